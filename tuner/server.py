"""The tuner daemon: many runs, many ranks per run, one asyncio loop, stdlib only.

Each connection is a coroutine that reads frames with deadlines (a client that trickles bytes,
or never says ``hello``, is dropped without holding anyone else up) and handles each message
synchronously on the loop, so run state needs no locks. Replies and pushes are written without
waiting for the peer to read; a peer whose unread output passes a bound is dropped.

Per run, once every rank has reported iteration *i*, the ranks' telemetry is aggregated into a
``tuner.policy.Observation`` (the slowest rank's times, the sum of the ranks' bandwidths) and
given to the run's policy. A decision is pushed to every rank with ``apply_at``, an iteration
far enough ahead that all ranks have the message before they reach it, so every rank switches
at the same iteration. One run's state, policy or client failing never touches another run.
"""
from __future__ import annotations

import asyncio
import errno
import json
import logging
import math
import os
import resource
import signal
import socket
import stat
import statistics
import struct
import time
import uuid
from collections import deque
from dataclasses import dataclass, field
from typing import Any, Callable

from engine.config import Knobs
from engine.errors import ConfigError

from offloadctl import __version__
from tuner.protocol import (API_VERSION, CLIENT_SCHEMAS, HEADER, MAX_FRAME_BYTES, ROLES, ErrorCode, ProtocolError,
                       check_length, decode, encode, knobs_from_dict, validate)
from tuner.service import private_dir

log = logging.getLogger("offloadctl.tuner")

SD_LISTEN_FDS_START = 3


@dataclass(frozen=True, kw_only=True)
class ServerConfig:
    """Settings of one daemon. Times in seconds."""

    socket_path: str
    """Where to listen (ignored when systemd passes a listening socket)."""
    max_frame_bytes: int = MAX_FRAME_BYTES
    """Largest frame accepted; a longer header closes the connection before the body is read."""
    frame_timeout_s: float = 10.0
    """Once a frame's first byte arrives, the whole frame must arrive within this."""
    handshake_timeout_s: float = 10.0
    """A new connection must complete ``hello`` within this."""
    max_connections: int = 1024
    """Connections beyond this are refused with error BUSY (and never more than the open-file
    limit allows, less 64)."""
    max_runs: int = 1024
    """Runs kept at once. A new run past it replaces the oldest finished or vanished one; with
    every one running, it is refused with BUSY. Bounds the daemon's memory whatever clients do."""
    max_outbuf_bytes: int = 4 << 20
    """A peer that leaves more than this of our replies unread is dropped."""
    margin_s: float = 0.5
    """Time a knob change is given to reach every rank: ``apply_at`` is at least this many
    seconds of iterations ahead of the furthest rank."""
    min_margin: int = 2
    """``apply_at`` is at least this many iterations past the furthest rank's last report."""
    max_margin: int = 1000
    window: int = 16
    """Iterations kept waiting for a slow rank; older ones are aggregated over the ranks that
    reported, so one stuck rank neither stalls tuning nor grows memory."""
    history_points: int = 600
    """Per run, iteration times kept for the live view."""
    finished_keep_s: float = 600.0
    """Finished runs stay listed this long; runs whose ranks all vanished without ``bye``
    are kept this long for them to reconnect."""
    sensor_interval_s: float = 1.0
    """Minimum time between two sensor samples of one run."""
    summary_interval_s: float = 30.0
    """Time between two points of a run written to the history database."""
    owner_pid: int | None = None
    """A private daemon's owner (the ``offloadctl train`` that started it): the daemon stops
    once that process is gone, however it ended. None: it serves until told to stop."""
    idle_exit_s: float | None = None
    """Stop after this long with no run connected. None: never."""

    def __post_init__(self) -> None:
        if not isinstance(self.socket_path, str) or not self.socket_path:
            raise ConfigError(f"ServerConfig.socket_path must be a path, got {self.socket_path!r}")
        if self.idle_exit_s is not None and not (isinstance(self.idle_exit_s, (int, float)) and self.idle_exit_s > 0
                                                 and math.isfinite(self.idle_exit_s)):
            raise ConfigError(f"ServerConfig.idle_exit_s must be a positive number of seconds, got {self.idle_exit_s!r}")
        for name in ("frame_timeout_s", "handshake_timeout_s", "margin_s", "finished_keep_s", "sensor_interval_s",
                     "summary_interval_s"):
            v = getattr(self, name)
            if not (isinstance(v, (int, float)) and v > 0 and math.isfinite(v)):
                raise ConfigError(f"ServerConfig.{name} must be a positive number of seconds, got {v!r}")
        for name in ("max_frame_bytes", "max_connections", "max_outbuf_bytes", "min_margin", "max_margin", "window",
                     "history_points", "max_runs"):
            v = getattr(self, name)
            if not (isinstance(v, int) and not isinstance(v, bool) and v > 0):
                raise ConfigError(f"ServerConfig.{name} must be a positive integer, got {v!r}")


# -- state -----------------------------------------------------------------------------------------

class _Conn:
    """One client connection."""

    def __init__(self, writer: asyncio.StreamWriter, server: "TunerServer") -> None:
        self.writer = writer
        self.server = server
        self.role: str | None = None
        self.pid = self.uid = None
        self.ranks: set[tuple[str, int]] = set()
        self.closed = False
        self.expired = False
        sock = writer.get_extra_info("socket")
        try:
            self.pid, self.uid, _ = struct.unpack("3i", sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED,
                                                                         struct.calcsize("3i")))
        except OSError:
            pass

    def send(self, msg: dict) -> None:
        """Queue ``msg`` without waiting; drop the peer if it stopped reading."""
        if self.closed:
            return
        try:
            data = encode(msg, self.server.config.max_frame_bytes)
        except ProtocolError as e:  # a reply too large for a frame: say so instead
            data = encode(e.to_message(msg.get("id")))
        except (TypeError, ValueError, OverflowError, RecursionError) as e:  # not JSON (a NaN): never the peer's fault
            log.error("a reply of type %r could not be encoded: %s", msg.get("type"), e)
            data = encode(ProtocolError(ErrorCode.INTERNAL, f"the daemon could not encode its reply: {e}").to_message(
                msg.get("id")))
        self.writer.write(data)
        if self.writer.transport.get_write_buffer_size() > self.server.config.max_outbuf_bytes:
            log.warning("dropping client pid %s: %d bytes of replies unread", self.pid,
                        self.writer.transport.get_write_buffer_size())
            self.abort()

    def error(self, err: ProtocolError, req_id=None) -> None:
        self.send(err.to_message(req_id))

    def expire(self, why: str) -> None:
        """A deadline passed: say so, then close (after the error is written)."""
        self.expired = True
        self.error(ProtocolError(ErrorCode.TIMEOUT, why))
        self.closed = True
        self.writer.transport.close()

    def abort(self) -> None:
        if not self.closed:
            self.closed = True
            self.writer.transport.abort()


