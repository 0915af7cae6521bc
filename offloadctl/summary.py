"""The end-of-run summary of ``offloadctl train``: how fast, where the time went, and why.

:func:`print_run_summary` reads the run directory: the recorder's ``record-rank<R>.jsonl``
when there is one (spans of every phase, samples and tokens per iteration), else the engine's
``telemetry-rank<R>.jsonl`` alone (``--no-record``: the update's parts and the time between
steps, no throughput). Its lines fit 80 columns; the bottleneck sentence is the report's own
(:func:`report.analyze.bottleneck`). :func:`print_summary` is the engine's per-step table of the
update phase, for a plain PyTorch loop's telemetry (examples/offload_adamw.py).
"""

from __future__ import annotations

import os
import statistics
import textwrap
from typing import TYPE_CHECKING

from rich.console import Console
from rich.table import Table

from engine.errors import ConfigError
from engine.telemetry import StepRecord
from engine.units import format_seconds
from offloadctl.commands.tune_view import held_text
from report.analyze import analyze_run, bottleneck, engine_segments, host_memory_summary, shares, storage_name
from report.load import load_run, read_telemetry
from report.render import extent, fixed_knobs_text, headline, host_memory_text
from tuner.knob_text import adaptation_text, changed_knobs, knobs_text, value_text
from tuner.run_state import DECISIONS_KEPT

if TYPE_CHECKING:
    from tuner.run_state import Activity, RunView

WIDTH = 80
STOCK_BYTES_PER_PARAM = 32
"""Stock ZeRO-Infinity's bytes per parameter per step with its optimizer state on NVMe."""


def run_summary_lines(run_dir: str, *, rank: int = 0) -> list[str]:
    """The summary of ``rank`` in ``run_dir`` as lines of at most :data:`WIDTH` columns."""
    record = os.path.join(run_dir, f"record-rank{rank}.jsonl")
    telemetry = os.path.join(run_dir, f"telemetry-rank{rank}.jsonl")
    if os.path.exists(record):
        try:
            return _wrap(_from_record(run_dir, rank))
        except ConfigError as e:  # named by file, not by path: the run directory is the train's own
            return _wrap([f"no summary: {str(e).replace(os.path.join(run_dir, ''), '')}"])
    if os.path.exists(telemetry):
        try:
            records = read_telemetry(telemetry, [])
        except ConfigError as e:
            return _wrap([f"no summary: {str(e).replace(os.path.join(run_dir, ''), '')}"])
        if records:
            return _wrap(_from_telemetry(records, run_dir, rank))
        return _wrap([f"no summary: {telemetry} holds no step: the run stopped before its first update"])
    return _wrap([f"no summary: {run_dir} has no record-rank{rank}.jsonl or telemetry-rank{rank}.jsonl"])


WHO_CHANGED = {"policy": "the tuner", "resync": "the tuner", "user": "you, tune --pin", "history": "history"}
"""Who changed a knob, by the daemon's source of the change."""


def tuner_lines(view: RunView) -> list[str]:
    """The tuner's part of the end of a run, from the daemon's view of it
    (``tuner.service.run_view``): every knob that ended other than it started, from what to
    what and who changed it (history names the earlier run), then what the tuner is doing.
    Wrapped to :data:`WIDTH`."""
    start = view.get("start_knobs") or {}
    changed = changed_knobs(start, view.get("knobs") or {}) if start else {}
    by = view.get("changed_by") or {}
    origin = (view.get("start_from") or {}).get("run_id")
    said = []
    for key, (before, after) in changed.items():
        who = WHO_CHANGED.get(by.get(key, "policy"), by.get(key, "policy"))
        if by.get(key) == "history" and origin:
            who = f"history: the tuner's verdict in run {origin}"
        said.append(f"{key} {value_text(before)} -> {value_text(after)} ({who})")
    activity: Activity | dict[str, None] = view.get("verdict") or {}
    mode, why = activity.get("mode") or "", activity.get("reason") or ""
    doing = {
        "holding": "holding",
        "frozen": "frozen by you",
        "trial": f"trying {activity.get('trial')}",
        "measuring": "measuring",
        "stopped": "policy stopped",
    }.get(mode, "done")
    if mode == "holding" and not why:
        why = "no move left to try"
    why = held_text(why)
    # Knobs that ended as they started may still have moved: trials the tuner reverted. The
    # view keeps its last DECISIONS_KEPT decisions, so a full list is a lower bound.
    decisions = view.get("decisions") or []
    tried = sum(d.get("source") in ("policy", "resync") for d in decisions)
    if said:
        head = "tuner: changed " + ", ".join(said)
    elif tried:
        more = " or more" if len(decisions) >= DECISIONS_KEPT else ""  # the view's list is full: older ones left out
        head = f"tuner: no knob changes in the end ({tried}{more} tried and undone)"
    else:
        head = "tuner: no knob changes"
    changes = [f"tuner: {adaptation_text(a)}" for a in ((view.get("policy") or {}).get("adaptations") or [])[-3:]]
    return _wrap([*changes, f"{head}; {doing}" + (f" ({why})" if why else "")])


