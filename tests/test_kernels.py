"""The gradient hook's kernels (hf_acco/engine/kernels.py): torch's ops by default; with HF_ACCO_ACCUMULATE=triton,
Triton kernels that must give the same fp32 sums bit for bit. On CPU, Triton's interpreter (TRITON_INTERPRET=1) runs
the kernels' code on CPU tensors, and Triton's compiler shows their PTX for a GPU (the GPU tier runs them compiled:
tests/test_gpu.py)."""

from __future__ import annotations

import importlib.util
import inspect

import pytest
import torch

from hf_acco import ACCOOptimizer
from hf_acco.engine import kernels
from hf_acco.tools.multiprocess import run_ranks

from .helpers import clones

needs_triton = pytest.mark.skipif(
    importlib.util.find_spec("triton") is None, reason="Triton is not installed (pip install triton)"
)


def test_by_default_the_hook_runs_torchs_own_ops(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(kernels.ENV, raising=False)
    assert kernels.writers(torch.device("cpu")) == (torch.Tensor.add_, torch.Tensor.copy_)
    monkeypatch.setenv(kernels.ENV, " Torch ")
    assert kernels.writers(torch.device("cpu")) == (torch.Tensor.add_, torch.Tensor.copy_)


def test_a_wrong_choice_is_refused_when_the_optimizer_is_built(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(kernels.ENV, "cuda")
    with pytest.raises(RuntimeError, match="ValueError: HF_ACCO_ACCUMULATE='cuda': use torch or triton"):
        run_ranks(_build, world_size=1)  # (the rank's error, re-raised here)


def test_triton_without_a_cuda_device_says_what_to_do(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(kernels.ENV, "triton")
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    with pytest.raises(RuntimeError, match="on a CUDA device; this engine's device is cpu. Unset HF_ACCO_ACCUMULATE"):
        kernels.writers(torch.device("cpu"))


def _build(rank: int, world_size: int) -> None:
    ACCOOptimizer(torch.nn.Linear(4, 4).parameters(), lr=1e-3).close()


def test_what_the_kernels_take() -> None:
    n = kernels.MIN_NUMEL
    acc, grad = torch.zeros(n), torch.zeros(n, dtype=torch.bfloat16)
    assert kernels.fits(acc, grad) and kernels.fits(acc, grad.half())
    assert not kernels.fits(acc, grad.float())  # same dtypes: torch's add is vectorised already
    assert not kernels.fits(acc.bfloat16(), grad)  # bf16 sums (grad_dtype="bf16")
    assert not kernels.fits(acc[: n - 1], grad[: n - 1])  # too small to be worth a launch
    assert not kernels.fits(acc, torch.zeros(2 * n, dtype=torch.bfloat16)[::2])  # not contiguous
    assert not kernels.fits(acc, grad[:-1].contiguous())


@needs_triton
@pytest.mark.parametrize("arch", [80, 90])
def test_the_kernels_compile_for_a_gpu_vectorised_and_without_flushing_subnormals(
    monkeypatch: pytest.MonkeyPatch, tmp_path, arch: int
) -> None:
    """Compiled for an A100 / H100 (no GPU needed: Triton's compiler and ptxas), as a launch with 16-byte aligned
    pointers and an odd n compiles them: whole blocks load and store in 16-byte vectors; the add is PTX's IEEE
    ``add.rn.f32``, nothing flushes subnormals (``.ftz``); fp16 is widened by ``cvt.f32.f16``, bf16 by a shift."""
    triton = pytest.importorskip("triton")
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    if "constexprs" not in inspect.signature(ASTSource).parameters:  # (Triton's compiler API, not the kernels')
        pytest.skip(f"Triton {triton.__version__}: its ASTSource takes no constexprs= (3.5-3.9's do)")
    from hf_acco.engine import triton_kernels

    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path))
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    if type(triton_kernels.add).__name__ == "InterpretedFunction":
        triton_kernels = importlib.reload(triton_kernels)
    aligned = [["tt.divisibility", 16]]
    signature = {"acc_ptr": "*fp32", "n": "i32", "BLOCK": "constexpr", "BF16_BITS": "constexpr"}
    options, target = {"enable_fp_fusion": False}, GPUTarget("cuda", arch, 32)
    for name in ("add", "copy"):
        for bf16, grad in ((True, "*i16"), (False, "*fp16")):
            constexprs = {"BLOCK": kernels.BLOCK, "BF16_BITS": bf16}
            source = ASTSource(getattr(triton_kernels, name), {**signature, "grad_ptr": grad},
                               attrs={(0,): aligned, (1,): aligned}, constexprs=constexprs)  # fmt: skip
            ptx = triton.compile(source, target=target, options=options).asm["ptx"]
            assert "ld.global.v4" in ptx and "st.global.v4" in ptx, (name, bf16)
            assert ".ftz" not in ptx, (name, bf16)
            assert (name == "add") == ("add.rn.f32" in ptx), (name, bf16)
            assert ("cvt.f32.f16" in ptx) == (not bf16), (name, bf16)


def _values(n: int, dtype: torch.dtype, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """fp32 sums and a gradient of ``dtype`` with the edge cases in them: infinities, NaN, signed zeros, fp32 and
    narrow subnormals, sums that overflow, cancellations."""
    g = torch.Generator().manual_seed(seed)
    acc = torch.randn(n, generator=g) * 10.0 ** torch.randint(-40, 38, (n,), generator=g).float()
    grad = (torch.randn(n, generator=g) * 10.0 ** torch.randint(-8, 4, (n,), generator=g).float()).to(dtype)
    specials = torch.tensor([float("inf"), float("-inf"), float("nan"), 0.0, -0.0, 1e-40, -1e-45, 3.4e38, -3.4e38])
    acc[: len(specials)] = specials
    grad[: len(specials)] = specials.flip(0).to(dtype)
    grad[20:30] = torch.finfo(dtype).smallest_normal / 4  # narrow subnormals
    grad[30:40] = (-acc[30:40]).to(dtype)  # cancellations
    grad[40:50] = torch.finfo(dtype).max  # with acc's 3.4e38: bf16's max overflows the sum to inf (fp16's does not)
    acc[40:50] = 3.4e38
    return acc, grad


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Bit for bit, NaN wherever the other is NaN (a NaN's payload is not an IEEE result)."""
    nan = a.isnan()
    return torch.equal(nan, b.isnan()) and torch.equal(a[~nan].view(torch.int32), b[~nan].view(torch.int32))


def _offset(t: torch.Tensor, by: int) -> torch.Tensor:
    """``t``'s values at ``by`` elements into a larger tensor (a view with a storage offset, as a parameter's in the
    flat buffer; by 1: not 16-byte aligned)."""
    out = torch.empty(t.numel() + by, dtype=t.dtype, device=t.device)[by:]
    out.copy_(t)
    return out


def checked_writes(add, copy, device: str, sizes: tuple[int, ...]) -> dict:  # noqa: ANN001
    """Each of the hook's writes (``add``, ``copy``) against torch's op, bit for bit: bf16 and fp16 gradients of
    each size, at aligned and offset places; an fp32 gradient (torch's op)."""
    out = {}
    for dtype in (torch.bfloat16, torch.float16):
        for n, by in ((n, by) for n in sizes for by in (0, 1)):
            acc, grad = (_offset(t.to(device), by) for t in _values(n, dtype, seed=n))
            mine, theirs = _offset(acc, by), acc.clone()
            add(mine, grad)
            theirs.add_(grad)
            out[f"add {dtype} {n} at {by}"] = _same(mine, theirs)
            copy(mine, grad)
            out[f"copy {dtype} {n} at {by}"] = _same(mine, grad.float())
            wide = torch.randn(n, dtype=torch.float32, device=device)  # what goes to torch's op
            mine, theirs = acc.clone(), acc.clone()
            add(mine, wide)
            theirs.add_(wide)
            out[f"fp32 {dtype} {n} at {by}"] = _same(mine, theirs)
    return out


def _interpreted_kernels(rank: int, world_size: int) -> dict:
    kernels.MIN_NUMEL = 1 << 16  # (the interpreter is slow: smaller tensors than a GPU's)
    add, copy = kernels.writers(torch.device("cpu"))
    return checked_writes(add, copy, "cpu", (1 << 16, (1 << 16) + 3 * kernels.BLOCK + 5))  # a partial last block


@needs_triton
def test_the_triton_kernels_give_torchs_sums_bit_for_bit(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(kernels.ENV, "triton")
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    (result,) = run_ranks(_interpreted_kernels, world_size=1)
    assert result and all(result.values()), result


def record_launches() -> list[bool]:
    """From now on in this process, each call of the hook's Triton writers appends whether it launched the kernel
    (True) or went to torch's op (False)."""
    launched: list[bool] = []
    fits = kernels.fits

    def recorded(view: torch.Tensor, grad: torch.Tensor) -> bool:
        launched.append(fits(view, grad))
        return launched[-1]

    kernels.fits = recorded  # type: ignore[assignment]
    return launched


SIDE = 256  # 65536-element weights through the kernels (MIN_NUMEL made that); the biases go to torch


def _train(rank: int, world_size: int, schedule: str) -> dict:
    kernels.MIN_NUMEL = SIDE * SIDE
    launched = record_launches()
    model = _untrained()
    opt = ACCOOptimizer(model.parameters(), lr=1e-2, micro_batches=4, schedule=schedule, max_grad_norm=1.0)
    g = torch.Generator().manual_seed(rank)
    for _ in range(4 * 4):
        model(torch.randn(8, SIDE, generator=g).bfloat16()).float().square().mean().backward()
        opt.after_backward()
        if opt.ready_to_step():
            opt.step()
    with opt.committed_parameters():
        final = clones(model)
    opt.close()
    return {"final": final, "kernel_calls": sum(launched), "torch_calls": len(launched) - sum(launched)}


@needs_triton
@pytest.mark.parametrize("schedule", ["acco", "sync"])
def test_training_with_the_triton_kernels_gives_the_same_parameters(
    monkeypatch: pytest.MonkeyPatch, schedule: str
) -> None:
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    monkeypatch.setenv(kernels.ENV, "torch")
    reference = run_ranks(_train, schedule=schedule)
    monkeypatch.setenv(kernels.ENV, "triton")
    triton = run_ranks(_train, schedule=schedule)
    for r, t in zip(reference, triton):
        assert r["kernel_calls"] == 0 and t["kernel_calls"] == 2 * 16  # two weights, 16 micro-batches
        assert t["torch_calls"] == 2 * 16  # the biases
        assert all(torch.equal(a, b) for a, b in zip(r["final"], t["final"]))
    assert not all(torch.equal(a, b) for a, b in zip(triton[0]["final"], clones(_untrained())))


def _untrained() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(SIDE, SIDE), torch.nn.Tanh(), torch.nn.Linear(SIDE, SIDE)).bfloat16()
