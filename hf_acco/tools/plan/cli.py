"""The planner's command: ``python -m hf_acco.plan`` (its table, the recommendation as ACCOConfig arguments, the
formulas; ``--examples``: the README's table of typical clusters, with each row's command). The model: model.py."""

from __future__ import annotations

import argparse
import json
from dataclasses import asdict, replace
from typing import Any

from hf_acco.tools.cli_types import GPUS, NONNEGATIVE_FLOAT, POSITIVE_FLOAT, POSITIVE_INT
from hf_acco.tools.device_memory import GIB, MARGIN, margin_bytes
from hf_acco.tools.plan import fsdp as _fsdp
from hf_acco.tools.plan import model as _model
from hf_acco.tools.plan.memory_fit import setting_bytes, what_would_fit
from hf_acco.tools.plan.model import (
    CHANGES,
    FITTED,
    INT8_BYTES,
    METHODS,
    NAMES,
    NCCL_ALPHA_US,
    WIRES,
    Cluster,
    Constants,
    Job,
    bucket_numel,
    load_constants,
    predict,
    recommend,
)


def _table(rows: list[tuple[str, dict[str, float]]], ddp_step: float, gpu_bytes: float) -> str:
    out = ["| method | step (s) | / DDP | tokens/s | memory per GPU (GB) | compute (s) | communication (s) | "
           "exposed (s) | overhead (s) |", "|---|---:|---:|---:|---:|---:|---:|---:|---:|"]  # fmt: skip
    for name, r in rows:
        cells = [f"{r['step_s']:.3f}", f"{r['step_s'] / ddp_step:.2f}", f"{r['tokens_per_s']:,.0f}"]
        fits = "" if r["memory_bytes"] < gpu_bytes else " (does not fit)"
        cells.append(f"{r['memory_bytes'] / 1e9:.1f}{fits}")
        cells += [f"{r[key]:.3f}" for key in ("compute_s", "comm_s", "exposed_s", "overhead_s")]
        out.append(f"| {name} | " + " | ".join(cells) + " |")
    return "\n".join(out)


def _memory(cluster: Cluster, activations: int = 0) -> Any:
    return lambda method, job: setting_bytes(method, job, cluster) + activations


def _mode(job: Job, cluster: Cluster, activations: int, fsdp: bool) -> tuple[Any, Any, Job, Cluster, Any]:
    """(methods, their names, the job and cluster the step model sees, memory per GPU of a method's setting):
    ACCO over whole GPUs, or with FSDP inside each node (fsdp.py: the view across nodes)."""
    if not fsdp:
        return METHODS, NAMES, job, cluster, _memory(cluster, activations)
    return (_fsdp.METHODS, _fsdp.NAMES, *_fsdp.view(job, cluster), _fsdp.memory(job, cluster, activations))


def _activations(args: argparse.Namespace, job: Job, checkpointing: bool | None = None) -> int:
    """A micro-batch's activations (rough: model_shape.py) when the model's shape is known (--config), else 0."""
    if getattr(args, "config", None) is None:
        return 0
    from hf_acco.tools.model_shape import activation_bytes, shape_from_config

    ckpt = args.gradient_checkpointing if checkpointing is None else checkpointing
    return activation_bytes(shape_from_config(args.config), job.micro_batch_tokens, ckpt)


def usable_bytes(gpu_gib: float, activations: int) -> float:
    """What a setting may take of a GPU of ``gpu_gib``: all of it when its memory counts the activations, else all
    but the margin left for them (``memory.MARGIN`` of the GPU). The planner recommends nothing beyond it."""
    return gpu_gib * GIB - (0 if activations else margin_bytes(gpu_gib))


def _what_would_fit(job: Job, cluster: Cluster, gpu_bytes: float, activations: int, checkpointed: int | None) -> list:
    """``what_would_fit`` with the activations counted (``gpu_bytes``: ``usable_bytes``); gradient checkpointing
    first when it alone would do."""
    fixes = what_would_fit(job, cluster, gpu_bytes - activations)
    if checkpointed is not None:
        need = setting_bytes("acco", job, cluster) + checkpointed
        if need < gpu_bytes:
            fixes.insert(0, f"gradient_checkpointing=True: {need / 1e9:.1f} GB per GPU")
    return fixes


