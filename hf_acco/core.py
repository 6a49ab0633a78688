"""ACCO: Accumulate While You Communicate (Nabli et al., arXiv 2406.02613), as a torch optimizer.

Each optimizer step has two halves of micro-batches, and each half overlaps one background round
(reduce-scatter, sharded optimizer update, all-gather):

    main thread:  | half A: grads at estimate θ̃_t |  half B: grads at committed θ_t  | half A of t+1 ...
    round:        | commit round of t-1 -> θ_t     |  estimate round -> θ̃_{t+1}      | commit round of t -> θ_{t+1}
    boundary A→B: load θ_t, launch estimate with G_A;   boundary B→A (``step()``): load θ̃_{t+1}, commit with G_A+G_B

The estimate round's optimizer update is a look-ahead: master weights and optimizer state stay as they are.
The same engine runs the baselines: ``dpu`` (one-step delayed update, one round per step) and ``sync``
(ZeRO-1 with no overlap). ``fixed`` accumulation gives each half a set number of micro-batches per rank
(reproducible); ``dynamic`` keeps computing micro-batches until the round in flight has finished, or is
expected to finish within half of this rank's next micro-batch (starting it would hold up the next round).

Usage (a hand-written loop; ``loss`` is a mean over the micro-batch, or a sum with ``weight`` = its tokens)::

    opt = ACCOOptimizer(model.parameters(), lr=3e-4, micro_batches=4)   # collective: all ranks
    for batch in loader:
        model(**batch).loss.backward()
        opt.after_backward()                 # may cross the A→B boundary and launch the estimate round
        if opt.ready_to_step():
            opt.step(); scheduler.step()     # B→A boundary: model gets θ̃_{t+1}, commit round launched

Limitations: element-wise optimizers only; all trainable parameters on one device; gradients reach the engine
through post-accumulate-grad hooks, so ``p.grad`` stays ``None`` (clip with ``max_grad_norm``, not
``clip_grad_norm_``); the model holds the estimate θ̃ between steps: evaluate and save inside
``committed_parameters()``.
"""

from __future__ import annotations

import contextlib
import statistics
import threading
import time
from collections import deque
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from enum import Enum
from typing import Any

import torch
import torch.distributed as dist

from .comm import Communicator, CompletedRound, RoundHandle, RoundRunner
from .optim import ShardOptimizer, check_elementwise
from .sharding import FlatLayout, unshard

STATE_FORMAT = 1
_HPARAM_SKIP = ("params", "param_names")


class Schedule(str, Enum):
    ACCO = "acco"  # estimate + correction halves, two rounds per step
    DPU = "dpu"  # one-step delayed update, one round per step
    SYNC = "sync"  # ZeRO-1, round waited for at once


class Accumulation(str, Enum):
    FIXED = "fixed"
    DYNAMIC = "dynamic"


class Phase(Enum):
    ESTIMATE = "estimate"  # half A: gradients at the estimate θ̃_t (ACCO only)
    CORRECTION = "correction"  # half B: gradients at the committed θ_t; the only phase of dpu and sync


class RoundKind(Enum):
    ESTIMATE = "estimate"  # look-ahead update, state not kept
    COMMIT = "commit"  # optimizer step, kept


@dataclass
class RoundResult:
    kind: RoundKind
    weight: float  # global sum of micro-batch weights (micro-batches or tokens) the gradient was divided by
    micro_batches: int  # global micro-batch count
    grad_norm: float  # global norm of the averaged gradient, before clipping
    seconds: float  # wall time of the round in the background thread
    joined: int = 0  # ranks that were in a rendezvous when they launched this round
    skipped: bool = False  # the averaged gradient was not finite: no update (the same decision on every rank)


def round_ends_soon(elapsed_s: float, round_s: Sequence[float], micro_batch_s: Sequence[float]) -> bool:
    """Whether a round ``elapsed_s`` into its run is expected to end within half of the next micro-batch.

    Expected durations are the medians of the last rounds (``round_s``) and micro-batches (``micro_batch_s``); with
    fewer than two of either there is no estimate, and the answer is no."""
    if len(micro_batch_s) < 2 or len(round_s) < 2:
        return False
    return statistics.median(round_s) - elapsed_s < 0.5 * statistics.median(micro_batch_s)


def _enum(cls: type[Enum], value: Any, what: str) -> Any:
    try:
        return cls(value)
    except ValueError:
        allowed = ", ".join(repr(m.value) for m in cls)  # type: ignore[attr-defined]
        raise ValueError(f"{what} must be one of {allowed}, got {value!r}") from None


