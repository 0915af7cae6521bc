"""offloadctl's multi-tier optimizer-state engine.

Start with :class:`OffloadAdamW` (a drop-in ``torch.optim`` optimizer); the DeepSpeed ZeRO-3
integration and the tuner drive the same :class:`SubgroupEngine` through :class:`Knobs`.

Names are imported on first use, so that torch-free parts (the performance model, profiles,
``offloadctl plan``) start without importing torch.
"""

from __future__ import annotations

import importlib
from typing import Any

_EXPORTS = {
    "AdamWHyper": "adamw",
    "FlatSubgroup": "binding",
    "SubgroupBinding": "binding",
    "EngineConfig": "config",
    "Knobs": "config",
    "StoragePath": "config",
    "SubgroupEngine": "core",
    "ConfigError": "errors",
    "CorruptSwapFileError": "errors",
    "OffloadError": "errors",
    "StorageIOError": "errors",
    "StoragePathError": "errors",
    "OffloadAdamW": "optimizer",
    "StepRecord": "telemetry",
}
__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    if name in _EXPORTS:
        value = getattr(importlib.import_module(f".{_EXPORTS[name]}", __name__), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
