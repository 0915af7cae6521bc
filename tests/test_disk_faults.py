"""Faults of the disk that holds the optimizer state, mid-run, with the state really on it
(issue 43, item 8).

With the default host budget a small model's state stays in the engine's kept buffers, and no
step reads or writes its swap files: a fault of the disk then shows nothing. These runs take a
host budget just above what the start needs (the refusal names it), no host cache and no
prefetch, so that every step reads and writes the swap files; then, mid-run, the disk fills, the
swap directory is deleted, or the file system goes read-only (as ext4 does on an error with
``errors=remount-ro``). Each run either goes on with the right losses or stops with one line,
and the checkpoint saved before the fault resumes to the losses of a run that never had one.

The disk is a small ext4 file system on a loop device of its own, made and removed here; root only.
"""

from __future__ import annotations

import contextlib
import glob
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile

import pytest
from ds_runs import LAYOUTS, SAVE, ours
from helpers import ROOT, cli, env_with_root, free_port, needs_root, wait_for

pytestmark = pytest.mark.slow

TINY = os.path.join(ROOT, "tests", "ds_scripts", "train_tiny.py")
SWAPPING = ("--host-cache", "0", "--prefetch-depth", "0", "--tuner", "off")
"""No host cache, no prefetch: the kept buffers hold one subgroup, and every step reads and
writes the others."""


@contextlib.contextmanager
def small_ext4(size_mb: int = 64):
    """A fresh ext4 of ``size_mb`` MB on a loop device of its own (``errors=remount-ro``, as
    distributions mount data disks), mounted in a temporary directory; all of it removed after."""
    base = tempfile.mkdtemp(prefix="offloadctl-disk-", dir="/var/tmp")
    image, mnt = os.path.join(base, "disk.img"), os.path.join(base, "mnt")
    os.mkdir(mnt)
    with open(image, "wb") as f:
        f.truncate(size_mb << 20)
    dev = subprocess.run(["losetup", "-f", "--show", image], check=True, capture_output=True, text=True).stdout.strip()
    try:
        subprocess.run(["mkfs.ext4", "-q", "-F", dev], check=True, capture_output=True)
        subprocess.run(["mount", "-o", "errors=remount-ro", dev, mnt], check=True, capture_output=True)
        try:
            yield dev, mnt
        finally:
            subprocess.run(["umount", mnt], check=False, capture_output=True)
            subprocess.run(["umount", "-l", mnt], check=False, capture_output=True)  # if still busy: detach it
    finally:
        subprocess.run(["losetup", "-d", dev], check=False, capture_output=True)
        shutil.rmtree(base, ignore_errors=True)


def _losses(path) -> list[float]:
    try:
        with open(path) as f:
            return [json.loads(line)["loss"] for line in f if line.strip()]
    except FileNotFoundError:
        return []


def _smallest_budget(tmp_path, nvme: str) -> str:
    """The --host-memory the refusal names as the smallest that starts."""
    r = cli(
        "train",
        "--num_gpus",
        "1",
        "--master_port",
        free_port(),
        "--nvme",
        nvme,
        *SWAPPING,
        "--host-memory",
        "1KB",
        "--run-dir",
        str(tmp_path / "refused"),
        TINY,
        "--losses-out",
        str(tmp_path / "refused.jsonl"),
        timeout=600,
    )
    said = [ln for ln in r.stderr.splitlines() if "(--host-memory) is below what this rank needs" in ln]
    assert r.returncode != 0 and said and "Traceback" not in r.stderr, r.stderr[-3000:]
    return said[0].split("give --host-memory ", 1)[1].split(" or more", 1)[0]


