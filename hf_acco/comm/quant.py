"""Blockwise int8 and int4 for the wire (pure torch): a float32 scale per block of ``BLOCK`` elements, as ZeRO++'s
quantised gradients (qgZ) and weights (qwZ) and bitsandbytes' blockwise quantisation do.

Each block is scaled by its largest magnitude (absmax / qmax, qmax 127 for 8 bits, 7 for 4) and rounded to the
nearest integer in [-qmax, qmax]: an element comes back within half a step of its block,
``|x - dequantize(quantize(x))| <= absmax / (2 qmax)`` (plus float32's rounding of the scale; a block whose absmax
is below ``TINY`` takes ``TINY`` as its absmax, so that qmax / absmax stays finite). A block with an inf
or NaN comes back with no finite element (its scale is not finite), so a non-finite gradient stays non-finite
after the wire and the round's non-finite policy still sees it.

A packed row is the row's values, padded to whole blocks, followed by its blocks' scales as bytes: one int8
tensor per destination, so one collective moves values and scales together. 8 bits: a value a byte, 1 + 4 /
``BLOCK`` bytes an element (about a quarter of float32's 4); 4 bits: two values a byte (element 2i in the low
nibble, 2i + 1 in the high one, each as q + 8), 0.5 + 4 / ``BLOCK`` bytes an element. Each row is padded with
zeros to a multiple of ``ROW_ALIGN`` bytes, so that every row of a (rows, bytes) tensor starts 16-byte aligned, as
NCCL's and the device's vectorised copies want it (unpadded, a row of ``nb`` blocks is ``nb`` x 260 bytes in int8
and ``nb`` x 132 in int4: 16-byte aligned only when ``nb`` is a multiple of 4).
"""

from __future__ import annotations

import torch

BLOCK = 256  # elements per scale: 1.6 % of the int8 bytes go to scales (3 % of int4's)
BITS = (8, 4)  # the widths a value can travel in
QMAX = 127  # 8 bits, symmetric: -127..127 (-128 unused, so that q and -q are both representable)
QMAX4 = 7  # 4 bits: -7..7, sent as q + 8 (1..15) in a nibble
ROW_ALIGN = 16  # bytes: every packed row's length is a multiple of it
TINY = 2.0**-120  # the smallest absmax a block is scaled by (127 / TINY is below float32's largest, 3.4e38)


