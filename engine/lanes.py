"""The two places a subgroup's update runs, and what they share.

Both call the same AdamW math (:mod:`engine.adamw`) on flat views; they differ only in where
the state sits during the update and how it gets there. Streams and events come from
:mod:`engine.streams`; ``docs/engine.md`` places the lanes in the step.

- **Host lane** (:mod:`engine.host_lane`): the state in host memory, updated chunk by chunk with
  the fused CPU kernel, each chunk's gradient upcast and unscaled in cache and its new weights
  cast out while still there.
- **Device lane** (:mod:`engine.device_lane`, Deep Optimizer States): the state copied to the
  device chunk by chunk, updated there and copied back, both PCIe directions and the update at
  once, beside the host lane; the device tier's resident state is updated on a stream of its own.

At the end of a step every stream that wrote weights the model reads is joined to the caller's
current stream (``wait_stream``: an order on the device, which the host does not wait for), so
DeepSpeed's all-gather and the next forward are ordered after the new weights whatever stream
they run on. The step does wait on the host, twice where there is a device lane: at its start,
for backward's work on the device (:meth:`engine.device_lane.DeviceLane.begin_step`), and at its
end, for the upload stream and the device lane's streams, so that no copy still uses a pinned
chunk buffer or a host buffer the lanes copy back into when ``step()`` returns (that wait is the
record's ``device_wait_s``; :meth:`engine.core.SubgroupEngine._end_streams`). The host lane's
gradient reads wait on their chunks' events, and ring slots on their last copies, as they go.

Here: a subgroup's gradients as one update reads them (:class:`SubgroupGrads`), and the growable
scratch each lane upcasts them into (:class:`Scratch`).
"""

from __future__ import annotations

from typing import Iterator

import torch

from engine.adamw import AdamWSlices, group_runs
from engine.binding import SubgroupBinding, grad_scale_of


class Scratch:
    """A growable flat fp32 tensor on one device."""

    def __init__(self, device: torch.device) -> None:
        self.device, self._t = device, torch.empty(0, device=device)

    @property
    def nbytes(self) -> int:
        return self._t.numel() * self._t.element_size()

    def get(self, numel: int) -> torch.Tensor:
        if self._t.numel() < numel:
            self._t = torch.empty(numel, dtype=torch.float32, device=self.device)
        return self._t[:numel]


def slice_offsets(binding: SubgroupBinding) -> list[int]:
    out = [0]
    for n in binding.slice_numels:
        out.append(out[-1] + n)
    return out


class SubgroupGrads:
    """A subgroup's gradients as one step reads them: per slice (None: no gradient), the runs
    of slices to update, the gradient scale, and the slices' offsets."""

    def __init__(self, binding: SubgroupBinding, steps: list[int]) -> None:
        self.per_slice = [None if g is None else g.reshape(-1) for g in binding.grads()]
        self.runs = group_runs(steps, [g is not None for g in self.per_slice])
        self.scale = grad_scale_of(binding)
        self.offsets = slice_offsets(binding)

    def slices_in(self, a: int, b: int) -> Iterator[tuple[int, int, int, torch.Tensor]]:
        """(slice, lo, hi, its gradient) for each slice with a gradient that overlaps elements [a, b)."""
        for k, g in enumerate(self.per_slice):
            lo, hi = max(a, self.offsets[k]), min(b, self.offsets[k + 1])
            if g is not None and lo < hi:
                yield k, lo, hi, g

    def source(self, k: int, lo: int, hi: int, g: torch.Tensor) -> torch.Tensor:
        """Elements [lo, hi) of the subgroup in slice ``k``'s gradient ``g`` (as :meth:`slices_in` gives them)."""
        off = self.offsets[k]
        return g[lo - off : hi - off]

    def slices_for(
        self,
        a: int,
        b: int,
        master: torch.Tensor,
        grad: torch.Tensor,
        exp_avg: torch.Tensor,
        exp_avg_sq: torch.Tensor,
        steps: list[int],
    ) -> AdamWSlices:
        """The fused call for elements [a, b): views (chunk-local) of each run that overlaps them."""
        s = AdamWSlices([], [], [], [], [])
        for i, j in self.runs:
            lo, hi = max(a, self.offsets[i]), min(b, self.offsets[j])
            if lo >= hi:
                continue
            x, y = lo - a, hi - a
            s.params.append(master[x:y])
            s.grads.append(grad[x:y])
            s.exp_avgs.append(exp_avg[x:y])
            s.exp_avg_sqs.append(exp_avg_sq[x:y])
            s.steps.append(step_tensor(steps[i] + 1, master.device))
        return s

    def advance(self, steps: list[int]) -> int:
        """Count the step in every updated slice; the slices updated."""
        for i, j in self.runs:
            for k in range(i, j):
                steps[k] += 1
        return sum(j - i for i, j in self.runs)


def step_tensor(step: int, device: torch.device) -> torch.Tensor:
    # torch.full launches a fill on the current stream; torch.tensor(..., device=cuda) would copy
    # from pageable memory, which waits for the stream and stalls the device lane's pipeline.
    return torch.full((), float(step), dtype=torch.float32, device=device)
