"""Tables of README.md and docs/*.md rendered from the code and the committed results, never typed by hand.

    python -m hf_acco.tools.docs            # rewrite every rendered block in place
    python -m hf_acco.tools.docs --check    # exit 1 and name each block that differs (tests/test_docs.py runs it)

A rendered block is the text between ``<!-- rendered: NAME -->`` and ``<!-- /rendered -->``, NAME one of
:data:`RENDERERS`; everything outside the blocks is prose. A figure that changes (a rerun benchmark, a refitted
planner, a new setting) changes its block when this command is rerun, and the test fails until it is.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import re
import sys
from collections.abc import Callable
from pathlib import Path

from hf_acco.tools import results_docs
from hf_acco.tools.bench.report import accumulation_name, method_label

ROOT = Path(__file__).resolve().parents[2]
RESULTS = ROOT / "recipes" / "results"
BLOCK = re.compile(r"(<!-- rendered: ([\w-]+) -->\n)(.*?)(<!-- /rendered -->)", re.S)


def options_table() -> str:
    """Every ``acco_*`` field of ``ACCOConfigMixin``: its default and its help (the one place they are declared)."""
    from hf_acco.integrations.config import REMOVED_SETTINGS, ACCOConfigMixin

    rows = ["| option | default | what it does, when to change it |", "|---|---|---|"]
    removed = []
    for f in dataclasses.fields(ACCOConfigMixin):
        if f.name in REMOVED_SETTINGS:
            removed.append(f"`{f.name}`")
            continue
        shown = f'"{f.default}"' if isinstance(f.default, str) else repr(f.default)
        default = "automatic" if f.default is None else f"`{shown}`"
        rows.append(f"| `{f.name}` | {default} | {f.metadata['help']} |")
    note = f"\nRemoved, refused with what to do instead: {', '.join(removed)}.\n" if removed else ""
    return "\n".join(rows) + "\n" + note


def planner_examples() -> str:
    from hf_acco.tools import plan

    return plan.examples_table()


def multinode_table() -> str:
    from hf_acco.tools.bench import multinode

    payload = json.loads((RESULTS / "multinode" / "benchmark.json").read_text())
    return multinode.table(payload["runs"])


def _load(path: str) -> dict:
    return json.loads((RESULTS / path).read_text())


def _to_target(run: dict | None, ddp: dict) -> str:
    """A run's time to the target loss over DDP's, or - when either did not reach it."""
    if not (run and run.get("time_to_target_s") and ddp.get("time_to_target_s")):
        return "-"
    return f"{run['time_to_target_s'] / ddp['time_to_target_s']:.2f}"


def _by_setting(runs: list[dict]):
    """Each setting of a benchmark's runs, in order, with its runs by (method, accumulation), paced runs under
    "paced" whatever name their file gives them."""
    for setting in dict.fromkeys(r["setting"] for r in runs):
        same = (r for r in runs if r["setting"] == setting)
        yield setting, {(r["method"], accumulation_name(r["accumulation"])): r for r in same}


def benchmark_table(path: str = "benchmark/benchmark.json") -> str:
    """The headline benchmark's ratios per setting (``python -m hf_acco.bench``; definitions: bench/report.py)."""
    runs = _load(path)["runs"]
    rows = [
        "| setting | link | comm / compute | acco / sync | acco / DDP | acco overlap efficiency "
        "| compute of a step (s) | acco's compute in run / alone | time to target / DDP: acco fixed, acco paced |",
        "|---|---|---:|---:|---:|---:|---:|---:|---|",
    ]
    for setting, by in _by_setting(runs):
        acco, sync, ddp = by[("acco", "fixed")], by[("sync", "fixed")], by[("ddp", "fixed")]
        link = "unshaped loopback" if acco["link_mbit"] is None else f"{acco['link_mbit']:.0f} Mbit/s"
        if acco["slow_factor"] != 1:
            link += f", rank 1 {acco['slow_factor']:g}x slower"
        # unshaped loopback: almost nothing to hide, the efficiency is noise
        shaped = acco["link_mbit"] is not None and acco["overlap_efficiency"] is not None
        eff = f"{acco['overlap_efficiency']:.2f}" if shaped else "-"

        paced = by.get(("acco", "paced"))
        rows.append(
            f"| {setting} | {link} | {acco['comm_over_compute_measured']:.2f} | "
            f"{acco['step_time_s'] / sync['step_time_s']:.2f} | {acco['step_time_s'] / ddp['step_time_s']:.2f} "
            f"| {eff} | {acco['t_compute_s']:.3f} | {acco['compute_slowdown']:.2f} "
            f"| {_to_target(acco, ddp)}, {_to_target(paced, ddp)} |"
        )
    return "\n".join(rows) + "\n"


