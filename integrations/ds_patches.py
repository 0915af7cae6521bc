"""Every change offloadctl makes to DeepSpeed's own objects, in one module.

- ``deepspeed.initialize``, wrapped once (:func:`wrap_initialize`): on each engine it returns, the
  ``load_checkpoint`` guard, the rank's checks, then the recorder.
- DeepSpeed's ZeRO-3 optimizer class, replaced in its module by the engine's subclass
  (:func:`replace_zero3_optimizer`).
- ``DeepSpeedEngine.get_optimizer_configuration``, wrapped on the class so that DeepSpeed builds
  torch's AdamW where cpu_adam is not built (:func:`build_torch_adam`).
- On each engine: ``load_checkpoint`` (:func:`guard_load_checkpoint`; what it says is
  :mod:`integrations.checkpoints`'), and for the recorder ``forward``, ``backward``, ``step`` and,
  under ``--engine stock``, the optimizer's per-subgroup update methods (:func:`attach_recorder`;
  :class:`report.recorder.Recorder` supplies the callbacks and keeps the spans).

The private names come from :mod:`integrations.ds_compat`'s table, which ``check_deepspeed``
compares with the installed DeepSpeed.
"""
from __future__ import annotations

import functools
import importlib
import inspect
import sys
from collections.abc import Callable

from engine.errors import CheckpointError, OffloadError
from integrations import checkpoints, ds_compat

ENGINE_PHASES = (("forward", "forward"), ("backward", "backward"), ("step", "update"))
"""DeepSpeedEngine's public methods the recorder times, with the phase each is: Hugging Face
Trainer and Accelerate call these, so their phases are recorded too."""

STOCK_UPDATE_PARTS = ((ds_compat.PREPARE_SUB_GROUP, "read_wait"), (ds_compat.OPTIMIZER_STEP, "host_lane"),
                      (ds_compat.RELEASE_SUB_GROUP, "write_wait"))
"""Stock ZeRO-3's per-subgroup update, with the part of the update each call is: swap-in (state
and gradients read), the optimizer step (CPU Adam or the GPU's), swap-out (state written)."""


def wrap_initialize(check: Callable[[object], None], recorder=None, *, rank: int = 0) -> None:
    """Make ``deepspeed.initialize`` guard ``load_checkpoint`` on every engine it returns, then call
    ``check(engine)`` (which may raise), then attach ``recorder`` (a
    :class:`report.recorder.Recorder`, or None)."""
    import deepspeed

    original = deepspeed.initialize

    @functools.wraps(original)
    def initialize(*args, **kwargs):
        result = original(*args, **kwargs)
        engine = result[0]
        guard_load_checkpoint(engine)  # a checkpoint that does not load: one line, stock or ours
        check(engine)
        if recorder is not None:
            try:
                attach_recorder(engine, recorder)
            except Exception as e:  # recording must never stop training
                print(f"offloadctl: recording off in rank {rank}: {type(e).__name__}: {e}", file=sys.stderr, flush=True)
        return result

    deepspeed.initialize = initialize


def replace_zero3_optimizer(cls: type) -> None:
    """Put ``cls`` in place of ``DeepSpeedZeroOptimizer_Stage3`` in DeepSpeed's stage3 module."""
    module, _, name = ds_compat.STAGE3.rpartition(".")
    # DeepSpeedEngine._configure_zero_optimizer imports the class from this module at call time
    # (ds_compat checks that it still does).
    setattr(importlib.import_module(module), name, cls)


