"""Bytes per rank of every buffer the engine holds, next to DDP, ZeRO-1 and ZeRO-2 for the same model.

    python -m hf_acco.memory --params 7e9 --world_size 8 --param_dtype bf16 [--comm_dtype auto|fp32|bf16|int8]
        [--gather_dtype auto|int8|int4] [--grad_dtype fp32|bf16] [--optimizer fused|foreach] [--gpus_per_node 8]
        [--fsdp_shard 8 [--fsdp_reduce_dtype fp32]] [--config path/to/model] [--json]

Units: GB = 10^9 bytes, with GiB (2^30 bytes) beside it. An "80 GB" GPU holds 80 GiB (85.9 GB). FSDP's working set,
the CUDA context's and NCCL's allowance and the verdict's margin: ``device_memory.py``.

The engine's figures come from the code that allocates its buffers: the flat layout (``FlatLayout``, padding and
buckets included), the buffer pair's dtypes (``buffers.comm_allocation``; ``"auto"`` on the wire is the model's
dtype), where a round keeps the shard gradient (``buffers.shard_grad_room``: in its buffer, else a tensor of its own),
the shard optimizer's master and per-element state, the boundary's model shard (``BoundaryState``).
``tests/test_memory.py`` checks them against the tensors a built engine really holds.

* Persistent: on the device for the whole run.
* Round stream pool: the temporaries of the rounds (the Adam estimate's windows; the commit's inner step: torch's
  foreach Adam allocates a shard-sized square root of the second moment, the fused one nothing). They are allocated
  on the round's own stream, and the caching allocator keeps freed blocks for the stream that made them: activations
  cannot reuse them, so they count as held for the run. Peak = persistent + that pool + the largest temporary of
  the main thread (none of shard size) + FSDP's working set where it shards the model.
* Host: acco's copy of the boundary's model shard (in the model's dtype, pinned on a GPU: a checkpoint written in
  the middle of a step still describes the boundary; torch's pinned allocator rounds each block up to a power of
  2, which the per-rank total counts); per node with ``--gpus_per_node``. Evaluation and saving at a
  step boundary keep the training parameters in the accumulation buffer (free there): nothing on the host; in the
  middle of a step (hand-written loops) a copy of the model in its dtype on the host. A resume stages through the
  accumulation buffer; a re-sharding resume reads each rank's new ranges from memory-mapped files (its shard's
  master, model and moments, on the host while it loads).

The baselines (``device_memory.baselines``): DDP, ZeRO-1, ZeRO-2 and HSDP with fp32 gradients, masters and moments.
Activations are counted only with ``--config`` and ``--micro_batch_size`` (``model_shape.py``).
"""

from __future__ import annotations

import argparse
import json
from dataclasses import dataclass, field

import torch

from hf_acco.comm import quant
from hf_acco.comm.deltas import GATHER_DTYPES, check_gather_dtype
from hf_acco.comm.nodes import machines
from hf_acco.comm.sharding import FlatLayout
from hf_acco.engine.buffers import ACCUM_DTYPE, SHARD_GRAD_DTYPE, check_grad_dtype, comm_allocation, shard_grad_room
from hf_acco.engine.optim import estimate_window
from hf_acco.engine.packing import packed_bytes, packs_round
from hf_acco.tools import device_memory
from hf_acco.tools.cli_types import GPUS, POSITIVE_FLOAT, POSITIVE_INT
from hf_acco.tools.device_memory import GIB, FSDPGroups, _gb, baselines, margin_bytes, verdict
from hf_acco.tools.model_shape import shape_and_activations
from hf_acco.tools.wire_pool import residual_bytes, wire_pool

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
ADAM_STATE_PER_ELEMENT = 2  # exp_avg, exp_avg_sq
OPTIMIZERS = ("fused", "foreach")  # Trainer's default optim="adamw_torch_fused"; a plain AdamW on CUDA: foreach
RESIDUAL = "int8 error feedback residual (fp32)"


