"""Performance model of the update phase and the iteration, and an optimizer over plans.

Pure functions over frozen dataclasses: no I/O, no torch. Inputs are a hardware
:class:`~perf.profile.Profile` (measured figures), a :class:`Workload` (model size, ranks,
forward/backward time) and a :class:`Plan` (where state lives and the engine's knobs). The
model follows what :class:`engine.core.SubgroupEngine` does, step by step; ``docs/perfmodel.md``
derives each formula. Notation, per rank unless said otherwise:

- ``P = ceil(params / (ranks * nodes))`` parameters (ZeRO-3 splits state evenly), ``n`` the
  subgroup size, ``N = ceil(P / n)`` subgroups; ``pay(x) = roundup(12 x, 4096)`` bytes of
  state, ``fb = pay(n) + 4096`` bytes per transfer (state and header).
- Placement: ``D`` subgroups resident on the device, then ``H`` in host memory (prefixes that
  fit ``device_cache_bytes`` and ``host_cache_bytes``), ``S = N - D - H`` swapped, striped over
  the paths by weight (greedy least-finish, as :func:`engine.placement.stripe`).
- Alternating order: ``K = min(S, d + 1)`` swapped subgroups stay in staging buffers across a
  step (``d`` = prefetch depth), so ``M = S - K`` are read and ``M`` written per step.
- ``u = n * ranks / R_lane``: host-lane time of one subgroup, ``R_lane`` the profile's
  measured host-lane rate (the whole integrated path: 16-bit gradient upcast and unscaled,
  fused AdamW, weights cast and uploaded), the node's rate shared by the ranks. Profiles
  without it: ``n / (R_cpu / ranks) + n * e / B_copy`` (the kernel rate plus ``e`` bytes per
  param copied: the gradient upcast, the weights written back).

Per step, with every rank on a node in lockstep and ``j`` ranging over the storage devices
(paths on one device share one bandwidth, so they never add up):

- storage   ``T_io = max_j max(R_j / r_j(c), W_j / w_j(c), (R_j + W_j) / m_j(c))``, ``R_j``,
  ``W_j`` the bytes all ranks of the node read and write on device ``j``, ``r, w, m`` its read,
  write and mixed (both at once) bandwidth at the in-flight requests ``c`` on that device;
- CPU       ``T_adam = P_host * (1 / (R_cpu / ranks) + e / B_copy)`` on the host lane, and
  ``crc = (R + W) / (C_crc * cores / ranks)`` of checksums on the I/O threads, same cores;
- GPU       ``T_gpu = 12 n / B_h2d + 12 n / B_d2h + (G + D) n / R_gpu``: the pipeline's fill and
  drain (one subgroup in and out) and the updates, ``G`` staged device-lane subgroups, ``D``
  resident ones; copies in, updates and copies back of successive subgroups overlap (three
  streams), so the copies themselves count in the PCIe chain;
- PCIe      ``T_pcie = max(H2D / (L * B_h2d'), D2H / (L * B_d2h'), (H2D + D2H) / B_mem)`` per node,
  ``L`` links, duplex figures, host memory shared by every link; H2D carries 12 B per staged
  device-lane param (its gradient is already on the GPU) and the 16-bit weights of host-lane
  params, D2H 12 B per staged param;
- prefetch  ``T_lat = sum over misses (r1 + u) / (d + 1)`` (Little's law on ``d + 1`` reads in
  flight; ``r1`` one subgroup's read, with a concurrent write when ``d = 0``).

The step is the longest of five chains, each with its fill and drain (``w1``/``r1``: one
subgroup's write/read, ``A`` the host-lane time of the resident subgroups, which run before any
read is issued in forward steps and after the last write is issued in reverse steps):

- storage  ``= A_fwd + u + T_io + max(0, u + A_rev - w1)``
- CPU      ``= T_adam + max(fill + drain, crc)``, ``fill = max(0, r1 - d u)`` (the first read,
  less the kept subgroups' updates), ``drain = max(0, w1 - K u - A_rev)`` (the last write-back)
- prefetch ``= A + K u + T_lat + max(0, drain - r1)`` (the last read hides the last write)
- GPU ``= u + T_gpu``;  PCIe ``= T_pcie``

``update_s`` is the mean of a forward and a reverse step; ``iteration_s = fwd_bwd_s + update_s``.
"""
from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field, replace
from functools import lru_cache
from typing import Literal, Mapping, Sequence

from engine.config import Knobs
from engine.errors import ConfigError
from engine.placement import device_lane_working_bytes, stripe
from perf.profile import PathProfile, Profile

STATE_BYTES_PER_PARAM = 12
"""fp32 master, exp_avg, exp_avg_sq."""
HEADER_BYTES = 4096
ALIGN_BYTES = 4096
CHUNK_BYTES = 8 << 20
"""The engine's I/O request size (``EngineConfig.io_chunk_bytes``)."""
MAX_CHUNKS = (HEADER_BYTES - 60) // 4
"""Chunk CRCs that fit a swap-file header; larger payloads get larger chunks (engine.storage.swapfile)."""
CRC_BYTES_PER_S_PER_CORE = 4e9
"""zlib CRC32 of every chunk read and written, on the I/O threads (engine.storage.swapfile)."""
BACKWARD_SHARE = 2 / 3
"""Share of forward+backward spent in backward, where ZeRO-Infinity flushes gradients."""
DEFAULT_HOST_SHARE = 0.5
"""Without ``Workload.host_bytes``: the share of the machine's memory given to optimizer state."""
DEFAULT_GPU_HEADROOM_SHARE = 0.5
"""Without ``Workload.gpu_headroom_bytes``: the share of GPU memory free during the update."""
DS_QUEUE_DEPTH = 8
DS_BLOCK_BYTES = 1 << 20
"""Stock ZeRO-Infinity's aio defaults: 1 MiB blocks, queue depth 8."""
EXACT_SUBGROUPS = 512
"""Up to this many swapped subgroups the model stripes them one by one as the engine does;
above, by proportion (the difference is under one subgroup per path)."""
DEPTHS = (0, 1, 2, 3, 4, 6, 8, 12, 16)
CONCURRENCIES = (1, 2, 4, 8, 16, 32, 64)
MAX_PARAMS = 10 ** 15
"""Largest model the model plans for (a thousand times today's largest): beyond it the byte
counts stop being numbers a float holds exactly."""
StockKind = Literal["zero3-cpu", "zero-infinity-nvme", "twinflow"]
STOCK_KINDS: tuple[str, ...] = ("zero3-cpu", "zero-infinity-nvme", "twinflow")


