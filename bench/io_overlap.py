"""Issue 24: optimizer-state I/O overlapping backward and the next forward, on emulated tiers, runs interleaved.

Needs root (emulated tiers; without it the run says so and exits 0):

    .venv/bin/python bench/io_overlap.py --rounds 2 --iters 6 --json io_overlap.json

bench/ds_model.py (92M parameters, DeepSpeed ZeRO-3, one rank, CPU accelerator) on the tiers of
bench/tiers.sh, "nvme" throttled to 400/400 MB/s and "pfs" to 200/200 MB/s (at /mnt/ovl-tiers,
cgroup ovl-tiers, unless OFFLOADCTL_TIERS_* say otherwise). Each round runs, one after the other:

- the O_DIRECT ceilings of each tier under its throttle: read, write, and reads and writes at once
  (offloadctl's probe, perf.probe.measure_path: the engine's I/O backend, 8 requests of 8 MiB in
  flight per direction);
- stock ZeRO-Infinity (``--offload nvme`` on "nvme") with the aio setting and ``buffer_count`` of
  bench/zi_aio_sweep.py (``--zi-aio``);
- offloadctl with nvme and no host cache, nvme with half the state cached, nvme + pfs with half
  cached: each with its I/O overlapping backward and forward (the default) and without
  (``offloadctl train --no-io-overlap``; left out, with a note, while ``offloadctl train`` has no such flag).

Per run: the median iteration over iterations 3 on, the update phase (``engine.step()``), forward
and backward (the rest), and for offloadctl the bytes each tier moved per step (telemetry) and the
read-ahead budget. Per overlapped configuration: the I/O floor (max over tiers of max(read bytes /
read ceiling, write bytes / write ceiling); the sum form read/R + write/W and the concurrent form
(read + write) / concurrent ceiling beside it), the compute time (forward and backward of the same
configuration without overlap), and the goals of the issue:

1. iteration <= 1.15 x max(compute, I/O floor);
2. iteration speed-up against the tuned ZeRO-Infinity >= 2.0x (no cache), 2.8x (half cached),
   3.5x (second path).
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import statistics
import subprocess
import sys
from datetime import datetime, timezone

from rich.console import Console
from rich.progress import Progress
from rich.table import Table

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, ROOT)
from bench import _runs  # noqa: E402
from bench._runs import can_emulate, measure_ceilings, run_one, tiers, tiers_root, train_cmd, use_own_tiers  # noqa: E402
from bench.vs_zero_infinity import HALF_GB, NVME_MBPS, PFS_MBPS  # noqa: E402
from bench.zi_aio_sweep import DS_DEFAULT, TIERS_NAME, med_from, zi_build  # noqa: E402
from bench.zi_aio_sweep import OUT as SWEEP_JSON  # noqa: E402

ZI_PORT, OURS_PORT = "29745", "29746"
GOAL1_SLACK = 1.15
ZI = "zero-infinity (tuned)"
NO_OVERLAP = " (no overlap)"
CONFIGS = {  # name: (offloadctl train options, goal 2's speed-up)
    "offloadctl nvme, no cache": (lambda d: ["--nvme", d["nvme"], "--host-cache", "0"], 2.0),
    "offloadctl nvme, half cached": (lambda d: ["--nvme", d["nvme"], "--host-cache", f"{HALF_GB:.4f}GB"], 2.8),
    "offloadctl nvme+pfs, half cached": (
        lambda d: ["--nvme", d["nvme"], "--remote", d["pfs"], "--host-cache", f"{HALF_GB:.4f}GB"],
        3.5,
    ),
}
console = Console(stderr=True)


# -- pure parts (tests/test_bench_io_overlap.py) --------------------------------------------------------


def load_zi_aio(path: str | None, default: str = SWEEP_JSON) -> tuple[dict, str]:
    """ZeRO-Infinity's setting (block_size, queue_depth, intra_op_parallelism, buffer_count) from
    bench/zi_aio_sweep.py's JSON ``choice``, and where it came from. ``path`` None: ``default`` if it
    exists, else DeepSpeed's aio defaults with bench/ds_model.py's buffer_count (source says so).
    A given file that is missing or malformed raises ValueError."""
    if path is None:
        if not os.path.exists(default):
            return dict(DS_DEFAULT), f"no {os.path.relpath(default, ROOT)}: DeepSpeed's aio defaults, buffer_count 16 (untuned)"
        path = default
    try:
        with open(path) as f:
            choice = json.load(f)["choice"]
        setting = {k: choice[k] for k in DS_DEFAULT}
    except (OSError, json.JSONDecodeError, KeyError, TypeError) as e:
        raise ValueError(f"--zi-aio {path}: no ZeRO-Infinity choice there ({type(e).__name__}: {e})") from None
    bad = [k for k, v in setting.items() if not (isinstance(v, int) and not isinstance(v, bool) and v > 0)]
    if bad:
        raise ValueError(f"--zi-aio {path}: {', '.join(bad)} must be positive integers, got {setting}")
    return setting, f"tuned: {path}"


def io_floor(bytes_read: dict[str, float], bytes_written: dict[str, float], ceilings: dict[str, dict]) -> dict:
    """Seconds the tiers need at least for one step's bytes (per tier name; ceilings in bytes/s with
    ``read``, ``write``, ``mixed``): ``floor_s`` max over tiers of max(read/R, write/W) (the directions
    overlap, each at its own ceiling), ``sum_s`` max over tiers of read/R + write/W (they do not
    overlap), ``mixed_s`` max over tiers of (read + write) / concurrent ceiling."""
    per = {}
    for t in sorted(set(bytes_read) | set(bytes_written)):
        r, w, c = bytes_read.get(t, 0), bytes_written.get(t, 0), ceilings[t]
        per[t] = {"read_s": r / c["read"], "write_s": w / c["write"], "mixed_s": (r + w) / c["mixed"]}
    return {
        "floor_s": max((max(p["read_s"], p["write_s"]) for p in per.values()), default=0.0),
        "sum_s": max((p["read_s"] + p["write_s"] for p in per.values()), default=0.0),
        "mixed_s": max((p["mixed_s"] for p in per.values()), default=0.0),
        "per_tier": per,
    }


def evaluate_goals(report: dict[str, dict], ceilings: dict[str, dict]) -> list[dict]:
    """The issue's goals for each overlapped configuration in ``report`` (name: iter_s, fwd_bwd_s,
    tier_bytes_read/written; ZeRO-Infinity under ``ZI``; the no-overlap twin under name + NO_OVERLAP,
    when run). Compute time is the twin's forward and backward, else the run's own (``compute_from``)."""
    zi_iter = report[ZI]["iter_s"]
    out = []
    for name, (_, target) in CONFIGS.items():
        r = report.get(name)
        if r is None:
            continue
        floor = io_floor(r.get("tier_bytes_read", {}), r.get("tier_bytes_written", {}), ceilings)
        twin = report.get(name + NO_OVERLAP)
        compute, source = (twin["fwd_bwd_s"], "no-overlap run") if twin else (r["fwd_bwd_s"], "own run (no no-overlap run)")
        bound = GOAL1_SLACK * max(compute, floor["floor_s"])
        speedup = zi_iter / r["iter_s"]
        out.append(
            {
                "config": name,
                "iter_s": r["iter_s"],
                "io_floor_s": floor["floor_s"],
                "io_floor_sum_s": floor["sum_s"],
                "io_floor_mixed_s": floor["mixed_s"],
                "compute_s": compute,
                "compute_from": source,
                "own_fwd_bwd_s": r["fwd_bwd_s"],
                "goal1_bound_s": bound,
                "goal1": r["iter_s"] <= bound,
                "speedup": speedup,
                "goal2_target": target,
                "goal2": speedup >= target,
                "no_overlap_iter_s": twin["iter_s"] if twin else None,
            }
        )
    return out


def summarize(runs: list[dict]) -> dict:
    """One configuration over rounds: medians over rounds of each run's median (iterations 3 on)."""
    m = lambda f: statistics.median(f(r) for r in runs)  # noqa: E731
    out = {
        "iter_s": m(lambda r: med_from(r["iter_s"])),
        "step_s": m(lambda r: med_from(r["step_s"])),
        "fwd_bwd_s": m(lambda r: med_from([i - s for i, s in zip(r["iter_s"], r["step_s"])])),
        "rounds_iter_s": [med_from(r["iter_s"]) for r in runs],
    }
    if all("tier_bytes_read" in r for r in runs):
        for key in ("tier_bytes_read", "tier_bytes_written"):
            out[key] = {t: statistics.median(r[key].get(t, 0) for r in runs) for t in sorted({t for r in runs for t in r[key]})}
        ra = [r["read_ahead_bytes"] for r in runs if r.get("read_ahead_bytes") is not None]
        out["read_ahead_bytes"] = statistics.median(ra) if ra else None
        fb = [r["engine_fwd_bwd_s"] for r in runs if r.get("engine_fwd_bwd_s") is not None]
        out["engine_fwd_bwd_s"] = statistics.median(fb) if fb else None
    return out


