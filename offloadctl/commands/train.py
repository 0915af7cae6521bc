"""Run an unmodified DeepSpeed ZeRO-3 script with its optimizer state in tiers.

    offloadctl train [options] SCRIPT [SCRIPT ARGS]
    offloadctl train [options] --launcher torchrun|accelerate SCRIPT [ARGS]
    offloadctl train [options] torchrun|accelerate|srun|python ... (as given)

The script runs as the `deepspeed` launcher would run it, with the same launcher options;
everything after SCRIPT goes to the script untouched. With --launcher torchrun or accelerate,
that launcher's command is built from the same options (--num_gpus, --num_nodes, --node_rank,
--master_addr, --master_port, --launcher_args, in its spelling). A launch command whose
program is torchrun, accelerate, deepspeed, srun, mpirun, mpiexec, python, llamafactory-cli or
axolotl runs as given, with the engine in every rank it starts. The options below say where the
optimizer state lives (they override the ds_config's offload_optimizer; its nvme_path becomes
an NVMe tier when no --nvme is given). The terminal shows the script's output, offloadctl's
start line and summary; DeepSpeed's own log lines go to RUN_DIR/deepspeed.log (--verbose shows
them too).

examples:
  offloadctl train --nvme /local/nvme examples/train_gpt.py --steps 30
  offloadctl train --nvme /ssd torchrun --nproc_per_node 8 train.py
  offloadctl train accelerate launch --use_deepspeed --num_processes 8 t.py
  offloadctl train --num_gpus 8 --nvme /ssd0 --nvme /ssd1 --host-cache 8GB t.py
  offloadctl train --hostfile hosts --remote /lustre/me/state a.py --epochs 1
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.util
import json
import math
import os
import stat
import sys
import uuid

from engine.config import storage_paths
from engine.errors import ConfigError
from integrations import launch_commands as lc
from integrations import launcher
from integrations.run_dir import DefaultTaken, claim, default_run_dir, recorded_iterations
from integrations.run_output import LauncherOutput
from integrations.settings import RankSettings, ZeroEngineSettings
from offloadctl.commands.plan import parse_params
from offloadctl.commands.train_text import dry_run_output, ending_note, start_line, storage_notes, tuner_stopped_line
from offloadctl.options import add_size_epilog, add_size_option, knob_words, size_bytes
from report.recorder import ENGINES, RecorderConfig
from tuner.service import ensure_daemon, logfile_for, probe, run_view

# perf's model and profiles, the tuner's daemon and the summary (rich, report/) are imported
# where they are used: `offloadctl --help` and completion import every command.

PARSER_OPTIONS = {"usage": "offloadctl train [options] SCRIPT|LAUNCH-PROGRAM [ARGS]"}

# DeepSpeed's launcher options, as its own help puts them, shortened: (metavar, help) by first flag.
LAUNCHER_HELP = {
    "--hostfile": ("FILE", "hosts and their GPU slots (default /job/hostfile)"),
    "--include": ("HOSTS", "hosts and GPUs to use, e.g. worker-0:0,1@worker-1"),
    "--exclude": ("HOSTS", "hosts and GPUs to leave out, as --include"),
    "--num_nodes": ("N", "nodes to use"),
    "--num_gpus": ("N", "GPUs per node to use"),
    "--master_port": ("PORT", "rendezvous port (default 29500, or a free one where that is in use)"),
    "--master_addr": ("ADDR", "rendezvous address (default: the first host)"),
    "--node_rank": ("N", "this node's rank, with --no_ssh"),
    "--launcher": (
        "NAME",
        "torchrun or accelerate: build that launcher's command from these options; or "
        "DeepSpeed's multi-node launcher: pdsh (default), openmpi, mpich, impi, slurm, mvapich",
    ),
    "--launcher_args": ("ARGS", "more arguments for that launcher, in one quoted string"),
    "--module": (None, "SCRIPT is a module, run as python -m"),
    "--no_python": (None, "run SCRIPT itself, not with python"),
    "--no_local_rank": (None, "do not pass --local_rank to the script"),
    "--no_ssh": (None, "start this node's ranks only (run once per node, with --node_rank)"),
    "--no_ssh_check": (None, "skip the check that ssh reaches the other nodes"),
    "--force_multi": (None, "use the multi-node launcher even on one node"),
    "--save_pid": (None, "write the launcher's pid to /tmp/PID.deepspeed"),
    "--enable_each_rank_log": ("DIR", "each rank's output to its own file in DIR"),
    "--autotuning": ("tune|run", "DeepSpeed's autotuning"),
    "--bind_cores_to_rank": (None, "bind each rank to its own cores with numactl"),
    "--bind_core_list": ("CORES", "the cores for --bind_cores_to_rank, e.g. 0-7,16-23"),
    "--ssh_port": ("PORT", "ssh port for the multi-node launcher"),
    "--venv_script": ("FILE", "sourced on each node before the run, e.g. a venv's activate"),
    "--log_level": ("LEVEL", "the launcher's log level (its lines go to deepspeed.log)"),
    "--quiet": (None, "the same as --log_level error"),
}


def add_arguments(p: argparse.ArgumentParser) -> None:
    o = p.add_argument_group("where the state lives and how it moves")
    o.add_argument("--nvme", action="append", default=[], metavar="PATH", help="node-local NVMe directory (repeatable)")
    o.add_argument("--remote", action="append", default=[], metavar="PATH", help="parallel file system directory (repeatable)")
    add_size_option(
        o,
        "--host-cache",
        dest="host_cache",
        deprecated="--host-cache-gb",
        help="optimizer state kept in host memory, per rank, e.g. 64GB or 60GiB (default: 0 when paths are given, else all)",
    )
    add_size_option(
        o,
        "--host-memory",
        dest="host_memory",
        help="budget for all the engine holds in host memory, per rank: state, staging buffers, copies "
        "(default: half the memory available at start, shared by the node's ranks; docs/host-memory.md)",
    )
    add_size_option(
        o,
        "--read-ahead",
        dest="read_ahead",
        auto=True,
        help="host memory for reading the next step's state ahead during forward and backward, per rank; "
        "auto: what the paths read in one forward and backward (default auto; 0: none)",
    )
    o.add_argument(
        "--no-io-overlap",
        dest="io_overlap",
        action="store_false",
        help="each step waits for its writes and nothing is read ahead (default: writes drain during the "
        "next forward, reads start at the step's end)",
    )
    add_size_option(
        o,
        "--device-cache",
        dest="device_cache",
        deprecated="--device-cache-gb",
        auto=True,
        help="optimizer state kept on the GPU, per rank, e.g. 8GB; auto: what the GPU has free after the "
        "first forward/backward, less a safety margin (default auto)",
    )
    o.add_argument(
        "--device-fraction",
        default="auto",
        metavar="F|auto",
        help="share of the subgroups outside the GPU updated on the GPU (device lane), 0..1; auto: the "
        "plan's with --profile, else the one that balances measured CPU and PCIe rates (default auto)",
    )
    o.add_argument("--lane-device", choices=["cpu"], help=argparse.SUPPRESS)  # tests: the GPU path's bookkeeping on a CPU
    o.add_argument(
        "--bind-cores",
        choices=["auto", "on", "off"],
        default="auto",
        help="each rank's host lane on its own share of the cores (auto: with several ranks per node, "
        "unless --bind_cores_to_rank binds them)",
    )
    o.add_argument(
        "--host-heap",
        choices=["keep", "system"],
        default="keep",
        help="keep: each rank reuses the host memory it frees, instead of the C library handing it "
        "back and the kernel zeroing it again every iteration (it goes back after start-up and under "
        "memory pressure); system: the C library's default (default keep; --engine stock runs as "
        "DeepSpeed does)",
    )
    o.add_argument(
        "--run-dir",
        metavar="DIR",
        help="where the run's records, telemetry and logs go, private to you "
        "(default ./runs/<timestamp>, a new one for each run)",
    )
    o.add_argument(
        "--force",
        action="store_true",
        help="with --run-dir: replace the records of an earlier run there (a running run's are never)",
    )
    o.add_argument(
        "--io-backend",
        choices=["auto", "aio", "posix"],
        default="auto",
        help="the engine's I/O backend: aio (DeepSpeed's async_io op), posix (a thread pool), or auto: "
        "aio where it is built (default auto)",
    )
    o.add_argument(
        "--host-adam",
        choices=["auto", "fastest", "torch", "deepspeed"],
        default="auto",
        help="the host lane's AdamW kernel: deepspeed (stock's cpu_adam: losses equal to stock's), torch "
        "(torch's fused AdamW), fastest (the faster lane here, measured once), or auto: fastest beside a "
        "GPU lane, else deepspeed where its op is built (default auto)",
    )
    o.add_argument(
        "--profile",
        metavar="NAME|PATH",
        help="hardware profile (offloadctl profile save): start from the "
        "performance model's best plan (default: a quick probe of the paths and default knobs)",
    )
    o.add_argument(
        "--tuner",
        default="auto",
        metavar="auto|off|SOCKET",
        help="auto: use the running tuner daemon, or start a private one for this run (default); "
        "off: keep the starting plan; SOCKET: the daemon at this socket",
    )
    o.add_argument(
        "--prefetch-depth",
        type=int,
        metavar="N",
        help="subgroups read ahead (default 2, or the plan's); given, the tuner never moves it",
    )
    o.add_argument(
        "--node-lock",
        action="store_true",
        default=None,
        help="one rank at a time per storage device on a node, so ranks do not interleave their I/O; "
        "given, the tuner never moves it",
    )
    o.add_argument(
        "--params",
        metavar="N",
        help="with --dry-run and --profile: model size for the plan preview (7e9, 70M, 1.5B); the ranks plan for the real size",
    )
    o.add_argument(
        "--json-summary",
        metavar="FILE",
        help="at the end, write the summary's figures to FILE as JSON (how the run ended, iterations, "
        "median iteration time, throughput, shares, bottleneck, bytes per parameter, the tuner's changes)",
    )
    o.add_argument("--dry-run", action="store_true", help="print the launcher command, environment and plan, then exit")
    o.add_argument("--json", action="store_true", help="with --dry-run: print JSON")
    o.add_argument(
        "--verbose", action="store_true", help="show DeepSpeed's own log lines too (they always go to RUN_DIR/deepspeed.log)"
    )
    o.add_argument(
        "--engine",
        choices=ENGINES,
        default="offloadctl",
        help="offloadctl: the multi-tier engine (default); stock: DeepSpeed's own optimizer and "
        "offload, untouched, with only the recording on (to characterize a current setup and compare "
        "with offloadctl report)",
    )
    o.add_argument(
        "--record-hz",
        type=float,
        default=100.0,
        metavar="HZ",
        help="sampled series (GPU memory, PCIe, disk, RSS, CPU) per second; 0: phases only (default 100)",
    )
    o.add_argument(
        "--no-record", action="store_true", help="record nothing for offloadctl report (the engine's telemetry is still written)"
    )
    g = p.add_argument_group("DeepSpeed launcher options (passed to it)")
    for flags, takes_value in launcher.LAUNCHER_OPTIONS:
        metavar, text = LAUNCHER_HELP[flags[0]]
        if takes_value:
            g.add_argument(*flags, dest=launcher.option_dest(flags), metavar=metavar, help=text)
        else:
            g.add_argument(*flags, dest=launcher.option_dest(flags), action="store_true", help=text)
    p.add_argument(
        "script",
        metavar="SCRIPT",
        help="the DeepSpeed training script, or a launch program run as "
        "given: torchrun, accelerate, deepspeed, srun, mpirun, mpiexec, python, llamafactory-cli, axolotl",
    )
    p.add_argument(
        "script_args",
        nargs=argparse.REMAINDER,
        metavar="SCRIPT ARGS",
        help="arguments for the script (or the launch program), untouched",
    )
    add_size_epilog(p)


def build(args: argparse.Namespace) -> launcher.Launch:
    """The resolved launch (:class:`integrations.launcher.Launch`): command, environment additions,
    the ranks' settings (:class:`integrations.settings.RankSettings`, whose validation refuses
    options that conflict) and the tuner."""
    _check_inputs(args)
    tuner = "off" if args.engine == "stock" else tuner_target(args.tuner)
    settings = rank_settings(args, tuner_socket=None if tuner in ("auto", "off") else tuner)
    preview = None
    if settings.zero.profile and args.params:
        preview = preview_plan(settings.zero, parse_params(args.params))
    values = vars(args)
    program = lc.launch_program(args.script)
    if program is not None:  # a launch command, as given
        command = [lc.resolve_program(program, args.script), *args.script_args]
        return launcher.Launch.through_hook(
            command, settings, launcher=program, tuner=tuner, direct=program.startswith("python"), preview=preview
        )
    kind = getattr(args, launcher.option_dest(("--launcher",)), None)
    if kind in lc.BUILT:
        target = args.script if values.get("ds_module") else os.path.abspath(args.script)  # a module by its name
        command = lc.built_command(kind, values, target, args.script_args)
        return launcher.Launch.through_hook(command, settings, launcher=kind, tuner=tuner, preview=preview)
    if values.get("ds_module") or values.get("ds_no_python"):  # the ranks run SCRIPT itself: no bootstrap there
        command = [
            sys.executable,
            "-u",
            "-m",
            "deepspeed.launcher.runner",
            *launcher.launcher_args(values),
            args.script,
            *args.script_args,
        ]
        return launcher.Launch.through_hook(command, settings, launcher="deepspeed", tuner=tuner, preview=preview)
    return launcher.Launch.of(
        launcher.launcher_args(values), settings, args.script, args.script_args, tuner=tuner, preview=preview
    )


def _check_inputs(args: argparse.Namespace) -> None:
    """The script, the launcher's values, the summary's path and the ds_config, checked before
    anything slow: a typo fails at once."""
    values = vars(args)
    program = lc.launch_program(args.script)
    kind = values.get(launcher.option_dest(("--launcher",)))
    if program is not None:
        lc.refuse_deepspeed_options(values, f"{program} (a launch command run as given)")
        lc.resolve_program(program, args.script)
    else:
        lc.check_launcher_name(kind)
        if kind in lc.BUILT:
            lc.refuse_deepspeed_options(values, f"{kind} (--launcher {kind})", allowed=lc.BUILT_TAKES)
        _check_script(args)
    launcher.check_launcher_values(values)
    if args.json_summary:  # a path that cannot take the file: said now, not after the run
        where = os.path.dirname(os.path.abspath(args.json_summary))
        if os.path.isdir(args.json_summary) or not os.path.isdir(where) or not os.access(where, os.W_OK):
            raise ConfigError(
                f"--json-summary {args.json_summary}: "
                + (
                    "is a directory: give a file name"
                    if os.path.isdir(args.json_summary)
                    else f"cannot write there ({where} is not a writable directory)"
                )
            )
    if args.engine != "stock":  # a config the engine refuses: said now, not by every rank after the launch
        from integrations.ds_config_check import check_ds_config

        check_ds_config(args.script_args, paths_given=bool(args.nvme or args.remote))


def _check_script(args: argparse.Namespace) -> None:
    """The training script (a module with --module, an executable with --no_python)."""
    if getattr(args, "ds_module", False):
        sys.path.insert(0, os.getcwd())
        try:
            found = importlib.util.find_spec(args.script) is not None
        except (ImportError, ValueError):
            found = False
        finally:
            sys.path.remove(os.getcwd())
        if not found:
            raise ConfigError(
                f"module {args.script} not found from {os.getcwd()} (--module runs python -m "
                f"{args.script}): check the name, or give the script's path without --module"
            )
        return
    if os.path.isdir(args.script):
        raise ConfigError(f"training script {args.script} is a directory: give the script file inside it")
    if os.path.exists(args.script) and not os.path.isfile(args.script):
        from perf.profile_toml import file_kind

        raise ConfigError(f"training script {args.script} is {file_kind(args.script)}: give the script file")
    if not os.path.isfile(args.script):
        raise ConfigError(f"training script {args.script} does not exist: check the path")
    if getattr(args, "ds_no_python", False) and not os.access(args.script, os.X_OK):
        raise ConfigError(
            f"{args.script} is not executable, and --no_python runs it as a program: chmod +x it, "
            f"or leave --no_python out to run it with python"
        )


def rank_settings(args: argparse.Namespace, *, tuner_socket: str | None) -> RankSettings:
    """The ranks' settings from the options; a bad value is a ConfigError naming its option, and
    the settings refuse options that conflict (``--engine stock`` with the engine's) and storage
    paths the engine cannot use."""
    host_cache, host_memory = size_bytes(args.host_cache), size_bytes(args.host_memory)
    read_ahead, device_cache = size_bytes(args.read_ahead, auto=True), size_bytes(args.device_cache, auto=True)
    device_fraction = _auto_or_number("--device-fraction", args.device_fraction, 0.0, 1.0, "a number in [0, 1]")
    run_dir = os.path.abspath(args.run_dir) if args.run_dir else default_run_dir()
    if os.path.exists(run_dir) and not os.path.isdir(run_dir):
        raise ConfigError(f"--run-dir {args.run_dir} is a file: give a directory (it is created if missing)")
    pins = {
        k: v
        for k, v in (("prefetch_depth", args.prefetch_depth), ("node_lock", args.node_lock), ("device_fraction", device_fraction))
        if v is not None
    }
    # --engine stock: RankSettings refuses a profile or a path given, so neither is looked at first.
    stock = args.engine == "stock"
    try:
        zero = ZeroEngineSettings(
            nvme_paths=tuple(os.path.abspath(p) for p in args.nvme),
            remote_paths=tuple(os.path.abspath(p) for p in args.remote),
            host_cache_bytes=host_cache,
            host_memory_bytes=host_memory,
            read_ahead_bytes=read_ahead,
            overlap_io=args.io_overlap,
            run_dir=run_dir,
            device_cache_bytes=device_cache,
            auto_device_fraction=device_fraction is None,
            lane_device=args.lane_device,
            io_backend=args.io_backend,
            host_adam=args.host_adam,
            pins=pins,
            profile=args.profile if stock else _checked_profile(args.profile),
            tuner_socket=tuner_socket,
            run_id=f"{os.path.basename(run_dir)}-{uuid.uuid4().hex[:8]}",
        )
    except ConfigError as e:  # a pin no knob takes, in the words the user typed
        raise ConfigError(knob_words(str(e), {n: "--" + n.replace("_", "-") for n in pins})) from None
    if not stock:
        zero.check_storage_paths()
    # DeepSpeed's launcher binds with numactl when asked: then ours would only narrow it again.
    ds_binds = getattr(args, launcher.option_dest(("--bind_cores_to_rank",)), False)
    record = None if args.no_record else RecorderConfig(run_dir=run_dir, engine=args.engine, sample_hz=args.record_hz)
    return RankSettings(
        zero=zero,
        bind_cores="off" if args.bind_cores == "auto" and ds_binds else args.bind_cores,
        host_heap=args.host_heap,
        engine=args.engine,
        recorder=record,
        verbose=args.verbose,
    )


def _checked_profile(name: str | None) -> str | None:
    """The path of profile ``name``, loaded once here: a malformed profile fails now, not in every rank."""
    if not name:
        return None
    from perf.profile_toml import load_profile, resolve_profile

    profile = resolve_profile(name)
    load_profile(profile)
    return profile


def _auto_or_number(flag: str, value: str, lo: float, hi: float, what: str) -> float | None:
    """None for 'auto', else ``value`` as a finite number in [lo, hi]."""
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
    if value in ("auto", "off"):
        return value
    path = os.path.abspath(value)
    if not os.path.exists(path):
        raise ConfigError(
            f"--tuner {value}: no socket there; start the daemon (offloadctl tuner start --socket {value}), or use --tuner auto"
        )
    if not stat.S_ISSOCK(os.stat(path).st_mode):
        raise ConfigError(
            f"--tuner {value} is not a socket: give the daemon's socket (offloadctl tuner status shows "
            f"it), or use --tuner auto or off"
        )
    return path


def preview_plan(settings, params: int) -> dict:
    """What each rank would plan for a model of ``params`` parameters on one node, in the engine's
    default subgroups and the model's default weight size (the ranks plan for the real ones)."""
    from perf.layout import SUBGROUP_NUMEL
    from perf.model import Workload
    from perf.plan import plan_for_rank

    paths = storage_paths(settings.nvme_paths, settings.remote_paths)
    rp = plan_for_rank(
        settings.profile,
        params_total=params,
        world_size=1,
        subgroup_numel=SUBGROUP_NUMEL,
        paths=paths,
        weight_bytes=Workload.weight_bytes,
        host_cache_bytes=settings.host_cache_bytes,
        pins=settings.pins,
    )
    return {
        "host_cache_bytes": rp.host_cache_bytes,
        "knobs": rp.knobs.to_dict(),
        "predicted_update_s": rp.predicted_update_s,
        "summary": rp.summary,
    }


def run(args: argparse.Namespace) -> int:
    if not args.dry_run and lc.launch_program(args.script) is None:  # a port in use: refused, or a free one taken
        _check_inputs(args)
        args.ds_master_port = launcher.rendezvous_port(vars(args))
    launch = build(args)
    for note in storage_notes(args):
        print(note, file=sys.stderr)
    if args.dry_run:
        # What DeepSpeed's launcher will start from that command, by its own runner (nothing runs).
        resolved = launcher.resolved_launch(launch.command, launch.env) if "deepspeed.launcher.runner" in launch.command else None
        print(dry_run_output(args, launch, resolved))
        return 0
    launch, claimed = _claim_run_dir(args, launch)
    try:
        return _run(args, launch)
    finally:
        claimed.release()


def _claim_run_dir(args: argparse.Namespace, launch: launcher.Launch):
    """The launch and its run dir, taken for this run (``integrations.run_dir.claim``); the
    default is chosen again where another launch took it first."""
    for _ in range(100):
        assert launch.settings.run_dir is not None  # build() gives every launch one
        try:
            claimed = claim(launch.settings.run_dir, flag="--run-dir", force=args.force, default=not args.run_dir)
        except DefaultTaken:
            launch = build(args)
            continue
        if claimed.note:  # a run dir open to others: its records are private all the same
            print(claimed.note, file=sys.stderr)
        return launch, claimed
    raise RuntimeError("no free default run dir after 100 tries")


def _run(args: argparse.Namespace, launch: launcher.Launch) -> int:
    from offloadctl.summary import (
        print_run_summary,
        run_summary_figures,
        tuner_lines,
    )  # not at the top: report.render only for a run that ran

    run_dir = launch.settings.run_dir
    assert run_dir is not None  # build() gives every launch one
    launcher.remove_stale_shm_buffers()  # what killed runs left behind
    stop_tuner = None
    if launch.tuner == "auto":
        socket_path, stop_tuner = ensure_daemon(run_dir=run_dir, run_id=launch.settings.zero.run_id)
        launch = launch.with_tuner_socket(socket_path)
    settings = launch.settings
    print(start_line(args, settings, launch.tuner, launch), file=sys.stderr, flush=True)  # the ranks take seconds to speak
    try:
        output = LauncherOutput(run_dir, verbose=args.verbose)
        port = lc.port_of(launch.command) if launch.hooked else args.ds_master_port
        rc, stopped_by = launcher.run_launcher(
            list(launch.command), dict(os.environ, **launch.env), master_port=port, output=output
        )
        note = ending_note(rc, stopped_by, output, verbose=args.verbose)
        if note:
            print(note, file=sys.stderr)
        ended = rc == 0 or stopped_by is not None
        if ended:  # how fast and why: first, before any pointer
            print_run_summary(run_dir, rank=0)
        tuner_socket, view = settings.zero.tuner_socket, None
        if tuner_socket and ended:
            assert settings.zero.run_id is not None  # rank_settings gives every run one
            view = run_view(tuner_socket, settings.zero.run_id)
            if view:
                print("\n".join(tuner_lines(view)))
            else:
                if probe(tuner_socket, timeout_s=1.0) is None:
                    print(tuner_stopped_line(tuner_socket, logfile_for(tuner_socket)))
        recorded = bool(settings.recorder) and recorded_iterations(run_dir)
        if recorded:  # nothing to report: no pointer to a refusal
            print(f"recorded: offloadctl report {run_dir}")
        if args.json_summary:
            figures = run_summary_figures(
                run_dir, rank=0, exit_status=rc, tuner_view=view, stopped_by=stopped_by.name if stopped_by is not None else None
            )
            _write_json(args.json_summary, figures)
        return rc
    finally:
        if stop_tuner is not None:
            stop_tuner()


def _write_json(path: str, obj: dict) -> None:
    """``obj`` as JSON at ``path``, whole or not at all (a reader never sees half a file); a
    path that cannot be written is one warning line: the run is over, and its records stand."""
    tmp = f"{path}.{os.getpid()}.tmp"
    try:
        with open(tmp, "w") as f:
            json.dump(obj, f, indent=1, allow_nan=False, default=float)
            f.write("\n")
        os.replace(tmp, path)
    except (OSError, ValueError) as e:
        print(f"offloadctl: warning: --json-summary {path} not written ({getattr(e, 'strerror', None) or e})", file=sys.stderr)
        with contextlib.suppress(OSError):
            os.unlink(tmp)
