"""Reward functions for RL trainers, one module per job: `disrm` (a trained DisRM in TRL's GRPO/RLOO, `LongRMReward`),
`judge` (a generative judge in TRL's GRPO/RLOO, `JudgeReward`), and the same judge from `verl` (`compute_score`) and
`openrlhf` (`reward_func`)."""

from trl_longrm.rewards.disrm import LongRMReward
from trl_longrm.rewards.judge import JudgeReward


__all__ = ["JudgeReward", "LongRMReward"]
