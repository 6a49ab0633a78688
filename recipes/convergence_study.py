"""Convergence study: the same pre-training run with each method and seed, side by side (resumable).

    python recipes/convergence_study.py                                   # ddp, acco, dpu, sync, dpu+warm-up; 3 seeds
    python recipes/convergence_study.py --methods ddp acco --seeds 0 --max_steps 150 --output_dir outputs/study

Each run is `accelerate launch --config_file accelerate_configs/cpu_2proc.yaml recipes/pretrain_clm.py` with the
same data, data order and initialisation for a given seed; a finished run (its metrics.json) is not run again.
Writes convergence.json (a list `runs`), table.md (final validation loss and perplexity per method: mean and
spread over seeds, gap to DDP, the largest gap at any evaluation after the first 10 % of training, LAMBADA)
and loss_curves.png: training and validation loss per step and per token (mean and range over seeds).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DEFAULT_ALPACA_LR = 1e-3
INT8 = ["--method", "acco", "--acco_comm_dtype", "int8", "--acco_gather_dtype", "int8"]  # gradients and parameters
METHODS = {  # name -> pretrain_clm.py arguments
    "ddp": ["--method", "ddp"],
    "acco": ["--method", "acco"],
    "dpu": ["--method", "dpu"],
    "sync": ["--method", "sync"],
    "dpu+warmup": ["--method", "dpu", "--acco_warmup_steps", "30"],
    "acco-int8": INT8,
    "acco-int8+ef": [*INT8, "--acco_error_feedback", "true"],
    "acco-int8-int4": [*INT8[:-1], "int4"],  # int8 gradients, int4 parameter changes
    "acco-int8-int4+ef": [*INT8[:-1], "int4", "--acco_error_feedback", "true"],
}
DEFAULT_METHODS = ["ddp", "acco", "dpu", "sync", "dpu+warmup"]  # the quantised wires: --methods acco acco-int8 ...


def run(method: str, seed: int, args: argparse.Namespace) -> dict:
    out = Path(args.output_dir) / "runs" / f"{method.replace('+', '_')}_seed{seed}"
    if not (out / "metrics.json").is_file():
        launch("pretrain_clm.py", args, *METHODS[method], "--seed", str(seed), "--max_steps", str(args.max_steps),
               "--eval_steps", str(args.eval_steps), "--output_dir", str(out), *args.extra)  # fmt: skip
    metrics = json.loads((out / "metrics.json").read_text())
    return {**metrics, "method": method}


def launch(recipe: str, args: argparse.Namespace, *recipe_args: str) -> None:
    cmd = [sys.executable, "-m", "accelerate.commands.launch", "--config_file", args.accelerate_config,
           str(ROOT / "recipes" / recipe), *recipe_args]  # fmt: skip
    print(f"[study] {recipe} {' '.join(recipe_args)}", flush=True)
    subprocess.run(cmd, check=True, env={**os.environ, "OMP_NUM_THREADS": "1"})


def chain(args: argparse.Namespace) -> list[dict]:
    """Pre-trained (seed 0, --chain_from) -> Alpaca fine-tune, full and LoRA, acco and ddp -> LAMBADA before/after."""
    out, entries = Path(args.output_dir), []
    for pretrained_with in args.chain_from:
        base = out / "runs" / f"{pretrained_with}_seed0"
        runs = [(False, lr) for lr in args.alpaca_lrs] + [(True, args.alpaca_lora_lr)]
        for lora, lr in runs:
            for method in args.alpaca_methods:
                suffix = "" if lr == DEFAULT_ALPACA_LR else f"_lr{lr:g}"
                name = f"alpaca_{method}{'_lora' if lora else ''}_from_{pretrained_with}{suffix}"
                ft = out / "runs" / name
                if not (ft / "metrics.json").is_file():
                    extra = ["--use_lora", "--lora_target_modules", "query_key_value"] if lora else []
                    launch("alpaca_finetune.py", args, "--model_name_or_path", str(base),
                           "--dataset_path", args.alpaca_path, "--method", method, "--max_length", "128",
                           "--heldout", "100", "--max_steps", str(args.alpaca_steps), "--learning_rate", str(lr),
                           "--warmup_steps", "10", "--per_device_train_batch_size", "4", "--output_dir", str(ft),
                           *extra)  # fmt: skip
                metrics = json.loads((ft / "metrics.json").read_text())
                entry = {"task": "alpaca", "method": method, "lora": lora, "learning_rate": lr,
                         "pretrained_with": pretrained_with,
                         "seed": 0, "steps": metrics["steps"], "heldout_loss": metrics["heldout_loss"],
                         "heldout_loss_before": metrics["heldout_loss_before"]}  # fmt: skip
                for when, model in (("before", base), ("after", ft)):
                    lam = out / "runs" / f"{name}_lambada_{when}"
                    if not (lam / "metrics.json").is_file():
                        model_args = (
                            ["--model_name_or_path", str(base), "--adapter_path", str(ft)]
                            if lora and when == "after"
                            else ["--model_name_or_path", str(model)]
                        )  # noqa: E501
                        launch("lambada_eval.py", args, *model_args, "--dataset_path", args.lambada_path,
                               "--limit", str(args.lambada_docs), "--output_dir", str(lam))  # fmt: skip
                    scores = json.loads((lam / "metrics.json").read_text())
                    entry[f"lambada_acc_{when}"], entry[f"lambada_ppl_{when}"] = (
                        scores["lambada_acc"],
                        scores["lambada_ppl"],
                    )
                entries.append(entry)
    return entries


def summarise(runs: list[dict]) -> tuple[str, dict]:
    by_method: dict[str, list[dict]] = {}
    for r in runs:
        by_method.setdefault(r["method"], []).append(r)
    ddp = {r["seed"]: r for r in by_method.get("ddp", [])}
    rows, summary = [], {}
    for method, rs in by_method.items():
        finals = [r["final_val_loss"] for r in rs]
        gaps, curve_gaps = [], []
        for r in rs:
            ref = ddp.get(r["seed"])
            if ref is None:
                continue
            gaps.append((r["final_val_loss"] - ref["final_val_loss"]) / ref["final_val_loss"])
            cut = 0.1 * r["steps"]
            curve_gaps += [
                abs(a - b) / b for s, a, b in zip(r["eval_steps"], r["val_losses"], ref["val_losses"]) if s > cut
            ]
        entry = {
            "seeds": len(rs),
            "final_val_loss_mean": statistics.mean(finals),
            "final_val_loss_spread": max(finals) - min(finals),
            "final_gap_to_ddp_mean": statistics.mean(gaps) if gaps else None,
            "final_gap_to_ddp_per_seed": gaps,
            "max_curve_gap_to_ddp": max(curve_gaps) if curve_gaps else None,
            "max_mean_curve_gap_to_ddp": _mean_curve_gap(rs, ddp),
            "lambada_acc_mean": statistics.mean(r.get("lambada_acc", float("nan")) for r in rs),
            "lambada_ppl_mean": statistics.mean(r.get("lambada_ppl", float("nan")) for r in rs),
        }
        summary[method] = entry
        pct = lambda x: "-" if x is None else f"{100 * x:+.2f} %"  # noqa: E731
        loss, half_range = entry["final_val_loss_mean"], entry["final_val_loss_spread"] / 2
        per_seed = ", ".join(f"{100 * g:+.2f}" for g in gaps) if len(gaps) > 1 else ""
        cells = [method, str(entry["seeds"]), f"{loss:.4f} ± {half_range:.4f}", f"{math.exp(loss):.1f}",
                 pct(entry["final_gap_to_ddp_mean"]) + (f" ({per_seed})" if per_seed else ""),
                 pct(entry["max_mean_curve_gap_to_ddp"]).lstrip("+"), pct(entry["max_curve_gap_to_ddp"]).lstrip("+"),
                 f"{entry['lambada_acc_mean']:.4f}", f"{entry['lambada_ppl_mean']:.3g}"]  # fmt: skip
        rows.append("| " + " | ".join(cells) + " |")
    header = ("| method | seeds | final val loss (mean ± half-range) | val ppl | gap to DDP: mean (per seed) | "
              "max gap after 10 %: seed means | max gap after 10 %: any one seed | LAMBADA acc | LAMBADA ppl |\n"
              "|---|---|---|---|---|---|---|---|---|")  # fmt: skip
    return header + "\n" + "\n".join(rows) + "\n", summary


def _mean_curve_gap(rs: list[dict], ddp: dict[int, dict]) -> float | None:
    """Largest |gap| after the first 10 % of training between the method's validation curve averaged over its
    seeds and DDP's averaged over the same seeds."""
    seeds = [r for r in rs if r["seed"] in ddp]
    if not seeds:
        return None
    gaps = []
    for i, step in enumerate(seeds[0]["eval_steps"]):
        if step > 0.1 * seeds[0]["steps"]:
            ours = statistics.mean(r["val_losses"][i] for r in seeds)
            ref = statistics.mean(ddp[r["seed"]]["val_losses"][i] for r in seeds)
            gaps.append(abs(ours - ref) / ref)
    return max(gaps) if gaps else None