def methods_table(*paths: str, baseline: str = "ddp") -> str:
    """Every method of the shaped settings of these benchmark.json files: step, bytes, time to target, each
    against the ``baseline`` method's (DDP's) in the same setting."""
    label = "DDP" if baseline == "ddp" else baseline
    rows = [
        f"| setting | method | step (s) | step / {label}'s | MB per step per rank | time to target / {label}'s |",
        "|---|---|---:|---:|---:|---:|",
    ]
    for path in paths:
        runs = [r for r in _load(path)["runs"] if r["setting"] != "loopback"]
        for r in runs:
            ddp = next(d for d in runs if d["setting"] == r["setting"] and d["method"] == baseline)
            name = method_label(r["method"], r["accumulation"])
            rows.append(
                f"| {r['setting']} ({r['link_mbit']:.0f} Mbit/s) | {name} | {r['step_time_s']:.3f} | "
                f"{r['step_time_s'] / ddp['step_time_s']:.2f} | {r['bytes_per_step'] / 1e6:.1f} | "
                f"{_to_target(r, ddp)} |"
            )
    return "\n".join(rows) + "\n"


def scaling_table() -> str:
    """``python -m hf_acco.tools.bench.scaling``: measured median step and the planner's prediction per method."""
    runs = [r for r in _load("scaling/benchmark.json")["runs"] if not r["setting"].startswith("check")]
    names = [("acco", "fixed"), ("acco", "paced"), ("sync", "fixed"), ("ddp", "fixed")]
    rows = [
        "| ranks (emulated) | round alone (s) | acco fixed: step / predicted | acco paced | sync (ZeRO-1) | DDP "
        "| acco fixed / sync |",
        "|---|---:|---|---|---|---|---:|",
    ]
    for _, by in _by_setting(runs):
        first = by[("acco", "fixed")]
        label = f"{first['world_size']}" + (
            f", rank 1 {first['slow_factor']:g}x slower" if first["slow_factor"] != 1 else ""
        )
        cells = [
            f"{by[k]['step_time_s']:.3f} / {by[k]['predicted_step_time_s']:.3f} "
            f"({by[k]['predicted_step_time_s'] / by[k]['step_time_s'] - 1:+.0%})"
            for k in names
        ]
        ratio = first["step_time_s"] / by[("sync", "fixed")]["step_time_s"]
        rows.append(f"| {label} | {first['round_alone_s']:.3f} | " + " | ".join(cells) + f" | {ratio:.2f} |")
    return "\n".join(rows) + "\n"


def engine_bytes() -> str:
    """``python benchmarks/engine.py bytes``: bytes on the wire of one round's collectives on gloo (2 ranks)."""
    rows = {r["spelling"]: r for r in _rows(json.loads((RESULTS / "engine" / "bytes.json").read_text()))}
    names = {
        "all_to_all": "all-to-all reduce-scatter + all-gather (hf_acco on gloo)",
        "native": "native reduce-scatter + all-gather",
        "all_reduce": "one all-reduce (reference)",
    }
    out = [
        "| collectives of one round | buffer (MB) | on the wire, both ranks (MB) | vs one all-reduce |",
        "|---|---:|---:|---:|",
    ]
    for key, name in names.items():
        r = rows[key]
        ratio = r["wire_bytes_all_ranks"] / rows["all_reduce"]["wire_bytes_all_ranks"]
        out.append(
            f"| {name} | {r['buffer_bytes'] / 1e6:.1f} | {r['wire_bytes_all_ranks'] / 1e6:.1f} | {ratio:.2f}x |"
        )
    return "\n".join(out) + "\n"


