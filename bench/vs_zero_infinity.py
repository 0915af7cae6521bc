"""offloadctl train against stock DeepSpeed ZeRO-Infinity, on emulated tiers, runs interleaved.

Needs root (emulated tiers; without it the run says so and exits 0):

    .venv/bin/python bench/vs_zero_infinity.py            # 3 rounds, 6 iterations per run

Each round runs, one after the other on the same machine: stock ZeRO-Infinity (optimizer state
on the "nvme" tier), stock ZeRO-3 CPU offload (all state in memory, for reference), and
offloadctl with nvme alone and no host cache, nvme with half the state cached, and nvme + pfs
with half cached. "nvme" is throttled to 400/400 MB/s and "pfs" to 200/200 MB/s. Reported:
median iteration and step (update phase) times, ratios against ZeRO-Infinity, and the floor
of the update phase that the throttles imply for the bytes each run moved.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys

from rich.console import Console
from rich.progress import Progress
from rich.table import Table

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, ROOT)
from bench._runs import TIERS, train_cmd  # noqa: E402
from bench._runs import run_one as _run_one  # noqa: E402  (shared with bench/io_overlap.py)
from engine.layout import STATE_BYTES_PER_ELEMENT  # noqa: E402

NVME_MBPS, PFS_MBPS = 400, 200
PARAMS = 9 * 3200 * 3200
HALF_GB = STATE_BYTES_PER_ELEMENT * PARAMS / 2 / 1e9
console = Console(stderr=True)

CONFIGS = {
    "zero-infinity": lambda d, out, it: [
        "-m",
        "deepspeed.launcher.runner",
        "--num_gpus",
        "1",
        "--master_port",
        "29731",
        os.path.join(HERE, "ds_model.py"),
        "--offload",
        "nvme",
        "--nvme-path",
        d["nvme"],
        "--iters",
        it,
        "--out",
        out,
    ],
    "zero-offload-cpu": lambda d, out, it: [
        "-m",
        "deepspeed.launcher.runner",
        "--num_gpus",
        "1",
        "--master_port",
        "29732",
        os.path.join(HERE, "ds_model.py"),
        "--iters",
        it,
        "--out",
        out,
    ],
    "offloadctl nvme": lambda d, out, it: _ours(d, out, it, ["--nvme", d["nvme"], "--host-cache", "0"]),
    "offloadctl nvme, half cached": lambda d, out, it: _ours(
        d, out, it, ["--nvme", d["nvme"], "--host-cache", f"{HALF_GB:.4f}GB"]
    ),
    "offloadctl nvme+pfs, half cached": lambda d, out, it: _ours(
        d, out, it, ["--nvme", d["nvme"], "--remote", d["pfs"], "--host-cache", f"{HALF_GB:.4f}GB"]
    ),
}


def _ours(d, out, iters, opts):
    return train_cmd(d, out, iters, opts, "29733")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--iters", type=int, default=6, help="iterations per run; the first two are warm-up")
    ap.add_argument("--json", metavar="FILE")
    args = ap.parse_args()
    if os.geteuid() != 0:
        console.print("skipping: emulated tiers need root (loop devices, mounts, blkio cgroups)")
        return 0
    subprocess.run(
        [TIERS, "up", f"nvme:6:{NVME_MBPS}:{NVME_MBPS}", f"pfs:6:{PFS_MBPS}:{PFS_MBPS}"], check=True, stdout=subprocess.DEVNULL
    )
    results: dict[str, list[dict]] = {k: [] for k in CONFIGS}
    try:
        with Progress(console=console) as progress:
            task = progress.add_task("runs", total=args.rounds * len(CONFIGS))
            for _ in range(args.rounds):
                for name, build in CONFIGS.items():
                    progress.update(task, description=name)
                    results[name].append(_run_one(build, str(args.iters)))
                    progress.advance(task)
    finally:
        subprocess.run([TIERS, "down"], check=False, stdout=subprocess.DEVNULL)
    report = _report(results)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"results": results, "report": report, "command": " ".join(sys.argv)}, f, indent=2)
    return 0


def _floor_s(r: dict) -> float | None:
    """Update-phase floor from the bytes each path moved and its throttle (reads and writes overlap)."""
    if "path_bytes_read" not in r:
        return None
    per_path = []
    for path, rb in r["path_bytes_read"].items():
        mbps = PFS_MBPS if "/pfs/" in path else NVME_MBPS
        per_path.append(max(rb, r["path_bytes_written"][path]) / (mbps * 1e6))
    return max(per_path) if per_path else 0.0


def _report(results: dict[str, list[dict]]) -> dict:
    med = lambda runs, key: statistics.median(statistics.median(r[key][2:]) for r in runs)  # noqa: E731
    zi_iter, zi_step = med(results["zero-infinity"], "iter_s"), med(results["zero-infinity"], "step_s")
    # ZeRO-Infinity moves ~4 B/param of fp32 gradients to nvme in backward and 16 read + 12 written in the step.
    zi_floor = 16 * PARAMS / (NVME_MBPS * 1e6)
    table = Table("configuration", "iteration s", "step s", "iteration speed-up vs ZeRO-Infinity", "step floor s")
    report = {}
    for name, runs in results.items():
        it, st = med(runs, "iter_s"), med(runs, "step_s")
        floors = [f for f in (_floor_s(r) for r in runs) if f is not None]
        floor = statistics.median(floors) if floors else (zi_floor if name == "zero-infinity" else None)
        report[name] = {
            "iter_s": it,
            "step_s": st,
            "speedup_iter": zi_iter / it,
            "speedup_step": zi_step / st,
            "step_floor_s": floor,
        }
        table.add_row(name, f"{it:.2f}", f"{st:.2f}", f"{zi_iter / it:.2f}x", f"{floor:.2f}" if floor else "-")
    Console(width=150).print(table)
    return report


if __name__ == "__main__":
    raise SystemExit(main())
