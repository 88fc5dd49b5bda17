"""`python -m mira_hf.cli`: the `mira` command."""

import sys

from . import main

sys.exit(main())