SUMMARY_FORMAT = "offloadctl-run-summary"
SUMMARY_VERSION = 1


def run_summary_figures(
    run_dir: str,
    *,
    rank: int = 0,
    exit_status: int | None = None,
    stopped_by: str | None = None,
    tuner_view: RunView | None = None,
) -> dict:
    """The end-of-run summary's figures, for ``offloadctl train --json-summary FILE``: how the
    run ended and, when it recorded iterations, how fast (median iteration, throughput), where
    the time went (shares of the median iteration), why (the bottleneck sentence), the bytes it
    moved per parameter, and the tuner's changes (knob, from, to, by whom). Seconds and bytes;
    None where a figure is unknown."""
    out: dict = {
        "format": SUMMARY_FORMAT,
        "version": SUMMARY_VERSION,
        "run_dir": os.path.abspath(run_dir),
        "rank": rank,
        "exit_status": exit_status,
        "stopped_by": stopped_by,
        "status": "interrupted" if stopped_by else "finished" if exit_status == 0 else "failed",
    }
    try:
        a = analyze_run(load_run(run_dir, rank=rank))
    except ConfigError as e:
        out["recorded"] = str(e)
        a = None
    if a is not None:
        s = a["summary"]
        out.update(
            {
                "status": a["status_kind"] if a["status_kind"] in ("finished", "interrupted", "error") else out["status"],
                "status_text": a["status"],
                "iterations": s["iterations"],
                "total_s": s["total_s"],
                "steady_iterations": len(s["steady_iterations"]),
                "median_iteration_s": s["median_iter_s"],
                "samples_per_s": s.get("samples_per_s"),
                "tokens_per_s": s.get("tokens_per_s"),
                "world_size": s.get("world_size", 1),
                "shares": dict(s["shares"]),
                "bottleneck": s["verdict"],
                "bytes_per_param": s.get("engine_bytes_per_param"),
                "bytes_per_param_total": s.get("engine_bytes_per_param_total"),
                "disk_bytes_per_param_total": s.get("disk_bytes_per_param_total"),
                "other_processes_disk_bytes_per_param_total": s.get("other_disk_bytes_per_param_total"),
                "host_memory": s.get("host_memory"),
                "fixed_knobs": s.get("fixed_knobs"),
            }
        )
    if tuner_view:
        by = tuner_view.get("changed_by") or {}
        start = tuner_view.get("start_knobs") or {}
        activity: Activity | dict[str, None] = tuner_view.get("verdict") or {}
        out["tuner"] = {
            "run_id": tuner_view.get("run_id"),
            "knobs": tuner_view.get("knobs"),
            "changes": [
                {"knob": k, "from": a_, "to": b_, "by": by.get(k, "policy")}
                for k, (a_, b_) in (changed_knobs(start, tuner_view.get("knobs") or {}) if start else {}).items()
            ],
            "history_run": (tuner_view.get("start_from") or {}).get("run_id"),
            "mode": activity.get("mode"),
            "reason": activity.get("reason"),
            "pins": tuner_view.get("pins") or {},
        }
    return out


def print_run_summary(run_dir: str, console: Console | None = None, *, rank: int = 0) -> None:
    """Print :func:`run_summary_lines` (the lines are wrapped already: the console leaves them be)."""
    console = console or Console()
    for line in run_summary_lines(run_dir, rank=rank):
        console.print(line, markup=False, highlight=False, soft_wrap=True)


def _wrap(lines: list[str]) -> list[str]:
    out = []
    for line in lines:
        out += textwrap.wrap(line, WIDTH, subsequent_indent="  ", break_on_hyphens=False, break_long_words=False) or [""]
    return out


def _pct(x: float) -> str:
    return f"{100 * x:.0f}%"


