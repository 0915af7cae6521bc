"""The layers import only downward: engine < perf < tuner < report < integrations < offloadctl.

Read from the source (every import statement, at module level or inside functions), so that a
lazy import inside a function cannot hide an upward dependency. And no module of any layer is
over :data:`MAX_LOGICAL_LINES` logical lines (:func:`logical_lines`: statements and comment lines,
which a formatter does not change): one a newcomer reads in one sitting.
"""

from __future__ import annotations

import ast
import os
import tokenize

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
LAYERS = ["engine", "perf", "tuner", "report", "integrations", "offloadctl"]
# engine/storage sits below the rest of engine: it may use only these engine modules.
STORAGE_MAY_USE = {
    "engine.errors",
    "engine.buffers",
    "engine.config",
    "engine.layout",
    "engine.storage",
    "engine.units",
}  # units: the size and rate words, a leaf over engine.errors
MAX_LOGICAL_LINES = 450


def logical_lines(path: str) -> int:
    """Statements (each logical line, however many physical lines a formatter makes of it: a
    docstring is one) plus comment lines of their own."""
    n = 0
    with open(path, "rb") as f:
        for tok in tokenize.tokenize(f.readline):
            if tok.type == tokenize.NEWLINE or (tok.type == tokenize.COMMENT and tok.line.lstrip().startswith("#")):
                n += 1
    return n


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
            if (
                rel.startswith(os.path.join("engine", "storage"))
                and top == "engine"
                and not any(mod == m or mod.startswith(m + ".") for m in STORAGE_MAY_USE)
            ):
                bad.append(f"{rel}:{line} imports {mod} (engine/storage may use only {sorted(STORAGE_MAY_USE)})")
    assert not bad, "\n".join(bad)


@pytest.mark.parametrize("package", LAYERS)
def test_no_module_is_over_450_logical_lines(package):
    long = [f"{rel}: {n} logical lines" for rel, path in _modules(package) if (n := logical_lines(path)) > MAX_LOGICAL_LINES]
    assert not long, f"over {MAX_LOGICAL_LINES} logical lines: " + ", ".join(long)


def test_logical_lines_count_statements_and_comment_lines(tmp_path):
    f = tmp_path / "m.py"
    f.write_text(
        '"""A docstring\nof three\nlines."""\n# a comment line\nx = f(1,\n      2)  # trailing\n\n'
        "def g():\n    return [\n        1,\n    ]\n"
    )
    assert logical_lines(str(f)) == 5  # the docstring, the comment line, x = ..., def g, return


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


def test_ruff_format_is_clean():
    """The tree is as ``ruff format`` leaves it (the formatting commit is in .git-blame-ignore-revs)."""
    import shutil
    import subprocess
    import sys

    ruff = shutil.which("ruff", path=os.path.dirname(sys.executable)) or shutil.which("ruff")
    if ruff is None:
        pytest.skip("ruff is not installed (pip install -e '.[test]')")
    out = subprocess.run([ruff, "format", "--check", ROOT], capture_output=True, text=True, cwd=ROOT)
    assert out.returncode == 0, out.stdout + out.stderr
