"""When a half ends: fixed and dynamic accumulation, behind one question, "is this half done?" (pure Python).

``FixedHalves``: a set number of micro-batches per half (for acco ``micro_batches // 2`` in half A and the rest in
half B, e.g. 1 + 2 for 3; ``micro_batches`` for the one half of dpu and sync), the same on every rank:
reproducible.

``DynamicHalves``: each rank keeps computing micro-batches while the round in flight runs, and ends the half once
it has finished, or is expected to finish within half of this rank's next micro-batch (starting one more would
hold up the next round of every rank), with at least ``min_micro_batches`` and at most ``max_micro_batches`` (more
while a peer has not launched the round yet: waiting for it could wait on a rank blocked in the caller's own
collective). The expectation comes from this rank's recent micro-batch and round durations. During a synchronous
warm-up (no round to overlap) it counts like ``FixedHalves``.

``PacedHalves``: the caller ends each half and step, where the global batch's claimed micro-batches say (pacing.py);
a rank may have none in a half.
"""

from __future__ import annotations

import statistics
import threading
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Protocol

from hf_acco.engine.schedule import Accumulation, RoundKind, Schedule


class _Handle(Protocol):
    launched_at: float

    def done(self) -> bool: ...


@dataclass
class InFlight:
    """The round in flight, as the main thread sees it."""

    handle: _Handle
    kind: RoundKind
    everyone_in: threading.Event = field(default_factory=threading.Event)  # every rank has launched it


def round_ends_soon(elapsed_s: float, round_s: Sequence[float], micro_batch_s: Sequence[float]) -> bool:
    """Whether a round ``elapsed_s`` into its run is expected to end within half of the next micro-batch.

    Expected durations are the medians of the last rounds (``round_s``) and micro-batches (``micro_batch_s``); with
    fewer than two of either there is no estimate, and the answer is no."""
    if len(micro_batch_s) < 2 or len(round_s) < 2:
        return False
    return statistics.median(round_s) - elapsed_s < 0.5 * statistics.median(micro_batch_s)


class FixedHalves:
    """``micro_batches`` per optimizer step per rank: for acco ``micro_batches // 2`` in half A (``first``) and the
    rest in half B; all of them otherwise."""

    def __init__(self, micro_batches: int, min_micro_batches: int = 1, max_micro_batches: int | None = None) -> None:
        self.micro_batches = micro_batches
        self.min_micro_batches = min_micro_batches  # dynamic mode's bounds per half (unused here)
        self.max_micro_batches = max_micro_batches

    def half_done(self, count: int, schedule: Schedule, inflight: InFlight | None, first: bool = True) -> bool:
        if schedule is not Schedule.ACCO:
            return count >= self.micro_batches
        half_a = self.micro_batches // 2
        return count >= (half_a if first else self.micro_batches - half_a)

    # the timings only the dynamic policy uses
    def micro_batch_started(self) -> None:
        pass

    def micro_batch_ended(self) -> None:
        pass

    def round_finished(self, seconds: float) -> None:
        pass


class PacedHalves(FixedHalves):
    """No half ends by itself: the caller ends them (``ACCOOptimizer.end_half`` and ``end_step``), where its claimed
    micro-batches cross a half's share of the global batch (pacing.py)."""

    def half_done(self, count: int, schedule: Schedule, inflight: InFlight | None, first: bool = True) -> bool:
        return False


class DynamicHalves(FixedHalves):
    """Compute until the round in flight is done or about to be (see the module docstring).

    Args:
        micro_batches: micro-batches per step during a synchronous warm-up.
        min_micro_batches, max_micro_batches: bounds per half per rank.
        clock: seconds, monotonic (tests pass a fake one).
    """

    def __init__(
        self,
        micro_batches: int,
        min_micro_batches: int = 1,
        max_micro_batches: int | None = None,
        clock: Callable[[], float] = time.perf_counter,
    ) -> None:
        super().__init__(micro_batches, min_micro_batches, max_micro_batches)
        self.clock = clock
        self.micro_batch_s: deque[float] = deque(maxlen=8)  # this rank's last micro-batches
        self.round_s: deque[float] = deque(maxlen=4)  # and rounds
        self._started: float | None = None

    def half_done(self, count: int, schedule: Schedule, inflight: InFlight | None, first: bool = True) -> bool:
        if schedule is Schedule.SYNC:
            return super().half_done(count, schedule, inflight, first)
        if count < self.min_micro_batches:
            return False
        if inflight is None or inflight.handle.done():
            return True
        if self.max_micro_batches is not None and count >= self.max_micro_batches:
            # the boundary waits for the round in flight: only once every rank has launched it (see below)
            return inflight.everyone_in.is_set()
        return self._round_ends_soon(inflight)

    def _round_ends_soon(self, inflight: InFlight) -> bool:
        """Only once every rank has joined the round (its counts all-reduce is done here): a rank must never block on
        a round that another rank has not launched yet, since that rank may be waiting in a collective of the
        caller's (Trainer's logging gather, a loss all-reduce) that this one would then never reach."""
        if not inflight.everyone_in.is_set():
            return False
        elapsed = self.clock() - inflight.handle.launched_at
        return round_ends_soon(elapsed, self.round_s, self.micro_batch_s)

    def micro_batch_started(self) -> None:
        self._started = self.clock()

    def micro_batch_ended(self) -> None:
        if self._started is not None:
            self.micro_batch_s.append(self.clock() - self._started)
        self._started = None

    def round_finished(self, seconds: float) -> None:
        self.round_s.append(seconds)


def halves_for(accumulation: Accumulation, micro_batches: int, least: int, most: int | None) -> FixedHalves:
    """The policy that ends the halves in this accumulation mode, for its micro-batch counts."""
    policy = {Accumulation.FIXED: FixedHalves, Accumulation.DYNAMIC: DynamicHalves, Accumulation.PACED: PacedHalves}
    return policy[accumulation](micro_batches, least, most)
