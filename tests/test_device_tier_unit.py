"""DeviceTier alone (``engine.device_tier``), on the CPU: what of it runs without CUDA. The
tier's "device" is the CPU (``device='cpu'``, as the engine's tests run it) and its headroom is
given, so the fit's arithmetic is the test's; the engine's other parts it is handed (the staging
pool's buffers, giving a staging buffer back, the host budget's word) are the test's stand-ins.
What needs a device's memory figures (the margin, a pass into it) is
``tests/test_device_tier_margin.py``'s."""

from __future__ import annotations

import logging
import os

import pytest
import torch

from engine.binding import FlatSubgroup
from engine.buffers import StateBuffer
from engine.config import EngineConfig, Knobs, StoragePath
from engine.device_lane import DeviceLane
from engine.device_tier import DeviceTier
from engine.layout import host_buffer_bytes, payload_bytes
from engine.placement import DEVICE, HOST, Tier, device_lane_working_bytes, swap_tier
from engine.streams import HostStreams
from engine.subgroup import InHost, OnDevice, Subgroup, Swapped
from engine.swap_paths import SwapPaths

CPU = torch.device("cpu")
N = 1000  # elements per subgroup
STATE = payload_bytes(N)  # a subgroup's state on the device: 12 bytes an element, padded
LANE = device_lane_working_bytes(N)  # the device lane's slots and scratches over such subgroups


class PinningStreams(HostStreams):
    """The host's streams, saying host memory must be page-locked, as CUDA's do."""

    pins_host_memory = True


class Pool:
    """Stands for the staging pool: its buffers, the pins they got, the buffers given back."""

    def __init__(self, n: int = 2) -> None:
        self.pins: list[int] = []
        self.released: list[int] = []
        self.calls = 0
        self._buffers = [self._buffer(i) for i in range(n)]

    def _buffer(self, i: int):
        pool = self

        class Buffer:
            def pin(self) -> bool:
                pool.pins.append(i)
                return True

        return Buffer()

    def buffers(self) -> list:
        self.calls += 1
        return list(self._buffers)

    def release(self, sg: Subgroup) -> None:
        self.released.append(sg.index)
        sg.swap.release()


@pytest.fixture
def paths(swap_dir):
    """The storage path of the swapped subgroups' files (bandwidth declared: no probe)."""
    path = StoragePath(path=swap_dir, read_bytes_per_s=1e9, write_bytes_per_s=1e9)
    paths = SwapPaths(EngineConfig(paths=(path,), host_cache_bytes=0, io_backend="posix"), Knobs())
    yield paths
    paths.close()


def subgroup(i: int, tier: Tier, paths: SwapPaths | None = None) -> Subgroup:
    binding = FlatSubgroup(torch.zeros(N))
    if tier == HOST:
        return Subgroup(i, binding, InHost(StateBuffer(N)), [0])
    if tier == DEVICE:
        return Subgroup(i, binding, OnDevice(torch.empty(3 * N)), [0])
    assert paths is not None, "a swapped subgroup has a swap file"
    sg = Subgroup(i, binding, Swapped(0, paths.create_file(i, N, 0)), [0])
    sg.swap.load(StateBuffer(N))
    sg.swap.read_landed()  # a clean copy in its staging buffer
    return sg


def make_tier(tiers: list[Tier], *, device_cache_bytes: int | None = None, streams=None, paths=None) -> DeviceTier:
    streams = streams or HostStreams(CPU)
    config = EngineConfig(device="cpu", device_cache_bytes=device_cache_bytes)
    subgroups = [subgroup(i, t, paths) for i, t in enumerate(tiers)]
    return DeviceTier(subgroups, config, CPU, DeviceLane(streams, N), streams, host_kernel_name="torch")


def fit(tier: DeviceTier, pool: Pool, fraction: float = 0.0, host_fits=lambda n: True, **k):
    return tier.fit(fraction, staging=pool.buffers, release_staged=pool.release, host_fits=host_fits, **k)


def tiers_of(tier: DeviceTier) -> list[str]:
    return [sg.tier.kind for sg in tier.subgroups]


def test_without_a_device_nothing_is_fitted_or_moved():
    sgs = [subgroup(0, HOST)]
    tier = DeviceTier(sgs, EngineConfig(), None, None, HostStreams(CPU), host_kernel_name="torch")
    pool = Pool()
    assert not tier.fit_pending and tier.lane_bytes() == 0 and tier.headroom_bytes() is None
    assert fit(tier, pool, 0.5, headroom_bytes=10 * STATE).device_tier_subgroups == 0
    tier.out_of_memory(torch.OutOfMemoryError("Tried to allocate 1.00 GiB"), 0.0, pool.buffers)
    tier.keep_margin(0.0, pool.buffers)
    assert tiers_of(tier) == ["host"] and pool.calls == 0


def test_the_fit_takes_the_longest_prefix_that_leaves_the_lanes_slots_free():
    tier = make_tier([HOST] * 4)
    assert tier.fit_pending  # a device: the first step fits
    cost = STATE + 2 * N  # the state and, kept beside it, a 2-byte gradient
    got = fit(tier, Pool(), 0.25, grad_bytes_per_element=2, headroom_bytes=2 * cost + LANE + 5 + 1000, reserve_bytes=1000)
    assert tiers_of(tier) == ["device", "device", "host", "host"]
    assert not tier.fit_pending
    assert got.headroom_bytes == 2 * cost + LANE + 5  # less what is reserved for later passes
    assert got.device_tier_subgroups == 2 and got.device_tier_bytes == 2 * cost
    assert got.device_lane_bytes == LANE and got.device_lane_off is None and tier.lane_has_room
    assert tier.lane_grad_budget_bytes == 5  # what is left beside the tier and the lane's slots
    assert got.device_fraction == 0.25 and tier.grad_bytes_per_element == 2
    everything = fit(tier, Pool(), headroom_bytes=4 * STATE + LANE)
    assert everything.device_tier_subgroups == 4 and tiers_of(tier) == ["device"] * 4


