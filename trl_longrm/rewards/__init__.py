"""Reward functions for RL trainers, one module per job: `disrm` (a trained DisRM in TRL's GRPO/RLOO, `LongRMReward`),
`judge` (a generative judge in TRL's GRPO/RLOO, `JudgeReward`), `distributed` (its groups made whole across
processes), `server` (`trl-longrm reward-server`: whole groups for frameworks asking one sample at a time), and
the same judge from `verl` (`JudgeRewardManager`, `compute_score`) and `openrlhf` (`reward_func`)."""

from trl_longrm.rewards.disrm import LongRMReward
from trl_longrm.rewards.judge import JudgeReward


__all__ = ["JudgeReward", "LongRMReward"]
