"""Stock ZeRO-Infinity's aio settings tuned on the emulated "nvme" tier: the anchor of bench/io_overlap.py.

Needs root (emulated tiers; without it the run says so and exits 0):

    .venv/bin/python bench/zi_aio_sweep.py          # writes bench/results/zi_aio_sweep.json

1. DeepSpeed's own I/O sweep, ``ds_nvme_tune`` (which runs ``ds_io`` with DeepSpeed's async_io
   handle, O_DIRECT), over block_size x queue_depth x io_parallel, reads and writes of ``--io-size``
   each (``--loops`` timed passes after one warm-up), on the "nvme" tier throttled to 400/400 MB/s,
   all under ``tiers.sh run``. Points ``ds_nvme_tune`` leaves out are run with ``ds_io`` directly;
   ``--logs DIR`` keeps the logs, and a later run with it measures only what is not there.
   The aio choice is the point with the highest read + write throughput; points within ``--tie`` of
   it count as ties, and the smallest block size among those wins (then the highest sum).
2. A short grid of the offload ``buffer_count`` (pipelined read and write on) with that aio setting:
   bench/ds_model.py ``--offload nvme`` (92M parameters, one rank), ``--iters`` iterations each; the
   fastest median step (iterations 3 on) is the choice. Today's anchor setting (DeepSpeed's aio
   defaults, ``buffer_count`` 16, as bench/vs_zero_infinity.py runs it) is run beside the grid and
   can win too, so the tuned anchor is never slower than the untuned one.

If DeepSpeed's async_io op does not load here, step 1 falls back to ``ds_io --engine torch_io``
(writes only; DeepSpeed has no read path without async_io) and step 2 is skipped: ZeRO-Infinity's
nvme offload needs async_io. The JSON says so.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import statistics
import sys
import tempfile
import threading
import time
from datetime import datetime, timezone

from rich.console import Console
from rich.progress import Progress
from rich.table import Table

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, ROOT)
from bench import _runs  # noqa: E402
from bench._runs import RunFailed, can_emulate, run_one, run_under_tiers, tiers, tiers_root, use_own_tiers  # noqa: E402

TIERS_NAME = "ovl-tiers"
"""This benchmark's and bench/io_overlap.py's tiers: /mnt/ovl-tiers, cgroup ovl-tiers (bench/tiers.sh)."""

NVME_MBPS = 400
BLOCKS = ("128K", "256K", "1M", "4M", "8M")
DEPTHS = (4, 8, 16, 32)
PARALLEL = (1, 2)
BUFFER_COUNTS = (4, 8, 16)
DS_DEFAULT = {"block_size": 1 << 20, "queue_depth": 8, "intra_op_parallelism": 1, "buffer_count": 16}
"""DeepSpeed's aio defaults with the buffer_count bench/ds_model.py has always used."""
GIB_MB = (1 << 30) / 1e6  # ds_io reports GB/sec in GiB
MASTER_PORT = "29747"
OUT = os.path.join(HERE, "results", "zi_aio_sweep.json")
BIN = os.path.dirname(sys.executable)
console = Console(stderr=True)


def size_bytes(s: str) -> int:
    units = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}
    return int(s[:-1]) * units[s[-1]] if s[-1] in units else int(s)


def log_name(op: str, block: str, depth: int, par: int) -> str:
    """The log file name ds_nvme_tune gives a point (deepspeed.nvme.perf_run_sweep.get_log_file)."""
    return f"{op}_block_overlap_ftd1_d{depth}_bs{block}_p{par}.txt"


_SPEED = {
    "read": re.compile(r"^E2E Read Speed = ([0-9.e+-]+) GB/sec", re.M),
    "write": re.compile(r"^E2E Write Speed = ([0-9.e+-]+) GB/sec", re.M),
}


def parse_log(text: str, op: str) -> float | None:
    """MB/s (1e6 bytes) of a ds_io log, from its 'E2E <op> Speed' line (GiB/s), or None."""
    m = _SPEED[op].search(text)
    return float(m.group(1)) * GIB_MB if m else None


