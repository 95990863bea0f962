"""``python -m runner.matrix``: the command line of :mod:`runner.tools.matrix` (kept at this name)."""

import sys

from runner.tools.matrix import main

if __name__ == "__main__":
    sys.exit(main())
