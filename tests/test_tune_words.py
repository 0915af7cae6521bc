"""What `offloadctl tune`, `tuner status` and `report` say (issue 46, points 5 to 8): a missing
directory said missing, a starting run said starting, the `offloadctl:` prefix on every error,
replies within 80 columns, the live view's per-path slots explained on `?`, and a mistyped
knob in the view answered with the nearest name in the view's own words. Real daemons, a real
engine-side client, the CLI as a process; the live view in tmux at 80x24."""

from __future__ import annotations

import os
import re
import shlex
import shutil
import subprocess
import sys
import time
import uuid

import pytest
from helpers import ROOT, cli, env_with_root, registered_run, wait_for

from engine.config import Knobs
from tuner import service


def _cli(*args: str, timeout: float = 60) -> subprocess.CompletedProcess:
    return cli(*args, timeout=timeout, env=env_with_root(COLUMNS="80"))


def _one_line(out: subprocess.CompletedProcess, rc: int, pattern: str) -> None:
    assert out.returncode == rc, (out.returncode, out.stdout, out.stderr)
    assert "Traceback" not in out.stderr and len(out.stderr.strip().splitlines()) == 1, out.stderr
    assert out.stderr.startswith("offloadctl: ") and re.search(pattern, out.stderr), out.stderr


def _run(run_dir: str, run_id: str, nvme: str, iterations: int = 4):
    return registered_run(run_dir, run_id, nvme, iterations, with_knobs=True)


def test_missing_directories_and_a_daemon_that_is_not_there_are_said_so(private_env):
    missing = str(private_env / "no-such-run")
    _one_line(_cli("report", missing), 2, rf"{re.escape(missing)} does not exist: give the --run-dir")
    _one_line(_cli("tune", "--run-dir", missing), 2, rf"--run-dir {re.escape(missing)} does not exist")
    a_file = private_env / "a-file"
    a_file.write_text("x")
    _one_line(_cli("report", str(a_file)), 2, "is not a directory")
    _one_line(_cli("tune", "--run-dir", str(a_file)), 2, "is not a directory")
    out = _cli("tuner", "status", "--socket", str(private_env / "t.sock"))
    _one_line(out, 3, r"no tuner daemon answers at \S+t\.sock .*: start one with `offloadctl tuner start`")
    assert out.stdout == ""


def test_a_starting_run_is_said_to_be_starting(private_env):
    """Its daemon is up, its ranks have not registered: `tune --once` says so and what to do,
    not `tuner runs: none`."""
    run_dir = str(private_env / "start" / "run")
    sock, stop = service.ensure_daemon(str(private_env / "no-system.sock"), run_dir=run_dir)
    try:
        out = _cli("tune", "--once", "--run-dir", run_dir)
        assert out.returncode == 0, out.stderr
        text = " ".join(out.stdout.split())
        assert "tuner runs: none" not in text, out.stdout
        assert f"the run in {run_dir} is starting: its ranks are loading" in text, out.stdout
        assert f"offloadctl tune --run-dir {run_dir}` (it waits for them)" in text, out.stdout
        assert all(len(line) <= 80 for line in out.stdout.splitlines()), out.stdout
    finally:
        stop()


def test_pin_replies_fit_80_columns_and_mistyped_knobs_get_the_nearest_name(private_env):
    run_dir = str(private_env / "p" / "run")
    sock, stop, rank = _run(run_dir, "a-run-with-a-rather-long-id", "/var/tmp/offloadctl-a-long-nvme-path/run")
    try:
        out = _cli("tune", "--pin", "a-run-with-a-rather-long-id:prefetch_depth=3")
        assert out.returncode == 0, out.stderr
        assert out.stdout.startswith("a-run-with-a-rather-long-id: pinned prefetch_depth=3; knobs now")
        assert all(len(line) <= 80 for line in out.stdout.splitlines()), out.stdout
        assert "prefetch_depth=3" in out.stdout and "node_lock=" in out.stdout
        _one_line(
            _cli("tune", "--pin", "a-run-with-a-rather-long-id:prefech_depth=4"),
            2,
            r"no knob 'prefech_depth' \(did you mean prefetch_depth\?\); write RUN:KNOB=VALUE",
        )
        _one_line(
            _cli("tune", "--unpin", "a-run-with-a-rather-long-id:node_lok"), 2, r"no knob 'node_lok' \(did you mean node_lock\?\)"
        )
        # A knob spelled right, the run left out: no suggestion, the form only.
        _one_line(_cli("tune", "--pin", "prefetch_depth=4"), 2, r"^offloadctl: --pin 'prefetch_depth=4': write RUN:KNOB")
    finally:
        rank.close()
        stop()


