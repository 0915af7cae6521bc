"""Real DeepSpeed trainings for the tests, each configuration launched once per test session.

A launch (a DeepSpeed launcher, a rank per GPU slot, imports before the first step) costs tens of
seconds here, and many tests need the same one: stock DeepSpeed's losses for a dtype and rank
count, a checkpoint saved at step 3, a recorded run to report on. A test describes the run it
needs as a :class:`Launch` (:func:`stock` or :func:`ours`) and asks the session's
:class:`DSRuns` (the ``ds_runs`` fixture) for it: the first asker runs it, every later asker gets
the same :class:`Finished` run (its output, losses, run dir and checkpoint). With pytest-xdist the
workers share the runs through a lock file per run, so each runs once in the whole session.

A run's files are shared: a test that changes them (damages a checkpoint, converts it) works on a
copy (:meth:`Finished.copy_of`). A run that is itself the thing under test (one that must fail,
or be signalled) is launched with :func:`launch`, uncached, into the test's own directory.

Golden references: a stock run that is a fixed function of its script, its arguments, the seed
and what computes it (DeepSpeed's and torch's versions, the CPU's instruction set) is kept under
``tests/data/golden`` (:data:`GOLDEN`, made by ``tests/make_golden.py``, as torchtitan keeps loss
curves) and read from there by :meth:`DSRuns.reference` where it was made with what this machine
has; elsewhere that stock run is launched live. The stock runs of every dtype and rank count
(:func:`baseline`) always run live.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import shutil
import signal
import subprocess
import sys
import warnings
from pathlib import Path

from helpers import ROOT, env_with_root, free_port

TINY = os.path.join(ROOT, "tests", "ds_scripts", "train_tiny.py")
GPT = os.path.join(ROOT, "examples", "train_gpt.py")
TINY_CACHE = "2kB"
"""--host-cache of :func:`ours` (per rank): train_tiny's smallest subgroups in host memory, the rest on NVMe."""
LAUNCH_TIMEOUT_S = 600
EXIT_ABORT = "terminate called without an active exception"
EXIT_ABORT_RC = 256 - 6  # a rank killed by SIGABRT, as DeepSpeed's launcher exits with it
SAVE = ("--save-at", "3", "--ckpt-dir", "{dir}/ckpt")
"""Script options: save a checkpoint after step 3 into the run's ``ckpt`` (tag ``ckpt``)."""

# The GPU path's tiers, run on the CPU. Subgroups of train_tiny.py: 24.6, 53.2, 8.2 and 4.1 kB of
# state. A 30 kB device tier holds the first and the last (placement fills it in order, skipping
# what does not fit); the device lane takes one of the other two, swapped, one of them read each
# step. With two ranks each holds half of every parameter: a 20 kB tier holds the first two, the
# lane the rest.
LANE_ON_CPU = (
    "--lane-device",
    "cpu",
    "--device-cache",
    "30kB",
    "--device-fraction",
    "0.5",
    "--prefetch-depth",
    "0",
    "--tuner",
    "off",
)
LANE_ON_CPU_2 = (
    "--lane-device",
    "cpu",
    "--device-cache",
    "20kB",
    "--device-fraction",
    "1.0",
    "--prefetch-depth",
    "0",
    "--tuner",
    "off",
)
TWO_PATHS = ("--nvme", "{dir}/nvme1", "--host-cache", "0")
"""State split over two paths, none in host memory."""
LAYOUTS = {
    "nvme-and-host": (),
    "all-nvme": ("--host-cache", "0"),
    "lane-on-cpu": LANE_ON_CPU,
    "all-host": ("--host-cache", "1GB"),
    "two-paths": TWO_PATHS,
}
"""Where the state lives in :func:`ours` runs, by name (``opts``)."""


@dataclasses.dataclass(frozen=True)
class Checkpoint:
    """The checkpoint a cached run saved (``--ckpt-dir {dir}/ckpt``, tag ``ckpt``), as a run that
    resumes from it names it: ``{ckpt}`` in that run's strings, the checkpoint directory."""

    saver: "Launch"
    universal: bool = False
    """Converted by DeepSpeed's ds_to_universal first: tag ``universal`` beside ``ckpt``, in a copy."""


