"""Measure this machine into a :class:`perf.profile.Profile`.

Each measurement returns schema objects whose figures say how and when they were taken, and
reports progress through a callback ``progress(what, done, total)`` or a ``rich`` Progress.

- storage paths: O_DIRECT sequential reads, writes, and both at once, through the engine's own
  I/O backend (``engine.storage.io_backends``, aio or posix), over a sweep of requests in flight (the
  engine's per-path ``io_concurrency`` knob) and request sizes (the engine's 8 MiB chunk, and a
  smaller one). Paths on one device are measured once: they share its bandwidth.
- host: memory copy bandwidth, and fused CPU AdamW params/s by thread count (the faster of the
  engine's two host kernels, as ``engine.adamw.select_host_kernel`` picks).
- CUDA (when present): pinned H2D and D2H alone and at once, fused AdamW on the GPU, memory.
- identity: CPU model, cores, memory, NUMA nodes, GPUs (pynvml), the device behind each path.
"""

from __future__ import annotations

import contextlib
import os
import platform
import socket
import statistics
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, replace
from datetime import datetime, timezone
from typing import TYPE_CHECKING, Callable, Iterable, Literal, Sequence

import psutil
import torch

from engine.adamw import AdamWHyper, AdamWSlices, adamw_update_torch_, measure_host_kernels
from engine.buffers import aligned_empty
from engine.config import EngineConfig
from engine.errors import ConfigError, StoragePathError
from engine.host_kernel import select_host_kernel
from engine.layout import ALIGN_BYTES
from engine.storage.blockdev import device_of
from engine.storage.io_backends import open_backend
from engine.storage.swapdir import make_swap_dir, remove_swap_dir
from engine.storage.usable import check_usable
from perf.nvml import open_nvml
from perf.profile import SCHEMA_VERSION, AdamWRate, Figure, Gpu, Host, Machine, PathProfile, Profile, Source, SweepPoint

if TYPE_CHECKING:
    from rich.progress import Progress, TaskID

ProgressFn = Callable[[str, int, int], None]
"""``progress(what, done, total)``: ``done`` of ``total`` steps of the measurement ``what``."""

ENGINE_CHUNK_BYTES = EngineConfig().io_chunk_bytes
SWEEP_CONCURRENCY = (1, 2, 4, 8, 16)
SWEEP_BLOCKS = (ENGINE_CHUNK_BYTES, 1 << 20)


@dataclass(frozen=True)
class ProbeSizes:
    """How much each measurement moves and how long it may take."""

    io_bytes: int
    """Data file per path (at most an eighth of the free space is used)."""
    io_seconds: float
    """Time of one sweep point."""
    memcpy_bytes: int
    adamw_numel: int
    reps: int
    gpu_bytes: int
    gpu_adamw_numel: int


FULL = ProbeSizes(
    io_bytes=8 << 30,
    io_seconds=3.0,
    memcpy_bytes=1 << 30,
    adamw_numel=1 << 24,
    reps=7,
    gpu_bytes=1 << 30,
    gpu_adamw_numel=1 << 26,
)
QUICK = ProbeSizes(
    io_bytes=1 << 30,
    io_seconds=0.5,
    memcpy_bytes=256 << 20,
    adamw_numel=1 << 24,
    reps=5,
    gpu_bytes=256 << 20,
    gpu_adamw_numel=1 << 24,
)


def now_iso() -> str:
    return datetime.now(timezone.utc).isoformat(timespec="seconds")


def _sig(v: float) -> float:
    """Four significant digits: more would be noise, and files stay readable."""
    return float(f"{v:.4g}")


def _size(n: float) -> str:
    for unit, s in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= s:
            return f"{n / s:.4g} {unit}"
    return f"{n:g} B"


def as_progress(progress: "ProgressFn | Progress | None") -> ProgressFn:
    """A callback from ``progress``: a callback, a ``rich.progress.Progress`` (one bar per
    measurement), or None (silent)."""
    if progress is None:
        return lambda what, done, total: None
    if callable(progress):  # a Progress is not
        return progress
    tasks: dict[str, TaskID] = {}

    def update(what: str, done: int, total: int) -> None:
        if what not in tasks:
            tasks[what] = progress.add_task(what, total=total)
        progress.update(tasks[what], completed=done, total=total)

    return update


# -- identity -------------------------------------------------------------------------------------


