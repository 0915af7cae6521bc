"""The transfers of swapped state between its files and the staging pool (:class:`Transfers`):
the reads of a step, the reads ahead of the next one, the write-behind, which staged copies give
up their buffers, and the writes that failed.

The staging pool (:mod:`engine.staging`) holds the buffers and the writes in flight; this module
decides what is read into them, and when. What overlaps what, and why the result is exact, is
``docs/io-overlap.md``:

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
- **Failures.** A write that fails keeps its state in memory (the pool makes it host-resident);
  the next step or :meth:`Transfers.flush` raises it.
"""

from __future__ import annotations

import functools
import time
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Callable, Sequence

import torch

from engine.buffers import StateBuffer
from engine.layout import host_buffer_bytes, read_ahead_bytes, staging_buffers
from engine.placement import HOST
from engine.staging import StagingPool, Subgroup, first_state

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
    """Reads and writes of the swapped subgroups' state through ``staging``.

    ``on_write_landed`` is called (in an I/O thread) when a write-back lands and reads ahead may
    use its buffer; None without overlap. ``room_bytes`` says what the host budget leaves for
    staging buffers now. ``auto_read_ahead``: the read-ahead budget is sized once from the run
    (:meth:`size_read_ahead_once`)."""

    def __init__(
        self,
        subgroups: Sequence[Subgroup],
        staging: StagingPool,
        *,
        room_bytes: Callable[[], int],
        on_write_landed: Callable[[], object] | None,
        auto_read_ahead: bool = False,
    ) -> None:
        self.subgroups = subgroups
        self.staging = staging
        self._room_bytes = room_bytes
        self._early_reads: dict[int, Future[None]] = {}  # reads ahead, taken by the next step's pass
        self.read_ahead_buffers = 0
        """Staging buffers of the read-ahead budget, beyond the working ones."""
        self._read_ahead_unsized = auto_read_ahead
        self._reads_on_landing = True  # False after flush(): a write landing reads nothing ahead until the next step
        self._on_write_landed = on_write_landed
        if on_write_landed is not None and self.swaps:
            staging.on_landed = self._write_landed

    @property
    def swaps(self) -> bool:
        """Whether any subgroup's state goes through staging buffers."""
        return self.staging.capacity_numel > 0

    @property
    def buffer_bytes(self) -> int:
        """Host memory of one staging buffer (0 without swapped state)."""
        return self.staging.buffer_bytes

    @property
    def pool_size(self) -> int:
        """Staging buffers in the pool now."""
        return self.staging.size

    # -- the pool's size ---------------------------------------------------------------------

    def size_read_ahead(self, nbytes: int) -> int:
        """Add the read-ahead budget's buffers, ``nbytes`` in whole buffers, within the host budget
        and at most one per swapped subgroup beyond the working ones. Returns the buffers added."""
        if not self.swaps or not nbytes:
            return 0
        per = self.staging.buffer_bytes
        room = self._room_bytes() - self.staging.size * per
        swapped = sum(1 for sg in self.subgroups if sg.tier.swapped)
        n = max(0, min(-(-nbytes // per), room // per, swapped - self.staging.size))
        self.read_ahead_buffers = n
        self.staging.resize(self.staging.size + n)
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
        return self.read_ahead_buffers * self.staging.buffer_bytes

    def resize_for(self, depth: int) -> None:
        """The pool for prefetch ``depth`` (at a knob change): its working buffers, and the read-ahead
        budget's as far as the host budget's room leaves them (it yields to the working ones).
        Shrinking frees clean copies' buffers first, then writes kept ones out."""
        if not self.swaps:
            return
        room = self._room_bytes() // self.staging.buffer_bytes
        self.read_ahead_buffers = max(0, min(self.read_ahead_buffers, room - staging_buffers(depth)))
        size = staging_buffers(depth) + self.read_ahead_buffers
        if size == self.staging.size or not self.staging.size:
            return
        self.staging.resize(size)
        if self.staging.size > size:
            self.staging.release_clean(self.subgroups)
            self.staging.resize(size)
        while self.staging.size > size:
            kept = next((sg for sg in self.subgroups if sg.staged is not None and sg.kept), None)
            if kept is None:
                break
            self.staging.write_back(kept)
            self.staging.drain()  # the kept one's write has landed: its buffer is free to give up
            self.staging.release(kept)
            self.staging.resize(size)

    def shrink(self, n: int) -> None:
        """Down towards ``n`` buffers by dropping free ones (memory ran low within a step)."""
        self.staging.resize(n)

    def give_back(self) -> None:
        """Under memory pressure, between steps: every transfer landed, kept copies newer than
        their files written back, and every buffer beyond :data:`PRESSURE_BUFFERS` freed."""
        self.wait_all()  # the writes behind the last step land first: a buffer is written back once
        for sg in self.subgroups:
            if sg.staged is not None and sg.dirty:
                self.staging.write_back(sg)
        self.staging.drain()  # the dirty copies are on storage before their buffers go
        for sg in self.subgroups:
            self.staging.release(sg)
        self.staging.resize(min(self.staging.size, PRESSURE_BUFFERS))

    def take_back(self, depth: int) -> None:
        """Memory is back: the working buffers of prefetch ``depth`` and the read-ahead budget's."""
        self.staging.resize(staging_buffers(depth) + self.read_ahead_buffers)

    def host_bytes(self) -> tuple[int, int]:
        """Host memory of the pool: (buffers not holding a kept copy, buffers holding one)."""
        kept = sum(host_buffer_bytes(sg.staged.capacity_numel) for sg in self.subgroups if sg.staged is not None and sg.kept)
        return max(0, self.staging.size * self.staging.buffer_bytes - kept), kept

    def buffers(self) -> list[StateBuffer]:
        """Every buffer of the pool that is not being written: free, or holding a subgroup."""
        return self.staging.free + [sg.staged for sg in self.subgroups if sg.staged is not None]

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
            if sg.staged is None and sg.tier.swapped:
                buf = self.staging.try_acquire(lambda: self.victims(swaps, after=swaps.next_read))
                if buf is None:
                    return
                self._load(sg, buf, swaps)
            swaps.next_read += 1

    def stage(self, sg: Subgroup, swaps: SwapPass) -> StateBuffer:
        """The staging buffer holding ``sg``'s state, read now if no read started: waits for its
        read (raising its failure)."""
        fut = swaps.reads.pop(sg.index, None)
        if fut is None and sg.staged is None:
            self._load(sg, self.staging.acquire(lambda: self.victims(swaps, exclude=sg)), swaps)
            fut = swaps.reads.pop(sg.index, None)
        if fut is not None:
            t0 = time.perf_counter()
            try:
                fut.result()  # the state is in the buffer before the update reads it
            except BaseException:
                self.staging.release(sg)
                raise
            swaps.read_wait_s += time.perf_counter() - t0
            swaps.misses += 1
        elif sg.kept:
            swaps.hits += 1
        sg.kept = False
        assert sg.staged is not None  # read into, or kept in, its buffer
        return sg.staged

    def wait_write(self, sg: Subgroup) -> None:
        """Wait for exactly ``sg``'s write behind the last step, if one is in flight."""
        self.staging.wait_write(sg)

    def write_back(self, sg: Subgroup) -> None:
        """Start writing ``sg``'s updated state to its file."""
        self.staging.write_back(sg)

    def release(self, sg: Subgroup) -> None:
        """``sg``'s buffer back to the pool, unwritten (its file is current, or about to go)."""
        self.staging.release(sg)

    def write_now(self, sg: Subgroup, sources: Sequence[torch.Tensor]) -> None:
        """Replace ``sg``'s state on storage with ``sources`` (master, exp_avg, exp_avg_sq), waiting
        for the write; a staged copy is dropped (no transfer in flight)."""
        self.staging.release(sg)
        buf = StateBuffer(sg.numel, pin=False)
        for dst, src in zip((buf.master, buf.exp_avg, buf.exp_avg_sq), sources):
            dst.copy_(src)
        sg.swap_file.path.write(sg.swap_file, buf).result()  # on storage before the load returns
        sg.dirty = sg.kept = False

    def abort(self, swaps: SwapPass) -> None:
        """After an error in the step: every transfer finishes, and reads nobody will check are
        put back."""
        self._drop_reads(swaps.reads)
        swaps.reads.clear()
        self.staging.drain()  # no write still reads a buffer the caller may free

    def victims(self, swaps: SwapPass, after: int = -1, exclude: Subgroup | None = None) -> list[Subgroup]:
        """Subgroups whose staged copies may give up their buffers for a subgroup needed at
        position ``after`` of ``swaps``: those needed later than it, the one needed last first.
        Those done this step are needed next step, in the reverse order."""
        n = len(swaps.order)

        def need(sg: Subgroup) -> int:
            k = swaps.position[sg.index]
            return k if k >= swaps.current else 2 * n - 1 - k

        cands = [
            sg for sg in self.subgroups if sg.staged is not None and sg.kept and sg is not exclude and sg.index in swaps.position
        ]
        return sorted((sg for sg in cands if need(sg) > after), key=need, reverse=True)

    def _load(self, sg: Subgroup, buf: StateBuffer, swaps: SwapPass) -> None:
        """``sg`` into ``buf``: its first state made there, or a read of its file started."""
        sg.staged = buf
        buf.bind(sg.numel)
        if sg.fresh:
            sg.start_state(buf)
        else:
            swaps.reads[sg.index] = sg.swap_file.path.read(sg.swap_file, buf)

    # -- between steps -----------------------------------------------------------------------------

    def read_ahead(self, order: Sequence[int]) -> int:
        """Start reading the swapped subgroups of the next step's ``order``, first ones first, into
        free buffers and those of copies needed later than each, without waiting. Returns the reads
        started; they become the next step's first reads."""
        if not self.swaps:
            return 0
        swaps = SwapPass.of(order)
        started = 0
        for k, i in enumerate(swaps.order):
            sg = self.subgroups[i]
            if sg.staged is not None or i in self._early_reads:
                continue  # in memory already (kept, a clean copy, being written, or read)
            buf = self.staging.try_acquire(functools.partial(self.victims, swaps, after=k))
            if buf is None:
                break
            self._load(sg, buf, swaps)
            started += 1
        self._early_reads.update(swaps.reads)
        return started

    def step_ended(self) -> None:
        """The step's writes are under way: each one landing may read ahead again (after a flush)."""
        self._reads_on_landing = True

    def _write_landed(self) -> None:
        """A write-back landed (an I/O thread): its buffer may take the next read ahead."""
        if self._reads_on_landing and self._on_write_landed is not None:  # installed only with one
            self._on_write_landed()

    def flush(self) -> None:
        """Wait for the writes (raising the first that failed) and the reads ahead (their buffers
        keep what they read, as clean copies); read nothing more ahead as writes land."""
        self._reads_on_landing = False
        self.staging.drain()  # the files hold every update before flush() returns
        for i, fut in self._early_reads.items():
            sg = self.subgroups[i]
            try:
                fut.result()  # the read has filled its buffer: a clean copy from now on
                sg.kept = True  # a clean copy now
            except BaseException:
                self.staging.release(sg)  # read again by the step, which reports the failure
        self._early_reads = {}
        self.raise_write_failure()

    def wait_writes(self) -> None:
        """Wait for every write-back (without overlap, each step waits for its own)."""
        self.staging.drain()

    def reap(self) -> None:
        """Finish the write-backs that have landed, without waiting."""
        self.staging.reap()

    def raise_write_failure(self) -> None:
        """Raise the first write that failed since the last call (its state stayed in memory)."""
        if self.staging.failures:
            err, self.staging.failures = self.staging.failures[0], []
            raise err

    def wait_all(self) -> None:
        """No transfer in flight once it returns: the write-behind landed, the reads ahead put
        back (what a checkpoint, a state load, a knob change or a device release needs before it
        touches the state)."""
        self.staging.drain()  # no write in flight: the files and buffers may change
        self._drop_reads(self._early_reads)
        self._early_reads = {}

    def _drop_reads(self, reads: dict[int, Future[None]]) -> None:
        """Let ``reads`` land, unchecked, and put their buffers back."""
        for i, fut in reads.items():
            try:
                fut.result()  # landed (or failed) before its buffer goes back
            except BaseException:
                pass
            self.staging.release(self.subgroups[i])

    def close(self) -> None:
        """At the engine's close: reads ahead put back, and every write-back landed (failures
        ignored: the files go with their paths)."""
        self._drop_reads(self._early_reads)
        self._early_reads = {}
        try:
            self.staging.drain()  # no write in flight when the paths close
        except Exception:
            pass


def host_state(sg: Subgroup) -> StateBuffer:
    """``sg``'s state in host memory, to read, at a step boundary (no transfer in flight): where
    it lives (its first state made there), its staged copy, or a copy read from its file now (a
    copy of its first state when it has none yet)."""
    if sg.tier == HOST:
        sg.start_state(sg.host_buffer)
        return sg.host_buffer
    if sg.staged is not None:
        return sg.staged
    buf = StateBuffer(sg.numel, pin=False)
    if sg.fresh:
        first_state(sg.binding, buf)  # a copy to read: the subgroup's own first state is made at its update
    else:
        sg.swap_file.path.read(sg.swap_file, buf).result()  # the copy is whole before it is read
    return buf
