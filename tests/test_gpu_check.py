"""`make gpu-check`'s plumbing on a CPU: the four methods train the same tiny model in their own processes, and the
results file holds every figure the GPU run fills in (the GPU-only ones empty here)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_the_gpu_check_runs_every_method_and_writes_its_results_file(tmp_path: Path) -> None:
    cmd = [sys.executable, "benchmarks/gpu_check.py", "--device", "cpu", "--tiny", "--skip_tests", "--steps", "3",
           "--warmup", "1", "--batch", "2", "--micro_batches", "2", "--out", str(tmp_path)]  # fmt: skip
    done = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    (path,) = tmp_path.glob("gpu_check_*.json")
    result = json.loads(path.read_text())
    assert set(result["runs"]) == {"trainer_bf16", "trainer_fp32_autocast", "acco_sync", "acco_acco"}
    losses = {m: r["final_loss"] for m, r in result["runs"].items()}
    assert abs(losses["acco_sync"] - losses["trainer_bf16"]) < 0.05 * losses["trainer_bf16"], losses
    assert all(r["steps_timed"] == 2 and r["step_s"] > 0 for r in result["runs"].values())
    assert result["runs"]["acco_acco"]["report_persistent_bytes"] > 0
    assert set(result["verdicts"]) >= {"acco_acco_vs_trainer_bf16", "acco_sync_vs_trainer_bf16"}
    assert result["command"].startswith("python benchmarks/gpu_check.py --device cpu")
    assert "| acco_acco |" in done.stdout
    kernels = result["accumulation_kernels"]["variants"]  # the hook's kernel and its alternatives, timed
    assert {"add_", "add_float", "copy_", "bf16_add_"} <= set(kernels) and kernels["add_float"]["equals_add_"]
    assert all(v["ms"] > 0 for v in kernels.values()) and "Accumulating one micro-batch" in done.stdout


def test_without_a_gpu_the_default_says_what_to_run_instead(tmp_path: Path) -> None:
    done = subprocess.run([sys.executable, "benchmarks/gpu_check.py", "--out", str(tmp_path)], cwd=ROOT,
                          capture_output=True, text=True, timeout=120)  # fmt: skip
    assert done.returncode == 2 and "--device cpu --tiny" in done.stderr
