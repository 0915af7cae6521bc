"""Streams, events and asynchronous copies behind one seam: CUDA's, or the host's.

The lanes order their work with streams and events (copy in, update, copy back, weight
uploads). They reach them only through a :class:`Streams`, so one code path runs everywhere:

- :class:`CudaStreams` on a CUDA device. Its events are blocking (``cudaEventBlockingSync``):
  a CPU thread that waits on one (an I/O thread before a write-back, the host lane before it
  reuses a staging buffer) sleeps instead of spinning a core beside the host lane's AdamW
  threads, which run at the pace of the slowest of them.
- :class:`HostStreams` on the CPU (the tests' device lane, ``OffloadAdamW`` without CUDA):
  every operation runs in order at once, so every wait is already satisfied.
- A recording fake in the tests (``tests/fake_streams.py``) that runs copies at once and keeps
  the happens-before relation, so a test can check every wait the engine makes.

``streams_for(device)`` is the one place the engine picks its implementation, and
``resolve_lane_device`` the one place a device setting becomes the lane's device.
"""

from __future__ import annotations

import contextlib
from typing import Protocol, cast

import torch

from engine.errors import ConfigError


class Event(Protocol):
    def synchronize(self) -> None:
        """Block the calling CPU thread until the work recorded before this event is done."""
        ...

    def query(self) -> bool: ...


class Stream(Protocol):
    def wait_event(self, event: Event) -> None:
        """Work queued on this stream from now on starts after ``event``."""
        ...

    def wait_stream(self, stream: "Stream") -> None:
        """Work queued on this stream from now on starts after everything queued on ``stream`` so far."""
        ...

    def synchronize(self) -> None: ...


class Streams(Protocol):
    """What the lanes need of a device's streams."""

    device: torch.device
    pins_host_memory: bool
    """Host memory a copy reads or writes must be page-locked for the copy to be asynchronous."""

    def new_stream(self) -> Stream: ...

    def current(self) -> Stream:
        """The stream the caller's own work (DeepSpeed's, the next forward) runs on."""
        ...

    def use(self, stream: Stream) -> contextlib.AbstractContextManager[None]:
        """Make ``stream`` current for the work queued inside the block."""
        ...

    def record(self, stream: Stream, event: Event | None = None) -> Event:
        """An event marking everything queued on ``stream`` so far. With ``event`` (one this
        returned before), that event is recorded again and returned: no new one. A ring slot
        keeps one (:class:`engine.host_lane.PinnedRing`, the device lane's slots), so a step
        makes events per slot, not per chunk (thousands of chunks a step at 4B). Waits queued
        on it before (``wait_event``) keep the point it marked then; a host wait after it
        waits for the new point."""
        ...

    def copy(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        """``dst.copy_(src)`` on the current stream, asynchronous where the memory allows."""
        ...

    def on_device(self, t: torch.Tensor) -> bool:
        """Whether ``t`` is in the device's memory (read there in place, no copy in)."""
        ...

    def in_host_memory(self, t: torch.Tensor) -> bool:
        """Whether ``t`` is in host memory (written there by the CPU in place, no upload)."""
        ...

    def synchronize(self) -> None:
        """Block the calling thread until everything queued on the device is done."""
        ...


class CudaStreams:
    """torch.cuda's streams for one device, with blocking events."""

    pins_host_memory = True

    def __init__(self, device: torch.device) -> None:
        if device.index is None:  # resolve_lane_device gives an index; anything else means the current device
            device = torch.device("cuda", torch.cuda.current_device())
        self.device = device

    def new_stream(self) -> "torch.cuda.Stream":
        return torch.cuda.Stream(self.device)  # type: ignore[no-untyped-call]  # torch: untyped __new__

    def current(self) -> "torch.cuda.Stream":
        return torch.cuda.current_stream(self.device)

    def use(self, stream: torch.cuda.Stream) -> torch.cuda.StreamContext:
        return torch.cuda.stream(stream)

    def record(self, stream: torch.cuda.Stream, event: torch.cuda.Event | None = None) -> "torch.cuda.Event":
        # a host wait sleeps (docstring); torch's Event has an untyped __new__
        ev = event if event is not None else torch.cuda.Event(blocking=True)  # type: ignore[no-untyped-call]
        ev.record(stream)
        return ev

    def copy(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        dst.copy_(src, non_blocking=True)

    def on_device(self, t: torch.Tensor) -> bool:
        return t.device.type == "cuda" and t.device.index == self.device.index

    def in_host_memory(self, t: torch.Tensor) -> bool:
        return t.device.type == "cpu"

    def synchronize(self) -> None:
        torch.cuda.synchronize(self.device)


class _HostStream:
    """The host's one stream, and every event on it: work is done as it is queued."""

    def wait_event(self, event: Event) -> None:
        pass

    def wait_stream(self, stream: Stream) -> None:
        pass

    def synchronize(self) -> None:
        pass

    def query(self) -> bool:
        return True


class HostStreams:
    """The host as a device: everything runs at once, in program order."""

    pins_host_memory = False

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self._stream = _HostStream()

    def new_stream(self) -> _HostStream:
        return self._stream

    def current(self) -> _HostStream:
        return self._stream

    def use(self, stream: Stream) -> contextlib.nullcontext[None]:
        return contextlib.nullcontext()

    def record(self, stream: Stream, event: Event | None = None) -> Event:
        return event if event is not None else self._stream

    def copy(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        dst.copy_(src)

    # The host's memory is the device's: read in place, written in place, never copied.
    def on_device(self, t: torch.Tensor) -> bool:
        return t.device.type == "cpu"

    def in_host_memory(self, t: torch.Tensor) -> bool:
        return t.device.type == "cpu"

    def synchronize(self) -> None:
        pass


def streams_for(device: torch.device) -> Streams:
    """The streams of ``device``: CUDA's on a CUDA device, the host's otherwise."""
    # CudaStreams takes back only the streams and events it made: torch's, which wait on torch's alone.
    return cast(Streams, CudaStreams(device)) if device.type == "cuda" else HostStreams(device)


def resolve_lane_device(device: str | None) -> torch.device | None:
    """The device of the device lane for a setting (``EngineConfig.device``, ``--lane-device``):
    the one given, checked; None: the current CUDA device, or no device lane without CUDA."""
    if device is None:
        return torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else None
    d = torch.device(device)
    if d.type == "cuda" and not torch.cuda.is_available():
        raise ConfigError(f"device={device!r} but CUDA is not available here: use device=None or 'cpu'")
    if d.type == "cuda" and d.index is None:
        # 'cuda' is the current device, with its index: tensors there say cuda:N, and a lane
        # device without one would compare unequal to them (nothing read in place, every
        # gradient and weight copied through the host).
        d = torch.device("cuda", torch.cuda.current_device())
    return d
