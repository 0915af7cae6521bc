"""Train a small GPT with DeepSpeed ZeRO-3 and CPU optimizer offload: an ordinary DeepSpeed script.

Run it as DeepSpeed would, or under offloadctl, which moves its optimizer state into tiers:

    deepspeed --num_gpus 1 examples/train_gpt.py --steps 30
    offloadctl train --num_gpus 1 --nvme /path/on/ssd examples/train_gpt.py --steps 30
"""

import argparse
import os
import sys

import deepspeed
import torch
from deepspeed.accelerator import get_accelerator
from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from gpt import GPT, generate_text, make_batches  # noqa: E402

ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
ap.add_argument("--local_rank", type=int, default=0)
ap.add_argument("--steps", type=int, default=30, help="optimizer steps (default 30)")
ap.add_argument("--batch", type=int, default=16, help="sequences per micro-batch (default 16)")
ap.add_argument("--ctx", type=int, default=64, help="context length in characters (default 64)")
args = ap.parse_args()

torch.manual_seed(0)
text = generate_text(4000)
chars = sorted(set(text))
model = GPT(len(chars), ctx=args.ctx)
config = {
    "train_micro_batch_size_per_gpu": args.batch,
    "gradient_clipping": 1.0,
    "optimizer": {"type": "AdamW", "params": {"lr": 3e-3, "weight_decay": 0.01}},
    "zero_optimization": {"stage": 3, "sub_group_size": 400_000, "offload_optimizer": {"device": "cpu"}},
}
engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=config)
batches = make_batches(text, chars, args.ctx, args.batch, args.steps, seed=engine.global_rank)
first = None
cols = [
    TextColumn("{task.description}"),
    BarColumn(),
    TextColumn("{task.completed}/{task.total}"),
    TextColumn("loss {task.fields[loss]}"),
    TimeElapsedColumn(),
]
with Progress(*cols, disable=engine.global_rank != 0) as progress:
    task = progress.add_task("training", total=args.steps, loss="-")
    device = get_accelerator().current_device_name()  # this rank's GPU, or the CPU
    for x, y in batches:
        x, y = x.to(device), y.to(device)
        loss = torch.nn.functional.cross_entropy(engine(x).reshape(-1, len(chars)), y.reshape(-1))
        engine.backward(loss)
        engine.step()
        first = first if first is not None else loss.item()
        progress.update(task, advance=1, loss=f"{loss.item():.3f}")
if engine.global_rank == 0:
    print(f"loss {first:.3f} -> {loss.item():.3f}")
