"""The layers import only downward: engine < perf < tuner < report < integrations < offloadctl.

Read from the source (every import statement, at module level or inside functions), so that a
lazy import inside a function cannot hide an upward dependency. And no module of any layer is
over :data:`MAX_LINES` lines: one a newcomer reads in one sitting.
"""
from __future__ import annotations

import ast
import os

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
LAYERS = ["engine", "perf", "tuner", "report", "integrations", "offloadctl"]
# engine/storage sits below the rest of engine: it may use only these engine modules.
STORAGE_MAY_USE = {"engine.errors", "engine.buffers", "engine.config", "engine.layout", "engine.storage",
                   "engine.units"}  # units: the size and rate words, a leaf over engine.errors
MAX_LINES = 600


def _modules(package: str):
    for dirpath, _, files in os.walk(os.path.join(ROOT, package)):
        for f in files:
            if f.endswith(".py"):
                path = os.path.join(dirpath, f)
                yield os.path.relpath(path, ROOT), path


def _imports(path: str):
    tree = ast.parse(open(path).read(), path)
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for a in node.names:
                yield node.lineno, a.name
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            yield node.lineno, node.module


@pytest.mark.parametrize("package", LAYERS)
def test_no_module_imports_a_layer_above_it(package):
    rank = LAYERS.index(package)
    bad = []
    for rel, path in _modules(package):
        for line, mod in _imports(path):
            top = mod.split(".")[0]
            if top in LAYERS and LAYERS.index(top) > rank:
                bad.append(f"{rel}:{line} imports {mod}")
            if rel.startswith(os.path.join("engine", "storage")) and top == "engine" and not any(
                    mod == m or mod.startswith(m + ".") for m in STORAGE_MAY_USE):
                bad.append(f"{rel}:{line} imports {mod} (engine/storage may use only {sorted(STORAGE_MAY_USE)})")
    assert not bad, "\n".join(bad)


@pytest.mark.parametrize("package", LAYERS)
def test_no_module_is_over_600_lines(package):
    long = []
    for rel, path in _modules(package):
        with open(path) as f:
            lines = sum(1 for _ in f)
        if lines > MAX_LINES:
            long.append(f"{rel}: {lines} lines")
    assert not long, f"over {MAX_LINES} lines: " + ", ".join(long)


def test_ruff_is_clean():
    """The lint configuration in pyproject.toml holds for the whole tree."""
    import shutil
    import subprocess
    import sys

    ruff = shutil.which("ruff", path=os.path.dirname(sys.executable)) or shutil.which("ruff")
    if ruff is None:
        pytest.skip("ruff is not installed (pip install -e '.[test]')")
    out = subprocess.run([ruff, "check", "--output-format", "concise", ROOT], capture_output=True, text=True, cwd=ROOT)
    assert out.returncode == 0, out.stdout + out.stderr
