"""Paced accumulation under Trainer (``acco_accumulation="paced"``): Trainer's data pipeline over micro-batches
the ranks claim from one shared, seeded order (claims.py; an IterableDataset: each rank's own shard, its batches
numbered from one shared counter), the slots Trainer's loop iterates instead of batches, and the position in the
epoch a checkpoint resumes from.

A Trainer step is one ACCO optimizer step over one global batch of ``world_size x gradient_accumulation_steps``
micro-batches; each rank computes as many of them as its speed allows (the next one it claims), so a rank twice as
fast computes about twice as many, and every sample is used once per epoch. The steps per epoch, ``max_steps``, the
learning-rate schedule and the logging, evaluation and checkpoint cadence are Trainer's (as under DDP with the same
settings); every rank is at the same step at every boundary, so they add no meeting point."""

from __future__ import annotations

import functools
import itertools
import json
import logging
import math
import os
from typing import TYPE_CHECKING, Any

import datasets
import torch
import torch.distributed as dist
from datasets.distributed import split_dataset_by_node
from transformers.trainer_pt_utils import IterableDatasetShard, LengthGroupedSampler, get_length_grouped_indices
from transformers.trainer_utils import has_length, seed_worker

from hf_acco.comm.groups import claims_store
from hf_acco.integrations.trainer.checkpoints import DATA_STATE_NAME
from hf_acco.pacing.claims import ClaimingBatchSampler, StreamTickets
from hf_acco.pacing.pacer import Pacer

if TYPE_CHECKING:  # the parts' trainer is always an ACCOTrainerMixin, seen through the attributes they use
    from hf_acco.integrations.trainer.run_state import TrainerParts

logger = logging.getLogger(__name__)


def pacer_of(trainer: TrainerParts) -> Pacer:
    """The trainer's pacer, which paced accumulation's ``get_train_dataloader`` builds."""
    if trainer.acco_run.pacer is None:
        raise RuntimeError(
            "ACCOTrainer builds its pacer with the train dataloader (paced accumulation): there is none yet."
        )
    return trainer.acco_run.pacer


def build_pacer(trainer: TrainerParts) -> Pacer:
    """Trainer's data pipeline (unused columns, collator, workers, seed, sampling strategy) over batches claimed
    from one shared, seeded order of the dataset: every sample once per epoch, whatever the ranks' speeds."""
    args, dataset = trainer.args, trainer.train_dataset
    if dataset is None:
        raise ValueError("Trainer: training requires a train_dataset.")
    store = claims_store()
    if isinstance(dataset, torch.utils.data.IterableDataset) or not has_length(dataset):
        return build_stream_pacer(trainer, dataset, store)
    collator = trainer.data_collator
    if isinstance(dataset, datasets.Dataset):
        dataset = trainer._remove_unused_columns(dataset, description="Training")
    else:
        collator = trainer._get_collator_with_removed_columns(collator, description="Training")
    strategy = getattr(args, "train_sampling_strategy", "random")
    if strategy not in ("random", "sequential", "group_by_length"):
        raise ValueError(
            f"train_sampling_strategy={strategy!r} is not supported with acco_accumulation='paced' (it plans "
            "each rank's batches ahead; here ranks claim batches as they go). Use 'random', 'sequential' or "
            "'group_by_length'."
        )
    seed = args.data_seed if args.data_seed is not None else args.seed
    if args.dataloader_num_workers > 0:
        logger.warning(
            "acco_accumulation='paced' with dataloader_num_workers=%d: the workers claim about prefetch_factor "
            "x num_workers batches ahead, so a slow rank holds more claims than it would compute in time. Use 0 "
            "or 1 worker and a small dataloader_prefetch_factor when a rank is much slower.",
            args.dataloader_num_workers,
        )
    batch_size = trainer._train_batch_size
    order = length_grouped_order(trainer, dataset, seed) if strategy == "group_by_length" else None
    sampler = ClaimingBatchSampler(
        store, len(dataset), batch_size, seed=seed, drop_last=args.dataloader_drop_last,
        shuffle=strategy != "sequential", num_replicas=args.world_size, order=order,
    )  # fmt: skip
    workers = args.dataloader_num_workers
    loader = torch.utils.data.DataLoader(
        dataset,  # type: ignore[arg-type]  # (a map-style dataset: Trainer's train_dataset)
        batch_sampler=sampler, collate_fn=collator, num_workers=workers,
        pin_memory=args.dataloader_pin_memory, persistent_workers=args.dataloader_persistent_workers,
        multiprocessing_context=args.dataloader_multiprocessing_context,
        prefetch_factor=args.dataloader_prefetch_factor, in_order=args.dataloader_in_order,
        worker_init_fn=functools.partial(seed_worker, num_workers=workers, rank=args.process_index),
    )  # fmt: skip
    return Pacer(loader, sampler, args.world_size * args.gradient_accumulation_steps)