@dataclass
class _Rank:
    conn: _Conn | None
    iteration: int = -1
    iter_time_s: float | None = None
    bye: bool = False


@dataclass
class _Run:
    run_id: str
    world_size: int
    params: int
    paths: tuple[str, ...]
    profile: Any
    has_device: bool
    subgroup_bytes: int
    knobs: Knobs
    """The run's knobs: the latest change pushed (in force once its ``apply_at`` is reached)."""
    knobs_dict: dict = field(default_factory=dict)  # knobs.to_dict(), kept up to date: asdict is slow
    policy: Any = None
    sensors: Any = None
    ranks: dict[int, _Rank] = field(default_factory=dict)
    started_at: float = field(default_factory=time.time)
    status: str = "running"          # running | disconnected | finished
    ended_at: float | None = None
    seq: int = 0                     # number of knob changes pushed
    apply_at: int | None = None      # of the latest change
    reason: str = ""                 # of the latest change
    max_iteration: int = -1          # furthest iteration any rank reported (or registered at)
    last_observed: int = -1          # latest iteration given to the policy
    pending: dict[int, dict[int, dict]] = field(default_factory=dict)  # iteration -> rank -> telemetry
    frozen: bool = False
    pins: dict[str, Any] = field(default_factory=dict)
    headroom: dict[int, int | None] = field(default_factory=dict)
    error: str | None = None         # an event to pass with the next observation
    policy_error: str | None = None
    in_force: dict | None = None     # knobs of the latest observed iteration, as the engines report them
    in_force_since: int = 0          # first iteration observed under them
    start_change: tuple[Knobs, str] | None = None  # from the history, pushed once all ranks registered
    history: deque = field(default_factory=deque)   # (iteration, iter_time_s, update_s)
    phases: dict = field(default_factory=dict)
    bandwidth: dict = field(default_factory=dict)
    sensor_sample: dict | None = None
    sensor_bytes: dict = field(default_factory=dict)  # our bytes per path since the last sample
    sensor_at: float = 0.0
    summary_at: float = 0.0
    decisions: deque = field(default_factory=lambda: deque(maxlen=200))
    events: deque = field(default_factory=lambda: deque(maxlen=100))
    applied: dict[int, dict[int, int]] = field(default_factory=dict)  # seq -> rank -> iteration applied

    def __post_init__(self) -> None:
        self.knobs_dict = self.knobs.to_dict()

    def connected(self) -> int:
        return sum(1 for r in self.ranks.values() if r.conn is not None)


# -- the server ------------------------------------------------------------------------------------

def _default_policy_factory(start: Knobs, **kw):
    from tuner.policy import Policy

    return Policy(start, **kw)


def _default_sensors_factory(paths):
    from tuner.sensors import Sensors

    return Sensors(paths)


