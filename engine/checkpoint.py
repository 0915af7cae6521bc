"""Saving state to disk so that a crash never leaves a half-written file under the final name."""

from __future__ import annotations

import contextlib
import os
import tempfile

import torch


def save_atomic(obj: object, path: str) -> None:
    """``torch.save`` to a temporary file in the same directory, fsync, then rename over ``path``."""
    path = os.path.abspath(path)
    d = os.path.dirname(path)
    fd, tmp = tempfile.mkstemp(prefix=os.path.basename(path) + ".", suffix=".tmp", dir=d)
    try:
        with os.fdopen(fd, "wb") as f:
            torch.save(obj, f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise
    dfd = os.open(d, os.O_RDONLY)
    try:
        os.fsync(dfd)  # the rename itself survives a power loss
    finally:
        os.close(dfd)
