"""A recording fake of the engine's streams (``engine.streams.Streams``) for CPU tests of the
GPU path's ordering.

Copies run at once, on the CPU, so results are real; each copy is also recorded with the stream
it was issued on and a vector clock, and every ``wait_event``, ``wait_stream``, ``record`` and
``synchronize`` moves the clocks as CUDA orders work: an operation X happens before a point
whose clock is C when ``C[X.stream] >= X.seq``. A host sync (an event's or a stream's
``synchronize``) moves the host's clock, which every later operation inherits (work issued
after a host wait starts after what was waited for).

Tensors named with :meth:`RecordingStreams.mark_device` play the device's memory (the model's
weights, gradients kept on the GPU); everything else is host memory. So with ``device='cpu'``
the engine runs its CUDA code path (uploads through staging, gradients copied in with the
state) and the test checks what each wait orders. Safe to use from several threads (the host
lane's): the stream a thread made current is its own, and every operation holds one lock.
"""

from __future__ import annotations

import contextlib
import threading
from dataclasses import dataclass

import torch


def _merge(into: dict[str, int], other: dict[str, int]) -> None:
    for k, v in other.items():
        if into.get(k, 0) < v:
            into[k] = v


def _span(t: torch.Tensor) -> tuple[int, int]:
    start = t.data_ptr()
    return start, start + t.numel() * t.element_size()


@dataclass
class Copy:
    stream: str
    seq: int
    clock: dict[str, int]
    dst: tuple[int, int]
    src: tuple[int, int]
    to_device: bool
    """The destination is marked device memory."""

    def before(self, clock: dict[str, int]) -> bool:
        """This copy happens before a point with ``clock``."""
        return clock.get(self.stream, 0) >= self.seq


class FakeEvent:
    def __init__(self, owner: "RecordingStreams", clock: dict[str, int], blocking: bool) -> None:
        self.owner, self.clock, self.blocking = owner, dict(clock), blocking

    def synchronize(self) -> None:
        with self.owner.lock:
            _merge(self.owner.host, self.clock)
            self.owner.ops.append(("wait", dict(self.owner.host)))

    def query(self) -> bool:
        return True


class FakeStream:
    def __init__(self, owner: "RecordingStreams", name: str) -> None:
        self.owner, self.name = owner, name
        self.clock: dict[str, int] = {name: 0}

    def wait_event(self, event: FakeEvent) -> None:
        with self.owner.lock:
            _merge(self.clock, event.clock)

    def wait_stream(self, stream: "FakeStream") -> None:
        with self.owner.lock:
            _merge(self.clock, stream.clock)

    def synchronize(self) -> None:
        with self.owner.lock:
            _merge(self.owner.host, self.clock)
            self.owner.ops.append(("wait", dict(self.owner.host)))

    def query(self) -> bool:
        return True

    def __repr__(self) -> str:
        return f"FakeStream({self.name})"


class RecordingStreams:
    """``engine.streams.Streams`` for device 'cpu', recording (module docstring)."""

    pins_host_memory = True  # as on CUDA (pinning itself is a no-op without CUDA)

    def __init__(self, device: torch.device | str = "cpu") -> None:
        self.device = torch.device(device)
        self.host: dict[str, int] = {}
        self.default = FakeStream(self, "default")
        self.streams = [self.default]
        self.lock = threading.RLock()
        self._local = threading.local()  # the stream each thread made current
        self.copies: list[Copy] = []
        self.events: list[FakeEvent] = []
        """Every event made (one per ``record`` without an event to record again)."""
        self.recorded = 0
        """Every ``record`` call, new event or not."""
        self.ops: list[tuple[str, object]] = []
        """In program order: ("copy", its index in ``copies``) and ("wait", the host's clock after a host sync)."""
        self._device_storages: set[int] = set()

    # -- the seam ------------------------------------------------------------------------------

    def new_stream(self) -> FakeStream:
        with self.lock:
            s = FakeStream(self, f"s{len(self.streams)}")
            self.streams.append(s)
            return s

    def current(self) -> FakeStream:
        return self.default

    @contextlib.contextmanager
    def use(self, stream: FakeStream):
        prev = getattr(self._local, "active", None)
        self._local.active = stream
        try:
            yield
        finally:
            self._local.active = prev

    def record(self, stream: FakeStream, event: FakeEvent | None = None) -> FakeEvent:
        """As CUDA's: a new event, or ``event`` recorded again (waits queued on it before keep
        the clock they merged then)."""
        with self.lock:
            if event is not None:
                event.clock = dict(stream.clock)
                self.recorded += 1
                return event
            ev = FakeEvent(self, stream.clock, blocking=True)
            self.events.append(ev)
            self.recorded += 1
            return ev

    def copy(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        s = getattr(self._local, "active", None) or self.default
        with self.lock:
            _merge(s.clock, self.host)  # issued after whatever the host waited for
            s.clock[s.name] = s.clock.get(s.name, 0) + 1
            self.copies.append(Copy(s.name, s.clock[s.name], dict(s.clock), _span(dst), _span(src), self.on_device(dst)))
            self.ops.append(("copy", len(self.copies) - 1))
            dst.copy_(src)

    def on_device(self, t: torch.Tensor) -> bool:
        return t.untyped_storage().data_ptr() in self._device_storages

    def in_host_memory(self, t: torch.Tensor) -> bool:
        return not self.on_device(t)

    def synchronize(self) -> None:
        with self.lock:
            for s in self.streams:
                _merge(self.host, s.clock)
            self.ops.append(("wait", dict(self.host)))

    # -- for the tests ---------------------------------------------------------------------------

    def mark_device(self, *tensors: torch.Tensor) -> None:
        """Treat these tensors' storages as device memory."""
        for t in tensors:
            self._device_storages.add(t.untyped_storage().data_ptr())

    def writes_to(self, t: torch.Tensor) -> list[Copy]:
        lo, hi = _span(t)
        return [c for c in self.copies if c.dst[0] < hi and lo < c.dst[1]]

    def first_wait_for(self, k: int) -> int | None:
        """Position in ``ops`` of the first host sync after which copy ``k`` is known done."""
        c = self.copies[k]
        return next((n for n, (kind, x) in enumerate(self.ops) if kind == "wait" and c.before(x)), None)

    def position(self, k: int) -> int:
        """Position in ``ops`` of copy ``k``'s issue."""
        return self.ops.index(("copy", k))

    def races(self) -> list[tuple[Copy, Copy]]:
        """Pairs of copies that touch the same bytes, one of them writing, on different streams,
        with neither ordered before the other."""
        out = []
        for j, b in enumerate(self.copies):
            for a in self.copies[:j]:
                if a.stream == b.stream or a.before(b.clock):
                    continue
                if _overlap(a.dst, b.dst) or _overlap(a.dst, b.src) or _overlap(a.src, b.dst):
                    out.append((a, b))
        return out


def _overlap(x: tuple[int, int], y: tuple[int, int]) -> bool:
    return x[0] < y[1] and y[0] < x[1]
