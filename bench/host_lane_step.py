"""The host lane's update against stock ZeRO-3's step, in one process, interleaved (issue 35, item 11;
issue 47 item 1: the lane with each kernel).

    .venv/bin/python bench/host_lane_step.py 8        # rounds (after one warm-up round)
    .venv/bin/python bench/host_lane_step.py 8 --threads 1 2 --busy 0 1

The partition of bench/gpt_zero3.py --size cpu at sub_group_size 2e7 (about 9e7 parameters, here 3
subgroups of 3e7), bf16 weights and gradients in host memory, gradients unscaled by 0.5 (clipping
engaged). Medians over rounds of:

- the host lane driven by one thread (2^21-element chunks, every op a parallel region of all the
  process's OpenMP threads): what the engine ran before issue 35;
- the host lane as it runs now (each of the lane's threads its own part, 2^19-element chunks);
- the host lane with DeepSpeed's ``cpu_adam`` kernel, driven by one thread (how the engine runs it:
  its op holds the interpreter lock for the whole call, so the lane's threads could not run its
  parts at once), and, to show that, the same kernel forced into per-thread parts;
- stock ZeRO-3's step on the same partition: its fp32 gradient (upcast in backward, not timed here)
  unscaled by one mul_, DeepSpeedCPUAdam on the whole subgroup, the master copied into the bf16 weights.

One process and interleaved rounds, so that whatever else runs on the machine weighs on all of
them. ``--threads`` repeats the rounds at each torch thread count; ``--busy K`` also runs them
with K busy processes beside (each a spinning loop, as another tenant's or the launcher's work on
the rank's cores), where a lane whose every op is a parallel region waits for a descheduled thread
at every barrier.
"""

from __future__ import annotations

import argparse
import multiprocessing
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from engine.adamw import AdamWHyper, AdamWSlices, DeepSpeedCpuAdam, adamw_update_torch_  # noqa: E402
from engine.binding import FlatSubgroup  # noqa: E402
from engine.buffers import StateBuffer  # noqa: E402
from engine.host_lane import HostLane, LaneThreads, WeightUploader  # noqa: E402
from engine.streams import streams_for  # noqa: E402

SUBGROUP_NUMEL = 30_000_000  # elements per subgroup
SUBGROUPS = 3
GRAD_SCALE = 0.5  # DeepSpeed's 1 / combined scale with clipping engaged
HOST = torch.device("cpu")  # the host lane and DeepSpeedCPUAdam update state in host memory: what is measured


def _spin() -> None:
    while True:
        pass


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("rounds", type=int, nargs="?", default=8, help="timed rounds, after one warm-up (default 8)")
    ap.add_argument(
        "--threads",
        type=int,
        nargs="+",
        default=[torch.get_num_threads()],
        help="torch thread counts to run the rounds at (default this process's)",
    )
    ap.add_argument("--busy", type=int, nargs="+", default=[0], help="busy processes beside, per set of rounds (default 0)")
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
        stock.append(
            (
                g16.float(),
                torch.rand(n, generator=gen, device=HOST),
                torch.zeros(n, device=HOST),
                torch.zeros(n, device=HOST),
                torch.zeros(n, dtype=torch.bfloat16, device=HOST),
            )
        )
    host = streams_for(HOST)
    before = HostLane("torch", adamw_update_torch_, WeightUploader(host))
    before._threads = None  # one thread drives the chunks, every op a parallel region: as before issue 35
    now = HostLane("torch", adamw_update_torch_, WeightUploader(host))
    ds = DeepSpeedCpuAdam()
    ds_lane = HostLane("deepspeed", ds, WeightUploader(host))  # as the engine runs it: one driver thread
    ds_parts = HostLane("deepspeed", DeepSpeedCpuAdam(), WeightUploader(host))
    ds_parts._threads = LaneThreads()  # forced into parts: the op holds the interpreter lock
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

    variants = {
        "torch kernel, one driver (2^21 chunks)": lambda: lane(before),
        "torch kernel, per-thread parts (engine)": lambda: lane(now),
        "cpu_adam kernel, one driver (engine)": lambda: lane(ds_lane),
        "cpu_adam kernel, forced into parts": lambda: lane(ds_parts),
        "stock step (DeepSpeedCPUAdam)": stock_step,
    }
    ctx = multiprocessing.get_context("fork")
    for threads in args.threads:
        torch.set_num_threads(threads)
        for busy in args.busy:
            spinners = [ctx.Process(target=_spin, daemon=True) for _ in range(busy)]
            for sp in spinners:
                sp.start()
            try:
                times: dict[str, list[float]] = {k: [] for k in variants}
                for r in range(args.rounds + 1):
                    for k, f in variants.items():
                        t0 = time.perf_counter()
                        f()
                        if r:  # round 0 warms up: first touches, the lanes' threads
                            times[k].append(time.perf_counter() - t0)
            finally:
                for sp in spinners:
                    sp.kill()
                    sp.join()
            stock_s = statistics.median(times["stock step (DeepSpeedCPUAdam)"])
            print(f"threads {threads}, busy processes beside {busy}:")
            for k, v in times.items():
                med = statistics.median(v)
                print(
                    f"  {k:42s} median {1e3 * med:5.0f} ms  (min {1e3 * min(v):.0f}, max {1e3 * max(v):.0f}, "
                    f"{len(v)} rounds; {SUBGROUPS * SUBGROUP_NUMEL / med / 1e6:4.0f} M params/s; "
                    f"stock / this {stock_s / med:.2f})"
                )
    for h in (now, ds_parts):
        h.close()


if __name__ == "__main__":
    main()
