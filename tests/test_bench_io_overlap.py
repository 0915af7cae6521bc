"""bench/io_overlap.py and bench/zi_aio_sweep.py: the floor and the goals from hand-made figures, the
sweep's choice read back (or refused), the sweep's pick and log parsing, and no root: a skip, exit 0."""

from __future__ import annotations

import json
import os
import subprocess

import pytest
from helpers import load_bench

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


_load = load_bench


@pytest.fixture(scope="module")
def bench():
    return _load("io_overlap")


@pytest.fixture(scope="module")
def sweep():
    return _load("zi_aio_sweep")


CEIL = {"nvme": {"read": 400e6, "write": 400e6, "mixed": 800e6}, "pfs": {"read": 200e6, "write": 200e6, "mixed": 400e6}}


def test_floor_is_the_slowest_tier_with_its_directions_overlapping(bench):
    f = bench.io_floor({"nvme": 800e6, "pfs": 200e6}, {"nvme": 400e6, "pfs": 300e6}, CEIL)
    # nvme: read 2.0 s, write 1.0 s; pfs: read 1.0 s, write 1.5 s
    assert f["floor_s"] == pytest.approx(2.0)
    assert f["sum_s"] == pytest.approx(3.0)  # nvme 2.0 + 1.0 against pfs 1.0 + 1.5
    assert f["mixed_s"] == pytest.approx(1.5)  # nvme 1200 MB at 800 MB/s against pfs 500 MB at 400 MB/s
    assert f["per_tier"]["pfs"] == pytest.approx({"read_s": 1.0, "write_s": 1.5, "mixed_s": 1.25})
    assert bench.io_floor({}, {}, CEIL)["floor_s"] == 0.0  # all cached: nothing moves
    assert bench.io_floor({"nvme": 0}, {"nvme": 400e6}, CEIL)["floor_s"] == pytest.approx(1.0)


def test_goals_use_the_no_overlap_compute_and_the_tuned_anchor(bench):
    nvme, half, two = bench.CONFIGS
    report = {
        bench.ZI: {"iter_s": 6.0, "fwd_bwd_s": 1.2},
        # floor 2.0 s (800 MB read from nvme), compute 0.9 s from the twin: bound 1.15 x 2.0 = 2.3
        nvme: {"iter_s": 2.9, "fwd_bwd_s": 1.0, "tier_bytes_read": {"nvme": 800e6}, "tier_bytes_written": {"nvme": 400e6}},
        nvme + bench.NO_OVERLAP: {"iter_s": 4.0, "fwd_bwd_s": 0.9},
        # no twin: its own forward and backward (1.6 s) is the compute time; floor 0.5 s; bound 1.84
        half: {"iter_s": 1.8, "fwd_bwd_s": 1.6, "tier_bytes_read": {"nvme": 200e6}, "tier_bytes_written": {"nvme": 200e6}},
    }
    goals = {g["config"]: g for g in bench.evaluate_goals(report, CEIL)}
    assert set(goals) == {nvme, half}  # nvme+pfs was not run: no row
    g = goals[nvme]
    assert g["compute_s"] == 0.9 and g["compute_from"] == "no-overlap run" and g["own_fwd_bwd_s"] == 1.0
    assert g["goal1_bound_s"] == pytest.approx(2.3) and g["goal1"] is False
    assert g["speedup"] == pytest.approx(6.0 / 2.9) and g["goal2_target"] == 2.0 and g["goal2"] is True
    assert g["no_overlap_iter_s"] == 4.0
    h = goals[half]
    assert h["compute_s"] == 1.6 and h["compute_from"].startswith("own run")
    assert h["goal1_bound_s"] == pytest.approx(1.84) and h["goal1"] is True
    assert h["speedup"] == pytest.approx(6.0 / 1.8) and h["goal2_target"] == 2.8 and h["goal2"] is True
    report[half]["iter_s"] = 2.5  # 2.4x: under 2.8x, and over the bound
    h = {g["config"]: g for g in bench.evaluate_goals(report, CEIL)}[half]
    assert h["goal1"] is False and h["goal2"] is False
    assert [bench.CONFIGS[k][1] for k in (nvme, half, two)] == [2.0, 2.8, 3.5]


def test_summary_takes_iterations_three_on_and_the_median_over_rounds(bench):
    runs = [
        {
            "iter_s": [9.0, 9.0, 3.0, 3.2, 3.1],
            "step_s": [5.0, 5.0, 1.0, 1.1, 1.2],
            "tier_bytes_read": {"nvme": 100},
            "tier_bytes_written": {"nvme": 50},
            "read_ahead_bytes": None,
        },
        {
            "iter_s": [9.0, 9.0, 2.0, 2.0, 2.0],
            "step_s": [5.0, 5.0, 0.5, 0.5, 0.5],
            "tier_bytes_read": {"nvme": 300, "pfs": 10},
            "tier_bytes_written": {"nvme": 70},
            "read_ahead_bytes": 64,
        },
    ]
    s = bench.summarize(runs)
    assert s["rounds_iter_s"] == [3.1, 2.0]
    assert s["iter_s"] == pytest.approx(2.55) and s["step_s"] == pytest.approx((1.1 + 0.5) / 2)
    assert s["fwd_bwd_s"] == pytest.approx((2.0 + 1.5) / 2)
    assert s["tier_bytes_read"] == {"nvme": 200, "pfs": 5} and s["tier_bytes_written"] == {"nvme": 60}
    assert s["read_ahead_bytes"] == 64