@dataclass
class MemoryReport:
    """Bytes per rank: what is held for the whole run, the rounds' cached temporaries, and the host's share."""

    persistent: dict[str, int]  # on the device
    round_pool: dict[str, int] = field(default_factory=dict)  # on the device, the round stream's (largest counts)
    temporaries: dict[str, int] = field(default_factory=dict)  # on the device, main thread, one at a time
    host: dict[str, int] = field(default_factory=dict)  # in (pinned) host memory, held for the run
    host_transient: dict[str, int] = field(default_factory=dict)  # on the host, only while it happens
    fsdp: dict[str, int] = field(default_factory=dict)  # on the device, FSDP2's working set (device_memory.py)
    runtime: dict[str, int] = field(default_factory=dict)  # on the device, outside torch: an allowance
    fsdp_source: str = ""  # where FSDP's group sizes come from

    @property
    def persistent_bytes(self) -> int:
        return sum(self.persistent.values())

    @property
    def round_pool_bytes(self) -> int:
        return max(self.round_pool.values(), default=0)

    @property
    def fsdp_bytes(self) -> int:
        return sum(self.fsdp.values())

    @property
    def peak_bytes(self) -> int:
        """What torch's allocator holds at the peak, activations aside: the engine's and FSDP's."""
        temporaries = max(self.temporaries.values(), default=0)
        return self.persistent_bytes + self.round_pool_bytes + temporaries + self.fsdp_bytes

    @property
    def device_bytes(self) -> int:
        """The peak and the CUDA context's and NCCL's allowance: what the GPU must hold besides the activations."""
        return self.peak_bytes + sum(self.runtime.values())

    @property
    def host_bytes(self) -> int:
        """Pinned host memory per rank as torch's pinned allocator takes it: each block rounded up to a power of 2."""
        return sum(1 << (n - 1).bit_length() if n else 0 for n in self.host.values())


def estimate_temporaries(optimizer: str, narrow_output: bool) -> int:
    """Window-sized fp32 temporaries of one Adam estimate window (optim._adam_estimate_runs): copies of the two
    moments, θ's copy when the output is narrower than fp32 or holds the gradient, the foreach kernel's square root."""
    return 2 + int(narrow_output) + int(optimizer == "foreach")


