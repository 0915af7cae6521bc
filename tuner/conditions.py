"""The paths' rates and what the model makes of them: each storage path's service rate as it is
now (:class:`Conditions`), a **change of conditions** when a path's rate moves beyond its noise
for a few iterations (:class:`RateChange`), and the stripe that balances the paths at their
measured rates (:func:`balanced_stripe`), the move the tuner makes at once on a change
(:class:`tuner.guards.Adaptation` holds what changed and what the tuner did about it).

The engine reports, per path and step, the bytes it read and wrote and the seconds the path was
busy reading and writing (``StepRecord.path_*_busy_s``): bytes over busy time is the rate the
path serves at now, whatever the gaps between requests. Reads and writes are followed apart
(a step may read little: its subgroups were kept in memory); a path's rate for the model is
one round trip of the same bytes, ``1 / (1/read + 1/write)``, the engine's own default stripe
weight (:func:`engine.placement.round_trip_rate`). A throttled drive, a burst buffer another tenant fills,
a competing O_DIRECT job: each shows as a rate that drops and stays down, which the iteration
time alone cannot attribute to a path.

Our own knob changes move rates too: more requests in flight, the node lock, and the stripe (a
lightly loaded path's requests meet less queueing and read faster than its steady rate). A path
has a reference per setting of its concurrency, the node lock, the prefetch depth and the stripe,
each measured from the second iteration under it; a change that comes during a trial is seen
once the knobs are back. A direction's rate that moves (reads, writes) is a change of the path
only when the path's round trip moves beyond the band too.
"""

from __future__ import annotations

import math
import statistics
from dataclasses import dataclass, field
from typing import Mapping, Sequence

from engine.config import Knobs
from engine.placement import round_trip_rate
from tuner.measurement import relative_noise
from tuner.observation import Observation
from tuner.policy_config import PolicyConfig

NOISE_FLOOR = 0.03
"""Smallest relative noise a path's rate is credited with (a quiet emulated tier shows ~1%)."""
REFERENCE_SAMPLES = 5
"""Rates within the band that the reference is the median of (it follows slow drift)."""
STEADY_AGREEMENT = 0.1
"""The start's rates have settled when two consecutive windows of ``change_iters`` iterations
under the same knobs agree within this, per path (:meth:`Conditions.steady_rates`): a run's first
iterations fill caches and queues, and a reference taken from them can miss the steady rate by
more than the band (a quiet run was re-striped at start for it)."""


@dataclass(frozen=True)
class RateChange:
    """One path's rate moved beyond its noise for ``PolicyConfig.change_iters`` iterations."""

    path: str
    before_bytes_per_s: float
    """The path's round trip before (what the model weighs)."""
    after_bytes_per_s: float
    moved: tuple[tuple[str, float, float], ...] = ()
    """The directions that changed: ('reads' or 'writes', before, after), in bytes/s."""

    @property
    def slowed(self) -> bool:
        return self.after_bytes_per_s < self.before_bytes_per_s

    def describe(self) -> str:
        """In the rates a user knows their drive by: 'path /ssd1 slowed: reads 300 -> 60 MB/s,
        writes 290 -> 62 MB/s', or 'path /ssd1 writes slowed from 440 to 60 MB/s' when one moved."""
        verb = "slowed" if self.slowed else "sped up"
        if len(self.moved) == 1:
            ((d, b, a),) = self.moved
            return f"path {self.path} {d} {verb} from {_mb(b)} to {_mb(a)} MB/s"
        return f"path {self.path} {verb}: " + ", ".join(f"{d} {_mb(b)} -> {_mb(a)} MB/s" for d, b, a in self.moved)


@dataclass
class _Reference:
    """One path's rate under one setting of the knobs that move it: the rates that agree with
    it, and those that do not."""

    skip: int = 1
    """Iterations still to leave out: the first under new knobs (a re-stripe moves subgroups at
    their next write, so its traffic is neither the old stripe's nor the new one's)."""
    agreeing: list[float] = field(default_factory=list)
    """The last rates within the band (the reference is their median), oldest first."""
    sigma: float = NOISE_FLOOR
    outside: list[float] = field(default_factory=list)
    """Consecutive rates beyond the band, all on the same side."""

    @property
    def rate(self) -> float | None:
        return statistics.median(self.agreeing) if len(self.agreeing) >= 3 else None


