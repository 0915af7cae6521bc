"""Per-rank recording of where each iteration's time, memory and bandwidth go (``offloadctl report``):
the spans, the files and their format.

``integrations/bootstrap.py`` starts a :class:`Recorder` in every rank, for offloadctl's engine
and for stock DeepSpeed (``offloadctl train --engine stock``) alike, and
``integrations/ds_patches.py`` hooks it into the DeepSpeed engine; it changes nothing in training.
Each forward, backward and step call is a span on ``time.perf_counter()``, with the kernel's byte
counters of the tier devices read at every span edge (/proc/diskstats, about 40 us), so each
phase gets the bytes it moved; inside the update, offloadctl's :class:`engine.telemetry.StepRecord`
goes in as it is (the recorder is one of the engine's step hooks, ``engine.hooks``), and stock
ZeRO-3's per-subgroup swap-in, optimizer step and swap-out are spans.
:class:`report.sampler.Sampler`'s thread adds samples at ``sample_hz`` (host RSS and CPU, tier
bytes, GPU memory and PCIe where CUDA and NVML exist).

Per rank, ``record-rank<R>.jsonl`` and ``samples-rank<R>.jsonl`` in the run directory, JSON lines
written as they happen, so a crashed run keeps everything up to its last full line.
docs/report.md ("What is recorded") describes every line and field, and what recording costs.
"""

from __future__ import annotations

import atexit
import dataclasses
import json
import math
import os
import socket
import sys
import threading
import time
from typing import Any, Callable

from engine.config import Knobs
from engine.errors import ConfigError
from engine.facts import EngineFacts
from engine.hooks import StepHook
from engine.record_files import private_opener

# Imported here, before bootstrap puts the user's script directory first on sys.path: a script
# beside a module named like ours (bench/tuner.py) must not shadow them when a rank attaches.
from engine.storage.blockdev import device_of
from engine.telemetry import StepRecord
from perf.plan import node_layout
from report.sampler import Sampler, stop_writing
from tuner.sensors import disk_bytes, process_io_bytes

RECORD_FORMAT = "offloadctl-record"
SAMPLES_FORMAT = "offloadctl-samples"
FORMAT_VERSION = 2
"""2: iterations carry ``samples`` and ``tokens``; the end's ``status`` is finished, interrupted
or error (1 wrote ok or error). Readers take both."""
ENGINES = ("offloadctl", "stock")
TIME_DIGITS = 6
"""Times and durations are written in seconds to the microsecond."""
MAX_SPANS = 4000
"""Spans kept per iteration (stock DeepSpeed has three per subgroup); past it only their sums."""


@dataclasses.dataclass(frozen=True, kw_only=True)
class RecorderConfig:
    """What ``offloadctl train`` asks every rank to record."""

    run_dir: str
    """Directory of the record files (the run directory)."""
    engine: str = "offloadctl"
    """'offloadctl' (the engine is installed) or 'stock' (DeepSpeed's own optimizer)."""
    sample_hz: float = 100.0
    """Sampled series per second; 0: no sampler thread (phases are still recorded). A sample
    costs 0.1 to 0.3 ms of the sampler thread's CPU (1 to 3% of a core at 100 Hz); 100 Hz resolves
    a 0.1 s update phase into ten steps."""
    max_rows: int = 360_000
    """Samples at ``sample_hz`` before the interval doubles (360,000: one hour at 100 Hz)."""

    def __post_init__(self) -> None:
        if self.engine not in ENGINES:
            raise ConfigError(f"--engine must be one of {', '.join(ENGINES)}, got {self.engine!r}")
        if not (isinstance(self.sample_hz, (int, float)) and math.isfinite(self.sample_hz) and 0 <= self.sample_hz <= 1000):
            raise ConfigError(f"--record-hz must be a number of samples per second in [0, 1000], got {self.sample_hz!r}")
        if not (isinstance(self.max_rows, int) and self.max_rows >= 1):
            raise ConfigError(f"RecorderConfig.max_rows must be a positive integer, got {self.max_rows!r}")

    def to_json(self) -> dict:
        return dataclasses.asdict(self)

    @classmethod
    def from_json(cls, d: dict) -> "RecorderConfig":
        """The config from :meth:`to_json`'s dict; a missing field takes its default, and the
        numbers are made the type their field declares (JSON may carry 100 for 100.0)."""
        numbers: dict[object, Callable[[Any], Any]] = {"float": float, "int": int}
        return cls(**{f.name: numbers.get(f.type, lambda v: v)(d[f.name]) for f in dataclasses.fields(cls) if f.name in d})


