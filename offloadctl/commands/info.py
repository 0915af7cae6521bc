"""Show what the engine can use on this machine: I/O backends, AdamW kernels, devices.

Measures the host AdamW kernels briefly (under a second once DeepSpeed's ops are built).
"""
from __future__ import annotations

import argparse
import json

from rich.console import Console
from rich.table import Table


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--json", action="store_true", help="print JSON instead of a table")


def collect() -> dict:
    import torch

    from engine.adamw import measure_host_kernels
    from engine.native_ops import import_deepspeed, load_async_io

    from .. import __version__

    try:
        ds_version = import_deepspeed().__version__
    except Exception:
        ds_version = None
    return {
        "offloadctl": __version__,
        "torch": torch.__version__,
        "deepspeed": ds_version,
        "cuda": torch.cuda.is_available(),
        "gpus": [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())],
        "io_backends": ["aio", "posix"] if load_async_io() is not None else ["posix"],
        "host_adamw_params_per_s": measure_host_kernels(),
    }


def run(args: argparse.Namespace) -> int:
    data = collect()
    if args.json:
        print(json.dumps(data, indent=2))
        return 0
    t = Table("what", "value", title="offloadctl info")
    for k, v in data.items():
        if k == "host_adamw_params_per_s":
            v = ", ".join(f"{n}: {r:.3g}" for n, r in v.items())
        elif isinstance(v, list):
            v = ", ".join(v) or "none"
        t.add_row(k, str(v))
    Console().print(t)
    return 0
