"""Process-group helpers shared by the Trainer glue and the Accelerate hook (torch only, so that a hand-written
Accelerate loop does not load transformers)."""

from __future__ import annotations

import uuid
from typing import Any

import torch
import torch.distributed as dist


def ensure_process_group(device: torch.device) -> None:
    """A one-process run still needs a process group for the engine: make a single-rank one."""
    if dist.is_initialized():
        return
    backend = "nccl" if device.type == "cuda" else "gloo"
    dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1)


def agreed_key(kind: str) -> str:
    """A name for this run's claim counters, rank 0's on every rank (collective)."""
    key = [f"hf_acco/{kind}/{uuid.uuid4().hex}"]
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.broadcast_object_list(key, src=0)
    return key[0]


def every_rank(obj: Any) -> list[Any]:
    """Collective: every rank's ``obj``, in rank order."""
    if not (dist.is_initialized() and dist.get_world_size() > 1):
        return [obj]
    out: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(out, obj)
    return out
