"""FSDP2 inside each machine, ACCO across machines, set up from Accelerate's configuration (docs/hsdp.md).

The user configures FSDP2 the way they would for Trainer's HSDP: ``fsdp_version: 2`` and a parallelism config of
``dp_replicate_size`` machines x ``dp_shard_size`` ranks (an accelerate config file, or ``fsdp``/``fsdp_config``/
``parallelism_config`` in the training arguments). Where Accelerate would shard each parameter over the 2-D mesh
(HSDP: an all-reduce across machines after every backward, blocking), this shards it over the machine's own ranks
(the mesh's ``dp_shard_cp`` dimension) with Accelerate's own ``fsdp2_prepare_model`` (its wrapping policy, mixed
precision, tail group, low-memory loading), and the engine's rounds take the cross-machine part over, on the
``dp_replicate`` group: one rank per machine, each holding the same FSDP shard.
"""

from __future__ import annotations

import os
import warnings
from types import SimpleNamespace
from typing import Any

import torch
import torch.distributed as dist

ONE_MACHINE = (
    "FSDP with ACCO needs several machines: ACCO runs its rounds across machines (dp_replicate_size), FSDP shards "
    "inside each (dp_shard_size). On one machine FSDP alone is the right tool: use transformers.Trainer with FSDP, "
    "or set parallelism_config=ParallelismConfig(dp_replicate_size=<machines>, dp_shard_size=<GPUs per machine>)."
)


def hsdp_layout(accelerator: Any) -> tuple[int, int] | None:
    """(machines, ranks per machine) when Accelerate is set up for FSDP (it has an FSDP plugin), else None.
    Refuses, with what to do instead, what this mode cannot run."""
    plugin = getattr(accelerator.state, "fsdp_plugin", None)
    if plugin is None:
        return None
    if getattr(plugin, "fsdp_version", 1) != 2:
        raise ValueError(
            "ACCO runs inside FSDP2 only (fsdp_version: 2); FSDP1 shards flat parameters ACCO cannot address. Set "
            "fsdp_config={'version': 2} (or fsdp_version: 2 in the accelerate config)."
        )
    pc = getattr(accelerator, "parallelism_config", None)
    if pc is None or pc.dp_replicate_size < 2:
        raise ValueError(ONE_MACHINE)
    if pc.dp_shard_size < 2:
        raise ValueError(
            "dp_shard_size=1: FSDP would shard over one rank. Without FSDP, ACCO alone shards the optimizer state "
            "(ZeRO-1): remove the FSDP configuration, or set dp_shard_size to the GPUs per machine."
        )
    if any((getattr(pc, name, 1) or 1) > 1 for name in ("tp_size", "cp_size", "sp_size")):
        raise ValueError(
            "ACCO with FSDP is data parallelism only: tensor, context and sequence parallelism are not supported. "
            "Set tp_size, cp_size and sp_size to 1 in the parallelism config."
        )
    from torch.distributed.fsdp import CPUOffloadPolicy

    if isinstance(plugin.cpu_offload, CPUOffloadPolicy):
        raise ValueError(
            "FSDP's CPU offload is not supported with ACCO (its rounds step the optimizer on the GPU shard). Remove "
            "cpu_offload / fsdp_offload_params; more machines, acco_grad_dtype='bf16' or int8 on the wire lower "
            "the memory instead (python -m hf_acco.memory --fsdp_shard ... says by how much)."
        )
    if plugin.activation_checkpointing:
        raise ValueError(
            "FSDP's activation_checkpointing is applied by Accelerate after the model is sharded, which ACCO shards "
            "earlier. Use gradient_checkpointing=True in the training arguments instead (the same recomputation)."
        )
    if plugin.ignored_modules is not None:
        raise ValueError(
            "FSDP's ignored_modules are not supported with ACCO: FSDP does not reduce their gradients inside a "
            "machine, so the ranks of a machine would drift apart. Freeze them, or leave them to FSDP."
        )
    if getattr(accelerator, "mixed_precision", "no") == "fp8":
        raise ValueError("fp8 training is not supported with ACCO: use mixed_precision='bf16'.")
    local = os.environ.get("LOCAL_WORLD_SIZE")
    if local is not None and int(local) != pc.dp_shard_size:
        warnings.warn(
            f"dp_shard_size={pc.dp_shard_size} but {local} processes per machine (LOCAL_WORLD_SIZE): FSDP's "
            "collectives run every micro-batch and are meant to stay inside a machine. Set dp_shard_size to the "
            "GPUs per machine.",
            stacklevel=2,
        )
    return pc.dp_replicate_size, pc.dp_shard_size


