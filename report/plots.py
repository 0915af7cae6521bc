"""The report's figures, drawn with matplotlib (Agg) from :func:`report.analyze.analyze`'s
numbers: one figure per section, every run in it side by side.

- ``breakdown``: each iteration's time, stacked by segment; knob changes marked.
- ``timeline``: one iteration per run on a time axis: phases, GPU memory, PCIe TX/RX, tier
  bandwidth, host RSS and CPU, with the phases shaded behind every series.
- ``bytes``: bytes per parameter per iteration, by phase, tier and direction.
- ``cache``: swapped subgroups found in memory (cache hits) or read, per iteration, and every
  knob that changed (per-path ones each on their own), with the tuner's changes marked.
- ``compare``: the median iteration of every run, stacked by segment, with its speed-up (only
  for more than one run: a run compared with itself says nothing).

Labels of knob changes are placed in rows at the top of their axes, each in the first row where
it overlaps no other label (measured with the renderer), and the axes grow to make room; they
carry the gid ``knob-label`` so that tests can check them.
"""

from __future__ import annotations

import io
import statistics

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
from matplotlib.lines import Line2D  # noqa: E402
from matplotlib.patches import Patch  # noqa: E402
from matplotlib.ticker import MaxNLocator  # noqa: E402

from engine.config import KnobKey, split_key  # noqa: E402
from report.analyze import PHASES, SEGMENT_LABELS, SEGMENTS  # noqa: E402

SECTIONS = ("breakdown", "timeline", "bytes", "cache", "compare")
COLORS = {
    "forward": "#4e79a7",
    "backward": "#f28e2b",
    "read_wait": "#e15759",
    "host_lane": "#59a14f",
    "device_lane": "#76b7b2",
    "write_wait": "#edc948",
    "device_wait": "#b07aa1",
    "update_other": "#9c755f",
    "outside": "#d3cfcc",
    "update": "#59a14f",
    "update_loop": "#8cd17d",
}
WIDTH_IN = 11.0
DPI = 100
GB = 1e9


def figures(analysis: dict) -> dict[str, "plt.Figure"]:
    """One figure per section, in :data:`SECTIONS` order (no ``compare`` for a single run)."""
    runs = analysis["runs"]
    out = {"breakdown": breakdown(runs), "timeline": timeline(runs)}
    if any(_has_bytes(r) for r in runs):
        out["bytes"] = bytes_per_param(runs)
    if any(_has_cache(r) for r in runs):
        out["cache"] = cache_and_knobs(runs)
    if len(runs) > 1:
        out["compare"] = compare(runs, analysis.get("comparison"))
    return out


def _has_bytes(run: dict) -> bool:
    s = run["summary"]
    return bool(run["tiers"]) or any(s["disk_bytes_per_param"].values()) or "engine_bytes_per_param" in s


def _has_cache(run: dict) -> bool:
    return any("cache" in i for i in run["iterations"])


def absent_panels(analysis: dict) -> list[str]:
    """The panels no run could record on this machine, a line each (instead of an empty plot):
    what is missing and why, with the runs it concerns when not all."""
    runs = analysis["runs"]
    out = []

    def missing(test, text):
        lacking = [r["label"] for r in runs if not test(r)]
        if len(lacking) == len(runs):
            out.append(text)
        elif lacking:
            out.append(f"{text}; in {', '.join(lacking)}")

    series = lambda r: r["timeline"]["series"]  # noqa: E731
    missing(lambda r: "gpu_allocated_bytes" in series(r), "GPU memory: not recorded (no CUDA device)")
    missing(lambda r: "pcie_tx_bytes_per_s" in series(r), "PCIe TX/RX: not recorded (no NVML: no NVIDIA driver or GPU)")
    missing(lambda r: bool(series(r).get("tier_bytes_per_s")), "tier bandwidth: not recorded (no storage tier on a block device)")
    missing(lambda r: "rss_bytes" in series(r), "host RSS and CPU: not recorded (--record-hz 0)")
    missing(_has_bytes, "bytes per parameter: none to count (no storage tier on a block device)")
    missing(_has_cache, "cache hits and knobs: no engine telemetry (stock DeepSpeed keeps no state in memory across steps)")
    missing(lambda r: r.get("loss_recorded"), "loss: not recorded (the run was recorded by an offloadctl before losses were)")
    return out


