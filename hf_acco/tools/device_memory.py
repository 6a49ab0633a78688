"""What a GPU holds beside the engine's buffers (``python -m hf_acco.memory``): FSDP2's working set where it shards
the model inside machines (``--fsdp_shard``), the allowance for the CUDA context and NCCL that no tensor shows; the
baselines' bytes counted alike; and the verdict, with the margin it leaves for the activations.

FSDP2 (torch 2.13, ``torch/distributed/fsdp/_fully_shard/``) all-gathers one group of parameters at a time (under
Accelerate: each decoder layer, the input embedding, and a tail group of the final norm and ``lm_head``), in the
mixed precision policy's ``param_dtype`` (the model's dtype for a bf16 model), and reduce-scatters its gradients in
``reduce_dtype``. With ``L`` the largest group's elements (each parameter's first dimension padded to a multiple of
the machine's ranks) and ``T`` the tail group's, per GPU:

* all-gather outputs, current and prefetched, ``2 L`` in the model's dtype: the flat output of one all-gather is
  freed only after the next group's copy-out (``FSDPParamGroup.wait_for_unshard``: "free after the next
  copy-out"), so two are alive at once; on CUDA they are allocated on FSDP's all-gather copy-in stream, whose
  freed blocks the caching allocator keeps for that stream (activations cannot reuse them): held for the run.
* the unsharded parameters of the group being computed, ``L`` (the copy-out's target; the next group's copy-out
  comes after this one is resharded, forward and backward);
* its unsharded gradients in backward, ``L`` in the model's dtype (autograd's, until the reduce-scatter's copy-in);
* the reduce-scatter input, ``L`` in ``reduce_dtype``, kept until the next group's post-backward
  (``comm_ctx.reduce_scatter_states``, one buffer by default: ``set_reduce_scatter_max_input_buffers``);
* the tail group, ``T``, unsharded from its forward to its backward (``reshard_after_forward=False``): held while
  the activations are at their peak (not counted again where it is the largest group);
* the reduce-scatter's output, a shard of the group (``L / S`` in ``reduce_dtype``, and its cast to the model's
  dtype where the two differ), allocated on FSDP's reduce-scatter stream, whose pool keeps it.

Counted all at once: an upper bound (the tail is resharded once its backward has run; the largest group's gradients
come when its activations are freed). ``tests/test_memory.py`` holds each line to what FSDP2 allocates for a
transformers Llama on 2 x 2 CPU ranks (sizes measured from its tensors; the reduce-scatter's output from the code:
it lives inside FSDP's reduce call). The sharded gradient ``p.grad`` is set to None by the engine's hook.

The CUDA context (with torch's kernels and cuBLAS's workspace) and each NCCL communicator's buffers are on the GPU
too, outside torch's allocator: an allowance of ``CUDA_CONTEXT`` and ``NCCL_COMMUNICATOR`` each, not a
measurement (``nvidia-smi`` after the first step shows yours; NVLS on NVSwitch machines can take more).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

GIB = 1 << 30
CUDA_CONTEXT = GIB  # the CUDA context, torch's loaded kernels, cuBLAS's workspace
NCCL_COMMUNICATOR = GIB // 2  # one NCCL communicator's buffers (channels x peers x NCCL_BUFFSIZE, proxies)


@dataclass(frozen=True)
class FSDPGroups:
    """Elements of the groups FSDP2 all-gathers on a machine of ``shard`` ranks (first dimensions padded)."""

    largest: int  # the largest group: a decoder layer, the input embedding or the tail
    tail: int  # the final norm and lm_head (and the input embedding when tied), unsharded from forward to backward
    source: str  # where the sizes come from: the model's config, or what was assumed


# Reference shapes (hidden, MLP, layers, vocabulary, key/value width) of Llama 2 7B / 13B, Code Llama 34B and Llama 2
# 70B, from their published configs: what ``--params`` alone is assumed to look like
_REFERENCE = {
    "Llama 2 7B": (4096, 11008, 32, 32000, 4096),
    "Llama 2 13B": (5120, 13824, 40, 32000, 5120),
    "Code Llama 34B": (8192, 22016, 48, 32000, 1024),
    "Llama 2 70B": (8192, 28672, 80, 32000, 1024),
}


def _llama(hidden: int, mlp: int, layers: int, vocab: int, kv: int) -> tuple[int, int, int]:
    """(a decoder layer's elements, the tail's, the model's) of an untied Llama."""
    layer = 2 * hidden * hidden + 2 * hidden * kv + 3 * hidden * mlp + 2 * hidden
    tail = vocab * hidden + hidden
    return layer, tail, vocab * hidden + layers * layer + tail


def assumed_groups(params: float) -> FSDPGroups:
    """Without the model's config: the reference Llama nearest in size, its groups scaled to ``params``."""
    name = min(_REFERENCE, key=lambda k: abs(_llama(*_REFERENCE[k])[2] - params))
    layer, tail, total = _llama(*_REFERENCE[name])
    scale = params / total
    return FSDPGroups(
        int(max(layer, tail) * scale), int(tail * scale), f"assumed: shaped like {name}, scaled to {params:.3g} "
        "parameters (--config gives your model's own)",
    )  # fmt: skip


def _padded(param: torch.Tensor, shard: int) -> int:
    """Elements FSDP2 all-gathers for ``param``: its first dimension padded to a multiple of ``shard``."""
    if param.dim() == 0:
        return shard
    rows = -(-param.shape[0] // shard) * shard
    return rows * (param.numel() // max(param.shape[0], 1))


def groups_of_model(model: torch.nn.Module, shard: int, source: str = "the model") -> FSDPGroups:
    """The groups as Accelerate's ``fsdp2_prepare_model`` makes them (``model._no_split_modules`` blocks, the input
    embedding, the tail of the final norm and the output embedding), from a model (the meta device will do)."""
    blocks = set(getattr(model, "_no_split_modules", None) or ())
    sizes = [
        sum(_padded(p, shard) for p in m.parameters()) for m in model.modules() if type(m).__name__ in blocks
    ]  # fmt: skip
    inp = getattr(model, "get_input_embeddings", lambda: None)()
    out = getattr(model, "get_output_embeddings", lambda: None)()
    tied = inp is not None and out is not None and inp.weight is out.weight
    tail = sum(_padded(p, shard) for p in out.parameters()) if out is not None else 0
    hidden = getattr(getattr(model, "config", None), "hidden_size", 0) or 0
    tail += -(-hidden // shard) * shard  # the final norm
    if inp is not None and not tied:
        sizes.append(sum(_padded(p, shard) for p in inp.parameters()))
    return FSDPGroups(max([tail, *sizes]), tail, source)


def groups_from_config(path: str | Path, shard: int) -> FSDPGroups:
    """``groups_of_model`` of the causal LM a transformers config describes, built on the meta device (offline)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    given = Path(path)
    config = AutoConfig.from_pretrained(given.parent if given.is_file() else given, local_files_only=True)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    return groups_of_model(model, shard, f"the model's config ({path})")


def working_set(
    groups: FSDPGroups, param_dtype: torch.dtype, reduce_dtype: torch.dtype, shard: int = 8
) -> dict[str, int]:
    """FSDP2's bytes per GPU beside the engine's (see the module's docstring), a line each; ``shard``: the machine's
    ranks, for the reduce-scatter's output (a group's shard). The tail's line is 0 where the tail is the largest
    group: it is then the group being computed, counted already."""
    big, pb, rb = groups.largest, param_dtype.itemsize, reduce_dtype.itemsize
    return {
        "FSDP: all-gather outputs, current and prefetched (model dtype; cached by its stream)": 2 * big * pb,
        "FSDP: the group being computed, unsharded (model dtype)": big * pb,
        "FSDP: its unsharded gradients in backward (model dtype)": big * pb,
        f"FSDP: reduce-scatter input ({_dtype(reduce_dtype)}), kept until the next group's": big * rb,
        "FSDP: the tail group (norm, lm_head), unsharded from forward to backward": (
            groups.tail * pb if groups.tail < big else 0
        ),
        "FSDP: reduce-scatter output, a group's shard (and its cast to the model's dtype; cached by its stream)": (
            -(-big // shard) * (rb + (pb if pb != rb else 0))
        ),
    }


def runtime_allowance(communicators: int) -> dict[str, int]:
    """The CUDA context and ``communicators`` NCCL communicators: an allowance (the module's docstring)."""
    return {
        "allowance: the CUDA context": CUDA_CONTEXT,
        f"allowance: {communicators} NCCL communicators' buffers": communicators * NCCL_COMMUNICATOR,
    }


def nccl_communicators(fsdp_shard: int, two_level: bool) -> int:
    """The NCCL communicators a rank of the engine holds: the world's (the default group, Accelerate's) and the
    rounds' own group; with FSDP inside machines, FSDP's group of the machine besides (the norm's sum goes over
    gloo); with int8 gradients in two levels, the node and rail groups."""
    if fsdp_shard > 1:
        return 3
    return 4 if two_level else 2


def _dtype(dtype: torch.dtype) -> str:
    return {torch.bfloat16: "bf16", torch.float32: "fp32", torch.float16: "fp16"}.get(dtype, str(dtype))


def baselines(numel: int, world_size: int, param_dtype: torch.dtype, fsdp_shard: int = 1) -> dict[str, int]:
    """Persistent bytes per rank of DDP, ZeRO-1 and ZeRO-2 (fp32 gradient accumulation, Adam(W)); with
    ``fsdp_shard``, HSDP too: FSDP2 over each machine's ranks with mixed precision as Accelerate sets it up (fp32
    sharded parameters, gradients and moments), replicated across machines."""
    params, grads, master, moments = numel * param_dtype.itemsize, 4 * numel, 4 * numel, 8 * numel
    out = {
        "DDP": params + grads + master + moments,
        "ZeRO-1": params + grads + (master + moments) // world_size,
        "ZeRO-2": params + (grads + master + moments) // world_size,
    }
    if fsdp_shard > 1:
        out[f"HSDP (FSDP2 over {fsdp_shard} ranks, fp32 master parameters)"] = (master + grads + moments) // fsdp_shard
    return out


def device_baseline(name: str, numel: int, world_size: int, param_dtype: torch.dtype, fsdp_shard: int = 1) -> int:
    """A baseline's bytes per GPU, activations aside, counted as the engine's ``device_bytes`` are: "DDP" and
    "ZeRO-1" with the allowance of one NCCL communicator; "HSDP" (Trainer's: FSDP2 over ``fsdp_shard`` ranks, fp32
    masters, Accelerate's bf16 policy) with FSDP's working set and three (the world's, the machine's, across).
    FSDP's groups are assumed from ``numel`` (``device_memory.assumed_groups``)."""
    base = baselines(numel, world_size, param_dtype, max(fsdp_shard, 2) if name == "HSDP" else 1)
    held = next(v for k, v in base.items() if k.split(" (")[0] == name)
    if name != "HSDP":
        return held + sum(runtime_allowance(1).values())
    fsdp = working_set(assumed_groups(numel), param_dtype, param_dtype, max(fsdp_shard, 2))  # (the bf16 policy's)
    return held + sum(fsdp.values()) + sum(runtime_allowance(3).values())


def _gb(n: int) -> str:
    return f"{n / 1e9:.2f} GB ({n / GIB:.2f} GiB)"


MARGIN = 0.10  # of the GPU: what a verdict leaves for the activations when they are not counted (and fragmentation)


def margin_bytes(gpu_gib: float) -> int:
    """The least a setting must leave on a GPU of ``gpu_gib`` when the activations are not counted."""
    return int(MARGIN * gpu_gib * GIB)


def verdict(left: int, gpu_gib: float, activations: bool = False) -> str:
    """Whether the peak (the engine's, FSDP's), the CUDA context's and NCCL's allowance and the activations, when
    counted, leave room in a GPU of ``gpu_gib``. Without the activations, what is left must be the margin at least
    (``MARGIN`` of the GPU) for the verdict to say it fits."""
    if activations:
        if left > 0:
            return f"Fits a GPU of {gpu_gib:g} GiB: {_gb(left)} left for the allocator's fragmentation."
        return f"Does not fit a GPU of {gpu_gib:g} GiB: {_gb(-left)} over, with the activations."
    floor = margin_bytes(gpu_gib)
    if left >= floor:
        return (f"Fits a GPU of {gpu_gib:g} GiB: {_gb(left)} left for the activations (the margin asked for is "
                f"{MARGIN:.0%} of the GPU, {_gb(floor)}; --config and --micro_batch_size count yours).")  # fmt: skip
    if left > 0:
        return (f"Does not fit a GPU of {gpu_gib:g} GiB with its margin: {_gb(left)} left for the activations, under "
                f"{MARGIN:.0%} of the GPU ({_gb(floor)}); --config and --micro_batch_size count yours.")  # fmt: skip
    return f"Does not fit a GPU of {gpu_gib:g} GiB: {_gb(-left)} over, before any activation."
