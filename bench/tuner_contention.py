"""Issue 35 item 4: tuned against frozen `offloadctl train` runs under read contention, whole runs.

    ../shared/tools/tiers up nvme:4:400:400 pfs:4:200:200   # optional: the bench brings them up itself
    PYTHONPATH=$PWD .venv/bin/python bench/tuner_contention.py --json tuner_contention.json
    PYTHONPATH=$PWD .venv/bin/python bench/tuner_contention.py --runs 1 --iters 8 --layers 4 --last 4   # smoke

Needs root. The tiers come from ``../shared/tools/tiers`` (else bench/tiers.sh; ``--tiers-tool``):
when no tier is up, the bench runs ``up`` with ``--tier-spec`` (default nvme 400/400 MB/s, pfs
200/200 MB/s) and ``down`` at the end; tiers that are up already (they must include ``nvme`` and
``pfs``) are used as they are and left up. The mounts are read from the tool's ``status``.

Each run is bench/ds_model.py (default: 9 layers of 2400 x 2400, ``sub_group_size`` 5,760,000, one
layer per subgroup, 51.8M parameters, 30 iterations) under ``offloadctl train --num_gpus 1
--host-cache 0 --prefetch-depth 2``, state on fresh directories under the nvme and pfs tiers. Tuned
runs use the tuner (``--tuner auto``: a private daemon, since the bench refuses to run while a
system daemon answers on /run/offloadctl/tuner.sock) with an empty history: a fresh
``XDG_STATE_HOME`` per run; frozen runs are ``--tuner off`` with the same options. Pairs run
interleaved, tuned first in even pairs and frozen first in odd ones, so that drift in the machine's
load falls on both.

Contention: ``--readers`` (default 3) loops of ``dd iflag=direct bs=8M`` reading one pre-written
file on the nvme tier, in the tiers' cgroup (they share its throttled read bandwidth). They start
before each run's launch and stop after it exits, so the engine's probe of the paths at start sees
them as well: every run, tuned or frozen, starts from a plan made under the same contention.

Reported per run: median iteration over the last ``--last`` iterations (the script's own wall
times), the summary's median, the knob changes the engine applied (from its telemetry: count and
list), the tuner's changes with their reasons (its daemon log, ``RUN_DIR/tuner/*.log``; ``undid``
counts kept moves taken back), the final verdict text, and whether it agrees with the knobs (a
verdict that says no move could help while the final knobs differ from the start, or that counts
kept moves while none is left, does not). Per pair: frozen / tuned (above 1: the tuner helped;
the issue's bad run was 0.82); overall: the same for the medians of the runs, and the worst pair.
The physical limit, measured in the same run before the pairs: each tier's O_DIRECT read bandwidth
(one ``dd`` for ``--bw-seconds``) alone and while the readers run.

On exit, SIGINT or SIGTERM: the run in progress gets SIGTERM (offloadctl removes its swap files)
and SIGKILL 10 s later, the readers are killed, the files and directories the bench made are
removed (``--work DIR`` keeps the run directories, for ``offloadctl report``), and the JSON holds
what was measured.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time

import _runs
from _runs import Stop, TierRuns, applied_changes, count_lines, free_port, on_signal, read_records, tuner_changes
from rich.console import Console
from rich.progress import Progress
from rich.table import Table

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
console = Console(stderr=True)
WHO = "tuner_contention"


def fail(msg: str) -> None:
    _runs.fail(WHO, msg)


class Bench(TierRuns):
    """What the bench started and made (:class:`_runs.TierRuns`), with the contention's readers."""

    def __init__(self, args) -> None:
        super().__init__(WHO, args.tiers_tool)
        self.args = args

    def tiers(self) -> dict:
        return super().tiers(self.args.tier_spec.split(), {"nvme", "pfs"})

    def write_file(self, tier: str, mib: int) -> str:
        return super().write_file(tier, mib, "tuner-contention")

    def fresh_dir(self, tier: str) -> str:
        return super().fresh_dir(tier, "tuner-contention")

    def readers(self, path: str) -> subprocess.Popen:
        loop = f'while :; do dd if="{path}" iflag=direct bs=8M of=/dev/null status=none || exit 1; done'
        script = " & ".join([f"( {loop} )"] * self.args.readers) + " & wait"
        return self.start(["bash", "-c", script], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)

    def read_bw(self, path: str) -> float:
        """One O_DIRECT reader's bandwidth (MB/s) in the tiers' cgroup over ``--bw-seconds``."""
        return self.dd_rate(path, self.args.bw_seconds)