class TunerServer:
    """The daemon's state and its listening socket; :func:`serve` runs one.

    ``policy_factory(start_knobs, paths=, has_device=, subgroup_bytes=, device_headroom_bytes=,
    profile=, params=, ranks=)`` makes one run's policy (default ``tuner.policy.Policy``);
    ``sensors_factory(paths)`` its sensors (default ``tuner.sensors.Sensors``; False: none);
    ``history`` is a ``tuner.history.History`` or None.
    """

    def __init__(self, config: ServerConfig, *, policy_factory: Callable | None = None,
                 sensors_factory: Callable | None | bool = None, history=None) -> None:
        self.config = config
        self.policy_factory = policy_factory or _default_policy_factory
        self.sensors_factory = _default_sensors_factory if sensors_factory is None else sensors_factory
        self.history = history
        self.runs: dict[str, _Run] = {}
        self.conns: set[_Conn] = set()
        self.server_id = uuid.uuid4().hex[:16]
        self.started_at = time.time()
        self._server: asyncio.AbstractServer | None = None
        self._stop: asyncio.Event | None = None
        self._inherited = False
        self.heap: _Heap | None = None  # set by serve(): glibc heap settings of the daemon process
        self._sock_ino: tuple[int, int] | None = None
        self._tasks: set[asyncio.Task] = set()
        self.messages = 0
        """Messages handled without error."""
        self._handle_s: deque[float] = deque(maxlen=10_000)  # recent handling times, for daemon_view
        self.max_connections = config.max_connections  # lowered to fit the open-file limit at start

    # -- lifecycle ---------------------------------------------------------------------------

    async def start(self) -> None:
        self._stop = asyncio.Event()
        soft = raise_fd_limit()
        # Below the descriptor limit, with room for the daemon's own files: a client past it
        # gets BUSY, never an accept() that fails (and asyncio's log line per retry).
        self.max_connections = max(1, min(self.config.max_connections, soft - min(FD_RESERVE, soft // 2)))
        if self.max_connections < self.config.max_connections:
            log.info("serving at most %d connections (open-file limit %d)", self.max_connections, soft)
        logging.getLogger("asyncio").addFilter(_quiet_accept_errors)
        sock = _inherited_socket()
        if sock is not None:
            self._inherited = True
            log.info("listening on a socket passed by systemd (%s)", sock.getsockname() or "unnamed")
        else:
            sock = bind_socket(self.config.socket_path)
            st = os.stat(self.config.socket_path)
            self._sock_ino = (st.st_dev, st.st_ino)
            log.info("listening on %s", self.config.socket_path)
        self._server = await asyncio.start_unix_server(self._on_connect, sock=sock)
        self._spawn(self._housekeeping())

    def request_stop(self) -> None:
        if self._stop is not None:
            self._stop.set()

    async def serve_until_stopped(self) -> None:
        await self._stop.wait()
        await self.close()

    async def close(self) -> None:
        if self._server is not None:
            self._server.close()
        for c in list(self.conns):
            c.abort()
        for t in list(self._tasks):
            t.cancel()
        if self._server is not None and not self._inherited:
            self._remove_socket_file()
        self._server = None

    def _remove_socket_file(self) -> None:
        """Unlink our socket, but not one a newer daemon has bound since."""
        try:
            st = os.lstat(self.config.socket_path)
            if (st.st_dev, st.st_ino) == self._sock_ino:
                os.unlink(self.config.socket_path)
        except FileNotFoundError:
            pass

    def _spawn(self, coro) -> None:
        t = asyncio.get_running_loop().create_task(coro)
        self._tasks.add(t)
        t.add_done_callback(self._tasks.discard)

    async def _housekeeping(self) -> None:
        """Forget finished runs after ``finished_keep_s``; end runs whose ranks never came back;
        stop when the owner is gone or nothing ran for ``idle_exit_s``."""
        idle_since = time.monotonic()
        while True:
            await asyncio.sleep(min(1.0 if self.config.owner_pid else 5.0, self.config.finished_keep_s / 2))
            if self.config.owner_pid and not _alive(self.config.owner_pid):
                log.info("owner pid %d is gone: stopping", self.config.owner_pid)
                self.request_stop()
                return
            if any(r.status == "running" for r in self.runs.values()) or self.conns:
                idle_since = time.monotonic()
            elif self.config.idle_exit_s and time.monotonic() - idle_since > self.config.idle_exit_s:
                log.info("no run for %.0f s: stopping", self.config.idle_exit_s)
                self.request_stop()
                return
            if self.heap is not None:
                self.heap.trim()
            now = time.time()
            for run in list(self.runs.values()):
                # A run that never reported an iteration has nothing to show or to resume: it
                # goes after a minute (clients that only register must not pile up).
                keep = self.config.finished_keep_s if run.max_iteration >= 0 else min(60.0, self.config.finished_keep_s)
                if run.status != "running" and now - (run.ended_at or now) > keep:
                    if run.status == "disconnected":
                        log.info("run %s: no rank came back in %.0f s; forgetting it", run.run_id, now - run.ended_at)
                    del self.runs[run.run_id]
                    _close_sensors(run)

    # -- connections -------------------------------------------------------------------------

    async def _on_connect(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        conn = _Conn(writer, self)
        try:
            if conn.uid is None or conn.uid not in (os.geteuid(), 0):
                log.warning("refused a client of uid %s (pid %s): only uid %d and root may connect",
                            conn.uid, conn.pid, os.geteuid())
                conn.error(ProtocolError(ErrorCode.PERMISSION, f"uid {conn.uid} may not use this daemon: only uid "
                                         f"{os.geteuid()} and root may; run as that user or start your own daemon"))
                return
            if len(self.conns) >= self.max_connections:
                conn.error(ProtocolError(ErrorCode.BUSY, f"the daemon already serves {len(self.conns)} connections"))
                return
            self.conns.add(conn)
            await self._serve_conn(conn, reader)
        except Exception:  # a bug handling one client must not take the daemon down
            log.exception("client pid %s: internal error; connection closed", conn.pid)
        finally:
            self.conns.discard(conn)
            self._detach(conn)
            if not conn.closed:
                conn.closed = True
                try:
                    await asyncio.wait_for(writer.drain(), 1.0)  # flush a final error reply
                except Exception:
                    pass
                writer.close()

    async def _serve_conn(self, conn: _Conn, reader: asyncio.StreamReader) -> None:
        while not conn.closed:
            try:
                body = await self._read_frame(conn, reader)
            except ProtocolError as e:
                conn.error(e)
                return
            if body is None:
                return
            req_id = None
            t0 = time.perf_counter()
            try:
                msg = decode(body)
                req_id = msg.get("id") if isinstance(msg.get("id"), (int, str)) else None
                validate(msg, CLIENT_SCHEMAS)
                self._dispatch(conn, msg)
                self.messages += 1
                self._handle_s.append(time.perf_counter() - t0)
            except ProtocolError as e:
                conn.error(e, req_id)
                if e.code in (ErrorCode.VERSION, ErrorCode.HANDSHAKE):
                    return
            except Exception as e:
                log.exception("client pid %s: failed handling a message", conn.pid)
                conn.error(ProtocolError(ErrorCode.INTERNAL, f"daemon failed on this message: {e}"), req_id)

    async def _read_frame(self, conn: _Conn, reader: asyncio.StreamReader) -> bytes | None:
        """One frame's body, or None when the connection ended (cleanly, or by a deadline).

        Deadlines are timers that close the connection, not ``wait_for`` (a task per read):
        ``hello`` must be complete within ``handshake_timeout_s`` of connecting, and every
        frame within ``frame_timeout_s`` of its first byte. Waiting for a first byte is free."""
        loop = asyncio.get_running_loop()
        timer = None
        if conn.role is None:
            timer = loop.call_later(self.config.handshake_timeout_s, conn.expire,
                                    f"no hello within {self.config.handshake_timeout_s:g} s")
        try:
            try:
                first = await reader.readexactly(1)
            except (asyncio.IncompleteReadError, ConnectionError):
                return None
            if timer is None:
                timer = loop.call_later(self.config.frame_timeout_s, conn.expire,
                                        f"frame not complete within {self.config.frame_timeout_s:g} s")
            try:
                (n,) = HEADER.unpack(first + await reader.readexactly(HEADER.size - 1))
                check_length(n, self.config.max_frame_bytes)  # before reading the body
                return await reader.readexactly(n)
            except (asyncio.IncompleteReadError, ConnectionError):
                if conn.expired:
                    return None
                raise ProtocolError(ErrorCode.BAD_FRAME, "connection ended inside a frame") from None
        finally:
            if timer is not None:
                timer.cancel()

    def _dispatch(self, conn: _Conn, msg: dict) -> None:
        kind = msg["type"]
        if conn.role is None:
            if kind != "hello":
                raise ProtocolError(ErrorCode.HANDSHAKE, f"the first message must be hello, got {kind!r}")
            if msg["api"] != API_VERSION:
                raise ProtocolError(ErrorCode.VERSION, f"client speaks API {msg['api']}; this daemon speaks "
                                    f"{API_VERSION}: use the same offloadctl version for both")
            conn.role = msg["role"]
            conn.send({"v": API_VERSION, "type": "welcome", "id": msg.get("id"), "api": API_VERSION,
                       "server": __version__, "server_id": self.server_id, "pid": os.getpid(),
                       "started_at": self.started_at})
            return
        if kind == "hello":
            raise ProtocolError(ErrorCode.HANDSHAKE, "hello was already received on this connection")
        if kind not in ROLES[conn.role]:
            raise ProtocolError(ErrorCode.ROLE, f"{kind!r} is not allowed for a {conn.role} client")
        reply = getattr(self, "_on_" + kind)(conn, msg)
        if msg.get("id") is not None:
            reply = reply or {"type": "ok"}
            conn.send({"v": API_VERSION, "id": msg["id"], **reply})

    # -- engine messages ---------------------------------------------------------------------

    def _on_ping(self, conn, msg):
        return {"type": "pong"}

    def _on_register(self, conn: _Conn, msg: dict) -> dict:
        run_id, rank, world = msg["run_id"], msg["rank"], msg["world_size"]
        if rank >= world:
            raise ProtocolError(ErrorCode.BAD_VALUE, f"rank {rank} is not below world_size {world}")
        knobs = knobs_from_dict(msg["knobs"])
        paths = tuple(msg["paths"])
        _check_knobs_for(knobs, paths, msg["has_device"])
        run = self.runs.get(run_id)
        if run is not None and run.status == "finished":
            run = None  # a run id used again after its end: a new run
        if run is None:
            run = self._new_run(msg, knobs, paths)
        elif run.world_size != world:
            raise ProtocolError(ErrorCode.BAD_VALUE, f"run {run_id} has world_size {run.world_size}, but rank {rank} "
                                f"says {world}: give each run its own run_id")
        old = run.ranks.get(rank)
        if old is not None and old.conn is not None and old.conn is not conn:
            old.conn.ranks.discard((run_id, rank))  # a reconnect before we noticed the old one die
        run.ranks[rank] = _Rank(conn, iteration=max(msg.get("iteration", 0) - 1, old.iteration if old else -1))
        run.headroom[rank] = msg.get("device_headroom_bytes")
        run.max_iteration = max(run.max_iteration, run.ranks[rank].iteration)
        run.status, run.ended_at = "running", None
        conn.ranks.add((run_id, rank))
        log.info("run %s: rank %d/%d registered (pid %s)", run_id, rank, world, conn.pid)
        if run.start_change is not None and run.connected() == run.world_size:
            (start, reason), run.start_change = run.start_change, None
            self._change(run, start, reason, source="history")
            return {"type": "registered", "run_id": run_id, "rank": rank}
        if knobs != run.knobs:
            if run.seq and run.apply_at > run.max_iteration:
                # A change no rank has reached yet: this rank takes it at the same iteration as the others.
                conn.send(self._knobs_message(run))
            else:
                log.warning("run %s: rank %d registered with knobs %s, not the run's %s; resynchronizing every rank",
                            run_id, rank, knobs.to_dict(), run.knobs_dict)
                self._change(run, run.knobs, f"rank {rank} registered with other knobs; every rank takes the run's",
                             source="resync")
        return {"type": "registered", "run_id": run_id, "rank": rank}

    def _new_run(self, msg: dict, knobs: Knobs, paths: tuple[str, ...]) -> _Run:
        if len(self.runs) >= self.config.max_runs:
            idle = [r for r in self.runs.values() if r.status != "running"]
            if not idle:
                raise ProtocolError(ErrorCode.BUSY, f"the daemon already tunes {len(self.runs)} running runs: start "
                                    f"this one with --tuner off, or another daemon (--tuner SOCKET)")
            oldest = min(idle, key=lambda r: r.ended_at or 0.0)
            log.info("run %s: forgotten to make room for run %s", oldest.run_id, msg["run_id"])
            del self.runs[oldest.run_id]
            _close_sensors(oldest)
        run = _Run(run_id=msg["run_id"], world_size=msg["world_size"], params=msg["params"], paths=paths,
                   profile=msg.get("profile"), has_device=msg["has_device"], subgroup_bytes=msg["subgroup_bytes"],
                   knobs=knobs, history=deque(maxlen=self.config.history_points))
        self.runs[run.run_id] = run
        start, from_history = knobs, None
        if self.history is not None:
            try:
                best = self.history.best_knobs(run.profile, run.params, run.world_size, paths=list(paths))
                if best is not None and best != knobs:
                    _check_knobs_for(best, paths, run.has_device)
                    start = from_history = best
            except Exception as e:  # history is advice; a bad entry must not stop the run
                log.warning("run %s: history not used: %s", run.run_id, e)
        try:
            run.policy = self.policy_factory(start, paths=list(paths), has_device=run.has_device,
                                             subgroup_bytes=run.subgroup_bytes,
                                             device_headroom_bytes=msg.get("device_headroom_bytes"),
                                             profile=run.profile, params=run.params, ranks=run.world_size)
        except Exception as e:
            run.policy_error = f"policy failed to start: {e}"
            log.exception("run %s: policy failed to start; the run keeps its knobs", run.run_id)
        if self.sensors_factory and paths:
            try:
                run.sensors = self.sensors_factory(list(paths))
            except Exception as e:
                log.warning("run %s: no sensors: %s", run.run_id, e)
        run.sensor_at = time.monotonic()
        log.info("run %s: new, %d rank(s), %d params, paths %s", run.run_id, run.world_size, run.params, list(paths))
        if from_history is not None:  # pushed once every rank is here to take it at the same iteration
            run.start_change = (from_history, "best knobs of earlier runs with the same profile, size and ranks")
        self._restore_controls(run, knobs)
        return run

    def _restore_controls(self, run: _Run, knobs: Knobs) -> None:
        """The user's pins and freeze of this run, saved before a daemon restart: put them back."""
        saved = None
        if self.history is not None:
            try:
                saved = self.history.controls(run.run_id)
            except Exception as e:
                log.warning("run %s: saved pins not read: %s", run.run_id, e)
        if not saved:
            return
        pins, frozen = saved
        try:
            if self._policy_ok(run):
                for knob, value in pins.items():
                    run.policy.pin(knob, value)
                if frozen:
                    run.policy.freeze(True)
                target, run.pins = run.policy.knobs, run.policy.pins
            else:
                target = knobs
                for knob, value in pins.items():
                    target = target.replace(**{knob: value})
                run.pins = dict(pins)
            _check_knobs_for(target, run.paths, run.has_device)
        except (ConfigError, ProtocolError, TypeError) as e:
            log.warning("run %s: saved pins %s not restored: %s", run.run_id, pins, e)
            return
        run.frozen = frozen
        log.info("run %s: restored the user's pins %s%s", run.run_id, pins, " and freeze" if frozen else "")
        if target != knobs:
            run.start_change = (target, "the user's pins, restored after a daemon restart")

    def _save_controls(self, run: _Run) -> None:
        if self.history is not None:
            try:
                self.history.save_controls(run.run_id, dict(run.pins), run.frozen)
            except Exception as e:
                log.warning("run %s: pins not saved: %s", run.run_id, e)

    def _rank_of(self, conn: _Conn, msg: dict) -> tuple[_Run, _Rank]:
        key = (msg["run_id"], msg["rank"])
        run = self.runs.get(key[0])
        if key not in conn.ranks or run is None:
            raise ProtocolError(ErrorCode.UNKNOWN_RUN, f"run {key[0]} rank {key[1]} is not registered on this "
                                "connection: send register first")
        return run, run.ranks[key[1]]

    def _on_telemetry(self, conn: _Conn, msg: dict) -> None:
        run, rank = self._rank_of(conn, msg)
        i = msg["iteration"]
        rank.iteration = max(rank.iteration, i)
        if msg.get("iter_time_s") is not None:
            rank.iter_time_s = msg["iter_time_s"]
        if "device_headroom_bytes" in msg:
            run.headroom[msg["rank"]] = msg["device_headroom_bytes"]
        run.max_iteration = max(run.max_iteration, i)
        if i <= run.last_observed:
            return  # late: its iteration was already aggregated without it
        run.pending.setdefault(i, {})[msg["rank"]] = msg
        self._aggregate_ready(run)

    def _on_event(self, conn: _Conn, msg: dict) -> None:
        run, _ = self._rank_of(conn, msg)
        run.error = msg["kind"] if msg["kind"] == "oom" else msg["message"]
        run.events.append({"time": time.time(), "rank": msg["rank"], "kind": msg["kind"], "message": msg["message"]})
        log.warning("run %s rank %d: %s: %s", run.run_id, msg["rank"], msg["kind"], msg["message"])

    def _on_applied(self, conn: _Conn, msg: dict) -> None:
        run, _ = self._rank_of(conn, msg)
        run.applied.setdefault(msg["seq"], {})[msg["rank"]] = msg["iteration"]
        while len(run.applied) > 64:
            del run.applied[min(run.applied)]
        if msg["iteration"] > msg["apply_at"]:
            log.warning("run %s rank %d: change #%d applied late, at iteration %d instead of %d", run.run_id,
                        msg["rank"], msg["seq"], msg["iteration"], msg["apply_at"])
            run.events.append({"time": time.time(), "rank": msg["rank"], "kind": "late",
                               "message": f"change #{msg['seq']} applied at iteration {msg['iteration']}, "
                                          f"not {msg['apply_at']}"})

    def _on_bye(self, conn: _Conn, msg: dict) -> None:
        run, rank = self._rank_of(conn, msg)
        rank.bye = True
        rank.conn = None
        conn.ranks.discard((run.run_id, msg["rank"]))
        self._maybe_end(run)

    def _detach(self, conn: _Conn) -> None:
        """A connection ended: its ranks are gone until they register again."""
        for run_id, r in conn.ranks:
            run = self.runs.get(run_id)
            if run is not None and r in run.ranks and run.ranks[r].conn is conn:
                run.ranks[r].conn = None
                log.info("run %s: rank %d disconnected", run_id, r)
                self._maybe_end(run)
        conn.ranks.clear()

    def _maybe_end(self, run: _Run) -> None:
        if run.connected():
            return
        run.ended_at = time.time()
        if len(run.ranks) == run.world_size and all(r.bye for r in run.ranks.values()):
            run.status = "finished"
            self._aggregate_ready(run, flush=True)
            log.info("run %s: finished at iteration %d with knobs %s", run.run_id, run.max_iteration,
                     run.in_force or run.knobs_dict)
            self._record_history(run)
            _close_sensors(run)
        else:
            run.status = "disconnected"

    def _record_history(self, run: _Run) -> None:
        """The knobs the run ended with (as the engines reported them) and their iteration time."""
        if self.history is None or not run.history:
            return
        times = [t if t is not None else u for i, t, u in run.history if i >= run.in_force_since]
        try:
            knobs = knobs_from_dict(run.in_force) if run.in_force else run.knobs
            self.history.record_run(run.run_id, run.profile, run.params, run.world_size, knobs,
                                    statistics.median(times) if times else None, paths=list(run.paths))
        except Exception as e:
            log.warning("run %s: not recorded in the history: %s", run.run_id, e)

    # -- aggregation and decisions -----------------------------------------------------------

    def _aggregate_ready(self, run: _Run, flush: bool = False) -> None:
        """Observe every iteration that all ranks reported, in order; and older ones anyway.

        Nothing is decided while a rank is away (a change could not reach it): iterations wait,
        and those older than the window are dropped. ``flush`` (the run ended) records what is
        left without asking the policy."""
        if not flush and run.connected() < run.world_size:
            for i in [i for i in run.pending if i < run.max_iteration - self.config.window]:
                del run.pending[i]
            return
        for i in sorted(run.pending):
            got = run.pending[i]
            complete = len(got) >= run.world_size
            stale = i < run.max_iteration - self.config.window
            if not (complete or stale or flush):
                break
            del run.pending[i]
            run.last_observed = i
            self._observe(run, i, list(got.values()), decide=not flush)

    def _observe(self, run: _Run, i: int, msgs: list[dict], decide: bool = True) -> None:
        recs = [m["record"] for m in msgs]
        times = [m["iter_time_s"] for m in msgs if m.get("iter_time_s") is not None]
        iter_time = max(times) if times else None
        update_s = max(r["wall_s"] for r in recs)
        read_bw: dict[str, float] = {}
        write_bw: dict[str, float] = {}
        for r in recs:
            if r["wall_s"] >= 1e-6:  # a shorter update is no measurement: rates from it would be noise or infinite
                for p, b in r.get("path_bytes_read", {}).items():
                    read_bw[p] = read_bw.get(p, 0.0) + b / r["wall_s"]
                for p, b in r.get("path_bytes_written", {}).items():
                    write_bw[p] = write_bw.get(p, 0.0) + b / r["wall_s"]
            for key in ("path_bytes_read", "path_bytes_written"):
                for p, b in r.get(key, {}).items():
                    run.sensor_bytes[p] = run.sensor_bytes.get(p, 0) + b
        other = self._sample_sensors(run)
        headrooms = [h for h in run.headroom.values() if h is not None]
        phases = {"update_s": update_s, "read_wait_s": max(r["read_wait_s"] for r in recs),
                  "write_wait_s": max(r["write_wait_s"] for r in recs), "compute_s": max(r["update_s"] for r in recs)}
        run.history.append((i, iter_time, update_s))
        run.phases = {"iteration": i, "iter_time_s": iter_time, **phases, "ranks_reported": len(msgs)}
        run.bandwidth = {p: {"read_bytes_per_s": read_bw.get(p, 0.0), "write_bytes_per_s": write_bw.get(p, 0.0),
                             "other_bytes_per_s": other.get(p), "concurrency": run.knobs.concurrency_for(p)}
                         for p in run.paths}
        # The knobs this iteration ran under; when ranks disagree (a late change), the odd one,
        # so that the policy does not take the mix for a measurement of its knobs.
        in_force = [r.get("knobs") for r in recs if r.get("knobs")]
        in_force = next((k for k in in_force if k != run.knobs_dict), in_force[0] if in_force else None)
        if in_force is not None and in_force != run.in_force:
            run.in_force, run.in_force_since = in_force, i
        self._maybe_summarize(run, i, iter_time, update_s)
        if not decide or run.policy is None or run.policy_error:
            return
        try:
            from tuner.policy import Observation

            obs = Observation(iteration=i, iter_time_s=iter_time, update_s=update_s,
                              read_wait_s=phases["read_wait_s"], write_wait_s=phases["write_wait_s"],
                              path_read_bytes_per_s=read_bw, path_write_bytes_per_s=write_bw,
                              path_other_bytes_per_s={p: v for p, v in other.items() if v is not None},
                              device_headroom_bytes=min(headrooms) if headrooms else None, error=run.error,
                              knobs=in_force, **_lane_figures(recs))
            run.error = None
            decision = run.policy.observe(obs)
        except Exception as e:
            run.policy_error = f"{type(e).__name__}: {e}"
            log.exception("run %s: policy failed at iteration %d; the run keeps knobs %s", run.run_id, i,
                          run.knobs_dict)
            return
        if decision is None:
            return
        try:
            _check_knobs_for(decision.knobs, run.paths, run.has_device)
        except ProtocolError as e:
            run.policy_error = f"policy proposed unusable knobs: {e}"
            log.error("run %s: %s", run.run_id, run.policy_error)
            return
        if decision.knobs != run.knobs:
            self._change(run, decision.knobs, decision.reason, source="policy")

    def _maybe_summarize(self, run: _Run, i: int, iter_time: float | None, update_s: float) -> None:
        """A point in the history database every ``summary_interval_s``: how the run went over time."""
        now = time.monotonic()
        if self.history is None or now - run.summary_at < self.config.summary_interval_s:
            return
        run.summary_at = now
        try:
            self.history.record_summary(run.run_id, i, iter_time, update_s, run.knobs)
        except Exception as e:
            log.warning("run %s: summary not recorded in the history: %s", run.run_id, e)

    def _sample_sensors(self, run: _Run) -> dict[str, float | None]:
        """Other processes' traffic per path, sampled at most every ``sensor_interval_s``."""
        now = time.monotonic()
        if run.sensors is not None and now - run.sensor_at >= self.config.sensor_interval_s:
            ours = {p: b / (now - run.sensor_at) for p, b in run.sensor_bytes.items()}
            run.sensor_bytes, run.sensor_at = {}, now
            try:
                run.sensor_sample = run.sensors.sample(ours)
            except Exception as e:
                log.warning("run %s: sensors failed, disabled for this run: %s", run.run_id, e)
                run.sensors = None
        paths = (run.sensor_sample or {}).get("paths", {})
        return {p: (paths.get(p) or {}).get("other_bytes_per_s") for p in run.paths}

    def _margin(self, run: _Run) -> int:
        """Iterations ahead for ``apply_at``: ``margin_s`` worth of recent iterations, at least min_margin."""
        recent = [t if t is not None else u for _, t, u in list(run.history)[-8:]]
        recent = [t for t in recent if t and t > 0]
        if not recent:
            return self.config.min_margin
        n = math.ceil(self.config.margin_s / statistics.median(recent))
        return max(self.config.min_margin, min(n, self.config.max_margin))

    def _change(self, run: _Run, knobs: Knobs, reason: str, *, source: str) -> None:
        """Push ``knobs`` to every rank of ``run``, to apply at one iteration all ranks reach later."""
        run.seq += 1
        run.apply_at = max(run.max_iteration, 0) + self._margin(run)
        run.knobs, run.knobs_dict, run.reason = knobs, knobs.to_dict(), reason
        run.decisions.append({"time": time.time(), "iteration": run.max_iteration, "seq": run.seq,
                              "apply_at": run.apply_at, "knobs": run.knobs_dict, "reason": reason, "source": source})
        log.info("run %s: iteration %d: change #%d at iteration %d (%s): %s; knobs %s", run.run_id, run.max_iteration,
                 run.seq, run.apply_at, source, reason, run.knobs_dict)
        msg = self._knobs_message(run)
        for r in run.ranks.values():
            if r.conn is not None:
                r.conn.send(msg)

    @staticmethod
    def _knobs_message(run: _Run) -> dict:
        return {"v": API_VERSION, "type": "knobs", "run_id": run.run_id, "knobs": run.knobs_dict,
                "apply_at": run.apply_at, "seq": run.seq, "reason": run.reason}

    # -- cli messages ------------------------------------------------------------------------

    def _run_for_cli(self, msg: dict) -> _Run:
        run = self.runs.get(msg["run_id"])
        if run is None:
            raise ProtocolError(ErrorCode.UNKNOWN_RUN, f"no run {msg['run_id']!r}; runs: "
                                f"{', '.join(sorted(self.runs)) or 'none'}")
        if run.status == "finished":
            raise ProtocolError(ErrorCode.UNKNOWN_RUN, f"run {run.run_id} has finished")
        return run

    def _policy_ok(self, run: _Run) -> bool:
        return run.policy is not None and run.policy_error is None

    def _on_pin(self, conn: _Conn, msg: dict) -> dict:
        run = self._run_for_cli(msg)
        knob, value = msg["knob"], msg["value"]
        try:
            if self._policy_ok(run):  # the policy owns pins: it knows io_concurrency[PATH] and its trials
                run.policy.pin(knob, value)
                knobs, run.pins = run.policy.knobs, run.policy.pins
            else:
                knobs = run.knobs.replace(**{knob: value})
                run.pins[knob] = value
        except (ConfigError, TypeError) as e:
            raise ProtocolError(ErrorCode.BAD_VALUE, f"cannot pin {knob}={value!r}: {e}") from None
        _check_knobs_for(knobs, run.paths, run.has_device)
        self._user_change(run, knobs, f"{knob} pinned to {value!r} by the user")
        self._save_controls(run)
        return {"type": "ok", "knobs": run.knobs_dict}

    def _on_unpin(self, conn: _Conn, msg: dict) -> dict:
        run = self._run_for_cli(msg)
        knob = msg["knob"]
        if self._policy_ok(run):
            try:
                run.policy.unpin(knob)
            except ConfigError as e:
                raise ProtocolError(ErrorCode.BAD_VALUE, str(e)) from None
            run.pins = run.policy.pins
        elif run.pins.pop(knob, None) is None:
            raise ProtocolError(ErrorCode.BAD_VALUE, f"knob {knob!r} is not pinned (pinned: {sorted(run.pins) or 'none'})")
        self._user_change(run, run.knobs, f"{knob} unpinned by the user")
        self._save_controls(run)
        return {"type": "ok", "knobs": run.knobs_dict}

    def _on_freeze(self, conn: _Conn, msg: dict) -> dict:
        run = self._run_for_cli(msg)
        run.frozen = msg["frozen"]
        knobs = run.knobs
        if self._policy_ok(run):
            run.policy.freeze(run.frozen)  # freezing mid-trial goes back to the last good knobs
            knobs = run.policy.knobs
        self._user_change(run, knobs, f"tuning {'frozen' if run.frozen else 'resumed'} by the user")
        self._save_controls(run)
        return {"type": "ok", "knobs": run.knobs_dict}

    def _user_change(self, run: _Run, knobs: Knobs, reason: str) -> None:
        """Push ``knobs`` now if they differ; log the request either way."""
        if knobs != run.knobs:
            self._change(run, knobs, reason, source="user")
            return
        log.info("run %s: %s", run.run_id, reason)
        run.decisions.append({"time": time.time(), "iteration": run.max_iteration, "seq": run.seq, "apply_at": None,
                              "knobs": run.knobs_dict, "source": "user", "reason": reason})

    def _on_shutdown(self, conn: _Conn, msg: dict) -> None:
        log.info("shutdown requested by pid %s", conn.pid)
        # Stop after this reply is written.
        asyncio.get_running_loop().call_later(0.05, self.request_stop)

    def _on_snapshot(self, conn: _Conn, msg: dict) -> dict:
        """Every run (or the one asked for), within one frame: a run whose view cannot be encoded
        or is too large for its share comes as a compact view, and runs beyond the frame are
        listed by id in ``omitted`` (ask for one with ``run_id``). One run never breaks the
        answer for the others."""
        n = msg.get("history", 60)
        budget = self.config.max_frame_bytes - 64 * 1024  # the daemon's view, ids of omitted runs, framing
        wanted = [r for r in self.runs.values() if msg.get("run_id") in (None, r.run_id)]
        share = max(budget // max(1, len(wanted)), 16 * 1024)
        runs, omitted, used = [], [], 0
        for r in wanted:
            view, size = self._encodable_view(r, n, share)
            if used + size > budget:
                omitted.append(r.run_id)
                continue
            runs.append(view)
            used += size
        out = {"type": "snapshot", "runs": runs, "daemon": self.daemon_view()}
        if omitted:
            out["omitted"] = omitted
        return out

    def _encodable_view(self, run: _Run, history: int, share: int) -> tuple[dict, int]:
        """``run``'s view and its encoded size; the compact view when the full one fails to
        encode or passes ``share`` bytes."""
        try:
            view = self.run_view(run, history)
            size = len(json.dumps(view, separators=(",", ":"), allow_nan=False))
            if size <= share:
                return view, size
            why = f"view of {size} bytes over this snapshot's share of {share}: ask for this run alone"
        except (TypeError, ValueError, OverflowError, RecursionError) as e:
            why = f"view could not be encoded ({e})"
            log.error("run %s: %s", run.run_id, why)
        view = {"run_id": run.run_id, "status": run.status, "ranks": run.world_size, "connected": run.connected(),
                "iteration": run.max_iteration, "iter_time_s": None, "knobs": {}, "truncated": why,
                "history": {"iteration": [], "iter_time_s": [], "update_s": []}, "paths": [], "decisions": [],
                "events": [], "phases": {}, "bandwidth": {}, "pins": {}, "frozen": run.frozen, "policy": None}
        return view, len(json.dumps(view))

    def daemon_view(self) -> dict:
        """The daemon itself; ``handle_ms``: time spent on each of the last 10,000 messages,
        from its frame read to its reply written (queueing in the kernel not included)."""
        recent = sorted(self._handle_s)
        pct = lambda q: 1e3 * recent[min(len(recent) - 1, int(len(recent) * q))] if recent else None
        return {"pid": os.getpid(), "api": API_VERSION, "version": __version__, "server_id": self.server_id,
                "started_at": self.started_at, "uptime_s": time.time() - self.started_at,
                "connections": len(self.conns), "socket": self.config.socket_path,
                "socket_activated": self._inherited, "messages": self.messages,
                "handle_ms": {"p50": pct(0.5), "p99": pct(0.99), "max": pct(1.0)}}

    def run_view(self, run: _Run, history: int = 60) -> dict:
        """What ``tune`` shows of a run; ``history`` bounds the per-iteration lists."""
        hist = list(run.history)[-history:] if history else []
        last = run.history[-1] if run.history else None
        iter_time = last[1] if last else max((r.iter_time_s for r in run.ranks.values() if r.iter_time_s), default=None)
        return {
            "run_id": run.run_id, "status": run.status, "ranks": run.world_size, "connected": run.connected(),
            "iteration": run.max_iteration, "iter_time_s": iter_time, "knobs": run.knobs_dict,
            "seq": run.seq, "apply_at": run.apply_at, "frozen": run.frozen, "pins": dict(run.pins),
            "params": run.params, "paths": list(run.paths), "has_device": run.has_device,
            "started_at": run.started_at, "ended_at": run.ended_at,
            "rank_iterations": {str(k): r.iteration for k, r in sorted(run.ranks.items())},
            "history": {"iteration": [h[0] for h in hist], "iter_time_s": [h[1] for h in hist],
                        "update_s": [h[2] for h in hist]},
            "phases": run.phases, "bandwidth": run.bandwidth, "sensors": run.sensor_sample,
            "decisions": list(run.decisions)[-20:], "events": list(run.events)[-20:],
            "applied": {str(s): {str(r): i for r, i in d.items()} for s, d in list(run.applied.items())[-8:]},
            "policy_error": run.policy_error, "policy": self._policy_state(run),
        }

    @staticmethod
    def _policy_state(run: _Run) -> dict | None:
        state = getattr(run.policy, "state", None)
        try:
            return state() if callable(state) else None
        except Exception as e:
            return {"error": str(e)}


def _close_sensors(run: _Run) -> None:
    close, run.sensors = getattr(run.sensors, "close", None), None
    if callable(close):
        try:
            close()
        except Exception as e:
            log.warning("run %s: closing sensors: %s", run.run_id, e)


def _check_knobs_for(knobs: Knobs, paths, has_device: bool) -> None:
    """``Knobs.check_for`` as the protocol's BAD_VALUE, so no rank refuses a change."""
    try:
        knobs.check_for(paths, has_device)
    except ConfigError as e:
        raise ProtocolError(ErrorCode.BAD_VALUE, str(e)) from None


# -- the listening socket --------------------------------------------------------------------------

def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


class _Heap:
    """glibc's heap, kept from growing under frames up to 1 MiB. Freed mmapped blocks raise
    glibc's mmap threshold (up to 32 MiB), so later large frames come from the heap and leave
    holes that small long-lived objects pin: a 10-minute soak with hostile clients grew the
    daemon by 32 MB with its Python objects flat (tracemalloc). The threshold is fixed at
    start, and free heap pages go back to the system once a minute."""

    TRIM_EVERY_S = 60.0

    def __init__(self) -> None:
        self._libc, self._last = None, time.monotonic()
        try:
            import ctypes

            libc = ctypes.CDLL("libc.so.6", use_errno=True)
            libc.mallopt(-3, 128 * 1024)  # M_MMAP_THRESHOLD: fixed, so no longer dynamic
            libc.mallopt(-1, 1 << 20)  # M_TRIM_THRESHOLD: fixed as well (the dynamic rule moves it too)
            self._libc = libc
        except (OSError, AttributeError):
            pass  # not glibc (musl, macOS): nothing to tune

    def trim(self) -> None:
        if self._libc is not None and time.monotonic() - self._last >= self.TRIM_EVERY_S:
            self._last = time.monotonic()
            self._libc.malloc_trim(0)


FD_RESERVE = 64
"""Descriptors kept for the daemon itself (listening socket, log, SQLite, sensors' reads)."""


def raise_fd_limit() -> int:
    """Raise this process's soft open-file limit to its hard limit where allowed; the soft
    limit in force."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    want = hard if hard != resource.RLIM_INFINITY else max(soft, 1 << 20)
    if soft != resource.RLIM_INFINITY and soft < want:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (want, hard))
            soft = want
        except (ValueError, OSError):
            pass
    return soft if soft != resource.RLIM_INFINITY else 1 << 20


class _QuietAcceptErrors(logging.Filter):
    """asyncio logs a traceback each time accept() fails for want of descriptors and retries a
    second later: keep one such line a minute."""

    def __init__(self) -> None:
        super().__init__()
        self._last = 0.0

    def filter(self, record: logging.LogRecord) -> bool:
        if "out of system resource" not in record.getMessage():
            return True
        now = time.monotonic()
        if now - self._last < 60.0:
            return False
        self._last = now
        record.exc_info, record.exc_text = None, None
        return True


_quiet_accept_errors = _QuietAcceptErrors()


def _inherited_socket() -> socket.socket | None:
    """The listening socket systemd passed (``LISTEN_FDS``), if it was passed to this process."""
    if os.environ.get("LISTEN_PID") != str(os.getpid()) or int(os.environ.get("LISTEN_FDS", "0") or 0) < 1:
        return None
    for name in ("LISTEN_PID", "LISTEN_FDS", "LISTEN_FDNAMES"):
        os.environ.pop(name, None)  # not for our children
    sock = socket.socket(fileno=SD_LISTEN_FDS_START)
    if sock.family != socket.AF_UNIX or sock.type != socket.SOCK_STREAM:
        raise ConfigError("the socket systemd passed is not a Unix stream socket: use ListenStream= with a path")
    sock.setblocking(False)
    return sock


def bind_socket(path: str) -> socket.socket:
    """A listening Unix socket at ``path``, mode 0600; a stale file is replaced, a live one refused."""
    if len(os.fsencode(path)) >= 108:
        raise ConfigError(f"socket path {path} is {len(os.fsencode(path))} bytes; Unix sockets allow 107: pick a "
                          "shorter --socket")
    private_dir(os.path.dirname(os.path.abspath(path)))
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        st = None
    if st is not None:
        if not stat.S_ISSOCK(st.st_mode):
            raise ConfigError(f"{path} exists and is not a socket: remove it or pick another --socket")
        probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        probe.settimeout(2.0)
        try:
            probe.connect(path)
        except ConnectionRefusedError:
            os.unlink(path)  # nothing listens: left by a daemon that died
            log.info("removed the stale socket %s", path)
        except OSError as e:
            raise ConfigError(f"cannot check the existing socket {path}: {e}: remove it or pick another --socket") from None
        else:
            raise ConfigError(f"a tuner daemon already listens on {path}: stop it with `offloadctl tuner stop "
                              f"--socket {path}`, or pick another --socket")
        finally:
            probe.close()
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    old = os.umask(0o177)  # the socket is born 0600: no window where others could connect
    try:
        sock.bind(path)
    except OSError as e:
        sock.close()
        if e.errno == errno.EADDRINUSE:
            raise ConfigError(f"a tuner daemon already listens on {path}: pick another --socket") from None
        raise ConfigError(f"cannot listen on {path}: {e.strerror}") from None
    finally:
        os.umask(old)
    os.chmod(path, 0o600)
    sock.listen(512)
    sock.setblocking(False)
    return sock


def serve(config: ServerConfig, *, policy_factory=None, sensors_factory=None, history=None,
          ready: Callable[[TunerServer], None] | None = None) -> int:
    """Run the daemon in this process until SIGTERM, SIGINT or a ``shutdown`` message."""

    async def main() -> None:
        server = TunerServer(config, policy_factory=policy_factory, sensors_factory=sensors_factory, history=history)
        server.heap = _Heap()  # the daemon's own process: its malloc is ours to set
        await server.start()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, server.request_stop)
        if ready is not None:
            ready(server)
        await server.serve_until_stopped()
        log.info("stopped")

    asyncio.run(main())
    return 0


def _lane_figures(recs: list[dict]) -> dict:
    """The lanes' times of the slowest rank (the one the iteration waits for), for the policy's
    device-fraction moves; nothing when the ranks' engines do not report them."""
    have = [r for r in recs if "host_lane_s" in r and "device_wait_s" in r]
    if not have:
        return {}
    r = max(have, key=lambda r: r["wall_s"])
    return {"host_lane_s": r["host_lane_s"], "device_wait_s": r["device_wait_s"],
            "host_lane_subgroups": r.get("host_lane_subgroups", 0), "device_lane_subgroups": r.get("device_lane_subgroups", 0),
            "device_tier_subgroups": r.get("device_tier_subgroups", 0)}

