"""``python -m runner.support_matrix``: the command line of :mod:`runner.tools.support_matrix`."""

import sys

from runner.app.console import quiet_tool

if __name__ == "__main__":
    quiet_tool(sys.argv[1:])  # python -m runner's console: no library noise (before torch is imported)

from runner.tools.support_matrix import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main())
