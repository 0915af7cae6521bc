"""bench/tuner.py --pin: read as the tuner reads a pin, a bad one refused in one line, and the
check that a tuned run kept it."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys

import pytest

from engine import Knobs
from engine.errors import ConfigError

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPT = os.path.join(ROOT, "bench", "tuner.py")


@pytest.fixture(scope="module")
def bench_tuner():
    spec = importlib.util.spec_from_file_location("bench_tuner_under_test", SCRIPT)
    mod = importlib.util.module_from_spec(spec)
    saved = list(sys.path)
    try:
        spec.loader.exec_module(mod)
    finally:
        sys.path[:] = saved  # the script reorders sys.path for itself
    return mod


def test_pins_are_read_and_checked_against_the_rows(bench_tuner):
    paths = ["/a", "/b"]
    fixed, start = bench_tuner.read_pins(["prefetch_depth=2", "io_concurrency[/b]=8"], paths)
    assert fixed == {"prefetch_depth": 2, "io_concurrency[/b]": 8}
    assert start.prefetch_depth == 2 and start.concurrency_for("/b") == 8 and start.concurrency_for("/a") == 4
    kept = {"iteration": 0, "knobs": start.replace(stripe_weights={"/a": 1.0, "/b": 2.0}).to_dict()}
    moved = {"iteration": 1, "knobs": start.replace(prefetch_depth=4).to_dict()}
    assert bench_tuner.pins_broken([kept], fixed, start) == []
    assert bench_tuner.pins_broken([kept, moved], fixed, start) == [1]
    assert bench_tuner.pins_broken([moved], {}, Knobs()) == []
    for bad in ("prefetch_depth", "prefetch_depth=x", "nope=1", "io_concurrency[/c]=4", "prefetch_depth=99"):
        with pytest.raises(ConfigError, match="--pin"):
            bench_tuner.read_pins([bad], paths)


@pytest.mark.slow
def test_a_bad_pin_is_one_line_and_exit_2(tmp_path):
    nvme, pfs = tmp_path / "nvme", tmp_path / "pfs"
    nvme.mkdir()
    pfs.mkdir()
    env = dict(os.environ, PYTHONPATH=ROOT, COLUMNS="200")
    base = [sys.executable, SCRIPT, "--nvme", str(nvme), "--remote", str(pfs), "--io-backend", "posix"]
    for extra, words in (
        (["--part", "2", "--pin", "prefetch_depth=deep"], "prefetch_depth=deep"),
        (["--part", "2", "--pin", "foo=1"], "unknown knob 'foo'"),
        (["--pin", "prefetch_depth=2"], "give --part 2"),
    ):
        r = subprocess.run(base + extra, capture_output=True, text=True, env=env, timeout=120)
        assert r.returncode == 2, (extra, r.stdout, r.stderr)
        lines = [ln for ln in r.stderr.splitlines() if ln.strip() and "[WARNING]" not in ln]
        assert len(lines) == 1 and words in lines[0], (extra, r.stderr)
