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
* dynamic mode (``acco_accumulation="dynamic"``): ``get_train_dataloader`` builds Trainer's data pipeline over
  batches every rank claims from one shared, seeded order (claims.py; an IterableDataset: each rank's own shard,
  its batches numbered from one shared counter), and gives Trainer slots to iterate;
  ``get_batch_samples`` turns a window into slots; ``training_step`` runs one ACCO step in the window's last slot
  (pacing.py); ``_init_training_state`` takes the epoch and the position in it from the checkpoint.
* ``log``: ACCO's figures (exposed communication, round time, micro-batches, tokens) next to the loss.

Dynamic accumulation under Trainer. A Trainer step is one ACCO optimizer step over one global batch of
``world_size x gradient_accumulation_steps`` micro-batches; each rank computes as many of them as its speed allows
(the next one it claims), so a rank twice as fast computes about twice as many, and every sample is used once per
epoch. The steps per epoch, ``max_steps``, the learning-rate schedule and the logging, evaluation and checkpoint
cadence are Trainer's (as under DDP with the same settings); every rank is at the same step at every boundary, so
they add no meeting point. Per-rank micro-batches and tokens are logged.

Evaluation sees the committed parameters through the optimizer's ``eval()``/``train()``, which Trainer calls
around evaluation and before every micro-batch.
"""

from __future__ import annotations

import contextlib
import datetime
import functools
import inspect
import itertools
import json
import logging
import math
import os
import re
from typing import Any

import datasets
import torch
import torch.distributed as dist
from datasets.distributed import split_dataset_by_node
from transformers import Trainer, TrainerCallback, TrainingArguments
from transformers.trainer_pt_utils import IterableDatasetShard, LengthGroupedSampler, get_length_grouped_indices
from transformers.trainer_utils import has_length, seed_worker

from .baselines import check_ddp_wrapped  # noqa: F401  (its old import path, kept for scripts)
from .checkpoint import atomic_save, load_optimizer_state, missing_shards, save_optimizer_state
from .claims import ClaimingBatchSampler, StreamTickets, default_store
from .comm import Communicator, PeerFailure, check_world_size, is_peer_failure, node
from .config import check_halves, check_supported, engine_accumulation, engine_micro_batches, splits_batches
from .core import ACCOOptimizer
from .distributed import agreed_key, ensure_process_group, every_rank
from .optim import check_elementwise
from .pacing import Pacer
from .schedule import Accumulation, validate_settings

logger = logging.getLogger(__name__)

SCHEDULER_NAME = "scheduler.pt"
DATA_STATE_NAME = "acco_data_state.json"  # dynamic mode: the position in the epoch (pacing.Pacer.state_dict)
RUN_DEPENDENT_METRICS = ("acco_exposed_comm_s", "acco_round_s")  # logged, not kept in state.log_history
TRAINER_STATE_NAME = "trainer_state.json"
JIT_SENTINEL = "checkpoint-is-incomplete.txt"  # transformers' JIT checkpoint marks a checkpoint in progress


def checkpoint_incomplete(path: str, world_size: int | None = None, ranks: list[int] | None = None) -> str | None:
    """Why ``path`` is not a complete ACCOTrainer checkpoint for ``ranks`` of a run on ``world_size`` ranks (for
    every rank when not given), or None.

    Every rank writes its files, then the ranks meet, then rank 0 (each node's first process with
    ``save_on_each_node``) writes ``trainer_state.json``: a checkpoint with a readable trainer state (and no JIT
    sentinel) has all its files. One killed while it was written lacks it. A per-node checkpoint holds only its
    node's optimizer shards: complete for the ranks that read it.
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
    missing = missing_shards(path, world_size, ranks)
    return f"it lacks {missing}" if missing else None


def complete_checkpoints(output_dir: str, world_size: int | None = None, ranks: list[int] | None = None) -> dict:
    """{N: path} of the checkpoint-N directories in ``output_dir`` complete for ``ranks`` (see
    ``checkpoint_incomplete``); the others are named in a warning."""
    if not os.path.isdir(output_dir):
        return {}
    found = {}
    for name in os.listdir(output_dir):
        match = re.fullmatch(r"checkpoint-(\d+)", name)
        path = os.path.join(output_dir, name)
        if match and os.path.isdir(path):
            reason = checkpoint_incomplete(path, world_size, ranks)
            if reason is None:
                found[int(match.group(1))] = path
            else:
                # per rank, per node (each node may have its own copy): say which one saw it
                where = f"rank {ranks[0]}, {node()}" if ranks and len(ranks) == 1 else node()
                logger.warning("Skipping %s (on %s): %s.", path, where, reason)
    return found


