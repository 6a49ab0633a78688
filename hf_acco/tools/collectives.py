"""One collective of the engine's, alone: what the benchmarks and the planner's calibration time."""

from __future__ import annotations

import torch

from hf_acco.comm.communicator import Communicator
from hf_acco.comm.sharding import FlatLayout


def one_collective(comm: Communicator, kind: str, layout: FlatLayout, flat: torch.Tensor, shard: torch.Tensor) -> None:
    """``kind`` "all_reduce": DDP's all-reduce of ``flat``; anything else: one ACCO/ZeRO-1 round, the reduce-scatter
    of ``flat`` into ``shard`` and the all-gather of ``shard`` back into ``flat`` (in ``comm``'s spelling)."""
    if kind == "all_reduce":
        comm.all_reduce(flat)
    else:
        comm.reduce_scatter(layout, flat, shard)
        comm.all_gather(layout, shard, flat)
