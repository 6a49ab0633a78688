"""ACCOTrainer where DDP + AdamW leave parameters or buffers alone, against Trainer + DDP on 2 forked ranks (same
data and seeds, tests/scripts/dropin_script.py): parameters with no gradient in a step (a tower, experts of a
mixture) and BatchNorm's running statistics (``ddp_broadcast_buffers``)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from hf_acco.tools.multiprocess import run_ranks

from .helpers import rel
from .scripts import dropin_script

GA = 2  # micro-batches per optimizer step and rank, in the script


def _run(rank: int, world_size: int, **kwargs) -> dict:
    return dropin_script.run(rank, world_size, **kwargs)


def train(out: Path, kind: str, acco: bool, use_b: float = 0.0, **extra) -> list[dict]:
    if acco:
        extra.setdefault("acco_schedule", "sync")
    return run_ranks(_run, world_size=2, backend=None, timeout=240, out=str(out), kind=kind, acco=acco, extra=extra,
                     use_b=use_b)  # fmt: skip


def flat(values: dict[str, torch.Tensor], part: str = "") -> torch.Tensor:
    return torch.cat([v.flatten().float() for n, v in values.items() if part in n])


@pytest.mark.parametrize("use_b", [0.0, 0.15], ids=["never", "some_steps_and_ranks"])
def test_a_tower_without_gradient_is_left_alone_as_ddp_leaves_it(tmp_path: Path, use_b: float) -> None:
    ddp = train(tmp_path / "ddp", "towers", acco=False, use_b=use_b)
    ours = train(tmp_path / "acco", "towers", acco=True, use_b=use_b)
    assert ours[0]["losses"] == pytest.approx(ddp[0]["losses"], rel=1e-5)
    assert rel(flat(ours[0]["params"]), flat(ddp[0]["params"])) < 1e-5
    assert rel(flat(ours[0]["params"], "tower_b"), flat(ddp[0]["params"], "tower_b")) < 1e-5
    assert torch.equal(flat(ours[0]["params"]), flat(ours[1]["params"]))
    used = [[any(r["used_b"][GA * t : GA * t + GA]) for r in ours] for t in range(12)]
    if use_b == 0.0:
        initial = dropin_script.build("towers", 0.0)[0]
        assert torch.equal(flat(ours[0]["params"], "tower_b"), flat(dict(initial.named_parameters()), "tower_b"))
    else:  # the data made every case: unused on every rank, used on one rank only, used on both
        assert [False, False] in used and [True, True] in used
        assert [True, False] in used or [False, True] in used


def test_acco_trainer_makes_no_per_step_copy_of_the_model_to_the_host(tmp_path: Path) -> None:
    """Trainer saves at step boundaries only: the acco engine it builds keeps no boundary copy (no device-to-host
    copy of the model shard at every step), and trains as the reference says (the tower test's DDP closeness is
    sync's; here the acco run's losses fall and its ranks agree)."""
    ours = train(tmp_path / "acco", "towers", acco=True, use_b=0.15, acco_schedule="acco")
    assert [r["boundary_copy"] for r in ours] == [False, False]
    assert torch.equal(flat(ours[0]["params"]), flat(ours[1]["params"]))
    assert ours[0]["losses"][-1] < ours[0]["losses"][0]


def test_experts_that_receive_no_row_are_left_alone_as_ddp_leaves_them(tmp_path: Path) -> None:
    ddp = train(tmp_path / "ddp", "experts", acco=False)
    ours = train(tmp_path / "acco", "experts", acco=True)
    assert rel(flat(ours[0]["params"]), flat(ddp[0]["params"])) < 1e-5
    assert ours[0]["losses"] == pytest.approx(ddp[0]["losses"], rel=1e-5)
    experts = len(dropin_script.ExpertsMoE().experts)
    hit_per_step = [set().union(*(h for r in ours for h in r["hit"][GA * t : GA * t + GA])) for t in range(12)]
    assert any(len(h) < experts for h in hit_per_step)  # some expert got no row in some step


def test_mixtral_fused_experts_equal_ddp(tmp_path: Path) -> None:
    """transformers' Mixtral holds its experts in one tensor: an expert without a token gets zeros inside a gradient
    that exists, so DDP steps the whole tensor, and so does ACCO."""
    ddp = train(tmp_path / "ddp", "mixtral", acco=False)
    ours = train(tmp_path / "acco", "mixtral", acco=True)
    assert rel(flat(ours[0]["params"]), flat(ddp[0]["params"])) < 1e-5


@pytest.mark.parametrize("broadcast", [None, False], ids=["broadcast_unset", "broadcast_false"])
def test_batchnorm_buffers_and_evaluation_equal_ddp(tmp_path: Path, broadcast: bool | None) -> None:
    extra = {} if broadcast is None else {"ddp_broadcast_buffers": broadcast}
    ddp = train(tmp_path / "ddp", "batchnorm", acco=False, **extra)
    ours = train(tmp_path / "acco", "batchnorm", acco=True, **extra)
    for r in range(2):  # each rank's running statistics are DDP's same rank's (rank 0's broadcast, then its own)
        assert rel(flat(ours[r]["buffers"]), flat(ddp[r]["buffers"])) < 1e-5
        assert ours[r]["eval_loss"] == pytest.approx(ddp[r]["eval_loss"], rel=1e-5)
    assert rel(flat(ours[0]["params"]), flat(ddp[0]["params"])) < 1e-5
    # the broadcast is what keeps them DDP's: without it each rank's statistics drift apart further
    apart = rel(flat(ours[0]["buffers"], "running_mean"), flat(ours[1]["buffers"], "running_mean"))
    assert apart > 0
