"""``offload_optimizer.device: nvme`` with no ``nvme_path`` and no ``--nvme`` (issue 43, item 9).

The state stayed in host memory with no word, where the user asked for NVMe to spare it (stock
DeepSpeed fails there with a traceback): refused in one line, before the launch where the
config is a file the script's arguments name, and by the rank where the script builds it.
"""

from __future__ import annotations

import json
import os

import pytest
from ds_runs import Launch, launch
from helpers import ROOT, cli

from engine.errors import ConfigError
from integrations.ds_config_check import check_ds_config

TINY = os.path.join(ROOT, "tests", "ds_scripts", "train_tiny.py")


def _config(tmp_path, offload: dict) -> str:
    path = tmp_path / "ds.json"
    path.write_text(json.dumps({"train_batch_size": 4, "zero_optimization": {"stage": 3, "offload_optimizer": offload}}))
    return str(path)


def _refusal(where: str) -> str:
    return (
        f'{where} puts the optimizer state on NVMe (offload_optimizer.device "nvme") but names no nvme_path, and '
        f'no --nvme was given: add "nvme_path": DIR to its offload_optimizer, or give --nvme DIR (device "cpu" '
        f"keeps the state in host memory)"
    )


def test_a_ds_config_on_nvme_without_a_path_is_refused_unless_a_path_is_given(tmp_path):
    cfg = _config(tmp_path, {"device": "nvme"})
    with pytest.raises(ConfigError) as e:
        check_ds_config(["--deepspeed_config", cfg])
    assert str(e.value) == _refusal(f"{cfg} (the script's --deepspeed_config)")
    assert check_ds_config(["--deepspeed_config", cfg], paths_given=True).path == cfg  # --nvme or --remote
    assert check_ds_config(["--deepspeed_config", _config(tmp_path, {"device": "nvme", "nvme_path": "/x"})])
    assert check_ds_config(["--deepspeed_config", _config(tmp_path, {"device": "cpu"})])


def test_offloadctl_train_refuses_it_before_the_launch(tmp_path):
    cfg = _config(tmp_path, {"device": "nvme"})
    run_dir = tmp_path / "run"
    r = cli(
        "train",
        "--num_gpus",
        "1",
        "--tuner",
        "off",
        "--run-dir",
        str(run_dir),
        TINY,
        "--losses-out",
        str(tmp_path / "l"),
        "--deepspeed_config",
        cfg,
        timeout=120,
    )
    assert r.returncode == 2 and r.stdout == "", r.stderr
    assert r.stderr == f"offloadctl: {_refusal(cfg + ' (the script' + chr(39) + 's --deepspeed_config)')}\n"
    assert not run_dir.exists()


@pytest.mark.slow
def test_a_config_built_in_the_script_is_refused_by_the_rank_in_one_line(tmp_path):
    """The script builds ``offload_optimizer: {"device": "nvme"}`` itself (no path)."""
    spec = Launch("ours", 1, ("--offload", "nvme"), opts=("--host-cache", "0", "--tuner", "off", "--run-dir", "{dir}/run"))
    out = launch(spec, tmp_path)
    assert out.returncode != 0 and "Traceback" not in out.stderr, out.stderr[-3000:]
    said = [ln for ln in out.stderr.splitlines() if "puts the optimizer state on NVMe" in ln]
    assert said and set(said) == {f"offloadctl: {_refusal('the ZeRO-3 config')}"}, out.stderr[-3000:]
