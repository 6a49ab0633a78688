"""The engine's parts alone, in one process and with no thread: the round over a fake communicator, each half
policy on a fake clock, the buffer pair, the step machine's table, the statistics."""

from __future__ import annotations

import threading
from dataclasses import dataclass

import pytest
import torch

from hf_acco.comm.sharding import FlatLayout
from hf_acco.engine.buffers import BufferPair
from hf_acco.engine.halves import DynamicHalves, FixedHalves, InFlight
from hf_acco.engine.handover import LentSums
from hf_acco.engine.optim import ShardOptimizer
from hf_acco.engine.rounds import RoundBody, RoundResult
from hf_acco.engine.runner import ROUND_THREAD
from hf_acco.engine.schedule import STEP_END, Phase, RoundKind, Schedule, first_phase, parse_settings, schedule_at
from hf_acco.engine.stats import EngineStats

from .helpers import FakeComm

# ---- the round, over a one-rank fake communicator -------------------------------------------------------------


def _setup(max_grad_norm: float | None = 0.5, nonfinite: str = "skip"):
    torch.manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(5, 3)), torch.nn.Parameter(torch.randn(7))]
    layout = FlatLayout(params, ["w", "b"], [0, 1], world_size=1, bucket_numel=8)
    flat = layout.flatten(params, layout.new_flat("cpu"))
    hparams = [{"lr": 0.1, "weight_decay": 0.1}, {"lr": 0.1, "weight_decay": 0.0}]
    shard = ShardOptimizer(
        layout.shard_of(flat, 0), layout.shard_segments(0), hparams, torch.optim.AdamW, {}, piece_numel=layout.chunk
    )
    comm = FakeComm()
    body = RoundBody(layout, comm, shard, max_grad_norm=max_grad_norm, nonfinite=nonfinite)
    grads = [torch.randn_like(p) * 3 for p in params]
    return params, layout, shard, comm, body, hparams, grads


def _reference_step(params, grads, weight: float, max_grad_norm: float, hparams) -> list[torch.Tensor]:
    ref = [torch.nn.Parameter(p.detach().clone()) for p in params]
    for r, g in zip(ref, grads):
        r.grad = g / weight
    torch.nn.utils.clip_grad_norm_(ref, max_grad_norm)
    opt = torch.optim.AdamW([{"params": [r], **hp} for r, hp in zip(ref, hparams)])
    opt.step()
    return [r.detach() for r in ref]


def _run(body, layout, kind, grads, weight=4.0, joined=0.0, hparams=None) -> tuple[RoundResult, torch.Tensor]:
    buf = layout.flatten(grads, layout.new_flat("cpu"))  # the gradient sums of the step
    counts = [weight, 2.0, joined]
    result = body(kind, buf, buf, counts, hparams, threading.Event(), "test round")
    return result, buf


def test_commit_round_is_the_clipped_adamw_step_on_the_averaged_gradient() -> None:
    params, layout, shard, comm, body, hparams, grads = _setup()
    result, buf = _run(body, layout, RoundKind.COMMIT, grads, hparams=hparams)
    expected = _reference_step(params, grads, 4.0, 0.5, hparams)
    for got, want in zip(layout.views(buf), expected):
        torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-7)
    assert result.grad_norm == pytest.approx(float(torch.cat([(g / 4).flatten() for g in grads]).norm()), rel=1e-6)
    assert (result.weight, result.micro_batches, result.skipped) == (4.0, 2, False)
    # counts first, on the host (every rank has launched the round), then grads, norm, params
    assert comm.calls == ["all_reduce_counts", "reduce_scatter", "all_reduce_norms", "all_gather"]
    torch.testing.assert_close(shard.master, buf[: shard.master.numel()])  # committed: the master moved


