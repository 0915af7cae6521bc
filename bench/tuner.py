"""Tuner benchmark: the policy drives a real engine's knobs (issue 5's acceptance, parts 1 and 2).

Part 1, from a poor plan. An engine of about 100M parameters, all optimizer state on one storage
path and no host cache, starts at concurrency 1 and prefetch depth 0; the policy tunes it online.
A second engine in the same process, stepped in alternation with the first so that both see the
same machine, measures a grid of static plans (1 settling + 3 measured steps each). Reported: the
first iteration at which the tuned run's update phase (median of a sliding window of 3) is within
10% of the best static plan's. Goal: iteration 30 at the latest.

Part 2, contention. State striped over two paths (NVMe-like and PFS-like). After --writer-at
iterations a background writer (fio, else dd, with O_DIRECT and 8 MiB blocks) starts writing on
the NVMe path; on an emulated tier it runs in the same blkio cgroup, so that it really takes a
share of the throttled bandwidth. It stops --writer-iters iterations later. A reference engine,
stepped in alternation, keeps the knobs the tuned run had when the writer started. Reported:
iterations until the tuner reacts, and until its update time settles (goal: 10), its update time
against the reference's while the writer runs, iterations to recover after it stops, and a plot
of update time per iteration with the writer window and the decisions.

Part 2 with ``--pin KNOB=VALUE`` (repeatable; VALUE read as JSON, KNOB a name of
``engine.config.Knobs.names()`` or ``io_concurrency[PATH]``): the tuned engine starts with those
values and they are fixed, as ``offloadctl train --prefetch-depth 2`` fixes them: in-process the
policy's ``pins``, through the daemon the engine's ``EngineConfig.pins`` in its
registration. The reference engine starts from the same knobs. Reported: the pins, and whether
every row of the tuned run kept them (``pins_held``).

    .venv/bin/python bench/tuner.py --emulate                 # root: nvme 400/400, pfs 200/200 MB/s
    .venv/bin/python bench/tuner.py --nvme DIR --remote DIR   # real paths (part 2 needs both)
    .venv/bin/python bench/tuner.py --emulate --params 3e7 --subgroup 3e6 --iters 30   # a smoke run
    .venv/bin/python bench/tuner.py --emulate --part 2 --pin prefetch_depth=2   # contention, the
                                                              # knobs that hide I/O fixed
    .venv/bin/python bench/tuner.py --emulate --daemon        # through `offloadctl tuner serve` and
                                                              # tuner.client.TunerClient
    .venv/bin/python bench/tuner.py --part 3 --params 2e9 --subgroup 1e8 --iters 100   # GPU: the device
                                                              # fraction from 0 against a static sweep

The emulated tiers come from bench/tiers.sh; OFFLOADCTL_TIERS_ROOT, _IMG and _CGROUP are honoured.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import math
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time

import torch
from rich.console import Console
from rich.markup import escape
from rich.progress import Progress
from rich.table import Table

BENCH = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(BENCH)
# This file's name would shadow the `tuner` package: the repository root, not bench/, goes first.
sys.path[:] = [ROOT] + [p for p in sys.path if os.path.abspath(p or ".") != BENCH]
from bench.emulate import run_emulated, tiers_root  # noqa: E402
from engine import AdamWHyper, EngineConfig, FlatSubgroup, Knobs, StoragePath, SubgroupEngine  # noqa: E402
from engine.buffers import payload_bytes  # noqa: E402
from engine.config import KnobKey  # noqa: E402
from engine.errors import ConfigError  # noqa: E402
from engine.layout import STATE_BYTES_PER_ELEMENT  # noqa: E402
from tuner.knob_text import Pins  # noqa: E402
from tuner.policy import Observation, Policy, PolicyConfig  # noqa: E402
from tuner.run_state import RunFacts  # noqa: E402
from tuner.sensors import Sensors  # noqa: E402

_spec = importlib.util.spec_from_file_location("update_phase", os.path.join(BENCH, "update_phase.py"))
update_phase = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(update_phase)

console = Console(stderr=True)
WINDOW = 3  # sliding median for "within 10%"
HYPERS = [AdamWHyper(lr=1e-4)]


# -- engines and how their knobs are driven ------------------------------------------------------


def build_engine(
    numel: int, sub: int, specs: tuple[StoragePath, ...], knobs: Knobs, backend: str, pins: dict | None = None
) -> SubgroupEngine:
    """A SubgroupEngine over ``numel`` parameters, every subgroup swapped (no host cache);
    ``pins`` (knob -> value) as the run's options would fix them (the engine reports them to a tuner)."""
    torch.manual_seed(0)
    # Host tensors on purpose: flat weights and gradients of an engine with no model on a device.
    weight = torch.randn(numel, device="cpu")
    grad = torch.randn(numel, device="cpu") * 1e-3
    bindings = [FlatSubgroup(weight[o : o + sub], grad[o : o + sub]) for o in range(0, numel, sub)]
    cfg = EngineConfig(subgroup_numel=sub, host_cache_bytes=0, io_backend=backend, host_adam="auto", paths=specs, pins=pins or {})
    return SubgroupEngine(bindings, cfg, knobs)


