"""Unicode's bidirectional controls never reach the terminal: U+202E (RIGHT-TO-LEFT OVERRIDE) in
a file name shows ``evil\u202etxt.py`` as ``evilyp.txt``, and its kin reorder or hide the text
after them. Wherever user text is shown (a profile's name, an error line naming a path, the tuner
view of a run's id and paths, a run's start line), they are left out, as control characters are."""

from __future__ import annotations

import os
import re

import pytest
from ds_runs import launch, ours
from helpers import ROOT, cli, wait_for

BIDI = "\u202a\u202b\u202c\u202d\u202e\u2066\u2067\u2068\u2069\u200e\u200f\u061c"
"""Every bidirectional control: the embeddings and overrides, the isolates, the marks."""
SHOWN_NEVER = re.compile(r"[\x00-\x08\x0b-\x1f\x7f-\x9f\u061c\u200e\u200f\u202a-\u202e\u2066-\u2069]")


def test_a_profile_name_shows_no_bidirectional_control(tmp_path):
    text = open(os.path.join(ROOT, "profiles", "example-cpu-vm.toml")).read()
    escaped = "".join(f"\\u{ord(c):04x}" for c in BIDI)
    f = tmp_path / "p.toml"
    f.write_text(text.replace('name = "example-cpu-vm"', f'name = "evil{escaped}gpj.exe"'))
    r = cli("profile", "show", str(f))
    assert r.returncode == 0 and "evilgpj.exe" in r.stdout, r.stdout + r.stderr
    assert not SHOWN_NEVER.search(r.stdout + r.stderr), ascii(r.stdout + r.stderr)


def test_an_error_line_naming_a_path_shows_no_bidirectional_control(tmp_path):
    r = cli("train", "--tuner", "off", str(tmp_path / f"script{BIDI}yp.txt"))
    assert r.returncode == 2 and "does not exist" in r.stderr and "scriptyp.txt" in r.stderr, r.stderr
    assert not SHOWN_NEVER.search(r.stdout + r.stderr), ascii(r.stderr)


def test_the_tuner_view_shows_no_bidirectional_control(tmp_path):
    """A run whose id and storage path hold them (and an escape sequence, in the path: a path may
    hold any character but NUL): ``tune --once`` and a pin's answer show neither."""
    from engine.config import Knobs
    from tuner import service
    from tuner.client import TunerClient
    from tuner.protocol import Connection
    from tuner.run_state import RunFacts

    nvme = str(tmp_path / f"nvme{BIDI}\x1b[31m")
    os.makedirs(nvme)
    run_dir = str(tmp_path / "run")
    os.makedirs(run_dir)
    run_id = f"run{BIDI}1"
    sock, stop = service.ensure_daemon(str(tmp_path / "no-system.sock"), run_dir=run_dir)
    rank = TunerClient(sock, RunFacts(params=1000, paths=(nvme,), subgroup_bytes=12000), Knobs(), run_id=run_id, rank=0)
    try:
        assert rank.connected.wait(20)

        def registered():
            with Connection(sock) as c:
                return c.request("snapshot", history=0)["runs"]

        wait_for(registered, 20, "the run to register")
        shown = cli("tune", "--socket", sock, "--once", timeout=60)
        pinned = cli("tune", "--socket", sock, "--pin", f"{run_id}:prefetch_depth=2", timeout=60)  # says the paths too
    finally:
        rank.close()
        stop()
    for r in (shown, pinned):
        assert r.returncode == 0, r.stdout + r.stderr
        assert not SHOWN_NEVER.search(r.stdout + r.stderr), ascii(r.stdout + r.stderr)
    assert "run1" in shown.stdout and "run1: pinned prefetch_depth" in pinned.stdout, shown.stdout + pinned.stdout


@pytest.mark.slow
def test_the_train_start_line_shows_no_bidirectional_control(tmp_path):
    nvme = tmp_path / f"nvme{BIDI}"
    nvme.mkdir()
    p = launch(ours(1, "--steps", "1", opts=("--nvme", str(nvme), "--tuner", "off")), tmp_path / "run").ok()
    out = p.stdout + p.stderr
    assert "offloadctl: engine active" in out, out[-3000:]
    assert not SHOWN_NEVER.search(out), ascii(out[-3000:])
