"""ACCOTrainerMixin: every override of transformers.Trainer, each a few lines that say why and delegate to a part.

What it intercepts, why, and where the work is (Trainer's loop itself is not copied or overridden):

* ``__init__``: refuse what ACCO cannot honour, before and after Trainer's own set-up (``engine.check_args``,
  ``engine.check_trainer``).
* ``train``: resume only from a checkpoint complete on every rank; a dead peer is named
  (``checkpoints.resolve_resume``, ``checkpoints.peer_failure``).
* ``_wrap_model``: Accelerate prepares the model without DDP: ACCO's rounds average the gradients; DDP's buffer
  broadcast (``ddp_broadcast_buffers``) is kept by forward hooks (``engine.sync_buffers``).
* ``create_optimizer``: the ACCOOptimizer with Trainer's groups and ``optim``, or the user's optimizer taken over,
  and the same engine again at the next ``train()`` (``engine.build_engine``).
* ``get_train_dataloader``, ``get_batch_samples``, ``_init_training_state``, ``create_scheduler``: paced accumulation's
  claimed micro-batches, the slots Trainer's loop iterates, the position in the epoch (``data``).
* ``training_step``: tell the engine a micro-batch is done, with the weight that undoes Trainer's loss
  normalisation (``weights``); with paced accumulation one whole ACCO step in the window's last slot.
* ``floating_point_ops``, ``_track_num_input_tokens``: a slot has no tokens; paced accumulation counts at logging.
* ``_clip_grad_norm``, ``_get_grad_norm``, ``_maybe_log_save_evaluate``: clipping happens inside the round, by the
  global norm; the logged norm is the last finished commit's.
* ``_finalize_training``: drain the round in flight, the committed parameters in the model, hooks released.
* ``save_model``, ``_save_optimizer_and_scheduler``, ``_save_rng_state``, ``_load_optimizer_and_scheduler``:
  committed parameters in the model files, one optimizer shard per rank, the ranks meet before the trainer
  state marks the checkpoint complete (``checkpoints``).
* ``log``: ACCO's figures next to the loss (``metrics``).
* With Accelerate's FSDP2 configuration over several machines (``hf_acco.integrations.fsdp``): ``create_optimizer``
  shards the model inside each machine before building the engine over the machines; ``_wrap_model`` leaves the
  model to Accelerate's FSDP ``prepare``; ``create_scheduler`` (right after it) restores the engine's parameter
  groups; ``evaluate`` and ``predict`` reshard after their forward passes; every rank saves
  the committed parameters (the save is collective), and checkpoints hold Trainer's FSDP model files too.

Evaluation sees the committed parameters through the optimizer's ``eval()``/``train()``, which Trainer calls around
evaluation and before every micro-batch.
"""

from __future__ import annotations

import inspect
from typing import TYPE_CHECKING, Any, cast

import torch
import torch.distributed as dist
from transformers import Trainer

from hf_acco.comm.failures import is_peer_failure
from hf_acco.comm.groups import agreed_key
from hf_acco.engine.checkpoint import fsdp_sharding_mismatch
from hf_acco.engine.core import ACCOOptimizer
from hf_acco.engine.schedule import Accumulation
from hf_acco.integrations import fsdp
from hf_acco.integrations.config import engine_accumulation, splits_batches
from hf_acco.integrations.trainer import checkpoints, data, engine, metrics, weights
from hf_acco.integrations.trainer.run_state import RunState

# Trainer's private methods and attributes the glue overrides or reads: checked against the installed Trainer by
# tests/test_trainer_glue.py (a release that renames one fails there, not in a user's run)
TRAINER_PRIVATE_METHODS = (
    "_wrap_model", "_clip_grad_norm", "_get_grad_norm", "_maybe_log_save_evaluate", "_finalize_training",
    "_save_optimizer_and_scheduler", "_save_rng_state", "_load_optimizer_and_scheduler", "_init_training_state",
    "_track_num_input_tokens", "_get_num_items_in_batch", "_remove_unused_columns",
    "_get_collator_with_removed_columns", "_save_checkpoint", "_get_output_dir",
)  # fmt: skip
TRAINER_PRIVATE_ATTRIBUTES = (
    "loss_is_scaled_for_ga",
    "model_accepts_loss_kwargs",
    "_train_batch_size",
    "_loss_shifts_labels",
)


