"""Hardware profile: what one machine measured (or a datasheet declares), as plain dataclasses.

This module is the schema only. ``perf.profile_toml`` reads and writes it as strict TOML;
``perf.probe`` measures it; ``perf.model`` predicts from it. Every figure is a
:class:`Figure` that carries how and when it was obtained. Bandwidths are bytes/s, rates are
per second, sizes are bytes.

Bump :data:`SCHEMA_VERSION` on any incompatible change; readers refuse other versions.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

SCHEMA_VERSION = 1

SourceKind = Literal["measured", "datasheet", "estimate"]


@dataclass(frozen=True, kw_only=True)
class Figure:
    """One number with its provenance."""

    value: float
    how: str
    """The method (``"O_DIRECT pread, 8 MiB requests, 4 threads, 256 MiB"``) or, for a
    datasheet figure, the document it comes from."""
    when: str
    """ISO 8601 UTC time of the measurement, or of the source's publication."""


@dataclass(frozen=True, kw_only=True)
class Source:
    """Where the whole profile comes from. Example profiles say ``datasheet`` or ``estimate``;
    only ``offloadctl profile save`` writes ``measured``."""

    kind: SourceKind
    description: str
    tool: str = ""
    """``offloadctl <version>`` for measured profiles."""


@dataclass(frozen=True, kw_only=True)
class Machine:
    hostname: str
    cpu_model: str
    cores_physical: int
    cores_logical: int
    memory_bytes: int
    numa_nodes: int
    gpu_model: str = ""
    """Empty when there is no NVIDIA GPU."""
    gpu_count: int = 0


@dataclass(frozen=True, kw_only=True)
class AdamWRate:
    """The bare host AdamW kernel's throughput (:func:`engine.adamw.measure_host_kernels`: fp32
    state larger than the caches, no gradient or weight copies) with a given number of threads."""

    threads: int
    params_per_s: Figure


@dataclass(frozen=True, kw_only=True)
class Host:
    memory_bandwidth: Figure
    """Copy bandwidth of host memory (bytes/s counted once per byte copied)."""
    adamw: tuple[AdamWRate, ...]
    """The bare kernel's rate by thread count, ascending threads
    (:meth:`Profile.host_kernel_params_per_s`); the lane's is :attr:`host_lane_params_per_s`."""
    host_lane_params_per_s: Figure | None = None
    """The engine's host lane as a step runs it, all threads: 16-bit gradients upcast and
    unscaled, fused AdamW, weights cast to 16 bits and (with a GPU) uploaded. None in profiles
    that did not measure it: the model then uses the kernel rate plus copy costs."""


@dataclass(frozen=True, kw_only=True)
class SweepPoint:
    """One point of a path's O_DIRECT concurrency sweep."""

    op: Literal["read", "write", "mixed"]
    """``mixed``: reads and writes at once, each at ``concurrency``; the figure is the sum."""
    concurrency: int
    """Requests in flight (threads x queue depth)."""
    block_bytes: int
    bytes_per_s: Figure


@dataclass(frozen=True, kw_only=True)
class PathProfile:
    path: str
    kind: Literal["nvme", "remote"]
    device: str
    """The block device behind the path (``nvme0n1``, ``md0``, ``loop3``), or the file system
    for network mounts (``lustre:fs1``). Paths with the same device share one bandwidth."""
    device_id: str
    """``major:minor`` of the file system's device (``st_dev``); identity used to group paths."""
    capacity_bytes: int
    read_bytes_per_s: Figure
    """Best sequential O_DIRECT read over the sweep."""
    write_bytes_per_s: Figure
    """Best sequential O_DIRECT write over the sweep."""
    mixed_bytes_per_s: Figure
    """Reads and writes at once (the contended case): total bytes/s of both."""
    best_concurrency: int
    """Smallest concurrency within 5% of the best read and write figures."""
    sweep: tuple[SweepPoint, ...] = ()

    def bytes_per_s(self, op: Literal["read", "write", "mixed"], concurrency: int | None = None) -> float:
        """Bandwidth of ``op`` at ``concurrency`` requests in flight, from the sweep (step-wise:
        the best point at or below it). Without a sweep, or with ``concurrency`` None: the best
        figure."""
        best = {"read": self.read_bytes_per_s, "write": self.write_bytes_per_s, "mixed": self.mixed_bytes_per_s}[op].value
        points = [s for s in self.sweep if s.op == op]
        if concurrency is None or not points:
            return best
        at_or_below = [s.bytes_per_s.value for s in points if s.concurrency <= concurrency]
        if not at_or_below:
            lowest = min(points, key=lambda s: s.concurrency)
            return lowest.bytes_per_s.value * concurrency / lowest.concurrency
        return max(at_or_below)


@dataclass(frozen=True, kw_only=True)
class Gpu:
    model: str
    memory_bytes: int
    h2d_bytes_per_s: Figure
    """Pinned host to device, alone."""
    d2h_bytes_per_s: Figure
    """Device to pinned host, alone."""
    duplex_h2d_bytes_per_s: Figure
    """Host to device while device to host runs."""
    duplex_d2h_bytes_per_s: Figure
    adamw_params_per_s: Figure
    """Fused AdamW on fp32 state resident on the GPU."""


@dataclass(frozen=True, kw_only=True)
class Profile:
    schema_version: int
    name: str
    source: Source
    machine: Machine
    host: Host
    paths: tuple[PathProfile, ...] = ()
    gpu: Gpu | None = None
    created: str = ""
    """ISO 8601 UTC time the profile was written."""
    notes: str = ""

    def path(self, path: str) -> PathProfile | None:
        return next((p for p in self.paths if p.path == path), None)

    def devices(self) -> dict[str, list[PathProfile]]:
        """Paths grouped by the device behind them: bandwidth is shared within a group."""
        out: dict[str, list[PathProfile]] = {}
        for p in self.paths:
            # By whole-disk name: two partitions of one disk have distinct st_dev but one bandwidth.
            out.setdefault(p.device or p.device_id, []).append(p)
        return out

    def host_kernel_params_per_s(self, threads: int | None = None) -> float:
        """The bare host AdamW kernel's rate (``host.adamw``) at ``threads`` (default: the most
        measured), interpolating linearly; not the host lane's (``host.host_lane_params_per_s``)."""
        rates = sorted(self.host.adamw, key=lambda r: r.threads)
        if not rates:
            return 0.0
        if threads is None or threads >= rates[-1].threads:
            return rates[-1].params_per_s.value
        below = [r for r in rates if r.threads <= threads]
        if not below:
            return rates[0].params_per_s.value * threads / rates[0].threads
        lo = below[-1]
        hi = next(r for r in rates if r.threads >= threads)
        if hi.threads == lo.threads:
            return lo.params_per_s.value
        t = (threads - lo.threads) / (hi.threads - lo.threads)
        return lo.params_per_s.value + t * (hi.params_per_s.value - lo.params_per_s.value)
