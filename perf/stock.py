"""Stock DeepSpeed ZeRO-3 on the same machine, for comparison: :func:`stock_deepspeed` models
ZeRO-3 CPU offload (ZeRO-Offload), ZeRO-Infinity with one NVMe path, and Twin-Flow, from the
same profile and workload as :func:`perf.model.predict`; a configuration that does not fit
comes back marked ``feasible=False`` rather than raising. ``docs/perfmodel.md`` (Stock
DeepSpeed) derives each formula.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Literal

from engine.config import Knobs
from engine.errors import ConfigError
from engine.layout import payload_bytes
from perf.hardware import Device, check_profile, device_time, gb, gpu_headroom, host_budget, host_lane_seconds_per_param
from perf.model import Plan, Prediction, Workload
from perf.profile import PathProfile, Profile

StockKind = Literal["zero3-cpu", "zero-infinity-nvme", "twinflow"]
STOCK_KINDS: tuple[str, ...] = ("zero3-cpu", "zero-infinity-nvme", "twinflow")
BACKWARD_SHARE = 2 / 3
"""Share of forward+backward spent in backward, where ZeRO-Infinity flushes gradients."""
DS_QUEUE_DEPTH = 8
DS_BLOCK_BYTES = 1 << 20
"""Stock ZeRO-Infinity's aio defaults: 1 MiB blocks, queue depth 8."""
DS_STATE_BYTES = 12.0
"""DeepSpeed's fp32 optimizer state per parameter: master, exp_avg, exp_avg_sq."""
DS_GRAD_BYTES = 4.0
"""DeepSpeed's fp32 gradient per parameter, offloaded with the state."""


def stock_deepspeed(profile: Profile, workload: Workload, kind: str, ratio: float | None = None) -> Prediction:
    """What stock DeepSpeed ZeRO-3 would take, for ``kind``:

    - ``zero3-cpu`` (ZeRO-Offload): all state in host memory, DeepSpeedCPUAdam over every
      parameter, 16-bit weights copied back in the loop: ``update = P * (1 / (R_cpu / ranks) + e / B)``.
    - ``zero-infinity-nvme``: one ``nvme_path`` (the profile's fastest path), subgroups in order
      0..N-1 with no cache, pipelined read and write (aio queue depth 8, 1 MiB blocks): per step
      16 B/param read (state and fp32 gradients) and 12 written, plus 4 written in backward,
      which overlaps the backward pass (``BACKWARD_SHARE`` of ``fwd_bwd_s``).
    - ``twinflow``: ``ratio`` of the state on the CPU (DeepSpeed's ``offload_optimizer.ratio``),
      the rest resident and updated on the GPU at the same time. Default ratio: the smallest
      that fits the GPU headroom, in steps of 0.05.

    A configuration that does not fit (host memory, GPU headroom, no path, no GPU) comes back
    with ``feasible=False`` and the reason in ``notes``.
    """
    check_profile(profile)
    if kind not in STOCK_KINDS:
        raise ConfigError(f"unknown stock DeepSpeed configuration {kind!r}: use one of {', '.join(STOCK_KINDS)}")
    s = _Stock.of(profile, workload)
    if kind == "zero3-cpu":
        return _zero3_cpu(s)
    if kind == "twinflow":
        return _twinflow(s, ratio)
    return _zero_infinity_nvme(s)


