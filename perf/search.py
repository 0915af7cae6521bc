"""The search over plans: :func:`best_plan` (the plan with the shortest predicted update phase)
and :func:`alternatives` (the best, a few of ours under restrictions, and stock DeepSpeed's, for
``offloadctl plan``). Each candidate is scored by :func:`perf.model.predict`; stock rows come
from :func:`perf.stock.stock_deepspeed`.
"""

from __future__ import annotations

from typing import Literal, Sequence

from engine.config import Knobs
from engine.errors import ConfigError
from engine.layout import HEADER_BYTES, STATE_BYTES_PER_ELEMENT, payload_bytes, staging_buffers
from engine.placement import device_lane_working_bytes
from perf.hardware import Device, check_profile, default_weight, device_key, device_time, gb, gpu_headroom, host_budget
from perf.layout import CHUNK_BYTES, prefix_fit
from perf.model import Plan, Prediction, Workload, predict, read_ahead_for
from perf.profile import PathProfile, Profile
from perf.stock import STOCK_KINDS, stock_deepspeed


class NoPlanFits(ConfigError):
    """No plan fits the node's host memory and storage (:func:`perf.nofit.no_fit` says what each needs)."""


DEPTHS = (0, 1, 2, 3, 4, 6, 8, 12, 16)
"""Prefetch depths the search tries."""
CONCURRENCIES = (1, 2, 4, 8, 16, 32, 64)
"""Requests in flight per path the search tries (with the profile's sweep points)."""
FRACTIONS = tuple(i / 20 for i in range(21))
"""Device fractions the search tries when the GPU holds the device lane."""


def best_plan(
    profile: Profile, workload: Workload, paths: Sequence[str] | None = None, *, device_cache: bool = True
) -> Prediction:
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
    best = _with_read_ahead(profile, workload, _search(profile, workload, paths, name="best", device_cache=device_cache))
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


