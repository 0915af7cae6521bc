"""Show the tuner daemon's runs live, or a snapshot with --once; pin knobs or freeze tuning.

    offloadctl tune                               # live view of every run (Ctrl-C to leave)
    offloadctl tune --once --json                 # {"runs": [{"run_id", "ranks", "iteration", "iter_time_s", "knobs", ...}]}
    offloadctl tune --pin RUN:prefetch_depth=4    # VALUE is JSON: 4, true, {"/nvme0": 8}
    offloadctl tune --unpin RUN:prefetch_depth --freeze RUN --unfreeze RUN

Pins and freezes are sent first; then the view (or, with only those, a line per action).
"""
from __future__ import annotations

import argparse
import json
import re
import time

SPARK = "▁▂▃▄▅▆▇█"


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--socket", metavar="PATH", help="the daemon's socket (default: $XDG_RUNTIME_DIR/offloadctl/"
                   "tuner.sock, /run/offloadctl/tuner.sock for root)")
    p.add_argument("--once", action="store_true", help="print one snapshot and exit")
    p.add_argument("--json", action="store_true", help="with --once: print JSON")
    p.add_argument("--live", action="store_true", help="live view (the default without --once)")
    p.add_argument("--run", metavar="RUN", help="only this run")
    p.add_argument("--interval", type=float, default=1.0, metavar="S", help="live refresh period (default 1 s)")
    p.add_argument("--pin", action="append", default=[], metavar="RUN:KNOB=VALUE", help="hold a knob at a value")
    p.add_argument("--unpin", action="append", default=[], metavar="RUN:KNOB", help="let the policy move a knob again")
    p.add_argument("--freeze", action="append", default=[], metavar="RUN", help="stop tuning a run (knobs stay)")
    p.add_argument("--unfreeze", action="append", default=[], metavar="RUN", help="resume tuning a run")


def _knob_rx() -> str:
    from engine.config import Knobs

    return r"(?P<knob>(?:%s)(?:\[[^\]]+\])?)" % "|".join(Knobs.names())


def parse_pin(spec: str) -> tuple[str, str, object]:
    """``RUN:KNOB=VALUE`` -> (run, knob, value); VALUE is JSON, else taken as a string. The
    knob names anchor the split, so run ids and paths may hold ':' and '='."""
    from engine.errors import ConfigError

    m = re.fullmatch(r"(?P<run>.+?):" + _knob_rx() + r"=(?P<value>.*)", spec, re.S)
    if not m:
        from engine.config import Knobs

        raise ConfigError(f"--pin {spec!r}: write RUN:KNOB=VALUE, e.g. myrun:prefetch_depth=4 (knobs: "
                          f"{', '.join(Knobs.names())}; io_concurrency[PATH] for one path)")
    try:
        value = json.loads(m["value"])
    except ValueError:
        value = m["value"]
    return m["run"], m["knob"], value


def parse_unpin(spec: str) -> tuple[str, str]:
    """``RUN:KNOB`` -> (run, knob)."""
    from engine.errors import ConfigError

    m = re.fullmatch(r"(?P<run>.+?):" + _knob_rx(), spec, re.S)
    if not m:
        raise ConfigError(f"--unpin {spec!r}: write RUN:KNOB, e.g. myrun:prefetch_depth")
    return m["run"], m["knob"]


def _actions(args: argparse.Namespace) -> list[tuple[str, dict]]:
    out = []
    for spec in args.pin:
        run_id, knob, value = parse_pin(spec)
        out.append(("pin", {"run_id": run_id, "knob": knob, "value": value}))
    for spec in args.unpin:
        run_id, knob = parse_unpin(spec)
        out.append(("unpin", {"run_id": run_id, "knob": knob}))
    out += [("freeze", {"run_id": r, "frozen": True}) for r in args.freeze]
    out += [("freeze", {"run_id": r, "frozen": False}) for r in args.unfreeze]
    return out


def run(args: argparse.Namespace) -> int:
    from engine.errors import ConfigError
    from tuner.protocol import Connection
    from tuner.service import default_socket_path

    path = args.socket or default_socket_path()
    actions = _actions(args)
    try:
        conn = Connection(path, timeout_s=5.0)
    except OSError as e:
        raise ConfigError(f"no tuner daemon answers at {path} ({e.strerror or e}): start one with "
                          "`offloadctl tuner start`, or give --socket") from None
    with conn:
        for kind, fields in actions:
            reply = conn.request(kind, **fields)
            if not (args.once or args.json or args.live):
                what = {"pin": f"pinned {fields.get('knob')}={fields.get('value')!r}",
                        "unpin": f"unpinned {fields.get('knob')}",
                        "freeze": "frozen" if fields.get("frozen") else "unfrozen"}[kind]
                print(f"{fields['run_id']}: {what}; knobs now {json.dumps(reply.get('knobs'))}")
        if actions and not (args.once or args.json or args.live):
            return 0
        if args.once or args.json:
            snap = conn.request("snapshot", run_id=args.run, history=60)
            if args.json:
                print(json.dumps({"runs": snap["runs"], "daemon": snap["daemon"]}, indent=2))
            else:
                from rich.console import Console

                Console().print(runs_table(snap["runs"]))
            return 0
        return _live(conn, args)


