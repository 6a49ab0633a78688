"""ACCOTrainer: transformers.Trainer with the ACCO sharded optimizer instead of DDP. Glue only.

What it intercepts, and why (Trainer's loop itself is not copied or overridden):

* ``_wrap_model``: Accelerate prepares the model without DDP (``evaluation_mode=True``): ACCO averages gradients.
* ``create_optimizer``: builds the ACCOOptimizer with Trainer's weight-decay groups and ``optim`` choice.
* ``training_step``: after Trainer's forward/backward, tells the engine a micro-batch is done, with the weight
  that undoes Trainer's loss normalisation (so gradients are averaged exactly as Trainer+DDP averages them).
* ``_clip_grad_norm`` / ``_get_grad_norm``: clipping happens inside the round, by the global norm.
* ``save_model``, ``_save_optimizer_and_scheduler``, ``_load_optimizer_and_scheduler``: committed parameters
  in the model files; one optimizer shard file per rank; re-sharding on load.
* ``_finalize_training``: drain the round in flight and leave the committed parameters in the model.
* ``evaluate`` / ``_save_checkpoint`` in dynamic mode: ranks first meet at one optimizer-step boundary.

Dynamic accumulation under Trainer. Trainer's step stays what it is: ``gradient_accumulation_steps``
micro-batches per rank, so the data order, epochs, ``max_steps``, the LR schedule (one scheduler step per
Trainer step: the learning rate follows the data consumed), logging, evaluation and checkpoint cadence are
Trainer's, and no micro-batch is dropped or repeated. ACCO's optimizer steps are decoupled from it: a rank
ends an ACCO half (and step) whenever the round in flight has finished, so a faster rank contributes more
micro-batches to each round and runs ahead in Trainer steps, until the next point where Trainer's ranks meet
(logging gathers the loss; evaluation, checkpoints and the end of training meet through ``rendezvous``).
``global_step`` counts Trainer steps; ``acco_optimizer_steps`` and the per-rank micro-batch counts are logged.
* ``log``: ACCO's figures (exposed communication, round time, micro-batches, tokens) next to the loss.

Evaluation sees the committed parameters through the optimizer's ``eval()``/``train()``, which Trainer calls
around evaluation and before every micro-batch.
"""

from __future__ import annotations

import datetime
import inspect
import json
import logging
import os
import re
from typing import Any

import torch
import torch.distributed as dist
from transformers import Trainer, TrainerCallback, TrainingArguments

from .checkpoint import atomic_save, load_optimizer_state, missing_shards, save_optimizer_state
from .comm import Communicator, PeerFailure, check_world_size, is_peer_failure
from .config import check_halves, check_supported, engine_micro_batches, splits_batches
from .core import ACCOOptimizer
from .optim import check_elementwise
from .schedule import Accumulation, validate_settings

logger = logging.getLogger(__name__)

SCHEDULER_NAME = "scheduler.pt"
RUN_DEPENDENT_METRICS = ("acco_exposed_comm_s", "acco_round_s")  # logged, not kept in state.log_history
TRAINER_STATE_NAME = "trainer_state.json"
JIT_SENTINEL = "checkpoint-is-incomplete.txt"  # transformers' JIT checkpoint marks a checkpoint in progress


def checkpoint_incomplete(path: str) -> str | None:
    """Why ``path`` is not a complete ACCOTrainer checkpoint, or None.

    Every rank writes its files, then the ranks meet, then rank 0 writes ``trainer_state.json``: a checkpoint
    with a readable trainer state (and no JIT sentinel) has all its files. One killed while it was written lacks it.
    """
    state = os.path.join(path, TRAINER_STATE_NAME)
    if not os.path.isfile(state):
        return f"it has no {TRAINER_STATE_NAME} (it was being written when the run stopped)"
    try:
        with open(state, encoding="utf-8") as f:
            json.load(f)
    except ValueError:
        return f"its {TRAINER_STATE_NAME} is truncated"
    if os.path.exists(os.path.join(path, JIT_SENTINEL)):
        return "its pre-emption (JIT) checkpoint did not finish"
    missing = missing_shards(path)
    return f"it lacks {missing}" if missing else None


