"""Each rank's share of the cores (integrations/cores.py): real node topologies from fake sysfs
trees, and a real 2-rank run bound to it."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from integrations.cores import (
    MIN_BOUND_CORES,
    CpuPlace,
    bind_rank_cores,
    gpu_numa_node,
    physical_cores,
    rank_cores,
    read_topology,
)


@pytest.mark.parametrize(
    "n,size,expect",
    [
        (16, 8, [[0, 1], [2, 3], [4, 5], [6, 7], [8, 9], [10, 11], [12, 13], [14, 15]]),
        (10, 4, [[0, 1, 2], [3, 4, 5], [6, 7], [8, 9]]),  # the first blocks one larger
        (2, 2, [[0], [1]]),
        (2, 4, [[0], [1], [0], [1]]),  # fewer cores than ranks: one each, shared
        (8, 1, [list(range(8))]),
    ],
)
def test_without_topology_blocks_cover_the_cpus_once(n, size, expect):
    """Where /sys says nothing, each CPU counts as a core of its own."""
    got = [rank_cores(range(n), r, size) for r in range(size)]
    assert got == expect
    if n >= size:
        assert sorted(c for block in got for c in block) == list(range(n))


def test_blocks_follow_the_affinity_mask():
    assert rank_cores([8, 9, 10, 11], 1, 2) == [10, 11]


def _in_child(mode: str, env: dict) -> str:
    code = (
        "import os, sys, torch; sys.path.insert(0, %r); from integrations.cores import bind_rank_cores; "
        "c = bind_rank_cores(%r); print(c, sorted(os.sched_getaffinity(0)), torch.get_num_threads(), "
        "os.environ.get('OMP_NUM_THREADS'))" % (os.path.dirname(os.path.dirname(os.path.abspath(__file__))), mode)
    )
    out = subprocess.run([sys.executable, "-c", code], env={**os.environ, **env}, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    return out.stdout.strip()


@pytest.mark.slow
@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="needs two cores")
def test_a_rank_is_bound_to_its_block_with_as_many_threads():
    cores = sorted(os.sched_getaffinity(0))
    mine = rank_cores(cores, 1, 2)
    bound = f"{mine} {mine} {len(mine)} {len(mine)}"
    if len(mine) >= MIN_BOUND_CORES:
        assert _in_child("auto", {"LOCAL_RANK": "1", "LOCAL_SIZE": "2"}) == bound
    else:  # a share of one core: its one thread, the affinity left to the scheduler
        assert _in_child("auto", {"LOCAL_RANK": "1", "LOCAL_SIZE": "2"}) == f"None {cores} 1 1"
    assert _in_child("on", {"LOCAL_RANK": "1", "LOCAL_SIZE": "2"}) == bound
    # One rank on the node, or off: nothing changes.
    env = {k: v for k, v in os.environ.items() if k != "OMP_NUM_THREADS"}
    assert _in_child("auto", {**env, "LOCAL_SIZE": "1"}).startswith(f"None {cores}")
    assert _in_child("off", {"LOCAL_RANK": "1", "LOCAL_SIZE": "2"}).startswith(f"None {cores}")
    assert _in_child("on", {"LOCAL_RANK": "0", "LOCAL_SIZE": "1"}) == f"{cores} {cores} {len(cores)} {len(cores)}"


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="needs two cores")
def test_the_users_thread_count_stands_over_the_share():
    """A user's OMP_NUM_THREADS (``offloadctl train`` says so in USER_OMP_ENV) is the rank's thread
    count, as under stock DeepSpeed; the binding still picks the cores. A launcher's (torchrun's
    1) is not the user's: the share replaces it."""
    from integrations.rank_entry import USER_OMP_ENV

    cores = sorted(os.sched_getaffinity(0))
    mine = rank_cores(cores, 1, 2)
    ranks = {"LOCAL_RANK": "1", "LOCAL_SIZE": "2", "OMP_NUM_THREADS": "3"}
    assert _in_child("on", {**ranks, USER_OMP_ENV: "1"}) == f"{mine} {mine} 3 3"
    assert _in_child("on", {**ranks, USER_OMP_ENV: "0"}) == f"{mine} {mine} {len(mine)} {len(mine)}"


