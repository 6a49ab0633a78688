"""`accelerate launch` with the CPU config really starts 2 gloo ranks: the hand-written-loop example and a Trainer
script that changes only its two class names. (The README's main job itself: tests/test_recipes.py.)"""

from __future__ import annotations

import json
from pathlib import Path

from .helpers import accelerate_launch

ROOT = Path(__file__).resolve().parents[1]


def test_the_hand_written_loop_recipe_launches_two_ranks_and_learns(tmp_path: Path) -> None:
    accelerate_launch(ROOT / "recipes/train_tiny.py", "--steps", "30", "--output_dir", str(tmp_path))
    metrics = json.loads((tmp_path / "metrics.json").read_text())
    assert metrics["world_size"] == 2
    assert metrics["held_out_loss_after"] < metrics["held_out_loss_before"] - 1.0


def test_trainer_script_runs_unchanged_but_for_the_class_names(tmp_path: Path) -> None:
    """tests/scripts/trainer_script.py is a Trainer script; `--acco` swaps Trainer/TrainingArguments only."""
    script = ROOT / "tests/scripts/trainer_script.py"
    accelerate_launch(
        script, "--acco", "--output_dir", str(tmp_path), "--max_steps", "6", env={"PYTHONPATH": str(ROOT)}
    )
    history = json.loads((tmp_path / "log_history.json").read_text())
    steps = [h for h in history if "loss" in h]
    assert len(steps) == 6 and steps[-1]["loss"] < steps[0]["loss"]
    assert steps[-1]["acco_global_micro_batches"] == 2 * 4  # 2 ranks x gradient_accumulation_steps
    assert (tmp_path / "final" / "model.safetensors").is_file()
