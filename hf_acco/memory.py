"""Bytes per rank of every buffer the engine holds, next to DDP, ZeRO-1 and ZeRO-2 for the same model.

    python -m hf_acco.memory --params 7e9 --world_size 8 --param_dtype bf16 [--comm_dtype bf16] [--grad_dtype bf16]
                             [--json]

The engine's figures come from the code that allocates its buffers: the flat layout (``FlatLayout``, padding and
buckets included), the buffer pair's dtypes (``buffers.comm_allocation``), where a round keeps the shard gradient
(``buffers.shard_grad_room``: in its buffer, else a tensor of its own), the shard optimizer's master and
per-element state, the boundary shard (``ShardCheckpoint``). ``tests/test_memory.py`` checks them against the
tensors a built engine really holds. Persistent: on the device for the whole run. Peak: persistent plus the
largest temporary on the device (a commit round's inner optimizer step: torch's foreach Adam allocates a
shard-sized square root of the second moment; a round's estimate windows; on gloo its all-to-all receive
buffers). Host: the
boundary shard (for mid-step checkpoints) and, during evaluation and saving, a copy of the model's parameters in
its dtype live in (pinned) host memory; a resume stages through the accumulation buffer.

The baselines, per rank, for a model whose weights are in ``param_dtype`` and whose gradients accumulate in fp32
(as DeepSpeed does with bf16; Adam(W): two fp32 moments): DDP, every rank everything; ZeRO-1, master and moments
sharded; ZeRO-2, the fp32 gradient sharded too. Activations are not counted anywhere.
"""

from __future__ import annotations

import argparse
import json
from dataclasses import dataclass, field

import torch

from .buffers import ACCUM_DTYPE, SHARD_GRAD_DTYPE, check_grad_dtype, comm_allocation, shard_grad_room
from .optim import ESTIMATE_TEMPORARIES, estimate_window
from .sharding import FlatLayout

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
ADAM_STATE_PER_ELEMENT = 2  # exp_avg, exp_avg_sq


@dataclass
class MemoryReport:
    """Bytes per rank: what is held for the whole run, and the temporaries on top of it at their peak."""

    persistent: dict[str, int]  # on the device
    temporaries: dict[str, int] = field(default_factory=dict)  # on the device, one at a time
    host: dict[str, int] = field(default_factory=dict)  # in (pinned) host memory, at most

    @property
    def persistent_bytes(self) -> int:
        return sum(self.persistent.values())

    @property
    def peak_bytes(self) -> int:
        return self.persistent_bytes + max(self.temporaries.values(), default=0)

    @property
    def host_bytes(self) -> int:
        return sum(self.host.values())


def engine_memory(
    numel: int,
    world_size: int,
    *,
    param_dtype: torch.dtype = torch.float32,
    comm_dtype: torch.dtype = torch.float32,
    grad_dtype: torch.dtype = ACCUM_DTYPE,
    schedule: str = "acco",
    backend: str = "nccl",
    bucket_numel: int | None = None,
    state_per_element: int = ADAM_STATE_PER_ELEMENT,
    max_inflight: int = 4,
) -> MemoryReport:
    """The engine's memory per rank for ``numel`` trainable parameters on ``world_size`` ranks."""
    layout = FlatLayout([torch.empty(numel, device="meta")], ["all"], [0], world_size, bucket_numel, backend)
    full, shard = layout.padded_numel, layout.shard_numel
    fp32 = torch.float32.itemsize
    check_grad_dtype(grad_dtype, comm_dtype, param_dtype)
    comm = comm_allocation(param_dtype, comm_dtype, schedule != "sync", grad_dtype)
    room = shard_grad_room(grad_dtype if comm is None else comm, comm_dtype, world_size, layout.chunk)
    persistent = {
        "parameters (the model's)": numel * param_dtype.itemsize,
        "gradient accumulation buffer (full)": full * grad_dtype.itemsize,
        "round buffer (full)": 0 if comm is None else full * comm.itemsize,
        "master shard (fp32)": shard * fp32,
        "shard gradient (fp32; 0: in the round's buffer)": 0 if room else shard * SHARD_GRAD_DTYPE.itemsize,
        "optimizer state shard (fp32)": state_per_element * shard * fp32,
    }
    window = min(shard, estimate_window(shard))
    temporaries = {
        "round: Adam estimate windows": ESTIMATE_TEMPORARIES * window * fp32,
        # torch's foreach Adam(W) (the CUDA default) allocates the square root of the second moment at once
        "round: commit step (the inner optimizer's own temporaries)": shard * fp32,
    }
    host = {  # a resume stages through the accumulation buffer (free at a step boundary): nothing more
        "boundary shard (fp32, for mid-step checkpoints)": shard * fp32,
        "evaluation / saving: backup of the model's parameters (model dtype, full)": full * param_dtype.itemsize,
    }
    if backend == "gloo":
        wire = comm_dtype.itemsize
        temporaries["round: all-to-all receive buffers"] = (
            min(max_inflight, layout.num_buckets) * layout.bucket_size * wire
        )
    return MemoryReport(persistent, temporaries, host)


