"""TRL's SFT and DPO trainers with ACCO: ``pip install hf_acco[trl]``.

    from hf_acco.trl import ACCOSFTConfig, ACCOSFTTrainer
    trainer = ACCOSFTTrainer(model=model, args=ACCOSFTConfig(output_dir="out"), train_dataset=data)

Each is ``ACCOTrainerMixin`` (every ACCO override) in front of TRL's trainer, and each config is
``ACCOConfigMixin`` (only the ``acco_*`` settings) in front of TRL's config, so TRL's defaults stay TRL's
(learning rate, logging, gradient checkpointing, bf16, ...).

TRL's ``compute_loss`` gathers its metrics (entropy, token accuracy, token counts, DPO's rewards) across ranks on
every micro-batch. With fixed accumulation every rank computes the same number of micro-batches, so these gathers
only add a meeting point per micro-batch; with paced accumulation ranks compute different numbers and a gather
would wait for a peer that never reaches it, so paced accumulation is refused for these trainers.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from hf_acco.integrations.config import ACCOConfigMixin, engine_accumulation
from hf_acco.integrations.trainer import ACCOTrainerMixin
from trl import DPOConfig, DPOTrainer, SFTConfig, SFTTrainer


class _GathersPerMicroBatch(ACCOTrainerMixin):
    """ACCO for a trainer whose ``compute_loss`` runs collectives on every micro-batch."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        if engine_accumulation(self.args) == "paced":
            raise ValueError(
                f"{type(self).__name__} cannot use acco_accumulation='paced': TRL's compute_loss gathers metrics "
                "across ranks on every micro-batch, and with paced accumulation ranks compute different numbers "
                "of micro-batches, so a rank would wait in a gather its peers never reach. Use "
                "acco_accumulation='fixed'."
            )


@dataclass
class ACCOSFTConfig(ACCOConfigMixin, SFTConfig):
    """[`trl.SFTConfig`] (its defaults unchanged) with the ``acco_*`` settings of [`ACCOConfigMixin`]."""


@dataclass
class ACCODPOConfig(ACCOConfigMixin, DPOConfig):
    """[`trl.DPOConfig`] (its defaults unchanged) with the ``acco_*`` settings of [`ACCOConfigMixin`]."""


class ACCOSFTTrainer(_GathersPerMicroBatch, SFTTrainer):
    """[`trl.SFTTrainer`] trained with ACCO; give it an [`ACCOSFTConfig`]."""


class ACCODPOTrainer(_GathersPerMicroBatch, DPOTrainer):
    """[`trl.DPOTrainer`] trained with ACCO; give it an [`ACCODPOConfig`]. The reference model is frozen and
    outside the optimizer, as with DDP."""
