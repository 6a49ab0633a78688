"""The collectives of one round (the thread and stream a round runs on: ``runner.py``), on the round's own process
groups (``membership.py``: who is in them; ``failures.py``: what a peer's loss is called). ``Communicator`` is
created collectively: every rank must construct it at the same point, in the same order as its other groups.

Per backend, the reduce-scatter is spelled the way that moves the fewest bytes:

* ``nccl``: native ``reduce_scatter_single``.
* ``gloo``: ``all_to_all_single`` of each bucket and a local sum. gloo's reduce-scatter is an all-reduce
  underneath, so the native call plus the all-gather moves ~1.5x the bytes of one all-reduce; the all-to-all
  spelling moves (N-1)/N of the buffer, and with the all-gather a round moves what one all-reduce moves. The
  round's all-gather is gloo's own (``exchange.py`` says why; only the packed parameter changes go point to point).

With ``quantized_gradients`` (int8 on the wire, ``quant.py``) every backend uses the all-to-all: each rank's chunks
are quantised blockwise before they leave, and the owner sums the chunks it receives in fp32; on several machines
of several ranks each, in two levels (exact inside a machine, int8 between machines: ``nodes.py``).
"""

from __future__ import annotations

import contextlib
import datetime
from collections.abc import Iterator, Sequence

import torch
import torch.distributed as dist

from hf_acco.comm import quant
from hf_acco.comm.exchange import all_gather_into
from hf_acco.comm.failures import PeerFailure, is_peer_failure
from hf_acco.comm.membership import Membership
from hf_acco.comm.nodes import REDUCE_SCATTER as _reduce_scatter
from hf_acco.comm.nodes import node, round_collectives, warm_collectives
from hf_acco.comm.sharding import FlatLayout

REDUCE_SCATTER_SPELLINGS = ("auto", "native", "all_to_all")