class ACCOOptimizer(torch.optim.Optimizer):
    """ZeRO-1 sharded optimizer whose communication runs in the background (ACCO, DPU or synchronous).

    Building it is collective: every rank of ``group`` must build it at the same point.

    Args:
        params: parameters or parameter groups (or ``named_parameters()``), as for any torch optimizer.
            Parameters with ``requires_grad=False`` are left out; each parameter object is counted once.
        optimizer_cls (`type`, defaults to `torch.optim.AdamW`): the element-wise inner optimizer.
        schedule (`str`, defaults to `"acco"`): ``"acco"``, ``"dpu"`` or ``"sync"``.
        accumulation (`str`, defaults to `"fixed"`): ``"fixed"`` or ``"dynamic"``.
        micro_batches (`int`, defaults to 2): fixed mode: micro-batches per optimizer step per rank (even for
            acco: half of them per half).
        min_micro_batches (`int`, defaults to 1): dynamic mode: least micro-batches per half per rank.
        max_micro_batches (`int`, *optional*): dynamic mode: most micro-batches per half per rank.
        max_grad_norm (`float`, *optional*): clip the averaged gradient to this global norm.
        warmup_steps (`int`, defaults to 0): synchronous steps before the schedule starts.
        group (`ProcessGroup`, *optional*): ranks to train over; ``None`` is the world.
        communicator (`Communicator`, *optional*): injected collectives (tests wrap it to slow rounds down).
        bucket_numel (`int`, *optional*): elements per communication bucket; default: about 16 buckets of
            256 KiB to 16 MiB each (several in flight keep the link busy both ways).
        allow_custom_optimizer (`bool`): accept an ``optimizer_cls`` not known to be element-wise.
        broadcast_parameters (`bool`, defaults to `True`): copy rank 0's parameters to every rank.
        auto_step (`bool`, defaults to `False`): ``after_backward`` ends the optimizer step itself when it is
            ready, and ``step()`` only marks the caller's window (for dynamic accumulation inside a loop whose
            windows are a fixed number of micro-batches, such as Trainer's).
        nonfinite (`str`, defaults to `"skip"`): when the averaged gradient has an inf or NaN (seen by every rank
            in the all-reduced norm, so all take the same decision): ``"skip"`` the update (master, state and
            estimate stay as they are; counted in ``totals["skipped_steps"]``) or ``"error"``: stop with an error.
        **defaults: hyper-parameters of the inner optimizer (``lr``, ``weight_decay``, ``betas``, ...).
    """

    def __init__(
        self,
        params: Iterable[Any],
        *,
        optimizer_cls: type[torch.optim.Optimizer] = torch.optim.AdamW,
        schedule: str = "acco",
        accumulation: str = "fixed",
        micro_batches: int = 2,
        min_micro_batches: int = 1,
        max_micro_batches: int | None = None,
        max_grad_norm: float | None = None,
        warmup_steps: int = 0,
        group: dist.ProcessGroup | None = None,
        communicator: Communicator | None = None,
        bucket_numel: int | None = None,
        allow_custom_optimizer: bool = False,
        broadcast_parameters: bool = True,
        auto_step: bool = False,
        nonfinite: str = "skip",
        **defaults: Any,
    ) -> None:
        check_elementwise(optimizer_cls, allow_custom_optimizer)
        self.schedule = _enum(Schedule, schedule, "schedule")
        self.accumulation = _enum(Accumulation, accumulation, "accumulation")
        _check_counts(self.schedule, self.accumulation, micro_batches, min_micro_batches, max_micro_batches)
        self.micro_batches = micro_batches
        self.min_micro_batches = min_micro_batches
        self.max_micro_batches = max_micro_batches
        self.max_grad_norm = max_grad_norm
        self.warmup_steps = warmup_steps
        self.auto_step = auto_step
        if nonfinite not in ("skip", "error"):
            raise ValueError(f"nonfinite must be 'skip' or 'error', got {nonfinite!r}")
        self.nonfinite = nonfinite
        self.grad_scale = 1.0  # multiplies the gradients of the next backward passes as they are accumulated
        super().__init__(params, defaults)
        named = _trainable(self.param_groups)
        self._params = [p for _, p, _ in named]
        self.comm = communicator if communicator is not None else Communicator(group)
        self.layout = FlatLayout(
            self._params, [n for n, _, _ in named], [g for _, _, g in named], self.comm.world_size, bucket_numel
        )
        self.device = self._params[0].device
        self._check_devices()
        self._check_same_layout_everywhere()

        # Buffers. ``_accum``: the main thread's fp32 gradient sums. ``_comm``: owned by the round in flight
        # (gradients in, parameters out); the main thread touches it only between wait() and the next launch.
        # The synchronous schedule has no overlap, so its round works in ``_accum`` and needs no second buffer.
        self._accum = self.layout.new_flat(self.device)
        self._comm = self._accum if self.schedule is Schedule.SYNC else self.layout.new_flat(self.device)
        self.layout.flatten(self._params, self._accum)
        if broadcast_parameters:
            self.comm.broadcast(self._accum)  # identical initial parameters on every rank
            self._load_into_model(self._accum)
        self.shard = ShardOptimizer(
            self.layout.shard_of(self._accum, self.comm.rank),
            self.layout.shard_segments(self.comm.rank),
            self._hparams(),
            optimizer_cls,
            dict(defaults),
            piece_numel=self.layout.chunk,
        )
        self._accum.zero_()
        # The state at the last optimizer-step boundary that is not in the master shard: this rank's shard of the
        # parameters the model computed with from there (ACCO's estimate, DPU's previous θ), and whether a commit
        # round was pending. It lets state_dict() describe that boundary exactly even from the middle of a step.
        self._boundary_model = self.shard.master.clone()
        self._boundary_pending = False
        self._param_pieces = self.layout.shard_param_pieces(self.comm.rank)
        self._hooks = [p.register_post_accumulate_grad_hook(self._grad_hook) for p in self._params]
        # per-parameter views of each full-size buffer, made once: the two buffers swap roles every step
        self._views_of = {
            id(buf): {id(p): v for p, v in zip(self._params, self.layout.views(buf))}
            for buf in (self._accum, self._comm)
        }
        self._grad_views = self._views_of[id(self._accum)]
        self._runner = RoundRunner(self.device)

        # Schedule state.
        self.step_count = 0  # committed optimizer steps launched
        self.phase = Phase.ESTIMATE if self._schedule_now() is Schedule.ACCO else Phase.CORRECTION
        self._inflight: RoundHandle | None = None  # launched, output not yet loaded into the model
        self._inflight_kind: RoundKind | None = None
        self._half_count = 0  # micro-batches in the current half (this rank)
        self._half_weight = 0.0
        self._step_counts: list[tuple[int, float]] = []  # (micro-batches, weight) of finished halves of this step
        self._hook_calls = 0
        self._wait_s = 0.0
        self._rounds: list[RoundResult] = []
        # dynamic mode: this rank's recent micro-batch and round durations, to foresee the end of a round
        self._micro_batch_s: deque[float] = deque(maxlen=8)
        self._round_s: deque[float] = deque(maxlen=4)
        self._micro_batch_clock: float | None = None
        self._round_everyone_in = threading.Event()  # of the round in flight: every rank has launched it
        self.last_step_stats: dict[str, float] = {}
        self.last_commit: RoundResult | None = None  # the latest commit round waited for
        # since the start: this rank's steps, micro-batches and weight; every commit round's global micro-batches
        totals = ("steps", "micro_batches", "weight", "wait_s", "round_s", "skipped_steps", "global_micro_batches")
        self.totals = dict.fromkeys(totals, 0.0)
        self._in_eval = False
        self._eval_backup: torch.Tensor | None = None
        self._joined = False  # in a rendezvous: this rank computes nothing until every rank has joined

    # ---- the user's loop ----------------------------------------------------------------------------------

    def after_backward(self, weight: float = 1.0) -> None:
        """Count one micro-batch whose gradients were just accumulated; may cross the A→B boundary.

        ``weight`` is what the gradient is averaged by: 1 when the loss is a mean over the micro-batch
        (average by micro-batch count), or the number of tokens when the loss is their sum (token-weighted).
        """
        if self._in_eval:
            raise RuntimeError("The ACCO optimizer is in eval mode (committed parameters loaded): call train() first.")
        if self._half_count == 0 and not self._step_counts:  # first micro-batch of a step
            self._check_devices()
        self._clock_micro_batch()
        self._half_count += 1
        self._half_weight += float(weight)
        if self.phase is Phase.ESTIMATE and self._half_done():
            self._boundary_estimate_to_correction()
        if self.auto_step and self.ready_to_step():
            self._end_step()
        self._micro_batch_clock = time.perf_counter()  # the next micro-batch starts now, after any boundary

    def ready_to_step(self) -> bool:
        """Whether the current optimizer step has all its micro-batches (fixed) or its round finished (dynamic)."""
        return self.phase is Phase.CORRECTION and self._half_done()

    def step(self, closure: None = None) -> None:  # type: ignore[override]
        """End the optimizer step: the B→A boundary. May be called early (the short last window of an epoch).

        With ``auto_step`` the engine ends its steps itself and this does nothing.
        """
        if closure is not None:
            raise ValueError("ACCOOptimizer.step does not take a closure.")
        if not self.auto_step:
            self._end_step()

    @torch.no_grad()
    def _end_step(self) -> None:
        if self.phase is Phase.ESTIMATE:  # short window: half A was all there was, half B is empty
            if self._half_count == 0 and not self._joined:
                raise RuntimeError("ACCOOptimizer.step() was called before any micro-batch was accumulated.")
            self._boundary_estimate_to_correction()
        self._finish_half()
        if self._hook_calls == 0 and not self._joined:
            raise RuntimeError(
                "No gradient reached the ACCO optimizer during this step: were the model's parameters replaced "
                "after it was built, or was backward() never called?"
            )
        schedule = self._schedule_now()
        micro_batches = sum(c for c, _ in self._step_counts)
        weight = sum(w for _, w in self._step_counts)
        if schedule is Schedule.ACCO:
            self._wait_and_load(at_boundary=True)  # the estimate θ̃_{t+1}: next half A computes there
            self._launch_with_accum(RoundKind.COMMIT, weight, micro_batches, swap=True)
            self.phase = Phase.ESTIMATE
        elif schedule is Schedule.DPU:
            self._wait_and_load(at_boundary=True)  # θ_t from the previous step's round: next gradients there
            self._launch_with_accum(RoundKind.COMMIT, weight, micro_batches, swap=True)
        else:
            self._launch_with_accum(RoundKind.COMMIT, weight, micro_batches, swap=True)
            self._wait_and_load()
            self._boundary_model.copy_(self.shard.master)
        self._boundary_pending = self._inflight_kind is RoundKind.COMMIT
        self.step_count += 1
        self._record_step(micro_batches, weight)
        self._micro_batch_clock = time.perf_counter()
        if self._schedule_now() is Schedule.ACCO and schedule is not Schedule.ACCO:
            self.phase = Phase.ESTIMATE  # warm-up over: the estimate restarts from the committed θ
        elif self._schedule_now() is not Schedule.ACCO:
            self.phase = Phase.CORRECTION

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Gradients live in the engine's buffer (``p.grad`` is always ``None``): nothing to do."""
        for p in self._params:
            p.grad = None

    def synchronize(self) -> None:
        """Wait for the round in flight (its output stays pending, as it would without the wait)."""
        if self._inflight is not None:
            self._wait_s += self._wait(self._inflight)

    @contextlib.contextmanager
    def committed_parameters(self) -> Iterator[None]:
        """Inside, the model holds the committed parameters θ (not the estimate): evaluate or save there."""
        if self._in_eval:
            yield
            return
        self.eval()
        try:
            yield
        finally:
            self.train()

    def eval(self) -> None:
        """Put the committed parameters θ into the model (Trainer calls this before evaluating)."""
        if self._in_eval:
            return
        self.synchronize()
        if self._inflight_kind is RoundKind.COMMIT:  # else the model already holds θ
            self._eval_backup = self.layout.flatten(self._params, self.layout.new_flat(self.device))
            self._load_into_model(self._comm)
        self._in_eval = True

    def train(self) -> None:
        """Give the model back what training computes with (Trainer calls this before every micro-batch)."""
        if not self._in_eval:
            return
        if self._eval_backup is not None:
            self._load_into_model(self._eval_backup)
            self._eval_backup = None
        self._in_eval = False

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
        if self.accumulation is Accumulation.FIXED:
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
        if self._inflight_kind is RoundKind.COMMIT:
            self._load_into_model(self._comm)
        self._inflight, self._inflight_kind = None, None
        self._boundary_model.copy_(self.shard.master)  # the model now holds θ: a boundary with nothing pending
        self._boundary_pending = False
        self._accum.zero_()
        self._half_count, self._half_weight, self._step_counts, self._hook_calls = 0, 0.0, [], 0
        self.phase = Phase.ESTIMATE if self._schedule_now() is Schedule.ACCO else Phase.CORRECTION

    def close(self) -> None:
        """Drain the round in flight and release the background thread and the gradient hooks."""
        try:
            self.synchronize()
        finally:
            self._runner.shutdown()
            for h in self._hooks:
                h.remove()
            self._hooks = []

    # ---- state --------------------------------------------------------------------------------------------

    def state_dict(self) -> dict[str, Any]:  # type: ignore[override]
        """This rank's shard of everything an exact resume needs, as of the last optimizer-step boundary.

        Called in the middle of a step (a pre-emption checkpoint), it still describes that boundary: the
        micro-batches of the unfinished step are not in it, and a resumed run computes them again.
        """
        self.synchronize()  # the master shard is final once the commit round in flight has finished
        flat_state, scalars = self.shard.state_tensors()
        return {
            "format": STATE_FORMAT,
            "rank": self.comm.rank,
            "layout": self.layout.meta(),
            "schedule": self.schedule.value,
            "step_count": self.step_count,
            "pending_commit": self._boundary_pending,
            "hparams": self._hparams(),
            "master": self.shard.master.detach().cpu().clone(),
            "model": self._boundary_model.detach().cpu().clone(),
            "optim_state": {k: v.detach().cpu().clone() for k, v in flat_state.items()},
            "optim_scalars": {k: v.detach().cpu().clone() for k, v in scalars.items()},
        }

    @torch.no_grad()
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:  # type: ignore[override]
        """Load this rank's shard (same world size) or a consolidated state (any world size). Collective.

        Every rank validates its input first and the ranks agree before anything is changed: a bad shard on
        one rank raises on every rank (instead of leaving the others waiting in a collective).
        """
        error = None
        try:
            self._validate_state(state_dict)
        except (ValueError, RuntimeError) as e:
            error = e
        self.raise_if_any_rank_failed(error)
        shard = self._shard_getter(state_dict)
        self.train()
        self.synchronize()
        self.shard.master.copy_(shard(state_dict["master"]))
        self.shard.load_state_tensors(
            {k: shard(v) for k, v in state_dict["optim_state"].items()}, state_dict["optim_scalars"]
        )
        for group, hp in zip(self.param_groups, state_dict["hparams"]):
            group.update(hp)
        self.step_count = state_dict["step_count"]
        # The model: every rank's shard of what it held at the boundary (estimate, or θ_t for dpu).
        staging = self.layout.new_flat(self.device)
        self._put_own_pieces(staging, shard(state_dict["model"]))
        self.comm.all_gather(self.layout, None, staging)
        self._load_into_model(staging)
        # A commit round that was pending at save time: its output is the all-gather of the master shards.
        self._boundary_model.copy_(shard(state_dict["model"]))
        self._boundary_pending = state_dict["pending_commit"]
        self._inflight, self._inflight_kind = None, None
        if state_dict["pending_commit"]:
            self._put_own_pieces(self._comm, self.shard.master)
            self.comm.all_gather(self.layout, None, self._comm)
            self._inflight, self._inflight_kind = CompletedRound(), RoundKind.COMMIT
        self.phase = Phase.ESTIMATE if self._schedule_now() is Schedule.ACCO else Phase.CORRECTION

    def raise_if_any_rank_failed(self, error: Exception | None) -> None:
        """Collective: raise ``error`` here, and an explanation on every other rank, if any rank has one."""
        failed = torch.tensor([0.0 if error is None else 1.0], device=self.device)
        self.comm.all_reduce(failed, op=dist.ReduceOp.MAX)
        if error is not None:
            raise error
        if failed.item():
            raise RuntimeError(
                "Another rank could not load its ACCO optimizer state (see its error); nothing was loaded."
            )

    def _validate_state(self, state_dict: dict[str, Any]) -> None:
        self._check_step_boundary("load_state_dict")
        if not isinstance(state_dict, dict) or state_dict.get("format") != STATE_FORMAT:
            raise ValueError("Not an hf_acco optimizer state (missing or unknown 'format').")
        self.layout.check_matches(state_dict["layout"])
        if state_dict["schedule"] != self.schedule.value:
            raise ValueError(
                f"The checkpoint was written with schedule {state_dict['schedule']!r}, this run uses "
                f"{self.schedule.value!r}. Resume with the same schedule."
            )
        self._shard_getter(state_dict)

    # ---- internals: boundaries ----------------------------------------------------------------------------

    def _half_done(self) -> bool:
        if self.accumulation is Accumulation.FIXED or self._schedule_now() is Schedule.SYNC:
            per_half = self.micro_batches // 2 if self._schedule_now() is Schedule.ACCO else self.micro_batches
            return self._half_count >= per_half
        if self._half_count < self.min_micro_batches:
            return False
        if self.max_micro_batches is not None and self._half_count >= self.max_micro_batches:
            return True
        return self._inflight is None or self._inflight.done() or self._round_ends_soon(self._inflight)

    def _round_ends_soon(self, handle: RoundHandle) -> bool:
        """Dynamic mode: whether the round in flight is expected to end within half of this rank's next
        micro-batch. Then the half ends now: waiting idles this rank for less than what another micro-batch would
        hold up the next round of every rank (by its expected overshoot past the round's end). Estimates: the
        median of this rank's last micro-batches and rounds; none before two of each.

        Only once every rank has joined the round (its reduce-scatter is done here): a rank must never block on a
        round that another rank has not launched yet, since that rank may be waiting in a collective of the
        caller's (Trainer's logging gather, a loss all-reduce) that this one would then never reach."""
        if not self._round_everyone_in.is_set():
            return False
        return round_ends_soon(time.perf_counter() - handle.launched_at, self._round_s, self._micro_batch_s)

    def _clock_micro_batch(self) -> None:
        if self._micro_batch_clock is not None:
            self._micro_batch_s.append(time.perf_counter() - self._micro_batch_clock)
        self._micro_batch_clock = None

    @torch.no_grad()
    def _boundary_estimate_to_correction(self) -> None:
        # (a) wait for the commit round of the previous step and (b) load θ_t: half B computes at θ_t.
        self._wait_and_load()
        self._finish_half()
        micro_batches, weight = self._step_counts[-1]
        # (c) hand G_A to the round (copy: half B keeps accumulating on top of it), (d) launch the estimate.
        self._launch_with_accum(RoundKind.ESTIMATE, weight, micro_batches, swap=False)
        self.phase = Phase.CORRECTION

    def _finish_half(self) -> None:
        self._step_counts.append((self._half_count, self._half_weight))
        self._half_count, self._half_weight = 0, 0.0

    def _launch_with_accum(self, kind: RoundKind, weight: float, micro_batches: int, swap: bool) -> None:
        if self._inflight is not None:
            raise AssertionError("a round is still in flight")  # invariant: one round at a time
        if self._comm is not self._accum:
            if swap:  # the round takes the sums; the main thread restarts from the (zeroed) old round buffer
                self._comm, self._accum = self._accum, self._comm
                self._grad_views = self._views_of[id(self._accum)]
            else:
                self._comm.copy_(self._accum)
        joined = 1.0 if self._joined else 0.0
        counts = torch.tensor([weight, float(micro_batches), joined], dtype=torch.float64, device=self.device)
        buf, hparams = self._comm, self._hparams()  # hyper-parameters as of launch: schedulers mutate them
        everyone_in = self._round_everyone_in = threading.Event()
        self._inflight = self._runner.launch(lambda: self._round(kind, buf, counts, hparams, everyone_in))
        self._inflight_kind = kind
        if swap and self._comm is not self._accum:
            self._accum.zero_()

    def _wait_and_load(self, at_boundary: bool = False) -> None:
        """Wait for the round in flight and copy its all-gathered parameters into the model."""
        if self._inflight is None:
            return
        self._wait_s += self._wait(self._inflight)
        self._load_into_model(self._comm)
        if at_boundary:
            self._boundary_model.copy_(self._own_pieces(self._comm).reshape(-1))
        if self._comm is self._accum:  # sync: the buffer goes back to accumulating gradients
            self._accum.zero_()
        self._inflight, self._inflight_kind = None, None

    def _wait(self, handle: RoundHandle) -> float:
        t0 = time.perf_counter()
        try:
            result = handle.wait()
        except BaseException:
            self._inflight, self._inflight_kind = None, None  # that round is over; report its error once
            raise
        if isinstance(result, RoundResult) and (not self._rounds or self._rounds[-1] is not result):
            self._rounds.append(result)
            self._round_s.append(result.seconds)
            if result.kind is RoundKind.COMMIT:
                self.last_commit = result
                self.totals["skipped_steps"] += float(result.skipped)
                self.totals["global_micro_batches"] += result.micro_batches
        return time.perf_counter() - t0

    # ---- internals: the round (background thread; touches only ``buf`` and the shard) ---------------------

    def _round(
        self, kind: RoundKind, buf: torch.Tensor, counts: torch.Tensor, hparams: list[dict], all_in: threading.Event
    ) -> RoundResult:
        with self.comm.guard(f"{kind.value} round {self.step_count}"):
            return self._round_body(kind, buf, counts, hparams, all_in)

    @torch.no_grad()
    def _round_body(
        self, kind: RoundKind, buf: torch.Tensor, counts: torch.Tensor, hparams: list[dict], all_in: threading.Event
    ) -> RoundResult:
        t0 = time.perf_counter()
        layout, comm, shard = self.layout, self.comm, self.shard
        # 1. global weight and micro-batch count, asynchronously
        count_work = comm.all_reduce(counts, async_op=True)
        # 2. reduce-scatter: this rank's shard of the sum of every rank's gradient sums
        comm.reduce_scatter(layout, buf, shard.grad)
        count_work.wait()
        total_weight, total_micro_batches, joined = counts.tolist()  # on CUDA this waits for the all-reduce
        all_in.set()  # every rank has launched this round: it can finish without their main threads
        if total_weight <= 0 and joined == 0:
            raise ValueError(
                "The global weight of an ACCO round is 0 (no micro-batch or no tokens on any rank): check that "
                "the dataset is not empty and that labels are not all masked."
            )
        skipped = False
        if total_weight <= 0:  # a rendezvous round in which no rank had a micro-batch: no update (same everywhere)
            norm = torch.zeros(1, device=buf.device)
            self._put_own_pieces(buf, shard.master)
        else:
            # 3. average
            shard.grad.div_(total_weight)
            # 4. global gradient norm and clipping, as torch.nn.utils.clip_grad_norm_ computes them
            norm = self._global_grad_norm()
            skipped = not bool(torch.isfinite(norm).all())  # all-reduced: every rank decides the same
            if skipped and self.nonfinite == "error":
                raise FloatingPointError(
                    f"The averaged gradient of this {kind.value} round is not finite (global norm {norm.item()}) on "
                    "every rank. Lower the learning rate, check the data for bad examples, or train with "
                    "bf16 instead of fp16; or let ACCO skip such steps (nonfinite='skip')."
                )
            if skipped:  # 5. no update: the round hands back the committed parameters
                self._put_own_pieces(buf, shard.master)
            else:
                if self.max_grad_norm is not None:
                    shard.grad.mul_(torch.clamp(self.max_grad_norm / (norm + 1e-6), max=1.0))
                # 5. optimizer update, 6. written into this rank's pieces of ``buf``
                if kind is RoundKind.COMMIT:
                    shard.commit(hparams)
                    self._put_own_pieces(buf, shard.master)
                else:  # the look-ahead goes straight into this rank's pieces of ``buf``: no shard-sized temporary
                    shard.estimate(hparams, self._own_pieces(buf))
        # 7. all-gather
        comm.all_gather(layout, None, buf)
        seconds = time.perf_counter() - t0
        return RoundResult(kind, total_weight, int(total_micro_batches), norm.item(), seconds, int(joined), skipped)

    def _global_grad_norm(self) -> torch.Tensor:
        """Norm of the per-parameter norms (clip_grad_norm_'s formula, so that clipping matches it to the bit
        for parameters held by one rank): each rank adds its part of each parameter's squared norm."""
        grad = self.shard.grad
        partial = torch.zeros(len(self.layout.params), dtype=grad.dtype, device=grad.device)
        for i, a, b in self._param_pieces:
            partial[i] += torch.linalg.vector_norm(grad[a:b]).square()
        self.comm.all_reduce(partial)
        return torch.linalg.vector_norm(partial.sqrt()).reshape(1)

    def _own_pieces(self, flat: torch.Tensor) -> torch.Tensor:
        """This rank's pieces of a flat buffer, as a (num_buckets, chunk) view."""
        layout = self.layout
        return flat.view(layout.num_buckets, layout.world_size, layout.chunk)[:, self.comm.rank]

    def _put_own_pieces(self, flat: torch.Tensor, shard: torch.Tensor) -> None:
        self._own_pieces(flat).copy_(shard.view(self.layout.num_buckets, self.layout.chunk))

    # ---- internals: helpers -------------------------------------------------------------------------------

    def _grad_hook(self, p: torch.Tensor) -> None:
        # Runs when autograd has finished p's gradient for this backward: accumulate it in fp32, free it.
        if self.grad_scale == 1.0:
            self._grad_views[id(p)].add_(p.grad)
        else:
            self._grad_views[id(p)].add_(p.grad, alpha=self.grad_scale)
        p.grad = None
        self._hook_calls += 1

    @torch.no_grad()
    def _load_into_model(self, flat: torch.Tensor) -> None:
        torch._foreach_copy_(self._params, self.layout.views(flat))

    def _hparams(self) -> list[dict[str, Any]]:
        return [{k: v for k, v in g.items() if k not in _HPARAM_SKIP} for g in self.param_groups]

    def _schedule_now(self) -> Schedule:
        return Schedule.SYNC if self.step_count < self.warmup_steps else self.schedule

    def _record_step(self, micro_batches: int, weight: float) -> None:
        rounds, self._rounds = self._rounds, []
        commit = [r for r in rounds if r.kind is RoundKind.COMMIT]
        self.last_step_stats = {
            "step": float(self.step_count),
            "micro_batches": float(micro_batches),
            "weight": weight,
            "wait_s": self._wait_s,
            "round_s": sum(r.seconds for r in rounds),
        }
        if commit:  # the commit round that finished during this step (the previous step's, except for sync)
            self.last_step_stats.update(
                global_micro_batches=float(commit[-1].micro_batches),
                global_weight=commit[-1].weight,
                grad_norm=commit[-1].grad_norm,
            )
        for key, value in (
            ("steps", 1.0),
            ("micro_batches", micro_batches),
            ("weight", weight),
            ("wait_s", self._wait_s),
            ("round_s", self.last_step_stats["round_s"]),
        ):
            self.totals[key] += value
        self._step_counts, self._wait_s, self._hook_calls = [], 0.0, 0

    def _shard_getter(self, state_dict: dict[str, Any]):
        """Map a saved vector to this rank's shard: directly (same world size) or re-sharded (consolidated)."""
        saved_world = state_dict["layout"]["world_size"]
        if state_dict.get("consolidated"):
            return lambda v: self.layout.shard_of(self.layout.pad(v.to(self.device)), self.comm.rank)
        if saved_world != self.comm.world_size or state_dict["layout"]["chunk"] != self.layout.chunk:
            raise ValueError(
                f"This optimizer shard was written by a run with {saved_world} ranks; this run has "
                f"{self.comm.world_size}. Load every rank's shard and pass consolidate_state_dicts(shards) (or use "
                "hf_acco.checkpoint.load_optimizer_state, which does it) to re-shard."
            )
        if state_dict["rank"] != self.comm.rank:
            raise ValueError(f"Rank {self.comm.rank} was given the optimizer shard of rank {state_dict['rank']}.")
        return lambda v: v.to(self.device)

    def _check_step_boundary(self, what: str) -> None:
        if self._half_count or self._step_counts:
            raise RuntimeError(f"{what}() must be called between optimizer steps, not in the middle of one.")

    def _check_devices(self) -> None:
        for p, name in zip(self._params, self.layout.names):
            if p.device != self.device:
                raise RuntimeError(
                    f"Parameter {name} is on {p.device}, the ACCO optimizer on {self.device}: move the model to "
                    "its device before building the optimizer, and keep all trainable parameters on one device."
                )

    def _check_same_layout_everywhere(self) -> None:
        mine = torch.tensor([self.layout.numel, len(self._params)], dtype=torch.float64, device=self.device)
        lowest, highest = -mine, mine.clone()
        self.comm.all_reduce(lowest, op=dist.ReduceOp.MAX)
        self.comm.all_reduce(highest, op=dist.ReduceOp.MAX)
        if not torch.equal(-lowest, highest):
            raise RuntimeError(
                "Ranks disagree on the trainable parameters (count or size differ). Build the same model with "
                "the same frozen/LoRA setup on every rank."
            )


