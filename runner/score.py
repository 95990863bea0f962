"""``python -m runner.score``: the command line of :mod:`runner.tools.score`."""

import sys

from runner.tools.score import main

if __name__ == "__main__":
    sys.exit(main())
