"""One host-memory budget per rank, counted by the engine, kept by the tuner, and given back
under pressure (engine.host_memory); knobs the run's options fix stay where they are through a
tuned run. Real engines, real files, real memory, a real daemon."""

from __future__ import annotations

import copy
import ctypes
import json
import logging
import os
import subprocess
import sys

import psutil
import pytest
import torch
from helpers import assert_params_close, feed_same_grads, make_model
from helpers import wait_for as _wait

from engine import Knobs, OffloadAdamW
from engine.config import StoragePath
from engine.errors import ConfigError
from engine.layout import host_buffer_bytes, kept_subgroups, staging_buffers

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _rss() -> int:
    """Resident bytes, less what the C library keeps of freed memory (``malloc_trim``)."""
    ctypes.CDLL("libc.so.6").malloc_trim(0)
    return psutil.Process().memory_info().rss


def test_every_step_stays_in_budget_and_rss_follows_what_the_engine_counts(swap_dir):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(2048, 2048), torch.nn.Linear(2048, 2048))  # 8.4M params
    sub = 1 << 20
    budget = 200 * 10**6
    # Bandwidth declared: no probe (its 64 MB buffer would come and go in the middle of the count).
    path = StoragePath(path=swap_dir, read_bytes_per_s=1e9, write_bytes_per_s=1e9)
    opt = OffloadAdamW(
        model.parameters(), nvme_paths=[path], subgroup_numel=sub, io_backend="posix", host_adam="torch", host_memory_bytes=budget
    )
    rss0 = _rss()  # after the first construction's imports; the engine's buffers are untouched until used
    try:
        feed_same_grads([(model, opt)], steps=5)
        grown = _rss() - rss0
        records = opt.engine.telemetry.records
        buf = host_buffer_bytes(sub)
        for r in records:
            total = r.host_bytes.total
            assert r.host_budget_bytes == budget and 0 < total <= budget, r.host_bytes
            assert r.host_bytes.state == 0  # paths given, no --host-cache: no state kept in memory
            # The working buffers and the read-ahead budget's; kept: the tail, and copies whose writes landed.
            assert r.host_bytes.staging + r.host_bytes.kept == staging_buffers(2) * buf + r.read_ahead_bytes
            assert r.host_bytes.kept >= kept_subgroups(2) * buf
            assert not r.host_pressure
        # What the process grew by is what the engine counts, and the gradients (two fp32 copies
        # of the model's: the generator's and the one set as .grad), give or take 32 MB.
        grads = 2 * 4 * sum(p.numel() for p in model.parameters())
        counted = records[-1].host_bytes.total
        assert grown <= counted + grads + (32 << 20), (grown, counted, grads)
        facts = opt.engine.describe()
        assert facts.host_memory_budget_bytes == budget and 0 < facts.host_bytes.total <= budget
        assert json.dumps(facts.to_dict()["host_bytes"]) == json.dumps(facts.host_bytes.to_dict())  # the run record's, as before
    finally:
        opt.close()


def _within_buffers(model, swap_dir, sub: int, buffers: int) -> OffloadAdamW:
    """An engine whose host budget holds ``buffers`` staging buffers of ``sub`` elements and the copies."""
    return OffloadAdamW(
        model.parameters(),
        nvme_paths=[swap_dir],
        subgroup_numel=sub,
        io_backend="posix",
        host_adam="torch",
        host_memory_bytes=buffers * host_buffer_bytes(sub) + 4096,
    )


