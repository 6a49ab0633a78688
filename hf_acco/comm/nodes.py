"""Which machine a rank runs on: the two levels of int8 gradients between machines (``comm_dtype="int8"``), and
the machine named in messages.

A job launched per machine (torchrun, ``accelerate launch``) numbers its ranks machine by machine and tells each
process how many ranks its machine runs (``LOCAL_WORLD_SIZE``) and which one it is (``LOCAL_RANK``). On ``n``
machines of ``g`` ranks each, with ``n`` and ``g`` both above 1, int8 gradients go in two levels, as ZeRO++'s
quantised gradients (qgZ) do:

1. inside each machine, a reduce-scatter in the dtype ``"auto"`` sends (over the machine's fast links): local rank
   ``l`` gets the machine's sum of the chunks whose owners have local rank ``l`` (one on every machine);
2. between machines, an all-to-all among the ``n`` ranks of local rank ``l`` (one per machine): each sends every
   other owner its chunk of the machine's sum, quantised blockwise; the owner sums the ``n`` chunks in fp32, in
   machine order.

What leaves a machine is then ``(n - 1) / n`` of the gradients in int8, as a ring's ``(p - 1) / p`` would be; a flat
all-to-all over all ``p = n g`` ranks would send ``g (p - g) / p`` of them (four times a ring's with 8 ranks on
each of 2 machines, more with more machines). On one machine, or one rank per machine, the all-to-all is flat.
"""

from __future__ import annotations

import datetime
import os
import socket
import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from hf_acco.comm.exchange import all_gather_into

REDUCE_SCATTER = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


def machines(world_size: int, ranks_per_node: int | None = None) -> tuple[int, int]:
    """(machines, ranks per machine): ``ranks_per_node`` if given, else the launcher's ``LOCAL_WORLD_SIZE``; a flat
    (``world_size``, 1) when machines run unequal numbers of ranks."""
    g = ranks_per_node if ranks_per_node is not None else int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    if g < 1 or world_size % g:
        return world_size, 1
    return world_size // g, g


@dataclass
class NodeGroups:
    """The two levels' process groups of this rank: its machine's ranks, and the ranks of its local rank."""

    nodes: int
    per_node: int
    node: Any  # dist.ProcessGroup
    rail: Any

    def destroy(self) -> None:
        destroy_groups(self.node, self.rail)


def destroy_groups(*groups: Any) -> None:
    """Destroy each of ``groups`` that torch.distributed still holds (each once)."""
    for group in dict.fromkeys(groups):
        if dist.is_initialized() and group in dist.distributed_c10d._world.pg_map:
            dist.destroy_process_group(group)


def node_groups(
    ranks: list[int],
    rank: int,
    nodes: int,
    per_node: int,
    timeout: datetime.timedelta | None,
    options: Callable[[], Any],
) -> NodeGroups:
    """Collective (every rank of ``ranks``, the round's group's global ranks in its order): one group per machine
    and one per local rank, every rank creating every group in the same order (torch's rule for ``new_group``).
    ``options()`` makes each group's backend options: one object per group (NCCL keeps and configures the
    ``ProcessGroupNCCL.Options`` it is given, so two groups must not share one)."""
    mine_node, mine_rail = None, None
    for a in range(nodes):
        group = dist.new_group(ranks[a * per_node : (a + 1) * per_node], timeout=timeout, pg_options=options())
        mine_node = group if rank // per_node == a else mine_node
    for local in range(per_node):
        group = dist.new_group(ranks[local::per_node], timeout=timeout, pg_options=options())
        mine_rail = group if rank % per_node == local else mine_rail
    return NodeGroups(nodes, per_node, mine_node, mine_rail)


def launcher_layout_agreed(rank: int, host_group: Any) -> bool:
    """Collective (every rank of ``host_group``, before any of them decides): whether every rank read the same
    machine size (``LOCAL_WORLD_SIZE``) and is numbered machine by machine (``LOCAL_RANK``). Decided by each rank
    alone, a job on machines of unequal size (8 + 4 GPUs) would have some ranks build the two levels' groups while
    the others do not: a hang. Otherwise the flat all-to-all, said once."""
    per_node = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    local = int(os.environ.get("LOCAL_RANK", rank % max(per_node, 1)))
    mine = torch.tensor([float(per_node), -float(per_node), float(local != rank % max(per_node, 1))])
    dist.all_reduce(mine, op=dist.ReduceOp.MAX, group=host_group)
    largest, smallest, off = int(mine[0]), -int(mine[1]), bool(mine[2])
    if largest != smallest:
        warnings.warn(
            f"The machines of this job run unequal numbers of ranks (LOCAL_WORLD_SIZE from {smallest} to "
            f"{largest}): int8 gradients go by one flat all-to-all over all ranks instead of two levels (inside "
            "each machine, then between machines), which sends more bytes between machines.",
            stacklevel=5,
        )
    return largest == smallest and not off


