"""Every change offloadctl makes to DeepSpeed's own objects, in one module.

Here:

- ``deepspeed.initialize``, wrapped once (:func:`wrap_initialize`): on each engine it returns, the
  ``load_checkpoint`` guard, the rank's checks, then the recorder.
- DeepSpeed's ZeRO-3 optimizer class, replaced in its module by the engine's subclass
  (:func:`replace_zero3_optimizer`; its overrides are listed below).
- ``DeepSpeedEngine.get_optimizer_configuration``, wrapped on the class so that DeepSpeed builds
  torch's AdamW where cpu_adam is not built (:func:`build_torch_adam`).
- ``is_zero_supported_optimizer`` as the engine module imported it, answering for an optimizer on
  DeepSpeed's list without importing Muon (:func:`answer_listed_optimizers_without_muon`).
- ``deepspeed.ops.__compatible_ops__``: an op the engine cannot load without compiling is marked
  incompatible, so that DeepSpeed does not compile it in the rank (:func:`keep_ops_from_deepspeed`;
  which ops, ``engine.storage.native_ops.prepare_deepspeed_loads`` says).
- DeepSpeed's logger: its stdout handler moved to stderr (:func:`engine.storage.native_ops.import_deepspeed`), and its records
  below ERROR sent to the run's log (:func:`quiet_deepspeed_logger`, a filter on the logger).
- ``warnings.showwarning``, replaced so that warnings raised inside DeepSpeed go to the run's log
  (:func:`route_deepspeed_warnings`).
- On each engine: ``load_checkpoint`` and ``save_checkpoint`` (:func:`guard_load_checkpoint`,
  :func:`guard_save_checkpoint`; what they say is :mod:`integrations.checkpoints`'), and for the
  recorder ``forward``, ``backward``, ``step`` and, under ``--engine stock``, the optimizer's
  per-subgroup update methods (:func:`attach_recorder`; :class:`report.recorder.Recorder`
  supplies the callbacks and keeps the spans).

The subclass, ``integrations.zero3_optimizer.OffloadZero3Optimizer``, overrides these methods of
``DeepSpeedZeroOptimizer_Stage3``:

- ``_configure_offloading``: requires ``offload_optimizer``, and creates no swapper;
- ``_create_fp32_partitions``, ``initialize_optimizer_states``: placeholders, no fp32 copies and
  no Adam state (the engine's);
- ``_offload_grad_partition_at_boundary``: the norm bookkeeping, no fp32 gradient copy;
- ``partition_grads``: DeepSpeed's body (checked, ``ds_compat.COPIED``) less one PCIe round trip;
- ``_setup_for_real_optimizer``: the gradient buffer pinned in place, then the engine built;
- ``step``: DeepSpeed's overflow check, loss scale and clipping, then the engine's update (a
  skipped step is told to the engine, so that the next iteration is timed alone);
- ``backward_prologue``: the engine reads ahead, then DeepSpeed's;
- ``_swappable_optimizer_subgroup``, ``_optimizer_states_and_gradient_swap_in``,
  ``_optimizer_states_and_gradient_swap_out``, ``_release_swap_buffers``,
  ``_writeback_swap_state``: a subgroup's state checked out of the engine and back in;
- ``_restore_from_bit16_weights``, ``_load_universal_checkpoint``, ``state_dict``,
  ``_rigid_load_state_dict``: checkpoints in DeepSpeed's layout, from and into the engine;
- ``offload_states``, ``reload_states``: the engine's device memory given back and taken again,
  the time between them kept out of the next iteration's;
- ``destroy``: the engine closed; DeepSpeed unpins only what it pinned.

Elsewhere, and only for as long as one call: ``integrations.launcher.resolved_launch``
(``--dry-run``) runs DeepSpeed's launcher ``runner.main`` in-process with its ``subprocess``
module and the multinode runners' ``backend_exists`` replaced, and puts them back after, to read
the command it would start.

Elsewhere, not DeepSpeed's: ``engine.storage.native_ops.import_deepspeed`` replaces py-cpuinfo's
``get_cpu_info`` before DeepSpeed is imported (its answer kept beside the built ops), and runs
DeepSpeed's import and op builders with stdout sent to stderr (a handler DeepSpeed's logger
makes during that import writes to stderr).

The private names come from :mod:`integrations.ds_compat`'s table, which ``check_deepspeed``
compares with the installed DeepSpeed.
"""

