"""What a run shows on the terminal: the script's output and ours; DeepSpeed's lines in the run's log.

The filter's rules are tested on byte streams cut the way a terminal delivers them; then real
`offloadctl train` runs, on a pipe and on a pseudo-terminal, show that no DeepSpeed line reaches
the user and that every one of them is in RUN_DIR/deepspeed.log.
"""

from __future__ import annotations

import importlib
import io
import os
import pty
import re
import select
import subprocess
import sys
import time
import warnings

import pytest
from ds_runs import SAVE, ours
from helpers import ROOT, env_with_root, free_port

from integrations.ds_patches import route_deepspeed_warnings
from integrations.run_output import OutputFilter, log_path

TINY = os.path.join(ROOT, "tests", "ds_scripts", "train_tiny.py")
DS_LINE = re.compile(r"^\s*\[\d{4}-\d\d-\d\d [\d:,]+\] \[(INFO|WARNING|DEBUG)\]", re.M)
LOG = b"[2026-11-24 14:08:33,943] [INFO] [launch.py:253:sigkill_handler] Killing subprocess 1\n"


def _sorted(*chunks: bytes, verbose: bool = False) -> tuple[bytes, bytes]:
    shown, log = io.BytesIO(), io.BytesIO()
    f = OutputFilter(shown, log, verbose=verbose)
    for c in chunks:
        f.feed(c)
    f.close()
    return shown.getvalue(), log.getvalue()


def test_deepspeed_lines_go_to_the_log_and_everything_else_is_shown():
    shown, log = _sorted(
        b"step 1 loss 3.2\n",
        LOG,
        b"DeepSpeed deepspeed.ops.comm.shm built successfully\n",
        b"[2026-11-24 14:08:33,943] [ERROR] [engine.py:1:f] it broke\n",
        b"[y/n] ",
        b"yes\n",
    )
    assert shown == b"step 1 loss 3.2\n[2026-11-24 14:08:33,943] [ERROR] [engine.py:1:f] it broke\n[y/n] yes\n"
    assert log == LOG + b"DeepSpeed deepspeed.ops.comm.shm built successfully\n"


def test_a_line_cut_anywhere_is_sorted_the_same():
    whole = b"hello\n" + LOG + b"bye\n"
    for cut in range(1, len(whole)):
        assert _sorted(whole[:cut], whole[cut:]) == (b"hello\nbye\n", LOG), cut


def test_a_log_line_after_invisible_bytes_on_its_line_is_sorted_the_same_cut_anywhere():
    """A progress bar stopped by Ctrl-C writes its last bytes (show the cursor: no newline) on
    the line where DeepSpeed's launcher then logs 'Killing subprocess': one read may hold both."""
    whole = b"\x1b[?25h" + LOG + b"bye\n"
    assert _sorted(whole) == (b"\x1b[?25hbye\n", LOG)
    for cut in range(1, len(whole)):
        assert _sorted(whole[:cut], whole[cut:]) == (b"\x1b[?25hbye\n", LOG), cut


def test_progress_without_newline_is_shown_at_once_and_a_log_line_after_it_is_not():
    shown, log = io.BytesIO(), io.BytesIO()
    f = OutputFilter(shown, log)
    f.feed(b"\r\x1b[2Ktraining 3/20")
    assert shown.getvalue() == b"\r\x1b[2Ktraining 3/20"  # not held back for a newline
    f.feed(LOG)
    f.feed(b"\r\x1b[2Ktraining 4/20\n")
    assert shown.getvalue() == b"\r\x1b[2Ktraining 3/20\r\x1b[2Ktraining 4/20\n"
    assert log.getvalue() == LOG


def test_verbose_shows_deepspeed_lines_and_still_logs_them():
    assert _sorted(LOG, verbose=True) == (LOG, LOG)


