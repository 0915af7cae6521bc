"""The tuner daemon's transport: one asyncio loop serving a Unix socket, stdlib only.

Owns the listening socket (bound here, or passed by systemd), accepting connections, the
peer's credentials (only our uid and root), limits on connections and on unread output, frame
reading with deadlines (a client that trickles bytes, or never says ``hello``, is dropped
without holding anyone else up), the handshake and role checks, and the daemon process's
housekeeping (owner and idle exit, glibc heap trimming). Each decoded message is handled
synchronously on the loop, so run state needs no locks; replies and pushes are written
without waiting for the peer to read, and a peer whose unread output passes a bound is dropped.

What the messages mean for runs (registration, aggregation, the policy, knob changes with
``apply_at``, pins) is :class:`tuner.runs.Runs`'s: the server hands it each message and sends
the replies and pushes it returns.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import json
import logging
import os
import resource
import signal
import socket
import stat
import struct
import time
import uuid
from collections import deque
from typing import Any, Callable, Coroutine, Literal

from engine import heap
from engine.errors import ConfigError
from engine.version import VERSION
from tuner.daemon_config import ServerConfig
from tuner.history import History
from tuner.protocol import (
    API_VERSION,
    CLIENT_SCHEMAS,
    HEADER,
    ROLES,
    ErrorCode,
    ProtocolError,
    check_length,
    decode,
    encode,
    validate,
)
from tuner.run_state import Run, encodable_view
from tuner.runs import Handler, PolicyFactory, Runs, SensorsFactory
from tuner.service import endedfile_for, pid_alive, private_dir, read_ended

__all__ = ["ServerConfig", "TunerServer", "bind_socket", "raise_fd_limit", "serve"]

log = logging.getLogger("offloadctl.tuner")

SD_LISTEN_FDS_START = 3


# -- connections -----------------------------------------------------------------------------------


class _Conn:
    """One client connection: the peer that :class:`tuner.runs.Runs` registers ranks on."""

    def __init__(self, writer: asyncio.StreamWriter, server: "TunerServer") -> None:
        self.writer = writer
        self.server = server
        self.role: str | None = None
        self.pid = self.uid = None
        self.closed = False
        self.expired = False
        sock = writer.get_extra_info("socket")
        with contextlib.suppress(OSError):
            self.pid, self.uid, _ = struct.unpack(
                "3i", sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i"))
            )

    def send(self, msg: dict[str, Any]) -> None:
        """Queue ``msg`` without waiting; drop the peer if it stopped reading."""
        if self.closed:
            return
        try:
            data = encode(msg, self.server.config.max_frame_bytes)
        except ProtocolError as e:  # a reply too large for a frame: say so instead
            data = encode(e.to_message(msg.get("id")))
        except (TypeError, ValueError, OverflowError, RecursionError) as e:  # not JSON (a NaN): never the peer's fault
            log.error("a reply of type %r could not be encoded: %s", msg.get("type"), e)
            data = encode(
                ProtocolError(ErrorCode.INTERNAL, f"the daemon could not encode its reply: {e}").to_message(msg.get("id"))
            )
        self.writer.write(data)
        if self.writer.transport.get_write_buffer_size() > self.server.config.max_outbuf_bytes:
            log.warning(
                "dropping client pid %s: %d bytes of replies unread", self.pid, self.writer.transport.get_write_buffer_size()
            )
            self.abort()

    def error(self, err: ProtocolError, req_id: int | str | None = None) -> None:
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


# -- the server ------------------------------------------------------------------------------------


class TunerServer:
    """The daemon's listening socket and connections, and the :class:`tuner.runs.Runs` it hands
    the messages about runs to; :func:`serve` makes and runs one."""

    def __init__(self, config: ServerConfig, runs: Runs) -> None:
        self.config = config
        self.runs = runs
        # Message type -> handler(conn, msg): the daemon's own, then those about runs.
        self._handlers: dict[str, Handler] = {
            "ping": self._on_ping,
            "snapshot": self._on_snapshot,
            "shutdown": self._on_shutdown,
            **self.runs.handlers(),
        }
        self.conns: set[_Conn] = set()
        self.server_id = uuid.uuid4().hex[:16]
        self.started_at = time.time()
        self._server: asyncio.AbstractServer | None = None
        self._stop: asyncio.Event | None = None
        self._inherited = False
        self.heap: _Heap | None = None  # set by serve(): glibc heap settings of the daemon process
        self._sock_ino: tuple[int, int] | None = None
        self._tasks: set[asyncio.Task[None]] = set()
        self._conn_tasks: set[asyncio.Task[Any]] = set()  # one per connection, waited for at close
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
            bound = os.stat(self.config.socket_path)
            self._sock_ino = (bound.st_dev, bound.st_ino)
            log.info("listening on %s", self.config.socket_path)
        self._server = await asyncio.start_unix_server(self._on_connect, sock=sock)
        self._spawn(self._housekeeping())

    def request_stop(self) -> None:
        if self._stop is not None:
            self._stop.set()

    async def serve_until_stopped(self) -> None:
        assert self._stop is not None, "start() first"
        await self._stop.wait()
        await self.close()

    async def close(self) -> None:
        if self._server is not None:
            self._server.close()
        for c in list(self.conns):
            c.abort()
        if self._conn_tasks:  # each sees its connection end and detaches its ranks, logged
            await asyncio.wait(list(self._conn_tasks), timeout=2.0)
        for t in list(self._tasks):
            t.cancel()
        if self._server is not None and not self._inherited:
            self._remove_socket_file()
        self._server = None

    def _remove_socket_file(self) -> None:
        """Unlink our socket, but not one a newer daemon has bound since."""
        with contextlib.suppress(FileNotFoundError):
            now = os.lstat(self.config.socket_path)
            if (now.st_dev, now.st_ino) == self._sock_ino:
                os.unlink(self.config.socket_path)

    def _spawn(self, coro: Coroutine[Any, Any, None]) -> None:
        t = asyncio.get_running_loop().create_task(coro)
        self._tasks.add(t)
        t.add_done_callback(self._tasks.discard)

    async def _housekeeping(self) -> None:
        """Forget finished runs after ``finished_keep_s``; end runs whose ranks never came back;
        stop when the owner is gone or nothing ran for ``idle_exit_s``."""
        idle_since = time.monotonic()
        while True:
            await asyncio.sleep(min(1.0 if self.config.owner_pid else 5.0, self.config.finished_keep_s / 2))
            if self.config.owner_pid and not pid_alive(self.config.owner_pid):
                log.info("owner pid %d is gone: stopping", self.config.owner_pid)
                self.request_stop()
                return
            if self.runs.any_running() or self.conns:
                idle_since = time.monotonic()
            elif self.config.idle_exit_s and time.monotonic() - idle_since > self.config.idle_exit_s:
                log.info("no run for %.0f s: stopping", self.config.idle_exit_s)
                self.request_stop()
                return
            if self.heap is not None:
                self.heap.trim()
            self.runs.forget_ended(time.time())

    # -- connections -------------------------------------------------------------------------

    async def _on_connect(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        conn = _Conn(writer, self)
        task = asyncio.current_task()
        assert task is not None  # a connection's callback runs as its own task
        self._conn_tasks.add(task)
        try:
            if conn.uid is None or conn.uid not in (os.geteuid(), 0):
                log.warning(
                    "refused a client of uid %s (pid %s): only uid %d and root may connect", conn.uid, conn.pid, os.geteuid()
                )
                conn.error(
                    ProtocolError(
                        ErrorCode.PERMISSION,
                        f"uid {conn.uid} may not use this daemon: only uid "
                        f"{os.geteuid()} and root may; run as that user or start your own daemon",
                    )
                )
                return
            if len(self.conns) >= self.max_connections:
                conn.error(ProtocolError(ErrorCode.BUSY, f"the daemon already serves {len(self.conns)} connections"))
                return
            self.conns.add(conn)
            await self._serve_conn(conn, reader)
        except asyncio.CancelledError:
            # The loop is shutting down with this client still connected: end quietly, as a
            # cancelled connection task makes asyncio's stream callback log a traceback (3.11).
            conn.abort()
        except Exception:  # a bug handling one client must not take the daemon down
            log.exception("client pid %s: internal error; connection closed", conn.pid)
        finally:
            self._conn_tasks.discard(task)
            self.conns.discard(conn)
            self.runs.detach(conn)
            self._send_pushes()
            if not conn.closed:
                conn.closed = True
                with contextlib.suppress(Exception):
                    await asyncio.wait_for(writer.drain(), 1.0)  # flush a final error reply
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
            timer = loop.call_later(
                self.config.handshake_timeout_s, conn.expire, f"no hello within {self.config.handshake_timeout_s:g} s"
            )
        try:
            try:
                first = await reader.readexactly(1)
            except (asyncio.IncompleteReadError, ConnectionError):
                return None
            if timer is None:
                timer = loop.call_later(
                    self.config.frame_timeout_s, conn.expire, f"frame not complete within {self.config.frame_timeout_s:g} s"
                )
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

    def _dispatch(self, conn: _Conn, msg: dict[str, Any]) -> None:
        kind = msg["type"]
        if conn.role is None:
            if kind != "hello":
                raise ProtocolError(ErrorCode.HANDSHAKE, f"the first message must be hello, got {kind!r}")
            if msg["api"] != API_VERSION:
                raise ProtocolError(
                    ErrorCode.VERSION,
                    f"client speaks API {msg['api']}; this daemon speaks {API_VERSION}: use the same offloadctl version for both",
                )
            conn.role = msg["role"]
            conn.send(
                {
                    "v": API_VERSION,
                    "type": "welcome",
                    "id": msg.get("id"),
                    "api": API_VERSION,
                    "server": VERSION,
                    "server_id": self.server_id,
                    "pid": os.getpid(),
                    "started_at": self.started_at,
                }
            )
            return
        if kind == "hello":
            raise ProtocolError(ErrorCode.HANDSHAKE, "hello was already received on this connection")
        if kind not in ROLES[conn.role]:
            raise ProtocolError(ErrorCode.ROLE, f"{kind!r} is not allowed for a {conn.role} client")
        try:
            reply = self._handlers[kind](conn, msg)
        finally:
            self._send_pushes()  # before the reply (or error), as a handler's own sends would be
        if msg.get("id") is not None:
            reply = reply or {"type": "ok"}
            conn.send({"v": API_VERSION, "id": msg["id"], **reply})

    def _send_pushes(self) -> None:
        """Send what the runs queued for their ranks (knob changes)."""
        for conn, msg in self.runs.take_outbox():
            conn.send(msg)

    # -- the daemon's own messages -----------------------------------------------------------

    def _on_ping(self, conn: _Conn, msg: dict[str, Any]) -> dict[str, Any]:
        return {"type": "pong"}

    def _on_shutdown(self, conn: _Conn, msg: dict[str, Any]) -> None:
        log.info("shutdown requested by pid %s", conn.pid)
        # Stop after this reply is written.
        asyncio.get_running_loop().call_later(0.05, self.request_stop)

    def _on_snapshot(self, conn: _Conn, msg: dict[str, Any]) -> dict[str, Any]:
        """Every run (or the one asked for), within one frame: a run whose view cannot be encoded
        or is too large for its share comes as a compact view, and runs beyond the frame are
        listed by id in ``omitted`` (ask for one with ``run_id``). One run never breaks the
        answer for the others."""
        budget = self.config.max_frame_bytes - 64 * 1024  # the daemon's view, ids of omitted runs, framing
        runs, omitted = self.runs.views(msg.get("run_id"), msg.get("history", 60), budget)
        out = {"type": "snapshot", "runs": runs, "daemon": self.daemon_view()}
        if omitted:
            out["omitted"] = omitted
        return out

    def daemon_view(self) -> dict[str, Any]:
        """The daemon itself; ``handle_ms``: time spent on each of the last 10,000 messages,
        from its frame read to its reply written (queueing in the kernel not included)."""
        recent = sorted(self._handle_s)
        pct: Callable[[float], float | None] = lambda q: (
            1e3 * recent[min(len(recent) - 1, int(len(recent) * q))] if recent else None
        )
        return {
            "pid": os.getpid(),
            "api": API_VERSION,
            "version": VERSION,
            "server_id": self.server_id,
            "started_at": self.started_at,
            "uptime_s": time.time() - self.started_at,
            "connections": len(self.conns),
            "socket": self.config.socket_path,
            "socket_activated": self._inherited,
            "messages": self.messages,
            "handle_ms": {"p50": pct(0.5), "p99": pct(0.99), "max": pct(1.0)},
        }


# -- the listening socket --------------------------------------------------------------------------


class _Heap:
    """glibc's heap, kept from growing under frames up to 1 MiB. Freed mmapped blocks raise
    glibc's mmap threshold (up to 32 MiB), so later large frames come from the heap and leave
    holes that small long-lived objects pin: a 10-minute soak with hostile clients grew the
    daemon by 32 MB with its Python objects flat (tracemalloc). The threshold is fixed at
    start, and free heap pages go back to the system once a minute."""

    TRIM_EVERY_S = 60.0

    def __init__(self) -> None:
        self._last = time.monotonic()
        heap.bound(mmap_threshold=128 * 1024, trim_threshold=1 << 20)

    def trim(self) -> None:
        if time.monotonic() - self._last >= self.TRIM_EVERY_S:
            self._last = time.monotonic()
            heap.release_freed()


FD_RESERVE = 64
"""Descriptors kept for the daemon itself (listening socket, log, SQLite, sensors' reads)."""


def raise_fd_limit() -> int:
    """Raise this process's soft open-file limit to its hard limit where allowed; the soft
    limit in force."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    want = hard if hard != resource.RLIM_INFINITY else max(soft, 1 << 20)
    if soft != resource.RLIM_INFINITY and soft < want:
        with contextlib.suppress(ValueError, OSError):
            resource.setrlimit(resource.RLIMIT_NOFILE, (want, hard))
            soft = want
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
        raise ConfigError(
            f"socket path {path} is {len(os.fsencode(path))} bytes; Unix sockets allow 107: pick a shorter --socket"
        )
    private_dir(os.path.dirname(os.path.abspath(path)))
    try:
        existing = os.lstat(path)
    except FileNotFoundError:
        existing = None
    if existing is not None:
        if not stat.S_ISSOCK(existing.st_mode):
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
            raise ConfigError(
                f"a tuner daemon already listens on {path}: stop it with `offloadctl tuner stop "
                f"--socket {path}`, or pick another --socket"
            )
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


def _ended_runs_writer(socket_path: str) -> Callable[[Run], None]:
    """What :class:`TunerServer` does with a run that ended: its final view goes to
    ``tuner.service.endedfile_for(socket_path)`` (the last 20 runs), where ``offloadctl tune``
    reads how it ended once this daemon is gone."""

    def record(run: Run) -> None:
        view, _ = encodable_view(run, 60, 256 * 1024)
        ended = read_ended(socket_path)
        ended.pop(run.run_id, None)
        ended[run.run_id] = view
        path = endedfile_for(socket_path)
        tmp = f"{path}.{os.getpid()}.tmp"
        with open(os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600), "w") as f:
            json.dump(dict(list(ended.items())[-20:]), f, allow_nan=False)
        os.replace(tmp, path)

    return record


def serve(
    config: ServerConfig,
    *,
    policy_factory: PolicyFactory | None = None,
    sensors_factory: SensorsFactory | Literal[False] | None = None,
    history: History | None = None,
    ready: Callable[[TunerServer], None] | None = None,
) -> int:
    """Run the daemon in this process until SIGTERM, SIGINT or a ``shutdown`` message. The
    keywords but ``ready`` (called with the server once it listens) are those of
    :class:`tuner.runs.Runs`."""

    async def main() -> None:
        runs = Runs(
            config,
            policy_factory=policy_factory,
            sensors_factory=sensors_factory,
            history=history,
            on_end=_ended_runs_writer(config.socket_path),
        )
        server = TunerServer(config, runs)
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