@pytest.mark.parametrize("pinned", [None, 2], ids=["depth-free", "depth-pinned"])
def test_a_budget_the_start_does_not_fit_is_one_clear_error(swap_dir, pinned):
    model = make_model()
    with pytest.raises(ConfigError) as e:
        OffloadAdamW(
            model.parameters(), nvme_paths=[swap_dir], subgroup_numel=500, host_memory_bytes=10_000, prefetch_depth=pinned
        )
    msg = str(e.value)
    # A depth nobody pinned is lowered first, so the refusal names depth 0's needs; a pinned one stays.
    depth = 0 if pinned is None else pinned
    assert "\n" not in msg and "host memory budget" in msg and f"prefetch depth {depth}" in msg and "staging" in msg, msg
    assert ("--prefetch-depth" in msg) == bool(depth), msg  # no fix offered that cannot help
    assert os.listdir(swap_dir) == []  # refused before any swap file was made
    # It names the smallest budget that starts (issue 43): that one starts.
    from engine.units import parse_size

    smallest = parse_size(msg.split("give --host-memory ", 1)[1].split(" or more")[0], flag="--host-memory")
    opt = OffloadAdamW(
        model.parameters(), nvme_paths=[swap_dir], subgroup_numel=500, host_memory_bytes=smallest, prefetch_depth=pinned
    )
    assert opt.engine.knobs.prefetch_depth == depth
    opt.close()


def test_a_small_budget_starts_at_the_deepest_prefetch_it_holds(swap_dir, caplog):
    """Issue 45 item 2: a --host-memory below the default depth's staging starts shallower (one
    line says so) and the updates stay AdamW's; the tuner may go deeper only within the budget."""
    sub = 500
    model, ref = make_model(), make_model()
    # Staging for depth 1 (5 buffers) and the copies, not for depth 2 (7).
    with caplog.at_level(logging.WARNING, logger="engine.host_memory"):
        opt = _within_buffers(model, swap_dir, sub, 5)
    try:
        assert opt.engine.knobs.prefetch_depth == 1
        said = [m for m in caplog.messages if "prefetch_depth=2 lowered to 1 at the start" in m]
        assert len(said) == 1, caplog.messages
        feed_same_grads([(model, opt), (ref, torch.optim.AdamW(ref.parameters()))], steps=3)
        assert_params_close(model, ref)
        records = opt.engine.telemetry.records
        assert [r.knobs.prefetch_depth for r in records] == [1, 1, 1]
        assert all(r.host_bytes.total <= r.host_budget_bytes for r in records)
    finally:
        opt.close()


def test_a_deeper_prefetch_than_the_budget_holds_is_lowered(swap_dir, caplog):
    model = make_model()
    sub = 500
    # Staging for depth 3 (9 buffers) and the copies, not for depth 4 (11).
    opt = _within_buffers(model, swap_dir, sub, 9)
    try:
        feed_same_grads([(model, opt)], steps=1)
        opt.set_knobs(Knobs(prefetch_depth=8))
        with caplog.at_level(logging.WARNING, logger="engine.core"):
            feed_same_grads([(model, opt)], steps=2)
        assert opt.engine.knobs.prefetch_depth == 3
        assert [r.knobs.prefetch_depth for r in opt.engine.telemetry.records] == [2, 3, 3]
        said = [m for m in caplog.messages if "prefetch_depth=8 lowered to 3" in m]
        assert len(said) == 1, caplog.messages
        assert all(r.host_bytes.total <= r.host_budget_bytes for r in opt.engine.telemetry.records)
    finally:
        opt.close()


