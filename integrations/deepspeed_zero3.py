"""The engine inside DeepSpeed ZeRO-3: a subclass of ``DeepSpeedZeroOptimizer_Stage3``.

ZeRO-3 already keeps each rank's parameters as flat partitions split into subgroups
(``sub_group_size``), so every subgroup becomes one :class:`ZeroPartitionSubgroup` binding and
:class:`engine.core.SubgroupEngine` does the rest. What changes against stock DeepSpeed:

- DeepSpeed allocates no fp32 master copies, no fp32 gradient copies and no Adam state
  (``_create_fp32_partitions``, ``initialize_optimizer_states``,
  ``_offload_grad_partition_at_boundary``), and creates no swapper: the engine owns the state
  and its tiers.
- Reduced gradients stay in DeepSpeed's host buffer (``grad_partitions_flat_buffer``, pinned
  in place at its exact size) in their own dtype; they are upcast and unscaled per chunk at
  update time, never written to storage. Gradients of subgroups updated on the GPU (the device
  tier, and the device lane when memory allows) stay on the GPU: their entries in DeepSpeed's
  per-parameter gradient map point into device buffers, so backward never copies them out.
- ``step()`` keeps DeepSpeed's overflow check, loss-scale update and clipping, then hands the
  whole update loop to the engine.
- ``state_dict``/``_rigid_load_state_dict`` gather and restore the engine's state in
  DeepSpeed's own checkpoint layout, so stock DeepSpeed can resume from our checkpoints.

:func:`install` checks the installed DeepSpeed (``ds_compat``) and has ``ds_patches`` put the
subclass (``integrations.zero3_optimizer``) in place of DeepSpeed's before
``deepspeed.initialize``; this module imports neither DeepSpeed nor torch, so that
``offloadctl train`` can build the settings without them.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from engine.config import Knobs
from integrations import ds_compat


@dataclass(frozen=True, kw_only=True)
class ZeroEngineSettings:
    """What ``offloadctl train`` decides for every rank; tier options override the ds_config."""

    nvme_paths: tuple[str, ...] = ()
    remote_paths: tuple[str, ...] = ()
    host_cache_bytes: int | None = None
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
    """Knobs the user set explicitly; with a profile they win over the model's plan."""
    io_backend: str = "auto"
    profile: str | None = None
    """Path of a hardware profile: each rank starts from the performance model's best plan."""
    tuner_socket: str | None = None
    """The tuner daemon's socket; None: no tuning (the starting plan is kept)."""
    run_id: str | None = None
    bind_cores: str = "auto"
    """Each rank on its share of the node's cores (``integrations.cores``): 'auto', 'on', 'off'."""

    def to_json(self) -> dict:
        return {"nvme_paths": list(self.nvme_paths), "remote_paths": list(self.remote_paths),
                "host_cache_bytes": self.host_cache_bytes, "run_dir": self.run_dir,
                "knobs": self.knobs.to_dict(), "knob_overrides": dict(self.knob_overrides),
                "device_cache_bytes": self.device_cache_bytes, "auto_device_fraction": self.auto_device_fraction,
                "lane_device": self.lane_device,
                "io_backend": self.io_backend, "profile": self.profile, "tuner_socket": self.tuner_socket,
                "run_id": self.run_id, "bind_cores": self.bind_cores}

    @classmethod
    def from_json(cls, d: dict) -> "ZeroEngineSettings":
        return cls(nvme_paths=tuple(d.get("nvme_paths", ())), remote_paths=tuple(d.get("remote_paths", ())),
                   host_cache_bytes=d.get("host_cache_bytes"), run_dir=d.get("run_dir"),
                   knobs=Knobs.from_dict(d.get("knobs", {})), knob_overrides=dict(d.get("knob_overrides", {})),
                   device_cache_bytes=d.get("device_cache_bytes"), auto_device_fraction=d.get("auto_device_fraction", True),
                   lane_device=d.get("lane_device"),
                   io_backend=d.get("io_backend", "auto"), profile=d.get("profile"),
                   tuner_socket=d.get("tuner_socket"), run_id=d.get("run_id"), bind_cores=d.get("bind_cores", "auto"))


def _keep_deepspeed_from_compiling() -> None:
    """DeepSpeed loads native ops itself in a rank (cpu_adam for DeepSpeedCPUAdam, the shm comm op
    on the CPU accelerator), and would compile a missing one there, for minutes, with no output.
    Load them first without compiling (DeepSpeed then finds them in its cache); when cpu_adam is not
    built, DeepSpeed builds torch's AdamW instead: the engine takes only the param groups and
    hyperparameters from that optimizer and never steps it."""
    from engine.storage.native_ops import prepare_deepspeed_loads
    from integrations import ds_patches

    if not prepare_deepspeed_loads()["cpu_adam"]:
        ds_patches.build_torch_adam()


def install(settings: ZeroEngineSettings):
    """Make ``deepspeed.initialize`` build the engine's optimizer for ZeRO stage 3."""
    from engine.storage.native_ops import import_deepspeed

    ds = import_deepspeed()
    ds_compat.check_deepspeed(ds)
    _keep_deepspeed_from_compiling()
    from integrations import ds_patches
    from integrations.zero3_optimizer import OffloadZero3Optimizer

    OffloadZero3Optimizer.settings = settings  # one install per process: the rank's settings
    ds_patches.replace_zero3_optimizer(OffloadZero3Optimizer)
    return OffloadZero3Optimizer