def _share_line(shares: list[tuple[str, float]], merge_fwd_bwd: bool = False) -> str:
    sh = dict(shares)
    head = (
        [("forward+backward", sh["forward"] + sh["backward"])]
        if merge_fwd_bwd
        else [("forward", sh["forward"]), ("backward", sh["backward"])]
    )
    update = sum(v for k, v in sh.items() if k.startswith("update"))
    parts = ", ".join(f"{k[len('update: ') :]} {_pct(v)}" for k, v in shares if k.startswith("update"))
    line = "time per iteration: " + ", ".join(f"{k} {_pct(v)}" for k, v in head) + f", update {_pct(update)} ({parts})"
    if sh.get("outside DeepSpeed", 0) >= 0.005:
        line += f", the script between calls {_pct(sh['outside DeepSpeed'])}"
    return line


def _bytes_line(per_param: dict | None, total: float | None, hits, swapped, state_by_tier: dict | None) -> str:
    parts = []
    if per_param and total is not None:
        tiers = "; ".join(
            f"{k} {rw.get('read', 0):.1f} read, {rw.get('written', 0):.1f} written" for k, rw in sorted(per_param.items())
        )
        parts.append(f"moved per param and iteration: {total:.1f} B ({tiers}; stock ZeRO-Infinity: ~{STOCK_BYTES_PER_PARAM})")
    if swapped:
        parts.append(f"kept in memory between steps: {hits:.0f} of {swapped:.0f} swapped subgroups")
    if state_by_tier:
        parts.append("state: " + ", ".join(f"{k} {v / 1e6:.1f} MB" for k, v in state_by_tier.items()))
    return "; ".join(parts)


def _from_record(run_dir: str, rank: int) -> list[str]:
    run = load_run(run_dir, rank=rank)
    a = analyze_run(run)
    s = a["summary"]
    world = s.get("world_size", 1)
    who = f" of rank {rank} of {world}" if world > 1 else ""
    lines = [f"run summary{who}: {run_dir}", headline(a), extent(a)]
    lines.append(_share_line(s["shares"]))
    lines.append(f"bottleneck: {s['verdict']}")
    per_param = s.get("engine_bytes_per_param")
    total = s.get("engine_bytes_per_param_total")
    if per_param is None and s.get("run_disk_bytes_per_param_total") is not None:  # stock: the rank's own bytes
        label = "+".join(dict.fromkeys(t["kind"] for t in a["tiers"] if t.get("device"))) or "disk"
        per_param = {label: {d: sum(rw[d] for rw in s["run_disk_bytes_per_param"].values()) for d in ("read", "written")}}
        total = s["run_disk_bytes_per_param_total"]
    elif per_param is None and s.get("disk_bytes_per_param_total") is not None:
        per_param = {}
        for ph in s["disk_bytes_per_param"].values():
            for tier, rw in ph.items():
                acc = per_param.setdefault(tier.split(" ")[0], {"read": 0.0, "written": 0.0})
                acc["read"] += rw["read"]
                acc["written"] += rw["written"]
        total = s["disk_bytes_per_param_total"]
    plan = run.record.init.get("engine_plan") or {}
    by_tier = _state_by_kind(plan, a["tiers"])
    line = _bytes_line(per_param, total, s.get("median_cache_hits"), s.get("swapped_subgroups"), by_tier)
    if line:
        lines.append(line)
    others, own = s.get("other_disk_bytes_per_param_total"), s.get("run_disk_bytes_per_param_total") or 0.0
    if others is not None and others >= max(0.5, 0.25 * own):
        lines.append(f"other processes moved {others:.1f} B/param an iteration on the same device (not counted as this run's)")
    elif not a["tiers"]:
        lines.append(f"optimizer state kept in {storage_name(a)}: no storage tier, no bytes moved to disk")
    lines += _host_lines(s.get("host_memory"), s.get("fixed_knobs"), rank, a["engine"] != "stock")
    return lines


def _host_lines(hm: dict | None, fixed: dict | None, rank: int, engine: bool) -> list[str]:
    """The engine's host memory against the rank's budget, and the knobs the tuner never moves."""
    out = [f"host memory of rank {rank}'s engine, at its peak: {host_memory_text(hm)}"] if hm else []
    if engine and fixed is not None:
        out.append(f"knobs fixed by the run's options, never tuned: {fixed_knobs_text(fixed)}")
    return out


def _state_by_kind(plan: dict, tiers: list[dict]) -> dict:
    kinds = {t["path"]: t["label"] for t in tiers}
    out: dict = {}
    for path, b in (plan.get("state_bytes_by_tier") or {}).items():
        k = kinds.get(path, path)
        out[k] = out.get(k, 0) + b
    return out


