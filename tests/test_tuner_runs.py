"""The tuner daemon's run bookkeeping (``tuner.runs.Runs``) driven directly, without a socket:
peers are plain objects, and what the daemon would send them is read from the outbox."""

from __future__ import annotations

import pytest

from engine import Knobs
from tuner.daemon_config import ServerConfig
from tuner.observation import Decision
from tuner.protocol import ErrorCode, ProtocolError


class Peer:
    def __init__(self, pid: int) -> None:
        self.pid = pid


class OneChange:
    """Deeper prefetch at the 2nd observation; records what it was told."""

    def __init__(self, start, facts):
        self.knobs, self.pins, self.seen = start, {}, []

    def observe(self, obs):
        self.seen.append(obs)
        if len(self.seen) == 2:
            self.knobs = self.knobs.replace(prefetch_depth=self.knobs.prefetch_depth + 1)
            return Decision(self.knobs, "one deeper")
        return None


def _register(runs, peer, rank, world=2):
    return runs.register(
        peer,
        {
            "type": "register",
            "run_id": "r",
            "rank": rank,
            "world_size": world,
            "params": 1000,
            "paths": [],
            "knobs": Knobs().to_dict(),
            "has_device": False,
            "subgroup_bytes": 12000,
        },
    )


def _telemetry(runs, peer, rank, i, update_s):
    rec = {
        "iteration": i,
        "update_s": update_s,
        "read_wait_s": 0.0,
        "write_wait_s": 0.0,
        "kernel_s": update_s,
        "knobs": Knobs().to_dict(),
    }
    runs.telemetry(
        peer, {"type": "telemetry", "run_id": "r", "rank": rank, "iteration": i, "record": rec, "iter_time_s": 1.0 + update_s}
    )


def test_runs_aggregate_ranks_and_push_one_change_to_all():
    from tuner.runs import Runs

    policies = []

    def factory(start, facts):
        policies.append(OneChange(start, facts))
        return policies[-1]

    runs = Runs(ServerConfig(socket_path="unused"), policy_factory=factory, sensors_factory=False)
    a, b = Peer(1), Peer(2)
    assert _register(runs, a, 0) == {"type": "registered", "run_id": "r", "rank": 0}
    _register(runs, b, 1)
    assert runs.take_outbox() == []
    _telemetry(runs, a, 0, 0, 0.5)
    assert policies[0].seen == []  # rank 1 has not reported iteration 0 yet
    _telemetry(runs, b, 1, 0, 0.7)
    assert [(o.iteration, o.update_s, o.iter_time_s) for o in policies[0].seen] == [(0, 0.7, 1.7)]  # the slowest
    _telemetry(runs, a, 0, 1, 0.5)
    _telemetry(runs, b, 1, 1, 0.5)
    pushed = runs.take_outbox()
    assert [p for p, _ in pushed] == [a, b]
    assert {m["apply_at"] for _, m in pushed} == {1 + runs.config.min_margin}
    assert all(
        m["type"] == "knobs" and m["seq"] == 1 and m["knobs"]["prefetch_depth"] == Knobs().prefetch_depth + 1 for _, m in pushed
    )
    with pytest.raises(ProtocolError) as e:
        runs.telemetry(b, {"type": "telemetry", "run_id": "r", "rank": 0, "iteration": 2, "record": {}})
    assert e.value.code == ErrorCode.UNKNOWN_RUN  # rank 0 is a's, not b's

    for peer, rank in ((a, 0), (b, 1)):
        runs.bye(peer, {"type": "bye", "run_id": "r", "rank": rank})
        runs.detach(peer)
    assert runs.runs["r"].status == "finished" and not runs.any_running()
    views, omitted = runs.views(None, 10, 1 << 20)
    assert omitted == [] and views[0]["history"]["iteration"] == [0, 1] and views[0]["seq"] == 1