def test_memory_pressure_gives_back_kept_buffers_and_the_math_stays_exact(swap_dir, caplog, monkeypatch):
    """The machine's available memory drops below the floor between steps (a real 3 GiB
    allocation): the engine writes back and frees its kept and read-ahead buffers, says so
    once, steps on without them, and takes them again when the memory is back. Every step
    stays equal to torch AdamW. The available memory the engine reads follows this test's own
    allocation only: other processes on the machine (another test worker's trainings) move the
    real figure by gigabytes, which would move the pressure's start and end under the test."""
    sub = 500
    real = psutil.virtual_memory
    start, held = real().available, {"bytes": 0}
    monkeypatch.setattr(psutil, "virtual_memory", lambda: real()._replace(available=start - held["bytes"]))
    floor = start - (2 << 30)  # 2 GiB below what is available: the 3 GiB allocation goes under it
    model = make_model()
    ref = copy.deepcopy(model)
    opt = OffloadAdamW(
        model.parameters(),
        lr=1e-2,
        nvme_paths=[swap_dir],
        subgroup_numel=sub,
        io_backend="posix",
        host_adam="torch",
        host_memory_floor_bytes=floor,
    )
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2, weight_decay=0.01)
    buf = host_buffer_bytes(sub)
    pairs = [(model, opt), (ref, ref_opt)]
    try:
        with caplog.at_level(logging.WARNING, logger="engine.host_memory"):
            feed_same_grads(pairs, steps=3, seed=1)
            assert opt.engine.host_usage().kept >= kept_subgroups(2) * buf
            hog = torch.ones(3 << 28)  # 3 GiB, every page touched
            held["bytes"] = hog.numel() * hog.element_size()
            try:
                # The watch's thread gives back at once: the engine is idle between steps.
                _wait(lambda: opt.engine.host_usage().kept == 0, 10, "the give-back")
                assert opt.engine.host_usage().staging <= 2 * buf
                feed_same_grads(pairs, steps=3, seed=2)
                under = opt.engine.telemetry.records[-3:]
                assert all(r.host_pressure and r.cache_hits == 0 and r.host_bytes.kept == 0 for r in under)
            finally:
                del hog
                held["bytes"] = 0
            _wait(lambda: not opt.engine.host_memory.low, 10, "the memory back")
            feed_same_grads(pairs, steps=3, seed=3)
        after = opt.engine.telemetry.records[-2:]
        assert all(not r.host_pressure and r.cache_hits > 0 for r in after)
        assert (
            opt.engine.host_usage().staging + opt.engine.host_usage().kept
            == staging_buffers(2) * buf + opt.engine.transfers.read_ahead_bytes
        )
        low = [m for m in caplog.messages if "host memory low" in m]
        assert len(low) == 1 and "gave back" in low[0], caplog.messages
        assert sum("host memory recovered" in m for m in caplog.messages) == 1
        assert_params_close(model, ref)
    finally:
        opt.close()


def test_the_tuner_keeps_within_the_spare_budget():
    from tuner.policy import Policy
    from tuner.policy_config import PolicyConfig
    from tuner.run_state import RunFacts

    sub = 12 << 20
    pol = Policy(
        Knobs(),
        RunFacts(paths=("/nvme0",), subgroup_bytes=sub, params=10**9, host_staging_bytes=5 * sub),
        PolicyConfig(max_prefetch_depth=16),
    )
    assert pol._limits.prefetch_cap() == 1  # 5 buffers: depth 1 (2 * 1 + 3)
    roomy = Policy(
        Knobs(),
        RunFacts(paths=("/nvme0",), subgroup_bytes=sub, params=10**9, host_staging_bytes=100 * sub),
        PolicyConfig(max_prefetch_depth=16),
    )
    assert roomy._limits.prefetch_cap() == 16


def test_fixed_knobs_are_pins_from_the_start():
    from tuner.policy import Policy
    from tuner.run_state import RunFacts

    pol = Policy(
        Knobs(prefetch_depth=2),
        RunFacts(paths=("/nvme0",), subgroup_bytes=1 << 20, pins={"prefetch_depth": 2, "io_concurrency[/nvme0]": 4}),
    )
    assert pol.pins == {"prefetch_depth": 2, "io_concurrency[/nvme0]": 4}
    assert pol.state()["fixed"] == ["prefetch_depth", "io_concurrency[/nvme0]"]
    assert "fixed by the run's options" in pol.log[-1]["reason"]
    pol.unpin("prefetch_depth")  # the user may still let it go, explicitly
    assert pol.state()["fixed"] == ["io_concurrency[/nvme0]"]


