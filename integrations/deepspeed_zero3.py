"""Putting the engine inside DeepSpeed ZeRO-3: :func:`install`.

:func:`install` checks the installed DeepSpeed (``ds_compat``), loads DeepSpeed's native ops
without compiling them in the rank, and has ``ds_patches`` put the subclass
(``integrations.zero3_optimizer.OffloadZero3Optimizer``, which says what it changes against stock
DeepSpeed) in place of DeepSpeed's ZeRO-3 optimizer before ``deepspeed.initialize``, given the
rank's :class:`ZeroEngineSettings` (``integrations.settings``) by ``optimizer_class``.
"""

from __future__ import annotations

from engine.storage.native_ops import import_deepspeed, prepare_deepspeed_loads
from integrations import ds_compat, ds_patches
from integrations.settings import ZeroEngineSettings


def _keep_deepspeed_from_compiling() -> None:
    """DeepSpeed loads native ops itself in a rank (cpu_adam for DeepSpeedCPUAdam, the shm comm op
    on the CPU accelerator), and would compile a missing one there, for minutes, with no output.
    Load them first without compiling (DeepSpeed then finds them in its cache). One that is not
    built is kept from DeepSpeed: the shm comm op is marked incompatible (torch.distributed's
    all-reduce is used), and without cpu_adam DeepSpeed builds torch's AdamW instead: the engine
    takes only the param groups and hyperparameters from that optimizer and never steps it."""
    ops = prepare_deepspeed_loads()
    if ops["deepspeed_shm_comm"].fallback is not None:
        ds_patches.keep_ops_from_deepspeed(["deepspeed_shm_comm"])
    if ops["cpu_adam"].fallback is not None:
        ds_patches.build_torch_adam()


def install(settings: ZeroEngineSettings):
    """Make ``deepspeed.initialize`` build the engine's optimizer for ZeRO stage 3."""
    ds = import_deepspeed()
    ds_compat.check_deepspeed(ds)
    _keep_deepspeed_from_compiling()
    from integrations.zero3_optimizer import optimizer_class

    cls = optimizer_class(settings)
    ds_patches.replace_zero3_optimizer(cls)
    ds_patches.answer_listed_optimizers_without_muon()
    return cls
