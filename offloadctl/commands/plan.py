"""Predict iteration time of the best offload plan and of stock DeepSpeed's.

From a hardware profile (made by offloadctl profile save, or one of the examples
in profiles/) and the model size, pick the fastest plan: how much optimizer
state stays in host memory and on the GPU, how much of the update runs on the
GPU, how far to read ahead, and how many requests to keep in flight per storage
path. It is printed beside a few other plans and stock DeepSpeed ZeRO-3 (CPU
offload, ZeRO-Infinity NVMe, Twin-Flow). Nothing is measured: it answers at
once, for any model size. docs/perfmodel.md explains the model.

examples:
  offloadctl plan --profile h100-node --params 70B --ranks 8 --fwd-bwd-s 12
  offloadctl plan --profile ./my.toml --params 1.5T --host-memory 1TB --json
"""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import sys
import textwrap

from rich import box
from rich.console import Console
from rich.markup import escape
from rich.table import Table

from engine.config import Knobs
from engine.errors import ConfigError
from engine.units import format_count, format_seconds, format_size, tidy_numbers
from offloadctl.options import add_size_epilog, add_size_option, size_bytes

_SUFFIX = {"": 1, "K": 1e3, "M": 1e6, "B": 1e9, "G": 1e9, "T": 1e12}
_PARAMS_RE = re.compile(r"^\s*([0-9]*\.?[0-9]+(?:[eE][+-]?[0-9]+)?)\s*([KMBGT]?)\s*$", re.IGNORECASE)
HELP_WIDTH = 79
"""Help text is laid out by hand (raw), so it is filled to fit an 80-column terminal."""


def parse_params(text: str) -> int:
    """``7e9``, ``7B``, ``1.5T``, ``70M``, ``350K`` or a plain integer, as a parameter count."""
    m = _PARAMS_RE.match(str(text))
    value = float(m.group(1)) * _SUFFIX[m.group(2).upper()] if m else math.nan
    if not (math.isfinite(value) and value >= 1):
        raise ConfigError(f"--params {text!r} is not a parameter count: give a number like 7e9, 7B, 1.5T or 70M")
    if value > 1e15:
        raise ConfigError(f"--params {text!r} is over 1e15 parameters: give the model's real size, like 7e9 or 70B")
    return int(round(value))


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--profile",
        metavar="NAME|PATH",
        help="hardware profile: a name or a TOML file (required; offloadctl profile save makes one, profiles/ has examples)",
    )
    p.add_argument("--params", required=True, metavar="N", help="model parameters: 7e9, 7B, 1.5T, 70M")
    p.add_argument("--ranks", type=int, default=1, metavar="R", help="ranks (GPUs) per node (default 1)")
    p.add_argument("--nodes", type=int, default=1, metavar="K", help="nodes (default 1)")
    add_size_option(
        p,
        "--host-memory",
        dest="host_memory",
        deprecated="--host-gb",
        help="host memory for optimizer state, per node, e.g. 512GB (default: half the profile's memory)",
    )
    add_size_option(
        p,
        "--gpu-headroom",
        dest="gpu_headroom",
        deprecated="--gpu-headroom-gb",
        help="GPU memory free during the update phase, per GPU, e.g. 40GB (default: half the GPU's memory)",
    )
    p.add_argument("--fwd-bwd-s", type=float, metavar="S", help="forward+backward seconds per iteration (default 0)")
    p.add_argument(
        "--subgroup",
        type=float,
        default=1e7,
        metavar="N",
        help="parameters per subgroup, the unit moved to and from storage (default 1e7)",
    )
    p.add_argument(
        "--path",
        action="append",
        default=None,
        metavar="PATH",
        help="use only these of the profile's storage paths (repeatable; default: all)",
    )
    p.add_argument("--json", action="store_true", help="print JSON instead of a table")
    add_size_epilog(p)
    p.epilog = fill_paragraphs(p.epilog or "")  # add_size_epilog gave it one


def no_profile_text() -> str:
    """What to do without --profile: the user's saved profiles, how to measure one, the examples."""
    from perf.profile_toml import list_profiles, profile_dir

    mine = list_profiles(profile_dir())
    examples = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))), "profiles")
    shown = os.path.relpath(examples) if not os.path.relpath(examples).startswith("..") else examples
    found = sorted(f for f in os.listdir(examples) if f.endswith(".toml")) if os.path.isdir(examples) else []
    text = "plan needs a hardware profile: give --profile NAME|PATH"
    if mine:
        text += f" (yours: {', '.join(mine)})"
    text += "; measure this machine with `offloadctl profile save NAME --nvme PATH --quick` (under 2 minutes)"
    if found:
        text += f", or try an example (datasheet figures, not a measurement): --profile {os.path.join(shown, found[0])}"
    return text


