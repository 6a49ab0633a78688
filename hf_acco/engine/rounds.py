"""One ACCO round: count all-reduce, reduce-scatter, average, global norm, clip, sharded update, all-gather.

A round runs on the background thread and touches only its buffer and the shard: the main thread hands it a
full-size buffer of gradient sums and gets back, in the same buffer, the all-gathered parameters (committed θ
for a commit round, the look-ahead θ̃ for an estimate round). It is a plain callable over a communicator, so
tests run it with a fake one and no thread.
"""

from __future__ import annotations

import contextlib
import itertools
import math
import threading
import time
import warnings
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from hf_acco.comm.communicator import Communicator
from hf_acco.comm.deltas import PackedRound
from hf_acco.comm.failures import PeerFailure
from hf_acco.comm.quant import ErrorFeedback
from hf_acco.comm.sharding import FlatLayout
from hf_acco.engine.optim import ShardOptimizer, overlaps
from hf_acco.engine.schedule import RoundKind


@dataclass
class RoundResult:
    kind: RoundKind
    weight: float  # global sum of micro-batch weights (micro-batches or tokens) the gradient was divided by
    micro_batches: int  # global micro-batch count
    grad_norm: float  # global norm of the averaged gradient, before clipping
    seconds: float  # wall time of the round in the background thread
    joined: int = 0  # ranks that were in a rendezvous when they launched this round
    skipped: bool = False  # the averaged gradient was not finite: no update (the same decision on every rank)
    local_weight: float = 0.0  # this rank's share of ``weight``


def own_pieces(layout: FlatLayout, flat: torch.Tensor, rank: int) -> torch.Tensor:
    """This rank's pieces of a flat buffer, as a (num_buckets, chunk) view."""
    return flat.view(layout.num_buckets, layout.world_size, layout.chunk)[:, rank]


def put_own_pieces(layout: FlatLayout, flat: torch.Tensor, shard: torch.Tensor, rank: int) -> None:
    own_pieces(layout, flat, rank).copy_(shard.view(layout.num_buckets, layout.chunk))


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _numeric_items(group: dict[str, Any]) -> Iterator[tuple[str, Any]]:
    """A group's numeric hyper-parameters (numbers and tuples of numbers, not flags), in a fixed order."""
    for key in sorted(group):
        value = group[key]
        if _is_number(value) or (isinstance(value, tuple) and all(map(_is_number, value))):
            yield key, value


def hparam_numbers(hparams: list[dict[str, Any]]) -> list[float]:
    """The numeric hyper-parameters of every group, flattened (``with_hparam_numbers`` puts them back)."""
    return [float(v) for g in hparams for _, value in _numeric_items(g) for v in _as_tuple(value)]


def with_hparam_numbers(hparams: list[dict[str, Any]], numbers: list[float]) -> list[dict[str, Any]]:
    """``hparams`` with its numbers (as ``hparam_numbers`` lists them) replaced by ``numbers``, types kept."""
    it = iter(numbers)
    out = []
    for group in hparams:
        new = dict(group)
        for key, value in _numeric_items(group):
            values = tuple(type(v)(next(it)) for v in _as_tuple(value))
            new[key] = values if isinstance(value, tuple) else values[0]
        out.append(new)
    return out


def _as_tuple(value: Any) -> tuple:
    return value if isinstance(value, tuple) else (value,)


def narrow_own_pieces(layout: FlatLayout, src: torch.Tensor, flat: torch.Tensor, rank: int) -> None:
    """This rank's pieces of ``flat`` <- ``src`` ((num_buckets, chunk), wider), where ``src`` is this rank's pieces
    of the same memory seen in a wider dtype. Bucket by bucket in increasing order: piece b of the narrow view ends
    before piece b + 1 of the wide one starts, so no copy overwrites a source not yet read; a piece that overlaps
    its own source (rank 0's first) goes through a copy."""
    for b in range(layout.num_buckets):
        dest, source = layout.piece(flat, b, rank), src[b]
        dest.copy_(source.clone() if overlaps(dest, source) else source)


