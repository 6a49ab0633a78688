"""Whether a setting of the planner fits the GPU: ``hf_acco.memory``'s figures per GPU (``device_bytes``: the
persistent buffers, the rounds' cached temporaries, FSDP's working set where it shards the model, and the allowance
for the CUDA context and NCCL; the activations are added by the caller where the model's shape is known), and what
would make ACCO fit when nothing does. A setting fits when it leaves the margin: the activations when counted,
else ``memory.MARGIN`` of the GPU."""

from __future__ import annotations

from typing import Any

import torch

from hf_acco.tools.device_memory import device_baseline
from hf_acco.tools.memory import engine_memory
from hf_acco.tools.plan.model import CHANGES, INT8_BYTES, Cluster, Job


def setting_bytes(method: str, job: Job, cluster: Cluster, gpus: int | None = None, **changes: Any) -> int:
    """Bytes per GPU of ``method`` ("ddp", "sync": ACCO's ZeRO-1 schedule, "acco") for ``job`` on ``cluster``
    (or on ``gpus``), the engine's settings from the job's dtypes, with ``changes`` (``engine_memory``'s keywords)."""
    numel, world = int(job.params), gpus or cluster.gpus
    param = torch.bfloat16 if job.param_bytes == 2 else torch.float32
    if method == "ddp":
        return device_baseline("DDP", numel, world, param)
    wire: torch.dtype | str = "int8" if job.grad_bytes == INT8_BYTES else {2: torch.bfloat16}.get(
        int(job.grad_bytes), torch.float32)  # fmt: skip
    settings: dict[str, Any] = dict(
        param_dtype=param, comm_dtype=wire, schedule="sync" if method == "sync" else "acco",
        gather_dtype=CHANGES.get(job.gather_bytes or 0, "auto"), ranks_per_node=cluster.local,
    )  # fmt: skip
    settings.update(changes)
    return engine_memory(numel, world, **settings).device_bytes


def what_would_fit(job: Job, cluster: Cluster, gpu_bytes: float, most_machines: int = 64) -> list[str]:
    """ACCO's settings that would bring it under ``gpu_bytes`` per GPU, with their bytes: bf16 sums, then int8 on
    the wire too (gradients and parameter changes: the round's buffer in int8), then the fewest machines (up to
    ``most_machines``) with those, without and with FSDP inside each machine (which needs 2 machines or more)."""
    bf16 = torch.bfloat16
    lean = {"grad_dtype": bf16, "comm_dtype": "int8", "gather_dtype": "int8"}
    out = []
    int8 = "acco_grad_dtype='bf16', acco_comm_dtype='int8', acco_gather_dtype='int8'"
    for name, changes in (("acco_grad_dtype='bf16' (bf16 sums)", {"grad_dtype": bf16}), (int8, lean)):
        need = setting_bytes("acco", job, cluster, **changes)
        if need < gpu_bytes:
            out.append(f"{name}: {need / 1e9:.1f} GB per GPU ({(gpu_bytes - need) / 1e9:.1f} GB to spare)")
    g = cluster.local
    fsdp = {**lean, "fsdp_shard": g} if g > 1 else None
    for what, extra, start in (("", lean, cluster.nodes * 2), (" with FSDP inside each (README: Models larger than "
                               "ZeRO-1 holds)", fsdp, max(2, cluster.nodes))):  # fmt: skip
        machines = start
        while extra is not None and machines <= most_machines:
            need = setting_bytes("acco", job, cluster, machines * g, **extra)
            if need < gpu_bytes:
                out.append(f"{machines} machines of {g} GPUs{what}, {int8}: {need / 1e9:.1f} "
                           f"GB per GPU ({(gpu_bytes - need) / 1e9:.1f} GB to spare)")  # fmt: skip
                break
            machines *= 2
    return out
