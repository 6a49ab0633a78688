"""What a fair DDP baseline needs beside ACCO (the recipes' ``--method ddp`` and the benchmarks): torch's bf16
compression hook where DDP refuses it (``comm/ddp_hooks.py``), its config, and a check that the baseline did train
under DDP (torch only)."""

from __future__ import annotations

import dataclasses
from typing import Any

import torch

from hf_acco.comm.ddp_hooks import bf16_wire_hook

__all__ = ["baseline_arguments", "bf16_wire_hook", "check_ddp_wrapped"]


def baseline_arguments(args: Any, config_cls: type) -> Any:
    """The DDP baseline's config: every field of ``args`` but the ``acco_*`` ones, as a ``config_cls``
    (TrainingArguments, or TRL's config). Copied field by field: ``to_dict()`` masks every ``*_token`` field,
    ``eos_token`` included."""
    fields = dataclasses.fields(args)
    return config_cls(**{f.name: getattr(args, f.name) for f in fields if f.init and not f.name.startswith("acco_")})


def check_ddp_wrapped(trainer: Any) -> None:
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
