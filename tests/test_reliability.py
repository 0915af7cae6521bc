"""Reliability: nothing the user, the tuner or a full disk does kills training, corrupts results
or loses records. One test (or one parametrized set) per case, on real processes, real files and
file systems, real signals.
"""

from __future__ import annotations

import glob
import json
import os
import re
import stat
import sys

import pytest
import torch
from ds_runs import LAYOUTS, SAVE, TINY, baseline, launch, ours
from helpers import ROOT, cli, free_port

# -- 1. a bit flip in a checkpoint ----------------------------------------------------------------


def _flip_exponent_bit(optim_file: str) -> None:
    """Flip the top exponent bit of ``exp_avg[0]`` of subgroup 0, found by its bytes in the file."""
    sd = torch.load(optim_file, map_location="cpu", weights_only=False)
    exp_avg = sd["optimizer_state_dict"]["optimizer_state_dict"]["state"][0]["exp_avg"]
    raw = exp_avg.numpy().tobytes()
    data = bytearray(open(optim_file, "rb").read())
    at = data.find(raw)
    assert at > 0 and data.find(raw, at + 1) < 0
    data[at + 3] ^= 0x40  # little-endian float32: byte 3 holds the sign and the top 7 exponent bits
    with open(optim_file, "wb") as f:
        f.write(data)


@pytest.mark.slow
@pytest.mark.parametrize("saver", ["ours", "stock"])
def test_a_bit_flip_in_a_checkpoint_is_one_line_and_changes_nothing(saver, ds_runs, tmp_path):
    """One exponent bit flipped in exp_avg of subgroup 0: the resume stops before loading, in one
    line naming the file and the record (offloadctl's checkpoint: the run exits 2), and a script
    that catches the failure finds every tier as it was (stock's checkpoint)."""
    saved = ds_runs.get(
        baseline(1, "fp32") if saver == "stock" else ours(1, "--dtype", "fp32", *SAVE, opts=LAYOUTS["all-nvme"])
    ).ok()
    ckpt = saved.copy_of("ckpt", tmp_path / "ckpt")
    optim = glob.glob(os.path.join(ckpt, "ckpt", "*optim_states.pt"))[0]
    _flip_exponent_bit(optim)
    record = r"record zero_pp_rank_0_mp_rank_00_optim_states/data/\d+ \(CRC-32 [0-9a-f]{8} stored, [0-9a-f]{8} read\)"
    if saver == "ours":
        p = launch(ours(1, "--resume", ckpt, opts=LAYOUTS["all-nvme"]), tmp_path / "load")
        assert p.returncode == 2 and "Traceback" not in p.stderr, p.stderr[-3000:]
        line = p.stderr.strip().splitlines()[-1]
        assert re.fullmatch(
            rf"offloadctl: checkpoint file {re.escape(optim)} is damaged: {record}; restore it from "
            r"where it was saved, or resume from another checkpoint",
            line,
        ), line
        assert not os.path.exists(tmp_path / "load" / "losses.jsonl")
    else:
        out = tmp_path / "try.json"
        launch(ours(1, "--dtype", "fp32", "--resume", ckpt, "--try-resume", str(out)), tmp_path / "goes-on").ok()
        got = json.loads(out.read_text())
        assert re.match(rf"failed: checkpoint file {re.escape(optim)} is damaged: {record}", got["outcome"]), got
        assert got["tiers_unchanged"], got


