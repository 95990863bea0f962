"""runner: a declarative, Hydra-driven batch runner for offline generation.

Packages: :mod:`runner.core` (what the engines build on: the config schema and precedence, dataset rows and their
sources, media inputs, sinks and atomic artifacts, resume, run dirs, platform, weights, video, distributed layouts,
errors), :mod:`runner.app` (the run: ``run.Run``'s steps, the stage graph, preflight, the console, launchers,
trackers) and :mod:`runner.tools` (what reads run dirs: report, matrix, repro, gate, export, validate, score, support
matrix; ``runner.report``, ``runner.repro``... are their ``python -m`` entry points). The engines are in the
top-level :mod:`models` package, the backends in :mod:`runner.kernels`. Entry point: ``python -m runner``
(``runner.__main__``).
"""

__version__ = "0.1.0"