def test_a_ranks_stop_line_goes_to_the_log_and_names_how_it_ended_first():
    """Each rank's line as it unwinds from a signal goes to the log (they come, on their own pipe, in
    any order with the launcher's report of a failed rank); the run's own line is shown. Should a
    stopped rank be the one the launcher found ended first, the run's last line says how."""
    shown, log = io.BytesIO(), io.BytesIO()
    f = OutputFilter(shown, log)
    f.feed(b"offloadctl: rank 1 stopped by SIGTERM; removing its swap files\n")
    # A rank under python -u writes print()'s newline apart: the line is held, not passed on half.
    f.feed(b"offloadctl: rank 0 stopped by SIGHUP; removing its swap files")
    f.feed(b"\n")
    f.feed(b"offloadctl: stopped by SIGTERM")
    f.feed(b"\n")
    assert shown.getvalue() == b"offloadctl: stopped by SIGTERM\n" and log.getvalue().count(b"stopped by") == 2
    f.feed(
        b"[2026-11-26 16:00:00,000] [ERROR] [launch.py:259:sigkill_handler] ['python', '-u', 'train.py', "
        b"'--local_rank=0'] exits with return code = 129\n"
    )
    assert (
        f.failures.summary("LOG") == "offloadctl: rank 0 failed first, exit status 129: stopped by SIGHUP; the full log is in LOG"
    )


def test_warnings_raised_inside_deepspeed_go_to_the_log_the_users_are_shown(monkeypatch):
    import typing_extensions

    shown = []
    monkeypatch.setattr(warnings, "showwarning", lambda message, *a, **k: shown.append(str(message)))
    log = io.BytesIO()
    route_deepspeed_warnings(log)

    @typing_extensions.deprecated("all_gather_into_tensor is deprecated", category=FutureWarning)
    def deprecated_call():
        pass

    # A caller compiled with the file name of a DeepSpeed module: the frame a real DeepSpeed call has.
    ds_file = importlib.import_module("deepspeed.comm.torch").__file__
    ns: dict = {}
    exec(compile("def from_deepspeed(f):\n    f()\n", ds_file, "exec"), ns)
    with warnings.catch_warnings():
        warnings.simplefilter("always")
        ns["from_deepspeed"](deprecated_call)
        deprecated_call()  # the user's own call
    assert shown == ["all_gather_into_tensor is deprecated"]
    assert b"all_gather_into_tensor is deprecated" in log.getvalue() and "deepspeed" in log.getvalue().decode()
    assert log.getvalue().count(b"deprecated") == 1


# -- real runs ------------------------------------------------------------------------------------


def _cmd(tmp_path, *extra) -> list[str]:
    (tmp_path / "nvme").mkdir(exist_ok=True)
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
        str(tmp_path / "nvme"),
        "--run-dir",
        str(tmp_path / "run"),
        "--tuner",
        "off",
        *extra,
        TINY,
        "--steps",
        "3",
        "--losses-out",
        str(tmp_path / "losses.jsonl"),
    ]


@pytest.mark.slow
def test_a_run_on_a_pipe_shows_no_deepspeed_line(ds_runs):
    """Any run captured through pipes (the session's 1-rank reference run of offloadctl): only
    the script's output and offloadctl's lines; DeepSpeed's go to the run's log."""
    out = ds_runs.get(ours(1, "--dtype", "fp32", *SAVE)).ok()
    both = out.stdout + out.stderr
    assert not DS_LINE.search(both), both
    assert "FutureWarning" not in both and "built successfully" not in both
    assert "offloadctl: engine active" in out.stderr
    log = open(log_path(str(out.run_dir))).read()
    assert "spawned with command" in log and "Setting accelerator to CPU" in log
    lines = out.stderr.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith("offloadctl: engine active"))
    banner = [lines[start]] + [line for line in lines[start + 1 : start + 8] if line.startswith("  ")]
    assert len(banner) >= 3 and all(len(line) <= 80 for line in banner), banner