def test_the_crc_check_finds_every_damaged_record_and_passes_intact_ones(tmp_path):
    """Records checked in pieces (several per record, on threads) give zlib's CRC of the whole."""
    import zlib

    import integrations.checkpoints as checkpoints

    f = str(tmp_path / "x.pt")
    torch.save({"a": torch.randn(300_000), "b": torch.arange(10), "c": torch.empty(0)}, f)
    for threads in (1, 3):
        assert checkpoints.damaged_record(f, threads=threads) is None
    saved = checkpoints.CRC_CHUNK_BYTES
    checkpoints.CRC_CHUNK_BYTES = 4096 * 7
    try:
        assert checkpoints.damaged_record(f, threads=3) is None
        data = bytearray(open(f, "rb").read())
        data[len(data) // 2] ^= 1
        open(f, "wb").write(data)
        assert re.fullmatch(
            r"record x/data/0 \(CRC-32 [0-9a-f]{8} stored, [0-9a-f]{8} read\)", checkpoints.damaged_record(f, threads=3)
        )
    finally:
        checkpoints.CRC_CHUNK_BYTES = saved
    a, b = os.urandom(1000), os.urandom(70_000)
    assert checkpoints.crc32_combine(zlib.crc32(a), zlib.crc32(b), len(b)) == zlib.crc32(a + b)


# -- 2. a knob value the daemon accepted kills the run at its next step ------------------------------


def test_a_pin_no_rank_can_run_is_refused_by_the_daemon(tmp_path):
    """`tune --pin RUN:stripe_weights={"PATH": 0}` (every path weight 0): the daemon refuses it
    with its numbered error (BAD_VALUE), `tune` says so in one line, and nothing is pushed."""
    from helpers import wait_for

    from engine.config import Knobs
    from tuner import service
    from tuner.client import TunerClient
    from tuner.protocol import Connection, ErrorCode, ProtocolError
    from tuner.run_state import RunFacts

    nvme = str(tmp_path / "nvme")
    os.makedirs(nvme)
    run_dir = str(tmp_path / "run")
    os.makedirs(run_dir)
    sock, stop = service.ensure_daemon(str(tmp_path / "no-system.sock"), run_dir=run_dir)
    rank = TunerClient(sock, RunFacts(params=1000, paths=(nvme,), subgroup_bytes=12000), Knobs(), run_id="r1", rank=0)
    try:
        assert rank.connected.wait(20)
        wait_for(lambda: _runs(sock), 20, "the run to register")
        r = cli("tune", "--socket", sock, "--pin", f'r1:stripe_weights={{"{nvme}": 0}}', timeout=60)
        assert r.returncode == 2 and "Traceback" not in r.stderr and r.stdout == "", r.stdout + r.stderr
        assert re.fullmatch(
            r"offloadctl: --pin r1:stripe_weights=.*: cannot pin stripe_weights=.*: stripe_weights "
            r"gives every storage path weight 0, so swapped state would have nowhere to go: give at "
            r"least one path a weight > 0\n",
            r.stderr,
        ), r.stderr
        with Connection(sock) as c, pytest.raises(ProtocolError) as e:
            c.request("pin", run_id="r1", knob="stripe_weights", value={nvme: 0.0})
        assert e.value.code == ErrorCode.BAD_VALUE
        assert _runs(sock)[0]["pins"] == {} and rank.pending_changes() == []
    finally:
        rank.close()
        stop()


def _runs(sock: str) -> list[dict]:
    from tuner.protocol import Connection

    with Connection(sock) as c:
        return c.request("snapshot", history=0)["runs"]


@pytest.mark.parametrize("source", ["history", "tuner-move"])
def test_knobs_no_rank_can_run_are_never_pushed(source, tmp_path):
    """The other sources of knobs in the daemon: a history row of a run on other paths (its
    weights, cut to this run's paths, all 0), and a policy move to all-zero weights; neither
    reaches a rank."""
    from engine.config import Knobs
    from tuner.history import History
    from tuner.runs import Runs
    from tuner.server import ServerConfig

    paths = [str(tmp_path / "a"), str(tmp_path / "b")]
    zero = Knobs(stripe_weights={paths[0]: 0.0, paths[1]: 0.0})
    history = History(str(tmp_path / "tuner.db"))
    if source == "history":
        history.record_run("old", None, 1000, 1, zero, 0.1)

    class Move:  # a policy whose every decision is the same bad move
        def __init__(self, start, facts):
            self.knobs, self.pins = start, {}

        def observe(self, *a, **kw):
            return type("D", (), {"knobs": zero, "reason": "a move to zero weights"})()

        def __getattr__(self, name):
            return lambda *a, **kw: None

    runs = Runs(
        ServerConfig(socket_path=str(tmp_path / "s.sock")),
        sensors_factory=False,
        history=history,
        policy_factory=Move if source == "tuner-move" else None,
    )
    runs.register(
        object(),
        {
            "run_id": "r1",
            "rank": 0,
            "world_size": 1,
            "params": 1000,
            "paths": paths,
            "has_device": False,
            "knobs": Knobs().to_dict(),
            "subgroup_bytes": 12288,
            "profile": None,
        },
    )
    if source == "tuner-move":
        run = runs.runs["r1"]
        runs._take_decision(run, run.policy.observe())
    assert [m for _, m in runs.take_outbox() if m["type"] == "knobs"] == []
    assert runs.runs["r1"].knobs == Knobs()


def test_a_pushed_knob_that_fails_in_the_step_is_refused_there(swap_dir, caplog):
    """Knobs that reach the engine and cannot run (an older daemon pushed them without the
    check): the step keeps the old knobs, says one line, and the update is the reference's."""
    import logging

    from helpers import assert_params_close, feed_same_grads, make_model

    from engine import OffloadAdamW
    from engine.config import Knobs

    model, ref = make_model(), make_model()
    opt = OffloadAdamW(
        model.parameters(), lr=1e-2, subgroup_numel=700, nvme_paths=[swap_dir], host_cache_bytes=0, host_adam="torch"
    )
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2, weight_decay=0.01)
    feed_same_grads([(model, opt), (ref, ref_opt)], 2)
    before = opt.engine.knobs
    opt.engine._pending_knobs = Knobs(stripe_weights={swap_dir: 0.0})  # past set_knobs' check, as an old daemon's push
    with caplog.at_level(logging.WARNING):
        feed_same_grads([(model, opt), (ref, ref_opt)], 2, seed=2)
    lines = [r.getMessage() for r in caplog.records if "refused" in r.getMessage()]
    assert len(lines) == 1 and re.fullmatch(
        r"offloadctl: knobs \{'stripe_weights': .*\} refused at iteration 2, the "
        r"old ones kept: .*weight 0.*",
        lines[0],
    ), lines
    assert opt.engine.knobs == before
    assert_params_close(model, ref)
    opt.close()


