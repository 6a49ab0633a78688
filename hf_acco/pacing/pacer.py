"""Optimizer steps paced by claimed micro-batches: a faster rank computes more of each step (pure torch).

Every optimizer step is one global batch of ``micro_batches`` micro-batches: the batch numbers
``[cursor, cursor + micro_batches)`` of the epoch (claims.py). Whichever rank claims a batch computes it, so a rank
twice as fast computes about twice as many; the step's half A (acco) is the first ``micro_batches // 2`` of them,
half B the rest. A rank ends its half when its next claim lies beyond it, and its step when the claim lies in a later
step (it keeps that batch for then) or the epoch's batches are all claimed. A rank may compute nothing in a half or a
step; it still takes part in the step's rounds, which average its peers' gradients. With per-rank streams
(``StreamTickets``) the numbers are given as each rank takes a batch from its own stream, a stream that ends starts
again, and the position to resume from includes every rank's place in its stream.

So the global batch, the steps per epoch (``ceil(num_batches / micro_batches)``), the learning-rate schedule and
every rank's step count are what they would be with ``micro_batches`` spread evenly: only who computes what depends
on speed, and the step is the single-process step over the same micro-batches (up to the order of float sums). Ranks
meet at no point but the rounds; at every step boundary all of them are at the same step, with no claimed batch of
an earlier step unused, so the position in the epoch is the cursor alone (``state_dict``): it resumes on any number
of ranks.

    pacer = Pacer(loader, sampler, micro_batches=world_size * 4)    # loader: DataLoader(batch_sampler=sampler)
    # or, for an IterableDataset: Pacer(DataLoader(this_ranks_shard, batch_size=8), StreamTickets(store, 8), ...)
    for epoch in range(epochs):
        pacer.set_epoch(epoch)
        while not pacer.epoch_done:
            for batch in pacer.step_batches(optimizer):           # optimizer: ACCOOptimizer(accumulation="paced")
                model(**batch).loss.backward()
                optimizer.after_backward()
            scheduler.step()
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import Any

from hf_acco.comm.groups import every_rank, world_rank, world_size
from hf_acco.engine.schedule import Accumulation
from hf_acco.pacing.claims import ClaimingBatchSampler, StreamTickets

STATE_FORMAT = "hf_acco.pacing/1"


class Pacer:
    """Steps of ``micro_batches`` claimed micro-batches (over all ranks) for a paced ``ACCOOptimizer``.

    Args:
        loader: yields the batches of ``sampler``'s claims in claim order (a DataLoader with
            ``batch_sampler=sampler``, ``in_order=True``: the default), or this rank's stream with ``StreamTickets``.
        sampler: the ``ClaimingBatchSampler`` behind ``loader``, or ``StreamTickets``.
        micro_batches: micro-batches per optimizer step over all ranks (for acco at least 2: one per half).
    """

    def __init__(
        self, loader: Iterable[Any], sampler: ClaimingBatchSampler | StreamTickets, micro_batches: int
    ) -> None:
        if micro_batches < 1:
            raise ValueError(f"micro_batches (per step, over all ranks) must be >= 1, got {micro_batches}")
        if getattr(loader, "in_order", True) is False:
            raise ValueError("The loader must return batches in claim order: build the DataLoader with in_order=True.")
        self.loader, self.sampler, self.micro_batches = loader, sampler, micro_batches
        self.epoch, self.cursor = 0, 0  # the next step's first batch number
        self.computed = 0  # micro-batches this rank computed, in all
        self._it: Iterator[Any] | None = None
        self._held: tuple[int, Any] | None = None  # a claimed batch of a later step
        self._exhausted = False
        self._resume: dict[str, Any] | None = None
        self._stream_start: dict[int, tuple[int, int]] = {}  # a resumed stream: rank -> (passes, batches used)
        self._passes, self._taken = 0, 0  # a stream: passes over it started in this epoch, batches of this pass

    @property
    def num_batches(self) -> int:
        return self.sampler.num_batches

    @property
    def epoch_done(self) -> bool:
        return self.cursor >= self.num_batches

    @property
    def progress(self) -> float:
        """Epochs done, with the fraction of this one (as Trainer's ``state.epoch``)."""
        return self.epoch + min(self.cursor, self.num_batches) / self.num_batches

    def steps_left(self) -> int:
        """Optimizer steps left in this epoch (in the epoch a loaded state continues, before it starts)."""
        cursor = self._resume["cursor"] if self._resume is not None else self.cursor
        return -(-max(self.num_batches - cursor, 0) // self.micro_batches)

    def set_epoch(self, epoch: int) -> None:
        """Start epoch ``epoch`` (where a loaded state left it, if it is that epoch). Every rank, in the same order."""
        start = 0
        if self._resume is not None and self._resume["epoch"] == epoch:
            start, self._resume = self._resume["cursor"], None
        self.sampler.set_epoch(epoch, start)
        self.epoch, self.cursor = epoch, start
        self._held, self._exhausted = None, False
        passes, skip = self._stream_start.get(_rank(), (0, 0))
        self._stream_start = {}
        it = self._start_pass(passes)
        for _ in range(skip):  # a resumed stream: the batches this rank had used (fetched again, as Trainer does)
            next(it)
        self._taken = skip

    def _start_pass(self, passes: int) -> Iterator[Any]:
        self._passes, self._taken = passes, 0
        dataset = getattr(self.loader, "dataset", None)
        if self.sampler.endless and dataset is not None and hasattr(dataset, "set_epoch"):
            dataset.set_epoch(passes)  # a streamed dataset's shuffling follows its pass
        self._it = it = iter(self.loader)
        return it

    def step_batches(self, optimizer: Any) -> Iterator[Any]:
        """This rank's micro-batches of the next optimizer step; ends the step's halves and the step on
        ``optimizer`` (an ACCOOptimizer, or Accelerate's wrapper of one) as the claims cross them (the step has
        ended when the iterator is done)."""
        if self._it is None:
            raise RuntimeError("Call set_epoch(epoch) before the first step of an epoch.")
        if self.epoch_done:
            raise RuntimeError(f"Epoch {self.epoch} has no step left: call set_epoch for the next one.")
        optimizer = getattr(optimizer, "optimizer", optimizer) if not hasattr(optimizer, "end_step") else optimizer
        if getattr(optimizer, "accumulation", None) is not Accumulation.PACED:
            raise ValueError("Pacer drives an ACCOOptimizer built with accumulation='paced'.")
        lo = self.cursor
        hi, mid = min(lo + self.micro_batches, self.num_batches), lo + self.micro_batches // 2
        while True:
            held = self._next()
            if held is None or held[0] >= hi:  # the data is used up, or the batch is a later step's: keep it
                break
            if held[0] >= mid:
                optimizer.end_half()  # nothing once in half B, or without two halves (dpu, sync, warm-up)
            self._held = None
            self.computed += 1
            yield held[1]
        optimizer.end_step()
        self.cursor = hi

    def _next(self) -> tuple[int, Any] | None:
        """The oldest claimed, uncomputed batch with its batch number; None once the epoch's batches are claimed."""
        if self._held is None and not self._exhausted:
            batch = self._fetch()
            if batch is None:
                self._exhausted = True
                return None
            self._held = (self.sampler.next_number(), batch)
        return self._held

    def _fetch(self) -> Any:
        try:
            batch = next(self._it)  # type: ignore[arg-type]
        except StopIteration:
            if not self.sampler.endless:
                return None
            it = self._start_pass(self._passes + 1)  # this rank's stream ended: its next pass
            try:
                batch = next(it)
            except StopIteration:
                raise ValueError("This rank's stream of training data is empty: check the dataset's shards.") from None
        self._taken += 1
        return batch

    # ---- resume -------------------------------------------------------------------------------------------

    def state_dict(self) -> dict[str, Any]:
        """The position in the data at a step boundary: the same on every rank, for any number of ranks. With
        streams it holds every rank's place in its own stream: collective then (every rank, same boundary), and it
        resumes on the same number of ranks."""
        state = {"format": STATE_FORMAT, "epoch": self.epoch, "cursor": self.cursor, **self.sampler.identity()}
        if self.sampler.endless:  # the batch held for the next step is taken again after a resume
            mine = (self._passes, self._taken - (self._held is not None))
            state["streams"] = [list(p) for p in every_rank(mine)]
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue where ``state`` left off: ``set_epoch(state["epoch"])`` starts at its cursor (an epoch's end is
        the next epoch's start: ``resume_epoch``)."""
        if state.get("format") != STATE_FORMAT:
            raise ValueError("Not an hf_acco data position (missing or unknown 'format').")
        for name, value in self.sampler.identity().items():
            if state.get(name) != value:
                raise ValueError(
                    f"The saved data position was for {name}={state.get(name)}, this run has {value}: resume with "
                    "the same dataset (map-style or streamed), batch size and seed."
                )
        if self.sampler.endless:
            world = world_size()
            if len(state["streams"]) != world:
                raise ValueError(
                    f"The saved position is in {len(state['streams'])} ranks' streams (an IterableDataset, one shard "
                    f"per rank); this run has {world} ranks. Resume a streamed dataset on the same number of ranks."
                )
            self._stream_start = {r: (p, k) for r, (p, k) in enumerate(state["streams"])}
        self._resume = dict(state)
        if not self.sampler.endless and self._resume["cursor"] >= self.num_batches:
            self._resume.update(epoch=state["epoch"] + 1, cursor=0)

    @property
    def resume_epoch(self) -> int:
        """The epoch a loaded state continues (0 without one)."""
        return self._resume["epoch"] if self._resume is not None else self.epoch


def _rank() -> int:
    return world_rank()
