"""Benchmark: ACCO (fixed, paced), DPU, ZeRO-1 (sync) and DDP as Trainer runs it, side by side, on a real,
rate-limited link between 2 ranks (``--world_size``: more, joined by a bridge), with and without a slow rank.

    python -m hf_acco.bench                               # the full run (about 20 min on 2 CPU cores)
    python -m hf_acco.bench --ratios 0.5 --repeats 1 --steps 10 --out outputs/bench   # a quick look

Each rank runs in its own network namespace, joined by a veth pair shaped with tbf on both ends (root and
iproute2 needed; without them the benchmark says so and measures unshaped loopback only). First the unshaped
loopback setting, which also calibrates: compute time of one step and bytes of one round. Then the link rate is
set so that one round of communication (what sync and DDP move per step) takes ``ratio`` x the compute of a step,
for each ``--ratios``; then one rank is slowed ``--slow_factor`` x at ``--slow_ratio``. In every setting the
methods run interleaved, ``--repeats`` times, through the same training loop (``worker.py``) on a small Llama
built from a config, learning real text (``../shared/data/text`` when present, else generated).

``acco`` paced runs ACCOTrainer's paced accumulation (claims.py + pacer.py): the same global batch of 2 x
``--micro_batches`` micro-batches per step as every other method, each rank computing as many of them as its speed
allows (the slow rank fewer).

``--emulate_micro_batch_s T --emulate_params N``: GPU-like compute (``worker.Emulation``: real gradients of the
small model, then a wait to ``T`` s per micro-batch, ``N`` extra trainable elements communicated); its runs are
labelled ``emulated``. The N-rank study with the planner beside it: ``python -m hf_acco.tools.bench.scaling``.

Writes ``benchmark.json`` (``runs``: one entry per method and setting), ``table.md`` and PNG plots to ``--out``.
Definitions of every figure: ``hf_acco/tools/bench/report.py``.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shlex
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from hf_acco.comm import quant
from hf_acco.tools.bench import report
from hf_acco.tools.bench.link import MTU, Link, unavailable
from hf_acco.tools.bench.report import method_label, paced_name
from hf_acco.tools.multiprocess import free_port

ROOT = Path(__file__).resolve().parents[3]
DEFAULT_TEXT = ROOT.parent / "shared" / "data" / "text" / "tinystories_validation_head.txt"
# bytes on the shaped veth per byte counted on loopback: TCP/IPv4 with timestamps in 9014-byte Ethernet frames
# (MTU 9000) carries 8948 bytes of payload (loopback's 64 KiB MTU adds almost nothing); tbf counts whole frames
FRAMING = (MTU + 14) / (MTU - 52)
METHODS = [("acco", "fixed"), ("acco", "paced"), ("dpu", "fixed"), ("sync", "fixed"), ("ddp", "fixed")]
# not run by default: gradients in bf16 on the wire (ACCO's comm_dtype, DDP's bf16_compress_hook)
BF16_METHODS = [("acco-bf16", "fixed"), ("acco-bf16", "paced"), ("sync-bf16", "fixed"), ("ddp-bf16", "fixed")]
# not run by default: int8 gradients and parameter changes on the wire (ACCO's comm_dtype and gather_dtype "int8";
# DDP has no such hook); acco-int8-int4: int8 gradients, int4 parameter changes
INT8_METHODS = [("acco-int8", "fixed"), ("acco-int8", "paced"), ("sync-int8", "fixed"), ("acco-int8-int4", "fixed")]
WIRE_BYTES = {
    "fp32": 4,
    "bf16": 2,
    **{f"int{b}": quant.packed_numel(1 << 20, b) / (1 << 20) for b in quant.BITS},  # a long row: no padding
}


def make_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m hf_acco.bench", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)  # fmt: skip
    p.add_argument("--out", default="outputs/benchmark", help="folder for benchmark.json, table.md, plots")
    p.add_argument("--ratios", type=float, nargs="*", default=[0.25, 0.5, 1.0, 3.0],
                   help="one round's wire time over one step's compute, one shaped setting each")  # fmt: skip
    p.add_argument("--slow_factor", type=float, default=2.0, help="the slow rank's compute time factor (1: none)")
    p.add_argument("--slow_ratio", type=float, default=1.0, help="communication/compute ratio of the slow setting")
    p.add_argument("--methods", nargs="+", default=[f"{m}:{a}" for m, a in METHODS], type=paced_name,
                   choices=[f"{m}:{a}" for m, a in METHODS + BF16_METHODS + INT8_METHODS])  # fmt: skip
    p.add_argument(
        "--param_dtype",
        "--model_dtype",
        dest="model_dtype",
        choices=["fp32", "bf16"],
        default="fp32",
        help="the model's weights",
    )
    p.add_argument("--steps", type=int, default=20, help="optimizer steps per run")
    p.add_argument("--repeats", type=int, default=2, help="runs of each method per setting, interleaved")
    p.add_argument("--micro_batches", type=int, default=4, help="per rank per optimizer step (fixed mode)")
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--seq", type=int, default=128)
    p.add_argument("--hidden", type=int, default=128)
    p.add_argument("--layers", type=int, default=3)
    p.add_argument("--heads", type=int, default=2)
    p.add_argument("--lr", type=float, default=2e-3)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--text", default=str(DEFAULT_TEXT), help="plain text to learn (generated when missing)")
    p.add_argument("--target_loss", type=float, default=None,
                   help="default: Trainer-DDP's smoothed loss after 3/4 of its tokens, per setting")  # fmt: skip
    p.add_argument("--no_netns", action="store_true", help="host loopback only, no namespaces (no root needed)")
    p.add_argument("--world_size", type=int, default=2, help="ranks; above 2 they are joined by a bridge")
    p.add_argument(
        "--emulate_micro_batch_s",
        type=float,
        default=None,
        help="GPU-like compute: real gradients, then a wait to this many seconds per micro-batch",
    )
    p.add_argument(
        "--emulate_params",
        type=float,
        default=0,
        help="with --emulate_micro_batch_s: extra trainable elements the methods communicate",
    )
    p.add_argument("--timeout_s", type=int, default=1800, help="per setting")
    return p


def run_setting(label: str, link: Link | None, spec: dict[str, Any], workdir: Path, timeout_s: int) -> list[dict]:
    """Start every rank (each in its namespace), stream rank 0's progress, return every rank's log."""
    world_size = link.world_size if link is not None else spec.get("world_size", 2)
    spec = {**spec, "label": label}
    spec_path = workdir / f"{label}.spec.json"
    spec_path.write_text(json.dumps(spec))
    procs, outs = [], []
    port = 29600 if link is not None else free_port()
    for rank in range(world_size):
        out = workdir / f"{label}.rank{rank}.json"
        out.unlink(missing_ok=True)
        outs.append(out)
        env = {**os.environ, "RANK": str(rank), "WORLD_SIZE": str(world_size), "LOCAL_RANK": "0",
               "OMP_NUM_THREADS": "1", "MASTER_PORT": str(port),
               "MASTER_ADDR": link.master_addr() if link else "127.0.0.1",
               "GLOO_SOCKET_IFNAME": link.device(rank) if link else "lo"}  # fmt: skip
        argv = [sys.executable, "-m", "hf_acco.tools.bench.worker", str(spec_path), str(out)]
        procs.append(subprocess.Popen(link.wrap(rank, argv) if link else argv, env=env))
    deadline = time.monotonic() + timeout_s
    try:
        while any(p.poll() is None for p in procs):
            failed = [r for r, p in enumerate(procs) if p.poll() not in (None, 0)]
            if failed or time.monotonic() > deadline:
                why = f"rank(s) {failed} failed" if failed else f"timed out after {timeout_s} s"
                raise RuntimeError(f"benchmark setting {label}: {why}; see the output above")
            time.sleep(0.5)
        if any(p.returncode != 0 for p in procs):
            raise RuntimeError(f"benchmark setting {label}: a rank exited with {[p.returncode for p in procs]}")
    finally:
        for p in procs:  # a failed or interrupted setting leaves no rank behind
            if p.poll() is None:
                p.kill()
                p.wait()
    return [json.loads(o.read_text()) for o in outs]


def summarise_setting(logs: list[dict], setting: dict[str, Any], target: float | None) -> list[dict]:
    window = len(logs) * 2 * logs[0]["runs"][0].get("k", 4)
    rounds = {"acco": 2, "dpu": 1, "sync": 1}
    # the wire time alone was measured for an fp32 round (or all-reduce); other dtypes move fewer bytes
    model_bytes = 2 if setting.get("model_dtype") == "bf16" else 4
    per_method: dict[tuple[str, str], list[dict]] = {}
    for i, run in enumerate(logs[0]["runs"]):
        ranks = [log["runs"][i] for log in logs]
        method = run["method"]
        base, wire = report.method_parts(method)
        grad_bytes = WIRE_BYTES[wire]
        changes = report.gather_of(method)  # the parameters' changes quantised, or the model's dtype
        param_bytes = model_bytes if changes == "auto" else WIRE_BYTES[changes]
        if base == "ddp":
            t_comm = max(log["comm"]["all_reduce_s"] for log in logs) * min(grad_bytes, param_bytes) / 4
        else:
            t_comm = rounds[base] * max(log["comm"]["all_to_all_s"] for log in logs) * (grad_bytes + param_bytes) / 8
        summary = report.summarise_run(ranks, t_comm=t_comm, link_mbit=setting["link_mbit"], window=window)
        per_method.setdefault((method, run["accumulation"]), []).append(summary)
    if target is None and ("ddp", "fixed") in per_method:
        target = report.default_target(per_method[("ddp", "fixed")])
    # one round (what sync and DDP move per step) over one fixed-mode step of the slowest rank's compute
    k = logs[0]["runs"][0].get("k", 4)
    t_compute = k * max(log["runs"][0]["t_micro"] for log in logs)
    measured_ratio = max(log["comm"]["all_to_all_s"] for log in logs) / t_compute
    out = []
    for summaries in per_method.values():
        entry = {**setting, "comm_over_compute_measured": measured_ratio, **report.combine_repeats(summaries, target)}
        entry["comm_alone"] = {k: max(log["comm"][k] or 0 for log in logs) for k in logs[0]["comm"]}
        out.append(entry)
    return out


def plot(runs: list[dict], path_loss: Path, path_steps: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    settings = list(dict.fromkeys(r["setting"] for r in runs))
    shown = [s for s in settings if s.startswith("slow")] + [s for s in settings if "ratio0.5" in s]
    shown = shown or settings[:1]
    fig, axes = plt.subplots(len(shown), 2, figsize=(12, 4 * len(shown)), squeeze=False)
    for row, setting in zip(axes, shown):
        for r in (r for r in runs if r["setting"] == setting):
            name = method_label(r["method"], r["accumulation"])
            curve = r["loss_curve"]
            row[0].plot([c[0] for c in curve], [c[2] for c in curve], label=name)
            row[1].plot([c[1] for c in curve], [c[2] for c in curve], label=name)
        for ax, xlabel in zip(row, ("wall-clock (s)", "tokens (all ranks)")):
            target = next(r["target_loss"] for r in runs if r["setting"] == setting)
            if target is not None:
                ax.axhline(target, color="grey", linestyle=":", linewidth=1)
            ax.set_xlabel(xlabel)
            ax.set_ylabel("training loss (sliding mean)")
            ax.set_title(setting)
        row[0].legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path_loss)
    plt.close(fig)

    fig, ax = plt.subplots(figsize=(7, 4.5))
    shaped = [r for r in runs if r["link_mbit"] is not None and r["slow_factor"] == 1]
    for key in dict.fromkeys((r["method"], r["accumulation"]) for r in shaped):
        rs = sorted((r for r in shaped if (r["method"], r["accumulation"]) == key), key=lambda r: r["link_mbit"])
        name = method_label(*key)
        ax.plot([r["link_mbit"] for r in rs], [r["step_time_s"] for r in rs], marker="o", label=name)
    compute = [r["t_compute_s"] for r in shaped if r["method"] == "sync"]
    if compute:
        ax.axhline(sum(compute) / len(compute), color="grey", linestyle=":", label="compute alone")
    ax.set_xscale("log")
    ax.set_xlabel("link rate (Mbit/s, each way)")
    ax.set_ylabel("median step time (s)")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path_steps)
    plt.close(fig)


def main(argv: list[str] | None = None) -> dict:
    parser = make_parser()
    args = parser.parse_args(argv)
    try:
        import matplotlib  # noqa: F401  (the plots; checked first, not after minutes of measuring)
    except ImportError:
        parser.error("the benchmark plots with matplotlib: pip install 'hf_acco[bench]' (or matplotlib)")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    why_not = "--no_netns given" if args.no_netns else unavailable()
    if why_not:
        print(f"[bench] no shaped link ({why_not}): measuring unshaped host loopback only", flush=True)
    methods = [tuple(m.split(":")) for m in args.methods]
    base = {"seed": args.seed, "hidden": args.hidden, "layers": args.layers, "heads": args.heads, "seq": args.seq,
            "batch": args.batch, "micro_batches": args.micro_batches, "lr": args.lr, "steps": args.steps,
            "text_path": args.text, "timeout_s": 600, "slow_factor": 1.0, "model_dtype": args.model_dtype,
            "world_size": args.world_size}  # fmt: skip
    if args.emulate_micro_batch_s is not None:
        base["emulate"] = {"micro_batch_s": args.emulate_micro_batch_s, "params": int(args.emulate_params)}

    def plan(repeats: int) -> list[dict]:  # interleaved; the order rotates between repeats
        rotated = lambda r: methods[r % len(methods) :] + methods[: r % len(methods)]  # noqa: E731
        return [{"method": m, "accumulation": a, "repeat": r, "k": args.micro_batches}
                for r in range(repeats) for m, a in rotated(r)]  # fmt: skip

    runs: list[dict] = []
    started = time.time()
    with tempfile.TemporaryDirectory(prefix="hf_acco_bench_") as tmp:
        workdir = Path(tmp)

        def measure(
            label: str, link: Link | None, mbit: float | None, ratio: float | None, slow: float
        ) -> tuple[list[dict], list[dict]]:
            if link is not None:
                link.shape(mbit)
            devices = [link.device(rank) for rank in range(args.world_size)] if link else None
            spec = {**base, "runs": plan(args.repeats), "slow_factor": slow, "devices": devices,
                    "shared_device": bool(link and link.loopback)}  # fmt: skip
            print(f"[bench] setting {label}: link {'unshaped' if mbit is None else f'{mbit:.0f} Mbit/s'}, "
                  f"slow factor {slow:g} ({time.time() - started:.0f} s so far)", flush=True)  # fmt: skip
            logs = run_setting(label, link, spec, workdir, args.timeout_s)
            setting = {"setting": label, "link_mbit": mbit, "comm_over_compute": ratio, "slow_factor": slow,
                       "model_dtype": args.model_dtype, "world_size": args.world_size,
                       "emulated": "emulate" in base}  # fmt: skip
            return logs, report_setting(logs, setting)

        def report_setting(logs: list[dict], setting: dict) -> list[dict]:
            entries = summarise_setting(logs, setting, args.target_loss)
            runs.extend(entries)
            write(out, runs, args, why_not)
            return entries

        if why_not:
            measure("loopback", None, None, None, 1.0)
        else:
            with Link(loopback=True, world_size=args.world_size) as lo:
                logs, _ = measure("loopback", lo, None, None, 1.0)
            # calibration from the loopback setting: one step's compute, one round's bytes per rank
            t_compute = statistics.mean(log["t_micro"] for log in logs) * args.micro_batches  # no rank is slowed
            round_bytes = max(log["comm"]["all_to_all_bytes"] for log in logs)
            with Link(world_size=args.world_size) as link:
                settings = [(f"ratio{r:g}", r, 1.0) for r in args.ratios]
                if args.slow_factor != 1.0:
                    settings.append((f"slow{args.slow_factor:g}x_ratio{args.slow_ratio:g}", args.slow_ratio,
                                     args.slow_factor))  # fmt: skip
                for label, ratio, slow in settings:
                    mbit = round_bytes * FRAMING * 8 / (ratio * t_compute) / 1e6
                    measure(label, link, mbit, ratio, slow)
    print(report.markdown_table(runs))
    print(f"[bench] done in {time.time() - started:.0f} s; results in {out}", flush=True)
    return {"runs": runs}


def write(out: Path, runs: list[dict], args: argparse.Namespace, why_not: str | None) -> None:
    """Results so far (rewritten after every setting: an interrupted benchmark keeps what it measured)."""
    slim = [{k: v for k, v in r.items() if k != "loss_curve"} for r in runs]
    step = lambda curve: max(1, len(curve) // 200)  # noqa: E731
    curves = {
        f"{r['setting']}/{r['method']}/{r['accumulation']}": r["loss_curve"][:: step(r["loss_curve"])] for r in runs
    }
    payload = {
        "command": "python -m hf_acco.bench " + " ".join(shlex.quote(a) for a in sys.argv[1:]),
        "settings": vars(args),
        "shaped_link": why_not is None,
        "machine": {"cpus": os.cpu_count(), "platform": platform.platform(), "python": platform.python_version()},
        "definitions": report.__doc__,
        "runs": slim,
        "loss_curves": curves,
    }
    (out / "benchmark.json").write_text(json.dumps(payload, indent=1))
    (out / "table.md").write_text(report.markdown_table(runs))
    plot(runs, out / "loss_vs_time.png", out / "step_time_vs_link.png")


if __name__ == "__main__":
    main()
