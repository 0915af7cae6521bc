"""offloadctl train against stock DeepSpeed on one GPU: the same unmodified ZeRO-3 script, interleaved.

    .venv/bin/python bench/gpu_vs_stock.py                      # GPU: sizes 2b and 4b
    .venv/bin/python bench/gpu_vs_stock.py --sizes 2b --iters 8 --json out.json
    .venv/bin/python bench/gpu_vs_stock.py --cpu                # no GPU: host lane vs stock CPU offload
    python3 bench/gpu_vs_stock.py --sizes 4b --profile none --row "offloadctl default" \\
        --row "stock ZeRO-3 CPU offload" --required 2 --stop-by EPOCH --gpu-memory-as auto   # a stage's rows

The script is bench/gpt_zero3.py (bf16, AdamW, gradient_clipping 1.0, sub_group_size 1e8, all
tensors on the rank's device). Rows, per size, run one after the other in each round:

- stock, no offload (only where the state fits the GPU: 2b);
- stock ZeRO-3 CPU offload (``offload_optimizer: cpu``);
- stock Twin-Flow (``offload_optimizer.ratio``) at each ratio of a small sweep;
- offloadctl default: ``offloadctl train --profile P`` with P measured at the start of this run
  (``offloadctl profile save --quick``; ``--profile none``: no profile, the lanes balance from the
  rates measured at the first step), device tier and device fraction ``auto``, tuner off;
- offloadctl with the device fraction forced to 0, 0.5 and 1 and no device tier.

Our rows run first (a run cut short keeps them). Per row: median iteration, step and
forward+backward over iterations 3..N, the first iteration, GPU peak memory, host peak RSS,
the losses of steps 1-3, the device it ran on, and the performance model's predicted iteration
(the measured profile and the row's measured forward+backward).
The physical limits measured in the same run (the profile: pinned PCIe, duplex, GPU and CPU
AdamW rates) are printed with the table. ``--cpu`` runs the same script at a CPU size: stock
ZeRO-3 CPU offload against offloadctl's host lane.

``--row NAME`` (repeatable) runs the named rows of the catalog in that order instead (names in
``catalog``; without CUDA the device lane and tier of a row run on the CPU, ``--lane-device
cpu``, so a dry run goes through the same rows). The catalog adds, beside the rows above: stock
Twin-Flow at 0.1..0.7, ``stock ZeRO-Infinity`` and ``offloadctl nvme`` (``--nvme DIR``: each row
its own fresh directory under DIR, removed after it), and ``offloadctl tuned from fraction 0``
(tuner on, started at device fraction 0 and device cache 0; once the run has registered with its
tuner, device_fraction is unpinned with ``offloadctl tune --unpin``, so the tuner may move it;
``--tuner-iters`` iterations; the iteration at which the sliding median of 3 comes within 5% of
the best ``offloadctl fraction F`` row is reported).

Time: ``--stop-by EPOCH`` bounds the whole run. A row's limit is what is left, less
``--min-row-s`` for each required row still to come (the first ``--required`` rows), capped by
``--row-timeout``; a row that is not required runs only when ``--min-row-s`` is left. Skipped rows
are in the JSON as skipped. ``--after-required CMD`` runs once after the last required row (after
the first row when none is), so that a slow command (gpu_session.sh packs the built ops there) never
takes the time kept for a required row. A row runs in a session of its own (its pgid registered in
``$GPU_SESSION_PGID_DIR`` when set, so that bench/gpu_session.sh can kill it if this process
dies first); past its limit, or when this process gets SIGTERM, SIGINT or SIGHUP, the row's group
gets SIGTERM (offloadctl then removes its swap files) and SIGKILL ``KILL_GRACE_S`` later. The
JSON is written after every row and on such a signal.

``--gpu-memory-as auto`` keeps the planned sizes honest on a bigger GPU (an H200's 141 GB holds the
4b state, and "offloadctl default" would no longer offload): where the GPU has more than
``BIG_GPU_BYTES``, a ballast process holds the difference, so every row, stock and ours, is
allowed the memory of an H100 80GB (``H100_TOTAL_BYTES``). offloadctl's device tier keeps a
safety margin beyond its step's peak, taken from the memory the process may use
(``engine.gpumem.usable_bytes``: the ballast's memory is another process's), so the tier is
sized as on an H100. Should an engine take it from the card's total instead, the ballast holds
that difference less (asked of ``engine.gpumem.gpu_headroom_bytes``, see
:func:`engine_margin_bytes`; 0 with the engine of issue 47). The JSON (``gpu_memory``;
``device_memory_bytes`` in every row) and the table say which card the rows ran on and how much
of its memory they had.

``--report DIR`` adds a row: stock CPU offload again, under ``offloadctl train --engine stock``
(DeepSpeed's own optimizer, only recorded). Its iteration over the plain stock row's is the
recording's overhead in this run; its record and offloadctl default's go into one
``offloadctl report`` (DIR/report-SIZE.html, PNGs in DIR/png-SIZE, numbers in DIR/report-SIZE.json):
GPU memory, PCIe and the update's parts of both on one time axis.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time

from _runs import Stop, on_signal
from rich.console import Console
from rich.table import Table

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
SCRIPT = os.path.join(HERE, "gpt_zero3.py")
console = Console(stderr=True)

# Twin-Flow ratios (share of the state on the CPU) swept per size; the smallest that fits wins.
TWINFLOW_RATIOS = {"2b": (0.1, 0.3), "4b": (0.5, 0.7), "cpu": ()}
NO_OFFLOAD_FITS = {"2b": True, "4b": False, "cpu": False}
FORCED_FRACTIONS = (0.0, 0.5, 1.0)
CATALOG_RATIOS = (0.1, 0.3, 0.5, 0.7)
"""Twin-Flow ratios the catalog offers to --row, whatever the size."""

RECORDED_STOCK = "stock ZeRO-3 CPU offload, recorded"
REPORTED_OURS = {True: "offloadctl default", False: "offloadctl (host lane)"}
TUNED = "offloadctl tuned from fraction 0"
TUNER_WITHIN = 0.05
"""The tuned row's goal: the sliding median of 3 iterations within 5% of the best static row."""
LOSS_RTOL_BF16 = 2e-3
"""Losses of steps 1-3 against stock's: tests/test_ds_interop.py's STOCK_RTOL for bf16 (the host
and GPU AdamW kernels round the fp32 master differently in the last bit; in bf16 that can flip a
weight's last mantissa bit, 2^-8)."""

