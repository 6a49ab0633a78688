"""Engine behaviour beyond the equations: bad input, mixed dtypes, fp32 accumulation, lifecycle."""

from __future__ import annotations

import contextlib

import pytest
import torch

from hf_acco import ACCOOptimizer, check_world_size
from hf_acco.tools.multiprocess import run_ranks

from .helpers import HostReads, clones
from .models import batch, mean_loss, tiny_llama, token_sum_loss


def _params():
    return tiny_llama().parameters()


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"micro_batches": 1}, "micro_batches must be >= 2; got 1. Use 2"),
        ({"micro_batches": 0, "schedule": "sync"}, "micro_batches must be >= 1"),
        ({"schedule": "sync", "accumulation": "dynamic"}, "Use accumulation='fixed' with 'sync'"),
        ({"schedule": "zero1"}, "schedule must be one of 'acco', 'dpu', 'sync'"),
        ({"accumulation": "adaptive"}, "accumulation must be one of 'fixed', 'dynamic'"),
        ({"accumulation": "dynamic", "min_micro_batches": 3, "max_micro_batches": 2}, "min_micro_batches"),
        ({"optimizer_cls": torch.optim.LBFGS}, "needs an element-wise optimizer"),
    ],
)
def test_bad_configuration_is_refused_before_any_collective(kwargs: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)")):
        ACCOOptimizer(_params(), lr=1e-3, **kwargs)


def test_no_trainable_parameters() -> None:
    model = tiny_llama()
    model.requires_grad_(False)
    with pytest.raises(ValueError, match="no trainable parameters"):
        ACCOOptimizer(model.parameters(), lr=1e-3)


def test_needs_torch_distributed() -> None:
    with pytest.raises(RuntimeError, match="torch.distributed is not initialised"):
        ACCOOptimizer(_params(), lr=1e-3)


def _world_size_message(rank: int, world_size: int) -> str:
    check_world_size(world_size)
    try:
        check_world_size(1)
    except RuntimeError as e:
        return str(e)
    return "no error"


def test_launcher_and_torch_distributed_disagree() -> None:
    got = run_ranks(_world_size_message)
    assert "torch.distributed has 2 ranks and the launcher started 2 (WORLD_SIZE), but Accelerate reports 1" in got[0]
    assert "ACCELERATE_USE_CPU=1" in got[0]


