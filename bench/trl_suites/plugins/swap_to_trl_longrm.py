"""pytest plugin (`-p swap_to_trl_longrm`), loaded in "ours" mode only: TRL's trainer classes become trl_longrm's.

Plugins given with `-p` load before the test modules are imported, and the tests import the trainers at module level
(`from trl import SFTTrainer, ...`, `from trl.experimental.cpo import CPOTrainer, ...`), so replacing the attributes
here is enough for the tests to build ours. `trl_longrm.trainers` is imported first, so that our subclasses are
defined on the stock classes rather than on themselves.
"""

import trl

# Aliased: trl's lazy top-level module does not reliably expose submodules as attributes.
import trl.experimental.cpo as cpo

import trl_longrm
import trl_longrm.trainers  # noqa: F401  (defines our subclasses against the stock classes, before the swap)


trl.SFTTrainer = trl_longrm.LongSFTTrainer
trl.SFTConfig = trl_longrm.LongSFTConfig
trl.RewardTrainer = trl_longrm.SimPODisRMTrainer
trl.RewardConfig = trl_longrm.SimPODisRMConfig
cpo.CPOTrainer = trl_longrm.SimPOGRMTrainer
cpo.CPOConfig = trl_longrm.SimPOGRMConfig


def pytest_report_header(config):
    return (
        f"swap_to_trl_longrm: SFTTrainer -> {trl.SFTTrainer.__name__}, RewardTrainer -> {trl.RewardTrainer.__name__}, "
        f"CPOTrainer -> {cpo.CPOTrainer.__name__}"
    )
