"""The names the swapped test copies import instead of transformers' Trainer / TrainingArguments.

ACCO_SWAP_SCHEDULE (env var, read at import): "acco" (default) -> TrainingArguments = hf_acco.ACCOConfig;
"sync" -> TrainingArguments = SyncConfig, an ACCOConfig subclass whose only change is the dataclass default of
acco_schedule ("sync"). Trainer = hf_acco.ACCOTrainer in both cases.
"""

import dataclasses
import os

from hf_acco import ACCOConfig, ACCOTrainer

SCHEDULE = os.environ.get("ACCO_SWAP_SCHEDULE", "acco")


@dataclasses.dataclass
class SyncConfig(ACCOConfig):
    acco_schedule: str = dataclasses.field(
        default="sync",
        metadata={"help": "acco | dpu | sync (default here: sync)", "choices": ["acco", "dpu", "sync"]},
    )


if SCHEDULE == "acco":
    TrainingArguments = ACCOConfig
elif SCHEDULE == "sync":
    TrainingArguments = SyncConfig
else:
    raise ValueError(f"ACCO_SWAP_SCHEDULE must be 'acco' or 'sync', got {SCHEDULE!r}")

Trainer = ACCOTrainer