def pick_aio(points: list[dict], tie: float) -> dict:
    """The aio setting with the highest read + write MB/s; settings within ``tie`` (a fraction) of the
    best are ties, won by the smallest block size, then the highest sum."""
    sums = {}
    for p in points:
        key = (p["block_size"], p["queue_depth"], p["io_parallel"])
        if p["MBps"] is None:
            continue
        sums.setdefault(key, {})[p["op"]] = p["MBps"]
    both = {k: v["read"] + v["write"] for k, v in sums.items() if "read" in v and "write" in v}
    if not both:
        raise ValueError("no sweep point has both a read and a write figure")
    best = max(both.values())
    ties = [k for k, s in both.items() if s >= (1 - tie) * best]
    k = min(ties, key=lambda k: (k[0], -both[k]))
    return {
        "block_size": k[0],
        "queue_depth": k[1],
        "intra_op_parallelism": k[2],
        "read_MBps": sums[k]["read"],
        "write_MBps": sums[k]["write"],
        "sum_MBps": both[k],
        "best_sum_MBps": best,
        "ties": len(ties),
    }


def async_io_state() -> tuple[bool, str]:
    """Whether DeepSpeed's async_io op loads here (built ahead, libaio present), and why not."""
    import engine.storage.native_ops as ops  # pins TORCH_EXTENSIONS_DIR and ninja for us and ds_io

    st = ops.op_state("async_io")  # compiles nothing
    return st.state == "built", f"DeepSpeed async_io: {st.state} ({st.detail})"


def run_ds_sweep(args, folder: str, log_dir: str, engine_ok: bool, progress: Progress) -> tuple[dict, list[str]]:
    """ds_nvme_tune over the grid (unless ``log_dir`` holds every point already), then ds_io for whatever
    points it left out. Returns DeepSpeed's own pick from the logs, and notes."""
    notes: list[str] = []
    ops = ("read", "write") if engine_ok else ("write",)
    grid = [(op, b, d, p) for op in ops for b in args.blocks for d in args.depths for p in args.parallel]
    task = progress.add_task("ds_io sweep", total=len(grid))
    logs = {"read": os.path.join(log_dir, "_aio_bench_read_logs"), "write": os.path.join(log_dir, "_aio_bench_write_logs")}
    done_flag = threading.Event()

    def count() -> int:
        return sum(os.path.exists(os.path.join(logs[op], log_name(op, b, d, p))) for op, b, d, p in grid)

    def watch():
        while not done_flag.wait(2):
            progress.update(task, completed=count())

    ds_pick: dict = {}
    if engine_ok and count() == len(grid):
        notes.append(f"all {len(grid)} points were logged already in {log_dir}: ds_nvme_tune not run again")
    elif engine_ok:
        cfg = os.path.join(log_dir, "sweep_config.json")
        with open(cfg, "w") as f:
            json.dump({"block_size": list(args.blocks), "queue_depth": list(args.depths), "io_parallel": list(args.parallel)}, f)
        progress.update(task, description="ds_nvme_tune")
        t = threading.Thread(target=watch, daemon=True)
        t.start()
        try:
            p = run_under_tiers(
                [
                    os.path.join(BIN, "ds_nvme_tune"),
                    "--nvme_dir",
                    folder,
                    "--sweep_config",
                    cfg,
                    "--io_size",
                    args.io_size,
                    "--loops",
                    str(args.loops),
                    "--log_dir",
                    log_dir,
                ],
                cwd=log_dir,
            )
        finally:
            done_flag.set()
            t.join()
        ds_pick["ds_nvme_tune_output_tail"] = [ln for ln in p.stdout.splitlines() if not ln.startswith("tid ")][-12:]
        if p.returncode != 0:
            notes.append(
                f"ds_nvme_tune exited {p.returncode} (last stderr: {p.stderr.strip().splitlines()[-1:]}); "
                "missing points run with ds_io directly"
            )
    else:
        notes.append("async_io unavailable: ds_io --engine torch_io, writes only")
    for op, b, d, par in grid:
        path = os.path.join(logs[op], log_name(op, b, d, par))
        if os.path.exists(path) and parse_log(open(path).read(), op) is not None:
            continue
        progress.update(task, description=f"ds_io {op} {b} qd{d} p{par}")
        os.makedirs(logs[op], exist_ok=True)
        cmd = [
            os.path.join(BIN, "ds_io"),
            "--folder",
            folder,
            "--io_size",
            args.io_size,
            "--loops",
            str(args.loops),
            "--block_size",
            b,
            "--queue_depth",
            str(d),
            "--io_parallel",
            str(par),
            "--engine",
            "aio_handle" if engine_ok else "torch_io",
            *(["--read"] if op == "read" else []),
        ]
        p = run_under_tiers(cmd, cwd=log_dir)
        with open(path, "w") as f:
            f.write(p.stdout + p.stderr)
        progress.update(task, completed=count())
    progress.update(task, completed=len(grid))
    if engine_ok:
        ds_pick.update(deepspeed_pick(log_dir))
    return ds_pick, notes


