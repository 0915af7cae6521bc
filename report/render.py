"""The report's outputs: PNG files, a self-contained HTML page, a terminal summary, JSON."""

from __future__ import annotations

import base64
import html
import json
import os
import textwrap

from rich.console import Console
from rich.table import Table

from engine.units import format_rate, format_seconds, format_size
from report.analyze import PHASES, SHARE_GROUPS
from tuner.knob_text import knobs_text

SECTION_TEXT = {
    "breakdown": (
        "Iteration time and loss, per iteration",
        "Each bar is one iteration (one optimizer step), stacked by where its time went: forward, backward, "
        "the update's parts, and the script's own time between DeepSpeed calls; the black line is the "
        "rolling median of the iteration time, which a few slow iterations do not move. Where outliers "
        "would flatten the rest, the axis stops at 2.5 times the rolling median and the bars cut there "
        "are marked \u25b2. Dashed black lines mark the tuner's knob changes, solid blue ones yours (a "
        "pin, unpin or freeze from offloadctl tune, labelled 'you:'), each with what changed. Below, every "
        "run's loss (the mean of the iteration's micro-batches): runs that train alike lie on each other.",
    ),
    "timeline": (
        "One iteration on a time axis",
        "The chosen iteration (--iteration, default the median one) of every run: the phases and the "
        "update's parts, then GPU memory, PCIe TX/RX, each tier's read (solid) and write (dashed) bandwidth "
        "from the kernel's disk counters, and the process's RSS and CPU use, with the phases shaded behind. "
        "A row no run could record on this machine (GPU memory and PCIe without a GPU) is left out and "
        "named in one line under 'Not recorded on this machine'.",
    ),
    "bytes": (
        "Bytes per parameter, by phase and tier",
        "Bytes the run read (solid) and wrote (hatched) on its tiers' devices in each phase of an iteration, "
        "per parameter (the rank's own storage bytes, mean over the steady iterations, so that the phases add "
        "up to the total), with what other processes moved on the same devices in grey above them (the "
        "kernel's device counters less the run's own), and the engine's own count for its "
        "update. Stock ZeRO-Infinity writes the fp32 "
        "gradients out (4 B/param: DeepSpeed 0.19 buffers them in backward and flushes most at the update's "
        "first swap-in) and reads them back with the state (16 read, 12 written): about 32 B/param. "
        "offloadctl keeps gradients in memory and leaves the subgroups it updates last in memory for the "
        "next step: at most 24.",
    ),
    "cache": (
        "Cache hits and knobs",
        "Swapped subgroups updated from memory kept since the previous step (the alternating order), against "
        "those read from storage, per iteration, with the knobs in force; the tuner's changes are dotted "
        "black lines with its reason, yours (pin, unpin, freeze) solid blue ones labelled 'you:'.",
    ),
    "compare": ("Runs side by side", "Median iteration of every run by segment, with its speed against the first run given."),
}
SINGLE_RUN_SECTIONS = ("breakdown", "timeline", "bytes", "cache")
"""A one-run report has nothing to put side by side: no compare section."""


def write_pngs(pngs: dict[str, bytes], directory: str) -> dict[str, str]:
    os.makedirs(directory, exist_ok=True)
    out = {}
    for name, data in pngs.items():
        path = os.path.join(directory, f"{name}.png")
        with open(path, "wb") as f:
            f.write(data)
        out[name] = path
    return out


