"""The multi-tier optimizer-state engine: one update loop over flat subgroups.

Each subgroup's fp32 state (master, exp_avg, exp_avg_sq) lives in one tier: device memory,
host memory, or a swap file on a storage path. ``step()`` visits every subgroup once:

- **Order.** 0..N-1 on even iterations, N-1..0 on odd ones (MLP-Offload). The last
  ``prefetch_depth + 1`` swapped subgroups updated are not written back; their staging
  buffers are kept and they are the first ones updated next iteration, with no write and
  re-read in between.
- **Prefetch.** Reads of the next ``prefetch_depth`` swapped subgroups are issued while the
  current one updates, and each updated subgroup is written back asynchronously. Staging
  buffers: ``prefetch_depth + 2`` working ones (reading ahead, updating, writing back) plus
  ``prefetch_depth + 1`` kept across the step boundary.
- **Lanes.** A ``device_fraction`` of the subgroups outside the device tier, evenly
  interleaved, is updated on the device lane; the rest on the host lane (Deep Optimizer States).
- **Device tier.** A prefix of subgroups keeps its state in device memory and is updated
  there with no transfer. Its size is ``device_cache_bytes``, or, when that is None, what the
  GPU has free after the first forward/backward, less a safety margin (:meth:`fit_device_tier`).
- **Overlap** (``EngineConfig.overlap_io``). A step's write-backs drain behind it, during the
  next forward and backward; whatever needs those bytes waits for exactly them. Between steps,
  the next step's first swapped subgroups are read ahead into free staging buffers (and buffers
  of the read-ahead budget, ``EngineConfig.read_ahead_bytes``): at the step's end, as writes
  land, and when backward starts. A buffer whose write landed keeps its subgroup's state as a
  clean copy until it is needed for another, so a subgroup updated again before that reads nothing.
- **Knobs** set with :meth:`set_knobs` take effect at the start of the next step, when no
  transfer is in flight.

The engine is driven by an adapter that supplies one :class:`SubgroupBinding` per subgroup
(``OffloadAdamW``; the DeepSpeed ZeRO-3 integration). Where state goes is
:mod:`engine.placement`, where it is updated :mod:`engine.lanes`, how it moves
:mod:`engine.storage`.
"""
from __future__ import annotations

import contextlib
import logging
import threading
import time
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Sequence

import psutil
import torch

from engine.adamw import AdamWHyper
from engine.binding import SubgroupBinding, flat_weights_of
from engine.buffers import StateBuffer, payload_bytes
from engine.config import EngineConfig, Knobs
from engine.errors import ConfigError, OffloadError
from engine.facts import DeviceFit, EngineFacts
from engine.gpumem import gpu_headroom_bytes, measure_lane_rates, reset_peak
from engine.host_kernel import host_lane_rate, node_memory_bandwidth, select_host_kernel
from engine.host_memory import HostUsage, PressureWatch, default_budget, default_floor, staging_room
from engine.lane_model import LaneRates, balanced_fraction, lane_assignment, memory_share
from engine.lanes import DeviceLane, HostLane, WeightUploader
from engine.layout import deepest_prefetch, forward_order, host_buffer_bytes, kept_subgroups, read_ahead_bytes, staging_buffers
from engine.placement import DEVICE, HOST, Placement, device_lane_working_bytes, device_tier_prefix, place, stripe, swap_tier
from engine.staging import StagingPool, Subgroup
from engine.storage.io_backends import open_backend
from engine.storage.paths import SwapFile, SwapPath, check_usable, measure_bandwidth
from engine.streams import resolve_lane_device, streams_for
from engine.telemetry import StepRecord, TelemetryLog
from engine.units import format_size

log = logging.getLogger(__name__)

PRESSURE_BUFFERS = 2
"""Staging buffers left under memory pressure: one updating, one writing back; no read-ahead."""


def first_state(binding: SubgroupBinding, buf: StateBuffer) -> None:
    """A subgroup's state before its first update: master from the model's weights, zero moments."""
    binding.read_weights(buf.master)
    buf.exp_avg.zero_()
    buf.exp_avg_sq.zero_()


@dataclass
class _StepState:
    seq: list[int]  # swapped subgroups in this step's order
    pos: dict[int, int]  # subgroup -> position in seq
    next_read: int = 0  # first position of seq not yet considered for prefetch
    current: int = 0  # position of seq being updated: those before it are done this step
    reads: dict[int, Future] = field(default_factory=dict)
    read_wait_s: float = 0.0
    kernel_s: float = 0.0  # AdamW on either lane, and queueing the device tier's
    host_lane_s: float = 0.0
    lane_subgroups: list[int] = field(default_factory=lambda: [0, 0])  # host lane, device lane
    hits: int = 0
    misses: int = 0
    pressure: bool = False  # host memory ran low during the step


