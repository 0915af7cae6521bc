"""The tuner's wire protocol: versioned, length-prefixed JSON over a Unix socket.

A frame is a 4-byte big-endian length followed by that many bytes of UTF-8 JSON holding one
object. The length is checked against :data:`MAX_FRAME_BYTES` before the body is read. Every
message has ``"v"`` (:data:`API_VERSION`) and ``"type"``; a request may carry an ``"id"``
(integer or short string) and then gets exactly one reply echoing it; a request without one
gets a reply only when it fails. The daemon also pushes ``knobs`` messages to engine clients.
No pickle: JSON only, with NaN and infinities refused.

Every message type has a schema (:data:`CLIENT_SCHEMAS`, :data:`SERVER_SCHEMAS`) that checks
each field's type and range; unknown fields are refused, except inside a telemetry ``record``
(the engine's ``StepRecord``, which may grow), whose known fields are still type-checked.
"""

from __future__ import annotations

import json
import math
import os
import re
import socket
import stat
import struct
import time
from enum import IntEnum
from typing import Any, Callable, Mapping, NoReturn

from engine.config import KnobKey, Knobs
from engine.errors import ConfigError, OffloadError

API_VERSION = 3
"""3: ``register`` carries ``pins`` (knob -> value the run's options pinned) where 2 named them in
``fixed_knobs``; 2: a step record's ``update_s`` is the update phase (1 called it ``wall_s``),
``kernel_s`` the math."""
MAX_FRAME_BYTES = 1 << 20
HEADER = struct.Struct(">I")


class ErrorCode(IntEnum):
    """Numbered error codes carried by ``error`` replies."""

    BAD_FRAME = 1  # zero length, or the connection ended inside a frame
    TOO_LARGE = 2  # length above the maximum frame size (connection closed)
    BAD_JSON = 3  # body is not UTF-8 JSON (connection kept: the framing is intact)
    SCHEMA = 4  # a field is missing, unknown, or of the wrong type or range
    UNKNOWN_TYPE = 5  # no such message type (connection kept)
    VERSION = 6  # API version not spoken by this daemon (connection closed)
    PERMISSION = 7  # peer is neither the daemon's uid nor root (connection closed)
    UNKNOWN_RUN = 8  # no such run, or this connection has not registered that rank
    HANDSHAKE = 9  # first message was not ``hello``, or ``hello`` came twice
    ROLE = 10  # message type not allowed for this connection's role
    BAD_VALUE = 11  # well-typed but unusable: a knob value, a world size that disagrees
    TIMEOUT = 12  # a frame or the handshake did not complete in time (connection closed)
    BUSY = 13  # too many connections (connection closed)
    INTERNAL = 14  # the daemon failed handling this message; other runs are unaffected


class ProtocolError(OffloadError):
    """A message that breaks the protocol, or an ``error`` reply from the daemon."""

    def __init__(self, code: ErrorCode | int, message: str) -> None:
        super().__init__(message)
        self.code = ErrorCode(code) if code in ErrorCode._value2member_map_ else code
        self.message = message

    def to_message(self, req_id: int | str | None = None) -> dict[str, Any]:
        return {"v": API_VERSION, "type": "error", "id": req_id, "code": int(self.code), "message": self.message}


# -- schemas -------------------------------------------------------------------------------------
# A spec is a function (value, where) -> value that raises ProtocolError(SCHEMA) naming ``where``.
# Containers call their members with an empty ``where`` and put the member's place in front of
# the message only when it fails: the daemon checks every field of thousands of messages a
# second, and building each field's path up front took a third of its time.

Spec = Callable[[Any, str], Any]


def _inside(where: str, place: str, e: ProtocolError) -> ProtocolError:
    """``e`` (raised by a member checked with an empty ``where``) with the member's place in front."""
    return ProtocolError(e.code, f"{where}{place}{e.message}")


def _fail(where: str, expected: str, value: object) -> NoReturn:
    shown = repr(value)
    if len(shown) > 60:
        shown = shown[:57] + "..."
    raise ProtocolError(ErrorCode.SCHEMA, f"{where} must be {expected}, got {shown}")