KNOB_LABEL = "knob-label"
LABEL_ROW = 0.085
"""Height of one row of knob-change labels, as a fraction of the axes."""


def place_labels(ax, items: list[tuple[float, str]], *, fontsize: float = 7) -> float:
    """Write ``items`` (x in data, text) at the top of ``ax``, each in the first row where its box
    overlaps no earlier label, right-aligned where it would run past the axes' right edge.
    Returns the axes fraction below the lowest row (what the data must stay under)."""
    fig = ax.figure
    renderer = fig.canvas.get_renderer()
    trans = matplotlib.transforms.blended_transform_factory(ax.transData, ax.transAxes)
    ax_box = ax.get_window_extent(renderer)
    placed: list = []
    lowest = 1.0
    for x, text in items:
        for row in range(20):
            y = 0.97 - row * LABEL_ROW
            t = ax.text(
                x,
                y,
                text,
                transform=trans,
                fontsize=fontsize,
                va="top",
                ha="left",
                gid=KNOB_LABEL,
                bbox={"facecolor": "white", "edgecolor": "none", "alpha": 0.8, "pad": 1},
            )
            box = t.get_window_extent(renderer)
            if box.x1 > ax_box.x1:
                t.set_ha("right")
                box = t.get_window_extent(renderer)
            if not any(box.overlaps(b) for b in placed) or row == 19:
                placed.append(box)
                lowest = min(lowest, y - LABEL_ROW)
                break
            t.remove()
    return lowest


def _headroom(ax, data_top: float, lowest: float) -> None:
    """Raise the y limit so that ``data_top`` stays below the labels' lowest row."""
    if data_top > 0 and lowest < 1.0:
        ax.set_ylim(top=data_top / max(lowest - 0.02, 0.2))


def png_bytes(fig) -> bytes:
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=DPI)
    plt.close(fig)
    return buf.getvalue()


def _segment_legend(fig, keys=SEGMENTS, ncol=5, extra=()) -> None:
    handles = [Patch(color=COLORS[k], label=SEGMENT_LABELS[k]) for k in keys] + list(extra)
    fig.legend(handles=handles, loc="upper center", ncol=ncol, fontsize=8, frameon=False)


def _ms_or_s(seconds: float) -> str:
    return f"{seconds * 1e3:.0f} ms" if seconds < 1 else f"{seconds:.2f} s"


# -- breakdown ---------------------------------------------------------------------------------


