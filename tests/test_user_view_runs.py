"""What a DeepSpeed user sees in tmux at 80x24, with real trainings: the screens are
captured with ``tmux capture-pane`` as the user would see them.

One scenario serves most tests (a launch costs tens of seconds): a run starts (its start line
at once), ``offloadctl tune --run-dir`` watches it, a key pins ``prefetch_depth=4`` while a
``dd oflag=direct`` writes to the same disk, the run is stopped with Ctrl-C; then a fresh run
of the same model starts, with a pin sent before its ranks registered and the live view left
with ``q``. Each test checks one point against what that left on the screens and in the files.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import shutil
import subprocess
import sys
import threading
import time
import uuid

import pytest
from ds_runs import launch, ours
from helpers import ROOT, cli, env_with_root, free_port, wait_for

pytestmark = [pytest.mark.slow, pytest.mark.skipif(shutil.which("tmux") is None, reason="needs tmux (apt-get install tmux)")]

PROMPT = "$ "


class Tmux:
    """A tmux server of this test's own (its own socket), one session at 80x24, windows by name."""

    def __init__(self, env: dict) -> None:
        self.sock = f"oc-test-{uuid.uuid4().hex[:8]}"
        self.env = env
        self._tmux("new-session", "-d", "-s", "t", "-n", "w0", "-x", "80", "-y", "24", *self._env(), "bash --norc --noprofile")
        self._tmux("set-option", "-g", "history-limit", "5000")
        self.send("w0", f"PS1={shlex.quote(PROMPT)}; cd {shlex.quote(ROOT)}; clear", enter=True)

    def _env(self) -> list[str]:
        return [a for k, v in self.env.items() for a in ("-e", f"{k}={v}")]

    def _tmux(self, *args: str) -> str:
        return subprocess.run(
            ["tmux", "-L", self.sock, "-f", "/dev/null", *args], check=True, capture_output=True, text=True
        ).stdout

    def window(self, name: str) -> None:
        self._tmux("new-window", "-d", "-t", "t", "-n", name, *self._env(), "bash --norc --noprofile")
        self._tmux("resize-window", "-t", f"t:{name}", "-x", "80", "-y", "24")
        self.send(name, f"PS1={shlex.quote(PROMPT)}; cd {shlex.quote(ROOT)}; clear", enter=True)

    def send(self, name: str, text: str, *, enter: bool = False) -> None:
        self._tmux("send-keys", "-t", f"t:{name}", "-l", text)
        if enter:
            self._tmux("send-keys", "-t", f"t:{name}", "Enter")

    def key(self, name: str, key: str) -> None:
        self._tmux("send-keys", "-t", f"t:{name}", key)

    def screen(self, name: str) -> str:
        """The visible 80x24 screen, as capture-pane gives it."""
        return self._tmux("capture-pane", "-p", "-t", f"t:{name}")

    def scrollback(self, name: str) -> str:
        return self._tmux("capture-pane", "-p", "-J", "-S", "-", "-t", f"t:{name}")

    def wait(self, name: str, pattern: str, timeout_s: float, *, scrollback: bool = False) -> str:
        """The screen (or all of the window) once ``pattern`` (a regex) is on it."""

        def found():
            text = self.scrollback(name) if scrollback else self.screen(name)
            return text if re.search(pattern, text) else None

        try:
            return wait_for(found, timeout_s, f"{pattern!r} in window {name}")
        except AssertionError:
            raise AssertionError(f"{pattern!r} not in window {name} within {timeout_s} s:\n{self.scrollback(name)}") from None

    def close(self) -> None:
        subprocess.run(["tmux", "-L", self.sock, "kill-server"], capture_output=True)


def _iterations(run_dir: str) -> list[dict]:
    try:
        with open(os.path.join(run_dir, "record-rank0.jsonl")) as f:
            return [x for x in map(json.loads, (line for line in f if line.endswith("\n"))) if x["type"] == "iteration"]
    except (FileNotFoundError, ValueError):
        return []