@dataclass
class _Stock:
    """What every stock configuration shares: sizes, DeepSpeed's CPU seconds per parameter, the
    host budget, forward+backward, and the notes and reasons it does not fit so far."""

    profile: Profile
    wl: Workload
    P: int
    n: int
    N: int
    per_param: float
    budget: int
    fwd_bwd: float
    notes: list[str] = field(default_factory=list)
    infeasible: list[str] = field(default_factory=list)

    @classmethod
    def of(cls, profile: Profile, wl: Workload) -> "_Stock":
        ranks, P = wl.ranks, wl.params_per_rank
        n = min(wl.subgroup_numel, P)
        gpu = profile.gpu
        cpu_rate = profile.host_kernel_params_per_s() / ranks
        mem_bw = profile.host.memory_bandwidth.value
        weight_s = wl.weight_bytes / (gpu.h2d_bytes_per_s.value if gpu else mem_bw / ranks)
        per_param = 1.0 / cpu_rate + weight_s + (4 * ranks / mem_bw if wl.grad_bytes != 4 else 0.0)
        # DeepSpeed's CPU path does at least what the engine's host lane does (and more: a separate
        # unscale pass, pageable weight copies), so it is never modelled faster than it.
        per_param = max(per_param, host_lane_seconds_per_param(profile, wl))
        s = cls(
            profile=profile,
            wl=wl,
            P=P,
            n=n,
            N=-(-P // n),
            per_param=per_param,
            budget=host_budget(profile, wl),
            fwd_bwd=wl.fwd_bwd_s if wl.fwd_bwd_s is not None else 0.0,
        )
        if wl.fwd_bwd_s is None:
            s.notes.append("no forward/backward time given (--fwd-bwd-s): the iteration counts the update phase only")
        return s

    def result(
        self,
        name: str,
        plan: Plan,
        update: float,
        breakdown: dict,
        bpp: float,
        bottleneck: str,
        extra_iter: float = 0.0,
        memory: dict | None = None,
    ) -> Prediction:
        breakdown = {**breakdown, "fwd_bwd": self.fwd_bwd}
        return Prediction(
            plan=plan.replace(name=name),
            update_s=update,
            iteration_s=self.fwd_bwd + extra_iter + update,
            breakdown=breakdown,
            bytes_per_param=bpp,
            bottleneck=bottleneck,
            notes=tuple(self.infeasible + self.notes),
            feasible=not self.infeasible,
            memory=memory or {},
        )


def _zero3_cpu(s: _Stock) -> Prediction:
    need = s.wl.ranks * s.P * int(DS_STATE_BYTES)
    if need > s.budget:
        s.infeasible.append(f"needs {gb(need)} of host memory per node for optimizer state, over the budget of {gb(s.budget)}")
    t = s.P * s.per_param
    return s.result(
        "stock ZeRO-3 CPU offload",
        Plan(host_cache_bytes=None, knobs=Knobs(prefetch_depth=0)),
        t,
        {"cpu_update": t},
        0.0,
        "cpu",
        memory={"host_per_node": need},
    )


def _twinflow(s: _Stock, ratio: float | None) -> Prediction:
    profile, P, ranks, gpu = s.profile, s.P, s.wl.ranks, s.profile.gpu
    if gpu is None:
        s.infeasible.append(f"profile {profile.name!r} has no GPU")
        return s.result("stock Twin-Flow", Plan(), math.inf, {}, 0.0, "none")
    on_gpu_bytes = int(DS_STATE_BYTES + DS_GRAD_BYTES)  # its fp32 gradient is on the GPU too
    headroom = gpu_headroom(profile, s.wl)
    if ratio is None:
        gpu_share = math.floor(min(1.0, headroom / (P * on_gpu_bytes)) * 20) / 20
        ratio = 1.0 - gpu_share
    if not (isinstance(ratio, (int, float)) and 0.0 <= ratio <= 1.0):
        raise ConfigError(f"Twin-Flow ratio must be in [0, 1] (the share of state on the CPU), got {ratio!r}")
    on_gpu = round((1 - ratio) * P)
    gpu_need = on_gpu * on_gpu_bytes
    host_need = ranks * (P - on_gpu) * int(DS_STATE_BYTES)
    if gpu_need > headroom:
        s.infeasible.append(f"ratio {ratio:g} keeps {gb(gpu_need)} of state on each GPU, over the headroom of {gb(headroom)}")
    if host_need > s.budget:
        s.infeasible.append(f"needs {gb(host_need)} of host memory per node, over the budget of {gb(s.budget)}")
    s.notes.append(f"ratio {ratio:g}: the GPU part stays resident through forward and backward too")
    t_cpu = (P - on_gpu) * s.per_param
    t_gpu = on_gpu / gpu.adamw_params_per_s.value * -(-ranks // max(1, profile.machine.gpu_count))
    t = max(t_cpu, t_gpu)
    # The engine runs it as a device tier of the GPU part, the rest in host memory.
    plan = Plan(
        host_cache_bytes=None, device_cache_bytes=payload_bytes(on_gpu), knobs=Knobs(device_fraction=0.0, prefetch_depth=0)
    )
    return s.result(
        f"stock Twin-Flow (ratio {ratio:g})",
        plan,
        t,
        {"cpu_update": t_cpu, "gpu_update": t_gpu},
        0.0,
        "cpu" if t_cpu >= t_gpu else "gpu",
        memory={"host_per_node": host_need, "gpu_per_rank": gpu_need},
    )


def _zero_infinity_nvme(s: _Stock) -> Prediction:
    profile, P, n, N, ranks = s.profile, s.P, s.n, s.N, s.wl.ranks
    if not profile.paths:
        s.infeasible.append(f"profile {profile.name!r} has no storage path")
        return s.result("stock ZeRO-Infinity NVMe", Plan(), math.inf, {}, 0.0, "none")
    c_dev = DS_QUEUE_DEPTH * ranks
    read_b, write_b = DS_STATE_BYTES + DS_GRAD_BYTES, DS_STATE_BYTES  # per param and step

    def io(dev: Device, R: float, W: float) -> tuple[float, float, float, float]:
        return device_time(dev, R, W, c_dev, c_dev, DS_BLOCK_BYTES)

    def unit(p: PathProfile) -> float:
        return io(Device.of(p), read_b, write_b)[0]

    best = min(profile.paths, key=unit)
    dev = Device.of(best, best.device or best.path)
    R, W = ranks * P * read_b, ranks * P * write_b
    T_io, t_r, t_w, t_m = io(dev, R, W)
    r1 = io(dev, ranks * n * read_b, 0.0)[0]
    w1 = io(dev, 0.0, ranks * n * write_b)[0]
    u = n * s.per_param
    T_cpu = P * s.per_param  # DeepSpeed's swap files carry no checksums
    # Read one ahead, write one behind: the first read and the last write are not overlapped.
    chains = {"storage": r1 + T_io * (N - 1) / N + u + w1, "cpu": r1 + T_cpu + w1}
    update = max(chains.values())
    grad_flush = io(dev, 0.0, ranks * P * DS_GRAD_BYTES)[0]
    extra = max(0.0, grad_flush - BACKWARD_SHARE * s.fwd_bwd)
    files = N * int(read_b) * n * ranks
    if files > best.capacity_bytes > 0:
        s.infeasible.append(f"needs {gb(files)} on {best.path}, over its capacity of {gb(best.capacity_bytes)}")
    which = max(chains, key=chains.__getitem__)
    s.notes.append(f"one nvme_path ({best.path}), order 0..N-1 with no cache, aio queue depth {DS_QUEUE_DEPTH}")
    plan = Plan(
        host_cache_bytes=0,
        knobs=Knobs(prefetch_depth=1, io_concurrency={best.path: DS_QUEUE_DEPTH}, stripe_weights={best.path: 1.0}),
    )
    return s.result(
        "stock ZeRO-Infinity NVMe",
        plan,
        update,
        {
            "storage": T_io,
            "read": t_r,
            "write": t_w,
            "mixed": t_m,
            "cpu_update": T_cpu,
            "gradient_flush": grad_flush,
            "gradient_flush_exposed": extra,
            f"storage:{dev.name}": T_io,
        },
        (read_b + write_b + DS_GRAD_BYTES) * ranks * P / (ranks * P),
        f"storage ({dev.name})" if which != "cpu" else "cpu",
        extra_iter=extra,
        memory={"storage_per_node": int(R)},
    )
