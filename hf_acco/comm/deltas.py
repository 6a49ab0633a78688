"""int8 or int4 parameter updates in the all-gather (``gather_dtype="int8"`` or ``"int4"``), as ZeRO++'s quantised
weights (qwZ) move fewer bytes, but without their drift: what travels is the change since what every rank already
holds.

What every rank holds is the model's own parameters: identical on every rank (each applied the same bytes), and
unchanged while a round runs (the main thread loads the model only after waiting for the round: ``inflight.py``).
For each bucket the owner of a piece sends ``new - base`` (its new parameters in the model's dtype, minus the
model's), quantised blockwise (``quant.py``: 1 + 4/256 bytes an element in int8, 0.5 + 4/256 in int4); every rank,
the owner too, writes ``base + dequantised`` into the round's output with the same arithmetic, so all ranks hold
the same bits. The
next round's change starts from what the ranks hold, so each round's rounding is carried into the next one
instead of adding up: the model stays within one round's rounding of the owner's exact result (the master and
the optimizer state stay fp32 and exact on the owner). In int4 a block's step is its largest change / 7: for Adam a
change is about the learning rate per element, so the model is off the master by at most about lr / 14 (half a
step), not by a fraction of the weights.

A resume recomputes a pending commit round's output the same way, from the same base (the boundary's model, which
the checkpoint holds exactly): it is exact.

Ordering on a GPU (the round on its own stream, ``runner.py``): the round reads the model on its stream after the
launch's ``ready`` event, which the main stream records after the boundary loaded the model; the main stream
writes the model again only after waiting for the round's ``done`` event (the next boundary's load, evaluation, a
resume). So every read of the base sees the model every rank loaded, and no load overlaps it; the main stream's
forward and backward only read the model meanwhile.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.distributed as dist

from hf_acco.comm import quant
from hf_acco.comm.communicator import Communicator
from hf_acco.comm.sharding import FlatLayout

GATHER_DTYPES = ("auto", "int8", "int4")  # the parameters in the all-gather: the model's dtype, or changes
CHANGE_BITS = {"auto": 0, "int8": 8, "int4": 4}  # gather_dtype -> the bits of a change's value (0: exact)
CHANGE_DTYPES = {bits: name for name, bits in CHANGE_BITS.items() if bits}  # 8 -> "int8", 4 -> "int4"


def check_gather_dtype(value: str) -> int:
    """The bits ``value`` (the engine's ``gather_dtype``) sends a change in (0: the parameters, exact); anything
    unknown is refused."""
    if value not in GATHER_DTYPES:
        raise ValueError(f"gather_dtype must be one of {', '.join(GATHER_DTYPES)}, got {value!r}")
    return CHANGE_BITS[value]


def quantized_settings(comm_dtype: object, gather_dtype: str, error_feedback: bool) -> int:
    """The bits the parameters' changes travel in (``gather_dtype``; 0: exact); refuses an unknown one, and error
    feedback without int8 gradients (before any collective: a bad setting fails alone, not in a hang)."""
    if error_feedback and comm_dtype != "int8":
        raise ValueError(
            "error_feedback carries the rounding of int8 gradients: set comm_dtype='int8' with it, or leave it off "
            f"(comm_dtype is {comm_dtype!r})."
        )
    return check_gather_dtype(gather_dtype)


class ModelPieces:
    """The model's parameters piece by piece of the flat layout: (bucket b, rank r) -> runs of one parameter each.

    Views are taken when read (``p.detach()``), so a parameter whose data was replaced is read where it is now."""

    def __init__(self, layout: FlatLayout, params: Sequence[torch.Tensor]) -> None:
        self.layout, self.params = layout, list(params)
        for p, name in zip(self.params, layout.names):
            if not p.is_contiguous():
                raise ValueError(f"a quantised gather_dtype reads parameters in place; {name} is not contiguous")
        self._runs: dict[tuple[int, int], list[tuple[int, int, int, int]]] = {}

    def runs(self, b: int, r: int) -> list[tuple[int, int, int, int]]:
        """(parameter, its first element, element count, offset in the piece) of each parameter in piece (b, r)."""
        if (b, r) not in self._runs:
            layout, out = self.layout, []
            lo = b * layout.bucket_size + r * layout.chunk
            for i, (off, n) in enumerate(zip(layout.offsets, layout.numels)):
                start, end = max(lo, off), min(lo + layout.chunk, off + n)
                if start < end:
                    out.append((i, start - off, end - start, start - lo))
            self._runs[(b, r)] = out
        return self._runs[(b, r)]

    def add_to(self, out: torch.Tensor, b: int, r: int, alpha: float = 1.0) -> None:
        """``out`` ((chunk,) float32) += ``alpha`` x the model's elements of piece (b, r) (padding adds nothing)."""
        runs = self.runs(b, r)
        if runs:
            targets = [out[o : o + n] for _, _, n, o in runs]
            sources = [self.params[i].detach().view(-1)[s : s + n] for i, s, n, _ in runs]
            torch._foreach_add_(targets, sources, alpha=alpha)

    def change(self, new: torch.Tensor, b: int, r: int, bits: int) -> torch.Tensor:
        """Piece (b, r)'s change, packed: ``new`` ((chunk,), the new parameters in the model's dtype) minus the
        model's elements there, in fp32."""
        change = new.to(torch.float32, copy=True)
        self.add_to(change, b, r, alpha=-1.0)
        return quant.pack(change.view(1, -1), bits=bits)[0]

    def plus_change(self, packed: torch.Tensor, b: int, r: int, bits: int) -> torch.Tensor:
        """The model's elements of piece (b, r) + the dequantised change ``packed`` (a row), in fp32: the same bits
        on every rank."""
        out = quant.unpack(packed.view(1, -1), self.layout.chunk, bits)[0]  # a new float32 row
        self.add_to(out, b, r)
        return out

    def add_into(self, row: torch.Tensor, b: int, r: int) -> None:
        """The model's elements of piece (b, r) += ``row`` ((chunk,) float32), in place: each element computed in
        fp32 and rounded to its parameter's dtype once, the bits of ``(row + model).to(dtype)`` (an IEEE add
        commutes) without a float32 copy of the model's elements kept (on a CPU torch's mixed-dtype add makes its own
        float32 temporaries of a run's size inside the call; a GPU's kernel casts as it reads)."""
        runs = self.runs(b, r)
        if runs:
            targets = [self.params[i].detach().view(-1)[s : s + n] for i, s, n, _ in runs]
            torch._foreach_add_(targets, [row[o : o + n] for _, _, n, o in runs])


class DeltaGather:
    """The all-gather of a round's output with quantised changes in ``bits`` (8 or 4; the module's docstring).

    Called with the round's output buffer in the model's dtype, this rank's pieces holding its new parameters;
    returns with every piece holding ``base + dequantised change``, the same bits on every rank."""

    def __init__(self, layout: FlatLayout, comm: Communicator, params: Sequence[torch.Tensor], bits: int) -> None:
        self.layout, self.comm, self.bits = layout, comm, bits
        self.model = ModelPieces(layout, params)

    def __call__(self, flat: torch.Tensor) -> None:
        layout, comm = self.layout, self.comm
        pending: list[tuple[int, torch.Tensor, dist.Work, torch.Tensor]] = []
        for b in range(layout.num_buckets):
            if len(pending) >= comm.max_inflight:
                self._apply(flat, *pending.pop(0))
            send = self.model.change(layout.piece(flat, b, comm.rank), b, comm.rank, self.bits)  # new - held
            recv = torch.empty(comm.world_size, send.numel(), dtype=torch.int8, device=flat.device)
            work = comm.all_gather_packed(recv, send)
            pending.append((b, recv, work, send))  # ``send`` outlives the collective that reads it
        for item in pending:
            self._apply(flat, *item)

    def _apply(self, flat: torch.Tensor, b: int, recv: torch.Tensor, work: dist.Work, _send: torch.Tensor) -> None:
        """Piece (b, r) of ``flat`` <- the model's piece (b, r) + rank r's dequantised change, for every rank r."""
        work.wait()
        for r in range(recv.shape[0]):
            self.layout.piece(flat, b, r).copy_(self.model.plus_change(recv[r], b, r, self.bits))


class PackedRound:
    """A round buffer of int8 bytes instead of the model's dtype, for int8 gradients with quantised changes (every
    rank's packed rows of each bucket, ``(num_buckets, world_size, packed_numel(chunk))``): about half of a bf16
    buffer, a quarter of an fp32 one.

    * The hand-over (main thread) quantises the sums into it (``pack_sums``), as the round would have before its
      all-to-all: the same bytes leave.
    * The round reduce-scatters those rows (the communicator sends an int8 buffer as it is), updates its shard, and
      all-gathers the packed changes into the same buffer (``gather``): the gradients' rows are dead by then.
    * The boundary (main thread, after waiting for the round) adds the changes to the model (``apply``), with the
      arithmetic ``DeltaGather`` uses: the same bits in the model as through a buffer of the model's dtype.

    The base every rank adds to is the model, unchanged from the launch to the load (``DeltaGather``'s ordering).
    """

    def __init__(
        self, layout: FlatLayout, comm: Communicator, params: Sequence[torch.Tensor], bits: int, dtype: torch.dtype
    ) -> None:
        self.layout, self.comm, self.bits, self.dtype = layout, comm, bits, dtype  # dtype: the model's, to round to
        self.model = ModelPieces(layout, params)
        self.row = quant.packed_numel(layout.chunk)  # bytes of one chunk's int8 gradient (no fewer than a change's)
        self.change_row = quant.packed_numel(layout.chunk, bits)

    def new_buffer(self, device: torch.device) -> torch.Tensor:
        shape = (self.layout.num_buckets, self.layout.world_size, self.row)
        return torch.zeros(shape, dtype=torch.int8, device=device)

    def pack_sums(self, buf: torch.Tensor, sums: torch.Tensor, wire: torch.dtype) -> None:
        """``buf`` <- every chunk of ``sums`` (full, flat), rounded to the wire's dtype first as a copy into a round
        buffer of that dtype would, quantised."""
        layout = self.layout
        for b in range(layout.num_buckets):
            rows = layout.bucket(sums, b).view(layout.world_size, layout.chunk)
            if rows.dtype == wire:
                quant.pack(rows, out=buf[b])
                continue
            for r in range(layout.world_size):  # rounded a row at a time: no bucket-sized temporary
                quant.pack(rows[r : r + 1].to(wire), out=buf[b, r : r + 1])

    def _changes(self, buf: torch.Tensor, b: int) -> torch.Tensor:
        """Bucket b's rows of packed changes ((world_size, change_row), contiguous, inside bucket b's bytes)."""
        return buf[b].view(-1)[: self.layout.world_size * self.change_row].view(self.layout.world_size, -1)

    def gather(self, buf: torch.Tensor, new: torch.Tensor) -> None:
        """Round thread: every rank's packed change into ``buf``; ``new`` ((num_buckets, chunk) float32): this rank's
        new parameters, rounded to the model's dtype before the change is taken."""
        comm = self.comm
        pending: list[tuple[dist.Work, torch.Tensor]] = []
        for b in range(self.layout.num_buckets):
            if len(pending) >= comm.max_inflight:
                pending.pop(0)[0].wait()
            send = self.model.change(new[b].to(self.dtype), b, comm.rank, self.bits)  # (never written into ``new``)
            pending.append((comm.all_gather_packed(self._changes(buf, b), send), send))  # send outlives its work
        for work, _send in pending:
            work.wait()

    @torch.no_grad()
    def apply(self, buf: torch.Tensor) -> None:
        """Main thread: the model's piece (b, r) += rank r's dequantised change, every piece, in place (the bits of
        ``plus_change``'s sum rounded to the model's dtype): a change dequantised into one float32 row, reused,
        then added where the model holds it (one read and one write of the model's bytes, no copy of them kept)."""
        chunk = self.layout.chunk
        row = torch.empty(1, quant.num_blocks(chunk) * quant.BLOCK, dtype=torch.float32, device=buf.device)
        for b in range(self.layout.num_buckets):
            changes = self._changes(buf, b)
            for r in range(changes.shape[0]):
                self.model.add_into(quant.unpack_into(changes[r : r + 1], chunk, row, self.bits)[0], b, r)
