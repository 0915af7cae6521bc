"""A training script's ds_config, found in its arguments and checked before the launch.

The engine takes over ZeRO-3's offloaded optimizer, so a ds_config with another ZeRO stage, or
stage 3 without ``offload_optimizer``, is refused by every rank once DeepSpeed has built its
engine: tens of seconds after the launch, minutes on a loaded machine (DeepSpeed may compile
an op first). Where the config is a file named in the script's arguments, ``offloadctl train``
reads it first and refuses at once, in the same words, before anything starts.

Where it is looked for, in order: the value of ``--deepspeed_config`` (DeepSpeed's own
``add_config_arguments``), ``--deepspeed`` (Hugging Face Trainer), ``--ds_config``,
``--ds-config`` or ``--deepspeed-config`` (as ``--flag FILE`` or ``--flag=FILE``); else the first
argument naming a ``.json`` file whose top level has DeepSpeed's keys. A config built inside
the script, or not readable as JSON here, is left to the ranks, which refuse it in one line.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from typing import Sequence

from engine.errors import ConfigError

CONFIG_FLAGS = ("--deepspeed_config", "--deepspeed", "--ds_config", "--ds-config", "--deepspeed-config")
DS_KEYS = frozenset(
    {
        "train_batch_size",
        "train_micro_batch_size_per_gpu",
        "gradient_accumulation_steps",
        "zero_optimization",
        "optimizer",
        "fp16",
        "bf16",
        "gradient_clipping",
    }
)
"""Top-level keys that make a JSON file a DeepSpeed config."""
MAX_CONFIG_BYTES = 1 << 20
"""A larger JSON file is not read: a ds_config is a few hundred bytes (a data file may be gigabytes)."""


@dataclass(frozen=True)
class FoundConfig:
    path: str
    """The file, as given."""
    how: str
    """How it was found: the flag that named it, or 'a JSON file among the script's arguments'."""
    config: dict


def find_ds_config(script_args: Sequence[str]) -> FoundConfig | None:
    """The ds_config file the script's arguments name (see the module docstring), or None."""
    args = list(script_args)
    for i, a in enumerate(args):
        flag, eq, value = a.partition("=")
        if flag in CONFIG_FLAGS:
            path = value if eq else (args[i + 1] if i + 1 < len(args) else "")
            _check_named(flag, path)
            config = _read(path)
            if config is not None:
                return FoundConfig(path, flag, config)
    for a in args:
        path = a.partition("=")[2] if a.startswith("-") else a
        if path.endswith(".json"):
            config = _read(path)
            if config is not None and DS_KEYS & set(config):
                return FoundConfig(path, "a JSON file among the script's arguments", config)
    return None


def _check_named(flag: str, path: str) -> None:
    """ConfigError for a config file the script's ``flag`` names that does not exist or is not
    JSON: DeepSpeed would say so only in the ranks, after the launch, in a page of traceback.
    DeepSpeed's own ``--deepspeed`` is a switch, so after it only a ``.json`` name is taken as a
    file; a value that is JSON itself (``{...}``) is left to the script."""
    if not path or path.startswith(("-", "{")) or (flag == "--deepspeed" and not path.endswith(".json")):
        return
    if not os.path.lexists(path):
        raise ConfigError(f"{path} does not exist (the script's {flag}): check the path")
    if not os.path.isfile(path) or os.path.getsize(path) > MAX_CONFIG_BYTES:
        return
    try:
        with open(path, encoding="utf-8") as f:
            json.load(f)
    except UnicodeDecodeError:
        raise ConfigError(f"{path} is not text (the script's {flag}): give a DeepSpeed JSON config") from None
    except json.JSONDecodeError as e:
        raise ConfigError(
            f"{path} line {e.lineno} column {e.colno}: not valid JSON ({e.msg}; the script's {flag}): fix the file"
        ) from None
    except OSError as e:
        raise ConfigError(f"{path} cannot be read ({e.strerror}; the script's {flag})") from None


def _read(path: str) -> dict | None:
    try:
        if not path or not os.path.isfile(path) or os.path.getsize(path) > MAX_CONFIG_BYTES:
            return None
        with open(path, encoding="utf-8") as f:
            config = json.load(f)
    except (OSError, ValueError):
        return None  # DeepSpeed will say what is wrong with it, in the ranks
    return config if isinstance(config, dict) else None


def nvme_without_path(where: str) -> str:
    """The refusal of an ``offload_optimizer`` on NVMe that names no directory, with no ``--nvme``
    or ``--remote`` given: the state would stay in host memory, which the user asked to spare
    (stock DeepSpeed fails there with a traceback)."""
    return (
        f'{where} puts the optimizer state on NVMe (offload_optimizer.device "nvme") but names no nvme_path, '
        f'and no --nvme was given: add "nvme_path": DIR to its offload_optimizer, or give --nvme DIR (device '
        f'"cpu" keeps the state in host memory)'
    )


def refuse_nvme_without_path(on_nvme: bool, nvme_path, settings) -> None:
    """In a rank (a config built inside the script): ConfigError where the optimizer is offloaded
    to NVMe (``on_nvme``) without ``nvme_path`` and ``settings`` (its ZeroEngineSettings) give
    no storage path."""
    if on_nvme and not nvme_path and not (settings.nvme_paths or settings.remote_paths):
        raise ConfigError(nvme_without_path("the ZeRO-3 config"))


def check_ds_config(script_args: Sequence[str], *, paths_given: bool = False) -> FoundConfig | None:
    """ConfigError, in one line naming the file, when the ds_config the script's arguments name
    is one the engine refuses: a ZeRO stage other than 3, stage 3 without ``offload_optimizer``,
    or one on NVMe without a path while no storage path was given (``paths_given``: --nvme or
    --remote). Returns what was found (None: nothing to check before the launch)."""
    found = find_ds_config(script_args)
    if found is None:
        return None
    zero = found.config.get("zero_optimization") or {}
    if not isinstance(zero, dict):
        return found
    stage = zero.get("stage", 0)
    where = f"{found.path} (the script's {found.how})" if found.how.startswith("--") else found.path
    if isinstance(stage, int) and not isinstance(stage, bool) and stage != 3:
        raise ConfigError(
            f"offloadctl's engine needs ZeRO stage 3, but {where} uses stage {stage}: set "
            f"zero_optimization.stage to 3 there, or run it with --engine stock (DeepSpeed's own "
            f"optimizer, recorded for offloadctl report)"
        )
    off = zero.get("offload_optimizer")
    device = off.get("device") if isinstance(off, dict) else None
    if stage == 3 and (not isinstance(off, dict) or device in (None, "none")):
        raise ConfigError(
            f"offloadctl needs `offload_optimizer` in the ZeRO-3 config, but {where} has "
            f"{'none' if not isinstance(off, dict) else 'device ' + json.dumps(device)}: add "
            f'"offload_optimizer": {{"device": "cpu"}} to its zero_optimization (the engine takes '
            f"over an offloaded optimizer), or run it with --engine stock"
        )
    if stage == 3 and device == "nvme" and isinstance(off, dict) and not off.get("nvme_path") and not paths_given:
        raise ConfigError(nvme_without_path(where))
    return found
