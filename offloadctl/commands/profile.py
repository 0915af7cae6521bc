"""Measure, show, list and compare hardware profiles (TOML files).

  offloadctl profile save [NAME] [--nvme PATH ...] [--remote PATH ...]
                          [--quick] [--io-size SIZE] [--output FILE] [--force]
                          [--io-backend auto|aio|posix]
  offloadctl profile show NAME|FILE [--sweep] [--json]
  offloadctl profile list [--dir DIR] [--json]
  offloadctl profile diff A B [--sweep] [--json]

Profiles live in $OFFLOADCTL_PROFILE_DIR, else ~/.config/offloadctl/profiles/.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import re
import socket
import sys
import time
from typing import Any

from rich import box
from rich.console import Console
from rich.markup import escape
from rich.table import Table

from engine.errors import ConfigError
from engine.units import format_rate, format_size
from offloadctl.options import SizeText, add_size_epilog, add_size_option, size_bytes
from perf.profile import Figure, Profile


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.formatter_class = argparse.RawDescriptionHelpFormatter
    sub = p.add_subparsers(dest="action", metavar="ACTION", required=True)

    s = sub.add_parser(
        "save",
        help="measure this machine and save its profile",
        description="Measure storage paths, host memory, CPU AdamW and (with CUDA) the GPU, and save "
        "the profile as TOML. A full run takes a few minutes per path; --quick under two.",
    )
    s.add_argument("name", nargs="?", metavar="NAME", help="profile name (default: the host name)")
    s.add_argument("--nvme", action="append", default=[], metavar="PATH", help="a node-local storage path (repeatable)")
    s.add_argument(
        "--remote", action="append", default=[], metavar="PATH", help="a remote parallel-file-system path (repeatable)"
    )
    s.add_argument("--quick", action="store_true", help="smaller and shorter measurements (under 2 minutes)")
    s.add_argument("--output", metavar="FILE", help="write here instead of the profile directory")
    s.add_argument("--force", action="store_true", help="replace an existing profile")
    s.add_argument(
        "--io-backend",
        dest="io_backend",
        choices=("auto", "aio", "posix"),
        default="auto",
        help="I/O backend to measure with, as offloadctl train --io-backend (default: auto)",
    )
    # The old name, as offloadctl train calls it --io-backend; hidden, kept for one release.
    s.add_argument(
        "--backend", dest="io_backend", choices=("auto", "aio", "posix"), default=argparse.SUPPRESS, help=argparse.SUPPRESS
    )
    add_size_option(
        s,
        "--io-size",
        dest="io_size",
        help="data file per path, e.g. 4GB (default 8.6GB, 1.1GB with --quick; at most 1/8 of the free space)",
    )
    s.add_argument(
        "--io-bytes", dest="io_size", type=_io_bytes_arg, default=argparse.SUPPRESS, metavar="BYTES", help=argparse.SUPPRESS
    )  # deprecated: still taken, not offered
    s.add_argument(
        "--io-seconds", type=float, metavar="S", help="seconds per point of the I/O sweep (default 3, 0.5 with --quick)"
    )
    add_size_epilog(s)

    for name, help_ in (("show", "show one profile"), ("list", "list saved profiles"), ("diff", "compare two profiles")):
        q = sub.add_parser(name, help=help_, description=help_[0].upper() + help_[1:] + ".")
        if name == "show":
            q.add_argument("profile", metavar="NAME|FILE")
        elif name == "diff":
            q.add_argument("a", metavar="A", help="profile name or file")
            q.add_argument("b", metavar="B", help="profile name or file")
        else:
            q.add_argument("--dir", metavar="DIR", help="list this directory instead of the profile directory")
        if name != "list":
            q.add_argument("--sweep", action="store_true", help="include every point of the I/O sweeps")
        q.add_argument("--json", action="store_true", help="print JSON instead of a table")


def run(args: argparse.Namespace) -> int:
    return {"save": _save, "show": _show, "list": _list, "diff": _diff}[args.action](args)


# -- save -----------------------------------------------------------------------------------------


def _io_bytes_arg(text: str) -> SizeText:
    """--io-bytes, deprecated, with its old meaning: a bare number is bytes, and K/M/G/T (with or
    without i and B) are powers of 1024, where the size rule makes K/M/G/T powers of 1000."""
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([KMGT])i?B?\s*", text, re.IGNORECASE)
    return SizeText("--io-bytes", f"{m.group(1)}{m.group(2)}iB" if m else text, "B")


def _save(args: argparse.Namespace) -> int:
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    from offloadctl import __version__
    from perf import probe
    from perf.profile_toml import check_name, path_for_name, save_profile

    if args.name:
        name = check_name(args.name)
    else:  # from the output file's name, else the host's
        base = os.path.splitext(os.path.basename(args.output))[0] if args.output else socket.gethostname()
        name = check_name(re.sub(r"[^A-Za-z0-9._-]", "-", base).strip(".-") or "this-machine")
    out = os.path.abspath(args.output) if args.output else path_for_name(name)
    if os.path.exists(out) and not args.force:
        raise ConfigError(f"profile {out} exists: pass --force to replace it, or give another NAME or --output")
    sizes = probe.QUICK if args.quick else probe.FULL
    io_bytes = size_bytes(args.io_size)
    if io_bytes is not None or args.io_seconds is not None:
        if args.io_seconds is not None and not args.io_seconds > 0:
            raise ConfigError(f"--io-seconds must be positive, got {args.io_seconds}")
        sizes = dataclasses.replace(sizes, io_bytes=io_bytes or sizes.io_bytes, io_seconds=args.io_seconds or sizes.io_seconds)
    if not args.nvme and not args.remote:
        print("offloadctl: no --nvme or --remote path given: the profile will hold host (and GPU) figures only", file=sys.stderr)
    t0 = time.monotonic()
    columns = (TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn())
    with Progress(*columns, console=Console(stderr=True)) as bar:
        profile = probe.measure_profile(
            name,
            nvme=args.nvme,
            remote=args.remote,
            quick=args.quick,
            sizes=sizes,
            backend=args.io_backend,
            tool=f"offloadctl {__version__}",
            progress=bar,
        )
    save_profile(profile, out)
    shown = name if out == path_for_name(name) else out
    # Two lines: each fits 80 columns where the path does, and the command is whole to copy.
    print(f"wrote profile {name} to {out} ({time.monotonic() - t0:.0f} s)")
    print(f"see it with `offloadctl profile show {shown}`")
    return 0


# -- figures, formatted ---------------------------------------------------------------------------


def _unit(key: str) -> str:
    return "params/s" if key.startswith(("host.adamw", "gpu.adamw")) else "B/s"


def _gb_per_s(v: float | None) -> str:
    """Bytes/s as a number of GB/s, for a column headed GB/s."""
    if v is None:
        return "-"
    g = v / 1e9
    return f"{g:,.0f}" if g >= 100 else f"{g:.3g}"


def _rate_at(x, op: str) -> str:
    """A path's best ``op`` rate in GB/s, with the requests in flight of the sweep point it is
    (none for a profile without a sweep: a datasheet's figure)."""
    fig = getattr(x, f"{op}_bytes_per_s")
    at = next((s.concurrency for s in x.sweep if s.op == op and s.bytes_per_s.value == fig.value), None)
    return _gb_per_s(fig.value) + (f" ({at})" if at is not None else "")


def _table(*headers: str, **kwargs) -> Table:
    """The commands' table style: a rule under the header and no frame, to fit 80 columns."""
    return Table(*headers, box=box.SIMPLE_HEAD, pad_edge=False, show_edge=False, collapse_padding=True, **kwargs)


_OPS = ("read", "write", "mixed")
_GPU_FIGURES = ("h2d_bytes_per_s", "d2h_bytes_per_s", "duplex_h2d_bytes_per_s", "duplex_d2h_bytes_per_s", "adamw_params_per_s")


def _figure_items(p: Profile, sweep: bool, labels: dict[str, str]) -> list[tuple[str, tuple, Figure]]:
    """(key, sort key, figure) of every figure; sort keys order two profiles' figures alike."""
    out: list[tuple[str, tuple, Figure]] = [("host.memory_bandwidth", (0,), p.host.memory_bandwidth)]
    out += [(f"host.adamw[threads={r.threads}]", (1, r.threads), r.params_per_s) for r in p.host.adamw]
    if p.gpu:
        out += [(f"gpu.{f}", (2, i), getattr(p.gpu, f)) for i, f in enumerate(_GPU_FIGURES)]
    for x in p.paths:
        label = labels.get(x.path, x.path)
        out += [(f"path {label} {op}", (3, label, 0, i), getattr(x, f"{op}_bytes_per_s")) for i, op in enumerate(_OPS)]
        if sweep:
            out += [
                (
                    f"path {label} {s.op} c={s.concurrency} {format_size(s.block_bytes)}",
                    (3, label, 1, -s.block_bytes, s.concurrency, _OPS.index(s.op)),
                    s.bytes_per_s,
                )
                for s in x.sweep
            ]
    return sorted(out, key=lambda item: item[1])


def figures(p: Profile, *, sweep: bool = False, path_labels: dict[str, str] | None = None) -> dict[str, Figure]:
    """Every figure of ``p`` by a readable key, in display order; ``path_labels`` renames paths."""
    return {k: f for k, _, f in _figure_items(p, sweep, path_labels or {})}


def _row(t: Table, *cells: object) -> None:
    """A table row of plain text: brackets in paths and keys are not rich markup."""
    t.add_row(*(escape(str(c)) for c in cells))


def _source_line(p: Profile) -> str:
    """``source: measured on vm (--quick run) [offloadctl 0.1.0]``: the kind, then the
    description, the kind said once where the description starts with it."""
    kind = p.source.kind if p.source.kind == "measured" else f"{p.source.kind} (not a measurement)"
    desc = p.source.description
    said = desc.lower().startswith(p.source.kind.lower())
    text = desc if said and p.source.kind == "measured" else f"{kind}: {desc}" if desc else kind
    return f"source: {text}" + (f" [{p.source.tool}]" if p.source.tool else "")


# -- show -----------------------------------------------------------------------------------------


def _show(args: argparse.Namespace) -> int:
    from perf.profile_toml import load_profile, profile_to_dict, resolve_profile

    path = resolve_profile(args.profile)
    p = load_profile(path)
    if args.json:
        print(json.dumps(profile_to_dict(p), indent=2))
        return 0
    con = Console(highlight=False)
    con.print(f"[bold]{escape(p.name)}[/bold]  {escape(path)}")
    con.print(_source_line(p), markup=False)
    if p.created:
        con.print(f"created: {p.created}", markup=False)
    if p.notes:
        con.print(f"notes: {p.notes}", markup=False)
    m = p.machine
    con.print()
    t = _table("machine", "value")
    _row(t, "host", m.hostname)
    _row(
        t,
        "CPU",
        f"{m.cpu_model}; {m.cores_physical} cores, {m.cores_logical} threads, {m.numa_nodes} NUMA "
        f"node{'s' if m.numa_nodes != 1 else ''}",
    )
    _row(t, "memory", format_size(m.memory_bytes))
    _row(t, "GPUs", f"{m.gpu_count} x {m.gpu_model}" if m.gpu_count else "none")
    if p.gpu:
        _row(t, "GPU memory", format_size(p.gpu.memory_bytes))
    con.print(t)
    if p.paths:
        con.print()
        swept = any(x.sweep for x in p.paths)
        unit = "GB/s (n)" if swept else "GB/s"
        t = _table(
            "storage path", "kind", "device", "capacity", f"read\n{unit}", f"write\n{unit}", f"mixed\n{unit}", "best\nconc."
        )
        t.columns[0].overflow = "fold"  # only a path too long for the terminal
        for c in t.columns[1:]:
            c.no_wrap = True
        for c in t.columns[4:]:
            c.justify = "right"
        for x in p.paths:
            _row(
                t, x.path, x.kind, x.device, format_size(x.capacity_bytes), *(_rate_at(x, op) for op in _OPS), x.best_concurrency
            )
        con.print(t)
        from engine.config import EngineConfig  # the engine's chunk, which the probe's sweep uses (perf.probe)

        chunk = EngineConfig().io_chunk_bytes
        con.print(
            f"best conc.: the fewest requests in flight at which the engine's {format_size(chunk)} "
            f"reads and writes both come within 5% of their best rates. read, write, mixed: each path's best "
            f"rate"
            + (
                "; (n): the requests in flight it was measured at, which for one direction alone may be "
                "fewer (the figures below give the request size)."
                if swept
                else "."
            ),
            style="dim",
            markup=False,
        )
        shared = {k: v for k, v in p.devices().items() if len(v) > 1}
        for dev, ps in shared.items():
            con.print(f"paths on one device ({dev}), sharing its bandwidth: {', '.join(x.path for x in ps)}", markup=False)
    con.print()
    items = figures(p, sweep=args.sweep)
    t = _table("figure", "value", "how (when)")
    values = {key: format_rate(f.value, _unit(key)) for key, f in items.items()}
    key_width = max(map(len, items), default=0)
    value_width = max(map(len, values.values()), default=0)
    # The figure's name on one line, if that leaves the explanation a column worth reading.
    if key_width + value_width + 4 + 24 <= con.width:
        t.columns[0].min_width = key_width
    t.columns[0].overflow = "fold"
    t.columns[1].no_wrap = True
    for key, f in items.items():
        t.add_row(escape(key), values[key], f"{escape(f.how)} [dim]({escape(f.when)})[/dim]")
    con.print(t)
    return 0


# -- list -----------------------------------------------------------------------------------------


def _list(args: argparse.Namespace) -> int:
    from perf.profile_toml import list_profiles, load_profile, profile_dir

    d = os.path.abspath(args.dir) if args.dir else profile_dir()
    if args.dir and not os.path.isdir(d):
        raise ConfigError(f"profile directory {d} does not exist: give an existing directory to --dir")
    rows: list[dict[str, Any]] = []  # JSON's rows
    for name in list_profiles(d):
        path = os.path.join(d, name + ".toml")
        try:
            p = load_profile(path)
        except ConfigError as e:  # one broken file must not hide the others
            rows.append({"name": name, "file": path, "error": str(e)})
            continue
        rows.append(
            {
                "name": name,
                "file": path,
                "source": p.source.kind,
                "created": p.created,
                "host": p.machine.hostname,
                "paths": [x.path for x in p.paths],
                "gpu": p.gpu.model if p.gpu else None,
            }
        )
    if args.json:
        print(json.dumps({"dir": d, "profiles": rows}, indent=2))
        return 0
    if not rows:
        Console().print(f"no profiles in {d}: measure one with `offloadctl profile save NAME --nvme PATH`", markup=False)
        return 0
    con = Console(highlight=False)
    con.print(f"profiles in {d}", markup=False)
    t = _table("name", "source", "created", "host", "paths")
    for c in t.columns[:3]:
        c.no_wrap = True
    for c in t.columns[3:]:  # host and paths: the long ones, folded only when the terminal is narrow
        c.overflow = "fold"
    for r in rows:
        if "error" in r:
            t.add_row(escape(r["name"]), "[red]invalid[/red]", "", "", escape(r["error"]))
        else:  # the date of an ISO time is enough to tell profiles apart; --json has all of it
            _row(t, r["name"], r["source"], (r["created"] or "-")[:10], r["host"], "\n".join(r["paths"]) or "-")
    con.print(t)
    return 0


# -- diff -----------------------------------------------------------------------------------------


def _path_labels(a: Profile, b: Profile) -> tuple[dict[str, str], dict[str, str]]:
    """Paths in both profiles keep their name; the others are paired by order (#1, #2, ...)."""
    common = {x.path for x in a.paths} & {x.path for x in b.paths}

    def labels(p: Profile) -> dict[str, str]:
        rest = [x.path for x in p.paths if x.path not in common]
        return {path: f"#{i + 1}" for i, path in enumerate(rest)}

    return labels(a), labels(b)


def diff_rows(a: Profile, b: Profile, *, sweep: bool = False) -> tuple[list[dict], list[dict]]:
    """(machine rows that differ, figure rows) comparing ``a`` with ``b``; ratio is b / a."""
    machine = []
    for f in ("hostname", "cpu_model", "cores_physical", "cores_logical", "memory_bytes", "numa_nodes", "gpu_model", "gpu_count"):
        va, vb = getattr(a.machine, f), getattr(b.machine, f)
        if va != vb:
            machine.append({"key": f"machine.{f}", "a": va, "b": vb})
    la, lb = _path_labels(a, b)
    fa = {k: (o, f) for k, o, f in _figure_items(a, sweep, la)}
    fb = {k: (o, f) for k, o, f in _figure_items(b, sweep, lb)}
    rows = []
    for key in sorted(fa.keys() | fb.keys(), key=lambda k: (fa.get(k) or fb[k])[0]):
        va = fa[key][1].value if key in fa else None
        vb = fb[key][1].value if key in fb else None
        ratio = vb / va if va and vb is not None else None
        rows.append({"key": key, "unit": _unit(key), "a": va, "b": vb, "ratio": ratio})
    return machine, rows


def _diff(args: argparse.Namespace) -> int:
    from perf.profile_toml import load_profile, resolve_profile

    pa, pb = resolve_profile(args.a), resolve_profile(args.b)
    a, b = load_profile(pa), load_profile(pb)
    machine, rows = diff_rows(a, b, sweep=args.sweep)
    if args.json:
        print(
            json.dumps(
                {
                    "a": {"name": a.name, "file": pa, "source": a.source.kind},
                    "b": {"name": b.name, "file": pb, "source": b.source.kind},
                    "machine": machine,
                    "figures": rows,
                },
                indent=2,
            )
        )
        return 0
    con = Console(highlight=False)
    con.print(f"A: {a.name} ({pa}), {_source_line(a)}", markup=False)
    con.print(f"B: {b.name} ({pb}), {_source_line(b)}", markup=False)
    la, lb = _path_labels(a, b)
    for tag, labels in (("A", la), ("B", lb)):
        for path, label in labels.items():
            con.print(f"path {label} of {tag}: {path}", markup=False)
    if machine:
        t = _table("machine", "A", "B")
        for r in machine:
            shown = [format_size(r[k]) if r["key"] == "machine.memory_bytes" else str(r[k]) for k in ("a", "b")]
            _row(t, r["key"].replace("_bytes", ""), *shown)
        con.print(t)
    t = _table("figure", "A", "B", "B / A")
    for r in rows:
        ratio = "-" if r["ratio"] is None else f"{r['ratio']:.2f}x"
        _row(t, r["key"], format_rate(r["a"], r["unit"]), format_rate(r["b"], r["unit"]), ratio)
    con.print(t)
    return 0
