import sys

from hotfit.pipeline.cli import main

sys.exit(main())
