"""Bad paths, full disks, corrupt files and bad values: clear errors, no lost state."""

from __future__ import annotations

import ctypes
import errno
import glob
import os
import pickle
import stat
import subprocess
import sys

import pytest
import torch
from helpers import IS_ROOT, assert_params_close, cli, feed_same_grads, make_model, mounted, needs_root, reference_pair

from engine import ConfigError, CorruptSwapFileError, Knobs, OffloadAdamW, StorageIOError, StoragePathError
from engine.subgroup import KEPT

SUB = 700


def _opt(model, path, **kw):
    kw.setdefault("host_cache_bytes", 0)
    return OffloadAdamW(model.parameters(), lr=1e-2, subgroup_numel=SUB, nvme_paths=[path], host_adam="torch", **kw)


def test_missing_path_names_path_and_fix(tmp_path):
    missing = str(tmp_path / "nope")
    with pytest.raises(StoragePathError, match=f"{missing} does not exist.*mkdir -p"):
        _opt(make_model(), missing)


def test_path_that_is_a_file(tmp_path):
    f = tmp_path / "file"
    f.write_text("x")
    with pytest.raises(StoragePathError, match="is not a directory"):
        _opt(make_model(), str(f))


def test_unwritable_path(tmp_path):
    if IS_ROOT:  # root ignores mode bits; a read-only mount refuses root too
        with mounted("tmpfs", "ro,size=1m") as d:
            with pytest.raises(StoragePathError, match=f"{d} (is not writable|cannot hold files)"):
                _opt(make_model(), d)
    else:
        d = tmp_path / "ro"
        d.mkdir()
        d.chmod(stat.S_IRUSR | stat.S_IXUSR)
        with pytest.raises(StoragePathError, match="is not writable"):
            _opt(make_model(), str(d))


@needs_root
def test_path_without_o_direct():
    with mounted("ramfs") as d:
        with pytest.raises(StoragePathError, match=f"{d} does not support O_DIRECT"):
            _opt(make_model(), d)


@needs_root
def test_disk_too_small_fails_at_construction():
    with mounted("tmpfs", "size=64k") as d:
        with pytest.raises(StoragePathError, match=f"{d} is full.*free space"):
            _opt(make_model(), d)
        assert glob.glob(os.path.join(d, "offloadctl-swap-*", "*", "*.swp")) == []


def _punch_hole(fd: int, offset: int, length: int) -> None:
    libc = ctypes.CDLL(None, use_errno=True)
    FALLOC_FL_KEEP_SIZE, FALLOC_FL_PUNCH_HOLE = 0x01, 0x02
    libc.fallocate.argtypes = [ctypes.c_int, ctypes.c_int, ctypes.c_long, ctypes.c_long]
    if libc.fallocate(fd, FALLOC_FL_KEEP_SIZE | FALLOC_FL_PUNCH_HOLE, offset, length) != 0:
        raise OSError(ctypes.get_errno(), "fallocate punch hole")


@needs_root
def test_disk_filling_mid_run_keeps_state():
    """Another writer fills the disk, and the next write needs new blocks (thin files, as on
    copy-on-write file systems). Only files whose state is newer in memory are thinned."""
    with mounted("tmpfs", "size=4m") as d:
        model, opt, ref, ref_opt = reference_pair(lambda m: _opt(m, d), 2)
        kept = [sg.swap.file.filename for sg in opt.engine.subgroups if sg.stage in KEPT]
        assert kept, "the alternating order keeps the last subgroups in memory"
        for f in kept:
            fd = os.open(f, os.O_RDWR)
            _punch_hole(fd, 0, os.fstat(fd).st_size)
            os.close(fd)
        fd = os.open(os.path.join(d, "filler"), os.O_WRONLY | os.O_CREAT, 0o600)
        try:
            while True:
                os.write(fd, b"\0" * (1 << 16))
        except OSError as e:
            assert e.errno == errno.ENOSPC
        finally:
            os.close(fd)
        feed_same_grads([(ref, ref_opt), (model, opt)], 1, seed=5)  # its writes run behind the step
        with pytest.raises(StorageIOError, match=f"{d}.*No space left.*free space on {d}"):
            opt.flush()
        # Every update of that step happened and nothing was lost: state equals the reference.
        assert_params_close(model, ref)
        sd, rsd = opt.state_dict(), ref_opt.state_dict()
        for i, st in rsd["state"].items():
            torch.testing.assert_close(sd["state"][i]["exp_avg"], st["exp_avg"], rtol=1e-5, atol=1e-8)
        # Space comes back: training continues and still matches.
        os.unlink(os.path.join(d, "filler"))
        feed_same_grads([(model, opt), (ref, ref_opt)], 2, seed=6)
        assert_params_close(model, ref)
        opt.close()


