"""The tuner policy's moves: what a move is (:class:`Move`, :class:`Trial`), which moves exist
from the good knobs and how they are ranked (:class:`MoveSearch`), and bounded steps toward a
target plan (the way back after contention).

Moves are ranked by what the baseline shows: read wait -> prefetch, I/O wait -> concurrency,
unbalanced lanes -> device fraction, a contended path -> stripe weight away from it; a move
that just helped scores higher (momentum). Which move to *keep* is the policy's.
"""
from __future__ import annotations

import json
from dataclasses import dataclass, field
from statistics import median
from typing import Mapping

from engine.config import Knobs
from tuner.measurement import Sample


@dataclass(frozen=True)
class Move:
    key: str
    """Identity of the move ('prefetch_depth+', 'io_concurrency[/p]-', 'stripe_weights[/p]-', ...)."""
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


def family(key: str) -> str:
    """The knob a move changes: its key less the direction ('io_concurrency[/p]', 'stripe_weights')."""
    key = key.rstrip("+-")
    return "stripe_weights" if key.startswith("stripe_weights") else key


def opposite(key: str) -> str | None:
    if key.endswith("+"):
        return key[:-1] + "-"
    if key.endswith("-"):
        return key[:-1] + "+"
    return None


def diff(a: Knobs, b: Knobs) -> str:
    """The knobs that differ, 'name old->new' each."""
    da, db = a.to_dict(), b.to_dict()
    parts = [f"{key} {da[key]}->{db[key]}" for key in da if da[key] != db[key]]
    return ", ".join(parts) or "no change"


