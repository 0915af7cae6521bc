"""Screens as a user sees them in a terminal of 80x24 (tmux), issue 46: `offloadctl plan` for a
model that does not fit, `info`, `profile show` and `profile save`. Each command runs in a tmux
server of the test's own; the screen is what capture-pane gives."""

from __future__ import annotations

import json
import os
import re
import shlex
import shutil
import subprocess
import sys
import time
import uuid

import pytest
from helpers import ROOT, env_with_root

CPU_VM = os.path.join(ROOT, "profiles", "example-cpu-vm.toml")
H100 = os.path.join(ROOT, "profiles", "example-h100-node.toml")
needs_tmux = pytest.mark.skipif(shutil.which("tmux") is None, reason="needs tmux (apt-get install tmux)")
DONE = "__exit="


def screen(command: str, *, timeout_s: float = 120, env: dict | None = None) -> tuple[str, int]:
    """(every line ``command`` left in an 80x24 tmux window, its exit status). The window keeps
    its scrollback, so a screen longer than 24 lines is read whole, as wrapped at 80 columns."""
    sock = f"oc-screen-{uuid.uuid4().hex[:8]}"
    env = env or env_with_root()
    tmux = ["tmux", "-L", sock, "-f", "/dev/null"]
    inner = f"cd {shlex.quote(ROOT)} && {command}; echo {DONE}$?; sleep 600"
    subprocess.run(
        [
            *tmux,
            "new-session",
            "-d",
            "-s",
            "t",
            "-x",
            "80",
            "-y",
            "24",
            *(
                a
                for k in ("PATH", "PYTHONPATH", "HOME", "XDG_CONFIG_HOME", "XDG_STATE_HOME", "OFFLOADCTL_PROFILE_DIR", "TMPDIR")
                if k in env
                for a in ("-e", f"{k}={env[k]}")
            ),
            inner,
        ],
        check=True,
        env=env,
    )
    try:
        subprocess.run([*tmux, "set-option", "-g", "history-limit", "5000"], check=True)
        deadline = time.monotonic() + timeout_s
        while True:
            text = subprocess.run(
                [*tmux, "capture-pane", "-p", "-S", "-", "-t", "t"], capture_output=True, text=True, check=True
            ).stdout
            m = re.search(rf"^{DONE}(\d+)$", text, re.MULTILINE)
            if m:
                return text[: m.start()].rstrip("\n"), int(m.group(1))
            assert time.monotonic() < deadline, f"{command} did not finish in {timeout_s} s:\n{text}"
            time.sleep(0.2)
    finally:
        subprocess.run([*tmux, "kill-server"], capture_output=True)


def offloadctl(*args: str) -> str:
    return " ".join([shlex.quote(sys.executable), "-m", "offloadctl.cli", *map(shlex.quote, args)])


def run_json(*args: str) -> tuple[dict, subprocess.CompletedProcess]:
    p = subprocess.run(
        [sys.executable, "-m", "offloadctl.cli", *args, "--json"],
        capture_output=True,
        text=True,
        cwd=ROOT,
        env=env_with_root(COLUMNS="80"),
        timeout=120,
    )
    return json.loads(p.stdout), p


def rc(*args: str) -> int:
    return subprocess.run(
        [sys.executable, "-m", "offloadctl.cli", *args],
        capture_output=True,
        text=True,
        cwd=ROOT,
        env=env_with_root(),
        timeout=120,
    ).returncode


# -- plan, for a model that does not fit (issue 46, items 2 and 5) -------------------------------


def _no_fit_screen(*args: str) -> tuple[list[str], str]:
    text, status = screen(
        offloadctl("plan", *args) + " 2>/tmp/plan-stderr-$$; cat /tmp/plan-stderr-$$; rm -f /tmp/plan-stderr-$$"
    )
    assert status == 0, text  # cat's status: the line on stderr comes last
    lines = text.splitlines()
    assert not [line for line in lines if len(line) > 80], text
    assert "--host-cache" not in text and "Traceback" not in text, text
    return lines, text


