"""trl_longrm: long-context reward models (LongRM) on top of TRL and PEFT.

The trainers are imported lazily so that `import trl_longrm` (and the CLI's `--help`) stays fast.
"""

import importlib


__version__ = "0.1.0"

_LAZY = {
    "LongRMReward": "trl_longrm.rewards",
    "JudgeReward": "trl_longrm.rewards",
    "LongSFTConfig": "trl_longrm.trainers",
    "LongSFTTrainer": "trl_longrm.trainers",
    "SimPODisRMConfig": "trl_longrm.trainers",
    "SimPODisRMTrainer": "trl_longrm.trainers",
    "SimPOGRMConfig": "trl_longrm.trainers",
    "SimPOGRMTrainer": "trl_longrm.trainers",
}

__all__ = list(_LAZY)


def __getattr__(name):
    if name in _LAZY:
        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'trl_longrm' has no attribute {name!r}")
