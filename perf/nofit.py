"""When no plan fits the node: what each plan would need of it, against what it has, and what to
add (``offloadctl plan`` prints it as a table, ``--json`` carries the same).

:func:`no_fit` takes a workload for which :func:`perf.search.best_plan` found nothing, and gives
for a few plans (the engine's defaults, all state on storage, all in host memory, stock
DeepSpeed's) the host memory and the bytes on each storage path they would take per node, which
of those is over what the node has, and the smallest change in ``plan``'s own options that fits:
``--host-memory``, ``--nodes``, or more storage (a path measured with ``offloadctl profile save``).
"""

from __future__ import annotations

import dataclasses
from typing import Sequence

from engine.config import Knobs
from engine.errors import ConfigError
from engine.layout import HEADER_BYTES, payload_bytes, staging_buffers
from perf.hardware import default_weight, gpu_headroom, host_budget
from perf.model import Plan, Workload, plan_needs
from perf.profile import Profile
from perf.stock import STOCK_KINDS, stock_deepspeed

MAX_NODES = 4096
"""Node counts :func:`no_fit` tries before it stops suggesting ``--nodes``."""


@dataclasses.dataclass(frozen=True)
class Need:
    """One plan's needs per node, and which of them the node does not have."""

    name: str
    host: int
    """Host memory per node: state kept there and staging buffers."""
    paths: dict[str, int]
    """Swap files per node by storage path."""
    gpu: int = 0
    """GPU memory per rank (0: none, or no GPU)."""
    fails: tuple[str, ...] = ()
    """``host``, a path, ``gpu``, ``no path`` (state swapped with no path to take it), ``no GPU``."""

    def to_dict(self) -> dict:
        return {
            "name": self.name,
            "host_per_node": self.host,
            "paths": dict(self.paths),
            "gpu_per_rank": self.gpu,
            "fails": list(self.fails),
        }


@dataclasses.dataclass(frozen=True)
class NoFit:
    has: dict
    """What the node has: ``host_per_node`` (the host memory budget for optimizer state),
    ``memory_per_node`` (the machine's), ``paths`` (capacity by path, 0: not known),
    ``gpu_per_rank`` (the GPU headroom; 0: no GPU)."""
    needs: list[Need]
    fixes: list[dict]
    """Each change that fits on its own: ``option`` (``--host-memory``, ``--nodes``, ``storage``),
    ``value`` (bytes or nodes), ``text`` (one line)."""
    why: str
    """The model's own reason for the best plan (the search's last refusal)."""

    def to_dict(self) -> dict:
        return {"has": self.has, "needs": [n.to_dict() for n in self.needs], "fixes": self.fixes, "why": self.why}


def _fits(profile: Profile, wl: Workload, paths: Sequence[str] | None) -> bool:
    from perf.search import best_plan

    try:
        best_plan(profile, wl, paths)
    except ConfigError:
        return False
    return True


