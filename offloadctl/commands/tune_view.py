"""What `offloadctl tune` draws: a run's panel (tuner state, knobs, the iteration time's phases
and history), the table of runs, and the line a run ends with, from the daemon's snapshot: its
runs' views (:class:`tuner.run_state.RunView`), worded here."""

from __future__ import annotations

import re
import statistics
import textwrap
from typing import TYPE_CHECKING

from rich.console import Group
from rich.table import Table
from rich.text import Text

from engine.config import Knobs, split_key
from engine.errors import ConfigError
from engine.units import format_seconds
from report.analyze import analyze_run
from report.load import load_run
from tuner.knob_text import adaptation_text, knobs_text, value_text

if TYPE_CHECKING:
    from tuner.run_state import Activity, RunView

SPARK = "▁▂▃▄▅▆▇█"
ENDED = ("finished", "disconnected")
"""A run's statuses in the daemon once it is over."""


def at_iteration(r: RunView) -> int:
    """The iteration a run is at, counted as the end-of-run summary and the report count it:
    the iterations it completed (the daemon's ``iteration`` is the last one reported, from 0)."""
    return max(0, r["iteration"] + 1)


def ended_text(r: RunView) -> str:
    """'finished at iteration 30', 'interrupted by SIGINT at iteration 110': the words and the
    count of the end-of-run summary and the report."""
    by = f" by {r['stopped_by']}" if r.get("stopped_by") and r["outcome"] == "interrupted" else ""
    return f"{r['outcome']}{by} at iteration {at_iteration(r)}"


def final_line(r: RunView, run_dir: str | None = None) -> str:
    """One run's outcome: how it ended, at which iteration, its iteration time and knobs, and
    what the tuner does with it. The iteration time is the run's summary's (the median of every
    iteration but the first, from the run's record in ``run_dir``); without the record, the
    median of the last 20 the tuner saw, said as such."""
    pace = ""
    recorded = recorded_median(run_dir) if run_dir else None
    if recorded is not None:
        pace = f"; {format_seconds(recorded[0])}/iteration (median of {recorded[1]}, as in the run's summary)"
    else:
        times = [t for t in r["history"]["iter_time_s"][-20:] if t is not None]
        if times:
            pace = (
                f"; {format_seconds(statistics.median(times))}/iteration (median of the last {len(times)} the tuner saw; "
                f"the run's summary takes all but the first)"
            )
    activity = activity_text(r.get("verdict"))
    return f"{r['run_id']}: {ended_text(r)}{pace}; knobs {knobs_text(r['knobs'])}" + (f"\ntuner: {activity}" if activity else "")


def recorded_median(run_dir: str) -> tuple[float, int] | None:
    """(median iteration time, iterations it is of) as the run's summary and report give them,
    from the record in ``run_dir``; None where it holds none that reports."""
    try:
        s = analyze_run(load_run(run_dir))["summary"]
    except (ConfigError, OSError, ValueError, KeyError):
        return None
    return s["median_iter_s"], len(s["steady_iterations"])


def held_text(reason: str) -> str:
    """The tuner's 'holding at iteration 0.309 s' said as what it is: the median of the last
    iterations it measured before it settled, not the run's median."""
    from tuner.policy_config import PolicyConfig

    window = PolicyConfig().window
    return re.sub(
        r"holding at (iteration|update) (\d+(?:\.\d+)?) s",
        lambda m: (
            f"holding at {format_seconds(float(m[2]))}/{m[1]} (the median of the last {window} it measured before it settled)"
        ),
        reason,
    )


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
    """Seconds as the end-of-run summary and the report write them: '561 ms', '1.13 s'."""
    return "-" if s is None else format_seconds(s)


def runs_table(runs: list[RunView], width: int = 80):
    """The runs of a snapshot, for ``tune --once``: a line each (status, ranks, iteration,
    iteration time), then its knobs, wrapped whole to ``width`` (never cut)."""
    out = Text("tuner runs" + ("" if runs else ": none"), style="bold")
    for r in runs:
        status = (ended_text(r) if r["status"] in ENDED else r["status"]) + (" (frozen)" if r["frozen"] else "")
        pace = f", {format_seconds(r['iter_time_s'])}/iteration" if r.get("iter_time_s") else ""
        out.append(f"\n{r['run_id']}: {status}, ranks {r['connected']}/{r['ranks']}, iteration {at_iteration(r)}{pace}", style="")
        knobs = textwrap.wrap(
            "knobs: " + knobs_text(r["knobs"]),
            max(40, width),
            initial_indent="  ",
            subsequent_indent="    ",
            break_on_hyphens=False,
            break_long_words=True,
        )
        out.append("\n" + "\n".join(knobs), style="")
    return out


def tuner_state(r: RunView) -> str:
    """What the tuner is doing with the run (:func:`activity_text`), or how the run ended."""
    if r["status"] in ENDED:
        return ended_text(r)
    return activity_text(r.get("verdict")) or ("tuning" if r["status"] == "running" else r["status"])


def activity_text(activity: Activity | None) -> str:
    """What the tuner does with a run (``tuner.run_state.tuner_activity``) in words; '' without it."""
    v: Activity | dict[str, None] = activity or {}
    mode, reason = v.get("mode"), v.get("reason")
    if mode == "stopped":
        return f"policy stopped: {reason}"
    if mode == "frozen":
        return "frozen by the user: knobs held"
    if mode == "trial":
        return f"trying {v.get('trial')}"
    if mode == "holding":
        since = f" (since iteration {v['since_iteration']})" if v.get("since_iteration") is not None else ""
        return f"holding{since}: {held_text(reason) if reason else 'no move left to try'}"
    if mode == "measuring":
        return "measuring the current knobs"
    return ""


