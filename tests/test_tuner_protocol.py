"""The tuner protocol: framing and schemas, and a real daemon facing hostile clients.

The daemon runs as its own process on a real Unix socket. Hostile clients (garbage, oversized
frames, bad JSON, unknown types, a client trickling one byte per second, one that never says
hello, one of another uid) must get their numbered error, and must neither crash the daemon nor
disturb a well-behaved run that trains alongside them.
"""

from __future__ import annotations

import functools
import json
import os
import shutil
import socket
import stat
import struct
import subprocess
import sys
import tempfile
import threading
import time

import pytest
from helpers import needs_root

from tuner.protocol import (
    API_VERSION,
    CLIENT_SCHEMAS,
    MAX_FRAME_BYTES,
    SERVER_SCHEMAS,
    Connection,
    ErrorCode,
    FrameBuffer,
    ProtocolError,
    check_length,
    decode,
    encode,
    knobs_from_dict,
    validate,
)

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
FRAME_TIMEOUT_S = 2.0


# -- framing and schemas, no daemon ---------------------------------------------------------------


def test_frame_round_trip_and_incremental_parse():
    msgs = [{"v": API_VERSION, "type": "ping", "id": k} for k in range(3)]
    data = b"".join(encode(m) for m in msgs)
    assert struct.unpack(">I", data[:4])[0] == len(json.dumps(msgs[0], separators=(",", ":")))
    fb = FrameBuffer()
    got = []
    for b in data:  # one byte at a time: frames come out whole, in order
        got += fb.feed(bytes([b]))
    assert got == msgs and fb.buf == b""


def test_framing_refuses_nan_empty_and_oversized():
    with pytest.raises(ValueError):
        encode({"v": API_VERSION, "type": "ping", "x": float("nan")})
    with pytest.raises(ProtocolError) as e:
        decode(b'{"v": API_VERSION, "type": "ping", "x": NaN}')
    assert e.value.code == ErrorCode.BAD_JSON
    with pytest.raises(ProtocolError) as e:
        check_length(0)
    assert e.value.code == ErrorCode.BAD_FRAME
    with pytest.raises(ProtocolError) as e:
        check_length(MAX_FRAME_BYTES + 1)
    assert e.value.code == ErrorCode.TOO_LARGE
    with pytest.raises(ProtocolError) as e:
        encode({"v": API_VERSION, "type": "ping", "pad": "x" * MAX_FRAME_BYTES})
    assert e.value.code == ErrorCode.TOO_LARGE
    for body, code in (
        (b"\xff\xfe", ErrorCode.BAD_JSON),
        (b"[" * 100_000, ErrorCode.BAD_JSON),
        (b"[1, 2]", ErrorCode.SCHEMA),
        (b'{"v": %d}' % API_VERSION, ErrorCode.SCHEMA),
        (b'{"v": %d, "type": "ping"}' % (API_VERSION + 1), ErrorCode.VERSION),
    ):
        with pytest.raises(ProtocolError) as e:
            decode(body)
        assert e.value.code == code, body[:20]


def _register(**over):
    msg = {
        "v": API_VERSION,
        "type": "register",
        "id": 1,
        "run_id": "r",
        "rank": 0,
        "world_size": 2,
        "params": 10,
        "paths": ["/nvme0"],
        "knobs": {"prefetch_depth": 2},
        "has_device": False,
        "subgroup_bytes": 120,
    }
    msg.update(over)
    return {k: v for k, v in msg.items() if v is not Ellipsis}


