"""A swap directory another user made first on a shared path (issue 43, item 2).

On a cluster's world-writable ``/scratch``, another user could create ``offloadctl-swap/`` before
a run (writable by all, or a symbolic link to a directory of the victim's): the engine used it
as it was, and that user could then move the live run's swap files away or put files of their
own in their place. Each test plants what another user would, as a real other user (``nobody``,
through ``setpriv``), in a real shared directory; root only.
"""

from __future__ import annotations

import glob
import os
import shutil
import stat
import subprocess
import tempfile

import pytest
from helpers import ROOT, cli, make_model, needs_root

from engine import OffloadAdamW
from engine.errors import StoragePathError
from engine.storage.usable import check_usable

NOBODY = ["setpriv", "--reuid=nobody", "--regid=nogroup", "--clear-groups"]
ME = os.geteuid()


def as_nobody(*argv: str) -> None:
    subprocess.run([*NOBODY, *argv], check=True, capture_output=True)


@pytest.fixture
def scratch():
    """A shared scratch directory as clusters make them (mode 1777), and a directory of this
    user's elsewhere that a planted link could point at."""
    base = tempfile.mkdtemp(prefix="offloadctl-scratch-", dir="/var/tmp")  # a disk: O_DIRECT works
    shared, mine = os.path.join(base, "scratch"), os.path.join(base, "home")
    os.mkdir(shared)
    os.chmod(shared, 0o1777)
    os.mkdir(mine, 0o700)
    os.chmod(base, 0o755)  # nobody may reach the shared directory
    yield shared, mine
    shutil.rmtree(base, ignore_errors=True)


def _opt(path: str) -> OffloadAdamW:
    return OffloadAdamW(
        make_model().parameters(), lr=1e-2, subgroup_numel=256, nvme_paths=[path], host_adam="torch", host_cache_bytes=0
    )


def _refused(path: str, expect: str) -> str:
    """Both where it is checked, the launcher's check and the engine: one line, naming ``expect``."""
    with pytest.raises(StoragePathError) as launcher:
        check_usable(path)
    with pytest.raises(StoragePathError) as engine:
        _opt(path)
    for e in (launcher, engine):
        assert expect in str(e.value) and "\n" not in str(e.value), str(e.value)
    return str(engine.value)


@needs_root
def test_a_swap_dir_anyone_may_write_that_another_user_made_is_refused(scratch):
    shared, _ = scratch
    planted = os.path.join(shared, f"offloadctl-swap-{ME}")
    as_nobody("mkdir", "-m", "777", planted)
    msg = _refused(shared, planted)
    assert msg == (
        f"swap directory {planted} belongs to uid 65534, not to you (uid {ME}): another user made it; "
        f"have it removed, or give another path"
    )
    assert os.listdir(planted) == []  # nothing of the run's went there


@needs_root
def test_a_swap_dir_linked_by_another_user_to_a_dir_of_mine_is_refused(scratch):
    shared, mine = scratch
    planted = os.path.join(shared, f"offloadctl-swap-{ME}")
    as_nobody("ln", "-s", mine, planted)
    msg = _refused(shared, planted)
    assert "is a symbolic link" in msg and f"rm {planted}" in msg, msg
    assert os.listdir(mine) == []  # nothing written, and nothing of mine removed as "stale"


@needs_root
def test_a_swap_dir_of_mine_that_others_may_write_is_refused(scratch):
    shared, _ = scratch
    own = os.path.join(shared, f"offloadctl-swap-{ME}")
    os.mkdir(own)
    os.chmod(own, 0o777)
    assert "is writable by other users (mode 0777)" in _refused(shared, own)


@needs_root
def test_a_path_everyone_may_write_without_the_sticky_bit_is_refused(scratch):
    """There anyone may rename anyone's entries: the swap directory itself could be swapped."""
    shared, _ = scratch
    os.chmod(shared, 0o777)
    assert "chmod +t" in _refused(shared, "without the sticky bit")


@needs_root
def test_the_old_shared_name_another_user_made_is_not_used(scratch):
    """The name every user shared before (``offloadctl-swap``), planted 0777: the run keeps to its
    own directory (0700, files 0600), which it removes at the end; the planted one is untouched."""
    shared, _ = scratch
    as_nobody("mkdir", "-m", "777", os.path.join(shared, "offloadctl-swap"))
    as_nobody("mkdir", "-m", "700", os.path.join(shared, "offloadctl-swap-65534"))  # nobody's own, beside ours
    opt = _opt(shared)
    try:
        own = os.path.join(shared, f"offloadctl-swap-{ME}")
        files = glob.glob(os.path.join(own, "*", "*.swp"))
        assert files and os.listdir(os.path.join(shared, "offloadctl-swap")) == []
        st = os.lstat(own)
        assert stat.S_ISDIR(st.st_mode) and st.st_uid == ME and stat.S_IMODE(st.st_mode) == 0o700
        assert {stat.S_IMODE(os.stat(f).st_mode) for f in files} == {0o600}
    finally:
        opt.close()
    assert sorted(os.listdir(shared)) == ["offloadctl-swap", "offloadctl-swap-65534"]


@needs_root
def test_offloadctl_train_refuses_a_planted_swap_dir_before_the_launch(scratch):
    shared, _ = scratch
    planted = os.path.join(shared, f"offloadctl-swap-{ME}")
    as_nobody("mkdir", "-m", "777", planted)
    r = cli(
        "train",
        "--num_gpus",
        "1",
        "--nvme",
        shared,
        "--tuner",
        "off",
        "--run-dir",
        os.path.join(scratch[1], "run"),
        os.path.join(ROOT, "tests", "ds_scripts", "train_tiny.py"),
        timeout=120,
    )
    assert r.returncode == 2 and r.stdout == "" and "Traceback" not in r.stderr, r.stderr
    assert r.stderr.startswith(f"offloadctl: swap directory {planted} belongs to uid 65534") and r.stderr.count("\n") == 1
    assert not os.path.exists(os.path.join(scratch[1], "run")) and os.listdir(planted) == []
