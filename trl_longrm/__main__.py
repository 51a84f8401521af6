"""`python -m trl_longrm recipe.yaml` (what `accelerate launch -m trl_longrm recipe.yaml` runs)."""

import sys

from trl_longrm.cli import main


sys.exit(main())
