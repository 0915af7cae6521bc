"""The multi-tier optimizer-state engine: one update loop over flat subgroups (:class:`SubgroupEngine`).

Each subgroup's fp32 state (master, exp_avg, exp_avg_sq) lives in one tier: device memory, host
memory, or a swap file on a storage path. ``step()`` visits every subgroup once, 0..N-1 on even
iterations and N-1..0 on odd ones, so that the last swapped subgroups updated, kept in their
staging buffers, are the first updated next: each is read ahead of its update, updated on its
lane and written back behind it; the device tier's are updated first, on the device. Knobs set
with :meth:`SubgroupEngine.set_knobs` apply at the next step. Here: the step, the two update
paths, the knobs and the state's access. The parts, in ``docs/engine.md``'s reading order:
:mod:`engine.transfers` (over :mod:`engine.subgroup`), :mod:`engine.host_memory`,
:mod:`engine.device_tier`, :mod:`engine.swap_paths`, :mod:`engine.lanes`. An adapter supplies
one :class:`SubgroupBinding` per subgroup (``OffloadAdamW``; the DeepSpeed ZeRO-3 integration).
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from dataclasses import dataclass
from typing import Iterator, Sequence

import torch

from engine import heap
from engine.adamw import AdamWHyper
from engine.binding import SubgroupBinding, flat_weights_of
from engine.buffers import StateBuffer
from engine.config import EngineConfig, Knobs
from engine.device_lane import DeviceLane
from engine.device_tier import DeviceTier
from engine.errors import ConfigError, OffloadError
from engine.facts import DeviceFit, EngineFacts, facts_of
from engine.gpumem import gpu_headroom_bytes, usable_bytes
from engine.hooks import StepHook, close_hooks
from engine.host_kernel import select_host_kernel
from engine.host_lane import HostLane, WeightUploader, threads_left_to_io
from engine.host_memory import HostBudget, HostUsage
from engine.layout import host_buffer_bytes, kept_subgroups, payload_bytes, step_order
from engine.placement import DEVICE, HOST, Tier, place
from engine.storage.paths import PathCounters
from engine.streams import resolve_lane_device, streams_for
from engine.subgroup import Home, InHost, OnDevice, Stage, Subgroup, Swapped
from engine.swap_paths import SwapPaths
from engine.telemetry import StepRecord, TelemetryLog
from engine.transfers import PRESSURE_BUFFERS, SwapPass, Transfers, host_state
from engine.units import format_size

log = logging.getLogger(__name__)


@dataclass
class _StepTally:
    """What one step's updates cost, and on which lane (its swapped subgroups': :class:`SwapPass`)."""

    pressure: bool = False  # host memory ran low during the step: nothing read ahead or kept
    kernel_s: float = 0.0  # AdamW on either lane, and queueing the device tier's
    host_lane_s: float = 0.0
    host_lane_subgroups: int = 0
    device_lane_subgroups: int = 0


class SubgroupEngine:
    """Owns every subgroup's optimizer state and runs the per-step update loop."""

    def __init__(self, bindings: Sequence[SubgroupBinding], config: EngineConfig, knobs: Knobs | None = None) -> None:
        self.config = config
        self.knobs = knobs or Knobs()
        self._pending_knobs: Knobs | None = None
        self._too_deep_warned: int | None = None  # the prefetch depth last warned of as too deep for the budget
        self._hooks: list[StepHook] = []
        self.iteration = 0
        self._closed = False
        self.device = resolve_lane_device(config.device)
        self._check(self.knobs)
        self._setup_s = 0.0  # one-time work outside a step (setup_time()) not yet taken out of fwd_bwd_s
        # The iteration's clock (what a tuner judges by): the time since the last step's end that
        # was no iteration's own (skipped_step, pause_clock), and the pause in progress: when it
        # began, and _setup_s then (setup inside a pause is setup, not excluded twice).
        self._excluded_s = 0.0
        self._paused: tuple[float, float] | None = None
        self._last_step_end: float | None = None
        self._counters_at: list[PathCounters] | None = None  # the paths' counters at the last step's end
        # Held by every entry point that touches the state, so that the memory watch's thread
        # gives buffers back only while the engine is idle.
        self._lock = threading.RLock()
        self.swap_paths = SwapPaths(config, self.knobs)
        if (config.device_cache_bytes is None or config.device_cache_bytes > 0) and self.device is None:
            raise ConfigError("device_cache_bytes needs a device: set device='cuda' (or 'cpu' in tests), or device_cache_bytes=0")
        # The device tier is fitted at the first step, once forward/backward has shown what
        # device memory it needs; until then it is what the budget places there.
        placement = place(
            [payload_bytes(b.numel) for b in bindings],
            device_budget=config.device_cache_bytes or 0,
            host_budget=config.host_cache_bytes,
            path_weights=self.swap_paths.stripe_weights(self.knobs),
        )
        placed = list(zip(bindings, placement.tiers))
        try:
            weights_on_device = any(w is not None and w.device.type != "cpu" for w in map(flat_weights_of, bindings))
            state_numels = [b.numel for b, t in placed if t == HOST]
            swapped_numels = [b.numel for b, t in placed if t.swapped]
            copies_bytes = HostLane.start_bytes(max((b.numel for b in bindings), default=0), weights_on_device)
            if "prefetch_depth" not in config.pins:  # the tuner may go deeper later, as far as the budget allows
                depth = HostBudget.start_depth(
                    config.host_memory_bytes, self.knobs.prefetch_depth, state_numels, swapped_numels, copies_bytes
                )
                self.knobs = self.knobs.replace(prefetch_depth=depth)
            self.host_memory = HostBudget.for_start(  # before allocating: a refusal costs nothing
                config.host_memory_bytes,
                usage=self.host_usage,
                local_ranks=config.local_ranks,
                prefetch_depth=self.knobs.prefetch_depth,
                state_numels=state_numels,
                swapped_numels=swapped_numels,
                copies_bytes=copies_bytes,
            )
            self.swap_paths.check_room(placement.tiers, [b.numel for b in bindings])
            self.subgroups = [
                Subgroup(i, b, self._home(i, b.numel, t), [0] * len(b.slice_numels)) for i, (b, t) in enumerate(placed)
            ]
            self.transfers = Transfers(
                self.subgroups,
                self.knobs.prefetch_depth,
                room_bytes=self.host_memory.staging_room,
                on_write_landed=self.read_ahead if config.overlap_io else None,
                auto_read_ahead=config.read_ahead_bytes is None and config.overlap_io,
            )
        except BaseException:
            self.close()
            raise
        self.host_kernel_name, kernel = select_host_kernel(config.host_adam, device_lane=self.device is not None)
        self.streams = streams_for(self.device if self.device is not None else torch.device("cpu"))
        capacity = max((sg.numel for sg in self.subgroups), default=0)
        self.device_lane = DeviceLane(self.streams, capacity) if self.device is not None else None
        # Host-lane weight uploads on a stream of their own: on the device lane's H2D stream they
        # would queue behind its waits for copies back, and the CPU with them.
        self.host_lane = HostLane(self.host_kernel_name, kernel, WeightUploader(self.streams))
        self.device_tier = DeviceTier(
            self.subgroups, config, self.device, self.device_lane, self.streams, host_kernel_name=self.host_kernel_name
        )
        self.device_tier.assign_lanes(self.knobs.device_fraction, self.transfers.buffers)
        if config.overlap_io and config.read_ahead_bytes:
            self.transfers.size_read_ahead(config.read_ahead_bytes)  # pinned, if the lane needs it, after the fit
        self.telemetry = TelemetryLog(config.run_dir, config.rank)
        if self.transfers.swaps:
            self.host_memory.watch(config.host_memory_floor_bytes, on_low=self._on_host_memory_low)

    def _home(self, index: int, numel: int, tier: Tier) -> Home:
        """Subgroup ``index``'s home in ``tier``: a swap file, device memory, or an exactly sized
        host buffer whose pages are touched at the first step."""
        if tier.path_index is not None:
            return Swapped(tier.path_index, self.swap_paths.create_file(index, numel, tier.path_index))
        if tier == DEVICE:
            return OnDevice(torch.empty(3 * numel, dtype=torch.float32, device=self.device))
        return InHost(StateBuffer(numel))  # pinned in place only if it takes the device lane

    # -- the step ------------------------------------------------------------------------------

    def step(self, hypers: Sequence[AdamWHyper]) -> StepRecord:
        """Update every subgroup once. ``hypers[g]`` are the hyper-parameters of param group g."""
        if self._closed:
            raise OffloadError("this optimizer engine was closed; create a new one")
        t_call = time.perf_counter()
        self._resume_clock_at(t_call)  # a pause not resumed ends at the step's start
        fwd_bwd_s, excluded_s, self._excluded_s = None, self._excluded_s, 0.0
        if self._last_step_end is not None:
            fwd_bwd_s = max(0.0, t_call - self._last_step_end - self._setup_s - excluded_s)
        try:
            with self._lock:
                rec = self._step(hypers, t_call, fwd_bwd_s, excluded_s)
        except BaseException as e:
            if isinstance(e, torch.OutOfMemoryError) and self.device is not None:
                with self._lock:  # the next step runs with a smaller tier, if the caller goes on
                    self.device_tier.out_of_memory(e, self.knobs.device_fraction, self.transfers.buffers)
            for hook in self._hooks:
                hook.on_error(self, e)
            raise
        for hook in self._hooks:
            hook.after_step(self, rec)
        return rec

    def _step(self, hypers: Sequence[AdamWHyper], t_call: float, fwd_bwd_s: float | None, excluded_s: float) -> StepRecord:
        write_wait_s = self._between_steps(fwd_bwd_s)  # knobs, the device fit, host memory: the step's setup
        t_start = time.perf_counter()
        setup_s, self._setup_s = t_start - t_call - write_wait_s + self._setup_s, 0.0
        # A step's bytes are those since the last step ended: the reads ahead during backward
        # and the writes behind during forward are this step's too.
        before = self._counters_at or self.swap_paths.counters()
        tally = _StepTally(pressure=self.host_memory.given_back)
        swaps = self.transfers.begin_step(self._swap_order())  # its first reads began during backward
        with threads_left_to_io(self.config.io_cores if swaps.order else 0):
            try:
                if self.device_lane:
                    # The step's first sync: backward's gradients and weights, on DeepSpeed's or
                    # the default stream, have landed before any lane reads them.
                    self.device_lane.begin_step()
                    t0 = time.perf_counter()
                    self.device_tier.update(hypers)  # first, on its own stream: never behind the lanes' copies
                    tally.kernel_s += time.perf_counter() - t0
                for i in step_order(len(self.subgroups), self.iteration):
                    sg = self.subgroups[i]
                    if isinstance(sg.home, Swapped):
                        self._update_swapped(sg, swaps, tally, hypers[sg.binding.group])
                    elif isinstance(sg.home, InHost):
                        self._update_resident(sg, sg.home.buffer, tally, hypers[sg.binding.group])
            except BaseException:
                self.transfers.abort(swaps)
                raise
        if tally.pressure:
            self._give_back_host_memory()
        elif not self.config.overlap_io:
            self.transfers.wait_writes()  # without overlap the step's writes land before it returns
        t0 = time.perf_counter()
        self._end_streams()
        device_wait_s = time.perf_counter() - t0
        rec = self._step_record(
            tally,
            swaps,
            before,
            t_start=t_start,
            write_wait_s=write_wait_s,
            update_s=time.perf_counter() - t_start + write_wait_s,
            device_wait_s=device_wait_s,
            setup_s=setup_s,
            fwd_bwd_s=fwd_bwd_s,
            excluded_s=excluded_s,
        )
        self.iteration += 1
        self.telemetry.append(rec)
        self._counters_at = self.swap_paths.counters()
        # The writes go on behind: step() returns once the weights are in place, and the next
        # step's first reads start now, behind them.
        if self.config.overlap_io:
            self.transfers.step_ended()
            self.read_ahead()
        self._last_step_end = time.perf_counter()
        return rec

    def _between_steps(self, fwd_bwd_s: float | None) -> float:
        """The step boundary: the hooks, the last step's writes, then the one-time work that is
        the step's setup and not its update (so that a tuner trial moving subgroups between lanes
        is measured without it): the knobs set, the device tier's fit, host memory given back or
        taken again. Returns the seconds waited for writes."""
        for hook in self._hooks:
            hook.before_step(self)  # a knob change it makes is applied just below
        # Write-behind: the last step's write-backs drain during forward and backward. The loop
        # waits for exactly the one it needs; only what moves files or buffers (a knob change, the
        # device tier's fit, a give-back) waits for all of them first.
        t0 = time.perf_counter()
        if self._pending_knobs is not None or self.device_tier.fit_pending or self.host_memory.low:
            self.transfers.wait_all()
        self.transfers.reap()
        write_wait_s = time.perf_counter() - t0
        self.transfers.raise_write_failure()
        if fwd_bwd_s is not None and self.transfers.size_read_ahead_once(fwd_bwd_s, self.swap_paths.read_bytes_per_s):
            self.device_tier.assign_lanes(self.knobs.device_fraction, self.transfers.buffers)  # pins the lane's new buffers
        self._apply_pending_knobs()
        if self.device_tier.fit_pending:
            self.fit_device_tier()
        else:
            self.device_tier.keep_margin(self.knobs.device_fraction, self.transfers.buffers)  # an eval may have come into it
        if self.host_memory.low:
            self._give_back_host_memory()
        elif self.host_memory.given_back:  # memory is back: the staging pool again, as deep as the budget holds
            self.host_memory.took_back()
            self.transfers.take_back(self.host_memory.affordable_depth(self.knobs.prefetch_depth, self.transfers.buffer_bytes))
        return write_wait_s

    def _update_swapped(self, sg: Subgroup, swaps: SwapPass, tally: _StepTally, hyper: AdamWHyper) -> None:
        """One swapped subgroup: read ahead, wait for its state, update it, write it back. Under
        memory pressure (the watch's flag, read at each subgroup) nothing is read ahead or kept."""
        if not tally.pressure and self.host_memory.low:
            tally.pressure = True
            self.transfers.resize(PRESSURE_BUFFERS)  # the free ones now; the rest at the step's end
        swaps.current = swaps.position[sg.index]
        if sg.stage is Stage.WRITING:  # its write behind the last step: wait for exactly that one
            t0 = time.perf_counter()
            self.transfers.wait_write(sg)
            swaps.read_wait_s += time.perf_counter() - t0
            if isinstance(sg.home, InHost):  # the write failed: its state stays in memory (raised next step)
                self._update_resident(sg, sg.home.buffer, tally, hyper)
                return
        depth = 0 if tally.pressure else self.knobs.prefetch_depth
        self.transfers.prefetch(swaps, swaps.current + depth)
        buf = self.transfers.stage(sg, swaps)
        self._run_update(sg, buf, hyper, tally, time.perf_counter())
        sg.swap.updated()
        # The tail stays in its buffers, unwritten: it is the head of the next step's (reversed)
        # order. As much of it as the pool holds beside the working buffers (at least depth + 1),
        # so the next step's first reads start at once instead of waiting for write-backs, and
        # a subgroup at the tail is written once for its two updates in a row, not twice.
        keep = 0 if tally.pressure else max(kept_subgroups(depth), self.transfers.pool_size - depth - 2)
        if swaps.current < len(swaps.order) - keep:
            self.transfers.write_back(sg)
        else:
            sg.swap.keep()

    def _update_resident(self, sg: Subgroup, buf: StateBuffer, tally: _StepTally, hyper: AdamWHyper) -> None:
        """One subgroup whose state is in host buffer ``buf`` (its first state counted in the update)."""
        t0 = time.perf_counter()
        sg.start_state(buf)
        self._run_update(sg, buf, hyper, tally, t0)

    def _run_update(self, sg: Subgroup, state: StateBuffer, hyper: AdamWHyper, tally: _StepTally, t0: float) -> None:
        """AdamW on ``state`` on the subgroup's lane; the time since ``t0`` is the step's kernel time."""
        if self.device_lane is not None and self.device_tier.on_device_lane(sg.index):
            self.device_lane.update_staged(state, sg.binding, sg.steps, hyper)
            tally.device_lane_subgroups += 1
        else:
            self.host_lane.update(state, sg.binding, sg.steps, hyper)
            tally.host_lane_s += time.perf_counter() - t0
            tally.host_lane_subgroups += 1
        tally.kernel_s += time.perf_counter() - t0

    def _end_streams(self) -> None:
        """The step's end on the device: every stream that wrote weights the model reads (the
        host lane's uploads, the device lane's updates, the device tier's) is joined to the
        caller's current stream, so DeepSpeed's all-gather inside ``step()``, a checkpoint's
        gather and the next forward are ordered after the new weights whatever stream they run
        on. Then the step's one host sync: the lanes' tail, measured as ``device_wait_s``, and
        no work of this step is left running when the caller frees or reuses its buffers."""
        current = self.streams.current()
        weight_streams = [self.host_lane.weights.stream]
        if self.device_lane:
            weight_streams += self.device_lane.weight_streams
        for s in weight_streams:
            current.wait_stream(s)  # the caller's next work after each stream's weight writes
        self.host_lane.weights.stream.synchronize()  # the host lane's last uploads have left its pinned buffers
        if self.device_lane:
            self.device_lane.sync()  # the lane's copies back into host buffers have landed

    def _swap_order(self) -> list[int]:
        """The swapped subgroups of the next (or current) step, in its order."""
        return [i for i in step_order(len(self.subgroups), self.iteration) if self.subgroups[i].tier.swapped]

    def _step_record(
        self,
        tally: _StepTally,
        swaps: SwapPass,
        before: list[PathCounters],
        *,
        t_start: float,
        update_s: float,
        write_wait_s: float,
        device_wait_s: float,
        setup_s: float,
        fwd_bwd_s: float | None,
        excluded_s: float,
    ) -> StepRecord:
        """The step's record: its times, the bytes each path moved since ``before``, the lanes."""
        moved = self.swap_paths.moved_since(before)
        cuda = self.device if self.device is not None and self.device.type == "cuda" else None
        headroom = gpu_headroom_bytes(cuda) if cuda is not None else None
        return StepRecord(
            iteration=self.iteration,
            update_s=update_s,
            read_wait_s=swaps.read_wait_s,
            kernel_s=tally.kernel_s,
            write_wait_s=write_wait_s,
            **moved,
            read_bytes_per_s=sum(moved["bytes_read"].values()) / update_s if update_s else 0.0,
            write_bytes_per_s=sum(moved["bytes_written"].values()) / update_s if update_s else 0.0,
            cache_hits=swaps.hits,
            cache_misses=swaps.misses,
            host_lane_subgroups=tally.host_lane_subgroups,
            device_lane_subgroups=tally.device_lane_subgroups,
            device_tier_subgroups=sum(sg.tier == DEVICE for sg in self.subgroups),
            host_lane_s=tally.host_lane_s,
            fwd_bwd_s=fwd_bwd_s,
            device_headroom_bytes=headroom,
            device_usable_bytes=usable_bytes(cuda) if cuda is not None else None,
            device_wait_s=device_wait_s,
            setup_s=setup_s,
            params=sum(sg.numel for sg in self.subgroups),
            knobs=self.knobs,
            start_s=t_start - write_wait_s,
            host_bytes=self.host_usage(),
            host_budget_bytes=self.host_memory.budget_bytes,
            host_pressure=tally.pressure,
            read_ahead_bytes=self.transfers.read_ahead_bytes,
            excluded_s=excluded_s,
        )

    @contextlib.contextmanager
    def setup_time(self) -> Iterator[None]:
        """Time one-time work an adapter does between steps for the engine (allocating the
        gradient buffers of subgroups that moved lanes): it is taken out of the next step's
        ``fwd_bwd_s`` and counted in its ``setup_s``, so that a tuner's trial is not charged
        with it."""
        t0 = time.perf_counter()
        try:
            yield
        finally:
            self._setup_s += time.perf_counter() - t0

    # -- the iteration's clock -----------------------------------------------------------------------
    # A step's fwd_bwd_s and a tuner's iteration time are this iteration's work only: the time
    # since the last step's end less the adapter's one-time setup (setup_time) and what the
    # calls below exclude (StepRecord.excluded_s). Before the first step they do nothing: its
    # record has no fwd_bwd_s, and a tuner no iteration time for it.

    def skipped_step(self) -> None:
        """An iteration ended without this engine's step (an fp16 overflow: the adapter skipped
        the update): its time since the last step's end (less setup) is excluded from the next
        step's, whose ``fwd_bwd_s`` then covers the next iteration alone."""
        if self._last_step_end is None:
            return
        now = time.perf_counter()
        # Everything since the last step's end that is not setup is now excluded; a pause in
        # progress is covered up to now, and goes on from here.
        self._excluded_s = max(self._excluded_s, now - self._last_step_end - self._setup_s)
        if self._paused is not None:
            self._paused = (now, self._setup_s)

    def pause_clock(self) -> None:
        """Training pauses between steps (DeepSpeed's ``offload_states``: an RLHF loop frees the
        GPU for generation): the time until :meth:`resume_clock` (or the next step's start, if
        it comes first) is excluded from the next step's ``fwd_bwd_s`` and a tuner's iteration
        time. Calling it again while paused changes nothing."""
        if self._last_step_end is not None and self._paused is None:
            self._paused = (time.perf_counter(), self._setup_s)

    def resume_clock(self) -> None:
        """Training resumes (``reload_states``): the pause since :meth:`pause_clock` goes to
        the next step's ``excluded_s``. Harmless when not paused."""
        self._resume_clock_at(time.perf_counter())

    def _resume_clock_at(self, now: float) -> None:
        if self._paused is None:
            return
        (since, setup_then), self._paused = self._paused, None
        self._excluded_s += max(0.0, now - since - (self._setup_s - setup_then))

    # -- transfers between steps -------------------------------------------------------------------

    def read_ahead(self) -> int:
        """Start reading the state of the swapped subgroups the next step updates first, into
        free staging buffers and buffers of clean copies needed later, without waiting for
        anything: their state does not depend on the gradients, so the reads run during forward
        and backward. Returns the reads started. The engine calls it at a step's end and as
        writes land; adapters call it when backward begins (``OffloadAdamW`` from a gradient
        hook). Calling it again, or not at all, is harmless."""
        if not self.config.overlap_io or not self._lock.acquire(blocking=False):  # re-entrant at a step's end
            return 0
        try:
            return 0 if self._closed or self.host_memory.low else self.transfers.read_ahead(self._swap_order())
        finally:
            self._lock.release()

    def flush(self) -> None:
        """Wait for the transfers still running behind the last step: the writes (raising the
        first that failed; its state stays in memory, nothing is lost) and the reads ahead
        (their buffers keep the state they read). Nothing more is read ahead until the next
        step or :meth:`read_ahead`, so the files are still once it returns."""
        with self._lock:
            self.transfers.flush()

    # -- host memory -------------------------------------------------------------------------------

    def host_usage(self) -> HostUsage:
        """What the engine holds in host memory now, by kind (``engine.host_memory``)."""
        staging, kept = self.transfers.host_bytes()
        state = sum(host_buffer_bytes(sg.home.buffer.capacity_numel) for sg in self.subgroups if isinstance(sg.home, InHost))
        return HostUsage(
            state=state, staging=staging, kept=kept, copies=self.host_lane.host_bytes() + self.device_tier.host_copy_bytes()
        )

    def _give_back_host_memory(self) -> None:
        """Under pressure, between steps: free what the engine keeps beyond its working set."""
        held = self.host_usage().total
        self.transfers.give_back()  # every transfer landed, kept copies written back, the pool shrunk
        self.device_tier.drop_host_copies()  # made again at the next release
        heap.release_freed()  # what the C library kept of it, and of the script's own frees
        self.host_memory.gave_back(held)

    def _on_host_memory_low(self) -> None:
        """The memory watch's thread: memory just ran low. Give back now if the engine is idle (between
        steps, in forward and backward); a step in progress gives back at its next decision."""
        if self._lock.acquire(blocking=False):
            try:
                if not self.host_memory.closed:
                    self._give_back_host_memory()
            finally:
                self._lock.release()

    # -- knobs -------------------------------------------------------------------------------------

    def add_step_hook(self, hook: StepHook) -> None:
        """Call ``hook`` around every step (``engine.hooks``); the engine closes it in ``close()``."""
        self._hooks.append(hook)

    @property
    def next_knobs(self) -> Knobs:
        """The knobs the next step runs with: those set and not yet applied, else those in force."""
        return self._pending_knobs or self.knobs

    def set_knobs(self, knobs: Knobs) -> None:
        """Validate ``knobs`` now; apply them at the start of the next ``step()`` (a prefetch
        deeper than the host budget holds is lowered to the deepest that fits, with one line)."""
        self._check(knobs)
        with self._lock:
            self._pending_knobs = knobs

    def _check(self, knobs: Knobs) -> None:
        knobs.check_for([p.path for p in self.config.paths], has_device=self.device is not None)

    def _apply_pending_knobs(self) -> None:
        knobs, self._pending_knobs = self._pending_knobs, None
        if knobs is None:
            return
        refused = self._knobs_refusal(knobs)
        if refused:  # checked before anything moves: the step runs with the knobs it had
            log.warning(
                "offloadctl: knobs %s refused at iteration %d, the old ones kept: %s",
                {n: v for n, v in knobs.to_dict().items() if v != getattr(self.knobs, n)},
                self.iteration,
                refused,
            )
            return
        fraction = self.device_tier.usable_fraction(knobs.device_fraction)
        if fraction != knobs.device_fraction:
            knobs = knobs.replace(device_fraction=fraction)
        depth = self.host_memory.affordable_depth(knobs.prefetch_depth, self.transfers.buffer_bytes)
        if depth != knobs.prefetch_depth:
            if self._too_deep_warned != knobs.prefetch_depth:
                log.warning(
                    "offloadctl: prefetch_depth=%d lowered to %d: deeper staging does not fit the host memory budget (%s)",
                    knobs.prefetch_depth,
                    depth,
                    format_size(self.host_memory.budget_bytes),
                )
                self._too_deep_warned = knobs.prefetch_depth
            knobs = knobs.replace(prefetch_depth=depth)
        old, self.knobs = self.knobs, knobs
        self.swap_paths.set_limits(knobs)
        self.transfers.resize_for(depth)
        self.swap_paths.restripe(self.subgroups, knobs, old)
        self.device_tier.assign_lanes(knobs.device_fraction, self.transfers.buffers)  # last: it pins the pool as it now is

    def _knobs_refusal(self, knobs: Knobs) -> str | None:
        """Why ``knobs`` cannot run in this engine (what ``set_knobs`` checks, and the stripe of
        the swapped subgroups over the paths' weights), or None."""
        try:
            self._check(knobs)
            self.swap_paths.check_stripe(self.subgroups, knobs, self.knobs)
        except ConfigError as e:
            return str(e)
        return None

    # -- the device ----------------------------------------------------------------------------------

    def fit_device_tier(
        self, grad_bytes_per_element: int = 0, headroom_bytes: int | None = None, reserve_bytes: int = 0
    ) -> DeviceFit:
        """Fit the device tier and the device lane to the device memory free now: at the first
        step, or by an adapter before it (:meth:`engine.device_tier.DeviceTier.fit` says what the
        arguments mean). The fit may set the device fraction. Returns the decision, for logs."""
        fit = self.device_tier.fit(
            self.knobs.device_fraction,
            grad_bytes_per_element,
            headroom_bytes,
            reserve_bytes,
            staging=self.transfers.buffers,
            release_staged=self.transfers.release,
            host_fits=self.host_memory.fits,
        )
        if self.device is not None and fit.device_fraction != self.knobs.device_fraction:
            self.knobs = self.knobs.replace(device_fraction=fit.device_fraction)
        return fit

    def release_device(self) -> None:
        """Give back every byte the engine holds on the device, between steps (DeepSpeed's
        ``offload_states``: RLHF frameworks free the GPU for generation between training steps);
        the next step fits the device tier and lane again (:meth:`~engine.device_tier.DeviceTier.release`)."""
        if self.device is None:
            return
        with self._lock:
            self.transfers.wait_all()
            self._end_streams()
            self.device_tier.release()

    def device_grad_subgroups(self) -> list[int]:
        """Subgroups whose gradients are best produced on the device for the next step: a device
        fraction set and not yet applied counts (an adapter places gradients between steps)."""
        pending = self._pending_knobs
        return self.device_tier.grad_subgroups(
            None if pending is None else pending.device_fraction, in_force=self.knobs.device_fraction
        )

    # -- state access (checkpoints) ----------------------------------------------------------

    def read_state(self, index: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, list[int]]:
        """Copies of subgroup ``index``'s (master, exp_avg, exp_avg_sq) on the CPU, and its steps."""
        with self._lock:
            self.transfers.wait_all()
            sg = self.subgroups[index]
            if sg.tier == DEVICE:
                return (*self.device_tier.state_copy(sg), list(sg.steps))
            buf = host_state(sg)
            buf.wait_ready()  # a device-lane copy back into it has landed
            return buf.master.clone(), buf.exp_avg.clone(), buf.exp_avg_sq.clone(), list(sg.steps)

    def write_state(
        self, index: int, master: torch.Tensor, exp_avg: torch.Tensor, exp_avg_sq: torch.Tensor, steps: Sequence[int]
    ) -> None:
        """Replace subgroup ``index``'s state (flat tensors of its numel, any device). The
        sources are read as data: a checkpoint's tensors may require grad, and the state is
        never part of a graph."""
        with torch.no_grad(), self._lock:
            self.transfers.wait_all()
            sg = self.subgroups[index]
            sources = (master.detach(), exp_avg.detach(), exp_avg_sq.detach())
            sg.steps[:] = list(steps)
            if isinstance(sg.home, Swapped):
                self.transfers.write_now(sg, sources)
            else:  # master, exp_avg and exp_avg_sq back to back, on the device or in a host buffer
                state = sg.home.state if isinstance(sg.home, OnDevice) else sg.home.buffer.state
                for dst, src in zip(torch.split(state, sg.numel), sources):
                    dst.copy_(src)
            sg.fresh = False

    # -- lifecycle -------------------------------------------------------------------------------

    def close(self) -> None:
        """Finish pending writes and remove every swap file. Idempotent."""
        if self._closed:
            return
        if getattr(self, "host_memory", None) is not None:  # absent when construction failed before it
            self.host_memory.close()
        with self._lock:
            self._closed = True
            close_hooks(self._hooks)  # a hook's failure must not keep the swap files on disk
            for part in ("host_lane", "transfers", "swap_paths"):  # absent when construction failed before it
                if getattr(self, part, None) is not None:
                    getattr(self, part).close()

    def describe(self) -> EngineFacts:
        """The plan in force: for logs, ``--dry-run`` and the tuner (which learns what it tunes
        from this, not from the engine's internals)."""
        return facts_of(self)
