"""The performance model on hand-computed cases, the plan optimizer, and `offloadctl plan`.

Reference machine for the hand computations (unless a test says otherwise): CPU AdamW 1e9
params/s, host memory 10e9 B/s, 2 cores; one disk at 400 MB/s read, 400 MB/s write, 800 MB/s
for both at once (an emulated tier throttles each direction). 100M params in subgroups of 1e7
with fp32 weights and gradients, as bench/update_phase.py runs them. Then:

- a subgroup's state is roundup(12e7, 4096) = 120_000_512 B and a transfer (with the 4 KiB
  header) FB = 120_004_608 B, so one read or write takes FB / 400e6 = 0.30001152 s;
- the host-lane time of one subgroup is u = 1e7 * (1 / 1e9 + 4 B / 10e9) = 0.014 s.
"""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
import time

import pytest
from helpers import cli, env_with_root

from engine.config import Knobs
from engine.errors import ConfigError
from engine.placement import DEVICE_LANE_CHUNK_NUMEL
from perf.model import Plan, Workload, predict
from perf.profile import SCHEMA_VERSION, AdamWRate, Figure, Gpu, Host, Machine, PathProfile, Profile, Source, SweepPoint
from perf.search import alternatives, best_plan
from perf.stock import stock_deepspeed

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
FB = 120_004_608  # one subgroup's transfer: state padded to 4 KiB, plus the header
T1 = FB / 400e6  # one transfer at 400 MB/s
U = 0.014  # host-lane time of one subgroup


def fig(v: float) -> Figure:
    return Figure(value=float(v), how="hand-set for a test", when="2026-01-01T00:00:00Z")


def disk(path: str, device: str, read=400e6, write=400e6, mixed=800e6, capacity=10**13, sweep=()) -> PathProfile:
    return PathProfile(
        path=path,
        kind="nvme",
        device=device,
        device_id=f"id-{device}",
        capacity_bytes=capacity,
        read_bytes_per_s=fig(read),
        write_bytes_per_s=fig(write),
        mixed_bytes_per_s=fig(mixed),
        best_concurrency=4,
        sweep=tuple(sweep),
    )


def machine_profile(paths=(), *, cpu=1e9, mem=10e9, cores=2, memory=24 << 30, gpu=None, gpus=0) -> Profile:
    return Profile(
        schema_version=SCHEMA_VERSION,
        name="test",
        source=Source(kind="estimate", description="hand-set for tests"),
        machine=Machine(
            hostname="test",
            cpu_model="test",
            cores_physical=cores,
            cores_logical=cores,
            memory_bytes=memory,
            numa_nodes=1,
            gpu_model=gpu.model if gpu else "",
            gpu_count=gpus,
        ),
        host=Host(memory_bandwidth=fig(mem), adamw=(AdamWRate(threads=cores, params_per_s=fig(cpu)),)),
        paths=tuple(paths),
        gpu=gpu,
    )


def gpu(h2d=10e9, duplex=8e9, adamw=1e11, memory=80 << 30) -> Gpu:
    return Gpu(
        model="test GPU",
        memory_bytes=memory,
        h2d_bytes_per_s=fig(h2d),
        d2h_bytes_per_s=fig(h2d),
        duplex_h2d_bytes_per_s=fig(duplex),
        duplex_d2h_bytes_per_s=fig(duplex),
        adamw_params_per_s=fig(adamw),
    )


ONE_DISK = machine_profile([disk("/nvme", "nvme0n1")])
WL = Workload(params=100_000_000, subgroup_numel=10_000_000, weight_bytes=4, grad_bytes=4)


def all_nvme(depth=2, **kw) -> Plan:
    return Plan(host_cache_bytes=0, knobs=Knobs(prefetch_depth=depth, io_concurrency={"/nvme": 8}, **kw))


# -- hand-computed cases --------------------------------------------------------------------------


