"""Where each subgroup's state lives: pure functions, no I/O.

Whole subgroups are placed. The device budget is filled first, then the host budget, in
subgroup order; the rest is striped over the storage paths so that each path's share of bytes
is proportional to its weight (its bandwidth unless the knobs say otherwise). Greedy
least-finish-time assignment keeps consecutive subgroups on different paths, so prefetches
of neighbours run on several devices at once.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

from engine.errors import ConfigError

DEVICE = "device"
HOST = "host"

DEVICE_LANE_SLOTS = 3
"""Device buffers of the device lane: one copying in, one updating, one copying back."""
DEVICE_LANE_CHUNK_NUMEL = 1 << 23
"""Elements the device lane moves and updates at a time: a subgroup goes through the lane in
chunks of this size, so the lane's device memory does not grow with ``sub_group_size``
(DeepSpeed's default of 1e9 would need 40 GB in whole-subgroup slots). 32 MB per fp32 copy
keeps pinned PCIe copies at their full rate."""


def device_lane_working_bytes(capacity_numel: int, slots: int = DEVICE_LANE_SLOTS,
                              chunk_numel: int = DEVICE_LANE_CHUNK_NUMEL) -> int:
    """Device memory a device lane over subgroups of at most ``capacity_numel`` elements uses:
    per slot, a chunk of fp32 state (12 B/element), of gradient and of 16- or 32-bit weights
    (4 B each at most); and two fp32 gradient scratches (the lane's and the device tier's
    update streams). Bounded by the chunk, whatever the subgroup size."""
    c = min(capacity_numel, chunk_numel)
    return (20 * slots + 8) * c


@dataclass(frozen=True)
class Placement:
    """Per subgroup: DEVICE, HOST, or the index of a storage path."""

    tiers: tuple[str | int, ...]

    def on_path(self, p: int) -> list[int]:
        return [i for i, t in enumerate(self.tiers) if t == p]

    @property
    def swapped(self) -> list[int]:
        return [i for i, t in enumerate(self.tiers) if isinstance(t, int)]


def place_resident(sizes_bytes: Sequence[int], *, device_budget: int, host_budget: int | None) -> list[str | None]:
    """DEVICE/HOST for subgroups that fit the budgets (in order), None for those that must swap."""
    out: list[str | None] = []
    dev_left, host_left = device_budget, host_budget
    for size in sizes_bytes:
        if size <= dev_left:
            dev_left -= size
            out.append(DEVICE)
        elif host_left is None or size <= host_left:
            host_left = None if host_left is None else host_left - size
            out.append(HOST)
        else:
            host_left = 0  # keep residency a prefix: later subgroups do not jump the queue
            out.append(None)
    return out


def stripe(sizes_bytes: Sequence[int], weights: Sequence[float]) -> list[int]:
    """Path index for each subgroup so that bytes per path are proportional to ``weights``."""
    if not weights or sum(weights) <= 0:
        raise ConfigError("no storage path has a positive stripe weight; give at least one path weight > 0")
    load = [0.0] * len(weights)
    out = []
    for size in sizes_bytes:
        p = min((i for i, w in enumerate(weights) if w > 0), key=lambda i: ((load[i] + size) / weights[i], i))
        load[p] += size
        out.append(p)
    return out


def place(sizes_bytes: Sequence[int], *, device_budget: int, host_budget: int | None,
          path_weights: Sequence[float]) -> Placement:
    resident = place_resident(sizes_bytes, device_budget=device_budget, host_budget=host_budget)
    swapped = [i for i, r in enumerate(resident) if r is None]
    if swapped and not path_weights:
        need = sum(sizes_bytes[i] for i in swapped)
        raise ConfigError(
            f"host_cache_bytes={host_budget} leaves {len(swapped)} subgroups ({need} bytes of optimizer state) "
            f"with nowhere to go: give nvme_paths or remote_paths, or raise host_cache_bytes (None keeps all in memory)")
    paths = stripe([sizes_bytes[i] for i in swapped], path_weights) if swapped else []
    tiers: list[str | int] = list(resident)  # type: ignore[arg-type]
    for i, p in zip(swapped, paths):
        tiers[i] = p
    return Placement(tuple(tiers))


def device_lane_mask(n: int, fraction: float) -> list[bool]:
    """Which of ``n`` subgroups (by index) take the device lane: ``fraction`` of them, evenly spread.

    Subgroup i is chosen when floor((i + 1) * f) > floor(i * f), so chosen ones are interleaved
    with host-lane ones and their transfers overlap host-lane updates.
    """
    return [int((i + 1) * fraction + 1e-9) > int(i * fraction + 1e-9) for i in range(n)]