NUM_MAX = 1e15
"""Largest number a client may send: no real figure (seconds, bytes/s, a knob) comes near it,
and anything derived from numbers under it stays finite."""
INT_MAX = 1 << 62
SECONDS_MAX = 1e7
"""Largest duration a client may report (about four months)."""


def Int(lo: int | None = None, hi: int = INT_MAX) -> Spec:
    def check(v: object, where: str) -> object:
        if not isinstance(v, int) or isinstance(v, bool) or (lo is not None and v < lo) or v > hi or v < -INT_MAX:
            _fail(where, f"an integer in [{lo if lo is not None else '-inf'}, {hi if hi is not None else 'inf'}]", v)
        return v

    return check


def Num(lo: float | None = None, hi: float = NUM_MAX) -> Spec:
    def check(v: object, where: str) -> object:
        if (
            not isinstance(v, (int, float))
            or isinstance(v, bool)
            or not math.isfinite(v)
            or (lo is not None and v < lo)
            or v > hi
        ):
            _fail(where, f"a finite number in [{lo if lo is not None else -hi}, {hi:g}]", v)
        return v

    return check


def Str(max_len: int = 256, pattern: str | None = None, min_len: int = 0) -> Spec:
    rx = re.compile(pattern) if pattern else None

    def check(v: object, where: str) -> object:
        if not isinstance(v, str) or not (min_len <= len(v) <= max_len) or (rx and not rx.fullmatch(v)):
            _fail(where, f"a string of {min_len}..{max_len} characters" + (f" matching {pattern}" if rx else ""), v)
        return v

    return check


def Bool(v: object, where: str) -> object:
    if not isinstance(v, bool):
        _fail(where, "true or false", v)
    return v


def Enum(*values: str) -> Spec:
    def check(v: object, where: str) -> object:
        if not isinstance(v, str) or v not in values:
            _fail(where, "one of " + ", ".join(map(repr, values)), v)
        return v

    return check


def Opt(spec: Spec) -> Spec:
    def check(v: object, where: str) -> object:
        return None if v is None else spec(v, where)

    return check


def Any_(v: object, where: str) -> object:
    return v  # bounded by the frame size; used for opaque values checked elsewhere


def Dict(value: Spec, key: Spec | None = None, max_items: int = 256) -> Spec:
    key = key or Str(4096)

    def check(v: object, where: str) -> object:
        if not isinstance(v, dict) or len(v) > max_items:
            _fail(where, f"an object of at most {max_items} entries", v)
        for k, x in v.items():
            try:
                key(k, "")
            except ProtocolError as e:
                raise _inside(where, " key", e) from None
            try:
                value(x, "")
            except ProtocolError as e:
                raise _inside(where, f"[{k!r}]", e) from None
        return v

    return check


def List(item: Spec, max_items: int = 256) -> Spec:
    def check(v: object, where: str) -> object:
        if not isinstance(v, list) or len(v) > max_items:
            _fail(where, f"a list of at most {max_items} items", v)
        for i, x in enumerate(v):
            try:
                item(x, "")
            except ProtocolError as e:
                raise _inside(where, f"[{i}]", e) from None
        return v

    return check


def Obj(fields: dict[str, tuple[Spec, bool]], *, extra: bool = False) -> Spec:
    """An object whose ``fields`` map name -> (spec, required); ``extra`` admits other keys."""
    known = frozenset(fields)

    def check(v: object, where: str) -> object:
        if not isinstance(v, dict):
            _fail(where, "an object", v)
        for name, (spec, required) in fields.items():
            if name in v:
                try:
                    spec(v[name], "")
                except ProtocolError as e:
                    raise _inside(where, f".{name}", e) from None
            elif required:
                raise ProtocolError(ErrorCode.SCHEMA, f"{where}.{name} is missing")
        if not extra and not known.issuperset(v):
            raise ProtocolError(ErrorCode.SCHEMA, f"{where} has unknown field(s) {sorted(set(v) - known)}")
        return v

    return check


