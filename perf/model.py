"""Performance model of the update phase and the iteration of one plan: its inputs
(:class:`Workload`, :class:`Plan`), its output (:class:`Prediction`) and :func:`predict`.

Pure functions over frozen dataclasses: no I/O, no torch. Inputs are a hardware
:class:`~perf.profile.Profile` (measured figures), a :class:`Workload` (model size, ranks,
forward/backward time) and a :class:`Plan` (where state lives, and the engine's
:class:`~engine.config.Knobs`). The model follows what :class:`engine.core.SubgroupEngine`
does, step by step: a step takes the longest of its storage, CPU, prefetch, GPU and PCIe
chains, each with its fill and drain; ``update_s`` is the mean of a forward and a reverse step.
``docs/perfmodel.md`` ("The model") gives the notation the code uses (``P``, ``n``, ``N``,
``D``, ``H``, ``S``, ``K``, ``M``, ``u``, ...) and derives each formula. The layout it counts
is :mod:`perf.layout`'s, the hardware figures :mod:`perf.hardware`'s; :mod:`perf.search`
searches over plans with it and :mod:`perf.stock` models stock DeepSpeed beside it.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field, fields, replace
from typing import Mapping

from engine.config import Knobs
from engine.errors import ConfigError
from engine.lane_model import LaneLoad, LaneRates, lane_times
from engine.layout import HEADER_BYTES, kept_subgroups, payload_bytes, read_ahead_bytes, staging_buffers
from engine.placement import device_lane_working_bytes
from perf.hardware import (
    Device,
    check_profile,
    default_weight,
    device_time,
    gb,
    gpu_headroom,
    group_devices,
    host_budget,
    host_lane_seconds_per_param,
)
from perf.layout import CHUNK_BYTES, SUBGROUP_NUMEL, Traffic, chunks, lane_count, prefix_fit, swap_traffic
from perf.profile import PathProfile, Profile

CRC_BYTES_PER_S_PER_CORE = 4e9
"""zlib CRC32 of every chunk read and written, on the I/O threads (engine.storage.swapfile)."""
MAX_PARAMS = 10**15
"""Largest model the model plans for (a thousand times today's largest): beyond it the byte
counts stop being numbers a float holds exactly."""


# -- inputs and output --------------------------------------------------------------------------


@dataclass(frozen=True, kw_only=True)
class Workload:
    """What is trained, on how many ranks, and the memory it may use."""

    params: int
    """Total model parameters."""
    ranks: int = 1
    """Ranks (GPUs) per node; they share the node's disks, PCIe, host memory and cores."""
    nodes: int = 1
    subgroup_numel: int = SUBGROUP_NUMEL
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
        p: float = self.params  # a count may come in as a float, e.g. 7e9
        if isinstance(p, float) and math.isfinite(p) and p.is_integer():
            object.__setattr__(self, "params", int(p))
        _int_at_least("Workload.params", self.params, 1, "give the model's parameter count, e.g. 7e9")
        if self.params > MAX_PARAMS:
            raise ConfigError(
                f"Workload.params is {self.params:.3g}, over {MAX_PARAMS:.0e}: no model is that large; "
                f"give the model's parameter count, e.g. 7e9"
            )
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
    """Where state lives and the engine's knobs: everything the model and the engine need.

    ``host_cache_bytes`` and ``device_cache_bytes`` are the ``EngineConfig`` fields of the same
    names (fixed for a run); ``knobs`` are the engine's :class:`~engine.config.Knobs` as they
    are, for ``engine.set_knobs(plan.knobs)``.
    """

    host_cache_bytes: int | None = None
    """Per rank: state kept in host memory (``EngineConfig.host_cache_bytes``). None: all."""
    device_cache_bytes: int = 0
    """Per rank: state kept in device memory across iterations (``EngineConfig.device_cache_bytes``)."""
    read_ahead_bytes: int = 0
    """Per rank: host memory for reading ahead during forward and backward, beyond the working
    staging buffers (``EngineConfig.read_ahead_bytes``); :func:`read_ahead_for` sizes it."""
    knobs: Knobs = field(default_factory=Knobs)
    """Device fraction, prefetch depth, per-path concurrency and stripe weights, node lock.
    A mapping of knob names is read with :meth:`Knobs.from_dict`."""
    overlap_io: bool = True
    """``EngineConfig.overlap_io``: writes behind the step and reads ahead of it, during forward and backward."""
    name: str = ""

    def __post_init__(self) -> None:
        if self.host_cache_bytes is not None:
            _int_at_least("Plan.host_cache_bytes", self.host_cache_bytes, 0, "give bytes, or None for all in host memory")
        _int_at_least("Plan.device_cache_bytes", self.device_cache_bytes, 0, "give bytes (0: none)")
        _int_at_least("Plan.read_ahead_bytes", self.read_ahead_bytes, 0, "give bytes (0: none)")
        if isinstance(self.knobs, Mapping):
            object.__setattr__(self, "knobs", Knobs.from_dict(self.knobs))
        elif not isinstance(self.knobs, Knobs):
            raise ConfigError(f"Plan.knobs must be engine.config.Knobs or a dict of knob names, got {self.knobs!r}")

    def replace(self, **changes) -> "Plan":
        return replace(self, **changes)

    def with_knobs(self, **changes) -> "Plan":
        """This plan with some knobs changed (names as :meth:`Knobs.names` gives them)."""
        return replace(self, knobs=self.knobs.from_dict({**self.knobs.to_dict(), **changes}))

    def to_dict(self) -> dict:
        """Flat: ``host_cache_bytes``, ``device_cache_bytes``, ``read_ahead_bytes``, each knob by name, ``name``."""
        return {
            "host_cache_bytes": self.host_cache_bytes,
            "device_cache_bytes": self.device_cache_bytes,
            "read_ahead_bytes": self.read_ahead_bytes,
            **self.knobs.to_dict(),
            "name": self.name,
        }

    @classmethod
    def from_dict(cls, d: Mapping) -> "Plan":
        """A plan from :meth:`to_dict`'s flat form; knob names go to :meth:`Knobs.from_dict`."""
        own = {f.name for f in fields(cls)} - {"knobs"}
        return cls(
            **{k: v for k, v in d.items() if k in own}, knobs=Knobs.from_dict({k: v for k, v in d.items() if k not in own})
        )


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
        """The prediction with its plan flat (:meth:`Plan.to_dict`), and the plan's name."""
        d = asdict(self)
        d["plan"] = self.plan.to_dict()
        d["name"] = self.plan.name
        return d


def _int_at_least(name: str, v, lo: int, fix: str) -> None:
    if not (isinstance(v, int) and not isinstance(v, bool) and v >= lo):
        raise ConfigError(f"{name} must be an integer >= {lo}, got {v!r}: {fix}")


def _finite_at_least(v, lo: float) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v) and v >= lo


