"""The tuner's policy: the decision loop of one run's online knob search (:class:`Policy`).

It owns what the loop decides and remembers: measuring, acting on a trial's ruling, holding,
rolling back after an error, the user's pins and freeze, and the log of every decision with its
reason. The search itself is :mod:`tuner.moves`; its settings :mod:`tuner.policy_config`;
samples and noise :mod:`tuner.measurement`; the trial, the good knobs' samples and the
keep-or-revert ruling :mod:`tuner.ledger`; limits, and what changed and what the tuner did about
it (contention, a path's rate) :mod:`tuner.guards`. How it behaves, and why:
docs/tuner-policy.md. ``Observation``, ``Decision`` and ``PolicyConfig`` are importable from here too.
"""

from __future__ import annotations

import math
from dataclasses import replace
from statistics import median as _median
from typing import Any, Callable, Mapping

from engine.config import KnobKey, Knobs
from engine.errors import ConfigError
from tuner.guards import Adaptation, Change, Limits, ModelMove
from tuner.knob_text import Pins, known_paths
from tuner.ledger import Ledger
from tuner.measurement import Noise, Sample, negligible
from tuner.moves import MODEL, RETURN, START, Move, MoveSearch, Trial
from tuner.observation import Decision, Observation
from tuner.policy_config import PolicyConfig
from tuner.run_state import RunFacts
from tuner.start_plan import model_start

__all__ = ["Decision", "LOG_ENTRIES", "Observation", "Policy", "PolicyConfig"]

LOG_ENTRIES = 1000


