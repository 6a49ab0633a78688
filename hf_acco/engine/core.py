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

This module is the facade users call; each job has a module of its own (``docs/architecture.md``: where is what).

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

from collections.abc import Iterable
from typing import Any

import torch
import torch.distributed as dist

from hf_acco.comm.communicator import Communicator
from hf_acco.comm.deltas import CHANGE_DTYPES, GATHER_DTYPES, DeltaGather, quantized_settings
from hf_acco.comm.groups import warn_if_one_hardware_queue
from hf_acco.comm.quant import ErrorFeedback
from hf_acco.comm.sharding import FlatLayout, trainable_parameters
from hf_acco.engine.buffers import BufferPair, check_grad_dtype, model_dtype, parse_comm_dtype, parse_wire
from hf_acco.engine.fsdp import check_fsdp, local_data
from hf_acco.engine.halves import halves_for, round_ends_soon
from hf_acco.engine.inflight import RoundInFlight
from hf_acco.engine.lifecycle import EngineLifecycle
from hf_acco.engine.optim import ShardOptimizer, check_elementwise
from hf_acco.engine.packing import packing
from hf_acco.engine.rounds import RoundBody, RoundResult, check_nonfinite
from hf_acco.engine.schedule import (
    STEP_END,
    Accumulation,
    Phase,
    RoundKind,
    Schedule,
    first_phase,
    parse_settings,
    schedule_at,
    validate_settings,
)
from hf_acco.engine.shard_state import STATE_FORMAT, BoundaryState, consolidate_state_dicts, torch_keys
from hf_acco.engine.stats import EngineStats

# re-exported from where they were before the engine was split: ``from hf_acco.engine.core import ...`` keeps working
__all__ = ["ACCOOptimizer", "Accumulation", "Phase", "RoundKind", "RoundResult", "Schedule"]
__all__ += ["STATE_FORMAT", "consolidate_state_dicts", "round_ends_soon", "validate_settings"]

_HPARAM_SKIP = ("params", "param_names")


def _forwarded(part: str, name: str, doc: str | None = None) -> property:
    """A setting or figure of the facade that lives in one of its parts (read and set there, live)."""
    return property(
        lambda self: getattr(getattr(self, part), name), lambda self, v: setattr(getattr(self, part), name, v), doc=doc
    )