def no_fit(profile: Profile, wl: Workload, paths: Sequence[str] | None, why: str) -> NoFit:
    """Needs, what the node has, and the fixes, for a workload no plan fits (``why``: the search's reason)."""
    from perf.search import _candidate_paths

    cands = _candidate_paths(profile, paths)
    budget = host_budget(profile, wl)
    has = {
        "host_per_node": budget,
        "memory_per_node": profile.machine.memory_bytes,
        "paths": {p.path: p.capacity_bytes for p in cands},
        "gpu_per_rank": gpu_headroom(profile, wl) if profile.gpu is not None else 0,
    }
    n = min(wl.subgroup_numel, wl.params_per_rank)
    fb = payload_bytes(n) + HEADER_BYTES
    weights = {p.path: default_weight(p) for p in cands}
    ours = []
    if cands:
        d = Knobs().prefetch_depth
        ours.append(
            Plan(
                host_cache_bytes=max(0, budget // wl.ranks - staging_buffers(d) * fb),
                knobs=Knobs(stripe_weights=weights),
                name="engine defaults",
            )
        )
        ours.append(Plan(host_cache_bytes=0, knobs=Knobs(prefetch_depth=0, stripe_weights=weights), name="all state on storage"))
    ours.append(Plan(host_cache_bytes=None, knobs=Knobs(prefetch_depth=0), name="all state in host memory"))
    needs = [_check(has, plan.name, plan_needs(profile, wl, plan)) for plan in ours]
    for kind in STOCK_KINDS:
        pr = stock_deepspeed(profile, wl, kind)
        if profile.gpu is None and kind == "twinflow":
            needs.append(Need(pr.plan.name, 0, {}, fails=("no GPU",)))
            continue
        m = pr.memory
        path = next(iter(pr.plan.knobs.stripe_weights), None)  # ZeRO-Infinity's one nvme_path
        stored = {path: int(m["storage_per_node"])} if m.get("storage_per_node") and path else {}
        needs.append(
            _check(
                has,
                pr.plan.name,
                {
                    "host_per_node": m.get("host_per_node", 0),
                    "paths": stored,
                    "gpu_per_rank": m.get("gpu_per_rank", 0),
                    "nowhere": 0 if profile.paths else 1,
                },
            )
        )
    return NoFit(has=has, needs=needs, fixes=_fixes(profile, wl, paths, has, needs), why=why)


def _check(has: dict, name: str, need: dict) -> Need:
    fails = []
    if need["host_per_node"] > has["host_per_node"]:
        fails.append("host")
    for path, b in need["paths"].items():
        if b > has["paths"].get(path, 0) > 0:
            fails.append(path)
    if need.get("nowhere"):
        fails.append("no path")
    if has["gpu_per_rank"] and need.get("gpu_per_rank", 0) > has["gpu_per_rank"]:
        fails.append("gpu")
    return Need(name, int(need["host_per_node"]), dict(need["paths"]), int(need.get("gpu_per_rank", 0)), tuple(fails))


def _smallest(fits, lo: int, hi: int, *, exact: bool = False) -> int:
    """The smallest value in (lo, hi] for which ``fits`` holds, ``fits(hi)`` being true: to 0.5%
    of ``hi`` (sizes), or ``exact`` (counts)."""
    while hi - lo > (1 if exact else max(1, hi // 200)):
        mid = (lo + hi) // 2
        if fits(mid):
            hi = mid
        else:
            lo = mid
    return hi


def _fixes(profile: Profile, wl: Workload, paths: Sequence[str] | None, has: dict, needs: list[Need]) -> list[dict]:
    from engine.units import format_size, size_at_least

    fixes = []
    memory = has["memory_per_node"]
    with_host = lambda b: _fits(profile, dataclasses.replace(wl, host_bytes=b), paths)  # noqa: E731
    if memory > has["host_per_node"] and with_host(memory):
        b = _smallest(with_host, has["host_per_node"], memory)
        fixes.append(
            {
                "option": "--host-memory",
                "value": b,
                "text": f"--host-memory {size_at_least(b)} (of the node's {format_size(memory)})",
            }
        )
    with_nodes = lambda k: _fits(profile, dataclasses.replace(wl, nodes=k), paths)  # noqa: E731
    hi = max(2, wl.nodes * 2)
    while hi < MAX_NODES and not with_nodes(hi):
        hi *= 2
    if with_nodes(hi):
        k = _smallest(with_nodes, wl.nodes, hi, exact=True)
        fixes.append({"option": "--nodes", "value": k, "text": f"--nodes {k} (the model over {k} nodes like this one)"})
    capacity = sum(has["paths"].values())
    if has["paths"] and any(f in has["paths"] for f in needs[0].fails):
        more = sum(needs[0].paths.values()) - capacity  # the engine's defaults: the rest of the budget on storage
    elif not has["paths"]:
        more = needs[-1].host - has["host_per_node"]  # all state in host memory: what does not fit there
    else:
        more = 0
    if more > 0:
        fixes.append(
            {
                "option": "storage",
                "value": int(more),
                "text": f"{size_at_least(more)} more storage per node: a path measured into the profile "
                f"with `offloadctl profile save NAME --nvme PATH`",
            }
        )
    return fixes
