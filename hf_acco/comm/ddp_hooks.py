"""DDP communication hooks for the baselines ACCO is measured against (``integrations/baselines.py``). Torch only."""

from __future__ import annotations

import torch
import torch.distributed as dist


def bf16_wire_hook(process_group, bucket):  # noqa: ANN001, ANN201 - DDP checks the annotations' objects
    """torch's ``default_hooks.bf16_compress_hook``, which DDP refuses by name off NCCL: each bucket averaged in
    bf16 on the wire."""
    group = process_group if process_group is not None else dist.group.WORLD
    compressed = bucket.buffer().to(torch.bfloat16).div_(dist.get_world_size(group))
    future = dist.all_reduce(compressed, group=group, async_op=True).get_future()

    def decompress(done: torch.futures.Future) -> torch.Tensor:
        return bucket.buffer().copy_(done.value()[0])

    return future.then(decompress)
