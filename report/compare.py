"""How runs compare, for ``offloadctl report RUN_A RUN_B ...``: each run's facts (command,
options, tier layout, knobs at start, versions), phase by phase against the first run (with a
warning where phases the engine does not touch differ beyond the noise: the comparison is then
of the machine), what limits each run, and the rolling median of its iteration times. Pure
functions of what ``report.analyze`` reads from the records.
"""

from __future__ import annotations

import os
import statistics
import time

from engine.units import format_seconds, format_size
from report.load import Run

UNTOUCHED = ("forward", "backward")
"""The phases the engine does not touch: what differs there between two runs is the machine
(another load, another clock), not the optimizer-state engine."""
TOUCHED = ("update",)
"""The phase the engine runs: the optimizer step."""
MACHINE_DIFF = 0.10
"""A relative difference of an untouched phase's median below which two runs count as alike,
whatever the noise says (a long run's medians are precise enough to tell 2% apart)."""


def phase_stats(iters: list[dict], phase: str) -> dict:
    """A phase's median over ``iters`` and its noise: the spread of the iterations around it
    (1.4826 x the median absolute deviation, an outlier-proof standard deviation) and the
    median's own uncertainty (1.253 x that over the square root of the count)."""
    xs = [i["phases"].get(phase) or 0.0 for i in iters]
    med = statistics.median(xs) if xs else 0.0
    spread = 1.4826 * statistics.median(abs(x - med) for x in xs) if xs else 0.0
    return {"median_s": med, "spread_s": spread, "n": len(xs), "median_error_s": 1.253 * spread / max(1, len(xs)) ** 0.5}


def compare_runs(base: dict, run: dict) -> dict:
    """``run`` against ``base``: per phase, the medians over the steady iterations and their
    ratio (base over run: above 1, ``run`` is faster); ``machine``: the untouched phases
    (:data:`UNTOUCHED`) whose medians differ by more than :data:`MACHINE_DIFF` and more than
    three times their combined uncertainty, with the sentence that says so (None when none
    does); ``update_speedup``: the ratio on the phase the engine runs."""
    steady = lambda a: [i for i in a["iterations"] if i["iteration"] in set(a["summary"]["steady_iterations"])]  # noqa: E731
    sa, sb = steady(base), steady(run)
    phases = {}
    for ph in (*UNTOUCHED, *TOUCHED, "outside"):
        a, b = phase_stats(sa, ph), phase_stats(sb, ph)
        diff = b["median_s"] - a["median_s"]
        noise = 3 * (a["median_error_s"] ** 2 + b["median_error_s"] ** 2) ** 0.5
        rel = diff / a["median_s"] if a["median_s"] > 0 else None
        phases[ph] = {
            "base": a,
            "run": b,
            "ratio": a["median_s"] / b["median_s"] if b["median_s"] > 0 else None,
            "difference_s": diff,
            "relative": rel,
            "noise_s": noise,
            "beyond_noise": abs(diff) > noise and rel is not None and abs(rel) > MACHINE_DIFF,
        }
    differ = [ph for ph in UNTOUCHED if phases[ph]["beyond_noise"]]
    machine = None
    if differ:
        said = ", ".join(
            f"{ph} {format_seconds(phases[ph]['base']['median_s'])} vs "
            f"{format_seconds(phases[ph]['run']['median_s'])} ({100 * phases[ph]['relative']:+.0f}%, "
            f"noise \u00b1{format_seconds(max(phases[ph]['noise_s'], 1e-6))})"
            for ph in differ
        )
        machine = (
            f"{' and '.join(differ)}, which the engine does not touch, differ beyond the noise (medians "
            f"of each run's steady iterations): {said}. "
            f"The overall speed compares the machine's state as much as the engines: run both again on "
            f"an idle machine, or judge by the update alone"
        )
    return {
        "base": base["label"],
        "run": run["label"],
        "phases": phases,
        "machine_differs": differ,
        "machine": machine,
        "update_speedup": phases["update"]["ratio"],
        "speedup": run["summary"].get("speedup_vs_first"),
    }


NEXT_STEP = {
    "update: read waits": "fewer reads: more host cache (--host-cache SIZE, within --host-memory), a deeper "
    "prefetch (--prefetch-depth), or another fast path (--nvme PATH)",
    "update: write waits": "faster writes: another fast path (--nvme PATH) to stripe over, or more host cache "
    "(--host-cache SIZE) so that fewer subgroups go to storage",
    "update: AdamW": "more cores for each rank's host lane (fewer ranks per node, --bind-cores), or, on a GPU, "
    "the device lane (--device-fraction F)",
    "update: other": "the step's bookkeeping (gradient norm, clipping): a larger sub_group_size in the ds_config "
    "means fewer subgroups to walk",
    "compute": "the model's own compute: the optimizer is not what limits the run (a larger batch per step "
    "spreads the update over more samples)",
    "outside DeepSpeed": "the script's own work between DeepSpeed calls: more data-loader workers, less logging per step",
}


