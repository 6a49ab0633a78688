"""The CPU of one ACCO round at the benchmark's model size, by component: 2 gloo ranks on loopback, no compute.

    python benchmarks/round_cpu.py [--rounds 60] [--out recipes/results/engine/round_cpu/<commit>.json]
    PYTHONPATH=<a worktree of another commit> python benchmarks/round_cpu.py ...   # that commit's code

The rounds (estimate and commit alternately, on random gradient sums) run on each rank's main thread through the
engine's own round body. Each component is measured around its call: ``thread_ms`` is the calling thread's CPU,
``process_ms`` that of every thread of the rank (gloo's workers and socket threads too); medians over the rounds
after a warm-up, averaged over the ranks. ``context_switches_per_round``: of every thread of the rank over a whole
round (median), since each wakeup of a round's thread or of gloo's costs the compute on a shared core beside the
round's own CPU (``benchmarks/wakeups.py``). In the benchmark a round runs beside the compute on the same cores, so
what it takes is the compute's loss (``compute in run / alone``). A measurement, not a test.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import json
import os
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import torch

from hf_acco.tools.multiprocess import run_ranks

WARMUP = 6
SWITCHES = "context switches (all threads)"
MODEL = {"seed": 0, "hidden": 128, "layers": 3, "heads": 2, "seq": 128}  # hf_acco.tools.bench's defaults
COMPONENTS = {  # (object, method): label, in a round's order
    ("comm", "all_reduce_counts"): "counts (host all-reduce)",
    ("comm", "reduce_scatter"): "reduce-scatter",
    ("body", "global_grad_norm"): "global norm (with its all-reduce)",
    ("shard", "estimate"): "AdamW estimate (estimate rounds)",
    ("shard", "commit"): "AdamW step (commit rounds)",
    ("comm", "all_gather"): "all-gather",
    ("body", "_run"): "whole round",
}


def _timed(obj: Any, name: str, record: list) -> None:
    """Wrap ``obj.name`` (on the instance) to append (thread CPU, process CPU) of each call to ``record``."""
    inner = getattr(obj, name)

    @functools.wraps(inner)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        # The process clock is read outside the thread clock at both ends: its window holds the thread's, so a call's
        # all-threads CPU is never less than its own thread's (read the other way round, 5.92 > 5.91 ms once in CI).
        p0 = time.process_time()
        t0 = time.thread_time()
        try:
            return inner(*args, **kwargs)
        finally:
            t1 = time.thread_time()
            record.append((t1 - t0, time.process_time() - p0))

    setattr(obj, name, wrapper)


def context_switches() -> int | None:
    """Context switches so far of every thread of this process (voluntary: it blocked; involuntary: preempted), or
    ``None`` off Linux. On a shared core each one costs the compute beside the round (``benchmarks/wakeups.py``)."""
    total = 0
    try:
        for tid in os.listdir("/proc/self/task"):
            with contextlib.suppress(FileNotFoundError):  # a thread that ended meanwhile
                with open(f"/proc/self/task/{tid}/status") as f:
                    total += sum(int(line.split()[1]) for line in f if "ctxt_switches" in line)
    except FileNotFoundError:
        return None
    return total


def _rank(rank: int, world_size: int, rounds: int) -> dict[str, Any]:
    import torch.distributed as dist

    from hf_acco.engine.core import ACCOOptimizer, RoundKind
    from hf_acco.tools.bench.worker import build_model

    model = build_model(MODEL)
    opt = ACCOOptimizer(model.parameters(), micro_batches=4, max_grad_norm=1.0, lr=2e-3, weight_decay=0.0)
    parts = {"comm": opt.comm, "body": opt._round, "shard": opt._round.shard}
    records: dict[str, list] = {label: [] for label in COMPONENTS.values()}
    for (part, name), label in COMPONENTS.items():
        _timed(parts[part], name, records[label])
    buffers = opt.buffers
    switches: list[int | None] = []
    for i in range(rounds):
        kind = RoundKind.COMMIT if i % 2 else RoundKind.ESTIMATE
        buf, lent = buffers.hand_over(swap=kind is RoundKind.COMMIT)
        if lent is not None:  # the round's copy of the sums (random gradients overwrite it below)
            lent.take()
        grads = buffers.grads_of(buf)
        grads.normal_(generator=torch.Generator().manual_seed(1000 * rank + i))
        dist.barrier()
        before = context_switches()
        opt._round(kind, grads, buffers.params_of(buf), [4.0, 4.0, 0.0], opt._hparams(), threading.Event(), "bench")
        after = context_switches()
        switches.append(None if before is None or after is None else after - before)
        buffers.restart(kind is RoundKind.COMMIT)
    opt.close()
    out: dict[str, Any] = {}
    after_warmup = [n for n in switches[WARMUP:] if n is not None]
    out[SWITCHES] = statistics.median(after_warmup) if None not in switches and after_warmup else None
    for label, calls in records.items():
        kept = calls[len(calls) * WARMUP // rounds :]  # after the warm-up rounds
        out[label] = [1e3 * statistics.median(c[0] for c in kept), 1e3 * statistics.median(c[1] for c in kept)]
        out[label].append(len(calls) / rounds)
    return out


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rounds", type=int, default=60)
    p.add_argument("--out", default=None, help="default: recipes/results/engine/round_cpu/<commit of the code>.json")
    args = p.parse_args(argv)
    import hf_acco

    code = Path(hf_acco.__file__).resolve().parent.parent
    git = ["git", "-C", str(code), "rev-parse", "--short", "HEAD"]
    commit = subprocess.run(git, capture_output=True, text=True, check=True).stdout.strip()
    per_rank = run_ranks(_rank, world_size=2, rounds=args.rounds)
    components = {
        label: {
            "thread_ms": statistics.mean(r[label][0] for r in per_rank),
            "process_ms": statistics.mean(r[label][1] for r in per_rank),
            "calls_per_round": per_rank[0][label][2],
        }
        for label in COMPONENTS.values()
    }
    command = "python benchmarks/round_cpu.py " + " ".join(sys.argv[1:] if argv is None else argv)
    result = {"command": command.strip(), "code_commit": commit, "rounds": args.rounds, "model": MODEL}
    result["components"] = components
    per_rank_switches = [r[SWITCHES] for r in per_rank]
    result["context_switches_per_round"] = None if None in per_rank_switches else statistics.mean(per_rank_switches)
    out = Path(args.out or Path(__file__).resolve().parent.parent / f"recipes/results/engine/round_cpu/{commit}.json")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=1) + "\n")
    for label, c in components.items():
        print(f"{label:36s} thread {c['thread_ms']:6.2f} ms  all threads {c['process_ms']:6.2f} ms")
    print(f"context switches per round, all threads: {result['context_switches_per_round']}")
    print(f"written to {out}")


if __name__ == "__main__":
    main()
