"""`python -m weft ...`: the `weft` command (weft.cli)."""

import sys

from weft.cli import main

sys.exit(main())
