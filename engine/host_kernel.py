"""Which fused AdamW kernel the host lane runs, and the rate of the host lane with it.

Two kernels can run the host lane: torch's ``_fused_adamw_`` and DeepSpeed's AVX
``DeepSpeedCPUAdam``. The choice is made by timing the host lane's own loop with each (the
gradient upcast and unscale, the kernel, the 16-bit weight cast, chunk by chunk: what a ZeRO-3
step runs), not the bare kernels: two OpenMP runtimes handing over at every chunk can make the
faster kernel the slower loop. Each is timed quiet and with a process spinning beside it
(:func:`busy_beside`), and where the lane runs a team of threads the slower of the two counts: a
training rank always has other runnable work beside its update, and the two lanes differ most
there. On one thread (a rank with one core's share) there is no team to stall, and the quiet
timing chooses (:func:`choose_host_kernel`). torch's runs in per-thread
parts (``engine.host_lane.LaneThreads``); DeepSpeed's op holds the interpreter lock for a whole
call, so one thread drives it and every op is a parallel region that waits, at its barrier, for
a descheduled thread. On a 2-core VM its lane was 15% faster quiet and 14% slower beside one busy
process, and in a whole training step 1.6x slower (BENCHMARKS.md, issue 47 item 1). The same
timing is the host-lane rate the lane balance uses
(:mod:`engine.lane_model`), measured with the threads this process runs (its share of the node's
cores under ``offloadctl train``).

The two kernels round differently in the last bit. So the default, ``auto``, takes no timing
where every update runs on the host: it runs DeepSpeed's kernel wherever the op is built, the
kernel stock ZeRO-3 offload runs, so a user who switches from stock gets stock's losses bit for
bit (and torch's where it is not built). Beside a device lane, whose updates round as the GPU's
AdamW does, the losses are not stock's whichever kernel the host runs, and ``auto`` is
``fastest``: the faster lane, measured once per machine and environment and kept in a file
(``KERNEL_CHOICE_FILE``, beside the built ops): every rank, every run and every resume then takes
the same kernel, and the same seed gives the same losses. The kept rates are also the lane
balance's for either kernel.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import os
import platform
import statistics
import subprocess
import sys
import time
from typing import Any, Callable, Iterator

import torch

from engine.adamw import AdamWHyper, DeepSpeedCpuAdam, HostKernel, adamw_update_torch_, host_kernels
from engine.binding import FlatSubgroup
from engine.buffers import StateBuffer
from engine.errors import ConfigError
from engine.host_lane import HostLane, WeightUploader
from engine.storage.machine_cache import kept_fact
from engine.storage.native_ops import BUILD_HINT, extensions_dir, import_deepspeed, load_cpu_adam, load_host_fused
from engine.streams import Streams, streams_for

log = logging.getLogger(__name__)

KERNEL_CHOICE_FILE = "offloadctl-host-kernel.json"
"""Kept beside the built ops (one per environment: the same torch, DeepSpeed and compiler)."""
LANE_SUBGROUPS = 4
"""Subgroups the timed loop updates per round (so that the staging of weights alternates)."""
SPIN_S = 20.0
"""The longest the busy process of :func:`busy_beside` lives: it ends itself, so that it never
outlives a rank killed while it measures."""


@contextlib.contextmanager
def busy_beside() -> Iterator[None]:
    """A process spinning on this process's CPUs (it inherits their affinity) while the block
    runs: the other runnable work beside a rank's update (its recorder's and communication
    threads, the launcher, another tenant of a shared node). Killed at the block's end, and
    ending itself after :data:`SPIN_S` seconds whatever happens to us."""
    spin = (
        f"import sys, time\nsys.stdout.write('.'); sys.stdout.flush()\ne = time.monotonic() + {SPIN_S}\n"
        "while time.monotonic() < e: pass\n"
    )
    p = subprocess.Popen(
        [sys.executable, "-S", "-c", spin],
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        close_fds=True,
    )
    assert p.stdout is not None  # stdout=PIPE
    try:
        p.stdout.read(1)  # it spins from here
        yield
    finally:
        p.kill()
        p.wait()
        p.stdout.close()


def time_host_lane(
    kernels: dict[str, HostKernel], numel: int = 1 << 24, reps: int = 5, streams: Streams | None = None, busy: bool = True
) -> dict[str, float]:
    """Params/s of the host lane's loop with each kernel (:func:`time_host_lane_quiet_and_busy`):
    with ``busy``, the slower of the quiet and the busy rates; else the quiet one."""
    return slower_rates(*time_host_lane_quiet_and_busy(kernels, numel, reps, streams, busy))


def time_host_lane_quiet_and_busy(
    kernels: dict[str, HostKernel], numel: int = 1 << 24, reps: int = 5, streams: Streams | None = None, busy: bool = True
) -> tuple[dict[str, float], dict[str, float]]:
    """(quiet, busy) params/s of the host lane's loop with each kernel: ``LANE_SUBGROUPS``
    subgroups of ``numel / LANE_SUBGROUPS`` fp32 state with a bf16 gradient in host memory
    unscaled by 0.5 (clipping engaged) and bf16 flat weights (on ``streams``' device when it is a
    GPU, uploaded as the engine does; in host memory otherwise). Rounds alternate between kernels
    and the median is kept, so that a burst of noise does not pick the slower one; with ``busy``,
    as many rounds again :func:`busy_beside` (else the busy rates are empty)."""
    streams = streams or streams_for(torch.device("cpu"))
    # A private generator: this runs inside the user's deepspeed.initialize and must not move
    # their RNG state (dropout masks would differ from a stock run).
    gen = torch.Generator().manual_seed(0)
    part = max(1, numel // LANE_SUBGROUPS)
    weights_device = streams.device if streams.device.type == "cuda" else torch.device("cpu")
    work = []
    for _ in range(LANE_SUBGROUPS):
        b = FlatSubgroup(
            torch.zeros(part, dtype=torch.bfloat16, device=weights_device), torch.rand(part, generator=gen).to(torch.bfloat16)
        )  # host: where ZeRO-3 offload keeps them
        b.grad_scale = 0.5
        buf = StateBuffer(part)
        buf.master.copy_(torch.rand(part, generator=gen))
        buf.exp_avg.zero_()
        buf.exp_avg_sq.zero_()
        work.append((b, buf, [0]))
    hyper = AdamWHyper(lr=1e-6)
    lanes = {k: HostLane(k, kernel, WeightUploader(streams)) for k, kernel in kernels.items()}

    def one_round(lane: HostLane) -> float:
        t0 = time.perf_counter()
        for b, buf, steps in work:
            lane.update(buf, b, steps, hyper)
        lane.weights.stream.synchronize()
        return time.perf_counter() - t0

    def rounds() -> dict[str, float]:
        times: dict[str, list[float]] = {k: [] for k in lanes}
        for _ in range(reps):
            for k, lane in lanes.items():
                times[k].append(one_round(lane))
        return {k: statistics.median(v) for k, v in times.items()}

    for lane in lanes.values():
        one_round(lane)  # warm-up: first touches, staging buffers, the lane's threads
    quiet = rounds()
    beside: dict[str, float] = {}
    if busy:
        with busy_beside():
            beside = rounds()
    for lane in lanes.values():
        lane.close()
    return {k: LANE_SUBGROUPS * part / s for k, s in quiet.items()}, {k: LANE_SUBGROUPS * part / s for k, s in beside.items()}


def measure_host_lanes() -> tuple[dict[str, float], dict[str, float]]:
    """The host lane's (quiet, busy) params/s with each kernel that runs here, this process's
    threads."""
    return time_host_lane_quiet_and_busy(host_kernels())


def slower_rates(quiet: dict[str, float], beside: dict[str, float]) -> dict[str, float]:
    """Each kernel's lane rate for the lane balance: the slower of its quiet and busy rates."""
    return {k: min(q, beside.get(k, q)) for k, q in quiet.items()}


