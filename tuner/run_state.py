"""One run's state as the daemon keeps it (:class:`Run`, :class:`Rank`), and its view: what
``offloadctl tune`` and snapshots show of it. :mod:`tuner.runs` changes this state; nothing
here changes it, so views can be made at any time.
"""

from __future__ import annotations

import json
import logging
import os
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any, Mapping, Sequence, TypedDict

from engine.config import KnobKey, Knobs
from engine.errors import ConfigError
from engine.facts import EngineFacts
from engine.telemetry import StepRecord
from tuner.knob_text import Pins

log = logging.getLogger("offloadctl.tuner")

DECISIONS_KEPT = 20
"""A run's last decisions that its view (:func:`run_view`) carries."""


@dataclass
class Rank:
    peer: Any | None
    """The connection the rank registered on; None while it is away."""
    iteration: int = -1
    iter_time_s: float | None = None
    bye: bool = False
    stopped_by: str | None = None  # the signal named in its bye: it was interrupted


@dataclass(frozen=True, kw_only=True)
class RunFacts:
    """What a run's registration says about it: made from its engine's facts by the client
    (:meth:`of_engine`), sent (:meth:`register_fields`), read from the message once by the daemon
    (:meth:`from_register`), kept by the :class:`Run` and handed as it is to the policy."""

    ranks: int = 1
    params: int = 0
    """Parameters per rank."""
    paths: tuple[str, ...] = ()
    has_device: bool = False
    subgroup_bytes: int = 0
    """The largest subgroup's state."""
    profile: Any = None
    """A hardware profile (its name or path, or the profile itself) to start from the model's plan."""
    device_headroom_bytes: int | None = None
    pins: dict[str, Any] = field(default_factory=dict)
    """Knobs the run's options fixed, with their values (the register message's): pinned from the start."""
    host_staging_bytes: int | None = None
    """Host bytes per rank its host-memory budget leaves for staging buffers."""
    path_depth_response: dict[str, dict[str, float]] = field(default_factory=dict)
    """Per path of the run, how its probed rate answered twice and half its concurrency (``EngineFacts``)."""

    @classmethod
    def of_engine(cls, facts: EngineFacts, *, ranks: int = 1, profile: Any = None) -> "RunFacts":
        """What a rank of a run of ``ranks`` registers from its engine's :class:`EngineFacts`
        (paths made absolute, as the daemon compares them)."""
        return cls(
            ranks=ranks,
            params=facts.params,
            paths=tuple(os.path.abspath(p) for p in facts.paths),
            has_device=facts.has_device,
            subgroup_bytes=facts.subgroup_bytes,
            profile=profile,
            device_headroom_bytes=facts.device_headroom_bytes,
            pins=dict(facts.pins),
            host_staging_bytes=facts.host_staging_bytes,
            path_depth_response={os.path.abspath(p): dict(r) for p, r in facts.path_depth_response.items()},
        )

    def register_fields(self) -> dict[str, Any]:
        """These facts as the register message spells them (``device_headroom_bytes`` aside: the
        client sends its latest)."""
        optional = {"host_staging_bytes": self.host_staging_bytes, "path_depth_response": self.path_depth_response or None}
        return {
            "world_size": self.ranks,
            "params": self.params,
            "paths": list(self.paths),
            "profile": self.profile,
            "has_device": self.has_device,
            "subgroup_bytes": self.subgroup_bytes,
            "pins": dict(self.pins),
            **{k: v for k, v in optional.items() if v is not None},  # sent only when known
        }

    @classmethod
    def from_register(cls, msg: dict[str, Any]) -> "RunFacts":
        """The facts of a validated register message. A pin the run cannot have (a path not its
        own) is left out, with a warning (the engine refused it already)."""
        paths = tuple(msg["paths"])
        pins: dict[str, Any] = {}
        for text, value in msg.get("pins", {}).items():
            try:
                KnobKey.parse(text, paths)
            except ConfigError as e:
                log.warning("run %s: fixed knob %s ignored: %s", msg["run_id"], text, e)
                continue
            pins[text] = value
        return cls(
            ranks=msg["world_size"],
            params=msg["params"],
            paths=paths,
            has_device=msg["has_device"],
            subgroup_bytes=msg["subgroup_bytes"],
            profile=msg.get("profile"),
            device_headroom_bytes=msg.get("device_headroom_bytes"),
            pins=pins,
            host_staging_bytes=msg.get("host_staging_bytes"),
            path_depth_response={p: r for p, r in msg.get("path_depth_response", {}).items() if p in paths},
        )


