"""DeepSpeed's native ops (and our one, ``host_fused``) the engine can use: built ahead of time,
loaded without compiling.

DeepSpeed compiles an op the first time it is loaded (torch's JIT: a ``build.ninja``, then
``ninja``), which takes minutes. Here building and loading are apart:

- :func:`build_ops` (``offloadctl info --build``, run by ``make setup``) compiles what is missing
  or out of date, and reports each compiler step;
- every other load (ranks, ``OffloadAdamW``, ``offloadctl info``) compiles nothing: torch writes
  its ``build.ninja`` as usual, ``ninja -n`` says whether anything would run, and if something
  would, the op is left out, the engine uses its fallback and says so in one line.

Each op is optional: when one cannot build here, the engine uses its pure-PyTorch path.

**One ninja.** torch runs whichever ``ninja`` PATH yields, and the venv's (pip's, which
DeepSpeed requires) and the system's may differ: ninja 1.11 and 1.13 keep ``.ninja_log`` in
different formats and each discards the other's, so switching between them recompiles every op
(even ``ninja -n`` deletes a log of the other format). This module puts the interpreter's ninja
(found from the interpreter, never from PATH) first on PATH, through a directory that holds only
that link, before anything loads an op: DeepSpeed's own loads and child processes (ranks) use it too.

**Locks.** Builds go to ``<venv>/torch_extensions/<op>`` unless ``TORCH_EXTENSIONS_DIR`` is set,
so two checkouts never rebuild over each other. torch guards a build directory with a ``lock``
file that it keeps open while it builds, and waits forever while the file exists; a build killed
half-way leaves it behind. A lock file that no live process has open is stale: the next load or
build removes it. Our loads and builds of an op take an ``flock`` on ``offloadctl.flock`` in its
directory, which also names the holder; a build hands it on to ninja and the compilers, so it is
held, and the op reported as building, until the last process of the build has exited.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import fcntl
import functools
import logging
import os
import shutil
import subprocess
import sys
import sysconfig
import threading
import time
from types import ModuleType
from typing import TYPE_CHECKING, Any, Callable, Iterable, Iterator, TextIO

from engine.storage.machine_cache import kept_fact

if TYPE_CHECKING:
    from deepspeed.ops.op_builder.builder import OpBuilder

log = logging.getLogger(__name__)

# Ops the engine (or DeepSpeed inside a rank) loads, and what is used when one is not there.
FALLBACKS = {
    "async_io": "the posix I/O backend",
    "cpu_adam": "torch's AdamW kernel",
    "deepspeed_shm_comm": "torch.distributed's all-reduce",
    "host_fused": "the host lane's op-by-op chunks",
}
OPS = tuple(FALLBACKS)
OWN_OPS = ("host_fused",)
"""Ops from the engine's own sources (``engine/csrc``), built with DeepSpeed's builders."""
# Ops DeepSpeed loads first when it loads one of ours: AsyncIOBuilder.load() loads pin_memory.
DEPENDENCIES = {"async_io": ("pin_memory",)}
BUILD_HINT = "run `make setup` or `offloadctl info --build`"
LOAD_WAIT_S = 60.0  # longest wait of a load behind other loads (each holds the flock well under a second)
FLOCK_NAME = "offloadctl.flock"


def extensions_dir() -> str:
    return os.environ.setdefault("TORCH_EXTENSIONS_DIR", os.path.join(sys.prefix, "torch_extensions"))


def interpreter_ninja() -> str | None:
    """The ninja that goes with this interpreter, the same whatever PATH or activation says:
    pip's ninja package (a DeepSpeed requirement) in the interpreter's environment, else the first
    on PATH outside the interpreter's own scripts directory."""
    try:
        import ninja  # pip's package; BIN_DIR is computed from sysconfig, not from PATH

        exe = os.path.join(ninja.BIN_DIR, "ninja") if ninja.BIN_DIR else ""
        if os.access(exe, os.X_OK):
            return os.path.realpath(exe)
    except ImportError:
        pass
    own = {os.path.realpath(d) for d in (sysconfig.get_path("scripts"), _shim_dir())}
    path = [d for d in os.environ.get("PATH", "").split(os.pathsep) if d and os.path.realpath(d) not in own]
    found = shutil.which("ninja", path=os.pathsep.join(path))
    return os.path.realpath(found) if found else None