class DiskWriter:
    """Another job on the same disk: ``dd oflag=direct`` in a loop, until stopped."""

    def __init__(self, directory: str) -> None:
        self.path = os.path.join(directory, "dd.bin")
        self.stop_event = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self) -> None:
        while not self.stop_event.is_set():
            subprocess.run(
                ["dd", "if=/dev/zero", f"of={self.path}", "bs=1M", "count=32", "oflag=direct", "status=none"], check=False
            )

    def stop(self) -> None:
        self.stop_event.set()
        self.thread.join(60)
        try:
            os.unlink(self.path)
        except FileNotFoundError:
            pass


def _train(run_dir: str, nvme: str, steps: int, *extra: str) -> str:
    py = shlex.quote(sys.executable)
    return (
        f"{py} -m offloadctl.cli train --num_gpus 1 --master_port {free_port()} --nvme {nvme} --host-cache 0 "
        f"--run-dir {run_dir} {' '.join(extra)} examples/train_gpt.py --steps {steps} --batch 8; echo END-$?"
    )


def _tune(*args: str) -> str:
    return f"{shlex.quote(sys.executable)} -m offloadctl.cli tune {' '.join(map(shlex.quote, args))}; echo TUNE-$?"


@pytest.fixture(scope="module")
def scenario(once, tmp_path_factory):
    """The scenario's screens and files, played once in the session (``once``)."""
    return once("user_view_runs", lambda: _play(tmp_path_factory))


def _play(tmp_path_factory) -> dict:
    base = tmp_path_factory.mktemp("uv")
    for d in ("nvme", "state", "xdg"):
        (base / d).mkdir(mode=0o700)
    env = {
        "PYTHONPATH": ROOT,
        "XDG_STATE_HOME": str(base / "state"),
        "XDG_RUNTIME_DIR": str(base / "xdg"),
        "XDG_CONFIG_HOME": os.environ.get("XDG_CONFIG_HOME", str(base / "config")),
        "TERM": "xterm-256color",
        "OFFLOADCTL_PROFILE_DIR": os.environ.get("OFFLOADCTL_PROFILE_DIR", str(base / "profiles")),
    }
    t = Tmux(env)
    t.window("w1")
    out: dict = {"base": base, "r1": str(base / "r1"), "r2": str(base / "r2"), "env": env}
    writer = None
    try:
        # Run 1: its start line before anything else; the live view; a pin by key under another
        # job's disk traffic; Ctrl-C.
        t.send("w0", _train(out["r1"], str(base / "nvme"), 400, "--json-summary", str(base / "r1.json")), enter=True)
        out["start"] = t.wait("w0", r"starting 1 rank", 60)
        t.send("w1", _tune("--run-dir", out["r1"]), enter=True)
        t.wait("w1", r"ranks 1/1", 240)
        wait_for(lambda: len(_iterations(out["r1"])) >= 4, 120, "run 1's first iterations")
        writer = DiskWriter(str(base / "nvme"))
        t.key("w1", "p")
        t.send("w1", "prefetch_depth=4")
        out["typing"] = t.wait("w1", r"pin KNOB=VALUE: prefetch_depth=4", 10)
        t.key("w1", "Enter")
        out["live"] = t.wait("w1", r"pinned prefetch_depth=4", 30)
        t.key("w1", "?")
        out["help"] = t.wait("w1", r"keys of the live view", 10)
        t.key("w1", "?")
        t.send("w1", "xyz")  # keys the view does not take: never on the shell's prompt afterwards
        wait_for(
            lambda: sum(i.get("engine", {}).get("knobs", {}).get("prefetch_depth") == 4 for i in _iterations(out["r1"])) >= 6,
            180,
            "six iterations at prefetch_depth 4",
        )
        writer.stop()
        t.key("w0", "C-c")
        t.wait("w0", r"END-\d+", 180)
        out["end"] = t.screen("w0")
        out["end_all"] = t.scrollback("w0")
        out["tune_end"] = t.wait("w1", r"TUNE-\d+", 60)
        out["tune_end_all"] = t.scrollback("w1")

        # Run 2, fresh: a pin sent as soon as its start line names it (its ranks are loading),
        # then the live view, left with q.
        t.send("w0", "clear", enter=True)
        t.send("w1", "clear", enter=True)
        time.sleep(0.5)
        t.send("w0", _train(out["r2"], str(base / "nvme"), 30), enter=True)
        start2 = t.wait("w0", r"\(run \S+\)", 60)
        run2 = re.search(r"\(run (\S+)\)", start2).group(1)
        out["run2"] = run2
        t.send("w1", _tune("--pin", f"{run2}:node_lock=false"), enter=True)
        out["pin_wait"] = t.wait("w1", r"TUNE-\d+", 300)
        out["wrong_id"] = cli(
            "tune",
            "--pin",
            "no-such-run:prefetch_depth=3",
            timeout=60,
            env=env_with_root(**{k: env[k] for k in ("XDG_STATE_HOME", "XDG_RUNTIME_DIR")}),
        )
        t.send("w1", "clear", enter=True)
        time.sleep(0.5)
        t.send("w1", _tune("--run-dir", out["r2"]), enter=True)
        t.wait("w1", r"ranks 1/1", 120)
        t.key("w1", "q")
        out["quit"] = t.wait("w1", r"TUNE-\d+", 30)
        t.wait("w0", r"END-\d+", 300)
        out["fresh_all"] = t.scrollback("w0")
    finally:
        if writer is not None:
            writer.stop()
        t.close()
    return out


