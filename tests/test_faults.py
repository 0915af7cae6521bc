"""Faults found by probing offloadctl as a hostile or unlucky user would, one test each.

Real processes, real sockets, real signals, real (small) file systems. Each test failed on the
code before its fix. Elsewhere: a daemon killed and restarted mid-run
(test_tuner_daemon.test_ranks_switch_together_across_runs_and_a_daemon_restart), a corrupt
or truncated swap file and a disk filling mid-run (test_bad_input).
"""

from __future__ import annotations

import errno
import glob
import json
import os
import resource
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time

import pytest
from ds_runs import LAYOUTS, SAVE, ours
from helpers import ROOT, cli, env_with_root, free_port, mounted, needs_root
from helpers import wait_for as _wait

from tuner import service
from tuner.protocol import API_VERSION, Connection, ErrorCode, ProtocolError, encode, recv_message

# Real `offloadctl train` runs, processes and signals: minutes; `pytest -m "not slow"` skips them.
pytestmark = pytest.mark.slow

TINY = os.path.join(ROOT, "tests", "ds_scripts", "train_tiny.py")
NOBODY = 65534


def _serve(sock: str, *extra: str, preexec=None) -> subprocess.Popen:
    os.makedirs(os.path.dirname(sock), mode=0o700, exist_ok=True)
    logf = open(sock + ".log", "ab")
    proc = subprocess.Popen(
        [sys.executable, "-m", "offloadctl.cli", "tuner", "serve", "--socket", sock, *extra],
        cwd=ROOT,
        env=env_with_root(),
        stdout=logf,
        stderr=logf,
        preexec_fn=preexec,
    )
    logf.close()
    _wait(lambda: service.probe(sock, timeout_s=0.5) is not None or proc.poll() is not None, 60, "daemon start")
    assert proc.poll() is None, open(sock + ".log").read()
    return proc


def _register(c: Connection, run_id: str, paths=("/x",), **extra) -> None:
    c.request(
        "register",
        run_id=run_id,
        rank=0,
        world_size=1,
        params=1000,
        paths=list(paths),
        has_device=False,
        knobs={"prefetch_depth": 2},
        subgroup_bytes=12288,
        **extra,
    )


# -- 1. a fake daemon of another user ------------------------------------------------------------------

FAKE_DAEMON = r"""
import json, os, socket, struct, sys

path, owner = sys.argv[1], int(sys.argv[3])
os.makedirs(os.path.dirname(path), mode=0o755, exist_ok=True)
s = socket.socket(socket.AF_UNIX); s.bind(path); os.chmod(path, 0o777); s.listen(8)
for p in (path, os.path.dirname(path), os.path.dirname(os.path.dirname(path))):
    os.chown(p, owner, owner)  # everything another user would have made
open(sys.argv[2], "w").close()
while True:
    c, _ = s.accept()
    hdr = c.recv(4)
    body = c.recv(struct.unpack(">I", hdr)[0])
    rid = json.loads(body)["id"]
    msg = json.dumps({"v": API_V, "type": "welcome", "id": rid, "api": API_V, "version": "evil", "server_id": "x",
                      "pid": os.getpid(), "started_at": 0}).encode()
    c.sendall(struct.pack(">I", len(msg)) + msg)
    c.close()
""".replace("API_V", str(API_VERSION))


