"""The tuner's policy: a noise-aware online search over one run's ``engine.Knobs``.

The daemon (or a benchmark, in-process) calls :meth:`Policy.observe` once per iteration with
an :class:`Observation` aggregated over the run's ranks; it returns a :class:`Decision` when
the knobs should change. The search is hill climbing, one bounded move at a time:

1. **Measure.** After every change the next ``settle_iters`` iterations are discarded (a
   stripe change migrates state lazily, a prefetch change refills buffers), then the
   iteration is timed over ``window`` iterations; the median is the figure. Users pay for the
   iteration, so that is what every move is judged on (the update phase when a run does not
   report iteration times); the update phase's breakdown explains the moves. The first
   iterations of a run are discarded too (they materialise state).
2. **Leave well alone.** When what the knobs can change (the update's I/O waits; with a
   device lane, the whole update phase) is under ``negligible_share`` of the iteration, or
   under twice the noise threshold, no move could be confirmed and trials cost iterations:
   hold, and say so. Re-examine when the share grows.
3. **Try a move** on one knob, within bounds: per-path concurrency x2 or /2, prefetch depth
   +1/+2 or -1, the device-lane fraction, at most 25% of a path's stripe weight moved to the
   others, node lock on/off (more than one rank). The device fraction moves the way the
   lanes' times say: when the GPU's tail (``device_wait_s``) is what the step waits for, to
   the fraction where host lane and device lane finish together at their measured rates;
   when the GPU kept up, halfway to all of it. Moves are ranked by what the baseline shows
   (read wait -> prefetch, I/O wait -> concurrency, unbalanced lanes -> device fraction, a
   contended path -> stripe weight away from it); a move that just helped is tried again.
4. **Keep or revert.** The move is kept when its median beats the baseline by more than the
   noise threshold (``max(min_gain, noise_k * sigma)``, the relative noise sigma pooled over
   every window measured). Otherwise it is reverted and not tried again until something
   changes. Clear verdicts end a trial early (two samples far beyond the threshold).
5. **Hold** when no move is left; re-explore when the iteration drifts up, when contention
   appears or vanishes, and every ``reexplore_every_iters`` iterations.

Guard rails: the engine keeps the device lane within the GPU memory its first step measured
(its buffers are reserved then; its gradients stay on the GPU only while they fit), so the
fraction is free to move; staging memory is capped; an error or OOM on any rank rolls back to
the last good knobs, marks the knobs that caused it as bad for the rest of the run, and an
OOM caps the device fraction below where it happened. Pins (from the
user) always win and are never searched. Every decision is logged with its reason.

With a hardware profile the run starts from the performance model's best plan
(:func:`perf.model.best_plan`), and the run's own starting knobs are the first
alternative measured against it.
"""
from __future__ import annotations

import json
import math
import statistics
from collections import deque
from dataclasses import dataclass, field
from typing import Any, Mapping, Sequence

import psutil

from engine.config import Knobs
from engine.errors import ConfigError

LOG_ENTRIES = 1000


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
    knobs: Knobs
    reason: str


@dataclass(frozen=True, kw_only=True)
class PolicyConfig:
    """How the policy searches. Defaults suit iterations of a few seconds on a noisy machine."""

    window: int = 3
    """Iterations measured per candidate; their median is compared."""
    rebaseline_iters: int = 2
    """Iterations measured under the last good knobs after contention appears or vanishes."""
    settle_iters: int = 1
    """Iterations discarded after each change before measuring."""
    warmup_iters: int = 2
    """Iterations discarded at the start of a run (the first step materialises state, the
    second still writes fresh file extents)."""
    min_gain: float = 0.03
    """Smallest relative improvement that keeps a move."""
    negligible_share: float = 0.05
    """Hold when what the knobs can change (the update's I/O waits; with a device lane, the
    whole update) is under this share of the iteration, or under twice the noise threshold:
    no move could be confirmed, and trials cost iterations. Re-examined when the share
    exceeds twice that."""
    noise_k: float = 2.5
    """Threshold = ``noise_k`` x the relative noise (sigma) pooled over the windows measured."""
    max_threshold: float = 0.15
    """Upper bound of the threshold, so that a noisy machine can still improve."""
    drift: float = 0.2
    """While holding: re-explore when the median update time rises by this fraction."""
    reexplore_every_iters: int = 100
    """While holding: re-explore after this many iterations. 0: never."""
    max_prefetch_depth: int = 8
    """Highest prefetch depth tried (each step costs two staging buffers of host memory)."""
    host_staging_bytes: int | None = None
    """Cap on staging memory of the run's ranks on this node, ``(2 * depth + 3) *
    subgroup_bytes * ranks``. None: a quarter of the host memory available when the policy
    starts."""
    device_step: float = 0.1
    """Change of the device-lane fraction per move."""
    stripe_step: float = 0.25
    """Largest share of a path's stripe weight moved to the other paths per move."""
    contention_min_bytes_per_s: float = 20e6
    """Others' traffic on a path counts as contention above this, and above
    ``contention_ratio`` x our own traffic there (sensor and engine intervals never align
    exactly); it is gone below half of that."""
    contention_ratio: float = 0.05

    def __post_init__(self) -> None:
        for name in ("window", "rebaseline_iters"):
            v = getattr(self, name)
            if not (isinstance(v, int) and not isinstance(v, bool) and v >= 1):
                raise ConfigError(f"PolicyConfig.{name} must be an integer >= 1, got {v!r}")
        for name in ("settle_iters", "warmup_iters", "reexplore_every_iters", "max_prefetch_depth"):
            v = getattr(self, name)
            if not (isinstance(v, int) and not isinstance(v, bool) and v >= 0):
                raise ConfigError(f"PolicyConfig.{name} must be a non-negative integer, got {v!r}")
        if self.max_prefetch_depth > 64:
            raise ConfigError(f"PolicyConfig.max_prefetch_depth must be at most 64, got {self.max_prefetch_depth}")
        for name in ("min_gain", "max_threshold", "drift", "device_step", "stripe_step", "contention_ratio"):
            v = getattr(self, name)
            if not (isinstance(v, (int, float)) and 0 < v <= 1):
                raise ConfigError(f"PolicyConfig.{name} must be in (0, 1], got {v!r}")
        if self.min_gain > self.max_threshold:
            raise ConfigError(f"PolicyConfig.min_gain ({self.min_gain}) must not exceed max_threshold ({self.max_threshold})")
        if not (isinstance(self.noise_k, (int, float)) and self.noise_k >= 0):
            raise ConfigError(f"PolicyConfig.noise_k must be a non-negative number, got {self.noise_k!r}")
        if not (isinstance(self.contention_min_bytes_per_s, (int, float)) and self.contention_min_bytes_per_s > 0):
            raise ConfigError(f"PolicyConfig.contention_min_bytes_per_s must be positive, got {self.contention_min_bytes_per_s!r}")
        if self.host_staging_bytes is not None and not (isinstance(self.host_staging_bytes, int) and self.host_staging_bytes > 0):
            raise ConfigError(f"PolicyConfig.host_staging_bytes must be a positive integer or None, got {self.host_staging_bytes!r}")


