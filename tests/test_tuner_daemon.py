"""The tuner daemon with real engines in real processes: same-iteration knob changes across
ranks, several runs at once, the daemon killed mid-run and restarted; plus the service
commands (start/stop/status, ensure_daemon), socket activation, the CLI and the units.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import os
import shutil
import socket
import stat
import subprocess
import sys
import time

import pytest
import torch
from helpers import env_with_root, needs_root
from helpers import wait_for as _wait

from engine import AdamWHyper, EngineConfig, FlatSubgroup, Knobs, SubgroupEngine
from engine.errors import ConfigError
from engine.telemetry import StepRecord
from tuner import service
from tuner.client import TunerClient
from tuner.protocol import Connection
from tuner.run_state import RunFacts
from tuner.server import bind_socket

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# A policy that moves prefetch_depth up by one at its 3rd observation, and never again: each
# daemon instance makes exactly one change per run, at a known point.
SCRIPTED_POLICY = '''
from tuner.policy import Decision

class Scripted:
    def __init__(self, start, facts):
        self.knobs, self.n, self.pins, self.log = start, 0, {}, []

    def observe(self, obs):
        self.n += 1
        if self.n == 3:
            self.knobs = self.knobs.replace(prefetch_depth=self.knobs.prefetch_depth + 1)
            return Decision(self.knobs, "scripted: one deeper prefetch at the 3rd observation")

    def pin(self, knob, value, check=None):
        self.knobs = self.knobs.replace(**{knob: value})
        self.pins[knob] = value

    def unpin(self, knob):
        del self.pins[knob]

    def freeze(self, frozen):
        pass


class Static(Scripted):
    """Never moves a knob by itself: only the user's pins change anything."""

    def observe(self, obs):
        return None


class HeadroomEcho(Scripted):
    """Deepens the prefetch once it observes 7000 bytes of GPU headroom: the figure the ranks
    report after registering with another."""

    def observe(self, obs):
        if obs.device_headroom_bytes == 7000 and self.knobs.prefetch_depth != 5:
            self.knobs = self.knobs.replace(prefetch_depth=5)
            return Decision(self.knobs, "saw the refreshed headroom")
