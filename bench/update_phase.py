"""Update-phase benchmark of the multi-tier engine, against the storage ceiling and DeepSpeedCPUAdam.

For about 100M parameters it runs three layouts (host-only, all-NVMe, host cache of half the
state), and the last two again with ``EngineConfig.io_cores=0`` (the host lane on every core,
beside the I/O threads' checksums), and reports, per layout: median update-phase time, bytes moved per parameter, achieved
storage bandwidth, and the floor that the path's own ceiling (measured in the same run, with
O_DIRECT at high concurrency) implies. It also compares the host-lane AdamW kernel with
DeepSpeedCPUAdam on the same buffer.

Raw disk (noisy on a host-cached virtual disk):

    .venv/bin/python bench/update_phase.py --nvme /var/tmp/offload-bench

Emulated tier with a fixed ceiling: ext4 on a loop device, O_DIRECT throttled by a blkio
cgroup to READ:WRITE MB/s (needs root; without it the run says so and exits 0):

    .venv/bin/python bench/update_phase.py --emulate 400:400

which is the same as doing it by hand with bench/tiers.sh:

    bench/tiers.sh up nvme:6:400:400
    bench/tiers.sh run .venv/bin/python bench/update_phase.py --nvme /mnt/offloadctl-tiers/nvme
    bench/tiers.sh down
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

import torch
from rich.console import Console
from rich.progress import Progress
from rich.table import Table

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from bench.emulate import add_engine_run_args, run_emulated  # noqa: E402
from engine import AdamWHyper, EngineConfig, FlatSubgroup, Knobs, StoragePath, SubgroupEngine  # noqa: E402
from engine.adamw import measure_host_kernels  # noqa: E402
from engine.buffers import StateBuffer, payload_bytes  # noqa: E402
from engine.layout import STATE_BYTES_PER_ELEMENT  # noqa: E402
from engine.storage.io_backends import open_backend  # noqa: E402
from engine.storage.paths import SwapPath  # noqa: E402

console = Console(stderr=True)


def measure_ceiling(path: str, nbytes: int, concurrency: int, backend: str) -> dict[str, float]:
    """O_DIRECT bandwidth of ``path`` alone for reads, for writes, and for both at once (bytes/s)."""
    sp = SwapPath(StoragePath(path=path), open_backend(backend), concurrency=concurrency, node_lock=False, verify_checksums=False)
    numel = nbytes // STATE_BYTES_PER_ELEMENT
    bufs = [StateBuffer(numel, pin=False) for _ in range(2)]
    for b in bufs:
        b.payload.fill_(3)
    files = [sp.create_file(i, numel, bufs[0].payload.numel(), 8 << 20) for i in range(2)]
    try:
        sp.write(files[0], bufs[0]).result()  # so that file 0 can be read
        t0 = time.perf_counter()
        sp.write(files[1], bufs[1]).result()
        write_s = time.perf_counter() - t0
        t0 = time.perf_counter()
        sp.read(files[0], bufs[0]).result()
        read_s = time.perf_counter() - t0
        t0 = time.perf_counter()
        r, w = sp.read(files[0], bufs[0]), sp.write(files[1], bufs[1])
        r.result(), w.result()
        mixed_s = time.perf_counter() - t0
    finally:
        sp.close()
    moved = bufs[0].file_image.numel()
    return {"read": moved / read_s, "write": moved / write_s, "mixed": 2 * moved / mixed_s}


def run_layout(
    name: str,
    numel: int,
    sub: int,
    host_cache: int | None,
    path: str | None,
    steps: int,
    backend: str,
    progress: Progress,
    io_cores: int = 1,
) -> dict:
    torch.manual_seed(0)
    # Host tensors on purpose: flat weights and gradients of an engine with no model on a device.
    weight = torch.randn(numel, device="cpu")
    grad = torch.randn(numel, device="cpu") * 1e-3
    bindings = [FlatSubgroup(weight[o : o + sub], grad[o : o + sub]) for o in range(0, numel, sub)]
    cfg = EngineConfig(
        subgroup_numel=sub,
        host_cache_bytes=host_cache,
        io_backend=backend,
        host_adam="auto",
        paths=(StoragePath(path=path, read_bytes_per_s=1e9, write_bytes_per_s=1e9),) if path else (),
        io_cores=io_cores,
    )
    eng = SubgroupEngine(bindings, cfg, Knobs(prefetch_depth=2, io_concurrency={path: 8} if path else {}))
    task = progress.add_task(f"{name}", total=steps)
    try:
        for _ in range(steps):
            eng.step([AdamWHyper(lr=1e-4)])
            progress.advance(task)
    finally:
        eng.close()
    recs = eng.telemetry.records[1:]  # the first step materialises state and writes it once
    med = lambda f: statistics.median(f(r) for r in recs)  # noqa: E731
    return {
        "layout": name,
        "update_s": med(lambda r: r.update_s),
        "read_wait_s": med(lambda r: r.read_wait_s),
        "write_wait_s": med(lambda r: r.write_wait_s),
        "bytes_per_param": med(lambda r: r.bytes_moved_per_param),
        "bytes_read": med(lambda r: sum(r.bytes_read.values())),
        "bytes_written": med(lambda r: sum(r.bytes_written.values())),
        "read_bytes_per_s": med(lambda r: r.read_bytes_per_s),
        "write_bytes_per_s": med(lambda r: r.write_bytes_per_s),
        "cache_hits": med(lambda r: r.cache_hits),
        "host_kernel": eng.host_kernel_name,
        "io_backend": eng.swap_paths.io_backend,
        "io_cores": io_cores,
    }


def compare_cpu_update(numel: int, sub: int, steps: int, progress: Progress) -> dict:
    """Host-only engine step against the anchor, DeepSpeedCPUAdam (ZeRO-Offload's CPU step), on
    the same subgroups and gradients. Steps alternate between the two so that both see the same
    machine; each includes copying the updated fp32 values into the model's weights."""
    from deepspeed.ops.adam import DeepSpeedCPUAdam

    torch.manual_seed(0)
    # Host tensors on purpose: the anchor is a CPU optimizer, and the engine has no device here.
    grad = torch.randn(numel, device="cpu") * 1e-3
    weight = torch.randn(numel, device="cpu")
    ds_weight = weight.clone()
    bindings = [FlatSubgroup(weight[o : o + sub], grad[o : o + sub]) for o in range(0, numel, sub)]
    eng = SubgroupEngine(bindings, EngineConfig(subgroup_numel=sub, host_adam="auto"))
    params = []
    for o in range(0, numel, sub):
        p = torch.nn.Parameter(ds_weight[o : o + sub].clone())
        p.grad = grad[o : o + sub]
        params.append(p)
    ds = DeepSpeedCPUAdam(params, lr=1e-4, adamw_mode=True)
    task = progress.add_task("host-only vs DeepSpeedCPUAdam", total=steps)
    ours, theirs = [], []
    for _ in range(steps):
        ours.append(eng.step([AdamWHyper(lr=1e-4)]).update_s)
        t0 = time.perf_counter()
        ds.step()
        for k, p in enumerate(params):
            ds_weight[k * sub : k * sub + p.numel()].copy_(p.data)
        theirs.append(time.perf_counter() - t0)
        progress.advance(task)
    eng.close()
    o, t = statistics.median(ours[1:]), statistics.median(theirs[1:])
    return {
        "engine_update_s": o,
        "deepspeed_cpu_adam_update_s": t,
        "engine_params_per_s": numel / o,
        "deepspeed_cpu_adam_params_per_s": numel / t,
        "ratio": t / o,
        "host_kernel": eng.host_kernel_name,
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_engine_run_args(ap, "steps per layout; the first is excluded (default 6)")
    args = ap.parse_args()
    if args.emulate:
        return run_emulated(__file__, args.emulate, sys.argv[1:], size_gb=6)
    if not os.path.isdir(args.nvme):
        console.print(f"[red]--nvme {args.nvme} is not a directory: create it first[/red]")
        return 2
    numel, sub = int(args.params), int(args.subgroup)
    state_bytes = STATE_BYTES_PER_ELEMENT * numel
    n_sub = -(-numel // sub)
    half_cache = (n_sub // 2) * payload_bytes(sub)  # half the subgroups, as the engine counts bytes
    out: dict = {"machine": _machine(), "params": numel, "subgroup": sub, "path": args.nvme, "command": " ".join(sys.argv)}
    with Progress(console=console, transient=True) as progress:
        t = progress.add_task("storage ceiling", total=None)
        out["ceiling_bytes_per_s"] = measure_ceiling(args.nvme, min(state_bytes // 2, 1 << 30), 8, args.io_backend)
        progress.remove_task(t)
        t = progress.add_task("host AdamW kernels", total=None)
        out["host_kernel_params_per_s"] = measure_host_kernels()
        progress.remove_task(t)
        out["cpu_update"] = compare_cpu_update(numel, sub, 2 * args.steps + 1, progress)
        out["layouts"] = [
            run_layout("host-only", numel, sub, None, None, args.steps, args.io_backend, progress),
            run_layout("all-nvme", numel, sub, 0, args.nvme, args.steps, args.io_backend, progress),
            run_layout("half-cache", numel, sub, half_cache, args.nvme, args.steps, args.io_backend, progress),
            # EngineConfig.io_cores=0: the host lane's threads share every core with the I/O
            # threads' checksums (before issue 18); the rows above leave them one core.
            run_layout("all-nvme, io_cores=0", numel, sub, 0, args.nvme, args.steps, args.io_backend, progress, 0),
            run_layout("half-cache, io_cores=0", numel, sub, half_cache, args.nvme, args.steps, args.io_backend, progress, 0),
        ]
    ceil = out["ceiling_bytes_per_s"]
    for lay in out["layouts"]:
        # Reads and writes overlap; the floor is the longer of the two at the path's own ceiling.
        lay["floor_s"] = max(lay["bytes_read"] / ceil["read"], lay["bytes_written"] / ceil["write"])
        lay["time_over_floor"] = lay["update_s"] / lay["floor_s"] if lay["floor_s"] else None
    k = out["host_kernel_params_per_s"]
    out["host_kernel_vs_deepspeed"] = k["torch"] / k["deepspeed"] if "deepspeed" in k else None
    _print(out)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=2)
    return 0


def _machine() -> dict:
    import psutil

    from perf.probe import cpu_model

    return {
        "cpu": cpu_model(),
        "cores": os.cpu_count(),
        "memory_gib": round(psutil.virtual_memory().total / 2**30, 1),
        "torch": torch.__version__,
        "cuda": torch.cuda.is_available(),
    }


def _print(out: dict) -> None:
    c = Console(width=150)
    ceil = out["ceiling_bytes_per_s"]
    c.print(f"[bold]{out['params']:.3g} params[/bold], subgroup {out['subgroup']:.3g}, path {out['path']}")
    c.print(
        f"ceiling (O_DIRECT, same run): read {ceil['read'] / 1e6:.0f} MB/s, write {ceil['write'] / 1e6:.0f} MB/s, "
        f"mixed {ceil['mixed'] / 1e6:.0f} MB/s"
    )
    tab = Table(
        "layout", "update s", "read wait s", "write wait s", "B/param", "read MB/s", "write MB/s", "hits", "floor s", "time/floor"
    )
    for lay in out["layouts"]:
        tab.add_row(
            lay["layout"],
            f"{lay['update_s']:.3f}",
            f"{lay['read_wait_s']:.3f}",
            f"{lay['write_wait_s']:.3f}",
            f"{lay['bytes_per_param']:.2f}",
            f"{lay['read_bytes_per_s'] / 1e6:.0f}",
            f"{lay['write_bytes_per_s'] / 1e6:.0f}",
            f"{lay['cache_hits']:.0f}",
            f"{lay['floor_s']:.3f}",
            f"{lay['time_over_floor']:.2f}" if lay["time_over_floor"] else "-",
        )
    c.print(tab)
    k = out["host_kernel_params_per_s"]
    c.print(
        "host AdamW kernels (params/s): "
        + ", ".join(f"{n} {v:.3g}" for n, v in k.items())
        + (f"; torch/deepspeed {out['host_kernel_vs_deepspeed']:.2f}" if out["host_kernel_vs_deepspeed"] else "")
    )
    cu = out["cpu_update"]
    c.print(
        f"CPU update, alternating steps: engine host-only {cu['engine_params_per_s']:.3g} params/s "
        f"(kernel {cu['host_kernel']}), DeepSpeedCPUAdam {cu['deepspeed_cpu_adam_params_per_s']:.3g} params/s; "
        f"engine speed / DeepSpeed speed = {cu['ratio']:.2f}"
    )


if __name__ == "__main__":
    raise SystemExit(main())
