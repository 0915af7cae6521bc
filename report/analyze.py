"""The numbers behind every plot of ``offloadctl report``: pure functions of the records.

An iteration runs from the end of the previous optimizer step (for the first, from its first
recorded call) to the end of its own, split into the **segments** of :data:`SEGMENTS`: forward,
backward, the update's parts (from the engine's StepRecord, or stock ZeRO-3's per-subgroup
spans; ``update_other`` is the rest of the step span), and ``outside`` (the training loop's own
time between DeepSpeed calls). The segments add up to the iteration exactly, by construction;
``measured_share`` says how much of it the recorded spans cover.

Bytes per parameter, the engine's own counts per tier kind (``engine_bytes``) and the kernel's
node-wide per-device counters per phase (``disk_bytes``, divided by the parameters of the node's
ranks), are means over the steady iterations, so that the phases add up to the iteration's
total (the engine's alternating order moves 8 B/param one way and 6 the other on alternate
steps: medians taken apart would not add up). The device counters count every process on the
device: the rank's own storage bytes per phase (``run_disk_bytes``, /proc/self/io, divided by
the rank's parameters) are the run's, and what the devices moved beyond them is other
processes' (``other_disk_bytes``): the report and the bottleneck sentence never count those as the run's.

:func:`shares` and :func:`bottleneck` say where the time went in words, for the report and
``offloadctl train``'s end-of-run summary. docs/report.md ("Reading the report") says what each
figure shows. Times are seconds, bytes are bytes.
"""

from __future__ import annotations

import statistics

from engine.config import KnobKey, Knobs
from engine.errors import ConfigError
from engine.layout import STATE_BYTES_PER_ELEMENT
from engine.telemetry import StepRecord
from report.compare import compare_runs, limit, rolling_median, rolling_window, run_facts
from report.load import Run
from tuner.knob_text import flat_knobs

SEGMENTS = (
    "forward",
    "backward",
    "read_wait",
    "host_lane",
    "device_lane",
    "write_wait",
    "device_wait",
    "update_other",
    "outside",
)
UPDATE_PARTS = ("read_wait", "host_lane", "device_lane", "write_wait", "device_wait", "update_other")
PHASES = ("forward", "backward", "update", "outside")
SEGMENT_LABELS = {
    "forward": "forward",
    "backward": "backward",
    "read_wait": "update: waiting for reads",
    "host_lane": "update: host lane (CPU Adam)",
    "device_lane": "update: device lane (queueing)",
    "write_wait": "update: waiting for writes",
    "device_wait": "update: waiting for the device",
    "update_other": "update: other (norm, clip, bookkeeping)",
    "outside": "outside DeepSpeed (the script)",
}


SHARE_GROUPS = (
    ("forward", ("forward",)),
    ("backward", ("backward",)),
    ("update: read waits", ("read_wait",)),
    ("update: AdamW", ("host_lane", "device_lane")),
    ("update: write waits", ("write_wait",)),
    ("update: other", ("device_wait", "update_other")),
    ("outside DeepSpeed", ("outside",)),
)
"""How an iteration's segments are told in shares: the update's parts in what they wait on."""


def engine_segments(step: StepRecord, update_s: float) -> dict[str, float]:
    """The update's segments (:data:`UPDATE_PARTS`) of one engine step whose update took
    ``update_s`` (the recorder's span of DeepSpeed's step, or, from the telemetry alone, the
    engine's update and its setup): the parts the engine timed, the device lane's queueing
    apart from the host lane's AdamW, and the rest ``update_other``. The report and the
    end-of-run summary both split a step by it."""
    parts = {
        "read_wait": step.read_wait_s,
        "host_lane": step.host_lane_s,
        "device_lane": max(0.0, step.kernel_s - step.host_lane_s),
        "write_wait": step.write_wait_s,
        "device_wait": step.device_wait_s,
    }
    parts["update_other"] = update_s - sum(parts.values())
    return parts


