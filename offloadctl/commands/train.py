"""Run an unmodified DeepSpeed ZeRO-3 script with the multi-tier engine in every rank.

    offloadctl train [launcher options] [offloadctl options] script.py [script args]

Launcher options are DeepSpeed's, with the same names and meaning; everything after the script
goes to the script untouched. Tier options override the ds_config's offload_optimizer; a
ds_config ``nvme_path`` becomes an NVMe tier when no --nvme is given.
"""
from __future__ import annotations

import argparse
import glob
import json
import math
import os
import shlex
import signal
import stat
import subprocess
import sys
import time
import uuid

from report import recorder

# DeepSpeed launcher options passed through: (flags, takes a value).
LAUNCHER_OPTIONS = [
    (("--num_gpus", "--num_accelerators"), True), (("--num_nodes",), True), (("--hostfile", "-H"), True),
    (("--include", "-i"), True), (("--exclude", "-e"), True), (("--master_addr",), True), (("--master_port",), True),
    (("--launcher",), True), (("--launcher_args",), True), (("--node_rank",), True), (("--bind_core_list",), True),
    (("--ssh_port",), True), (("--min_elastic_nodes",), True), (("--max_elastic_nodes",), True),
    (("--force_multi",), False), (("--no_local_rank",), False), (("--no_python",), False), (("--module",), False),
    (("--bind_cores_to_rank",), False), (("--enable_each_rank_log",), True), (("--save_pid",), False),
]


