"""Every way people start DeepSpeed, under ``offloadctl train``: a launch command as given
(torchrun, ``accelerate launch``, a tool that re-executes itself under torchrun, ``python``),
``--launcher torchrun|accelerate`` built from DeepSpeed's options, and ``--module`` /
``--no_python`` of DeepSpeed's own launcher. Real launches, two ranks, gloo on the CPU
accelerator; each compared with the same launcher without offloadctl (stock DeepSpeed).
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import textwrap
import warnings

import pytest
from ds_runs import EXIT_ABORT
from helpers import ROOT, cli, env_with_root, free_port, wait_for

SCRIPTS = os.path.join(ROOT, "tests", "ds_scripts")
COMMUNITY = os.path.join(SCRIPTS, "train_hf_community.py")
ACCEL_STATE = os.path.join(SCRIPTS, "train_accelerate_state.py")
TINY = os.path.join(SCRIPTS, "train_tiny.py")
FAIL = os.path.join(SCRIPTS, "fail_rank.py")
TORCHRUN = [sys.executable, "-m", "torch.distributed.run"]
ACCELERATE = [
    sys.executable,
    "-m",
    "accelerate.commands.launch",
    "--use_deepspeed",
    "--num_processes",
    "2",
    "--zero_stage",
    "3",
    "--offload_optimizer_device",
    "cpu",
]
ENV = {"PATH": os.path.dirname(sys.executable) + os.pathsep + os.environ.get("PATH", "")}
"""torchrun and accelerate as the user's shell finds them: the venv's."""


def _losses(path) -> dict[int, float]:
    with open(path) as f:
        return {r["step"]: r["loss"] for r in map(json.loads, f)}


def _assert_losses_equal(ours: dict, stock: dict) -> None:
    assert ours.keys() == stock.keys() and ours, (ours, stock)
    for step in stock:
        assert ours[step] == pytest.approx(stock[step], rel=1e-4), (step, ours, stock)


def _stock(command: list[str], timeout: float = 600, finished: str | None = None, times: int = 1) -> subprocess.CompletedProcess:
    """A launch command without offloadctl: stock DeepSpeed. With ``finished``, text printed
    ``times`` once every rank is through: a run that printed it and then aborted in the
    interpreter's exit (``EXIT_ABORT``, stock's gloo teardown race, no offloadctl code in the
    process) counts as finished, as ``ds_runs.Finished.ok`` counts it, with a warning."""
    r = subprocess.run(command, capture_output=True, text=True, timeout=timeout, cwd=ROOT, env=env_with_root(**ENV))
    done = finished is not None and r.stdout.count(finished) >= times
    if r.returncode and done and EXIT_ABORT in r.stdout + r.stderr:
        warnings.warn(f"stock aborted at exit after {finished!r} ({EXIT_ABORT!r}); its results are used", stacklevel=2)
        return r
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    return r


def _ours(run_dir, *command: str, opts=("--tuner", "off"), timeout: float = 600, ok=True):
    r = cli("train", "--run-dir", str(run_dir), *opts, *command, timeout=timeout, env=env_with_root(**ENV))
    if ok:
        assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    return r


def _telemetry_ranks(run_dir) -> list[int]:
    """The ranks whose engine wrote telemetry lines in ``run_dir``."""
    out = []
    for rank in range(4):
        path = os.path.join(run_dir, f"telemetry-rank{rank}.jsonl")
        if os.path.exists(path) and sum(1 for line in open(path) if line.strip()):
            out.append(rank)
    return out


def _rank_budget(ranks: int) -> int:
    """The host-lane threads a rank of ``ranks`` on this node gets: its share of the physical cores."""
    from integrations.cores import physical_cores, rank_cores, read_topology

    topology = read_topology()
    return physical_cores(rank_cores(os.sched_getaffinity(0), 0, ranks, topology), topology)


# -- torchrun of an HF Trainer script with a community config ----------------------------------


@pytest.fixture(scope="module")
def community(once, tmp_path_factory):
    """Stock torchrun and ``offloadctl train torchrun`` of the community-config Trainer script, 2
    ranks, 4 steps, a checkpoint every 2, the 16-bit model saved at the end; then ours resumed
    from its step-2 checkpoint."""

    def make():
        base = tmp_path_factory.mktemp("community")
        runs = {}
        for who in ("stock", "ours"):
            d = base / who
            d.mkdir()
            args = [
                COMMUNITY,
                "--steps",
                "4",
                "--losses-out",
                str(d / "l.jsonl"),
                "--output-dir",
                str(d / "out"),
                "--save-steps",
                "2",
                "--save-model",
                str(d / "model"),
            ]
            launch = ["torchrun", "--nproc_per_node", "2", "--master_port", free_port(), *args]
            # "saved:" follows save_model, a collective of every rank.
            r = _stock([*TORCHRUN, *launch[1:]], finished="saved:") if who == "stock" else _ours(d / "run", *launch)
            runs[who] = {"dir": str(d), "stderr": r.stderr, "stdout": r.stdout}
        d = base / "resumed"
        d.mkdir()
        r = _ours(
            d / "run",
            "torchrun",
            "--nproc_per_node",
            "2",
            "--master_port",
            free_port(),
            COMMUNITY,
            "--steps",
            "4",
            "--losses-out",
            str(d / "l.jsonl"),
            "--output-dir",
            str(d / "out"),
            "--resume",
            str(base / "ours" / "out" / "checkpoint-2"),
        )
        runs["resumed"] = {"dir": str(d), "stderr": r.stderr, "stdout": r.stdout}
        return runs

    return once("launchers-community", make)


@pytest.mark.slow
def test_torchrun_of_a_community_config_trainer_script_gives_stocks_losses(community):
    stock, ours = community["stock"], community["ours"]
    _assert_losses_equal(_losses(f"{ours['dir']}/l.jsonl"), _losses(f"{stock['dir']}/l.jsonl"))
    assert open(f"{ours['dir']}/l.jsonl.world").read() == "2"  # the Trainer saw both ranks
    assert "engine active" in ours["stderr"] and _telemetry_ranks(f"{ours['dir']}/run") == [0, 1]
    threads = int(re.search(r"host lane (\d+) thread", ours["stderr"]).group(1))
    assert threads == _rank_budget(2), ours["stderr"]  # the core budget, not torchrun's OMP_NUM_THREADS=1 as such
    assert "OMP_NUM_THREADS" not in ours["stderr"] + ours["stdout"]  # torchrun's banner: to the log
    assert "Setting OMP_NUM_THREADS" in open(f"{ours['dir']}/run/deepspeed.log").read()


@pytest.mark.slow
def test_the_16bit_model_saved_under_torchrun_loads_and_gives_stocks_logits(community):
    import torch
    from transformers import GPT2LMHeadModel

    stock = GPT2LMHeadModel.from_pretrained(f"{community['stock']['dir']}/model")
    ours = GPT2LMHeadModel.from_pretrained(f"{community['ours']['dir']}/model")
    ids = torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(5))  # cpu ok: from_pretrained loads on the CPU
    torch.testing.assert_close(ours(ids).logits, stock(ids).logits)


@pytest.mark.slow
def test_resume_from_checkpoint_under_torchrun_equals_the_uninterrupted_run(community):
    whole = _losses(f"{community['ours']['dir']}/l.jsonl")
    resumed = _losses(f"{community['resumed']['dir']}/l.jsonl")
    assert sorted(resumed) == [3, 4]
    _assert_losses_equal(resumed, {s: whole[s] for s in (3, 4)})


@pytest.mark.slow
def test_sub_group_size_0_is_one_subgroup_per_parameter_as_stock(tmp_path):
    """``sub_group_size: 0`` (LLaMA-Factory's configs): stock's losses, over torchrun."""
    runs = {}
    for who in ("stock", "ours"):
        args = [
            COMMUNITY,
            "--steps",
            "2",
            "--losses-out",
            str(tmp_path / f"{who}.jsonl"),
            "--output-dir",
            str(tmp_path / who),
            "--sub-group-size",
            "0",
        ]
        launch = ["torchrun", "--nproc_per_node", "2", "--master_port", free_port(), *args]
        runs[who] = (
            _stock([*TORCHRUN, *launch[1:]], finished="train_hf_community: rank ", times=2)
            if who == "stock"
            else _ours(tmp_path / "run", *launch)
        )
    _assert_losses_equal(_losses(tmp_path / "ours.jsonl"), _losses(tmp_path / "stock.jsonl"))
    assert "engine active" in runs["ours"].stderr


# -- accelerate launch ---------------------------------------------------------------------------


@pytest.mark.slow
def test_accelerate_launch_gives_stocks_losses_and_save_state_resumes(tmp_path):
    """``accelerate launch --use_deepspeed`` (which runs torch.distributed.run in its own process):
    stock's losses, both ranks' telemetry; ``load_state`` of a ``save_state`` at step 3 goes on
    with the uninterrupted run's losses."""
    tail = ["--steps", "6", "--losses-out"]
    _stock(
        [*ACCELERATE, "--main_process_port", free_port(), ACCEL_STATE, *tail, str(tmp_path / "stock.jsonl")],
        finished="train_accelerate_state: rank ",
        times=2,
    )
    r = _ours(
        tmp_path / "run",
        "accelerate",
        "launch",
        *ACCELERATE[3:],
        "--main_process_port",
        free_port(),
        ACCEL_STATE,
        *tail,
        str(tmp_path / "ours.jsonl"),
        "--save-at",
        "3",
        "--state-dir",
        str(tmp_path / "s"),
    )
    assert "engine active" in r.stderr and _telemetry_ranks(tmp_path / "run") == [0, 1]
    whole = _losses(tmp_path / "ours.jsonl")
    _assert_losses_equal(whole, _losses(tmp_path / "stock.jsonl"))
    _ours(
        tmp_path / "run2",
        "accelerate",
        "launch",
        *ACCELERATE[3:],
        "--main_process_port",
        free_port(),
        ACCEL_STATE,
        *tail,
        str(tmp_path / "resumed.jsonl"),
        "--resume",
        str(tmp_path / "s"),
    )
    resumed = _losses(tmp_path / "resumed.jsonl")
    assert sorted(resumed) == [4, 5, 6]
    _assert_losses_equal(resumed, {s: whole[s] for s in (4, 5, 6)})


# -- torchrun of a plain DeepSpeed script: re-executed, across nodes, python ---------------------


@pytest.fixture(scope="module")
def stock_tiny(once, tmp_path_factory):
    def make():
        d = tmp_path_factory.mktemp("stock-tiny")
        _stock(
            [
                *TORCHRUN,
                "--nproc_per_node",
                "2",
                "--master_port",
                free_port(),
                TINY,
                "--steps",
                "3",
                "--losses-out",
                str(d / "l.jsonl"),
            ],
            finished="train_tiny: rank ",
            times=2,
        )
        return _losses(d / "l.jsonl")

    return once("launchers-stock-tiny", make)


@pytest.mark.slow
def test_a_tool_that_reexecutes_under_torchrun_gets_the_engine_in_every_rank(tmp_path, stock_tiny):
    """LLaMA-Factory's CLI starts ``torchrun`` in a subprocess: its ranks get the engine."""
    tool = tmp_path / "bin" / "llamafactory-cli"
    tool.parent.mkdir()
    tool.write_text(
        f"#!{sys.executable}\n"
        + textwrap.dedent(f"""\
        import subprocess, sys
        sys.exit(subprocess.call([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2",
                                  "--master_port", "{free_port()}", {TINY!r}] + sys.argv[2:]))
        """)
    )
    tool.chmod(0o755)
    r = _ours(tmp_path / "run", str(tool), "train", "--steps", "3", "--losses-out", str(tmp_path / "l.jsonl"))
    assert "engine active" in r.stderr and _telemetry_ranks(tmp_path / "run") == [0, 1]
    _assert_losses_equal(_losses(tmp_path / "l.jsonl"), stock_tiny)


@pytest.mark.slow
def test_torchrun_across_two_nodes_meets_at_its_rendezvous(tmp_path, stock_tiny):
    """``torchrun --nnodes 2 --node_rank N``, one ``offloadctl train`` per node (here both on this
    machine): the engine on each, the losses of stock's two ranks."""
    port = free_port()
    procs = []
    for node in (0, 1):
        cmd = [
            sys.executable,
            "-m",
            "offloadctl.cli",
            "train",
            "--run-dir",
            str(tmp_path / f"run{node}"),
            "--tuner",
            "off",
            "torchrun",
            "--nnodes",
            "2",
            "--node_rank",
            str(node),
            "--nproc_per_node",
            "1",
            "--master_addr",
            "127.0.0.1",
            "--master_port",
            port,
            TINY,
            "--steps",
            "3",
            "--losses-out",
            str(tmp_path / f"l{node}"),
        ]
        procs.append(
            subprocess.Popen(cmd, cwd=ROOT, env=env_with_root(**ENV), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        )
    outs = [p.communicate(timeout=600) for p in procs]
    assert [p.returncode for p in procs] == [0, 0], outs
    assert all("engine active" in err for _, err in outs[:1])
    assert _telemetry_ranks(tmp_path / "run0") == [0] and _telemetry_ranks(tmp_path / "run1") == [1]
    _assert_losses_equal(_losses(tmp_path / "l0"), stock_tiny)


@pytest.mark.slow
def test_python_runs_the_script_as_one_rank_and_module_and_no_python_reach_the_ranks(tmp_path):
    """``offloadctl train python script.py``: rank 0 of one, with the engine (stock DeepSpeed would
    look for MPI there). DeepSpeed's ``--module`` (python -m) and ``--no_python`` (the script as a
    program) give the losses of the plain script."""
    args = ["--steps", "2", "--losses-out"]
    r = _ours(tmp_path / "p", "python", TINY, *args, str(tmp_path / "python.jsonl"))
    assert "starting 1 rank of train_tiny.py" in r.stderr and "engine active" in r.stderr
    _ours(tmp_path / "plain", "--num_gpus", "1", "--master_port", free_port(), TINY, *args, str(tmp_path / "plain.jsonl"))
    plain = _losses(tmp_path / "plain.jsonl")
    _assert_losses_equal(_losses(tmp_path / "python.jsonl"), plain)
    pkg = tmp_path / "pkg"
    pkg.mkdir()
    (pkg / "train_mod.py").write_text(open(TINY).read())
    program = tmp_path / "train_prog"
    program.write_text(f"#!{sys.executable}\n" + open(TINY).read())
    program.chmod(0o755)
    for how, what in (("module", ["--module", "pkg.train_mod"]), ("no_python", ["--no_python", str(program)])):
        r = subprocess.run(
            [
                sys.executable,
                "-m",
                "offloadctl.cli",
                "train",
                "--run-dir",
                str(tmp_path / how),
                "--tuner",
                "off",
                "--num_gpus",
                "1",
                "--master_port",
                free_port(),
                *what,
                *args,
                str(tmp_path / f"{how}.jsonl"),
            ],
            env=env_with_root(**ENV),
            cwd=tmp_path,
            capture_output=True,
            text=True,
            timeout=600,
        )
        assert r.returncode == 0 and "engine active" in r.stderr, r.stderr[-3000:]
        _assert_losses_equal(_losses(tmp_path / f"{how}.jsonl"), plain)


# -- what a user sees when it goes wrong -----------------------------------------------------------


@pytest.mark.slow
def test_a_failed_rank_under_torchrun_is_one_line(tmp_path):
    r = _ours(
        tmp_path / "run",
        "torchrun",
        "--nproc_per_node",
        "2",
        "--master_port",
        free_port(),
        FAIL,
        "--rank",
        "1",
        "--at",
        "2",
        ok=False,
    )
    assert r.returncode == 1
    lines = [x for x in r.stderr.splitlines() if x.startswith("offloadctl: rank")]
    assert lines == [
        f"offloadctl: rank 1 failed first, exit status 1: ValueError: bad batch at step 2 on rank 1; the "
        f"full log is in {tmp_path}/run/deepspeed.log"
    ], r.stderr
    assert "Traceback" not in r.stderr + r.stdout and "ChildFailedError" not in r.stderr
    log = open(tmp_path / "run" / "deepspeed.log").read()
    assert "ChildFailedError" in log and "[rank1]: Traceback" in log


@pytest.mark.slow
def test_a_rendezvous_port_in_use_under_torchrun_is_one_line_and_the_retry_takes_the_run_dir(tmp_path):
    import socket

    port = free_port()
    with socket.socket() as held:
        held.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        held.bind(("", int(port)))
        held.listen()
        r = _ours(
            tmp_path / "run",
            "torchrun",
            "--nproc_per_node",
            "2",
            "--master_port",
            port,
            TINY,
            "--steps",
            "2",
            "--losses-out",
            str(tmp_path / "l"),
            ok=False,
        )
    assert r.returncode != 0
    assert r.stderr.splitlines()[-1] == (
        f"offloadctl: the rendezvous port {port} is in use on this machine (another "
        f"run, or another program): give a free one (--master_port); the full log is "
        f"in {tmp_path}/run/deepspeed.log"
    ), r.stderr
    assert "Traceback" not in r.stderr
    again = _ours(
        tmp_path / "run",
        "torchrun",
        "--nproc_per_node",
        "2",
        "--master_port",
        free_port(),
        TINY,
        "--steps",
        "2",
        "--losses-out",
        str(tmp_path / "l"),
    )
    assert "engine active" in again.stderr


@pytest.mark.slow
def test_a_config_the_ranks_refuse_under_torchrun_is_one_line_and_its_run_dir_takes_the_retry(tmp_path):
    """A config built inside the script (train_tiny's --stage) can only be refused by the ranks:
    in the pre-launch check's words, once; the same command's retry takes the run dir it left."""
    cmd = [
        "torchrun",
        "--nproc_per_node",
        "2",
        "--master_port",
        free_port(),
        TINY,
        "--steps",
        "2",
        "--losses-out",
        str(tmp_path / "l"),
    ]
    r = _ours(tmp_path / "run", *cmd, "--stage", "2", ok=False)
    assert r.returncode != 0 and "Traceback" not in r.stderr
    ours = [x for x in r.stderr.splitlines() if x.startswith("offloadctl:") and "starting" not in x]
    assert ours == [
        "offloadctl: offloadctl's engine needs ZeRO stage 3, but this ds_config uses stage 2: set "
        "zero_optimization.stage to 3, or use engine.OffloadAdamW in a plain PyTorch loop"
    ], r.stderr
    again = _ours(tmp_path / "run", *cmd)
    assert "engine active" in again.stderr


@pytest.mark.slow
def test_ctrl_c_under_torchrun_stops_every_process_and_removes_the_swap_files(tmp_path):
    nvme = tmp_path / "nvme"
    nvme.mkdir()
    cmd = [
        sys.executable,
        "-m",
        "offloadctl.cli",
        "train",
        "--run-dir",
        str(tmp_path / "run"),
        "--tuner",
        "off",
        "--nvme",
        str(nvme),
        "torchrun",
        "--nproc_per_node",
        "2",
        "--master_port",
        free_port(),
        FAIL,
        "--rank",
        "9",
    ]
    p = subprocess.Popen(
        cmd, cwd=ROOT, env=env_with_root(**ENV), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True
    )
    try:
        wait_for(
            lambda: (
                os.path.exists(tmp_path / "run" / "telemetry-rank1.jsonl")
                and sum(1 for _ in open(tmp_path / "run" / "telemetry-rank1.jsonl")) > 3
            ),
            300,
            "the ranks to step",
        )
        os.killpg(p.pid, signal.SIGINT)  # the terminal's Ctrl-C: the whole foreground group
        out, err = p.communicate(timeout=180)
    finally:
        if p.poll() is None:
            os.killpg(p.pid, signal.SIGKILL)
    assert p.returncode == 128 + signal.SIGINT, err[-3000:]
    assert "offloadctl: stopped by SIGINT: ranks stopped, their swap files removed" in err.splitlines()
    assert "Traceback" not in err and "SignalException" not in err
    assert "interrupted by SIGINT" in out + err
    assert not [f for _, _, fs in os.walk(nvme) for f in fs], "swap files left behind"
    ps = subprocess.run(["pgrep", "-f", str(tmp_path / "run")], capture_output=True, text=True)
    assert ps.stdout.strip() == "", "processes left behind"


# -- refusals and dry runs (no launch) -------------------------------------------------------------


def _refused(*args: str) -> str:
    r = cli("train", *args, env=env_with_root(**ENV), timeout=120)
    assert r.returncode == 2 and r.stdout == "" and len(r.stderr.splitlines()) == 1, r.stdout + r.stderr
    return r.stderr.strip()


@pytest.mark.slow
def test_what_cannot_launch_is_refused_in_one_line(tmp_path):
    known = _refused("--launcher", "mosaic", TINY)
    assert known.startswith("offloadctl: --launcher mosaic: offloadctl knows torchrun, accelerate") and "pdsh" in known
    assert _refused("--num_gpus", "2", "torchrun", "--nproc_per_node", "2", TINY) == (
        "offloadctl: --num_gpus is an option of DeepSpeed's launcher, which torchrun (a launch command run as "
        "given) does not use: give torchrun's own option in its command instead"
    )
    assert _refused("--launcher", "torchrun", "--hostfile", "h", TINY).startswith("offloadctl: --hostfile is an option")
    assert _refused("srun", "-n", "2", "python", TINY).startswith("offloadctl: srun is not installed here")
    assert _refused("--module", "nosuch.mod").startswith("offloadctl: module nosuch.mod not found from")
    script = tmp_path / "s.py"
    script.write_text("")
    assert "is not executable, and --no_python runs it as a program" in _refused("--no_python", str(script))
    assert _refused(TINY, "--deepspeed_config", "nosuch.json") == (
        "offloadctl: nosuch.json does not exist (the script's --deepspeed_config): check the path"
    )
    (tmp_path / "bad.json").write_text('{"zero_optimization": {"stage": 3,}}')
    assert _refused("torchrun", TINY, "--deepspeed", str(tmp_path / "bad.json")) == (
        f"offloadctl: {tmp_path}/bad.json line 1 column 35: not valid JSON (Expecting property name enclosed in "
        f"double quotes; the script's --deepspeed): fix the file"
    )


def _dry(*args: str) -> dict:
    r = cli("train", "--dry-run", "--json", *args, env=env_with_root(**ENV), timeout=120)
    assert r.returncode == 0, r.stderr
    return json.loads(r.stdout)


@pytest.mark.slow
def test_dry_runs_show_the_command_each_launcher_runs():
    tail = [TINY, "--losses-out", "x"]
    built = _dry(
        "--launcher", "torchrun", "--num_gpus", "2", "--master_port", "23456", "--launcher_args", "--max_restarts 1", *tail
    )
    assert built["command"] == [*TORCHRUN, "--nproc_per_node", "2", "--master_port", "23456", "--max_restarts", "1", *tail]
    hook = os.path.join(ROOT, "integrations", "rank_hook")
    assert built["env"]["PYTHONPATH"].split(os.pathsep)[:2] == [hook, ROOT] and built["launcher"] == "torchrun"
    assert json.loads(built["env"]["OFFLOADCTL_RANK_SETTINGS"]) == built["settings"]
    accel = _dry(
        "--launcher", "accelerate", "--num_gpus", "2", "--num_nodes", "2", "--node_rank", "1", "--master_addr", "10.0.0.1", *tail
    )
    assert accel["command"] == [
        sys.executable,
        "-m",
        "accelerate.commands.launch",
        "--use_deepspeed",
        "--num_processes",
        "4",
        "--num_machines",
        "2",
        "--machine_rank",
        "1",
        "--main_process_ip",
        "10.0.0.1",
        *tail,
    ]
    module = _dry("--launcher", "torchrun", "--num_gpus", "2", "--module", "tests.ds_scripts.train_tiny", "--x")
    assert module["command"][-4:] == ["2", "--module", "tests.ds_scripts.train_tiny", "--x"]
    given = _dry("torchrun", "--nproc_per_node", "2", *tail)
    assert given["command"] == [os.path.join(os.path.dirname(sys.executable), "torchrun"), "--nproc_per_node", "2", *tail]
    r = cli("train", "--dry-run", "torchrun", "--nproc_per_node", "2", *tail, env=env_with_root(**ENV), timeout=120)
    text = " ".join(r.stdout.split())
    assert "ranks: 2 ranks" in text and "(torchrun; each rank's interpreter installs offloadctl's engine" in text, text
    r = cli("train", "--dry-run", "python", *tail, env=env_with_root(**ENV), timeout=120)
    assert "ranks:     1 rank\n" in r.stdout, r.stdout


# -- the rank hook's parts -------------------------------------------------------------------------


def test_the_program_an_interpreter_runs_is_read_from_its_command_line():
    from integrations.rank_entry import main_program

    py = "/v/bin/python"
    assert main_program([py, "-u", "t.py", "--a", "1"]) == ("script", "t.py", ["--a", "1"])
    assert main_program([py, "-X", "dev", "-W", "error", "-B", "t.py"]) == ("script", "t.py", [])
    assert main_program([py, "-uBm", "pkg.mod", "-x"]) == ("module", "pkg.mod", ["-x"])
    assert main_program([py, "-mpkg.mod", "-x"]) == ("module", "pkg.mod", ["-x"])
    assert main_program([py, "-c", "print(1)"]) is None and main_program([py]) is None
    assert main_program([py, "-", "x"]) is None


def test_only_a_numbered_interpreter_that_is_no_launcher_and_no_ranks_child_is_a_rank():
    from integrations.rank_entry import ARMED_ENV, SETTINGS_ENV, is_rank

    env = {SETTINGS_ENV: "{}", "RANK": "1"}
    assert is_rank(env, ["python", "-u", "train.py"])
    assert not is_rank({**env, ARMED_ENV: "123"}, ["python", "-u", "train.py"])  # a process the rank started
    assert not is_rank({SETTINGS_ENV: "{}"}, ["python", "train.py"])  # nobody numbered it
    assert is_rank({SETTINGS_ENV: "{}", "SLURM_PROCID": "3"}, ["python", "train.py"])
    assert is_rank({SETTINGS_ENV: "{}", "OMPI_COMM_WORLD_RANK": "0"}, ["python", "train.py"])
    for launcher in (
        ["/v/bin/python", "/v/bin/torchrun", "x.py"],
        ["python", "-m", "torch.distributed.run", "x.py"],
        ["python", "/v/bin/accelerate", "launch", "x.py"],
        ["python", "-m", "deepspeed.launcher.launch"],
        ["python", "/usr/bin/llamafactory-cli", "train"],
    ):
        assert not is_rank({**env, "SLURM_PROCID": "0"}, launcher), launcher
    assert not is_rank({"RANK": "0"}, ["python", "train.py"])  # not a launch of offloadctl's


def test_a_launchers_one_thread_per_rank_gives_way_to_the_ranks_share_unless_the_user_set_it():
    from integrations.rank_entry import USER_OMP_ENV, launcher_threads

    cpus = len(os.sched_getaffinity(0))
    env = {"OMP_NUM_THREADS": "1", "LOCAL_WORLD_SIZE": "1", USER_OMP_ENV: "0"}
    launcher_threads(env)
    assert env["OMP_NUM_THREADS"] == str(cpus)
    env = {"OMP_NUM_THREADS": "1", "LOCAL_WORLD_SIZE": "1", USER_OMP_ENV: "1"}
    launcher_threads(env)
    assert env["OMP_NUM_THREADS"] == "1"


def test_the_hook_runs_the_sitecustomize_it_shadows_and_leaves_other_processes_alone(tmp_path):
    """A venv's or site's own sitecustomize still runs; a process that is not a rank runs its
    program untouched."""
    (tmp_path / "sitecustomize.py").write_text("import os\nos.environ['SHADOWED_RAN'] = '1'\n")
    hook = os.path.join(ROOT, "integrations", "rank_hook")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([hook, ROOT, str(tmp_path)]), OFFLOADCTL_RANK_SETTINGS="{}")
    r = subprocess.run(
        [sys.executable, "-c", "import os, sys; print(os.environ.get('SHADOWED_RAN'), sys.argv[1:])", "a"],
        capture_output=True,
        text=True,
        env=env,
        timeout=60,
    )
    assert r.returncode == 0 and r.stdout == "1 ['a']\n", r.stderr


def test_torchruns_failure_report_goes_to_the_log_and_names_the_first_failed_rank():
    """torch elastic's page for a failed rank (its log line, the agent's ChildFailedError
    traceback and table) is the launcher's: to the log; the first failed rank is taken from it."""
    import io

    from integrations.run_output import OutputFilter

    page = (
        b"E1201 19:40:01.123000 8343 torch/distributed/elastic/multiprocessing/api.py:882] failed (exitcode: 1) "
        b"local_rank: 1 (pid: 99) of binary: /v/bin/python\n"
        b"Traceback (most recent call last):\n"
        b'  File "/v/bin/torchrun", line 8, in <module>\n'
        b"    sys.exit(main())\n"
        b'  File "/v/lib/python3.11/site-packages/torch/distributed/run.py", line 892, in main\n'
        b"    run(args)\n"
        b"torch.distributed.elastic.multiprocessing.errors.ChildFailedError: \n"
        b"============================================================\n"
        b"fail_rank.py FAILED\n"
        b"------------------------------------------------------------\n"
        b"Root Cause (first observed failure):\n"
        b"[0]:\n"
        b"  rank      : 1 (local_rank: 1)\n"
        b"  exitcode  : 1 (pid: 99)\n"
        b"============================================================\n"
    )
    users = b'Traceback (most recent call last):\n  File "/home/me/t.py", line 3, in <module>\nValueError: mine\n'
    # a lone rank's own traceback, then its launcher's: the rank's is shown, the launcher's logged
    accelerate = (
        b'Traceback (most recent call last):\n  File "/v/bin/accelerate", line 8, in <module>\n'
        b'  File "/v/lib/python3.11/site-packages/accelerate/commands/launch.py", line 999, in simple\n'
        b"subprocess.CalledProcessError: Command '['python', 't.py']' returned non-zero exit status 1.\n"
    )
    shown, log = io.BytesIO(), io.BytesIO()
    f = OutputFilter(shown, log)
    f.feed(users + accelerate)
    f.close()
    assert (shown.getvalue(), log.getvalue()) == (users, accelerate)
    data = b"step 1\n" + page + users + b"bye\n"
    for cut in range(1, len(data)):
        shown, log = io.BytesIO(), io.BytesIO()
        f = OutputFilter(shown, log)
        f.feed(data[:cut])
        f.feed(data[cut:])
        f.close()
        assert shown.getvalue() == b"step 1\n" + users + b"bye\n", cut
        assert log.getvalue() == page
        assert f.failures.first == (1, 1)


def test_a_port_taken_between_the_check_and_the_bind_is_one_line_naming_it():
    """The race that the launch's port check cannot close (the port free at the check, taken
    before the rank's store binds it): the rank's one line, or a lone rank's traceback, ends
    the run in one line naming the port."""
    import io

    from integrations.run_output import OutputFilter

    error = (
        b"torch.distributed.DistNetworkError: The server socket has failed to listen on any local network "
        b"address. port: 29517, useIpv6: false, code: -98, name: EADDRINUSE, message: address already in use\n"
    )
    rank_line = b"offloadctl: rank 0 failed: " + error.split(b": ", 1)[1].replace(b"\n", b"") + b"\n"
    traceback = (
        b'Traceback (most recent call last):\n  File "/home/me/train.py", line 9, in <module>\n'
        b"    deepspeed.init_distributed()\n" + error
    )
    for page in (rank_line, traceback):
        shown, log = io.BytesIO(), io.BytesIO()
        f = OutputFilter(shown, log)
        f.feed(b"step 0\n" + page)
        f.close()
        assert shown.getvalue() == b"step 0\n" and log.getvalue() == page
        assert f.failures.summary("/r/deepspeed.log") == (
            "offloadctl: the rendezvous port 29517 is in use on this machine (another run, or another program): "
            "give a free one (--master_port); the full log is in /r/deepspeed.log"
        )


@pytest.mark.slow
def test_the_dry_run_says_how_many_ranks_a_launch_without_num_gpus_starts():
    """Without --num_gpus DeepSpeed's launcher starts a rank per local slot: the node's GPUs, else
    the CPU accelerator's NUMA nodes. The dry run (and the start line) say the number."""
    from integrations.launch_commands import local_slots

    n = local_slots()
    r = cli("train", "--dry-run", TINY, "--losses-out", "x", timeout=120)
    assert f"ranks:     {n} rank{'s' if n != 1 else ''}\n" in r.stdout, r.stdout
    assert "GPU slot" not in r.stdout


@pytest.mark.slow
@pytest.mark.parametrize("launcher", ["deepspeed", "torchrun"])
def test_a_stop_signal_while_a_rank_reports_its_error_is_no_traceback(launcher, tmp_path):
    """DeepSpeed's launcher (and torchrun) stop the ranks with SIGTERM as soon as one fails; one
    that arrives while a rank is still saying its own error unwinds that rank in one line, with
    no traceback (it escaped the rank's error handling before: torch's excepthook printed
    `[rank1]: Traceback ...` on the terminal)."""
    script = [FAIL, "--rank", "1", "--at", "2", "--how", "signalled-while-said"]
    launch = (
        ["--num_gpus", "2", "--master_port", free_port(), *script]
        if launcher == "deepspeed"
        else ["torchrun", "--nproc_per_node", "2", "--master_port", free_port(), *script]
    )
    r = _ours(tmp_path / "run", *launch, ok=False)
    assert r.returncode != 0
    assert "Traceback" not in r.stderr + r.stdout, r.stderr[-3000:]
    assert "failed first" in r.stderr, r.stderr[-3000:]
    if launcher == "deepspeed":  # torch elastic may name rank 0 first: its collective failed as rank 1 stopped
        assert "offloadctl: rank 1 failed first" in r.stderr and "stopped by SIGTERM" in r.stderr, r.stderr[-3000:]


def _filtered_in_two(data: bytes, cut: int) -> tuple[bytes, bytes]:
    """What the filter shows and logs of ``data`` handed over in two reads, split at ``cut``."""
    import io

    from integrations.run_output import OutputFilter

    shown, log = io.BytesIO(), io.BytesIO()
    f = OutputFilter(shown, log)
    f.feed(data[:cut])
    f.feed(data[cut:])
    f.close()
    return shown.getvalue(), log.getvalue()


def test_a_logging_error_of_torchruns_agent_on_ctrl_c_goes_to_the_log():
    """Ctrl-C's SIGINT can reach torch elastic's agent while its logger writes: the signal
    handler's SignalException inside the handler's write makes Python's logging print its own
    report ("--- Logging error ---", a traceback through torch elastic, the call stack, the
    record). It is the launcher's: to the log, whole; the same block from the user's code is shown."""
    import io

    from integrations.run_output import OutputFilter

    block = (
        b"--- Logging error ---\n"
        b"Traceback (most recent call last):\n"
        b'  File "/usr/lib/python3.11/logging/__init__.py", line 1113, in emit\n'
        b"    stream.write(msg + self.terminator)\n"
        b'  File "/v/lib/python3.11/site-packages/torch/distributed/elastic/multiprocessing/api.py", line 83, in '
        b"_terminate_process_handler\n"
        b'    raise SignalException(f"Process {os.getpid()} got signal: {sigval}", sigval=sigval)\n'
        b"torch.distributed.elastic.multiprocessing.api.SignalException: Process 9 got signal: 2\n"
        b"Call stack:\n"
        b'  File "/v/bin/torchrun", line 8, in <module>\n'
        b"    sys.exit(main())\n"
        b'  File "/v/lib/python3.11/site-packages/torch/distributed/elastic/agent/server/api.py", line 745, in run\n'
        b"    result = self._invoke_run(role)\n"
        b"Message: 'Received %s death signal, shutting down workers'\n"
        b"Arguments: (<Signals.SIGINT: 2>,)\n"
    )
    end = b"offloadctl: stopped by SIGINT: ranks stopped, their swap files removed\n"
    data = b"step 3\n" + block + end
    for cut in range(1, len(data), 7):
        assert _filtered_in_two(data, cut) == (b"step 3\n" + end, block), cut
    users = block.replace(b"torch/distributed/elastic", b"home/me").replace(b"/v/bin/torchrun", b"/home/me/t.py")
    shown, log = io.BytesIO(), io.BytesIO()
    f = OutputFilter(shown, log)
    f.feed(users + b"bye\n")
    f.close()
    assert shown.getvalue() == users + b"bye\n"


def test_a_ranks_line_is_written_with_its_newline_in_one_write(monkeypatch):
    """As ``python -u`` writes stderr (write-through, unbuffered): ``say_line`` hands the line
    and its newline over in one write, where ``print`` makes two."""
    import io

    from engine.text import say_line

    class Writes(io.RawIOBase):
        def __init__(self):
            self.calls: list[bytes] = []

        def writable(self):
            return True

        def write(self, b):
            self.calls.append(bytes(b))
            return len(b)

    raw = Writes()
    monkeypatch.setattr(sys, "stderr", io.TextIOWrapper(raw, write_through=True))
    say_line("offloadctl: rank 1 stopped by SIGINT; removing its swap files")
    assert raw.calls == [b"offloadctl: rank 1 stopped by SIGINT; removing its swap files\n"]
    print("x", file=sys.stderr, flush=True)
    assert raw.calls[1:] == [b"x", b"\n"]  # the way that let torchrun's bytes in between


def test_a_ranks_newline_written_apart_inside_torchruns_traceback_leaves_it_whole():
    """A rank run unbuffered wrote its stop line and its newline apart (``print`` under
    ``python -u``), and torchrun's frame landed between them: the frame ends the rank's line,
    and the rank's newline comes as a blank line among torchrun's frames. That blank line is
    not the traceback's end: the rest of it (its frames, the SignalException of offloadctl's
    SIGTERM) goes to the log with it, as it came."""

    head = (
        b"Traceback (most recent call last):\n"
        b'  File "/v/lib/python3.11/site-packages/torch/distributed/elastic/agent/server/api.py", line 923, in _invoke_run\n'
        b"    time.sleep(monitor_interval)\n"
    )
    merged = (
        b"offloadctl: rank 1 stopped by SIGINT; removing its swap files"
        b'  File "/v/lib/python3.11/site-packages/torch/distributed/elastic/multiprocessing/api.py", line 86, in '
        b"_terminate_process_handler\n"
    )
    tail = (
        b"\n"
        b'    raise SignalException(f"Process {os.getpid()} got signal: {sigval}", sigval=sigval)\n'
        b"torch.distributed.elastic.multiprocessing.api.SignalException: Process 9 got signal: 15\n"
    )
    data = b"step 3\n" + head + merged + tail
    for cut in range(1, len(data), 11):
        assert _filtered_in_two(data, cut) == (b"step 3\n", merged + head + tail), cut


def test_a_ranks_line_written_into_torchruns_traceback_leaves_it_whole():
    """Every process of the run writes to one stream: a rank's line of its stop can land between
    the frames of torchrun's traceback (Ctrl-C, then offloadctl's SIGTERM to torchrun as it
    shuts its workers down). The rank's line is sorted as its own; the traceback stays whole,
    to the log."""
    import io

    from integrations.run_output import OutputFilter

    head = (
        b"Traceback (most recent call last):\n"
        b'  File "/v/lib/python3.11/site-packages/torch/distributed/elastic/agent/server/api.py", line 745, in run\n'
    )
    rank = b"offloadctl: rank 1 stopped by SIGINT; removing its swap files\n"
    tail = (
        b"    result = self._invoke_run(role)\n"
        b"torch.distributed.elastic.multiprocessing.api.SignalException: Process 9 got signal: 15\n"
    )
    shown, log = io.BytesIO(), io.BytesIO()
    f = OutputFilter(shown, log)
    f.feed(b"step 3\n" + head + rank + tail + b"bye\n")
    f.close()
    assert shown.getvalue() == b"step 3\nbye\n"  # the rank's stop line is the run's, said at its end
    assert log.getvalue() == rank + head + tail
