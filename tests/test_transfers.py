"""The transfers of swapped state, on their own (engine.transfers): subgroups over real swap files
in a temporary directory and the pool of staging buffers they pass through, driven as the engine's
step drives them. What one step of the engine does with them: tests/test_io_and_placement.py."""

from __future__ import annotations

import os
import threading
from concurrent.futures import Future

import pytest
import torch

from engine.binding import FlatSubgroup
from engine.buffers import StateBuffer
from engine.config import EngineConfig, Knobs, StoragePath
from engine.errors import StorageIOError
from engine.layout import payload_bytes
from engine.placement import HOST
from engine.subgroup import InHost, Stage, Subgroup, Swapped
from engine.swap_paths import SwapPaths
from engine.transfers import Transfers

NUMEL = 4096
N = 5
DEPTH = 0  # staging_buffers(0): three buffers in the pool


@pytest.fixture
def swapped(swap_dir):
    """``N`` subgroups swapped to files in ``swap_dir``, each with its state there (master ``i``,
    moments ``10 + i`` and ``20 + i``), and the transfers over a pool for prefetch ``DEPTH``."""
    # Bandwidth declared: no probe.
    path = StoragePath(path=swap_dir, read_bytes_per_s=1e9, write_bytes_per_s=1e9)
    paths = SwapPaths(EngineConfig(paths=(path,), host_cache_bytes=0, io_backend="posix"), Knobs())
    subgroups = []
    for i in range(N):
        subgroups.append(Subgroup(i, FlatSubgroup(torch.zeros(NUMEL)), Swapped(0, paths.create_file(i, NUMEL, 0)), [0]))
    transfers = Transfers(subgroups, DEPTH, room_bytes=lambda: 1 << 40, on_write_landed=None)
    for sg in subgroups:
        transfers.write_now(sg, [torch.full((NUMEL,), float(v)) for v in (sg.index, 10 + sg.index, 20 + sg.index)])
        sg.fresh = False  # its state is on storage: a stage reads it
    yield transfers, subgroups
    transfers.close()
    paths.close()


def _buffer(sg: Subgroup) -> StateBuffer | None:
    """The staging buffer holding ``sg``'s state, if one does."""
    return None if sg.staged is None else sg.staged.buffer


def _on_file(sg: Subgroup) -> StateBuffer:
    """What ``sg``'s file holds, read now into a buffer of its own."""
    buf = StateBuffer(sg.numel)
    sg.swap.file.path.read(sg.swap.file, buf).result()
    return buf


def _updated(transfers: Transfers, sg: Subgroup, master: float) -> StateBuffer:
    """``sg`` staged in a step and updated to ``master`` (not yet written back)."""
    buf = transfers.stage(sg, transfers.begin_step(range(N)))
    buf.master.fill_(master)
    sg.swap.updated()
    return buf


def _clean_copy(transfers: Transfers, sg: Subgroup) -> StateBuffer:
    """``sg`` updated, written back and landed: a clean copy in its buffer."""
    buf = _updated(transfers, sg, 100.0 + sg.index)
    transfers.write_back(sg)
    transfers.wait_writes()
    return buf


def test_a_write_back_lands_and_leaves_a_clean_kept_copy_that_the_next_update_reads_nothing_for(swapped):
    transfers, sgs = swapped
    sg = sgs[0]
    buf = _updated(transfers, sg, 7.0)
    transfers.write_back(sg)
    assert sg.stage is Stage.WRITING  # the buffer is read-only until the write lands
    transfers.wait_writes()
    assert sg.stage is Stage.KEPT_CLEAN and _buffer(sg) is buf
    assert torch.equal(_on_file(sg).master, torch.full((NUMEL,), 7.0))
    assert torch.equal(_on_file(sg).exp_avg, torch.full((NUMEL,), 10.0))
    swaps = transfers.begin_step(range(N))
    assert transfers.stage(sg, swaps) is buf
    assert (swaps.hits, swaps.misses) == (1, 0)


