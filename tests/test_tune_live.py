"""`offloadctl tune` finds live runs and follows them to their end: private daemons started as
`offloadctl train` starts them (tuner.service.ensure_daemon), real engine-side clients, the
CLI as a process; the registry of live runs, its stale entries; the daemon's log at a stop;
the live view at 80 columns; help at 80 columns."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time

import pytest
from helpers import cli, env_with_root, registered_run, wait_for

from engine.config import Knobs
from tuner import client as client_module
from tuner import service
from tuner.protocol import Connection

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _cli(*args: str, timeout: float = 60) -> subprocess.CompletedProcess:
    return cli(*args, timeout=timeout, env=env_with_root(COLUMNS="80"))


def _run(run_dir: str, run_id: str, nvme: str, iterations: int = 4):
    return registered_run(run_dir, run_id, nvme, iterations)


def _iteration(sock: str, run_id: str) -> int | None:
    with Connection(sock) as c:
        runs = c.request("snapshot", history=0)["runs"]
    return next((r["iteration"] for r in runs if r["run_id"] == run_id), None)


def test_live_runs_are_found_listed_and_picked_by_run_dir(private_env):
    a_dir, b_dir = str(private_env / "a" / "run"), str(private_env / "b" / "run")
    a_sock, a_stop, a_rank = _run(a_dir, "run-a", str(private_env))
    try:
        assert [e["run_dir"] for e in service.live_runs()] == [a_dir]
        out = _cli("tune", "--once", "--json")  # one live run: that one, no socket given
        assert out.returncode == 0, out.stderr
        assert [r["run_id"] for r in json.loads(out.stdout)["runs"]] == ["run-a"]

        b_sock, b_stop, b_rank = _run(b_dir, "run-b", str(private_env))
        try:
            out = _cli("tune", "--once")
            assert out.returncode == 2 and out.stderr.count("\n") == 1, out.stderr
            assert "2 live runs: pick one with --run-dir DIR" in out.stderr
            listed = out.stdout.splitlines()
            assert listed[0].split() == ["RUN", "DIR", "RUN", "ITERATION", "STARTED"]
            assert [line.split()[:3] for line in listed[1:]] == [[a_dir, "run-a", "4"], [b_dir, "run-b", "4"]]

            out = _cli("tune", "--once", "--json", "--run-dir", b_dir)
            assert out.returncode == 0, out.stderr
            assert [r["run_id"] for r in json.loads(out.stdout)["runs"]] == ["run-b"]
            out = _cli("tune", "--pin", "run-b:prefetch_depth=3")  # the run id picks the daemon
            assert out.returncode == 0 and out.stdout.startswith("run-b: pinned prefetch_depth=3"), out.stderr
        finally:
            b_rank.close()
            b_stop()
        assert [e["run_dir"] for e in service.live_runs()] == [a_dir]  # b's entry went with its daemon
        out = _cli("tune", "--once", "--run-dir", b_dir)
        assert out.returncode == 2 and f"--run-dir {b_dir}: no live run there" in out.stderr, out.stderr
    finally:
        a_rank.close()
        a_stop()
    assert service.live_runs() == []
    out = _cli("tune", "--live")
    assert out.returncode == 2 and out.stderr.count("\n") == 1 and "Traceback" not in out.stderr
    assert "no live run" in out.stderr and "--run-dir DIR" in out.stderr, out.stderr


def test_a_stale_registry_entry_is_ignored_and_removed(private_env):
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    sock, stop, rank = _run(str(private_env / "live" / "run"), "live-run", str(private_env))
    try:
        os.makedirs(service.registry_dir(), exist_ok=True)
        stale = service.register_run(sock, str(private_env / "gone"), pid=dead.pid)  # its daemon was SIGKILLed
        garbage = os.path.join(service.registry_dir(), "12345678.json")
        with open(garbage, "w") as f:
            f.write("{not json")
        out = _cli("tune", "--once", "--json")
        assert out.returncode == 0, out.stderr  # one live run, not a list of two
        assert [r["run_id"] for r in json.loads(out.stdout)["runs"]] == ["live-run"]
        assert not os.path.exists(stale) and not os.path.exists(garbage)
    finally:
        rank.close()
        stop()


def _watch(run_dir: str) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "-m", "offloadctl.cli", "tune", "--live", "--interval", "0.2", "--run-dir", run_dir],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=dict(os.environ, COLUMNS="80", PYTHONPATH=ROOT),
    )


def _ended(watch: subprocess.Popen) -> tuple[str, str]:
    out, err = watch.communicate(timeout=60)
    assert watch.returncode == 0, err
    assert "Traceback" not in out + err and "Broken pipe" not in out + err, out + err
    assert all(len(line) <= 80 for line in out.splitlines()), out
    return out, err


@pytest.mark.slow
def test_the_live_view_ends_with_the_run(private_env):
    """Finished (every rank said bye), interrupted (a rank's bye names a signal), and a daemon
    gone mid-run: a final frame and line, exit status 0, no traceback."""
    run_dir = str(private_env / "fin" / "run")
    sock, stop, rank = _run(run_dir, "fin-run", str(private_env))
    watch = _watch(run_dir)
    try:
        time.sleep(2)  # the view is up (it would have exited otherwise)
        assert watch.poll() is None, watch.communicate()
        rank.close()
        out, _ = _ended(watch)
        assert "fin-run (finished)" in out and "fin-run: finished at iteration 4" in out, out
    finally:
        stop()
    assert "Traceback" not in open(service.logfile_for(sock)).read()

    run_dir = str(private_env / "int" / "run")
    sock, stop, rank = _run(run_dir, "int-run", str(private_env))
    watch = _watch(run_dir)
    try:
        time.sleep(2)
        # As the rank's bootstrap does when the launcher stops it, with the record's count: a
        # fifth iteration whose step the signal cut short (the engine completed 4).
        client_module.note_stopped("SIGTERM", 5)
        rank.close()
        out, _ = _ended(watch)
        assert "int-run (interrupted)" in out, out
        assert "int-run: interrupted by SIGTERM at iteration 5" in out, out
    finally:
        client_module._stopped_by, client_module._stopped_at = None, 0
        stop()

    run_dir = str(private_env / "gone" / "run")
    sock, stop, rank = _run(run_dir, "gone-run", str(private_env))
    watch = _watch(run_dir)
    try:
        time.sleep(2)
        stop()  # the daemon goes while the rank still trains: `offloadctl train` killed, say
        out, _ = _ended(watch)
        assert "gone-run (interrupted)" in out and "gone-run: interrupted at iteration 4" in out, out
    finally:
        rank.close()


def test_daemon_log_ends_cleanly_with_clients_connected(private_env):
    """A normal stop while a rank and a CLI are connected: the log ends with `stopped`, no traceback."""
    sock, stop, rank = _run(str(private_env / "r" / "run"), "log-run", str(private_env))
    cli = Connection(sock)
    try:
        stop()
    finally:
        cli.close()
        rank.close(timeout_s=0.5)
    log = open(service.logfile_for(sock)).read()
    assert "Traceback" not in log and "CancelledError" not in log, log
    assert log.rstrip().splitlines()[-1].endswith("offloadctl.tuner: stopped"), log


def test_live_view_at_80_columns(private_env):
    """The frame fits 80x24; one iteration time; a labelled sparkline; pins and movable knobs."""
    from rich.console import Console

    from offloadctl.commands.tune_view import fitted_panels, tuner_state

    sock, stop, rank = _run(str(private_env / "w" / "run"), "wide-run", str(private_env), iterations=12)
    try:
        with Connection(sock) as c:
            for value in (3, 5, 6, 7, 4):  # a decisions table taller than the terminal has room for
                c.request("pin", run_id="wide-run", knob="prefetch_depth", value=value)
            (view,) = c.request("snapshot", history=60)["runs"]
    finally:
        rank.close()
        stop()
    console = Console(width=80, height=24, record=True, file=open(os.devnull, "w"))
    for panel in fitted_panels([view], console):
        console.print(panel)
    text = console.export_text()
    lines = text.splitlines()
    assert all(len(line) <= 80 for line in lines) and len(lines) <= 23, text
    # the iteration time, once: the phases' total (the sparkline's line gives its range)
    assert [line.split() for line in lines if "500 ms" in line and " to " not in line] == [["│", "total", "500", "ms", "│"]], text
    assert re.search(r"iteration time, last 12 iterations: \S+\s+500 ms to 500 ms", text), text
    assert "pinned: prefetch_depth=4; tuner may move: device_fraction, io_concurrency" in text, text
    assert f"tuner: {tuner_state(view)}"[:30] in text, text


def test_help_fits_80_columns_and_value_errors_name_the_flag():
    for cmd in (["tune"], ["tuner"], ["tuner", "serve"], ["tuner", "start"], ["tuner", "stop"], ["tuner", "status"]):
        out = _cli(*cmd, "--help")
        assert out.returncode == 0, out.stderr
        assert all(len(line) <= 80 for line in out.stdout.splitlines()), (cmd, out.stdout)
        module = re.search(r"\b(?:tuner|engine|integrations|perf|report)\.(?!sock\b|db\b)\w+", out.stdout)
        assert "``" not in out.stdout and not module, (cmd, out.stdout)
    out = _cli("tune", "--pin", "myrun:prefetch_depth=-1")
    assert out.returncode == 2 and out.stderr.count("\n") == 1, out.stderr
    assert "--pin 'myrun:prefetch_depth=-1': prefetch_depth must be" in out.stderr and "Knobs." not in out.stderr
    out = _cli("tune", "--pin", "prefetch_depth=-1")
    assert out.returncode == 2 and "--pin 'prefetch_depth=-1': write RUN:KNOB=VALUE" in out.stderr, out.stderr


@pytest.mark.slow
def test_a_run_whose_rank_dies_ends_as_interrupted(private_env):
    """A rank process killed without a bye while its daemon stays up: after the grace period
    the view calls the run interrupted, at the last iteration it reported."""
    run_dir = str(private_env / "dead" / "run")
    sock, stop = service.ensure_daemon(str(private_env / "no-system.sock"), run_dir=run_dir)
    rank = subprocess.Popen(
        [
            sys.executable,
            "-c",
            f"""
import os, sys, time
from engine.config import Knobs
from engine.telemetry import StepRecord
from tuner.client import TunerClient
from tuner.run_state import RunFacts
c = TunerClient({sock!r}, RunFacts(params=1000, paths=({str(private_env)!r},), subgroup_bytes=12000), Knobs(),
                run_id="dead-run", rank=0)
assert c.connected.wait(20)
for i in range(5):
    c.report(StepRecord(iteration=i, update_s=0.2, read_wait_s=0.05, kernel_s=0.1, write_wait_s=0.05),
             iter_time_s=0.5)
print("reported", flush=True)
time.sleep(600)
""",
        ],
        cwd=ROOT,
        env=dict(os.environ, PYTHONPATH=ROOT),
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert rank.stdout.readline() == "reported\n"
        wait_for(lambda: _iteration(sock, "dead-run") == 4, 20, "the rank's telemetry")
        watch = _watch(run_dir)
        time.sleep(2)
        rank.kill()  # SIGKILL: no bye
        t0 = time.monotonic()
        out, _ = _ended(watch)
        assert time.monotonic() - t0 >= 2.5  # the grace period: ranks that come back within it are not gone
        assert "dead-run (interrupted)" in out and "dead-run: interrupted at iteration 5" in out, out
    finally:
        rank.kill()
        rank.wait()
        stop()


def test_the_tuner_state_line_follows_the_policys_mode():
    """The recorded demo run, on which the policy holds and says why; a pin then restarts its
    measuring: the state line says so, not the old reason to hold (which the decisions table
    would contradict with the pin)."""
    from offloadctl.commands.tune_view import tuner_state
    from tuner.observation import Observation
    from tuner.policy import Policy
    from tuner.run_state import RunFacts, tuner_activity

    pol = Policy(Knobs(), RunFacts(paths=("/nvme",), subgroup_bytes=5_500_000, params=3_189_248))
    with open(os.path.join(ROOT, "tests", "data", "demo-trace.jsonl")) as f:
        for line in f:
            if not line.startswith("#"):
                pol.observe(Observation(**json.loads(line), path_other_bytes_per_s={}, device_headroom_bytes=None))

    def view() -> dict:
        return {
            "status": "running",
            "frozen": False,
            "verdict": tuner_activity(pol.state(), frozen=False, policy_error=None, decisions=[]),
        }

    assert re.fullmatch(
        r"holding \(since iteration \d+\): the knobs can change only the update's I/O waits, "
        r"[\d.]+% of the iteration: under the \d+% a gain must pass to show above this run's noise",
        tuner_state(view()),
    ), tuner_state(view())
    pol.pin("prefetch_depth", 3)
    assert pol.state()["holding_reason"] is None and tuner_state(view()) == "measuring the current knobs"


def test_the_activity_is_the_daemons_and_its_words_the_clis():
    """The snapshot says what the tuner does (mode, since, trial, reason) and how a run ended;
    tune's view words it, with no sentence of the policy's taken apart."""
    from offloadctl.commands.tune_view import activity_text, ended_text
    from tuner.run_state import run_outcome, tuner_activity

    decisions = [{"source": "policy", "reason": "kept prefetch_depth 2->3"}, {"source": "user", "reason": "pinned"}]
    trial = tuner_activity(
        {"mode": "trial", "trial": "prefetch_depth 3->4"}, frozen=False, policy_error=None, decisions=decisions
    )
    assert trial == {
        "mode": "trial",
        "since_iteration": None,
        "trial": "prefetch_depth 3->4",
        "reason": "kept prefetch_depth 2->3",
    }
    assert activity_text(trial) == "trying prefetch_depth 3->4"
    holding = tuner_activity(
        {"mode": "holding", "since_iteration": 7, "holding_reason": None}, frozen=False, policy_error=None, decisions=decisions
    )
    assert activity_text(holding) == "holding (since iteration 7): no move left to try"
    frozen = tuner_activity({"mode": "holding"}, frozen=True, policy_error=None, decisions=decisions)
    assert frozen["reason"] is None and activity_text(frozen) == "frozen by the user: knobs held"
    stopped = tuner_activity(None, frozen=True, policy_error="boom", decisions=[])
    assert activity_text(stopped) == "policy stopped: boom"
    assert activity_text(tuner_activity(None, frozen=False, policy_error=None, decisions=[])) == ""
    assert [
        run_outcome(s, by) for s, by in (("running", None), ("finished", None), ("finished", "SIGINT"), ("disconnected", None))
    ] == ["running", "finished", "interrupted", "interrupted"]
    run = {"outcome": "interrupted", "stopped_by": "SIGTERM", "iteration": 9}
    assert ended_text(run) == "interrupted by SIGTERM at iteration 10"