def test_host_only_is_params_over_cpu_rate():
    p = predict(ONE_DISK, WL, Plan(host_cache_bytes=None))
    # 1e8 params * (1 / 1e9 + 4 B of weight copy / 10e9): no storage traffic at all.
    assert p.update_s == pytest.approx(0.1 + 0.04)
    assert p.bytes_per_param == 0 and p.bottleneck == "cpu"
    # Two ranks on the node share the cores: half the params each at half the rate, same time.
    two = predict(ONE_DISK, dataclasses.replace(WL, params=100_000_000, ranks=2), Plan(host_cache_bytes=None))
    assert two.update_s == pytest.approx(0.14)
    # Two nodes: half the params per rank, each node's cores to itself.
    nodes = predict(ONE_DISK, dataclasses.replace(WL, nodes=2), Plan(host_cache_bytes=None))
    assert nodes.update_s == pytest.approx(0.07)


def test_all_nvme_is_bandwidth_bound():
    p = predict(ONE_DISK, WL, all_nvme())
    # 10 subgroups, 3 kept across the step (prefetch 2 + 1): 7 read and 7 written, each 7 * T1 on
    # its own direction and 14 * FB / 800e6 together: 2.1 s. Before it, the first (kept)
    # subgroup's update, before any read is issued.
    assert p.update_s == pytest.approx(U + 7 * T1)
    assert p.bottleneck == "storage (nvme0n1)"
    assert p.bytes_per_param == pytest.approx(14 * FB / 1e8)  # 16.8, as bench/update_phase.py measured
    assert p.breakdown["storage"] == pytest.approx(7 * T1)


def test_half_cached_counts_resident_updates_in_forward_steps():
    p = predict(ONE_DISK, WL, all_nvme().replace(host_cache_bytes=5 * 120_000_512))
    # 5 resident, 5 swapped of which 3 kept: 2 read and 2 written (0.6 s). Forward steps update
    # the 5 resident subgroups first (5 U) with no I/O issued; reverse steps do them last,
    # while the final write-back runs.
    forward = 5 * U + U + 2 * T1
    reverse = U + 2 * T1
    assert p.breakdown["forward_step"] == pytest.approx(forward)
    assert p.breakdown["reverse_step"] == pytest.approx(reverse)
    assert p.update_s == pytest.approx((forward + reverse) / 2)
    assert p.bytes_per_param == pytest.approx(4 * FB / 1e8)


def test_two_paths_on_different_devices_add_up():
    prof = machine_profile([disk("/nvme0", "nvme0n1"), disk("/nvme1", "nvme1n1")])
    p = predict(
        prof,
        WL,
        Plan(
            host_cache_bytes=0,
            knobs=Knobs(io_concurrency={"/nvme0": 8, "/nvme1": 8}, stripe_weights={"/nvme0": 1.0, "/nvme1": 1.0}),
        ),
    )
    # Subgroups alternate between the disks; of the 7 reads and 7 writes, each disk does 3 + 4
    # (read 3 write 4, or the reverse): 4 * T1 per disk, both at once.
    assert p.update_s == pytest.approx(U + 4 * T1)
    assert p.update_s < 0.6 * predict(ONE_DISK, WL, all_nvme()).update_s


def test_two_paths_on_the_same_device_do_not_add_up():
    prof = machine_profile([disk("/nvme/a", "nvme0n1"), disk("/nvme/b", "nvme0n1")])
    p = predict(
        prof,
        WL,
        Plan(
            host_cache_bytes=0,
            knobs=Knobs(io_concurrency={"/nvme/a": 8, "/nvme/b": 8}, stripe_weights={"/nvme/a": 1.0, "/nvme/b": 1.0}),
        ),
    )
    # One disk behind both directories: all 7 + 7 transfers share its bandwidth.
    assert p.update_s == pytest.approx(U + 7 * T1)
    assert [k for k in p.breakdown if k.startswith("storage:")] == ["storage:nvme0n1"]
    # The optimizer gives the whole device's weight to one of the two.
    best = best_plan(prof, dataclasses.replace(WL, host_bytes=0 + 7 * FB))
    assert sorted(best.plan.knobs.stripe_weights.values())[0] == 0.0


