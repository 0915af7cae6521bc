"""The host lane (:class:`HostLane`): AdamW on state in host memory, in chunks.

In chunks of ``HOST_CHUNK_NUMEL`` elements: a chunk's gradient is upcast and unscaled into a
scratch buffer that stays in the cores' caches, the fused kernel updates the chunk, and its new
master is cast into the model's 16-bit weights while still in cache. So the gradient is read once
from memory, the state once read and once written, and nothing is allocated per step. With
torch's kernel and more than one thread, the lane's threads each update their own part of a
subgroup (:class:`LaneThreads`).

Weights on a GPU go up chunk by chunk through a few pinned chunk-sized buffers, each copy
asynchronous on the upload stream (:class:`WeightUploader`): the CPU casts the next chunk while
the last one crosses PCIe, and a subgroup's last upload is one chunk, whatever its size.
Gradients on a GPU (``OffloadAdamW`` with the model there) come down the same way
(:class:`GradReader`): the next chunk's copy runs while the CPU updates this one. The lanes
together: :mod:`engine.lanes` and ``docs/engine.md``.
"""

from __future__ import annotations

import contextlib
import queue
import threading
from typing import Callable, Iterator

import torch

from engine.adamw import AdamWHyper, AdamWSlices, DeepSpeedCpuAdam, HostKernel, adamw_update_torch_
from engine.binding import SubgroupBinding, flat_weights_of, weight_views_of, weights_written
from engine.buffers import StateBuffer, aligned_empty
from engine.lanes import Scratch, SubgroupGrads, step_tensor
from engine.streams import Event, Stream, Streams

HOST_CHUNK_NUMEL = 1 << 21
"""Elements per host-lane chunk when one thread drives the lane and every op is a parallel region
of the process's OpenMP threads: 8 MB of fp32 gradient, small enough to stay in the caches between
its upcast and the kernel, large enough that per-call overhead is noise (~1%)."""
PART_CHUNK_NUMEL = 1 << 19
"""Elements per chunk when the lane's threads each update their own part (:class:`LaneThreads`),
and on a process's one thread (no team: the per-call overhead is a thread's alone): 2 MB of fp32
gradient, a core's L2 cache, where the new master is still when it is cast (12-17% faster than
:data:`HOST_CHUNK_NUMEL` on one core, either kernel); :data:`LOCK_CHUNK_NUMEL` where the
interpreter lock binds (:func:`part_chunk_numel`)."""
LOCK_CHUNK_NUMEL = 1 << 21
"""Elements per part chunk where the interpreter lock binds: 4x fewer Python-level calls a part."""
LOCK_SHARE_LIMIT = 0.25
"""The share of a chunk's time that the lane's threads together may spend in per-chunk Python
overhead (which holds the interpreter lock) before the lock binds: above it, each thread waits
for the others' overhead between its chunks, and the parts run in series for that long."""


def part_chunk_numel(threads: int, overhead_s: float, chunk_s: float) -> int:
    """The part chunk for ``threads`` threads, from one thread's measured per-chunk overhead
    (``overhead_s``: the chunk's ops on a few elements) and time of a :data:`PART_CHUNK_NUMEL`
    chunk (``chunk_s``): :data:`LOCK_CHUNK_NUMEL` where ``threads`` x overhead is more than
    :data:`LOCK_SHARE_LIMIT` of a chunk's time (at 16 threads, about 90 us of calls against
    2 ms of work a chunk, issue 47), else :data:`PART_CHUNK_NUMEL` (the L2-sized chunk)."""
    if threads <= 1 or chunk_s <= 0:
        return PART_CHUNK_NUMEL
    return LOCK_CHUNK_NUMEL if threads * overhead_s > LOCK_SHARE_LIMIT * chunk_s else PART_CHUNK_NUMEL