def last_complete_checkpoint(
    output_dir: str, world_size: int | None = None, ranks: list[int] | None = None
) -> str | None:
    """The checkpoint-N directory with the highest N that is complete (see ``checkpoint_incomplete``), or None."""
    found = complete_checkpoints(output_dir, world_size, ranks)
    return found[max(found)] if found else None


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
        engine_accumulation(training_args),
        engine_micro_batches(training_args),
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
        if engine_accumulation(self.args) == "paced" and self.args.average_tokens_across_devices:
            # Trainer would gather each micro-batch's token count across ranks, and ranks compute different numbers
            # of micro-batches: a hang. ACCO weighs the tokens exactly without it (see _micro_batch_weight).
            self.args.average_tokens_across_devices = False
        if self.train_dataset is not None and hasattr(self.train_dataset, "__len__") and len(self.train_dataset) == 0:
            raise ValueError("train_dataset is empty: ACCO has nothing to train on. Check the data files and filters.")
        if self.optimizer_cls_and_kwargs is None:
            cls, _ = Trainer.get_optimizer_cls_and_kwargs(self.args, self.model)
            check_elementwise(cls, _setting(self.args, "acco_allow_custom_optimizer", False), _ALLOW_CUSTOM)
        check_world_size(self.accelerator.num_processes)
        if (
            engine_accumulation(self.args) == "paced"
            and _setting(self.args, "acco_schedule", "acco") == "acco"
            and self.args.world_size * self.args.gradient_accumulation_steps < 2
        ):
            raise ValueError(
                "acco_accumulation='dynamic' with acco_schedule='acco' needs a global batch of at least 2 "
                "micro-batches (one per half): world_size x gradient_accumulation_steps is 1. Raise "
                "gradient_accumulation_steps, or use acco_accumulation='fixed' (it splits a micro-batch in two)."
            )
        _agree_on_jit_checkpoints(self)
        self.acco: ACCOOptimizer | None = None
        self._pacer: Pacer | None = None  # dynamic mode: the claimed micro-batches of each step
        self._logged_totals: dict[str, float] = {}
        self._input_tokens = self._logged_tokens = 0.0  # input tokens this rank computed, and when last logged
        self._step_losses: list[torch.Tensor] = []  # dynamic mode: (loss x weight, weight) per step since the log

    def train(self, resume_from_checkpoint: str | bool | None = None, *args: Any, **kwargs: Any) -> Any:
        """Trainer.train, resuming only from complete checkpoints (``True``: the latest complete one)."""
        # Which checkpoint is complete is decided by all ranks together (collective): each checks what it reads (its
        # own shard: on a per-node checkpoint, save_on_each_node, only its node's are there), so that no rank resumes
        # from step 8 while another resumes from step 4, and a bad checkpoint fails on every rank alike.
        world, rank = self.args.world_size, self.args.process_index
        if resume_from_checkpoint is True:
            mine = complete_checkpoints(self.args.output_dir, world, [rank])
            everywhere = set.intersection(*(set(steps) for steps in every_rank(sorted(mine))))
            for step in sorted(set(mine) - everywhere):
                logger.warning(
                    "Skipping %s (on rank %d, %s): incomplete on another rank (its shard or its node's files).",
                    mine[step],
                    rank,
                    node(),
                )
            found = mine[max(everywhere)] if everywhere else None
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
            reasons = every_rank(checkpoint_incomplete(resume_from_checkpoint, world, [rank]))
            reason = next((f"{r} (on rank {i})" for i, r in enumerate(reasons) if r is not None), None)
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
                f"Training stopped on rank {rank} ({node()}): peer rank(s) {[r for r in range(world) if r != rank]} "
                "died or "
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
        ensure_process_group(self.accelerator.device)
        self._logged_totals = {}  # a new engine's figures start from zero
        self.acco = ACCOOptimizer(
            [g for g in groups if g["params"]],
            optimizer_cls=optimizer_cls,
            schedule=_setting(args, "acco_schedule", "acco"),
            accumulation=engine_accumulation(args),
            micro_batches=engine_micro_batches(args),
            max_grad_norm=args.max_grad_norm if args.max_grad_norm and args.max_grad_norm > 0 else None,
            warmup_steps=_setting(args, "acco_warmup_steps", 0),
            communicator=Communicator(
                reduce_scatter=_setting(args, "acco_reduce_scatter", "auto"),
                timeout=datetime.timedelta(seconds=_setting(args, "acco_comm_timeout_s", 1800.0)),
            ),
            bucket_numel=_setting(args, "acco_bucket_numel", None),
            nonfinite=_setting(args, "acco_nonfinite", "skip"),
            comm_dtype=_setting(args, "acco_comm_dtype", "auto"),
            grad_dtype=_setting(args, "acco_grad_dtype", "fp32"),
            allow_custom_optimizer=True,  # checked just above, with the advice that fits Trainer
            **optimizer_kwargs,
        )
        if taken is not None and getattr(self.lr_scheduler, "optimizer", None) is taken:
            self.lr_scheduler.optimizer = self.acco  # the user's schedule now sets the engine's learning rates
        # prepared here without the state_dict round trip Accelerate does at prepare time (a collective for us)
        self.optimizer = self.accelerator.prepare_optimizer(self.acco, device_placement=False)
        return self.optimizer

    # ---- data in dynamic mode -----------------------------------------------------------------------------

    def get_train_dataloader(self) -> Any:
        if engine_accumulation(self.args) != "paced":
            return super().get_train_dataloader()
        # dynamic mode: each rank claims the micro-batches it computes (pacing.py); Trainer iterates slots
        self._pacer, self._step_losses = self._build_pacer(), []
        return _EndlessSlots(self._pacer) if self._pacer.sampler.endless else _PacedSlots(self._pacer)

    def _build_pacer(self) -> Pacer:
        """Trainer's data pipeline (unused columns, collator, workers, seed, sampling strategy) over batches claimed
        from one shared, seeded order of the dataset: every sample once per epoch, whatever the ranks' speeds."""
        args, dataset = self.args, self.train_dataset
        if dataset is None:
            raise ValueError("Trainer: training requires a train_dataset.")
        store = default_store() if dist.is_initialized() and dist.get_world_size() > 1 else dist.HashStore()
        if isinstance(dataset, torch.utils.data.IterableDataset) or not has_length(dataset):
            return self._build_stream_pacer(dataset, store)
        collator = self.data_collator
        if isinstance(dataset, datasets.Dataset):
            dataset = self._remove_unused_columns(dataset, description="Training")
        else:
            collator = self._get_collator_with_removed_columns(collator, description="Training")
        strategy = getattr(args, "train_sampling_strategy", "random")
        if strategy not in ("random", "sequential", "group_by_length"):
            raise ValueError(
                f"train_sampling_strategy={strategy!r} is not supported with acco_accumulation='dynamic' (it plans "
                "each rank's batches ahead; here ranks claim batches as they go). Use 'random', 'sequential' or "
                "'group_by_length'."
            )
        seed = args.data_seed if args.data_seed is not None else args.seed
        if args.dataloader_num_workers > 0:
            logger.warning(
                "acco_accumulation='dynamic' with dataloader_num_workers=%d: the workers claim about prefetch_factor "
                "x num_workers batches ahead, so a slow rank holds more claims than it would compute in time. Use 0 "
                "or 1 worker and a small dataloader_prefetch_factor when a rank is much slower.",
                args.dataloader_num_workers,
            )
        sampler = ClaimingBatchSampler(
            store, len(dataset), self._train_batch_size, seed=seed, drop_last=args.dataloader_drop_last,
            shuffle=strategy != "sequential", num_replicas=args.world_size,
            order=self._length_grouped_order(dataset, seed) if strategy == "group_by_length" else None,
        )  # fmt: skip
        loader = torch.utils.data.DataLoader(
            dataset, batch_sampler=sampler, collate_fn=collator, num_workers=args.dataloader_num_workers,
            pin_memory=args.dataloader_pin_memory, persistent_workers=args.dataloader_persistent_workers,
            multiprocessing_context=args.dataloader_multiprocessing_context,
            prefetch_factor=args.dataloader_prefetch_factor, in_order=args.dataloader_in_order,
            worker_init_fn=functools.partial(
                seed_worker, num_workers=args.dataloader_num_workers, rank=args.process_index
            ),
        )  # fmt: skip
        return Pacer(loader, sampler, args.world_size * args.gradient_accumulation_steps)

    def _build_stream_pacer(self, dataset: Any, store: dist.Store) -> Pacer:
        """An IterableDataset: every rank reads its own shard (datasets' split_dataset_by_node, else Trainer's
        IterableDatasetShard) at its own pace, starting it again when it ends; the batches are numbered from one
        shared counter, so the steps are global batches as for a map-style dataset. Needs ``max_steps``."""
        args = self.args
        if isinstance(dataset, datasets.IterableDataset):
            shard = split_dataset_by_node(dataset, rank=args.process_index, world_size=args.world_size)
        else:
            shard = IterableDatasetShard(
                dataset, batch_size=self._train_batch_size, drop_last=args.dataloader_drop_last,
                num_processes=args.world_size, process_index=args.process_index, seed=args.seed,
            )  # fmt: skip
        loader = torch.utils.data.DataLoader(
            shard, batch_size=self._train_batch_size, drop_last=args.dataloader_drop_last,
            collate_fn=self._get_collator_with_removed_columns(self.data_collator, description="Training"),
            num_workers=args.dataloader_num_workers, pin_memory=args.dataloader_pin_memory,
        )  # fmt: skip
        tickets = StreamTickets(store, self._train_batch_size)
        return Pacer(loader, tickets, args.world_size * args.gradient_accumulation_steps)

    def _length_grouped_order(self, dataset: Any, seed: int) -> Any:
        """group_by_length: Trainer's grouping of similar lengths, seeded per epoch the same way on every rank."""
        column = self.args.length_column_name
        lengths = dataset[column] if isinstance(dataset, datasets.Dataset) and column in dataset.column_names else None
        name = self.processing_class.model_input_names[0] if self.processing_class is not None else None
        grouped = LengthGroupedSampler(self._train_batch_size, dataset=dataset, lengths=lengths, model_input_name=name)

        def order(epoch: int) -> list[int]:
            generator = torch.Generator().manual_seed(seed + epoch)
            return get_length_grouped_indices(grouped.lengths, self._train_batch_size, generator=generator)

        return order

    def _init_training_state(self, *args: Any, **kwargs: Any) -> tuple[int, int]:
        epochs_trained, steps_trained = super()._init_training_state(*args, **kwargs)
        if self._pacer is None:
            return epochs_trained, steps_trained
        # the claim counters' name: rank 0's on every rank, agreed here, inside train() where every rank is (a
        # dataloader built by one rank alone, say by a callback, must not shift the names the ranks count on)
        self._pacer.sampler.key = agreed_key("claims")
        # Dynamic mode: the epoch and the position in it come from the checkpoint's data state (Trainer would
        # derive them from global_step and skip batches by fetching them, which here would claim them).
        checkpoint = (
            inspect.signature(super()._init_training_state)
            .bind(*args, **kwargs)
            .arguments.get("resume_from_checkpoint")
        )
        if checkpoint is not None:
            path = os.path.join(checkpoint, DATA_STATE_NAME)
            if not os.path.isfile(path):
                raise ValueError(
                    f"{checkpoint} has no {DATA_STATE_NAME}: it was written with acco_accumulation='fixed'. Resume it "
                    "with acco_accumulation='fixed'."
                )
            with open(path, encoding="utf-8") as f:
                self._pacer.load_state_dict(json.load(f))
            if self.args.max_steps <= 0:  # epochs: the steps the data has left at this world size (Trainer's
                # count unless the checkpoint had other ranks), a fractional last epoch included
                per_epoch = -(-len(self._pacer.sampler) // self.args.gradient_accumulation_steps)
                done = per_epoch - self._pacer.steps_left()  # of the resumed epoch, in this world size's steps
                epochs_left = self.args.num_train_epochs - self._pacer.resume_epoch
                self.state.max_steps = self.state.global_step + max(math.ceil(epochs_left * per_epoch) - done, 0)
        return self._pacer.resume_epoch, 0

    def create_scheduler(self, num_training_steps: int, optimizer: Any = None) -> Any:
        if self._pacer is not None and self.state.max_steps:  # dynamic mode: the horizon _init_training_state set
            num_training_steps = self.state.max_steps
        return super().create_scheduler(num_training_steps, optimizer)

    def get_batch_samples(self, epoch_iterator: Any, num_batches: int, device: torch.device) -> tuple[list, Any]:
        if self._pacer is None:
            return super().get_batch_samples(epoch_iterator, num_batches, device)
        # Dynamic mode: Trainer's window is its slots; the last one runs a whole ACCO step (training_step), so that
        # one Trainer step is one optimizer step with Trainer's own step, logging and checkpoint cadence.
        slots = sum(1 for _ in itertools.islice(epoch_iterator, num_batches))
        return [_Slot(last=i == slots - 1) for i in range(slots)], None

    # ---- training -----------------------------------------------------------------------------------------

    def training_step(
        self, model: torch.nn.Module, inputs: dict[str, Any], num_items_in_batch: torch.Tensor | int | None = None
    ) -> torch.Tensor:
        if self.acco is None:  # outside train() (a one-step check): Trainer's own step, gradients in .grad
            return super().training_step(model, inputs, num_items_in_batch)
        if isinstance(inputs, _Slot):  # dynamic mode (see get_batch_samples)
            return self._paced_step(model) if inputs.last else torch.zeros((), device=self.args.device)
        # A window of one micro-batch under fixed acco: its two halves along the batch dimension, each one's loss
        # and gradient scaled by its share of the rows, so the step's are the whole batch's (see _micro_batch_weight)
        parts = _split_rows(inputs) if splits_batches(self.args) else [(inputs, 1.0)]
        total = None
        for part, share in parts:
            weight, scale = self._micro_batch_weight(part, num_items_in_batch, share)  # before labels are popped
            items = num_items_in_batch
            if items is not None and share != 1.0 and self._loss_is_scaled(items):
                items = items * share  # with the share as gradient scale: a loss summed over N is summed over N
            self.acco.grad_scale = scale
            loss = super().training_step(model, part, items)
            self.acco.grad_scale = 1.0
            self.acco.after_backward(weight)
            loss = loss if len(parts) == 1 else loss * scale
            total = loss if total is None else total + loss
        return total

    def _paced_step(self, model: torch.nn.Module) -> torch.Tensor:
        """One ACCO optimizer step over the micro-batches this rank claims of the step's global batch; returns the
        mean loss of this rank's micro-batches (weighted as the gradient is)."""
        loss_sum, weight_sum = torch.zeros((), device=self.args.device), 0.0
        for inputs in self._pacer.step_batches(self.acco):
            num_items = self._get_num_items_in_batch([inputs], self.args.device)  # this micro-batch's alone
            if torch.is_tensor(num_items) and int(num_items) == 0:  # all labels masked: weight 0, zero gradient
                num_items = torch.ones_like(num_items)  # (not a division by zero on this rank alone)
            weight, scale = self._micro_batch_weight(inputs, num_items)
            self.acco.grad_scale = scale
            loss = super().training_step(model, inputs, num_items)
            self.acco.grad_scale = 1.0
            self.acco.after_backward(weight)
            mean = loss if self._loss_is_scaled(num_items) else loss * self.current_gradient_accumulation_steps
            loss_sum += mean.detach() * weight
            weight_sum += weight
            self.current_flos += float(self.floating_point_ops(inputs))
            self._input_tokens += self._count_input_tokens(inputs)
        if self._pacer.epoch_done:
            self.control.should_epoch_stop = True  # the epoch's batches are all used: every rank ends it here
        self._step_losses.append(torch.stack([loss_sum, torch.tensor(weight_sum, device=loss_sum.device)]))
        if weight_sum == 0:  # its peers computed all of this step; Trainer's nan filter fills in the mean so far
            return torch.tensor(float("nan") if self.args.logging_nan_inf_filter else 0.0, device=self.args.device)
        return loss_sum / weight_sum

    def floating_point_ops(self, inputs: Any) -> int:
        return 0 if isinstance(inputs, _Slot) else super().floating_point_ops(inputs)  # a slot's: in _paced_step

    def _track_num_input_tokens(self, inputs: Any) -> None:
        # Trainer gathers the count across ranks every micro-batch; in dynamic mode the counts are gathered at
        # logging instead (_acco_metrics): a gather every step would hold the fast rank back to the slow one
        if not isinstance(inputs, _Slot):
            super()._track_num_input_tokens(inputs)

    def _count_input_tokens(self, inputs: dict[str, Any]) -> float:
        if "attention_mask" in inputs and self.args.include_num_input_tokens_seen != "all":
            return float(inputs["attention_mask"].sum())
        main = inputs.get(getattr(self.model, "main_input_name", "input_ids"))
        return float(main.numel()) if torch.is_tensor(main) else 0.0

    @property
    def _paced(self) -> bool:
        return self.acco is not None and self.acco.accumulation is Accumulation.PACED

    def _loss_is_scaled(self, num_items_in_batch: torch.Tensor | int | None) -> bool:
        """Whether Trainer normalised the loss by ``num_items_in_batch`` (else by the window's micro-batch count)."""
        if self.loss_is_scaled_for_ga is not None:
            return self.loss_is_scaled_for_ga
        return (
            self.model_accepts_loss_kwargs and num_items_in_batch is not None
        ) or self.compute_loss_func is not None

    def _micro_batch_weight(
        self, inputs: dict[str, Any], num_items_in_batch: torch.Tensor | int | None, share: float = 1.0
    ) -> tuple[float, float]:
        """(weight, gradient scale) that undo Trainer's normalisation of this micro-batch's loss.

        Trainer divides a token-summed loss by the window's token count ``num_items_in_batch`` (times the number
        of processes, which DDP divides out again), or a mean loss by the number of micro-batches in the window.
        Fixed mode: the same factor for every micro-batch of a step on every rank, so weight = factor x tokens
        makes the engine's sum / weight the exact token-weighted average, for each half as for the whole step.
        Dynamic mode: each micro-batch is its own window (its ``num_items_in_batch`` is its own token count), so
        the gradient is scaled back to a plain token sum and the weight is the token count.

        ``share``: the fraction of the micro-batch's rows in this part of it (a window of one micro-batch split into
        two halves). The part's gradient is scaled by it, and a token-normalised loss is given ``num_items_in_batch
        x share`` (training_step): a loss summed over the window's N tokens then sums over N as one micro-batch's
        would, and a model that takes the loss kwargs but returns a mean (it ignores N) gives the mean of the batch,
        as Trainer+DDP computes it for the whole micro-batch (not twice it).

        A window without a label token (``num_items_in_batch == 0``: this rank's, or every rank's when tokens are
        averaged across devices): Trainer's loss is 0/0, its gradient exactly 0 (cross-entropy with every target
        ignored writes no gradient), and DDP still counts the rank in its average and takes the step (momentum and
        weight decay move the parameters). Its micro-batches weigh 1 / gradient_accumulation_steps each, so the
        window weighs what a rank's window weighs (1): the averages, and the step, are DDP's.
        """
        if not self._loss_is_scaled(num_items_in_batch):
            return share / self.current_gradient_accumulation_steps, share
        if num_items_in_batch is None:
            return 1.0, 1.0
        if float(num_items_in_batch) == 0:
            return share / self.current_gradient_accumulation_steps, share
        tokens = self.count_label_tokens(inputs)
        factor = 1.0
        if self.args.average_tokens_across_devices and (self.model_accepts_loss_kwargs or self.compute_loss_func):
            factor = float(self.accelerator.num_processes // self.get_tp_size())
        factor /= float(num_items_in_batch)
        if self._paced:
            return tokens, 1.0 / factor
        return tokens * factor, share

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
        if self._pacer is not None and not self._pacer.sampler.endless:  # the epoch's fraction: the data used
            self.state.epoch = self._pacer.progress
        super()._maybe_log_save_evaluate(tr_loss, grad_norm, *args, **kwargs)

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
        if self.acco is None or not self.args.should_save:
            return super().save_model(output_dir, _internal_call)
        with self.acco.committed_parameters(), _model_files_on_this_node(self):
            super().save_model(output_dir, _internal_call)

    def _save_optimizer_and_scheduler(self, output_dir: str) -> None:
        save_optimizer_state(self.acco, output_dir)  # every rank writes its own shard
        data = self._pacer.state_dict() if self._pacer is not None else None  # collective with streams: every rank
        if self.args.should_save:
            atomic_save(self.lr_scheduler.state_dict(), os.path.join(output_dir, SCHEDULER_NAME))
            if data is not None:  # the same on every rank at a step boundary
                _atomic_write_json(data, os.path.join(output_dir, DATA_STATE_NAME))

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
        if self._paced:  # micro-batches differ per rank: log each (all ranks log at the same step: one gather)
            tokens, self._logged_tokens = self._input_tokens - self._logged_tokens, self._input_tokens
            counts = torch.tensor([delta["micro_batches"], tokens], dtype=torch.float64, device=self.args.device)
            losses = torch.stack(self._step_losses).double().flatten() if self._step_losses else counts[:0]
            self._step_losses = []
            gathered = self.accelerator.gather(torch.cat([counts, losses])).view(self.args.world_size, -1)
            # the loss of each step's global batch, weighted as its gradient (whoever computed which micro-batch),
            # then averaged over the steps as Trainer does: what DDP logs, not a mean of per-rank means
            sums = gathered[:, 2:].sum(0).view(-1, 2)
            if len(sums):
                out["loss"] = float((sums[:, 0] / sums[:, 1]).mean())
            per_rank = gathered[:, :2].tolist()
            for rank, (micro_batches, rank_tokens) in enumerate(per_rank):
                out[f"acco_micro_batches_rank{rank}"] = micro_batches / steps
                out[f"acco_tokens_rank{rank}"] = rank_tokens / steps
            global_tokens = sum(t for _, t in per_rank)
            out["acco_global_batch_tokens"] = global_tokens / steps
            if self.args.include_num_input_tokens_seen != "no":
                self.state.num_input_tokens_seen += int(global_tokens)
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


class _Slot:
    """One of the slots of a Trainer window in dynamic mode; the window's last one runs the ACCO step."""

    __slots__ = ("last",)

    def __init__(self, last: bool) -> None:
        self.last = last


class _PacedSlots:
    """What Trainer's loop iterates in dynamic mode: per epoch, a rank's share of the micro-batches on average, so
    that Trainer's steps per epoch, ``max_steps`` and learning-rate schedule come out as under DDP (one step per
    ``gradient_accumulation_steps`` slots). The micro-batches themselves come from the pacer."""

    def __init__(self, pacer: Pacer) -> None:
        self.pacer = pacer
        self.dataset = pacer.loader.dataset  # Trainer's num_examples

    def __len__(self) -> int:
        return len(self.pacer.sampler)

    def __iter__(self) -> Any:
        return iter(range(len(self)))

    def set_epoch(self, epoch: int) -> None:  # Trainer calls it at every epoch's start
        self.pacer.set_epoch(epoch)


class _EndlessSlots:
    """Dynamic mode over per-rank streams: slots without a length (Trainer counts steps to ``max_steps``)."""

    def __init__(self, pacer: Pacer) -> None:
        self.pacer = pacer

    def __iter__(self) -> Any:
        return itertools.count()

    def set_epoch(self, epoch: int) -> None:
        self.pacer.set_epoch(epoch)


@contextlib.contextmanager
def _model_files_on_this_node(trainer: Trainer) -> Any:
    """With ``save_on_each_node``, each node's first process writes the model files too (every node holds the full
    parameters: a per-node checkpoint then resumes without a shared file system). transformers 5.24's
    ``save_pretrained`` writes on global rank 0 only (``should_save_on_this_rank``); Trainer passes
    ``is_main_process=should_save``, which is what this node's first process needs."""
    model = trainer.accelerator.unwrap_model(trainer.model)
    override = trainer.args.save_on_each_node and hasattr(model, "should_save_on_this_rank")
    if override:
        model.should_save_on_this_rank = lambda is_main_process: is_main_process
    try:
        yield
    finally:
        if override:
            del model.should_save_on_this_rank


def _atomic_write_json(obj: Any, path: str) -> None:
    tmp = f"{path}.tmp"
    with open(tmp, "w", encoding="utf-8") as f:
        json.dump(obj, f)
    os.replace(tmp, path)


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