def test_estimate_round_gives_the_same_update_and_keeps_master_and_state() -> None:
    params, layout, shard, comm, body, hparams, grads = _setup()
    _run(body, layout, RoundKind.COMMIT, grads, hparams=hparams)  # so that the state is not empty
    master, state = shard.master.clone(), {k: v.clone() for k, v in shard.state_tensors()[0].items()}
    _, estimate = _run(body, layout, RoundKind.ESTIMATE, grads, hparams=hparams)
    assert torch.equal(shard.master, master)
    assert all(torch.equal(v, state[k]) for k, v in shard.state_tensors()[0].items())
    _, commit = _run(body, layout, RoundKind.COMMIT, grads, hparams=hparams)
    torch.testing.assert_close(estimate, commit, rtol=0, atol=1e-7)


def test_a_nonfinite_gradient_is_skipped_or_stops_the_round() -> None:
    params, layout, shard, comm, body, hparams, grads = _setup()
    master = shard.master.clone()
    grads[1][3] = float("nan")
    result, buf = _run(body, layout, RoundKind.COMMIT, grads, hparams=hparams)
    assert result.skipped and torch.equal(shard.master, master)
    assert torch.equal(buf[: master.numel()], master)  # the round hands back the committed parameters
    strict = RoundBody(layout, comm, shard, nonfinite="error")
    with pytest.raises(FloatingPointError, match="not finite"):
        _run(strict, layout, RoundKind.COMMIT, grads, hparams=hparams)


def test_a_round_without_any_weight_hands_back_the_committed_parameters() -> None:
    """A half with no label token anywhere: the estimate is θ. A step with none: skipped, with a warning (Trainer's
    weights never make one: a window without a label token weighs as any other, see test_trainer_weights.py). A
    rendezvous round in which no rank had a micro-batch: nothing to do."""
    params, layout, shard, comm, body, hparams, grads = _setup()
    master = shard.master.clone()
    result, buf = _run(body, layout, RoundKind.ESTIMATE, grads, weight=0.0, hparams=hparams)
    assert not result.skipped and torch.equal(buf[: master.numel()], master)
    with pytest.warns(UserWarning, match="no weight on any rank"):
        result, buf = _run(body, layout, RoundKind.COMMIT, grads, weight=0.0, hparams=hparams)
    assert result.skipped and torch.equal(shard.master, master) and torch.equal(buf[: master.numel()], master)
    result, buf = _run(body, layout, RoundKind.COMMIT, grads, weight=0.0, joined=1.0, hparams=hparams)
    assert torch.equal(shard.master, master) and torch.equal(buf[: master.numel()], master)
    assert result.joined == 1 and result.grad_norm == 0.0


# ---- the half policies, on a fake clock -----------------------------------------------------------------------


@dataclass
class FakeRound:
    launched_at: float
    seconds: float
    clock: list[float]

    def done(self) -> bool:
        return self.clock[0] - self.launched_at >= self.seconds


def test_fixed_halves_count_micro_batches() -> None:
    halves = FixedHalves(6)
    assert [halves.half_done(n, Schedule.ACCO, None) for n in (2, 3)] == [False, True]
    odd = FixedHalves(5)  # half A 2 micro-batches, half B 3
    assert [odd.half_done(n, Schedule.ACCO, None, first=True) for n in (1, 2)] == [False, True]
    assert [odd.half_done(n, Schedule.ACCO, None, first=False) for n in (2, 3)] == [False, True]
    assert [halves.half_done(n, Schedule.DPU, None) for n in (5, 6)] == [False, True]


def _simulate_half(micro_batch_s: float, round_s: float, policy: DynamicHalves, clock: list[float]) -> int:
    """One half of a rank whose micro-batches take ``micro_batch_s`` while a ``round_s`` round runs."""
    inflight = InFlight(FakeRound(clock[0], round_s, clock), RoundKind.COMMIT)
    inflight.everyone_in.set()
    count = 0
    while True:
        policy.micro_batch_started()
        clock[0] += micro_batch_s
        policy.micro_batch_ended()
        count += 1
        if policy.half_done(count, Schedule.ACCO, inflight):
            break
    clock[0] = max(clock[0], inflight.handle.launched_at + round_s)  # waits for the rest of the round
    policy.round_finished(round_s)
    return count


