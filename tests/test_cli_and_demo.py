"""The command line and the demo, as real processes."""
from __future__ import annotations

import json
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _run(*args, timeout=300):
    return subprocess.run([sys.executable, *args], capture_output=True, text=True, timeout=timeout, cwd=ROOT)


def test_info_json():
    out = _run("-m", "offloadctl.cli", "info", "--json")
    assert out.returncode == 0, out.stderr
    data = json.loads(out.stdout)
    assert "posix" in data["io_backends"] and data["host_adamw_params_per_s"]["torch"] > 0


def test_demo_trains_with_state_on_nvme(tmp_path):
    out = _run("examples/demo_offload_adamw.py", "--steps", "6", "--nvme", str(tmp_path))
    assert out.returncode == 0, out.stdout + out.stderr
    assert "bytes moved per param" in out.stdout and "no host cache" in out.stdout
    assert os.listdir(tmp_path) == []  # the temporary swap directory is gone