def _row(rec, decision: str | None, other: dict | None = None) -> dict:
    return {
        "iteration": rec.iteration,
        "update_s": rec.update_s,
        "read_wait_s": rec.read_wait_s,
        "write_wait_s": rec.write_wait_s,
        "knobs": rec.knobs.to_dict(),
        "decision": decision,
        "other_bytes_per_s": other or {},
    }


class InProcess:
    """The policy in this process: observe each step, hand decisions to the engine."""

    def __init__(self, engine: SubgroupEngine, paths: list[str], max_prefetch: int, fixed: dict | None = None) -> None:
        self.engine = engine
        self.paths = paths
        # What a registration would carry: the knobs the run fixed, and the spare host budget.
        facts = RunFacts(
            paths=tuple(paths),
            subgroup_bytes=max(payload_bytes(sg.numel) for sg in engine.subgroups),
            params=sum(sg.numel for sg in engine.subgroups),
            pins=fixed or {},
            host_staging_bytes=engine.describe().host_staging_bytes,
        )
        self.policy = Policy(engine.knobs, facts, PolicyConfig(max_prefetch_depth=max_prefetch))
        self.sensors = Sensors(paths, gpu=False)

    def step(self) -> dict:
        # The sensors' interval is this engine's step alone: the other engine's traffic between
        # our steps would otherwise count as contention.
        self.sensors.sample({})
        t0 = time.monotonic()
        rec = self.engine.step(HYPERS)
        moved = {p: rec.path_bytes_read.get(p, 0) + rec.path_bytes_written.get(p, 0) for p in self.paths}
        dt = max(time.monotonic() - t0, 1e-6)
        s = self.sensors.sample({p: b / dt for p, b in moved.items()})
        other = {p: s["paths"][p]["other_bytes_per_s"] for p in self.paths}
        obs = Observation.from_records([rec], path_other_bytes_per_s=other, knobs=rec.knobs)
        d = self.policy.observe(obs)
        if d is not None:
            self.engine.set_knobs(d.knobs)
        return _row(rec, d.reason if d else None, other)

    def good_knobs(self) -> Knobs:
        return Knobs(**self.policy.state()["good_knobs"])

    def log(self) -> list[dict]:
        return self.policy.log

    def close(self) -> None:
        self.sensors.close()


class ThroughDaemon:
    """The real daemon and engine client: report each step, apply changes before the next."""

    def __init__(self, engine: SubgroupEngine, paths: list[str], run_id: str, socket_path: str) -> None:
        from tuner.client import TunerClient

        self.engine = engine
        # The engine's step hook, as in training. No training loop here: the step is the whole
        # iteration (the time since the last report would count the reference engine's step).
        self.client = TunerClient.for_engine(socket_path, engine, run_id=run_id, step_is_iteration=True)
        if not self.client.connected.wait(15):
            raise SystemExit(f"the tuner daemon at {socket_path} did not register the run: {self.client.last_error}")
        self._changes: list[dict] = []

    def step(self) -> dict:
        before = self.client.knobs
        rec = self.engine.step(HYPERS)
        applied = self.client.knobs if self.client.knobs is not before else None
        return _row(rec, f"daemon's change applied: {applied.to_dict()}" if applied is not None else None)

    def good_knobs(self) -> Knobs:
        return self.engine.knobs

    def log(self) -> list[dict]:
        return []

    def close(self) -> None:
        self.client.close()


class Daemon:
    """A private `offloadctl tuner serve` for this benchmark, with its own socket and database."""

    def __init__(self) -> None:
        from tuner import service

        self.service = service
        self.dir = tempfile.mkdtemp(prefix="offloadctl-bench-tuner-")
        self.socket = os.path.join(self.dir, "tuner.sock")
        self.info = service.start(self.socket, db_path=os.path.join(self.dir, "tuner.db"))

    def close(self) -> None:
        try:
            self.service.stop(self.socket)
            if self.info.get("process") is not None:
                self.info["process"].wait(5)
        finally:
            shutil.rmtree(self.dir, ignore_errors=True)


# -- the background writer -------------------------------------------------------------------------