def build_stream_pacer(trainer: TrainerParts, dataset: Any, store: dist.Store) -> Pacer:
    """An IterableDataset: every rank reads its own shard (datasets' split_dataset_by_node, else Trainer's
    IterableDatasetShard) at its own pace, starting it again when it ends; the batches are numbered from one
    shared counter, so the steps are global batches as for a map-style dataset. Needs ``max_steps``."""
    args, batch_size = trainer.args, trainer._train_batch_size
    if isinstance(dataset, datasets.IterableDataset):
        shard = split_dataset_by_node(dataset, rank=args.process_index, world_size=args.world_size)
    else:
        shard = IterableDatasetShard(
            dataset, batch_size=batch_size, drop_last=args.dataloader_drop_last,
            num_processes=args.world_size, process_index=args.process_index, seed=args.seed,
        )  # fmt: skip
    loader = torch.utils.data.DataLoader(
        shard, batch_size=batch_size, drop_last=args.dataloader_drop_last,
        collate_fn=trainer._get_collator_with_removed_columns(trainer.data_collator, description="Training"),
        num_workers=args.dataloader_num_workers, pin_memory=args.dataloader_pin_memory,
    )  # fmt: skip
    tickets = StreamTickets(store, batch_size)
    return Pacer(loader, tickets, args.world_size * args.gradient_accumulation_steps)


def length_grouped_order(trainer: TrainerParts, dataset: Any, seed: int) -> Any:
    """group_by_length: Trainer's grouping of similar lengths, seeded per epoch the same way on every rank."""
    column, batch_size = trainer.args.length_column_name, trainer._train_batch_size
    lengths = dataset[column] if isinstance(dataset, datasets.Dataset) and column in dataset.column_names else None
    processor = trainer.processing_class  # (as Trainer reads it)
    name = processor.model_input_names[0] if processor is not None else None  # type: ignore[union-attr]
    grouped = LengthGroupedSampler(batch_size, dataset=dataset, lengths=lengths, model_input_name=name)

    def order(epoch: int) -> list[int]:
        generator = torch.Generator().manual_seed(seed + epoch)
        return get_length_grouped_indices(grouped.lengths, batch_size, generator=generator)

    return order


def restore_position(trainer: TrainerParts, checkpoint: str) -> None:
    """The epoch and the position in it from a checkpoint's data state (Trainer would derive them from
    global_step and skip batches by fetching them, which here would claim them); with epochs, the steps the data
    has left at this world size."""
    pacer, args = pacer_of(trainer), trainer.args
    path = os.path.join(checkpoint, DATA_STATE_NAME)
    if not os.path.isfile(path):
        raise ValueError(
            f"{checkpoint} has no {DATA_STATE_NAME}: it was written with acco_accumulation='fixed' (or by plain "
            "Trainer). Resume it with acco_accumulation='fixed'."
        )
    with open(path, encoding="utf-8") as f:
        pacer.load_state_dict(json.load(f))
    if args.max_steps <= 0:  # epochs: Trainer's count unless the checkpoint had other ranks, a fractional last
        # epoch included
        per_epoch = -(-len(pacer.sampler) // args.gradient_accumulation_steps)  # type: ignore[arg-type]
        done = per_epoch - pacer.steps_left()  # of the resumed epoch, in this world size's steps
        epochs_left = args.num_train_epochs - pacer.resume_epoch
        trainer.state.max_steps = trainer.state.global_step + max(math.ceil(epochs_left * per_epoch) - done, 0)


def slots(pacer: Pacer) -> Any:
    """What Trainer's loop iterates with paced accumulation instead of a DataLoader."""
    return EndlessSlots(pacer) if pacer.sampler.endless else PacedSlots(pacer)


def window_slots(epoch_iterator: Any, num_batches: int) -> list[Slot]:
    """Trainer's window with paced accumulation: its slots; the last one runs a whole ACCO step (training_step), so
    that one Trainer step is one optimizer step with Trainer's own step, logging and checkpoint cadence."""
    count = sum(1 for _ in itertools.islice(epoch_iterator, num_batches))
    return [Slot(last=i == count - 1) for i in range(count)]


class Slot:
    """One of the slots of a Trainer window with paced accumulation; the window's last one runs the ACCO step."""

    __slots__ = ("last",)

    def __init__(self, last: bool) -> None:
        self.last = last


class PacedSlots:
    """What Trainer's loop iterates with paced accumulation: per epoch, a rank's share of the micro-batches on
    average, so that Trainer's steps per epoch, ``max_steps`` and learning-rate schedule come out as under DDP (one
    step per ``gradient_accumulation_steps`` slots). The micro-batches themselves come from the pacer."""

    def __init__(self, pacer: Pacer) -> None:
        self.pacer = pacer
        self.dataset = pacer.loader.dataset  # type: ignore[attr-defined]  # (Trainer's num_examples; a DataLoader)

    def __len__(self) -> int:
        return len(self.pacer.sampler)  # type: ignore[arg-type]  # (a claiming sampler: an epoch's batches)

    def __iter__(self) -> Any:
        return iter(range(len(self)))

    def set_epoch(self, epoch: int) -> None:  # Trainer calls it at every epoch's start
        self.pacer.set_epoch(epoch)


class EndlessSlots:
    """Dynamic mode over per-rank streams: slots without a length (Trainer counts steps to ``max_steps``)."""

    def __init__(self, pacer: Pacer) -> None:
        self.pacer = pacer

    def __iter__(self) -> Any:
        return itertools.count()

    def set_epoch(self, epoch: int) -> None:
        self.pacer.set_epoch(epoch)