RUN_ID = Str(128, r"[^\x00-\x1f\x7f]+", min_len=1)
"""Any printable text (a run directory's name, say), no control characters."""
RANK = Int(0, 1 << 20)
PATH = Str(4096, min_len=1)
KNOB_NAMES = Knobs.names()
KNOB = Str(4200, KnobKey.pattern())
"""A knob to pin: :class:`engine.config.KnobKey` text."""
# The wire type of each knob; the names (and their ranges) are Knobs'. A knob added there
# without a wire type here fails at import, not at the first message.
_KNOB_WIRE = {
    "device_fraction": Num(0),
    "prefetch_depth": Int(0),
    "io_concurrency": Dict(Int(1), PATH, 64),
    "node_lock": Bool,
    "stripe_weights": Dict(Num(0), PATH, 64),
}
KNOBS = Obj({name: (_KNOB_WIRE[name], False) for name in KNOB_NAMES})
PINS = Dict(Any_, KNOB, 64)
"""Knob -> value pinned (a value the policy checks as it checks a ``pin`` request's)."""
# The parts of StepRecord.to_dict() the daemon reads; other fields pass unchecked.
SECONDS = Num(0, SECONDS_MAX)
RECORD = Obj(
    {
        "iteration": (Int(0), True),
        "update_s": (SECONDS, True),
        "read_wait_s": (SECONDS, True),
        "kernel_s": (SECONDS, True),
        "write_wait_s": (SECONDS, True),
        "path_bytes_read": (Dict(Int(0), PATH, 64), False),
        "path_bytes_written": (Dict(Int(0), PATH, 64), False),
        "path_read_busy_s": (Dict(SECONDS, PATH, 64), False),
        "path_write_busy_s": (Dict(SECONDS, PATH, 64), False),
        "path_queue_wait_s": (Dict(SECONDS, PATH, 64), False),
        "setup_s": (SECONDS, False),
        "knobs": (KNOBS, False),
        "host_lane_s": (SECONDS, False),
        "device_wait_s": (SECONDS, False),
        "host_lane_subgroups": (Int(0), False),
        "device_lane_subgroups": (Int(0), False),
        "device_tier_subgroups": (Int(0), False),
    },
    extra=True,
)
DEPTH_RESPONSE = Obj({"at": (Int(1, 64), True), "double": (Num(0, 1000), False), "half": (Num(0, 1000), False)})
"""A path's probed round trip at twice and half its concurrency ``at``, over at it (``EngineFacts``)."""
PROFILE = Opt(lambda v, where: v if isinstance(v, (str, dict)) else _fail(where, "a string, an object or null", v))

_RUN_RANK = {"run_id": (RUN_ID, True), "rank": (RANK, True)}

CLIENT_SCHEMAS: dict[str, dict[str, tuple[Spec, bool]]] = {
    "hello": {"api": (Int(0), True), "role": (Enum("engine", "cli"), True), "client": (Str(256), False)},
    "ping": {},
    # engine role
    "register": {
        **_RUN_RANK,
        "world_size": (Int(1, 1 << 20), True),
        "params": (Int(0), True),
        "paths": (List(PATH, 64), True),
        "knobs": (KNOBS, True),
        "profile": (PROFILE, False),
        "has_device": (Bool, True),
        "device_headroom_bytes": (Opt(Int(0)), False),
        "subgroup_bytes": (Int(0), True),
        "iteration": (Int(0), False),
        # the pins of the run's options, with their values (held from the start), and
        # the rank's host bytes for staging buffers within its host-memory budget
        "pins": (PINS, False),
        "host_staging_bytes": (Opt(Int(0)), False),
        "path_depth_response": (Dict(DEPTH_RESPONSE, PATH, 64), False),
    },
    "telemetry": {
        **_RUN_RANK,
        "iteration": (Int(0), True),
        "record": (RECORD, True),
        "iter_time_s": (Opt(SECONDS), False),
        "device_headroom_bytes": (Opt(Int(0)), False),
    },
    "event": {**_RUN_RANK, "kind": (Enum("oom", "error"), True), "message": (Str(4096), True)},
    "applied": {**_RUN_RANK, "seq": (Int(1), True), "iteration": (Int(0), True), "apply_at": (Int(0), True)},
    # stopped_by: the signal that stopped the rank (SIGINT, SIGTERM); absent when its script ran to the end.
    # steps: the steps its engine completed, whose telemetry a signal between the step's hooks may have cut
    "bye": {**_RUN_RANK, "stopped_by": (Str(32, r"[A-Z0-9]+"), False), "steps": (Int(0), False)},
    # cli role
    "snapshot": {"run_id": (Opt(RUN_ID), False), "history": (Int(0, 1000), False)},
    "pin": {"run_id": (RUN_ID, True), "knob": (KNOB, True), "value": (Any_, True)},
    "unpin": {"run_id": (RUN_ID, True), "knob": (KNOB, True)},
    "freeze": {"run_id": (RUN_ID, True), "frozen": (Bool, True)},
    "shutdown": {},
}
ROLES = {
    "engine": {"ping", "register", "telemetry", "event", "applied", "bye"},
    "cli": {"ping", "snapshot", "pin", "unpin", "freeze", "shutdown"},
}