# -- one run ---------------------------------------------------------------------------------


def one_run(bench: Bench, work: str, name: str, tuned: bool, reader_file: str, progress: Progress, task) -> dict:
    a = bench.args
    d = os.path.join(work, name)
    os.makedirs(d)
    run_dir, out, summary = os.path.join(d, "run"), os.path.join(d, "times.json"), os.path.join(d, "summary.json")
    nvme, pfs = bench.fresh_dir("nvme"), bench.fresh_dir("pfs")
    model = ["--width", str(a.width), "--layers", str(a.layers), "--sub-group-size", str(a.sub_group_size or a.width**2)]
    cmd = [
        "env",
        f"XDG_STATE_HOME={os.path.join(d, 'state')}",
        f"PYTHONPATH={ROOT}",
        sys.executable,
        "-m",
        "offloadctl.cli",
        "train",
        "--num_gpus",
        "1",
        "--master_port",
        str(free_port()),
        "--nvme",
        nvme,
        "--remote",
        pfs,
        "--host-cache",
        "0",
        "--prefetch-depth",
        "2",
        "--io-backend",
        a.io_backend,
        "--tuner",
        "auto" if tuned else "off",
        "--run-dir",
        run_dir,
        "--json-summary",
        summary,
        os.path.join(HERE, "ds_model.py"),
        *model,
        "--iters",
        str(a.iters),
        "--out",
        out,
    ]
    readers = bench.readers(reader_file) if a.readers else None
    t0 = time.monotonic()
    with open(os.path.join(d, "train.log"), "w") as log:
        p = bench.start(cmd, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT)
        tel = os.path.join(run_dir, "telemetry-rank0.jsonl")
        while p.poll() is None:
            if time.monotonic() - t0 > a.run_timeout:
                bench.kill(p)
                break
            done = count_lines(tel)
            progress.update(task, description=f"{name}: iteration {done}/{a.iters}")
            time.sleep(0.5)
        bench.kill(p)
    if readers is not None:
        bench.kill(readers, signal.SIGKILL)
    wall = time.monotonic() - t0
    for path in (nvme, pfs):
        shutil.rmtree(path, ignore_errors=True)
    if p.returncode != 0 or not os.path.exists(out):
        why = "timed out" if wall > a.run_timeout else f"exited {p.returncode}"
        fail(f"{name} {why}; its output: {os.path.join(d, 'train.log')} (--work keeps it)")
    with open(out) as f:
        iters = json.load(f)["iter_s"]
    with open(summary) as f:
        s = json.load(f)
    applied = applied_changes(read_records(tel))
    changes = tuner_changes(os.path.join(run_dir, "tuner"))
    t = s.get("tuner") or {}
    r = {
        "name": name,
        "tuned": tuned,
        "wall_s": wall,
        "iter_s": iters,
        "median_last_s": statistics.median(iters[-a.last :]),
        "summary_median_s": s.get("median_iteration_s"),
        "status": s.get("status"),
        "applied_changes": applied,
        "tuner_changes": changes,
        "undid": sum(c["reason"].startswith("undid") for c in changes),
        "net_changes": t.get("changes", []),
        "final_knobs": t.get("knobs"),
        "verdict": {"mode": t.get("mode"), "reason": t.get("reason")} if tuned else None,
        "bottleneck": s.get("bottleneck"),
        "bytes_per_param": s.get("bytes_per_param_total"),
        "other_processes_disk_bytes_per_param": s.get("other_processes_disk_bytes_per_param_total"),
    }
    r["verdict_agrees"] = _agrees(r) if tuned else None
    return r


