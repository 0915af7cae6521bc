"""The DeepSpeed ZeRO-3 script that bench/vs_zero_infinity.py runs, stock or under offloadctl.

A 92M-parameter stack of linear layers (9 x 3200 x 3200) with ZeRO-3 and optimizer offload
(``--offload cpu`` or ``--offload nvme --nvme-path DIR`` for ZeRO-Infinity, with pipelined
read and write and ``buffer_count`` 16; ``--buffer-count`` and ``--aio-block-size``,
``--aio-queue-depth``, ``--aio-intra-op`` set those, as bench/zi_aio_sweep.py tunes them; the
defaults are DeepSpeed's aio defaults). ``--width``, ``--layers`` and ``--sub-group-size`` give
other sizes: ``--width 2400 --layers 9 --sub-group-size 5760000`` is the 51.8M-parameter model of
issue 23's run, one layer per subgroup. It writes per-iteration wall time and the time of
``engine.step()`` (the update phase) as JSON to ``--out``.
"""

import argparse
import json
import time

import deepspeed
import torch
from deepspeed.accelerator import get_accelerator

ap = argparse.ArgumentParser()
ap.add_argument("--local_rank", type=int, default=0)
ap.add_argument("--iters", type=int, default=6)
ap.add_argument("--offload", choices=["cpu", "nvme"], default="cpu")
ap.add_argument("--nvme-path")
ap.add_argument("--width", type=int, default=3200, help="features of each layer (default 3200)")
ap.add_argument("--layers", type=int, default=9, help="linear layers (default 9)")
ap.add_argument("--sub-group-size", type=int, default=10_000_000, help="ZeRO-3 sub_group_size (default 1e7)")
ap.add_argument("--buffer-count", type=int, default=16, help="offload_optimizer buffer_count with nvme (default 16)")
ap.add_argument("--aio-block-size", type=int, default=1048576, help="aio block_size in bytes (default 1048576)")
ap.add_argument("--aio-queue-depth", type=int, default=8, help="aio queue_depth (default 8)")
ap.add_argument("--aio-intra-op", type=int, default=1, help="aio intra_op_parallelism (default 1)")
ap.add_argument("--out", required=True)
args = ap.parse_args()

torch.manual_seed(0)
width, layers = args.width, args.layers
model = torch.nn.Sequential(*[torch.nn.Linear(width, width, bias=False) for _ in range(layers)])
offload = {"device": args.offload}
if args.offload == "nvme":
    offload.update(nvme_path=args.nvme_path, pipeline_read=True, pipeline_write=True, buffer_count=args.buffer_count)
config = {
    "train_micro_batch_size_per_gpu": 8,
    "optimizer": {"type": "AdamW", "params": {"lr": 1e-4, "weight_decay": 0.01}},
    "zero_optimization": {"stage": 3, "sub_group_size": args.sub_group_size, "offload_optimizer": offload},
    "aio": {
        "block_size": args.aio_block_size,
        "queue_depth": args.aio_queue_depth,
        "intra_op_parallelism": args.aio_intra_op,
        "single_submit": False,
        "overlap_events": True,
    },
}
engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=config)
device = get_accelerator().current_device_name()
x, y = torch.randn(8, width, device=device), torch.randn(8, width, device=device)
iters, steps = [], []
for _ in range(args.iters):
    t0 = time.perf_counter()
    loss = torch.nn.functional.mse_loss(engine(x), y)
    engine.backward(loss)
    t1 = time.perf_counter()
    engine.step()
    t2 = time.perf_counter()
    iters.append(t2 - t0)
    steps.append(t2 - t1)
if engine.global_rank == 0:
    with open(args.out, "w") as f:
        json.dump({"iter_s": iters, "step_s": steps, "params": sum(p.ds_numel for p in model.parameters())}, f)
