"""The benchmark with 2, 4 and 8 ranks on a shaped network, GPU-like (emulated) compute, and the planner beside it.

    python -m hf_acco.tools.bench.scaling                                   # the committed run (about 40 min)
    python -m hf_acco.tools.bench.scaling --world_sizes 2 4 --steps 8 --repeats 1 --check none --out outputs/scaling

Every rank runs in its own network namespace, all joined by a Linux bridge (``link.py``); every rank's link is
shaped to ``--link_mbit`` each way, at every world size. Compute is emulated (``worker.Emulation``): each
micro-batch computes the real gradients of a small Llama, then waits so that it takes a stated time with the
CPU free, as a GPU leaves it; the model carries ``--params`` extra trainable elements, so every method
communicates and updates the gradients of a model of that size. 8 ranks then fit on 2 CPU cores and the figures
are about the schedule and the network, not about CPU contention. Every figure of these runs is labelled
emulated.

The scaling series (``--world_sizes``): the micro-batch time is set, at each world size, so that one round
measured alone (reduce-scatter + all-gather of the gradients) is ``--ratio`` x a step's compute. Methods: acco
fixed, acco paced, sync (ZeRO-1) and DDP as Trainer runs it, interleaved, ``--repeats`` times each.

The slow setting (``--slow WORLD_SIZE:FACTOR``): rank 1's micro-batch ``FACTOR`` x the others' (the same
methods; the planner predicts it from the fit, it is not fitted on).

Then the planner (``hf_acco/tools/plan/``): its constants are fitted from the scaling runs (the collectives measured
alone at every world size; the half overhead from the 2-rank ACCO fixed runs only), and every run gets the planner's
prediction beside its measured median step time. The check (``--check WORLD_SIZE:RATIO``, a setting the fit did not
see): the planner recommends a method, accumulation and micro-batches per step (1 to ``--micro_batches``), and every
setting it could have chosen is measured there.

Writes ``benchmark.json`` (``runs``: world_size, method, accumulation, emulated, step_time_s (median),
predicted_step_time_s, ...), ``constants.json`` (the fit), ``table.md`` and ``step_time_vs_world_size.png``.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shlex
import statistics
import sys
import tempfile
import time
from dataclasses import asdict, replace
from pathlib import Path
from typing import Any

from hf_acco.tools import plan
from hf_acco.tools.bench import report
from hf_acco.tools.bench.headline import DEFAULT_TEXT, run_setting
from hf_acco.tools.bench.link import Link, unavailable
from hf_acco.tools.bench.report import method_label

METHODS = [("acco", "fixed"), ("acco", "paced"), ("sync", "fixed"), ("ddp", "fixed")]


def add_run_args(p: argparse.ArgumentParser) -> None:
    """What ``measure`` and ``base_spec`` read: the emulated model, the ratio, the steps (scaling and multinode)."""
    p.add_argument("--params", type=float, default=4e6, help="trainable elements communicated (fp32 gradients)")
    p.add_argument("--ratio", type=float, default=0.5, help="one round alone over one step's compute")
    p.add_argument("--micro_batches", type=int, default=4, help="per rank per step")
    p.add_argument("--steps", type=int, default=12)
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--timeout_s", type=int, default=1800, help="per setting")


def make_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m hf_acco.tools.bench.scaling", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)  # fmt: skip
    p.add_argument("--out", default="outputs/scaling")
    p.add_argument("--world_sizes", type=int, nargs="+", default=[2, 4, 8])
    p.add_argument("--link_mbit", type=float, default=200.0, help="every rank's link, each way")
    add_run_args(p)
    p.add_argument("--check", default="4:1.0", help="WORLD_SIZE:RATIO for the recommendation check, or none")
    p.add_argument(
        "--check_micro_batches",
        type=int,
        nargs="+",
        default=[2, 4, 8],
        help="the micro-batches per step the check's planner chooses from (and that are measured)",
    )
    p.add_argument(
        "--slow",
        default="4:2",
        help="WORLD_SIZE:FACTOR: a setting with rank 1 FACTOR x slower (at --ratio for the others), "
        "predicted, not fitted; or none",
    )
    p.add_argument(
        "--from_json",
        default=None,
        help="measure nothing: refit the planner on this benchmark.json's runs and predict them again",
    )
    return p


def base_spec(args: argparse.Namespace) -> dict[str, Any]:
    # a small Llama: its real forward and backward take a few ms, well inside the emulated micro-batch
    return {"seed": args.seed, "hidden": 32, "layers": 4, "heads": 2, "seq": 32, "batch": 2,
            "micro_batches": args.micro_batches, "lr": 1e-3, "steps": args.steps, "text_path": str(DEFAULT_TEXT),
            "timeout_s": 600, "slow_factor": 1.0, "model_dtype": "fp32", "calibration_repeats": 6}  # fmt: skip


def interleaved(settings: list[tuple[str, str, int]], repeats: int) -> list[dict[str, Any]]:
    """Runs in rotating order, so that a drift of the machine's speed is spread over every method."""
    rotated = lambda r: settings[r % len(settings) :] + settings[: r % len(settings)]  # noqa: E731
    return [{"method": m, "accumulation": a, "k": k, "repeat": r} for r in range(repeats) for m, a, k in rotated(r)]