def _serve(sock: str) -> subprocess.Popen:
    from tuner import service

    logf = open(sock + ".log", "ab")
    proc = subprocess.Popen(
        [sys.executable, "-m", "offloadctl.cli", "tuner", "serve", "--socket", sock, "--db", "none", "--no-sensors"],
        cwd=ROOT,
        stdout=logf,
        stderr=logf,
    )
    logf.close()
    _wait(lambda: service.probe(sock, timeout_s=0.5) is not None or proc.poll() is not None, 60, "daemon start")
    assert proc.poll() is None, open(sock + ".log").read()
    return proc


def _tuned_run(sock: str, swap: str, run_id: str, iterations: int, until=None, **fixed) -> list[Knobs]:
    """OffloadAdamW on a path capped at 40 MB/s (its reads dominate the step), tuned by the real
    policy; the knobs of every step, for ``iterations`` or until ``until(knobs)`` holds. Nothing is
    read ahead during backward: on a busy machine a slow backward hid every read, the update waited
    on no I/O, and the tuner rightly held (the knobs could change 0% of the iteration)."""
    from tuner.client import TunerClient

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(512, 512), torch.nn.Linear(512, 512))
    path = StoragePath(path=swap, cap_bytes_per_s=40e6, read_bytes_per_s=40e6, write_bytes_per_s=40e6)
    opt = OffloadAdamW(
        model.parameters(),
        nvme_paths=[path],
        subgroup_numel=1 << 16,
        io_backend="posix",
        host_adam="torch",
        read_ahead_bytes=0,
        **fixed,
    )
    try:
        TunerClient.for_engine(sock, opt.engine, run_id=run_id)
        for _ in range(iterations):
            feed_same_grads([(model, opt)], steps=1)
            if until is not None and until(opt.engine.telemetry.records[-1].knobs):
                break
        return [r.knobs for r in opt.engine.telemetry.records]
    finally:
        opt.close()


@pytest.mark.slow
def test_a_fixed_prefetch_depth_stays_through_a_tuned_run_that_moves_it_otherwise(tmp_path):
    from tuner.protocol import Connection

    sock = str(tmp_path / "tuner.sock")
    daemon = _serve(sock)
    try:
        # How soon the tuner moves a free prefetch depth depends on the noise it measures (a
        # busy machine holds longer): the free run goes until it has, the pinned one as long again.
        free = _tuned_run(sock, _mkdir(tmp_path / "a"), "free", 80, until=lambda k: k.prefetch_depth != 2)
        if not any(k.prefetch_depth != 2 for k in free):
            with Connection(sock) as c:  # why it held, for the failure: the policy's word and the log's
                held = [r.get("policy") for r in c.request("snapshot", history=0)["runs"] if r["run_id"] == "free"]
            log = open(sock + ".log").read()[-2000:]
            raise AssertionError(f"the tuner never moved the prefetch in {len(free)} iterations: {held}\n{log}")
        fixed = _tuned_run(sock, _mkdir(tmp_path / "b"), "fixed", max(24, len(free) + 8), prefetch_depth=2)
        assert all(k.prefetch_depth == 2 for k in fixed), [k.prefetch_depth for k in fixed]
        with Connection(sock) as c:
            runs = {r["run_id"]: r for r in c.request("snapshot", history=0)["runs"]}
        assert runs["fixed"]["pins"] == {"prefetch_depth": 2} and runs["free"]["pins"] == {}
        assert runs["fixed"]["policy"]["fixed"] == ["prefetch_depth"]
    finally:
        daemon.terminate()
        daemon.wait(10)


def _mkdir(p) -> str:
    p.mkdir()
    return str(p)


def test_train_takes_host_memory_and_fixes_the_knobs_it_is_given(tmp_path):
    import json

    script = os.path.join(ROOT, "tests", "ds_scripts", "train_tiny.py")
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "offloadctl.cli",
            "train",
            "--dry-run",
            "--json",
            "--nvme",
            str(tmp_path),
            "--host-memory",
            "2GB",
            "--prefetch-depth",
            "3",
            "--run-dir",
            str(tmp_path / "run"),
            script,
        ],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=ROOT,
    )
    assert out.returncode == 0, out.stderr
    settings = json.loads(out.stdout)["settings"]
    assert settings["host_memory_bytes"] == 2 * 10**9 and settings["pins"] == {"prefetch_depth": 3}
    assert not (tmp_path / "run").exists()