def _shim_dir() -> str:
    return os.path.join(extensions_dir(), ".ninja-bin")


def pin_build_environment() -> str | None:
    """Set TORCH_EXTENSIONS_DIR (when unset) and put :func:`interpreter_ninja` first on PATH, for
    this process and its children. Returns the pinned ninja, or None when there is none."""
    extensions_dir()
    exe = interpreter_ninja()
    if exe is None:
        return None  # torch says "Ninja is required" when something tries to build
    shim, link = _shim_dir(), os.path.join(_shim_dir(), "ninja")
    try:
        if os.path.realpath(link) != exe:
            os.makedirs(shim, exist_ok=True)
            tmp = f"{link}.{os.getpid()}"
            with contextlib.suppress(FileNotFoundError):
                os.unlink(tmp)
            os.symlink(exe, tmp)
            os.replace(tmp, link)  # atomic: ranks starting together never see a half-made link
    except OSError as e:  # a read-only extensions dir: builds cannot happen there anyway
        log.info("cannot pin ninja in %s: %s", shim, e)
        return None
    path = [d for d in os.environ.get("PATH", "").split(os.pathsep) if d != shim]
    os.environ["PATH"] = os.pathsep.join([shim, *path])
    return exe


pin_build_environment()  # before anything loads an op, DeepSpeed's own (shm comm, cpu_adam) included


def _cpu_description() -> str:
    """What identifies this CPU to py-cpuinfo, read cheaply: the kernel's description of the first
    core (vendor, family, model, stepping, flags), the machine and py-cpuinfo's version."""
    import hashlib
    import platform

    keep = ("vendor_id", "cpu family", "model", "model name", "stepping", "flags", "Features", "CPU implementer", "CPU part")
    try:
        with open("/proc/cpuinfo") as f:
            first = f.read().split("\n\n", 1)[0]
    except OSError:
        first = ""
    fields = sorted(line.strip() for line in first.splitlines() if line.split(":", 1)[0].strip() in keep)
    import cpuinfo

    text = "\n".join([platform.machine(), getattr(cpuinfo, "CPUINFO_VERSION_STRING", "?"), *fields])
    return hashlib.sha256(text.encode()).hexdigest()[:16]


CPU_INFO_FILE = "offloadctl-cpuinfo.json"
"""py-cpuinfo's answer per CPU (:func:`remember_cpu_info`), beside the built ops."""


def remember_cpu_info() -> None:
    """Keep py-cpuinfo's answer beside the built ops. Its ``get_cpu_info()`` starts a Python process
    and a fork to run CPUID (one to two seconds each time), and DeepSpeed calls it for every op it
    loads (to pick ``-march``) and in each DeepSpeedCPUAdam: seconds of every rank's start. The
    answer is the same for the same CPU, so it is kept in the extensions dir (``CPU_INFO_FILE``,
    :func:`engine.storage.machine_cache.kept_fact`), keyed by :func:`_cpu_description`; a machine
    with another CPU (a venv on a shared file system) asks py-cpuinfo again."""
    try:
        import cpuinfo
    except ImportError:
        return
    if getattr(cpuinfo.get_cpu_info, "offloadctl_kept", False):
        return
    ask = cpuinfo.get_cpu_info
    kept: list[str] = []  # the answer as JSON text: each caller gets its own copy to change

    def get_cpu_info() -> dict[str, Any]:
        import json

        if not kept:
            answer = kept_fact(
                extensions_dir(), CPU_INFO_FILE, _cpu_description(), lambda known: known if isinstance(known, dict) else ask()
            )
            kept.append(json.dumps(answer))
        return dict(json.loads(kept[0]))

    vars(get_cpu_info)["offloadctl_kept"] = True
    cpuinfo.get_cpu_info = get_cpu_info


