"""A commit voted before it is applied (``ACCOOptimizer.vote_commits``, ``rounds.RoundBody._commit``): every rank
steps its shard with its last commit kept aside, the ranks agree, and only then is the step theirs. The same
parameters as an unvoted run, bit for bit; where the agreement fails (a communicator that fails it on one rank)
every rank stands at the last commit: master and optimizer state as they were, and the error says so."""

from __future__ import annotations

import pytest
import torch

from hf_acco import ACCOOptimizer
from hf_acco.comm.communicator import Communicator
from hf_acco.comm.failures import PeerFailure
from hf_acco.tools.multiprocess import run_ranks

from .models import batch, decay_groups, mean_loss, tiny_llama

MICRO, STEPS = 4, 4


class FailsTheVote(Communicator):
    """Says no at its ``fail_at``-th vote (counted from 1) on rank ``on_rank``: its update could not be made."""

    def __init__(self, fail_at: int, on_rank: int) -> None:
        super().__init__()
        self.fail_at, self.on_rank, self.votes = fail_at, on_rank, 0

    def agree(self, ok: bool) -> bool:
        self.votes += 1
        return super().agree(ok and not (self.votes == self.fail_at and self.rank == self.on_rank))


def _engine(model: torch.nn.Module, vote: bool, schedule: str, comm: Communicator | None = None) -> ACCOOptimizer:
    opt = ACCOOptimizer(decay_groups(model, 0.1), schedule=schedule, micro_batches=MICRO, max_grad_norm=1.0, lr=1e-2,
                        communicator=comm)  # fmt: skip
    opt.vote_commits = vote
    return opt


def _step(model: torch.nn.Module, opt: ACCOOptimizer, rank: int, t: int) -> None:
    for i in range(MICRO):
        mean_loss(model, batch(rank, t * MICRO + i))[0].backward()
        opt.after_backward()
    opt.step()


def _train(rank: int, world_size: int, vote: bool, schedule: str) -> list[torch.Tensor]:
    model = tiny_llama()
    opt = _engine(model, vote, schedule)
    for t in range(STEPS):
        _step(model, opt, rank, t)
    with opt.committed_parameters():
        final = [p.detach().clone() for p in model.parameters()]
    opt.close()
    return final


@pytest.mark.parametrize("schedule", ["acco", "sync"])
def test_a_voted_commit_gives_the_same_bits(schedule: str) -> None:
    voted = run_ranks(_train, world_size=2, vote=True, schedule=schedule)
    plain = run_ranks(_train, world_size=2, vote=False, schedule=schedule)
    for r in range(2):
        assert all(torch.equal(a, b) for a, b in zip(voted[r], plain[r]))
    assert not all(torch.equal(a, p.detach()) for a, p in zip(voted[0], tiny_llama().parameters()))  # it trained


def _refused(rank: int, world_size: int, schedule: str) -> dict:
    model = tiny_llama()
    # commit rounds vote, one per step: the third step's commit is refused on rank 1
    opt = _engine(model, True, schedule, FailsTheVote(fail_at=3, on_rank=1))
    for t in range(2):
        _step(model, opt, rank, t)
    before = opt.state_dict()  # (waits for the second commit)
    error = ""
    try:
        _step(model, opt, rank, 2)
        opt.synchronize()
    except PeerFailure as e:
        error = str(e)
    state, scalars = opt.shard.state_tensors()
    same = torch.equal(opt.shard.master.cpu(), before["master"]) and all(
        torch.equal(v.cpu(), before["optim_state"][k]) for k, v in state.items()
    )
    steps = {k: v.cpu() for k, v in opt.shard.param_scalars().items()}
    same_steps = all(torch.equal(v.nan_to_num(-1.0), before["optim_param_scalars"][k].nan_to_num(-1.0))
                     for k, v in steps.items())  # (NaN: a parameter this rank holds none of)  # fmt: skip
    return {
        "error": error,
        "same": same,
        "same_steps": same_steps,
        "keys": sorted(state),
        "before": before["step_count"],
    }


@pytest.mark.parametrize("schedule", ["acco", "sync"])
def test_a_commit_the_ranks_do_not_agree_on_leaves_every_rank_at_the_last_commit(schedule: str) -> None:
    said = run_ranks(_refused, world_size=2, schedule=schedule)
    for r in said:
        assert "commit round was not applied" in r["error"], r["error"]
        assert r["same"] and r["same_steps"] and r["keys"] == ["exp_avg", "exp_avg_sq"]


