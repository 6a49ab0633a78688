"""What the engine's gradient hook costs per micro-batch on this device, and what the alternatives would: each
parameter's bf16 gradient added into its fp32 view of the accumulation buffer, one call per parameter, for every
parameter of gpu_check's ~0.95B Llama (its shapes, from a model on the meta device).

    python benchmarks/accumulate_kernels.py                      # on a GPU; gpu_check.py runs it as one of its parts
    python benchmarks/accumulate_kernels.py --device cpu --tiny  # the plumbing

Variants, each over every parameter (the hook's pattern: one kernel per parameter as autograd finishes it):

* ``add_``: ``view.add_(grad)``, what the hook runs for a micro-batch's 2nd and later gradients (fp32 += bf16: a
  mixed-dtype TensorIterator kernel);
* ``add_float``: ``view.add_(grad.float())``: a cast kernel, then an fp32 += fp32 one;
* ``triton``: the engine's Triton kernel (``HF_ACCO_ACCUMULATE=triton``, ``hf_acco/engine/kernels.py``), which loads
  both, widens the gradient and adds (where Triton is installed, on CUDA);
* ``add_unaligned`` / ``triton_unaligned``: the same adds with each gradient 2 bytes into its allocation (not
  16-byte aligned, as FSDP2's views of its reduce-scatter output can be: Triton's loads are not vectorised there);
* ``copy_``: ``view.copy_(grad)``, the hook's first gradient of a step; ``triton_copy``: the engine's Triton one;
* ``bf16_add_``: ``bf16.add_(grad)``, what autograd does when Trainer accumulates bf16 gradients in ``p.grad``.

Per variant: milliseconds per pass over all parameters (the median of ``--passes``, between CUDA events), the bytes
per element the operation needs (read and written; ``add_float`` moves 18: its cast's output goes through memory)
and the bandwidth that makes, and whether its sums equal ``add_``'s bit for bit. A measurement of one
device's kernels, not a test: which way the hook should add is decided from it.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def shapes(tiny: bool) -> list[tuple[int, ...]]:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    spec = importlib.util.spec_from_file_location("gpu_check", ROOT / "benchmarks" / "gpu_check.py")
    assert spec is not None and spec.loader is not None
    gpu_check = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(gpu_check)
    with torch.device("meta"):
        model = LlamaForCausalLM(LlamaConfig(**gpu_check.model_config(tiny)))
    return [tuple(p.shape) for p in model.parameters()]


def triton_writers(device: str):  # noqa: ANN201
    """The hook's Triton (add, copy) as the engine runs them with ``HF_ACCO_ACCUMULATE=triton``
    (hf_acco/engine/kernels.py; small tensors go to torch's op there too), or None without Triton / off CUDA."""
    import os

    import torch

    from hf_acco.engine import kernels

    if device != "cuda" or importlib.util.find_spec("triton") is None:
        return None
    before = os.environ.get(kernels.ENV)
    os.environ[kernels.ENV] = "triton"
    try:
        return kernels.writers(torch.device(device))
    finally:
        if before is None:
            del os.environ[kernels.ENV]
        else:
            os.environ[kernels.ENV] = before


def median_seconds(run, passes: int, cuda: bool) -> float:  # noqa: ANN001 - a callable of no arguments
    """The median time of ``passes`` calls of ``run``: between CUDA events on a GPU, by the host's clock on a CPU."""
    import torch

    times = []
    for _ in range(passes):
        if cuda:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            run()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end) / 1e3)
        else:
            t0 = time.perf_counter()
            run()
            times.append(time.perf_counter() - t0)
    return statistics.median(times)