KILL_GRACE_S = 8.0
"""SIGTERM to SIGKILL for a row's group: offloadctl's ranks unwind and remove their swap files."""
BIG_GPU_BYTES = 100e9
H100_TOTAL_BYTES = 81559 << 20
"""An H100 80GB HBM3's memory as nvidia-smi gives it (81559 MiB): what the rows are allowed on a
bigger card (--gpu-memory-as)."""


class Groups:
    """The process groups this bench started (rows, the ballast): killed on the way out, and
    registered in ``$GPU_SESSION_PGID_DIR`` (one empty file per pgid) for the stage script."""

    def __init__(self) -> None:
        self.dir = os.environ.get("GPU_SESSION_PGID_DIR")
        self.live: set[int] = set()

    def add(self, pgid: int) -> None:
        self.live.add(pgid)
        if self.dir and os.path.isdir(self.dir):
            open(os.path.join(self.dir, str(pgid)), "w").close()

    def remove(self, pgid: int) -> None:
        self.live.discard(pgid)
        if self.dir:
            try:
                os.unlink(os.path.join(self.dir, str(pgid)))
            except OSError:
                pass

    def kill(self, pgid: int, proc: subprocess.Popen | None = None) -> None:
        """SIGTERM to the group, SIGKILL to what is left after KILL_GRACE_S."""
        try:
            os.killpg(pgid, signal.SIGTERM)
        except ProcessLookupError:
            pass
        deadline = time.monotonic() + KILL_GRACE_S
        while time.monotonic() < deadline and _group_alive(pgid):
            if proc is not None:
                proc.poll()  # reap the leader, or the group never looks empty
            time.sleep(0.2)
        try:
            os.killpg(pgid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        if proc is not None:
            proc.wait()
        self.remove(pgid)

    def kill_all(self) -> None:
        for pgid in list(self.live):
            self.kill(pgid)


def _group_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
        return True
    except ProcessLookupError:
        return False
    except PermissionError:
        return True


GROUPS = Groups()


def _run_dir(workdir: str, name: str) -> str:
    return os.path.join(workdir, "run-" + _slug(name))


def _slug(name: str) -> str:
    return "".join(c if c.isalnum() else "-" for c in name)


def _script(size: str) -> list[str]:
    return [SCRIPT, "--size", size] + (["--sub-group-size", "20000000"] if size == "cpu" else [])


PORT = "{port}"
"""Placeholder in a row's command for a free rendezvous port, picked as it starts: two benches on
one machine (a dry run beside another) never meet on a port."""
NVME_DIR = "{nvme}"
"""Placeholder in a row's command for its own fresh directory under --nvme."""


def _stock(size: str, *opts: str) -> list[str]:
    return [sys.executable, "-m", "deepspeed.launcher.runner", "--num_gpus", "1", "--master_port", PORT, *_script(size), *opts]


def _ours(size: str, *opts: str, tuner: str = "off") -> list[str]:
    return [
        sys.executable,
        "-m",
        "offloadctl.cli",
        "train",
        "--num_gpus",
        "1",
        "--master_port",
        PORT,
        "--tuner",
        tuner,
        *opts,
        *_script(size),
    ]


def _free_port() -> str:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return str(s.getsockname()[1])


def catalog(size: str, gpu: bool, profile: str | None, zi_aio: tuple[str, ...] = ()) -> dict[str, list[str]]:
    """Every row --row can name, by name. Without CUDA the rows that use the device lane or tier
    run them on the CPU (``--lane-device cpu``): the same options and code paths, not GPU figures."""
    lane = () if gpu else ("--lane-device", "cpu")
    rows = {
        "offloadctl default": _ours(size, *(["--profile", profile] if profile else [])),
        "offloadctl (host lane)": _ours(size),
    }
    for f in FORCED_FRACTIONS:
        rows[f"offloadctl fraction {f:g}"] = _ours(size, "--device-fraction", f"{f:g}", "--device-cache", "0", *lane)
    rows[TUNED] = _ours(size, "--device-fraction", "0", "--device-cache", "0", *lane, tuner="auto")
    rows["offloadctl nvme"] = _ours(size, "--nvme", NVME_DIR, "--host-cache", "0")
    rows["offloadctl nvme, device cache 0"] = _ours(size, "--nvme", NVME_DIR, "--host-cache", "0", "--device-cache", "0")
    rows["stock, no offload"] = _stock(size, "--offload", "none")
    rows["stock ZeRO-3 CPU offload"] = _stock(size, "--offload", "cpu")
    rows[RECORDED_STOCK] = [
        sys.executable,
        "-m",
        "offloadctl.cli",
        "train",
        "--engine",
        "stock",
        "--num_gpus",
        "1",
        "--master_port",
        PORT,
        *_script(size),
        "--offload",
        "cpu",
    ]
    for r in CATALOG_RATIOS:
        rows[f"stock Twin-Flow ratio {r:g}"] = _stock(size, "--offload", "twinflow", "--ratio", f"{r:g}")
    rows["stock ZeRO-Infinity"] = _stock(size, "--offload", "nvme", "--nvme-path", NVME_DIR, *zi_aio)
    return rows


def rows_for(size: str, gpu: bool, profile: str | None, recorded: bool = False) -> list[tuple[str, list[str]]]:
    """(name, command) of every row for ``size``, without --row: the default set."""
    cat = catalog(size, gpu, profile)
    # Our rows first: a call cut short by the device's time limit still has them.
    names: list[str] = []
    if gpu:
        names += ["offloadctl default", *(f"offloadctl fraction {f:g}" for f in FORCED_FRACTIONS)]
    else:
        names.append("offloadctl (host lane)")
    if gpu and NO_OFFLOAD_FITS.get(size, False):
        names.append("stock, no offload")
    names.append("stock ZeRO-3 CPU offload")
    if recorded:
        names.append(RECORDED_STOCK)
    if gpu:
        names += [f"stock Twin-Flow ratio {r:g}" for r in TWINFLOW_RATIOS.get(size, ())]
    return [(n, cat[n]) for n in names]


class Unpinner(threading.Thread):
    """The tuned row's start: once the run has registered with its private tuner (RUN_DIR/tuner),
    unpin device_fraction, which --device-fraction 0 fixed, so that the tuner may move it."""

    def __init__(self, run_dir: str, env: dict) -> None:
        super().__init__(daemon=True)
        self.run_dir, self.env = run_dir, env
        self.done = threading.Event()
        self.result: dict = {"unpinned": False}

    def _tune(self, *opts: str) -> subprocess.CompletedProcess:
        return subprocess.run(
            [sys.executable, "-m", "offloadctl.cli", "tune", "--run-dir", self.run_dir, *opts],
            capture_output=True,
            text=True,
            cwd=ROOT,
            env=self.env,
            timeout=30,
        )

    def run(self) -> None:
        t0 = time.monotonic()
        while not self.done.wait(2.0):
            try:
                p = self._tune("--once", "--json")
                runs = json.loads(p.stdout).get("runs", []) if p.returncode == 0 else []
            except (subprocess.TimeoutExpired, ValueError):
                continue
            if not runs:
                continue
            run = runs[0]
            try:
                q = self._tune("--unpin", f"{run['run_id']}:device_fraction")
            except subprocess.TimeoutExpired:
                continue
            self.result = {
                "unpinned": q.returncode == 0,
                "run_id": run["run_id"],
                "at_iteration": run.get("iteration"),
                "after_s": round(time.monotonic() - t0, 1),
                "reply": (q.stdout + q.stderr).strip()[-300:],
            }
            return


def run_row(
    cmd: list[str], iters: int, workdir: str, name: str, timeout_s: float, logs: str | None = None, nvme: str | None = None
) -> dict:
    out = os.path.join(workdir, "row.json")
    if os.path.exists(out):
        os.unlink(out)
    run_dir = _run_dir(workdir, name)
    if "offloadctl.cli" in cmd:
        i = cmd.index("train") + 1
        cmd = cmd[:i] + ["--run-dir", run_dir, "--force"] + cmd[i:]  # a row run again replaces its records
    cmd = [_free_port() if c == PORT else c for c in cmd]
    row_nvme = None
    if NVME_DIR in cmd:
        if not nvme:
            return {"failed": "this row needs --nvme DIR"}
        row_nvme = os.path.join(nvme, _slug(name))
        shutil.rmtree(row_nvme, ignore_errors=True)
        os.makedirs(row_nvme)
        cmd = [row_nvme if c == NVME_DIR else c for c in cmd]
    log = os.path.join(logs or workdir, f"row-{_slug(name)}.log")
    # Every row, stock's included, loads DeepSpeed's ops from where `make setup` built them, with
    # the same ninja (as the tests do): stock's row used ~/.cache's, JIT-built on its first run,
    # and hung for its whole time limit on a build lock a killed run had left there.
    import engine.storage.native_ops  # noqa: F401 - sets TORCH_EXTENSIONS_DIR and PATH for the rows

    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    unpin = Unpinner(run_dir, env) if name == TUNED else None
    # A session of its own, so that a row past its time is killed whole (launcher and ranks).
    # Iteration 1 (not in the medians) traces backward's host-device copies (issue 18 item 8).
    with open(log, "w") as logf:
        p = subprocess.Popen(
            [*cmd, "--iters", str(iters), "--out", out, "--trace-backward-at", "1"],
            stdin=subprocess.DEVNULL,
            stdout=logf,
            stderr=subprocess.STDOUT,
            cwd=ROOT,
            start_new_session=True,
            env=env,
        )
    GROUPS.add(p.pid)
    if unpin:
        unpin.start()
    try:
        p.wait(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        GROUPS.kill(p.pid, p)
        return {"failed": f"over the row's {timeout_s:.0f} s limit", "log": log}
    except BaseException:  # Stop (a signal), KeyboardInterrupt: the row goes with us
        GROUPS.kill(p.pid, p)
        raise
    finally:
        if unpin:
            unpin.done.set()
        if row_nvme:  # stock ZeRO-Infinity leaves its swap files; the disk holds one row's state at a time
            shutil.rmtree(row_nvme, ignore_errors=True)
    GROUPS.kill(p.pid, p)  # anything the row left behind in its group (normally nothing: returns at once)
    if p.returncode != 0 or not os.path.exists(out):
        with open(log, errors="replace") as f:
            tail = [ln for ln in f.read().splitlines() if ln.strip()]
        why = next((ln for ln in reversed(tail) if "Error" in ln or "error" in ln), tail[-1] if tail else "no output")
        return {"failed": why[-300:], "log": log}
    with open(out) as f:
        rec = json.load(f)
    tel = os.path.join(run_dir, "telemetry-rank0.jsonl")
    if os.path.exists(tel):
        with open(tel) as f:
            rec["telemetry"] = [json.loads(line) for line in f]
    if unpin:
        rec["unpin"] = unpin.result
    return rec


def summarize(rec: dict) -> dict:
    if "failed" in rec or "skipped" in rec:
        return rec
    warm = slice(2, None) if len(rec["iter_s"]) > 3 else slice(1, None)
    med = lambda k: statistics.median(rec[k][warm])  # noqa: E731
    out = {
        "iteration_s": med("iter_s"),
        "step_s": med("step_s"),
        "fwd_bwd_s": med("fwd_bwd_s"),
        "first_iteration_s": rec["iter_s"][0],
        "losses_1_3": rec["loss"][:3],
        "params": rec["params"],
        "gpu_peak_reserved_bytes": rec["gpu_peak_reserved_bytes"],
        "host_peak_rss_bytes": rec["host_peak_rss_bytes"],
        "host_rss_bytes": rec["host_rss_bytes"],
        "init_s": rec["init_s"],
        "iterations": len(rec["iter_s"]),
        "device": rec.get("gpu") or "cpu",
    }
    for k in ("engine", "backward_memcpy_bytes", "aio", "unpin"):
        if rec.get(k) is not None:
            out[k] = rec[k]
    if "unpin" in rec:  # the tuned row: every iteration, for the time to its goal
        out["iter_s_all"] = rec["iter_s"]
    if rec.get("telemetry"):
        t = rec["telemetry"][warm]
        out["update_breakdown"] = {
            k: statistics.median(r[k] for r in t)
            for k in ("update_s", "host_lane_s", "device_wait_s", "read_wait_s", "write_wait_s")
        }
        out["device_tier_subgroups"] = t[-1]["device_tier_subgroups"]
        out["device_lane_subgroups"] = t[-1]["device_lane_subgroups"]
        out["knobs"] = t[-1]["knobs"]
        if "unpin" in rec:
            out["device_fraction_by_iteration"] = [r["knobs"].get("device_fraction") for r in rec["telemetry"]]
    return out


def predict(profile_path: str | None, name: str, s: dict) -> float | None:
    """The model's iteration for this row: the measured profile, the row's forward+backward."""
    if not profile_path or "failed" in s or "skipped" in s:
        return None
    from engine.config import Knobs
    from perf.model import Plan, Workload
    from perf.model import predict as model_predict
    from perf.profile_toml import load_profile
    from perf.stock import stock_deepspeed

    prof = load_profile(profile_path)
    fit = (s.get("engine") or {}).get("fit") or {}
    wl = Workload(
        params=s["params"], subgroup_numel=100_000_000, fwd_bwd_s=s["fwd_bwd_s"], gpu_headroom_bytes=fit.get("headroom_bytes")
    )
    try:
        if name.startswith("stock ZeRO-3"):
            it = stock_deepspeed(prof, wl, "zero3-cpu").iteration_s
        elif name.startswith("stock Twin-Flow"):
            it = stock_deepspeed(prof, wl, "twinflow", ratio=float(name.rsplit(" ", 1)[1])).iteration_s
        elif name.startswith("stock"):  # no offload, ZeRO-Infinity: not in the model
            return None
        else:
            knobs = s.get("knobs") or {}
            plan = Plan(
                host_cache_bytes=None,
                device_cache_bytes=int(fit.get("device_tier_bytes", 0) or 0),
                knobs=Knobs(device_fraction=float(knobs.get("device_fraction", 0.0)), prefetch_depth=0),
            )
            it = model_predict(prof, wl, plan).iteration_s
        return it if math.isfinite(it) else None  # Twin-Flow without a GPU in the profile: inf
    except Exception as e:  # a plan the model refuses: say so in the row, keep the bench going
        console.print(f"[yellow]{name}: no prediction ({e})[/yellow]")
        return None


def measure_profile(workdir: str, gpu: bool) -> str | None:
    path = os.path.join(workdir, "profile.toml")
    p = subprocess.run(
        [sys.executable, "-m", "offloadctl.cli", "profile", "save", "bench-machine", "--quick", "--output", path, "--force"],
        capture_output=True,
        text=True,
        cwd=ROOT,
    )
    if p.returncode != 0:
        console.print(f"[yellow]profile save failed: {(p.stderr or p.stdout).strip().splitlines()[-1:]}[/yellow]")
        return None
    return path


BALLAST = r"""
import json, sys, torch
target = int(sys.argv[1])
free, total = torch.cuda.mem_get_info()
hold = max(0, free - target)
x = torch.empty(hold, dtype=torch.uint8, device="cuda") if hold else None
after, _ = torch.cuda.mem_get_info()
print(json.dumps({"total_bytes": total, "free_before_bytes": free, "held_bytes": hold, "free_after_bytes": after}),
      flush=True)
sys.stdin.read()  # until the bench closes its end, or dies: then the memory goes back
"""


def engine_margin_bytes(free: int, total: int) -> int | None:
    """The safety margin offloadctl's device tier keeps beyond a step's peak, in a process that
    sees ``free`` of ``total`` bytes free and has allocated nothing: the engine's own rule
    (``engine.gpumem.gpu_headroom_bytes``) asked with those figures; the GPU is not touched.
    None where the engine gives no sensible answer (its rule changed shape)."""
    from unittest import mock

    import torch

    try:
        from engine import gpumem

        with (
            mock.patch.object(torch.cuda, "mem_get_info", lambda *a, **k: (free, total)),
            mock.patch.object(torch.cuda, "memory_reserved", lambda *a, **k: 0),
            mock.patch.object(torch.cuda, "max_memory_reserved", lambda *a, **k: 0),
        ):
            headroom = gpumem.gpu_headroom_bytes(torch.device("cuda"))
    except Exception as e:  # noqa: BLE001 - a bench that cannot ask goes on without the correction
        console.print(f"[yellow]cannot ask the engine for its device margin: {e}[/yellow]")
        return None
    if headroom is None or not 0 <= free - headroom <= free:
        return None
    return free - headroom


def start_ballast(mode: str, gpu: bool) -> tuple[subprocess.Popen | None, dict]:
    """--gpu-memory-as: on a GPU bigger than BIG_GPU_BYTES, a process holding what an H100 80GB
    would not have (less the part of offloadctl's margin that comes from the card's size, see the
    module's docstring), so that every row is allowed an H100's memory. Returns (process, what it
    did: ``rows_bytes`` the memory the rows are allowed, ``margin_bytes`` offloadctl's device-tier
    margin on it)."""
    import torch

    if mode == "none" or not gpu:
        return None, {"mode": mode, "applied": False, "why": "not asked" if mode == "none" else "no GPU"}
    props = torch.cuda.get_device_properties(0)
    total = props.total_memory
    card = {"gpu": props.name, "gpu_total_bytes": total}
    if mode == "auto" and total <= BIG_GPU_BYTES:
        return None, {
            "mode": mode,
            "applied": False,
            **card,
            "rows_bytes": total,
            "margin_bytes": engine_margin_bytes(total, total),
            "why": f"the GPU has {total / 1e9:.0f} GB, not more than {BIG_GPU_BYTES / 1e9:.0f} GB",
        }
    # The engine's margin on the memory the rows are allowed, and what it would keep here: where it
    # takes it from the card's total, the ballast leaves the difference free for it.
    on_rows = engine_margin_bytes(H100_TOTAL_BYTES, H100_TOTAL_BYTES)
    on_card = engine_margin_bytes(H100_TOTAL_BYTES, total)
    adjust = max(0, on_card - on_rows) if on_card is not None and on_rows is not None else 0
    # A session of its own, as a row's; it also exits when its stdin (our pipe) closes.
    p = subprocess.Popen(
        [sys.executable, "-c", BALLAST, str(H100_TOTAL_BYTES + adjust)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    GROUPS.add(p.pid)
    line = p.stdout.readline()
    try:
        info = json.loads(line)
    except ValueError:
        GROUPS.kill(p.pid, p)
        return None, {"mode": mode, "applied": False, **card, "why": f"the ballast process failed: {line.strip()[-200:]}"}
    info.update(
        mode=mode,
        applied=True,
        **card,
        as_gpu="H100 80GB",
        as_total_bytes=H100_TOTAL_BYTES,
        rows_bytes=H100_TOTAL_BYTES,
        margin_bytes=on_rows,
        engine_margin_on_card_bytes=on_card,
        margin_adjust_bytes=adjust,
        note=f"on an {props.name} ({total / 1e9:.1f} GB) the rows are allowed an H100 80GB's "
        f"{H100_TOTAL_BYTES / 1e9:.1f} GB: {info['held_bytes'] / 1e9:.1f} GB held by a ballast, "
        f"{info['free_after_bytes'] / 1e9:.1f} GB free; offloadctl's device-tier margin "
        + (
            f"{on_rows / 1e9:.1f} GB, taken from the rows' memory"
            if on_rows is not None
            else "not known (the engine did not answer): not corrected"
        )
        + (
            f" (the engine takes {on_card / 1e9:.1f} GB from the card's total: the ballast leaves the "
            f"{adjust / 1e9:.1f} GB between them free)"
            if adjust
            else ""
        ),
    )
    console.print(f"[bold]gpu memory: {info['note']}[/bold]")
    return p, info


def row_limit(stop_by: float | None, cap: float, min_row_s: float, required_after: int, required: bool) -> tuple[float, str]:
    """(seconds this row may take, why it is skipped or ""): what is left of --stop-by, less
    min_row_s for each required row after it, capped; a row that is not required runs only when
    min_row_s is left."""
    if stop_by is None:
        return cap, ""
    left = stop_by - time.time()
    budget = left - min_row_s * required_after
    if required:
        budget = max(budget, min(left, min_row_s))  # a required row gets at least its share of what is left
    if budget < min_row_s * (0.5 if required else 1.0):
        return 0.0, (
            f"{left:.0f} s left before the stage's end ({budget:.0f} s for this row), under the {min_row_s:.0f} s a row needs"
        )
    return min(cap, budget), ""


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sizes", default="2b,4b", help="comma-separated sizes of bench/gpt_zero3.py (default 2b,4b)")
    ap.add_argument("--cpu", action="store_true", help="CPU-only mode: host lane vs stock CPU offload, size 'cpu'")
    ap.add_argument("--rounds", type=int, default=1)
    ap.add_argument("--iters", type=int, default=5, help="iterations per run; medians over 3..N (default 5)")
    ap.add_argument("--row-timeout", type=float, default=300, help="seconds a row may take before it is killed")
    ap.add_argument("--rows", help="comma-separated substrings: run only rows whose name contains one")
    ap.add_argument(
        "--row", action="append", default=[], metavar="NAME", help="run this row of the catalog (repeatable; in the order given)"
    )
    ap.add_argument(
        "--required",
        type=int,
        default=0,
        metavar="N",
        help="with --stop-by: the first N rows are required (time is kept for them)",
    )
    ap.add_argument("--stop-by", type=float, metavar="EPOCH", help="no row runs past this time (seconds since the epoch)")
    ap.add_argument("--min-row-s", type=float, default=60, help="with --stop-by: the least time a row needs (default 60)")
    ap.add_argument("--tuner-iters", type=int, default=35, help=f"iterations of the row '{TUNED}' (default 35)")
    ap.add_argument("--nvme", metavar="DIR", help="directory for the rows that use NVMe (a fresh one per row)")
    ap.add_argument(
        "--zi-aio",
        default="",
        help="stock ZeRO-Infinity's aio options for gpt_zero3.py, one string "
        "(e.g. '--aio-block-size 1048576 --aio-queue-depth 32 --aio-intra-op 8')",
    )
    ap.add_argument(
        "--gpu-memory-as",
        choices=["auto", "h100", "none"],
        default="none",
        help="auto: on a GPU over 100 GB, hold what an H100 80GB lacks; h100: always; none (default)",
    )
    ap.add_argument(
        "--profile",
        help="use this profile instead of measuring one; 'none': no profile (our rows "
        "run without --profile, the lanes balance from the rates measured at the first step)",
    )
    ap.add_argument(
        "--logs",
        metavar="DIR",
        help="each row's output to DIR/row-NAME.log, and the rows' run directories "
        "removed at the end (default: both kept in a temporary directory)",
    )
    ap.add_argument(
        "--after-required",
        metavar="CMD",
        help="a shell command run once, after the last required row "
        "(the first row when none is), so it takes none of their time (gpu_session.sh: the built ops "
        "archived, with the host-kernel choice our first row wrote)",
    )
    ap.add_argument("--json", metavar="FILE", help="write every row's figures here")
    ap.add_argument(
        "--report",
        metavar="DIR",
        help="add a recorded stock row and write offloadctl report of it and offloadctl default into DIR",
    )
    args = ap.parse_args()
    for s in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
        signal.signal(s, on_signal)
    import torch

    gpu = torch.cuda.is_available() and not args.cpu
    sizes = ["cpu"] if not gpu else args.sizes.split(",")
    workdir = tempfile.mkdtemp(prefix="offloadctl-gpu-bench-")
    if args.logs:
        os.makedirs(args.logs, exist_ok=True)
    if args.profile == "none":
        profile = None
    else:
        profile = args.profile or measure_profile(workdir, gpu)
    report: dict = {"machine": _machine(), "profile": _limits(profile), "command": " ".join(sys.argv), "sizes": {}}
    ballast = None
    running: tuple[list, float] | None = None  # the row under way: its runs, its start
    try:
        ballast, report["gpu_memory"] = start_ballast(args.gpu_memory_as, gpu)
        report["machine"]["gpu_memory_as"] = report["gpu_memory"].get("as_gpu")
        rows_memory = report["gpu_memory"].get("rows_bytes")  # the device memory every row was allowed
        hook, hook_after = args.after_required, max(args.required, 1) - 1
        for size in sizes:
            if args.row:
                cat = catalog(size, gpu, profile, tuple(args.zi_aio.split()))
                unknown = [n for n in args.row if n not in cat]
                if unknown:
                    console.print(f"[red]unknown rows {unknown}; the catalog: {sorted(cat)}[/red]")
                    return 2
                rows = [(n, cat[n]) for n in args.row]
            else:
                rows = rows_for(size, gpu, profile, recorded=bool(args.report))
                if args.rows:
                    keep = args.rows.split(",")
                    rows = [r for r in rows if any(k in r[0] for k in keep)]
            if args.report and RECORDED_STOCK not in dict(rows):
                rows.append((RECORDED_STOCK, catalog(size, gpu, profile)[RECORDED_STOCK]))
            results: dict[str, list[dict]] = {name: [] for name, _ in rows}
            report["sizes"][size] = results
            for rnd in range(args.rounds):
                for i, (name, cmd) in enumerate(rows):
                    required = i < args.required
                    limit, why = row_limit(
                        args.stop_by, args.row_timeout, args.min_row_s, max(0, args.required - i - 1), required
                    )
                    if why:
                        console.print(f"[yellow]{size} round {rnd + 1}: {name}: skipped: {why}[/yellow]")
                        results[name].append({"skipped": why})
                    else:
                        console.print(f"[dim]{size} round {rnd + 1}: {name} (limit {limit:.0f} s)[/dim]")
                        iters = args.tuner_iters if name == TUNED else args.iters
                        t0 = time.monotonic()
                        running = (results[name], t0)
                        rec = summarize(run_row(list(cmd), iters, workdir, name, limit, args.logs, args.nvme))
                        running = None
                        rec["wall_s"] = round(time.monotonic() - t0, 1)
                        rec["limit_s"] = round(limit)
                        if "iteration_s" in rec:
                            rec["device_memory_bytes"] = rows_memory
                        results[name].append(rec)
                        console.print(f"[dim]  {name}: {_brief(rec)}[/dim]")
                    if args.json:  # as it goes: a call cut short keeps the rows it finished
                        _write(args.json, report)
                    if hook and i >= hook_after:  # after the required rows: never in their time
                        run_hook(hook)
                        hook = None
            table = {}
            for name, runs in results.items():
                ok = [r for r in runs if "failed" not in r and "skipped" not in r]
                if not ok:
                    table[name] = runs[-1]
                    continue
                best = min(ok, key=lambda r: r["iteration_s"])
                best["iteration_s_rounds"] = [r["iteration_s"] for r in ok]
                best["step_s_rounds"] = [r["step_s"] for r in ok]  # the step's noise between processes, per round
                best["predicted_iteration_s"] = predict(profile, name, best)
                table[name] = best
            report["sizes"][size] = table
            report.setdefault("checks", {})[size] = checks(table)
            if args.json:
                _write(args.json, report)
            _print(size, table, report.get("gpu_memory", {}))
            if args.report:
                report.setdefault("report", {})[size] = write_report(args.report, size, workdir, table, gpu)
        if hook:  # fewer rows than --required
            run_hook(hook)
    except Stop as e:
        report["interrupted"] = f"{signal.Signals(e.signum).name} during the run: the running row was killed"
        if running:
            running[0].append(
                {
                    "failed": f"killed by {signal.Signals(e.signum).name} after "
                    f"{time.monotonic() - running[1]:.0f} s (the bench was stopped)"
                }
            )
        console.print(f"[red]{report['interrupted']}[/red]")
        return 128 + e.signum
    finally:
        for s in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
            signal.signal(s, signal.SIG_IGN)  # the cleanup below is not cut short by a second signal
        GROUPS.kill_all()
        if ballast is not None:
            ballast.stdin.close()
        if args.json:
            _write(args.json, report)
        if args.logs:  # a stage's bench: the logs are kept there, the rows' run directories (records) are not
            shutil.rmtree(workdir, ignore_errors=True)
    return 0


def run_hook(cmd: str) -> None:
    """--after-required's command, in its own group (killed with the rest on a signal)."""
    console.print(f"[dim]after the required rows: {cmd}[/dim]")
    p = subprocess.Popen(cmd, shell=True, cwd=ROOT, start_new_session=True)
    GROUPS.add(p.pid)
    try:
        p.wait(timeout=180)
    except subprocess.TimeoutExpired:
        console.print("[yellow]after-required command over 180 s: killed[/yellow]")
    finally:
        GROUPS.kill(p.pid, p)


def checks(table: dict) -> dict:
    """What the stage asks of the figures: our losses against stock's (steps 1-3, bf16 tolerance),
    and the tuned row's iterations to within 5% of the best static row."""
    out: dict = {}
    ok = {n: r for n, r in table.items() if "iteration_s" in r}
    refs = [n for n in ("stock, no offload", "stock ZeRO-3 CPU offload", RECORDED_STOCK, "stock ZeRO-Infinity") if n in ok]
    by_ref = {}
    for ref_name in refs:
        ref = ok[ref_name]["losses_1_3"]
        rows = {}
        for n, r in ok.items():
            if n.startswith("stock") or not r["losses_1_3"]:
                continue
            rel = max(abs(a - b) / max(abs(b), 1e-12) for a, b in zip(r["losses_1_3"], ref))
            rows[n] = {"max_rel_diff": rel, "within": rel <= LOSS_RTOL_BF16}
        if rows:
            by_ref[ref_name] = rows
    if by_ref:
        out["losses_vs_stock"] = {
            "rtol": LOSS_RTOL_BF16,
            "steps": "1-3",
            "tolerance_basis": "bf16: tests/test_ds_interop.py STOCK_RTOL",
            "by_reference": by_ref,
        }
    statics = {n: r["iteration_s"] for n, r in ok.items() if n.startswith("offloadctl fraction ")}
    tuned = ok.get(TUNED)
    if tuned and statics:
        best_name = min(statics, key=statics.get)
        its = tuned.get("iter_s_all") or []
        goal = (1 + TUNER_WITHIN) * statics[best_name]
        reached = next((i + 1 for i in range(2, len(its)) if statistics.median(its[i - 2 : i + 1]) <= goal), None)
        out["tuner"] = {
            "best_static": best_name,
            "best_static_iteration_s": statics[best_name],
            "within": TUNER_WITHIN,
            "reached_at_iteration": reached,
            "goal_iteration": 30,
            "met": reached is not None and reached <= 30,
            "iterations": len(its),
            "final_device_fraction": (tuned.get("knobs") or {}).get("device_fraction"),
            "unpin": tuned.get("unpin"),
        }
    elif tuned:
        out["tuner"] = {
            "note": "no static 'offloadctl fraction F' row finished: nothing to compare with",
            "unpin": tuned.get("unpin"),
        }
    return out


def _brief(r: dict) -> str:
    if "failed" in r:
        return "failed: " + r["failed"][-120:]
    return (
        f"iteration {r['iteration_s']:.3f} s, first {r['first_iteration_s']:.1f} s, init {r['init_s']:.1f} s, "
        f"wall {r.get('wall_s', 0):.0f} s, on {r['device']}"
    )


def write_report(out: str, size: str, workdir: str, table: dict, gpu: bool) -> dict:
    """``offloadctl report`` of the recorded stock row and offloadctl's, and the recording's overhead."""
    os.makedirs(out, exist_ok=True)
    ours = "offloadctl default" if "offloadctl default" in table else REPORTED_OURS[gpu]
    names = [RECORDED_STOCK, ours]
    base = os.path.join(out, f"report-{size}")
    cmd = [
        sys.executable,
        "-m",
        "offloadctl.cli",
        "report",
        *(_run_dir(workdir, n) for n in names),
        "--label",
        "stock ZeRO-3 CPU offload",
        "--label",
        "offloadctl",
        "--output",
        base + ".html",
        "--png",
        os.path.join(out, f"png-{size}"),
        "--json",
    ]  # one pass: HTML, PNGs and the numbers
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    p = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True)
    if p.returncode == 0:
        with open(base + ".json", "w") as f:
            f.write(p.stdout)
        console.print(f"report: {base}.html, PNGs in {out}/png-{size}, numbers in {base}.json")
    else:
        console.print(f"offloadctl report failed: {p.stderr[-1000:]}")
    plain, recorded = (table.get(n, {}).get("iteration_s") for n in ("stock ZeRO-3 CPU offload", RECORDED_STOCK))
    overhead = recorded / plain - 1 if plain and recorded else None
    if overhead is not None:
        console.print(f"recording overhead (stock, recorded over plain): {100 * overhead:+.1f}% of the iteration")
    return {"html": base + ".html", "rc": p.returncode, "recording_overhead": overhead}


def _write(path: str, report: dict) -> None:
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        json.dump(report, f, indent=1)
    os.replace(tmp, path)


def _print(size: str, table: dict, gpu_memory: dict) -> None:
    base = table.get("stock ZeRO-3 CPU offload", {}).get("iteration_s") or table.get(RECORDED_STOCK, {}).get("iteration_s")
    title = f"size {size}: medians of iterations 3..N"
    if gpu_memory.get("rows_bytes"):
        title += (
            f" on an {gpu_memory['gpu']}: rows allowed {gpu_memory['rows_bytes'] / 1e9:.1f} GB of its "
            f"{gpu_memory['gpu_total_bytes'] / 1e9:.1f} GB"
            + (
                f" (an {gpu_memory['as_gpu']}'s; {gpu_memory['held_bytes'] / 1e9:.1f} GB held by a ballast)"
                if gpu_memory.get("applied")
                else ""
            )
        )
        if gpu_memory.get("margin_bytes") is not None:
            title += f", offloadctl's device-tier margin {gpu_memory['margin_bytes'] / 1e9:.1f} GB"
    t = Table(title=title)
    for c in (
        "row",
        "iteration s",
        "vs CPU offload",
        "step s",
        "fwd+bwd s",
        "first s",
        "GPU peak GB",
        "host RSS GB",
        "losses 1-3",
        "predicted s",
        "device",
    ):
        t.add_column(c)
    for name, r in table.items():
        if "failed" in r or "skipped" in r:
            what = "failed: " + r["failed"][-80:] if "failed" in r else "skipped: " + r["skipped"][-80:]
            t.add_row(name, what, *[""] * 9)
            continue
        pred = r.get("predicted_iteration_s")
        t.add_row(
            name,
            f"{r['iteration_s']:.3f}",
            f"{base / r['iteration_s']:.2f}x" if base else "-",
            f"{r['step_s']:.3f}",
            f"{r['fwd_bwd_s']:.3f}",
            f"{r['first_iteration_s']:.2f}",
            f"{r['gpu_peak_reserved_bytes'] / 1e9:.1f}",
            f"{r['host_peak_rss_bytes'] / 1e9:.1f}",
            " ".join(f"{x:.4f}" for x in r["losses_1_3"]),
            f"{pred:.3f}" if pred else "-",
            r["device"],
        )
    Console(width=200).print(t)


def _machine() -> dict:
    import platform

    import psutil
    import torch

    out = {
        "cpu": platform.processor() or platform.machine(),
        "cores": psutil.cpu_count(),
        "memory_bytes": psutil.virtual_memory().total,
        "torch": torch.__version__,
        "gpu": torch.cuda.get_device_name() if torch.cuda.is_available() else None,
        "gpu_total_bytes": torch.cuda.get_device_properties(0).total_memory if torch.cuda.is_available() else None,
    }
    try:
        out["nvidia_smi_L"] = subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True, timeout=20).stdout.strip()
    except (OSError, subprocess.TimeoutExpired):
        out["nvidia_smi_L"] = None
    return out


def _limits(profile: str | None) -> dict:
    if not profile:
        return {}
    from perf.profile_toml import load_profile

    p = load_profile(profile)
    out = {"cpu_adamw_params_per_s": p.host_kernel_params_per_s(), "host_memory_bytes_per_s": p.host.memory_bandwidth.value}
    if p.gpu is not None:
        out.update(
            h2d=p.gpu.h2d_bytes_per_s.value,
            d2h=p.gpu.d2h_bytes_per_s.value,
            duplex_h2d=p.gpu.duplex_h2d_bytes_per_s.value,
            duplex_d2h=p.gpu.duplex_d2h_bytes_per_s.value,
            gpu_adamw_params_per_s=p.gpu.adamw_params_per_s.value,
        )
    console.print("limits measured in this run: " + json.dumps({k: f"{v:.3g}" for k, v in out.items()}))
    return out


if __name__ == "__main__":
    raise SystemExit(main())