@pytest.mark.parametrize(
    "msg, where",
    [
        (_register(rank=True), "register.rank"),  # a bool is not an integer
        (_register(rank=-1), "register.rank"),
        (_register(world_size=...), "register.world_size is missing"),
        (_register(colour="red"), "unknown field"),
        (_register(run_id="a\nb"), "register.run_id"),  # no control characters in a run id
        (_register(run_id=""), "register.run_id"),
        (_register(paths="/nvme0"), "register.paths"),
        (_register(knobs={"prefetch_depth": "2"}), "register.knobs.prefetch_depth"),
        (_register(knobs={"warp": 9}), "unknown field"),
        (_register(knobs={"io_concurrency": {"/a": True}}), "io_concurrency"),
        (_register(id=[1]), "register.id"),
        (_register(id="x" * 65), "register.id"),
        (
            {
                "v": API_VERSION,
                "type": "telemetry",
                "run_id": "r",
                "rank": 0,
                "iteration": 3,
                "record": {"iteration": 3, "update_s": "fast", "read_wait_s": 0, "kernel_s": 0, "write_wait_s": 0},
            },
            "telemetry.record.update_s",
        ),
        (
            {"v": API_VERSION, "type": "telemetry", "run_id": "r", "rank": 0, "iteration": 3, "record": {"iteration": 3}},
            "telemetry.record.update_s is missing",
        ),
        ({"v": API_VERSION, "type": "event", "run_id": "r", "rank": 0, "kind": "fire", "message": ""}, "event.kind"),
        ({"v": API_VERSION, "type": "pin", "run_id": "r", "knob": "warp_speed", "value": 9}, "pin.knob"),
        ({"v": API_VERSION, "type": "hello", "api": API_VERSION, "role": "admin"}, "hello.role"),
    ],
)
def test_schema_names_the_field(msg, where):
    with pytest.raises(ProtocolError) as e:
        validate(msg, CLIENT_SCHEMAS)
    assert e.value.code == ErrorCode.SCHEMA and where in str(e.value)


def test_schema_accepts_valid_messages_and_unknown_types_get_their_code():
    validate(_register(), CLIENT_SCHEMAS)
    validate(_register(profile="profiles/example-cpu-vm.toml", device_headroom_bytes=None, iteration=7), CLIENT_SCHEMAS)
    validate({"v": API_VERSION, "type": "pin", "run_id": "r", "knob": "io_concurrency[/nvme0]", "value": 8}, CLIENT_SCHEMAS)
    # extra fields inside a StepRecord are the engine's business and pass
    validate(
        {
            "v": API_VERSION,
            "type": "telemetry",
            "run_id": "r",
            "rank": 0,
            "iteration": 3,
            "iter_time_s": None,
            "record": {
                "iteration": 3,
                "update_s": 1.0,
                "read_wait_s": 0,
                "kernel_s": 0.5,
                "write_wait_s": 0,
                "order": "forward",
                "something_new": [1],
            },
        },
        CLIENT_SCHEMAS,
    )
    validate(
        {
            "v": API_VERSION,
            "type": "knobs",
            "run_id": "r",
            "knobs": {"prefetch_depth": 3},
            "apply_at": 9,
            "seq": 1,
            "reason": "x",
        },
        SERVER_SCHEMAS,
    )
    with pytest.raises(ProtocolError) as e:
        validate({"v": API_VERSION, "type": "teleport"}, CLIENT_SCHEMAS)
    assert e.value.code == ErrorCode.UNKNOWN_TYPE
    with pytest.raises(ProtocolError) as e:  # well-typed but out of the engine's range
        knobs_from_dict({"prefetch_depth": 65})
    assert e.value.code == ErrorCode.BAD_VALUE and "prefetch_depth" in str(e.value)


# -- a real daemon --------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def daemon():
    # Directly under /tmp, not pytest's 0700 tree: the other-uid test must reach the socket.
    d = tempfile.mkdtemp(prefix="offloadctl-proto-")
    path = os.path.join(d, "run", "tuner.sock")  # "run" does not exist: the daemon creates it, 0700
    logf = open(os.path.join(d, "daemon.log"), "w+")
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "offloadctl.cli",
            "tuner",
            "serve",
            "--socket",
            path,
            "--db",
            "none",
            "--no-sensors",
            "--frame-timeout",
            str(FRAME_TIMEOUT_S),
            "--handshake-timeout",
            str(FRAME_TIMEOUT_S),
        ],
        cwd=ROOT,
        stdout=logf,
        stderr=logf,
    )
    deadline = time.monotonic() + 60
    while not os.path.exists(path):
        assert proc.poll() is None, open(logf.name).read()
        assert time.monotonic() < deadline, "daemon did not start"
        time.sleep(0.05)
    try:
        yield path, proc
        proc.terminate()
        assert proc.wait(10) == 0
        out = open(logf.name).read()
        assert "Traceback" not in out, out  # hostile input is logged as warnings, never as a crash
        assert not os.path.exists(path)  # the daemon removes its socket at exit
    finally:
        if proc.poll() is None:
            proc.kill()
        logf.close()
        shutil.rmtree(d)


def _raw(path: str, timeout: float = 5.0) -> socket.socket:
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.settimeout(timeout)
    s.connect(path)
    return s


def _send(s: socket.socket, msg: dict) -> None:
    s.sendall(encode({"v": API_VERSION, **msg}))