def _mean(a: float, b: float) -> float:
    return (a + b) / 2


# -- predict: layout, paths, memory, traffic, rates, steps ---------------------------------------


@dataclass(frozen=True)
class _Layout:
    """One rank's subgroups under a plan, in the module docstring's notation."""

    P: int
    n: int
    N: int
    n_last: int
    pay_n: int
    pay_last: int
    fb: int
    d: int
    f: float
    D: int
    H: int
    S: int
    K: int
    M: int
    B: int  # staging buffers: the working ones and the read-ahead budget's
    G_host: int
    G_swap: int

    @property
    def G(self) -> int:
        return self.G_host + self.G_swap


def _layout(wl: Workload, plan: Plan) -> _Layout:
    """Placement (engine.placement.place): device prefix, host prefix, the rest swapped."""
    P = wl.params_per_rank
    n = min(wl.subgroup_numel, P)
    N = -(-P // n)
    n_last = P - (N - 1) * n
    pay_n, pay_last = payload_bytes(n), payload_bytes(n_last)
    d, f = plan.knobs.prefetch_depth, plan.knobs.device_fraction
    D = prefix_fit(plan.device_cache_bytes, 0, N, pay_n, pay_last) if plan.device_cache_bytes else 0
    H = prefix_fit(plan.host_cache_bytes, D, N, pay_n, pay_last)
    S = N - D - H
    K = min(S, kept_subgroups(d))
    fb = pay_n + HEADER_BYTES
    B = staging_buffers(d) + -(-plan.read_ahead_bytes // fb) if S else 0
    return _Layout(
        P=P,
        n=n,
        N=N,
        n_last=n_last,
        pay_n=pay_n,
        pay_last=pay_last,
        fb=fb,
        d=d,
        f=f,
        D=D,
        H=H,
        S=S,
        K=K,
        M=S - K,
        B=B,
        G_host=lane_count(D, D + H, f),
        G_swap=lane_count(D + H, N, f),
    )


def _plan_paths(profile: Profile, plan: Plan) -> list[PathProfile]:
    named = set(plan.knobs.stripe_weights) | set(plan.knobs.io_concurrency)
    known = {p.path for p in profile.paths}
    unknown = sorted(named - known)
    if unknown:
        raise ConfigError(
            f"plan {plan.name or ''!s} names {unknown}, which are not paths of profile {profile.name!r} "
            f"(its paths: {sorted(known) or 'none'}): measure them with `offloadctl profile save --nvme PATH`"
        )
    return [p for p in profile.paths if p.path in named] if named else list(profile.paths)


def _paths_and_weights(profile: Profile, plan: Plan, lay: _Layout) -> tuple[list[PathProfile], tuple[float, ...]]:
    """The plan's paths and their stripe weights; ConfigError when swapped state has nowhere to go."""
    if (lay.f > 0 or plan.device_cache_bytes > 0) and profile.gpu is None:
        raise ConfigError(
            f"plan {plan.name!r} uses the device lane (device_fraction={lay.f}, device_cache_bytes="
            f"{plan.device_cache_bytes}) but profile {profile.name!r} has no GPU: set both to 0"
        )
    paths = _plan_paths(profile, plan)
    weights = tuple(float(plan.knobs.stripe_weights.get(p.path, default_weight(p))) for p in paths)
    if lay.S and (not paths or sum(weights) <= 0):
        why = "no path has a positive stripe weight" if paths else f"profile {profile.name!r} has no storage paths"
        raise ConfigError(
            f"plan {plan.name!r} leaves {lay.S} subgroups per rank ({gb(lay.S * lay.pay_n)}) outside host "
            f"memory, but {why}: raise the host memory for optimizer state "
            f"(--host-memory), or give a storage path"
        )
    return paths, weights


def _memory_need(profile: Profile, wl: Workload, plan: Plan, lay: _Layout) -> tuple[int, int]:
    """(host bytes per node, GPU bytes per rank) that ``plan`` takes, whatever the node has."""
    staging = lay.B * (max(lay.pay_n, lay.pay_last) + HEADER_BYTES) if lay.S else 0
    host_state = lay.H * lay.pay_n - (lay.pay_n - lay.pay_last if lay.D + lay.H == lay.N and lay.H else 0)
    host_node = wl.ranks * (host_state + staging)
    # Resident state and its gradients, the lane's working buffers, and the gradients of the
    # device-lane subgroups that stay on the GPU (as many as fit: lane_load).
    load = lane_load(wl, lay, plan, gpu_headroom(profile, wl))
    gpu_rank = (
        plan.device_cache_bytes
        + (load.resident_params + load.staged_params - load.upload_grad_params) * wl.grad_bytes
        + (device_lane_working_bytes(lay.n) if lay.G > 0 else 0)
    )
    return host_node, gpu_rank


def _memory(profile: Profile, wl: Workload, plan: Plan, lay: _Layout) -> tuple[int, int]:
    """(host bytes per node, GPU bytes per rank); ConfigError over the budget or the headroom."""
    host_node, gpu_rank = _memory_need(profile, wl, plan, lay)
    budget = host_budget(profile, wl)
    if host_node > budget:
        raise ConfigError(
            f"plan {plan.name!r} needs {gb(host_node)} of host memory per node for optimizer state and "
            f"staging buffers, over the budget of {gb(budget)}: lower host_cache_bytes or prefetch_depth, "
            f"or raise the host memory budget (--host-memory)"
        )
    headroom = gpu_headroom(profile, wl)
    if profile.gpu is not None and gpu_rank > headroom:
        raise ConfigError(
            f"plan {plan.name!r} needs {gb(gpu_rank)} of GPU memory per rank (device cache, the "
            f"gradients of GPU-updated subgroups, the device lane's buffers), over the GPU headroom of "
            f"{gb(headroom)}: lower device_fraction to 0, device_cache_bytes, or subgroup_numel"
        )
    return host_node, gpu_rank


def _swap_need(paths: list[PathProfile], wt: tuple[float, ...], lay: _Layout, ranks: int) -> dict[str, float]:
    """Bytes of swap files per node on each path that holds any."""
    per_path_files = swap_traffic(lay.N, lay.D + lay.H, 0, lay.n, lay.n_last, wt, 0.0)[0].read  # every file, once
    return {p.path: ranks * b for p, b in zip(paths, per_path_files) if b}


def _swap_files(paths: list[PathProfile], wt: tuple[float, ...], lay: _Layout, ranks: int) -> dict[str, float]:
    """Bytes of swap files per node on each path; ConfigError over a path's capacity."""
    storage_node = _swap_need(paths, wt, lay, ranks)
    for p in paths:
        need = storage_node.get(p.path, 0)
        if need > p.capacity_bytes > 0:
            raise ConfigError(
                f"path {p.path} would hold {gb(need)} of swap files per node, over its capacity of "
                f"{gb(p.capacity_bytes)}: add a path, lower its stripe weight, or raise the host memory "
                f"for optimizer state (--host-memory)"
            )
    return storage_node


def plan_needs(profile: Profile, workload: Workload, plan: Plan) -> dict:
    """What ``plan`` would take of the node, whether or not the node has it (``offloadctl plan``
    shows it when no plan fits): ``host_per_node`` (state and staging buffers), ``gpu_per_rank``,
    ``paths`` (bytes of swap files per node by path), and ``nowhere`` (bytes per node swapped
    with no path to take them)."""
    check_profile(profile)
    lay = _layout(workload, plan)
    host_node, gpu_rank = _memory_need(profile, workload, plan, lay)
    paths = _plan_paths(profile, plan)
    weights = tuple(max(0.0, float(plan.knobs.stripe_weights.get(p.path, default_weight(p)))) for p in paths)
    swapped = workload.ranks * (lay.S * lay.pay_n - (lay.pay_n - lay.pay_last if lay.S else 0))
    stored = _swap_need(paths, weights, lay, workload.ranks) if lay.S and sum(weights) > 0 else {}
    return {
        "host_per_node": host_node,
        "gpu_per_rank": gpu_rank if profile.gpu else 0,
        "paths": {k: int(v) for k, v in stored.items()},
        "nowhere": 0 if stored or not lay.S else int(swapped),
    }


def lane_rates(profile: Profile, wl: Workload) -> LaneRates:
    """The profile's rates as one rank sees them (:class:`engine.lane_model.LaneRates`): the
    node's PCIe links, GPUs and host memory shared by its ranks."""
    gpu, ranks = profile.gpu, wl.ranks
    assert gpu is not None, "lane_rates needs a profile with a GPU"
    gpus = max(1, profile.machine.gpu_count)
    links = min(ranks, gpus)
    return LaneRates(
        host_lane_params_per_s=1.0 / host_lane_seconds_per_param(profile, wl),
        h2d_bytes_per_s=gpu.duplex_h2d_bytes_per_s.value * links / ranks,
        d2h_bytes_per_s=gpu.duplex_d2h_bytes_per_s.value * links / ranks,
        gpu_adamw_params_per_s=gpu.adamw_params_per_s.value / -(-ranks // gpus),
        # The profile's figure is bytes copied per second: twice that crosses memory.
        memory_bytes_per_s=2 * profile.host.memory_bandwidth.value / ranks,
    )


def lane_load(wl: Workload, lay: _Layout, plan: Plan, headroom: int) -> LaneLoad:
    """One rank's work by lane under ``plan``: the device tier's, the device lane's (their
    gradients on the GPU as far as the headroom left holds them, as the engine keeps them), the
    host lane's."""
    resident = min(lay.P, lay.D * lay.n)
    staged = min(lay.P - resident, lay.G * lay.n)
    left = headroom - plan.device_cache_bytes - resident * wl.grad_bytes - device_lane_working_bytes(lay.n)
    kept = min(lay.G, max(0, int(left // (lay.n * wl.grad_bytes)))) if lay.G else 0
    return LaneLoad(
        host_params=lay.P - resident - staged,
        staged_params=staged,
        upload_grad_params=max(0, staged - kept * lay.n),
        resident_params=resident,
        grad_bytes=wl.grad_bytes,
        weight_bytes=wl.weight_bytes,
        weights_on_device=True,
    )


def _gpu_and_pcie(profile: Profile, wl: Workload, lay: _Layout, plan: Plan, notes: list[str]) -> tuple[float, float]:
    """(T_gpu, T_pcie): the device lane's and the device tier's updates, and the rank's share of
    PCIe and host memory, by :func:`engine.lane_model.lane_times` (the engine's own model)."""
    if profile.gpu is None:
        return 0.0, 0.0
    t = lane_times(lane_load(wl, lay, plan, gpu_headroom(profile, wl)), lane_rates(profile, wl))
    gpus = max(1, profile.machine.gpu_count)
    if wl.ranks > gpus:
        notes.append(f"{wl.ranks} ranks share {gpus} GPU(s)")
    T_gpu = t["gpu"] if lay.G + lay.D else 0.0
    return T_gpu, max(t["h2d"], t["d2h"], t["memory"])


def predict(profile: Profile, workload: Workload, plan: Plan) -> Prediction:
    """Predicted update-phase and iteration time of ``plan`` (formulas in the module docstring).

    Raises :class:`ConfigError` for a plan the engine would refuse or that does not fit: paths
    not in the profile, swapped state with no path, a device lane without a GPU or over the GPU
    headroom, host memory over ``workload.host_bytes``, swap files over a path's capacity.
    """
    check_profile(profile)
    wl, lay = workload, _layout(workload, plan)
    notes: list[str] = []
    paths, weights = _paths_and_weights(profile, plan, lay)
    host_node, gpu_rank = _memory(profile, wl, plan, lay)

    # Swap traffic, per path and per order.
    wt = tuple(w if w > 0 else 0.0 for w in weights)
    # Traffic as if only the kept subgroups were held: the clean copies the other buffers keep
    # (engine.transfers) save up to B - K reads a step, which the model leaves out (docs/perfmodel.md).
    traffic = swap_traffic(lay.N, lay.D + lay.H, lay.K, lay.n, lay.n_last, wt, float(lay.f)) if lay.S else None
    storage_node = _swap_files(paths, wt, lay, wl.ranks) if lay.S else {}

    # Rates.
    cores = max(1, profile.machine.cores_logical or profile.machine.cores_physical)
    per_param_host = host_lane_seconds_per_param(profile, wl)
    u = lay.n * per_param_host
    lane_params = min(lay.P, (lay.D + lay.G) * lay.n)
    host_params = lay.P - lane_params
    A = (lay.H - lay.G_host) * u  # host-lane time of the host-resident subgroups
    T_gpu, T_pcie = _gpu_and_pcie(profile, wl, lay, plan, notes)

    devices = group_devices(paths, [w > 0 for w in wt]) if lay.S else []
    ctx = _StepInputs(
        paths=paths,
        devices=devices,
        knobs=plan.knobs,
        ranks=wl.ranks,
        fb=lay.fb,
        chunks=chunks(lay.n),
        d=lay.d,
        K=lay.K,
        M=lay.M,
        u=u,
        A=A,
        T_adam=host_params * per_param_host,
        T_gpu=T_gpu,
        T_pcie=T_pcie,
        crc_bytes_per_s=CRC_BYTES_PER_S_PER_CORE * cores / wl.ranks,
    )
    fwd = _step(ctx, traffic[0] if traffic else None, forward=True)
    rev = _step(ctx, traffic[1] if traffic else None, forward=False)
    update_s = (fwd.total + rev.total) / 2
    breakdown, bottleneck = _breakdown(fwd, rev, update_s, T_gpu, T_pcie, A)
    fwd_bwd = wl.fwd_bwd_s
    if fwd_bwd is None:
        notes.append("no forward/backward time given (--fwd-bwd-s): the iteration counts the update phase only")
        fwd_bwd = 0.0
    breakdown["fwd_bwd"] = fwd_bwd
    hidden = _hidden_io(fwd, rev, lay, fwd_bwd) if plan.overlap_io else 0.0
    breakdown["io_in_fwd_bwd"] = hidden
    if lay.D:
        notes.append(
            f"keeps {gb(lay.D * lay.pay_n)} of state on each GPU through forward and backward too: the GPU "
            f"must have it free then, not only during the update"
        )
    if lay.S and lay.K:
        notes.append(f"{lay.K} of {lay.S} swapped subgroups per rank stay in memory across steps (alternating order)")
    return Prediction(
        plan=plan,
        update_s=update_s,
        iteration_s=max(fwd_bwd, fwd_bwd + update_s - hidden),
        breakdown=breakdown,
        bytes_per_param=_mean(fwd.bytes_moved, rev.bytes_moved) / lay.P,
        bottleneck=bottleneck,
        notes=tuple(notes),
        memory={
            "host_per_node": host_node,
            "gpu_per_rank": gpu_rank if profile.gpu else 0,
            "storage_per_node": int(sum(storage_node.values())),
        },
    )


def _hidden_io(fwd: "_StepTime", rev: "_StepTime", lay: _Layout, fwd_bwd: float) -> float:
    """Storage time moved out of the update into forward and backward (``EngineConfig.overlap_io``):
    the writes behind the step, in the working buffers still writing at its end (``d + 2``), and
    the reads ahead, into the buffers of the read-ahead budget; no more than forward and
    backward last, nor than the step's storage time beyond its compute."""
    T_io = _mean(fwd.T_io, rev.T_io)
    moved = _mean(fwd.bytes_moved, rev.bytes_moved)
    if not moved or not T_io:
        return 0.0
    behind = min(lay.M, lay.d + 2) * lay.fb
    ahead = min(lay.S - min(lay.S, staging_buffers(lay.d)), lay.B - staging_buffers(lay.d)) * lay.fb
    return min(fwd_bwd, T_io * min(1.0, (behind + ahead) / moved), max(0.0, T_io - _mean(fwd.T_cpu, rev.T_cpu)))


def read_ahead_for(fwd_bwd_s: float, read_bytes_per_s: float, room_bytes: int) -> int:
    """The read-ahead budget a plan takes: what the paths read during forward and backward
    (``engine.layout.read_ahead_bytes``, the engine's own default), within ``room_bytes``."""
    return max(0, min(read_ahead_bytes(fwd_bwd_s, read_bytes_per_s), room_bytes))


# -- one step -----------------------------------------------------------------------------------


@dataclass(frozen=True)
class _StepInputs:
    """What a forward and a reverse step share (see :func:`predict`)."""

    paths: list[PathProfile]
    devices: list[Device]
    knobs: Knobs
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


@dataclass
class _StepIO:
    """Storage time of one step: per device, and the one-subgroup read and write (misses' mean)."""

    T_io: float = 0.0
    T_lat: float = 0.0
    r1: float = 0.0
    w1: float = 0.0
    moved: float = 0.0
    per_device: dict[str, float] = field(default_factory=dict)
    parts: dict[str, float] = field(default_factory=lambda: {"read": 0.0, "write": 0.0, "mixed": 0.0})


def _step_io(c: _StepInputs, tr: Traffic) -> _StepIO:
    """Every device's time for the step's traffic at the requests in flight on it, and the
    prefetch window's latency (Little's law on ``d + 1`` reads)."""
    d, M, ranks = c.d, c.M, c.ranks
    io = _StepIO()
    lat = 0.0
    for dev in c.devices:
        conc = [c.knobs.concurrency_for(c.paths[i].path) for i in dev.members]
        cr = [min(x, (d + 1) * c.chunks) for x in conc]  # reads in flight: d + 1 subgroups at most
        cw = [min(x, (d + 2) * c.chunks) for x in conc]
        # The node lock lets one process, and in it one path of the device, at a time.
        c_read = max(cr) if c.knobs.node_lock else ranks * sum(cr)
        c_write = max(cw) if c.knobs.node_lock else ranks * sum(cw)
        R = ranks * sum(tr.read[i] for i in dev.members)
        W = ranks * sum(tr.written[i] for i in dev.members)
        t, t_r, t_w, t_m = device_time(dev, R, W, c_read, c_write, CHUNK_BYTES)
        io.per_device[dev.name] = t
        for k, v in (("read", t_r), ("write", t_w), ("mixed", t_m)):
            io.parts[k] = max(io.parts[k], v)
        io.T_io = max(io.T_io, t)
        # One subgroup's read while the other ranks' reads share the device; with d = 0 the
        # previous subgroup's write-back runs at the same time.
        r1 = device_time(dev, ranks * c.fb, ranks * c.fb if d == 0 else 0.0, c_read, c_write, CHUNK_BYTES)[0]
        w1 = device_time(dev, 0.0, ranks * c.fb, c_read, c_write, CHUNK_BYTES)[0]
        misses = sum(tr.misses[i] for i in dev.members)
        lat += misses * r1
        io.r1 += misses / M * r1
        io.w1 += misses / M * w1
        io.moved += sum(tr.read[i] + tr.written[i] for i in dev.members)
    io.T_lat = (lat + tr.host_misses * c.u) / (d + 1)
    return io


def _step(c: _StepInputs, tr: Traffic | None, *, forward: bool) -> _StepTime:
    """One step in forward (resident subgroups first) or reverse (resident last) order: the
    longest of the chains in the module docstring."""
    d, K, M, u = c.d, c.K, c.M, c.u
    io = _step_io(c, tr) if tr is not None and M > 0 else _StepIO()
    crc = io.moved / c.crc_bytes_per_s
    A_fwd, A_rev = (c.A, 0.0) if forward else (0.0, c.A)
    u_first = u if K else 0.0  # the first kept subgroup's update, before any read is issued
    if M > 0:
        fill = max(0.0, io.r1 - d * u)
        drain = max(0.0, io.w1 - K * u - A_rev)
        chains = {
            "storage": A_fwd + u_first + io.T_io + max(0.0, u + A_rev - io.w1),
            # Checksums run on the I/O threads: they use the cores while the loop waits.
            "cpu": c.T_adam + max(fill + drain, crc),
            # The last read is issued after the last write-back, and hides it.
            "prefetch": c.A + K * u + io.T_lat + max(0.0, drain - io.r1),
        }
    else:
        chains = {"cpu": c.T_adam + crc}
    chains["gpu"] = (u_first + c.T_gpu) if c.T_gpu else 0.0
    chains["pcie"] = c.T_pcie
    return _StepTime(max(chains.values()), chains, io.T_io, c.T_adam + crc, io.T_lat, io.per_device, io.parts, io.moved)


def _breakdown(
    fwd: _StepTime, rev: _StepTime, update_s: float, T_gpu: float, T_pcie: float, A: float
) -> tuple[dict[str, float], str]:
    """Seconds per resource and chain (mean of the two orders), and the bottleneck: the longest chain."""
    chain_avg = {k: _mean(fwd.chains.get(k, 0.0), rev.chains.get(k, 0.0)) for k in fwd.chains.keys() | rev.chains.keys()}
    which = max(chain_avg, key=chain_avg.__getitem__)
    if which == "storage":
        worst = max(fwd.per_device, key=lambda k: fwd.per_device[k] + rev.per_device.get(k, 0.0))
        bottleneck = f"storage ({worst})"
    else:
        bottleneck = {"cpu": "cpu", "prefetch": "prefetch depth", "gpu": "gpu", "pcie": "pcie"}[which]
    core = max(_mean(fwd.T_io, rev.T_io), _mean(fwd.T_cpu, rev.T_cpu), _mean(fwd.T_lat, rev.T_lat), T_gpu, T_pcie)
    breakdown = {
        "storage": _mean(fwd.T_io, rev.T_io),
        **{k: _mean(fwd.parts[k], rev.parts[k]) for k in ("read", "write", "mixed")},
        "cpu_update": _mean(fwd.T_cpu, rev.T_cpu),
        "gpu_update": T_gpu,
        "pcie": T_pcie,
        "prefetch_latency": _mean(fwd.T_lat, rev.T_lat),
        "fill_drain": max(0.0, update_s - core),
        "resident_host": A,
        "forward_step": fwd.total,
        "reverse_step": rev.total,
    }
    for k in fwd.per_device:
        breakdown[f"storage:{k}"] = _mean(fwd.per_device[k], rev.per_device.get(k, 0.0))
    return breakdown, bottleneck
