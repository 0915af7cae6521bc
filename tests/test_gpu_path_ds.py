"""The GPU path under a real DeepSpeed run (one launch): offload_states()/reload_states() on a GPU.

Only a GPU shows where DeepSpeed's gradient buffer ends up and what the device fit measures
after a cycle; the bookkeeping is checked on the CPU by tests/test_gpu_path_zero3.py. Skipped
without CUDA; run by the GPU session.
"""

from __future__ import annotations

import json
import os

import pytest
from helpers import ROOT, cli, env_with_root, free_port, needs_cuda

pytestmark = pytest.mark.slow


@needs_cuda
def test_cuda_offload_and_reload_states_refit_as_at_the_first_step(tmp_path):
    """On a GPU, through DeepSpeed: after offload_states()/reload_states() at step 3 the
    device tier and the lane gradients kept on the GPU are what the first step's fit gave (the
    refit is the same fit, from a fresh peak), and the run finishes."""
    run = tmp_path / "run"
    out = cli(
        "train",
        "--num_gpus",
        "1",
        "--master_port",
        free_port(),
        "--tuner",
        "off",
        "--run-dir",
        str(run),
        os.path.join(ROOT, "tests", "ds_scripts", "train_tiny.py"),
        "--steps",
        "6",
        "--dtype",
        "bf16",
        "--offload-states-at",
        "3",
        "--offload-include",
        "all",
        "--losses-out",
        str(tmp_path / "losses.jsonl"),
        env=env_with_root(),
        timeout=900,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    recs = [json.loads(line) for line in open(run / "telemetry-rank0.jsonl")]
    assert len(recs) == 6
    first, after = recs[1], recs[3]  # a step of the first fit, and the first after the refit
    assert after["device_tier_subgroups"] == first["device_tier_subgroups"] > 0
    assert after["device_lane_subgroups"] == first["device_lane_subgroups"]