# -- host memory bandwidth: what the host lane is bound by ------------------------------------------


def test_a_ranks_memory_bandwidth_is_the_lower_of_its_own_and_its_share():
    from engine.lane_model import memory_share

    assert memory_share(12e9, 80e9, 8) == 10e9  # eight ranks share the node's 80 GB/s
    assert memory_share(6e9, 80e9, 8) == 6e9  # its own threads move less than its share
    assert memory_share(12e9, None, 4) == 3e9  # no node figure: its own, shared
    assert memory_share(12e9, 80e9, 1) == 12e9


def test_the_lane_balance_uses_the_nodes_bandwidth_share(monkeypatch, tmp_path):
    """The first step's lane rates used this process's copy rate divided by the node's ranks: a
    rank bound to 8 of 64 cores measured a fraction of the node and then divided it again. The
    memory rate is the lower of its own and its share of the node's, measured once with every core."""
    import engine.device_tier
    from engine.binding import FlatSubgroup
    from engine.config import EngineConfig
    from engine.core import SubgroupEngine

    monkeypatch.setattr(engine.device_tier, "measure_lane_rates", lambda device: (50e9, 50e9, 80e9, 12e9))
    monkeypatch.setattr(engine.device_tier, "host_lane_rate", lambda name: 1e9)
    monkeypatch.setattr(engine.device_tier, "node_memory_bandwidth", lambda: 80e9)
    eng = SubgroupEngine(
        [FlatSubgroup(torch.zeros(100), torch.zeros(100))],
        EngineConfig(device="cpu", host_cache_bytes=None, device_cache_bytes=0, host_adam="torch", local_ranks=8),
    )
    assert eng.device_tier.lane_rates().memory_bytes_per_s == 10e9
    eng.close()


def test_the_nodes_bandwidth_is_measured_once_and_kept(monkeypatch, tmp_path):
    import engine.host_kernel as hk

    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path))
    calls = []
    monkeypatch.setattr(hk, "_measure_node_bandwidth", lambda: calls.append(1) or 42e9)
    assert hk.node_memory_bandwidth(measure=False) is None
    assert hk.node_memory_bandwidth() == 42e9 and hk.node_memory_bandwidth() == 42e9
    assert calls == [1]
    assert (tmp_path / hk.MEMORY_BANDWIDTH_FILE).is_file()
    hk.keep_node_memory_bandwidth(50e9)  # what `profile save` measured
    assert hk.node_memory_bandwidth() == 50e9 and calls == [1]


# A bound rank's measurement of the node, in a real taskset and cpuset: tests/test_cpuset_probe.py.


def test_profile_save_keeps_the_nodes_bandwidth_and_info_shows_it(monkeypatch):
    import engine.host_kernel as hk
    import perf.probe
    from offloadctl.commands import info

    kept = []
    monkeypatch.setattr(hk, "keep_node_memory_bandwidth", lambda v: kept.append(v))
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(os.cpu_count())))
    monkeypatch.setattr(torch, "get_num_threads", lambda: os.cpu_count())
    fig = perf.probe.measure_memory_bandwidth(1 << 20, 1)
    assert kept == [2 * fig.value]  # read plus written
    data = {
        "offloadctl": "x",
        "torch": "x",
        "deepspeed": "x",
        "deepspeed_integration": "ok",
        "gpus": [],
        "native_ops": {},
        "io_backends": [],
        "host_adamw_params_per_s": {},
        "host_adamw_kernel": "torch",
        "host_lane_params_per_s": 1e9,
        "host_memory_bytes_per_s": 28e9,
        "host_lane_memory_bound_params_per_s": 1e9,
    }
    from rich.console import Console

    con = Console(width=400, record=True)  # the kept files' paths are long on CI: no wrap inside a figure
    con.print(info.info_table(data))
    text = con.export_text()
    assert "host memory" in text and "28 GB/s read and written" in text and "28 B a parameter" in text