class Conditions:
    """Each path's rate now, and the changes of conditions (see the module docstring).

    A path keeps one reference per setting of the knobs that move its rate (its concurrency, the
    node lock, the prefetch depth, the stripe): a trial of another setting measures its own, and a
    change that comes during a trial is seen once the knobs are back. A change makes every other
    reference of the path stale: they are dropped."""

    def __init__(self, paths: Sequence[str], cfg: PolicyConfig) -> None:
        self.cfg = cfg
        self.paths = list(paths)
        self._refs: dict[tuple[str, str], dict[IoKey | None, _Reference]] = {(p, d): {} for p in self.paths for d in _DIRECTIONS}
        self._now: dict[tuple[str, str], float] = {}
        self._steady: dict[str, list[float]] = {p: [] for p in self.paths}
        """Each path's round trip per iteration under the same knobs, the last two windows."""
        self._steady_key: tuple[IoKey, ...] | None = None
        self._steady_skip = 1

    def rates(self) -> dict[str, float]:
        """Each path's round-trip bytes/s now (as last measured), for the paths measured so far; a
        direction not measured yet is taken to run at the other's rate."""
        out = {}
        for p in self.paths:
            r, w = self._now.get((p, "reads"), 0.0), self._now.get((p, "writes"), 0.0)
            if r or w:
                out[p] = round_trip_rate(r or w, w or r)
        return out

    def known(self) -> bool:
        """Every path's rate has been measured (the model can weigh all of them)."""
        return len(self.rates()) == len(self.paths) > 0

    def steady_rates(self) -> dict[str, float] | None:
        """Each path's round trip once it has settled: the later window's median when the last
        two windows of ``change_iters`` iterations under the same knobs agree within
        :data:`STEADY_AGREEMENT` for every path; None while any path still drifts."""
        n = self.cfg.change_iters
        out = {}
        for p, xs in self._steady.items():
            if len(xs) < 2 * n:
                return None
            early, late = statistics.median(xs[:n]), statistics.median(xs[n:])
            if abs(math.log(late / early)) > math.log1p(STEADY_AGREEMENT):
                return None
            out[p] = late
        return out if out else None

    def _track_steady(self, obs: Observation, knobs: Knobs | None) -> None:
        key = tuple(_io_key(knobs, p) for p in self.paths) if knobs is not None else self._steady_key
        if key != self._steady_key:  # other knobs, other rates: start again, past their first iteration
            self._steady_key, self._steady, self._steady_skip = key, {p: [] for p in self.paths}, 1
        if self._steady_skip > 0:
            self._steady_skip -= 1
            return
        for p, xs in self._steady.items():
            r, w = obs.path_read_rate.get(p, 0.0), obs.path_write_rate.get(p, 0.0)
            if r > 0 or w > 0:
                xs.append(round_trip_rate(r or w, w or r))
                del xs[: -2 * self.cfg.change_iters]

    def track(self, obs: Observation, knobs: Knobs | None) -> list[RateChange]:
        """Take one iteration's rates; return the paths whose rate changed. ``knobs``: those in
        force for the iteration (None: unknown, taken as the same as before)."""
        self._track_steady(obs, knobs)
        changes = []
        for p in self.paths:
            moved: dict[str, tuple[float, float]] = {}
            for d, x in (("reads", obs.path_read_rate.get(p, 0.0)), ("writes", obs.path_write_rate.get(p, 0.0))):
                if not x > 0:
                    continue  # too little traffic this iteration to say
                key = _io_key(knobs, p) if knobs is not None else None
                ref = self._refs[(p, d)].setdefault(key, _Reference())
                change = self._add(ref, x)
                if ref.rate is not None:
                    self._now[(p, d)] = ref.rate
                if change is not None:
                    self._refs[(p, d)] = {key: ref}  # the others were measured under the old conditions
                    self._now[(p, d)] = change[1]
                    moved[d] = change
            if not moved:
                continue
            # A change of the path, not of one direction alone: its round trip (what the model
            # weighs) moved beyond the band too, from the references that changed. A direction
            # that moved less than that (a lightly loaded path's writes read faster than its cap)
            # becomes its new reference silently.
            old = {d: moved[d][0] if d in moved else self._now.get((p, d), 0.0) for d in _DIRECTIONS}
            new = {d: self._now.get((p, d), 0.0) for d in _DIRECTIONS}
            before, after = (round_trip_rate(r["reads"] or r["writes"], r["writes"] or r["reads"]) for r in (old, new))
            if not (before > 0 and after > 0 and abs(math.log(after / before)) > math.log1p(self.cfg.rate_change)):
                continue
            changes.append(RateChange(p, before, after, tuple((d, b, a) for d, (b, a) in moved.items())))
        return changes

    def _add(self, ref: _Reference, x: float) -> tuple[float, float] | None:
        """Add rate ``x`` to ``ref``; (before, after) when it is a change."""
        if ref.skip > 0:
            ref.skip -= 1
            return None
        before = ref.rate
        if before is None:
            ref.agreeing.append(x)
            if len(ref.agreeing) >= 3:
                ref.sigma = _relative_noise(ref.agreeing)
            return None
        band = max(math.log1p(self.cfg.rate_change), self.cfg.noise_k * ref.sigma)
        d = math.log(x / before)
        if abs(d) <= band:
            ref.outside = []
            ref.agreeing = [*ref.agreeing, x][-REFERENCE_SAMPLES:]
            return None
        if ref.outside and (math.log(ref.outside[-1] / before) > 0) != (d > 0):
            ref.outside = []  # the other side: not the same change
        ref.outside.append(x)
        if len(ref.outside) < self.cfg.change_iters:
            return None
        ref.agreeing, ref.outside = list(ref.outside), []
        ref.sigma = max(ref.sigma, _relative_noise(ref.agreeing))
        return before, statistics.median(ref.agreeing)