@pytest.mark.parametrize("backend", ["posix", "aio"])
@pytest.mark.parametrize("damage", ["flip", "truncate"])
def test_corrupt_swap_file_is_an_error(damage, backend, swap_dir):
    # Three staging buffers for six subgroups: after flush() the writes behind the last step have
    # landed, nothing more is read ahead, and three subgroups are on disk only.
    model, opt, ref, ref_opt = reference_pair(
        lambda m: _opt(m, swap_dir, io_backend=backend, prefetch_depth=0, read_ahead_bytes=0), 2
    )
    opt.flush()
    sg = next(s for s in opt.engine.subgroups if s.staged is None and not s.fresh)
    with open(sg.swap.file.filename, "r+b") as f:
        if damage == "flip":
            f.seek(4096 + 100)
            b = f.read(1)
            f.seek(4096 + 100)
            f.write(bytes([b[0] ^ 0xFF]))
        else:
            f.truncate(4096)
    with pytest.raises(CorruptSwapFileError, match=sg.swap.file.filename):
        feed_same_grads([(model, opt), (ref, ref_opt)], 1)
    opt.close()


def test_bad_values_are_config_errors(swap_dir, tmp_path):
    m = make_model()
    with pytest.raises(ConfigError, match="subgroup_numel"):
        OffloadAdamW(m.parameters(), subgroup_numel=0)
    with pytest.raises(ConfigError, match="learning rate"):
        OffloadAdamW(m.parameters(), lr=-1)
    with pytest.raises(ConfigError, match="nowhere to go.*nvme_paths"):
        OffloadAdamW(m.parameters(), host_cache_bytes=0, subgroup_numel=SUB)
    with pytest.raises(ConfigError, match="device_fraction > 0 needs a device lane"):
        OffloadAdamW(m.parameters(), device_fraction=0.5)
    with pytest.raises(ConfigError, match="device_fraction must be in"):
        Knobs(device_fraction=2)
    opt = _opt(m, swap_dir)
    with pytest.raises(ConfigError, match="not storage paths of this run"):
        opt.set_knobs(Knobs(io_concurrency={str(tmp_path / "other"): 2}))
    with pytest.raises(ConfigError, match="cannot add param groups"):
        opt.add_param_group({"params": [torch.nn.Parameter(torch.zeros(3))]})
    opt.close()


def test_lane_device_setting():
    """One rule for the engine and the DeepSpeed integration (engine.streams.resolve_lane_device)."""
    from engine.streams import resolve_lane_device

    assert resolve_lane_device("cpu") == torch.device("cpu")
    if torch.cuda.is_available():
        assert resolve_lane_device(None) == torch.device("cuda", torch.cuda.current_device())
    else:
        assert resolve_lane_device(None) is None
        with pytest.raises(ConfigError, match=r"device='cuda:0' but CUDA is not available here: use device=None or 'cpu'"):
            resolve_lane_device("cuda:0")


def test_load_state_of_another_model(swap_dir):
    _, opt, _, _ = reference_pair(lambda m: _opt(m, swap_dir), 1)
    other = OffloadAdamW(torch.nn.Linear(3, 3).parameters(), host_adam="torch")
    with pytest.raises(ConfigError, match="same model"):
        other.load_state_dict(opt.state_dict())
    opt.close()


# -- lifecycle: swap files never outlive their run ----------------------------------------------


def _swap_files(d):
    return glob.glob(os.path.join(d, "offloadctl-swap-*", "*", "*.swp"))


def test_close_removes_swap_files(swap_dir):
    _, opt, _, _ = reference_pair(lambda m: _opt(m, swap_dir), 2)
    assert _swap_files(swap_dir)
    opt.close()
    assert glob.glob(os.path.join(swap_dir, "offloadctl-swap*")) == []


_CHILD = """
import os, sys, torch
sys.path.insert(0, {tests!r})
from helpers import make_model
from engine import OffloadAdamW
m = make_model()
opt = OffloadAdamW(m.parameters(), lr=1e-2, subgroup_numel=700, host_cache_bytes=0, nvme_paths=[{d!r}], host_adam="torch")
for p in m.parameters():
    p.grad = torch.ones_like(p)
opt.step()
opt.step()
print("stepped", flush=True)
{end}
"""


@pytest.mark.parametrize(
    "end,left_behind",
    [("", False), ("raise SystemExit(3)", False), ("os.kill(os.getpid(), 9)", True)],
    ids=["exit", "error-exit", "sigkill"],
)
@pytest.mark.slow
def test_swap_files_removed_at_exit_or_next_start(end, left_behind, swap_dir):
    code = _CHILD.format(tests=os.path.dirname(__file__), d=swap_dir, end=end)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert "stepped" in out.stdout, out.stderr
    assert bool(_swap_files(swap_dir)) == left_behind
    # The next engine on this path removes what a crashed one left.
    opt = _opt(make_model(), swap_dir)
    assert len(opt.engine.swap_paths.paths[0].stale_dirs_removed) == int(left_behind)
    opt.close()
    assert not _swap_files(swap_dir)


