"""One plain record per ``step()``, kept in memory and optionally appended to a JSONL file."""

from __future__ import annotations

import json
import logging
import os
from dataclasses import asdict, dataclass, field, fields
from typing import Any

from engine.config import Knobs
from engine.host_memory import HostUsage
from engine.layout import forward_order
from engine.record_files import private_opener, say_records_stopped

log = logging.getLogger(__name__)


@dataclass
class StepRecord:
    iteration: int
    update_s: float
    """The whole update phase, from the loop's start to its last wait."""
    read_wait_s: float
    """Time the update loop waited for state to arrive from storage."""
    kernel_s: float
    """Time in the AdamW math: host-lane updates, and queueing device-lane and device-tier work."""
    write_wait_s: float
    """Time waiting, at the end of the step, for write-back to finish."""
    bytes_read: dict[str, int] = field(default_factory=dict)
    """Per tier kind ('nvme', 'remote')."""
    bytes_written: dict[str, int] = field(default_factory=dict)
    path_bytes_read: dict[str, int] = field(default_factory=dict)
    path_bytes_written: dict[str, int] = field(default_factory=dict)
    """Per storage path; like every ``path_*`` figure, over the time since the previous step
    ended (the reads ahead during backward and the writes behind during forward count here)."""
    path_read_busy_s: dict[str, float] = field(default_factory=dict)
    """Per path: seconds with at least one of our reads in the device's hands (the union of the
    requests' intervals). ``path_bytes_read / path_read_busy_s`` is the rate the path serves
    reads at now, whatever the gaps between requests: what the tuner watches for a path that
    slows or speeds up."""
    path_write_busy_s: dict[str, float] = field(default_factory=dict)
    """The same for writes."""
    path_queue_wait_s: dict[str, float] = field(default_factory=dict)
    """Per path: seconds our requests waited for a slot (the concurrency limit) or the node
    lock, summed over requests."""
    read_bytes_per_s: float = 0.0
    """Bytes read over the step's wall time (achieved, not peak)."""
    write_bytes_per_s: float = 0.0
    cache_hits: int = 0
    """Swapped subgroups updated from a buffer kept from the previous step (no read)."""
    cache_misses: int = 0
    """Swapped subgroups read from storage this step."""
    host_lane_subgroups: int = 0
    """Subgroups updated on the host lane (their state in host memory, or staged there)."""
    device_lane_subgroups: int = 0
    """Subgroups updated on the device lane (state copied to the device and back)."""
    device_tier_subgroups: int = 0
    """Subgroups whose state stays in device memory, updated there (counted on neither lane)."""
    host_lane_s: float = 0.0
    """Time in host-lane updates (the CPU's share of ``kernel_s``)."""
    fwd_bwd_s: float | None = None
    """Time from the end of the previous step to the start of this one, less ``excluded_s`` and
    the adapter's one-time work counted in ``setup_s``: forward, backward and whatever else the
    training loop does between steps. None at the first step."""
    device_headroom_bytes: int | None = None
    """Device memory still free beyond what forward/backward and the engine use, at the end of
    the step (``engine.gpumem.gpu_headroom_bytes``); None without a CUDA device."""
    device_usable_bytes: int | None = None
    """Device memory this process may use (``engine.gpumem.usable_bytes``: the card's less other
    processes', within a per-process fraction): what the margin and the headroom are taken from."""
    device_wait_s: float = 0.0
    """Time waiting, at the end of the step, for device-lane work still queued (the GPU's and
    PCIe's tail past the CPU's)."""
    setup_s: float = 0.0
    """One-time work before the update loop, outside ``update_s`` and ``fwd_bwd_s``: knob changes
    (pinning the buffers of subgroups that moved to the device lane), the device tier's fit, the
    adapter's work for them between steps (``SubgroupEngine.setup_time``)."""
    params: int = 0
    knobs: Knobs | None = None
    """The knobs in force (None in a record made without them: ``{}`` in its JSON)."""
    start_s: float | None = None
    """``time.perf_counter()`` when the update phase started (its write wait; knob changes and the
    device tier's fit, when any, come between that and the loop): with the durations above it
    places the step's parts on a timeline. The clock is
    CLOCK_MONOTONIC on Linux, so it compares with other processes' on the same node. The step
    first waits for what is left of the writes behind the last step (``write_wait_s``), then its
    loop runs for ``update_s - write_wait_s - device_wait_s``, then it waits for the device."""
    host_bytes: HostUsage | None = None
    """What the engine held in host memory at the step's end, by kind (None, ``{}`` in JSON, before budgets)."""
    host_budget_bytes: int = 0
    """The rank's host-memory budget (0 in records written before there was one)."""
    host_pressure: bool = False
    """Available memory ran below the floor during the step: nothing was read ahead or kept."""
    read_ahead_bytes: int = 0
    """Host memory of the read-ahead budget in force (``EngineConfig.read_ahead_bytes``)."""
    excluded_s: float = 0.0
    """Time since the previous step that was not this iteration's work, and is in neither
    ``fwd_bwd_s`` nor ``setup_s``: iterations whose step was skipped (an fp16 overflow:
    ``SubgroupEngine.skipped_step``), an ``offload_states``/``reload_states`` cycle (an RLHF
    loop's generation between them, and the two calls but for the engine's own release, which
    is ``setup_s``: ``SubgroupEngine.pause_clock``/``resume_clock``). An iteration's own time is
    the wall time since the previous step's end less this and ``setup_s`` (what the tuner judges
    by: ``tuner.client.TunerClient.report`` takes this out of the time it measures)."""

    @property
    def order(self) -> str:
        """'forward' (subgroups 0..N-1) on even iterations, 'reverse' (N-1..0) on odd ones."""
        return "forward" if forward_order(self.iteration) else "reverse"

    @property
    def bytes_moved_per_param(self) -> float:
        moved = sum(self.bytes_read.values()) + sum(self.bytes_written.values())
        return moved / self.params if self.params else 0.0

    def to_dict(self) -> dict[str, Any]:
        """The record's JSON (telemetry files, run records, the tuner's socket), written here alone."""
        d = asdict(self)
        d["knobs"], d["host_bytes"] = d["knobs"] or {}, d["host_bytes"] or {}
        d["order"], d["bytes_moved_per_param"] = self.order, self.bytes_moved_per_param
        return d

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "StepRecord":
        """A record as :meth:`to_dict` wrote it (the tuner's socket; a file's once
        :func:`upgrade_record` has read it); what it derives (the order, bytes per parameter) and
        fields it does not know are dropped."""
        kw = {f.name: d[f.name] for f in fields(cls) if f.name in d}
        kw["knobs"] = Knobs.from_dict(kw["knobs"]) if kw.get("knobs") else None
        kw["host_bytes"] = HostUsage(**kw["host_bytes"]) if kw.get("host_bytes") else None
        return cls(**kw)


