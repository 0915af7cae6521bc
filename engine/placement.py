"""Where each subgroup's state lives: pure functions, no I/O.

Whole subgroups are placed. The device budget is filled first, then the host budget, in
subgroup order; the rest is striped over the storage paths so that each path's share of bytes
is proportional to its weight (its bandwidth unless the knobs say otherwise). Greedy
least-finish-time assignment keeps consecutive subgroups on different paths, so prefetches
of neighbours run on several devices at once.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal, Sequence

from engine.errors import ConfigError


@dataclass(frozen=True)
class Tier:
    """Where one subgroup's state lives: device memory, host memory, or a swap file on the
    storage path ``path_index`` (``SwapPaths.paths[path_index]``)."""

    kind: Literal["device", "host", "swap"]
    """Device memory, host memory, or a swap file."""
    path_index: int | None = None

    @property
    def swapped(self) -> bool:
        return self.path_index is not None

    def __repr__(self) -> str:
        return f"swap:{self.path_index}" if self.swapped else self.kind


DEVICE = Tier("device")
HOST = Tier("host")


def swap_tier(path_index: int) -> Tier:
    """The tier of a subgroup swapped to storage path ``path_index``."""
    return Tier("swap", path_index)


DEVICE_LANE_SLOTS = 3
"""Device buffers of the device lane: one copying in, one updating, one copying back."""
DEVICE_LANE_CHUNK_NUMEL = 1 << 23
"""Elements the device lane moves and updates at a time: a subgroup goes through the lane in
chunks of this size, so the lane's device memory does not grow with ``sub_group_size``
(DeepSpeed's default of 1e9 would need 40 GB in whole-subgroup slots). 32 MB per fp32 copy
keeps pinned PCIe copies at their full rate."""


def device_lane_working_bytes(
    capacity_numel: int, slots: int = DEVICE_LANE_SLOTS, chunk_numel: int = DEVICE_LANE_CHUNK_NUMEL
) -> int:
    """Device memory a device lane over subgroups of at most ``capacity_numel`` elements uses:
    per slot, a chunk of fp32 state (12 B/element), of gradient and of 16- or 32-bit weights
    (4 B each at most); and two fp32 gradient scratches (the lane's and the device tier's
    update streams). Bounded by the chunk, whatever the subgroup size."""
    c = min(capacity_numel, chunk_numel)
    return (20 * slots + 8) * c


@dataclass(frozen=True)
class Placement:
    """Each subgroup's tier, in subgroup order."""

    tiers: tuple[Tier, ...]


def place_resident(sizes_bytes: Sequence[int], *, device_budget: int, host_budget: int | None) -> list[Tier | None]:
    """DEVICE/HOST for subgroups that fit the budgets (in order), None for those that must swap."""
    out: list[Tier | None] = []
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


def round_trip_rate(read_bytes_per_s: float, write_bytes_per_s: float) -> float:
    """A path's rate for a read plus a write of the same bytes, its default stripe weight: what
    a subgroup's round trip costs it. 0 when either rate is unknown (0)."""
    if not (read_bytes_per_s > 0 and write_bytes_per_s > 0):
        return 0.0
    return 1.0 / (1.0 / read_bytes_per_s + 1.0 / write_bytes_per_s)


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


def place(sizes_bytes: Sequence[int], *, device_budget: int, host_budget: int | None, path_weights: Sequence[float]) -> Placement:
    resident = place_resident(sizes_bytes, device_budget=device_budget, host_budget=host_budget)
    swapped = [i for i, r in enumerate(resident) if r is None]
    if swapped and not path_weights:
        need = sum(sizes_bytes[i] for i in swapped)
        raise ConfigError(
            f"host_cache_bytes={host_budget} leaves {len(swapped)} subgroups ({need} bytes of optimizer state) "
            f"with nowhere to go: give nvme_paths or remote_paths, or raise host_cache_bytes (None keeps all in memory)"
        )
    paths = stripe([sizes_bytes[i] for i in swapped], path_weights) if swapped else []
    swapped_tiers = iter([swap_tier(p) for p in paths])  # in the order of the swapped ones
    return Placement(tuple(next(swapped_tiers) if r is None else r for r in resident))


def device_tier_prefix(costs_bytes: Sequence[int], headroom_bytes: int, lane_bytes: int) -> int:
    """How many leading subgroups a fitted device tier takes (``device_cache_bytes=None``): all
    of them when they fit with the device lane's slots (the tier's own update streams through
    the lane's scratch), otherwise the longest prefix that leaves the slots free."""
    if sum(costs_bytes) + lane_bytes <= headroom_bytes:
        return len(costs_bytes)
    left, n = headroom_bytes - lane_bytes, 0
    while n < len(costs_bytes) and costs_bytes[n] <= left:
        left -= costs_bytes[n]
        n += 1
    return n


def device_lane_mask(n: int, fraction: float) -> list[bool]:
    """Which of ``n`` subgroups (by index) take the device lane: ``fraction`` of them, evenly spread.

    Subgroup i is chosen when floor((i + 1) * f) > floor(i * f), so chosen ones are interleaved
    with host-lane ones and their transfers overlap host-lane updates.
    """
    return [int((i + 1) * fraction + 1e-9) > int(i * fraction + 1e-9) for i in range(n)]