@dataclass
class Run:
    run_id: str
    facts: RunFacts
    knobs: Knobs
    """The run's knobs: the latest change pushed (in force once its ``apply_at`` is reached)."""
    knobs_dict: dict[str, Any] = field(default_factory=dict)  # knobs.to_dict(), kept up to date: asdict is slow
    policy: Any = None
    sensors: Any = None
    ranks: dict[int, Rank] = field(default_factory=dict)
    started_at: float = field(default_factory=time.time)
    status: str = "running"  # running | disconnected | finished
    ended_at: float | None = None
    stopped_by: str | None = None  # finished, but a rank's bye named the signal that stopped it
    seq: int = 0  # number of knob changes pushed
    apply_at: int | None = None  # of the latest change
    reason: str = ""  # of the latest change
    max_iteration: int = -1  # furthest iteration any rank reported (or registered at)
    last_observed: int = -1  # latest iteration given to the policy
    pending: dict[int, dict[int, tuple[StepRecord, float | None]]] = field(default_factory=dict)  # iteration -> rank -> telemetry
    frozen: bool = False
    own_pins: Pins = field(default_factory=Pins)
    """The user's pins while the run has no working policy; a working one holds them (:meth:`pins`)."""
    headroom: dict[int, int | None] = field(default_factory=dict)
    error: str | None = None  # an event to pass with the next observation
    policy_error: str | None = None
    in_force: Knobs | None = None  # knobs of the latest observed iteration, as the engines report them
    in_force_since: int = 0  # first iteration observed under them
    start_change: tuple[Knobs, str, str] | None = None  # (knobs, reason, source): pushed once all ranks registered
    start_knobs: dict[str, Any] = field(default_factory=dict)
    """The knobs the run registered with (its own options, plan and probe): where its changes start."""
    changed_by: dict[str, str] = field(default_factory=dict)
    """Who last changed each knob (``flat_knobs`` key): 'history', 'policy' or 'user'."""
    start_from: dict[str, Any] | None = None
    """The history's start: ``{"run_id": the earlier run, "knobs": {key: value it set}}``."""
    history: deque[tuple[int, float | None, float]] = field(default_factory=deque)  # (iteration, iter_time_s, update_s)
    phases: dict[str, float | None] = field(default_factory=dict)
    bandwidth: dict[str, dict[str, float | None]] = field(default_factory=dict)
    sensor_sample: dict[str, Any] | None = None
    sensor_bytes: dict[str, int] = field(default_factory=dict)  # our bytes per path since the last sample
    sensor_at: float = 0.0
    summary_at: float = 0.0
    decisions: deque[dict[str, Any]] = field(default_factory=lambda: deque(maxlen=200))
    events: deque[dict[str, Any]] = field(default_factory=lambda: deque(maxlen=100))
    applied: dict[int, dict[int, int]] = field(default_factory=dict)  # seq -> rank -> iteration applied

    def __post_init__(self) -> None:
        self.knobs_dict = self.knobs.to_dict()
        self.start_knobs = self.start_knobs or dict(self.knobs_dict)

    def connected(self) -> int:
        return sum(1 for r in self.ranks.values() if r.peer is not None)

    def policy_ok(self) -> bool:
        return self.policy is not None and self.policy_error is None

    def close_sensors(self) -> None:
        """Stop the run's disk and PCIe sensors (a failure to is logged, never raised)."""
        close, self.sensors = getattr(self.sensors, "close", None), None
        if callable(close):
            try:
                close()
            except Exception as e:
                log.warning("run %s: closing sensors: %s", self.run_id, e)

    def pins(self) -> dict[str, Any]:
        """The user's pins, as the wire spells them: the policy's, or without a working one the run's own."""
        return dict(self.policy.pins) if self.policy_ok() else self.own_pins.as_dict()


class Activity(TypedDict):
    """What the tuner does with a run, or concluded at its end (:func:`tuner_activity`); a view
    carries it under the key ``verdict`` (the wire's name, kept)."""

    mode: str | None
    """frozen (by the user), stopped (the policy failed), trial, holding, measuring; None
    without a policy."""
    since_iteration: int | None
    """While holding: the iteration it started holding at."""
    trial: str | None
    """While on trial: the move tried."""
    reason: str | None
    """Why: the policy's error, its reason to hold (None when it holds for want of a move to
    try), or the reason of the tuner's latest change."""


class _CompactView(TypedDict):
    """What every view of a run holds, the compact one too."""

    run_id: str
    status: str
    """running, disconnected (its ranks went away without a bye) or finished."""
    outcome: str
    """running, finished, or interrupted (:func:`run_outcome`)."""
    stopped_by: str | None
    """The signal a rank's bye named: the run was interrupted by it."""
    verdict: Activity | None
    """What the tuner does with the run (the key's name is the protocol's); None in the compact view."""
    ranks: int
    connected: int
    iteration: int
    """The furthest iteration a rank reported, from 0 (-1: none yet)."""
    iter_time_s: float | None
    knobs: dict[str, Any]
    """``Knobs.to_dict()`` of the latest change pushed ({} in the compact view)."""
    pins: dict[str, Any]
    frozen: bool
    policy: dict[str, Any] | None
    """The policy's own state (``Policy.state()``)."""
    history: dict[str, list[float | None]]
    paths: list[str]
    decisions: list[dict[str, Any]]
    events: list[dict[str, Any]]
    phases: dict[str, float | None]
    bandwidth: dict[str, dict[str, float | None]]


