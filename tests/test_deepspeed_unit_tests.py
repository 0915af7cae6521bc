"""DeepSpeed's own unit tests of the APIs the engine must keep working, run with the engine
installed in every process, against a checkout of DeepSpeed's repository at a pinned commit.

DeepSpeed's tests are not in its PyPI release, and this project commits none of DeepSpeed's code,
so the checkout comes from outside: ``OFFLOADCTL_DEEPSPEED_SRC`` names it (``bench/ds_unit_tests.sh``
makes one from a fetched snapshot). Without it these tests skip, saying so. The selected tests are
those of ZeRO stage 3 with an offloaded optimizer (the engine refuses stage 3 without one, in one
line; ZeRO 1 and 2 never reach it), with the state on the engine's tiers: a 2 kB host cache, the
rest on an NVMe path, the device tier and device lane run on the CPU.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

pytestmark = pytest.mark.slow

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PINNED_COMMIT = "edaa7221267243c7be7fb49c5d5f5c4fb97b4641"
"""deepspeedai/DeepSpeed at 0.19.6.dev (2026-08-22): the newest snapshot this project could fetch;
its tests of these APIs run against the installed DeepSpeed 0.19.8."""
SELECTED = {
    # The partitioned-state API (get, set, update; local and full; fp32, fp16, bf16), ZeRO-3 with
    # CPU and NVMe optimizer offload: every parametrization of those two.
    "tests/unit/runtime/zero/test_zero_tensor_fragment.py": "cpu-3 or nvme-3",
}
SRC = os.environ.get("OFFLOADCTL_DEEPSPEED_SRC")


@pytest.mark.skipif(
    not SRC,
    reason=f"set OFFLOADCTL_DEEPSPEED_SRC to a DeepSpeed checkout at {PINNED_COMMIT[:12]} (bench/ds_unit_tests.sh makes one)",
)
@pytest.mark.parametrize("path", sorted(SELECTED))
def test_deepspeeds_own_tests_pass_with_the_engine(path, tmp_path):
    nvme = tmp_path / "nvme"
    nvme.mkdir()
    settings = {
        "nvme_paths": [str(nvme)],
        "host_cache_bytes": 2000,
        "lane_device": "cpu",
        "device_cache_bytes": 30000,
        "knobs": {"device_fraction": 0.5, "prefetch_depth": 0},
        "auto_device_fraction": False,
    }
    # LOCAL_SIZE: the CPU accelerator's device count, so that DeepSpeed's 2-rank tests run rather than skip.
    env = dict(
        os.environ,
        OFFLOADCTL_ENGINE_SETTINGS=json.dumps(settings),
        LOCAL_SIZE="2",
        PYTHONPATH=os.pathsep.join([os.path.join(ROOT, "tests", "deepspeed_unit"), ROOT, os.path.join(SRC, "tests")]),
    )
    # -m "": DeepSpeed's pytest.ini deselects its NVMe rows (marked sequential) by default.
    p = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-m", "", os.path.join(SRC, path), "-k", SELECTED[path]],
        capture_output=True,
        text=True,
        env=env,
        cwd=os.path.join(SRC, "tests"),
        timeout=3000,
    )
    tail = p.stdout[-3000:]
    assert p.returncode == 0 and " passed" in tail and " failed" not in tail, tail