def _joined(screen: str) -> str:
    return " ".join(screen.split())


def _fits(screen: str) -> None:
    lines = screen.splitlines()
    assert len(lines) <= 24 and all(len(line) <= 80 for line in lines), screen


def test_point1_a_hand_pin_in_one_run_is_not_the_next_runs_start(scenario):
    end = _joined(scenario["end_all"])
    assert "tuner: changed prefetch_depth 2 -> 4 (you, tune --pin)" in end, scenario["end_all"]
    fresh = scenario["fresh_all"]
    assert "history:" not in fresh, fresh
    assert re.search(r"END-0", fresh), fresh
    knobs = [i["engine"]["knobs"]["prefetch_depth"] for i in _iterations(scenario["r2"]) if "engine" in i]
    assert knobs and set(knobs) == {2}, knobs
    assert "tuner: no knob changes" in _joined(fresh), fresh
    from tuner.history import History

    with History(os.path.join(scenario["env"]["XDG_STATE_HOME"], "offloadctl", "tuner.db")) as h:
        rows = {r["run_id"]: r for r in h.runs()}
    first = next(r for r in rows.values() if r["run_id"] != scenario["run2"])
    assert first["outcome"] == "interrupted" and "prefetch_depth" not in first["learned"], first


def test_point3_the_reports_disk_bytes_are_the_runs_own_under_another_writer(scenario):
    out = cli("report", scenario["r1"], "--json", "--output", str(scenario["base"] / "r1.html"), timeout=300)
    assert out.returncode == 0, out.stderr
    s = json.loads(out.stdout)["runs"][0]["summary"]
    engine, own, others = (
        s["engine_bytes_per_param_total"],
        s["run_disk_bytes_per_param_total"],
        s["other_disk_bytes_per_param_total"],
    )
    assert others > 2 * own and others > 5, s  # dd wrote far more than the run
    assert 0.5 * engine <= own <= 1.5 * engine + 1.0, (engine, own)  # the run's own: what its engine counted
    assert s["disk_bytes_per_param_total"] >= own + 0.9 * others
    text = cli(
        "report", scenario["r1"], "--output", str(scenario["base"] / "r1b.html"), timeout=300, env=env_with_root(COLUMNS="80")
    ).stdout
    row = next(line for line in text.splitlines() if "disk B/param, iteration" in line)
    assert f"{own:.1f}; other processes {others:.1f}" in row, row


