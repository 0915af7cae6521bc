"""DeepSpeed's launcher, run with the engine in every rank: its command line and environment,
the process tree's life (signals, stop), and the shared memory DeepSpeed leaves in /dev/shm.

``offloadctl train`` parses, calls these and prints; the launch itself is decided here:

    deepspeed.launcher.runner [launcher options] integrations/bootstrap.py \\
        --offloadctl-config JSON script.py [script args]

Every rank runs the bootstrap (integrations/bootstrap.py), which installs the engine from the
rank's settings (``integrations.settings.RankSettings``, as JSON) and then runs the script with
the argv the launcher would have given it.
"""

from __future__ import annotations

import contextlib
import glob
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any

import psutil

from engine.errors import ConfigError
from integrations import bootstrap, rank_entry
from integrations.run_output import LauncherOutput
from integrations.settings import RankSettings

# DeepSpeed launcher options passed through: (flags, takes a value). Every option of DeepSpeed's
# own parser (deepspeed.launcher.runner.parse_args), no more: tests/test_launcher_options.py builds
# that parser and fails when the two differ, so a DeepSpeed release that adds one cannot go unseen.
LAUNCHER_OPTIONS = [
    (("--hostfile", "-H"), True),
    (("--include", "-i"), True),
    (("--exclude", "-e"), True),
    (("--num_nodes",), True),
    (("--num_gpus", "--num_accelerators"), True),
    (("--master_port",), True),
    (("--master_addr",), True),
    (("--node_rank",), True),
    (("--launcher",), True),
    (("--launcher_args",), True),
    (("--module",), False),
    (("--no_python",), False),
    (("--no_local_rank",), False),
    (("--no_ssh",), False),
    (("--no_ssh_check",), False),
    (("--force_multi",), False),
    (("--save_pid",), False),
    (("--enable_each_rank_log",), True),
    (("--autotuning",), True),
    (("--bind_cores_to_rank",), False),
    (("--bind_core_list",), True),
    (("--ssh_port",), True),
    (("--venv_script",), True),
    (("--log_level",), True),
    (("--quiet", "-q"), False),
]

DEFAULT_MASTER_PORT = "29500"
"""The DeepSpeed launcher's, when --master_port is not given."""

STOP_GRACE_S = 45.0
"""How long the ranks get to unwind after SIGTERM (DeepSpeed's launcher gives them 30 s)."""


def option_dest(flags: Sequence[str]) -> str:
    """The attribute a launcher option is parsed into: ``--num_gpus`` -> ``ds_num_gpus``."""
    return "ds_" + flags[0].lstrip("-")


def launcher_args(values: Mapping[str, object]) -> list[str]:
    """The launcher's own arguments from parsed ``values`` (by :func:`option_dest`; None or False:
    not given), each option by its first spelling."""
    out: list[str] = []
    for flags, takes_value in LAUNCHER_OPTIONS:
        v = values.get(option_dest(flags))
        if takes_value and v is not None:
            out += [flags[0], str(v)]
        elif not takes_value and v:
            out.append(flags[0])
    return out


def check_launcher_values(values: Mapping[str, object]) -> None:
    """The launcher options whose values DeepSpeed's launcher takes without a word and then
    misuses (a port out of range fails deep in a rank; 0 or fewer GPUs runs as 1): ConfigError
    in one line naming the option."""

    def whole(flag: str, lo: int, hi: int | None, what: str) -> None:
        v = values.get(option_dest((flag,)))
        if v is None:
            return
        try:
            n = int(str(v), 10)
        except ValueError:
            n = None
        if n is None or n < lo or (hi is not None and n > hi):
            raise ConfigError(f"{flag} must be {what}, got {v!r}")

    whole("--master_port", 1, 65535, "a TCP port, 1..65535")
    whole("--num_gpus", 1, None, "a whole number of 1 or more (leave it out for every GPU)")
    whole("--num_nodes", 1, None, "a whole number of 1 or more (leave it out for every node)")
    whole("--node_rank", 0, None, "a whole number of 0 or more")