def round_cpu_table(commits: tuple[str, ...] = ("ff2df1a", "1d4c8e9", "d0dff54")) -> str:
    """``python benchmarks/round_cpu.py`` on several commits' code: a round's CPU by component (ms, 2 gloo ranks),
    the round's own thread and all the rank's threads."""
    runs = [json.loads((RESULTS / "engine" / "round_cpu" / f"{c}.json").read_text()) for c in commits]
    out = ["| component of one round | " + " | ".join(f"{c}: its thread | all threads" for c in commits) + " |"]
    out.append("|---|" + "---:|---:|" * len(commits))
    for label in runs[0]["components"]:
        cells = [
            f"{r['components'][label]['thread_ms']:.2f} | {r['components'][label]['process_ms']:.2f}" for r in runs
        ]
        out.append(f"| {label} | " + " | ".join(cells) + " |")
    return "\n".join(out) + "\n"


# the engine's commits from the benchmark's reference code to the point-to-point all-gather, in order
ROUND_CPU_COMMITS = ("ff2df1a", "7cbd056", "31b3368", "e6eab23", "722ac54", "96de51e", "1d4c8e9", "d0dff54")


def round_cpu_by_commit() -> str:
    """``python benchmarks/round_cpu.py`` on each of ``ROUND_CPU_COMMITS``: the estimate and the whole round."""
    out = ["| code | AdamW estimate, its thread (ms) | whole round, all threads (ms) |", "|---|---:|---:|"]
    for commit in ROUND_CPU_COMMITS:
        parts = json.loads((RESULTS / "engine" / "round_cpu" / f"{commit}.json").read_text())["components"]
        estimate, whole = parts["AdamW estimate (estimate rounds)"]["thread_ms"], parts["whole round"]["process_ms"]
        out.append(f"| {commit} | {estimate:.2f} | {whole:.2f} |")
    return "\n".join(out) + "\n"


def wakeups_table(day: str = "2026-12-03") -> str:
    """``python benchmarks/wakeups.py``: a micro-batch beside a thread that wakes every period, on 2 processes."""
    run = json.loads((RESULTS / "engine" / "wakeups" / f"{day}.json").read_text())
    head = "| a thread beside it wakes every | micro-batch wall (ms) | its CPU (ms) | wakeups per micro-batch |"
    out = [head + " cost of one wakeup (us) |", "|---|---:|---:|---:|---:|"]
    for row in run["settings"]:
        period = f"{row['period_ms']:.1f} ms" if row["period_ms"] else "(no such thread)"
        cost = "" if row["cost_per_wakeup_ms"] is None else f"{1e3 * row['cost_per_wakeup_ms']:.0f}"
        out.append(f"| {period} | {row['wall_ms']:.1f} | {row['cpu_ms']:.1f} | {row['wakeups']:.1f} | {cost} |")
    return "\n".join(out) + "\n"


def _rows(payload: dict | list) -> list:
    """A result file's rows: ``{"command": ..., "rows": [...]}`` (benchmarks/engine.py)."""
    return payload["rows"] if isinstance(payload, dict) else payload


def lifecycle_table() -> str:
    """``python benchmarks/engine.py lifecycle``: peak RSS per rank after each phase (MB)."""
    runs = _rows(json.loads((RESULTS / "lifecycle" / "lifecycle.json").read_text()))
    rows = ["| ranks | rank | peak RSS after each phase (MB) |", "|---:|---:|---|"]
    for r in runs:
        phases = ", ".join(f"{phase} {rss / 1e6:,.0f}" for phase, rss in r["peak_rss_bytes"].items())
        rows.append(f"| {r['world_size']} | {r['rank']} | {phases} |")
    return "\n".join(rows) + "\n"


def main_job(folder: str = "main_job") -> str:
    """The main job's committed run (``recipes/results/main_job/result.json``, written by its command; main_job_trl:
    the same job through TRL's SFTTrainer)."""
    run = _load(f"{folder}/result.json")
    m = run["metrics"]
    return (
        f"Measured ({run['machine']}, `{run['command']}`): held-out exact match {m['exact_match_before']:.3f} -> "
        f"{m['exact_match_after']:.3f}, held-out loss {m['heldout_loss_before']:.3f} -> {m['heldout_loss']:.3f}, "
        f"{m['steps']} steps in {m['train_seconds']:.0f} s. On another processor the CPU kernels round differently "
        "and the trajectory moves: expect figures near these, not equal.\n"
    )