def consolidate_state_dicts(shards: list[dict[str, Any]]) -> dict[str, Any]:
    """Merge every rank's optimizer state into one, loadable on any number of ranks."""
    if not shards:
        raise ValueError("consolidate_state_dicts needs at least one shard")
    shards = sorted(shards, key=lambda s: s["rank"])
    meta = shards[0]["layout"]
    if [s["rank"] for s in shards] != list(range(meta["world_size"])):
        raise ValueError(f"need the shards of all {meta['world_size']} ranks, got ranks {[s['rank'] for s in shards]}")

    def merge(get) -> torch.Tensor:
        return unshard([get(s) for s in shards], meta["num_buckets"], meta["chunk"], meta["numel"])

    out = {k: v for k, v in shards[0].items() if k not in ("master", "model", "optim_state", "rank")}
    out.update(
        consolidated=True,
        master=merge(lambda s: s["master"]),
        model=merge(lambda s: s["model"]),
        optim_state={k: merge(lambda s, k=k: s["optim_state"][k]) for k in shards[0]["optim_state"]},
    )
    return out


def _trainable(param_groups: list[dict[str, Any]]) -> list[tuple[str, torch.Tensor, int]]:
    """(name, parameter, group index) of each trainable parameter, each object once; frozen ones removed."""
    seen: set[int] = set()
    out = []
    for gi, group in enumerate(param_groups):
        names = group.get("param_names") or [f"group{gi}.param{i}" for i in range(len(group["params"]))]
        kept, kept_names = [], []
        for name, p in zip(names, group["params"]):
            if not p.requires_grad or id(p) in seen:
                continue
            seen.add(id(p))
            out.append((name, p, gi))
            kept.append(p)
            kept_names.append(name)
        group["params"] = kept
        if "param_names" in group:
            group["param_names"] = kept_names
    if not out:
        raise ValueError(
            "ACCO found no trainable parameters: every parameter has requires_grad=False. Unfreeze at least one "
            "parameter (or attach a LoRA adapter) before building the optimizer."
        )
    return out


