"""A subgroup's record (:class:`Subgroup`): its binding, its steps, and its home, where its state
lives: on the device (:class:`OnDevice`), in a host buffer (:class:`InHost`), or in a swap file
(:class:`Swapped`), which holds the staging buffer it passes through and that copy's
:class:`Stage` as the transfers of :mod:`engine.transfers` move it; and its first state
(:func:`first_state`). Its tier is its home's: a move between tiers is one assignment of the home.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import ClassVar, TypeAlias

import torch

from engine.binding import SubgroupBinding
from engine.buffers import StateBuffer
from engine.placement import DEVICE, HOST, Tier, swap_tier
from engine.storage.paths import SwapFile


class Stage(enum.Enum):
    """Where a swapped subgroup's staged copy is in its round trip, and the transitions between
    the stages (the methods of :class:`Swapped` that make them; any other fails loudly):

    - not staged (``Swapped.staged`` is None): its state is in its file, or nowhere yet (fresh).
      :meth:`~Swapped.load`: a staging buffer taken for it, read into or its first state made: HELD.
    - ``HELD``: in its buffer and in use, not newer than its file: read for this step's update or
      ahead of the next one's, or taken for its update (:meth:`~Swapped.take`). ``updated``: UPDATED;
      ``read_landed`` (a read ahead landed, at a flush): KEPT_CLEAN.
    - ``UPDATED``: in use and newer than its file: updated (``updated``), or a kept tail taken for
      its update. ``write``: WRITING; ``keep``: KEPT_DIRTY.
    - ``WRITING``: being written back; its buffer is read-only until the write lands, and is neither
      taken, released nor written again. ``landed``: KEPT_CLEAN (its next file becomes its file);
      ``write_failed``: it leaves the swap tier, its home the buffer (:class:`InHost`).
    - ``KEPT_DIRTY``: the kept tail, newer than its file, held for the next step's first updates.
      ``take``: UPDATED; ``write``: WRITING (a buffer needed, a give-back, a smaller pool).
    - ``KEPT_CLEAN``: a clean copy, its file current: a later update reads nothing, until its buffer
      is taken for another subgroup (``release``). ``take``: HELD.

    ``release`` (its buffer back to the pool, unwritten) is legal in every stage but WRITING: the
    file is current, or the state moves elsewhere or is replaced (a fit, a state load).
    """

    HELD = "held"
    UPDATED = "updated"
    WRITING = "writing"
    KEPT_DIRTY = "kept dirty"
    KEPT_CLEAN = "kept clean"


KEPT = frozenset({Stage.KEPT_DIRTY, Stage.KEPT_CLEAN})
"""Held between updates: copies whose buffers may go to another subgroup (dirty ones written first)."""
DIRTY = frozenset({Stage.UPDATED, Stage.WRITING, Stage.KEPT_DIRTY})
"""Newer than the file."""


@dataclass(frozen=True)
class Staged:
    """A swapped subgroup's state in a staging buffer, at ``stage`` of its round trip."""

    buffer: StateBuffer
    stage: Stage


@dataclass
class OnDevice:
    """In the device tier: its flat state (master, exp_avg, exp_avg_sq back to back) on the device,
    and the pinned host buffer its state leaves to at ``release_device()``, kept from the last one."""

    state: torch.Tensor
    host_copy: StateBuffer | None = None
    tier: ClassVar[Tier] = DEVICE


@dataclass(frozen=True)
class InHost:
    """In host memory: the buffer its state lives in (a swapped one's, after its write failed)."""

    buffer: StateBuffer
    tier: ClassVar[Tier] = HOST