def test_same_device_is_found_by_name_across_partitions():
    a, b = disk("/p1", "nvme0n1"), disk("/p2", "nvme0n1")
    b = dataclasses.replace(b, device_id="259:2")  # another partition of the same disk
    prof = machine_profile([a, b])
    p = predict(prof, WL, Plan(host_cache_bytes=0, knobs=Knobs(stripe_weights={"/p1": 1.0, "/p2": 1.0})))
    assert p.update_s == pytest.approx(U + 7 * T1)


def test_ranks_share_the_disk():
    wl = dataclasses.replace(WL, params=200_000_000, ranks=2)  # 1e8 per rank, as above
    p = predict(ONE_DISK, wl, all_nvme())
    # Both ranks' 7 + 7 transfers go through one disk: 14 * T1. The first subgroup's update runs
    # at half the CPU (the other rank uses the rest): 1e7 * (2e-9 + 4 B * 2 / 10e9) = 0.028 s.
    assert p.update_s == pytest.approx(0.028 + 14 * T1)


def test_ranks_share_pcie_through_host_memory():
    # Device lane for every subgroup, all state in host memory, 16-bit gradients (kept on the GPU).
    g = gpu(h2d=10e9, duplex=8e9, adamw=1e11)
    wl = Workload(params=100_000_000, subgroup_numel=10_000_000, weight_bytes=2, grad_bytes=2)
    one = predict(machine_profile(gpu=g, gpus=2, mem=10e9), wl, Plan(host_cache_bytes=None, knobs=Knobs(device_fraction=1.0)))
    # The pipeline's fill and drain, one chunk in and out at the duplex rate, then the updates
    # (engine.lane_model, the engine's own model).
    chunk = 12 * DEVICE_LANE_CHUNK_NUMEL / 8e9
    assert one.breakdown["gpu_update"] == pytest.approx(2 * chunk + 1e8 / 1e11)
    # PCIe: 1.2 GB in (state only: the gradients are on the GPU) and 1.2 GB out, duplex 8e9 each
    # (0.15 s, and the other direction's last chunk); 2.4 GB of DMA through host memory, which
    # moves 2 x 10e9 B/s (the profile's figure is bytes copied: read and written): 0.12 s.
    assert one.breakdown["pcie"] == pytest.approx(0.15 + chunk)
    assert one.update_s == pytest.approx(0.15 + chunk) and one.bottleneck == "pcie"
    # Two ranks (two GPUs, two links) move twice the bytes through the same host memory: 0.24 s.
    two = predict(
        machine_profile(gpu=g, gpus=2, mem=10e9),
        dataclasses.replace(wl, params=200_000_000, ranks=2),
        Plan(host_cache_bytes=None, knobs=Knobs(device_fraction=1.0)),
    )
    assert two.breakdown["gpu_update"] == pytest.approx(2 * chunk + 1e8 / 1e11)
    assert two.update_s == pytest.approx(0.24) and two.bottleneck == "pcie"


def test_the_plan_and_the_engine_share_one_lane_model():
    """The plan's GPU and PCIe times are engine.lane_model's, on the profile's rates."""
    from engine.lane_model import lane_times
    from perf.model import _layout, lane_load, lane_rates

    g = gpu(h2d=10e9, duplex=8e9, adamw=1e11)
    prof = machine_profile([disk("/nvme", "nvme0n1")], gpu=g, gpus=1, mem=10e9)
    wl = Workload(params=100_000_000, subgroup_numel=10_000_000, gpu_headroom_bytes=4 << 30)
    for f in (0.3, 0.5, 1.0):
        plan = Plan(host_cache_bytes=None, device_cache_bytes=2 * 120_000_512, knobs=Knobs(device_fraction=f))
        t = lane_times(lane_load(wl, _layout(wl, plan), plan, 4 << 30), lane_rates(prof, wl))
        p = predict(prof, wl, plan)
        assert p.breakdown["gpu_update"] == pytest.approx(t["gpu"])
        assert p.breakdown["pcie"] == pytest.approx(max(t["h2d"], t["d2h"], t["memory"]))
        assert p.breakdown["cpu_update"] == pytest.approx(t["host"])