def test_bind_off_leaves_the_process_alone():
    before = os.sched_getaffinity(0)
    assert bind_rank_cores("off", {"LOCAL_RANK": "0", "LOCAL_SIZE": "4"}) is None
    assert os.sched_getaffinity(0) == before


# -- real topologies, from fake sysfs trees ------------------------------------------------------


def _sysfs(root, *, packages: int, cores_per_package: int, smt: bool, gpu_nodes: list[int]) -> tuple[str, list[str]]:
    """A sysfs tree of a node as Linux numbers it: the physical cores first (package by package),
    then their SMT siblings in the same order; one NUMA node per package; one PCI device per GPU
    with its node. Returns the root and the GPUs' bus ids (NVML's spelling)."""
    physical = packages * cores_per_package
    cpus = 2 * physical if smt else physical
    node_cpus: dict[int, list[int]] = {}
    for cpu in range(cpus):
        core = cpu % physical
        package = core // cores_per_package
        topo = root / "devices" / "system" / "cpu" / f"cpu{cpu}" / "topology"
        topo.mkdir(parents=True)
        siblings = f"{core},{core + physical}" if smt else f"{core}"
        (topo / "thread_siblings_list").write_text(siblings + "\n")
        (topo / "physical_package_id").write_text(f"{package}\n")
        node_cpus.setdefault(package, []).append(cpu)
    for node, members in node_cpus.items():
        d = root / "devices" / "system" / "node" / f"node{node}"
        d.mkdir(parents=True)
        (d / "cpulist").write_text(",".join(map(str, members)) + "\n")
    buses = []
    for i, node in enumerate(gpu_nodes):
        bus = f"0000:{0x18 + 0x10 * i:02x}:00.0"
        d = root / "bus" / "pci" / "devices" / bus
        d.mkdir(parents=True)
        (d / "numa_node").write_text(f"{node}\n")
        buses.append(f"0000{bus.upper()}")  # NVML: an 8-digit domain, upper case
    return str(root), buses


def _split(sysfs, buses, size):
    topo = read_topology(sysfs)
    nodes = [gpu_numa_node(b, sysfs) for b in buses]
    return topo, [rank_cores(sorted(topo), r, size, topo, nodes) for r in range(size)]