def breakdown(runs: list[dict]):
    """Each run's iterations as stacked bars with their rolling median, cut above a few
    outliers (:func:`outlier_cap`), and under them every run's loss on one axes (the same
    iterations), where a run recorded it."""
    n = len(runs)
    losses = any(r.get("loss_recorded") for r in runs)
    fig, axes = plt.subplots(
        n + losses,
        1,
        figsize=(WIDTH_IN, 1.0 + 2.4 * n + 2.0 * losses),
        squeeze=False,
        gridspec_kw={"height_ratios": [2.4] * n + [2.0] * losses},
    )
    for ax in axes[1:n, 0]:
        ax.sharey(axes[0, 0])
    totals = []
    for ax, run in zip(axes[:n, 0], runs):
        its = run["iterations"]
        x = [i["iteration"] for i in its]
        bottom = [0.0] * len(its)
        for k in SEGMENTS:
            vals = [max(0.0, i["segments"][k]) for i in its]
            ax.bar(x, vals, bottom=bottom, color=COLORS[k], width=0.8)
            bottom = [b + v for b, v in zip(bottom, vals)]
        for i in its:
            if i["skipped"]:
                ax.text(i["iteration"], bottom[x.index(i["iteration"])], "skipped", ha="center", va="bottom", fontsize=7)
        rolling = (run.get("rolling_median_iter_s") or {}).get("values")
        if rolling:
            ax.plot(x, rolling, color="black", lw=1.4, gid=ROLLING_MEDIAN)
        ax.set_ylabel("seconds")
        ax.set_xlim(min(x) - 0.6, max(x) + 0.6)
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        totals.append((x, bottom))
    # One scale for every run (their axes share it): as high as the highest bar, or, where a few
    # outliers would flatten every other bar, cut at the cap and the bars above it marked.
    top = max((min(max(b), outlier_cap(b) or max(b)) for _, b in totals if b), default=1.0)
    for ax, run, (x, bottom) in zip(axes[:n, 0], runs, totals):
        out = [xi for xi, b in zip(x, bottom) if b > top * 1.0001]
        cut = ""
        if out:
            ax.plot(
                out,
                [1.0] * len(out),
                ls="none",
                marker="^",
                color="#c00",
                ms=4,
                gid=OUTLIER,
                clip_on=False,
                transform=ax.get_xaxis_transform(),
            )  # at the axes' top edge, whatever its limit becomes
            cut = f"; {len(out)} above {_ms_or_s(top)} cut (\u25b2), the slowest {_ms_or_s(max(bottom))}"
        s = run["summary"]
        ax.set_title(
            f"{run['label']}: median iteration {_ms_or_s(s['median_iter_s'])} ({run['status']}){cut}", fontsize=9, loc="left"
        )
    axes[0, 0].set_ylim(0, top * 1.08)
    if losses:
        lo = min(i["iteration"] for r in runs for i in r["iterations"])
        hi = max(i["iteration"] for r in runs for i in r["iterations"])
        _loss_axes(axes[n, 0], runs, (lo - 0.6, hi + 0.6))
    axes[-1, 0].set_xlabel("iteration")
    _segment_legend(fig, extra=[Line2D([], [], color="black", lw=1.4, label="rolling median of the iteration time")])
    fig.tight_layout(rect=(0, 0, 1, 1 - 0.45 / fig.get_figheight()))
    # Labels last, once the layout is fixed: their placement measures them on the final axes.
    for ax, run in zip(axes[:n, 0], runs):
        for ch in run["knob_changes"]:
            ax.axvline(ch["iteration"] - 0.5, **_change_style(ch))
        top = ax.get_ylim()[1] / 1.08
        _headroom(ax, top, place_labels(ax, [(ch["iteration"] - 0.45, _knob_change_text(ch)) for ch in run["knob_changes"]]))
    return fig


ROLLING_MEDIAN = "rolling-median"
OUTLIER = "outlier"
"""The gids of the breakdown's rolling median and of its marks for bars cut at the cap."""


def outlier_cap(totals: list[float]) -> float | None:
    """Where the breakdown's y axis stops when a few outliers would set it: 3 times the run's
    median iteration (None when no bar goes past it)."""
    if not totals:
        return None
    cap = 3 * statistics.median(totals)
    return cap if max(totals) > cap else None


def _change_style(ch: dict) -> dict:
    """A knob change's line: the user's (a pin, unpin or freeze) solid blue, the tuner's dashed black."""
    if ch.get("by") == "you":
        return {"color": "#1f5fbf", "ls": "-", "lw": 1.4}
    return {"color": "black", "ls": "--", "lw": 1}


def _knob_change_text(ch: dict) -> str:
    parts = [f"{_knob_name(k)}: {_short(a)} \u2192 {_short(b)}" for k, (a, b) in ch["changed"].items()]
    text = ("you: " if ch.get("by") == "you" else "") + "; ".join(parts)
    return text if len(text) < 70 else text[:67] + "..."


def _knob_name(text: str) -> str:
    """A per-path knob with its path's last part: io_concurrency[/mnt/nvme0/run] -> io_concurrency[run]."""
    name, path = split_key(text)
    return text if path is None else str(KnobKey(name, path.rstrip("/").rsplit("/", 1)[-1] or path))