def test_alternating_order_keeps_the_tail_in_memory():
    for depth in range(5):
        kept = depth + 1
        p = predict(ONE_DISK, WL, all_nvme(depth))
        assert p.bytes_per_param == pytest.approx(2 * (10 - kept) * FB / 1e8)
    # Fewer swapped subgroups than kept buffers: nothing moves after the first step.
    few = predict(ONE_DISK, WL, all_nvme(2).replace(host_cache_bytes=7 * 120_000_512))
    assert few.bytes_per_param == 0 and few.bottleneck == "cpu"


def test_prefetch_zero_serialises_read_and_update():
    p = predict(ONE_DISK, WL, all_nvme(0))
    # 1 kept, 9 read: each read waits in full (with the previous write-back on the same disk,
    # 2 FB at 800 MB/s = T1), then the update: U + 9 (T1 + U).
    assert p.update_s == pytest.approx(U + 9 * (T1 + U))
    assert p.bottleneck == "prefetch depth"


def test_concurrency_from_the_sweep_and_the_node_lock():
    sweep = [
        SweepPoint(op=op, concurrency=c, block_bytes=8 << 20, bytes_per_s=fig(k * 100e6 * c))
        for c in (1, 2, 4, 8)
        for op, k in (("read", 1), ("write", 1), ("mixed", 2))
    ]
    prof = machine_profile([disk("/nvme", "nvme0n1", sweep=sweep)])  # 100 MB/s per request, each direction
    p1 = predict(prof, WL, Plan(host_cache_bytes=0, knobs=Knobs(io_concurrency={"/nvme": 1})))
    p4 = predict(prof, WL, Plan(host_cache_bytes=0, knobs=Knobs(io_concurrency={"/nvme": 4})))
    assert p1.breakdown["storage"] == pytest.approx(7 * FB / 100e6)
    assert p4.breakdown["storage"] == pytest.approx(7 * FB / 400e6)
    # Two ranks at 2 each put 4 requests on the disk; with the node lock only one rank's 2.
    wl2 = dataclasses.replace(WL, params=200_000_000, ranks=2)
    free = predict(prof, wl2, Plan(host_cache_bytes=0, knobs=Knobs(io_concurrency={"/nvme": 2})))
    locked = predict(prof, wl2, Plan(host_cache_bytes=0, knobs=Knobs(io_concurrency={"/nvme": 2}, node_lock=True)))
    assert free.breakdown["storage"] == pytest.approx(14 * FB / 400e6)
    assert locked.breakdown["storage"] == pytest.approx(14 * FB / 200e6)
    # The optimizer takes the smallest concurrency that reaches the best bandwidth.
    assert best_plan(prof, dataclasses.replace(WL, host_bytes=7 * FB)).plan.knobs.io_concurrency == {"/nvme": 8}


def test_gpu_headroom_caps_the_device_lane():
    from engine.placement import device_lane_working_bytes

    g = gpu(h2d=25e9, duplex=20e9, adamw=1e11)
    prof = machine_profile([disk("/nvme", "nvme0n1")], cpu=1e8, gpu=g, gpus=1)  # a slow CPU: the GPU lane pays
    # The lane's buffers (its gradients need not stay on the GPU: they are uploaded with the state).
    scratch = device_lane_working_bytes(10_000_000)
    roomy = best_plan(prof, dataclasses.replace(WL, gpu_headroom_bytes=scratch), device_cache=False)
    assert roomy.plan.knobs.device_fraction > 0 and roomy.plan.device_cache_bytes == 0
    assert roomy.memory["gpu_per_rank"] <= scratch
    # Room for a few subgroups' state and gradients too: the optimizer keeps them on the GPU.
    big = dataclasses.replace(WL, gpu_headroom_bytes=scratch + 5 * 120_000_512)
    cached = best_plan(prof, big)
    assert cached.plan.device_cache_bytes >= 120_000_512 and cached.memory["gpu_per_rank"] <= big.gpu_headroom_bytes
    assert cached.update_s < best_plan(prof, big, device_cache=False).update_s
    assert "forward and backward" in " ".join(cached.notes)
    tight = best_plan(prof, dataclasses.replace(WL, gpu_headroom_bytes=scratch - 1), device_cache=False)
    assert tight.plan.knobs.device_fraction == 0
    with pytest.raises(ConfigError, match="GPU headroom"):
        predict(
            prof,
            dataclasses.replace(WL, gpu_headroom_bytes=scratch - 1),
            Plan(host_cache_bytes=None, knobs=Knobs(device_fraction=0.5)),
        )


