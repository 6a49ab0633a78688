"""hf_acco: ACCO (Accumulate While You Communicate) for the Hugging Face training stack."""

from .claims import ClaimingBatchSampler
from .comm import Communicator, check_world_size
from .core import (
    ACCOOptimizer,
    Accumulation,
    Phase,
    RoundKind,
    Schedule,
    consolidate_state_dicts,
)
from .pacing import Pacer
from .sharding import FlatLayout


def __getattr__(name: str):  # noqa: ANN202
    """The Hugging Face glue (ACCOConfig, ACCOTrainer) is imported on first use: the engine needs only torch."""
    if name in ("ACCOConfig", "ACCOConfigMixin"):
        from . import config

        return getattr(config, name)
    if name in ("ACCOTrainer", "ACCOTrainerMixin"):
        from . import trainer

        return getattr(trainer, name)
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
    "check_world_size",
    "consolidate_state_dicts",
]