def test_other_live_process_dirs_are_kept(swap_dir):
    a = _opt(make_model(), swap_dir)
    b = _opt(make_model(), swap_dir)  # same pid, live: a's directory must survive b's clean-up
    assert b.engine.swap_paths.paths[0].stale_dirs_removed == []
    assert os.path.isdir(a.engine.swap_paths.paths[0].dir)
    a.close()
    b.close()


def test_save_is_atomic(swap_dir, tmp_path):
    _, opt, _, _ = reference_pair(lambda m: _opt(m, swap_dir), 2)
    target = tmp_path / "opt.pt"
    opt.save(str(target))
    good = target.read_bytes()
    # A save that fails half-way (unpicklable state) leaves the previous file and no temp files.
    opt.param_groups[0]["bad"] = lambda: None
    with pytest.raises((AttributeError, TypeError, pickle.PicklingError)):  # what pickling a lambda raises
        opt.save(str(target))
    assert target.read_bytes() == good
    assert sorted(p.name for p in tmp_path.iterdir() if p.is_file()) == ["opt.pt"]
    opt.close()


# -- sizes on the command line: one line naming the flag, exit 2, no traceback -----------------


@pytest.mark.parametrize(
    "text",
    [
        "",
        " ",
        "-1GB",
        "-0.5",
        "nan",
        "NaN GB",
        "inf",
        "infGB",
        "4X",
        "4GBs",
        "4 G B",
        "GB",
        "1..2GB",
        "0x10GB",
        "1,5GB",
        "64",
        "1.5",
        "1e400GB",
        "2000000TB",
        "9" * 400,
    ],
)
def test_bad_sizes_are_one_line_config_errors(text):
    from engine.units import parse_size

    with pytest.raises(ConfigError) as e:
        parse_size(text, flag="--host-cache")
    msg = str(e.value)
    assert msg.startswith("--host-cache ") and "\n" not in msg and len(msg) < 200, msg
    assert "GB" in msg and "GiB" in msg, msg  # valid examples


@pytest.mark.parametrize("text", ["nan", "inf", "-1", "1e400", "64GBs"])
def test_bad_deprecated_sizes_name_the_old_flag(text):
    from engine.units import parse_size

    with pytest.raises(ConfigError, match=r"^--host-cache-gb .*e\.g\. 64 or 1\.5"):
        parse_size(text, flag="--host-cache-gb", bare_unit="GB")


@pytest.mark.parametrize(
    "args,expect",
    [
        (["train", "--host-cache", "64", "SCRIPT"], "--host-cache '64' has no unit"),
        (["train", "--host-cache=-1GB", "SCRIPT"], "--host-cache '-1GB' is negative"),
        (["train", "--device-cache", "8XB", "SCRIPT"], "--device-cache '8XB' is not a size"),
        (["train", "--host-cache-gb", "nan", "SCRIPT"], "--host-cache-gb 'nan' is not a size"),
        (["plan", "--profile", "PROFILE", "--params", "7B", "--host-memory", "1.5"], "--host-memory '1.5' has no unit"),
        (["plan", "--profile", "PROFILE", "--params", "7B", "--gpu-headroom", "nan"], "--gpu-headroom 'nan' is not"),
        (["profile", "save", "x", "--output", "OUT", "--io-size", "16"], "--io-size '16' has no unit"),
        (["profile", "save", "x", "--output", "OUT", "--io-bytes", "16Q"], "--io-bytes '16Q' is not a size"),
    ],
    ids=[
        "train-bare",
        "train-negative",
        "train-unit",
        "train-old-nan",
        "plan-bare",
        "plan-nan",
        "profile-bare",
        "profile-old-unit",
    ],
)
def test_bad_size_on_the_command_line_is_one_line_exit_2(args, expect, tmp_path):
    script = tmp_path / "script.py"
    script.write_text("pass\n")
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    subst = {
        "SCRIPT": str(script),
        "PROFILE": os.path.join(root, "profiles", "example-cpu-vm.toml"),
        "OUT": str(tmp_path / "p.toml"),
    }
    r = cli(*(subst.get(a, a) for a in args), timeout=120)
    assert r.returncode == 2 and "Traceback" not in r.stderr, r.stderr[-2000:]
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("offloadctl: ") and expect in lines[0], r.stderr
    assert not (tmp_path / "p.toml").exists() and r.stdout == ""
