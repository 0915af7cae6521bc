"""The test suite keeps to its own state: no test reads or writes the user's tuner history,
profiles, daemon registry or default socket (conftest.py sets the directories before any test
module is imported, and every process a test starts inherits them)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

from conftest import ISOLATED_ENV
from helpers import ROOT

from perf.profile_toml import profile_dir
from tuner import service

CHILD = """
import json, os
from perf.profile_toml import profile_dir
from tuner import service
print(json.dumps({"db": service.default_db_path(), "registry": service.registry_dir(), "profiles": profile_dir()}))
"""


def _inside(path: str, top: str) -> bool:
    return os.path.commonpath([os.path.realpath(path), os.path.realpath(top)]) == os.path.realpath(top)


def test_state_config_and_runtime_dirs_are_the_suites_own():
    top = os.path.dirname(ISOLATED_ENV["XDG_STATE_HOME"])
    for name, value in ISOLATED_ENV.items():
        assert os.environ[name] == value and _inside(value, top), name
    here = {"db": service.default_db_path(), "registry": service.registry_dir(), "profiles": profile_dir()}
    out = subprocess.run(
        [sys.executable, "-c", CHILD], capture_output=True, text=True, cwd=ROOT, timeout=60, env=dict(os.environ, PYTHONPATH=ROOT)
    )
    assert out.returncode == 0, out.stderr
    for where in (here, json.loads(out.stdout)):  # this process and a child it starts
        for what, path in where.items():
            assert _inside(path, top), (what, path)
    assert not _inside(service.default_db_path(), os.path.join(os.path.expanduser("~"), ".local"))


def test_a_golden_stock_run_stands_for_the_live_one_only_where_it_was_made_so(tmp_path, monkeypatch):
    """Every golden copy is read where it was made with what this machine has; a copy made with
    another DeepSpeed (or torch, instruction set, script) is passed over, saying why, and the
    tests then run that stock run live."""
    import ds_runs

    for spec in ds_runs.GOLDEN:
        kept, why = ds_runs.golden(spec)
        # Made on another CPU (its capability, its flags, or both differ, in either order): the
        # suite runs that stock run live here, and the rest of the test still holds.
        if kept is None and all(part.startswith(("cpu_capability ", "cpu_flags ")) for part in why.split("; ")):
            continue
        assert kept is not None and why == "", (spec.golden_name(), why)
        assert len(kept.losses) == (3 if spec.ckpt else 6) and kept.ok() is kept  # a resumed run: steps 4-6
    spec = ds_runs.GOLDEN[0]
    moved = tmp_path / spec.golden_name()
    kept = ds_runs.GOLDEN_DIR / spec.golden_name()
    moved.mkdir()
    meta = json.loads((kept / "golden.json").read_text())
    meta["made_with"]["deepspeed"] = "0.0.1"
    (moved / "golden.json").write_text(json.dumps(meta))
    monkeypatch.setattr(ds_runs, "GOLDEN_DIR", tmp_path)
    got, why = ds_runs.golden(spec)
    assert got is None and why.startswith("deepspeed 0.0.1 there, "), why