@dataclass(frozen=True)
class _Move:
    key: str
    """Identity of the move ('prefetch_depth+', 'io_concurrency[/p]-', 'stripe_weights[/p]-', ...)."""
    knobs: Knobs
    what: str
    """For the log: 'prefetch_depth 0->2'."""
    lenient: bool = False
    """Kept unless it makes things worse: a move back to a plan measured good before."""


@dataclass
class _Sample:
    update_s: float
    iter_time_s: float | None
    read_wait_s: float
    write_wait_s: float
    path_bytes_per_s: dict[str, float]
    lanes: tuple | None = None
    """(host_lane_s, device_wait_s, host-lane subgroups, device-lane ones, device-tier ones)."""

    @property
    def cost(self) -> float:
        """What a move is judged on: the iteration, or the update phase when no iteration time
        is reported."""
        return self.iter_time_s if self.iter_time_s else self.update_s

    @classmethod
    def of(cls, obs: Observation, paths: Sequence[str]) -> "_Sample":
        moved = {p: obs.path_read_bytes_per_s.get(p, 0.0) + obs.path_write_bytes_per_s.get(p, 0.0) for p in paths}
        it = obs.iter_time_s if obs.iter_time_s and math.isfinite(obs.iter_time_s) and obs.iter_time_s >= obs.update_s else None
        lanes = None
        if obs.host_lane_s is not None and obs.device_wait_s is not None:
            lanes = (obs.host_lane_s, obs.device_wait_s, obs.host_lane_subgroups, obs.device_lane_subgroups,
                     obs.device_tier_subgroups)
        return cls(obs.update_s, it, obs.read_wait_s, obs.write_wait_s, moved, lanes)


@dataclass
class _Trial:
    move: _Move
    samples: list[_Sample] = field(default_factory=list)


def _median(xs) -> float:
    return statistics.median(xs)


def _knobs_key(k: Knobs) -> str:
    return json.dumps(k.to_dict(), sort_keys=True)


def _family(key: str) -> str:
    """The knob a move changes: its key less the direction ('io_concurrency[/p]', 'stripe_weights')."""
    key = key.rstrip("+-")
    return "stripe_weights" if key.startswith("stripe_weights") else key


def _opposite(key: str) -> str | None:
    if key.endswith("+"):
        return key[:-1] + "-"
    if key.endswith("-"):
        return key[:-1] + "+"
    return None


def _as_knobs(k: Knobs | Mapping[str, Any]) -> Knobs:
    return k if isinstance(k, Knobs) else Knobs.from_dict(dict(k))


