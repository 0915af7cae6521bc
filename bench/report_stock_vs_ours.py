"""Stock ZeRO-Infinity against offloadctl on one emulated NVMe tier, recorded and reported side by side.

Needs root (emulated tiers; without it the run says so and exits 0):

    .venv/bin/python bench/report_stock_vs_ours.py                 # 6 iterations per run, 400/400 MB/s
    .venv/bin/python bench/report_stock_vs_ours.py --out runs/report-bench --iters 6

Both runs are bench/ds_model.py (92M parameters, ZeRO-3, one rank, CPU accelerator) under
``offloadctl train`` on the same throttled "nvme" tier: first ``--engine stock`` with the
script's own ZeRO-Infinity config (``--offload nvme --nvme-path``: DeepSpeed's optimizer and
swapper, untouched, only recorded), then offloadctl's engine with all state on the tier
(``--nvme``, no host cache). Then ``offloadctl report`` of both: OUT/report.html, OUT/png/,
OUT/report.json. Printed: bytes per parameter by phase (kernel counters of the tier's loop
device) and the median iteration of each run, from the report and from the script's own
timing. The tiers use their own names (``OFFLOADCTL_TIERS_*``), so other emulations on the
machine are left alone.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, ROOT)
from integrations.launcher import remove_shm_buffers  # noqa: E402

TIERS = os.path.join(HERE, "tiers.sh")
NAME = "offloadctl-report-bench"
ENV = dict(
    os.environ,
    PYTHONPATH=ROOT,
    OFFLOADCTL_TIERS_ROOT=f"/mnt/{NAME}",
    OFFLOADCTL_TIERS_IMG=f"/var/tmp/{NAME}",
    OFFLOADCTL_TIERS_CGROUP=NAME,
)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=os.path.join("runs", "report-bench"), help="output directory (default runs/report-bench)")
    ap.add_argument("--iters", type=int, default=6, help="iterations per run (default 6)")
    ap.add_argument("--mbps", type=int, default=400, help="the tier's read and write throttle, MB/s (default 400)")
    args = ap.parse_args()
    if os.geteuid() != 0:
        print("skipping: emulated tiers need root (loop devices, mounts, blkio cgroups)", file=sys.stderr)
        return 0
    out = os.path.abspath(args.out)
    shutil.rmtree(out, ignore_errors=True)
    os.makedirs(out)
    mnt = os.path.join(ENV["OFFLOADCTL_TIERS_ROOT"], "nvme")
    subprocess.run([TIERS, "up", f"nvme:8:{args.mbps}:{args.mbps}"], check=True, env=ENV)
    try:
        runs = {}
        for name, engine_opts, script_opts in (
            ("stock", ["--engine", "stock"], ["--offload", "nvme", "--nvme-path", os.path.join(mnt, "stock")]),
            ("ours", ["--nvme", os.path.join(mnt, "ours"), "--host-cache", "0", "--tuner", "off"], []),
        ):
            os.makedirs(os.path.join(mnt, name), exist_ok=True)
            run_dir = os.path.join(out, name)
            cmd = [
                TIERS,
                "run",
                sys.executable,
                "-m",
                "offloadctl.cli",
                "train",
                "--num_gpus",
                "1",
                "--master_port",
                "29741",
                "--run-dir",
                run_dir,
                *engine_opts,
                os.path.join(HERE, "ds_model.py"),
                "--iters",
                str(args.iters),
                "--out",
                os.path.join(out, f"{name}-times.json"),
                *script_opts,
            ]
            print("+ " + " ".join(cmd[2:]), file=sys.stderr, flush=True)
            remove_shm_buffers("29741")  # a run killed on this port leaves one, and the next would wait on it
            p = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT, env=ENV)
            with open(os.path.join(out, f"{name}.log"), "w") as f:
                f.write(p.stdout + p.stderr)
            if p.returncode != 0:
                print(p.stderr[-3000:], file=sys.stderr)
                return 1
            with open(os.path.join(out, f"{name}-times.json")) as f:
                runs[name] = json.load(f)
            shutil.rmtree(os.path.join(mnt, name), ignore_errors=True)
    finally:
        subprocess.run([TIERS, "down"], check=False, env=ENV, stdout=subprocess.DEVNULL)
    rep = subprocess.run(
        [
            sys.executable,
            "-m",
            "offloadctl.cli",
            "report",
            os.path.join(out, "stock"),
            os.path.join(out, "ours"),
            "--label",
            "ZeRO-Infinity (stock)",
            "--label",
            "offloadctl",
            "--output",
            os.path.join(out, "report.html"),
            "--png",
            os.path.join(out, "png"),
            "--json",
        ],
        capture_output=True,
        text=True,
        cwd=ROOT,
        env=ENV,
    )
    if rep.returncode != 0:
        print(rep.stderr, file=sys.stderr)
        return 1
    with open(os.path.join(out, "report.json"), "w") as f:
        f.write(rep.stdout)
    analysis = json.loads(rep.stdout)
    for r, name in zip(analysis["runs"], ("stock", "ours")):
        s = r["summary"]
        own = statistics.median(runs[name]["iter_s"][2:])
        print(
            f"{r['label']}: median iteration {s['median_iter_s']:.2f} s (the script's own timing, iterations 3..: "
            f"{own:.2f} s); disk B/param per iteration {s['disk_bytes_per_param_total']:.1f}"
        )
        for ph, tiers in s["disk_bytes_per_param"].items():
            for tier, rw in tiers.items():
                print(f"  {ph:9s} {tier}: read {rw['read']:.1f}, written {rw['written']:.1f} B/param")
        if "engine_bytes_per_param_total" in s:
            print(f"  engine's own count: {s['engine_bytes_per_param_total']:.1f} B/param")
    print(
        f"speed-up of offloadctl: {analysis['runs'][1]['summary']['speedup_vs_first']:.2f}x; "
        f"report: {os.path.join(out, 'report.html')}"
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