def choose_host_kernel(quiet: dict[str, float], slower: dict[str, float], threads: int) -> str:
    """The kernel whose lane is faster: by ``slower`` (of its quiet and busy rates,
    :func:`slower_rates`) where the lane runs an OpenMP team (``threads`` > 1: a descheduled member stalls every region's barrier,
    DeepSpeed's lane most), by the quiet rate on one thread. There is no team to stall there,
    and beside a busy process both lanes get the core's share alone, so their busy rates differ
    by the scheduler's noise (277 against 242 M params/s, torch's the faster, one run; 647
    against 750 quiet, DeepSpeed's the faster by 16%, and the same kernel as stock's)."""
    rank = quiet if threads <= 1 else slower
    return max(rank, key=rank.__getitem__)


_measured_rates: dict[str, float] = {}


def host_lane_rate(name: str) -> float:
    """Params/s of the host lane with kernel ``name`` with this process's threads: kept with the
    fastest lane's choice (:func:`chosen_host_kernel`), or measured once per machine there."""
    if name not in _measured_rates:
        chosen_host_kernel()
    return _measured_rates.get(name, 0.0)


def _cpu_model() -> str:
    model = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            model = next((ln.split(":", 1)[1].strip() for ln in f if ln.startswith("model name")), model)
    except OSError:
        pass
    return model


