"""What a user sees: a tuner history that learns only from the tuner,
the start and end lines that say where knobs came from, and the CLI's own lines.

The tests here need no training run; those that do are in ``test_user_view_runs.py``."""

from __future__ import annotations

import json
import re
import sqlite3

import pytest

from engine import Knobs
from tuner.daemon_config import ServerConfig


class Peer:
    def __init__(self, pid: int) -> None:
        self.pid = pid


def _register(runs, peer, run_id, *, knobs=None, pins=None, rank=0):
    msg = {
        "type": "register",
        "run_id": run_id,
        "rank": rank,
        "world_size": 1,
        "params": 1000,
        "paths": [],
        "knobs": (knobs or Knobs()).to_dict(),
        "has_device": False,
        "subgroup_bytes": 12000,
    }
    if pins:
        msg["pins"] = dict(pins)
    return runs.register(peer, msg)


def _iterations(runs, peer, run_id, n, knobs):
    for i in range(n):
        rec = {
            "iteration": i,
            "update_s": 0.1,
            "read_wait_s": 0.0,
            "write_wait_s": 0.0,
            "kernel_s": 0.1,
            "knobs": knobs.to_dict(),
        }
        runs.telemetry(
            peer, {"type": "telemetry", "run_id": run_id, "rank": 0, "iteration": i, "record": rec, "iter_time_s": 0.5}
        )


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
        return {
            "mode": "holding",
            "good_knobs": self.knobs.replace(prefetch_depth=3).to_dict(),
            "pins": {},
            "holding_reason": None,
        }


def test_a_hand_pin_in_an_interrupted_run_is_no_later_runs_start(tmp_path):
    """`tune --pin RUN:prefetch_depth=4` in a run stopped by Ctrl-C; the next run
    (another daemon, the same history) starts from its own knobs, and says nothing of history."""
    from tuner.history import History
    from tuner.runs import Runs

    db = str(tmp_path / "tuner.db")
    with History(db) as history:
        runs = Runs(ServerConfig(socket_path="unused"), sensors_factory=False, history=history)
        a = Peer(1)
        _register(runs, a, "pinned")
        runs.controls.pin({"run_id": "pinned", "knob": "prefetch_depth", "value": 4})
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
        _register(runs, a, "pinned", knobs=Knobs(node_lock=True), pins={"node_lock": True})
        runs.controls.pin({"run_id": "pinned", "knob": "prefetch_depth", "value": 4})
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
        runs = Runs(ServerConfig(socket_path="unused"), sensors_factory=False, history=history, policy_factory=Verdict)
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
        assert "start_from" not in _register(runs, c, "own", knobs=Knobs(prefetch_depth=1), pins={"prefetch_depth": 1})
        assert _knob_pushes(runs) == []


def test_the_end_line_names_who_changed_each_knob():
    from offloadctl.summary import tuner_lines

    view = {
        "start_knobs": Knobs().to_dict(),
        "knobs": Knobs(prefetch_depth=4, node_lock=True).to_dict(),
        "changed_by": {"prefetch_depth": "user", "node_lock": "policy"},
        "frozen": False,
        "verdict": {"mode": "holding", "since_iteration": 40, "trial": None, "reason": None},
    }
    text = " ".join(" ".join(tuner_lines(view)).split())
    assert "node_lock off -> on (the tuner)" in text and "prefetch_depth 2 -> 4 (you, tune --pin)" in text
    assert text.rstrip().endswith("holding (no move left to try)")
    quiet = dict(view, knobs=Knobs().to_dict(), changed_by={})
    assert tuner_lines(quiet) == ["tuner: no knob changes; holding (no move left to try)"]
    why = dict(quiet, verdict={"mode": "holding", "since_iteration": 40, "trial": None, "reason": "knobs change 1% of it"})
    assert tuner_lines(why) == ["tuner: no knob changes; holding (knobs change 1% of it)"]
    # Trials the tuner made and reverted: the knobs ended as they started, but they did move.
    decisions = [{"iteration": i, "reason": "trying io_concurrency 4->8", "source": "policy"} for i in (12, 15)]
    tried = dict(why, decisions=[*decisions, {"iteration": 20, "reason": "pinned", "source": "user"}])
    said = " ".join(" ".join(tuner_lines(tried)).split())
    assert said == "tuner: no knob changes in the end (2 tried and undone); holding (knobs change 1% of it)"
    many = dict(why, decisions=decisions * 10)
    assert "(20 or more tried and undone)" in " ".join(tuner_lines(many))


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
    con.execute(
        "INSERT INTO runs VALUES ('old', 'h', '', 1000, 1, '[]', ?, 0.5, 1, 1)", (json.dumps(Knobs(prefetch_depth=4).to_dict()),)
    )
    con.commit()
    con.close()
    with History(str(db)) as h:
        assert h.warm_start("", 1000, 1) is None
        (row,) = h.runs()
        assert row["run_id"] == "old" and row["outcome"] is None and row["learned"] is None
    con = sqlite3.connect(str(db))
    assert con.execute("PRAGMA user_version").fetchone()[0] == 2
    con.close()


