"""What a user sees, second pass (issue 36): a tuner history that learns only from the tuner,
the start and end lines that say where knobs came from, and the CLI's own lines.

The tests here need no training run; those that do are in ``test_user_view_runs.py``."""
from __future__ import annotations

import json
import sqlite3

from engine import Knobs
from tuner.daemon_config import ServerConfig


class Peer:
    def __init__(self, pid: int) -> None:
        self.pid = pid


def _register(runs, peer, run_id, *, knobs=None, fixed=(), rank=0):
    msg = {"type": "register", "run_id": run_id, "rank": rank, "world_size": 1, "params": 1000, "paths": [],
           "knobs": (knobs or Knobs()).to_dict(), "has_device": False, "subgroup_bytes": 12000}
    if fixed:
        msg["fixed_knobs"] = list(fixed)
    return runs.register(peer, msg)


def _iterations(runs, peer, run_id, n, knobs):
    for i in range(n):
        rec = {"iteration": i, "update_s": 0.1, "read_wait_s": 0.0, "write_wait_s": 0.0, "kernel_s": 0.1,
               "knobs": knobs.to_dict()}
        runs.telemetry(peer, {"type": "telemetry", "run_id": run_id, "rank": 0, "iteration": i, "record": rec,
                              "iter_time_s": 0.5})


def _end(runs, peer, run_id, stopped_by=None):
    bye = {"type": "bye", "run_id": run_id, "rank": 0}
    if stopped_by:
        bye["stopped_by"] = stopped_by
    runs.bye(peer, bye)
    runs.detach(peer)
    assert runs.runs[run_id].status == "finished"


def _knob_pushes(runs):
    return [m for _, m in runs.take_outbox() if m["type"] == "knobs"]


class Verdict:
    """A policy that settled on deeper prefetch (its last good knobs), and pins nothing."""

    def __init__(self, start, facts):
        self.knobs, self.pins = start, {}

    def observe(self, obs):
        return None

    def state(self):
        return {"mode": "holding", "good_knobs": self.knobs.replace(prefetch_depth=3).to_dict(), "pins": {},
                "holding_reason": None}


def test_a_hand_pin_in_an_interrupted_run_is_no_later_runs_start(tmp_path):
    """Issue 36, 1: `tune --pin RUN:prefetch_depth=4` in a run stopped by Ctrl-C; the next run
    (another daemon, the same history) starts from its own knobs, and says nothing of history."""
    from tuner.history import History
    from tuner.runs import Runs

    db = str(tmp_path / "tuner.db")
    with History(db) as history:
        runs = Runs(ServerConfig(socket_path="unused"), sensors_factory=False, history=history)
        a = Peer(1)
        _register(runs, a, "pinned")
        runs.pin({"run_id": "pinned", "knob": "prefetch_depth", "value": 4})
        _iterations(runs, a, "pinned", 8, Knobs(prefetch_depth=4))
        _end(runs, a, "pinned", stopped_by="SIGINT")
        (row,) = history.runs()
        assert row["outcome"] == "interrupted" and "prefetch_depth" not in row["learned"]
    with History(db) as history:
        runs = Runs(ServerConfig(socket_path="unused"), sensors_factory=False, history=history)
        reply = _register(runs, Peer(2), "fresh")
        assert "start_from" not in reply
        assert _knob_pushes(runs) == [] and runs.runs["fresh"].knobs == Knobs()


def test_a_finished_run_with_a_pin_teaches_only_the_knobs_the_tuner_chose(tmp_path):
    """The same pin in a run that finished: its other knobs are the tuner's verdict, the pinned
    one is not; a knob given on the command line (fixed) is not learned either."""
    from tuner.history import History
    from tuner.runs import Runs

    with History(str(tmp_path / "tuner.db")) as history:
        runs = Runs(ServerConfig(socket_path="unused"), sensors_factory=False, history=history)
        a = Peer(1)
        _register(runs, a, "pinned", knobs=Knobs(node_lock=True), fixed=["node_lock"])
        runs.pin({"run_id": "pinned", "knob": "prefetch_depth", "value": 4})
        _iterations(runs, a, "pinned", 8, Knobs(prefetch_depth=4, node_lock=True))
        _end(runs, a, "pinned")
        runs.take_outbox()
        (row,) = history.runs()
        assert row["outcome"] == "finished"
        assert "prefetch_depth" not in row["learned"] and "node_lock" not in row["learned"]
        assert "device_fraction" in row["learned"]
        reply = _register(runs, Peer(2), "next")
        assert "start_from" not in reply and _knob_pushes(runs) == []  # nothing the tuner chose differs