def _machine_key() -> str:
    """What the loop's speed with each kernel depends on: the CPU, the threads a process uses,
    the library versions, and whether the fused host step is built (a choice measured without it
    is measured again once it is)."""
    model = _cpu_model()
    try:
        ds = import_deepspeed().__version__
    except Exception:
        ds = "none"
    fused = load_host_fused() is not None
    return f"{model}|threads={torch.get_num_threads()}|torch={torch.__version__}|deepspeed={ds}|fused={fused}|lane-busy-team"


def chosen_host_kernel() -> str:
    """The kernel of the faster host lane on this machine (``--host-adam fastest``): kept in ``KERNEL_CHOICE_FILE``
    (:func:`engine.storage.machine_cache.kept_fact`), or measured once and kept there."""

    def decide(entry: object) -> dict[str, Any]:
        if isinstance(entry, dict) and entry.get("kernel") in ("torch", "deepspeed"):
            rates = entry.get("params_per_s", {})
            # Measured before the cpu_adam op was built, or the op is gone since: measure again.
            if isinstance(rates, dict) and ("deepspeed" in rates) == (load_cpu_adam() is not None):
                return entry
        quiet, beside = measure_host_lanes()
        rates = slower_rates(quiet, beside)  # the lane balance's
        best = choose_host_kernel(quiet, rates, torch.get_num_threads())
        log.info("host lane kernel: %s (%s)", best, ", ".join(f"{k} {v:.3g} params/s" for k, v in rates.items()))
        return {"kernel": best, "params_per_s": rates, "quiet_params_per_s": quiet}

    entry = kept_fact(extensions_dir(), KERNEL_CHOICE_FILE, _machine_key(), decide)
    _measured_rates.update({k: float(v) for k, v in entry["params_per_s"].items()})
    return str(entry["kernel"])


@functools.lru_cache(maxsize=None)
def select_host_kernel(choice: str = "auto", device_lane: bool = False) -> tuple[str, HostKernel]:
    """The host-lane kernel for ``choice`` ('auto', 'fastest', 'torch', 'deepspeed'), as (name,
    callable). 'auto' is stock's kernel where it is built, 'fastest' beside a ``device_lane``
    (see the module's doc)."""
    if choice == "auto" and not device_lane:
        choice = "deepspeed" if load_cpu_adam() is not None else "torch"
    elif choice in ("auto", "fastest"):
        choice = chosen_host_kernel()
    elif choice == "deepspeed" and load_cpu_adam() is None:
        raise ConfigError(
            f"host_adam 'deepspeed' (--host-adam deepspeed) needs DeepSpeed's cpu_adam op, which is not built here: {BUILD_HINT}"
        )
    if choice == "deepspeed":
        return "deepspeed", DeepSpeedCpuAdam()
    return "torch", adamw_update_torch_


# -- the node's host memory bandwidth ----------------------------------------------------------------

MEMORY_BANDWIDTH_FILE = "offloadctl-memory-bandwidth.json"
"""Kept beside the kernel choice: the node's host memory bandwidth, measured once per machine."""
HOST_LANE_BYTES_PER_PARAM = 28
"""Host memory bytes a host-lane update moves per parameter, bf16 gradients and weights: the fp32
state read and written (24), the gradient read (2), the weight written (2)
(:data:`engine.lane_model.HOST_LANE_STATE_BYTES` and the rest)."""


NODE_CPUS_ENV = "OFFLOADCTL_NODE_CPUS"
"""The CPUs a rank's launcher gave it before ``--bind-cores`` bound it to its share, as
``0,1,2``: the node's CPUs this process may use (a cpuset's, a ``taskset``'s), kept by
:func:`integrations.cores.bind_rank_cores` for the node's bandwidth measurement."""
NODE_PROBE_TIMEOUT_S = 120
"""The most the measurement in a child process may take; past it, the rank's own figure."""


def _bandwidth_key() -> str:
    """What the node's bandwidth depends on: the CPU and how many of them a process may use
    (fewer than the machine's in a cpuset), the memory size."""
    import psutil

    return f"{_cpu_model()}|cpus={len(node_cpus())}|memory={psutil.virtual_memory().total}"


