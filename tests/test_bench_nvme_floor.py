"""bench/nvme_floor.py (issue 45 item 2): the floors of a run from hand-made figures, the pairs'
order, and the per-phase bytes read back from a recorder's records."""

from __future__ import annotations

import os

import pytest
from helpers import load_bench

from engine.layout import STATE_BYTES_PER_ELEMENT, host_buffer_bytes

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


_load = load_bench


@pytest.fixture(scope="module")
def bench():
    return _load("nvme_floor")


def _run(read_mb: float, written_mb: float, pool_buffers: int, numel: int) -> dict:
    return {
        "tier_bytes_read": {"nvme": read_mb * 1e6},
        "tier_bytes_written": {"nvme": written_mb * 1e6},
        "phases": {"forward": {"s": 0.1}, "backward": {"s": 0.9}, "update": {"s": 2.4}},
        "kernel_s": 0.25,
        "staging_pool_bytes": pool_buffers * host_buffer_bytes(numel),
    }


def test_the_floors_of_a_run(bench):
    ceiling = {"read": 350e6, "write": 450e6, "mixed": 800e6}
    f = bench.floors(_run(700, 900, 15, 2_000_000), ceiling, subgroups=48, subgroup_numel=2_000_000)
    assert f["io_floor_s"] == pytest.approx(2.0)  # the writes: 900 MB at 450 MB/s, beside 2.0 s of reads
    assert f["compute_s"] == pytest.approx(1.25) and f["fwd_bwd_s"] == pytest.approx(1.0)
    assert f["iteration_floor_s"] == pytest.approx(2.0)
    assert f["buffers"] == 15
    # The update reads what 15 buffers cannot hold before it: 33 subgroups of 24 MB.
    assert f["budget_floor_s"] == pytest.approx(1.0 + 33 * STATE_BYTES_PER_ELEMENT * 2_000_000 / 350e6)
    # A budget holding every subgroup leaves the I/O floor.
    g = bench.floors(_run(700, 900, 48, 2_000_000), ceiling, subgroups=48, subgroup_numel=2_000_000)
    assert g["budget_floor_s"] == pytest.approx(2.0)


def test_pairs_alternate_which_runs_first(bench):
    assert [bench.pair_order(k) for k in range(3)] == [(bench.ZI, bench.OURS), (bench.OURS, bench.ZI), (bench.ZI, bench.OURS)]


def test_phase_io_reads_the_records_medians():
    from bench._runs import phase_io

    def it(n, fwd, upd):
        return {
            "type": "iteration",
            "iteration": n,
            "sums": {"forward": 0.1, "backward": 0.5, "update": 2.0},
            "io": {"forward": {"loop0": fwd}, "update": {"loop0": upd, "loop1": [1, 1]}},
        }

    recs = [
        {"type": "header"},
        it(0, [9, 9], [9, 9]),
        it(1, [9, 9], [9, 9]),
        it(2, [0, 10], [100, 200]),
        it(3, [0, 20], [300, 400]),
    ]
    recs.append({**it(4, [0, 0], [0, 0]), "skipped": True})
    out = phase_io(recs)
    assert out["forward"] == {"s": 0.1, "read": 0, "written": 15}
    assert out["update"] == {"s": 2.0, "read": 201, "written": 301}
    assert out["backward"] == {"s": 0.5, "read": 0, "written": 0}
