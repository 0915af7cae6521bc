"""A storage path as a tier: validation, swap files, and parallel O_DIRECT transfers.

``SwapPath.read`` and ``SwapPath.write`` move one subgroup's state between a
:class:`StateBuffer` and its swap file and return a ``Future``. A transfer is split into
chunks (:class:`ChunkPlan`) that run on the path's I/O threads, at most ``concurrency`` reads
and ``concurrency`` writes at a time, paced by the path's bandwidth cap, and under the node lock when it is on.
"""

from __future__ import annotations

import contextlib
import errno
import itertools
import os
import threading
import time
import weakref
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Iterator

import torch

from engine.buffers import StateBuffer
from engine.config import StoragePath
from engine.errors import CorruptSwapFileError, StorageIOError, StoragePathError
from engine.layout import HEADER_BYTES, STATE_BYTES_PER_ELEMENT
from engine.storage import swapfile
from engine.storage.io_backends import DeepSpeedAIO, PosixDirectIO, ShortFileError
from engine.storage.limits import NodeLock, RateLimiter, ResizableSemaphore
from engine.storage.swapdir import make_swap_dir, remove_stale_swap_dirs, remove_swap_dir
from engine.storage.usable import check_usable as check_usable  # callers import it from here too

MAX_IO_THREADS = 64


@dataclass
class SwapFile:
    """One subgroup's file on one path, and what was last written to it."""

    path: "SwapPath"
    filename: str
    fd: int
    index: int
    numel: int
    plan: swapfile.ChunkPlan
    generation: int = 0  # 0: never written
    crcs: list[int] = field(default_factory=list)


@dataclass
class PathCounters:
    """Cumulative traffic of one path; the engine takes differences per step.

    The busy times are wall time with at least one request of that direction in the device's
    hands (the union of their intervals, not their sum), so bytes over busy time is the rate
    the path serves at now, whatever the gaps between requests; the queue wait is the sum over
    requests of the time spent waiting for a slot (the concurrency limit) or the node lock."""

    bytes_read: int = 0
    bytes_written: int = 0
    read_busy_s: float = 0.0
    write_busy_s: float = 0.0
    queue_wait_s: float = 0.0


class _BusyClock:
    """The union of one direction's request intervals on a path (see :class:`PathCounters`)."""

    def __init__(self) -> None:
        self.in_flight = 0
        self.since = 0.0

    def enter(self, now: float) -> None:
        if self.in_flight == 0:
            self.since = now
        self.in_flight += 1

    def leave(self, now: float) -> float:
        """Seconds to add to the busy time: the interval that just ended, if none is left in flight."""
        self.in_flight -= 1
        return now - self.since if self.in_flight == 0 else 0.0

    def running(self, now: float) -> float:
        """The busy interval still open at ``now`` (0 when idle), for a reading taken mid-interval."""
        return now - self.since if self.in_flight else 0.0


