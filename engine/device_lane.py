"""The device lane (:class:`DeviceLane`, Deep Optimizer States): AdamW on the device, in chunks.

In chunks of ``DEVICE_LANE_CHUNK_NUMEL`` elements through ``DEVICE_LANE_SLOTS`` device slots: a
chunk's fp32 state (and its gradient, when in host memory) is copied in on ``h2d``, updated on
``compute`` and copied back on ``d2h``, so both PCIe directions and the update run at once, beside
the host lane; the lane's device memory is its slots, whatever the subgroup size. An event on the
host buffer orders every later use of it after its copy back. Gradients DeepSpeed keeps on the
GPU are read where they are. The device tier's resident state is updated on a stream of its own
(``resident``), so it never queues behind the lane's copies. The lanes together:
:mod:`engine.lanes` and ``docs/engine.md``.
"""

from __future__ import annotations

import weakref

import torch

from engine.adamw import AdamWHyper, adamw_update_torch_
from engine.binding import SubgroupBinding, flat_weights_of, weights_written
from engine.buffers import StateBuffer, release_deferred_unpins
from engine.lanes import Scratch, SubgroupGrads
from engine.placement import DEVICE_LANE_CHUNK_NUMEL, DEVICE_LANE_SLOTS
from engine.streams import Event, Stream, Streams