def measure(
    args, label: str, world_size: int, ratio: float, settings, workdir: Path, slow_factor: float = 1.0, nodes: int = 1,
    extra: dict[str, Any] | None = None,
) -> list[dict[str, Any]]:  # fmt: skip
    """One setting on a fresh bridge: every run's median step time and the figures the planner needs. With
    ``slow_factor`` rank 1's micro-batch takes that many times the others'. With ``nodes`` > 1 the ranks are
    grouped into that many nodes (``Link(nodes=...)``) and ``args.link_mbit`` is each node's uplink. ``extra``:
    more of the workers' spec (``fsdp_shard``: the FSDP methods' ranks per node)."""
    spec = {**base_spec(args), "runs": interleaved(settings, args.repeats), "slow_factor": slow_factor,
            "emulate": {"params": int(args.params), "comm_over_compute": ratio},
            "devices": None, "shared_device": False, **(extra or {})}  # fmt: skip
    with Link(world_size=world_size, bridge=True, nodes=nodes) as link:
        link.shape(args.link_mbit)
        spec["devices"] = [link.device(r) for r in range(world_size)]
        spec["uplinks"] = [[ns, up] for ns, (up, _) in zip(link.node_namespaces, link.uplinks)]
        each = f"{nodes} nodes, each node's uplink" if nodes > 1 else "each rank's link"
        print(f"[bench] {label}: {world_size} ranks, {each} {args.link_mbit:g} Mbit/s, ratio {ratio:g}", flush=True)
        logs = run_setting(label, link, spec, workdir, args.timeout_s)
    comm = {key: max(log["comm"][key] or 0.0 for log in logs) for key in ("all_to_all_s", "all_reduce_s")}
    numel = logs[0]["comm"]["numel"]
    out = []
    for key in dict.fromkeys((r["method"], r["accumulation"], r["k"]) for r in logs[0]["runs"]):
        idx = [i for i, r in enumerate(logs[0]["runs"]) if (r["method"], r["accumulation"], r["k"]) == key]
        summaries = [report.summarise_run([log["runs"][i] for log in logs], t_comm=0.0, link_mbit=args.link_mbit,
                                          window=world_size * 2 * key[2]) for i in idx]  # fmt: skip
        steps = [s["step_time_s"] for s in summaries]
        out.append({
            "setting": label, "world_size": world_size, "nodes": nodes, "ranks_per_node": world_size // nodes,
            "method": key[0], "accumulation": key[1],
            "micro_batches": key[2], "emulated": True, "link_mbit": args.link_mbit, "params": numel,
            "comm_over_compute": ratio, "slow_factor": slow_factor, "t_micro_s": [log["t_micro"] for log in logs],
            "round_alone_s": comm["all_to_all_s"], "all_reduce_alone_s": comm["all_reduce_s"],
            "step_time_s": statistics.median(steps), "step_time_s_all": steps,
            "tokens_per_s": statistics.median(s["tokens_per_s"] for s in summaries),
            "bytes_per_step": report.median_or_none([s["bytes_per_step"] for s in summaries if s["bytes_per_step"]]),
            "across_bytes_per_step": report.median_or_none([s["across_bytes_per_step"] for s in summaries
                                                            if s["across_bytes_per_step"]]),  # fmt: skip
            "exposed_comm_s": report.median_or_none([s["exposed_comm_s"] for s in summaries if s["exposed_comm_s"]]),
            "compute_slowdown": report.median_or_none([s["compute_slowdown"] for s in summaries
                                                       if s["compute_slowdown"]]),
        })  # fmt: skip
    return out


def job_and_cluster(run: dict[str, Any]) -> tuple[plan.Job, plan.Cluster]:
    """The planner's view of a benchmark run: gloo; one rank per bridge port (``gpus_per_node`` 1), or the
    run's nodes, each with its uplink (``inter_gbit``) and its ranks on an unshaped bridge (``intra_gbit``: as
    good as unlimited)."""
    p = run["world_size"]
    job = plan.Job(params=run["params"], micro_batch_s=run["t_micro_s"], micro_batches=run["micro_batches"],
                   micro_batch_tokens=1, grad_bytes=4, param_bytes=4)  # fmt: skip
    cluster = plan.Cluster(
        gpus=p,
        gpus_per_node=run.get("ranks_per_node", 1),
        intra_gbit=1e9,
        inter_gbit=run["link_mbit"] / 1000,
        backend="gloo",
    )
    return job, cluster


