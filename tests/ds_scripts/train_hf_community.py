"""A Hugging Face Trainer script with a ZeRO-3 offload config as the community ships them
(axolotl's zero3_bf16_cpuoffload_all.json, LLaMA-Factory's ds_z3_offload_config.json), used
unmodified by the tests: "auto" values the Trainer fills in, no optimizer block (the Trainer's
torch AdamW, kept under offload by zero_force_ds_cpu_optimizer: false), pin_memory false,
parameters offloaded too, the 16-bit model gathered on save, accumulation with a cosine warmup.

    torchrun --nproc_per_node 2 train_hf_community.py --steps 6 --losses-out l.jsonl --output-dir out
"""

import argparse
import json
import os

import torch
from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainerCallback, TrainingArguments

ap = argparse.ArgumentParser()
ap.add_argument("--local_rank", type=int, default=0)
ap.add_argument("--steps", type=int, default=6)
ap.add_argument("--losses-out", required=True)
ap.add_argument("--output-dir", required=True)
ap.add_argument("--sub-group-size", type=float, default=1e9)
ap.add_argument("--save-steps", type=int, default=0, help="a checkpoint every N steps (0: none)")
ap.add_argument("--resume", help="a checkpoint folder to resume from")
ap.add_argument("--save-model", help="save the 16-bit model here at the end (save_model)")
args = ap.parse_args()

ds_config = {
    "bf16": {"enabled": "auto"},
    "fp16": {"enabled": "auto"},
    "train_micro_batch_size_per_gpu": "auto",
    "train_batch_size": "auto",
    "gradient_accumulation_steps": "auto",
    "gradient_clipping": "auto",
    "zero_force_ds_cpu_optimizer": False,
    "zero_optimization": {
        "stage": 3,
        "overlap_comm": True,
        "contiguous_gradients": True,
        "sub_group_size": int(args.sub_group_size),
        "reduce_bucket_size": "auto",
        "stage3_prefetch_bucket_size": "auto",
        "stage3_param_persistence_threshold": "auto",
        "stage3_max_live_parameters": 1e9,
        "stage3_max_reuse_distance": 1e9,
        "stage3_gather_16bit_weights_on_model_save": True,
        "offload_optimizer": {"device": "cpu", "pin_memory": False},
        "offload_param": {"device": "cpu", "pin_memory": False},
    },
}
training_args = TrainingArguments(
    output_dir=args.output_dir,
    max_steps=args.steps,
    per_device_train_batch_size=4,
    gradient_accumulation_steps=2,
    learning_rate=3e-3,
    weight_decay=0.01,
    adam_beta2=0.95,
    max_grad_norm=1.0,
    warmup_steps=2,
    lr_scheduler_type="cosine",
    logging_steps=1,
    save_strategy="steps" if args.save_steps else "no",
    save_steps=args.save_steps or 500,
    save_only_model=False,
    report_to=[],
    deepspeed=ds_config,
    seed=0,
    data_seed=0,
    dataloader_num_workers=0,
    disable_tqdm=True,
    ddp_backend=None if torch.cuda.is_available() else "gloo",
    use_cpu=not torch.cuda.is_available(),
)

torch.manual_seed(0)
model = GPT2LMHeadModel(GPT2Config(vocab_size=256, n_positions=32, n_embd=64, n_layer=2, n_head=4))
gen = torch.Generator().manual_seed(1234)
# cpu ok: the Trainer moves each batch to the model's device
data = [{"input_ids": ids, "labels": ids} for ids in torch.randint(0, 256, (64, 32), generator=gen)]  # cpu ok


class LossLog(TrainerCallback):
    def on_train_begin(self, args, state, control, **kw):
        if state.is_world_process_zero:
            with open(cli.losses_out + ".world", "w") as f:
                f.write(str(args.world_size))  # the tests check the Trainer saw every rank

    def on_log(self, args, state, control, logs=None, **kw):
        if state.is_world_process_zero and logs and "loss" in logs:
            with open(cli.losses_out, "a") as f:
                f.write(json.dumps({"step": state.global_step, "loss": logs["loss"]}) + "\n")


cli = args
trainer = Trainer(model=model, args=training_args, train_dataset=data, callbacks=[LossLog()])
trainer.train(resume_from_checkpoint=args.resume)
if args.save_model:
    trainer.save_model(args.save_model)
    if trainer.is_world_process_zero():
        print("saved:", sorted(os.listdir(args.save_model)), flush=True)
# every rank says so: the tests count it to tell a finished run from one that died mid-training
print(f"train_hf_community: rank {trainer.args.process_index} finished", flush=True)