def node_cpus() -> set[int]:
    """The CPUs the node's bandwidth is measured on: those the launcher gave this process before
    it was bound to its share (``NODE_CPUS_ENV``), else its affinity (a cpuset's or a taskset's:
    a process inside one may use no others, whatever ``os.cpu_count()`` says)."""
    mine = set(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else set(range(os.cpu_count() or 1))
    try:
        given = {int(c) for c in os.environ.get(NODE_CPUS_ENV, "").split(",") if c.strip()}
    except ValueError:
        given = set()
    return given | mine if given else mine


def _copy_bandwidth_on(cpus: set[int]) -> tuple[float, int]:
    """(bytes/s of a large copy, CPUs it ran on) with a thread per CPU of ``cpus`` that this
    process gets: it widens its affinity to them first, and the kernel clips that to its cpuset
    (or refuses it): then it measures on what it has. Never starts a process."""
    if hasattr(os, "sched_setaffinity") and set(os.sched_getaffinity(0)) != cpus:
        with contextlib.suppress(OSError):  # none of them in this process's cpuset: measured on its own CPUs
            os.sched_setaffinity(0, cpus)
    have = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else len(cpus)
    from engine.gpumem import measure_memory_bandwidth

    threads = torch.get_num_threads()
    torch.set_num_threads(have)
    try:
        return measure_memory_bandwidth.__wrapped__(), have  # measured now, not this process's cached figure
    finally:
        torch.set_num_threads(threads)


_CHILD = (
    "import sys\n"
    "from engine.host_kernel import _copy_bandwidth_on\n"
    "print(*_copy_bandwidth_on({int(c) for c in sys.argv[1].split(',')}))\n"
)


def _measure_node_bandwidth() -> float | None:
    """The copy bandwidth with every CPU this process may use (:func:`node_cpus`): here when it
    is not bound to fewer (``offloadctl info``, ``profile save``, a lone rank, a process in a
    cpuset), else in one child process that takes them itself (a rank bound to 8 of 64 cores
    cannot fill the node's memory channels). The child measures and starts nothing (a child that
    measured again wherever its affinity came out short would spawn without end in a cpuset),
    and it sets its own affinity: no ``preexec_fn`` between fork and exec of a rank that runs
    threads. None, said in one line, when the child fails: the rank counts on its own figure."""
    import subprocess
    import sys

    cpus = node_cpus()
    mine = set(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else cpus
    if mine >= cpus:
        bytes_per_s, measured_on = _copy_bandwidth_on(mine)
        log.info("node memory bandwidth: %.3g bytes/s on %d CPUs (this process)", bytes_per_s, measured_on)
        return bytes_per_s
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = {
        **os.environ,
        "OMP_NUM_THREADS": str(len(cpus)),
        "PYTHONPATH": os.pathsep.join(p for p in (root, os.environ.get("PYTHONPATH")) if p),
    }
    try:
        out = subprocess.run(
            [sys.executable, "-c", _CHILD, ",".join(map(str, sorted(cpus)))],
            env=env,
            stdin=subprocess.DEVNULL,
            capture_output=True,
            text=True,
            timeout=NODE_PROBE_TIMEOUT_S,
        )
        if out.returncode != 0:
            raise RuntimeError((out.stderr.strip().splitlines() or [f"exit status {out.returncode}"])[-1])
        printed = out.stdout.split()
        if len(printed) < 2:
            raise RuntimeError("the child process printed no figure")
        bytes_per_s, child_cpus = float(printed[-2]), printed[-1]
        if not bytes_per_s > 0:
            raise ValueError(f"measured {printed[-2]}")
    except subprocess.TimeoutExpired:
        why = f"the measurement took over {NODE_PROBE_TIMEOUT_S} s"
    except (OSError, subprocess.SubprocessError, RuntimeError, ValueError) as e:
        why = str(e) or type(e).__name__
    else:
        log.info("node memory bandwidth: %.3g bytes/s on %s CPUs (a child process)", bytes_per_s, child_cpus)
        return bytes_per_s
    log.warning("offloadctl: the node's memory bandwidth was not measured (%s): this rank counts on its own figure", why)
    return None


def keep_node_memory_bandwidth(bytes_per_s: float) -> None:
    """Keep ``bytes_per_s`` as this machine's host memory bandwidth (read plus written), in
    ``MEMORY_BANDWIDTH_FILE``: what ``profile save`` measured, for the runs that follow."""
    _update_bandwidth_file(lambda known: float(bytes_per_s))


def node_memory_bandwidth(measure: bool = True) -> float | None:
    """Bytes/s of host memory traffic (read plus written) the whole node moves, all its cores
    copying at once: kept in ``MEMORY_BANDWIDTH_FILE`` beside the kernel choice, measured once
    per machine (under a lock, so that ranks starting together measure it once) when ``measure``.
    The host lane is bound by it, not only by its cores: at 28 bytes a parameter, a node's ranks
    together run out of memory bandwidth before they run out of cores."""
    return _update_bandwidth_file(lambda known: known if known is not None else (_measure_node_bandwidth() if measure else None))


def _update_bandwidth_file(decide: Callable[[float | None], float | None]) -> float | None:
    def checked(kept: object) -> float | None:
        return decide(float(kept) if isinstance(kept, (int, float)) and kept > 0 else None)

    return kept_fact(extensions_dir(), MEMORY_BANDWIDTH_FILE, _bandwidth_key(), checked)
