"""A subgroup's record on its own (engine.subgroup): its home says its tier, and a swapped one's
staged copy moves through the stages ``Stage``'s docstring lists, by the transitions named
there; any other fails loudly, leaving the copy as it was. The transfers that drive them over
real files: tests/test_transfers.py."""

from __future__ import annotations

import pytest
import torch

from engine.binding import FlatSubgroup
from engine.buffers import StateBuffer
from engine.config import EngineConfig, Knobs, StoragePath
from engine.placement import DEVICE, HOST, swap_tier
from engine.subgroup import DIRTY, KEPT, InHost, OnDevice, Stage, Subgroup, Swapped
from engine.swap_paths import SwapPaths

NUMEL = 1024


@pytest.fixture
def paths(swap_dir):
    path = StoragePath(path=swap_dir, read_bytes_per_s=1e9, write_bytes_per_s=1e9)  # declared: no probe
    paths = SwapPaths(EngineConfig(paths=(path,), host_cache_bytes=0, io_backend="posix"), Knobs())
    yield paths
    paths.close()


@pytest.fixture
def sg(paths):
    """A subgroup swapped to its file on path 0, nothing staged."""
    return Subgroup(3, FlatSubgroup(torch.zeros(NUMEL)), Swapped(0, paths.create_file(3, NUMEL, 0)), [0])


def _held(sg: Subgroup) -> StateBuffer:
    buf = StateBuffer(NUMEL, pin=False)
    sg.swap.load(buf)
    return buf


def test_the_tier_is_the_homes(sg):
    assert sg.tier == swap_tier(0) and sg.tier.swapped and sg.staged is None and sg.stage is None
    sg.swap.path_index = 1  # a restripe: where the next write goes
    assert sg.tier == swap_tier(1)
    buf = StateBuffer(NUMEL, pin=False)
    sg.home = InHost(buf)
    assert sg.tier == HOST and sg.staged is None
    with pytest.raises(AssertionError, match="subgroup 3 is not swapped"):
        _ = sg.swap
    sg.home = OnDevice(torch.empty(3 * NUMEL))
    assert sg.tier == DEVICE and sg.home.host_copy is None


def test_a_round_trip_through_its_staging_buffer(sg):
    buf = _held(sg)
    assert sg.stage is Stage.HELD and sg.staged is not None and sg.staged.buffer is buf
    assert sg.swap.take() is buf and sg.stage is Stage.HELD  # nothing newer than the file yet
    sg.swap.updated()
    assert sg.stage is Stage.UPDATED
    assert sg.swap.write() == (sg.swap.file, buf) and sg.stage is Stage.WRITING
    assert sg.swap.landed() is None and sg.stage is Stage.KEPT_CLEAN  # its file current: a clean copy
    assert sg.swap.take() is buf and sg.stage is Stage.HELD  # a later update reads nothing
    assert sg.swap.release() is buf and sg.staged is None


def test_the_kept_tail_stays_newer_than_its_file_until_it_is_written(sg):
    buf = _held(sg)
    sg.swap.take()
    sg.swap.updated()
    sg.swap.keep()
    assert sg.stage is Stage.KEPT_DIRTY
    assert sg.swap.take() is buf and sg.stage is Stage.UPDATED  # taken for its next update: still dirty
    sg.swap.keep()
    sg.swap.write()  # a buffer needed, a give-back, a smaller pool
    assert sg.stage is Stage.WRITING


def test_a_read_ahead_that_landed_is_a_clean_copy(sg):
    buf = _held(sg)
    sg.swap.read_landed()
    assert sg.stage is Stage.KEPT_CLEAN and sg.swap.release() is buf


def test_a_restriped_write_goes_to_the_next_file_which_becomes_its_file(sg, paths):
    old = sg.swap.file
    sg.swap.next_file = new = paths.create_file(sg.index, sg.numel, 0)
    buf = _held(sg)
    sg.swap.updated()
    assert sg.swap.write() == (new, buf)
    assert sg.swap.landed() is old  # the caller removes it
    assert sg.swap.file is new and sg.swap.next_file is None


def test_a_failed_write_makes_the_buffer_its_home(sg):
    buf = _held(sg)
    sg.swap.updated()
    sg.swap.write()
    home = sg.swap.write_failed()
    assert isinstance(home, InHost) and home.buffer is buf and sg.swap.staged is None


@pytest.mark.parametrize(
    "stage, kept, dirty",
    [
        (Stage.HELD, False, False),
        (Stage.UPDATED, False, True),
        (Stage.WRITING, False, True),
        (Stage.KEPT_DIRTY, True, True),
        (Stage.KEPT_CLEAN, True, False),
    ],
)
def test_which_stages_are_kept_and_which_newer_than_the_file(stage, kept, dirty):
    assert (stage in KEPT, stage in DIRTY) == (kept, dirty)


def _writing(sg: Subgroup) -> StateBuffer:
    buf = _held(sg)
    sg.swap.updated()
    sg.swap.write()
    return buf


@pytest.mark.parametrize(
    "setup, move, have, want",
    [
        (_writing, lambda h: h.release(), "writing", "not staged"),  # its buffer is read by the write
        (_writing, lambda h: h.take(), "writing", "updated"),  # updated before its write landed
        (_writing, lambda h: h.write(), "writing", "writing"),  # written twice at once
        (_writing, lambda h: h.load(StateBuffer(NUMEL, pin=False)), None, None),
        (_held, lambda h: h.write(), "held", "writing"),  # nothing newer than the file to write
        (_held, lambda h: h.keep(), "held", "kept dirty"),  # kept before its update
        (_held, lambda h: h.landed(), "held", "kept clean"),  # no write in flight
        (_held, lambda h: h.write_failed(), "held", "not staged"),
        (lambda sg: None, lambda h: h.release(), "not staged", "not staged"),
        (lambda sg: None, lambda h: h.updated(), "not staged", "updated"),
    ],
)
def test_an_illegal_move_fails_loudly_and_leaves_the_staged_copy_as_it_was(sg, setup, move, have, want):
    setup(sg)
    before = sg.swap.staged
    match = "no load" if have is None else f"subgroup 3's staged copy: no move from {have} to {want}"
    with pytest.raises(RuntimeError, match=match):
        move(sg.swap)
    assert sg.swap.staged == before