def test_a_ranks_knobs_reach_the_policy_typed_and_knobs_out_of_range_are_refused():
    """The knobs a record reports are :class:`Knobs` from the wire on (the policy's, the run's
    knobs in force); ones the schema passes but Knobs refuses are BAD_VALUE, not the daemon's failure."""
    from tuner.runs import Runs

    policies = []

    def factory(start, facts):
        policies.append(OneChange(start, facts))
        return policies[-1]

    runs = Runs(ServerConfig(socket_path="unused"), policy_factory=factory, sensors_factory=False)
    a = Peer(1)
    _register(runs, a, 0, world=1)
    _telemetry(runs, a, 0, 0, 0.5)
    assert policies[0].seen[0].knobs == Knobs() and runs.runs["r"].in_force == Knobs()
    rec = {"iteration": 1, "update_s": 0.5, "read_wait_s": 0.0, "write_wait_s": 0.0, "kernel_s": 0.5}
    with pytest.raises(ProtocolError) as e:
        runs.telemetry(
            a, {"type": "telemetry", "run_id": "r", "rank": 0, "iteration": 1, "record": {**rec, "knobs": {"prefetch_depth": 65}}}
        )
    assert e.value.code == ErrorCode.BAD_VALUE and "prefetch_depth" in str(e.value)
    assert len(policies[0].seen) == 1


def _register_paths(runs, peer, paths):
    return runs.register(
        peer,
        {
            "type": "register",
            "run_id": "r",
            "rank": 0,
            "world_size": 1,
            "params": 1000,
            "paths": paths,
            "knobs": Knobs().to_dict(),
            "has_device": False,
            "subgroup_bytes": 12000,
        },
    )


def test_without_a_policy_the_run_takes_pins_itself_one_path_s_concurrency_too():
    """A policy that failed to start: pins and unpins still work, read as the policy reads them."""
    from tuner.runs import Runs

    def broken(start, facts):
        raise RuntimeError("no policy today")

    runs = Runs(ServerConfig(socket_path="unused"), policy_factory=broken, sensors_factory=False)
    a = Peer(1)
    _register_paths(runs, a, ["/nvme0", "/nvme1"])
    run = runs.runs["r"]
    assert run.policy_error and not run.policy_ok()
    reply = runs.controls.pin({"type": "pin", "run_id": "r", "knob": "io_concurrency[/nvme0]", "value": 8})
    assert reply["knobs"]["io_concurrency"] == {"/nvme0": 8}
    assert [m["knobs"]["io_concurrency"] for _, m in runs.take_outbox()] == [{"/nvme0": 8}]
    runs.controls.pin({"type": "pin", "run_id": "r", "knob": "node_lock", "value": "on"})  # text, read as the policy reads it
    assert run.knobs.node_lock is True
    assert runs.views("r", 0, 1 << 20)[0][0]["pins"] == {"io_concurrency[/nvme0]": 8, "node_lock": True}
    with pytest.raises(ProtocolError, match="names a path this run does not use") as e:
        runs.controls.pin({"type": "pin", "run_id": "r", "knob": "io_concurrency[/elsewhere]", "value": 8})
    assert e.value.code == ErrorCode.BAD_VALUE
    runs.controls.unpin({"type": "unpin", "run_id": "r", "knob": "io_concurrency[/nvme0]"})
    assert run.pins() == {"node_lock": True}
    with pytest.raises(ProtocolError, match="is not pinned"):
        runs.controls.unpin({"type": "unpin", "run_id": "r", "knob": "io_concurrency[/nvme0]"})


class PinsThenFails:
    """Takes pins; fails at its first observation."""

    def __init__(self, start, facts):
        self.knobs, self.pins = start, {}

    def pin(self, knob, value, check=None):
        self.pins[knob] = value
        self.knobs = self.knobs.replace(prefetch_depth=value)

    def observe(self, obs):
        raise RuntimeError("lost")


class PinsAnyway:
    """A factory's policy that ignores the wire's check and makes a device fraction of any pin."""

    def __init__(self, start, facts):
        self.knobs, self.pins = start, {}

    def pin(self, knob, value, check=None):
        self.pins[knob] = value
        self.knobs = self.knobs.replace(device_fraction=0.5)

    def observe(self, obs):
        return None


def test_a_pin_a_policy_makes_knobs_no_rank_can_run_of_is_refused():
    """The wire's check before the policy keeps a pin is the policy's to call; what the policy made
    of the pin is checked again, so that no rank is sent knobs it refuses (here a device fraction
    for a run without a device lane)."""
    from tuner.runs import Runs

    runs = Runs(ServerConfig(socket_path="unused"), policy_factory=PinsAnyway, sensors_factory=False)
    a = Peer(1)
    _register_paths(runs, a, ["/nvme0"])
    runs.take_outbox()
    with pytest.raises(ProtocolError) as e:
        runs.controls.pin({"type": "pin", "run_id": "r", "knob": "prefetch_depth", "value": 5})
    assert e.value.code == ErrorCode.BAD_VALUE and "device_fraction" in str(e.value)
    assert runs.runs["r"].knobs == Knobs() and runs.take_outbox() == []


