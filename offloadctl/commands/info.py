"""Show what offloadctl can use on this machine: DeepSpeed's native ops, I/O, AdamW kernels, GPUs.

Times the host AdamW kernels briefly (under a second once DeepSpeed's ops are built), and the
node's host memory bandwidth once per machine (kept; the host lane is bound by it). Compiles
nothing unless asked: --build first builds the native ops that are missing or out of date
(minutes, with progress; `make setup` runs it). Checks that the installed DeepSpeed has what
offloadctl builds on; if not, says what differs and exits with status 2.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

from rich.console import Console, Group
from rich.table import Column, Table
from rich.text import Text


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--json", action="store_true", help="print JSON instead of a table")
    p.add_argument(
        "--build",
        action="store_true",
        help="first build DeepSpeed's native ops that are missing or out of date (progress on stderr)",
    )


def collect() -> dict:
    import torch

    from engine.adamw import host_kernels as ops_kernels
    from engine.adamw import measure_host_kernels
    from engine.errors import ConfigError
    from engine.host_kernel import HOST_LANE_BYTES_PER_PARAM, host_lane_rate, node_memory_bandwidth, select_host_kernel
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
        "native_ops": {name: op.to_json() for name, op in ops.items()},
        "io_backends": ["aio", "posix"] if ops["async_io"].state == "built" else ["posix"],
        "host_adamw_params_per_s": measure_host_kernels(),
        # What runs take by default (--host-adam auto: stock's kernel where its op is built, so
        # stock's losses), and that lane's rate, timed once per machine and kept.
        "host_adamw_kernel": (kernel := select_host_kernel("auto", device_lane=torch.cuda.is_available())[0]),
        "host_lane_params_per_s": host_lane_rate(kernel),
        # The loop's rate with every kernel, as the choice compared them (kept with it).
        "host_lane_params_per_s_by_kernel": {k: host_lane_rate(k) for k in ops_kernels()},
        # Read plus written, every core copying: what all ranks' host lanes share on this node.
        "host_memory_bytes_per_s": (bw := node_memory_bandwidth()),
        "host_lane_memory_bound_params_per_s": bw / HOST_LANE_BYTES_PER_PARAM if bw else None,
    }


def build(console: Console) -> None:
    """Build the native ops, one progress bar per compiling op on ``console``."""
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TaskID, TextColumn, TimeElapsedColumn

    from engine.storage.native_ops import build_ops

    with Progress(
        TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(), console=console
    ) as progress:
        tasks: dict[tuple[str, str], TaskID] = {}

        def on_step(op: str, done: int, total: int, target: str) -> None:
            where = target.split("/")[0]  # an op's own build directory, or a dependency's
            key = (op, where)
            if key not in tasks:
                label = op if where == op else f"{op} ({where})"
                tasks[key] = progress.add_task(f"compiling {label}", total=total)
            progress.update(tasks[key], completed=done, total=total)

        build_ops(on_step=on_step, on_note=lambda op, msg: progress.console.print(f"{op}: {msg}"))


def _op_cell(op: dict) -> str:
    if op["state"] in ("built", "not needed"):
        return op["state"] if op["state"] == "built" else f"not needed ({op['detail']})"
    hint = "; `offloadctl info --build`" if op["state"] == "not built" else ""
    return f"{op['state']} ({op['detail']}): fallback {op['fallback']}{hint}"


def run(args: argparse.Namespace) -> int:
    if args.build:
        build(Console(stderr=True))  # stderr: stdout stays clean for --json
    data = collect()
    if args.json:
        print(json.dumps(data, indent=2))
        return _integration_exit(data)
    Console().print(info_table(data))
    return _integration_exit(data)


def info_table(data: dict):
    """The table, then the files it names (whole, one per line: a path is never cut in a cell)."""
    from engine.host_kernel import HOST_LANE_BYTES_PER_PARAM, KERNEL_CHOICE_FILE, MEMORY_BANDWIDTH_FILE
    from engine.storage.native_ops import extensions_dir
    from engine.units import format_rate

    t = Table(Column(""), Column("", overflow="fold"), title="offloadctl info", show_header=False)
    t.add_row("versions", f"offloadctl {data['offloadctl']}, torch {data['torch']}, DeepSpeed {data['deepspeed']}")
    t.add_row("DeepSpeed check", data["deepspeed_integration"])
    t.add_row("GPUs", ", ".join(data["gpus"]) or "none")
    for name, op in data["native_ops"].items():
        t.add_row(f"op {name}", _op_cell(op))
    t.add_row("I/O backends", ", ".join(data["io_backends"]))
    names = {"torch": "torch", "deepspeed": "DeepSpeed"}
    rate = lambda r: format_rate(r, "params/s")  # noqa: E731
    t.add_row(
        "AdamW kernels",
        "each kernel alone on one buffer of 16M parameters, timed now: "
        + ", ".join(f"{names.get(n, n)} {rate(r)}" for n, r in data["host_adamw_params_per_s"].items()),
    )
    kernel = data["host_adamw_kernel"]
    loops = data.get("host_lane_params_per_s_by_kernel") or {kernel: data["host_lane_params_per_s"]}
    t.add_row(
        "runs use",
        f"{names.get(kernel, kernel)}, "
        + (
            "the faster lane: beside a GPU lane the losses are not stock's whatever the host runs"
            if data.get("cuda")
            else "stock's kernel, for stock's losses"
            if kernel == "deepspeed"
            else "DeepSpeed's op not being built"
        )
        + "; the whole host update loop (unscale, AdamW, weight copy; 4 subgroups), timed with each "
        "kernel once on this machine: "
        + ", ".join(f"{names.get(n, n)} {rate(r)}" for n, r in loops.items())
        + "; kept [1], for the lane balance and --host-adam fastest",
    )
    files = [("[1]", os.path.join(extensions_dir(), KERNEL_CHOICE_FILE))]
    bw = data.get("host_memory_bytes_per_s")
    if bw:
        files.append(("[2]", os.path.join(extensions_dir(), MEMORY_BANDWIDTH_FILE)))
        t.add_row(
            "host memory",
            f"{format_rate(bw, 'B/s')} read and written, every core copying (measured once, "
            f"kept [2]); the host lane moves {HOST_LANE_BYTES_PER_PARAM} B a parameter, so all ranks' host "
            f"lanes together reach at most {rate(data['host_lane_memory_bound_params_per_s'])}: a run's host "
            f"lane goes at the lower of its loop's rate and its share of that",
        )
    return Group(t, *(Text(f"{mark} {path}", no_wrap=True, overflow="ignore") for mark, path in files))


def _integration_exit(data: dict) -> int:
    # The one line again, last and on stderr: where `make setup` (which runs info --build) stops.
    if data["deepspeed_integration"].startswith("ok "):
        return 0
    print(f"offloadctl: {data['deepspeed_integration']}", file=sys.stderr)
    return 2
