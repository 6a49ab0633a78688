"""Process-group helpers: the round group's options, the launch checks, and what the Trainer glue and the Accelerate
hook share (torch only, so that a hand-written Accelerate loop does not load transformers)."""

from __future__ import annotations

import datetime
import gc
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
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.broadcast_object_list(key, src=0)
    return key[0]


def every_rank(obj: Any) -> list[Any]:
    """Collective: every rank's ``obj``, in rank order."""
    if not (dist.is_initialized() and dist.get_world_size() > 1):
        return [obj]
    out: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(out, obj)
    return out


def end_training(accelerator: Any, trainer: Any = None) -> None:
    """A run's last distributed act, in the order that cannot hang at exit: every rank here, then the wrapped
    models released, then the process groups destroyed (``accelerator.end_training()``). Call it last; the
    caller drops its own references to a DistributedDataParallel model before it.

    A DistributedDataParallel model that outlives ``destroy_process_group()`` is left holding the last reference
    to the gloo process group, in its C++ reducer. torch binds the reducer without giving up the GIL in its
    destructor, so the group's destructor, which joins its worker threads, then runs with the GIL held, while a
    worker thread that still has to let go of a finished collective's tensors waits for the GIL: that rank never
    exits (seen in CI: the main thread in a destructor as ``main()`` returned, a second thread with no Python frame).
    Released first, the model drops a reference that the process-group registry still holds; the registry lets go
    of the last one from Python, and that destructor does give up the GIL while it joins.
    """
    accelerator.wait_for_everyone()
    if trainer is not None:
        trainer.model_wrapped = trainer.model  # the Trainer's reference to the wrapper
    accelerator.free_memory()  # Accelerate's references to what it prepared (the wrapper among them)
    gc.collect()  # a wrapper held only in reference cycles goes now, not at exit
    accelerator.end_training()


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