def last_complete_checkpoint(output_dir: str) -> str | None:
    """The checkpoint-N directory with the highest N that is complete (see ``checkpoint_incomplete``)."""
    if not os.path.isdir(output_dir):
        return None
    candidates = []
    for name in os.listdir(output_dir):
        match = re.fullmatch(r"checkpoint-(\d+)", name)
        if match and os.path.isdir(os.path.join(output_dir, name)):
            candidates.append((int(match.group(1)), os.path.join(output_dir, name)))
    for _, path in sorted(candidates, reverse=True):
        reason = checkpoint_incomplete(path)
        if reason is None:
            return path
        logger.warning("Skipping %s: %s.", path, reason)
    return None


_ALLOW_CUSTOM = "set acco_allow_custom_optimizer=True and pass it as optimizer_cls_and_kwargs=(cls, kwargs)"


def _setting(args: TrainingArguments, name: str, default: Any) -> Any:
    """ACCO settings from an ACCOConfig, or ACCO's defaults when given plain TrainingArguments."""
    return getattr(args, name, default)


def _check_takeover(optimizer: Any, training_args: TrainingArguments | None) -> None:
    """An optimizer instance ACCO can take over faithfully: an element-wise torch class, not yet stepped, whose
    groups hold trainable parameters only (ACCO rebuilds it sharded, with the same groups and settings)."""
    if not isinstance(optimizer, torch.optim.Optimizer):
        raise ValueError(f"optimizers[0] must be a torch.optim.Optimizer, got {type(optimizer).__name__}.")
    allow = _setting(training_args, "acco_allow_custom_optimizer", False) if training_args is not None else False
    check_elementwise(type(optimizer), allow, _ALLOW_CUSTOM)
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


def _check_args(training_args: TrainingArguments) -> None:
    """Refuse, with what to change, training arguments ACCO cannot honour (ACCO's defaults for plain ones)."""
    check_supported(training_args)
    check_halves(training_args)
    validate_settings(
        _setting(training_args, "acco_schedule", "acco"),
        _setting(training_args, "acco_accumulation", "fixed"),
        engine_micro_batches(training_args),
        _setting(training_args, "acco_min_micro_batches", 1),
    )
    if training_args.n_gpu > 1:
        raise ValueError(
            "ACCO needs one process per GPU; this run sees several GPUs in one process (DataParallel). "
            "Launch with `accelerate launch` or `torchrun`."
        )


