"""The report's figures, drawn with matplotlib (Agg) from :func:`report.analyze.analyze`'s
numbers: one figure per section, every run in it side by side.

- ``breakdown``: each iteration's time, stacked by segment; knob changes marked.
- ``timeline``: one iteration per run on a time axis: phases, GPU memory, PCIe TX/RX, tier
  bandwidth, host RSS and CPU, with the phases shaded behind every series.
- ``bytes``: bytes per parameter per iteration, by phase, tier and direction.
- ``cache``: swapped subgroups found in memory (cache hits) or read, per iteration, and the
  knobs, with the tuner's changes marked.
- ``compare``: the median iteration of every run, stacked by segment, with its speed-up.
"""
from __future__ import annotations

import io

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
from matplotlib.patches import Patch  # noqa: E402

from report.analyze import PHASES, SEGMENT_LABELS, SEGMENTS  # noqa: E402

SECTIONS = ("breakdown", "timeline", "bytes", "cache", "compare")
COLORS = {"forward": "#4e79a7", "backward": "#f28e2b", "read_wait": "#e15759", "host_lane": "#59a14f",
          "device_lane": "#76b7b2", "write_wait": "#edc948", "device_wait": "#b07aa1", "update_other": "#9c755f",
          "outside": "#d3cfcc", "update": "#59a14f", "update_loop": "#8cd17d"}
WIDTH_IN = 11.0
DPI = 100
GB = 1e9


def figures(analysis: dict) -> dict[str, "plt.Figure"]:
    """One figure per section, in :data:`SECTIONS` order."""
    runs = analysis["runs"]
    return {"breakdown": breakdown(runs), "timeline": timeline(runs), "bytes": bytes_per_param(runs),
            "cache": cache_and_knobs(runs), "compare": compare(runs)}


def png_bytes(fig) -> bytes:
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=DPI)
    plt.close(fig)
    return buf.getvalue()


def _segment_legend(fig, keys=SEGMENTS, ncol=5) -> None:
    handles = [Patch(color=COLORS[k], label=SEGMENT_LABELS[k]) for k in keys]
    fig.legend(handles=handles, loc="upper center", ncol=ncol, fontsize=8, frameon=False)


def _ms_or_s(seconds: float) -> str:
    return f"{seconds * 1e3:.0f} ms" if seconds < 1 else f"{seconds:.2f} s"


# -- breakdown ---------------------------------------------------------------------------------

def breakdown(runs: list[dict]):
    n = len(runs)
    fig, axes = plt.subplots(n, 1, figsize=(WIDTH_IN, 1.0 + 2.4 * n), squeeze=False, sharey=True)
    for ax, run in zip(axes[:, 0], runs):
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
        top = max(bottom) if bottom else 1.0
        for ch in run["knob_changes"]:
            ax.axvline(ch["iteration"] - 0.5, color="black", ls="--", lw=1)
            ax.text(ch["iteration"] - 0.45, top * 0.98, _knob_change_text(ch), fontsize=7, va="top")
        s = run["summary"]
        ax.set_title(f"{run['label']}: median iteration {_ms_or_s(s['median_iter_s'])} "
                     f"({run['status']})", fontsize=9, loc="left")
        ax.set_ylabel("seconds")
        ax.set_xlim(min(x) - 0.6, max(x) + 0.6)
        ax.margins(y=0.08)
    axes[-1, 0].set_xlabel("iteration")
    _segment_legend(fig)
    fig.tight_layout(rect=(0, 0, 1, 1 - 0.45 / fig.get_figheight()))
    return fig


def _knob_change_text(ch: dict) -> str:
    parts = [f"{k}: {_short(a)} \u2192 {_short(b)}" for k, (a, b) in ch["changed"].items()]
    text = "; ".join(parts)
    return text if len(text) < 70 else text[:67] + "..."


def _short(v) -> str:
    if isinstance(v, float):
        return f"{v:.2f}"
    if isinstance(v, dict):
        return "{" + ", ".join(f"{_short(x)}" for x in v.values()) + "}"
    return str(v)


# -- timeline ----------------------------------------------------------------------------------

