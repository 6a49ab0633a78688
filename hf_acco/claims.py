"""Data at each rank's own pace: micro-batches claimed from a shared counter, every sample once per epoch.

With dynamic accumulation a faster rank computes more micro-batches than a slower one. A fixed shard per rank
(DistributedSampler) would then over-represent the fast rank's shard, or leave the slow rank's unfinished. Here
every rank walks the same seeded permutation of the dataset, and takes the next batch of it by an atomic
``store.add`` on torch.distributed's c10d store (the one the process group was built on): the batches of all
ranks together are the permutation cut into batches, each exactly once, whatever the speeds.

One claim is one micro-batch, made when the rank is about to compute it, so at an optimizer-step boundary no rank
holds a claimed, unused batch: the epoch's state is the counter alone (``state_dict``), and it resumes on any
number of ranks (``load_state_dict``) without repeating or skipping a sample. Pure torch.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import torch
import torch.distributed as dist

STATE_FORMAT = "hf_acco.claims/1"


def default_store() -> dist.Store:
    """The c10d store the default process group was built on (every rank's counters meet there)."""
    return dist.distributed_c10d._get_default_store()


class ClaimingBatchSampler:
    """Batches of a seeded per-epoch permutation of ``range(num_samples)``, claimed one at a time from ``store``.

    Args:
        store: a c10d store shared by the ranks (``default_store()``; tests pass a FileStore or HashStore).
        num_samples: the dataset's length.
        batch_size: samples per micro-batch.
        seed: the permutation's seed (the same on every rank); ``epoch`` is added to it, as DistributedSampler does.
        drop_last: drop the epoch's last, shorter batch (every rank agrees: it is the same batch).
        shuffle: ``False`` walks ``range(num_samples)`` in order.
        key: the counter's name in the store (one counter per epoch under it).
    """

    def __init__(
        self,
        store: dist.Store,
        num_samples: int,
        batch_size: int,
        seed: int = 0,
        drop_last: bool = False,
        shuffle: bool = True,
        key: str = "hf_acco/claims",
    ) -> None:
        if num_samples < 1 or batch_size < 1:
            raise ValueError(f"need num_samples >= 1 and batch_size >= 1, got {num_samples} and {batch_size}")
        self.store, self.num_samples, self.batch_size = store, num_samples, batch_size
        self.seed, self.drop_last, self.shuffle, self.key = seed, drop_last, shuffle, key
        self.epoch = 0
        self.claimed = 0  # batches this rank has claimed in this epoch

    def set_epoch(self, epoch: int) -> None:
        self.epoch, self.claimed = epoch, 0

    @property
    def num_batches(self) -> int:
        """Batches in an epoch, over all ranks together."""
        full, rest = divmod(self.num_samples, self.batch_size)
        return full + (1 if rest and not self.drop_last else 0)

    def __len__(self) -> int:
        # Over all ranks: how many this rank gets depends on its speed. Loaders that need a length (Trainer's
        # steps per epoch) get the epoch's total; the end of the epoch is the shared counter's.
        return self.num_batches

    def permutation(self) -> torch.Tensor:
        if not self.shuffle:
            return torch.arange(self.num_samples)
        g = torch.Generator().manual_seed(self.seed + self.epoch)
        return torch.randperm(self.num_samples, generator=g)

    def __iter__(self) -> Iterator[list[int]]:
        order = self.permutation()
        while True:
            b = self._claim()
            if b >= self.num_batches:
                return
            self.claimed += 1
            yield order[b * self.batch_size : (b + 1) * self.batch_size].tolist()

    def _counter(self) -> str:
        return f"{self.key}/epoch{self.epoch}"

    def _claim(self) -> int:
        """The next batch index of this epoch, for this rank alone (atomic across ranks)."""
        return int(self.store.add(self._counter(), 1)) - 1

    # ---- resume -------------------------------------------------------------------------------------------

    def state_dict(self) -> dict[str, Any]:
        """The epoch's position: batches claimed by all ranks so far. Take it at a step boundary (no claimed batch
        unused), on any rank: it is the same everywhere."""
        return {"format": STATE_FORMAT, "epoch": self.epoch, "seed": self.seed, "claimed": int(self.store.add(
            self._counter(), 0)), "num_samples": self.num_samples, "batch_size": self.batch_size}  # fmt: skip

    def load_state_dict(self, state: dict[str, Any], set_counter: bool) -> None:
        """Continue an epoch where ``state`` left it (any number of ranks). ``set_counter`` on exactly one rank,
        before any rank iterates (e.g. rank 0, then a barrier): it writes the shared counter."""
        if state.get("format") != STATE_FORMAT:
            raise ValueError("Not an hf_acco claims state (missing or unknown 'format').")
        for name in ("num_samples", "batch_size", "seed"):
            if state[name] != getattr(self, name):
                raise ValueError(
                    f"The saved data position was for {name}={state[name]}, this run has {getattr(self, name)}: "
                    "resume with the same dataset, batch size and seed."
                )
        self.set_epoch(state["epoch"])
        if set_counter:
            self.store.set(self._counter(), str(int(state["claimed"])))