def rendezvous_port(values: Mapping[str, object]) -> object:
    """The ``--master_port`` a launch of parsed ``values`` takes. Where every rank runs on this
    machine (no hostfile, no other master address), the port is checked here, before anything
    starts, because a port in use fails only in the ranks, after the launch, in a page of
    traceback ending in EADDRINUSE: without ``--master_port``, DeepSpeed's 29500 where it is
    free, else another free one (two runs on one machine); with one, ConfigError in one line
    where it is in use. Elsewhere (several nodes: the port is the master node's) the value as given."""
    given = values.get(option_dest(("--master_port",)))
    if not _local_launch(values):
        return given
    if given is not None:
        try:
            port = int(str(given), 10)
        except ValueError:
            return given  # check_launcher_values says what is wrong with it
        in_use = _port_in_use(port)
        if in_use:
            raise ConfigError(
                f"--master_port {port} {in_use} on this machine (another run, or another program): give "
                f"another port, or leave --master_port out and offloadctl picks a free one"
            )
        return given
    free = free_port()
    return None if free == DEFAULT_MASTER_PORT else free  # DeepSpeed's own default: as the command line was


def _local_launch(values: Mapping[str, object]) -> bool:
    """Whether DeepSpeed's launcher starts every rank on this machine and meets them here: no
    hostfile (given, or DeepSpeed's default /job/hostfile), nothing forcing a multi-node launch,
    no master address other than this machine's."""
    get = lambda flag: values.get(option_dest((flag,)))  # noqa: E731
    addr = get("--master_addr")
    return (
        get("--hostfile") is None
        and not os.path.isfile("/job/hostfile")
        and not get("--force_multi")
        and not get("--no_ssh")
        and get("--launcher") in (None, "pdsh", "torchrun", "accelerate")
        and (get("--launcher") in (None, "pdsh") or str(get("--num_nodes") or 1) == "1")
        and addr in (None, "localhost", "127.0.0.1", "::1")
    )


def free_port() -> str:
    """A rendezvous port nothing listens on here now: :data:`DEFAULT_MASTER_PORT` where it is free,
    else another, drawn at random (two launches at once differ); ConfigError where none is."""
    if not _port_in_use(int(DEFAULT_MASTER_PORT)):
        return DEFAULT_MASTER_PORT
    import random

    for port in random.sample(range(int(DEFAULT_MASTER_PORT) + 1, 30000), 499):
        if not _port_in_use(port):
            return str(port)
    raise ConfigError(f"no free rendezvous port in {DEFAULT_MASTER_PORT}..29999 on this machine: give --master_port")


def _port_in_use(port: int) -> str | None:
    """How the TCP port ``port`` cannot be listened on here ('is in use', ...), or None where it
    can: bound as torch's rendezvous store binds it (all addresses, SO_REUSEADDR: a connection of
    an earlier run still closing does not count)."""
    import errno
    import socket

    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind(("", port))
        except OSError as e:
            return "is in use" if e.errno == errno.EADDRINUSE else f"cannot be listened on ({e.strerror})"
    return None


def launch_command(launcher: Sequence[str], rank_settings: RankSettings, script: str, script_args: Sequence[str]) -> list[str]:
    """The command that starts DeepSpeed's launcher with the bootstrap in place of ``script``."""
    return [
        sys.executable,
        "-u",
        "-m",
        "deepspeed.launcher.runner",
        *launcher,
        os.path.abspath(bootstrap.__file__),
        bootstrap.CONFIG_FLAG,
        json.dumps(rank_settings.to_json()),
        os.path.abspath(script),
        *script_args,
    ]


