"""What the swap files' checksums cost the host lane, and what leaving them a core buys.

With state on storage, the I/O threads take a CRC32 of every chunk read and written while the
host lane's OpenMP threads run AdamW. This measures, in one run on this machine:

- zlib's CRC32 on one core (bytes/s): the checksums' CPU cost per byte of swap traffic;
- the host lane's own loop (``engine.host_kernel.time_host_lane``, each kernel) on all of this
  process's threads, alone and beside one thread checksumming 8 MB chunks without pause;
- the same on one thread fewer (what ``EngineConfig.io_cores=1`` gives it in a swapped step),
  alone and beside the checksum thread.

    .venv/bin/python bench/io_cores.py [--numel 16777216] [--reps 5] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import threading
import time
import zlib

import torch
from rich.console import Console
from rich.table import Table

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from engine.adamw import host_kernels  # noqa: E402
from engine.host_kernel import time_host_lane  # noqa: E402

CHUNK = 8 << 20  # the engine's I/O chunk (EngineConfig.io_chunk_bytes)


def _host_chunk() -> memoryview:
    """One I/O chunk of host memory: the engine checksums its staging buffers on the CPU, so
    this stays on the CPU on a GPU machine too."""
    return memoryview(torch.ones(CHUNK, dtype=torch.uint8, device="cpu").numpy())


def crc_rate(seconds: float = 1.0) -> float:
    buf = _host_chunk()
    t0, n = time.perf_counter(), 0
    while time.perf_counter() - t0 < seconds:
        zlib.crc32(buf)
        n += CHUNK
    return n / (time.perf_counter() - t0)


def lane_rates(numel: int, reps: int, with_crc: bool) -> tuple[dict[str, float], float]:
    """Host lane params/s per kernel, and the checksum thread's bytes/s meanwhile (0 without it)."""
    buf = _host_chunk()
    stop, done = threading.Event(), [0]

    def checksum() -> None:
        while not stop.is_set():
            zlib.crc32(buf)
            done[0] += CHUNK

    th = threading.Thread(target=checksum, daemon=True)
    t0 = time.perf_counter()
    if with_crc:
        th.start()
    try:
        rates = time_host_lane(host_kernels(), numel, reps)
    finally:
        stop.set()
        if with_crc:
            th.join()
    return rates, done[0] / (time.perf_counter() - t0)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--numel", type=int, default=1 << 24)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--json", metavar="FILE")
    args = ap.parse_args()
    threads = torch.get_num_threads()
    out = {
        "cores": len(os.sched_getaffinity(0)),
        "threads": threads,
        "crc32_bytes_per_s_one_core": crc_rate(),
        "command": " ".join(sys.argv),
        "rows": [],
    }
    for t in sorted({threads, max(1, threads - 1)}, reverse=True):
        torch.set_num_threads(t)
        for with_crc in (False, True):
            rates, crc = lane_rates(args.numel, args.reps, with_crc)
            out["rows"].append({"threads": t, "checksum_thread": with_crc, "lane_params_per_s": rates, "crc_bytes_per_s": crc})
    torch.set_num_threads(threads)
    tab = Table(
        "host lane threads",
        "checksum thread",
        *(f"{k} params/s" for k in out["rows"][0]["lane_params_per_s"]),
        "CRC GB/s meanwhile",
        title=f"host lane beside checksums ({out['cores']} cores)",
    )
    for r in out["rows"]:
        tab.add_row(
            str(r["threads"]),
            "yes" if r["checksum_thread"] else "no",
            *(f"{v:.3g}" for v in r["lane_params_per_s"].values()),
            f"{r['crc_bytes_per_s'] / 1e9:.2f}" if r["checksum_thread"] else "-",
        )
    c = Console()
    c.print(
        f"zlib CRC32, one core: {out['crc32_bytes_per_s_one_core'] / 1e9:.2f} GB/s "
        f"({1e9 / out['crc32_bytes_per_s_one_core']:.2f} core-seconds per GB of swap traffic)"
    )
    c.print(tab)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