def shares(segments: dict, iter_s: float) -> list[tuple[str, float]]:
    """[(group, share of the iteration)] in :data:`SHARE_GROUPS` order; missing segments count 0."""
    if not iter_s or iter_s <= 0:
        return []
    return [(name, max(0.0, sum(segments.get(k) or 0.0 for k in keys)) / iter_s) for name, keys in SHARE_GROUPS]


def bottleneck(segments: dict, iter_s: float, storage: str, shared: tuple[float, float] | None = None) -> str:
    """The bottleneck in one sentence, from an iteration's segments; ``storage`` names where the
    update's state is read from and written to ('nvme', 'nvme+remote', 'host memory').
    ``shared``: (the run's own, other processes') disk bytes per parameter on those devices:
    where others' are a sizeable part and the update waits on the device, the sentence says so,
    so that the run is not taken to have caused their traffic."""
    sh = dict(shares(segments, iter_s))
    if not sh:
        return "no iteration time recorded"
    update = sum(v for k, v in sh.items() if k.startswith("update"))
    pct = lambda x: f"{100 * x:.0f}%"  # noqa: E731
    top = max(("update: read waits", "update: AdamW", "update: write waits", "update: other"), key=lambda k: sh[k])
    compute = sh["forward"] + sh["backward"]
    if sh["outside DeepSpeed"] > max(compute, update):
        return (
            f"the script's own work between DeepSpeed calls (data loading, logging) takes "
            f"{pct(sh['outside DeepSpeed'])} of the iteration"
        )
    others = ""
    if shared is not None and shared[1] >= max(0.5, 0.25 * shared[0]):
        others = (
            f", a device other processes used as well (theirs {shared[1]:.1f} B/param an iteration, the run's {shared[0]:.1f})"
        )
    if update > compute and sh[top] >= 0.1:
        what = {
            "update: read waits": f"the update waits on reads from {storage}",
            "update: AdamW": "the update is bound by AdamW's compute",
            "update: write waits": f"the update waits on writes to {storage}",
            "update: other": "the update's bookkeeping (gradient norm, clipping, partitioning)",
        }[top]
        return f"{what}: {pct(sh[top])} of the iteration" + (others if "waits on" in what else "")
    waits = sh["update: read waits"] + sh["update: write waits"]
    return f"forward and backward (the model's compute) take {pct(compute)} of the iteration; the update {pct(update)}" + (
        f", of it {pct(waits)} waiting on {storage}{others}" if waits >= 0.01 else ""
    )


def storage_name(run: dict) -> str:
    """Where a run's optimizer state lives, for :func:`bottleneck`: its tiers' kinds, else the offload device."""
    kinds = list(dict.fromkeys(t["kind"] for t in run.get("tiers") or []))
    if kinds:
        return "+".join(kinds)
    dev = str((run.get("offload_optimizer") or {}).get("device") or "")
    return "host memory" if dev.endswith("cpu") else dev or "memory"


def analyze(runs: list[Run], iteration: int | None = None) -> dict:
    """Every run's numbers, and, for more than one, their comparison against the first
    (:func:`compare_runs`)."""
    out = [analyze_run(r, iteration) for r in runs]
    base = out[0]["summary"]["median_iter_s"]
    for a in out:
        med = a["summary"]["median_iter_s"]
        a["summary"]["speedup_vs_first"] = base / med if med and len(out) > 1 else None
    result = {"version": 2, "baseline": out[0]["label"], "runs": out}
    if len(out) > 1:
        result["comparison"] = [compare_runs(out[0], a) for a in out[1:]]
    return result