def resolved_launch(command: Sequence[str], env: Mapping[str, str]) -> dict:
    """What DeepSpeed's launcher would start for ``command`` (:func:`launch_command`), worked out
    by DeepSpeed's own runner in this process with nothing started: the per-node launch
    (``deepspeed.launcher.launch``, locally or with ``--no_ssh``) or the pdsh, mpirun or srun
    command of ``--launcher``, each carrying the bootstrap in place of the script. For
    ``--dry-run``: ``{"command": [...]}``, or ``{"error": "..."}`` where DeepSpeed's runner refuses."""
    import io

    with contextlib.redirect_stdout(io.StringIO()):  # DeepSpeed logs to stdout as it imports: not into --json
        import deepspeed.launcher.multinode_runner as multinode
        import deepspeed.launcher.runner as runner

    seen: dict = {}

    class Started:  # in place of subprocess.Popen: records what would have been started
        returncode = 0

        def __init__(self, cmd, env=None, **kw) -> None:
            seen.setdefault("command", list(cmd))

        def wait(self, timeout=None):
            return 0

        def poll(self):
            return 0

        def send_signal(self, sig) -> None:
            pass

    class NothingRuns:  # the runner's subprocess module: nothing starts, probes succeed
        Popen, PIPE, DEVNULL, STDOUT, CalledProcessError = (
            Started,
            subprocess.PIPE,
            subprocess.DEVNULL,
            subprocess.STDOUT,
            subprocess.CalledProcessError,
        )

        @staticmethod
        def check_call(*a, **kw) -> int:
            return 0

        @staticmethod
        def check_output(*a, **kw) -> bytes:
            return b"127.0.0.1"

    argv = list(command)[list(command).index("deepspeed.launcher.runner") + 1 :]
    # MVAPICH's runner writes a hostfile as it builds its command: a dry run leaves none behind.
    scratch = getattr(multinode, "MVAPICH_TMP_HOSTFILE", None)
    scratch = scratch if scratch and not os.path.exists(scratch) else None
    runners: list[Any] = [  # DeepSpeed's runner classes (untyped)
        c
        for c in vars(multinode).values()
        if isinstance(c, type) and issubclass(c, multinode.MultiNodeRunner) and "backend_exists" in vars(c)
    ]
    saved = (runner.subprocess, {c: c.backend_exists for c in runners}, os.environ.copy())
    try:
        runner.subprocess = NothingRuns
        for c in runners:
            c.backend_exists = lambda self: True  # not installed here: the command all the same
        os.environ.update(env)
        with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
            runner.main(argv)
    except SystemExit:
        pass
    except Exception as e:  # noqa: BLE001 - DeepSpeed's own refusal, shown as it says it
        return {"error": f"{type(e).__name__}: {e}"}
    finally:
        if scratch and os.path.exists(scratch):
            os.unlink(scratch)
        runner.subprocess = saved[0]
        for c, f in saved[1].items():
            c.backend_exists = f
        os.environ.clear()
        os.environ.update(saved[2])
    return {"command": seen.get("command", [])}


def launch_env() -> dict[str, str]:
    """What the launch adds to the environment: this checkout on PYTHONPATH, so that every rank
    (on any node the launcher reaches) imports the same engine and bootstrap."""
    root = os.path.dirname(os.path.dirname(os.path.abspath(bootstrap.__file__)))
    return {
        "PYTHONPATH": os.pathsep.join(filter(None, [root, os.environ.get("PYTHONPATH")])),
        # Accelerate scripts take their DeepSpeed path only with this set, as `accelerate launch` does.
        "ACCELERATE_USE_DEEPSPEED": os.environ.get("ACCELERATE_USE_DEEPSPEED", "true"),
    }


def with_rank_settings(command: Sequence[str], rank_settings: RankSettings) -> list[str]:
    """``command`` with the ranks' settings replaced (e.g. once the tuner's socket is known)."""
    cmd = list(command)
    i = cmd.index(bootstrap.CONFIG_FLAG)
    cmd[i + 1] = json.dumps(rank_settings.to_json())
    return cmd