class ACCOTrainerMixin:
    """Every ACCO override of [`~transformers.Trainer`], cooperative with ``super()``: put it first,
    ``class MyTrainer(ACCOTrainerMixin, SomeTrainer)``, and give it a config with the ``acco_*`` settings
    ([`ACCOConfigMixin`] joined to that trainer's config)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        # the config and the optimizers by name, whatever their position in the trainer's signature (DPOTrainer's
        # second positional argument is ref_model)
        given = inspect.signature(super().__init__).bind_partial(*args, **kwargs).arguments
        if given.get("args") is not None:
            _check_args(given["args"])
        optimizers = given.get("optimizers")
        if optimizers is not None and optimizers[0] is not None and not isinstance(optimizers[0], ACCOOptimizer):
            _check_takeover(optimizers[0], given.get("args"))
        super().__init__(*args, **kwargs)
        _check_args(self.args)  # again: a subclass may build or replace its config in __init__ (TRL does)
        if self.train_dataset is not None and hasattr(self.train_dataset, "__len__") and len(self.train_dataset) == 0:
            raise ValueError("train_dataset is empty: ACCO has nothing to train on. Check the data files and filters.")
        if self.optimizer_cls_and_kwargs is None:
            cls, _ = Trainer.get_optimizer_cls_and_kwargs(self.args, self.model)
            check_elementwise(cls, _setting(self.args, "acco_allow_custom_optimizer", False), _ALLOW_CUSTOM)
        check_world_size(self.accelerator.num_processes)
        _agree_on_jit_checkpoints(self)
        self.acco: ACCOOptimizer | None = None
        self._logged_totals: dict[str, float] = {}

    def train(self, resume_from_checkpoint: str | bool | None = None, *args: Any, **kwargs: Any) -> Any:
        """Trainer.train, resuming only from complete checkpoints (``True``: the latest complete one)."""
        if resume_from_checkpoint is True:
            found = last_complete_checkpoint(self.args.output_dir)
            if found is None:
                raise ValueError(  # Trainer's words, then ACCO's detail
                    f"No valid checkpoint found in output directory ({self.args.output_dir}): no complete "
                    "checkpoint to resume from. Start without resume_from_checkpoint, or point it at a checkpoint "
                    "directory."
                )
            resume_from_checkpoint = found
        elif isinstance(resume_from_checkpoint, str):
            if not os.path.isdir(resume_from_checkpoint):
                raise ValueError(f"Can't find a valid checkpoint at {resume_from_checkpoint}: not a directory.")
            reason = checkpoint_incomplete(resume_from_checkpoint)
            if reason is not None:
                latest = last_complete_checkpoint(os.path.dirname(os.path.abspath(resume_from_checkpoint)))
                raise ValueError(
                    f"Can't find a valid checkpoint at {resume_from_checkpoint}: {reason}. "
                    + (
                        f"The latest complete checkpoint is {latest}."
                        if latest
                        else "No complete checkpoint is there."
                    )
                )
        try:
            return super().train(resume_from_checkpoint, *args, **kwargs)
        except (RuntimeError, dist.DistError) as e:
            if not is_peer_failure(e):  # this rank's own error (out of memory, CUDA, a bug): as it is
                raise
            rank, world = self.args.process_index, self.args.world_size
            latest = last_complete_checkpoint(self.args.output_dir)
            raise PeerFailure(
                f"Training stopped on rank {rank}: peer rank(s) {[r for r in range(world) if r != rank]} died or "
                f"stopped answering ({type(e).__name__}). The last complete checkpoint is {latest}; restart all "
                f"ranks with resume_from_checkpoint=True to continue from it. Cause: {e}"
            ) from e

    # ---- model and optimizer ------------------------------------------------------------------------------

    def _wrap_model(self, model: torch.nn.Module, training: bool = True, dataloader: Any = None) -> torch.nn.Module:
        model = super()._wrap_model(model, training, dataloader)
        if training and not getattr(model, "_is_accelerate_prepared", False):
            # autocast, compile and device placement, but no DDP: the ACCO rounds average the gradients
            model = self.accelerator.prepare_model(model, evaluation_mode=True)
        return model

    def create_optimizer(self, model: torch.nn.Module | None = None) -> torch.optim.Optimizer:
        # Trainer calls this at every train(). The engine released its hooks and thread when the last training
        # ended (_finalize_training): train() again goes on with the same engine and state, as Trainer goes on
        # with its optimizer. An engine left mid-step by a failed attempt (Trainer's auto batch size retry) is
        # released and replaced.
        if self.acco is not None and self.optimizer is not None:
            if self.acco.closed:
                self.acco.reopen()
                return self.optimizer
            if self.acco.pristine:
                return self.optimizer
            self.acco.close()
            self.optimizer = None
        taken = None  # an optimizer instance the user passed (checked in __init__): its class, groups, settings
        if self.optimizer is not None and not isinstance(self.optimizer, ACCOOptimizer):
            taken, self.optimizer = self.optimizer, None
        if self.optimizer is not None:
            return self.optimizer
        opt_model = self.model if model is None else model
        if taken is not None:
            optimizer_cls = type(taken)
            accepted = inspect.signature(optimizer_cls.__init__).parameters  # defaults hold some it sets itself
            optimizer_kwargs = {k: v for k, v in taken.defaults.items() if k in accepted}
            groups = [dict(g) for g in taken.param_groups]
        elif self.optimizer_cls_and_kwargs is not None:
            optimizer_cls, optimizer_kwargs = self.optimizer_cls_and_kwargs
        else:
            optimizer_cls, optimizer_kwargs = self.get_optimizer_cls_and_kwargs(self.args, opt_model)
        if taken is None:
            decay = set(self.get_decay_parameter_names(opt_model))
            named = [(n, p) for n, p in opt_model.named_parameters() if p.requires_grad]
            groups = [
                {"params": [p for n, p in named if n in decay], "param_names": [n for n, _ in named if n in decay],
                 "weight_decay": self.args.weight_decay},
                {"params": [p for n, p in named if n not in decay],
                 "param_names": [n for n, _ in named if n not in decay], "weight_decay": 0.0},
            ]  # fmt: skip
        args = self.args
        check_elementwise(optimizer_cls, _setting(args, "acco_allow_custom_optimizer", False), _ALLOW_CUSTOM)
        _ensure_process_group(self.accelerator.device)
        self._logged_totals = {}  # a new engine's figures start from zero
        self.acco = ACCOOptimizer(
            [g for g in groups if g["params"]],
            optimizer_cls=optimizer_cls,
            schedule=_setting(args, "acco_schedule", "acco"),
            accumulation=_setting(args, "acco_accumulation", "fixed"),
            micro_batches=engine_micro_batches(args),
            min_micro_batches=_setting(args, "acco_min_micro_batches", 1),
            max_grad_norm=args.max_grad_norm if args.max_grad_norm and args.max_grad_norm > 0 else None,
            warmup_steps=_setting(args, "acco_warmup_steps", 0),
            communicator=Communicator(
                reduce_scatter=_setting(args, "acco_reduce_scatter", "auto"),
                timeout=datetime.timedelta(seconds=_setting(args, "acco_comm_timeout_s", 1800.0)),
            ),
            bucket_numel=_setting(args, "acco_bucket_numel", None),
            auto_step=_setting(args, "acco_accumulation", "fixed") == "dynamic",  # steps decoupled from Trainer's
            nonfinite=_setting(args, "acco_nonfinite", "skip"),
            comm_dtype=_setting(args, "acco_comm_dtype", "fp32"),
            grad_dtype=_setting(args, "acco_grad_dtype", "fp32"),
            allow_custom_optimizer=True,  # checked just above, with the advice that fits Trainer
            **optimizer_kwargs,
        )
        if taken is not None and getattr(self.lr_scheduler, "optimizer", None) is taken:
            self.lr_scheduler.optimizer = self.acco  # the user's schedule now sets the engine's learning rates
        # prepared here without the state_dict round trip Accelerate does at prepare time (a collective for us)
        self.optimizer = self.accelerator.prepare_optimizer(self.acco, device_placement=False)
        return self.optimizer

    # ---- training -----------------------------------------------------------------------------------------

    def training_step(
        self, model: torch.nn.Module, inputs: dict[str, Any], num_items_in_batch: torch.Tensor | int | None = None
    ) -> torch.Tensor:
        # A window of one micro-batch under fixed acco: its two halves along the batch dimension (each half's
        # gradient weighted by its share of the rows, so the step's gradient is the whole batch's)
        parts = _split_rows(inputs) if splits_batches(self.args) else [(inputs, 1.0)]
        total = None
        for part, share in parts:
            weight, scale = self._micro_batch_weight(part, num_items_in_batch, share)  # before labels are popped
            self.acco.grad_scale = scale
            loss = super().training_step(model, part, num_items_in_batch)
            self.acco.grad_scale = 1.0
            self.acco.after_backward(weight)
            loss = loss if len(parts) == 1 else loss * scale
            total = loss if total is None else total + loss
        return total

    @property
    def _dynamic(self) -> bool:
        return self.acco is not None and self.acco.accumulation is Accumulation.DYNAMIC

    def _micro_batch_weight(
        self, inputs: dict[str, Any], num_items_in_batch: torch.Tensor | int | None, share: float = 1.0
    ) -> tuple[float, float]:
        """(weight, gradient scale) that undo Trainer's normalisation of this micro-batch's loss.

        Trainer divides a token-summed loss by the window's token count ``num_items_in_batch`` (times the number
        of processes, which DDP divides out again), or a mean loss by the number of micro-batches in the window.
        Fixed mode: the same factor for every micro-batch of a step on every rank, so weight = factor x tokens
        makes the engine's sum / weight the exact token-weighted average, for each half as for the whole step.
        Dynamic mode: a step spans several of Trainer's windows, whose factors differ, so the gradient is scaled
        back to a plain token sum and the weight is the token count. ``share``: the fraction of the micro-batch's
        rows in this part of it (a window of one micro-batch split into two halves), for a mean loss.
        """
        scaled = self.loss_is_scaled_for_ga
        if scaled is None:
            scaled = (self.model_accepts_loss_kwargs and num_items_in_batch is not None) or (
                self.compute_loss_func is not None
            )
        if not scaled:
            return share / self.current_gradient_accumulation_steps, share
        if num_items_in_batch is None:
            return 1.0, 1.0
        tokens = self.count_label_tokens(inputs)
        factor = 1.0
        if self.args.average_tokens_across_devices and (self.model_accepts_loss_kwargs or self.compute_loss_func):
            factor = float(self.accelerator.num_processes // self.get_tp_size())
        factor /= float(num_items_in_batch)
        if self._dynamic:
            return tokens, 1.0 / factor
        return tokens * factor, 1.0

    def count_label_tokens(self, inputs: dict[str, Any]) -> float:
        """The number of tokens a micro-batch's summed loss adds up: the weight its gradient gets. Override it for a
        loss that counts otherwise.

        Default, as Trainer counts ``num_items_in_batch``: labels other than -100 in ``shift_labels`` when the batch
        has them, else in ``labels`` after the shift the model's loss applies (causal LMs drop the first label).
        Padding-free batches (sequences packed into one row) need nothing more: their collators mark the first
        label of every sequence -100."""
        if "shift_labels" in inputs:
            labels = inputs["shift_labels"]
        else:
            labels = inputs["labels"][..., 1:] if getattr(self, "_loss_shifts_labels", False) else inputs["labels"]
        return float(labels.ne(-100).sum())

    def _clip_grad_norm(self, model: torch.nn.Module) -> None:
        return None  # clipped inside the round, by the norm of the globally averaged gradient

    def _get_grad_norm(self, model: torch.nn.Module, grad_norm: Any = None) -> float | None:
        return None  # Trainer asks before the step; the norm is known after it (see _maybe_log_save_evaluate)

    def _maybe_log_save_evaluate(self, tr_loss: torch.Tensor, grad_norm: Any, *args: Any, **kwargs: Any) -> None:
        # The global norm (before clipping) of the latest commit round that finished: this step's for sync,
        # the previous step's for acco and dpu, whose commit round is still in flight when the step ends.
        if self.acco is not None and self.acco.last_commit is not None:
            grad_norm = self.acco.last_commit.grad_norm
        super()._maybe_log_save_evaluate(tr_loss, grad_norm, *args, **kwargs)

    def _finalize_training(self, *args: Any, **kwargs: Any) -> Any:
        if self.acco is not None:
            self.acco.finalize()  # the committed parameters in the model
            self.acco.close()  # hooks and thread released: another trainer may train this model now
        return super()._finalize_training(*args, **kwargs)

    def evaluate(self, *args: Any, **kwargs: Any) -> dict[str, float]:
        if self._dynamic and self.is_in_train:
            self.acco.rendezvous()  # every rank evaluates the same committed parameters
        return super().evaluate(*args, **kwargs)

    # ---- checkpoints --------------------------------------------------------------------------------------

    def _save_checkpoint(self, model: torch.nn.Module, trial: Any) -> None:
        if self._dynamic:
            self.acco.rendezvous()  # shards of every rank from the same commit round
        super()._save_checkpoint(model, trial)

    def save_model(self, output_dir: str | None = None, _internal_call: bool = False) -> None:
        if self.acco is None:
            return super().save_model(output_dir, _internal_call)
        with self.acco.committed_parameters():  # never the estimate
            super().save_model(output_dir, _internal_call)

    def _save_optimizer_and_scheduler(self, output_dir: str) -> None:
        save_optimizer_state(self.acco, output_dir)  # every rank writes its own shard
        if self.args.should_save:
            atomic_save(self.lr_scheduler.state_dict(), os.path.join(output_dir, SCHEDULER_NAME))

    def _save_rng_state(self, output_dir: str) -> None:
        super()._save_rng_state(output_dir)
        # Every rank's files are on disk before rank 0 writes trainer_state.json, which marks the checkpoint
        # complete (see checkpoint_incomplete); a checkpoint cut short by a crash is never resumed from.
        if dist.is_initialized() and dist.get_world_size() > 1:
            dist.barrier()

    def _load_optimizer_and_scheduler(self, checkpoint: str | None) -> None:
        if checkpoint is None:
            return
        load_optimizer_state(self.acco, checkpoint)  # collective; re-shards if the world size changed
        scheduler_file = os.path.join(checkpoint, SCHEDULER_NAME)
        if os.path.isfile(scheduler_file):
            self.lr_scheduler.load_state_dict(torch.load(scheduler_file, map_location="cpu", weights_only=True))

    # ---- logging ------------------------------------------------------------------------------------------

    def log(self, logs: dict[str, float], start_time: float | None = None) -> None:
        if self.acco is None or "loss" not in logs:
            return super().log(logs, start_time)
        logs.update(self._acco_metrics())
        super().log(logs, start_time)
        # The timings reached the console and the loggers (report_to) through on_log; the run's history keeps only
        # what the training computed, so that a resumed run's log_history equals the uninterrupted one's.
        entry = self.state.log_history[-1]
        for key in RUN_DEPENDENT_METRICS:
            entry.pop(key, None)

    def _acco_metrics(self) -> dict[str, float]:
        """Per optimizer step since the last log: exposed communication, round time, micro-batches, weight."""
        totals = dict(self.acco.totals)
        delta = {k: v - self._logged_totals.get(k, 0.0) for k, v in totals.items()}
        self._logged_totals = totals
        steps = max(delta["steps"], 1.0)
        out = {
            "acco_exposed_comm_s": delta["wait_s"] / steps,
            "acco_round_s": delta["round_s"] / steps,
            "acco_micro_batches": delta["micro_batches"] / steps,
            "acco_skipped_steps": totals["skipped_steps"],
        }
        if self.acco.last_commit is not None:
            out["acco_global_micro_batches"] = float(self.acco.last_commit.micro_batches)
        out["acco_optimizer_steps"] = float(self.acco.step_count)  # restored by a resume
        if self._dynamic:  # micro-batches differ per rank: log each (all ranks log at the same Trainer steps)
            mine = torch.tensor([delta["micro_batches"]], dtype=torch.float64, device=self.args.device)
            for rank, value in enumerate(self.accelerator.gather(mine).tolist()):
                out[f"acco_micro_batches_rank{rank}"] = value
        return out


class ACCOTrainer(ACCOTrainerMixin, Trainer):
    """Drop-in replacement for [`~transformers.Trainer`] that trains with ACCO (see [`ACCOConfig`])."""


class _JITAgreement(TrainerCallback):
    """Transformers' SIGTERM (JIT) checkpoint, requested on all ranks at the same step boundary.

    Its SIGTERM timer sets a flag per process, at any moment: ranks would save at different steps, and an
    ACCO checkpoint needs every rank's shard of the same step. The timer here only marks the request; at each
    step's start the ranks all-reduce it (one small collective per step, only with ``enable_jit_checkpoint``)
    and then all raise the flag the JIT callback checks, which saves at that step boundary and stops.
    """

    def __init__(self, trainer: Trainer, manager: Any) -> None:
        self.trainer, self.manager, self.pending = trainer, manager, False
        manager._enable_checkpoint = self._mark  # called by the SIGTERM timer thread

    def _mark(self) -> None:
        self.pending = True

    def on_step_begin(self, args: TrainingArguments, state: Any, control: Any, **kwargs: Any) -> None:
        flag = torch.tensor([1.0 if self.pending else 0.0], device=args.device)
        if dist.is_initialized():
            dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        if flag.item():
            self.pending = False
            self.manager.is_checkpoint_requested = True


def _agree_on_jit_checkpoints(trainer: Trainer) -> None:
    """Put a _JITAgreement callback in front of transformers' JIT checkpoint callback, if there is one."""
    callbacks = trainer.callback_handler.callbacks
    for i, cb in enumerate(callbacks):
        manager = getattr(cb, "jit_manager", None)
        if manager is not None:
            callbacks.insert(i, _JITAgreement(trainer, manager))
            return


