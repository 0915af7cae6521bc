"""Show what the engine can use on this machine: DeepSpeed's native ops, I/O backends, AdamW kernels, devices.

Measures the host AdamW kernels briefly (under a second once DeepSpeed's ops are built).
Compiles nothing unless asked: ``--build`` first builds the native ops that are missing or out of
date (minutes, with progress; ``make setup`` runs it), recovering locks left by interrupted builds.
Checks the installed DeepSpeed against what the ZeRO-3 integration overrides and reads
(``integrations/ds_compat.py``): a mismatch is shown, then exits with status 2 and the one-line
error, so that ``make setup`` stops there.
"""
from __future__ import annotations

import argparse
import json
import sys

from rich.console import Console
from rich.table import Table


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--json", action="store_true", help="print JSON instead of a table")
    p.add_argument("--build", action="store_true",
                   help="first build DeepSpeed's native ops that are missing or out of date (progress on stderr)")


def collect() -> dict:
    import torch

    from engine.adamw import measure_host_kernels
    from engine.errors import ConfigError
    from engine.host_kernel import chosen_host_kernel, host_lane_rate
    from engine.storage.native_ops import OPS, import_deepspeed, op_state
    from integrations import ds_compat
    from offloadctl import __version__

    try:
        ds_version = import_deepspeed().__version__
    except Exception:
        ds_version = None
    try:
        integration = ds_compat.integration_status()
    except ConfigError as e:
        integration = str(e)
    ops = {name: op_state(name) for name in OPS}
    return {
        "offloadctl": __version__,
        "torch": torch.__version__,
        "deepspeed": ds_version,
        # "ok (DeepSpeed X)", or the one-line error naming what does not match and the fix.
        "deepspeed_integration": integration,
        "cuda": torch.cuda.is_available(),
        "gpus": [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())],
        "native_ops": {name: st.to_json() for name, st in ops.items()},
        "io_backends": ["aio", "posix"] if ops["async_io"].state == "built" else ["posix"],
        "host_adamw_params_per_s": measure_host_kernels(),
        # What runs take: the kernel of the faster host lane (its whole loop timed once per machine
        # and environment, then kept: same seed, same losses), and that lane's rate.
        "host_adamw_kernel": (kernel := chosen_host_kernel()),
        "host_lane_params_per_s": host_lane_rate(kernel),
    }


def build(console: Console) -> None:
    """Build the native ops, one progress bar per compiling op on ``console``."""
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    from engine.storage.native_ops import build_ops

    with Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                  console=console) as progress:
        tasks: dict[tuple[str, str], int] = {}

        def on_step(op: str, done: int, total: int, target: str) -> None:
            where = target.split("/")[0]  # an op's own build directory, or a dependency's
            key = (op, where)
            if key not in tasks:
                label = op if where == op else f"{op} ({where})"
                tasks[key] = progress.add_task(f"compiling {label}", total=total)
            progress.update(tasks[key], completed=done, total=total)

        build_ops(on_step=on_step, on_note=lambda op, msg: progress.console.print(f"{op}: {msg}"))


def _op_cell(st: dict) -> str:
    if st["state"] in ("built", "not needed"):
        return st["state"] if st["state"] == "built" else f"not needed ({st['detail']})"
    hint = "; `offloadctl info --build`" if st["state"] == "not built" else ""
    return f"{st['state']} ({st['detail']}): fallback {st['fallback']}{hint}"


def run(args: argparse.Namespace) -> int:
    if args.build:
        build(Console(stderr=True))  # stderr: stdout stays clean for --json
    data = collect()
    if args.json:
        print(json.dumps(data, indent=2))
        return _integration_exit(data)
    t = Table("what", "value", title="offloadctl info")
    for k, v in data.items():
        if k == "native_ops":
            for name, st in v.items():
                t.add_row(f"op {name}", _op_cell(st))
            continue
        if k == "host_adamw_params_per_s":
            v = ", ".join(f"{n}: {r:.3g}" for n, r in v.items())
        elif isinstance(v, list):
            v = ", ".join(v) or "none"
        t.add_row(k, str(v))
    Console().print(t)
    return _integration_exit(data)


def _integration_exit(data: dict) -> int:
    # The one line again, last and on stderr: where `make setup` (which runs info --build) stops.
    if data["deepspeed_integration"].startswith("ok "):
        return 0
    print(f"offloadctl: {data['deepspeed_integration']}", file=sys.stderr)
    return 2