def test_dynamic_halves_a_faster_rank_computes_more_and_foresees_the_round_end() -> None:
    """Rounds of 0.3 s. A rank at 0.14 s per micro-batch: before two rounds were timed it computes until the round
    is done (3), then ends a half when the round is within half a micro-batch of its end (2: at 0.28 s). A rank
    twice as fast puts more micro-batches into the same rounds (5, then 4)."""
    clock = [0.0]
    slow = DynamicHalves(4, clock=lambda: clock[0])
    assert [_simulate_half(0.14, 0.3, slow, clock) for _ in range(5)] == [3, 3, 2, 2, 2]
    clock = [0.0]
    fast = DynamicHalves(4, clock=lambda: clock[0])
    assert [_simulate_half(0.07, 0.3, fast, clock) for _ in range(5)] == [5, 5, 4, 4, 4]


def test_dynamic_halves_bounds_and_the_rule_for_a_round_not_everyone_joined() -> None:
    clock = [10.0]
    policy = DynamicHalves(4, min_micro_batches=2, max_micro_batches=3, clock=lambda: clock[0])
    running = InFlight(FakeRound(10.0, 1.0, clock), RoundKind.ESTIMATE)
    assert not policy.half_done(1, Schedule.ACCO, None)  # below the minimum, even with no round in flight
    assert policy.half_done(2, Schedule.ACCO, None)
    assert not policy.half_done(2, Schedule.ACCO, running)
    assert not policy.half_done(3, Schedule.ACCO, running)  # the maximum, but a peer has not launched the round:
    running.everyone_in.set()  # waiting for it could deadlock (that peer may wait in the caller's collective)
    assert policy.half_done(3, Schedule.ACCO, running)  # the maximum
    running.everyone_in.clear()
    policy.round_s.extend([1.0, 1.0])
    policy.micro_batch_s.extend([0.5, 0.5])
    clock[0] = 10.8  # 0.2 s left, less than half a micro-batch: foreseen, but only once every rank joined it
    assert not policy.half_done(2, Schedule.ACCO, running)
    running.everyone_in.set()
    assert policy.half_done(2, Schedule.ACCO, running)
    assert policy.half_done(4, Schedule.SYNC, running) and not policy.half_done(3, Schedule.SYNC, running)


# ---- the buffer pair ------------------------------------------------------------------------------------------


def _pair(separate: bool) -> tuple[torch.nn.Linear, BufferPair]:
    model = torch.nn.Linear(3, 2).to(torch.bfloat16)
    params = list(model.parameters())
    layout = FlatLayout(params, ["w", "b"], [0, 0], world_size=1)
    pair = BufferPair(params, layout, torch.device("cpu"), separate=separate)
    pair.attach()
    return model, pair


def test_gradients_accumulate_in_fp32_and_the_round_takes_them_by_swap_or_copy() -> None:
    model, pair = _pair(separate=True)
    x = torch.ones(4, 3, dtype=torch.bfloat16)
    model(x).sum().backward()
    pair.grad_scale = 2.0
    model(x).sum().backward()
    assert model.weight.grad is None and pair.hook_calls == 4
    assert pair.accum.dtype == torch.float32
    torch.testing.assert_close(pair.grad_views[id(model.bias)], torch.full((2,), 12.0))  # 4 + 2 x 4
    first = pair.accum
    wire, lent = pair.hand_over(swap=False)
    assert wire is not first and lent is not None and not wire.any()  # a copy, which the round makes
    lent.take()  # (the round's first work, on its thread and stream)
    assert torch.equal(wire, first)  # half B goes on from the same sums
    sums = pair.accum.clone()
    handed, lent = pair.hand_over(swap=True)
    pair.restart(swap=True)
    assert handed is first and torch.equal(handed, sums) and lent is None  # swap: the round owns the step's sums
    # accumulation restarts elsewhere, with no zeroing pass: each view's next gradient is written over it
    assert pair.accum is not handed and not any(pair.written) and pair.stale
    model(x).sum().backward()
    assert torch.equal(handed, sums)  # the round's buffer is never touched by the main thread
    assert torch.equal(pair.grad_views[id(model.bias)], torch.full((2,), 8.0))  # 2 x 4: one backward, not added to 12
    pair.release()
    model(x).sum().backward()
    assert model.weight.grad is not None  # hooks gone: autograd's own .grad again


