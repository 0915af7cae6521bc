"""The engine's side of the tuner: telemetry out, knob changes in, never in training's way.

Training calls :meth:`TunerClient.report` after each step and :meth:`TunerClient.apply_pending`
before the next; neither blocks. A background thread owns the socket: it connects, says hello,
registers the rank, sends queued messages, and receives knob changes. If the daemon dies or
restarts, training keeps its last knobs, the thread reconnects with backoff and registers again
(with the knobs in force and the current iteration), and any change received before the loss
still applies at its iteration.

A change carries ``apply_at``; every rank of the run applies it before the step whose
``engine.iteration`` reaches it, so all ranks switch at the same iteration. A rank that gets a
change late applies it at its next step boundary and tells the daemon (``applied``).
"""

from __future__ import annotations

import contextlib
import logging
import os
import select
import socket
import threading
import time
from collections import deque
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from engine.config import Knobs
from engine.errors import ConfigError, OffloadError
from engine.telemetry import StepRecord
from tuner.protocol import (
    API_VERSION,
    MAX_FRAME_BYTES,
    RANK,
    RUN_ID,
    SERVER_SCHEMAS,
    ErrorCode,
    FrameBuffer,
    Int,
    ProtocolError,
    connect_daemon,
    encode,
    knobs_from_dict,
    recv_message,
    validate,
)
from tuner.run_state import RunFacts

if TYPE_CHECKING:
    from engine.core import SubgroupEngine

log = logging.getLogger("offloadctl.tuner.client")
_stopped_by: str | None = None  # see note_stopped
_stopped_at: int = 0  # the iterations the run's record counts at the stop (see note_stopped)


def note_stopped(signal_name: str, iterations: int = 0) -> None:
    """Say that this process was stopped by ``signal_name`` (``"SIGINT"``): every client's
    ``bye`` from now on tells the daemon the run was interrupted, not finished. For the code
    that catches the signal, as clients are usually closed at exit, far from it. ``iterations``:
    the run's record's count, which includes an iteration whose step the signal cut short (the
    engine's count does not), so that the daemon ends the run at the iteration the record does."""
    global _stopped_by, _stopped_at
    _stopped_by, _stopped_at = signal_name, iterations


@dataclass(frozen=True)
class _Change:
    knobs: Knobs
    apply_at: int
    seq: int
    reason: str


@dataclass(frozen=True, kw_only=True)
class ClientSettings:
    """How a :class:`TunerClient` talks to the daemon. ``queue_size`` bounds the telemetry kept
    while the daemon is slow or away (oldest dropped). Reconnect attempts back off from
    ``backoff_s[0]`` to ``backoff_s[1]`` seconds. ``step_is_iteration``: the iteration is the
    engine's step alone (benchmarks driving engines side by side)."""

    queue_size: int = 256
    backoff_s: tuple[float, float] = (0.05, 1.0)
    connect_timeout_s: float = 2.0
    step_is_iteration: bool = False