def test_a_failed_policy_s_pins_stay_with_the_run():
    from tuner.runs import Runs

    runs = Runs(ServerConfig(socket_path="unused"), policy_factory=PinsThenFails, sensors_factory=False)
    a = Peer(1)
    _register_paths(runs, a, ["/nvme0"])
    runs.controls.pin({"type": "pin", "run_id": "r", "knob": "prefetch_depth", "value": 5})
    rec = {"iteration": 0, "update_s": 0.5, "read_wait_s": 0.0, "write_wait_s": 0.0, "kernel_s": 0.5}
    runs.telemetry(a, {"type": "telemetry", "run_id": "r", "rank": 0, "iteration": 0, "record": rec})
    run = runs.runs["r"]
    assert run.policy_error == "RuntimeError: lost"
    runs.controls.pin({"type": "pin", "run_id": "r", "knob": "io_concurrency[/nvme0]", "value": "2"})
    assert run.pins() == {"prefetch_depth": 5, "io_concurrency[/nvme0]": 2}
    assert run.knobs.prefetch_depth == 5 and run.knobs.io_concurrency == {"/nvme0": 2}


def test_a_knob_pinned_then_unpinned_and_left_there_is_still_the_users(tmp_path):
    """Issue 41 item 4: the user pins prefetch_depth, later unpins it, and the tuner holds there:
    the run's end does not record it as the tuner's verdict, so the next run does not start from
    it. A knob the tuner itself chose is still learned."""
    from tuner.history import History
    from tuner.runs import Runs

    with History(str(tmp_path / "tuner.db")) as history:
        runs = Runs(ServerConfig(socket_path="unused"), sensors_factory=False, history=history)
        a = Peer(1)
        _register(runs, a, 0, world=1)
        for i in range(3):
            _telemetry(runs, a, 0, i, 0.5)
        runs.controls.pin({"type": "pin", "run_id": "r", "knob": "prefetch_depth", "value": 5})
        runs.controls.unpin({"type": "unpin", "run_id": "r", "knob": "prefetch_depth"})
        for i in range(3, 8):
            _telemetry(runs, a, 0, i, 0.5)
        runs.bye(a, {"type": "bye", "run_id": "r", "rank": 0})
        runs.detach(a)
        (row,) = history.runs()
        assert row["knobs"]["prefetch_depth"] == 5
        assert "prefetch_depth" not in row["learned"] and "node_lock" in row["learned"], row
        assert history.warm_start(None, 1000, 1) is None or "prefetch_depth" not in history.warm_start(None, 1000, 1).learned


def test_the_record_schema_checks_every_field_the_daemon_reads(monkeypatch):
    """Each field of a telemetry record that the daemon reads, as it aggregates an iteration for
    the real policy, is one the wire's schema checks: a rank's wrong-typed value is its SCHEMA
    error, not the daemon's failure on that iteration."""
    import dataclasses

    import tuner.runs
    from engine.telemetry import StepRecord
    from tuner.protocol import API_VERSION, CLIENT_SCHEMAS, validate
    from tuner.runs import Runs

    names, read = {f.name for f in dataclasses.fields(StepRecord)}, set()

    class Spy(StepRecord):
        def __getattribute__(self, name):
            if name in names:
                read.add(name)
            return super().__getattribute__(name)

    monkeypatch.setattr(tuner.runs, "StepRecord", Spy)
    runs = Runs(ServerConfig(socket_path="unused"), sensors_factory=False)
    a = Peer(1)
    _register_paths(runs, a, ["/nvme0"])
    rec = {"iteration": 0, "update_s": 0.5, "read_wait_s": 0.1, "write_wait_s": 0.0, "kernel_s": 0.4}
    runs.telemetry(a, {"type": "telemetry", "run_id": "r", "rank": 0, "iteration": 0, "record": rec, "iter_time_s": 1.0})
    assert runs.runs["r"].policy_error is None and runs.runs["r"].last_observed == 0
    assert {"update_s", "path_bytes_read", "path_read_busy_s", "setup_s", "knobs"} <= read, read
    for name in sorted(read):
        msg = {"v": API_VERSION, "type": "telemetry", "run_id": "r", "rank": 0, "iteration": 0, "record": {**rec, name: "x"}}
        with pytest.raises(ProtocolError) as e:
            validate(msg, CLIENT_SCHEMAS)
        assert e.value.code == ErrorCode.SCHEMA and f"telemetry.record.{name}" in str(e.value), name
