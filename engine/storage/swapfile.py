"""The on-storage format of one subgroup's swap file, and its checksums.

A swap file is the image of a :class:`StateBuffer`: a 4096-byte header, then the payload.
The payload is moved in chunks that run in parallel; each chunk has its own CRC32, computed in
the I/O thread that moves it (zlib releases the GIL, ~4 GB/s per core here). The header
holds every chunk's CRC and a generation number and is written after the payload, so a torn
or stale file fails verification instead of being read as state.
"""

from __future__ import annotations

import struct
import zlib
from dataclasses import dataclass

import torch

from engine.errors import CorruptSwapFileError
from engine.layout import HEADER_BYTES, SWAP_HEADER_FIXED, chunk_bytes_for

MAGIC = b"OFLDSWP1"
_FIXED = SWAP_HEADER_FIXED
VERSION = 1


@dataclass(frozen=True)
class ChunkPlan:
    """How a payload is split into I/O requests."""

    chunk_bytes: int
    payload_bytes: int

    @classmethod
    def for_payload(cls, payload_bytes: int, preferred_chunk_bytes: int) -> "ChunkPlan":
        return cls(chunk_bytes_for(payload_bytes, preferred_chunk_bytes), payload_bytes)

    def chunks(self) -> list[tuple[int, int]]:
        """(offset within payload, length) of each chunk."""
        return [(o, min(self.chunk_bytes, self.payload_bytes - o)) for o in range(0, self.payload_bytes, self.chunk_bytes)]


def crc32(t: torch.Tensor) -> int:
    return zlib.crc32(memoryview(t.numpy()))  # type: ignore[arg-type]  # numpy: no __buffer__ in its stubs before 3.12


def write_header(header: torch.Tensor, *, index: int, numel: int, plan: ChunkPlan, generation: int, crcs: list[int]) -> None:
    body = _FIXED.pack(MAGIC, VERSION, 0, index, numel, plan.payload_bytes, generation, plan.chunk_bytes, len(crcs))
    body += struct.pack(f"<{len(crcs)}I", *crcs)
    header.zero_()
    header[: len(body)].copy_(torch.frombuffer(bytearray(body), dtype=torch.uint8))


def verify(
    header: torch.Tensor, *, path: str, index: int, numel: int, plan: ChunkPlan, generation: int, crcs: list[int] | None
) -> None:
    """Raise :class:`CorruptSwapFileError` unless the header read from ``path`` is the one last
    written for this subgroup and (when ``crcs`` is given) every chunk's CRC matches it."""
    raw = bytes(header[: _FIXED.size].numpy())
    magic, version, _, f_index, f_numel, f_payload, f_gen, f_chunk, n = _FIXED.unpack(raw)
    fix = "the swap file was changed or damaged outside offloadctl; restore from your last checkpoint"
    if magic != MAGIC or version != VERSION:
        raise CorruptSwapFileError(f"swap file {path} has no valid header (expected {MAGIC!r} v{VERSION}): {fix}")
    expect = (index, numel, plan.payload_bytes, generation, plan.chunk_bytes)
    if (f_index, f_numel, f_payload, f_gen, f_chunk) != expect:
        raise CorruptSwapFileError(
            f"swap file {path} holds subgroup {f_index} generation {f_gen}, expected subgroup {index} "
            f"generation {generation}: {fix}"
        )
    if crcs is None:
        return
    stored = struct.unpack_from(f"<{n}I", bytes(header[_FIXED.size : _FIXED.size + 4 * n].numpy()))
    if n != len(crcs) or any(a != b for a, b in zip(stored, crcs)):
        bad = next((i for i, (a, b) in enumerate(zip(stored, crcs)) if a != b), min(n, len(crcs)))
        off = HEADER_BYTES + bad * plan.chunk_bytes
        raise CorruptSwapFileError(f"swap file {path} fails its checksum at byte offset {off}: {fix}")
