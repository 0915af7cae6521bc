"""The command line and the demo, as real processes."""
from __future__ import annotations

import json
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _run(*args, timeout=300, env=None):
    env = dict(os.environ, PYTHONPATH=ROOT, **(env or {}))
    return subprocess.run([sys.executable, *args], capture_output=True, text=True, timeout=timeout, cwd=ROOT, env=env)


def test_info_json():
    out = _run("-m", "offloadctl.cli", "info", "--json")
    assert out.returncode == 0, out.stderr
    data = json.loads(out.stdout)
    assert "posix" in data["io_backends"] and data["host_adamw_params_per_s"]["torch"] > 0
    ops = data["native_ops"]
    assert set(ops) == {"async_io", "cpu_adam", "deepspeed_shm_comm"}
    for st in ops.values():
        assert st["state"] in ("built", "building", "not built", "unavailable", "not needed")
        assert (st["fallback"] is None) == (st["state"] in ("built", "not needed")), st
    assert ("aio" in data["io_backends"]) == (ops["async_io"]["state"] == "built")


def test_offload_adamw_example(tmp_path):
    out = _run("examples/offload_adamw.py", "--steps", "6", "--nvme", str(tmp_path))
    assert out.returncode == 0, out.stdout + out.stderr
    assert "bytes moved per param" in out.stdout and "no host cache" in out.stdout
    assert os.listdir(tmp_path) == []  # the temporary swap directory is gone


def _builds(ext_dir: str) -> dict:
    """Every op's ninja log and libraries under ``ext_dir``, with mtimes: what a compile changes."""
    out = {}
    for op in sorted(os.listdir(ext_dir)) if os.path.isdir(ext_dir) else []:
        for f in (".ninja_log", f"{op}.so"):
            path = os.path.join(ext_dir, op, f)
            if os.path.exists(path):
                out[f"{op}/{f}"] = os.stat(path).st_mtime_ns
    return out


def test_demo_under_offloadctl_train(tmp_path):
    """What `make demo` runs, after `source .venv/bin/activate`: the GPT script under offloadctl
    train, state in an NVMe tier; it compiles nothing, whatever the ops' state."""
    scripts = os.path.dirname(sys.executable)
    ext_dir = os.environ.get("TORCH_EXTENSIONS_DIR") or os.path.join(sys.prefix, "torch_extensions")
    before = _builds(ext_dir)
    out = _run("-m", "offloadctl.cli", "train", "--num_gpus", "1", "--nvme", str(tmp_path), "--run-dir",
               str(tmp_path / "run"), "examples/train_gpt.py", "--steps", "4",
               env={"VIRTUAL_ENV": os.path.dirname(scripts), "PATH": scripts + os.pathsep + os.environ["PATH"]})
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-3000:]
    assert "offloadctl: engine active" in out.stderr and str(tmp_path) in out.stderr
    assert "bytes moved per param" in out.stdout and "loss" in out.stdout
    assert _builds(ext_dir) == before, "the run compiled a native op"
