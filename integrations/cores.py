"""Each rank's share of the node's cores, for its host lane.

The host lane's AdamW runs on ``torch.get_num_threads()`` OpenMP threads. With several ranks
on a node, each would otherwise start as many threads as the node has cores: 8 ranks put 8
threads on every core, the kernels run at the pace of their slowest thread, and the rate each
rank measured alone (which the lane balance uses) is 8 times what it gets. Under
``offloadctl train`` each rank is bound, before the user's script starts, to its own block of the
cores this process may use (as DeepSpeed's ``--bind_cores_to_rank`` does, without numactl), and
runs that many threads; the host lane's rate is then measured on that share.

``--bind-cores auto`` (the default) binds when more than one rank shares the node and the user
did not ask DeepSpeed's launcher to bind; ``on`` always binds; ``off`` leaves the threads alone.
"""
from __future__ import annotations

import os
from typing import Sequence

MODES = ("auto", "on", "off")


def rank_cores(available: Sequence[int], local_rank: int, local_size: int) -> list[int]:
    """This rank's cores: the ``local_rank``-th of ``local_size`` contiguous blocks of
    ``available`` (sorted), the first blocks one core larger where they do not divide evenly.
    With fewer cores than ranks, ranks share a core (one each, round robin)."""
    cores = sorted(available)
    if not cores or local_size <= 1:
        return cores
    if len(cores) < local_size:
        return [cores[local_rank % len(cores)]]
    base, extra = divmod(len(cores), local_size)
    start = local_rank * base + min(local_rank, extra)
    return cores[start:start + base + (1 if local_rank < extra else 0)]


def bind_rank_cores(mode: str, environ=os.environ) -> list[int] | None:
    """Bind this rank to its cores and set its thread count to match, per ``mode``; the cores,
    or None when not bound. Call before torch starts its thread pool (before the user's script)."""
    from perf.plan import local_rank
    from perf.plan import local_size as launcher_local_size

    local_size = launcher_local_size(environ) or 1
    if mode == "off" or (mode == "auto" and local_size <= 1):
        return None
    if not hasattr(os, "sched_setaffinity"):  # pragma: no cover - not Linux
        return None
    cores = rank_cores(os.sched_getaffinity(0), local_rank(environ), local_size)
    if not cores:
        return None
    os.sched_setaffinity(0, cores)
    environ["OMP_NUM_THREADS"] = str(len(cores))  # DeepSpeed's cpu_adam op and anything OpenMP started later
    import torch

    torch.set_num_threads(len(cores))
    return cores


def describe(cores: list[int] | None) -> str:
    """For the start line: the host lane's threads and where they run."""
    import torch

    if cores is None:
        n = torch.get_num_threads()
        return f"host lane {n} thread{'s' if n != 1 else ''}"
    if len(cores) == 1:
        return f"host lane 1 thread on core {cores[0]}"
    span = f"{cores[0]}-{cores[-1]}" if cores == list(range(cores[0], cores[-1] + 1)) else ",".join(map(str, cores))
    return f"host lane {len(cores)} threads on cores {span}"