def html_page(analysis: dict, pngs: dict[str, bytes]) -> str:
    runs = analysis["runs"]
    parts = [
        "<!doctype html><html><head><meta charset='utf-8'><title>offloadctl report</title><style>",
        "body{font-family:sans-serif;max-width:1150px;margin:1em auto;color:#222}"
        "table{border-collapse:collapse;font-size:13px}td,th{border:1px solid #ccc;padding:3px 8px;text-align:right}"
        "th:first-child,td:first-child{text-align:left}img{max-width:100%}.note{color:#a33}"
        "p.how{color:#444;font-size:14px}p.verdict{font-size:17px;margin:.3em 0}"
        ".shares{display:flex;height:26px;margin:.4em 0 .2em;font-size:12px;color:#fff;max-width:1000px}"
        ".shares div{overflow:hidden;white-space:nowrap;padding:5px 3px;box-sizing:border-box}"
        ".key span{display:inline-block;width:10px;height:10px;margin:0 4px 0 10px}.key{font-size:12px}"
        ".machine{border:2px solid #c33;background:#fff3f3;padding:6px 10px;margin:.5em 0}"
        "p.limit{font-size:15px;margin:.3em 0}table.facts td{text-align:left;vertical-align:top;max-width:520px;"
        "word-break:break-word;font-family:monospace;font-size:12px}ul.absent{color:#666;font-size:13px}"
        "</style></head><body>",
        "<h1>offloadctl report</h1>",
    ]
    parts += _html_comparison(analysis)
    for r in runs:
        s = r["summary"]
        status_class = "" if r["status_kind"] == "finished" else " class='note'"
        parts.append(f"<h3>{html.escape(r['label'])}: <span{status_class}>{html.escape(r['status'])}</span></h3>")
        count = extent(r) if r["status_kind"] == "finished" else extent(r).replace(f"; {r['status']}", "")
        parts.append(
            f"<p class='verdict'>{html.escape(headline(r))}; {html.escape(count)}<br><b>{html.escape(s['verdict'])}</b></p>"
        )
        parts.append(_html_shares(s["shares"]))
        parts.append(f"<p class='limit' id='limit'>{html.escape(limit_text(s.get('limit')))}</p>")
        parts.append(
            f"<p class='how'>{html.escape(r['path'])}, engine {r['engine']}, {_rank_text(r)}, "
            f"{r['params_total']:,} parameters</p>"
        )
        for n in r["notes"]:
            parts.append(f"<p class='note'>{html.escape(n)}</p>")
    parts.append("<h2 id='runs'>The runs</h2>")
    parts.append(_html_table(fact_rows(analysis), [r["label"] for r in runs], cls="facts"))
    parts.append("<h2 id='figures'>The median iteration</h2>")
    parts.append(_html_table(summary_rows(analysis), [r["label"] for r in runs]))
    from report.plots import absent_panels

    absent = absent_panels(analysis)
    for name, data in pngs.items():
        if len(runs) == 1 and name not in SINGLE_RUN_SECTIONS:
            continue
        title, how = SECTION_TEXT[name]
        b64 = base64.b64encode(data).decode()
        parts.append(
            f"<h2 id='{name}'>{title}</h2><p class='how'>{html.escape(how)}</p>"
            f"<img alt='{name}' src='data:image/png;base64,{b64}'>"
        )
    if absent:
        parts.append(
            "<h2 id='not-recorded'>Not recorded on this machine</h2><ul class='absent'>"
            + "".join(f"<li>{html.escape(a)}</li>" for a in absent)
            + "</ul>"
        )
    parts.append("<p class='how'>The numbers behind every plot: <code>offloadctl report --json</code>.</p>")
    parts.append("</body></html>")
    return "\n".join(parts)


SHARE_COLORS = {
    "forward": "#4e79a7",
    "backward": "#f28e2b",
    "update: read waits": "#e15759",
    "update: AdamW": "#59a14f",
    "update: write waits": "#edc948",
    "update: other": "#9c755f",
    "outside DeepSpeed": "#bab0ac",
}