def _short(v) -> str:
    if isinstance(v, float):
        return f"{v:.2f}"
    if isinstance(v, dict):
        return "{" + ", ".join(f"{_short(x)}" for x in v.values()) + "}"
    return str(v)


# -- timeline ----------------------------------------------------------------------------------

ROWS = ("phases", "gpu", "pcie", "tiers", "host")
ROW_TITLES = {
    "phases": "",
    "gpu": "GPU memory (GB)",
    "pcie": "PCIe (GB/s)",
    "tiers": "tier bandwidth (MB/s)",
    "host": "host RSS (GB)",
}


def timeline_rows(runs: list[dict]) -> list[str]:
    """The timeline's rows that some run recorded (:data:`ROWS` order): a row no run could
    record on this machine (GPU memory, PCIe without a GPU) is one line under the figure
    (:func:`absent_panels`), not an empty plot."""

    def has(r, name):
        s = r["timeline"]["series"]
        return {
            "phases": True,
            "gpu": "gpu_allocated_bytes" in s or "nvml_used_bytes" in s,
            "pcie": "pcie_tx_bytes_per_s" in s,
            "tiers": bool(s.get("tier_bytes_per_s")),
            "host": "rss_bytes" in s,
        }[name]

    return [name for name in ROWS if any(has(r, name) for r in runs)]


def timeline(runs: list[dict]):
    n = len(runs)
    rows = timeline_rows(runs)
    ratios = {"phases": 0.7, "gpu": 1, "pcie": 1, "tiers": 1.2, "host": 1}
    fig, axes = plt.subplots(
        len(rows),
        n,
        figsize=(WIDTH_IN, 1.2 + 1.6 * sum(ratios[r] for r in rows)),
        squeeze=False,
        sharex="col",
        gridspec_kw={"height_ratios": [ratios[r] for r in rows]},
    )
    for c, run in enumerate(runs):
        tl = run["timeline"]
        col = dict(zip(rows, axes[:, c]))
        _gantt(col["phases"], tl)
        col["phases"].set_title(f"{run['label']}\niteration {tl['iteration']} ({_ms_or_s(tl['iter_s'])})", fontsize=9)
        s = tl["series"]
        t = s.get("t", [])
        if "gpu" in col:
            _series(
                col["gpu"],
                t,
                s,
                [
                    ("gpu_allocated_bytes", "torch allocated"),
                    ("gpu_reserved_bytes", "torch reserved"),
                    ("nvml_used_bytes", "NVML used"),
                ],
                1 / GB,
                "GPU memory: not recorded\n(no CUDA device in this run)",
            )
        if "pcie" in col:
            _series(
                col["pcie"],
                t,
                s,
                [("pcie_tx_bytes_per_s", "TX (GPU\u2192host)"), ("pcie_rx_bytes_per_s", "RX (host\u2192GPU)")],
                1 / GB,
                "PCIe TX/RX: not recorded\n(no NVML in this run)",
                steps=True,
            )
        tiers = s.get("tier_bytes_per_s") or {}
        if "tiers" in col and tiers:
            for k, (lab, bw) in enumerate(tiers.items()):
                color = f"C{k}"
                # A rate covers the sampling interval that ends at its sample: a step drawn backwards.
                col["tiers"].plot(
                    t, _scale(bw["read_bytes_per_s"], 1e-6), color=color, label=f"{lab} read", drawstyle="steps-pre"
                )
                col["tiers"].plot(
                    t, _scale(bw["write_bytes_per_s"], 1e-6), color=color, ls="--", label=f"{lab} write", drawstyle="steps-pre"
                )
            col["tiers"].legend(fontsize=7, loc="upper left")
        elif "tiers" in col:
            _absent(col["tiers"], "tier bandwidth: no storage tier\non a block device in this run")
        if "host" in col and "rss_bytes" in s:
            rss = _scale(s["rss_bytes"], 1 / GB)
            col["host"].plot(t, rss, color="C0", label="RSS")
            col["host"].set_ylim(0, 1.25 * max((v for v in rss if v is not None), default=1.0))
            twin = col["host"].twinx()
            twin.plot(t, s.get("cpu_percent", []), color="C3", lw=0.8, label="CPU %")
            twin.set_ylim(bottom=0)
            twin.set_ylabel("CPU % (process)", fontsize=8, color="C3")
            twin.tick_params(labelsize=7)
            h1, l1 = col["host"].get_legend_handles_labels()
            h2, l2 = twin.get_legend_handles_labels()
            twin.legend(
                h1 + h2,
                ["host RSS (GB)", "CPU % (process)"] if l1 + l2 == ["RSS", "CPU %"] else l1 + l2,
                fontsize=7,
                loc="upper left",
            )
        elif "host" in col:
            _absent(col["host"], "host series: not recorded (--record-hz 0)")
        for name, ax in col.items():
            if name != "phases":
                _shade(ax, tl["phase_spans"])
                ax.tick_params(labelsize=7)
        col[rows[-1]].set_xlabel("seconds from the iteration's start", fontsize=8)
        col["phases"].set_xlim(-0.02 * tl["iter_s"], 1.02 * tl["iter_s"])
    for r, name in enumerate(rows):
        if ROW_TITLES[name]:
            axes[r, 0].set_ylabel(ROW_TITLES[name], fontsize=8)
        if r:  # one scale per row, so that the runs compare at a glance
            drawn = [ax for ax in axes[r] if ax.lines]
            top = max((ax.get_ylim()[1] for ax in drawn), default=None)
            for ax in drawn:
                ax.set_ylim(0, top)
    handles = [Patch(color=COLORS[k], alpha=0.35, label=k) for k in PHASES[:3]]
    handles += [
        Patch(color=COLORS[k], label=SEGMENT_LABELS.get(k, "update loop (reads, lanes)"))
        for k in ("update_loop", "read_wait", "host_lane", "write_wait", "device_wait")
    ]
    fig.legend(handles=handles, loc="upper center", ncol=4, fontsize=8, frameon=False)
    fig.tight_layout(rect=(0, 0, 1, 1 - 0.5 / fig.get_figheight()))
    return fig