def validate_settings(
    schedule: str,
    accumulation: str,
    micro_batches: int,
    min_micro_batches: int = 1,
    max_micro_batches: int | None = None,
) -> None:
    """Raise a ValueError that says what to change if these ACCO settings cannot work together."""
    _check_counts(
        _enum(Schedule, schedule, "schedule"),
        _enum(Accumulation, accumulation, "accumulation"),
        micro_batches,
        min_micro_batches,
        max_micro_batches,
    )


def _check_counts(
    schedule: Schedule, accumulation: Accumulation, micro_batches: int, min_mb: int, max_mb: int | None
) -> None:
    if accumulation is Accumulation.FIXED:
        if schedule is Schedule.ACCO and (micro_batches < 2 or micro_batches % 2):
            raise ValueError(
                f"ACCO with fixed accumulation splits each optimizer step into two equal halves, so "
                f"micro_batches (gradient_accumulation_steps) must be even and >= 2; got {micro_batches}. "
                f"Use {max(2, micro_batches + micro_batches % 2)}, or accumulation='dynamic'."
            )
        if micro_batches < 1:
            raise ValueError(f"micro_batches must be >= 1, got {micro_batches}")
        return
    if schedule is Schedule.SYNC:
        raise ValueError(
            "Dynamic accumulation keeps computing while a round is in flight; the 'sync' schedule has no round in "
            "flight. Use accumulation='fixed' with 'sync', or schedule 'acco' or 'dpu' with 'dynamic'."
        )
    if min_mb < 1 or (max_mb is not None and max_mb < min_mb):
        raise ValueError(f"need 1 <= min_micro_batches <= max_micro_batches, got {min_mb} and {max_mb}")