from __future__ import annotations

import contextlib
import functools
import importlib
import inspect
import logging
import os
import sys
import types
import warnings
from collections.abc import Callable, Iterable

from engine.errors import CheckpointError, OffloadError
from engine.storage.native_ops import import_deepspeed
from engine.text import say_line
from integrations import checkpoints, ds_compat

ENGINE_PHASES = (("forward", "forward"), ("backward", "backward"), ("step", "update"))
"""DeepSpeedEngine's public methods the recorder times, with the phase each is: Hugging Face
Trainer and Accelerate call these, so their phases are recorded too."""

STOCK_UPDATE_PARTS = (
    (ds_compat.PREPARE_SUB_GROUP, "read_wait"),
    (ds_compat.OPTIMIZER_STEP, "host_lane"),
    (ds_compat.RELEASE_SUB_GROUP, "write_wait"),
)
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
                say_line(f"offloadctl: recording off in rank {rank}: {type(e).__name__}: {e}")
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


def answer_listed_optimizers_without_muon() -> None:
    """DeepSpeed's ``is_zero_supported_optimizer`` imports its Muon optimizer on each call, to put
    it on the list of supported optimizers. That import runs ``torch.compile``'s decorator, which
    imports torch's inductor: 1.7 s of each rank's start on 2 cores, whatever the optimizer. An
    optimizer already on the list is supported whatever Muon adds, so it is answered (with
    DeepSpeed's log line) without the import; any other goes to DeepSpeed's own check, which
    imports Muon as before. Only where the installed body is the one read (``ds_compat.COPIED``).
    Idempotent."""
    from deepspeed.runtime import engine as ds_engine
    from deepspeed.runtime.zero import utils as zero_utils

    m = ds_compat.IS_ZERO_SUPPORTED_OPTIMIZER
    original = getattr(zero_utils, m.name)
    if getattr(ds_engine, m.name) is not original or not ds_compat.copied_source_matches(m.owner, m.name):
        return

    def is_zero_supported_optimizer(optimizer):
        if type(optimizer) not in zero_utils.ZERO_SUPPORTED_OPTIMIZERS:
            return original(optimizer)
        if zero_utils.dist.get_rank() == 0:
            zero_utils.logger.info(f"Checking ZeRO support for optimizer={optimizer.__class__.__name__} type={type(optimizer)}")
        return True

    setattr(ds_engine, m.name, is_zero_supported_optimizer)


def keep_ops_from_deepspeed(ops: Iterable[str]) -> None:
    """Mark ``ops`` incompatible in ``deepspeed.ops.__compatible_ops__``: DeepSpeed then uses its
    fallback (torch.distributed's all-reduce for the shm comm op) instead of compiling them."""
    compatible = import_deepspeed().ops.__compatible_ops__
    for op in ops:
        compatible[op] = False


class _ToLog(logging.Filter):
    """On DeepSpeed's logger: records below ERROR go to ``log`` (or nowhere) instead of its handler."""

    def __init__(self, log) -> None:
        super().__init__()
        self.log = log
        self.formatter = logging.Formatter("[%(asctime)s] [%(levelname)s] [%(filename)s:%(lineno)d:%(funcName)s] %(message)s")

    def filter(self, record: logging.LogRecord) -> bool:
        if record.levelno >= logging.ERROR:
            return True
        if self.log is not None:
            with contextlib.suppress(OSError, ValueError):
                self.log.write((self.formatter.format(record) + "\n").encode())
        return False


def quiet_deepspeed_logger(log=None) -> None:
    """DeepSpeed's logger keeps its errors and sends the rest to ``log`` (a binary file, or None:
    dropped). Call before DeepSpeed is imported: it logs as it imports (the accelerator line),
    and it takes this same logger object by name, filters included."""
    logger = logging.getLogger("DeepSpeed")
    if not any(isinstance(f, _ToLog) for f in logger.filters):
        logger.addFilter(_ToLog(log))


