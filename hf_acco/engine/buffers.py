"""The pair of full-size buffers, and the rule that the main thread never touches the one a round owns.

``accum``: the main thread's gradient sums (fp32; bf16 by choice for the largest bf16 models), filled by a
post-accumulate-grad hook on every trainable parameter (bf16 gradients accumulate in fp32, mixed dtypes work,
``p.grad`` stays ``None``). ``wire``: owned by the round in flight (gradients in, parameters out); the main thread
touches it only between the round's ``wait()`` and the next launch. Handing a half's gradients to a round either
swaps the two (the step's sums go; accumulation restarts from zero) or lends ``accum`` to the round, which copies it
into ``wire`` (cast to the wire's dtype) first thing on its thread and stream; the next write of ``accum`` waits for
that copy (``handover.LentSums``; half B then keeps accumulating on top of half A's sums). With the wire in the sums'
dtype the synchronous schedule's round works in ``accum`` itself, and there is no second buffer.

The round also keeps this rank's fp32 shard of the reduced gradient inside its buffer when there is room
(``shard_grad_room``), so no shard-sized gradient is held for the whole run:

* ``"own"``: the buffer is fp32 with fp32 gradients: the reduce-scatter sums into this rank's own pieces of each
  bucket (NCCL's in-place rule) and the optimizer reads them there.
* ``"beside"``: a 2-byte buffer (bf16 on the wire and a bf16 model) on 4 ranks or more: each bucket's fp32 piece
  takes the bytes of two pieces of other ranks (2 and 3, or 0 and 1), dead from the bucket's reduce-scatter until
  the all-gather, and never where this rank's output goes.
* ``None``: anything else (an fp32 model with bf16 on the wire; bf16 buffers on 2-3 ranks): the shard optimizer
  keeps a shard-sized fp32 gradient of its own.
"""

from __future__ import annotations

import warnings
import weakref
from collections.abc import Sequence
from typing import Any, cast

import torch
from torch.distributed.tensor import DTensor

from hf_acco.comm.deltas import PackedRound
from hf_acco.comm.sharding import FlatLayout
from hf_acco.engine.handover import HookStreams, LentSums
from hf_acco.engine.kernels import writers

WIRE_DTYPES = ("auto", "fp32", "bf16", "int8")  # the settings' spellings of comm_dtype
GRAD_DTYPES = ("fp32", "bf16")  # of grad_dtype
COMM_DTYPES = {"fp32": torch.float32, "float32": torch.float32, "bf16": torch.bfloat16, "bfloat16": torch.bfloat16}
QUANTIZED = {"int8": torch.int8}  # packed on the wire by the round (quant.py), from the sums "auto" sends


def parse_comm_dtype(
    value: str | torch.dtype, what: str = "comm_dtype", params: Sequence[torch.Tensor] = ()
) -> torch.dtype:
    """``"fp32"`` / ``"bf16"`` (or the torch dtypes) as a torch dtype; ``"auto"``: bf16 for a bf16 model (all of
    ``params`` bf16), else fp32, as DDP all-reduces a bf16 model's gradients in bf16 and DeepSpeed's
    ``communication_data_type`` defaults to the model's dtype. Anything else is refused."""
    if isinstance(value, torch.dtype) and value in COMM_DTYPES.values():
        return value
    if isinstance(value, str) and value in COMM_DTYPES:
        return COMM_DTYPES[value]
    if value == "auto" and params:  # fp16 has no loss scaling here: its gradients go in fp32
        return torch.bfloat16 if model_dtype(params) == torch.bfloat16 else torch.float32
    accepted = "'auto', 'fp32' or 'bf16'" if params else "'fp32' or 'bf16'"
    raise ValueError(f"{what} must be one of {accepted}, got {value!r}")


