"""Building ACCO's engine for a Trainer: the construction-time checks (settings ACCO cannot honour, an optimizer it
cannot take over), Trainer's weight-decay groups and ``optim`` choice, an optimizer instance taken over, and the
engine reused across ``train()`` calls as Trainer reuses its optimizer."""

from __future__ import annotations

import datetime
import inspect
import warnings
from typing import TYPE_CHECKING, Any

import torch
from transformers import Trainer, TrainingArguments

from hf_acco.comm.communicator import Communicator
from hf_acco.comm.groups import check_world_size, ensure_process_group
from hf_acco.comm.module_buffers import BufferSync, has_running_statistics
from hf_acco.engine.core import ACCOOptimizer
from hf_acco.engine.optim import check_elementwise
from hf_acco.engine.schedule import validate_settings
from hf_acco.integrations import fsdp
from hf_acco.integrations.config import (
    acco_setting,
    check_halves,
    check_supported,
    engine_accumulation,
    engine_micro_batches,
)

if TYPE_CHECKING:  # the parts' trainer is always an ACCOTrainerMixin, seen through the attributes they use
    from hf_acco.integrations.trainer.run_state import TrainerParts

ALLOW_CUSTOM = "set acco_allow_custom_optimizer=True and pass it as optimizer_cls_and_kwargs=(cls, kwargs)"


def sync_buffers(trainer: TrainerParts, model: torch.nn.Module) -> None:
    """DDP's ``broadcast_buffers`` (Trainer's ``ddp_broadcast_buffers``; unset is DDP's default, True): rank 0's
    buffers before the first forward of each accumulation window (``BufferSync``), once per model. Not with
    paced accumulation (refused or said in ``check_args`` / ``check_trainer``), nor on one rank."""
    args = trainer.args
    run = trainer.acco_run
    current = run.buffer_sync
    if current is not None and current.module is model:
        return
    if current is not None:
        current.remove()
    run.buffer_sync = None
    if args.ddp_broadcast_buffers is False or engine_accumulation(args) == "paced" or args.world_size < 2:
        return
    if fsdp.is_sharded(model):  # FSDP shards the buffers' modules too and, as Trainer's HSDP, broadcasts none
        return
    run.buffer_sync = BufferSync(model, lambda: trainer.accelerator.sync_gradients)


def check_takeover(optimizer: Any, training_args: TrainingArguments | None) -> None:
    """An optimizer instance ACCO can take over faithfully: an element-wise torch class, not yet stepped, whose
    groups hold trainable parameters only (ACCO rebuilds it sharded, with the same groups and settings)."""
    if not isinstance(optimizer, torch.optim.Optimizer):
        raise ValueError(f"optimizers[0] must be a torch.optim.Optimizer, got {type(optimizer).__name__}.")
    allow = acco_setting(training_args, "acco_allow_custom_optimizer") if training_args is not None else False
    check_elementwise(type(optimizer), allow, ALLOW_CUSTOM)
    if optimizer.state:
        raise ValueError(
            "The optimizer passed in optimizers=(...) has already been stepped: ACCO rebuilds it sharded and cannot "
            "take its state over. Pass a fresh optimizer, or resume from a checkpoint with resume_from_checkpoint."
        )
    if any(not p.requires_grad for g in optimizer.param_groups for p in g["params"]):
        raise ValueError(
            "The optimizer passed in optimizers=(...) holds parameters that do not require gradients: ACCO trains "
            "the trainable ones only. Build it over [p for p in model.parameters() if p.requires_grad]."
        )


def check_args(training_args: TrainingArguments) -> None:
    """Refuse, with what to change, training arguments ACCO cannot honour (ACCO's defaults for plain ones)."""
    check_supported(training_args)
    check_halves(training_args)
    validate_settings(
        acco_setting(training_args, "acco_schedule"),
        engine_accumulation(training_args),
        engine_micro_batches(training_args),
    )
    if engine_accumulation(training_args) == "paced" and training_args.ddp_broadcast_buffers:
        raise ValueError(
            "ddp_broadcast_buffers=True cannot be honoured with acco_accumulation='paced': ranks compute different "
            "numbers of micro-batches, so they never meet before the same forward. Set ddp_broadcast_buffers=False "
            "(each rank keeps its own buffers), or use acco_accumulation='fixed'."
        )
    if training_args.n_gpu > 1:
        raise ValueError(
            "ACCO needs one process per GPU; this run sees several GPUs in one process (DataParallel). "
            "Launch with `accelerate launch` or `torchrun`."
        )


