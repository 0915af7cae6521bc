"""The two places a subgroup's update runs: the host lane and the device lane.

Both call the same AdamW math (:mod:`engine.adamw`) on flat views; they differ only in where
the state sits during the update and how it gets there.

Host lane: the update runs over the subgroup in chunks of ``HOST_CHUNK_NUMEL`` elements. Each
chunk's gradient is upcast to fp32 and unscaled (clipping, loss scale) into a small scratch
buffer that stays in the cores' caches, the fused kernel updates the chunk, and the chunk's
new master is cast into the model's 16-bit weights while it is still in cache. Nothing is
allocated per step; the gradient is read once from memory, the state once read and once
written. Weights that live on a GPU go through a pinned staging buffer and an asynchronous
copy (:class:`WeightUploader`), so the CPU goes on to the next subgroup at once.

Device lane (Deep Optimizer States): the subgroup's fp32 state (master, exp_avg, exp_avg_sq,
back to back) is copied host-to-device on one stream, updated with the fused kernel on a
second, and copied back on a third, through ``DEVICE_LANE_SLOTS`` device buffers, so that the copy
in of one subgroup, the update of the next-older one and the copy back of the one before run
at once (both PCIe directions), while the host lane updates other subgroups on the CPU.
An event on the host buffer orders every later use of it after its copy back. Gradients that
DeepSpeed keeps on the GPU are used where they are. State resident on the device (the device
tier) is updated on the update stream with no transfer at all.

With ``device='cpu'`` (tests) the device lane runs the same code synchronously.
"""
from __future__ import annotations

import contextlib
from typing import Sequence

import torch

from engine.adamw import AdamWHyper, AdamWSlices, HostKernel, adamw_update_torch_, group_runs
from engine.binding import SubgroupBinding, flat_weights_of, grad_scale_of, weights_written
from engine.buffers import StateBuffer, aligned_empty
from engine.placement import DEVICE_LANE_SLOTS, device_lane_working_bytes

HOST_CHUNK_NUMEL = 1 << 21
"""Elements per host-lane chunk: 8 MB of fp32 gradient, small enough to stay in the caches
between its upcast and the kernel, large enough that per-call overhead is noise (~1%)."""
HOST_LANE_EFFICIENCY = 0.9
"""The host lane's rate inside a step over the bare kernel's (the upcast and the weight cast
ride in cache); what the engine's own lane balancing assumes."""


class _Scratch:
    """A growable flat fp32 tensor on one device."""

    def __init__(self, device: torch.device) -> None:
        self.device, self._t = device, torch.empty(0, device=device)

    def get(self, numel: int) -> torch.Tensor:
        if self._t.numel() < numel:
            self._t = torch.empty(numel, dtype=torch.float32, device=self.device)
        return self._t[:numel]

    @property
    def nbytes(self) -> int:
        return self._t.numel() * 4


def _offsets(binding: SubgroupBinding) -> list[int]:
    out = [0]
    for n in binding.slice_numels:
        out.append(out[-1] + n)
    return out


def _gather(out: torch.Tensor, grads: Sequence[torch.Tensor | None], offsets: list[int], a: int, b: int) -> None:
    """Copy the gradient elements [a, b) of the subgroup (across slices) into ``out`` (fp32)."""
    for k, g in enumerate(grads):
        lo, hi = max(a, offsets[k]), min(b, offsets[k + 1])
        if g is None or lo >= hi:
            continue
        out[lo - a:hi - a].copy_(g[lo - offsets[k]:hi - offsets[k]], non_blocking=True)


def _read_grads(binding: SubgroupBinding, steps: list[int]):
    """(flat gradients per slice, runs of slices to update, gradient scale, slice offsets) of a
    subgroup; None when no slice has a gradient this step."""
    grads = [None if g is None else g.reshape(-1) for g in binding.grads()]
    runs = group_runs(steps, [g is not None for g in grads])
    if not runs:
        return None
    return grads, runs, grad_scale_of(binding), _offsets(binding)