def fill_paragraphs(text: str, width: int = HELP_WIDTH) -> str:
    """``text``'s paragraphs (blank-line separated) refilled to ``width`` columns."""
    return "\n\n".join(textwrap.fill(" ".join(par.split()), width) for par in text.split("\n\n"))


def run(args: argparse.Namespace) -> int:
    from perf.model import Workload
    from perf.nofit import no_fit
    from perf.profile_toml import load_profile
    from perf.search import NoPlanFits, alternatives

    if not args.profile:
        raise ConfigError(no_profile_text())
    profile = load_profile(args.profile)
    if not (math.isfinite(args.subgroup) and args.subgroup >= 1 and float(args.subgroup).is_integer()):
        raise ConfigError(f"--subgroup must be a whole number of elements, 1 or more, got {args.subgroup:g}")
    wl = Workload(
        params=parse_params(args.params),
        ranks=args.ranks,
        nodes=args.nodes,
        subgroup_numel=int(args.subgroup),
        fwd_bwd_s=args.fwd_bwd_s,
        host_bytes=size_bytes(args.host_memory),
        gpu_headroom_bytes=size_bytes(args.gpu_headroom),
    )
    try:
        preds = alternatives(profile, wl, args.path)
    except NoPlanFits as e:
        return _no_fit(args, profile, wl, no_fit(profile, wl, args.path, str(e)))
    if args.json:
        print(
            json.dumps(
                {
                    "profile": {"name": profile.name, "source": profile.source.kind},
                    "workload": {k: getattr(wl, k) for k in wl.__dataclass_fields__},
                    "fits": True,
                    "best": preds[0].plan.name,
                    "plans": [_finite({**p.to_dict(), "label": plan_label(p.plan.name)}) for p in preds],
                },
                indent=2,
            )
        )
        return 0
    _print(profile, wl, preds)
    return 0


def _no_fit(args: argparse.Namespace, profile, wl, nf) -> int:
    """No plan fits: each plan's needs per node against what the node has, what fails, and what
    to add, as a table (or JSON); then one line on stderr, and exit status 2."""
    if args.json:
        print(
            json.dumps(
                {
                    "profile": {"name": profile.name, "source": profile.source.kind},
                    "workload": {k: getattr(wl, k) for k in wl.__dataclass_fields__},
                    "fits": False,
                    "best": None,
                    "plans": [],
                    "no_fit": nf.to_dict(),
                },
                indent=2,
            )
        )
    else:
        _print_no_fit(profile, wl, nf)
    print(f"offloadctl: {no_fit_line(nf)}", file=sys.stderr)
    return 2


def no_fit_line(nf) -> str:
    """The one line of a plan that does not fit, within 80 columns with its ``offloadctl: ``."""
    first = nf.fixes[0] if nf.fixes else None
    if first is None:
        return "no plan fits this node, nor 4096 of them: see the table above"
    fix = {
        "--host-memory": lambda f: f"raise --host-memory to {f['text'].split()[1]}",
        "--nodes": lambda f: f"run on --nodes {f['value']}",
        "storage": lambda f: f"add {f['text'].split()[0]} of storage",
    }[first["option"]](first)
    return f"no plan fits this node: {fix} (see above)"


_FAILS = {"host": "host memory", "no path": "a storage path", "no GPU": "a GPU", "gpu": "GPU memory"}