def measure_chunk_costs(numel: int = PART_CHUNK_NUMEL, reps: int = 3) -> tuple[float, float]:
    """(overhead, chunk) seconds of one host-lane chunk's ops on the calling thread: the upcast
    of a bf16 gradient, the unscale, torch's fused kernel (the one the lane runs in parts) and
    the weight cast, on 16 elements (the
    per-chunk calls alone: the best of 20) and on ``numel`` (the best of ``reps``). From
    ``torch.empty``/``zeros`` only: no generator moves."""
    import time

    hyper = AdamWHyper(lr=1e-3)
    state = torch.zeros(3 * numel)
    src, weights, scratch = (
        torch.zeros(numel, dtype=torch.bfloat16),
        torch.empty(numel, dtype=torch.bfloat16),
        Scratch(torch.device("cpu")),
    )
    step = torch.full((), 1.0)

    def chunk(n: int) -> float:
        t0 = time.perf_counter()
        g = scratch.get(n)
        g.copy_(src[:n], non_blocking=True)
        g.mul_(0.5)
        adamw_update_torch_(
            AdamWSlices([state[:n]], [g], [state[numel : numel + n]], [state[2 * numel : 2 * numel + n]], [step]), hyper
        )
        weights[:n].copy_(state[:n])
        return time.perf_counter() - t0

    chunk(numel)  # first touch of the buffers
    overhead = min(chunk(16) for _ in range(20))
    return overhead, min(chunk(numel) for _ in range(reps))


_OWN_THREADS: list[Callable[[int], object] | None] = []  # [omp_set_num_threads or None], found once
_Task = tuple[int, Callable[[int], None]]
"""What a lane thread runs: ``fn(k)``, its part ``k`` of a subgroup."""


def own_thread_count() -> Callable[[int], object] | None:
    """The OpenMP runtime's ``omp_set_num_threads`` (torch's own libgomp, or Intel's or LLVM's
    where torch runs on one), which sets the calling thread's count alone; None where it is not
    found. ``torch.set_num_threads`` also sets torch's process-wide default, from which every
    thread takes its count at its first op: a thread starting meanwhile would keep that count."""
    if not _OWN_THREADS:
        fn: Callable[[int], object] | None = None
        try:
            with open("/proc/self/maps") as f:
                libs = {line.split()[-1] for line in f if "omp" in line and ".so" in line}
            for path in sorted(libs):
                if any(k in path.rsplit("/", 1)[-1] for k in ("libgomp", "libiomp", "libomp")):
                    import ctypes

                    lib = ctypes.CDLL(path)
                    fn = lib.omp_set_num_threads
                    fn.argtypes, fn.restype = [ctypes.c_int], None
                    break
        except (OSError, AttributeError):
            fn = None
        _OWN_THREADS.append(fn)
    return _OWN_THREADS[0]


