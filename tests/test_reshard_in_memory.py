"""Re-sharding the engine's state in memory (``engine/reshard.py``) when a rank leaves at a step boundary: 3 gloo
ranks train, the leaving rank hands its shard over point to point, the 2 that stay re-shard without files and go on
in a new 2-rank world. Their state is the one a 3 -> 2 resume from the checkpoint files gives, bit for bit, and so
are the steps after it."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from hf_acco.engine.checkpoint import load_optimizer_state, save_optimizer_state
from hf_acco.engine.reshard import reshard_in_memory
from hf_acco.engine.shard_files import read_shard, shard_files
from hf_acco.engine.shard_state import reshard
from hf_acco.tools.multiprocess import run_ranks

from .test_resume import build, run_steps, snapshot

VIRTUAL, BEFORE, AFTER = 12, 5, 10  # 12 virtual ranks deal evenly to 3 and 2: the same micro-batches per step


def _equal_states(a: object, b: object, where: str = "state") -> None:
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b), where
    elif isinstance(a, dict):
        assert isinstance(b, dict) and sorted(a) == sorted(b), (where, sorted(a), sorted(b))
        for k in a:
            _equal_states(a[k], b[k], f"{where}.{k}")
    elif isinstance(a, (list, tuple)):
        assert type(a) is type(b) and len(a) == len(b), where
        for i, (x, y) in enumerate(zip(a, b)):
            _equal_states(x, y, f"{where}[{i}]")
    else:
        assert a == b, (where, a, b)


def _leave_and_go_on(rank: int, world_size: int, checkpoint: str, rendezvous: str) -> dict:
    model, opt = build(world_size, "acco", virtual=VIRTUAL)
    run_steps(model, opt, rank, world_size, 0, BEFORE, VIRTUAL)
    save_optimizer_state(opt, checkpoint)  # what the reference resumes from
    state, layout = opt.state_dict(), opt.layout.resized(2)
    opt.close()
    stays = rank < 2
    moved = reshard_in_memory([state], layout, rank if stays else None)  # over the 3-rank world
    dist.destroy_process_group()
    if not stays:
        return {"moved": moved}
    from_files = reshard([read_shard(p) for _, p in sorted(shard_files(checkpoint)[3].items())], layout, rank)
    _equal_states(moved, from_files)  # the checkpoint path's state, bit for bit
    dist.init_process_group("gloo", store=dist.FileStore(rendezvous, 2), rank=rank, world_size=2)  # the new world
    _, again = build(2, "acco", virtual=VIRTUAL, model=model)  # the same model, a new engine on 2 ranks
    again.load_state_dict(moved)
    run_steps(model, again, rank, 2, BEFORE, AFTER, VIRTUAL)
    out = snapshot(model, again)
    again.close()
    return out


def _resume(rank: int, world_size: int, checkpoint: str) -> dict:
    model, opt = build(world_size, "acco", seed=123, virtual=VIRTUAL)  # other weights: all comes from the files
    load_optimizer_state(opt, checkpoint)
    run_steps(model, opt, rank, world_size, BEFORE, AFTER, VIRTUAL)
    out = snapshot(model, opt)
    opt.close()
    return out


def test_two_ranks_that_stay_reshard_in_memory_and_go_on_as_a_resume_from_files(tmp_path: Path) -> None:
    checkpoint = tmp_path / "checkpoint"
    live = run_ranks(_leave_and_go_on, world_size=3, checkpoint=str(checkpoint), rendezvous=str(tmp_path / "rdzv"))
    assert live[2] == {"moved": None}
    resumed = run_ranks(_resume, world_size=2, checkpoint=str(checkpoint))
    for r in range(2):
        for key in ("committed", "held"):
            assert all(torch.equal(a, b) for a, b in zip(live[r][key], resumed[r][key])), (r, key)
    assert all(torch.equal(a, b) for a, b in zip(live[0]["committed"], live[1]["committed"]))


def _incomplete(rank: int, world_size: int) -> str:
    model, opt = build(world_size, "acco", virtual=VIRTUAL)
    run_steps(model, opt, rank, world_size, 0, 1, VIRTUAL)
    state, layout = opt.state_dict(), opt.layout.resized(2)
    opt.close()
    held = [] if rank == 2 else [state]  # rank 2 leaves without handing its shard over
    try:
        reshard_in_memory(held, layout, rank if rank < 2 else None)
    except ValueError as e:
        return str(e)
    return "re-sharded"


def test_a_shard_no_member_holds_is_said_on_every_member() -> None:
    said = run_ranks(_incomplete, world_size=3)
    assert len(set(said)) == 1 and "old ranks [2] (of 3): they are lost" in said[0], said


@pytest.mark.parametrize("new_ranks", [(0, 0, None), (0, None, None)])
def test_new_ranks_must_number_the_new_engine_once_each(new_ranks: tuple) -> None:
    said = run_ranks(_numbered, world_size=3, new_ranks=new_ranks)
    assert len(set(said)) == 1 and "needs each of 0..1 once" in said[0], said


def _numbered(rank: int, world_size: int, new_ranks: tuple) -> str:
    model, opt = build(world_size, "acco", virtual=VIRTUAL)
    state, layout = opt.state_dict(), opt.layout.resized(2)
    opt.close()
    try:
        reshard_in_memory([state], layout, new_ranks[rank])
    except ValueError as e:
        return str(e)
    return "re-sharded"
