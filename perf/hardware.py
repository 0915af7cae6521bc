"""What a hardware profile's figures give the performance model: a path's bandwidth at a
concurrency, the storage devices behind the paths (paths on one device share its bandwidth),
the host lane's seconds per parameter, and the memory budgets a workload leaves for optimizer
state. Pure functions over :class:`~perf.profile.Profile`; no I/O, no torch.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal, Sequence

from engine.errors import ConfigError
from engine.placement import round_trip_rate
from engine.units import format_size
from perf.layout import CHUNK_BYTES
from perf.profile import PathProfile, Profile

if TYPE_CHECKING:
    from perf.model import Workload

DEFAULT_HOST_SHARE = 0.5
"""Without ``Workload.host_bytes``: the share of the machine's memory given to optimizer state."""
DEFAULT_GPU_HEADROOM_SHARE = 0.5
"""Without ``Workload.gpu_headroom_bytes``: the share of GPU memory free during the update."""


def gb(b: float) -> str:
    return format_size(b)


def bandwidth(
    path: PathProfile, op: Literal["read", "write", "mixed"], concurrency: float, block_bytes: int = CHUNK_BYTES
) -> float:
    """Bytes/s of ``op`` on ``path`` at ``concurrency`` requests in flight (per direction).

    :meth:`PathProfile.bytes_per_s` (best sweep point at or below the concurrency), restricted to
    the sweep's block size nearest ``block_bytes`` when the sweep has several.
    """
    c = max(1, int(concurrency))
    points = [s for s in path.sweep if s.op == op]
    blocks = {s.block_bytes for s in points}
    if len(blocks) <= 1:
        return path.bytes_per_s(op, c)
    block = min(blocks, key=lambda b: (abs(math.log(b / block_bytes)), -b))
    points = [s for s in points if s.block_bytes == block]
    at_or_below = [s.bytes_per_s.value for s in points if s.concurrency <= c]
    if at_or_below:
        return max(at_or_below)
    lowest = min(points, key=lambda s: s.concurrency)
    return lowest.bytes_per_s.value * c / lowest.concurrency


def device_key(p: PathProfile) -> str:
    """The whole-disk name first: two partitions of one disk have two ``device_id``s, one disk."""
    return p.device or p.device_id or p.path


@dataclass(frozen=True)
class Device:
    """A storage device and the paths on it."""

    key: str
    name: str
    profile: PathProfile
    members: tuple[int, ...]  # indices into the plan's path list

    @classmethod
    def of(cls, p: PathProfile, name: str | None = None) -> "Device":
        """The device behind one path, alone."""
        return cls(device_key(p), p.device if name is None else name, p, (0,))


def default_weight(p: PathProfile) -> float:
    """The engine's default stripe weight of a path: a read plus a write of the same bytes."""
    return round_trip_rate(p.read_bytes_per_s.value, p.write_bytes_per_s.value)


def group_devices(paths: Sequence[PathProfile], active: Sequence[bool]) -> list[Device]:
    groups: dict[str, list[int]] = {}
    for i, p in enumerate(paths):
        if active[i]:
            groups.setdefault(device_key(p), []).append(i)
    return [Device(k, paths[m[0]].device or k, paths[m[0]], tuple(m)) for k, m in groups.items()]


def device_time(dev: Device, R: float, W: float, c_read: float, c_write: float, block: int) -> tuple[float, float, float, float]:
    """(time, read-only, write-only, mixed) seconds for R and W bytes at the given concurrencies."""
    rbw = bandwidth(dev.profile, "read", c_read, block)
    wbw = bandwidth(dev.profile, "write", c_write, block)
    mbw = bandwidth(dev.profile, "mixed", min(c_read, c_write), block)
    tr, tw = R / rbw, W / wbw
    tm = (R + W) / mbw if R and W else 0.0
    return max(tr, tw, tm), tr, tw, tm


def check_profile(profile: Profile) -> None:
    if profile.host_kernel_params_per_s() <= 0:
        raise ConfigError(f"profile {profile.name!r} has no CPU AdamW rate: measure one with `offloadctl profile save`")
    if profile.host.memory_bandwidth.value <= 0:
        raise ConfigError(f"profile {profile.name!r} has no host memory bandwidth: measure one with `offloadctl profile save`")


def host_budget(profile: Profile, wl: "Workload") -> int:
    """Host memory per node for optimizer state and staging."""
    return wl.host_bytes if wl.host_bytes is not None else int(profile.machine.memory_bytes * DEFAULT_HOST_SHARE)


def gpu_headroom(profile: Profile, wl: "Workload") -> int:
    """GPU memory per GPU free during the update (0 without a GPU)."""
    if profile.gpu is None:
        return 0
    if wl.gpu_headroom_bytes is not None:
        return wl.gpu_headroom_bytes
    return int(profile.gpu.memory_bytes * DEFAULT_GPU_HEADROOM_SHARE)


def host_lane_seconds_per_param(profile: Profile, wl: "Workload") -> float:
    """Seconds per parameter of the host lane with ``wl.ranks`` ranks sharing the node: the
    measured integrated rate when the profile has it, else the kernel rate plus the gradient
    upcast and weight copy at memory bandwidth (and the weight upload over PCIe)."""
    lane = profile.host.host_lane_params_per_s
    if lane is not None and lane.value > 0:
        return wl.ranks / lane.value
    extra_mem = (4 if wl.grad_bytes != 4 else 0) + (0 if profile.gpu else wl.weight_bytes)
    t = wl.ranks / profile.host_kernel_params_per_s() + extra_mem * wl.ranks / profile.host.memory_bandwidth.value
    if profile.gpu is not None:
        t += wl.weight_bytes / profile.gpu.h2d_bytes_per_s.value  # 16-bit weights to the device, in the loop
    return t
