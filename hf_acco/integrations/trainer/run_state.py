"""What the Trainer parts share, in one place: the run's ACCO state (``RunState``, ``trainer.acco_run``) and the
Trainer they work on, as the attributes they use (``TrainerParts``). The parts import this module, never the mixin:
the mixin imports them, and nothing imports back (tests/test_layers.py checks the package has no import circle)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

import torch

if TYPE_CHECKING:
    from hf_acco.comm.module_buffers import BufferSync
    from hf_acco.engine.core import ACCOOptimizer
    from hf_acco.pacing.pacer import Pacer


@dataclass
class RunState:
    """The ACCO side of one trainer: its engine and pacer, and the figures logged since the last log."""

    engine: ACCOOptimizer | None = None  # built by create_optimizer at train() (``trainer.acco``)
    pacer: Pacer | None = None  # paced accumulation: the claimed micro-batches of each step
    buffer_sync: BufferSync | None = None  # DDP's buffer broadcast, by forward hooks (``engine.sync_buffers``)
    group_params: list[list[torch.nn.Parameter]] | None = None  # the groups as built (FSDP's prepare moves them)
    logged_totals: dict[str, float] = field(default_factory=dict)  # the engine's totals at the last log
    input_tokens: float = 0.0  # input tokens this rank computed
    logged_tokens: float = 0.0  # ... and when last logged
    step_losses: list[torch.Tensor] = field(default_factory=list)  # paced: (loss x weight, weight) a step


class TrainerParts(Protocol):
    """The ``transformers.Trainer`` the parts work on (an ``ACCOTrainerMixin``): what they read and set of it."""

    acco_run: RunState
    args: Any
    accelerator: Any
    state: Any
    control: Any
    model: Any
    optimizer: Any
    lr_scheduler: Any
    train_dataset: Any
    data_collator: Any
    processing_class: Any
    callback_handler: Any
    compute_loss_func: Any
    model_accepts_loss_kwargs: Any
    optimizer_cls_and_kwargs: Any
    _train_batch_size: Any
    is_fsdp_enabled: Any
    loss_is_scaled_for_ga: Any
    current_gradient_accumulation_steps: Any

    def _save_checkpoint(self, model: Any, trial: Any) -> Any: ...
    def _get_output_dir(self, trial: Any) -> Any: ...
    def _get_collator_with_removed_columns(self, data_collator: Any, description: Any = None) -> Any: ...
    def _remove_unused_columns(self, dataset: Any, description: Any = None) -> Any: ...
    def get_decay_parameter_names(self, model: Any) -> Any: ...
    @staticmethod
    def get_optimizer_cls_and_kwargs(args: Any, model: Any = None) -> Any: ...
    def get_tp_size(self) -> Any: ...
    def count_label_tokens(self, inputs: Any) -> Any: ...
