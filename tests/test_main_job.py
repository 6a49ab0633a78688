"""`accelerate launch` with the CPU config really starts 2 gloo ranks: the hand-written-loop example and a Trainer
script that changes only its two class names. (The README's main job itself: tests/test_recipes.py.)"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_main_job_launches_two_ranks_and_learns(tmp_path: Path) -> None:
    cmd = [
        sys.executable, "-m", "accelerate.commands.launch",
        "--config_file", str(ROOT / "accelerate_configs/cpu_2proc.yaml"),
        str(ROOT / "recipes/train_tiny.py"), "--steps", "30", "--output_dir", str(tmp_path),
    ]  # fmt: skip
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    done = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=240)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    metrics = json.loads((tmp_path / "metrics.json").read_text())
    assert metrics["world_size"] == 2
    assert metrics["held_out_loss_after"] < metrics["held_out_loss_before"] - 1.0


def test_trainer_script_runs_unchanged_but_for_the_class_names(tmp_path: Path) -> None:
    """tests/scripts/trainer_script.py is a Trainer script; `--acco` swaps Trainer/TrainingArguments only."""
    cmd = [
        sys.executable, "-m", "accelerate.commands.launch",
        "--config_file", str(ROOT / "accelerate_configs/cpu_2proc.yaml"),
        str(ROOT / "tests/scripts/trainer_script.py"), "--acco", "--output_dir", str(tmp_path), "--max_steps", "6",
    ]  # fmt: skip
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    done = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=240)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    history = json.loads((tmp_path / "log_history.json").read_text())
    steps = [h for h in history if "loss" in h]
    assert len(steps) == 6 and steps[-1]["loss"] < steps[0]["loss"]
    assert steps[-1]["acco_global_micro_batches"] == 2 * 4  # 2 ranks x gradient_accumulation_steps
    assert (tmp_path / "final" / "model.safetensors").is_file()
