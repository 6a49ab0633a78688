"""Checkpoints without a shared file system (``save_on_each_node=True``, one directory per machine): each machine's
checkpoint is complete for the ranks that read it, the ranks agree on the one to resume from, and a resume on another
number of ranks says how to gather the shards first (2 forked ranks, each its own "machine")."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch

from hf_acco.engine.checkpoint import shard_filename
from hf_acco.tools.checkpoint_cli import main as checkpoint_cli

from .helpers import rel
from .test_trainer import flat, train

PER_NODE = {"save_steps": 4, "machine_per_rank": True, "extra": {"save_on_each_node": True}}


def steps_computed(result: dict) -> float:
    """Optimizer steps this run computed (2 rows per micro-batch, 4 micro-batches per step and rank)."""
    return len(result["rows"]) / 8


@pytest.fixture(scope="module")
def straight(tmp_path_factory) -> tuple[Path, list[dict]]:
    """8 steps with a checkpoint at 4 and 8 on each machine: the uninterrupted run, and its directories."""
    out = tmp_path_factory.mktemp("straight")
    return out, train(out, acco=True, max_steps=8, **PER_NODE)


def _copy(straight: tuple[Path, list[dict]], tmp_path: Path) -> Path:
    shutil.copytree(straight[0], tmp_path / "run")
    return tmp_path / "run"


def test_each_machine_resumes_from_its_own_directory(tmp_path: Path, straight) -> None:
    out = _copy(straight, tmp_path)
    for rank in range(2):
        files = {p.name for p in (out / f"node{rank}" / "checkpoint-4").iterdir()}
        assert {shard_filename(rank, 2), "model.safetensors", "trainer_state.json"} <= files, files
        assert shard_filename(1 - rank, 2) not in files  # the other machine's shard is not here
        shutil.rmtree(out / f"node{rank}" / "checkpoint-8")  # pre-empted before the checkpoint of step 8
    resumed = train(out, acco=True, max_steps=8, resume="last", **PER_NODE)
    for r in range(2):
        assert steps_computed(resumed[r]) == 4  # steps 5 to 8
        assert torch.equal(flat(resumed[r]["params"]), flat(straight[1][r]["params"]))


def test_a_checkpoint_incomplete_on_one_machine_is_skipped_by_every_rank(tmp_path: Path, straight) -> None:
    out = _copy(straight, tmp_path)
    (out / "node1" / "checkpoint-8" / shard_filename(1, 2)).unlink()  # machine 1 lost its shard of step 8
    resumed = train(out, acco=True, max_steps=8, resume="last", **PER_NODE)
    for r in range(2):  # both from step 4: none from 8
        assert steps_computed(resumed[r]) == 4
        assert torch.equal(flat(resumed[r]["params"]), flat(straight[1][r]["params"]))


def test_another_number_of_ranks_needs_the_shards_gathered(tmp_path: Path, straight) -> None:
    out = _copy(straight, tmp_path)
    checkpoint = out / "node0" / "checkpoint-4"
    extra = {"save_on_each_node": True, "gradient_accumulation_steps": 8}  # the same global batch on one rank
    options = {"max_steps": 8, "resume": str(checkpoint), "extra": extra}
    with pytest.raises(RuntimeError, match="Gather every node's shards"):
        train(tmp_path / "one", acco=True, world_size=1, **options)
    checkpoint_cli(["gather", "--into", str(checkpoint), str(out / "node1" / "checkpoint-4")])
    alone = train(tmp_path / "one", acco=True, world_size=1, **options)
    assert len(alone[0]["rows"]) == 4 * 8 * 2  # steps 5 to 8, 8 micro-batches of 2 rows each
    assert rel(flat(alone[0]["params"]), flat(straight[1][0]["params"])) < 1e-5


def test_a_skipped_checkpoint_is_reported_with_the_rank_and_node_that_saw_it(
    tmp_path: Path, monkeypatch, caplog
) -> None:
    """On a per-node checkpoint each machine judges its own copy: the warning says which rank and node did."""
    from hf_acco.integrations.trainer import TRAINER_STATE_NAME, complete_checkpoints

    (tmp_path / "checkpoint-4").mkdir()
    (tmp_path / "checkpoint-4" / TRAINER_STATE_NAME).write_text("{}")  # readable, but only rank 0's shard is here
    (tmp_path / "checkpoint-4" / shard_filename(0, 2)).write_bytes(b"")
    monkeypatch.setenv("GROUP_RANK", "1")
    with caplog.at_level("WARNING", logger="hf_acco.integrations.trainer"):
        assert complete_checkpoints(str(tmp_path), world_size=2, ranks=[1]) == {}
    assert "checkpoint-4 (on rank 1, node 1, " in caplog.text and "shards of ranks [1] (of 2)" in caplog.text


def test_a_replaced_machine_rebuilds_the_shards_it_lost_and_training_goes_on(tmp_path: Path, straight) -> None:
    """Machine 1 is replaced after step 4's checkpoint, its disk empty: its checkpoint is copied from machine 0 (the
    model files are the same everywhere, the optimizer shard is machine 0's own), ``python -m hf_acco.checkpoint
    rebuild`` writes rank 1's shard from the model weights, and both ranks resume. Rank 0's state is exact; rank 1's
    master is exact (an fp32 model) and its moments restart, so the run stays close to the uninterrupted one."""
    out = _copy(straight, tmp_path)
    shutil.rmtree(out / "node0" / "checkpoint-8")
    shutil.rmtree(out / "node1")  # the replaced machine: nothing of machine 1 survives
    shutil.copytree(out / "node0" / "checkpoint-4", out / "node1" / "checkpoint-4")
    with pytest.raises(RuntimeError, match="No valid checkpoint found"):  # rank 1's shard is nowhere
        train(out, acco=True, max_steps=8, resume="last", **PER_NODE)
    checkpoint_cli(["rebuild", str(out / "node1" / "checkpoint-4")])
    lost, kept = (torch.load(out / f"node{n}" / "checkpoint-4" / shard_filename(r, 2)) for n, r in ((1, 1), (0, 0)))
    original = torch.load(straight[0] / "node1" / "checkpoint-4" / shard_filename(1, 2))
    assert lost["rebuilt"] and torch.equal(lost["master"], original["master"])  # from the fp32 weights: exact
    assert all(not v.any() for v in lost["optim_state"].values()) and kept["optim_state"]["exp_avg"].any()
    resumed = train(out, acco=True, max_steps=8, resume="last", **PER_NODE)
    for r in range(2):
        assert steps_computed(resumed[r]) == 4  # steps 5 to 8
    assert torch.equal(flat(resumed[0]["params"]), flat(resumed[1]["params"]))
    gap = rel(flat(resumed[0]["params"]), flat(straight[1][0]["params"]))
    assert 0 < gap < 0.05, gap  # half the moments restarted at step 4: close to the uninterrupted run, not equal
    with pytest.raises(SystemExit):  # a surviving shard is never overwritten
        checkpoint_cli(["rebuild", str(out / "node1" / "checkpoint-4"), "--ranks", "0"])