@dataclasses.dataclass(frozen=True)
class Launch:
    """One training run of a test script. In every string, ``{dir}`` stands for the run's own
    directory (``{dir}/nvme`` and ``{dir}/nvme1`` exist before it starts), and ``{ckpt}`` for
    the directory of ``ckpt`` (:meth:`DSRuns.checkpoint`)."""

    who: str
    """'stock' (DeepSpeed's launcher) or 'ours' (``offloadctl train``, whatever its ``opts`` say)."""
    ranks: int = 1
    script_args: tuple[str, ...] = ()
    opts: tuple[str, ...] = ()
    """``offloadctl train`` options, before the script."""
    script: str = TINY
    env: tuple[tuple[str, str], ...] = ()
    """Variables added to the environment."""
    ckpt: Checkpoint | None = None
    """The cached run's checkpoint this one resumes from."""

    @property
    def losses_out(self) -> bool:
        return self.script.startswith(os.path.join(ROOT, "tests", "ds_scripts"))

    def argv(self, run_dir: str, port: str, ckpt_dir: str = "{ckpt}") -> list[str]:
        fill = lambda args: [a.replace("{dir}", run_dir).replace("{ckpt}", ckpt_dir) for a in args]  # noqa: E731
        launcher = ["--num_gpus", str(self.ranks), "--master_port", port]
        tail = [self.script, *(["--losses-out", f"{run_dir}/losses.jsonl"] if self.losses_out else []), *fill(self.script_args)]
        if self.who == "stock":
            return [sys.executable, "-m", "deepspeed.launcher.runner", *launcher, *tail]
        return [sys.executable, "-m", "offloadctl.cli", "train", *launcher, *fill(self.opts), *tail]

    def _fields(self, portable: bool) -> dict:
        """The fields, ``ckpt`` left out where there is none (the names of runs without one stay
        as they were before it existed); ``portable``: scripts by their path in the checkout."""
        d = {f.name: getattr(self, f.name) for f in dataclasses.fields(self) if f.name != "ckpt"}
        if portable:
            d["script"] = os.path.relpath(self.script, ROOT)
        if self.ckpt is not None:
            d["ckpt"] = {"saver": self.ckpt.saver._fields(portable), "universal": self.ckpt.universal}
        return d

    def _name(self, portable: bool) -> str:
        text = json.dumps(self._fields(portable), sort_keys=True)
        return f"{self.who[0]}{self.ranks}-{hashlib.sha256(text.encode()).hexdigest()[:8]}"

    def key(self) -> str:
        """A directory name unique to the launch, and short: paths in its output are printed whole,
        and the tests hold that output to 80 columns (its ``finished.json`` gives the command)."""
        return self._name(portable=False)

    def golden_name(self) -> str:
        """:meth:`key` without this checkout's path: the name of its golden copy."""
        return self._name(portable=True)

    def run_dir(self, run_dir: str) -> str:
        """Where ``offloadctl train`` records (its --run-dir), for a run in ``run_dir``."""
        opts = list(self.opts)
        given = opts[opts.index("--run-dir") + 1] if "--run-dir" in opts else "{dir}/run"
        return given.replace("{dir}", run_dir)


GPT_RECORDED = Launch(
    "ours",
    1,
    ("--steps", "5", "--batch", "8"),
    script=GPT,
    opts=("--nvme", "{dir}/nvme", "--tuner", "off", "--read-ahead", "0", "--prefetch-depth", "0", "--run-dir", "{dir}/ours"),
)
"""The example GPT script under ``offloadctl train``, all state on an NVMe path, recorded: the run
the report and the end-of-run summary are read from. No read-ahead budget and prefetch 0: the 3
staging buffers hold fewer subgroups than the model has, so each step reads state back from the
path (the report's read rows are then not empty)."""


