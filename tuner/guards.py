"""The tuner policy's guard rails: what the run's resources allow (:class:`Limits`: the device
lane's fraction cap after an OOM, the prefetch depth that staging memory and the subgroup
count allow), and what changed and what the tuner did about it (:class:`Adaptation`): another
process contending for a path's device (:class:`Contention`) or a path's rate moving
(:mod:`tuner.conditions`), the plan to head back to once contention is gone, the model's
re-stripe, and the log of each change with its measured effect.

These keep state and answer questions; the policy applies the answers to its loop (the trial
it abandons, the ledger it clears, the knobs it measures again: :mod:`tuner.policy`).
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass
from statistics import median
from typing import Any, Mapping, Sequence

import psutil

from engine.config import Knobs
from engine.layout import STATE_BYTES_PER_ELEMENT, deepest_prefetch
from tuner.conditions import Conditions, RateChange, restripe
from tuner.measurement import Sample
from tuner.observation import Observation
from tuner.policy_config import PolicyConfig
from tuner.run_state import RunFacts

STEADY_WAIT_WINDOWS = 4
"""The start's check of the stripe waits this many windows of ``change_iters`` iterations for
the rates to settle (:meth:`tuner.conditions.Conditions.steady_rates`); rates that never do are
no ground for a start move (a change of conditions still re-stripes)."""


class Limits:
    """Caps on the knobs for one run. ``device_cap`` only comes down (set by the policy below the
    fraction where an OOM happened); the staging cap, host bytes per rank for staging buffers, is
    fixed when the policy starts: the spare part of the engine's host-memory budget (the run's
    ``host_staging_bytes``, from the ranks' registrations), else the config's, else a quarter of
    what is available now shared by the ranks."""

    def __init__(self, cfg: PolicyConfig, facts: RunFacts) -> None:
        self.cfg = cfg
        self.facts = facts
        self.device_cap = 1.0
        staging = facts.host_staging_bytes
        self.staging_cap = (
            staging if staging is not None else cfg.host_staging_bytes or psutil.virtual_memory().available // 4 // facts.ranks
        )

    def subgroups_per_rank(self) -> int | None:
        if not self.facts.params or not self.facts.subgroup_bytes:
            return None
        return max(1, math.ceil(STATE_BYTES_PER_ELEMENT * self.facts.params / self.facts.subgroup_bytes))  # params are per rank

    def device_fits(self, f: float) -> bool:
        """The device lane may run at fraction ``f``: there is a device, and no OOM happened at or
        below ``f``. Its memory is the engine's to keep within the headroom (tuner.policy's docstring)."""
        return f <= 0 or (self.facts.has_device and f <= self.device_cap + 1e-9)

    def prefetch_cap(self) -> int:
        cap = self.cfg.max_prefetch_depth
        n = self.subgroups_per_rank()
        if n is not None:
            cap = min(cap, max(0, n - 1))  # deeper than the subgroups buys nothing
        if self.facts.subgroup_bytes:
            cap = min(cap, max(0, deepest_prefetch(self.staging_cap // self.facts.subgroup_bytes)))
        return cap


class Contention:
    """Per path: is another process's traffic on its device enough to count as contention?"""

    def __init__(self, paths: Sequence[str], cfg: PolicyConfig) -> None:
        self.cfg = cfg
        self.contended: set[str] = set()
        self._others: dict[str, deque[float]] = {p: deque(maxlen=3) for p in paths}
        self._ours: dict[str, deque[float]] = {p: deque(maxlen=8) for p in paths}

    def track(self, obs: Observation) -> list[tuple[str, bool, float]]:
        """Update each path's contended state; return (path, appeared, others' bytes/s) changes."""
        changes = []
        for p, hist in self._others.items():
            other = float(obs.path_other_bytes_per_s.get(p, 0.0) or 0.0)
            ours = obs.path_read_bytes_per_s.get(p, 0.0) + obs.path_write_bytes_per_s.get(p, 0.0)
            hist.append(other)
            if p not in self.contended:
                self._ours[p].append(ours)
            # Our own traffic in the threshold: sensor and engine intervals never align exactly.
            thr = max(
                self.cfg.contention_min_bytes_per_s, self.cfg.contention_ratio * (median(self._ours[p]) if self._ours[p] else 0.0)
            )
            if p not in self.contended:
                # One iteration far above the threshold, or two above it.
                if other >= 2 * thr or (len(hist) >= 2 and min(hist[-1], hist[-2]) >= thr):
                    self.contended.add(p)
                    changes.append((p, True, other))
            elif len(hist) >= 2 and max(hist[-1], hist[-2]) < thr / 2:
                self.contended.discard(p)
                changes.append((p, False, other))
        return changes


@dataclass(frozen=True)
class Change:
    """What changed at one iteration: contention that appeared or vanished on a path (path,
    appeared, others' bytes/s), and the paths whose rate moved."""

    contention: list[tuple[str, bool, float]]
    rates: list[RateChange]

    def __bool__(self) -> bool:
        return bool(self.contention or self.rates)

    @property
    def kind(self) -> str:
        """The policy log's kind of the entry that says it."""
        return "contention" if self.contention else "conditions"

    def describe(self) -> str:
        return "; ".join(
            [
                f"contention {'appeared' if up else 'vanished'} on {p} (others {other / 1e6:.0f} MB/s)"
                for p, up, other in self.contention
            ]
            + [c.describe() for c in self.rates]
        )


@dataclass(frozen=True)
class ModelMove:
    """The model's move after a change: to the stripe that balances the paths at their rates."""

    knobs: Knobs
    what: str
    """'stripe weight /ssd1 0.5 -> 0.17'."""
    reason: str
    """For the log: the cause, the move, the rates and the predicted gain."""


