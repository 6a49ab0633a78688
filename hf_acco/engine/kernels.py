"""How the gradient hook writes a narrow gradient into its fp32 sums: torch's kernels, or one Triton kernel each.

A bf16 (or fp16) gradient added into fp32 sums (``view.add_(grad)``), or copied over them at the first micro-batch
(``view.copy_(grad)``), is a mixed-dtype element-wise op: on CUDA torch runs it with its dynamic-casting kernel, one
element per load (on an H200, ``unrolled_elementwise_kernel<CUDAFunctor_add<float>>``: 15 ms of a 0.95B model's step
of four micro-batches, at about half the bandwidth of Trainer's same-dtype bf16 add). The Triton kernels here load
the gradient in wide vectors, widen it (every bf16 and fp16 value is an fp32 value: exact) and add in fp32 as torch
does, so the sums are the same bit for bit.

``HF_ACCO_ACCUMULATE`` chooses, read when an engine is built: ``torch`` (the default) or ``triton`` (a CUDA device
and Triton, which CUDA builds of torch install; Triton's interpreter, ``TRITON_INTERPRET=1``, runs the kernels on
CPU tensors, for tests). Where a call does not fit the kernels (an fp32 gradient, a non-contiguous one, fp32 sums
of fewer than ``MIN_NUMEL`` or more than 2**31 elements) it goes to torch's op.
"""

from __future__ import annotations

import os
from collections.abc import Callable

import torch

ENV = "HF_ACCO_ACCUMULATE"
CHOICES = ("torch", "triton")
BLOCK = 4096  # elements per Triton program
# Below it, torch's op: the GPU time the kernel saves (microseconds) is less than the host time a Triton launch costs
# over torch's (~10-20 us of Python), which shows wherever the backward is host-bound (many small tensors, LoRA)
MIN_NUMEL = 1 << 20
MAX_NUMEL = 2**31 - BLOCK  # the kernels' offsets are int32
NARROW = (torch.bfloat16, torch.float16)

Write = Callable[[torch.Tensor, torch.Tensor], object]  # (fp32 view of the sums, gradient)


torch_add: Write = torch.Tensor.add_  # the methods themselves: the default hook calls no Python function more
torch_copy: Write = torch.Tensor.copy_


def choice() -> str:
    value = os.environ.get(ENV, "").strip().lower() or "torch"
    if value not in CHOICES:
        raise ValueError(f"HF_ACCO_ACCUMULATE={value!r}: use torch or triton (or leave it unset: torch).")
    return value


def writers(device: torch.device) -> tuple[Write, Write]:
    """(add, copy) for the gradient hook of an engine on ``device``, as ``HF_ACCO_ACCUMULATE`` says."""
    if choice() == "torch":
        return torch_add, torch_copy
    interpreted = os.environ.get("TRITON_INTERPRET", "").strip().lower() in ("1", "true", "on", "yes")  # Triton's
    if device.type != "cuda" and not interpreted:
        raise RuntimeError(
            "HF_ACCO_ACCUMULATE=triton runs the gradient hook's kernels on a CUDA device; this engine's device is "
            f"{device}. Unset HF_ACCO_ACCUMULATE (or set it to torch) to train here."
        )
    try:
        add_kernel, copy_kernel = _kernels(interpreted)
    except ImportError as e:
        raise RuntimeError(
            f"HF_ACCO_ACCUMULATE=triton needs Triton ({e}); CUDA builds of torch install it: pip install triton, or "
            "unset HF_ACCO_ACCUMULATE."
        ) from e
    return _launcher(add_kernel, torch_add, interpreted), _launcher(copy_kernel, torch_copy, interpreted)


def fits(view: torch.Tensor, grad: torch.Tensor) -> bool:
    """Whether the Triton kernels take ``view`` (fp32 sums) and ``grad``: both contiguous, as large, on one device;
    the gradient bf16 or fp16; not too small to be worth a launch, nor too large for int32 offsets."""
    n = view.numel()
    return (
        view.dtype == torch.float32
        and grad.dtype in NARROW
        and MIN_NUMEL <= n <= MAX_NUMEL
        and grad.numel() == n
        and view.is_contiguous()
        and grad.is_contiguous()
        and view.device == grad.device
    )


def _launcher(kernel, fallback: Write, interpreted: bool) -> Write:  # noqa: ANN001
    import triton

    options = {} if interpreted else {"enable_fp_fusion": False}

    def write(view: torch.Tensor, grad: torch.Tensor) -> None:
        if not fits(view, grad):
            fallback(view, grad)
            return
        n, bf16 = view.numel(), grad.dtype == torch.bfloat16
        grad = grad.view(torch.int16) if bf16 else grad  # its bits, widened by the kernel
        # Triton launches on the current device's current stream: the hook runs on autograd's thread for the
        # gradient's device, with the gradient's stream current (as torch's op would use); the guard is for callers
        # whose current device is another one. (No multiply to fuse: fp fusion off says so, and spares Triton's
        # warning about its default.)
        if interpreted or grad.device.index == torch.cuda.current_device():
            kernel[(triton.cdiv(n, BLOCK),)](view, grad, n, BLOCK=BLOCK, BF16_BITS=bf16, **options)
        else:
            with torch.cuda.device(grad.device):
                kernel[(triton.cdiv(n, BLOCK),)](view, grad, n, BLOCK=BLOCK, BF16_BITS=bf16, **options)

    return write


def _kernels(interpreted: bool):  # noqa: ANN202
    """The two Triton kernels (``triton_kernels``, imported on first use). Triton decides at a kernel's definition
    whether its interpreter runs it: a module defined the other way (a process forked after a compiled use) is
    defined again."""
    import importlib

    from hf_acco.engine import triton_kernels

    if (type(triton_kernels.add).__name__ == "InterpretedFunction") != interpreted:
        importlib.reload(triton_kernels)
    return triton_kernels.add, triton_kernels.copy
