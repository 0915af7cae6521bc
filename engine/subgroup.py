"""A subgroup's record (:class:`Subgroup`): its binding, its tier, where its state is (a host
buffer, the device, a swap file and the staging buffer holding it), and the flags the transfers
of :mod:`engine.transfers` keep on it; and its first state (:func:`first_state`).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from engine.binding import SubgroupBinding
from engine.buffers import StateBuffer
from engine.placement import Tier
from engine.storage.paths import SwapFile


@dataclass
class Subgroup:
    index: int
    binding: SubgroupBinding
    tier: Tier
    steps: list[int]  # per slice, as torch AdamW keeps per parameter
    resident: StateBuffer | torch.Tensor | None = None  # HOST: StateBuffer; DEVICE: flat tensor
    file: SwapFile | None = None  # swapped: where the state is
    next_file: SwapFile | None = None  # restriped: where the next write goes
    staged: StateBuffer | None = None  # swapped: staging buffer holding it now
    fresh: bool = True  # no state yet: its first state (start_state) is made where it is first needed
    dirty: bool = False  # staged copy is newer than the file
    kept: bool = False  # staged copy held between updates (dirty: the kept tail; clean: its write landed)
    writing: bool = False  # staged copy being written back (the buffer is read-only until it lands)
    host_copy: StateBuffer | None = None  # DEVICE: the pinned host buffer its state leaves to at release_device()

    @property
    def numel(self) -> int:
        return self.binding.numel

    @property
    def swap_file(self) -> SwapFile:
        """Swapped: the file its state is in."""
        assert self.file is not None, f"subgroup {self.index} has no swap file"
        return self.file

    @property
    def host_buffer(self) -> StateBuffer:
        """In host memory (``HOST``): the buffer its state lives in."""
        assert isinstance(self.resident, StateBuffer), f"subgroup {self.index} is not in host memory"
        return self.resident

    @property
    def device_state(self) -> torch.Tensor:
        """In the device tier: its flat state (master, exp_avg, exp_avg_sq back to back) on the device."""
        assert isinstance(self.resident, torch.Tensor), f"subgroup {self.index} is not on the device"
        return self.resident

    def start_state(self, buf: StateBuffer) -> None:
        """Its first state, in host buffer ``buf`` where it is first needed; nothing once it has state."""
        if self.fresh:
            first_state(self.binding, buf)
            self.fresh = False


def first_state(binding: SubgroupBinding, buf: StateBuffer) -> None:
    """A subgroup's state before its first update: master from the model's weights, zero moments."""
    binding.read_weights(buf.master)
    buf.exp_avg.zero_()
    buf.exp_avg_sq.zero_()