@dataclasses.dataclass(frozen=True)
class OpState:
    """Where one op stands in this process."""

    name: str
    state: str
    """'built' (loaded, nothing compiled), 'building' (a live build holds it: ``pid``), 'not built'
    (missing or out of date), 'unavailable' (cannot build here) or 'not needed'."""
    detail: str = ""
    """Why; for 'built', the build directory."""
    pid: int | None = None
    """The building process, for 'building'."""

    @property
    def fallback(self) -> str | None:
        """What the engine uses instead, or None when the op is used (or not needed)."""
        return None if self.state in ("built", "not needed") else FALLBACKS[self.name]

    def to_json(self) -> dict[str, Any]:
        return {"state": self.state, "detail": self.detail, "pid": self.pid, "fallback": self.fallback}


class _WouldCompile(Exception):
    pass


_modules: dict[str, ModuleType] = {}
_states: dict[str, OpState] = {}
_said: set[str] = set()  # ops whose fallback this process has announced
_mutex = threading.RLock()  # one load or build at a time per process: the ninja hook is process-wide


@functools.lru_cache(maxsize=None)
def import_deepspeed() -> ModuleType:
    """DeepSpeed, imported the one way offloadctl imports it (its op builders here; the checks of
    ``integrations.ds_compat`` and the patches of ``integrations.ds_patches``): what it prints as
    it imports goes to stderr, and its logger's stdout handler is moved to stderr, not silenced,
    so that stdout stays clean for ``--json``. py-cpuinfo's answer is kept first
    (:func:`remember_cpu_info`): DeepSpeed asks it for every op it loads and each CPU Adam it makes."""
    remember_cpu_info()
    with contextlib.redirect_stdout(sys.stderr):  # its handler is created, and logs, on import
        import deepspeed

    for h in logging.getLogger("DeepSpeed").handlers:
        if isinstance(h, logging.StreamHandler) and getattr(h, "stream", None) is sys.stdout:
            h.setStream(sys.stderr)
    return deepspeed  # type: ignore[no-any-return]  # deepspeed: untyped (no py.typed)


CSRC = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "csrc")
"""The engine's own C++ sources (``engine/csrc``)."""


def _host_fused_builder() -> OpBuilder:
    """The builder of ``engine/csrc/host_fused.cpp``: DeepSpeed's cpu_adam builder (its flags,
    SIMD width and OpenMP) with our source, which includes cpu_adam's kernel source."""
    from deepspeed.ops.op_builder import CPUAdamBuilder

    class HostFusedBuilder(CPUAdamBuilder):  # type: ignore[misc]  # DeepSpeed ships no types: a subclass of Any
        NAME = "offloadctl_host_fused"

        def absolute_name(self) -> str:
            return f"engine.{self.NAME}_op"

        def sources(self) -> list[str]:
            return [os.path.join(CSRC, "host_fused.cpp")]

        def include_paths(self) -> list[str]:
            return ["csrc/includes", "csrc/adam"]

    return HostFusedBuilder()


def _make_builder(name: str) -> OpBuilder:
    if name == "host_fused":
        return _host_fused_builder()
    if name == "cpu_adam":  # the builder DeepSpeedCPUAdam uses, so that one build serves both
        from deepspeed.ops.op_builder import CPUAdamBuilder

        return CPUAdamBuilder()
    # The accelerator's builders, as ZeRO-Infinity and DeepSpeed's comm use: the same flags, so one
    # build serves both and neither rebuilds over the other.
    from deepspeed.accelerator import get_accelerator

    return get_accelerator().create_op_builder({"async_io": "AsyncIOBuilder", "deepspeed_shm_comm": "ShareMemCommBuilder"}[name])


# ---- who holds a build -------------------------------------------------------------------------


def _processes_holding(path: str) -> list[int]:
    """Pids of the live processes that have ``path`` open (those we may inspect)."""
    target, pids = os.path.realpath(path), []
    for entry in os.listdir("/proc"):
        if not entry.isdigit() or int(entry) == os.getpid():
            continue
        fd_dir = f"/proc/{entry}/fd"
        try:
            fds = os.listdir(fd_dir)
        except OSError:  # gone, or another user's
            continue
        for fd in fds:
            with contextlib.suppress(OSError):
                if os.readlink(os.path.join(fd_dir, fd)) == target:
                    pids.append(int(entry))
                    break
    return pids


