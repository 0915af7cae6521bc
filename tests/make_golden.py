"""Make (or check) the golden copies of stock DeepSpeed runs the tests compare with.

    .venv/bin/python tests/make_golden.py           # run each of ds_runs.GOLDEN live, keep its results
    .venv/bin/python tests/make_golden.py --check   # run each live, compare with the kept copy
    .venv/bin/python tests/make_golden.py --missing # make only those without a copy usable here

A copy (``tests/data/golden/NAME``: the files of ``ds_runs.GOLDEN_FILES`` the run wrote, and
``golden.json`` with its command and what it was made with) stands for the live run only where the
tests find DeepSpeed, torch, the CPU's instruction set and the script as they were (ds_runs.golden);
elsewhere the tests run that stock run live. Make them again after changing any of those.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
from pathlib import Path

TESTS = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, TESTS)
sys.path.insert(0, os.path.dirname(TESTS))

import torch  # noqa: E402
from ds_runs import GOLDEN, GOLDEN_DIR, GOLDEN_FILES, DSRuns, golden, made_with  # noqa: E402


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--check", action="store_true", help="compare live runs with the kept copies; keep nothing")
    ap.add_argument("--missing", action="store_true", help="make only the copies missing or made elsewhere")
    args = ap.parse_args()
    failed = 0
    with tempfile.TemporaryDirectory(prefix="golden-") as scratch:
        runs = DSRuns(Path(scratch))  # a run that resumes finds the saving run's checkpoint here
        for i, spec in enumerate(GOLDEN):
            name = spec.golden_name()
            if args.missing and golden(spec)[0] is not None:
                continue
            print(
                f"[{i + 1}/{len(GOLDEN)}] {name}: {' '.join(spec.script_args)} ({os.path.basename(spec.script)}, "
                f"{spec.ranks} rank{'s' * (spec.ranks > 1)})",
                flush=True,
            )
            run = runs.get(spec).ok()
            if args.check:
                kept, why = golden(spec)
                if kept is None:
                    print(f"  no usable copy: {why}")
                    failed += 1
                    continue
                for f in GOLDEN_FILES:
                    if (run.dir / f).exists() != (kept.dir / f).exists():
                        print(f"  {f}: in one of the two only")
                        failed += 1
                torch.testing.assert_close(torch.tensor(run.losses), torch.tensor(kept.losses), rtol=1e-5, atol=0)
                for r in range(spec.ranks):
                    if (kept.dir / f"values.pt.rank{r}").exists():  # as test_partitioned_state_api_matches_stock
                        want, got = (torch.load(d / f"values.pt.rank{r}") for d in (kept.dir, run.dir))
                        assert want.keys() == got.keys()
                        for k in want:
                            torch.testing.assert_close(got[k], want[k], rtol=1e-5, atol=1e-7)
                print("  the same within the tests' tolerance")
                continue
            out = GOLDEN_DIR / name
            shutil.rmtree(out, ignore_errors=True)
            out.mkdir(parents=True)
            for f in GOLDEN_FILES:
                if (run.dir / f).exists():
                    shutil.copy(run.dir / f, out / f)
            (out / "golden.json").write_text(
                json.dumps(
                    {
                        "command": spec.argv("{dir}", "{port}"),
                        "made_with": made_with(spec),
                        "ckpt": None
                        if spec.ckpt is None
                        else {"saver": spec.ckpt.saver.golden_name(), "universal": spec.ckpt.universal},
                        "made_by": "tests/make_golden.py",
                        "stdout": run.stdout[-2000:],
                    },
                    indent=1,
                )
                + "\n"
            )
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
