"""The engine's state layout in numbers, torch-free: the one owner of these figures.

A subgroup's state is 12 bytes per element (fp32 master, exp_avg, exp_avg_sq), padded to the
O_DIRECT alignment, behind a 4096-byte header that holds, besides fixed fields, one CRC32 per
I/O chunk. With swapped state a rank keeps ``2 d + 3`` staging buffers for a prefetch depth d.

``engine.buffers``, ``engine.storage.swapfile``, ``engine.transfers`` and ``engine.core`` build on these; the
performance model (``perf.layout``, ``perf.model``, ``perf.search``) imports them without
importing torch, so ``offloadctl plan`` starts at once.
"""

from __future__ import annotations

import struct

ALIGN_BYTES = 4096
"""O_DIRECT alignment of addresses and lengths."""
HEADER_BYTES = 4096
"""A swap file's header, before its payload."""
STATE_BYTES_PER_ELEMENT = 12
"""fp32 master + exp_avg + exp_avg_sq."""
SWAP_HEADER_FIXED = struct.Struct("<8sIIqqqqqI")
"""A swap-file header's fixed fields: magic, version, reserved, index, numel, payload,
generation, chunk, number of chunks; the chunk CRCs follow."""
MAX_CHUNKS = (HEADER_BYTES - SWAP_HEADER_FIXED.size) // 4
"""Chunk CRCs that fit the header; larger payloads get larger chunks."""


def deepest_prefetch(buffers: int) -> int:
    """The deepest prefetch whose staging buffers number at most ``buffers`` (-1: none fits)."""
    return (buffers - 3) // 2


def chunk_bytes_for(payload_bytes: int, preferred_chunk_bytes: int) -> int:
    """The I/O request size for a payload: the preferred one, doubled until every chunk's CRC
    fits the header."""
    chunk = preferred_chunk_bytes
    while -(-payload_bytes // chunk) > MAX_CHUNKS:
        chunk *= 2
    return chunk


def round_up(n: int, to: int = ALIGN_BYTES) -> int:
    return (n + to - 1) // to * to


def payload_bytes(numel: int) -> int:
    """Bytes on storage for a subgroup's state, padded for O_DIRECT."""
    return round_up(STATE_BYTES_PER_ELEMENT * numel)


def forward_order(iteration: int) -> bool:
    """Whether step ``iteration`` visits subgroups 0..N-1 (even) or N-1..0 (odd): the alternating
    order that lets each step start with what the previous one kept."""
    return iteration % 2 == 0


def step_order(subgroups: int, iteration: int) -> range:
    """The subgroups in the order step ``iteration`` visits them (:func:`forward_order`)."""
    return range(subgroups) if forward_order(iteration) else range(subgroups - 1, -1, -1)


def kept_subgroups(prefetch_depth: int) -> int:
    """Swapped subgroups kept in staging buffers across a step boundary (the head of the next
    step's reversed order)."""
    return prefetch_depth + 1


def staging_buffers(prefetch_depth: int) -> int:
    """Staging buffers: read ahead + updating + writing back, plus the kept ones."""
    return prefetch_depth + 2 + kept_subgroups(prefetch_depth)


def read_ahead_bytes(fwd_bwd_s: float, read_bytes_per_s: float) -> int:
    """The default read-ahead budget: what the paths can read while forward and backward run,
    so that the disks stay busy through them (``EngineConfig.read_ahead_bytes`` = None)."""
    return int(max(0.0, fwd_bwd_s) * max(0.0, read_bytes_per_s))


def host_buffer_bytes(numel: int) -> int:
    """Host memory one state buffer of ``numel`` elements takes: header, padded payload, and the
    slack that aligns its start for O_DIRECT."""
    return HEADER_BYTES + payload_bytes(numel) + ALIGN_BYTES
