"""Claimed micro-batches (hf_acco.claims): at unequal, jittered speeds every sample is used exactly once per epoch,
and an epoch resumed mid-way on another number of ranks neither repeats nor skips one."""

from __future__ import annotations

import random
import time

import pytest
import torch
import torch.distributed as dist

from hf_acco.claims import ClaimingBatchSampler, default_store
from hf_acco.multiprocess import run_ranks

N, BATCH = 203, 4  # a short last batch


def _consume(rank: int, world_size: int, epochs: int, stop_after: int | None = None, state=None) -> dict:
    sampler = ClaimingBatchSampler(default_store(), N, BATCH, seed=7)
    if state is not None:  # resume: one rank writes the counter, then every rank iterates
        sampler.load_state_dict(state, set_counter=rank == 0)
        dist.barrier()
    jitter = random.Random(rank)
    seen = []
    for epoch in range(epochs):
        if state is None:
            sampler.set_epoch(epoch)
        batches = []
        for batch in sampler:
            batches.append(batch)
            time.sleep(jitter.uniform(0, 0.002) * (1 + 4 * rank))  # rank r about 1 + 4r times slower, jittered
            if stop_after is not None and len(batches) == stop_after:
                break
        seen.append(batches)
    dist.barrier()  # a step boundary: nothing claimed and unused
    return {"seen": seen, "state": sampler.state_dict()}


@pytest.mark.parametrize("world_size", [2, 3])
def test_every_sample_is_used_once_per_epoch_at_unequal_speeds(world_size: int) -> None:
    results = run_ranks(_consume, world_size=world_size, epochs=2)
    for epoch in range(2):
        batches = [b for r in results for b in r["seen"][epoch]]
        used = sorted(i for b in batches for i in b)
        assert used == list(range(N)), f"epoch {epoch}: a sample repeated or missing"
        assert sorted(len(b) for b in batches)[0] == N % BATCH and len(batches) == -(-N // BATCH)
    first = {tuple(b) for r in results for b in r["seen"][0]}
    second = {tuple(b) for r in results for b in r["seen"][1]}
    assert first != second  # a new permutation each epoch


def test_an_epoch_resumed_on_another_number_of_ranks_repeats_and_skips_nothing() -> None:
    before = run_ranks(_consume, world_size=2, epochs=1, stop_after=9)  # 18 of 51 batches, then a checkpoint
    state = before[0]["state"]
    assert state == before[1]["state"] and state["claimed"] == 18
    after = run_ranks(_consume, world_size=3, epochs=1, state=state)
    used = [i for r in before + after for b in r["seen"][0] for i in b]
    assert sorted(used) == list(range(N))


def test_one_rank_alone_walks_the_permutation_in_order() -> None:
    sampler = ClaimingBatchSampler(dist.HashStore(), N, BATCH, seed=7, drop_last=True)
    assert len(sampler) == N // BATCH
    got = [i for b in sampler for i in b]
    assert got == sampler.permutation()[: (N // BATCH) * BATCH].tolist()
    assert list(sampler) == []  # the epoch is used up
    sampler.set_epoch(1)
    assert len(list(sampler)) == N // BATCH and not torch.equal(sampler.permutation(), torch.randperm(N))


def test_a_mismatched_state_is_refused() -> None:
    sampler = ClaimingBatchSampler(dist.HashStore(), N, BATCH, seed=7)
    state = sampler.state_dict()
    with pytest.raises(ValueError, match="batch_size=4, this run has 8"):
        ClaimingBatchSampler(dist.HashStore(), N, 8, seed=7).load_state_dict(state, set_counter=True)
    with pytest.raises(ValueError, match="Not an hf_acco claims state"):
        sampler.load_state_dict({}, set_counter=True)