def _agrees(r: dict) -> bool | None:
    """Whether a holding verdict matches the knobs it ended with: 'no move could ...' with knobs
    moved from the start, or 'after N kept moves' with none moved, do not. None: nothing to check."""
    reason, moved = (r["verdict"] or {}).get("reason") or "", bool(r["net_changes"])
    m = re.search(r"after (\d+) kept move", reason)
    if m:
        return moved
    if "no move could" in reason:
        return not moved
    return None


# -- the bench -------------------------------------------------------------------------------


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--runs", type=int, default=3, help="pairs of tuned and frozen runs (default 3)")
    ap.add_argument("--iters", type=int, default=30, help="iterations per run (default 30)")
    ap.add_argument("--last", type=int, default=10, help="last iterations whose median is reported (default 10; at most --iters)")
    ap.add_argument("--layers", type=int, default=9, help="bench/ds_model.py layers (default 9)")
    ap.add_argument("--width", type=int, default=2400, help="bench/ds_model.py width (default 2400)")
    ap.add_argument("--sub-group-size", type=int, default=0, help="ZeRO-3 sub_group_size (default width^2: a layer)")
    ap.add_argument("--readers", type=int, default=3, help="competing O_DIRECT readers on nvme (default 3; 0: none)")
    ap.add_argument("--reader-file-mb", type=int, default=1024, help="size of the file they read (default 1024)")
    ap.add_argument("--bw-seconds", type=float, default=3.0, help="length of each bandwidth measurement (default 3)")
    ap.add_argument("--io-backend", choices=["auto", "aio", "posix"], default="auto")
    ap.add_argument("--run-timeout", type=float, default=900, help="seconds before a run is stopped (default 900)")
    ap.add_argument("--tiers-tool", default=_runs.default_tiers_tool())
    ap.add_argument("--tier-spec", default="nvme:4:400:400 pfs:4:200:200", help="for `tiers up` when none is up")
    ap.add_argument("--work", help="keep the runs' directories here (default: a temporary directory, removed)")
    ap.add_argument("--json", help="write the results here")
    a = ap.parse_args()
    _runs.check_can_run(WHO, a.tiers_tool)
    if a.runs < 1 or a.iters < 2 or a.last < 1:
        fail("--runs and --last must be >= 1, --iters >= 2")
    a.last = min(a.last, a.iters)

    for s in (signal.SIGINT, signal.SIGTERM):
        signal.signal(s, on_signal)
    bench = Bench(a)
    work = os.path.abspath(a.work) if a.work else tempfile.mkdtemp(prefix="tuner-contention-")
    os.makedirs(work, exist_ok=True)
    res: dict = {"args": vars(a), "work": work if a.work else None, "runs": [], "pairs": []}
    code = 0
    try:
        res["tiers"] = bench.tiers()
        reader_file = bench.write_file("nvme", a.reader_file_mb)
        probe_pfs = bench.write_file("pfs", 512)
        bw: dict = {}
        with console.status("the tiers' read bandwidth, alone and beside the readers"):
            for tier, f in (("nvme", reader_file), ("pfs", probe_pfs)):
                bw[tier] = {"alone_MBps": bench.read_bw(f)}
            if a.readers:
                rd = bench.readers(reader_file)
                time.sleep(1.0)
                for tier, f in (("nvme", reader_file), ("pfs", probe_pfs)):
                    bw[tier]["beside_readers_MBps"] = bench.read_bw(f)
                bench.kill(rd, signal.SIGKILL)
        res["read_bandwidth"] = bw
        console.print(
            "read bandwidth (one dd, MB/s): "
            + "; ".join(
                f"{t} {v['alone_MBps']:.0f} alone"
                + (f", {v['beside_readers_MBps']:.0f} beside {a.readers} readers" if "beside_readers_MBps" in v else "")
                for t, v in bw.items()
            ),
            highlight=False,
        )
        with Progress(console=console, transient=True) as progress:
            task = progress.add_task("runs", total=2 * a.runs)
            for i in range(a.runs):
                pair = {}
                for tuned in (True, False) if i % 2 == 0 else (False, True):
                    name = f"{'tuned' if tuned else 'frozen'}-{i + 1}"
                    r = one_run(bench, work, name, tuned, reader_file, progress, task)
                    res["runs"].append(r)
                    pair["tuned" if tuned else "frozen"] = r
                    progress.advance(task)
                    _save(a, res)
                res["pairs"].append(
                    {
                        "pair": i + 1,
                        "tuned_s": pair["tuned"]["median_last_s"],
                        "frozen_s": pair["frozen"]["median_last_s"],
                        "frozen_over_tuned": pair["frozen"]["median_last_s"] / pair["tuned"]["median_last_s"],
                    }
                )
        tuned = [r["median_last_s"] for r in res["runs"] if r["tuned"]]
        frozen = [r["median_last_s"] for r in res["runs"] if not r["tuned"]]
        res["overall"] = {
            "tuned_median_s": statistics.median(tuned),
            "frozen_median_s": statistics.median(frozen),
            "frozen_over_tuned": statistics.median(frozen) / statistics.median(tuned),
            "worst_pair": min(p["frozen_over_tuned"] for p in res["pairs"]),
        }
    except Stop as e:
        console.print(f"tuner_contention: stopped by signal {e.signum}; cleaning up", highlight=False)
        res["stopped_by"] = e.signum
        code = 128 + e.signum
    finally:
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        bench.cleanup()
        if not a.work:
            shutil.rmtree(work, ignore_errors=True)
        _save(a, res)
    _print(a, res)
    return code


