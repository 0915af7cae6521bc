"""NVIDIA GPUs through NVML (pynvml): one way to open it, for the profiler and the tuner's sensors."""

from __future__ import annotations


def open_nvml():
    """``(pynvml, device handles)`` after ``nvmlInit``, or None without the package, a driver or a
    GPU. The caller owns the session and ends it with ``pynvml.nvmlShutdown()``."""
    try:
        import pynvml

        pynvml.nvmlInit()
    except Exception:  # no package, no driver: a CPU-only node
        return None
    try:
        handles = [pynvml.nvmlDeviceGetHandleByIndex(i) for i in range(pynvml.nvmlDeviceGetCount())]
    except Exception:
        handles = []
    if not handles:
        pynvml.nvmlShutdown()
        return None
    return pynvml, handles