def test_a_lent_buffer_waits_for_the_rounds_copy_and_never_hangs_its_writer() -> None:
    """The next writer of ``accum`` waits until the round's copy is made (on another thread); a round that fails
    before its copy, or one never launched, releases it; the round's own thread never waits for itself."""
    made: list[str] = []
    lent = LentSums(lambda: made.append("copy"), torch.device("cpu"))
    writer = threading.Thread(target=lambda: (lent.wait(), made.append("write")))
    writer.start()
    writer.join(0.2)
    assert writer.is_alive() and made == []  # still waiting: no copy yet
    threading.Thread(target=lent.take, name=ROUND_THREAD).start()
    writer.join(5)
    assert made == ["copy", "write"]

    failed = LentSums(lambda: None, torch.device("cpu"))
    failed.release()  # (the round's future ended before its copy: RoundInFlight's done callback)
    failed.wait()  # returns
    mine: list[BaseException] = []
    own = LentSums(lambda: None, torch.device("cpu"))
    waiter = threading.Thread(target=lambda: _catch(own.wait, mine), name=ROUND_THREAD)
    waiter.start()
    waiter.join(5)
    assert isinstance(mine[0], AssertionError)

    model, pair = _pair(separate=True)
    model(torch.ones(1, 3, dtype=torch.bfloat16)).sum().backward()
    _, lent = pair.hand_over(swap=False)
    assert lent is not None
    pair.cancel_lend()  # the launch failed: the sums stay, and the next backward does not wait for a copy
    model(torch.ones(1, 3, dtype=torch.bfloat16)).sum().backward()
    assert pair.hook_calls == 4


def _catch(fn, into: list) -> None:  # noqa: ANN001
    try:
        fn()
    except BaseException as e:  # noqa: BLE001
        into.append(e)


class _FakeStream:
    """A CUDA stream as the engine sees it (its id, ``wait_stream``), logging what waits for what."""

    def __init__(self, name: str, log: list) -> None:
        self.name, self.log, self.stream_id = name, log, id(self)

    def wait_stream(self, other: _FakeStream) -> None:
        self.log.append(f"{self.name} waits for {other.name}")


@pytest.mark.parametrize("way", ["copy", "swap"])
def test_the_main_stream_waits_for_the_hooks_stream_before_the_sums_are_read(monkeypatch, way: str) -> None:
    """FSDP2 runs the gradient hooks on its reduce-scatter stream: the main stream waits for that stream (on the
    device) before anything reads or writes the sums after a backward, whatever FSDP's own end-of-backward wait
    does (``set_is_last_backward(False)`` skips it). Streams are faked: CUDA's ordering with no GPU here."""
    from hf_acco.engine import handover

    log: list[str] = []
    main, fsdp = _FakeStream("main", log), _FakeStream("fsdp reduce-scatter", log)
    current = {"stream": main}
    monkeypatch.setattr(handover, "current_stream", lambda device: current["stream"])
    model, pair = _pair(separate=True)
    pair.hook_streams = handover.HookStreams(torch.device("cuda"))  # the CPU pair, its ordering as on a GPU
    read = pair._zero_unwritten
    monkeypatch.setattr(pair, "_zero_unwritten", lambda: (log.append("sums read"), read()))

    def backward_on(stream: _FakeStream) -> None:
        current["stream"] = stream  # the hooks run with FSDP's stream current
        model(torch.ones(2, 3, dtype=torch.bfloat16)).sum().backward()
        current["stream"] = main

    backward_on(fsdp)
    backward_on(fsdp)
    pair.hand_over(swap=way == "swap")
    assert log == ["main waits for fsdp reduce-scatter", "sums read"]  # once, before the sums: streams noted once
    log.clear()
    pair.cancel_lend()
    pair.restart(way == "swap")
    backward_on(main)  # hooks on the main stream itself (no FSDP): nothing to wait for
    pair.hand_over(swap=False)
    assert log == ["sums read"]
    log.clear()
    pair.cancel_lend()
    backward_on(fsdp)
    pair.accum  # noqa: B018 - any use of ``accum`` by the main thread (a boundary's scratch) orders it too
    assert log == ["main waits for fsdp reduce-scatter"]