# -- the CLI's own lines -------------------------------------------------------------------------


def _script(tmp_path, config: dict | None, *, flag="--deepspeed_config", name="ds_config.json"):
    """A DeepSpeed script that would take its ds_config from its arguments (never run here)."""
    script = tmp_path / "train.py"
    script.write_text("import deepspeed\n")
    if config is None:
        return script, []
    cfg = tmp_path / name
    cfg.write_text(json.dumps(config))
    return script, ([flag, str(cfg)] if flag else [str(cfg)])


DS_BASE = {"train_micro_batch_size_per_gpu": 4, "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}}}


@pytest.mark.slow
def test_a_config_the_engine_refuses_is_refused_before_the_launch(tmp_path, short_tmp):
    """ZeRO-2, or ZeRO-3 without offload_optimizer, named by the script's
    --deepspeed_config, HF's --deepspeed=FILE or as a JSON among its arguments: one line naming
    the file, at once, no run dir; --engine stock takes it."""
    import time

    from helpers import cli

    cases = [
        (
            {**DS_BASE, "zero_optimization": {"stage": 2, "offload_optimizer": {"device": "cpu"}}},
            "--deepspeed_config",
            "uses stage 2",
        ),
        ({**DS_BASE, "zero_optimization": {"stage": 3}}, "--deepspeed", "has none"),
        ({**DS_BASE, "zero_optimization": {"stage": 3, "offload_optimizer": {"device": "none"}}}, None, 'has device "none"'),
    ]
    for k, (config, flag, said) in enumerate(cases):
        d = tmp_path / str(k)
        d.mkdir()
        script, args = _script(d, config, flag=flag)
        if flag == "--deepspeed":
            args = [f"--deepspeed={args[1]}"]
        run_dir = short_tmp / f"run{k}"
        t0 = time.monotonic()
        out = cli("train", "--dry-run", "--num_gpus", "1", "--run-dir", str(run_dir), str(script), *args, timeout=120)
        assert out.returncode == 2, (out.stdout, out.stderr)
        (line,) = out.stderr.splitlines()
        assert said in line and "ds_config.json" in line and "--engine stock" in line, line
        assert time.monotonic() - t0 < 30 and not run_dir.exists()
    script, args = _script(tmp_path / "0", cases[0][0])
    out = cli("train", "--dry-run", "--engine", "stock", "--num_gpus", "1", str(script), *args, timeout=120)
    assert out.returncode == 0, out.stderr
    ok = {**DS_BASE, "zero_optimization": {"stage": 3, "offload_optimizer": {"device": "cpu"}}}
    (tmp_path / "ok").mkdir()
    script, args = _script(tmp_path / "ok", ok)
    out = cli("train", "--dry-run", "--num_gpus", "1", str(script), *args, timeout=120)
    assert out.returncode == 0, out.stderr


def test_a_json_that_is_no_ds_config_is_left_alone(tmp_path):
    from integrations.ds_config_check import check_ds_config, find_ds_config

    data = tmp_path / "data.json"
    data.write_text(json.dumps({"zero": 2, "rows": [1, 2]}))
    assert find_ds_config(["--data", str(data)]) is None and check_ds_config([str(data)]) is None
    cfg = tmp_path / "cfg.json"
    cfg.write_text(json.dumps({**DS_BASE, "zero_optimization": {"stage": 3, "offload_optimizer": {"device": "nvme"}}}))
    found = check_ds_config(["--config", f"{cfg}"], paths_given=True)  # on NVMe: with --nvme given
    assert found is not None and found.how == "a JSON file among the script's arguments"
    # A config file the script's flag names that is not there is no data file: refused before the
    # launch (issue 42: it used to launch and end in a page of traceback in every rank).
    from engine.errors import ConfigError

    with pytest.raises(ConfigError, match="missing.json does not exist .the script's --deepspeed_config."):
        check_ds_config(["--deepspeed_config", str(tmp_path / "missing.json")])


@pytest.mark.slow
def test_dry_run_is_one_human_block_at_80_columns(short_tmp):
    """No settings JSON, and no row broken mid-token: one block with the launch, where the
    state goes, knobs and pins, the tuner; --json keeps the JSON."""
    from helpers import cli, env_with_root

    args = (
        "train",
        "--dry-run",
        "--num_gpus",
        "1",
        "--nvme",
        str(short_tmp),
        "--prefetch-depth",
        "3",
        "--run-dir",
        str(short_tmp / "run"),
        "examples/train_gpt.py",
        "--steps",
        "3",
    )
    out = cli(*args, env=env_with_root(COLUMNS="80"), timeout=120)
    assert out.returncode == 0, out.stderr
    lines = out.stdout.splitlines()
    assert all(len(line) <= 80 for line in lines) and len(lines) <= 24, out.stdout
    assert "{" not in out.stdout and "offloadctl-config" not in out.stdout, out.stdout
    labels = [line.split(":")[0] for line in lines[1:] if not line.startswith(" ")]
    assert labels[:3] == ["launch", "ranks", "state"] and {"knobs", "tuner", "run dir"} <= set(labels), labels
    text = " ".join(" ".join(lines).split())
    assert "deepspeed --num_gpus 1 examples/train_gpt.py --steps 3" in text
    assert f"{short_tmp} (NVMe)" in text and "never tuned: prefetch_depth=3" in text
    assert out.stderr == "", out.stderr  # DeepSpeed's import-time lines stay out of it
    out = cli(*args[:-3], "--json", *args[-3:], timeout=120)
    plan = json.loads(out.stdout)
    assert plan["settings"]["knobs"]["prefetch_depth"] == 3 and "command" in plan["launch"]


def test_json_output_into_a_closed_pipe_ends_quietly(tmp_path):
    """`plan --json | head` and `train --dry-run --json | head`: no BrokenPipeError."""
    import subprocess
    import sys

    from helpers import ROOT, env_with_root

    for args in (
        ["plan", "--profile", "profiles/example-cpu-vm.toml", "--params", "7B", "--ranks", "8", "--json"],
        ["profile", "show", "profiles/example-h100-node.toml", "--json"],
    ):
        p = subprocess.Popen(
            [sys.executable, "-m", "offloadctl.cli", *args],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            env=env_with_root(),
            cwd=ROOT,
        )
        p.stdout.read(1)
        p.stdout.close()  # as `head -c 1` does
        err = p.stderr.read().decode()
        p.wait(60)
        assert "Traceback" not in err and "BrokenPipe" not in err, err
        assert p.returncode in (0, 141), (p.returncode, err)


def test_tune_once_json_with_no_run_is_an_empty_list(tmp_path):
    """`tune --once --json` with no live run: {"runs": []}, exit 0."""
    from helpers import cli, env_with_root

    (tmp_path / "xdg").mkdir()
    out = cli(
        "tune",
        "--once",
        "--json",
        "--socket",
        str(tmp_path / "none.sock"),
        timeout=60,
        env=env_with_root(XDG_RUNTIME_DIR=str(tmp_path / "xdg")),
    )
    assert out.returncode == 2  # a socket named by the user that does not answer: still an error
    out = cli("tune", "--once", "--json", timeout=60, env=env_with_root(XDG_RUNTIME_DIR=str(tmp_path / "xdg")))
    assert out.returncode == 0 and json.loads(out.stdout) == {"runs": []}, (out.stdout, out.stderr)


def test_profile_errors_name_toml_tables_and_plan_says_where_profiles_come_from(tmp_path):
    """Profile errors name `[machine]`, `[[paths]]`, the top level, never a Python class; `plan`
    without --profile: how to measure one, and an example; the examples cite nothing a user
    does not have."""
    import glob
    import re

    from helpers import ROOT, cli

    from engine.errors import ConfigError
    from perf.profile_toml import loads_profile

    text = open(f"{ROOT}/profiles/example-cpu-vm.toml").read()
    for bad, table in (
        (text.replace("numa_nodes = 1", "numa_nodes = 1\nbogus = 1"), "[machine]"),
        (text.replace("[[paths]]", "[[paths]]\nfoo = 3", 1), "[[paths]]"),
        ("schema_version = 1\nname = 'x'\n", "the top level"),
    ):
        try:
            loads_profile(bad, file="p.toml")
        except ConfigError as e:
            msg = str(e)
        else:
            raise AssertionError("accepted")
        assert table in msg and not re.search(r"\b(Machine|PathProfile|Profile|Source|Host)\b", msg), msg
    out = cli("plan", "--params", "7B", timeout=60)
    assert out.returncode == 2 and out.stderr.count("\n") == 1, out.stderr
    assert "offloadctl profile save" in out.stderr and "profiles/example-" in out.stderr, out.stderr
    for path in glob.glob(f"{ROOT}/profiles/*"):
        body = open(path).read()
        assert "RESEARCH.md" not in body and "/work/" not in body and "/home/" not in body, path


def test_tune_once_keeps_knob_names_whole_and_history_changes_say_start():
    """`tune --once` at 80 columns keeps knob names whole; a change made at registration
    (history's) is listed at the start, not at iteration -1; iterations are counted as the
    summary counts them."""
    from rich.console import Console

    from offloadctl.commands.tune_view import run_panel, runs_table

    path = "/a/rather/long/path/to/an/nvme/directory"
    knobs = Knobs(io_concurrency={path: 8}, stripe_weights={path: 1.0}).to_dict()
    run = {
        "run_id": "20261126-132559-f94b026b",
        "status": "running",
        "frozen": False,
        "connected": 1,
        "ranks": 1,
        "iteration": 109,
        "iter_time_s": 0.5,
        "knobs": knobs,
        "pins": {},
        "history": {"iter_time_s": [0.5], "update_s": [0.1], "iteration": [109]},
        "bandwidth": {},
        "phases": {},
        "decisions": [{"iteration": -1, "apply_at": 2, "source": "history", "reason": "from history: run x"}],
    }
    console = Console(width=80, record=True, file=open("/dev/null", "w"))
    console.print(runs_table([run], width=80))
    text = console.export_text()
    assert all(len(line) <= 80 for line in text.splitlines()), text
    flat = "".join(text.split())
    for part in ("device_fraction=0", "prefetch_depth=2", f"io_concurrency={path}:8", f"stripe_weights={path}:1"):
        assert part in flat, text
    assert "iteration 110" in text and "500 ms/iteration" in text, text
    console.print(run_panel(run, width=80))
    panel = console.export_text()
    assert re.search(r"│\s+start\s+2\s+history\s+from history", panel) and " -1 " not in panel, panel


def test_a_log_line_split_after_a_progress_bar_stays_off_the_terminal():
    """Ctrl-C's launcher lines ("Killing subprocess") arrived in pieces after a progress bar and
    showed; every rank's copy of the same offloadctl line showed once per rank."""
    import io

    from integrations.run_output import OutputFilter

    rec = b"[2026-11-26 13:51:04,045] [INFO] [launch.py:253:sigkill_handler] Killing subprocess 17679\n"
    for cut in (1, 5, 12, 26, 29, 40):
        out, log = io.BytesIO(), io.BytesIO()
        f = OutputFilter(out, log)
        f.feed(b"\r\x1b[2Ktraining \x1b[38;5;237m\xe2\x94\x81\x1b[0m 89/300 \x1b[33m0:00:50\x1b[0m")
        f.feed(rec[:cut])
        f.feed(rec[cut:])
        f.close()
        assert b"Killing" not in out.getvalue() and log.getvalue() == rec, (cut, out.getvalue())
    out, said = io.BytesIO(), set()
    line = b"offloadctl: offloadctl needs `offload_optimizer` (device cpu or nvme) in the ZeRO-3 config\n"
    for stream in (OutputFilter(out, io.BytesIO(), said=said), OutputFilter(out, io.BytesIO(), said=said)):
        stream.feed(line[:30])  # python -u writes the newline apart
        stream.feed(line[30:])
    assert out.getvalue() == line


def test_the_readme_says_what_the_code_does():
    """The README's sampling rate, the demo's time and last line; single-node options are
    not under "On a cluster"."""
    from helpers import ROOT

    from report.recorder import RecorderConfig

    readme = open(f"{ROOT}/README.md").read()
    assert f"at {RecorderConfig(run_dir='x').sample_hz:.0f} Hz" in readme and "20 Hz" not in readme
    assert "runs/demo-report.html" in readme and re.search(r"make demo` takes about \d+ minutes", readme)
    cluster = readme[readme.index("### On a cluster") : readme.index("\n## ", readme.index("### On a cluster"))]
    for single in ("--profile NAME|PATH", "Hugging Face", "--host-memory SIZE", "On a GPU"):
        assert single not in cluster, single
    makefile = open(f"{ROOT}/Makefile").read()
    assert "--output runs/demo-report.html" in makefile and "report runs/demo " in makefile


def test_a_change_of_conditions_is_said_with_its_cause_and_measured_effect():
    """Issue 41 item 4: the summary and the live view say each change of conditions, what the
    tuner did about it, and what that did to the iteration; the live view shows each path's rate."""
    from rich.console import Console

    from offloadctl.commands.tune_view import run_panel
    from offloadctl.summary import tuner_lines

    a = {
        "iteration": 42,
        "cause": "path /ssd1 slowed from 300 to 62 MB/s",
        "move": "stripe weight /ssd1 0.5 -> 0.17, stripe weight /ssd0 0.5 -> 0.83",
        "effect": "iteration 10.5 -> 3.9 s, -63%",
    }
    policy = {"adaptations": [a], "rates": {"/ssd0": 301e6, "/ssd1": 62e6}}
    view = {
        "start_knobs": Knobs().to_dict(),
        "knobs": Knobs().to_dict(),
        "changed_by": {},
        "frozen": False,
        "policy": policy,
        "verdict": {"mode": "holding", "since_iteration": 50, "trial": None, "reason": None},
    }
    text = " ".join(" ".join(tuner_lines(view)).split())
    assert (
        "tuner: at iteration 42, path /ssd1 slowed from 300 to 62 MB/s: stripe weight /ssd1 0.5 -> 0.17, "
        "stripe weight /ssd0 0.5 -> 0.83 (iteration 10.5 -> 3.9 s, -63%)"
    ) in text
    snap = {
        "run_id": "r",
        "status": "running",
        "ranks": 1,
        "connected": 1,
        "iteration": 60,
        "iter_time_s": 3.9,
        "knobs": Knobs().to_dict(),
        "pins": {},
        "frozen": False,
        "policy": policy,
        "policy_error": None,
        "history": {"iteration": [], "iter_time_s": [], "update_s": []},
        "decisions": [],
        "phases": {},
        "bandwidth": {
            p: {"read_bytes_per_s": 1e8, "write_bytes_per_s": 1e8, "other_bytes_per_s": 0.0, "concurrency": 4}
            for p in ("/ssd0", "/ssd1")
        },
        "verdict": view["verdict"],
        "outcome": "running",
    }
    console = Console(width=120, record=True)
    console.print(run_panel(snap, width=120))
    shown = console.export_text()
    assert "serves at" in shown and "62 MB/s" in shown and "301 MB/s" in shown
    assert "conditions: at iteration 42, path /ssd1 slowed from 300 to 62 MB/s" in shown