def _step_tensor(step: int, device: torch.device) -> torch.Tensor:
    # torch.full launches a fill on the current stream; torch.tensor(..., device=cuda) would copy
    # from pageable memory, which waits for the stream and stalls the device lane's pipeline.
    return torch.full((), float(step), dtype=torch.float32, device=device)


def host_update(buf: StateBuffer, binding: SubgroupBinding, steps: list[int], hp: AdamWHyper, kernel: HostKernel,
                scratch: _Scratch, weights: "WeightUploader | None" = None) -> int:
    """One AdamW step of a subgroup whose state is in host memory, chunk by chunk (module
    docstring). Slices without a gradient keep their state and step, as torch AdamW skips
    them. Returns the slices updated."""
    buf.wait_ready()  # a device-lane copy back into this buffer (before a knob change) has landed
    read = _read_grads(binding, steps)
    if read is None:
        return 0
    grads, runs, scale, offsets = read
    master, exp_avg, exp_avg_sq = buf.master, buf.exp_avg, buf.exp_avg_sq
    direct = (len(grads) == 1 and scale == 1.0 and grads[0].dtype == torch.float32
              and grads[0].device.type == "cpu" and grads[0].is_contiguous())
    sink = weights.begin(binding) if weights is not None else None
    covered = 0
    for i, j in runs:
        step = _step_tensor(steps[i] + 1, master.device)
        lo, hi = offsets[i], offsets[j]
        if sink is not None and lo > covered:
            sink.write(covered, lo, master[covered:lo])  # slices not updated: their weights as they are
        for a in range(lo, hi, HOST_CHUNK_NUMEL):
            b = min(hi, a + HOST_CHUNK_NUMEL)
            if direct:
                g = grads[0][a:b]  # fp32 on the host already, nothing to unscale: read in place
            else:
                g = scratch.get(b - a)
                _gather(g, grads, offsets, a, b)
                if scale != 1.0:
                    g.mul_(scale)  # DeepSpeed's math: fp32 gradient * (1 / combined scale)
            kernel(AdamWSlices([master[a:b]], [g], [exp_avg[a:b]], [exp_avg_sq[a:b]], [step]), hp)
            if sink is not None:
                sink.write(a, b, master[a:b])  # cast while the chunk is in cache
        covered = hi
    for i, j in runs:
        for k in range(i, j):
            steps[k] += 1
    if sink is not None:
        if covered < binding.numel:
            sink.write(covered, binding.numel, master[covered:binding.numel])
        sink.finish()
    else:
        binding.write_weights(master)
    return sum(j - i for i, j in runs)


def device_update(master: torch.Tensor, exp_avg: torch.Tensor, exp_avg_sq: torch.Tensor, binding: SubgroupBinding,
                  steps: list[int], hp: AdamWHyper, scratch: _Scratch) -> int:
    """One AdamW step of a subgroup whose state views are on the device, on the current stream.
    Gradients are upcast (and unscaled) into ``scratch`` unless they are fp32 there already."""
    read = _read_grads(binding, steps)
    if read is None:
        return 0
    grads, runs, scale, offsets = read
    g0 = grads[0]
    if (len(grads) == 1 and scale == 1.0 and g0.dtype == torch.float32 and g0.device == master.device
            and g0.is_contiguous()):
        grad = g0  # fp32 on this device already: read in place
    else:
        grad = scratch.get(master.numel())
        _gather(grad, grads, offsets, 0, master.numel())
        if scale != 1.0:
            grad.mul_(scale)
    s = AdamWSlices([], [], [], [], [])
    for i, j in runs:
        a, b = offsets[i], offsets[j]
        s.params.append(master[a:b])
        s.grads.append(grad[a:b])
        s.exp_avgs.append(exp_avg[a:b])
        s.exp_avg_sqs.append(exp_avg_sq[a:b])
        s.steps.append(_step_tensor(steps[i] + 1, master.device))
    adamw_update_torch_(s, hp)
    for i, j in runs:
        for k in range(i, j):
            steps[k] += 1
    flat = flat_weights_of(binding)
    if flat is not None and flat.device == master.device:
        flat.copy_(master)  # cast on the device, no transfer
        weights_written(binding)
    else:
        binding.write_weights(master)
    return sum(j - i for i, j in runs)