def test_point4_ctrl_c_is_sigint_and_every_screen_has_the_same_last_iteration(scenario):
    records = [json.loads(x) for x in open(os.path.join(scenario["r1"], "record-rank0.jsonl"))]
    end = records[-1]
    n = sum(r["type"] == "iteration" for r in records)
    assert end["type"] == "end" and end["signal"] == "SIGINT" and end["iterations"] == n, end
    said = f"interrupted by SIGINT at iteration {n}"
    assert said in _joined(scenario["end_all"]), scenario["end_all"]
    assert said in _joined(scenario["tune_end"]), scenario["tune_end"]
    assert "END-130" in scenario["end"]
    for screen in (scenario["end_all"], scenario["tune_end_all"]):
        assert "Traceback" not in screen and "race condition" not in screen and "[INFO]" not in screen, screen
        assert "SIGTERM" not in screen, screen


def test_point5_a_start_line_at_once_and_tune_waits_for_a_starting_run(scenario):
    start = scenario["start"]
    said = [line for line in start.splitlines() if line.startswith("offloadctl")]  # the command line is "$ ..."
    assert said[0].startswith("offloadctl: starting 1 rank of train_gpt.py (run "), start
    assert "engine active" not in start and "deepspeed.log" in _joined(start), start  # before the ranks spoke
    assert f"offloadctl tune --run-dir {scenario['r1']}" in _joined(start), start
    waited = _joined(scenario["pin_wait"])
    assert f"waiting for run {scenario['run2']} to start" in waited, waited
    assert f"{scenario['run2']}: pinned node_lock=False" in waited and "TUNE-0" in waited, waited
    wrong = scenario["wrong_id"]
    assert wrong.returncode == 2 and "no live run no-such-run" in wrong.stderr, wrong.stderr
    assert scenario["run2"] in wrong.stdout, wrong.stdout  # the live runs are listed


def test_point7_the_live_view_takes_keys_and_gives_the_terminal_back(scenario):
    for name in ("typing", "live", "help"):
        _fits(scenario[name])
    legend = scenario["live"].rstrip().splitlines()[-1]
    assert legend.startswith("q quit  p pin  u unpin  f freeze  ? help"), scenario["live"]
    assert "pinned: prefetch_depth=4" in _joined(scenario["live"]), scenario["live"]
    assert "xyz" not in scenario["tune_end"] and "no key" not in scenario["tune_end"].splitlines()[-1]
    last = [line for line in scenario["tune_end"].splitlines() if line.strip()][-2:]
    assert last == ["TUNE-0", PROMPT.strip()], scenario["tune_end"]  # nothing typed in the view reached the shell
    assert "left the live view; the run goes on" in scenario["quit"] and "TUNE-0" in scenario["quit"]


def test_point9_the_json_summary_of_the_interrupted_run(scenario):
    summary = json.load(open(scenario["base"] / "r1.json"))
    n = sum(1 for _ in _iterations(scenario["r1"]))
    assert summary["status"] == "interrupted" and summary["stopped_by"] == "SIGINT", summary
    assert summary["exit_status"] == 130 and summary["iterations"] == n
    assert summary["median_iteration_s"] > 0 and summary["bottleneck"]
    assert {"knob": "prefetch_depth", "from": 2, "to": 4, "by": "user"} in summary["tuner"]["changes"], summary


def test_point6_a_refusal_only_a_rank_can_make_is_one_line(tmp_path):
    """A config built inside the script (ZeRO-2 here), two ranks: one line, once, not
    DeepSpeed's report of each rank, and no pointer to a report of nothing."""
    run = launch(ours(2, "--stage", "2", "--steps", "2", opts=("--tuner", "off")), tmp_path)
    assert run.returncode != 0
    lines = [line for line in (run.stdout + run.stderr).splitlines() if line.strip()]
    ours_lines = [line for line in lines if line.startswith("offloadctl:") and not line.startswith("offloadctl: starting")]
    assert len(ours_lines) == 1 and "needs ZeRO stage 3" in ours_lines[0], lines
    assert not any("sigkill_handler" in line or "recorded:" in line or "Traceback" in line for line in lines), lines
