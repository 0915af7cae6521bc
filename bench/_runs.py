"""What the tier benchmarks share: the emulated tiers up and down, one run of a script under them
(its times and the engine's telemetry), and the O_DIRECT ceilings of a tier under its throttle.

Used by bench/vs_zero_infinity.py, bench/io_overlap.py and bench/zi_aio_sweep.py. The tiers are
those of bench/tiers.sh, at ``$OFFLOADCTL_TIERS_ROOT`` (default /mnt/offloadctl-tiers).

The whole-run tuner benchmarks (bench/tuner_contention.py, bench/tuner_scenarios.py) share
:class:`TierRuns` (the tiers of ``../shared/tools/tiers`` or bench/tiers.sh, read from its
``status``; processes under them; files on them; all undone at the end) and the readers of what a
run left: the knob changes in its telemetry (:func:`applied_changes`) and in its tuner daemon's
log (:func:`tuner_changes`).

    python bench/_runs.py ceilings nvme=/mnt/t/nvme pfs=/mnt/t/pfs   # run under `tiers.sh run`: JSON
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
TIERS = os.path.join(HERE, "tiers.sh")
SHARED_TIERS = os.path.join(os.path.dirname(ROOT), "shared", "tools", "tiers")
SYSTEM_SOCKET = "/run/offloadctl/tuner.sock"
KILL_GRACE_S = 10.0
CHANGE = re.compile(r"iteration (\d+): change #(\d+) at iteration (\d+) \((\w+)\): (.*); knobs (\{.*\})$")
"""A knob change in a tuner daemon's log: decided at, its number, applied at, who, why, the knobs."""
DD_STATS = re.compile(r"(\d+) bytes .* copied, ([0-9.]+) s")


class Stop(BaseException):
    """SIGTERM, SIGINT or SIGHUP while a benchmark runs (:func:`on_signal`): it unwinds to the
    benchmark's cleanup (the current run's processes killed, its files removed, the JSON written)."""

    def __init__(self, signum: int) -> None:
        super().__init__(signum)
        self.signum = signum


def on_signal(signum, frame):
    raise Stop(signum)


def use_own_tiers(name: str) -> None:
    """Unless the environment says otherwise, bench/tiers.sh's tiers at /mnt/NAME (images in
    /var/tmp/NAME, cgroup NAME), apart from other emulations on the machine."""
    os.environ.setdefault("OFFLOADCTL_TIERS_ROOT", f"/mnt/{name}")
    os.environ.setdefault("OFFLOADCTL_TIERS_IMG", f"/var/tmp/{name}")
    os.environ.setdefault("OFFLOADCTL_TIERS_CGROUP", name)


def tiers_root() -> str:
    """Where bench/tiers.sh mounts the tiers (its ``OFFLOADCTL_TIERS_ROOT``)."""
    return os.environ.get("OFFLOADCTL_TIERS_ROOT", "/mnt/offloadctl-tiers")


def can_emulate() -> str | None:
    """Why the emulated tiers cannot be used here, or None when they can."""
    if os.geteuid() != 0:
        return "emulated tiers need root (loop devices, mounts, blkio cgroups)"
    if not os.path.isdir("/sys/fs/cgroup/blkio"):
        return "no blkio cgroup (v1) on this machine for the emulated tiers' throttles"
    return None


@contextlib.contextmanager
def tiers(*specs: str):
    """``tiers.sh up SPEC...`` for the block; ``tiers.sh down`` after it, also when it raises or the
    process gets SIGTERM (turned into SystemExit here, SIGINT is KeyboardInterrupt already)."""
    old = signal.getsignal(signal.SIGTERM)

    def term(signum, frame):
        raise SystemExit(128 + signum)

    signal.signal(signal.SIGTERM, term)
    try:
        subprocess.run([TIERS, "up", *specs], check=True, stdout=subprocess.DEVNULL)
        yield
    finally:
        try:
            subprocess.run([TIERS, "down"], check=False, stdout=subprocess.DEVNULL)
        finally:
            signal.signal(signal.SIGTERM, old)


