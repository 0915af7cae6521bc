"""The command line and the demo, as real processes."""
from __future__ import annotations

import json
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _run(*args, timeout=300):
    env = dict(os.environ, PYTHONPATH=ROOT)
    return subprocess.run([sys.executable, *args], capture_output=True, text=True, timeout=timeout, cwd=ROOT, env=env)


def test_info_json():
    out = _run("-m", "offloadctl.cli", "info", "--json")
    assert out.returncode == 0, out.stderr
    data = json.loads(out.stdout)
    assert "posix" in data["io_backends"] and data["host_adamw_params_per_s"]["torch"] > 0


def test_offload_adamw_example(tmp_path):
    out = _run("examples/offload_adamw.py", "--steps", "6", "--nvme", str(tmp_path))
    assert out.returncode == 0, out.stdout + out.stderr
    assert "bytes moved per param" in out.stdout and "no host cache" in out.stdout
    assert os.listdir(tmp_path) == []  # the temporary swap directory is gone


def test_demo_under_offloadctl_train(tmp_path):
    """What `make demo` runs: the GPT script under offloadctl train, state in an NVMe tier."""
    out = _run("-m", "offloadctl.cli", "train", "--num_gpus", "1", "--nvme", str(tmp_path), "--run-dir",
               str(tmp_path / "run"), "examples/train_gpt.py", "--steps", "4")
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-3000:]
    assert "offloadctl: engine active" in out.stderr and str(tmp_path) in out.stderr
    assert "bytes moved per param" in out.stdout and "loss" in out.stdout
