"""``python -m runner.repro``: the command line of :mod:`runner.tools.repro` (kept at this name)."""

import sys

from runner.tools.repro import main

if __name__ == "__main__":
    sys.exit(main())
