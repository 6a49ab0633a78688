"""The gradient hook's Triton kernels (``kernels.py`` chooses them, and imports this module only then): fp32 sums
+= a narrow gradient, and a narrow gradient widened over the sums, ``BLOCK`` elements per program.

A bf16 gradient comes in as its bits (an int16 view) and is widened by a 16-bit shift: exact by construction,
subnormals included (Triton's interpreter, converting through numpy, would flush them); an fp16 one by conversion
(exact in hardware and in numpy). The add is one IEEE fp32 add per element, as torch's."""

import triton
import triton.language as tl


@triton.jit
def _widened(grad_ptr, offsets, mask, BF16_BITS: tl.constexpr):  # noqa: ANN001, ANN202, N803
    if BF16_BITS:  # (a compile-time branch: one of the two is compiled, and one return follows)
        bits = tl.load(grad_ptr + offsets, mask=mask).to(tl.uint16, bitcast=True).to(tl.uint32) << 16
        wide = bits.to(tl.float32, bitcast=True)
    else:
        wide = tl.load(grad_ptr + offsets, mask=mask).to(tl.float32)
    return wide


# A whole block is loaded and stored without a mask: Triton vectorises it (16-byte accesses) where the pointers are
# 16-byte aligned, whatever n is; only the last, partial block is masked.


@triton.jit
def add(acc_ptr, grad_ptr, n, BLOCK: tl.constexpr, BF16_BITS: tl.constexpr):  # noqa: ANN001, ANN201, N803
    start = tl.program_id(0) * BLOCK
    offsets = start + tl.arange(0, BLOCK)
    if start + BLOCK <= n:
        tl.store(acc_ptr + offsets, tl.load(acc_ptr + offsets) + _widened(grad_ptr, offsets, None, BF16_BITS))
    else:
        mask = offsets < n
        acc = tl.load(acc_ptr + offsets, mask=mask)
        tl.store(acc_ptr + offsets, acc + _widened(grad_ptr, offsets, mask, BF16_BITS), mask=mask)


@triton.jit
def copy(acc_ptr, grad_ptr, n, BLOCK: tl.constexpr, BF16_BITS: tl.constexpr):  # noqa: ANN001, ANN201, N803
    start = tl.program_id(0) * BLOCK
    offsets = start + tl.arange(0, BLOCK)
    if start + BLOCK <= n:
        tl.store(acc_ptr + offsets, _widened(grad_ptr, offsets, None, BF16_BITS))
    else:
        mask = offsets < n
        tl.store(acc_ptr + offsets, _widened(grad_ptr, offsets, mask, BF16_BITS), mask=mask)
