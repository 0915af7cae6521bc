"""What a launch costs before its first step: `offloadctl train` checks and starts the launcher
without importing torch, and py-cpuinfo's answer (seconds per call, several calls per rank) is
asked once per CPU and kept beside the built ops."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
from helpers import env_with_root

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPT = os.path.join(ROOT, "tests", "ds_scripts", "train_tiny.py")

BUILD_ONLY = """
import json, sys
from offloadctl.cli import build_parser
from offloadctl.commands import train
args = build_parser().parse_args(sys.argv[1:])
launch = train.build(args)
print(json.dumps({"torch": "torch" in sys.modules, "deepspeed": "deepspeed" in sys.modules,
                  "command": launch.command}))
"""


def test_the_train_command_builds_its_launch_without_torch(tmp_path):
    """The parent process of every run checks the paths (O_DIRECT included) and builds the launch
    with neither torch nor DeepSpeed imported: seconds saved on every launch."""
    nvme = tmp_path / "nvme"
    nvme.mkdir()
    p = subprocess.run(
        [
            sys.executable,
            "-c",
            BUILD_ONLY,
            "train",
            "--nvme",
            str(nvme),
            "--tuner",
            "off",
            "--run-dir",
            str(tmp_path / "run"),
            SCRIPT,
            "--steps",
            "1",
        ],
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=120,
        env=dict(os.environ, PYTHONPATH=ROOT),
    )
    assert p.returncode == 0, p.stderr[-3000:]
    out = json.loads(p.stdout)
    assert out["torch"] is False and out["deepspeed"] is False
    assert out["command"][-3:] == [SCRIPT, "--steps", "1"]


def test_check_usable_refuses_what_cannot_hold_swap_files(tmp_path):
    from engine.errors import StoragePathError
    from engine.storage.usable import check_usable

    check_usable(str(tmp_path))  # a real disk file system: O_DIRECT works
    assert os.listdir(tmp_path) == []  # the probe file is gone
    with pytest.raises(StoragePathError, match="does not exist: create it"):
        check_usable(str(tmp_path / "missing"))
    (tmp_path / "f").write_text("x")
    with pytest.raises(StoragePathError, match="is not a directory"):
        check_usable(str(tmp_path / "f"))


@pytest.fixture
def fresh_cpu_info(tmp_path, monkeypatch):
    """py-cpuinfo with a counting stand-in for its slow query, and an empty extensions dir."""
    import cpuinfo

    from engine.storage import native_ops

    calls = []

    def ask():
        calls.append(1)
        return {"arch": "X86_64", "flags": ["avx2"], "brand_raw": "test CPU"}

    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path / "ext"))
    monkeypatch.setattr(cpuinfo, "get_cpu_info", ask)
    return native_ops, cpuinfo, calls


def test_cpu_info_is_asked_once_per_cpu_and_kept(fresh_cpu_info, monkeypatch):
    native_ops, cpuinfo, calls = fresh_cpu_info
    native_ops.remember_cpu_info()
    first = cpuinfo.get_cpu_info()
    first["flags"].append("mutated by a caller")  # a caller's change never reaches the kept answer
    assert cpuinfo.get_cpu_info() == {"arch": "X86_64", "flags": ["avx2"], "brand_raw": "test CPU"}
    assert len(calls) == 1
    native_ops.remember_cpu_info()  # installed once: no wrapper around the wrapper
    assert cpuinfo.get_cpu_info.offloadctl_kept and len(calls) == 1

    # Another process on the same CPU: read from the extensions dir, py-cpuinfo not asked.
    def never():
        raise AssertionError("asked py-cpuinfo although the answer is kept")

    monkeypatch.setattr(cpuinfo, "get_cpu_info", never)
    native_ops.remember_cpu_info()
    assert cpuinfo.get_cpu_info()["brand_raw"] == "test CPU"

    # Another CPU (the same venv on a shared file system): asked again.
    monkeypatch.setattr(cpuinfo, "get_cpu_info", lambda: {"arch": "ARM_8", "brand_raw": "other"})
    monkeypatch.setattr(native_ops, "_cpu_description", lambda: "another-cpu")
    native_ops.remember_cpu_info()
    assert cpuinfo.get_cpu_info()["brand_raw"] == "other"


def test_cpu_info_is_kept_by_the_deepspeed_import_not_by_importing_the_module():
    """Issue 48 item 6: the patch is an explicit step of the one DeepSpeed import, not a side
    effect of importing the module that holds it."""
    code = (
        "import cpuinfo\n"
        "from engine.storage import native_ops\n"
        "assert not getattr(cpuinfo.get_cpu_info, 'offloadctl_kept', False), 'installed at import'\n"
        "native_ops.import_deepspeed()\n"
        "assert cpuinfo.get_cpu_info.offloadctl_kept\n"
    )
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    out = subprocess.run([sys.executable, "-c", code], cwd=root, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]


@pytest.mark.slow
def test_an_ops_state_does_not_depend_on_where_stdout_goes():
    """Under Jupyter or pytest's capture sys.stdout and sys.stderr have no file descriptor, and
    DeepSpeed's checks and loads write to ``sys.stderr.fileno()``: a built op was then taken for
    one that cannot build here (the I/O fell back to posix). Its state is the same either way."""
    code = (
        "import io, sys\n"
        "real = sys.__stdout__\n"
        "if sys.argv[1] == 'captured':\n"
        "    sys.stdout = io.StringIO(); sys.stderr = io.StringIO()\n"
        "from engine.storage import native_ops\n"
        "real.write(' '.join(native_ops.op_state(n).state for n in native_ops.OPS) + '\\n')\n"
    )
    states = [
        subprocess.run(
            [sys.executable, "-c", code, how], capture_output=True, text=True, env=env_with_root(), cwd=ROOT, timeout=120
        ).stdout.strip()
        for how in ("plain", "captured")
    ]
    assert states[0] and states[0] == states[1], states


LISTED_OPTIMIZER = """
import json, sys
import torch
from integrations import ds_patches
from engine.storage.native_ops import import_deepspeed
ds = import_deepspeed()
ds.init_distributed(dist_backend="gloo", auto_mpi_discovery=False, init_method="tcp://127.0.0.1:" + sys.argv[1],
                    rank=0, world_size=1)
