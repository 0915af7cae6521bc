"""What recording costs: iterations with the recorder on (the default 100 Hz) and off, alternating in one run.

    .venv/bin/python bench/record_overhead.py                      # 40 iterations, state in host memory
    .venv/bin/python bench/record_overhead.py --nvme /var/tmp/x    # with a storage tier (disk counters read too)

It starts itself under ``offloadctl train --tuner off`` as a DeepSpeed ZeRO-3 script: the model
of bench/ds_model.py (92M parameters, micro-batch 8, one rank, CPU accelerator). Iterations
alternate between recording on and suspended (``report.recorder.current().suspend()``:
hooks pass straight through, the sampler takes no samples), in ABBA order so that a drift in
the machine's load falls on both. Each iteration is timed by the script itself, not by the
recorder. Between separate runs the noise of a shared 2-core machine is several times the
effect; within one run, iteration by iteration, it mostly cancels. Reported: the median
iteration of each kind, the median of the paired ratios (on / off, neighbouring iterations),
and the recorder's own cost as it measured it (time in its hooks; its sampler thread's CPU time).
``--record-hz 0`` measures the phase hooks alone.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

HERE = os.path.abspath(__file__)
ROOT = os.path.dirname(os.path.dirname(HERE))


def launch(args) -> int:
    with tempfile.TemporaryDirectory(prefix="offloadctl-overhead-") as run_dir:
        out = os.path.join(run_dir, "overhead.json")
        tiers = ["--nvme", args.nvme, "--host-cache", "0"] if args.nvme else []
        cmd = [
            sys.executable,
            "-m",
            "offloadctl.cli",
            "train",
            "--num_gpus",
            "1",
            "--master_port",
            "29752",
            "--tuner",
            "off",
            "--record-hz",
            str(args.record_hz),
            "--run-dir",
            os.path.join(run_dir, "run"),
            *tiers,
            HERE,
            "--worker",
            "--iters",
            str(args.iters),
            "--out",
            out,
        ]
        p = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT, env=dict(os.environ, PYTHONPATH=ROOT))
        if p.returncode != 0:
            print(p.stderr[-3000:], file=sys.stderr)
            return 1
        with open(out) as f:
            res = json.load(f)
        lines = [json.loads(x) for x in open(os.path.join(run_dir, "run", "record-rank0.jsonl"))]
    its = [x for x in lines if x["type"] == "iteration"][1:]
    end = next(x for x in lines if x["type"] == "end")
    on_s = sum(res["on"])
    res["hooks_share"] = sum(x["recorder_s"] for x in its) / on_s
    res["sampler_cpu_share"] = end.get("sampler_busy_s", 0.0) / on_s
    res["sampler_rows"] = end.get("sampler_rows", 0)
    on, off = statistics.median(res["on"]), statistics.median(res["off"])
    print(f"iterations {len(res['on'])} on, {len(res['off'])} off (after 2 warm-up), alternating ABBA in one run")
    pairs = res["pair_ratios"]
    se = statistics.stdev(pairs) / len(pairs) ** 0.5
    print(
        f"median iteration: recording off {off:.3f} s, on {on:.3f} s; ratio {on / off:.4f}; paired ratios "
        f"(on / off, neighbours): mean {statistics.fmean(pairs):.4f} +- {se:.4f} (standard error), median "
        f"{statistics.median(pairs):.4f}"
    )
    print(
        f"recorder's own cost over the recorded iterations: hooks {100 * res['hooks_share']:.3f}% of their time; "
        f"sampler thread {100 * res['sampler_cpu_share']:.2f}% of one core ({res['sampler_rows']} samples)"
    )
    if args.json:
        res.update(command=" ".join(sys.argv), median_on_s=on, median_off_s=off)
        with open(args.json, "w") as f:
            json.dump(res, f, indent=1)
    return 0


def worker(args) -> int:
    import deepspeed
    import torch
    from deepspeed.accelerator import get_accelerator

    from report import recorder

    torch.manual_seed(0)
    width, layers = 3200, 9
    model = torch.nn.Sequential(*[torch.nn.Linear(width, width, bias=False) for _ in range(layers)])
    config = {
        "train_micro_batch_size_per_gpu": 8,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-4, "weight_decay": 0.01}},
        "zero_optimization": {"stage": 3, "sub_group_size": 10_000_000, "offload_optimizer": {"device": "cpu"}},
    }
    engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=config)
    rec = recorder.current()
    if rec is None:
        raise SystemExit("run this under offloadctl train with recording on (bench/record_overhead.py does)")
    device = get_accelerator().current_device_name()
    x, y = torch.randn(8, width, device=device), torch.randn(8, width, device=device)
    times: dict[bool, list[float]] = {True: [], False: []}
    order = []
    for k in range(args.iters + 2):
        on = k < 2 or (k - 2) % 4 in (0, 3)  # warm-up recorded, then ABBA: on off off on ...
        rec.suspend(not on)
        t0 = time.perf_counter()
        loss = torch.nn.functional.mse_loss(engine(x), y)
        engine.backward(loss)
        engine.step()
        dt = time.perf_counter() - t0
        if k >= 2:
            times[on].append(dt)
            order.append((on, dt))
    rec.suspend(False)
    pairs = [a[1] / b[1] if a[0] else b[1] / a[1] for a, b in zip(order[::2], order[1::2])]
    with open(args.out, "w") as f:
        json.dump({"on": times[True], "off": times[False], "pair_ratios": pairs}, f)
    return 0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--iters", type=int, default=40, help="measured iterations, half of each kind (default 40)")
    ap.add_argument("--nvme", help="a storage tier for the engine (default: state in host memory)")
    ap.add_argument(
        "--record-hz",
        type=float,
        default=100.0,
        help="the sampler's rate (default 100, as offloadctl train; 0: phase hooks only)",
    )
    ap.add_argument("--json", metavar="FILE")
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--out", help=argparse.SUPPRESS)
    ap.add_argument("--local_rank", type=int, default=0, help=argparse.SUPPRESS)
    args = ap.parse_args()
    return worker(args) if args.worker else launch(args)


if __name__ == "__main__":
    raise SystemExit(main())