def deepspeed_pick(log_dir: str) -> dict:
    """What DeepSpeed's own generator (the last step of ds_nvme_tune) makes of the logs: its aio
    block, strict max of read + write (its figures are GiB/s rounded to 2 decimals)."""
    import contextlib
    import io

    from deepspeed.nvme.perf_generate_param import generate_main

    buf = io.StringIO()
    try:
        with contextlib.redirect_stdout(buf):
            generate_main(log_dir)
    except Exception as e:  # noqa: BLE001 -- its asserts, a missing log: say so, the sweep stands
        return {"error": f"{type(e).__name__}: {e}"}
    m = re.search(r"Best performance \(GB/sec\): read = *([0-9.]+), write = *([0-9.]+)\s*(\{.*\})", buf.getvalue(), re.S)
    if not m:
        return {"error": f"unexpected output: {buf.getvalue()[-300:]}"}
    return {"read_MBps": float(m.group(1)) * GIB_MB, "write_MBps": float(m.group(2)) * GIB_MB, **json.loads(m.group(3))}


def collect(args, log_dir: str) -> list[dict]:
    points = []
    for op in ("read", "write"):
        for b in args.blocks:
            for d in args.depths:
                for par in args.parallel:
                    path = os.path.join(log_dir, f"_aio_bench_{op}_logs", log_name(op, b, d, par))
                    mbps = parse_log(open(path).read(), op) if os.path.exists(path) else None
                    points.append(
                        {"op": op, "block": b, "block_size": size_bytes(b), "queue_depth": d, "io_parallel": par, "MBps": mbps}
                    )
    return points


def zi_build(aio: dict, port: str = MASTER_PORT):
    """bench/ds_model.py as stock ZeRO-Infinity on the "nvme" tier with ``aio`` (block_size,
    queue_depth, intra_op_parallelism, buffer_count)."""
    return lambda d, out, it: [
        "-m",
        "deepspeed.launcher.runner",
        "--num_gpus",
        "1",
        "--master_port",
        port,
        os.path.join(HERE, "ds_model.py"),
        "--offload",
        "nvme",
        "--nvme-path",
        d["nvme"],
        *zi_model_args(aio),
        *_runs.MODEL_ARGS,
        "--iters",
        it,
        "--out",
        out,
    ]


def zi_model_args(aio: dict) -> list[str]:
    return [
        "--aio-block-size",
        str(aio["block_size"]),
        "--aio-queue-depth",
        str(aio["queue_depth"]),
        "--aio-intra-op",
        str(aio["intra_op_parallelism"]),
        "--buffer-count",
        str(aio["buffer_count"]),
    ]


def _last_error(text: str) -> str:
    """The telling line of a failed run's stderr: the last exception line (an assert's source line before
    a bare AssertionError)."""
    lines = [ln.removeprefix("[rank0]:").strip() for ln in text.splitlines()]
    lines = [ln for ln in lines if ln.strip("^~ ")]  # no empty lines, no caret lines under the source
    for i in range(len(lines) - 1, -1, -1):
        if re.match(r"^\w*(Error|Exception)\b", lines[i]):
            return f"{lines[i - 1]} -> {lines[i]}" if lines[i] in ("AssertionError",) and i else lines[i]
    return lines[-1] if lines else "failed"