class Adaptation:
    """What changed, and what the tuner did about it, for one run (see the module docstring).

    ``depth_response``: how each path's probe answered more and fewer requests in flight (the
    run's ``path_depth_response``), until its rate changes."""

    def __init__(self, facts: RunFacts, cfg: PolicyConfig) -> None:
        self.cfg = cfg
        self.contention = Contention(facts.paths, cfg)
        self.conditions = Conditions(facts.paths, cfg)
        self.recent: deque[Sample] = deque(maxlen=8)
        """Every usable sample, whatever its knobs: a change's baseline."""
        self.stripe_checked = False
        """The stripe checked against the paths' first steady rates."""
        self.unsettled_iters = 0
        """Iterations the start's check has waited for the rates to settle."""
        self.depth_response = {p: dict(r) for p, r in facts.path_depth_response.items() if p in facts.paths}
        self.log: deque[dict[str, Any]] = deque(maxlen=20)
        """Each change of conditions and what the tuner did about it: iteration, cause, move (None:
        none made, and why in ``effect``), effect (its measured result once judged)."""
        self.plan_before_contention: Knobs | None = None
        """The good knobs when contention appeared."""
        self.return_to: Knobs | None = None
        """Where to head back to once it vanished."""
        self.shares_before_contention: dict[str, float] = {}
        """Byte shares per path then (the engine's default weights)."""

    def track(self, obs: Observation, knobs: Knobs | None, sample: Sample | None) -> Change:
        """Take one iteration (``knobs``: those in force for it; ``sample``: its figures, None when
        unusable); return what changed."""
        change = Change(self.contention.track(obs), self.conditions.track(obs, knobs))
        if sample is not None:
            self.recent.append(sample)
        return change

    def check_stripe(self) -> bool:
        """True once, when every path's rate is first known and has settled: the stripe at start
        came from a probe, or the user, and is checked against the rates then. Rates still
        unsettled after :data:`STEADY_WAIT_WINDOWS` windows: the start check is given up."""
        if self.stripe_checked or not self.conditions.known():
            return False
        if self.conditions.steady_rates() is None:
            self.unsettled_iters += 1
            self.stripe_checked = self.unsettled_iters >= STEADY_WAIT_WINDOWS * self.cfg.change_iters
            return False
        self.stripe_checked = True
        return True

    def awaiting_steady_rates(self, stripe_pinned: bool) -> bool:
        """The start's check of the stripe is still to come: the search waits for it, since a
        trial's other knobs would start the rates' windows again."""
        return not self.stripe_checked and self.can_restripe(stripe_pinned)

    def respond(self, change: Change, good_knobs: Knobs, shares: Mapping[str, float]) -> None:
        """Keep what ``change`` makes the tuner head for or forget: when contention appears, the
        good knobs and the byte ``shares`` then (the plan to go back to; a return under way keeps
        heading for its plan); when every path is calm again, that plan as the way back; on a
        rate change, the stripe counts as checked and the path's probed depth response is stale."""
        if any(up for _, up, _ in change.contention) and self.plan_before_contention is None:
            if self.return_to is None:
                self.plan_before_contention = good_knobs
                self.shares_before_contention = dict(shares)
            else:  # back before the return finished: keep heading for the same plan afterwards
                self.plan_before_contention = self.return_to
            self.return_to = None
        if not self.contention.contended and self.plan_before_contention is not None:
            self.return_to, self.plan_before_contention = self.plan_before_contention, None
        if change.rates:
            self.stripe_checked = True
            for c in change.rates:
                self.depth_response.pop(c.path, None)

    def can_restripe(self, stripe_pinned: bool) -> bool:
        """The model may move the stripe: two paths or more, not pinned, every rate known."""
        return len(self.conditions.paths) >= 2 and not stripe_pinned and self.conditions.known()

    def no_move(self, iteration: int, cause: str, why: str) -> None:
        """A change of conditions that moved no knob, and ``why``, in the log."""
        self.log.append({"iteration": iteration, "cause": cause, "move": None, "effect": f"no move: {why}"})

    def has_model_move(self, shares: Mapping[str, float], stripe_pinned: bool) -> bool:
        """The model would re-stripe from ``shares`` (the stripe in force) at the rates now."""
        return self.can_restripe(stripe_pinned) and restripe(self.conditions.rates(), shares, self.cfg) is not None

    def restripe(
        self, why: str, good_knobs: Knobs, shares: Mapping[str, float], iteration: int, *, quiet: bool = False
    ) -> ModelMove | str | None:
        """The model's move after ``why`` (the stripe in force: ``shares``), in the log; else why
        there is none (it is already close to balance), in the log too, or None when ``quiet``."""
        r = restripe(self.conditions.rates(), shares, self.cfg)
        if r is None:
            if quiet:
                return None
            self.no_move(iteration, why, "the stripe is already near the balance")
            return f"{why}: the stripe is within {100 * self.cfg.model_gain:.0f}% of the balance at the paths' rates now"
        self.log.append({"iteration": iteration, "cause": why, "move": r.describe(), "effect": None})
        rates = ", ".join(f"{p} {v / 1e6:.0f} MB/s" for p, v in self.conditions.rates().items())
        return ModelMove(
            good_knobs.replace(stripe_weights=r.after),
            r.describe(),
            f"{why}: {r.describe()} (balances the paths at their rates now, {rates}; predicted I/O time -{100 * r.gain:.0f}%)",
        )

    def judged(self, kept: bool, effect: str) -> None:
        """The model's move was ruled on: its measured ``effect`` in the log."""
        if self.log:
            self.log[-1]["effect"] = ("" if kept else "undone: ") + effect
