"""The device's share of the update (:class:`DeviceTier`): which subgroups keep their state in
device memory (the device tier), which of the others the device lane updates, and giving the
device back between training phases. ``docs/engine.md`` says when each is decided.

- **Fit** (:meth:`DeviceTier.fit`), at the first step once forward and backward have shown what
  device memory training needs: the tier takes what ``device_cache_bytes`` places there, or, when
  that is None, the longest prefix of subgroups that fits what is free; the device lane runs if
  its slots fit what is left; device-lane gradients stay on the device within the rest.
- **Lanes** (:meth:`DeviceTier.assign_lanes`): a fraction of the subgroups outside the tier,
  evenly spread, is updated on the device lane (Deep Optimizer States), the rest on the host lane;
  with ``auto_device_fraction``, the fraction that makes the lanes finish together.
- **Keeping the margin** (:meth:`DeviceTier.keep_margin`, :meth:`DeviceTier.out_of_memory`): the
  fit sees the first step's peak only. A pass between steps that needs more (an evaluation with a
  larger batch, a generation without ``offload_states``) that came halfway into the margin, or an
  out-of-memory error at the step, moves the tier's last subgroups to host memory until the margin
  is back, says so in one line, and measures the peak afresh from there.
- **Release** (:meth:`DeviceTier.release`, DeepSpeed's ``offload_states``): the tier's state moves
  to host memory, into pinned host buffers kept from the last release where there are some, and
  the next step fits again; :meth:`DeviceTier.returned` (``reload_states``) restarts the peak.
"""

from __future__ import annotations

import logging
import re
from typing import Callable, Iterable, Sequence

import psutil
import torch

from engine.adamw import AdamWHyper
from engine.binding import flat_weights_of
from engine.buffers import StateBuffer, unpins_deferred
from engine.config import EngineConfig
from engine.device_lane import DeviceLane
from engine.facts import DeviceFit
from engine.gpumem import gpu_headroom_bytes, gpu_memory_left, margin_bytes_of, measure_lane_rates, reset_peak, usable_bytes
from engine.host_kernel import host_lane_rate, node_memory_bandwidth
from engine.lane_model import LaneRates, balanced_fraction, lane_assignment, memory_share
from engine.layout import host_buffer_bytes, payload_bytes
from engine.placement import DEVICE, device_lane_working_bytes, device_tier_prefix
from engine.streams import Streams
from engine.subgroup import InHost, OnDevice, Subgroup, Swapped
from engine.transfers import host_state
from engine.units import format_size

log = logging.getLogger(__name__)

_TRIED_TO_ALLOCATE = re.compile(r"Tried to allocate ([0-9.]+) ([KMGT]?i?B)")
_UNIT_BYTES = {"B": 1, "KiB": 1 << 10, "MiB": 1 << 20, "GiB": 1 << 30, "TiB": 1 << 40}


def requested_bytes(error: BaseException) -> int:
    """The allocation an out-of-memory error names (torch's "Tried to allocate 1.20 GiB"), or 0."""
    m = _TRIED_TO_ALLOCATE.search(str(error))
    return int(float(m.group(1)) * _UNIT_BYTES.get(m.group(2), 1)) if m else 0


