"""The transfers of swapped state between its files and the host staging buffers it passes
through (:class:`Transfers`): the pool of buffers, the reads of a step, the reads ahead of the
next one, the write-behind, which staged copies give up their buffers, and the writes that
failed. What overlaps what, and why the result is exact, is ``docs/io-overlap.md``:

- **The pool.** A staging buffer is free, or holds a swapped subgroup's state (``Swapped.staged``,
  at a :class:`~engine.subgroup.Stage` of its round trip: being written back, it is read-only until
  the write lands). A buffer is acquired free, else from a clean copy (:meth:`Transfers.acquire`),
  else once the oldest write-back lands.
- **Write-behind.** A step's write-backs drain behind it, during the next forward and backward;
  whatever needs those bytes waits for exactly them (:meth:`Transfers.wait_write`). What moves
  files or buffers (a knob change, the device tier's fit, a give-back, a checkpoint) waits for all
  of them first (:meth:`Transfers.wait_all`).
- **Read-ahead.** Between steps, the next step's first swapped subgroups are read into free
  staging buffers and the buffers of copies needed later (:meth:`Transfers.read_ahead`): at the
  step's end, as writes land, and when backward starts. The read-ahead budget adds buffers for
  them beyond the working ones (:meth:`Transfers.size_read_ahead`).
- **Clean copies.** A buffer whose write landed keeps its subgroup's state until it is needed
  for another (:meth:`Transfers.victims` ranks them): a subgroup updated again before that reads
  nothing.
- **Failures.** A write that fails keeps its state in memory: the subgroup stays in that buffer
  as host-resident state, out of the pool; the next step or :meth:`Transfers.flush` raises it.
"""

from __future__ import annotations

import contextlib
import time
from collections import deque
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Callable, Iterable, Sequence

import torch

from engine.buffers import StateBuffer
from engine.errors import OffloadError, StorageIOError
from engine.layout import host_buffer_bytes, read_ahead_bytes, staging_buffers
from engine.subgroup import DIRTY, KEPT, InHost, Stage, Subgroup, Swapped, first_state

PRESSURE_BUFFERS = 2
"""Staging buffers left under memory pressure: one updating, one writing back; no read-ahead."""


@dataclass
class SwapPass:
    """One step's pass over the swapped subgroups: their order, how far the update and the reads
    have gone, the reads under way, and what the pass waited for."""

    order: list[int]
    """Swapped subgroups in the step's order."""
    position: dict[int, int]
    """Subgroup -> its position in ``order``."""
    next_read: int = 0
    """First position of ``order`` not yet considered for a read."""
    current: int = 0
    """Position being updated: those before it are done this step."""
    reads: dict[int, Future[None]] = field(default_factory=dict)
    """Subgroup -> its read in flight into its staging buffer."""
    read_wait_s: float = 0.0
    hits: int = 0
    """Subgroups updated from a copy kept in memory: nothing read."""
    misses: int = 0
    """Subgroups whose state was read from storage."""

    @classmethod
    def of(cls, order: Sequence[int]) -> SwapPass:
        return cls(list(order), {i: k for k, i in enumerate(order)})


