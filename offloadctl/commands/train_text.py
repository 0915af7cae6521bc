"""What ``offloadctl train`` says of a launch: the warnings about its storage paths, the dry
run's block and the start line, each wrapped to the terminal, and the line the launch ends with."""

from __future__ import annotations

import argparse
import json
import os
import shlex
import shutil
import signal
import textwrap

from engine.storage.blockdev import device_of
from engine.text import printable
from engine.units import format_size
from integrations import launcher
from integrations.launch_commands import launch_program, local_slots, ranks_of, script_of
from integrations.rank_entry import SETTINGS_ENV
from integrations.run_output import LauncherOutput, log_path

DRY_RUN_LABEL = 11
"""Columns of a dry run's row labels ('launch:    ')."""


def storage_notes(args: argparse.Namespace) -> list[str]:
    """A warning for each storage path whose file system keeps its files in RAM, filled to the
    terminal (at most 120 columns), paths kept whole."""
    notes = (_in_memory(flag, path) for flag, paths in (("--nvme", args.nvme), ("--remote", args.remote)) for path in paths)
    width = max(40, min(shutil.get_terminal_size().columns, 120))
    return [textwrap.fill(n, width, subsequent_indent="    ", break_on_hyphens=False, break_long_words=False) for n in notes if n]


def _in_memory(flag: str, path: str) -> str | None:
    """A warning for a storage path whose file system keeps its files in RAM (tmpfs, ramfs), or None."""
    kind = device_of(os.path.abspath(path)).name.split(":", 1)[0]
    if kind not in ("tmpfs", "ramfs"):
        return None
    return (
        f"offloadctl: warning: {flag} {path} is on {kind}: the state swapped there sits in RAM, outside --host-memory; "
        f"give a path on a disk, or keep the state in host memory on purpose with --host-cache"
    )


def dry_run_output(args: argparse.Namespace, launch: launcher.Launch, resolved: dict | None) -> str:
    """What ``train --dry-run`` prints: the launch and ``resolved`` as JSON with ``--json``,
    else :func:`dry_run_lines`."""
    if args.json:
        return json.dumps({**launch.to_json(), "launch": resolved}, indent=2)
    return "\n".join(dry_run_lines(args, launch, resolved))


def dry_run_lines(
    args: argparse.Namespace, launch: launcher.Launch, resolved: dict | None = None, width: int | None = None
) -> list[str]:
    """``train --dry-run`` for a person: one block, a row each for the launch, the ranks, where
    the state goes, the run dir, the knobs and pins, the tuner, the recording and the
    environment, wrapped to the terminal (``--json`` gives the exact commands and settings).
    ``resolved``: what DeepSpeed's launcher would start (``launcher.resolved_launch``)."""
    settings = launch.settings
    zero = settings.zero
    width = width or max(60, min(shutil.get_terminal_size().columns, 120))
    script = [
        os.path.relpath(args.script) if not os.path.relpath(args.script).startswith("..") else args.script,
        *args.script_args,
    ]
    if launch.hooked:
        rows = [
            (
                "launch",
                shlex.join(launch.command) + f" ({launch.launcher}; each rank's interpreter installs "
                "offloadctl's engine as it starts, then runs the script as given)",
            )
        ]
    else:
        rows = [
            (
                "launch",
                "deepspeed "
                + shlex.join(launcher.launcher_args(vars(args)) + script)
                + " (DeepSpeed's launcher; each rank installs offloadctl's engine, then runs the script as given)",
            )
        ]
    if resolved and "error" in resolved:
        rows.append(("refused", f"DeepSpeed's launcher would refuse this launch: {resolved['error']}"))
    rows.append(("ranks", ranks_text(args, launch)))
    if settings.engine == "stock":
        rows.append(("state", "as the ds_config says: DeepSpeed's own optimizer and offload (--engine stock)"))
    else:
        paths = [f"{p} (NVMe)" for p in zero.nvme_paths] + [f"{p} (remote)" for p in zero.remote_paths]
        cache = (
            "all of it in host memory"
            if zero.host_cache_bytes is None and not paths
            else "none in host memory"
            if zero.host_cache_bytes is None
            else f"{format_size(zero.host_cache_bytes)} per rank in host memory"
        )
        state = f"{'; '.join(paths) or 'no storage path (a ds_config nvme_path becomes one)'}; {cache}; GPU: " + (
            "what it has free after the first forward/backward"
            if zero.device_cache_bytes is None
            else f"{format_size(zero.device_cache_bytes)} per rank"
        )
        state += "; host-memory budget " + (
            f"{format_size(zero.host_memory_bytes)} per rank" if zero.host_memory_bytes else "half of what is available at start"
        )
        rows.append(("state", state))
    rows.append(("run dir", f"{zero.run_dir} (records, telemetry, deepspeed.log)"))
    if settings.engine != "stock":
        k = zero.start_knobs
        knobs = [
            f"prefetch_depth {k.prefetch_depth}",
            "device_fraction " + ("auto" if zero.auto_device_fraction else f"{k.device_fraction:g}"),
            f"node_lock {'on' if k.node_lock else 'off'}",
            "io_concurrency and stripe weights from a probe of the paths",
        ]
        start = f"the performance model's plan for profile {zero.profile}" if zero.profile else "defaults"
        rows.append(
            (
                "knobs",
                f"{', '.join(knobs)} ({start}); pinned by your options, never tuned: "
                + (", ".join(f"{n}={json.dumps(v)}" for n, v in zero.pins.items()) or "none"),
            )
        )
    rows.append(
        (
            "tuner",
            {
                "auto": "auto: the running daemon, else a private one for this run; it may start from "
                "the tuner's verdict in an earlier run like this one",
                "off": "off: the starting knobs are kept",
            }.get(launch.tuner, launch.tuner),
        )
    )
    rec = settings.recorder
    rows.append(
        (
            "recording",
            "off (--no-record)"
            if rec is None
            else f"phases per iteration, samples at {rec.sample_hz:g} Hz: offloadctl report {zero.run_dir}",
        )
    )
    rows.append(
        (
            "env",
            " ".join(
                f"{k}={shlex.quote(v)}" if k != SETTINGS_ENV else f"{k}=... (the settings above, as JSON: --json shows them)"
                for k, v in launch.env.items()
            ),
        )
    )
    if launch.preview is not None:
        rows.append(("preview", launch.preview["summary"]))
    out = ["dry run, nothing started (--json: the exact commands and settings)"]
    for label, text in rows:
        out += textwrap.wrap(
            printable(text),
            width,
            initial_indent=f"{label + ':':<{DRY_RUN_LABEL}}",
            subsequent_indent=" " * DRY_RUN_LABEL,
            break_on_hyphens=False,
            break_long_words=True,
        )
    return out


