"""An ordinary DeepSpeed ZeRO-3 training script, used unmodified by the tests.

deepspeed --num_gpus 1 train_tiny.py --steps 6 --losses-out losses.jsonl
"""

import argparse
import json
import os
import sys

import deepspeed
import torch
from deepspeed.accelerator import get_accelerator

ap = argparse.ArgumentParser()
ap.add_argument("--local_rank", type=int, default=0)
ap.add_argument("--steps", type=int, default=6)
ap.add_argument("--losses-out", required=True)
ap.add_argument("--dtype", default="fp32", choices=["fp32", "bf16", "fp16"])
ap.add_argument("--overflow-at", type=int, default=0, help="make this step's gradients inf (fp16: a skipped step)")
ap.add_argument(
    "--overflow-in",
    choices=["all", "first"],
    default="all",
    help="first: only the first layer's weight gradient overflows (it may live apart from the rest)",
)
ap.add_argument("--stage", type=int, default=3)
ap.add_argument("--offload", default="cpu", choices=["cpu", "nvme", "none"])
ap.add_argument("--nvme-path")
ap.add_argument("--save-at", type=int, default=0, help="save a checkpoint after this step (0: never)")
ap.add_argument("--resume", help="checkpoint directory to resume from")
ap.add_argument("--resume-tag", default="ckpt", help="the checkpoint's tag (a universal checkpoint's folder name)")
ap.add_argument("--ckpt-dir")
ap.add_argument("--no-init", action="store_true", help="never call deepspeed.initialize")
ap.add_argument("--groups", action="store_true", help="two param groups with their own lr and weight decay")
ap.add_argument("--ds-extra", default="{}", help="JSON merged into the ds_config (options a test wants refused)")
ap.add_argument(
    "--state-api-out",
    help="at step 2, read (and at step 3 change) partitioned state through "
    "DeepSpeed's safe_get_*/safe_set_* API; the values read go here (torch.save)",
)
ap.add_argument(
    "--try-resume",
    metavar="FILE",
    help="with --resume: after training, try to load it; a load that fails is caught, and whether the "
    "optimizer's tiers kept their state (offloadctl only) is written here",
)
ap.add_argument(
    "--offload-states-at",
    type=int,
    default=0,
    help="after this step: engine.offload_states(include), the local fp32 params and Adam states read "
    "before and after, then reload_states() (RLHF frameworks do this around generation)",
)
ap.add_argument("--offload-include", default="all", help="comma-separated OffloadStateTypeEnum names, or all")
ap.add_argument("--hidden", type=int, default=64, help="the model's width (another model: another checkpoint)")
ap.add_argument("--sub-group-size", type=int, default=100)
ap.add_argument(
    "--resume-module-only",
    action="store_true",
    help="with --resume: load_checkpoint(load_optimizer_states=False, load_module_only=True)",
)
ap.add_argument("--show-tty", action="store_true", help="print whether stdout is a terminal")
args = ap.parse_args()
if args.show_tty and int(os.environ.get("RANK", "0")) == 0:
    print(f"tty {sys.stdout.isatty()}", flush=True)

if args.no_init:
    raise SystemExit(0)
torch.manual_seed(0)
h = args.hidden
model = torch.nn.Sequential(
    torch.nn.Linear(32, h), torch.nn.GELU(), torch.nn.Linear(h, h), torch.nn.GELU(), torch.nn.Linear(h, 8)
)
zero = {"stage": args.stage, "sub_group_size": args.sub_group_size, "stage3_param_persistence_threshold": 0}
if args.offload != "none":
    zero["offload_optimizer"] = {"device": args.offload}
    if args.offload == "nvme":
        zero["offload_optimizer"]["nvme_path"] = args.nvme_path
config = {
    "train_micro_batch_size_per_gpu": 4,
    "gradient_accumulation_steps": 2,
    "gradient_clipping": 0.5,
    "optimizer": {"type": "AdamW", "params": {"lr": 1e-2, "weight_decay": 0.01}},
    "scheduler": {"type": "WarmupLR", "params": {"warmup_min_lr": 0, "warmup_max_lr": 1e-2, "warmup_num_steps": 3}},
    "zero_optimization": zero,
}
if args.dtype == "bf16":
    config["bf16"] = {"enabled": True}
if args.dtype == "fp16":
    # Dynamic loss scaling from 2**8, halved after each overflow.
    config["fp16"] = {"enabled": True, "initial_scale_power": 8, "loss_scale_window": 2, "hysteresis": 1}
    # DeepSpeed's CPU accelerator refuses fp16 unless oneDNN has fp16 kernels; torch's CPU fp16 math
    # is enough for this test, for the stock run and for offloadctl's alike.
    type(get_accelerator()).is_fp16_supported = lambda self: True
config.update(json.loads(args.ds_extra))
params = list(model.parameters())
if args.groups:
    params = [{"params": params[:2], "lr": 3e-2, "weight_decay": 0.0}, {"params": params[2:], "weight_decay": 0.1}]
inject = {"on": False}
if args.overflow_in == "first":
    model[0].weight.register_hook(lambda g: g * float("inf") if inject["on"] else g)
engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=params, config=config)
rank = engine.global_rank
start = 0
if args.resume and not args.try_resume:
    only = dict(load_optimizer_states=False, load_module_only=True) if args.resume_module_only else {}
    _, client = engine.load_checkpoint(args.resume, tag=args.resume_tag, **only)
    start = client["step"]