class BackgroundWriter:
    """``jobs`` sequential writers with O_DIRECT and 8 MiB blocks into ``directory`` until
    stopped, 512 MiB of files in all: fio when present, else dd loops. Each has one request in
    flight, so ``jobs`` sets its share of a throttled device against the engine's concurrency.
    With ``cgroup``, the writer puts itself into that blkio cgroup before writing; without, it
    inherits this process's cgroup (under ``tiers.sh run``, the tiers' cgroup)."""

    def __init__(self, directory: str, jobs: int = 4, cgroup: str | None = None) -> None:
        self.dir, self.jobs, self.cgroup = directory, jobs, cgroup
        self.prefix = os.path.join(directory, "offloadctl-bench-writer")
        self.proc: subprocess.Popen | None = None
        self.tool = "fio" if shutil.which("fio") else "dd"

    def start(self) -> None:
        mib = max(8, 512 // self.jobs)
        if self.tool == "fio":
            write = (
                f'exec fio --name=bg --directory="{self.dir}" --filename_format="offloadctl-bench-writer.$jobnum" '
                f"--rw=write --bs=8M --direct=1 --size={mib}M --numjobs={self.jobs} --time_based --runtime=86400 "
                f"--output=/dev/null"
            )
        else:
            loop = (
                f'while :; do dd if=/dev/zero of="{self.prefix}.$j" bs=8M count={mib // 8} oflag=direct conv=notrunc '
                f"status=none || exit 1; done"
            )
            write = f"for j in $(seq {self.jobs}); do ({loop}) & done; wait"
        join = f'echo $$ > "{self.cgroup}/cgroup.procs" && ' if self.cgroup else ""
        # Its own process group, so that stop() ends the loops and the writers, nothing else.
        self.proc = subprocess.Popen(
            ["bash", "-c", join + write],
            start_new_session=True,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
        )

    def cgroup_of(self) -> str:
        try:
            with open(f"/proc/{self.proc.pid}/cgroup") as f:
                return next((ln.strip().split(":", 2)[2] for ln in f if ":blkio:" in ln), "?")
        except (OSError, AttributeError):
            return "?"

    def stop(self) -> None:
        if self.proc is None:
            return
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
        try:
            _, err = self.proc.communicate(timeout=10)
        except subprocess.TimeoutExpired:
            os.killpg(self.proc.pid, signal.SIGKILL)
            _, err = self.proc.communicate()
        if self.proc.returncode not in (0, -signal.SIGTERM, 143) and err:
            console.print(f"[yellow]background writer: {err.decode(errors='replace').strip()[:300]}[/yellow]")
        self.proc = None
        for name in os.listdir(self.dir):
            if name.startswith("offloadctl-bench-writer"):
                os.unlink(os.path.join(self.dir, name))


# -- the two parts ---------------------------------------------------------------------------------


def _sliding(xs: list[float], i: int) -> float:
    return statistics.median(xs[max(0, i - WINDOW + 1) : i + 1])


def part1(args, specs: tuple[StoragePath, ...], daemon: Daemon | None, progress: Progress) -> dict:
    path = specs[0].path
    depths = list(args.grid_prefetch)
    if daemon and PolicyConfig().max_prefetch_depth not in depths:
        # The daemon's policy may go as deep as its default allows: the grid must cover that too.
        depths.append(PolicyConfig().max_prefetch_depth)
    grid = [Knobs(io_concurrency={path: c}, prefetch_depth=d) for c in args.grid_concurrency for d in depths]
    start = Knobs(io_concurrency={path: 1}, prefetch_depth=0)
    numel, sub = int(args.params), int(args.subgroup)
    tuned = build_engine(numel, sub, specs, start, args.io_backend)
    static = build_engine(numel, sub, specs, grid[0], args.io_backend)
    driver = (
        ThroughDaemon(tuned, [path], f"bench-part1-{os.getpid()}", daemon.socket)
        if daemon
        else InProcess(tuned, [path], max(args.grid_prefetch))
    )
    schedule = [(k, step) for k in range(len(grid)) for step in range(4)]  # step 0 settles
    # In-process, the two engines alternate so that both see the same machine. The daemon's
    # sensors would count the static engine's traffic as contention: there they run one after
    # the other.
    n = max(args.iters, len(schedule))
    order = (
        [("tuned", i) for i in range(args.iters)] + [("static", i) for i in range(len(schedule))]
        if daemon
        else [(who, i) for i in range(n) for who in ("tuned", "static") if i < (args.iters if who == "tuned" else len(schedule))]
    )
    rows, static_times = [], [[] for _ in grid]
    task = progress.add_task("part 1: tuned run and static grid", total=len(order))
    try:
        for who, i in order:
            if who == "tuned":
                rows.append(driver.step())
            else:
                k, step = schedule[i]
                if step == 0 and k > 0:
                    static.set_knobs(grid[k])
                rec = static.step(HYPERS)
                if step > 0:
                    static_times[k].append(rec.update_s)
            progress.advance(task)
    finally:
        driver.close()
        tuned.close()
        static.close()
    plans = [
        {"io_concurrency": g.concurrency_for(path), "prefetch_depth": g.prefetch_depth, "update_s": statistics.median(t)}
        for g, t in zip(grid, static_times)
    ]
    best = min(plans, key=lambda p: p["update_s"])
    u = [r["update_s"] for r in rows]
    reached = next((i for i in range(WINDOW, len(u)) if _sliding(u, i) <= 1.1 * best["update_s"]), None)
    return {
        "path": path,
        "start": start.to_dict(),
        "static_plans": plans,
        "best_static": best,
        "rows": rows,
        "reached_within_10pct_at_iteration": reached,
        "goal_iteration": 30,
        "tuned_final_update_s": _sliding(u, len(u) - 1),
        "tuned_final_knobs": driver.good_knobs().to_dict(),
        "log": driver.log(),
    }


def gpu_engine(numel: int, sub: int, device: str, fraction: float) -> SubgroupEngine:
    """A ZeRO-3 rank's shape on a GPU: bf16 weights on the device, bf16 gradients in host memory,
    a gradient scale (clipping), all state in host memory, no device tier."""
    torch.manual_seed(0)
    weight = torch.randn(numel, device=device).to(torch.bfloat16)
    grad = (torch.randn(numel) * 1e-3).to(torch.bfloat16)  # cpu ok: ZeRO-3 offload keeps gradients in host memory
    bindings = []
    for o in range(0, numel, sub):
        b = FlatSubgroup(weight[o : o + sub], grad[o : o + sub])
        b.grad_scale = 0.5
        bindings.append(b)
    cfg = EngineConfig(subgroup_numel=sub, host_cache_bytes=None, device=device, device_cache_bytes=0, host_adam="auto")
    return SubgroupEngine(bindings, cfg, Knobs(device_fraction=fraction))


def part3(args, progress: Progress) -> dict:
    """The device fraction from a poor start (0: every subgroup on the CPU) against a static sweep
    of fractions, in the same process, alternating. A fixed forward/backward time
    (--fwd-bwd-s) is added to each update to make the iteration the policy judges."""
    device = args.lane_device or ("cuda" if torch.cuda.is_available() else None)
    if device is None:
        raise SystemExit("part 3 needs CUDA (or --lane-device cpu for a smoke run of its code)")
    numel, sub = int(args.params), int(args.subgroup)
    grid = [k / 4 for k in range(5)]
    tuned = gpu_engine(numel, sub, device, 0.0)
    static = gpu_engine(numel, sub, device, grid[0])
    policy = Policy(tuned.knobs, RunFacts(has_device=True, subgroup_bytes=payload_bytes(sub), params=numel), PolicyConfig())
    schedule = [(k, step) for k in range(len(grid)) for step in range(4)]
    rows, static_times = [], [[] for _ in grid]
    n = max(args.iters, len(schedule))
    task = progress.add_task("part 3: device fraction", total=n)
    try:
        for i in range(n):
            if i < args.iters:
                rec = tuned.step(HYPERS)
                it = rec.update_s + args.fwd_bwd_s
                obs = Observation.from_records(
                    [rec], iter_times_s=[it], device_headroom_bytes=rec.device_headroom_bytes, knobs=rec.knobs
                )
                d = policy.observe(obs)
                if d is not None:
                    tuned.set_knobs(d.knobs)
                rows.append(
                    {
                        "iteration": rec.iteration,
                        "iteration_s": it,
                        "update_s": rec.update_s,
                        "fraction": rec.knobs.device_fraction,
                        "decision": d.reason if d else None,
                    }
                )
            if i < len(schedule):
                k, step = schedule[i]
                if step == 0 and k > 0:
                    static.set_knobs(static.knobs.replace(device_fraction=grid[k]))
                rec = static.step(HYPERS)
                if step > 0:
                    static_times[k].append(rec.update_s + args.fwd_bwd_s)
            progress.advance(task)
    finally:
        tuned.close()
        static.close()
    plans = [{"device_fraction": f, "iteration_s": statistics.median(t)} for f, t in zip(grid, static_times)]
    best = min(plans, key=lambda p: p["iteration_s"])
    its = [r["iteration_s"] for r in rows]
    reached = next((i for i in range(WINDOW, len(its)) if _sliding(its, i) <= 1.05 * best["iteration_s"]), None)
    untuned = plans[0]["iteration_s"] * len(its)
    return {
        "device": device,
        "static_plans": plans,
        "best_static": best,
        "rows": rows,
        "reached_within_5pct_at_iteration": reached,
        "goal_iteration": 30,
        "tuned_total_s": sum(its),
        "untuned_total_s": untuned,
        "final_fraction": rows[-1]["fraction"],
    }


def print_part3(r: dict, c: Console) -> None:
    t = Table(title=f"part 3: device fraction on {r['device']}, static plans (iteration, median of 3)")
    t.add_column("fraction")
    t.add_column("iteration s")
    for p in r["static_plans"]:
        t.add_row(f"{p['device_fraction']:g}", f"{p['iteration_s']:.3f}")
    c.print(t)
    c.print(
        f"tuned from fraction 0: within 5% of the best static ({r['best_static']['device_fraction']:g}) at iteration "
        f"{r['reached_within_5pct_at_iteration']} (goal <= {r['goal_iteration']}); final fraction "
        f"{r['final_fraction']:g}; total over the run {r['tuned_total_s']:.1f} s against "
        f"{r['untuned_total_s']:.1f} s untuned"
    )
    for row in r["rows"]:
        if row["decision"]:
            c.print(f"  {row['iteration']:>3}: {escape(row['decision'])}")


def read_pins(texts: list[str], paths: list[str]) -> tuple[dict, Knobs]:
    """``--pin KNOB=VALUE`` texts -> ({knob text: value}, the default knobs with them set), read as
    the tuner reads a pin (``tuner.knob_text``). ConfigError naming the bad one."""
    pins, start, fixed = Pins(), Knobs(), {}
    for text in texts:
        knob, eq, value = text.partition("=")
        if not eq or not knob.strip() or not value.strip():
            raise ConfigError(f"--pin {text!r}: give KNOB=VALUE, for example prefetch_depth=2")
        try:
            key, value, start = pins.pin(knob.strip(), value, start, paths, has_device=False)
        except ConfigError as e:
            raise ConfigError(f"--pin {text}: {e}") from None
        fixed[str(key)] = value
    return fixed, start


def pins_broken(rows: list[dict], fixed: dict, start: Knobs) -> list[int]:
    """Iterations of ``rows`` whose knobs differ from ``start`` in a pinned knob."""
    keys = [KnobKey.parse(k) for k in fixed]
    return [r["iteration"] for r in rows if any(k.value_in(Knobs.from_dict(r["knobs"])) != k.value_in(start) for k in keys)]


def part2(args, specs: tuple[StoragePath, ...], daemon: Daemon | None, progress: Progress) -> dict:
    paths = [s.path for s in specs]
    numel, sub = int(args.params), int(args.subgroup)
    fixed, start = read_pins(args.pin, paths)
    tuned = build_engine(numel, sub, specs, start, args.io_backend, pins=fixed)
    # The daemon's sensors would count a reference engine's traffic as contention: none there.
    ref = build_engine(numel, sub, specs, start, args.io_backend) if args.reference and not daemon else None
    driver = (
        ThroughDaemon(tuned, paths, f"bench-part2-{os.getpid()}", daemon.socket)
        if daemon
        else InProcess(tuned, paths, args.max_prefetch, fixed=fixed)
    )
    w0, w1 = args.writer_at, args.writer_at + args.writer_iters
    total = w1 + args.after
    writer = BackgroundWriter(paths[0], args.writer_jobs, args.writer_cgroup)
    rows, writer_cgroup, frozen = [], None, None
    task = progress.add_task("part 2: contention", total=total)
    try:
        for i in range(total):
            if i == w0:
                frozen = driver.good_knobs()
                if ref is not None:
                    ref.set_knobs(frozen)  # from here on the reference keeps the plan of this moment
                writer.start()
                time.sleep(0.5)  # let it reach full speed before the step
                writer_cgroup = writer.cgroup_of()
            if i == w1:
                writer.stop()
            row = driver.step()
            row["writer"] = w0 <= i < w1
            if ref is not None:
                if i < w0 and ref.knobs != tuned.knobs:
                    ref.set_knobs(tuned.knobs)  # until then it follows the tuned run
                row["reference_update_s"] = ref.step(HYPERS).update_s
            rows.append(row)
            progress.advance(task)
    finally:
        writer.stop()
        driver.close()
        tuned.close()
        if ref is not None:
            ref.close()
    broken = pins_broken(rows, fixed, start)
    return {
        "paths": paths,
        "writer": f"{writer.tool} x{writer.jobs}",
        "writer_cgroup": writer_cgroup,
        "writer_start": w0,
        "writer_stop": w1,
        "start_knobs": start.to_dict(),
        "pins": fixed,
        "pins_held": not broken if fixed else None,
        "pins_broken_at_iterations": broken,
        "knobs_at_writer_start": frozen.to_dict() if frozen else None,
        "rows": rows,
        "log": driver.log(),
        **_contention_metrics(rows, w0, w1),
    }


def _contention_metrics(rows: list[dict], w0: int, w1: int) -> dict:
    u = [r["update_s"] for r in rows]
    pre = statistics.median(u[max(0, w0 - 5) : w0])
    half = (w0 + w1) // 2
    settled = statistics.median(u[half:w1]) if w1 > half else None
    reacted = next(
        (
            i - w0
            for i in range(w0, len(rows))
            if rows[i]["decision"] and ("contention" in rows[i]["decision"] or "contended" in rows[i]["decision"])
        ),
        None,
    )
    settle = next((i - w0 for i in range(w0 + WINDOW - 1, w1) if settled and _sliding(u, i) <= 1.1 * settled), None)
    recover = next((i - w1 for i in range(w1 + WINDOW - 1, len(u)) if _sliding(u, i) <= 1.1 * pre), None)
    out = {
        "pre_update_s": pre,
        "during_update_s": settled,
        "reacted_after_iterations": reacted,
        "settled_after_iterations": settle,
        "recovered_after_iterations": recover,
        "goal_iterations": 10,
    }
    ref = [r.get("reference_update_s") for r in rows]
    if ref[0] is not None and w1 > half:
        out["reference_during_update_s"] = statistics.median(ref[half:w1])
        out["reference_over_tuned_during"] = out["reference_during_update_s"] / settled
        # Adapted: the tuned run beats the reference (its knobs frozen when the writer started)
        # by 10%, both as sliding medians.
        out["adapted_after_iterations"] = next(
            (i - w0 for i in range(w0 + WINDOW - 1, w1) if _sliding(u, i) <= 0.9 * _sliding(ref, i)), None
        )
    return out


# -- output ----------------------------------------------------------------------------------------


def _bar(x: float, top: float, width: int = 36) -> str:
    n = 0 if top <= 0 else x / top * width
    return "█" * int(n) + ("▌" if n - int(n) >= 0.5 else "")


def _names(text: str, paths: list[str]) -> str:
    """``text`` with each path written as its last component, so that the plot stays narrow."""
    for p in paths:
        text = text.replace(p, os.path.basename(p.rstrip("/")) or p)
    return text


def _short(k: dict, paths: list[str]) -> str:
    conc = "/".join(str(k["io_concurrency"].get(p, Knobs.DEFAULT_IO_CONCURRENCY)) for p in paths)
    w = k["stripe_weights"]
    share = f" w{w[paths[0]] / sum(w.values()):.2f}" if len(paths) > 1 and w and sum(w.values()) > 0 else ""
    return f"c{conc} p{k['prefetch_depth']}{share}"


def print_part1(r: dict, c: Console) -> None:
    c.print(f"\n[bold]Part 1[/bold]: from concurrency 1, prefetch 0 on {escape(r['path'])}")
    t = Table("static plan", "update s (median of 3)")
    for p in r["static_plans"]:
        best = " (best)" if p == r["best_static"] else ""
        t.add_row(f"concurrency {p['io_concurrency']}, prefetch {p['prefetch_depth']}{best}", f"{p['update_s']:.3f}")
    c.print(t)
    _print_rows(r["rows"], [r["path"]], c, reference=None)
    at = r["reached_within_10pct_at_iteration"]
    c.print(
        f"best static plan {r['best_static']['update_s']:.3f} s; tuned run within 10% (median of {WINDOW}) at "
        f"iteration {at if at is not None else 'never'} (goal: <= {r['goal_iteration']}); final "
        f"{r['tuned_final_update_s']:.3f} s with {escape(_short(r['tuned_final_knobs'], [r['path']]))}"
    )


def print_part2(r: dict, c: Console) -> None:
    c.print(
        f"\n[bold]Part 2[/bold]: background writer ({r['writer']}, cgroup {r['writer_cgroup']}) on {escape(r['paths'][0])} "
        f"during iterations {r['writer_start']}..{r['writer_stop'] - 1}"
    )
    if r.get("pins"):
        held = "yes" if r["pins_held"] else f"NO, moved at iterations {', '.join(map(str, r['pins_broken_at_iterations']))}"
        c.print(
            f"pinned (fixed from the start, the reference starts there too): "
            f"{escape(_names(', '.join(f'{k}={json.dumps(v)}' for k, v in r['pins'].items()), r['paths']))}; "
            f"held in every row of the tuned run: {held}"
        )
    _print_rows(r["rows"], r["paths"], c, reference="reference_update_s")
    fmt = lambda v: "never" if v is None else str(v)  # noqa: E731
    c.print(
        f"update before the writer {r['pre_update_s']:.3f} s, tuned while it runs {r['during_update_s']:.3f} s"
        + (
            f", reference (knobs frozen at its start) {r['reference_during_update_s']:.3f} s, "
            f"reference / tuned = {r['reference_over_tuned_during']:.2f}"
            if "reference_during_update_s" in r
            else ""
        )
    )
    adapted = (
        f", 10% faster than the reference after {fmt(r['adapted_after_iterations'])}" if "adapted_after_iterations" in r else ""
    )
    c.print(
        f"after the writer started: reacted after {fmt(r['reacted_after_iterations'])} iterations{adapted}, at its "
        f"level under contention after {fmt(r['settled_after_iterations'])} (goal: adapt within "
        f"{r['goal_iterations']}); after it stopped: within 10% of the time before it after "
        f"{fmt(r['recovered_after_iterations'])} iterations"
    )


def _print_rows(rows: list[dict], paths: list[str], c: Console, reference: str | None) -> None:
    top = max(max(r["update_s"] for r in rows), max((r.get(reference) or 0 for r in rows), default=0) if reference else 0)
    t = Table("it", "W", "update s", "", *(["ref s"] if reference else []), "knobs", "decision", show_edge=False)
    for r in rows:
        t.add_row(
            str(r["iteration"]),
            "W" if r.get("writer") else "",
            f"{r['update_s']:.3f}",
            _bar(r["update_s"], top),
            *([f"{r[reference]:.3f}" if r.get(reference) is not None else ""] if reference else []),
            escape(_short(r["knobs"], paths)),
            escape(_names(r["decision"] or "", paths)[:120]),
        )
    c.print(t)


# -- emulated tiers --------------------------------------------------------------------------------


def run_emulated_tiers(args, argv: list[str]) -> int:
    """Two emulated tiers (nvme, pfs) with bench/tiers.sh; this benchmark re-runs inside their cgroup."""
    nvme, _, pfs = args.emulate.partition(",")
    # Two engines' state (part 1 puts both on the NVMe tier), the writer's 512 MiB, and slack.
    size_gb = args.tier_gb or math.ceil(2 * STATE_BYTES_PER_ELEMENT * args.params * 1.3 / 1e9) + 1
    return run_emulated(
        __file__, nvme, argv, size_gb=size_gb, remote=pfs or "200:200", extra=["--bandwidth", f"{nvme},{pfs or '200:200'}"]
    )


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument(
        "--emulate",
        nargs="?",
        const="400:400,200:200",
        metavar="NR:NW,PR:PW",
        help="set up emulated NVMe and PFS tiers throttled to these MB/s (root; default 400:400,200:200), "
        "run there, and take them down",
    )
    ap.add_argument("--nvme", help="directory of the NVMe-like path (parts 1 and 2)")
    ap.add_argument("--remote", help="directory of the PFS-like path (part 2)")
    ap.add_argument("--bandwidth", metavar="NR:NW,PR:PW", help="declare the paths' MB/s instead of probing them")
    ap.add_argument(
        "--part",
        choices=["1", "2", "3", "all"],
        default="all",
        help="1: poor start on storage; 2: contention; 3: the device fraction on a GPU (not in 'all')",
    )
    ap.add_argument("--fwd-bwd-s", type=float, default=1.0, help="part 3: forward/backward seconds per iteration")
    ap.add_argument("--lane-device", choices=["cpu"], help="part 3 on the CPU: a smoke run of its code, not figures")
    ap.add_argument("--params", type=float, default=100e6, help="parameters per engine (default 1e8)")
    ap.add_argument("--subgroup", type=float, default=1e7, help="elements per subgroup (default 1e7)")
    ap.add_argument("--iters", type=int, default=40, help="part 1: iterations of the tuned run (default 40)")
    ap.add_argument(
        "--grid-concurrency",
        type=lambda s: [int(x) for x in s.split(",")],
        default=[1, 4, 16],
        help="part 1: static plans' concurrency (default 1,4,16)",
    )
    ap.add_argument(
        "--grid-prefetch",
        type=lambda s: [int(x) for x in s.split(",")],
        default=[0, 2, 4],
        help="part 1: static plans' prefetch depth (default 0,2,4); the tuner's maximum too",
    )
    ap.add_argument("--writer-at", type=int, default=15, help="part 2: iteration the writer starts (default 15)")
    ap.add_argument("--writer-iters", type=int, default=20, help="part 2: iterations it runs (default 20)")
    ap.add_argument("--after", type=int, default=15, help="part 2: iterations after it stops (default 15)")
    ap.add_argument(
        "--writer-jobs", type=int, default=4, help="part 2: parallel writers, each with one 8 MiB request in flight (default 4)"
    )
    ap.add_argument("--writer-cgroup", help="part 2: blkio cgroup directory the writer joins (default: inherit ours)")
    ap.add_argument(
        "--pin",
        action="append",
        default=[],
        metavar="KNOB=VALUE",
        help="part 2: fix a knob of the tuned run from the start (repeatable; VALUE as JSON; KNOB one of "
        f"{', '.join(Knobs.names())}, or io_concurrency[PATH]); the reference starts there too",
    )
    ap.add_argument("--max-prefetch", type=int, default=4, help="part 2: the tuner's maximum prefetch depth (default 4)")
    ap.add_argument(
        "--no-reference",
        dest="reference",
        action="store_false",
        help="part 2: no reference engine (halves the run time; always so with --daemon)",
    )
    ap.add_argument(
        "--daemon",
        action="store_true",
        help="drive the knobs through a private tuner daemon and tuner.client.TunerClient instead of in-process",
    )
    ap.add_argument("--tier-gb", type=int, help="--emulate: size of each tier (default: from --params)")
    ap.add_argument("--io-backend", default="auto", choices=["auto", "aio", "posix"])
    ap.add_argument("--json", metavar="FILE", help="also write the results as JSON to FILE")
    args = ap.parse_args()
    if args.part == "3":
        with Progress(console=console, transient=True) as progress:
            r = part3(args, progress)
        if args.json:
            with open(args.json, "w") as f:
                json.dump({"machine": update_phase._machine(), "command": " ".join(sys.argv), "part3": r}, f, indent=2)
        print_part3(r, Console(width=180))
        return 0
    if args.pin:
        if args.part != "2":
            console.print("[red]--pin: the pins apply to part 2 (contention); give --part 2[/red]", soft_wrap=True)
            return 2
        # Read them now, against the paths they will have, so that a bad one costs no tiers.
        where = (
            [os.path.join(tiers_root(), "nvme"), os.path.join(tiers_root(), "pfs")] if args.emulate else [args.nvme, args.remote]
        )
        try:
            read_pins(args.pin, [p for p in where if p])
        except ConfigError as e:
            console.print(f"[red]{escape(str(e))}[/red]", soft_wrap=True)
            return 2
    if args.emulate:
        return run_emulated_tiers(args, sys.argv[1:])
    if not args.nvme or not os.path.isdir(args.nvme):
        console.print(f"[red]--nvme {args.nvme}: give an existing directory (or --emulate)[/red]")
        return 2
    if args.part in ("2", "all") and not (args.remote and os.path.isdir(args.remote)):
        console.print(f"[red]--remote {args.remote}: part 2 needs a second existing directory (or --part 1)[/red]")
        return 2
    declared = [(None, None), (None, None)]
    if args.bandwidth:
        declared = [tuple(float(x) * 1e6 for x in t.split(":")) for t in args.bandwidth.split(",")]
    nvme = StoragePath(path=args.nvme, kind="nvme", read_bytes_per_s=declared[0][0], write_bytes_per_s=declared[0][1])
    out: dict = {
        "machine": update_phase._machine(),
        "params": int(args.params),
        "subgroup": int(args.subgroup),
        "command": " ".join(sys.argv),
        "mode": "daemon" if args.daemon else "in-process",
        "pins": {},
    }
    daemon = None
    if args.daemon:
        if not os.path.exists(os.path.join(ROOT, "tuner", "client.py")):
            console.print("[red]--daemon needs tuner/client.py (the engine client), which this checkout lacks[/red]")
            return 2
        daemon = Daemon()
    try:
        with Progress(console=console, transient=True) as progress:
            if args.part in ("1", "all"):
                out["part1"] = part1(args, (nvme,), daemon, progress)
            if args.part in ("2", "all"):
                pfs = StoragePath(
                    path=args.remote, kind="remote", read_bytes_per_s=declared[1][0], write_bytes_per_s=declared[1][1]
                )
                out["part2"] = part2(args, (nvme, pfs), daemon, progress)
                out["pins"] = out["part2"]["pins"]
    finally:
        if daemon is not None:
            daemon.close()
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=2, default=str)
    c = Console(width=180)
    c.print(
        f"[bold]{out['params']:.3g} params[/bold] per engine, subgroup {out['subgroup']:.3g}, "
        f"knobs driven {out['mode']}, pinned: "
        + (escape(", ".join(f"{k}={json.dumps(v)}" for k, v in out["pins"].items())) if out["pins"] else "none")
    )
    if "part1" in out:
        print_part1(out["part1"], c)
    if "part2" in out:
        print_part2(out["part2"], c)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