# -- inputs -------------------------------------------------------------------------------------


@dataclass(frozen=True, kw_only=True)
class Workload:
    """What is trained, on how many ranks, and the memory it may use."""

    params: int
    """Total model parameters."""
    ranks: int = 1
    """Ranks (GPUs) per node; they share the node's disks, PCIe, host memory and cores."""
    nodes: int = 1
    subgroup_numel: int = 10_000_000
    fwd_bwd_s: float | None = None
    """Forward and backward time of one iteration, measured or given. None: counted as 0."""
    host_bytes: int | None = None
    """Host memory per node for optimizer state and staging. None: half the machine's memory."""
    gpu_headroom_bytes: int | None = None
    """GPU memory free during the update phase, per GPU. None: half the GPU's memory."""
    weight_bytes: int = 2
    """Bytes per model weight the update writes back (2: fp16/bf16, 4: fp32)."""
    grad_bytes: int = 2
    """Bytes per gradient element kept in host memory (2: 16-bit, 4: fp32)."""

    def __post_init__(self) -> None:
        p = self.params
        if isinstance(p, float) and math.isfinite(p) and p.is_integer():
            object.__setattr__(self, "params", int(p))
        _int_at_least("Workload.params", self.params, 1, "give the model's parameter count, e.g. 7e9")
        if self.params > MAX_PARAMS:
            raise ConfigError(f"Workload.params is {self.params:.3g}, over {MAX_PARAMS:.0e}: no model is that large; "
                              f"give the model's parameter count, e.g. 7e9")
        _int_at_least("Workload.ranks", self.ranks, 1, "give the ranks (GPUs) per node")
        _int_at_least("Workload.nodes", self.nodes, 1, "give the number of nodes")
        _int_at_least("Workload.subgroup_numel", self.subgroup_numel, 1, "use e.g. 10_000_000")
        if self.fwd_bwd_s is not None and not _finite_at_least(self.fwd_bwd_s, 0.0):
            raise ConfigError(f"Workload.fwd_bwd_s must be a non-negative number of seconds, got {self.fwd_bwd_s!r}")
        for name in ("host_bytes", "gpu_headroom_bytes"):
            v = getattr(self, name)
            if v is not None:
                _int_at_least(f"Workload.{name}", v, 0, "give bytes, or None for the default share")
        for name in ("weight_bytes", "grad_bytes"):
            if getattr(self, name) not in (2, 4):
                raise ConfigError(f"Workload.{name} must be 2 (16-bit) or 4 (fp32), got {getattr(self, name)!r}")

    @property
    def params_per_rank(self) -> int:
        return -(-self.params // (self.ranks * self.nodes))


@dataclass(frozen=True, kw_only=True)
class Plan:
    """Where state lives and the engine's knobs: everything the model and the engine need."""

    host_cache_bytes: int | None = None
    """Per rank: state kept in host memory (``EngineConfig.host_cache_bytes``). None: all."""
    device_cache_bytes: int = 0
    """Per rank: state kept in device memory across iterations (``EngineConfig.device_cache_bytes``)."""
    device_fraction: float = 0.0
    prefetch_depth: int = 2
    io_concurrency: Mapping[str, int] = field(default_factory=dict)
    """Per path: requests in flight per direction. Missing: the engine's default (4)."""
    stripe_weights: Mapping[str, float] = field(default_factory=dict)
    """Per path: share of swapped subgroups. Missing: the path's bandwidth, as the engine does."""
    node_lock: bool = False
    name: str = ""

    def __post_init__(self) -> None:
        if self.host_cache_bytes is not None:
            _int_at_least("Plan.host_cache_bytes", self.host_cache_bytes, 0, "give bytes, or None for all in host memory")
        _int_at_least("Plan.device_cache_bytes", self.device_cache_bytes, 0, "give bytes (0: none)")
        object.__setattr__(self, "io_concurrency", dict(self.io_concurrency))
        object.__setattr__(self, "stripe_weights", dict(self.stripe_weights))
        self.to_knobs()  # the same ranges as the engine's knobs, with the same messages

    def to_knobs(self) -> Knobs:
        return Knobs(device_fraction=self.device_fraction, prefetch_depth=self.prefetch_depth,
                     io_concurrency=dict(self.io_concurrency), node_lock=self.node_lock,
                     stripe_weights=dict(self.stripe_weights))

    def engine_settings(self) -> dict:
        """The ``EngineConfig`` fields this plan sets (the rest of it is knobs)."""
        return {"host_cache_bytes": self.host_cache_bytes, "device_cache_bytes": self.device_cache_bytes}

    def replace(self, **changes) -> "Plan":
        return replace(self, **changes)

    def to_dict(self) -> dict:
        return asdict(self)


@dataclass(frozen=True)
class Prediction:
    """What the model predicts for one plan. Times in seconds, per iteration."""

    plan: Plan
    update_s: float
    """Update phase: mean of a forward-order and a reverse-order step."""
    iteration_s: float
    breakdown: dict[str, float]
    """Seconds per resource and chain (see the module docstring); ``storage:<device>`` per device."""
    bytes_per_param: float
    """Storage bytes read plus written per step, per parameter (as ``StepRecord`` counts them)."""
    bottleneck: str
    notes: tuple[str, ...] = ()
    feasible: bool = True
    """False for a stock configuration that does not fit this machine (see ``notes``)."""
    memory: dict[str, int] = field(default_factory=dict)
    """Bytes: ``host_per_node`` (state and staging), ``gpu_per_rank``, ``storage_per_node``."""

    def to_dict(self) -> dict:
        d = asdict(self)
        d["name"] = self.plan.name
        return d


# -- helpers ------------------------------------------------------------------------------------


def _int_at_least(name: str, v, lo: int, fix: str) -> None:
    if not (isinstance(v, int) and not isinstance(v, bool) and v >= lo):
        raise ConfigError(f"{name} must be an integer >= {lo}, got {v!r}: {fix}")


def _finite_at_least(v, lo: float) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v) and v >= lo