class LaneThreads:
    """The host lane's threads when a subgroup is updated in parts: the caller and workers, each
    running its torch ops on its own thread alone (an OpenMP team of one) over a contiguous part
    of the subgroup, chunk by chunk, and meeting once per subgroup.

    Why: with one thread driving the lane, every op of every chunk (upcast, unscale, kernel,
    weight cast) is a parallel region that ends in a barrier of all the process's OpenMP threads,
    a few hundred a step. When anything else is runnable on the rank's cores (the recorder's
    sampler, the launcher, I/O threads, another tenant), each barrier waits for its descheduled
    thread: on 2 busy cores the update of a 9e7-parameter partition took 2-3 times stock
    DeepSpeed's, whose CPU Adam runs one region per subgroup. In parts, a descheduled thread
    delays only its own part (BENCHMARKS.md, "host-path overhead"). The workers block on a queue
    between steps and use no CPU there."""

    def __init__(self) -> None:
        self._queues: list[queue.SimpleQueue[_Task | None]] = []
        self._done: queue.SimpleQueue[BaseException | None] = queue.SimpleQueue()
        self.chunk_costs: tuple[float, float] | None = None  # measure_chunk_costs on a worker, once

    def chunk_numel(self, parts: int) -> int:
        """The part chunk for ``parts`` threads (:func:`part_chunk_numel`), from costs measured
        once, on a worker (one thread, as the parts run), at the lane's first update in parts."""
        if self.chunk_costs is None:
            self._grow(1)
            out: list[tuple[float, float]] = []
            self._queues[0].put((0, lambda _k: out.append(measure_chunk_costs())))
            err = self._done.get()
            if err is not None:
                raise err
            self.chunk_costs = out[0]
        return part_chunk_numel(parts, *self.chunk_costs)

    def run(self, n: int, fn: Callable[[int], None]) -> None:
        """``fn(k)`` for k in 0..n-1: 0 on the calling thread, the others on workers; raises the
        first error once every part has ended. The caller's part runs on it alone by its own
        OpenMP count (:func:`own_thread_count`), never by torch's process-wide default: a thread
        whose first op came while the default was 1 would keep one thread for good. Where the
        OpenMP runtime is not found, part 0 runs on a worker too and the caller waits."""
        own = own_thread_count()
        on_caller = 1 if own is not None else 0
        self._grow(n - on_caller)
        for k in range(on_caller, n):
            self._queues[k - on_caller].put((k, fn))
        first: BaseException | None = None
        if own is not None:  # on_caller
            threads = torch.get_num_threads()
            own(1)  # the caller's part on it alone too; no other thread's count changes
            try:
                fn(0)
            except BaseException as e:  # the workers' parts end first: their buffers are in use
                first = e
            finally:
                own(threads)
        for _ in range(on_caller, n):
            err = self._done.get()
            if err is not None and first is None:
                first = err
        if first is not None:
            raise first

    def _grow(self, workers: int) -> None:
        if len(self._queues) >= workers:
            return
        threads = torch.get_num_threads()
        # The caller's CUDA device (a rank's): a new thread starts on device 0.
        cuda = torch.cuda.current_device() if torch.cuda.is_available() and torch.cuda.is_initialized() else None  # type: ignore[no-untyped-call]  # torch
        for i in range(len(self._queues), workers):
            q: queue.SimpleQueue[_Task | None] = queue.SimpleQueue()
            ready = threading.Event()
            threading.Thread(target=self._serve, args=(q, ready, cuda), name=f"offloadctl-host-lane-{i + 1}", daemon=True).start()
            ready.wait()
            self._queues.append(q)
        if own_thread_count() is None:
            # A worker's set_num_threads(1) also set torch's default for threads started later:
            # put back the caller's count (its own OpenMP setting never changed).
            torch.set_num_threads(threads)

    def _serve(self, q: queue.SimpleQueue[_Task | None], ready: threading.Event, cuda: int | None) -> None:
        own = own_thread_count()
        # torch sets a thread's count up at its first op, from the process-wide default: asking
        # now sets this one up; then it runs on one thread (no team, no barrier), set for this
        # thread alone where the runtime is found, else through torch's default (put back by
        # _grow once the workers are up).
        if own is not None:
            torch.get_num_threads()
            own(1)
        else:
            torch.set_num_threads(1)
            torch.get_num_threads()
        if cuda is not None:
            torch.cuda.set_device(cuda)
        ready.set()
        while True:
            item = q.get()
            if item is None:
                return
            k, fn = item
            try:
                fn(k)
                self._done.put(None)
            except BaseException as e:
                self._done.put(e)

    def close(self) -> None:
        for q in self._queues:
            q.put(None)
        self._queues = []


