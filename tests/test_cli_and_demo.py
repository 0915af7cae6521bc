"""The command line and the demo, as real processes."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
from helpers import ROOT, cli, env_with_root, free_port

from engine.units import format_size, parse_size


def _run(*args, timeout=300, env=None):
    """A Python program (a path or -m module) of the checkout, run as a user runs it."""
    return subprocess.run(
        [sys.executable, *args], capture_output=True, text=True, timeout=timeout, cwd=ROOT, env=env_with_root(**(env or {}))
    )


@pytest.mark.slow
def test_info_json():
    out = cli("info", "--json", timeout=300)
    assert out.returncode == 0, out.stderr
    data = json.loads(out.stdout)
    assert "posix" in data["io_backends"] and data["host_adamw_params_per_s"]["torch"] > 0
    ops = data["native_ops"]
    assert set(ops) == {"async_io", "cpu_adam", "deepspeed_shm_comm", "host_fused"}
    for st in ops.values():
        assert st["state"] in ("built", "building", "not built", "unavailable", "not needed")
        assert (st["fallback"] is None) == (st["state"] in ("built", "not needed")), st
    assert ("aio" in data["io_backends"]) == (ops["async_io"]["state"] == "built")


@pytest.mark.slow
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


@pytest.mark.slow
def test_demo_under_offloadctl_train(tmp_path):
    """What `make demo` runs, after `source .venv/bin/activate`: the GPT script under offloadctl
    train, state in an NVMe tier; it compiles nothing, whatever the ops' state."""
    scripts = os.path.dirname(sys.executable)
    ext_dir = os.environ.get("TORCH_EXTENSIONS_DIR") or os.path.join(sys.prefix, "torch_extensions")
    before = _builds(ext_dir)
    # A port of its own (make demo takes DeepSpeed's default, 29500): other tests run beside this one.
    out = _run(
        "-m",
        "offloadctl.cli",
        "train",
        "--num_gpus",
        "1",
        "--master_port",
        free_port(),
        "--nvme",
        str(tmp_path),
        "--run-dir",
        str(tmp_path / "run"),
        "examples/train_gpt.py",
        "--steps",
        "4",
        env={"VIRTUAL_ENV": os.path.dirname(scripts), "PATH": scripts + os.pathsep + os.environ["PATH"]},
    )
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-3000:]
    assert "offloadctl: engine active" in out.stderr and str(tmp_path) in out.stderr
    assert "/iteration (median of" in out.stdout and "bottleneck: " in out.stdout and "loss" in out.stdout
    assert _builds(ext_dir) == before, "the run compiled a native op"


# -- sizes and flag spellings ----------------------------------------------------------------------

GB, GIB = 10**9, 2**30


@pytest.mark.parametrize(
    "text,expect",
    [
        ("512M", 512 * 10**6),
        ("512MB", 512 * 10**6),
        ("512mb", 512 * 10**6),
        ("4G", 4 * GB),
        ("4GB", 4 * GB),
        ("4GiB", 4 * GIB),
        ("4gib", 4 * GIB),
        ("4 GiB", 4 * GIB),
        (" 64GB ", 64 * GB),
        ("1.5GB", 1_500_000_000),
        ("1.5T", 1_500_000_000_000),
        ("1.5TiB", 3 * 2**39),
        ("2K", 2000),
        ("2KiB", 2048),
        ("3MiB", 3 << 20),
        ("4096B", 4096),
        ("0", 0),
        ("0GB", 0),
        ("0.3GB", 300_000_000),
        (".5GB", 500_000_000),
        ("1e3GB", 1000 * GB),
        ("1000000TB", 10**18),
        ("1e18B", 10**18),
    ],
)
def test_parse_size_accepts(text, expect):
    assert parse_size(text, flag="--x") == expect


def test_parse_size_bare_number_needs_a_unit_except_in_deprecated_flags():
    assert parse_size("64", flag="--host-cache-gb", bare_unit="GB") == 64 * GB
    assert parse_size("0.00003", flag="--host-cache-gb", bare_unit="GB") == 30_000
    assert parse_size("4096", flag="--io-bytes", bare_unit="B") == 4096
    assert parse_size("0", flag="--host-cache") == 0


@pytest.mark.parametrize(
    "n,binary,expect",
    [
        (64 * GB, False, "64 GB"),
        (1_500_000_000_000, False, "1.5 TB"),
        (512, False, "512 B"),
        (60 * GIB, True, "60 GiB"),
        (0, False, "0 B"),
    ],
)
def test_format_size(n, binary, expect):
    assert format_size(n, binary=binary) == expect
    assert parse_size(expect.replace(" ", ""), flag="--x") == n


def _train_launch(tmp_path, *flags):
    """``offloadctl train``'s resolved launch for ``flags``, in-process as the command builds it."""
    from offloadctl.cli import build_parser
    from offloadctl.commands import train

    script = tmp_path / "script.py"
    script.write_text("pass\n")
    args = build_parser().parse_args(
        ["train", "--tuner", "off", "--run-dir", str(tmp_path / "run"), *flags, str(script), "--lr", "1"]
    )
    launch = train.build(args)
    settings = dict(launch.settings.to_json(), run_id=None)  # random per launch
    cmd = launch.command
    i = cmd.index("--offloadctl-config")
    return settings, cmd[: i + 1] + cmd[i + 2 :], launch.env


