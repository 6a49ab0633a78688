"""Process-group helpers shared by the Trainer glue and the Accelerate hook (torch only, so that a hand-written
Accelerate loop does not load transformers)."""

from __future__ import annotations

import gc
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


def end_training(accelerator: Any, trainer: Any = None) -> None:
    """A run's last distributed act, in the order that cannot hang at exit: every rank here, then the wrapped
    models released, then the process groups destroyed (``accelerator.end_training()``). Call it last; the
    caller drops its own references to a DistributedDataParallel model before it.

    A DistributedDataParallel model that outlives ``destroy_process_group()`` is left holding the last reference
    to the gloo process group, in its C++ reducer. torch binds the reducer without giving up the GIL in its
    destructor, so the group's destructor, which joins its worker threads, then runs with the GIL held, while a
    worker thread that still has to let go of a finished collective's tensors waits for the GIL: that rank never
    exits (seen in CI: the main thread in a destructor as ``main()`` returned, a second thread with no Python frame).
    Released first, the model drops a reference that the process-group registry still holds; the registry lets go
    of the last one from Python, and that destructor does give up the GIL while it joins.
    """
    accelerator.wait_for_everyone()
    if trainer is not None:
        trainer.model_wrapped = trainer.model  # the Trainer's reference to the wrapper
    accelerator.free_memory()  # Accelerate's references to what it prepared (the wrapper among them)
    gc.collect()  # a wrapper held only in reference cycles goes now, not at exit
    accelerator.end_training()
