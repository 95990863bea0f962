"""runner: a declarative, Hydra-driven batch runner for offline generation.

Modules: ``schema`` (structured configs), ``dataset`` (rows, validation, seeds, batching), ``platform``
(device detection and probes), ``execute`` (the run loop), ``artifacts`` (crash-safe writes), ``manifest``
(provenance). Entry point: ``python -m runner`` (``runner.__main__``).
"""

__version__ = "0.1.0"