def _html_shares(shares: list) -> str:
    """The median iteration as one bar of its shares, with a key."""
    bar = "".join(
        f"<div style='width:{100 * v:.2f}%;background:{SHARE_COLORS[k]}' title='{html.escape(k)} "
        f"{100 * v:.0f}%'>{f'{100 * v:.0f}%' if v >= 0.04 else ''}</div>"
        for k, v in shares
        if v > 0
    )
    key = "".join(f"<span style='background:{SHARE_COLORS[k]}'></span>{html.escape(k)} {100 * v:.0f}%" for k, v in shares)
    return f"<div class='shares'>{bar}</div><div class='key'>{key}</div>"


def _rank_text(r: dict) -> str:
    if len(r["ranks"]) == 1 and r["summary"].get("world_size", 1) == 1:
        return "one rank"
    return f"rank {r['rank']} of {r['summary'].get('world_size', len(r['ranks']))}"


def fmt_rate(x: float) -> str:
    """A per-second figure with K/M/G of 1000."""
    return format_rate(x, "").strip()


def fmt_s(x: float) -> str:
    """Seconds as ms below one, else s (3 significant digits)."""
    return format_seconds(x)


def headline(r: dict) -> str:
    """How fast: s/iteration (median of the steady iterations), samples/s and tokens/s over all
    ranks. The same line heads the report and the summary at the end of a run."""
    s = r["summary"]
    parts = [f"{fmt_s(s['median_iter_s'])}/iteration (median of {len(s['steady_iterations'])})"]
    if s.get("samples_per_s"):
        parts.append(f"{fmt_rate(s['samples_per_s'])} samples/s")
    if s.get("tokens_per_s"):
        parts.append(f"{fmt_rate(s['tokens_per_s'])} tokens/s")
    world = s.get("world_size", 1)
    return ", ".join(parts) + (f" over {world} ranks" if world > 1 and len(parts) > 1 else "")


def extent(r: dict) -> str:
    """How long, and how it ended, and what the median of :func:`headline` is of: '7 iterations
    in 3.83 s; interrupted by SIGINT at iteration 7; the median: all but the first'."""
    s = r["summary"]
    text = f"{s['iterations']} iterations in {fmt_s(s['total_s'])}"
    text = text if r["status_kind"] == "finished" else f"{text}; {r['status']}"
    left = s["iterations"] - len(s["steady_iterations"])
    if s["iterations"] > 1:
        skipped = f" and {left - 1} skipped (overflow)" if left > 1 else ""
        text += f"; the median: all but the first (start-up){skipped}"
    return text


def _html_table(rows: list[tuple[str, list[str]]], labels: list[str], cls: str = "") -> str:
    head = "<tr><th></th>" + "".join(f"<th>{html.escape(x)}</th>" for x in labels) + "</tr>"
    body = "".join(
        "<tr><th>" + html.escape(name) + "</th>" + "".join(f"<td>{html.escape(v)}</td>" for v in vals) + "</tr>"
        for name, vals in rows
    )
    return f"<table{f' class={cls!r}' if cls else ''}>{head}{body}</table>"


def limit_text(lim: dict | None) -> str:
    """'What limits this run: ...; next: ...' of :func:`report.analyze.limit`."""
    if not lim:
        return "what limits this run: not known"
    return f"what limits this run: {lim['what']}" + (f"; next: {lim['next']}" if lim.get("next") else "")


def comparison_lines(analysis: dict) -> list[tuple[str, str | None]]:
    """Per run compared with the first: (the speed line, the machine warning or None). The
    speed line gives the iteration's ratio and the update's (the phase the engine runs)."""
    out = []
    for c in analysis.get("comparison") or []:
        up = c["phases"]["update"]
        ratio = f"{c['speedup']:.2f}x" if c.get("speedup") else "-"
        upd = (
            f"{up['ratio']:.2f}x ({fmt_s(up['base']['median_s'])} vs {fmt_s(up['run']['median_s'])})" if up.get("ratio") else "-"
        )
        out.append(
            (
                f"{c['run']} against {c['base']}: iteration {ratio} the speed; the update (the optimizer "
                f"step, the engine's phase) {upd}",
                c.get("machine"),
            )
        )
    return out


