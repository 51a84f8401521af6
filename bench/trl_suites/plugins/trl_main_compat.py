"""pytest plugin (`-p trl_main_compat`), loaded in both modes: bridges TRL main's test files and the installed trl.

The test files come from TRL main, the installed trl is an older release (1.16.0). A few names the test modules
import at module level are missing there, and without them a whole module fails to import:

- `trl.import_utils.is_joblib_available`: added with the same one-line definition as TRL main.
- `trl.trainer.sft_trainer._chunked_cross_entropy_loss`, `_patch_chunked_ce_lm_head`, `dft_loss`: placeholders that
  raise, so only the tests that call them fail, in both modes alike (and are then left out of the comparison, which
  only counts tests that pass with stock).

It also provides the `lazy_shared_datadir` fixture of pytest-datadir (not installed), which some tests use.
"""

import importlib.util
import shutil
from pathlib import Path

import pytest

# Aliased imports: trl's lazy top-level module does not expose these submodules as attributes.
import trl.import_utils as import_utils
import trl.trainer.sft_trainer as sft_trainer


if not hasattr(import_utils, "is_joblib_available"):
    import_utils.is_joblib_available = lambda: importlib.util.find_spec("joblib") is not None


def _missing(name):
    def placeholder(*args, **kwargs):
        raise NotImplementedError(f"{name} does not exist in the installed trl (the test was written for TRL main)")

    placeholder.__name__ = name
    return placeholder


for _name in ("_chunked_cross_entropy_loss", "_patch_chunked_ce_lm_head", "dft_loss"):
    if not hasattr(sft_trainer, _name):
        setattr(sft_trainer, _name, _missing(_name))


@pytest.fixture
def lazy_shared_datadir(request, tmp_path):
    """Minimal pytest-datadir `lazy_shared_datadir`: a temporary copy of the `data/` folder next to the test module."""
    source = Path(request.path).parent / "data"
    target = tmp_path / "data"
    if source.is_dir():
        shutil.copytree(source, target)
    else:
        target.mkdir()
    return target
