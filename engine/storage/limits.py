"""Limits on storage traffic: in-flight requests per path, a bandwidth cap, and a node lock.

All three are shared by the I/O threads of one path; the node lock is also shared with the
other processes on this node that use the same storage device.
"""

from __future__ import annotations

import contextlib
import fcntl
import heapq
import itertools
import math
import os
import re
import tempfile
import threading
import time
from typing import Iterator

from engine.storage.blockdev import device_of


class ResizableSemaphore:
    """A counting semaphore whose limit can change while requests are in flight, and which
    grants its slots in order of a key (the lowest first; equal keys in arrival order).

    The engine keys each chunk with its transfer's number, so the chunks of an earlier transfer
    go before those of later ones, its last chunk (a write's header) included: transfers land
    one after the other, as they were started, instead of all together once a burst has gone
    through. Lowering the limit never interrupts a request: new ones wait until the count drops.
    """

    def __init__(self, limit: int) -> None:
        self._lock = threading.Lock()
        self._limit = limit
        self._held = 0
        self._waiters: list[tuple[float, int, threading.Event]] = []  # a heap
        self._arrivals = itertools.count()

    def set_limit(self, limit: int) -> None:
        with self._lock:
            self._limit = limit
            self._grant()

    def _grant(self) -> None:
        while self._waiters and self._held < self._limit:
            self._held += 1
            heapq.heappop(self._waiters)[2].set()

    def acquire(self, key: float = math.inf) -> None:
        with self._lock:
            if self._held < self._limit and not self._waiters:
                self._held += 1
                return
            granted = threading.Event()
            heapq.heappush(self._waiters, (key, next(self._arrivals), granted))
        granted.wait()

    def release(self) -> None:
        with self._lock:
            self._held -= 1
            self._grant()

    @contextlib.contextmanager
    def slot(self, key: float = math.inf) -> Iterator[None]:
        self.acquire(key)
        try:
            yield
        finally:
            self.release()


class RateLimiter:
    """Paces requests so that bytes per second stay under a cap (None: no cap).

    Each request reserves the next slot of ``nbytes / cap`` seconds and sleeps until its slot
    starts; requests may run concurrently, the long-run rate is the cap.
    """

    def __init__(self, cap_bytes_per_s: float | None) -> None:
        self.cap_bytes_per_s = cap_bytes_per_s
        self._lock = threading.Lock()
        self._next_s = 0.0

    def acquire(self, nbytes: int) -> None:
        if not self.cap_bytes_per_s:
            return
        with self._lock:
            now = time.monotonic()
            start = max(now, self._next_s)
            self._next_s = start + nbytes / self.cap_bytes_per_s
        if start > now:
            time.sleep(start - now)


def lock_dir() -> str:
    """Node-local directory for lock files: $OFFLOADCTL_LOCK_DIR, else /dev/shm, else the temp dir."""
    d = os.environ.get("OFFLOADCTL_LOCK_DIR") or ("/dev/shm" if os.path.isdir("/dev/shm") else tempfile.gettempdir())
    d = os.path.join(d, f"offloadctl-locks-{os.getuid()}")
    os.makedirs(d, mode=0o700, exist_ok=True)
    return d


class NodeLock:
    """One process at a time on a storage device of this node, while the lock is enabled.

    Keyed by the whole disk behind the path (:func:`engine.storage.blockdev.device_of`, as profiles and
    the performance model group paths), so directories or partitions of one disk share a lock. The
    threads of the holding process share it: the first takes the ``flock``, the last releases it,
    so a process keeps its own requests in flight while other processes wait.
    """

    def __init__(self, path: str, *, enabled: bool = False) -> None:
        key = re.sub(r"[^A-Za-z0-9_.-]", "_", device_of(path).name)  # "tmpfs:tmpfs", "nfs:host:/x" as a file name
        self.lock_path = os.path.join(lock_dir(), f"dev-{key}.lock")
        self.enabled = enabled
        self._cond = threading.Condition()
        self._users = 0
        self._acquiring = False
        self._fd: int | None = None

    def __enter__(self) -> None:
        if not self.enabled:
            return
        with self._cond:
            while self._acquiring:
                self._cond.wait()
            if self._users > 0:
                self._users += 1
                return
            self._acquiring = True
        try:
            fd = os.open(self.lock_path, os.O_RDWR | os.O_CREAT, 0o600)
            fcntl.flock(fd, fcntl.LOCK_EX)
        except BaseException:
            with self._cond:
                self._acquiring = False
                self._cond.notify_all()
            raise
        with self._cond:
            self._fd, self._users, self._acquiring = fd, 1, False
            self._cond.notify_all()

    def __exit__(self, *exc: object) -> None:
        if self._fd is None and self._users == 0:
            return
        with self._cond:
            self._users -= 1
            if self._users == 0 and self._fd is not None:
                fd, self._fd = self._fd, None
                fcntl.flock(fd, fcntl.LOCK_UN)
                os.close(fd)