ROWS = ("phases", "gpu", "pcie", "tiers", "host")
ROW_TITLES = {"phases": "", "gpu": "GPU memory (GB)", "pcie": "PCIe (GB/s)", "tiers": "tier bandwidth (MB/s)",
              "host": "host RSS (GB)"}


def timeline(runs: list[dict]):
    n = len(runs)
    fig, axes = plt.subplots(len(ROWS), n, figsize=(WIDTH_IN, 8.5), squeeze=False, sharex="col",
                             gridspec_kw={"height_ratios": [0.7, 1, 1, 1.2, 1]})
    for c, run in enumerate(runs):
        tl = run["timeline"]
        col = axes[:, c]
        _gantt(col[0], tl)
        col[0].set_title(f"{run['label']}\niteration {tl['iteration']} ({_ms_or_s(tl['iter_s'])})", fontsize=9)
        s = tl["series"]
        t = s.get("t", [])
        _series(col[1], t, s, [("gpu_allocated_bytes", "torch allocated"), ("gpu_reserved_bytes", "torch reserved"),
                               ("nvml_used_bytes", "NVML used")], 1 / GB,
                   "GPU memory: not recorded\n(no CUDA device in this run)")
        _series(col[2], t, s, [("pcie_tx_bytes_per_s", "TX (GPU\u2192host)"), ("pcie_rx_bytes_per_s", "RX (host\u2192GPU)")],
                1 / GB, "PCIe TX/RX: not recorded\n(no NVML in this run)", steps=True)
        tiers = s.get("tier_bytes_per_s") or {}
        if tiers:
            for k, (lab, bw) in enumerate(tiers.items()):
                color = f"C{k}"
                col[3].plot(t, _scale(bw["read_bytes_per_s"], 1e-6), color=color, label=f"{lab} read")
                col[3].plot(t, _scale(bw["write_bytes_per_s"], 1e-6), color=color, ls="--", label=f"{lab} write")
            col[3].legend(fontsize=7, loc="upper left")
        else:
            _absent(col[3], "tier bandwidth: no storage tier\non a block device in this run")
        if "rss_bytes" in s:
            col[4].plot(t, _scale(s["rss_bytes"], 1 / GB), color="C0", label="RSS")
            col[4].set_ylim(bottom=0)
            twin = col[4].twinx()
            twin.plot(t, s.get("cpu_percent", []), color="C3", lw=0.8, label="CPU %")
            twin.set_ylim(bottom=0)
            twin.set_ylabel("CPU % (process)", fontsize=8, color="C3")
            twin.tick_params(labelsize=7)
        else:
            _absent(col[4], "host series: not recorded (--record-hz 0)")
        for ax in col[1:]:
            _shade(ax, tl["phase_spans"])
            ax.tick_params(labelsize=7)
        col[-1].set_xlabel("seconds from the iteration's start", fontsize=8)
        col[0].set_xlim(-0.02 * tl["iter_s"], 1.02 * tl["iter_s"])
    for r, name in enumerate(ROWS):
        if ROW_TITLES[name]:
            axes[r, 0].set_ylabel(ROW_TITLES[name], fontsize=8)
        if r:  # one scale per row, so that the runs compare at a glance
            drawn = [ax for ax in axes[r] if ax.lines]
            top = max((ax.get_ylim()[1] for ax in drawn), default=None)
            for ax in drawn:
                ax.set_ylim(0, top)
    handles = [Patch(color=COLORS[k], alpha=0.35, label=k) for k in PHASES[:3]]
    handles += [Patch(color=COLORS[k], label=SEGMENT_LABELS.get(k, "update loop (reads, lanes)"))
                for k in ("update_loop", "read_wait", "host_lane", "write_wait", "device_wait")]
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


# -- bytes per parameter -------------------------------------------------------------------------