class DeviceTier:
    """The device tier and the device lane's share of ``subgroups`` (``lane`` None: no device).
    The engine's other parts come as arguments: ``staging()``, the staging buffers to pin when the
    lane copies from them; at a fit, ``release_staged`` and ``host_fits`` (:meth:`fit`)."""

    def __init__(
        self,
        subgroups: Sequence[Subgroup],
        config: EngineConfig,
        device: torch.device | None,
        lane: DeviceLane | None,
        streams: Streams,
        *,
        host_kernel_name: str,
    ) -> None:
        self.subgroups, self.config, self.device, self.lane = subgroups, config, device, lane
        self.streams, self.host_kernel_name = streams, host_kernel_name
        self.fit_pending = device is not None
        """The next step fits the tier and the lane first (the first step, and after a release)."""
        # Those the device budget placed there (placement fills it in order, skipping those that
        # do not fit: not always a prefix); the fit puts them back after release().
        self._placed = {sg.index for sg in subgroups if sg.tier == DEVICE}
        self.grad_bytes_per_element = 0
        """What keeping a subgroup's gradient on the device adds (the fit's argument)."""
        self.lane_grad_budget_bytes = 0
        """Device bytes the fit left for device-lane gradients."""
        self.device_grads: set[int] = set()
        """Device-lane subgroups whose gradients fit that budget."""
        self.lane_has_room = True
        """The device has room for the device lane's slots (False: the fit found none)."""
        self._on_device_lane = [False] * len(subgroups)
        self._lane_off_said = False
        self._lane_rates: LaneRates | None = None
        # After a first release() (an RLHF loop's offload_states), the tier keeps its pinned host
        # buffers while on the device, within the host budget: the next release copies into them
        # at PCIe speed instead of into fresh pageable memory.
        self._keep_host_copies = False

    def on_device_lane(self, index: int) -> bool:
        """Whether the device lane updates subgroup ``index`` this step."""
        return self._on_device_lane[index]

    def headroom_bytes(self) -> int | None:
        """Device memory free for the engine now (:func:`engine.gpumem.gpu_headroom_bytes`); None without a device."""
        return gpu_headroom_bytes(self.device) if self.device is not None else None

    @property
    def _lane(self) -> DeviceLane:
        """The device lane, where the code runs only with a device (the tier, a release)."""
        assert self.lane is not None, "no device lane: no device"
        return self.lane

    def lane_bytes(self) -> int:
        """Device memory the device lane's chunk slots take when it runs (0 without a device)."""
        if self.lane is None:
            return 0
        return device_lane_working_bytes(self.lane.capacity_numel, self.lane.n_slots, self.lane.chunk_numel)

    # -- the lanes -------------------------------------------------------------------------------

    def assign_lanes(self, fraction: float, staging: Callable[[], Iterable[StateBuffer]]) -> None:
        """Device-lane subgroups: ``fraction`` of those outside the device tier, evenly spread.
        Their gradients live on the device, in order, as far as what the fit left for them holds;
        the buffers they copy from are pinned (those of ``staging()`` for swapped ones)."""
        self._on_device_lane, self.device_grads = lane_assignment(
            [sg.numel for sg in self.subgroups],
            [sg.tier == DEVICE for sg in self.subgroups],
            fraction,
            grad_budget_bytes=self.lane_grad_budget_bytes,
            grad_bytes=self.grad_bytes_per_element,
        )
        lane = [i for i, on in enumerate(self._on_device_lane) if on]
        if self.streams.pins_host_memory and lane and not self.fit_pending:
            # Page-lock what the device lane copies from now, between steps (the step's setup),
            # not inside the first update of each buffer (pinning faults in every page); and only
            # after the fit, which may move these subgroups to the device.
            for i in lane:
                sg = self.subgroups[i]
                if isinstance(sg.home, InHost):
                    sg.home.buffer.pin()
            if any(self.subgroups[i].tier.swapped for i in lane):
                for buf in staging():
                    buf.pin()

    def usable_fraction(self, fraction: float) -> float:
        """``fraction``, or 0 when the fit found no room for the lane (said once)."""
        if fraction > 0 and not self.lane_has_room:
            if not self._lane_off_said:
                log.warning(
                    "offloadctl: device_fraction=%g ignored: the device lane has no room on the device "
                    "(see the device fit at the first step)",
                    fraction,
                )
                self._lane_off_said = True
            return 0.0
        return fraction

    def grad_subgroups(self, next_fraction: float | None, in_force: float) -> list[int]:
        """Subgroups whose gradients are best produced on the device: those in the tier, and those
        on the device lane when device memory holds their gradients too. With ``next_fraction`` (a
        device fraction set for the next step, not yet applied: the one ``in_force`` now), those
        of the lanes it will make."""
        grads = self.device_grads
        if next_fraction is not None and not self.fit_pending:
            fraction = next_fraction if self.lane_has_room else 0.0  # as usable_fraction() will
            if fraction != in_force:
                _, grads = lane_assignment(
                    [sg.numel for sg in self.subgroups],
                    [sg.tier == DEVICE for sg in self.subgroups],
                    fraction,
                    grad_budget_bytes=self.lane_grad_budget_bytes,
                    grad_bytes=self.grad_bytes_per_element,
                )
        return [sg.index for sg in self.subgroups if sg.tier == DEVICE or sg.index in grads]

    # -- the tier's update ------------------------------------------------------------------------

    def update(self, hypers: Sequence[AdamWHyper]) -> None:
        """Queue the update of every subgroup in the tier on the lane's resident stream, its first
        state made there first: it runs on the device while the host feeds the lanes."""
        for sg in self.subgroups:
            if isinstance(sg.home, OnDevice):
                self.start_state(sg, sg.home.state)
                self._lane.update_resident(sg.home.state, sg.binding, sg.steps, hypers[sg.binding.group])

    def start_state(self, sg: Subgroup, state: torch.Tensor) -> None:
        """A tier subgroup's first state, in its device ``state``; nothing once it has state."""
        if sg.fresh:
            self._lane.seed_resident(state, sg.binding)
            sg.fresh = False

    def state_copy(self, sg: Subgroup) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Copies of a tier subgroup's (master, exp_avg, exp_avg_sq) on the CPU."""
        assert isinstance(sg.home, OnDevice), f"subgroup {sg.index} is not on the device"
        self.start_state(sg, sg.home.state)
        self._lane.sync()  # its updates on the resident stream have finished
        master, exp_avg, exp_avg_sq = (t.detach().to("cpu", copy=True) for t in torch.split(sg.home.state, sg.numel))
        return master, exp_avg, exp_avg_sq

    # -- the fit -----------------------------------------------------------------------------------

    def fit(
        self,
        fraction: float,
        grad_bytes_per_element: int = 0,
        headroom_bytes: int | None = None,
        reserve_bytes: int = 0,
        *,
        staging: Callable[[], Iterable[StateBuffer]],
        release_staged: Callable[[Subgroup], None],
        host_fits: Callable[[int], bool],
    ) -> DeviceFit:
        """Fit the tier and the lane to the device memory free now, at a step boundary (no
        transfer in flight); the lane at ``fraction`` unless the fit decides it.

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
        ``release_staged(sg)`` gives a swapped subgroup's staging buffer back to the pool as it
        moves into the tier; ``host_fits(nbytes)`` says whether the host budget keeps a host
        buffer it left. Returns the decision; its ``device_fraction`` is the lane's from now on.
        """
        self.fit_pending = False
        if self.device is None:
            return DeviceFit()
        usable = margin = None
        if headroom_bytes is None:
            headroom_bytes = self._free_for_state(self.device)
            usable = usable_bytes(self.device)
            margin = margin_bytes_of(usable) if usable is not None else None
        headroom_bytes = max(0, headroom_bytes - reserve_bytes)
        cost = [payload_bytes(sg.numel) + grad_bytes_per_element * sg.numel for sg in self.subgroups]
        lane_ws = self.lane_bytes()
        # A pinned host buffer the refit frees keeps its memory, pinned, until the lane's next
        # sync at a step's end (DeviceLane.sync): cudaHostUnregister may synchronize the device.
        with unpins_deferred():
            if self.config.device_cache_bytes is not None:
                self._place(self._placed, release_staged, host_fits)  # the budget's placement (back after release())
            else:
                self._place(set(range(device_tier_prefix(cost, headroom_bytes, lane_ws))), release_staged, host_fits)
        used = sum(c for c, sg in zip(cost, self.subgroups) if sg.tier == DEVICE)
        rest = [sg for sg in self.subgroups if sg.tier != DEVICE]
        self.grad_bytes_per_element = grad_bytes_per_element
        self.lane_has_room = headroom_bytes - used >= lane_ws
        # What stays for the device lane's gradients; a later fraction (the tuner's) keeps them
        # on the device only within it, so no knob change can take more than the fit allowed.
        self.lane_grad_budget_bytes = max(0, headroom_bytes - used - lane_ws)
        lane_note = ""
        if rest and not self.lane_has_room:
            lane_note = (
                f"device lane off: its buffers need {lane_ws / 1e9:.2f} GB of GPU memory and "
                f"{max(0, headroom_bytes - used) / 1e9:.2f} GB is free after forward/backward "
                f"(and the device tier); lower the micro-batch or --device-cache to use it"
            )
            log.warning("offloadctl: %s", lane_note)
            self._lane_off_said = True  # a later knob push asking for the lane is not said again
            fraction = 0.0
        elif rest and self.config.auto_device_fraction:
            balanced = self._balanced_fraction(rest)
            if balanced is not None:
                fraction = balanced
        self.assign_lanes(fraction, staging)
        return DeviceFit(
            headroom_bytes=headroom_bytes,
            device_tier_subgroups=len(self.subgroups) - len(rest),
            device_tier_bytes=used,
            device_fraction=fraction,
            device_lane_grads_on_device=len(self.device_grads),
            device_lane_bytes=lane_ws,
            device_lane_off=lane_note or None,
            usable_bytes=usable,
            margin_bytes=margin or 0,
        )

    @staticmethod
    def _free_for_state(device: torch.device) -> int:
        """Device memory the state may take now on ``device``, measured."""
        if device.type == "cuda":
            torch.cuda.empty_cache()  # fresh segments for the state rather than carved out of cached activation blocks
        headroom_bytes = gpu_headroom_bytes(device)
        if headroom_bytes is None:  # a CPU "device" (tests): its memory is host memory
            headroom_bytes = psutil.virtual_memory().available // 2
        return headroom_bytes

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
                self._lane_rates = LaneRates(
                    host_lane_params_per_s=host_lane_rate(self.host_kernel_name),
                    h2d_bytes_per_s=h2d,
                    d2h_bytes_per_s=d2h,
                    gpu_adamw_params_per_s=gpu_rate,
                    memory_bytes_per_s=memory,
                )
        return self._lane_rates

    def _balanced_fraction(self, rest: list[Subgroup]) -> float | None:
        """The device fraction of ``rest`` (not in the tier) with the shortest update by the lane
        model; None where there are no rates (no CUDA device)."""
        rates = self.lane_rates()
        if rates is None or not rates.host_lane_params_per_s:
            return None
        resident = sum(sg.numel for sg in self.subgroups if sg.tier == DEVICE)
        weights = [flat_weights_of(sg.binding) for sg in rest]
        on_device = all(w is None or not self.streams.in_host_memory(w) for w in weights)
        weight_bytes = next((w.element_size() for w in weights if w is not None), 4)
        f, _ = balanced_fraction(
            [sg.numel for sg in rest],
            rates,
            resident_params=resident,
            grad_budget_bytes=self.lane_grad_budget_bytes,
            grad_bytes=self.grad_bytes_per_element or 4,
            weight_bytes=weight_bytes,
            weights_on_device=on_device,
        )
        return f

    # -- moving state on and off the device ----------------------------------------------------------

    def _place(self, indices: set[int], release_staged: Callable[[Subgroup], None], host_fits: Callable[[int], bool]) -> None:
        """Keep the state of subgroups ``indices`` in device memory, the rest off it."""
        spares = []
        for sg in self.subgroups:
            if sg.index in indices and sg.tier != DEVICE:
                spares.append(self._to_device(sg, release_staged))
            elif sg.index not in indices and sg.tier == DEVICE:
                self._off_device(sg)
        if self._keep_host_copies:
            # Kept for the next release(), in order, while the host budget has room.
            for home, spare in spares:
                if spare is not None and host_fits(host_buffer_bytes(spare.capacity_numel)):
                    home.host_copy = spare

    def _to_device(self, sg: Subgroup, release_staged: Callable[[Subgroup], None]) -> tuple[OnDevice, StateBuffer | None]:
        """Into the tier; returns its home there and the host buffer it held, if any."""
        state = torch.empty(3 * sg.numel, dtype=torch.float32, device=self.device)
        if not sg.fresh:
            view = host_state(sg)
            view.wait_ready()  # a device-lane copy back into it has landed
            state.copy_(view.state)
        spare = sg.home.buffer if isinstance(sg.home, InHost) else None
        if isinstance(sg.home, Swapped):
            release_staged(sg)
            for f in (sg.home.file, sg.home.next_file):
                if f is not None:
                    f.path.remove_file(f)
        sg.home = home = OnDevice(state)
        return home, spare

    def _off_device(self, sg: Subgroup) -> None:
        """Out of the tier, into host memory (whatever the host budget says): into the buffer it
        left at its last release when there is one, pinned, so that the copy runs at PCIe speed
        (a pageable one runs through the driver's bounce buffer, at a fraction of it)."""
        home = sg.home
        assert isinstance(home, OnDevice), f"subgroup {sg.index} is not on the device"
        buf = home.host_copy if home.host_copy is not None else StateBuffer(sg.numel)
        if self.streams.pins_host_memory:
            buf.pin()  # once per buffer (about 0.1 s per GB), not once per cycle
        if not sg.fresh:
            self._lane.sync()  # the tier's last update on the resident stream has finished
            buf.state.copy_(home.state[: 3 * sg.numel])
        sg.home = InHost(buf)

    # -- keeping the margin after the fit ----------------------------------------------------------

    def keep_margin(self, fraction: float, staging: Callable[[], Iterable[StateBuffer]]) -> None:
        """At a step's start, between fits: where the device's peak since the last step came
        more than halfway into the margin (a pass larger than the fit saw: an evaluation with a
        bigger batch, a generation), the tier gives back what restores the whole margin
        (:meth:`_shrink`). Half, so that the allocator's rounding of the tier's own blocks never
        moves a subgroup."""
        if self.device is None or not any(sg.tier == DEVICE for sg in self.subgroups):
            return
        left = gpu_memory_left(self.device)
        usable = usable_bytes(self.device)
        if left is None or usable is None or left >= -margin_bytes_of(usable) // 2:
            return
        self._shrink(
            -left,
            fraction,
            staging,
            f"GPU memory peaked within {format_size(max(0, margin_bytes_of(usable) + left))} "
            f"of the {format_size(usable)} this process may use since the last step "
            "(an evaluation or generation pass?)",
        )

    def out_of_memory(self, error: BaseException, fraction: float, staging: Callable[[], Iterable[StateBuffer]]) -> None:
        """The step raised an out-of-memory error: the tier gives back what the failed allocation
        asked for and the margin (:meth:`_shrink`), so that a caller that goes on (skipping the
        batch) runs its next step with room."""
        if self.device is None or not any(sg.tier == DEVICE for sg in self.subgroups):
            return
        asked = requested_bytes(error)
        usable = usable_bytes(self.device)
        margin = margin_bytes_of(usable) if usable is not None else 0
        self._shrink(
            asked + margin,
            fraction,
            staging,
            "out of GPU memory at the step" + (f" (it asked for {format_size(asked)} more)" if asked else ""),
        )

    def _shrink(self, need_bytes: int, fraction: float, staging: Callable[[], Iterable[StateBuffer]], why: str) -> None:
        """Move the tier's last subgroups to host memory until ``need_bytes`` are free (at least
        one), say so in one line, lay the lanes out again at ``fraction``, and count the device's
        peak afresh from here. A user's --device-cache placement loses them too: a later refit
        does not put back what the device had no room for."""
        cost = self.grad_bytes_per_element
        moved, freed = [], 0
        for sg in reversed(self.subgroups):
            if freed >= need_bytes:
                break
            if sg.tier == DEVICE:
                self._off_device(sg)
                moved.append(sg.index)
                freed += payload_bytes(sg.numel) + cost * sg.numel
        self._placed -= set(moved)
        left = sum(sg.tier == DEVICE for sg in self.subgroups)
        log.warning(
            "offloadctl: %s: %d device-tier subgroup%s (%s) moved to host memory, %d left on the GPU; "
            "offload_states() around such a pass keeps them (docs/engine.md)",
            why,
            len(moved),
            "" if len(moved) == 1 else "s",
            format_size(freed),
            left,
        )
        self.assign_lanes(self.usable_fraction(fraction), staging)
        reset_peak(self.device)

    def release(self) -> None:
        """Every byte on the device given back (no transfer in flight, the step's streams joined):
        the tier's state moves to host memory (the host budget aside: it is there until the next
        fit), the lane's slots and scratches are freed, and the next step fits both again to what
        the device then has free. The tier's host buffers are pinned and kept for the next cycle
        from now on (within the host budget)."""
        self._keep_host_copies = True
        for sg in self.subgroups:
            if sg.tier == DEVICE:
                self._off_device(sg)
        self._lane.release()
        self._on_device_lane = [False] * len(self.subgroups)
        self.device_grads = set()
        self.fit_pending = True
        reset_peak(self.device)  # the tier just freed is not what training needs

    def returned(self) -> None:
        """The device is training's again: its peak memory counts from now."""
        reset_peak(self.device)

    def drop_host_copies(self) -> None:
        """Free the tier's kept host buffers (memory pressure): the next release makes them again."""
        for sg in self.subgroups:
            if isinstance(sg.home, OnDevice):
                sg.home.host_copy = None

    def host_copy_bytes(self) -> int:
        """Host memory of the tier's kept host buffers."""
        copies = [sg.home.host_copy for sg in self.subgroups if isinstance(sg.home, OnDevice)]
        return sum(host_buffer_bytes(c.capacity_numel) for c in copies if c is not None)