class LaneSlot:
    """One chunk-sized device buffer of the device lane (state, gradient, weights) and its
    events, each made once and recorded again for every chunk through the slot: ``loaded``
    (its copy in), ``updated`` (its update) and ``free`` (its copy out, which orders its reuse)."""

    def __init__(self, device: torch.device, chunk_numel: int) -> None:
        self.chunk_numel = chunk_numel
        self.state = torch.empty(3 * chunk_numel, dtype=torch.float32, device=device)
        # Raw bytes, viewed as the gradient's or the weights' dtype (4 bytes per element at most).
        self.grad = torch.empty(4 * chunk_numel, dtype=torch.uint8, device=device)
        self.weights = torch.empty(4 * chunk_numel, dtype=torch.uint8, device=device)
        self.free: Event | None = None
        self.loaded: Event | None = None
        self.updated: Event | None = None

    def views(self, m: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        c = self.chunk_numel
        return self.state[:m], self.state[c : c + m], self.state[2 * c : 2 * c + m]

    @staticmethod
    def typed(raw: torch.Tensor, dtype: torch.dtype, m: int) -> torch.Tensor:
        return raw.view(dtype)[:m]


class DeviceLane:
    """Updates subgroups on ``device``: staged from host buffers through chunk slots, or resident there."""

    def __init__(
        self, streams: Streams, capacity_numel: int, slots: int = DEVICE_LANE_SLOTS, chunk_numel: int = DEVICE_LANE_CHUNK_NUMEL
    ) -> None:
        self.streams, self.device = streams, streams.device
        self.capacity_numel = capacity_numel
        self.chunk_numel = max(1, min(chunk_numel, capacity_numel))
        self.n_slots = max(1, slots)
        self.h2d, self.compute, self.d2h = streams.new_stream(), streams.new_stream(), streams.new_stream()
        self.resident = streams.new_stream()
        self._slots: list[LaneSlot] = []  # allocated at the first staged update
        self._next = 0
        self._grad = Scratch(self.device)  # the compute stream's fp32 gradient chunk
        self._resident_grad = Scratch(self.device)  # the resident stream's
        self._pin_next: dict[int, weakref.ref[StateBuffer]] = {}  # buffers to pin at the next step's start

    @property
    def weight_streams(self) -> tuple[Stream, Stream]:
        """The lane's streams that write weights the model reads."""
        return self.compute, self.resident

    def begin_step(self) -> None:
        # Everything the step reads (gradients, weights) was produced by backward on DeepSpeed's
        # or the default stream, and host-lane gradients were copied out by it: let all of it land.
        # (The step's end joins the weight streams and waits for the lane: SubgroupEngine._end_streams.)
        self.streams.synchronize()  # the step's first sync: the host after backward's work on the device
        self.pin_deferred()

    def pin_deferred(self) -> None:
        """Page-lock the buffers an update found pageable (:meth:`update_staged`), with no copy
        of the lane in flight (after the sync at the step's start, or between steps)."""
        refs, self._pin_next = self._pin_next, {}
        for ref in refs.values():
            buf = ref()
            if buf is not None:
                buf.pin()

    def release(self) -> None:
        """Free the slots and scratches (after :meth:`sync`); they are made again when needed."""
        self.sync()  # no copy or update still uses a slot
        self._slots = []
        self._grad = Scratch(self.device)
        self._resident_grad = Scratch(self.device)

    def sync(self) -> None:
        """Wait for everything queued on the lane's streams."""
        for s in (self.h2d, self.compute, self.d2h, self.resident):
            s.synchronize()  # the host after the stream's last copy or update
        # The lane is idle (at the step's end, or a release): what a refit freed is unpinned now,
        # where cudaHostUnregister has nothing of the lane's to wait for (engine.buffers.tie_pin_to).
        release_deferred_unpins()

    # -- the device tier: state resident on the device ------------------------------------------

    def seed_resident(self, state: torch.Tensor, binding: SubgroupBinding) -> None:
        """First state of a device-tier subgroup: master from the weights, zero moments; on
        the resident stream, ahead of the subgroup's update."""
        with self.streams.use(self.resident):
            n = binding.numel
            binding.read_weights(state[:n])
            state[n : 3 * n].zero_()

    def update_resident(self, state: torch.Tensor, binding: SubgroupBinding, steps: list[int], hyper: AdamWHyper) -> int:
        """Update state that lives on the device (the device tier), chunk by chunk through the
        resident stream's gradient scratch: no transfers."""
        grads = SubgroupGrads(binding, steps)
        if not grads.runs:
            return 0
        n = binding.numel
        master, exp_avg, exp_avg_sq = torch.split(state[: 3 * n], n)
        flat = flat_weights_of(binding)
        with self.streams.use(self.resident):
            for a in range(0, n, self.chunk_numel):
                b = min(n, a + self.chunk_numel)
                g = self._grad_chunk(grads, a, b, self._resident_grad, None)
                adamw_update_torch_(grads.slices_for(a, b, master[a:b], g, exp_avg[a:b], exp_avg_sq[a:b], steps), hyper)
                self._write_weights(binding, flat, master[a:b], a)
        weights_written(binding)
        return grads.advance(steps)

    # -- the device lane: state staged from host memory ------------------------------------------

    def update_staged(self, buf: StateBuffer, binding: SubgroupBinding, steps: list[int], hyper: AdamWHyper) -> int:
        """Copy a host buffer's state in, chunk by chunk, update it here, copy it back; all
        asynchronous (``buf.ready_event`` marks the last copy back)."""
        grads = SubgroupGrads(binding, steps)
        if not grads.runs:
            return 0
        if self.streams.pins_host_memory and not buf.pin_tried:
            # Not pinned inside the step (cudaHostRegister faults in every page, about 0.1 s per
            # GB, and may synchronize the device): a buffer the pool grew in this step (after a
            # failed write) or between steps is copied from pageable memory this once, through
            # the driver's bounce buffer, and pinned at the next step's start.
            self._pin_next.setdefault(id(buf), weakref.ref(buf))
        n = binding.numel
        flat = flat_weights_of(binding)
        host_flat = flat if flat is not None and not self.streams.on_device(flat) else None  # written through the slots
        previous = buf.ready_event  # a copy back into this buffer still in flight (an earlier step)
        for a in range(0, n, self.chunk_numel):
            b, slot = min(n, a + self.chunk_numel), self._take_slot()
            m = b - a
            master, exp_avg, exp_avg_sq = slot.views(m)
            with self.streams.use(self.h2d):
                if slot.free is not None:
                    self.h2d.wait_event(slot.free)  # the slot's last chunk has been copied out
                if previous is not None:
                    self.h2d.wait_event(previous)  # the buffer holds its last copy back
                    previous = None
                for dst, src in zip((master, exp_avg, exp_avg_sq), (buf.master, buf.exp_avg, buf.exp_avg_sq)):
                    self.streams.copy(dst, src[a:b])
                uploaded = self._upload_grads(grads, a, b, slot)
                slot.loaded = self.streams.record(self.h2d, slot.loaded)
            with self.streams.use(self.compute):
                self.compute.wait_event(slot.loaded)  # the chunk's state (and gradient) has arrived
                g = self._grad_chunk(grads, a, b, self._grad, uploaded)
                adamw_update_torch_(grads.slices_for(a, b, master, g, exp_avg, exp_avg_sq, steps), hyper)
                if host_flat is not None:
                    weights = LaneSlot.typed(slot.weights, host_flat.dtype, m)
                    weights.copy_(master)  # cast here; copied out with the state
                else:
                    self._write_weights(binding, flat, master, a)
                slot.updated = self.streams.record(self.compute, slot.updated)
            with self.streams.use(self.d2h):
                self.d2h.wait_event(slot.updated)  # the chunk's update is done
                for dst, src in zip((buf.master, buf.exp_avg, buf.exp_avg_sq), (master, exp_avg, exp_avg_sq)):
                    self.streams.copy(dst[a:b], src)
                if host_flat is not None:
                    self.streams.copy(host_flat[a:b], weights)
                slot.free = self.streams.record(self.d2h, slot.free)
        # d2h runs in order: one point after the last chunk's copy back covers them all. An event
        # of its own, once per subgroup: the slots' are recorded again by later chunks.
        buf.ready_event = self.streams.record(self.d2h)
        weights_written(binding)
        return grads.advance(steps)

    def _take_slot(self) -> LaneSlot:
        if not self._slots:
            self._slots = [LaneSlot(self.device, self.chunk_numel) for _ in range(self.n_slots)]
        slot = self._slots[self._next]
        self._next = (self._next + 1) % len(self._slots)
        return slot

    def _upload_grads(self, grads: SubgroupGrads, a: int, b: int, slot: LaneSlot) -> dict[int, torch.Tensor]:
        """On the h2d stream: the chunk's gradient slices that are in host memory, into the
        slot (in their own dtype; fp32 if they differ). Per slice, the slot's view of it."""
        host = [(k, lo, hi, g) for k, lo, hi, g in grads.slices_in(a, b) if not self.streams.on_device(g)]
        if not host:
            return {}
        dtypes = {g.dtype for _, _, _, g in host}
        dtype = dtypes.pop() if len(dtypes) == 1 else torch.float32
        staged = LaneSlot.typed(slot.grad, dtype, b - a)
        out = {}
        for k, lo, hi, g in host:
            dst = staged[lo - a : hi - a]
            self.streams.copy(dst, grads.source(k, lo, hi, g))
            out[k] = dst
        return out

    def _grad_chunk(
        self, grads: SubgroupGrads, a: int, b: int, scratch: Scratch, uploaded: dict[int, torch.Tensor] | None
    ) -> torch.Tensor:
        """The fp32, unscaled gradient of elements [a, b) on the device, on the current stream:
        read in place when it is one fp32 slice here already, else upcast into ``scratch``."""
        one = grads.per_slice[0] if len(grads.per_slice) == 1 else None
        if (
            one is not None
            and grads.scale == 1.0
            and one.dtype == torch.float32
            and not uploaded
            and self.streams.on_device(one)
            and one.is_contiguous()
        ):
            return one[a:b]
        out = scratch.get(b - a)
        for k, lo, hi, g in grads.slices_in(a, b):
            src = uploaded[k] if uploaded and k in uploaded else grads.source(k, lo, hi, g)
            out[lo - a : hi - a].copy_(src, non_blocking=True)
        if grads.scale != 1.0:
            out.mul_(grads.scale)  # DeepSpeed's math: fp32 gradient * (1 / combined scale)
        return out

    def _write_weights(self, binding: SubgroupBinding, flat: torch.Tensor | None, master: torch.Tensor, offset: int) -> None:
        """The chunk's new weights, on the current stream: cast into flat weights on this device,
        else through the binding."""
        if flat is not None and self.streams.on_device(flat):
            self.streams.copy(flat[offset : offset + master.numel()], master)  # cast on the device, no transfer
        else:
            binding.write_weights(master, offset)