def balanced_stripe(rates: Mapping[str, float], floor: float) -> dict[str, float]:
    """Stripe weights (shares summing to 1) under which every path takes the same time for its
    bytes at ``rates``: each path's share in proportion to its rate, and at least ``floor`` (a
    slow path keeps some bytes, so that its rate is still measured and its recovery seen)."""
    w = {p: r / sum(rates.values()) for p, r in rates.items()}
    low = {p for p, v in w.items() if v < floor}
    if low and len(low) < len(w):
        rest = sum(rates[p] for p in w if p not in low)
        w = {p: floor if p in low else (1 - floor * len(low)) * rates[p] / rest for p in w}
    return {p: round(v, 4) for p, v in w.items()}


def io_time(shares: Mapping[str, float], rates: Mapping[str, float]) -> float:
    """Seconds per byte moved in all when the paths work in parallel: the slowest path's share
    over its rate (the paths' time per iteration, up to the iteration's bytes)."""
    return max(shares.get(p, 0.0) / r for p, r in rates.items())


_DIRECTIONS = ("reads", "writes")
IoKey = tuple[int, bool, int, tuple[tuple[str, float], ...]]  # the knobs that move a path's rate, as _io_key reads them


def _io_key(k: Knobs, path: str) -> IoKey:
    return k.concurrency_for(path), k.node_lock, k.prefetch_depth, tuple(sorted(k.stripe_weights.items()))


def _relative_noise(xs: Sequence[float]) -> float:
    return max(NOISE_FLOOR, relative_noise(xs) or 0.0)


def _mb(x: float) -> str:
    return f"{x / 1e6:.0f}"


@dataclass(frozen=True)
class Restripe:
    """The model's move after a change: from the stripe in force to the balanced one."""

    before: dict[str, float]
    """The shares in force (the knobs' weights, else the bytes each path moved)."""
    after: dict[str, float]
    gain: float
    """The share of the paths' I/O time the model predicts it saves."""

    def describe(self) -> str:
        """'stripe weight /ssd1 0.5 -> 0.17' (each path that moves; the others take the rest)."""
        moved = [p for p in self.after if abs(self.after[p] - self.before.get(p, 0.0)) >= 0.005]
        slow_first = sorted(moved, key=lambda p: self.after[p] - self.before.get(p, 0.0))
        return ", ".join(f"stripe weight {p} {self.before.get(p, 0.0):.2g} -> {self.after[p]:.2g}" for p in slow_first)


def restripe(rates: Mapping[str, float], shares: Mapping[str, float], cfg: PolicyConfig) -> Restripe | None:
    """The balanced stripe at ``rates`` when it saves at least ``cfg.model_gain`` of the paths'
    I/O time against ``shares`` (the stripe in force), else None: close enough to balance that
    small moves may refine it, and a re-stripe would cost more in trials than it gains."""
    if len(rates) < 2 or set(shares) != set(rates) or not sum(shares.values()) > 0:
        return None
    total = sum(shares.values())
    before = {p: v / total for p, v in shares.items()}
    after = balanced_stripe(rates, cfg.min_stripe_share)
    gain = 1.0 - io_time(after, rates) / io_time(before, rates)
    return Restripe(before, after, gain) if gain >= cfg.model_gain else None
