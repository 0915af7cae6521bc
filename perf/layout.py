"""The engine's layout as the performance model counts it: bytes of a subgroup, I/O requests
of a transfer, staging buffers, which subgroups are resident, on the device lane or swapped,
and the swap traffic of one step.

Every figure of the layout is the engine's own, imported (here and in the model's other
modules) from its torch-free modules (``engine.layout``: header, 12 B/element, chunk CRCs, kept
and staging buffers; ``engine.config``: I/O request size, default concurrency;
``engine.placement``: the stripe rule), so ``offloadctl plan`` starts without torch and the
model cannot drift from the engine.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache

from engine.config import EngineConfig
from engine.layout import HEADER_BYTES, chunk_bytes_for, payload_bytes
from engine.placement import stripe

_ENGINE_DEFAULTS = EngineConfig()

CHUNK_BYTES = _ENGINE_DEFAULTS.io_chunk_bytes
"""The engine's I/O request size (``EngineConfig.io_chunk_bytes``)."""
SUBGROUP_NUMEL = _ENGINE_DEFAULTS.subgroup_numel
"""The engine's default subgroup size (``EngineConfig.subgroup_numel``)."""
EXACT_SUBGROUPS = 512
"""Up to this many swapped subgroups the model stripes them one by one as the engine does;
above, by proportion (the difference is under one subgroup per path)."""


def chunks(numel: int) -> int:
    """I/O requests of one transfer: the payload's chunks and the header
    (``engine.storage.swapfile.ChunkPlan.for_payload``)."""
    payload = payload_bytes(numel)
    return -(-payload // chunk_bytes_for(payload, CHUNK_BYTES)) + 1


def prefix_fit(budget: int | None, start: int, N: int, pay_n: int, pay_last: int) -> int:
    """Subgroups from index ``start`` that fit ``budget`` in order (the last one may be smaller),
    as ``engine.placement.place_resident`` fills a tier."""
    left = N - start
    if left <= 0:
        return 0
    if budget is None:
        return left
    k = min(budget // pay_n, left - 1)
    if k == left - 1 and budget - k * pay_n >= pay_last:
        k += 1
    return k


def lane_count(a: int, b: int, f: float) -> int:
    """Device-lane subgroups among indices [a, b) (:func:`engine.placement.device_lane_mask`)."""
    return int(b * f + 1e-9) - int(a * f + 1e-9)


def on_device_lane(i: int, f: float) -> bool:
    """Whether subgroup ``i`` takes the device lane (:func:`engine.placement.device_lane_mask`)."""
    return int((i + 1) * f + 1e-9) > int(i * f + 1e-9)


@dataclass(frozen=True)
class Traffic:
    """One step's swap traffic of one rank: per path index, bytes read/written and misses."""

    read: tuple[float, ...]
    written: tuple[float, ...]
    misses: tuple[float, ...]
    host_misses: float
    """Misses updated on the host lane (the loop waits for their update; device-lane ones are queued)."""


@lru_cache(maxsize=4096)
def swap_traffic(
    N: int, first: int, K: int, n: int, n_last: int, weights: tuple[float, ...], f: float, held: int | None = None
) -> tuple[Traffic, Traffic]:
    """Forward- and reverse-order traffic of swapped subgroups ``first..N-1`` over weighted paths.
    ``K`` subgroups are kept unwritten across the step boundary; ``held`` (at least ``K``; default
    ``K``) are in staging buffers then and read nothing: the kept ones, and those whose writes
    landed and whose buffers no read took (``engine.transfers``), next to them in the order."""
    S = N - first
    M = S - K
    held = K if held is None else max(K, min(S, held))
    R = S - held
    fb_n = payload_bytes(n) + HEADER_BYTES
    if S > EXACT_SUBGROUPS:
        total = sum(weights)
        share = [w / total for w in weights]
        host_m = R * (1 - lane_count(first, N, f) / S)
        t = Traffic(tuple(R * fb_n * s for s in share), tuple(M * fb_n * s for s in share), tuple(R * s for s in share), host_m)
        return t, t
    idx = list(range(first, N))
    sizes = [n_last if i == N - 1 else n for i in idx]
    tiers = stripe([payload_bytes(x) for x in sizes], list(weights))
    out = []
    for reads, writes in ((range(held, S), range(0, M)), (range(0, R), range(K, S))):  # forward, reverse
        r, w, m = [0.0] * len(weights), [0.0] * len(weights), [0.0] * len(weights)
        host_m = 0
        for k in reads:
            r[tiers[k]] += payload_bytes(sizes[k]) + HEADER_BYTES
            m[tiers[k]] += 1
            host_m += not on_device_lane(idx[k], f)
        for k in writes:
            w[tiers[k]] += payload_bytes(sizes[k]) + HEADER_BYTES
        out.append(Traffic(tuple(r), tuple(w), tuple(m), host_m))
    return out[0], out[1]
