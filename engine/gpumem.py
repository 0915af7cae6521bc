"""What the GPU can give the optimizer state: headroom after forward/backward, and the rates
the lane balance needs (PCIe, GPU AdamW, host memory bandwidth).

All are measured in the training process itself, at the first step: the headroom is what the
first forward/backward left (its peak as the caching allocator saw it), the PCIe rates are
those of this process's pinned copies, both directions at once, as the device lane runs them.
"""

from __future__ import annotations

import functools

import torch

MARGIN_MIN_BYTES = 2 << 30
MARGIN_SHARE = 0.06
"""Device memory kept free beyond the measured peak: the larger of 2 GiB and 6% of the memory this
process may use (:func:`usable_bytes`; allocator fragmentation, a longer batch later, the CUDA
context growing). Of that memory, not of the card: on a 141 GB card held to 80 GB by another
tenant or a per-process fraction, 6% of the card would keep 9 GB free where 5 GB is the rule."""


def usable_bytes(device: torch.device) -> int | None:
    """Device memory this process may use: the card's total less what other processes hold (and
    this one's CUDA context), and no more than torch's per-process memory fraction where one is
    set (``torch.cuda.set_per_process_memory_fraction``: the allocator refuses beyond it). None
    when ``device`` is not a CUDA device."""
    if device.type != "cuda":
        return None
    free, total = torch.cuda.mem_get_info(device)
    reserved = torch.cuda.memory_reserved(device)
    usable = total - max(0, total - free - reserved)
    try:
        fraction = torch.cuda.get_per_process_memory_fraction(device)
    except (AttributeError, AssertionError, RuntimeError):  # an older torch; a build without CUDA (tests)
        fraction = 1.0
    return min(usable, int(fraction * total)) if 0 < fraction < 1 else usable


def margin_bytes_of(usable: int) -> int:
    """The margin kept beyond the peak on ``usable`` bytes of device memory (:data:`MARGIN_SHARE`)."""
    return max(MARGIN_MIN_BYTES, int(MARGIN_SHARE * usable))


def gpu_memory_left(device: torch.device, margin_bytes: int | None = None) -> int | None:
    """Bytes left on ``device`` beyond this process's peak so far and the margin: ``usable -
    peak reserved - margin`` (:func:`usable_bytes`), negative where the peak came into the margin
    (an evaluation or generation pass larger than training's). None when not a CUDA device."""
    usable = usable_bytes(device)
    if usable is None:
        return None
    peak = max(torch.cuda.max_memory_reserved(device), torch.cuda.memory_reserved(device))
    return usable - peak - (margin_bytes if margin_bytes is not None else margin_bytes_of(usable))


def gpu_headroom_bytes(device: torch.device, margin_bytes: int | None = None) -> int | None:
    """Bytes that state kept on ``device`` may take, so that forward/backward still reaches
    its peak so far: :func:`gpu_memory_left`, not below 0. None when ``device`` is not a CUDA
    device."""
    left = gpu_memory_left(device, margin_bytes)
    return None if left is None else max(0, left)


def reset_peak(device: torch.device | None) -> None:
    """Count ``device``'s peak memory afresh from now (``torch.cuda.reset_peak_memory_stats``), so
    that :func:`gpu_headroom_bytes` measures what runs after this point: after the engine gave its
    device memory back (``offload_states``), an RLHF loop's generation phase and the tier itself
    are not what the next forward/backward needs. The allocator's cached blocks go back first:
    the peak restarts from what is allocated, not from a generation phase's cache. Nothing
    without CUDA."""
    if device is not None and device.type == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)


@functools.lru_cache(maxsize=None)
def measure_pcie(device: torch.device, nbytes: int = 256 << 20, reps: int = 3) -> tuple[float, float] | None:
    """(host-to-device, device-to-host) bytes/s of pinned copies running both at once, the best
    of ``reps``; None without CUDA. About 0.1 s."""
    if device.type != "cuda":
        return None
    from engine.buffers import aligned_empty

    host_in, host_out = aligned_empty(nbytes, pin=True), aligned_empty(nbytes, pin=True)
    dev_in = torch.empty(nbytes, dtype=torch.uint8, device=device)
    dev_out = torch.empty(nbytes, dtype=torch.uint8, device=device)
    up, down = torch.cuda.Stream(device), torch.cuda.Stream(device)  # type: ignore[no-untyped-call]  # torch: untyped
    best = (0.0, 0.0)
    for _ in range(reps + 1):  # the first round warms up
        marks = [torch.cuda.Event(enable_timing=True) for _ in range(4)]  # type: ignore[no-untyped-call]  # torch: untyped
        torch.cuda.synchronize(device)
        with torch.cuda.stream(up):
            marks[0].record(up)
            dev_in.copy_(host_in, non_blocking=True)
            marks[1].record(up)
        with torch.cuda.stream(down):
            marks[2].record(down)
            host_out.copy_(dev_out, non_blocking=True)
            marks[3].record(down)
        torch.cuda.synchronize(device)
        rate = (nbytes / (marks[0].elapsed_time(marks[1]) / 1e3), nbytes / (marks[2].elapsed_time(marks[3]) / 1e3))
        best = (max(best[0], rate[0]), max(best[1], rate[1]))
    return best


@functools.lru_cache(maxsize=None)
def measure_gpu_adamw(device: torch.device, numel: int = 1 << 24, reps: int = 3) -> float | None:
    """Params/s of fused AdamW on ``device`` over fp32 state (the best of ``reps``); None without CUDA.

    The operands are constants, not random numbers: this runs in the training process at its
    first step, and a draw from the device's generator would shift every later dropout mask
    against a stock run with the same seed (the kernel's speed does not depend on the values)."""
    if device.type != "cuda":
        return None
    t = [torch.full((numel,), v, dtype=torch.float32, device=device) for v in (0.5, 1e-3, 1e-4, 1e-6)]
    step = torch.ones((), device=device)
    best = 0.0
    for _ in range(reps + 1):  # the first round warms up
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)  # type: ignore[no-untyped-call]  # torch
        start.record()
        torch._fused_adamw_(
            [t[0]],
            [t[1]],
            [t[2]],
            [t[3]],
            [],
            [step],
            lr=1e-6,
            beta1=0.9,
            beta2=0.999,
            weight_decay=0.0,
            eps=1e-8,
            amsgrad=False,
            maximize=False,
        )
        end.record()
        end.synchronize()
        best = max(best, numel / (start.elapsed_time(end) / 1e3))
    return best


@functools.lru_cache(maxsize=None)
def measure_memory_bandwidth(nbytes: int = 256 << 20, reps: int = 3) -> float:
    """Host memory bytes/s of a large copy (bytes read plus bytes written), this process's
    threads, the best of ``reps``."""
    import time

    src = torch.ones(nbytes, dtype=torch.uint8)
    dst = torch.empty_like(src)
    best = 0.0
    for _ in range(reps + 1):
        t0 = time.perf_counter()
        dst.copy_(src)
        best = max(best, 2 * nbytes / (time.perf_counter() - t0))
    return best


def measure_lane_rates(device: torch.device) -> tuple[float, float, float, float] | None:
    """(H2D, D2H bytes/s both at once, GPU AdamW params/s, host memory bytes/s) on ``device``;
    None without CUDA. About 0.3 s, once per process."""
    pcie, gpu = measure_pcie(device), measure_gpu_adamw(device)
    if pcie is None or gpu is None:
        return None
    return pcie[0], pcie[1], gpu, measure_memory_bandwidth()