class SubgroupEngine:
    """Owns every subgroup's optimizer state and runs the per-step update loop."""

    def __init__(self, bindings: Sequence[SubgroupBinding], config: EngineConfig, knobs: Knobs | None = None) -> None:
        self.config = config
        self.knobs = knobs or Knobs()
        self._pending_knobs: Knobs | None = None
        self._hooks: list = []
        self.iteration = 0
        self._closed = False
        self.device = resolve_lane_device(config.device)
        self.knobs.check_for([p.path for p in config.paths], has_device=self.device is not None)
        self._lane_grad_budget = 0  # device bytes for device-lane gradients (set by fit_device_tier)
        self._device_grads: set[int] = set()  # device-lane subgroups whose gradients fit that budget
        self._lane_room = True  # the device has room for the device lane's slots (False: fit found none)
        self._setup_s = 0.0  # one-time work outside a step (setup_time()) not yet taken out of fwd_bwd_s
        self._lane_rates: LaneRates | None = None
        self._lane_off_said = False
        # Held by every entry point that touches the state, so that the memory watch's thread
        # gives buffers back only while the engine is idle.
        self._lock = threading.RLock()
        self._pressure: PressureWatch | None = None
        self._gave_back = False  # buffers were given back under pressure and not yet taken again
        self._depth_said: int | None = None
        self._early_reads: dict[int, Future] = {}  # read_ahead()'s reads, taken by the next step
        self._counters_at: list[tuple[int, int]] | None = None  # the paths' byte counters at the last step's end
        self._read_ahead_buffers = 0  # staging buffers of the read-ahead budget, beyond the working ones
        self._quiet = False  # after flush(): writes landing start no reads ahead until the next step
        self._read_ahead_sized = config.read_ahead_bytes is not None or not config.overlap_io
        # After a first release_device() (an RLHF loop's offload_states), the device tier keeps its
        # pinned host buffers while on the device, within the host budget: the next release copies
        # into them at PCIe speed instead of into fresh pageable memory.
        self._keep_host_copies = False

        sizes = [payload_bytes(b.numel) for b in bindings]
        self.paths: list[SwapPath] = []
        self.path_bandwidth: list[float] = []
        self.path_read_bandwidth: list[float] = []
        host_only = config.host_cache_bytes is None
        if config.paths and not host_only:
            backend = open_backend(config.io_backend)
            self.io_backend = backend.name
            for spec in config.paths:
                self.paths.append(SwapPath(spec, backend, concurrency=self.knobs.concurrency_for(spec.path),
                                           node_lock=self.knobs.node_lock, verify_checksums=config.verify_checksums,
                                           rank=config.rank))
            rates = [self._rates_of(p) for p in self.paths]
            self.path_read_bandwidth = [r for r, _ in rates]
            # A read plus a write of the same bytes: what a subgroup's round trip costs a path.
            self.path_bandwidth = [1.0 / (1.0 / r + 1.0 / w) for r, w in rates]
        else:
            self.io_backend = None
            for spec in config.paths:  # unused, but a bad path is still an error at construction
                check_usable(spec.path)

        if (config.device_cache_bytes is None or config.device_cache_bytes > 0) and self.device is None:
            raise ConfigError("device_cache_bytes needs a device: set device='cuda' (or 'cpu' in tests), or "
                              "device_cache_bytes=0")
        # Fitted at the first step, once forward/backward has shown what device memory it needs.
        self._device_tier_pending = self.device is not None
        placement = place(sizes, device_budget=config.device_cache_bytes or 0, host_budget=config.host_cache_bytes,
                          path_weights=self._stripe_weights(self.knobs))
        self.subgroups = [Subgroup(i, b, t, [0] * len(b.slice_numels))
                          for i, (b, t) in enumerate(zip(bindings, placement.tiers))]
        # The subgroups the device budget placed there (placement fills it in order, skipping those
        # that do not fit: not always a prefix); the fit puts them back after release_device().
        self._placed_on_device = {i for i, t in enumerate(placement.tiers) if t == DEVICE}
        try:
            self.host_budget = self._host_budget(bindings, placement)  # before allocating: a refusal costs nothing
            self._allocate(placement)
            if self.staging.capacity_numel:
                floor = config.host_memory_floor_bytes
                self._pressure = PressureWatch(default_floor() if floor is None else floor, on_low=self._on_low_memory)
        except BaseException:
            self.close()
            raise

        self.host_kernel_name, kernel = select_host_kernel(config.host_adam)
        capacity = max((sg.numel for sg in self.subgroups), default=0)
        self.streams = streams_for(self.device if self.device is not None else torch.device("cpu"))
        self.device_lane = DeviceLane(self.streams, capacity) if self.device is not None else None
        # Host-lane weight uploads on a stream of their own: on the device lane's H2D stream they
        # would queue behind its waits for copies back, and the CPU with them.
        self.host_lane = HostLane(self.host_kernel_name, kernel, WeightUploader(self.streams))
        self._grad_bytes_per_element = 0
        self._last_step_end: float | None = None
        self._set_lane_mask(self.knobs.device_fraction)
        if config.overlap_io and config.read_ahead_bytes:
            self._size_read_ahead(config.read_ahead_bytes)
        self.telemetry = TelemetryLog(config.run_dir, config.rank)

    # -- construction ------------------------------------------------------------------------

    @staticmethod
    def _rates_of(p: SwapPath) -> tuple[float, float]:
        """Read and write bytes/s of a path: declared, else probed now; within its cap."""
        r, w = p.spec.read_bytes_per_s, p.spec.write_bytes_per_s
        if r is None or w is None:
            mr, mw = measure_bandwidth(p)
            r, w = r or mr, w or mw
        if p.spec.cap_bytes_per_s:
            r, w = min(r, p.spec.cap_bytes_per_s), min(w, p.spec.cap_bytes_per_s)
        return r, w

    def _stripe_weights(self, knobs: Knobs) -> list[float]:
        return [knobs.stripe_weights.get(p.path, bw) for p, bw in zip(self.paths, self.path_bandwidth)]

    def _allocate(self, placement: Placement) -> None:
        for sg in self.subgroups:
            if sg.tier == DEVICE:
                sg.resident = torch.empty(3 * sg.numel, dtype=torch.float32, device=self.device)
            elif sg.tier == HOST:
                # Exact size; pages are touched at the first step. Pinned in place only if the
                # subgroup takes the device lane.
                sg.resident = StateBuffer(sg.numel)
            else:
                sg.file = self._create_file(sg, sg.tier.path_index)
        swapped = [sg.numel for sg in self.subgroups if sg.tier.swapped]
        self.staging = StagingPool(max(swapped, default=0))
        if swapped and self.config.overlap_io:
            self.staging.on_landed = self._pump
        self.staging.resize(staging_buffers(self.knobs.prefetch_depth) if swapped else 0)

    def _host_budget(self, bindings: Sequence[SubgroupBinding], placement: Placement) -> int:
        """The rank's host-memory budget (``engine.host_memory``): the one given, which the start
        must fit, else the default raised to what the start needs."""
        swapped = [b.numel for b, t in zip(bindings, placement.tiers) if t.swapped]
        weights = [flat_weights_of(b) for b in bindings]
        on_device = [w for w in weights if w is not None and w.device.type != "cpu"]
        need = HostUsage(
            state=sum(host_buffer_bytes(b.numel) for b, t in zip(bindings, placement.tiers) if t == HOST),
            staging=staging_buffers(self.knobs.prefetch_depth) * host_buffer_bytes(max(swapped)) if swapped else 0,
            # the host lane's gradient scratch, and the uploads' pinned chunk buffers when weights are on a device
            copies=HostLane.scratch_bytes(max((b.numel for b in bindings), default=0))
            + (WeightUploader.pinned_bytes(torch.get_num_threads()) if on_device else 0))
        budget = self.config.host_memory_bytes
        if budget is None:
            return max(default_budget(self.config.local_ranks), need.total)
        if need.total > budget:
            parts = ", ".join(f"{format_size(v)} {k}" for k, v in need.to_dict().items() if v)
            raise ConfigError(
                f"host memory budget {format_size(budget)} (--host-memory) is below what this rank needs to start: "
                f"{format_size(need.total)} ({parts}, prefetch depth {self.knobs.prefetch_depth}); raise --host-memory, "
                f"or lower --host-cache or --prefetch-depth")
        return budget

    def host_usage(self) -> HostUsage:
        """What the engine holds in host memory now, by kind (``engine.host_memory``)."""
        state = sum(host_buffer_bytes(sg.resident.capacity_numel) for sg in self.subgroups
                    if sg.tier == HOST and isinstance(sg.resident, StateBuffer))
        kept = sum(host_buffer_bytes(sg.staged.capacity_numel) for sg in self.subgroups
                   if sg.staged is not None and sg.kept)
        pool = self.staging.size * self.staging.buffer_bytes
        tier_copies = sum(host_buffer_bytes(sg.host_copy.capacity_numel) for sg in self.subgroups
                          if sg.host_copy is not None)
        return HostUsage(state=state, staging=max(0, pool - kept), kept=kept,
                         copies=self.host_lane.host_bytes() + tier_copies)

    def _affordable_depth(self, depth: int) -> int:
        """The deepest prefetch up to ``depth`` whose staging buffers fit the budget's spare bytes."""
        if not self.staging.capacity_numel:
            return depth
        spare = staging_room(self.host_budget, self.host_usage())
        return max(0, min(depth, deepest_prefetch(spare // self.staging.buffer_bytes)))

    # -- memory pressure ---------------------------------------------------------------------

    def _low_memory(self) -> bool:
        return self._pressure is not None and self._pressure.low.is_set()

    def _on_low_memory(self) -> None:
        """The watch's thread: memory just ran low. Give back now if the engine is idle (between
        steps, in forward and backward); a step in progress gives back at its next decision."""
        if self._lock.acquire(blocking=False):
            try:
                if not self._closed:
                    self._give_back()
            finally:
                self._lock.release()

    def _give_back(self) -> None:
        """Under pressure, between steps: write back what kept buffers hold that is newer than its
        file, and free every staging buffer beyond :data:`PRESSURE_BUFFERS`. Said in one line."""
        before = self.host_usage().total
        self._settle()  # the writes behind the last step land first: a buffer is written back once
        for sg in self.subgroups:
            sg.host_copy = None  # the device tier's spare host buffers: made again at the next release
            if sg.staged is not None and sg.dirty:
                self.staging.write_back(sg)
        self.staging.drain()
        for sg in self.subgroups:
            self.staging.release(sg)
        self.staging.resize(min(self.staging.size, PRESSURE_BUFFERS))
        if not self._gave_back:
            self._gave_back = True
            avail, floor = self._pressure.available_bytes, self._pressure.floor_bytes
            log.warning("offloadctl: host memory low (%s available, floor %s): gave back %s of kept and read-ahead "
                        "staging buffers; reading ahead again when memory recovers",
                        format_size(avail), format_size(floor), format_size(before - self.host_usage().total))

    def _recover(self) -> None:
        """Memory is back above the floor: the staging pool the knobs ask for, within the budget."""
        self._gave_back = False
        depth = self._affordable_depth(self.knobs.prefetch_depth)
        self.staging.resize(staging_buffers(depth) + self._read_ahead_buffers)
        log.warning("offloadctl: host memory recovered (%s available): reading ahead again",
                    format_size(self._pressure.available_bytes))

    def _create_file(self, sg: Subgroup, path_index: int) -> SwapFile:
        return self.paths[path_index].create_file(sg.index, sg.numel, payload_bytes(sg.numel), self.config.io_chunk_bytes)

    # -- knobs ---------------------------------------------------------------------------------

    def add_step_hook(self, hook) -> None:
        """Call ``hook`` around every step (``engine.hooks``); the engine closes it in ``close()``."""
        self._hooks.append(hook)

    @property
    def next_knobs(self) -> Knobs:
        """The knobs the next step runs with: those set and not yet applied, else those in force."""
        return self._pending_knobs or self.knobs

    def set_knobs(self, knobs: Knobs) -> None:
        """Validate ``knobs`` now; apply them at the start of the next ``step()`` (a prefetch
        deeper than the host budget holds is lowered to the deepest that fits, with one line)."""
        knobs.check_for([p.path for p in self.config.paths], has_device=self.device is not None)
        with self._lock:
            self._pending_knobs = knobs

    def _apply_pending_knobs(self) -> None:
        k, self._pending_knobs = self._pending_knobs, None
        if k is None:
            return
        refused = self._knobs_refusal(k)
        if refused:  # checked before anything moves: the step runs with the knobs it had
            log.warning("offloadctl: knobs %s refused at iteration %d, the old ones kept: %s",
                        {n: v for n, v in k.to_dict().items() if v != getattr(self.knobs, n)}, self.iteration, refused)
            return
        if k.device_fraction > 0 and not self._lane_room:
            if not self._lane_off_said:
                log.warning("offloadctl: device_fraction=%g ignored: the device lane has no room on the device "
                            "(see the device fit at the first step)", k.device_fraction)
                self._lane_off_said = True
            k = k.replace(device_fraction=0.0)
        depth = self._affordable_depth(k.prefetch_depth)
        if depth != k.prefetch_depth:
            if self._depth_said != k.prefetch_depth:
                log.warning("offloadctl: prefetch_depth=%d lowered to %d: deeper staging does not fit the host memory "
                            "budget (%s)", k.prefetch_depth, depth, format_size(self.host_budget))
                self._depth_said = k.prefetch_depth
            k = k.replace(prefetch_depth=depth)
        if self.staging.capacity_numel:  # the read-ahead budget yields to the working buffers
            room = staging_room(self.host_budget, self.host_usage()) // self.staging.buffer_bytes
            self._read_ahead_buffers = max(0, min(self._read_ahead_buffers, room - staging_buffers(depth)))
        old, self.knobs = self.knobs, k
        for p in self.paths:
            p.set_limits(concurrency=k.concurrency_for(p.path), node_lock=k.node_lock)
        size = staging_buffers(k.prefetch_depth) + self._read_ahead_buffers
        if size != self.staging.size and self.staging.size:
            self.staging.resize(size)
            # Shrinking may need buffers back: clean copies first, then kept ones written out.
            if self.staging.size > size:
                self.staging.release_clean(self.subgroups)
                self.staging.resize(size)
            while self.staging.size > size:
                kept = next((sg for sg in self.subgroups if sg.staged is not None and sg.kept), None)
                if kept is None:
                    break
                self.staging.write_back(kept)
                self.staging.drain()
                self.staging.release(kept)
                self.staging.resize(size)
        if self._stripe_weights(k) != self._stripe_weights(old):
            self._restripe(k)
        self._set_lane_mask(k.device_fraction)  # last: it pins the staging pool as it now is

    def _knobs_refusal(self, k: Knobs) -> str | None:
        """Why the knobs ``k`` cannot run in this engine (what ``set_knobs`` checks, and the
        stripe of the swapped subgroups over the paths' weights), or None."""
        try:
            k.check_for([p.path for p in self.config.paths], has_device=self.device is not None)
            swapped = [payload_bytes(sg.numel) for sg in self.subgroups if sg.tier.swapped]
            if swapped and self._stripe_weights(k) != self._stripe_weights(self.knobs):
                stripe(swapped, self._stripe_weights(k))
        except ConfigError as e:
            return str(e)
        return None

    def _restripe(self, knobs: Knobs) -> None:
        """Move swapped subgroups to new paths lazily: each goes at its next write."""
        swapped = [sg for sg in self.subgroups if sg.tier.swapped]
        targets = stripe([payload_bytes(sg.numel) for sg in swapped], self._stripe_weights(knobs))
        for sg, p in zip(swapped, targets):
            if p == sg.tier.path_index:
                continue
            if sg.next_file is not None:
                sg.next_file.path.remove_file(sg.next_file)
                sg.next_file = None
            sg.tier = swap_tier(p)
            if sg.file.path is self.paths[p]:
                continue  # back on the path that holds its state (a move not yet done): nothing to move
            if sg.fresh:  # nothing on storage yet: move the empty file now
                sg.file.path.remove_file(sg.file)
                sg.file = self._create_file(sg, p)
            else:
                sg.next_file = self._create_file(sg, p)

    # -- the step ------------------------------------------------------------------------------

    @contextlib.contextmanager
    def setup_time(self):
        """Time one-time work an adapter does between steps for the engine (allocating the
        gradient buffers of subgroups that moved lanes): it is taken out of the next step's
        ``fwd_bwd_s`` and counted in its ``setup_s``, so that a tuner's trial is not charged
        with it."""
        t0 = time.perf_counter()
        try:
            yield
        finally:
            self._setup_s += time.perf_counter() - t0

    def step(self, hypers: Sequence[AdamWHyper]) -> StepRecord:
        """Update every subgroup once. ``hypers[g]`` are the hyper-parameters of param group g."""
        if self._closed:
            raise OffloadError("this optimizer engine was closed; create a new one")
        t_call = time.perf_counter()
        fwd_bwd_s = None
        if self._last_step_end is not None:
            fwd_bwd_s = max(0.0, t_call - self._last_step_end - self._setup_s)
        try:
            with self._lock:
                rec = self._step(hypers, t_call, fwd_bwd_s)
        except BaseException as e:
            for hook in self._hooks:
                hook.on_error(self, e)
            raise
        for hook in self._hooks:
            hook.after_step(self, rec)
        return rec

    def _step(self, hypers: Sequence[AdamWHyper], t_call: float, fwd_bwd_s: float | None) -> StepRecord:
        for hook in self._hooks:
            hook.before_step(self)  # a knob change it makes is applied just below
        # Write-behind: the last step's write-backs drain during forward and backward. The loop
        # waits for exactly the one it needs; only what moves files or buffers (a knob change, the
        # device tier's fit, a give-back) waits for all of them first.
        t0 = time.perf_counter()
        if self._pending_knobs is not None or self._device_tier_pending or self._low_memory():
            self._settle()
        self.staging.reap()
        write_wait_s = time.perf_counter() - t0
        self._raise_write_failure()
        if not self._read_ahead_sized and fwd_bwd_s is not None:
            self._read_ahead_sized = True
            self._size_read_ahead(read_ahead_bytes(fwd_bwd_s, sum(self.path_read_bandwidth)))
        # One-time work (a knob change pinning buffers, the device tier's fit) is the step's
        # setup, not its update: a tuner trial that moves subgroups between lanes is measured
        # without it.
        self._apply_pending_knobs()
        if self._device_tier_pending:
            self.fit_device_tier()
        if self._low_memory():
            self._give_back()
        elif self._gave_back:
            self._recover()
        t_start = time.perf_counter()
        setup_s, self._setup_s = t_start - t_call - write_wait_s + self._setup_s, 0.0
        # A step's bytes are those since the last step ended: the reads ahead during backward
        # and the writes behind during forward are this step's too.
        before = self._counters_at or [(p.counters.bytes_read, p.counters.bytes_written) for p in self.paths]
        order = self._order()
        st = self._step_state(pressure=self._gave_back)
        st.reads, self._early_reads = self._early_reads, {}  # read ahead during backward
        threads = torch.get_num_threads()
        if st.seq and self.config.io_cores and threads > 1:
            torch.set_num_threads(max(1, threads - self.config.io_cores))  # config.io_cores: why
        try:
            if self.device_lane:
                self.device_lane.begin_step()
                # The device tier first, whatever the order, on its own stream: its updates run on
                # the GPU while the loop below feeds the lanes, never queued behind their copies.
                t0 = time.perf_counter()
                for sg in self.subgroups:
                    if sg.tier == DEVICE:
                        self._init_state(sg)
                        self.device_lane.update_resident(sg.resident, sg.binding, sg.steps, hypers[sg.binding.group])
                st.kernel_s += time.perf_counter() - t0
            for i in order:
                sg = self.subgroups[i]
                if sg.tier == DEVICE:
                    continue
                if sg.tier.swapped:
                    self._update_swapped(sg, st, hypers[sg.binding.group])
                else:
                    self._update_resident(sg, st, hypers[sg.binding.group])
        except BaseException:
            self._abort_step(st)
            raise
        finally:
            torch.set_num_threads(threads)
        if st.pressure:
            self._give_back()
        elif not self.config.overlap_io:
            self.staging.drain()
        t0 = time.perf_counter()
        self._end_streams()
        device_wait_s = time.perf_counter() - t0
        rec = self._step_record(st, before, t_start=t_start, update_s=time.perf_counter() - t_start + write_wait_s,
                                write_wait_s=write_wait_s, device_wait_s=device_wait_s, setup_s=setup_s,
                                fwd_bwd_s=fwd_bwd_s)
        self.iteration += 1
        self.telemetry.append(rec)
        self._counters_at = [(p.counters.bytes_read, p.counters.bytes_written) for p in self.paths]
        # The writes go on behind: step() returns once the weights are in place, and the next
        # step's first reads start now, behind them.
        if self.config.overlap_io:
            self._quiet = False
            self._read_ahead()
        self._last_step_end = time.perf_counter()
        return rec

    def read_ahead(self) -> int:
        """Start reading the state of the swapped subgroups the next step updates first, into
        free staging buffers and buffers of clean copies needed later, without waiting for
        anything: their state does not depend on the gradients, so the reads run during forward
        and backward. Returns the reads started. The engine calls it at a step's end and as
        writes land; adapters call it when backward begins (``OffloadAdamW`` from a gradient
        hook). Calling it again, or not at all, is harmless."""
        if not self.config.overlap_io or not self._lock.acquire(blocking=False):
            return 0
        try:
            return self._read_ahead()
        finally:
            self._lock.release()

    def _pump(self) -> None:
        """A write-back landed (an I/O thread): its buffer may take the next read ahead."""
        if not self._quiet:
            self.read_ahead()

    def _read_ahead(self) -> int:
        if self._closed or self._low_memory() or not self.staging.capacity_numel:
            return 0
        st = self._step_state()
        started = 0
        for k, i in enumerate(st.seq):
            sg = self.subgroups[i]
            if sg.staged is not None or i in self._early_reads:
                continue  # in memory already (kept, a clean copy, being written, or read)
            buf = self.staging.try_acquire(lambda k=k: self._victims(st, after=k))
            if buf is None:
                break
            self._load(sg, buf, st)
            started += 1
        self._early_reads.update(st.reads)
        return started

    def _order(self) -> range:
        """The subgroups in the order of the next (or current) step: 0..N-1 or N-1..0."""
        n = len(self.subgroups)
        return range(n) if forward_order(self.iteration) else range(n - 1, -1, -1)

    def _step_state(self, pressure: bool = False) -> _StepState:
        """The swapped subgroups of the next (or current) step in its order."""
        seq = [i for i in self._order() if self.subgroups[i].tier.swapped]
        return _StepState(seq, {i: k for k, i in enumerate(seq)}, pressure=pressure)

    def _victims(self, st: _StepState, after: int = -1, exclude: Subgroup | None = None) -> list[Subgroup]:
        """Subgroups whose staged copies may give up their buffers for a subgroup needed at
        position ``after`` of ``st``: those needed later than it, the one needed last first.
        Those done this step are needed next step, in the reverse order."""
        n = len(st.seq)

        def need(sg: Subgroup) -> int:
            k = st.pos[sg.index]
            return k if k >= st.current else 2 * n - 1 - k
        cands = [sg for sg in self.subgroups
                 if sg.staged is not None and sg.kept and sg is not exclude and sg.index in st.pos]
        return sorted((sg for sg in cands if need(sg) > after), key=need, reverse=True)

    def _size_read_ahead(self, nbytes: int) -> None:
        """The read-ahead budget: staging buffers beyond the working ones, within the host budget."""
        if not self.staging.capacity_numel or not nbytes:
            return
        per = self.staging.buffer_bytes
        room = staging_room(self.host_budget, self.host_usage()) - self.staging.size * per
        swapped = sum(1 for sg in self.subgroups if sg.tier.swapped)
        n = max(0, min(-(-nbytes // per), room // per, swapped - self.staging.size))
        self._read_ahead_buffers = n
        self.staging.resize(self.staging.size + n)
        if n and self.device_lane is not None:
            self._set_lane_mask(self.knobs.device_fraction)  # pins the new buffers when the lane copies from them

    @property
    def read_ahead_bytes(self) -> int:
        """Host memory of the read-ahead budget's staging buffers."""
        return self._read_ahead_buffers * self.staging.buffer_bytes

    def flush(self) -> None:
        """Wait for the transfers still running behind the last step: the writes (raising the
        first that failed; its state stays in memory, nothing is lost) and the reads ahead
        (their buffers keep the state they read). Nothing more is read ahead until the next
        step or :meth:`read_ahead`, so the files are still once it returns."""
        with self._lock:
            self._quiet = True
            self.staging.drain()
            for i, fut in self._early_reads.items():
                sg = self.subgroups[i]
                try:
                    fut.result()
                    sg.kept = True  # a clean copy now
                except BaseException:
                    self.staging.release(sg)  # read again by the step, which reports the failure
            self._early_reads = {}
            self._raise_write_failure()

    def _raise_write_failure(self) -> None:
        if self.staging.failures:
            err, self.staging.failures = self.staging.failures[0], []
            raise err

    def _settle(self) -> None:
        """No transfer in flight: the write-behind landed, the reads ahead put back (what a
        checkpoint, a state load or a device release needs before it touches the state)."""
        self.staging.drain()
        self._wait_early_reads()

    def _wait_early_reads(self) -> None:
        """Let read_ahead()'s reads land and put their buffers back (before buffers are given
        back or the paths closed)."""
        self._drop_reads(self._early_reads)
        self._early_reads = {}

    def _drop_reads(self, reads: dict[int, Future]) -> None:
        """Let ``reads`` land, unchecked, and put their buffers back."""
        for i, fut in reads.items():
            try:
                fut.result()
            except BaseException:
                pass
            self.staging.release(self.subgroups[i])

    def _update_swapped(self, sg: Subgroup, st: _StepState, hp: AdamWHyper) -> None:
        """One swapped subgroup: read ahead, wait for its state, update it, write it back. Under
        memory pressure (the watch's flag, read at each subgroup) nothing is read ahead or kept."""
        if not st.pressure and self._low_memory():
            st.pressure = True
            self.staging.resize(PRESSURE_BUFFERS)  # the free ones now; the rest at the step's end
        st.current = st.pos[sg.index]
        if sg.writing:  # its write behind the last step: wait for exactly that one
            t0 = time.perf_counter()
            self.staging.wait_write(sg)
            st.read_wait_s += time.perf_counter() - t0
            if not sg.tier.swapped:  # the write failed: its state stays in memory (raised next step)
                self._update_resident(sg, st, hp)
                return
        depth = 0 if st.pressure else self.knobs.prefetch_depth
        self._prefetch(st, st.current + depth)
        buf = self._stage(sg, st)
        self._run_update(sg, buf, hp, st, time.perf_counter())
        sg.dirty = True
        # The tail stays in its buffers: it is the head of the next step's (reversed) order. The
        # kept buffers come on top of the working ones, so the next step's first reads start at
        # once instead of waiting for write-backs.
        keep = 0 if st.pressure else kept_subgroups(depth)
        if st.current < len(st.seq) - keep:
            self.staging.write_back(sg)
        else:
            sg.kept = True

    def _update_resident(self, sg: Subgroup, st: _StepState, hp: AdamWHyper) -> None:
        """One subgroup whose state is in host memory (its first state counted in the update)."""
        t0 = time.perf_counter()
        self._init_state(sg)
        self._run_update(sg, sg.resident, hp, st, t0)

    def _run_update(self, sg: Subgroup, state: StateBuffer, hp: AdamWHyper, st: _StepState, t0: float) -> None:
        """AdamW on ``state`` on the subgroup's lane; the time since ``t0`` is the step's kernel time."""
        on_device = self._lane_mask[sg.index]
        if on_device:
            self.device_lane.update_staged(state, sg.binding, sg.steps, hp)
        else:
            self.host_lane.update(state, sg.binding, sg.steps, hp)
            st.host_lane_s += time.perf_counter() - t0
        st.kernel_s += time.perf_counter() - t0
        st.lane_subgroups[on_device] += 1

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
            current.wait_stream(s)
        self.host_lane.weights.stream.synchronize()
        if self.device_lane:
            self.device_lane.sync()

    # -- the device tier and the lanes ------------------------------------------------------------

    def _set_lane_mask(self, fraction: float) -> None:
        """Device-lane subgroups: ``fraction`` of those outside the device tier, evenly spread.
        Their gradients live on the device, in order, as far as what the fit left for them holds."""
        self._lane_mask, self._device_grads = lane_assignment(
            [sg.numel for sg in self.subgroups], [sg.tier == DEVICE for sg in self.subgroups], fraction,
            grad_budget_bytes=self._lane_grad_budget, grad_bytes=self._grad_bytes_per_element)
        lane = [i for i, on in enumerate(self._lane_mask) if on]
        if self.streams.pins_host_memory and lane and not self._device_tier_pending:
            # Page-lock what the device lane copies from now, between steps (the step's setup),
            # not inside the first update of each buffer (pinning faults in every page); and only
            # after the fit, which may move these subgroups to the device.
            for i in lane:
                sg = self.subgroups[i]
                if sg.tier == HOST and sg.resident is not None:
                    sg.resident.pin()
            if any(self.subgroups[i].tier.swapped for i in lane):
                for buf in self.staging.free + [sg.staged for sg in self.subgroups if sg.staged is not None]:
                    buf.pin()

    def fit_device_tier(self, grad_bytes_per_element: int = 0, headroom_bytes: int | None = None,
                        reserve_bytes: int = 0) -> DeviceFit:
        """Fit the device tier and the device lane to the device memory free now.

        Called at the first step (after the first forward/backward, so the headroom is what
        training leaves), or by an adapter before it. ``grad_bytes_per_element``: what keeping
        a subgroup's gradient on the device adds (0 when gradients are there anyway).
        ``headroom_bytes`` overrides the measurement (:func:`engine.gpumem.gpu_headroom_bytes`);
        ``reserve_bytes`` is kept free on top (what later forward/backward passes may need beyond
        the first one's peak: DeepSpeed prefetches parameters only from the second).

        - ``device_cache_bytes=None``: the tier takes the longest prefix of subgroups whose
          state (and gradient) fits, leaving the device lane's slots free unless every
          subgroup fits;
        - the device lane runs only if its slots (a few hundred MB, whatever the subgroup size:
          :func:`engine.placement.device_lane_working_bytes`) fit what is left; otherwise it is
          off, with one line saying why, and no knob turns it on;
        - ``auto_device_fraction``: the device fraction that makes the lanes finish together
          (:func:`engine.lane_model.balanced_fraction`, on rates measured in this process);
        - device-lane gradients stay on the device as far as what is left holds them.
        Returns the decision, for logs.
        """
        self._device_tier_pending = False
        if self.device is None:
            return DeviceFit()
        if headroom_bytes is None:
            if self.device.type == "cuda":
                # Fresh segments for the state rather than carved out of cached activation blocks.
                torch.cuda.empty_cache()
            headroom_bytes = gpu_headroom_bytes(self.device)
            if headroom_bytes is None:  # a CPU "device" (tests): its memory is host memory
                headroom_bytes = psutil.virtual_memory().available // 2
        headroom_bytes = max(0, headroom_bytes - reserve_bytes)
        cost = [payload_bytes(sg.numel) + grad_bytes_per_element * sg.numel for sg in self.subgroups]
        lane_ws = device_lane_working_bytes(self.device_lane.capacity_numel, self.device_lane.n_slots,
                                            self.device_lane.chunk_numel)
        if self.config.device_cache_bytes is not None:
            self._set_device_tier(self._placed_on_device)  # the budget's placement (back after release_device)
        else:
            self._set_device_tier(set(range(device_tier_prefix(cost, headroom_bytes, lane_ws))))
        used = sum(c for c, sg in zip(cost, self.subgroups) if sg.tier == DEVICE)
        rest = [sg for sg in self.subgroups if sg.tier != DEVICE]
        self._grad_bytes_per_element = grad_bytes_per_element
        self._lane_room = headroom_bytes - used >= lane_ws
        # What stays for the device lane's gradients; a later fraction (the tuner's) keeps them
        # on the device only within it, so no knob change can take more than the fit allowed.
        self._lane_grad_budget = max(0, headroom_bytes - used - lane_ws)
        lane_note = ""
        if rest and not self._lane_room:
            lane_note = (f"device lane off: its buffers need {lane_ws / 1e9:.2f} GB of GPU memory and "
                         f"{max(0, headroom_bytes - used) / 1e9:.2f} GB is free after forward/backward "
                         f"(and the device tier); lower the micro-batch or --device-cache to use it")
            log.warning("offloadctl: %s", lane_note)
            self._lane_off_said = True  # a later knob push asking for the lane is not said again
            self.knobs = self.knobs.replace(device_fraction=0.0)
        elif rest and self.config.auto_device_fraction:
            f = self._balanced_fraction(rest)
            if f is not None:
                self.knobs = self.knobs.replace(device_fraction=f)
        self._set_lane_mask(self.knobs.device_fraction)
        return DeviceFit(headroom_bytes=headroom_bytes, device_tier_subgroups=len(self.subgroups) - len(rest),
                         device_tier_bytes=used, device_fraction=self.knobs.device_fraction,
                         device_lane_grads_on_device=len(self._device_grads), device_lane_bytes=lane_ws,
                         device_lane_off=lane_note or None)

    def lane_rates(self) -> LaneRates | None:
        """The rates the lane balance uses, measured in this process (once; about 0.3 s on a
        GPU): the host lane's loop with its kernel on this process's threads, pinned PCIe both
        ways at once, GPU AdamW, and host memory bandwidth: the lower of what this process's
        threads move and its share of the node's (measured once per machine with every core,
        :func:`engine.host_kernel.node_memory_bandwidth`), so that the lane model takes the
        lower of the host lane's core rate and its memory bandwidth."""
        if self._lane_rates is None and self.device is not None:
            measured = measure_lane_rates(self.device)
            if measured is not None:
                h2d, d2h, gpu_rate, own = measured
                memory = memory_share(own, node_memory_bandwidth(), self.config.local_ranks)
                self._lane_rates = LaneRates(host_lane_params_per_s=host_lane_rate(self.host_kernel_name),
                                             h2d_bytes_per_s=h2d, d2h_bytes_per_s=d2h, gpu_adamw_params_per_s=gpu_rate,
                                             memory_bytes_per_s=memory)
        return self._lane_rates

    def _balanced_fraction(self, rest: list[Subgroup]) -> float | None:
        """The device fraction of ``rest`` (not in the device tier) with the shortest update by
        the lane model; None where there are no rates (no CUDA device)."""
        rates = self.lane_rates()
        if rates is None or not rates.host_lane_params_per_s:
            return None
        resident = sum(sg.numel for sg in self.subgroups if sg.tier == DEVICE)
        weights = [flat_weights_of(sg.binding) for sg in rest]
        on_device = all(w is None or not self.streams.in_host_memory(w) for w in weights)
        weight_bytes = next((w.element_size() for w in weights if w is not None), 4)
        f, _ = balanced_fraction([sg.numel for sg in rest], rates, resident_params=resident,
                                 grad_budget_bytes=self._lane_grad_budget, grad_bytes=self._grad_bytes_per_element or 4,
                                 weight_bytes=weight_bytes, weights_on_device=on_device)
        return f

    def _set_device_tier(self, indices: set[int]) -> None:
        """Keep the state of subgroups ``indices`` in device memory, the rest off it. At a step
        boundary (no transfer in flight)."""
        spares = []
        for sg in self.subgroups:
            if sg.index in indices and sg.tier != DEVICE:
                spares.append((sg, self._to_device(sg)))
            elif sg.index not in indices and sg.tier == DEVICE:
                self._off_device(sg)
        if self._keep_host_copies:
            # Kept for the next release_device(), in order, while the host budget has room.
            for sg, spare in spares:
                if spare is not None and self.host_usage().total + host_buffer_bytes(spare.capacity_numel) <= self.host_budget:
                    sg.host_copy = spare

    def _to_device(self, sg: Subgroup) -> StateBuffer | None:
        """Into the device tier; returns the host buffer it held there, if any."""
        state = torch.empty(3 * sg.numel, dtype=torch.float32, device=self.device)
        if not sg.fresh:
            view = self._host_view(sg)
            view.wait_ready()
            state.copy_(view.state)
        spare = None
        if sg.tier == HOST:
            spare, sg.resident = sg.resident, None
        elif sg.tier.swapped:
            self.staging.release(sg)
            for f in (sg.file, sg.next_file):
                if f is not None:
                    f.path.remove_file(f)
            sg.file = sg.next_file = None
            sg.dirty = sg.kept = False
        sg.tier, sg.resident = DEVICE, state
        return spare

    def _off_device(self, sg: Subgroup) -> None:
        """Out of the device tier, into host memory (whatever the host budget says): into the
        buffer it left at its last release when there is one, pinned, so that the copy runs at
        PCIe speed (a pageable one runs through the driver's bounce buffer, at a fraction of it)."""
        buf, sg.host_copy = sg.host_copy, None
        if buf is None:
            buf = StateBuffer(sg.numel)
        if self.streams.pins_host_memory:
            buf.pin()  # once per buffer (about 0.1 s per GB), not once per cycle
        if not sg.fresh:
            self.device_lane.sync()
            buf.state.copy_(sg.resident[:3 * sg.numel])
        sg.tier, sg.resident = HOST, buf

    def release_device(self) -> None:
        """Give back every byte the engine holds on the device, between steps: the device tier's
        state moves to host memory (the host budget aside: it is there until the next fit), the
        device lane's slots and scratches are freed, and the next step fits the tier and the lane
        again to what the device then has free. What DeepSpeed's ``offload_states`` asks of the
        optimizer (RLHF frameworks free the GPU for generation between training steps).
        The tier's host buffers are pinned and kept for the next cycle (within the host budget)."""
        if self.device is None:
            return
        with self._lock:
            self._settle()
            self._end_streams()
            self._keep_host_copies = True
            for sg in self.subgroups:
                if sg.tier == DEVICE:
                    self._off_device(sg)
            self.device_lane.release()
            self._lane_mask = [False] * len(self.subgroups)
            self._device_grads = set()
            self._device_tier_pending = True
            reset_peak(self.device)  # the tier just freed is not what training needs

    def device_returned(self) -> None:
        """The device is training's again (DeepSpeed's ``reload_states``): its peak memory is
        counted from now, so that the next step's fit measures the forward/backward that runs
        next, not an RLHF loop's generation phase in between."""
        reset_peak(self.device)

    def device_grad_subgroups(self) -> list[int]:
        """Subgroups whose gradients are best produced on the device for the next step: those in
        the device tier, and those on the device lane when device memory holds their gradients
        too. The lanes are the next step's: a device fraction set and not yet applied counts (an
        adapter places gradients between steps, before the knobs apply at the next one)."""
        grads = self._device_grads
        k = self._pending_knobs
        if k is not None and not self._device_tier_pending:
            fraction = k.device_fraction if self._lane_room else 0.0  # as _apply_pending_knobs will
            if fraction != self.knobs.device_fraction:
                _, grads = lane_assignment(
                    [sg.numel for sg in self.subgroups], [sg.tier == DEVICE for sg in self.subgroups], fraction,
                    grad_budget_bytes=self._lane_grad_budget, grad_bytes=self._grad_bytes_per_element)
        return [sg.index for sg in self.subgroups if sg.tier == DEVICE or sg.index in grads]

    def _abort_step(self, st: _StepState) -> None:
        """After an error: let every transfer finish, and forget reads nobody will check."""
        self._drop_reads(st.reads)
        st.reads.clear()
        self.staging.drain()

    def _prefetch(self, st: _StepState, upto: int) -> None:
        """Issue reads for positions up to ``upto`` of this step's order, while buffers are free."""
        while st.next_read < len(st.seq) and st.next_read <= upto:
            sg = self.subgroups[st.seq[st.next_read]]
            if sg.staged is None and sg.tier.swapped:
                buf = self.staging.try_acquire(lambda: self._victims(st, after=st.next_read))
                if buf is None:
                    return
                self._load(sg, buf, st)
            st.next_read += 1

    def _stage(self, sg: Subgroup, st: _StepState) -> StateBuffer:
        """The staging buffer holding ``sg``, reading it now if no prefetch did."""
        fut = st.reads.pop(sg.index, None)
        if fut is None and sg.staged is None:
            self._load(sg, self.staging.acquire(lambda: self._victims(st, exclude=sg)), st)
            fut = st.reads.pop(sg.index, None)
        if fut is not None:
            t0 = time.perf_counter()
            try:
                fut.result()
            except BaseException:
                self.staging.release(sg)
                raise
            st.read_wait_s += time.perf_counter() - t0
            st.misses += 1
        elif sg.kept:
            st.hits += 1
        sg.kept = False
        return sg.staged

    def _load(self, sg: Subgroup, buf: StateBuffer, st: _StepState) -> None:
        sg.staged = buf
        buf.bind(sg.numel)
        if sg.fresh:
            self._init_state(sg, buf)
        else:
            st.reads[sg.index] = sg.file.path.read(sg.file, buf)

    def _init_state(self, sg: Subgroup, buf: StateBuffer | None = None) -> None:
        """A subgroup's first state, where it is first needed: in ``buf`` (a swapped subgroup's
        staging buffer) or where it is resident. Nothing once it has state."""
        if not sg.fresh:
            return
        if sg.tier == DEVICE:
            self.device_lane.seed_resident(sg.resident, sg.binding)
        else:
            first_state(sg.binding, buf if buf is not None else sg.resident)
        sg.fresh = False

    def _step_record(self, st: _StepState, before: list[tuple[int, int]], *, t_start: float,
                     update_s: float, write_wait_s: float, device_wait_s: float, setup_s: float,
                     fwd_bwd_s: float | None) -> StepRecord:
        """The step's record: its times, the bytes each path moved since ``before``, the lanes."""
        bytes_read: dict[str, int] = {}
        bytes_written: dict[str, int] = {}
        path_read: dict[str, int] = {}
        path_written: dict[str, int] = {}
        for p, (r0, w0) in zip(self.paths, before):
            path_read[p.path], path_written[p.path] = p.counters.bytes_read - r0, p.counters.bytes_written - w0
            bytes_read[p.spec.kind] = bytes_read.get(p.spec.kind, 0) + path_read[p.path]
            bytes_written[p.spec.kind] = bytes_written.get(p.spec.kind, 0) + path_written[p.path]
        headroom = gpu_headroom_bytes(self.device) if self.device is not None and self.device.type == "cuda" else None
        return StepRecord(
            iteration=self.iteration, update_s=update_s,
            read_wait_s=st.read_wait_s, kernel_s=st.kernel_s, write_wait_s=write_wait_s,
            bytes_read=bytes_read, bytes_written=bytes_written, path_bytes_read=path_read,
            path_bytes_written=path_written,
            read_bytes_per_s=sum(bytes_read.values()) / update_s if update_s else 0.0,
            write_bytes_per_s=sum(bytes_written.values()) / update_s if update_s else 0.0,
            cache_hits=st.hits, cache_misses=st.misses, host_lane_subgroups=st.lane_subgroups[0],
            device_lane_subgroups=st.lane_subgroups[1],
            device_tier_subgroups=sum(sg.tier == DEVICE for sg in self.subgroups), host_lane_s=st.host_lane_s,
            fwd_bwd_s=fwd_bwd_s, device_headroom_bytes=headroom, device_wait_s=device_wait_s, setup_s=setup_s,
            params=sum(sg.numel for sg in self.subgroups), knobs=self.knobs.to_dict(), start_s=t_start - write_wait_s,
            host_bytes=self.host_usage().to_dict(), host_budget_bytes=self.host_budget, host_pressure=st.pressure,
            read_ahead_bytes=self.read_ahead_bytes)

    # -- state access (checkpoints) ----------------------------------------------------------

    def read_state(self, index: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, list[int]]:
        """Copies of subgroup ``index``'s (master, exp_avg, exp_avg_sq) on the CPU, and its steps."""
        with self._lock:
            self._settle()
            return self._read_state(index)

    def _read_state(self, index: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, list[int]]:
        sg = self.subgroups[index]
        if sg.tier == DEVICE:
            self._init_state(sg)
            self.device_lane.sync()
            n = sg.numel
            return (*(t.detach().to("cpu", copy=True) for t in sg.resident.split(n)), list(sg.steps))
        buf = self._host_view(sg)
        buf.wait_ready()
        return buf.master.clone(), buf.exp_avg.clone(), buf.exp_avg_sq.clone(), list(sg.steps)

    def write_state(self, index: int, master: torch.Tensor, exp_avg: torch.Tensor, exp_avg_sq: torch.Tensor,
                    steps: Sequence[int]) -> None:
        """Replace subgroup ``index``'s state (flat tensors of its numel, any device). The
        sources are read as data: a checkpoint's tensors may require grad, and the state is
        never part of a graph."""
        with torch.no_grad(), self._lock:
            self._settle()
            self._write_state(index, master.detach(), exp_avg.detach(), exp_avg_sq.detach(), steps)

    def _write_state(self, index: int, master: torch.Tensor, exp_avg: torch.Tensor, exp_avg_sq: torch.Tensor,
                     steps: Sequence[int]) -> None:
        sg = self.subgroups[index]
        sg.steps[:] = list(steps)
        if sg.tier == DEVICE:
            for dst, src in zip(sg.resident.split(sg.numel), (master, exp_avg, exp_avg_sq)):
                dst.copy_(src)
        elif sg.tier == HOST:
            for dst, src in zip((sg.resident.master, sg.resident.exp_avg, sg.resident.exp_avg_sq), (master, exp_avg, exp_avg_sq)):
                dst.copy_(src)
        else:
            self.staging.release(sg)
            buf = StateBuffer(sg.numel, pin=False)
            buf.master.copy_(master)
            buf.exp_avg.copy_(exp_avg)
            buf.exp_avg_sq.copy_(exp_avg_sq)
            sg.file.path.write(sg.file, buf).result()
            sg.dirty = sg.kept = False
        sg.fresh = False

    def _host_view(self, sg: Subgroup) -> StateBuffer:
        if sg.tier == HOST:
            self._init_state(sg)
            return sg.resident
        if sg.staged is not None:
            return sg.staged
        buf = StateBuffer(sg.numel, pin=False)
        if sg.fresh:
            first_state(sg.binding, buf)  # a copy to read: the subgroup's own first state is made at its update
        else:
            sg.file.path.read(sg.file, buf).result()
        return buf

    # -- lifecycle -------------------------------------------------------------------------------

    def close(self) -> None:
        """Finish pending writes and remove every swap file. Idempotent."""
        if self._closed:
            return
        if self._pressure is not None:
            self._pressure.close()
        with self._lock:
            self._close()

    def _close(self) -> None:
        self._closed = True
        self._wait_early_reads()
        lane = getattr(self, "host_lane", None)  # None when construction failed before it
        if lane is not None:
            lane.close()
        for hook in self._hooks:
            close = getattr(hook, "close", None)
            if close is not None:
                try:
                    close()
                except Exception:  # a hook's failure must not keep the swap files on disk
                    pass
        try:
            self.staging.drain()
        except Exception:
            pass
        for p in self.paths:
            p.close()

    def describe(self) -> EngineFacts:
        """The plan in force: for logs, ``--dry-run`` and the tuner (which learns what it tunes
        from this, not from the engine's internals)."""
        tiers: dict[str, int] = {}
        for sg in self.subgroups:
            key = self.paths[sg.tier.path_index].path if sg.tier.swapped else sg.tier.kind
            tiers[key] = tiers.get(key, 0) + payload_bytes(sg.numel)
        usage = self.host_usage()
        return EngineFacts(
            subgroups=len(self.subgroups), params=sum(sg.numel for sg in self.subgroups),
            state_bytes_by_tier=tiers, staging_buffers=self.staging.size, io_backend=self.io_backend,
            host_kernel=self.host_kernel_name, device=str(self.device) if self.device is not None else None,
            path_bandwidth_bytes_per_s={p.path: bw for p, bw in zip(self.paths, self.path_bandwidth)},
            knobs=self.knobs, paths=[p.path for p in self.config.paths], has_device=self.device is not None,
            subgroup_bytes=max((payload_bytes(sg.numel) for sg in self.subgroups), default=0),
            device_headroom_bytes=None if self.device is None else gpu_headroom_bytes(self.device),
            device_lane_bytes=(device_lane_working_bytes(self.device_lane.capacity_numel, self.device_lane.n_slots,
                                                         self.device_lane.chunk_numel) if self.device_lane else 0),
            device_lane_available=self.device_lane is not None and self._lane_room,
            host_memory_budget_bytes=self.host_budget, host_bytes=usage.to_dict(),
            host_staging_bytes=staging_room(self.host_budget, usage), fixed_knobs=self.config.fixed_knobs)