def _recv(s: socket.socket) -> dict:
    n = struct.unpack(">I", _exactly(s, 4))[0]
    return json.loads(_exactly(s, n))


def _exactly(s: socket.socket, n: int) -> bytes:
    buf = b""
    while len(buf) < n:
        chunk = s.recv(n - len(buf))
        if not chunk:
            raise EOFError
        buf += chunk
    return buf


def _closed(s: socket.socket) -> bool:
    try:
        return s.recv(1) == b""
    except ConnectionResetError:
        return True


def _hello(path: str, role: str = "cli") -> socket.socket:
    s = _raw(path)
    _send(s, {"type": "hello", "id": 0, "api": API_VERSION, "role": role})
    assert _recv(s)["type"] == "welcome"
    return s


def _expect_error(s: socket.socket, code: ErrorCode) -> dict:
    reply = _recv(s)
    assert reply["type"] == "error" and reply["code"] == code, reply
    return reply


def test_socket_is_private(daemon):
    path, _ = daemon
    assert stat.S_ISSOCK(os.lstat(path).st_mode)
    assert stat.S_IMODE(os.lstat(path).st_mode) == 0o600
    assert stat.S_IMODE(os.stat(os.path.dirname(path)).st_mode) == 0o700


def test_handshake_and_version(daemon):
    path, _ = daemon
    s = _raw(path)
    _send(s, {"type": "ping", "id": 1})  # no hello first
    assert _expect_error(s, ErrorCode.HANDSHAKE)["id"] == 1 and _closed(s)
    s = _raw(path)
    _send(s, {"type": "hello", "id": 1, "api": API_VERSION + 1, "role": "cli"})
    assert "API" in _expect_error(s, ErrorCode.VERSION)["message"] and _closed(s)
    s = _raw(path)
    s.sendall(encode({"v": API_VERSION + 1, "type": "hello", "api": API_VERSION, "role": "cli"}))
    _expect_error(s, ErrorCode.VERSION)
    assert _closed(s)
    s = _hello(path)
    _send(s, {"type": "hello", "id": 2, "api": API_VERSION, "role": "cli"})
    _expect_error(s, ErrorCode.HANDSHAKE)
    with Connection(path) as c:  # the library client speaks it right
        assert c.welcome["api"] == API_VERSION and c.welcome["pid"] == daemon[1].pid


def test_errors_that_keep_the_connection(daemon):
    path, _ = daemon
    s = _hello(path)
    for body, code in (
        (b"{not json", ErrorCode.BAD_JSON),
        (b"\xff\xfe\xfd", ErrorCode.BAD_JSON),
        (b"[" * 200_000, ErrorCode.BAD_JSON),
        (b"[1, 2]", ErrorCode.SCHEMA),
    ):
        s.sendall(struct.pack(">I", len(body)) + body)
        _expect_error(s, code)
    _send(s, {"type": "teleport", "id": 7})
    assert _expect_error(s, ErrorCode.UNKNOWN_TYPE)["id"] == 7
    _send(
        s,
        {
            "type": "telemetry",
            "id": 8,
            "run_id": "r",
            "rank": 0,
            "iteration": 0,
            "record": {"iteration": 0, "update_s": 1, "read_wait_s": 0, "kernel_s": 0, "write_wait_s": 0},
        },
    )
    _expect_error(s, ErrorCode.ROLE)  # a cli client may not send telemetry
    _send(s, {"type": "pin", "id": 9, "run_id": "nosuchrun", "knob": "prefetch_depth", "value": 3})
    _expect_error(s, ErrorCode.UNKNOWN_RUN)
    _send(s, {"type": "ping", "id": 10})
    assert _recv(s) == {"v": API_VERSION, "id": 10, "type": "pong"}  # still served
    e = _hello(path, role="engine")
    _send(
        e,
        {
            "type": "telemetry",
            "id": 1,
            "run_id": "r",
            "rank": 0,
            "iteration": 0,
            "record": {"iteration": 0, "update_s": 1, "read_wait_s": 0, "kernel_s": 0, "write_wait_s": 0},
        },
    )
    _expect_error(e, ErrorCode.UNKNOWN_RUN)  # not registered: telemetry is refused, not guessed at
    _send(e, {"type": "shutdown", "id": 2})
    _expect_error(e, ErrorCode.ROLE)


