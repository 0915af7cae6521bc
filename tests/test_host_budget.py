"""HostBudget alone (``engine.host_memory``): the numbers a rank's host memory is decided by,
and the watch that calls its engine back when the machine's memory runs low. No engine: the
usage is what each test sets, the callback a stand-in's bound method, and the machine's
available memory is faked (``psutil.virtual_memory``) as ``tests/test_host_memory.py`` fakes it,
so that other processes on the machine move nothing here. The engine's side of the give-back
(what it frees, under its lock) is ``tests/test_host_memory.py``'s."""

from __future__ import annotations

import gc
import logging
import time

import psutil
import pytest
from helpers import wait_for

from engine.errors import ConfigError
from engine.host_memory import RECOVER_BYTES, HostBudget, HostUsage, PressureWatch
from engine.layout import host_buffer_bytes

GB = 10**9
BUF = host_buffer_bytes(1000)  # one state buffer of the 1000-element subgroups below
QUIET_S = 0.7  # over three of the watch's 0.2 s readings: long enough for a wrong call to come


@pytest.fixture
def machine(monkeypatch):
    """The machine's memory as the test sets it: ``machine["available"]`` of 100 GB."""
    real = psutil.virtual_memory
    mem = {"available": 64 * GB}
    monkeypatch.setattr(psutil, "virtual_memory", lambda: real()._replace(available=mem["available"], total=100 * GB))
    return mem


class Usage:
    """What the engine holds, as the test sets it (``now``)."""

    def __init__(self, **kinds: int) -> None:
        self.now = HostUsage(**kinds)

    def __call__(self) -> HostUsage:
        return self.now


class Engine:
    """Stands for the engine: the watch calls back a bound method, held weakly."""

    def __init__(self) -> None:
        self.calls = 0

    def on_low(self) -> None:
        self.calls += 1


# -- the start ------------------------------------------------------------------------------------


def test_without_a_budget_the_start_takes_its_share_of_memory_raised_to_what_it_needs(machine):
    usage = Usage()
    small = HostBudget.for_start(
        None, usage=usage, local_ranks=4, prefetch_depth=2, state_numels=[1000], swapped_numels=[], copies_bytes=0
    )
    assert small.budget_bytes == 8 * GB  # half of the 64 GB available, shared by 4 ranks
    assert small.usage is usage
    big = HostBudget.for_start(
        None, usage=usage, local_ranks=4, prefetch_depth=2, state_numels=[1000], swapped_numels=[], copies_bytes=10 * GB
    )
    assert big.budget_bytes == 10 * GB + BUF  # the copies and the state: nowhere else to go


def test_a_budget_given_is_the_budget_and_one_the_start_does_not_fit_is_refused():
    start = dict(usage=Usage(), local_ranks=1, state_numels=[1000], swapped_numels=[1000], copies_bytes=100)
    need = BUF + 7 * BUF + 100  # the host tier's state, 2 * 2 + 3 staging buffers at depth 2, the copies
    assert HostBudget.for_start(need, prefetch_depth=2, **start).budget_bytes == need  # exactly what it needs
    with pytest.raises(ConfigError) as e:
        HostBudget.for_start(need - 1, prefetch_depth=2, **start)
    assert "(--host-memory) is below what this rank needs to start" in str(e.value)
    assert "prefetch depth 2" in str(e.value) and str(e.value).endswith("or lower --host-cache or --prefetch-depth")
    with pytest.raises(ConfigError) as e:
        HostBudget.for_start(BUF, prefetch_depth=0, **start)  # 3 staging buffers at depth 0
    assert str(e.value).endswith("or lower --host-cache")  # no deeper prefetch to lower


def test_the_start_depth_is_the_deepest_a_budget_given_holds():
    swapped = dict(state_numels=[], swapped_numels=[1000, 1000], copies_bytes=0)
    assert HostBudget.start_depth(None, 4, **swapped) == 4  # no budget given: the depth asked
    assert HostBudget.start_depth(100 * BUF, 4, **swapped) == 4
    assert HostBudget.start_depth(5 * BUF, 4, **swapped) == 1  # 2d + 3 buffers: 5 at depth 1, 7 at 2
    assert HostBudget.start_depth(5 * BUF - 1, 4, **swapped) == 0
    assert HostBudget.start_depth(BUF, 4, **swapped) == 0  # not even depth 0: the start refuses it


# -- the budget's spare bytes ---------------------------------------------------------------------


def test_fits_counts_everything_held_against_the_budget():
    usage = Usage(state=100, staging=200, kept=300, copies=50)
    budget = HostBudget(1000, usage)
    assert budget.fits(350) and not budget.fits(351)
    usage.now = HostUsage(copies=1000)
    assert budget.fits(0) and not budget.fits(1)


