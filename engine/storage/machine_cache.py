"""Facts measured once per machine and kept for every process after: the host lane's kernel
choice, the node's memory bandwidth, py-cpuinfo's answer.

Each kind is one JSON object in a file of its own beside the built ops, keyed by what the fact
depends on (the CPU, the threads, the library versions). :func:`kept_fact` reads and decides
under an ``flock`` of a ``.lock`` file beside it, so that ranks starting together measure once
and the others read what the first kept; it writes through a temporary file and a rename, so a
reader never sees half a file. Nowhere to keep it (a read-only environment) costs a measurement
per process, never a failure. Files are opened without following a symbolic link: the directory
is the environment's, but a link planted there must not make us read or write elsewhere.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import logging
import os
from typing import Any, Callable, TypeVar

_T = TypeVar("_T")

log = logging.getLogger(__name__)

_NOFOLLOW = getattr(os, "O_NOFOLLOW", 0)


def _read(path: str) -> dict[str, Any]:
    try:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC | _NOFOLLOW)
    except OSError:
        return {}
    try:
        with os.fdopen(fd) as f:
            known = json.load(f)
    except (OSError, ValueError):
        return {}
    return known if isinstance(known, dict) else {}


def _write(path: str, known: dict[str, Any]) -> None:
    tmp = f"{path}.{os.getpid()}.tmp"
    try:
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC | _NOFOLLOW, 0o644)
        with os.fdopen(fd, "w") as f:
            json.dump(known, f, indent=1)
        os.replace(tmp, path)
    except OSError as e:  # a read-only environment: measured each time, still correct
        log.info("cannot keep %s: %s", path, e)
        with contextlib.suppress(OSError):
            os.unlink(tmp)


def kept_fact(directory: str, filename: str, key: str, decide: Callable[[Any], _T]) -> _T:
    """``decide(kept)`` under the lock of ``directory/filename``, where ``kept`` is the value kept
    under ``key`` (None when there is none); a result that is not None and differs from it is
    kept in its place. Returns what ``decide`` returned. ``decide`` judges whether a kept value
    still holds (and measures when not): it runs while the lock is held."""
    path = os.path.join(directory, filename)
    try:
        os.makedirs(directory, exist_ok=True)
        lock = os.open(path + ".lock", os.O_RDWR | os.O_CREAT | os.O_CLOEXEC | _NOFOLLOW, 0o644)
    except OSError:
        lock = -1  # nowhere to keep it: decided in this process alone
    try:
        if lock >= 0:
            fcntl.flock(lock, fcntl.LOCK_EX)
        known = _read(path)
        old = known.get(key)
        new = decide(old)
        if new is not None and new != old and lock >= 0:
            known[key] = new
            _write(path, known)
        return new
    finally:
        if lock >= 0:
            os.close(lock)
