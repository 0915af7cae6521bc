"""An ordinary DeepSpeed ZeRO-3 GPT training script, run unmodified under stock `deepspeed` and
under `offloadctl train` by bench/gpu_vs_stock.py.

    deepspeed --num_gpus 1 bench/gpt_zero3.py --size 2b --offload cpu --out stock.json
    deepspeed --num_gpus 1 bench/gpt_zero3.py --size 2b --offload twinflow --ratio 0.3 --out tf.json
    deepspeed --num_gpus 1 bench/gpt_zero3.py --size 2b --offload none --out gpu.json
    deepspeed --num_gpus 1 bench/gpt_zero3.py --size 2b --offload nvme --nvme-path /local/nvme --out zi.json
    offloadctl train --num_gpus 1 bench/gpt_zero3.py --size 2b --out ours.json

A nanoGPT-style decoder (pre-LayerNorm blocks, causal scaled-dot-product attention, GELU MLP,
untied head) built under ``deepspeed.zero.Init`` on the rank's device, bf16, AdamW,
``gradient_clipping`` 1.0, ``sub_group_size`` 1e8; random tokens generated on the device.
``--offload nvme`` is ZeRO-Infinity (``offload_optimizer: nvme``, pipelined read and write,
``buffer_count`` 16: 4 and 8 run out of swap buffers, bench/results/zi_aio_sweep.json) with the
``aio`` block of ``--aio-*`` (default: queue depth 32, the emulated tier's sweep; 1 MiB blocks and
8 I/O threads, for a real NVMe).
Sizes (parameters): ``1b`` 16 layers, d 2048, 16 heads (9.4e8; the NVMe comparison where a
bigger state does not fit the disk); ``2b`` 24 layers, d 2560, 20 heads (2.06e9); ``4b`` 28 layers, d 3328,
26 heads (3.93e9); ``cpu`` 2 layers, d 1024, 8 tokens (9.1e7: a step that
weighs, a forward/backward a 2-core CPU does in seconds; the CPU-only bench); ``cpu-deep`` 8
layers, d 768, vocab 8000, 16 tokens (6.9e7: four times the tensors per parameter, the CPU
bench's second shape); ``tiny`` 2 layers,
d 128 (tests). Writes per-iteration times (iteration,
forward+backward, step), losses, GPU peak memory and host RSS as JSON to ``--out``.
"""

import argparse
import json
import math
import resource
import time

import deepspeed
import psutil
import torch
import torch.nn as nn
import torch.nn.functional as F
from deepspeed.accelerator import get_accelerator

SIZES = {  # layers, d_model, heads, vocab, sequence, micro-batch
    "tiny": (2, 128, 4, 512, 64, 2),
    "cpu": (2, 1024, 16, 32000, 8, 1),
    "cpu-deep": (8, 768, 12, 8000, 16, 1),
    "1b": (16, 2048, 16, 32000, 2048, 4),
    "2b": (24, 2560, 20, 32000, 2048, 4),
    "4b": (28, 3328, 26, 32000, 2048, 4),
}

ap = argparse.ArgumentParser()
ap.add_argument("--local_rank", type=int, default=0)
ap.add_argument("--size", choices=sorted(SIZES), default="tiny")
ap.add_argument("--iters", type=int, default=6)
ap.add_argument(
    "--offload",
    choices=["cpu", "twinflow", "nvme", "none"],
    default="cpu",
    help="cpu: ZeRO-Offload; twinflow: ZeRO-Offload with offload_optimizer.ratio; nvme: ZeRO-Infinity "
    "(optimizer state on --nvme-path); none: state on the GPU",
)
ap.add_argument("--ratio", type=float, default=0.5, help="twinflow: share of the state on the CPU")
ap.add_argument("--nvme-path", help="nvme: the directory of DeepSpeed's swap files")
ap.add_argument("--buffer-count", type=int, default=16, help="nvme: offload_optimizer buffer_count (default 16)")
ap.add_argument("--aio-block-size", type=int, default=1 << 20, help="nvme: aio block_size in bytes (default 1 MiB)")
ap.add_argument("--aio-queue-depth", type=int, default=32, help="nvme: aio queue_depth (default 32)")
ap.add_argument("--aio-intra-op", type=int, default=8, help="nvme: aio intra_op_parallelism (default 8)")
ap.add_argument("--dtype", choices=["bf16", "fp32"], default="bf16")
ap.add_argument("--sub-group-size", type=int, default=100_000_000)
ap.add_argument(
    "--trace-backward-at",
    type=int,
    default=None,
    metavar="I",
    help="profile iteration I's backward (CUDA): bytes copied host-to-device and back in it",
)
ap.add_argument("--out", required=True)
args = ap.parse_args()
if args.offload == "nvme" and not args.nvme_path:
    ap.error("--offload nvme needs --nvme-path DIR")
