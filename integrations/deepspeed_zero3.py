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
``deepspeed.initialize``, with the rank's :class:`ZeroEngineSettings` (``integrations.settings``).
"""
from __future__ import annotations

from integrations import ds_compat
from integrations.settings import ZeroEngineSettings


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
