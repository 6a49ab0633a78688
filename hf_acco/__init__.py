"""hf_acco: ACCO (Accumulate While You Communicate) for the Hugging Face training stack."""

from .comm import Communicator, check_world_size
from .core import (
    ACCOOptimizer,
    Accumulation,
    Phase,
    RoundKind,
    Schedule,
    consolidate_state_dicts,
)
from .sharding import FlatLayout


def __getattr__(name: str):  # noqa: ANN202
    """The Hugging Face glue (ACCOConfig, ACCOTrainer) is imported on first use: the engine needs only torch."""
    if name == "ACCOConfig":
        from .config import ACCOConfig

        return ACCOConfig
    if name == "ACCOTrainer":
        from .trainer import ACCOTrainer

        return ACCOTrainer
    raise AttributeError(f"module 'hf_acco' has no attribute {name!r}")


__version__ = "0.1.0"

__all__ = [
    "ACCOConfig",
    "ACCOOptimizer",
    "ACCOTrainer",
    "Accumulation",
    "Communicator",
    "FlatLayout",
    "Phase",
    "RoundKind",
    "Schedule",
    "check_world_size",
    "consolidate_state_dicts",
]
