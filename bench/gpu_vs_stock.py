"""offloadctl train against stock DeepSpeed on one GPU: the same unmodified ZeRO-3 script, interleaved.

    .venv/bin/python bench/gpu_vs_stock.py                      # GPU: sizes 2b and 4b
    .venv/bin/python bench/gpu_vs_stock.py --sizes 2b --iters 8 --json out.json
    .venv/bin/python bench/gpu_vs_stock.py --cpu                # no GPU: host lane vs stock CPU offload

The script is bench/gpt_zero3.py (bf16, AdamW, gradient_clipping 1.0, sub_group_size 1e8, all
tensors on the rank's device). Rows, per size, run one after the other in each round:

- stock, no offload (only where the state fits the GPU: 2b);
- stock ZeRO-3 CPU offload (``offload_optimizer: cpu``);
- stock Twin-Flow (``offload_optimizer.ratio``) at each ratio of a small sweep;
- offloadctl default: ``offloadctl train --profile P`` with P measured at the start of this run
  (``offloadctl profile save --quick``), device tier and device fraction ``auto``, tuner off;
- offloadctl with the device fraction forced to 0, 0.5 and 1 and no device tier.

Our rows run first (a run cut short keeps them). Per row: median iteration, step and
forward+backward over iterations 3..N, the first iteration, GPU peak memory, host peak RSS,
the losses of steps 1-3, and the performance model's predicted iteration (the measured profile
and the row's measured forward+backward).
The physical limits measured in the same run (the profile: pinned PCIe, duplex, GPU and CPU
AdamW rates) are printed with the table. ``--cpu`` runs the same script at a CPU size: stock
ZeRO-3 CPU offload against offloadctl's host lane.

``--report DIR`` adds a row: stock CPU offload again, under ``offloadctl train --engine stock``
(DeepSpeed's own optimizer, only recorded). Its iteration over the plain stock row's is the
recording's overhead in this run; its record and offloadctl default's go into one
``offloadctl report`` (DIR/report-SIZE.html, PNGs in DIR/png-SIZE, numbers in DIR/report-SIZE.json):
GPU memory, PCIe and the update's parts of both on one time axis.
"""
from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile

from rich.console import Console
from rich.table import Table

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
SCRIPT = os.path.join(HERE, "gpt_zero3.py")
console = Console(stderr=True)

# Twin-Flow ratios (share of the state on the CPU) swept per size; the smallest that fits wins.
TWINFLOW_RATIOS = {"2b": (0.1, 0.3), "4b": (0.5, 0.7), "cpu": ()}
NO_OFFLOAD_FITS = {"2b": True, "4b": False, "cpu": False}
FORCED_FRACTIONS = (0.0, 0.5, 1.0)


RECORDED_STOCK = "stock ZeRO-3 CPU offload, recorded"
REPORTED_OURS = {True: "offloadctl default", False: "offloadctl (host lane)"}


def _run_dir(workdir: str, name: str) -> str:
    return os.path.join(workdir, "run-" + "".join(c if c.isalnum() else "-" for c in name))


def rows_for(size: str, gpu: bool, profile: str | None, recorded: bool = False) -> list[tuple[str, list[str]]]:
    """(name, command) of every row for ``size``."""
    script = [SCRIPT, "--size", size] + (["--sub-group-size", "20000000"] if size == "cpu" else [])

    def stock(*opts):
        return [sys.executable, "-m", "deepspeed.launcher.runner", "--num_gpus", "1", "--master_port", "29741", *script,
                *opts]

    def ours(*opts):
        return [sys.executable, "-m", "offloadctl.cli", "train", "--num_gpus", "1", "--master_port", "29742",
                "--tuner", "off", *opts, *script]

    # Our rows first: a call cut short by the device's time limit still has them.
    rows: list[tuple[str, list[str]]] = []
    if gpu:
        rows.append(("offloadctl default", ours(*(["--profile", profile] if profile else []))))
        for f in FORCED_FRACTIONS:
            rows.append((f"offloadctl fraction {f:g}", ours("--device-fraction", str(f), "--device-cache", "0")))
    else:
        rows.append(("offloadctl (host lane)", ours()))
    if gpu and NO_OFFLOAD_FITS[size]:
        rows.append(("stock, no offload", stock("--offload", "none")))
    rows.append(("stock ZeRO-3 CPU offload", stock("--offload", "cpu")))
    if recorded:
        rows.append((RECORDED_STOCK, [sys.executable, "-m", "offloadctl.cli", "train", "--engine", "stock",
                                      "--num_gpus", "1", "--master_port", "29743", *script, "--offload", "cpu"]))
    if gpu:
        for r in TWINFLOW_RATIOS[size]:
            rows.append((f"stock Twin-Flow ratio {r:g}", stock("--offload", "twinflow", "--ratio", str(r))))
    return rows