def analyze_run(run: Run, iteration: int | None = None) -> dict:
    rec = run.record
    init = rec.init
    tiers = _tiers(init)
    iters = [_iteration(run, it, prev, tiers) for prev, it in zip([None, *rec.iterations[:-1]], rec.iterations)]
    steady = [i for i in iters if i["iteration"] > 0 and not i["skipped"]] or iters
    median = _median_iteration(steady)
    chosen = _choose(iters, iteration, run) if iteration is not None else median
    summary = _summary(steady, iters, median, any(t["device"] for t in tiers))
    off = init.get("offload_optimizer") or {}
    if run.engine == "stock" and str(off.get("device", "")).endswith("nvme") and summary["disk_bytes_per_param_total"]:
        # ZeRO-Infinity swaps every subgroup's Adam state in and out at every step (12 B/param of
        # fp32 master, exp_avg, exp_avg_sq each way); what its tier moves beyond that is its fp32
        # gradients, written out (in backward, and flushed at the update's first swap-in) and read back.
        summary["gradient_round_trip_bytes_per_param"] = {
            d: max(
                0.0,
                _median(sum(rw[d] for ph in i["disk_bytes_per_param"].values() for rw in ph.values()) for i in steady)
                - STATE_BYTES_PER_ELEMENT,
            )
            for d in ("read", "written")
        }
    world = int(rec.header.get("world_size") or 1)
    summary["world_size"] = world
    summary.update(_throughput(steady, iters, summary["median_iter_s"], world))
    med_seg = summary["median_segments_s"]
    window = rolling_window(len(iters))
    result = {
        "label": run.label,
        "path": run.path,
        "engine": run.engine,
        "status": run.status,
        "status_kind": run.status_kind,
        "stopped_at": run.stopped_at,
        "rank": rec.rank,
        "ranks": run.ranks,
        "notes": list(rec.notes),
        "params_total": init.get("params_total"),
        "params_rank": init.get("params_rank"),
        "local_world_size": init.get("local_world_size", 1),
        "zero_stage": init.get("zero_stage"),
        "offload_optimizer": init.get("offload_optimizer"),
        "offload_param": init.get("offload_param"),
        "device": init.get("device"),
        "tiers": tiers,
        "argv": init.get("argv"),
        "script": rec.header.get("script"),
        "iterations": iters,
        "summary": summary,
        "knob_changes": _knob_changes(iters),
        "timeline": _timeline(run, chosen, tiers),
        "recorder": _recorder_cost(rec, iters),
        "knob_series": _knob_series(iters),
        "facts": run_facts(run),
        "loss_recorded": any(i.get("loss") is not None for i in iters),
        "rolling_median_iter_s": {"window": window, "values": rolling_median([i["iter_s"] for i in iters], window)},
    }
    summary["host_memory"] = host_memory_summary(
        [(i["iteration"], it["engine"]) for i, it in zip(iters, rec.iterations) if it.get("engine") is not None]
    )
    plan = init.get("engine_plan") or {}
    summary["fixed_knobs"] = (
        dict(plan["pins"])
        if "pins" in plan  # an earlier version's record names them only
        else pin_values(plan.get("fixed_knobs") or (), plan.get("knobs") or {})
    )
    summary["shares"] = shares(med_seg, summary["median_iter_s"])
    shared = (
        (summary["run_disk_bytes_per_param_total"], summary["other_disk_bytes_per_param_total"])
        if "other_disk_bytes_per_param_total" in summary
        else None
    )
    summary["verdict"] = bottleneck(med_seg, summary["median_iter_s"], storage_name(result), shared)
    summary["limit"] = limit(summary, run.engine)
    return result


def _throughput(steady: list[dict], iters: list[dict], median_iter_s: float, world: int) -> dict:
    """Samples and tokens per iteration (this rank's forward inputs) and per second over all
    ranks (data parallel: every rank takes as many), and the iterations' total time."""
    samples = _median(i.get("samples") for i in steady)
    tokens = _median(i.get("tokens") for i in steady)
    return {
        "total_s": iters[-1]["t_end"] - iters[0]["t_start"],
        "samples_per_iteration": samples or None,
        "tokens_per_iteration": tokens or None,
        "samples_per_s": samples * world / median_iter_s if samples and median_iter_s else None,
        "tokens_per_s": tokens * world / median_iter_s if tokens and median_iter_s else None,
    }