def build_torch_adam() -> None:
    """Make DeepSpeed build torch's AdamW where its config asks for Adam (DeepSpeedCPUAdam needs
    the cpu_adam op, which DeepSpeed would otherwise compile in the rank). Idempotent."""
    from deepspeed.runtime.config import TORCH_ADAM_PARAM
    from deepspeed.runtime.engine import DeepSpeedEngine

    name = ds_compat.GET_OPTIMIZER_CONFIGURATION.name
    if getattr(DeepSpeedEngine, "_offloadctl_torch_adam", False):
        return
    original = getattr(DeepSpeedEngine, name)

    def get_optimizer_configuration(self, optimizer_parameters, *args, **kwargs):
        optimizer_parameters.setdefault(TORCH_ADAM_PARAM, True)  # a copy: DeepSpeed pops from it
        return original(self, optimizer_parameters, *args, **kwargs)

    setattr(DeepSpeedEngine, name, get_optimizer_configuration)
    DeepSpeedEngine._offloadctl_torch_adam = True


def guard_load_checkpoint(engine) -> None:
    """Make ``engine.load_checkpoint`` raise :class:`CheckpointError` (one line) on a checkpoint
    that does not load: :func:`integrations.checkpoints.preflight` on every rank first, and a
    failure inside DeepSpeed described by :func:`integrations.checkpoints.describe_failure`."""
    original = engine.load_checkpoint
    if getattr(original, "_offloadctl_guarded", False):
        return

    signature = inspect.signature(original)

    @functools.wraps(original)
    def load_checkpoint(load_dir, tag=None, *args, **kwargs):
        bound = signature.bind(load_dir, tag, *args, **kwargs)
        bound.apply_defaults()
        a = bound.arguments
        checkpoints.preflight(str(load_dir), tag, world_size=checkpoints.dp_world_size(engine),
                              universal=bool(getattr(engine, "load_universal_checkpoint", lambda: False)()),
                              optimizer_states=a.get("load_optimizer_states", True) and not a.get("load_module_only", False))
        try:
            return original(load_dir, tag, *args, **kwargs)
        except OffloadError:
            raise
        except Exception as e:  # noqa: BLE001 - any failure inside DeepSpeed's load reads the same to the user
            raise CheckpointError(checkpoints.describe_failure(str(load_dir), tag, e)) from e

    load_checkpoint._offloadctl_guarded = True
    engine.load_checkpoint = load_checkpoint


def attach_recorder(engine, recorder) -> None:
    """Record ``engine`` (a DeepSpeedEngine): ``recorder`` writes its init facts, every call of the
    methods of :data:`ENGINE_PHASES` becomes a span (and, under ``--engine stock``, those of
    :data:`STOCK_UPDATE_PARTS` spans inside the update), then the sampler starts.

    The hooks are instance attributes, so that only this engine is touched."""
    recorder.attach(engine)
    for name, phase in ENGINE_PHASES:
        setattr(engine, name, _phase_hook(getattr(engine, name), phase, engine, recorder))
    opt = getattr(engine, "optimizer", None)
    if recorder.config.engine == "stock" and opt is not None:
        for method, part in STOCK_UPDATE_PARTS:
            fn = getattr(opt, method.name, None)
            if callable(fn):  # missing (another DeepSpeed, another optimizer): the update is one span
                setattr(opt, method.name, _part_hook(fn, part, recorder))
    recorder.start_sampler()


def _phase_hook(fn, phase: str, engine, recorder):
    @functools.wraps(fn)
    def hook(*args, **kwargs):
        if not recorder.phase_starts(phase, args, kwargs):
            return fn(*args, **kwargs)
        steps = getattr(engine, "global_steps", None)
        failed = True
        try:
            out = fn(*args, **kwargs)
            failed = False
            return out
        finally:
            # An iteration ends with the step() that advances global_steps (the accumulation
            # boundary); earlier micro-batches' spans belong to it.
            boundary = phase == "update" and (failed or getattr(engine, "global_steps", None) != steps)
            recorder.phase_ends(phase, boundary, failed)

    return hook


def _part_hook(fn, part: str, recorder):
    @functools.wraps(fn)
    def hook(*args, **kwargs):
        t0 = recorder.part_starts()
        if t0 is None:
            return fn(*args, **kwargs)
        try:
            return fn(*args, **kwargs)
        finally:
            recorder.part_ends(part, t0)

    return hook
