"""A subgroup's record (:class:`Subgroup`), and the staging of swapped ones (:class:`StagingPool`):
the host buffers their state passes through between its file and its update, and the write-backs
in flight. Reading into a buffer, and when, is the step's (``engine.core``); writing a buffer back,
taking it back when the write lands (or keeping the state in memory when it fails), and finding a
free one are here.
"""
from __future__ import annotations

from collections import deque
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Sequence

import torch

from engine.binding import SubgroupBinding
from engine.buffers import StateBuffer
from engine.errors import OffloadError, StorageIOError
from engine.layout import host_buffer_bytes
from engine.placement import HOST, Tier
from engine.storage.paths import SwapFile


@dataclass
class Subgroup:
    index: int
    binding: SubgroupBinding
    tier: Tier
    steps: list[int]  # per slice, as torch AdamW keeps per parameter
    resident: StateBuffer | torch.Tensor | None = None  # HOST: StateBuffer; DEVICE: flat tensor
    file: SwapFile | None = None  # swapped: where the state is
    next_file: SwapFile | None = None  # restriped: where the next write goes
    staged: StateBuffer | None = None  # swapped: staging buffer holding it now
    fresh: bool = True  # no state yet: its first state (first_state) is made where it is first needed
    dirty: bool = False  # staged copy is newer than the file
    kept: bool = False  # staged copy kept from the previous step

    @property
    def numel(self) -> int:
        return self.binding.numel


class StagingPool:
    """``size`` staging buffers of ``capacity_numel`` elements each: free, holding a subgroup's
    state (``Subgroup.staged``), or being written back. A write that fails leaves the subgroup's
    state in its buffer as host-resident state, out of the pool, and its error in ``failures``."""

    def __init__(self, capacity_numel: int) -> None:
        self.capacity_numel = capacity_numel
        self.size = 0
        self.free: list[StateBuffer] = []
        self.writes: deque[tuple[Subgroup, StateBuffer, Future]] = deque()
        self.failures: list[OffloadError] = []

    @property
    def buffer_bytes(self) -> int:
        """Host memory of one buffer (0 without swapped state)."""
        return host_buffer_bytes(self.capacity_numel) if self.capacity_numel else 0

    def resize(self, n: int) -> None:
        """Grow to ``n`` buffers, or shrink towards it by dropping free ones."""
        while self.size < n:
            self.free.append(StateBuffer(self.capacity_numel))
            self.size += 1
        while self.size > n and self.free:
            self.free.pop()
            self.size -= 1

    def write_back(self, sg: Subgroup) -> None:
        """Start writing ``sg``'s staged state to its file (the next one, after a restripe)."""
        buf = sg.staged
        target = sg.next_file or sg.file
        self.writes.append((sg, buf, target.path.write(target, buf)))

    def try_acquire(self) -> StateBuffer | None:
        """A free buffer, or the oldest write-back's if it has landed; None without waiting."""
        if self.free:
            return self.free.pop()
        if self.writes and self.writes[0][2].done():
            return self.reclaim_oldest_write()
        return None

    def acquire(self, exclude: Subgroup, subgroups: Sequence[Subgroup], forward: bool) -> StateBuffer:
        """A free buffer; waits for the oldest write-back, or evicts the kept buffer of
        ``subgroups`` needed last in this step's order (``forward``), never ``exclude``'s."""
        while True:
            buf = self.try_acquire()
            if buf is not None:
                return buf
            if self.writes:
                buf = self.reclaim_oldest_write()
                if buf is not None:
                    return buf
                continue
            kept = [sg for sg in subgroups if sg.staged is not None and sg.kept and sg is not exclude]
            if not kept:
                # Only after failed writes pinned buffers in memory: grow rather than stall.
                self.size += 1
                return StateBuffer(self.capacity_numel)
            self.write_back(kept[-1] if forward else kept[0])

    def reclaim_oldest_write(self) -> StateBuffer | None:
        """Wait for the oldest write-back; its buffer, or None if it failed (then kept in memory)."""
        sg, buf, fut = self.writes.popleft()
        try:
            fut.result()
        except StorageIOError as e:
            # Nothing is lost: the subgroup stays in this buffer, now as host-resident state.
            self.failures.append(e)
            self.size -= 1
            sg.tier, sg.resident, sg.staged, sg.kept = HOST, buf, None, False
            return None
        if sg.next_file is not None:
            sg.file.path.remove_file(sg.file)
            sg.file, sg.next_file = sg.next_file, None
        sg.staged, sg.dirty, sg.kept = None, False, False
        return buf

    def release(self, sg: Subgroup) -> None:
        """``sg``'s buffer back to the free ones, unwritten (its file is current)."""
        if sg.staged is not None:
            self.free.append(sg.staged)
            sg.staged = None

    def drain(self) -> None:
        """Wait for every write-back; failures are recorded and keep their state in memory."""
        while self.writes:
            buf = self.reclaim_oldest_write()
            if buf is not None:
                self.free.append(buf)
