"""Will ACCO help on my cluster? An alpha-beta cost model of one optimizer step for DDP, ZeRO-1 and ACCO.

    python -m hf_acco.plan --params 1.3e9 --world_size 32 --gpus_per_node 8 --intra_gbit 2400 --inter_gbit 100 \\
        --micro_batch_s 0.32 --micro_batches 8

prints the predicted step time, tokens/s and exposed communication of DDP (as Trainer runs it), ZeRO-1 and ACCO
(fixed and dynamic accumulation), the settings it recommends, and the formulas below. Standard library only.

**Collectives** (``B`` bytes, ``p`` ranks, link ``bw`` bytes/s, ``alpha`` s per step of a ring)::

    ring(B, p, bw) = (p - 1) * alpha + (p - 1) / p * B / (efficiency * bw)       # reduce-scatter or all-gather
    all-reduce = reduce-scatter + all-gather

``efficiency`` is the share of the link rate a collective achieves (framing, protocol, gaps), fitted per kind
(``round``: ACCO/ZeRO-1's reduce-scatter + all-gather; ``all_reduce``: DDP's). On ``n`` nodes of ``g`` GPUs
(ranks numbered node by node, as launchers do) the collectives run over all ``p`` ranks at once, and each of
the two kinds of link carries its share at the same time, so the slower one sets the pace. A ring (NCCL's
reduce-scatter, all-gather and all-reduce; gloo's all-gather and all-reduce) enters and leaves every node once:
every GPU's link inside a node (``intra_gbit`` per GPU) and every node's network (``inter_gbit`` per node, all
its NICs) carry ``(p - 1) / p`` of the bytes. An all-to-all (the engine's reduce-scatter on gloo) sends ``1 / p``
of the bytes from every rank to every other: ``g (p - g) / p`` of them leave a node, ``(g - 1) / p`` stay::

    ring_2(B)       = (p - 1) alpha + max((p - 1)/p B / intra, (p - 1)/p B / inter)  (the first on 1 node only,
    all_to_all_2(B) = (p - 1) alpha + max((g - 1)/p B / intra, g (p - g)/p B / inter)  the second with g = 1)

(both ``= ring(B, p, inter)`` with one GPU per node, and ``ring(B, g, intra)`` on one node). Neither is
hierarchical: NCCL's reduce-scatter and all-gather are rings (its tree, for all-reduce at many nodes, moves
about half a ring's bytes between nodes: DDP is then predicted slower than it is); across 2 nodes a ring moves
almost twice what a two-level collective would (``(n - 1) / n`` of the bytes).

**A step** (``k`` micro-batches per rank, each ``t`` s; ``t_max`` the slowest rank's; ``R = RS + AG`` one
round: the gradients reduce-scattered in the communication dtype, the parameters all-gathered in the model's;
``AR`` DDP's all-reduce of the gradients, in the model's dtype)::

    DDP        k * t_max + exposed(AR)                     + overhead[ddp]     DDP's buckets (1 MiB, then 25 MiB,
                                                                               parameters spread evenly over the
               backward) become ready during the last backward ((1 - forward_share) * t_max) and are all-reduced
               one after another: exposed = when the last one ends - when the backward ends (simulated)
    ZeRO-1     k * t_max + R                               + overhead[sync]    nothing overlaps
    ACCO fixed max(h1 * t_max, R) + max(h2 * t_max, R)     + overhead[acco]    h1 = k // 2, h2 = k - h1: each half
                                                                               overlaps one round
    ACCO dyn.  max(claims(p * k), 2 * R)                   + overhead[acco]    claims(n): the time the ranks take
               to compute n micro-batches together, each claiming the next one as soon as it is free (simulated;
               k * t when all ranks are equally fast): a fast rank goes on into the next half while a slow one
               finishes its last micro-batch

``overhead`` is what a step costs beyond its compute and its collectives alone (the optimizer update, a round's
two small all-reduces, loading parameters, Python). It and the collectives' ``alpha`` and ``efficiency`` are
fitted by :func:`fit` from the benchmark's measurements (``python -m hf_acco.bench.scaling``); :data:`FITTED`
are the committed ones. Where it was held against measured runs, and where it is known to be wrong:
``docs/benchmarks.md``.
"""

