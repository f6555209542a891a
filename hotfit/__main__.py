"""``python -m hotfit``: the command line, as the ``hotfit`` console script runs it."""

import sys

from hotfit.pipeline.cli import main

sys.exit(main())
