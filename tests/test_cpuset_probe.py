"""The node's memory-bandwidth probe inside a cpuset and a taskset (issue 43, item 1).

Slurm's cgroup cores, Kubernetes' static CPU manager and ``docker --cpuset-cpus`` give a process
fewer CPUs than ``os.cpu_count()``. The probe used to start a child to measure "every CPU"; the
kernel clipped the child's affinity to the cpuset, so the child started another, without end.
Each test here runs a real process in a real restricted affinity, on an empty cache (its own
extensions and XDG directories, so nothing was measured before), and checks that it finishes
quickly and leaves no process behind.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
import uuid

import pytest
from helpers import IS_ROOT, ROOT, env_with_root

pytestmark = pytest.mark.slow  # processes that import torch and measure for seconds

TWO_CPUS = pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="needs two CPUs")
PROBE = (
    "import logging, sys; logging.basicConfig(level=logging.INFO, stream=sys.stderr, format='%(message)s')\n"
    "from engine.host_kernel import node_memory_bandwidth\n"
    "print('figure', node_memory_bandwidth())\n"
)
QUICK_S = 90  # imports and a 256 MB copy take seconds; the endless respawn never ends


@pytest.fixture
def empty_cache(tmp_path):
    """An environment where nothing was measured yet: the state ``make setup`` leaves on a fresh node."""
    env = env_with_root(
        TORCH_EXTENSIONS_DIR=str(tmp_path / "ext"),
        XDG_STATE_HOME=str(tmp_path / "state"),
        XDG_CONFIG_HOME=str(tmp_path / "config"),
        XDG_RUNTIME_DIR=str(tmp_path / "run"),
    )
    for k in ("TORCH_EXTENSIONS_DIR", "XDG_STATE_HOME", "XDG_CONFIG_HOME", "XDG_RUNTIME_DIR"):
        os.makedirs(env[k], mode=0o700)
    env.pop("OFFLOADCTL_NODE_CPUS", None)
    return env


def _session_processes(sid: int) -> list[int]:
    """The live processes of session ``sid`` (each test starts its process in a session of its own)."""
    out = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[3]) == sid and fields[0] != "Z":
            out.append(int(entry))
    return out


def _run_to_the_end(argv: list[str], env: dict) -> tuple[subprocess.CompletedProcess, float, list[int]]:
    """Run ``argv`` in a session of its own: (its result, seconds, the processes of its session
    left once it ended). Past ``QUICK_S`` it and every process of its session are killed (each
    by its id: all are this test's), and the test fails."""
    t0 = time.monotonic()
    p = subprocess.Popen(
        argv, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True
    )
    try:
        out, err = p.communicate(timeout=QUICK_S)
    except subprocess.TimeoutExpired:
        left = _session_processes(p.pid)
        for pid in left:
            os.kill(pid, signal.SIGKILL)
        out, err = p.communicate()
        pytest.fail(f"did not end within {QUICK_S} s; {len(left)} processes in its session: {err[-2000:]}")
    seconds = time.monotonic() - t0
    time.sleep(0.5)  # a child it left would still be running now
    left = _session_processes(p.pid)
    for pid in left:
        os.kill(pid, signal.SIGKILL)
    return subprocess.CompletedProcess(argv, p.returncode, out, err), seconds, left


def _measured(result: subprocess.CompletedProcess) -> tuple[float, str]:
    assert result.returncode == 0 and "Traceback" not in result.stderr, result.stderr[-3000:]
    figure = float(result.stdout.split("figure", 1)[1].split()[0])
    said = [ln for ln in result.stderr.splitlines() if ln.startswith("node memory bandwidth:")]
    assert figure > 1e8 and len(said) == 1, result.stderr[-3000:]
    return figure, said[0]


@TWO_CPUS
def test_a_process_in_a_taskset_measures_on_its_cpus_here(empty_cache):
    """``taskset -c 0`` on a 2-CPU machine: measured on that CPU in the process itself."""
    result, seconds, left = _run_to_the_end(["taskset", "-c", "0", sys.executable, "-c", PROBE], empty_cache)
    _, said = _measured(result)
    assert said.endswith("on 1 CPUs (this process)") and left == [] and seconds < QUICK_S, (said, left)


@TWO_CPUS
def test_a_bound_rank_measures_the_node_in_one_child_that_starts_nothing(empty_cache):
    """A rank bound to its share (CPU 0) of what its launcher gave it (CPUs 0-1): one child
    widens its own affinity (no preexec_fn in the rank) and measures on both."""
    env = dict(empty_cache, OFFLOADCTL_NODE_CPUS="0,1")
    result, seconds, left = _run_to_the_end(["taskset", "-c", "0", sys.executable, "-c", PROBE], env)
    _, said = _measured(result)
    assert said.endswith("on 2 CPUs (a child process)") and left == [], (said, left)


@TWO_CPUS
def test_a_child_that_fails_leaves_the_rank_its_own_figure_in_one_line(empty_cache, tmp_path):
    """The child cannot start (its interpreter is gone, as after an upgrade of the environment
    under a running rank): one line, no figure kept, the rank goes on."""
    probe = "import sys; sys.executable = '/nonexistent/python'\n" + PROBE
    env = dict(empty_cache, OFFLOADCTL_NODE_CPUS="0,1")
    result, _, left = _run_to_the_end(["taskset", "-c", "0", sys.executable, "-c", probe], env)
    assert result.returncode == 0 and "Traceback" not in result.stderr and left == [], result.stderr[-3000:]
    assert result.stdout.split() == ["figure", "None"]
    warned = [ln for ln in result.stderr.splitlines() if "memory bandwidth was not measured" in ln]
    assert len(warned) == 1 and warned[0].startswith("offloadctl: ") and "counts on its own" in warned[0], warned
    assert not os.path.exists(os.path.join(empty_cache["TORCH_EXTENSIONS_DIR"], "offloadctl-memory-bandwidth.json"))


# -- a real cpuset ---------------------------------------------------------------------------------


def _cpuset_root() -> str | None:
    """Where this machine's cgroup cpuset controller is mounted, as a cgroup v1 hierarchy (v2
    needs its controller enabled at the root, a change to the machine a test should not make)."""
    try:
        with open("/proc/self/mountinfo") as f:
            for line in f:
                left, right = line.split(" - ", 1)
                fstype, _, options = right.split()[:3]
                if fstype == "cgroup" and "cpuset" in options.split(","):
                    return left.split()[4]
    except OSError:
        pass
    return None


@pytest.fixture
def one_cpu_cpuset():
    """A cgroup cpuset of CPU 0 alone, made here (root) and removed afterwards: the argv prefix
    that runs a command in it."""
    root = _cpuset_root()
    if not IS_ROOT or root is None or not os.access(root, os.W_OK):
        pytest.skip("needs root and a cgroup v1 cpuset hierarchy")
    cg = os.path.join(root, f"offloadctl-test-{uuid.uuid4().hex[:8]}")
    os.mkdir(cg)
    try:
        with open(os.path.join(root, "cpuset.mems")) as f:
            mems = f.read().strip()
        for name, value in (("cpuset.cpus", "0"), ("cpuset.mems", mems)):
            with open(os.path.join(cg, name), "w") as f:
                f.write(value)
        yield ["sh", "-c", 'echo $$ > "$0/cgroup.procs" && exec "$@"', cg]
    finally:
        for _ in range(50):  # _run_to_the_end killed whatever was left: wait for the kernel to reap it
            with open(os.path.join(cg, "cgroup.procs")) as f:
                if not f.read().strip():
                    break
            time.sleep(0.1)
        os.rmdir(cg)


@TWO_CPUS
def test_in_a_one_cpu_cpuset_the_probe_ends_and_starts_no_process(one_cpu_cpuset, empty_cache):
    """The reported case: a process in a cpuset of 1 of the machine's 2 CPUs, nothing measured
    yet. The old probe spawned itself without end (36 processes after 150 s)."""
    result, seconds, left = _run_to_the_end([*one_cpu_cpuset, sys.executable, "-c", PROBE], empty_cache)
    _, said = _measured(result)
    assert said.endswith("on 1 CPUs (this process)") and left == [], (said, left)


@TWO_CPUS
def test_in_a_one_cpu_cpuset_a_bound_rank_measures_what_the_cpuset_allows(one_cpu_cpuset, empty_cache):
    """A rank whose launcher's list names CPUs the cpuset does not allow (a stale or inherited
    list): the one child gets its affinity clipped, measures on CPU 0, and starts nothing."""
    env = dict(empty_cache, OFFLOADCTL_NODE_CPUS="0,1")
    result, _, left = _run_to_the_end([*one_cpu_cpuset, sys.executable, "-c", PROBE], env)
    _, said = _measured(result)
    assert said.endswith("on 1 CPUs (a child process)") and left == [], (said, left)


@TWO_CPUS
def test_offloadctl_info_in_a_one_cpu_cpuset_on_a_fresh_node(one_cpu_cpuset, empty_cache):
    """As the user ran it: ``offloadctl info`` in the cpuset, on a node that has measured nothing."""
    result, _, left = _run_to_the_end([*one_cpu_cpuset, sys.executable, "-m", "offloadctl.cli", "info", "--json"], empty_cache)
    assert result.returncode == 0 and "Traceback" not in result.stderr and left == [], result.stderr[-3000:]
    import json

    assert json.loads(result.stdout)["host_memory_bytes_per_s"] > 1e8