def test_the_tuners_verdict_is_the_next_runs_start_and_every_line_says_so(tmp_path):
    """A finished run whose tuner settled on prefetch_depth=3: the next run like it starts
    there; the registration reply (the rank's start line), the change's reason and the end
    summary's tuner line name the knob, the value and the earlier run. A knob the new run's
    own options fix keeps its value."""
    from offloadctl.summary import tuner_lines
    from tuner.history import History
    from tuner.runs import Runs

    with History(str(tmp_path / "tuner.db")) as history:
        runs = Runs(ServerConfig(socket_path="unused"), sensors_factory=False, history=history,
                    policy_factory=Verdict)
        a = Peer(1)
        _register(runs, a, "tuned")
        _iterations(runs, a, "tuned", 4, Knobs())
        _end(runs, a, "tuned")
        runs = Runs(ServerConfig(socket_path="unused"), sensors_factory=False, history=history)
        b = Peer(2)
        reply = _register(runs, b, "next")
        assert reply["start_from"] == {"run_id": "tuned", "knobs": {"prefetch_depth": 3}}
        (push,) = _knob_pushes(runs)
        assert push["knobs"]["prefetch_depth"] == 3 and "run tuned" in push["reason"]
        view, _ = runs.views("next", 10, 1 << 20)
        line = "\n".join(tuner_lines(view[0]))
        assert "prefetch_depth 2 -> 3 (history: the tuner's verdict in run tuned)" in " ".join(line.split())
        assert all(len(x) <= 80 for x in line.splitlines())

        c = Peer(3)
        assert "start_from" not in _register(runs, c, "own", knobs=Knobs(prefetch_depth=1), fixed=["prefetch_depth"])
        assert _knob_pushes(runs) == []


def test_the_end_line_names_who_changed_each_knob():
    from offloadctl.summary import tuner_lines

    view = {"start_knobs": Knobs().to_dict(), "knobs": Knobs(prefetch_depth=4, node_lock=True).to_dict(),
            "changed_by": {"prefetch_depth": "user", "node_lock": "policy"}, "frozen": False,
            "policy": {"mode": "holding", "holding_reason": "no move left to try"}, "decisions": []}
    text = " ".join(" ".join(tuner_lines(view)).split())
    assert "node_lock off -> on (the tuner)" in text and "prefetch_depth 2 -> 4 (you, tune --pin)" in text
    assert text.rstrip().endswith("holding (no move left to try)")
    quiet = dict(view, knobs=Knobs().to_dict(), changed_by={})
    assert tuner_lines(quiet) == ["tuner: no knob changes; holding (no move left to try)"]


def test_a_schema_1_history_is_upgraded_and_never_learned_from(tmp_path):
    """Rows written before the history said who chose the knobs (they hold hand pins as often
    as verdicts) stay for `offloadctl tune`'s history, and never set a start."""
    from tuner.history import History

    db = tmp_path / "tuner.db"
    con = sqlite3.connect(str(db))
    con.executescript("""
        CREATE TABLE runs (run_id TEXT PRIMARY KEY, host TEXT NOT NULL, profile TEXT NOT NULL, params INTEGER NOT NULL,
            ranks INTEGER NOT NULL, paths TEXT NOT NULL, knobs TEXT NOT NULL, iter_time_s REAL,
            started_s REAL NOT NULL, updated_s REAL NOT NULL);
        PRAGMA user_version=1;""")
    con.execute("INSERT INTO runs VALUES ('old', 'h', '', 1000, 1, '[]', ?, 0.5, 1, 1)",
                (json.dumps(Knobs(prefetch_depth=4).to_dict()),))
    con.commit()
    con.close()
    with History(str(db)) as h:
        assert h.warm_start("", 1000, 1) is None and h.best_knobs("", 1000, 1) is None
        (row,) = h.runs()
        assert row["run_id"] == "old" and row["outcome"] is None and row["learned"] is None
    con = sqlite3.connect(str(db))
    assert con.execute("PRAGMA user_version").fetchone()[0] == 2
    con.close()
