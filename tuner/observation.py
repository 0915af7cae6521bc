"""What the tuner's policy is told and what it answers: :class:`Observation` (one iteration of a
run, aggregated over its ranks by :mod:`tuner.runs` or a benchmark) and :class:`Decision` (new
knobs and the reason). Kept apart from the policy so that the daemon and custom policies share
the interface without importing the search.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping

from engine.config import Knobs


@dataclass
class Observation:
    """One iteration of a run, aggregated over its ranks."""

    iteration: int
    iter_time_s: float | None
    """Whole iteration, max over ranks; None when not reported."""
    update_s: float
    """Engine update phase (``StepRecord.wall_s``), max over ranks."""
    read_wait_s: float
    write_wait_s: float
    path_read_bytes_per_s: dict[str, float]
    """Ours, summed over ranks."""
    path_write_bytes_per_s: dict[str, float]
    path_other_bytes_per_s: dict[str, float]
    """Others' traffic on each path's device (contention), from :class:`tuner.sensors.Sensors`."""
    device_headroom_bytes: int | None
    error: str | None = None
    """'oom' or a message when a rank reported an event during this iteration."""
    knobs: Mapping[str, Any] | None = None
    """The knobs in force for this iteration (``StepRecord.knobs``), when known. An observation
    made under other knobs than the last decision's is ignored: the change has not arrived yet."""
    host_lane_s: float | None = None
    """Time the CPU spent in host-lane updates (``StepRecord.host_lane_s``), max over ranks."""
    device_wait_s: float | None = None
    """Time the step waited at its end for the device lane (``StepRecord.device_wait_s``)."""
    host_lane_subgroups: int = 0
    device_lane_subgroups: int = 0
    """Device-tier subgroups included, as ``StepRecord`` counts them."""
    device_tier_subgroups: int = 0


@dataclass(frozen=True)
class Decision:
    """New knobs for the run, and why (for the log and the live view)."""

    knobs: Knobs
    reason: str
