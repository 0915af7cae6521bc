"""The engine's layout as the performance model counts it: bytes of a subgroup, I/O requests
of a transfer, staging buffers, which subgroups are resident, on the device lane or swapped,
and the swap traffic of one step.

What the engine owns is imported from it where that stays torch-free (``engine.config``,
``engine.placement``): the I/O request size, the default concurrency, the stripe rule, the
device lane's working memory. The rest is owned by engine modules that import torch
(``engine.buffers``: header, alignment, 12 B/element; ``engine.storage.swapfile``: chunk CRCs
per header; ``engine.core``: kept and staging buffers per prefetch depth); ``offloadctl plan``
starts without torch, so those few figures are restated here, each naming its owner, and
``tests/test_perfmodel.py`` checks that they equal the engine's.
"""
from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache

from engine.config import EngineConfig
from engine.placement import stripe

_ENGINE_DEFAULTS = EngineConfig()

STATE_BYTES_PER_PARAM = 12
"""fp32 master, exp_avg, exp_avg_sq (``engine.buffers.STATE_BYTES_PER_ELEMENT``)."""
HEADER_BYTES = 4096
"""A swap file's header, before its payload (``engine.buffers.HEADER_BYTES``)."""
ALIGN_BYTES = 4096
"""O_DIRECT alignment of a payload (``engine.buffers.ALIGN_BYTES``)."""
_SWAP_HEADER_FIXED_BYTES = 60
"""The fixed fields of a swap-file header (``engine.storage.swapfile._FIXED.size``)."""
MAX_CHUNKS = (HEADER_BYTES - _SWAP_HEADER_FIXED_BYTES) // 4
"""Chunk CRCs that fit a swap-file header; larger payloads get larger chunks
(``engine.storage.swapfile.MAX_CHUNKS``)."""
CHUNK_BYTES = _ENGINE_DEFAULTS.io_chunk_bytes
"""The engine's I/O request size (``EngineConfig.io_chunk_bytes``)."""
SUBGROUP_NUMEL = _ENGINE_DEFAULTS.subgroup_numel
"""The engine's default subgroup size (``EngineConfig.subgroup_numel``)."""
EXACT_SUBGROUPS = 512
"""Up to this many swapped subgroups the model stripes them one by one as the engine does;
above, by proportion (the difference is under one subgroup per path)."""


def kept_subgroups(prefetch_depth: int) -> int:
    """Swapped subgroups kept in staging buffers across a step (``engine.core._kept_count``)."""
    return prefetch_depth + 1


def staging_buffers(prefetch_depth: int) -> int:
    """Staging buffers of a rank with swapped state: read ahead, updating, writing back, and the
    kept ones (``engine.core._staging_count``): ``2 d + 3``."""
    return prefetch_depth + 2 + kept_subgroups(prefetch_depth)


def pay(numel: int) -> int:
    """Bytes of a subgroup's state, padded for O_DIRECT (``engine.buffers.payload_bytes``)."""
    return -(-STATE_BYTES_PER_PARAM * numel // ALIGN_BYTES) * ALIGN_BYTES


def chunks(numel: int) -> int:
    """I/O requests of one transfer: the payload's chunks and the header
    (``engine.storage.swapfile.ChunkPlan.for_payload``)."""
    pay_, chunk = pay(numel), CHUNK_BYTES
    while -(-pay_ // chunk) > MAX_CHUNKS:
        chunk *= 2
    return -(-pay_ // chunk) + 1


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
def swap_traffic(N: int, first: int, K: int, n: int, n_last: int, weights: tuple[float, ...],
                 f: float) -> tuple[Traffic, Traffic]:
    """Forward- and reverse-order traffic of swapped subgroups ``first..N-1`` over weighted paths."""
    S = N - first
    M = S - K
    fb_n = pay(n) + HEADER_BYTES
    if S > EXACT_SUBGROUPS:
        total = sum(weights)
        share = [w / total for w in weights]
        host_m = M * (1 - lane_count(first, N, f) / S)
        t = Traffic(tuple(M * fb_n * s for s in share), tuple(M * fb_n * s for s in share),
                    tuple(M * s for s in share), host_m)
        return t, t
    idx = list(range(first, N))
    sizes = [n_last if i == N - 1 else n for i in idx]
    tiers = stripe([pay(x) for x in sizes], list(weights))
    out = []
    for reads, writes in ((range(K, S), range(0, M)), (range(0, M), range(K, S))):  # forward, reverse
        r, w, m = [0.0] * len(weights), [0.0] * len(weights), [0.0] * len(weights)
        host_m = 0
        for k in reads:
            r[tiers[k]] += pay(sizes[k]) + HEADER_BYTES
            m[tiers[k]] += 1
            host_m += not on_device_lane(idx[k], f)
        for k in writes:
            w[tiers[k]] += pay(sizes[k]) + HEADER_BYTES
        out.append(Traffic(tuple(r), tuple(w), tuple(m), host_m))
    return out[0], out[1]
