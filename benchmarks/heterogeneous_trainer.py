"""Slower and faster ranks under ACCOTrainer: Trainer+DDP, ACCOTrainer fixed and ACCOTrainer paced, side by side.

Each run is ``accelerate launch`` of tests/scripts/trainer_script.py (a script written for transformers.Trainer;
``--acco`` swaps the two class names) on 2 CPU ranks, with per-rank work before every training micro-batch:
``--delays`` sleeps (a GPU's compute time without loading this machine's CPU) and ``--matmuls`` extra 256 x 256
matrix products (real compute). Every mode trains the same global batches (2 ranks x gradient_accumulation_steps
micro-batches per step, for ``--steps`` steps); the runs are interleaved, ``--repeats`` times.

    python benchmarks/heterogeneous_trainer.py --delays 0.03 0.06            # rank 1 plays a GPU half as fast
    python benchmarks/heterogeneous_trainer.py --delays 0 0 --matmuls 20 60  # rank 1 computes 3x more, for real

Prints a markdown table: micro-batches per rank, wall-clock (train_runtime, median), global tokens per second and
its ratio to fixed mode; writes it with the raw runs to ``--out``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "tests" / "scripts" / "trainer_script.py"
MODES = {
    "Trainer + DDP": ([], {}),
    'ACCOTrainer, acco_accumulation="fixed"': (["--acco"], {}),
    'ACCOTrainer, acco_accumulation="paced"': (["--acco"], {"acco_accumulation": "paced"}),
}
SEQ = 16  # the script's sequence length


def run(mode: str, cli: argparse.Namespace, out: Path) -> dict:
    flags, extra = MODES[mode]
    extra = {**extra, "gradient_accumulation_steps": cli.gradient_accumulation_steps, "logging_steps": cli.steps}
    cmd = [sys.executable, "-m", "accelerate.commands.launch", "--config_file",
           str(ROOT / "accelerate_configs" / "cpu_2proc.yaml"), str(SCRIPT), *flags, "--output_dir", str(out),
           "--max_steps", str(cli.steps), "--train_size", str(cli.train_size), "--extra", json.dumps(extra),
           "--rank_delays", *map(str, cli.delays), "--rank_matmuls", *map(str, cli.matmuls)]  # fmt: skip
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}
    subprocess.run(cmd, check=True, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    history = json.loads((out / "log_history.json").read_text())
    counts = [json.loads((out / f"rank{r}_micro_batches.json").read_text()) for r in range(2)]
    runtime = history[-1]["train_runtime"]
    rows = sum(c["rows"] for c in counts)
    final_loss = [h["loss"] for h in history if "loss" in h][-1]
    return {"mode": mode, "runtime_s": runtime, "micro_batches": [c["micro_batches"] for c in counts],
            "tokens_per_s": rows * SEQ / runtime, "final_loss": final_loss}  # fmt: skip


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--delays", type=float, nargs=2, default=[0.03, 0.06], help="seconds of sleep per micro-batch")
    p.add_argument("--matmuls", type=int, nargs=2, default=[0, 0], help="extra matmuls per micro-batch")
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--gradient_accumulation_steps", type=int, default=4)
    p.add_argument("--train_size", type=int, default=2048)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--out", default="outputs/heterogeneous_trainer")
    cli = p.parse_args(argv)
    out = Path(cli.out)
    out.mkdir(parents=True, exist_ok=True)
    runs = []
    for repeat in range(cli.repeats):
        for mode in MODES:
            with tempfile.TemporaryDirectory() as tmp:
                runs.append({**run(mode, cli, Path(tmp)), "repeat": repeat})
                r = runs[-1]
                print(f"{mode} (repeat {repeat}): {r['runtime_s']:.2f} s, micro-batches {r['micro_batches']}",
                      flush=True)  # fmt: skip
    fixed = statistics.median(r["tokens_per_s"] for r in runs if r["mode"] == list(MODES)[1])
    lines = [f"delays {cli.delays} s, matmuls {cli.matmuls} per micro-batch; {cli.steps} steps, "
             f"gradient_accumulation_steps={cli.gradient_accumulation_steps}, medians of {cli.repeats}", "",
             "| mode | micro-batches rank 0 / rank 1 | wall-clock | global tokens/s | / fixed |",
             "|---|---|---|---|---|"]  # fmt: skip
    for mode in MODES:
        mine = [r for r in runs if r["mode"] == mode]
        mb = [statistics.median(r["micro_batches"][k] for r in mine) for k in range(2)]
        tps = statistics.median(r["tokens_per_s"] for r in mine)
        wall = statistics.median(r["runtime_s"] for r in mine)
        lines.append(f"| {mode} | {mb[0]:.0f} / {mb[1]:.0f} | {wall:.2f} s | {tps:.0f} | {tps / fixed:.2f}x |")
    table = "\n".join(lines)
    print(table)
    (out / "table.md").write_text(table + "\n")
    command = " ".join(["python", "benchmarks/heterogeneous_trainer.py", *sys.argv[1:]])
    (out / "runs.json").write_text(json.dumps({"command": command, "args": vars(cli), "runs": runs}, indent=1))


if __name__ == "__main__":
    main()