class Tmux:
    """A tmux server of this test's own, one window at 80x24."""

    def __init__(self, env: dict) -> None:
        self.sock = f"oc-words-{uuid.uuid4().hex[:8]}"
        args = [a for k, v in env.items() for a in ("-e", f"{k}={v}")]
        self._tmux("new-session", "-d", "-s", "t", "-x", "80", "-y", "24", *args, "bash --norc --noprofile")
        self.send(f"PS1='$ '; cd {shlex.quote(ROOT)}; clear", enter=True)

    def _tmux(self, *args: str) -> str:
        return subprocess.run(
            ["tmux", "-L", self.sock, "-f", "/dev/null", *args], check=True, capture_output=True, text=True
        ).stdout

    def send(self, text: str, *, enter: bool = False) -> None:
        self._tmux("send-keys", "-t", "t", "-l", text)
        if enter:
            self._tmux("send-keys", "-t", "t", "Enter")

    def key(self, key: str) -> None:
        self._tmux("send-keys", "-t", "t", key)

    def screen(self) -> str:
        return self._tmux("capture-pane", "-p", "-t", "t")

    def wait(self, pattern: str, timeout_s: float) -> str:
        try:
            return wait_for(lambda: (lambda s: s if re.search(pattern, s) else None)(self.screen()), timeout_s, pattern)
        except AssertionError:
            raise AssertionError(f"{pattern!r} not on the screen within {timeout_s} s:\n{self.screen()}") from None

    def close(self) -> None:
        subprocess.run(["tmux", "-L", self.sock, "kill-server"], capture_output=True)


def _fits(screen: str) -> None:
    lines = screen.splitlines()
    assert len(lines) <= 24 and all(len(line) <= 80 for line in lines), screen


@pytest.mark.slow
@pytest.mark.skipif(shutil.which("tmux") is None, reason="needs tmux (apt-get install tmux)")
def test_the_live_view_explains_slots_and_answers_a_mistyped_knob(private_env):
    run_dir = str(private_env / "v" / "run")
    nvme = str(private_env / "nvme")
    sock, stop, rank = _run(run_dir, "view-run", nvme)
    env = {
        "PYTHONPATH": ROOT,
        "XDG_RUNTIME_DIR": os.environ["XDG_RUNTIME_DIR"],
        "TERM": "xterm-256color",
        "XDG_STATE_HOME": os.environ["XDG_STATE_HOME"],
    }
    t = Tmux(env)
    try:
        t.send(f"{shlex.quote(sys.executable)} -m offloadctl.cli tune --run-dir {shlex.quote(run_dir)}; echo TUNE-$?", enter=True)
        frame = t.wait(r"ranks 1/1", 60)
        # The per-path column is the path's slots (its io_concurrency), not an unexplained "- / 4".
        assert "queue" not in frame and " - / " not in frame, frame
        head = next(line for line in frame.splitlines() if "serves at" in line)
        assert head.strip(" │").split()[-2:] == ["others", "slots"], frame
        rows = frame.splitlines()
        row = rows[rows.index(head) + 1 : rows.index(head) + 4]  # the path's row (its path may fold onto more)
        assert any(re.search(rf"MB/s .*\s{Knobs().concurrency_for(nvme)}\s+│$", x) for x in row), frame
        _fits(frame)
        t.key("?")
        help_screen = t.wait(r"keys of the live view", 10)
        joined = " ".join(help_screen.split())
        assert (
            "slots (per path): the most reads and writes the engine keeps in flight there at once, its io_concurrency" in joined
        ), help_screen
        _fits(help_screen)
        t.key("?")
        t.wait(r"ranks 1/1", 10)
        t.key("p")
        t.send("prefech_depth=4")
        t.wait(r"pin KNOB=VALUE: prefech_depth=4", 10)
        t.key("Enter")
        said = t.wait(r"did you mean", 10)
        line = next(x for x in said.splitlines() if "did you mean" in x)
        assert "prefech_depth=4: no knob 'prefech_depth' (did you mean prefetch_depth?)" in " ".join(said.split()), said
        assert "RUN:KNOB" not in said and "--pin" not in said, said
        _fits(said)
        assert len(line) <= 80
        t.key("p")
        t.send("prefetch_depth=-1")
        t.key("Enter")
        said = t.wait(r"prefetch_depth must", 10)
        assert "prefetch_depth=-1: prefetch_depth must be" in " ".join(said.split()), said
        assert "--pin" not in said and "view-run:" not in said, said
        t.key("q")
        t.wait(r"TUNE-0", 20)
        # The run goes on; when it ends, the view's last line says which median it gives.
        t.send(
            f"clear; {shlex.quote(sys.executable)} -m offloadctl.cli tune --run-dir {shlex.quote(run_dir)}; echo TUNE-$?",
            enter=True,
        )
        t.wait(r"ranks 1/1", 60)
        time.sleep(1)
        rank.close()
        end = t.wait(r"TUNE-0", 60)
        joined = " ".join(end.split())
        assert (
            "view-run: finished at iteration 4; 500 ms/iteration (median of the last 4 the tuner saw; the "
            "run's summary takes all but the first)" in joined
        ), end
        _fits(end)
    finally:
        t.close()
        rank.close()
        stop()
