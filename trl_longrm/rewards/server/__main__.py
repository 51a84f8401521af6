"""`python -m trl_longrm.rewards.server ...`: the same as `trl-longrm reward-server ...`."""

import sys

from trl_longrm.rewards.server.main import main


sys.exit(main())