def _pay(numel: int) -> int:
    return -(-STATE_BYTES_PER_PARAM * numel // ALIGN_BYTES) * ALIGN_BYTES


def _chunks(numel: int) -> int:
    """I/O requests of one transfer: the payload's chunks and the header."""
    pay, chunk = _pay(numel), CHUNK_BYTES
    while -(-pay // chunk) > MAX_CHUNKS:
        chunk *= 2
    return -(-pay // chunk) + 1


def bandwidth(path: PathProfile, op: Literal["read", "write", "mixed"], concurrency: float,
              block_bytes: int = CHUNK_BYTES) -> float:
    """Bytes/s of ``op`` on ``path`` at ``concurrency`` requests in flight (per direction).

    :meth:`PathProfile.bytes_per_s` (best sweep point at or below the concurrency), restricted to
    the sweep's block size nearest ``block_bytes`` when the sweep has several.
    """
    c = max(1, int(concurrency))
    points = [s for s in path.sweep if s.op == op]
    blocks = {s.block_bytes for s in points}
    if len(blocks) <= 1:
        return path.bytes_per_s(op, c)
    block = min(blocks, key=lambda b: (abs(math.log(b / block_bytes)), -b))
    points = [s for s in points if s.block_bytes == block]
    at_or_below = [s.bytes_per_s.value for s in points if s.concurrency <= c]
    if at_or_below:
        return max(at_or_below)
    lowest = min(points, key=lambda s: s.concurrency)
    return lowest.bytes_per_s.value * c / lowest.concurrency


def _device_key(p: PathProfile) -> str:
    """The whole-disk name first: two partitions of one disk have two ``device_id``s, one disk."""
    return p.device or p.device_id or p.path


def _check_profile(profile: Profile) -> None:
    if profile.cpu_adamw_params_per_s() <= 0:
        raise ConfigError(f"profile {profile.name!r} has no CPU AdamW rate: measure one with `offloadctl profile save`")
    if profile.host.memory_bandwidth.value <= 0:
        raise ConfigError(f"profile {profile.name!r} has no host memory bandwidth: measure one with `offloadctl profile save`")


def _host_budget(profile: Profile, wl: Workload) -> int:
    return wl.host_bytes if wl.host_bytes is not None else int(profile.machine.memory_bytes * DEFAULT_HOST_SHARE)


def _gpu_headroom(profile: Profile, wl: Workload) -> int:
    if profile.gpu is None:
        return 0
    if wl.gpu_headroom_bytes is not None:
        return wl.gpu_headroom_bytes
    return int(profile.gpu.memory_bytes * DEFAULT_GPU_HEADROOM_SHARE)


def host_lane_seconds_per_param(profile: Profile, wl: Workload) -> float:
    """Seconds per parameter of the host lane with ``wl.ranks`` ranks sharing the node: the
    measured integrated rate when the profile has it, else the kernel rate plus the gradient
    upcast and weight copy at memory bandwidth (and the weight upload over PCIe)."""
    lane = profile.host.host_lane_params_per_s
    if lane is not None and lane.value > 0:
        return wl.ranks / lane.value
    extra_mem = (4 if wl.grad_bytes != 4 else 0) + (0 if profile.gpu else wl.weight_bytes)
    t = wl.ranks / profile.cpu_adamw_params_per_s() + extra_mem * wl.ranks / profile.host.memory_bandwidth.value
    if profile.gpu is not None:
        t += wl.weight_bytes / profile.gpu.h2d_bytes_per_s.value  # 16-bit weights to the device, in the loop
    return t


def _gb(b: float) -> str:
    return f"{b / 1e9:.3g} GB"


def _prefix_fit(budget: int | None, start: int, N: int, pay_n: int, pay_last: int) -> int:
    """Subgroups from index ``start`` that fit ``budget`` in order (the last one may be smaller)."""
    left = N - start
    if left <= 0:
        return 0
    if budget is None:
        return left
    k = min(budget // pay_n, left - 1)
    if k == left - 1 and budget - k * pay_n >= pay_last:
        k += 1
    return k


def _lane_count(a: int, b: int, f: float) -> int:
    """Device-lane subgroups among indices [a, b) (:func:`engine.placement.device_lane_mask`)."""
    return int(b * f + 1e-9) - int(a * f + 1e-9)


def _on_device_lane(i: int, f: float) -> bool:
    return int((i + 1) * f + 1e-9) > int(i * f + 1e-9)


@dataclass(frozen=True)
class _Traffic:
    """One step's swap traffic of one rank: per path index, bytes read/written and misses."""

    read: tuple[float, ...]
    written: tuple[float, ...]
    misses: tuple[float, ...]
    host_misses: float
    """Misses updated on the host lane (the loop waits for their update; device-lane ones are queued)."""


@lru_cache(maxsize=4096)
def _swap_traffic(N: int, first: int, K: int, n: int, n_last: int, weights: tuple[float, ...],
                  f: float) -> tuple[_Traffic, _Traffic]:
    """Forward- and reverse-order traffic of swapped subgroups ``first..N-1`` over weighted paths."""
    S = N - first
    M = S - K
    fb_n = _pay(n) + HEADER_BYTES
    if S > EXACT_SUBGROUPS:
        total = sum(weights)
        share = [w / total for w in weights]
        host_m = M * (1 - _lane_count(first, N, f) / S)
        t = _Traffic(tuple(M * fb_n * s for s in share), tuple(M * fb_n * s for s in share),
                     tuple(M * s for s in share), host_m)
        return t, t
    idx = list(range(first, N))
    sizes = [n_last if i == N - 1 else n for i in idx]
    tiers = stripe([_pay(x) for x in sizes], list(weights))
    out = []
    for reads, writes in ((range(K, S), range(0, M)), (range(0, M), range(K, S))):  # forward, reverse
        r, w, m = [0.0] * len(weights), [0.0] * len(weights), [0.0] * len(weights)
        host_m = 0
        for k in reads:
            r[tiers[k]] += _pay(sizes[k]) + HEADER_BYTES
            m[tiers[k]] += 1
            host_m += not _on_device_lane(idx[k], f)
        for k in writes:
            w[tiers[k]] += _pay(sizes[k]) + HEADER_BYTES
        out.append(_Traffic(tuple(r), tuple(w), tuple(m), host_m))
    return out[0], out[1]


@dataclass(frozen=True)
class _Device:
    key: str
    name: str
    profile: PathProfile
    members: tuple[int, ...]  # indices into the plan's path list


def _group_devices(paths: Sequence[PathProfile], active: Sequence[bool]) -> list[_Device]:
    groups: dict[str, list[int]] = {}
    for i, p in enumerate(paths):
        if active[i]:
            groups.setdefault(_device_key(p), []).append(i)
    return [_Device(k, paths[m[0]].device or k, paths[m[0]], tuple(m)) for k, m in groups.items()]


def _device_time(dev: _Device, R: float, W: float, c_read: float, c_write: float, block: int) -> tuple[float, float, float, float]:
    """(time, read-only, write-only, mixed) seconds for R and W bytes at the given concurrencies."""
    rbw = bandwidth(dev.profile, "read", c_read, block)
    wbw = bandwidth(dev.profile, "write", c_write, block)
    mbw = bandwidth(dev.profile, "mixed", min(c_read, c_write), block)
    tr, tw = R / rbw, W / wbw
    tm = (R + W) / mbw if R and W else 0.0
    return max(tr, tw, tm), tr, tw, tm


# -- the model ----------------------------------------------------------------------------------


def _plan_paths(profile: Profile, plan: Plan) -> list[PathProfile]:
    named = set(plan.stripe_weights) | set(plan.io_concurrency)
    known = {p.path for p in profile.paths}
    unknown = sorted(named - known)
    if unknown:
        raise ConfigError(f"plan {plan.name or ''!s} names {unknown}, which are not paths of profile {profile.name!r} "
                          f"(its paths: {sorted(known) or 'none'}): measure them with `offloadctl profile save --nvme PATH`")
    return [p for p in profile.paths if p.path in named] if named else list(profile.paths)


def _default_weight(p: PathProfile) -> float:
    """The engine's default stripe weight: a read plus a write of the same bytes."""
    r, w = p.read_bytes_per_s.value, p.write_bytes_per_s.value
    return 1.0 / (1.0 / r + 1.0 / w)


def predict(profile: Profile, workload: Workload, plan: Plan) -> Prediction:
    """Predicted update-phase and iteration time of ``plan`` (formulas in the module docstring).

    Raises :class:`ConfigError` for a plan the engine would refuse or that does not fit: paths
    not in the profile, swapped state with no path, a device lane without a GPU or over the GPU
    headroom, host memory over ``workload.host_bytes``, swap files over a path's capacity.
    """
    _check_profile(profile)
    wl = workload
    ranks = wl.ranks
    P = wl.params_per_rank
    n = min(wl.subgroup_numel, P)
    N = -(-P // n)
    n_last = P - (N - 1) * n
    pay_n, pay_last = _pay(n), _pay(n_last)
    fb = pay_n + HEADER_BYTES
    d = plan.prefetch_depth
    f = plan.device_fraction
    gpu = profile.gpu
    notes: list[str] = []

    # Placement (engine.placement.place): device prefix, host prefix, the rest swapped.
    if (f > 0 or plan.device_cache_bytes > 0) and gpu is None:
        raise ConfigError(f"plan {plan.name!r} uses the device lane (device_fraction={f}, device_cache_bytes="
                          f"{plan.device_cache_bytes}) but profile {profile.name!r} has no GPU: set both to 0")
    D = _prefix_fit(plan.device_cache_bytes, 0, N, pay_n, pay_last) if plan.device_cache_bytes else 0
    H = _prefix_fit(plan.host_cache_bytes, D, N, pay_n, pay_last)
    S = N - D - H
    K = min(S, d + 1)
    M = S - K

    paths = _plan_paths(profile, plan)
    weights = tuple(float(plan.stripe_weights.get(p.path, _default_weight(p))) for p in paths)
    if S and (not paths or sum(weights) <= 0):
        raise ConfigError(f"plan {plan.name!r} leaves {S} subgroups per rank ({_gb(S * pay_n)}) outside host memory, but "
                          f"{'no path has a positive stripe weight' if paths else f'profile {profile.name!r} has no storage paths'}: "
                          f"raise host_cache_bytes, or give a storage path")

    # Memory.
    staging = (2 * d + 3) * (max(pay_n, pay_last) + HEADER_BYTES) if S else 0
    host_state = H * pay_n - (pay_n - pay_last if D + H == N and H else 0)
    host_node = ranks * (host_state + staging)
    budget = _host_budget(profile, wl)
    if host_node > budget:
        raise ConfigError(f"plan {plan.name!r} needs {_gb(host_node)} of host memory per node for optimizer state and "
                          f"staging buffers, over the budget of {_gb(budget)}: lower host_cache_bytes or prefetch_depth, "
                          f"or raise the host memory budget (--host-gb)")
    G_host = _lane_count(D, D + H, f)
    G_swap = _lane_count(D + H, N, f)
    G = G_host + G_swap
    lane_used = G > 0
    # Resident state, the gradients of every subgroup updated on the GPU (kept there through
    # backward), and the lane's working buffers.
    gpu_rank = (plan.device_cache_bytes + (D + G) * n * wl.grad_bytes
                + (device_lane_working_bytes(n) if lane_used else 0))
    headroom = _gpu_headroom(profile, wl)
    if gpu is not None and gpu_rank > headroom:
        raise ConfigError(f"plan {plan.name!r} needs {_gb(gpu_rank)} of GPU memory per rank (device cache, the "
                          f"gradients of GPU-updated subgroups, the device lane's buffers), over the GPU headroom of "
                          f"{_gb(headroom)}: lower device_fraction to 0, device_cache_bytes, or subgroup_numel")

    # Swap traffic, per path and per order.
    wt = tuple(w if w > 0 else 0.0 for w in weights)
    traffic = _swap_traffic(N, D + H, K, n, n_last, wt, float(f)) if S else None
    storage_node: dict[str, float] = {}
    if S:
        per_path_files = _swap_traffic(N, D + H, 0, n, n_last, wt, 0.0)[0].read  # every swapped file, once
        for p, b in zip(paths, per_path_files):
            need = ranks * b
            if need > p.capacity_bytes > 0:
                raise ConfigError(f"path {p.path} would hold {_gb(need)} of swap files per node, over its capacity of "
                                  f"{_gb(p.capacity_bytes)}: add a path, lower its stripe weight, or raise host_cache_bytes")
            if b:
                storage_node[p.path] = need

    # Rates.
    cores = max(1, profile.machine.cores_logical or profile.machine.cores_physical)
    mem_bw = profile.host.memory_bandwidth.value
    per_param_host = host_lane_seconds_per_param(profile, wl)
    u = n * per_param_host

    lane_params = min(P, (D + G) * n)
    host_params = P - lane_params
    A = (H - G_host) * u  # host-lane time of the host-resident subgroups
    if gpu is not None:
        gpus = max(1, profile.machine.gpu_count)
        per_gpu = -(-ranks // gpus)
        fill = (n * STATE_BYTES_PER_PARAM / gpu.h2d_bytes_per_s.value + n * STATE_BYTES_PER_PARAM / gpu.d2h_bytes_per_s.value
                if G else 0.0)
        T_gpu = per_gpu * (fill + lane_params / gpu.adamw_params_per_s.value) if G + D else 0.0
        links = min(ranks, gpus)
        h2d = ranks * (G * n * STATE_BYTES_PER_PARAM + host_params * wl.weight_bytes)
        d2h = ranks * G * n * STATE_BYTES_PER_PARAM
        T_pcie = max(h2d / (links * gpu.duplex_h2d_bytes_per_s.value), d2h / (links * gpu.duplex_d2h_bytes_per_s.value),
                     (h2d + d2h) / mem_bw)
        if ranks > gpus:
            notes.append(f"{ranks} ranks share {gpus} GPU(s)")
    else:
        T_gpu = T_pcie = 0.0

    devices = _group_devices(paths, [w > 0 for w in wt]) if S else []
    ctx = _StepInputs(paths=paths, devices=devices, plan=plan, ranks=ranks, fb=fb, chunks=_chunks(n), d=d, K=K, M=M, u=u,
                      A=A, T_adam=host_params * per_param_host, T_gpu=T_gpu, T_pcie=T_pcie,
                      crc_bytes_per_s=CRC_BYTES_PER_S_PER_CORE * cores / ranks)
    fwd = _step(ctx, traffic[0] if traffic else None, forward=True)
    rev = _step(ctx, traffic[1] if traffic else None, forward=False)
    update_s = (fwd.total + rev.total) / 2
    mean = lambda a, b: (a + b) / 2  # noqa: E731
    chain_avg = {k: mean(fwd.chains.get(k, 0.0), rev.chains.get(k, 0.0)) for k in fwd.chains.keys() | rev.chains.keys()}
    which = max(chain_avg, key=chain_avg.get)
    if which == "storage":
        worst = max(fwd.per_device, key=lambda k: fwd.per_device[k] + rev.per_device.get(k, 0.0))
        bottleneck = f"storage ({worst})"
    else:
        bottleneck = {"cpu": "cpu", "prefetch": "prefetch depth", "gpu": "gpu", "pcie": "pcie"}[which]
    core = max(mean(fwd.T_io, rev.T_io), mean(fwd.T_cpu, rev.T_cpu), mean(fwd.T_lat, rev.T_lat), T_gpu, T_pcie)
    breakdown = {
        "storage": mean(fwd.T_io, rev.T_io),
        **{k: mean(fwd.parts[k], rev.parts[k]) for k in ("read", "write", "mixed")},
        "cpu_update": mean(fwd.T_cpu, rev.T_cpu),
        "gpu_update": T_gpu,
        "pcie": T_pcie,
        "prefetch_latency": mean(fwd.T_lat, rev.T_lat),
        "fill_drain": max(0.0, update_s - core),
        "resident_host": A,
        "forward_step": fwd.total,
        "reverse_step": rev.total,
    }
    for k in fwd.per_device:
        breakdown[f"storage:{k}"] = mean(fwd.per_device[k], rev.per_device.get(k, 0.0))
    fwd_bwd = wl.fwd_bwd_s
    if fwd_bwd is None:
        notes.append("no forward/backward time given (--fwd-bwd-s): the iteration counts the update phase only")
        fwd_bwd = 0.0
    breakdown["fwd_bwd"] = fwd_bwd
    if D:
        notes.append(f"keeps {_gb(D * pay_n)} of state on each GPU through forward and backward too: the GPU must have "
                     f"it free then, not only during the update")
    if S and K:
        notes.append(f"{K} of {S} swapped subgroups per rank stay in memory across steps (alternating order)")
    return Prediction(
        plan=plan, update_s=update_s, iteration_s=fwd_bwd + update_s, breakdown=breakdown,
        bytes_per_param=mean(fwd.bytes_moved, rev.bytes_moved) / P, bottleneck=bottleneck, notes=tuple(notes),
        memory={"host_per_node": host_node, "gpu_per_rank": gpu_rank if gpu else 0,
                "storage_per_node": int(sum(storage_node.values()))})


@dataclass(frozen=True)
class _StepInputs:
    """What a forward and a reverse step share (see :func:`predict`)."""

    paths: list[PathProfile]
    devices: list[_Device]
    plan: Plan
    ranks: int
    fb: int
    chunks: int
    d: int
    K: int
    M: int
    u: float
    A: float
    T_adam: float
    T_gpu: float
    T_pcie: float
    crc_bytes_per_s: float


@dataclass(frozen=True)
class _StepTime:
    total: float
    chains: dict[str, float]
    T_io: float
    T_cpu: float
    T_lat: float
    per_device: dict[str, float]
    parts: dict[str, float]
    bytes_moved: float
    """Storage bytes read and written by one rank."""


def _step(c: _StepInputs, tr: _Traffic | None, *, forward: bool) -> _StepTime:
    """One step in forward (resident subgroups first) or reverse (resident last) order: the
    longest of the chains in the module docstring."""
    d, K, M, u, ranks = c.d, c.K, c.M, c.u, c.ranks
    T_io = T_lat = r1_avg = w1_avg = moved = 0.0
    per_dev: dict[str, float] = {}
    parts = {"read": 0.0, "write": 0.0, "mixed": 0.0}
    if tr is not None and M > 0:
        lat = 0.0
        for dev in c.devices:
            conc = [c.plan.io_concurrency.get(c.paths[i].path, Knobs.DEFAULT_IO_CONCURRENCY) for i in dev.members]
            cr = [min(x, (d + 1) * c.chunks) for x in conc]  # reads in flight: d + 1 subgroups at most
            cw = [min(x, (d + 2) * c.chunks) for x in conc]
            # The node lock lets one process, and in it one path of the device, at a time.
            c_read = max(cr) if c.plan.node_lock else ranks * sum(cr)
            c_write = max(cw) if c.plan.node_lock else ranks * sum(cw)
            R = ranks * sum(tr.read[i] for i in dev.members)
            W = ranks * sum(tr.written[i] for i in dev.members)
            t, t_r, t_w, t_m = _device_time(dev, R, W, c_read, c_write, CHUNK_BYTES)
            per_dev[dev.name] = t
            for k, v in (("read", t_r), ("write", t_w), ("mixed", t_m)):
                parts[k] = max(parts[k], v)
            T_io = max(T_io, t)
            # One subgroup's read while the other ranks' reads share the device; with d = 0 the
            # previous subgroup's write-back runs at the same time.
            r1 = _device_time(dev, ranks * c.fb, ranks * c.fb if d == 0 else 0.0, c_read, c_write, CHUNK_BYTES)[0]
            w1 = _device_time(dev, 0.0, ranks * c.fb, c_read, c_write, CHUNK_BYTES)[0]
            misses = sum(tr.misses[i] for i in dev.members)
            lat += misses * r1
            r1_avg += misses / M * r1
            w1_avg += misses / M * w1
            moved += sum(tr.read[i] + tr.written[i] for i in dev.members)
        T_lat = (lat + tr.host_misses * u) / (d + 1)
    crc = moved / c.crc_bytes_per_s
    A_fwd, A_rev = (c.A, 0.0) if forward else (0.0, c.A)
    u_first = u if K else 0.0  # the first kept subgroup's update, before any read is issued
    if M > 0:
        fill = max(0.0, r1_avg - d * u)
        drain = max(0.0, w1_avg - K * u - A_rev)
        chains = {
            "storage": A_fwd + u_first + T_io + max(0.0, u + A_rev - w1_avg),
            # Checksums run on the I/O threads: they use the cores while the loop waits.
            "cpu": c.T_adam + max(fill + drain, crc),
            # The last read is issued after the last write-back, and hides it.
            "prefetch": c.A + K * u + T_lat + max(0.0, drain - r1_avg),
        }
    else:
        chains = {"cpu": c.T_adam + crc}
    chains["gpu"] = (u_first + c.T_gpu) if c.T_gpu else 0.0
    chains["pcie"] = c.T_pcie
    return _StepTime(max(chains.values()), chains, T_io, c.T_adam + crc, T_lat, per_dev, parts, moved)


# -- stock DeepSpeed ----------------------------------------------------------------------------


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
    _check_profile(profile)
    wl = workload
    if kind not in STOCK_KINDS:
        raise ConfigError(f"unknown stock DeepSpeed configuration {kind!r}: use one of {', '.join(STOCK_KINDS)}")
    ranks, P = wl.ranks, wl.params_per_rank
    n = min(wl.subgroup_numel, P)
    N = -(-P // n)
    gpu = profile.gpu
    cpu_rate = profile.cpu_adamw_params_per_s() / ranks
    mem_bw = profile.host.memory_bandwidth.value
    weight_s = wl.weight_bytes / (gpu.h2d_bytes_per_s.value if gpu else mem_bw / ranks)
    per_param = 1.0 / cpu_rate + weight_s + (4 * ranks / mem_bw if wl.grad_bytes != 4 else 0.0)
    # DeepSpeed's CPU path does at least what the engine's host lane does (and more: a separate
    # unscale pass, pageable weight copies), so it is never modelled faster than it.
    per_param = max(per_param, host_lane_seconds_per_param(profile, wl))
    budget = _host_budget(profile, wl)
    fwd_bwd = wl.fwd_bwd_s if wl.fwd_bwd_s is not None else 0.0
    notes: list[str] = []
    if wl.fwd_bwd_s is None:
        notes.append("no forward/backward time given (--fwd-bwd-s): the iteration counts the update phase only")
    infeasible: list[str] = []

    def result(name: str, plan: Plan, update: float, breakdown: dict, bpp: float, bottleneck: str, extra_iter: float = 0.0,
               memory: dict | None = None) -> Prediction:
        breakdown = {**breakdown, "fwd_bwd": fwd_bwd}
        return Prediction(plan=plan.replace(name=name), update_s=update, iteration_s=fwd_bwd + extra_iter + update,
                          breakdown=breakdown, bytes_per_param=bpp, bottleneck=bottleneck,
                          notes=tuple(infeasible + notes), feasible=not infeasible, memory=memory or {})

    if kind == "zero3-cpu":
        need = ranks * P * STATE_BYTES_PER_PARAM
        if need > budget:
            infeasible.append(f"needs {_gb(need)} of host memory per node for optimizer state, over the budget of {_gb(budget)}")
        t = P * per_param
        return result("stock ZeRO-3 CPU offload", Plan(host_cache_bytes=None, prefetch_depth=0), t,
                      {"cpu_update": t}, 0.0, "cpu", memory={"host_per_node": need})

    if kind == "twinflow":
        if gpu is None:
            infeasible.append(f"profile {profile.name!r} has no GPU")
            return result("stock Twin-Flow", Plan(), math.inf, {}, 0.0, "none")
        headroom = _gpu_headroom(profile, wl)
        if ratio is None:
            gpu_share = math.floor(min(1.0, headroom / (P * (STATE_BYTES_PER_PARAM + 4))) * 20) / 20
            ratio = 1.0 - gpu_share
        if not (isinstance(ratio, (int, float)) and 0.0 <= ratio <= 1.0):
            raise ConfigError(f"Twin-Flow ratio must be in [0, 1] (the share of state on the CPU), got {ratio!r}")
        on_gpu = round((1 - ratio) * P)
        gpu_need = on_gpu * (STATE_BYTES_PER_PARAM + 4)  # and its fp32 gradient, on the GPU too
        host_need = ranks * (P - on_gpu) * STATE_BYTES_PER_PARAM
        if gpu_need > headroom:
            infeasible.append(f"ratio {ratio:g} keeps {_gb(gpu_need)} of state on each GPU, over the headroom of {_gb(headroom)}")
        if host_need > budget:
            infeasible.append(f"needs {_gb(host_need)} of host memory per node, over the budget of {_gb(budget)}")
        notes.append(f"ratio {ratio:g}: the GPU part stays resident through forward and backward too")
        t_cpu = (P - on_gpu) * per_param
        t_gpu = on_gpu / gpu.adamw_params_per_s.value * -(-ranks // max(1, profile.machine.gpu_count))
        t = max(t_cpu, t_gpu)
        return result(f"stock Twin-Flow (ratio {ratio:g})",
                      Plan(host_cache_bytes=None, device_cache_bytes=_pay(on_gpu), device_fraction=0.0, prefetch_depth=0), t,
                      {"cpu_update": t_cpu, "gpu_update": t_gpu}, 0.0, "cpu" if t_cpu >= t_gpu else "gpu",
                      memory={"host_per_node": host_need, "gpu_per_rank": gpu_need})

    # zero-infinity-nvme
    if not profile.paths:
        infeasible.append(f"profile {profile.name!r} has no storage path")
        return result("stock ZeRO-Infinity NVMe", Plan(), math.inf, {}, 0.0, "none")
    c_dev = DS_QUEUE_DEPTH * ranks

    def unit(p: PathProfile) -> float:
        dev = _Device(_device_key(p), p.device, p, (0,))
        return _device_time(dev, 16.0, 12.0, c_dev, c_dev, DS_BLOCK_BYTES)[0]

    best = min(profile.paths, key=unit)
    dev = _Device(_device_key(best), best.device or best.path, best, (0,))
    R, W = ranks * P * 16.0, ranks * P * 12.0
    T_io, t_r, t_w, t_m = _device_time(dev, R, W, c_dev, c_dev, DS_BLOCK_BYTES)
    r1 = _device_time(dev, ranks * n * 16.0, 0.0, c_dev, c_dev, DS_BLOCK_BYTES)[0]
    w1 = _device_time(dev, 0.0, ranks * n * 12.0, c_dev, c_dev, DS_BLOCK_BYTES)[0]
    u = n * per_param
    T_cpu = P * per_param  # DeepSpeed's swap files carry no checksums
    # Read one ahead, write one behind: the first read and the last write are not overlapped.
    chains = {"storage": r1 + T_io * (N - 1) / N + u + w1, "cpu": r1 + T_cpu + w1}
    update = max(chains.values())
    grad_flush = _device_time(dev, 0.0, ranks * P * 4.0, c_dev, c_dev, DS_BLOCK_BYTES)[0]
    extra = max(0.0, grad_flush - BACKWARD_SHARE * fwd_bwd)
    if N * 16 * n * ranks > best.capacity_bytes > 0:
        infeasible.append(f"needs {_gb(N * 16 * n * ranks)} on {best.path}, over its capacity of {_gb(best.capacity_bytes)}")
    which = max(chains, key=chains.get)
    notes.append(f"one nvme_path ({best.path}), order 0..N-1 with no cache, aio queue depth {DS_QUEUE_DEPTH}")
    return result("stock ZeRO-Infinity NVMe", Plan(host_cache_bytes=0, prefetch_depth=1,
                                                   io_concurrency={best.path: DS_QUEUE_DEPTH}, stripe_weights={best.path: 1.0}),
                  update, {"storage": T_io, "read": t_r, "write": t_w, "mixed": t_m, "cpu_update": T_cpu,
                           "gradient_flush": grad_flush, "gradient_flush_exposed": extra, f"storage:{dev.name}": T_io},
                  (16.0 + 12.0 + 4.0) * ranks * P / (ranks * P),
                  f"storage ({dev.name})" if which != "cpu" else "cpu", extra_iter=extra,
                  memory={"storage_per_node": int(R)})


# -- the optimizer ------------------------------------------------------------------------------


def _candidate_paths(profile: Profile, paths: Sequence[str] | None) -> list[PathProfile]:
    if paths is None:
        return list(profile.paths)
    out = []
    for name in paths:
        p = profile.path(name)
        if p is None:
            raise ConfigError(f"path {name} is not in profile {profile.name!r} (its paths: "
                              f"{sorted(q.path for q in profile.paths) or 'none'}): measure it with "
                              f"`offloadctl profile save --nvme {name}`")
        out.append(p)
    return out


def _tune_paths(paths: Sequence[PathProfile], ranks: int, lock: bool) -> tuple[dict[str, int], dict[str, float]]:
    """Per device: the smallest concurrency within 2% of its best mixed-traffic time (the engine's
    default when the profile has no sweep), and a stripe weight equal to the bytes/s it moves for
    equal reads and writes. One path per device takes the device's whole weight: two paths on one
    disk do not make it faster."""
    conc: dict[str, int] = {}
    weights: dict[str, float] = {}
    seen: set[str] = set()
    for p in paths:
        key = _device_key(p)
        dev = _Device(key, p.device, p, (0,))
        cs = sorted(set(CONCURRENCIES) | {s.concurrency for s in p.sweep if 1 <= s.concurrency <= 64})

        def unit(c: int) -> float:
            cd = c if lock else ranks * c
            return _device_time(dev, 1.0, 1.0, cd, cd, CHUNK_BYTES)[0]

        best = min(unit(c) for c in cs)
        c = next(c for c in cs if unit(c) <= best * 1.02) if p.sweep else Knobs.DEFAULT_IO_CONCURRENCY
        conc[p.path] = c
        weights[p.path] = 0.0 if key in seen else 2.0 / unit(c)
        seen.add(key)
    return conc, weights


def best_plan(profile: Profile, workload: Workload, paths: Sequence[str] | None = None, *,
              device_cache: bool = True) -> Prediction:
    """The plan with the shortest predicted update phase, over the storage ``paths`` of the
    profile (default: all of them).

    Search: all state in host memory when it fits; otherwise, for each prefetch depth in
    ``DEPTHS`` the host cache is what the host budget leaves after the ``2 d + 3`` staging
    buffers, and the device fraction runs over 0..1 in steps of 0.05 (when the GPU headroom
    holds the lane's buffers); per device the concurrency and stripe weight come from
    :func:`_tune_paths`, with and without the node lock. With ``device_cache`` (the default, as
    ``offloadctl train`` fits a device tier to the headroom) it also tries keeping state
    resident on the GPU: all of it when it fits, else what the headroom leaves beside the
    device lane, and less, so the lane's gradients fit too. Among plans within 1% of the
    fastest it takes no device cache, then the smallest prefetch depth, then device fraction,
    then no lock. Finally the engine can always run what stock DeepSpeed runs, so a stock
    configuration the model finds faster is taken as the plan (its placement, run by the
    engine): the best is never slower than a stock row of :func:`alternatives`. At most a
    few hundred evaluations of :func:`predict`, each O(paths): well under a second at any
    model size.
    """
    best = _search(profile, workload, paths, name="best", device_cache=device_cache)
    for kind in STOCK_KINDS:
        stock = stock_deepspeed(profile, workload, kind)
        if not stock.feasible or stock.iteration_s >= best.iteration_s:
            continue
        if not device_cache and stock.plan.device_cache_bytes:
            continue
        try:
            mirror = predict(profile, workload, stock.plan.replace(name="best"))
        except ConfigError:
            continue
        if mirror.update_s < best.update_s:
            best = mirror
    return best


def _search(profile: Profile, wl: Workload, paths: Sequence[str] | None, *, name: str, device_lane: bool = True,
            device_cache: bool = False, host: Literal["budget", "none"] = "budget") -> Prediction:
    """:func:`best_plan`'s search; ``device_lane=False`` keeps the fraction at 0, ``host="none"``
    keeps every subgroup on storage."""
    _check_profile(profile)
    cands = _candidate_paths(profile, paths)
    P = wl.params_per_rank
    n = min(wl.subgroup_numel, P)
    budget_rank = _host_budget(profile, wl) // wl.ranks
    fb = _pay(n) + HEADER_BYTES
    headroom = _gpu_headroom(profile, wl)
    lane_ws = device_lane_working_bytes(n)
    lane_ok = device_lane and profile.gpu is not None and headroom >= lane_ws + n * wl.grad_bytes
    fractions = [i / 20 for i in range(21)] if lane_ok else [0.0]
    state_rank = _pay(n) * (-(-P // n))
    # State kept on the GPU through the whole iteration, with its gradients: all of it when it
    # fits, else what the headroom leaves beside the device lane, and less (the lane's own
    # gradients need room too).
    dev_caches = [0]
    if device_cache and profile.gpu is not None:
        per_byte = (STATE_BYTES_PER_PARAM + wl.grad_bytes) / STATE_BYTES_PER_PARAM
        if state_rank * per_byte <= headroom:
            dev_caches.append(state_rank)
        room = (headroom - lane_ws) / per_byte
        dev_caches += sorted({int(room * k // _pay(n)) * _pay(n) for k in (1.0, 0.75, 0.5) if room * k >= _pay(n)})
    preds: list[tuple[tuple, Prediction]] = []
    refusals: list[ConfigError] = []

    def consider(plan: Plan) -> None:
        try:
            pr = predict(profile, wl, plan)
        except ConfigError as e:
            refusals.append(e)
            return
        preds.append(((pr.update_s, plan.device_cache_bytes > 0, plan.prefetch_depth, plan.device_fraction,
                       plan.node_lock), pr))

    if host == "budget" and state_rank <= budget_rank:
        for dc in dev_caches:
            for f in fractions:
                consider(Plan(host_cache_bytes=None, device_cache_bytes=dc, device_fraction=f, prefetch_depth=0, name=name))
    if cands:
        for lock in ((False, True) if wl.ranks > 1 else (False,)):
            conc, weights = _tune_paths(cands, wl.ranks, lock)
            for d in DEPTHS:
                cache = budget_rank - (2 * d + 3) * fb
                if cache < 0:
                    continue
                for dc in dev_caches:
                    for f in fractions:
                        consider(Plan(host_cache_bytes=cache if host == "budget" else 0, device_cache_bytes=dc,
                                      device_fraction=f, prefetch_depth=d, io_concurrency=conc, stripe_weights=weights,
                                      node_lock=lock, name=name))
    if preds:
        # Within 1% of the fastest, the simplest plan: less prefetch memory, no device lane, no lock.
        fastest = min(k[0] for k, _ in preds)
        return min((kp for kp in preds if kp[0][0] <= fastest * 1.01 + 1e-12), key=lambda kp: kp[0][1:] + kp[0][:1])[1]
    if refusals:
        raise ConfigError(f"no plan fits: {str(refusals[-1]).replace(f'plan {name!r} ', '', 1)}")
    if not cands:
        raise ConfigError(f"{_gb(state_rank * wl.ranks)} of optimizer state per node does not fit the host memory budget "
                          f"of {_gb(budget_rank * wl.ranks)} and profile {profile.name!r} has no storage paths: measure "
                          f"a profile with `offloadctl profile save --nvme PATH`, or raise --host-gb")
    raise ConfigError(f"the host memory budget of {_gb(budget_rank * wl.ranks)} per node does not hold the 3 staging "
                      f"buffers of a {n}-element subgroup per rank ({_gb(3 * fb * wl.ranks)}): raise --host-gb or "
                      f"lower the subgroup size")


def alternatives(profile: Profile, workload: Workload, paths: Sequence[str] | None = None) -> list[Prediction]:
    """The best plan first, then a few of ours for comparison, then stock DeepSpeed's.

    Ours: the engine's defaults (prefetch 2, concurrency 4, stripes by bandwidth, host cache
    as the budget allows); the best plan without the device lane; the best with state also kept
    on the GPU (``device_cache``); the best with all state on storage. Stock: ZeRO-3 CPU offload, ZeRO-Infinity NVMe, Twin-Flow (see
    :func:`stock_deepspeed`); those that do not fit are kept, marked infeasible.
    """
    wl = workload
    best = best_plan(profile, wl, paths)
    cands = _candidate_paths(profile, paths)
    n = min(wl.subgroup_numel, wl.params_per_rank)
    budget_rank = _host_budget(profile, wl) // wl.ranks
    fb = _pay(n) + HEADER_BYTES
    out = [best]

    def add(make) -> None:
        try:
            pr = make()
        except ConfigError:
            return
        if all(_placement_and_knobs(pr.plan, wl) != _placement_and_knobs(o.plan, wl) for o in out):
            out.append(pr)

    defaults = Plan(host_cache_bytes=max(0, budget_rank - 7 * fb), prefetch_depth=2,
                    stripe_weights={p.path: _default_weight(p) for p in cands}, name="engine defaults")
    if cands:
        add(lambda: predict(profile, wl, defaults))
    if best.plan.device_fraction > 0:
        add(lambda: _search(profile, wl, paths, name="best without device lane", device_lane=False))
    if profile.gpu is not None:
        add(lambda: _search(profile, wl, paths, name="best with device cache", device_cache=True))
    if cands:
        add(lambda: _search(profile, wl, paths, name="all state on storage", host="none"))
    for kind in STOCK_KINDS:
        out.append(stock_deepspeed(profile, wl, kind))
    return out


def _placement_and_knobs(plan: Plan, wl: Workload) -> tuple:
    """What makes two plans run alike: subgroups kept in host memory, and the knobs."""
    P = wl.params_per_rank
    n = min(wl.subgroup_numel, P)
    N = -(-P // n)
    host = _prefix_fit(plan.host_cache_bytes, 0, N, _pay(n), _pay(P - (N - 1) * n))
    k = plan.to_knobs()
    return (host, plan.device_cache_bytes, k.device_fraction, k.prefetch_depth, sorted(k.io_concurrency.items()),
            sorted(k.stripe_weights.items()), k.node_lock)