def plot(runs: list[dict], path: Path) -> None:
    """Train (top) and validation (bottom) loss per step (left) and per token (right): each method's mean over
    its seeds, with the seeds' range shaded."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(2, 2, figsize=(12, 8))
    by_method: dict[str, list[dict]] = {}
    for r in runs:
        by_method.setdefault(r["method"], []).append(r)
    for method, rs in by_method.items():
        tokens_per_step = rs[0]["tokens"] / max(rs[0]["steps"], 1)
        for row, (xs_of, ys_of) in enumerate(
            (
                (lambda r: [s for s, _ in r["train_losses"]], lambda r: [v for _, v in r["train_losses"]]),
                (lambda r: r["eval_steps"], lambda r: r["val_losses"]),
            )
        ):
            n = min(len(xs_of(r)) for r in rs)
            steps = xs_of(rs[0])[:n]
            ys = [ys_of(r)[:n] for r in rs]
            mean = [statistics.mean(v) for v in zip(*ys)]
            lo, hi = [min(v) for v in zip(*ys)], [max(v) for v in zip(*ys)]
            label = f"{method} ({len(rs)} seed{'s' if len(rs) > 1 else ''})"
            for col, xs in enumerate((steps, [s * tokens_per_step for s in steps])):
                (line,) = axes[row][col].plot(xs, mean, label=label)
                axes[row][col].fill_between(xs, lo, hi, color=line.get_color(), alpha=0.2)
    for row, what in enumerate(("training loss", "validation loss")):
        for col, xlabel in enumerate(("optimizer step", "tokens")):
            ax = axes[row][col]
            ax.set_xlabel(xlabel)
            ax.set_ylabel(what)
            ax.set_yscale("log")
    axes[0][0].legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--methods", nargs="+", default=DEFAULT_METHODS, choices=list(METHODS))
    parser.add_argument("--seeds", nargs="+", type=int, default=[0, 1, 2])
    parser.add_argument(
        "--first_seed_only",
        nargs="*",
        default=[],
        choices=list(METHODS),
        help="methods to run on the first seed only (to save time)",
    )
    parser.add_argument("--max_steps", type=int, default=300)
    parser.add_argument("--eval_steps", type=int, default=20)
    parser.add_argument("--accelerate_config", default=str(ROOT / "accelerate_configs" / "cpu_2proc.yaml"))
    parser.add_argument("--output_dir", default=str(ROOT / "recipes" / "results" / "convergence"))
    parser.add_argument("--chain", action="store_true", help="then fine-tune on Alpaca and evaluate LAMBADA")
    parser.add_argument("--alpaca_path", default=str(ROOT.parent / "shared/data/alpaca/alpaca_data_random5000.json"))
    parser.add_argument("--alpaca_steps", type=int, default=200)
    parser.add_argument("--alpaca_lrs", type=float, nargs="+", default=[DEFAULT_ALPACA_LR],
                        help="learning rates of the full fine-tunes")  # fmt: skip
    parser.add_argument("--alpaca_lora_lr", type=float, default=DEFAULT_ALPACA_LR)
    parser.add_argument("--alpaca_methods", nargs="+", default=["ddp", "acco"], choices=["ddp", "acco", "sync", "dpu"],
                        help="fine-tune with each (ddp is the baseline; sync, our ZeRO-1, must equal it)")  # fmt: skip
    parser.add_argument("--chain_from", nargs="+", default=["acco"], help="pre-trained models to fine-tune (methods)")
    parser.add_argument("--lambada_path", default=str(ROOT.parent / "shared/data/lambada/lambada_openai_test.jsonl"))
    parser.add_argument("--lambada_docs", type=int, default=500)
    parser.add_argument("extra", nargs="*", help="more pretrain_clm.py arguments (after --)")
    args = parser.parse_args(argv)
    if args.chain and "ddp" not in args.alpaca_methods:
        parser.error("--alpaca_methods needs ddp: every fine-tune is compared with it")
    plan = [(m, s) for m in args.methods for s in args.seeds if m not in args.first_seed_only or s == args.seeds[0]]
    runs = [run(m, s, args) for m, s in plan]
    out = Path(args.output_dir)
    out.mkdir(parents=True, exist_ok=True)
    table, summary = summarise(runs)
    keep = ("method", "seed", "steps", "tokens", "final_val_loss", "final_val_ppl", "val_losses", "eval_steps",
            "train_losses",
            "warmup_steps", "lambada_acc", "lambada_ppl", "lambada_docs")  # fmt: skip
    payload = {"command": " ".join(["python", "recipes/convergence_study.py", *sys.argv[1:]]),
               "runs": [{k: r[k] for k in keep if k in r} for r in runs], "summary": summary}  # fmt: skip
    if args.chain:
        alpaca = chain(args)
        payload["runs"] += alpaca
        table += "\n| Alpaca fine-tune | pre-trained with | learning rate | held-out loss | gap to DDP | "
        table += "LAMBADA acc before -> after |\n|---|---|---|---|---|---|\n"
        key = lambda e: (e["lora"], e["pretrained_with"], e["learning_rate"])  # noqa: E731
        ddp_loss = {key(e): e["heldout_loss"] for e in alpaca if e["method"] == "ddp"}
        for e in alpaca:
            e["heldout_gap_to_ddp"] = e["heldout_loss"] / ddp_loss[key(e)] - 1
            cells = [e["method"] + (" LoRA" if e["lora"] else ""), e["pretrained_with"], f"{e['learning_rate']:g}",
                     f"{e['heldout_loss_before']:.4f} -> {e['heldout_loss']:.4f}",
                     f"{100 * e['heldout_gap_to_ddp']:+.2f} %",
                     f"{e['lambada_acc_before']:.4f} -> {e['lambada_acc_after']:.4f}"]  # fmt: skip
            table += "| " + " | ".join(cells) + " |\n"
    (out / "convergence.json").write_text(json.dumps(payload, indent=2))
    (out / "table.md").write_text(table)
    plot(runs, out / "loss_curves.png")
    print(table)


if __name__ == "__main__":
    main()