def run_under_tiers(cmd: list[str], **kw) -> subprocess.CompletedProcess:
    """``tiers.sh run CMD`` in its own process group, captured; the group is killed if this process is
    interrupted, so no rank is left holding a tier's mount."""
    p = subprocess.Popen(
        [TIERS, "run", *cmd], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True, **kw
    )
    try:
        while True:
            # Short waits, so that the main thread runs its signal handlers soon even when a signal
            # lands on another thread (rich's refresh thread) while it waits on a quiet child.
            try:
                out, err = p.communicate(timeout=0.5)
                break
            except subprocess.TimeoutExpired:
                continue
    except BaseException:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(p.pid, signal.SIGKILL)
        p.wait()
        raise
    return subprocess.CompletedProcess(p.args, p.returncode, out, err)


MODEL_ARGS: list[str] = []
"""bench/ds_model.py's model options for every run (``--width``, ``--layers``, ``--sub-group-size``;
empty: its 92M default of 9 layers of 3200 x 3200), set once by a benchmark's ``--model``."""


def train_cmd(d: dict, out: str, iters: str, opts: list[str], port: str) -> list[str]:
    """Python arguments of bench/ds_model.py under ``offloadctl train OPTS`` (one rank, run dir d["run"])."""
    return [
        "-m",
        "offloadctl.cli",
        "train",
        "--num_gpus",
        "1",
        "--master_port",
        port,
        "--run-dir",
        d["run"],
        *opts,
        os.path.join(HERE, "ds_model.py"),
        *MODEL_ARGS,
        "--iters",
        iters,
        "--out",
        out,
    ]


class RunFailed(SystemExit):
    """A run exited non-zero (a SystemExit, so that a benchmark that does not catch it stops with the message)."""


def run_one(build, iters: str, *, telemetry_detail: bool = False) -> dict:
    """One run of ``build(dirs, out, iters)`` (python arguments) under the tiers, in fresh
    directories on each tier that is up; returns the script's times.json, with the engine's bytes per step from
    its telemetry when there is one (iterations 3 on). ``telemetry_detail`` adds, per path, the median
    bytes read and written per step, the read-ahead budget and the engine's own forward/backward time,
    and, from the run's record, each phase's median time and disk bytes (:func:`phase_io`)."""
    mnt = tiers_root()
    d = {t: tempfile.mkdtemp(dir=f"{mnt}/{t}") for t in ("nvme", "pfs") if os.path.ismount(f"{mnt}/{t}")}
    d["run"] = tempfile.mkdtemp()
    out = os.path.join(d["run"], "times.json")
    try:
        cmd = [sys.executable, *build(d, out, iters)]
        p = run_under_tiers(cmd, cwd=ROOT, env=dict(os.environ, PYTHONPATH=ROOT))
        if p.returncode != 0:
            raise RunFailed(f"run failed: {' '.join(cmd)}\n{p.stderr[-3000:]}")
        with open(out) as f:
            times = json.load(f)
        tel = os.path.join(d["run"], "telemetry-rank0.jsonl")
        if os.path.exists(tel):
            with open(tel) as f:
                recs = [json.loads(line) for line in f][2:]
            times["bytes_read"] = statistics.median(sum(r["bytes_read"].values()) for r in recs)
            times["bytes_written"] = statistics.median(sum(r["bytes_written"].values()) for r in recs)
            times["path_bytes_read"] = recs[-1]["path_bytes_read"]
            times["path_bytes_written"] = recs[-1]["path_bytes_written"]
            if telemetry_detail:
                times.update(telemetry_summary(recs, {k: v for k, v in d.items() if k != "run"}))
        record = os.path.join(d["run"], "record-rank0.jsonl")
        if telemetry_detail and os.path.exists(record):
            times["phases"] = phase_io(read_records(record))
        return times
    finally:
        for v in d.values():
            shutil.rmtree(v, ignore_errors=True)