layers, d, heads, vocab, seq, batch = SIZES[args.size]


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.ln1, self.ln2 = nn.LayerNorm(d), nn.LayerNorm(d)
        self.qkv, self.proj = nn.Linear(d, 3 * d), nn.Linear(d, d)
        self.fc, self.out = nn.Linear(d, 4 * d), nn.Linear(4 * d, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, _ = x.shape
        q, k, v = self.qkv(self.ln1(x)).view(b, t, 3, heads, d // heads).unbind(2)
        a = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True)
        x = x + self.proj(a.transpose(1, 2).reshape(b, t, d))
        return x + self.out(F.gelu(self.fc(self.ln2(x))))


class GPT(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.tok, self.pos = nn.Embedding(vocab, d), nn.Embedding(seq, d)
        self.blocks = nn.ModuleList(Block() for _ in range(layers))
        self.ln, self.head = nn.LayerNorm(d), nn.Linear(d, vocab, bias=False)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.tok(idx) + self.pos(torch.arange(idx.shape[1], device=idx.device))
        for blk in self.blocks:
            x = blk(x)
        return self.head(self.ln(x))


offload = {"device": "cpu", "pin_memory": True}
if args.offload == "twinflow":
    offload["ratio"] = args.ratio
elif args.offload == "nvme":
    offload.update(
        device="nvme", nvme_path=args.nvme_path, pipeline_read=True, pipeline_write=True, buffer_count=args.buffer_count
    )
zero = {
    "stage": 3,
    "sub_group_size": args.sub_group_size,
    "overlap_comm": True,
    "contiguous_gradients": True,
    "stage3_param_persistence_threshold": 100_000,
}
optimizer = {"type": "AdamW", "params": {"lr": 1e-4, "weight_decay": 0.01}}
if args.offload == "none":
    optimizer["params"].update(torch_adam=True, fused=True)  # torch's fused CUDA AdamW: no op to build
else:
    zero["offload_optimizer"] = offload
config = {
    "train_micro_batch_size_per_gpu": batch,
    "gradient_accumulation_steps": 1,
    "gradient_clipping": 1.0,
    "optimizer": optimizer,
    "zero_optimization": zero,
    "steps_per_print": 10**9,
}
if args.dtype == "bf16":
    config["bf16"] = {"enabled": True}
if args.offload == "nvme":
    config["aio"] = {
        "block_size": args.aio_block_size,
        "queue_depth": args.aio_queue_depth,
        "intra_op_parallelism": args.aio_intra_op,
        "single_submit": False,
        "overlap_events": True,
    }

accel = get_accelerator()
device = accel.current_device_name()
deepspeed.init_distributed()
torch.manual_seed(0)
t_init = time.perf_counter()
with deepspeed.zero.Init(config_dict_or_path=config):
    model = GPT()
params = sum(p.ds_numel for p in model.parameters())
engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=config)
init_s = time.perf_counter() - t_init
gen = torch.Generator(device=device).manual_seed(1234 + engine.global_rank)
tokens = torch.randint(0, vocab, (args.iters, batch, seq + 1), device=device, generator=gen)


def traced_backward(loss) -> dict:
    """engine.backward(loss) under the CUDA profiler: bytes of each memcpy kind (HtoD, DtoH)."""
    import os
    import tempfile

    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        engine.backward(loss)
        accel.synchronize()
    path = os.path.join(tempfile.mkdtemp(), "trace.json")
    prof.export_chrome_trace(path)
    out: dict = {}
    for ev in json.load(open(path)).get("traceEvents", []):
        name = ev.get("name", "")
        if ev.get("cat") == "gpu_memcpy" or name.startswith("Memcpy"):
            kind = "HtoD" if "HtoD" in name else "DtoH" if "DtoH" in name else "other"
            out[kind] = out.get(kind, 0) + int((ev.get("args") or {}).get("bytes", 0))
    return out


rec = {"iter_s": [], "fwd_bwd_s": [], "step_s": [], "loss": []}
for it in range(args.iters):
    accel.synchronize()
    t0 = time.perf_counter()
    logits = engine(tokens[it, :, :-1])
    loss = F.cross_entropy(logits.float().view(-1, vocab), tokens[it, :, 1:].reshape(-1))
    if it == args.trace_backward_at and torch.cuda.is_available():
        rec["backward_memcpy_bytes"] = traced_backward(loss)
    else:
        engine.backward(loss)
    accel.synchronize()
    t1 = time.perf_counter()
    engine.step()
    accel.synchronize()
    t2 = time.perf_counter()
    rec["iter_s"].append(t2 - t0)
    rec["fwd_bwd_s"].append(t1 - t0)
    rec["step_s"].append(t2 - t1)
    rec["loss"].append(loss.item())
    if not math.isfinite(rec["loss"][-1]):
        break
if engine.global_rank == 0:
    rec.update(
        params=params,
        size=args.size,
        offload=args.offload,
        ratio=args.ratio,
        init_s=init_s,
        aio=config.get("aio"),
        host_rss_bytes=psutil.Process().memory_info().rss,
        host_peak_rss_bytes=resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
        gpu_peak_allocated_bytes=torch.cuda.max_memory_allocated() if torch.cuda.is_available() else 0,
        gpu_peak_reserved_bytes=torch.cuda.max_memory_reserved() if torch.cuda.is_available() else 0,
        gpu=torch.cuda.get_device_name() if torch.cuda.is_available() else None,
    )
    opt = engine.optimizer
    if hasattr(opt, "offload_engine"):  # under offloadctl train: what the engine decided
        from engine.buffers import is_pinned_in_place

        fit = opt.device_fit.to_dict() if opt.device_fit else None
        rec["engine"] = {
            "fit": fit,
            "describe": opt.offload_engine.describe().to_dict(),
            "plan": opt.plan_summary,
            "grad_buffer_pinned": is_pinned_in_place(opt.grad_partitions_flat_buffer),
        }
    with open(args.out, "w") as f:
        json.dump(rec, f)