def fit_constants(runs: list[dict[str, Any]]) -> plan.Constants:
    """The collectives alone at every world size; each method's step overhead from the smallest world size's runs
    only (the larger ones are predicted, not fitted)."""
    points = []
    for r in {r["setting"]: r for r in runs}.values():
        for kind, key in (("round", "round_alone_s"), ("all_reduce", "all_reduce_alone_s")):
            points.append({"kind": kind, "world_size": r["world_size"], "bytes": 4 * r["params"],
                           "link_mbit": r["link_mbit"], "seconds": r[key]})  # fmt: skip
    smallest = min(r["world_size"] for r in runs)
    observed = [(r["method"], r["accumulation"], *job_and_cluster(r), r["step_time_s"])
                for r in runs if r["world_size"] == smallest]  # fmt: skip
    fitted = plan.fit(points, observed)
    return replace(fitted, source=f"fitted: python -m hf_acco.tools.bench.scaling ({len(points)} collectives alone; "
                   f"step overheads from the {len(observed)} runs at {smallest} ranks)")  # fmt: skip


def predict_run(run: dict[str, Any], c: plan.Constants) -> float:
    job, cluster = job_and_cluster(run)
    return plan.predict(run["method"], run["accumulation"], job, cluster, c)["step_s"]


def check_recommendation(check_runs: list[dict[str, Any]], c: plan.Constants) -> dict[str, Any]:
    """The planner's choice at the check setting against every setting it could have chosen, measured."""
    job, cluster = job_and_cluster(check_runs[0])
    job = replace(job, micro_batches=max(r["micro_batches"] for r in check_runs))
    methods = list(dict.fromkeys((r["method"], r["accumulation"]) for r in check_runs))
    ks = sorted({r["micro_batches"] for r in check_runs})
    choice = plan.recommend(job, cluster, c, ks=ks, methods=methods, grad_bytes=[4])["choice"]  # all measured fp32
    key = lambda r: (r["method"], r["accumulation"], r["micro_batches"])  # noqa: E731
    measured = {key(r): r["tokens_per_s"] for r in check_runs}
    chosen = measured[key(choice)]
    best_key = max(measured, key=lambda k: measured[k])
    return {"setting": check_runs[0]["setting"], "recommended": list(key(choice)),
            "recommended_tokens_per_s": chosen, "best": list(best_key), "best_tokens_per_s": measured[best_key],
            "recommended_over_best": chosen / measured[best_key],
            "candidates_measured": [[*k, v] for k, v in measured.items()]}  # fmt: skip


def table(runs: list[dict[str, Any]], check: dict[str, Any] | None) -> str:
    lines = ["Emulated compute (GPU-like: real gradients of a small model, then a wait to the stated micro-batch "
             "time); every rank's link shaped to the same rate; medians over repeats.", "",
             "| setting | ranks | method | micro-batches | micro-batch, slowest rank (s) | round alone (s) | "
             "step (s) | predicted (s) | error | / sync |",
             "|---|---:|---|---:|---:|---:|---:|---:|---:|---:|"]  # fmt: skip
    for r in runs:
        sync = next((s for s in runs if s["setting"] == r["setting"] and s["method"] == "sync"
                     and s["micro_batches"] == r["micro_batches"]), None)  # fmt: skip
        name = method_label(r["method"], r["accumulation"])
        err = r["predicted_step_time_s"] / r["step_time_s"] - 1
        over_sync = f"{r['step_time_s'] / sync['step_time_s']:.2f}" if sync else "-"
        lines.append(f"| {r['setting']} (emulated) | {r['world_size']} | {name} | {r['micro_batches']} | "
                     f"{max(r['t_micro_s']):.3f} | {r['round_alone_s']:.3f} | {r['step_time_s']:.3f} | "
                     f"{r['predicted_step_time_s']:.3f} | {err:+.0%} | {over_sync} |")  # fmt: skip
    if check:
        lines += ["", f"Recommendation check at {check['setting']}: the planner chose {check['recommended']} "
                  f"({check['recommended_tokens_per_s']:.0f} tokens/s measured); the best measured was "
                  f"{check['best']} ({check['best_tokens_per_s']:.0f}): "
                  f"{check['recommended_over_best']:.2f} of the best."]  # fmt: skip
    return "\n".join(lines) + "\n"


