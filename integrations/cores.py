"""Each rank's share of the node's cores, for its host lane.

The host lane's AdamW runs on ``torch.get_num_threads()`` OpenMP threads. With several ranks
on a node, each would otherwise start as many threads as the node has cores: 8 ranks put 8
threads on every core, the kernels run at the pace of their slowest thread, and the rate each
rank measured alone (which the lane balance uses) is 8 times what it gets. Under
``offloadctl train`` each rank is bound, before the user's script starts, to its own share of
the cores this process may use (as DeepSpeed's ``--bind_cores_to_rank`` does, without numactl),
and runs one thread per physical core of it; the host lane's rate is then measured on that share.

The share follows the machine's topology (``/sys``), not the CPU numbers: Linux numbers SMT
siblings after the physical cores, so blocks of sorted CPU numbers would give ranks 4-7 of an
8-GPU node the siblings of ranks 0-3's cores, and on two sockets put half the ranks far from
their GPU. So CPUs are grouped into physical cores (``thread_siblings_list``), a rank takes
whole physical cores (their SMT siblings with them, for its I/O threads, with one host-lane
thread per core), and its cores come from its GPU's NUMA node
(``/sys/bus/pci/devices/<bus id>/numa_node``) where that is known, else from the nodes in turn.

``--bind-cores auto`` (the default) binds when more than one rank shares the node and the user
did not ask DeepSpeed's launcher to bind; ``on`` always binds; ``off`` leaves the threads alone.
Where a rank's share is a single physical core, ``auto`` sets its one thread but leaves its
affinity to the scheduler (:data:`MIN_BOUND_CORES`).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Iterable, Mapping, Sequence

MODES = ("auto", "on", "off")
MIN_BOUND_CORES = 2
"""The smallest share ``auto`` pins a rank to. On one core, a rank's communication and I/O threads
(gloo's, the engine's I/O and recorder threads) have no core beside its lane's: two ranks on a
2-core node took 1.2-1.3x as long for their step pinned as with one thread each, unpinned
(issue 45 item 1, ``bench/host_floor.py`` size cpu-deep). The thread count still follows the share."""
SYSFS = "/sys"


@dataclass(frozen=True, order=True)
class CpuPlace:
    """Where a logical CPU sits: its NUMA node, its package (socket) and its physical core
    (named by the lowest CPU number among its SMT siblings)."""

    node: int
    package: int
    core: int


def _read(path: str) -> str | None:
    try:
        with open(path) as f:
            return f.read().strip()
    except OSError:
        return None


def parse_cpu_list(text: str) -> list[int]:
    """``0-3,8,10-11`` (sysfs's list format) as CPU numbers."""
    out: list[int] = []
    for part in text.split(","):
        part = part.strip()
        if not part:
            continue
        lo, _, hi = part.partition("-")
        out.extend(range(int(lo), int(hi or lo) + 1))
    return out


def read_topology(sysfs: str = SYSFS) -> dict[int, CpuPlace]:
    """Every online CPU's place from ``sysfs`` (empty where it cannot be read: not Linux, a
    container without /sys). A CPU without a NUMA node is on node 0."""
    base = os.path.join(sysfs, "devices", "system", "cpu")
    node_of: dict[int, int] = {}
    nodes = os.path.join(sysfs, "devices", "system", "node")
    try:
        node_dirs = [d for d in os.listdir(nodes) if d.startswith("node") and d[4:].isdigit()]
    except OSError:
        node_dirs = []
    for d in node_dirs:
        cpus = _read(os.path.join(nodes, d, "cpulist"))
        for c in parse_cpu_list(cpus) if cpus else ():
            node_of[c] = int(d[4:])
    out: dict[int, CpuPlace] = {}
    try:
        cpu_dirs = [d for d in os.listdir(base) if d.startswith("cpu") and d[3:].isdigit()]
    except OSError:
        return {}
    for d in cpu_dirs:
        cpu, topo = int(d[3:]), os.path.join(base, d, "topology")
        siblings = _read(os.path.join(topo, "thread_siblings_list"))
        package = _read(os.path.join(topo, "physical_package_id"))
        if siblings is None:
            continue  # offline
        out[cpu] = CpuPlace(
            node=node_of.get(cpu, 0), package=int(package) if package else 0, core=min(parse_cpu_list(siblings) or [cpu])
        )
    return out


def gpu_numa_node(bus_id: str, sysfs: str = SYSFS) -> int | None:
    """The NUMA node of the PCI device ``bus_id`` (NVML's ``00000000:3B:00.0`` or sysfs's
    ``0000:3b:00.0``); None when unknown (one node, no sysfs, -1)."""
    domain, _, rest = bus_id.strip().lower().partition(":")
    name = f"{domain[-4:].rjust(4, '0')}:{rest}"
    text = _read(os.path.join(sysfs, "bus", "pci", "devices", name, "numa_node"))
    try:
        node = int(text) if text is not None else -1
    except ValueError:
        return None
    return node if node >= 0 else None


def local_gpu_bus_ids(local_size: int, environ: Mapping[str, str] = os.environ) -> list[str | None]:
    """The PCI bus id of each local rank's GPU, through NVML without initialising CUDA: local
    rank r drives the r-th visible GPU (DeepSpeed's ``set_device(local_rank)``), CUDA's
    visible order being the PCI order NVML numbers them in. None for a rank whose GPU is
    unknown (no NVML, fewer GPUs, a visible-devices entry NVML cannot resolve)."""
    from perf.nvml import open_nvml

    opened = open_nvml()
    if opened is None:
        return [None] * local_size
    nvml, handles = opened
    try:
        visible = environ.get("CUDA_VISIBLE_DEVICES")
        entries = (
            [e.strip() for e in visible.split(",") if e.strip()] if visible is not None else [str(i) for i in range(len(handles))]
        )
        out: list[str | None] = []
        for r in range(local_size):
            bus = None
            if r < len(entries):
                try:
                    e = entries[r]
                    h = handles[int(e)] if e.isdigit() else nvml.nvmlDeviceGetHandleByUUID(e)
                    bus = nvml.nvmlDeviceGetPciInfo(h).busId
                    bus = bus.decode() if isinstance(bus, bytes) else str(bus)
                except Exception:
                    bus = None
            out.append(bus)
        return out
    finally:
        nvml.nvmlShutdown()


def rank_cores(
    available: Iterable[int],
    local_rank: int,
    local_size: int,
    topology: Mapping[int, CpuPlace] | None = None,
    gpu_nodes: Sequence[int | None] | None = None,
) -> list[int]:
    """This rank's CPUs (the affinity mask): whole physical cores of ``available``, split in
    contiguous blocks among the ranks that share a NUMA node, the first blocks one core larger
    where they do not divide evenly. ``topology`` (:func:`read_topology`): without it, or for a
    CPU it lacks, each CPU is a core of its own on node 0. ``gpu_nodes``: each local rank's GPU's
    NUMA node; where every rank's is known and has cores, ranks take their GPU's node, else the
    nodes are dealt out to ranks in turn. With fewer physical cores than ranks, ranks share:
    one logical CPU each, round robin."""
    cpus = sorted(available)
    if not cpus or local_size <= 1:
        return cpus
    topology = topology or {}
    place = {c: topology.get(c, CpuPlace(node=0, package=0, core=c)) for c in cpus}
    cores: dict[CpuPlace, list[int]] = {}
    for c in cpus:
        cores.setdefault(place[c], []).append(c)
    if len(cores) < local_size:
        return [cpus[local_rank % len(cpus)]]
    nodes = sorted({p.node for p in cores})
    node_of = (
        list(gpu_nodes[:local_size])
        if gpu_nodes is not None and len(gpu_nodes) >= local_size and all(n in nodes for n in gpu_nodes[:local_size])
        else [nodes[r * len(nodes) // local_size] for r in range(local_size)]
    )
    peers = [r for r in range(local_size) if node_of[r] == node_of[local_rank]]
    mine = sorted(p for p in cores if p.node == node_of[local_rank])
    if len(mine) < len(peers):  # more ranks on that node than it has cores: the node split ignored
        peers, mine = list(range(local_size)), sorted(cores)
    base, extra = divmod(len(mine), len(peers))
    k = peers.index(local_rank)
    start = k * base + min(k, extra)
    block = mine[start : start + base + (1 if k < extra else 0)]
    return sorted(c for p in block for c in cores[p])


def physical_cores(cpus: Sequence[int], topology: Mapping[int, CpuPlace] | None = None) -> int:
    """How many physical cores ``cpus`` span (each CPU its own without ``topology``)."""
    topology = topology or {}
    return len({topology.get(c, CpuPlace(node=0, package=0, core=c)) for c in cpus})


def bind_rank_cores(mode: str, environ=os.environ, sysfs: str = SYSFS) -> list[int] | None:
    """Bind this rank to its cores and set its thread count to one per physical core, per
    ``mode`` (a share of one core under ``auto``: the thread count only, :data:`MIN_BOUND_CORES`);
    the CPUs, or None when not bound. Call before torch starts its thread pool (before the user's
    script)."""
    from integrations.rank_entry import users_threads
    from perf.plan import local_rank
    from perf.plan import local_size as launcher_local_size

    local_size = launcher_local_size(environ) or 1
    if mode == "off" or (mode == "auto" and local_size <= 1):
        return None
    if not hasattr(os, "sched_setaffinity"):  # pragma: no cover - not Linux
        return None
    topology = read_topology(sysfs)
    gpu_nodes = [gpu_numa_node(b, sysfs) if b else None for b in local_gpu_bus_ids(local_size, environ)]
    given = os.sched_getaffinity(0)
    cores = rank_cores(given, local_rank(environ), local_size, topology, gpu_nodes)
    if not cores:
        return None
    share = physical_cores(cores, topology)
    pinned = mode == "on" or share >= MIN_BOUND_CORES
    if pinned:
        os.sched_setaffinity(0, cores)
    # A user's count stands, as stock DeepSpeed's ranks keep it: torch's CPU kernels (LayerNorm's
    # backward among them) round differently at another count, so a run compared with stock's
    # bit for bit sets the same count on both.
    threads = users_threads(environ) or share
    environ["OMP_NUM_THREADS"] = str(threads)  # DeepSpeed's cpu_adam op and anything OpenMP started later
    import torch

    from engine.host_kernel import NODE_CPUS_ENV

    # The node's bandwidth is measured on every CPU the launcher gave (a cpuset's), not this share.
    environ[NODE_CPUS_ENV] = ",".join(map(str, sorted(given)))

    torch.set_num_threads(threads)
    return cores if pinned else None


def describe(cores: list[int] | None) -> str:
    """For the start line: the host lane's threads and where they run."""
    import torch

    n = torch.get_num_threads()
    threads = f"host lane {n} thread{'s' if n != 1 else ''}"
    if cores is None:
        return threads
    if len(cores) == 1:
        return f"{threads} on CPU {cores[0]}"
    span = f"{cores[0]}-{cores[-1]}" if cores == list(range(cores[0], cores[-1] + 1)) else ",".join(map(str, cores))
    return f"{threads} on CPUs {span}"