def _with_read_ahead(profile: Profile, workload: Workload, pr: Prediction) -> Prediction:
    """``pr``'s plan with a read-ahead budget, if the model finds it faster: what its paths read
    during forward and backward (``perf.model.read_ahead_for``), taken from its host cache
    (or from the budget's room when it caches nothing): a cached subgroup saves its bytes, a
    read-ahead buffer hides them in forward and backward."""
    plan = pr.plan
    if not workload.fwd_bwd_s or not pr.bytes_per_param or plan.read_ahead_bytes:
        return pr
    paths = [p for p in profile.paths if plan.knobs.stripe_weights.get(p.path, 0) > 0] or list(profile.paths)
    read_bw = sum(p.bytes_per_s("read") for p in paths)
    cache = plan.host_cache_bytes or 0
    free = max(0, (host_budget(profile, workload) - pr.memory.get("host_per_node", 0)) // workload.ranks)
    ra = read_ahead_for(workload.fwd_bwd_s, read_bw, free + cache)
    if not ra:
        return pr
    try:
        cand = predict(profile, workload, plan.replace(read_ahead_bytes=ra, host_cache_bytes=cache - max(0, ra - free)))
    except ConfigError:
        return pr
    return cand if cand.iteration_s < pr.iteration_s else pr


def alternatives(profile: Profile, workload: Workload, paths: Sequence[str] | None = None) -> list[Prediction]:
    """The best plan first, then a few of ours for comparison, then stock DeepSpeed's.

    Ours: the engine's defaults (prefetch 2, concurrency 4, stripes by bandwidth, host cache
    as the budget allows); the best plan without the device lane; the best with state also kept
    on the GPU (``device_cache``); the best with all state on storage. Stock: ZeRO-3 CPU
    offload, ZeRO-Infinity NVMe, Twin-Flow (see :func:`~perf.stock.stock_deepspeed`); those that
    do not fit are kept, marked infeasible.
    """
    wl = workload
    best = best_plan(profile, wl, paths)
    cands = _candidate_paths(profile, paths)
    n = min(wl.subgroup_numel, wl.params_per_rank)
    budget_rank = host_budget(profile, wl) // wl.ranks
    fb = payload_bytes(n) + HEADER_BYTES
    out = [best]

    def add(make) -> None:
        try:
            pr = make()
        except ConfigError:
            return
        if all(_placement_and_knobs(pr.plan, wl) != _placement_and_knobs(o.plan, wl) for o in out):
            out.append(pr)

    knobs = Knobs(stripe_weights={p.path: default_weight(p) for p in cands})
    defaults = Plan(
        host_cache_bytes=max(0, budget_rank - staging_buffers(knobs.prefetch_depth) * fb), knobs=knobs, name="engine defaults"
    )
    if cands:
        add(lambda: predict(profile, wl, defaults))
    if best.plan.knobs.device_fraction > 0:
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
    host = prefix_fit(plan.host_cache_bytes, 0, N, payload_bytes(n), payload_bytes(P - (N - 1) * n))
    k = plan.knobs
    return (
        host,
        plan.device_cache_bytes,
        k.device_fraction,
        k.prefetch_depth,
        sorted(k.io_concurrency.items()),
        sorted(k.stripe_weights.items()),
        k.node_lock,
    )


# -- the search ---------------------------------------------------------------------------------


def _candidate_paths(profile: Profile, paths: Sequence[str] | None) -> list[PathProfile]:
    if paths is None:
        return list(profile.paths)
    out = []
    for name in paths:
        p = profile.path(name)
        if p is None:
            raise ConfigError(
                f"path {name} is not in profile {profile.name!r} (its paths: "
                f"{sorted(q.path for q in profile.paths) or 'none'}): measure it with "
                f"`offloadctl profile save --nvme {name}`"
            )
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
        key = device_key(p)
        dev = Device.of(p)
        cs = sorted(set(CONCURRENCIES) | {s.concurrency for s in p.sweep if 1 <= s.concurrency <= 64})

        # Seconds to read and write one byte at c requests per rank (all ranks, or one with the lock).
        unit = {
            c: device_time(dev, 1.0, 1.0, c if lock else ranks * c, c if lock else ranks * c, CHUNK_BYTES)[0]
            for c in set(cs) | {Knobs.DEFAULT_IO_CONCURRENCY}
        }
        best = min(unit[c] for c in cs)
        c = next(c for c in cs if unit[c] <= best * 1.02) if p.sweep else Knobs.DEFAULT_IO_CONCURRENCY
        conc[p.path] = c
        weights[p.path] = 0.0 if key in seen else 2.0 / unit[c]
        seen.add(key)
    return conc, weights


def _device_caches(profile: Profile, wl: Workload, n: int, state_rank: int, device_cache: bool) -> list[int]:
    """Device-tier sizes to try: none; with ``device_cache``, all state when it and its gradients
    fit the headroom, else what the headroom leaves beside the device lane, and less (the lane's
    own gradients need room too)."""
    dev_caches = [0]
    if device_cache and profile.gpu is not None:
        headroom = gpu_headroom(profile, wl)
        per_byte = (STATE_BYTES_PER_ELEMENT + wl.grad_bytes) / STATE_BYTES_PER_ELEMENT
        if state_rank * per_byte <= headroom:
            dev_caches.append(state_rank)
        room = (headroom - device_lane_working_bytes(n)) / per_byte
        pay_n = payload_bytes(n)
        dev_caches += sorted({int(room * k // pay_n) * pay_n for k in (1.0, 0.75, 0.5) if room * k >= pay_n})
    return dev_caches


def _search(
    profile: Profile,
    wl: Workload,
    paths: Sequence[str] | None,
    *,
    name: str,
    device_lane: bool = True,
    device_cache: bool = False,
    host: Literal["budget", "none"] = "budget",
) -> Prediction:
    """:func:`best_plan`'s search; ``device_lane=False`` keeps the fraction at 0, ``host="none"``
    keeps every subgroup on storage."""
    check_profile(profile)
    cands = _candidate_paths(profile, paths)
    P = wl.params_per_rank
    n = min(wl.subgroup_numel, P)
    budget_rank = host_budget(profile, wl) // wl.ranks
    fb = payload_bytes(n) + HEADER_BYTES
    lane_ok = device_lane and profile.gpu is not None and gpu_headroom(profile, wl) >= device_lane_working_bytes(n)
    fractions = FRACTIONS if lane_ok else (0.0,)
    state_rank = payload_bytes(n) * (-(-P // n))
    dev_caches = _device_caches(profile, wl, n, state_rank, device_cache)
    preds: list[tuple[tuple, Prediction]] = []
    refusals: list[ConfigError] = []

    def consider(plan: Plan) -> None:
        try:
            pr = predict(profile, wl, plan)
        except ConfigError as e:
            refusals.append(e)
            return
        k = plan.knobs
        preds.append(((pr.update_s, plan.device_cache_bytes > 0, k.prefetch_depth, k.device_fraction, k.node_lock), pr))

    if host == "budget" and state_rank <= budget_rank:
        for dc in dev_caches:
            for f in fractions:
                consider(
                    Plan(
                        host_cache_bytes=None, device_cache_bytes=dc, knobs=Knobs(device_fraction=f, prefetch_depth=0), name=name
                    )
                )
    if cands:
        for lock in (False, True) if wl.ranks > 1 else (False,):
            conc, weights = _tune_paths(cands, wl.ranks, lock)
            for d in DEPTHS:
                cache = budget_rank - staging_buffers(d) * fb
                if cache < 0:
                    continue
                for dc in dev_caches:
                    for f in fractions:
                        knobs = Knobs(
                            device_fraction=f, prefetch_depth=d, io_concurrency=conc, stripe_weights=weights, node_lock=lock
                        )
                        consider(
                            Plan(host_cache_bytes=cache if host == "budget" else 0, device_cache_bytes=dc, knobs=knobs, name=name)
                        )
    if preds:
        # Within 1% of the fastest, the simplest plan: less prefetch memory, no device lane, no lock.
        fastest = min(k[0] for k, _ in preds)
        return min((kp for kp in preds if kp[0][0] <= fastest * 1.01 + 1e-12), key=lambda kp: kp[0][1:] + kp[0][:1])[1]
    raise _no_plan(profile, wl, name, refusals, bool(cands), state_rank, budget_rank, n, fb)


def _no_plan(
    profile: Profile,
    wl: Workload,
    name: str,
    refusals: list[ConfigError],
    has_paths: bool,
    state_rank: int,
    budget_rank: int,
    n: int,
    fb: int,
) -> NoPlanFits:
    """Why no plan fits: the last refusal, or that state fits neither host memory nor a path."""
    if refusals:
        return NoPlanFits(f"no plan fits: {str(refusals[-1]).replace(f'plan {name!r} ', '', 1)}")
    if not has_paths:
        return NoPlanFits(
            f"{gb(state_rank * wl.ranks)} of optimizer state per node does not fit the host memory budget "
            f"of {gb(budget_rank * wl.ranks)} and profile {profile.name!r} has no storage paths: measure "
            f"a profile with `offloadctl profile save --nvme PATH`, or raise --host-memory"
        )
    staging = staging_buffers(0)
    return NoPlanFits(
        f"the host memory budget of {gb(budget_rank * wl.ranks)} per node does not hold the {staging} "
        f"staging buffers of a {n}-element subgroup per rank ({gb(staging * fb * wl.ranks)}): raise "
        f"--host-memory or lower the subgroup size"
    )
