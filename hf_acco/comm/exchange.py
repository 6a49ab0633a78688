"""The rounds' all-gathers, spelled per backend and payload (``comm.py`` calls them, one bucket at a time).

* The exact all-gather of a round's output: ``all_gather_into_tensor`` on every backend. On gloo it was sent point
  to point for a while (below): a round then took less CPU, but longer beside the compute on the benchmark's shaped
  link, and the compute beside it was no faster (``benchmarks/beside.py``: ``docs/benchmarks.md``).
* The packed int8 / int4 parameter changes of ``deltas.py`` on gloo: point to point. Each rank sends its row straight
  to every other rank with the process group's own ``send`` / ``recv`` (what ``dist.isend`` / ``dist.irecv`` call):
  the same bytes as gloo's all-gather, which hands every call to its worker threads and took about 2.5x the CPU for
  them (``benchmarks/round_cpu.py``, ``recipes/results/engine/round_cpu/``). (The reduce-scatter's all-to-all spelled
  the same way, its receives posted a few buckets at a time, took more CPU than gloo's own ``all_to_all_single``:
  ``comm.py`` keeps that.) On every other backend (NCCL), and for device tensors on gloo: ``all_gather_into_tensor``.

It returns a handle whose ``wait()`` blocks until this rank's rows have arrived and its own has left.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

_all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


class Exchange:
    """The sends and receives of one point-to-point exchange, waited for together (as one ``Work``)."""

    def __init__(self, works: list[dist.Work]) -> None:
        self.works = works

    def wait(self) -> bool:
        # the last posted first. Each blocking wait wakes this thread when the tcp loop completes it, and a wakeup
        # costs the compute on the same cores tens of microseconds (benchmarks/wakeups.py). One pair's messages arrive
        # in the order they were posted, so once the last one is in the earlier ones mostly are and return at once.
        for work in reversed(self.works):
            work.wait()
        return True


def all_gather_into(
    output: torch.Tensor,
    input: torch.Tensor,  # noqa: A002
    group: dist.ProcessGroup,
    tag: int = 0,
    point_to_point: bool = True,
) -> Any:
    """``output`` (``world_size * n`` elements) <- every rank's ``input`` (``n``), in rank order, asynchronously:
    ``all_gather_into_tensor``'s contract (a ``Work``, or on gloo an ``Exchange``). ``input`` may be this rank's own
    row of ``output``. ``point_to_point=False``: the collective on every backend.

    On gloo, peers in ring order: every rank sends to rank + k while it receives from rank - k, so no pair waits on
    a third. Sends and receives of one pair and tag are matched in the order they were posted; every rank posts in
    the same order (the same buckets of the same rounds, on the round's own group)."""
    # (gloo's send and recv take host tensors only)
    if not point_to_point or dist.get_backend(group) != "gloo" or output.device.type != "cpu":
        return _all_gather(output, input, group=group, async_op=True)
    rank, size = group.rank(), group.size()
    if input.dtype != output.dtype or input.numel() * size != output.numel():  # as the collective would refuse
        raise ValueError(
            f"all_gather_into: {size} x {input.numel()} {input.dtype} into {output.numel()} {output.dtype}"
        )
    rows = output.view(size, -1)
    if rows[rank].data_ptr() != input.data_ptr():
        rows[rank].copy_(input.view(-1))
    works = []
    for k in range(1, size):
        dst, src = (rank + k) % size, (rank - k) % size
        works.append(group.send([rows[rank]], dst, tag))
        works.append(group.recv([rows[src]], src, tag))
    return Exchange(works)