def add_arguments(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("DeepSpeed launcher options (passed through)")
    for flags, takes_value in LAUNCHER_OPTIONS:
        if takes_value:
            g.add_argument(*flags, dest="ds_" + flags[0].lstrip("-"), metavar="VALUE")
        else:
            g.add_argument(*flags, dest="ds_" + flags[0].lstrip("-"), action="store_true")
    o = p.add_argument_group("offloadctl options")
    o.add_argument("--nvme", action="append", default=[], metavar="PATH", help="node-local NVMe directory (repeatable)")
    o.add_argument("--remote", action="append", default=[], metavar="PATH", help="parallel file system directory (repeatable)")
    o.add_argument("--host-cache-gb", type=float, metavar="X", help="optimizer state kept in host memory per rank, GB "
                   "(default: 0 when paths are given, else all)")
    o.add_argument("--device-cache-gb", default="auto", metavar="X|auto",
                   help="optimizer state kept on each rank's GPU, GB; auto: what the GPU has free after the first "
                   "forward/backward, less a safety margin (default auto)")
    o.add_argument("--device-fraction", default="auto", metavar="F|auto",
                   help="share of the subgroups outside the GPU updated on the GPU (device lane), 0..1; auto: the "
                   "plan's with --profile, else the one that balances measured CPU and PCIe rates (default auto)")
    o.add_argument("--lane-device", choices=["cpu"], help=argparse.SUPPRESS)  # tests: the GPU path's bookkeeping on a CPU
    o.add_argument("--run-dir", metavar="DIR", help="per-rank telemetry JSONL (default ./runs/<timestamp>)")
    o.add_argument("--io-backend", choices=["auto", "aio", "posix"], default="auto")
    o.add_argument("--profile", metavar="NAME|PATH", help="hardware profile (offloadctl profile save): start from the "
                   "performance model's best plan (default: a quick probe of the paths and default knobs)")
    o.add_argument("--tuner", default="auto", metavar="auto|off|SOCKET",
                   help="auto: use the running tuner daemon, or start a private one for this run (default); "
                   "off: keep the starting plan; SOCKET: the daemon at this socket")
    o.add_argument("--prefetch-depth", type=int, metavar="N", help="subgroups read ahead (default 2, or the plan's)")
    o.add_argument("--node-lock", action="store_true", default=None,
                   help="one rank at a time per storage device on a node, so ranks do not interleave their I/O")
    o.add_argument("--params", metavar="N", help="with --dry-run and --profile: model size for the plan preview "
                   "(7e9, 70M, 1.5B); the ranks plan for the real size")
    o.add_argument("--dry-run", action="store_true", help="print the launcher command, environment and plan, then exit")
    o.add_argument("--json", action="store_true", help="with --dry-run: print JSON")
    recorder.add_train_arguments(o)
    p.add_argument("script", help="the DeepSpeed training script")
    p.add_argument("script_args", nargs=argparse.REMAINDER, help="arguments for the script, untouched")


def build(args: argparse.Namespace) -> dict:
    """The resolved launch: command, environment additions and engine settings."""
    from engine.config import Knobs
    from integrations.deepspeed_zero3 import ZeroEngineSettings
    from engine.errors import ConfigError
    from engine.storage.paths import check_usable

    if os.path.isdir(args.script):
        raise ConfigError(f"training script {args.script} is a directory: give the script file inside it")
    if not os.path.isfile(args.script):
        raise ConfigError(f"training script {args.script} does not exist: check the path")
    for path in args.nvme + args.remote:
        check_usable(os.path.abspath(path))
    if args.host_cache_gb is not None and not (math.isfinite(args.host_cache_gb) and 0 <= args.host_cache_gb < 1e9):
        raise ConfigError(f"--host-cache-gb must be a number of GB >= 0, got {args.host_cache_gb}")
    device_cache = _auto_or_number("--device-cache-gb", args.device_cache_gb, 0.0, 1e6, "a number of GB >= 0")
    device_fraction = _auto_or_number("--device-fraction", args.device_fraction, 0.0, 1.0, "a number in [0, 1]")
    run_dir = os.path.abspath(args.run_dir or os.path.join("runs", time.strftime("%Y%m%d-%H%M%S")))
    if os.path.exists(run_dir) and not os.path.isdir(run_dir):
        raise ConfigError(f"--run-dir {args.run_dir} is a file: give a directory (it is created if missing)")
    overrides = {k: v for k, v in (("prefetch_depth", args.prefetch_depth), ("node_lock", args.node_lock),
                                   ("device_fraction", device_fraction)) if v is not None}
    profile = None
    if args.profile:
        from perf.profile_toml import load_profile, resolve_profile

        profile = resolve_profile(args.profile)
        load_profile(profile)  # a malformed profile fails here, once, not in every rank
    tuner = "off" if args.engine == "stock" else tuner_target(args.tuner)
    settings = ZeroEngineSettings(
        nvme_paths=tuple(os.path.abspath(p) for p in args.nvme), remote_paths=tuple(os.path.abspath(p) for p in args.remote),
        host_cache_bytes=None if args.host_cache_gb is None else int(args.host_cache_gb * 1e9), run_dir=run_dir,
        device_cache_bytes=None if device_cache is None else int(device_cache * 1e9),
        auto_device_fraction=device_fraction is None, lane_device=args.lane_device,
        io_backend=args.io_backend, knobs=Knobs(**overrides), knob_overrides=overrides, profile=profile,
        tuner_socket=None if tuner in ("auto", "off") else tuner,
        run_id=f"{os.path.basename(run_dir)}-{uuid.uuid4().hex[:8]}")
    rank_settings = recorder.launch_settings(settings.to_json(), args, run_dir)
    launcher = []
    for flags, takes_value in LAUNCHER_OPTIONS:
        v = getattr(args, "ds_" + flags[0].lstrip("-"))
        if takes_value and v is not None:
            launcher += [flags[0], str(v)]
        elif not takes_value and v:
            launcher.append(flags[0])
    from integrations import bootstrap as bootstrap_module

    bootstrap = os.path.abspath(bootstrap_module.__file__)
    root = os.path.dirname(os.path.dirname(bootstrap))
    cmd = [sys.executable, "-u", "-m", "deepspeed.launcher.runner", *launcher, bootstrap,
           "--offloadctl-config", json.dumps(rank_settings), os.path.abspath(args.script), *args.script_args]
    env = {"PYTHONPATH": os.pathsep.join(filter(None, [root, os.environ.get("PYTHONPATH")])),
           # Accelerate scripts take their DeepSpeed path only with this set, as `accelerate launch` does.
           "ACCELERATE_USE_DEEPSPEED": os.environ.get("ACCELERATE_USE_DEEPSPEED", "true")}
    out = {"command": cmd, "env": env, "settings": rank_settings, "tuner": tuner}
    if profile and args.params:
        from offloadctl.commands.plan import parse_params

        out["plan_preview"] = preview_plan(settings, parse_params(args.params))
    return out


def _auto_or_number(flag: str, value: str, lo: float, hi: float, what: str) -> float | None:
    """None for 'auto', else ``value`` as a finite number in [lo, hi]."""
    from engine.errors import ConfigError

    if value == "auto":
        return None
    try:
        x = float(value)
    except ValueError:
        x = math.nan
    if not (math.isfinite(x) and lo <= x <= hi):
        raise ConfigError(f"{flag} must be 'auto' or {what}, got {value!r}")
    return x


def tuner_target(value: str) -> str:
    """'auto', 'off', or the absolute path of a daemon socket."""
    from engine.errors import ConfigError

    if value in ("auto", "off"):
        return value
    path = os.path.abspath(value)
    if not os.path.exists(path):
        raise ConfigError(f"--tuner {value}: no socket there; start the daemon (offloadctl tuner start --socket "
                          f"{value}), or use --tuner auto")
    if not stat.S_ISSOCK(os.stat(path).st_mode):
        raise ConfigError(f"--tuner {value} is not a socket: give the daemon's socket (offloadctl tuner status shows "
                          f"it), or use --tuner auto or off")
    return path


def preview_plan(settings, params: int) -> dict:
    """What each rank would plan for a model of ``params`` parameters on one node."""
    from engine.config import StoragePath
    from perf.plan import plan_for_rank

    paths = tuple(StoragePath(path=p, kind="nvme") for p in settings.nvme_paths) + tuple(
        StoragePath(path=p, kind="remote") for p in settings.remote_paths)
    rp = plan_for_rank(settings.profile, params_total=params, world_size=1, subgroup_numel=10_000_000, paths=paths,
                       weight_bytes=2, host_cache_bytes=settings.host_cache_bytes, knob_overrides=settings.knob_overrides)
    return {"host_cache_bytes": rp.host_cache_bytes, "knobs": rp.knobs.to_dict(),
            "predicted_update_s": rp.predicted_update_s, "summary": rp.summary}


def remove_stale_shm_buffers() -> int:
    """Remove this user's DeepSpeed allreduce buffers in /dev/shm that no live process maps: left
    by runs killed before they could clean up (any port). Returns the count."""
    mine = [f for f in glob.glob(f"/dev/shm/deepspeed_allreduce_buffer_{os.getuid()}_*") if _owned(f)]
    if not mine:
        return 0
    mapped: set[str] = set()
    for maps in glob.glob("/proc/[0-9]*/maps"):
        try:
            with open(maps) as f:
                mapped.update(line.split(None, 5)[5].strip() for line in f if "/dev/shm/deepspeed_allreduce" in line)
        except (OSError, IndexError):
            continue  # gone, or another user's: theirs never map our files
    return _unlink_all(f for f in mine if f not in mapped)


def _unlink_all(paths) -> int:
    removed = 0
    for f in paths:
        try:
            os.unlink(f)
            removed += 1
        except OSError:
            pass
    return removed


def _owned(path: str) -> bool:
    try:
        return os.stat(path).st_uid == os.getuid()
    except OSError:
        return False


def remove_shm_buffers(master_port: str | None) -> int:
    """Remove the shared-memory allreduce buffers that DeepSpeed's CPU comm op leaves in /dev/shm
    (64 MiB per rank, never unlinked by DeepSpeed 0.19), for this run's port. Returns the count."""
    port = master_port or "29500"  # the DeepSpeed launcher's default
    return _unlink_all(glob.glob(f"/dev/shm/deepspeed_allreduce_buffer_{os.getuid()}_*_{port}_*"))


def run(args: argparse.Namespace) -> int:
    plan = build(args)
    if args.dry_run:
        if args.json:
            print(json.dumps(plan, indent=2))
        else:
            print("command: " + shlex.join(plan["command"]))
            print("env:     " + " ".join(f"{k}={shlex.quote(v)}" for k, v in plan["env"].items()))
            print("plan:    " + json.dumps(plan["settings"]))
            print("tuner:   " + {"auto": "auto (the running daemon, else a private one for this run)",
                                 "off": "off (the starting plan is kept)"}.get(plan["tuner"], plan["tuner"]))
            if "plan_preview" in plan:
                print("preview: " + plan["plan_preview"]["summary"])
        return 0
    run_dir = plan["settings"]["run_dir"]
    os.makedirs(run_dir, exist_ok=True)
    remove_stale_shm_buffers()  # what killed runs left behind
    stop_tuner = None
    if plan["tuner"] == "auto":
        from tuner.service import ensure_daemon

        socket_path, stop_tuner = ensure_daemon(run_dir=run_dir)
        plan = with_tuner_socket(plan, socket_path)
    env = dict(os.environ, **plan["env"])
    try:
        rc = _launch(plan, env, args, run_dir)
        if plan["settings"].get("recorder"):
            print(f"recorded: offloadctl report {run_dir}")
        socket_path = plan["settings"].get("tuner_socket")
        if rc == 0 and socket_path:
            from tuner.service import run_verdict

            verdict = run_verdict(socket_path, plan["settings"]["run_id"])
            if verdict:
                print(f"tuner: {verdict}")
        return rc
    finally:
        if stop_tuner is not None:
            stop_tuner()


def _ignore_sigint() -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)