def check_trainer(trainer: TrainerParts) -> None:
    """What only a built Trainer can tell: its data, its optimizer class, the launch, a paced acco step's size."""
    args = trainer.args
    if (
        trainer.train_dataset is not None
        and hasattr(trainer.train_dataset, "__len__")
        and not len(trainer.train_dataset)
    ):
        raise ValueError("train_dataset is empty: ACCO has nothing to train on. Check the data files and filters.")
    if trainer.optimizer_cls_and_kwargs is None:
        cls, _ = Trainer.get_optimizer_cls_and_kwargs(args, trainer.model)  # type: ignore[arg-type]  # (as Trainer)
        check_elementwise(cls, acco_setting(args, "acco_allow_custom_optimizer"), ALLOW_CUSTOM)
    check_world_size(trainer.accelerator.num_processes)
    if fsdp.hsdp_layout(trainer.accelerator) is not None:  # FSDP inside machines: refusals before any work
        fsdp.check_args(args)
        if engine_accumulation(args) == "paced":
            raise ValueError(
                "acco_accumulation='paced' with FSDP: the ranks of a machine must compute the same micro-batches "
                "(FSDP's collectives run in lockstep). Use acco_accumulation='fixed'."
            )
        if trainer.optimizer is not None:
            raise ValueError(
                "An optimizer instance cannot be taken over with FSDP: it holds the parameters from before FSDP "
                "shards them. Pass its class and settings as optimizer_cls_and_kwargs=(cls, kwargs) instead."
            )
    if (
        engine_accumulation(args) == "paced"
        and args.ddp_broadcast_buffers is None
        and has_running_statistics(
            trainer.model  # type: ignore[arg-type]
        )
    ):
        warnings.warn(
            "The model keeps running statistics (BatchNorm), which DDP would broadcast from rank 0 before each "
            "optimizer step; with acco_accumulation='paced' ranks do not meet before the same forward, so each rank "
            "keeps its own. Set ddp_broadcast_buffers=False to say so, or use acco_accumulation='fixed'.",
            stacklevel=3,
        )
    if (
        engine_accumulation(args) == "paced"
        and acco_setting(args, "acco_schedule") == "acco"
        and args.world_size * args.gradient_accumulation_steps < 2
    ):
        raise ValueError(
            "acco_accumulation='paced' with acco_schedule='acco' needs a global batch of at least 2 "
            "micro-batches (one per half): world_size x gradient_accumulation_steps is 1. Raise "
            "gradient_accumulation_steps, or use acco_accumulation='fixed' (it splits a micro-batch in two)."
        )


def engine_of(trainer: TrainerParts) -> ACCOOptimizer:
    """The trainer's engine, which ``create_optimizer`` builds at the start of ``train()``."""
    if trainer.acco_run.engine is None:
        raise RuntimeError("ACCOTrainer builds its ACCO engine in train() (create_optimizer): there is none yet.")
    return trainer.acco_run.engine


def reuse_engine(trainer: TrainerParts) -> torch.optim.Optimizer | None:
    """The engine of an earlier ``train()`` to go on with, or None to build one (Trainer calls create_optimizer at
    every train()). The engine released its hooks and thread when the last training ended: train() again goes on
    with the same engine and state, as Trainer goes on with its optimizer. An engine left mid-step by a failed
    attempt (Trainer's auto batch size retry) is released and replaced."""
    acco = trainer.acco_run.engine
    if acco is not None and trainer.optimizer is not None:
        if acco.closed:
            acco.reopen()
            return trainer.optimizer
        if acco.pristine:
            return trainer.optimizer
        acco.close()
        trainer.optimizer = None
    return None


def optimizer_groups(trainer: TrainerParts, model: torch.nn.Module, taken: Any) -> tuple[type, dict, list[dict]]:
    """The optimizer's class, settings and parameter groups: those of an instance the user passed (checked in
    __init__), else Trainer's choice (``optim`` or ``optimizer_cls_and_kwargs``) over its weight-decay groups."""
    if taken is not None:
        accepted = inspect.signature(type(taken).__init__).parameters  # defaults hold some it sets itself
        kwargs = {k: v for k, v in taken.defaults.items() if k in accepted}
        return type(taken), kwargs, [dict(g) for g in taken.param_groups]
    if trainer.optimizer_cls_and_kwargs is not None:
        cls, kwargs = trainer.optimizer_cls_and_kwargs
    else:
        cls, kwargs = trainer.get_optimizer_cls_and_kwargs(trainer.args, model)  # type: ignore[arg-type]  # as Trainer
    decay = set(trainer.get_decay_parameter_names(model))
    named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    groups = []
    for in_decay, weight_decay in ((True, trainer.args.weight_decay), (False, 0.0)):
        chosen = [(n, p) for n, p in named if (n in decay) == in_decay]
        groups.append(
            {"params": [p for _, p in chosen], "param_names": [n for n, _ in chosen], "weight_decay": weight_decay}
        )
    return cls, kwargs, groups


