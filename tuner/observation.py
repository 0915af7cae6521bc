"""What the tuner's policy is told and what it answers: :class:`Observation` (one iteration of a
run, aggregated over its ranks by :mod:`tuner.runs` or a benchmark) and :class:`Decision` (new
knobs and the reason). Kept apart from the policy so that the daemon and custom policies share
the interface without importing the search.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Mapping, Sequence

from engine.config import Knobs
from engine.telemetry import StepRecord


@dataclass(frozen=True, kw_only=True)
class LaneTimes:
    """The lanes' side of one rank's step (``StepRecord``'s names), for the device-fraction moves."""

    host_lane_s: float
    """Time the CPU spent in host-lane updates."""
    device_wait_s: float
    """Time the step waited at its end for the device lane."""
    host_lane_subgroups: int = 0
    device_lane_subgroups: int = 0
    device_tier_subgroups: int = 0

    @classmethod
    def of(cls, rec: StepRecord) -> "LaneTimes":
        return cls(
            host_lane_s=rec.host_lane_s,
            device_wait_s=rec.device_wait_s,
            host_lane_subgroups=rec.host_lane_subgroups,
            device_lane_subgroups=rec.device_lane_subgroups,
            device_tier_subgroups=rec.device_tier_subgroups,
        )


@dataclass(kw_only=True)
class Observation:
    """One iteration of a run, aggregated over its ranks (:meth:`from_records`)."""

    iteration: int
    iter_time_s: float | None
    """Whole iteration, max over ranks; None when not reported."""
    update_s: float
    """The update phase (``StepRecord.update_s``), max over ranks."""
    read_wait_s: float
    write_wait_s: float
    kernel_s: float | None = None
    """The AdamW math (``StepRecord.kernel_s``), max over ranks."""
    path_read_bytes_per_s: dict[str, float] = field(default_factory=dict)
    """Ours, summed over ranks."""
    path_write_bytes_per_s: dict[str, float] = field(default_factory=dict)
    path_other_bytes_per_s: dict[str, float] = field(default_factory=dict)
    """Others' traffic on each path's device (contention), from :class:`tuner.sensors.Sensors`."""
    path_read_rate: dict[str, float] = field(default_factory=dict)
    """The rate each path serves our reads at now: bytes over the time it was busy reading
    (:func:`service_rates`), summed over ranks; no entry where it moved too little to say."""
    path_write_rate: dict[str, float] = field(default_factory=dict)
    """The same for writes."""
    path_queue_wait_s: dict[str, float] = field(default_factory=dict)
    """Seconds our requests waited for a slot or the node lock on each path, summed over ranks."""
    device_headroom_bytes: int | None = None
    error: str | None = None
    """'oom' or a message when a rank reported an event during this iteration."""
    knobs: Knobs | Mapping[str, Any] | None = None
    """The knobs in force for this iteration (``StepRecord.knobs``; a trace's dict), when known. An
    observation made under other knobs than the last decision's is ignored: the change has not arrived yet."""
    lanes: LaneTimes | None = None
    """The slowest rank's (the one the iteration waits for); None when the engines do not say."""
    setup_s: float = 0.0
    """One-time work inside this iteration (``StepRecord.setup_s``: pinning buffers for a lane
    change, allocating gradient buffers), max over ranks: not what the knobs cost from now on,
    so it is taken out of the iteration time a move is judged on."""

    @classmethod
    def from_records(cls, records: Sequence[StepRecord], *, iter_times_s: Sequence[float] = (), **context: Any) -> "Observation":
        """One iteration from its ranks' records: the phases' times are the slowest rank's (the
        iteration waits for it), the bytes/s per path the sum over ranks. ``context``: what the
        records do not carry (others' traffic, headroom, error, the knobs in force)."""
        slowest = max(records, key=lambda r: r.update_s)
        read, write = path_rates(records)
        read_rate, write_rate = service_rates(records)
        queued: dict[str, float] = {}
        for r in records:
            for p, s in r.path_queue_wait_s.items():
                queued[p] = queued.get(p, 0.0) + s
        return cls(
            iteration=records[0].iteration,
            iter_time_s=max(iter_times_s) if iter_times_s else None,
            update_s=slowest.update_s,
            read_wait_s=max(r.read_wait_s for r in records),
            write_wait_s=max(r.write_wait_s for r in records),
            kernel_s=max(r.kernel_s for r in records),
            path_read_bytes_per_s=read,
            path_write_bytes_per_s=write,
            path_read_rate=read_rate,
            path_write_rate=write_rate,
            path_queue_wait_s=queued,
            lanes=LaneTimes.of(slowest),
            setup_s=max(r.setup_s for r in records),
            **context,
        )


def path_rates(records: Sequence[StepRecord]) -> tuple[dict[str, float], dict[str, float]]:
    """Read and write bytes/s per path over each record's update phase, summed over records."""
    read: dict[str, float] = {}
    write: dict[str, float] = {}
    for r in records:
        if r.update_s < 1e-6:  # a shorter update is no measurement: rates from it would be noise or infinite
            continue
        for p, b in r.path_bytes_read.items():
            read[p] = read.get(p, 0.0) + b / r.update_s
        for p, b in r.path_bytes_written.items():
            write[p] = write.get(p, 0.0) + b / r.update_s
    return read, write


MIN_BUSY_S = 0.005
"""Less busy time than this is no measurement of a path's rate."""
MIN_SERVED_BYTES = 1 << 20
"""Nor are fewer bytes (one request's latency, not the path's rate)."""


def service_rates(records: Sequence[StepRecord]) -> tuple[dict[str, float], dict[str, float]]:
    """Read and write bytes/s each path served while busy with them, summed over records (ranks
    sharing a device each see their part of it); records of engines that do not report busy
    times, and paths that moved too little, give no entry."""
    out: tuple[dict[str, float], dict[str, float]] = ({}, {})
    for r in records:
        for rates, moved, busy in (
            (out[0], r.path_bytes_read, r.path_read_busy_s),
            (out[1], r.path_bytes_written, r.path_write_busy_s),
        ):
            for p, s in busy.items():
                b = moved.get(p, 0)
                if s >= MIN_BUSY_S and b >= MIN_SERVED_BYTES:
                    rates[p] = rates.get(p, 0.0) + b / s
    return out


@dataclass(frozen=True)
class Decision:
    """New knobs for the run, and why (for the log and the live view)."""

    knobs: Knobs
    reason: str
