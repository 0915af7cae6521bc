"""Re-run a benchmark script on emulated tiers made with bench/tiers.sh, then remove them.

Each benchmark's ``--emulate READ:WRITE`` calls :func:`run_emulated`: the tiers come up, the
script runs again inside their blkio cgroup with ``--nvme`` (and ``--remote``) pointing at them,
and the tiers go down whatever happens. Needs root; without it the run says so and exits 0.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys

from rich.console import Console

TIERS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "tiers.sh")


def tiers_root() -> str:
    return os.environ.get("OFFLOADCTL_TIERS_ROOT", "/mnt/offloadctl-tiers")


def parse_rates(spec: str) -> tuple[int, int] | None:
    try:
        read_mbps, write_mbps = (int(x) for x in spec.split(":"))
    except ValueError:
        return None
    return read_mbps, write_mbps


def without_option(argv: list[str], name: str) -> list[str]:
    """``argv`` less ``name`` and its value (``--x V``, ``--x=V``, or a bare ``--x`` whose value
    is optional)."""
    rest, skip = [], False
    for a in argv:
        if skip:
            skip = False
            if not a.startswith("--"):
                continue
        if a.startswith(name + "="):
            continue
        if a == name:
            skip = True
            continue
        rest.append(a)
    return rest


def run_emulated(
    script: str, spec: str, argv: list[str], *, size_gb: int = 8, remote: str | None = None, extra: list[str] = ()
) -> int:
    """Run ``script`` with ``argv`` (less ``--emulate``) and ``extra`` on an "nvme" tier throttled
    to ``spec`` (READ:WRITE MB/s), plus a "pfs" tier throttled to ``remote`` when given (passed as
    --remote)."""
    console = Console(stderr=True)
    tiers = {"nvme": parse_rates(spec)}
    if remote is not None:
        tiers["pfs"] = parse_rates(remote)
    for name, rates in tiers.items():
        if rates is None:
            console.print(f"[red]--emulate: give READ:WRITE in MB/s for {name}, for example 400:400[/red]")
            return 2
    if os.geteuid() != 0:
        console.print(
            "skipping: emulated tiers need root (loop devices, mounts, blkio cgroups); "
            "run with --nvme PATH on a real path instead"
        )
        return 0
    specs = [f"{name}:{size_gb}:{r}:{w}" for name, (r, w) in tiers.items()]
    where = ["--nvme", os.path.join(tiers_root(), "nvme")]
    if remote is not None:
        where += ["--remote", os.path.join(tiers_root(), "pfs")]
    subprocess.run([TIERS, "up", *specs], check=True)
    try:
        return subprocess.call(
            [TIERS, "run", sys.executable, os.path.abspath(script), *where, *extra, *without_option(argv, "--emulate")]
        )
    finally:
        subprocess.run([TIERS, "down"], check=False)


def add_engine_run_args(ap: argparse.ArgumentParser, steps_help: str) -> None:
    """Where an update-phase benchmark runs (a path, or an emulated tier) and its model size."""
    where = ap.add_mutually_exclusive_group(required=True)
    where.add_argument("--nvme", help="directory on the storage to test (it must exist)")
    where.add_argument(
        "--emulate",
        metavar="READ:WRITE",
        help="set up an emulated tier throttled to READ:WRITE MB/s (root), run there, and take it down",
    )
    ap.add_argument("--params", type=float, default=100e6, help="parameters (default 1e8)")
    ap.add_argument("--subgroup", type=float, default=1e7, help="elements per subgroup (default 1e7)")
    ap.add_argument("--steps", type=int, default=6, help=steps_help)
    ap.add_argument("--io-backend", default="auto", choices=["auto", "aio", "posix"])
    ap.add_argument("--json", metavar="FILE", help="also write the results as JSON to FILE")
