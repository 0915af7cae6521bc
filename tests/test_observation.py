"""One step record from the engine to the tuner and the report: a record read back, old files
included; an iteration aggregated over its ranks' records in one place
(``Observation.from_records``); one split of a step into the update's segments for the report
and the end-of-run summary; the recorder given each step by the engine's step hook."""

from __future__ import annotations

import json

import pytest

from engine.config import Knobs
from engine.host_memory import HostUsage
from engine.telemetry import StepRecord, upgrade_record
from tuner.observation import LaneTimes, Observation


def _rec(rank: int, update_s: float, **kw) -> StepRecord:
    return StepRecord(
        iteration=4,
        update_s=update_s,
        read_wait_s=0.1 * (rank + 1),
        kernel_s=0.5 * update_s,
        write_wait_s=0.02 * (rank + 1),
        **kw,
    )


def test_a_record_survives_its_json_and_extra_fields_are_dropped():
    rec = _rec(0, 1.5, path_bytes_read={"/a": 10}, host_lane_s=0.3, knobs=Knobs(prefetch_depth=2))
    d = json.loads(json.dumps(rec.to_dict()))
    assert "bytes_moved_per_param" in d  # derived: written, not read back
    assert StepRecord.from_dict(d) == rec


def test_a_records_json_spells_its_knobs_and_host_bytes_as_they_spell_themselves():
    """The typed knobs and host bytes are written in ``to_dict()`` alone, as ``Knobs.to_dict()``
    and ``HostUsage.to_dict()`` write them, in the record's field order; a record made without
    them writes ``{}`` there (as the dicts the record held before), and reads back None."""
    from dataclasses import fields

    knobs = Knobs(prefetch_depth=3, io_concurrency={"/a": 8}, stripe_weights={"/a": 1.0})
    usage = HostUsage(state=1, staging=2, kept=3, copies=4)
    d = _rec(0, 1.0, knobs=knobs, host_bytes=usage).to_dict()
    assert list(d) == [f.name for f in fields(StepRecord)] + ["order", "bytes_moved_per_param"]
    assert json.dumps(d["knobs"]) == json.dumps(knobs.to_dict())
    assert json.dumps(d["host_bytes"]) == '{"state": 1, "staging": 2, "kept": 3, "copies": 4}'
    bare = _rec(0, 1.0).to_dict()
    assert (bare["knobs"], bare["host_bytes"]) == ({}, {})
    back = StepRecord.from_dict(json.loads(json.dumps(d)))
    assert (back.knobs, back.host_bytes) == (knobs, usage)
    assert (StepRecord.from_dict(bare).knobs, StepRecord.from_dict(bare).host_bytes) == (None, None)


def test_the_host_memory_summary_is_the_step_that_held_the_most():
    from report.analyze import host_memory_summary

    steps = [
        (0, _rec(0, 1.0)),  # a record from before the budget: not counted
        (1, _rec(0, 1.0, host_bytes=HostUsage(staging=5, kept=1), host_budget_bytes=10)),
        (2, _rec(0, 1.0, host_bytes=HostUsage(state=2, copies=1), host_budget_bytes=10, host_pressure=True)),
    ]
    assert host_memory_summary(steps) == {
        "budget_bytes": 10,
        "peak_bytes": 6,
        "peak_iteration": 1,
        "by_kind": {"state": 0, "staging": 5, "kept": 1, "copies": 0},
        "pressure_iterations": 1,
    }
    assert host_memory_summary(steps[:1]) is None


def test_a_record_in_the_old_names_reads_as_today():
    old = {"iteration": 3, "order": "reverse", "wall_s": 2.0, "read_wait_s": 0.5, "update_s": 1.25, "write_wait_s": 0.1}
    rec = StepRecord.from_dict(upgrade_record(old))
    assert (rec.update_s, rec.kernel_s) == (2.0, 1.25)
    assert upgrade_record(rec.to_dict()) == rec.to_dict()  # today's names pass unchanged
    # the tuner's wire does not require the order: the engine's parity rule fills it
    assert (
        StepRecord.from_dict({"iteration": 5, "update_s": 1, "read_wait_s": 0, "kernel_s": 0, "write_wait_s": 0}).order
        == "reverse"
    )


def test_an_iteration_is_its_slowest_rank_and_its_ranks_traffic_summed():
    a = _rec(
        0,
        1.0,
        path_bytes_read={"/a": 100},
        path_bytes_written={"/a": 50},
        host_lane_s=0.4,
        device_wait_s=0.1,
        host_lane_subgroups=3,
        device_lane_subgroups=1,
    )
    b = _rec(
        1,
        2.0,
        path_bytes_read={"/a": 100, "/b": 40},
        host_lane_s=0.9,
        device_wait_s=0.3,
        host_lane_subgroups=2,
        device_lane_subgroups=2,
        device_tier_subgroups=1,
    )
    tiny = _rec(2, 1e-9, path_bytes_read={"/a": 10**6})  # no measurement of a rate
    obs = Observation.from_records([a, b, tiny], iter_times_s=[3.0, 3.5], error="oom")
    assert (obs.iteration, obs.iter_time_s, obs.update_s, obs.kernel_s) == (4, 3.5, 2.0, 1.0)
    assert obs.read_wait_s == pytest.approx(0.3) and obs.write_wait_s == pytest.approx(0.06)
    assert obs.path_read_bytes_per_s == pytest.approx({"/a": 100 / 1.0 + 100 / 2.0, "/b": 40 / 2.0})
    assert obs.path_write_bytes_per_s == pytest.approx({"/a": 50.0})
    assert obs.lanes == LaneTimes(
        host_lane_s=0.9, device_wait_s=0.3, host_lane_subgroups=2, device_lane_subgroups=2, device_tier_subgroups=1
    )
    assert obs.error == "oom" and Observation.from_records([a]).iter_time_s is None


