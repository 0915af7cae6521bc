"""A subgroup's record (:class:`Subgroup`), and the staging of swapped ones (:class:`StagingPool`):
the host buffers their state passes through between its file and its update, and the write-backs
in flight. Reading into a buffer, and when, is :mod:`engine.transfers`'; writing a buffer back,
taking it back when the write lands (or keeping the state in memory when it fails), and finding a
free one are here. How the two overlap training: ``docs/io-overlap.md``.
"""

from __future__ import annotations

from collections import deque
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Callable, Iterable, Sequence

import torch

from engine.binding import SubgroupBinding
from engine.buffers import StateBuffer
from engine.errors import OffloadError, StorageIOError
from engine.layout import host_buffer_bytes, staging_buffers
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
    fresh: bool = True  # no state yet: its first state (start_state) is made where it is first needed
    dirty: bool = False  # staged copy is newer than the file
    kept: bool = False  # staged copy held between updates (dirty: the kept tail; clean: its write landed)
    writing: bool = False  # staged copy being written back (the buffer is read-only until it lands)
    host_copy: StateBuffer | None = None  # DEVICE: the pinned host buffer its state leaves to at release_device()

    @property
    def numel(self) -> int:
        return self.binding.numel

    @property
    def swap_file(self) -> SwapFile:
        """Swapped: the file its state is in."""
        assert self.file is not None, f"subgroup {self.index} has no swap file"
        return self.file

    @property
    def host_buffer(self) -> StateBuffer:
        """In host memory (``HOST``): the buffer its state lives in."""
        assert isinstance(self.resident, StateBuffer), f"subgroup {self.index} is not in host memory"
        return self.resident

    @property
    def device_state(self) -> torch.Tensor:
        """In the device tier: its flat state (master, exp_avg, exp_avg_sq back to back) on the device."""
        assert isinstance(self.resident, torch.Tensor), f"subgroup {self.index} is not on the device"
        return self.resident

    def start_state(self, buf: StateBuffer) -> None:
        """Its first state, in host buffer ``buf`` where it is first needed; nothing once it has state."""
        if self.fresh:
            first_state(self.binding, buf)
            self.fresh = False


def first_state(binding: SubgroupBinding, buf: StateBuffer) -> None:
    """A subgroup's state before its first update: master from the model's weights, zero moments."""
    binding.read_weights(buf.master)
    buf.exp_avg.zero_()
    buf.exp_avg_sq.zero_()


class StagingPool:
    """``size`` staging buffers of ``capacity_numel`` elements each: free, holding a subgroup's
    state (``Subgroup.staged``), or being written back. A buffer whose write landed stays with its
    subgroup as a clean copy (``kept``, not ``dirty``) until its buffer is taken for another: a
    later update of that subgroup reads nothing. A write that fails leaves the subgroup's state in
    its buffer as host-resident state, out of the pool, and its error in ``failures``."""

    @classmethod
    def for_swapped(cls, subgroups: Sequence[Subgroup], prefetch_depth: int) -> StagingPool:
        """The pool of ``subgroups``' swapped ones: buffers of the largest, as many as the working
        buffers of ``prefetch_depth`` need (none without swapped state)."""
        swapped = [sg.numel for sg in subgroups if sg.tier.swapped]
        pool = cls(max(swapped, default=0))
        pool.resize(staging_buffers(prefetch_depth) if swapped else 0)
        return pool

    def __init__(self, capacity_numel: int) -> None:
        self.capacity_numel = capacity_numel
        self.size = 0
        self.free: list[StateBuffer] = []
        self.writes: deque[tuple[Subgroup, StateBuffer, Future[None]]] = deque()
        self.failures: list[OffloadError] = []
        self.on_landed: Callable[[], object] | None = None  # called (in an I/O thread) when a write-back lands

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
        assert buf is not None  # what is written back is staged
        target = sg.next_file or sg.swap_file
        fut = target.path.write(target, buf)
        sg.writing, sg.kept = True, False
        self.writes.append((sg, buf, fut))
        if (on_landed := self.on_landed) is not None:
            fut.add_done_callback(lambda _: on_landed())

    def _finish(self, sg: Subgroup, buf: StateBuffer, fut: Future[None]) -> bool:
        """A write-back that has landed (or is waited for now): the subgroup keeps its buffer as
        a clean copy. False if it failed: the state stays in the buffer as host-resident state."""
        sg.writing = False
        try:
            fut.result()
        except StorageIOError as e:
            # Nothing is lost: the subgroup stays in this buffer, now as host-resident state.
            self.failures.append(e)
            self.size -= 1
            sg.tier, sg.resident, sg.staged, sg.kept = HOST, buf, None, False
            return False
        if sg.next_file is not None:
            sg.swap_file.path.remove_file(sg.swap_file)
            sg.file, sg.next_file = sg.next_file, None
        sg.dirty, sg.kept = False, True
        return True

    def reap(self) -> None:
        """Finish the write-backs that have landed, without waiting."""
        for entry in [w for w in self.writes if w[2].done()]:
            self.writes.remove(entry)
            self._finish(*entry)

    def wait_write(self, sg: Subgroup) -> None:
        """Wait for exactly ``sg``'s write-back, if one is in flight."""
        if not sg.writing:
            return
        entry = next(w for w in self.writes if w[0] is sg)
        self.writes.remove(entry)
        self._finish(*entry)

    def drain(self) -> None:
        """Wait for every write-back; failures are recorded and keep their state in memory."""
        while self.writes:
            self._finish(*self.writes.popleft())

    def take(self, sg: Subgroup) -> StateBuffer:
        """The buffer of ``sg``'s clean copy, for another subgroup (its file is current)."""
        buf, sg.staged, sg.kept = sg.staged, None, False
        assert buf is not None  # only a staged copy is taken
        return buf

    def try_acquire(self, victims: Callable[[], Iterable[Subgroup]] = lambda: ()) -> StateBuffer | None:
        """A free buffer, else that of the first clean copy among ``victims()`` (called only when
        no buffer is free: ranking them is the costly part); None without waiting."""
        if self.free:
            return self.free.pop()
        self.reap()
        for sg in victims():
            if sg.staged is not None and sg.kept and not sg.dirty:
                return self.take(sg)
        return None

    def acquire(self, victims: Callable[[], Iterable[Subgroup]]) -> StateBuffer:
        """A buffer, waiting if it must: a free one, a clean copy among ``victims()`` (the
        subgroups whose copies may go, the one needed last first), the oldest write-back's once
        it lands, or a dirty kept one's after writing it back."""
        while True:
            buf = self.try_acquire(victims)
            if buf is not None:
                return buf
            if self.writes:
                self._finish(*self.writes.popleft())
                continue
            dirty = [sg for sg in victims() if sg.staged is not None and sg.kept]
            if not dirty:
                # Only after failed writes pinned buffers in memory: grow rather than stall.
                self.size += 1
                return StateBuffer(self.capacity_numel)
            self.write_back(dirty[0])

    def release(self, sg: Subgroup) -> None:
        """``sg``'s buffer back to the free ones, unwritten (its file is current)."""
        if sg.staged is not None:
            self.free.append(sg.staged)
            sg.staged = None
            sg.kept = False

    def release_clean(self, subgroups: Sequence[Subgroup]) -> None:
        """Every clean copy's buffer back to the free ones."""
        self.reap()
        for sg in subgroups:
            if sg.staged is not None and sg.kept and not sg.dirty:
                self.release(sg)
