"""Issue 45 item 2: the NVMe-bound path with a small host budget, against ZeRO-Infinity and the I/O floor.

Needs root (emulated tiers; without it the run says so and exits 0):

    .venv/bin/python bench/nvme_floor.py --pairs 3 --iters 10 --json nvme_floor.json

One emulated NVMe path (bench/tiers.sh at /mnt/nvf-tiers, cgroup nvf-tiers: 350 MB/s read,
450 MB/s write) holds all the optimizer state of bench/ds_model.py at 48 layers of 1415 x 1415:
96.1M parameters in 48 subgroups of 2.0M elements, 1.15 GB of state. First the path's O_DIRECT
ceilings under its throttle; then each pair runs, in alternating order, stock ZeRO-Infinity (its
aio setting from bench/zi_aio_sweep.py's JSON where there is one) and ``offloadctl train --nvme
PATH --host-cache 0 --host-memory 384MB`` (the tuner on, as a user runs it).

Per offloadctl run, from its own bytes and the ceilings measured in the same invocation:

- **I/O floor**: max(bytes read / read ceiling, bytes written / write ceiling) per iteration.
  The bytes are what the path must move: what the alternating order keeps in memory is not read
  (nor written, for the kept copies not yet written). The iteration if every byte overlapped
  forward, backward and the update.
- **compute**: forward + backward (the record's spans) + the update's kernels, same run.
- **iteration floor**: max(I/O floor, compute); the goal is the iteration within 1.15x of it.
- **budget floor**: the floor once the update runs inside ``step()``, as ZeRO-3's does: state
  can be read before the step only into the host budget's staging buffers, so the update reads
  at least (swapped subgroups - buffers) x subgroup bytes. It is forward + backward + that /
  read ceiling (or the I/O floor, whichever is larger).
- Per phase, the bytes the path moved during it (the recorder's disk samples).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys

from rich.console import Console
from rich.progress import Progress
from rich.table import Table

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, ROOT)
from bench import _runs  # noqa: E402
from bench._runs import can_emulate, measure_ceilings, run_one, tiers, tiers_root, train_cmd, use_own_tiers  # noqa: E402
from bench.io_overlap import io_floor, load_zi_aio  # noqa: E402
from bench.zi_aio_sweep import med_from, zi_build  # noqa: E402
from engine.layout import STATE_BYTES_PER_ELEMENT, host_buffer_bytes  # noqa: E402

TIERS_NAME = "nvf-tiers"
READ_MBPS, WRITE_MBPS = 350, 450
WIDTH, LAYERS = 1415, 48  # one layer per subgroup: 2,002,225 elements, just over the sub_group_size
SUB_GROUP_SIZE = 2_000_000
HOST_MEMORY = "384MB"
GOAL_SLACK = 1.15
ZI_PORT, OURS_PORT = "29771", "29772"
ZI, OURS = "zero-infinity", "offloadctl"
console = Console(stderr=True)


# -- pure parts (tests/test_bench_nvme_floor.py) ----------------------------------------------------


def floors(run: dict, ceiling: dict, *, subgroups: int, subgroup_numel: int) -> dict:
    """The floors of one offloadctl run (see the module's docstring) from its medians: bytes per
    step (``tier_bytes_read``/``written`` of the "nvme" tier), ``phases`` (forward, backward, update),
    ``kernel_s`` and ``staging_pool_bytes``; ``ceiling``: the tier's ``read`` and ``write`` bytes/s."""
    io = io_floor(run["tier_bytes_read"], run["tier_bytes_written"], {"nvme": ceiling})
    fwd_bwd = run["phases"]["forward"]["s"] + run["phases"]["backward"]["s"]
    compute = fwd_bwd + (run.get("kernel_s") or 0.0)
    buffers = int((run.get("staging_pool_bytes") or 0) // host_buffer_bytes(subgroup_numel))
    update_reads = max(0, subgroups - buffers) * STATE_BYTES_PER_ELEMENT * subgroup_numel
    budget = max(io["floor_s"], fwd_bwd + update_reads / ceiling["read"])
    return {
        "io_floor_s": io["floor_s"],
        "compute_s": compute,
        "iteration_floor_s": max(io["floor_s"], compute),
        "budget_floor_s": budget,
        "buffers": buffers,
        "fwd_bwd_s": fwd_bwd,
    }


def pair_order(k: int, zi: bool = True) -> tuple[str, ...]:
    """The pair's order: ZeRO-Infinity first on even pairs, offloadctl first on odd ones (offloadctl
    alone without ``zi``)."""
    if not zi:
        return (OURS,)
    return (ZI, OURS) if k % 2 == 0 else (OURS, ZI)


def summarize(runs: dict[str, list[dict]], ceiling: dict) -> dict:
    """Per run the iteration and step medians (iterations 3 on), offloadctl's floors and its ratio
    to them, and each pair's speed-up against ZeRO-Infinity."""
    out: dict = {ZI: [], OURS: [], "pairs": []}
    for name in (ZI, OURS):
        for r in runs[name]:
            row = {"iter_s": med_from(r["iter_s"]), "step_s": med_from(r["step_s"])}
            if name == OURS:
                row.update(floors(r, ceiling, subgroups=LAYERS, subgroup_numel=WIDTH * WIDTH))
                row["vs_iteration_floor"] = row["iter_s"] / row["iteration_floor_s"]
                row["vs_budget_floor"] = row["iter_s"] / row["budget_floor_s"]
                row["phases"] = r["phases"]
                row["bytes_read"], row["bytes_written"] = r["tier_bytes_read"]["nvme"], r["tier_bytes_written"]["nvme"]
            out[name].append(row)
    for z, o in zip(out[ZI], out[OURS]):
        out["pairs"].append({"speedup": z["iter_s"] / o["iter_s"], "step_speedup": z["step_s"] / o["step_s"]})
    return out


# -- the runs --------------------------------------------------------------------------------------


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--pairs", type=int, default=3, help="interleaved pairs (default 3)")
    ap.add_argument("--iters", type=int, default=10, help="iterations per run (default 10; the first 2 are left out)")
    ap.add_argument("--zi-aio", help="bench/zi_aio_sweep.py's JSON (default: bench/results/zi_aio_sweep.json if there)")
    ap.add_argument("--host-memory", default=HOST_MEMORY, help=f"offloadctl train --host-memory (default {HOST_MEMORY})")
    ap.add_argument("--no-zi", action="store_true", help="offloadctl's runs only (no speed-up column)")
    ap.add_argument("--json", help="write the figures here")
    a = ap.parse_args(argv)
    why = can_emulate()
    if why:
        console.print(f"nvme_floor: skipped: {why}")
        return 0
    use_own_tiers(TIERS_NAME)
    _runs.MODEL_ARGS[:] = ["--width", str(WIDTH), "--layers", str(LAYERS), "--sub-group-size", str(SUB_GROUP_SIZE)]
    try:
        zi_aio, zi_source = load_zi_aio(a.zi_aio)
    except ValueError as e:
        console.print(f"[red]nvme_floor: {e}[/red]")
        return 2
    builds = {
        ZI: zi_build(zi_aio, ZI_PORT),
        OURS: lambda d, out, it: train_cmd(
            d, out, it, ["--nvme", d["nvme"], "--host-cache", "0", "--host-memory", a.host_memory], OURS_PORT
        ),
    }
    runs: dict[str, list[dict]] = {ZI: [], OURS: []}
    with tiers(f"nvme:4:{READ_MBPS}:{WRITE_MBPS}"):
        ceiling = measure_ceilings({"nvme": os.path.join(tiers_root(), "nvme")})["nvme"]
        with Progress(console=console, transient=True) as prog:
            task = prog.add_task("pairs", total=(1 if a.no_zi else 2) * a.pairs)
            for k in range(a.pairs):
                for name in pair_order(k, zi=not a.no_zi):
                    prog.update(task, description=f"pair {k + 1}/{a.pairs}: {name}")
                    runs[name].append(run_one(builds[name], str(a.iters), telemetry_detail=name == OURS))
                    prog.advance(task)
    report = summarize(runs, ceiling)
    report.update(
        ceiling={k: ceiling[k] for k in ("read", "write", "mixed")}, zi_aio=zi_aio, zi_source=zi_source, host_memory=a.host_memory
    )
    print_report(report)
    if a.json:
        with open(a.json, "w") as f:
            json.dump(report, f, indent=1)
    return 0


def print_report(report: dict) -> None:
    c = report["ceiling"]
    console.print(
        f"path ceilings under the throttle: read {c['read'] / 1e6:.0f} MB/s, write {c['write'] / 1e6:.0f} MB/s, "
        f"both at once {c['mixed'] / 1e6:.0f} MB/s; ZeRO-Infinity's aio: {report['zi_source']}"
    )
    t = Table("pair", "ZI it. s", "ours it. s", "speed-up", "I/O floor", "compute", "x floor", "budget fl.", "x budget")
    for k, o in enumerate(report[OURS]):
        z, p = (report[ZI][k], report["pairs"][k]) if k < len(report["pairs"]) else ({"iter_s": None}, {"speedup": None})
        t.add_row(
            str(k + 1),
            *(f"{x:.2f}" if x is not None else "-" for x in (z["iter_s"], o["iter_s"])),
            f"{p['speedup']:.2f}x" if p["speedup"] is not None else "-",
            *(f"{o[key]:.2f}" for key in ("io_floor_s", "compute_s", "vs_iteration_floor", "budget_floor_s", "vs_budget_floor")),
        )
    console.print(t)
    ph = Table("offloadctl, per phase", "s", "MB read", "MB written")
    for phase in ("forward", "backward", "update"):
        rows = [o["phases"][phase] for o in report[OURS]]
        ph.add_row(
            phase,
            *(f"{statistics.median(r[key] for r in rows) / (1 if key == 's' else 1e6):.2f}" for key in ("s", "read", "written")),
        )
    console.print(ph)
    o = report[OURS]
    med = lambda key: statistics.median(r[key] for r in o)
    console.print(
        f"per iteration {med('bytes_read') / 1e6:.0f} MB read, {med('bytes_written') / 1e6:.0f} MB written; "
        f"{med('buffers'):.0f} staging buffers for {LAYERS} subgroups (--host-memory {report.get('host_memory', HOST_MEMORY)}). "
        + (
            f"Median speed-up {statistics.median(p['speedup'] for p in report['pairs']):.2f}x ZeRO-Infinity; "
            if report["pairs"]
            else ""
        )
        + ("the iteration " if report["pairs"] else "The iteration ")
        + f"{med('vs_iteration_floor'):.2f}x its floor (goal <= {GOAL_SLACK}), {med('vs_budget_floor'):.2f}x the budget floor"
    )


if __name__ == "__main__":
    raise SystemExit(main())
