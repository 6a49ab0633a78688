"""ACCOTrainer: transformers.Trainer with the ACCO sharded optimizer instead of DDP. Glue only, in parts:

* ``mixin.py``: ``ACCOTrainerMixin`` / ``ACCOTrainer``, every Trainer override, each delegating to a part (its
  docstring lists the interceptions and why);
* ``engine.py``: the construction-time checks; building the engine (Trainer's groups and ``optim``, an optimizer
  taken over) and reusing it across ``train()``;
* ``weights.py``: each micro-batch's weight and gradient scale (undoing Trainer's loss normalisation), label
  tokens, the split of a window of one micro-batch;
* ``data.py``: paced accumulation, claimed micro-batches through Trainer's data pipeline, slots, the position
  in the epoch;
* ``checkpoints.py``: completeness per rank, the checkpoint all ranks resume from, shards and scheduler, the
  JIT agreement, per-node model files;
* ``metrics.py``: ACCO's logged figures.
"""

from hf_acco.integrations.baselines import check_ddp_wrapped
from hf_acco.integrations.trainer.checkpoints import (
    DATA_STATE_NAME,
    JIT_SENTINEL,
    SCHEDULER_NAME,
    TRAINER_STATE_NAME,
    checkpoint_incomplete,
    complete_checkpoints,
    last_complete_checkpoint,
)
from hf_acco.integrations.trainer.metrics import RUN_DEPENDENT_METRICS
from hf_acco.integrations.trainer.mixin import ACCOTrainer, ACCOTrainerMixin

__all__ = [
    "ACCOTrainer",
    "ACCOTrainerMixin",
    "DATA_STATE_NAME",
    "JIT_SENTINEL",
    "RUN_DEPENDENT_METRICS",
    "SCHEDULER_NAME",
    "TRAINER_STATE_NAME",
    "check_ddp_wrapped",
    "checkpoint_incomplete",
    "complete_checkpoints",
    "last_complete_checkpoint",
]
