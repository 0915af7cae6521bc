"""The tuner's ledger of trials and rulings alone (:mod:`tuner.ledger`): small inputs, exact
expectations. Costs are iteration seconds against a baseline whose last five samples have a
median of 1.0, and a noise threshold of 5%, so that each rule's edge is a round figure."""

from __future__ import annotations

import pytest

from engine.config import KnobKey, Knobs
from tuner.ledger import Ledger, Ruling
from tuner.measurement import Sample
from tuner.moves import Move, MoveKey, Trial, knobs_key

THR, WINDOW = 0.05, 3
UP, DOWN = MoveKey(KnobKey("prefetch_depth"), "+"), MoveKey(KnobKey("prefetch_depth"), "-")
GOOD, DEEPER = Knobs(prefetch_depth=2), Knobs(prefetch_depth=3)


def sample(cost: float) -> Sample:
    return Sample(update_s=cost / 2, iter_time_s=cost, read_wait_s=0.0, write_wait_s=0.0, path_bytes_per_s={})


def on_trial(*, lenient: bool = False, baseline=(9.0, 1.0, 1.0, 0.9, 1.1, 1.0)) -> Ledger:
    """A ledger whose good knobs measured ``baseline`` (only the last five count: the 9.0 never
    does), with a trial of prefetch_depth 2->3."""
    return Ledger(
        trial=Trial(Move(key=UP, knobs=DEEPER, what="prefetch_depth 2->3", lenient=lenient)),
        baseline=[sample(c) for c in baseline],
    )


def rulings(ledger: Ledger, costs) -> list[Ruling | None]:
    return [ledger.rule(sample(c), THR, WINDOW) for c in costs]


def test_a_move_must_beat_the_good_knobs_by_the_threshold_over_a_window():
    assert rulings(on_trial(), [0.94, 0.93, 0.92]) == [None, None, Ruling(True, 1.0, (0.94, 0.93, 0.92), THR)]
    assert rulings(on_trial(), [0.96, 1.02, 0.955])[-1] == Ruling(False, 1.0, (0.96, 1.02, 0.955), THR)
    # exactly the threshold is not a gain
    assert rulings(on_trial(), [0.94, 1.02, 0.95])[-1].keep is False


def test_clearly_worse_or_better_samples_rule_before_the_window():
    # one sample over 25% worse (3 x 5% is less): reverted at once
    assert rulings(on_trial(), [1.26]) == [Ruling(False, 1.0, (1.26,), THR)]
    assert rulings(on_trial(), [1.25, 1.06]) == [None, Ruling(False, 1.0, (1.25, 1.06), THR)]
    # two under twice the threshold: kept without waiting
    assert rulings(on_trial(), [0.89, 0.85]) == [None, Ruling(True, 1.0, (0.89, 0.85), THR)]
    assert rulings(on_trial(), [0.89, 0.9]) == [None, None]


def test_a_lenient_move_is_kept_unless_it_does_worse():
    assert rulings(on_trial(lenient=True), [1.03, 1.05, 1.04])[-1] == Ruling(True, 1.0, (1.03, 1.05, 1.04), THR)
    assert rulings(on_trial(lenient=True), [1.03, 1.06, 1.06])[-1].keep is False
    assert rulings(on_trial(lenient=True), [1.5]) == [None]  # no single-sample revert for a lenient move
    assert rulings(on_trial(lenient=True), [1.11, 1.2]) == [None, Ruling(False, 1.0, (1.11, 1.2), THR)]
    assert rulings(on_trial(lenient=True), [0.89, 0.8]) == [None, Ruling(True, 1.0, (0.89, 0.8), THR)]


def test_the_cost_is_the_update_phase_without_an_iteration_time():
    ledger = on_trial()
    ledger.baseline = [Sample(2.0, None, 0.0, 0.0, {})] * 5
    assert ledger.rule(Sample(2.6, None, 0.0, 0.0, {}), THR, WINDOW) == Ruling(False, 2.0, (2.6,), THR)
    assert ledger.trial.samples[-1].update_s == 2.6


def test_a_ruling_needs_a_trial():
    with pytest.raises(ValueError, match="no trial"):
        Ledger(baseline=[sample(1.0)]).rule(sample(1.0), THR, WINDOW)


def test_kept_and_reverted_moves_in_the_ledger():
    ledger = Ledger(reverts=2)
    ledger.kept(Move(key=UP, knobs=DEEPER, what="up"), GOOD, 1.0, confirm=True)
    assert (ledger.kept_total, ledger.reverts, ledger.last_kept, ledger.failed_moves) == (1, 0, UP, {DOWN})
    assert [(k.move.key, k.before, k.before_cost) for k in ledger.unconfirmed] == [(UP, GOOD, 1.0)]
    node_lock = MoveKey(KnobKey("node_lock"))
    ledger.reverted(Move(key=node_lock, knobs=GOOD.replace(node_lock=True), what="lock"))
    assert (ledger.reverts, ledger.last_kept, ledger.failed_moves) == (1, None, {DOWN, node_lock})
    ledger.errored(DEEPER)
    assert ledger.bad_knobs == {knobs_key(DEEPER)} and ledger.failed_moves == {DOWN, node_lock}


def test_a_kept_move_a_later_window_refutes_is_undone_and_barred():
    ledger = Ledger()
    ledger.kept(Move(key=UP, knobs=DEEPER, what="up"), GOOD, 1.0, confirm=True)
    assert ledger.refuted(1.05, THR) is None and ledger.unconfirmed == []  # within the threshold: confirmed
    ledger.kept(Move(key=UP, knobs=DEEPER, what="up"), GOOD, 1.0, confirm=True)
    undone = ledger.refuted(1.06, THR)
    assert (undone.move.key, undone.before, undone.before_cost) == (UP, GOOD, 1.0)
    assert (ledger.kept_total, ledger.last_kept, ledger.failed_moves) == (1, None, {UP})  # its opposite may help now


def test_forgetting_and_measuring_again():
    ledger = on_trial()
    ledger.kept(Move(key=UP, knobs=DEEPER, what="up"), GOOD, 1.0, confirm=True)
    ledger.errored(DEEPER, Move(key=UP, knobs=DEEPER, what="up"))
    ledger.reverts = 2
    ledger.forget()
    assert (ledger.failed_moves, ledger.unconfirmed, ledger.last_kept, ledger.bad_knobs) == (set(), [], None, {knobs_key(DEEPER)})
    ledger.forget(errors=True)
    assert ledger.bad_knobs == set()
    ledger.remeasure(keep_samples=True)
    assert (len(ledger.baseline), ledger.reverts) == (6, 0)
    ledger.remeasure()
    assert ledger.baseline == [] and ledger.kept_total == 1
