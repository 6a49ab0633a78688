"""Will ACCO help on my cluster? An alpha-beta cost model of one optimizer step for DDP, ZeRO-1 and ACCO.

    python -m hf_acco.plan --params 1.3e9 --world_size 32 --gpus_per_node 8 --intra_gbit 2400 --inter_gbit 100 \\
        --micro_batch_s 0.32 --micro_batches 8

prints the predicted step time, tokens/s and exposed communication of DDP (as Trainer runs it), ZeRO-1 and ACCO
(fixed and paced accumulation), the settings it recommends, and the formulas below. Standard library only.

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

**int8 on the wire** (``--comm_dtype int8``, ``--gather_dtype int8`` or ``int4``: ``INT8_BYTES`` / ``INT4_BYTES``
an element): the int8
reduce-scatter is an all-to-all, in two levels on several nodes of several GPUs (:func:`int8_reduce_scatter`:
a ring inside each node in the model's dtype, then ``(n - 1) / n`` of the int8 bytes out of each node), the int8
or int4 changes' all-gather a ring; each quantised collective adds ``quant_s_per_element`` seconds an element (stated).

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
fitted by :func:`fit` from the benchmark's measurements (``python -m hf_acco.tools.bench.scaling``); :data:`FITTED`
are the committed ones. Where it was held against measured runs, and where it is known to be wrong:
``docs/benchmarks.md``.
"""

from __future__ import annotations

import heapq
import json
import math
import statistics
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

METHODS = (("ddp", "fixed"), ("sync", "fixed"), ("acco", "fixed"), ("acco", "paced"))
# paced (Trainer's acco_accumulation="paced": the ranks claim a global batch's micro-batches as they are free) is what
# the planner models for GPUs of unequal speed; "dynamic" is taken for it too (Trainer's old name for paced, and the
# name older benchmark result files give their paced runs)
PACED = ("paced", "dynamic")
NAMES = {("ddp", "fixed"): "DDP (Trainer)", ("sync", "fixed"): "ZeRO-1", ("acco", "fixed"): "ACCO fixed",
         ("acco", "paced"): "ACCO paced"}  # fmt: skip
DDP_FIRST_BUCKET_BYTES, DDP_BUCKET_BYTES = 2**20, 25 * 2**20  # DDP's defaults (bucket_cap_mb 25)
NCCL_BUCKET_NUMEL = (1 << 22, 1 << 28)  # the engine's automatic bucket range on NCCL (hf_acco/comm/sharding.py)
# NCCL's latency per ring step on NVLink / InfiniBand is some microseconds (nccl-tests' small-message times);
# the benchmark cannot measure it (gloo over TCP here: its fitted alpha is milliseconds), so it is stated
NCCL_ALPHA_US = 20.0
INT8_BYTES = 1 + 4 / 256  # an element in int8 on the wire: quant.py's value and its share of a block's fp32 scale
INT4_BYTES = 0.5 + 4 / 256  # int4 (parameter changes only): two values a byte, and the same scales
# Quantising or dequantising an element (quant.py's unfused torch ops: some 30-70 bytes of device memory traffic
# an element) at about 2.5 TB/s; stated, not measured: the benchmark runs on CPUs, where it is far slower
QUANT_S_PER_ELEMENT = 2e-11
WIRES = {4: "fp32", 2: "bf16", INT8_BYTES: "int8"}  # bytes an element -> the acco_comm_dtype that sends them
CHANGES = {INT8_BYTES: "int8", INT4_BYTES: "int4"}  # bytes an element -> the acco_gather_dtype that sends them


@dataclass(frozen=True)
class Constants:
    """The model's fitted constants (see the module docstring)."""

    alpha_s: dict[str, float] = field(default_factory=lambda: {"round": 50e-6, "all_reduce": 50e-6})
    efficiency: dict[str, float] = field(default_factory=lambda: {"round": 0.9, "all_reduce": 0.9})
    overhead_s: dict[str, float] = field(default_factory=lambda: {"ddp": 0.0, "sync": 0.0, "acco": 0.0})
    forward_share: float = 1 / 3  # the forward's share of a micro-batch (the backward: 2/3)
    quant_s_per_element: float = QUANT_S_PER_ELEMENT  # per quantised collective of a round (stated)
    source: str = "defaults"