def median_ceilings(rounds: list[dict]) -> dict[str, dict]:
    return {t: {k: statistics.median(r[t][k] for r in rounds) for k in ("read", "write", "mixed")} for t in rounds[0]}


# -- the run ----------------------------------------------------------------------------------------


def train_flags() -> set[str]:
    """The issue's ``offloadctl train`` flags that this checkout has."""
    p = subprocess.run(
        [sys.executable, "-m", "offloadctl.cli", "train", "--help"],
        capture_output=True,
        text=True,
        cwd=ROOT,
        env=dict(os.environ, PYTHONPATH=ROOT, COLUMNS="200"),
    )
    return {f for f in ("--no-io-overlap", "--read-ahead") if f in p.stdout}


def plan(flags: set[str], read_ahead: str | None, zi: dict) -> tuple[dict, list[str]]:
    """{name: build} in the order each round runs them, and notes."""
    notes = []
    ra = []
    if read_ahead is not None:
        if "--read-ahead" in flags:
            ra = ["--read-ahead", read_ahead]
        else:
            notes.append(f"--read-ahead {read_ahead} ignored: offloadctl train has no --read-ahead yet")
    if "--no-io-overlap" not in flags:
        notes.append(
            "no-overlap runs left out: offloadctl train has no --no-io-overlap yet "
            "(compute time is then each overlapped run's own forward and backward)"
        )
    builds = {ZI: zi_build(zi, ZI_PORT)}
    for name, (opts, _) in CONFIGS.items():
        builds[name] = lambda d, out, it, opts=opts: train_cmd(d, out, it, [*opts(d), *ra], OURS_PORT)
        if "--no-io-overlap" in flags:
            builds[name + NO_OVERLAP] = lambda d, out, it, opts=opts: train_cmd(
                d, out, it, [*opts(d), "--no-io-overlap"], OURS_PORT
            )
    return builds, notes


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--iters", type=int, default=6, help="iterations per run; the first two are warm-up")
    ap.add_argument(
        "--read-ahead",
        metavar="SIZE",
        help="offloadctl train --read-ahead for the overlapped runs (e.g. 512MB, 0 = none; default: not given, auto)",
    )
    ap.add_argument(
        "--zi-aio",
        metavar="FILE",
        help=f"bench/zi_aio_sweep.py's JSON (default {os.path.relpath(SWEEP_JSON, ROOT)} if present, else DeepSpeed's defaults)",
    )
    ap.add_argument(
        "--model",
        metavar="ARGS",
        default="",
        help="bench/ds_model.py model options for every run, e.g. '--width 1600 --layers 36 "
        "--sub-group-size 2560000' (36 subgroups; default: its 9 layers of 3200 x 3200, 9 subgroups)",
    )
    ap.add_argument("--json", metavar="FILE")
    args = ap.parse_args(argv)
    _runs.MODEL_ARGS[:] = shlex.split(args.model)
    why = can_emulate()
    if why:
        console.print(f"skipping: {why}")
        return 0
    try:
        zi, zi_source = load_zi_aio(args.zi_aio)
    except ValueError as e:
        console.print(f"io_overlap: {e}")
        return 2
    if not zi_source.startswith("tuned"):
        console.print(f"[yellow]warning:[/] ZeRO-Infinity untuned: {zi_source}; run bench/zi_aio_sweep.py first")
    use_own_tiers(TIERS_NAME)
    flags = train_flags()
    builds, notes = plan(flags, args.read_ahead, zi)
    for n in notes:
        console.print(f"note: {n}")
    started = datetime.now(timezone.utc).isoformat(timespec="seconds")
    results: dict[str, list[dict]] = {k: [] for k in builds}
    ceil_rounds: list[dict] = []
    with tiers(f"nvme:6:{NVME_MBPS}:{NVME_MBPS}", f"pfs:6:{PFS_MBPS}:{PFS_MBPS}"), Progress(console=console) as progress:
        task = progress.add_task("runs", total=args.rounds * (len(builds) + 1))
        root = tiers_root()
        for _ in range(args.rounds):
            progress.update(task, description="ceilings (O_DIRECT, under the throttles)")
            ceil_rounds.append(measure_ceilings({"nvme": f"{root}/nvme", "pfs": f"{root}/pfs"}))
            progress.advance(task)
            for name, build in builds.items():
                progress.update(task, description=name)
                results[name].append(run_one(build, str(args.iters), telemetry_detail=True))
                progress.advance(task)
    ceilings = median_ceilings(ceil_rounds)
    report = {name: summarize(runs) for name, runs in results.items()}
    goals = evaluate_goals(report, ceilings)
    print_report(report, ceilings, goals, zi, zi_source, notes)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(
                {
                    "when": started,
                    "command": " ".join([os.path.relpath(sys.argv[0], ROOT), *sys.argv[1:]]),
                    "flags": sorted(flags),
                    "read_ahead": args.read_ahead,
                    "zi_aio": zi,
                    "zi_aio_source": zi_source,
                    "ceilings": ceilings,
                    "ceilings_rounds": ceil_rounds,
                    "results": results,
                    "report": report,
                    "goals": goals,
                    "notes": notes,
                },
                f,
                indent=2,
            )
    return 0


