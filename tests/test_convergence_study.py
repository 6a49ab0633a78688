"""The convergence study's summary arithmetic (fast), and a short acco-vs-DDP comparison (slow)."""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "recipes"))

import convergence_study  # noqa: E402


def _run(method: str, seed: int, losses: list[float]) -> dict:
    return {"method": method, "seed": seed, "steps": 100, "tokens": 100 * 64, "eval_steps": [10, 50, 100],
            "val_losses": losses, "final_val_loss": losses[-1], "lambada_acc": 0.0, "lambada_ppl": 1e6}  # fmt: skip


def test_summary_numbers_on_synthetic_runs() -> None:
    runs = [
        _run("ddp", 0, [5.0, 4.0, 3.0]),
        _run("ddp", 1, [5.0, 4.0, 3.2]),
        _run("acco", 0, [5.5, 4.04, 3.03]),  # the step-10 eval (first 10 %) is ignored in the curve gap
        _run("acco", 1, [5.0, 4.0, 3.2]),
    ]
    table, summary = convergence_study.summarise(runs)
    acco = summary["acco"]
    assert acco["seeds"] == 2
    assert acco["final_val_loss_mean"] == pytest.approx((3.03 + 3.2) / 2)
    assert acco["final_val_loss_spread"] == pytest.approx(0.17)
    assert acco["final_gap_to_ddp_mean"] == pytest.approx((0.01 + 0.0) / 2)
    assert acco["max_curve_gap_to_ddp"] == pytest.approx(0.01)
    # the seed means: acco (4.04 + 4.0) / 2 against ddp 4.0 at step 50; (3.03 + 3.2) / 2 against 3.1 at step 100
    assert acco["max_mean_curve_gap_to_ddp"] == pytest.approx(max(0.02 / 4.0, 0.015 / 3.1))
    assert acco["final_gap_to_ddp_per_seed"] == pytest.approx([0.01, 0.0])
    assert summary["ddp"]["final_gap_to_ddp_mean"] == 0.0
    assert f"{math.exp((3.03 + 3.2) / 2):.1f}" in table and "+0.50 %" in table


def test_chain_orchestration(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The chain's runs and their order, with a stand-in launcher that writes what each recipe would."""
    calls = []

    def fake_launch(recipe: str, args, *recipe_args: str) -> None:
        calls.append((recipe, recipe_args))
        out = Path(recipe_args[recipe_args.index("--output_dir") + 1])
        out.mkdir(parents=True)
        if recipe == "alpaca_finetune.py":
            metrics = {"steps": 5, "heldout_loss": 2.0, "heldout_loss_before": 3.0}
        else:
            metrics = {"lambada_acc": 0.1 if "--adapter_path" in recipe_args else 0.0, "lambada_ppl": 50.0}
        (out / "metrics.json").write_text(json.dumps(metrics))

    monkeypatch.setattr(convergence_study, "launch", fake_launch)
    args = convergence_study.argparse.Namespace(
        output_dir=str(tmp_path),
        chain_from=["acco"],
        alpaca_path="a.json",
        alpaca_steps=5,
        alpaca_lrs=[1e-3],
        alpaca_lora_lr=1e-3,
        alpaca_methods=["ddp", "acco"],
        lambada_path="l.jsonl",
        lambada_docs=10,
        accelerate_config="c.yaml",
    )
    entries = convergence_study.chain(args)
    assert [(e["method"], e["lora"]) for e in entries] == [
        ("ddp", False),
        ("acco", False),
        ("ddp", True),
        ("acco", True),
    ]
    assert all(e["task"] == "alpaca" and e["heldout_loss"] == 2.0 for e in entries)
    assert [c[0] for c in calls].count("alpaca_finetune.py") == 4 and len(calls) == 12
    lora_after = [c for c in calls if c[0] == "lambada_eval.py" and "--adapter_path" in c[1]]
    assert len(lora_after) == 2 and entries[3]["lambada_acc_after"] == 0.1
    assert convergence_study.chain(args) == entries and len(calls) == 12  # finished runs are not run again


@pytest.mark.slow
def test_short_comparison_acco_tracks_ddp(tmp_path: Path) -> None:
    """A short version of the study (1 seed, 90 steps): acco within 2 % of DDP at the end and along the way.

    (The full study's bounds are 1 % at the end of several hundred steps; in 150-step runs acco was 0.7-1.1 %
    *below* DDP along the curve, so a short run is held to the curve bound.)
    """
    convergence_study.main(["--methods", "ddp", "acco", "--seeds", "0", "--max_steps", "90", "--eval_steps", "15",
                            "--output_dir", str(tmp_path), "--", "--lambada_docs", "50"])  # fmt: skip
    summary = json.loads((tmp_path / "convergence.json").read_text())["summary"]
    assert abs(summary["acco"]["final_gap_to_ddp_mean"]) < 0.02
    assert summary["acco"]["max_curve_gap_to_ddp"] < 0.02
