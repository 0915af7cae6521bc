"""The tuner policy's moves: what a move is (:class:`MoveKey`, :class:`Move`, :class:`Trial`),
which moves exist from the good knobs and how they are ranked (:class:`MoveSearch`), and
bounded steps toward a target plan (the way back after contention).

Moves are ranked by what the baseline shows: read wait -> prefetch, I/O wait -> concurrency,
unbalanced lanes -> device fraction, a contended path -> stripe weight away from it; a move
that just helped scores higher (momentum). Which move to *keep* is the policy's.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from statistics import median
from typing import TYPE_CHECKING, Literal, Mapping, Sequence, TypedDict

from engine.config import KnobKey, Knobs
from tuner.conditions import io_time
from tuner.guards import Adaptation, Limits
from tuner.knob_text import Pins
from tuner.measurement import Sample
from tuner.policy_config import PolicyConfig
from tuner.run_state import RunFacts

if TYPE_CHECKING:
    from tuner.ledger import Ledger  # which imports the moves

Plan = Literal["start", "return", "model"]
Step = Literal["+", "-", ""]


@dataclass(frozen=True)
class MoveKey:
    """Identity of a move, for the moves that failed and the one that just helped: the knob it
    changes and which way (``''``: a toggle), or a whole plan (``plan``, and no knob).

    ``str()`` spells it ('prefetch_depth+', 'io_concurrency[/p]-', 'stripe_weights[/p]-' (weight
    away from /p), 'node_lock', 'start', 'return', 'model'), for the log."""

    knob: KnobKey | None = None
    step: Step = ""
    plan: Plan | None = None

    def __str__(self) -> str:
        return self.plan if self.plan is not None else f"{self.knob}{self.step}"

    def family(self) -> "MoveKey":
        """The knob a move changes, less the direction: one path's concurrency, or all the stripe
        weights (moving weight away from one path changes every path's share)."""
        if self.knob is None:
            return self
        if self.knob.name == "stripe_weights":
            return MoveKey(KnobKey("stripe_weights"))
        return MoveKey(self.knob)

    def opposite(self) -> "MoveKey | None":
        """The same knob the other way; None for a toggle or a plan."""
        if self.step == "":
            return None
        return MoveKey(self.knob, "-" if self.step == "+" else "+")


START = MoveKey(plan="start")
"""The run's own starting knobs, tried against the performance model's plan."""
RETURN = MoveKey(plan="return")
"""A step back toward the plan from before contention."""
MODEL = MoveKey(plan="model")
"""The stripe that balances the paths at their measured rates, after a change of conditions."""


@dataclass(frozen=True, kw_only=True)
class Move:
    key: MoveKey
    knobs: Knobs
    what: str
    """For the log: 'prefetch_depth 0->2'."""
    lenient: bool = False
    """Kept unless it makes things worse: a move back to a plan measured good before."""


@dataclass
class Trial:
    move: Move
    samples: list[Sample] = field(default_factory=list)


def knobs_key(k: Knobs) -> str:
    return json.dumps(k.to_dict(), sort_keys=True)


def diff(a: Knobs, b: Knobs) -> str:
    """The knobs that differ, 'name old->new' each."""
    da, db = a.to_dict(), b.to_dict()
    parts = [f"{key} {da[key]}->{db[key]}" for key in da if da[key] != db[key]]
    return ", ".join(parts) or "no change"


class BaselineStats(TypedDict, total=False):
    """:meth:`MoveSearch.stats`: each phase's share of the update, each path's share of the bytes ({} without samples)."""

    read_share: float
    write_share: float
    shares: dict[str, float]


class MoveSearch:
    """The moves worth trying from the good knobs, ranked, for one run's policy.

    It keeps no state of its own: the run's facts and guard rails (``limits``, ``adapt``: what
    changed and the tuner's response to it, ``pins``: objects the policy keeps current) are
    given once; the good knobs, the trials' :class:`tuner.ledger.Ledger` and the run's own start
    come with each call.
    """

    def __init__(self, cfg: PolicyConfig, facts: RunFacts, *, limits: Limits, adapt: Adaptation, pins: Pins) -> None:
        self.cfg = cfg
        self.facts = facts
        self._limits = limits
        self._adapt = adapt
        self._pins = pins

    def stats(self, baseline: Sequence[Sample]) -> BaselineStats:
        """Medians over the baseline: where the update time goes, and each path's share of bytes."""
        b = baseline[-5:]
        if not b:
            return {}
        upd = median([s.update_s for s in b]) or 1e-9
        moved = {p: median([s.path_bytes_per_s.get(p, 0.0) for s in b]) for p in self.facts.paths}
        total = sum(moved.values())
        return {
            "read_share": min(1.0, median([s.read_wait_s for s in b]) / upd),
            "write_share": min(1.0, median([s.write_wait_s for s in b]) / upd),
            "shares": {p: v / total for p, v in moved.items()} if total > 0 else {},
        }

    def io_move_keys(self) -> set[MoveKey]:
        """Every move of the knobs that shape the paths' traffic (prefetch, concurrency, stripe,
        node lock): what a model-guided re-stripe settles until the next re-exploration; but weight
        away from a contended path, whose rate depends on how much we send it (another job's
        requests share it by queue depth), which only a trial can tell."""
        keys = {_key("prefetch_depth", "+"), _key("prefetch_depth", "-"), _key("node_lock", "")}
        for p in self.facts.paths:
            keys |= {_key("io_concurrency", "+", p), _key("io_concurrency", "-", p)}
            if p not in self._adapt.contention.contended:
                keys.add(_key("stripe_weights", "-", p))
        return keys

    def why(self, move: Move, baseline: Sequence[Sample]) -> str:
        """Why ``move`` is tried, for the log: ': that path is contended', ' (read wait 40%, ...)'."""
        if move.key == RETURN:
            return ": contention is gone"
        if move.key == START:
            return ": the run's own starting knobs, against the model's plan"
        knob, stats = move.key.knob, self.stats(baseline)
        if (
            knob is not None
            and knob.path in self._adapt.contention.contended
            and (knob.name == "stripe_weights" or (knob.name == "io_concurrency" and move.key.step == "-"))
        ):
            return ": that path is contended"
        if not stats:
            return ""
        return f" (read wait {100 * stats['read_share']:.0f}%, write wait {100 * stats['write_share']:.0f}% of the update)"

    def next_move(self, good: Knobs, ledger: Ledger, own_start: Knobs | None) -> tuple[Move | None, bool]:
        """The best move from the ``good`` knobs not failed, not to knobs that caused an error
        (``ledger``), and not to the good knobs themselves (``own_start``: the run's own start,
        while it is to be tried against the model's plan); and whether the way back to
        ``adapt.return_to`` is done (no step is left)."""
        candidates, back_done = self._candidates(good, ledger, own_start)
        untried = (
            m
            for _, m in sorted(candidates, key=lambda sm: -sm[0])
            if m.key not in ledger.failed_moves and m.knobs != good and knobs_key(m.knobs) not in ledger.bad_knobs
        )
        return next(untried, None), back_done

    def _candidates(self, k: Knobs, ledger: Ledger, own_start: Knobs | None) -> tuple[list[tuple[float, Move]], bool]:
        """Every move worth trying from the good knobs ``k``, each with its score (higher:
        sooner); and whether the way back is done."""
        stats = self.stats(ledger.baseline)
        read_share = stats.get("read_share", 0.0)
        io_share = min(1.0, read_share + stats.get("write_share", 0.0))
        shares = stats.get("shares", {})
        # In this order: sorting by score is stable, so ties go to the earlier kind of move.
        planned, back_done = self._planned_moves(k, ledger.baseline, own_start)
        out = [
            *planned,
            *self._prefetch_moves(k, read_share),
            *self._concurrency_moves(k, io_share, shares),
            *self._stripe_moves(k, io_share, shares),
            *self._device_moves(k, io_share, ledger.baseline),
            *self._node_lock_moves(k, io_share),
        ]
        return [(s + (1.0 if m.key == ledger.last_kept else 0.0), m) for s, m in out], back_done

    def _planned_moves(
        self, k: Knobs, baseline: Sequence[Sample], own_start: Knobs | None
    ) -> tuple[list[tuple[float, Move]], bool]:
        """Back toward the plan from before contention (and whether no step is left); the run's
        own start against the model's plan."""
        out: list[tuple[float, Move]] = []
        back_done = False
        if self._adapt.return_to is not None:
            back = self.step_toward(k, self._adapt.return_to, baseline)
            if back != k:
                out.append(
                    (
                        3.0,
                        Move(
                            key=RETURN, knobs=back, lenient=True, what=f"back toward the plan before contention ({diff(k, back)})"
                        ),
                    )
                )
            else:
                back_done = True
        if own_start is not None:
            out.append((2.5, Move(key=START, knobs=own_start, what=f"the starting knobs ({diff(k, own_start)})")))
        return out, back_done

    def _prefetch_moves(self, k: Knobs, read_share: float) -> list[tuple[float, Move]]:
        out: list[tuple[float, Move]] = []
        if self.facts.paths and not self._pins.covers("prefetch_depth"):  # prefetch only matters with state on storage
            d = k.prefetch_depth
            up = min(d + (2 if read_share > 0.3 else 1), self._limits.prefetch_cap())
            if up > d:
                out.append(
                    (
                        0.2 + 2 * read_share,
                        Move(
                            key=_key("prefetch_depth", "+"), knobs=k.replace(prefetch_depth=up), what=f"prefetch_depth {d}->{up}"
                        ),
                    )
                )
            if d > 0:
                out.append(
                    (
                        0.02,
                        Move(
                            key=_key("prefetch_depth", "-"),
                            knobs=k.replace(prefetch_depth=d - 1),
                            what=f"prefetch_depth {d}->{d - 1}",
                        ),
                    )
                )
        return out

    def _concurrency_moves(self, k: Knobs, io_share: float, shares: Mapping[str, float]) -> list[tuple[float, Move]]:
        """Twice or half the requests in flight on one path; where the path's probe at start
        answered at this concurrency (``adapt.depth_response``) and no one else shares it, only a
        rise the probe says gains (half the requests cannot serve it faster than the probe showed
        at full depth)."""
        out: list[tuple[float, Move]] = []
        for p in self.facts.paths:
            if self._pins.covers("io_concurrency", p):
                continue
            c, knob = k.concurrency_for(p), KnobKey("io_concurrency", p)
            conc = dict(k.io_concurrency)
            probed = self._adapt.depth_response.get(p) if p not in self._adapt.contention.contended else None
            probed = probed if probed is not None and probed.get("at") == c else None
            if c < 64 and (probed is None or probed.get("double", 0.0) >= 1 + self.cfg.depth_gain):
                conc[p] = min(64, 2 * c)
                out.append(
                    (
                        0.1 + io_share * shares.get(p, 1.0 / len(self.facts.paths)),
                        Move(
                            key=MoveKey(knob, "+"),
                            knobs=k.replace(io_concurrency=dict(conc)),
                            what=f"{knob} {c}->{conc[p]}",
                        ),
                    )
                )
            if c > 1 and probed is None:
                conc[p] = c // 2
                out.append(
                    (
                        1.5 if p in self._adapt.contention.contended else 0.03,
                        Move(
                            key=MoveKey(knob, "-"),
                            knobs=k.replace(io_concurrency=dict(conc)),
                            what=f"{knob} {c}->{c // 2}",
                        ),
                    )
                )
        return out

    def _stripe_moves(self, k: Knobs, io_share: float, shares: Mapping[str, float]) -> list[tuple[float, Move]]:
        """Weight away from one path, for each path; with every path's rate known, only the steps
        the paths' balance at those rates says may shorten their time (a step away from a
        balanced stripe only unbalances it: no trial spent on it), but away from a contended path."""
        out: list[tuple[float, Move]] = []
        if len(self.facts.paths) > 1 and not self._pins.covers("stripe_weights") and (w := self.weights_of(k, shares)):
            known = self._adapt.conditions.known()
            rates = self._adapt.conditions.rates()
            for p in self.facts.paths:
                new = self._shift_away(w, p)
                # A contended path's rate moves with our share of its queue: no prediction holds.
                if new is None or (
                    known and p not in self._adapt.contention.contended and io_time(new, rates) >= io_time(w, rates)
                ):
                    continue
                calm_elsewhere = any(q not in self._adapt.contention.contended for q in self.facts.paths if q != p)
                score = 2.0 if p in self._adapt.contention.contended and calm_elsewhere else 0.05 + 0.3 * io_share
                out.append(
                    (
                        score,
                        Move(
                            key=_key("stripe_weights", "-", p),
                            knobs=k.replace(stripe_weights=new),
                            what=f"stripe weight of {p} {w[p]:.3g}->{new[p]:.3g}",
                        ),
                    )
                )
        return out

    def _device_moves(self, k: Knobs, io_share: float, baseline: Sequence[Sample]) -> list[tuple[float, Move]]:
        out: list[tuple[float, Move]] = []
        if self.facts.has_device and not self._pins.covers("device_fraction"):
            f = k.device_fraction
            target = self._balanced_fraction(k, baseline)
            if target is not None:
                t, why = target
                t = min(t, self._limits.device_cap)
                if abs(t - f) >= 0.05 - 1e-9:
                    key = _key("device_fraction", "+" if t > f else "-")
                    out.append(
                        (1.2, Move(key=key, knobs=k.replace(device_fraction=t), what=f"device_fraction {f:.2g}->{t:.2g} ({why})"))
                    )
            else:  # no lane times reported: bounded steps
                up = round(min(1.0, self._limits.device_cap, f + self.cfg.device_step), 6)
                if up > f + 1e-9 and self._limits.device_fits(up):
                    out.append(
                        (
                            0.1 + (1 - io_share),
                            Move(
                                key=_key("device_fraction", "+"),
                                knobs=k.replace(device_fraction=up),
                                what=f"device_fraction {f:.2g}->{up:.2g}",
                            ),
                        )
                    )
                if f > 0:
                    down = round(max(0.0, f - self.cfg.device_step), 6)
                    out.append(
                        (
                            0.03,
                            Move(
                                key=_key("device_fraction", "-"),
                                knobs=k.replace(device_fraction=down),
                                what=f"device_fraction {f:.2g}->{down:.2g}",
                            ),
                        )
                    )
        return out

    def _node_lock_moves(self, k: Knobs, io_share: float) -> list[tuple[float, Move]]:
        if self.facts.ranks > 1 and not self._pins.covers("node_lock"):
            return [
                (
                    0.1 + 0.5 * io_share,
                    Move(
                        key=_key("node_lock", ""),
                        knobs=k.replace(node_lock=not k.node_lock),
                        what=f"node_lock {k.node_lock}->{not k.node_lock}",
                    ),
                )
            ]
        return []

    def _balanced_fraction(self, k: Knobs, baseline: Sequence[Sample]) -> tuple[float, str] | None:
        """Where the lanes' measured times say the device fraction should go (steps of 0.05),
        and why; None without lane times, or when no subgroup is outside the device tier.

        The step waits at its end only for the device lane, so a wait means the GPU side (its
        PCIe copies) finished last and took about the whole update: its rate is lane subgroups
        over the update time, the host lane's is its subgroups over its busy time, and the
        fraction where both finish together is ``r_dev / (r_dev + r_host)``. No wait means the
        GPU kept up and its rate is only known to be enough: one ``device_step`` more (runs
        start from the engine's measured balance, so this is a refinement). No device lane yet:
        half the subgroups, once."""
        lanes = [x.lanes for x in baseline[-self.cfg.window :] if x.lanes is not None]
        if not lanes:
            return None
        host_s = median([x.host_lane_s for x in lanes])
        wait = median([x.device_wait_s for x in lanes])
        host_n, lane_n = lanes[-1].host_lane_subgroups, lanes[-1].device_lane_subgroups
        rest = host_n + lane_n
        if rest <= 0:
            return None
        upd = median([x.update_s for x in baseline[-self.cfg.window :]])
        f = k.device_fraction
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

    def weights_of(self, k: Knobs, shares: Mapping[str, float]) -> dict[str, float] | None:
        """Current stripe weights as shares summing to 1: the knobs', else the observed byte shares
        (the engine's default weights are its measured bandwidths, which the policy cannot see)."""
        if all(p in k.stripe_weights for p in self.facts.paths):
            w = {p: float(k.stripe_weights[p]) for p in self.facts.paths}
        elif shares and sum(shares.values()) > 0:
            w = dict(shares)
        else:
            return None
        total = sum(w.values())
        return {p: v / total for p, v in w.items()} if total > 0 else None

    def _shift_away(self, w: dict[str, float], p: str) -> dict[str, float] | None:
        others = [q for q in self.facts.paths if q != p]
        if w[p] <= 1e-6 or not others:
            return None
        d = self.cfg.stripe_step * w[p]
        out = dict(w)
        out[p] -= d
        rest = sum(w[q] for q in others)
        for q in others:
            out[q] += d * (w[q] / rest if rest > 0 else 1 / len(others))
        return {q: round(v, 4) for q, v in out.items()}

    def step_toward(self, k: Knobs, target: Knobs, baseline: Sequence[Sample]) -> Knobs:
        """One bounded move of every searchable knob from ``k`` toward ``target`` (its stripe
        weights, when the engine's, as the byte shares when contention appeared)."""
        out = k
        if not self._pins.covers("prefetch_depth"):
            d, t = k.prefetch_depth, target.prefetch_depth
            out = out.replace(prefetch_depth=min(d + max(-2, min(2, t - d)), max(d, self._limits.prefetch_cap())))
        if not self._pins.covers("device_fraction"):
            f, to = k.device_fraction, target.device_fraction
            f2 = round(f + max(-self.cfg.device_step, min(self.cfg.device_step, to - f)), 6)
            if f2 <= f or (f2 <= self._limits.device_cap and self._limits.device_fits(f2)):  # the headroom may have shrunk since
                out = out.replace(device_fraction=f2)
        conc = dict(out.io_concurrency)
        for p in self.facts.paths:
            if self._pins.covers("io_concurrency", p):
                continue
            c, t = k.concurrency_for(p), target.concurrency_for(p)
            conc[p] = min(t, 2 * c) if t > c else max(t, c // 2)
            if conc[p] == t and p not in target.io_concurrency:
                del conc[p]  # back to the engine's default, as the target has it
        out = out.replace(io_concurrency=conc, node_lock=target.node_lock if not self._pins.covers("node_lock") else k.node_lock)
        if len(self.facts.paths) > 1 and not self._pins.covers("stripe_weights") and k.stripe_weights != target.stripe_weights:
            cur = self.weights_of(k, self.stats(baseline).get("shares", {}))
            tgt = self.weights_of(target, self._adapt.shares_before_contention)
            if cur and tgt:
                # Paths losing weight lose at most stripe_step of theirs; the gainers share it.
                delta = {p: tgt[p] - cur[p] for p in self.facts.paths}
                loss = {p: min(-delta[p], self.cfg.stripe_step * cur[p]) for p in self.facts.paths if delta[p] < 0}
                if all(loss[p] >= -delta[p] - 1e-9 for p in loss):
                    out = out.replace(stripe_weights=dict(target.stripe_weights))  # within one step: exactly there
                else:
                    moved, gain = sum(loss.values()), sum(v for v in delta.values() if v > 0)
                    new = {
                        p: cur[p] - loss.get(p, 0.0) + (moved * delta[p] / gain if delta[p] > 0 else 0.0)
                        for p in self.facts.paths
                    }
                    out = out.replace(stripe_weights={p: round(v, 4) for p, v in new.items()})
        return out


def _key(name: str, step: Step, path: str | None = None) -> MoveKey:
    return MoveKey(KnobKey(name, path), step)