SERVER_SCHEMAS: dict[str, dict[str, tuple[Spec, bool]]] = {
    "welcome": {
        "api": (Int(0), True),
        "server": (Str(64), True),
        "server_id": (Str(64), True),
        "pid": (Int(0), True),
        "started_at": (Num(0), True),
    },
    "pong": {},
    "ok": {"knobs": (KNOBS, False)},
    # start_from: the knobs the history set for the run's start, and the earlier run they come from
    "registered": {
        **_RUN_RANK,
        "knobs": (Opt(KNOBS), False),
        "apply_at": (Opt(Int(0)), False),
        "seq": (Opt(Int(0)), False),
        "reason": (Opt(Str(4096)), False),
        "start_from": (Obj({"run_id": (RUN_ID, True), "knobs": (Dict(Any_), True)}), False),
    },
    "knobs": {
        "run_id": (RUN_ID, True),
        "knobs": (KNOBS, True),
        "apply_at": (Int(0), True),
        "seq": (Int(1), True),
        "reason": (Str(4096), True),
    },
    "snapshot": {
        "runs": (List(Dict(Any_, max_items=64), 4096), True),
        "daemon": (Dict(Any_), True),
        "omitted": (List(RUN_ID, 100_000), False),
    },
    "error": {"code": (Int(0), True), "message": (Str(4096), True)},
}


def _request_id(v: object, where: str) -> object:
    if not ((isinstance(v, int) and not isinstance(v, bool)) or (isinstance(v, str) and len(v) <= 64)):
        _fail(where, "an integer or a string of at most 64 characters", v)
    return v


_ENVELOPE = {"v": (Int(0), True), "type": (Str(32), True), "id": (Opt(_request_id), False)}


_CHECKERS = {
    id(schemas): {kind: Obj({**_ENVELOPE, **fields}) for kind, fields in schemas.items()}
    for schemas in (CLIENT_SCHEMAS, SERVER_SCHEMAS)
}


def validate(msg: dict[str, Any], schemas: dict[str, dict[str, tuple[Spec, bool]]]) -> dict[str, Any]:
    """Check ``msg`` (already a dict from :func:`decode`) against its type's schema in
    ``schemas`` (:data:`CLIENT_SCHEMAS` or :data:`SERVER_SCHEMAS`)."""
    kind = msg["type"]
    checkers = _CHECKERS.get(id(schemas)) or {k: Obj({**_ENVELOPE, **f}) for k, f in schemas.items()}
    if kind not in checkers:
        raise ProtocolError(ErrorCode.UNKNOWN_TYPE, f"unknown message type {kind!r}; known: {', '.join(sorted(schemas))}")
    checkers[kind](msg, kind)
    return msg


def knobs_from_dict(d: Mapping[str, Any]) -> Knobs:
    """``engine.Knobs`` from a schema-checked dict; a value out of range is BAD_VALUE."""
    try:
        return Knobs.from_dict(d)
    except (ConfigError, TypeError) as e:  # TypeError: a value of the wrong kind
        raise ProtocolError(ErrorCode.BAD_VALUE, str(e)) from None


