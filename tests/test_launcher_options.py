"""Every option of the installed DeepSpeed launcher passes through `offloadctl train`, with its meaning."""

from __future__ import annotations

import argparse
import json
import subprocess
import sys

import pytest

from integrations.launcher import LAUNCHER_OPTIONS

ROOT = __import__("os").path.dirname(__import__("os").path.dirname(__import__("os").path.abspath(__file__)))


def deepspeed_launcher_parser() -> argparse.ArgumentParser:
    """The parser deepspeed.launcher.runner.parse_args builds (caught as it parses)."""
    import deepspeed.launcher.runner as runner

    class Caught(Exception):
        pass

    seen = {}
    original = argparse.ArgumentParser.parse_args

    def catch(self, args=None, namespace=None):
        seen["parser"] = self
        raise Caught

    argparse.ArgumentParser.parse_args = catch
    try:
        runner.parse_args([])
    except Caught:
        pass
    finally:
        argparse.ArgumentParser.parse_args = original
    return seen["parser"]


def _deepspeeds_options() -> dict[tuple[str, ...], bool]:
    out = {}
    for a in deepspeed_launcher_parser()._actions:
        if a.option_strings and not isinstance(a, argparse._HelpAction):
            out[tuple(sorted(a.option_strings))] = a.nargs != 0
    return out


def test_every_deepspeed_launcher_option_passes_through():
    ours = {tuple(sorted(flags)): takes_value for flags, takes_value in LAUNCHER_OPTIONS}
    theirs = _deepspeeds_options()
    assert set(theirs) - set(ours) == set(), "DeepSpeed launcher options offloadctl train does not pass through"
    assert set(ours) - set(theirs) == set(), "options offloadctl passes that DeepSpeed's launcher does not take"
    assert ours == theirs, "an option that takes a value in one and not the other"


def _dry_run(*args: str) -> dict:
    p = subprocess.run(
        [
            sys.executable,
            "-m",
            "offloadctl.cli",
            "train",
            "--dry-run",
            "--json",
            *args,
            "tests/ds_scripts/train_tiny.py",
            "--losses-out",
            "x.jsonl",
        ],
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=120,
    )
    assert p.returncode == 0, p.stderr
    return json.loads(p.stdout)


def test_each_option_reaches_the_launcher_as_given():
    """Every option, in one command line, comes out in the launcher's argv as DeepSpeed spells it
    (``--launcher`` with one of DeepSpeed's launchers: offloadctl refuses names it does not know;
    ``--module`` and ``--no_python`` make the ranks run the script itself, so they reach the ranks
    through the rank hook, not the bootstrap: tests/test_launchers.py)."""
    given = []
    for flags, takes_value in LAUNCHER_OPTIONS:
        if flags[0] in ("--module", "--no_python"):
            continue
        value = (
            "7"
            if flags[0] in ("--num_nodes", "--num_gpus", "--master_port", "--node_rank", "--ssh_port")
            else "pdsh"
            if flags[0] == "--launcher"
            else "v"
        )
        given += [flags[0], value] if takes_value else [flags[0]]
    cmd = _dry_run(*given)["command"]
    runner = cmd.index("deepspeed.launcher.runner")
    launcher_argv = cmd[runner + 1 : cmd.index(next(c for c in cmd if c.endswith("bootstrap.py")))]
    assert launcher_argv == given


@pytest.mark.parametrize(
    "launcher,tool",
    [("pdsh", "pdsh"), ("slurm", "srun"), ("openmpi", "mpirun"), ("mpich", "mpirun"), ("impi", "mpirun"), ("mvapich", "mpirun")],
)
def test_other_launchers_start_the_bootstrap_in_every_rank(launcher, tool, tmp_path):
    """With any --launcher, --dry-run --json shows the command DeepSpeed's own runner builds for it
    (nothing started, the tool need not be installed): the bootstrap, with the engine's settings,
    in place of the script, so that every rank it starts runs the engine."""
    hostfile = tmp_path / "hostfile"
    hostfile.write_text("node0 slots=2\nnode1 slots=2\n")
    out = _dry_run("--launcher", launcher, "--hostfile", str(hostfile), "--master_addr", "10.0.0.1")
    assert out["command"][out["command"].index("--launcher") + 1] == launcher
    cmd = out["launch"]["command"]
    assert cmd[0] == tool
    text = " ".join(cmd)
    assert "integrations/bootstrap.py --offloadctl-config" in text and "tests/ds_scripts/train_tiny.py" in text