# -- 4 and 5. a run dir is one run's, and private ----------------------------------------------------


def _train_cmd(run_dir: str | None, nvme: str, *script_args: str, opts=()) -> list[str]:
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
        nvme,
        "--host-cache",
        "0",
        "--tuner",
        "off",
        *(["--run-dir", run_dir] if run_dir else []),
        *opts,
        TINY,
        *script_args,
    ]


def test_a_run_dir_holding_a_run_is_refused_and_force_replaces_its_records(tmp_path):
    """A run dir with an earlier run's records: refused in one line naming --force and another
    dir, before anything starts, the records untouched; --force removes them (and only them)."""
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    (run_dir / "record-rank0.jsonl").write_text('{"type": "header"}\n')
    (run_dir / "telemetry-rank0.jsonl").write_text("{}\n")
    (run_dir / "notes.txt").write_text("mine")
    (tmp_path / "nvme").mkdir()
    r = cli(*_train_cmd(str(run_dir), str(tmp_path / "nvme"), "--losses-out", str(tmp_path / "l"))[3:], timeout=120)
    assert r.returncode == 2 and r.stdout == "", r.stdout + r.stderr
    assert r.stderr == (
        f"offloadctl: --run-dir {run_dir} holds an earlier run (record-rank0.jsonl, "
        f"telemetry-rank0.jsonl): give another --run-dir, or add --force to replace its records\n"
    )
    assert sorted(os.listdir(run_dir)) == ["notes.txt", "record-rank0.jsonl", "telemetry-rank0.jsonl"]

    from integrations.run_dir import claim

    claimed = claim(str(run_dir), flag="--run-dir", force=True)
    claimed.release()
    assert os.listdir(run_dir) == ["notes.txt"]


def test_a_new_or_empty_run_dir_is_private_and_the_default_never_collides(tmp_path):
    from integrations.run_dir import DefaultTaken, claim, default_run_dir

    given = tmp_path / "empty"
    given.mkdir(mode=0o755)
    os.chmod(given, 0o755)
    for d in (str(tmp_path / "new" / "run"), str(given)):
        claim(d, flag="--run-dir").release()
        assert stat.S_IMODE(os.stat(d).st_mode) == 0o700, d
    first = default_run_dir(str(tmp_path / "runs"))
    claim(first, flag="--run-dir", default=True).release()
    with pytest.raises(DefaultTaken):  # another launch took the same name between choosing and taking it
        claim(first, flag="--run-dir", default=True)
    second = default_run_dir(str(tmp_path / "runs"))
    assert second != first and second.startswith(first)