def cpu_model() -> str:
    with contextlib.suppress(OSError):
        with open("/proc/cpuinfo") as f:
            for line in f:
                key, _, value = line.partition(":")
                if key.strip() in ("model name", "Processor", "cpu model") and value.strip():
                    return value.strip()
    return platform.processor() or platform.machine() or "unknown"


def numa_nodes() -> int:
    try:
        return max(1, sum(1 for e in os.listdir("/sys/devices/system/node") if e.startswith("node") and e[4:].isdigit()))
    except OSError:
        return 1


def nvml_gpus() -> list[tuple[str, int]]:
    """(model, memory bytes) of each NVIDIA GPU; empty without a driver."""
    opened = open_nvml()
    if opened is None:
        return []
    nvml, handles = opened
    try:
        out = []
        for h in handles:
            name = nvml.nvmlDeviceGetName(h)
            out.append((name.decode() if isinstance(name, bytes) else name, int(nvml.nvmlDeviceGetMemoryInfo(h).total)))
        return out
    finally:
        nvml.nvmlShutdown()


def probe_machine() -> Machine:
    gpus = nvml_gpus()
    logical = psutil.cpu_count(logical=True) or os.cpu_count() or 1
    return Machine(
        hostname=socket.gethostname(),
        cpu_model=cpu_model(),
        cores_physical=psutil.cpu_count(logical=False) or logical,
        cores_logical=logical,
        memory_bytes=psutil.virtual_memory().total,
        numa_nodes=numa_nodes(),
        gpu_model=", ".join(dict.fromkeys(name for name, _ in gpus)),
        gpu_count=len(gpus),
    )


# -- storage paths --------------------------------------------------------------------------------


class _Cursor:
    """Next request offset of one stream of sequential requests, wrapping at the file's end."""

    def __init__(self, size: int, start: int = 0) -> None:
        self.size, self.pos = size, start
        self._lock = threading.Lock()

    def take(self, block: int) -> int:
        with self._lock:
            if self.pos + block > self.size:
                self.pos = 0
            off = self.pos
            self.pos += block
            return off


class _Stream:
    """``concurrency`` threads each keeping one request in flight until told to stop."""

    def __init__(self, op: Literal["read", "write"], cursor: _Cursor, buffers: list[torch.Tensor]) -> None:
        self.op, self.cursor, self.buffers = op, cursor, buffers
        self.bytes = 0
        self._lock = threading.Lock()

    def worker(self, backend, fd: int, filename: str, buf: torch.Tensor, stop: threading.Event) -> None:
        io = backend.pread if self.op == "read" else backend.pwrite
        n = buf.numel()
        while True:  # at least one request, however short the point
            io(fd, filename, buf, self.cursor.take(n))
            with self._lock:
                self.bytes += n
            if stop.is_set():
                return


def _run_streams(pool: ThreadPoolExecutor, backend, fd: int, filename: str, streams: list[_Stream], seconds: float) -> float:
    """Run ``streams`` at once for ``seconds``; the elapsed time until the last request is done."""
    stop = threading.Event()
    t0 = time.perf_counter()
    try:
        futs = [pool.submit(s.worker, backend, fd, filename, buf, stop) for s in streams for buf in s.buffers]
        stop.wait(seconds)
    finally:  # also on Ctrl-C, so that the workers end and the pool can shut down
        stop.set()
    for f in futs:
        f.result()
    return time.perf_counter() - t0


def _group_key(path: str) -> str:
    info = device_of(path)
    return info.name if info.is_block else info.device_id