NONFINITE_POLICIES = ("skip", "error")


def check_nonfinite(nonfinite: str) -> None:
    if nonfinite not in NONFINITE_POLICIES:
        raise ValueError(f"nonfinite must be 'skip' or 'error', got {nonfinite!r}")


class RoundBody:
    """The body of every round of one engine (its layout, communicator, shard and clipping / non-finite policy).

    Args:
        layout, comm, shard: the flat layout, the round's communicator and this rank's shard optimizer.
        max_grad_norm: clip the averaged gradient to this global norm (``None``: no clipping).
        nonfinite: ``"skip"`` an update whose averaged gradient has an inf/NaN, or ``"error"``.
        gather: the all-gather of a round's output (``None``: exact, in the model's dtype).
        feedback: int8 gradients' error feedback, carried from commit round to commit round.
    """

    def __init__(
        self,
        layout: FlatLayout,
        comm: Communicator,
        shard: ShardOptimizer,
        max_grad_norm: float | None = None,
        nonfinite: str = "skip",
        shard_grad_of: Callable[[torch.Tensor], torch.Tensor | None] = lambda grads: None,
        gather: Callable[[torch.Tensor], None] | None = None,
        feedback: ErrorFeedback | None = None,
        packed: PackedRound | None = None,
    ) -> None:
        self.layout, self.comm, self.shard = layout, comm, shard
        # 7.'s all-gather of the output (this rank's pieces in place): exact, or int8 / int4 changes (DeltaGather)
        self.gather_output = gather if gather is not None else lambda flat: comm.all_gather(layout, None, flat)
        self.feedback = feedback  # int8 gradients' error feedback, for commit rounds (quant.ErrorFeedback)
        # a round buffer of packed int8 rows: gradients in, this rank's new parameters out as changes (PackedRound)
        self.packed = packed
        self._new: torch.Tensor | None = None  # packed: this rank's new parameters, (num_buckets, chunk) fp32
        self.max_grad_norm = max_grad_norm
        self.nonfinite = nonfinite
        self.vote = False  # a commit applied only once every rank has computed its own (``_commit``)
        self._residual: torch.Tensor | None = None  # voted, with error feedback: the residual before the commit
        self.rank = comm.rank
        self.shard_grad_of = shard_grad_of  # where a round's buffer keeps the shard gradient (None: the shard's own)
        # The global norm's pieces: a run of one parameter in one bucket each. Pieces come in shard order, so a
        # parameter's pieces are consecutive: summed as segments (deterministic on every device, in the order a
        # loop would add them), one segment per parameter this rank holds.
        self._pieces = layout.shard_param_pieces(comm.rank)
        self._piece_views: dict[int, list[torch.Tensor]] = {}  # by the gradient's address
        device = shard.master.device
        runs = [(i, len(list(run))) for i, run in itertools.groupby(i for i, _, _ in self._pieces)]
        if len({i for i, _ in runs}) != len(runs):
            raise AssertionError("a parameter's shard pieces are not consecutive")  # FlatLayout's invariant
        self._owned = torch.tensor([i for i, _ in runs], dtype=torch.long, device=device)
        self._segments = torch.tensor([n for _, n in runs], dtype=torch.long, device=device)

    @property
    def nonfinite(self) -> str:
        return self._nonfinite

    @nonfinite.setter
    def nonfinite(self, nonfinite: str) -> None:
        check_nonfinite(nonfinite)
        self._nonfinite = nonfinite

    def __call__(
        self,
        kind: RoundKind,
        grads: torch.Tensor,
        params: torch.Tensor,
        counts: Sequence[float | torch.Tensor],
        hparams: list[dict[str, Any]],
        everyone_in: threading.Event,
        label: str,
        touched: Sequence[float] | None = None,
    ) -> RoundResult:
        """Run one round: reduce-scatter ``grads``, all-gather into ``params`` (two views of the round's buffer,
        in the wire's and the model's dtype). ``counts`` = [weight, micro-batches, joined] of this rank (the weight
        may be a one-element tensor on the device: read here, on the round's thread and stream);
        ``touched``: per parameter, 1.0 if this rank's sums hold a gradient of it (None: all of them)."""
        with self.comm.guard(label):
            return self._run(kind, grads, params, counts, hparams, everyone_in, touched)

    @torch.no_grad()
    def _run(
        self,
        kind: RoundKind,
        grads: torch.Tensor,
        buf: torch.Tensor,
        counts: Sequence[float | torch.Tensor],
        hparams: list,
        everyone_in: threading.Event,
        touched: Sequence[float] | None = None,
    ) -> RoundResult:
        t0 = time.perf_counter()
        layout, comm, shard = self.layout, self.comm, self.shard
        # 1. global weight, micro-batch count and rendezvous flag, on the host. After it every rank has launched
        # this round: the device collectives below never wait on a peer that has not started them (on NCCL such a
        # kernel would spin on the device while the main thread goes on), and the round can finish without the
        # other ranks' main threads.
        # Rank 0's numeric hyper-parameters ride along (the others add zeros): every rank updates its shard with the
        # same learning rate and weight decay in the same round, even when their schedulers have drifted apart
        # (dynamic accumulation under Trainer: ranks launch a round at different Trainer steps).
        # Which parameters received a gradient on any rank rides along too (a flag per parameter, summed): a
        # parameter no rank gave one is left out of the update (skip), as torch's optimizers leave out grad None.
        # A weight on the device (Trainer's token counts) is read here, not by the main thread at the boundary (a host
        # sync there would stall the compute): this stream waited for the launch's ready event, recorded after the
        # weight's last addition on the main stream, and the round holds the tensor until the read is over.
        local = [float(c) for c in counts]
        numbers = hparam_numbers(hparams)
        mine = numbers if self.rank == 0 else [0.0] * len(numbers)
        flags = list(touched) if touched is not None else [1.0] * len(self.layout.params)
        # (and how many ranks vote their commits: all or none, or the votes would pair with other collectives)
        counts = comm.all_reduce_counts(local + flags + mine + [float(self.vote)])
        total_weight, total_micro_batches, joined, *agreed, votes = counts
        skip = frozenset(i for i, f in enumerate(agreed[: len(flags)]) if f == 0.0)
        hparams = with_hparam_numbers(hparams, agreed[len(flags) :])
        everyone_in.set()
        if votes not in (0.0, float(comm.world_size)):  # the same sum on every rank: all of them raise
            raise ValueError(
                f"vote_commits is set on {votes:.0f} of the {comm.world_size} ranks: set it to the same value on "
                "every rank (before the first step)."
            )
        if total_weight <= 0:  # the same on every rank: no weight anywhere, so nothing to reduce or update
            norm, skipped = 0.0, self._no_weight(kind, joined)
            self._put(buf, shard.master)  # the committed parameters
        else:
            # 2. reduce-scatter: this rank's shard of the sum of every rank's gradient sums, in fp32, into the round's
            # buffer where it has room (its own pieces, or beside them); from here on the rest of the buffer is free
            # for the output, and this rank's output pieces once the update has read the gradient
            grad = shard.use_grad(self.shard_grad_of(grads))
            if self.feedback is not None and kind is RoundKind.COMMIT:  # (a Communicator subclass without the
                if self.vote:  # the residual this commit's rounding replaces, put back if it is voted down
                    self._residual = self.feedback.residual.clone()
                comm.reduce_scatter(layout, grads, grad, self.feedback)  # argument still runs the other rounds)
            else:
                comm.reduce_scatter(layout, grads, grad)
            # an output narrower than the gradient it overwrites (a bf16 model, fp32 on the wire, the gradient in
            # this rank's own pieces): the update is computed in place of the gradient first, then rounded
            # (packed: the look-ahead too, then taken as a change)
            narrow = self.packed is not None or (
                buf.dtype != grad.dtype and grad.data_ptr() == own_pieces(layout, grads, self.rank).data_ptr()
            )
            norm, skipped = self._update(kind, buf, grad, total_weight, hparams, narrow, skip)  # 3.-6.
        # 7. all-gather
        self._gather(buf)
        if buf.is_cuda:  # the round's duration is that of its kernels, not of their launch (work.wait() does not
            torch.cuda.current_stream(buf.device).synchronize()  # block the host on NCCL); blocks only this thread
        seconds = time.perf_counter() - t0
        return RoundResult(kind, total_weight, int(total_micro_batches), norm, seconds, int(joined), skipped, local[0])

    def _put(self, buf: torch.Tensor, new: torch.Tensor, narrow: bool = False) -> None:
        """This rank's new parameters ``new`` (its shard: master or look-ahead, fp32) into its pieces of ``buf``;
        ``narrow``: ``new`` is this rank's pieces of ``buf`` seen wider. Packed: kept for ``_gather``."""
        if self.packed is not None:
            self._new = new.view(self.layout.num_buckets, self.layout.chunk)
        elif narrow:
            narrow_own_pieces(self.layout, new, buf, self.rank)
        else:
            put_own_pieces(self.layout, buf, new, self.rank)

    def _gather(self, buf: torch.Tensor) -> None:
        if self.packed is not None:
            assert self._new is not None
            new, self._new = self._new, None
            self.packed.gather(buf, new)
        else:
            self.gather_output(buf)

    def committed_output(self, buf: torch.Tensor) -> None:
        """``buf`` <- the committed parameters, every rank's master gathered, as a commit round hands them back (a
        resume of a pending commit round, from the model just loaded as its base)."""
        self._put(buf, self.shard.master)
        self._gather(buf)

    @staticmethod
    def _no_weight(kind: RoundKind, joined: float) -> bool:
        """A round with no weight on any rank hands back the committed parameters. An estimate's half without a label
        token (completion-only SFT with truncation) is an estimate of θ itself; a rendezvous round in which no rank
        had a micro-batch is nothing to do. A commit round without weight is a step without data: skipped, said."""
        if kind is not RoundKind.COMMIT or joined:
            return False
        warnings.warn(
            "An ACCO optimizer step had no weight on any rank (no micro-batch, or no label token: check that the "
            "labels are not all masked): the step is skipped, the parameters stay as they are.",
            stacklevel=2,
        )
        return True

    def _update(
        self,
        kind: RoundKind,
        buf: torch.Tensor,
        grad: torch.Tensor,
        total_weight: float,
        hparams: list,
        narrow: bool = False,
        skip: frozenset[int] = frozenset(),
    ) -> tuple[float, bool]:
        """Average, norm, clip, update (``grad``: the shard's reduced gradient, the one ``shard.use_grad`` set); this
        rank's pieces of ``buf`` get the result; the parameters in ``skip`` (no gradient on any rank) are left out
        of the norm and the update. (norm, skipped): the norm read on the host once, for both."""
        layout, shard = self.layout, self.shard
        if skip:  # zero already, unless int8 error feedback sent a rounding residual for them: not a gradient
            for i, a, b in self._pieces:
                if i in skip:
                    grad[a // layout.chunk, a % layout.chunk : a % layout.chunk + (b - a)].zero_()
        # 3. average
        grad.div_(total_weight)
        # 4. global gradient norm and clipping, as torch.nn.utils.clip_grad_norm_ computes them
        norm = self.global_grad_norm(grad)
        norm_value = norm.item()  # the round's one read of its device (the update waits for it anyway)
        skipped = not math.isfinite(norm_value)  # all-reduced: every rank decides the same
        if skipped and self.nonfinite == "error":
            raise FloatingPointError(
                f"The averaged gradient of this {kind.value} round is not finite (global norm {norm_value}) on "
                "every rank. Lower the learning rate, check the data for bad examples, or train with "
                "bf16 instead of fp16; or let ACCO skip such steps (nonfinite='skip')."
            )
        if skipped:  # 5. no update: the round hands back the committed parameters
            self._put(buf, shard.master)
            return norm_value, skipped
        if self.max_grad_norm is not None:
            grad.mul_(torch.clamp(self.max_grad_norm / (norm + 1e-6), max=1.0))
        # 5. optimizer update, 6. written into this rank's pieces of ``buf``
        if kind is RoundKind.COMMIT:
            self._commit(hparams, skip)
            self._put(buf, shard.master)
        elif narrow:  # the look-ahead in fp32 in place of the gradient, then rounded into the output's pieces
            shard.estimate(hparams, grad, skip)
            self._put(buf, grad, narrow=True)
        else:  # the look-ahead goes straight into this rank's pieces of ``buf``: no shard-sized temporary
            shard.estimate(hparams, own_pieces(layout, buf, self.rank), skip)
        return norm_value, skipped

    def _commit(self, hparams: list, skip: frozenset[int]) -> None:
        """The commit's optimizer step. Voted (``vote``): every rank keeps its master and state as of the last commit
        aside (``ShardOptimizer.keep``) until all have stepped theirs and agree (``Communicator.agree``, before any
        rank sends its new parameters); where any rank could not (its own error, or a peer lost before the vote),
        every rank puts its last commit back, so no two ranks stand at different steps."""
        if not self.vote:
            self.shard.commit(hparams, skip)
            return
        kept, residual, self._residual = None, self._residual, None

        def undo() -> None:
            if kept is not None:
                kept.restore()
            if residual is not None and self.feedback is not None:  # (error feedback's, taken before the round)
                self.feedback.residual.copy_(residual)

        try:
            kept = self.shard.keep()  # (its copies are this path's largest allocation: inside, to vote no)
            self.shard.commit(hparams, skip)
        except BaseException:  # this rank's own failure (out of memory): the others learn it from the vote
            undo()
            with contextlib.suppress(Exception):  # (a peer lost too: this rank's own error is the one to say)
                self.comm.agree(False)
            raise
        try:
            agreed = self.comm.agree(True)
        except BaseException:  # a peer lost: the guard says so
            undo()
            raise
        if not agreed:
            undo()
            raise PeerFailure(
                f"ACCO's commit round was not applied: a peer rank of rank {self.rank} could not complete its update "
                "(see its error). Every rank keeps the last commit's parameters and optimizer state."
            )

    def global_grad_norm(self, grad: torch.Tensor) -> torch.Tensor:
        """Norm of the per-parameter norms of the shard's gradient ``grad`` (clip_grad_norm_'s formula, so that
        clipping matches it to the bit for parameters held by one rank): each rank adds its part of each
        parameter's squared norm."""
        partial = torch.zeros(len(self.layout.params), dtype=grad.dtype, device=grad.device)
        if self._pieces:  # one fused call over every piece, not a Python loop
            if grad.data_ptr() not in self._piece_views:  # made once for each place the gradient lives
                chunk = self.layout.chunk
                views = [grad[a // chunk, a % chunk : a % chunk + (b - a)] for _, a, b in self._pieces]
                self._piece_views[grad.data_ptr()] = views
            squares = torch.stack(torch._foreach_norm(self._piece_views[grad.data_ptr()])).square()
            partial[self._owned] = torch.segment_reduce(squares, "sum", lengths=self._segments, unsafe=True)
        self.comm.all_reduce_norms(partial)
        return torch.linalg.vector_norm(partial.sqrt()).reshape(1)
