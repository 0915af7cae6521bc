"""How long the update's lanes take for one split of the work: the one model of it.

The engine balances its lanes with it at the first step (:meth:`engine.device_tier.DeviceTier.fit`,
from rates measured in the training process), and the performance model (``perf.model``)
predicts the GPU and PCIe side of a plan with it (from a profile's rates). Same formula, so a
plan's device fraction and the engine's agree when their rates do. Pure, no torch.

Per rank and step, with the lanes running at once: the host lane's loop on this rank's share of
the cores; H2D, D2H and host memory (every DMA byte also crosses host memory, beside the host
lane's own traffic) as one PCIe chain; the GPU's updates of the device lane and the device tier;
plus the device lane's fill and drain when it has work. The H2D and D2H rates are duplex figures
(both directions at once), each rank's share of its link. ``docs/perfmodel.md`` ("Resources")
gives each formula.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Sequence

from engine.layout import STATE_BYTES_PER_ELEMENT
from engine.placement import DEVICE_LANE_CHUNK_NUMEL, device_lane_mask

HOST_LANE_STATE_BYTES = 2 * STATE_BYTES_PER_ELEMENT
"""Host memory bytes per host-lane element for its state: read once and written once."""


@dataclass(frozen=True)
class LaneRates:
    """This rank's rates (a node's shared resources already divided among its ranks)."""

    host_lane_params_per_s: float
    """The host lane's loop (not the bare kernel), on this rank's cores."""
    h2d_bytes_per_s: float
    """Pinned host-to-device copies while device-to-host ones run too."""
    d2h_bytes_per_s: float
    gpu_adamw_params_per_s: float
    """Fused AdamW on the GPU, fp32 state."""
    memory_bytes_per_s: float | None = None
    """Host memory bandwidth this rank may use; None: not a limit."""


@dataclass(frozen=True)
class LaneLoad:
    """One rank's update work, by lane."""

    host_params: int
    """Updated on the host lane."""
    staged_params: int = 0
    """Updated on the device lane (state copied in and out)."""
    upload_grad_params: int = 0
    """Of the device lane's, those whose gradient is in host memory (uploaded with the state)."""
    resident_params: int = 0
    """Updated in the device tier (state on the GPU)."""
    grad_bytes: int = 2
    weight_bytes: int = 2
    weights_on_device: bool = True
    """The model's weights live on the GPU: the host lane's new weights are uploaded."""
    chunk_numel: int = DEVICE_LANE_CHUNK_NUMEL
    """The device lane's chunk (its pipeline's fill and drain)."""


def memory_share(own_bytes_per_s: float, node_bytes_per_s: float | None, ranks: int) -> float:
    """Host memory bandwidth one of a node's ``ranks`` may count on: the lower of what its own
    threads move alone (``own_bytes_per_s``) and its share of what the whole node moves
    (``node_bytes_per_s``, every core copying at once). Without the node's figure, the own
    figure shared as if it were the node's. (A rank bound to 8 of 64 cores moves a fraction of
    the node's bandwidth alone; 8 ranks each measuring alone and dividing by 8 would count it
    twice.)"""
    ranks = max(1, ranks)
    if not node_bytes_per_s:
        return own_bytes_per_s / ranks
    return min(own_bytes_per_s, node_bytes_per_s / ranks)


def lane_times(load: LaneLoad, rates: LaneRates) -> dict[str, float]:
    """Seconds of each resource for ``load`` (module docstring); the step takes the largest."""
    s = STATE_BYTES_PER_ELEMENT
    h2d = s * load.staged_params + load.grad_bytes * load.upload_grad_params
    if load.weights_on_device:
        h2d += load.weight_bytes * load.host_params
    d2h = s * load.staged_params
    # The device lane's pipeline: its first chunk in before any update, its last one out after.
    c = min(load.chunk_numel, load.staged_params)
    fill_in, fill_out = s * c / rates.h2d_bytes_per_s, s * c / rates.d2h_bytes_per_s
    host_mem = load.host_params * (HOST_LANE_STATE_BYTES + load.grad_bytes + load.weight_bytes)
    return {
        "host": load.host_params / rates.host_lane_params_per_s if load.host_params else 0.0,
        "h2d": h2d / rates.h2d_bytes_per_s + fill_out,
        "d2h": d2h / rates.d2h_bytes_per_s + fill_in,
        "gpu": (load.staged_params + load.resident_params) / rates.gpu_adamw_params_per_s + fill_in + fill_out,
        "memory": (host_mem + h2d + d2h) / rates.memory_bytes_per_s if rates.memory_bytes_per_s else 0.0,
    }