def test_frames_that_close_the_connection(daemon):
    path, proc = daemon
    s = _raw(path)
    t0 = time.monotonic()
    s.sendall(struct.pack(">I", 2 * MAX_FRAME_BYTES))  # no body follows: refused on the header alone
    _expect_error(s, ErrorCode.TOO_LARGE)
    assert _closed(s) and time.monotonic() - t0 < 1.5  # not waiting out the 2 s frame deadline
    s = _raw(path)
    s.sendall(b"GET / HTTP/1.1\r\nHost: localhost\r\n\r\n")  # "GET " read as a length: 1.2 GB
    _expect_error(s, ErrorCode.TOO_LARGE)
    assert _closed(s)
    s = _raw(path)
    s.sendall(struct.pack(">I", 0))
    _expect_error(s, ErrorCode.BAD_FRAME)
    s = _raw(path)
    s.sendall(struct.pack(">I", 100) + b"{")  # then hang up inside the frame
    s.shutdown(socket.SHUT_WR)
    assert _expect_error(s, ErrorCode.BAD_FRAME)
    assert proc.poll() is None


def test_slow_clients_are_dropped_without_delaying_others(daemon):
    """One byte per second of a frame, and a connection that never says hello: both dropped
    after the deadline, while another client's requests are answered at once throughout."""
    path, _ = daemon
    loris = _hello(path)
    mute = _raw(path)
    frame = encode({"v": API_VERSION, "type": "ping", "id": 1})
    outcome = {}

    def trickle():
        t0 = time.monotonic()
        try:
            for b in frame:
                loris.sendall(bytes([b]))
                time.sleep(1.0)
        except OSError:
            pass
        try:
            outcome["reply"] = _recv(loris)
        except (EOFError, OSError):
            outcome["reply"] = None
        outcome["after_s"] = time.monotonic() - t0

    t = threading.Thread(target=trickle)
    t.start()
    good = _hello(path)
    latencies = []
    while t.is_alive():
        t0 = time.monotonic()
        _send(good, {"type": "ping", "id": 5})
        assert _recv(good)["type"] == "pong"
        latencies.append(time.monotonic() - t0)
        time.sleep(0.05)
    t.join()
    assert outcome["reply"]["code"] == ErrorCode.TIMEOUT and _closed(loris)
    assert FRAME_TIMEOUT_S - 0.5 < outcome["after_s"] < FRAME_TIMEOUT_S + 3
    assert len(latencies) > 10 and max(latencies) < 1.0, latencies  # not held up by the trickling client
    _expect_error(mute, ErrorCode.TIMEOUT)  # no hello within the handshake timeout
    assert _closed(mute)


def _as_uid(uid: int, fn):
    """``fn()`` in a forked child that has dropped to ``uid``; its JSON result."""
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: never returns into pytest
        try:
            os.close(r)
            os.setgid(uid)
            os.setuid(uid)
            out = fn()
        except BaseException as e:
            out = f"{type(e).__name__}: {e}"
        os.write(w, json.dumps(out).encode())
        os._exit(0)
    os.close(w)
    with os.fdopen(r, "rb") as f:
        data = f.read()
    os.waitpid(pid, 0)
    return json.loads(data)


@functools.partial(needs_root, reason="needs root to run a client as another uid")
def test_other_uid_is_refused(daemon):
    """A client of another uid: the socket's mode 0600 stops it at connect; and where the mode
    is loosened (a misconfigured socket), SO_PEERCRED refuses it with PERMISSION."""
    path, proc = daemon

    def client():
        try:
            s = _raw(path)
        except PermissionError:
            return "EACCES"
        try:
            _send(s, {"type": "hello", "id": 0, "api": API_VERSION, "role": "cli"})
        except BrokenPipeError:
            pass  # the daemon refuses at accept, before any hello
        return {"reply": _recv(s), "closed": _closed(s)}

    parent, top = os.path.dirname(path), os.path.dirname(os.path.dirname(path))
    for d in (top, parent):
        os.chmod(d, 0o711)  # let the other uid reach the socket file itself
    try:
        assert _as_uid(65534, client) == "EACCES"
        os.chmod(path, 0o666)
        out = _as_uid(65534, client)
        assert isinstance(out, dict), out
        assert out["reply"]["code"] == ErrorCode.PERMISSION and "uid 65534" in out["reply"]["message"], out
        assert out["closed"]
    finally:
        os.chmod(path, 0o600)
        for d in (top, parent):
            os.chmod(d, 0o700)
    with Connection(path) as c:  # and the daemon serves its own uid as before
        assert c.welcome["pid"] == proc.pid