from deepspeed.runtime import engine
from deepspeed.runtime.zero import utils
stock = engine.is_zero_supported_optimizer
ds_patches.answer_listed_optimizers_without_muon()
ds_patches.answer_listed_optimizers_without_muon()
wrapped = engine.is_zero_supported_optimizer
muon = "deepspeed.runtime.zero.muon.muon_optimizer"
p = [torch.nn.Parameter(torch.zeros(4))]
out = {"wrapped": wrapped is not stock, "adamw": wrapped(torch.optim.AdamW(p)),
       "muon_after_adamw": muon in sys.modules, "inductor_after_adamw": "torch._inductor.compile_fx" in sys.modules,
       "sgd": wrapped(torch.optim.SGD(p, lr=0.1)), "muon_after_sgd": muon in sys.modules,
       "stock_sgd": stock(torch.optim.SGD(p, lr=0.1)), "stock_adamw": stock(torch.optim.AdamW(p))}
print(json.dumps(out))
"""


@pytest.mark.slow
def test_an_optimizer_on_deepspeeds_list_is_answered_without_importing_muon():
    """DeepSpeed's ZeRO check imports its Muon optimizer, and with it torch's inductor (1.7 s of
    each rank's start here): an optimizer on the list is answered without it, as DeepSpeed
    answers; any other still goes through DeepSpeed's own check."""
    from helpers import free_port

    p = subprocess.run(
        [sys.executable, "-c", LISTED_OPTIMIZER, free_port()],
        capture_output=True,
        text=True,
        env=env_with_root(),
        cwd=ROOT,
        timeout=300,
    )
    assert p.returncode == 0, p.stderr[-3000:]
    out = json.loads(p.stdout.strip().splitlines()[-1])
    assert out == {
        "wrapped": True,
        "adamw": True,
        "muon_after_adamw": False,
        "inductor_after_adamw": False,
        "sgd": False,
        "muon_after_sgd": True,
        "stock_sgd": False,
        "stock_adamw": True,
    }, out