def ranks_text(args: argparse.Namespace, launch: launcher.Launch | None = None) -> str:
    """How many ranks the launch starts, as far as its options say without asking the launcher."""
    if launch is not None and launch.hooked and launch_program_of(args):
        return ranks_of(launch.launcher, launch.command)
    gpus, nodes = getattr(args, "ds_num_gpus", None), getattr(args, "ds_num_nodes", None)
    multi = nodes or getattr(args, "ds_hostfile", None) or getattr(args, "ds_include", None)
    if gpus and nodes:
        return f"{gpus} ranks per node on {nodes} nodes"
    if multi:
        return f"{gpus + ' ranks' if gpus else 'a rank per slot'} per host of the hostfile"
    n = int(str(gpus)) if gpus else local_slots()
    return f"{n} rank{'s' if n != 1 else ''}"


def launch_program_of(args: argparse.Namespace) -> str | None:
    return launch_program(args.script)


def start_line(args: argparse.Namespace, settings, tuner: str, launch: launcher.Launch | None = None) -> str:
    """The run's first line, printed before the launcher starts (the ranks take seconds to say
    anything): how many ranks, the run's id, where DeepSpeed's log goes, and how to watch it.
    Wrapped to the terminal."""
    run_dir = settings.run_dir
    script = args.script
    if launch is not None and launch_program_of(args):
        script = script_of(launch.command) or launch.launcher
    head = (
        f"offloadctl: starting {ranks_text(args, launch)} of {os.path.basename(script)} (run "
        f"{settings.zero.run_id}); DeepSpeed's log: {log_path(run_dir)}"
    )
    if settings.engine == "stock":
        watch = "DeepSpeed's own optimizer and offload (--engine stock), recorded for offloadctl report"
    elif tuner == "off":
        watch = "tuner off (--tuner off): the knobs stay as planned"
    else:
        watch = f"watch it, pin a knob: offloadctl tune --run-dir {shlex.quote(run_dir)}"
    width = max(40, min(shutil.get_terminal_size().columns, 120))
    return "\n".join(
        textwrap.fill(
            printable(p),
            width,
            initial_indent="" if i == 0 else "  ",
            subsequent_indent="    ",
            break_on_hyphens=False,
            break_long_words=False,
        )
        for i, p in enumerate((head, watch))
    )


def ending_note(rc: int, stopped_by: signal.Signals | None, output: LauncherOutput, *, verbose: bool) -> str | None:
    """The line a launch ends with, before the summary: the signal that stopped it, which rank
    failed first and how, or where DeepSpeed's log is; None where the ranks said it all."""
    if stopped_by is not None:
        return f"offloadctl: stopped by {stopped_by.name}: ranks stopped, their swap files removed"
    failure = output.failures.summary(output.path) if rc != 0 else None
    if failure:
        return failure
    if rc not in (0, 2) and not output.failures.refused and output.hidden_lines and not verbose:
        # 2 (or a launcher's 1 for a rank's 2): the ranks' one-line error said it all
        return f"offloadctl: the run failed (exit status {rc}); DeepSpeed's log is in {output.path}"
    return None


def tuner_stopped_line(tuner_socket: str, log: str) -> str:
    """Said after the run when its tuner daemon is gone and has no view of it to give."""
    return (
        f"tuner: its daemon ({tuner_socket}) stopped during the run, which went on with the knobs it had; the daemon's log: {log}"
    )