def _gb(n: float) -> str:
    return f"{n / 1e9:.2f}" if n < 10e9 else f"{n / 1e9:.1f}"


def memory_table() -> str:
    """``hf_acco.tools.memory`` for bf16 models on 8 ranks (NCCL, fused AdamW): GB per rank on the GPU, activations not
    counted; the baselines with fp32 gradient accumulation and Adam."""
    import torch

    from hf_acco.tools.memory import GIB, baselines, engine_memory

    models = (("125M", 125e6), ("1.3B", 1.3e9), ("2.7B", 2.7e9), ("7B", 7e9), ("Llama-2-7B (6.74B)", 6.74e9))
    # (wire dtype, accumulation dtype): the default (the model's, fp32), fp32 on the wire, bf16 both
    wires = (("auto", torch.float32), (torch.float32, torch.float32), (torch.bfloat16, torch.bfloat16))
    rows = [
        "| model (bf16), 8 ranks | DDP | ZeRO-1 | ZeRO-2 | hf_acco, default (bf16 wire): persistent / peak "
        "| fp32 wire "
        "| bf16 wire + bf16 accumulation | host pinned per rank (GiB) |",
        "|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for name, params in models:
        numel = int(params)
        base = baselines(numel, 8, torch.bfloat16)
        reports = [engine_memory(numel, 8, param_dtype=torch.bfloat16, comm_dtype=c, grad_dtype=g) for c, g in wires]
        cells = [_gb(base[k]) for k in ("DDP", "ZeRO-1", "ZeRO-2")]
        cells += [f"{_gb(r.persistent_bytes)} / {_gb(r.peak_bytes)}" for r in reports]
        rows.append(f"| {name} | " + " | ".join(cells) + f" | {reports[0].host_bytes / GIB:.2f} |")
    return "\n".join(rows) + "\n"


def bf16_wire_table() -> str:
    """``recipes/pretrain_clm.py`` with bf16 against fp32 on the wire (and sync's bf16 against DDP's bf16 hook),
    seed 0: final validation loss and the largest gap over the evaluations."""
    runs = {name: _load(f"convergence/bf16_wire/{name}_seed0.json") for name in ("acco_fp32", "acco_bf16")}
    runs.update({name: _load(f"convergence/bf16_wire/{name}_seed0.json") for name in ("ddp_bf16", "sync_bf16")})
    rows = [
        "| run | against | final validation loss | gap | largest gap over the evaluations |",
        "|---|---|---:|---:|---:|",
    ]
    for run, base in (("acco_bf16", "acco_fp32"), ("sync_bf16", "ddp_bf16")):
        a, b = runs[run], runs[base]
        assert a["eval_steps"] == b["eval_steps"], (run, base)
        gaps = [abs(x / y - 1) for x, y in zip(a["val_losses"], b["val_losses"])]
        rows.append(
            f"| {run} | {base} | {a['final_val_loss']:.4f} / {b['final_val_loss']:.4f} | "
            f"{a['final_val_loss'] / b['final_val_loss'] - 1:+.3%} | {max(gaps):.3%} |"
        )
    return "\n".join(rows) + "\n"


def quantised_wire_table(folder: str = "convergence/int8_wire") -> str:
    """``recipes/convergence_study.py --methods acco-int8 acco-int8+ef`` (or ``acco-int8-int4 ...``, in another
    ``folder``): quantised gradients and parameter changes, with and without error feedback, against the study's
    ``acco`` (fp32 on the wire) seed by seed: final validation loss, its gap (of the seed means), the largest gap at
    any evaluation (of the seed-mean curves, and of any one seed); and the study's ``acco`` seed 0 rerun beside the
    committed one (the same command on this code), where the folder holds one."""
    study_runs = _load("convergence/convergence.json")["runs"]  # (and the Alpaca chain's, without a val loss)
    fp32 = {r["seed"]: r for r in study_runs if r["method"] == "acco" and "final_val_loss" in r}
    study = _load(f"{folder}/convergence.json")["runs"]
    rows = [
        "| method | seeds | final val loss (per seed) | mean | gap to acco, fp32 wire | max gap, seed means | "
        "max gap, any seed |",
        "|---|---|---|---:|---:|---:|---:|",
    ]
    mean = lambda xs: sum(xs) / len(xs)  # noqa: E731
    for method in dict.fromkeys(r["method"] for r in study):
        runs = sorted((r for r in study if r["method"] == method), key=lambda r: r["seed"])
        bases = [fp32[r["seed"]] for r in runs]
        assert all(r["eval_steps"] == b["eval_steps"] for r, b in zip(runs, bases)), method
        curves = [mean(vs) for vs in zip(*(r["val_losses"] for r in runs))]
        base_curve = [mean(vs) for vs in zip(*(b["val_losses"] for b in bases))]
        any_seed = max(abs(x / y - 1) for r, b in zip(runs, bases) for x, y in zip(r["val_losses"], b["val_losses"]))
        final, base = mean([r["final_val_loss"] for r in runs]), mean([b["final_val_loss"] for b in bases])
        seeds = ", ".join(f"{r['final_val_loss']:.4f}" for r in runs)
        rows.append(
            f"| {method} | {len(runs)} | {seeds} | {final:.4f} | "
            f"{final / base - 1:+.2%} | {max(abs(x / y - 1) for x, y in zip(curves, base_curve)):.2%} | "
            f"{any_seed:.2%} |"
        )
    if not (RESULTS / folder / "acco_fp32_seed0_rerun.json").is_file():
        return "\n".join(rows) + "\n"
    rerun = _load(f"{folder}/acco_fp32_seed0_rerun.json")
    rows.append(
        f"\nThe study's `acco` seed 0 rerun on this code: final validation loss {rerun['final_val_loss']:.4f} "
        f"(committed: {fp32[0]['final_val_loss']:.4f})."
    )
    return "\n".join(rows) + "\n"


RENDERERS: dict[str, Callable[[], str]] = {
    "benchmark": benchmark_table,
    "benchmark-rerun": lambda: benchmark_table("benchmark/rerun_2026-12-02/benchmark.json"),
    "benchmark-rerun-12-03": lambda: benchmark_table("benchmark/rerun_2026-12-03/benchmark.json"),
    "benchmark-rerun-12-03-full": lambda: benchmark_table("benchmark/rerun_2026-12-03_full/benchmark.json"),
    "benchmark-batch16": lambda: benchmark_table("benchmark/batch16/benchmark.json"),
    "benchmark-heterogeneous": lambda: methods_table(
        "benchmark/heterogeneous/slow2x_ratio0.5/benchmark.json",
        "benchmark/heterogeneous/slow2x_ratio1/benchmark.json",
    ),
    "benchmark-bf16": lambda: methods_table("benchmark/bf16_wire/benchmark.json"),
    "benchmark-int8": lambda: methods_table("benchmark/int8_wire/benchmark.json", baseline="ddp-bf16"),
    "benchmark-int8-emulated": lambda: methods_table(
        "benchmark/int8_wire_emulated/benchmark.json", baseline="ddp-bf16"
    ),
    "scaling": scaling_table,
    "options": options_table,
    "planner-examples": planner_examples,
    "multinode": multinode_table,
    "memory": memory_table,
    "main-job": main_job,
    "main-job-trl": lambda: main_job("main_job_trl"),
    "engine-bytes": engine_bytes,
    "round-cpu": round_cpu_table,
    "round-cpu-by-commit": round_cpu_by_commit,
    "wakeups": wakeups_table,
    "bench-ab-ff2df1a": results_docs.bench_ab_table,
    "bench-ab-ff2df1a-final": lambda: results_docs.bench_ab_table("ff2df1a_vs_8966971"),
    "bench-ab-gloo-all-gather": lambda: results_docs.bench_ab_table("691166d_vs_cdb2a70"),
    "bench-ab-untouched": lambda: results_docs.bench_ab_table("83f0941_vs_824f643"),
    "bench-ab-moments-in-place": lambda: results_docs.bench_ab_table("824f643_vs_a0158e0"),
    "bench-ab-lazy-zero": lambda: results_docs.bench_ab_table("0abc56d_vs_81a160a"),
    "bench-ab-fsdp-engine": lambda: results_docs.bench_ab_table("b73aaa4_vs_6182267"),
    "bench-ab-packed-round": lambda: results_docs.bench_ab_table("e753052_vs_b6b86a4"),
    "bench-ab-off-the-main-stream": lambda: results_docs.bench_ab_table("e08c78f_vs_0c8c23c"),
    "bench-ab-fsdp-on-cuda": lambda: results_docs.bench_ab_table("408794f_vs_284794d"),
    "bench-ab-fsdp-on-cuda-final": lambda: results_docs.bench_ab_table("408794f_vs_e62cbd1"),
    "bench-ab-voted-commit": lambda: results_docs.bench_ab_table("c5966a9_vs_6f83d24-dirty"),
    "bench-ab-vote-review": lambda: results_docs.bench_ab_table("3748a3b_vs_65dbcb5"),
    "bench-ab-gloo-all-gather-first": lambda: results_docs.bench_ab_table("691166d_vs_691166d-dirty"),
    "beside-bisect": lambda: results_docs.beside_table(
        "bisect_2026-12-03", ("e6e92b3", "d0dff54", "adbff10", "02600b4")
    ),
    "beside-landing": lambda: results_docs.beside_table("landing_2026-12-03", ("691166d", "cdb2a70")),
    "lifecycle": lifecycle_table,
    "gpu-status": results_docs.gpu_status,
    "tested-versions": results_docs.tested_versions,
    "gpu-check": results_docs.gpu_check_table,
    "engine-traffic": results_docs.traffic_table,
    "hsdp-memory": results_docs.hsdp_memory_table,
    "hsdp-fits": results_docs.hsdp_fits_table,
    "hsdp-70b": results_docs.hsdp_70b_table,
    "hsdp-bench": results_docs.hsdp_bench_table,
    "packed-round-cpu": results_docs.packed_round_table,
    # tables the study commands wrote beside their results, as they are
    "convergence": lambda: (RESULTS / "convergence" / "table.md").read_text(),
    "heterogeneous-study": lambda: (RESULTS / "heterogeneous" / "table.md").read_text(),
    "heterogeneous-trainer": lambda: (RESULTS / "heterogeneous_trainer" / "table.md").read_text(),
    "bf16-wire-convergence": lambda: bf16_wire_table(),
    "int8-wire-convergence": quantised_wire_table,
    "int4-wire-convergence": lambda: quantised_wire_table("convergence/int4_wire"),
}


def documents() -> list[Path]:
    return [ROOT / "README.md", ROOT / "recipes" / "README.md", *sorted((ROOT / "docs").glob("*.md"))]


def render(text: str, where: str = "") -> str:
    """``text`` with every rendered block rendered anew."""

    def fill(match: re.Match) -> str:
        name = match.group(2)
        if name not in RENDERERS:
            raise ValueError(f"{where}: unknown rendered block {name!r}; known: {', '.join(RENDERERS)}")
        return match.group(1) + RENDERERS[name]().rstrip("\n") + "\n" + match.group(4)

    return BLOCK.sub(fill, text)


def stale() -> list[str]:
    """``file: block`` of every rendered block that differs from what it renders now."""
    out = []
    for path in documents():
        text = path.read_text()
        fresh = render(text, path.name)
        if fresh != text:
            old = {m.group(2): m.group(3) for m in BLOCK.finditer(text)}
            new = {m.group(2): m.group(3) for m in BLOCK.finditer(fresh)}
            out += [f"{path.relative_to(ROOT)}: {name}" for name in old if old[name] != new.get(name)]
    return out


def make_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m hf_acco.tools.docs", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--check", action="store_true", help="change nothing; exit 1 if a block is stale")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = make_parser().parse_args(argv)
    if args.check:
        names = stale()
        for name in names:
            print(f"stale: {name} (rerun `python -m hf_acco.tools.docs`)")
        return 1 if names else 0
    for path in documents():
        text = path.read_text()
        fresh = render(text, path.name)
        if fresh != text:
            path.write_text(fresh)
            print(f"rendered {path.relative_to(ROOT)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