def _start(tmp_path, nvme: str, budget: str, ckpt: str) -> tuple[subprocess.Popen, str, str]:
    run_dir, losses = str(tmp_path / "run"), str(tmp_path / "losses.jsonl")
    cmd = [
        sys.executable,
        "-m",
        "offloadctl.cli",
        "train",
        "--num_gpus",
        "1",
        "--master_port",
        free_port(),
        "--nvme",
        nvme,
        *SWAPPING,
        "--host-memory",
        budget,
        "--run-dir",
        run_dir,
        TINY,
        "--steps",
        "100000",
        "--losses-out",
        losses,
        "--save-at",
        "3",
        "--ckpt-dir",
        ckpt,
    ]
    p = subprocess.Popen(
        cmd, cwd=ROOT, env=env_with_root(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True
    )
    return p, run_dir, losses


def _every_step_swaps(run_dir: str) -> None:
    with open(os.path.join(run_dir, "telemetry-rank0.jsonl")) as f:
        steps = [json.loads(line) for line in f][1:]  # the first step only writes: nothing was on disk yet
    assert steps and all(sum(s["bytes_read"].values()) > 0 and sum(s["bytes_written"].values()) > 0 for s in steps), steps


def _stop(p: subprocess.Popen) -> tuple[str, str]:
    if p.poll() is None:
        os.killpg(p.pid, signal.SIGINT)
    try:
        return p.communicate(timeout=180)
    except subprocess.TimeoutExpired:
        os.killpg(p.pid, signal.SIGKILL)
        return p.communicate()


def _resume(tmp_path, ckpt: str) -> list[float]:
    """The checkpoint saved at step 3, resumed on a disk of its own to step 6."""
    nvme = tmp_path / "nvme-resume"
    nvme.mkdir()
    r = subprocess.run(
        [
            sys.executable,
            "-m",
            "offloadctl.cli",
            "train",
            "--num_gpus",
            "1",
            "--master_port",
            free_port(),
            "--nvme",
            str(nvme),
            "--host-cache",
            "0",
            "--tuner",
            "off",
            "--run-dir",
            str(tmp_path / "resumed"),
            TINY,
            "--steps",
            "6",
            "--losses-out",
            str(tmp_path / "resumed.jsonl"),
            "--resume",
            ckpt,
        ],
        cwd=ROOT,
        env=env_with_root(),
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert r.returncode == 0, r.stderr[-3000:]
    return _losses(tmp_path / "resumed.jsonl")


def _fill(mnt: str) -> None:
    with open(os.path.join(mnt, "filler"), "wb", buffering=0) as f:
        try:
            while True:
                f.write(b"\1" * (1 << 20))
                f.flush()
        except OSError:
            pass


def _delete_swap_dir(mnt: str) -> None:
    [own] = glob.glob(os.path.join(mnt, "nvme", "offloadctl-swap-*"))
    shutil.rmtree(own)


def _read_only(dev: str) -> None:
    """What ext4 does on an error with errors=remount-ro: the file system goes read-only under
    the run (a user's ``mount -o remount,ro`` is refused while the run's files are open for writing)."""
    with open(f"/sys/fs/ext4/{os.path.basename(dev)}/trigger_fs_error", "w") as f:
        f.write("offloadctl test: the disk fails\n")


FAULTS = {
    "disk-full": lambda dev, mnt: _fill(mnt),
    "swap-dir-deleted": lambda dev, mnt: _delete_swap_dir(mnt),
    "read-only": lambda dev, mnt: _read_only(dev),
}
GOES_ON = {"disk-full": True, "swap-dir-deleted": True, "read-only": False}
"""The swap files were allocated at start, and are read and written through the descriptors
opened then: a full disk and a deleted directory take nothing from them. A read-only file system
refuses the next write: the run stops in one line."""


@needs_root
@pytest.mark.parametrize("fault", sorted(FAULTS))
def test_a_disk_fault_mid_run_with_the_state_on_it(fault, ds_runs, tmp_path):
    whole = ds_runs.get(ours(1, "--dtype", "fp32", *SAVE, opts=LAYOUTS["all-nvme"])).ok()  # never faulted
    ckpt = str(tmp_path / "ckpt")
    with small_ext4() as (dev, mnt):
        nvme = os.path.join(mnt, "nvme")
        os.mkdir(nvme, 0o700)
        budget = _smallest_budget(tmp_path, nvme)
        p, run_dir, losses = _start(tmp_path, nvme, budget, ckpt)
        try:
            wait_for(lambda: len(_losses(losses)) >= 5 or p.poll() is not None, 300, "steps past the checkpoint")
            assert p.poll() is None, _stop(p)[1][-3000:]
            _every_step_swaps(run_dir)
            before = len(_losses(losses))
            FAULTS[fault](dev, mnt)
            wait_for(lambda: len(_losses(losses)) >= before + 10 or p.poll() is not None, 300, "the run after the fault")
            went_on = p.poll() is None
        finally:
            out, err = _stop(p)
        assert "Traceback" not in err and went_on == GOES_ON[fault], err[-5000:]
        if went_on:  # it goes on correctly: the losses of a run that had no fault
            assert p.returncode == 128 + signal.SIGINT, err[-3000:]
            assert _losses(losses)[:6] == whole.losses, err[-3000:]
        else:  # it stops cleanly: one line naming the file, the cause and the fix
            said = [ln for ln in err.splitlines() if ln.startswith("offloadctl: ") and "optimizer state" in ln]
            assert p.returncode not in (0, 128 + signal.SIGINT) and len(set(said)) == 1, err[-3000:]
            if fault == "read-only":
                assert "(Read-only file system)" in said[0] and "went read-only" in said[0], said
        if fault != "read-only":  # nothing left behind (on a read-only disk, the next run there removes them)
            assert glob.glob(os.path.join(nvme, "offloadctl-swap-*", "*", "*.swp")) == []
    assert _resume(tmp_path, ckpt) == whole.losses[3:]


@pytest.mark.parametrize("backend", ["posix", "aio"])
def test_a_swap_dir_deleted_between_steps_reads_the_files_the_rank_made(backend, tmp_path):
    """DeepSpeed's async_io op reads by name: it read the deleted name and failed, where the
    descriptors the rank holds still had the state. Every step here reads and writes the files,
    and the parameters come out bit for bit those of the same steps with nothing deleted."""
    import torch
    from helpers import feed_same_grads, make_model

    from engine import OffloadAdamW
    from engine.storage.io_backends import open_backend

    if backend == "aio" and open_backend("auto").name != "aio":
        pytest.skip("DeepSpeed's async_io op is not built here")

    def run(delete: bool) -> list:
        nvme = tmp_path / f"nvme-{delete}"
        nvme.mkdir()
        model = make_model()
        opt = OffloadAdamW(
            model.parameters(),
            lr=1e-2,
            subgroup_numel=300,
            nvme_paths=[str(nvme)],
            host_cache_bytes=0,
            io_backend=backend,
            host_adam="torch",
            overlap_io=False,
        )
        try:
            feed_same_grads([(model, opt)], 2)
            if delete:
                [own] = glob.glob(str(nvme / "offloadctl-swap*"))  # this user's; the name before issue 43 too
                shutil.rmtree(own)
            feed_same_grads([(model, opt)], 3, seed=7)
            assert all(sum(r.bytes_read.values()) > 0 and sum(r.bytes_written.values()) > 0 for r in opt.telemetry[1:])
        finally:
            opt.close()
        return [p.detach().clone() for p in model.parameters()]

    assert all(torch.equal(a, b) for a, b in zip(run(True), run(False)))