def _holder(flock_path: str) -> tuple[str, int] | None:
    """(mode, pid) the flock's current holder wrote, or None."""
    try:
        with open(flock_path) as f:
            mode, pid = f.read().split()
        return mode, int(pid)
    except (OSError, ValueError):
        return None


def _take_flock(build_dir: str, build: bool, on_note: Callable[[str], None]) -> tuple[int, int | None]:
    """Lock ``build_dir`` against our other loads and builds: (fd, None) when held, or (-1, pid)
    for a load that found a build under way. A build waits for another build; a load does not."""
    path = os.path.join(build_dir, FLOCK_NAME)
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
    deadline = time.monotonic() + LOAD_WAIT_S
    while True:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            break
        except BlockingIOError:
            mode, pid = _holder(path) or ("", None)
            building = mode == "build"
            if building and build:
                on_note(f"waiting for the build started by pid {pid}")
                fcntl.flock(fd, fcntl.LOCK_EX)
                break
            if building or time.monotonic() > deadline:
                os.close(fd)
                return -1, pid
            time.sleep(0.05)  # another process's load: a fraction of a second
    os.ftruncate(fd, 0)
    os.pwrite(fd, f"{'build' if build else 'load'} {os.getpid()}\n".encode(), 0)
    return fd, None


def _release_flock(fd: int) -> None:
    os.ftruncate(fd, 0)  # a holder that is gone must not read as a build
    os.close(fd)  # releases the flock (ninja and compilers hand theirs back as they exit)


# ---- torch's ninja step, replaced for the duration of one load ---------------------------------


def _ninja_steps(build_dir: str) -> list[str]:
    """The commands ninja would run in ``build_dir`` (its dry run)."""
    out = subprocess.run([_ninja(), "-n", "-v"], cwd=build_dir, capture_output=True, text=True)
    if out.returncode != 0:
        raise RuntimeError(f"ninja -n in {build_dir}: {out.stdout.strip()} {out.stderr.strip()}")
    return [line for line in out.stdout.splitlines() if line.startswith("[")]


def _ninja() -> str:
    return shutil.which("ninja") or "ninja"  # the pinned one: its link is first on PATH


def _target(step: str) -> str:
    """What a ninja step ``[k/N] c++ ... -o x.o`` makes."""
    words = step.split()
    return os.path.basename(words[words.index("-o") + 1]) if "-o" in words[:-1] else words[-1]


@contextlib.contextmanager
def _ninja_hook(name: str, build: bool, flock_fds: list[int], on_step: Callable[[str, int, int, str], None]) -> Iterator[None]:
    """Within: torch's ``_run_ninja_build`` is a dry run that raises :class:`_WouldCompile` when
    anything would compile (a load), or a ninja run that reports each step (a build)."""
    from torch.utils import cpp_extension

    def dry_run(build_directory: str, verbose: bool, error_prefix: str) -> None:
        steps = _ninja_steps(build_directory)
        if steps:
            raise _WouldCompile(f"{len(steps)} compiler steps to run in {build_directory}")

    def run_with_progress(build_directory: str, verbose: bool, error_prefix: str) -> None:
        total = len(_ninja_steps(build_directory))
        if total == 0:
            return  # built, and up to date
        where = os.path.basename(build_directory)
        on_step(name, 0, total, where)
        cmd = [_ninja(), "-v"]
        if os.environ.get("MAX_JOBS", "").isdigit():
            cmd += ["-j", os.environ["MAX_JOBS"]]
        # ninja and the compilers inherit the flock: a build whose Python process is killed is
        # still seen as under way until its last compiler exits.
        proc = subprocess.Popen(
            cmd, cwd=build_directory, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, pass_fds=tuple(flock_fds)
        )
        output: list[str] = []
        done = 0
        assert proc.stdout is not None  # stdout=PIPE
        for line in proc.stdout:
            output.append(line)
            if line.startswith("["):
                done += 1
                on_step(name, done, max(total, done), f"{where}/{_target(line)}")
        if proc.wait() != 0:
            raise RuntimeError(f"{error_prefix}: {''.join(output[-40:])}")

    original = cpp_extension._run_ninja_build
    cpp_extension._run_ninja_build = run_with_progress if build else dry_run
    try:
        yield
    finally:
        cpp_extension._run_ninja_build = original