def med_from(xs: list[float], start: int = 2) -> float:
    """Median of iterations ``start + 1`` on (all of them when there are not that many)."""
    return statistics.median(xs[start:] if len(xs) > start else xs)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--io-size", default="400M", help="bytes per ds_io read or write (default 400M)")
    ap.add_argument("--loops", type=int, default=2, help="timed ds_io passes after the warm-up (default 2)")
    ap.add_argument("--blocks", type=lambda s: tuple(s.split(",")), default=BLOCKS)
    ap.add_argument("--depths", type=lambda s: tuple(int(x) for x in s.split(",")), default=DEPTHS)
    ap.add_argument("--parallel", type=lambda s: tuple(int(x) for x in s.split(",")), default=PARALLEL)
    ap.add_argument("--buffer-counts", type=lambda s: tuple(int(x) for x in s.split(",")), default=BUFFER_COUNTS)
    ap.add_argument("--iters", type=int, default=4, help="ds_model.py iterations per buffer_count run (default 4)")
    ap.add_argument("--tie", type=float, default=0.02, help="read+write sums within this fraction of the best tie (0.02)")
    ap.add_argument("--logs", metavar="DIR", help="keep ds_io's logs in DIR; points already logged there are not run again")
    ap.add_argument("--json", metavar="FILE", default=OUT, help=f"where the results go (default {os.path.relpath(OUT, ROOT)})")
    args = ap.parse_args(argv)
    why = can_emulate()
    if why:
        console.print(f"skipping: {why}")
        return 0
    use_own_tiers(TIERS_NAME)
    engine_ok, engine_note = async_io_state()
    console.print(engine_note)
    started = datetime.now(timezone.utc).isoformat(timespec="seconds")
    log_dir = args.logs or tempfile.mkdtemp(prefix="zi-aio-sweep-")
    os.makedirs(log_dir, exist_ok=True)
    result = {
        "when": started,
        "command": " ".join([os.path.relpath(sys.argv[0], ROOT), *sys.argv[1:]]),
        "tier": {"name": "nvme", "read_MBps": NVME_MBPS, "write_MBps": NVME_MBPS, "emulation": "bench/tiers.sh"},
        "engine": "aio_handle" if engine_ok else "torch_io",
        "async_io": engine_ok,
        "async_io_note": engine_note,
        "io_size": args.io_size,
        "loops": args.loops,
        "tie": args.tie,
        "grid_iters": args.iters,
    }
    os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)

    def save(**more) -> None:
        result.update(more)
        with open(args.json, "w") as f:
            json.dump(result, f, indent=2)

    grid_rows: list[dict] = []
    with tiers(f"nvme:6:{NVME_MBPS}:{NVME_MBPS}"), Progress(console=console) as progress:
        folder = tempfile.mkdtemp(dir=f"{tiers_root()}/nvme")
        try:
            t0 = time.perf_counter()
            ds_pick, notes = run_ds_sweep(args, folder, log_dir, engine_ok, progress)
            sweep_s = time.perf_counter() - t0
        finally:
            shutil.rmtree(folder, ignore_errors=True)
        points = collect(args, log_dir)
        aio = pick_aio(points, args.tie) if engine_ok else None
        save(
            sweep_seconds=round(sweep_s, 1),
            points=points,
            aio_choice=aio,
            deepspeed_pick=ds_pick,
            strict_best=pick_aio(points, 0.0) if engine_ok else None,
            notes=notes,
            partial="ds_io sweep only; the buffer_count grid did not finish",
        )
        if engine_ok:
            rows = [{**aio, "buffer_count": bc} for bc in args.buffer_counts]
            if not any(all(r[k] == DS_DEFAULT[k] for k in DS_DEFAULT) for r in rows):
                rows.append({**DS_DEFAULT, "reference": "DeepSpeed aio defaults, buffer_count 16 (today's anchor)"})
            task = progress.add_task("buffer_count grid", total=len(rows))
            for r in rows:
                setting = {k: r[k] for k in DS_DEFAULT}
                progress.update(task, description=f"ZeRO-Infinity {setting}")
                row = {**setting, **({"reference": r["reference"]} if "reference" in r else {})}
                try:
                    times = run_one(zi_build(setting), str(args.iters))
                    row.update(step_s=med_from(times["step_s"]), iter_s=med_from(times["iter_s"]), times=times)
                except RunFailed as e:  # e.g. too few buffers for pipelined swapping: a point that does not run
                    row.update(step_s=None, iter_s=None, error=_last_error(str(e.code)))
                grid_rows.append(row)
                progress.advance(task)
        else:
            notes.append("buffer_count grid skipped: ZeRO-Infinity's nvme offload needs async_io")
    ran = [r for r in grid_rows if r["step_s"] is not None]
    if ran:
        best = min(ran, key=lambda r: r["step_s"])
        choice = {k: best[k] for k in DS_DEFAULT}
    else:
        choice = dict(DS_DEFAULT)
        notes.append("choice: DeepSpeed's defaults (nothing measured to choose from)")
    choice.update(single_submit=False, overlap_events=True, pipeline_read=True, pipeline_write=True)
    result.pop("partial")
    save(buffer_grid=grid_rows, choice=choice, notes=notes)
    if not args.logs:
        shutil.rmtree(log_dir, ignore_errors=True)
    print_tables(result)
    return 0


