"""Messages and screens that name what the user types (issue 46, items 5-8): a full swap disk names
--host-cache and the size the run needs; --engine stock with --nvme is said in English; a typo in
a profile key gets its did-you-mean; `info` says what each AdamW rate measures and keeps paths
whole; `profile show` says where each rate was measured and its source once; `profile save`'s
last lines fit 80 columns."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest
import torch
from helpers import IS_ROOT, ROOT, env_with_root, mounted
from test_screens_80 import needs_tmux, offloadctl, screen

from engine.errors import ConfigError, StoragePathError

VM = os.path.join(ROOT, "profiles", "example-cpu-vm.toml")


@pytest.mark.skipif(not IS_ROOT, reason="needs root to mount tmpfs")
def test_a_full_swap_disk_names_host_cache_and_the_size_the_run_needs():
    """2 MB free, 6.1 MB of swap files: refused before the first file, with the whole size this
    rank needs there and the --host-cache that fits (not host_cache_bytes and one file's size)."""
    from engine import OffloadAdamW
    from engine.config import StoragePath

    model = torch.nn.Linear(512, 1000)  # 513,000 parameters: 6.16 MB of state
    with mounted("tmpfs", "size=2m") as d:
        path = StoragePath(path=d, read_bytes_per_s=1e9, write_bytes_per_s=1e9)  # declared: no probe
        with pytest.raises(StoragePathError) as e:
            OffloadAdamW(
                model.parameters(), lr=1e-2, subgroup_numel=100_000, nvme_paths=[path], host_cache_bytes=0, host_adam="torch"
            )
    text = str(e.value)
    m = re.fullmatch(
        rf"storage path {re.escape(d)} is full for this run: this rank's swap files there need "
        r"(6\.18 MB) and it has (\S+ [KM]B) free; free space there, add another path \(--nvme\), or "
        r"keep more state in host memory: --host-cache (\S+) or more \(host_cache_bytes, now 0 B\)",
        text,
    )
    assert m, text
    from engine.units import parse_size

    assert 4e6 < parse_size(m.group(3), flag="--host-cache") < 4.2e6, text  # what the disk lacks, rounded up


def test_engine_stock_with_one_option_says_does_not_apply():
    """`so --nvme do not apply` was the line for one option: one does, two do."""
    one = _engine_stock_line("--nvme", "/tmp")
    assert "so --nvme does not apply:" in one, one
    two = _engine_stock_line("--nvme", "/tmp", "--host-cache", "1GB")
    assert re.search(r"so --\S+, --\S+ do not apply:", two), two


def _engine_stock_line(*opts: str) -> str:
    p = subprocess.run(
        [
            sys.executable,
            "-m",
            "offloadctl.cli",
            "train",
            "--engine",
            "stock",
            *opts,
            "--dry-run",
            os.path.join(ROOT, "tests", "ds_scripts", "train_tiny.py"),
            "--losses-out",
            "/dev/null",
        ],
        capture_output=True,
        text=True,
        cwd=ROOT,
        env=env_with_root(),
        timeout=120,
    )
    assert p.returncode == 2, p.stderr
    return p.stderr.strip().splitlines()[-1]


def test_a_mistyped_profile_key_gets_its_did_you_mean(tmp_path):
    """`cores_phyiscal` in [machine]: `did you mean cores_physical?`, at its line; a key like no
    other still lists the keys there are."""
    from perf.profile_toml import load_profile

    text = open(VM).read()
    bad = tmp_path / "typo.toml"
    bad.write_text(text.replace("cores_physical = 2", "cores_phyiscal = 2"))
    line = next(i for i, x in enumerate(bad.read_text().splitlines(), 1) if x.startswith("cores_phyiscal"))
    with pytest.raises(ConfigError) as e:
        load_profile(str(bad))
    assert str(e.value) == (
        f"profile {bad}, line {line}: key machine.cores_phyiscal is not a key of [machine]: did you mean cores_physical?"
    )
    bad.write_text(text.replace("cores_physical = 2", "cores_physical = 2\nzzz = 1"))
    with pytest.raises(ConfigError) as e:
        load_profile(str(bad))
    assert "is not a key of [machine] (hostname, cpu_model, cores_physical" in str(e.value)
    assert "remove it, or fix its spelling" in str(e.value) and "did you mean" not in str(e.value)


def test_info_says_what_each_rate_measures_and_keeps_paths_whole():
    """The kernel alone (timed now), the whole loop (timed once, the choice: why runs use it),
    the memory bound: each said for what it is; the files they are kept in whole, on lines
    of their own (a path cut mid-word in a cell cannot be copied)."""
    from rich.console import Console

    from engine.host_kernel import KERNEL_CHOICE_FILE, MEMORY_BANDWIDTH_FILE
    from engine.storage.native_ops import extensions_dir
    from offloadctl.commands import info

    data = {
        "offloadctl": "0.1.0",
        "torch": "2.13.0+cpu",
        "deepspeed": "0.19.8",
        "deepspeed_integration": "ok (DeepSpeed 0.19.8)",
        "cuda": False,
        "gpus": [],
        "native_ops": {},
        "io_backends": ["aio", "posix"],
        "host_adamw_params_per_s": {"torch": 3.72e8, "deepspeed": 4.93e8},
        "host_adamw_kernel": "deepspeed",
        "host_lane_params_per_s": 3.1e8,
        "host_lane_params_per_s_by_kernel": {"torch": 3.72e8, "deepspeed": 3.1e8},
        "host_memory_bytes_per_s": 8.4e9,
        "host_lane_memory_bound_params_per_s": 3e8,
    }
    con = Console(width=80, record=True)
    con.print(info.info_table(data))
    text = con.export_text()
    assert all(len(line) <= 80 for line in text.splitlines()), text
    flat = re.sub(r"[\s│]+", " ", text)
    assert "each kernel alone on one buffer of 16M parameters, timed now: torch 372M params/s, DeepSpeed 493M" in flat
    assert (
        "runs use DeepSpeed, stock's kernel, for stock's losses; the whole host update loop (unscale, AdamW, "
        "weight copy; 4 subgroups), timed with each kernel once on this machine: torch 372M params/s, "
        "DeepSpeed 310M params/s; kept [1], for the lane balance and --host-adam fastest" in flat
    ), flat
    assert "at most 300M params/s: a run's host lane goes at the lower of its loop's rate and its share" in flat
    lines = text.splitlines()
    assert f"[1] {os.path.join(extensions_dir(), KERNEL_CHOICE_FILE)}" in lines, text
    assert f"[2] {os.path.join(extensions_dir(), MEMORY_BANDWIDTH_FILE)}" in lines, text


def _measured_profile(tmp_path) -> str:
    """A profile as `profile save` writes one: a sweep whose best read is at 4 in flight while
    reads and writes both come within 5% of their best only at 16."""
    from perf.profile import Figure, PathProfile, Source, SweepPoint
    from perf.profile_toml import load_profile, save_profile

    p = load_profile(VM)
    fig = lambda v: Figure(value=v, how="O_DIRECT, measured", when="2026-12-01")  # noqa: E731
    rates = {
        ("read", 4): 1.4e9,
        ("read", 16): 1.35e9,
        ("write", 4): 2e9,
        ("write", 16): 4.1e9,
        ("mixed", 4): 2e9,
        ("mixed", 16): 2.63e9,
    }
    sweep = tuple(SweepPoint(op=op, concurrency=c, block_bytes=8 << 20, bytes_per_s=fig(v)) for (op, c), v in rates.items())
    path = PathProfile(
        path="/tmp/nv",
        kind="nvme",
        device="vda",
        device_id="254:0",
        capacity_bytes=83_500_000_000,
        read_bytes_per_s=fig(1.4e9),
        write_bytes_per_s=fig(4.1e9),
        mixed_bytes_per_s=fig(2.63e9),
        best_concurrency=16,
        sweep=sweep,
    )
    measured = p.__class__(
        **{
            **p.__dict__,
            "paths": (path,),
            "source": Source(kind="measured", description="measured on vm (--quick run)", tool="offloadctl 0.1.0"),
        }
    )
    out = str(tmp_path / "vm.toml")
    save_profile(measured, out)
    return out


@needs_tmux
def test_profile_show_says_where_each_rate_was_measured_and_its_source_once(tmp_path):
    text, status = screen(offloadctl("profile", "show", _measured_profile(tmp_path)))
    assert status == 0 and all(len(line) <= 80 for line in text.splitlines()), text
    assert "\nsource: measured on vm (--quick run) [offloadctl 0.1.0]\n" in text, text
    assert "measured: measured" not in text
    row = next(line for line in text.splitlines() if line.startswith("/tmp/nv "))
    assert re.search(r"1\.4 \(4\) +4\.1 \(16\) +2\.63 \(16\) +16$", row), text
    flat = " ".join(text.split())
    assert (
        "best conc.: the fewest requests in flight at which the engine's 8.39 MB reads and writes both come "
        "within 5% of their best rates. read, write, mixed: each path's best rate; (n): the requests in flight "
        "it was measured at, which for one direction alone may be fewer (the figures below give the request "
        "size)."
    ) in flat, text


@needs_tmux
def test_profile_save_says_where_it_wrote_within_80_columns():
    """The last lines of a save: where the profile went, then the command that shows it."""
    short = tempfile.mkdtemp(prefix="oc-", dir="/tmp")  # a path that fits a line, as a user's would
    tmp_path = Path(short)
    nvme = tmp_path / "nv"
    nvme.mkdir()
    env = env_with_root(OFFLOADCTL_PROFILE_DIR=str(tmp_path / "profiles"))
    text, status = screen(
        offloadctl("profile", "save", "vm", "--nvme", str(nvme), "--quick", "--io-size", "32MB", "--io-seconds", "0.1"),
        timeout_s=300,
        env=env,
    )
    assert status == 0, text
    lines = text.splitlines()
    assert re.fullmatch(rf"wrote profile vm to {re.escape(str(tmp_path / 'profiles' / 'vm.toml'))} \(\d+ s\)", lines[-2]), text
    assert lines[-1] == "see it with `offloadctl profile show vm`", text
    assert all(len(line) <= 80 for line in lines[-2:])
    shutil.rmtree(short)