def telemetry_summary(recs: list[dict], tier_dirs: dict[str, str]) -> dict:
    """Per tier (the name whose directory holds the path), the median over ``recs`` of the bytes read
    and written per step; the read-ahead budget (``read_ahead_bytes``, None where the records do not
    say) and the engine's forward/backward time (``fwd_bwd_s``)."""
    roots = {name: os.path.realpath(root) for name, root in tier_dirs.items()}

    def tier_of(path: str) -> str:
        real = os.path.realpath(path)
        return next((name for name, root in roots.items() if real == root or real.startswith(root + os.sep)), path)

    out: dict = {"tier_bytes_read": {}, "tier_bytes_written": {}}
    for key, dest in (("path_bytes_read", "tier_bytes_read"), ("path_bytes_written", "tier_bytes_written")):
        per_rec = []
        for r in recs:
            by_tier: dict[str, int] = {}
            for path, n in r.get(key, {}).items():
                by_tier[tier_of(path)] = by_tier.get(tier_of(path), 0) + n
            per_rec.append(by_tier)
        for t in sorted({t for b in per_rec for t in b}):
            out[dest][t] = statistics.median(b.get(t, 0) for b in per_rec)
    budgets = [r.get("read_ahead_bytes") for r in recs if r.get("read_ahead_bytes") is not None]
    out["read_ahead_bytes"] = statistics.median(budgets) if budgets else None
    fb = [r["fwd_bwd_s"] for r in recs if r.get("fwd_bwd_s") is not None]
    out["engine_fwd_bwd_s"] = statistics.median(fb) if fb else None
    for key in ("kernel_s", "read_wait_s", "write_wait_s"):
        out[key] = statistics.median(r[key] for r in recs) if recs else None
    pools = [r["host_bytes"]["staging"] + r["host_bytes"]["kept"] for r in recs if r.get("host_bytes")]
    out["staging_pool_bytes"] = statistics.median(pools) if pools else None  # working, read-ahead and kept buffers
    return out


def phase_io(records: list[dict], skip: int = 2) -> dict[str, dict[str, float]]:
    """Per phase of a run's record (forward, backward, update), over its iterations after the first
    ``skip``: the median seconds, and the median disk bytes read and written during the phase
    (the recorder's samples of every device the tiers are on, whoever moved them)."""
    its = [r for r in records if r.get("type") == "iteration" and not r.get("skipped")][skip:]
    out: dict[str, dict[str, float]] = {}
    for phase in ("forward", "backward", "update"):
        secs = [r["sums"].get(phase, 0.0) for r in its]
        reads = [sum(v[0] for v in r["io"].get(phase, {}).values()) for r in its]
        writes = [sum(v[1] for v in r["io"].get(phase, {}).values()) for r in its]
        if its:
            out[phase] = {"s": statistics.median(secs), "read": statistics.median(reads), "written": statistics.median(writes)}
    return out


# -- whole runs under the tiers tool (bench/tuner_contention.py, bench/tuner_scenarios.py) ----------


def default_tiers_tool() -> str:
    """``../shared/tools/tiers`` where the checkout has one, else bench/tiers.sh."""
    return SHARED_TIERS if os.path.exists(SHARED_TIERS) else TIERS


class BenchFailed(SystemExit):
    """One line for the user (exit 2): :meth:`TierRuns.fail` raises it."""


def fail(who: str, msg: str) -> None:
    """``who: msg`` in red on stderr, then exit 2 (a SystemExit: the benchmark's cleanup runs)."""
    from rich.console import Console

    Console(stderr=True).print(f"[red]{who}: {msg}[/red]", highlight=False, soft_wrap=True)
    raise BenchFailed(2)


def check_can_run(who: str, tool: str) -> None:
    """Root, the tiers tool, a blkio cgroup, dd and timeout, and no system tuner daemon (tuned runs
    would use it and its history): else one line and exit 2."""
    if os.geteuid() != 0:
        fail(who, "needs root (emulated tiers: loop devices, mounts, blkio cgroups)")
    if not os.path.isfile(tool) or not os.access(tool, os.X_OK):
        fail(who, f"tiers tool {tool} is missing or not executable (--tiers-tool)")
    if not os.path.isdir("/sys/fs/cgroup/blkio"):
        fail(who, "no blkio cgroup (v1) on this machine for the tiers' throttles")
    if not shutil.which("dd") or not shutil.which("timeout"):
        fail(who, "needs dd and timeout (coreutils)")
    if system_daemon_answers():
        fail(who, f"a system tuner daemon answers on {SYSTEM_SOCKET}: tuned runs would use it and its history; stop it first")