from __future__ import annotations

import argparse
import heapq
import json
import math
import statistics
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

METHODS = (("ddp", "fixed"), ("sync", "fixed"), ("acco", "fixed"), ("acco", "dynamic"))
NAMES = {("ddp", "fixed"): "DDP (Trainer)", ("sync", "fixed"): "ZeRO-1", ("acco", "fixed"): "ACCO fixed",
         ("acco", "dynamic"): "ACCO dynamic"}  # fmt: skip
DDP_FIRST_BUCKET_BYTES, DDP_BUCKET_BYTES = 2**20, 25 * 2**20  # DDP's defaults (bucket_cap_mb 25)
NCCL_BUCKET_NUMEL = (1 << 22, 1 << 28)  # the engine's automatic bucket range on NCCL (hf_acco/sharding.py)
# NCCL's latency per ring step on NVLink / InfiniBand is some microseconds (nccl-tests' small-message times);
# the benchmark cannot measure it (gloo over TCP here: its fitted alpha is milliseconds), so it is stated
NCCL_ALPHA_US = 20.0


@dataclass(frozen=True)
class Constants:
    """The model's fitted constants (see the module docstring)."""

    alpha_s: dict[str, float] = field(default_factory=lambda: {"round": 50e-6, "all_reduce": 50e-6})
    efficiency: dict[str, float] = field(default_factory=lambda: {"round": 0.9, "all_reduce": 0.9})
    overhead_s: dict[str, float] = field(default_factory=lambda: {"ddp": 0.0, "sync": 0.0, "acco": 0.0})
    forward_share: float = 1 / 3  # the forward's share of a micro-batch (the backward: 2/3)
    source: str = "defaults"


# Fitted by `python -m hf_acco.bench.scaling` (recipes/results/scaling/constants.json, rounded): gloo over TCP on the
# benchmark's bridge, every rank's link shaped to 200 Mbit/s, 2/4/8 ranks, emulated compute, 2 CPU cores. The
# latencies are below what these points resolve (the fit gives 0): NCCL's is stated instead (NCCL_ALPHA_US,
# --backend nccl). Where the model is known to be wrong: docs/benchmarks.md.
FITTED = Constants(
    alpha_s={"round": 0.0, "all_reduce": 0.0},
    efficiency={"round": 0.888, "all_reduce": 0.983},
    overhead_s={"ddp": 0.000, "sync": 0.000, "acco": 0.000},
    source="fitted on the benchmark (recipes/results/scaling/constants.json)",
)


@dataclass(frozen=True)
class Cluster:
    gpus: int
    gpus_per_node: int
    intra_gbit: float  # per GPU, inside a node (NVLink, PCIe)
    inter_gbit: float  # per node, between nodes (its NICs together)
    backend: str = "nccl"  # the engine's reduce-scatter: a ring on NCCL, an all-to-all on gloo

    @property
    def nodes(self) -> int:
        return math.ceil(self.gpus / self.gpus_per_node)

    @property
    def local(self) -> int:
        return min(self.gpus, self.gpus_per_node)


def ring(nbytes: float, p: int, gbit: float, efficiency: float, alpha_s: float) -> float:
    """One ring reduce-scatter (or all-gather) of ``nbytes`` over ``p`` ranks on links of ``gbit`` Gbit/s."""
    if p <= 1:
        return 0.0
    return (p - 1) * alpha_s + (p - 1) / p * nbytes / (efficiency * gbit * 1e9 / 8)