def knob_control(r: RunView) -> str:
    """Which knobs the user pinned and which the tuner may move."""
    pins = r.get("pins") or {}
    fixed = set((r.get("policy") or {}).get("fixed") or ())  # by the run's own options, not tune --pin
    pinned = ", ".join(f"{k}={value_text(v)}" + (" (run option)" if k in fixed else "") for k, v in pins.items()) or "none"
    if r["frozen"] or r["status"] in ENDED:
        movable = "none" + (" (frozen)" if r["frozen"] else "")
    else:
        movable = (
            ", ".join(
                n + (" (other paths)" if n in {split_key(p)[0] for p in pins} else "") for n in Knobs.names() if n not in pins
            )
            or "none"
        )
    return f"pinned: {pinned}; tuner may move: {movable}"


def fitted_panels(runs: list[RunView], console, height: int | None = -1) -> list:
    """The runs' panels at the console's width; with one run, as many decision rows as fit the
    console's height (a frame taller than the terminal would be cut)."""
    height = console.size.height - 1 if height == -1 else height
    if len(runs) != 1 or height is None:
        return [run_panel(r, width=console.width) for r in runs]
    for rows in (6, 4, 2, 1, 0):
        panel = run_panel(runs[0], width=console.width, decisions=rows)
        if len(console.render_lines(panel, console.options, pad=False)) <= height:
            break
    return [panel]


def run_panel(r: RunView, *, width: int | None = None, decisions: int = 6):
    """One run of a snapshot: what the tuner is doing, knobs, the iteration time (its phases and
    its recent history), per-path traffic, PCIe, and the latest knob changes."""
    from rich.panel import Panel  # only for the live view: not loaded with the CLI

    ph = r.get("phases") or {}
    it = ph.get("iter_time_s")
    observed = ph.get("iteration")
    head = Text(f"iteration {at_iteration(r)}, ranks {r['connected']}/{r['ranks']}; tuner: ")
    head.append(tuner_state(r), style="red" if r.get("policy_error") else "yellow" if r["frozen"] else "green")
    body: list = [head, Text("knobs: " + knobs_text(r["knobs"])), Text(knob_control(r), style="dim")]
    if r.get("truncated"):
        body.append(Text(f"(compact view: {r['truncated']})", style="dim"))

    phases = Table(
        "iteration time" + (f" (iteration {observed + 1}, slowest rank)" if observed is not None else ""),
        "",
        box=None,
        title_justify="left",
    )
    rest = (it - u) if it is not None and (u := ph.get("update_s")) is not None else None
    phases.add_row("  forward, backward, other", _secs(rest))
    for name, key in (
        ("  update (optimizer step)", "update_s"),
        ("    waiting for reads", "read_wait_s"),
        ("    AdamW", "kernel_s"),
        ("    waiting for writes", "write_wait_s"),
    ):
        phases.add_row(name, _secs(ph.get(key)))
    phases.add_row("  total", _secs(it), style="bold")
    body.append(phases)

    times, what = r["history"]["iter_time_s"], "iteration time"
    if not any(t is not None for t in times):
        times, what = r["history"]["update_s"], "update time"
    known = [t for t in times if t is not None]
    if known:
        scale = f"  {_secs(min(known))} to {_secs(max(known))}"
        spark_w = max(8, min(len(times), (width or 100) - 4 - len(f"{what}, last 60 iterations: ") - len(scale)))
        times = times[-spark_w:]
        known = [t for t in times if t is not None]
        scale = f"  {_secs(min(known))} to {_secs(max(known))}" if known else ""
        label = f"{what}, last {len(times)} iterations: "
        body.append(Text(label) + Text(sparkline(times, spark_w), style="cyan") + Text(scale))
    else:
        body.append(Text("no iterations reported yet", style="dim"))

    sensors = r.get("sensors") or {}
    policy = r.get("policy") or {}
    if r["bandwidth"]:
        rates = policy.get("rates") or {}
        paths = Table("path", "read", "write", "serves at", "others", "slots", box=None, title_justify="left")
        for p, bw in r["bandwidth"].items():
            # slots: the requests in flight on the path at most (io_concurrency); ? explains it
            paths.add_row(
                Text(p, overflow="fold"),
                _rate(bw["read_bytes_per_s"]),
                _rate(bw["write_bytes_per_s"]),
                _rate(rates.get(p)),
                _rate(bw["other_bytes_per_s"]),
                str(bw["concurrency"]),
            )
        body.append(paths)
    body.extend(Text("conditions: " + adaptation_text(a)) for a in (policy.get("adaptations") or [])[-2:])
    gpu = sensors.get("gpu")
    if isinstance(gpu, dict) and gpu:
        body.append(Text("GPU/PCIe: " + ", ".join(f"{k}={_num(v)}" for k, v in gpu.items() if not isinstance(v, (dict, list)))))
    if sensors.get("cpu_percent") is not None:
        body.append(Text(f"CPU: {sensors['cpu_percent']:.0f}%"))

    if decisions:
        log = Table("iteration", "applies at", "by", "why", box=None, title="knob changes", title_justify="left")
        for d in r["decisions"][-decisions:]:
            log.add_row(
                str(d["iteration"]) if d["iteration"] >= 0 else "start",
                str(d["apply_at"] if d["apply_at"] is not None else "-"),
                d["source"],
                Text(d["reason"]),
            )
        if not r["decisions"]:
            log.add_row("-", "-", "-", "none yet")
        body.append(log)
    status = r["outcome"] if r["status"] in ENDED else r["status"]
    return Panel(Group(*body), title=Text(f"{r['run_id']} ({status})"), title_align="left", width=width)


def _num(v) -> str:
    if isinstance(v, float):
        return f"{v / 1e6:,.0f}M" if abs(v) >= 1e6 else f"{v:.3g}"
    return str(v)