def _stop_run(proc: subprocess.Popen, signum: int) -> None:
    """Stop the launcher and every process under it: SIGTERM to each (after SIGINT, which they
    ignore, DeepSpeed's launcher has sent it already), wait until all are gone, SIGKILL what is
    left after ``STOP_GRACE_S``."""
    import psutil

    try:
        tree = psutil.Process(proc.pid).children(recursive=True) + [psutil.Process(proc.pid)]
    except psutil.NoSuchProcess:
        tree = []
    for p in reversed(tree):  # the ranks first, so that no launcher reports them as failed first
        try:
            p.send_signal(signal.SIGTERM)
        except psutil.NoSuchProcess:
            pass
    _, alive = psutil.wait_procs(tree, timeout=STOP_GRACE_S)
    for p in alive:
        try:
            p.kill()
        except psutil.NoSuchProcess:
            pass
    proc.wait()


def with_tuner_socket(plan: dict, socket_path: str) -> dict:
    """The launch with the ranks pointed at ``socket_path``."""
    settings = dict(plan["settings"], tuner_socket=socket_path)
    cmd = list(plan["command"])
    i = cmd.index("--offloadctl-config")
    cmd[i + 1] = json.dumps(settings)
    return dict(plan, command=cmd, settings=settings)


class _Interrupted(BaseException):
    def __init__(self, signum: int) -> None:
        super().__init__(signum)
        self.signum = signum