def test_all_state_on_the_gpu_when_it_fits():
    g = gpu(h2d=25e9, duplex=20e9, adamw=1e11)
    prof = machine_profile(cpu=1e9, gpu=g, gpus=1)
    wl = dataclasses.replace(WL, gpu_headroom_bytes=20 << 30)  # 1.6 GB of state and gradients fit easily
    best = best_plan(prof, wl)
    assert best.plan.device_cache_bytes >= 12 * WL.params and best.breakdown["cpu_update"] == 0
    assert best.update_s == pytest.approx(WL.params / 1e11)


def test_best_plan_is_never_slower_than_stock():
    """The engine can run what stock DeepSpeed runs, so the best plan of a table never loses to
    one of its stock rows (issue: 'best' 1.12 s, 'stock Twin-Flow' 0.67 s in one table)."""
    from perf.profile_toml import load_profile

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    for name, ranks in (("example-h100-node.toml", 4), ("example-h100-node.toml", 8), ("example-cpu-vm.toml", 1)):
        prof = load_profile(os.path.join(root, "profiles", name))
        for params in (2e9, 7e9, 20e9, 70e9):
            wl = Workload(params=int(params), ranks=ranks, subgroup_numel=100_000_000, fwd_bwd_s=1.0)
            try:
                rows = alternatives(prof, wl)
            except ConfigError:
                continue
            stock = [r.iteration_s for r in rows if r.plan.name.startswith("stock") and r.feasible]
            assert not stock or rows[0].iteration_s <= min(stock) * (1 + 1e-9), (name, ranks, params)


def test_stock_deepspeed():
    wl = dataclasses.replace(WL, fwd_bwd_s=0.9)
    cpu = stock_deepspeed(ONE_DISK, wl, "zero3-cpu")
    assert cpu.update_s == pytest.approx(0.14) and cpu.iteration_s == pytest.approx(1.04)
    zi = stock_deepspeed(ONE_DISK, wl, "zero-infinity-nvme")
    # 16 B/param read, 12 written, no cache: 1.6 GB at 400 MB/s is 4.0 s; read one ahead and
    # write one behind: the first read (0.4 s) and last write (0.3 s) stand out, 9/10 of the
    # rest overlaps. Backward writes 4 B/param (1.0 s), of which 2/3 * 0.9 s hides in backward.
    assert zi.update_s == pytest.approx(0.4 + 4.0 * 9 / 10 + U + 0.3)
    assert zi.iteration_s == pytest.approx(0.9 + (1.0 - 0.6) + zi.update_s)
    assert zi.bytes_per_param == 32.0
    ours = predict(ONE_DISK, wl, all_nvme())
    assert ours.bytes_per_param < 24 < zi.bytes_per_param
    assert not stock_deepspeed(ONE_DISK, wl, "twinflow").feasible  # no GPU
    g = machine_profile(gpu=gpu(adamw=1e10), gpus=1)
    tf = stock_deepspeed(g, dataclasses.replace(wl, weight_bytes=2), "twinflow", ratio=0.5)
    # Half on the CPU (0.05 s AdamW + 2 B weights / 10e9 H2D), half on the GPU at 1e10: 5e7 / 1e10.
    assert tf.breakdown["cpu_update"] == pytest.approx(5e7 * (1e-9 + 2 / 10e9))
    assert tf.breakdown["gpu_update"] == pytest.approx(0.005)