@needs_tmux
def test_plan_that_does_not_fit_shows_the_table_of_needs_and_what_to_add():
    """1T parameters on the 2-core VM's profile: the plans, what each needs per node (host memory,
    each storage path) against what the node has, the constraint that fails marked, what to add
    in plan's own options; the last line on stderr within 80 columns, naming the first fix."""
    lines, text = _no_fit_screen("--profile", CPU_VM, "--params", "1T")
    header = next(i for i, line in enumerate(lines) if line.startswith("plan "))
    assert re.match(r"plan +host memory +/var/tmp/offloadctl +lacks$", lines[header]), text
    rows = {re.split(r"  +", line.strip())[0]: line for line in lines[header + 2 : header + 9]}
    assert set(rows) == {
        "this node has",
        "defaults",
        "all on disk",
        "all in memory",
        "DS CPU offload",
        "DS Infinity",
        "DS Twin-Flow",
    }, text
    assert re.search(r"12\.9 GB +80 GB$", rows["this node has"]), text
    assert re.search(r"12 TB ! +storage$", rows["defaults"]) and re.search(r"12 TB ! +- +host memory$", rows["all in memory"]), (
        text
    )
    assert rows["DS Twin-Flow"].endswith("a GPU"), text
    fixes = lines[lines.index("To fit, any one of:") + 1 :]
    m = re.fullmatch(r"  --nodes (\d+) \(the model over \1 nodes like this one\)", fixes[0])
    assert m, text
    assert any("offloadctl profile save NAME --nvme PATH" in line for line in fixes), text
    assert lines[-1] == f"offloadctl: no plan fits this node: run on --nodes {m.group(1)} (see above)", text
    nodes = int(m.group(1))  # the least that fits
    assert rc("plan", "--profile", CPU_VM, "--params", "1T", "--nodes", str(nodes)) == 0
    assert rc("plan", "--profile", CPU_VM, "--params", "1T", "--nodes", str(nodes - 1)) == 2


@needs_tmux
def test_plan_short_of_host_memory_says_how_much_to_give():
    """Staging buffers over --host-memory 1MB: the host column is marked, and the least
    --host-memory that fits is said (and does fit), in the table and in the one line."""
    lines, text = _no_fit_screen("--profile", CPU_VM, "--params", "7e9", "--host-memory", "1MB")
    node = next(line for line in lines if line.startswith("this node has"))
    assert re.match(r"this node has +1 MB +80 GB$", node), text
    defaults = next(line for line in lines if line.startswith("defaults "))
    assert re.search(r"MB ! +84 GB ! +host memory, storage$", defaults), text
    m = re.search(r"^  --host-memory (\S+) \(of the node's 25\.8 GB\)$", text, re.MULTILINE)
    assert m, text
    assert lines[-1] == f"offloadctl: no plan fits this node: raise --host-memory to {m.group(1)} (see above)"
    assert rc("plan", "--profile", CPU_VM, "--params", "7e9", "--host-memory", m.group(1)) == 0


def test_plan_json_that_does_not_fit_carries_the_same():
    """--json: fits false, what the node has, each plan's needs and what fails, the fixes; the
    same one line on stderr, exit status 2. A plan that fits says fits true."""
    data, p = run_json("plan", "--profile", H100, "--params", "20T", "--ranks", "8")
    assert p.returncode == 2 and p.stderr.startswith("offloadctl: no plan fits this node: run on --nodes ")
    assert data["fits"] is False and data["plans"] == [] and data["best"] is None
    nf = data["no_fit"]
    assert set(nf["has"]["paths"]) == {"/local/nvme0", "/local/nvme1"} and nf["has"]["host_per_node"] > 0
    needs = {n["name"]: n for n in nf["needs"]}
    assert needs["engine defaults"]["fails"] == ["/local/nvme0", "/local/nvme1"]
    assert needs["all state in host memory"]["fails"] == ["host"]
    for n in needs.values():
        for path, b in n["paths"].items():
            assert (path in n["fails"]) == (b > nf["has"]["paths"][path]), n
        assert ("host" in n["fails"]) == (n["host_per_node"] > nf["has"]["host_per_node"]), n
    nodes = next(f for f in nf["fixes"] if f["option"] == "--nodes")
    assert p.stderr.strip() == f"offloadctl: no plan fits this node: run on --nodes {nodes['value']} (see above)"
    assert {f["option"] for f in nf["fixes"]} <= {"--host-memory", "--nodes", "storage"}
    assert "--host-cache" not in json.dumps(data)
    ok, p = run_json("plan", "--profile", H100, "--params", "7B", "--ranks", "8")
    assert p.returncode == 0 and ok["fits"] is True


def test_the_models_no_fit_messages_name_options_plan_has():
    """perf.model's refusals said `(--host-cache, or --host-memory in plan)`: plan has no
    --host-cache. They name --host-memory, which plan and train both have."""
    from engine.errors import ConfigError
    from perf.model import Plan, Workload, predict
    from perf.profile_toml import load_profile

    profile = load_profile(CPU_VM)
    bare = profile.__class__(**{**profile.__dict__, "paths": ()})
    cases = [
        (bare, Workload(params=10**9), Plan(host_cache_bytes=0)),  # swapped state, no path
        (profile, Workload(params=10**12), Plan(host_cache_bytes=0)),
    ]  # over the path's capacity
    for prof, wl, plan in cases:
        with pytest.raises(ConfigError) as e:
            predict(prof, wl, plan)
        assert "--host-memory" in str(e.value) and "--host-cache" not in str(e.value), str(e.value)