def report(
    job: Job, cluster: Cluster, c: Constants, tolerance: float = 0.05, gpu_gib: float = 80.0, explain: bool = False,
    activations: int = 0, checkpointed: int | None = None, fsdp: bool = False,
) -> str:  # fmt: skip
    """The planner's printout: the table at the stated settings (each method's memory per GPU beside it), the
    recommendation among the settings that fit, at the user's global batch; the formulas with ``explain``. With
    ``fsdp``: FSDP inside each node, Trainer's HSDP against ACCO across nodes (fsdp.py)."""
    gpu_bytes = usable_bytes(gpu_gib, activations)
    methods, names, step_job, step_cluster, memory = _mode(job, cluster, activations, fsdp)
    rows = [(names[m], {**predict(m[0], m[1], step_job, step_cluster, c), "memory_bytes": memory(m[0], step_job)})
            for m in methods]  # fmt: skip
    ddp_step = rows[0][1]["step_s"]
    rec = recommend(step_job, step_cluster, c, tolerance, ks=[job.micro_batches], methods=methods, memory=memory,
                    gpu_bytes=gpu_bytes)  # fmt: skip
    ch = rec["choice"]
    lines = [
        f"Cluster: {cluster.gpus} GPUs of {gpu_gib:g} GiB, {cluster.nodes} node(s) of {cluster.local}, intra "
        f"{cluster.intra_gbit:g} Gbit/s per GPU, inter {cluster.inter_gbit:g} Gbit/s per node; model "
        f"{job.params:.3g} parameters, {job.param_bytes}-byte weights, {WIRES[job.grad_bytes]} gradients on the "
        "wire (ACCO, ZeRO-1)"
        + (f", {CHANGES[job.gather_bytes]} parameter changes; " if job.gather_bytes in CHANGES else "; ")
        + f"{job.micro_batches} micro-batches per rank per step of "
        f"{', '.join(f'{t:g}' for t in sorted(set(job.micro_batch_s)))} s, {job.micro_batch_tokens} tokens each "
        f"(a global batch of {job.micro_batches * cluster.gpus * job.micro_batch_tokens:,} tokens, the same in "
        "every row)."
        + (
            f" FSDP inside each node over its {cluster.local} GPUs, the nodes as the replicate dimension."
            if fsdp
            else ""
        ),
        "",
        _table(rows, ddp_step, gpu_bytes),
        "",
        (
            "Memory per GPU: hf_acco.memory --fsdp_shard's peak (HSDP: FSDP2's fp32 masters, gradients and Adam "
            "moments over a node's GPUs), "
            if fsdp
            else "Memory per GPU: hf_acco.memory's peak (ZeRO-1: the engine's sync "
            "schedule; DDP: weights, fp32 gradients, master and Adam moments), "
        )
        + "with FSDP's working set and an allowance for the CUDA context and NCCL, "
        + (
            f"with a micro-batch's activations (roughly {activations / 1e9:.1f} GB)."
            if activations
            else f"activations not counted (--config and --micro_batch_size add them): a setting fits when it leaves "
            f"{MARGIN:.0%} of the GPU ({margin_bytes(gpu_gib) / 1e9:.1f} GB) for them."
        ),
    ]
    over = [f"{name} needs {r['memory_bytes'] / 1e9:.1f} GB" for name, r in rows if r["memory_bytes"] >= gpu_bytes]
    if over:
        lines.append(f"Over what a GPU of {gpu_gib:g} GiB allows ({gpu_bytes / 1e9:.1f} GB): " + "; ".join(over) + ".")
    if ch is None:
        fixes = _what_would_fit(job, cluster, gpu_bytes, activations, checkpointed)
        lines += ["", f"Nothing fits a GPU of {gpu_gib:g} GiB at these settings."]
        lines += ["What would (ACCO):", *(f"  {f}" for f in fixes)] if fixes else [
            "Nor with bf16 sums, int8 on the wire, twice the machines or FSDP inside each machine."]  # fmt: skip
    else:
        lines.append("")
        lines += _recommendation(step_job, step_cluster, c, ch, gpu_gib * GIB, names, cluster if fsdp else None)
    lines += ["", f"Constants (round / all-reduce): alpha {c.alpha_s['round'] * 1e6:.0f} / "
              f"{c.alpha_s['all_reduce'] * 1e6:.0f} us, efficiency {c.efficiency['round']:.2f} / "
              f"{c.efficiency['all_reduce']:.2f}; step overhead "
              + ", ".join(f"{m} {v * 1e3:.0f} ms" for m, v in c.overhead_s.items()) + f" ({c.source})."]  # fmt: skip
    if explain:
        lines += ["", _model.__doc__.split("**Collectives**")[1].split("``overhead`` is")[0].strip()]
        lines += ["", _fsdp.__doc__.split("**The view across nodes.**")[1].strip()] if fsdp else []
    else:
        lines.append("The formulas: --explain.")
    return "\n".join(lines)