def _gantt(ax, tl: dict) -> None:
    for name, a, b in tl["phase_spans"]:
        ax.broken_barh([(a, b - a)], (1.1, 0.8), color=COLORS.get(name, "grey"))
    for name, a, b in tl["update_spans"]:
        ax.broken_barh([(a, max(b - a, 1e-9))], (0.1, 0.8), color=COLORS.get(name, "grey"))
    ax.set_yticks([0.5, 1.5], ["update", "phase"], fontsize=8)
    ax.set_ylim(0, 2)
    ax.tick_params(labelsize=7)


def _scale(values, factor):
    return [None if v is None else v * factor for v in values]


def _series(ax, t, s: dict, names, factor, absent_text, steps=False) -> None:
    drawn = False
    for key, label in names:
        if key in s:
            ax.plot(t, _scale(s[key], factor), label=label, drawstyle="steps-pre" if steps else "default")
            drawn = True
    if drawn:
        ax.legend(fontsize=7, loc="upper left")
        ax.set_ylim(bottom=0)
    else:
        _absent(ax, absent_text)


def _absent(ax, text: str) -> None:
    ax.text(0.5, 0.5, text, transform=ax.transAxes, ha="center", va="center", fontsize=8, color="grey")
    if not ax.get_shared_y_axes().get_siblings(ax)[1:]:
        ax.set_yticks([])


def _shade(ax, spans) -> None:
    for name, a, b in spans:
        ax.axvspan(a, b, color=COLORS.get(name, "grey"), alpha=0.12, lw=0)


# -- loss ---------------------------------------------------------------------------------------

LOSS_AXES = "loss"
"""The gid of the breakdown's loss axes."""


