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
choose a process. :class:`HostBudget` is the engine's side: the budget, what the engine holds
against it, and the watch, which calls the engine back when memory runs low. Torch-free:
``offloadctl`` reads these numbers without importing torch.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import weakref
from dataclasses import asdict, dataclass
from typing import Callable, Sequence

import psutil

from engine.errors import ConfigError
from engine.layout import deepest_prefetch, host_buffer_bytes, staging_buffers
from engine.units import format_size, size_at_least

log = logging.getLogger(__name__)

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


def start_usage(prefetch_depth: int, state_numels: Sequence[int], swapped_numels: Sequence[int], copies_bytes: int) -> HostUsage:
    """What a rank holds at its start: the host tier's state (``state_numels``), the staging
    buffers of the swapped subgroups at ``prefetch_depth``, and the copies."""
    return HostUsage(
        state=sum(host_buffer_bytes(n) for n in state_numels),
        staging=staging_buffers(prefetch_depth) * host_buffer_bytes(max(swapped_numels)) if swapped_numels else 0,
        copies=copies_bytes,
    )


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

    def __init__(self, floor_bytes: int, on_low: Callable[[], None], interval_s: float = 0.2) -> None:
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
                with contextlib.suppress(Exception):  # the step sees the pressure too; the thread must not die
                    callback()
            del callback  # not held while waiting: the engine stays collectable

    def close(self) -> None:
        self._stop.set()
        if self._thread is not threading.current_thread():
            self._thread.join(timeout=2.0)


class HostBudget:
    """One rank's host-memory budget, held by its engine: numbers, and the watch.

    ``usage`` says what the engine holds now, by kind. Under pressure (the :class:`PressureWatch`
    started by :meth:`watch`, which calls the engine back), the engine frees what it keeps beyond
    a step's working set and :meth:`gave_back` says so in one line; once memory is back above the
    floor it makes its staging pool again (as deep as :meth:`affordable_depth` holds) and
    :meth:`took_back` says so. Both at a step boundary, under the engine's lock.
    """

    def __init__(self, budget_bytes: int, usage: Callable[[], HostUsage]) -> None:
        self.budget_bytes = budget_bytes
        self.usage = usage
        self.given_back = False
        """Buffers were given back under pressure and not yet taken again."""
        self._watch: PressureWatch | None = None
        self.closed = False
        """:meth:`close` began: nothing is given back from now on."""

    @classmethod
    def for_start(
        cls,
        given_bytes: int | None,
        *,
        usage: Callable[[], HostUsage],
        local_ranks: int,
        prefetch_depth: int,
        state_numels: Sequence[int],
        swapped_numels: Sequence[int],
        copies_bytes: int,
    ) -> HostBudget:
        """The budget given (``--host-memory``), or :func:`default_budget` raised to what the start
        needs: the host tier's state (``state_numels``), the staging buffers of the swapped
        subgroups at ``prefetch_depth``, and the copies (the host lane's). A budget given that the
        start does not fit is a :class:`ConfigError` naming the fix. Decided before the engine
        allocates anything: a refusal costs nothing."""
        need = start_usage(prefetch_depth, state_numels, swapped_numels, copies_bytes)
        if given_bytes is None:
            return cls(max(default_budget(local_ranks), need.total), usage)
        if need.total > given_bytes:
            parts = ", ".join(f"{format_size(v)} {k}" for k, v in need.to_dict().items() if v)
            raise ConfigError(
                f"host memory budget {format_size(given_bytes)} (--host-memory) is below what this rank needs to start: "
                f"{format_size(need.total)} ({parts}, prefetch depth {prefetch_depth}); give --host-memory "
                f"{size_at_least(need.total)} or more, or lower --host-cache" + (" or --prefetch-depth" if prefetch_depth else "")
            )
        return cls(given_bytes, usage)

    @staticmethod
    def start_depth(
        given_bytes: int | None,
        prefetch_depth: int,
        state_numels: Sequence[int],
        swapped_numels: Sequence[int],
        copies_bytes: int,
    ) -> int:
        """The deepest prefetch up to ``prefetch_depth`` whose start fits the budget given: a prefetch
        depth nobody pinned yields to a small ``--host-memory`` (0 when even that does not fit; the
        start then refuses with depth 0's needs), said in one line where it is lower."""
        if given_bytes is None:
            return prefetch_depth
        fits = (
            d
            for d in range(prefetch_depth, -1, -1)
            if start_usage(d, state_numels, swapped_numels, copies_bytes).total <= given_bytes
        )
        depth = next(fits, 0)
        if depth < prefetch_depth:
            log.warning(
                "offloadctl: prefetch_depth=%d lowered to %d at the start: deeper staging does not fit the host memory "
                "budget (%s)",
                prefetch_depth,
                depth,
                format_size(given_bytes),
            )
        return depth

    def watch(self, floor_bytes: int | None, on_low: Callable[[], None]) -> None:
        """Watch the machine's available memory against ``floor_bytes`` (None: :func:`default_floor`),
        calling ``on_low`` (a bound method: held weakly) from the watch's thread each time memory
        runs low."""
        self._watch = PressureWatch(default_floor() if floor_bytes is None else floor_bytes, on_low=on_low)

    @property
    def low(self) -> bool:
        """Whether available memory is below the floor now (False when nothing is watched)."""
        return self._watch is not None and self._watch.low.is_set()

    def staging_room(self) -> int:
        """Bytes the budget leaves for staging buffers now (:func:`staging_room`)."""
        return staging_room(self.budget_bytes, self.usage())

    def affordable_depth(self, depth: int, buffer_bytes: int) -> int:
        """The deepest prefetch up to ``depth`` whose staging buffers of ``buffer_bytes`` each fit
        the budget's spare bytes (``depth`` itself when nothing is staged)."""
        if not buffer_bytes:
            return depth
        return max(0, min(depth, deepest_prefetch(self.staging_room() // buffer_bytes)))

    def fits(self, extra_bytes: int) -> bool:
        """Whether ``extra_bytes`` more stay within the budget."""
        return self.usage().total + extra_bytes <= self.budget_bytes

    def gave_back(self, held_bytes: int) -> None:
        """Under pressure, between steps: the engine freed what it keeps beyond its working set,
        and held ``held_bytes`` before. The first time since memory was last back, one line says
        how much."""
        assert self._watch is not None  # memory runs low only while it is watched
        if not self.given_back:
            self.given_back = True
            log.warning(
                "offloadctl: host memory low (%s available, floor %s): gave back %s of kept and read-ahead "
                "staging buffers; reading ahead again when memory recovers",
                format_size(self._watch.available_bytes),
                format_size(self._watch.floor_bytes),
                format_size(held_bytes - self.usage().total),
            )

    def took_back(self) -> None:
        """Memory is back above the floor: the engine makes its staging pool again, said in one line."""
        assert self._watch is not None  # given back only while it is watched
        self.given_back = False
        log.warning(
            "offloadctl: host memory recovered (%s available): reading ahead again", format_size(self._watch.available_bytes)
        )

    def close(self) -> None:
        """Stop the watch: nothing is given back from now on."""
        self.closed = True
        if self._watch is not None:
            self._watch.close()