def _kept_against_the_report(rank: int, world_size: int) -> tuple[int, int, int]:
    from hf_acco.tools.memory import engine_memory_of

    model = tiny_llama()
    opt = _engine(model, True, "acco")
    _step(model, opt, rank, 0)
    opt.synchronize()
    kept = opt.shard.keep()
    held = kept.master.nbytes + sum(v.nbytes for s in kept.state.values() for v in s.values() if v.dim())
    padding = opt.shard.master.numel() - sum(seg.end - seg.start for seg in opt.shard.segments)  # no state there
    report = engine_memory_of(opt).round_pool["round: the last commit, kept until the ranks agree"]
    opt.close()
    return held, report, padding


def test_the_memory_report_counts_the_kept_commit() -> None:
    """What a voted commit keeps aside is the report's line for it (the moments kept segment by segment: the shard's
    padding, which no segment covers, is the only difference)."""
    for held, report, padding in run_ranks(_kept_against_the_report, world_size=2):
        assert report == held + 2 * padding * 4 and held > 0


def test_a_first_step_undone_leaves_an_optimizer_that_makes_its_state_as_it_was() -> None:
    """``Kept.restore`` after the first step of an optimizer whose state the step re-homes into per-element vectors
    (Adagrad makes ``sum`` in its constructor): the state is as before, and the next step is the step a fresh
    optimizer takes, bit for bit."""
    from hf_acco.comm.sharding import Segment
    from hf_acco.engine.optim import ShardOptimizer

    def shard() -> ShardOptimizer:
        torch.manual_seed(0)
        opt = ShardOptimizer(torch.randn(96), [Segment(0, 40, 0, 0), Segment(40, 96, 0, 1)], [{"lr": 0.1}],
                             torch.optim.Adagrad, {}, piece_numel=48)  # fmt: skip
        opt.grad.copy_(torch.randn(opt.grad.shape))
        return opt

    undone, fresh = shard(), shard()
    before = undone.state_tensors()
    kept = undone.keep()
    undone.commit([{"lr": 0.1}])
    assert not torch.equal(undone.master, fresh.master)
    kept.restore()
    after = undone.state_tensors()
    assert torch.equal(undone.master, fresh.master)
    assert sorted(after[0]) == sorted(before[0]) and sorted(after[1]) == sorted(before[1])
    undone.commit([{"lr": 0.1}])
    fresh.commit([{"lr": 0.1}])
    assert torch.equal(undone.master, fresh.master)
    for a, b in zip(undone.state_tensors(), fresh.state_tensors()):
        assert sorted(a) == sorted(b) and all(torch.equal(a[k], b[k]) for k in a)


def _mixed_votes(rank: int, world_size: int) -> str:
    model = tiny_llama()
    opt = _engine(model, rank == 0, "acco")
    try:
        for t in range(2):
            _step(model, opt, rank, t)
        opt.synchronize()
    except ValueError as e:
        return str(e)
    return "trained"


def test_ranks_that_disagree_on_voting_are_told_all_the_same() -> None:
    said = run_ranks(_mixed_votes, world_size=2)
    assert len(set(said)) == 1 and "vote_commits is set on 1 of the 2 ranks" in said[0], said


def test_moving_state_needs_a_group_that_moves_host_tensors(monkeypatch: pytest.MonkeyPatch) -> None:
    from hf_acco.comm import transfer

    monkeypatch.setattr(transfer.dist, "get_backend", lambda group=None: "nccl")
    with pytest.raises(ValueError, match="pass a gloo group over the same ranks"):
        transfer.check_host_group()
    monkeypatch.setattr(transfer.dist, "get_backend", lambda group=None: "cpu:gloo,cuda:nccl")
    transfer.check_host_group()  # (a world with both: its gloo part moves them)


def test_a_layout_read_from_a_checkpoint_resizes_as_a_built_one() -> None:
    from hf_acco.comm.sharding import FlatLayout

    params = [torch.empty(s) for s in (1000, 333, 77)]
    built = FlatLayout(params, ["a", "b", "c"], [0, 0, 1], 4, 256)
    for world in (1, 3, 5):
        a, b = built.resized(world), FlatLayout.from_meta(built.meta()).resized(world)
        fresh = FlatLayout(params, ["a", "b", "c"], [0, 0, 1], world, 256)
        assert (a.chunk, a.num_buckets) == (b.chunk, b.num_buckets) == (fresh.chunk, fresh.num_buckets)
