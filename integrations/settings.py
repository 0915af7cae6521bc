"""The one settings object of a rank, :class:`RankSettings`: built by ``offloadctl train``, written
once onto the launcher's command line (:meth:`RankSettings.to_json`) and read back by every
rank's bootstrap (:meth:`RankSettings.from_json`). It holds the engine's settings
(:class:`ZeroEngineSettings`) and the recorder's (:class:`report.recorder.RecorderConfig`).

Each class reads its own JSON back (``from_json``): the field types JSON does not carry (tuples,
the recorder's config) are made there, and a key no field has is an error naming it.
Imports neither torch nor DeepSpeed: ``offloadctl train`` builds these without them.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any, Literal, Mapping

from engine.config import Knobs
from engine.errors import ConfigError
from report.recorder import ENGINES, RecorderConfig


def _fields_json(obj) -> dict:
    """``obj``'s fields as JSON values (tuples as lists, mappings as objects)."""
    out = {}
    for f in dataclasses.fields(obj):
        v = getattr(obj, f.name)
        out[f.name] = list(v) if isinstance(v, tuple) else dict(v) if isinstance(v, Mapping) else v
    return out


def _known_keys(cls, d: Mapping, where: str) -> None:
    unknown = set(d) - {f.name for f in dataclasses.fields(cls)}
    if unknown:
        raise ConfigError(
            f"{where}: unknown key(s) {sorted(unknown)}; offloadctl train and the rank's bootstrap must be the same offloadctl"
        )


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
    device_cache_bytes: int | None = None
    """State kept on the GPU. None: what the GPU has free after the first forward/backward."""
    auto_device_fraction: bool = True
    """Start from the device fraction that balances the lanes (measured rates, or the plan's
    with a profile); False: ``pins['device_fraction']`` as given."""
    lane_device: str | None = None
    """Device of the device lane and tier. None: the rank's CUDA device (none without CUDA).
    'cpu' runs them, and keeps their gradients in separate buffers, on the CPU: how the tests
    drive the GPU path's bookkeeping against stock DeepSpeed on machines without a GPU.
    """
    pins: Mapping[str, Any] = field(default_factory=dict)
    """Knob name -> value the user's options set (``--prefetch-depth``, ``--node-lock``,
    ``--device-fraction``): the rank starts from them, they win over a profile's plan, and the
    tuner never moves them (``EngineConfig.pins``)."""
    io_backend: Literal["auto", "aio", "posix"] = "auto"
    host_adam: Literal["auto", "fastest", "torch", "deepspeed"] = "auto"
    """The host lane's AdamW kernel (``EngineConfig.host_adam``): 'auto' is stock's cpu_adam where
    it is built and no GPU lane runs, for losses equal to stock's bit for bit; 'fastest' (and
    'auto' beside a GPU lane) the faster lane here."""
    profile: str | None = None
    """Path of a hardware profile: each rank starts from the performance model's best plan."""
    tuner_socket: str | None = None
    """The tuner daemon's socket; None: no tuning (the starting plan is kept)."""
    run_id: str | None = None

    def __post_init__(self) -> None:
        object.__setattr__(self, "nvme_paths", tuple(self.nvme_paths))
        object.__setattr__(self, "remote_paths", tuple(self.remote_paths))
        object.__setattr__(self, "pins", dict(self.pins))
        Knobs.from_dict(self.pins)  # a pin no knob can take: refused here, not in every rank

    def check_storage_paths(self) -> None:
        """Each storage path usable (a directory, writable, O_DIRECT: ``engine.storage.usable``):
        a wrong one is one line before the launch, not an error from every rank. Checked where the
        launch starts, not where the settings are read back."""
        from engine.storage.usable import check_usable

        for path in self.nvme_paths + self.remote_paths:
            check_usable(path)

    @property
    def start_knobs(self) -> Knobs:
        """The knobs a rank starts from without a profile: the defaults with the pins in place."""
        return Knobs.from_dict(self.pins)

    def to_json(self) -> dict:
        # The starting knobs too, for a reader of ``train --dry-run --json`` (after run_dir, where
        # they always were); derived, so not read back.
        out = {}
        for key, value in _fields_json(self).items():
            out[key] = value
            if key == "run_dir":
                out["knobs"] = self.start_knobs.to_dict()
        return out

    @classmethod
    def from_json(cls, d: Mapping) -> "ZeroEngineSettings":
        """The settings from :meth:`to_json`'s dict; a missing field takes its default."""
        d = {k: v for k, v in d.items() if k != "knobs"}
        _known_keys(cls, d, "the rank's engine settings")
        return cls(**d)