def _html_comparison(analysis: dict) -> list[str]:
    out = []
    for line, machine in comparison_lines(analysis):
        out.append(f"<p class='verdict' id='comparison'><b>{html.escape(line)}</b></p>")
        if machine:
            out.append(
                f"<div class='machine' id='machine-warning'><b>The machine differed between the runs.</b> "
                f"{html.escape(machine)}.</div>"
            )
    return out


NOT_RECORDED = "not recorded (by an offloadctl before it recorded this)"


def fact_rows(analysis: dict) -> list[tuple[str, list[str]]]:
    """What each run was: command line, options, script arguments, tier layout, knobs at start,
    versions, date and host; a fact the run's record lacks says so."""
    import shlex

    def cell(r, key, fn=str):
        v = (r.get("facts") or {}).get(key)
        return NOT_RECORDED if v is None else fn(v)

    def command(v):
        return "offloadctl " + shlex.join(v)

    def command_missing(r):
        f = r.get("facts") or {}
        if f.get("command") is None and (f.get("versions") is not None):
            return "not recorded (a rank not started by offloadctl train on this node)"
        return NOT_RECORDED

    rows = [
        (
            "command line",
            [
                cell(r, "command", command) if (r.get("facts") or {}).get("command") is not None else command_missing(r)
                for r in analysis["runs"]
            ],
        ),
        (
            "options",
            [
                cell(r, "options", lambda v: shlex.join(v) or "none")
                if (r.get("facts") or {}).get("command") is not None
                else command_missing(r)
                for r in analysis["runs"]
            ],
        ),
        (
            "script and its arguments",
            [
                shlex.join([(r.get("facts") or {}).get("script") or "?", *((r.get("facts") or {}).get("script_args") or [])])
                for r in analysis["runs"]
            ],
        ),
        ("optimizer state (tier layout)", [cell(r, "layout") for r in analysis["runs"]]),
        (
            "knobs at start",
            [
                cell(r, "knobs_at_start", lambda v: knobs_text(v, ", "))
                if r["engine"] != "stock"
                else "none (DeepSpeed's own optimizer)"
                for r in analysis["runs"]
            ],
        ),
        ("versions", [cell(r, "versions", lambda v: ", ".join(f"{k} {x}" for k, x in v.items() if x)) for r in analysis["runs"]]),
        ("date", [cell(r, "date") for r in analysis["runs"]]),
        ("host, ranks", [f"{cell(r, 'host')}, {cell(r, 'world_size')}" for r in analysis["runs"]]),
    ]
    return rows


def _fmt_s(x) -> str:
    if x is None:
        return "-"
    return f"{x * 1e3:.1f} ms" if abs(x) < 1 else f"{x:.3f} s"


def _bpp(d: dict | None) -> str:
    if not d:
        return "-"
    return ", ".join(f"{t.split(' ')[0]} {rw.get('read', 0):.1f}r {rw.get('written', 0):.1f}w" for t, rw in sorted(d.items()))


OTHERS_SHOWN = 0.05
"""B/param of other processes' traffic in a phase below which the table leaves it out."""


def _disk_cell(s: dict, phase: str) -> str:
    """A phase's disk bytes per parameter: the run's own ('0.0r 6.8w'), and other processes'
    on the same devices apart; without the run's own count (an older record), the devices'."""
    run = (s.get("run_disk_bytes_per_param") or {}).get(phase)
    if run is None:
        return _bpp(s["disk_bytes_per_param"].get(phase))
    text = f"{run['read']:.1f}r {run['written']:.1f}w"
    other = (s.get("other_disk_bytes_per_param") or {}).get(phase) or {}
    if sum(other.values()) >= OTHERS_SHOWN:
        text += f"; others {other['read']:.1f}r {other['written']:.1f}w"
    return text