def measure(device: str, tiny: bool, passes: int) -> dict:
    import torch

    torch.manual_seed(0)
    dims = shapes(tiny)
    numel = sum(torch.Size(s).numel() for s in dims)
    accum = torch.zeros(numel, dtype=torch.float32, device=device)
    views = list(torch.split(accum, [torch.Size(s).numel() for s in dims]))
    grads = [torch.randn(torch.Size(s).numel(), device=device).to(torch.bfloat16) for s in dims]
    bf16 = [torch.zeros_like(g) for g in grads]
    # the same gradients 2 bytes into a larger allocation (not 16-byte aligned, as a view into a buffer can be:
    # FSDP2 hands the hook views of its reduce-scatter output): Triton's loads are not vectorised there
    shifted = []
    for g in grads:
        s = torch.empty(g.numel() + 1, dtype=g.dtype, device=device)[1:]
        shifted.append(s.copy_(g))
    variants = {
        "add_": (lambda: [v.add_(g) for v, g in zip(views, grads)], 10),
        "add_unaligned": (lambda: [v.add_(g) for v, g in zip(views, shifted)], 10),
        "add_float": (lambda: [v.add_(g.float()) for v, g in zip(views, grads)], 18),
        "copy_": (lambda: [v.copy_(g) for v, g in zip(views, grads)], 6),
        "bf16_add_": (lambda: [b.add_(g) for b, g in zip(bf16, grads)], 6),
    }
    writers = triton_writers(device)
    if writers is not None:
        add, copy = writers
        variants["triton"] = (lambda: [add(v, g) for v, g in zip(views, grads)], 10)
        variants["triton_unaligned"] = (lambda: [add(v, g) for v, g in zip(views, shifted)], 10)
        variants["triton_copy"] = (lambda: [copy(v, g) for v, g in zip(views, grads)], 6)
    cuda = device == "cuda"
    out: dict = {"params": len(dims), "numel": numel, "variants": {}}
    reference = copied = None
    for name, (run, nbytes) in variants.items():
        accum.fill_(0.5)
        run()  # warm-up (Triton compiles here)
        seconds = median_seconds(run, passes, cuda)
        figure = {"ms": seconds * 1e3, "bytes_per_element": nbytes, "GB_per_s": nbytes * numel / seconds / 1e9}
        # the same sums from the same start: 0.5 + (passes + 1) grads
        if name in ("add_", "add_unaligned", "add_float", "triton", "triton_unaligned"):
            accum_now = accum.clone()
            reference = accum_now if reference is None else reference
            figure["equals_add_"] = bool(torch.equal(accum_now, reference))
        if name in ("copy_", "triton_copy"):  # the gradients, widened
            copied = accum.clone() if copied is None else copied
            figure["equals_copy_"] = bool(torch.equal(accum, copied))
        out["variants"][name] = figure
    out["triton"] = writers is not None
    return out


def parser(script: str, doc: str | None) -> argparse.ArgumentParser:
    """The options this benchmark and ``packed_round.py`` share (``--device``, ``--tiny``, ``--passes``, ``--out``)."""
    p = argparse.ArgumentParser(prog=f"python benchmarks/{script}", description=doc,
                                formatter_class=argparse.RawDescriptionHelpFormatter)  # fmt: skip
    p.add_argument("--device", choices=["cuda", "cpu"], default="cuda")
    p.add_argument("--tiny", action="store_true", help="gpu_check's tiny model (the plumbing, on CPU)")
    p.add_argument("--passes", type=int, default=5, help="timed passes, after one warm-up")
    p.add_argument("--out", help="write the result here (JSON)")
    return p


def report(script: str, argv: list[str] | None, figures: dict, out: str | None) -> int:
    """The result (the command, then ``figures``) printed, and written to ``out`` as JSON."""
    command = f"python benchmarks/{script} " + " ".join(argv or sys.argv[1:])
    text = json.dumps({"command": command, **figures}, indent=1)
    if out:
        Path(out).write_text(text + "\n")
    print(text)
    return 0


def main(argv: list[str] | None = None) -> int:
    args = parser("accumulate_kernels.py", __doc__).parse_args(argv)
    return report("accumulate_kernels.py", argv, measure(args.device, args.tiny, args.passes), args.out)


if __name__ == "__main__":
    sys.exit(main())