@dataclass(frozen=True, kw_only=True)
class Launch:
    """What ``offloadctl train`` starts, resolved: its one JSON form (:meth:`to_json`) is what
    ``train --dry-run --json`` prints."""

    command: tuple[str, ...]
    """DeepSpeed's launcher with the bootstrap in place of the script (:func:`launch_command`),
    ``settings`` as JSON in it."""
    env: Mapping[str, str]
    """What the launch adds to the environment (:func:`launch_env`)."""
    settings: RankSettings
    tuner: str
    """'auto' (the running daemon, else a private one), 'off', or a daemon's socket."""
    preview: Mapping | None = None
    """With ``--profile`` and ``--params``: what each rank would plan for that size; None without."""

    hooked: bool = False
    """The engine reaches the ranks through the environment (``integrations.launch_commands``:
    a launch run as given, or built for torchrun or Accelerate), not through the bootstrap in
    DeepSpeed's runner's command; the settings are then in ``env``."""
    launcher: str = "deepspeed"
    """Which launcher starts the ranks: 'deepspeed' (its runner), or the launch program."""

    @classmethod
    def of(
        cls,
        launcher_args: Sequence[str],
        settings: RankSettings,
        script: str,
        script_args: Sequence[str],
        *,
        tuner: str,
        preview: Mapping | None = None,
    ) -> "Launch":
        return cls(
            command=tuple(launch_command(launcher_args, settings, script, script_args)),
            env=launch_env(),
            settings=settings,
            tuner=tuner,
            preview=preview,
        )

    @classmethod
    def through_hook(
        cls,
        command: Sequence[str],
        settings: RankSettings,
        *,
        launcher: str,
        tuner: str,
        direct: bool = False,
        preview: Mapping | None = None,
    ) -> "Launch":
        """``command`` run as it is, with the engine carried to its ranks by the environment;
        ``direct``: the command's own interpreter is the one rank (``python script.py``)."""
        from integrations.launch_commands import hook_env

        env = hook_env(json.dumps(settings.to_json()), direct=direct)
        return cls(
            command=tuple(command), env=env, settings=settings, tuner=tuner, preview=preview, hooked=True, launcher=launcher
        )

    def with_tuner_socket(self, socket_path: str) -> "Launch":
        """The launch with the ranks pointed at ``socket_path``."""
        settings = self.settings.with_tuner_socket(socket_path)
        if self.hooked:
            return replace(self, env={**self.env, rank_entry.SETTINGS_ENV: json.dumps(settings.to_json())}, settings=settings)
        return replace(self, command=tuple(with_rank_settings(self.command, settings)), settings=settings)

    def to_json(self) -> dict:
        out = {
            "command": list(self.command),
            "env": dict(self.env),
            "settings": self.settings.to_json(),
            "tuner": self.tuner,
            "launcher": self.launcher,
        }
        if self.preview is not None:
            out["plan_preview"] = dict(self.preview)  # the key --json always had
        return out


# -- running it ---------------------------------------------------------------------------------


class _Interrupted(BaseException):
    def __init__(self, signum: int) -> None:
        super().__init__(signum)
        self.signum = signum


def _ignore_sigint() -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)


def run_launcher(
    command: Sequence[str], env: Mapping[str, str], *, master_port: str | None, output: LauncherOutput | None = None
) -> tuple[int, signal.Signals | None]:
    """Run the launch to its end: (exit status, None), or (128 + signal, the signal) when SIGINT,
    SIGTERM or SIGHUP stopped it, after every rank has unwound (or been killed). Either way this
    run's /dev/shm buffers are removed. With ``output``, the launcher's stdout and stderr go
    through it (DeepSpeed's lines to the run's log) until every process of the run is gone."""
    # The launcher stays in our process group, so killing the group kills the whole run. It
    # ignores SIGINT until DeepSpeed's per-node launcher sets its handler (no launcher
    # traceback); the ranks inherit the ignore and set their own (integrations.bootstrap): on
    # Ctrl-C each rank takes the SIGINT itself, records it, unwinds and removes its swap files,
    # and the per-node launcher's SIGTERM that follows finds it unwinding already.
    streams = output.child_fds() if output is not None else (None, None)
    try:
        proc = subprocess.Popen(list(command), env=dict(env), preexec_fn=_ignore_sigint, stdout=streams[0], stderr=streams[1])
    finally:
        if output is not None:
            output.started()

    def on_signal(signum, frame):
        raise _Interrupted(signum)

    handled = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)
    before = {s: signal.signal(s, on_signal) for s in handled}
    try:
        return proc.wait(), None
    except _Interrupted as e:
        for s in handled:
            signal.signal(s, signal.SIG_IGN)  # a second Ctrl-C must not cut the cleanup short
        _stop_run(proc, e.signum)
        return 128 + e.signum, signal.Signals(e.signum)
    finally:
        for s, h in before.items():
            signal.signal(s, h)
        if output is not None:
            output.close()
        remove_shm_buffers(master_port)


