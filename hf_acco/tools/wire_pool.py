"""The round pool's buffers of the collectives themselves and the int8 error feedback's residual, for the memory
report (``hf_acco.tools.memory``): what quant.py, nodes.py and deltas.py allocate, counted from the flat layout."""

from __future__ import annotations

import torch

from hf_acco.comm import quant
from hf_acco.comm.nodes import machines
from hf_acco.comm.sharding import FlatLayout


def residual_bytes(layout: FlatLayout, ranks_per_node: int) -> int:
    """quant.ErrorFeedback's residual: one fp32 row per row this rank quantises (a flat all-to-all: one per rank;
    two levels, nodes.py: one per machine), every bucket."""
    nodes, per_node = machines(layout.world_size, ranks_per_node)
    rows = nodes if nodes > 1 and per_node > 1 else layout.world_size
    return layout.num_buckets * rows * layout.chunk * torch.float32.itemsize


def wire_pool(
    layout: FlatLayout,
    comm_dtype: torch.dtype,
    quantized: bool,
    change_bits: int,
    backend: str,
    max_inflight: int,
    per_node: int = 1,
    packed: bool = False,
) -> dict[str, int]:
    """The round pool's buffers of the collectives themselves (the largest counts: they run one after the other);
    ``per_node``: ranks per machine (int8 gradients go in two levels on several machines of several ranks);
    ``change_bits``: the parameters' changes in the all-gather (8 or 4; 0: the parameters themselves); ``packed``:
    the round's buffer holds the packed rows (``deltas.PackedRound``): what is sent is not allocated again, what
    is received of the changes lands in it."""
    fp32, pool = torch.float32.itemsize, {}
    inflight = min(max_inflight, layout.num_buckets)
    row = quant.packed_numel(layout.chunk)  # one chunk's int8 values and their scales
    # one chunk's fp32 temporaries at once: quantising (the scaled product, an fp32 or padded copy of the input)
    # or dequantising (one row)
    temporaries = 2 * quant.num_blocks(layout.chunk) * quant.BLOCK * fp32
    nodes, per_node = machines(layout.world_size, per_node)
    if quantized and nodes > 1 and per_node > 1:  # nodes.py: a machine's reduce-scatter, then int8 between machines
        regrouped = (layout.bucket_size + nodes * layout.chunk) * comm_dtype.itemsize  # the bucket, its node sum
        pool["round: int8 reduce-scatter in two levels (a bucket regrouped, packed rows in flight)"] = (
            regrouped + 2 * inflight * row * nodes + temporaries
        )
    elif quantized:  # every backend: the all-to-all of packed chunks (comm.py, quant.py)
        pool["round: int8 reduce-scatter (packed buckets in flight, fp32 temporaries)"] = (
            1 if packed else 2
        ) * inflight * row * layout.world_size + temporaries
    elif backend == "gloo":
        pool["round: all-to-all receive buffers"] = inflight * layout.bucket_size * comm_dtype.itemsize
    if change_bits:  # deltas.py: this rank's packed change and every rank's, per bucket in flight; the change
        changes = quant.packed_numel(layout.chunk, change_bits)
        pool[f"round: int{change_bits} all-gather (packed changes in flight, fp32 temporaries)"] = (
            inflight * (1 + (0 if packed else layout.world_size)) * changes + temporaries + layout.chunk * fp32
        )
    return pool
