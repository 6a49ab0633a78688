"""Data at each rank's own pace: micro-batches claimed from a shared counter, every sample once per epoch.

With dynamic accumulation a faster rank computes more micro-batches than a slower one. A fixed shard per rank
(DistributedSampler) would then over-represent the fast rank's shard, or leave the slow rank's unfinished. Here
every rank walks the same seeded permutation of the dataset, and takes the next batch of it by an atomic
``store.add`` on torch.distributed's c10d store (the one the process group was built on): the batches of all
ranks together are the permutation cut into batches, each exactly once, whatever the speeds.

A claim is one micro-batch. Each claimed batch number is also kept (``taken``, in claim order) so that the loader's
batches can be matched to their place in the epoch: pacing.py ends optimizer steps where the claims say. An epoch
resumed mid-way starts at a batch number (``set_epoch(epoch, start)``) on any number of ranks. Pure torch.
"""

from __future__ import annotations

import itertools
import sys
from collections import deque
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch
import torch.distributed as dist

_SAMPLERS = itertools.count()  # every rank builds its samplers in the same order: the same counter names


class ClaimingBatchSampler:
    """Batches of a seeded per-epoch permutation of ``range(num_samples)``, claimed one at a time from ``store``.

    Args:
        store: a c10d store shared by the ranks (``comm.groups.claims_store()``; tests pass a FileStore or HashStore).
        num_samples: the dataset's length.
        batch_size: samples per micro-batch.
        seed: the permutation's seed (the same on every rank); ``epoch`` is added to it, as DistributedSampler does.
        drop_last: drop the epoch's last, shorter batch (every rank agrees: it is the same batch).
        shuffle: ``False`` walks ``range(num_samples)`` in order.
        key: the counters' name in the store (default: one per sampler built, numbered in the order every rank
            builds them; one counter per ``set_epoch`` under it).
        num_replicas: the ranks sharing the epoch; ``len()`` is one rank's share on average.
        order: ``order(epoch)`` gives the epoch's sample order instead of the seeded permutation (e.g. grouped by
            length); the same on every rank.

    Call ``set_epoch`` before every epoch, as for DistributedSampler: each call opens a new counter.
    """

    endless = False  # an epoch ends when its batches are all claimed

    def __init__(
        self,
        store: dist.Store,
        num_samples: int,
        batch_size: int,
        seed: int = 0,
        drop_last: bool = False,
        shuffle: bool = True,
        key: str | None = None,
        num_replicas: int = 1,
        order: Callable[[int], Sequence[int]] | None = None,
    ) -> None:
        if num_samples < 1 or batch_size < 1 or num_replicas < 1:
            raise ValueError(
                f"need num_samples, batch_size, num_replicas >= 1, got {num_samples}, {batch_size}, {num_replicas}"
            )
        self.store, self.num_samples, self.batch_size = store, num_samples, batch_size
        self.seed, self.drop_last, self.shuffle, self.order = seed, drop_last, shuffle, order
        self.key = key if key is not None else f"hf_acco/pacing/claims/{next(_SAMPLERS)}"
        self.num_replicas = num_replicas
        self.epoch, self.start, self._opened = 0, 0, 0
        self.taken: deque[int] = deque()  # batch numbers claimed and handed out, oldest first

    def set_epoch(self, epoch: int, start: int = 0) -> None:
        """The next iteration walks epoch ``epoch`` from batch number ``start`` (a resumed epoch: the batches before
        it were used), on a fresh counter."""
        self.epoch, self.start = epoch, start
        self._opened += 1
        self.taken.clear()

    @property
    def num_batches(self) -> int:
        """Batches in an epoch, over all ranks together."""
        full, rest = divmod(self.num_samples, self.batch_size)
        return full + (1 if rest and not self.drop_last else 0)

    def __len__(self) -> int:
        # One rank's share on average, as DistributedSampler's: Trainer's steps per epoch come out as under DDP. How
        # many a rank gets depends on its speed; the epoch ends when the shared counter passes num_batches.
        return -(-self.num_batches // self.num_replicas)

    def permutation(self) -> torch.Tensor:
        if self.order is not None:
            return torch.as_tensor(list(self.order(self.epoch)), dtype=torch.long)
        if not self.shuffle:
            return torch.arange(self.num_samples)
        g = torch.Generator().manual_seed(self.seed + self.epoch)
        return torch.randperm(self.num_samples, generator=g)

    def __iter__(self) -> Iterator[list[int]]:
        order = self.permutation()
        while True:
            b = self.start + self._claim()
            if b >= self.num_batches:
                return
            self.taken.append(b)
            yield order[b * self.batch_size : (b + 1) * self.batch_size].tolist()

    def _claim(self) -> int:
        """The next batch of this pass over the epoch, for this rank alone (atomic across ranks)."""
        return int(self.store.add(f"{self.key}/{self._opened}", 1)) - 1

    def next_number(self) -> int:
        """The batch number of the oldest batch handed out and not yet matched (the loader's next batch)."""
        return self.taken.popleft()

    def identity(self) -> dict[str, Any]:
        """What a resumed run must share with the saved one."""
        order = "custom" if self.order is not None else "permutation" if self.shuffle else "in order"
        return {"num_samples": self.num_samples, "batch_size": self.batch_size, "seed": self.seed,
                "drop_last": self.drop_last, "order": order}  # fmt: skip


class StreamTickets:
    """Numbers for the batches of per-rank streams (an IterableDataset: every rank reads its own shard).

    Each batch a rank takes from its stream gets the next number of one shared counter, so the batches of all ranks
    together are numbered 0, 1, 2, ... in the order they were taken, and steps are ranges of numbers as with
    ``ClaimingBatchSampler``. A stream has no epoch of its own over all ranks: a rank whose stream ends starts it
    again (pacing.py), so a faster rank goes through its shard more often; training ends at ``max_steps``.
    """

    endless = True
    num_batches = sys.maxsize

    def __init__(self, store: dist.Store, batch_size: int, key: str | None = None) -> None:
        self.store, self.batch_size = store, batch_size
        self.key = key if key is not None else f"hf_acco/tickets/{next(_SAMPLERS)}"
        self.epoch, self.start, self._opened = 0, 0, 0

    def set_epoch(self, epoch: int, start: int = 0) -> None:
        self.epoch, self.start = epoch, start
        self._opened += 1

    def next_number(self) -> int:
        return self.start + int(self.store.add(f"{self.key}/{self._opened}", 1)) - 1

    def identity(self) -> dict[str, Any]:
        return {"batch_size": self.batch_size, "stream": True}
