"""DeepSpeed's native ops: built once whatever PATH says, never compiled by a run, never stuck
behind the lock of an interrupted build.

Real processes, real builds (in a scratch TORCH_EXTENSIONS_DIR), real signals. A build of one op
takes a minute or more on two cores, so these are slow tests.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import sysconfig
import time

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
VENV_BIN = sysconfig.get_path("scripts")  # what `source .venv/bin/activate` puts first on PATH

pytestmark = pytest.mark.slow

# Child programs: one JSON line on stdout.
LOAD = """
import json, sys, time
t0 = time.perf_counter()
from engine.storage import native_ops
module = {"async_io": native_ops.load_async_io, "cpu_adam": native_ops.load_cpu_adam,
          "deepspeed_shm_comm": native_ops.load_shm_comm}[sys.argv[1]]()
st = native_ops.op_state(sys.argv[1])
out = dict(st.to_json(), loaded=module is not None, seconds=time.perf_counter() - t0)
if sys.argv[1] == "async_io":
    from engine.storage.io_backends import open_backend
    out["io_backend"] = open_backend("auto").name
print(json.dumps(out))
"""
BUILD = """
import json, sys, time
t0 = time.perf_counter()
from engine.storage import native_ops
steps, notes = [], []
states = native_ops.build_ops([sys.argv[1]], on_step=lambda op, done, total, what: steps.append(what) if done else None,
                              on_note=lambda op, msg: notes.append(msg))
print(json.dumps(dict(states[sys.argv[1]].to_json(), steps=steps, notes=notes, seconds=time.perf_counter() - t0)))
"""


def _usual_path() -> str:
    """PATH as a shell has it: without the venv's bin and without the link directory that
    engine.storage.native_ops puts first (this process may have imported it)."""
    return os.pathsep.join(
        d
        for d in os.environ["PATH"].split(os.pathsep)
        if d and not d.endswith(".ninja-bin") and os.path.realpath(d) != os.path.realpath(VENV_BIN)
    )


def _env(ext_dir: str, kind: str = "usual", decoy_dir: str | None = None) -> dict:
    env = {k: v for k, v in os.environ.items() if k not in ("VIRTUAL_ENV", "LOCAL_RANK", "MAX_JOBS")}
    env.update(PYTHONPATH=ROOT, TORCH_EXTENSIONS_DIR=ext_dir, PATH=_usual_path())
    if kind == "venv-path":  # PATH=$PWD/.venv/bin:$PATH
        env["PATH"] = VENV_BIN + os.pathsep + env["PATH"]
    elif kind == "activated":  # what `source .venv/bin/activate` exports
        env.update(
            PATH=VENV_BIN + os.pathsep + env["PATH"],
            VIRTUAL_ENV=os.path.dirname(VENV_BIN),
            VIRTUAL_ENV_PROMPT=f"({os.path.basename(os.path.dirname(VENV_BIN))}) ",
        )
        env.pop("PYTHONHOME", None)
    elif kind == "decoy":  # some other ninja first on PATH: it must never run
        env["PATH"] = decoy_dir + os.pathsep + env["PATH"]
    return env


def _child(program: str, op: str, env: dict, timeout: float = 900) -> tuple[dict, str]:
    out = subprocess.run([sys.executable, "-c", program, op], capture_output=True, text=True, env=env, cwd=ROOT, timeout=timeout)
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1]), out.stderr


def _fingerprint(op_dir: str) -> dict:
    """What a compile changes: ninja's log and every object and library, with their mtimes."""
    out = {}
    for f in sorted(os.listdir(op_dir)):
        if f == ".ninja_log" or f.endswith((".o", ".so")):
            st = os.stat(os.path.join(op_dir, f))
            out[f] = (st.st_mtime_ns, st.st_size)
    with open(os.path.join(op_dir, ".ninja_log"), "rb") as log:
        out["log"] = log.read()
    return out


def _decoy(tmp_path) -> tuple[str, str]:
    d = tmp_path / "decoy-bin"
    d.mkdir()
    ran = tmp_path / "decoy-ran"
    (d / "ninja").write_text(f'#!/bin/sh\necho "$@" >> {ran}\nexit 1\n')
    (d / "ninja").chmod(0o755)
    return str(d), str(ran)


