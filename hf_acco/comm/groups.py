"""Process-group helpers: the run's world (its size, this rank, a barrier, a flag any rank raised, the store the
claims meet in), the round group's options, the launch checks, and what the Trainer glue and the Accelerate hook
share. Every torch.distributed call of the package outside the tools is in ``comm/`` (tests/test_layers.py)."""

from __future__ import annotations

import datetime
import os
import uuid
import warnings
from typing import Any

import torch
import torch.distributed as dist


def ensure_process_group(device: torch.device) -> None:
    """A one-process run still needs a process group for the engine: make a single-rank one."""
    if dist.is_initialized():
        return
    backend = "nccl" if device.type == "cuda" else "gloo"
    dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1)


def agreed_key(kind: str) -> str:
    """A name for this run's claim counters, rank 0's on every rank (collective)."""
    key = [f"hf_acco/{kind}/{uuid.uuid4().hex}"]
    if world_size() > 1:
        dist.broadcast_object_list(key, src=0)
    return key[0]


def every_rank(obj: Any) -> list[Any]:
    """Collective: every rank's ``obj``, in rank order."""
    if world_size() == 1:
        return [obj]
    out: list[Any] = [None] * world_size()
    dist.all_gather_object(out, obj)
    return out


def world_size() -> int:
    """The number of processes of the run (1 without a process group)."""
    return dist.get_world_size() if dist.is_initialized() else 1


def world_rank() -> int:
    """This process's rank in the run (0 without a process group)."""
    return dist.get_rank() if dist.is_initialized() else 0


def barrier() -> None:
    """Every rank of the run here before any goes on (nothing to wait for on one)."""
    if world_size() > 1:
        dist.barrier()


def any_rank(flag: torch.Tensor) -> torch.Tensor:
    """``flag`` (on the process group's device) <- its largest value over the run's ranks, in place: whether any
    rank raised it."""
    if dist.is_initialized():
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)
    return flag


def default_store() -> dist.Store:
    """The c10d store the default process group was built on (every rank's counters meet there)."""
    return dist.distributed_c10d._get_default_store()


def claims_store() -> dist.Store:
    """Where the ranks' claims of micro-batches meet (``pacing.claims``): the run's store, or a store of this
    process's own when it trains alone."""
    return default_store() if world_size() > 1 else dist.HashStore()


MAX_CTAS = "HF_ACCO_ROUND_MAX_CTAS"  # caps the CTAs (channels) of the round's NCCL communicators (docs/tuning.md)


def round_max_ctas() -> int | None:
    """The cap on the CTAs of the round's NCCL communicators (``HF_ACCO_ROUND_MAX_CTAS``), None when unset: NCCL
    then picks (up to 32 or 64 thread blocks, each on an SM the compute and FSDP's collectives also want)."""
    value = os.environ.get(MAX_CTAS, "").strip()
    if not value:
        return None
    if not value.isdigit() or not 1 <= int(value) <= 64:
        raise ValueError(
            f"{MAX_CTAS}={value!r}: the most CTAs (thread blocks, one per NCCL channel) the round's collectives may "
            "take, a whole number from 1 to 64 (4 to 8 is usual), the same on every machine; unset it for NCCL's own."
        )
    return int(value)


def cap_ctas(options: Any, cap: int | None) -> Any:
    """``options`` (``ProcessGroupNCCL.Options``) with ``config.max_ctas = cap`` where a cap is set."""
    if cap is not None:
        options.config.max_ctas = cap
    return options


def round_group_options(backend: str, timeout: datetime.timedelta | None = None) -> Any:
    """Options of the round's own process group: on NCCL its stream gets high priority, so that the round's
    collectives are scheduled ahead of the compute kernels queued beside them (the round is what hides behind
    compute; a collective held back by a queue of compute kernels holds up every rank); its CTAs capped where
    ``HF_ACCO_ROUND_MAX_CTAS`` says (the round's kernels then leave the compute more SMs)."""
    cap = round_max_ctas()  # (refused alike on every backend, before any group is made)
    if backend != "nccl" or not dist.is_nccl_available():
        return None
    options = dist.ProcessGroupNCCL.Options()
    options.is_high_priority_stream = True
    if timeout is not None:  # else torch warns that the options' own (10 min) and the group's timeouts differ
        options._timeout = timeout
    return cap_ctas(options, cap)


def warn_if_one_hardware_queue(device: torch.device) -> None:
    """``CUDA_DEVICE_MAX_CONNECTIONS=1`` (Megatron's setting) puts every stream's work in one hardware queue: the
    round's collectives then run in launch order with Trainer's own, and two ranks that launched them in a
    different order wait on each other for ever."""
    if device.type == "cuda" and os.environ.get("CUDA_DEVICE_MAX_CONNECTIONS") == "1":
        warnings.warn(
            "CUDA_DEVICE_MAX_CONNECTIONS=1: all CUDA streams share one hardware queue, so ACCO's background round "
            "cannot overlap compute, and its collectives can deadlock with the main thread's across ranks. Unset it "
            "(or set it to 8 or more) for ACCO runs.",
            stacklevel=3,
        )


def check_world_size(expected: int, group: dist.ProcessGroup | None = None) -> None:
    """Fail with launch instructions if torch.distributed and the launcher disagree on the world size."""
    actual = dist.get_world_size(group) if dist.is_initialized() else 1
    launched = int(os.environ.get("WORLD_SIZE", actual))  # what torchrun / accelerate launch started
    if actual != expected or launched != expected:
        raise RuntimeError(
            f"torch.distributed has {actual} ranks and the launcher started {launched} (WORLD_SIZE), but Accelerate "
            f"reports {expected} processes. "
            "On CPU, start 2 gloo ranks with `ACCELERATE_USE_CPU=1 accelerate launch --config_file "
            "accelerate_configs/cpu_2proc.yaml ...` (distributed_type MULTI_GPU, num_processes 2) or "
            "`torchrun --nproc_per_node 2 ...` with `Accelerator(cpu=True)`; MULTI_CPU silently starts one "
            "process without mpirun."
        )
