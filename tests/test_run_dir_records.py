"""A run's record files: private whatever the run dir's mode (issue 43, item 7), and a full
run-dir disk said in one line, not one per record stream (item 9).

Real files in real directories with a real umask; the full disk is a real small tmpfs (root).
"""

from __future__ import annotations

import logging
import os
import stat
import subprocess
import sys
import time

import pytest
from helpers import IS_ROOT, ROOT, env_with_root, free_port, mounted

TINY = os.path.join(ROOT, "tests", "ds_scripts", "train_tiny.py")
RECORD_FILES = {"record-rank0.jsonl", "samples-rank0.jsonl", "telemetry-rank0.jsonl", "deepspeed.log"}


@pytest.fixture
def umask_022():
    """The umask most users have: files made without a mode of their own come out 0644."""
    old = os.umask(0o022)
    yield
    os.umask(old)


def _modes(run_dir) -> dict[str, int]:
    return {n: stat.S_IMODE(os.lstat(os.path.join(run_dir, n)).st_mode) for n in os.listdir(run_dir)}


def _write_every_record_file(run_dir: str) -> None:
    """What a rank writes there: the engine's telemetry, the recorder's record and sampled
    series, DeepSpeed's log (each by the code a run uses)."""
    from engine.telemetry import StepRecord, TelemetryLog
    from integrations.run_output import open_log
    from report.recorder import Recorder, RecorderConfig

    TelemetryLog(run_dir, 0).append(StepRecord(iteration=1, update_s=0.1, read_wait_s=0.0, kernel_s=0.1, write_wait_s=0.0))
    rec = Recorder(RecorderConfig(run_dir=run_dir, sample_hz=100), rank=0, script="train.py --token s3cret")
    rec.start_sampler()
    time.sleep(0.05)
    rec.close()
    with open_log(run_dir) as f:
        f.write(b"[ds] a line\n")


def test_record_files_are_private_in_a_forced_run_dir_open_to_others(tmp_path, umask_022):
    """An existing non-empty 0755 run dir, taken with --force: it stays as the user made it, its
    records are 0600, and the launcher says so in one line."""
    from integrations.run_dir import claim

    run_dir = tmp_path / "run"
    run_dir.mkdir()
    os.chmod(run_dir, 0o755)
    (run_dir / "notes.txt").write_text("mine")
    (run_dir / "telemetry-rank0.jsonl").write_text("{}\n")  # an earlier run's, 0644
    claimed = claim(str(run_dir), flag="--run-dir", force=True)
    try:
        assert claimed.note == (
            f"offloadctl: --run-dir {run_dir} is open to other users (mode 0755): the run's records "
            f"there are created private (0600); chmod 700 {run_dir} to hide their names too"
        )
        _write_every_record_file(str(run_dir))
    finally:
        claimed.release()
    modes = _modes(run_dir)
    assert set(modes) == RECORD_FILES | {"notes.txt"}
    assert {n: m for n, m in modes.items() if n != "notes.txt"} == dict.fromkeys(RECORD_FILES, 0o600)
    assert modes["notes.txt"] == 0o644 and stat.S_IMODE(os.stat(run_dir).st_mode) == 0o755  # the user's, untouched


def test_a_private_run_dir_gets_no_note(tmp_path):
    from integrations.run_dir import claim

    claimed = claim(str(tmp_path / "new"), flag="--run-dir")
    claimed.release()
    assert claimed.note is None


def test_a_record_file_with_a_looser_mode_is_made_private_before_it_is_written(tmp_path, umask_022):
    """A file the engine appends to that exists already 0644 (the telemetry of a run that
    resumes into its own dir), and a link in its place, which is never followed."""
    from engine.telemetry import StepRecord, TelemetryLog

    run_dir = tmp_path / "run"
    run_dir.mkdir()
    (run_dir / "telemetry-rank0.jsonl").write_text("")
    os.chmod(run_dir / "telemetry-rank0.jsonl", 0o644)
    TelemetryLog(str(run_dir), 0).append(StepRecord(iteration=1, update_s=0.1, read_wait_s=0.0, kernel_s=0.1, write_wait_s=0.0))
    assert _modes(run_dir) == {"telemetry-rank0.jsonl": 0o600}
    elsewhere = tmp_path / "elsewhere"
    elsewhere.write_text("keep")
    os.symlink(elsewhere, run_dir / "telemetry-rank1.jsonl")
    log = TelemetryLog(str(run_dir), 1)
    log.append(StepRecord(iteration=1, update_s=0.1, read_wait_s=0.0, kernel_s=0.1, write_wait_s=0.0))
    assert elsewhere.read_text() == "keep" and log.path is None and len(log.records) == 1


