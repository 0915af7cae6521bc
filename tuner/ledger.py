"""The tuner's ledger of trials and verdicts (:class:`Ledger`): what the search has learned under
the current conditions, which the policy consults before every move and forgets when conditions
change (:mod:`tuner.conditions`).

It holds the moves that did not help, the knob settings that caused an error, the move that just
helped (tried again first), and the kept moves a later window must still confirm (a few samples
can mislead: a transient, the cost of a change landing before or after the window).
"""
from __future__ import annotations

from dataclasses import dataclass, field

from engine.config import Knobs
from tuner.moves import Move, MoveKey, knobs_key


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

    def forget(self, *, errors: bool = False) -> None:
        """Conditions changed (or a re-exploration starts): no earlier verdict blocks a move; with
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
        if move.key.opposite() is not None:
            self.failed_moves.add(move.key.opposite())  # undoing a gain is pointless

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