def warm_collectives(
    backend: str, group: Any, kinds: Sequence[str], numel: int = 1, dtype: torch.dtype = torch.float32
) -> None:
    """One collective of each of ``kinds`` ("all_reduce", "all_gather", "all_to_all", "reduce_scatter") on
    ``group``, of ``numel`` elements of ``dtype`` (a round's bucket: the all-reduce stays a few numbers, the norm's),
    here, on the calling (main) thread. NCCL makes a group's communicator at its first collective and, with lazy
    connection (NCCL 2.22 on, ``NCCL_RUNTIME_CONNECT=1``), each algorithm's connections at their first use, the
    algorithm chosen by the message's size (and the all-to-all's point-to-point connections at its first): the
    round's thread would otherwise set them up beside the compute and FSDP's collectives (a rendezvous of every
    member, seconds at scale) and be the first to see a setup failure. A gloo group connects when it is made: there
    this is a few messages. Collective: every rank of ``group``, at the same point (the engine's construction,
    ``reopen``). The buffers are freed when it returns."""
    device = torch.device("cuda", torch.cuda.current_device()) if backend == "nccl" else torch.device("cpu")
    size = group.size()
    n = -(-max(numel, size) // size) * size  # a whole number of pieces, as a bucket is
    for kind in kinds:
        if kind == "all_reduce":
            dist.all_reduce(torch.zeros(1, device=device), group=group)
        elif kind == "all_gather":
            out = torch.zeros(n, dtype=dtype, device=device)
            all_gather_into(out, out[: n // size].clone(), group, point_to_point=False).wait()
        elif kind == "all_to_all":
            send = torch.zeros(n, dtype=dtype, device=device)
            dist.all_to_all_single(torch.empty_like(send), send, group=group)
        elif kind == "reduce_scatter":
            send = torch.zeros(n, dtype=dtype, device=device)
            REDUCE_SCATTER(send[: n // size].clone(), send, group=group)
        else:
            raise ValueError(f"no such collective to warm: {kind!r}")


def round_collectives(spelling: str, int8: bool, norm: bool) -> tuple[str, ...]:
    """The device collectives a round issues on its own group: the all-gather of its output; its reduce-scatter,
    native (``spelling``) or as an all-to-all (gloo's, and int8 gradients' on every backend: the rail group's in
    two levels, which ``Communicator`` warms itself); the norm's all-reduce (``norm``: where the group's sum is
    the norm's, not the world's over gloo)."""
    scatter = ("reduce_scatter",) if spelling == "native" and not int8 else ("all_to_all",)
    return ("all_gather", *scatter, *(("all_reduce",) if norm else ()))


def partition_of(ranks: list[int] | None) -> list[list[int]] | None:
    """Collective (the whole world): every rank's ``ranks`` (its round's group), distinct, in the order of their
    lowest rank; None when every rank has the same (the usual case, the world or one group). They must partition
    the world, each rank in its own part: HSDP's replicate groups, one per FSDP shard index."""
    if ranks is None or dist.get_world_size() == 1:
        return None
    every: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(every, sorted(ranks))
    parts = sorted({tuple(r) for r in every})
    if len(parts) == 1:
        return None
    members = sorted(r for part in parts for r in part)
    if members != list(range(dist.get_world_size())) or any(rank not in every[rank] for rank in range(len(every))):
        raise ValueError(
            f"ACCO's process groups differ between ranks ({[list(p) for p in parts]}) but do not partition the world "
            "with each rank in its own: pass each rank the group of the ranks it exchanges with (for FSDP inside "
            "each machine: the mesh's replicate group, mesh.get_group('dp_replicate'))."
        )
    return [list(part) for part in parts]


def node() -> str:
    """Which machine this process runs on, for messages of a multi-node job: the launcher's node rank
    (``GROUP_RANK``, set by torchrun and ``accelerate launch``) and the host's name."""
    rank = os.environ.get("GROUP_RANK")
    return f"node {rank}, {socket.gethostname()}" if rank is not None else socket.gethostname()


def gloo_failure(error: BaseException) -> str:
    """What to do when a gloo group of ACCO's (the round's counts go over gloo on the host, also on NCCL) cannot be
    set up: the interface gloo binds and the address it resolved, and what to set."""
    interface = os.environ.get("GLOO_SOCKET_IFNAME")
    if interface:
        where = f"GLOO_SOCKET_IFNAME={interface!r}"
    else:
        host = socket.gethostname()
        try:
            address = socket.gethostbyname(host)
        except OSError:
            address = "no address"
        where = f"GLOO_SOCKET_IFNAME unset: the address of the hostname {host!r} ({address})"
    rank = dist.get_rank() if dist.is_initialized() else "?"
    return (
        f"ACCO could not set up its gloo group on rank {rank} ({node()}; {where}): {type(error).__name__}: {error}. "
        "ACCO sends "
        "each round's counts over gloo (TCP between the hosts), also when the gradients go over NCCL. Set "
        "GLOO_SOCKET_IFNAME on every node to the network interface the nodes reach each other on (`ip -br addr`; "
        "often the one NCCL_SOCKET_IFNAME names), and let TCP through between the nodes: the rendezvous port "
        "(MASTER_PORT) and the ephemeral ports gloo listens on."
    )