@pytest.mark.slow
def test_a_run_on_a_terminal_shows_no_deepspeed_line_and_the_script_sees_a_terminal(tmp_path):
    """On a pseudo-terminal, as in a shell: the script's progress bar and our lines, nothing of
    DeepSpeed's; --verbose shows DeepSpeed's lines too."""
    for verbose in (False, True):
        run_dir = tmp_path / ("verbose" if verbose else "quiet")
        cmd = _cmd(tmp_path, *(["--verbose"] if verbose else []))
        cmd[cmd.index("--run-dir") + 1] = str(run_dir)
        ours, theirs = pty.openpty()
        proc = subprocess.Popen(
            cmd + ["--show-tty"],
            cwd=ROOT,
            stdin=subprocess.DEVNULL,
            stdout=theirs,
            stderr=theirs,
            env=env_with_root(COLUMNS="80", TERM="xterm"),
        )
        os.close(theirs)
        seen, deadline = b"", time.monotonic() + 300
        while time.monotonic() < deadline:
            if select.select([ours], [], [], 1)[0]:
                try:
                    data = os.read(ours, 65536)
                except OSError:
                    break
                if not data:
                    break
                seen += data
            elif proc.poll() is not None:
                break
        os.close(ours)
        assert proc.wait(60) == 0, seen.decode(errors="replace")[-3000:]
        text = seen.decode(errors="replace")
        assert "offloadctl: engine active" in text
        assert "tty True" in text  # the script's stdout is a terminal, as without offloadctl
        if verbose:
            assert "spawned with command" in text
        else:
            assert not DS_LINE.search(text), text
            assert "FutureWarning" not in text
        assert "spawned with command" in open(log_path(str(run_dir))).read()


EXIT_NOISE = (
    b"Exception ignored in: <module 'threading' from '/usr/lib/python3.11/threading.py'>\n"
    b"Traceback (most recent call last):\n"
    b'  File "/usr/lib/python3.11/threading.py", line 1541, in _shutdown\n'
    b"    def _shutdown():\n"
    b"    \n"
    b'  File "/v/lib/python3.11/site-packages/deepspeed/launcher/launch.py", line 266, in sigkill_handler\n'
    b"    sys.exit(1)\n"
    b"SystemExit: 1\n"
)


def test_the_launchers_second_stop_at_exit_goes_to_the_log_cut_anywhere():
    """Ctrl-C reaches DeepSpeed's per-node launcher from the terminal, and offloadctl's SIGTERM
    follows: arriving while the launcher exits, it runs the launcher's handler again inside the
    interpreter's shutdown, and Python prints its sys.exit as an ignored exception (a full
    run's Ctrl-C showed it once in several). It is the launcher's, and goes to the log."""
    end = b"offloadctl: stopped by SIGINT: ranks stopped, their swap files removed\n"
    whole = b"step 3\n" + EXIT_NOISE + end
    assert _sorted(whole) == (b"step 3\n" + end, EXIT_NOISE)
    for cut in range(1, len(whole)):
        assert _sorted(whole[:cut], whole[cut:]) == (b"step 3\n" + end, EXIT_NOISE), cut
    assert _sorted(whole, verbose=True) == (whole, EXIT_NOISE)


def test_an_ignored_exception_of_anything_else_is_shown_whole_in_order():
    """The same block from the user's own code (another frame, another exception), or cut short
    by the end of the stream, is shown as it came; the line after it is sorted as usual."""
    users = EXIT_NOISE.replace(b"/v/lib/python3.11/site-packages/deepspeed/launcher/launch.py", b"/home/me/train.py")
    assert _sorted(users + LOG + b"bye\n") == (users + b"bye\n", LOG)
    other = EXIT_NOISE.replace(b"SystemExit: 1", b"KeyboardInterrupt")
    assert _sorted(other + b"bye\n") == (other + b"bye\n", b"")
    cut_short = EXIT_NOISE[: EXIT_NOISE.index(b"SystemExit")]
    assert _sorted(cut_short) == (cut_short, b"")


def test_a_peers_loss_is_told_from_a_ranks_own_error():
    """A rank that loses its peer in a collective waits before it ends (integrations.bootstrap
    PEER_LOST_GRACE_S), so that the launcher finds the peer ended first and the run ends with the
    peer's line (a refusal: status 2), not with this rank's connection error (seen in a 2-rank
    checkpoint refusal under load: 'rank 1 failed first, exit status 1: ... Connection closed by peer')."""
    from integrations.bootstrap import peer_lost

    gloo = RuntimeError(
        "[/__w/pytorch/pytorch/third_party/gloo/gloo/transport/tcp/pair.cc:553] Connection closed by peer "
        "[127.0.0.1]:58278. This is typically caused by a remote worker crashing."
    )
    assert peer_lost(gloo) and peer_lost(RuntimeError("NCCL error: remote process exited or there was a network error"))
    assert not peer_lost(RuntimeError("CUDA out of memory")) and not peer_lost(ValueError("bad batch"))