def test_stock_that_does_not_fit_is_marked():
    small = machine_profile([disk("/nvme", "nvme0n1")], memory=1 << 30)
    p = stock_deepspeed(small, Workload(params=10**9), "zero3-cpu")
    assert not p.feasible and "host memory" in p.notes[0]


def test_best_plan_and_alternatives():
    prof = machine_profile([disk("/nvme0", "nvme0n1"), disk("/nvme1", "nvme1n1", read=200e6, write=200e6, mixed=400e6)])
    wl = Workload(params=10**9, fwd_bwd_s=2.0, host_bytes=4 * 10**9)
    alts = alternatives(prof, wl)
    best = alts[0]
    assert best.plan.name == "best"
    ours = [p for p in alts if not p.plan.name.startswith("stock")]
    assert best.update_s <= 1.01 * min(p.update_s for p in ours)  # within 1%, the simplest plan
    # Stripes follow bandwidth: the disk twice as fast gets twice the weight.
    w = best.plan.knobs.stripe_weights
    assert w["/nvme0"] == pytest.approx(2 * w["/nvme1"])
    # Every plan the optimizer returns is one the engine accepts, and one that fits.
    assert isinstance(best.plan.knobs, Knobs)
    assert best.memory["host_per_node"] <= wl.host_bytes
    stock = {"stock ZeRO-3 CPU offload", "stock ZeRO-Infinity NVMe", "stock Twin-Flow"}
    assert {p.plan.name.split(" (")[0] for p in alts} >= stock
    zi = next(p for p in alts if p.plan.name == "stock ZeRO-Infinity NVMe")
    assert best.iteration_s < zi.iteration_s
    # Forward and backward hide part of the storage time (writes behind, reads ahead), never more than they last.
    hidden = best.breakdown["io_in_fwd_bwd"]
    assert 0 < hidden <= 2.0 and best.iteration_s == pytest.approx(2.0 + best.update_s - hidden)
    assert predict(prof, wl, best.plan.replace(overlap_io=False)).iteration_s == pytest.approx(2.0 + best.update_s)


@pytest.mark.parametrize("params", [10**12, 10**13])
def test_best_plan_is_fast_at_any_size(params):
    prof = machine_profile(
        [disk("/nvme0", "nvme0n1", capacity=10**15), disk("/nvme1", "nvme1n1", capacity=10**15)],
        cpu=4e9,
        mem=200e9,
        cores=64,
        memory=2 << 40,
        gpu=gpu(),
        gpus=8,
    )
    wl = Workload(params=params, ranks=8, fwd_bwd_s=30.0)
    t0 = time.perf_counter()
    alts = alternatives(prof, wl)
    # Not a speed figure (0.3-0.7 s here): a bound that a search growing with the model size would
    # break by orders of magnitude at 1e13, loose enough for a loaded 2-core machine.
    assert time.perf_counter() - t0 < 5.0
    assert alts[0].update_s > 0 and alts[0].bytes_per_param > 0