'''

# One rank of a run: a real SubgroupEngine (state on a swap path), ranks kept in lockstep by a
# gloo all-reduce per iteration as in data-parallel training, the tuner client wired as the
# optimizer adapters wire it. Writes one JSON line per iteration.
RANK = r"""
import json, os, sys, time
import torch
import torch.distributed as dist
from engine import AdamWHyper, EngineConfig, FlatSubgroup, Knobs, StoragePath, SubgroupEngine
from tuner.client import TunerClient

a = json.loads(sys.argv[1])
if a["world"] > 1:
    dist.init_process_group("gloo", init_method="file://" + a["store"], rank=a["rank"], world_size=a["world"])
torch.manual_seed(0)
numel, sub = 4000, 1000
weight, grad = torch.zeros(numel), torch.zeros(numel)
eng = SubgroupEngine([FlatSubgroup(weight[o:o + sub], grad[o:o + sub]) for o in range(0, numel, sub)],
                     EngineConfig(subgroup_numel=sub, host_cache_bytes=0, io_backend="posix", host_adam="torch",
                                  paths=(StoragePath(path=a["swap"], read_bytes_per_s=1e9, write_bytes_per_s=1e9),)),
                     Knobs(prefetch_depth=a["prefetch"]))
# The client is the engine's step hook: changes applied before each step, telemetry after.
client = TunerClient.for_engine(a["socket"], eng, run_id=a["run"], rank=a["rank"], world_size=a["world"],
                                backoff_s=(0.05, 0.3))
with open(a["out"], "w") as out:
    stop = False
    while not stop:
        grad.normal_()
        rec = eng.step([AdamWHyper(lr=1e-3)])
        # The slowest rank sets the pace; and all ranks stop after the same iteration.
        flag = torch.tensor([float(os.path.exists(a["stop"]) or eng.iteration >= 3000)])
        if a["world"] > 1:
            dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        stop = bool(flag.item())
        out.write(json.dumps({"it": rec.iteration, "pd": rec.knobs.prefetch_depth, "t": time.time(),
                              "connected": client.connected.is_set()}) + "\n")
        out.flush()
        time.sleep(0.02)
client.close()
eng.close()
"""


@pytest.fixture(scope="module")
def policy_dir(tmp_path_factory):
    d = tmp_path_factory.mktemp("policy")
    (d / "scripted.py").write_text(SCRIPTED_POLICY)
    return str(d)


def _serve(sock: str, *extra: str, policy_dir: str | None = None) -> subprocess.Popen:
    """``offloadctl tuner serve`` at ``sock``; its log is appended to ``sock + ".log"``."""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [policy_dir, ROOT])))
    os.makedirs(os.path.dirname(sock), exist_ok=True)
    with open(sock + ".log", "ab") as logf:
        proc = subprocess.Popen(
            [sys.executable, "-m", "offloadctl.cli", "tuner", "serve", "--socket", sock, "--db", "none", "--no-sensors", *extra],
            cwd=ROOT,
            env=env,
            stdout=logf,
            stderr=logf,
        )
    _wait(lambda: service.probe(sock, timeout_s=0.5) is not None or proc.poll() is not None, 60, "daemon start")
    assert proc.poll() is None, open(sock + ".log").read()
    return proc


def _lines(path: str) -> list[dict]:
    try:
        with open(path) as f:
            return [json.loads(x) for x in f if x.endswith("\n")]
    except FileNotFoundError:
        return []


def _snapshot(sock: str) -> dict:
    with Connection(sock) as c:
        return {r["run_id"]: r for r in c.request("snapshot", history=0)["runs"]}


@pytest.mark.slow
def test_ranks_switch_together_across_runs_and_a_daemon_restart(tmp_path, policy_dir):
    """Run A (2 ranks) and run B (1 rank) train under one daemon whose policy makes one change
    per run. Both ranks of A switch at the same iteration, the one the daemon chose. The daemon
    is then killed: training goes on with the last knobs. A new daemon on the same socket gets
    every rank back (the stale socket is replaced), and its change is again applied by both
    ranks of A at one iteration. Run B moves on its own, from its own starting knobs."""
    sock = str(tmp_path / "d" / "tuner.sock")
    policy = ("--policy", "scripted:Scripted", "--margin", "1.0")
    daemon = _serve(sock, *policy, policy_dir=policy_dir)
    stop = str(tmp_path / "stop")
    ranks = []
    for run, rank, world, prefetch in (("A", 0, 2, 2), ("A", 1, 2, 2), ("B", 0, 1, 1)):
        swap = tmp_path / f"swap-{run}{rank}"
        swap.mkdir()
        args = {
            "socket": sock,
            "run": run,
            "rank": rank,
            "world": world,
            "prefetch": prefetch,
            "swap": str(swap),
            "store": str(tmp_path / f"store-{run}"),
            "out": str(tmp_path / f"{run}{rank}.jsonl"),
            "stop": stop,
        }
        with open(args["out"] + ".log", "w") as logf:
            ranks.append(
                (
                    args["out"],
                    subprocess.Popen([sys.executable, "-c", RANK, json.dumps(args)], cwd=ROOT, stdout=logf, stderr=logf),
                )
            )
    outs = {os.path.basename(o)[:2]: o for o, _ in ranks}
    try:
        # 1. the first daemon's change reaches every rank
        def changed(first_pd):
            return all(any(x["pd"] == first_pd[k[0]] for x in _lines(o)) for k, o in outs.items())

        _wait(lambda: changed({"A": 3, "B": 2}), 120, "the first change on every rank")
        before = _snapshot(sock)
        assert before["A"]["ranks"] == 2 and before["A"]["connected"] == 2 and before["B"]["connected"] == 1
        apply_at = {r: before[r]["apply_at"] for r in ("A", "B")}

        # 2. kill the daemon: training goes on, with the last knobs
        daemon.kill()
        daemon.wait()
        t_kill = time.time()
        n_at_kill = {k: len(_lines(o)) for k, o in outs.items()}
        _wait(lambda: all(len(_lines(o)) > n_at_kill[k] + 10 for k, o in outs.items()), 60, "training without daemon")
        assert os.path.exists(sock)  # a SIGKILLed daemon leaves its socket behind

        # 3. a new daemon on the same socket: every rank registers again, a new change applies
        t_restart = time.time()
        daemon = _serve(sock, *policy, policy_dir=policy_dir)
        _wait(lambda: changed({"A": 4, "B": 3}), 120, "the second change on every rank")
        after = _snapshot(sock)
        assert after["A"]["connected"] == 2 and after["B"]["connected"] == 1
        apply_at2 = {r: after[r]["apply_at"] for r in ("A", "B")}
        open(stop, "w").close()
        for out, p in ranks:
            assert p.wait(60) == 0, open(out + ".log").read()[-3000:]
        done = _wait(
            lambda: all(r["status"] == "finished" for r in _snapshot(sock).values()) and _snapshot(sock), 10, "runs to finish"
        )
        assert set(done) == {"A", "B"}
    finally:
        open(stop, "w").close()
        for _, p in ranks:
            if p.poll() is None:
                p.kill()
        daemon.terminate()
        daemon.wait(10)
    assert daemon.returncode == 0
    log = open(sock + ".log").read()
    assert "removed the stale socket" in log and "Traceback" not in log, log

    lines = {k: _lines(o) for k, o in outs.items()}
    for k, ls in lines.items():
        its = [x["it"] for x in ls]
        assert its == list(range(len(its))), f"{k}: iterations not contiguous"
        # knob values in order: the start, one change per daemon, nothing else
        start = 1 if k == "B0" else 2
        assert [x["pd"] for x in ls] == sorted(x["pd"] for x in ls)
        assert {x["pd"] for x in ls} == {start, start + 1, start + 2}
        # trained through the outage: iterations ran while no daemon was up, disconnected
        down = [x for x in ls if t_kill < x["t"] < t_restart]
        assert len(down) >= 10 and not any(x["connected"] for x in down[3:])
        assert all(x["pd"] == start + 1 for x in down)  # the last knobs were kept
        assert ls[-1]["connected"]
    # every rank switched exactly at the iteration the daemon chose: the same on both ranks of A
    for k, ls in lines.items():
        start = 1 if k == "B0" else 2
        first = next(x["it"] for x in ls if x["pd"] == start + 1)
        second = next(x["it"] for x in ls if x["pd"] == start + 2)
        assert first == apply_at[k[0]] and second == apply_at2[k[0]], (k, first, second, apply_at, apply_at2)


def test_a_run_cut_between_a_step_and_its_telemetry_ends_where_its_engine_did(tmp_path):
    """A signal can stop a rank after its engine's step and the recorder's hook, before the
    tuner client's hook queued the step's telemetry: the bye carries the steps the engine
    completed, so the daemon's end (what `tune` shows) counts the iterations the summary does."""
    sock = str(tmp_path / "tuner.sock")
    daemon = _serve(sock)
    eng = SubgroupEngine([FlatSubgroup(torch.zeros(100), torch.ones(100))], EngineConfig(subgroup_numel=100, host_adam="torch"))
    client = TunerClient.for_engine(sock, eng, run_id="cut", backoff_s=(0.05, 0.2))
    try:
        assert client.connected.wait(20)
        hp = [AdamWHyper(lr=1e-3)]
        for _ in range(3):
            eng.step(hp)
        _wait(lambda: _snapshot(sock)["cut"]["iteration"] == 2, 10, "telemetry")
        eng._hooks.remove(client)  # the next step's telemetry is never queued: the signal came first
        eng.step(hp)
        client.close()
        run = _wait(lambda: _snapshot(sock)["cut"]["status"] == "finished" and _snapshot(sock)["cut"], 10, "bye")
        assert run["iteration"] == 3 and eng.iteration == 4  # four steps: iterations 0 to 3
    finally:
        eng.close()
        daemon.terminate()
        daemon.wait(10)


def test_client_never_blocks_and_connects_when_a_daemon_appears(tmp_path):
    """No daemon: report() is instant and keeps only the newest records; apply_pending is a
    no-op. When a daemon starts at the socket, the client registers on its own and delivers."""
    sock = str(tmp_path / "tuner.sock")
    w, g = torch.zeros(100), torch.ones(100)
    eng = SubgroupEngine([FlatSubgroup(w, g)], EngineConfig(subgroup_numel=100, host_adam="torch"))
    client = TunerClient.for_engine(sock, eng, run_id="late", queue_size=8, backoff_s=(0.05, 0.2), hook=False)
    rec = lambda i: StepRecord(iteration=i, update_s=0.01, read_wait_s=0, kernel_s=0.01, write_wait_s=0)
    with pytest.raises(ConfigError, match="run_id"):  # refused here, not silently at every registration
        TunerClient.for_engine(sock, eng, run_id="my\nrun", hook=False)
    with pytest.raises(ConfigError, match="rank 2 must be below world_size 2"):
        TunerClient.for_engine(sock, eng, run_id="r", rank=2, world_size=2, hook=False)
    t0 = time.perf_counter()
    for i in range(1000):
        client.report(rec(i), iter_time_s=0.02)
    # A report that waited on a connection (its backoff is 50-200 ms) would make 1000 of them take
    # a minute; unblocked they take milliseconds, and seconds only on a machine busy with other work.
    assert time.perf_counter() - t0 < 5.0
    assert client.dropped == 1000 - 8 and client.apply_pending(eng) is None and not client.connected.is_set()
    daemon = _serve(sock)
    try:
        assert client.connected.wait(20)
        run = _wait(
            lambda: _snapshot(sock).get("late", {}).get("iteration") == 999 and _snapshot(sock)["late"], 10, "queued telemetry"
        )
        assert run["ranks"] == 1 and run["connected"] == 1
        client.close()
        assert _wait(lambda: _snapshot(sock)["late"]["status"] == "finished", 10, "bye")
    finally:
        client.close()
        eng.close()
        daemon.terminate()
        daemon.wait(10)


def test_late_change_applies_at_next_boundary_and_is_logged(tmp_path, policy_dir):
    """A change that reaches a rank after its iteration is applied at the rank's next step
    boundary, never skipped, and the daemon records that it came late."""
    sock = str(tmp_path / "tuner.sock")
    daemon = _serve(sock, "--policy", "scripted:Static", policy_dir=policy_dir)
    w, g = torch.zeros(300), torch.ones(300)
    eng = SubgroupEngine(
        [FlatSubgroup(w[o : o + 100], g[o : o + 100]) for o in range(0, 300, 100)],
        EngineConfig(subgroup_numel=100, host_adam="torch"),
    )
    client = TunerClient.for_engine(sock, eng, run_id="slow", hook=False)
    try:
        assert client.connected.wait(20)
        for _ in range(5):
            client.report(eng.step([AdamWHyper(lr=1e-3)]))
        _wait(lambda: _snapshot(sock)["slow"]["iteration"] == 4, 10, "telemetry")
        with Connection(sock) as c:
            reply = c.request("pin", run_id="slow", knob="prefetch_depth", value=7)
        assert reply["knobs"]["prefetch_depth"] == 7
        (change,) = _wait(lambda: client.pending_changes(), 10, "the pushed change")
        assert change["apply_at"] >= 6 and change["knobs"].prefetch_depth == 7
        while eng.iteration <= change["apply_at"] + 2:  # this rank misses the boundary
            eng.step([AdamWHyper(lr=1e-3)])
        late_at = eng.iteration
        assert client.apply_pending(eng).prefetch_depth == 7 and client.pending_changes() == []
        rec = eng.step([AdamWHyper(lr=1e-3)])
        assert rec.iteration == late_at and rec.knobs.prefetch_depth == 7
        client.report(rec)
        run = _wait(
            lambda: [r for r in [_snapshot(sock)["slow"]] if any(e["kind"] == "late" for e in r["events"])], 10, "the late notice"
        )[0]
        late = next(e for e in run["events"] if e["kind"] == "late")
        assert f"at iteration {late_at}, not {change['apply_at']}" in late["message"]
        assert run["pins"] == {"prefetch_depth": 7} and run["decisions"][-1]["source"] == "user"
    finally:
        client.close()
        eng.close()
        daemon.terminate()
        daemon.wait(10)


def test_tune_cli_snapshot_pin_freeze_and_live_view(tmp_path):
    """`offloadctl tune` against a daemon running the real policy: pin one path's concurrency,
    freeze, read the snapshot as JSON, refuse bad values in one line, render the live view."""
    sock = str(tmp_path / "tuner.sock")
    daemon = _serve(sock)
    nvme = str(tmp_path)
    client = TunerClient(sock, RunFacts(params=1000, paths=(nvme,), subgroup_bytes=12000), Knobs(), run_id="cli-run", rank=0)
    cli = lambda *a: subprocess.run(
        [sys.executable, "-m", "offloadctl.cli", *a, "--socket", sock], cwd=ROOT, capture_output=True, text=True, timeout=60
    )
    try:
        assert client.connected.wait(20)
        for i in range(4):
            client.report(
                StepRecord(
                    iteration=i,
                    update_s=0.5,
                    read_wait_s=0.1,
                    kernel_s=0.3,
                    write_wait_s=0.1,
                    path_bytes_read={nvme: 50_000_000},
                    path_bytes_written={nvme: 25_000_000},
                ),
                iter_time_s=1.0,
            )
        _wait(lambda: _snapshot(sock)["cli-run"]["iteration"] == 3, 10, "telemetry")
        out = cli("tune", "--pin", f"cli-run:io_concurrency[{nvme}]=8", "--freeze", "cli-run")
        assert out.returncode == 0, out.stderr
        assert "cli-run: pinned" in out.stdout and "cli-run: frozen" in out.stdout
        out = cli("tune", "--once", "--json")
        assert out.returncode == 0, out.stderr
        (run,) = json.loads(out.stdout)["runs"]
        assert {"run_id", "ranks", "iteration", "iter_time_s", "knobs"} <= set(run)
        assert (run["run_id"], run["ranks"], run["iteration"], run["iter_time_s"]) == ("cli-run", 1, 3, 1.0)
        assert run["knobs"]["io_concurrency"] == {nvme: 8} and run["frozen"]
        _wait(lambda: any(c["knobs"].io_concurrency == {nvme: 8} for c in client.pending_changes()), 10, "the pin's push")
        bad = [
            subprocess.Popen(
                [sys.executable, "-m", "offloadctl.cli", "tune", "--pin", spec, "--socket", sock],
                cwd=ROOT,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                text=True,
            )
            for spec in ("cli-run:prefetch_depth=100", "nosuch:prefetch_depth=1")
        ]
        (_, err1), (_, err2) = (p.communicate(timeout=60) for p in bad)
        assert bad[0].returncode == 2 and err1.count("\n") == 1 and "prefetch_depth" in err1, err1
        assert bad[1].returncode == 2 and "no run 'nosuch'" in err2 and "Traceback" not in err2, err2

        from rich.console import Console

        from offloadctl.commands.tune_view import run_panel

        with Connection(sock) as c:
            (snap,) = c.request("snapshot", history=60)["runs"]
        console = Console(record=True, width=140, file=open(os.devnull, "w"))
        console.print(run_panel(snap))
        text = console.export_text()
        for expected in (
            "cli-run (running)",
            "iteration 4",
            "prefetch_depth=",
            f"io_concurrency={nvme}:8",
            "100 MB/s",
            "50 MB/s",
            "frozen",
            "tuning frozen by the user",
            "500 ms",
        ):
            assert expected in text, (expected, text)
    finally:
        client.close()
        daemon.terminate()
        daemon.wait(10)


def test_pin_specs():
    from offloadctl.commands.tune import parse_pin, parse_unpin

    # run ids and paths may hold ':' and '=': the knob name anchors the split
    assert parse_pin("runs=2:a:io_concurrency[/x=y:z]=8") == ("runs=2:a", "io_concurrency[/x=y:z]", 8)
    assert parse_pin('my run:stripe_weights={"/a": 1}') == ("my run", "stripe_weights", {"/a": 1})
    assert parse_pin("r:node_lock=true") == ("r", "node_lock", True)
    assert parse_unpin("a:b:prefetch_depth") == ("a:b", "prefetch_depth")
    for bad in ("r:warp=1", "prefetch_depth=1", "r:prefetch_depth"):
        with pytest.raises(ConfigError, match="RUN:KNOB=VALUE"):
            parse_pin(bad)


def test_service_start_status_stop(tmp_path):
    sock = str(tmp_path / "svc" / "tuner.sock")
    info = service.start(sock, db_path="none")
    try:
        assert not info["already_running"]
        with open(service.pidfile_for(sock)) as f:
            assert int(f.read()) == info["pid"]
        assert os.path.exists(service.logfile_for(sock))
        assert stat.S_IMODE(os.stat(os.path.dirname(sock)).st_mode) == 0o700
        assert service.start(sock, db_path="none")["already_running"]
        out = subprocess.run(
            [sys.executable, "-m", "offloadctl.cli", "tuner", "status", "--json", "--socket", sock],
            cwd=ROOT,
            capture_output=True,
            text=True,
            timeout=60,
        )
        st = json.loads(out.stdout)
        assert out.returncode == 0 and st["running"] and st["pid"] == info["pid"] and st["runs"] == []
    finally:
        stopped = service.stop(sock)
    assert stopped["was_running"] and stopped["pid"] == info["pid"]
    assert not os.path.exists(sock) and not os.path.exists(service.pidfile_for(sock))
    assert not os.path.exists(f"/proc/{info['pid']}") or open(f"/proc/{info['pid']}/stat").read().split()[2] == "Z"
    assert service.status(sock)["running"] is False
    assert service.stop(sock)["was_running"] is False


def test_ensure_daemon_uses_a_running_one_or_starts_a_private_one(tmp_path):
    run_dir = tmp_path / "run"
    nothing = str(tmp_path / "none.sock")
    own, stop = service.ensure_daemon(nothing, run_dir=str(run_dir))
    try:
        assert own == str(run_dir / "tuner" / "tuner.sock") and stop is not None
        assert service.probe(own) is not None
        again, stop2 = service.ensure_daemon(own)
        assert again == own and stop2 is None  # a running daemon is used, not replaced
    finally:
        stop()
    assert service.probe(own) is None and not os.path.exists(own)


def test_default_paths(monkeypatch, tmp_path):
    monkeypatch.setenv("XDG_STATE_HOME", str(tmp_path / "state"))
    assert service.default_db_path() == str(tmp_path / "state" / "offloadctl" / "tuner.db")
    if os.geteuid() == 0:
        assert service.default_socket_path() == "/run/offloadctl/tuner.sock"
    else:
        monkeypatch.setenv("XDG_RUNTIME_DIR", str(tmp_path))
        assert service.default_socket_path() == str(tmp_path / "offloadctl" / "tuner.sock")


def test_bind_replaces_stale_socket_and_refuses_live_one(tmp_path):
    path = str(tmp_path / "t.sock")
    stale = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    stale.bind(path)
    stale.close()  # a socket file nothing listens on: what a killed daemon leaves
    live = bind_socket(path)
    try:
        assert stat.S_IMODE(os.stat(path).st_mode) == 0o600
        with pytest.raises(ConfigError, match="already listens on .*t.sock"):
            bind_socket(path)
    finally:
        live.close()
    other = str(tmp_path / "file")
    open(other, "w").close()
    with pytest.raises(ConfigError, match="is not a socket"):
        bind_socket(other)
    with pytest.raises(ConfigError, match="107"):
        bind_socket(str(tmp_path / ("x" * 120)))


@functools.partial(needs_root, reason="needs root to make a directory another user owns")
def test_socket_directory_of_another_user_is_refused(tmp_path):
    theirs = tmp_path / "theirs"
    theirs.mkdir()
    os.chown(theirs, 65534, 65534)
    with pytest.raises(ConfigError, match="belongs to uid 65534"):
        bind_socket(str(theirs / "tuner.sock"))
    with pytest.raises(ConfigError, match="belongs to uid 65534"):  # nor a directory of ours inside theirs
        bind_socket(str(theirs / "sub" / "tuner.sock"))


def test_socket_activation(tmp_path):
    """Started as systemd starts it (LISTEN_PID, LISTEN_FDS, the socket on fd 3), the daemon
    serves on the socket it was given and leaves that socket in place when it stops."""
    path = str(tmp_path / "activated.sock")
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(path)
    listener.listen()
    fd = listener.fileno()
    # What systemd does between fork and exec: the socket on fd 3, LISTEN_PID = the pid that execs.
    trampoline = (
        "import os, sys; os.dup2(int(sys.argv[1]), 3); os.environ.update(LISTEN_PID=str(os.getpid()), "
        "LISTEN_FDS='1'); os.execv(sys.executable, [sys.executable, *sys.argv[2:]])"
    )
    proc = subprocess.Popen(
        [
            sys.executable,
            "-c",
            trampoline,
            str(fd),
            "-m",
            "offloadctl.cli",
            "tuner",
            "serve",
            "--db",
            "none",
            "--no-sensors",
            "--socket",
            str(tmp_path / "ignored.sock"),
        ],
        pass_fds=[fd],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
    )
    listener.close()
    try:
        welcome = _wait(lambda: service.probe(path, timeout_s=1.0) or proc.poll() is not None, 60, "the activated daemon")
        assert proc.poll() is None, proc.stdout.read().decode()
        assert welcome["pid"] == proc.pid
        with Connection(path) as c:
            assert c.request("snapshot")["daemon"]["socket_activated"] is True
            c.request("shutdown")
        assert proc.wait(10) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
    assert os.path.exists(path) and not os.path.exists(tmp_path / "ignored.sock")


def test_systemd_units():
    units = os.path.join(ROOT, "systemd")
    parse = lambda name: _unit(os.path.join(units, name))
    svc, sock = parse("offloadctl-tuner.service"), parse("offloadctl-tuner.socket")
    exec_start = svc["Service"]["ExecStart"][0].split()
    assert exec_start[1:3] == ["tuner", "serve"]
    assert exec_start[exec_start.index("--socket") + 1] == sock["Socket"]["ListenStream"][0] == "%t/offloadctl/tuner.sock"
    assert sock["Socket"]["SocketMode"] == ["0600"] and sock["Socket"]["Service"] == ["offloadctl-tuner.service"]
    s = {k: v[-1] for k, v in svc["Service"].items()}
    assert s["RuntimeDirectory"] == "offloadctl" and s["RuntimeDirectoryMode"] == "0700"
    assert s["User"] not in ("", "root") and s["RuntimeDirectoryPreserve"] == "yes"
    for key, value in (
        ("NoNewPrivileges", "yes"),
        ("ProtectSystem", "strict"),
        ("PrivateTmp", "yes"),
        ("RestrictAddressFamilies", "AF_UNIX"),
        ("CapabilityBoundingSet", ""),
    ):
        assert s[key] == value, key
    assert "PrivateUsers" not in s  # it would map every peer to nobody and break the uid check
    if shutil.which("systemd-analyze"):
        out = subprocess.run(
            ["systemd-analyze", "verify", "offloadctl-tuner.service", "offloadctl-tuner.socket"],
            cwd=units,
            capture_output=True,
            text=True,
            timeout=60,
        )
        problems = [
            x for x in (out.stdout + out.stderr).splitlines() if x.strip() and "is not executable" not in x and "offloadctl" in x
        ]
        assert not problems, problems


def _unit(path: str) -> dict[str, dict[str, list[str]]]:
    """A unit file as section -> key -> values (keys may repeat)."""
    out: dict[str, dict[str, list[str]]] = {}
    section = None
    with open(path) as f:
        for line in f:
            line = line.strip()
            if not line or line[0] in "#;":
                continue
            if line.startswith("["):
                section = out.setdefault(line.strip("[]"), {})
            else:
                k, _, v = line.partition("=")
                section.setdefault(k.strip(), []).append(v.strip())
    return out


def test_gpu_headroom_is_refreshed_every_step(tmp_path, policy_dir):
    """The headroom the policy's guard rails use is the one each step measured, not the one at
    registration (forward/backward's peak changes after the first iterations). The engine puts
    it in each StepRecord; the client passes it on."""
    sock = str(tmp_path / "tuner.sock")
    daemon = _serve(sock, "--policy", "scripted:HeadroomEcho", policy_dir=policy_dir)
    w, g = torch.zeros(300), torch.ones(300)
    eng = SubgroupEngine(
        [FlatSubgroup(w[o : o + 100], g[o : o + 100]) for o in range(0, 300, 100)],
        EngineConfig(subgroup_numel=100, host_adam="torch"),
    )
    client = None
    try:
        facts = dataclasses.replace(RunFacts.of_engine(eng.describe()), device_headroom_bytes=1000)  # at registration
        client = TunerClient(sock, facts, eng.knobs, run_id="room", rank=0)
        assert client.connected.wait(20)
        for _ in range(4):
            rec = eng.step([AdamWHyper(lr=1e-3)])
            rec.device_headroom_bytes = 7000  # as the engine measures it after each step on a CUDA device
            client.report(rec, iter_time_s=0.01)
        _wait(lambda: _snapshot(sock)["room"]["knobs"]["prefetch_depth"] == 5, 10, "the policy's reaction")
    finally:
        if client is not None:
            client.close()
        eng.close()
        daemon.terminate()
        daemon.wait(10)


def test_offload_adamw_is_tuned_through_its_step_hook(tmp_path, policy_dir):
    """OffloadAdamW, without DeepSpeed, takes the daemon's changes at a step boundary through
    the same hook as the ZeRO-3 integration; closing the optimizer says bye to the daemon."""
    from engine import OffloadAdamW

    sock = str(tmp_path / "tuner.sock")
    swap = tmp_path / "swap"
    swap.mkdir()
    model = torch.nn.Linear(64, 64)
    opt = OffloadAdamW(
        model.parameters(), lr=1e-3, subgroup_numel=1024, host_adam="torch", io_backend="posix", nvme_paths=[str(swap)]
    )
    daemon = _serve(sock, "--policy", "scripted:Static", policy_dir=policy_dir)
    try:
        TunerClient.for_engine(sock, opt.engine, run_id="plain")

        def train_step():
            model(torch.randn(8, 64, device="cpu")).square().mean().backward()  # the model is on the CPU here
            opt.step()
            opt.zero_grad()

        for _ in range(3):
            train_step()
        _wait(lambda: _snapshot(sock).get("plain", {}).get("iteration") == 2, 20, "telemetry through the hook")
        with Connection(sock) as c:
            c.request("pin", run_id="plain", knob="prefetch_depth", value=6)
        deadline = time.monotonic() + 60  # steps until the pin arrives: seconds on a loaded 2-core machine
        while time.monotonic() < deadline:
            train_step()
            if opt.engine.knobs.prefetch_depth == 6:
                break
            time.sleep(0.02)
        assert opt.engine.knobs.prefetch_depth == 6 and opt.telemetry[-1].knobs.prefetch_depth == 6
        opt.close()
        assert _wait(lambda: _snapshot(sock)["plain"]["status"] == "finished", 10, "bye at close")
    finally:
        opt.close()
        daemon.terminate()
        daemon.wait(10)


def test_the_tuner_is_told_each_iterations_time_without_a_skipped_step_or_a_pause(tmp_path, policy_dir):
    """The iteration time the client sends (the daemon's history, what the policy judges by) is
    the iteration's own: an fp16-skipped iteration before it (OffloadAdamW.skipped_step, as the
    ZeRO-3 adapter calls on an overflow) and a pause (pause_clock/resume_clock, as around
    offload_states/reload_states) are left out, and the step's record says how long they were
    (excluded_s). Sleeps stand in for forward/backward (fwd_s) and the time left out (away_s)."""
    from engine import OffloadAdamW

    fwd_s, away_s = 0.05, 0.8
    sock = str(tmp_path / "tuner.sock")
    model = torch.nn.Linear(64, 64)
    opt = OffloadAdamW(model.parameters(), lr=1e-3, subgroup_numel=1024, host_adam="torch")
    daemon = _serve(sock, "--policy", "scripted:Static", policy_dir=policy_dir)
    try:
        TunerClient.for_engine(sock, opt.engine, run_id="clock")

        def iteration(skipped: bool = False):
            model(torch.randn(8, 64)).square().mean().backward()
            time.sleep(away_s if skipped else fwd_s)
            if skipped:
                opt.skipped_step()  # a GradScaler found inf gradients: no step
            else:
                opt.step()
            opt.zero_grad()

        for _ in range(2):
            iteration()
        iteration(skipped=True)
        iteration()  # record 2: after the skipped iteration
        opt.pause_clock()
        time.sleep(away_s)  # generation
        opt.resume_clock()
        iteration()  # record 3: after the pause
        iteration()
        _wait(lambda: _snapshot_history(sock, "clock").get(4) is not None, 20, "the iterations' times")
        told = _snapshot_history(sock, "clock")
        recs = opt.telemetry
        for i in (2, 3):
            assert recs[i].excluded_s >= away_s, recs[i]
            assert fwd_s <= recs[i].fwd_bwd_s < fwd_s + away_s / 2, recs[i]
            assert fwd_s <= told[i] < fwd_s + away_s / 2, (i, told)
        assert recs[1].excluded_s == recs[4].excluded_s == 0.0
        assert told[4] < fwd_s + away_s / 2
    finally:
        opt.close()
        daemon.terminate()
        daemon.wait(10)


def _snapshot_history(sock: str, run_id: str) -> dict[int, float | None]:
    """The iteration time the daemon was told for each iteration of ``run_id`` it observed."""
    with Connection(sock) as c:
        runs = {r["run_id"]: r for r in c.request("snapshot", history=60)["runs"]}
    hist = runs.get(run_id, {}).get("history") or {"iteration": [], "iter_time_s": []}
    return dict(zip(hist["iteration"], hist["iter_time_s"]))


def test_a_zombie_is_not_alive():
    """The daemon's owner check and the run registry share one answer: an exited process that
    its parent has not reaped yet is gone."""
    assert service.pid_alive(os.getpid()) and not service.pid_alive(0) and not service.pid_alive(-1)
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    try:
        _wait(lambda: open(f"/proc/{child.pid}/stat").read().rsplit(")", 1)[1].split()[0] == "Z", 30, "the child to exit")
        assert not service.pid_alive(child.pid)
    finally:
        child.wait()
    assert not service.pid_alive(child.pid)


def test_a_daemon_that_was_up_and_is_gone_is_told_from_one_still_starting(tmp_path):
    """`tune --run-dir` waits for a starting run's daemon, but not for one that was killed: its
    pidfile names a process that is gone (or a pid now used by another program)."""
    sock = str(tmp_path / "tuner.sock")
    assert not service.daemon_stopped(sock)  # no pidfile yet: starting
    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()
    (tmp_path / "tuner.sock.pid").write_text(f"{gone.pid}\n")
    assert service.daemon_stopped(sock)
    (tmp_path / "tuner.sock.pid").write_text(f"{os.getpid()}\n")  # alive, but not a tuner daemon
    assert service.daemon_stopped(sock)
    daemon = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "offloadctl.cli",
            "tuner",
            "serve",
            "--socket",
            sock,
            "--db",
            "none",
            "--no-sensors",
            "--pidfile",
            service.pidfile_for(sock),
        ],
        cwd=ROOT,
        env=env_with_root(),
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        deadline = time.monotonic() + 60
        while service.read_pid(service.pidfile_for(sock)) != daemon.pid:
            assert time.monotonic() < deadline, "the daemon did not write its pidfile"
            time.sleep(0.1)
        assert not service.daemon_stopped(sock)
    finally:
        daemon.terminate()
        daemon.wait(10)