def stock(ranks: int = 1, *script_args: str, script: str = TINY, ckpt: Checkpoint | None = None) -> Launch:
    """Stock DeepSpeed on a test script, as ``accelerate launch --use_deepspeed`` would set it up
    (plain DeepSpeed scripts ignore the variable)."""
    return Launch("stock", ranks, tuple(script_args), script=script, env=(("ACCELERATE_USE_DEEPSPEED", "true"),), ckpt=ckpt)


def baseline(ranks: int, dtype: str) -> Launch:
    """Stock DeepSpeed's reference run for a rank count and dtype: it also saves a checkpoint at
    step 3 (which changes no loss), so that one run serves as the reference and as the checkpoint."""
    return stock(ranks, "--dtype", dtype, *SAVE)


def ours(
    ranks: int = 1, *script_args: str, opts: tuple[str, ...] = (), script: str = TINY, ckpt: Checkpoint | None = None
) -> Launch:
    """``offloadctl train`` with the state on ``{dir}/nvme`` past a 2 kB host cache (``opts`` come
    after, so they can override it), recording into ``{dir}/run``."""
    base = ("--nvme", "{dir}/nvme", "--host-cache", TINY_CACHE, "--run-dir", "{dir}/run")
    return Launch("ours", ranks, tuple(script_args), opts=(*base, *opts), script=script, ckpt=ckpt)


UNIVERSAL = ("--resume-tag", "universal", "--ds-extra", '{"checkpoint": {"load_universal": true}}')
"""Script options: resume from the ``universal`` tag, as a universal checkpoint."""


def resumed_stock(ranks: int, dtype: str, saved_ranks: int, *extra: str, universal: bool = False) -> Launch:
    """Stock DeepSpeed resuming from the checkpoint of stock's :func:`baseline` of ``saved_ranks``
    (converted to a universal checkpoint first where ``universal``): a reference that is a fixed
    function of the script and seed, kept golden."""
    return stock(
        ranks,
        "--dtype",
        dtype,
        "--resume",
        "{ckpt}",
        *(UNIVERSAL if universal else ()),
        *extra,
        ckpt=Checkpoint(baseline(saved_ranks, dtype), universal),
    )


def to_universal(ckpt_dir: str) -> None:
    """DeepSpeed's ds_to_universal on ``ckpt_dir``'s tag ``ckpt``, into its tag ``universal``."""
    p = subprocess.run(
        [
            sys.executable,
            "-m",
            "deepspeed.checkpoint.ds_to_universal",
            "--input_folder",
            f"{ckpt_dir}/ckpt",
            "--output_folder",
            f"{ckpt_dir}/universal",
        ],
        capture_output=True,
        text=True,
        timeout=300,
        env=env_with_root(),
        cwd=ROOT,
    )
    assert p.returncode == 0, p.stderr[-3000:]


@dataclasses.dataclass(frozen=True)
class Finished:
    """A run that ended: how, and what it left in its directory."""

    launch: Launch
    dir: Path
    returncode: int
    stdout: str
    stderr: str
    port: str
    """The launcher's --master_port."""

    def ok(self) -> "Finished":
        """This run, which must have succeeded. The one exception, written here once: a stock
        DeepSpeed run whose every rank finished the script and that then aborted in the
        interpreter's exit (``EXIT_ABORT``, a gloo teardown race of stock's, no offloadctl code in
        the process) counts as finished, and the test run says so in a warning."""
        if self.returncode == EXIT_ABORT_RC and self.launch.who == "stock" and EXIT_ABORT in self.stdout + self.stderr:
            finished = self.stdout.count("train_tiny: rank ") if self.launch.script == TINY else 0
            if finished == self.launch.ranks:
                warnings.warn(
                    f"{self.dir.name}: stock DeepSpeed aborted at exit after every rank finished "
                    f"({EXIT_ABORT!r}); its results are complete and used",
                    stacklevel=2,
                )
                return self
        assert self.returncode == 0, f"{self.launch}:\n{self.stderr[-3000:]}"
        return self

    @property
    def losses(self) -> list[float]:
        return [json.loads(line)["loss"] for line in open(self.dir / "losses.jsonl")]

    @property
    def loss_scales(self) -> list:
        return [json.loads(line).get("loss_scale") for line in open(self.dir / "losses.jsonl")]

    @property
    def run_dir(self) -> Path:
        return Path(self.launch.run_dir(str(self.dir)))

    @property
    def nvme(self) -> Path:
        return self.dir / "nvme"

    def telemetry(self, rank: int = 0) -> list[dict]:
        return [json.loads(line) for line in open(self.run_dir / f"telemetry-rank{rank}.jsonl")]

    def copy_of(self, name: str, to: Path) -> str:
        """A copy of ``{dir}/name`` (a checkpoint, a run dir) at ``to``, for a test that changes it."""
        shutil.copytree(self.dir / name, to)
        return str(to)