@dataclass
class Swapped:
    """In a swap file on storage path ``path_index``: ``file``, or ``next_file`` from its next write
    after a restripe moved it there; and its staged copy, if a staging buffer holds it (:class:`Stage`)."""

    path_index: int
    file: SwapFile
    next_file: SwapFile | None = None
    staged: Staged | None = None

    @property
    def tier(self) -> Tier:
        return swap_tier(self.path_index)

    def _move(self, to: Stage | None, *legal: Stage) -> StateBuffer:
        """The staged copy to stage ``to`` (None: not staged) from one of ``legal``; its buffer."""
        st = self.staged
        if st is None or st.stage not in legal:
            have, want = (st.stage.value if st else "not staged"), (to.value if to else "not staged")
            raise RuntimeError(f"subgroup {self.file.index}'s staged copy: no move from {have} to {want}")
        self.staged = None if to is None else Staged(st.buffer, to)
        return st.buffer

    def load(self, buf: StateBuffer) -> None:
        if self.staged is not None:
            raise RuntimeError(f"subgroup {self.file.index}'s staged copy: no load, it is {self.staged.stage.value}")
        self.staged = Staged(buf, Stage.HELD)

    def take(self) -> StateBuffer:
        """The buffer, for its update (a kept tail stays newer than its file)."""
        to = Stage.UPDATED if self.staged is not None and self.staged.stage in DIRTY else Stage.HELD
        return self._move(to, Stage.HELD, Stage.UPDATED, Stage.KEPT_DIRTY, Stage.KEPT_CLEAN)

    def updated(self) -> None:
        self._move(Stage.UPDATED, Stage.HELD, Stage.UPDATED)

    def keep(self) -> None:
        self._move(Stage.KEPT_DIRTY, Stage.UPDATED)

    def write(self) -> tuple[SwapFile, StateBuffer]:
        """Its write-back starts: the file written (the next one, after a restripe) and the buffer."""
        return self.next_file or self.file, self._move(Stage.WRITING, Stage.UPDATED, Stage.KEPT_DIRTY)

    def landed(self) -> SwapFile | None:
        """Its write-back landed: a clean copy, in its next file if it moved; the file it left."""
        self._move(Stage.KEPT_CLEAN, Stage.WRITING)
        if self.next_file is None:
            return None
        old, self.file, self.next_file = self.file, self.next_file, None
        return old

    def write_unsent(self) -> None:
        """Its write-back was not made (the submit, or waiting for it, raised other than a storage
        error): the copy is again newer than its file, and not being written."""
        self._move(Stage.UPDATED, Stage.WRITING)

    def write_failed(self) -> InHost:
        """Its write-back failed: its home from now on, its state kept in the buffer."""
        return InHost(self._move(None, Stage.WRITING))

    def read_landed(self) -> None:
        self._move(Stage.KEPT_CLEAN, Stage.HELD)

    def release(self) -> StateBuffer:
        return self._move(None, Stage.HELD, Stage.UPDATED, Stage.KEPT_DIRTY, Stage.KEPT_CLEAN)


Home: TypeAlias = OnDevice | InHost | Swapped


@dataclass
class Subgroup:
    """One subgroup: its binding, its home (which says its tier) and its steps (per slice, as torch
    AdamW keeps them per parameter). ``fresh``: no state yet; its first state is made where it is
    first needed (:meth:`start_state`). A flag, not a stage: it holds in every home and across
    moves between them (a fresh subgroup moved to the device stays fresh), and a staged copy is
    never fresh (its first state is made as it is loaded)."""

    index: int
    binding: SubgroupBinding
    home: Home
    steps: list[int]
    fresh: bool = True

    @property
    def numel(self) -> int:
        return self.binding.numel

    @property
    def tier(self) -> Tier:
        return self.home.tier

    @property
    def swap(self) -> Swapped:
        """Swapped: its home (its files, its staged copy)."""
        assert isinstance(self.home, Swapped), f"subgroup {self.index} is not swapped"
        return self.home

    @property
    def staged(self) -> Staged | None:
        """Its staged copy (swapped, while a staging buffer holds it), else None."""
        return self.home.staged if isinstance(self.home, Swapped) else None

    @property
    def stage(self) -> Stage | None:
        """Its staged copy's stage, or None."""
        return st.stage if (st := self.staged) is not None else None

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