@pytest.mark.slow
def test_a_run_dir_in_use_is_refused_and_the_running_run_goes_on(tmp_path):
    """A second `offloadctl train` into the run dir of a running one: refused in one line (a lock
    on the directory); the first run trains on, its records whole; the run dir (made by
    offloadctl) and its log are private (0700, 0600). After the first ends, its dir is refused
    as holding a run."""
    import signal
    import subprocess

    from helpers import env_with_root, wait_for

    nvme = tmp_path / "nvme"
    nvme.mkdir()
    run_dir = tmp_path / "run"
    first = subprocess.Popen(
        _train_cmd(str(run_dir), str(nvme), "--steps", "100000", "--losses-out", str(tmp_path / "losses.jsonl")),
        cwd=ROOT,
        env=env_with_root(),
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        wait_for(lambda: os.path.exists(tmp_path / "losses.jsonl") or first.poll() is not None, 300, "training to start")
        assert first.poll() is None
        second = cli(*_train_cmd(str(run_dir), str(nvme), "--losses-out", str(tmp_path / "l2"))[3:], timeout=120)
        assert second.returncode == 2 and second.stderr == (
            f"offloadctl: --run-dir {run_dir} is in use by a running `offloadctl train`: give another --run-dir, or "
            f"wait for that run to end\n"
        ), second.stderr
        steps = sum(1 for _ in open(tmp_path / "losses.jsonl"))
        wait_for(lambda: sum(1 for _ in open(tmp_path / "losses.jsonl")) > steps + 2, 120, "the first run to go on")
        assert stat.S_IMODE(os.stat(run_dir).st_mode) == 0o700
        assert stat.S_IMODE(os.stat(run_dir / "deepspeed.log").st_mode) == 0o600
    finally:
        first.send_signal(signal.SIGINT)
        _, err = first.communicate(timeout=180)
    assert first.returncode == 128 + signal.SIGINT, err[-3000:]
    records = [json.loads(line) for line in open(run_dir / "record-rank0.jsonl")]
    assert records[0]["type"] == "header" and records[-1]["type"] == "end", records[-1]
    telemetry = [json.loads(line)["iteration"] for line in open(run_dir / "telemetry-rank0.jsonl")]
    assert telemetry == list(range(len(telemetry))) and len(telemetry) > steps
    again = cli(*_train_cmd(str(run_dir), str(nvme), "--losses-out", str(tmp_path / "l3"))[3:], timeout=120)
    assert again.returncode == 2 and "holds an earlier run" in again.stderr and "--force" in again.stderr


@pytest.mark.slow
def test_two_launches_at_once_without_a_run_dir_get_a_dir_each(tmp_path):
    """The default run dir (./runs/<timestamp>): two launches started together, each its own."""
    import subprocess

    from helpers import env_with_root

    (tmp_path / "nvme").mkdir()
    cmds = [_train_cmd(None, str(tmp_path / "nvme"), "--no-init", "--losses-out", "x") for _ in range(2)]
    procs = [
        subprocess.Popen(c, cwd=tmp_path, env=env_with_root(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        for c in cmds
    ]
    outs = [p.communicate(timeout=300) for p in procs]
    dirs = sorted(os.listdir(tmp_path / "runs"))
    assert len(dirs) == 2, (dirs, outs)
    for d in dirs:
        assert os.path.exists(tmp_path / "runs" / d / "deepspeed.log")
        assert stat.S_IMODE(os.stat(tmp_path / "runs" / d).st_mode) == 0o700


# -- 6. a failed rank of several: one line -----------------------------------------------------------


@pytest.mark.slow
@pytest.mark.parametrize("how", ["sigkill", "raise"])
def test_a_failed_rank_of_several_is_one_line(how, tmp_path):
    """Rank 1 of 2 is SIGKILLed (or raises) mid-run, rank 0 meets its loss in a collective: the
    terminal shows which rank failed first, how, its one line and where the full log is; no
    traceback, no launcher line, no rank's SIGTERM; rank 0's end (a traceback, or its stop) is in the log."""
    import signal
    import subprocess

    from helpers import env_with_root, wait_for

    (tmp_path / "nvme").mkdir()
    run_dir = tmp_path / "run"
    cmd = [
        sys.executable,
        "-m",
        "offloadctl.cli",
        "train",
        "--num_gpus",
        "2",
        "--master_port",
        free_port(),
        "--nvme",
        str(tmp_path / "nvme"),
        "--host-cache",
        "0",
        "--tuner",
        "off",
        "--run-dir",
        str(run_dir),
        os.path.join(ROOT, "tests", "ds_scripts", "fail_rank.py"),
        "--rank",
        "1",
        "--at",
        "2",
        "--how",
        "hang" if how == "sigkill" else "raise",
    ]
    p = subprocess.Popen(
        cmd, cwd=ROOT, env=env_with_root(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True
    )
    if how == "sigkill":

        def rank1() -> int | None:
            for pid in os.listdir("/proc"):
                try:
                    argv = open(f"/proc/{pid}/cmdline", "rb").read().split(b"\0")
                except (OSError, ValueError):
                    continue
                if b"--local_rank=1" in argv and str(run_dir).encode() in b" ".join(argv):
                    return int(pid)
            return None

        pid = wait_for(rank1, 120, "rank 1 to start")
        wait_for(lambda: glob.glob(str(tmp_path / "nvme" / "offloadctl-swap-*" / "*" / "*.swp")), 120, "training")
        os.kill(pid, signal.SIGKILL)
    out, err = p.communicate(timeout=300)
    log = str(run_dir / "deepspeed.log")
    want = (
        "offloadctl: rank 1 failed first, killed by SIGKILL"
        if how == "sigkill"
        else "offloadctl: rank 1 failed first, exit status 1: ValueError: bad batch at step 2 on rank 1"
    )
    assert p.returncode != 0 and err.strip().splitlines()[-1] == f"{want}; the full log is in {log}", err[-5000:]
    both = out + err
    for noise in ("Traceback", "Stopped", "sigkill_handler", "terminate called", "exit status 247", "rank 0 failed"):
        assert noise not in both, (noise, both[-5000:])
    assert err.count("offloadctl: rank") == 1, err
    text = open(log).read()
    # Rank 0's end is in the log: its error from the collective whose peer died, or, when DeepSpeed's
    # launcher (which polls every second) stopped it first, its line of that.
    assert any(s in text for s in ("[rank0]: Traceback", "rank 0 failed", "offloadctl: rank 0 stopped by SIGTERM")), text[-3000:]
    if how == "raise":
        assert "[rank1]: Traceback" in text and "ValueError: bad batch" in text


# -- 7. tracebacks where one line belongs --------------------------------------------------------------


def _mini_run(d) -> str:
    """A run dir with a small, well-formed record (what --engine stock leaves, no samples)."""
    os.makedirs(d, exist_ok=True)
    t = 100.0
    rows = [
        {
            "type": "header",
            "format": "offloadctl-record",
            "version": 2,
            "rank": 0,
            "world_size": 1,
            "engine": "stock",
            "script": "t.py",
            "host": "h",
            "pid": 1,
            "unix_time": 1.0,
            "clock": "perf_counter",
            "t0": t,
            "sample_hz": 0.0,
        },
        {
            "type": "init",
            "t": t + 1,
            "argv": [],
            "params_total": 1000,
            "params_rank": 1000,
            "local_world_size": 1,
            "zero_stage": 3,
            "optimizer": "X",
            "offload_optimizer": None,
            "offload_param": None,
            "device": "cpu",
            "tiers": [],
            "gradient_accumulation_steps": 1,
        },
    ]
    for i in range(3):
        s = t + 2 + i
        rows.append(
            {
                "type": "iteration",
                "iteration": i,
                "t_end": s + 0.9,
                "spans": [["forward", s, s + 0.3], ["backward", s + 0.3, s + 0.7], ["update", s + 0.7, s + 0.9]],
                "spans_dropped": 0,
                "sums": {"forward": 0.3, "backward": 0.4, "update": 0.2},
                "counts": {"forward": 1, "backward": 1, "update": 1},
            }
        )
    rows.append(
        {
            "type": "end",
            "t": t + 6,
            "status": "finished",
            "signal": None,
            "error": None,
            "iterations": 3,
            "open_spans": 0,
            "sampler_rows": 0,
            "sampler_busy_s": 0.0,
            "sampler_interval_s": 0.0,
        }
    )
    with open(os.path.join(d, "record-rank0.jsonl"), "w") as f:
        f.write("".join(json.dumps(r) + "\n" for r in rows))
    return str(d)


def _zero_rate_profile(tmp_path) -> str:
    text = open(os.path.join(ROOT, "profiles", "example-cpu-vm.toml")).read()
    assert "read_bytes_per_s = { value = 0.85e9" in text
    f = tmp_path / "zero.toml"
    f.write_text(text.replace("read_bytes_per_s = { value = 0.85e9", "read_bytes_per_s = { value = 0"))
    return str(f)


def _case_7(case: str, tmp_path, stack) -> tuple[list[str], str]:
    """(offloadctl arguments, what the one line says) for each case of item 7."""
    from helpers import mounted

    nvme = tmp_path / "nvme"
    nvme.mkdir()
    train = ["train", "--tuner", "off", "--num_gpus", "1", "--nvme", str(nvme)]
    script = [TINY, "--losses-out", str(tmp_path / "l")]
    if case.startswith("zero-rate"):
        profile = _zero_rate_profile(tmp_path)
        want = "key paths[0].read_bytes_per_s.value is a rate and must be above 0, got 0.0"
        return {
            "zero-rate-show": ["profile", "show", profile],
            "zero-rate-plan": ["plan", "--profile", profile, "--params", "1e9"],
            "zero-rate-train-dry-run": [*train, "--profile", profile, "--dry-run", *script],
        }[case], want
    if case == "run-dir-read-only":
        ro = stack.enter_context(mounted("tmpfs", "ro,size=64k"))
        return [*train, "--run-dir", os.path.join(ro, "run"), *script], "the file system is read-only"
    if case == "run-dir-symlink-loop":
        os.symlink("loop", tmp_path / "loop")
        return [*train, "--run-dir", str(tmp_path / "loop"), *script], "a symbolic link loop"
    run = _mini_run(tmp_path / "run")
    if case == "report-output-dir":
        return ["report", run, "--output", str(tmp_path)], "is a directory: give a file name"
    if case == "report-output-read-only":
        ro = stack.enter_context(mounted("tmpfs", "ro,size=64k"))
        return ["report", run, "--output", os.path.join(ro, "r.html")], "Read-only file system"
    if case == "report-png-file":
        (tmp_path / "f").write_text("")
        return ["report", run, "--png", str(tmp_path / "f")], "is a file: give a directory"
    if case in ("report-nan", "report-inf"):
        rec = tmp_path / "run" / "record-rank0.jsonl"
        bad = "NaN" if case == "report-nan" else "Infinity"
        rec.write_text(rec.read_text().replace('"t_end": 102.9', f'"t_end": {bad}'))
        return ["report", run], f"record-rank0.jsonl:3: holds {bad}, not a number"
    if case == "tuner-socket-under-a-file":
        (tmp_path / "f").write_text("")
        return ["tuner", "start", "--socket", str(tmp_path / "f" / "t.sock")], "a part of the path is a file"
    if case == "tuner-socket-read-only":
        ro = stack.enter_context(mounted("tmpfs", "ro,size=64k"))
        return ["tuner", "start", "--socket", os.path.join(ro, "d", "t.sock")], "the file system is read-only"
    if case == "master-port-70000":
        return [*train, "--master_port", "70000", *script], "--master_port must be a TCP port, 1..65535, got '70000'"
    raise AssertionError(case)


CASES_7 = [
    "zero-rate-show",
    "zero-rate-plan",
    "zero-rate-train-dry-run",
    "run-dir-read-only",
    "run-dir-symlink-loop",
    "report-output-dir",
    "report-output-read-only",
    "report-png-file",
    "report-nan",
    "report-inf",
    "tuner-socket-under-a-file",
    "tuner-socket-read-only",
    "master-port-70000",
]


@pytest.mark.parametrize("case", CASES_7)
def test_what_failed_with_a_traceback_is_one_line(case, tmp_path):
    import contextlib

    from helpers import IS_ROOT

    if "read-only" in case and not IS_ROOT:
        pytest.skip("needs root to mount a read-only file system")
    with contextlib.ExitStack() as stack:
        args, want = _case_7(case, tmp_path, stack)
        r = cli(*args, timeout=120)
    assert r.returncode == 2 and "Traceback" not in r.stderr, r.stderr[-3000:]
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("offloadctl: ") and want in lines[0], r.stderr


@pytest.mark.slow
def test_a_checkpoint_saved_to_a_full_disk_is_one_line(tmp_path):
    """save_checkpoint onto a 64 kB file system: one line saying the disk is full (torch says
    "unexpected pos" or "iostream error"), the half-written checkpoint removed."""
    from helpers import IS_ROOT, mounted

    if not IS_ROOT:
        pytest.skip("needs root to mount a small file system")
    with mounted("tmpfs", "size=64k") as full:
        p = launch(ours(1, "--save-at", "3", "--ckpt-dir", os.path.join(full, "ck"), opts=("--tuner", "off")), tmp_path)
        left = os.listdir(os.path.join(full, "ck")) if os.path.isdir(os.path.join(full, "ck")) else []
    assert p.returncode == 2 and "Traceback" not in p.stderr, p.stderr[-3000:]
    line = p.stderr.strip().splitlines()[-1]
    assert re.fullmatch(
        rf"offloadctl: checkpoint {re.escape(full)}/ck/ckpt not saved: the disk is full \([\d,]+ bytes "
        r"free there\): free space, or save elsewhere; the run's earlier checkpoints are as they were",
        line,
    ), line
    assert left == []


# -- 8. terminal escapes --------------------------------------------------------------------------------

ESC = "\x1b]0;owned\x07\x1b[2J\x1b[31m"
"""A window title, a screen clear and red: what a hostile string would do to a terminal."""


@pytest.mark.parametrize("where", ["profile-name", "profile-notes", "error-line"])
def test_control_characters_never_reach_the_terminal(where, tmp_path):
    text = open(os.path.join(ROOT, "profiles", "example-cpu-vm.toml")).read()
    toml_esc = ESC.encode("unicode_escape").decode().replace("\\x", "\\u00")
    if where == "profile-name":
        text = text.replace('name = "example-cpu-vm"', f'name = "evil{toml_esc}"')
    else:
        text = text.replace('notes = "Example', f'notes = "{toml_esc}Example')
    f = tmp_path / "p.toml"
    f.write_text(text)
    r = (
        cli("profile", "show", str(f))
        if where != "error-line"
        else cli("train", "--tuner", "off", str(tmp_path / f"script{ESC}.py"))
    )
    out = r.stdout + r.stderr
    assert not re.search(r"[\x00-\x08\x0b-\x1f\x7f-\x9f]", out), repr(out[-2000:])
    if where == "error-line":
        assert r.returncode == 2 and "does not exist" in r.stderr
    else:
        assert r.returncode == 0 and ("evil]0;owned" in out if where == "profile-name" else "[31mExample" in out), out


@pytest.mark.slow
def test_the_train_start_line_shows_no_control_characters(tmp_path):
    """A storage path whose name holds escape sequences: the start line (and all else the run
    prints) without them."""
    nvme = tmp_path / f"nvme{ESC}"
    nvme.mkdir()
    p = launch(ours(1, "--steps", "1", opts=("--nvme", str(nvme), "--tuner", "off")), tmp_path / "run").ok()
    out = p.stdout + p.stderr
    assert "offloadctl: engine active" in out and "[31m" in out, out[-3000:]
    assert not re.search(r"[\x00-\x08\x0b-\x1f\x7f-\x9f]", out), repr(out[-3000:])


# -- 9. the smaller ones ----------------------------------------------------------------------------------

CASES_9 = [
    "nvme-symlink-loop",
    "profile-fifo",
    "profile-directory",
    "script-fifo",
    "plan-names-host-memory",
    "subgroup-0",
    "num-gpus-0",
    "num-gpus-minus-1",
]


@pytest.mark.parametrize("case", CASES_9)
def test_the_smaller_ones_are_one_line_naming_the_fault(case, tmp_path):
    nvme = tmp_path / "nvme"
    nvme.mkdir()
    fifo = str(tmp_path / "fifo")
    os.mkfifo(fifo)
    train = ["train", "--tuner", "off", "--nvme", str(nvme)]
    script = [TINY, "--losses-out", str(tmp_path / "l")]
    example = os.path.join(ROOT, "profiles", "example-cpu-vm.toml")
    if case == "nvme-symlink-loop":
        os.symlink("loop", tmp_path / "loop")
    args, want, not_want = {
        "nvme-symlink-loop": (
            ["train", "--tuner", "off", "--nvme", str(tmp_path / "loop"), *script],
            f"storage path {tmp_path / 'loop'} is a symbolic link loop: give a real directory",
            "mkdir",
        ),
        "profile-fifo": (
            [*train, "--profile", fifo, *script],
            f"profile {fifo} is a FIFO (named pipe), not a profile file",
            "does not exist",
        ),
        "profile-directory": (
            [*train, "--profile", str(tmp_path), *script],
            f"profile {tmp_path} is a directory, not a profile file",
            "does not exist",
        ),
        "script-fifo": ([*train, fifo], f"training script {fifo} is a FIFO (named pipe): give the script file", "does not exist"),
        "plan-names-host-memory": (
            ["plan", "--profile", example, "--params", "7e9", "--host-memory", "1MB"],
            "raise --host-memory",
            "--host-gb",
        ),
        "subgroup-0": (
            ["plan", "--profile", example, "--params", "7e9", "--subgroup", "0"],
            "--subgroup must be a whole number of elements, 1 or more, got 0",
            "0.0",
        ),
        "num-gpus-0": ([*train, "--num_gpus", "0", *script], "--num_gpus must be a whole number of 1 or more", None),
        "num-gpus-minus-1": ([*train, "--num_gpus", "-1", *script], "--num_gpus must be a whole number of 1 or more", None),
    }[case]
    r = cli(*args, timeout=120)
    assert r.returncode == 2 and "Traceback" not in r.stderr, r.stderr[-3000:]
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and want in lines[0] and (not_want is None or not_want not in lines[0]), r.stderr


def test_a_tmpfs_storage_path_is_said_to_be_in_memory(tmp_path):
    from helpers import IS_ROOT, mounted

    if not IS_ROOT:
        pytest.skip("needs root to mount tmpfs")
    with mounted("tmpfs", "size=16m") as d:
        r = cli("train", "--tuner", "off", "--nvme", d, "--dry-run", TINY, "--losses-out", str(tmp_path / "l"), timeout=120)
    assert r.returncode == 0, r.stderr[-3000:]
    assert " ".join(r.stderr.split()) == (
        f"offloadctl: warning: --nvme {d} is on tmpfs: the state swapped there sits in RAM, outside --host-memory; "
        f"give a path on a disk, or keep the state in host memory on purpose with --host-cache"
    ), r.stderr
    assert all(len(line) <= 80 for line in r.stderr.splitlines()), r.stderr  # filled to the terminal (80 here)


@pytest.mark.slow
def test_a_killed_private_daemon_is_said_and_the_run_goes_on(tmp_path):
    """The run's private tuner daemon SIGKILLed mid-run: `tune --run-dir` says the run goes on
    without it (not "no live run there"), and the run's end says the daemon stopped."""
    import signal
    import subprocess

    from helpers import env_with_root, wait_for

    nvme = tmp_path / "nvme"
    nvme.mkdir()
    run_dir = tmp_path / "run"
    cmd = [
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
        "auto",
        "--run-dir",
        str(run_dir),
        TINY,
        "--steps",
        "100000",
        "--losses-out",
        str(tmp_path / "losses.jsonl"),
    ]
    p = subprocess.Popen(cmd, cwd=ROOT, env=env_with_root(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        wait_for(lambda: os.path.exists(tmp_path / "losses.jsonl") or p.poll() is not None, 300, "training to start")
        pid = int(open(glob.glob(str(run_dir / "tuner" / "*.pid"))[0]).read())
        os.kill(pid, signal.SIGKILL)
        sock = str(run_dir / "tuner" / "tuner.sock")
        r = cli("tune", "--run-dir", str(run_dir), "--once", timeout=60)
        assert r.returncode == 2 and r.stderr == (
            f"offloadctl: --run-dir {run_dir}: the run there goes on, but its tuner daemon ({sock}) does not answer: it "
            f"stopped, and the run keeps the knobs it has (the daemon's log: {sock}.log)\n"
        ), r.stderr
        steps = sum(1 for _ in open(tmp_path / "losses.jsonl"))
        wait_for(lambda: sum(1 for _ in open(tmp_path / "losses.jsonl")) > steps + 2, 120, "the run to go on")
    finally:
        p.send_signal(signal.SIGINT)
        out, err = p.communicate(timeout=180)
    assert p.returncode == 128 + signal.SIGINT, err[-3000:]
    assert f"tuner: its daemon ({sock}) stopped during the run, which went on with the knobs it had" in out, out


# -- 3. a full run-dir disk ------------------------------------------------------------------------------


@pytest.mark.slow
def test_a_full_run_dir_disk_stops_the_recording_not_the_run(tmp_path):
    """The run dir on a small file system that fills mid-run: the rank's files (the engine's
    telemetry, the record, the sampled series) stop with one warning for all of them (it was one
    each), no traceback, and training goes on to its end."""
    import signal
    import subprocess

    from helpers import IS_ROOT, env_with_root, mounted, wait_for

    if not IS_ROOT:
        pytest.skip("needs root to mount a small file system")
    nvme = tmp_path / "nvme"
    nvme.mkdir()
    with mounted("tmpfs", "size=1m") as d:
        run_dir = os.path.join(d, "run")
        cmd = [
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
            run_dir,
            TINY,
            "--steps",
            "100000",
            "--losses-out",
            str(tmp_path / "losses.jsonl"),
        ]
        p = subprocess.Popen(cmd, cwd=ROOT, env=env_with_root(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        try:
            wait_for(lambda: os.path.exists(tmp_path / "losses.jsonl") or p.poll() is not None, 300, "training to start")
            with open(os.path.join(d, "filler"), "wb") as f:  # the disk fills
                try:
                    while True:
                        f.write(b"\0" * 65536)
                        f.flush()
                except OSError:
                    pass
            steps = sum(1 for _ in open(tmp_path / "losses.jsonl"))
            wait_for(
                lambda: sum(1 for _ in open(tmp_path / "losses.jsonl")) > steps + 20 or p.poll() is not None,
                180,
                "training to go on",
            )
            assert p.poll() is None
        finally:
            p.send_signal(signal.SIGINT)
            out, err = p.communicate(timeout=180)
    assert p.returncode == 128 + signal.SIGINT and "Traceback" not in err, err[-5000:]
    warned = [line for line in err.splitlines() if "no longer written" in line]
    assert warned == [
        f"offloadctl: this rank's records are no longer written to {run_dir} (No space left on device): "
        f"the run goes on (telemetry kept in memory); offloadctl report shows what was written before"
    ], err
