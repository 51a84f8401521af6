"""The three LongRM trainers, each a subclass of the TRL trainer it replaces."""

from trl_longrm.trainers.long_sft import LongSFTConfig, LongSFTTrainer
from trl_longrm.trainers.simpo_disrm import SimPODisRMConfig, SimPODisRMTrainer
from trl_longrm.trainers.simpo_grm import SimPOGRMConfig, SimPOGRMTrainer


__all__ = [
    "LongSFTConfig",
    "LongSFTTrainer",
    "SimPODisRMConfig",
    "SimPODisRMTrainer",
    "SimPOGRMConfig",
    "SimPOGRMTrainer",
]