def _disk_total_cell(s: dict) -> str:
    if s.get("run_disk_bytes_per_param_total") is not None:
        text = f"{s['run_disk_bytes_per_param_total']:.1f}"
        others = s.get("other_disk_bytes_per_param_total") or 0.0
        return text + (f"; other processes {others:.1f}" if others >= OTHERS_SHOWN else "")
    return f"{s['disk_bytes_per_param_total']:.1f}" if s.get("disk_bytes_per_param_total") is not None else "-"


def summary_rows(analysis: dict) -> list[tuple[str, list[str]]]:
    """The terminal's and the HTML page's table: one column per run."""
    runs = analysis["runs"]
    rows: list[tuple[str, list[str]]] = []

    def row(name, fn):
        rows.append((name, [fn(r) for r in runs]))

    row("status", lambda r: r["status"].split(" (")[0])
    row("iterations (steady)", lambda r: f"{r['summary']['iterations']} ({len(r['summary']['steady_iterations'])})")
    row("median iteration", lambda r: f"{_fmt_s(r['summary']['median_iter_s'])} (#{r['summary']['median_iteration']})")
    if len(runs) > 1:
        row("speed vs the first run", lambda r: f"{r['summary']['speedup_vs_first']:.2f}x")
        ratios = {c["run"]: c["phases"]["update"]["ratio"] for c in analysis.get("comparison") or []}
        row(
            "update's speed vs the first",
            lambda r: "1.00x" if r is runs[0] else f"{ratios[r['label']]:.2f}x" if ratios.get(r["label"]) else "-",
        )
    row("samples/s (all ranks)", lambda r: fmt_rate(r["summary"]["samples_per_s"]) if r["summary"].get("samples_per_s") else "-")
    row("tokens/s (all ranks)", lambda r: fmt_rate(r["summary"]["tokens_per_s"]) if r["summary"].get("tokens_per_s") else "-")
    for name, _ in SHARE_GROUPS:
        row(f"  {name}", lambda r, name=name: _share_cell(r, name))
    row("phases recorded / iteration", lambda r: f"{100 * r['summary']['median_measured_share']:.1f}%")
    for ph in PHASES:
        row(f"disk B/param, {ph}", lambda r, ph=ph: _disk_cell(r["summary"], ph))
    row("disk B/param, iteration", lambda r: _disk_total_cell(r["summary"]))
    row(
        "gradients' round trip B/param",
        lambda r: (
            "{written:.1f}w {read:.1f}r".format(**r["summary"]["gradient_round_trip_bytes_per_param"])
            if "gradient_round_trip_bytes_per_param" in r["summary"]
            else "-"
        ),
    )
    row("engine's B/param", lambda r: _bpp(r["summary"].get("engine_bytes_per_param")))
    row(
        "cache hits (of swapped)",
        lambda r: (
            f"{r['summary']['median_cache_hits']:.0f} of {r['summary']['swapped_subgroups']:.0f}"
            if r["summary"].get("swapped_subgroups") is not None
            else "-"
        ),
    )
    row("knob changes", lambda r: knob_changes_text(r["knob_changes"]) if any("knobs" in i for i in r["iterations"]) else "-")
    row("fixed knobs (never tuned)", lambda r: fixed_knobs_text(r["summary"].get("fixed_knobs")))
    row("engine host memory, peak", lambda r: host_memory_text(r["summary"].get("host_memory"), kinds=False))
    row("  state/staging/kept/copies", lambda r: host_kinds_text(r["summary"].get("host_memory")))
    row("GPU peak fwd/bwd/update", _gpu_peaks)
    row(
        "recorder: hooks; sampler CPU",
        lambda r: (
            f"{100 * (r['recorder']['hooks_share'] or 0):.2f}%; "
            + (f"{r['recorder']['sampler_busy_s']:.2f} s" if r["recorder"]["sampler_busy_s"] is not None else "-")
        ),
    )
    return rows


