"""Whether a round's buffer is packed int8 rows (``deltas.PackedRound``: int8 gradients in, quantised changes out)
instead of a buffer in the wire's dtype: the rule the engine builds by and the memory report counts by. Torch only."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from hf_acco.comm import quant
from hf_acco.comm.deltas import PackedRound
from hf_acco.comm.sharding import FlatLayout
from hf_acco.engine.buffers import SHARD_GRAD_DTYPE, comm_allocation, model_dtype, shard_grad_room


def packed_round_saves(
    layout: FlatLayout, param_dtype: torch.dtype, comm_dtype: torch.dtype, grad_dtype: torch.dtype
) -> bool:
    """Whether a round buffer of packed int8 rows (``deltas.PackedRound``: int8 gradients and quantised changes),
    with the shard gradient beside it, takes fewer bytes than a buffer of the wire's dtype with the shard gradient
    where ``shard_grad_room`` puts it (not on 4 ranks with a 2-byte buffer, which holds it for free)."""
    wire = comm_allocation(param_dtype, comm_dtype, True, grad_dtype)
    assert wire is not None
    shard_grad = layout.shard_numel * SHARD_GRAD_DTYPE.itemsize
    plain = layout.padded_numel * wire.itemsize
    if shard_grad_room(wire, comm_dtype, layout.world_size, layout.chunk) is None:
        plain += shard_grad
    return packed_bytes(layout) + shard_grad < plain


def packed_bytes(layout: FlatLayout) -> int:
    """Bytes of a packed round buffer: every chunk's int8 row (values and scales), every bucket."""
    return layout.num_buckets * layout.world_size * quant.packed_numel(layout.chunk)


def packs_round(layout: FlatLayout, param_dtype: torch.dtype, wire: torch.dtype, sums: torch.dtype, *,
                int8_grads: bool, change_bits: int, error_feedback: bool, separate: bool, one_level: bool,
                wired: bool) -> bool:  # fmt: skip
    """Whether the round's buffer is packed int8 rows (``deltas.PackedRound``; the engine builds it, the memory report
    counts it): int8 gradients in one level (a flat all-to-all) with quantised changes, a round beside the
    micro-batches (not sync), no error feedback (it packs in the round), a wire (more than one rank), and fewer
    bytes than the buffer in the wire's dtype."""
    if not (int8_grads and change_bits and not error_feedback and separate and one_level and wired):
        return False
    return packed_round_saves(layout, param_dtype, wire, sums)


def packing(comm: Any, layout: FlatLayout, params: Sequence[torch.Tensor], wire: torch.dtype, sums: torch.dtype,
            **settings: Any) -> PackedRound | None:  # fmt: skip
    """The engine's packed round buffer (``packs_round``; ``settings``: its change_bits, error_feedback, separate),
    or None: the round's buffer in the wire's dtype."""
    dtype = model_dtype(params)
    wired, one_level = not comm.local_copies, comm.two_level is None
    if not packs_round(layout, dtype, wire, sums, int8_grads=comm.quantized_gradients, one_level=one_level,
                       wired=wired, **settings):  # fmt: skip
        return None
    return PackedRound(layout, comm, params, settings["change_bits"], dtype)
