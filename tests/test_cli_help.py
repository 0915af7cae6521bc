"""Help that fits an 80-column terminal and speaks to users; options spelled out, mistakes pointed out."""

from __future__ import annotations

import argparse
import re

import pytest

from integrations import launcher
from offloadctl import cli
from offloadctl.commands import train

EXAMPLE = "examples/train_gpt.py"
MODULE_NAME = re.compile(
    r"\b(engine|perf|tuner|report|integrations|offloadctl)\.(?!(sock|html|toml|jsonl?|png|log|db|md)\b)"
    r"[a-z_]+\b|\b[a-z_]+\.py's\b"
)


def _all_parsers(parser: argparse.ArgumentParser, prefix: tuple[str, ...] = ()):
    yield prefix, parser
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                yield from _all_parsers(sub, prefix + (name,))


def _help(argv: list[str], capsys) -> str:
    with pytest.raises(SystemExit) as e:
        cli.main(argv + ["--help"])
    assert e.value.code == 0
    return capsys.readouterr().out


def test_every_help_fits_80_columns_and_names_no_module(monkeypatch, capsys):
    monkeypatch.setenv("COLUMNS", "80")
    commands = [list(p) for p, _ in _all_parsers(cli.build_parser())]
    assert len(commands) > 8
    for argv in commands:
        text = _help(argv, capsys)
        long = [line for line in text.splitlines() if len(line) > 80]
        assert not long, (argv, long)
        assert "``" not in text, argv
        assert not MODULE_NAME.search(text.replace("offloadctl.toml", "")), (argv, MODULE_NAME.search(text))


def test_top_level_help_speaks_to_users(monkeypatch, capsys):
    monkeypatch.setenv("COLUMNS", "80")
    text = _help([], capsys)
    assert "parses arguments" not in text and "subcommand" not in text
    assert "offloadctl train --nvme" in text


def test_train_help_describes_every_launcher_option_and_hides_deprecated_flags(monkeypatch, capsys):
    monkeypatch.setenv("COLUMNS", "80")
    assert set(train.LAUNCHER_HELP) == {flags[0] for flags, _ in launcher.LAUNCHER_OPTIONS}
    text = _help(["train"], capsys)
    for flags, _ in launcher.LAUNCHER_OPTIONS:
        assert re.search(rf"^  {re.escape(flags[0])}\b", text, re.M), flags
    assert "VALUE" not in text
    for deprecated in ("--host-cache-gb", "--device-cache-gb"):
        assert deprecated not in text


@pytest.mark.parametrize(
    "typed,meant",
    [("--nvm", "--nvme"), ("--nmve", "--nvme"), ("--num_gpu", "--num_gpus"), ("--prefetch-dept", "--prefetch-depth")],
)
def test_abbreviated_or_misspelled_flags_are_refused_with_the_nearest(typed, meant, capsys, tmp_path):
    with pytest.raises(SystemExit) as e:
        cli.main(["train", typed, "1", "--dry-run", "--nvme", str(tmp_path), EXAMPLE])
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith("usage: offloadctl train"), err  # the subcommand's usage, not the top level's
    assert f"unrecognized arguments: {typed}" in err and f"(did you mean {meant}?)" in err
    assert len(err.splitlines()) == 2


def test_a_bad_knob_value_names_the_option(capsys, tmp_path):
    assert cli.main(["train", "--prefetch-depth", "-1", "--nvme", str(tmp_path), "--dry-run", EXAMPLE]) == 2
    err = capsys.readouterr().err
    assert err.startswith("offloadctl: --prefetch-depth ") and "Knobs" not in err, err


def test_info_reads_as_a_user_would(monkeypatch, capsys):
    from offloadctl.commands import info

    monkeypatch.setenv("COLUMNS", "80")
    data = {
        "offloadctl": "0.1.0",
        "torch": "2.13.0+cpu",
        "deepspeed": "0.19.8",
        "deepspeed_integration": "ok (DeepSpeed 0.19.8)",
        "cuda": False,
        "gpus": [],
        "native_ops": {"async_io": {"state": "built", "detail": "", "fallback": ""}},
        "io_backends": ["aio", "posix"],
        "host_adamw_params_per_s": {"torch": 3.04e8, "deepspeed": 3.5e8},
        "host_adamw_kernel": "torch",
        "host_lane_params_per_s": 1.65e8,
    }
    from rich.console import Console

    console = Console(width=80, record=True)
    console.print(info.info_table(data))
    text = console.export_text()
    assert all(len(line) <= 80 for line in text.splitlines())
    assert not any(key in text for key in data if "_" in key)  # no internal keys
    # The kernel runs use, and the whole loop's rate with it, kept: the table says so, and why.
    flat = re.sub(r"[\s│]+", " ", text)
    assert "DeepSpeed 350M params/s" in flat and "kept" in flat and "165M params/s" in flat, flat