def _save(a, res: dict) -> None:
    if a.json:
        with open(a.json, "w") as f:
            json.dump(res, f, indent=1)


def _print(a, res: dict) -> None:
    if not res["runs"]:
        return
    t = Table(title=f"{a.readers} O_DIRECT readers on nvme; --host-cache 0 --prefetch-depth 2")
    for c in ("run", f"median of last {a.last}", "summary median", "knob changes", "undid", "verdict agrees"):
        t.add_column(c)
    for r in res["runs"]:
        t.add_row(
            r["name"],
            f"{r['median_last_s']:.3f} s",
            f"{r['summary_median_s'] or 0:.3f} s",
            str(len(r["applied_changes"])),
            str(r["undid"]) if r["tuned"] else "",
            {True: "yes", False: "[red]no[/red]", None: "-"}[r["verdict_agrees"]],
        )
    console.print(t)
    for r in res["runs"]:
        for c in r["tuner_changes"]:
            console.print(f"{r['name']} it {c['iteration']} (applied at {c['apply_at']}): {c['reason']}", highlight=False)
        if r["tuned"]:
            v = r["verdict"]
            console.print(f"{r['name']} verdict: {v['mode']} ({v['reason']})", highlight=False)
    for p in res["pairs"]:
        console.print(
            f"pair {p['pair']}: frozen {p['frozen_s']:.3f} s / tuned {p['tuned_s']:.3f} s = {p['frozen_over_tuned']:.2f}x",
            highlight=False,
        )
    if "overall" in res:
        o = res["overall"]
        console.print(
            f"overall: frozen {o['frozen_median_s']:.3f} s / tuned {o['tuned_median_s']:.3f} s = "
            f"[bold]{o['frozen_over_tuned']:.2f}x[/bold] (worst pair {o['worst_pair']:.2f}x; the issue's "
            "worst: 0.82x)",
            highlight=False,
        )


if __name__ == "__main__":
    sys.exit(main())