class Transfers:
    """Reads and writes of the swapped subgroups' state through a pool of staging buffers, each
    the size of the largest swapped subgroup, as many as the working buffers of
    ``prefetch_depth`` need (none without swapped state). A buffer whose write landed stays with
    its subgroup as a clean copy (``KEPT_CLEAN``) until its buffer is taken for another:
    a later update of that subgroup reads nothing. A write that fails leaves the subgroup's state
    in its buffer as host-resident state, out of the pool, and its error in ``failures``.

    ``on_write_landed`` is called (in an I/O thread) when a write-back lands and reads ahead may
    use its buffer; None without overlap. ``room_bytes`` says what the host budget leaves for
    staging buffers now. ``auto_read_ahead``: the read-ahead budget is sized once from the run
    (:meth:`size_read_ahead_once`)."""

    def __init__(
        self,
        subgroups: Sequence[Subgroup],
        prefetch_depth: int,
        *,
        room_bytes: Callable[[], int],
        on_write_landed: Callable[[], object] | None,
        auto_read_ahead: bool = False,
    ) -> None:
        self.subgroups = subgroups
        swapped = [sg.numel for sg in subgroups if sg.tier.swapped]
        self.capacity_numel = max(swapped, default=0)
        """Elements of one staging buffer (0 without swapped state)."""
        self.pool_size = 0
        """Staging buffers in the pool now: free, holding a subgroup, or being written back."""
        self.free: list[StateBuffer] = []
        self.writes: deque[tuple[Subgroup, Future[None]]] = deque()
        self.failures: list[OffloadError] = []
        self._room_bytes = room_bytes
        self._early_reads: dict[int, Future[None]] = {}  # reads ahead, taken by the next step's pass
        self.read_ahead_buffers = 0
        """Staging buffers of the read-ahead budget, beyond the working ones."""
        self._read_ahead_unsized = auto_read_ahead
        self._reads_on_landing = True  # False after flush(): a write landing reads nothing ahead until the next step
        self._on_write_landed = on_write_landed
        self.resize(staging_buffers(prefetch_depth) if swapped else 0)

    @property
    def swaps(self) -> bool:
        """Whether any subgroup's state goes through staging buffers."""
        return self.capacity_numel > 0

    @property
    def buffer_bytes(self) -> int:
        """Host memory of one staging buffer (0 without swapped state)."""
        return host_buffer_bytes(self.capacity_numel) if self.capacity_numel else 0

    # -- the pool's buffers -------------------------------------------------------------------

    def resize(self, n: int) -> None:
        """Grow to ``n`` buffers, or shrink towards it by dropping free ones."""
        while self.pool_size < n:
            self.free.append(StateBuffer(self.capacity_numel))
            self.pool_size += 1
        while self.pool_size > n and self.free:
            self.free.pop()
            self.pool_size -= 1

    def try_acquire(self, victims: Callable[[], Iterable[Subgroup]] = lambda: ()) -> StateBuffer | None:
        """A free buffer, else that of the first clean copy among ``victims()`` (called only when
        no buffer is free: ranking them is the costly part); None without waiting."""
        if self.free:
            return self.free.pop()
        self.reap()
        for sg in victims():
            if sg.stage is Stage.KEPT_CLEAN:
                return sg.swap.release()  # its file is current
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
            dirty = [sg for sg in victims() if sg.stage in KEPT]
            if not dirty:
                # Only after failed writes pinned buffers in memory: grow rather than stall.
                self.pool_size += 1
                return StateBuffer(self.capacity_numel)
            self.write_back(dirty[0])

    def release(self, sg: Subgroup) -> None:
        """``sg``'s buffer back to the free ones, unwritten (its file is current, or about to go)."""
        if sg.staged is not None:
            self.free.append(sg.swap.release())

    def buffers(self) -> list[StateBuffer]:
        """Every buffer of the pool that is not being written: free, or holding a subgroup."""
        return self.free + [st.buffer for sg in self.subgroups if (st := sg.staged) is not None]

    def host_bytes(self) -> tuple[int, int]:
        """Host memory of the pool: (buffers not holding a kept copy, buffers holding one)."""
        kept = sum(host_buffer_bytes(st.buffer.capacity_numel) for sg in self.subgroups if (st := sg.staged) and st.stage in KEPT)
        return max(0, self.pool_size * self.buffer_bytes - kept), kept

    # -- the pool's size ---------------------------------------------------------------------

    def size_read_ahead(self, nbytes: int) -> int:
        """Add the read-ahead budget's buffers, ``nbytes`` in whole buffers, within the host budget
        and at most one per swapped subgroup beyond the working ones. Returns the buffers added."""
        if not self.swaps or not nbytes:
            return 0
        per = self.buffer_bytes
        room = self._room_bytes() - self.pool_size * per
        swapped = sum(1 for sg in self.subgroups if sg.tier.swapped)
        n = max(0, min(-(-nbytes // per), room // per, swapped - self.pool_size))
        self.read_ahead_buffers = n
        self.resize(self.pool_size + n)
        return n

    def size_read_ahead_once(self, fwd_bwd_s: float, read_bytes_per_s: Sequence[float]) -> int:
        """The automatic read-ahead budget, once (the second step: the first that measured forward
        and backward): what the paths read in ``fwd_bwd_s`` (:func:`engine.layout.read_ahead_bytes`).
        Returns the buffers added."""
        if not self._read_ahead_unsized:
            return 0
        self._read_ahead_unsized = False
        return self.size_read_ahead(read_ahead_bytes(fwd_bwd_s, sum(read_bytes_per_s)))

    @property
    def read_ahead_bytes(self) -> int:
        """Host memory of the read-ahead budget's staging buffers."""
        return self.read_ahead_buffers * self.buffer_bytes

    def resize_for(self, depth: int) -> None:
        """The pool for prefetch ``depth`` (at a knob change): its working buffers, and the read-ahead
        budget's as far as the host budget's room leaves them (it yields to the working ones).
        Shrinking frees clean copies' buffers first, then writes kept ones out."""
        if not self.swaps:
            return
        room = self._room_bytes() // self.buffer_bytes
        self.read_ahead_buffers = max(0, min(self.read_ahead_buffers, room - staging_buffers(depth)))
        size = staging_buffers(depth) + self.read_ahead_buffers
        if size == self.pool_size or not self.pool_size:
            return
        self.resize(size)
        if self.pool_size > size:  # every clean copy's buffer back to the free ones
            self.reap()
            for sg in self.subgroups:
                if sg.stage is Stage.KEPT_CLEAN:
                    self.release(sg)
            self.resize(size)
        while self.pool_size > size:
            kept = next((sg for sg in self.subgroups if sg.stage in KEPT), None)
            if kept is None:
                break
            self.write_back(kept)
            self.wait_writes()  # the kept one's write has landed: its buffer is free to give up
            self.release(kept)
            self.resize(size)

    def give_back(self) -> None:
        """Under memory pressure, between steps: every transfer landed, kept copies newer than
        their files written back, and every buffer beyond :data:`PRESSURE_BUFFERS` freed."""
        self.wait_all()  # the writes behind the last step land first: a buffer is written back once
        for sg in self.subgroups:
            if sg.stage in DIRTY:
                self.write_back(sg)
        self.wait_writes()  # the dirty copies are on storage before their buffers go
        for sg in self.subgroups:
            self.release(sg)
        self.resize(min(self.pool_size, PRESSURE_BUFFERS))

    def take_back(self, depth: int) -> None:
        """Memory is back: the working buffers of prefetch ``depth`` and the read-ahead budget's."""
        self.resize(staging_buffers(depth) + self.read_ahead_buffers)

    # -- a step's reads --------------------------------------------------------------------------

    def begin_step(self, order: Sequence[int]) -> SwapPass:
        """The step's pass over the swapped subgroups ``order``, with the reads ahead started
        since the last step (during backward) as its first reads."""
        swaps = SwapPass.of(order)
        swaps.reads, self._early_reads = self._early_reads, {}
        return swaps

    def prefetch(self, swaps: SwapPass, upto: int) -> None:
        """Start reads for positions up to ``upto`` of ``swaps``, while buffers are free."""
        while swaps.next_read < len(swaps.order) and swaps.next_read <= upto:
            sg = self.subgroups[swaps.order[swaps.next_read]]
            if isinstance(sg.home, Swapped) and sg.home.staged is None:
                buf = self.try_acquire(lambda: self.victims(swaps, after=swaps.next_read))
                if buf is None:
                    return
                self._load(sg, buf, swaps)
            swaps.next_read += 1

    def stage(self, sg: Subgroup, swaps: SwapPass) -> StateBuffer:
        """The staging buffer holding ``sg``'s state, read now if no read started: waits for its
        read (raising its failure)."""
        fut = swaps.reads.pop(sg.index, None)
        if fut is None and sg.staged is None:
            self._load(sg, self.acquire(lambda: self.victims(swaps, exclude=sg)), swaps)
            fut = swaps.reads.pop(sg.index, None)
        if fut is not None:
            t0 = time.perf_counter()
            try:
                fut.result()  # the state is in the buffer before the update reads it
            except BaseException:
                self.release(sg)
                raise
            swaps.read_wait_s += time.perf_counter() - t0
            swaps.misses += 1
        elif sg.stage in KEPT:
            swaps.hits += 1
        return sg.swap.take()  # read into, or kept in, its buffer

    def write_now(self, sg: Subgroup, sources: Sequence[torch.Tensor]) -> None:
        """Replace ``sg``'s state on storage with ``sources`` (master, exp_avg, exp_avg_sq), waiting
        for the write; a staged copy is dropped (no transfer in flight)."""
        self.release(sg)
        buf = StateBuffer(sg.numel, pin=False)
        for dst, src in zip((buf.master, buf.exp_avg, buf.exp_avg_sq), sources):
            dst.copy_(src)
        sg.swap.file.path.write(sg.swap.file, buf).result()  # on storage before the load returns

    def abort(self, swaps: SwapPass) -> None:
        """After an error in the step: every transfer finishes, and reads nobody will check are
        put back."""
        self._drop_reads(swaps.reads)
        self.wait_writes()  # no write still reads a buffer the caller may free

    def victims(self, swaps: SwapPass, after: int = -1, exclude: Subgroup | None = None) -> list[Subgroup]:
        """Subgroups whose staged copies may give up their buffers for a subgroup needed at
        position ``after`` of ``swaps``: those needed later than it, the one needed last first.
        Those done this step are needed next step, in the reverse order."""
        n = len(swaps.order)

        def need(sg: Subgroup) -> int:
            k = swaps.position[sg.index]
            return k if k >= swaps.current else 2 * n - 1 - k

        cands = [sg for sg in self.subgroups if sg.stage in KEPT and sg is not exclude and sg.index in swaps.position]
        return sorted((sg for sg in cands if need(sg) > after), key=need, reverse=True)

    def _load(self, sg: Subgroup, buf: StateBuffer, swaps: SwapPass) -> None:
        """``sg`` into ``buf``: its first state made there, or a read of its file started."""
        home = sg.swap
        home.load(buf)
        buf.bind(sg.numel)
        if sg.fresh:
            sg.start_state(buf)
        else:
            swaps.reads[sg.index] = home.file.path.read(home.file, buf)

    # -- the write-backs ---------------------------------------------------------------------------

    def write_back(self, sg: Subgroup) -> None:
        """Start writing ``sg``'s staged state to its file (the next one, after a restripe)."""
        target, buf = sg.swap.write()
        try:
            fut = target.path.write(target, buf)
        except BaseException:
            sg.swap.write_unsent()
            raise
        self.writes.append((sg, fut))
        if (on_landed := self._on_write_landed) is not None:
            # In an I/O thread: its buffer may take the next read ahead (none after a flush until the next step).
            fut.add_done_callback(lambda _: on_landed() if self._reads_on_landing else None)

    def _finish(self, sg: Subgroup, fut: Future[None]) -> None:
        """A write-back that has landed (or is waited for now): the subgroup keeps its buffer as
        a clean copy; if it failed, the state stays in the buffer as host-resident state."""
        try:
            fut.result()
        except StorageIOError as e:
            # Nothing is lost: the subgroup stays in this buffer, now as host-resident state.
            self.failures.append(e)
            self.pool_size -= 1
            sg.home = sg.swap.write_failed()
            return
        except BaseException:
            sg.swap.write_unsent()  # an unexpected error, raised: the copy stays staged and dirty
            raise
        if (left := sg.swap.landed()) is not None:  # restriped: its state is in its next file now
            left.path.remove_file(left)

    def reap(self) -> None:
        """Finish the write-backs that have landed, without waiting."""
        for entry in [w for w in self.writes if w[1].done()]:
            self.writes.remove(entry)
            self._finish(*entry)

    def wait_write(self, sg: Subgroup) -> None:
        """Wait for exactly ``sg``'s write-back (behind the last step), if one is in flight."""
        if sg.stage is not Stage.WRITING:
            return
        entry = next(w for w in self.writes if w[0] is sg)
        self.writes.remove(entry)
        self._finish(*entry)

    def wait_writes(self) -> None:
        """Wait for every write-back (without overlap, each step waits for its own); failures are
        recorded and keep their state in memory."""
        while self.writes:
            self._finish(*self.writes.popleft())

    def raise_write_failure(self) -> None:
        """Raise the first write that failed since the last call (its state stayed in memory)."""
        if self.failures:
            err, self.failures = self.failures[0], []
            raise err

    # -- between steps -----------------------------------------------------------------------------

    def read_ahead(self, order: Sequence[int]) -> int:
        """Start reading the swapped subgroups of the next step's ``order``, first ones first, into
        free buffers and those of copies needed later than each, without waiting. Returns the reads
        started; they become the next step's first reads."""
        if not self.swaps:
            return 0
        swaps = SwapPass.of(order)
        self.prefetch(swaps, len(swaps.order))  # those staged already (read ahead, kept) are passed over
        self._early_reads.update(swaps.reads)
        return len(swaps.reads)

    def step_ended(self) -> None:
        """The step's writes are under way: each one landing may read ahead again (after a flush)."""
        self._reads_on_landing = True

    def flush(self) -> None:
        """Wait for the writes (raising the first that failed) and the reads ahead (their buffers
        keep what they read, as clean copies); read nothing more ahead as writes land."""
        self._reads_on_landing = False
        self.wait_writes()  # the files hold every update before flush() returns
        for i, fut in self._early_reads.items():
            sg = self.subgroups[i]
            try:
                fut.result()  # the read has filled its buffer: a clean copy from now on
                sg.swap.read_landed()
            except BaseException:
                self.release(sg)  # read again by the step, which reports the failure
        self._early_reads = {}
        self.raise_write_failure()

    def wait_all(self) -> None:
        """No transfer in flight once it returns: the write-behind landed, the reads ahead put
        back (what a checkpoint, a state load, a knob change or a device release needs before it
        touches the state)."""
        self.wait_writes()  # no write in flight: the files and buffers may change
        self._drop_reads(self._early_reads)

    def _drop_reads(self, reads: dict[int, Future[None]]) -> None:
        """Let ``reads`` land, unchecked, and put their buffers back; ``reads`` is emptied."""
        for i, fut in reads.items():
            with contextlib.suppress(BaseException):
                fut.result()  # landed (or failed) before its buffer goes back
            self.release(self.subgroups[i])
        reads.clear()

    def close(self) -> None:
        """At the engine's close: reads ahead put back, and every write-back landed (failures
        ignored: the files go with their paths)."""
        self._drop_reads(self._early_reads)
        with contextlib.suppress(Exception):
            self.wait_writes()  # no write in flight when the paths close


def host_state(sg: Subgroup) -> StateBuffer:
    """``sg``'s state in host memory, to read, at a step boundary (no transfer in flight): where
    it lives (its first state made there), its staged copy, or a copy read from its file now (a
    copy of its first state when it has none yet)."""
    if isinstance(sg.home, InHost):
        sg.start_state(sg.home.buffer)
        return sg.home.buffer
    home = sg.swap
    if home.staged is not None:
        return home.staged.buffer
    buf = StateBuffer(sg.numel, pin=False)
    if sg.fresh:
        first_state(sg.binding, buf)  # a copy to read: the subgroup's own first state is made at its update
    else:
        home.file.path.read(home.file, buf).result()  # the copy is whole before it is read
    return buf