def _print_no_fit(profile, wl, nf) -> None:
    con = Console(highlight=False)
    ranks = f"{wl.ranks} rank{'s' if wl.ranks != 1 else ''} per node x {wl.nodes} node{'s' if wl.nodes != 1 else ''}"
    con.print(
        f"[bold]{format_count(wl.params)} params[/], {ranks}; profile {escape(profile.name)} ({escape(profile.source.kind)})"
    )
    con.print(
        "[bold red]No plan fits this node.[/] What each plan needs per node, against what the node has (! marks what it lacks):"
    )
    paths = list(nf.has["paths"])
    named = len(paths) <= 2 and all(len(p) <= 22 for p in paths)
    heads = {p: (p if named else f"path {i + 1}") for i, p in enumerate(paths)}
    gpu = any("gpu" in n.fails for n in nf.needs)
    tab = Table(box=box.SIMPLE_HEAD, pad_edge=False, show_edge=False, collapse_padding=True)
    for name in ["plan", "host memory", *heads.values(), *(["GPU"] if gpu else []), "lacks"]:
        tab.add_column(escape(name), justify="left" if name in ("plan", "lacks") else "right", no_wrap=True)
    has = nf.has
    tab.add_row(
        "this node has",
        format_size(has["host_per_node"]) + "  ",
        *((format_size(has["paths"][p]) if has["paths"][p] else "?") + "  " for p in paths),
        *([format_size(has["gpu_per_rank"]) + "  "] if gpu else []),
        "",
        style="bold",
    )

    def cell(value, failed: bool) -> str:
        return ("-" if not value else format_size(value)) + (" !" if failed else "  ")

    for n in nf.needs:
        lacks = [_FAILS.get(f, heads.get(f, f)) for f in n.fails]
        lacks = [x if x not in paths and x not in heads.values() else "storage" for x in lacks]
        tab.add_row(
            escape(plan_label(n.name)),
            cell(n.host, "host" in n.fails),
            *(cell(n.paths.get(p), p in n.fails) for p in paths),
            *([cell(n.gpu, "gpu" in n.fails)] if gpu else []),
            escape(", ".join(dict.fromkeys(lacks))),
            style="dim" if n.name.startswith("stock") else None,
        )
    con.print(tab)
    if not named:
        for p, h in heads.items():
            con.print(f"{h}: {p}", style="dim", markup=False)
    con.print(
        f"host memory: optimizer state and staging buffers, per node (--host-memory; the node has "
        f"{format_size(has['memory_per_node'])} in all). A storage path: swap files per node, against its "
        f"capacity.{' GPU: per rank.' if gpu else ''} DS: stock DeepSpeed ZeRO-3.",
        style="dim",
        markup=False,
    )
    if nf.fixes:
        con.print("[bold]To fit, any one of:[/]")
        for f in nf.fixes:
            # A command in backticks stays on one line, to copy whole.
            text = re.sub(r"`[^`]*`", lambda m: m.group(0).replace(" ", "\u00a0"), f["text"])
            con.print(
                textwrap.fill(
                    text,
                    min(con.width, HELP_WIDTH + 1) - 1,
                    initial_indent="  ",
                    subsequent_indent="    ",
                    break_on_hyphens=False,
                    break_long_words=False,
                ).replace("\u00a0", " "),
                markup=False,
            )


