"""offloadctl's version: the one owner of that fact, kept in the lowest layer so that every
layer (the tuner daemon's ``welcome``, the CLI's ``--version``) reads the same string without
importing upward.

It comes from the installed package's metadata, so it is the version pyproject.toml built;
a source tree used without being installed has no metadata and says so ("0+unknown", a
valid PEP 440 local version that sorts below every release).
"""

from __future__ import annotations

from importlib import metadata

try:
    VERSION: str = metadata.version("offloadctl")
except metadata.PackageNotFoundError:
    VERSION = "0+unknown"
