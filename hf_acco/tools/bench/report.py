"""The benchmark's statistics and report: pure Python over the ranks' raw logs (tested on synthetic timings).

Definitions (per method and setting; times in seconds, per optimizer step unless said otherwise):
- ``step_time_s``: median interval between two optimizer steps on rank 0, start-up steps left out.
- ``t_compute_s``: the same micro-batches with no communication at all, measured alone in the same processes
  (the slowest rank's; it includes a slowed rank's extra time). Dynamic mode: its mean micro-batches per step.
- ``t_comm_s``: the method's collectives per step measured alone (no compute) on the same link: one round for
  sync and dpu, two for acco, one all-reduce of the gradients for DDP.
- ``exposed_comm_s``: median time the main thread waited for communication in a step (ACCO's engine measures
  its wait; for DDP, whose all-reduce runs inside backward, ``step_time_s - t_compute_s``).
- ``overlap_efficiency``: ``(t_compute + t_comm - step_time) / t_comm``; 1 hides all communication, 0 none;
  not given (``None``) where communication is under 5 % of compute (unshaped loopback).
- ``limit_s``: the physical limit ``max(t_compute, t_wire)``, ``t_wire`` = bytes each rank sends per step over
  the link rate (``t_compute`` alone when the link is not shaped).
- ``peak_mem_bytes``: peak resident memory of the process during the run (the peak is reset before each run);
  ``run_mem_bytes``: that peak minus what the process held just before the run.
- ``compute_slowdown``: a micro-batch's forward + backward while training over the same alone (median over
  the run, the larger of the ranks'): above 1 where the run's own communication (gloo's threads, the kernel's
  network work, the round's optimizer update) takes CPU from compute on the same cores.
- ``cpu_per_wall``: CPU seconds of each rank's process (all threads) over the run's wall-clock.
- ``time_to_target_s``: first time the training loss, averaged over a sliding window of the latest micro-batches
  of all ranks, is at or below the target; ``None`` when never.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Sequence
from typing import Any

from hf_acco.tools.plan.model import PACED

WARMUP_STEPS = 2  # steps left out of medians: start-up (first rounds, allocator, caches)


def accumulation_name(accumulation: str) -> str:
    """A run's accumulation by its one name: result files written before paced had it say "dynamic" for ACCOTrainer's
    paced accumulation (the engine's own dynamic mode is not benchmarked)."""
    return "paced" if accumulation in PACED else accumulation


def method_label(method: str, accumulation: str) -> str:
    """A run's name in tables and plots: its method, with "paced" for paced accumulation."""
    return method + (" paced" if accumulation_name(accumulation) == "paced" else "")


def paced_name(method: str) -> str:
    """An argparse ``type`` for ``method:accumulation``: the old name ``:dynamic`` taken as ``:paced``."""
    return method[: -len(":dynamic")] + ":paced" if method.endswith(":dynamic") else method


def step_intervals(step_ends: Sequence[float], skip: int = WARMUP_STEPS) -> list[float]:
    """Intervals between consecutive step ends, without the first ``skip`` steps."""
    ends = list(step_ends)[skip:]
    return [b - a for a, b in zip(ends, ends[1:])]


def median_or_none(values: Sequence[float]) -> float | None:
    return statistics.median(values) if values else None


NEGLIGIBLE_COMM = 0.05  # communication under 5 % of compute: nothing worth hiding, the ratio would be noise


def overlap_efficiency(t_compute: float, t_comm: float, t_step: float) -> float | None:
    """(T_compute + T_comm - T_step) / T_comm: the share of the communication time that compute hid.

    ``None`` when the communication is negligible (under 5 % of the compute): the ratio would divide noise."""
    if t_comm <= NEGLIGIBLE_COMM * t_compute:
        return None
    return (t_compute + t_comm - t_step) / t_comm


def merged_loss_curve(
    ranks: Sequence[Sequence[tuple[float, float, int]]], window: int
) -> list[tuple[float, int, float]]:
    """Merge the ranks' micro-batch records ``(seconds since start, loss, tokens)`` in time order.

    Returns ``(time, tokens so far over all ranks, mean loss of the latest `window` micro-batches)`` from the
    point where a whole window exists.
    """
    if window < 1:
        raise ValueError("window must be at least 1")
    records = sorted((t, loss, tok) for rank in ranks for t, loss, tok in rank)
    out, tokens, recent = [], 0, []
    for t, loss, tok in records:
        tokens += tok
        recent.append(loss)
        if len(recent) > window:
            recent.pop(0)
        if len(recent) == window:
            out.append((t, tokens, sum(recent) / window))
    return out


def time_to_target(curve: Sequence[tuple[float, int, float]], target: float) -> tuple[float, int] | None:
    """First (time, tokens) at which the smoothed loss is at or below ``target``."""
    for t, tokens, loss in curve:
        if loss <= target:
            return t, tokens
    return None


def loss_at_fraction(curve: Sequence[tuple[float, int, float]], fraction: float) -> float:
    """The smoothed loss after ``fraction`` of the run's tokens."""
    if not curve:
        raise ValueError("empty loss curve")
    limit = fraction * curve[-1][1]
    return next(loss for _, tokens, loss in curve if tokens >= limit)


def summarise_run(
    run: Sequence[dict[str, Any]],
    *,
    t_comm: float,
    link_mbit: float | None,
    window: int,
) -> dict[str, Any]:
    """One method's run in one setting from every rank's log (rank 0 first).

    Each rank log holds ``step_ends`` (seconds since the run's start), ``waits`` (main-thread wait per step),
    ``micro_batches`` (this rank's per step), ``records`` ((time, loss, tokens) per micro-batch), ``tx_bytes``
    (sent by this rank over the run), ``peak_mem_bytes`` and ``t_micro`` (one micro-batch, compute alone).
    """
    r0 = run[0]
    steps = len(r0["step_ends"])
    peaks, before = [r["peak_mem_bytes"] for r in run], [r.get("resident_before_bytes", 0) for r in run]
    t_step = median_or_none(step_intervals(r0["step_ends"]))
    # compute per step: the slowest rank's micro-batches at its compute-alone speed
    per_rank_compute = [
        statistics.mean(r["micro_batches"][WARMUP_STEPS:] or r["micro_batches"]) * r["t_micro"] for r in run
    ]
    t_compute = max(per_rank_compute)
    if method_parts(r0["method"])[0] in ("ddp", "hsdp"):  # no engine: what the step takes beyond its compute
        exposed = None if t_step is None else max(0.0, t_step - t_compute)
    else:
        exposed = median_or_none(r0["waits"][WARMUP_STEPS:])
    bytes_per_step = None
    if all(r.get("tx_bytes") is not None for r in run):
        bytes_per_step = max(r["tx_bytes"] for r in run) / max(steps, 1)
    across = [r["across_tx_bytes"] for r in run if r.get("across_tx_bytes") is not None]  # its node's, its share
    across_per_step = max(across) / max(steps, 1) if len(across) == len(run) else None
    t_wire = None if link_mbit is None or bytes_per_step is None else bytes_per_step * 8 / (link_mbit * 1e6)
    tokens = sum(sum(rec[2] for rec in r["records"]) for r in run)
    duration = max(r["step_ends"][-1] for r in run) if steps else None
    timed_tokens = sum(
        sum(tok for t, _, tok in r["records"] if t > r0["step_ends"][WARMUP_STEPS - 1]) for r in run
    ) if steps > WARMUP_STEPS else 0  # fmt: skip
    timed_seconds = r0["step_ends"][-1] - r0["step_ends"][WARMUP_STEPS - 1] if steps > WARMUP_STEPS else None
    in_run = [  # after the start-up steps' micro-batches
        median_or_none(r.get("micro_batch_compute_s", [])[sum(r["micro_batches"][:WARMUP_STEPS]) :]) for r in run
    ]
    slowdown = [c / r["t_base"] for c, r in zip(in_run, run) if c is not None and r.get("t_base")]
    return {
        "method": r0["method"],
        "accumulation": r0["accumulation"],
        "steps": steps,
        "step_time_s": t_step,
        "t_compute_s": t_compute,
        "t_comm_s": t_comm,
        "exposed_comm_s": exposed,
        "overlap_efficiency": None if t_step is None else overlap_efficiency(t_compute, t_comm, t_step),
        "t_wire_s": t_wire,
        "limit_s": t_compute if t_wire is None else max(t_compute, t_wire),
        "bytes_per_step": bytes_per_step,
        "across_bytes_per_step": across_per_step,
        "tokens": tokens,
        "tokens_per_s": timed_tokens / timed_seconds if timed_seconds else None,
        "duration_s": duration,
        "micro_batches_per_step": [statistics.mean(r["micro_batches"]) for r in run],
        "compute_slowdown": max(slowdown) if slowdown else None,
        "cpu_per_wall": [r["cpu_s"] / r["wall_s"] if r.get("wall_s") else None for r in run],
        "peak_mem_bytes": None if None in peaks else max(peaks),
        # what the run itself added at its peak, over what the process held before it (fewer leftovers)
        "run_mem_bytes": None if None in peaks + before else max(p - b for p, b in zip(peaks, before)),
        "loss_curve": merged_loss_curve([r["records"] for r in run], window),
    }


def combine_repeats(summaries: Sequence[dict[str, Any]], target: float | None) -> dict[str, Any]:
    """Repetitions of one method in one setting: medians of the per-repetition figures, the time to target."""

    def med(key: str) -> float | None:
        values = [s[key] for s in summaries if s[key] is not None]
        return statistics.median(values) if values else None

    hits = [time_to_target(s["loss_curve"], target) for s in summaries] if target is not None else []
    times = [h[0] for h in hits if h is not None]
    first = summaries[0]
    out = {
        "method": first["method"],
        "accumulation": first["accumulation"],
        "repeats": len(summaries),
        "steps": first["steps"],
    }
    for key in ("step_time_s", "t_compute_s", "t_comm_s", "exposed_comm_s", "overlap_efficiency", "t_wire_s",
                "limit_s", "bytes_per_step", "tokens_per_s", "peak_mem_bytes", "run_mem_bytes",
                "compute_slowdown"):  # fmt: skip
        out[key] = med(key)
    out["step_time_s_all"] = [s["step_time_s"] for s in summaries]
    out["cpu_per_wall"] = [s.get("cpu_per_wall") for s in summaries]  # per repetition, per rank
    out["micro_batches_per_step"] = [s.get("micro_batches_per_step") for s in summaries]  # per repetition, per rank
    out["target_loss"] = target
    # the median over repetitions; a repetition that never reached the target counts as infinitely slow
    out["time_to_target_s"] = statistics.median([h[0] if h is not None else math.inf for h in hits]) if hits else None
    if out["time_to_target_s"] == math.inf:
        out["time_to_target_s"] = None
    out["reached_target"] = f"{len(times)}/{len(hits)}"
    out["final_loss"] = statistics.median(s["loss_curve"][-1][2] for s in summaries if s["loss_curve"])
    out["loss_curve"] = first["loss_curve"]
    return out


def default_target(ddp_summaries: Sequence[dict[str, Any]], fraction: float = 0.75) -> float:
    """Target loss: Trainer-DDP's smoothed training loss after ``fraction`` of its tokens (median of repeats)."""
    return statistics.median(loss_at_fraction(s["loss_curve"], fraction) for s in ddp_summaries)


def _fmt(x: Any, spec: str = ".3f") -> str:
    if x is None:
        return "-"
    return format(x, spec)


def _ratio_cell(r: dict[str, Any]) -> str:
    """Communication over compute: the setting's nominal ratio (measured alone in the run, in brackets)."""
    nominal, measured = r.get("comm_over_compute"), r.get("comm_over_compute_measured")
    if nominal is None:
        return _fmt(measured, ".2f")
    return f"{nominal:.2f}" + ("" if measured is None else f" ({measured:.2f})")


def _memory(r: dict[str, Any]) -> str:
    if r["peak_mem_bytes"] is None:
        return "-"
    run = "" if r.get("run_mem_bytes") is None else f" ({r['run_mem_bytes'] / 2**20:.0f})"
    return f"{r['peak_mem_bytes'] / 2**20:.0f}{run}"


def markdown_table(runs: Sequence[dict[str, Any]]) -> str:
    """One row per method and setting, with its ratios to sync and to Trainer-DDP of the same setting."""
    header = (
        "| link (Mbit/s) | comm/compute (measured) | slow | method | step (s) | / sync | / DDP | limit (s) | "
        "T_compute (s) | T_comm (s) | exposed (s) | overlap eff. | compute in run / alone | tokens/s | MB/step | "
        "time to target (s) | / DDP | peak MB (run) |\n"
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"
    )
    rows = [header]
    for r in runs:
        same = [o for o in runs if o["setting"] == r["setting"]]
        sync = next((o for o in same if o["method"] == "sync"), None)
        ddp = next((o for o in same if o["method"] == "ddp"), None)

        def ratio(other: dict[str, Any] | None, key: str, r: dict[str, Any] = r) -> str:
            if other is None or r[key] is None or not other[key]:
                return "-"
            return f"{r[key] / other[key]:.2f}"

        name = method_label(r["method"], r["accumulation"])
        link = "loopback" if r["link_mbit"] is None else f"{r['link_mbit']:.0f}"
        if r.get("world_size", 2) != 2:
            link += f", {r['world_size']} ranks"
        if r.get("emulated"):  # GPU-like compute (worker.Emulation): never mistaken for a real-compute figure
            link += " (emulated)"
        cells = [link, _ratio_cell(r), f"{r['slow_factor']:g}x", name,
                 _fmt(r["step_time_s"]), ratio(sync, "step_time_s"), ratio(ddp, "step_time_s"), _fmt(r["limit_s"]),
                 _fmt(r["t_compute_s"]), _fmt(r["t_comm_s"]), _fmt(r["exposed_comm_s"]),
                 _fmt(r["overlap_efficiency"], ".2f"), _fmt(r.get("compute_slowdown"), ".2f"),
                 _fmt(r["tokens_per_s"], ".0f"),
                 _fmt(None if r["bytes_per_step"] is None else r["bytes_per_step"] / 1e6, ".1f"),
                 _fmt(r["time_to_target_s"], ".1f"), ratio(ddp, "time_to_target_s"),
                 _memory(r)]  # fmt: skip
        rows.append("| " + " | ".join(cells) + " |")
    return "\n".join(rows) + "\n"


def method_parts(method: str) -> tuple[str, str]:
    """("acco", "bf16") for "acco-bf16": the method and its gradients' dtype on the wire (fp32 when unnamed)."""
    base, _, wire = method.partition("-")
    return base, wire.partition("-")[0] or "fp32"


def gather_of(method: str) -> str:
    """The parameters' gather_dtype: "int8" for "acco-int8" (its changes in int8 too), "int4" for "acco-int8-int4"
    (int8 gradients, int4 changes), "auto" (the model's dtype) otherwise."""
    wire, _, changes = method.partition("-")[2].partition("-")
    return changes or ("int8" if wire == "int8" else "auto")