class RunView(_CompactView, total=False):
    """A run as a snapshot shows it (:func:`run_view`), for ``offloadctl tune`` and the end of
    ``offloadctl train``; the compact view (:func:`encodable_view`) has ``truncated`` and
    none of the others below."""

    truncated: str
    seq: int
    apply_at: int | None
    params: int
    has_device: bool
    started_at: float
    ended_at: float | None
    rank_iterations: dict[str, int]
    sensors: dict[str, Any] | None
    applied: dict[str, dict[str, int]]
    policy_error: str | None
    start_knobs: dict[str, Any]
    changed_by: dict[str, str]
    start_from: dict[str, Any] | None


def encodable_view(run: Run, history: int, share: int) -> tuple[RunView, int]:
    """``run``'s view and its encoded size; the compact view when the full one fails to
    encode or passes ``share`` bytes."""
    try:
        view = run_view(run, history)
        size = len(json.dumps(view, separators=(",", ":"), allow_nan=False))
        if size <= share:
            return view, size
        why = f"view of {size} bytes over this snapshot's share of {share}: ask for this run alone"
    except (TypeError, ValueError, OverflowError, RecursionError) as e:
        why = f"view could not be encoded ({e})"
        log.error("run %s: %s", run.run_id, why)
    view = {
        "run_id": run.run_id,
        "status": run.status,
        "ranks": run.facts.ranks,
        "connected": run.connected(),
        "iteration": run.max_iteration,
        "iter_time_s": None,
        "knobs": {},
        "truncated": why,
        "history": {"iteration": [], "iter_time_s": [], "update_s": []},
        "paths": [],
        "decisions": [],
        "events": [],
        "phases": {},
        "bandwidth": {},
        "pins": {},
        "frozen": run.frozen,
        "policy": None,
        "stopped_by": run.stopped_by,
        "outcome": run_outcome(run.status, run.stopped_by),
        "verdict": None,
    }
    return view, len(json.dumps(view))


def run_view(run: Run, history: int = 60) -> RunView:
    """What ``tune`` shows of a run; ``history`` bounds the per-iteration lists."""
    hist = list(run.history)[-history:] if history else []
    last = run.history[-1] if run.history else None
    iter_time = last[1] if last else max((r.iter_time_s for r in run.ranks.values() if r.iter_time_s), default=None)
    policy = _policy_state(run)
    return {
        "run_id": run.run_id,
        "status": run.status,
        "ranks": run.facts.ranks,
        "connected": run.connected(),
        "iteration": run.max_iteration,
        "iter_time_s": iter_time,
        "knobs": run.knobs_dict,
        "seq": run.seq,
        "apply_at": run.apply_at,
        "frozen": run.frozen,
        "pins": run.pins(),
        "params": run.facts.params,
        "paths": list(run.facts.paths),
        "has_device": run.facts.has_device,
        "started_at": run.started_at,
        "ended_at": run.ended_at,
        "stopped_by": run.stopped_by,
        "rank_iterations": {str(k): r.iteration for k, r in sorted(run.ranks.items())},
        "history": {"iteration": [h[0] for h in hist], "iter_time_s": [h[1] for h in hist], "update_s": [h[2] for h in hist]},
        "phases": run.phases,
        "bandwidth": run.bandwidth,
        "sensors": run.sensor_sample,
        "decisions": list(run.decisions)[-DECISIONS_KEPT:],
        "events": list(run.events)[-20:],
        "applied": {str(s): {str(r): i for r, i in d.items()} for s, d in list(run.applied.items())[-8:]},
        "policy_error": run.policy_error,
        "policy": policy,
        "start_knobs": run.start_knobs,
        "changed_by": dict(run.changed_by),
        "start_from": run.start_from,
        "outcome": run_outcome(run.status, run.stopped_by),
        "verdict": tuner_activity(policy, frozen=run.frozen, policy_error=run.policy_error, decisions=run.decisions),
    }


def run_outcome(status: str, stopped_by: str | None) -> str:
    """How a run stands or ended: running, finished, or interrupted (a rank's bye named the
    signal that stopped it, or its ranks went away without one)."""
    if status == "disconnected" or (status == "finished" and stopped_by):
        return "interrupted"
    return status


def tuner_activity(
    policy: Mapping[str, Any] | None, *, frozen: bool, policy_error: str | None, decisions: Sequence[Mapping[str, Any]]
) -> Activity:
    """What the tuner does with a run, or concluded at its end, for the CLI to word, from the
    policy's state, the run's freeze and policy error, and its decisions."""
    policy = policy or {}
    mode = "stopped" if policy_error else "frozen" if frozen else policy.get("mode")
    if mode == "stopped":
        reason = policy_error
    elif mode == "holding":
        reason = policy.get("holding_reason")
    elif mode == "frozen":
        reason = None
    else:
        reason = next((d["reason"] for d in reversed(decisions) if d.get("source") != "user"), None)
    return {
        "mode": mode,
        "since_iteration": policy.get("since_iteration") if mode == "holding" else None,
        "trial": policy.get("trial") if mode == "trial" else None,
        "reason": reason,
    }


def _policy_state(run: Run) -> dict[str, Any] | None:
    state = getattr(run.policy, "state", None)
    try:
        return state() if callable(state) else None
    except Exception as e:
        return {"error": str(e)}
