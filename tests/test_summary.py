"""The end-of-run summary (offloadctl/summary.py) and the end status of an interrupted run, on
real `offloadctl train` runs of examples/train_gpt.py (CPU): one that finishes, one stopped with
SIGINT as a Ctrl-C would."""

from __future__ import annotations

import io
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time

import pytest
from ds_runs import GPT, GPT_RECORDED
from helpers import ROOT, cli, env_with_root, free_port
from rich.console import Console

from offloadctl.summary import WIDTH, print_run_summary, run_summary_lines

pytestmark = pytest.mark.slow


def _train_args(base, name: str, steps: int) -> list[str]:
    nvme = base / f"nvme-{name}"
    nvme.mkdir()
    return [
        sys.executable,
        "-m",
        "offloadctl.cli",
        "train",
        "--num_gpus",
        "1",
        "--master_port",
        free_port(),
        "--nvme",
        str(nvme),
        "--tuner",
        "off",
        "--run-dir",
        str(base / name),
        GPT,
        "--steps",
        str(steps),
        "--batch",
        "8",
    ]


def _iterations(run_dir) -> int:
    try:
        with open(os.path.join(run_dir, "record-rank0.jsonl")) as f:
            return sum('"type":"iteration"' in line for line in f)
    except FileNotFoundError:
        return 0


@pytest.fixture(scope="module")
def runs(ds_runs, once, tmp_path_factory):
    """The report's recorded run, and one interrupted by SIGINT (once in the session, ``once``)."""
    finished = ds_runs.get(GPT_RECORDED).ok()  # 5 iterations (the report's run)
    return dict(once("summary_interrupted", lambda: _interrupted(tmp_path_factory)), finished=str(finished.run_dir))


def _interrupted(tmp_path_factory) -> dict:
    # Interrupted: SIGINT to `offloadctl train` (what Ctrl-C sends it) once three iterations are recorded.
    base = tmp_path_factory.mktemp("summary-runs")
    proc = subprocess.Popen(
        _train_args(base, "interrupted", 400),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env_with_root(),
        cwd=ROOT,
    )
    deadline = time.monotonic() + 300
    while _iterations(base / "interrupted") < 3 and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.2)
    assert proc.poll() is None, proc.communicate()[1][-3000:]
    proc.send_signal(signal.SIGINT)
    out, err = proc.communicate(timeout=120)
    return {"interrupted": str(base / "interrupted"), "interrupted_rc": proc.returncode, "interrupted_stderr": err}


def _report(run_dir: str) -> dict:
    out = cli("report", run_dir, "--json", timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout)["runs"][0]


def _joined(lines: list[str]) -> str:
    return " ".join(line.strip() for line in lines)


def test_an_interrupted_run_says_so_and_where(runs):
    assert runs["interrupted_rc"] == 128 + signal.SIGINT, runs["interrupted_stderr"][-3000:]
    lines = [json.loads(x) for x in open(os.path.join(runs["interrupted"], "record-rank0.jsonl"))]
    end = lines[-1]
    completed = sum(x["type"] == "iteration" for x in lines)
    assert end["type"] == "end" and end["status"] == "interrupted", end
    assert end["signal"] in ("SIGINT", "SIGTERM") and end["iterations"] == completed >= 3, end
    run = _report(runs["interrupted"])
    assert run["status"] == f"interrupted by {end['signal']} at iteration {completed}"
    assert run["status_kind"] == "interrupted"
    summary = run_summary_lines(runs["interrupted"])
    assert all(len(line) <= WIDTH for line in summary), summary
    assert f"interrupted by {end['signal']} at iteration {completed}" in _joined(summary)
    # The finished run says finished, and nothing about an interruption.
    assert _report(runs["finished"])["status"] == "finished"
    assert "interrupted" not in _joined(run_summary_lines(runs["finished"]))


def test_summary_leads_with_speed_then_shares_then_the_bottleneck(runs):
    run = _report(runs["finished"])
    s = run["summary"]
    lines = run_summary_lines(runs["finished"])
    assert all(len(line) <= WIDTH for line in lines), [line for line in lines if len(line) > WIDTH]
    text = _joined(lines)
    # Speed first: s/iteration, samples/s and tokens/s (8 sequences of 64 tokens per iteration).
    speed = lines[1]
    median_ms = (
        f"{s['median_iter_s'] * 1e3:.3g} ms/iteration" if s["median_iter_s"] < 1 else f"{s['median_iter_s']:.3g} s/iteration"
    )
    assert speed.startswith(median_ms), (speed, median_ms)
    samples = re.search(r"([\d.]+)(K?) samples/s", speed)
    tokens = re.search(r"([\d.]+)(K?) tokens/s", speed)
    assert samples and tokens, speed
    value = lambda m: float(m.group(1)) * (1000 if m.group(2) == "K" else 1)  # noqa: E731
    assert value(samples) == pytest.approx(8 / s["median_iter_s"], rel=0.01)
    assert value(tokens) == pytest.approx(8 * 64 / s["median_iter_s"], rel=0.01)
    assert re.search(r"5 iterations in [\d.]+ (ms|s)", text), text
    # Then the shares of the iteration, then the bottleneck: the report's own sentence.
    order = [text.index(k) for k in ("/iteration", "time per iteration: forward", "bottleneck: ")]
    assert order == sorted(order), text
    assert f"bottleneck: {s['verdict']}" in text
    assert re.search(r"moved per param and iteration: [\d.]+ B", text), text
    assert "tuner" not in text  # offloadctl train prints the tuner's line itself
    # Printed as it is (already wrapped): a wide console does not join or re-wrap the lines.
    buf = io.StringIO()
    print_run_summary(runs["finished"], Console(file=buf, width=160), rank=0)
    assert buf.getvalue().splitlines() == lines


