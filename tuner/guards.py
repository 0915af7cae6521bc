"""The tuner policy's guard rails: what the run's resources allow (:class:`Limits`: the device
lane's fraction cap after an OOM, the prefetch depth that staging memory and the subgroup
count allow) and whether another process contends for a path's device (:class:`Contention`).

These only keep state and answer questions; reacting (rolling back, measuring again, moving
stripe weight away) is the policy's.
"""
from __future__ import annotations

import math
from collections import deque
from statistics import median
from typing import Sequence

import psutil

from engine.layout import STATE_BYTES_PER_ELEMENT, deepest_prefetch
from tuner.observation import Observation
from tuner.policy_config import PolicyConfig


class Limits:
    """Caps on the knobs for one run. ``device_cap`` only comes down (set by the policy below the
    fraction where an OOM happened); the staging cap, host bytes per rank for staging buffers, is
    fixed when the policy starts: the spare part of the engine's host-memory budget (``staging_bytes``,
    from the ranks' registrations), else the config's, else a quarter of what is available now
    shared by the ranks."""

    def __init__(self, cfg: PolicyConfig, *, has_device: bool, params: int, subgroup_bytes: int, ranks: int,
                 staging_bytes: int | None = None) -> None:
        self.cfg = cfg
        self.has_device = has_device
        self.params = params
        self.subgroup_bytes = subgroup_bytes
        self.ranks = ranks
        self.device_cap = 1.0
        self.staging_cap = (staging_bytes if staging_bytes is not None
                            else cfg.host_staging_bytes or psutil.virtual_memory().available // 4 // ranks)

    def subgroups_per_rank(self) -> int | None:
        if not self.params or not self.subgroup_bytes:
            return None
        return max(1, math.ceil(STATE_BYTES_PER_ELEMENT * self.params / self.subgroup_bytes))  # params are per rank

    def device_fits(self, f: float) -> bool:
        """The device lane may run at fraction ``f``: there is a device, and no OOM happened at or
        below ``f``. Its memory is the engine's to keep within the headroom (tuner.policy's docstring)."""
        return f <= 0 or (self.has_device and f <= self.device_cap + 1e-9)

    def prefetch_cap(self) -> int:
        cap = self.cfg.max_prefetch_depth
        n = self.subgroups_per_rank()
        if n is not None:
            cap = min(cap, max(0, n - 1))  # deeper than the subgroups buys nothing
        if self.subgroup_bytes:
            cap = min(cap, max(0, deepest_prefetch(self.staging_cap // self.subgroup_bytes)))
        return cap


class Contention:
    """Per path: is another process's traffic on its device enough to count as contention?"""

    def __init__(self, paths: Sequence[str], cfg: PolicyConfig) -> None:
        self.cfg = cfg
        self.paths = list(paths)
        self.contended: set[str] = set()
        self._others: dict[str, deque[float]] = {p: deque(maxlen=3) for p in self.paths}
        self._ours: dict[str, deque[float]] = {p: deque(maxlen=8) for p in self.paths}

    def track(self, obs: Observation) -> list[tuple[str, bool, float]]:
        """Update each path's contended state; return (path, appeared, others' bytes/s) changes."""
        changes = []
        for p in self.paths:
            other = float(obs.path_other_bytes_per_s.get(p, 0.0) or 0.0)
            ours = obs.path_read_bytes_per_s.get(p, 0.0) + obs.path_write_bytes_per_s.get(p, 0.0)
            hist = self._others[p]
            hist.append(other)
            if p not in self.contended:
                self._ours[p].append(ours)
            # Our own traffic in the threshold: sensor and engine intervals never align exactly.
            thr = max(self.cfg.contention_min_bytes_per_s,
                      self.cfg.contention_ratio * (median(self._ours[p]) if self._ours[p] else 0.0))
            if p not in self.contended:
                # One iteration far above the threshold, or two above it.
                if other >= 2 * thr or (len(hist) >= 2 and min(hist[-1], hist[-2]) >= thr):
                    self.contended.add(p)
                    changes.append((p, True, other))
            elif len(hist) >= 2 and max(hist[-1], hist[-2]) < thr / 2:
                self.contended.discard(p)
                changes.append((p, False, other))
        return changes