def print_report(report: dict, ceilings: dict, goals: list[dict], zi: dict, zi_source: str, notes: list[str]) -> None:
    out = Console(width=170)
    mb = lambda n: f"{n / 1e6:.0f}"  # noqa: E731
    c = Table("tier", "read MB/s", "write MB/s", "read+write at once MB/s", title="O_DIRECT ceilings under the throttles")
    for t, v in ceilings.items():
        c.add_row(t, mb(v["read"]), mb(v["write"]), mb(v["mixed"]))
    out.print(c)
    t = Table(
        "configuration",
        "iteration s",
        "step s",
        "fwd+bwd s",
        "nvme MB/step r/w",
        "pfs MB/step r/w",
        "read-ahead MB",
        "iteration s by round",
        title=f"runs (ZeRO-Infinity: {json.dumps(zi)}, {zi_source})",
    )

    def per(r: dict, tier: str) -> str:
        rd, wr = r.get("tier_bytes_read", {}), r.get("tier_bytes_written", {})
        return f"{mb(rd.get(tier, 0))}/{mb(wr.get(tier, 0))}" if tier in rd or tier in wr else "-"

    for name, r in report.items():
        ra = r.get("read_ahead_bytes")
        t.add_row(
            name,
            f"{r['iter_s']:.2f}",
            f"{r['step_s']:.2f}",
            f"{r['fwd_bwd_s']:.2f}",
            per(r, "nvme"),
            per(r, "pfs"),
            mb(ra) if ra is not None else "-",
            ", ".join(f"{x:.2f}" for x in r["rounds_iter_s"]),
        )
    out.print(t)
    g = Table(
        "configuration (overlapped)",
        "iteration s",
        "I/O floor s max(r/R,w/W)",
        "sum r/R+w/W",
        "(r+w)/concurrent",
        "compute s",
        "own fwd+bwd s",
        f"goal 1: <= {GOAL1_SLACK} x max",
        "speed-up vs ZI",
        "goal 2",
        title="goals of issue 24",
    )
    yes = lambda ok: "[green]held[/]" if ok else "[red]missed[/]"  # noqa: E731
    for x in goals:
        star = "" if x["compute_from"] == "no-overlap run" else "*"
        g.add_row(
            x["config"],
            f"{x['iter_s']:.2f}",
            f"{x['io_floor_s']:.2f}",
            f"{x['io_floor_sum_s']:.2f}",
            f"{x['io_floor_mixed_s']:.2f}",
            f"{x['compute_s']:.2f}{star}",
            f"{x['own_fwd_bwd_s']:.2f}",
            f"{x['goal1_bound_s']:.2f} {yes(x['goal1'])}",
            f"{x['speedup']:.2f}x",
            f">= {x['goal2_target']}x {yes(x['goal2'])}",
        )
    out.print(g)
    if any(x["compute_from"] != "no-overlap run" for x in goals):
        out.print("* compute from the overlapped run's own forward and backward (no no-overlap run)")
    held = [
        f"{x['config']}: goal 1 {'held' if x['goal1'] else 'missed'}, goal 2 {'held' if x['goal2'] else 'missed'}" for x in goals
    ]
    out.print("goals: " + "; ".join(held))
    for n in notes:
        out.print(f"note: {n}")


if __name__ == "__main__":
    raise SystemExit(main())
