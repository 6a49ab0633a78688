"""Claimed micro-batches (hf_acco.pacing.claims): at unequal, jittered speeds every sample is used exactly once per
epoch, and an epoch resumed mid-way on another number of ranks neither repeats nor skips one."""

from __future__ import annotations

import random
import time

import pytest
import torch
import torch.distributed as dist

from hf_acco.comm.groups import default_store
from hf_acco.pacing.claims import ClaimingBatchSampler
from hf_acco.tools.multiprocess import run_ranks

N, BATCH = 203, 4  # a short last batch


def _consume(rank: int, world_size: int, epochs: int, stop_after: int | None = None, start: int = 0) -> dict:
    sampler = ClaimingBatchSampler(default_store(), N, BATCH, seed=7, num_replicas=world_size)
    jitter = random.Random(rank)
    seen = []
    for epoch in range(epochs):
        sampler.set_epoch(epoch, start if epoch == 0 else 0)  # start: a resumed epoch's first batch number
        batches = []
        for batch in sampler:
            batches.append(batch)
            time.sleep(jitter.uniform(0, 0.002) * (1 + 4 * rank))  # rank r about 1 + 4r times slower, jittered
            if stop_after is not None and len(batches) == stop_after:
                break
        seen.append(batches)
    return {"seen": seen, "taken": list(sampler.taken)}


@pytest.mark.parametrize("world_size", [2, 3])
def test_every_sample_is_used_once_per_epoch_at_unequal_speeds(world_size: int) -> None:
    results = run_ranks(_consume, world_size=world_size, epochs=2)
    for epoch in range(2):
        batches = [b for r in results for b in r["seen"][epoch]]
        used = sorted(i for b in batches for i in b)
        assert used == list(range(N)), f"epoch {epoch}: a sample repeated or missing"
        assert sorted(len(b) for b in batches)[0] == N % BATCH and len(batches) == -(-N // BATCH)
    assert sorted(b for r in results for b in r["taken"]) == list(range(-(-N // BATCH)))  # batch numbers, kept
    first = {tuple(b) for r in results for b in r["seen"][0]}
    second = {tuple(b) for r in results for b in r["seen"][1]}
    assert first != second  # a new permutation each epoch


def test_an_epoch_resumed_on_another_number_of_ranks_repeats_and_skips_nothing() -> None:
    before = run_ranks(_consume, world_size=2, epochs=1, stop_after=9)  # 18 of 51 batches, then a checkpoint
    assert sorted(b for r in before for b in r["taken"]) == list(range(18))  # nothing claimed and unused
    after = run_ranks(_consume, world_size=3, epochs=1, start=18)
    used = [i for r in before + after for b in r["seen"][0] for i in b]
    assert sorted(used) == list(range(N))


def test_one_rank_alone_walks_the_permutation_in_order() -> None:
    sampler = ClaimingBatchSampler(dist.HashStore(), N, BATCH, seed=7, drop_last=True)
    assert len(sampler) == N // BATCH
    assert len(ClaimingBatchSampler(dist.HashStore(), N, BATCH, num_replicas=3)) == -(-51 // 3)  # a rank's share
    got = [i for b in sampler for i in b]
    assert got == sampler.permutation()[: (N // BATCH) * BATCH].tolist()
    assert list(sampler) == []  # the epoch is used up
    sampler.set_epoch(0, start=N // BATCH - 2)  # a resumed epoch: its last two batches
    assert [i for b in sampler for i in b] == got[-2 * BATCH :]
    sampler.set_epoch(1)
    assert len(list(sampler)) == N // BATCH and not torch.equal(sampler.permutation(), torch.randperm(N))
