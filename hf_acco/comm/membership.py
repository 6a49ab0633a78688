"""Who is in the rounds: the process groups a ``Communicator``'s collectives run on, made over fixed ranks.

A round uses its **own** process group: the main thread may run collectives on the default group at the same time
(Trainer gathers metrics, users call barriers), and two threads issuing collectives on one group can deadlock (seen
in 3 of 3 runs on gloo). The groups are made collectively with ``new_group``: every rank at the same point, in the
same order as its other groups. Beside the round's group: a gloo group for the counts where the round's is not gloo,
a world-wide gloo group where the round's group is one part of the world (FSDP inside machines), and int8's node and
rail groups on several machines (``nodes.py``). ``destroy`` releases them (an engine closed holds none), ``reopen``
makes them again over the same ranks.

This is the static membership: the ranks are fixed for the groups' life. One that changes (a group rebuilt when a
machine is lost, torchft's) is another ``Membership``: the collectives (``Communicator``) only use its groups.
"""

from __future__ import annotations

import atexit
import datetime
from collections.abc import Callable

import torch.distributed as dist

from hf_acco.comm.groups import round_group_options
from hf_acco.comm.nodes import (
    NodeGroups,
    destroy_groups,
    gloo_failure,
    launcher_layout_agreed,
    machines,
    node_groups,
    partition_of,
)


class Membership:
    """The round's process groups over ``group``'s ranks (``None``: the world), made now (collective).

    Args:
        group: the ranks to train over. New groups over the same ranks are made.
        timeout: collective timeout of the groups; a dead peer raises instead of hanging forever.
        ranks_per_node: ranks per machine for int8's two levels (None: the launcher's ``LOCAL_WORLD_SIZE``).
    """

    def __init__(
        self,
        group: dist.ProcessGroup | None = None,
        timeout: datetime.timedelta | None = None,
        ranks_per_node: int | None = None,
    ) -> None:
        if not dist.is_initialized():
            raise RuntimeError(
                "torch.distributed is not initialised. Launch with `accelerate launch` or `torchrun`, or call "
                "`torch.distributed.init_process_group` before building the ACCO optimizer."
            )
        self._ranks = dist.get_process_group_ranks(group) if group is not None else None
        self._global_rank = dist.get_rank()
        self._parts = partition_of(self._ranks)  # every rank's part, when they differ (HSDP's replicate groups)
        self.timeout = timeout
        self.ranks_per_node = ranks_per_node  # None: the launcher's LOCAL_WORLD_SIZE (nodes.py)
        self.two_level: NodeGroups | None = None  # int8 gradients on several machines of several ranks
        self.in_round = False  # a round on these groups is running (on the background thread)
        self._make_groups(dist.get_backend(group))
        self.rank = dist.get_rank(self.group)
        self.world_size = dist.get_world_size(self.group)

    def _make_groups(self, backend: str) -> None:
        """The round's group (and a gloo host group for the counts when the round's is not gloo). Collective: every
        rank, in the same order as its other groups. With ``group`` a part of the world (the ranks of one FSDP shard
        index, one per machine), each rank's part differs: every rank makes every part's group (torch's rule for
        ``new_group``) and keeps its own."""
        timeout = self.timeout
        try:
            options = lambda: round_group_options(backend, timeout)  # noqa: E731  # one object per group
            self.group = self._new_group(lambda ranks: dist.new_group(ranks, timeout=timeout, pg_options=options()))
        except (RuntimeError, dist.DistError) as e:
            if backend != "gloo":
                raise
            raise RuntimeError(gloo_failure(e)) from e
        self.backend = dist.get_backend(self.group)
        self.weight_group: dist.ProcessGroup | None = None
        # With FSDP inside machines (this group one part of the world), a world-wide gloo group for the round's two
        # world-wide sums: the weight (each rank's gradient is its machine's average, so a round divides by the
        # world's weight over the parts: every part the same divisor) and the gradient's norm (all_reduce_norms)
        if self._parts is not None:
            self.weight_group = dist.new_group(None, timeout=timeout, backend="gloo")
        # The counts of a round go first, on the host (a gloo group; the round's own group on gloo): once they are
        # in, every rank has launched the round, so its device collectives never wait on a peer that has not.
        self.host_group = self.group
        if self.backend != "gloo":
            try:
                self.host_group = self._new_group(lambda ranks: dist.new_group(ranks, timeout=timeout, backend="gloo"))
            except (RuntimeError, dist.DistError) as e:
                raise RuntimeError(gloo_failure(e)) from e
        atexit.register(self._destroy_at_exit)
        self.destroyed = False

    @property
    def part(self) -> tuple[int, int] | None:
        """(which, how many) of the world's parts this rank's group is, when the ranks' groups differ (HSDP: the FSDP
        shard index, of the machine's ranks); None when every rank shares one group."""
        if self._parts is None:
            return None
        return next(i for i, p in enumerate(self._parts) if self._global_rank in p), len(self._parts)

    def _new_group(self, make: Callable[[list[int] | None], dist.ProcessGroup]) -> dist.ProcessGroup:
        """``make(ranks)`` for this communicator's ranks (None: the world), or, when ranks differ between ranks (each
        has its own part of the world), for every part in the order of its lowest rank; this rank's part."""
        if self._parts is None:
            return make(self._ranks)
        mine: dist.ProcessGroup | None = None
        for part in self._parts:
            group = make(part)
            mine = group if self._global_rank in part else mine
        assert mine is not None  # (partition_of checked that every rank is in a part)
        return mine

    def destroy(self) -> None:
        """Release the groups (NCCL communicators, gloo sockets): an engine that is closed holds none, so retries
        and repeated trainers do not pile them up. ``reopen`` makes new ones."""
        if self.destroyed:
            return
        atexit.unregister(self._destroy_at_exit)
        self._destroy_at_exit()
        self.destroyed = True

    def reopen(self) -> None:
        """New groups after ``destroy`` (collective, like the constructor)."""
        if self.destroyed:
            self._make_groups(self.backend)
            self._reopened()

    def _reopened(self) -> None:
        """What the users of the groups make again on new ones (``Communicator``: int8's groups, the warm-up)."""

    def _make_node_groups(self) -> None:
        """int8's node and rail groups where the ranks are several machines of several ranks each (``nodes.py``)."""
        if self.world_size == 1 or self.two_level is not None or self._parts is not None:
            return  # (a part of the world, one rank per machine: the flat all-to-all)
        if self.ranks_per_node is None and not launcher_layout_agreed(self.rank, self.host_group):
            return
        nodes, per_node = machines(self.world_size, self.ranks_per_node)
        if nodes == 1 or per_node == 1:
            return
        ranks = self._ranks if self._ranks is not None else list(range(dist.get_world_size()))
        options = lambda: round_group_options(self.backend, self.timeout)  # one object per group
        self.two_level = node_groups(ranks, self.rank, nodes, per_node, self.timeout, options)

    def _destroy_at_exit(self) -> None:
        """Tear the round's group down while Python still runs: a gloo group left to C++ static destruction at
        exit can abort the process ("terminate called without an active exception") while a peer still works.
        Not while a round runs (a process failing with its round stuck on a peer): destroying a group under a
        collective in flight can hang or crash; the process exits with the group as it is."""
        if self.in_round:
            return
        try:
            if self.two_level is not None:
                self.two_level.destroy()
                self.two_level = None
            destroy_groups(self.host_group, self.weight_group, self.group)
        except Exception:  # noqa: BLE001 - best effort at interpreter exit
            pass