gen = torch.Generator().manual_seed(1234 + rank)  # on the CPU: the same data on every machine
device = get_accelerator().current_device_name()
batches = [
    (torch.randn(4, 32, generator=gen).to(device), torch.randn(4, 8, generator=gen).to(device)) for _ in range(2 * args.steps)
]
dtype = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}[args.dtype]
read_values: dict = {}


def state_api(step: int) -> None:
    """DeepSpeed's documented partitioned-state API ("Debugging", "Modifying Partitioned States"):
    every getter at step 2, then every setter at step 3 (their effect shows in later losses)."""
    from deepspeed.utils import (
        safe_get_full_fp32_param,
        safe_get_full_grad,
        safe_get_full_optimizer_state,
        safe_get_local_fp32_param,
        safe_get_local_grad,
        safe_get_local_optimizer_state,
        safe_set_full_fp32_param,
        safe_set_full_optimizer_state,
        safe_set_local_fp32_param,
        safe_set_local_grad,
        safe_set_local_optimizer_state,
        safe_update_full_grad_vectorized,
    )

    named = list(model.named_parameters())
    if step == 2:
        for name, p in named:
            for what, get in (
                ("full_fp32", safe_get_full_fp32_param),
                ("full_grad", safe_get_full_grad),
                ("local_fp32", safe_get_local_fp32_param),
                ("local_grad", safe_get_local_grad),
            ):
                read_values[f"{name}.{what}"] = get(p).detach().float().cpu().clone()
            for key in ("exp_avg", "exp_avg_sq"):
                read_values[f"{name}.full_{key}"] = safe_get_full_optimizer_state(p, key).detach().float().cpu().clone()
                read_values[f"{name}.local_{key}"] = safe_get_local_optimizer_state(p, key).float().cpu().clone()
        torch.save(read_values, f"{args.state_api_out}.rank{rank}")
        return
    p0, p1, p2 = (p for _, p in named[:3])
    safe_set_full_fp32_param(p0, safe_get_full_fp32_param(p0) * 0.5)
    safe_set_full_optimizer_state(p1, safe_get_full_optimizer_state(p1, "exp_avg") * 2.0, "exp_avg")
    safe_set_local_fp32_param(p2, safe_get_local_fp32_param(p2) + 0.01)
    safe_set_local_optimizer_state(p2, safe_get_local_optimizer_state(p2, "exp_avg_sq") * 3.0, "exp_avg_sq")
    safe_set_local_grad(p1, safe_get_local_grad(p1) * 0.25)
    safe_update_full_grad_vectorized([p0, p2], lambda grad, param: grad * 2.0)


def offload_and_reload() -> None:
    """offload_states then reload_states: the state read through DeepSpeed's API is unchanged."""
    from deepspeed.runtime.zero.offload_config import OffloadStateTypeEnum
    from deepspeed.utils import safe_get_local_fp32_param, safe_get_local_optimizer_state

    def read():
        return [
            t.float().cpu().clone()
            for p in model.parameters()
            for t in (safe_get_local_fp32_param(p), safe_get_local_optimizer_state(p, "exp_avg"))
        ]

    include = None if args.offload_include == "all" else [OffloadStateTypeEnum(x) for x in args.offload_include.split(",")]
    before = read()
    engine.offload_states(include=include)
    engine.reload_states()
    after = read()
    assert all(torch.equal(a, b) for a, b in zip(before, after)), "state changed across offload_states/reload_states"


for step in range(start, args.steps):
    for micro in range(2):
        x, y = batches[2 * step + micro]
        loss = torch.nn.functional.mse_loss(engine(x.to(dtype)).float(), y)
        if args.overflow_at == step + 1 and micro == 1:
            if args.overflow_in == "first":
                inject["on"] = True
            else:
                loss = loss * float("inf")
        else:
            inject["on"] = False
        engine.backward(loss)
        if args.state_api_out and micro == 1 and step + 1 in (2, 3):
            state_api(step + 1)
        engine.step()
    if rank == 0:
        with open(args.losses_out, "a") as f:
            f.write(json.dumps({"step": step + 1, "loss": loss.item(), "loss_scale": engine.optimizer.loss_scale}) + "\n")
    if args.offload_states_at and step + 1 == args.offload_states_at:
        offload_and_reload()
    if args.save_at and step + 1 == args.save_at:
        engine.save_checkpoint(args.ckpt_dir, tag="ckpt", client_state={"step": step + 1})
if args.resume and args.try_resume:  # after training: the state a failed load must leave alone
    tiers = getattr(engine.optimizer, "offload_engine", None)
    state = lambda: [tiers.read_state(i) for i in range(len(tiers.subgroups))] if tiers else []  # noqa: E731
    before = state()
    try:
        engine.load_checkpoint(args.resume, tag=args.resume_tag)
        outcome = "loaded"
    except Exception as e:  # noqa: BLE001 - what a script that falls back does
        outcome = f"failed: {e}"
    same = all(torch.equal(x, y) for a, b in zip(before, state()) for x, y in zip(a[:3], b[:3]))
    with open(args.try_resume, "w") as f:
        json.dump({"outcome": outcome, "tiers_unchanged": same}, f)
# A distributed script's clean end: its process group goes before the interpreter does (gloo's
# threads torn down by the interpreter's exit can abort it: "terminate called without an active
# exception"). The line after it tells a test that this rank finished everything before exit.
if torch.distributed.is_initialized():
    torch.distributed.destroy_process_group()
print(f"train_tiny: rank {rank} finished", flush=True)
