"""The one settings object of a rank, :class:`RankSettings`: built by ``offloadctl train``, written
once onto the launcher's command line (:meth:`RankSettings.to_json`) and read back by every
rank's bootstrap (:meth:`RankSettings.from_json`). It holds the engine's settings
(:class:`ZeroEngineSettings`) and the recorder's (:class:`report.recorder.RecorderConfig`).

The JSON of each is made from its dataclass fields, so a new field needs no serialization code.
Imports neither torch nor DeepSpeed: ``offloadctl train`` builds these without them.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

from engine.config import Knobs
from engine.errors import ConfigError
from report.recorder import ENGINES, RecorderConfig

_FROM_JSON = {"tuple[str, ...]": tuple, "dict": dict, "Knobs": Knobs.from_dict,
              "RecorderConfig | None": lambda d: None if d is None else RecorderConfig.from_json(d)}
"""How a JSON value becomes a field's value, by the field's declared type (as written); other
types are taken as they are."""


def _to_json(obj) -> dict:
    out = {}
    for f in dataclasses.fields(obj):
        v = getattr(obj, f.name)
        if f.metadata.get("flat"):
            out.update(_to_json(v))
        elif dataclasses.is_dataclass(v):
            out[f.name] = v.to_json() if hasattr(v, "to_json") else dataclasses.asdict(v)
        else:
            out[f.name] = list(v) if isinstance(v, tuple) else dict(v) if isinstance(v, dict) else v
    return out


def _from_json(cls, d: dict):
    """``cls`` from :func:`_to_json`'s dict: a missing field takes its default, unknown keys are
    ignored."""
    kwargs = {}
    for f in dataclasses.fields(cls):
        if f.metadata.get("flat"):
            kwargs[f.name] = _from_json(f.metadata["flat"], d)
        elif f.name in d:
            kwargs[f.name] = _FROM_JSON.get(f.type, lambda v: v)(d[f.name])
    return cls(**kwargs)


@dataclass(frozen=True, kw_only=True)
class ZeroEngineSettings:
    """What ``offloadctl train`` decides for the engine in every rank; tier options override the
    ds_config. ``integrations.zero3_optimizer.OffloadZero3Optimizer`` reads them."""

    nvme_paths: tuple[str, ...] = ()
    remote_paths: tuple[str, ...] = ()
    host_cache_bytes: int | None = None
    host_memory_bytes: int | None = None
    """The rank's host-memory budget (``engine.host_memory``); None: the default."""
    read_ahead_bytes: int | None = None
    """The read-ahead budget (``EngineConfig.read_ahead_bytes``); None: sized from the run."""
    overlap_io: bool = True
    """False: each step waits for its writes and reads nothing ahead (``EngineConfig.overlap_io``)."""
    run_dir: str | None = None
    knobs: Knobs = field(default_factory=Knobs)
    """Starting knobs without a profile."""
    device_cache_bytes: int | None = None
    """State kept on the GPU. None: what the GPU has free after the first forward/backward."""
    auto_device_fraction: bool = True
    """Start from the device fraction that balances the lanes (measured rates, or the plan's
    with a profile); False: ``knobs.device_fraction`` as given."""
    lane_device: str | None = None
    """Device of the device lane and tier. None: the rank's CUDA device (none without CUDA).
    'cpu' runs them, and keeps their gradients in separate buffers, on the CPU: how the tests
    drive the GPU path's bookkeeping against stock DeepSpeed on machines without a GPU."""
    knob_overrides: dict = field(default_factory=dict)
    """Knobs the user set explicitly; with a profile they win over the model's plan, and the
    tuner never moves them (the engine's ``fixed_knobs``)."""
    io_backend: str = "auto"
    profile: str | None = None
    """Path of a hardware profile: each rank starts from the performance model's best plan."""
    tuner_socket: str | None = None
    """The tuner daemon's socket; None: no tuning (the starting plan is kept)."""
    run_id: str | None = None

    def to_json(self) -> dict:
        return _to_json(self)

    @classmethod
    def from_json(cls, d: dict) -> "ZeroEngineSettings":
        return _from_json(cls, d)


@dataclass(frozen=True, kw_only=True)
class RankSettings:
    """Everything a rank is told by ``offloadctl train``."""

    zero: ZeroEngineSettings = field(default_factory=ZeroEngineSettings, metadata={"flat": ZeroEngineSettings})
    """The engine's settings; in the JSON, their fields sit beside the others (the keys
    ``train --dry-run`` prints)."""
    bind_cores: str = "auto"
    """Each rank on its share of the node's cores (``integrations.cores``): 'auto', 'on', 'off'."""
    engine: str = "offloadctl"
    """'offloadctl' (the engine is installed) or 'stock' (DeepSpeed's own optimizer, recorded only)."""
    recorder: RecorderConfig | None = None
    """What to record for ``offloadctl report``; None: nothing."""
    verbose: bool = False
    """DeepSpeed's own log lines on the terminal too (else only in the run's log)."""

    def __post_init__(self) -> None:
        if self.engine not in ENGINES:
            raise ConfigError(f"--engine must be one of {', '.join(ENGINES)}, got {self.engine!r}")

    @property
    def stock(self) -> bool:
        """Whether the rank runs DeepSpeed's own optimizer: no engine to install."""
        return self.engine == "stock"

    @property
    def run_dir(self) -> str | None:
        return self.zero.run_dir

    def with_tuner_socket(self, socket_path: str) -> "RankSettings":
        return dataclasses.replace(self, zero=dataclasses.replace(self.zero, tuner_socket=socket_path))

    def to_json(self) -> dict:
        return _to_json(self)

    @classmethod
    def from_json(cls, d: dict) -> "RankSettings":
        return _from_json(cls, d)
