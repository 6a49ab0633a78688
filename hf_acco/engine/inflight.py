"""The round in flight: launched one at a time on the background runner, waited for, its output loaded.

Main-thread side of a round. Invariants: at most one round is in flight; from ``launch`` until its output has been
loaded, the round owns ``buffers.wire`` (the main thread only accumulates into ``buffers.accum``); on CUDA the
runner orders the round's stream after the launch and the main stream after ``wait`` (see ``runner.RoundRunner``).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import torch

from hf_acco.engine.buffers import BufferPair
from hf_acco.engine.halves import FixedHalves, InFlight
from hf_acco.engine.handover import LentSums
from hf_acco.engine.rounds import RoundBody, RoundResult
from hf_acco.engine.runner import CompletedRound, RoundRunner
from hf_acco.engine.schedule import RoundKind
from hf_acco.engine.stats import EngineStats


class RoundInFlight:
    """Launch, wait for and load the rounds of one engine (``body`` runs each on the background thread)."""

    def __init__(self, body: RoundBody, buffers: BufferPair, stats: EngineStats, halves: FixedHalves) -> None:
        self.body, self.buffers, self.stats, self.halves = body, buffers, stats, halves
        self.runner = RoundRunner(buffers.device)
        self.current: InFlight | None = None  # launched, output not yet loaded into the model

    @property
    def kind(self) -> RoundKind | None:
        return None if self.current is None else self.current.kind

    def launch(
        self,
        kind: RoundKind,
        weight: float | torch.Tensor,
        micro_batches: int,
        joined: bool,
        swap: bool,
        hparams: list,
        label: str,
        before: Callable[[], torch.cuda.Event | None] | None = None,
    ) -> None:
        """Hand ``accum``'s sums to a new round (swapped or copied, see ``BufferPair``) and start it. ``before`` runs
        first on the round's thread and stream (the boundary's copy of the model, see ``BoundaryState.capture``);
        the round's ``done`` event comes after the work it queued, on whatever stream (the event it returns)."""
        if self.current is not None:
            raise AssertionError("a round is still in flight")  # invariant: one round at a time
        buf, lent = self.buffers.hand_over(swap)  # from here on the round owns ``buf``
        try:
            counts = [weight, float(micro_batches), 1.0 if joined else 0.0]
            inflight = self._start(kind, buf, lent, swap, hparams, label, before, counts)
        except BaseException:
            self.buffers.cancel_lend()  # never launched: the sums stay in ``accum``, no copy to wait for
            raise
        self.current = inflight
        self.buffers.restart(swap)

    def _start(
        self,
        kind: RoundKind,
        buf: torch.Tensor,
        lent: LentSums | None,
        swap: bool,
        hparams: list,
        label: str,
        before: Callable[[], torch.cuda.Event | None] | None,
        counts: list,
    ) -> InFlight:
        """Launch the round over ``buf`` (``lent``: the copy of the sums it makes first). ``counts``: to the host
        group; a weight on the device is read by the round (the main thread never waits on it)."""
        grads, params = self.buffers.grads_of(buf), self.buffers.params_of(buf)
        touched = self.buffers.take_touched(reset=swap)  # the parameters these sums hold a gradient of
        inflight = InFlight(None, kind)  # type: ignore[arg-type]
        everyone_in = inflight.everyone_in

        def run() -> RoundResult:
            if lent is not None:  # the half's sums into ``buf`` first: the next writer of ``accum`` waits for it
                lent.take()
            copied = before() if before is not None else None
            try:
                return self.body(kind, grads, params, counts, hparams, everyone_in, label, touched)
            finally:  # the round stream waits for the copy before its ``done`` (or failure) event, whatever happens
                if copied is not None:
                    torch.cuda.current_stream().wait_event(copied)

        inflight.handle = self.runner.launch(run)
        if lent is not None:  # a round that fails before its copy must not leave the next writer of ``accum`` waiting
            inflight.handle.future.add_done_callback(lambda _: lent.release())
        return inflight

    def completed(self, kind: RoundKind) -> None:
        """A round whose output is already in ``buffers.wire`` (its parameters' view; after a resume)."""
        self.current = InFlight(CompletedRound(), kind)

    def wait(self) -> None:
        """Wait for the round in flight; its output stays pending (not loaded)."""
        if self.current is not None:
            self.stats.wait_s += self._wait()

    def wait_and_load(self) -> None:
        """Wait for the round in flight and copy its all-gathered parameters into the model."""
        if self.current is None:
            return
        self.stats.wait_s += self._wait()
        self.current = None  # consumed before it is loaded: a load that fails is never applied twice (packed: adds)
        self.buffers.load_round_output()
        self.buffers.round_returned()

    def drop(self) -> None:
        self.current = None

    def _wait(self) -> float:
        t0 = time.perf_counter()
        try:
            result: Any = self.current.handle.wait()  # type: ignore[union-attr]
        except BaseException:
            self.current = None  # that round is over; report its error once
            raise
        if isinstance(result, RoundResult) and self.stats.round_finished(result):
            self.halves.round_finished(result.seconds)
        return time.perf_counter() - t0

    def shutdown(self) -> None:
        self.runner.shutdown()

    def restart_runner(self) -> None:
        """A new background thread after ``shutdown`` (nothing is in flight then)."""
        self.current = None
        self.runner = RoundRunner(self.buffers.device)