class SwapPath:
    """One storage path in use by this process."""

    def __init__(
        self,
        spec: StoragePath,
        backend: PosixDirectIO | DeepSpeedAIO,
        *,
        concurrency: int,
        node_lock: bool,
        verify_checksums: bool,
        rank: int = 0,
    ) -> None:
        self.spec = spec
        self.backend = backend
        self.verify_checksums = verify_checksums
        check_usable(spec.path)
        self.stale_dirs_removed = remove_stale_swap_dirs(spec.path)
        self.dir = make_swap_dir(spec.path, rank)
        # Removes the directory on close() or at interpreter exit, whichever comes first.
        self._finalizer = weakref.finalize(self, remove_swap_dir, self.dir)
        # Reads and writes each have their own slots, so a burst of write-backs never starves
        # the prefetches the update loop is waiting for (and the reverse).
        self.read_slots = ResizableSemaphore(concurrency)
        self.write_slots = ResizableSemaphore(concurrency)
        self.node_lock = NodeLock(spec.path, enabled=node_lock)
        self.read_pacer = RateLimiter(spec.cap_bytes_per_s)
        self.write_pacer = RateLimiter(spec.cap_bytes_per_s)
        self.counters = PathCounters()
        self._counter_lock = threading.Lock()
        self._busy = {"r": _BusyClock(), "w": _BusyClock()}
        # Chunks run on a pool per direction; whole-subgroup transfers wait on them from
        # _transfer_pool, so a waiting transfer never occupies a chunk thread, and a burst of
        # write chunks never queues ahead of a read's.
        self._chunk_pools = {d: ThreadPoolExecutor(MAX_IO_THREADS, thread_name_prefix=f"offload-io-{d}") for d in "rw"}
        # Transfers are numbered as they start, and each chunk takes its slot in that order.
        self._transfer_numbers = itertools.count()
        self._transfer_pool = ThreadPoolExecutor(MAX_IO_THREADS, thread_name_prefix="offload-xfer")
        self._files: list[SwapFile] = []

    @property
    def path(self) -> str:
        return self.spec.path

    def set_limits(self, *, concurrency: int, node_lock: bool) -> None:
        """Apply knobs; call only while no transfer is in flight."""
        self.read_slots.set_limit(concurrency)
        self.write_slots.set_limit(concurrency)
        self.node_lock.enabled = node_lock

    def free_bytes(self) -> int:
        fs = os.statvfs(self.spec.path)
        return fs.f_bavail * fs.f_frsize

    def create_file(self, index: int, numel: int, payload_bytes: int, chunk_bytes: int) -> SwapFile:
        """Create and fully allocate the swap file of subgroup ``index``."""
        plan = swapfile.ChunkPlan.for_payload(payload_bytes, chunk_bytes)
        filename = os.path.join(self.dir, f"sg{index:06d}.swp")
        # O_NOFOLLOW: a link in the swap directory is never followed (engine/storage/swapdir.py).
        fd = os.open(filename, os.O_RDWR | os.O_CREAT | os.O_DIRECT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
        try:
            # Allocating now turns a disk that is too small into an error at start, not mid-run.
            os.posix_fallocate(fd, 0, HEADER_BYTES + payload_bytes)
        except OSError as e:
            os.close(fd)
            os.unlink(filename)
            if e.errno == errno.ENOSPC:
                from engine.units import format_size

                what = "probe file (to measure its bandwidth)" if index < 0 else "swap file"
                raise StoragePathError(
                    f"storage path {self.path} is full: a {format_size(HEADER_BYTES + payload_bytes)} {what} does "
                    f"not fit in the {format_size(self.free_bytes())} free there (other processes write there too); "
                    f"free space there, add another path (--nvme), or raise --host-cache (host_cache_bytes)"
                ) from None
            raise StoragePathError(f"cannot allocate swap file {filename} ({e.strerror}): choose another path") from None
        sf = SwapFile(self, filename, fd, index, numel, plan)
        self._files.append(sf)
        return sf

    def remove_file(self, sf: SwapFile) -> None:
        os.close(sf.fd)
        with contextlib.suppress(OSError):
            os.unlink(sf.filename)
        self._files.remove(sf)

    # -- transfers ---------------------------------------------------------------------------

    def write(self, sf: SwapFile, buf: StateBuffer) -> Future[None]:
        """Write ``buf`` to ``sf``: payload chunks in parallel, then the header with their CRCs."""
        return self._transfer_pool.submit(self._write_subgroup, sf, buf, next(self._transfer_numbers))

    def read(self, sf: SwapFile, buf: StateBuffer) -> Future[None]:
        """Read ``sf`` into ``buf`` and verify it against what was last written."""
        return self._transfer_pool.submit(self._read_subgroup, sf, buf, next(self._transfer_numbers))

    def _write_subgroup(self, sf: SwapFile, buf: StateBuffer, number: int) -> None:
        buf.wait_ready()
        buf.bind(sf.numel)
        pool = self._chunk_pools["w"]
        futs = [
            pool.submit(self._write_chunk, sf, buf.payload[o : o + n], HEADER_BYTES + o, True, number)
            for o, n in sf.plan.chunks()
        ]
        crcs = _results(futs, sf, "writing")
        generation = sf.generation + 1
        swapfile.write_header(buf.header, index=sf.index, numel=sf.numel, plan=sf.plan, generation=generation, crcs=crcs)
        # The header from this thread, not queued behind the chunks of later writes: with its
        # transfer's number it takes the next free slot, and the write lands now.
        try:
            self._write_chunk(sf, buf.header, 0, False, number)
        except OSError as e:
            raise storage_error(e, sf, "writing") from e
        sf.generation, sf.crcs = generation, crcs

    def _read_subgroup(self, sf: SwapFile, buf: StateBuffer, number: int) -> None:
        buf.wait_ready()  # a device-lane copy back into this buffer has landed before it is overwritten
        buf.bind(sf.numel)
        pool = self._chunk_pools["r"]
        futs = [pool.submit(self._read_chunk, sf, buf.header, 0, False, number)]
        futs += [
            pool.submit(self._read_chunk, sf, buf.payload[o : o + n], HEADER_BYTES + o, True, number) for o, n in sf.plan.chunks()
        ]
        crcs = _results(futs, sf, "reading")[1:]
        swapfile.verify(
            buf.header,
            path=sf.filename,
            index=sf.index,
            numel=sf.numel,
            plan=sf.plan,
            generation=sf.generation,
            crcs=crcs if self.verify_checksums else None,
        )

    def _write_chunk(self, sf: SwapFile, view: torch.Tensor, offset: int, payload: bool, number: int) -> int:
        # The CRC is taken in this I/O thread, off the update's critical path.
        crc = swapfile.crc32(view) if payload else 0
        with self._request("w", number, view.numel()):
            self.backend.pwrite(sf.fd, sf.filename, view, offset)
        return crc

    def _read_chunk(self, sf: SwapFile, view: torch.Tensor, offset: int, payload: bool, number: int) -> int:
        with self._request("r", number, view.numel()):
            self.backend.pread(sf.fd, sf.filename, view, offset)
        return swapfile.crc32(view) if payload and self.verify_checksums else 0

    @contextlib.contextmanager
    def _request(self, direction: str, number: int, nbytes: int) -> Iterator[None]:
        """One request of ``direction`` ('r', 'w') of transfer ``number``, ``nbytes`` long, in the
        device's hands: its slot and the node lock taken (the wait counted), paced by the cap, and
        its bytes and busy time counted as it leaves."""
        queued = time.perf_counter()
        with (self.read_slots if direction == "r" else self.write_slots).slot(number), self.node_lock:
            now = time.perf_counter()
            with self._counter_lock:
                self.counters.queue_wait_s += now - queued
                self._busy[direction].enter(now)
            try:
                (self.read_pacer if direction == "r" else self.write_pacer).acquire(nbytes)
                yield
            finally:  # it left the device
                now = time.perf_counter()
                with self._counter_lock:
                    busy = self._busy[direction].leave(now)
                    if direction == "r":
                        self.counters.read_busy_s += busy
                        self.counters.bytes_read += nbytes
                    else:
                        self.counters.write_busy_s += busy
                        self.counters.bytes_written += nbytes

    def snapshot(self) -> PathCounters:
        """The counters now, the busy intervals still open counted up to now (a step's reading)."""
        now = time.perf_counter()
        with self._counter_lock:
            c = self.counters
            return PathCounters(
                c.bytes_read,
                c.bytes_written,
                c.read_busy_s + self._busy["r"].running(now),
                c.write_busy_s + self._busy["w"].running(now),
                c.queue_wait_s,
            )

    def close(self) -> None:
        for pool in self._chunk_pools.values():
            pool.shutdown(wait=True)
        self._transfer_pool.shutdown(wait=True)
        for sf in list(self._files):
            os.close(sf.fd)
        self._files.clear()
        self._finalizer()


def _results(futs: list[Future[int]], sf: SwapFile, doing: str) -> list[int]:
    """Results of every chunk; after all have finished, the first failure as a clear error."""
    out: list[int] = []
    first_error: OSError | None = None
    for f in futs:
        try:
            out.append(f.result())
        except OSError as e:
            first_error = first_error or e
    if first_error is not None:
        raise storage_error(first_error, sf, doing) from first_error
    return out


def storage_error(e: OSError, sf: SwapFile, doing: str) -> StorageIOError | CorruptSwapFileError:
    if isinstance(e, ShortFileError):
        return CorruptSwapFileError(
            f"swap file {sf.filename} was truncated ({e.strerror}): the swap file was changed "
            f"outside offloadctl; restore from your last checkpoint"
        )
    fixes: dict[int | None, str] = {
        errno.ENOSPC: f"free space on {sf.path.path} or give the state another path",
        errno.EDQUOT: f"raise your quota on {sf.path.path} or give the state another path",
        errno.EFBIG: "raise the file-size limit (ulimit -f) or use a smaller subgroup_numel",
        errno.EIO: f"check the device behind {sf.path.path} (dmesg) and resume from your last checkpoint",
        errno.EROFS: f"{sf.path.path} went read-only (dmesg says why): resume from your last checkpoint on a writable path",
    }
    fix = fixes.get(e.errno, "check the storage path and resume from your last checkpoint")
    kept = " The state is still in host memory." if doing == "writing" else ""
    return StorageIOError(
        f"{doing} optimizer state of subgroup {sf.index} in {sf.filename} failed ({e.strerror or e}): {fix}.{kept}"
    )


def measure_bandwidth(path: SwapPath, nbytes: int = 64 << 20) -> tuple[float, float]:
    """Quick O_DIRECT probe of ``path``: (read bytes/s, write bytes/s) through its own I/O threads.

    Uses at most an eighth of the free space, so that probing never fills a small disk.
    """
    nbytes = max(1 << 20, min(nbytes, path.free_bytes() // 8))
    numel = nbytes // STATE_BYTES_PER_ELEMENT
    buf = StateBuffer(numel, pin=False)
    buf.payload.fill_(1)
    sf = path.create_file(-1, numel, buf.payload.numel(), 4 << 20)
    try:
        t0 = time.perf_counter()
        path.write(sf, buf).result()
        t1 = time.perf_counter()
        path.read(sf, buf).result()
        t2 = time.perf_counter()
    finally:
        path.remove_file(sf)
    moved = buf.file_image.numel()
    return moved / (t2 - t1), moved / (t1 - t0)