def host_update(
    buf: StateBuffer,
    binding: SubgroupBinding,
    steps: list[int],
    hyper: AdamWHyper,
    kernel: HostKernel,
    scratch: Scratch,
    weights: "WeightUploader | None" = None,
    reader: "GradReader | None" = None,
    lane_threads: "LaneThreads | None" = None,
    part_scratch: "list[Scratch] | None" = None,
) -> int:
    """One AdamW step of a subgroup whose state is in host memory, chunk by chunk (module
    docstring). Slices without a gradient keep their state and step, as torch AdamW skips
    them. Gradients on the device come down through ``reader``, a chunk ahead. With
    ``lane_threads`` (and gradients in host memory), ``torch.get_num_threads()`` threads each
    update a contiguous part in chunks of :meth:`LaneThreads.chunk_numel`, on one thread each, into their
    own ``part_scratch``. Returns the slices updated."""
    buf.wait_ready()  # a device-lane copy back into this buffer (before a knob change) has landed
    grads = SubgroupGrads(binding, steps)
    if not grads.runs:
        return 0
    per_slice, offsets, scale = grads.per_slice, grads.offsets, grads.scale
    master, exp_avg, exp_avg_sq = buf.master, buf.exp_avg, buf.exp_avg_sq
    g0 = per_slice[0] if len(per_slice) == 1 else None
    direct = (  # the one gradient, read in place (fp32 on the host already, nothing to unscale), or None
        g0
        if g0 is not None and scale == 1.0 and g0.dtype == torch.float32 and g0.device.type == "cpu" and g0.is_contiguous()
        else None
    )
    if reader is not None and direct is None and reader.on_device(grads):
        reader.begin()
    else:
        reader = None
    parts = torch.get_num_threads() if lane_threads is not None and reader is None else 1
    sink = weights.begin(binding) if weights is not None else None
    if sink is not None:  # slices not updated: their weights as they are
        covered = 0
        for i, j in grads.runs:
            if offsets[i] > covered:
                sink.write(covered, offsets[i], master[covered : offsets[i]])
            covered = offsets[j]
        if covered < binding.numel:
            sink.write(covered, binding.numel, master[covered : binding.numel])
    if isinstance(kernel, DeepSpeedCpuAdam) and kernel.fused and reader is None and parts == 1 and fusable(grads, sink):
        for i, j in grads.runs:  # each run in one call: the op's threads take its tiles
            a, b = offsets[i], offsets[j]
            kernel.fused_step(
                steps[i] + 1,
                hyper,
                (master[a:b], exp_avg[a:b], exp_avg_sq[a:b]),
                [(lo - a, grads.source(k, lo, hi, g)) for k, lo, hi, g in grads.slices_in(a, b)],
                scale,
                [] if sink is None else sink.host_targets(a, b),
            )
        return finish_update(grads, steps, binding, master, sink)
    if parts > 1 and lane_threads is not None and sum(offsets[j] - offsets[i] for i, j in grads.runs) > PART_CHUNK_NUMEL:
        chunk_numel = lane_threads.chunk_numel(parts)  # measured at the first update with more than one part
    elif parts > 1:
        chunk_numel = PART_CHUNK_NUMEL  # one part chunk at most: one part
    elif torch.get_num_threads() > 1:
        chunk_numel = HOST_CHUNK_NUMEL  # one thread drives the lane, an OpenMP team in each op
    else:
        chunk_numel = min(HOST_CHUNK_NUMEL, PART_CHUNK_NUMEL)  # no team: the L2-sized chunk
    chunks = [(i, a, min(offsets[j], a + chunk_numel)) for i, j in grads.runs for a in range(offsets[i], offsets[j], chunk_numel)]
    step_of = {i: step_tensor(steps[i] + 1, master.device) for i, _ in grads.runs}

    def update(part: int, mine: list[tuple[int, int, int]], scratch: Scratch) -> None:
        ahead = reader.fetch(grads, mine[0][1], mine[0][2]) if reader is not None and mine else None
        for n, (i, a, b) in enumerate(mine):
            if direct is not None:
                g = direct[a:b]
            else:
                g = scratch.get(b - a)
                if reader is not None:
                    handle, ahead = (
                        ahead,
                        (reader.fetch(grads, mine[n + 1][1], mine[n + 1][2]) if n + 1 < len(mine) else None),
                    )  # the next chunk's copy runs meanwhile
                    assert handle is not None  # this chunk's, fetched a chunk ahead
                    reader.gather(handle, g, grads, a, b)
                else:  # the gradient elements [a, b), across slices, upcast into the scratch
                    for k, lo, hi, src in grads.slices_in(a, b):
                        g[lo - a : hi - a].copy_(grads.source(k, lo, hi, src), non_blocking=True)
                if scale != 1.0:
                    g.mul_(scale)  # DeepSpeed's math: fp32 gradient * (1 / combined scale)
            kernel(AdamWSlices([master[a:b]], [g], [exp_avg[a:b]], [exp_avg_sq[a:b]], [step_of[i]]), hyper)
            if sink is not None:
                sink.write(a, b, master[a:b], part)  # cast while the chunk is in cache

    parts = max(1, min(parts, len(chunks)))
    if parts == 1:
        update(0, chunks, scratch)
    else:
        assert lane_threads is not None and part_scratch is not None  # more than one part: the lane's threads
        while len(part_scratch) < parts:
            part_scratch.append(Scratch(torch.device("cpu")))
        bounds = [len(chunks) * k // parts for k in range(parts + 1)]
        lane_threads.run(parts, lambda k: update(k, chunks[bounds[k] : bounds[k + 1]], part_scratch[k]))
    return finish_update(grads, steps, binding, master, sink)


def finish_update(
    grads: SubgroupGrads, steps: list[int], binding: SubgroupBinding, master: torch.Tensor, sink: "WeightSink | None"
) -> int:
    """Count the step and write the weights no chunk wrote; the slices updated."""
    updated = grads.advance(steps)
    if sink is not None:
        sink.finish(master)
    else:
        binding.write_weights(master)
    return updated


FUSED_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
"""The gradient and weight dtypes the fused step reads and writes."""


def fusable(grads: SubgroupGrads, sink: "WeightSink | None") -> bool:
    """Whether the fused step (``engine/csrc/host_fused.cpp``) can update this subgroup: its
    gradients and its weights (those written in place; the others are written at the sink's
    finish) flat tensors in host memory of a dtype it knows. Weights uploaded to a device go
    through the chunked lane, whose uploads overlap the casts."""
    for g in grads.per_slice:
        if g is not None and (g.device.type != "cpu" or not g.is_contiguous() or g.dtype not in FUSED_DTYPES):
            return False
    if sink is None:
        return True
    return all(t is None or (in_place and t.is_contiguous() and t.dtype in FUSED_DTYPES) for _, _, t, in_place in sink.targets)


class WeightSink:
    """Where one subgroup's updated weights go, chunk by chunk (see :class:`WeightUploader`):
    ``targets`` are (lo, hi, view) ranges of the subgroup, each a flat tensor written in place
    (host memory) or uploaded; a view of None (a parameter that is not contiguous: its elements
    are no flat range of its memory) is written whole through the binding at :meth:`finish`."""

    def __init__(
        self, uploader: "WeightUploader", binding: SubgroupBinding, targets: list[tuple[int, int, torch.Tensor | None]]
    ) -> None:
        self.uploader, self.binding = uploader, binding
        self.targets = [(lo, hi, t, t is not None and uploader.streams.in_host_memory(t)) for lo, hi, t in targets]

    def write(self, a: int, b: int, master_chunk: torch.Tensor, part: int = 0) -> None:
        for lo, hi, target, in_place in self.targets:
            x, y = max(a, lo), min(b, hi)
            if x >= y or target is None:
                continue
            src = master_chunk[x - a : y - a]
            if in_place:
                target[x - lo : y - lo].copy_(src)
            else:
                self.uploader.upload(target, x - lo, src, part)

    def host_targets(self, a: int, b: int) -> list[tuple[int, torch.Tensor]]:
        """(offset from ``a``, view) of each in-place target's elements within [a, b): what the
        fused step writes (:func:`fusable` checked that every target is in place or None)."""
        out = []
        for lo, hi, target, in_place in self.targets:
            x, y = max(a, lo), min(b, hi)
            if x < y and target is not None and in_place:
                out.append((x - a, target[x - lo : y - lo]))
        return out

    def finish(self, master: torch.Tensor) -> None:
        for lo, hi, target, _ in self.targets:
            if target is None:
                self.binding.write_weights(master[lo:hi], lo)
        weights_written(self.binding)


class PinnedRing:
    """``slots`` pinned host buffers of ``slot_bytes`` each, taken in turn: taking one waits (a
    blocking event: the thread sleeps) until the copy last queued on it is done. Pinned all at
    once, at the first use, so that no buffer grows or is pinned inside a later step. Each slot
    keeps one event, recorded again for each copy (:meth:`record`): no new event per chunk."""

    def __init__(self, slots: int, slot_bytes: int) -> None:
        self.n, self.slot_bytes = slots, slot_bytes
        self._bufs: list[torch.Tensor] = []
        self._events: list[Event | None] = [None] * slots  # the slot's one event, made at its first copy
        self._pending = [False] * slots  # a copy recorded on it that take() has not waited for
        self._next = 0

    def take(self) -> tuple[int, torch.Tensor]:
        if not self._bufs:
            self._bufs = [aligned_empty(self.slot_bytes, pin=True) for _ in range(self.n)]
        k, self._next = self._next, (self._next + 1) % self.n
        if self._pending[k] and (ev := self._events[k]) is not None:
            ev.synchronize()  # its last copy is done with it
            self._pending[k] = False
        return k, self._bufs[k]

    def record(self, k: int, streams: Streams, stream: Stream) -> Event:
        """Mark slot ``k``'s copy just queued on ``stream``: its event, recorded again."""
        ev = self._events[k] = streams.record(stream, self._events[k])
        self._pending[k] = True
        return ev

    @property
    def nbytes(self) -> int:
        return sum(b.numel() for b in self._bufs)


UPLOAD_SLOTS = 3
"""Pinned chunk buffers of the weight uploads: the CPU casts into one while the others' copies run."""


class WeightUploader:
    """Gets the host lane's updated weights into the model's flat weights.

    A flat weight tensor in host memory is written in place. One in device memory is written
    chunk by chunk (``chunk_numel`` elements) through :data:`UPLOAD_SLOTS` pinned chunk buffers
    per host-lane thread (each thread its own: no lock between them): the thread casts a chunk
    into one, its asynchronous copy runs on ``stream`` (the upload stream, which the engine joins
    to the caller's stream at the end of the step) while the next chunk is cast. The pinned
    memory is a few chunks per thread whatever the subgroup size, and a subgroup's last copy is
    one chunk. Bindings without a flat weight tensor (``OffloadAdamW``) fall back to their
    ``write_weights``.
    """

    def __init__(self, streams: Streams, chunk_numel: int = PART_CHUNK_NUMEL) -> None:
        self.streams = streams
        self.stream = streams.new_stream()
        self.chunk_numel = chunk_numel
        self._rings: dict[int, PinnedRing] = {}  # per host-lane thread (its part number)

    def begin(self, binding: SubgroupBinding) -> WeightSink | None:
        """The subgroup's sink: its flat weights, else its weight views (``OffloadAdamW``'s
        parameters, :func:`engine.binding.weight_views_of`); None: through ``write_weights``."""
        target = flat_weights_of(binding)
        if target is not None:
            return WeightSink(self, binding, [(0, binding.numel, target)])
        views = weight_views_of(binding)
        return None if views is None else WeightSink(self, binding, views)

    @staticmethod
    def pinned_bytes(threads: int = 1, chunk_numel: int = PART_CHUNK_NUMEL) -> int:
        """Host memory of the pinned chunk buffers of ``threads`` host-lane threads, once weights
        on a device have been written."""
        return threads * UPLOAD_SLOTS * 4 * chunk_numel

    def host_bytes(self) -> int:
        """Host memory of the pinned chunk buffers (allocated when first needed)."""
        return sum(r.nbytes for r in self._rings.values())

    def upload(self, target: torch.Tensor, offset: int, master: torch.Tensor, part: int = 0) -> None:
        """``master`` (fp32, in host memory) cast into ``target[offset:]`` on the device, a chunk
        at a time through host-lane thread ``part``'s pinned buffers."""
        ring = self._rings.get(part)
        if ring is None:  # 4 bytes an element: any weight dtype
            ring = self._rings[part] = PinnedRing(UPLOAD_SLOTS, 4 * self.chunk_numel)
        n, size = master.numel(), target.element_size()
        for a in range(0, n, self.chunk_numel):
            b = min(n, a + self.chunk_numel)
            k, raw = ring.take()
            staging = raw[: (b - a) * size].view(target.dtype)
            staging.copy_(master[a:b])  # the cast, on the CPU, while the last chunk crosses PCIe
            with self.streams.use(self.stream):
                self.streams.copy(target[offset + a : offset + b], staging)
                ring.record(k, self.streams, self.stream)


READ_SLOTS = 2
"""Pinned chunk buffers of the gradient reads: one being read by the CPU, one being copied into."""


class GradReader:
    """Gets gradients that live on the device into the host lane, chunk by chunk: each chunk's
    device slices are copied into one of :data:`READ_SLOTS` pinned chunk buffers on ``stream``,
    the next chunk's copy issued before this one is read, so that the copy runs while the CPU
    updates (a pageable destination would make every chunk a synchronous copy). The stream
    first waits for the caller's stream, where backward produced them."""

    def __init__(self, streams: Streams, chunk_numel: int = HOST_CHUNK_NUMEL) -> None:
        self.streams = streams
        self.stream = streams.new_stream()
        self._ring = PinnedRing(READ_SLOTS, 4 * chunk_numel)

    def host_bytes(self) -> int:
        return self._ring.nbytes

    def on_device(self, grads: "SubgroupGrads") -> bool:
        return any(g is not None and not self.streams.in_host_memory(g) for g in grads.per_slice)

    def begin(self) -> None:
        self.stream.wait_stream(self.streams.current())  # after backward's work that produced them

    def fetch(self, grads: "SubgroupGrads", a: int, b: int) -> tuple[Event, dict[int, torch.Tensor]]:
        """Start copying the device slices of elements [a, b) down; the handle for :meth:`gather`."""
        k, raw = self._ring.take()
        views, off = {}, 0
        with self.streams.use(self.stream):
            for i, lo, hi, g in grads.slices_in(a, b):
                if self.streams.in_host_memory(g):
                    continue
                size = g.element_size()
                off = -(-off // size) * size
                dst = raw[off : off + (hi - lo) * size].view(g.dtype)
                self.streams.copy(dst, grads.source(i, lo, hi, g))
                views[i] = dst
                off += (hi - lo) * size
            event = self._ring.record(k, self.streams, self.stream)
        return event, views

    @staticmethod
    def gather(handle: tuple[Event, dict[int, torch.Tensor]], out: torch.Tensor, grads: "SubgroupGrads", a: int, b: int) -> None:
        """Elements [a, b) of the gradient into ``out`` (fp32): the fetched slices once their copy
        has landed, the ones in host memory read where they are."""
        event, views = handle
        if views:
            event.synchronize()  # this chunk's copy down (a blocking event: the thread sleeps)
        for i, lo, hi, g in grads.slices_in(a, b):
            out[lo - a : hi - a].copy_(views[i] if i in views else grads.source(i, lo, hi, g))


class HostLane:
    """Updates state in host memory with the faster fused CPU AdamW kernel. With torch's kernel
    and more than one thread, the lane's threads update each subgroup in parts
    (:class:`LaneThreads`); DeepSpeed's kernel runs its own OpenMP threads and is driven by one."""

    def __init__(self, kernel_name: str, kernel: HostKernel, weights: WeightUploader, grads: GradReader | None = None) -> None:
        self.kernel_name, self.kernel = kernel_name, kernel
        self.weights = weights
        self.grads = grads if grads is not None else GradReader(weights.streams)
        self._grad = Scratch(torch.device("cpu"))
        self._parts: list[Scratch] = []
        self._threads = LaneThreads() if kernel_name == "torch" else None

    def update(self, buf: StateBuffer, binding: SubgroupBinding, steps: list[int], hyper: AdamWHyper) -> int:
        return host_update(
            buf, binding, steps, hyper, self.kernel, self._grad, self.weights, self.grads, self._threads, self._parts
        )

    def close(self) -> None:
        """Stop the lane's worker threads (they are made again if the lane runs once more)."""
        if self._threads is not None:
            self._threads.close()

    @staticmethod
    def scratch_bytes(numel: int) -> int:
        """Host memory of the gradient scratch for subgroups of up to ``numel`` elements: one
        chunk, or one part chunk per thread (the larger one where the interpreter lock binds,
        which is measured at the first update: counted here before it)."""
        threads = torch.get_num_threads()
        part = LOCK_CHUNK_NUMEL if threads > 1 else PART_CHUNK_NUMEL
        return 4 * min(numel, max(HOST_CHUNK_NUMEL, threads * part))

    @staticmethod
    def start_bytes(numel: int, weights_on_device: bool) -> int:
        """Host memory the lane takes for subgroups of up to ``numel`` elements: its gradient
        scratch and, with the weights on a device, its uploads' pinned chunk buffers."""
        uploads = WeightUploader.pinned_bytes(torch.get_num_threads()) if weights_on_device else 0
        return HostLane.scratch_bytes(numel) + uploads

    def host_bytes(self) -> int:
        """Host memory the lane holds besides the state: its gradient scratch, the pinned chunk
        buffers of the weight uploads and the gradient reads."""
        return self._grad.nbytes + sum(s.nbytes for s in self._parts) + self.weights.host_bytes() + self.grads.host_bytes()


@contextlib.contextmanager
def threads_left_to_io(io_cores: int) -> Iterator[None]:
    """Within: ``io_cores`` fewer of this process's threads for the host lane (at least one), left
    to the I/O threads' checksums while swapped state moves (``EngineConfig.io_cores`` says why).
    The calling thread's count alone (:func:`own_thread_count`; torch's process-wide default only
    where the OpenMP runtime is not found): a thread whose first op comes within keeps its count."""
    threads = torch.get_num_threads()
    if not io_cores or threads <= 1:
        yield
        return
    set_count = own_thread_count() or torch.set_num_threads
    set_count(max(1, threads - io_cores))
    try:
        yield
    finally:
        set_count(threads)