def test_hostile_clients_do_not_disturb_a_run(daemon):
    """A run registers and reports while every kind of bad client comes and goes; at the end
    the run has all its iterations, its rank is still connected, and the daemon is the same."""
    path, proc = daemon
    run = _hello(path, role="engine")
    _send(
        run,
        {
            "type": "register",
            "id": 1,
            "run_id": "steady",
            "rank": 0,
            "world_size": 1,
            "params": 100,
            "paths": [],
            "knobs": {"prefetch_depth": 2},
            "has_device": False,
            "subgroup_bytes": 1200,
        },
    )
    assert _recv(run)["type"] == "registered"
    hostile = [
        lambda s: s.sendall(b"\x00\x00\x00\x05hello"),
        lambda s: s.sendall(os.urandom(64)),
        lambda s: s.sendall(struct.pack(">I", 1 << 30)),
        lambda s: (
            _send(s, {"type": "hello", "id": 0, "api": 1, "role": "engine"}),
            _send(
                s,
                {
                    "type": "register",
                    "id": 1,
                    "run_id": "steady",
                    "rank": 0,
                    "world_size": 3,
                    "params": 1,
                    "paths": [],
                    "knobs": {},
                    "has_device": False,
                    "subgroup_bytes": 0,
                },
            ),
            _send(
                s,
                {
                    "type": "telemetry",
                    "run_id": "steady",
                    "rank": 0,
                    "iteration": 10**6,
                    "record": {"iteration": 10**6, "update_s": 0, "read_wait_s": 0, "kernel_s": 0, "write_wait_s": 0},
                },
            ),
        ),
        lambda s: (
            _send(s, {"type": "hello", "id": 0, "api": 1, "role": "cli"}),
            _send(s, {"type": "freeze", "id": 1, "run_id": "steady", "frozen": "yes"}),
            _send(s, {"type": "pin", "id": 2, "run_id": "steady", "knob": "prefetch_depth", "value": -4}),
            _send(s, {"type": "pin", "id": 3, "run_id": "steady", "knob": "io_concurrency[/not/ours]", "value": 4}),
        ),
    ]
    for i in range(40):
        s = _raw(path)
        try:
            hostile[i % len(hostile)](s)
        except OSError:
            pass
        s.close()
        _send(
            run,
            {
                "type": "telemetry",
                "id": 100 + i,
                "run_id": "steady",
                "rank": 0,
                "iteration": i,
                "iter_time_s": 0.01,
                "record": {"iteration": i, "update_s": 0.005, "read_wait_s": 0.0, "kernel_s": 0.004, "write_wait_s": 0.0},
            },
        )
        reply = _recv(run)
        while reply["type"] == "knobs":  # the real policy may move knobs; that is fine
            reply = _recv(run)
        assert reply == {"v": API_VERSION, "id": 100 + i, "type": "ok"}
    with Connection(path) as c:
        snap = c.request("snapshot", run_id="steady")
        (steady,) = snap["runs"]
        assert steady["iteration"] == 39 and steady["connected"] == 1 and steady["ranks"] == 1
        assert steady["knobs"]["prefetch_depth"] >= 0 and steady["pins"] == {} and not steady["frozen"]
        assert snap["daemon"]["pid"] == proc.pid
    _send(run, {"type": "bye", "id": 2, "run_id": "steady", "rank": 0})
    while _recv(run)["type"] != "ok":
        pass


def test_knob_names_have_one_owner():
    """The tuner's protocol, its policy and `offloadctl tune` take the knob names from Knobs, so a
    knob of the engine is one the daemon accepts and the CLI can pin, and nothing else is."""
    from engine.config import Knobs
    from engine.errors import ConfigError
    from offloadctl.commands.tune import parse_pin
    from tuner.protocol import KNOBS, ProtocolError, knobs_from_dict

    defaults = Knobs().to_dict()
    assert KNOBS(defaults, "knobs") == defaults
    for name in Knobs.names():
        assert parse_pin(f"run-1:{name}=1")[1] == name
        assert knobs_from_dict({name: defaults[name]}) == Knobs()
    with pytest.raises(ProtocolError, match="knobs has unknown field"):
        KNOBS({"prefetch_depths": 2}, "knobs")
    with pytest.raises(ConfigError, match=r"unknown knob\(s\) \['prefetch_depths'\]: the knobs are device_fraction"):
        Knobs.from_dict({"prefetch_depths": 2})
    with pytest.raises(ConfigError, match="--pin"):
        parse_pin("run-1:prefetch_depths=2")
