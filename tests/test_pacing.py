"""Paced steps (hf_acco.pacing.pacer): ranks at unequal, jittered speeds claim the micro-batches of each global batch.

What the design guarantees, whatever the timing: every sample once per epoch, the same steps on every rank, identical
parameters, and training equal to the single-process reference over the micro-batches each rank actually computed.
"""

from __future__ import annotations

import random
import time

import pytest
import torch
from torch.utils.data import DataLoader

from hf_acco import ACCOOptimizer
from hf_acco.comm.groups import default_store
from hf_acco.engine.schedule import Phase
from hf_acco.pacing.claims import ClaimingBatchSampler, StreamTickets
from hf_acco.pacing.pacer import Pacer
from hf_acco.tools.multiprocess import run_ranks

from .helpers import clones
from .models import SEQ, VOCAB, decay_groups, tiny_llama, token_sum_loss
from .reference import Reference, relative_error, run_acco, run_dpu

N, BATCH, PER_RANK = 61, 2, 3  # 31 micro-batches an epoch, the last one short; 3 per rank per step on average
HP = {"lr": 1e-2, "betas": (0.9, 0.95), "eps": 1e-8}
WD, CLIP = 0.1, 0.6


def sample(i: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(i)
    ids = torch.randint(0, VOCAB, (SEQ,), generator=g)
    labels = ids.clone()
    labels[: int(torch.randint(1, SEQ - 2, (1,), generator=g))] = -100  # uneven token counts
    return {"input_ids": ids, "labels": labels, "index": torch.tensor(i)}


DATA = [sample(i) for i in range(N)]


def collate(items: list[dict]) -> dict[str, torch.Tensor]:
    return {k: torch.stack([it[k] for it in items]) for k in items[0]}


def train_paced(
    rank: int,
    world_size: int,
    schedule: str = "acco",
    epochs: int = 1,
    slowdown: float = 4.0,
    stall: tuple[int, float] | None = None,
    steps: int | None = None,
    state: dict | None = None,
    warmup_lr: bool = False,
    workers: int = 0,
) -> dict:
    """Trains over DATA; rank r sleeps about (1 + slowdown r) ms per micro-batch, jittered. ``stall``: rank 1 sleeps
    ``stall[1]`` s at its micro-batch ``stall[0]``. ``steps``: stop after that many steps (a checkpoint).
    ``workers``: DataLoader worker processes (they claim ahead of the micro-batch being computed)."""
    model = tiny_llama()
    opt = ACCOOptimizer(decay_groups(model, WD), schedule=schedule, accumulation="paced", max_grad_norm=CLIP, **HP)
    scheduler = torch.optim.lr_scheduler.LambdaLR(opt, lambda t: min(1.0, (t + 1) / 4)) if warmup_lr else None
    sampler = ClaimingBatchSampler(default_store(), N, BATCH, seed=3, num_replicas=world_size)
    loader = DataLoader(DATA, batch_sampler=sampler, collate_fn=collate, num_workers=workers)
    pacer = Pacer(loader, sampler, world_size * PER_RANK)
    start_epoch = 0
    if state is not None:
        pacer.load_state_dict(state["pacer"])
        start_epoch = state["pacer"]["epoch"]
        if "optimizer" in state:
            opt.load_state_dict(state["optimizer"][rank])
    jitter = random.Random(rank)
    plan, lrs, done = [], [], 0  # plan[t] = (sample indices of half A, of half B) this rank computed in step t
    for epoch in range(start_epoch, epochs):
        pacer.set_epoch(epoch)
        used: tuple[list[int], list[int]] = ([], [])
        while not pacer.epoch_done and (steps is None or done < steps):
            used = ([], [])
            lrs.append(opt.param_groups[0]["lr"])
            for b in pacer.step_batches(opt):
                time.sleep(jitter.uniform(0.5, 1.5) * 1e-3 * (1 + slowdown * rank))
                if stall is not None and rank == 1 and pacer.computed == stall[0]:
                    time.sleep(stall[1])
                used[opt.phase is Phase.CORRECTION].extend(b["index"].tolist())
                loss, weight = token_sum_loss(model, b)
                loss.backward()
                opt.after_backward(weight)
            plan.append(used)
            done += 1
            if scheduler is not None:
                scheduler.step()
    with opt.committed_parameters():
        final = clones(model)
    out = {"plan": plan, "final": final, "lrs": lrs, "pacer": pacer.state_dict(), "steps": opt.step_count}
    out["optimizer"] = opt.state_dict()
    opt.close()
    return out


def _epochs(results: list[dict], steps_per_epoch: int) -> list[list[int]]:
    """The sample indices all ranks used, epoch by epoch."""
    n = len(results[0]["plan"])
    return [
        sorted(
            i for r in results for t in range(e, min(e + steps_per_epoch, n)) for half in r["plan"][t] for i in half
        )
        for e in range(0, n, steps_per_epoch)
    ]


def _reference(results: list[dict], schedule: str) -> list[torch.Tensor]:
    model = tiny_llama()
    ref = Reference(model, decay_groups(model, WD), torch.optim.AdamW, CLIP, token_sum_loss, **HP)

    def as_batches(indices: list[int]) -> list[dict]:
        return [collate([DATA[i] for i in indices[k : k + BATCH]]) for k in range(0, len(indices), BATCH)]

    steps = [[(as_batches(r["plan"][t][0]), as_batches(r["plan"][t][1])) for r in results]
             for t in range(len(results[0]["plan"]))]  # fmt: skip
    if schedule == "acco":
        return run_acco(ref, steps)[-1]
    return run_dpu(ref, [[a + b for a, b in per_rank] for per_rank in steps])[-1]


@pytest.mark.parametrize(("world_size", "schedule"), [(2, "acco"), (3, "acco"), (2, "dpu")])
def test_paced_steps_use_every_sample_once_and_match_the_reference(world_size: int, schedule: str) -> None:
    results = run_ranks(train_paced, world_size=world_size, schedule=schedule, epochs=2)
    steps_per_epoch = -(-31 // (world_size * PER_RANK))
    assert all(r["steps"] == 2 * steps_per_epoch for r in results)  # the data sets the step count, not the speeds
    assert _epochs(results, steps_per_epoch) == [list(range(N))] * 2
    for r in results[1:]:
        assert all(torch.equal(a, b) for a, b in zip(r["final"], results[0]["final"]))
    assert relative_error(results[0]["final"], _reference(results, schedule)) <= 1e-6
    # a step's half A is the first half of its global batch (3 of 6 micro-batches, or 4 of 9 for 3 ranks)
    if schedule == "acco":
        half_a = [sum(len(r["plan"][t][0]) for r in results) for t in range(steps_per_epoch - 1)]
        assert half_a == [BATCH * (world_size * PER_RANK // 2)] * (steps_per_epoch - 1)


def test_prefetching_loader_workers_keep_every_sample_once_and_the_steps_exact() -> None:
    """Workers claim batches ahead of use; the pacer matches each loaded batch to its claim in order."""
    results = run_ranks(train_paced, world_size=2, workers=2)
    assert _epochs(results, 6) == [list(range(N))]
    assert all(torch.equal(a, b) for a, b in zip(results[0]["final"], results[1]["final"]))
    assert relative_error(results[0]["final"], _reference(results, "acco")) <= 1e-6


def test_a_five_times_slower_rank_and_a_stall_finish_without_deadlock() -> None:
    for kwargs in ({"slowdown": 4.0 * 5}, {"stall": (2, 2.0)}):
        results = run_ranks(train_paced, world_size=2, timeout=120, **kwargs)
        fast, slow = results
        assert all(torch.equal(a, b) for a, b in zip(fast["final"], slow["final"]))
        assert _epochs(results, 6) == [list(range(N))]
        assert fast["steps"] == slow["steps"] == 6


def test_every_rank_applies_the_same_learning_rate_in_the_same_step_during_warm_up() -> None:
    fast, slow = run_ranks(train_paced, world_size=2, warmup_lr=True)
    assert fast["lrs"] == slow["lrs"] and fast["lrs"][:4] == pytest.approx([HP["lr"] * k / 4 for k in (1, 2, 3, 4)])
    assert all(torch.equal(a, b) for a, b in zip(fast["final"], slow["final"]))


def test_a_mid_epoch_resume_repeats_and_skips_nothing_on_the_same_or_another_number_of_ranks() -> None:
    before = run_ranks(train_paced, world_size=2, steps=3)
    assert before[0]["pacer"] == before[1]["pacer"] and before[0]["pacer"]["cursor"] == 3 * 2 * PER_RANK
    state = {"pacer": before[0]["pacer"], "optimizer": [r["optimizer"] for r in before]}
    same = run_ranks(train_paced, world_size=2, state=state)
    used = sorted(i for r in before + same for t in r["plan"] for i in t[0] + t[1])
    assert used == list(range(N))
    # exact resume: the two runs together equal the reference over what each rank computed in each step
    joined = [{"plan": b["plan"] + a["plan"]} for b, a in zip(before, same)]
    assert relative_error(same[0]["final"], _reference(joined, "acco")) <= 1e-6
    other = run_ranks(train_paced, world_size=3, state={"pacer": before[0]["pacer"]})
    used = sorted(i for r in before for t in r["plan"] for i in t[0] + t[1])
    used += [i for r in other for t in r["plan"] for i in t[0] + t[1]]
    assert sorted(used) == list(range(N))


def test_a_state_for_other_data_is_refused() -> None:
    sampler = ClaimingBatchSampler(torch.distributed.HashStore(), N, BATCH, seed=3)
    pacer = Pacer(DataLoader(DATA, batch_sampler=sampler, collate_fn=collate), sampler, 4)
    state = pacer.state_dict()
    other = ClaimingBatchSampler(torch.distributed.HashStore(), N, 4, seed=3)
    with pytest.raises(ValueError, match="batch_size=2, this run has 4"):
        Pacer(DataLoader(DATA, batch_sampler=other, collate_fn=collate), other, 4).load_state_dict(state)
    with pytest.raises(ValueError, match="Not an hf_acco data position"):
        pacer.load_state_dict({})


class RankStream(torch.utils.data.IterableDataset):
    """This rank's own stream: its shard of DATA (every world_size-th sample), in order, each pass the same."""

    def __init__(self, rank: int, world_size: int) -> None:
        self.indices = list(range(rank, N, world_size))

    def __iter__(self):
        return (DATA[i] for i in self.indices)


def train_stream(rank: int, world_size: int, steps: int, state: dict | None = None) -> dict:
    model = tiny_llama()
    opt = ACCOOptimizer(decay_groups(model, WD), accumulation="paced", max_grad_norm=CLIP, **HP)
    stream = DataLoader(RankStream(rank, world_size), batch_size=BATCH, collate_fn=collate)
    pacer = Pacer(stream, StreamTickets(default_store(), BATCH), world_size * PER_RANK)
    if state is not None:
        pacer.load_state_dict(state["pacer"])
        opt.load_state_dict(state["optimizer"][rank])
    pacer.set_epoch(0)
    jitter, plan, micro_batches = random.Random(rank), [], 0
    for _ in range(steps):
        used: tuple[list[int], list[int]] = ([], [])
        for b in pacer.step_batches(opt):
            micro_batches += 1
            time.sleep(jitter.uniform(0.5, 1.5) * 1e-3 * (1 + 4 * rank))
            used[opt.phase is Phase.CORRECTION].extend(b["index"].tolist())
            loss, weight = token_sum_loss(model, b)
            loss.backward()
            opt.after_backward(weight)
        plan.append(used)
    with opt.committed_parameters():
        final = clones(model)
    out = {"plan": plan, "final": final, "pacer": pacer.state_dict(), "optimizer": opt.state_dict()}
    out["micro_batches"] = micro_batches
    opt.close()
    return out


def test_per_rank_streams_each_continue_their_own_stream_and_resume_exactly() -> None:
    """An IterableDataset: each rank reads its own shard at its own pace (passing its end starts it again); a step
    is still 6 micro-batches over all ranks; a resume on the same ranks continues every rank's stream where it was."""
    before = run_ranks(train_stream, world_size=2, steps=5)
    state = {"pacer": before[0]["pacer"], "optimizer": [r["optimizer"] for r in before]}
    assert before[0]["pacer"] == before[1]["pacer"] and state["pacer"]["cursor"] == 5 * 2 * PER_RANK
    after = run_ranks(train_stream, world_size=2, steps=5, state=state)
    for rank in range(2):
        shard = list(range(rank, N, 2))
        seen = [i for r in (before, after) for t in r[rank]["plan"] for i in t[0] + t[1]]
        assert seen == (shard * 10)[: len(seen)], f"rank {rank} skipped or repeated part of its stream"
    assert sum(r["micro_batches"] for r in before) == 5 * 2 * PER_RANK  # 5 global batches
    joined = [{"plan": b["plan"] + a["plan"]} for b, a in zip(before, after)]
    assert relative_error(after[0]["final"], _reference(joined, "acco")) <= 1e-6
    assert all(torch.equal(a, b) for a, b in zip(after[0]["final"], after[1]["final"]))
    with pytest.raises(ValueError, match="same number of ranks"):
        sampler = StreamTickets(torch.distributed.HashStore(), BATCH)
        Pacer(DataLoader(RankStream(0, 1), batch_size=BATCH, collate_fn=collate), sampler, 4).load_state_dict(
            state["pacer"]
        )