# -- each rank's side --------------------------------------------------------------------------


def start(config: RecorderConfig, *, script: str, rank: int) -> "Recorder":
    """This rank's recorder, current from now on: its record file opened, its end line written at
    exit with the signal or exception that ended the rank (the bootstrap, which catches the
    signal, sets :attr:`Recorder.stopped_by`); ``integrations.ds_patches`` attaches it to the engine."""
    global _CURRENT
    rec = _CURRENT = Recorder(config, rank=rank, script=script)
    atexit.register(rec.close)
    previous_hook = sys.excepthook

    def excepthook(kind, value, tb):
        rec.error = f"{kind.__name__}: {value}"
        previous_hook(kind, value, tb)

    sys.excepthook = excepthook
    return rec


_CURRENT: "Recorder | None" = None


def current() -> "Recorder | None":
    """This rank's recorder, when ``offloadctl train`` installed one."""
    return _CURRENT


class _LatestStep(StepHook):
    """The recorder's step hook on offloadctl's engine: the record of the engine's latest step,
    taken by the iteration that step ends."""

    def __init__(self) -> None:
        self.record: StepRecord | None = None

    def after_step(self, engine, record: StepRecord) -> None:
        self.record = record

    def take(self) -> StepRecord | None:
        record, self.record = self.record, None
        return record