class Policy:
    """Online search over one run's knobs; see the module docstring."""

    def __init__(self, start: Knobs, *, paths: Sequence[str], has_device: bool, subgroup_bytes: int,
                 device_headroom_bytes: int | None = None, profile=None, params: int = 0, ranks: int = 1,
                 config: PolicyConfig | None = None) -> None:
        if not isinstance(start, Knobs):
            raise ConfigError(f"Policy start must be engine.Knobs, got {type(start).__name__}")
        if not (isinstance(subgroup_bytes, int) and subgroup_bytes >= 0):
            raise ConfigError(f"Policy subgroup_bytes must be a non-negative integer, got {subgroup_bytes!r}")
        if not (isinstance(ranks, int) and ranks >= 1):
            raise ConfigError(f"Policy ranks must be a positive integer, got {ranks!r}")
        self.cfg = config or PolicyConfig()
        self.paths = list(dict.fromkeys(paths))
        self.has_device = bool(has_device)
        self.subgroup_bytes = subgroup_bytes
        self.params = int(params or 0)
        self.ranks = ranks
        self.log: list[dict] = []
        self._headroom = device_headroom_bytes
        self._iteration = -1
        self._pins: dict[str, Any] = {}
        self._frozen = False
        self._pending: str | None = None  # a change made outside observe(), announced by the next one
        self._skip = self.cfg.warmup_iters
        self._base: list[_Sample] = []  # measurements of the last good knobs
        self._need = self.cfg.window  # samples of the good knobs wanted before the next move
        self._trial: _Trial | None = None
        self._holding_since: int | None = None  # iteration the search ran out of moves
        self._reference: float | None = None  # median cost (iteration) when it did
        self._idle: str | None = None  # why the policy holds without searching (update too small to matter)
        self._rejects = 0  # reverted moves since the baseline was last measured
        self._failed: set[str] = set()  # moves that did not help, since the last re-exploration
        self._bad: set[str] = set()  # knob settings that caused an error: never again
        self._momentum: str | None = None
        self._sigmas: deque[float] = deque(maxlen=20)  # relative noise, one estimate per measured window
        self._device_cap = 1.0
        self._others: dict[str, deque[float]] = {p: deque(maxlen=3) for p in self.paths}
        self._ours: dict[str, deque[float]] = {p: deque(maxlen=8) for p in self.paths}
        self._contended: set[str] = set()
        self._pre_contention: Knobs | None = None  # the good knobs when contention appeared
        self._returning: Knobs | None = None  # where to head back to once it vanished
        self._pre_shares: dict[str, float] = {}  # byte shares per path then (the engine's default weights)
        self._start_alt: Knobs | None = None  # the run's own start, tried against the model's plan
        self._staging_cap = self.cfg.host_staging_bytes or psutil.virtual_memory().available // 4

        self._knobs = self._good = start
        start = self._known_paths(start, "start knobs")
        if not self.has_device and start.device_fraction > 0:
            start = start.replace(device_fraction=0.0)
            self._note("no device lane: device_fraction set to 0", "guard")
        self._knobs = self._good = start
        if profile is not None:
            self._start_from_model(profile, start)

    # -- public ------------------------------------------------------------------------------

    @property
    def knobs(self) -> Knobs:
        """The knobs most recently decided (in force once the engine applies them)."""
        return self._knobs

    @property
    def frozen(self) -> bool:
        return self._frozen

    @property
    def pins(self) -> dict[str, Any]:
        return dict(self._pins)

    def state(self) -> dict:
        """What the policy is doing, for snapshots and the live view."""
        return {
            "mode": "frozen" if self._frozen else "trial" if self._trial else "holding" if self._holding_since is not None else "measuring",
            "trial": self._trial.move.what if self._trial else None,
            "good_knobs": self._good.to_dict(),
            "good_update_s": _median([s.update_s for s in self._base[-5:]]) if self._base else None,
            "good_iteration_s": (_median([s.iter_time_s for s in self._base[-5:] if s.iter_time_s])
                                 if any(s.iter_time_s for s in self._base[-5:]) else None),
            "holding_reason": self._idle,
            "threshold": self._threshold(),
            "contended_paths": sorted(self._contended),
            "pins": dict(self._pins),
            "frozen": self._frozen,
        }

    def observe(self, obs: Observation) -> Decision | None:
        """Take one iteration's figures; return new knobs when they should change."""
        self._iteration = obs.iteration
        if obs.device_headroom_bytes is not None:
            self._headroom = obs.device_headroom_bytes
        changes = self._track_contention(obs)
        if self._pending is not None:  # user requests apply even while frozen
            reason, self._pending = self._pending, None
            if changes and not self._frozen:
                self._on_contention_change(changes)  # no trial runs after a pin: only bookkeeping
            return self._decide(self._knobs, reason, "user")
        if self._frozen:
            return None
        if obs.error:
            return self._on_error(obs.error)
        if changes:
            d = self._on_contention_change(changes)
            if d is not None:
                return d
        if obs.knobs is not None and _as_knobs(obs.knobs) != self._knobs:
            return None  # measured under earlier knobs: the last change has not reached the engine yet
        if self._skip > 0:
            self._skip -= 1
            return None
        if not (isinstance(obs.update_s, (int, float)) and math.isfinite(obs.update_s) and obs.update_s > 0):
            return None  # no usable figure (a rank sent garbage, or nothing was updated)
        s = _Sample.of(obs, self.paths)
        if self._trial is not None:
            return self._judge(s)
        self._base.append(s)
        if self._holding_since is not None:
            return self._hold()
        if len(self._base) < self._need:
            return None
        self._add_noise([x.cost for x in self._base[-self._need:]])
        idle = self._negligible()
        if idle is not None and self._knobs == self._good:
            self._holding_since, self._idle = self._iteration, idle
            self._reference = _median([x.cost for x in self._base[-self.cfg.window:]])
            self._note(idle, "hold")
            return None
        return self._propose("")

    def pin(self, knob: str, value) -> None:
        """Fix ``knob`` (a Knobs field, or ``io_concurrency[PATH]``) at ``value``; never searched."""
        name, path = Knobs.parse_name(knob, self.paths)
        value = Knobs.read_value(name, value, self.paths)
        new = self._good.with_value(knob, value, self.paths, self.has_device)
        if name == "device_fraction" and new.device_fraction > 0 and not self._device_fits(new.device_fraction):
            why = ("this run has no device lane" if not self.has_device
                   else f"it ran out of GPU memory above {self._device_cap:g}")
            raise ConfigError(f"cannot pin device_fraction={new.device_fraction}: {why}; pin a smaller fraction")
        self._pins[knob if path is None else f"{name}[{path}]"] = value
        self._trial = None
        self._good = new
        self._restart_measuring()
        if new != self._knobs:
            self._knobs = new
            self._pending = f"pinned {knob}={value} by the user"
        else:
            self._note(f"pinned {knob}={value} by the user (already in force)", "user")

    def unpin(self, knob: str) -> None:
        name, path = Knobs.parse_name(knob, self.paths)
        key = knob if path is None else f"{name}[{path}]"
        if self._pins.pop(key, None) is None:
            raise ConfigError(f"knob {knob!r} is not pinned (pinned: {sorted(self._pins) or 'none'})")
        self._failed.clear()
        self._restart_measuring(keep_samples=True)
        self._note(f"unpinned {knob}: the search may change it again", "user")

    def freeze(self, frozen: bool) -> None:
        """Stop (True) or resume (False) tuning. Freezing ends a trial: back to the last good knobs."""
        frozen = bool(frozen)
        if frozen == self._frozen:
            return
        self._frozen = frozen
        if frozen:
            if self._trial is not None and self._knobs != self._good:
                what = self._trial.move.what
                self._knobs = self._good
                self._pending = f"tuning frozen by the user: trial of {what} ended, back to the last good knobs"
            else:
                self._note("tuning frozen by the user", "user")
            self._trial = None
        else:
            self._restart_measuring()
            self._note("tuning resumed by the user", "user")

    # -- decisions and the log ---------------------------------------------------------------

    def _decide(self, knobs: Knobs, reason: str, kind: str) -> Decision:
        self._knobs = knobs
        self._skip = max(self._skip, self.cfg.settle_iters)
        self._log(reason, kind, changed=True)
        return Decision(knobs, reason)

    def _note(self, reason: str, kind: str) -> None:
        """A decision that changes no knob (kept, holding, ignored error): logged all the same."""
        self._log(reason, kind, changed=False)

    def _log(self, reason: str, kind: str, *, changed: bool) -> None:
        self.log.append({"iteration": self._iteration, "knobs": self._knobs.to_dict(), "reason": reason, "kind": kind,
                         "changed": changed})
        if len(self.log) > 2 * LOG_ENTRIES:  # a daemon's run may last weeks: keep the recent part
            del self.log[:-LOG_ENTRIES]

    def _restart_measuring(self, keep_samples: bool = False) -> None:
        if not keep_samples:
            self._base = []
        self._need = self.cfg.window
        self._holding_since = None
        self._rejects = 0

    # -- the search --------------------------------------------------------------------------

    def _threshold(self) -> float:
        # A prior of 2% keeps the first verdicts cautious until real windows have been measured.
        sigma = _median([*self._sigmas, 0.02])
        return min(self.cfg.max_threshold, max(self.cfg.min_gain, self.cfg.noise_k * sigma))

    def _add_noise(self, xs: list[float]) -> None:
        """Pool a relative-noise estimate from one window: its range over its median, divided by
        the expected range of n normal samples in units of sigma (d2, as in control charts)."""
        d2 = {2: 1.128, 3: 1.693, 4: 2.059, 5: 2.326}.get(min(len(xs), 5))
        m = _median(xs) if xs else 0.0
        if d2 and m > 0:
            self._sigmas.append((max(xs) - min(xs)) / m / d2)

    def _propose(self, prefix: str, reverting: _Move | None = None) -> Decision | None:
        """Start the best untried move from the good knobs, or hold there. ``reverting``: the
        move just rejected, whose knobs are still in force."""
        if self._rejects >= 3 and self._knobs != self._good:
            # The baseline is old after several reverts: measure the good knobs again first.
            self._restart_measuring()
            return self._decide(self._good, prefix + "measuring the last good knobs again before further moves", "revert")
        move = self._next_move()
        if move is not None and reverting is not None and _family(move.key) == _family(reverting.key):
            # Going straight from one trial to the next on the same knob would be two steps in
            # one change: back to the good knobs first, then the next move after one sample.
            self._need = len(self._base) + 1
            return self._decide(self._good, prefix.rstrip("; "), "revert")
        if move is None:
            self._holding_since = self._iteration
            self._reference = _median([s.cost for s in self._base[-self.cfg.window:]]) if self._base else None
            msg = prefix + f"no move left to try; holding ({self._cost_name()} {self._reference:.3f} s)" if self._reference else prefix + "holding"
            if self._knobs != self._good:
                return self._decide(self._good, msg, "revert")
            self._note(msg, "hold")
            return None
        self._trial = _Trial(move)
        why = self._why(move)
        return self._decide(move.knobs, f"{prefix}trying {move.what}{why}", "trial")

    def _judge(self, s: _Sample) -> Decision | None:
        t = self._trial
        t.samples.append(s)
        xs = [x.cost for x in t.samples]
        base = _median([x.cost for x in self._base[-5:]])
        thr = self._threshold()
        n = len(xs)
        verdict = None
        if t.move.lenient:
            if n >= 2 and all(x > base * (1 + 2 * thr) for x in xs):
                verdict = False
            elif n >= self.cfg.window:
                verdict = _median(xs) <= base * (1 + thr)
        else:
            if n == 1 and xs[0] > base * (1 + max(0.25, 3 * thr)):
                verdict = False  # clearly worse: no need to wait for the window
            elif n >= 2 and all(x < base * (1 - 2 * thr) for x in xs):
                verdict = True  # clearly better
            elif n >= 2 and all(x > base * (1 + thr) for x in xs):
                verdict = False
            elif n >= self.cfg.window:
                verdict = _median(xs) < base * (1 - thr)
        if verdict is None:
            return None
        self._add_noise(xs)
        med = _median(xs)
        figures = f"{self._cost_name()} {base:.3f} -> {med:.3f} s, {100 * (med / base - 1):+.0f}%, threshold {100 * thr:.0f}%"
        if self._cost_name() == "iteration":  # the explanation: what the update phase did
            figures += (f"; update {_median([x.update_s for x in self._base[-5:]]):.3f} -> "
                        f"{_median([x.update_s for x in t.samples]):.3f} s")
        self._trial = None
        move = t.move
        if verdict:
            self._good, self._base, self._rejects = move.knobs, list(t.samples), 0
            self._momentum = move.key
            if _opposite(move.key):
                self._failed.add(_opposite(move.key))  # undoing a gain is pointless
            if move.key == "start":
                self._start_alt = None
            return self._propose(f"kept {move.what} ({figures}); ")
        self._failed.add(move.key)
        self._rejects += 1
        self._momentum = None
        if move.key == "start":
            self._start_alt = None
        if move.key == "return":
            self._returning = None
        return self._propose(f"reverted {move.what} ({figures}); ", reverting=move)

    def _hold(self) -> Decision | None:
        w = self.cfg.window
        self._base = self._base[-2 * w:]
        recent = [s.cost for s in self._base[-w:]]
        if self._idle is not None:
            if len(recent) >= w and self._negligible(2.0) is None:
                self._idle, self._holding_since = None, None
                self._base = self._base[-w:]
                return self._propose("the update phase grew past the point where tuning pays; re-exploring; ")
            return None  # holding: nothing the knobs change is worth measuring
        if len(recent) >= w and self._reference and _median(recent) > self._reference * (1 + self.cfg.drift):
            self._failed.clear()
            self._holding_since = None
            self._base = self._base[-w:]
            return self._propose(f"{self._cost_name()} rose {100 * (_median(recent) / self._reference - 1):.0f}% while "
                                 f"holding; re-exploring; ")
        every = self.cfg.reexplore_every_iters
        if every and self._iteration - self._holding_since >= every:
            self._failed.clear()
            self._holding_since = None
            return self._propose(f"{every} iterations since the last move; re-exploring; ")
        return None

    def _cost_name(self) -> str:
        return "iteration" if self._base and all(x.iter_time_s for x in self._base[-self.cfg.window:]) else "update"

    def _negligible(self, factor: float = 1.0) -> str | None:
        """Why no move can pay, or None when one can: what the knobs can change is under the
        bar (``factor`` x the larger of ``negligible_share`` and twice the noise threshold) as
        a share of the iteration, medians of the last window. Without a device lane the knobs
        change only the update's I/O waits; with one, the whole update phase."""
        b = self._base[-self.cfg.window:]
        if not b:
            return None
        it = _median([x.cost for x in b])
        upd = _median([x.update_s for x in b])
        if self.has_device:
            tunable, what = upd, "the update phase"
        else:
            tunable, what = _median([x.read_wait_s + x.write_wait_s for x in b]), "the update's I/O waits"
        bar = factor * max(self.cfg.negligible_share, 2 * self._threshold())
        share = tunable / it if it > 0 else 1.0
        if share >= bar:
            return None
        return (f"holding: what the knobs can change ({what}, {1e3 * tunable:.1f} ms) is {100 * share:.1f}% of the "
                f"{self._cost_name()} ({1e3 * it:.0f} ms), under {100 * bar:.0f}%: no move could show above the noise")

    def _why(self, move: _Move) -> str:
        st = self._stats()
        if move.key == "return":
            return ": contention is gone"
        if move.key == "start":
            return ": the run's own starting knobs, against the model's plan"
        if move.key.startswith("stripe_weights") and move.key[len("stripe_weights["):-2] in self._contended:
            return ": that path is contended"
        if move.key.startswith("io_concurrency") and move.key.endswith("-") and move.key[len("io_concurrency["):-2] in self._contended:
            return ": that path is contended"
        if not st:
            return ""
        return f" (read wait {100 * st['read_share']:.0f}%, write wait {100 * st['write_share']:.0f}% of the update)"

    def _stats(self) -> dict:
        """Medians over the baseline: where the update time goes, and each path's share of bytes."""
        b = self._base[-5:]
        if not b:
            return {}
        upd = _median([s.update_s for s in b]) or 1e-9
        moved = {p: _median([s.path_bytes_per_s.get(p, 0.0) for s in b]) for p in self.paths}
        total = sum(moved.values())
        return {
            "read_share": min(1.0, _median([s.read_wait_s for s in b]) / upd),
            "write_share": min(1.0, _median([s.write_wait_s for s in b]) / upd),
            "shares": {p: v / total for p, v in moved.items()} if total > 0 else {},
        }

    def _next_move(self) -> _Move | None:
        scored = sorted(self._candidates(), key=lambda sm: -sm[0])
        for _, m in scored:
            if m.key in self._failed or m.knobs == self._good or _knobs_key(m.knobs) in self._bad:
                continue
            return m
        return None

    def _candidates(self) -> list[tuple[float, _Move]]:
        k, st, cfg = self._good, self._stats(), self.cfg
        read_share = st.get("read_share", 0.0)
        io_share = min(1.0, read_share + st.get("write_share", 0.0))
        shares = st.get("shares", {})
        out: list[tuple[float, _Move]] = []
        if self._returning is not None:
            back = self._step_toward(k, self._returning)
            if back != k:
                out.append((3.0, _Move("return", back, f"back toward the plan before contention ({_diff(k, back)})",
                                       lenient=True)))
            else:
                self._returning = None
        if self._start_alt is not None:
            out.append((2.5, _Move("start", self._start_alt, f"the starting knobs ({_diff(k, self._start_alt)})")))
        if self.paths and not self._pinned("prefetch_depth"):  # prefetch only matters with state on storage
            d = k.prefetch_depth
            up = min(d + (2 if read_share > 0.3 else 1), self._prefetch_cap())
            if up > d:
                out.append((0.2 + 2 * read_share, _Move("prefetch_depth+", k.replace(prefetch_depth=up),
                                                        f"prefetch_depth {d}->{up}")))
            if d > 0:
                out.append((0.02, _Move("prefetch_depth-", k.replace(prefetch_depth=d - 1), f"prefetch_depth {d}->{d - 1}")))
        for p in self.paths:
            if self._pinned("io_concurrency", p):
                continue
            c = k.concurrency_for(p)
            conc = dict(k.io_concurrency)
            if c < 64:
                conc[p] = min(64, 2 * c)
                out.append((0.1 + io_share * shares.get(p, 1.0 / len(self.paths)),
                            _Move(f"io_concurrency[{p}]+", k.replace(io_concurrency=dict(conc)), f"io_concurrency[{p}] {c}->{conc[p]}")))
            if c > 1:
                conc[p] = c // 2
                out.append((1.5 if p in self._contended else 0.03,
                            _Move(f"io_concurrency[{p}]-", k.replace(io_concurrency=dict(conc)), f"io_concurrency[{p}] {c}->{c // 2}")))
        if len(self.paths) > 1 and not self._pinned("stripe_weights"):
            w = self._weights(k, shares)
            for p in self.paths:
                new = self._shift_away(w, p) if w else None
                if new is None:
                    continue
                calm_elsewhere = any(q not in self._contended for q in self.paths if q != p)
                score = 2.0 if p in self._contended and calm_elsewhere else 0.05 + 0.3 * io_share
                out.append((score, _Move(f"stripe_weights[{p}]-", k.replace(stripe_weights=new),
                                         f"stripe weight of {p} {w[p]:.3g}->{new[p]:.3g}")))
        if self.has_device and not self._pinned("device_fraction"):
            f = k.device_fraction
            target = self._balanced_fraction()
            if target is not None:
                t, why = target
                t = min(t, self._device_cap)
                if abs(t - f) >= 0.05 - 1e-9:
                    key = "device_fraction+" if t > f else "device_fraction-"
                    out.append((1.2, _Move(key, k.replace(device_fraction=t), f"device_fraction {f:.2g}->{t:.2g} ({why})")))
            else:  # no lane times reported: bounded steps
                up = round(min(1.0, self._device_cap, f + cfg.device_step), 6)
                if up > f + 1e-9 and self._device_fits(up):
                    out.append((0.1 + (1 - io_share), _Move("device_fraction+", k.replace(device_fraction=up),
                                                            f"device_fraction {f:.2g}->{up:.2g}")))
                if f > 0:
                    down = round(max(0.0, f - cfg.device_step), 6)
                    out.append((0.03, _Move("device_fraction-", k.replace(device_fraction=down),
                                            f"device_fraction {f:.2g}->{down:.2g}")))
        if self.ranks > 1 and not self._pinned("node_lock"):
            out.append((0.1 + 0.5 * io_share, _Move("node_lock", k.replace(node_lock=not k.node_lock),
                                                    f"node_lock {k.node_lock}->{not k.node_lock}")))
        return [(s + (1.0 if m.key == self._momentum else 0.0), m) for s, m in out]

    def _balanced_fraction(self) -> tuple[float, str] | None:
        """Where the lanes' measured times say the device fraction should go (steps of 0.05),
        and why; None without lane times, or when no subgroup is outside the device tier.

        The step waits at its end only for the device lane, so a wait means the GPU side (its
        PCIe copies) finished last and took about the whole update: its rate is lane subgroups
        over the update time, the host lane's is its subgroups over its busy time, and the
        fraction where both finish together is ``r_dev / (r_dev + r_host)``. No wait means the
        GPU kept up and its rate is only known to be enough: one ``device_step`` more (runs
        start from the engine's measured balance, so this is a refinement). No device lane yet:
        half the subgroups, once."""
        lanes = [x.lanes for x in self._base[-self.cfg.window:] if x.lanes is not None]
        if not lanes:
            return None
        host_s = _median([x[0] for x in lanes])
        wait = _median([x[1] for x in lanes])
        host_n, dev_n, tier = lanes[-1][2], lanes[-1][3], lanes[-1][4]
        lane_n = dev_n - tier
        rest = host_n + lane_n
        if rest <= 0:
            return None
        upd = _median([x.update_s for x in self._base[-self.cfg.window:]])
        f = self._good.device_fraction
        if lane_n > 0 and host_n > 0 and wait > 0.05 * upd and host_s > 0:
            r_dev, r_host = lane_n / upd, host_n / host_s
            t = r_dev / (r_dev + r_host)
            why = f"the GPU's tail is {1e3 * wait:.0f} ms of the update: the lanes finish together there"
        elif lane_n > 0 and host_n == 0 and wait > 0.05 * upd:
            t = 0.5
            why = f"every subgroup on the GPU and its tail is {1e3 * wait:.0f} ms: share with the CPU"
        elif host_n > 0 and lane_n == 0:
            t = 0.5  # nothing known of the GPU's rate yet: one bold probe, refined from its times
            why = "no device lane yet: half of the subgroups to the GPU"
        elif host_n > 0:
            t = f + self.cfg.device_step  # its rate is only known to be at least enough: probe upward
            why = f"the GPU kept up (tail {1e3 * wait:.0f} ms): give it more"
        else:
            return None
        return round(round(t * 20) / 20, 6), why

    # -- stripe weights ------------------------------------------------------------------------

    def _weights(self, k: Knobs, shares: Mapping[str, float]) -> dict[str, float] | None:
        """Current stripe weights as shares summing to 1: the knobs', else the observed byte shares
        (the engine's default weights are its measured bandwidths, which the policy cannot see)."""
        if all(p in k.stripe_weights for p in self.paths):
            w = {p: float(k.stripe_weights[p]) for p in self.paths}
        elif shares and sum(shares.values()) > 0:
            w = dict(shares)
        else:
            return None
        total = sum(w.values())
        return {p: v / total for p, v in w.items()} if total > 0 else None

    def _shift_away(self, w: dict[str, float], p: str) -> dict[str, float] | None:
        others = [q for q in self.paths if q != p]
        if w[p] <= 1e-6 or not others:
            return None
        d = self.cfg.stripe_step * w[p]
        out = dict(w)
        out[p] -= d
        rest = sum(w[q] for q in others)
        for q in others:
            out[q] += d * (w[q] / rest if rest > 0 else 1 / len(others))
        return {q: round(v, 4) for q, v in out.items()}

    def _step_toward(self, k: Knobs, target: Knobs) -> Knobs:
        """One bounded move of every searchable knob from ``k`` toward ``target``."""
        out = k
        if not self._pinned("prefetch_depth"):
            d, t = k.prefetch_depth, target.prefetch_depth
            out = out.replace(prefetch_depth=min(d + max(-2, min(2, t - d)), max(d, self._prefetch_cap())))
        if not self._pinned("device_fraction"):
            f, t = k.device_fraction, target.device_fraction
            f2 = round(f + max(-self.cfg.device_step, min(self.cfg.device_step, t - f)), 6)
            if f2 <= f or (f2 <= self._device_cap and self._device_fits(f2)):  # the headroom may have shrunk since
                out = out.replace(device_fraction=f2)
        conc = dict(out.io_concurrency)
        for p in self.paths:
            if self._pinned("io_concurrency", p):
                continue
            c, t = k.concurrency_for(p), target.concurrency_for(p)
            conc[p] = min(t, 2 * c) if t > c else max(t, c // 2)
            if conc[p] == t and p not in target.io_concurrency:
                del conc[p]  # back to the engine's default, as the target has it
        out = out.replace(io_concurrency=conc, node_lock=target.node_lock if not self._pinned("node_lock") else k.node_lock)
        if len(self.paths) > 1 and not self._pinned("stripe_weights") and k.stripe_weights != target.stripe_weights:
            cur = self._weights(k, self._stats().get("shares", {}))
            tgt = self._weights(target, self._pre_shares)
            if cur and tgt:
                # Paths losing weight lose at most stripe_step of theirs; the gainers share it.
                delta = {p: tgt[p] - cur[p] for p in self.paths}
                loss = {p: min(-delta[p], self.cfg.stripe_step * cur[p]) for p in self.paths if delta[p] < 0}
                if all(loss[p] >= -delta[p] - 1e-9 for p in loss):
                    out = out.replace(stripe_weights=dict(target.stripe_weights))  # within one step: exactly there
                else:
                    moved, gain = sum(loss.values()), sum(v for v in delta.values() if v > 0)
                    new = {p: cur[p] - loss.get(p, 0.0) + (moved * delta[p] / gain if delta[p] > 0 else 0.0)
                           for p in self.paths}
                    out = out.replace(stripe_weights={p: round(v, 4) for p, v in new.items()})
        return out

    # -- guard rails -----------------------------------------------------------------------------

    def _subgroups_per_rank(self) -> int | None:
        if not self.params or not self.subgroup_bytes:
            return None
        return max(1, math.ceil(12 * self.params / self.subgroup_bytes))  # params are per rank

    def _device_fits(self, f: float) -> bool:
        """The device lane may run at fraction ``f``: there is a device, and no OOM happened at or
        below ``f``. Its memory is the engine's to keep within the headroom (module docstring)."""
        return f <= 0 or (self.has_device and f <= self._device_cap + 1e-9)

    def _prefetch_cap(self) -> int:
        cap = self.cfg.max_prefetch_depth
        n = self._subgroups_per_rank()
        if n is not None:
            cap = min(cap, max(0, n - 1))  # deeper than the subgroups buys nothing
        if self.subgroup_bytes:
            per = self.subgroup_bytes * self.ranks
            cap = min(cap, max(0, (self._staging_cap // per - 3) // 2))
        return cap

    def _on_error(self, error: str) -> Decision | None:
        if self._trial is not None:
            move, self._trial = self._trial.move, None
            self._bad.add(_knobs_key(move.knobs))
            self._failed.add(move.key)
            self._need = max(self._need, len(self._base))  # the baseline still holds: go on after settling
            return self._decide(self._good, f"rolled back {move.what} after an error on a rank ({error}); "
                                f"those knobs are not tried again", "rollback")
        f = self._knobs.device_fraction
        if "oom" in error.lower() and f > 0:
            self._bad.add(_knobs_key(self._knobs))
            down = round(max(0.0, f - self.cfg.device_step), 6)
            self._device_cap = down
            self._good = self._knobs.replace(device_fraction=down)
            self._restart_measuring()
            return self._decide(self._good, f"out of memory with the device lane at {f:.2g} ({error}): lowered to "
                                f"{down:.2g}, and never raised above it again", "rollback")
        self._note(f"error on a rank under the last good knobs ({error}); nothing to roll back", "error")
        return None

    # -- contention ------------------------------------------------------------------------------

    def _track_contention(self, obs: Observation) -> list[tuple[str, bool, float]]:
        """Update each path's contended state; return (path, appeared, others' bytes/s) changes."""
        changes = []
        for p in self.paths:
            other = float(obs.path_other_bytes_per_s.get(p, 0.0) or 0.0)
            ours = obs.path_read_bytes_per_s.get(p, 0.0) + obs.path_write_bytes_per_s.get(p, 0.0)
            hist = self._others[p]
            hist.append(other)
            if p not in self._contended:
                self._ours[p].append(ours)
            thr = max(self.cfg.contention_min_bytes_per_s,
                      self.cfg.contention_ratio * (_median(self._ours[p]) if self._ours[p] else 0.0))
            if p not in self._contended:
                # One iteration far above the threshold, or two above it.
                if other >= 2 * thr or (len(hist) >= 2 and min(hist[-1], hist[-2]) >= thr):
                    self._contended.add(p)
                    changes.append((p, True, other))
            elif len(hist) >= 2 and max(hist[-1], hist[-2]) < thr / 2:
                self._contended.discard(p)
                changes.append((p, False, other))
        return changes

    def _on_contention_change(self, changes: list[tuple[str, bool, float]]) -> Decision | None:
        desc = "; ".join(f"contention {'appeared' if up else 'vanished'} on {p} (others {other / 1e6:.0f} MB/s)"
                         for p, up, other in changes)
        if any(up for _, up, _ in changes) and self._pre_contention is None:
            if self._returning is None:
                self._pre_contention = self._good
                self._pre_shares = self._stats().get("shares", {})
            else:  # back before the return finished: keep heading for the same plan afterwards
                self._pre_contention = self._returning
            self._returning = None
        if not self._contended and self._pre_contention is not None:
            self._returning, self._pre_contention = self._pre_contention, None
        # Earlier verdicts were made in another regime: forget them and measure again.
        self._failed.clear()
        self._momentum = None
        self._restart_measuring()
        self._need = self.cfg.rebaseline_iters
        if self._trial is not None:
            what, self._trial = self._trial.move.what, None
            return self._decide(self._good, f"{desc}: trial of {what} abandoned, measuring the last good knobs", "contention")
        self._note(f"{desc}: measuring the current knobs again", "contention")
        return None

    # -- the model's plan ------------------------------------------------------------------------

    def _start_from_model(self, profile, start: Knobs) -> None:
        try:
            from perf import model as perfmodel
            if isinstance(profile, str):
                from perf.profile_toml import load_profile
                profile = load_profile(profile)
            # The host cache is fixed for the run's life and not a knob: plan for state on the
            # paths, with host memory for the staging buffers of the deepest prefetch only.
            staging = (2 * self.cfg.max_prefetch_depth + 3) * self.subgroup_bytes * self.ranks if self.paths else None
            # params are per rank; the model's are the whole model (it divides by ranks and nodes).
            wl = perfmodel.Workload(params=self.params * self.ranks, ranks=self.ranks,
                                    subgroup_numel=max(1, self.subgroup_bytes // 12),
                                    host_bytes=staging, gpu_headroom_bytes=self._headroom)
            pred = perfmodel.best_plan(profile, wl, paths=list(self.paths))
            plan = self._known_paths(pred.plan.knobs, "the model's plan")
        except Exception as e:  # the model is advice: without it the search starts from `start`
            self._note(f"performance model not used ({type(e).__name__}: {e}); searching from the starting knobs", "model")
            return
        fit = plan.device_fraction
        while fit > 0 and not self._device_fits(fit):
            fit = round(max(0.0, fit - self.cfg.device_step), 6)
        plan = plan.replace(device_fraction=fit)
        if plan == start:
            self._note(f"the performance model's best plan for profile {getattr(profile, 'name', profile)} is the "
                       f"starting plan", "model")
            return
        self._knobs = self._good = plan
        self._start_alt = start
        self._pending = (f"performance model's best plan for profile {getattr(profile, 'name', profile)} "
                         f"(predicted update {pred.update_s:.3f} s): {_diff(start, plan)}")

    # -- knob names and values -------------------------------------------------------------------

    def _known_paths(self, k: Knobs, what: str) -> Knobs:
        """``k`` less entries for paths this run does not have (the engine would refuse them)."""
        conc = {p: v for p, v in k.io_concurrency.items() if p in self.paths}
        weights = {p: v for p, v in k.stripe_weights.items() if p in self.paths}
        if len(weights) != len(self.paths):
            weights = {}  # partial weights would mix with the engine's measured bandwidths
        dropped = (set(k.io_concurrency) - set(conc)) | (set(k.stripe_weights) - set(weights))
        if dropped:
            self._note(f"{what} name paths this run does not use, or not all of them: dropped {sorted(dropped)}", "guard")
        return k.replace(io_concurrency=conc, stripe_weights=weights)

    def _pinned(self, name: str, path: str | None = None) -> bool:
        return name in self._pins or (path is not None and f"{name}[{path}]" in self._pins)


def _diff(a: Knobs, b: Knobs) -> str:
    """The knobs that differ, 'name old->new' each."""
    da, db = a.to_dict(), b.to_dict()
    parts = [f"{key} {da[key]}->{db[key]}" for key in da if da[key] != db[key]]
    return ", ".join(parts) or "no change"
