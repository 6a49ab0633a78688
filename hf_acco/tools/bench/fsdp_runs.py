"""The benchmark's FSDP methods (``python -m hf_acco.tools.bench.hsdp``): FSDP2 inside each node of the two-level
network, with what crosses between nodes done by HSDP's own all-reduce (``hsdp``, as Trainer runs HSDP: no
synchronisation while accumulating, then FSDP's reduce-scatter inside the node and all-reduce across nodes in the
last backward) or by ACCO's rounds (``hsdp_acco``, ``hsdp_sync``: FSDP inside the node every micro-batch, the
engine over the ranks holding the same FSDP shard, one per node). Ranks are numbered node by node, as ``Link``
and launchers number them."""

from __future__ import annotations

import contextlib
import statistics
import time
from collections.abc import Iterator
from typing import Any

import torch
import torch.distributed as dist

from hf_acco.comm.communicator import Communicator
from hf_acco.comm.sharding import FlatLayout
from hf_acco.engine.core import ACCOOptimizer
from hf_acco.tools.collectives import one_collective

METHODS = ("hsdp", "hsdp_acco", "hsdp_sync")


class HSDPModel:
    """The HSDP baseline as the training loop drives DDP: ``no_sync()`` while accumulating, a call is a forward."""

    def __init__(self, model: torch.nn.Module) -> None:
        self.module = model

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        self.module.set_requires_gradient_sync(False)  # type: ignore[operator]  # (an FSDPModule)
        try:
            yield
        finally:
            self.module.set_requires_gradient_sync(True)  # type: ignore[operator]

    def __call__(self, **kwargs: Any) -> Any:
        return self.module(**kwargs)


def _shard(model: torch.nn.Module, mesh: Any) -> None:
    from torch.distributed.fsdp import fully_shard

    for layer in model.model.layers:  # type: ignore[union-attr]  # a LlamaForCausalLM
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)


def build(run: dict[str, Any], spec: dict[str, Any], model: torch.nn.Module, k: int, max_grad_norm: float) -> tuple:
    """(HSDP wrapper or None, optimizer) for an FSDP method; the model is sharded in place."""
    from torch.distributed.device_mesh import init_device_mesh

    per_node = spec["fsdp_shard"]
    shape = (dist.get_world_size() // per_node, per_node)
    mesh = init_device_mesh("cpu", shape, mesh_dim_names=("dp_replicate", "dp_shard"))
    if run["method"] == "hsdp":  # FSDP2 on the 2-D mesh: HSDP (Replicate, Shard)
        _shard(model, mesh)
        return HSDPModel(model), torch.optim.AdamW(model.parameters(), lr=spec["lr"], weight_decay=0.0)
    _shard(model, mesh["dp_shard"])
    opt = ACCOOptimizer(model.parameters(), schedule=run["method"].split("_")[1], micro_batches=k,
                        max_grad_norm=max_grad_norm, lr=spec["lr"], weight_decay=0.0,
                        group=mesh.get_group("dp_replicate"))  # fmt: skip
    return None, opt


def clip(model: Any, max_norm: float) -> None:
    """Trainer's clipping of an FSDP model's gradients: the global norm over the DTensor gradients."""
    torch.nn.utils.clip_grad_norm_(model.module.parameters(), max_norm)


def comm_alone(model: torch.nn.Module, per_node: int, repeats: int) -> dict[str, float | None]:
    """What crosses between nodes, alone: every rank at once, over its group of the ranks holding the same FSDP
    shard (one per node; a node's groups share its uplink, as they will while training), one FSDP shard's worth of
    fp32 gradients: ACCO's round (reduce-scatter + all-gather) and HSDP's all-reduce."""
    numel = sum(p.numel() for p in model.parameters() if p.requires_grad)
    world, rank = dist.get_world_size(), dist.get_rank()
    groups = [dist.new_group(list(range(s, world, per_node))) for s in range(per_node)]
    group = groups[rank % per_node]
    out: dict[str, float | None] = {"numel": float(numel)}
    for name in ("all_to_all", "all_reduce"):
        comm = Communicator(group, reduce_scatter="native" if name == "all_reduce" else name)
        shard_params = [torch.empty(-(-numel // per_node))]
        layout = FlatLayout(shard_params, ["shard"], [0], comm.world_size)
        flat, shard = layout.new_flat("cpu"), torch.zeros(layout.shard_numel)
        flat.normal_()
        seconds = []
        for _ in range(repeats + 1):
            dist.barrier()
            t0 = time.perf_counter()
            one_collective(comm, name, layout, flat, shard)
            seconds.append(time.perf_counter() - t0)
        out[f"{name}_s"] = statistics.median(seconds[1:])
        comm.destroy()
    return out
