"""``python -m runner.gate``: the command line of :mod:`runner.tools.gate` (kept at this name)."""

import sys

from runner.tools.gate import main

if __name__ == "__main__":
    sys.exit(main())