_ENGINE_FLAGS = (
    ("--nvme", lambda z: z.nvme_paths),
    ("--remote", lambda z: z.remote_paths),
    ("--host-cache", lambda z: z.host_cache_bytes),
    ("--host-memory", lambda z: z.host_memory_bytes),
    ("--read-ahead", lambda z: z.read_ahead_bytes),
    ("--no-io-overlap", lambda z: not z.overlap_io),
    ("--device-cache", lambda z: z.device_cache_bytes),
    ("--device-fraction", lambda z: z.pins.get("device_fraction")),
    ("--profile", lambda z: z.profile),
    ("--prefetch-depth", lambda z: z.pins.get("prefetch_depth")),
    ("--node-lock", lambda z: z.pins.get("node_lock")),
    ("--lane-device", lambda z: z.lane_device),
    ("--host-adam", lambda z: z.host_adam != "auto"),
)
"""The options of ``train`` that set the engine's settings, in the order its help gives them, each
with whether a :class:`ZeroEngineSettings` has it given (a zero, as none, is not): ``--engine
stock`` takes none of them."""


@dataclass(frozen=True, kw_only=True)
class RankSettings:
    """Everything a rank is told by ``offloadctl train``."""

    zero: ZeroEngineSettings = field(default_factory=ZeroEngineSettings)
    """The engine's settings; in the JSON, their fields sit beside the others (the keys
    ``train --dry-run`` prints)."""
    bind_cores: str = "auto"
    """Each rank on its share of the node's cores (``integrations.cores``): 'auto', 'on', 'off'."""
    host_heap: str = "keep"
    """'keep': the rank's C library keeps what it frees for its next allocations (``engine.heap``);
    'system': its default, freed memory goes back at once. Not with ``engine='stock'``, which
    runs as DeepSpeed does."""
    engine: str = "offloadctl"
    """'offloadctl' (the engine is installed) or 'stock' (DeepSpeed's own optimizer, recorded only)."""
    recorder: RecorderConfig | None = None
    """What to record for ``offloadctl report``; None: nothing."""
    verbose: bool = False
    """DeepSpeed's own log lines on the terminal too (else only in the run's log)."""

    def __post_init__(self) -> None:
        if self.engine not in ENGINES:
            raise ConfigError(f"--engine must be one of {', '.join(ENGINES)}, got {self.engine!r}")
        given = [flag for flag, is_given in _ENGINE_FLAGS if is_given(self.zero)]
        if self.stock and given:
            raise ConfigError(
                f"--engine stock runs DeepSpeed's own optimizer as its ds_config says, so "
                f"{', '.join(given)} {'does' if len(given) == 1 else 'do'} not apply: set offload_optimizer in the "
                f"ds_config, or drop --engine stock"
            )

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
        own = {f.name: getattr(self, f.name) for f in dataclasses.fields(self) if f.name != "zero"}
        return {**self.zero.to_json(), **own, "recorder": self.recorder.to_json() if self.recorder else None}

    @classmethod
    def from_json(cls, d: Mapping) -> "RankSettings":
        """The settings from :meth:`to_json`'s flat dict: the rank's own keys, the rest the engine's."""
        own = {f.name for f in dataclasses.fields(cls)} - {"zero"}
        kwargs = {k: v for k, v in d.items() if k in own}
        if kwargs.get("recorder") is not None:
            kwargs["recorder"] = RecorderConfig.from_json(kwargs["recorder"])
        return cls(zero=ZeroEngineSettings.from_json({k: v for k, v in d.items() if k not in own}), **kwargs)
