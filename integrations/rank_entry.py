"""The engine in every rank of a launch command run as given (``offloadctl train torchrun ...``,
``accelerate launch``, ``srun``, ``mpirun``, a tool that re-executes itself under torchrun).

``offloadctl train`` puts ``integrations/rank_hook`` first on the launch's PYTHONPATH and the
ranks' settings (``integrations.settings.RankSettings`` as JSON) in :data:`SETTINGS_ENV`. Every
Python interpreter the launch starts then runs the hook's ``sitecustomize``, which calls
:func:`arm`. In a rank, :func:`arm` takes over the interpreter before its main program starts:
it runs that program (a script, or ``-m`` module) through ``integrations.bootstrap.run_rank``,
as the DeepSpeed path's bootstrap runs the script, and then ends the interpreter with the
rank's status, after the interpreter's own exit work (threads joined, atexit handlers, the
engine's swap files removed).

A rank is an interpreter that a launcher numbered (``perf.plan.RANK_VARS``) and that is neither a
launcher itself (torchrun, ``accelerate launch``, DeepSpeed's runners: by the program it runs)
nor a process a rank started (a data-loader worker, a compile worker, a probe: by
:data:`ARMED_ENV`, which a rank sets for everything it starts). Under ``offloadctl train python
script.py`` the one interpreter is rank 0 of a world of one (``launch_commands.hook_env``).

Threads: torchrun sets ``OMP_NUM_THREADS=1`` for every rank when it starts several on a node
and the variable is unset; ``offloadctl train`` says in :data:`USER_OMP_ENV` whether the user
set it. Where the user did not, the rank's thread count is its core budget
(``integrations.cores``), whatever the launcher set.
"""

from __future__ import annotations

import contextlib
import json
import os
import sys

SETTINGS_ENV = "OFFLOADCTL_RANK_SETTINGS"
ARMED_ENV = "OFFLOADCTL_RANK_PID"
"""Set by a rank to its pid: a Python process it starts inherits it and is not a rank."""
USER_OMP_ENV = "OFFLOADCTL_USER_OMP_NUM_THREADS"
"""'1' where the user's environment set OMP_NUM_THREADS before the launch (then it stands)."""

LAUNCHER_PROGRAMS = frozenset({"torchrun", "accelerate", "deepspeed", "ds", "llamafactory-cli", "lmf", "axolotl"})
"""Entry points that start ranks (or re-execute under a launcher that does), by file name."""
LAUNCHER_MODULES = frozenset(
    {
        "torch.distributed.run",
        "torch.distributed.launch",
        "accelerate.commands.launch",
        "accelerate.commands.accelerate_cli",
        "deepspeed.launcher.runner",
        "deepspeed.launcher.launch",
        "llamafactory.cli",
        "axolotl.cli.main",
    }
)
"""The same, started as ``python -m``."""

# Interpreter options that take a value (``python -X dev -W error script.py``).
_OPTIONS_WITH_VALUE = frozenset({"-X", "-W", "--check-hash-based-pycs"})


def main_program(argv) -> tuple[str, str, list[str]] | None:
    """What an interpreter started with ``argv`` (``sys.orig_argv``) runs: ('script', path, args),
    ('module', name, args), or None (``-c``, a prompt, stdin)."""
    i = 1
    while i < len(argv):
        a = argv[i]
        if a == "--" or not a.startswith("-") or a == "-":
            if a == "--":
                i += 1
            if i >= len(argv) or argv[i] == "-":
                return None
            return "script", argv[i], list(argv[i + 1 :])
        if a in _OPTIONS_WITH_VALUE:
            i += 2
            continue
        if a.startswith("--"):
            i += 1
            continue
        # a cluster of one-letter options: -uB, -m mod, -mmod, -c cmd, -Xfoo, -Werror
        for j, ch in enumerate(a[1:], start=1):
            if ch in "mc":
                value = a[j + 1 :] or (argv[i + 1] if i + 1 < len(argv) else None)
                rest = argv[i + 1 :] if a[j + 1 :] else argv[i + 2 :]
                if ch == "c" or value is None:
                    return None
                return "module", value, list(rest)
            if ch in "XW":
                i += 0 if a[j + 1 :] else 1  # the value is the next argument
                break
        i += 1
    return None


def is_launcher(program: tuple[str, str, list[str]] | None) -> bool:
    if program is None:
        return False
    kind, name, _ = program
    if kind == "module":
        return name in LAUNCHER_MODULES
    return os.path.basename(name) in LAUNCHER_PROGRAMS


def is_rank(environ=None, argv=None) -> bool:
    """Whether this interpreter is one of the run's ranks (see the module's doc)."""
    environ = os.environ if environ is None else environ
    argv = sys.orig_argv if argv is None else argv
    if not environ.get(SETTINGS_ENV) or environ.get(ARMED_ENV):
        return False
    program = main_program(argv)
    if program is None or is_launcher(program):
        return False
    from perf.plan import launcher_rank

    return launcher_rank(environ) is not None


def users_threads(environ) -> int | None:
    """The OMP_NUM_THREADS the user set before the launch (:data:`USER_OMP_ENV`), which stands
    over a rank's share of the cores; None where the user set none, or nothing usable."""
    value = environ.get("OMP_NUM_THREADS", "")
    return int(value) if environ.get(USER_OMP_ENV) == "1" and value.isdigit() and int(value) > 0 else None


def launcher_threads(environ) -> None:
    """Drop a launcher's OMP_NUM_THREADS where the user set none (torchrun's 1 per rank): the
    rank's thread count is then its core budget (``integrations.cores.bind_rank_cores`` sets it
    where it binds; elsewhere the rank's share of its CPUs)."""
    if environ.get(USER_OMP_ENV) == "1" or "OMP_NUM_THREADS" not in environ:
        return
    from perf.plan import local_size

    cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    environ["OMP_NUM_THREADS"] = str(max(1, cpus // max(1, local_size(environ) or 1)))


def arm() -> None:
    """From the hook's sitecustomize: in a rank, run its program with the engine and end the
    interpreter with its status; anywhere else, nothing."""
    if not is_rank() or (program := main_program(sys.orig_argv)) is None:  # a rank has one
        return
    os.environ[ARMED_ENV] = str(os.getpid())
    kind, name, args = program
    launcher_threads(os.environ)
    from integrations import bootstrap
    from integrations.settings import RankSettings

    status = 1
    try:
        settings = RankSettings.from_json(json.loads(os.environ[SETTINGS_ENV]))
        status = bootstrap.finish(lambda: bootstrap.run_rank(settings, name, args, module=kind == "module"))
    except SystemExit as e:  # the program's own exit, with a status or a message
        status = e.code if isinstance(e.code, int) else 0 if e.code is None else 1
        if not isinstance(e.code, int) and e.code is not None:
            print(e.code, file=sys.stderr)
    except BaseException as e:  # noqa: BLE001 - one rank alone: its traceback, as Python shows it
        sys.excepthook(type(e), e, e.__traceback__)
        status = 1
    finally:
        _end_interpreter(status)


def _end_interpreter(status: int) -> None:
    """End this interpreter as its own exit would, with ``status``: the main program must not
    run again after the hook (it ran inside it), and an exit raised here would be a fatal error
    in the interpreter's start."""
    import atexit
    import threading

    with contextlib.suppress(Exception):  # the exit goes on
        threading._shutdown()  # type: ignore[attr-defined]  # private, not in typeshed; non-daemon threads joined, as at the interpreter's exit
    atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(OSError, ValueError, AttributeError):
            stream.flush()
    os._exit(status)
