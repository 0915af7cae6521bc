"""Predict iteration time of the best offload plan and of stock DeepSpeed's.

From a hardware profile (``offloadctl profile save``) and the model size, the performance
model (perf.model, perf.search; docs/perfmodel.md) picks the best plan (host cache, device-lane
fraction, prefetch depth, per-path concurrency and stripe weights, node lock) and prints it
beside a few alternatives and stock DeepSpeed ZeRO-3 CPU offload, ZeRO-Infinity NVMe and
Twin-Flow. Nothing is measured: it answers at once, for any model size.

  offloadctl plan --profile h100-node --params 70B --ranks 8 --fwd-bwd-s 12
  offloadctl plan --profile ./my.toml --params 1.5T --host-memory 1024GB --json
"""
from __future__ import annotations

import argparse
import json
import math
import re

from offloadctl.options import add_size_epilog, add_size_option, size_bytes

_SUFFIX = {"": 1, "K": 1e3, "M": 1e6, "B": 1e9, "G": 1e9, "T": 1e12}
_PARAMS_RE = re.compile(r"^\s*([0-9]*\.?[0-9]+(?:[eE][+-]?[0-9]+)?)\s*([KMBGT]?)\s*$", re.IGNORECASE)


def parse_params(text: str) -> int:
    """``7e9``, ``7B``, ``1.5T``, ``70M``, ``350K`` or a plain integer, as a parameter count."""
    from engine.errors import ConfigError

    m = _PARAMS_RE.match(str(text))
    value = float(m.group(1)) * _SUFFIX[m.group(2).upper()] if m else math.nan
    if not (math.isfinite(value) and value >= 1):
        raise ConfigError(f"--params {text!r} is not a parameter count: give a number like 7e9, 7B, 1.5T or 70M")
    if value > 1e15:
        raise ConfigError(f"--params {text!r} is over 1e15 parameters: give the model's real size, like 7e9 or 70B")
    return int(round(value))


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--profile", required=True, metavar="NAME|PATH", help="hardware profile: a name or a TOML file")
    p.add_argument("--params", required=True, metavar="N", help="model parameters: 7e9, 7B, 1.5T, 70M")
    p.add_argument("--ranks", type=int, default=1, metavar="R", help="ranks (GPUs) per node (default 1)")
    p.add_argument("--nodes", type=int, default=1, metavar="K", help="nodes (default 1)")
    add_size_option(p, "--host-memory", dest="host_memory", deprecated="--host-gb",
                    help="host memory for optimizer state, per node, e.g. 512GB or 480GiB (default: half the "
                    "profile's memory)")
    add_size_option(p, "--gpu-headroom", dest="gpu_headroom", deprecated="--gpu-headroom-gb",
                    help="GPU memory free during the update phase, per GPU, e.g. 40GB (default: half the GPU's "
                    "memory)")
    p.add_argument("--fwd-bwd-s", type=float, metavar="S", help="forward+backward seconds per iteration (default 0)")
    p.add_argument("--subgroup", type=float, default=1e7, metavar="N", help="elements per subgroup (default 1e7)")
    p.add_argument("--path", action="append", default=None, metavar="PATH",
                   help="use only these of the profile's storage paths (repeatable; default: all)")
    p.add_argument("--json", action="store_true", help="print JSON instead of a table")
    add_size_epilog(p)


def run(args: argparse.Namespace) -> int:
    from engine.errors import ConfigError
    from perf.model import Workload
    from perf.profile_toml import load_profile
    from perf.search import alternatives

    profile = load_profile(args.profile)
    if not (math.isfinite(args.subgroup) and args.subgroup >= 1 and float(args.subgroup).is_integer()):
        raise ConfigError(f"--subgroup must be a whole number of elements, got {args.subgroup}")
    wl = Workload(params=parse_params(args.params), ranks=args.ranks, nodes=args.nodes,
                  subgroup_numel=int(args.subgroup), fwd_bwd_s=args.fwd_bwd_s,
                  host_bytes=size_bytes(args.host_memory), gpu_headroom_bytes=size_bytes(args.gpu_headroom))
    preds = alternatives(profile, wl, args.path)
    if args.json:
        print(json.dumps({"profile": {"name": profile.name, "source": profile.source.kind},
                          "workload": {k: getattr(wl, k) for k in wl.__dataclass_fields__},
                          "best": preds[0].plan.name, "plans": [_finite(p.to_dict()) for p in preds]}, indent=2))
        return 0
    _print(profile, wl, preds)
    return 0