# ---- load and build -----------------------------------------------------------------------------


@contextlib.contextmanager
def _streams_with_files() -> Iterator[None]:
    """Within: stdout and stderr with file descriptors. DeepSpeed's checks (is libaio there?) and
    loads send output to ``sys.stderr.fileno()``; under Jupyter or pytest's capture the streams
    have none, and a built op was taken for one that cannot build here. Their output then goes
    to /dev/null."""

    def has_fd(stream: TextIO) -> bool:
        try:
            stream.fileno()
            return True
        except (AttributeError, OSError, ValueError):
            return False

    if has_fd(sys.stdout) and has_fd(sys.stderr):
        yield
        return
    out, err = sys.stdout, sys.stderr
    with open(os.devnull, "w") as null:
        sys.stdout = sys.stderr = null
        try:
            yield
        finally:
            sys.stdout, sys.stderr = out, err


def _load(
    name: str,
    build: bool,
    on_step: Callable[[str, int, int, str], None] | None = None,
    on_note: Callable[[str], None] | None = None,
) -> OpState:
    """Load op ``name`` (compiling only when ``build``); records the module and returns its state."""
    on_step = on_step or (lambda *a: None)
    on_note = on_note or (lambda msg: None)
    import torch

    if name == "deepspeed_shm_comm" and torch.cuda.is_available():
        return OpState(name, "not needed", "CUDA runs all-reduce with NCCL")
    try:
        import_deepspeed()
        with contextlib.redirect_stdout(sys.stderr):  # DeepSpeed prints its checks on stdout
            builder = _make_builder(name)
            compatible = builder is not None and builder.is_compatible(verbose=False)
    except Exception as e:  # DeepSpeed missing or broken: an expected outcome here, not a crash
        return OpState(name, "unavailable", f"DeepSpeed cannot provide it: {e}")
    if not compatible:
        why = {"async_io": "DeepSpeed finds no libaio (install libaio-dev)"}.get(name, "DeepSpeed says it cannot build here")
        return OpState(name, "unavailable", why)
    # Dependencies first, in a fixed order, so that two processes never wait on each other.
    build_dirs = [os.path.join(extensions_dir(), d) for d in (*DEPENDENCIES.get(name, ()), builder.name)]
    fds: list[int] = []
    try:
        for build_dir in build_dirs:
            os.makedirs(build_dir, exist_ok=True)
            fd, builder_pid = _take_flock(build_dir, build, on_note)
            if fd < 0:
                return OpState(name, "building", f"being built by pid {builder_pid}", pid=builder_pid)
            fds.append(fd)
        for build_dir in build_dirs:
            lock = os.path.join(build_dir, "lock")
            if not os.path.exists(lock):
                continue
            holders = _processes_holding(lock)
            if holders and not build:  # a build that did not go through here (DeepSpeed's own)
                return OpState(name, "building", f"being built by pid {holders[0]}", pid=holders[0])
            if holders:
                on_note(f"waiting for the build by pid {holders[0]}")  # torch waits on its lock
            else:
                on_note(f"removed a stale build lock left by an interrupted build ({lock})")
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(lock)
        from torch.utils.cpp_extension import JIT_EXTENSION_VERSIONER

        # torch skips the ninja step for an op it has already tried in this process.
        for build_dir in build_dirs:
            JIT_EXTENSION_VERSIONER.entries.pop(os.path.basename(build_dir), None)
        try:
            with _ninja_hook(name, build, fds, on_step), contextlib.redirect_stdout(sys.stderr):
                _modules[name] = builder.load(verbose=False)
        except _WouldCompile as e:
            return OpState(name, "not built", f"missing or out of date: {e}")
        except Exception as e:  # a failed build is an expected outcome here, not a crash
            first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
            return OpState(name, "unavailable", f"build failed: {first[:300]}")
        return OpState(name, "built", build_dirs[-1])
    finally:
        for fd in fds:
            _release_flock(fd)


def op_state(name: str) -> OpState:
    """The state of op ``name`` in this process; the first call loads it, compiling nothing."""
    with _mutex:
        if name not in _states:
            with _streams_with_files():
                _states[name] = _load(name, build=False)
        return _states[name]


