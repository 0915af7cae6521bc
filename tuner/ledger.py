"""The tuner's ledger of trials and rulings (:class:`Ledger`): the move on trial and the
samples of the good knobs it is judged against, the keep-or-revert :class:`Ruling` on it, and what
the search has learned under the current conditions, which the policy consults before every move
and forgets when conditions change (:mod:`tuner.guards`).

It holds the moves that did not help, the knob settings that caused an error, the move that just
helped (tried again first), and the kept moves a later window must still confirm (a few samples
can mislead: a transient, the cost of a change landing before or after the window).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from statistics import median

from engine.config import Knobs
from tuner.measurement import Sample
from tuner.moves import Move, MoveKey, Trial, knobs_key


@dataclass(frozen=True)
class Ruling:
    """The ledger's ruling on a trial: keep its move, or revert it, and the figures it rests on."""

    keep: bool
    base_cost: float
    """The good knobs' median cost (their last five samples)."""
    costs: tuple[float, ...]
    """The trial's samples' costs, in order."""
    threshold: float
    """The relative noise threshold the trial was ruled with."""

    @property
    def cost(self) -> float:
        return median(self.costs)


@dataclass(frozen=True)
class Kept:
    """A move kept on its trial's samples, not yet confirmed by a window measured after it."""

    move: Move
    before: Knobs
    """The good knobs it replaced."""
    before_cost: float
    """Their median cost when it was judged."""


@dataclass
class Ledger:
    trial: Trial | None = None
    """The move on trial and its samples so far; None between trials."""
    baseline: list[Sample] = field(default_factory=list)
    """Samples of the last good knobs: what a trial is ruled against."""
    failed_moves: set[MoveKey] = field(default_factory=set)
    """Moves that did not help, since the last re-exploration or change of conditions."""
    bad_knobs: set[str] = field(default_factory=set)
    """Knob settings (:func:`tuner.moves.knobs_key`) that caused an error: not tried again until
    conditions change."""
    last_kept: MoveKey | None = None
    """The move that just helped: tried again first (momentum)."""
    unconfirmed: list[Kept] = field(default_factory=list)
    """Kept moves a later window of the good knobs must confirm, oldest first."""
    kept_total: int = 0
    """Moves kept and confirmed (or not yet refuted) in this run."""
    reverts: int = 0
    """Moves reverted since the baseline was last measured."""

    def rule(self, s: Sample, threshold: float, window: int) -> Ruling | None:
        """Add ``s`` to the trial's samples; the ruling once they say (``threshold``: the relative
        noise, ``window``: the samples after which the median decides), else None. A lenient
        move is kept unless it does worse; any other must do better. Clearly worse or better
        samples rule before the window is full."""
        t = self.trial
        if t is None:
            raise ValueError("no trial to rule on")
        t.samples.append(s)
        xs = [x.cost for x in t.samples]
        base = median([x.cost for x in self.baseline[-5:]])
        n = len(xs)
        keep = None
        if n >= 2 and all(x < base * (1 - 2 * threshold) for x in xs):
            keep = True  # clearly better: no need to wait for the window
        elif t.move.lenient:
            if n >= 2 and all(x > base * (1 + 2 * threshold) for x in xs):
                keep = False
            elif n >= window:
                keep = median(xs) <= base * (1 + threshold)
        else:
            if n == 1 and xs[0] > base * (1 + max(0.25, 3 * threshold)):
                keep = False  # clearly worse: no need to wait for the window
            elif n >= 2 and all(x > base * (1 + threshold) for x in xs):
                keep = False
            elif n >= window:
                keep = median(xs) < base * (1 - threshold)
        return None if keep is None else Ruling(keep, base, tuple(xs), threshold)

    def remeasure(self, keep_samples: bool = False) -> None:
        """The good knobs are measured again (their samples dropped unless ``keep_samples``)."""
        if not keep_samples:
            self.baseline = []
        self.reverts = 0

    def forget(self, *, errors: bool = False) -> None:
        """Conditions changed (or a re-exploration starts): no earlier ruling blocks a move; with
        ``errors``, neither do the knobs that failed (a rate change: another machine, in effect)."""
        self.failed_moves.clear()
        self.unconfirmed = []
        self.last_kept = None
        if errors:
            self.bad_knobs.clear()

    def kept(self, move: Move, before: Knobs, before_cost: float, *, confirm: bool) -> None:
        """``move`` beat ``before`` (cost ``before_cost``); ``confirm``: a later window checks it."""
        if confirm:
            self.unconfirmed.append(Kept(move, before, before_cost))
        self.kept_total += 1
        self.reverts = 0
        self.last_kept = move.key
        if (opposite := move.key.opposite()) is not None:
            self.failed_moves.add(opposite)  # undoing a gain is pointless

    def reverted(self, move: Move) -> None:
        self.failed_moves.add(move.key)
        self.reverts += 1
        self.last_kept = None

    def errored(self, knobs: Knobs, move: Move | None = None) -> None:
        """``knobs`` (a trial's ``move``, when one) caused an error on a rank."""
        self.bad_knobs.add(knobs_key(knobs))
        if move is not None:
            self.failed_moves.add(move.key)

    def refuted(self, now: float, threshold: float) -> Kept | None:
        """The kept move to undo, once a full window of the good knobs measured ``now``: the last
        one kept, when any still unconfirmed costs less than ``now`` by more than ``threshold``
        (never tried again until something changes); else every one is confirmed (None)."""
        if not any(now > k.before_cost * (1 + threshold) for k in self.unconfirmed):
            self.unconfirmed = []
            return None
        last = self.unconfirmed.pop()
        self.kept_total -= 1
        self.failed_moves.add(last.move.key)
        if last.move.key.opposite() is not None:
            self.failed_moves.discard(last.move.key.opposite())  # undoing it is what helps now
        self.last_kept = None
        return last