class ACCOOptimizer(EngineLifecycle, torch.optim.Optimizer):
    """ZeRO-1 sharded optimizer whose communication runs in the background (ACCO, DPU or synchronous).

    Building it is collective: every rank of ``group`` must build it at the same point.

    Args:
        params: parameters or parameter groups (or ``named_parameters()``), as for any torch optimizer.
            Parameters with ``requires_grad=False`` are left out; each parameter object is counted once.
        optimizer_cls (`type`, defaults to `torch.optim.AdamW`): the element-wise inner optimizer.
        schedule (`str`, defaults to `"acco"`): ``"acco"``, ``"dpu"`` or ``"sync"``.
        accumulation (`str`, defaults to `"fixed"`): ``"fixed"``, ``"dynamic"`` or ``"paced"`` (the caller ends each
            half with ``end_half()`` and each step with ``end_step()``, and a rank may have no micro-batch in either:
            the claimed micro-batches of pacing.py).
        micro_batches (`int`, defaults to 2): fixed mode: micro-batches per optimizer step per rank (acco: at
            least 2, k // 2 in the first half and the rest in the second).
        min_micro_batches (`int`, defaults to 1): dynamic mode: least micro-batches per half per rank.
        max_micro_batches (`int`, *optional*): dynamic mode: most micro-batches per half per rank.
        max_grad_norm (`float`, *optional*): clip the averaged gradient to this global norm.
        warmup_steps (`int`, defaults to 0): synchronous steps before the schedule starts.
        group (`ProcessGroup`, *optional*): ranks to train over; ``None`` is the world.
        communicator (`Communicator`, *optional*): injected collectives (tests wrap it to slow rounds down); the
            engine owns it: ``close()`` destroys its process groups, ``reopen()`` makes new ones.
        bucket_numel (`int`, *optional*): elements per communication bucket; default: about 16 buckets of
            256 KiB to 16 MiB each on gloo (several in flight keep the link busy both ways), 16 MiB to 1 GiB on NCCL.
        allow_custom_optimizer (`bool`): accept an ``optimizer_cls`` not known to be element-wise.
        broadcast_parameters (`bool`, defaults to `True`): copy rank 0's parameters to every rank.
        auto_step (`bool`, defaults to `False`): ``after_backward`` ends the optimizer step itself when it is
            ready, and ``step()`` only marks the caller's window (for dynamic accumulation inside a loop whose
            windows are a fixed number of micro-batches, such as ``prepare_acco``'s with Accelerate).
        nonfinite (`str`, defaults to `"skip"`): when the averaged gradient has an inf or NaN (seen by every rank
            in the all-reduced norm, so all take the same decision): ``"skip"`` the update (master, state and
            estimate stay as they are; counted in ``totals["skipped_steps"]``) or ``"error"``: stop with an error.
        comm_dtype (`str`, defaults to `"auto"`): the gradients' dtype on the wire: ``"auto"`` (the model's, as DDP),
            ``"fp32"``, ``"bf16"`` (each rank's sums rounded once, summed in fp32 on gloo, in bf16 by NCCL), or
            ``"int8"``: the sums (in the dtype ``"auto"`` sends) quantised blockwise (``quant.py``), sent by
            all-to-all, summed by the owner in fp32: about a quarter of fp32's bytes.
        grad_dtype (`str`, defaults to `"fp32"`): the dtype gradients accumulate in. ``"bf16"`` (for bf16 models
            with ``comm_dtype="bf16"``, as the authors' release did for the largest models) halves the accumulation
            buffer; each backward's gradient is rounded as it is added.
        gather_dtype (`str`, defaults to `"auto"`): the parameters in the all-gather: ``"auto"`` (the model's dtype,
            exact), ``"int8"`` or ``"int4"``: each owner sends the change of its parameters since what every rank
            holds, quantised blockwise (the ranks stay identical, the master exact: ``deltas.py``). With int8
            gradients too, the round's buffer is int8 where that is smaller (``deltas.PackedRound``).
        error_feedback (`bool`, defaults to `False`): with ``comm_dtype="int8"``, carry each commit round's rounding
            of this rank's gradients into the next commit round's (``quant.ErrorFeedback``; a float32 residual of
            the buffer's size, or of its share per machine in two levels, saved in the checkpoint).
        boundary_copy (`bool`, defaults to `True`): ``acco`` only: at each step boundary, copy this rank's shard of
            the model to the host (pinned on a GPU, on the commit round's side stream), so that ``state_dict()`` in
            the middle of a step, after the A→B boundary moved the model, still describes the boundary. A caller
            that saves only at step boundaries (``ACCOTrainer``) turns it off: no per-step device-to-host copy.
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
        comm_dtype: str | torch.dtype = "auto",
        grad_dtype: str | torch.dtype = "fp32",
        gather_dtype: str = "auto",
        error_feedback: bool = False,
        boundary_copy: bool = True,
        **defaults: Any,
    ) -> None:
        check_elementwise(optimizer_cls, allow_custom_optimizer)
        counts = micro_batches, min_micro_batches, max_micro_batches
        self.schedule, self.accumulation = parse_settings(schedule, accumulation, *counts)
        check_nonfinite(nonfinite)  # before the first collective: a bad setting fails alone, not in a hang
        sums = parse_comm_dtype(grad_dtype, "grad_dtype")
        change_bits = quantized_settings(comm_dtype, gather_dtype, error_feedback)
        self.warmup_steps, self.auto_step = warmup_steps, auto_step
        super().__init__(params, defaults)
        named = trainable_parameters(self.param_groups)
        self._owners = [p for _, p, _ in named]  # where the gradients arrive
        self._params = [local_data(p) for p in self._owners]  # what the engine reads and writes (FSDP2: local shards)
        check_fsdp(self._owners, self.accumulation.value)
        wire, quantized = parse_wire(comm_dtype, self._params)
        check_grad_dtype(sums, wire, model_dtype(self._params))  # before the first collective, as above
        self.comm = communicator if communicator is not None else Communicator(group)
        self.layout = FlatLayout(
            self._params, [n for n, _, _ in named], [g for _, _, g in named], self.comm.world_size, bucket_numel,
            backend=self.comm.backend,
        )  # fmt: skip
        self.device = self._params[0].device
        warn_if_one_hardware_queue(self.device)
        # collective: int8's two levels on several machines (before the buffers, which depend on it), the warm-up
        self.comm.prepare_rounds(self.layout, wire, quantized)
        self.buffers = self._build_buffers(wire, sums, change_bits=change_bits, error_feedback=error_feedback)
        self.shard = self._build_shard(optimizer_cls, defaults, broadcast_parameters)
        self.halves = halves_for(self.accumulation, *counts)
        self.stats = EngineStats()
        self._round = self._build_round(max_grad_norm, nonfinite, change_bits, error_feedback)
        self.rounds = RoundInFlight(self._round, self.buffers, self.stats, self.halves)
        self._boundary_copy = boundary_copy and self.schedule is Schedule.ACCO
        self._boundary = BoundaryState(  # the last step boundary, for state_dict
            self.layout, self.comm, self.shard, self._params, self._boundary_copy, self._round.feedback
        )
        self._model_moved = False  # the model no longer holds the last boundary's parameters (acco, after A→B)
        self.step_count = 0  # committed optimizer steps launched
        self._closed = False
        self._joined = False  # in a rendezvous: this rank computes nothing until every rank has joined
        self._restart_step()
        self.buffers.attach()  # last: if anything above raised, the model's gradients are as they were

    def _build_round(
        self, max_grad_norm: float | None, nonfinite: str, change_bits: int, error_feedback: bool
    ) -> RoundBody:
        """The body of every round, with int8 / int4 parameter changes and error feedback where asked (int8
        gradients: the communicator's). Nothing goes on a wire with one rank (local copies): its output and
        gradients are exact there."""
        wired = not self.comm.local_copies
        packed = self.buffers.packed
        changes = change_bits and wired and packed is None  # (a packed round gathers its changes itself)
        gather = DeltaGather(self.layout, self.comm, self._params, change_bits) if changes else None
        self.gather_dtype = CHANGE_DTYPES[change_bits] if gather or packed else GATHER_DTYPES[0]  # what it sends
        feedback = None
        if error_feedback and self.comm.quantized_gradients and wired:
            feedback = ErrorFeedback(self.layout.num_buckets, self.comm.int8_rows(), self.layout.chunk, self.device)
        return RoundBody(
            self.layout, self.comm, self.shard, max_grad_norm, nonfinite, self.buffers.shard_grad_of, gather, feedback,
            packed,
        )  # fmt: skip

    def _build_buffers(self, wire: torch.dtype, sums: torch.dtype, **packed: Any) -> BufferPair:
        """The gradient buffer pair, on the parameters' device, checked alike on every rank (collective); the round's
        packed where it saves memory (``packing.packs_round``; ``packed``: its change_bits and error_feedback)."""
        separate = self.schedule is not Schedule.SYNC
        packed_round = packing(self.comm, self.layout, self._params, wire, sums, separate=separate, **packed)
        buffers = BufferPair(
            self._params, self.layout, self.device, separate, comm_dtype=wire, grad_dtype=sums, rank=self.comm.rank,
            owners=self._owners, packed=packed_round,
        )  # fmt: skip
        buffers.check_devices()
        self.comm.check_same_everywhere(
            [self.layout.numel, len(self._params)], self.device, "Ranks disagree on the trainable parameters (count "
            "or size differ). Build the same model with the same frozen/LoRA setup on every rank."
        )  # fmt: skip
        return buffers

    def _build_shard(self, optimizer_cls: type, defaults: dict[str, Any], broadcast: bool) -> ShardOptimizer:
        """This rank's master shard of the model's parameters (rank 0's on every rank with ``broadcast``)."""
        master = self.buffers.initial_shard(self.comm if broadcast else None, self.comm.rank)
        segments = self.layout.shard_param_segments(self.comm.rank)  # one per parameter piece: each has its own step
        return ShardOptimizer(
            master, segments, self._hparams(), optimizer_cls, dict(defaults), self.layout.chunk,
            keep_grad=self.buffers.grad_room is None,  # else each round keeps it in its buffer
            num_params=len(self._params),
        )  # fmt: skip

    def _restart_step(self) -> None:
        """An optimizer step starts with nothing counted, in the schedule's first phase."""
        self._half_count = 0  # micro-batches and their weight in this half (this rank)
        self._half_weight: float | torch.Tensor = 0.0
        # (micro-batches, weight) of the finished halves of this step; a weight on the device stays there
        self._step_counts: list[tuple[int, float | torch.Tensor]] = []
        self.buffers.hook_calls = 0
        self.buffers.clear_touched()
        self.phase = first_phase(self._schedule_now())

    # ---- settings and figures, where they live ------------------------------------------------------------

    grad_scale = _forwarded("buffers", "grad_scale", "Multiplies the gradients of the next backward passes.")
    max_grad_norm = _forwarded("_round", "max_grad_norm", "Clip the averaged gradient to this global norm.")
    nonfinite = _forwarded("_round", "nonfinite", "'skip' or 'error' on an inf/NaN averaged gradient.")
    vote_commits = _forwarded("_round", "vote", "Apply a commit once every rank has made its own (rounds._commit).")
    micro_batches, min_micro_batches = _forwarded("halves", "micro_batches"), _forwarded("halves", "min_micro_batches")
    max_micro_batches = _forwarded("halves", "max_micro_batches")
    last_step_stats = _forwarded("stats", "last_step_stats", "Figures of the last optimizer step.")
    last_commit = _forwarded("stats", "last_commit", "The latest commit round waited for.")
    totals = _forwarded("stats", "totals", "Figures added up since the start.")

    # ---- the user's loop ----------------------------------------------------------------------------------

    def after_backward(self, weight: float | torch.Tensor = 1.0) -> None:
        """Count one micro-batch whose gradients were just accumulated; may cross the A→B boundary.

        ``weight`` is what the gradient is averaged by: 1 when the loss is a mean over the micro-batch
        (average by micro-batch count), or the number of tokens when the loss is their sum (token-weighted).
        """
        if self.buffers.evaluating:
            raise RuntimeError("The ACCO optimizer is in eval mode (committed parameters loaded): call train() first.")
        if self._half_count == 0 and not self._step_counts:  # first micro-batch of a step
            self.buffers.check_devices()
        self.halves.micro_batch_ended()
        self._half_count += 1
        w = weight.detach().to(torch.float64) if torch.is_tensor(weight) else float(weight)  # a device weight stays:
        self._half_weight = self._half_weight + w  # summed in float64 where it is, read by the round (RoundBody._run)
        if self.phase is Phase.ESTIMATE and self._half_done():
            self._boundary_estimate_to_correction()
        if self.auto_step and self.ready_to_step():
            self._end_step()
        self.halves.micro_batch_started()  # the next micro-batch starts now, after any boundary

    def ready_to_step(self) -> bool:
        """Whether the current optimizer step has all its micro-batches (fixed) or its round finished (dynamic)."""
        return self.phase is Phase.CORRECTION and self._half_done()

    def end_half(self) -> None:
        """Paced accumulation: end half A here (the A→B boundary), whatever this rank computed in it. Nothing to do
        in half B, under dpu and sync (one half per step) and during a synchronous warm-up."""
        if self.accumulation is not Accumulation.PACED:
            raise RuntimeError("end_half() is for accumulation='paced'; the other modes end their halves themselves.")
        if self.phase is Phase.ESTIMATE and self._schedule_now() is Schedule.ACCO:
            self._boundary_estimate_to_correction()

    def step(self, closure: None = None) -> None:  # type: ignore[override]
        """End the optimizer step: the B→A boundary (early too: an epoch's short last window). Nothing with
        ``auto_step`` (the engine ends its steps) or paced accumulation (the caller's ``end_step()`` does)."""
        if closure is not None:
            raise ValueError("ACCOOptimizer.step does not take a closure.")
        if not self.auto_step and self.accumulation is not Accumulation.PACED:
            self._end_step()

    def end_step(self) -> None:
        """Paced accumulation: end the optimizer step here (the B→A boundary), whatever this rank computed in it.
        ``step()`` does nothing in this mode: the caller's loop (Trainer's) may call it at its own window ends."""
        if self.accumulation is not Accumulation.PACED:
            raise RuntimeError("end_step() is for accumulation='paced'; call step() in the other modes.")
        self._end_step()

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Gradients live in the engine's buffer (``p.grad`` is always ``None``): nothing to do."""
        for p in self._owners:
            p.grad = None

    # ---- state --------------------------------------------------------------------------------------------

    def state_dict(self) -> dict[str, Any]:  # type: ignore[override]
        """This rank's shard of everything an exact resume needs, as of the last optimizer-step boundary: in the
        middle of a step (a pre-emption checkpoint) the unfinished step's micro-batches are not in it (a resumed
        run computes them again)."""
        self.synchronize()  # the master shard is final once the commit round in flight has finished
        moved, held = self._model_moved, self.buffers.eval_backup  # in eval, the training parameters wait there
        state = self._boundary.state_dict(self.schedule.value, self.step_count, self._hparams(), moved, held)
        state["stats"] = self.stats.state_dict()
        state.update(torch_keys(self.param_groups))
        return state

    @torch.no_grad()
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:  # type: ignore[override]
        """Load this rank's shard (same world size) or a consolidated state (any world size). Collective.

        Every rank validates its input first and the ranks agree before anything is changed: a bad shard on
        one rank raises on every rank (instead of leaving the others waiting in a collective).
        """
        if self._closed:
            raise RuntimeError("This ACCO optimizer was closed: reopen() it (collective) before loading a state.")
        self.synchronize()  # before any collective of the main thread on the round's group: a round in flight
        error = None  # issues its own, and two threads issuing collectives on one group can pair them wrongly
        try:
            self._check_step_boundary("load_state_dict")
            shard = self._boundary.check(state_dict, self.schedule.value)
        except (ValueError, RuntimeError) as e:
            error = e
        self.raise_if_any_rank_failed(error)
        self.train()
        pending = self._boundary.load(state_dict, shard, self.param_groups, self.buffers, self._round.committed_output)
        self.step_count = state_dict["step_count"]
        self.stats.load_state_dict(state_dict.get("stats"))
        self.rounds.drop()
        self._model_moved = False
        if pending:
            self.rounds.completed(RoundKind.COMMIT)
        self.phase = first_phase(self._schedule_now())

    def raise_if_any_rank_failed(self, error: Exception | None) -> None:
        """Collective: raise ``error`` here, and an explanation on every other rank, if any rank has one."""
        self.synchronize()  # the round in flight issues collectives on the same group: it must be over first
        other = "Another rank could not load its ACCO optimizer state (see its error); nothing was loaded."
        self.comm.raise_if_any_failed(error, self.device, other)

    # ---- internals: boundaries (the step machine's transitions, see schedule.py) --------------------------

    def _schedule_now(self) -> Schedule:
        return schedule_at(self.schedule, self.step_count, self.warmup_steps)

    def _half_done(self) -> bool:
        first = self.phase is Phase.ESTIMATE
        return self.halves.half_done(self._half_count, self._schedule_now(), self.rounds.current, first)

    @torch.no_grad()
    def _boundary_estimate_to_correction(self) -> None:
        # A boundary in eval mode (paced: a rank that reaches it before its next micro-batch, right after an
        # evaluation) first gives the model back what training computes with: the accumulation buffer may hold it
        self.train()
        # (a) wait for the commit round of the previous step and (b) load θ_t: half B computes at θ_t.
        self._model_moved |= self.rounds.current is not None
        self._wait_and_load()
        self._finish_half()
        micro_batches, weight = self._step_counts[-1]
        # (c) hand G_A to the round (copy: half B keeps accumulating on top of it), (d) launch the estimate.
        self._launch(RoundKind.ESTIMATE, weight, micro_batches, swap=False)
        self.phase = Phase.CORRECTION

    @torch.no_grad()
    def _end_step(self) -> None:
        """The B→A boundary: launch the commit round of this step with G_A + G_B (see ``STEP_END``)."""
        self.train()  # as at the A→B boundary: never hand a round the buffer that holds the training parameters
        empty_allowed = self._joined or self.accumulation is Accumulation.PACED  # the peers' micro-batches make it
        if self.phase is Phase.ESTIMATE:  # short window: half A was all there was, half B is empty
            if self._half_count == 0 and not empty_allowed:
                raise RuntimeError("ACCOOptimizer.step() was called before any micro-batch was accumulated.")
            self._boundary_estimate_to_correction()
        self._finish_half()
        counted = any(c for c, _ in self._step_counts)
        if self.buffers.hook_calls == 0 and (counted or not empty_allowed):
            raise RuntimeError(
                "No gradient reached the ACCO optimizer during this step: were the model's parameters replaced "
                "after it was built, or was backward() never called?"
            )
        end = STEP_END[self._schedule_now()]
        micro_batches = sum(c for c, _ in self._step_counts)
        weight = sum(w for _, w in self._step_counts)
        if end.load_first:  # acco: the estimate θ̃_{t+1} (next half A computes there); dpu: θ_t
            self._wait_and_load()
        # acco's next step loads θ_{t+1} at its A→B boundary: the commit round first copies this boundary's model
        # shard to the host, off the main stream (BoundaryState.capture); dpu and sync never move the model mid-step
        capture = self._schedule_now() is Schedule.ACCO and self._boundary_copy
        self._launch(RoundKind.COMMIT, weight, micro_batches, swap=True, capture=capture)
        if end.wait_at_once:  # sync: θ_{t+1} at once
            self._wait_and_load()
        self._boundary.pending = self.rounds.kind is RoundKind.COMMIT
        self._model_moved = False
        self.step_count += 1
        self.stats.step_ended(self.step_count, micro_batches)
        self._restart_step()  # after a warm-up the estimate restarts from θ (the schedule's first phase)
        self.halves.micro_batch_started()

    def _finish_half(self) -> None:
        self._step_counts.append((self._half_count, self._half_weight))
        self._half_count, self._half_weight = 0, 0.0

    def _launch(
        self, kind: RoundKind, weight: float | torch.Tensor, micro_batches: int, swap: bool, capture: bool = False
    ) -> None:
        if self.buffers.evaluating:
            raise AssertionError("a round launched in eval mode")  # invariant: accum may hold the parameters then
        label = f"{kind.value} round {self.step_count}"
        # hyper-parameters as of launch: schedulers mutate them
        before = self._boundary.capture if capture else None
        self.rounds.launch(kind, weight, micro_batches, self._joined, swap, self._hparams(), label, before)

    def _wait_and_load(self) -> None:
        """Wait for the round in flight and load its output into the model."""
        self.rounds.wait_and_load()

    # ---- internals: helpers -------------------------------------------------------------------------------

    def _hparams(self) -> list[dict[str, Any]]:
        return [{k: v for k, v in g.items() if k not in _HPARAM_SKIP} for g in self.param_groups]

    def _check_step_boundary(self, what: str) -> None:
        if self._half_count or self._step_counts:
            raise RuntimeError(f"{what}() must be called between optimizer steps, not in the middle of one.")
