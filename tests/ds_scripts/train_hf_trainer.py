"""An ordinary Hugging Face Trainer script with a DeepSpeed ZeRO-3 config, used unmodified by the tests.

A tiny GPT-2 built from a config (no download) on random tokens.

    deepspeed --num_gpus 1 train_hf_trainer.py --steps 6 --losses-out losses.jsonl --output-dir out
"""

import argparse
import json

import torch
from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainerCallback, TrainingArguments

ap = argparse.ArgumentParser()
ap.add_argument("--local_rank", type=int, default=0)
ap.add_argument("--steps", type=int, default=6)
ap.add_argument("--losses-out", required=True)
ap.add_argument("--output-dir", required=True)
args = ap.parse_args()

ds_config = {
    "train_micro_batch_size_per_gpu": "auto",
    "gradient_accumulation_steps": "auto",
    "gradient_clipping": "auto",
    "optimizer": {"type": "AdamW", "params": {"lr": "auto", "weight_decay": "auto", "betas": "auto", "eps": "auto"}},
    "zero_optimization": {
        "stage": 3,
        "sub_group_size": 20000,
        "stage3_param_persistence_threshold": 0,
        "offload_optimizer": {"device": "cpu"},
    },
}
training_args = TrainingArguments(
    output_dir=args.output_dir,
    max_steps=args.steps,
    per_device_train_batch_size=4,
    gradient_accumulation_steps=2,
    learning_rate=3e-3,
    weight_decay=0.01,
    max_grad_norm=1.0,
    warmup_steps=2,
    logging_steps=1,
    save_strategy="no",
    report_to=[],
    deepspeed=ds_config,
    seed=0,
    data_seed=0,
    dataloader_num_workers=0,
    disable_tqdm=True,
    use_cpu=not torch.cuda.is_available(),
)

torch.manual_seed(0)
model = GPT2LMHeadModel(GPT2Config(vocab_size=256, n_positions=32, n_embd=64, n_layer=2, n_head=4))
gen = torch.Generator().manual_seed(1234)
# cpu ok: the Trainer moves each batch to the model's device
data = [{"input_ids": ids, "labels": ids} for ids in torch.randint(0, 256, (64, 32), generator=gen)]  # cpu ok


class LossLog(TrainerCallback):
    def on_log(self, args, state, control, logs=None, **kw):
        if state.is_world_process_zero and logs and "loss" in logs:
            with open(args_cli.losses_out, "a") as f:
                f.write(json.dumps({"step": state.global_step, "loss": logs["loss"]}) + "\n")


args_cli = args
Trainer(model=model, args=training_args, train_dataset=data, callbacks=[LossLog()]).train()
