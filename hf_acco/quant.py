"""Blockwise int8 for the wire (pure torch): a float32 scale per block of ``BLOCK`` elements, as ZeRO++'s
quantised gradients (qgZ) and bitsandbytes' blockwise quantisation do.

Each block is scaled by its largest magnitude (absmax / 127) and rounded to the nearest integer in [-127, 127]:
an element comes back within half a step of its block, ``|x - dequantize(quantize(x))| <= absmax / 254`` (plus
float32's rounding of the scale). A block with an inf or NaN comes back with no finite element (its scale is not
finite), so a non-finite gradient stays non-finite after the wire and the round's non-finite policy still sees it.

A packed row is the row's int8 values, padded to whole blocks, followed by its blocks' scales as bytes: one
tensor per destination, so one all-to-all moves values and scales together. 1 + 4 / ``BLOCK`` bytes per element
(about a quarter of float32's 4).
"""

from __future__ import annotations

import torch

BLOCK = 256  # elements per scale: 1.6 % of the bytes go to scales
QMAX = 127  # symmetric: -127..127 (-128 unused, so that q and -q are both representable)


def num_blocks(numel: int) -> int:
    return -(-numel // BLOCK)


def packed_numel(numel: int) -> int:
    """Bytes of one packed row of ``numel`` elements: values padded to whole blocks, then a float32 scale each."""
    return num_blocks(numel) * (BLOCK + 4)


def _absmax(blocks: torch.Tensor) -> torch.Tensor:
    """Each block's largest magnitude, max(amax, -amin): the values of ``abs().amax()`` (NaN and inf propagate)
    without a temporary of the blocks' size."""
    return torch.maximum(blocks.amax(dim=-1), blocks.amin(dim=-1).neg_())


def pack(rows: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """Quantise each row of ``rows`` ((R, n), any float dtype) into ``out`` ((R, packed_numel(n)) int8), blockwise.
    One row at a time: the float32 temporary is a row's, not the whole tensor's (a bucket can be 1 GiB)."""
    r, n = rows.shape
    nb = num_blocks(n)
    if out is None:
        out = torch.empty(r, nb * (BLOCK + 4), dtype=torch.int8, device=rows.device)
    x = torch.empty(nb * BLOCK, dtype=torch.float32, device=rows.device)  # a row, its last block padded
    blocks = x.view(nb, BLOCK)
    for i in range(r):
        x[:n].copy_(rows[i])
        x[n:].zero_()  # the last block's missing elements are zeros: they change no block's absmax
        absmax = _absmax(blocks)
        inverse = torch.where(absmax > 0, QMAX / absmax, torch.zeros_like(absmax))  # an all-zero block stays zeros
        inverse = torch.where(torch.isfinite(absmax), inverse, absmax)  # not finite: so is every value
        out[i, : nb * BLOCK].view(nb, BLOCK).copy_(blocks.mul_(inverse.unsqueeze(-1)).round_().clamp_(-QMAX, QMAX))
        out[i, nb * BLOCK :].view(torch.float32).copy_(absmax / QMAX)
    return out


def _parts(packed: torch.Tensor, n: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(values (R, nb, BLOCK) int8, scales (R, nb) float32) of packed rows."""
    nb = num_blocks(n)
    if packed.shape[-1] != nb * (BLOCK + 4):
        raise ValueError(f"a packed row of {n} elements has {nb * (BLOCK + 4)} bytes, got {packed.shape[-1]}")
    r = packed.shape[0]
    return packed[:, : nb * BLOCK].view(r, nb, BLOCK), packed[:, nb * BLOCK :].view(torch.float32)


def unpack(packed: torch.Tensor, n: int) -> torch.Tensor:
    """The float32 rows ((R, n)) that ``pack`` quantised into ``packed``."""
    values, scales = _parts(packed, n)
    return values.float().mul_(scales.unsqueeze(-1)).view(packed.shape[0], -1)[:, :n]


def unpack_sum(packed: torch.Tensor, n: int, out: torch.Tensor) -> torch.Tensor:
    """``out`` ((n,) float32, the shard gradient's row) <- the sum over the packed rows of their values, in row
    order (deterministic), one row at a time through one float32 temporary."""
    values, scales = _parts(packed, n)
    row = torch.empty(values.shape[1:], dtype=torch.float32, device=packed.device)
    for i in range(packed.shape[0]):
        row.copy_(values[i]).mul_(scales[i].unsqueeze(-1))
        if i == 0:
            out.copy_(row.view(-1)[:n])
        else:
            out.add_(row.view(-1)[:n])
    return out


def error_bound(rows: torch.Tensor) -> torch.Tensor:
    """Per element of ``rows`` ((R, n)): the most ``unpack(pack(rows))`` may differ from it, half a step of its
    block (absmax / 254) and float32's rounding of the scale and of the product."""
    r, n = rows.shape
    nb = num_blocks(n)
    x = torch.nn.functional.pad(rows.float(), (0, nb * BLOCK - n))
    absmax = x.view(r, nb, BLOCK).abs().amax(dim=-1)
    step = absmax / QMAX
    bound = step * 0.5 + absmax * 4 * torch.finfo(torch.float32).eps
    return bound.unsqueeze(-1).expand(r, nb, BLOCK).reshape(r, -1)[:, :n]


class ErrorFeedback:
    """Error feedback for int8 gradients: the rounding of each row this rank quantised, added to the same row of
    the next commit round before it is quantised again, so that what the owners receive adds up, round after
    round, to what was sent within one rounding (``sum of dequantised = sum of inputs - the last residual``)
    instead of one rounding a round.

    One float32 residual per row this rank quantises: (buckets, rows, chunk), the rows every rank's chunk of a
    bucket (a flat all-to-all) or its machine's sums (two levels, ``nodes.py``). Only commit rounds use it: an
    estimate round updates no state, so a checkpoint taken in the middle of a step holds the boundary's residual.
    """

    def __init__(self, num_buckets: int, rows: int, chunk: int, device: torch.device) -> None:
        self.residual = torch.zeros(num_buckets, rows, chunk, dtype=torch.float32, device=device)

    def pack(self, b: int, rows: torch.Tensor) -> torch.Tensor:
        """``pack(rows + residual[b])``; ``residual[b]`` <- what that rounding lost (zero where it is not finite:
        a step whose gradient is not finite is skipped, its rounding is not carried)."""
        x = rows.float() + self.residual[b]
        packed = pack(x)
        self.residual[b].copy_(x.sub_(unpack(packed, rows.shape[-1])).nan_to_num_(0.0, 0.0, 0.0))
        return packed