def _live(conn, args: argparse.Namespace) -> int:
    from rich.console import Group
    from rich.live import Live

    from engine.errors import ConfigError

    with Live(auto_refresh=False) as live:
        try:
            while True:
                snap = conn.request("snapshot", run_id=args.run, history=60)
                views = [run_panel(r) for r in snap["runs"]] or ["no runs yet"]
                live.update(Group(*views), refresh=True)
                time.sleep(args.interval)
        except KeyboardInterrupt:
            return 0
        except OSError as e:
            raise ConfigError(f"lost the tuner daemon at {conn.path} ({e}): is it still running? "
                              "`offloadctl tuner status`") from None


# -- rendering --------------------------------------------------------------------------------------

def sparkline(values: list[float | None], width: int = 60) -> str:
    vals = [v for v in values[-width:]]
    known = [v for v in vals if v is not None]
    if not known:
        return ""
    lo, hi = min(known), max(known)
    span = (hi - lo) or 1.0
    return "".join(" " if v is None else SPARK[min(len(SPARK) - 1, int((v - lo) / span * len(SPARK)))] for v in vals)


def _rate(b: float | None) -> str:
    return "-" if b is None else f"{b / 1e6:,.0f} MB/s"


def _secs(s: float | None) -> str:
    return "-" if s is None else f"{s:.3f} s"


def runs_table(runs: list[dict]):
    from rich.table import Table
    from rich.text import Text

    t = Table("run", "status", "ranks", "iteration", "iteration time", "knobs", title="tuner runs")
    for r in runs:
        t.add_row(Text(r["run_id"]), r["status"] + (" (frozen)" if r["frozen"] else ""),
                  f"{r['connected']}/{r['ranks']}", str(r["iteration"]), _secs(r["iter_time_s"]),
                  Text(_knobs_text(r["knobs"])))
    return t


def _knobs_text(k: dict) -> str:
    parts = [f"device_fraction={k['device_fraction']:g}", f"prefetch_depth={k['prefetch_depth']}"]
    if k["node_lock"]:
        parts.append("node_lock")
    if k["io_concurrency"]:
        parts.append("io_concurrency=" + ",".join(f"{p}:{n}" for p, n in k["io_concurrency"].items()))
    if k["stripe_weights"]:
        parts.append("stripe_weights=" + ",".join(f"{p}:{w:g}" for p, w in k["stripe_weights"].items()))
    return " ".join(parts)


def run_panel(r: dict):
    """One run of a snapshot: iteration-time chart, phases, per-path traffic, PCIe, knobs, decisions."""
    from rich.console import Group
    from rich.markup import escape
    from rich.panel import Panel
    from rich.table import Table
    from rich.text import Text

    times = r["history"]["iter_time_s"]
    if not any(t is not None for t in times):
        times = r["history"]["update_s"]
    known = [t for t in times if t is not None]
    chart = f"[cyan]{sparkline(times)}[/]  " + (f"{min(known):.3f}..{max(known):.3f} s" if known else "no iterations yet")

    ph = r["phases"] or {}
    phases = Table("phase", "s", box=None, title="phases (slowest rank)", title_justify="left")
    rest = (ph["iter_time_s"] - ph["update_s"]) if ph.get("iter_time_s") is not None else None
    for name, key in (("update (optimizer step)", "update_s"), ("  waiting for reads", "read_wait_s"),
                      ("  AdamW", "compute_s"), ("  waiting for writes", "write_wait_s")):
        phases.add_row(name, _secs(ph.get(key)))
    phases.add_row("forward, backward, other", _secs(rest))

    sensors = r.get("sensors") or {}
    spaths = sensors.get("paths") or {}
    paths = Table("path", "read", "write", "others", "queue", box=None, title="tiers", title_justify="left")
    for p, bw in r["bandwidth"].items():
        queue = (spaths.get(p) or {}).get("in_flight")
        paths.add_row(Text(p), _rate(bw["read_bytes_per_s"]), _rate(bw["write_bytes_per_s"]), _rate(bw["other_bytes_per_s"]),
                      f"{queue if queue is not None else '-'} / {bw['concurrency']}")
    lines = []
    gpu = sensors.get("gpu")
    if isinstance(gpu, dict) and gpu:
        lines.append(Text("GPU/PCIe: " + ", ".join(f"{k}={_num(v)}" for k, v in gpu.items()
                                                  if not isinstance(v, (dict, list)))))
    if sensors.get("cpu_percent") is not None:
        lines.append(f"CPU: {sensors['cpu_percent']:.0f}%")
    state = "[yellow]frozen[/]" if r["frozen"] else "tuning"
    if r["pins"]:
        state += ", pinned: " + escape(", ".join(f"{k}={v!r}" for k, v in r["pins"].items()))
    held = (r.get("policy") or {}).get("holding_reason")
    if held:
        state += f", [green]{escape(held)}[/]"
    if r.get("policy_error"):
        state += f", [red]policy stopped: {escape(r['policy_error'])}[/]"

    log = Table("iteration", "at", "by", "reason", box=None, title="decisions", title_justify="left")
    for d in r["decisions"][-6:]:
        log.add_row(str(d["iteration"]), str(d["apply_at"] if d["apply_at"] is not None else "-"), d["source"],
                    Text(d["reason"]))
    head = (f"iteration {r['iteration']}  {_secs(r['iter_time_s'])}/it  ranks {r['connected']}/{r['ranks']}  {state}\n"
            f"knobs: {escape(_knobs_text(r['knobs']))}")
    body = [head, chart, phases, paths, *lines, log]
    return Panel(Group(*body), title=Text(f"{r['run_id']} ({r['status']})"), title_align="left")


def _num(v) -> str:
    if isinstance(v, float):
        return f"{v / 1e6:,.0f}M" if abs(v) >= 1e6 else f"{v:.3g}"
    return str(v)