def test_one_buffer_without_overlap_goes_back_to_accumulating_after_the_round() -> None:
    model, pair = _pair(separate=False)
    model(torch.ones(1, 3, dtype=torch.bfloat16)).sum().backward()
    handed, lent = pair.hand_over(swap=True)
    assert handed is pair.accum and lent is None  # sync: the round works in the one buffer
    pair.round_returned()
    assert not any(pair.written) and pair.stale  # back to accumulating: what it holds is overwritten or zeroed
    assert pair.hand_over(swap=True)[0] is pair.accum and not pair.accum.any()  # a round of no gradient reads zeros


# ---- the step machine and the statistics ----------------------------------------------------------------------


def test_step_machine_table() -> None:
    assert STEP_END[Schedule.ACCO].load_first and not STEP_END[Schedule.ACCO].wait_at_once
    assert STEP_END[Schedule.DPU].load_first and not STEP_END[Schedule.DPU].wait_at_once
    assert STEP_END[Schedule.SYNC].wait_at_once and not STEP_END[Schedule.SYNC].load_first
    assert [schedule_at(Schedule.ACCO, s, 2) for s in range(4)] == [Schedule.SYNC] * 2 + [Schedule.ACCO] * 2
    assert first_phase(Schedule.ACCO) is Phase.ESTIMATE and first_phase(Schedule.DPU) is Phase.CORRECTION
    assert parse_settings("dpu", "dynamic", 3) == (Schedule.DPU, "dynamic")
    assert parse_settings("acco", "fixed", 3) == (Schedule.ACCO, "fixed")  # halves of 1 and 2
    with pytest.raises(ValueError, match="must be >= 2"):
        parse_settings("acco", "fixed", 1)


def test_statistics_count_each_round_once() -> None:
    stats = EngineStats()
    commit = RoundResult(RoundKind.COMMIT, 8.0, 4, 1.5, 0.2, local_weight=3.0)
    assert stats.round_finished(commit) and not stats.round_finished(commit)
    stats.wait_s = 0.1
    stats.step_ended(1, micro_batches=2)
    assert stats.last_step_stats["global_micro_batches"] == 4.0 and stats.last_step_stats["grad_norm"] == 1.5
    assert stats.last_step_stats["weight"] == 3.0 and stats.totals["weight"] == 3.0  # the round's, counted once
    saved = stats.state_dict()  # what a checkpoint keeps: readable by a version without the local weight
    assert "local_weight" not in saved["last_commit"]
    saved["last_commit"]["from_a_newer_version"] = 1.0  # and fields this version does not know are left aside
    resumed = EngineStats()
    resumed.load_state_dict(saved)
    assert resumed.last_commit == RoundResult(RoundKind.COMMIT, 8.0, 4, 1.5, 0.2)
    assert stats.totals["global_micro_batches"] == 4 and stats.totals["wait_s"] == 0.1 and stats.wait_s == 0.0


