"""The host lane's rate per thread against its thread count, beside the memory's limit (issue 47, item 2).

    .venv/bin/python bench/host_lane_threads.py --threads 1 2 --rounds 5

One subgroup of ``--numel`` elements (default 2^24), bf16 weights and gradients in host memory,
gradients unscaled by 0.5, torch's fused kernel: the host lane as the engine runs it (one thread:
2^21-element chunks; more: each thread its own part, in 2^19- or 2^21-element chunks). Interleaved
rounds, medians. For each thread count:

- the lane's rate (elements a second), per thread, and the bytes it moves a second (28 B an element:
  the bf16 gradient read, the fp32 state read and written, the bf16 weights written);
- the physical limit measured in the same run at the same thread count: a large torch copy
  (``--copy-mib`` of fp32, read and written: 2 bytes moved a byte copied);
- the per-chunk costs the lane measures to choose its part chunk (``measure_chunk_costs``: the
  chunk's ops on 16 elements, and on a 2^19 chunk) and the share of a chunk's time that ``t``
  threads' per-chunk Python overhead takes (the interpreter lock's share, ``part_chunk_numel``'s
  rule), here and extrapolated to 8 and 16 threads.

``--json FILE`` writes the figures.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from engine import host_lane  # noqa: E402
from engine.adamw import AdamWHyper, adamw_update_torch_  # noqa: E402
from engine.binding import FlatSubgroup  # noqa: E402
from engine.buffers import StateBuffer  # noqa: E402
from engine.streams import streams_for  # noqa: E402

BYTES_PER_ELEMENT = 2 + 12 + 12 + 2  # bf16 gradient read, fp32 state read and written, bf16 weights written
HOST = torch.device("cpu")


def copy_rate(src: torch.Tensor, dst: torch.Tensor, reps: int = 3) -> float:
    """Bytes a second a large copy moves (read and written), the best of ``reps``."""
    best = min(_timed(lambda: dst.copy_(src)) for _ in range(reps))
    return 2 * src.numel() * src.element_size() / best


def _timed(f) -> float:
    t0 = time.perf_counter()
    f()
    return time.perf_counter() - t0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    ap.add_argument("--rounds", type=int, default=5, help="timed rounds, after one warm-up")
    ap.add_argument("--numel", type=int, default=1 << 24)
    ap.add_argument("--copy-mib", type=int, default=512)
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    caller_threads = torch.get_num_threads()
    gen = torch.Generator().manual_seed(0)
    n = args.numel
    # cpu ok: the host lane's buffers live in host memory on every machine; this bench times them there
    b = FlatSubgroup(torch.zeros(n, dtype=torch.bfloat16), torch.rand(n, generator=gen).to(torch.bfloat16))  # cpu ok
    b.grad_scale = 0.5
    buf = StateBuffer(n)
    buf.master.copy_(torch.rand(n, generator=gen))  # cpu ok
    buf.exp_avg.zero_()
    buf.exp_avg_sq.zero_()
    src = torch.rand(args.copy_mib << 18, generator=gen)  # MiB of fp32; cpu ok: host memory's bandwidth
    dst = torch.empty_like(src)
    hp = AdamWHyper(lr=1e-6)
    lane = host_lane.HostLane("torch", adamw_update_torch_, host_lane.WeightUploader(streams_for(HOST)))
    steps = [0]

    variants = []  # (threads, chunk)
    for t in args.threads:
        variants += [(t, host_lane.PART_CHUNK_NUMEL), (t, host_lane.LOCK_CHUNK_NUMEL)]

    def run(t: int, chunk: int) -> float:
        torch.set_num_threads(t)
        if t == 1:  # one thread drives the lane in HOST_CHUNK_NUMEL chunks: that chunk, set here
            host_lane.HOST_CHUNK_NUMEL = chunk
        else:  # the parts' chunk, as part_chunk_numel would choose it
            lane._threads.chunk_costs = (0.0, 1.0) if chunk == host_lane.PART_CHUNK_NUMEL else (1.0, 1e-3)
        try:
            return _timed(lambda: lane.update(buf, b, steps, hp))
        finally:
            host_lane.HOST_CHUNK_NUMEL = 1 << 21
            torch.set_num_threads(caller_threads)

    times: dict[tuple[int, int], list[float]] = {v: [] for v in variants}
    copies: dict[int, list[float]] = {t: [] for t in args.threads}
    for r in range(args.rounds + 1):
        for v in variants:
            s = run(*v)
            if r:
                times[v].append(s)
        for t in args.threads:
            torch.set_num_threads(t)
            c = copy_rate(src, dst)
            torch.set_num_threads(caller_threads)
            if r:
                copies[t].append(c)
    lane.close()
    # the lane's own measurement, on a thread of one (as the parts run)
    torch.set_num_threads(1)
    overhead_s, chunk_s = host_lane.measure_chunk_costs()
    torch.set_num_threads(caller_threads)
    out = {
        "numel": n,
        "cpu_count": os.cpu_count(),
        "torch_threads": caller_threads,
        "chunk_overhead_s": overhead_s,
        "part_chunk_s": chunk_s,
        "rows": [],
    }
    load = os.getloadavg()[0]
    out["loadavg_1min"] = load
    print(
        f"machine: {os.cpu_count()} CPUs, torch {torch.__version__}, subgroup {n} elements, "
        f"{args.rounds} rounds (medians), load average {load:.2f}"
    )
    print(f"per-chunk costs on one thread: {1e6 * overhead_s:.0f} us of calls (16 elements), {1e3 * chunk_s:.2f} ms a 2^19 chunk")
    print(
        f"{'threads':>7} {'chunk':>6} {'update ms':>9} {'Melem/s':>8} {'per thread':>10} {'lane GB/s':>9} "
        f"{'copy GB/s':>9} {'of copy':>7}"
    )
    for (t, chunk), v in times.items():
        s = statistics.median(v)
        rate = n / s
        copy = statistics.median(copies[t])
        row = {
            "threads": t,
            "chunk": chunk,
            "update_s": s,
            "elements_per_s": rate,
            "per_thread": rate / t,
            "lane_bytes_per_s": rate * BYTES_PER_ELEMENT,
            "copy_bytes_per_s": copy,
            "min_s": min(v),
            "max_s": max(v),
        }
        out["rows"].append(row)
        print(
            f"{t:7d} {'2^%d' % (chunk.bit_length() - 1):>6} {1e3 * s:9.1f} {rate / 1e6:8.1f} {rate / t / 1e6:10.1f} "
            f"{rate * BYTES_PER_ELEMENT / 1e9:9.2f} {copy / 1e9:9.2f} {rate * BYTES_PER_ELEMENT / copy:7.0%}"
        )
    out["lock_share"] = {}
    for t in sorted(set(args.threads) | {8, 16}):
        share = t * overhead_s / chunk_s
        out["lock_share"][t] = {"share_at_2^19": share, "chunk": host_lane.part_chunk_numel(t, overhead_s, chunk_s)}
        print(
            f"lock share at {t:2d} threads, 2^19 chunks: {share:6.1%} (limit {host_lane.LOCK_SHARE_LIMIT:.0%}): "
            f"part chunk 2^{host_lane.part_chunk_numel(t, overhead_s, chunk_s).bit_length() - 1}"
        )
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