def test_bad_inputs_raise_config_error():
    with pytest.raises(ConfigError, match="Workload.params"):
        Workload(params=0)
    with pytest.raises(ConfigError, match="Workload.ranks"):
        Workload(params=10, ranks=0)
    with pytest.raises(ConfigError, match="Workload.fwd_bwd_s"):
        Workload(params=10, fwd_bwd_s=-1.0)
    with pytest.raises(ConfigError, match="device_fraction"):
        Plan(knobs={"device_fraction": 1.5})
    with pytest.raises(ConfigError, match="prefetch_depth"):
        Plan(knobs=Knobs(prefetch_depth=-1))
    with pytest.raises(ConfigError, match="unknown knob"):
        Plan(knobs={"prefetch": 2})
    with pytest.raises(ConfigError, match="Plan.knobs"):
        Plan(knobs=2)
    with pytest.raises(ConfigError, match="Plan.device_cache_bytes"):
        Plan(device_cache_bytes=-1)
    with pytest.raises(ConfigError, match="/elsewhere"):
        predict(ONE_DISK, WL, Plan(host_cache_bytes=0, knobs=Knobs(stripe_weights={"/elsewhere": 1.0})))
    with pytest.raises(ConfigError, match="no GPU"):
        predict(ONE_DISK, WL, Plan(knobs=Knobs(device_fraction=0.5)))
    with pytest.raises(ConfigError, match="host memory"):
        predict(ONE_DISK, dataclasses.replace(WL, host_bytes=10**8), Plan(host_cache_bytes=None))
    with pytest.raises(ConfigError, match="no storage paths"):
        predict(machine_profile(), WL, Plan(host_cache_bytes=0))
    with pytest.raises(ConfigError, match="no storage paths"):
        best_plan(machine_profile(memory=1 << 30), Workload(params=10**9))
    with pytest.raises(ConfigError, match="capacity"):
        predict(machine_profile([disk("/nvme", "nvme0n1", capacity=10**9)]), WL, all_nvme())
    with pytest.raises(ConfigError, match="zero4"):
        stock_deepspeed(ONE_DISK, WL, "zero4")
    with pytest.raises(ConfigError, match="ratio"):
        stock_deepspeed(machine_profile(gpu=gpu(), gpus=1), WL, "twinflow", ratio=2.0)


# -- Plan, and the engine's layout as the model counts it -----------------------------------------


def test_plan_holds_the_engines_knobs_and_is_flat_in_json():
    knobs = Knobs(device_fraction=0.25, prefetch_depth=3, io_concurrency={"/nvme": 8}, stripe_weights={"/nvme": 1.0})
    plan = Plan(host_cache_bytes=5, device_cache_bytes=7, knobs=knobs, name="p")
    assert plan.knobs is knobs and Plan().knobs == Knobs()
    d = plan.to_dict()
    assert list(d) == ["host_cache_bytes", "device_cache_bytes", "read_ahead_bytes", *Knobs.names(), "name"]
    assert Plan.from_dict(json.loads(json.dumps(d))) == plan
    assert plan.with_knobs(prefetch_depth=0).knobs == knobs.replace(prefetch_depth=0)
    with pytest.raises(ConfigError, match="unknown knob"):
        plan.with_knobs(prefetch=0)
    # A prediction's JSON (offloadctl plan --json) carries the plan flat.
    pred = predict(ONE_DISK, WL, all_nvme())
    assert pred.to_dict()["plan"] == pred.plan.to_dict() and pred.to_dict()["name"] == pred.plan.name


def test_the_models_layout_is_the_engines(tmp_path):
    """The model counts the engine's layout as the engine lays state out: the figures are
    engine.layout's, and a real engine's staging pool and kept buffers are what the model counts."""
    pytest.importorskip("torch")
    import torch

    from engine import AdamWHyper, EngineConfig, FlatSubgroup, StoragePath, SubgroupEngine, buffers
    from engine.layout import kept_subgroups, staging_buffers
    from engine.placement import device_lane_mask
    from engine.storage import swapfile
    from engine.subgroup import Stage
    from perf import layout

    for numel in (1, 1000, 341, 10_000_000, 123_456_789, 10**10):
        plan = swapfile.ChunkPlan.for_payload(buffers.payload_bytes(numel), layout.CHUNK_BYTES)
        assert layout.chunks(numel) == len(plan.chunks()) + 1  # and the header
    n, sub = 8, 64
    for depth in range(5):
        w, g = torch.zeros(n * sub, device="cpu"), torch.ones(n * sub, device="cpu")  # a host engine, no model
        eng = SubgroupEngine(
            [FlatSubgroup(w[o : o + sub], g[o : o + sub]) for o in range(0, n * sub, sub)],
            EngineConfig(
                subgroup_numel=sub,
                host_cache_bytes=0,
                host_adam="torch",
                io_backend="posix",
                paths=(StoragePath(path=str(tmp_path)),),
            ),
            Knobs(prefetch_depth=depth),
        )
        try:
            assert eng.describe().staging_buffers == staging_buffers(depth)
            eng.step([AdamWHyper(lr=1e-3)])
            kept = sum(sg.stage is Stage.KEPT_DIRTY for sg in eng.subgroups)  # the tail, not the copies of landed writes
            assert kept == min(n, kept_subgroups(depth)), (depth, kept)
        finally:
            eng.close()
    for f in (0.0, 0.05, 1 / 3, 0.5, 0.95, 1.0):
        mask = device_lane_mask(40, f)
        assert [layout.on_device_lane(i, f) for i in range(40)] == mask
        assert all(layout.lane_count(a, b, f) == sum(mask[a:b]) for a in range(40) for b in range(a, 41))