def _finite(x):
    """JSON has no infinity: an unbounded time (a stock setup that cannot run) becomes null."""
    if isinstance(x, float) and not math.isfinite(x):
        return None
    if isinstance(x, dict):
        return {k: _finite(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_finite(v) for v in x]
    return x


# -- the table ------------------------------------------------------------------------------------

_LABELS = {
    "best": "best",
    "engine defaults": "defaults",
    "best without device lane": "no GPU lane",
    "best with device cache": "GPU cache",
    "all state on storage": "all on disk",
    "all state in host memory": "all in memory",
    "stock ZeRO-3 CPU offload": "DS CPU offload",
    "stock ZeRO-Infinity NVMe": "DS Infinity",
    "stock Twin-Flow": "DS Twin-Flow",
}
"""Table names of the plans: short enough for an 80-column terminal. DS: stock DeepSpeed."""
_BOTTLENECKS = {"cpu": "CPU", "gpu": "GPU", "pcie": "PCIe", "none": "-"}
_BREAKDOWN = {
    "storage": "storage",
    "cpu_update": "CPU update",
    "gpu_update": "GPU update",
    "pcie": "PCIe",
    "prefetch_latency": "waiting for reads",
    "fill_drain": "pipeline fill and drain",
}
LEGEND = (
    "host, disk: optimizer state per node in host memory and on disk; GPU: per GPU. lane: share of the "
    "update on the GPU. prefetch: subgroups read ahead. conc.: requests in flight per storage path; "
    "lock: one rank at a time per disk. B/param: bytes read and written per parameter. DS: stock "
    "DeepSpeed ZeRO-3 (CPU offload, ZeRO-Infinity NVMe, Twin-Flow)."
)


def plan_label(name: str) -> str:
    """The table's name for the plan called ``name``: ``DS Infinity`` for ``stock ZeRO-Infinity NVMe``."""
    return _LABELS.get(name.split(" (")[0], name)


def bottleneck_label(text: str) -> str:
    """``storage (nvme0n1)``: ``disk nvme0n1``; ``cpu``: ``CPU``."""
    m = re.fullmatch(r"storage \((.*)\)", text)
    return f"disk {m.group(1)}" if m else _BOTTLENECKS.get(text, text)


def ranked(preds: list) -> list:
    """The best plan, then the other plans that fit by iteration time, then those that do not fit."""
    best, rest = preds[0], preds[1:]
    return [best] + sorted(rest, key=lambda p: (not p.feasible, p.iteration_s if p.feasible else 0.0))


def _print(profile, wl, preds) -> None:
    con = Console(highlight=False)
    rows = ranked(preds)
    best = preds[0]
    ranks = f"{wl.ranks} rank{'s' if wl.ranks != 1 else ''} per node x {wl.nodes} node{'s' if wl.nodes != 1 else ''}"
    con.print(
        f"[bold]{format_count(wl.params)} params[/], {ranks}; profile {escape(profile.name)} ({escape(profile.source.kind)})"
    )
    wide = _table(rows, best, settings=True, times=True)
    if _width(wide) <= con.width:
        con.print(wide)
    else:
        con.print(_table(rows, best, settings=False, times=True))
        con.print(_table(rows, best, settings=True, times=False))
    con.print(LEGEND, style="dim", markup=False)
    for p in rows:
        if not p.feasible:
            why = "; ".join(tidy_numbers(n) for n in p.notes[:1])
            con.print(f"{plan_label(p.plan.name)} does not fit: {why}", style="dim", markup=False)
    twinflow = next((p.plan.name for p in rows if p.plan.name.startswith("stock Twin-Flow (")), None)
    if twinflow:
        ratio = twinflow.split("(", 1)[1].rstrip(")")
        con.print(f"DS Twin-Flow: {ratio}, the share of optimizer state updated on the CPU", style="dim", markup=False)
    b = best.breakdown
    parts = ", ".join(f"{label} {format_seconds(b[k])}" for k, label in _BREAKDOWN.items() if b.get(k))
    con.print(
        f"[bold green]best[/]: {format_seconds(best.iteration_s)} per iteration, "
        f"{format_seconds(best.update_s)} of it the update phase ({parts})"
    )
    weights = best.plan.knobs.stripe_weights
    if weights:
        total = sum(weights.values()) or 1.0
        con.print("stripes: " + ", ".join(f"{escape(k)} {w / total:.0%}" for k, w in weights.items()))
    for note in best.notes:
        con.print(f"best: {tidy_numbers(note)}", style="dim", markup=False)


def _table(rows, best, *, settings: bool, times: bool):
    """The plans as a table: where state lives and the times (``times``), the knobs (``settings``)."""
    tab = Table(box=box.SIMPLE_HEAD, pad_edge=False, show_edge=False, collapse_padding=True)
    columns = ["plan"]
    if times:
        columns += ["host", "disk", "GPU"]
    if settings:
        columns += ["lane", "prefetch", "conc.", "lock", "B/param"]
    if times:
        columns += ["update", "iteration", "bottleneck"]
    for name in columns:
        tab.add_column(name, justify="left" if name in ("plan", "bottleneck", "lock") else "right", no_wrap=True)
    for p in rows:
        knobs, m = p.plan.knobs, p.memory
        cells = {
            "plan": escape(plan_label(p.plan.name)),
            "host": format_size(m.get("host_per_node")) if m.get("host_per_node") else "-",
            "disk": format_size(m.get("storage_per_node")) if m.get("storage_per_node") else "-",
            "GPU": format_size(m.get("gpu_per_rank")) if m.get("gpu_per_rank") else "-",
        }
        conc = ",".join(sorted({str(c) for c in knobs.io_concurrency.values()}, key=int))
        cells["conc."] = conc or (str(Knobs.DEFAULT_IO_CONCURRENCY) if m.get("storage_per_node") else "-")
        cells.update(
            {
                "lane": f"{knobs.device_fraction:.2f}",
                "prefetch": str(knobs.prefetch_depth),
                "lock": "yes" if knobs.node_lock else "no",
                "B/param": f"{p.bytes_per_param:.1f}",
            }
        )
        if p.feasible:
            cells.update(
                {
                    "update": format_seconds(p.update_s),
                    "iteration": format_seconds(p.iteration_s),
                    "bottleneck": escape(bottleneck_label(p.bottleneck)),
                }
            )
        else:
            cells.update({"update": "-", "iteration": "-", "bottleneck": "does not fit"})
        tab.add_row(*(cells[c] for c in columns), style="bold green" if p is best else ("dim" if not p.feasible else None))
    return tab


def _width(renderable) -> int:
    """Columns ``renderable`` takes when nothing is wrapped."""
    wide = Console(width=1000, file=None, record=False, color_system=None)
    with wide.capture() as cap:
        wide.print(renderable)
    return max((len(line.rstrip()) for line in cap.get().splitlines()), default=0)