@needs_root
def test_client_refuses_a_daemon_another_user_planted():
    """Another user (uid 65534) creates the socket directory under /tmp that a run would use, and
    a daemon answers there: `tuner status` must not call it running, `tuner start` must refuse the
    directory, and an engine client must not register with it. (The fake daemon's process runs
    as root here, since this machine's Python lives under /root where no other uid may run it:
    the socket and directories are the other user's, which is what the client checks first.)"""
    base = tempfile.mkdtemp(prefix="offloadctl-trap-")
    os.chmod(base, 0o1777)
    sock = os.path.join(base, "offloadctl-0", "offloadctl", "tuner.sock")
    ready = os.path.join(base, "ready")
    fake = subprocess.Popen([sys.executable, "-c", FAKE_DAEMON, sock, ready, str(NOBODY)])
    try:
        _wait(lambda: os.path.exists(ready), 30, "the fake daemon")
        st = cli("tuner", "status", "--json", "--socket", sock)
        out = json.loads(st.stdout)
        assert out["running"] is False and "not trusted" in out["reason"], out
        start = cli("tuner", "start", "--socket", sock)
        assert start.returncode == 2 and "Traceback" not in start.stderr and "belongs to uid" in start.stderr, start.stderr
        from engine.config import Knobs
        from tuner.client import TunerClient
        from tuner.run_state import RunFacts

        client = TunerClient(sock, RunFacts(params=1), Knobs(), run_id="r", rank=0)
        try:
            assert not client.connected.wait(3)
            assert "not trusted" in (client.last_error or "")
        finally:
            client.close()
    finally:
        fake.kill()
        fake.wait()
        shutil.rmtree(base, ignore_errors=True)


# -- 2. at the open-file limit the daemon answers BUSY, quietly -----------------------------------------


def test_daemon_at_its_open_file_limit_answers_busy_without_flooding_its_log(tmp_path):
    sock = str(tmp_path / "d" / "tuner.sock")

    def low_limit():
        resource.setrlimit(resource.RLIMIT_NOFILE, (128, 128))

    daemon = _serve(sock, "--db", "none", "--no-sensors", preexec=low_limit)
    held, busy = [], 0
    try:
        for _ in range(200):
            s = socket.socket(socket.AF_UNIX)
            s.connect(sock)
            # A daemon that is full says BUSY at once, then closes; one with room answers the hello.
            # (Waiting for a BUSY before the hello cost half a second per connection held.)
            s.settimeout(0.02)
            try:
                reply = recv_message(s)
            except (socket.timeout, TimeoutError):
                s.settimeout(5)
                try:
                    s.sendall(encode({"v": API_VERSION, "type": "hello", "id": 1, "api": API_VERSION, "role": "cli"}))
                except (BrokenPipeError, ConnectionResetError):  # BUSY came meanwhile, and the close: read it
                    pass
                reply = recv_message(s)
            if reply["type"] == "error":
                assert reply["code"] == ErrorCode.BUSY
                busy += 1
                s.close()
            else:
                held.append(s)
        assert busy > 0 and len(held) <= 128
        time.sleep(3)  # the old daemon logged a traceback per accept() retry here
        assert os.path.getsize(sock + ".log") < 50_000
        for s in held:
            s.close()
        _wait(lambda: service.probe(sock, timeout_s=1.0) is not None, 10, "the daemon answering again")
    finally:
        daemon.terminate()
        daemon.wait(10)


# -- 3 and 4. one run's figures or size never break the others' snapshot --------------------------------


def test_extreme_telemetry_and_a_huge_run_do_not_break_snapshots(tmp_path):
    sock = str(tmp_path / "d" / "tuner.sock")
    daemon = _serve(sock, "--db", "none", "--no-sensors")
    try:
        with Connection(sock, role="engine") as c:
            _register(c, "tiny-wall")
            rec = {
                "iteration": 1,
                "update_s": 5e-324,
                "read_wait_s": 0.0,
                "kernel_s": 0.0,
                "write_wait_s": 0.0,
                "path_bytes_read": {"/x": 1 << 60},
                "path_bytes_written": {"/x": 1 << 60},
            }
            c.sock.sendall(
                encode(
                    {
                        "v": API_VERSION,
                        "type": "telemetry",
                        "id": 5,
                        "run_id": "tiny-wall",
                        "rank": 0,
                        "iteration": 1,
                        "record": rec,
                    }
                )
            )
            with pytest.raises(ProtocolError, match="1e\\+15|integer"):  # unbounded numbers are refused
                c.request(
                    "telemetry",
                    run_id="tiny-wall",
                    rank=0,
                    iteration=2,
                    record={**rec, "iteration": 2, "path_bytes_read": {"/x": 10**300}},
                )
        with Connection(sock, role="engine") as c:
            long_paths = [f"/{i:02d}" + "p" * 3990 for i in range(64)]
            _register(c, "huge", paths=long_paths)
            for k in range(40):
                _register(c, f"run-{k:03d}", paths=long_paths[:8])
            snap = cli("tune", "--once", "--json", "--socket", sock)
            assert snap.returncode == 0, snap.stderr[-2000:]
            st = cli("tuner", "status", "--json", "--socket", sock)
            assert json.loads(st.stdout)["running"] is True
            with Connection(sock) as client:
                full = client.request("snapshot", history=0)
                ids = {r["run_id"] for r in full["runs"]} | set(full.get("omitted", []))
                assert {"tiny-wall", "huge"} <= ids and len(ids) == 42
                one = client.request("snapshot", run_id="huge", history=0)
                assert one["runs"][0]["run_id"] == "huge" and len(one["runs"][0]["paths"]) == 64
    finally:
        daemon.terminate()
        daemon.wait(10)


