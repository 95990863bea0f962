"""``python -m runner.support_matrix``: the command line of :mod:`runner.tools.support_matrix`."""

import sys

from runner.tools.support_matrix import main

if __name__ == "__main__":
    sys.exit(main())
