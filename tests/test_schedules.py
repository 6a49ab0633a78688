"""2 gloo ranks: each schedule equals the single-process reference of its equations, and DDP where it should."""

from __future__ import annotations

import time

import pytest
import torch

from hf_acco import ACCOOptimizer, Phase
from hf_acco.engine.halves import round_ends_soon
from hf_acco.tools.multiprocess import run_ranks

from .doubles import DelayedCommunicator
from .helpers import clones
from .models import batch, decay_groups, mean_loss, tiny_llama, token_sum_loss
from .reference import Reference, relative_error, run_acco, run_dpu, run_sync

STEPS = 20
MICRO = 4  # micro-batches per optimizer step per rank
HP = {"lr": 1e-2, "betas": (0.9, 0.95), "eps": 1e-8}
WD = 0.1
CLIP = 0.6  # clipping active in some steps and not in others (both paths)
LOSSES = {"mean": mean_loss, "tokens": token_sum_loss}


def train_fixed(
    rank: int,
    world_size: int,
    schedule: str,
    loss: str = "mean",
    masked: bool = False,
    warmup_steps: int = 0,
    micro: int = MICRO,
) -> dict:
    model = tiny_llama()
    opt = ACCOOptimizer(
        decay_groups(model, WD),
        schedule=schedule,
        micro_batches=micro,
        max_grad_norm=CLIP,
        warmup_steps=warmup_steps,
        **HP,
    )
    history, norms = [], []
    for t in range(STEPS):
        for i in range(micro):
            value, weight = LOSSES[loss](model, batch(rank, t * micro + i, masked))
            value.backward()
            opt.after_backward(weight)
        assert opt.ready_to_step()
        opt.step()
        with opt.committed_parameters():  # waits for the commit round: timing changes, values do not
            history.append(clones(model))
        norms.append(opt.last_commit.grad_norm)
    opt.close()
    return {"history": history, "norms": norms}


def reference_fixed(schedule: str, loss: str = "mean", masked: bool = False, world_size: int = 2, micro: int = MICRO):
    model = tiny_llama()
    ref = Reference(model, decay_groups(model, WD), torch.optim.AdamW, CLIP, LOSSES[loss], **HP)

    def mbs(rank: int, t: int, lo: int, hi: int):
        return [batch(rank, t * micro + i, masked) for i in range(lo, hi)]

    if schedule == "acco":  # half A: micro // 2 micro-batches, half B: the rest
        a = micro // 2
        plan = [[(mbs(r, t, 0, a), mbs(r, t, a, micro)) for r in range(world_size)] for t in range(STEPS)]
        return run_acco(ref, plan), ref.norms
    plan = [[mbs(r, t, 0, micro) for r in range(world_size)] for t in range(STEPS)]
    return (run_sync if schedule == "sync" else run_dpu)(ref, plan), ref.norms


def _assert_ranks_identical(results: list[dict]) -> None:
    for t, (a, b) in enumerate(zip(results[0]["history"], results[1]["history"])):
        assert all(torch.equal(x, y) for x, y in zip(a, b)), f"ranks differ after step {t}"


@pytest.mark.parametrize(
    ("schedule", "world_size"),
    [("acco", 2), ("dpu", 2), ("sync", 2), ("acco", 3), ("dpu", 3), ("sync", 3), ("acco", 4)],
)
def test_schedule_matches_reference(schedule: str, world_size: int) -> None:
    """3 ranks: an odd world size pads the flat buffer and leaves the last shard short."""
    results = run_ranks(train_fixed, world_size=world_size, schedule=schedule)
    for other in results[1:]:
        _assert_ranks_identical([results[0], other])
    expected, norms = reference_fixed(schedule, world_size=world_size)
    errors = [relative_error(got, want) for got, want in zip(results[0]["history"], expected)]
    assert len(errors) == STEPS
    assert max(errors) <= 1e-6, f"{schedule}: relative error per step {errors}"
    # the parameters really moved, and clipping was active at least once
    assert relative_error(expected[0], expected[-1]) > 1e-2
    if world_size == 2:  # (with more ranks the average is smoother: its norm stays below CLIP)
        assert max(norms) > CLIP > min(norms)
    # the engine's global gradient norm (before clipping) is clip_grad_norm_'s on the full averaged gradient
    got_norms = results[0]["norms"]
    assert got_norms == pytest.approx(norms, rel=1e-5)


