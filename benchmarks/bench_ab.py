"""A/B of the headline benchmark: a base commit against the working tree, alternated on one machine.

    python benchmarks/bench_ab.py --base 28073e1 [--rounds 2] [--steps 20] [--out outputs/bench_ab]
    make bench-ab BASE=28073e1

Run it before committing a change to the engine's round or step path. The base commit is checked out in a
temporary git worktree; each round runs ``python -m hf_acco.bench --ratios 0.5 --slow_factor 1 --methods acco:fixed
sync:fixed ddp:fixed --repeats 1`` once for the base and once for the working tree (alternated, so that the
machine's drift hits both), each with its own code on ``PYTHONPATH``. Printed: per side and round, the acco step
at the shaped setting (one round = half a step's compute), acco / sync, acco / DDP, acco's overlap efficiency and
compute in run / alone, then the medians over the rounds. A measurement, not a test: the machine is shared and
noisy; look at the ratios of one run, side by side.

Besides each run's benchmark.json and log, ``--out`` gets ``table.md`` and ``summary.json`` (the command, both
commits, every round's figures and the medians: what ``python -m hf_acco.tools.docs`` renders).
``--summarize`` rebuilds both from the runs already in ``--out``, without running anything.
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

ROOT = Path(__file__).resolve().parent.parent
BENCH = ["--ratios", "0.5", "--slow_factor", "1", "--methods", "acco:fixed", "sync:fixed", "ddp:fixed"]
FIGURES = ("acco step (s)", "acco / sync", "acco / DDP", "overlap eff.", "compute in run / alone")


def figures(benchmark: dict) -> dict[str, float]:
    """The headline figures of one benchmark.json, at its shaped setting."""
    runs = {r["method"]: r for r in benchmark["runs"] if r["setting"] != "loopback" and r["slow_factor"] == 1}
    acco, sync, ddp = runs["acco"], runs["sync"], runs["ddp"]
    return {
        "acco step (s)": acco["step_time_s"],
        "acco / sync": acco["step_time_s"] / sync["step_time_s"],
        "acco / DDP": acco["step_time_s"] / ddp["step_time_s"],
        "overlap eff.": acco["overlap_efficiency"],
        "compute in run / alone": acco["compute_slowdown"],
    }


def run_side(code: Path, out: Path, steps: int) -> dict[str, float]:
    cmd = [sys.executable, "-m", "hf_acco.bench", *BENCH, "--repeats", "1", "--steps", str(steps), "--out", str(out)]
    env = {**os.environ, "PYTHONPATH": str(code)}
    with open(out.with_suffix(".log"), "w") as log:
        subprocess.run(cmd, cwd=code, env=env, stdout=log, stderr=subprocess.STDOUT, check=True)
    return figures(json.loads((out / "benchmark.json").read_text()))


def table(results: dict[str, list[dict[str, float]]]) -> str:
    lines = ["| side | round | " + " | ".join(FIGURES) + " |", "|---|---|" + "---|" * len(FIGURES)]
    middle = medians(results)
    for side, rows in results.items():
        for i, row in enumerate(rows):
            lines.append(f"| {side} | {i + 1} | " + " | ".join(f"{row[k]:.3f}" for k in FIGURES) + " |")
        median = middle[side]
        lines.append(f"| **{side}** | median | " + " | ".join(f"**{median[k]:.3f}**" for k in FIGURES) + " |")
    return "\n".join(lines)


def medians(results: dict[str, list[dict[str, float]]]) -> dict[str, dict[str, float]]:
    return {side: {k: statistics.median(r[k] for r in rows) for k in FIGURES} for side, rows in results.items()}


def head_commit() -> str:
    """The working tree's commit, ``-dirty`` when it has uncommitted changes to tracked files."""
    run = lambda *a: subprocess.run(["git", "-C", str(ROOT), *a], capture_output=True, text=True).stdout.strip()  # noqa: E731
    return run("rev-parse", "--short", "HEAD") + ("-dirty" if run("status", "--porcelain", "-uno") else "")


def write_results(out: Path, results: dict[str, list[dict[str, float]]], base: str, head: str, steps: int) -> str:
    """``table.md`` and ``summary.json`` in ``out``; returns the table."""
    text = table(results)
    (out / "table.md").write_text(text + "\n")
    summary = {
        "command": f"python benchmarks/bench_ab.py --base {base} --rounds {len(results[f'base {base}'])} "
        f"--steps {steps}",
        "base": base,
        "head": head,
        "bench": ["python", "-m", "hf_acco.bench", *BENCH, "--repeats", "1", "--steps", str(steps)],
        "rounds": {("base" if side.startswith("base") else "head"): rows for side, rows in results.items()},
        "medians": {("base" if side.startswith("base") else "head"): m for side, m in medians(results).items()},
    }
    (out / "summary.json").write_text(json.dumps(summary, indent=1) + "\n")
    return text


def make_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--base", required=True, help="the commit to compare the working tree with")
    p.add_argument("--rounds", type=int, default=2, help="runs of each side, alternated")
    p.add_argument("--steps", type=int, default=20, help="optimizer steps per run")
    p.add_argument("--out", default="outputs/bench_ab", help="folder for each run's benchmark.json and log")
    p.add_argument("--summarize", action="store_true", help="rebuild table.md and summary.json from --out's runs")
    p.add_argument("--head", default=None, help="with --summarize: the commit the working tree's runs ran")
    return p


def read_runs(out: Path, base: str) -> dict[str, list[dict[str, float]]]:
    """The figures of the runs already in ``out`` (base-1, head-1, base-2, ...), by side."""
    results: dict[str, list[dict[str, float]]] = {f"base {base}": [], "working tree": []}
    for side, name in ((f"base {base}", "base"), ("working tree", "head")):
        i = 1
        while (out / f"{name}-{i}" / "benchmark.json").is_file():
            results[side].append(figures(json.loads((out / f"{name}-{i}" / "benchmark.json").read_text())))
            i += 1
    if not all(results.values()):
        raise SystemExit(f"no base-N/ and head-N/ runs with a benchmark.json in {out}")
    return results


def main(argv: list[str] | None = None) -> None:
    args = make_parser().parse_args(argv)
    out = Path(args.out).resolve()
    out.mkdir(parents=True, exist_ok=True)
    if args.summarize:
        print(write_results(out, read_runs(out, args.base), args.base, args.head or head_commit(), args.steps))
        return
    head = head_commit()
    with tempfile.TemporaryDirectory() as tmp:
        base = Path(tmp) / "base"
        subprocess.run(["git", "-C", str(ROOT), "worktree", "add", "--detach", str(base), args.base], check=True)
        try:
            results: dict[str, list[dict[str, float]]] = {f"base {args.base}": [], "working tree": []}
            for i in range(args.rounds):
                for side, code in ((f"base {args.base}", base), ("working tree", ROOT)):
                    name = "base" if code is base else "head"
                    results[side].append(run_side(code, out / f"{name}-{i + 1}", args.steps))
                    print(f"[bench-ab] {side}, round {i + 1}: {results[side][-1]}", flush=True)
        finally:
            subprocess.run(["git", "-C", str(ROOT), "worktree", "remove", "--force", str(base)], check=False)
    print(write_results(out, results, args.base, head, args.steps))


if __name__ == "__main__":
    main()
