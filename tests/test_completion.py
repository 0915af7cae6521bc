"""``offloadctl completion bash|zsh``: a completion script made from offloadctl's own parser,
run in a real bash."""

from __future__ import annotations

import shutil
import subprocess

import pytest
from helpers import cli


def _complete(script: str, *words: str) -> list[str]:
    line = " ".join(words)
    r = subprocess.run(
        [
            "bash",
            "-c",
            f'eval "$1"; COMP_WORDS=({line}); COMP_CWORD={len(words) - 1}; _offloadctl; printf "%s\\n" "${{COMPREPLY[@]}}"',
            "bash",
            script,
        ],
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert r.returncode == 0, r.stderr
    return r.stdout.split()


@pytest.mark.slow
def test_bash_completes_commands_and_each_commands_own_options():
    r = cli("completion", "bash")
    assert r.returncode == 0 and r.stderr == ""
    assert _complete(r.stdout, "offloadctl", "tr") == ["train"]
    assert _complete(r.stdout, "offloadctl", "t") == ["train", "tune", "tuner"]
    assert _complete(r.stdout, "offloadctl", "train", "--nv") == ["--nvme"]
    assert "--launcher" in _complete(r.stdout, "offloadctl", "train", "--l")
    assert _complete(r.stdout, "offloadctl", "plan", "--nv") == []  # train's option, not plan's
    assert "--lane-device" not in _complete(r.stdout, "offloadctl", "train", "--la")  # hidden options stay hidden


@pytest.mark.slow
@pytest.mark.skipif(shutil.which("zsh") is None, reason="zsh is not installed")
def test_zsh_loads_the_same_completion():
    r = cli("completion", "zsh")
    z = subprocess.run(
        ["zsh", "-c", 'eval "$1"; print ${_comps[offloadctl]}', "zsh", r.stdout], capture_output=True, text=True, timeout=30
    )
    assert z.returncode == 0 and z.stdout.strip() == "_bash_complete -F _offloadctl" or "_offloadctl" in z.stdout