def collective(nbytes: float, cluster: Cluster, c: Constants, kind: str = "round", spelling: str = "ring") -> float:
    """One reduce-scatter or all-gather of ``nbytes`` over all the cluster's ranks, spelled as a ``"ring"`` or an
    ``"all_to_all"``: the latency of its ``p - 1`` steps, and the bytes on the busier kind of link (inside a node
    per GPU, between nodes per node) over that link's rate (see the module docstring)."""
    p, g = cluster.gpus, cluster.local
    if p <= 1:
        return 0.0
    if spelling == "ring":
        inside, across = (p - 1) / p, (p - 1) / p
    elif spelling == "all_to_all":
        inside, across = (g - 1) / p, g * (p - g) / p
    else:
        raise ValueError(f"spelling must be 'ring' or 'all_to_all', got {spelling!r}")
    rate = lambda gbit: c.efficiency[kind] * gbit * 1e9 / 8  # noqa: E731  (bytes/s)
    wire = max(
        inside * nbytes / rate(cluster.intra_gbit) if g > 1 else 0.0,
        across * nbytes / rate(cluster.inter_gbit) if cluster.nodes > 1 else 0.0,
    )
    return (p - 1) * c.alpha_s[kind] + wire


def round_time(job: Job, cluster: Cluster, c: Constants) -> float:
    """One round: the gradients reduce-scattered (a ring on NCCL, an all-to-all on gloo) in the communication
    dtype, the parameters all-gathered (a ring) in the model's."""
    spelling = "all_to_all" if cluster.backend == "gloo" else "ring"
    return collective(job.params * job.grad_bytes, cluster, c, spelling=spelling) + collective(
        job.params * job.param_bytes, cluster, c
    )


def all_reduce(nbytes: float, cluster: Cluster, c: Constants) -> float:
    """DDP's all-reduce: a ring's reduce-scatter then its all-gather."""
    return 2 * collective(nbytes, cluster, c, "all_reduce")


def ddp_exposed(nbytes: float, backward_s: float, cluster: Cluster, c: Constants) -> float:
    """Seconds DDP's all-reduce runs past the end of the last backward: its buckets, in backward order, are ready
    as the backward reaches their share of the parameters, and are all-reduced one after another."""
    done = finish = 0.0
    while done < nbytes:
        size = min(DDP_FIRST_BUCKET_BYTES if done == 0 else DDP_BUCKET_BYTES, nbytes - done)
        done += size
        ready = backward_s * done / nbytes
        finish = max(finish, ready) + all_reduce(size, cluster, c)
    return max(0.0, finish - backward_s)


def claims_time(times: Sequence[float], micro_batches: int) -> float:
    """Seconds until ``micro_batches`` micro-batches are done when ranks of these per-micro-batch ``times``
    each claim the next one as soon as they are free (dynamic accumulation's claims, simulated)."""
    if micro_batches <= 0:
        return 0.0
    free = [(0.0, i) for i in range(len(times))]
    heapq.heapify(free)
    end = 0.0
    for _ in range(micro_batches):
        t, i = heapq.heappop(free)
        end = max(end, t + times[i])
        heapq.heappush(free, (t + times[i], i))
    return end


@dataclass(frozen=True)
class Job:
    params: float  # trainable parameters
    micro_batch_s: Sequence[float]  # per rank (len 1: all ranks alike)
    micro_batches: int  # per rank per optimizer step (Trainer's gradient_accumulation_steps)
    micro_batch_tokens: int = 16384
    grad_bytes: int = 4  # per element of ACCO / ZeRO-1's reduce-scatter: 4 fp32, 2 bf16 (acco_comm_dtype)
    param_bytes: int = 4  # per element of the all-gather and of DDP's all-reduce: the model's dtype

    def times(self, p: int) -> list[float]:
        t = list(self.micro_batch_s)
        if len(t) not in (1, p):
            raise ValueError(f"micro_batch_s needs one time or one per GPU ({p}), got {len(t)}")
        return t * p if len(t) == 1 else t


