"""``python -m tfprofd.daemon.analysis PATH [--json]``: the analysis worker the agent runs."""

import sys

from .cli import main

sys.exit(main())
