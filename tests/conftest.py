"""Shared fixtures; the helpers the tests share are in ``helpers.py``."""
from __future__ import annotations

import pytest

# Every process the tests start, stock DeepSpeed runs included, builds and finds DeepSpeed's ops
# with the same ninja and in the same directory as the engine (see engine/storage/native_ops.py).
import engine.storage.native_ops  # noqa: F401,E402


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
