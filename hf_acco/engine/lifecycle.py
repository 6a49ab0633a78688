"""The engine's modes and life: evaluation at the committed parameters, a common step boundary for every rank,
the end of training, closing and reopening. A part of ``ACCOOptimizer`` (``core.py``), which keeps the step
machine; here, only what moves the engine between training and the rest.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import TYPE_CHECKING

import torch

from hf_acco.comm.communicator import Communicator
from hf_acco.engine.buffers import BufferPair
from hf_acco.engine.inflight import RoundInFlight
from hf_acco.engine.rounds import RoundResult
from hf_acco.engine.schedule import Accumulation, Phase, RoundKind, Schedule
from hf_acco.engine.shard_state import BoundaryState


class EngineLifecycle:
    """Eval mode, ``rendezvous``, ``finalize``, ``close`` and ``reopen`` of ``ACCOOptimizer`` (its base)."""

    # what the facade builds (core.py)
    accumulation: Accumulation
    buffers: BufferPair
    comm: Communicator
    phase: Phase
    rounds: RoundInFlight
    step_count: int
    _boundary: BoundaryState
    _closed: bool
    _half_count: int
    _joined: bool
    _model_moved: bool
    _step_counts: list[tuple[int, float | torch.Tensor]]
    last_commit: RoundResult | None

    def synchronize(self) -> None:
        """Wait for the round in flight (its output stays pending, as it would without the wait)."""
        self.rounds.wait()

    @contextlib.contextmanager
    def committed_parameters(self) -> Iterator[None]:
        """Inside, the model holds the committed parameters θ (not the estimate): evaluate or save there."""
        if self.buffers.evaluating:
            yield
            return
        self.eval()
        try:
            yield
        finally:
            self.train()

    def eval(self) -> None:
        """Put the committed parameters θ into the model (Trainer calls this before evaluating)."""
        if self.buffers.evaluating:
            return
        self.synchronize()
        at_boundary = not (self._half_count or self._step_counts or self.buffers.hook_calls)
        self.buffers.enter_eval(self.rounds.kind is RoundKind.COMMIT, at_boundary)  # else the model holds θ already

    def train(self) -> None:
        """Give the model back what training computes with (Trainer calls this before every micro-batch)."""
        if self.buffers.evaluating:
            self.buffers.leave_eval()

    @torch.no_grad()
    def rendezvous(self) -> None:
        """Bring every rank to one common optimizer-step boundary. Collective; ranks may arrive at any time.

        In dynamic mode ranks run independently between rounds, so at a given point of the caller's loop they
        can be a round apart (and, at the end of their data, have different amounts left). This rank ends its
        current step with what it has, then takes part in rounds with no micro-batch (they average only the
        others' gradients) until a commit round shows that every rank had joined. Fixed mode keeps ranks in
        step already: there it only checks that the caller is at a step boundary.
        """
        self.train()
        if self.accumulation is not Accumulation.DYNAMIC:  # fixed and paced keep ranks in step already
            self._check_step_boundary("rendezvous")
            return
        self._joined = True
        try:
            while True:
                if self.phase is Phase.ESTIMATE and self._schedule_now() is Schedule.ACCO:
                    self._boundary_estimate_to_correction()
                self._end_step()
                self.synchronize()
                if self.last_commit is not None and self.last_commit.joined == self.comm.world_size:
                    break
        finally:
            self._joined = False

    @torch.no_grad()
    def finalize(self) -> None:
        """End of training: drain the round in flight and leave the committed parameters in the model.

        A step cut short (training stopped in the middle of one) is dropped, as an optimizer step that never
        happened. Training may continue afterwards: it restarts from θ as at the start (θ̃ = θ).
        """
        self.train()
        if self.accumulation is Accumulation.DYNAMIC:
            self.rendezvous()  # ranks may be a round apart: finish together (collective)
        self.synchronize()
        if self.rounds.kind is RoundKind.COMMIT:
            self.buffers.load_round_output()
        self.rounds.drop()
        self._model_moved, self._boundary.pending = False, False  # the model holds θ: a boundary, nothing pending
        self.buffers.release_accum()
        self._restart_step()

    def close(self) -> None:
        """Drain the round in flight and release the background thread and the gradient hooks (``reopen`` takes
        them again)."""
        try:
            self.synchronize()
        finally:
            self.rounds.shutdown()
            self.buffers.release()
            self.comm.destroy()  # no process group outlives its engine (NCCL communicators would pile up)
            self._closed = True

    @property
    def closed(self) -> bool:
        return self._closed

    @property
    def pristine(self) -> bool:
        """Nothing accumulated, launched or stepped since it was built."""
        counted = self._half_count or self._step_counts or self.buffers.hook_calls
        return self.step_count == 0 and self.rounds.current is None and not counted

    def reopen(self) -> None:
        """After ``finalize()`` and ``close()``: train again with the same state (hooks and a thread again)."""
        if not self._closed:
            return
        self.comm.reopen()  # collective: every rank reopens at the same point (Trainer: in train())
        self.rounds.restart_runner()
        self._restart_step()
        self.buffers.attach()
        self._closed = False

    if TYPE_CHECKING:  # the step machine's transitions, in core.py

        def _schedule_now(self) -> Schedule: ...
        def _boundary_estimate_to_correction(self) -> None: ...
        def _end_step(self) -> None: ...
        def _restart_step(self) -> None: ...
        def _check_step_boundary(self, what: str) -> None: ...