def _lane_step(iteration: int, **kw) -> StepRecord:
    """A step of 1 s between updates and a 0.5 s update: 0.1 s reading, 0.3 s of AdamW of
    which 0.1 s on the host lane (the rest queueing the device lane's), 0.05 s writing, 0.02 s
    waiting for the device."""
    return StepRecord(
        **{
            "iteration": iteration,
            "update_s": 0.5,
            "read_wait_s": 0.1,
            "kernel_s": 0.3,
            "host_lane_s": 0.1,
            "write_wait_s": 0.05,
            "device_wait_s": 0.02,
            "fwd_bwd_s": 1.0 if iteration else None,
            "params": 1000,
            "bytes_read": {"nvme": 8000},
            "bytes_written": {"nvme": 6000},
            **kw,
        }
    )


def test_one_split_of_a_step_for_the_report_and_the_summary(tmp_path):
    """The device lane's queueing is its own segment (not the host lane's AdamW), the update's
    rest is the update less its parts, and the summary from the telemetry alone tells its
    shares from that split."""
    from offloadctl.summary import run_summary_lines
    from report.analyze import engine_segments, shares

    seg = engine_segments(_lane_step(1), 0.5 + 0.04)
    assert seg == pytest.approx(
        {"read_wait": 0.1, "host_lane": 0.1, "device_lane": 0.2, "write_wait": 0.05, "device_wait": 0.02, "update_other": 0.07}
    )
    (tmp_path / "telemetry-rank0.jsonl").write_text(
        "".join(json.dumps(_lane_step(i, setup_s=0.04).to_dict()) + "\n" for i in range(3))
    )
    text = " ".join(run_summary_lines(str(tmp_path)))
    iteration_s = 1.0 + 0.5 + 0.04
    adamw = dict(shares({"forward": 1.0, **seg}, iteration_s))["update: AdamW"]
    assert f"AdamW {100 * adamw:.0f}%" in text and adamw == pytest.approx(0.3 / iteration_s)


def test_a_telemetry_file_from_before_the_device_lane_reads_all_its_adamw_on_the_host(tmp_path):
    from report.load import read_telemetry

    old = {"iteration": 0, "wall_s": 2.0, "read_wait_s": 0.5, "update_s": 1.25, "write_wait_s": 0.1}
    path = tmp_path / "telemetry-rank0.jsonl"
    path.write_text(json.dumps(old) + "\n" + json.dumps(_lane_step(1).to_dict()) + "\n" + '{"iteration": 2, "upd')
    notes: list[str] = []
    first, second = read_telemetry(str(path), notes)
    assert (first.update_s, first.kernel_s, first.host_lane_s) == (2.0, 1.25, 1.25)
    assert second == _lane_step(1) and "cut short" in notes[0]


class _OffloadEngine:
    """What the recorder touches of offloadctl's engine: its plan, its paths, its step hooks
    (no telemetry list: the recorder takes each step from its hook)."""

    def __init__(self) -> None:
        self.hooks, self.iteration = [], 0

    def describe(self):
        class Plan:
            path_kinds: dict = {}

            def to_dict(self):
                return {"knobs": {}}

        return Plan()

    def add_step_hook(self, hook) -> None:
        self.hooks.append(hook)

    def step(self) -> None:
        record = _lane_step(self.iteration, knobs=Knobs(prefetch_depth=2 if self.iteration < 2 else 3))
        self.iteration += 1
        for hook in self.hooks:
            hook.after_step(self, record)


class _DeepSpeedEngine:
    def __init__(self) -> None:
        import torch

        self.optimizer = type("Optimizer", (), {"overflow": False, "offload_engine": _OffloadEngine()})()
        self.module = torch.nn.Linear(2, 2)
        self.global_steps = 0

    def forward(self, x):
        return x

    def backward(self, loss):
        pass

    def step(self):
        self.optimizer.offload_engine.step()
        self.global_steps += 1


def test_the_recorder_takes_each_step_from_the_engines_step_hook(tmp_path):
    from integrations.ds_patches import attach_recorder
    from report.load import load_run
    from report.recorder import Recorder, RecorderConfig

    rec = Recorder(RecorderConfig(run_dir=str(tmp_path), sample_hz=0), rank=0, script="fake.py")
    eng = _DeepSpeedEngine()
    attach_recorder(eng, rec)
    for _ in range(3):
        eng.backward(eng.forward(1.0))
        eng.step()
    rec.close()
    run = load_run(str(tmp_path))
    steps = [it["engine"] for it in run.record.iterations]
    assert [s.iteration for s in steps] == [0, 1, 2] and all(isinstance(s, StepRecord) for s in steps)
    assert "tuner" in run.record.iterations[2] and "tuner" not in run.record.iterations[1]
