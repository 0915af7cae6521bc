"""The tuner daemon's files where another user got there first: links planted (as uid 65534,
with setpriv) in a directory others may write, for the log and the history database that
``offloadctl tuner start --socket DIR/t.sock --db DIR/t.db`` would write. Refused in one line,
the link targets untouched, no daemon left running; in a directory of the user's own, start
says it started, and the daemon answers."""

from __future__ import annotations

import functools
import os
import shutil
import subprocess
import tempfile

import pytest
from helpers import cli, needs_root

ROOT_ONLY = functools.partial(needs_root, reason="needs root to act as another user (setpriv)")
FIX = "pick a --socket in a directory only you can write (mode 0700)"


def _as_nobody(*cmd: str) -> None:
    subprocess.run(["setpriv", "--reuid=nobody", "--regid=nogroup", "--clear-groups", *cmd], check=True)


@pytest.fixture
def shared():
    """A scratch directory every user may write (mode 1777, as /tmp or a cluster's /scratch), in
    a directory every user may enter, and a file of the victim's (this user's) outside it."""
    base = tempfile.mkdtemp(prefix="offloadctl-shared-")
    os.chmod(base, 0o755)
    d = os.path.join(base, "scratch")
    os.mkdir(d)
    os.chmod(d, 0o1777)
    victim = os.path.join(base, "victim.txt")
    with open(victim, "w") as f:
        f.write("the victim's own file\n")
    empty = os.path.join(base, "victim-empty")
    open(empty, "w").close()
    yield d, victim, empty
    cli("tuner", "stop", "--socket", os.path.join(d, "t.sock"), timeout=60)  # nothing should run; if it does, stop it
    shutil.rmtree(base, ignore_errors=True)


@pytest.fixture
def own(tmp_path):
    """A directory of this user's alone (mode 0700); a daemon left at its t.sock is stopped."""
    d = tmp_path / "own"
    d.mkdir(mode=0o700)
    yield d
    if os.path.exists(d / "t.sock"):
        cli("tuner", "stop", "--socket", str(d / "t.sock"), timeout=60)


def _unchanged(victim: str, empty: str) -> None:
    assert open(victim).read() == "the victim's own file\n"
    assert os.path.getsize(empty) == 0


@ROOT_ONLY
def test_links_planted_in_a_shared_directory_are_never_followed(shared):
    d, victim, empty = shared
    _as_nobody("ln", "-s", victim, os.path.join(d, "t.sock.log"))
    _as_nobody("ln", "-s", empty, os.path.join(d, "t.db"))
    r = cli("tuner", "start", "--socket", os.path.join(d, "t.sock"), "--db", os.path.join(d, "t.db"), timeout=120)
    assert r.returncode == 2 and r.stdout == "" and "Traceback" not in r.stderr, r.stdout + r.stderr
    assert r.stderr.splitlines() == [
        f"offloadctl: {d} is writable by other users (mode 1777): they could put links there for the tuner daemon's "
        f"log, pidfile or history; {FIX}"
    ], r.stderr
    _unchanged(victim, empty)
    assert sorted(os.listdir(d)) == ["t.db", "t.sock.log"]  # the links, and nothing of the daemon's
    assert cli("tuner", "status", "--socket", os.path.join(d, "t.sock")).returncode == 3


@ROOT_ONLY
def test_a_history_database_in_a_shared_directory_is_refused_before_the_daemon_starts(shared, own):
    d, victim, empty = shared
    _as_nobody("ln", "-s", empty, os.path.join(d, "t.db"))
    r = cli("tuner", "start", "--socket", str(own / "t.sock"), "--db", os.path.join(d, "t.db"), timeout=120)
    assert r.returncode == 2 and r.stdout == "" and "Traceback" not in r.stderr, r.stdout + r.stderr
    assert r.stderr.splitlines() == [
        f"offloadctl: tuner history database {d}/t.db: {d} is writable by other users (mode 1777), where they could "
        f"put links for it: give --db a path in a directory only you can write (mode 0700)"
    ], r.stderr
    _unchanged(victim, empty)
    assert cli("tuner", "status", "--socket", str(own / "t.sock")).returncode == 3


@pytest.mark.parametrize("planted", ["t.sock.log", "t.db", "t.db-wal"])
def test_a_link_in_place_of_a_daemon_file_is_refused(planted, own, tmp_path):
    """In a directory of the user's own, a link where the log or the database goes (left there,
    or made by a script gone wrong) is refused too, not followed."""
    victim, empty = tmp_path / "victim.txt", tmp_path / "victim-empty"
    victim.write_text("the victim's own file\n")
    empty.touch()
    os.symlink(victim if planted.endswith(".log") else empty, own / planted)
    r = cli("tuner", "start", "--socket", str(own / "t.sock"), "--db", str(own / "t.db"), timeout=120)
    assert r.returncode == 2 and r.stdout == "" and "Traceback" not in r.stderr, r.stdout + r.stderr
    want = (
        f"tuner log {own}/t.sock.log is a symbolic link, which someone else may have put there: remove it, or {FIX}"
        if planted.endswith(".log")
        else f"tuner history database {own}/t.db: {own}/{planted} is a symbolic link, which someone else may have put "
        f"there: remove it, or give --db a path in a directory only you can write (mode 0700)"
    )
    assert r.stderr.splitlines() == [f"offloadctl: {want}"], r.stderr
    _unchanged(str(victim), str(empty))
    assert cli("tuner", "status", "--socket", str(own / "t.sock")).returncode == 3


@pytest.mark.slow
def test_start_in_a_directory_of_ones_own_says_started_and_the_daemon_answers(own):
    sock = str(own / "t.sock")
    try:
        r = cli("tuner", "start", "--socket", sock, "--db", str(own / "t.db"), timeout=120)
        assert r.returncode == 0 and r.stderr == "", r.stdout + r.stderr
        assert r.stdout.startswith(f"tuner daemon started at {sock} (pid "), r.stdout
        assert cli("tuner", "status", "--socket", sock).returncode == 0
        for name in ("t.sock.log", "t.db"):
            assert oct(os.stat(own / name).st_mode & 0o777) == "0o600", name
    finally:
        assert cli("tuner", "stop", "--socket", sock, timeout=60).returncode == 0