def test_a_restriped_write_back_moves_the_state_to_its_next_file_when_it_lands(swapped):
    transfers, sgs = swapped
    sg = sgs[1]
    old = sg.swap.file
    new = old.path.create_file(N + sg.index, sg.numel, payload_bytes(sg.numel), EngineConfig().io_chunk_bytes)
    sg.swap.next_file = new  # as SwapPaths.restripe leaves it: the state moves at its next write
    _updated(transfers, sg, 8.0)
    transfers.write_back(sg)
    transfers.wait_write(sg)
    assert sg.swap.file is new and sg.swap.next_file is None and sg.stage is Stage.KEPT_CLEAN
    assert not os.path.exists(old.filename)
    assert torch.equal(_on_file(sg).master, torch.full((NUMEL,), 8.0))


def test_victims_rank_the_copy_needed_last_first(swapped):
    transfers, sgs = swapped
    transfers.resize(N)
    for sg in sgs[1:]:
        _clean_copy(transfers, sg)
    swaps = transfers.begin_step(range(N))
    assert [sg.index for sg in transfers.victims(swaps)] == [4, 3, 2, 1]
    # For the subgroup at position 2: only copies needed after it may go.
    assert [sg.index for sg in transfers.victims(swaps, after=2)] == [4, 3]
    assert [sg.index for sg in transfers.victims(swaps, exclude=sgs[4])] == [3, 2, 1]
    # At position 3, those before it are done this step: needed again next step, in the reverse
    # order (1 last), after 4 and 3 of this step.
    swaps.current = 3
    assert [sg.index for sg in transfers.victims(swaps)] == [1, 2, 4, 3]
    sgs[2].swap.take()  # being updated: not a copy that may go
    assert [sg.index for sg in transfers.victims(swaps)] == [1, 4, 3]


def test_acquire_waits_for_the_oldest_write_when_no_buffer_is_free(swapped, monkeypatch):
    transfers, sgs = swapped
    path = sgs[0].swap.file.path
    real_write = path.write
    writes: list[tuple[Future, object, StateBuffer]] = []

    def held_write(sf, buf):
        """A real write, started only when the test lands it."""
        fut: Future = Future()
        writes.append((fut, sf, buf))
        return fut

    def land(k: int) -> None:
        fut, sf, buf = writes[k]
        if not fut.done():
            real_write(sf, buf).result()
            fut.set_result(None)

    monkeypatch.setattr(path, "write", held_write)
    bufs = [_updated(transfers, sg, 50.0 + sg.index) for sg in sgs[:3]]
    for sg in sgs[:3]:
        transfers.write_back(sg)
    assert not transfers.free  # every buffer being written

    def victims():
        return [sgs[2], sgs[1], sgs[0]]  # the order the step would rank them in

    # The oldest write lands a moment after acquire() starts waiting; the others much later, so
    # that waiting for any other one shows as the wrong buffer, not as a hang.
    timers = [threading.Timer(0.2, land, (0,)), threading.Timer(10.0, land, (1,)), threading.Timer(10.0, land, (2,))]
    for t in timers:
        t.start()
    try:
        got = transfers.acquire(victims)
        assert got is bufs[0]
        assert sgs[0].staged is None
        assert sgs[1].stage is Stage.WRITING and sgs[2].stage is Stage.WRITING  # not waited for
        assert torch.equal(_on_file(sgs[0]).master, torch.full((NUMEL,), 50.0))
    finally:
        for t in timers:
            t.cancel()
        for k in range(len(writes)):
            land(k)
        transfers.wait_writes()


def test_acquire_takes_the_free_buffers_then_a_clean_copy_without_waiting(swapped):
    transfers, sgs = swapped
    buf = _clean_copy(transfers, sgs[3])
    free = list(transfers.free)
    assert [transfers.acquire(lambda: [sgs[3]]) for _ in free] == free[::-1]
    assert _buffer(sgs[3]) is buf and sgs[3].stage is Stage.KEPT_CLEAN  # the free ones went first
    assert transfers.acquire(lambda: [sgs[3]]) is buf
    assert sgs[3].staged is None