# -- framing -------------------------------------------------------------------------------------


def _no_constants(name: str) -> NoReturn:
    raise ValueError(f"{name} is not valid JSON")


def encode(msg: Mapping[str, Any], max_frame: int = MAX_FRAME_BYTES) -> bytes:
    """One frame. Raises ProtocolError(TOO_LARGE) above ``max_frame``, ValueError on NaN."""
    body = json.dumps(msg, separators=(",", ":"), allow_nan=False).encode()
    if len(body) > max_frame:
        raise ProtocolError(ErrorCode.TOO_LARGE, f"message of {len(body)} bytes exceeds the {max_frame}-byte frame limit")
    return HEADER.pack(len(body)) + body


def check_length(n: int, max_frame: int = MAX_FRAME_BYTES) -> None:
    """Validate a frame header's length before the body is read."""
    if n == 0:
        raise ProtocolError(ErrorCode.BAD_FRAME, "empty frame: a frame holds one JSON object")
    if n > max_frame:
        raise ProtocolError(ErrorCode.TOO_LARGE, f"frame of {n} bytes exceeds the {max_frame}-byte limit")


def decode(body: bytes) -> dict[str, Any]:
    """Parse one frame body into a message with ``v`` and ``type`` (its schema is not checked)."""
    try:
        msg = json.loads(body.decode("utf-8"), parse_constant=_no_constants)
    except (UnicodeDecodeError, ValueError, RecursionError) as e:
        raise ProtocolError(ErrorCode.BAD_JSON, f"frame body is not UTF-8 JSON: {str(e)[:200]}") from None
    if not isinstance(msg, dict):
        raise ProtocolError(ErrorCode.SCHEMA, f"a message must be a JSON object, got {type(msg).__name__}")
    if not isinstance(msg.get("type"), str):
        raise ProtocolError(ErrorCode.SCHEMA, "message.type is missing or not a string")
    if msg.get("v") != API_VERSION:
        raise ProtocolError(ErrorCode.VERSION, f"message.v is {msg.get('v')!r}; this side speaks API version {API_VERSION}")
    return msg


def _recv_exactly(sock: socket.socket, n: int) -> bytes:
    buf = bytearray()
    while len(buf) < n:
        chunk = sock.recv(n - len(buf))
        if not chunk:
            raise ConnectionError("the tuner daemon closed the connection")
        buf += chunk
    return bytes(buf)


def recv_message(sock: socket.socket, max_frame: int = MAX_FRAME_BYTES) -> dict[str, Any]:
    """Read one frame from a blocking socket (its timeout applies to each read)."""
    (n,) = HEADER.unpack(_recv_exactly(sock, HEADER.size))
    check_length(n, max_frame)
    return decode(_recv_exactly(sock, n))


class FrameBuffer:
    """Incremental frame parser for a non-blocking reader (the engine client's thread)."""

    def __init__(self, max_frame: int = MAX_FRAME_BYTES) -> None:
        self.buf = bytearray()
        self.max_frame = max_frame

    def feed(self, data: bytes) -> list[dict[str, Any]]:
        self.buf += data
        out = []
        while len(self.buf) >= HEADER.size:
            (n,) = HEADER.unpack_from(self.buf)
            check_length(n, self.max_frame)
            if len(self.buf) < HEADER.size + n:
                break
            body = bytes(self.buf[HEADER.size : HEADER.size + n])
            del self.buf[: HEADER.size + n]
            out.append(decode(body))
        return out