def _stop_run(proc: subprocess.Popen, signum: int = signal.SIGTERM) -> None:
    """Stop the launcher and every process under it: the ranks first, with the signal that
    stopped us (``signum``: they unwind on SIGINT, SIGTERM and SIGHUP alike, and record which,
    so a Ctrl-C is recorded as SIGINT, not as the SIGTERM DeepSpeed's launcher then sends), then
    SIGTERM to the launchers; wait until all are gone, SIGKILL what is left after ``STOP_GRACE_S``."""
    try:
        tree = psutil.Process(proc.pid).children(recursive=True) + [psutil.Process(proc.pid)]
    except psutil.NoSuchProcess:
        tree = []
    ranks = [p for p in tree if _is_rank(p)]
    for p in ranks + [p for p in reversed(tree) if p not in ranks]:  # ranks first: no launcher reports them failed first
        with contextlib.suppress(psutil.NoSuchProcess):
            p.send_signal(signum if p in ranks else signal.SIGTERM)
    _, alive = psutil.wait_procs(tree, timeout=STOP_GRACE_S)
    for p in alive:
        with contextlib.suppress(psutil.NoSuchProcess):
            p.kill()
    proc.wait()


def _is_rank(p) -> bool:
    """Whether process ``p`` is a rank: the script its interpreter runs is the bootstrap, or, in a
    launch through the rank hook, the hook's own test (``integrations.rank_entry.is_rank``) on
    the environment and command line ``p`` started with. DeepSpeed's per-node launcher names
    the bootstrap too, as its own argument (``-m deepspeed.launcher.launch ... bootstrap.py``):
    it is a launcher, and gets SIGTERM (its handler stops its ranks and logs it), not the run's
    signal, which as SIGHUP would end it before it could; so do torchrun and Accelerate."""
    try:
        argv = p.cmdline()
    except (psutil.Error, OSError):
        return False
    script = next((a for a in argv[1:] if not a.startswith("-")), None)  # python -u bootstrap.py ...
    if script is not None and os.path.abspath(script) == os.path.abspath(bootstrap.__file__):
        return True
    try:
        return rank_entry.is_rank(p.environ(), argv)
    except (psutil.Error, OSError):
        return False


# -- DeepSpeed's shared memory ------------------------------------------------------------------


def remove_shm_buffers(master_port: str | None) -> int:
    """Remove the shared-memory allreduce buffers that DeepSpeed's CPU comm op leaves in /dev/shm
    (64 MiB per rank, never unlinked by DeepSpeed 0.19), for this run's port. Returns the count."""
    port = master_port or DEFAULT_MASTER_PORT
    return _unlink_all(glob.glob(f"/dev/shm/deepspeed_allreduce_buffer_{os.getuid()}_*_{port}_*"))


SHM_STALE_AFTER_S = 30.0
"""A buffer younger than this is never stale: a starting run may be creating it."""


def remove_stale_shm_buffers() -> int:
    """Remove this user's DeepSpeed allreduce buffers in /dev/shm that no live process holds open
    or maps and that are older than :data:`SHM_STALE_AFTER_S`: left by runs killed before they
    could clean up (any port). Returns the count.

    A rank creates its buffer (open, then 64 MiB written, then mapped) while other runs start:
    a buffer removed in between leaves its peer rank waiting on it for ever. So each process's
    open files are read before its maps (a creator closes its descriptor only after mapping)."""
    now = time.time()
    mine = [
        f
        for f in glob.glob(f"/dev/shm/deepspeed_allreduce_buffer_{os.getuid()}_*")
        if _owned_and_older(f, now - SHM_STALE_AFTER_S)
    ]
    if not mine:
        return 0
    in_use: set[str] = set()
    for proc in glob.glob("/proc/[0-9]*"):
        try:  # gone, or another user's (theirs never hold our files): skipped
            for fd in os.listdir(f"{proc}/fd"):
                with contextlib.suppress(OSError):
                    in_use.add(os.readlink(f"{proc}/fd/{fd}"))
            with open(f"{proc}/maps") as f:
                in_use.update(line.split(None, 5)[5].strip() for line in f if "/dev/shm/deepspeed_allreduce" in line)
        except (OSError, IndexError):
            continue
    return _unlink_all(f for f in mine if f not in in_use)


def _owned_and_older(path: str, since: float) -> bool:
    try:
        st = os.stat(path)
    except OSError:
        return False  # gone already: nothing to remove
    return st.st_uid == os.getuid() and st.st_mtime <= since


def _unlink_all(paths) -> int:
    removed = 0
    for f in paths:
        with contextlib.suppress(OSError):
            os.unlink(f)
            removed += 1
    return removed