def _iteration_s(r: StepRecord) -> float:
    """One step's iteration: the time since the last update, the update and its setup."""
    return (r.fwd_bwd_s or 0.0) + r.update_s + r.setup_s


def _from_telemetry(records: list[StepRecord], run_dir: str, rank: int) -> list[str]:
    """The summary from the engine's StepRecords alone: the update's parts, and the time between
    updates (forward, backward and the loop's own work) as ``fwd_bwd_s``."""
    steady = [r for r in records[1:] if r.fwd_bwd_s is not None] or records
    seg = [({"forward": r.fwd_bwd_s or 0.0, **engine_segments(r, r.update_s + r.setup_s)}, _iteration_s(r)) for r in steady]
    ordered = sorted(seg, key=lambda x: x[1])
    segments, median_s = ordered[(len(ordered) - 1) // 2]
    kinds = sorted({k for r in records for k, v in {**r.bytes_read, **r.bytes_written}.items() if v}) or sorted(
        {k for r in records for k in r.bytes_read}
    )
    storage = storage_name({"tiers": [{"kind": k} for k in kinds]}) if kinds else "host memory"
    total = sum(_iteration_s(r) for r in records)
    who = f" of rank {rank}" if rank else ""
    lines = [
        f"run summary{who}: {run_dir}",
        "engine telemetry only (the run was not recorded): no samples/s or tokens/s, no end status",
        f"{format_seconds(median_s)}/iteration (median of {len(steady)}), {len(records)} iterations in {format_seconds(total)}",
        _share_line(shares(segments, median_s), merge_fwd_bwd=True),
        f"bottleneck: {bottleneck(segments, median_s, storage)}",
    ]
    p = steady[0].params
    per_param = (
        {
            k: {
                "read": statistics.fmean(r.bytes_read.get(k, 0) for r in steady) / p,
                "written": statistics.fmean(r.bytes_written.get(k, 0) for r in steady) / p,
            }
            for k in kinds
        }
        if p
        else None
    )
    total_pp = sum(v for rw in per_param.values() for v in rw.values()) if per_param else None
    swapped = statistics.median(r.cache_hits + r.cache_misses for r in steady)
    line = _bytes_line(per_param, total_pp, statistics.median(r.cache_hits for r in steady), swapped, None)
    if line:
        lines.append(line)
    return lines + _host_lines(host_memory_summary([(r.iteration, r) for r in records]), None, rank, True)


# -- the engine's per-step table (a plain PyTorch loop's telemetry) ------------------------------


def summary_table(records: list[StepRecord], title: str = "update phase") -> Table:
    """Medians over steps 2..N (step 1 materialises the state)."""
    steady = records[1:] or records
    med = lambda key: statistics.median(getattr(r, key) for r in steady)  # noqa: E731
    t = Table(f"median over {len(steady)} steps", "value", title=title)
    t.add_row("update phase wall", f"{med('update_s') * 1e3:.1f} ms")
    t.add_row("  waiting for reads", f"{med('read_wait_s') * 1e3:.1f} ms")
    t.add_row("  AdamW updates", f"{med('kernel_s') * 1e3:.1f} ms")
    t.add_row("  waiting for writes", f"{med('write_wait_s') * 1e3:.1f} ms")
    t.add_row("bytes moved per param", f"{med('bytes_moved_per_param'):.1f} (stock ZeRO-Infinity: ~32)")
    t.add_row("read / write bandwidth", f"{med('read_bytes_per_s') / 1e6:.0f} / {med('write_bytes_per_s') / 1e6:.0f} MB/s")
    swapped = steady[0].cache_hits + steady[0].cache_misses
    t.add_row("swapped subgroups kept in memory (alternating order)", f"{med('cache_hits'):.0f} of {swapped}")
    t.add_row("subgroups on host / device lane", f"{med('host_lane_subgroups'):.0f} / {med('device_lane_subgroups'):.0f}")
    changes = [r for prev, r in zip(records, records[1:]) if r.knobs != prev.knobs]
    t.add_row(
        "knob changes (tuner)",
        f"{len(changes)}" + (f", last at step {changes[-1].iteration}: {knobs_text(changes[-1].knobs, ', ')}" if changes else ""),
    )
    return t


def print_summary(records: list[StepRecord], console: Console | None = None, title: str = "update phase") -> None:
    if records:
        (console or Console()).print(summary_table(records, title))