_HEAP_LOOP = r"""
import resource, sys, psutil, torch
from engine import heap
if sys.argv[1] == "keep":
    assert heap.keep_freed()
torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(1024, 4096), torch.nn.GELU(), torch.nn.Linear(4096, 1024))
x = torch.randn(4096, 1024)
faults = []
for _ in range(12):  # forward and backward: activations and gradients made and freed each time
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    model(x).square().mean().backward()
    faults.append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
del model, x
held = psutil.Process().memory_info().rss
heap.release_freed()
print(sorted(faults[-6:])[3], held - psutil.Process().memory_info().rss)  # the median of the last six
"""


@pytest.mark.parametrize("policy", ["keep", "system"])
def test_a_kept_heap_serves_the_next_iteration_without_page_faults_and_gives_it_back_on_release(policy):
    """engine.heap in a process of its own (its policy is the process's), on a forward and
    backward on the CPU: glibc's own policy maps the activations fresh every iteration (about
    50,000-90,000 page faults here); with ``keep_freed`` most of the last iterations take none, and
    ``release_freed`` hands what was kept back to the system."""
    r = subprocess.run([sys.executable, "-c", _HEAP_LOOP, policy], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    faults, released = map(int, r.stdout.split())
    if policy == "keep":
        assert faults < 1000, faults
        assert released > 100 << 20, released
    else:
        assert faults > 10000, faults  # what keep_freed saves: the check above could fail


_HEAP_GROWING = r"""
import psutil, torch
from engine import OffloadAdamW, heap
assert heap.keep_freed()
model = torch.nn.Linear(64, 64)
opt = OffloadAdamW(model.parameters(), host_adam="torch")
watch = heap.KeptHeapWatch()
opt.add_step_hook(watch)
held, releases = [], []
for step in range(20):
    held.append(torch.ones(16 << 20))  # 64 MiB more each step, outside the engine
    model.weight.grad = torch.ones_like(model.weight)
    model.bias.grad = torch.ones_like(model.bias)
    opt.step()
    releases.append(watch.releases)
print(int(watch.given_up), releases.index(1), releases.index(3), watch.releases)
"""


def test_a_rank_whose_memory_keeps_growing_returns_to_the_c_librarys_policy():
    """Memory outside the engine that keeps growing (here the script holds it; a kept heap
    with holes it cannot reuse grows the same way): the watch gives the kept pages back each
    step the growth passes a quarter of the settled size, the third time returns the rank to
    glibc's policy with one line, and checks no more."""
    from engine.heap import KeptHeapWatch

    r = subprocess.run([sys.executable, "-c", _HEAP_GROWING], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    given_up, first, third, releases = map(int, r.stdout.split())
    assert given_up == 1 and releases == 3, r.stdout
    assert KeptHeapWatch.SETTLE_STEPS <= first < third, r.stdout  # not before it settled
    assert "back to the C library's default" in r.stderr


_HEAP_RESTORED = r"""
import resource, torch
from engine import heap
assert heap.keep_freed()
heap.restore_default()
faults = []
for _ in range(4):
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    t = torch.empty(16 << 20)
    t.fill_(1.0)
    del t
    faults.append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
print(min(faults))
"""


def test_the_c_librarys_policy_restored_maps_large_blocks_again():
    """What the watch falls back to where a kept heap keeps growing: a 64 MiB block is mapped
    and unmapped again (16,384 pages faulted each time), as glibc does by default."""
    r = subprocess.run([sys.executable, "-c", _HEAP_RESTORED], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    assert int(r.stdout) >= (64 << 20) // os.sysconf("SC_PAGE_SIZE") // 2, r.stdout