def _wait_for(cond, timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while not cond():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.1)


def test_an_op_built_once_is_reused_whatever_path_or_activation(tmp_path):
    """The venv's ninja and the system's write .ninja_log in different formats, and each discarded
    the other's: every switch between `PATH=.venv/bin:$PATH` (or an activated venv) and the usual
    PATH recompiled every op. Built once here (its link: ninja writes its log for any step, and a
    log it cannot read makes it redo every step); then no load and no build compiles anything."""
    ext = str(tmp_path / "ext")
    _seed(ext, "cpu_adam", drop=("cpu_adam.so",))  # a link here, not a whole build (minutes)
    first, _ = _child(BUILD, "cpu_adam", _env(ext, "usual"))
    assert first["state"] == "built" and "cpu_adam/cpu_adam.so" in first["steps"], first  # linked here
    op_dir = os.path.join(ext, "cpu_adam")
    before = _fingerprint(op_dir)
    decoy_dir, decoy_ran = _decoy(tmp_path)
    seconds = {}
    for kind in ("venv-path", "usual", "activated", "usual", "decoy"):
        env = _env(ext, kind, decoy_dir)
        loaded, _ = _child(LOAD, "cpu_adam", env)
        assert loaded["state"] == "built" and loaded["loaded"], (kind, loaded)
        built, _ = _child(BUILD, "cpu_adam", env)
        assert built["state"] == "built" and built["steps"] == [], (kind, built)  # nothing recompiled
        assert _fingerprint(op_dir) == before, f"{kind}: the op was rebuilt"
        seconds.setdefault(kind, []).append(round(loaded["seconds"], 2))
    assert not os.path.exists(decoy_ran), "the ninja on the user's PATH ran"
    print("load seconds by environment:", seconds)


def test_a_live_build_makes_a_run_fall_back_in_one_line_and_a_killed_one_does_not(tmp_path):
    ext = str(tmp_path / "ext")
    build = subprocess.Popen(
        [sys.executable, "-c", BUILD, "cpu_adam"],
        env=_env(ext),
        cwd=ROOT,
        text=True,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        start_new_session=True,
    )
    try:
        flock, lock = os.path.join(ext, "cpu_adam", "offloadctl.flock"), os.path.join(ext, "cpu_adam", "lock")
        _wait_for(lambda: os.path.exists(lock) and open(flock).read().startswith("build"), 120, "the build to start")
        got, err = _child(LOAD, "cpu_adam", _env(ext, "activated"))
        assert got["state"] == "building" and got["pid"] == build.pid and not got["loaded"], got
        said = [line for line in err.splitlines() if "cpu_adam" in line]
        assert len(said) == 1 and f"being built by pid {build.pid}" in said[0] and "torch's AdamW" in said[0], err
    finally:
        _kill_build(build, os.path.join(ext, "cpu_adam"))
    assert os.path.exists(lock)  # left behind, as after a real kill
    got, err = _child(LOAD, "cpu_adam", _env(ext))
    # Not "building": the lock is recognised as stale and removed; the op is simply not built yet.
    assert got["state"] == "not built" and not got["loaded"], got
    assert not os.path.exists(os.path.join(ext, "cpu_adam", "lock"))
    said = [line for line in err.splitlines() if "cpu_adam" in line]
    assert len(said) == 1 and "offloadctl info --build" in said[0], err


def _kill_build(proc: subprocess.Popen, op_dir: str) -> None:
    """SIGKILL a build started with ``start_new_session``: its process group, then the compilers
    (ninja puts each in a group of its own), found by the flock they inherited."""
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()
    target = os.path.realpath(os.path.join(op_dir, "offloadctl.flock"))
    deadline = time.monotonic() + 60
    while _busy(op_dir):
        assert time.monotonic() < deadline, "the killed build's compilers did not exit"
        for pid in filter(str.isdigit, os.listdir("/proc")):
            try:
                if any(os.readlink(f"/proc/{pid}/fd/{fd}") == target for fd in os.listdir(f"/proc/{pid}/fd")):
                    os.kill(int(pid), signal.SIGKILL)
            except OSError:  # gone meanwhile
                pass
        time.sleep(0.2)