class TierRuns:
    """What a whole-run benchmark started and made under the tiers tool ``tool``: processes (each
    in its own group), files and directories on the tiers, the tiers themselves when it brought
    them up, the rates it changed. :meth:`cleanup` undoes them whatever happens."""

    def __init__(self, who: str, tool: str) -> None:
        self.who, self.tool = who, tool
        self.procs: dict[int, subprocess.Popen] = {}
        self.paths: list[str] = []
        self.tiers_brought_up = False
        self.mounts: dict[str, str] = {}
        self.sizes: dict[str, str] = {}
        self.rates_at_start: dict[str, dict[str, float]] = {}
        """Each tier's read and write limits (MB/s) as they were when this found them up (restored at
        the end: ``set_rates`` changed them); empty when this brought them up."""

    def fail(self, msg: str) -> None:
        fail(self.who, msg)

    # -- tiers and files ---------------------------------------------------------------------
    def status(self) -> dict[str, dict[str, float]]:
        """The tiers that are up (into :attr:`mounts`) and each one's limits, MB/s by direction
        ('read', 'write'): the tool's ``status``."""
        status = subprocess.run([self.tool, "status"], capture_output=True, text=True)
        if status.returncode != 0:
            self.fail(f"{self.tool} status failed: {(status.stderr or status.stdout).strip()}")
        limits, section, tier_of = {}, None, {}
        self.mounts = {}
        for line in status.stdout.splitlines():
            f = line.split()
            if line.endswith("limits:"):
                section = f[0]
            elif section and len(f) == 2:
                limits.setdefault(f[0], {})[section] = int(f[1]) / 1e6
            elif len(f) == 3 and f[2].startswith("/dev/"):
                self.mounts[f[0]] = f[1]
                rdev = os.stat(f[2]).st_rdev
                tier_of[f"{os.major(rdev)}:{os.minor(rdev)}"] = f[0]
        return {tier_of[dev]: v for dev, v in limits.items() if dev in tier_of}

    def tiers(self, spec: list[str], required: set[str]) -> dict:
        """Bring the tiers of ``spec`` (``NAME:SIZE_GB:READ:WRITE``) up when none is up (and down at
        the end); tiers that are up already are used as they are (their rates restored at the
        end), and must include ``required``. The tool, whether this brought them up, the mounts and
        the limits (MB/s)."""
        for s in spec:
            name, size = s.split(":")[:2]
            self.sizes[name] = size
        limits = self.status()
        if not self.mounts:
            up = subprocess.run([self.tool, "up", *spec], capture_output=True, text=True)
            self.tiers_brought_up = True  # down at the end, even if up failed half-way
            if up.returncode != 0:
                self.fail(f"{self.tool} up failed: {(up.stderr or up.stdout).strip()}")
            limits = self.status()
        else:
            self.rates_at_start = {t: dict(v) for t, v in limits.items()}
        if not required <= set(self.mounts):
            self.fail(
                f"the tiers that are up ({', '.join(self.mounts) or 'none'}) lack "
                f"{', '.join(sorted(required - set(self.mounts)))}; bring them down ({self.tool} down) or "
                f"up with them"
            )
        return {"tool": self.tool, "brought_up": self.tiers_brought_up, "mounts": dict(self.mounts), "limits_MBps": limits}

    def set_rates(self, tier: str, read_mbps: float, write_mbps: float) -> None:
        """The tier's throttle, mid-run: ``tool up`` again on a mounted tier rewrites only its limits."""
        if not os.path.ismount(self.mounts[tier]):
            self.fail(f"tier {tier} is no longer mounted at {self.mounts[tier]}")
        spec = f"{tier}:{self.sizes.get(tier, '1')}:{round(read_mbps)}:{round(write_mbps)}"
        r = subprocess.run([self.tool, "up", spec], capture_output=True, text=True)
        if r.returncode != 0:
            self.fail(f"{self.tool} up {spec} failed: {(r.stderr or r.stdout).strip()}")

    def write_file(self, tier: str, mib: int, prefix: str) -> str:
        path = os.path.join(self.mounts[tier], f"{prefix}-{os.getpid()}-{len(self.paths)}.bin")
        self.paths.append(path)
        subprocess.run(
            ["dd", "if=/dev/zero", f"of={path}", "bs=8M", f"count={max(1, mib // 8)}", "oflag=direct", "status=none"], check=True
        )
        return path

    def fresh_dir(self, tier: str, prefix: str) -> str:
        d = tempfile.mkdtemp(prefix=f"{prefix}-", dir=self.mounts[tier])
        self.paths.append(d)
        return d

    # -- processes ---------------------------------------------------------------------------
    def start(self, cmd: list[str], *, under_tiers: bool = True, **kw) -> subprocess.Popen:
        """``cmd`` in its own process group, under the tiers' throttles unless ``under_tiers`` is False."""
        p = subprocess.Popen([self.tool, "run", *cmd] if under_tiers else cmd, start_new_session=True, **kw)
        self.procs[p.pid] = p
        return p

    def kill(self, p: subprocess.Popen, sig: int = signal.SIGTERM) -> None:
        """``sig`` to ``p``'s group, SIGKILL :data:`KILL_GRACE_S` later (at once after a SIGKILL)."""
        deadline = time.monotonic() + (KILL_GRACE_S if sig == signal.SIGTERM else 0)
        for s in (sig, signal.SIGKILL):
            try:
                os.killpg(p.pid, s)
            except ProcessLookupError:
                break
            while time.monotonic() < deadline and alive(p.pid, p):
                time.sleep(0.2)
        p.wait()
        self.procs.pop(p.pid, None)

    def dd_rate(self, path: str, seconds: float, *, write: bool = False) -> float:
        """One O_DIRECT ``dd`` (8 MiB blocks) in the tiers' cgroup for ``seconds``: MB/s reading
        ``path``, or writing it (at most 1 GiB; the file is removed after)."""
        if write:
            cmd = ["dd", "if=/dev/zero", f"of={path}", "oflag=direct", "bs=8M", "count=128"]
            self.paths.append(path)
        else:
            cmd = ["dd", f"if={path}", "iflag=direct", "bs=8M", "of=/dev/null"]
        p = self.start(["timeout", "-s", "INT", str(seconds), *cmd], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
        _, err = p.communicate()
        self.procs.pop(p.pid, None)
        if write:
            with contextlib.suppress(OSError):
                os.unlink(path)
        m = DD_STATS.search(err or "")
        if not m:
            self.fail(f"no figures from dd {'writing' if write else 'reading'} {path}: {(err or '').strip()[-300:]}")
        return int(m.group(1)) / float(m.group(2)) / 1e6

    def cleanup(self) -> None:
        """Every process killed, every file and directory removed, the rates as they were found;
        the tiers down when this brought them up."""
        for p in list(self.procs.values()):
            self.kill(p)
        for path in reversed(self.paths):
            with contextlib.suppress(OSError):
                shutil.rmtree(path, ignore_errors=True) if os.path.isdir(path) else os.unlink(path)
        if self.tiers_brought_up:
            subprocess.run([self.tool, "down"], capture_output=True)
            return
        for tier, v in self.rates_at_start.items():
            if tier in self.mounts and os.path.ismount(self.mounts[tier]) and {"read", "write"} <= set(v):
                subprocess.run(
                    [self.tool, "up", f"{tier}:{self.sizes.get(tier, '1')}:{round(v['read'])}:{round(v['write'])}"],
                    capture_output=True,
                )


def alive(pgid: int, p: subprocess.Popen) -> bool:
    """Whether process group ``pgid`` (led by ``p``) has a process left."""
    p.poll()  # reap the leader, or the group never looks empty
    try:
        os.killpg(pgid, 0)
        return True
    except ProcessLookupError:
        return False


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def system_daemon_answers() -> bool:
    with socket.socket(socket.AF_UNIX) as s:
        return s.connect_ex(SYSTEM_SOCKET) == 0


def count_lines(path: str) -> int:
    try:
        with open(path, "rb") as f:
            return sum(1 for _ in f)
    except FileNotFoundError:
        return 0


def read_records(path: str) -> list[dict]:
    """A telemetry file's records (a last line cut short by a kill is left out)."""
    out = []
    try:
        with open(path) as f:
            for line in f:
                with contextlib.suppress(ValueError):
                    out.append(json.loads(line))
    except FileNotFoundError:
        pass
    return out


def applied_changes(records: list[dict]) -> list[dict]:
    """Each iteration whose knobs differ from the iteration before, with what changed."""
    out, prev = [], None
    for rec in records:
        k = rec.get("knobs") or {}
        if prev is not None and k != prev:
            out.append(
                {
                    "iteration": rec["iteration"],
                    "changed": {n: [prev.get(n), k.get(n)] for n in sorted(set(k) | set(prev)) if k.get(n) != prev.get(n)},
                }
            )
        prev = k
    return out


def tuner_changes(tuner_dir: str) -> list[dict]:
    """The daemon's knob changes for a run, from its log (``RUN_DIR/tuner/*.log``): decided at,
    applied at, who, why."""
    out = []
    for fn in sorted(os.listdir(tuner_dir)) if os.path.isdir(tuner_dir) else []:
        if fn.endswith(".log"):
            with open(os.path.join(tuner_dir, fn)) as f:
                for line in f:
                    m = CHANGE.search(line.rstrip("\n"))
                    if m:
                        out.append(
                            {
                                "iteration": int(m.group(1)),
                                "seq": int(m.group(2)),
                                "apply_at": int(m.group(3)),
                                "source": m.group(4),
                                "reason": m.group(5),
                            }
                        )
    return out


# -- ceilings ----------------------------------------------------------------------------------------

_MIXED_SPLIT = re.compile(r"read ([0-9.e+-]+) B/s \+ write ([0-9.e+-]+) B/s")


def measure_ceilings(
    tier_dirs: dict[str, str],
    *,
    io_bytes: int = 1 << 30,
    io_seconds: float = 2.0,
    concurrency: int = 8,
    block_bytes: int = 8 << 20,
) -> dict[str, dict]:
    """O_DIRECT read, write and concurrent read+write ceilings (bytes/s) of each tier, measured under
    the tiers' throttles by offloadctl's own probe (perf.probe.measure_path: the engine's I/O backend,
    ``concurrency`` requests of ``block_bytes`` in flight per direction, ``io_seconds`` per point)."""
    p = run_under_tiers(
        [
            sys.executable,
            os.path.abspath(__file__),
            "ceilings",
            f"--io-bytes={io_bytes}",
            f"--io-seconds={io_seconds}",
            f"--concurrency={concurrency}",
            f"--block-bytes={block_bytes}",
            *(f"{k}={v}" for k, v in tier_dirs.items()),
        ],
        cwd=ROOT,
        env=dict(os.environ, PYTHONPATH=ROOT),
    )
    if p.returncode != 0:
        raise SystemExit(f"measuring the ceilings failed:\n{p.stderr[-3000:]}")
    return json.loads(p.stdout.strip().splitlines()[-1])


def _ceilings_main(argv: list[str]) -> int:
    import argparse

    ap = argparse.ArgumentParser()
    ap.add_argument("cmd", choices=["ceilings"])
    ap.add_argument("--io-bytes", type=int, default=1 << 30)
    ap.add_argument("--io-seconds", type=float, default=2.0)
    ap.add_argument("--concurrency", type=int, default=8)
    ap.add_argument("--block-bytes", type=int, default=8 << 20)
    ap.add_argument("tiers", nargs="+", metavar="NAME=DIR")
    a = ap.parse_args(argv)
    sys.path.insert(0, ROOT)
    from perf.probe import measure_path

    out = {}
    for spec in a.tiers:
        name, _, path = spec.partition("=")
        prof = measure_path(
            path,
            "nvme",
            io_bytes=a.io_bytes,
            io_seconds=a.io_seconds,
            concurrencies=(a.concurrency,),
            block_sizes=(a.block_bytes,),
        )
        m = _MIXED_SPLIT.search(prof.mixed_bytes_per_s.how)
        out[name] = {
            "read": prof.read_bytes_per_s.value,
            "write": prof.write_bytes_per_s.value,
            "mixed": prof.mixed_bytes_per_s.value,
            "mixed_read": float(m.group(1)) if m else None,
            "mixed_write": float(m.group(2)) if m else None,
            "backend": (re.search(r"\((\w+) backend\)", prof.read_bytes_per_s.how) or [None, None])[1],
            "how": {"read": prof.read_bytes_per_s.how, "write": prof.write_bytes_per_s.how, "mixed": prof.mixed_bytes_per_s.how},
        }
    print(json.dumps(out))
    return 0


if __name__ == "__main__":
    raise SystemExit(_ceilings_main(sys.argv[1:]))