class Recorder:
    """One rank's record: phase spans per iteration, and the sampler thread."""

    def __init__(self, config: RecorderConfig, *, rank: int, script: str = "") -> None:
        os.makedirs(config.run_dir, exist_ok=True)
        self.config, self.rank = config, rank
        self.error: str | None = None
        self.stopped_by: str | None = None
        """The signal that stopped the rank (SIGINT, SIGTERM, SIGHUP), when one did."""
        self._lock = threading.Lock()
        path = os.path.join(config.run_dir, f"record-rank{rank}.jsonl")  # 0600: it holds the script's argv
        self._file = open(path, "w", buffering=1, opener=private_opener)
        self._write(
            {
                "type": "header",
                "format": RECORD_FORMAT,
                "version": FORMAT_VERSION,
                "rank": rank,
                "world_size": int(os.environ.get("WORLD_SIZE", "1")),
                "engine": config.engine,
                "script": script,
                "host": socket.gethostname(),
                "pid": os.getpid(),
                "unix_time": time.time(),
                "clock": "perf_counter",
                "t0": time.perf_counter(),
                "sample_hz": config.sample_hz,
            }
        )
        self._engine = None
        self._cuda = None
        self._sampler: Sampler | None = None
        self._devices: list[str] = []
        self._last_own: tuple[int, int] | None = None
        self._depth = 0
        self._iteration = 0
        self._engine_step = _LatestStep()
        self._last_knobs: Knobs | None = None
        self._reset_iteration()
        self._cost_s = 0.0  # time spent in the hooks' own bookkeeping
        self._closed = False
        self.suspended = False

    @property
    def iterations(self) -> int:
        """Iterations written so far (one a signal cut short counts: its ``failed`` is true)."""
        return self._iteration

    def suspend(self, suspended: bool = True) -> None:
        """Stop (True) or restart (False) recording between two iterations: the hooks pass calls
        straight through and the sampler takes no samples. For measuring what recording costs,
        iteration by iteration in one process (bench/record_overhead.py). Iterations run while
        suspended are not recorded; the next recorded one starts where the last recorded ended."""
        self.suspended = suspended
        if self._sampler is not None:
            self._sampler.paused = suspended

    # -- hooks -------------------------------------------------------------------------------

    def attach(self, engine) -> None:
        """Write ``engine``'s init facts (a DeepSpeedEngine) and record from here on; the
        calls reach the recorder through ``integrations.ds_patches``'s hooks."""
        opt = getattr(engine, "optimizer", None)
        offload_engine = getattr(opt, "offload_engine", None)  # offloadctl's: what it says of itself is its describe()
        plan: EngineFacts | None = offload_engine.describe() if offload_engine is not None else None
        tiers = self._tiers(engine, plan)
        for t in tiers:
            try:
                info = device_of(t["path"])
                t["device"] = info.name if info.is_block else None
            except OSError:
                t["device"] = None
        devices = list(dict.fromkeys(t["device"] for t in tiers if t["device"]))
        params = [p for p in engine.module.parameters()]
        params_total = sum(int(getattr(p, "ds_numel", p.numel())) for p in params)
        world = int(os.environ.get("WORLD_SIZE", "1"))
        flat = getattr(opt, "fp16_partitioned_groups_flat_numel", None)
        params_rank = int(sum(flat)) if flat else -(-params_total // world)
        device = getattr(engine, "device", None)
        init = {
            "type": "init",
            "t": round(time.perf_counter(), TIME_DIGITS),
            "argv": sys.argv[1:],
            "params_total": params_total,
            "params_rank": params_rank,
            "local_world_size": node_layout(world)[0],
            "zero_stage": _call(engine, "zero_optimization_stage"),
            "optimizer": type(opt).__name__,
            "offload_optimizer": _offload(engine, "zero_offload_optimizer"),
            "offload_param": _offload(engine, "zero_offload_param"),
            "device": str(device) if device is not None else None,
            "tiers": tiers,
            "gradient_accumulation_steps": _call(engine, "gradient_accumulation_steps"),
            "command": launch_command(),
            "versions": versions(),
        }
        if offload_engine is not None and plan is not None:
            init["engine_plan"] = plan.to_dict()
            offload_engine.add_step_hook(self._engine_step)
        self._write(init)
        self._engine = engine
        self._devices = devices
        self._last_disk = self._disk()
        self._last_own = process_io_bytes() if devices else None
        self._cuda = device if device is not None and getattr(device, "type", None) == "cuda" else None

    def start_sampler(self) -> None:
        """Start the sampler thread (none at ``sample_hz`` 0), once the engine is attached."""
        if self.config.sample_hz > 0 and self._sampler is None:
            self._sampler = Sampler(
                os.path.join(self.config.run_dir, f"samples-rank{self.rank}.jsonl"),
                self.config.sample_hz,
                self._devices,
                self._cuda,
                self.config.max_rows,
                fmt=SAMPLES_FORMAT,
                version=FORMAT_VERSION,
            )
            self._sampler.start()

    @staticmethod
    def _tiers(engine, plan: EngineFacts | None) -> list[dict[str, Any]]:
        if plan is not None:  # offloadctl's engine: the paths it swaps to
            return [{"kind": kind, "path": path} for path, kind in plan.path_kinds.items()]
        tiers: list[dict[str, Any]] = []
        for getter in ("zero_offload_optimizer", "zero_offload_param"):
            off = _call(engine, getter)
            path = getattr(off, "nvme_path", None) if off is not None else None
            if path and str(getattr(off, "device", "")).endswith("nvme"):
                p = os.path.abspath(str(path))
                if p not in [t["path"] for t in tiers]:
                    tiers.append({"kind": "nvme", "path": p})
        return tiers

    def phase_starts(self, phase: str, args, kwargs) -> bool:
        """A call of ``phase`` (forward, backward, update) starts, with its arguments; False: not
        recorded (nested in another phase, whose span holds it, or recording suspended)."""
        if self._depth or self.suspended:
            return False
        if phase == "forward":
            self._count_inputs(args, kwargs)
        elif phase == "backward" and args:
            self._keep_loss(args[0])
        self._enter(phase)
        self._depth += 1
        return True

    def phase_ends(self, phase: str, boundary: bool, failed: bool) -> None:
        """The recorded call of ``phase`` returned (or raised: ``failed``); ``boundary``: it ended
        the iteration."""
        self._depth -= 1
        self._exit(phase, boundary, failed)

    def part_starts(self) -> float | None:
        """A part of the update starts (stock ZeRO-3's per-subgroup calls): its start time, or
        None when recording is suspended."""
        if self.suspended:
            return None
        c0 = time.perf_counter()
        self._account_io("update")  # what the step moved since the last edge
        t0 = time.perf_counter()
        self._cost_s += t0 - c0
        return t0

    def part_ends(self, part: str, t0: float) -> None:
        t1 = time.perf_counter()
        self._account_io(f"update.{part}")
        self._span(part, t0, t1)
        self._cost_s += time.perf_counter() - t1

    def _count_inputs(self, args, kwargs) -> None:
        """Add a forward call's samples (the batch dimension of its first integer tensor input:
        ``input_ids``, else the first positional one) and tokens (that tensor's elements)."""
        c0 = time.perf_counter()
        tensor = None
        for v in ([kwargs["input_ids"]] if "input_ids" in kwargs else []) + list(args) + list(kwargs.values()):
            if getattr(v, "dtype", None) is not None and getattr(v, "ndim", 0) >= 1 and callable(getattr(v, "numel", None)):
                if tensor is None:
                    tensor = v  # a float input (an image): samples only, unless an integer one follows
                if not v.dtype.is_floating_point and not v.dtype.is_complex and str(v.dtype) != "torch.bool":
                    tensor = v
                    break
        if tensor is not None:
            self._samples += int(tensor.shape[0])
            if not tensor.dtype.is_floating_point:
                self._tokens += int(tensor.numel())
        self._cost_s += time.perf_counter() - c0

    def _keep_loss(self, loss) -> None:
        """Keep a backward call's loss (a one-element tensor) for the iteration's line; read at
        the iteration's end, after the step, so that nothing waits on the device here."""
        if getattr(loss, "numel", None) is not None and callable(loss.numel) and loss.numel() == 1:
            self._losses.append(loss.detach())

    def _loss(self) -> float | None:
        """The mean of the iteration's micro-batch losses; None without one (or not finite)."""
        try:
            values = [float(x) for x in self._losses]
        except Exception:  # noqa: BLE001 - a loss we cannot read is no reason to stop training
            return None
        mean = sum(values) / len(values) if values else None
        return round(mean, 7) if mean is not None and math.isfinite(mean) else None

    def _reset_iteration(self) -> None:
        self._losses: list = []
        self._samples = 0
        self._tokens = 0
        self._spans: list[list] = []
        self._sums: dict[str, float] = {}
        self._counts: dict[str, int] = {}
        self._io: dict[str, dict[str, list[int]]] = {}
        self._io_self: dict[str, list[int]] = {}  # this process's own storage bytes, by the same edges
        self._t_enter = 0.0
        self._tuner_pending: list[dict] = []

    def _disk(self) -> dict[str, tuple[int, int]]:
        if not self._devices:
            return {}
        return disk_bytes(self._devices)

    def _account_io(self, phase: str) -> None:
        """The bytes the tier devices moved since the last edge, and of them this process's own
        (the rest is other processes' on the same devices), into ``phase``."""
        if not self._devices:
            return
        now = self._disk()
        acc = self._io.setdefault(phase, {})
        for dev, (r, w) in now.items():
            r0, w0 = self._last_disk.get(dev, (r, w))
            if r != r0 or w != w0:
                cur = acc.setdefault(dev, [0, 0])
                cur[0] += r - r0
                cur[1] += w - w0
        self._last_disk = now
        own = process_io_bytes()
        if own is not None and self._last_own is not None:
            cur = self._io_self.setdefault(phase, [0, 0])
            cur[0] += own[0] - self._last_own[0]
            cur[1] += own[1] - self._last_own[1]
        self._last_own = own

    def _enter(self, phase: str) -> None:
        t0 = time.perf_counter()
        self._account_io("outside")
        if phase == "update":
            client = getattr(getattr(self._engine, "optimizer", None), "tuner_client", None)
            if client is not None:
                try:
                    self._tuner_pending = client.pending_changes()
                except Exception:
                    self._tuner_pending = []
        t1 = time.perf_counter()
        self._cost_s += t1 - t0
        self._t_enter = t1

    def _exit(self, phase: str, boundary: bool, failed: bool) -> None:
        t_end = time.perf_counter()
        self._account_io(phase)
        self._span(phase, self._t_enter, t_end)
        if boundary:
            self._close_iteration(t_end, failed)
        self._cost_s += time.perf_counter() - t_end

    def _span(self, name: str, t0: float, t1: float) -> None:
        self._sums[name] = self._sums.get(name, 0.0) + (t1 - t0)
        self._counts[name] = self._counts.get(name, 0) + 1
        if len(self._spans) < MAX_SPANS:
            self._spans.append([name, round(t0, TIME_DIGITS), round(t1, TIME_DIGITS)])

    def _close_iteration(self, t_end: float, failed: bool) -> None:
        opt = getattr(self._engine, "optimizer", None)
        line = {
            "type": "iteration",
            "iteration": self._iteration,
            "t_end": round(t_end, TIME_DIGITS),
            "spans": self._spans,
            "spans_dropped": max(0, sum(self._counts.values()) - len(self._spans)),
            "sums": {k: round(v, TIME_DIGITS) for k, v in self._sums.items()},
            "counts": self._counts,
            "io": self._io,
            "io_self": self._io_self,
            "skipped": bool(getattr(opt, "overflow", False)),
            "failed": failed,
            "samples": self._samples,
            "tokens": self._tokens,
            "loss": self._loss(),
        }
        step = self._engine_step.take()
        if step is not None:
            line["engine"] = step.to_dict()
            if self._last_knobs is not None and step.knobs != self._last_knobs:
                line["tuner"] = self._tuner_reason(step.iteration)
            self._last_knobs = step.knobs
        line["recorder_s"] = round(self._cost_s, TIME_DIGITS)
        self._write(line)
        self._iteration += 1
        self._cost_s = 0.0
        self._reset_iteration()

    def _tuner_reason(self, engine_iteration: int) -> dict:
        """Why the knobs changed at the engine's step ``engine_iteration``: the tuner's change
        applied at that step, else unattributed."""
        due = [c for c in self._tuner_pending if c["apply_at"] <= engine_iteration]
        if due:
            c = due[-1]
            return {"seq": c["seq"], "reason": c["reason"], "apply_at": c["apply_at"]}
        return {"seq": None, "reason": "knobs changed (not by a tuner change seen here)", "apply_at": None}

    # -- lifecycle ---------------------------------------------------------------------------

    def _write(self, obj: dict) -> None:
        with self._lock:
            if not self._file.closed:
                try:
                    self._file.write(json.dumps(obj, separators=(",", ":")) + "\n")
                except OSError as e:  # a full or failing disk: recording is never a reason to stop training
                    stop_writing(self._file, e)

    def close(self) -> None:
        """Stop the sampler and write the ``end`` line. Idempotent (atexit calls it)."""
        if self._closed:
            return
        self._closed = True
        sampler = self._sampler
        if sampler is not None:
            sampler.stop()
        status = "error" if self.error else "interrupted" if self.stopped_by else "finished"
        end = {
            "type": "end",
            "t": round(time.perf_counter(), TIME_DIGITS),
            "status": status,
            "signal": self.stopped_by,
            "error": self.error,
            "iterations": self._iteration,
            "open_spans": len(self._spans),
        }
        if sampler is not None:
            end.update(
                sampler_rows=sampler.rows,
                sampler_busy_s=round(sampler.busy_s, TIME_DIGITS),
                sampler_interval_s=round(sampler.interval_s, TIME_DIGITS),
            )
        self._write(end)
        with self._lock:
            if not self._file.closed:
                try:
                    self._file.close()
                except OSError as e:
                    stop_writing(self._file, e)


LAUNCHER_NAMES = ("offloadctl", "offloadctl.cli", "cli.py")
"""How ``offloadctl train`` appears in its process's argv: the console script, ``python -m
offloadctl.cli``, or the module's file."""


def launch_command(pid: int | None = None, depth: int = 8) -> list[str] | None:
    """The ``offloadctl train ...`` command line that started this rank, as typed after the
    program's name (``["train", "--nvme", "/nvme", "train.py", ...]``), found among the rank's
    ancestor processes (the launcher, DeepSpeed's runner and ``launch`` come between); None where
    none is one (a rank started over ssh or MPI on another node, or not by ``offloadctl train``)."""
    pid = os.getppid() if pid is None else pid
    for _ in range(depth):
        if pid <= 1:
            return None
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                argv = [a.decode(errors="replace") for a in f.read().split(b"\0")[:-1]]
            with open(f"/proc/{pid}/stat", "rb") as f:
                ppid = int(f.read().rsplit(b")", 1)[1].split()[1])
        except (OSError, ValueError, IndexError):
            return None
        for k, a in enumerate(argv[:4]):
            name = os.path.basename(a)
            if (name in LAUNCHER_NAMES and (name != "cli.py" or "offloadctl" in a)) and argv[k + 1 : k + 2] == ["train"]:
                return argv[k + 1 :]
        pid = ppid
    return None


def versions() -> dict[str, str | None]:
    """The versions a run ran with: Python, torch, DeepSpeed (as imported), offloadctl."""
    from engine.version import VERSION

    def of(module: str) -> str | None:
        return getattr(sys.modules.get(module), "__version__", None)

    return {"offloadctl": VERSION, "python": sys.version.split()[0], "torch": of("torch"), "deepspeed": of("deepspeed")}


def _call(obj, name: str):
    fn = getattr(obj, name, None)
    try:
        return fn() if callable(fn) else None
    except Exception:
        return None


def _offload(engine, getter: str) -> dict | None:
    off = _call(engine, getter)
    if off is None:
        return None
    device = getattr(off, "device", None)
    device = getattr(device, "value", device)
    path = getattr(off, "nvme_path", None)
    return {"device": str(device) if device is not None else None, "nvme_path": str(path) if path else None}