class _OneMachineView:
    """The accelerator as ``fsdp2_prepare_model`` reads it, except that FSDP's mesh is the machine's own ranks
    (``dp_shard_cp``) instead of HSDP's 2-D (``dp_replicate``, ``dp_shard_cp``), and, where ``keep_dtype``, no
    mixed precision for its fp32 upcast of the trainable parameters to read (its policy is the plugin's, unchanged)."""

    def __init__(self, accelerator: Any, keep_dtype: bool) -> None:
        self._accelerator = accelerator
        self.parallelism_config = SimpleNamespace(fsdp_dim_names=["dp_shard_cp"])
        if keep_dtype:
            self.mixed_precision = "no"

    def __getattr__(self, name: str) -> Any:
        return getattr(self._accelerator, name)


def shard_within_machines(accelerator: Any, model: torch.nn.Module) -> torch.nn.Module:
    """``fully_shard`` the model over each machine's ranks, in place, as Accelerate would for FSDP2 (its wrapping
    policy, mixed precision policy, tail group, low-memory loading). Done before the engine exists: Accelerate's
    later ``prepare`` sees an FSDP model and leaves it as it is.

    The trainable parameters keep their dtype where they share one (a bf16 model's shards stay bf16): Accelerate
    upcasts them to fp32 under mixed precision because its optimizer steps FSDP's shards, which must then be the
    fp32 masters; here the engine steps its own fp32 master shard and FSDP's parameters are what the forward reads,
    as without FSDP. Trainable parameters of several dtypes are upcast as Accelerate does (FSDP needs one)."""
    from accelerate.utils.fsdp_utils import fsdp2_prepare_model

    dtypes = {p.dtype for p in model.parameters() if p.requires_grad}
    return fsdp2_prepare_model(_OneMachineView(accelerator, keep_dtype=len(dtypes) == 1), model)


def chunk_slice(size: int, parts: int, index: int) -> slice:
    """Where chunk ``index`` of ``torch.chunk(tensor, parts)`` lies along a dimension of ``size`` (FSDP2's and
    DTensor's ``Shard``: chunks of ``ceil(size / parts)``, the last ones shorter or empty)."""
    chunk = -(-size // parts)
    start = min(index * chunk, size)
    return slice(start, start + max(0, min(chunk, size - start)))


def local_piece(param: Any) -> tuple[slice, ...]:
    """Where ``param``'s local shard (an FSDP2 DTensor's, sharded along one dimension over its mesh, as torch.chunk
    splits it) lies in the whole parameter; the whole of a plain tensor."""
    from torch.distributed.tensor import DTensor, Shard

    whole = tuple(slice(0, n) for n in param.shape)
    if not isinstance(param, DTensor):
        return whole
    (placement,) = param.placements
    if not isinstance(placement, Shard):
        return whole
    dim = placement.dim
    piece = chunk_slice(param.shape[dim], param.device_mesh.size(), param.device_mesh.get_local_rank())
    if piece.stop - piece.start != param.to_local().shape[dim]:
        raise ValueError(f"FSDP's local shard of a parameter of shape {tuple(param.shape)} is not torch.chunk's")
    return whole[:dim] + (piece,) + whole[dim + 1 :]


def check_args(args: Any) -> None:
    """What the training arguments ask for that this mode cannot honour (``args``: Trainer's)."""
    if getattr(args, "save_on_each_node", False):
        raise ValueError(
            "save_on_each_node=True with FSDP: the full model files come from the first rank only (FSDP gathers "
            "them there), so the other machines' checkpoints would lack them. Save to a file system every machine "
            "shares (save_on_each_node=False)."
        )


def sync_every_micro_batch(accelerator: Any) -> None:
    """Turn Accelerate's ``no_sync`` off (``sync_each_batch``, read by Trainer's loop and ``accumulate``): the engine
    takes each micro-batch's reduce-scattered shard in FSDP's gradient hooks, which ``no_sync`` (FSDP's
    ``set_requires_gradient_sync(False)``: full unsharded gradients) would skip. Set again at every ``train()``:
    another Accelerator made in this process resets the shared gradient state."""
    accelerator.gradient_state.plugin_kwargs["sync_each_batch"] = True


def replicate_group(accelerator: Any) -> dist.ProcessGroup:
    """The engine's group: the ranks holding the same FSDP shard, one per machine."""
    return accelerator.torch_device_mesh["dp_replicate"].get_group()


def is_sharded(model: torch.nn.Module) -> bool:
    from torch.distributed.fsdp import FSDPModule

    return isinstance(model, FSDPModule)


def reshard(model: torch.nn.Module) -> None:
    """Every FSDP group back to its sharded parameters. A forward without backward (evaluation) leaves the groups
    FSDP does not reshard after forward (the root, Accelerate's tail) holding unsharded copies, which would not see
    the engine's next write of the local shards."""
    from torch.distributed.fsdp import FSDPModule

    for module in model.modules():
        if isinstance(module, FSDPModule):
            module.reshard()