@pytest.mark.root
@pytest.mark.skipif(not IS_ROOT, reason="needs root to mount a small file system")
def test_a_full_run_dir_disk_is_one_line_for_every_record_stream(caplog):
    """Telemetry, record and sampled series all stop on a full disk: one warning names the run
    dir and the cause; the records stay in memory."""
    from engine.telemetry import StepRecord, TelemetryLog
    from report.recorder import Recorder, RecorderConfig

    def step(i):
        return StepRecord(iteration=i, update_s=0.1, read_wait_s=0.0, kernel_s=0.1, write_wait_s=0.0)

    with mounted("tmpfs", "size=256k") as d:
        run_dir = os.path.join(d, "run")
        os.mkdir(run_dir, 0o700)
        telemetry = TelemetryLog(run_dir, 0)
        telemetry.append(step(1))
        rec = Recorder(RecorderConfig(run_dir=run_dir, sample_hz=200), rank=0, script="train.py")
        rec.start_sampler()
        with open(os.path.join(d, "filler"), "wb", buffering=0) as f:  # the disk fills
            try:
                while True:
                    f.write(b"\0" * 4096)
                    f.flush()
            except OSError:
                pass
        with caplog.at_level(logging.WARNING):
            for i in range(2, 200):
                telemetry.append(step(i))
                rec._write({"type": "iteration", "pad": "x" * 4000})
            time.sleep(1.5)  # the sampler flushes once a second
            rec.close()
    warned = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
    assert warned == [
        f"offloadctl: this rank's records are no longer written to {run_dir} (No space left on device): "
        f"the run goes on (telemetry kept in memory); offloadctl report shows what was written before"
    ]
    assert len(telemetry.records) == 199


@pytest.mark.slow
def test_a_forced_run_in_a_non_empty_0755_run_dir_keeps_its_records_private(tmp_path):
    """As a user runs it: `offloadctl train --force` into a 0755 dir holding other files and an
    earlier run, with umask 022."""
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    os.chmod(run_dir, 0o755)
    (run_dir / "notes.txt").write_text("mine")
    (run_dir / "record-rank0.jsonl").write_text('{"type": "header"}\n')
    nvme = tmp_path / "nvme"
    nvme.mkdir()
    cmd = [
        "sh",
        "-c",
        'umask 022 && exec "$@"',
        "sh",
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
        "--host-cache",
        "0",
        "--tuner",
        "off",
        "--run-dir",
        str(run_dir),
        "--force",
        TINY,
        "--steps",
        "3",
        "--losses-out",
        str(tmp_path / "losses.jsonl"),
    ]
    r = subprocess.run(cmd, cwd=ROOT, env=env_with_root(), capture_output=True, text=True, timeout=600)
    assert r.returncode == 0 and "Traceback" not in r.stderr, r.stderr[-3000:]
    noted = [ln for ln in r.stderr.splitlines() if "is open to other users" in ln]
    assert noted == [
        f"offloadctl: --run-dir {run_dir} is open to other users (mode 0755): the run's records there are "
        f"created private (0600); chmod 700 {run_dir} to hide their names too"
    ], r.stderr[-3000:]
    modes = _modes(run_dir)
    assert RECORD_FILES <= set(modes), modes
    assert {n: m for n, m in modes.items() if n != "notes.txt"} == dict.fromkeys(set(modes) - {"notes.txt"}, 0o600), modes


# A full run-dir disk mid-run, as a user meets it: test_reliability.test_a_full_run_dir_disk_stops_the_recording_not_the_run.
