"""ACCO in a hand-written Accelerate loop: ``prepare_acco`` and a few unchanged lines.

    model, optimizer = prepare_acco(accelerator, model, lr=3e-4, weight_decay=0.1)
    scheduler = accelerator.prepare(get_scheduler(...optimizer...))
    for batch in loader:
        with accelerator.accumulate(model):
            accelerator.backward(model(**batch).loss)
            optimizer.step()            # every micro-batch, as usual: ACCO counts it; steps at the window's end
            scheduler.step()
            optimizer.zero_grad()
    accelerator.save_state(dir)         # committed model weights + one optimizer shard file per rank
    accelerator.load_state(dir)

Why ``optimizer.step()``: Accelerate has no hook at the end of a backward, but the usual loop calls
``optimizer.step()`` after every backward and Accelerate forwards it only at the end of an accumulation window;
the wrapper counts each call as one micro-batch and forwards the window's end to the ACCO optimizer.
"""

from __future__ import annotations

from typing import Any

import torch
from accelerate import Accelerator
from accelerate.optimizer import AcceleratedOptimizer

from .checkpoint import load_optimizer_state, save_optimizer_state
from .comm import check_world_size
from .core import ACCOOptimizer
from .trainer import _ensure_process_group


class ACCOAcceleratedOptimizer(AcceleratedOptimizer):
    """Accelerate's optimizer wrapper around an ACCOOptimizer: counts micro-batches, saves per-rank shards."""

    def __init__(self, optimizer: ACCOOptimizer, accelerator: Accelerator) -> None:
        super().__init__(optimizer, device_placement=False, scaler=accelerator.scaler)
        self.checkpoint_dir: str | None = None
        # accelerator.backward divides the loss by gradient_accumulation_steps: weigh micro-batches the same way
        self.micro_batch_weight = 1.0 / accelerator.gradient_accumulation_steps

    def step(self, closure: Any = None) -> None:
        self.optimizer.after_backward(self.micro_batch_weight)
        if self.gradient_state.sync_gradients:
            self.optimizer.step()

    def state_dict(self) -> dict[str, Any]:
        # accelerator.save_state writes this on rank 0 only; the real state is in the per-rank shard files
        return {"hf_acco": "optimizer state in acco_optimizer_rank*_of_*.pt"}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        if self.checkpoint_dir is None:
            raise RuntimeError("Load ACCO optimizer state with accelerator.load_state(dir) (after prepare_acco).")
        load_optimizer_state(self.optimizer, self.checkpoint_dir)  # after Accelerate loaded the model weights
        self.checkpoint_dir = None


def prepare_acco(
    accelerator: Accelerator,
    model: torch.nn.Module,
    *,
    weight_decay: float = 0.0,
    **acco_kwargs: Any,
) -> tuple[torch.nn.Module, ACCOAcceleratedOptimizer]:
    """Prepare ``model`` (no DDP) and build its ACCO optimizer for a hand-written Accelerate loop.

    Weight decay applies to matrices and embeddings, not to biases and norm weights (one-dimensional
    parameters). ``acco_kwargs`` go to [`ACCOOptimizer`] (``lr``, ``schedule``, ``max_grad_norm``, ...);
    ``micro_batches`` defaults to the accelerator's ``gradient_accumulation_steps``. Collective: every rank.
    """
    check_world_size(accelerator.num_processes)
    _ensure_process_group(accelerator.device)
    model = accelerator.prepare_model(model, evaluation_mode=True)  # autocast and placement; ACCO averages
    named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    groups = [
        {"params": [p for _, p in named if p.ndim >= 2], "param_names": [n for n, p in named if p.ndim >= 2],
         "weight_decay": weight_decay},
        {"params": [p for _, p in named if p.ndim < 2], "param_names": [n for n, p in named if p.ndim < 2],
         "weight_decay": 0.0},
    ]  # fmt: skip
    acco_kwargs.setdefault("micro_batches", accelerator.gradient_accumulation_steps)
    engine = ACCOOptimizer([g for g in groups if g["params"]], **acco_kwargs)
    optimizer = ACCOAcceleratedOptimizer(engine, accelerator)
    optimizer._is_accelerate_prepared = True
    optimizer = accelerator.prepare_optimizer(optimizer)  # registers it for save_state / load_state

    def save_hook(models: list[torch.nn.Module], weights: list[dict], output_dir: str) -> None:
        # model files get the committed parameters, not the estimate the model computes with
        with engine.committed_parameters():
            for i, m in enumerate(models):
                if i < len(weights) and m is model:
                    weights[i] = {
                        k: v.detach().clone() for k, v in accelerator.get_state_dict(m, unwrap=False).items()
                    }
        save_optimizer_state(engine, output_dir)

    def load_hook(models: list[torch.nn.Module], input_dir: str) -> None:
        optimizer.checkpoint_dir = input_dir  # loaded by ACCOAcceleratedOptimizer.load_state_dict, later

    accelerator.register_save_state_pre_hook(save_hook)
    accelerator.register_load_state_pre_hook(load_hook)
    return model, optimizer
