"""What the tier benchmarks share: the emulated tiers up and down, one run of a script under them
(its times and the engine's telemetry), and the O_DIRECT ceilings of a tier under its throttle.

Used by bench/vs_zero_infinity.py, bench/io_overlap.py and bench/zi_aio_sweep.py. The tiers are
those of bench/tiers.sh, at ``$OFFLOADCTL_TIERS_ROOT`` (default /mnt/offloadctl-tiers).

    python bench/_runs.py ceilings nvme=/mnt/t/nvme pfs=/mnt/t/pfs   # run under `tiers.sh run`: JSON
"""
from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
TIERS = os.path.join(HERE, "tiers.sh")


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
    p = subprocess.Popen([TIERS, "run", *cmd], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                         start_new_session=True, **kw)
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
    return ["-m", "offloadctl.cli", "train", "--num_gpus", "1", "--master_port", port, "--run-dir", d["run"], *opts,
            os.path.join(HERE, "ds_model.py"), *MODEL_ARGS, "--iters", iters, "--out", out]


class RunFailed(SystemExit):
    """A run exited non-zero (a SystemExit, so that a benchmark that does not catch it stops with the message)."""


def run_one(build, iters: str, *, telemetry_detail: bool = False) -> dict:
    """One run of ``build(dirs, out, iters)`` (python arguments) under the tiers, in fresh
    directories on each tier that is up; returns the script's times.json, with the engine's bytes per step from
    its telemetry when there is one (iterations 3 on). ``telemetry_detail`` adds, per path, the median
    bytes read and written per step, the read-ahead budget and the engine's own forward/backward time."""
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
    return out


# -- ceilings ----------------------------------------------------------------------------------------

_MIXED_SPLIT = re.compile(r"read ([0-9.e+-]+) B/s \+ write ([0-9.e+-]+) B/s")


def measure_ceilings(tier_dirs: dict[str, str], *, io_bytes: int = 1 << 30, io_seconds: float = 2.0,
                     concurrency: int = 8, block_bytes: int = 8 << 20) -> dict[str, dict]:
    """O_DIRECT read, write and concurrent read+write ceilings (bytes/s) of each tier, measured under
    the tiers' throttles by offloadctl's own probe (perf.probe.measure_path: the engine's I/O backend,
    ``concurrency`` requests of ``block_bytes`` in flight per direction, ``io_seconds`` per point)."""
    p = run_under_tiers([sys.executable, os.path.abspath(__file__), "ceilings", f"--io-bytes={io_bytes}",
                         f"--io-seconds={io_seconds}", f"--concurrency={concurrency}", f"--block-bytes={block_bytes}",
                         *(f"{k}={v}" for k, v in tier_dirs.items())], cwd=ROOT, env=dict(os.environ, PYTHONPATH=ROOT))
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
        prof = measure_path(path, "nvme", io_bytes=a.io_bytes, io_seconds=a.io_seconds, concurrencies=(a.concurrency,),
                            block_sizes=(a.block_bytes,))
        m = _MIXED_SPLIT.search(prof.mixed_bytes_per_s.how)
        out[name] = {"read": prof.read_bytes_per_s.value, "write": prof.write_bytes_per_s.value,
                     "mixed": prof.mixed_bytes_per_s.value,
                     "mixed_read": float(m.group(1)) if m else None, "mixed_write": float(m.group(2)) if m else None,
                     "backend": (re.search(r"\((\w+) backend\)", prof.read_bytes_per_s.how) or [None, None])[1],
                     "how": {"read": prof.read_bytes_per_s.how, "write": prof.write_bytes_per_s.how,
                             "mixed": prof.mixed_bytes_per_s.how}}
    print(json.dumps(out))
    return 0


if __name__ == "__main__":
    raise SystemExit(_ceilings_main(sys.argv[1:]))
