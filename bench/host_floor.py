"""Issue 45 item 1: offloadctl against stock ZeRO-3 CPU offload with all state in host memory, in
interleaved pairs, at 1 and 2 ranks and on two model shapes, recording and the tuner on.

    .venv/bin/python bench/host_floor.py                       # 3 pairs, 10 iterations, ranks 1 2, cpu cpu-deep
    .venv/bin/python bench/host_floor.py --pairs 4 --ranks 2 --sizes cpu --json out.json

Each pair runs the same unmodified script (``bench/gpt_zero3.py --size S``: bf16, AdamW,
``gradient_clipping`` 1.0, ``offload_optimizer: cpu``, ``sub_group_size`` 2e7) twice, one run
after the other, in an order that alternates from pair to pair:

- stock: ``deepspeed --num_gpus R bench/gpt_zero3.py ...``;
- ours: ``offloadctl train --num_gpus R --tuner auto bench/gpt_zero3.py ...`` (recording on, the
  tuner a private daemon with an empty history per run, in a state directory of its own).

On the CPU accelerator a "GPU" is a rank on its share of the cores. Figures: the medians over
iterations 3..N of rank 0's step (``engine.step()``) and whole iteration; per pair stock / ours
(above 1: ours is faster). The goal: both at least 1.0 in the median of the pairs and never
below 0.95 in a pair; losses 1-3 equal to stock's. The physical limit in the same run: host
memory bandwidth as an update sees it (an in-place ``mul_`` of 512 MiB of fp32 on every core,
bytes read plus written, the best of 4, before the pairs: a copy into a second buffer runs at
about 40% of it on this VM), and from it the update's floor per rank, the bytes a step must move
in host memory (28 B a parameter: fp32 state read and written, the bf16 gradient read, the bf16
weight written) at that bandwidth shared by the node's ranks.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import tempfile
import time

import psutil

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, HERE)
sys.path.insert(0, ROOT)
from gpu_vs_stock import PORT, SCRIPT, run_row, summarize  # noqa: E402

BYTES_PER_PARAM = 28  # engine.host_kernel.HOST_LANE_BYTES_PER_PARAM: what the update must move
SUB_GROUP_SIZE = "20000000"


def commands(size: str, ranks: int, ours_opts: list[str]) -> dict[str, list[str]]:
    script = [SCRIPT, "--size", size, "--sub-group-size", SUB_GROUP_SIZE, "--offload", "cpu"]
    return {
        "stock": [sys.executable, "-m", "deepspeed.launcher.runner", "--num_gpus", str(ranks), "--master_port", PORT, *script],
        "ours": [
            sys.executable,
            "-m",
            "offloadctl.cli",
            "train",
            "--num_gpus",
            str(ranks),
            "--master_port",
            PORT,
            "--tuner",
            "auto",
            *ours_opts,
            *script,
        ],
    }


def memory_bandwidth(nbytes: int = 512 << 20, reps: int = 4) -> float:
    """Bytes/s (read plus written) of an in-place update on every core: AdamW's state is read and
    written in place."""
    import torch

    torch.set_num_threads(psutil.cpu_count(logical=True) or 1)
    x = torch.ones(nbytes // 4, device="cpu")  # host memory is what is measured: where ZeRO-3's offloaded state lives
    best = 0.0
    for _ in range(reps):
        t0 = time.perf_counter()
        x.mul_(1.0000001)
        best = max(best, 2 * nbytes / (time.perf_counter() - t0))
    return best


def run_pairs(size: str, ranks: int, args: argparse.Namespace, work: str, out: dict, save) -> dict:
    pairs, iters, timeout_s = args.pairs, args.iters, args.run_timeout
    cmds = commands(size, ranks, args.ours_opt)
    key = f"{size} x{ranks}"
    cell = out["cells"].setdefault(key, {"size": size, "ranks": ranks, "pairs": []})
    for k in range(pairs):
        order = ("stock", "ours") if k % 2 == 0 else ("ours", "stock")
        pair = {"order": list(order)}
        for name in order:
            state = tempfile.mkdtemp(prefix=f"host-floor-{name}-", dir=work)
            os.environ["XDG_STATE_HOME"] = state  # ours: a tuner history of its own, empty
            t0 = time.time()
            rec = run_row(cmds[name], iters, work, f"{key} {name} {k}", timeout_s)
            s = summarize(rec)
            s["wall_s"] = time.time() - t0
            s["load_average"] = os.getloadavg()[0]
            s.pop("iter_s_all", None)
            pair[name] = s
            print(
                f"{key} pair {k + 1} {name}: "
                + (
                    f"step {s['step_s']:.4f} s, iteration {s['iteration_s']:.4f} s"
                    if "step_s" in s
                    else f"failed: {s.get('failed')}"
                ),
                flush=True,
            )
        if "step_s" in pair["stock"] and "step_s" in pair["ours"]:
            pair["step_ratio"] = pair["stock"]["step_s"] / pair["ours"]["step_s"]
            pair["iteration_ratio"] = pair["stock"]["iteration_s"] / pair["ours"]["iteration_s"]
            pair["losses_equal"] = [round(x, 4) for x in pair["stock"]["losses_1_3"]] == [
                round(x, 4) for x in pair["ours"]["losses_1_3"]
            ]
        cell["pairs"].append(pair)
        save()
    done = [p for p in cell["pairs"] if "step_ratio" in p]
    for what in ("step", "iteration"):
        r = [p[f"{what}_ratio"] for p in done]
        cell[f"{what}_ratio_median"] = statistics.median(r) if r else None
        cell[f"{what}_ratio_min"] = min(r) if r else None
        cell[f"{what}_goal_met"] = bool(r) and statistics.median(r) >= 1.0 and min(r) >= 0.95
    params = next((p["ours"]["params"] for p in done), None)
    if params and out.get("memory_bytes_per_s"):
        cell["params"] = params
        cell["update_floor_s"] = params / ranks * BYTES_PER_PARAM / (out["memory_bytes_per_s"] / ranks)
    save()
    return cell


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--pairs", type=int, default=3)
    ap.add_argument("--iters", type=int, default=10, help="iterations per run; medians over 3..N (default 10)")
    ap.add_argument("--ranks", type=int, nargs="+", default=[1, 2])
    ap.add_argument("--sizes", nargs="+", default=["cpu", "cpu-deep"], help="bench/gpt_zero3.py sizes")
    ap.add_argument("--run-timeout", type=float, default=600)
    ap.add_argument("--json", help="write the figures here (after every run)")
    ap.add_argument(
        "--ours-opt", action="append", default=[], metavar="OPT", help="an option of ours' `offloadctl train`, repeatable"
    )
    args = ap.parse_args()
    out: dict = {
        "machine": {
            "cpu": platform.processor() or platform.machine(),
            "cores": psutil.cpu_count(),
            "memory_bytes": psutil.virtual_memory().total,
        },
        "command": " ".join(sys.argv),
        "started": time.strftime("%Y-%m-%d %H:%M:%S"),
        "cells": {},
    }

    def save() -> None:
        if args.json:
            with open(args.json, "w") as f:
                json.dump(out, f, indent=1)

    out["memory_bytes_per_s"] = memory_bandwidth()
    print(
        f"host memory bandwidth (in-place update, read + written, {psutil.cpu_count()} threads): "
        f"{out['memory_bytes_per_s'] / 1e9:.1f} GB/s",
        flush=True,
    )
    work = tempfile.mkdtemp(prefix="host-floor-")
    for size in args.sizes:
        for ranks in args.ranks:
            run_pairs(size, ranks, args, work, out, save)
    print()
    print(
        "| shape, ranks | pairs (stock / ours: step; iteration) | step median (min) | iteration median (min) "
        "| update floor | losses |"
    )
    print("| --- | --- | --- | --- | --- | --- |")
    for key, c in out["cells"].items():
        done = [p for p in c["pairs"] if "step_ratio" in p]
        pairs = ", ".join(f"{p['step_ratio']:.2f}; {p['iteration_ratio']:.2f}" for p in done)
        floor = f"{c['update_floor_s'] * 1e3:.0f} ms" if c.get("update_floor_s") else "-"
        step_ms = ", ".join(f"{p['ours']['step_s'] * 1e3:.0f}/{p['stock']['step_s'] * 1e3:.0f}" for p in done)
        print(
            f"| {key} | {pairs} (ours/stock step ms: {step_ms}) | {c['step_ratio_median']:.2f} "
            f"({c['step_ratio_min']:.2f}) | {c['iteration_ratio_median']:.2f} ({c['iteration_ratio_min']:.2f}) "
            f"| {floor} | {'equal' if all(p['losses_equal'] for p in done) else 'DIFFER'} |"
            if done
            else f"| {key} | no complete pair | | | | |"
        )
    out["ended"] = time.strftime("%Y-%m-%d %H:%M:%S")
    save()
    return 0 if all(c.get("step_goal_met") and c.get("iteration_goal_met") for c in out["cells"].values()) else 1


if __name__ == "__main__":
    sys.exit(main())
