"""``python -m runner.score``: the command line of :mod:`runner.tools.score`."""

import sys

from runner.app.console import quiet_tool

if __name__ == "__main__":
    # python -m runner's console: no library noise, no loading bar of the metric's model (before torch is imported)
    quiet_tool(sys.argv[1:], loading_bars=True)

from runner.tools.score import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main())