def test_a_failed_write_keeps_the_state_in_memory_and_is_raised_once(swapped, monkeypatch):
    transfers, sgs = swapped
    sg = sgs[2]
    path = sg.swap.file.path

    def failing_write(sf, buf):
        f: Future = Future()
        f.set_exception(StorageIOError("injected"))
        return f

    buf = _updated(transfers, sg, 9.0)
    size = transfers.pool_size
    monkeypatch.setattr(path, "write", failing_write)
    transfers.write_back(sg)
    transfers.wait_writes()
    # The state is where the update left it, now host-resident, and its buffer out of the pool.
    assert sg.tier == HOST and isinstance(sg.home, InHost) and sg.home.buffer is buf
    assert torch.equal(buf.master, torch.full((NUMEL,), 9.0))
    assert transfers.pool_size == size - 1 and buf not in transfers.buffers()
    with pytest.raises(StorageIOError, match="injected"):
        transfers.raise_write_failure()
    transfers.raise_write_failure()  # raised once


def test_a_write_that_fails_during_a_read_ahead_leaves_its_subgroup_in_host_memory(swapped, monkeypatch):
    """Review of e0fbad6: the read ahead's first buffer reaps a failed write; the subgroup it
    leaves in host memory, later in the order, is skipped, not read into a buffer of the pool."""
    transfers, sgs = swapped
    sg = sgs[3]
    for i in (1, 4):
        _clean_copy(transfers, sgs[i])
    failed: Future = Future()
    failed.set_exception(StorageIOError("injected"))
    buf = _updated(transfers, sg, 9.0)  # the third buffer: none is free now
    monkeypatch.setattr(sg.swap.file.path, "write", lambda sf, b: failed)
    transfers.write_back(sg)  # landed (failed), not yet reaped
    # 0 takes 4's clean copy (needed last), reaping 3's write first; 3 is skipped; 1 is in memory.
    assert transfers.read_ahead([0, 3, 1, 4]) == 1
    assert sgs[0].staged is not None and sgs[4].staged is None
    assert isinstance(sg.home, InHost) and sg.home.buffer is buf and buf not in transfers.buffers()
    assert torch.equal(buf.master, torch.full((NUMEL,), 9.0))
    with pytest.raises(StorageIOError, match="injected"):
        transfers.raise_write_failure()


def test_an_unexpected_write_error_leaves_the_copy_dirty_and_not_being_written(swapped, monkeypatch):
    """Review of e0fbad6: an error other than a storage error, from the submit or from the write,
    is raised with the copy as it was before the write began (staged, newer than its file)."""
    transfers, sgs = swapped
    sg = sgs[1]
    path = sg.swap.file.path
    _updated(transfers, sg, 7.0)

    def refused(sf, b):
        raise RuntimeError("executor shut down")

    monkeypatch.setattr(path, "write", refused)
    with pytest.raises(RuntimeError, match="executor"):
        transfers.write_back(sg)
    assert sg.stage is Stage.UPDATED
    broken: Future = Future()
    broken.set_exception(ValueError("not a storage error"))
    monkeypatch.setattr(path, "write", lambda sf, b: broken)
    transfers.write_back(sg)
    with pytest.raises(ValueError, match="not a storage error"):
        transfers.wait_writes()
    assert sg.stage is Stage.UPDATED and isinstance(sg.home, Swapped)


def test_read_ahead_reads_into_free_buffers_only_for_subgroups_needed_before_the_copies_they_displace(swapped):
    transfers, sgs = swapped
    for i in (1, 4):
        _clean_copy(transfers, sgs[i])
    (free,) = transfers.free  # three buffers: the two copies and one free
    kept_1 = _buffer(sgs[1])
    assert transfers.read_ahead(range(N)) == 2
    # 0 into the free buffer; 1 is in memory already; 2 into 4's buffer (needed after it); 3 not:
    # the only copy left, 1's, is needed before it.
    assert _buffer(sgs[0]) is free
    assert _buffer(sgs[1]) is kept_1 and sgs[1].stage is Stage.KEPT_CLEAN
    assert sgs[2].staged is not None and sgs[4].staged is None
    assert sgs[3].staged is None
    swaps = transfers.begin_step(range(N))
    assert set(swaps.reads) == {0, 2}  # the reads ahead are the step's first reads
    for i in (0, 2):
        assert torch.equal(transfers.stage(sgs[i], swaps).exp_avg_sq, torch.full((NUMEL,), 20.0 + i))
    assert (swaps.hits, swaps.misses) == (0, 2)