def check_daemon_socket(path: str) -> None:
    """Refuse a daemon socket that another user could have put in place (a fake daemon would
    learn the run's paths and push it knobs). Raises :class:`ProtocolError` (PERMISSION).

    The trust model: a client trusts a socket, and the directory holding it, owned by itself or
    root, in a directory nobody else may write to, whose own parent is also its or root's (so
    nobody else could have made the directory: the /tmp trap). Root trusts a service user's
    socket under a root-owned parent (systemd's /run/offloadctl). After connecting, the server's
    credentials must match (:func:`check_daemon_peer`)."""
    me = os.geteuid()
    sock_stat = os.lstat(path)  # FileNotFoundError (an OSError): nothing listens there
    if not stat.S_ISSOCK(sock_stat.st_mode):
        raise ProtocolError(ErrorCode.PERMISSION, f"{path} is not a socket: not a tuner daemon")
    d = os.path.dirname(os.path.abspath(path))
    dir_stat, parent_stat = os.stat(d), os.stat(os.path.dirname(d))
    if dir_stat.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
        raise ProtocolError(
            ErrorCode.PERMISSION,
            f"{d} is writable by other users, so the daemon socket in it cannot be trusted: use a private directory (--socket)",
        )
    if me != 0:
        owners = {"socket": sock_stat.st_uid, "its directory": dir_stat.st_uid, "the directory above": parent_stat.st_uid}
        bad = {k: u for k, u in owners.items() if u not in (me, 0)}
    else:  # a service user's daemon (systemd's /run/offloadctl): its own directory under root's
        bad = {
            k: u
            for k, u in (("its directory", dir_stat.st_uid), ("the directory above", parent_stat.st_uid))
            if u not in (0, sock_stat.st_uid) or (k == "the directory above" and u != 0)
        }
    if bad:
        what, uid = next(iter(bad.items()))
        raise ProtocolError(
            ErrorCode.PERMISSION,
            f"the daemon socket {path}: {what} belongs to uid {uid}, not to you "
            f"or root, so another user could have put it there; not trusted: "
            f"use your own --socket",
        )


def check_daemon_peer(sock: socket.socket, path: str) -> None:
    """The process serving ``sock`` runs as us or root (or, for root, as the socket's owner)."""
    _pid, uid, _gid = struct.unpack("3i", sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i")))
    me = os.geteuid()
    allowed = (me, 0) if me != 0 else (0, os.lstat(path).st_uid)
    if uid not in allowed:
        raise ProtocolError(
            ErrorCode.PERMISSION,
            f"the process serving {path} runs as uid {uid}, not as you or root: not trusted; use your own --socket",
        )


def connect_daemon(path: str, timeout_s: float) -> socket.socket:
    """A connected socket to a trusted daemon at ``path`` (:func:`check_daemon_socket`,
    :func:`check_daemon_peer`); ``OSError`` when nothing listens there."""
    check_daemon_socket(path)
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        sock.settimeout(timeout_s)
        sock.connect(path)
        check_daemon_peer(sock, path)
    except BaseException:
        sock.close()
        raise
    return sock


class Connection:
    """A blocking request/reply client (the CLI and ``tuner.service``); pushes are skipped.

    Raises ``OSError`` when nothing listens at ``path`` and :class:`ProtocolError` for an
    ``error`` reply.
    """

    def __init__(self, path: str, *, role: str = "cli", timeout_s: float = 5.0, client: str = "offloadctl") -> None:
        self.path = path
        self.sock = connect_daemon(path, timeout_s)
        self._next_id = 0
        try:
            self.welcome = self.request("hello", api=API_VERSION, role=role, client=client)
        except BaseException:
            self.sock.close()
            raise

    def request(self, type: str, **fields: Any) -> dict[str, Any]:
        self._next_id += 1
        rid = self._next_id
        self.sock.sendall(encode({"v": API_VERSION, "type": type, "id": rid, **fields}))
        deadline = time.monotonic() + (self.sock.gettimeout() or 5.0)
        while True:
            reply = recv_message(self.sock)
            if reply.get("type") == "error" and reply.get("id") in (rid, None):
                raise ProtocolError(reply.get("code", ErrorCode.INTERNAL), str(reply.get("message")))
            if reply.get("id") == rid:
                return validate(reply, SERVER_SCHEMAS)
            if time.monotonic() > deadline:
                raise TimeoutError(f"no reply to {type!r} from the tuner daemon at {self.path}")

    def close(self) -> None:
        self.sock.close()

    def __enter__(self) -> "Connection":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
