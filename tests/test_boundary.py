"""What the main thread does at a step boundary, and where evaluation keeps the training parameters (2 gloo ranks).

On a GPU a shard-sized copy at the step boundary runs on the main stream: compute and the commit round both wait for
it. The rule shown here on CPU: between ``step()`` and the next forward the main thread makes no tensor of a
shard's size (no device-to-host copy of the shard, no shard-sized temporary); the boundary's model shard is copied
on the commit round's thread, and a mid-step checkpoint still describes the boundary (tests/test_resume.py).
"""

from __future__ import annotations

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from hf_acco import ACCOOptimizer
from hf_acco.tools.multiprocess import run_ranks

from .helpers import clones
from .models import batch, decay_groups, mean_loss, tiny_llama

HP = {"lr": 1e-2, "betas": (0.9, 0.95)}


class Sizes(TorchDispatchMode):
    """The element counts of every tensor the ops of this thread write (allocations and copies; views left out)."""

    def __init__(self) -> None:
        super().__init__()
        self.made: list[tuple[str, int]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001, ANN204 - torch's protocol
        out = func(*args, **(kwargs or {}))
        if func.is_view:
            return out
        for t in out if isinstance(out, (tuple, list)) else [out]:
            if torch.is_tensor(t):
                self.made.append((str(func), t.numel()))
        return out


def _engine(schedule: str, bf16: bool = False) -> tuple[torch.nn.Module, ACCOOptimizer]:
    model = tiny_llama()
    if bf16:
        model = model.to(torch.bfloat16)
    opt = ACCOOptimizer(decay_groups(model, 0.1), schedule=schedule, micro_batches=4, max_grad_norm=0.5, **HP)
    return model, opt


def _micro_batches(model, opt, rank: int, t: int) -> None:
    for i in range(4):
        mean_loss(model, batch(rank, 4 * t + i))[0].backward()
        opt.after_backward()


def boundary_ops(rank: int, world_size: int, schedule: str, bf16: bool) -> list[tuple[str, int]]:
    model, opt = _engine(schedule, bf16)
    assert opt.layout.shard_numel not in {p.numel() for p in model.parameters()}  # else the count means nothing
    shard_sized = []
    for t in range(4):
        _micro_batches(model, opt, rank, t)
        with Sizes() as sizes:
            opt.step()
        shard = opt.layout.shard_numel  # (the full-size buffers are twice that: zeroing one is not a copy)
        shard_sized += [(op, n) for op, n in sizes.made if shard // 2 <= n <= shard]
    opt.close()
    return shard_sized


@pytest.mark.parametrize(("schedule", "bf16"), [("acco", False), ("acco", True), ("dpu", False), ("sync", True)])
def test_no_shard_sized_tensor_on_the_main_thread_at_a_step_boundary(schedule: str, bf16: bool) -> None:
    for made in run_ranks(boundary_ops, schedule=schedule, bf16=bf16):
        assert made == [], made


def eval_at(rank: int, world_size: int, where: str) -> dict:
    model, opt = _engine("acco")
    plain_model, plain = _engine("acco")  # the same run without evaluation
    for t in range(3):
        _micro_batches(model, opt, rank, t)
        opt.step()
        _micro_batches(plain_model, plain, rank, t)
        plain.step()
    held = clones(model)
    if where == "mid-step":  # half A: the accumulation buffer holds its gradients
        for i in range(1):
            mean_loss(model, batch(rank, 12 + i))[0].backward()
            opt.after_backward()
            mean_loss(plain_model, batch(rank, 12 + i))[0].backward()
            plain.after_backward()
        held = clones(model)
    padded = opt.layout.padded_numel
    with Sizes() as sizes:
        opt.eval()
    in_accum = opt.buffers.eval_backup is opt.buffers.accum
    full_size_made = [op for op, n in sizes.made if n == padded]
    with pytest.raises(RuntimeError, match="in eval mode"):
        mean_loss(model, batch(rank, 99))[0].backward()  # the buffer holds the parameters: refused
    evaluated = clones(model)
    opt.train()
    restored = all(torch.equal(a, p) for a, p in zip(held, model.parameters()))
    # accum is back to gradients: no view counts as holding sums (what it still holds is overwritten by the next
    # gradients, or zeroed before a round reads it)
    accum_zero = where == "mid-step" or (not any(opt.buffers.written) and opt.buffers.stale)
    start = 1 if where == "mid-step" else 0
    for i in range(start, 4):
        mean_loss(model, batch(rank, 12 + i))[0].backward()
        opt.after_backward()
        mean_loss(plain_model, batch(rank, 12 + i))[0].backward()
        plain.after_backward()
    opt.step()
    plain.step()
    with opt.committed_parameters(), plain.committed_parameters():
        same = all(torch.equal(a, b) for a, b in zip(model.parameters(), plain_model.parameters()))
        committed = clones(model)
    moved = any(not torch.equal(a, b) for a, b in zip(evaluated, held))
    opt.close()
    plain.close()
    return {
        "in_accum": in_accum,
        "full_size_made": full_size_made,
        "restored": restored,
        "accum_zero": accum_zero,
        "same_as_without_eval": same,
        "evaluated_committed": moved,
        "final": committed,
    }


@pytest.mark.parametrize("where", ["boundary", "mid-step"])
def test_evaluation_keeps_the_training_parameters_on_the_device_at_a_step_boundary(where: str) -> None:
    """At a step boundary (where Trainer evaluates and saves) the accumulation buffer is free: the training
    parameters wait there, no full-size host buffer (pinned on a GPU) is made. In the middle of a step (hand-written
    loops) they go to the host. Either way training goes on exactly as without the evaluation."""
    for r in run_ranks(eval_at, where=where):
        assert r["in_accum"] is (where == "boundary")
        if where == "boundary":
            assert r["full_size_made"] == []
        assert r["restored"] and r["accum_zero"] and r["same_as_without_eval"] and r["evaluated_committed"]


def state_in_eval(rank: int, world_size: int, schedule: str) -> bool:
    model, opt = _engine(schedule)
    for t in range(3):
        _micro_batches(model, opt, rank, t)
        opt.step()
    outside = opt.state_dict()["model"]
    with opt.committed_parameters():  # the model holds θ; the boundary's parameters wait elsewhere
        inside = opt.state_dict()["model"]
    opt.close()
    return torch.equal(outside, inside)


@pytest.mark.parametrize("schedule", ["acco", "dpu"])
def test_a_state_dict_taken_while_evaluating_describes_the_boundary(schedule: str) -> None:
    assert all(run_ranks(state_in_eval, schedule=schedule))


def paced_boundary_in_eval(rank: int, world_size: int, evaluate: bool) -> list[torch.Tensor]:
    """Paced steps (ACCOTrainer's dynamic mode): rank 1 computes nothing in step 2, and reaches its boundaries right
    after an evaluation, before any micro-batch would have called train()."""
    model = tiny_llama()
    opt = ACCOOptimizer(decay_groups(model, 0.1), accumulation="paced", max_grad_norm=0.5, **HP)
    for t in range(4):
        idle = rank == 1 and t == 2
        if evaluate and t == 2:
            opt.eval()  # at a step boundary: the training parameters wait in the accumulation buffer
        for half in range(2):
            if not idle:
                if evaluate and t == 2:
                    opt.train()
                mean_loss(model, batch(rank, 4 * t + half))[0].backward()
                opt.after_backward()
            opt.end_half() if half == 0 else opt.end_step()
    with opt.committed_parameters():
        out = clones(model)
    opt.close()
    return out


def test_a_paced_boundary_right_after_an_evaluation_trains_as_without_it() -> None:
    plain = run_ranks(paced_boundary_in_eval, evaluate=False)
    evaluated = run_ranks(paced_boundary_in_eval, evaluate=True)
    for a, b in zip(plain, evaluated):
        assert all(torch.equal(x, y) for x, y in zip(a, b))