def test_per_node_launch_without_ssh(tmp_path):
    """--no_ssh --node_rank N (Kubernetes, a SLURM step per node): this node's launch only."""
    hostfile = tmp_path / "hostfile"
    hostfile.write_text("node0 slots=1\nnode1 slots=1\n")
    out = _dry_run("--hostfile", str(hostfile), "--no_ssh", "--node_rank", "1", "--master_addr", "10.0.0.1")
    cmd = out["launch"]["command"]
    assert cmd[1:4] == ["-u", "-m", "deepspeed.launcher.launch"] and "--node_rank=1" in cmd
    assert "--master_addr=10.0.0.1" in cmd and any(c.endswith("integrations/bootstrap.py") for c in cmd)


def test_rank_settings_reach_the_bootstrap_as_built(tmp_path):
    """One settings object per rank: what `offloadctl train` builds is what the bootstrap reads
    back from the launcher's command line, field for field, the tuner's socket included."""
    import dataclasses

    from integrations import bootstrap, launcher
    from integrations.settings import RankSettings, ZeroEngineSettings
    from offloadctl.cli import build_parser
    from offloadctl.commands import train

    script = tmp_path / "script.py"
    script.write_text("pass\n")
    args = build_parser().parse_args(
        [
            "train",
            "--tuner",
            "off",
            "--run-dir",
            str(tmp_path / "run"),
            "--nvme",
            str(tmp_path),
            "--prefetch-depth",
            "3",
            "--record-hz",
            "5",
            "--bind-cores",
            "off",
            "--verbose",
            str(script),
            "--lr",
            "1",
        ]
    )
    launch = train.build(args)
    built = launch.settings
    assert isinstance(built, RankSettings) and built.zero.pins == {"prefetch_depth": 3}
    assert built.zero.start_knobs.prefetch_depth == 3 and built.recorder.sample_hz == 5.0
    launch = launch.with_tuner_socket("/tmp/tuner.sock")
    cmd = launch.command
    runner = cmd.index("deepspeed.launcher.runner")
    read, got_script, got_args = bootstrap.split_argv(["--local_rank=0", *cmd[runner + 2 :]])
    assert (
        read
        == launch.settings
        == dataclasses.replace(built, zero=dataclasses.replace(built.zero, tuner_socket="/tmp/tuner.sock"))
    )
    assert got_script == str(script) and got_args == ["--local_rank=0", "--lr", "1"]
    assert tuple(launcher.with_rank_settings(cmd, read)) == cmd
    # The engine's fields and the rank's share one flat JSON object (the keys --dry-run prints).
    own = {f.name for f in dataclasses.fields(RankSettings)} - {"zero"}
    assert own.isdisjoint(f.name for f in dataclasses.fields(ZeroEngineSettings))
    assert RankSettings.from_json({}) == RankSettings()


def test_rank_settings_validate_themselves():
    """The settings refuse what no rank could run, naming it: a key of another offloadctl, a pin
    no knob takes, and the engine's options with --engine stock (in the order train's help gives them)."""
    from engine.errors import ConfigError
    from integrations.settings import RankSettings, ZeroEngineSettings

    with pytest.raises(ConfigError, match=r"unknown key\(s\) \['knob_overrides'\]"):
        RankSettings.from_json({"knob_overrides": {}})
    with pytest.raises(ConfigError, match="prefetch_depth must be at most 64"):
        ZeroEngineSettings(pins={"prefetch_depth": 65})
    zero = ZeroEngineSettings(nvme_paths=["/x"], host_cache_bytes=0, pins={"node_lock": True, "prefetch_depth": 1})
    assert zero.nvme_paths == ("/x",) and zero.start_knobs.node_lock and zero.start_knobs.prefetch_depth == 1
    with pytest.raises(ConfigError, match="so --nvme, --prefetch-depth, --node-lock do not apply"):
        RankSettings(engine="stock", zero=zero)
    assert RankSettings.from_json(RankSettings(zero=zero).to_json()) == RankSettings(zero=zero)