def build_engine(trainer: TrainerParts, model: torch.nn.Module | None) -> torch.optim.Optimizer:
    """Trainer's ``create_optimizer``: the ACCOOptimizer with the trainer's settings, prepared by Accelerate."""
    sharded = fsdp.hsdp_layout(trainer.accelerator) is not None  # FSDP inside machines (docs/hsdp.md)
    if sharded:
        fsdp.sync_every_micro_batch(trainer.accelerator)
    reused = reuse_engine(trainer)
    if reused is not None:
        return reused
    taken = None
    if trainer.optimizer is not None and not isinstance(trainer.optimizer, ACCOOptimizer):
        taken, trainer.optimizer = trainer.optimizer, None
    if trainer.optimizer is not None:
        return trainer.optimizer
    model = trainer.model if model is None else model
    if model is None:
        raise ValueError("ACCOTrainer needs a model to build its optimizer for: pass model= (or model_init=).")
    args = trainer.args
    group = None
    if sharded:
        if not fsdp.is_sharded(model):  # the engine is built over the sharded parameters, FSDP's own from now on
            model = fsdp.shard_within_machines(trainer.accelerator, model)
        group = fsdp.replicate_group(trainer.accelerator)
    optimizer_cls, optimizer_kwargs, groups = optimizer_groups(trainer, model, taken)
    check_elementwise(optimizer_cls, acco_setting(args, "acco_allow_custom_optimizer"), ALLOW_CUSTOM)
    ensure_process_group(trainer.accelerator.device)
    run = trainer.acco_run
    run.logged_totals = {}  # a new engine's figures start from zero
    run.engine = acco = ACCOOptimizer(
        groups,  # empty ones too: the groups of Trainer's optimizer, so that its checkpoints and ours match
        optimizer_cls=optimizer_cls,
        schedule=acco_setting(args, "acco_schedule"),
        accumulation=engine_accumulation(args),
        micro_batches=engine_micro_batches(args),
        max_grad_norm=args.max_grad_norm if args.max_grad_norm and args.max_grad_norm > 0 else None,
        warmup_steps=acco_setting(args, "acco_warmup_steps"),
        communicator=Communicator(
            group=group,
            reduce_scatter=acco_setting(args, "acco_reduce_scatter"),
            timeout=datetime.timedelta(seconds=acco_setting(args, "acco_comm_timeout_s")),
        ),
        bucket_numel=acco_setting(args, "acco_bucket_numel"),
        nonfinite=acco_setting(args, "acco_nonfinite"),
        comm_dtype=acco_setting(args, "acco_comm_dtype"),
        grad_dtype=acco_setting(args, "acco_grad_dtype"),
        gather_dtype=acco_setting(args, "acco_gather_dtype"),
        error_feedback=acco_setting(args, "acco_error_feedback"),
        allow_custom_optimizer=True,  # checked just above, with the advice that fits Trainer
        boundary_copy=False,  # Trainer saves (and its JIT checkpoint agrees) at step boundaries only
        **optimizer_kwargs,
    )
    scheduler = trainer.lr_scheduler
    if taken is not None and scheduler is not None and getattr(scheduler, "optimizer", None) is taken:
        scheduler.optimizer = acco  # the user's schedule now sets the engine's learning rates
    # prepared here without the state_dict round trip Accelerate does at prepare time (a collective for us); marked
    # prepared, so that Trainer's accelerator.prepare(model, optimizer) keeps this wrapper as it is
    trainer.optimizer = trainer.accelerator.prepare_optimizer(acco, device_placement=False)
    trainer.optimizer._is_accelerate_prepared = True  # type: ignore[union-attr]
    run.group_params = [list(g["params"]) for g in acco.param_groups]
    return trainer.optimizer


def restore_param_groups(trainer: TrainerParts) -> None:
    """The engine's parameter groups as it was built with them. Accelerate's FSDP2 prepare swaps every optimizer
    parameter for the model's by data pointer (``fsdp2_switch_optimizer_parameters``), and every empty local shard
    (a dimension smaller than the machine's ranks) has data pointer 0: one of them would stand for all."""
    run = trainer.acco_run
    if run.engine is not None and run.group_params is not None:
        for group, params in zip(run.engine.param_groups, run.group_params):
            group["params"] = params
