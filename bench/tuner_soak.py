"""Tuner daemon soak: 64 well-behaved clients for 10 minutes with hostile ones mixed in.

    .venv/bin/python bench/tuner_soak.py                      # 64 clients x 10 msg/s x 600 s
    .venv/bin/python bench/tuner_soak.py --duration 60        # a shorter run
    .venv/bin/python bench/tuner_soak.py --check --json       # exit 1 if a goal is missed

The well-behaved clients are bench/tuner_load.py's (ranks of 4-rank runs, one telemetry message
each every 100 ms: iterations ten times shorter than any offloaded training's, replies timed,
knob changes applied). bench/tuner_load.py measures the daemon's peak rate instead. Beside them, one process keeps attacking
the same daemon, in turns, all the while:

- slow clients: a frame header sent one byte a second (dropped at the frame deadline);
- garbage: random bytes, a frame header of 2 GiB, JSON that is not an object, unknown types;
- a flood of connections closed at once (50 a second);
- schema-valid extremes: a 5e-324 s update moving 2**60 bytes, and numbers past the bounds;
- huge runs: a registration with 64 paths of 4000 characters, every 20 s, then gone.

Reported: the good clients' response times (goal p99 < 50 ms, none dropped or disconnected),
the daemon's RSS after the first minute and at the end (goal: growth < 20 MB), its open file
descriptors before the load and after every client left (goal: back to the start), and the
tracebacks in its log (goal: none).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing as mp
import os
import queue
import random
import shutil
import struct
import subprocess
import sys
import tempfile
import threading
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from tuner_load import P99_GOAL_S, _pct, worker  # noqa: E402

from tuner.protocol import API_VERSION, Connection, encode  # noqa: E402

RSS_GROWTH_GOAL_BYTES = 20 << 20


def _frame(obj) -> bytes:
    body = json.dumps(obj).encode()
    return struct.pack(">I", len(body)) + body


async def _hostile(sock: str, stop: threading.Event, counts: dict) -> None:
    rng = random.Random(7)

    async def slow():
        r, w = await asyncio.open_unix_connection(sock)
        try:
            for b in struct.pack(">I", 100):
                w.write(bytes([b]))
                await w.drain()
                await asyncio.sleep(1.0)
            await asyncio.sleep(30)
        except (ConnectionError, OSError):
            pass
        finally:
            w.close()

    async def garbage():
        for payload in (
            os.urandom(rng.randint(1, 512)),
            struct.pack(">I", 1 << 31),
            _frame([1, 2, 3]),
            _frame({"v": API_VERSION, "type": "nonsense", "id": 1}),
            b"\x00\x00\x00\x00",
        ):
            try:
                r, w = await asyncio.open_unix_connection(sock)
                w.write(payload)
                await w.drain()
                await asyncio.wait_for(r.read(4096), 2)
                w.close()
            except (ConnectionError, OSError, asyncio.TimeoutError):
                pass

    async def flood():
        for _ in range(50):
            try:
                r, w = await asyncio.open_unix_connection(sock)
                w.close()
            except (ConnectionError, OSError):
                pass
            await asyncio.sleep(0.02)

    async def extremes(k: int):
        run = f"hostile-extreme-{k}"
        try:
            r, w = await asyncio.open_unix_connection(sock)
            w.write(encode({"v": API_VERSION, "type": "hello", "id": 0, "api": API_VERSION, "role": "engine"}))
            w.write(
                encode(
                    {
                        "v": API_VERSION,
                        "type": "register",
                        "id": 1,
                        "run_id": run,
                        "rank": 0,
                        "world_size": 1,
                        "params": 1000,
                        "paths": ["/x"],
                        "knobs": {},
                        "has_device": False,
                        "subgroup_bytes": 12288,
                    }
                )
            )
            rec = {
                "iteration": 1,
                "update_s": 5e-324,
                "read_wait_s": 0.0,
                "kernel_s": 0.0,
                "write_wait_s": 0.0,
                "path_bytes_read": {"/x": 1 << 60},
            }
            w.write(
                encode({"v": API_VERSION, "type": "telemetry", "id": 2, "run_id": run, "rank": 0, "iteration": 1, "record": rec})
            )
            bad = dict(rec, iteration=2, path_bytes_read={"/x": 10**300})
            w.write(
                _frame({"v": API_VERSION, "type": "telemetry", "id": 3, "run_id": run, "rank": 0, "iteration": 2, "record": bad})
            )
            await w.drain()
            await asyncio.sleep(0.5)
            w.write(encode({"v": API_VERSION, "type": "bye", "run_id": run, "rank": 0}))
            await w.drain()
            w.close()
        except (ConnectionError, OSError):
            pass

    async def huge(k: int):
        try:
            r, w = await asyncio.open_unix_connection(sock)
            w.write(encode({"v": API_VERSION, "type": "hello", "id": 0, "api": API_VERSION, "role": "engine"}))
            w.write(
                encode(
                    {
                        "v": API_VERSION,
                        "type": "register",
                        "id": 1,
                        "run_id": f"hostile-huge-{k}",
                        "rank": 0,
                        "world_size": 1,
                        "params": 1000,
                        "paths": [f"/{i:02d}" + "p" * 3990 for i in range(64)],
                        "knobs": {},
                        "has_device": False,
                        "subgroup_bytes": 12288,
                    }
                )
            )
            await w.drain()
            await asyncio.sleep(1.0)
            w.close()  # gone without bye: the daemon keeps it a while for a reconnect
        except (ConnectionError, OSError):
            pass

    slow_tasks: set[asyncio.Task] = set()
    k = 0
    last_huge = 0.0
    while not stop.is_set():
        k += 1
        if len(slow_tasks) < 8:
            t = asyncio.ensure_future(slow())
            slow_tasks.add(t)
            t.add_done_callback(slow_tasks.discard)
        await garbage()
        await flood()
        await extremes(k)
        if time.monotonic() - last_huge > 20:
            last_huge = time.monotonic()
            await huge(k)
            counts["huge"] += 1
        counts["rounds"] += 1
        await asyncio.sleep(0.2)
    for t in slow_tasks:
        t.cancel()


def _hostile_thread(sock: str, stop: threading.Event, counts: dict) -> threading.Thread:
    t = threading.Thread(target=lambda: asyncio.run(_hostile(sock, stop, counts)), daemon=True)
    t.start()
    return t


def _rss(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    return 0


def _fds(pid: int) -> int:
    return len(os.listdir(f"/proc/{pid}/fd"))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--clients", type=int, default=64)
    ap.add_argument("--rate", type=float, default=10.0, help="messages per second per client (default 10)")
    ap.add_argument("--keep-log", metavar="FILE", help="copy the daemon's log here")
    ap.add_argument("--duration", type=float, default=600.0)
    ap.add_argument("--procs", type=int, default=min(8, os.cpu_count() or 1))
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--check", action="store_true")
    args = ap.parse_args(argv)

    tmp = tempfile.mkdtemp(prefix="offloadctl-soak-")
    sock = os.path.join(tmp, "d", "tuner.sock")
    os.makedirs(os.path.dirname(sock), mode=0o700)
    log_path = os.path.join(tmp, "daemon.log")
    daemon = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "offloadctl.cli",
            "tuner",
            "serve",
            "--socket",
            sock,
            "--db",
            "none",
            "--no-sensors",
            "--log-level",
            "warning",
        ],
        cwd=ROOT,
        stderr=open(log_path, "w"),
    )
    deadline = time.time() + 60
    while not os.path.exists(sock):
        if daemon.poll() is not None or time.time() > deadline:
            sys.exit(f"the daemon did not start: see {log_path}")
        time.sleep(0.05)
    time.sleep(0.5)
    fds_start, rss_start = _fds(daemon.pid), _rss(daemon.pid)

    clients, paths_of = [], {}
    for c in range(args.clients):
        run = f"soak-{c // 4}"
        clients.append((run, c % 4, 4))
        paths_of[run] = [os.path.join(tmp, run, "nvme0"), os.path.join(tmp, run, "nvme1")]
    for p in {p for ps in paths_of.values() for p in ps}:
        os.makedirs(p, exist_ok=True)
    ctx = mp.get_context("fork")
    results, go_on = ctx.Queue(), ctx.Event()
    start_at = time.time() + 1.0
    procs = [
        ctx.Process(
            target=worker, args=(sock, clients[k :: args.procs], args.rate, args.duration, start_at, paths_of, results, go_on)
        )
        for k in range(args.procs)
    ]
    for p in procs:
        p.start()
    stop, counts = threading.Event(), {"rounds": 0, "huge": 0}
    hostile = _hostile_thread(sock, stop, counts)
    rss_warm, rss_series = None, []
    parts = []
    end = start_at + args.duration + 120
    while len(parts) < len(procs) and time.time() < end:
        try:
            parts.append(results.get(timeout=5))
        except queue.Empty:
            pass
        rss_series.append((time.time() - start_at, _rss(daemon.pid)))
        if rss_warm is None and time.time() - start_at > 60:
            rss_warm = rss_series[-1][1]
    stop.set()
    hostile.join(40)
    with Connection(sock, timeout_s=30) as c:
        snap = c.request("snapshot", history=0)
    go_on.set()
    for p in procs:
        p.join(30)
    # Every client has said bye: the daemon's descriptors should come back to where they started.
    settle = time.time() + 15
    while _fds(daemon.pid) > fds_start and time.time() < settle:
        time.sleep(0.2)
    rss_end, fds_end = _rss(daemon.pid), _fds(daemon.pid)
    daemon.terminate()
    daemon.wait(10)
    log_text = open(log_path).read()
    if args.keep_log:
        shutil.copy(log_path, args.keep_log)
    shutil.rmtree(tmp, ignore_errors=True)

    lat = sorted(x for part in parts for x in part["latencies"])
    good = {r["run_id"]: r for r in snap["runs"] if r["run_id"].startswith("soak-")}
    dropped = [r for r in paths_of if r not in good or good[r]["connected"] != 4]
    result = {
        "clients": args.clients,
        "rate_per_client": args.rate,
        "duration_s": args.duration,
        "hostile_rounds": counts["rounds"],
        "hostile_huge_runs": counts["huge"],
        "replies": len(lat),
        "p50_ms": 1e3 * _pct(lat, 50),
        "p99_ms": 1e3 * _pct(lat, 99),
        "max_ms": 1e3 * lat[-1] if lat else None,
        "unanswered": sum(p["unanswered"] for p in parts),
        "good_runs_dropped": len(dropped) + (len(procs) - len(parts)),
        "good_clients_disconnected": sum(p["disconnected"] for p in parts),
        "rss_start_mb": rss_start / 2**20,
        "rss_after_1min_mb": (rss_warm or rss_start) / 2**20,
        "rss_end_mb": rss_end / 2**20,
        "rss_growth_mb": (rss_end - (rss_warm or rss_start)) / 2**20,
        "fds_start": fds_start,
        "fds_end": fds_end,
        "tracebacks_in_log": log_text.count("Traceback"),
        "log_bytes": len(log_text),
    }
    ok = (
        result["p99_ms"] < P99_GOAL_S * 1e3
        and not result["good_runs_dropped"]
        and not result["good_clients_disconnected"]
        and rss_end - (rss_warm or rss_start) < RSS_GROWTH_GOAL_BYTES
        and fds_end == fds_start
        and result["tracebacks_in_log"] == 0
    )
    result["goal_met"] = ok
    if args.json:
        print(json.dumps(result, indent=2))
    else:
        for k, v in result.items():
            print(f"{k}: {v:.2f}" if isinstance(v, float) else f"{k}: {v}")
    return 1 if args.check and not ok else 0


if __name__ == "__main__":
    raise SystemExit(main())
