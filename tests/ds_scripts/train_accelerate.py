"""An ordinary Hugging Face Accelerate script with a DeepSpeed ZeRO-3 plugin, used unmodified by the tests.

deepspeed --num_gpus 1 train_accelerate.py --steps 6 --losses-out losses.jsonl
"""

import argparse
import json

import torch
from accelerate import Accelerator, DeepSpeedPlugin, PartialState
from accelerate.utils import DummyOptim, DummyScheduler, set_seed

ap = argparse.ArgumentParser()
ap.add_argument("--local_rank", type=int, default=0)
ap.add_argument("--steps", type=int, default=6)
ap.add_argument("--losses-out", required=True)
args = ap.parse_args()

ds_config = {
    "train_micro_batch_size_per_gpu": 4,
    "gradient_accumulation_steps": 2,
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
model = torch.nn.Sequential(torch.nn.Linear(32, 256), torch.nn.GELU(), torch.nn.Dropout(0.1), torch.nn.Linear(256, 8))
gen = torch.Generator().manual_seed(1234 + accelerator.process_index)
# cpu ok: seeded on the CPU, moved to accelerator.device at use
batches = [(torch.randn(4, 32, generator=gen), torch.randn(4, 8, generator=gen)) for _ in range(2 * args.steps)]  # cpu ok
model, optimizer, scheduler = accelerator.prepare(model, DummyOptim(model.parameters()), DummyScheduler(None))
for step in range(args.steps):
    for micro in range(2):
        with accelerator.accumulate(model):
            x, y = batches[2 * step + micro]
            loss = torch.nn.functional.mse_loss(model(x.to(accelerator.device)), y.to(accelerator.device))
            accelerator.backward(loss)
            optimizer.step()
            scheduler.step()
            optimizer.zero_grad()
    if accelerator.is_main_process:
        with open(args.losses_out, "a") as f:
            f.write(json.dumps({"step": step + 1, "loss": loss.item()}) + "\n")