def test_the_sweep_choice_is_read_back_and_a_bad_one_refused(bench, tmp_path):
    good = tmp_path / "sweep.json"
    good.write_text(
        json.dumps(
            {
                "choice": {
                    "block_size": 262144,
                    "queue_depth": 16,
                    "intra_op_parallelism": 2,
                    "buffer_count": 8,
                    "single_submit": False,
                },
                "points": [],
            }
        )
    )
    setting, source = bench.load_zi_aio(str(good))
    assert setting == {"block_size": 262144, "queue_depth": 16, "intra_op_parallelism": 2, "buffer_count": 8}
    assert source.startswith("tuned")
    setting, source = bench.load_zi_aio(None, default=str(good))
    assert setting["buffer_count"] == 8 and source.startswith("tuned")
    setting, source = bench.load_zi_aio(None, default=str(tmp_path / "none.json"))
    assert setting == {"block_size": 1048576, "queue_depth": 8, "intra_op_parallelism": 1, "buffer_count": 16}
    assert "defaults" in source and "untuned" in source
    bad = tmp_path / "bad.json"
    for text in (
        "{",
        json.dumps({"points": []}),
        json.dumps({"choice": {"block_size": 4096, "queue_depth": 8}}),
        json.dumps({"choice": {"block_size": 0, "queue_depth": 8, "intra_op_parallelism": 1, "buffer_count": 4}}),
        json.dumps({"choice": {"block_size": 4096, "queue_depth": True, "intra_op_parallelism": 1, "buffer_count": 4}}),
    ):
        bad.write_text(text)
        with pytest.raises(ValueError, match="--zi-aio"):
            bench.load_zi_aio(str(bad))
    with pytest.raises(ValueError, match="--zi-aio"):
        bench.load_zi_aio(str(tmp_path / "missing.json"))  # given, so it must be there


def test_the_sweep_picks_the_best_sum_and_the_smaller_block_on_a_tie(sweep):
    def pts(block, depth, par, r, w):
        return [
            {"op": "read", "block_size": block, "queue_depth": depth, "io_parallel": par, "MBps": r},
            {"op": "write", "block_size": block, "queue_depth": depth, "io_parallel": par, "MBps": w},
        ]

    points = pts(1 << 20, 8, 1, 420, 418) + pts(8 << 20, 32, 2, 425, 421) + pts(128 << 10, 4, 1, 300, 390)
    points += [{"op": "read", "block_size": 256 << 10, "queue_depth": 8, "io_parallel": 1, "MBps": 900}]  # no write: out
    a = sweep.pick_aio(points, tie=0.02)
    assert (a["block_size"], a["queue_depth"], a["intra_op_parallelism"]) == (1 << 20, 8, 1)  # 838 vs 846: a tie
    assert a["sum_MBps"] == 838 and a["best_sum_MBps"] == 846 and a["ties"] == 2
    a = sweep.pick_aio(points, tie=0.0)
    assert (a["block_size"], a["queue_depth"], a["intra_op_parallelism"]) == (8 << 20, 32, 2)
    with pytest.raises(ValueError):
        sweep.pick_aio(pts(1 << 20, 8, 1, None, 400), tie=0.02)


def test_ds_io_logs_are_read_in_mb_per_s(sweep):
    log = "Task Read Speed = 0.5 GB/sec\nE2E Read Latency = 0.9 sec\nE2E Read Speed = 0.390625 GB/sec\n"
    assert sweep.parse_log(log, "read") == pytest.approx(0.390625 * 1073.741824)
    assert sweep.parse_log(log, "write") is None
    assert sweep.parse_log("E2E Write Speed = 1 GB/sec", "write") == pytest.approx(1073.741824)
    assert sweep.log_name("write", "128K", 4, 2) == "write_block_overlap_ftd1_d4_bs128K_p2.txt"
    assert sweep.size_bytes("128K") == 131072 and sweep.size_bytes("4M") == 4 << 20


@pytest.mark.parametrize("which", ["io_overlap", "zi_aio_sweep"])
def test_without_root_it_says_skipping_and_exits_0(which, bench, sweep, monkeypatch, capsys):
    mod = {"io_overlap": bench, "zi_aio_sweep": sweep}[which]
    monkeypatch.setattr(os, "geteuid", lambda: 1000)

    def no_processes(*a, **k):
        raise AssertionError(f"started a process without root: {a}")

    monkeypatch.setattr(subprocess, "run", no_processes)
    monkeypatch.setattr(subprocess, "Popen", no_processes)
    assert mod.main([]) == 0
    err = capsys.readouterr().err
    assert err.startswith("skipping: ") and "root" in err