class _WeightSink:
    """Where one subgroup's updated weights go, chunk by chunk (see :class:`WeightUploader`)."""

    def __init__(self, uploader: "WeightUploader", binding: SubgroupBinding, target: torch.Tensor,
                 staging: torch.Tensor | None, slot: int) -> None:
        self.uploader, self.binding, self.target, self.staging, self.slot = uploader, binding, target, staging, slot
        self.dst = target if staging is None else staging

    def write(self, a: int, b: int, master_chunk: torch.Tensor) -> None:
        self.dst[a:b].copy_(master_chunk)

    def finish(self) -> None:
        if self.staging is not None:
            self.uploader.upload(self.target, self.staging, self.slot)
        weights_written(self.binding)


class WeightUploader:
    """Gets the host lane's updated weights into the model's flat weights.

    A flat weight tensor on the host is written in place. One on a CUDA device is written
    through two pinned staging buffers: the host lane casts into one while the other's
    asynchronous copy runs on ``stream``. Bindings without a flat weight tensor (``OffloadAdamW``)
    fall back to their ``write_weights``.
    """

    def __init__(self, stream: "torch.cuda.Stream | None") -> None:
        self.stream = stream
        self._staging: list[torch.Tensor | None] = [None, None]
        self._done: list[torch.cuda.Event | None] = [None, None]
        self._next = 0

    def begin(self, binding: SubgroupBinding) -> _WeightSink | None:
        target = flat_weights_of(binding)
        if target is None:
            return None
        if target.device.type == "cpu":
            return _WeightSink(self, binding, target, None, -1)
        if self.stream is None:
            return None
        k, self._next = self._next, 1 - self._next
        if self._done[k] is not None:
            self._done[k].synchronize()  # its previous copy has read it
        nbytes = target.numel() * target.element_size()
        buf = self._staging[k]
        if buf is None or buf.numel() < nbytes:
            buf = self._staging[k] = aligned_empty(nbytes, pin=True)
        staging = buf[:nbytes].view(target.dtype)
        return _WeightSink(self, binding, target, staging, k)

    def upload(self, target: torch.Tensor, staging: torch.Tensor, k: int) -> None:
        with torch.cuda.stream(self.stream):
            target.copy_(staging, non_blocking=True)
            ev = self._done[k] = torch.cuda.Event()
            ev.record(self.stream)

    @property
    def nbytes(self) -> int:
        return sum(b.numel() for b in self._staging if b is not None)


class HostLane:
    """Updates state in host memory with the faster fused CPU AdamW kernel."""

    def __init__(self, kernel_name: str, kernel: HostKernel, weights: WeightUploader | None = None) -> None:
        self.kernel_name, self.kernel = kernel_name, kernel
        self.weights = weights
        self._grad = _Scratch(torch.device("cpu"))

    def update(self, buf: StateBuffer, binding: SubgroupBinding, steps: list[int], hp: AdamWHyper) -> int:
        return host_update(buf, binding, steps, hp, self.kernel, self._grad, self.weights)


class _Slot:
    """One device buffer of the device lane and the events that order its reuse."""

    def __init__(self) -> None:
        self.state: torch.Tensor | None = None
        self.loaded = self.updated = self.free = None