# -- per iteration ---------------------------------------------------------------------------


def _tiers(init: dict) -> list[dict]:
    """Tier devices with a label each: 'nvme', 'remote', numbered when a kind repeats."""
    tiers = init.get("tiers") or []
    kinds = [t["kind"] for t in tiers]
    out = []
    for i, t in enumerate(tiers):
        n = kinds[: i + 1].count(t["kind"])
        label = t["kind"] if kinds.count(t["kind"]) == 1 else f"{t['kind']}{n - 1}"
        out.append({"label": label, "kind": t["kind"], "path": t["path"], "device": t.get("device")})
    return out


def _device_labels(tiers: list[dict]) -> dict[str, str]:
    labels: dict[str, list[str]] = {}
    for t in tiers:
        if t["device"]:
            labels.setdefault(t["device"], []).append(t["label"])
    return {d: "+".join(ls) + f" ({d})" for d, ls in labels.items()}


def _iteration(run: Run, it: dict, prev: dict | None, tiers: list[dict]) -> dict:
    spans = it.get("spans") or []
    sums = it.get("sums") or {}
    t_start = (
        prev["t_end"]
        if prev is not None
        else min((s[1] for s in spans), default=it["t_end"] - sum(sums.get(p, 0.0) for p in PHASES[:3]))
    )
    iter_s = max(it["t_end"] - t_start, 1e-9)
    phases = {p: sums.get(p, 0.0) for p in PHASES[:3]}
    measured = sum(phases.values())
    phases["outside"] = iter_s - measured
    eng: StepRecord | None = it.get("engine")
    if eng is not None:
        parts = engine_segments(eng, phases["update"])
    else:  # stock ZeRO-3: its per-subgroup spans
        parts = dict.fromkeys(UPDATE_PARTS, 0.0)
        for k in ("read_wait", "host_lane", "write_wait"):
            parts[k] = sums.get(k, 0.0)
        parts["update_other"] = phases["update"] - sum(v for k, v in parts.items() if k != "update_other")
    segments = {"forward": phases["forward"], "backward": phases["backward"], **parts, "outside": phases["outside"]}
    out = {
        "iteration": it["iteration"],
        "t_start": t_start,
        "t_end": it["t_end"],
        "iter_s": iter_s,
        "phases": phases,
        "segments": segments,
        "measured_share": measured / iter_s,
        "skipped": bool(it.get("skipped")),
        "failed": bool(it.get("failed")),
        "disk_bytes": _disk_bytes(it.get("io") or {}, tiers),
        "disk_bytes_update_parts": {
            k: v for k, v in _disk_bytes(it.get("io") or {}, tiers, parts=True).items() if k.startswith("update")
        }
        if any("." in k for k in it.get("io") or {})
        else None,
        "recorder_s": it.get("recorder_s", 0.0),
        "samples": it.get("samples"),
        "tokens": it.get("tokens"),
        "loss": it.get("loss"),
    }
    params_node = (run.record.init.get("params_rank") or 0) * (run.record.init.get("local_world_size") or 1)
    per_param = lambda db: (
        {
            ph: {t: {k: v / params_node for k, v in rw.items()} for t, rw in d.items()}  # noqa: E731
            for ph, d in db.items()
        }
        if params_node
        else {}
    )
    out["disk_bytes_per_param"] = per_param(out["disk_bytes"])
    if out["disk_bytes_update_parts"]:
        out["disk_bytes_per_param_update_parts"] = per_param(out["disk_bytes_update_parts"])
    params_rank = run.record.init.get("params_rank") or 0
    if it.get("io_self") is not None and params_rank and _device_labels(tiers):
        out.update(_run_and_others(it["io_self"], out["disk_bytes_per_param"], params_rank))
    if eng is not None:
        kinds = sorted(set(eng.bytes_read) | set(eng.bytes_written))
        engine_bytes = {k: {"read": eng.bytes_read.get(k, 0), "written": eng.bytes_written.get(k, 0)} for k in kinds}
        p = eng.params
        out.update(
            engine_bytes=engine_bytes,
            engine_bytes_per_param={k: {d: v / p for d, v in rw.items()} for k, rw in engine_bytes.items()} if p else {},
            engine_iteration=eng.iteration,
            cache={"hits": eng.cache_hits, "misses": eng.cache_misses},
            lanes={
                "host": eng.host_lane_subgroups,
                "device": eng.device_lane_subgroups,
                "device_tier": eng.device_tier_subgroups,
            },
            knobs=eng.knobs.to_dict() if eng.knobs else {},
            host_bytes=eng.host_bytes.to_dict() if eng.host_bytes else {},
            host_budget_bytes=eng.host_budget_bytes,
            host_pressure=eng.host_pressure,
            engine_start_s=eng.start_s,
            engine_update_s=eng.update_s,
        )
        if it.get("tuner"):
            out["tuner"] = it["tuner"]
    return out


