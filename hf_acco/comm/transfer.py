"""Moving state between the members of a group outside the rounds: small records to everyone, and tensors point to
point (the in-memory re-shard, ``engine/reshard.py``). Collective over ``group``: every member calls each function
at the same point, with the messages it sends and receives (a peer is a rank in ``group``)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist


def check_host_group(group: dist.ProcessGroup | None = None) -> None:
    """Refuse a group that cannot move host tensors point to point (one of NCCL only): the same on every member."""
    backend = str(dist.get_backend(group))
    if "gloo" not in backend:
        raise ValueError(
            f"Moving optimizer state between ranks sends host tensors, which a {backend} group cannot: pass a gloo "
            "group over the same ranks (torch.distributed.new_group(ranks, backend='gloo'))."
        )


def member_rank(group: dist.ProcessGroup | None = None) -> int:
    """This process's rank in ``group`` (the world's: None)."""
    return dist.get_rank(group)


def gather_objects(obj: Any, group: dist.ProcessGroup | None = None) -> list[Any]:
    """Every member's ``obj`` (picklable, small), in rank order of ``group``."""
    out: list[Any] = [None] * dist.get_world_size(group)
    dist.all_gather_object(out, obj, group=group)
    return out


def send_receive(
    sends: Sequence[tuple[int, torch.Tensor]],
    receives: Sequence[tuple[int, torch.Tensor]],
    group: dist.ProcessGroup | None = None,
) -> None:
    """Send each (peer, tensor) of ``sends`` and fill each (peer, tensor) of ``receives``, all posted together and
    waited for. One pair's messages match in the order each side lists them (one tag): both sides must list a
    pair's messages in the same order. A member's messages to itself are not for this function (copy them)."""
    me = dist.get_rank(group)
    if any(peer == me for peer, _ in [*sends, *receives]):
        raise ValueError("send_receive moves tensors between members; a member's own are copied, not sent")
    ops = [dist.P2POp(dist.irecv, t, group=group, group_peer=peer) for peer, t in receives]
    ops += [dist.P2POp(dist.isend, t.contiguous(), group=group, group_peer=peer) for peer, t in sends]
    for work in dist.batch_isend_irecv(ops) if ops else []:
        work.wait()