class Communicator(Membership):
    """The collectives of one ACCO round, on the round's own process groups (``Membership``).

    Args:
        group: the ranks to train over (``None``: the whole world). A new group over the same ranks is created.
        reduce_scatter: ``"auto"`` (per backend, see the module docstring), ``"native"`` or ``"all_to_all"``.
        max_inflight: buckets in flight at once (bounds the all-to-all receive buffers).
        timeout: collective timeout of the round's group; a dead peer raises instead of hanging forever.
        collectives_at_world_size_1: run the real reduce-scatter and all-gather even with one rank (the GPU tier
            exercises NCCL's path on one GPU this way); by default one rank copies locally.
    """

    def __init__(
        self,
        group: dist.ProcessGroup | None = None,
        reduce_scatter: str = "auto",
        max_inflight: int = 4,
        timeout: datetime.timedelta | None = None,
        collectives_at_world_size_1: bool = False,
        ranks_per_node: int | None = None,
    ) -> None:
        if reduce_scatter not in REDUCE_SCATTER_SPELLINGS:
            raise ValueError(f"reduce_scatter must be one of {REDUCE_SCATTER_SPELLINGS}, got {reduce_scatter!r}")
        self.quantized_gradients = False  # int8 gradients on the wire (use_int8_gradients)
        super().__init__(group, timeout, ranks_per_node)
        self.local_copies = self.world_size == 1 and not collectives_at_world_size_1
        if reduce_scatter == "auto":
            reduce_scatter = "all_to_all" if self.backend == "gloo" else "native"
        self.reduce_scatter_spelling = reduce_scatter
        self._warm_at: tuple[int, torch.dtype] | None = None  # a round's bucket: elements, dtype (prepare_rounds)
        self.max_inflight = max(1, max_inflight)

    def int8_rows(self) -> int:
        """Rows of each bucket this rank quantises: one per rank (a flat all-to-all), or per machine (two levels)."""
        return self.world_size if self.two_level is None else self.two_level.nodes

    def prepare_rounds(self, layout: FlatLayout, dtype: torch.dtype, int8: bool) -> None:
        """Collective, at the engine's construction: int8 gradients' groups (``int8``), then every device
        collective a round issues, warmed on the main thread at a bucket's size in the round buffer's ``dtype``."""
        if int8:
            self.use_int8_gradients()
        self._warm_at = (layout.bucket_size, dtype)
        self._warm()

    def _warm(self) -> None:  # (nodes.warm_collectives; again at reopen)
        if self.local_copies or self._warm_at is None:
            return
        numel, dtype = self._warm_at
        kinds = round_collectives(self.reduce_scatter_spelling, self.quantized_gradients, self.weight_group is None)
        warm_collectives(self.backend, self.group, kinds if self.two_level is None else ["all_gather"], numel, dtype)
        if self.two_level is not None:  # its machine's sum, in the sums' dtype; int8 rows between machines
            warm_collectives(self.backend, self.two_level.node, ("reduce_scatter",), numel, dtype)
            rows = numel // self.two_level.per_node
            warm_collectives(self.backend, self.two_level.rail, ("all_to_all",), rows, torch.int8)

    def _reopened(self) -> None:
        if self.quantized_gradients:
            self._make_node_groups()
        self._warm()

    def use_int8_gradients(self) -> None:
        """int8 gradients on the wire (``quant.py``), in two levels on several machines of several ranks each
        (``nodes.py``). Collective: every rank at the same point (the engine's construction)."""
        self.quantized_gradients = True
        self._make_node_groups()

    @contextlib.contextmanager
    def guard(self, what: str) -> Iterator[None]:
        """Turn a collective that failed because of a peer into a PeerFailure that says which ranks and what to do.

        This rank's own errors (out of memory, a CUDA error, a bad input) surface as themselves, with a note of
        the round they happened in."""
        self.in_round = True
        try:
            yield
        except (RuntimeError, dist.DistError) as e:
            if isinstance(e, PeerFailure):
                raise
            if not is_peer_failure(e):
                if hasattr(e, "add_note"):
                    e.add_note(f"(in ACCO's {what}, on rank {self.rank} of {self.world_size}, {node()})")
                raise
            peers = [r for r in range(self.world_size) if r != self.rank]
            limit = f"{self.timeout.total_seconds():.0f} s" if self.timeout else "the process group's timeout"
            raise PeerFailure(
                f"ACCO {what} failed on rank {self.rank} of {self.world_size} ({node()}): peer rank(s) {peers} died "
                "or did not "
                f"answer within {limit} ({type(e).__name__}: {e}). Nothing was written by this round; restart the "
                "job and resume from the last complete checkpoint."
            ) from e
        finally:
            self.in_round = False

    def all_reduce(
        self, tensor: torch.Tensor, op: dist.ReduceOp.RedOpType = dist.ReduceOp.SUM, async_op: bool = False
    ) -> dist.Work | None:
        return dist.all_reduce(tensor, op=op, group=self.group, async_op=async_op)

    def all_reduce_norms(self, tensor: torch.Tensor) -> None:
        """The sum of ``tensor`` over every rank holding a part of the gradient: the round's group, or, where it
        holds one FSDP shard, the world's, on the host (gloo): the round's thread drives one NCCL communicator."""
        if self.weight_group is None:
            dist.all_reduce(tensor, group=self.group)
            return
        host = tensor.cpu()
        dist.all_reduce(host, group=self.weight_group)
        tensor.copy_(host)

    def all_reduce_counts(self, counts: Sequence[float]) -> list[float]:
        """The sums over ranks of a few numbers, on the host group (no device memory, no device sync)."""
        tensor = torch.tensor(counts, dtype=torch.float64)
        dist.all_reduce(tensor, group=self.host_group)
        if self.weight_group is not None and self._parts is not None:  # the first two: weight and micro-batches
            world = torch.tensor(counts[:2], dtype=torch.float64)
            dist.all_reduce(world, group=self.weight_group)  # every rank's micro-batches: the global count
            tensor[:2] = world
            tensor[0] /= len(self._parts)  # the weight over a part's ranks (see weight_group)
        return tensor.tolist()

    def agree(self, ok: bool) -> bool:
        """Whether every rank of the rounds (of the world, where this group is a part of it) says ``ok``: one number
        summed on the host. A commit's vote (``rounds.RoundBody``); a peer that died makes it raise instead."""
        vote = torch.tensor([0.0 if ok else 1.0], dtype=torch.float64)
        dist.all_reduce(vote, group=self.weight_group if self.weight_group is not None else self.host_group)
        return vote.item() == 0.0

    def check_same_everywhere(self, values: list[float], device: torch.device, message: str) -> None:
        """Collective: raise ``RuntimeError(message)`` on every rank unless every rank passed the same ``values``."""
        mine = torch.tensor(values, dtype=torch.float64, device=device)
        lowest, highest = -mine, mine.clone()
        self.all_reduce(lowest, op=dist.ReduceOp.MAX)
        self.all_reduce(highest, op=dist.ReduceOp.MAX)
        if not torch.equal(-lowest, highest):
            raise RuntimeError(message)

    def raise_if_any_failed(self, error: Exception | None, device: torch.device, elsewhere: str) -> None:
        """Collective: raise ``error`` here, and ``RuntimeError(elsewhere)`` on every other rank, if any rank has
        one (so that no rank goes on into a collective the failed one never reaches). Where the group is one part
        of the world (HSDP: a machine's ranks are tied by FSDP's collectives), the whole world agrees."""
        failed = torch.tensor([0.0 if error is None else 1.0], device=device)
        dist.all_reduce(failed, op=dist.ReduceOp.MAX, group=None if self._parts is not None else self.group)
        if error is not None:
            raise error
        if failed.item():
            raise RuntimeError(elsewhere)

    def broadcast(self, tensor: torch.Tensor, src_rank: int = 0) -> None:
        dist.broadcast(tensor, src=dist.get_global_rank(self.group, src_rank), group=self.group)

    def reduce_scatter(
        self, layout: FlatLayout, flat: torch.Tensor, shard: torch.Tensor, feedback: quant.ErrorFeedback | None = None
    ) -> None:
        """``shard`` <- this rank's shard of the sum over ranks of ``flat`` (``flat`` may be overwritten).

        ``shard`` is contiguous or ``(num_buckets, chunk)``, possibly rows of ``flat``'s own memory (this rank's own
        pieces, NCCL's in-place rule, or the bytes beside them: bucket b's row is written only once bucket b has
        been reduced). ``flat`` may be narrower than ``shard`` (bf16 on the wire, fp32 shard): the all-to-all
        spelling sums the received pieces in ``shard``'s dtype; the native one sums in ``flat``'s (as NCCL does)
        and casts. ``feedback``: int8 gradients' error feedback (commit rounds)."""
        rows = shard.view(layout.num_buckets, layout.chunk) if shard.dim() == 1 else shard
        if self.local_copies:
            own = flat.view(layout.num_buckets, 1, layout.chunk)[:, 0]
            if own.data_ptr() != rows.data_ptr() or own.dtype != rows.dtype:
                rows.copy_(own)
            return
        if self.quantized_gradients:
            self._int8_reduce_scatter(layout, flat, rows, feedback)
            return
        if self.reduce_scatter_spelling == "native":
            self._native_reduce_scatter(layout, flat, rows)
            return
        # all-to-all: rank j sends its chunk r of each bucket to rank r; r sums the world_size chunks it receives.
        pending: list[tuple[int, torch.Tensor, dist.Work]] = []
        for b in range(layout.num_buckets):
            if len(pending) >= self.max_inflight:
                self._sum_received(layout, rows, *pending.pop(0))
            recv = torch.empty_like(layout.bucket(flat, b))
            work = dist.all_to_all_single(recv, layout.bucket(flat, b), group=self.group, async_op=True)
            pending.append((b, recv, work))
        for item in pending:
            self._sum_received(layout, rows, *item)

    def _native_reduce_scatter(self, layout: FlatLayout, flat: torch.Tensor, rows: torch.Tensor) -> None:
        if flat.dtype == rows.dtype:
            outs = list(rows)
        elif self.backend == "nccl":  # in place into this rank's piece of each bucket (NCCL's in-place rule)
            outs = [layout.piece(flat, b, self.rank) for b in range(layout.num_buckets)]
        else:
            outs = [torch.empty(layout.chunk, dtype=flat.dtype, device=flat.device) for _ in range(layout.num_buckets)]
        works = [
            _reduce_scatter(out, layout.bucket(flat, b), group=self.group, async_op=True) for b, out in enumerate(outs)
        ]
        for w in works:
            w.wait()
        if flat.dtype != rows.dtype:  # after every bucket is reduced; no row overlaps this rank's pieces
            for row, out in zip(rows, outs):
                row.copy_(out)

    def _int8_reduce_scatter(
        self, layout: FlatLayout, flat: torch.Tensor, rows: torch.Tensor, feedback: quant.ErrorFeedback | None
    ) -> None:
        """The all-to-all spelling with each chunk quantised blockwise to int8 before it leaves (quant.py, about a
        quarter of fp32's bytes): the owner dequantises the chunks it receives (one per rank, or per machine in
        two levels: nodes.py) and sums them in fp32, in rank order. Bucket b is read before its row of ``rows`` is
        written, as in the fp32 spelling. An int8 ``flat`` ((num_buckets, world_size, row)) was packed already."""
        pending: list[tuple[int, torch.Tensor, dist.Work, torch.Tensor]] = []
        for b in range(layout.num_buckets):
            if len(pending) >= self.max_inflight:
                self._sum_unpacked(layout, rows, *pending.pop(0))
            if flat.dtype == torch.int8:  # packed at the hand-over (deltas.PackedRound): every chunk's row as it is
                assert feedback is None, "error feedback packs in the round: the engine does not pack then"
                send, group = flat[b], self.group
            else:
                if self.two_level is None:
                    sums, group = layout.bucket(flat, b).view(layout.world_size, layout.chunk), self.group
                else:
                    sums, group = self._machine_sum(layout, flat, b), self.two_level.rail
                send = quant.pack(sums) if feedback is None else feedback.pack(b, sums)
            recv = torch.empty_like(send)
            work = dist.all_to_all_single(recv, send, group=group, async_op=True)
            pending.append((b, recv, work, send))  # ``send`` outlives the collective that reads it
        for item in pending:
            self._sum_unpacked(layout, rows, *item)

    def _machine_sum(self, layout: FlatLayout, flat: torch.Tensor, b: int) -> torch.Tensor:
        """nodes.py's first level: this machine's sum of bucket b's chunks whose owners have this rank's local
        rank, (machines, chunk) in ``flat``'s dtype (a reduce-scatter of the bucket regrouped by local rank)."""
        levels = self.two_level
        assert levels is not None
        by_local = layout.bucket(flat, b).view(levels.nodes, levels.per_node, layout.chunk).transpose(0, 1)
        summed = torch.empty(levels.nodes, layout.chunk, dtype=flat.dtype, device=flat.device)
        _reduce_scatter(summed.view(-1), by_local.contiguous().view(-1), group=levels.node)
        return summed

    @staticmethod
    def _sum_unpacked(
        layout: FlatLayout, rows: torch.Tensor, b: int, recv: torch.Tensor, work: dist.Work, _send: torch.Tensor
    ) -> None:
        work.wait()
        quant.unpack_sum(recv, layout.chunk, rows[b])

    @staticmethod
    def _sum_received(layout: FlatLayout, rows: torch.Tensor, b: int, recv: torch.Tensor, work: dist.Work) -> None:
        work.wait()
        pieces = recv.view(layout.world_size, layout.chunk)
        if recv.dtype == rows.dtype:
            torch.sum(pieces, dim=0, out=rows[b])
        else:  # bf16 on the wire, summed in fp32
            torch.sum(pieces, dim=0, dtype=rows.dtype, out=rows[b])

    def all_gather_packed(self, recv: torch.Tensor, send: torch.Tensor) -> dist.Work:
        """Row r of ``recv`` ((world_size, n) int8) <- rank r's ``send`` ((n,) int8), asynchronously (the packed
        int8 or int4 changes of ``deltas.DeltaGather``)."""
        return all_gather_into(recv.view(-1), send, self.group)

    def all_gather(self, layout: FlatLayout, shard: torch.Tensor | None, flat: torch.Tensor) -> None:
        """``flat`` <- every rank's shard. With ``shard=None`` each rank's pieces are already in ``flat``."""
        works = []
        for b in range(layout.num_buckets):
            own = layout.piece(flat, b, self.rank) if shard is None else layout.shard_piece(shard, b)
            if self.local_copies:
                layout.piece(flat, b, 0).copy_(own)
                continue
            works.append(all_gather_into(layout.bucket(flat, b), own, self.group, point_to_point=False))
        for w in reversed(works):  # the last bucket first: fewer blocking waits
            w.wait()
