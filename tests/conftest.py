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
ISOLATED_ENV = {
    "XDG_STATE_HOME": os.path.join(_STATE, "state"),
    "XDG_CONFIG_HOME": os.path.join(_STATE, "config"),
    "XDG_RUNTIME_DIR": os.path.join(_STATE, "runtime"),
    "OFFLOADCTL_PROFILE_DIR": os.path.join(_STATE, "config", "offloadctl", "profiles"),
}
for _d in ISOLATED_ENV.values():
    os.makedirs(_d, mode=0o700, exist_ok=True)
os.environ.update(ISOLATED_ENV)
atexit.register(shutil.rmtree, _STATE, True)

# Every process the tests start, stock DeepSpeed runs included, builds and finds DeepSpeed's ops
# with the same ninja and in the same directory as the engine (see engine/storage/native_ops.py).
import engine.storage.native_ops  # noqa: F401,E402


def _session_base(tmp_path_factory) -> Path:
    base = tmp_path_factory.getbasetemp()
    if os.environ.get("PYTEST_XDIST_WORKER"):  # each worker has its own basetemp under the session's
        base = base.parent
    return base


@pytest.fixture(scope="session")
def ds_runs(tmp_path_factory):
    """The session's training runs (ds_runs.DSRuns), shared by pytest-xdist's workers."""
    from ds_runs import DSRuns

    return DSRuns(_session_base(tmp_path_factory) / "ds-runs")


@pytest.fixture(scope="session")
def once(tmp_path_factory):
    """``once(name, make)``: what ``make()`` returns, made by one pytest-xdist worker in the whole
    session and read by the others (pickled under the session's base, a lock per name). For a
    module fixture that plays a scenario: pytest-xdist spreads a module's tests over its workers,
    each of which would otherwise play it again. (Its ``--dist loadgroup`` cannot keep them on one:
    it renames tests, which pytest 9.2's node ids no longer take.) A ``make`` that raises leaves
    nothing: the next asker plays it again."""
    import pickle

    from filelock import FileLock

    base = _session_base(tmp_path_factory) / "once"
    base.mkdir(exist_ok=True)

    def get(name: str, make):
        kept = base / f"{name}.pickle"
        with FileLock(str(kept) + ".lock"):
            if kept.exists():
                return pickle.loads(kept.read_bytes())
            value = make()
            kept.write_bytes(pickle.dumps(value))
            return value

    return get


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


@pytest.fixture
def private_env(short_tmp, monkeypatch):
    """A test's own tuner registry and history (children inherit them), with no system daemon in
    the way; a short path (paths are printed whole, and tests hold lines to 80 columns)."""
    from tuner import service

    monkeypatch.setenv("XDG_RUNTIME_DIR", str(short_tmp / "xdg"))
    monkeypatch.setenv("XDG_STATE_HOME", str(short_tmp / "state"))
    os.makedirs(short_tmp / "xdg")
    if service.probe(service.default_socket_path()) is not None:
        pytest.skip(f"a tuner daemon answers at {service.default_socket_path()}: discovery would pick it")
    return short_tmp