def predict(method: str, accumulation: str, job: Job, cluster: Cluster, c: Constants = FITTED) -> dict[str, float]:
    """Predicted seconds per optimizer step, its compute, its communication (all of it, and what compute does not
    hide: ``exposed_s``), the method's step overhead, and tokens/s."""
    p, k = cluster.gpus, job.micro_batches
    times = job.times(p)
    t_max = max(times)
    round_s = round_time(job, cluster, c)
    if method == "ddp":
        nbytes = job.params * job.param_bytes
        compute, comm = k * t_max, all_reduce(nbytes, cluster, c)
        exposed = 0.0 if p == 1 else ddp_exposed(nbytes, (1 - c.forward_share) * t_max, cluster, c)
    elif method == "sync":
        compute, comm = k * t_max, round_s
        exposed = round_s if p > 1 else 0.0
    elif method == "acco":
        comm = 2 * round_s
        if accumulation == "dynamic":  # the step's p * k claims, computed by the ranks together
            compute = claims_time(times, p * k)
            exposed = max(compute, comm) - compute
        else:  # one micro-batch is split along the batch (two halves of t / 2)
            halves = [t_max / 2, t_max / 2] if k == 1 else [k // 2 * t_max, (k - k // 2) * t_max]
            compute = sum(halves)
            exposed = sum(max(h, round_s) for h in halves) - compute
    else:
        raise ValueError(f"method must be ddp, sync or acco, got {method!r}")
    overhead = c.overhead_s.get(method, 0.0)
    step = compute + exposed + overhead
    tokens = p * k * job.micro_batch_tokens
    return {"step_s": step, "compute_s": compute, "comm_s": comm, "exposed_s": exposed, "overhead_s": overhead,
            "tokens_per_s": tokens / step}  # fmt: skip


def candidates(max_micro_batches: int) -> list[int]:
    ks, k = [], 1
    while k < max_micro_batches:
        ks.append(k)
        k *= 2
    return [*ks, max_micro_batches]


def recommend(
    job: Job,
    cluster: Cluster,
    c: Constants = FITTED,
    tolerance: float = 0.05,
    ks: Sequence[int] | None = None,
    methods: Sequence[tuple[str, str]] = METHODS,
    grad_bytes: Sequence[int] | None = None,
) -> dict[str, Any]:
    """The method, accumulation, micro-batches per step (``ks``; default 1, 2, 4, ... up to
    ``job.micro_batches``) and gradient dtype on the wire for ACCO / ZeRO-1 (``grad_bytes``; default the stated
    one, and bf16 too when fp32 is stated) of the most tokens/s; among settings within ``tolerance`` of it, the
    one with the fewest micro-batches (a smaller global batch converges better per token), then the first in
    :data:`METHODS` (DDP, ZeRO-1, ACCO fixed, ACCO dynamic: the simpler first), then fp32 on the wire (exact)."""
    options = []
    times = job.times(cluster.gpus)
    wires = grad_bytes or ((4, 2) if job.grad_bytes == 4 else (job.grad_bytes,))
    for k in ks or candidates(job.micro_batches):
        for order, (method, acc) in enumerate(methods):
            if acc == "dynamic" and max(times) <= 1.05 * min(times):
                continue  # all ranks about equally fast: dynamic can only match fixed
            for wire in wires if method != "ddp" else (job.grad_bytes,):  # DDP: the model's dtype
                pred = predict(method, acc, replace(job, micro_batches=k, grad_bytes=wire), cluster, c)
                options.append({"method": method, "accumulation": acc, "micro_batches": k, "grad_bytes": wire,
                                "order": order, **pred})  # fmt: skip
    best = max(o["tokens_per_s"] for o in options)
    close = [o for o in options if o["tokens_per_s"] >= (1 - tolerance) * best]
    choice = min(close, key=lambda o: (o["micro_batches"], o["order"], -o["grad_bytes"]))
    return {"choice": choice, "options": options, "best_tokens_per_s": best}


def bucket_numel(job: Job, cluster: Cluster, c: Constants, overhead: float = 0.05) -> int:
    """Elements per bucket so that a bucket's latency (``(p - 1) alpha``) is at most ``overhead`` of its
    transfer time on the slowest link, within the engine's NCCL range."""
    slowest_gbit = min(cluster.intra_gbit, cluster.inter_gbit) if cluster.nodes > 1 else cluster.intra_gbit
    bytes_needed = c.alpha_s["round"] / overhead * c.efficiency["round"] * slowest_gbit * 1e9 / 8 * cluster.gpus
    low, high = NCCL_BUCKET_NUMEL
    return int(min(high, max(low, bytes_needed / job.grad_bytes)))


def _table(rows: list[tuple[str, dict[str, float]]], ddp_step: float) -> str:
    out = ["| method | step (s) | / DDP | tokens/s | compute (s) | communication (s) | exposed (s) | overhead (s) |",
           "|---|---:|---:|---:|---:|---:|---:|---:|"]  # fmt: skip
    for name, r in rows:
        cells = [f"{r['step_s']:.3f}", f"{r['step_s'] / ddp_step:.2f}", f"{r['tokens_per_s']:,.0f}"]
        cells += [f"{r[key]:.3f}" for key in ("compute_s", "comm_s", "exposed_s", "overhead_s")]
        out.append(f"| {name} | " + " | ".join(cells) + " |")
    return "\n".join(out)


def report(job: Job, cluster: Cluster, c: Constants, tolerance: float = 0.05) -> str:
    """The planner's printout: the table at the stated settings, the recommendation and the formulas."""
    rows = [(NAMES[m], predict(*m, job, cluster, c)) for m in METHODS]
    ddp_step = rows[0][1]["step_s"]
    rec = recommend(job, cluster, c, tolerance)
    ch = rec["choice"]
    lines = [
        f"Cluster: {cluster.gpus} GPUs, {cluster.nodes} node(s) of {cluster.local}, intra {cluster.intra_gbit:g} "
        f"Gbit/s per GPU, inter {cluster.inter_gbit:g} Gbit/s per node; model {job.params:.3g} parameters, "
        f"{job.param_bytes}-byte weights, {job.grad_bytes}-byte gradients on the wire (ACCO, ZeRO-1); "
        f"{job.micro_batches} micro-batches per rank per step of "
        f"{', '.join(f'{t:g}' for t in sorted(set(job.micro_batch_s)))} s, {job.micro_batch_tokens} tokens each.",
        f"Constants (round / all-reduce): alpha {c.alpha_s['round'] * 1e6:.0f} / {c.alpha_s['all_reduce'] * 1e6:.0f}"
        f" us, efficiency {c.efficiency['round']:.2f} / {c.efficiency['all_reduce']:.2f}; step overhead "
        + ", ".join(f"{m} {v * 1e3:.0f} ms" for m, v in c.overhead_s.items())
        + f" ({c.source}).",
        "",
        _table(rows, ddp_step),
        "",
        f"Recommended: {NAMES[(ch['method'], ch['accumulation'])]} with {ch['micro_batches']} micro-batches per rank "
        f"per step: {ch['step_s']:.3f} s/step, "
        f"{ch['tokens_per_s']:,.0f} tokens/s (the best setting up to {job.micro_batches} micro-batches: "
        f"{rec['best_tokens_per_s']:,.0f}; chosen as the smallest batch within {tolerance:.0%} of it).",
    ]
    if ch["method"] == "ddp":
        lines.append(f"  transformers.Trainer, gradient_accumulation_steps={ch['micro_batches']}")
    else:
        schedule = "acco" if ch["method"] == "acco" else "sync"
        lines.append(f"  ACCOTrainer: acco_schedule={schedule!r}, acco_accumulation={ch['accumulation']!r}, "
                     f"gradient_accumulation_steps={ch['micro_batches']}")  # fmt: skip
    if ch["method"] != "ddp":
        wire = {4: "fp32", 2: "bf16"}[ch["grad_bytes"]]
        lines.append(f"  acco_comm_dtype={wire!r} (gradients on the wire), acco_bucket_numel="
                     f"{bucket_numel(replace(job, grad_bytes=ch['grad_bytes']), cluster, c)} (latency under 5 % "
                     "of a bucket's transfer)")  # fmt: skip
    lines += ["", __doc__.split("**Collectives**")[1].split("``overhead`` is")[0].strip()]
    return "\n".join(lines)


def fit(points: Sequence[dict[str, Any]], observed: Sequence[tuple[str, str, Job, Cluster, float]] = ()) -> Constants:
    """Constants from the benchmark's measurements.

    ``points``: collectives measured alone, each ``{"kind": "round"|"all_reduce", "world_size", "bytes",
    "link_mbit", "seconds"}``, one rank per bridge port (``g = 1``: a round is ``2 * ring(B, p, link)``, an
    all-reduce the same). Per kind, ``alpha`` and ``1 / efficiency`` by least squares on
    ``seconds = steps * alpha + wire * (1 / efficiency)``, ``steps = 2 (p - 1)``, ``wire = 2 (p - 1) / p * B / bw``
    (the round's all-to-all spelling and bucketing cost other latencies than one all-reduce).
    ``observed``: measured steps ``(method, accumulation, job, cluster, step_time_s)``; a method's ``overhead`` is
    the median of what its steps took beyond the model's prediction without overhead (never below 0).
    """
    defaults = Constants()
    alphas, efficiencies = dict(defaults.alpha_s), dict(defaults.efficiency)
    for kind in sorted({pt["kind"] for pt in points}):
        rows, ys = [], []
        for pt in (pt for pt in points if pt["kind"] == kind):
            p = pt["world_size"]
            rows.append([2 * (p - 1), 2 * (p - 1) / p * pt["bytes"] / (pt["link_mbit"] * 1e6 / 8)])
            ys.append(pt["seconds"])
        try:
            alpha, inverse = _least_squares(rows, ys)
        except ValueError:  # one world size only: latency and rate cannot be told apart; the rate alone
            alpha = -1.0
        if alpha < 0:  # latency below what the fit resolves (or not resolvable): refit without it
            alpha, (inverse,) = 0.0, _least_squares([r[1:] for r in rows], ys)
        if inverse <= 0:
            raise ValueError(
                f"the fit of {kind!r} gave a non-positive 1 / efficiency ({inverse:.3g}): the measurements do not "
                "follow time = latency + bytes / rate; check that the link was shaped and the points are distinct"
            )
        alphas[kind], efficiencies[kind] = alpha, 1 / inverse
    c = Constants(alpha_s=alphas, efficiency=efficiencies, overhead_s=dict.fromkeys(defaults.overhead_s, 0.0),
                  source="fitted")  # fmt: skip
    extra: dict[str, list[float]] = {}
    for method, accumulation, job, cluster, step in observed:
        extra.setdefault(method, []).append(step - predict(method, accumulation, job, cluster, c)["step_s"])
    overhead = {m: max(0.0, statistics.median(v)) for m, v in extra.items()}
    return replace(c, overhead_s={**c.overhead_s, **overhead})


def _least_squares(rows: list[list[float]], ys: list[float]) -> list[float]:
    """Solve the normal equations (a handful of unknowns) by Gaussian elimination."""
    n = len(rows[0])
    a = [[sum(r[i] * r[j] for r in rows) for j in range(n)] + [sum(r[i] * y for r, y in zip(rows, ys))]
         for i in range(n)]  # fmt: skip
    for col in range(n):
        pivot = max(range(col, n), key=lambda i: abs(a[i][col]))
        if abs(a[pivot][col]) < 1e-300:
            raise ValueError("the measurements cannot separate the constants (too few distinct points)")
        a[col], a[pivot] = a[pivot], a[col]
        for i in range(n):
            if i != col:
                f = a[i][col] / a[col][col]
                a[i] = [x - f * y for x, y in zip(a[i], a[col])]
    return [a[i][n] / a[i][i] for i in range(n)]


def load_constants(path: str | Path) -> Constants:
    """A constants.json (as the scaling benchmark writes it); a kind it leaves out keeps the default, one alpha
    (a number) is every kind's."""
    data = {k: v for k, v in json.loads(Path(path).read_text()).items() if k in Constants.__dataclass_fields__}
    defaults = Constants()
    if isinstance(data.get("alpha_s"), (int, float)):
        data["alpha_s"] = dict.fromkeys(defaults.alpha_s, float(data["alpha_s"]))
    for key in ("alpha_s", "efficiency", "overhead_s"):
        data[key] = {**getattr(defaults, key), **data.get(key, {})}
    return Constants(**data)


# The typical clusters of the README's table (`python -m hf_acco.plan --examples` renders it): a 1.3 B-parameter
# bf16 model, micro-batches of 8 x 2048 tokens at 0.32 s on a GPU, up to 8 per step, A100 NVLink inside a node
COMMON = ["--params", "1.3e9", "--micro_batches", "8", "--intra_gbit", "2400", "--gpus_per_node", "8"]
# (--world_size: all GPUs of the job)
EXAMPLES = (
    ("1 node x 8 GPUs (NVLink)", [*COMMON, "--world_size", "8", "--micro_batch_s", "0.32"]),
    ("4 x 8 over 100 Gbit/s", [*COMMON, "--world_size", "32", "--inter_gbit", "100", "--micro_batch_s", "0.32"]),
    ("16 x 8 over 25 Gbit/s", [*COMMON, "--world_size", "128", "--inter_gbit", "25", "--micro_batch_s", "0.32"]),
    (
        "8 fast + 8 slow (2.5x) over 100 Gbit/s",
        [
            *COMMON,
            "--world_size",
            "16",
            "--inter_gbit",
            "100",
            "--micro_batch_s",
            "0.32",
            "0.8",
            "--group_gpus",
            "8",
            "8",
        ],
    ),
)


def examples_table() -> str:
    """The planner on :data:`EXAMPLES`: step times of every method at 8 micro-batches (the engine's default wire:
    bf16 gradients for a bf16 model), the recommendation, and each row's command."""
    lines = [
        "| cluster | DDP (s) | ZeRO-1 (s) | ACCO fixed (s) | ACCO dynamic (s) | recommended | its step (s), "
        "tokens/s vs DDP |",
        "|---|---:|---:|---:|---:|---|---|",
    ]
    commands = []
    for name, argv in EXAMPLES:
        out = main([*argv, "--quiet"])
        steps = [out["predictions"][f"{m}:{a}"]["step_s"] for m, a in METHODS]
        ch = out["recommendation"]
        wire = {4: "fp32", 2: "bf16"}[ch["grad_bytes"]]
        k = ch["micro_batches"]
        how = f"{NAMES[(ch['method'], ch['accumulation'])]}, {k} micro-batch{'es' if k > 1 else ''}"
        how += f", {wire} wire" if ch["method"] != "ddp" else ""
        gain = ch["tokens_per_s"] / out["predictions"]["ddp:fixed"]["tokens_per_s"]
        lines.append(
            f"| {name} | " + " | ".join(f"{t:.2f}" for t in steps) + f" | {how} | {ch['step_s']:.2f}, {gain:.2f}x |"
        )
        commands.append(f"python -m hf_acco.plan {' '.join(argv)}")
    return "\n".join(lines) + "\n\n```bash\n" + "\n".join(commands) + "\n```\n"


def make_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m hf_acco.plan", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)  # fmt: skip
    p.add_argument("--params", type=float, help="trainable parameters, e.g. 1.3e9 (required)")
    p.add_argument(
        "--world_size", "--gpus", dest="gpus", type=int, help="GPUs (ranks) of the job, all nodes together (required)"
    )
    p.add_argument("--gpus_per_node", type=int, default=8)
    p.add_argument(
        "--intra_gbit",
        type=float,
        default=3600.0,
        help="Gbit/s each way per GPU inside a node (default: H100 NVLink 4, 450 GB/s each way; A100 NVLink 3: "
        "2400; PCIe 4.0 x16: about 200)",
    )
    p.add_argument(
        "--inter_gbit",
        type=float,
        default=100.0,
        help="Gbit/s each way per node between nodes, all its NICs together (8 x 400 Gbit/s InfiniBand: 3200)",
    )
    p.add_argument(
        "--micro_batch_s",
        type=float,
        nargs="+",
        default=None,
        help="forward + backward of one micro-batch; one value, or one per GPU group with --group_gpus",
    )
    p.add_argument(
        "--group_gpus",
        type=int,
        nargs="+",
        default=None,
        help="GPUs of each --micro_batch_s (a mixed cluster: --micro_batch_s 0.12 0.2 --group_gpus 16 16)",
    )
    p.add_argument("--tokens_per_s", type=float, default=None, help="instead of --micro_batch_s: per GPU")
    p.add_argument("--micro_batch_tokens", type=int, default=16384, help="tokens of one micro-batch (8 x 2048)")
    p.add_argument("--micro_batches", type=int, default=8, help="per GPU per step: the most the plan may use")
    p.add_argument(
        "--param_dtype",
        "--model_dtype",
        dest="model_dtype",
        choices=["bf16", "fp32"],
        default="bf16",
        help="the weights (all-gathered; DDP all-reduces gradients in it)",
    )
    p.add_argument(
        "--comm_dtype",
        choices=["auto", "bf16", "fp32"],
        default="auto",
        help="ACCO / ZeRO-1's gradients on the wire (acco_comm_dtype; its default auto: the model's dtype)",
    )
    p.add_argument(
        "--backend",
        choices=["nccl", "gloo"],
        default="nccl",
        help="nccl: rings, alpha NCCL_ALPHA_US (stated: the benchmark runs gloo); gloo: the engine's "
        "all-to-all reduce-scatter, the fitted alpha",
    )
    p.add_argument("--alpha_us", type=float, default=None, help="the latency per ring step (overrides --backend's)")
    p.add_argument("--efficiency", type=float, default=None, help="override the fitted share of the link rate")
    p.add_argument("--constants", default=None, help="a constants.json of `python -m hf_acco.bench.scaling`")
    p.add_argument("--json", action="store_true", help="print the predictions as JSON")
    p.add_argument("--quiet", action="store_true", help="print nothing (for callers that read the returned dict)")
    p.add_argument("--examples", action="store_true", help="print the table of typical clusters, with commands")
    return p


def job_from_args(args: argparse.Namespace, parser: argparse.ArgumentParser) -> Job:
    if args.params is None or args.gpus is None:
        parser.error("state --params (trainable parameters) and --world_size (GPUs, all nodes together)")
    if (args.micro_batch_s is None) == (args.tokens_per_s is None):
        parser.error("state one of --micro_batch_s (seconds per micro-batch) or --tokens_per_s (per GPU)")
    times = args.micro_batch_s or [args.micro_batch_tokens / args.tokens_per_s]
    if args.group_gpus is not None:
        if len(args.group_gpus) != len(times) or sum(args.group_gpus) != args.gpus:
            parser.error("--group_gpus needs one count per --micro_batch_s, adding up to --world_size")
        times = [t for t, n in zip(times, args.group_gpus) for _ in range(n)]
    elif len(times) > 1:
        parser.error("several --micro_batch_s need --group_gpus (how many GPUs have each)")
    nbytes = {"bf16": 2, "fp32": 4}
    wire = args.model_dtype if args.comm_dtype == "auto" else args.comm_dtype
    return Job(params=args.params, micro_batch_s=times, micro_batches=args.micro_batches,
               micro_batch_tokens=args.micro_batch_tokens, grad_bytes=nbytes[wire],
               param_bytes=nbytes[args.model_dtype])  # fmt: skip


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = make_parser()
    args = parser.parse_args(argv)
    if args.examples:
        print(examples_table())
        return {}
    c = load_constants(args.constants) if args.constants else FITTED
    if args.alpha_us is None and args.backend == "nccl":
        args.alpha_us = NCCL_ALPHA_US
    if args.alpha_us is not None:
        c = replace(c, alpha_s=dict.fromkeys(c.alpha_s, args.alpha_us * 1e-6), source=f"{c.source}, alpha stated")
    if args.efficiency is not None:
        stated = dict.fromkeys(c.efficiency, args.efficiency)
        c = replace(c, efficiency=stated, source=f"{c.source}, efficiency stated")
    job = job_from_args(args, parser)
    cluster = Cluster(args.gpus, args.gpus_per_node, args.intra_gbit, args.inter_gbit, args.backend)
    out = {"constants": asdict(c), "predictions": {f"{m}:{a}": predict(m, a, job, cluster, c) for m, a in METHODS},
           "recommendation": recommend(job, cluster, c)["choice"]}  # fmt: skip
    if not args.quiet:
        print(json.dumps(out, indent=1) if args.json else report(job, cluster, c))
    return out


if __name__ == "__main__":
    main()
