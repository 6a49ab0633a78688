"""FSDP2 inside each machine (docs/hsdp.md): what the engine reads and writes of a sharded model's parameters, and
the settings the mode needs."""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch.distributed.tensor import DTensor


@torch.no_grad()
def local_data(p: torch.Tensor) -> torch.Tensor:
    """What the engine reads and writes of a parameter: the parameter, or, for an FSDP2 (DTensor) parameter, this
    rank's local shard (a view of the storage FSDP all-gathers from: a write is seen by the next all-gather)."""
    return p.to_local() if isinstance(p, DTensor) else p


def check_fsdp(params: Sequence[torch.Tensor], accumulation: str) -> None:
    """An FSDP2 model (DTensor parameters: FSDP inside each machine, docs/hsdp.md) needs ``accumulation="fixed"``:
    the ranks of a machine run FSDP's all-gathers and reduce-scatters in lockstep, so every rank computes the same
    number of micro-batches. Raised before any collective."""
    if accumulation != "fixed" and any(isinstance(p, DTensor) for p in params):
        raise ValueError(
            f"accumulation={accumulation!r} with an FSDP2 model: the ranks of a machine must compute the same "
            "micro-batches (FSDP's collectives run in lockstep), and paced or dynamic accumulation lets each rank "
            "compute its own. Use accumulation='fixed'."
        )
