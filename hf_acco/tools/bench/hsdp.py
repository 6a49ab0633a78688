"""HSDP against HSDP-ACCO on a two-level network: FSDP2 inside each node, and across nodes either HSDP's all-reduce
(``hsdp``, Trainer's HSDP: no synchronisation while accumulating, FSDP's reduce-scatter inside the node and its
all-reduce across nodes in the step's last backward) or ACCO's rounds on each rank's FSDP shard (``hsdp_acco``; and
``hsdp_sync``, its schedule that waits for the round: ZeRO-1 of the FSDP shard).

    python -m hf_acco.tools.bench.hsdp                      # the committed run
    python -m hf_acco.tools.bench.hsdp --nodes 2 --ranks_per_node 2 --steps 6 --repeats 1 --out outputs/hsdp

The network and the compute are those of ``python -m hf_acco.tools.bench.multinode`` (``link.py``: every rank in
its own network namespace, a node's ranks on an unshaped bridge, every node's uplink shaped to ``--uplink_mbit``;
``worker.Emulation``: the real gradients of a small Llama with ``--params`` extra trainable elements, then a wait to
the micro-batch's time, GPU-like): every figure is labelled emulated. The micro-batch time is set so that what
crosses between nodes, measured alone (every rank at once over its group of the ranks holding the same FSDP shard:
ACCO's reduce-scatter and all-gather of one FSDP shard's fp32 gradients), is ``--ratio`` x a step's compute;
``--ratio 0.5``: one round per half step. Runs interleaved, ``--repeats`` times; medians.

Each run's median step time has the planner's prediction beside it (``predicted_step_time_s``: ``python -m
hf_acco.plan --fsdp``'s view across nodes, hf_acco/tools/plan/fsdp.py, with its committed constants, not fitted on
these runs: ``hsdp`` as its HSDP, ``hsdp_sync`` / ``hsdp_acco`` as HSDP-ACCO sync / fixed).

Writes ``benchmark.json`` (``runs``: method, step_time_s, predicted_step_time_s, across_bytes_per_step (what left a
rank's node per step, counted on the node's uplink, over its ranks), bytes_per_step (what a rank sent per step,
inside and across nodes, counted on its own network device), ...) and ``table.md``; ``--from_json FILE`` predicts
the runs of a file again.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shlex
import sys
import tempfile
import time
from dataclasses import asdict
from pathlib import Path
from typing import Any

from hf_acco.tools import plan
from hf_acco.tools.bench import scaling
from hf_acco.tools.bench.fsdp_runs import METHODS
from hf_acco.tools.bench.link import unavailable
from hf_acco.tools.plan import fsdp as plan_fsdp

PLANNED = {"hsdp": "ddp", "hsdp_sync": "sync", "hsdp_acco": "acco"}  # the planner's name of each method


def make_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m hf_acco.tools.bench.hsdp", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)  # fmt: skip
    p.add_argument("--out", default="outputs/hsdp")
    p.add_argument("--nodes", type=int, default=2)
    p.add_argument("--ranks_per_node", type=int, default=2, help="FSDP's ranks inside a node (dp_shard_size)")
    p.add_argument("--uplink_mbit", type=float, default=200.0, help="every node's uplink, each way (Mbit/s)")
    scaling.add_run_args(p)
    p.add_argument("--from_json", default=None, help="measure nothing: predict this benchmark.json's runs again")
    p.set_defaults(ratio=0.5)
    return p


def predict(runs: list[dict[str, Any]], c: plan.Constants = plan.FITTED) -> None:
    """Each run's step as the planner predicts it with FSDP inside each node (its view across nodes)."""
    for r in runs:
        job, cluster = scaling.job_and_cluster(r)
        step_job, step_cluster = plan_fsdp.view(job, cluster)
        r["predicted_step_time_s"] = plan.predict(PLANNED[r["method"]], "fixed", step_job, step_cluster, c)["step_s"]


def table(runs: list[dict[str, Any]]) -> str:
    hsdp = next(r for r in runs if r["method"] == "hsdp")
    lines = [
        "Emulated compute (GPU-like: real gradients of a small model, then a wait to the stated micro-batch time); "
        "FSDP2 inside each node (an unshaped bridge), every node's uplink shaped; medians over repeats; predictions: "
        "the planner's (--fsdp) with its committed constants (not fitted on these runs).",
        "",
        "| nodes x ranks | method | micro-batch (s) | round alone (s) | all-reduce alone (s) | step (s) | "
        "predicted (s) | error | / hsdp | sent per rank per step, across nodes (MB) | ... in all (MB) |",
        "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    mb = lambda n: "-" if not n else f"{n / 1e6:.1f}"  # noqa: E731
    for r in runs:
        predicted = r.get("predicted_step_time_s")
        guess = "- | -" if predicted is None else f"{predicted:.3f} | {predicted / r['step_time_s'] - 1:+.0%}"
        lines.append(
            f"| {r['nodes']} x {r['ranks_per_node']} (emulated) | {r['method']} | {max(r['t_micro_s']):.3f} | "
            f"{r['round_alone_s']:.3f} | {r['all_reduce_alone_s']:.3f} | {r['step_time_s']:.3f} | {guess} | "
            f"{r['step_time_s'] / hsdp['step_time_s']:.2f} | {mb(r.get('across_bytes_per_step'))} | "
            f"{mb(r.get('bytes_per_step'))} |"
        )
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = make_parser()
    args = parser.parse_args(argv)
    out = Path(args.out)
    command = "python -m hf_acco.tools.bench.hsdp " + shlex.join(sys.argv[1:] if argv is None else argv)
    if args.from_json:
        payload = json.loads(Path(args.from_json).read_text())
        predict(payload["runs"])
        payload.update(analysed_with=command, constants=asdict(plan.FITTED))
        out.mkdir(parents=True, exist_ok=True)
        (out / "benchmark.json").write_text(json.dumps(payload, indent=1))
        (out / "table.md").write_text(table(payload["runs"]))
        print(table(payload["runs"]))
        return payload
    if args.nodes < 2 or args.ranks_per_node < 2:
        parser.error("HSDP needs --nodes and --ranks_per_node of 2 or more")
    why = unavailable()
    if why:
        parser.error(f"the HSDP benchmark needs its shaped network: {why}")
    out.mkdir(parents=True, exist_ok=True)
    args.link_mbit = args.uplink_mbit  # what scaling.measure shapes: with nodes, every node's uplink
    started = time.time()
    settings = [(m, "fixed", args.micro_batches) for m in METHODS]
    world_size = args.nodes * args.ranks_per_node
    label = f"hsdp_nodes{args.nodes}x{args.ranks_per_node}"
    with tempfile.TemporaryDirectory(prefix="hf_acco_hsdp_") as tmp:
        runs = scaling.measure(args, label, world_size, args.ratio, settings, Path(tmp), nodes=args.nodes,
                               extra={"fsdp_shard": args.ranks_per_node})  # fmt: skip
    predict(runs)
    machine = {"cpus": os.cpu_count(), "platform": platform.platform(), "python": platform.python_version()}
    payload = {"command": command, "settings": vars(args), "machine": machine, "emulated": True, "runs": runs}
    (out / "benchmark.json").write_text(json.dumps(payload, indent=1))
    (out / "table.md").write_text(table(runs))
    print(table(runs))
    print(f"[hsdp] done in {time.time() - started:.0f} s; results in {out}", flush=True)
    return payload


if __name__ == "__main__":
    main()
