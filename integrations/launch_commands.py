"""Launches other than DeepSpeed's own runner: a launch command run as given
(``offloadctl train torchrun ...``), or one built for ``--launcher torchrun|accelerate`` from the
same options as DeepSpeed's launcher takes.

Both carry the engine into every rank through the environment (:func:`hook_env`): the rank
hook (``integrations/rank_hook``) first on PYTHONPATH and the ranks' settings beside it, so that
whatever the launcher starts, re-executes or hands on (``accelerate launch`` runs
``torch.distributed.run`` in its own process; LLaMA-Factory's CLI re-executes under torchrun;
``srun`` starts torchrun on each node), each rank's interpreter installs the engine before the
script runs (``integrations.rank_entry``).
"""

from __future__ import annotations

import os
import re
import shlex
import shutil
import sys
from collections.abc import Mapping, Sequence

from engine.errors import ConfigError
from integrations import rank_entry
from integrations.launcher import LAUNCHER_OPTIONS, free_port, option_dest

PROGRAMS = (
    "torchrun",
    "accelerate",
    "deepspeed",
    "srun",
    "mpirun",
    "mpiexec",
    "python",
    "python3",
    "llamafactory-cli",
    "axolotl",
)
"""Launch programs ``offloadctl train PROGRAM ...`` runs as given (``python3.N`` too)."""
BUILT = ("torchrun", "accelerate")
"""``--launcher`` values whose command offloadctl builds."""
DEEPSPEED_LAUNCHERS = ("pdsh", "openmpi", "mpich", "impi", "slurm", "mvapich")
"""``--launcher`` values DeepSpeed's runner takes (its multi-node launchers)."""

# DeepSpeed's options that a built launcher takes, in its own spelling: (torchrun's, accelerate's).
BUILT_SPELLING = {
    "--num_nodes": ("--nnodes", "--num_machines"),
    "--node_rank": ("--node_rank", "--machine_rank"),
    "--master_addr": ("--master_addr", "--main_process_ip"),
    "--master_port": ("--master_port", "--main_process_port"),
    "--module": ("--module", "--module"),
    "--no_python": ("--no-python", "--no_python"),
}
BUILT_TAKES = ("--num_gpus", "--launcher", "--launcher_args", *BUILT_SPELLING)
"""DeepSpeed's launcher options a built launcher takes; the others are refused beside it."""

HOOK_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "rank_hook")


def launch_program(script: str) -> str | None:
    """The launch program ``script`` names (torchrun, ``accelerate``, ``srun``, ...), or None
    where it is a training script."""
    name = os.path.basename(script)
    if name in PROGRAMS or re.fullmatch(r"python3\.\d+", name):
        return name
    return None


def resolve_program(program: str, given: str) -> str:
    """The executable of ``given`` (a launch program): the one beside this interpreter where
    there is one (the environment that has the engine, DeepSpeed and torch), else PATH's;
    ConfigError where there is none."""
    if os.sep in given:
        if os.path.isfile(given) and os.access(given, os.X_OK):
            return os.path.abspath(given)
        raise ConfigError(f"{given} is not an executable file: check the path")
    if program.startswith("python"):
        return sys.executable
    here = os.path.dirname(sys.executable)
    found = shutil.which(given, path=here) or shutil.which(given)
    if not found:
        raise ConfigError(
            f"{given} is not installed here (not beside {sys.executable}, nor on PATH): install it "
            f"in offloadctl's environment, or give its path"
        )
    return found


def check_launcher_name(name: str | None) -> None:
    if name is not None and name not in BUILT + DEEPSPEED_LAUNCHERS:
        raise ConfigError(
            f"--launcher {name}: offloadctl knows {', '.join(BUILT)} (it builds their command) and "
            f"DeepSpeed's {', '.join(DEEPSPEED_LAUNCHERS)}; or run any launch command as given: "
            f"offloadctl train [options] torchrun|accelerate|srun|mpirun ..."
        )


def refuse_deepspeed_options(values: Mapping[str, object], beside: str, allowed: Sequence[str] = ()) -> None:
    """ConfigError naming the first of DeepSpeed's launcher options given in ``values`` (parsed,
    by ``launcher.option_dest``) that ``beside`` (a launch that is not DeepSpeed's runner) does
    not take."""
    for flags, _ in LAUNCHER_OPTIONS:
        if values.get(option_dest(flags)) not in (None, False) and flags[0] not in allowed:
            raise ConfigError(
                f"{flags[0]} is an option of DeepSpeed's launcher, which {beside} does not use: give "
                f"{beside.split()[0]}'s own option in its command instead"
            )


def local_slots(sysfs: str = "/sys") -> int:
    """The ranks a launch starts on this node when told no number, as DeepSpeed's launcher
    counts them: the node's GPUs (NVML, without initialising CUDA), else the CPU accelerator's
    devices, one per NUMA node."""
    from perf.nvml import open_nvml

    opened = open_nvml()
    if opened is not None:
        nvml, handles = opened
        try:
            if handles:
                return len(handles)
        finally:
            nvml.nvmlShutdown()
    try:
        nodes = [
            d for d in os.listdir(os.path.join(sysfs, "devices", "system", "node")) if d.startswith("node") and d[4:].isdigit()
        ]
    except OSError:
        nodes = []
    return max(1, len(nodes))


