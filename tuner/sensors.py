"""What the node is doing besides our engines: disk traffic per device, CPU use, and the GPUs.

Disk traffic comes from the kernel's per-disk counters (psutil, ``/proc/diskstats``) of the
device behind each storage path (:func:`engine.storage.blockdev.device_of`), so two paths on one disk
share one figure. What the engines report as theirs is subtracted: the rest is other
processes' traffic on that device, the contention the policy reacts to. File systems without
a block device (tmpfs, NFS, Lustre) have no counters; their paths report ``measured: False``
and no contention.

GPUs (pynvml, when an NVIDIA driver is present): PCIe TX/RX throughput, memory and
utilisation, summed (utilisation averaged) over the node's GPUs, with a per-GPU list.
"""

from __future__ import annotations

import contextlib
import time
from types import ModuleType
from typing import Any, Callable, Mapping, Sequence, cast

import psutil

from engine.storage.blockdev import device_of
from perf.nvml import open_nvml


class Sensors:
    """Samples the node; each :meth:`sample` covers the time since the previous one."""

    def __init__(self, paths: Sequence[str], *, gpu: bool = True) -> None:
        self.paths = list(dict.fromkeys(paths))
        self.devices = {p: device_of(p) for p in self.paths}
        self._disks = self._disk_counters()
        self._t = time.monotonic()
        psutil.cpu_percent(None)  # the first call only sets the reference point
        self._gpu = _NvmlGpus.open() if gpu else None

    def sample(self, ours_bytes_per_s: Mapping[str, float]) -> dict[str, Any]:
        """Rates since the last sample. ``ours_bytes_per_s``: per path, the bytes/s (read plus
        written) that our engines moved there over the same interval."""
        now, disks = time.monotonic(), self._disk_counters()
        dt = max(now - self._t, 1e-6)
        per_device: dict[str, tuple[float, float] | None] = {}
        for info in self.devices.values():
            a, b = self._disks.get(info.name), disks.get(info.name)
            per_device[info.name] = (
                None
                if a is None or b is None
                else (max(0, b.read_bytes - a.read_bytes) / dt, max(0, b.write_bytes - a.write_bytes) / dt)
            )
        ours_on: dict[str, float] = {}
        for p, info in self.devices.items():
            ours_on[info.name] = ours_on.get(info.name, 0.0) + float(ours_bytes_per_s.get(p, 0.0))
        paths = {}
        for p, info in self.devices.items():
            rw = per_device[info.name]
            total = None if rw is None else rw[0] + rw[1]
            paths[p] = {
                "device": info.name,
                "measured": total is not None,
                "read_bytes_per_s": None if rw is None else rw[0],
                "write_bytes_per_s": None if rw is None else rw[1],
                "total_bytes_per_s": total,
                "other_bytes_per_s": 0.0 if total is None else max(0.0, total - ours_on[info.name]),
            }
        self._disks, self._t = disks, now
        return {
            "interval_s": dt,
            "paths": paths,
            "cpu_percent": psutil.cpu_percent(None),
            "memory_available_bytes": psutil.virtual_memory().available,
            "gpu": self._gpu.sample() if self._gpu else None,
        }

    def close(self) -> None:
        if self._gpu:
            self._gpu.close()
            self._gpu = None

    def __enter__(self) -> "Sensors":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    @staticmethod
    def _disk_counters() -> dict[str, Any]:
        try:
            return psutil.disk_io_counters(perdisk=True) or {}
        except (OSError, RuntimeError):  # no /proc/diskstats (containers): no disk figures
            return {}


SECTOR_BYTES = 512
"""/proc/diskstats counts 512-byte sectors whatever the device's own sector size."""


def disk_bytes(names: Sequence[str]) -> dict[str, tuple[int, int]]:
    """Cumulative (bytes read, bytes written) of the whole-disk devices ``names`` (as in
    /proc/diskstats: ``vda``, ``loop3``), the kernel's counters that psutil reports, read
    straight from /proc/diskstats for the named devices only (about 40 us, against psutil's
    300 us for every disk): cheap enough to read at every phase boundary of an iteration.
    Devices not listed there are left out; without /proc/diskstats, psutil's counters."""
    wanted = set(names)
    out: dict[str, tuple[int, int]] = {}
    if not wanted:
        return out
    try:
        with open("/proc/diskstats") as f:
            text = f.read()
    except OSError:
        counters = Sensors._disk_counters()
        return {n: (c.read_bytes, c.write_bytes) for n, c in counters.items() if n in wanted}
    for line in text.splitlines():
        fields = line.split()
        if len(fields) > 9 and fields[2] in wanted:
            out[fields[2]] = (int(fields[5]) * SECTOR_BYTES, int(fields[9]) * SECTOR_BYTES)
    return out


def process_io_bytes() -> tuple[int, int] | None:
    """Cumulative (bytes read, bytes written) this process (all its threads) caused to go to
    storage: /proc/self/io's read_bytes and write_bytes, which count O_DIRECT and AIO transfers
    at submission, and buffered writes when they dirty the page cache (about 10 us). With
    :func:`disk_bytes` of the same device, what is left is other processes' traffic. None
    where the kernel does not keep these counters."""
    try:
        with open("/proc/self/io") as f:
            fields = dict(line.split(": ", 1) for line in f.read().splitlines() if ": " in line)
        return int(fields["read_bytes"]), int(fields["write_bytes"])
    except (OSError, KeyError, ValueError):
        return None


class _NvmlGpus:
    """Every NVIDIA GPU of the node through NVML; None when there is no driver."""

    def __init__(self, nvml: ModuleType, handles: list[object]) -> None:
        self.nvml, self.handles = nvml, handles

    @classmethod
    def open(cls) -> "_NvmlGpus | None":
        # perf.nvml.open_nvml is not annotated (perf/ is checked at mypy's defaults): its type, said here
        opened = cast("Callable[[], tuple[ModuleType, list[object]] | None]", open_nvml)()
        return None if opened is None else cls(*opened)

    def sample(self) -> dict[str, Any] | None:
        n = self.nvml
        try:
            devices = []
            for h in self.handles:
                mem = n.nvmlDeviceGetMemoryInfo(h)
                devices.append(
                    {
                        # NVML reports PCIe throughput in KB/s, sampled over 20 ms.
                        "pcie_tx_bytes_per_s": n.nvmlDeviceGetPcieThroughput(h, n.NVML_PCIE_UTIL_TX_BYTES) * 1024.0,
                        "pcie_rx_bytes_per_s": n.nvmlDeviceGetPcieThroughput(h, n.NVML_PCIE_UTIL_RX_BYTES) * 1024.0,
                        "memory_used_bytes": int(mem.used),
                        "memory_total_bytes": int(mem.total),
                        "utilization_percent": float(n.nvmlDeviceGetUtilizationRates(h).gpu),
                    }
                )
        except Exception:  # a GPU fell off the bus or the driver went away: no figures this time
            return None
        return {
            "pcie_tx_bytes_per_s": sum(d["pcie_tx_bytes_per_s"] for d in devices),
            "pcie_rx_bytes_per_s": sum(d["pcie_rx_bytes_per_s"] for d in devices),
            "memory_used_bytes": sum(d["memory_used_bytes"] for d in devices),
            "memory_total_bytes": sum(d["memory_total_bytes"] for d in devices),
            "utilization_percent": sum(d["utilization_percent"] for d in devices) / len(devices),
            "devices": devices,
        }

    def close(self) -> None:
        with contextlib.suppress(Exception):
            self.nvml.nvmlShutdown()
