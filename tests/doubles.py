"""Test doubles of the package's parts: a ``Communicator`` whose rounds take longer (tests, benchmarks/engine.py)."""

from __future__ import annotations

import time
from typing import Any

import torch
import torch.distributed as dist

from hf_acco.comm import quant
from hf_acco.comm.communicator import Communicator
from hf_acco.comm.exchange import all_gather_into
from hf_acco.comm.sharding import FlatLayout


class DelayedCommunicator(Communicator):
    """A ``Communicator`` whose rounds each take ``delay_s`` longer (sleeps in the background thread, half
    before the reduce-scatter and half before the all-gather, as a slow link slows both).

    Emulates a slow link without using CPU, for overlap experiments and tests: in a fixed-mode ACCO step the
    delay hides behind compute up to the length of a half.
    """

    def __init__(self, delay_s: float, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.delay_s = delay_s

    def reduce_scatter(
        self, layout: FlatLayout, flat: torch.Tensor, shard: torch.Tensor, feedback: quant.ErrorFeedback | None = None
    ) -> None:
        time.sleep(self.delay_s / 2)
        super().reduce_scatter(layout, flat, shard, feedback)

    def all_gather_packed(self, recv: torch.Tensor, send: torch.Tensor) -> dist.Work:
        """Row r of ``recv`` ((world_size, n) int8) <- rank r's ``send`` ((n,) int8), asynchronously (the packed
        int8 or int4 changes of ``deltas.DeltaGather``). Not delayed: a round whose changes travel packed takes
        only the reduce-scatter's half of ``delay_s``."""
        return all_gather_into(recv.view(-1), send, self.group)

    def all_gather(self, layout: FlatLayout, shard: torch.Tensor | None, flat: torch.Tensor) -> None:
        time.sleep(self.delay_s / 2)
        super().all_gather(layout, shard, flat)