def bytes_per_param(runs: list[dict]):
    n = len(runs)
    fig, axes = plt.subplots(1, n, figsize=(WIDTH_IN, 4.2), squeeze=False, sharey=True)
    tier_colors: dict[str, str] = {}
    for ax, run in zip(axes[0], runs):
        s = run["summary"]
        cats = list(PHASES)
        data = {ph: s["disk_bytes_per_param"].get(ph, {}) for ph in PHASES}
        if "engine_bytes_per_param" in s:
            cats.append("update\n(engine's count)")
            data["update\n(engine's count)"] = s["engine_bytes_per_param"]
        for k, cat in enumerate(cats):
            bottom = 0.0
            for tier, rw in sorted(data[cat].items()):
                base = tier.split(" ")[0]
                color = tier_colors.setdefault(base, f"C{len(tier_colors)}")
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
        total = s.get("disk_bytes_per_param_total")
        ax.set_title(f"{run['label']}\n{total:.1f} B/param per iteration on disk" if total is not None
                     else run["label"], fontsize=9)
        if not any(data[c] for c in cats):
            _absent(ax, "no storage tier on a block device:\nno bytes to count")
        trip = s.get("gradient_round_trip_bytes_per_param")
        if trip:
            ax.text(0.02, 0.97, f"beyond Adam's 12 B/param of state each way:\n{trip['written']:.1f} written, "
                    f"{trip['read']:.1f} read back: the fp32\ngradients' round trip through the tier",
                    transform=ax.transAxes, va="top", fontsize=8,
                    bbox={"facecolor": "white", "edgecolor": "#bbb", "boxstyle": "round"})
    axes[0, 0].set_ylabel("bytes/param per iteration")
    handles = [Patch(facecolor=c, label=t) for t, c in tier_colors.items()]
    handles += [Patch(facecolor="grey", label="read"), Patch(facecolor="grey", hatch="//", edgecolor="white",
                                                             label="written")]
    fig.legend(handles=handles, loc="upper center", ncol=len(handles), fontsize=8, frameon=False)
    fig.tight_layout(rect=(0, 0, 1, 1 - 0.35 / fig.get_figheight()))
    return fig


# -- cache hits and knobs ------------------------------------------------------------------------

def cache_and_knobs(runs: list[dict]):
    n = len(runs)
    fig, axes = plt.subplots(n, 1, figsize=(WIDTH_IN, 1.0 + 2.2 * n), squeeze=False)
    for ax, run in zip(axes[:, 0], runs):
        its = [i for i in run["iterations"] if "cache" in i]
        ax.set_title(run["label"], fontsize=9, loc="left")
        if not its:
            _absent(ax, "no engine telemetry in this run (stock DeepSpeed): it keeps no state in memory across steps;\n"
                        "with NVMe offload (ZeRO-Infinity) every subgroup is swapped in and out at every step")
            ax.set_xticks([])
            continue
        x = [i["iteration"] for i in its]
        hits = [i["cache"]["hits"] for i in its]
        misses = [i["cache"]["misses"] for i in its]
        ax.bar(x, hits, color="#59a14f", label="swapped subgroups kept in memory (hits)")
        ax.bar(x, misses, bottom=hits, color="#e15759", label="read from storage (misses)")
        ax.set_ylabel("subgroups")
        ax.set_xlabel("iteration", fontsize=8)
        twin = ax.twinx()
        twin.step(x, [i["knobs"].get("device_fraction", 0.0) for i in its], where="mid", color="black",
                  label="device_fraction")
        twin.step(x, [i["knobs"].get("prefetch_depth", 0) / 10 for i in its], where="mid", color="C4", ls="--",
                  label="prefetch_depth / 10")
        twin.set_ylim(-0.05, 1.05)
        twin.set_ylabel("knob value", fontsize=8)
        for ch in run["knob_changes"]:
            ax.axvline(ch["iteration"] - 0.5, color="black", ls=":", lw=1)
            ax.text(ch["iteration"] - 0.45, ax.get_ylim()[1] * 0.95, (ch.get("reason") or _knob_change_text(ch))[:80],
                    fontsize=7, va="top")
        h1, l1 = ax.get_legend_handles_labels()
        h2, l2 = twin.get_legend_handles_labels()
        ax.legend(h1 + h2, l1 + l2, fontsize=7, loc="upper left", bbox_to_anchor=(1.06, 1.0))
    fig.tight_layout()
    return fig


# -- comparison ----------------------------------------------------------------------------------

def compare(runs: list[dict]):
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
