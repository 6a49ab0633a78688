"""`make gpu-check`'s plumbing on a CPU: the methods train the same tiny model in their own processes, and the
results file holds every figure the GPU run fills in (the GPU-only ones empty here)."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

from .helpers import load_script

ROOT = Path(__file__).resolve().parents[1]


def test_the_gpu_check_runs_every_method_and_writes_its_results_file(tmp_path: Path) -> None:
    cmd = [sys.executable, "benchmarks/gpu_check.py", "--device", "cpu", "--tiny", "--skip_tests", "--steps", "3",
           "--warmup", "1", "--batch", "2", "--micro_batches", "2", "--out", str(tmp_path)]  # fmt: skip
    done = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    (path,) = tmp_path.glob("gpu_check_*.json")
    result = json.loads(path.read_text())
    methods = {"trainer_bf16", "trainer_fp32_autocast", "acco_sync", "acco_acco"}
    if importlib.util.find_spec("triton") is not None:  # the engine's Triton kernels (its interpreter, here)
        methods |= {"acco_sync_triton", "acco_acco_triton"}
    assert set(result["runs"]) == methods
    losses = {m: r["final_loss"] for m, r in result["runs"].items()}
    assert abs(losses["acco_sync"] - losses["trainer_bf16"]) < 0.05 * losses["trainer_bf16"], losses
    assert all(r["steps_timed"] == 2 and r["step_s"] > 0 for r in result["runs"].values())
    assert result["runs"]["acco_acco"]["report_persistent_bytes"] > 0
    assert set(result["verdicts"]) >= {f"{m}_vs_trainer_bf16" for m in methods if m.startswith("acco_")}
    assert result["command"].startswith("python benchmarks/gpu_check.py --device cpu")
    assert "| acco_acco |" in done.stdout
    kernels = result["accumulation_kernels"]["variants"]  # the hook's kernel and its alternatives, timed
    assert {"add_", "add_float", "copy_", "bf16_add_"} <= set(kernels) and kernels["add_float"]["equals_add_"]
    assert all(v["ms"] > 0 for v in kernels.values()) and "Accumulating one micro-batch" in done.stdout
    packed = result["packed_round"]["passes"]  # the packed round's boundary passes beside the exact path's
    assert set(packed) == {"pack_sums", "cast_copy", "apply", "load"} and all(v["ms"] > 0 for v in packed.values())


def test_without_a_gpu_the_default_says_what_to_run_instead(tmp_path: Path) -> None:
    done = subprocess.run([sys.executable, "benchmarks/gpu_check.py", "--out", str(tmp_path)], cwd=ROOT,
                          capture_output=True, text=True, timeout=120)  # fmt: skip
    assert done.returncode == 2 and "--device cpu --tiny" in done.stderr


def _gpu_check():  # noqa: ANN202
    return load_script(ROOT / "benchmarks" / "gpu_check.py")


def test_device_to_host_copies_are_told_apart_by_the_thread_that_asked() -> None:
    """A profile's device-to-host copies, read from its chrome trace: the main thread's (Trainer's loop: a read there
    makes the host wait for the compute) apart from the round's, and copies of data apart from scalar reads."""
    gpu_check = _gpu_check()

    def copy(correlation: int, nbytes: int) -> dict:
        return {"cat": "gpu_memcpy", "name": "Memcpy DtoH (Device -> Pinned)", "dur": 2.0,
                "args": {"correlation": correlation, "bytes": nbytes}}  # fmt: skip

    def call(correlation: int, tid: int) -> dict:
        return {"cat": "cuda_runtime", "name": "cudaMemcpyAsync", "tid": tid, "args": {"correlation": correlation}}

    events = [copy(1, 4), call(1, 100), copy(2, 8), call(2, 200), copy(3, 4096), call(3, 100),
              {"cat": "gpu_memcpy", "name": "Memcpy HtoD (Pinned -> Device)", "args": {"correlation": 4, "bytes": 8}},
              {"cat": "kernel", "name": "ampere_gemm", "dur": 3000.0}]  # fmt: skip
    got = gpu_check.device_to_host(events, main_thread=100)
    assert (got["count"], got["count_main_thread"], got["count_over_64_bytes"]) == (3, 2, 1)
    assert got["bytes"] == 4108 and got["kernel_ms_per_step"] == 3.0 / gpu_check.PROFILED


def test_the_reads_verdict_holds_the_main_thread_to_trainers_and_each_round_to_two() -> None:
    gpu_check = _gpu_check()
    steps = gpu_check.PROFILED

    def run(count: int, main: int, data: int = 0) -> dict:
        copies = {"steps": steps, "count": count, "count_main_thread": main, "count_over_64_bytes": data}
        return {"step_s": 1.0, "device_to_host": copies}

    def ok(**runs: dict) -> dict:
        verdicts = gpu_check.verdicts({"trainer_bf16": run(14 * steps, 14 * steps), **runs})
        return {k.removesuffix("_device_to_host"): v["ok"] for k, v in verdicts.items() if "device_to_host" in k}

    trainers = 14 * steps
    assert ok(acco_acco=run(trainers + 4 * steps, trainers), acco_sync=run(trainers + 2 * steps, trainers)) == {
        "acco_acco": True,  # two rounds a step, each reading its weight and its norm on its own thread
        "acco_sync": True,
    }
    assert ok(acco_sync=run(trainers + 3 * steps, trainers)) == {"acco_sync": False}  # a third read a round
    assert ok(acco_acco=run(trainers + 1, trainers + 1)) == {"acco_acco": False}  # one more on the main thread
    assert ok(acco_acco_triton=run(trainers, trainers, data=1)) == {"acco_acco_triton": False}  # a copy of data