def _compiling(session: int) -> bool:
    """Whether a compiler of the build started as ``session`` (its own session) is running."""
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            if os.getsid(int(pid)) == session and open(f"/proc/{pid}/comm").read().strip() in ("cc1plus", "cc1"):
                return True
        except OSError:  # gone meanwhile
            pass
    return False


def _busy(op_dir: str) -> bool:
    """Whether some process (ninja, a compiler) still holds the op's flock."""
    import fcntl

    fd = os.open(os.path.join(op_dir, "offloadctl.flock"), os.O_RDONLY)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        return False
    except BlockingIOError:
        return True
    finally:
        os.close(fd)


def _seed(ext: str, op: str, drop: tuple[str, ...], deps: tuple[str, ...] = ()) -> bool:
    """Copy ``op`` (and ``deps``, which DeepSpeed loads first) into ``ext`` where the default build
    directory has it built by this ninja, less the files in ``drop``: a build there then compiles
    those (a minute) instead of the whole op (several). False: nothing to seed from."""
    src = os.environ.get("TORCH_EXTENSIONS_DIR") or os.path.join(sys.prefix, "torch_extensions")  # as engine.storage.native_ops
    probe = subprocess.run([sys.executable, "-c", LOAD, op], capture_output=True, text=True, cwd=ROOT, env=_env(src), timeout=300)
    if probe.returncode != 0 or json.loads(probe.stdout.strip().splitlines()[-1])["state"] != "built":
        return False
    for name in (*deps, op):
        shutil.copytree(os.path.join(src, name), os.path.join(ext, name), ignore=shutil.ignore_patterns("lock", "*.flock"))
    for f in drop:
        os.unlink(os.path.join(ext, op, f))
    return True


def test_a_build_killed_mid_compile_is_recovered_by_the_next_build(tmp_path):
    """SIGKILL a build mid-compile (the whole process group: Python, ninja, compilers). The lock it
    leaves does not stop the next build, which compiles the rest; a fresh process then uses aio.
    The objects left to compile are async_io's smallest (a second or two each, not a minute): the
    kill comes as soon as a compiler runs."""
    ext = str(tmp_path / "ext")
    os.makedirs(ext)
    probe, _ = _child(LOAD, "async_io", _env(str(tmp_path / "probe")))
    if probe["state"] == "unavailable":
        pytest.skip(f"async_io cannot build here: {probe['detail']}")
    small = ("deepspeed_aio_utils.o", "deepspeed_aio_types.o", "deepspeed_aio_common.o")
    _seed(ext, "async_io", drop=("async_io.so", *small), deps=("pin_memory",))
    build = subprocess.Popen(
        [sys.executable, "-c", BUILD, "async_io"],
        env=_env(ext),
        cwd=ROOT,
        text=True,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        start_new_session=True,
    )
    lock = os.path.join(ext, "async_io", "lock")
    try:
        _wait_for(lambda: os.path.exists(lock) and _compiling(build.pid), 900, "the async_io build to compile")
        assert build.poll() is None, "the build finished before it could be killed"
    finally:
        _kill_build(build, os.path.join(ext, "async_io"))
    assert os.path.exists(lock) and not os.path.exists(os.path.join(ext, "async_io", "async_io.so"))

    rebuilt, _ = _child(BUILD, "async_io", _env(ext), timeout=1800)
    assert rebuilt["state"] == "built", rebuilt
    assert any("stale build lock" in n for n in rebuilt["notes"]), rebuilt["notes"]
    # It compiled what the killed build had not finished, then linked.
    assert any(s.startswith("async_io/") and s.endswith(".o") for s in rebuilt["steps"]), rebuilt
    assert rebuilt["steps"][-1] == "async_io/async_io.so", rebuilt

    run, err = _child(LOAD, "async_io", _env(ext, "activated"))
    assert run["loaded"] and run["io_backend"] == "aio", (run, err)