# Fitted by `python -m hf_acco.tools.bench.scaling` (recipes/results/scaling/constants.json, rounded): gloo over TCP
# on the benchmark's bridge, every rank's link shaped to 200 Mbit/s, 2/4/8 ranks, emulated compute, 2 CPU cores. The
# latencies are below what these points resolve (the fit gives 0): NCCL's is stated instead (NCCL_ALPHA_US,
# --backend nccl). Where the model is known to be wrong: docs/benchmarks.md.
FITTED = Constants(
    alpha_s={"round": 0.0, "all_reduce": 0.0},
    efficiency={"round": 0.888, "all_reduce": 0.983},
    overhead_s={"ddp": 0.000, "sync": 0.000, "acco": 0.000},
    source="efficiencies and overheads fitted with gloo on CPU ranks over shaped 200 Mbit/s links, emulated "
    "compute (python -m hf_acco.tools.bench.scaling, recipes/results/scaling/constants.json), applied to NCCL "
    "unchanged; on your cluster, fit them with that benchmark and pass --constants, or state --efficiency",
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
    dtype, the parameters all-gathered (a ring) in the model's, or their int8 / int4 changes; the (de)quantising."""
    gather = job.param_bytes if job.gather_bytes is None else job.gather_bytes
    if job.grad_bytes == INT8_BYTES:
        reduce_scatter = int8_reduce_scatter(job, cluster, c)
    else:
        spelling = "all_to_all" if cluster.backend == "gloo" else "ring"
        reduce_scatter = collective(job.params * job.grad_bytes, cluster, c, spelling=spelling)
    quantised = (job.grad_bytes == INT8_BYTES) + (job.gather_bytes in CHANGES)
    kernels = quantised * job.params * c.quant_s_per_element
    return reduce_scatter + collective(job.params * gather, cluster, c) + kernels


def int8_reduce_scatter(job: Job, cluster: Cluster, c: Constants) -> float:
    """int8 gradients: an all-to-all of int8 over all ranks on one node (or one GPU per node); on ``n`` nodes of
    ``g > 1`` GPUs two levels (hf_acco/comm/nodes.py): a ring reduce-scatter inside each node in the model's dtype,
    then an all-to-all of int8 among the ``n`` GPUs of each local rank, ``(n - 1) / n`` of the int8 bytes leaving
    each node; the buckets keep both kinds of link busy at once, so the slower sets the pace."""
    n, g = cluster.nodes, cluster.local
    if n == 1 or g == 1:
        return collective(job.params * INT8_BYTES, cluster, c, spelling="all_to_all")
    rate = lambda gbit: c.efficiency["round"] * gbit * 1e9 / 8  # noqa: E731  (bytes/s)
    inside = (g - 1) / g * job.params * job.param_bytes / rate(cluster.intra_gbit)
    across = (n - 1) / n * job.params * INT8_BYTES / rate(cluster.inter_gbit)
    return (g - 1 + n - 1) * c.alpha_s["round"] + max(inside, across)


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
    each claim the next one as soon as they are free (paced accumulation's claims, simulated)."""
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
    grad_bytes: float = 4  # per element of ACCO / ZeRO-1's reduce-scatter: 4 fp32, 2 bf16, INT8_BYTES int8
    param_bytes: int = 4  # per element of the all-gather and of DDP's all-reduce: the model's dtype
    gather_bytes: float | None = None  # the all-gather's, if not the model's: INT8_BYTES / INT4_BYTES (changes)

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
        if accumulation in PACED:  # the step's p * k claims, computed by the ranks together
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
    grad_bytes: Sequence[float] | None = None,
    memory: Callable[[str, Job], float] | None = None,
    gpu_bytes: float | None = None,
) -> dict[str, Any]:
    """The method, accumulation, micro-batches per step (``ks``; default 1, 2, 4, ... up to
    ``job.micro_batches``) and gradient dtype on the wire for ACCO / ZeRO-1 (``grad_bytes``; default the stated
    one, and bf16 too when fp32 is stated) of the most tokens/s; among settings within ``tolerance`` of it, the
    one with the fewest micro-batches (a smaller global batch converges better per token), then the first in
    :data:`METHODS` (DDP, ZeRO-1, ACCO fixed, ACCO paced: the simpler first), then fp32 on the wire (exact).
    With ``memory`` (bytes per GPU of a method's setting) and ``gpu_bytes``, only the settings that fit are chosen
    from; ``choice`` is None when none does."""
    options: list[dict[str, Any]] = []
    times = job.times(cluster.gpus)
    wires = grad_bytes or ((4, 2) if job.grad_bytes == 4 else (job.grad_bytes,))
    for k in ks or candidates(job.micro_batches):
        for order, (method, acc) in enumerate(methods):
            if acc in PACED and max(times) <= 1.05 * min(times):
                continue  # all ranks about equally fast: paced can only match fixed
            for wire in wires if method != "ddp" else (job.grad_bytes,):  # DDP: the model's dtype
                setting = replace(job, micro_batches=k, grad_bytes=wire)
                pred = predict(method, acc, setting, cluster, c)
                options.append({"method": method, "accumulation": acc, "micro_batches": k, "grad_bytes": wire,
                                "order": order, **pred})  # fmt: skip
                if memory is not None:
                    options[-1]["memory_bytes"] = memory(method, setting)
    fitting = [o for o in options if gpu_bytes is None or o.get("memory_bytes", 0) < gpu_bytes]
    if not fitting:
        return {"choice": None, "options": options, "best_tokens_per_s": None}
    best = max(o["tokens_per_s"] for o in fitting)
    close = [o for o in fitting if o["tokens_per_s"] >= (1 - tolerance) * best]
    choice = min(close, key=lambda o: (o["micro_batches"], o["order"], -o["grad_bytes"]))
    return {"choice": choice, "options": options, "best_tokens_per_s": best}


def bucket_numel(job: Job, cluster: Cluster, c: Constants, overhead: float = 0.05) -> int:
    """Elements per bucket so that a bucket's latency (``(p - 1) alpha``) is at most ``overhead`` of its
    transfer time on the slowest link, within the engine's NCCL range."""
    slowest_gbit = min(cluster.intra_gbit, cluster.inter_gbit) if cluster.nodes > 1 else cluster.intra_gbit
    bytes_needed = c.alpha_s["round"] / overhead * c.efficiency["round"] * slowest_gbit * 1e9 / 8 * cluster.gpus
    low, high = NCCL_BUCKET_NUMEL
    return int(min(high, max(low, bytes_needed / job.grad_bytes)))


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
