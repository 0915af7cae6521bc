"""Errors the engine raises for problems a user can fix.

Every message names the thing at fault and the fix. The CLI prints ``str(err)`` as one line
and exits non-zero, without a traceback, for any :class:`OffloadError`.
"""

from __future__ import annotations


class OffloadError(Exception):
    """Base of every user-facing engine error."""


class ConfigError(OffloadError, ValueError):
    """A configuration value is out of range or inconsistent."""


class StoragePathError(OffloadError):
    """A storage path cannot hold swap files (missing, read-only, no O_DIRECT, too small)."""


class StorageIOError(OffloadError):
    """A read or write of optimizer state failed mid-run (disk full, I/O error).

    The optimizer state involved is kept in host memory, so nothing is lost: ``state_dict()``
    still returns complete state.
    """


class CorruptSwapFileError(OffloadError):
    """A swap file's contents do not match the checksum written with them."""


class CheckpointError(OffloadError):
    """A checkpoint cannot be loaded into this run (missing or damaged files, another model, another
    rank count or subgroup layout). Raised before anything in the engine's tiers changes."""