def _loaded(name: str) -> ModuleType | None:
    """The op's module, or None after one line saying what is used instead and why."""
    op = op_state(name)
    if op.state == "built":
        return _modules[name]
    if op.state in ("building", "not built") and name not in _said:
        _said.add(name)
        whose = "offloadctl's" if name in OWN_OPS else "DeepSpeed's"
        if op.state == "building":
            msg = f"offloadctl: {whose} {name} op is {op.detail}; this run uses {op.fallback}"
        else:
            msg = f"offloadctl: {whose} {name} op is not built; using {op.fallback}: {BUILD_HINT}"
            log.info("%s op: %s", name, op.detail)  # where and what is missing: for the log, not the screen
        # One line per node (every rank there sees the same build directory), none per call.
        (log.warning if os.environ.get("LOCAL_RANK", "0") == "0" else log.info)("%s", msg)
    elif op.state == "unavailable":
        log.info("DeepSpeed %s unavailable: %s", name, op.detail)
    return None


def load_async_io() -> ModuleType | None:
    """DeepSpeed's ``async_io`` op module, or None (not built, being built, or no libaio-dev)."""
    return _loaded("async_io")


def load_cpu_adam() -> ModuleType | None:
    """DeepSpeed's ``cpu_adam`` op module (the one DeepSpeedCPUAdam loads), or None."""
    return _loaded("cpu_adam")


def load_host_fused() -> ModuleType | None:
    """The host lane's fused step (``engine/csrc/host_fused.cpp``, cpu_adam's kernel with the
    upcast, unscale and weight cast beside it in one parallel region), or None."""
    return _loaded("host_fused")


def load_shm_comm() -> ModuleType | None:
    """DeepSpeed's shared-memory all-reduce for the CPU accelerator (DeepSpeed loads it itself in
    ``init_distributed``), or None (not built, or not needed: with CUDA)."""
    return _loaded("deepspeed_shm_comm")


DEEPSPEED_LOADS = ("cpu_adam", "deepspeed_shm_comm")
"""Ops DeepSpeed loads by itself in a rank: cpu_adam for DeepSpeedCPUAdam, the shm comm op in
``init_distributed`` on the CPU accelerator."""


def prepare_deepspeed_loads() -> dict[str, OpState]:
    """In a rank, before DeepSpeed starts: load the ops of :data:`DEEPSPEED_LOADS`, so that
    DeepSpeed's own loads find them in its cache and run no ninja. Returns each op's state: one
    with a ``fallback`` is not built here, and DeepSpeed would compile it; the caller keeps it
    from DeepSpeed (``integrations.ds_patches``)."""
    load_cpu_adam()
    load_shm_comm()
    return {name: op_state(name) for name in DEEPSPEED_LOADS}


def build_ops(
    ops: Iterable[str] = OPS,
    *,
    on_step: Callable[[str, int, int, str], None] | None = None,
    on_note: Callable[[str, str], None] | None = None,
) -> dict[str, OpState]:
    """Build (or find built) each op in ``ops``, recovering stale locks and waiting for builds under
    way. ``on_step(op, done, total, target)`` follows the compiler steps; ``on_note(op, message)``
    says what else happens (a stale lock removed, a wait). Returns each op's state."""
    out: dict[str, OpState] = {}
    with _mutex:
        for name in ops:
            with _streams_with_files():
                op = _load(
                    name, build=True, on_step=on_step, on_note=None if on_note is None else functools.partial(on_note, name)
                )
            _states[name] = out[name] = op
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m engine.storage.native_ops", description=__doc__.splitlines()[0])
    ap.add_argument("--build", action="store_true", help="build (or find already built) the optional ops")
    args = ap.parse_args(argv)
    if not args.build:
        ap.print_help()
        return 0

    def step(op: str, done: int, total: int, target: str) -> None:
        print(f"native op {op}: {f'compiling {target}' if done == 0 else target} [{done}/{total}]", flush=True)

    states = build_ops(on_step=step, on_note=lambda op, msg: print(f"native op {op}: {msg}", flush=True))
    for op in states.values():
        print(f"native op {op.name}: {op.state}" + (f" ({op.detail}; using {op.fallback})" if op.fallback else ""))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