def test_two_sockets_of_32_smt_cores_with_8_gpus(tmp_path):
    """On a 2x32-core SMT node with 8 GPUs, each rank takes 8 whole physical cores of its GPU's
    socket, with their siblings, and runs 8 threads: ranks 4-7 get none of the SMT siblings of
    ranks 0-3's cores (blocks of sorted CPU numbers would give them those, and none of socket 1's)."""
    sysfs, buses = _sysfs(tmp_path, packages=2, cores_per_package=32, smt=True, gpu_nodes=[0, 0, 0, 0, 1, 1, 1, 1])
    topo, got = _split(sysfs, buses, 8)
    assert topo[70] == CpuPlace(node=0, package=0, core=6) and topo[100] == CpuPlace(node=1, package=1, core=36)
    assert sorted(c for g in got for c in g) == list(range(128))  # every CPU once
    for r, cpus in enumerate(got):
        cores = {topo[c].core for c in cpus}
        assert len(cores) == 8 and physical_cores(cpus, topo) == 8 and len(cpus) == 16  # 8 cores, siblings included
        assert {topo[c].package for c in cpus} == {r // 4}  # on its GPU's socket
    assert got[0] == [*range(0, 8), *range(64, 72)]
    assert got[4] == [*range(32, 40), *range(96, 104)]


def test_ranks_follow_their_gpus_numa_node(tmp_path):
    """GPUs interleaved over the sockets (even ranks on socket 0, odd on socket 1): each rank's
    cores are where its GPU is, not the next block of numbers."""
    sysfs, buses = _sysfs(tmp_path, packages=2, cores_per_package=32, smt=True, gpu_nodes=[0, 1] * 4)
    topo, got = _split(sysfs, buses, 8)
    for r, cpus in enumerate(got):
        assert {topo[c].node for c in cpus} == {r % 2} and physical_cores(cpus, topo) == 8


def test_nodes_are_dealt_out_where_the_gpus_node_is_unknown(tmp_path):
    """No NUMA node for the GPUs (one-node PCI, no NVML): ranks 0-3 on socket 0, 4-7 on socket 1."""
    sysfs, _ = _sysfs(tmp_path, packages=2, cores_per_package=32, smt=True, gpu_nodes=[])
    topo = read_topology(sysfs)
    got = [rank_cores(sorted(topo), r, 8, topo, [None] * 8) for r in range(8)]
    assert [{topo[c].node for c in g} for g in got] == [{0}] * 4 + [{1}] * 4
    assert all(physical_cores(g, topo) == 8 for g in got)


def test_one_socket_of_16_smt_cores_with_one_gpu(tmp_path):
    """A 1-socket 16-core SMT node with one GPU: the one rank keeps every CPU and runs one thread
    per physical core; two ranks split the physical cores, never a core's two siblings."""
    sysfs, buses = _sysfs(tmp_path, packages=1, cores_per_package=16, smt=True, gpu_nodes=[0])
    topo, got = _split(sysfs, buses, 1)
    assert got == [list(range(32))] and physical_cores(got[0], topo) == 16
    two = [rank_cores(sorted(topo), r, 2, topo) for r in range(2)]
    assert two == [[*range(0, 8), *range(16, 24)], [*range(8, 16), *range(24, 32)]]
    assert {topo[c].core for c in two[0]}.isdisjoint({topo[c].core for c in two[1]})


def test_fewer_physical_cores_than_ranks_share_cpus(tmp_path):
    sysfs, _ = _sysfs(tmp_path, packages=1, cores_per_package=2, smt=True, gpu_nodes=[])
    topo = read_topology(sysfs)
    assert [rank_cores(sorted(topo), r, 4, topo) for r in range(4)] == [[0], [1], [2], [3]]


def test_the_bus_id_spellings_and_an_unknown_node(tmp_path):
    sysfs, buses = _sysfs(tmp_path, packages=2, cores_per_package=2, smt=False, gpu_nodes=[1])
    assert gpu_numa_node(buses[0], sysfs) == 1
    assert gpu_numa_node(buses[0].lower()[4:], sysfs) == 1  # sysfs's own spelling
    assert gpu_numa_node("0000:ff:00.0", sysfs) is None
    d = tmp_path / "bus" / "pci" / "devices" / "0000:aa:00.0"
    d.mkdir(parents=True)
    (d / "numa_node").write_text("-1\n")
    assert gpu_numa_node("0000:aa:00.0", sysfs) is None


def test_each_rank_finds_its_gpu_through_nvml(monkeypatch):
    """Local rank r drives the r-th visible GPU; CUDA_VISIBLE_DEVICES may reorder or name them."""
    import types

    import perf.nvml
    from integrations.cores import local_gpu_bus_ids

    handles = ["h0", "h1", "h2"]
    nvml = types.SimpleNamespace(
        nvmlDeviceGetPciInfo=lambda h: types.SimpleNamespace(busId=f"00000000:{10 + handles.index(h)}:00.0".encode()),
        nvmlDeviceGetHandleByUUID=lambda u: {"GPU-b": "h1"}[u],
        nvmlShutdown=lambda: None,
    )
    monkeypatch.setattr(perf.nvml, "open_nvml", lambda: (nvml, handles))
    assert local_gpu_bus_ids(2, {}) == ["00000000:10:00.0", "00000000:11:00.0"]
    assert local_gpu_bus_ids(3, {"CUDA_VISIBLE_DEVICES": "2,GPU-b"}) == ["00000000:12:00.0", "00000000:11:00.0", None]
    monkeypatch.setattr(perf.nvml, "open_nvml", lambda: None)
    assert local_gpu_bus_ids(2, {}) == [None, None]