def engine_memory(
    numel: int,
    world_size: int,
    *,
    param_dtype: torch.dtype = torch.float32,
    comm_dtype: torch.dtype | str = "auto",
    grad_dtype: torch.dtype = ACCUM_DTYPE,
    schedule: str = "acco",
    backend: str = "nccl",
    bucket_numel: int | None = None,
    state_per_element: int = ADAM_STATE_PER_ELEMENT,
    max_inflight: int = 4,
    optimizer: str = "fused",
    gather_dtype: str = "auto",
    ranks_per_node: int = 1,
    error_feedback: bool = False,
    fsdp_shard: int = 1,
    packed: bool | None = None,
    boundary_copy: bool = True,
    fsdp_groups: FSDPGroups | None = None,
    reduce_dtype: torch.dtype | None = None,
    vote_commits: bool = False,
) -> MemoryReport:
    """The engine's memory per rank for ``numel`` trainable parameters on ``world_size`` ranks. ``fsdp_shard``: the
    ranks of a machine that shard the model with FSDP2 (docs/hsdp.md): the engine then holds one FSDP shard's
    numbers (``numel / fsdp_shard`` elements: FSDP splits each parameter's first dimension, within a row of even)
    and its rounds run over ``world_size / fsdp_shard`` ranks, one per machine. ``packed``: whether the round's buffer
    holds int8 rows (None: the engine's rule for these settings). ``boundary_copy``: acco's host copy of the
    boundary's model shard (``ACCOOptimizer(boundary_copy=...)``: kept by hand-written loops, not by ACCOTrainer).
    ``fsdp_groups``: the sizes of the groups FSDP all-gathers (``device_memory``; None: assumed from ``numel``),
    ``reduce_dtype``: FSDP's reduce-scatter dtype (None: the model's, Accelerate's policy). ``vote_commits``: the
    last commit kept aside until the ranks agree (``ACCOOptimizer.vote_commits``)."""
    groups = fsdp_groups or (device_memory.assumed_groups(numel) if fsdp_shard > 1 else None)
    communicators = device_memory.nccl_communicators(fsdp_shard, two_level=False)
    if fsdp_shard > 1:
        if world_size % fsdp_shard:
            raise ValueError(f"world_size ({world_size}) is machines x fsdp_shard: {fsdp_shard} does not divide it")
        numel, world_size = -(-numel // fsdp_shard), world_size // fsdp_shard
        ranks_per_node = 1  # one rank per machine in the rounds' group: the flat all-to-all
    comm_dtype, quantized = _wire(comm_dtype, param_dtype)
    layout = FlatLayout([torch.empty(numel, device="meta")], ["all"], [0], world_size, bucket_numel, backend)
    full, shard = layout.padded_numel, layout.shard_numel
    fp32 = torch.float32.itemsize
    check_grad_dtype(grad_dtype, comm_dtype, param_dtype)
    comm = comm_allocation(param_dtype, comm_dtype, schedule != "sync", grad_dtype)
    room = shard_grad_room(grad_dtype if comm is None else comm, comm_dtype, world_size, layout.chunk)
    change_bits = check_gather_dtype(gather_dtype)
    nodes, per_node = machines(layout.world_size, ranks_per_node)
    if packed is None:  # the round's buffer as int8 rows: the engine's rule
        packed = packs_round(layout, param_dtype, comm_dtype, grad_dtype, int8_grads=quantized,
                             change_bits=change_bits, error_feedback=error_feedback, separate=schedule != "sync",
                             one_level=not (nodes > 1 and per_node > 1), wired=world_size > 1)  # fmt: skip
    if packed:
        room = None
    persistent = {
        "parameters (the model's)" if fsdp_shard == 1 else "parameters (this rank's FSDP shard)": numel
        * param_dtype.itemsize,
        "gradient accumulation buffer (full)": full * grad_dtype.itemsize,
        "round buffer (full)": 0 if comm is None else packed_bytes(layout) if packed else full * comm.itemsize,
        "master shard (fp32)": shard * fp32,
        "shard gradient (fp32; 0: in the round's buffer)": 0 if room else shard * SHARD_GRAD_DTYPE.itemsize,
        "optimizer state shard (fp32)": state_per_element * shard * fp32,
    }
    if error_feedback:
        if not quantized:
            raise ValueError("error_feedback is for int8 gradients (comm_dtype='int8')")
        persistent[RESIDUAL] = residual_bytes(layout, ranks_per_node)
    window = min(shard, estimate_window(shard))
    # the estimate writes into the round buffer's own pieces: in fp32 straight there, unless they hold the gradient
    # (room "own") or are narrower (a bf16 buffer)
    narrow = (comm if comm is not None else grad_dtype) != torch.float32 or room == "own" or packed
    round_pool = {
        "round: Adam estimate windows": estimate_temporaries(optimizer, narrow) * window * fp32,
        "round: commit step (the inner optimizer's own temporaries)": shard * fp32 if optimizer == "foreach" else 0,
    }
    if vote_commits:  # (engine/kept.py: the master and every per-element state vector)
        kept = (1 + state_per_element) * shard * fp32  # (and error feedback's residual, as it was before the round)
        round_pool["round: the last commit, kept until the ranks agree"] = kept + persistent.get(RESIDUAL, 0)
    if schedule == "sync":  # no estimate round
        round_pool.pop("round: Adam estimate windows")
    temporaries = {"main thread at a step boundary (no shard-sized copy)": 0}
    if packed:  # the round quantises the sums (a row rounded to the wire's dtype, its fp32 copy); the boundary adds
        row = quant.num_blocks(layout.chunk) * quant.BLOCK  # the changes (a row dequantised, added in place)
        round_pool["round: packing the sums (a row's)"] = row * fp32 + layout.chunk * comm_dtype.itemsize
        temporaries["main thread at a step boundary: adding the changes (a row's)"] = row * fp32
    reduce = reduce_dtype or param_dtype
    fsdp = device_memory.working_set(groups, param_dtype, reduce, fsdp_shard) if groups is not None else {}
    host = {}
    if schedule == "acco" and boundary_copy:  # (ACCOTrainer saves at step boundaries only: it keeps none)
        host["acco: the boundary's model shard (model dtype, pinned; hand-written loops, opt-in under FSDP)"] = (
            shard * param_dtype.itemsize
        )
    host_transient = {
        "evaluation / saving in the middle of a step: the model (model dtype, full)": full * param_dtype.itemsize,
        "re-sharding resume: this rank's new shard (master, model, moments)": (1 + state_per_element) * shard * fp32
        + shard * param_dtype.itemsize,
    }
    round_pool.update(
        wire_pool(layout, comm_dtype, quantized, change_bits, backend, max_inflight, ranks_per_node, bool(packed))
    )
    if fsdp_shard == 1 and nodes > 1 and per_node > 1 and quantized:  # int8 in two levels: the node and rail groups
        communicators = device_memory.nccl_communicators(1, two_level=True)
    runtime = device_memory.runtime_allowance(communicators) if backend == "nccl" else {}
    source = groups.source if groups is not None else ""
    return MemoryReport(persistent, round_pool, temporaries, host, host_transient, fsdp, runtime, source)


def _wire(comm_dtype: torch.dtype | str, param_dtype: torch.dtype) -> tuple[torch.dtype, bool]:
    """(the dtype of the sums a round is handed, whether it packs them to int8): "auto" and "int8" hand it the
    model's dtype."""
    if not isinstance(comm_dtype, str):
        return comm_dtype, False
    if comm_dtype not in ("auto", "int8"):
        raise ValueError(f"comm_dtype is a torch dtype, 'auto' (the model's) or 'int8', got {comm_dtype!r}")
    return param_dtype, comm_dtype == "int8"


def engine_memory_of(opt) -> MemoryReport:  # noqa: ANN001 - an ACCOOptimizer (not imported: no cycle)
    """The report for a built engine, from its own layout and settings."""
    fused = any(g.get("fused") for g in opt.shard.inner.param_groups)
    return engine_memory(
        opt.layout.numel,
        opt.layout.world_size,
        param_dtype=opt.buffers.param_dtype,
        comm_dtype="int8" if opt.comm.quantized_gradients else opt.buffers.comm_dtype,
        gather_dtype=opt.gather_dtype,
        ranks_per_node=opt.comm.two_level.per_node if opt.comm.two_level is not None else 1,
        error_feedback=opt._round.feedback is not None,
        grad_dtype=opt.buffers._accum.dtype,  # (not ``accum``: no wait for a round's copy)
        schedule=opt.schedule.value,
        backend=opt.comm.backend,
        bucket_numel=opt.layout.bucket_numel,
        state_per_element=len(opt.shard.state_tensors()[0]) or 2,
        max_inflight=opt.comm.max_inflight,
        optimizer="fused" if fused else "foreach",
        packed=opt.buffers.packed is not None,
        boundary_copy=opt._boundary_copy,
        vote_commits=opt.vote_commits,
    )


def table(
    report: MemoryReport,
    numel: int,
    world_size: int,
    param_dtype: torch.dtype,
    settings: dict,
    gpus_per_node: int,
    fsdp_shard: int = 1,
) -> str:
    """The report as Markdown tables (GB = 10^9 bytes, GiB beside)."""
    name = ", ".join(f"{k} {v}" for k, v in settings.items())
    lines = [f"hf_acco per rank, {numel / 1e9:.3g}B parameters on {world_size} ranks ({name}):", ""]
    lines += ["| on the device | GB (GiB) |", "|---|---|"]
    lines += [f"| {k} | {_gb(n)} |" for k, n in report.persistent.items() if n]
    lines += [f"| **persistent** | **{_gb(report.persistent_bytes)}** |"]
    lines += [f"| + round stream pool: {k} | {_gb(n)} |" for k, n in report.round_pool.items()]
    lines += [f"| + {k} | {_gb(n)} |" for k, n in report.fsdp.items()]
    pool = "persistent + the pool's largest" + (" + FSDP's working set" if report.fsdp else "")
    lines += [f"| **peak** ({pool}) | **{_gb(report.peak_bytes)}** |"]
    lines += [f"| + {k} | {_gb(n)} |" for k, n in report.runtime.items()]
    if report.runtime:
        lines += [f"| **on the GPU, activations aside** | **{_gb(report.device_bytes)}** |"]
    lines += [""]
    lines += ["| on the host | GB (GiB) |", "|---|---|"]
    lines += [f"| {k} | {_gb(n)} |" for k, n in report.host.items()]
    lines += [f"| **pinned per rank** (blocks rounded up to a power of 2 by torch) | **{_gb(report.host_bytes)}** |"]
    lines += [
        f"| **pinned per node** (--gpus_per_node {gpus_per_node}) | **{_gb(report.host_bytes * gpus_per_node)}** |"
    ]
    lines += [f"| only while it happens: {k} | {_gb(n)} |" for k, n in report.host_transient.items()]
    lines += ["", "| baseline | persistent GB (GiB) |", "|---|---|"]
    base = baselines(numel, world_size, param_dtype, fsdp_shard)
    lines += [f"| {k} | {_gb(n)} |" for k, n in base.items()]
    extra = {k: n for k, n in report.persistent.items() if k.startswith("round buffer") and n}
    if fsdp_shard == 1 and extra and report.persistent_bytes > base["ZeRO-1"]:
        name, n = next(iter(extra.items()))
        why = ("acco: the next micro-batches accumulate while a round runs; sync: the wire's dtype is not the "
               "sums'; --grad_dtype bf16 with a bf16 wire works in the sums themselves")  # fmt: skip
        lines += [
            "",
            f"Beyond ZeRO-1: the {name.split(' (')[0]} ({_gb(n)}), the gradients' buffer beside the sums ({why}).",
        ]
    if report.fsdp:
        lines += ["", f"FSDP's groups: {report.fsdp_source}. Not counted: the activations."]
    if report.runtime:
        lines += ["", "The allowance is not a measurement: nvidia-smi after the first step shows what yours take."]
    return "\n".join(lines)


def make_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m hf_acco.memory", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--params", type=POSITIVE_FLOAT, default=None, help="trainable parameters, e.g. 7e9")
    p.add_argument("--config", default=None, help="a transformers config.json (or its folder): the model's shape")
    p.add_argument("--micro_batch_size", type=POSITIVE_INT, default=None, help="with --config: sequences per GPU")
    p.add_argument("--seq_len", type=POSITIVE_INT, default=2048, help="with --micro_batch_size: tokens a sequence")
    p.add_argument("--gradient_checkpointing", action="store_true", help="activations with checkpointing")
    p.add_argument("--world_size", type=POSITIVE_INT, default=8)
    p.add_argument(
        "--gpus_per_node", type=POSITIVE_INT, default=8, help="ranks per machine (pinned host memory per node)"
    )
    p.add_argument("--param_dtype", choices=sorted(DTYPES), default="bf16")
    p.add_argument(
        "--comm_dtype",
        choices=["auto", *sorted(DTYPES), "int8"],
        default="auto",
        help="gradients on the wire (auto: the model's)",
    )
    p.add_argument("--gather_dtype", choices=GATHER_DTYPES, default="auto", help="parameters in the all-gather")
    p.add_argument("--grad_dtype", choices=sorted(DTYPES), default="fp32", help="gradient accumulation")
    p.add_argument("--error_feedback", action="store_true", help="int8 gradients' residual (with --comm_dtype int8)")
    p.add_argument("--schedule", choices=["acco", "dpu", "sync"], default="acco")
    p.add_argument(
        "--optimizer", choices=OPTIMIZERS, default="fused", help="the inner AdamW (Trainer's default: fused)"
    )
    p.add_argument(
        "--fsdp_shard", type=POSITIVE_INT, default=1,
        help="ranks of each machine that shard the model with FSDP2, ACCO across machines (docs/hsdp.md)",
    )  # fmt: skip
    p.add_argument(
        "--fsdp_reduce_dtype", choices=sorted(DTYPES), default=None,
        help="with --fsdp_shard: FSDP's reduce-scatter dtype inside a machine (default: the model's, Accelerate's)",
    )  # fmt: skip
    p.add_argument(
        "--gpu_gib", type=POSITIVE_FLOAT, default=None,
        help="the GPU's memory in GiB (default: --gpu's, else 80): whether the peak fits and what is left",
    )  # fmt: skip
    p.add_argument("--gpu", choices=sorted(GPUS), default=None, help="the GPU (its memory: --gpu_gib's default)")
    p.add_argument("--json", action="store_true", help="one JSON object instead of the tables")
    return p


