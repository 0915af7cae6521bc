"""offloadctl: train models whose optimizer state does not fit in GPU memory.

This package is the command line only: parse, call the library (engine/, perf/, tuner/,
report/, integrations/), print. The version is the package metadata's (engine.version).
"""

from engine.version import VERSION as __version__  # noqa: F401  (re-exported for `--version` and tools)
