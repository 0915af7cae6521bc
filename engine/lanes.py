"""The two places a subgroup's update runs: the host lane and the device lane.

Both call the same AdamW math (:mod:`engine.adamw`) on flat views; they differ only in where
the state sits during the update and how it gets there.

Device lane (Deep Optimizer States): the subgroup's fp32 state (master, exp_avg, exp_avg_sq,
back to back) is copied host-to-device on a side stream, updated with the fused kernel there,
its weights are written to the model from the device copy, and the state is copied back.
All of it is queued on the side stream, so the host lane updates the next subgroups while it
runs; an event on the host buffer orders any later use of that buffer after the copy back.
With ``device='cpu'`` (tests) the same code runs synchronously.
"""
from __future__ import annotations

import contextlib

import torch

from .adamw import AdamWHyper, AdamWSlices, HostKernel, adamw_update_torch_, group_runs
from .binding import SubgroupBinding
from .buffers import StateBuffer


class _Scratch:
    """A growable flat fp32 tensor on one device."""

    def __init__(self, device: torch.device) -> None:
        self.device, self._t = device, torch.empty(0, device=device)

    def get(self, numel: int) -> torch.Tensor:
        if self._t.numel() < numel:
            self._t = torch.empty(numel, dtype=torch.float32, device=self.device)
        return self._t[:numel]


def run_update(master: torch.Tensor, exp_avg: torch.Tensor, exp_avg_sq: torch.Tensor, binding: SubgroupBinding,
               steps: list[int], hp: AdamWHyper, kernel: HostKernel, grad_scratch: _Scratch) -> int:
    """One AdamW step of a subgroup whose state views are on ``grad_scratch.device``.

    Gradients are upcast into the scratch buffer (never stored anywhere else). Slices without
    a gradient keep their state and step, as torch AdamW skips them. Returns the slices updated.
    """
    grads = binding.grads()
    has_grad = [g is not None for g in grads]
    runs = group_runs(steps, has_grad)
    if not runs:
        return 0
    offsets = [0]
    for n in binding.slice_numels:
        offsets.append(offsets[-1] + n)
    if (len(grads) == 1 and grads[0] is not None and grads[0].dtype == torch.float32
            and grads[0].device == master.device and grads[0].is_contiguous()):
        grad = grads[0].view(-1)  # fp32 on this device already: no copy (the kernel only reads it)
    else:
        grad = grad_scratch.get(master.numel())
        for k, g in enumerate(grads):
            if g is not None:
                grad[offsets[k]:offsets[k + 1]].copy_(g.reshape(-1), non_blocking=True)
    s = AdamWSlices([], [], [], [], [])
    for i, j in runs:
        a, b = offsets[i], offsets[j]
        s.params.append(master[a:b])
        s.grads.append(grad[a:b])
        s.exp_avgs.append(exp_avg[a:b])
        s.exp_avg_sqs.append(exp_avg_sq[a:b])
        s.steps.append(torch.tensor(float(steps[i] + 1), device=master.device))
    kernel(s, hp)
    for i, j in runs:
        for k in range(i, j):
            steps[k] += 1
    binding.write_weights(master)
    return sum(j - i for i, j in runs)


class HostLane:
    """Updates state in host memory with the faster fused CPU AdamW kernel."""

    def __init__(self, kernel_name: str, kernel: HostKernel) -> None:
        self.kernel_name, self.kernel = kernel_name, kernel
        self._grad = _Scratch(torch.device("cpu"))

    def update(self, buf: StateBuffer, binding: SubgroupBinding, steps: list[int], hp: AdamWHyper) -> int:
        return run_update(buf.master, buf.exp_avg, buf.exp_avg_sq, binding, steps, hp, self.kernel, self._grad)


class DeviceLane:
    """Updates subgroups on ``device``: staged from host buffers, or resident there."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.is_cuda = device.type == "cuda"
        self.stream = torch.cuda.Stream(device) if self.is_cuda else None
        self._state = _Scratch(device)
        self._grad = _Scratch(device)

    def begin_step(self) -> None:
        if self.is_cuda:
            # Orders the side stream after the backward pass that produced the gradients.
            self.stream.wait_stream(torch.cuda.current_stream(self.device))

    def end_step(self) -> None:
        if self.is_cuda:
            # Orders the next forward pass after the weights written on the side stream.
            torch.cuda.current_stream(self.device).wait_stream(self.stream)

    def update_resident(self, state: torch.Tensor, binding: SubgroupBinding, steps: list[int], hp: AdamWHyper) -> int:
        """Update state that lives on the device (the device tier): no transfers."""
        with self._on_stream():
            n = binding.numel
            m, ea, eas = state[:3 * n].split(n)
            return run_update(m, ea, eas, binding, steps, hp, adamw_update_torch_, self._grad)

    def update_staged(self, buf: StateBuffer, binding: SubgroupBinding, steps: list[int], hp: AdamWHyper) -> int:
        """Copy a host buffer's state in, update it here, copy it back; asynchronous on CUDA."""
        buf.wait_ready()
        n = binding.numel
        with self._on_stream():
            dev = self._state.get(3 * n)
            dev.copy_(buf.state, non_blocking=True)  # H2D from pinned memory
            m, ea, eas = dev.split(n)
            updated = run_update(m, ea, eas, binding, steps, hp, adamw_update_torch_, self._grad)
            buf.state.copy_(dev, non_blocking=True)  # D2H into pinned memory
            if self.is_cuda:
                buf.ready_event = torch.cuda.Event()
                buf.ready_event.record(self.stream)
        return updated

    def _on_stream(self):
        return torch.cuda.stream(self.stream) if self.is_cuda else contextlib.nullcontext()


