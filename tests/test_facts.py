"""``facts_of`` alone: what a real engine's parts say of themselves reaches ``EngineFacts``, and
``to_dict()`` keeps the one JSON form the run record (``engine_plan``), ``--dry-run`` and the
tuner's registration read. Real engine, real files, CPU."""

from __future__ import annotations

import json

import pytest
import torch

from engine import OffloadAdamW
from engine.config import StoragePath
from engine.facts import facts_of
from engine.layout import payload_bytes, staging_buffers

# The run record's engine_plan keys, in order: a field renamed or dropped fails here, not in a reader.
KEYS = [
    "subgroups",
    "params",
    "state_bytes_by_tier",
    "staging_buffers",
    "io_backend",
    "host_kernel",
    "device",
    "path_bandwidth_bytes_per_s",
    "path_depth_response",
    "knobs",
    "paths",
    "path_kinds",
    "has_device",
    "subgroup_bytes",
    "device_headroom_bytes",
    "device_lane_bytes",
    "device_lane_available",
    "host_memory_budget_bytes",
    "host_bytes",
    "host_staging_bytes",
    "pins",
]


# With CUDA present, device=None gives the engine a device lane and maybe a device tier, which
# change the placement this test pins; the device's facts are test_gpu_path's.
@pytest.mark.skipif(torch.cuda.is_available(), reason="the facts of an engine with no device")
def test_each_part_says_its_facts_and_the_json_form_is_unchanged(swap_dir):
    model = torch.nn.Linear(100, 100)  # 10,100 params: three subgroups of at most 4,000
    path = StoragePath(path=swap_dir, read_bytes_per_s=1e9, write_bytes_per_s=2e9)  # declared: no probe
    opt = OffloadAdamW(
        model.parameters(), nvme_paths=[path], subgroup_numel=4000, io_backend="posix", host_adam="torch", prefetch_depth=1
    )
    try:
        engine = opt.engine
        facts = facts_of(engine)
        assert facts == engine.describe()
        # The placement: everything on the path (paths given, no --host-cache).
        assert (facts.subgroups, facts.params, facts.subgroup_bytes) == (3, 10_100, payload_bytes(4000))
        assert [sg.numel for sg in engine.subgroups] == [4000, 4000, 2100]
        assert facts.state_bytes_by_tier == {swap_dir: 2 * payload_bytes(4000) + payload_bytes(2100)}
        # The swap paths: declared rates (no depth probe), their kind, the backend asked for.
        assert facts.paths == [swap_dir] and facts.path_kinds == {swap_dir: "nvme"} and facts.io_backend == "posix"
        assert facts.path_bandwidth_bytes_per_s == {swap_dir: engine.swap_paths.round_trip_bytes_per_s[0]}
        assert facts.path_depth_response == {}
        # No device: no tier, no lane.
        assert (facts.device, facts.has_device, facts.device_headroom_bytes, facts.device_lane_available) == (
            None,
            False,
            None,
            False,
        )
        # The host budget and the transfers at the pinned depth, which the facts report in force.
        assert facts.staging_buffers == staging_buffers(1) and facts.pins == {"prefetch_depth": 1}
        assert facts.host_staging_bytes == facts.host_memory_budget_bytes - facts.host_bytes.state - facts.host_bytes.copies
        assert facts.host_bytes.state == 0 and facts.host_bytes.staging > 0
        d = json.loads(json.dumps(facts.to_dict()))
        assert list(d) == KEYS
        assert list(d["host_bytes"]) == ["state", "staging", "kept", "copies"] and d["knobs"] == facts.knobs.to_dict()
    finally:
        opt.close()
