"""TRL's SFT and DPO trainers with ACCO (``pip install hf_acco[trl]``): ``ACCOSFTTrainer`` + ``ACCOSFTConfig``,
``ACCODPOTrainer`` + ``ACCODPOConfig``. They live in ``hf_acco/integrations/trl.py``."""

from hf_acco.integrations.trl import ACCODPOConfig, ACCODPOTrainer, ACCOSFTConfig, ACCOSFTTrainer

__all__ = ["ACCODPOConfig", "ACCODPOTrainer", "ACCOSFTConfig", "ACCOSFTTrainer"]
