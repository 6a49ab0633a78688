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

__version__ = "0.1.0"

__all__ = [
    "ACCOOptimizer",
    "Accumulation",
    "Communicator",
    "FlatLayout",
    "Phase",
    "RoundKind",
    "Schedule",
    "check_world_size",
    "consolidate_state_dicts",
]
