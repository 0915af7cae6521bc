"""What the tuner's policy measures and how far it trusts it: :class:`Sample` (one iteration's
figures, the cost a move is judged on) and :class:`Noise` (the relative noise pooled over the
windows measured, and the threshold a move must beat because of it).
"""

from __future__ import annotations

import math
import statistics
from collections import deque
from dataclasses import dataclass
from typing import Sequence

from tuner.observation import LaneTimes, Observation
from tuner.policy_config import PolicyConfig


@dataclass
class Sample:
    update_s: float
    iter_time_s: float | None
    read_wait_s: float
    write_wait_s: float
    path_bytes_per_s: dict[str, float]
    lanes: LaneTimes | None = None

    @property
    def cost(self) -> float:
        """What a move is judged on: the iteration, or the update phase when no iteration time
        is reported."""
        return self.iter_time_s if self.iter_time_s else self.update_s

    @classmethod
    def of(cls, obs: Observation, paths: Sequence[str]) -> "Sample":
        """The sample of ``obs``: its iteration time less its one-time setup (``setup_s``), which
        a move pays once and not at every iteration it stays (the update phase never has it)."""
        moved = {p: obs.path_read_bytes_per_s.get(p, 0.0) + obs.path_write_bytes_per_s.get(p, 0.0) for p in paths}
        it = None
        if obs.iter_time_s and math.isfinite(obs.iter_time_s):
            setup = obs.setup_s if isinstance(obs.setup_s, (int, float)) and math.isfinite(obs.setup_s) else 0.0
            steady = obs.iter_time_s - max(0.0, setup)
            it = steady if steady >= obs.update_s else None
        return cls(obs.update_s, it, obs.read_wait_s, obs.write_wait_s, moved, obs.lanes)


class Noise:
    """The run's relative noise, one estimate per measured window (the last 20 kept)."""

    def __init__(self, cfg: PolicyConfig) -> None:
        self.cfg = cfg
        self._sigmas: deque[float] = deque(maxlen=20)

    def threshold(self) -> float:
        """The relative gain a move must show: ``noise_k`` sigma, within [min_gain, max_threshold]."""
        # A prior of 2% keeps the first rulings cautious until real windows have been measured.
        sigma = statistics.median([*self._sigmas, 0.02])
        return min(self.cfg.max_threshold, max(self.cfg.min_gain, self.cfg.noise_k * sigma))

    def add(self, xs: list[float]) -> None:
        """Pool a relative-noise estimate from one window (:func:`relative_noise`)."""
        sigma = relative_noise(xs)
        if sigma is not None:
            self._sigmas.append(sigma)


def relative_noise(xs: Sequence[float]) -> float | None:
    """Sigma over the median, estimated from a window's range: the range over the median, divided
    by the expected range of n normal samples in units of sigma (d2, as in control charts). None
    for fewer than two samples or a median of 0."""
    d2 = {2: 1.128, 3: 1.693, 4: 2.059, 5: 2.326}.get(min(len(xs), 5))
    m = statistics.median(xs) if xs else 0.0
    if not d2 or m <= 0:
        return None
    return (max(xs) - min(xs)) / m / d2


def negligible(
    baseline: Sequence[Sample], cfg: PolicyConfig, *, has_device: bool, threshold: float, kept: int, factor: float = 1.0
) -> str | None:
    """Why no move can pay, in one sentence, or None when one can: what the knobs can change is
    under the bar (``factor`` x the larger of ``cfg.negligible_share`` and twice the noise
    ``threshold``) as a share of the iteration, medians over ``baseline`` (the last window).
    Without a device lane the knobs change only the update's I/O waits; with one, the whole
    update phase. ``kept``: moves kept so far in the run (said, when any)."""
    if not baseline:
        return None
    cost = "iteration" if all(x.iter_time_s for x in baseline) else "update"
    it = statistics.median([x.cost for x in baseline])
    if has_device:
        tunable, what = statistics.median([x.update_s for x in baseline]), "the update phase"
    else:
        tunable, what = statistics.median([x.read_wait_s + x.write_wait_s for x in baseline]), "the update's I/O waits"
    bar = factor * max(cfg.negligible_share, 2 * threshold)
    share = tunable / it if it > 0 else 1.0
    if share >= bar:
        return None
    after = f"after {kept} kept move{'s' if kept != 1 else ''}, " if kept else ""
    bar_is = (
        f"under the {100 * bar:.0f}% a gain must pass to show above this run's noise"
        if 2 * threshold >= cfg.negligible_share
        else f"under {100 * bar:.0f}%, too little to be worth a trial"
    )
    return f"{after}the knobs can change only {what}, {100 * share:.1f}% of the {cost}: {bar_is}"