if TYPE_CHECKING:  # the type checker reads the mixin as the Trainer it is always mixed into
    _TrainerBase = Trainer
else:
    _TrainerBase = object


class ACCOTrainerMixin(_TrainerBase):
    """Every ACCO override of [`~transformers.Trainer`], cooperative with ``super()``: put it first,
    ``class MyTrainer(ACCOTrainerMixin, SomeTrainer)``, and give it a config with the ``acco_*`` settings
    ([`ACCOConfigMixin`] joined to that trainer's config)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        # the config and the optimizers by name, whatever their position in the trainer's signature (DPOTrainer's
        # second positional argument is ref_model)
        given = inspect.signature(super().__init__).bind_partial(*args, **kwargs).arguments
        if given.get("args") is not None:
            engine.check_args(given["args"])
        optimizers = given.get("optimizers")
        if optimizers is not None and optimizers[0] is not None and not isinstance(optimizers[0], ACCOOptimizer):
            engine.check_takeover(optimizers[0], given.get("args"))
        super().__init__(*args, **kwargs)
        self.acco_run = RunState()  # the engine, the pacer and the figures the parts share
        engine.check_args(self.args)  # again: a subclass may build or replace its config in __init__ (TRL does)
        if engine_accumulation(self.args) == "paced" and self.args.average_tokens_across_devices:
            # Trainer would gather each micro-batch's token count across ranks, and ranks compute different numbers
            # of micro-batches: a hang. ACCO weighs the tokens exactly without it (see weights.micro_batch_weight).
            self.args.average_tokens_across_devices = False
        engine.check_trainer(self)
        checkpoints.agree_on_jit_checkpoints(self)

    @property
    def acco(self) -> ACCOOptimizer | None:
        """The ACCO engine (``None`` until ``train()`` builds it)."""
        return self.acco_run.engine

    def train(self, resume_from_checkpoint: str | bool | None = None, *args: Any, **kwargs: Any) -> Any:
        """Trainer.train, resuming only from complete checkpoints (``True``: the latest complete on every rank)."""
        resume_from_checkpoint = checkpoints.resolve_resume(self.args, resume_from_checkpoint)
        if isinstance(resume_from_checkpoint, str):  # before Trainer reads its model files (FSDP's or not)
            layout = fsdp.hsdp_layout(self.accelerator)
            mismatch = fsdp_sharding_mismatch(resume_from_checkpoint, layout[1] if layout else None)
            kind = checkpoints.trainer_checkpoint_kind(resume_from_checkpoint)  # plain Trainer's: DDP's or FSDP's
            if kind == "ddp" and mismatch:
                mismatch = (
                    f"{resume_from_checkpoint} is a plain Trainer checkpoint: ACCOTrainer resumes those without FSDP "
                    "inside machines only. Start from its model files (from_pretrained) without the optimizer state."
                )
            elif kind == "fsdp" and layout:  # the whole model's optimizer state: each FSDP shard takes its piece
                mismatch = None
            elif kind == "fsdp_sharded":
                mismatch = (
                    f"{resume_from_checkpoint} is a plain Trainer FSDP checkpoint with SHARDED_STATE_DICT: its "
                    "optimizer state (optimizer_0) is not imported. Resume it with plain Trainer, or start from its "
                    "model files without the optimizer state (accelerate merge-weights makes them one file)."
                )
            elif kind == "fsdp":
                mismatch = (
                    f"{resume_from_checkpoint} is a plain Trainer FSDP checkpoint: ACCOTrainer resumes it with FSDP "
                    "inside machines only (fsdp_config version 2, a parallelism_config of machines x GPUs). Start "
                    "from its model files without the optimizer state."
                )
            if mismatch:
                raise ValueError(mismatch)
        try:
            return super().train(resume_from_checkpoint, *args, **kwargs)
        except (RuntimeError, dist.DistError) as e:
            if not is_peer_failure(e):  # this rank's own error (out of memory, CUDA, a bug): as it is
                raise
            raise checkpoints.peer_failure(self.args, e) from e

    # ---- model and optimizer ------------------------------------------------------------------------------

    def _wrap_model(self, model: torch.nn.Module, training: bool = True, dataloader: Any = None) -> torch.nn.Module:
        model = super()._wrap_model(model, training, dataloader)
        if training and not getattr(model, "_is_accelerate_prepared", False) and not self.is_fsdp_enabled:
            # autocast, compile and device placement, but no DDP: the ACCO rounds average the gradients
            model = self.accelerator.prepare_model(model, evaluation_mode=True)
        if training:  # what DDP's forward would do with the buffers: rank 0's before each window
            engine.sync_buffers(self, model)
        return model

    def create_optimizer(self, model: torch.nn.Module | None = None) -> torch.optim.Optimizer:
        return engine.build_engine(self, model)  # at every train(): the same engine goes on (see reuse_engine)

    # ---- data with paced accumulation ----------------------------------------------------------------------

    def get_train_dataloader(self) -> Any:
        if engine_accumulation(self.args) != "paced":
            return super().get_train_dataloader()
        # each rank claims the micro-batches it computes (pacing.py); Trainer iterates slots
        self.acco_run.pacer, self.acco_run.step_losses = data.build_pacer(self), []
        return data.slots(self.acco_run.pacer)

    def _init_training_state(self, *args: Any, **kwargs: Any) -> tuple[int, int]:
        epochs_trained, steps_trained = super()._init_training_state(*args, **kwargs)
        pacer = self.acco_run.pacer
        if pacer is None:
            return epochs_trained, steps_trained
        # the claim counters' name: rank 0's on every rank, agreed here, inside train() where every rank is (a
        # dataloader built by one rank alone, say by a callback, must not shift the names the ranks count on)
        pacer.sampler.key = agreed_key("claims")
        bound = inspect.signature(super()._init_training_state).bind(*args, **kwargs)
        checkpoint = bound.arguments.get("resume_from_checkpoint")
        if checkpoint is not None:  # the epoch and the position in it from the checkpoint's data state
            data.restore_position(self, checkpoint)
        return pacer.resume_epoch, 0

    def create_scheduler(self, num_training_steps: int, optimizer: Any = None) -> Any:
        if self.is_fsdp_enabled:  # called right after Accelerate's FSDP prepare: see engine.restore_param_groups
            engine.restore_param_groups(self)
        if self.acco_run.pacer is not None and self.state.max_steps:  # paced: the horizon restore_position set
            num_training_steps = self.state.max_steps
        return super().create_scheduler(num_training_steps, optimizer)

    def get_batch_samples(self, epoch_iterator: Any, num_batches: int, device: torch.device) -> tuple[list, Any]:
        if self.acco_run.pacer is None:
            return super().get_batch_samples(epoch_iterator, num_batches, device)
        return data.window_slots(epoch_iterator, num_batches), None  # the last slot runs the ACCO step

    # ---- training -----------------------------------------------------------------------------------------

    def training_step(
        self, model: torch.nn.Module, inputs: dict[str, Any], num_items_in_batch: torch.Tensor | int | None = None
    ) -> torch.Tensor:
        if self.acco is None:  # outside train() (a one-step check): Trainer's own step, gradients in .grad
            return super().training_step(model, inputs, num_items_in_batch)
        if isinstance(inputs, data.Slot):  # paced accumulation (see get_batch_samples)
            return self._paced_step(model) if inputs.last else torch.zeros((), device=self.args.device)
        # A window of one micro-batch under fixed acco: its two halves along the batch dimension, each one's loss
        # and gradient scaled by its share of the rows, so the step's are the whole batch's
        parts = weights.split_rows(inputs) if splits_batches(self.args) else [(inputs, 1.0)]
        total: torch.Tensor | None = None
        for part, share in parts:
            items: Any = num_items_in_batch
            if items is not None and share != 1.0 and weights.loss_is_scaled(self, items):
                items = items * share  # with the share as gradient scale: a loss summed over N is summed over N
            loss, _, scale = self._micro_batch(model, part, num_items_in_batch, items, share)
            loss = loss if len(parts) == 1 else loss * scale
            total = loss if total is None else total + loss
        return cast(torch.Tensor, total)  # (parts is never empty)

    def _micro_batch(
        self, model: torch.nn.Module, inputs: Any, window_items: Any, items: Any, share: float
    ) -> tuple[torch.Tensor, float | torch.Tensor, float]:
        """Trainer's forward and backward of one micro-batch, its gradient scaled and weighted for the engine:
        (loss, weight, gradient scale)."""
        weight, scale = weights.micro_batch_weight(self, inputs, window_items, share, self._paced)  # before the pop
        acco = engine.engine_of(self)
        acco.grad_scale = scale
        loss = super().training_step(model, inputs, items)
        acco.grad_scale = 1.0
        acco.after_backward(weight)
        return loss, weight, scale

    def _paced_step(self, model: torch.nn.Module) -> torch.Tensor:
        """One ACCO optimizer step over the micro-batches this rank claims of the step's global batch; returns the
        mean loss of this rank's micro-batches (weighted as the gradient is)."""
        loss_sum, weight_sum = torch.zeros((), device=self.args.device), 0.0
        pacer = data.pacer_of(self)
        for inputs in pacer.step_batches(self.acco):
            num_items = self._get_num_items_in_batch([inputs], self.args.device)  # this micro-batch's alone
            if torch.is_tensor(num_items) and int(num_items) == 0:  # all labels masked: weight 0, zero gradient
                num_items = torch.ones_like(num_items)  # (not a division by zero on this rank alone)
            loss, counted, _ = self._micro_batch(model, inputs, num_items, num_items, 1.0)
            weight = float(counted)  # paced weights are host floats: each micro-batch is its own window
            scaled = weights.loss_is_scaled(self, num_items)
            mean = loss if scaled else loss * self.current_gradient_accumulation_steps
            loss_sum += mean.detach() * weight
            weight_sum += weight
            self.current_flos += float(self.floating_point_ops(inputs))  # type: ignore[assignment]  # as Trainer
            self.acco_run.input_tokens += weights.input_tokens(self, inputs)
        if pacer.epoch_done:
            self.control.should_epoch_stop = True  # the epoch's batches are all used: every rank ends it here
        self.acco_run.step_losses.append(torch.stack([loss_sum, torch.tensor(weight_sum, device=loss_sum.device)]))
        if weight_sum == 0:  # its peers computed all of this step; Trainer's nan filter fills in the mean so far
            return torch.tensor(float("nan") if self.args.logging_nan_inf_filter else 0.0, device=self.args.device)
        return loss_sum / weight_sum

    def floating_point_ops(self, inputs: Any) -> int:
        return 0 if isinstance(inputs, data.Slot) else super().floating_point_ops(inputs)  # a slot's: _paced_step

    def _track_num_input_tokens(self, inputs: Any) -> None:
        # Trainer gathers the count across ranks every micro-batch; with paced accumulation the counts are gathered at
        # logging instead (metrics.per_rank_metrics): a gather every step would hold the fast rank back
        if not isinstance(inputs, data.Slot):
            super()._track_num_input_tokens(inputs)

    @property
    def _paced(self) -> bool:
        return self.acco is not None and self.acco.accumulation is Accumulation.PACED

    def count_label_tokens(self, inputs: dict[str, Any]) -> float | torch.Tensor:
        """The number of tokens a micro-batch's summed loss adds up: the weight its gradient gets. Override it for a
        loss that counts otherwise. Default, as Trainer counts ``num_items_in_batch``: ``weights.label_tokens``.
        Padding-free batches (sequences packed into one row) need nothing more: their collators mark the first
        label of every sequence -100."""
        return weights.label_tokens(inputs, getattr(self, "_loss_shifts_labels", False))

    def _clip_grad_norm(self, model: torch.nn.Module) -> None:
        return None  # clipped inside the round, by the norm of the globally averaged gradient

    def _get_grad_norm(self, model: torch.nn.Module, grad_norm: Any = None) -> float | None:
        return None  # Trainer asks before the step; the norm is known after it (see _maybe_log_save_evaluate)

    def _maybe_log_save_evaluate(self, tr_loss: torch.Tensor, grad_norm: Any, *args: Any, **kwargs: Any) -> None:
        # The global norm (before clipping) of the latest commit round that finished: this step's for sync,
        # the previous step's for acco and dpu, whose commit round is still in flight when the step ends.
        if self.acco is not None and self.acco.last_commit is not None:
            grad_norm = self.acco.last_commit.grad_norm
        pacer = self.acco_run.pacer
        if pacer is not None and not pacer.sampler.endless:  # the epoch's fraction: the data used
            self.state.epoch = pacer.progress
        super()._maybe_log_save_evaluate(tr_loss, grad_norm, *args, **kwargs)

    # evaluate and predict, wherever they are called from (the loop, eval_on_start, a callback): see fsdp.reshard
    def evaluate(self, *args: Any, **kwargs: Any) -> Any:
        return then_reshard(self, super().evaluate, *args, **kwargs)

    def predict(self, *args: Any, **kwargs: Any) -> Any:
        return then_reshard(self, super().predict, *args, **kwargs)

    def _finalize_training(self, *args: Any, **kwargs: Any) -> Any:
        if self.acco is not None:
            self.acco.finalize()  # the committed parameters in the model
            self.acco.close()  # hooks and thread released: another trainer may train this model now
        return super()._finalize_training(*args, **kwargs)

    # ---- checkpoints --------------------------------------------------------------------------------------

    def save_model(self, output_dir: str | None = None, _internal_call: bool = False) -> None:
        # The model files get the committed parameters, never the estimate: loaded only where they are written
        # (should_save: the main process, or each node's first with save_on_each_node; Trainer's save_model writes
        # nothing elsewhere and makes no collective), so the other ranks copy nothing
        # With FSDP every rank holds a piece of the model, and Trainer's save gathers it (a collective): every
        # rank loads the committed parameters.
        if self.acco is None or not (self.args.should_save or self.is_fsdp_enabled):
            return super().save_model(output_dir, _internal_call)
        with self.acco.committed_parameters(), checkpoints.model_files_on_this_node(self):
            super().save_model(output_dir, _internal_call)

    def _save_checkpoint(self, model: Any, trial: Any) -> None:
        checkpoints.clear_for_rewrite(self, trial)  # a step saved again: no other run's state left beside ours
        super()._save_checkpoint(model, trial)

    def _save_optimizer_and_scheduler(self, output_dir: str) -> None:
        checkpoints.save_engine_state(self, output_dir)  # one shard per rank instead of optimizer.pt
        if self.is_fsdp_enabled:  # the model as Trainer's FSDP checkpoint holds it, which its resume loads
            checkpoints.save_fsdp_model_state(self, output_dir)

    def _save_rng_state(self, output_dir: str) -> None:
        super()._save_rng_state(output_dir)
        checkpoints.ranks_meet_before_trainer_state()  # then rank 0 writes trainer_state.json: complete

    def _load_optimizer_and_scheduler(self, checkpoint: str | None) -> None:
        if checkpoint is not None:
            checkpoints.load_engine_state(self, checkpoint)  # collective; re-shards if the world size changed

    # ---- logging ------------------------------------------------------------------------------------------

    def log(self, logs: dict[str, float], start_time: float | None = None) -> None:
        if self.acco is None or "loss" not in logs:
            return super().log(logs, start_time)
        logs.update(metrics.acco_metrics(self, self._paced))
        super().log(logs, start_time)
        # The timings reached the console and the loggers (report_to) through on_log; the run's history keeps only
        # what the training computed, so that a resumed run's log_history equals the uninterrupted one's.
        entry = self.state.log_history[-1]
        for key in metrics.RUN_DEPENDENT_METRICS:
            entry.pop(key, None)


def then_reshard(trainer: ACCOTrainerMixin, run: Any, *args: Any, **kwargs: Any) -> Any:
    """``run(*args, **kwargs)``, then, with FSDP, every group of the model resharded (see ``fsdp.reshard``)."""
    try:
        return run(*args, **kwargs)
    finally:
        if trainer.is_fsdp_enabled:
            fsdp.reshard(cast(torch.nn.Module, trainer.model))


class ACCOTrainer(ACCOTrainerMixin, Trainer):
    """Drop-in replacement for [`~transformers.Trainer`] that trains with ACCO (see [`ACCOConfig`])."""
