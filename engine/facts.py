"""What the engine tells the layers above about itself: :class:`EngineFacts` (its plan in
force, from :meth:`engine.core.SubgroupEngine.describe`) and :class:`DeviceFit` (what
:meth:`~engine.core.SubgroupEngine.fit_device_tier` decided). Frozen: they travel as they are,
and ``to_dict`` is their one JSON form (logs, ``--dry-run``, the run record)."""
from __future__ import annotations

from dataclasses import asdict, dataclass, field

from engine.config import Knobs


@dataclass(frozen=True, kw_only=True)
class EngineFacts:
    """The plan in force: tiers, bytes per tier, knobs; what a tuner learns what it tunes from."""

    subgroups: int
    params: int
    state_bytes_by_tier: dict[str, int] = field(default_factory=dict)
    """Bytes of optimizer state per tier: 'device', 'host', or a storage path."""
    staging_buffers: int = 0
    io_backend: str | None = None
    host_kernel: str = ""
    device: str | None = None
    path_bandwidth_bytes_per_s: dict[str, float] = field(default_factory=dict)
    knobs: Knobs = field(default_factory=Knobs)
    """The knobs in force."""
    paths: list[str] = field(default_factory=list)
    has_device: bool = False
    subgroup_bytes: int = 0
    """The largest subgroup's state."""
    device_headroom_bytes: int | None = None
    device_lane_bytes: int = 0
    device_lane_available: bool = False
    host_memory_budget_bytes: int = 0
    """The rank's host-memory budget (``engine.host_memory``)."""
    host_bytes: dict[str, int] = field(default_factory=dict)
    """What the engine holds in host memory now, by kind."""
    host_staging_bytes: int = 0
    """Host bytes the budget leaves for staging buffers (``engine.host_memory.staging_room``)."""
    fixed_knobs: tuple[str, ...] = ()
    """Knobs the user fixed: a tuner never moves them."""

    def to_dict(self) -> dict:
        return asdict(self)


@dataclass(frozen=True)
class DeviceFit:
    """What :meth:`SubgroupEngine.fit_device_tier` decided (for logs, the adapter and the report)."""

    headroom_bytes: int = 0
    """Device memory the state could take after forward/backward (less the margin and reserve)."""
    device_tier_subgroups: int = 0
    device_tier_bytes: int = 0
    """Device memory the device tier takes (state, and gradients kept on the device)."""
    device_fraction: float = 0.0
    """The device lane's starting fraction of the subgroups outside the device tier."""
    device_lane_grads_on_device: int = 0
    """Device-lane subgroups (at that fraction) whose gradients stay on the device."""
    device_lane_bytes: int = 0
    """Device memory the device lane's chunk slots take when it runs."""
    device_lane_off: str | None = None
    """Why the device lane cannot run (no room for its slots); None when it can."""

    def to_dict(self) -> dict:
        return asdict(self)