def engine_memory_of(opt) -> MemoryReport:  # noqa: ANN001 - an ACCOOptimizer (not imported: no cycle)
    """The report for a built engine, from its own layout and settings."""
    return engine_memory(
        opt.layout.numel, opt.layout.world_size, param_dtype=opt.buffers.param_dtype,
        comm_dtype=opt.buffers.comm_dtype, grad_dtype=opt.buffers.accum.dtype, schedule=opt.schedule.value,
        backend=opt.comm.backend,
        bucket_numel=opt.layout.bucket_numel, state_per_element=len(opt.shard.state_tensors()[0]) or 2,
        max_inflight=opt.comm.max_inflight,
    )  # fmt: skip


def baselines(numel: int, world_size: int, param_dtype: torch.dtype) -> dict[str, int]:
    """Persistent bytes per rank of DDP, ZeRO-1 and ZeRO-2 (fp32 gradient accumulation, Adam(W))."""
    params, grads, master, moments = numel * param_dtype.itemsize, 4 * numel, 4 * numel, 8 * numel
    return {
        "DDP": params + grads + master + moments,
        "ZeRO-1": params + grads + (master + moments) // world_size,
        "ZeRO-2": params + (grads + master + moments) // world_size,
    }


def table(
    numel: int,
    world_size: int,
    param_dtype: torch.dtype,
    comm_dtype: torch.dtype,
    grad_dtype: torch.dtype,
    schedule: str,
) -> str:
    report = engine_memory(
        numel, world_size, param_dtype=param_dtype, comm_dtype=comm_dtype, grad_dtype=grad_dtype, schedule=schedule
    )
    gb = 1e9
    lines = [f"hf_acco ({schedule}, {_name(comm_dtype)} on the wire, {_name(grad_dtype)} accumulation), per rank, "
             f"{numel / 1e9:.3g}B parameters in {_name(param_dtype)} on {world_size} ranks:", "", "| buffer | GB |",
             "|---|---|"]  # fmt: skip
    lines += [f"| {name} | {n / gb:.2f} |" for name, n in report.persistent.items() if n]
    lines += [f"| **persistent** | **{report.persistent_bytes / gb:.2f}** |"]
    lines += [f"| + {name} | {n / gb:.2f} |" for name, n in report.temporaries.items()]
    lines += [f"| **peak** | **{report.peak_bytes / gb:.2f}** |"]
    lines += [f"| host: {name} | {n / gb:.2f} |" for name, n in report.host.items()]
    lines += ["", "| baseline | persistent GB |", "|---|---|"]
    lines += [f"| {name} | {n / gb:.2f} |" for name, n in baselines(numel, world_size, param_dtype).items()]
    return "\n".join(lines)


def _name(dtype: torch.dtype) -> str:
    return next(k for k, v in DTYPES.items() if v == dtype)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m hf_acco.memory", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)  # fmt: skip
    p.add_argument("--params", type=float, required=True, help="trainable parameters, e.g. 7e9")
    p.add_argument("--world_size", type=int, default=8)
    p.add_argument("--param_dtype", choices=sorted(DTYPES), default="bf16")
    p.add_argument("--comm_dtype", choices=sorted(DTYPES), default="fp32", help="gradients on the wire")
    p.add_argument("--grad_dtype", choices=sorted(DTYPES), default="fp32", help="gradient accumulation")
    p.add_argument("--schedule", choices=["acco", "dpu", "sync"], default="acco")
    p.add_argument("--json", action="store_true", help="one JSON object instead of the tables")
    args = p.parse_args(argv)
    numel, param, comm = int(args.params), DTYPES[args.param_dtype], DTYPES[args.comm_dtype]
    grad = DTYPES[args.grad_dtype]
    try:
        check_grad_dtype(grad, comm, param)
    except ValueError as e:
        p.error(str(e))
    if not args.json:
        print(table(numel, args.world_size, param, comm, grad, args.schedule))
        return
    report = engine_memory(
        numel, args.world_size, param_dtype=param, comm_dtype=comm, grad_dtype=grad, schedule=args.schedule
    )
    print(json.dumps({
        "params": numel, "world_size": args.world_size, "param_dtype": args.param_dtype,
        "comm_dtype": args.comm_dtype, "grad_dtype": args.grad_dtype, "schedule": args.schedule,
        "persistent_bytes": report.persistent_bytes, "peak_bytes": report.peak_bytes, "host_bytes": report.host_bytes,
        "persistent": report.persistent, "temporaries": report.temporaries, "host": report.host,
        "baselines_persistent_bytes": baselines(numel, args.world_size, param),
    }))  # fmt: skip


if __name__ == "__main__":
    main()