def plot(runs: list[dict[str, Any]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    series = [r for r in runs if r["setting"].startswith("scaling")]
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for i, key in enumerate(dict.fromkeys((r["method"], r["accumulation"]) for r in series)):
        rs = sorted((r for r in series if (r["method"], r["accumulation"]) == key), key=lambda r: r["world_size"])
        name = method_label(*key)
        colour = f"C{i}"
        ax.plot([r["world_size"] for r in rs], [r["step_time_s"] for r in rs], marker="o", color=colour,
                label=f"{name} measured")  # fmt: skip
        ax.plot([r["world_size"] for r in rs], [r["predicted_step_time_s"] for r in rs], linestyle="--",
                color=colour, label=f"{name} planner")  # fmt: skip
    ax.set_xlabel("ranks (each on its own shaped link)")
    ax.set_ylabel("median step time (s)")
    ax.set_title(f"EMULATED compute; one round alone = {series[0]['comm_over_compute']:g} x a step's compute;\n"
                 f"every rank's link {series[0]['link_mbit']:g} Mbit/s; dashed: the planner", fontsize=10)  # fmt: skip
    ax.set_xticks(sorted({r["world_size"] for r in series}))
    ax.legend(fontsize=7, ncol=2)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = make_parser()
    args = parser.parse_args(argv)
    out = Path(args.out)
    started = time.time()
    groups: dict[str, list[dict[str, Any]]] = {"scaling": [], "check": [], "slow": []}  # by the label's first word
    if args.from_json:
        measured = json.loads(Path(args.from_json).read_text())
        for r in measured["runs"]:
            groups[r["setting"].split("_")[0]].append(r)
        out.mkdir(parents=True, exist_ok=True)
        return analyse({k: measured[k] for k in ("command", "settings", "machine")}, groups, out)
    why = unavailable()
    if why:
        parser.error(f"the scaling benchmark needs its shaped network: {why}")
    out.mkdir(parents=True, exist_ok=True)
    settings = [(m, a, args.micro_batches) for m, a in METHODS]
    with tempfile.TemporaryDirectory(prefix="hf_acco_scaling_") as tmp:
        for p in args.world_sizes:
            groups["scaling"] += measure(args, f"scaling_ws{p}", p, args.ratio, settings, Path(tmp))
            print(f"[scaling] {time.time() - started:.0f} s so far", flush=True)
        if args.slow != "none":
            p, factor = args.slow.split(":")
            label = f"slow_ws{p}_x{factor}"
            groups["slow"] = measure(args, label, int(p), args.ratio, settings, Path(tmp), float(factor))
        if args.check != "none":
            p, ratio = args.check.split(":")
            # every setting the planner may choose from: micro-batches per step x the methods (all ranks are
            # equally fast here, so the planner leaves paced out: it can only match fixed)
            candidates = [(m, a, k) for k in args.check_micro_batches for m, a in METHODS if a == "fixed"]
            label = f"check_ws{p}_ratio{ratio}"
            groups["check"] = measure(args, label, int(p), float(ratio), candidates, Path(tmp))
    machine = {"cpus": os.cpu_count(), "platform": platform.platform(), "python": platform.python_version()}
    measured = {"command": "python -m hf_acco.tools.bench.scaling " + shlex.join(sys.argv[1:]), "settings": vars(args),
                "machine": machine}  # fmt: skip
    # the measurements first: an analysis that fails leaves them for --from_json
    (out / "benchmark.json").write_text(json.dumps({**measured, "runs": sum(groups.values(), [])}, indent=1))
    payload = analyse(measured, groups, out)
    print(f"[scaling] done in {time.time() - started:.0f} s; results in {out}", flush=True)
    return payload


def analyse(measured: dict[str, Any], groups: dict[str, list[dict]], out: Path) -> dict:
    """Fit the planner on the scaling runs, predict every run, check the recommendation; write the results.
    ``measured``: the measurement's ``command``, ``settings`` and ``machine`` (kept when refitting from a file)."""
    runs, check_runs = groups["scaling"], groups["check"]
    constants = fit_constants(runs)
    every = runs + groups["slow"] + check_runs
    for r in every:
        r["predicted_step_time_s"] = predict_run(r, constants)
    check = check_recommendation(check_runs, constants) if check_runs else None
    payload = {
        **measured,
        "analysed_with": "python -m hf_acco.tools.bench.scaling " + shlex.join(sys.argv[1:]),
        "emulated": True,
        "constants": asdict(constants),
        "recommendation_check": check,
        "runs": every,
    }
    (out / "benchmark.json").write_text(json.dumps(payload, indent=1))
    (out / "constants.json").write_text(json.dumps({"command": measured["command"], **asdict(constants)}, indent=1))
    (out / "table.md").write_text(table(every, check))
    plot(runs, out / "step_time_vs_world_size.png")
    print(table(every, check))
    return payload


if __name__ == "__main__":
    main()