def test_offloadctl_plan_starts_without_torch():
    code = "import sys, perf.model, perf.search, perf.stock, perf.plan, offloadctl.commands.plan; print('torch' in sys.modules)"
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, env=dict(os.environ, PYTHONPATH=ROOT), timeout=60
    )
    assert out.returncode == 0 and out.stdout.strip() == "False", out.stderr


# -- the command --------------------------------------------------------------------------------


def _run_cli(*args, env=None):
    return cli(*args, timeout=120, env=env_with_root(**(env or {})))


def test_parse_params():
    from offloadctl.commands.plan import parse_params

    assert parse_params("7e9") == 7_000_000_000
    assert parse_params("7B") == 7_000_000_000
    assert parse_params("1.5T") == 1_500_000_000_000
    assert parse_params("70m") == 70_000_000
    assert parse_params("125000") == 125_000
    for bad in ("seven", "7X", "-1", "0", ""):
        with pytest.raises(ConfigError, match="--params"):
            parse_params(bad)


def test_plan_json(tmp_path):
    profile_toml = pytest.importorskip("perf.profile_toml")
    prof = machine_profile([disk(str(tmp_path / "nvme"), "nvme0n1", capacity=10**14)], memory=64 << 30)
    profile_toml.save_profile(prof, str(tmp_path / "profiles" / "box.toml"))
    out = _run_cli(
        "plan",
        "--profile",
        "box",
        "--params",
        "20B",
        "--fwd-bwd-s",
        "3",
        "--host-gb",
        "32",
        "--json",
        env={"OFFLOADCTL_PROFILE_DIR": str(tmp_path / "profiles")},
    )
    assert out.returncode == 0, out.stderr
    data = json.loads(out.stdout)
    assert data["best"] == "best" and data["workload"]["params"] == 20 * 10**9
    plans = {p["name"]: p for p in data["plans"]}
    assert plans["best"]["iteration_s"] == pytest.approx(
        3.0 + plans["best"]["update_s"] - plans["best"]["breakdown"]["io_in_fwd_bwd"]
    )
    # Same numbers as the library gives for the same inputs.
    wl = Workload(params=20 * 10**9, fwd_bwd_s=3.0, host_bytes=32 * 10**9)
    assert plans["best"]["update_s"] == pytest.approx(best_plan(prof, wl).update_s)
    assert plans["stock ZeRO-Infinity NVMe"]["iteration_s"] > plans["best"]["iteration_s"]
    assert plans["stock Twin-Flow"]["feasible"] is False and plans["stock Twin-Flow"]["update_s"] is None
    # The table form runs too, and a bad size is one line, no traceback.
    table = _run_cli("plan", "--profile", str(tmp_path / "profiles" / "box.toml"), "--params", "20B", env={"COLUMNS": "200"})
    assert table.returncode == 0 and "best" in table.stdout and "ZeRO-Infinity" in table.stdout
    bad = _run_cli("plan", "--profile", "box", "--params", "20X", env={"OFFLOADCTL_PROFILE_DIR": str(tmp_path / "profiles")})
    assert bad.returncode == 2 and "Traceback" not in bad.stderr and "--params" in bad.stderr
    assert len(bad.stderr.strip().splitlines()) == 1