def lanes_seconds(load: LaneLoad, rates: LaneRates) -> float:
    return max(lane_times(load, rates).values())


def grads_on_device(lane_numels: Sequence[int], budget_bytes: int, grad_bytes: int) -> list[bool]:
    """Which device-lane subgroups keep their gradient on the GPU: in order, as many as
    ``budget_bytes`` holds (the rest are reduced into host memory and uploaded with the state)."""
    out, left = [], budget_bytes
    for n in lane_numels:
        fits = n * grad_bytes <= left
        left -= n * grad_bytes if fits else 0
        out.append(fits)
    return out


def lane_assignment(
    numels: Sequence[int], in_device_tier: Sequence[bool], fraction: float, *, grad_budget_bytes: int, grad_bytes: int
) -> tuple[list[bool], set[int]]:
    """Which subgroups take the device lane (``fraction`` of those outside the device tier,
    evenly spread), and which of those keep their gradients on the device (in order, as far as
    ``grad_budget_bytes`` holds; none when ``grad_bytes`` is 0, gradients not kept there)."""
    rest = [i for i, t in enumerate(in_device_tier) if not t]
    mask = [False] * len(numels)
    for i, on in zip(rest, device_lane_mask(len(rest), fraction)):
        mask[i] = on
    lane = [i for i in rest if mask[i]]
    kept = grads_on_device([numels[i] for i in lane], grad_budget_bytes, grad_bytes)
    return mask, {i for i, k in zip(lane, kept) if k and grad_bytes}


def load_for(
    numels: Sequence[int],
    fraction: float,
    *,
    resident_params: int,
    grad_budget_bytes: int,
    grad_bytes: int,
    weight_bytes: int,
    weights_on_device: bool = True,
    chunk_numel: int = DEVICE_LANE_CHUNK_NUMEL,
) -> LaneLoad:
    """The load of the subgroups ``numels`` (those outside the device tier, in order) when a
    ``fraction`` of them, evenly spread (:func:`engine.placement.device_lane_mask`), take the
    device lane, their gradients on the GPU within ``grad_budget_bytes``."""
    mask = device_lane_mask(len(numels), fraction)
    lane = [n for n, m in zip(numels, mask) if m]
    kept = grads_on_device(lane, grad_budget_bytes, grad_bytes)
    staged = sum(lane)
    return LaneLoad(
        host_params=sum(numels) - staged,
        staged_params=staged,
        upload_grad_params=sum(n for n, k in zip(lane, kept) if not k),
        resident_params=resident_params,
        grad_bytes=grad_bytes,
        weight_bytes=weight_bytes,
        weights_on_device=weights_on_device,
        chunk_numel=chunk_numel,
    )


def balanced_fraction(numels: Sequence[int], rates: LaneRates, **load_kw: Any) -> tuple[float, float]:
    """(device fraction, seconds) with the shortest update for the subgroups ``numels``, the
    fraction at one-subgroup granularity, searched exhaustively; the smaller fraction on a tie."""
    best: tuple[float, float] | None = None
    n = len(numels)
    for k in range(n + 1):
        f = k / n if n else 0.0
        t = lanes_seconds(load_for(numels, f, **load_kw), rates)
        if best is None or t < best[1] * (1 - 1e-9):
            best = (f, t)
    return best if best is not None else (0.0, 0.0)