def _build_fails_then_backward(rank: int, world_size: int) -> bool:
    from hf_acco import ACCOOptimizer

    model = torch.nn.Linear(3, 2)
    with pytest.raises(ValueError, match="Invalid learning rate"):
        ACCOOptimizer(model.parameters(), lr=-1.0)  # the inner AdamW refuses it, after the buffers exist
    model(torch.ones(1, 3)).sum().backward()
    return model.weight.grad is not None


def test_a_failed_build_leaves_the_models_gradients_alone() -> None:
    from hf_acco.tools.multiprocess import run_ranks

    assert run_ranks(_build_fails_then_backward, world_size=1) == [True]


@pytest.mark.parametrize("numel", [4 * 6 * 3 - 5, 4 * 7 * 3 - 1])  # even and odd chunks
@pytest.mark.parametrize("world_size", [4, 5, 6, 8])
def test_the_shard_gradient_beside_a_ranks_own_pieces_never_touches_them(numel: int, world_size: int) -> None:
    """In a bf16 round buffer each bucket's fp32 gradient row lies in that bucket, 4-byte aligned, clear of this
    rank's own (output) piece; a bucket of odd length keeps its own gradient."""
    params = [torch.nn.Parameter(torch.zeros(numel, dtype=torch.bfloat16))]
    layout = FlatLayout(params, ["w"], [0], world_size=world_size, bucket_numel=numel // 3)
    for rank in range(world_size):
        pair = BufferPair(params, layout, torch.device("cpu"), True, comm_dtype=torch.bfloat16, rank=rank)
        if world_size * layout.chunk % 2:
            assert pair.grad_room is None and pair.shard_grad_of(pair.wire) is None
            continue
        assert pair.grad_room == "beside"
        rows, buf = pair.shard_grad_of(pair.wire), pair.wire
        assert rows.dtype == torch.float32 and rows.shape == (layout.num_buckets, layout.chunk)
        for b in range(layout.num_buckets):
            start = rows[b].data_ptr() - buf.data_ptr()
            end = start + rows[b].nbytes
            bucket = (b * layout.bucket_size * 2, (b + 1) * layout.bucket_size * 2)
            own = (
                (b * layout.bucket_size + rank * layout.chunk) * 2,
                (b * layout.bucket_size + (rank + 1) * layout.chunk) * 2,
            )
            assert start % 4 == 0 and bucket[0] <= start and end <= bucket[1]
            assert end <= own[0] or own[1] <= start


def test_the_fake_communicator_keeps_the_real_ones_signatures() -> None:
    """FakeComm stands in for Communicator in the round's tests: a renamed or reordered argument of the real one
    must show here, not pass unnoticed."""
    import inspect

    from hf_acco.comm.communicator import Communicator

    def shape(fn) -> list[tuple[str, object, bool]]:
        return [(p.name, p.kind, p.default is p.empty) for p in inspect.signature(fn).parameters.values()]

    methods = [n for n, v in vars(FakeComm).items() if callable(v) and not n.startswith("_")]
    assert methods, "FakeComm has no collective"
    for name in methods:
        assert shape(getattr(FakeComm, name)) == shape(getattr(Communicator, name)), name


def test_on_cuda_the_round_runs_on_a_high_priority_stream_of_its_own(monkeypatch) -> None:
    """The rule a GPU needs, checked without one: the runner asks CUDA for a stream of priority -1 (its highest)
    on the engine's device, and the round's thread selects that device before it runs anything."""
    from hf_acco.engine.runner import RoundRunner

    made, selected = [], []

    class Stream:
        def __init__(self, device=None, priority=0) -> None:
            made.append((device, priority))
            self.device = device

    monkeypatch.setattr(torch.cuda, "Stream", Stream)
    monkeypatch.setattr(torch.cuda, "set_device", selected.append)
    runner = RoundRunner(torch.device("cuda", 1))
    runner.shutdown()
    assert made == [(torch.device("cuda", 1), -1)]
    assert selected == [torch.device("cuda", 1)]