def main(argv: list[str] | None = None) -> None:
    p = make_parser()
    args = p.parse_args(argv)
    _, activations = shape_and_activations(args, p)
    numel, param, grad = int(args.params), DTYPES[args.param_dtype], DTYPES[args.grad_dtype]
    sent = param if args.comm_dtype in ("auto", "int8") else DTYPES[args.comm_dtype]  # int8 packs what auto sends
    wire: torch.dtype | str = "int8" if args.comm_dtype == "int8" else sent
    try:
        check_grad_dtype(grad, sent, param)
    except ValueError as e:
        p.error(str(e))
    if args.error_feedback and args.comm_dtype != "int8":
        p.error("--error_feedback is for int8 gradients: add --comm_dtype int8")
    if args.world_size > args.gpus_per_node and args.world_size % args.gpus_per_node:
        p.error(f"--world_size ({args.world_size}) is whole machines of --gpus_per_node ({args.gpus_per_node}) GPUs")
    if args.fsdp_shard > 1 and args.world_size % args.fsdp_shard:
        p.error(f"--world_size is machines x --fsdp_shard: {args.fsdp_shard} does not divide {args.world_size}")
    groups = None
    if args.config is not None and args.fsdp_shard > 1:
        groups = device_memory.groups_from_config(args.config, args.fsdp_shard)
    reduce = DTYPES[args.fsdp_reduce_dtype] if args.fsdp_reduce_dtype else param
    report = engine_memory(
        numel, args.world_size, param_dtype=param, comm_dtype=wire, grad_dtype=grad, schedule=args.schedule,
        optimizer=args.optimizer, gather_dtype=args.gather_dtype, ranks_per_node=args.gpus_per_node,
        error_feedback=args.error_feedback, fsdp_shard=args.fsdp_shard, fsdp_groups=groups, reduce_dtype=reduce,
        boundary_copy=args.fsdp_shard == 1,  # (under FSDP, kept only when asked for: prepare_acco's default)
    )  # fmt: skip
    settings = {"param_dtype": args.param_dtype, "comm_dtype": _name(wire), "grad_dtype": args.grad_dtype}
    settings.update(gather_dtype=args.gather_dtype, error_feedback=args.error_feedback)
    settings.update(schedule=args.schedule, optimizer=args.optimizer)
    if args.fsdp_shard > 1:
        settings.update(fsdp_shard=args.fsdp_shard, fsdp_reduce_dtype=_name(reduce))
    lower = lower_settings(args, numel, param, wire, grad, report.persistent_bytes)
    if args.gpu_gib is None:
        args.gpu_gib = float(GPUS[args.gpu][1]) if args.gpu else 80.0
    left = int(args.gpu_gib * GIB) - report.device_bytes - (activations or 0)
    if not args.json:
        print(table(report, numel, args.world_size, param, settings, args.gpus_per_node, args.fsdp_shard))
        if activations is not None:
            print(f"\nActivations, roughly (hf_acco/tools/model_shape.py): {_gb(activations)} for "
                  f"{args.micro_batch_size} x {args.seq_len} tokens"
                  + (" with gradient checkpointing" if args.gradient_checkpointing else ""))  # fmt: skip
        print(f"\n{verdict(left, args.gpu_gib, activations is not None)}")
        if lower:
            print("\nWhat would lower the persistent bytes per rank:")
            print("\n".join(f"- {k}: {_gb(n)}" for k, n in lower.items()))
        return
    out = {"unit": "bytes (GB = 10^9 bytes; GiB = 2^30)", "params": numel, "world_size": args.world_size}
    out.update(gpus_per_node=args.gpus_per_node, param_dtype=args.param_dtype, comm_dtype=_name(wire))
    out.update(grad_dtype=args.grad_dtype, gather_dtype=args.gather_dtype, schedule=args.schedule)
    out.update(error_feedback=args.error_feedback)
    out.update(optimizer=args.optimizer, fsdp_shard=args.fsdp_shard)
    out.update(persistent_bytes=report.persistent_bytes, round_pool_bytes=report.round_pool_bytes)
    out.update(peak_bytes=report.peak_bytes, fsdp_bytes=report.fsdp_bytes, device_bytes=report.device_bytes)
    out.update(host_pinned_bytes_per_rank=report.host_bytes)
    out.update(host_pinned_bytes_per_node=report.host_bytes * args.gpus_per_node)
    out.update({f"{k}_gib": out[k] / GIB for k in list(out) if k.endswith("_bytes") or "_bytes_per_" in k})
    out.update(persistent=report.persistent, round_pool=report.round_pool, temporaries=report.temporaries)
    out.update(host=report.host, host_transient=report.host_transient)
    out.update(fsdp=report.fsdp, fsdp_groups=report.fsdp_source, runtime=report.runtime)
    out["baselines_persistent_bytes"] = baselines(numel, args.world_size, param, args.fsdp_shard)
    out["lower_persistent_bytes"] = lower
    out["activation_bytes"] = activations
    margin = 0 if activations is not None else margin_bytes(args.gpu_gib)
    out.update(gpu_gib=args.gpu_gib, fits=left > 0, left_for_activations_bytes=left, margin_bytes=margin)
    out.update(fits_with_margin=left > 0 and left >= margin)
    print(json.dumps(out))


