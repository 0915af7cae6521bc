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
    out = subprocess.run([sys.executable, "-c", CHILD], capture_output=True, text=True, cwd=ROOT, timeout=60,
                         env=dict(os.environ, PYTHONPATH=ROOT))
    assert out.returncode == 0, out.stderr
    for where in (here, json.loads(out.stdout)):  # this process and a child it starts
        for what, path in where.items():
            assert _inside(path, top), (what, path)
    assert not _inside(service.default_db_path(), os.path.join(os.path.expanduser("~"), ".local"))