class Policy:
    """Online search over one run's knobs; see the module docstring."""

    def __init__(self, start: Knobs, facts: RunFacts, config: PolicyConfig | None = None) -> None:
        if not isinstance(start, Knobs):
            raise ConfigError(f"Policy start must be engine.Knobs, got {type(start).__name__}")
        if not (isinstance(facts.subgroup_bytes, int) and facts.subgroup_bytes >= 0):
            raise ConfigError(f"Policy subgroup_bytes must be a non-negative integer, got {facts.subgroup_bytes!r}")
        if not (isinstance(facts.ranks, int) and facts.ranks >= 1):
            raise ConfigError(f"Policy ranks must be a positive integer, got {facts.ranks!r}")
        facts = replace(facts, paths=tuple(dict.fromkeys(facts.paths)))  # each path once
        self.cfg = config or PolicyConfig()
        self.facts = facts
        self.log: list[dict[str, Any]] = []
        self._iteration = -1
        self._pins = Pins()
        self._user_pin_values: dict[str, Any] = {}  # each knob the user pinned in this run -> the value given
        self._frozen = False
        self._unannounced: str | None = None  # why the knobs changed outside observe(): the next one says so
        self._iters_to_discard = self.cfg.warmup_iters
        self._samples_wanted = self.cfg.window  # samples of the good knobs wanted before the next move
        self._holding_since: int | None = None  # iteration the search ran out of moves
        self._held: list[Sample] = []  # samples measured while holding (the first window is its level)
        self._hold_why: str | None = None  # why it holds with moves left (a model-guided re-stripe settled them)
        self._negligible_why: str | None = None  # why the policy holds without searching (update too small to matter)
        self._ledger = Ledger()
        self._fresh = 0  # samples of the good knobs measured since the knobs last changed
        self._noise = Noise(self.cfg)
        self._limits = Limits(self.cfg, facts)
        self._adapt = Adaptation(facts, self.cfg)  # what changed, and the response
        self._own_start: Knobs | None = None  # the run's own start, tried against the model's plan
        self._search = MoveSearch(self.cfg, facts, limits=self._limits, adapt=self._adapt, pins=self._pins)

        self._knobs = self._good_knobs = start
        start, dropped = known_paths(start, self.facts.paths, "start knobs")
        if dropped:
            self._note(dropped, "guard")
        if not self.facts.has_device and start.device_fraction > 0:
            start = start.replace(device_fraction=0.0)
            self._note("no device lane: device_fraction set to 0", "guard")
        self._knobs = self._good_knobs = start
        self.start_pins: list[str] = []
        """The pins of the run's options (pinned from the start), as :class:`KnobKey` text."""
        self._pin_from_the_start(facts.pins)
        if facts.profile is not None:
            m = model_start(facts, start, cfg=self.cfg, limits=self._limits, pins=self._pins)
            if m.dropped:
                self._note(m.dropped, "guard")
            if m.plan is None:
                self._note(m.note, "model")
            else:
                self._knobs = self._good_knobs = m.plan
                self._own_start, self._unannounced = start, m.note

    # -- public ------------------------------------------------------------------------------

    @property
    def knobs(self) -> Knobs:
        """The knobs most recently decided (in force once the engine applies them)."""
        return self._knobs

    @property
    def pins(self) -> dict[str, Any]:
        """The user's pins, as the wire spells them: ``{'io_concurrency[/nvme0]': 8, ...}``."""
        return self._pins.as_dict()

    def state(self) -> dict[str, Any]:
        """What the policy is doing, for snapshots and the live view; ``holding_reason`` only
        while it holds, so that it never contradicts ``mode``."""
        mode = (
            "frozen"
            if self._frozen
            else "trial"
            if self._ledger.trial
            else "holding"
            if self._holding_since is not None
            else "measuring"
        )
        return {
            "mode": mode,
            "since_iteration": self._holding_since if mode == "holding" else None,
            "trial": self._ledger.trial.move.what if self._ledger.trial else None,
            "good_knobs": self._good_knobs.to_dict(),
            "good_update_s": _median([s.update_s for s in self._ledger.baseline[-5:]]) if self._ledger.baseline else None,
            "good_iteration_s": (
                _median([s.iter_time_s for s in self._ledger.baseline[-5:] if s.iter_time_s])
                if any(s.iter_time_s for s in self._ledger.baseline[-5:])
                else None
            ),
            "holding_reason": (self._negligible_why or self._hold_why) if mode == "holding" else None,
            "threshold": self._noise.threshold(),
            "contended_paths": sorted(self._adapt.contention.contended),
            "pins": self._pins.as_dict(),
            "user_set": self._user_set(),
            "fixed": list(self.start_pins),
            "frozen": self._frozen,
            "rates": {p: round(v) for p, v in self._adapt.conditions.rates().items()},
            "adaptations": list(self._adapt.log),
        }

    def observe(self, obs: Observation) -> Decision | None:
        """Take one iteration's figures; return new knobs when they should change."""
        self._iteration = obs.iteration
        usable = isinstance(obs.update_s, (int, float)) and math.isfinite(obs.update_s) and obs.update_s > 0
        s = Sample.of(obs, self.facts.paths) if usable else None
        in_force = obs.knobs if obs.knobs is None or isinstance(obs.knobs, Knobs) else Knobs.from_dict(dict(obs.knobs))
        change = self._adapt.track(obs, in_force, s)
        if self._unannounced is not None:  # user requests apply even while frozen
            reason, self._unannounced = self._unannounced, None
            if change and not self._frozen:
                self._on_conditions(change, model=False)  # no trial runs after a pin: only bookkeeping
            return self._decide(self._knobs, reason, "user")
        if self._frozen:
            return None
        if obs.error:
            return self._on_error(obs.error)
        if change and (d := self._on_conditions(change)) is not None:
            return d
        if in_force is not None and in_force != self._knobs:
            return None  # measured under earlier knobs: the last change has not reached the engine yet
        if self._iters_to_discard > 0:
            self._iters_to_discard -= 1
            return None
        if s is None:
            return None  # no usable figure (a rank sent garbage, or nothing was updated)
        if (trial := self._ledger.trial) is not None:
            return self._rule_on_trial(trial, s)
        why = "the stripe does not match the paths' measured rates"
        if self._adapt.check_stripe() and (d := self._model_move(why, [*self._ledger.baseline[-2:], s], quiet=True)) is not None:
            return d
        self._ledger.baseline.append(s)
        if self._adapt.awaiting_steady_rates(self._pins.covers("stripe_weights")):
            return None  # the start's check of the stripe first: a trial now would restart its windows
        if self._knobs == self._good_knobs:
            self._fresh += 1
        if (d := self._confirm_kept()) is not None:
            return d
        if self._holding_since is not None:
            return self._hold()
        if len(self._ledger.baseline) < self._samples_wanted:
            return None
        self._noise.add([x.cost for x in self._ledger.baseline[-self._samples_wanted :]])
        idle = self._negligible()
        if idle is not None and self._knobs == self._good_knobs:
            self._holding_since, self._negligible_why = self._iteration, idle
            self._note(f"holding: {idle}", "hold")
            return None
        return self._propose("")

    def pin(self, knob: str, value: Any, check: Callable[[KnobKey, Knobs], None] | None = None) -> None:
        """Pin ``knob`` (:class:`KnobKey` text) at ``value``; never searched. ``check(key,
        new_knobs)`` may refuse it (as :meth:`tuner.knob_text.Pins.pin`) before anything is kept."""

        def allowed(key: KnobKey, new: Knobs) -> None:
            if check is not None:
                check(key, new)
            if key.name == "device_fraction" and new.device_fraction > 0 and not self._limits.device_fits(new.device_fraction):
                why = (
                    "this run has no device lane"
                    if not self.facts.has_device
                    else f"it ran out of GPU memory above {self._limits.device_cap:g}"
                )
                raise ConfigError(f"cannot pin device_fraction={new.device_fraction}: {why}; pin a smaller fraction")

        key, value, new = self._pins.pin(knob, value, self._good_knobs, self.facts.paths, self.facts.has_device, check=allowed)
        knob = str(key)
        self._user_pin_values[knob] = key.value_in(new)
        self._ledger.trial = None
        self._ledger.unconfirmed = []  # the user's knobs now: nothing of the search's to undo
        self._good_knobs = new
        self._restart_measuring()
        if new != self._knobs:
            self._knobs = new
            self._unannounced = f"pinned {knob}={value} by the user"
        else:
            self._note(f"pinned {knob}={value} by the user (already in force)", "user")

    def _pin_from_the_start(self, pins: Mapping[str, Any]) -> None:
        """Pin what the run's options set (``train`` flags, ``OffloadAdamW`` arguments; key ->
        value): the search never moves them, as it never moves a ``tune --pin``."""
        for text, value in pins.items():
            try:
                key, value, self._knobs = self._pins.pin(text, value, self._knobs, self.facts.paths, self.facts.has_device)
            except ConfigError as e:  # a pin this run cannot have: the engine refused it already
                self._note(f"fixed knob {text} not pinned: {e}", "guard")
                continue
            self.start_pins.append(str(key))
        self._good_knobs = self._knobs
        if self.start_pins:
            self._note(
                f"fixed by the run's options, never moved: "
                f"{', '.join(f'{k}={v}' for k, v in self._pins.as_dict().items() if k in self.start_pins)}",
                "user",
            )

    def _user_set(self) -> list[str]:
        """Knobs the user pinned in this run, pinned still or unpinned since, whose good value is
        still the one the user gave: the user's, not the tuner's verdict (history never learns them)."""
        return [k for k, v in self._user_pin_values.items() if KnobKey.parse(k, self.facts.paths).value_in(self._good_knobs) == v]

    def unpin(self, knob: str) -> None:
        key = self._pins.unpin(knob, self.facts.paths)
        self.start_pins = [k for k in self.start_pins if k != str(key)]
        self._ledger.failed_moves.clear()
        self._restart_measuring(keep_samples=True)
        self._note(f"unpinned {knob}: the search may change it again", "user")

    def freeze(self, frozen: bool) -> None:
        """Stop (True) or resume (False) tuning. Freezing ends a trial: back to the last good knobs."""
        frozen = bool(frozen)
        if frozen == self._frozen:
            return
        self._frozen = frozen
        if frozen:
            if self._ledger.trial is not None and self._knobs != self._good_knobs:
                what = self._ledger.trial.move.what
                self._knobs = self._good_knobs
                self._unannounced = f"tuning frozen by the user: trial of {what} ended, back to the last good knobs"
            else:
                self._note("tuning frozen by the user", "user")
            self._ledger.trial = None
        else:
            self._restart_measuring()
            self._note("tuning resumed by the user", "user")

    # -- decisions and the log ---------------------------------------------------------------

    def _decide(self, knobs: Knobs, reason: str, kind: str) -> Decision:
        self._knobs = knobs
        self._fresh = 0
        self._iters_to_discard = max(self._iters_to_discard, self.cfg.settle_iters)
        self._log(reason, kind, changed=True)
        return Decision(knobs, reason)

    def _note(self, reason: str, kind: str) -> None:
        """A decision that changes no knob (kept, holding, ignored error): logged all the same."""
        self._log(reason, kind, changed=False)

    def _log(self, reason: str, kind: str, *, changed: bool) -> None:
        self.log.append(
            {"iteration": self._iteration, "knobs": self._knobs.to_dict(), "reason": reason, "kind": kind, "changed": changed}
        )
        if len(self.log) > 2 * LOG_ENTRIES:  # a daemon's run may last weeks: keep the recent part
            del self.log[:-LOG_ENTRIES]

    def _restart_measuring(self, keep_samples: bool = False) -> None:
        self._ledger.remeasure(keep_samples)
        self._samples_wanted = self.cfg.window
        self._holding_since, self._negligible_why = None, None

    # -- the search --------------------------------------------------------------------------

    def _propose(self, prefix: str, reverting: Move | None = None) -> Decision | None:
        """Start the best untried move from the good knobs, or hold there. ``reverting``: the
        move just rejected, whose knobs are still in force."""
        if self._ledger.reverts >= 3 and self._knobs != self._good_knobs:
            # The baseline is old after several reverts: measure the good knobs again first.
            self._restart_measuring()
            return self._decide(self._good_knobs, prefix + "measuring the last good knobs again before further moves", "revert")
        move, back_done = self._search.next_move(self._good_knobs, self._ledger, self._own_start)
        if back_done:
            self._adapt.return_to = None
        if move is not None and reverting is not None and move.key.family() == reverting.key.family():
            # Going straight from one trial to the next on the same knob would be two steps in
            # one change: back to the good knobs first, then the next move after one sample.
            self._samples_wanted = len(self._ledger.baseline) + 1
            return self._decide(self._good_knobs, prefix.rstrip("; "), "revert")
        if move is None:
            self._holding_since, self._held = self._iteration, []
            recent = self._ledger.baseline[-self.cfg.window :]
            cost = _median([s.cost for s in recent]) if recent else None  # the hold's level, for the log
            self._hold_why = (
                "the stripe balances the paths at their rates now: the I/O knobs wait for the next re-exploration"
                if self._ledger.last_kept == MODEL
                else None
                if self._ledger.failed_moves
                else "no move worth a trial: the paths' probes and rates leave no knob to gain by"
            )
            left = self._hold_why or (
                f"no move left to try: none gained more than {100 * self._noise.threshold():.0f}% (this run's noise threshold)"
            )
            msg = prefix + f"{left}; holding at {self._cost_name()} {cost:.3f} s" if cost else prefix + "holding"
            if self._knobs != self._good_knobs:
                return self._decide(self._good_knobs, msg, "revert")
            self._note(msg, "hold")
            return None
        self._ledger.trial = Trial(move)
        why = self._search.why(move, self._ledger.baseline)
        return self._decide(move.knobs, f"{prefix}trying {move.what}{why}", "trial")

    def _rule_on_trial(self, t: Trial, s: Sample) -> Decision | None:
        """The ledger's ruling on the trial ``t``, once its samples say (:meth:`tuner.ledger.Ledger.rule`):
        keep the move or revert it, and propose the next."""
        ruling = self._ledger.rule(s, self._noise.threshold(), self.cfg.window)
        if ruling is None:
            return None
        self._noise.add(list(ruling.costs))
        base, med, thr = ruling.base_cost, ruling.cost, ruling.threshold
        figures = f"{self._cost_name()} {base:.3f} -> {med:.3f} s, {100 * (med / base - 1):+.0f}%, threshold {100 * thr:.0f}%"
        if self._cost_name() == "iteration":  # the explanation: what the update phase did
            figures += (
                f"; update {_median([x.update_s for x in self._ledger.baseline[-5:]]):.3f} -> "
                f"{_median([x.update_s for x in t.samples]):.3f} s"
            )
        self._ledger.trial = None
        move = t.move
        if move.key == MODEL:
            self._adapt.judged(ruling.keep, figures.split(", threshold")[0])
        if move.key == START:  # kept or not, the run's own start has been tried against the plan
            self._own_start = None
        if ruling.keep:
            # The start and the way back are judged against a plan, not kept over it.
            self._ledger.kept(move, self._good_knobs, base, confirm=move.key not in (START, RETURN))
            self._good_knobs, self._ledger.baseline = move.knobs, list(t.samples)
            if move.key == MODEL:  # the paths balanced on measured rates: a trial of an I/O knob is noisier evidence
                self._ledger.failed_moves |= self._search.io_move_keys()
            return self._propose(f"kept {move.what} ({figures}); ")
        self._ledger.reverted(move)
        if move.key == RETURN:
            self._adapt.return_to = None
        return self._propose(f"reverted {move.what} ({figures}); ", reverting=move)

    def _confirm_kept(self) -> Decision | None:
        """Moves are kept on a few samples, and a few samples can mislead (a transient, the cost of
        a change landing before or after the window). Once a full window of the good knobs has
        been measured after them, each kept move must still beat what it replaced: the last one
        kept is undone (back to the knobs before it, and never tried again until something
        changes) when the good knobs now cost more than that by more than the threshold; the
        next window checks the one before it. Confirmed moves are not checked again."""
        w = self.cfg.window
        if not self._ledger.unconfirmed or self._fresh < w or self._knobs != self._good_knobs:
            return None
        now = _median([x.cost for x in self._ledger.baseline[-w:]])
        thr = self._noise.threshold()
        last = self._ledger.refuted(now, thr)
        if last is None:
            return None
        reason = (
            f"undid {last.move.what}: {self._cost_name()} {last.before_cost:.3f} s before it, {now:.3f} s over "
            f"the {w} iterations since ({100 * (now / last.before_cost - 1):+.0f}%, threshold {100 * thr:.0f}%)"
        )
        self._good_knobs = last.before
        self._restart_measuring()
        return self._decide(last.before, reason, "revert")

    def _hold(self) -> Decision | None:
        w = self.cfg.window
        self._ledger.baseline = self._ledger.baseline[-2 * w :]
        recent = [s.cost for s in self._ledger.baseline[-w:]]
        if self._negligible_why is not None:
            if len(recent) >= w and self._negligible(2.0) is None:
                self._negligible_why, self._holding_since = None, None
                self._ledger.baseline = self._ledger.baseline[-w:]
                return self._propose("the update phase grew past the point where tuning pays; re-exploring; ")
            return None  # holding: nothing the knobs change is worth measuring
        # Its level: its own first window, not a trial's few samples; a rise: over two windows after
        # it (one noisy window starts no search; a path that slows is a change of conditions).
        self._held = (self._held + [self._ledger.baseline[-1]])[: 2 * w + 1]
        first, last = self._held[:w], self._ledger.baseline[-2 * w :]
        level, risen = _median([s.cost for s in first]), _median([s.cost for s in last])
        if len(self._held) > 2 * w and risen > level * (1 + max(self.cfg.drift, 2 * self._noise.threshold())):
            # Every knob acts on the update phase: a rise that forward and backward account for
            # (another process on the CPUs, the host's own noise) is no move's to undo, and a
            # trial then could only be judged on that noise. Its level becomes the hold's.
            update_rise = _median([s.update_s for s in last]) - _median([s.update_s for s in first])
            if update_rise < (risen - level) / 2:
                self._held = []
                self._note(
                    f"{self._cost_name()} rose {100 * (risen / level - 1):.0f}% while holding, in forward and backward "
                    f"(update {update_rise:+.3f} s): no knob acts there; holding at the new level",
                    "hold",
                )
                return None
            self._ledger.failed_moves.clear()
            self._holding_since = None
            self._ledger.baseline = self._ledger.baseline[-w:]
            return self._propose(f"{self._cost_name()} rose {100 * (risen / level - 1):.0f}% while holding; re-exploring; ")
        every = self.cfg.reexplore_every_iters
        if every and self._holding_since is not None and self._iteration - self._holding_since >= every:
            self._ledger.failed_moves.clear()
            self._holding_since = None
            return self._propose(f"{every} iterations since the last move; re-exploring; ")
        return None

    def _cost_name(self) -> str:
        recent = self._ledger.baseline[-self.cfg.window :]
        return "iteration" if recent and all(x.iter_time_s for x in recent) else "update"

    def _negligible(self, factor: float = 1.0) -> str | None:
        """Why no move can pay (:func:`tuner.measurement.negligible`), or None when one can."""
        return negligible(
            self._ledger.baseline[-self.cfg.window :],
            self.cfg,
            has_device=self.facts.has_device,
            threshold=self._noise.threshold(),
            kept=self._ledger.kept_total,
            factor=factor,
        )

    # -- guard rails -----------------------------------------------------------------------------

    def _on_error(self, error: str) -> Decision | None:
        if self._ledger.trial is not None:
            move, self._ledger.trial = self._ledger.trial.move, None
            self._ledger.errored(move.knobs, move)
            # The baseline still holds: go on after settling.
            self._samples_wanted = max(self._samples_wanted, len(self._ledger.baseline))
            return self._decide(
                self._good_knobs,
                f"rolled back {move.what} after an error on a rank ({error}); those knobs are not tried again",
                "rollback",
            )
        f = self._knobs.device_fraction
        if "oom" in error.lower() and f > 0:
            self._ledger.errored(self._knobs)
            down = round(max(0.0, f - self.cfg.device_step), 6)
            self._limits.device_cap = down
            self._good_knobs = self._knobs.replace(device_fraction=down)
            self._ledger.unconfirmed = []
            self._restart_measuring()
            return self._decide(
                self._good_knobs,
                f"out of memory with the device lane at {f:.2g} ({error}): lowered to "
                f"{down:.2g}, and never raised above it again",
                "rollback",
            )
        self._note(f"error on a rank under the last good knobs ({error}); nothing to roll back", "error")
        return None

    # -- a change of conditions ---------------------------------------------------------------

    def _on_conditions(self, change: Change, *, model: bool = True) -> Decision | None:
        """Contention appeared or vanished, or a path's rate moved (``change``; what the tuner heads
        for after it: :meth:`tuner.guards.Adaptation.respond`): what was learned under the old
        conditions (failed moves, kept moves to confirm, the noise, and on a rate change the knobs
        that failed) no longer blocks a move. On a rate change the model's stripe is tried at once
        (``model``); otherwise the last good knobs are measured again, a trial in flight abandoned."""
        desc = change.describe()
        if model and (unfelt := self._unfelt(change)) is not None:
            self._adapt.no_move(self._iteration, desc, unfelt)
            self._note(f"{desc}: {unfelt}", change.kind)
            return None
        self._adapt.respond(change, self._good_knobs, self._search.stats(self._ledger.baseline).get("shares", {}))
        self._ledger.forget(errors=bool(change.rates))
        if change.rates:
            self._noise = Noise(self.cfg)
        abandoned, self._ledger.trial = (self._ledger.trial.move.what if self._ledger.trial else None), None
        recent = list(self._adapt.recent)[-self.cfg.change_iters :]  # the iterations that showed the change
        if change.rates and model and (d := self._model_move(desc, recent, abandoned)) is not None:
            return d
        self._restart_measuring()
        self._samples_wanted = self.cfg.rebaseline_iters
        if abandoned is not None:
            return self._decide(
                self._good_knobs, f"{desc}: trial of {abandoned} abandoned, measuring the last good knobs", change.kind
            )
        self._note(f"{desc}: measuring the current knobs again", change.kind)
        return None

    def _stripe_in_force(self) -> dict[str, float] | None:
        """The good knobs' stripe as shares, else the byte shares of the recent iterations."""
        return self._search.weights_of(self._good_knobs, self._search.stats(list(self._adapt.recent)).get("shares", {}))

    def _unfelt(self, change: Change) -> str | None:
        """Why a change of a path's rate leaves what was learned standing, or None when it does not.

        It does when the step does not feel it (the update phase over the iterations that showed
        the change is within the noise threshold of the good knobs': the path's rate moved, and
        nothing that waits on it did) and either no path's round trip moved by
        ``unfelt_rate_change`` (twice or half) or the stripe is near the balance at the rates
        now. A quiet emulated path's busy-time read rate swings 1.8x between regimes (240 and
        430 MB/s for stretches of iterations, one path or both, the update within 1%): taken as
        a change, it forgot the start's probes and opened concurrency trials, or re-striped
        toward the path in its fast regime (+26% and +39% on the iteration, reverted), in runs
        where nothing changed. A path that slows so that the step waits, or that comes back
        from a 5x slowdown while its share is low (the model's move), is a change."""
        recent, base = list(self._adapt.recent)[-self.cfg.change_iters :], self._ledger.baseline[-2 * self.cfg.window :]
        if change.contention or not change.rates or self._ledger.trial is not None or len(base) < self.cfg.window:
            return None
        before, now = _median([s.update_s for s in base]), _median([s.update_s for s in recent])
        if abs(math.log(now / before)) > self._noise.threshold():
            return None
        felt = (
            f"the step did not feel it (update {before:.3f} -> {now:.3f} s, "
            f"within this run's noise threshold of {100 * self._noise.threshold():.0f}%)"
        )
        big = max(abs(math.log(c.after_bytes_per_s / c.before_bytes_per_s)) for c in change.rates)
        if big < math.log1p(self.cfg.unfelt_rate_change):
            return (
                f"{felt}, and no path's rate moved {1 + self.cfg.unfelt_rate_change:g}x, the least the rates alone are acted on"
            )
        shares = self._stripe_in_force()
        if shares and self._adapt.has_model_move(shares, self._pins.covers("stripe_weights")):
            return None
        return f"{felt}, and the stripe is near the balance"

    def _model_move(
        self, why: str, baseline: list[Sample], abandoned: str | None = None, *, quiet: bool = False
    ) -> Decision | None:
        """Straight to the stripe that balances the paths at their measured rates, judged (kept
        unless it does worse) against ``baseline``, the iterations that showed the change; None
        when the stripe is pinned, a rate is unknown, or it is already close to balance (said in
        the log unless ``quiet``). Once kept, the stripe is not searched by small steps until the
        search re-explores: the rates are a direct measurement, a trial a noisier one."""
        if not baseline or not self._adapt.can_restripe(self._pins.covers("stripe_weights")):
            return None
        shares = self._stripe_in_force()
        m = self._adapt.restripe(why, self._good_knobs, shares or {}, self._iteration, quiet=quiet)
        if not isinstance(m, ModelMove):
            if m is not None:
                self._note(m, "conditions")
            return None
        self._restart_measuring()
        self._ledger.baseline = baseline
        self._ledger.trial = Trial(Move(key=MODEL, knobs=m.knobs, lenient=True, what=m.what))
        return self._decide(m.knobs, m.reason + (f"; trial of {abandoned} abandoned" if abandoned else ""), "model")