# -- 5 and 6. a run stopped by a signal, or killed, leaves nothing behind -------------------------------


def _train(tmp_path, *opts, steps=400, port=None):
    nvme = tmp_path / "nvme"
    nvme.mkdir(exist_ok=True)
    cmd = [
        sys.executable,
        "-m",
        "offloadctl.cli",
        "train",
        "--num_gpus",
        "1",
        "--master_port",
        port or free_port(),
        "--nvme",
        str(nvme),
        "--host-cache-gb",
        "0",
        "--run-dir",
        str(tmp_path / "run"),
        *opts,
        TINY,
        "--steps",
        str(steps),
        "--losses-out",
        str(tmp_path / "losses.jsonl"),
    ]
    err = open(tmp_path / "stderr", "w")
    # A session of its own, as a shell gives a job: the test can signal it as a terminal would.
    proc = subprocess.Popen(cmd, cwd=ROOT, env=env_with_root(), stdout=subprocess.DEVNULL, stderr=err, start_new_session=True)
    swaps = lambda: glob.glob(str(nvme / "offloadctl-swap-*" / "*" / "*.swp"))  # noqa: E731
    _wait(lambda: os.path.exists(tmp_path / "losses.jsonl") or proc.poll() is not None, 180, "training to start")
    assert proc.poll() is None, open(tmp_path / "stderr").read()[-3000:]
    assert swaps()
    return proc, swaps


@pytest.mark.slow
@pytest.mark.parametrize(
    "sig,to_group", [(signal.SIGINT, True), (signal.SIGTERM, False), (signal.SIGHUP, False)], ids=["ctrl-c", "sigterm", "sighup"]
)
def test_signals_end_the_run_cleanly(sig, to_group, tmp_path):
    """Ctrl-C (SIGINT to the foreground process group), or SIGTERM/SIGHUP to offloadctl: the ranks
    unwind and remove their swap files; exit 128+signal; one line, no traceback."""
    proc, swaps = _train(tmp_path, "--tuner", "off")
    (os.killpg if to_group else os.kill)(proc.pid, sig)
    rc = proc.wait(120)
    err = open(tmp_path / "stderr").read()
    assert rc == 128 + sig, err[-3000:]
    assert swaps() == []
    assert "Traceback" not in err
    assert f"offloadctl: stopped by {signal.Signals(sig).name}" in err
    # One line for the run: DeepSpeed's launcher lines and each rank's own go to the run's log.
    assert err.count("stopped by") == 1 and "Killing subprocess" not in err and "received SIG" not in err, err
    assert "Killing subprocess" in open(tmp_path / "run" / "deepspeed.log").read()


@pytest.mark.slow
def test_a_killed_run_leaks_no_tuner_daemon(tmp_path):
    """SIGKILL of the whole run (offloadctl, launcher, ranks): its private tuner daemon, in a
    session of its own, goes too (parent-death signal; it also watches its owner's pid)."""
    proc, _ = _train(tmp_path, "--tuner", "auto")
    pidfile = glob.glob(str(tmp_path / "run" / "tuner" / "*.pid"))
    daemon_pid = int(open(pidfile[0]).read())
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()

    def gone() -> bool:
        try:
            return open(f"/proc/{daemon_pid}/stat").read().split()[2] == "Z"
        except FileNotFoundError:
            return True

    _wait(gone, 10, "the private tuner daemon to exit")