def knob_changes_text(changes: list[dict]) -> str:
    """'3 (2 by the tuner, 1 by you)': the knob changes, by who made them."""
    if not changes:
        return "0"
    by: dict[str, int] = {}
    for ch in changes:
        by[ch.get("by") or "unknown"] = by.get(ch.get("by") or "unknown", 0) + 1
    return (
        f"{len(changes)} ("
        + ", ".join(f"{n} by {who}" if who != "unknown" else f"{n} unattributed" for who, n in by.items())
        + ")"
    )


def host_kinds_text(hm: dict | None) -> str:
    """'0 B state, 480.0 MB staging, ...' of :func:`report.analyze.host_memory_summary`."""
    if not hm:
        return "-"
    return ", ".join(f"{format_size(v)} {k}" for k, v in hm["by_kind"].items())


def host_memory_text(hm: dict | None, kinds: bool = True) -> str:
    """The engine's host memory at its peak against the rank's budget, with the pressure steps."""
    if not hm:
        return "-"
    text = format_size(hm["peak_bytes"])
    if hm["budget_bytes"]:
        text += f" of its {format_size(hm['budget_bytes'])} budget"
    if kinds:
        text += f" ({host_kinds_text(hm)})"
    if hm["pressure_iterations"]:
        text += f"; memory low in {hm['pressure_iterations']} iterations: buffers given back"
    return text


def fixed_knobs_text(fixed: dict | None) -> str:
    return knobs_text(fixed, ", ") if fixed else "none"


def _share_cell(r: dict, name: str) -> str:
    """A share of the median iteration, with its time: '62% 281 ms'."""
    sh = dict(r["summary"]["shares"]).get(name, 0.0)
    return f"{100 * sh:.0f}% {_fmt_s(sh * r['summary']['median_iter_s'])}"


def _gpu_peaks(r: dict) -> str:
    peaks = r["timeline"].get("gpu_peak_by_phase") or {}
    p = peaks.get("nvml_used_bytes") or peaks.get("gpu_reserved_bytes")
    if not p:
        return "not recorded"
    return " / ".join("-" if p.get(ph) is None else f"{p[ph] / 1e9:.1f}" for ph in PHASES[:3]) + " GB"


def print_summary(analysis: dict, console: Console | None = None) -> None:
    console = console or Console()
    width = min(console.width, 100)

    def say(text: str, style: str = "") -> None:
        lead = text[: len(text) - len(text.lstrip())]
        for line in textwrap.wrap(text, width, initial_indent="", subsequent_indent=lead + "  ", break_on_hyphens=False):
            console.print(line, style=style, markup=False, highlight=False, soft_wrap=True)

    for r in analysis["runs"]:
        prefix = f"{r['label']}: " if len(analysis["runs"]) > 1 else ""
        say(f"{prefix}{headline(r)}")
        indent = "  " if prefix else ""
        say(indent + extent(r), "" if r["status_kind"] == "finished" else "yellow")
        say(f"{indent}bottleneck: {r['summary']['verdict']}", "bold")
        say(indent + limit_text(r["summary"].get("limit")))
    for line, machine in comparison_lines(analysis):
        say(line, "bold")
        if machine:
            say(f"warning: {machine}", "yellow")
    t = Table(
        "",
        *[r["label"] for r in analysis["runs"]],
        title="the median iteration (B/param: mean of steady iterations; disk: the run's own, others: other "
        "processes on the same devices)",
    )
    for name, vals in summary_rows(analysis):
        t.add_row(name, *vals)
    console.print(t)
    for r in analysis["runs"]:
        for n in r["notes"]:
            console.print(f"[yellow]{r['label']}: {n}[/yellow]")
    from report.plots import absent_panels

    for m in absent_panels(analysis):  # once for all runs, as on the page
        say(m, "dim")


def to_json(analysis: dict, files: dict) -> str:
    return json.dumps(dict(analysis, files=files), indent=1, default=float)