class TunerClient:
    """One rank (``rank``) of run ``run_id``, connected to the tuner daemon at ``socket_path``:
    it registers the run's ``facts`` (a :class:`tuner.run_state.RunFacts`) with ``knobs`` in force."""

    def __init__(
        self,
        socket_path: str,
        facts: RunFacts,
        knobs: Knobs,
        *,
        run_id: str,
        rank: int,
        settings: ClientSettings | None = None,
    ) -> None:
        try:  # what the daemon would refuse at every registration: refuse it now, once
            RUN_ID(run_id, "run_id")
            RANK(rank, "rank")
            Int(1)(facts.ranks, "world_size")
        except ProtocolError as e:
            raise ConfigError(f"TunerClient: {e}") from None
        if rank >= facts.ranks:
            raise ConfigError(f"TunerClient: rank {rank} must be below world_size {facts.ranks}")
        self.socket_path, self.run_id, self.rank, self.facts = socket_path, run_id, rank, facts
        self.settings = settings = settings or ClientSettings()
        self.knobs = knobs
        """The knobs in force (as last applied)."""
        self._headroom = facts.device_headroom_bytes
        self._iteration = 0
        self._engine: SubgroupEngine | None = None  # the engine whose step hook this client is (for_engine)
        self._telemetry: deque[dict[str, Any]] = deque(maxlen=settings.queue_size)
        self._control: deque[dict[str, Any]] = deque(maxlen=64)  # applied and event: never pushed out by telemetry
        self._pending: list[_Change] = []
        self._lock = threading.Lock()
        self._closing = threading.Event()
        self._last_report: float | None = None
        self.connected = threading.Event()
        """Set while registered with a daemon."""
        self.dropped = 0
        """Telemetry messages dropped because the queue was full (or not encodable)."""
        self.connects = 0
        """Successful registrations, the first one included."""
        self.last_error: str | None = None
        self.start_from: dict[str, Any] | None = None
        """What the daemon said at registration of the run's start from history: ``{"run_id": the
        earlier run, "knobs": {knob: value}}``, or None (:meth:`wait_registered`)."""
        self._registered = threading.Event()
        self._wake_r, self._wake_w = os.pipe()
        os.set_blocking(self._wake_w, False)
        self._thread = threading.Thread(target=self._run, name=f"tuner-client-{run_id}-{rank}", daemon=True)
        self._thread.start()

    @classmethod
    def for_engine(
        cls,
        socket_path: str,
        engine: SubgroupEngine,
        *,
        run_id: str,
        rank: int = 0,
        world_size: int = 1,
        profile: str | dict[str, Any] | None = None,
        hook: bool = True,
        **settings: Any,
    ) -> "TunerClient":
        """A client for ``engine`` (a ``SubgroupEngine``), from what its ``describe()`` says, and
        (``hook``) registered as its step hook: knob changes applied before each step, telemetry
        after. ``hook=False`` leaves calling :meth:`apply_pending` and :meth:`report` to the caller.
        ``settings``: those of :class:`ClientSettings`."""
        facts = engine.describe()
        run = RunFacts.of_engine(facts, ranks=world_size, profile=profile)
        client = cls(socket_path, run, facts.knobs, run_id=run_id, rank=rank, settings=ClientSettings(**settings))
        if hook:
            engine.add_step_hook(client)
            client._engine = engine  # its completed steps go with the bye
        return client

    # -- the engine's step hook (engine.hooks) -------------------------------------------------

    def before_step(self, engine: SubgroupEngine) -> None:
        self.apply_pending(engine)  # every rank switches at the same iteration

    def after_step(self, engine: SubgroupEngine, record: StepRecord) -> None:
        # The iteration is the time between reports (forward and backward included), unless the
        # caller's loop is the step alone (benchmarks driving engines side by side).
        self.report(record, iter_time_s=record.update_s if self.settings.step_is_iteration else None)

    def on_error(self, engine: SubgroupEngine, error: BaseException) -> None:
        self.report_event("oom" if type(error).__name__ == "OutOfMemoryError" else "error", str(error))

    # -- the training side (never blocks) ----------------------------------------------------

    def report(self, rec: StepRecord, *, iter_time_s: float | None = None, device_headroom_bytes: int | None = None) -> None:
        """Queue this step's telemetry. ``iter_time_s`` defaults to the time since the last call
        (the whole iteration, forward and backward included) less what was not this iteration's
        (``rec.excluded_s``: a step skipped since, an ``offload_states``/``reload_states`` gap);
        one given is sent as it is."""
        now = time.perf_counter()
        if iter_time_s is None and self._last_report is not None:
            iter_time_s = max(0.0, now - self._last_report - rec.excluded_s)
        self._last_report = now
        if device_headroom_bytes is None:
            device_headroom_bytes = rec.device_headroom_bytes  # the engine's, refreshed every step
        if device_headroom_bytes is not None:
            self._headroom = device_headroom_bytes
        self._iteration = max(self._iteration, rec.iteration + 1)
        if len(self._telemetry) == self._telemetry.maxlen:
            self.dropped += 1
        self._telemetry.append(
            {
                "type": "telemetry",
                "run_id": self.run_id,
                "rank": self.rank,
                "iteration": rec.iteration,
                "record": rec.to_dict(),
                "iter_time_s": iter_time_s,
                "device_headroom_bytes": self._headroom,
            }
        )
        self._wake()

    def report_event(self, kind: str, message: str) -> None:
        """Tell the daemon about an ``"oom"`` or an ``"error"`` in this rank."""
        self._control.append(
            {"type": "event", "run_id": self.run_id, "rank": self.rank, "kind": kind, "message": str(message)[:4096]}
        )
        self._wake()

    def apply_pending(self, engine: SubgroupEngine) -> Knobs | None:
        """Hand the engine the latest change due at ``engine.iteration`` (the step about to run).

        Returns the knobs handed over, or None. A change the engine refuses is reported as an
        event and the engine keeps its knobs.
        """
        it = engine.iteration
        self._iteration = max(self._iteration, it)
        with self._lock:
            due = [k for k, c in enumerate(self._pending) if c.apply_at <= it]
            if not due:
                return None
            change = self._pending[due[-1]]
            del self._pending[: due[-1] + 1]  # earlier-received changes are superseded
        try:
            engine.set_knobs(change.knobs)
        except OffloadError as e:
            self.report_event("error", f"knob change #{change.seq} refused by the engine: {e}")
            return None
        self.knobs = change.knobs
        if it > change.apply_at:
            log.warning(
                "rank %d: change #%d applied late, at iteration %d instead of %d", self.rank, change.seq, it, change.apply_at
            )
        self._control.append(
            {
                "type": "applied",
                "run_id": self.run_id,
                "rank": self.rank,
                "seq": change.seq,
                "iteration": it,
                "apply_at": change.apply_at,
            }
        )
        self._wake()
        return change.knobs

    def wait_registered(self, timeout_s: float) -> bool:
        """Wait at most ``timeout_s`` for the first registration; whether it happened."""
        return self._registered.wait(timeout_s)

    def pending_changes(self) -> list[dict[str, Any]]:
        """Changes received and not yet applied, oldest first: seq, apply_at, knobs, reason."""
        with self._lock:
            return [{"seq": c.seq, "apply_at": c.apply_at, "knobs": c.knobs, "reason": c.reason} for c in self._pending]

    def close(self, timeout_s: float = 2.0) -> None:
        """Send what is queued and ``bye``, then stop the thread (waits at most ``timeout_s``)."""
        if self._closing.is_set():
            return
        self._closing.set()
        self._wake()
        self._thread.join(timeout_s)
        if not self._thread.is_alive():  # else it may still select on them; a daemon thread ends with us
            wake_r, wake_w, self._wake_w = self._wake_r, self._wake_w, -1
            os.close(wake_r)
            os.close(wake_w)

    def __enter__(self) -> "TunerClient":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _wake(self) -> None:
        if self._wake_w < 0:
            return  # closed: never write to a descriptor number that may have been reused
        with contextlib.suppress(OSError):  # the pipe is full: the thread will wake anyway
            os.write(self._wake_w, b"\0")

    # -- the background thread ---------------------------------------------------------------

    def _run(self) -> None:
        delay = self.settings.backoff_s[0]
        while not self._closing.is_set():
            sock = None
            try:
                sock = self._connect()
                delay = self.settings.backoff_s[0]
                self._exchange(sock)
            except (OSError, ProtocolError, ValueError) as e:
                if str(e) != self.last_error:  # once per distinct failure, not once per retry
                    refused = isinstance(e, ProtocolError)
                    log.log(
                        logging.WARNING if refused else logging.INFO,
                        "rank %d: tuner daemon at %s %s (%s); training keeps its knobs, retrying",
                        self.rank,
                        self.socket_path,
                        "refused this rank" if refused else "unavailable",
                        e,
                    )
                self.last_error = str(e)
            finally:
                self.connected.clear()
                if sock is not None:
                    sock.close()
            if self._closing.wait(delay):
                break
            delay = min(delay * 2, self.settings.backoff_s[1])

    def _connect(self) -> socket.socket:
        sock = connect_daemon(self.socket_path, self.settings.connect_timeout_s)  # refuses a daemon it cannot trust
        try:
            sock.sendall(
                encode(
                    {
                        "v": API_VERSION,
                        "type": "hello",
                        "id": 0,
                        "api": API_VERSION,
                        "role": "engine",
                        "client": f"offloadctl engine pid {os.getpid()}",
                    }
                )
            )
            self._expect(sock, "welcome")
            sock.sendall(encode(self.register_message()))
            reply = self._expect(sock, "registered")
        except BaseException:
            sock.close()
            raise
        self.start_from = reply.get("start_from")
        self.connects += 1
        self.connected.set()
        self._registered.set()
        self.last_error = None
        log.info("rank %d: registered run %s with the tuner daemon at %s", self.rank, self.run_id, self.socket_path)
        return sock

    def register_message(self) -> dict[str, Any]:
        """The ``register`` this rank sends at each connection: its facts, where it is now."""
        return {
            "v": API_VERSION,
            "type": "register",
            "id": 1,
            "run_id": self.run_id,
            "rank": self.rank,
            **self.facts.register_fields(),
            "knobs": self._target_knobs().to_dict(),
            "device_headroom_bytes": self._headroom,
            "iteration": self._iteration,
        }

    def _target_knobs(self) -> Knobs:
        """The knobs this rank is heading for: the last change received, else those in force. A
        restarted daemon learns them at registration, so it does not take them for a surprise."""
        with self._lock:
            return self._pending[-1].knobs if self._pending else self.knobs

    def _expect(self, sock: socket.socket, kind: str) -> dict[str, Any]:
        while True:
            msg = recv_message(sock)
            if msg["type"] == "error":
                raise ProtocolError(msg.get("code", ErrorCode.INTERNAL), f"daemon: {msg.get('message')}")
            if msg["type"] == kind:
                return validate(msg, SERVER_SCHEMAS)
            self._handle(msg)  # a knobs push may come right after registered

    def _exchange(self, sock: socket.socket) -> None:
        """Send the queues and receive pushes until the connection fails or close() is done."""
        frames = FrameBuffer(MAX_FRAME_BYTES)
        sock.settimeout(5.0)  # for sendall only; reads happen when select says so
        while True:
            self._flush(sock)
            if self._closing.is_set():
                self._flush(sock)  # what report() queued meanwhile; bye goes last
                bye = {"v": API_VERSION, "type": "bye", "run_id": self.run_id, "rank": self.rank}
                if _stopped_by:
                    bye["stopped_by"] = _stopped_by
                steps = max(self._engine.iteration if self._engine is not None else 0, _stopped_at)
                if steps:
                    bye["steps"] = steps
                sock.sendall(encode(bye))
                self._drain_until_eof(sock, frames)
                return
            readable, _, _ = select.select((sock, self._wake_r), [], [], 1.0)
            if self._wake_r in readable:
                with contextlib.suppress(OSError):
                    os.read(self._wake_r, 4096)
            if sock in readable:
                data = sock.recv(65536)
                if not data:
                    raise ConnectionError("the tuner daemon closed the connection")
                for msg in frames.feed(data):
                    self._handle(msg)

    def _drain_until_eof(self, sock: socket.socket, frames: FrameBuffer, timeout_s: float = 1.0) -> None:
        """Half-close, then read until the daemon closes. Closing with its pushes unread would
        reset the connection, and the daemon would lose the ``bye`` still in its buffer."""
        sock.shutdown(socket.SHUT_WR)
        deadline = time.monotonic() + timeout_s
        while (left := deadline - time.monotonic()) > 0:
            sock.settimeout(left)
            try:
                data = sock.recv(65536)
            except TimeoutError:
                return
            if not data:
                return
            frames.feed(data)

    def _flush(self, sock: socket.socket) -> None:
        while self._control or self._telemetry:
            msg = (self._control or self._telemetry).popleft()
            try:
                data = encode({"v": API_VERSION, **msg})
            except (ValueError, ProtocolError):  # a NaN in a record, or an absurd size: skip it
                self.dropped += 1
                continue
            sock.sendall(data)

    def _handle(self, msg: dict[str, Any]) -> None:
        try:
            validate(msg, SERVER_SCHEMAS)
            if msg["type"] == "knobs" and msg["run_id"] == self.run_id:
                change = _Change(knobs_from_dict(msg["knobs"]), msg["apply_at"], msg["seq"], msg["reason"])
                with self._lock:
                    self._pending.append(change)
                log.info("rank %d: change #%d at iteration %d: %s", self.rank, change.seq, change.apply_at, change.reason)
            elif msg["type"] == "error":
                log.warning("rank %d: tuner daemon error %s: %s", self.rank, msg["code"], msg["message"])
        except ProtocolError as e:
            log.warning("rank %d: ignoring a bad message from the tuner daemon: %s", self.rank, e)