def test_stale_shared_memory_of_killed_runs_is_removed(tmp_path):
    """What DeepSpeed's CPU comm op leaves in /dev/shm when a run is killed goes at the next
    `offloadctl train`; a buffer a live process maps or holds open, or one made in the last
    seconds, stays (another run may be creating it: removing it would hang that run)."""
    import mmap

    from integrations.launcher import SHM_STALE_AFTER_S, remove_stale_shm_buffers

    port = free_port()
    stale = f"/dev/shm/deepspeed_allreduce_buffer_{os.getuid()}_127.0.0.1_{port}_0"
    live = f"/dev/shm/deepspeed_allreduce_buffer_{os.getuid()}_127.0.0.1_{port}_1"
    young = f"/dev/shm/deepspeed_allreduce_buffer_{os.getuid()}_127.0.0.1_{port}_2"
    opened = f"/dev/shm/deepspeed_allreduce_buffer_{os.getuid()}_127.0.0.1_{port}_3"
    old = time.time() - 2 * SHM_STALE_AFTER_S
    for f in (stale, live, young, opened):
        with open(f, "wb") as fh:
            fh.truncate(1 << 16)
        if f != young:
            os.utime(f, (old, old))
    fh = open(live, "r+b")
    being_created = open(opened, "r+b")  # a starting rank's buffer: open, not yet mapped
    mapping = mmap.mmap(fh.fileno(), 1 << 16)
    try:
        assert remove_stale_shm_buffers() >= 1
        assert not os.path.exists(stale) and os.path.exists(live)
        assert os.path.exists(young) and os.path.exists(opened)  # another run may be creating these
    finally:
        mapping.close()
        fh.close()
        being_created.close()
        for f in (live, young, opened):
            os.unlink(f)


# -- 7. bad input: one line, no traceback ---------------------------------------------------------------


@pytest.mark.parametrize(
    "args,expect",
    [
        (["train", "--host-cache-gb", "nan", TINY], "--host-cache-gb"),
        (["train", "--host-cache-gb", "inf", TINY], "--host-cache-gb"),
        (["train", "--host-cache-gb", "1e400", TINY], "--host-cache-gb"),
        (["train", "--device-cache-gb", "-1", TINY], "--device-cache-gb"),
        (["train", "--device-fraction", "2", TINY], "--device-fraction"),
        (["train", "--run-dir", TINY, TINY], "is a file"),
        (["train", "--tuner", TINY, TINY], "is not a socket"),
        (["train", os.path.join(ROOT, "tests")], "is a directory"),
        (["plan", "--profile", os.path.join(ROOT, "profiles", "example-cpu-vm.toml"), "--params", "1e308"], "1e15"),
    ],
    ids=[
        "cache-nan",
        "cache-inf",
        "cache-1e400",
        "device-cache-neg",
        "fraction-2",
        "run-dir-file",
        "tuner-file",
        "script-dir",
        "params-1e308",
    ],
)
def test_bad_input_is_one_line(args, expect):
    r = cli(*args)
    assert r.returncode == 2 and "Traceback" not in r.stderr and expect in r.stderr, r.stderr[-2000:]
    assert len(r.stderr.strip().splitlines()) == 1


@pytest.mark.parametrize(
    "text,expect",
    [
        ("a = " + "[" * 100_000 + "]" * 100_000, "nests"),
        ("x = [" + ",".join("{a=1}" for _ in range(5000)) + "]", "schema_version"),
    ],
    ids=["nested-100k", "5000-inline-tables"],
)
def test_hostile_profiles_are_one_line(text, expect, tmp_path):
    f = tmp_path / "p.toml"
    f.write_text(text)
    r = cli("profile", "show", str(f))
    assert r.returncode == 2 and "Traceback" not in r.stderr and expect in r.stderr, r.stderr[-2000:]