def _recommendation(
    job: Job, cluster: Cluster, c: Constants, ch: dict[str, Any], gpu_bytes: float, names: dict = NAMES,
    fsdp_over: Cluster | None = None,
) -> list[str]:  # fmt: skip
    """The chosen setting, as training arguments; ``fsdp_over``: the whole cluster, FSDP inside its nodes."""
    left = gpu_bytes - ch["memory_bytes"]
    lines = [
        f"Recommended: {names[(ch['method'], ch['accumulation'])]}, {ch['micro_batches']} micro-batches per rank per "
        f"step: {ch['step_s']:.3f} s/step, {ch['tokens_per_s']:,.0f} tokens/s, {ch['memory_bytes'] / 1e9:.1f} GB per "
        f"GPU ({left / 1e9:.1f} GB left)."
    ]
    schedule = "acco" if ch["method"] == "acco" else "sync"
    if fsdp_over is not None:
        lines += _fsdp.recommendation(ch, fsdp_over)
    elif ch["method"] == "ddp":
        lines.append(f"  transformers.Trainer, gradient_accumulation_steps={ch['micro_batches']}")
    else:
        lines.append(f"  ACCOTrainer: acco_schedule={schedule!r}, acco_accumulation={ch['accumulation']!r}, "
                     f"gradient_accumulation_steps={ch['micro_batches']}")  # fmt: skip
    if ch["method"] == "ddp":
        return lines
    wire = WIRES[ch["grad_bytes"]]
    gather = f", acco_gather_dtype={CHANGES[job.gather_bytes]!r}" if job.gather_bytes in CHANGES else ""
    lines.append(f"  acco_comm_dtype={wire!r} (gradients on the wire){gather}, acco_bucket_numel="
                 f"{bucket_numel(replace(job, grad_bytes=ch['grad_bytes']), cluster, c)} (latency under 5 % "
                 "of a bucket's transfer)")  # fmt: skip
    return lines