def lower_settings(
    args: argparse.Namespace, numel: int, param: torch.dtype, wire: torch.dtype | str, grad: torch.dtype, now: int
) -> dict[str, int]:
    """The persistent bytes per rank with each setting that holds less (one change at a time), where it does."""
    base = dict(param_dtype=param, comm_dtype=wire, grad_dtype=grad, schedule=args.schedule, optimizer=args.optimizer,
                gather_dtype=args.gather_dtype, ranks_per_node=args.gpus_per_node,
                error_feedback=args.error_feedback, fsdp_shard=args.fsdp_shard)  # fmt: skip
    changes: dict[str, dict] = {
        "--schedule sync (one buffer: no round runs beside the next micro-batches)": {"schedule": "sync"},
        "--grad_dtype bf16 (bf16 sums, model in bf16)": {"grad_dtype": torch.bfloat16},
        # with int8 gradients too: the round's buffer as int8 rows (deltas.PackedRound)
        "--gather_dtype int8 (int8 changes in the all-gather)": {"gather_dtype": "int8"},
    }
    if param == torch.float32:  # fp32 weights for a bf16 run: the model, its sums and its wire twice the size
        bf16 = {"param_dtype": torch.bfloat16} | ({"comm_dtype": torch.bfloat16} if args.comm_dtype == "auto" else {})
        changes["--param_dtype bf16 (load the weights in bf16: torch_dtype=torch.bfloat16)"] = bf16
    if args.world_size > args.fsdp_shard:
        changes["twice the machines (--world_size x 2)"] = {}
    out = {}
    for name, change in changes.items():
        world = args.world_size * (2 if name.startswith("twice") else 1)
        try:
            model, sent = change.get("param_dtype", param), change.get("comm_dtype", wire)
            check_grad_dtype(change.get("grad_dtype", grad), model if isinstance(sent, str) else sent, model)
            held = engine_memory(numel, world, **{**base, **change}).persistent_bytes
        except ValueError:
            continue
        if held < now:
            out[name] = held
    return out


def _name(dtype: torch.dtype | str) -> str:
    return dtype if isinstance(dtype, str) else next(k for k, v in DTYPES.items() if v == dtype)


if __name__ == "__main__":
    main()
