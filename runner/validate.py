"""``python -m runner.validate``: the command line of :mod:`runner.tools.validate` (kept at this name)."""

import sys

from runner.tools.validate import main

if __name__ == "__main__":
    sys.exit(main())