def measure_path(
    path: str,
    kind: Literal["nvme", "remote"] = "nvme",
    *,
    io_bytes: int = FULL.io_bytes,
    io_seconds: float = FULL.io_seconds,
    concurrencies: Sequence[int] = SWEEP_CONCURRENCY,
    block_sizes: Sequence[int] = SWEEP_BLOCKS,
    backend: str = "auto",
    progress: "ProgressFn | Progress | None" = None,
) -> PathProfile:
    """Sweep O_DIRECT reads, writes and mixed traffic on ``path`` over ``concurrencies`` x
    ``block_sizes``; each point runs ``io_seconds`` over a data file of ``io_bytes`` (at most an
    eighth of the free space). Usable alone, e.g. by benchmarks."""
    report = as_progress(progress)
    if not concurrencies or not block_sizes or any(not (isinstance(c, int) and c >= 1) for c in concurrencies):
        raise ConfigError(
            f"measure_path needs concurrencies of 1 or more and at least one block size, got "
            f"{list(concurrencies)} and {list(block_sizes)}"
        )
    for b in block_sizes:
        if b <= 0 or b % ALIGN_BYTES:
            raise ConfigError(f"block size {b} must be a positive multiple of {ALIGN_BYTES} (O_DIRECT)")
    check_usable(path)
    path = os.path.abspath(path)
    info = device_of(path)
    fs = os.statvfs(path)
    free = fs.f_bavail * fs.f_frsize
    unit = 2 * max(block_sizes)  # mixed traffic starts its reads and writes half a file apart
    if io_bytes < unit:
        raise ConfigError(
            f"the probe file ({io_bytes} bytes) must hold at least two of the largest requests "
            f"({_size(max(block_sizes))}): give at least {_size(unit)}"
        )
    size = min(io_bytes, free // 8) // unit * unit
    if size < unit:
        raise StoragePathError(
            f"storage path {path} has {free} bytes free, too little to measure it with "
            f"{_size(max(block_sizes))} requests (an eighth of the free space is used): free space there"
        )
    io = open_backend(backend)
    what = f"I/O sweep {path}"
    steps = 1 + 3 * len(block_sizes) * len(concurrencies)
    report(what, 0, steps)
    max_c = max(concurrencies)
    d = make_swap_dir(path)  # removed below, or after a crash by the next engine on this path
    filename = os.path.join(d, "probe.dat")
    pool = ThreadPoolExecutor(2 * max_c, thread_name_prefix="offloadctl-probe")
    sweep: list[SweepPoint] = []
    fd = None
    try:
        fd = os.open(filename, os.O_RDWR | os.O_CREAT | os.O_DIRECT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
        os.posix_fallocate(fd, 0, size)
        # Incompressible data: some devices compress or skip zeros.
        noise = torch.randint(0, 256, (max(block_sizes),), dtype=torch.uint8, generator=torch.Generator().manual_seed(0))
        bufs = {b: [aligned_empty(b, pin=False).copy_(noise[:b]) for _ in range(2 * max_c)] for b in block_sizes}
        # Fill the file first: reading never-written (fallocated) blocks returns zeros without I/O.
        big = max(block_sizes)
        with ThreadPoolExecutor(max_c) as fill_pool:
            list(fill_pool.map(lambda off: io.pwrite(fd, filename, bufs[big][0], off), range(0, size, big)))
        report(what, 1, steps)
        # Streams continue where the previous point stopped, so each point touches new data.
        rc, wc = _Cursor(size), _Cursor(size, size // 2)
        done = 1
        backend_name = io.name
        for block in block_sizes:
            for c in concurrencies:
                for op in ("write", "read", "mixed"):
                    held = bufs[block]
                    if op == "mixed":
                        r, w = _Stream("read", rc, held[:c]), _Stream("write", wc, held[c : 2 * c])
                        streams = [r, w]
                    else:
                        streams = [_Stream("read", rc, held[:c]) if op == "read" else _Stream("write", wc, held[:c])]
                    elapsed = _run_streams(pool, io, fd, filename, streams, io_seconds)
                    moved = sum(s.bytes for s in streams)
                    how = (
                        f"O_DIRECT {'reads and writes at once' if op == 'mixed' else op + 's'} ({backend_name} backend), "
                        f"{_size(block)} requests, {c} in flight{' each' if op == 'mixed' else ''}, "
                        f"{_size(moved)} in {elapsed:.2f} s over a {_size(size)} file"
                    )
                    if op == "mixed":
                        how += f" (read {streams[0].bytes / elapsed:.3g} B/s + write {streams[1].bytes / elapsed:.3g} B/s)"
                    sweep.append(
                        SweepPoint(
                            op=op,
                            concurrency=c,
                            block_bytes=block,
                            bytes_per_s=Figure(value=_sig(moved / elapsed), how=how, when=now_iso()),
                        )
                    )
                    done += 1
                    report(what, done, steps)
    except OSError as e:
        raise StoragePathError(
            f"measuring storage path {path} failed ({e.strerror or e}) with a {size} byte probe "
            f"file: free space there, or check the device behind it (dmesg)"
        ) from None
    finally:
        pool.shutdown(wait=True)
        if fd is not None:
            os.close(fd)
        remove_swap_dir(d)
    best = {op: max((s for s in sweep if s.op == op), key=lambda s: s.bytes_per_s.value) for op in ("read", "write", "mixed")}

    def summary(op: str) -> Figure:
        s = best[op]
        return replace(s.bytes_per_s, how=f"best point of the sweep: {s.bytes_per_s.how}")

    return PathProfile(
        path=path,
        kind=kind,
        device=info.name,
        device_id=info.device_id,
        capacity_bytes=free,
        read_bytes_per_s=summary("read"),
        write_bytes_per_s=summary("write"),
        mixed_bytes_per_s=summary("mixed"),
        best_concurrency=best_concurrency(sweep),
        sweep=tuple(sweep),
    )


def best_concurrency(sweep: Iterable[SweepPoint], block_bytes: int | None = None) -> int:
    """Smallest concurrency whose read and write are both within 5% of the best, at the
    engine's chunk size (or ``block_bytes``; else the block size measured most)."""
    sweep = list(sweep)
    blocks = {s.block_bytes for s in sweep}
    block = block_bytes if block_bytes in blocks else (ENGINE_CHUNK_BYTES if ENGINE_CHUNK_BYTES in blocks else max(blocks))
    pts = [s for s in sweep if s.block_bytes == block]
    by_c: dict[int, dict[str, float]] = {}
    for s in pts:
        by_c.setdefault(s.concurrency, {})[s.op] = s.bytes_per_s.value
    top = {op: max(v.get(op, 0.0) for v in by_c.values()) for op in ("read", "write")}
    for c in sorted(by_c):
        if all(by_c[c].get(op, 0.0) >= 0.95 * top[op] for op in ("read", "write")):
            return c
    return max(by_c)


def measure_paths(paths: Sequence[tuple[str, Literal["nvme", "remote"]]], *, progress=None, **kw) -> tuple[PathProfile, ...]:
    """Measure each path, once per device: later paths on a measured device copy its figures
    (with their own path, free space and device id), since they share its bandwidth."""
    for p, _ in paths:
        check_usable(p)  # every path before minutes of measuring
    done: dict[str, PathProfile] = {}
    out = []
    for p, kind in paths:
        key = _group_key(p)
        if key in done:
            first = done[key]
            info = device_of(p)
            fs = os.statvfs(p)
            note = f"same device as {first.path} ({first.device}), measured there once: "
            out.append(
                replace(
                    first,
                    path=os.path.abspath(p),
                    kind=kind,
                    device_id=info.device_id,
                    capacity_bytes=fs.f_bavail * fs.f_frsize,
                    read_bytes_per_s=replace(first.read_bytes_per_s, how=note + first.read_bytes_per_s.how),
                    write_bytes_per_s=replace(first.write_bytes_per_s, how=note + first.write_bytes_per_s.how),
                    mixed_bytes_per_s=replace(first.mixed_bytes_per_s, how=note + first.mixed_bytes_per_s.how),
                )
            )
            continue
        done[key] = measure_path(p, kind, progress=progress, **kw)
        out.append(done[key])
    return tuple(out)


# -- host -----------------------------------------------------------------------------------------


def measure_memory_bandwidth(
    nbytes: int = FULL.memcpy_bytes, reps: int = FULL.reps, *, progress: "ProgressFn | Progress | None" = None
) -> Figure:
    """Host memory copy bandwidth (bytes copied per second) of a large torch copy."""
    report = as_progress(progress)
    what = "host memory bandwidth"
    src = torch.ones(nbytes, dtype=torch.uint8)
    dst = torch.empty_like(src)
    dst.copy_(src)  # warm-up: page faults out of the timing
    times = []
    for i in range(reps):
        report(what, i, reps)
        t0 = time.perf_counter()
        dst.copy_(src)
        times.append(time.perf_counter() - t0)
    report(what, reps, reps)
    value = _sig(nbytes / statistics.median(times))
    if (
        hasattr(os, "sched_getaffinity")
        and len(os.sched_getaffinity(0)) >= (os.cpu_count() or 1)
        and torch.get_num_threads() >= (os.cpu_count() or 1)
    ):
        # Every core copied: the node's figure, kept for the runs' lane balance (read plus written).
        from engine.host_kernel import keep_node_memory_bandwidth

        keep_node_memory_bandwidth(2 * value)
    return Figure(
        value=value, when=now_iso(), how=f"torch copy_ of {_size(nbytes)}, {torch.get_num_threads()} threads, median of {reps}"
    )


def thread_counts(max_threads: int) -> list[int]:
    """1, 2, 4, ... below ``max_threads``, then ``max_threads``."""
    out, t = [], 1
    while t < max_threads:
        out.append(t)
        t *= 2
    return out + [max_threads]


def available_cores() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # pragma: no cover - not Linux
        return os.cpu_count() or 1


def measure_host_kernel_rates(
    threads: Sequence[int] | None = None,
    numel: int = FULL.adamw_numel,
    reps: int = FULL.reps,
    *,
    progress: "ProgressFn | Progress | None" = None,
) -> tuple[AdamWRate, ...]:
    """The bare host AdamW kernel's params/s (``host.adamw``; the lane's is :func:`measure_host_lane`)
    at each thread count (default: powers of two up to the cores this process may use), the
    faster of the engine's kernels at each. Restores the thread count."""
    report = as_progress(progress)
    threads = sorted(set(threads or thread_counts(available_cores())))
    what = "CPU AdamW by threads"
    before = torch.get_num_threads()
    out = []
    try:
        for i, t in enumerate(threads):
            report(what, i, len(threads))
            torch.set_num_threads(t)
            rates = measure_host_kernels(numel, reps)
            best = max(rates, key=rates.__getitem__)
            kernels = ", ".join(f"{k} {v:.3g}" for k, v in rates.items())
            out.append(
                AdamWRate(
                    threads=t,
                    params_per_s=Figure(
                        value=_sig(rates[best]),
                        when=now_iso(),
                        how=f"fused AdamW on {numel} fp32 params, {t} thread{'s' if t > 1 else ''}, median of {reps}; "
                        f"best kernel: {best} ({kernels})",
                    ),
                )
            )
    finally:
        torch.set_num_threads(before)
    report(what, len(threads), len(threads))
    return tuple(out)


def measure_host_lane(
    numel: int = FULL.adamw_numel, reps: int = FULL.reps, *, progress: "ProgressFn | Progress | None" = None
) -> Figure:
    """The engine's host lane as a ZeRO-3 step runs it, all threads, with the kernel the engine
    takes (:func:`engine.host_kernel.time_host_lane`: bf16 gradients unscaled, fused AdamW, bf16
    weights uploaded to the GPU asynchronously, or in host memory without one). Median of ``reps``."""
    from engine.host_kernel import LANE_SUBGROUPS, time_host_lane
    from engine.streams import streams_for

    report = as_progress(progress)
    what = "host lane (integrated)"
    report(what, 0, 1)
    dev = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")
    name, kernel = select_host_kernel("auto", device_lane=dev.type == "cuda")
    rate = time_host_lane({name: kernel}, numel, reps, streams=streams_for(dev))[name]
    report(what, 1, 1)
    where = "uploaded to the GPU" if dev.type == "cuda" else "in host memory"
    part = max(1, numel // LANE_SUBGROUPS)
    return Figure(
        value=_sig(rate),
        when=now_iso(),
        how=f"engine host lane ({name} kernel, {torch.get_num_threads()} threads) on {LANE_SUBGROUPS} x {part} params: "
        f"bf16 gradient upcast and unscaled, fused AdamW, bf16 weights {where}; median of {reps}",
    )


# -- CUDA -----------------------------------------------------------------------------------------


def measure_gpu(
    nbytes: int = FULL.gpu_bytes,
    adamw_numel: int = FULL.gpu_adamw_numel,
    reps: int = FULL.reps,
    *,
    progress: "ProgressFn | Progress | None" = None,
) -> Gpu | None:
    """Pinned H2D and D2H bandwidth, alone and at once (two streams), and fused AdamW on the
    current CUDA device; None without CUDA."""
    if not torch.cuda.is_available():
        return None
    report = as_progress(progress)
    what = "GPU transfers and AdamW"
    dev = torch.device("cuda", torch.cuda.current_device())
    h_in = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True).fill_(1)
    h_out = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    d_in = torch.empty(nbytes, dtype=torch.uint8, device=dev)
    d_out = torch.ones(nbytes, dtype=torch.uint8, device=dev)
    streams = [torch.cuda.Stream(dev), torch.cuda.Stream(dev)]

    def timed(copies: list[tuple[torch.Tensor, torch.Tensor]]) -> list[float]:
        """Median seconds of each copy, all started together on their own streams."""
        times: list[list[float]] = [[] for _ in copies]
        for rep in range(reps + 1):  # the first is a warm-up
            torch.cuda.synchronize(dev)
            events = []
            for stream, (dst, src) in zip(streams, copies):
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                with torch.cuda.stream(stream):
                    start.record()
                    dst.copy_(src, non_blocking=True)
                    end.record()
                events.append((start, end))
            torch.cuda.synchronize(dev)
            if rep:
                for k, (start, end) in enumerate(events):
                    times[k].append(start.elapsed_time(end) / 1e3)
        return [statistics.median(t) for t in times]

    def fig(seconds: float, how: str) -> Figure:
        return Figure(value=_sig(nbytes / seconds), when=now_iso(), how=f"{how}, {_size(nbytes)} pinned, median of {reps}")

    report(what, 0, 4)
    h2d = fig(timed([(d_in, h_in)])[0], "host to device copy alone")
    report(what, 1, 4)
    d2h = fig(timed([(h_out, d_out)])[0], "device to host copy alone")
    report(what, 2, 4)
    both = timed([(d_in, h_in), (h_out, d_out)])
    duplex_h2d = fig(both[0], "host to device copy while a device to host copy runs (two streams)")
    duplex_d2h = fig(both[1], "device to host copy while a host to device copy runs (two streams)")
    report(what, 3, 4)
    del h_in, h_out, d_in, d_out
    t = [torch.rand(adamw_numel, device=dev) for _ in range(4)]
    s = AdamWSlices([t[0]], [t[1]], [t[2]], [t[3]], [torch.tensor(1.0, device=dev)])
    hp = AdamWHyper(lr=1e-6)
    adamw_update_torch_(s, hp)  # warm-up
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        adamw_update_torch_(s, hp)
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    adamw = Figure(
        value=_sig(adamw_numel / statistics.median(times)),
        when=now_iso(),
        how=f"torch._fused_adamw_ on {adamw_numel} fp32 params resident on the GPU, median of {reps}",
    )
    del t, s
    torch.cuda.empty_cache()
    report(what, 4, 4)
    props = torch.cuda.get_device_properties(dev)
    return Gpu(
        model=props.name,
        memory_bytes=int(props.total_memory),
        h2d_bytes_per_s=h2d,
        d2h_bytes_per_s=d2h,
        duplex_h2d_bytes_per_s=duplex_h2d,
        duplex_d2h_bytes_per_s=duplex_d2h,
        adamw_params_per_s=adamw,
    )


# -- all of it ------------------------------------------------------------------------------------


def measure_profile(
    name: str,
    *,
    nvme: Sequence[str] = (),
    remote: Sequence[str] = (),
    quick: bool = False,
    sizes: ProbeSizes | None = None,
    backend: str = "auto",
    tool: str = "",
    progress: "ProgressFn | Progress | None" = None,
) -> Profile:
    """Measure everything into a profile named ``name`` (``source.kind = "measured"``)."""
    sizes = sizes or (QUICK if quick else FULL)
    paths: list[tuple[str, Literal["nvme", "remote"]]] = [(p, "nvme") for p in nvme] + [(p, "remote") for p in remote]
    seen: set[str] = set()
    for p, _ in paths:
        ap = os.path.abspath(p)
        if ap in seen:
            raise ConfigError(f"storage path {ap} is given twice; give each directory once")
        seen.add(ap)
    machine = probe_machine()
    path_profiles = measure_paths(paths, io_bytes=sizes.io_bytes, io_seconds=sizes.io_seconds, backend=backend, progress=progress)
    host = Host(
        memory_bandwidth=measure_memory_bandwidth(sizes.memcpy_bytes, sizes.reps, progress=progress),
        adamw=measure_host_kernel_rates(numel=sizes.adamw_numel, reps=sizes.reps, progress=progress),
        host_lane_params_per_s=measure_host_lane(sizes.adamw_numel, sizes.reps, progress=progress),
    )
    gpu = measure_gpu(sizes.gpu_bytes, sizes.gpu_adamw_numel, sizes.reps, progress=progress)
    mode = "--quick" if quick else "full"
    return Profile(
        schema_version=SCHEMA_VERSION,
        name=name,
        source=Source(kind="measured", description=f"measured on {machine.hostname} ({mode} run)", tool=tool),
        machine=machine,
        host=host,
        paths=path_profiles,
        gpu=gpu,
        created=now_iso(),
    )