def _run_and_others(io_self: dict, disk_per_param: dict, params_rank: int) -> dict:
    """Per phase, the rank's own storage bytes per parameter (``io_self``: this process's, by
    the same phase edges as the device counters) and the tier devices' bytes beyond them: other
    processes' (never below 0; the rank's own bytes on other devices, its dataset's say, do not
    make others' negative)."""
    run: dict = {}
    for key, (r, w) in io_self.items():
        ph = key.split(".")[0]
        if ph in PHASES:
            d = run.setdefault(ph, {"read": 0.0, "written": 0.0})
            d["read"] += r / params_rank
            d["written"] += w / params_rank
    others = {}
    for ph, tiers in disk_per_param.items():
        device = {d: sum(rw.get(d, 0.0) for rw in tiers.values()) for d in ("read", "written")}
        others[ph] = {d: max(0.0, device[d] - run.get(ph, {}).get(d, 0.0)) for d in ("read", "written")}
    return {"run_disk_bytes_per_param": run, "other_disk_bytes_per_param": others}


def _disk_bytes(io: dict, tiers: list[dict], parts: bool = False) -> dict:
    """{phase: {tier label: {"read": bytes, "written": bytes}}} from the per-device counters;
    the update's parts (stock ZeRO-3: ``update.read_wait`` ...) count in ``update``, or, with
    ``parts``, on their own (``update`` then holds the rest of the step)."""
    labels = _device_labels(tiers)
    out: dict = {}
    for key, per_dev in io.items():
        phase = key if parts else key.split(".")[0]
        if not parts and phase not in PHASES:
            continue
        for dev, (r, w) in per_dev.items():
            lab = labels.get(dev, dev)
            d = out.setdefault(phase, {}).setdefault(lab, {"read": 0, "written": 0})
            d["read"] += r
            d["written"] += w
    return out


# -- across iterations -----------------------------------------------------------------------


def _choose(iters: list[dict], iteration: int, run: Run) -> dict:
    for i in iters:
        if i["iteration"] == iteration:
            return i
    raise ConfigError(
        f"{run.path} recorded iterations {iters[0]['iteration']}..{iters[-1]['iteration']}: "
        f"--iteration {iteration} is not among them"
    )