def run_row(cmd: list[str], iters: int, workdir: str, name: str, timeout_s: float) -> dict:
    out = os.path.join(workdir, "row.json")
    if os.path.exists(out):
        os.unlink(out)
    run_dir = _run_dir(workdir, name)
    if "offloadctl.cli" in cmd:
        i = cmd.index("train") + 1
        cmd = cmd[:i] + ["--run-dir", run_dir] + cmd[i:]
    # A session of its own, so that a row past its time is killed whole (launcher and ranks).
    # Iteration 1 (not in the medians) traces backward's host-device copies (issue 18 item 8).
    p = subprocess.Popen([*cmd, "--iters", str(iters), "--out", out, "--trace-backward-at", "1"],
                         stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=ROOT, start_new_session=True,
                         env=dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", "")))
    try:
        output, _ = p.communicate(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        os.killpg(p.pid, signal.SIGKILL)
        p.communicate()
        return {"failed": f"over the row's {timeout_s:.0f} s limit"}
    if p.returncode != 0 or not os.path.exists(out):
        tail = [ln for ln in output.splitlines() if ln.strip()]
        why = next((ln for ln in reversed(tail) if "Error" in ln or "error" in ln), tail[-1] if tail else "no output")
        return {"failed": why[-300:]}
    with open(out) as f:
        rec = json.load(f)
    tel = os.path.join(run_dir, "telemetry-rank0.jsonl")
    if os.path.exists(tel):
        with open(tel) as f:
            rec["telemetry"] = [json.loads(line) for line in f]
    return rec


def summarize(rec: dict) -> dict:
    if "failed" in rec:
        return rec
    warm = slice(2, None) if len(rec["iter_s"]) > 3 else slice(1, None)
    med = lambda k: statistics.median(rec[k][warm])  # noqa: E731
    out = {"iteration_s": med("iter_s"), "step_s": med("step_s"), "fwd_bwd_s": med("fwd_bwd_s"),
           "first_iteration_s": rec["iter_s"][0], "losses_1_3": rec["loss"][:3], "params": rec["params"],
           "gpu_peak_reserved_bytes": rec["gpu_peak_reserved_bytes"], "host_peak_rss_bytes": rec["host_peak_rss_bytes"],
           "host_rss_bytes": rec["host_rss_bytes"], "init_s": rec["init_s"]}
    if "engine" in rec:
        out["engine"] = rec["engine"]
    if "backward_memcpy_bytes" in rec:
        out["backward_memcpy_bytes"] = rec["backward_memcpy_bytes"]
    if rec.get("telemetry"):
        t = rec["telemetry"][warm]
        out["update_breakdown"] = {k: statistics.median(r[k] for r in t) for k in
                                   ("update_s", "host_lane_s", "device_wait_s", "read_wait_s", "write_wait_s")}
        out["device_tier_subgroups"] = t[-1]["device_tier_subgroups"]
        out["device_lane_subgroups"] = t[-1]["device_lane_subgroups"]
        out["knobs"] = t[-1]["knobs"]
    return out


def predict(profile_path: str | None, name: str, s: dict) -> float | None:
    """The model's iteration for this row: the measured profile, the row's forward+backward."""
    if not profile_path or "failed" in s:
        return None
    from engine.config import Knobs
    from perf.model import Plan, Workload
    from perf.model import predict as model_predict
    from perf.profile_toml import load_profile
    from perf.stock import stock_deepspeed

    prof = load_profile(profile_path)
    fit = (s.get("engine") or {}).get("fit") or {}
    wl = Workload(params=s["params"], subgroup_numel=100_000_000, fwd_bwd_s=s["fwd_bwd_s"],
                  gpu_headroom_bytes=fit.get("headroom_bytes"))
    try:
        if name.startswith("stock ZeRO-3"):
            return stock_deepspeed(prof, wl, "zero3-cpu").iteration_s
        if name.startswith("stock Twin-Flow"):
            return stock_deepspeed(prof, wl, "twinflow", ratio=float(name.rsplit(" ", 1)[1])).iteration_s
        if name.startswith("stock, no offload"):
            return None
        knobs = s.get("knobs") or {}
        plan = Plan(host_cache_bytes=None, device_cache_bytes=int(fit.get("device_tier_bytes", 0) or 0),
                    knobs=Knobs(device_fraction=float(knobs.get("device_fraction", 0.0)), prefetch_depth=0))
        return model_predict(prof, wl, plan).iteration_s
    except Exception as e:  # a plan the model refuses: say so in the row, keep the bench going
        console.print(f"[yellow]{name}: no prediction ({e})[/yellow]")
        return None


def measure_profile(workdir: str, gpu: bool) -> str | None:
    path = os.path.join(workdir, "profile.toml")
    p = subprocess.run([sys.executable, "-m", "offloadctl.cli", "profile", "save", "bench-machine", "--quick",
                        "--output", path, "--force"], capture_output=True, text=True, cwd=ROOT)
    if p.returncode != 0:
        console.print(f"[yellow]profile save failed: {(p.stderr or p.stdout).strip().splitlines()[-1:]}[/yellow]")
        return None
    return path


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sizes", default="2b,4b", help="comma-separated sizes of bench/gpt_zero3.py (default 2b,4b)")
    ap.add_argument("--cpu", action="store_true", help="CPU-only mode: host lane vs stock CPU offload, size 'cpu'")
    ap.add_argument("--rounds", type=int, default=1)
    ap.add_argument("--iters", type=int, default=5, help="iterations per run; medians over 3..N (default 5)")
    ap.add_argument("--row-timeout", type=float, default=300, help="seconds a row may take before it is killed")
    ap.add_argument("--rows", help="comma-separated substrings: run only rows whose name contains one")
    ap.add_argument("--profile", help="use this profile instead of measuring one")
    ap.add_argument("--json", metavar="FILE", help="write every row's figures here")
    ap.add_argument("--report", metavar="DIR", help="add a recorded stock row and write offloadctl report of it "
                    "and offloadctl default into DIR")
    args = ap.parse_args()
    import torch

    gpu = torch.cuda.is_available() and not args.cpu
    sizes = ["cpu"] if not gpu else args.sizes.split(",")
    workdir = tempfile.mkdtemp(prefix="offloadctl-gpu-bench-")
    profile = args.profile or measure_profile(workdir, gpu)
    report: dict = {"machine": _machine(), "profile": _limits(profile), "sizes": {}}
    for size in sizes:
        rows = rows_for(size, gpu, profile, recorded=bool(args.report))
        if args.rows:
            keep = args.rows.split(",")
            rows = [r for r in rows if any(k in r[0] for k in keep)]
        results: dict[str, list[dict]] = {name: [] for name, _ in rows}
        for rnd in range(args.rounds):
            for name, cmd in rows:
                console.print(f"[dim]{size} round {rnd + 1}: {name}[/dim]")
                results[name].append(summarize(run_row(list(cmd), args.iters, workdir, name, args.row_timeout)))
                if args.json:  # as it goes: a call cut short keeps the rows it finished
                    report["sizes"][size] = results
                    _write(args.json, report)
        table = {}
        for name, runs in results.items():
            ok = [r for r in runs if "failed" not in r]
            if not ok:
                table[name] = runs[-1]
                continue
            best = min(ok, key=lambda r: r["iteration_s"])
            best["iteration_s_rounds"] = [r["iteration_s"] for r in ok]
            best["step_s_rounds"] = [r["step_s"] for r in ok]  # the step's noise between processes, per round
            best["predicted_iteration_s"] = predict(profile, name, best)
            table[name] = best
        report["sizes"][size] = table
        _print(size, table)
        if args.report:
            report.setdefault("report", {})[size] = write_report(args.report, size, workdir, table, gpu)
    if args.json:
        _write(args.json, report)
    return 0


def write_report(out: str, size: str, workdir: str, table: dict, gpu: bool) -> dict:
    """``offloadctl report`` of the recorded stock row and offloadctl's, and the recording's overhead."""
    os.makedirs(out, exist_ok=True)
    ours = REPORTED_OURS[gpu]
    names = [RECORDED_STOCK, ours]
    base = os.path.join(out, f"report-{size}")
    cmd = [sys.executable, "-m", "offloadctl.cli", "report", *(_run_dir(workdir, n) for n in names),
           "--label", "stock ZeRO-3 CPU offload", "--label", "offloadctl", "--output", base + ".html",
           "--png", os.path.join(out, f"png-{size}"), "--json"]  # one pass: HTML, PNGs and the numbers
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    p = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True)
    if p.returncode == 0:
        with open(base + ".json", "w") as f:
            f.write(p.stdout)
        console.print(f"report: {base}.html, PNGs in {out}/png-{size}, numbers in {base}.json")
    else:
        console.print(f"offloadctl report failed: {p.stderr[-1000:]}")
    plain, recorded = (table.get(n, {}).get("iteration_s") for n in ("stock ZeRO-3 CPU offload", RECORDED_STOCK))
    overhead = recorded / plain - 1 if plain and recorded else None
    if overhead is not None:
        console.print(f"recording overhead (stock, recorded over plain): {100 * overhead:+.1f}% of the iteration")
    return {"html": base + ".html", "rc": p.returncode, "recording_overhead": overhead}


def _write(path: str, report: dict) -> None:
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        json.dump(report, f, indent=1)
    os.replace(tmp, path)


def _print(size: str, table: dict) -> None:
    base = table.get("stock ZeRO-3 CPU offload", {}).get("iteration_s")
    t = Table(title=f"size {size}: medians of iterations 3..N")
    for c in ("row", "iteration s", "vs CPU offload", "step s", "fwd+bwd s", "first s", "GPU peak GB", "host RSS GB",
              "losses 1-3", "predicted s"):
        t.add_column(c)
    for name, r in table.items():
        if "failed" in r:
            t.add_row(name, "failed: " + r["failed"][-80:], *[""] * 8)
            continue
        pred = r.get("predicted_iteration_s")
        t.add_row(name, f"{r['iteration_s']:.3f}", f"{base / r['iteration_s']:.2f}x" if base else "-",
                  f"{r['step_s']:.3f}", f"{r['fwd_bwd_s']:.3f}", f"{r['first_iteration_s']:.2f}",
                  f"{r['gpu_peak_reserved_bytes'] / 1e9:.1f}", f"{r['host_peak_rss_bytes'] / 1e9:.1f}",
                  " ".join(f"{x:.4f}" for x in r["losses_1_3"]), f"{pred:.3f}" if pred else "-")
    Console().print(t)


def _machine() -> dict:
    import platform

    import psutil
    import torch

    return {"cpu": platform.processor() or platform.machine(), "cores": psutil.cpu_count(),
            "memory_bytes": psutil.virtual_memory().total, "torch": torch.__version__,
            "gpu": torch.cuda.get_device_name() if torch.cuda.is_available() else None}


def _limits(profile: str | None) -> dict:
    if not profile:
        return {}
    from perf.profile_toml import load_profile

    p = load_profile(profile)
    out = {"cpu_adamw_params_per_s": p.cpu_adamw_params_per_s(), "host_memory_bytes_per_s": p.host.memory_bandwidth.value}
    if p.gpu is not None:
        out.update(h2d=p.gpu.h2d_bytes_per_s.value, d2h=p.gpu.d2h_bytes_per_s.value,
                   duplex_h2d=p.gpu.duplex_h2d_bytes_per_s.value, duplex_d2h=p.gpu.duplex_d2h_bytes_per_s.value,
                   gpu_adamw_params_per_s=p.gpu.adamw_params_per_s.value)
    console.print("limits measured in this run: " + json.dumps({k: f"{v:.3g}" for k, v in out.items()}))
    return out


if __name__ == "__main__":
    raise SystemExit(main())