def route_deepspeed_warnings(log) -> None:
    """Python warnings raised inside DeepSpeed (torch's deprecations of the calls DeepSpeed makes,
    and DeepSpeed's own) go to ``log``; other warnings are shown as before. Which it is is decided
    where the warning arises: walking out from it past the standard library and third-party
    packages (torch, typing_extensions...), is the first frame left DeepSpeed's?"""
    import importlib.util
    import sysconfig

    spec = importlib.util.find_spec("deepspeed")
    if spec is None or not spec.origin:
        return
    deepspeed_dir = os.path.dirname(os.path.realpath(spec.origin)) + os.sep
    libraries = tuple({os.path.realpath(sysconfig.get_paths()[k]) + os.sep for k in ("stdlib", "purelib", "platlib")})
    shown = warnings.showwarning

    def from_deepspeed() -> bool:
        frame: types.FrameType | None = sys._getframe(2)
        while frame is not None:
            path = os.path.realpath(frame.f_code.co_filename)
            if path.startswith(deepspeed_dir):
                return True
            if not path.startswith(libraries) and not path.startswith("<"):
                return False
            frame = frame.f_back
        return False

    def showwarning(message, category, filename, lineno, file=None, line=None):
        if from_deepspeed():
            with contextlib.suppress(OSError, ValueError):
                log.write(warnings.formatwarning(message, category, filename, lineno, line).encode())
            return
        shown(message, category, filename, lineno, file, line)

    warnings.showwarning = showwarning


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
        checkpoints.preflight(
            str(load_dir),
            tag,
            world_size=checkpoints.dp_world_size(engine),
            universal=bool(getattr(engine, "load_universal_checkpoint", lambda: False)()),
            optimizer_states=a.get("load_optimizer_states", True) and not a.get("load_module_only", False),
        )
        try:
            return original(load_dir, tag, *args, **kwargs)
        except OffloadError:
            raise
        except Exception as e:  # noqa: BLE001 - any failure inside DeepSpeed's load reads the same to the user
            raise CheckpointError(checkpoints.describe_failure(str(load_dir), tag, e)) from e

    load_checkpoint._offloadctl_guarded = True  # type: ignore[attr-defined]  # mypy types no attributes set on a function
    engine.load_checkpoint = load_checkpoint


def guard_save_checkpoint(engine) -> None:
    """Make ``engine.save_checkpoint`` raise :class:`CheckpointError` (one line) where the disk
    fills or fails under it (torch says only "iostream error" or "file write failed"), and remove
    the checkpoint folder it had begun (the earlier checkpoints and ``latest`` stay as they were)."""
    import shutil

    original = engine.save_checkpoint
    if getattr(original, "_offloadctl_guarded", False):
        return

    @functools.wraps(original)
    def save_checkpoint(save_dir, tag=None, *args, **kwargs):
        folder = os.path.join(str(save_dir), str(tag)) if tag is not None else None
        fresh = folder is not None and not os.path.exists(folder)
        opt = getattr(engine, "optimizer", None)
        if opt is not None:  # the engine's optimizer saves the step it is saved at, for this save only
            opt.checkpoint_global_steps = engine.global_steps
        try:
            return original(save_dir, tag, *args, **kwargs)
        except Exception as e:  # noqa: BLE001 - torch's and DeepSpeed's ways of saying a write failed
            why = checkpoints.describe_write_failure(str(save_dir), e)
            if why is None:
                raise
            if fresh and os.path.isdir(folder):
                shutil.rmtree(folder, ignore_errors=True)
            raise CheckpointError(
                f"checkpoint {folder or save_dir} not saved: {why}; the run's earlier checkpoints are as they were"
            ) from e
        finally:
            if opt is not None:
                opt.checkpoint_global_steps = None

    save_checkpoint._offloadctl_guarded = True  # type: ignore[attr-defined]  # mypy types no attributes set on a function
    engine.save_checkpoint = save_checkpoint


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