def upgrade_record(d: dict[str, Any]) -> dict[str, Any]:
    """A record dict of a file in today's names, made once where run directories are read
    (``report.load``): files from offloadctl 0.1 name the phase ``wall_s`` and the math
    ``update_s``, and a record written before the device lane, without ``host_lane_s``, had all
    its AdamW on the host lane. Run directories outlive upgrades, so they still read."""
    d = dict(d)
    if "wall_s" in d:
        d["kernel_s"], d["update_s"] = d.pop("update_s", 0.0), d.pop("wall_s")
    d.setdefault("host_lane_s", d.get("kernel_s", 0.0))
    return d


class TelemetryLog:
    """Keeps every record, and appends each to ``run_dir/telemetry-rank<R>.jsonl`` when given.

    Writing it is never a reason to stop training: where the file cannot be written (a full
    disk, an I/O error) it stops, with one warning, and the records stay in memory."""

    def __init__(self, run_dir: str | None, rank: int) -> None:
        self.records: list[StepRecord] = []
        self.path = None
        if run_dir:
            self.path = os.path.join(run_dir, f"telemetry-rank{rank}.jsonl")
            try:
                os.makedirs(run_dir, exist_ok=True)
            except OSError as e:
                self._stop_writing(self.path, e)

    def append(self, rec: StepRecord) -> None:
        self.records.append(rec)
        if self.path:
            try:
                with open(self.path, "a", opener=private_opener) as f:
                    f.write(json.dumps(rec.to_dict()) + "\n")
            except OSError as e:
                self._stop_writing(self.path, e)

    def _stop_writing(self, path: str, e: OSError) -> None:
        say_records_stopped(path, e)  # its records stay in memory
        self.path = None