@pytest.mark.parametrize(
    "old,new",
    [
        (["--host-cache-gb", "64", "--device-cache-gb", "1.5"], ["--host-cache", "64GB", "--device-cache", "1.5GB"]),
        (["--host-cache-gb", "0.00003", "--device-cache-gb", "auto"], ["--host-cache", "30KB"]),
        (["--host-cache-gb", "0", "--device-cache-gb", "0"], ["--host-cache", "0", "--device-cache", "0B"]),
        (["--host-cache-gb", "1.073741824"], ["--host-cache", "1GiB", "--device-cache", "AUTO"]),
    ],
    ids=["64GB", "30KB-auto", "zero", "1GiB"],
)
def test_train_old_and_new_size_flags_give_the_same_launch(old, new, tmp_path):
    a, b = _train_launch(tmp_path, *old), _train_launch(tmp_path, *new)
    assert a == b
    none = _train_launch(tmp_path)[0]
    assert a[0]["host_cache_bytes"] != none["host_cache_bytes"]  # the flag did reach the ranks' settings


def test_train_sizes_reach_the_ranks_in_bytes(tmp_path):
    settings, cmd, env = _train_launch(
        tmp_path, "--host-cache", "64GB", "--device-cache", "8GiB", "--num_gpus", "2", "--master_port", "29999"
    )
    assert settings["host_cache_bytes"] == 64 * GB and settings["device_cache_bytes"] == 8 * GIB
    assert cmd[cmd.index("--num_gpus") + 1] == "2" and cmd[cmd.index("--master_port") + 1] == "29999"
    assert cmd[-2:] == ("--lr", "1") and cmd[-3].endswith("script.py")
    assert env["PYTHONPATH"].split(os.pathsep)[0] == ROOT


def test_train_dry_run_process_takes_the_new_flags(tmp_path):
    script = tmp_path / "script.py"
    script.write_text("pass\n")
    out = cli(
        "train",
        "--dry-run",
        "--json",
        "--tuner",
        "off",
        "--run-dir",
        str(tmp_path / "run"),
        "--host-cache",
        "2GiB",
        "--device-cache-gb",
        "3",
        str(script),
        timeout=300,
    )
    assert out.returncode == 0, out.stderr[-2000:]
    settings = json.loads(out.stdout)["settings"]
    assert settings["host_cache_bytes"] == 2 * GIB and settings["device_cache_bytes"] == 3 * GB


def test_plan_old_and_new_size_flags_give_the_same_plan(capsys):
    from offloadctl.cli import main

    base = ["plan", "--profile", os.path.join(ROOT, "profiles", "example-cpu-vm.toml"), "--params", "2B", "--json"]
    outs = []
    for flags in (["--host-gb", "12", "--gpu-headroom-gb", "4"], ["--host-memory", "12GB", "--gpu-headroom", "4GB"]):
        assert main(base + flags) == 0
        outs.append(json.loads(capsys.readouterr().out))
    assert outs[0] == outs[1]
    assert outs[0]["workload"]["host_bytes"] == 12 * GB and outs[0]["workload"]["gpu_headroom_bytes"] == 4 * GB


@pytest.mark.parametrize(
    "old,new",
    [
        (["--backend", "posix", "--io-bytes", "16M"], ["--io-backend", "posix", "--io-size", "16MiB"]),
        (["--io-bytes", "1048576"], ["--io-size", "1MiB"]),
        (["--io-bytes", "1.5G"], ["--io-size", "1.5GiB"]),
    ],
    ids=["backend-16M", "bare-bytes", "1.5G"],
)
def test_profile_save_old_and_new_spellings_parse_alike(old, new):
    """--backend and --io-bytes keep their old meaning (K/M/G/T were powers of 1024, a bare number
    bytes); the measurement itself is test_profiles' (with the old spelling)."""
    from offloadctl.cli import build_parser
    from offloadctl.options import size_bytes

    a, b = (build_parser().parse_args(["profile", "save", "x", *flags]) for flags in (old, new))
    assert (a.io_backend, size_bytes(a.io_size)) == (b.io_backend, size_bytes(b.io_size))
    assert size_bytes(b.io_size) >= 1 << 20


def _help(capsys, *command) -> str:
    from offloadctl.cli import main

    with pytest.raises(SystemExit):
        main([*command, "--help"])
    return " ".join(capsys.readouterr().out.split())  # as one line: argparse wraps at the terminal width


def test_help_states_units_and_scope(capsys):
    train, plan, save = _help(capsys, "train"), _help(capsys, "plan"), _help(capsys, "profile", "save")
    for text in (train, plan, save):
        assert "KB/MB/GB/TB are powers of 1000, KiB/MiB/GiB/TiB powers of 1024" in text
        assert "a bare number other than 0 is refused" in text
    assert "--host-cache SIZE optimizer state kept in host memory, per rank" in train
    assert "--device-cache SIZE|auto optimizer state kept on the GPU, per rank" in train
    assert "--host-memory SIZE host memory for optimizer state, per node" in plan
    assert "--gpu-headroom SIZE GPU memory free during the update phase, per GPU" in plan
    # Deprecated spellings still work (tests below) but are not offered.
    for old, text in (
        ("--host-cache-gb", train),
        ("--host-gb", plan),
        ("--device-cache-gb", train),
        ("--gpu-headroom-gb", plan),
        ("--io-bytes", save),
    ):
        assert old not in text, old
    assert "--io-backend {auto,aio,posix}" in save and "--backend" not in save  # the old name works, hidden