def num_blocks(numel: int) -> int:
    return -(-numel // BLOCK)


def _qmax(bits: int) -> int:
    if bits not in BITS:
        raise ValueError(f"values travel in {' or '.join(map(str, BITS))} bits, got {bits}")
    return QMAX if bits == 8 else QMAX4


def packed_numel(numel: int, bits: int = 8) -> int:
    """Bytes of one packed row of ``numel`` elements: values padded to whole blocks, then a float32 scale each, then
    zeros to a multiple of ``ROW_ALIGN``."""
    _qmax(bits)
    used = num_blocks(numel) * (BLOCK * bits // 8 + 4)
    return -(-used // ROW_ALIGN) * ROW_ALIGN


def _absmax(blocks: torch.Tensor) -> torch.Tensor:
    """Each block's largest magnitude, max(amax, -amin): the values of ``abs().amax()`` (NaN and inf propagate)
    without a temporary of the blocks' size."""
    return torch.maximum(blocks.amax(dim=-1), blocks.amin(dim=-1).neg_())


def pack(rows: torch.Tensor, out: torch.Tensor | None = None, bits: int = 8) -> torch.Tensor:
    """Quantise each row of ``rows`` ((R, n), any float dtype) into ``out`` ((R, packed_numel(n, bits)) int8),
    blockwise. One row at a time: the float32 temporary is a row's, not the whole tensor's (a bucket can be 1 GiB)."""
    r, n = rows.shape
    nb, qmax = num_blocks(n), _qmax(bits)
    values = nb * BLOCK * bits // 8  # bytes of a row's values
    if out is None:
        out = torch.empty(r, packed_numel(n, bits), dtype=torch.int8, device=rows.device)
    x = torch.empty(nb * BLOCK, dtype=torch.float32, device=rows.device)  # a row, its last block padded
    blocks = x.view(nb, BLOCK)
    for i in range(r):
        x[:n].copy_(rows[i])
        x[n:].zero_()  # the last block's missing elements are zeros: they change no block's absmax
        span = _absmax(blocks).clamp_(min=TINY)  # (an all-zero block stays zeros; NaN and inf stay as they are)
        inverse = torch.where(torch.isfinite(span), qmax / span, span)  # not finite: so is every value
        q = blocks.mul_(inverse.unsqueeze(-1)).round_().clamp_(-qmax, qmax)
        if bits == 4:  # (lo + 8) + 16 (hi + 8) in 17..255, made in the high element's place (no temporary)
            pairs = q.view(nb, BLOCK // 2, 2)
            q = pairs[..., 1].mul_(16).add_(pairs[..., 0]).add_(136)
            out[i, :values].view(torch.uint8).view(nb, BLOCK // 2).copy_(q)
        else:
            out[i, :values].view(nb, BLOCK).copy_(q)
        out[i, values : values + 4 * nb].view(torch.float32).copy_(span / qmax)
        out[i, values + 4 * nb :].zero_()  # the row's alignment padding: the same bytes on every rank, every time
    return out


def _parts(packed: torch.Tensor, n: int, bits: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(values (R, nb, BLOCK * bits / 8) int8, scales (R, nb) float32) of packed rows."""
    nb, expected = num_blocks(n), packed_numel(n, bits)
    if packed.shape[-1] != expected:
        raise ValueError(f"a packed row of {n} elements in {bits} bits has {expected} bytes, got {packed.shape[-1]}")
    r, values = packed.shape[0], nb * BLOCK * bits // 8
    return packed[:, :values].view(r, nb, -1), packed[:, values : values + 4 * nb].view(torch.float32)


def _dequantize(values: torch.Tensor, scales: torch.Tensor, out: torch.Tensor, bits: int) -> torch.Tensor:
    """``out`` ((..., nb, BLOCK) float32) <- ``values`` (..., nb, BLOCK * bits / 8) x their blocks' ``scales``."""
    if bits == 4:
        nibbles, pairs = values.view(torch.uint8), out.view(*out.shape[:-1], BLOCK // 2, 2)
        pairs[..., 0].copy_(nibbles & 15)
        pairs[..., 1].copy_(nibbles >> 4)
        out.sub_(8)
    else:
        out.copy_(values)
    return out.mul_(scales.unsqueeze(-1))


def unpack(packed: torch.Tensor, n: int, bits: int = 8) -> torch.Tensor:
    """The float32 rows ((R, n)) that ``pack`` quantised into ``packed``."""
    out = torch.empty(packed.shape[0], num_blocks(n) * BLOCK, dtype=torch.float32, device=packed.device)
    return unpack_into(packed, n, out, bits)


def unpack_into(packed: torch.Tensor, n: int, out: torch.Tensor, bits: int = 8) -> torch.Tensor:
    """``unpack`` written into ``out`` ((R, num_blocks(n) * BLOCK) float32, reused by a caller that unpacks row after
    row); returns its (R, n) view."""
    values, scales = _parts(packed, n, bits)
    _dequantize(values, scales, out.view(*scales.shape, BLOCK), bits)
    return out[:, :n]


def unpack_sum(packed: torch.Tensor, n: int, out: torch.Tensor, bits: int = 8) -> torch.Tensor:
    """``out`` ((n,) float32, the shard gradient's row) <- the sum over the packed rows of their values, in row
    order (deterministic), one row at a time through one float32 temporary."""
    values, scales = _parts(packed, n, bits)
    row = torch.empty(scales.shape[1], BLOCK, dtype=torch.float32, device=packed.device)
    for i in range(packed.shape[0]):
        _dequantize(values[i], scales[i], row, bits)
        if i == 0:
            out.copy_(row.view(-1)[:n])
        else:
            out.add_(row.view(-1)[:n])
    return out


def error_bound(rows: torch.Tensor, bits: int = 8) -> torch.Tensor:
    """Per element of ``rows`` ((R, n)): the most ``unpack(pack(rows, bits=bits), bits=bits)`` may differ from
    it, half a step of its block (absmax / (2 qmax)) and float32's rounding of the scale and of the product."""
    r, n = rows.shape
    nb = num_blocks(n)
    x = torch.nn.functional.pad(rows.float(), (0, nb * BLOCK - n))
    absmax = x.view(r, nb, BLOCK).abs().amax(dim=-1)
    step = absmax.clamp(min=TINY) / _qmax(bits)
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
