"""hf_acco: ACCO (Accumulate While You Communicate) for the Hugging Face training stack."""

from .comm import Communicator, check_world_size
from .config import ACCOConfig  # noqa: E402  (the Hugging Face glue; the modules above need only torch)
from .core import (
    ACCOOptimizer,
    Accumulation,
    Phase,
    RoundKind,
    Schedule,
    consolidate_state_dicts,
)
from .sharding import FlatLayout
from .trainer import ACCOTrainer  # noqa: E402

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