def parse_wire(value: str | torch.dtype, params: Sequence[torch.Tensor]) -> tuple[torch.dtype, bool]:
    """The engine's ``comm_dtype``: (the dtype of the gradient sums a round is handed, whether the round quantises
    them to int8 on the wire). ``"int8"`` hands the round the sums in the dtype ``"auto"`` would send (a bf16
    model's round buffer stays bf16), then packs them (quant.py)."""
    if (isinstance(value, str) and value in QUANTIZED) or value in QUANTIZED.values():
        return parse_comm_dtype("auto", params=params), True
    try:
        return parse_comm_dtype(value, params=params), False
    except ValueError:
        raise ValueError(f"comm_dtype must be one of {', '.join(WIRE_DTYPES)}, got {value!r}") from None


ACCUM_DTYPE = torch.float32  # gradients accumulate in fp32 by default
_OWNERS: dict[int, weakref.ref] = {}  # id(parameter) -> the BufferPair last hooked on it
SHARD_GRAD_DTYPE = torch.float32  # the reduced shard gradient the optimizer reads


def check_grad_dtype(grad_dtype: torch.dtype, comm_dtype: torch.dtype, param_dtype: torch.dtype) -> None:
    """bf16 accumulation: for bf16 models with bf16 on the wire (the sums are rounded to bf16 anyway)."""
    if grad_dtype == torch.float32:
        return
    if param_dtype != torch.bfloat16 or comm_dtype != torch.bfloat16:
        raise ValueError(
            "grad_dtype='bf16' (bf16 gradient accumulation) is for bf16 models with comm_dtype='bf16': the "
            f"model's parameters are {param_dtype} and the wire is {comm_dtype}. Cast the model to bf16 and set "
            "comm_dtype='bf16', or keep grad_dtype='fp32' (the default)."
        )


def model_dtype(params: Sequence[torch.Tensor]) -> torch.dtype:
    """The dtype parameters are all-gathered in: the parameters' common floating dtype, else fp32."""
    dtypes = {p.dtype for p in params}
    (only, *others) = dtypes
    return only if not others and only.is_floating_point else torch.float32


def swappable(param_dtype: torch.dtype, comm_dtype: torch.dtype, grad_dtype: torch.dtype = ACCUM_DTYPE) -> bool:
    """Whether the round's buffer is a second accumulation buffer (so the two can swap roles)."""
    return comm_dtype == grad_dtype and param_dtype.itemsize <= grad_dtype.itemsize


def comm_allocation(
    param_dtype: torch.dtype, comm_dtype: torch.dtype, separate: bool, grad_dtype: torch.dtype = ACCUM_DTYPE
) -> torch.dtype | None:
    """The dtype the round's full-size buffer is allocated in (the wider of the wire's and the model's), or None
    when the round works in the accumulation buffer itself (no overlap, the wire's dtype is the sums')."""
    if swappable(param_dtype, comm_dtype, grad_dtype):
        return grad_dtype if separate else None
    return comm_dtype if comm_dtype.itemsize >= param_dtype.itemsize else param_dtype


def shard_grad_room(buffer_dtype: torch.dtype, comm_dtype: torch.dtype, world_size: int, chunk: int) -> str | None:
    """Where a round keeps its fp32 shard gradient in a buffer of ``buffer_dtype`` (see the module's docstring)."""
    if buffer_dtype == SHARD_GRAD_DTYPE and comm_dtype == SHARD_GRAD_DTYPE:
        return "own"
    # two 2-byte pieces hold one fp32 piece; an even bucket keeps every row of the fp32 view 4-byte aligned
    if buffer_dtype.itemsize == 2 and comm_dtype == buffer_dtype and world_size >= 4 and world_size * chunk % 2 == 0:
        return "beside"
    return None