def _median_iteration(steady: list[dict]) -> dict:
    """The steady iteration of median time (the lower one of an even count): the run's
    representative, whose breakdown adds up to its time (medians of parts would not)."""
    ordered = sorted(steady, key=lambda i: i["iter_s"])
    return ordered[(len(ordered) - 1) // 2]


def _median(xs):
    xs = [x for x in xs if x is not None]
    return statistics.median(xs) if xs else None


def _mean(xs):
    xs = [x for x in xs if x is not None]
    return statistics.fmean(xs) if xs else None


def _tier_means(steady: list[dict], key: str) -> dict:
    """The iterations' ``key`` ({phase: {tier: {"read", "written"}}} bytes/param), the mean over
    the steady iterations (absent counts as 0)."""
    keys = {(ph, t) for i in steady for ph, d in (i.get(key) or {}).items() for t in d}
    out: dict = {}
    for ph, t in sorted(keys):
        out.setdefault(ph, {})[t] = {
            d: _mean((i.get(key) or {}).get(ph, {}).get(t, {}).get(d, 0.0) for i in steady) for d in ("read", "written")
        }
    return out


def _summary(steady: list[dict], iters: list[dict], median: dict, has_devices: bool) -> dict:
    s = {
        "iterations": len(iters),
        "steady_iterations": [i["iteration"] for i in steady],
        "median_iteration": median["iteration"],
        "median_iter_s": median["iter_s"],
        "median_segments_s": dict(median["segments"]),
        "median_phases_s": dict(median["phases"]),
        "mean_iter_s": statistics.fmean(i["iter_s"] for i in steady),
        "median_measured_share": _median(i["measured_share"] for i in steady),
    }
    s["disk_bytes_per_param"] = disk = _tier_means(steady, "disk_bytes_per_param")
    if any(i.get("disk_bytes_per_param_update_parts") for i in steady):
        # The update's bytes by part (stock ZeRO-3): where in the step the gradients' round trip falls.
        s["disk_bytes_per_param_update_parts"] = _tier_means(steady, "disk_bytes_per_param_update_parts")
    s["disk_bytes_per_param_total"] = (
        sum(v for d in disk.values() for rw in d.values() for v in rw.values()) if has_devices else None
    )
    if has_devices and any("run_disk_bytes_per_param" in i for i in steady):
        # The run's own and other processes', per phase (means, as above), and over the iteration:
        # others' total is what the devices moved beyond the run's, direction by direction, so that
        # the run's bytes counted a phase later by the device never show as another's.
        for key in ("run_disk_bytes_per_param", "other_disk_bytes_per_param"):
            s[key] = {
                ph: {d: _mean((i.get(key) or {}).get(ph, {}).get(d, 0.0) for i in steady) for d in ("read", "written")}
                for ph in PHASES
            }
        device = {d: sum(rw[d] for ph in disk.values() for rw in ph.values()) for d in ("read", "written")}
        run = {d: sum(rw[d] for rw in s["run_disk_bytes_per_param"].values()) for d in ("read", "written")}
        s["run_disk_bytes_per_param_total"] = sum(run.values())
        s["other_disk_bytes_per_param_total"] = sum(max(0.0, device[d] - run[d]) for d in ("read", "written"))
    if any("engine_bytes_per_param" in i for i in steady):
        kinds = sorted({k for i in steady for k in i.get("engine_bytes_per_param", {})})
        s["engine_bytes_per_param"] = {
            k: {d: _mean(i.get("engine_bytes_per_param", {}).get(k, {}).get(d, 0.0) for i in steady) for d in ("read", "written")}
            for k in kinds
        }
        s["engine_bytes_per_param_total"] = sum(v for rw in s["engine_bytes_per_param"].values() for v in rw.values())
        s["median_cache_hits"] = _median(i["cache"]["hits"] for i in steady if "cache" in i)
        s["swapped_subgroups"] = _median(i["cache"]["hits"] + i["cache"]["misses"] for i in steady if "cache" in i)
    return s


def host_memory_summary(steps: list[tuple[int, StepRecord]]) -> dict | None:
    """The engine's host memory over a run, from (iteration, its step record): the step that
    held the most, by kind, against the budget; None when no record says."""
    held = [(i, r, r.host_bytes) for i, r in steps if r.host_bytes is not None]
    if not held:
        return None
    peak_iteration, peak, usage = max(held, key=lambda irh: irh[2].total)
    return {
        "budget_bytes": peak.host_budget_bytes or 0,
        "peak_bytes": usage.total,
        "peak_iteration": peak_iteration,
        "by_kind": usage.to_dict(),
        "pressure_iterations": sum(bool(r.host_pressure) for _, r, _ in held),
    }


def pin_values(pins, knobs: dict) -> dict:
    """{knob: value} of the run's options' pins (:class:`KnobKey` text) that an earlier version's
    record names only, read from the knobs in force as the tuner reads them."""
    in_force = Knobs.from_dict(knobs) if knobs else Knobs()
    out = {}
    for text in pins:
        try:
            out[text] = KnobKey.parse(text).value_in(in_force)
        except ConfigError:  # a record from another version: shown as it is
            out[text] = "?"
    return out


def _knob_series(iters: list[dict]) -> dict[str, list]:
    """{knob: [value per iteration with engine telemetry]} of every knob that changes during the
    run (:func:`tuner.knob_text.flat_knobs` names), with ``iteration`` the x values; empty when none changes."""
    its = [i for i in iters if i.get("knobs") is not None]
    flat = [flat_knobs(i["knobs"]) for i in its]
    names = sorted({n for f in flat for n in f})
    changing = [n for n in names if len({repr(f.get(n)) for f in flat}) > 1]
    if not changing:
        return {}
    return {"iteration": [i["iteration"] for i in its], **{n: [f.get(n) for f in flat] for n in changing}}


def _knob_changes(iters: list[dict]) -> list[dict]:
    out, prev = [], None
    for i in iters:
        k = i.get("knobs")
        if k is None:
            continue
        k = flat_knobs(k)
        if prev is not None and k != prev:
            changed = {n: [prev.get(n), k.get(n)] for n in sorted(set(k) | set(prev)) if k.get(n) != prev.get(n)}
            reason = (i.get("tuner") or {}).get("reason")
            out.append(
                {
                    "iteration": i["iteration"],
                    "engine_iteration": i.get("engine_iteration"),
                    "changed": changed,
                    "reason": reason,
                    "by": changed_by(i.get("tuner")),
                }
            )
        prev = k
    return out


USER_WORDS = ("by the user", "the user's")
"""How the daemon's reasons say a change was the user's (a pin, an unpin, a freeze)."""


def changed_by(tuner: dict | None) -> str:
    """Who made a knob change, from the reason the ranks received with it: 'you' (a pin, unpin
    or freeze: ``offloadctl tune``), 'the tuner', or 'unknown' (no change of the daemon's seen)."""
    reason = (tuner or {}).get("reason") or ""
    if any(w in reason for w in USER_WORDS):
        return "you"
    if not tuner or tuner.get("seq") is None:
        return "unknown"
    return "the tuner"


def _recorder_cost(rec, iters: list[dict]) -> dict:
    end = rec.end or {}
    total_s = sum(i["iter_s"] for i in iters)
    hooks = sum(i["recorder_s"] for i in iters)
    busy = end.get("sampler_busy_s")
    return {
        "hooks_s": hooks,
        "hooks_share": hooks / total_s if total_s else None,
        "sampler_rows": end.get("sampler_rows", len(rec.samples)),
        "sampler_busy_s": busy,
        "sampler_hz": (rec.samples_header or {}).get("hz"),
    }


# -- the chosen iteration on a time axis ------------------------------------------------------


def _timeline(run: Run, it: dict, tiers: list[dict]) -> dict:
    rec = run.record
    raw = next(r for r in rec.iterations if r["iteration"] == it["iteration"])
    t0, t1 = it["t_start"], it["t_end"]
    spans = [[s[0], s[1] - t0, s[2] - t0] for s in raw.get("spans") or []]
    phase_spans = [s for s in spans if s[0] in PHASES]
    update_spans = [s for s in spans if s[0] in UPDATE_PARTS]
    if "engine_start_s" in it and it["engine_start_s"] is not None:
        # The engine's step on the same clock: the wait for the writes behind the last step, its
        # loop, then the device wait.
        start = it["engine_start_s"] - t0
        wait_s = it["segments"]["write_wait"]
        loop_s = it["engine_update_s"] - wait_s - it["segments"]["device_wait"]
        update_spans = [
            ["write_wait", start, start + wait_s],
            ["update_loop", start + wait_s, start + wait_s + loop_s],
            ["device_wait", start + wait_s + loop_s, start + it["engine_update_s"]],
        ]
    out = {
        "iteration": it["iteration"],
        "iter_s": it["iter_s"],
        "phase_spans": phase_spans,
        "update_spans": update_spans,
        "series": {},
        "missing": [],
    }
    header = rec.samples_header
    if not header or not rec.samples:
        out["missing"].append("no sampled series in this run (--record-hz 0, or the samples file is missing)")
        return out
    cols = {c: k for k, c in enumerate(header["columns"])}
    pad = max(0.03 * it["iter_s"], 2.0 / (header.get("hz") or 20))
    rows = rec.samples
    lo = next((k for k, r in enumerate(rows) if r[0] >= t0 - pad), len(rows))
    hi = next((k for k, r in enumerate(rows) if r[0] > t1 + pad), len(rows))
    window = rows[max(0, lo - 1) : hi]  # one row before, for the first rate
    if len(window) < 2:
        out["missing"].append(
            "fewer than two samples fell within this iteration (a faster iteration than the sampling interval: raise --record-hz)"
        )
    t = [r[0] - t0 for r in window]
    series = out["series"]
    series["t"] = t
    for name in (
        "rss_bytes",
        "cpu_percent",
        "gpu_allocated_bytes",
        "gpu_reserved_bytes",
        "nvml_used_bytes",
        "pcie_tx_bytes_per_s",
        "pcie_rx_bytes_per_s",
    ):
        if name in cols:
            series[name] = [r[cols[name]] for r in window]
    if "gpu_allocated_bytes" not in cols:
        out["missing"].append("GPU memory: not recorded (no CUDA device in this run)")
    if "pcie_tx_bytes_per_s" not in cols:
        out["missing"].append("PCIe TX/RX: not recorded (no NVML: no NVIDIA driver or GPU in this run)")
    labels = _device_labels(tiers)
    tier_bw = {}
    # Each rate is over the sampling interval that ends at its sample (drawn as a step over that
    # interval): a rate averaged across samples on both sides would move an update's reads into
    # the backward before it.
    out["rate_window_s"] = 1.0 / (header.get("hz") or 20)
    for dev, lab in labels.items():
        rc, wc = cols.get(f"disk_read_bytes:{dev}"), cols.get(f"disk_write_bytes:{dev}")
        if rc is None or wc is None:
            continue
        tier_bw[lab] = {"read_bytes_per_s": _rates(window, rc), "write_bytes_per_s": _rates(window, wc)}
    series["tier_bytes_per_s"] = tier_bw
    if not tier_bw:
        out["missing"].append("tier bandwidth: no storage tier with a block device in this run")
    # GPU memory per phase (FlexScience'24: what the update phase leaves free).
    for name in ("gpu_reserved_bytes", "nvml_used_bytes"):
        if name in series:
            out.setdefault("gpu_peak_by_phase", {})[name] = {
                ph: max(
                    (
                        v
                        for tt, v in zip(t, series[name])
                        if v is not None and any(s[0] == ph and s[1] <= tt <= s[2] for s in phase_spans)
                    ),
                    default=None,
                )
                for ph in PHASES[:3]
            }
    return out


def _rates(rows: list[list], col: int) -> list[float | None]:
    """Rate of a cumulative counter over the sampling interval ending at each row (None for the
    first row, which has no interval before it)."""
    out: list[float | None] = [None] if rows else []
    for k in range(1, len(rows)):
        a, b = rows[k - 1], rows[k]
        if a[col] is None or b[col] is None or b[0] <= a[0]:
            out.append(None)
        else:
            out.append(max(0, b[col] - a[col]) / (b[0] - a[0]))
    return out
