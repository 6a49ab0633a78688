"""Parameters that get no gradient in an optimizer step: left alone as DDP + torch's AdamW leave them (no weight
decay, no moment update, their own step count unchanged), under every schedule, against DDP and the reference.

The model has two towers; tower B runs on a micro-batch only where the test's pattern says so: never, in some steps
only, on some ranks only, in one half of an ACCO step only.
"""

from __future__ import annotations

import pytest
import torch

from hf_acco import ACCOOptimizer, consolidate_state_dicts
from hf_acco.tools.multiprocess import run_ranks

from .helpers import rel
from .reference import Reference, run_acco, run_dpu, run_sync

STEPS, MICRO = 12, 4
LR, DECAY = 3e-2, 0.1


class Towers(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.a = torch.nn.Sequential(torch.nn.Linear(6, 12), torch.nn.Tanh(), torch.nn.Linear(12, 1))
        self.b = torch.nn.Sequential(torch.nn.Linear(6, 12), torch.nn.Tanh(), torch.nn.Linear(12, 1))

    def forward(self, x: torch.Tensor, use_b: bool) -> torch.Tensor:
        out = self.a(x)
        return out + self.b(x) if use_b else out


def micro_batch(rank: int, step: int, i: int) -> dict:
    g = torch.Generator().manual_seed(10_000 * rank + 100 * step + i)
    x = torch.randn(4, 6, generator=g)
    return {"x": x, "y": torch.tanh(x[:, :1] - x[:, 1:2])}


# patterns: (rank, step, micro-batch) -> does tower B run
PATTERNS = {
    "never": lambda r, t, i: False,
    "some_steps": lambda r, t, i: t % 3 == 1,
    "some_ranks": lambda r, t, i: t % 3 == 1 or (t % 3 == 2 and r == 1 and i == 3),
    "one_half": lambda r, t, i: (t % 4 == 1 and i < MICRO // 2) or (t % 4 == 2 and i >= MICRO // 2),
}


def loss_of(pattern: str):
    def loss(model: torch.nn.Module, b: dict) -> tuple[torch.Tensor, float]:
        return torch.nn.functional.mse_loss(model(b["x"], PATTERNS[pattern](*b["at"])), b["y"]), 1.0

    return loss


def groups(model: torch.nn.Module) -> list[dict]:
    decay = [p for p in model.parameters() if p.ndim >= 2]
    return [{"params": decay, "weight_decay": DECAY}, {"params": [p for p in model.parameters() if p.ndim < 2],
                                                      "weight_decay": 0.0}]  # fmt: skip


def _batches(rank: int) -> list[list[dict]]:
    return [[{**micro_batch(rank, t, i), "at": (rank, t, i)} for i in range(MICRO)] for t in range(STEPS)]


def _acco(rank: int, world_size: int, pattern: str, schedule: str, resume_at: int = 0) -> dict:
    model = Towers()
    loss = loss_of(pattern)

    def build() -> ACCOOptimizer:
        return ACCOOptimizer(groups(model), lr=LR, schedule=schedule, micro_batches=MICRO, max_grad_norm=1.0)

    opt = build()
    saved = None
    for t, step in enumerate(_batches(rank)):
        if resume_at and t == resume_at:  # a new engine from the checkpoint of this boundary (a fresh process would)
            saved = opt.state_dict()
            opt.close()
            model = Towers()
            opt = build()
            opt.load_state_dict(saved)
        for b in step:
            loss(model, b)[0].backward()
            opt.after_backward()
        opt.step()
    opt.finalize()
    out = {"params": [p.detach().clone() for p in model.parameters()]}
    if saved is not None:
        out["saved"] = saved
    return out


def _ddp(rank: int, world_size: int, pattern: str) -> list[torch.Tensor]:
    model = Towers()
    ddp = torch.nn.parallel.DistributedDataParallel(model, find_unused_parameters=True)
    opt = torch.optim.AdamW(groups(model), lr=LR)
    loss = loss_of(pattern)
    for step in _batches(rank):
        for i, b in enumerate(step):
            if i < MICRO - 1:
                with ddp.no_sync():
                    (loss(ddp, b)[0] / MICRO).backward()
            else:
                (loss(ddp, b)[0] / MICRO).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
    return [p.detach().clone() for p in model.parameters()]


def _reference(pattern: str, schedule: str, world_size: int) -> list[torch.Tensor]:
    model = Towers()
    ref = Reference(model, groups(model), torch.optim.AdamW, 1.0, loss_of(pattern), lr=LR)
    per_rank = [_batches(r) for r in range(world_size)]
    if schedule == "acco":
        steps = [[(per_rank[r][t][: MICRO // 2], per_rank[r][t][MICRO // 2 :]) for r in range(world_size)]
                 for t in range(STEPS)]  # fmt: skip
        return run_acco(ref, steps)[-1]
    steps = [[per_rank[r][t] for r in range(world_size)] for t in range(STEPS)]
    return (run_sync if schedule == "sync" else run_dpu)(ref, steps)[-1]


def _tower_b(params: list[torch.Tensor]) -> list[torch.Tensor]:
    return params[4:]


@pytest.mark.parametrize(("pattern", "world_size"), [("never", 2), ("some_steps", 2), ("some_ranks", 3)])
def test_sync_equals_ddp_with_adamw_where_a_tower_gets_no_gradient(pattern: str, world_size: int) -> None:
    ours = run_ranks(_acco, world_size=world_size, pattern=pattern, schedule="sync")
    ddp = run_ranks(_ddp, world_size=world_size, pattern=pattern)
    assert rel(ours[0]["params"], ddp[0]) < 1e-5
    assert all(torch.equal(a, b) for r in ours[1:] for a, b in zip(r["params"], ours[0]["params"]))
    if pattern == "never":  # untouched to the bit: no weight decay, no momentum
        assert all(
            torch.equal(a, b) for a, b in zip(_tower_b(ours[0]["params"]), _tower_b(list(Towers().parameters())))
        )


@pytest.mark.parametrize("pattern", ["some_ranks", "one_half"])
@pytest.mark.parametrize("schedule", ["acco", "dpu", "sync"])
def test_every_schedule_equals_the_reference_with_the_same_rule(schedule: str, pattern: str) -> None:
    ours = run_ranks(_acco, world_size=2, pattern=pattern, schedule=schedule)
    expected = _reference(pattern, schedule, 2)
    assert rel(ours[0]["params"], expected) < 1e-5
    assert rel(_tower_b(ours[0]["params"]), _tower_b(expected)) < 1e-5


def test_the_rule_is_what_makes_the_difference() -> None:
    """Without the rule (every parameter stepped each step) tower B would differ from the reference: the test
    above can fail."""
    expected = _reference("some_steps", "sync", 1)
    model = Towers()
    opt = torch.optim.AdamW(groups(model), lr=LR)
    loss = loss_of("some_steps")
    for step in _batches(0):
        for p in model.parameters():
            p.grad = torch.zeros_like(p)  # a zeroed buffer: every parameter has a gradient
        for b in step:
            (loss(model, b)[0] / MICRO).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
    assert rel(_tower_b([p.detach() for p in model.parameters()]), _tower_b(expected)) > 1e-3


@pytest.mark.parametrize("schedule", ["acco", "sync"])
def test_resume_is_exact_with_parameters_left_out_before_the_checkpoint(schedule: str) -> None:
    """Tower B is left out of steps 0, 3, 4, 6, 7, ... : at step 5 its step count is behind tower A's."""
    straight = run_ranks(_acco, world_size=2, pattern="some_steps", schedule=schedule)
    resumed = run_ranks(_acco, world_size=2, pattern="some_steps", schedule=schedule, resume_at=5)
    for r in range(2):
        assert all(torch.equal(a, b) for a, b in zip(resumed[r]["params"], straight[r]["params"]))
    steps = consolidate_state_dicts([r["saved"] for r in resumed])["optim_param_scalars"]["step"]
    model = Towers()
    in_b = {id(p) for p in model.b.parameters()}
    order = [p for g in groups(model) for p in g["params"]]  # the layout's order: the groups' order
    expected = [2.0 if id(p) in in_b else 5.0 for p in order]  # tower A stepped 5 times, tower B twice (1 and 4)
    assert steps.tolist() == expected
    held = [r["saved"]["optim_param_scalars"]["step"] for r in resumed]  # each rank: the parameters it holds
    assert all(torch.isnan(h).any() for h in held) and not torch.isnan(held[0]).all()


def _never_used(rank: int, world_size: int, schedule: str, settings: dict) -> list[torch.Tensor]:
    model = Towers()
    opt = ACCOOptimizer(groups(model), lr=LR, schedule=schedule, micro_batches=MICRO, **settings)
    loss = loss_of("never")
    for step in _batches(rank):
        for b in step:
            loss(model, b)[0].backward()
            opt.after_backward()
        opt.step()
    opt.finalize()
    return [p.detach().clone() for p in model.parameters()]


@pytest.mark.parametrize(
    "settings",
    [{}, {"comm_dtype": "int8", "error_feedback": True}, {"gather_dtype": "int8"}, {"comm_dtype": "bf16"}],
    ids=["fp32", "int8_feedback", "int8_gather", "bf16"],
)
def test_a_tower_never_used_stays_bit_identical_under_acco_on_every_wire(settings: dict) -> None:
    ours = run_ranks(_never_used, world_size=2, schedule="acco", settings=settings)
    initial = _tower_b(list(Towers().parameters()))
    assert all(torch.equal(a, b) for r in ours for a, b in zip(_tower_b(r), initial))
    assert not torch.equal(ours[0][0], next(Towers().parameters()))  # tower A did train


def _without_boundary_copy(rank: int, world_size: int, boundary_copy: bool) -> dict:
    model = Towers()
    opt = ACCOOptimizer(groups(model), lr=LR, micro_batches=MICRO, boundary_copy=boundary_copy)
    loss = loss_of("some_steps")
    states, error = [], None
    for t, step in enumerate(_batches(rank)[:6]):
        for i, b in enumerate(step):
            loss(model, b)[0].backward()
            opt.after_backward()
            if t == 3 and i == MICRO // 2:  # after the half boundary: the model holds θ_t, not the boundary's θ̃
                try:
                    opt.state_dict()
                except RuntimeError as e:
                    error = str(e)
        opt.step()
        states.append(opt.state_dict()["model"])  # at a step boundary: the model's own
    opt.finalize()
    return {"states": states, "error": error, "copy": opt._boundary.copy is not None,
            "params": [p.detach().clone() for p in model.parameters()]}  # fmt: skip


def test_without_the_boundary_copy_checkpoints_at_step_boundaries_are_the_same_and_mid_step_ones_are_refused() -> None:
    kept = run_ranks(_without_boundary_copy, boundary_copy=True)
    lean = run_ranks(_without_boundary_copy, boundary_copy=False)
    assert [r["copy"] for r in kept] == [True, True] and [r["copy"] for r in lean] == [False, False]
    for a, b in zip(kept, lean):
        assert all(torch.equal(x, y) for x, y in zip(a["states"], b["states"]))
        assert all(torch.equal(x, y) for x, y in zip(a["params"], b["params"]))
    assert kept[0]["error"] is None
    assert "boundary_copy=True" in lean[0]["error"] and "Save at a step boundary" in lean[0]["error"]