def limit(summary: dict, engine: str) -> dict:
    """What limits a run, in one sentence with the next step to try: the largest group of the
    median iteration's shares (the model's compute, each of the update's waits, the script);
    a stock run's next step is offloadctl's engine."""
    sh = dict(summary.get("shares") or [])
    if not sh:
        return {"what": "nothing recorded", "next": ""}
    groups = {
        "compute": sh.get("forward", 0) + sh.get("backward", 0),
        "outside DeepSpeed": sh.get("outside DeepSpeed", 0),
        **{k: v for k, v in sh.items() if k.startswith("update: ")},
    }
    top = max(groups, key=groups.__getitem__)
    words = {
        "compute": "forward and backward (the model's compute)",
        "outside DeepSpeed": "the script's own work",
        "update: read waits": "the update's waits on reads",
        "update: write waits": "the update's waits on writes",
        "update: AdamW": "the update's AdamW compute",
        "update: other": "the update's bookkeeping",
    }[top]
    nxt = NEXT_STEP[top]
    if engine == "stock" and top.startswith("update"):
        nxt = "offloadctl's engine: the same command without --engine stock"
    return {"what": f"{words}: {100 * groups[top]:.0f}% of the iteration", "group": top, "next": nxt}


def rolling_median(xs: list[float], window: int) -> list[float]:
    """The median of each value's window (centred, ``window`` wide, shorter at the ends)."""
    half = max(1, window) // 2
    return [statistics.median(xs[max(0, k - half) : k + half + 1]) for k in range(len(xs))]


def rolling_window(n: int) -> int:
    """The rolling median's width for ``n`` iterations: 5 to 51, odd, about a twentieth of the run."""
    return min(51, max(5, (n // 20) | 1))


def run_facts(run: Run) -> dict:
    """What a run was: the command that started it (its options apart), the script's arguments,
    the tier layout, the knobs at start, the versions, the date and host; None where the run's
    record does not say (recorded by an older offloadctl, or a rank not started from here)."""
    rec, init = run.record, run.record.init
    command = init.get("command")
    options = None
    script = rec.header.get("script")
    if command:
        names = [os.path.basename(a) for a in command]
        at = next(
            (k for k, a in enumerate(command) if script and (a == script or os.path.abspath(a) == os.path.abspath(script))), None
        )
        if at is None and script:
            at = next((k for k, n in enumerate(names) if n == os.path.basename(script)), None)
        options = command[1:at] if at is not None else None
    plan = init.get("engine_plan") or {}
    knobs = plan.get("knobs")
    if knobs is None:
        first = next((i["engine"] for i in rec.iterations if i.get("engine") is not None), None)
        knobs = None if first is None else first.knobs.to_dict() if first.knobs else {}
    t = rec.header.get("unix_time")
    args = [a for a in init.get("argv") or [] if not a.startswith("--local_rank=")]  # the launcher's, not the user's
    return {
        "command": command,
        "options": options,
        "script": script,
        "script_args": args,
        "layout": layout_text(init, plan),
        "knobs_at_start": knobs,
        "versions": init.get("versions"),
        "date": time.strftime("%Y-%m-%d %H:%M:%S %Z", time.localtime(t)) if t else None,
        "host": rec.header.get("host"),
        "world_size": rec.header.get("world_size"),
    }


def layout_text(init: dict, plan: dict) -> str:
    """Where the optimizer state lives, in words: '1.2 GB host, 3.4 GB on /nvme0 (nvme)'."""
    kinds = {t["path"]: t["kind"] for t in init.get("tiers") or []}
    by_tier = plan.get("state_bytes_by_tier") or {}
    if by_tier:
        parts = [
            f"{format_size(b)} {t}" if t in ("device", "host") else f"{format_size(b)} on {t} ({kinds.get(t, 'path')})"
            for t, b in by_tier.items()
            if b
        ]
        return ", ".join(parts) or "no state"
    off = init.get("offload_optimizer") or {}
    dev = str(off.get("device") or "")
    if dev.endswith("nvme"):
        return f"DeepSpeed's own: all on {off.get('nvme_path')} (nvme, ZeRO-Infinity)"
    if dev.endswith("cpu"):
        return "DeepSpeed's own: all in host memory (CPU offload)"
    return dev or "not recorded"