def launch(spec: Launch, run_dir: Path, *, timeout: float = LAUNCH_TIMEOUT_S, ckpt_dir: str = "{ckpt}") -> Finished:
    """Run ``spec`` in ``run_dir`` (made if missing), uncached (``{ckpt}`` stands for
    ``ckpt_dir``); DeepSpeed's shared-memory buffers of a stock run are removed after it (stock
    leaves 64 MiB in /dev/shm per rank)."""
    from integrations.launcher import remove_shm_buffers

    for d in ("nvme", "nvme1"):
        (run_dir / d).mkdir(parents=True, exist_ok=True)
    port = free_port()
    env = dict(env_with_root(), **dict(spec.env))
    # A session of its own: a run past its time is killed whole (launcher, per-node launcher and
    # ranks), not only the process started here, which would leave the ranks on their port.
    p = subprocess.Popen(
        spec.argv(str(run_dir), port, ckpt_dir),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
        cwd=ROOT,
        start_new_session=True,
    )
    try:
        stdout, stderr = p.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(p.pid, signal.SIGKILL)
        stdout, stderr = p.communicate()
        stderr += f"\n[ds_runs: killed after {timeout:.0f} s]"
    finally:
        if p.poll() is None:  # the test was interrupted
            os.killpg(p.pid, signal.SIGKILL)
            p.wait()
        if spec.who == "stock":
            remove_shm_buffers(port)
    return Finished(spec, run_dir, p.returncode, stdout, stderr, port)


GOLDEN_DIR = Path(ROOT) / "tests" / "data" / "golden"
STATE_API = ("--state-api-out", "{dir}/values.pt")
"""Script options: the values DeepSpeed's partitioned-state API reads at step 2 go to ``values.pt.rankN``."""
HF_TRAINER = os.path.join(ROOT, "tests", "ds_scripts", "train_hf_trainer.py")
ACCELERATE = os.path.join(ROOT, "tests", "ds_scripts", "train_accelerate.py")
GOLDEN = (
    stock(1, "--dtype", "fp32", "--groups"),
    stock(1, "--dtype", "fp16", "--overflow-at", "3", "--overflow-in", "first"),
    stock(1, "--output-dir", "{dir}/out", script=HF_TRAINER),
    stock(2, script=ACCELERATE),
    *(stock(ranks, "--dtype", dtype, *STATE_API) for ranks, dtype in ((1, "fp32"), (2, "bf16"), (1, "bf16"))),
    resumed_stock(1, "fp32", 1, "--resume-module-only"),
    *(resumed_stock(loaded, "fp32", saved, universal=True) for saved, loaded in ((2, 1), (1, 2))),
)
"""The stock runs kept as golden copies (``tests/make_golden.py`` makes them)."""
GOLDEN_FILES = ("losses.jsonl", "values.pt.rank0", "values.pt.rank1")
"""What a golden copy keeps of its run: what the tests read."""