def test_the_staging_room_and_the_affordable_depth_leave_out_the_staging_itself():
    usage = Usage(state=BUF, staging=5 * BUF, kept=4 * BUF, copies=BUF)
    budget = HostBudget(11 * BUF + 10, usage)
    assert budget.staging_room() == 9 * BUF + 10  # the budget less the state and the copies
    assert budget.affordable_depth(5, BUF) == 3  # 9 buffers: 2 * 3 + 3
    assert budget.affordable_depth(2, BUF) == 2  # never deeper than asked
    assert budget.affordable_depth(5, 0) == 5  # nothing staged
    usage.now = HostUsage(state=9 * BUF, copies=BUF)
    assert budget.staging_room() == BUF + 10
    assert budget.affordable_depth(5, BUF) == 0  # not even depth 0's three: 0, not below
    usage.now = HostUsage(state=20 * BUF)
    assert budget.staging_room() == 0


# -- the watch ------------------------------------------------------------------------------------


def test_the_watch_calls_back_each_time_memory_runs_low_and_not_otherwise(machine):
    floor = 10 * GB
    engine = Engine()
    budget = HostBudget(GB, Usage())
    assert not budget.low  # nothing watched
    budget.watch(floor, on_low=engine.on_low)
    try:
        time.sleep(QUIET_S)
        assert engine.calls == 0 and not budget.low
        machine["available"] = floor - 1
        wait_for(lambda: engine.calls == 1, 5, "the callback")
        assert budget.low
        machine["available"] = floor + RECOVER_BYTES  # above the floor, not yet by the recovery's margin
        time.sleep(QUIET_S)
        assert engine.calls == 1 and budget.low  # called once for the one time it ran low
        machine["available"] = floor + RECOVER_BYTES + 1
        wait_for(lambda: not budget.low, 5, "the memory back")
        machine["available"] = floor - 1
        wait_for(lambda: engine.calls == 2, 5, "the second callback")
    finally:
        budget.close()
    assert budget.closed
    machine["available"] = 64 * GB
    time.sleep(QUIET_S)
    machine["available"] = 0
    time.sleep(QUIET_S)
    assert engine.calls == 2  # closed: never called again


def test_the_default_floor_is_a_share_of_the_machines_memory(machine):
    engine = Engine()
    budget = HostBudget(GB, Usage())
    machine["available"] = 5 * GB  # 5% of the machine's 100 GB: at the floor, not below it
    budget.watch(None, on_low=engine.on_low)
    try:
        time.sleep(QUIET_S)
        assert engine.calls == 0
        machine["available"] = 5 * GB - 1
        wait_for(lambda: engine.calls == 1, 5, "the callback")
    finally:
        budget.close()


def test_a_watch_whose_engine_is_gone_stops(machine):
    """The watch holds its callback weakly: an engine nobody closed is still freed, and its
    watch's thread ends with it."""
    engine = Engine()
    watch = PressureWatch(10 * GB, on_low=engine.on_low, interval_s=0.01)
    thread = watch._thread
    del engine
    gc.collect()
    wait_for(lambda: not thread.is_alive(), 5, "the watch's thread to end")


def test_giving_back_is_said_once_until_memory_is_back(machine, caplog):
    """The lines a user reads, word for word: one when memory runs low (how much the engine
    gave back), one when it is back."""
    machine["available"] = 9 * GB
    usage = Usage(staging=3 * BUF, kept=5 * BUF)
    budget = HostBudget(GB, usage)
    engine = Engine()
    budget.watch(10 * GB, on_low=engine.on_low)
    caplog.set_level(logging.WARNING, logger="engine.host_memory")
    try:
        assert budget.low and not budget.given_back
        held = usage().total
        usage.now = HostUsage(staging=2 * BUF)  # what the engine freed
        budget.gave_back(held)
        assert budget.given_back
        assert caplog.messages == [
            "offloadctl: host memory low (9 GB available, floor 10 GB): gave back 123 KB of kept and read-ahead "
            "staging buffers; reading ahead again when memory recovers"
        ]
        budget.gave_back(usage().total)  # every decision under pressure gives back: said once
        assert len(caplog.messages) == 1 and budget.given_back
        caplog.clear()
        machine["available"] = 11 * GB
        wait_for(lambda: not budget.low, 5, "the watch to read the memory back")
        budget.took_back()
        assert not budget.given_back
        assert caplog.messages == ["offloadctl: host memory recovered (11 GB available): reading ahead again"]
        caplog.clear()
        budget.gave_back(usage().total)  # low again: said again
        assert len(caplog.messages) == 1 and "gave back 0 B" in caplog.messages[0]
    finally:
        budget.close()
