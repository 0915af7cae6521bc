"""A Hugging Face Accelerate script that saves and resumes its whole state through Accelerate's
own calls (``save_state``/``load_state``), with a DeepSpeed ZeRO-3 plugin; used unmodified by
the tests.

    accelerate launch --use_deepspeed --num_processes 2 train_accelerate_state.py --steps 6 \\
        --losses-out l.jsonl --save-at 3 --state-dir state
    accelerate launch ... train_accelerate_state.py --steps 6 --losses-out l2.jsonl --resume state
"""

import argparse
import json
import os

import torch
from accelerate import Accelerator, DeepSpeedPlugin, PartialState
from accelerate.utils import DummyOptim, DummyScheduler, set_seed

ap = argparse.ArgumentParser()
ap.add_argument("--local_rank", type=int, default=0)
ap.add_argument("--steps", type=int, default=6)
ap.add_argument("--losses-out", required=True)
ap.add_argument("--save-at", type=int, default=0, help="save_state after this step (0: never)")
ap.add_argument("--state-dir", help="where save_state writes")
ap.add_argument("--resume", help="load_state from here, then go on from the step it saved")
args = ap.parse_args()

ds_config = {
    "train_micro_batch_size_per_gpu": 4,
    "gradient_accumulation_steps": 1,
    "gradient_clipping": 0.5,
    "optimizer": {"type": "AdamW", "params": {"lr": 1e-2, "weight_decay": 0.01}},
    "scheduler": {"type": "WarmupLR", "params": {"warmup_min_lr": 0, "warmup_max_lr": 1e-2, "warmup_num_steps": 3}},
    "zero_optimization": {
        "stage": 3,
        "sub_group_size": 1000,
        "stage3_param_persistence_threshold": 0,
        "offload_optimizer": {"device": "cpu"},
    },
}
if not torch.cuda.is_available():
    # Accelerate picks no backend on a machine without GPUs and then counts one process; name gloo.
    PartialState(backend="gloo")
accelerator = Accelerator(deepspeed_plugin=DeepSpeedPlugin(hf_ds_config=ds_config))
set_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(32, 256), torch.nn.GELU(), torch.nn.Linear(256, 8))
gen = torch.Generator().manual_seed(1234 + accelerator.process_index)
# cpu ok: seeded on the CPU, moved to accelerator.device at use
batches = [(torch.randn(4, 32, generator=gen), torch.randn(4, 8, generator=gen)) for _ in range(args.steps)]  # cpu ok
model, optimizer, scheduler = accelerator.prepare(model, DummyOptim(model.parameters()), DummyScheduler(None))
start = 0
if args.resume:
    accelerator.load_state(args.resume)
    with open(os.path.join(args.resume, "step.txt")) as f:
        start = int(f.read())
for step in range(start, args.steps):
    x, y = batches[step]
    loss = torch.nn.functional.mse_loss(model(x.to(accelerator.device)), y.to(accelerator.device))
    accelerator.backward(loss)
    optimizer.step()
    scheduler.step()
    optimizer.zero_grad()
    if accelerator.is_main_process:
        with open(args.losses_out, "a") as f:
            f.write(json.dumps({"step": step + 1, "loss": loss.item()}) + "\n")
    if step + 1 == args.save_at:
        accelerator.save_state(args.state_dir)
        if accelerator.is_main_process:
            with open(os.path.join(args.state_dir, "step.txt"), "w") as f:
                f.write(str(step + 1))
        accelerator.wait_for_everyone()

# every rank says so: the tests count it to tell a finished run from one that died mid-training
print(f"train_accelerate_state: rank {accelerator.process_index} finished", flush=True)
