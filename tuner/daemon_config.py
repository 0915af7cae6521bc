"""The tuner daemon's settings (:class:`ServerConfig`): one owner for the transport's limits
(:mod:`tuner.server`) and the run bookkeeping's (:mod:`tuner.runs`), so that both read the same
validated values and neither imports the other for them.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from engine.errors import ConfigError
from tuner.protocol import MAX_FRAME_BYTES


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
        if self.idle_exit_s is not None and not (
            isinstance(self.idle_exit_s, (int, float)) and self.idle_exit_s > 0 and math.isfinite(self.idle_exit_s)
        ):
            raise ConfigError(f"ServerConfig.idle_exit_s must be a positive number of seconds, got {self.idle_exit_s!r}")
        for name in (
            "frame_timeout_s",
            "handshake_timeout_s",
            "margin_s",
            "finished_keep_s",
            "sensor_interval_s",
            "summary_interval_s",
        ):
            v = getattr(self, name)
            if not (isinstance(v, (int, float)) and v > 0 and math.isfinite(v)):
                raise ConfigError(f"ServerConfig.{name} must be a positive number of seconds, got {v!r}")
        for name in (
            "max_frame_bytes",
            "max_connections",
            "max_outbuf_bytes",
            "min_margin",
            "max_margin",
            "window",
            "history_points",
            "max_runs",
        ):
            v = getattr(self, name)
            if not (isinstance(v, int) and not isinstance(v, bool) and v > 0):
                raise ConfigError(f"ServerConfig.{name} must be a positive integer, got {v!r}")