class MixedModel(torch.nn.Module):
    """An fp32 base with a bf16 trainable adapter, like LoRA adapters kept in another dtype."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.base = torch.nn.Linear(8, 8)
        self.adapter = torch.nn.Parameter(torch.randn(8, 8, dtype=torch.bfloat16) * 0.1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.base(x) + (x.bfloat16() @ self.adapter).float()


def _mixed(rank: int, world_size: int) -> dict:
    model = MixedModel()
    opt = ACCOOptimizer(model.parameters(), lr=1e-2, micro_batches=4)
    g = torch.Generator().manual_seed(rank)
    bf16_grads = []
    for _i in range(4):
        x = torch.randn(16, 8, generator=g)
        model(x).square().mean().backward()
        bf16_grads.append(opt.buffers.grad_views[id(model.adapter)].clone())
        opt.after_backward()
    accumulated = opt.buffers.grad_views[id(model.adapter)].clone()
    opt.step()
    for _i in range(8):
        model(torch.randn(16, 8, generator=g)).square().mean().backward()
        opt.after_backward()
        if opt.ready_to_step():
            opt.step()
    with opt.committed_parameters():
        final = clones(model)
    opt.close()
    return {"accumulated": accumulated, "views": bf16_grads, "final": final, "dtype": model.adapter.dtype}


def test_mixed_dtypes_accumulate_in_fp32() -> None:
    results = run_ranks(_mixed)
    for r in results:
        assert r["accumulated"].dtype == torch.float32
        # each micro-batch's bf16 gradient, recovered from the running fp32 sum
        steps = [r["views"][0]] + [b - a for a, b in zip(r["views"], r["views"][1:])]
        in_bf16 = torch.zeros_like(steps[0], dtype=torch.bfloat16)
        for s in steps:
            assert torch.equal(s, s.bfloat16().float())  # really bf16 gradients
            in_bf16 += s.bfloat16()
        assert torch.equal(r["accumulated"], r["views"][-1])
        assert not torch.equal(in_bf16.float(), r["accumulated"])  # a bf16 sum would have lost bits
        assert r["dtype"] == torch.bfloat16
        assert all(torch.isfinite(p.float()).all() for p in r["final"])
    assert all(torch.equal(a, b) for a, b in zip(results[0]["final"], results[1]["final"]))
    assert not torch.equal(results[0]["final"][2].float(), MixedModel().adapter.float())


def _close_and_misuse(rank: int, world_size: int) -> list[str]:
    model = tiny_llama()
    opt = ACCOOptimizer(model.parameters(), lr=1e-3, micro_batches=2)
    messages = []
    try:
        opt.step()
    except RuntimeError as e:
        messages.append(str(e))
    mean_loss(model, batch(rank, 0))[0].backward()
    opt.after_backward()
    state = opt.state_dict()  # mid-step: describes the last boundary
    try:
        opt.load_state_dict(state)
    except RuntimeError as e:
        messages.append(str(e))
    mean_loss(model, batch(rank, 1))[0].backward()
    opt.after_backward()
    opt.step()
    opt.state_dict()  # fine at a step boundary
    opt.close()
    return messages


def test_misuse_is_explained() -> None:
    messages = run_ranks(_close_and_misuse)[0]
    assert "before any micro-batch was accumulated" in messages[0]
    assert "between optimizer steps" in messages[1]


def _replaced_parameters(rank: int, world_size: int) -> str:
    model = tiny_llama()
    opt = ACCOOptimizer(model.parameters(), lr=1e-3, micro_batches=2)
    model.lm_head.weight = torch.nn.Parameter(model.lm_head.weight.detach().clone())  # hook lost
    for p in model.parameters():
        p.requires_grad_(False)
    model.lm_head.weight.requires_grad_(True)
    for i in range(2):
        mean_loss(model, batch(rank, i))[0].backward()
        opt.after_backward()
    try:
        opt.step()
    except RuntimeError as e:
        return str(e)
    return "no error"


def test_replaced_parameters_are_detected() -> None:
    assert "No gradient reached the ACCO optimizer" in run_ranks(_replaced_parameters)[0]


def _accumulation_ops(rank: int, world_size: int, schedule: str) -> dict:
    """The operations the main thread runs on the accumulation buffer in steady steps: in the gradient hooks and
    at the step boundaries (the round's thread is not counted)."""
    from torch.utils._python_dispatch import TorchDispatchMode

    model = tiny_llama()
    opt = ACCOOptimizer(model.parameters(), lr=1e-2, micro_batches=4, schedule=schedule)
    big = opt.layout.numel // 4  # larger than any one parameter: a pass over the whole buffer
    ops: list[tuple[str, int]] = []

    class Ops(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001, ANN204
            out = func(*args, **(kwargs or {}))
            first = args[0] if args and isinstance(args[0], torch.Tensor) else None
            if first is not None and first.dtype == torch.float32 and func.__name__.split(".")[0] in ACCUMULATION:
                ops.append((func.__name__.split(".")[0], first.numel()))
            return out

    for t in range(4):
        with Ops() if t >= 2 else contextlib.nullcontext():  # steady steps: the moments exist, rounds run
            for i in range(4):
                mean_loss(model, batch(rank, 4 * t + i))[0].backward()
                opt.after_backward()
            opt.step()
    opt.synchronize()
    params = len(list(model.parameters()))
    opt.close()
    return {"ops": ops, "params": params, "big": big}


ACCUMULATION = ("add_", "copy_", "zero_")


@pytest.mark.parametrize("schedule", ["acco", "sync"])
def test_a_steps_first_gradient_is_written_over_the_sums_no_zeroing_pass(schedule: str) -> None:
    """Between steps nothing zeroes the accumulation buffer: each parameter's first gradient of a step is copied
    over its view (read 2 bytes, write 4, instead of zeroing 4 then adding 6 + 4); the other three are added."""
    r = run_ranks(_accumulation_ops, schedule=schedule)[0]
    ops, params = r["ops"], r["params"]
    hooks = [(name, n) for name, n in ops if n < r["big"]]
    assert not [op for op in ops if op[0] == "zero_" and op[1] >= r["big"]], ops  # no pass over the buffer
    assert sum(name == "copy_" for name, _ in hooks) == 2 * params  # one per parameter and step (2 steps)
    assert sum(name == "add_" for name, _ in hooks) == 2 * 3 * params


def _host_reads_by_thread(rank: int, world_size: int, schedule: str, on_device: bool) -> dict:
    """Device reads (aten._local_scalar_dense: a host sync on a GPU) of the main thread in ``after_backward`` and
    ``step``, and of each round on its thread, over three steps with token weights and clipping."""
    from hf_acco.engine.rounds import RoundBody

    main: list[int] = []
    rounds: list[int] = []
    original = RoundBody.__call__

    def counted(self, *args, **kwargs):  # noqa: ANN001, ANN202
        rounds.append(0)
        with HostReads(rounds):
            return original(self, *args, **kwargs)

    RoundBody.__call__ = counted
    try:
        model = tiny_llama()
        # fused AdamW (Trainer's default optim): its step counts live on the device, and it reads none of them (the
        # one-tensor-at-a-time AdamW keeps them on the host, where a read is no device sync)
        opt = ACCOOptimizer(
            model.parameters(), lr=1e-2, micro_batches=4, schedule=schedule, max_grad_norm=0.5, fused=True
        )
        for t in range(3):
            for i in range(4):
                loss, tokens = token_sum_loss(model, batch(rank, 4 * t + i))
                loss.backward()
                weight = torch.tensor(float(tokens), dtype=torch.float64) if on_device else float(tokens)
                main.append(0)
                with HostReads(main):
                    opt.after_backward(weight)
            main.append(0)
            with HostReads(main):
                opt.step()
        opt.synchronize()
        weight = opt.last_commit.local_weight
        opt.close()
    finally:
        RoundBody.__call__ = original
    return {"main": main, "rounds": rounds, "weight": weight}


@pytest.mark.parametrize("on_device", [True, False])
@pytest.mark.parametrize("schedule", ["acco", "sync"])
def test_the_main_thread_never_reads_the_device_and_a_round_reads_it_once_or_twice(
    schedule: str, on_device: bool
) -> None:
    """A weight kept on the device is read by the round, on its thread (never by the main thread at a boundary,
    where a host sync would stall the compute); the round reads its global norm once (for the skip decision and
    the figure it reports). One read per round, two with a device weight."""
    r = run_ranks(_host_reads_by_thread, schedule=schedule, on_device=on_device)[0]
    assert r["main"] == [0] * len(r["main"]), r["main"]
    rounds = 6 if schedule == "acco" else 3
    assert r["rounds"] == [2 if on_device else 1] * rounds, r["rounds"]
    assert r["weight"] > 0  # this rank's weight (its tokens) in the last commit round, as the round read it


def _late_copy(rank: int, world_size: int, delay: float) -> dict:
    """acco on a bf16 model (fp32 sums, a bf16 wire: each hand-over is a cast copy) with the round's copy of the sums
    held back by ``delay`` seconds; the main thread's full-buffer copies at the boundaries are counted."""
    import time

    from torch.utils._python_dispatch import TorchDispatchMode

    from hf_acco.engine.handover import LentSums

    take = LentSums.take

    def late(self):  # noqa: ANN001, ANN202
        time.sleep(delay)  # the next half's backward reaches its hooks first
        return take(self)

    LentSums.take = late
    copies = [0]

    class Copies(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001, ANN204
            if func.__name__.startswith("copy_") and args[0].numel() >= opt.layout.numel:
                copies[0] += 1
            return func(*args, **(kwargs or {}))

    try:
        model = tiny_llama().to(torch.bfloat16)
        opt = ACCOOptimizer(model.parameters(), lr=1e-2, micro_batches=2, schedule="acco")
        for t in range(4):
            for i in range(2):
                mean_loss(model, batch(rank, 2 * t + i))[0].backward()
                with Copies():
                    opt.after_backward()
            with Copies():
                opt.step()
        opt.finalize()
        out = {"params": [p.detach().float().clone() for p in model.parameters()], "copies": copies[0]}
        opt.close()
    finally:
        LentSums.take = take
    return out


def test_the_round_copies_the_sums_and_the_next_half_waits_for_it() -> None:
    """The cast copy of a half's sums into the round's buffer is the round's (off the main thread and stream), and
    the next half's gradients are added into ``accum`` only after it: a copy held back by 0.3 s gives the same
    parameters, bit for bit (half B's gradients never leak into half A's estimate)."""
    prompt, late = (run_ranks(_late_copy, delay=d)[0] for d in (0.0, 0.3))
    assert prompt["copies"] == late["copies"] == 0  # no full-buffer copy on the main thread at a boundary
    assert all(torch.equal(a, b) for a, b in zip(prompt["params"], late["params"]))


def _integer_weights(rank: int, world_size: int) -> tuple[float, float]:
    model = tiny_llama()
    opt = ACCOOptimizer(model.parameters(), lr=1e-2, micro_batches=2, schedule="sync")
    for i, tokens in enumerate((2**24, 1)):  # int64 counts on the device, as a hand-written loop may pass them
        mean_loss(model, batch(rank, i))[0].backward()
        opt.after_backward(torch.tensor(tokens))
    opt.step()
    opt.synchronize()
    figures = opt.last_commit.local_weight, opt.last_commit.weight
    opt.close()
    return figures


def test_weights_kept_on_the_device_are_summed_exactly() -> None:
    """A half's device weights are summed in float64 where they are (2^24 + 1 is not a float32)."""
    assert run_ranks(_integer_weights)[0] == (2**24 + 1, 2 * (2**24 + 1))
