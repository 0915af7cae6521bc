"""A DeepSpeed ZeRO-3 script whose one rank fails mid-run, the others going on into the next
collective (tests of what a run of several ranks shows when one fails).

    offloadctl train --num_gpus 2 fail_rank.py --rank 1 --at 2
"""

import argparse
import time

import deepspeed
import torch

ap = argparse.ArgumentParser()
ap.add_argument("--local_rank", type=int, default=0)
ap.add_argument("--rank", type=int, default=1, help="the rank that fails")
ap.add_argument("--at", type=int, default=2, help="after this many steps")
ap.add_argument(
    "--how",
    choices=["raise", "hang", "signalled-while-said"],
    default="raise",
    help="raise: a ValueError; hang: it stops stepping (a test kills it), the others go on; "
    "signalled-while-said: an error whose text sends the rank SIGTERM as it is said (the "
    "launcher stopping the ranks while this one reports its error)",
)
ap.add_argument("--steps", type=int, default=100_000)
args = ap.parse_args()
torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.GELU(), torch.nn.Linear(64, 8))
config = {
    "train_micro_batch_size_per_gpu": 4,
    "optimizer": {"type": "AdamW", "params": {"lr": 1e-2}},
    "zero_optimization": {"stage": 3, "sub_group_size": 100, "offload_optimizer": {"device": "cpu"}},
}
engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=config)
for step in range(args.steps):
    if engine.global_rank == args.rank and step == args.at:
        if args.how == "raise":
            raise ValueError(f"bad batch at step {step} on rank {args.rank}")
        if args.how == "signalled-while-said":
            import os
            import signal

            class Signalled(ValueError):
                def __str__(self) -> str:
                    os.kill(os.getpid(), signal.SIGTERM)
                    time.sleep(0.5)  # the handler runs here, inside the rank's report of this error
                    return "bad batch"

            raise Signalled()
        print(f"fail_rank: rank {args.rank} waits at step {step}", flush=True)
        time.sleep(3600)
    loss = engine(torch.randn(4, 32, device=engine.device)).pow(2).mean()
    engine.backward(loss)
    engine.step()
