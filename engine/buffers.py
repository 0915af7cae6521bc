"""Host memory for subgroup state, laid out so that one buffer is one swap file.

A :class:`StateBuffer` is one 4096-byte-aligned allocation::

    [ header (4096 B) | master fp32 | exp_avg fp32 | exp_avg_sq fp32 | pad to 4096 ]

The same bytes go to storage with O_DIRECT, which needs aligned addresses and lengths, so the
header and payload are written from and read into this buffer with no extra copy. Buffers are
pinned when CUDA is present, so that the device lane's copies run asynchronously.
"""
from __future__ import annotations

import torch

ALIGN_BYTES = 4096
HEADER_BYTES = 4096
STATE_BYTES_PER_ELEMENT = 12  # fp32 master + exp_avg + exp_avg_sq


def round_up(n: int, to: int = ALIGN_BYTES) -> int:
    return (n + to - 1) // to * to


def payload_bytes(numel: int) -> int:
    """Bytes on storage for a subgroup's state, padded for O_DIRECT."""
    return round_up(STATE_BYTES_PER_ELEMENT * numel)


def aligned_empty(nbytes: int, *, pin: bool) -> torch.Tensor:
    """An uninitialised uint8 tensor of ``nbytes`` whose address is 4096-aligned."""
    if pin:
        t = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
        if t.data_ptr() % ALIGN_BYTES == 0:  # cudaHostAlloc returns page-aligned memory
            return t
        raw = torch.empty(nbytes + ALIGN_BYTES, dtype=torch.uint8, pin_memory=True)
    else:
        raw = torch.empty(nbytes + ALIGN_BYTES, dtype=torch.uint8)
    off = (-raw.data_ptr()) % ALIGN_BYTES
    return raw[off:off + nbytes]


class StateBuffer:
    """One subgroup's state in host memory; see the module docstring for the layout.

    A buffer has a capacity and is bound to one subgroup's ``numel`` at a time, so staging
    buffers can be reused by subgroups of different sizes.
    """

    def __init__(self, capacity_numel: int, *, pin: bool) -> None:
        self.capacity_numel = capacity_numel
        self.raw = aligned_empty(HEADER_BYTES + payload_bytes(capacity_numel), pin=pin)
        self.header = self.raw[:HEADER_BYTES]
        self.bind(capacity_numel)
        # Set while an asynchronous device-lane copy back into this buffer may still run; the
        # buffer is not read, written to storage or reused before it completes.
        self.ready_event = None

    def bind(self, numel: int) -> None:
        if numel > self.capacity_numel:
            raise ValueError(f"subgroup of {numel} elements does not fit a buffer of {self.capacity_numel}")
        self.numel = numel
        self.payload = self.raw[HEADER_BYTES:HEADER_BYTES + payload_bytes(numel)]
        state = self.raw[HEADER_BYTES:HEADER_BYTES + STATE_BYTES_PER_ELEMENT * numel].view(torch.float32)
        self.state = state  # master, exp_avg and exp_avg_sq back to back: one H2D/D2H copy
        self.master, self.exp_avg, self.exp_avg_sq = state.split(numel)

    @property
    def file_image(self) -> torch.Tensor:
        """Header and payload: exactly the bytes of the swap file."""
        return self.raw[:HEADER_BYTES + self.payload.numel()]

    def wait_ready(self) -> None:
        """Block until any device-lane copy into this buffer has landed."""
        ev, self.ready_event = self.ready_event, None
        if ev is not None:
            ev.synchronize()

    @property
    def nbytes(self) -> int:
        return self.raw.numel()
