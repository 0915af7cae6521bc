"""Each rank's share of the cores (integrations/cores.py), and a real 2-rank run bound to it."""
from __future__ import annotations

import os
import subprocess
import sys

import pytest

from integrations.cores import bind_rank_cores, rank_cores


@pytest.mark.parametrize("n,size,expect", [
    (16, 8, [[0, 1], [2, 3], [4, 5], [6, 7], [8, 9], [10, 11], [12, 13], [14, 15]]),
    (10, 4, [[0, 1, 2], [3, 4, 5], [6, 7], [8, 9]]),  # the first blocks one larger
    (2, 2, [[0], [1]]),
    (2, 4, [[0], [1], [0], [1]]),  # fewer cores than ranks: one each, shared
    (8, 1, [list(range(8))]),
])
def test_blocks_cover_the_cores_once(n, size, expect):
    got = [rank_cores(range(n), r, size) for r in range(size)]
    assert got == expect
    if n >= size:
        assert sorted(c for block in got for c in block) == list(range(n))


def test_blocks_follow_the_affinity_mask():
    assert rank_cores([8, 9, 10, 11], 1, 2) == [10, 11]


def _in_child(mode: str, env: dict) -> str:
    code = ("import os, sys, torch; sys.path.insert(0, %r); from integrations.cores import bind_rank_cores; "
            "c = bind_rank_cores(%r); print(c, sorted(os.sched_getaffinity(0)), torch.get_num_threads(), "
            "os.environ.get('OMP_NUM_THREADS'))" % (os.path.dirname(os.path.dirname(os.path.abspath(__file__))), mode))
    out = subprocess.run([sys.executable, "-c", code], env={**os.environ, **env}, capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0, out.stderr
    return out.stdout.strip()


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="needs two cores")
def test_a_rank_is_bound_to_its_block_with_as_many_threads():
    cores = sorted(os.sched_getaffinity(0))
    mine = rank_cores(cores, 1, 2)
    assert _in_child("auto", {"LOCAL_RANK": "1", "LOCAL_SIZE": "2"}) == f"{mine} {mine} {len(mine)} {len(mine)}"
    # One rank on the node, or off: nothing changes.
    env = {k: v for k, v in os.environ.items() if k != "OMP_NUM_THREADS"}
    assert _in_child("auto", {**env, "LOCAL_SIZE": "1"}).startswith(f"None {cores}")
    assert _in_child("off", {"LOCAL_RANK": "1", "LOCAL_SIZE": "2"}).startswith(f"None {cores}")
    assert _in_child("on", {"LOCAL_RANK": "0", "LOCAL_SIZE": "1"}) == f"{cores} {cores} {len(cores)} {len(cores)}"


def test_bind_off_leaves_the_process_alone():
    before = os.sched_getaffinity(0)
    assert bind_rank_cores("off", {"LOCAL_RANK": "0", "LOCAL_SIZE": "4"}) is None
    assert os.sched_getaffinity(0) == before
