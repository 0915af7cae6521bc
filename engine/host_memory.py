"""One host-memory budget per rank, and the watch that gives memory back under pressure.

Everything the engine holds in host memory counts against one budget (:class:`HostUsage` names
the kinds): optimizer state kept in the host tier, staging buffers (reading ahead, updating,
writing back), staging buffers kept across the step boundary, and copies (the weight uploads'
pinned buffers, the host lane's gradient scratch). The rules (``docs/host-memory.md``):

- a budget given (``--host-memory``, ``OffloadAdamW(host_memory_bytes=...)``) is the budget; a
  start that needs more is an error naming the fix;
- otherwise :func:`default_budget`: a share of the memory available at start, divided among the
  node's ranks, raised to what the start needs (state with nowhere else to go stays in memory);
- the tuner deepens the prefetch only within the budget's spare bytes.

When the machine's available memory falls below a floor (:func:`default_floor`),
:class:`PressureWatch` says so, and the engine writes back and frees the buffers it keeps
beyond the step's working set (kept and read-ahead ones) before the kernel's OOM killer has to
choose a process. Torch-free: ``offloadctl`` reads these numbers without importing torch.
"""
from __future__ import annotations

import threading
import weakref
from dataclasses import asdict, dataclass

import psutil

HOST_SHARE = 0.5
"""Share of the memory available at start that the default budget gives the node's ranks together."""
FLOOR_SHARE = 0.05
"""Default pressure floor: this share of the machine's memory ..."""
FLOOR_MIN_BYTES = 1 << 30
"""... and never below 1 GiB."""
RECOVER_BYTES = 256 << 20
"""Available memory must rise this far above the floor before the engine reads ahead again, so
that one allocation's give and take does not flip it every step."""


@dataclass(frozen=True)
class HostUsage:
    """Bytes the engine holds in host memory, by kind."""

    state: int = 0
    """Optimizer state kept in the host tier."""
    staging: int = 0
    """Staging buffers of swapped state: reading ahead, updating, writing back, free."""
    kept: int = 0
    """Staging buffers that keep a subgroup's state across the step boundary."""
    copies: int = 0
    """The host lane's gradient scratch, its pinned chunk buffers (weight uploads, gradient reads),
    and the device tier's pinned host buffers kept between ``release_device()`` cycles."""

    @property
    def total(self) -> int:
        return self.state + self.staging + self.kept + self.copies

    def to_dict(self) -> dict[str, int]:
        return asdict(self)


def staging_room(budget_bytes: int, usage: HostUsage) -> int:
    """Host bytes a budget leaves for staging buffers: all but the state and the copies."""
    return max(0, budget_bytes - usage.state - usage.copies)


def default_budget(local_ranks: int, available_bytes: int | None = None) -> int:
    """The budget of one rank when none is given: :data:`HOST_SHARE` of the memory available
    now, divided among the node's ``local_ranks``."""
    available = psutil.virtual_memory().available if available_bytes is None else available_bytes
    return int(available * HOST_SHARE) // max(1, local_ranks)


def default_floor(total_bytes: int | None = None) -> int:
    """Available memory below which the engine gives buffers back: :data:`FLOOR_SHARE` of the
    machine's memory, at least :data:`FLOOR_MIN_BYTES`."""
    total = psutil.virtual_memory().total if total_bytes is None else total_bytes
    return max(FLOOR_MIN_BYTES, int(total * FLOOR_SHARE))


class PressureWatch:
    """A thread that reads the machine's available memory every ``interval_s`` and keeps
    :attr:`low` set while it is below ``floor_bytes`` (cleared again above the floor plus
    :data:`RECOVER_BYTES`). ``on_low`` (a bound method) is called from the thread each time it
    becomes low; the watch holds it weakly, and stops once its object is gone, so that an engine
    nobody closed is still freed."""

    def __init__(self, floor_bytes: int, on_low, interval_s: float = 0.2) -> None:
        self.floor_bytes = floor_bytes
        self.low = threading.Event()
        self.available_bytes = psutil.virtual_memory().available
        self._on_low = weakref.WeakMethod(on_low)
        self._interval = interval_s
        self._stop = threading.Event()
        self.check()
        self._thread = threading.Thread(target=self._run, name="offloadctl-host-memory", daemon=True)
        self._thread.start()

    def check(self) -> bool:
        """Read available memory now; whether it just became low."""
        self.available_bytes = psutil.virtual_memory().available
        if self.low.is_set():
            if self.available_bytes > self.floor_bytes + RECOVER_BYTES:
                self.low.clear()
            return False
        if self.available_bytes < self.floor_bytes:
            self.low.set()
            return True
        return False

    def _run(self) -> None:
        while not self._stop.wait(self._interval):
            callback = self._on_low()
            if callback is None:
                return  # its engine was freed without close()
            if self.check():
                try:
                    callback()
                except Exception:  # the step sees the pressure too; the thread must not die
                    pass
            del callback  # not held while waiting: the engine stays collectable

    def close(self) -> None:
        self._stop.set()
        if self._thread is not threading.current_thread():
            self._thread.join(timeout=2.0)