def made_with(spec: Launch) -> dict:
    """What a stock run's numbers depend on besides its arguments and seed: DeepSpeed's and
    torch's versions, the instruction set their CPU kernels pick (DeepSpeed builds its CPU Adam
    for this CPU; torch dispatches by capability), the script."""
    import deepspeed
    import torch

    with open("/proc/cpuinfo") as f:
        flags = next((line.split(":", 1)[1].split() for line in f if line.startswith("flags")), [])
    with open(spec.script, "rb") as f:
        script = hashlib.sha256(f.read()).hexdigest()[:16]
    return {
        "deepspeed": deepspeed.__version__,
        "torch": torch.__version__,
        "cpu_capability": torch.backends.cpu.get_cpu_capability(),
        "cpu_flags": sorted(
            set(flags) & {"avx2", "fma", "f16c", "avx512f", "avx512bw", "avx512_bf16", "avx512_fp16", "amx_bf16", "amx_tile"}
        ),
        "script": f"{os.path.relpath(spec.script, ROOT)} {script}",
    }


def golden(spec: Launch) -> tuple[Finished | None, str]:
    """``spec``'s golden copy and '', or None and why it cannot stand for the live run here."""
    meta = GOLDEN_DIR / spec.golden_name() / "golden.json"
    if not meta.exists():
        return None, "none kept"
    kept = json.loads(meta.read_text())
    here = made_with(spec)
    differ = [f"{k} {kept['made_with'].get(k)} there, {v} here" for k, v in here.items() if kept["made_with"].get(k) != v]
    if differ:
        return None, "; ".join(differ)
    return Finished(spec, meta.parent, 0, kept["stdout"], "", ""), ""


class DSRuns:
    """The session's runs, under ``base`` (shared by pytest-xdist's workers)."""

    def __init__(self, base: Path) -> None:
        self.base = base
        self._done: dict[Launch, Finished] = {}

    def get(self, spec: Launch) -> Finished:
        """``spec``'s run: launched by the first asker in the session, the same run for the rest."""
        if spec in self._done:
            return self._done[spec]
        from filelock import FileLock

        ckpt_dir = self.checkpoint(spec.ckpt) if spec.ckpt is not None else "{ckpt}"
        run_dir = self.base / spec.key()
        result = run_dir / "finished.json"
        self.base.mkdir(parents=True, exist_ok=True)
        with FileLock(str(run_dir) + ".lock"):
            if result.exists():
                got = json.loads(result.read_text())
                done = Finished(spec, run_dir, got["returncode"], got["stdout"], got["stderr"], got["port"])
            else:
                if run_dir.exists():  # a worker that died mid-run left it: start over
                    shutil.rmtree(run_dir)
                done = launch(spec, run_dir, ckpt_dir=ckpt_dir)
                result.write_text(
                    json.dumps(
                        {
                            "returncode": done.returncode,
                            "stdout": done.stdout,
                            "stderr": done.stderr,
                            "port": done.port,
                            "argv": spec.argv(str(run_dir), done.port, ckpt_dir),
                        }
                    )
                )
        self._done[spec] = done
        return done

    def checkpoint(self, c: Checkpoint) -> str:
        """The directory of ``c``: its saver's own (runs only read it), or for a universal
        checkpoint a converted copy, made once in the session."""
        from filelock import FileLock

        saved = self.get(c.saver).ok().dir / "ckpt"
        if not c.universal:
            return str(saved)
        out = self.base / f"{c.saver.key()}-universal"
        with FileLock(str(out) + ".lock"):
            done = Path(str(out) + ".done")
            if not done.exists():
                shutil.rmtree(out, ignore_errors=True)  # a worker that died mid-conversion left it
                shutil.copytree(saved, out)
                to_universal(str(out))
                done.touch()
        return str(out)

    def reference(self, spec: Launch) -> Finished:
        """Stock's run ``spec``: its golden copy where that was made with what this machine has
        (:func:`golden`), else the live run (and a warning when a copy made elsewhere was passed
        over). ``OFFLOADCTL_TESTS_LIVE_STOCK=1`` runs every one live."""
        assert spec.who == "stock", spec
        if os.environ.get("OFFLOADCTL_TESTS_LIVE_STOCK") != "1":
            kept, why = golden(spec)
            if kept is not None:
                return kept
            if spec in GOLDEN:
                warnings.warn(f"golden {spec.golden_name()}: {why}; stock DeepSpeed runs live", stacklevel=2)
        return self.get(spec)