STOP_GRACE_S = 45.0
"""How long the ranks get to unwind after SIGTERM (DeepSpeed's launcher gives them 30 s)."""


def _launch(plan: dict, env: dict, args: argparse.Namespace, run_dir: str) -> int:
    # The launcher stays in our process group, so killing the group kills the whole run. It and
    # the ranks ignore SIGINT (inherited: the ranks are started before DeepSpeed's launcher sets
    # its handlers): on Ctrl-C, DeepSpeed's per-node launcher alone acts, sending the ranks
    # SIGTERM, on which each rank unwinds and removes its swap files; no launcher traceback.
    proc = subprocess.Popen(plan["command"], env=env, preexec_fn=_ignore_sigint)

    def on_signal(signum, frame):
        raise _Interrupted(signum)

    handled = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)
    before = {s: signal.signal(s, on_signal) for s in handled}
    try:
        rc = proc.wait()
    except _Interrupted as e:
        for s in handled:
            signal.signal(s, signal.SIG_IGN)  # a second Ctrl-C must not cut the cleanup short
        _stop_run(proc, e.signum)
        print(f"offloadctl: stopped by {signal.Signals(e.signum).name}: the ranks were stopped and their swap files "
              f"removed", file=sys.stderr)
        return 128 + e.signum
    finally:
        for s, h in before.items():
            signal.signal(s, h)
        remove_shm_buffers(args.ds_master_port)
    telemetry = os.path.join(run_dir, "telemetry-rank0.jsonl")
    if rc == 0 and os.path.exists(telemetry):
        from offloadctl.summary import load_records, print_summary

        print_summary(load_records(telemetry), title=f"update phase, rank 0 (telemetry in {run_dir})")
    return rc