def _loss_axes(ax, runs: list[dict], xlim) -> None:
    """Every run's loss per iteration (the mean of its micro-batches' losses, as passed to
    ``backward``) on one axes, so that a faster run is seen to train the same."""
    ax.set_gid(LOSS_AXES)
    for k, run in enumerate(runs):
        pts = [(i["iteration"], i["loss"]) for i in run["iterations"] if i.get("loss") is not None]
        if pts:
            ax.plot(
                [p[0] for p in pts],
                [p[1] for p in pts],
                color=f"C{k}",
                lw=1.2 + 0.6 * (k == 0),
                ls=("-", "--", ":", "-.")[k % 4],
                label=run["label"],
                marker="o" if len(pts) < 30 else None,
                ms=3,
            )
    missing = [r["label"] for r in runs if not r.get("loss_recorded")]
    ax.set_title("loss" + (f" (not recorded in {', '.join(missing)})" if missing else ""), fontsize=9, loc="left")
    ax.set_ylabel("loss")
    ax.set_xlim(*xlim)
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax.legend(fontsize=7, loc="upper right")


# -- bytes per parameter -------------------------------------------------------------------------

OTHERS = "other processes"
"""The bytes-per-parameter plot's label for the traffic of other processes on the tier devices."""


def bytes_per_param(runs: list[dict]):
    runs = [r for r in runs if _has_bytes(r)]  # the others: one line (absent_panels)
    n = len(runs)
    fig, axes = plt.subplots(1, n, figsize=(WIDTH_IN, 4.2), squeeze=False, sharey=True)
    tier_colors: dict[str, str] = {}
    for ax, run in zip(axes[0], runs):
        s = run["summary"]
        cats = list(PHASES)
        data = {ph: s["disk_bytes_per_param"].get(ph, {}) for ph in PHASES}
        others = s.get("other_disk_bytes_per_param")
        if s.get("run_disk_bytes_per_param") is not None:  # the run's own, apart from other processes'
            label = "+".join(t["label"] for t in run["tiers"] if t.get("device")) or "disk"
            data = {ph: {label: s["run_disk_bytes_per_param"].get(ph, {})} for ph in PHASES}
            for ph in PHASES:
                if sum((others or {}).get(ph, {}).values()) >= 0.05:
                    data[ph][OTHERS] = others[ph]
        if "engine_bytes_per_param" in s:
            cats.append("update\n(engine's count)")
            data["update\n(engine's count)"] = s["engine_bytes_per_param"]
        for k, cat in enumerate(cats):
            bottom = 0.0
            for tier, rw in sorted(data[cat].items(), key=lambda kv: (kv[0] == OTHERS, kv[0])):
                base = tier.split(" ")[0] if tier != OTHERS else tier
                color = tier_colors.setdefault(base, "#b0b0b0" if tier == OTHERS else f"C{len(tier_colors)}")
                for direction, hatch in (("read", ""), ("written", "//")):
                    v = rw.get(direction) or 0.0
                    if v <= 0:
                        continue
                    ax.bar(k, v, bottom=bottom, color=color, hatch=hatch, edgecolor="white", width=0.7)
                    if v >= 1.5:
                        ax.text(k, bottom + v / 2, f"{v:.1f}", ha="center", va="center", fontsize=7, color="white")
                    bottom += v
            if bottom > 0:
                ax.text(k, bottom, f"{bottom:.1f}", ha="center", va="bottom", fontsize=8)
        ax.set_xticks(range(len(cats)), cats, fontsize=8)
        ax.set_xlim(-0.6, len(cats) - 0.4)
        total = s.get("run_disk_bytes_per_param_total", s.get("disk_bytes_per_param_total"))
        other = s.get("other_disk_bytes_per_param_total") or 0.0
        title = f"{run['label']}\n{total:.1f} B/param per iteration on disk" if total is not None else run["label"]
        if other >= 0.05:
            title += f" (other processes: {other:.1f})"
        ax.set_title(title, fontsize=9)
        if not any(data[c] for c in cats):
            _absent(ax, "no storage tier on a block device:\nno bytes to count")
        trip = s.get("gradient_round_trip_bytes_per_param")
        if trip:
            ax.text(
                0.02,
                0.97,
                f"beyond Adam's 12 B/param of state each way:\n{trip['written']:.1f} written, "
                f"{trip['read']:.1f} read back: the fp32\ngradients' round trip through the tier",
                transform=ax.transAxes,
                va="top",
                fontsize=8,
                bbox={"facecolor": "white", "edgecolor": "#bbb", "boxstyle": "round"},
            )
    axes[0, 0].set_ylabel("bytes/param per iteration")
    handles = [Patch(facecolor=c, label=t) for t, c in tier_colors.items()]
    handles += [Patch(facecolor="grey", label="read"), Patch(facecolor="grey", hatch="//", edgecolor="white", label="written")]
    fig.legend(handles=handles, loc="upper center", ncol=len(handles), fontsize=8, frameon=False)
    fig.tight_layout(rect=(0, 0, 1, 1 - 0.35 / fig.get_figheight()))
    return fig