def print_tables(result: dict) -> None:
    out = Console(width=150)
    by = {}
    for p in result["points"]:
        by.setdefault((p["block_size"], p["block"], p["queue_depth"], p["io_parallel"]), {})[p["op"]] = p["MBps"]
    t = Table(
        "block",
        "queue depth",
        "io_parallel",
        "read MB/s",
        "write MB/s",
        "read+write MB/s",
        title=f"ds_io on the emulated nvme tier ({result['tier']['read_MBps']}/{result['tier']['write_MBps']} MB/s), "
        f"{result['io_size']} x {result['loops']}, engine {result['engine']}",
    )
    aio = result["aio_choice"] or {}
    fmt = lambda v: f"{v:.0f}" if v is not None else "-"
    for (bs, b, d, par), v in sorted(by.items()):
        mark = " <" if (bs, d, par) == (aio.get("block_size"), aio.get("queue_depth"), aio.get("intra_op_parallelism")) else ""
        s = (v.get("read") or 0) + (v.get("write") or 0)
        t.add_row(b, str(d), str(par), fmt(v.get("read")), fmt(v.get("write")), f"{s:.0f}{mark}")
    out.print(t)
    if result["buffer_grid"]:
        g = Table(
            "block",
            "queue depth",
            "intra_op",
            "buffer_count",
            "step s (median)",
            "iteration s (median)",
            "",
            title=f"ZeRO-Infinity, bench/ds_model.py --offload nvme, {result['grid_iters']} iterations",
        )
        for r in result["buffer_grid"]:
            chosen = all(r[k] == result["choice"][k] for k in DS_DEFAULT)
            ok = r["step_s"] is not None
            g.add_row(
                str(r["block_size"]),
                str(r["queue_depth"]),
                str(r["intra_op_parallelism"]),
                str(r["buffer_count"]),
                f"{r['step_s']:.2f}" if ok else "failed",
                f"{r['iter_s']:.2f}" if ok else r["error"][:60],
                ("chosen " if chosen and ok else "") + ("(reference)" if "reference" in r else ""),
            )
        out.print(g)
    out.print(f"choice: {json.dumps(result['choice'])}")
    pick = {k: v for k, v in result["deepspeed_pick"].items() if k != "ds_nvme_tune_output_tail"}
    if pick:
        out.print(f"ds_nvme_tune's own pick (strict max of read+write, its figures in GiB/s to 2 decimals): {json.dumps(pick)}")
    for n in result["notes"]:
        out.print(f"note: {n}")


if __name__ == "__main__":
    raise SystemExit(main())