class DeviceLane:
    """Updates subgroups on ``device``: staged from host buffers, or resident there."""

    def __init__(self, device: torch.device, capacity_numel: int, slots: int = DEVICE_LANE_SLOTS) -> None:
        self.device, self.capacity_numel = device, capacity_numel
        self.is_cuda = device.type == "cuda"
        if self.is_cuda:
            self.h2d = torch.cuda.Stream(device)
            self.compute = torch.cuda.Stream(device)
            self.d2h = torch.cuda.Stream(device)
        else:
            self.h2d = self.compute = self.d2h = None
        self._slots = [_Slot() for _ in range(max(1, slots))]
        self._next = 0
        self._grad = _Scratch(device)


    def working_bytes(self) -> int:
        """Device memory the lane uses at most: its slots and a gradient scratch."""
        return device_lane_working_bytes(self.capacity_numel, len(self._slots))

    def begin_step(self) -> None:
        if self.is_cuda:
            # Everything the step reads (gradients, weights) was produced by backward on
            # DeepSpeed's or the default stream: let all of it land first.
            torch.cuda.synchronize(self.device)

    def end_step(self) -> None:
        # The step's one sync point: every update, copy back and weight upload has landed
        # before the next forward reads the weights, on whatever stream it runs.
        self.sync()

    def sync(self) -> None:
        """Wait for everything queued on the lane's streams."""
        if self.is_cuda:
            for s in (self.h2d, self.compute, self.d2h):
                s.synchronize()

    def seed_resident(self, state: torch.Tensor, binding: SubgroupBinding) -> None:
        """First state of a device-tier subgroup: master from the weights, zero moments; on
        the update stream, ahead of the subgroup's update."""
        with self._on(self.compute):
            n = binding.numel
            binding.read_weights(state[:n])
            state[n:3 * n].zero_()

    def update_resident(self, state: torch.Tensor, binding: SubgroupBinding, steps: list[int], hp: AdamWHyper) -> int:
        """Update state that lives on the device (the device tier): no transfers."""
        with self._on(self.compute):
            n = binding.numel
            m, ea, eas = state[:3 * n].split(n)
            return device_update(m, ea, eas, binding, steps, hp, self._grad)

    def update_staged(self, buf: StateBuffer, binding: SubgroupBinding, steps: list[int], hp: AdamWHyper) -> int:
        """Copy a host buffer's state in, update it here, copy it back; asynchronous on CUDA."""
        buf.wait_ready()
        n = binding.numel
        if not self.is_cuda:
            dev = self._slots[0].state = _grow(self._slots[0].state, 3 * n, self.device)[:3 * n]
            dev.copy_(buf.state)
            m, ea, eas = dev.split(n)
            updated = device_update(m, ea, eas, binding, steps, hp, self._grad)
            buf.state.copy_(dev)
            return updated
        buf.pin()  # once: page-locked in place, so both copies run asynchronously
        slot = self._slots[self._next]
        self._next = (self._next + 1) % len(self._slots)
        if slot.state is None:
            # Allocated once, at the largest subgroup's size: a slot is never freed while a
            # copy on another stream may still use it.
            slot.state = torch.empty(3 * self.capacity_numel, dtype=torch.float32, device=self.device)
        dev = slot.state[:3 * n]
        with torch.cuda.stream(self.h2d):
            if slot.free is not None:
                self.h2d.wait_event(slot.free)  # the slot's previous copy back has read it
            dev.copy_(buf.state, non_blocking=True)
            slot.loaded = _record(self.h2d)
        with torch.cuda.stream(self.compute):
            self.compute.wait_event(slot.loaded)  # the state has arrived
            m, ea, eas = dev.split(n)
            updated = device_update(m, ea, eas, binding, steps, hp, self._grad)
            slot.updated = _record(self.compute)
        with torch.cuda.stream(self.d2h):
            self.d2h.wait_event(slot.updated)  # the update is done
            buf.state.copy_(dev, non_blocking=True)
            slot.free = _record(self.d2h)
        buf.ready_event = slot.free  # the host buffer is not read or reused before this
        return updated

    @staticmethod
    def _on(stream):
        return torch.cuda.stream(stream) if stream is not None else contextlib.nullcontext()


def _grow(t: torch.Tensor | None, numel: int, device: torch.device) -> torch.Tensor:
    if t is None or t.numel() < numel:
        return torch.empty(numel, dtype=torch.float32, device=device)
    return t


def _record(stream) -> "torch.cuda.Event":
    ev = torch.cuda.Event()
    ev.record(stream)
    return ev
