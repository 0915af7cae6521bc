"""The recorder's sampler thread: the rank's process, its tier devices and its GPU, sampled at a
fixed rate into ``samples-rank<R>.jsonl`` (the format is :mod:`report.recorder`'s).

Series that cannot be measured are left out of the header's columns, not written as zeros; past
``max_rows`` rows the interval doubles, so a long run's file grows with the logarithm of its length.
"""

from __future__ import annotations

import contextlib
import json
import os
import threading
import time

from engine.record_files import private_opener, say_records_stopped
from perf.nvml import open_nvml
from tuner.sensors import disk_bytes


class Sampler(threading.Thread):
    """Samples the rank's process, its tier devices and its GPU at a fixed rate, on its own thread."""

    FLUSH_S = 1.0

    def __init__(self, path: str, hz: float, devices: list[str], cuda_device, max_rows: int, *, fmt: str, version: int) -> None:
        """``fmt`` and ``version``: the header's, owned by the recorder that reads them back."""
        super().__init__(name="offloadctl-recorder", daemon=True)
        self.interval_s = 1.0 / hz
        self.rows = 0
        self.busy_s = 0.0
        self.paused = False
        self._next_double = max_rows
        self._max_rows = max_rows
        self._devices = devices
        self._stop_event = threading.Event()
        self._cuda = cuda_device
        self._nvml = _own_nvml(cuda_device) if cuda_device is not None else None
        self._statm = _open_statm()
        self._page = os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 4096
        columns = ["t", "rss_bytes", "cpu_percent"]
        for d in devices:
            columns += [f"disk_read_bytes:{d}", f"disk_write_bytes:{d}"]
        if cuda_device is not None:
            columns += ["gpu_allocated_bytes", "gpu_reserved_bytes"]
        if self._nvml is not None:
            columns += ["nvml_used_bytes", "pcie_tx_bytes_per_s", "pcie_rx_bytes_per_s"]
        self.columns = columns
        self._file = open(path, "w", opener=private_opener)  # 0600, whatever the run dir's mode
        self._file.write(
            json.dumps(
                {
                    "type": "header",
                    "format": fmt,
                    "version": version,
                    "columns": columns,
                    "hz": hz,
                    "max_rows": max_rows,
                    "clock": "perf_counter",
                    "t0": time.perf_counter(),
                    "gpu": cuda_device is not None,
                    "nvml": self._nvml is not None,
                }
            )
            + "\n"
        )
        self._file.flush()
        self._cpu = (time.perf_counter(), _cpu_s())

    def stop(self) -> None:
        self._stop_event.set()
        if self.is_alive():
            self.join(timeout=2.0)
        if not self._file.closed:
            try:
                self._file.close()
            except OSError as e:
                stop_writing(self._file, e)
        if self._nvml is not None:
            with contextlib.suppress(Exception):
                self._nvml[0].nvmlShutdown()

    def run(self) -> None:
        rows: list[str] = []
        last_flush = time.perf_counter()
        next_t = time.perf_counter()
        try:
            while not self._stop_event.is_set():
                if self.paused:
                    self._stop_event.wait(self.interval_s)
                    next_t = time.perf_counter()
                    continue
                t0 = time.perf_counter()
                c0 = time.thread_time()  # CPU time, not wall: waits for the GIL are not our cost
                rows.append(json.dumps(self._sample(t0), separators=(",", ":")))
                self.rows += 1
                if self.rows >= self._next_double:  # bounded growth: halve the rate
                    self.interval_s *= 2
                    self._next_double += self._max_rows
                t1 = time.perf_counter()
                if t1 - last_flush >= self.FLUSH_S:
                    if not self._flush(rows):
                        return  # the disk is full or failing: sampling stops, the run goes on
                    rows, last_flush = [], t1
                self.busy_s += time.thread_time() - c0
                next_t += self.interval_s
                if next_t < t1:  # fell behind (a long NVML call): skip, do not burst
                    next_t = t1 + self.interval_s
                self._stop_event.wait(max(0.0, next_t - time.perf_counter()))
        finally:
            if rows and not self._file.closed:
                self._flush(rows)

    def _flush(self, rows: list[str]) -> bool:
        """Write ``rows``; False (one warning, the file closed) where the disk refuses them."""
        try:
            self._file.write("\n".join(rows) + "\n")
            self._file.flush()
            return True
        except OSError as e:
            stop_writing(self._file, e)
            return False

    def _sample(self, t: float) -> list:
        cpu_t, cpu_s = t, _cpu_s()
        t_prev, s_prev = self._cpu
        self._cpu = (cpu_t, cpu_s)
        row = [round(t, 4), self._rss(), round(100.0 * (cpu_s - s_prev) / max(cpu_t - t_prev, 1e-6), 1)]
        if self._devices:
            disk = disk_bytes(self._devices)
            for d in self._devices:
                row += list(disk.get(d, (None, None)))
        if self._cuda is not None:
            import torch

            try:
                row += [torch.cuda.memory_allocated(self._cuda), torch.cuda.memory_reserved(self._cuda)]
            except Exception:
                row += [None, None]
        if self._nvml is not None:
            n, h = self._nvml
            try:
                # NVML reports PCIe throughput in KB/s, over its last 20 ms.
                row += [
                    int(n.nvmlDeviceGetMemoryInfo(h).used),
                    n.nvmlDeviceGetPcieThroughput(h, n.NVML_PCIE_UTIL_TX_BYTES) * 1024,
                    n.nvmlDeviceGetPcieThroughput(h, n.NVML_PCIE_UTIL_RX_BYTES) * 1024,
                ]
            except Exception:
                row += [None, None, None]
        return row

    def _rss(self) -> int | None:
        if self._statm is not None:
            with contextlib.suppress(OSError, IndexError, ValueError):
                return int(os.pread(self._statm, 128, 0).split()[1]) * self._page
        try:
            import psutil

            return psutil.Process().memory_info().rss
        except Exception:
            return None


def _open_statm() -> int | None:
    try:
        return os.open("/proc/self/statm", os.O_RDONLY)
    except OSError:
        return None


def _cpu_s() -> float:
    t = os.times()
    return t.user + t.system


def _own_nvml(cuda_device):
    """(pynvml, handle) of the GPU behind ``cuda_device``, or None (no NVML, or no match)."""
    opened = open_nvml()
    if opened is None:
        return None
    nvml, handles = opened
    with contextlib.suppress(Exception):
        import torch

        props = torch.cuda.get_device_properties(cuda_device)
        uuid = getattr(props, "uuid", None)
        if uuid is not None:
            with contextlib.suppress(Exception):
                return nvml, nvml.nvmlDeviceGetHandleByUUID(f"GPU-{uuid}")
        bus = getattr(props, "pci_bus_id", None)
        if bus is not None:
            bus_id = f"{getattr(props, 'pci_domain_id', 0):08X}:{bus:02X}:{getattr(props, 'pci_device_id', 0):02X}.0"
            return nvml, nvml.nvmlDeviceGetHandleByPciBusId_v2(bus_id)
    with contextlib.suppress(Exception):
        nvml.nvmlShutdown()
    return None


def stop_writing(f, e: OSError) -> None:
    """Stop writing ``f``, a run's file, after ``e``: one warning for all of the rank's record
    files (:func:`engine.record_files.say_records_stopped`); the run goes on."""
    say_records_stopped(str(getattr(f, "name", "?")), e)
    try:
        f.close()
    except OSError:
        with contextlib.suppress(OSError):
            f.close()  # a close whose flush failed leaves the file open: the second closes it