class MoveSearch:
    """The move generator of :class:`tuner.policy.Policy`, which it is mixed into.

    It reads the policy's state: ``cfg``, ``paths``, ``has_device``, ``ranks``, ``_good`` (the
    knobs moves start from), ``_base`` (their samples), ``_failed`` and ``_bad`` (moves and
    knobs not to try), ``_momentum``, ``_start_alt``, ``_pre_shares``, ``_limits``,
    ``_contended`` and ``_pinned()``; it writes only ``_returning`` (cleared once the way
    back is done).
    """

    def _stats(self) -> dict:
        """Medians over the baseline: where the update time goes, and each path's share of bytes."""
        b = self._base[-5:]
        if not b:
            return {}
        upd = median([s.update_s for s in b]) or 1e-9
        moved = {p: median([s.path_bytes_per_s.get(p, 0.0) for s in b]) for p in self.paths}
        total = sum(moved.values())
        return {
            "read_share": min(1.0, median([s.read_wait_s for s in b]) / upd),
            "write_share": min(1.0, median([s.write_wait_s for s in b]) / upd),
            "shares": {p: v / total for p, v in moved.items()} if total > 0 else {},
        }

    def _next_move(self) -> Move | None:
        scored = sorted(self._candidates(), key=lambda sm: -sm[0])
        for _, m in scored:
            if m.key in self._failed or m.knobs == self._good or knobs_key(m.knobs) in self._bad:
                continue
            return m
        return None

    def _candidates(self) -> list[tuple[float, Move]]:
        """Every move worth trying from the good knobs, each with its score (higher: sooner)."""
        k, st = self._good, self._stats()
        read_share = st.get("read_share", 0.0)
        io_share = min(1.0, read_share + st.get("write_share", 0.0))
        shares = st.get("shares", {})
        # In this order: sorting by score is stable, so ties go to the earlier kind of move.
        out = [*self._planned_moves(k), *self._prefetch_moves(k, read_share),
               *self._concurrency_moves(k, io_share, shares), *self._stripe_moves(k, io_share, shares),
               *self._device_moves(k, io_share), *self._node_lock_moves(k, io_share)]
        return [(s + (1.0 if m.key == self._momentum else 0.0), m) for s, m in out]

    def _planned_moves(self, k: Knobs) -> list[tuple[float, Move]]:
        """Back toward the plan from before contention; the run's own start against the model's plan."""
        out: list[tuple[float, Move]] = []
        if self._returning is not None:
            back = self._step_toward(k, self._returning)
            if back != k:
                out.append((3.0, Move("return", back, f"back toward the plan before contention ({diff(k, back)})",
                                      lenient=True)))
            else:
                self._returning = None
        if self._start_alt is not None:
            out.append((2.5, Move("start", self._start_alt, f"the starting knobs ({diff(k, self._start_alt)})")))
        return out

    def _prefetch_moves(self, k: Knobs, read_share: float) -> list[tuple[float, Move]]:
        out: list[tuple[float, Move]] = []
        if self.paths and not self._pinned("prefetch_depth"):  # prefetch only matters with state on storage
            d = k.prefetch_depth
            up = min(d + (2 if read_share > 0.3 else 1), self._limits.prefetch_cap())
            if up > d:
                out.append((0.2 + 2 * read_share, Move("prefetch_depth+", k.replace(prefetch_depth=up),
                                                       f"prefetch_depth {d}->{up}")))
            if d > 0:
                out.append((0.02, Move("prefetch_depth-", k.replace(prefetch_depth=d - 1), f"prefetch_depth {d}->{d - 1}")))
        return out

    def _concurrency_moves(self, k: Knobs, io_share: float, shares: Mapping[str, float]) -> list[tuple[float, Move]]:
        out: list[tuple[float, Move]] = []
        for p in self.paths:
            if self._pinned("io_concurrency", p):
                continue
            c = k.concurrency_for(p)
            conc = dict(k.io_concurrency)
            if c < 64:
                conc[p] = min(64, 2 * c)
                out.append((0.1 + io_share * shares.get(p, 1.0 / len(self.paths)),
                            Move(f"io_concurrency[{p}]+", k.replace(io_concurrency=dict(conc)),
                                 f"io_concurrency[{p}] {c}->{conc[p]}")))
            if c > 1:
                conc[p] = c // 2
                out.append((1.5 if p in self._contended else 0.03,
                            Move(f"io_concurrency[{p}]-", k.replace(io_concurrency=dict(conc)),
                                 f"io_concurrency[{p}] {c}->{c // 2}")))
        return out

    def _stripe_moves(self, k: Knobs, io_share: float, shares: Mapping[str, float]) -> list[tuple[float, Move]]:
        out: list[tuple[float, Move]] = []
        if len(self.paths) > 1 and not self._pinned("stripe_weights"):
            w = self._weights(k, shares)
            for p in self.paths:
                new = self._shift_away(w, p) if w else None
                if new is None:
                    continue
                calm_elsewhere = any(q not in self._contended for q in self.paths if q != p)
                score = 2.0 if p in self._contended and calm_elsewhere else 0.05 + 0.3 * io_share
                out.append((score, Move(f"stripe_weights[{p}]-", k.replace(stripe_weights=new),
                                        f"stripe weight of {p} {w[p]:.3g}->{new[p]:.3g}")))
        return out

    def _device_moves(self, k: Knobs, io_share: float) -> list[tuple[float, Move]]:
        out: list[tuple[float, Move]] = []
        if self.has_device and not self._pinned("device_fraction"):
            f = k.device_fraction
            target = self._balanced_fraction()
            if target is not None:
                t, why = target
                t = min(t, self._limits.device_cap)
                if abs(t - f) >= 0.05 - 1e-9:
                    key = "device_fraction+" if t > f else "device_fraction-"
                    out.append((1.2, Move(key, k.replace(device_fraction=t), f"device_fraction {f:.2g}->{t:.2g} ({why})")))
            else:  # no lane times reported: bounded steps
                up = round(min(1.0, self._limits.device_cap, f + self.cfg.device_step), 6)
                if up > f + 1e-9 and self._limits.device_fits(up):
                    out.append((0.1 + (1 - io_share), Move("device_fraction+", k.replace(device_fraction=up),
                                                           f"device_fraction {f:.2g}->{up:.2g}")))
                if f > 0:
                    down = round(max(0.0, f - self.cfg.device_step), 6)
                    out.append((0.03, Move("device_fraction-", k.replace(device_fraction=down),
                                           f"device_fraction {f:.2g}->{down:.2g}")))
        return out

    def _node_lock_moves(self, k: Knobs, io_share: float) -> list[tuple[float, Move]]:
        if self.ranks > 1 and not self._pinned("node_lock"):
            return [(0.1 + 0.5 * io_share, Move("node_lock", k.replace(node_lock=not k.node_lock),
                                                f"node_lock {k.node_lock}->{not k.node_lock}"))]
        return []

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
        host_s = median([x.host_lane_s for x in lanes])
        wait = median([x.device_wait_s for x in lanes])
        host_n, lane_n = lanes[-1].host_lane_subgroups, lanes[-1].device_lane_subgroups
        rest = host_n + lane_n
        if rest <= 0:
            return None
        upd = median([x.update_s for x in self._base[-self.cfg.window:]])
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
            out = out.replace(prefetch_depth=min(d + max(-2, min(2, t - d)), max(d, self._limits.prefetch_cap())))
        if not self._pinned("device_fraction"):
            f, t = k.device_fraction, target.device_fraction
            f2 = round(f + max(-self.cfg.device_step, min(self.cfg.device_step, t - f)), 6)
            if f2 <= f or (f2 <= self._limits.device_cap and self._limits.device_fits(f2)):  # the headroom may have shrunk since
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
