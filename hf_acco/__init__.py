"""hf_acco: ACCO (Accumulate While You Communicate) for the Hugging Face training stack.

The public API: ``ACCOTrainer`` / ``ACCOConfig`` (a drop-in for ``transformers.Trainer``), ``prepare_acco`` /
``acco_dataloader`` (a hand-written Accelerate loop), ``ACCOOptimizer`` (the engine, torch only), ``hf_acco.trl``
(TRL's trainers), and the commands ``python -m hf_acco.plan``, ``python -m hf_acco.memory``,
``python -m hf_acco.bench``, ``python -m hf_acco.checkpoint``. Where each part lives: ``docs/architecture.md``.
"""

import importlib

from hf_acco.comm.communicator import Communicator
from hf_acco.comm.groups import check_world_size
from hf_acco.comm.sharding import FlatLayout
from hf_acco.engine.core import (
    ACCOOptimizer,
    Accumulation,
    Phase,
    RoundKind,
    Schedule,
    consolidate_state_dicts,
)
from hf_acco.pacing.claims import ClaimingBatchSampler
from hf_acco.pacing.pacer import Pacer

# The Hugging Face glue is imported on first use: the engine needs only torch, a hand-written Accelerate loop
# loads no transformers. Name -> the module of hf_acco/integrations/ that defines it.
_GLUE = {
    "ACCOConfig": "config",
    "ACCOConfigMixin": "config",
    "ACCOTrainer": "trainer",
    "ACCOTrainerMixin": "trainer",
    "prepare_acco": "accelerate",
    "acco_dataloader": "accelerate",
    "end_training": "teardown",
}


def __getattr__(name: str):  # noqa: ANN202
    if name in _GLUE:
        module = importlib.import_module(f"hf_acco.integrations.{_GLUE[name]}")
        return getattr(module, name)
    raise AttributeError(f"module 'hf_acco' has no attribute {name!r}")


__version__ = "0.1.0"

__all__ = [
    "ACCOConfig",
    "ACCOConfigMixin",
    "ACCOOptimizer",
    "ACCOTrainer",
    "ACCOTrainerMixin",
    "Accumulation",
    "ClaimingBatchSampler",
    "Communicator",
    "FlatLayout",
    "Pacer",
    "Phase",
    "RoundKind",
    "Schedule",
    "acco_dataloader",
    "check_world_size",
    "consolidate_state_dicts",
    "end_training",
    "prepare_acco",
]
