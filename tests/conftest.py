"""Shared fixtures; the helpers the tests share are in ``helpers.py``, the training runs in ``ds_runs.py``.

Tests never touch the user's state: before any test module is imported, this process (and every
process it starts) gets its own state, config and runtime directories, so no test reads or writes
the user's tuner history, profiles, daemon registry or default socket.
"""
from __future__ import annotations

import atexit
import os
import shutil
import tempfile
from pathlib import Path

import pytest

_STATE = tempfile.mkdtemp(prefix="offloadctl-tests-")
ISOLATED_ENV = {"XDG_STATE_HOME": os.path.join(_STATE, "state"), "XDG_CONFIG_HOME": os.path.join(_STATE, "config"),
                "XDG_RUNTIME_DIR": os.path.join(_STATE, "runtime"),
                "OFFLOADCTL_PROFILE_DIR": os.path.join(_STATE, "config", "offloadctl", "profiles")}
for _d in ISOLATED_ENV.values():
    os.makedirs(_d, mode=0o700, exist_ok=True)
os.environ.update(ISOLATED_ENV)
atexit.register(shutil.rmtree, _STATE, True)

# Every process the tests start, stock DeepSpeed runs included, builds and finds DeepSpeed's ops
# with the same ninja and in the same directory as the engine (see engine/storage/native_ops.py).
import engine.storage.native_ops  # noqa: F401,E402


def pytest_collection_modifyitems(config, items):
    """The slow tests first (each part in collection order): pytest-xdist hands tests out in this
    order, so a worker's last tests are short ones and no worker waits long on another's last
    training run."""
    items.sort(key=lambda item: item.get_closest_marker("slow") is None)


@pytest.fixture(scope="session")
def ds_runs(tmp_path_factory):
    """The session's training runs (ds_runs.DSRuns), shared by pytest-xdist's workers."""
    from ds_runs import DSRuns

    base = tmp_path_factory.getbasetemp()
    if os.environ.get("PYTEST_XDIST_WORKER"):  # each worker has its own basetemp under the session's
        base = base.parent
    return DSRuns(base / "ds-runs")


@pytest.fixture
def short_tmp():
    """A directory with a short path, for tests that hold printed output to 80 columns: a path is
    printed whole, and pytest's own (deeper under pytest-xdist) can fill a line by itself."""
    d = tempfile.mkdtemp(prefix="oc-")
    yield Path(d)
    shutil.rmtree(d, ignore_errors=True)


@pytest.fixture
def swap_dir(tmp_path):
    """A directory on a real disk file system (O_DIRECT works there)."""
    d = tmp_path / "nvme0"
    d.mkdir()
    return str(d)


@pytest.fixture
def swap_dirs(tmp_path):
    out = []
    for name in ("nvme0", "nvme1", "pfs"):
        (tmp_path / name).mkdir()
        out.append(str(tmp_path / name))
    return out
