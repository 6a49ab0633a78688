"""The planner with FSDP inside each node (``python -m hf_acco.plan --fsdp``): Trainer's HSDP against ACCO's rounds
across nodes on each GPU's FSDP shard (README: "Models larger than ZeRO-1 holds"; docs/hsdp.md).

**The view across nodes.** FSDP2 shards every parameter over a node's ``g`` GPUs and reduce-scatters the gradients
inside the node every micro-batch, on NVLink; what crosses between the ``n`` nodes is each GPU's shard (``P / g``
elements), over the group of the ``n`` GPUs that hold the same shard, one per node. The ``g`` groups run at once
and share each node's network, ``inter / g`` each. So the step across nodes is the step of model.py on a cluster
of ``n`` ranks, one per node, each with ``inter / g`` of network, for a model of ``P / g`` parameters (and
``g`` times the tokens per micro-batch: one rank of the view stands for a node)::

    HSDP (Trainer)   = DDP    on the view: the shard's all-reduce across nodes in the last backward, per
                                            bucket as it becomes ready (FSDP2 per layer group)
    HSDP-ACCO sync   = ZeRO-1 on the view: one round (reduce-scatter + all-gather of the shard) after the compute
    HSDP-ACCO fixed  = ACCO   on the view: each half of the micro-batches hides one round

``--micro_batch_s`` is one micro-batch under FSDP on one node (its all-gathers and reduce-scatters inside the node
included): the same in every row. ACCO reduce-scatters inside the node every micro-batch (the engine reads the
sharded gradients); Trainer's HSDP does so with ``sync_each_batch`` (without, it keeps unsharded gradients while
accumulating: the whole model's gradients on every GPU). Paced accumulation is not available here (a node's GPUs
compute the same micro-batches). Memory per GPU: ``hf_acco.memory --fsdp_shard g`` (HSDP: FSDP2's fp32 masters,
gradients and moments over the node's GPUs), each with FSDP's working set and the CUDA context's and NCCL's
allowance.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import torch

from hf_acco.tools.device_memory import device_baseline
from hf_acco.tools.plan.memory_fit import setting_bytes
from hf_acco.tools.plan.model import Cluster, Job

METHODS = (("ddp", "fixed"), ("sync", "fixed"), ("acco", "fixed"))
NAMES = {("ddp", "fixed"): "HSDP (Trainer)", ("sync", "fixed"): "HSDP-ACCO sync", ("acco", "fixed"): "HSDP-ACCO fixed"}


def check(cluster: Cluster) -> str | None:
    """Why FSDP inside each node cannot run on ``cluster``, or None."""
    if cluster.nodes < 2:
        return "--fsdp needs 2 nodes or more (ACCO's rounds run between nodes; on one node FSDP alone is the tool)"
    if cluster.local < 2:
        return "--fsdp needs 2 GPUs per node or more (FSDP shards over a node's GPUs)"
    return None


def view(job: Job, cluster: Cluster) -> tuple[Job, Cluster]:
    """The job and cluster across nodes (the module docstring): one rank per node holding one FSDP shard, ``inter /
    g`` of network each; a node's micro-batch is its slowest GPU's (FSDP's collectives keep them in step)."""
    g, n = cluster.local, cluster.nodes
    times = job.times(cluster.gpus)
    per_node = [max(times[i * g : (i + 1) * g]) for i in range(n)]
    across = Cluster(gpus=n, gpus_per_node=1, intra_gbit=cluster.intra_gbit, inter_gbit=cluster.inter_gbit / g,
                     backend=cluster.backend)  # fmt: skip
    shard = replace(job, params=job.params / g, micro_batch_s=per_node if len(set(per_node)) > 1 else per_node[:1],
                    micro_batch_tokens=job.micro_batch_tokens * g)  # fmt: skip
    return shard, across


def memory(job: Job, cluster: Cluster, activations: int = 0) -> Any:
    """Bytes per GPU of a method's setting (``recommend``'s ``memory``; it is handed the view's job, whose wire and
    micro-batches are what varies): HSDP's FSDP2 with fp32 masters, or the engine over FSDP shards."""
    g = cluster.local

    def of(method: str, setting: Job) -> int:
        full = replace(setting, params=job.params)
        if method == "ddp":
            param = torch.bfloat16 if job.param_bytes == 2 else torch.float32
            return device_baseline("HSDP", int(job.params), cluster.gpus, param, g) + activations
        return setting_bytes(method, full, cluster, fsdp_shard=g) + activations

    return of


def recommendation(choice: dict[str, Any], cluster: Cluster) -> list[str]:
    """The chosen setting as training arguments."""
    layout = f"parallelism_config=ParallelismConfig(dp_replicate_size={cluster.nodes}, dp_shard_size={cluster.local})"
    k = choice["micro_batches"]
    if choice["method"] == "ddp":
        return [f"  transformers.Trainer with fsdp=True, fsdp_config={{'version': 2}}, {layout}, "
                f"gradient_accumulation_steps={k}"]  # fmt: skip
    schedule = "acco" if choice["method"] == "acco" else "sync"
    return [f"  ACCOTrainer with fsdp=True, fsdp_config={{'version': 2}}, {layout}, acco_schedule={schedule!r}, "
            f"gradient_accumulation_steps={k}"]  # fmt: skip