# -- cache hits and knobs ------------------------------------------------------------------------


def cache_and_knobs(runs: list[dict]):
    """Per run with engine telemetry: the cache hits and misses per iteration, with the knob
    that changed on a second scale, or, when several changed, one thin axes per knob below
    (a stock run has none: :func:`absent_panels` says so in a line)."""
    runs = [r for r in runs if _has_cache(r)]
    names_of = [[n for n in (run.get("knob_series") or {}) if n != "iteration"] for run in runs]
    knob_rows = [len(names) if len(names) > 1 else 0 for names in names_of]
    ratios = [r for k in knob_rows for r in [2.2] + [0.8] * k]
    fig, grid = plt.subplots(
        len(ratios), 1, figsize=(WIDTH_IN, 1.0 + sum(ratios)), squeeze=False, gridspec_kw={"height_ratios": ratios}
    )
    axes = list(grid[:, 0])
    label_axes = []
    for run, k, names in zip(runs, knob_rows, names_of):
        ax, knob_axes = axes[0], axes[1 : 1 + k]
        del axes[: 1 + k]
        its = [i for i in run["iterations"] if "cache" in i]
        if not its:
            ax.set_title(run["label"], fontsize=9, loc="left")
            _absent(
                ax,
                "no engine telemetry in this run (stock DeepSpeed): it keeps no state in memory across steps;\n"
                "with NVMe offload (ZeRO-Infinity) every subgroup is swapped in and out at every step",
            )
            ax.set_xticks([])
            continue
        x = [i["iteration"] for i in its]
        hits = [i["cache"]["hits"] for i in its]
        misses = [i["cache"]["misses"] for i in its]
        ax.bar(x, hits, color="#59a14f", label="kept in memory (hits)")
        ax.bar(x, misses, bottom=hits, color="#e15759", label="read from storage (misses)")
        ax.set_ylabel("swapped subgroups", fontsize=8)
        series = run.get("knob_series") or {}
        if names:
            ax.set_title(f"{run['label']}: cache hits, and the knobs that changed", fontsize=9, loc="left")
        else:
            knobs = its[-1].get("knobs") or {}
            ax.set_title(
                f"{run['label']}: cache hits; knobs unchanged: "
                + ", ".join(f"{n} {_short(v)}" for n, v in knobs.items() if v not in ({}, None)),
                fontsize=9,
                loc="left",
            )
        handles, labels = ax.get_legend_handles_labels()
        if len(names) == 1:
            twin = ax.twinx()
            _knob_axes(twin, series["iteration"], series[names[0]], names[0], twin=True)
            h2, l2 = twin.get_legend_handles_labels()
            handles, labels = handles + h2, labels + l2
        for kax, name in zip(knob_axes, names):
            _knob_axes(kax, series["iteration"], series[name], name)
        ax.legend(handles, labels, fontsize=7, loc="upper left", bbox_to_anchor=(1.06, 1.0))
        for a_ in [ax, *knob_axes]:
            a_.xaxis.set_major_locator(MaxNLocator(integer=True))
            a_.set_xlim(min(x) - 0.6, max(x) + 0.6)
            a_.tick_params(labelsize=7)
            for ch in run["knob_changes"]:
                a_.axvline(ch["iteration"] - 0.5, **dict(_change_style(ch), ls="-" if ch.get("by") == "you" else ":"))
        (knob_axes[-1] if knob_axes else ax).set_xlabel("iteration", fontsize=8)
        label_axes.append((ax, run, max(h + m for h, m in zip(hits, misses))))
    fig.tight_layout()
    # Labels last, once the layout is fixed: their placement measures them on the final axes.
    for ax, run, top in label_axes:
        ax.set_ylim(0, top * 1.05)
        _headroom(
            ax, top * 1.05, place_labels(ax, [(ch["iteration"] - 0.45, _change_reason(ch)[:80]) for ch in run["knob_changes"]])
        )
    return fig