def test_summary_from_the_engine_telemetry_alone(runs, short_tmp):
    """--no-record leaves only telemetry-rank<R>.jsonl: the update's parts, no throughput."""
    only = short_tmp / "telemetry-only"
    only.mkdir()
    shutil.copy(os.path.join(runs["finished"], "telemetry-rank0.jsonl"), only)
    lines = run_summary_lines(str(only))
    assert all(len(line) <= WIDTH for line in lines), lines
    text = _joined(lines)
    assert "engine telemetry only" in text and "no samples/s or tokens/s" in text
    assert not re.search(r"\d samples/s", text)
    assert re.search(r"[\d.]+ (ms|s)/iteration \(median of 4\), 5 iterations in", text), text
    assert "time per iteration: forward+backward" in text and "bottleneck: " in text


def test_summary_of_nothing_says_why(runs, short_tmp):
    tmp_path = short_tmp
    lines = run_summary_lines(str(tmp_path / "missing"))
    assert lines[0].startswith("no summary:") and all(len(line) <= WIDTH for line in lines)
    assert _joined(lines) == f"no summary: {tmp_path / 'missing'} has no record-rank0.jsonl or telemetry-rank0.jsonl"
    # A run stopped in its first iteration: the record's header and init only.
    early = tmp_path / "early"
    early.mkdir()
    head = open(os.path.join(runs["finished"], "record-rank0.jsonl")).readlines()[:2]
    (early / "record-rank0.jsonl").write_text("".join(head))
    lines = run_summary_lines(str(early))
    assert lines[0].startswith("no summary:") and "recorded no complete iteration" in _joined(lines)
    assert all(len(line) <= WIDTH for line in lines)


def test_the_bottleneck_sentence_names_it():
    """The one sentence the report and the summary share, on iterations of known parts."""
    from report.analyze import bottleneck

    waits = {"forward": 0.1, "backward": 0.2, "read_wait": 0.6, "host_lane": 0.05, "update_other": 0.05}
    assert bottleneck(waits, 1.0, "nvme") == "the update waits on reads from nvme: 60% of the iteration"
    writes = {"forward": 0.1, "backward": 0.2, "write_wait": 0.5, "host_lane": 0.2}
    assert bottleneck(writes, 1.0, "nvme+remote") == "the update waits on writes to nvme+remote: 50% of the iteration"
    adam = {"forward": 0.1, "backward": 0.2, "host_lane": 0.4, "device_lane": 0.2, "read_wait": 0.1}
    assert bottleneck(adam, 1.0, "host memory") == "the update is bound by AdamW's compute: 60% of the iteration"
    compute = {"forward": 0.3, "backward": 0.5, "read_wait": 0.05, "host_lane": 0.15}
    assert bottleneck(compute, 1.0, "nvme") == (
        "forward and backward (the model's compute) take 80% of the iteration; the update 20%, of it 5% waiting on nvme"
    )
    script = {"forward": 0.1, "backward": 0.1, "host_lane": 0.1, "outside": 0.7}
    assert bottleneck(script, 1.0, "nvme").startswith("the script's own work between DeepSpeed calls")


def test_a_version_1_record_still_reads(runs, tmp_path):
    """Records written before samples, tokens and the end's signal: status 'ok' reads as finished."""
    old = tmp_path / "v1"
    shutil.copytree(runs["finished"], old)
    rec = old / "record-rank0.jsonl"
    lines = [json.loads(x) for x in rec.read_text().splitlines()]
    lines[0]["version"] = 1
    for x in lines:
        for key in ("samples", "tokens", "signal"):
            x.pop(key, None)
    lines[-1]["status"] = "ok"
    rec.write_text("".join(json.dumps(x) + "\n" for x in lines))
    run = _report(str(old))
    assert run["status"] == "finished" and run["summary"]["samples_per_s"] is None
    text = _joined(run_summary_lines(str(old)))
    assert "samples/s" not in text and "/iteration (median of 4)" in text and "bottleneck: " in text
