"""Two runs on one machine and DeepSpeed's rendezvous port: a ``--master_port`` in use is one line
before anything starts (no run dir left, so the same command runs once the port is free), and a
run without ``--master_port`` beside one on DeepSpeed's default port (29500) takes another
and trains. The ports are held by real listening sockets."""

from __future__ import annotations

import errno
import os
import socket

import pytest
from ds_runs import TINY
from helpers import cli, free_port


def _listen(port: int) -> socket.socket | None:
    """A socket listening on ``port`` (all addresses), or None where something else already does."""
    s = socket.socket()
    try:
        s.bind(("", port))
    except OSError as e:
        s.close()
        if e.errno == errno.EADDRINUSE:
            return None
        raise
    s.listen()
    return s


def _train(tmp_path, *opts: str):
    nvme = tmp_path / "nvme"
    nvme.mkdir(exist_ok=True)
    return cli(
        "train",
        "--num_gpus",
        "1",
        *opts,
        "--tuner",
        "off",
        "--nvme",
        str(nvme),
        "--host-cache",
        "0",
        "--run-dir",
        str(tmp_path / "run"),
        TINY,
        "--steps",
        "2",
        "--losses-out",
        str(tmp_path / "losses.jsonl"),
        timeout=600,
    )


def test_a_master_port_in_use_is_one_line_and_leaves_nothing(tmp_path):
    port = int(free_port())
    holder = _listen(port)
    assert holder is not None
    with holder:
        r = _train(tmp_path, "--master_port", str(port))
    assert r.returncode == 2 and r.stdout == "" and "Traceback" not in r.stderr, r.stdout + r.stderr[-3000:]
    assert r.stderr.splitlines() == [
        f"offloadctl: --master_port {port} is in use on this machine (another run, or another program): give another "
        f"port, or leave --master_port out and offloadctl picks a free one"
    ], r.stderr[-3000:]
    assert not (tmp_path / "run").exists() and not (tmp_path / "losses.jsonl").exists()


@pytest.mark.slow
def test_a_run_without_master_port_beside_one_on_29500_takes_another(tmp_path):
    holder = _listen(29500)  # None: something on this machine holds it already, which is the case to try
    try:
        r = _train(tmp_path)
    finally:
        if holder is not None:
            holder.close()
    assert r.returncode == 0, r.stderr[-3000:]
    assert "EADDRINUSE" not in r.stdout + r.stderr
    assert len(open(tmp_path / "losses.jsonl").readlines()) == 2
    assert os.path.isdir(tmp_path / "run")