def _change_reason(ch: dict) -> str:
    """A knob change's label in the cache figure: the reason the daemon gave, said as the
    user's ('you: prefetch_depth pinned to 4') where it was the user's."""
    reason = ch.get("reason") or _knob_change_text(ch)
    if ch.get("by") == "you":
        return "you: " + reason.replace(" by the user", "")
    return reason


def _knob_axes(ax, x, values, name: str, twin: bool = False) -> None:
    """One knob's values per iteration as a step line, its name beside it."""
    ys = [float("nan") if v is None else float(v) for v in values]
    ax.step(x, ys, where="mid", color="black", lw=1.2, label=_knob_name(name))
    if twin:
        ax.set_ylabel(_knob_name(name), fontsize=8)
    else:
        ax.set_ylabel(_knob_name(name), fontsize=8, rotation=0, ha="right", va="center")
    lo, hi = min(y for y in ys if y == y), max(y for y in ys if y == y)
    pad = (hi - lo) * 0.15 or 0.5
    ax.set_ylim(lo - pad, hi + pad * 2.5)
    if all(float(v).is_integer() for v in ys if v == v):
        ax.yaxis.set_major_locator(MaxNLocator(integer=True, nbins=3))
    ax.tick_params(labelsize=7)


# -- comparison ----------------------------------------------------------------------------------


def compare(runs: list[dict], comparison: list[dict] | None = None):
    fig, ax = plt.subplots(figsize=(WIDTH_IN, 1.2 + 0.9 * len(runs) + 1.0))
    labels = [r["label"] for r in runs]
    for y, run in enumerate(runs):
        left = 0.0
        for k in SEGMENTS:
            v = max(0.0, run["summary"]["median_segments_s"][k] or 0.0)
            ax.barh(y, v, left=left, color=COLORS[k], height=0.6)
            left += v
        s = run["summary"]
        speed = s.get("speedup_vs_first")
        bpp = s.get("engine_bytes_per_param_total", s.get("disk_bytes_per_param_total"))
        text = f"  {_ms_or_s(s['median_iter_s'])}"
        text += "  (baseline)" if y == 0 else f"  {speed:.2f}\u00d7 the baseline's speed"
        upd = next((c["phases"]["update"]["ratio"] for c in comparison or [] if c["run"] == run["label"]), None)
        if upd:
            text += f", the update {upd:.2f}\u00d7"
        if bpp:
            text += f",  {bpp:.1f} B/param"
        ax.text(left, y, text, va="center", fontsize=8)
    ax.set_yticks(range(len(runs)), labels, fontsize=8)
    ax.invert_yaxis()
    ax.set_xlabel("the median iteration's time (s), by segment")
    ax.margins(x=0.35)
    ax.set_xlim(left=0)
    _segment_legend(fig)
    fig.tight_layout(rect=(0, 0, 1, 1 - 0.5 / fig.get_figheight()))
    return fig