# -- 8. the smaller ones ---------------------------------------------------------------------------------


@needs_root
def test_a_full_disk_is_reported_as_full():
    from engine.errors import StoragePathError
    from engine.storage.usable import check_usable

    with mounted("tmpfs", "size=64k") as d:
        fd = os.open(os.path.join(d, "filler"), os.O_WRONLY | os.O_CREAT, 0o600)
        try:
            while True:
                os.write(fd, b"\0" * 4096)
        except OSError as e:
            assert e.errno == errno.ENOSPC
        finally:
            os.close(fd)
        with pytest.raises(StoragePathError, match="is full"):
            check_usable(d)


def test_racing_tuner_starts_keep_one_daemon_and_its_pidfile(tmp_path):
    sock = str(tmp_path / "d" / "tuner.sock")
    procs = [
        subprocess.Popen(
            [sys.executable, "-m", "offloadctl.cli", "tuner", "start", "--socket", sock, "--db", "none", "--json"],
            cwd=ROOT,
            env=env_with_root(),
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for _ in range(4)
    ]
    outs = [p.communicate(timeout=120) for p in procs]
    try:
        time.sleep(1.0)  # the losers' daemons have exited by now
        welcome = service.probe(sock)
        assert welcome is not None, outs
        pid = int(open(service.pidfile_for(sock)).read())
        assert pid == welcome["pid"], (pid, welcome, outs)
    finally:
        service.stop(sock)


def test_pins_and_freeze_survive_a_daemon_restart(tmp_path):
    sock, db = str(tmp_path / "d" / "tuner.sock"), str(tmp_path / "tuner.db")
    daemon = _serve(sock, "--db", db, "--no-sensors")
    try:
        with Connection(sock, role="engine") as c:
            _register(c, "r1", paths=("/x",))
            with Connection(sock) as client:
                client.request("pin", run_id="r1", knob="prefetch_depth", value=5)
                client.request("freeze", run_id="r1", frozen=True)
        daemon.terminate()
        daemon.wait(10)
        daemon = _serve(sock, "--db", db, "--no-sensors")
        with Connection(sock, role="engine") as c:
            _register(c, "r1", paths=("/x",))  # the rank reconnects to the new daemon
            with Connection(sock) as client:
                run = client.request("snapshot", run_id="r1", history=0)["runs"][0]
        assert run["pins"] == {"prefetch_depth": 5} and run["frozen"] is True
    finally:
        daemon.terminate()
        daemon.wait(10)


def test_systemd_units_are_hardened():
    unit = open(os.path.join(ROOT, "systemd", "offloadctl-tuner.service")).read()
    for directive in (
        "LimitNOFILE=",
        "RemoveIPC=yes",
        "ProtectProc=invisible",
        "DevicePolicy=closed",
        "DeviceAllow=/dev/nvidiactl",
    ):
        assert directive in unit
    if shutil.which("systemd-analyze") is None:
        pytest.skip("no systemd-analyze here")
    r = subprocess.run(
        ["systemd-analyze", "security", "--offline=true", os.path.join(ROOT, "systemd", "offloadctl-tuner.service")],
        capture_output=True,
        text=True,
    )
    if "Overall exposure level" not in r.stdout:
        pytest.skip(f"systemd-analyze security --offline is not available here: {r.stderr[-200:]}")
    level = float(r.stdout.split("Overall exposure level for offloadctl-tuner.service:")[1].split()[0])
    assert level <= 1.4


# -- beyond the list ---------------------------------------------------------------------------------------


@pytest.mark.slow
def test_two_runs_sharing_one_nvme_path(tmp_path):
    """Two trainings at once on one storage directory: each keeps its own swap directory, both
    train to the same losses as alone, and both clean up."""
    nvme = tmp_path / "nvme"
    nvme.mkdir()
    procs = []
    for k in range(2):
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
            str(nvme),
            "--host-cache-gb",
            "0",
            "--tuner",
            "off",
            "--run-dir",
            str(tmp_path / f"run{k}"),
            TINY,
            "--losses-out",
            str(tmp_path / f"l{k}.jsonl"),
        ]
        procs.append(
            subprocess.Popen(cmd, cwd=ROOT, env=env_with_root(), stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
        )
    for p in procs:
        _, err = p.communicate(timeout=600)
        assert p.returncode == 0, err[-3000:]
    losses = [[json.loads(line)["loss"] for line in open(tmp_path / f"l{k}.jsonl")] for k in range(2)]
    assert losses[0] == losses[1] and len(losses[0]) == 6
    assert glob.glob(str(nvme / "offloadctl-swap-*" / "*" / "*.swp")) == []


@pytest.mark.slow
def test_rank_killed_mid_write_resumes_from_its_checkpoint(ds_runs, tmp_path):
    """kill -9 of the rank while it writes swap files, then resume from the last checkpoint:
    the losses after it equal those of a run that was never interrupted."""
    nvme = tmp_path / "nvme"
    nvme.mkdir()
    ckpt = str(tmp_path / "ckpt")

    def run(losses, *extra, steps=6):
        return [
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
            "--host-cache-gb",
            "0",
            "--tuner",
            "off",
            "--run-dir",
            str(tmp_path / losses.replace(".jsonl", "-run")),
            TINY,
            "--steps",
            str(steps),
            "--losses-out",
            str(tmp_path / losses),
            "--ckpt-dir",
            ckpt,
            *extra,
        ]

    # The uninterrupted run, all state on NVMe: the session's (it saves at step 3, which changes no loss).
    whole = ds_runs.get(ours(1, "--dtype", "fp32", *SAVE, opts=LAYOUTS["all-nvme"])).ok()
    # Save at step 3, then keep stepping until killed (a long run: the kill lands mid-step).
    p = subprocess.Popen(
        run("killed.jsonl", "--save-at", "3", steps=10_000),
        cwd=ROOT,
        env=env_with_root(),
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,
    )
    _wait(
        lambda: sum(1 for _ in open(tmp_path / "killed.jsonl")) >= 5 if os.path.exists(tmp_path / "killed.jsonl") else False,
        300,
        "steps past the checkpoint",
    )
    os.killpg(p.pid, signal.SIGKILL)
    p.wait()
    resumed = subprocess.run(
        run("resumed.jsonl", "--resume", ckpt), cwd=ROOT, env=env_with_root(), capture_output=True, text=True, timeout=600
    )
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    ref = whole.losses[3:]
    got = [json.loads(line)["loss"] for line in open(tmp_path / "resumed.jsonl")]
    assert got == pytest.approx(ref, rel=1e-6) and len(got) == 3
    assert glob.glob(str(nvme / "offloadctl-swap-*" / "*" / "*.swp")) == []


NESTED_SIGNALS = """
import os, signal
from integrations import bootstrap

bootstrap._stop_on_signals()
real, sent = bootstrap._ignore_later_signals, []


def sigterm_arrives_meanwhile():  # DeepSpeed's launcher's SIGTERM, while Ctrl-C's SIGINT is being handled
    if not sent:
        sent.append(1)
        os.kill(os.getpid(), signal.SIGTERM)
    real()


bootstrap._ignore_later_signals = sigterm_arrives_meanwhile
try:
    os.kill(os.getpid(), signal.SIGINT)
    for _ in range(100_000):
        pass
except bootstrap.Stopped as e:
    print(signal.Signals(e.signum).name)
"""


def test_a_signal_arriving_while_the_first_is_handled_does_not_take_its_place():
    """Ctrl-C's SIGINT, then DeepSpeed's launcher's SIGTERM while the rank's handler of the first
    still runs (other threads hold the GIL): Python runs the second handler inside the first, and
    the rank said 'stopped by SIGTERM' to its tuner while its record said SIGINT. The first counts."""
    out = subprocess.run(
        [sys.executable, "-c", NESTED_SIGNALS], capture_output=True, text=True, cwd=ROOT, env=env_with_root(), timeout=60
    )
    assert out.stdout.strip() == "SIGINT", (out.stdout, out.stderr[-2000:])
