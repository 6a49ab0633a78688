"""Convergence with a slower rank: Trainer+DDP, ACCOTrainer fixed and ACCOTrainer paced on the pre-training
recipe, against tokens and against seconds of training (resumable).

    python recipes/heterogeneous_study.py       # rank 1 sleeps 0.6 s per micro-batch (its compute: about 0.6 s)
    python recipes/heterogeneous_study.py --slow_rank_delay 0.3 --max_steps 50 --output_dir outputs/hetero
    python recipes/heterogeneous_study.py --from_json recipes/results/heterogeneous/heterogeneous.json  # re-render

Each run is `accelerate launch --config_file accelerate_configs/cpu_2proc.yaml recipes/pretrain_clm.py` with the
same model, initialisation and settings, rank 1 made slower by a sleep before each training micro-batch
(``--slow_rank_delay``: choose it near one micro-batch's compute time for a rank half as fast). Every method trains
the same global batch per step (2 ranks x gradient_accumulation_steps micro-batches): DDP and fixed mode split it
evenly, paced accumulation by speed. A finished run (its metrics.json) is not run again. Writes heterogeneous.json,
table.md (final validation loss, training seconds, time to the validation loss every method reached) and
loss_curves.png (validation loss per token and per second of training).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from convergence_study import launch  # this folder's: the same `accelerate launch` of a recipe

ROOT = Path(__file__).resolve().parents[1]
METHODS = {  # name -> pretrain_clm.py arguments
    "ddp": ["--method", "ddp"],
    "acco fixed": ["--method", "acco"],
    "acco paced": ["--method", "acco", "--acco_accumulation", "paced"],
}
OLD_NAMES = {"acco dynamic": "acco paced"}  # in result files written before paced had its one name


def run(method: str, args: argparse.Namespace) -> dict:
    out = Path(args.output_dir) / "runs" / method.replace(" ", "_")
    if not (out / "metrics.json").is_file():
        launch("pretrain_clm.py", args, *METHODS[method], "--seed", str(args.seed), "--max_steps", str(args.max_steps),
               "--eval_steps", str(args.eval_steps), "--lambada_path", "", "--slow_rank_delay",
               str(args.slow_rank_delay), "--gradient_accumulation_steps", str(args.gradient_accumulation_steps),
               "--output_dir", str(out), *args.extra)  # fmt: skip
    return {**json.loads((out / "metrics.json").read_text()), "method": method}


def time_to(loss: float, seconds: list[float], losses: list[float]) -> float | None:
    """Training seconds at which the validation loss first reaches ``loss`` (linear between evaluations)."""
    for i, (t, v) in enumerate(zip(seconds, losses)):
        if v <= loss:
            if i == 0:
                return t
            t0, v0 = seconds[i - 1], losses[i - 1]
            return t0 + (t - t0) * (v0 - loss) / (v0 - v)
    return None


def summarise(runs: list[dict]) -> tuple[str, list[dict]]:
    """Final validation loss, training time, and the time each method took to reach the loss every one of them
    reached (the highest final validation loss), against DDP's."""
    target = max(r["val_losses"][-1] for r in runs)
    reach = {r["method"]: time_to(target, r["train_seconds"], r["val_losses"]) for r in runs}
    ddp = next(r for r in runs if r["method"] == "ddp")
    rows, out = [], []
    for r in runs:
        final = r["val_losses"][-1]
        entry = {"method": r["method"], "final_val_loss": final, "train_seconds": r["train_seconds"][-1],
                 "target_val_loss": target, "time_to_target_s": reach[r["method"]], "tokens": r["tokens"]}  # fmt: skip
        out.append(entry)
        rows.append(f"| {r['method']} | {final:.4f} | {100 * (final / ddp['val_losses'][-1] - 1):+.2f} % | "
                    f"{entry['train_seconds']:.0f} s | {reach[r['method']]:.0f} s | "
                    f"{reach[r['method']] / reach['ddp']:.2f}x |")  # fmt: skip
    head = (f"| method | final val loss | vs DDP | training time | time to val loss {target:.4f} | / DDP |\n"
            "|---|---|---|---|---|---|\n")  # fmt: skip
    return head + "\n".join(rows) + "\n", out


def plot(runs: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(12, 4.5))
    for r in runs:
        tokens_per_step = r["tokens"] / max(r["steps"], 1)
        n = len(r["val_losses"])
        axes[0].plot(
            [s * tokens_per_step for s in r["eval_steps"][:n]], r["val_losses"], marker=".", label=r["method"]
        )
        axes[1].plot(r["train_seconds"][:n], r["val_losses"], marker=".", label=r["method"])
    for ax, xlabel in zip(axes, ("tokens", "seconds of training (evaluations left out)")):
        ax.set_xlabel(xlabel)
        ax.set_ylabel("validation loss")
        ax.set_yscale("log")
        ax.legend()
    fig.suptitle(f"pre-training recipe, 2 CPU ranks, rank 1 slower ({runs[0].get('slow_rank_delay', 0)} s per "
                 "micro-batch)")  # fmt: skip
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--methods", nargs="+", default=list(METHODS), choices=list(METHODS))
    parser.add_argument("--slow_rank_delay", type=float, default=0.6, help="seconds rank 1 sleeps per micro-batch")
    parser.add_argument("--gradient_accumulation_steps", type=int, default=4, help="a global batch of 8")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--max_steps", type=int, default=100)
    parser.add_argument("--eval_steps", type=int, default=10)
    parser.add_argument("--accelerate_config", default=str(ROOT / "accelerate_configs" / "cpu_2proc.yaml"))
    parser.add_argument("--output_dir", default=str(ROOT / "recipes" / "results" / "heterogeneous"))
    parser.add_argument(
        "--from_json",
        default=None,
        help="summarise and plot the runs of this heterogeneous.json again (into --output_dir) instead of running",
    )
    parser.add_argument("extra", nargs="*", help="more pretrain_clm.py arguments (after --)")
    args = parser.parse_args(argv)
    if "ddp" not in args.methods:
        parser.error("--methods needs ddp: every method is compared with it")
    if args.from_json:
        measured = json.loads(Path(args.from_json).read_text())
        command, runs = measured["command"], measured["runs"]
        for r in runs:
            r["method"] = OLD_NAMES.get(r["method"], r["method"])
    else:
        command, runs = " ".join(sys.argv), [run(m, args) for m in args.methods]
    out = Path(args.output_dir)
    out.mkdir(parents=True, exist_ok=True)
    table, summary = summarise(runs)
    keep = ("method", "seed", "steps", "tokens", "eval_steps", "val_losses", "train_seconds", "slow_rank_delay")
    payload = {"command": command, "runs": [{k: r.get(k) for k in keep} for r in runs], "summary": summary}
    if args.from_json:
        payload["analysed_with"] = " ".join(sys.argv)
    (out / "heterogeneous.json").write_text(json.dumps(payload, indent=2))
    (out / "table.md").write_text(table)
    plot(runs, out / "loss_curves.png")
    print(table)


if __name__ == "__main__":
    main()
