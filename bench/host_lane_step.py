"""The host lane's update against stock ZeRO-3's step, in one process, interleaved (issue 35, item 11).

    .venv/bin/python bench/host_lane_step.py 8        # rounds (after one warm-up round)

The partition of bench/gpt_zero3.py --size cpu at sub_group_size 2e7 (about 9e7 parameters, here 3
subgroups of 3e7), bf16 weights and gradients in host memory, gradients unscaled by 0.5 (clipping
engaged). Medians over rounds of:

- the host lane driven by one thread (2^21-element chunks, every op a parallel region of all the
  process's OpenMP threads): what the engine ran before issue 35;
- the host lane as it runs now (each of the lane's threads its own part, 2^19-element chunks);
- stock ZeRO-3's step on the same partition: its fp32 gradient (upcast in backward, not timed here)
  unscaled by one mul_, DeepSpeedCPUAdam on the whole subgroup, the master copied into the bf16 weights.

One process and interleaved rounds, so that whatever else runs on the machine weighs on all three.
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from engine.adamw import AdamWHyper, AdamWSlices, DeepSpeedCpuAdam, adamw_update_torch_  # noqa: E402
from engine.binding import FlatSubgroup  # noqa: E402
from engine.buffers import StateBuffer  # noqa: E402
from engine.host_lane import HostLane, WeightUploader  # noqa: E402
from engine.streams import streams_for  # noqa: E402

SUBGROUP_NUMEL = 30_000_000  # elements per subgroup
SUBGROUPS = 3
GRAD_SCALE = 0.5  # DeepSpeed's 1 / combined scale with clipping engaged
HOST = torch.device("cpu")  # the host lane and DeepSpeedCPUAdam update state in host memory: what is measured


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("rounds", type=int, nargs="?", default=8, help="timed rounds, after one warm-up (default 8)")
    args = ap.parse_args()
    gen = torch.Generator().manual_seed(0)
    ours, stock = [], []
    for _ in range(SUBGROUPS):
        n = SUBGROUP_NUMEL
        g16 = torch.rand(n, generator=gen, device=HOST).to(torch.bfloat16)
        b = FlatSubgroup(torch.zeros(n, dtype=torch.bfloat16, device=HOST), g16)
        b.grad_scale = GRAD_SCALE
        buf = StateBuffer(n)
        buf.master.copy_(torch.rand(n, generator=gen, device=HOST))
        buf.exp_avg.zero_()
        buf.exp_avg_sq.zero_()
        ours.append((b, buf, [0]))
        stock.append((g16.float(), torch.rand(n, generator=gen, device=HOST), torch.zeros(n, device=HOST),
                      torch.zeros(n, device=HOST), torch.zeros(n, dtype=torch.bfloat16, device=HOST)))
    host = streams_for(HOST)
    before = HostLane("torch", adamw_update_torch_, WeightUploader(host))
    before._threads = None  # one thread drives the chunks, every op a parallel region: as before issue 35
    now = HostLane("torch", adamw_update_torch_, WeightUploader(host))
    ds = DeepSpeedCpuAdam()
    hp = AdamWHyper(lr=1e-6)
    step = [0]

    def lane(h: HostLane) -> None:
        for b, buf, steps in ours:
            h.update(buf, b, steps, hp)

    def stock_step() -> None:
        step[0] += 1
        for g, p, m, v, w in stock:
            g.mul_(GRAD_SCALE)  # unscale_and_clip_grads
            ds(AdamWSlices([p], [g], [m], [v], [torch.tensor(float(step[0]), device=HOST)]), hp)
            w.copy_(p)  # _reassign_or_swap_out_partitioned_parameters

    variants = {"host lane before (one thread, 2^21 chunks)": lambda: lane(before),
                "host lane now (per-thread parts)": lambda: lane(now),
                "stock step (DeepSpeedCPUAdam)": stock_step}
    times: dict[str, list[float]] = {k: [] for k in variants}
    for r in range(args.rounds + 1):
        for k, f in variants.items():
            t0 = time.perf_counter()
            f()
            if r:  # round 0 warms up: first touches
                times[k].append(time.perf_counter() - t0)
    for k, v in times.items():
        print(f"{k:44s} median {1e3 * statistics.median(v):5.0f} ms  "
              f"(min {1e3 * min(v):.0f}, max {1e3 * max(v):.0f}, {len(v)} rounds)")
    now.close()


if __name__ == "__main__":
    main()
