"""The C library's heap: whether freed memory stays with the process or goes back to the system.

glibc serves a large allocation (from 128 KiB, a threshold that moves up to 32 MiB) with its own
``mmap`` and unmaps it when it is freed, and hands the heap's free top back once it exceeds a
trim threshold. A rank on the CPU allocates and frees the same tensors every iteration
(activations, gradients, the host lane's upcasts), so it got fresh pages each time, and the
kernel faulted and zeroed every one: on a 2-core VM, 91,000-165,000 page faults a forward and
backward of ``bench/gpt_zero3.py --size cpu-deep``, 0.3-0.6 s of system time against 0.3 s of
work. :func:`keep_freed` serves every allocation from the heap and trims nothing, so what an
iteration frees serves the next; the rank reaches the same peak every iteration either way, so
its neighbours lose nothing they could have used. What a one-off peak (building the model, a
checkpoint) left free goes back with :func:`release_freed`, called after ``deepspeed.initialize``
and whenever the engine gives memory back under pressure (``engine.host_memory``).

A heap that serves everything can also grow where glibc's maps would not: a large aligned block
freed below a small live one leaves a hole its next request (the same size plus the alignment)
does not fit, so each iteration takes new pages. :class:`KeptHeapWatch` checks after every step
that the rank's resident memory, less what the engine itself holds, stays where it settled, and
gives the kept pages back where it grew; where it keeps growing, the rank returns to glibc's
default policy, with one line.

Where the C library is not glibc (musl, macOS) every function here does nothing.
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import logging
from typing import TYPE_CHECKING

import psutil

from engine.hooks import StepHook

if TYPE_CHECKING:
    from engine.core import SubgroupEngine
    from engine.telemetry import StepRecord

M_TRIM_THRESHOLD = -1
M_MMAP_THRESHOLD = -3
M_MMAP_MAX = -4
"""mallopt's parameters (glibc's malloc.h)."""
GLIBC_MMAP_MAX = 65536
GLIBC_THRESHOLD = 128 * 1024
"""glibc's defaults for them (both thresholds start at 128 KiB)."""

log = logging.getLogger(__name__)


@functools.cache
def _glibc() -> ctypes.CDLL | None:
    with contextlib.suppress(OSError, AttributeError):
        libc = ctypes.CDLL("libc.so.6", use_errno=True)
        libc.gnu_get_libc_version  # noqa: B018 - glibc's own: not another C library named libc.so.6
        return libc
    return None


def keep_freed() -> bool:
    """Serve every allocation from the heap (no ``mmap`` of its own) and trim nothing: freed
    memory is reused by the process. Whether the policy took."""
    libc = _glibc()
    if libc is None:
        return False
    return bool(libc.mallopt(M_MMAP_MAX, 0)) and bool(libc.mallopt(M_TRIM_THRESHOLD, -1))  # -1: trimming off


def bound(mmap_threshold: int, trim_threshold: int) -> bool:
    """Fixed thresholds in place of glibc's moving ones (a long-lived process whose heap must
    not grow under short-lived frames: the tuner daemon). Whether they took."""
    libc = _glibc()
    if libc is None:
        return False
    return bool(libc.mallopt(M_MMAP_THRESHOLD, mmap_threshold)) and bool(libc.mallopt(M_TRIM_THRESHOLD, trim_threshold))


def release_freed() -> None:
    """Hand the heap's free pages back to the system (``malloc_trim``)."""
    libc = _glibc()
    if libc is not None:
        libc.malloc_trim(0)


class KeptHeapWatch(StepHook):
    """A step hook (``engine.hooks``) for a rank whose heap is kept (:func:`keep_freed`): after
    :data:`SETTLE_STEPS` steps it takes the resident bytes the engine does not hold as the
    settled size; a step that ends :data:`GROWTH` above it gives the kept pages back; the
    :data:`GIVE_UP_AFTER`-th time, the rank returns to glibc's default policy."""

    SETTLE_STEPS = 5
    GROWTH = 1.25
    GIVE_UP_AFTER = 3

    def __init__(self) -> None:
        self.steps = 0
        self.settled_bytes: int | None = None
        self.releases = 0
        self.given_up = False

    def after_step(self, engine: SubgroupEngine, record: StepRecord) -> None:
        if self.given_up:
            return
        self.steps += 1
        if self.steps < self.SETTLE_STEPS:
            return
        outside_engine = psutil.Process().memory_info().rss - int(engine.host_usage().total)
        if self.settled_bytes is None:
            self.settled_bytes = outside_engine
        if outside_engine <= self.settled_bytes * self.GROWTH:
            return
        self.releases += 1
        release_freed()
        if self.releases >= self.GIVE_UP_AFTER:
            self.given_up = True
            restore_default()
            log.warning(
                "offloadctl: this rank's heap kept growing with freed memory kept (%d times over %d steps): "
                "back to the C library's default (--host-heap system does so from the start)",
                self.releases,
                self.steps,
            )


def restore_default() -> None:
    """glibc's own policy again (its thresholds fixed at their starting values)."""
    libc = _glibc()
    if libc is not None:
        libc.mallopt(M_MMAP_MAX, GLIBC_MMAP_MAX)
        bound(GLIBC_THRESHOLD, GLIBC_THRESHOLD)
        release_freed()
