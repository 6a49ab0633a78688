"""The benchmark on a two-level network (ranks grouped into nodes), with the planner's prediction beside each run.

    python -m hf_acco.tools.bench.multinode                                 # the committed run (about 25 min)
    python -m hf_acco.tools.bench.multinode --nodes 2 --ranks_per_node 2 --steps 6 --repeats 1 --out outputs/multinode

Every rank runs in its own network namespace. The ranks of a node are joined by a bridge of their own
(unshaped: the fast network inside a machine), and every node's bridge reaches a core bridge through one uplink
shaped to ``--uplink_mbit`` each way (``link.py``, ``Link(nodes=...)``): what leaves a node, from all its ranks
together, shares that rate, as it shares a machine's NICs. Ranks are numbered node by node, as launchers number
them. Compute is emulated as in ``python -m hf_acco.tools.bench.scaling`` (GPU-like: the real gradients of a small
Llama, then a wait to the micro-batch's time; ``--params`` extra trainable elements communicated): every figure
is labelled emulated.

For each ``--nodes`` (each node with ``--ranks_per_node`` ranks) the micro-batch time is set so that one round
measured alone (the gradients' reduce-scatter and the parameters' all-gather) is ``--ratio`` x a step's compute.
Methods: DDP as Trainer runs it, sync (ZeRO-1), acco fixed and acco paced, interleaved, ``--repeats`` times.

Each run's median step time has the planner's prediction beside it (``predicted_step_time_s``): ``plan.predict``
with the committed constants (``plan.FITTED``, fitted on the one-level scaling benchmark: nothing here is fitted
on these runs), the run's micro-batch times, ``gpus_per_node = --ranks_per_node``, ``inter_gbit =
--uplink_mbit``, gloo's spellings of the collectives.

Writes ``benchmark.json`` (``runs``: nodes, ranks_per_node, method, accumulation, step_time_s (median),
predicted_step_time_s, ...) and ``table.md``; ``--from_json FILE`` predicts the runs of a file again.
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
from hf_acco.tools.bench.link import unavailable
from hf_acco.tools.bench.report import method_label

METHODS = [("ddp", "fixed"), ("sync", "fixed"), ("acco", "fixed"), ("acco", "paced")]


def make_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m hf_acco.tools.bench.multinode",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--out", default="outputs/multinode")
    p.add_argument("--nodes", type=int, nargs="+", default=[2, 4], help="node counts, one setting each")
    p.add_argument("--ranks_per_node", type=int, default=2)
    p.add_argument("--uplink_mbit", type=float, default=200.0, help="every node's uplink, each way (Mbit/s)")
    scaling.add_run_args(p)
    p.add_argument("--from_json", default=None, help="measure nothing: predict this benchmark.json's runs again")
    return p


def predict(runs: list[dict[str, Any]], c: plan.Constants = plan.FITTED) -> None:
    for r in runs:
        r["predicted_step_time_s"] = scaling.predict_run(r, c)


def table(runs: list[dict[str, Any]]) -> str:
    lines = [
        "Emulated compute (GPU-like: real gradients of a small model, then a wait to the stated micro-batch "
        "time); the ranks of a node on an unshaped bridge, every node's uplink shaped; medians over repeats; "
        "predictions: the planner with its committed constants (not fitted on these runs).",
        "",
        "| nodes x ranks | method | micro-batch (s) | round alone (s) | all-reduce alone (s) | step (s) | "
        "predicted (s) | error | / sync | / DDP |",
        "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in runs:
        same = [s for s in runs if s["setting"] == r["setting"]]
        by = {method_label(s["method"], s["accumulation"]): s["step_time_s"] for s in same}
        name = method_label(r["method"], r["accumulation"])
        err = r["predicted_step_time_s"] / r["step_time_s"] - 1
        lines.append(
            f"| {r['nodes']} x {r['ranks_per_node']} (emulated) | {name} | {max(r['t_micro_s']):.3f} | "
            f"{r['round_alone_s']:.3f} | {r['all_reduce_alone_s']:.3f} | {r['step_time_s']:.3f} | "
            f"{r['predicted_step_time_s']:.3f} | {err:+.0%} | {r['step_time_s'] / by['sync']:.2f} | "
            f"{r['step_time_s'] / by['ddp']:.2f} |"
        )
    return "\n".join(lines) + "\n"


def write(out: Path, payload: dict[str, Any]) -> None:
    out.mkdir(parents=True, exist_ok=True)
    (out / "benchmark.json").write_text(json.dumps(payload, indent=1))
    (out / "table.md").write_text(table(payload["runs"]))


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = make_parser()
    args = parser.parse_args(argv)
    out = Path(args.out)
    command = "python -m hf_acco.tools.bench.multinode " + shlex.join(sys.argv[1:] if argv is None else argv)
    payload: dict[str, Any]
    if args.from_json:
        payload = json.loads(Path(args.from_json).read_text())
        predict(payload["runs"])
        payload.update(analysed_with=command, constants=asdict(plan.FITTED))
        write(out, payload)
        print(table(payload["runs"]))
        return payload
    if args.ranks_per_node < 1 or any(n < 2 for n in args.nodes):
        parser.error("a two-level network needs --nodes of 2 or more and --ranks_per_node of 1 or more")
    why = unavailable()
    if why:
        parser.error(f"the multi-node benchmark needs its shaped network: {why}")
    args.link_mbit = args.uplink_mbit  # what scaling.measure shapes: with nodes, every node's uplink
    started, runs = time.time(), []
    settings = [(m, a, args.micro_batches) for m, a in METHODS]
    machine = {"cpus": os.cpu_count(), "platform": platform.platform(), "python": platform.python_version()}
    payload = {"command": command, "settings": vars(args), "machine": machine, "emulated": True}
    with tempfile.TemporaryDirectory(prefix="hf_acco_multinode_") as tmp:
        for nodes in args.nodes:
            label = f"nodes{nodes}x{args.ranks_per_node}"
            world_size = nodes * args.ranks_per_node
            runs += scaling.measure(args, label, world_size, args.ratio, settings, Path(tmp), nodes=nodes)
            predict(runs)
            write(out, {**payload, "constants": asdict(plan.FITTED), "runs": runs})  # kept if a later one fails
            print(f"[multinode] {time.time() - started:.0f} s so far", flush=True)
    print(table(runs))
    print(f"[multinode] done in {time.time() - started:.0f} s; results in {out}", flush=True)
    return {**payload, "runs": runs}


if __name__ == "__main__":
    main()