@pytest.mark.parametrize("micro", [3, 2])
def test_acco_with_unequal_or_single_micro_batch_halves_matches_reference(micro: int) -> None:
    """An odd window makes unequal halves (1 + 2 for 3): nothing in ACCO needs them equal."""
    results = run_ranks(train_fixed, schedule="acco", micro=micro)
    _assert_ranks_identical(results)
    expected, _ = reference_fixed("acco", micro=micro)
    errors = [relative_error(got, want) for got, want in zip(results[0]["history"], expected)]
    assert len(errors) == STEPS and max(errors) <= 1e-6, errors


@pytest.mark.parametrize("schedule", ["acco", "dpu"])
def test_warmup_steps_are_synchronous_then_the_schedule_starts(schedule: str) -> None:
    warmup = 3
    results = run_ranks(train_fixed, schedule=schedule, warmup_steps=warmup)
    model = tiny_llama()
    ref = Reference(model, decay_groups(model, WD), torch.optim.AdamW, CLIP, mean_loss, **HP)

    def mbs(rank: int, t: int, lo: int, hi: int):
        return [batch(rank, t * MICRO + i) for i in range(lo, hi)]

    expected = run_sync(ref, [[mbs(r, t, 0, MICRO) for r in (0, 1)] for t in range(warmup)])
    if schedule == "acco":
        rest = [
            [(mbs(r, t, 0, MICRO // 2), mbs(r, t, MICRO // 2, MICRO)) for r in (0, 1)] for t in range(warmup, STEPS)
        ]
        expected += run_acco(ref, rest)
    else:
        expected += run_dpu(ref, [[mbs(r, t, 0, MICRO) for r in (0, 1)] for t in range(warmup, STEPS)])
    errors = [relative_error(got, want) for got, want in zip(results[0]["history"], expected)]
    assert len(errors) == STEPS and max(errors) <= 1e-6, errors
    no_warmup, _ = reference_fixed(schedule)
    assert relative_error(expected[-1], no_warmup[-1]) > 1e-4  # the warm-up changed the trajectory


def test_token_weighted_acco_matches_reference() -> None:
    results = run_ranks(train_fixed, schedule="acco", loss="tokens", masked=True)
    _assert_ranks_identical(results)
    expected, _ = reference_fixed("acco", loss="tokens", masked=True)
    errors = [relative_error(got, want) for got, want in zip(results[0]["history"], expected)]
    assert max(errors) <= 1e-6, errors


def test_token_weighting_differs_from_count_weighting() -> None:
    """Guards the test above: with uneven token counts the two averages give different trajectories."""
    by_tokens, _ = reference_fixed("sync", loss="tokens", masked=True)
    by_count, _ = reference_fixed("sync", loss="mean", masked=True)
    assert relative_error(by_tokens[-1], by_count[-1]) > 1e-4


def train_ddp(rank: int, world_size: int) -> list[torch.Tensor]:
    model = tiny_llama()
    ddp = torch.nn.parallel.DistributedDataParallel(model)
    opt = torch.optim.AdamW(decay_groups(model, WD), **HP)
    for t in range(STEPS):
        for i in range(MICRO):
            ctx = ddp.no_sync() if i < MICRO - 1 else torch.enable_grad()
            with ctx:
                (ddp(**batch(rank, t * MICRO + i)).loss / MICRO).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP)
        opt.step()
        opt.zero_grad()
    return clones(model)


def test_sync_matches_ddp() -> None:
    ddp = run_ranks(train_ddp)
    ours = run_ranks(train_fixed, schedule="sync")
    err = relative_error(ours[0]["history"][-1], ddp[0])
    assert err <= 1e-5, err


def train_dynamic(
    rank: int, world_size: int, schedule: str, steps: int, slow_rank_delay: float, round_delay: float
) -> dict:
    model = tiny_llama()
    opt = ACCOOptimizer(
        decay_groups(model, WD),
        schedule=schedule,
        accumulation="dynamic",
        max_grad_norm=CLIP,
        communicator=DelayedCommunicator(round_delay),
        **HP,
    )
    plan, index = [], 0
    for _ in range(steps):
        halves: dict[Phase, list[int]] = {Phase.ESTIMATE: [], Phase.CORRECTION: []}
        while True:
            phase = opt.phase
            if rank == 1:
                time.sleep(slow_rank_delay)  # a slower GPU
            value, weight = mean_loss(model, batch(rank, index))
            value.backward()
            opt.after_backward(weight)
            halves[phase].append(index)
            index += 1
            if opt.ready_to_step():
                break
        opt.step()
        plan.append((halves[Phase.ESTIMATE], halves[Phase.CORRECTION]))
    with opt.committed_parameters():
        final = clones(model)
    opt.close()
    return {"plan": plan, "final": final, "last_global": opt.last_commit.micro_batches}


@pytest.mark.parametrize(("schedule", "world_size"), [("acco", 2), ("dpu", 2), ("acco", 3)])
def test_dynamic_slow_rank_matches_reference_of_actual_assignment(schedule: str, world_size: int) -> None:
    steps = 6
    results = run_ranks(
        train_dynamic, world_size=world_size, schedule=schedule, steps=steps, slow_rank_delay=0.06, round_delay=0.25
    )
    fast = results[0]
    for other in results[1:]:
        assert all(torch.equal(a, b) for a, b in zip(fast["final"], other["final"]))
    halves = (0, 1) if schedule == "acco" else (1,)  # dpu has one phase (CORRECTION)
    assert all(len(plan[h]) >= 1 for r in results for plan in r["plan"] for h in halves)
    assert fast["last_global"] == sum(len(r["plan"][-1][0]) + len(r["plan"][-1][1]) for r in results)
    # the reference, replaying exactly which micro-batches each rank used in each half
    model = tiny_llama()
    ref = Reference(model, decay_groups(model, WD), torch.optim.AdamW, CLIP, mean_loss, **HP)
    plan = [
        [
            ([batch(r, i) for i in results[r]["plan"][t][0]], [batch(r, i) for i in results[r]["plan"][t][1]])
            for r in range(world_size)
        ]
        for t in range(steps)
    ]
    if schedule == "acco":
        expected = run_acco(ref, plan)[-1]
    else:
        expected = run_dpu(ref, [[a + b for a, b in per_rank] for per_rank in plan])[-1]
    assert relative_error(fast["final"], expected) <= 1e-6


def train_lr_zero(rank: int, world_size: int) -> bool:
    model = tiny_llama()
    before = clones(model)
    opt = ACCOOptimizer(model.parameters(), lr=0.0, micro_batches=2)
    for i in range(6):
        mean_loss(model, batch(rank, i))[0].backward()
        opt.after_backward()
        if opt.ready_to_step():
            opt.step()
    with opt.committed_parameters():
        after = clones(model)
    opt.close()
    return all(torch.equal(a, b) for a, b in zip(before, after))


def test_lr_zero_moves_nothing() -> None:
    assert run_ranks(train_lr_zero) == [True, True]


def train_unequal_data(rank: int, world_size: int, schedule: str, micro_batches: list[int], delay: float) -> dict:
    """Dynamic mode where ranks have different amounts of data: the one that runs out waits in finalize()."""
    model = tiny_llama()
    opt = ACCOOptimizer(
        decay_groups(model, WD),
        schedule=schedule,
        accumulation="dynamic",
        communicator=DelayedCommunicator(0.05),
        **HP,
    )
    for index in range(micro_batches[rank]):
        if rank == 1:
            time.sleep(delay)
        mean_loss(model, batch(rank, index))[0].backward()
        opt.after_backward()
        if opt.ready_to_step():
            opt.step()
    opt.finalize()  # rank 0 gets here first and takes part in empty rounds until rank 1 is done
    total = opt.totals["micro_batches"]
    params = clones(model)
    opt.close()
    return {"params": params, "local_total": total, "steps": opt.step_count}


@pytest.mark.parametrize("schedule", ["acco", "dpu"])
def test_dynamic_ranks_with_unequal_data_finish_together(schedule: str) -> None:
    results = run_ranks(train_unequal_data, schedule=schedule, micro_batches=[20, 8], delay=0.03, timeout=120)
    assert all(torch.equal(a, b) for a, b in zip(results[0]["params"], results[1]["params"]))
    assert results[0]["steps"] == results[1]["steps"]  # the same rounds on both ranks
    assert [r["local_total"] for r in results] == [20, 8]  # every micro-batch used once, none repeated


def train_round_end_foreseen(rank: int, world_size: int, round_s: float, micro_batch_s: float, steps: int) -> dict:
    """Dynamic mode with a slow link: micro-batches of ``micro_batch_s`` against rounds of ``round_s``."""
    model = tiny_llama()
    opt = ACCOOptimizer(model.parameters(), lr=1e-3, accumulation="dynamic", communicator=DelayedCommunicator(round_s))
    halves = []
    while opt.step_count < steps:
        time.sleep(micro_batch_s)  # the compute of a slower device
        mean_loss(model, batch(rank, 0))[0].backward()
        before = opt.phase
        opt.after_backward()
        if opt.phase is not before:  # the A→B boundary was crossed
            halves.append(opt._step_counts[-1][0])
        if opt.ready_to_step():
            opt.step()
            halves.append(int(opt.last_step_stats["micro_batches"]) - halves[-1])
    opt.close()
    return {"halves": halves, "micro_batches": opt.totals["micro_batches"], "steps": opt.step_count}


def test_round_end_is_foreseen_from_the_last_rounds_and_micro_batches() -> None:
    """Round 0.3 s, micro-batch 0.14 s: after a micro-batch at 0.28 s the round has ~0.02 s left, less than half a
    micro-batch, so the half ends there (2 micro-batches, a short wait) instead of overshooting the round's end by
    0.12 s with a third; at 0.14 s, 0.16 s are left: compute on. No estimate before two of each were timed."""
    rounds, micro_batches = [0.31, 0.29, 0.30], [0.13, 0.15, 0.14]
    assert not round_ends_soon(0.14, rounds, micro_batches)
    assert round_ends_soon(0.28, rounds, micro_batches)
    assert round_ends_soon(0.5, rounds, micro_batches)  # overdue
    assert not round_ends_soon(0.28, rounds[:1], micro_batches)
    assert not round_ends_soon(0.28, rounds, micro_batches[:1])


def test_dynamic_halves_on_a_slow_link() -> None:
    """The engine in dynamic mode with rounds longer than micro-batches (how many micro-batches a half takes
    depends on timing: the rule itself is tested above): the very first half has no round to wait for, so it is
    one micro-batch; every half has at least min_micro_batches; every micro-batch is in exactly one half."""
    result = run_ranks(train_round_end_foreseen, round_s=0.3, micro_batch_s=0.14, steps=6, timeout=120)
    for rank in result:
        assert rank["halves"][0] == 1, rank["halves"]
        assert min(rank["halves"]) >= 1, rank["halves"]
        assert sum(rank["halves"]) == rank["micro_batches"], rank
        assert len(rank["halves"]) == 2 * 6 == 2 * rank["steps"], rank


def _train_with_drifted_hparams(rank: int, world_size: int, drift: bool) -> list[torch.Tensor]:
    model = tiny_llama()
    opt = ACCOOptimizer(decay_groups(model, WD), micro_batches=MICRO, max_grad_norm=CLIP, **HP)
    for t in range(4):
        for group in opt.param_groups:  # a scheduler's warm-up; with drift, rank 1's is 3 steps ahead
            group["lr"] = HP["lr"] * (t + 1 + (3 if drift and rank == 1 else 0)) / 8
        if drift and rank == 1:
            opt.param_groups[0]["weight_decay"] = 0.5
        for i in range(MICRO):
            mean_loss(model, batch(rank, t * MICRO + i))[0].backward()
            opt.after_backward()
        opt.step()
    with opt.committed_parameters():
        out = clones(model)
    opt.close()
    return out


def test_every_rank_updates_with_rank_0s_hyper_parameters_in_each_round() -> None:
    """Under Trainer in dynamic mode ranks launch a round at different Trainer steps, so their schedulers differ:
    the round takes rank 0's learning rate and weight decay for every shard (sent with the counts)."""
    drifted = run_ranks(_train_with_drifted_hparams, drift=True)
    agreed = run_ranks(_train_with_drifted_hparams, drift=False)
    for a, b in zip(drifted[0] + drifted[1], agreed[0] + agreed[1]):
        assert torch.equal(a, b)
