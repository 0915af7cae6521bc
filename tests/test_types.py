"""The type checker holds for the library: mypy, with pyproject.toml's ``[tool.mypy]`` (the six
packages at mypy's defaults, engine/ and tuner/ strict), finds no error."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_mypy_is_clean():
    """``python -m mypy`` from the repository root (which reads the config) exits 0."""
    pytest.importorskip("mypy", reason="mypy is not installed (pip install -e '.[test]')")
    out = subprocess.run([sys.executable, "-m", "mypy"], capture_output=True, text=True, cwd=ROOT)
    errors = [line for line in out.stdout.splitlines() if ": error: " in line]
    assert out.returncode == 0, "\n".join(errors[:30] or [out.stdout, out.stderr]) + f"\n({len(errors)} errors)"