def _finite(x):
    """JSON has no infinity: an unbounded time (a stock setup that cannot run) becomes null."""
    if isinstance(x, float) and not math.isfinite(x):
        return None
    if isinstance(x, dict):
        return {k: _finite(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_finite(v) for v in x]
    return x


def _t(s: float) -> str:
    if not math.isfinite(s):
        return "-"
    return f"{s:.3g}" if s < 1000 else f"{s:,.0f}"


def _gb(b: int | None) -> str:
    if not b:
        return "-"
    return f"{b / 1e9:.2g}" if b < 10e9 else f"{b / 1e9:,.0f}"


def _print(profile, wl, preds) -> None:
    from rich import box
    from rich.console import Console
    from rich.markup import escape
    from rich.table import Table

    from engine.config import Knobs

    con = Console()
    title = (f"{wl.params:.3g} params, {wl.ranks} rank(s)/node x {wl.nodes} node(s), profile {profile.name!r} "
             f"({profile.source.kind})")
    tab = Table(title=escape(title), box=box.SIMPLE_HEAD, pad_edge=False,
                caption="state: GB per node in host memory (h), on disk (d), per GPU (g); lane: device-lane fraction; "
                        "pf: prefetch depth; conc: requests in flight per path; B/p: bytes moved per param; "
                        "update and iteration in seconds")
    for name in ("plan", "state GB", "lane", "pf", "conc", "B/p", "update", "iter", "bottleneck"):
        wraps = name in ("plan", "state GB", "bottleneck")
        tab.add_column(name, justify="left" if wraps else "right", no_wrap=not wraps,
                       min_width={"plan": 10, "state GB": 7, "bottleneck": 9}.get(name))
    best = preds[0]
    for p in preds:
        plan, knobs, m = p.plan, p.plan.knobs, p.memory
        conc = ",".join(sorted({str(c) for c in knobs.io_concurrency.values()}, key=int))
        if not conc:
            conc = str(Knobs.DEFAULT_IO_CONCURRENCY) if m.get("storage_per_node") else "-"
        state = " ".join(f"{k}{_gb(m.get(key))}" for k, key in (("h", "host_per_node"), ("d", "storage_per_node"),
                                                                 ("g", "gpu_per_rank")) if m.get(key))
        tab.add_row(escape(plan.name), state or "-", f"{knobs.device_fraction:.2f}", str(knobs.prefetch_depth),
                    conc + ("+lock" if knobs.node_lock else ""), f"{p.bytes_per_param:.1f}", _t(p.update_s),
                    _t(p.iteration_s), escape(p.bottleneck if p.feasible else "does not fit"),
                    style="bold green" if p is best else ("dim" if not p.feasible else None))
    con.print(tab)
    b = best.breakdown
    keys = [k for k in ("storage", "cpu_update", "gpu_update", "pcie", "prefetch_latency", "fill_drain") if b.get(k)]
    con.print(f"[bold green]best[/]: {_t(best.iteration_s)} s per iteration, {_t(best.update_s)} s of it the update "
              f"phase ({', '.join(f'{k} {b[k]:.3g} s' for k in keys)})")
    weights = best.plan.knobs.stripe_weights
    if weights:
        total = sum(weights.values()) or 1.0
        con.print("stripes: " + ", ".join(f"{escape(k)} {w / total:.0%}" for k, w in weights.items()))
    for note in best.notes:
        con.print(f"[dim]best: {escape(note)}[/]")
    for p in preds:
        if not p.feasible:
            con.print(f"[dim]{escape(p.plan.name)}: {escape(p.notes[0])}[/]")
