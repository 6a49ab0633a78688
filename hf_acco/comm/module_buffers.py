"""A module's statistics buffers (BatchNorm's running mean and variance, ...) kept as DDP keeps them with
``broadcast_buffers=True``.

ACCO trains without the DistributedDataParallel wrapper, whose forward broadcasts rank 0's buffers. DDP does it
before a forward when the forward before it synchronised gradients (``require_forward_param_sync``): before the
first forward, then before the first micro-batch of each accumulation window (the forwards under ``no_sync`` set
the flag False). ``BufferSync`` does the same from forward hooks, told by ``is_sync`` whether the current forward
is a window's last. Forwards without autograd (evaluation: Trainer evaluates the unwrapped model, outside DDP)
neither broadcast nor change the flag.

What goes: the persistent buffers (those a checkpoint saves), by torch's own coalesced broadcast on the default
process group, on the main thread (the rounds use the engine's own groups). DDP sends non-persistent buffers too;
those are tables a model derives from its config (rotary embeddings' frequencies, causal masks), the same on every
rank, and sending them would make every rank of an LLM meet at every optimizer step for nothing. A model without
persistent buffers makes no collective at all.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

BROADCAST_BUCKET_BYTES = 250 * 1024 * 1024  # DDP's bucket for its parameter and buffer broadcasts


def persistent_buffers(module: torch.nn.Module) -> list[tuple[torch.nn.Module, str]]:
    """(owner, name) of every persistent buffer of ``module``, each once, in ``named_buffers`` order."""
    found, seen = [], set()
    for owner in module.modules():
        for name, buf in owner.named_buffers(recurse=False):
            if buf is not None and name not in owner._non_persistent_buffers_set and id(buf) not in seen:
                seen.add(id(buf))
                found.append((owner, name))
    return found


class BufferSync:
    """Rank 0's persistent buffers of ``module`` on every rank before a training forward, when DDP would broadcast
    them.

    Args:
        module: the model (each buffer is read again at each broadcast: a buffer may be reassigned).
        is_sync: whether the forward that just ran is the last of its accumulation window (Accelerate's
            ``sync_gradients``).
        group: the process group (``None``: the default one).
    """

    def __init__(self, module: torch.nn.Module, is_sync: Callable[[], bool], group: Any = None) -> None:
        self.module, self.is_sync, self.group = module, is_sync, group
        self.buffers = persistent_buffers(module)
        self.due = True  # DDP's require_forward_param_sync: True before the first forward
        self.broadcasts = 0
        self._hooks = []
        if self.buffers:
            self._hooks = [module.register_forward_pre_hook(self._before), module.register_forward_hook(self._after)]

    def _before(self, module: torch.nn.Module, args: Any) -> None:
        if not (self.due and torch.is_grad_enabled()):
            return
        if dist.is_initialized() and dist.get_world_size(self.group) > 1:
            group = self.group if self.group is not None else dist.group.WORLD
            assert group is not None
            tensors = [getattr(owner, name).detach() for owner, name in self.buffers]
            with torch.no_grad():
                dist._broadcast_coalesced(group, tensors, BROADCAST_BUCKET_BYTES, 0)
            self.broadcasts += 1

    def _after(self, module: torch.nn.Module, args: Any, output: Any) -> None:
        if torch.is_grad_enabled():
            self.due = bool(self.is_sync())

    def remove(self) -> None:
        for hook in self._hooks:
            hook.remove()
        self._hooks = []


def has_running_statistics(module: torch.nn.Module) -> bool:
    """Whether ``module`` keeps statistics in buffers that each rank's data would change (BatchNorm's)."""
    return any(isinstance(m, torch.nn.modules.batchnorm._NormBase) and m.track_running_stats for m in module.modules())