# How a launch command says its ranks per node (or all its ranks): (flags, per node).
_RANK_COUNT_FLAGS = {
    "torchrun": (("--nproc_per_node", "--nproc-per-node"), True),
    "accelerate": (("--num_processes",), False),
    "deepspeed": (("--num_gpus", "--num_accelerators"), True),
    "srun": (("-n", "--ntasks"), False),
    "mpirun": (("-n", "-np"), False),
    "mpiexec": (("-n", "-np"), False),
}


def ranks_of(launcher: str, command: Sequence[str]) -> str:
    """How many ranks a launch command starts, as far as its arguments say."""
    if launcher.startswith("python"):
        return "1 rank"
    flags, per_node = _RANK_COUNT_FLAGS.get(launcher, ((), False))
    for i, a in enumerate(command):
        flag, eq, value = a.partition("=")
        if flag in flags:
            value = value if eq else (command[i + 1] if i + 1 < len(command) else "")
            if value.isdigit():
                n = int(value)
                return f"{n} rank{'s' if n != 1 else ''}" + (" per node" if per_node and _nodes(command) else "")
    return f"the ranks {launcher} starts"


def _nodes(command: Sequence[str]) -> bool:
    return any(a.partition("=")[0] in ("--nnodes", "--num_machines", "--num_nodes") for a in command)


def built_command(kind: str, values: Mapping[str, object], script: str, script_args: Sequence[str]) -> list[str]:
    """The ``--launcher torchrun|accelerate`` command: that launcher started by this interpreter
    (``python -m``), with DeepSpeed's options of the same meaning in its spelling, then
    ``--launcher_args`` as given, then the script and its arguments."""
    get = lambda flag: values.get(option_dest((flag,)))  # noqa: E731
    which = BUILT.index(kind)
    per_node = int(str(get("--num_gpus") or local_slots()))
    nodes = int(str(get("--num_nodes") or 1))
    cmd = (
        [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(per_node)]
        if kind == "torchrun"
        else [sys.executable, "-m", "accelerate.commands.launch", "--use_deepspeed", "--num_processes", str(per_node * nodes)]
    )
    for flag, spelled in BUILT_SPELLING.items():
        v = get(flag)
        if v is True:
            cmd.append(spelled[which])
        elif v not in (None, False) and not (flag == "--num_nodes" and kind == "torchrun" and nodes == 1):
            cmd += [spelled[which], str(v)]
    cmd += shlex.split(str(get("--launcher_args") or ""))
    return cmd + [script, *script_args]


def hook_env(settings_json: str, *, direct: bool) -> dict[str, str]:
    """What a launch that is not DeepSpeed's runner adds to the environment: the rank hook and
    this checkout on PYTHONPATH, the ranks' settings, and whether the user set OMP_NUM_THREADS
    (then it stands in every rank). With ``direct`` (``python script.py``: the launch's own
    interpreter is the one rank), a world of one, as a launcher would describe it, where the
    environment does not describe one already: DeepSpeed would otherwise look for MPI."""
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = {
        "PYTHONPATH": os.pathsep.join(filter(None, [HOOK_DIR, root, os.environ.get("PYTHONPATH")])),
        rank_entry.SETTINGS_ENV: settings_json,
        rank_entry.USER_OMP_ENV: "1" if "OMP_NUM_THREADS" in os.environ else "0",
    }
    if direct and "RANK" not in os.environ:
        env.update(
            RANK="0",
            LOCAL_RANK="0",
            WORLD_SIZE="1",
            LOCAL_WORLD_SIZE="1",
            MASTER_ADDR=os.environ.get("MASTER_ADDR", "127.0.0.1"),
            MASTER_PORT=os.environ.get("MASTER_PORT") or free_port(),
        )
    return env


def script_of(command: Sequence[str]) -> str | None:
    """The training script a launch command names, as far as it can be told without running it:
    the first argument after the launcher's options that ends in ``.py`` (for the start line and
    the ds_config check)."""
    return next((a for a in command[1:] if a.endswith(".py") and not a.startswith("-")), None)


def port_of(command: Sequence[str]) -> str | None:
    """The rendezvous port a launch command gives (``--master_port``, ``--main_process_port``,
    or torchrun's ``--rdzv_endpoint``/``--rdzv-endpoint`` HOST:PORT), or None."""
    for i, a in enumerate(command):
        flag, eq, value = a.partition("=")
        if flag in ("--master_port", "--master-port", "--main_process_port", "--rdzv_endpoint", "--rdzv-endpoint"):
            value = value if eq else (command[i + 1] if i + 1 < len(command) else "")
            port = value.rsplit(":", 1)[-1]
            return port if port.isdigit() else None
    return None
