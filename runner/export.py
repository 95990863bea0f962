"""``python -m runner.export``: the command line of :mod:`runner.tools.export` (kept at this name)."""

import sys

from runner.tools.export import main

if __name__ == "__main__":
    sys.exit(main())
