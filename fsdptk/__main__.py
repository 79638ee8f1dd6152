"""``python -m fsdptk``: the command line (see :mod:`fsdptk.cli`)."""

import sys

from fsdptk.cli import main

sys.exit(main())
