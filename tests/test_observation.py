"""One step record from the engine to the tuner: a record read back, old files included, and
an iteration aggregated over its ranks' records in one place (``Observation.from_records``)."""
from __future__ import annotations

import json

import pytest

from engine.telemetry import StepRecord, upgrade_record
from tuner.observation import LaneTimes, Observation


def _rec(rank: int, update_s: float, **kw) -> StepRecord:
    return StepRecord(iteration=4, update_s=update_s, read_wait_s=0.1 * (rank + 1),
                      kernel_s=0.5 * update_s, write_wait_s=0.02 * (rank + 1), **kw)


def test_a_record_survives_its_json_and_extra_fields_are_dropped():
    rec = _rec(0, 1.5, path_bytes_read={"/a": 10}, host_lane_s=0.3, knobs={"prefetch_depth": 2})
    d = json.loads(json.dumps(rec.to_dict()))
    assert "bytes_moved_per_param" in d  # derived: written, not read back
    assert StepRecord.from_dict(d) == rec


def test_a_record_in_the_old_names_reads_as_today():
    old = {"iteration": 3, "order": "reverse", "wall_s": 2.0, "read_wait_s": 0.5, "update_s": 1.25, "write_wait_s": 0.1}
    rec = StepRecord.from_dict(old)
    assert (rec.update_s, rec.kernel_s) == (2.0, 1.25)
    assert upgrade_record(rec.to_dict()) == rec.to_dict()  # today's names pass unchanged
    # the tuner's wire does not require the order: the engine's parity rule fills it
    assert StepRecord.from_dict({"iteration": 5, "update_s": 1, "read_wait_s": 0, "kernel_s": 0,
                                 "write_wait_s": 0}).order == "reverse"


def test_an_iteration_is_its_slowest_rank_and_its_ranks_traffic_summed():
    a = _rec(0, 1.0, path_bytes_read={"/a": 100}, path_bytes_written={"/a": 50}, host_lane_s=0.4,
             device_wait_s=0.1, host_lane_subgroups=3, device_lane_subgroups=1)
    b = _rec(1, 2.0, path_bytes_read={"/a": 100, "/b": 40}, host_lane_s=0.9, device_wait_s=0.3,
             host_lane_subgroups=2, device_lane_subgroups=2, device_tier_subgroups=1)
    tiny = _rec(2, 1e-9, path_bytes_read={"/a": 10 ** 6})  # no measurement of a rate
    obs = Observation.from_records([a, b, tiny], iter_times_s=[3.0, 3.5], error="oom")
    assert (obs.iteration, obs.iter_time_s, obs.update_s, obs.kernel_s) == (4, 3.5, 2.0, 1.0)
    assert obs.read_wait_s == pytest.approx(0.3) and obs.write_wait_s == pytest.approx(0.06)
    assert obs.path_read_bytes_per_s == pytest.approx({"/a": 100 / 1.0 + 100 / 2.0, "/b": 40 / 2.0})
    assert obs.path_write_bytes_per_s == pytest.approx({"/a": 50.0})
    assert obs.lanes == LaneTimes(host_lane_s=0.9, device_wait_s=0.3, host_lane_subgroups=2,
                                  device_lane_subgroups=2, device_tier_subgroups=1)
    assert obs.error == "oom" and Observation.from_records([a]).iter_time_s is None