class BufferPair:
    """``accum`` and ``wire`` over ``params`` in ``layout``.

    ``accum`` is in ``grad_dtype`` (fp32 by default). ``comm`` carries gradients in ``comm_dtype`` and hands
    parameters back in the model's dtype (``param_dtype``: the parameters' common dtype, fp32 when they differ): one
    allocation of the larger of the two, seen through two views (``grads_of``, ``params_of``), so a bf16 model
    all-gathers bf16 even with fp32 gradients. With ``separate`` False and the wire in the sums' dtype there is one
    buffer (the synchronous schedule). ``rank``: whose shard of the gradient ``shard_grad_of`` places.
    """

    def __init__(
        self,
        params: Sequence[torch.Tensor],
        layout: FlatLayout,
        device: torch.device,
        separate: bool,
        comm_dtype: torch.dtype = torch.float32,
        grad_dtype: torch.dtype = ACCUM_DTYPE,
        rank: int = 0,
        owners: Sequence[torch.Tensor] | None = None,
        packed: PackedRound | None = None,
    ) -> None:
        self.params = list(params)
        # where each parameter's gradient arrives (the hooks' tensors): the parameters themselves, or, for an FSDP2
        # model, its DTensor parameters, whose local shards (``params``) the engine reads and writes
        self.owners = list(owners) if owners is not None else self.params
        self.layout = layout
        self.device = device
        self.comm_dtype = comm_dtype
        self.param_dtype = model_dtype(self.params)
        check_grad_dtype(grad_dtype, comm_dtype, self.param_dtype)
        self._add, self._copy = writers(device)  # the hook's kernels (HF_ACCO_ACCUMULATE: torch's, or Triton's)
        self._accum = layout.new_flat(device, dtype=grad_dtype)
        self._lent: LentSums | None = None  # the last hand-over's copy, made by its round: writers of ``_accum`` wait
        self.hook_streams = HookStreams(device)  # where the hooks' kernels ran: the main stream waits before the sums
        self.packed = packed  # the round's buffer holds int8 rows (deltas.PackedRound), packed at the hand-over
        # the two buffers can swap roles when they are alike (the wire in the sums' dtype); else the round gets a copy
        self.swappable = swappable(self.param_dtype, comm_dtype, grad_dtype) and packed is None
        wire = comm_allocation(self.param_dtype, comm_dtype, separate, grad_dtype)
        if packed is not None:
            self.wire = packed.new_buffer(device)
        else:
            self.wire = self._accum if wire is None else layout.new_flat(device, dtype=wire)
        self.rank = rank
        room = shard_grad_room(self.wire.dtype, comm_dtype, layout.world_size, layout.chunk)
        self.grad_room = None if packed is not None else room
        self.grad_scale = 1.0  # multiplies the gradients of the next backward passes as they are accumulated
        self.hook_calls = 0  # gradients accumulated since the counter was last reset
        # which parameters received a gradient since the step began (by index): a round tells its owners, so that
        # a parameter no rank gave a gradient is left out of the update, as torch's optimizers leave out grad None
        self.touched = bytearray(len(self.params))
        # which views of ``accum`` hold sums of the current accumulation; a parameter's first gradient is written
        # over its view (no zeroing pass over the buffer between steps: ``release_accum``), and ``stale`` says that
        # the views nothing was written into (and the padding) may hold other values until ``hand_over`` zeroes them
        self.written = bytearray(len(self.params))
        self.stale = False
        self._index = {id(p): i for i, p in enumerate(self.owners)}
        self.evaluating = False  # the engine is in eval mode: no gradient may come in (``accum`` may hold parameters)
        self.eval_backup: torch.Tensor | None = None  # in eval mode, what the model held if it was not θ
        # per-parameter views of each buffer, made once: the two buffers swap roles every step
        flats = (self._accum,) if packed is not None else (self._accum, self.wire)
        self._views_of = {id(buf): {id(p): v for p, v in zip(self.owners, layout.views(buf))} for buf in flats}
        self.grad_views = self._views_of[id(self._accum)]
        self._hooks: list = []

    def shard_grad_of(self, buf: torch.Tensor) -> torch.Tensor | None:
        """The (num_buckets, chunk) fp32 view of ``buf``'s memory where a round working in ``buf`` keeps this rank's
        reduced shard gradient, or None when ``buf`` has no room for it (``grad_room``)."""
        layout, rank = self.layout, self.rank
        if self.grad_room == "own":
            return buf.view(layout.num_buckets, layout.world_size, layout.chunk)[:, rank]
        if self.grad_room == "beside":  # pieces 2 and 3 for ranks 0 and 1, pieces 0 and 1 for the others
            first = 2 if rank < 2 else 0  # an even piece: 4-byte aligned whatever the chunk's parity
            row = buf.view(torch.uint8).view(layout.num_buckets, layout.bucket_size * buf.itemsize)
            start = first * layout.chunk * buf.itemsize
            return row[:, start : start + layout.chunk * SHARD_GRAD_DTYPE.itemsize].view(SHARD_GRAD_DTYPE)
        return None

    def _typed(self, buf: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """``buf``'s memory as a flat buffer of ``dtype`` (its first bytes when ``dtype`` is narrower); a packed
        round buffer as it is (int8 rows both ways)."""
        if buf.dtype == dtype or self.packed is not None:
            return buf
        return buf.view(torch.uint8)[: self.layout.padded_numel * dtype.itemsize].view(dtype)

    def grads_of(self, buf: torch.Tensor) -> torch.Tensor:
        """The view of a round's buffer its gradients are reduce-scattered from (``comm_dtype``)."""
        return self._typed(buf, self.comm_dtype)

    def params_of(self, buf: torch.Tensor) -> torch.Tensor:
        """The view of a round's buffer its parameters are all-gathered into (``param_dtype``)."""
        return self._typed(buf, self.param_dtype)

    def attach(self) -> None:
        """From now on every backward adds the parameters' gradients into ``accum`` (call it last when building
        the engine: a failed build must leave the model's autograd untouched). An earlier engine's hooks on the same
        parameters are released first: each gradient can go to one engine only."""
        if self._hooks:
            return
        earlier = {}
        for p in self.owners:
            owner = _OWNERS[id(p)]() if id(p) in _OWNERS else None
            if owner is not None and owner is not self and owner._hooks and id(p) in owner._views_of[id(owner._accum)]:
                earlier[id(owner)] = owner
        for owner in earlier.values():
            warnings.warn(
                "An ACCO optimizer built earlier on these parameters was still attached (never closed); its "
                "gradient hooks are released so that the new one gets the gradients. Call close() on an optimizer "
                "you are done with (ACCOTrainer does when training ends).",
                stacklevel=3,
            )
            owner.release()
        self._hooks = [p.register_post_accumulate_grad_hook(self._grad_hook) for p in self.owners]
        for p in self.owners:
            _OWNERS[id(p)] = weakref.ref(self)

    @torch.no_grad()  # to_local() outside no_grad records an autograd node for each parameter
    def check_devices(self) -> None:
        if self.owners is not self.params:  # FSDP2: the local shards the engine writes must be those FSDP reads
            for owner, p, name in zip(self.owners, self.params, self.layout.names):
                if isinstance(owner, DTensor) and owner.to_local().data_ptr() != p.data_ptr():
                    raise RuntimeError(
                        f"FSDP replaced the local shard of {name} after the ACCO optimizer was built (a .to(), "
                        ".cuda(), or load_state_dict(assign=True) on the model): build the optimizer after them."
                    )
        for p, name in zip(self.params, self.layout.names):
            if p.device != self.device:
                raise RuntimeError(
                    f"Parameter {name} is on {p.device}, the ACCO optimizer on {self.device}: move the model to "
                    "its device before building the optimizer, and keep all trainable parameters on one device."
                )

    @property
    def accum(self) -> torch.Tensor:
        """The main thread's gradient sums, once the round in flight has taken its copy of them (``LentSums``):
        whoever gets ``accum`` may write it."""
        self.reclaim()
        return self._accum

    def reclaim(self) -> None:
        """Before the main thread reads or writes ``accum``: its stream after the gradient hooks' kernels
        (``HookStreams``), and the last hand-over's round done copying the sums out of it, on the host, then this
        stream (each stream a writer uses waits once; the lend is kept until the next hand-over)."""
        self.hook_streams.order_main()
        lent = self._lent
        if lent is not None:
            lent.wait()

    @property
    def separate(self) -> bool:
        return self.wire is not self._accum

    def _grad_hook(self, p: torch.Tensor) -> None:
        # Runs when autograd has finished p's gradient for this backward: accumulate it in fp32, free it.
        if self.evaluating:
            p.grad = None  # the backward stops here: nothing of it stays behind
            raise RuntimeError(
                "A backward pass ran while the ACCO optimizer is in eval mode (the model holds the committed "
                "parameters, and the accumulation buffer may hold the training ones): call optimizer.train() (or "
                "leave committed_parameters()) before training."
            )
        if self._lent is not None:  # after the round's copy of the last half's sums (a no-op once this stream waited)
            self._lent.wait()
        self.hook_streams.note()  # this stream's kernels below: the main stream waits for them before the sums
        # (p.grad is set: a post-accumulate-grad hook runs after autograd has written it)
        i, view, grad = self._index[id(p)], self.grad_views[id(p)], cast(torch.Tensor, p.grad)
        if isinstance(grad, DTensor):  # FSDP2: this rank's shard of the machine's reduced gradient
            grad = grad.to_local()
        if self.written[i] and self.grad_scale == 1.0:
            self._add(view, grad)
        elif self.written[i]:
            view.add_(grad, alpha=self.grad_scale)
        else:  # the first of this accumulation: written over the view (0 + g is g), read no sum
            self._copy(view, grad)
            if self.grad_scale != 1.0:
                view.mul_(self.grad_scale)  # in the sums' dtype, as add_(grad, alpha) computes it
            self.written[i] = 1
        p.grad = None
        self.hook_calls += 1
        self.touched[i] = 1

    def take_touched(self, reset: bool) -> list[float]:
        """Which parameters received a gradient since the step began (1.0 / 0.0, for the round's count all-reduce);
        ``reset`` when the sums go with them (a commit round): the next step starts with none."""
        flags = list(map(float, self.touched))
        if reset:
            self.clear_touched()
        return flags

    def clear_touched(self) -> None:
        self.touched[:] = bytes(len(self.touched))

    def hand_over(self, swap: bool) -> tuple[torch.Tensor, LentSums | None]:
        """Give ``accum``'s sums to the next round: the buffer the round will own (``wire``), and the copy of the
        sums the round makes first (``LentSums.take``: cast into the wire's dtype, or packed into int8 rows; None:
        nothing to copy).

        ``swap``: the step's sums go (accumulation restarts from zero); else half B goes on accumulating on top of
        them. Call ``restart`` after the round is launched (on CUDA its ready event is recorded first)."""
        self.reclaim()  # the hooks' streams, the previous round's copy: the main stream after both
        self._lent = None
        self._zero_unwritten()
        accum, wire = self._accum, self.wire
        if not self.separate:
            return wire, None
        if self.packed is not None:  # quantised into the round's buffer by the round, first thing on its stream
            packed, wire_dtype = self.packed, self.comm_dtype
            self._lent = LentSums(lambda: packed.pack_sums(wire, accum, wire_dtype), self.device)
            return wire, self._lent  # (a swap restarts ``accum`` from zero once the round has read it: ``restart``)
        elif swap and self.swappable:  # the round takes the sums; the main thread restarts from the old buffer
            self.wire, self._accum = accum, wire
            self.grad_views = self._views_of[id(self._accum)]
        else:  # a copy, cast to the wire's dtype (each rank's fp32 sums rounded once), made by the round
            grads = self.grads_of(wire)
            self._lent = LentSums(lambda: grads.copy_(accum), self.device)
            return wire, self._lent
        return self.wire, None

    def cancel_lend(self) -> None:
        """A round that was never launched: ``accum`` is the main thread's again, its sums untouched."""
        if self._lent is not None:
            self._lent.release()
        self._lent = None

    def _zero_unwritten(self) -> None:
        """``accum`` holds exactly the sums: zero where no gradient was written since ``release_accum`` (a parameter
        without a gradient in this accumulation, and the padding). Invariant: a round, or anything else that reads
        ``accum`` as sums, comes after this."""
        if not self.stale:
            return
        views = self.grad_views
        for i, p in enumerate(self.owners):
            if not self.written[i]:
                views[id(p)].zero_()
        self._accum[self.layout.numel :].zero_()
        self.stale = False

    def restart(self, swap: bool) -> None:
        """After a swap, accumulation restarts from zero in the buffer the previous round gave back."""
        if swap and self.separate:
            self.release_accum()

    def round_returned(self) -> None:
        """The round's output has been read: with one buffer, it goes back to accumulating gradients."""
        if not self.separate:
            self.release_accum()

    @torch.no_grad()
    def load_into_model(self, flat: torch.Tensor) -> None:
        torch._foreach_copy_(self.params, self.layout.views(flat))

    def load_round_output(self) -> None:
        """Copy the parameters the last round all-gathered into the model (packed: add its changes to the model)."""
        if self.packed is not None:
            self.packed.apply(self.wire)
        else:
            self.load_into_model(self.params_of(self.wire))

    def initial_shard(self, comm: Any, rank: int) -> torch.Tensor:
        """This rank's fp32 shard of the model's parameters (staged in ``accum``, which is zero again after). With
        a communicator, rank 0's parameters are broadcast first and loaded into every rank's model."""
        flat = self.model_to(self.accum)  # exact: the model's dtype is no wider than the sums'
        if comm is not None:
            comm.broadcast(flat)  # identical initial parameters on every rank
            self.load_into_model(flat)
        shard = self.layout.shard_of(flat, rank).to(torch.float32)
        self.release_accum()
        return shard

    def enter_eval(self, commit_pending: bool, at_boundary: bool) -> None:
        """Eval mode. With ``commit_pending`` the model gets the commit round's output θ and what it held is kept,
        exactly: at a step boundary in ``accum`` (zero and unused there, no narrower than the model's dtype), in
        the middle of a step (``accum`` holds half A's gradients: hand-written loops only, Trainer evaluates and
        saves at step boundaries) on the host."""
        if commit_pending:
            self.eval_backup = self.model_to_accum() if at_boundary else self.model_to_host()
            self.load_round_output()
        self.evaluating = True

    def leave_eval(self) -> None:
        """The model gets back what it held before ``enter_eval``; ``accum`` is zero again if it kept it."""
        if self.eval_backup is not None:
            self.load_into_model(self.eval_backup)
            if self.eval_backup is self.accum:
                self.release_accum()
            self.eval_backup = None
        self.evaluating = False

    def model_to_accum(self) -> torch.Tensor:
        """The model's current parameters, kept in ``accum`` (zero and unused at a step boundary: exact, no narrower
        than the model's dtype). No gradient may be accumulated until ``release_accum``."""
        if self.hook_calls:
            raise AssertionError("accum holds gradients of this step")
        return self.model_to(self.accum)

    def release_accum(self) -> None:
        """``accum`` back to gradients, zero as far as they are concerned: each parameter's next gradient is written
        over its view, and what nothing overwrites is zeroed before a round reads the sums (``_zero_unwritten``)."""
        self.written[:] = bytes(len(self.written))
        self.stale = True

    def model_to_host(self) -> torch.Tensor:
        """The model's current parameters, flattened into a new host buffer in their dtype (pinned on a GPU)."""
        out = torch.empty(self.layout.padded_numel, dtype=self.param_dtype, pin_memory=self.device.type == "cuda")
        for view, p in zip(self.layout.views(out), self.params):
            view.copy_(p.detach())
        return out

    def model_to(self, out: torch.Tensor) -> torch.Tensor:
        """The model's current parameters, flattened into ``out``."""
        return self.layout.flatten(self.params, out)

    def release(self) -> None:
        """Remove the gradient hooks: the parameters no longer feed this engine."""
        for h in self._hooks:
            h.remove()
        self._hooks = []
