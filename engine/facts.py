"""What the engine tells the layers above about itself: :class:`EngineFacts` (its plan in
force, from :meth:`engine.core.SubgroupEngine.describe`, gathered from its parts by
:func:`facts_of`) and :class:`DeviceFit` (what :meth:`engine.device_tier.DeviceTier.fit`
decided). Frozen: they travel as they are, and ``to_dict`` is their one JSON form (logs,
``--dry-run``, the run record). ``docs/engine.md`` names the parts."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING, Any, Mapping, Protocol

from engine.config import EngineConfig, KnobKey, Knobs
from engine.host_memory import HostUsage
from engine.layout import payload_bytes

if TYPE_CHECKING:
    import torch

    from engine.device_tier import DeviceTier
    from engine.host_memory import HostBudget
    from engine.subgroup import Subgroup
    from engine.swap_paths import SwapPaths
    from engine.transfers import Transfers


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
    path_depth_response: dict[str, dict[str, float]] = field(default_factory=dict)
    """Per probed path: its round trip at twice and half its concurrency over at it
    (:func:`engine.swap_paths.depth_response`)."""
    knobs: Knobs = field(default_factory=Knobs)
    """The knobs in force."""
    paths: list[str] = field(default_factory=list)
    path_kinds: dict[str, str] = field(default_factory=dict)
    """The storage paths the engine swaps to (those it opened), in order, each with its tier's
    kind: 'nvme' or 'remote'."""
    has_device: bool = False
    subgroup_bytes: int = 0
    """The largest subgroup's state."""
    device_headroom_bytes: int | None = None
    device_lane_bytes: int = 0
    device_lane_available: bool = False
    host_memory_budget_bytes: int = 0
    """The rank's host-memory budget (``engine.host_memory``)."""
    host_bytes: HostUsage = field(default_factory=HostUsage)
    """What the engine holds in host memory now, by kind."""
    host_staging_bytes: int = 0
    """Host bytes the budget leaves for staging buffers (``engine.host_memory.staging_room``)."""
    pins: dict[str, Any] = field(default_factory=dict)
    """The user's pins (``EngineConfig.pins``), with their values in force: a tuner never moves them."""

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass(frozen=True)
class DeviceFit:
    """What :meth:`engine.device_tier.DeviceTier.fit` decided (for logs, the adapter and the report)."""

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
    usable_bytes: int | None = None
    """Device memory this process may use (``engine.gpumem.usable_bytes``), measured at the fit:
    the margin is taken from it; None where it was not measured (no CUDA device, or a headroom given)."""
    margin_bytes: int = 0
    """Device memory the fit kept free beyond the peak (``engine.gpumem.margin_bytes_of``)."""

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


class EngineParts(Protocol):
    """What :func:`facts_of` reads of an engine (a :class:`engine.core.SubgroupEngine`): its
    subgroups, knobs, config and device, and its parts, each for what it says of itself."""

    subgroups: list[Subgroup]
    knobs: Knobs
    config: EngineConfig
    device: torch.device | None
    host_kernel_name: str
    swap_paths: SwapPaths
    device_tier: DeviceTier
    host_memory: HostBudget
    transfers: Transfers

    def host_usage(self) -> HostUsage: ...


def facts_of(engine: EngineParts) -> EngineFacts:
    """The plan in force of ``engine``, from its parts: the placement, then what the swap paths,
    the device tier, the host budget and the transfers each say."""
    swap, tier, host = engine.swap_paths, engine.device_tier, engine.host_memory
    tiers: dict[str, int] = {}
    for sg in engine.subgroups:
        key = swap.paths[sg.tier.path_index].path if sg.tier.path_index is not None else sg.tier.kind
        tiers[key] = tiers.get(key, 0) + payload_bytes(sg.numel)
    has_device = engine.device is not None
    return EngineFacts(
        subgroups=len(engine.subgroups),
        params=sum(sg.numel for sg in engine.subgroups),
        state_bytes_by_tier=tiers,
        subgroup_bytes=max((payload_bytes(sg.numel) for sg in engine.subgroups), default=0),
        host_kernel=engine.host_kernel_name,
        device=str(engine.device) if has_device else None,
        has_device=has_device,
        knobs=engine.knobs,
        pins=pins_in_force(engine.config.pins, engine.knobs),
        paths=[p.path for p in engine.config.paths],
        io_backend=swap.io_backend,
        path_bandwidth_bytes_per_s=dict(zip((p.path for p in swap.paths), swap.round_trip_bytes_per_s)),
        path_depth_response=dict(swap.depth_response),
        path_kinds={p.path: p.spec.kind for p in swap.paths},
        device_headroom_bytes=tier.headroom_bytes() if has_device else None,
        device_lane_bytes=tier.lane_bytes(),
        device_lane_available=has_device and tier.lane_has_room,  # the core makes a device lane where there is a device
        host_memory_budget_bytes=host.budget_bytes,
        host_bytes=engine.host_usage(),
        host_staging_bytes=host.staging_room(),
        staging_buffers=engine.transfers.pool_size,
    )


def pins_in_force(pins: Mapping[str, Any], knobs: Knobs) -> dict[str, Any]:
    """``pins`` (:class:`KnobKey` text -> value) with the values of ``knobs``: the engine may run a
    pin lower than given (a prefetch depth the host budget cannot stage, a device fraction the
    device has no room for), and a tuner pins what runs."""
    return {key: KnobKey.parse(key).value_in(knobs) for key in pins}
