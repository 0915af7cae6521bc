"""offloadctl's multi-tier optimizer-state engine.

Start with :class:`OffloadAdamW` (a drop-in ``torch.optim`` optimizer); the DeepSpeed ZeRO-3
integration and the tuner drive the same :class:`SubgroupEngine` through :class:`Knobs`.
"""
from .adamw import AdamWHyper
from .binding import FlatSubgroup, SubgroupBinding
from .config import EngineConfig, Knobs, StoragePath
from .core import SubgroupEngine
from .errors import ConfigError, CorruptSwapFileError, OffloadError, StorageIOError, StoragePathError
from .optimizer import OffloadAdamW
from .telemetry import StepRecord

__all__ = [
    "AdamWHyper", "ConfigError", "FlatSubgroup", "SubgroupBinding", "CorruptSwapFileError", "EngineConfig", "Knobs", "OffloadAdamW", "OffloadError",
    "StepRecord", "StorageIOError", "StoragePath", "StoragePathError", "SubgroupEngine",
]
