"""``python -m runner.report``: the command line of :mod:`runner.tools.report` (kept at this name)."""

import sys

from runner.tools.report import main

if __name__ == "__main__":
    sys.exit(main())
