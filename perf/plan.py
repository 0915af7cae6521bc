"""From a hardware profile to one rank's engine settings: the performance model's best plan.

``offloadctl train --profile`` resolves the profile at launch; each rank calls
:func:`plan_for_rank` once it knows its partition, so the plan is for the real model size. The
knobs the user set on the command line win over the plan's.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, replace

from engine.config import Knobs, StoragePath
from engine.errors import ConfigError


@dataclass(frozen=True)
class RankPlan:
    host_cache_bytes: int | None
    knobs: Knobs
    paths: tuple[StoragePath, ...]
    """The run's paths with the profile's bandwidths declared (no probe at start)."""
    predicted_update_s: float
    summary: str
    """One line for the run log."""


LOCAL_SIZE_VARS = (
    "LOCAL_SIZE",
    "LOCAL_WORLD_SIZE",
    "OMPI_COMM_WORLD_LOCAL_SIZE",
    "MPI_LOCALNRANKS",
    "MV2_COMM_WORLD_LOCAL_SIZE",
    "SLURM_NTASKS_PER_NODE",
)
"""Where launchers put the ranks on this node: DeepSpeed's own, torchrun, Open MPI, MPICH and
Intel MPI, MVAPICH2, Slurm (DeepSpeed's --launcher options start ranks through each)."""
LOCAL_RANK_VARS = ("LOCAL_RANK", "OMPI_COMM_WORLD_LOCAL_RANK", "MPI_LOCALRANKID", "MV2_COMM_WORLD_LOCAL_RANK", "SLURM_LOCALID")


RANK_VARS = ("RANK", "OMPI_COMM_WORLD_RANK", "PMI_RANK", "PMIX_RANK", "MV2_COMM_WORLD_RANK", "SLURM_PROCID")
"""Where launchers put a process's global rank: torchrun, Accelerate and DeepSpeed's per-node
launcher (RANK), Open MPI, MPICH and Intel MPI, PMIx, MVAPICH2, Slurm."""
WORLD_SIZE_VARS = ("WORLD_SIZE", "OMPI_COMM_WORLD_SIZE", "PMI_SIZE", "MV2_COMM_WORLD_SIZE", "SLURM_NTASKS")


def _first_env(names, environ=None) -> str | None:
    environ = os.environ if environ is None else environ
    return next((environ[n] for n in names if environ.get(n)), None)


def launcher_rank(environ=None) -> int | None:
    """This process's global rank, from whichever launcher started it; None when none says."""
    v = _first_env(RANK_VARS, environ)
    return int(v) if v is not None and v.strip().isdigit() else None


def launcher_world_size(environ=None) -> int:
    """The run's ranks, from whichever launcher started it (1 when none says)."""
    v = _first_env(WORLD_SIZE_VARS, environ)
    return int(v) if v is not None and v.strip().isdigit() else 1


def local_rank(environ=None) -> int:
    """This rank's index on its node, from whichever launcher started it (0 when none says)."""
    return int(_first_env(LOCAL_RANK_VARS, environ) or 0)


def local_size(environ=None) -> int | None:
    """Ranks on this node, from whichever launcher started it; None when none says."""
    v = _first_env(LOCAL_SIZE_VARS, environ)
    return int(v.split("(")[0]) if v else None  # Slurm writes "4(x2)" for uneven nodes


def node_layout(world_size: int) -> tuple[int, int]:
    """(ranks per node, nodes) from the launcher's environment."""
    local = local_size() or world_size
    local = max(1, min(local, world_size))
    return local, max(1, world_size // local)


def plan_for_rank(
    profile_path: str,
    *,
    params_total: int,
    world_size: int,
    subgroup_numel: int,
    paths: tuple[StoragePath, ...],
    weight_bytes: int,
    host_cache_bytes: int | None,
    pins: dict,
    gpu_headroom_bytes: int | None = None,
    device_cache_bytes: int | None = None,
    device_fraction: float | None = None,
) -> RankPlan:
    """The model's best plan for this run, with ``host_cache_bytes`` (when not None) and
    ``pins`` (knob name -> value the user's options fixed) taking precedence.

    ``gpu_headroom_bytes``: what the first forward/backward left free on the GPU (measured by
    the engine at the first step); ``device_cache_bytes``: the device tier the engine fitted to
    it. With both, the plan is for the rest: what the CPU and the device lane share, at
    ``device_fraction`` when given (the engine's own balance, by the same lane model), else at
    the fraction the model predicts fastest."""
    from perf.model import Workload, predict
    from perf.profile_toml import load_profile
    from perf.search import best_plan

    profile = load_profile(profile_path)
    ranks, nodes = node_layout(world_size)
    workload = Workload(
        params=max(1, params_total),
        ranks=ranks,
        nodes=nodes,
        subgroup_numel=max(1, subgroup_numel),
        weight_bytes=weight_bytes if weight_bytes in (2, 4) else 4,
        grad_bytes=weight_bytes if weight_bytes in (2, 4) else 4,
        gpu_headroom_bytes=gpu_headroom_bytes,
    )
    names = [p.path for p in paths]
    for p in names:
        if profile.path(p) is None:
            raise ConfigError(
                f"storage path {p} is not in profile {profile.name!r} ({profile_path}): measure it with "
                f"`offloadctl profile save NAME --nvme {p}`, or run without --profile"
            )
    best = best_plan(profile, workload, paths=names)
    plan = best.plan
    if device_cache_bytes is not None:
        # The tier is fitted; the lane's share of what is left is the engine's, or the model's.
        plan = plan.replace(device_cache_bytes=device_cache_bytes)
        if device_fraction is not None:
            plan = plan.with_knobs(device_fraction=device_fraction)
            best = predict(profile, workload, plan)
        else:
            best = _best_fraction(profile, workload, plan)
            plan = best.plan
    if host_cache_bytes is not None:
        plan = plan.replace(host_cache_bytes=host_cache_bytes)
    if pins:
        plan = plan.with_knobs(**pins)
    pred = best if plan == best.plan else predict(profile, workload, plan)
    declared = tuple(
        replace(
            sp,
            read_bytes_per_s=sp.read_bytes_per_s or m.read_bytes_per_s.value,
            write_bytes_per_s=sp.write_bytes_per_s or m.write_bytes_per_s.value,
        )
        for sp in paths
        if (m := profile.path(sp.path)) is not None  # every one: checked above
    )
    # Without storage paths everything stays in host memory, whatever the plan says; with paths,
    # the plan's None is all of it in memory (EngineConfig's None, not a user's).
    host = plan.host_cache_bytes if paths else None
    summary = (
        f"profile {profile.name}: predicted update {pred.update_s:.3g} s, bottleneck {pred.bottleneck}; "
        f"host cache {'all' if host is None else f'{host / 1e9:.3g} GB'}, "
        f"device cache {plan.device_cache_bytes / 1e9:.3g} GB, device fraction {plan.knobs.device_fraction:g}, "
        f"prefetch {plan.knobs.prefetch_depth}, concurrency {dict(plan.knobs.io_concurrency) or 'default'}"
    )
    return RankPlan(host, plan.knobs, declared, pred.update_s, summary)


def _best_fraction(profile, workload, plan):
    """``plan`` with the device fraction (steps of 0.05) the model predicts fastest."""
    from perf.model import predict

    best = None
    for k in range(21):
        try:
            pr = predict(profile, workload, plan.with_knobs(device_fraction=k / 20))
        except ConfigError:
            continue
        if best is None or pr.update_s < best.update_s * 0.99:
            best = pr
    return best if best is not None else predict(profile, workload, plan.with_knobs(device_fraction=0.0))
