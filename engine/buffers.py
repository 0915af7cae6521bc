"""Host memory for subgroup state, laid out so that one buffer is one swap file.

A :class:`StateBuffer` is one 4096-byte-aligned allocation::

    [ header (4096 B) | master fp32 | exp_avg fp32 | exp_avg_sq fp32 | pad to 4096 ]

The same bytes go to storage with O_DIRECT, which needs aligned addresses and lengths, so the
header and payload are written from and read into this buffer with no extra copy.

Host memory is allocated at its exact size and pinned in place, on demand (:func:`pin_in_place`:
``cudaHostRegister``), only for buffers whose state crosses PCIe (the device lane). torch's
pinned allocator rounds every block up to a power of two and keeps it cached: a 1.2 GB subgroup
would take 2 GiB of locked memory.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import weakref
from typing import Iterator

import torch

from engine.streams import Event

log = logging.getLogger(__name__)

# The layout's figures are engine.layout's (torch-free, so the performance model shares them).
from engine.layout import ALIGN_BYTES, HEADER_BYTES, STATE_BYTES_PER_ELEMENT, payload_bytes, round_up  # noqa: E402,F401


def aligned_empty(nbytes: int, *, pin: bool = False) -> torch.Tensor:
    """An uninitialised uint8 tensor of exactly ``nbytes`` (plus alignment) whose address is
    4096-aligned; pinned in place when ``pin`` and CUDA is present."""
    raw = torch.empty(nbytes + ALIGN_BYTES, dtype=torch.uint8)
    off = (-raw.data_ptr()) % ALIGN_BYTES
    t = raw[off : off + nbytes]
    if pin:
        pin_in_place(t)
    return t


_pin_failed_once = False
_registered: set[int] = set()
"""Start addresses pinned by :func:`pin_in_place` and not yet released. (``is_pinned()`` looks
at a storage's base address, which an aligned view starts after, so it cannot tell.)"""
_finalizers: dict[int, weakref.finalize[[int], torch.UntypedStorage]] = {}
_lock = threading.Lock()
_defer_depth = 0
_deferred: list[torch.Tensor] = []
"""Pinned memory whose owner died while unpins were deferred (:func:`unpins_deferred`): kept
alive, still registered, until :func:`release_deferred_unpins`."""


def _cuda_pins() -> bool:
    return torch.cuda.is_available()


def _host_register(ptr: int, nbytes: int) -> int:
    return int(torch.cuda.cudart().cudaHostRegister(ptr, nbytes, 0))  # type: ignore[no-untyped-call]  # torch: untyped


def _host_unregister(ptr: int) -> None:
    torch.cuda.cudart().cudaHostUnregister(ptr)  # type: ignore[no-untyped-call]  # torch: untyped


def _unregister(ptr: int) -> None:
    # A finalizer of the storage's Python object (or of the buffer that owns the pin): its weak
    # references are cleared (and this runs) before the storage's memory is freed.
    _registered.discard(ptr)
    _finalizers.pop(ptr, None)
    with contextlib.suppress(Exception):  # interpreter shutdown: the driver releases it with the process
        _host_unregister(ptr)


def pin_in_place(t: torch.Tensor) -> bool:
    """Page-lock ``t``'s memory where it is (``cudaHostRegister``), exact size, until ``t``'s
    storage is freed (or its owner dies: :func:`tie_pin_to`). False when CUDA is absent or the
    driver refuses (the copies then run synchronously through the driver's bounce buffer:
    slower, still correct)."""
    global _pin_failed_once
    if not _cuda_pins() or t.device.type != "cpu" or t.numel() == 0:
        return False
    if t.data_ptr() in _registered:
        return True
    nbytes = t.numel() * t.element_size()
    err = _host_register(t.data_ptr(), nbytes)
    if err != 0:
        if not _pin_failed_once:
            log.warning(
                "could not pin %d bytes of host memory (cudaHostRegister error %s): device-lane copies of "
                "these buffers run synchronously; raise `ulimit -l` to fix",
                nbytes,
                err,
            )
            _pin_failed_once = True
        return False
    _registered.add(t.data_ptr())
    _finalizers[t.data_ptr()] = weakref.finalize(t.untyped_storage(), _unregister, t.data_ptr())
    return True


def tie_pin_to(t: torch.Tensor, owner: object) -> None:
    """``t``'s pin (:func:`pin_in_place`) ends when ``owner`` dies, not when the storage is
    freed; ``t`` (so its memory) lives until then. An owner that dies while unpins are deferred
    (:func:`unpins_deferred`) has its memory kept, pinned, until :func:`release_deferred_unpins`:
    ``cudaHostUnregister`` may synchronize the device, so a buffer dropped inside a step (a spare
    of the device tier's refit) is not unpinned there."""
    fin = _finalizers.pop(t.data_ptr(), None)
    if fin is None or not fin.detach():
        return
    weakref.finalize(owner, _owner_died, t)


def _owner_died(t: torch.Tensor) -> None:
    with _lock:
        if _defer_depth:
            _deferred.append(t)
            return
    _unregister(t.data_ptr())


@contextlib.contextmanager
def unpins_deferred() -> Iterator[None]:
    """Within: buffers whose owners die keep their memory, pinned, for
    :func:`release_deferred_unpins` (outside the step)."""
    global _defer_depth
    with _lock:
        _defer_depth += 1
    try:
        yield
    finally:
        with _lock:
            _defer_depth -= 1


def release_deferred_unpins() -> int:
    """Unpin (and free) the memory :func:`unpins_deferred` kept; nothing while a deferral is open.
    Returns the buffers released."""
    with _lock:
        if _defer_depth or not _deferred:
            return 0
        pending = list(_deferred)
        _deferred.clear()
    for t in pending:
        _unregister(t.data_ptr())
    return len(pending)


def is_pinned_in_place(t: torch.Tensor) -> bool:
    """Whether :func:`pin_in_place` page-locked ``t`` (and it is not released)."""
    return t.data_ptr() in _registered


class StateBuffer:
    """One subgroup's state in host memory; see the module docstring for the layout.

    A buffer has a capacity and is bound to one subgroup's ``numel`` at a time, so staging
    buffers can be reused by subgroups of different sizes.
    """

    def __init__(self, capacity_numel: int, *, pin: bool = False) -> None:
        self.capacity_numel = capacity_numel
        self.raw = aligned_empty(HEADER_BYTES + payload_bytes(capacity_numel))
        self.pinned = False
        self._pin_tried = False  # a refused pin is not tried again at every update
        if pin:
            self.pin()
        self.header = self.raw[:HEADER_BYTES]
        self.bind(capacity_numel)
        # Set while an asynchronous device-lane copy back into this buffer may still run; the
        # buffer is not read, written to storage or reused before it completes.
        self.ready_event: Event | None = None

    def bind(self, numel: int) -> None:
        if numel > self.capacity_numel:
            raise ValueError(f"subgroup of {numel} elements does not fit a buffer of {self.capacity_numel}")
        self.numel = numel
        self.payload = self.raw[HEADER_BYTES : HEADER_BYTES + payload_bytes(numel)]
        state = self.raw[HEADER_BYTES : HEADER_BYTES + STATE_BYTES_PER_ELEMENT * numel].view(torch.float32)
        self.state = state  # master, exp_avg and exp_avg_sq back to back: one H2D/D2H copy
        self.master, self.exp_avg, self.exp_avg_sq = torch.split(state, numel)

    @property
    def file_image(self) -> torch.Tensor:
        """Header and payload: exactly the bytes of the swap file."""
        return self.raw[: HEADER_BYTES + self.payload.numel()]

    @property
    def pin_tried(self) -> bool:
        """Whether :meth:`pin` ran (pinned, or refused: not tried again)."""
        return self._pin_tried

    def pin(self) -> bool:
        """Page-lock this buffer in place, so device-lane copies run asynchronously. Tried once:
        where the driver refuses (``ulimit -l``), the copies run synchronously from then on."""
        if not self._pin_tried:
            self._pin_tried = True
            self.pinned = pin_in_place(self.raw)
            if self.pinned:
                tie_pin_to(self.raw, self)  # unpinned when the buffer dies, or later (unpins_deferred)
        return self.pinned

    def wait_ready(self) -> None:
        """Block until any device-lane copy into this buffer has landed."""
        ev, self.ready_event = self.ready_event, None
        if ev is not None:
            ev.synchronize()