def test_a_fit_without_room_for_the_lanes_slots_turns_the_lane_off_and_says_so_once(caplog):
    tier = make_tier([HOST] * 3)
    caplog.set_level(logging.WARNING, logger="engine.device_tier")
    got = fit(tier, Pool(), 0.5, headroom_bytes=LANE - 1)
    assert tiers_of(tier) == ["host"] * 3 and not tier.lane_has_room
    assert got.device_fraction == 0.0 and got.device_lane_off and "device lane off" in got.device_lane_off
    assert not any(tier.on_device_lane(i) for i in range(3))
    assert tier.usable_fraction(0.5) == 0.0  # a later knob asking for the lane: refused, not said again
    assert len(caplog.messages) == 1 and "device lane off" in caplog.messages[0]


def test_a_fit_gives_a_swapped_subgroups_staging_buffer_back_and_keeps_host_copies_as_the_budget_says(paths):
    """Into the tier, a swapped subgroup's staging buffer goes back to the pool. After a first
    release, the host buffers the refit frees are kept for the next release, each as far as the
    host budget says it fits."""
    tier = make_tier([HOST, HOST, swap_tier(0)], paths=paths)
    pool, asked = Pool(), []
    swap_file = tier.subgroups[2].swap.file.filename
    fit(tier, pool, headroom_bytes=3 * STATE + LANE, host_fits=lambda n: asked.append(n) or True)
    assert tiers_of(tier) == ["device"] * 3
    assert pool.released == [2] and not os.path.exists(swap_file)  # its file goes with it
    assert asked == []  # nothing kept before a first release
    tier.release()
    assert tiers_of(tier) == ["host"] * 3 and tier.fit_pending
    fit(tier, pool, headroom_bytes=3 * STATE + LANE, host_fits=lambda n: asked.append(n) or len(asked) == 1)
    assert asked == [host_buffer_bytes(N)] * 3
    assert [isinstance(sg.home, OnDevice) and sg.home.host_copy is not None for sg in tier.subgroups] == [True, False, False]
    assert tier.host_copy_bytes() == host_buffer_bytes(N)
    tier.drop_host_copies()
    assert tier.host_copy_bytes() == 0


def test_the_lanes_pin_the_staging_pool_when_a_swapped_subgroup_is_on_the_device_lane(paths):
    tier = make_tier([HOST, swap_tier(0), swap_tier(0)], streams=PinningStreams(CPU), paths=paths)
    pool = Pool()
    tier.assign_lanes(1.0, pool.buffers)  # before the first fit: it may move them to the device
    assert pool.pins == []
    fit(tier, pool, 1.0, headroom_bytes=LANE)  # no room for the tier: every subgroup on the lane
    assert all(tier.on_device_lane(i) for i in range(3))
    assert sorted(pool.pins) == [0, 1]
    pool.pins.clear()
    tier.assign_lanes(0.0, pool.buffers)
    assert pool.pins == []  # no subgroup on the lane: nothing to pin
    plain = make_tier([swap_tier(0)] * 2, paths=paths)  # pageable copies: nothing is pinned
    fit(plain, pool, 1.0, headroom_bytes=LANE)
    assert pool.calls == 1 and pool.pins == []  # the pool was asked for its buffers once: at the fit


def test_an_out_of_memory_error_moves_the_tiers_last_subgroups_and_a_refit_keeps_them_off(caplog):
    """Without a device's memory figures (no margin), the tier gives back what the failed
    allocation asked for, in whole subgroups from its end; a --device-cache placement loses them:
    the next fit does not put them back."""
    tier = make_tier([DEVICE] * 4, device_cache_bytes=4 * STATE)
    pool = Pool()
    caplog.set_level(logging.WARNING, logger="engine.device_tier")
    tier.out_of_memory(torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 20.00 KiB."), 0.0, pool.buffers)
    assert tiers_of(tier) == ["device", "device", "host", "host"]  # 20480 bytes: two of 12288
    assert caplog.messages == [
        "offloadctl: out of GPU memory at the step (it asked for 20.5 KB more): 2 device-tier subgroups (24.6 KB) "
        "moved to host memory, 2 left on the GPU; offload_states() around such a pass keeps them (docs/engine.md)"
    ]
    caplog.clear()
    tier.out_of_memory(torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 12.00 KiB."), 0.0, pool.buffers)
    assert tiers_of(tier) == ["device", "host", "host", "host"]  # 12288 bytes: exactly one
    assert caplog.messages[0].startswith(
        "offloadctl: out of GPU memory at the step (it asked for 12.3 KB more): 1 device-tier subgroup (12.3 KB) moved"
    )
    tier.keep_margin(0.0, pool.buffers)  # no device figures: nothing to keep
    assert tiers_of(tier) == ["device", "host", "host", "host"]
    fit(tier, pool, headroom_bytes=4 * STATE + LANE)  # room for all four: the placement left is one
    assert tiers_of(tier) == ["device", "host", "host", "host"]