def _split_rows(inputs: dict[str, Any]) -> list[tuple[dict[str, Any], float]]:
    """A micro-batch as two halves along the batch dimension, with each one's share of the rows; one row stays
    whole (a window that cannot be split ends its step early, as a short window does)."""
    rows = next((v.shape[0] for v in inputs.values() if torch.is_tensor(v) and v.dim() > 0), 0)
    if rows < 2:
        return [(inputs, 1.0)]
    cut = rows // 2

    def part(lo: int, hi: int) -> dict[str, Any]:
        return {
            k: v[lo:hi] if torch.is_tensor(v) and v.dim() > 0 and v.shape[0] == rows else v for k, v in inputs.items()
        }

    return [(part(0, cut), cut / rows), (part(cut, rows), (rows - cut) / rows)]


def _ensure_process_group(device: torch.device) -> None:
    """A one-process run still needs a process group for the engine: make a single-rank one."""
    if dist.is_initialized():
        return
    backend = "nccl" if device.type == "cuda" else "gloo"
    dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1)


def check_ddp_wrapped(trainer: Trainer) -> None:
    """After ``train()`` of a plain Trainer baseline on several processes: it did train under DDP.

    A DDP baseline whose ranks never averaged their gradients is no baseline, and nothing else says so. It happens
    when ``trainer.evaluate()`` runs before ``trainer.train()`` (transformers 5.24 with accelerate 1.15):
    evaluate() marks the bare model as prepared, and train() then does not wrap it.
    """
    if not isinstance(trainer.model_wrapped, torch.nn.parallel.DistributedDataParallel):
        raise RuntimeError(
            f"The ddp baseline trained without DistributedDataParallel ({type(trainer.model_wrapped).__name__}): "
            "its ranks never averaged their gradients. Do not call trainer.evaluate() before trainer.train() "
            "(use eval_on_start), and launch with `accelerate launch` on more than one process."
        )