# The typical clusters of the README's table (`python -m hf_acco.plan --examples` renders it): a 1.3 B-parameter
# bf16 model, micro-batches of 8 x 2048 tokens, 8 per step, on A100s (NVLink inside a node): 6 x 1.3e9 x 16384 =
# 1.3e14 FLOP a micro-batch, 0.8 s at about 160 TFLOP/s (half the A100's 312 bf16 peak: 50 % MFU)
COMMON = ["--params", "1.3e9", "--micro_batches", "8", "--intra_gbit", "2400", "--gpus_per_node", "8"]
# (--world_size: all GPUs of the job)
EXAMPLES = (
    ("1 node x 8 GPUs (NVLink)", [*COMMON, "--world_size", "8", "--micro_batch_s", "0.8"]),
    ("4 x 8 over 100 Gbit/s", [*COMMON, "--world_size", "32", "--inter_gbit", "100", "--micro_batch_s", "0.8"]),
    ("16 x 8 over 25 Gbit/s", [*COMMON, "--world_size", "128", "--inter_gbit", "25", "--micro_batch_s", "0.8"]),
    ("16 x 8 over 10 Gbit/s", [*COMMON, "--world_size", "128", "--inter_gbit", "10", "--micro_batch_s", "0.8"]),
    (
        "8 fast + 8 slow (2.5x) over 100 Gbit/s",
        [
            *COMMON,
            "--world_size",
            "16",
            "--inter_gbit",
            "100",
            "--micro_batch_s",
            "0.8",
            "2.0",
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
        "| cluster | DDP (s) | ZeRO-1 (s) | ACCO fixed (s) | ACCO paced (s) | recommended | its step (s), "
        "tokens/s vs DDP |",
        "|---|---:|---:|---:|---:|---|---|",
    ]
    commands = []
    for name, argv in EXAMPLES:
        out = main([*argv, "--quiet"])
        steps = [out["predictions"][f"{m}:{a}"]["step_s"] for m, a in METHODS]
        ch = out["recommendation"]
        if ch is None:  # (not in these examples: a 1.3B model fits every setting)
            lines.append(f"| {name} | " + " | ".join(f"{t:.2f}" for t in steps) + " | nothing fits | - |")
            continue
        wire = WIRES[ch["grad_bytes"]]
        k = ch["micro_batches"]
        how = f"{NAMES[(ch['method'], ch['accumulation'])]}, {k} micro-batch{'es' if k > 1 else ''}"
        how += f", {wire} wire" if ch["method"] != "ddp" else ""
        gain = ch["tokens_per_s"] / out["predictions"]["ddp:fixed"]["tokens_per_s"]
        lines.append(
            f"| {name} | " + " | ".join(f"{t:.2f}" for t in steps) + f" | {how} | {ch['step_s']:.2f}, {gain:.2f}x |"
        )
        commands.append(f"python -m hf_acco.plan {' '.join(argv)}")
    return "\n".join(lines) + "\n\n```bash\n" + "\n".join(commands) + "\n```\n"


def EFFICIENCY(text: str) -> float:  # noqa: N802 - an argparse type, named as the others
    """A share of the link rate: in (0, 1]."""
    value = POSITIVE_FLOAT(text)
    if value > 1:
        raise argparse.ArgumentTypeError(f"is a share of the link rate, in (0, 1], got {text}")
    return value


def make_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m hf_acco.plan", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)  # fmt: skip
    p.add_argument("--params", type=POSITIVE_FLOAT, help="trainable parameters, e.g. 1.3e9 (or --config)")
    p.add_argument("--config", default=None, help="a transformers config.json (or its folder): its parameter count")
    p.add_argument(
        "--world_size",
        "--gpus",
        dest="gpus",
        type=POSITIVE_INT,
        help="GPUs (ranks) of the job, all nodes together (required)",
    )
    p.add_argument("--gpus_per_node", type=POSITIVE_INT, default=8)
    p.add_argument(
        "--intra_gbit",
        type=POSITIVE_FLOAT,
        default=3600.0,
        help="Gbit/s each way per GPU inside a node (default: H100 NVLink 4, 450 GB/s each way; A100 NVLink 3: "
        "2400; PCIe 4.0 x16: about 200)",
    )
    p.add_argument(
        "--inter_gbit",
        type=POSITIVE_FLOAT,
        default=100.0,
        help="Gbit/s each way per node between nodes, all its NICs together (8 x 400 Gbit/s InfiniBand: 3200)",
    )
    p.add_argument(
        "--micro_batch_s",
        type=POSITIVE_FLOAT,
        nargs="+",
        default=None,
        help="forward + backward of one micro-batch; one value, or one per GPU group with --group_gpus",
    )
    p.add_argument(
        "--group_gpus",
        type=POSITIVE_INT,
        nargs="+",
        default=None,
        help="GPUs of each --micro_batch_s (a mixed cluster: --micro_batch_s 0.12 0.2 --group_gpus 16 16)",
    )
    p.add_argument("--tokens_per_s", type=POSITIVE_FLOAT, default=None, help="instead of --micro_batch_s: per GPU")
    p.add_argument(
        "--gpu", choices=sorted(GPUS), default=None,
        help="instead of --micro_batch_s: the GPU, whose bf16 peak x --mfu sets it (6 x params x tokens FLOP a "
        "micro-batch); also --gpu_gib's default",
    )  # fmt: skip
    p.add_argument("--mfu", type=EFFICIENCY, default=0.4, help="with --gpu: the share of its peak the model reaches")
    p.add_argument(
        "--micro_batch_tokens", type=POSITIVE_INT, default=16384, help="tokens of one micro-batch (8 x 2048)"
    )
    p.add_argument(
        "--micro_batch_size", type=POSITIVE_INT, default=None, help="sequences a micro-batch (with --seq_len)"
    )
    p.add_argument("--seq_len", type=POSITIVE_INT, default=2048, help="tokens a sequence")
    p.add_argument("--gradient_checkpointing", action="store_true", help="with --config: the activations' memory")
    p.add_argument(
        "--micro_batches",
        type=POSITIVE_INT,
        default=8,
        help="per GPU per step (every method in the plan uses this many)",
    )
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
        choices=["auto", "bf16", "fp32", "int8"],
        default="auto",
        help="ACCO / ZeRO-1's gradients on the wire (acco_comm_dtype; its default auto: the model's dtype)",
    )
    p.add_argument(
        "--gather_dtype",
        choices=["auto", *CHANGES.values()],
        default="auto",
        help="ACCO / ZeRO-1's parameters in the all-gather (acco_gather_dtype; auto: the model's dtype)",
    )
    _add_model_args(p)
    return p


def _add_model_args(p: argparse.ArgumentParser) -> None:
    """The cost model's own settings: the backend, its latency and efficiency, another fit; the output."""
    p.add_argument(
        "--backend",
        choices=["nccl", "gloo"],
        default="nccl",
        help="nccl: rings, alpha NCCL_ALPHA_US (stated: the benchmark runs gloo); gloo: the engine's "
        "all-to-all reduce-scatter, the fitted alpha",
    )
    p.add_argument(
        "--alpha_us", type=NONNEGATIVE_FLOAT, default=None, help="the latency per ring step (overrides --backend's)"
    )
    p.add_argument("--efficiency", type=EFFICIENCY, default=None, help="override the fitted share of the link rate")
    p.add_argument("--constants", default=None, help="a constants.json of `python -m hf_acco.tools.plan.calibrate` "
                   "(on your cluster) or of the scaling benchmark")  # fmt: skip
    p.add_argument(
        "--gpu_gib", type=POSITIVE_FLOAT, default=None, help="each GPU's memory (default: --gpu's, else 80)"
    )
    p.add_argument("--fsdp", action="store_true", help="FSDP inside each node over its --gpus_per_node GPUs, ACCO "
                   "across nodes: Trainer's HSDP against HSDP-ACCO (models beyond ZeRO-1's reach)")  # fmt: skip
    p.add_argument("--explain", action="store_true", help="print the cost model's formulas too")
    p.add_argument("--json", action="store_true", help="print the predictions as JSON")
    p.add_argument("--quiet", action="store_true", help="print nothing (for callers that read the returned dict)")
    p.add_argument("--examples", action="store_true", help="print the table of typical clusters, with commands")


def job_from_args(args: argparse.Namespace, parser: argparse.ArgumentParser) -> Job:
    if args.params is None and getattr(args, "config", None) is not None:
        from hf_acco.tools.model_shape import shape_from_config

        try:
            args.params = float(shape_from_config(args.config).params)
        except (ValueError, OSError) as e:
            parser.error(str(e))
    if args.params is None or args.gpus is None:
        parser.error("state --params (trainable parameters) or --config, and --world_size (GPUs, all nodes together)")
    if args.gpus > args.gpus_per_node and args.gpus % args.gpus_per_node:
        parser.error(f"--world_size ({args.gpus}) is whole nodes of --gpus_per_node ({args.gpus_per_node}) GPUs")
    if args.micro_batch_size is not None:
        args.micro_batch_tokens = args.micro_batch_size * args.seq_len
    if args.gpu is not None and args.micro_batch_s is None and args.tokens_per_s is None:
        peak, _ = GPUS[args.gpu]
        args.micro_batch_s = [6 * args.params * args.micro_batch_tokens / (peak * args.mfu)]
    if (args.micro_batch_s is None) == (args.tokens_per_s is None):
        parser.error("state one of --micro_batch_s (seconds per micro-batch), --tokens_per_s (per GPU) or --gpu")
    times = args.micro_batch_s or [args.micro_batch_tokens / args.tokens_per_s]
    if args.group_gpus is not None:
        if len(args.group_gpus) != len(times) or sum(args.group_gpus) != args.gpus:
            parser.error("--group_gpus needs one count per --micro_batch_s, adding up to --world_size")
        times = [t for t, n in zip(times, args.group_gpus) for _ in range(n)]
    elif len(times) > 1:
        parser.error("several --micro_batch_s need --group_gpus (how many GPUs have each)")
    nbytes = {"bf16": 2, "fp32": 4, "int8": INT8_BYTES}
    wire = args.model_dtype if args.comm_dtype == "auto" else args.comm_dtype
    gather = {v: k for k, v in CHANGES.items()}.get(args.gather_dtype)
    return Job(params=args.params, micro_batch_s=times, micro_batches=args.micro_batches,
               micro_batch_tokens=args.micro_batch_tokens, grad_bytes=nbytes[wire],
               param_bytes=int(nbytes[args.model_dtype]), gather_bytes=gather)  # fmt: skip


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = make_parser()
    args = parser.parse_args(argv)
    if args.examples:
        print(examples_table())
        return {}
    c = load_constants(args.constants) if args.constants else FITTED
    if args.alpha_us is None and args.backend == "nccl" and not args.constants:  # (a calibrated file has its own)
        args.alpha_us = NCCL_ALPHA_US
    if args.alpha_us is not None:
        whose = "NCCL's stated" if args.backend == "nccl" and args.alpha_us == NCCL_ALPHA_US else "stated"
        c = replace(c, alpha_s=dict.fromkeys(c.alpha_s, args.alpha_us * 1e-6), source=f"{c.source}; alpha {whose}")
    if args.efficiency is not None:
        stated = dict.fromkeys(c.efficiency, args.efficiency)
        c = replace(c, efficiency=stated, source=f"{c.source}, efficiency stated")
    job = job_from_args(args, parser)
    if args.gpu_gib is None:
        args.gpu_gib = float(GPUS[args.gpu][1]) if args.gpu else 80.0
    cluster = Cluster(args.gpus, args.gpus_per_node, args.intra_gbit, args.inter_gbit, args.backend)
    why = _fsdp.check(cluster) if args.fsdp else None
    if why:
        parser.error(why)
    activations = _activations(args, job)
    methods, _, step_job, step_cluster, memory = _mode(job, cluster, activations, args.fsdp)
    predictions = {f"{m}:{a}": {**predict(m, a, step_job, step_cluster, c), "memory_bytes": memory(m, step_job)}
                   for m, a in methods}  # fmt: skip
    gpu_bytes = usable_bytes(args.gpu_gib, activations)
    rec = recommend(step_job, step_cluster, c, ks=[job.micro_batches], methods=methods, memory=memory,
                    gpu_bytes=gpu_bytes)  # fmt: skip
    checkpointed = None if args.gradient_checkpointing or not activations else _activations(args, job, True)
    fixes = _what_would_fit(job, cluster, gpu_bytes, activations, checkpointed) if rec["choice"] is None else []
    out = {"constants": asdict(c), "gpu_gib": args.gpu_gib, "usable_bytes": gpu_bytes, "predictions": predictions,
           "recommendation": rec["choice"], "what_would_fit": fixes}  # fmt: skip
    if not args.quiet:
        print(json.dumps(out, indent=1) if args.json else report(job, cluster, c, gpu_gib=args.gpu_gib,
                                                                  explain=args.explain,
                                                                  activations=activations,
                                                                  checkpointed=checkpointed,
                                                                  fsdp=args.fsdp))  # fmt: skip
    return out
