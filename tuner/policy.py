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
(:func:`perf.search.best_plan`), and the run's own starting knobs are the first
alternative measured against it.

This module owns the decision loop (observe, measure, judge, hold, roll back, pins and
freeze). Its parts: :mod:`tuner.observation` (what it is told and answers),
:mod:`tuner.policy_config` (its settings), :mod:`tuner.measurement` (samples and noise),
:mod:`tuner.moves` (which moves exist and how they rank) and :mod:`tuner.guards` (the limits
and contention). ``Observation``, ``Decision`` and ``PolicyConfig`` are importable from here too.
"""
from __future__ import annotations

import math
from statistics import median as _median
from typing import Any, Mapping, Sequence

from engine.config import Knobs
from engine.errors import ConfigError
from engine.layout import STATE_BYTES_PER_ELEMENT, staging_buffers
from tuner.guards import Contention, Limits
from tuner.measurement import Noise, Sample
from tuner.moves import Move, MoveSearch, Trial, family, knobs_key, opposite
from tuner.moves import diff as _diff  # the name _start_from_model has always used
from tuner.observation import Decision, Observation
from tuner.policy_config import PolicyConfig

__all__ = ["Decision", "LOG_ENTRIES", "Observation", "Policy", "PolicyConfig"]

LOG_ENTRIES = 1000


def _as_knobs(k: Knobs | Mapping[str, Any]) -> Knobs:
    return k if isinstance(k, Knobs) else Knobs.from_dict(dict(k))


class Policy(MoveSearch):
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
        self._base: list[Sample] = []  # measurements of the last good knobs
        self._need = self.cfg.window  # samples of the good knobs wanted before the next move
        self._trial: Trial | None = None
        self._holding_since: int | None = None  # iteration the search ran out of moves
        self._reference: float | None = None  # median cost (iteration) when it did
        self._idle: str | None = None  # why the policy holds without searching (update too small to matter)
        self._rejects = 0  # reverted moves since the baseline was last measured
        self._failed: set[str] = set()  # moves that did not help, since the last re-exploration
        self._bad: set[str] = set()  # knob settings that caused an error: never again
        self._momentum: str | None = None
        self._noise = Noise(self.cfg)
        self._limits = Limits(self.cfg, has_device=self.has_device, params=self.params,
                              subgroup_bytes=self.subgroup_bytes, ranks=self.ranks)
        self._contention = Contention(self.paths, self.cfg)
        self._pre_contention: Knobs | None = None  # the good knobs when contention appeared
        self._returning: Knobs | None = None  # where to head back to once it vanished
        self._pre_shares: dict[str, float] = {}  # byte shares per path then (the engine's default weights)
        self._start_alt: Knobs | None = None  # the run's own start, tried against the model's plan

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
        """What the policy is doing, for snapshots and the live view; ``holding_reason`` only
        while it holds, so that it never contradicts ``mode``."""
        mode = ("frozen" if self._frozen else "trial" if self._trial
                else "holding" if self._holding_since is not None else "measuring")
        return {
            "mode": mode,
            "since_iteration": self._holding_since if mode == "holding" else None,
            "trial": self._trial.move.what if self._trial else None,
            "good_knobs": self._good.to_dict(),
            "good_update_s": _median([s.update_s for s in self._base[-5:]]) if self._base else None,
            "good_iteration_s": (_median([s.iter_time_s for s in self._base[-5:] if s.iter_time_s])
                                 if any(s.iter_time_s for s in self._base[-5:]) else None),
            "holding_reason": self._idle if mode == "holding" else None,
            "threshold": self._noise.threshold(),
            "contended_paths": sorted(self._contended),
            "pins": dict(self._pins),
            "frozen": self._frozen,
        }

    def observe(self, obs: Observation) -> Decision | None:
        """Take one iteration's figures; return new knobs when they should change."""
        self._iteration = obs.iteration
        if obs.device_headroom_bytes is not None:
            self._headroom = obs.device_headroom_bytes
        changes = self._contention.track(obs)
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
        s = Sample.of(obs, self.paths)
        if self._trial is not None:
            return self._judge(s)
        self._base.append(s)
        if self._holding_since is not None:
            return self._hold()
        if len(self._base) < self._need:
            return None
        self._noise.add([x.cost for x in self._base[-self._need:]])
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
                   else f"it ran out of GPU memory above {self._limits.device_cap:g}")
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
        self._holding_since, self._idle = None, None
        self._rejects = 0

    # -- the search --------------------------------------------------------------------------

    def _propose(self, prefix: str, reverting: Move | None = None) -> Decision | None:
        """Start the best untried move from the good knobs, or hold there. ``reverting``: the
        move just rejected, whose knobs are still in force."""
        if self._rejects >= 3 and self._knobs != self._good:
            # The baseline is old after several reverts: measure the good knobs again first.
            self._restart_measuring()
            return self._decide(self._good, prefix + "measuring the last good knobs again before further moves", "revert")
        move = self._next_move()
        if move is not None and reverting is not None and family(move.key) == family(reverting.key):
            # Going straight from one trial to the next on the same knob would be two steps in
            # one change: back to the good knobs first, then the next move after one sample.
            self._need = len(self._base) + 1
            return self._decide(self._good, prefix.rstrip("; "), "revert")
        if move is None:
            self._holding_since = self._iteration
            self._reference = _median([s.cost for s in self._base[-self.cfg.window:]]) if self._base else None
            msg = (prefix + f"no move left to try; holding ({self._cost_name()} {self._reference:.3f} s)"
                   if self._reference else prefix + "holding")
            if self._knobs != self._good:
                return self._decide(self._good, msg, "revert")
            self._note(msg, "hold")
            return None
        self._trial = Trial(move)
        why = self._why(move)
        return self._decide(move.knobs, f"{prefix}trying {move.what}{why}", "trial")

    def _judge(self, s: Sample) -> Decision | None:
        t = self._trial
        t.samples.append(s)
        xs = [x.cost for x in t.samples]
        base = _median([x.cost for x in self._base[-5:]])
        thr = self._noise.threshold()
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
        self._noise.add(xs)
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
            if opposite(move.key):
                self._failed.add(opposite(move.key))  # undoing a gain is pointless
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
        bar = factor * max(self.cfg.negligible_share, 2 * self._noise.threshold())
        share = tunable / it if it > 0 else 1.0
        if share >= bar:
            return None
        return (f"holding: what the knobs can change ({what}, {1e3 * tunable:.1f} ms) is {100 * share:.1f}% of the "
                f"{self._cost_name()} (median {1e3 * it:.0f} ms), under {100 * bar:.0f}%: no move could "
                "show above the noise")

    def _why(self, move: Move) -> str:
        st = self._stats()
        if move.key == "return":
            return ": contention is gone"
        if move.key == "start":
            return ": the run's own starting knobs, against the model's plan"
        if move.key.startswith("stripe_weights") and move.key[len("stripe_weights["):-2] in self._contended:
            return ": that path is contended"
        if (move.key.startswith("io_concurrency") and move.key.endswith("-")
                and move.key[len("io_concurrency["):-2] in self._contended):
            return ": that path is contended"
        if not st:
            return ""
        return f" (read wait {100 * st['read_share']:.0f}%, write wait {100 * st['write_share']:.0f}% of the update)"

    # -- guard rails -----------------------------------------------------------------------------

    def _subgroups_per_rank(self) -> int | None:
        return self._limits.subgroups_per_rank()

    def _device_fits(self, f: float) -> bool:
        return self._limits.device_fits(f)

    def _prefetch_cap(self) -> int:
        return self._limits.prefetch_cap()

    @property
    def _contended(self) -> set[str]:
        """Paths another process contends for now (the tracker's set, not a copy)."""
        return self._contention.contended

    def _on_error(self, error: str) -> Decision | None:
        if self._trial is not None:
            move, self._trial = self._trial.move, None
            self._bad.add(knobs_key(move.knobs))
            self._failed.add(move.key)
            self._need = max(self._need, len(self._base))  # the baseline still holds: go on after settling
            return self._decide(self._good, f"rolled back {move.what} after an error on a rank ({error}); "
                                f"those knobs are not tried again", "rollback")
        f = self._knobs.device_fraction
        if "oom" in error.lower() and f > 0:
            self._bad.add(knobs_key(self._knobs))
            down = round(max(0.0, f - self.cfg.device_step), 6)
            self._limits.device_cap = down
            self._good = self._knobs.replace(device_fraction=down)
            self._restart_measuring()
            return self._decide(self._good, f"out of memory with the device lane at {f:.2g} ({error}): lowered to "
                                f"{down:.2g}, and never raised above it again", "rollback")
        self._note(f"error on a rank under the last good knobs ({error}); nothing to roll back", "error")
        return None

    # -- contention ------------------------------------------------------------------------------

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
            from perf.model import Workload
            from perf.search import best_plan
            if isinstance(profile, str):
                from perf.profile_toml import load_profile
                profile = load_profile(profile)
            # The host cache is fixed for the run's life and not a knob: plan for state on the
            # paths, with host memory for the staging buffers of the deepest prefetch only.
            staging = (staging_buffers(self.cfg.max_prefetch_depth) * self.subgroup_bytes * self.ranks
                       if self.paths else None)
            # params are per rank; the model's are the whole model (it divides by ranks and nodes).
            wl = Workload(params=self.params * self.ranks, ranks=self.ranks,
                          subgroup_numel=max(1, self.subgroup_bytes // STATE_BYTES_PER_ELEMENT),
                          host_bytes=staging, gpu_headroom_bytes=self._headroom)
            pred = best_plan(profile, wl, paths=list(self.paths))
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
