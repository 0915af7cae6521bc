"""What the ZeRO-3 integration depends on inside DeepSpeed, in one table, and the checks against it.

``integrations/zero3_optimizer.py`` overrides and calls private methods of
``DeepSpeedZeroOptimizer_Stage3`` and uses attributes its ``__init__`` sets up;
``integrations/ds_patches.py`` wraps private methods named here. None of that is DeepSpeed's
public API, and a changed signature or renamed attribute would otherwise surface mid-run as a
traceback deep in DeepSpeed (or, for a parameter DeepSpeed starts passing, as a silently
different update). The version range alone cannot tell, so the checks compare the table with
what is installed:

- :func:`check_deepspeed` (at install, in ``offloadctl info`` and so in ``make setup``): the
  version against the range, each method's parameter names against the table, each
  attribute against the names DeepSpeed's own source assigns, and the bodies of the methods
  whose behaviour the integration relies on (:data:`MIRRORED`) against the release checked.
- :func:`check_optimizer_instance` (once per optimizer, when the engine is built on it): the
  attributes on the live object, its parameter-offload helper and its parameters.

Both raise :class:`engine.errors.ConfigError` with one line: the DeepSpeed version, the method or
attribute at fault, and the fix.

The supported range is owned by ``pyproject.toml`` (the ``deepspeed`` dependency); it is read
from the installed package's metadata, and :data:`DEEPSPEED_REQUIREMENT` is only the fallback
where that is missing (a test keeps the two equal).
"""

from __future__ import annotations

import ast
import contextlib
import functools
import importlib
import inspect
from dataclasses import dataclass

from engine.errors import ConfigError
from engine.storage.native_ops import import_deepspeed

DEEPSPEED_REQUIREMENT = "deepspeed>=0.19.8,<0.20"
"""Used only without offloadctl's package metadata (running from a bare checkout)."""

CHECKED_AGAINST = "0.19.8"
"""The DeepSpeed release the table below was taken from: the fix offered when an in-range
release does not match it."""

STAGE3 = "deepspeed.runtime.zero.stage3.DeepSpeedZeroOptimizer_Stage3"
ENGINE = "deepspeed.runtime.engine.DeepSpeedEngine"
PARAM_OFFLOAD = "deepspeed.runtime.zero.parameter_offload.DeepSpeedZeRoOffload"
UTILS = "deepspeed.runtime.utils"
PARTITION_PARAMETERS = "deepspeed.runtime.zero.partition_parameters"
ZERO_UTILS = "deepspeed.runtime.zero.utils"


@dataclass(frozen=True)
class Method:
    """A method or function the integration overrides, calls or wraps."""

    owner: str
    """Dotted path of its class or module."""
    name: str
    params: tuple[str, ...]
    """Parameter names after ``self`` as :func:`inspect.signature` gives them ("*args", "**kw")."""
    use: str
    """override: our subclass replaces it, so DeepSpeed's callers must pass what ours takes;
    call: ours calls it; wrap: ours wraps it and forwards the arguments."""


@dataclass(frozen=True)
class Attribute:
    """An attribute the integration reads or writes on a DeepSpeed object."""

    owner: str
    """Dotted path of the class whose source sets it (``self.name = ...``); for the ZeRO-3
    parameters, the module whose source sets it (``param.name = ...``)."""
    name: str
    """As on the object: name-mangled where DeepSpeed's source writes ``self.__name``."""
    live: bool = True
    """Present when DeepSpeed's ``_setup_for_real_optimizer`` returns, where
    :func:`check_optimizer_instance` looks. False: set later in ``__init__`` (or a property
    that reads such an attribute), so only the check against the source covers it."""


# What integrations/ds_patches.py wraps (besides DeepSpeed's public API), named here once.
GET_OPTIMIZER_CONFIGURATION = Method(
    ENGINE, "get_optimizer_configuration", ("optimizer_parameters", "adam_w_mode", "allow_legacy_fallback"), "wrap"
)
"""Wrapped on the class so that DeepSpeed builds torch's AdamW when cpu_adam is not built; the
wrapper sets a key in the first argument and forwards the rest."""
PREPARE_SUB_GROUP = Method(STAGE3, "_prepare_sub_group", ("sub_group_id", "timer_names"), "wrap")
OPTIMIZER_STEP = Method(STAGE3, "_optimizer_step", ("sub_group_id",), "wrap")
RELEASE_SUB_GROUP = Method(STAGE3, "_release_sub_group", ("sub_group_id", "timer_names"), "wrap")
"""Stock ZeRO-3's per-subgroup update (swap-in, optimizer step, swap-out), wrapped on the live
optimizer for the recorder under ``--engine stock``, each call forwarded as it came."""
IS_ZERO_SUPPORTED_OPTIMIZER = Method(ZERO_UTILS, "is_zero_supported_optimizer", ("optimizer",), "wrap")
"""Wrapped where the engine module imported it, so that an optimizer already on DeepSpeed's list is
answered without importing Muon (``ds_patches.answer_listed_optimizers_without_muon``)."""

METHODS: tuple[Method, ...] = (
    # Overridden by OffloadZero3Optimizer.
    Method(STAGE3, "_configure_offloading", ("offload_optimizer_config", "offload_param_config"), "override"),
    Method(STAGE3, "_create_fp32_partitions", (), "override"),
    Method(STAGE3, "initialize_optimizer_states", (), "override"),
    Method(
        STAGE3,
        "_offload_grad_partition_at_boundary",
        ("param", "grad_buffer", "offload_fp32_gradients", "offload_fp32_offsets"),
        "override",
    ),
    Method(STAGE3, "_setup_for_real_optimizer", (), "override"),
    Method(STAGE3, "step", ("closure",), "override"),
    Method(STAGE3, "state_dict", (), "override"),
    Method(STAGE3, "_rigid_load_state_dict", ("state_dict", "load_optimizer_states"), "override"),
    Method(STAGE3, "destroy", (), "override"),
    Method(STAGE3, "partition_grads", ("params_to_release", "grad_partitions"), "override"),
    Method(STAGE3, "backward_prologue", (), "override"),
    # The partitioned-state API's swap hooks, overridden to check state out of the engine.
    Method(STAGE3, "_swappable_optimizer_subgroup", ("sub_group_id",), "override"),
    Method(STAGE3, "_optimizer_states_and_gradient_swap_in", ("sub_group_id", "timer_names"), "override"),
    Method(STAGE3, "_optimizer_states_and_gradient_swap_out", ("sub_group_id", "timer_names"), "override"),
    Method(STAGE3, "_release_swap_buffers", ("sub_group_id",), "override"),
    Method(STAGE3, "_writeback_swap_state", ("sub_group_id", "write_opt_state", "write_gradients"), "override"),
    Method(STAGE3, "_restore_from_bit16_weights", (), "override"),
    Method(STAGE3, "offload_states", ("include", "device", "pin_memory", "non_blocking"), "override"),
    Method(STAGE3, "reload_states", ("non_blocking",), "override"),
    Method(
        STAGE3, "_load_universal_checkpoint", ("checkpoint_folder", "load_optimizer_states", "load_from_fp32_weights"), "override"
    ),
    # Called by the overrides (step() is rebuilt from DeepSpeed's own helpers).
    Method(STAGE3, "_pre_step", (), "call"),
    Method(STAGE3, "_partition_all_parameters", (), "call"),
    Method(STAGE3, "_overflow_check_and_loss_scale_update", ("update_scale",), "call"),
    Method(STAGE3, "_get_norm_groups", (), "call"),
    Method(STAGE3, "_loss_scale_update_and_overflow_cleanup", (), "call"),
    Method(STAGE3, "_post_step", ("timer_names",), "call"),
    Method(STAGE3, "_unflatten_partitioned_parameters", ("sub_group_id",), "call"),
    Method(STAGE3, "get_param_id", ("param",), "call"),
    Method(STAGE3, "_constant_buffered_norm2", ("input", "buffer_size"), "call"),
    Method(STAGE3, "_get_param_partition_rank", ("param",), "call"),
    Method(STAGE3, "is_gradient_accumulation_boundary", (), "call"),
    Method(STAGE3, "_swap_out_offload_fp32_gradients", ("offload_fp32_gradients", "offload_fp32_offsets"), "call"),
    Method(UTILS, "combine_grad_norm_groups", ("norm_groups", "norm_type"), "call"),
    Method(UTILS, "is_invalid_grad_norm", ("norm",), "call"),
    # Patched by integrations/ds_patches.py, which takes these names from the entries above.
    GET_OPTIMIZER_CONFIGURATION,
    PREPARE_SUB_GROUP,
    OPTIMIZER_STEP,
    RELEASE_SUB_GROUP,
    IS_ZERO_SUPPORTED_OPTIMIZER,
    # install() replaces the class in the stage3 module; this must import it from there at call time.
    Method(ENGINE, "_configure_zero_optimizer", ("optimizer",), "call"),
)

ATTRIBUTES: tuple[Attribute, ...] = (
    *(
        Attribute(STAGE3, name)
        for name in (
            "optimizer",
            "offload_optimizer",
            "swap_optimizer",
            "offload_optimizer_pin_memory",
            "fp16_groups",
            "fp16_partitioned_groups_flat",
            "fp16_partitioned_groups_flat_numel",
            "fp16_partitioned_groups_flat_id",
            "fp32_partitioned_groups_flat",
            "sub_group_to_group_id",
            "subgroup_to_device",
            "grad_partitions_flat_buffer",
            "_DeepSpeedZeroOptimizer_Stage3__param_id_to_grad_partition",
            "parameter_offload",
            "prefetch_elements",
            "overflow",
            "clip_grad",
            "_global_grad_norm",
            "partition_count",
            "_offload_boundary_param_ids",
            "gradient_accumulation_dtype",
        )
    ),
    *(
        Attribute(STAGE3, name, live=False)
        for name in (
            "norm_for_param_grads",
            "loss_scaler",
            "dynamic_loss_scale",
            "loss_scale",
            "micro_step_id",
            "offloaded_states",
        )
    ),
    Attribute(PARAM_OFFLOAD, "_max_available_parameters_in_numel"),
    *(Attribute(PARTITION_PARAMETERS, name) for name in ("ds_id", "ds_numel", "partition_numel")),
)

COPIED: dict[tuple[str, str], str] = {
    (STAGE3, "partition_grads"): "ef0ab1c41f74894cf9d033df644e09bd26325849ed62cfe744affa20b775793c",
    (ZERO_UTILS, "is_zero_supported_optimizer"): "32bf7a76f4c99d89df16b144e6877f22365a394c677876eb4c05be834033588f",
}
"""Methods whose body the integration copies with a change (sha256 of DeepSpeed's source, as
:func:`copied_source_matches` reads it, in release ``CHECKED_AGAINST``). Where the installed body
differs, the override runs DeepSpeed's own instead: a fix DeepSpeed made there is never lost,
only our change to it."""

MIRRORED: dict[tuple[str, str], tuple[str, str]] = {
    (STAGE3, "step"): (
        "588aaf2c337d5634769f9afa53f7952af4f3efbba5089826a9bf86263afa60c5",
        "offloadctl's step() rebuilds it around the engine: the overflow check, the norms, then the loss-scale "
        "update (0.19.6's order), and no gradient zeroed per subgroup (0.19.6 stopped it)",
    ),
    (STAGE3, "offload_states"): (
        "3275adee1e1fb87f34ea0f2c038089e82bb67b4d014d4089ca35ce0d5873f291",
        "offloadctl's override hands it only the states DeepSpeed still owns (what offloaded_states holds is "
        "skipped: the engine's states and gradient buffer)",
    ),
    (STAGE3, "reload_states"): (
        "51220c8de9390b1d96defdfc94f88a8fa14a5d05997b9a27d439400c3a3166a8",
        "offloadctl's override takes the engine's states out of offloaded_states first, so that it moves neither "
        "them nor the gradient buffer to the GPU",
    ),
    (STAGE3, "_unpin_offload_buffers"): (
        "91b0b0d0ba0d41a6603d898af4161c4b5f4be581ccdb439a8d7729b6d9ca73fe",
        "destroy() unpins these buffers (since 0.19.7); offloadctl's destroy() hides the gradient buffer, which the "
        "engine pinned in place itself, and owns no other of them",
    ),
    (STAGE3, "_release_sub_group"): (
        "ebde3fca8c27c118378a585c7745f542d367bfee12bfe93ab4ce1549e80af307",
        "with offload_optimizer it releases nothing itself and swaps the subgroup out (since 0.19.7 the fp32 "
        "gradient is dropped here only without it): the engine's check-in drops the gradient it lent",
    ),
}
"""DeepSpeed methods whose behaviour, not only whose signature, the integration relies on (sha256
of the body as :func:`copied_source_matches` reads it, in release ``CHECKED_AGAINST``), and what
it relies on. DeepSpeed 0.19.6-0.19.8 changed four behaviours around the store the engine
replaces; a release that changes one of these again fails the check, naming it, rather than run
on an assumption that no longer holds. (The fourth change, prefetching the next subgroup only
with timers on, is inside ``_optimizer_states_and_gradient_swap_in``, which the integration
overrides and which reads no next subgroup: nothing relies on it.)"""

OWN_ATTRIBUTES: tuple[str, ...] = (
    "_ds_nvme_path",
    "offload_grad_scale",
    "_bindings",
    "offload_engine",
    "device_fit",
    "tuner_client",
    "plan_summary",
    "settings",
    "_checked_out",
)
"""What OffloadZero3Optimizer sets on itself: a DeepSpeed that sets one of these too would
have the subclass overwrite its state (or the reverse)."""

NAMES: tuple[tuple[str, str], ...] = (
    ("deepspeed.checkpoint.constants", "FP32_FLAT_GROUPS"),
    ("deepspeed.checkpoint.constants", "LOSS_SCALER"),
    ("deepspeed.checkpoint.constants", "OPTIMIZER_STATE_DICT"),
    ("deepspeed.checkpoint.constants", "PARTITION_COUNT"),
    ("deepspeed.checkpoint.constants", "ZERO_STAGE"),
    ("deepspeed.runtime.zero.config", "ZeroStageEnum"),
    ("deepspeed.runtime.config", "TORCH_ADAM_PARAM"),
    ("deepspeed.runtime.zero.offload_config", "OffloadDeviceEnum"),
    ("deepspeed.runtime.zero.offload_config", "OffloadStateTypeEnum"),
    (ZERO_UTILS, "ZERO_SUPPORTED_OPTIMIZERS"),
    ("deepspeed.runtime.engine", "is_zero_supported_optimizer"),
)
"""Module-level names the integration imports."""


def supported_requirement() -> str:
    """The ``deepspeed`` requirement of the installed offloadctl, else the fallback constant."""
    import importlib.metadata

    from packaging.requirements import Requirement

    try:
        requires = importlib.metadata.requires("offloadctl") or []
    except importlib.metadata.PackageNotFoundError:
        requires = []
    for line in requires:
        req = Requirement(line)
        if req.name == "deepspeed" and (req.marker is None or req.marker.evaluate({"extra": ""})):
            # Lower bounds first, as written in pyproject.toml (the metadata sorts them otherwise).
            specs = sorted(req.specifier, key=lambda s: (s.operator.startswith("<"), str(s)))
            return "deepspeed" + ",".join(str(s) for s in specs)
    return DEEPSPEED_REQUIREMENT


def _fix(version: str, requirement: str) -> str:
    from packaging.requirements import Requirement

    if _in_range(version, Requirement(requirement)):
        return (
            f"install the release the integration was checked against "
            f"(pip install 'deepspeed=={CHECKED_AGAINST}' --no-build-isolation)"
        )
    return f"install a DeepSpeed version in the supported range (pip install '{requirement}' --no-build-isolation)"


def _in_range(version: str, requirement) -> bool:
    # Pre-releases of an in-range version (a source build, 0.19.9.dev0) count as in range; the
    # method and attribute checks then decide.
    return requirement.specifier.contains(version, prereleases=True)


def _fail(version: str, requirement: str, faults: list[str]) -> ConfigError:
    more = f" (and {len(faults) - 1} more: {'; '.join(faults[1:])})" if len(faults) > 1 else ""
    return ConfigError(
        f"DeepSpeed {version} does not match offloadctl's ZeRO-3 integration: {faults[0]}{more}: {_fix(version, requirement)}"
    )


def _resolve(path: str, ds_name: str):
    """The class or module at ``path`` (a path under ``deepspeed``), or None."""
    path = ds_name + path[len("deepspeed") :]
    with contextlib.suppress(ImportError):
        return importlib.import_module(path)
    module, _, name = path.rpartition(".")
    try:
        obj = getattr(importlib.import_module(module), name, None)
    except ImportError:
        return None
    if inspect.isclass(obj):
        # After install() the stage3 module holds our subclass: check DeepSpeed's class beneath it.
        obj = next((c for c in obj.__mro__ if c.__module__.split(".")[0] == ds_name.split(".")[0]), obj)
    return obj


def _short(path: str) -> str:
    return path.rsplit(".", 1)[-1]


def _unwrap(fn, name: str):
    """The function DeepSpeed wrote, beneath its decorators: ``functools.wraps`` ones through
    ``__wrapped__``, and ``instrument_w_nvtx`` (which does not use it) through its closure."""
    fn = inspect.unwrap(fn)
    for _ in range(4):
        if getattr(fn, "__name__", name) == name or not getattr(fn, "__closure__", None):
            break
        inner = []
        for cell in fn.__closure__:
            try:
                c = cell.cell_contents
            except ValueError:  # an empty cell
                continue
            if inspect.isfunction(c) and c.__name__ == name:
                inner.append(c)
        if len(inner) != 1:
            break
        fn = inspect.unwrap(inner[0])
    return fn


def _param_names(fn, drop_self: bool) -> tuple[str, ...]:
    out = []
    for p in inspect.signature(fn).parameters.values():
        prefix = {"VAR_POSITIONAL": "*", "VAR_KEYWORD": "**"}.get(p.kind.name, "")
        out.append(prefix + p.name)
    return tuple(out[1:] if drop_self and out else out)


def _render(params: tuple[str, ...], method: bool) -> str:
    return "(" + ", ".join((("self",) if method else ()) + params) + ")"


def _method_fault(m: Method, ds_name: str) -> str | None:
    owner = _resolve(m.owner, ds_name)
    is_class = inspect.isclass(owner)
    expected = f"{_short(m.owner)}.{m.name}{_render(m.params, is_class or owner is None)}"
    if owner is None:
        return f"{expected} expected, found no {m.owner}"
    fn = inspect.getattr_static(owner, m.name, None)
    if isinstance(fn, (staticmethod, classmethod)):
        return f"{expected} expected, found a {type(fn).__name__}"
    if not callable(fn):
        return f"{expected} expected, found {'no such method' if fn is None else type(fn).__name__}"
    try:
        found = _param_names(_unwrap(fn, m.name), drop_self=is_class)
    except (TypeError, ValueError):
        return f"{expected} expected, found a callable without a signature"
    if found != m.params:
        return f"{expected} expected, found {_render(found, is_class)}"
    return None


def _module_tree(module) -> ast.Module | None:
    """The parsed source of ``module``, parsed once (stage3.py alone is 4,000 lines)."""
    if module.__name__ not in _trees:
        try:
            _trees[module.__name__] = ast.parse(inspect.getsource(module))
        except (OSError, TypeError, SyntaxError):
            _trees[module.__name__] = None
    return _trees[module.__name__]


_trees: dict[str, ast.Module | None] = {}


def _assigned_names(owner, receiver: str) -> set[str] | None:
    """Attribute names ``owner``'s source assigns on ``receiver`` (``self.x = ...``), name-mangled
    as Python does; for a class, over its bases from the same package too. None without source."""
    package = owner.__name__ if inspect.ismodule(owner) else owner.__module__
    classes = (
        [c for c in owner.__mro__ if c.__module__.split(".")[0] == package.split(".")[0]] if inspect.isclass(owner) else [owner]
    )
    names: set[str] = set()
    for c in classes:
        tree: ast.AST | None = _module_tree(c if inspect.ismodule(c) else importlib.import_module(c.__module__))
        if tree is not None and inspect.isclass(c):
            tree = next((n for n in ast.walk(tree) if isinstance(n, ast.ClassDef) and n.name == c.__name__), None)
        if tree is None:
            return None
        mangle = f"_{c.__name__.lstrip('_')}" if inspect.isclass(c) else ""
        for node in ast.walk(tree):
            targets = (
                node.targets
                if isinstance(node, ast.Assign)
                else [node.target]
                if isinstance(node, (ast.AnnAssign, ast.AugAssign))
                else []
            )
            stack = list(targets)
            while stack:
                t = stack.pop()
                if isinstance(t, (ast.Tuple, ast.List)):
                    stack.extend(t.elts)
                elif isinstance(t, ast.Attribute) and isinstance(t.value, ast.Name) and t.value.id == receiver:
                    private = t.attr.startswith("__") and not t.attr.endswith("__")
                    names.add(mangle + t.attr if private and mangle else t.attr)
        if inspect.isclass(c):
            names.update(vars(c))  # properties and class attributes
    return names


def _attribute_faults(ds_name: str) -> list[str]:
    faults, cache = [], {}
    for a in ATTRIBUTES:
        if a.owner not in cache:
            owner = _resolve(a.owner, ds_name)
            receiver = "self" if inspect.isclass(owner) else "param"
            cache[a.owner] = None if owner is None else _assigned_names(owner, receiver)
        names = cache[a.owner]
        if names is not None and a.name not in names:
            faults.append(f"{_short(a.owner)}.{a.name} expected, found nothing in its source that sets it")
    stage3 = cache.get(STAGE3)
    for name in OWN_ATTRIBUTES:
        if stage3 is not None and name in stage3:
            faults.append(f"DeepSpeedZeroOptimizer_Stage3.{name} expected to be offloadctl's own, found DeepSpeed setting it too")
    return faults


def _call_time_import_fault(ds_name: str) -> str | None:
    # install() swaps the class in the stage3 module, which reaches DeepSpeed only if the engine
    # imports the class from there when it builds the optimizer, not once at import.
    engine = _resolve(ENGINE, ds_name)
    try:
        src = inspect.getsource(engine._configure_zero_optimizer)
    except (AttributeError, OSError, TypeError):
        return None  # no source: the method check above already covers a missing method
    if "import DeepSpeedZeroOptimizer_Stage3" not in src:
        return (
            "DeepSpeedEngine._configure_zero_optimizer expected to import DeepSpeedZeroOptimizer_Stage3 "
            "when it runs, found no such import"
        )
    return None


def _name_faults(ds_name: str) -> list[str]:
    faults = []
    for module, name in NAMES:
        try:
            present = hasattr(importlib.import_module(ds_name + module[len("deepspeed") :]), name)
        except ImportError:
            present = False
        if not present:
            faults.append(f"{module}.{name} expected, found no such name")
    return faults


def _source_sha(owner: str, name: str, ds_name: str = "deepspeed") -> str | None:
    """sha256 of the installed ``owner.name``'s body (cleaned of indentation); None without one."""
    import hashlib

    try:
        fn = _unwrap(getattr(_resolve(owner, ds_name), name), name)
        src = inspect.cleandoc(inspect.getsource(fn))
    except (AttributeError, OSError, TypeError, ImportError):
        return None
    return hashlib.sha256(src.encode()).hexdigest()


def _mirrored_faults(ds_name: str) -> list[str]:
    faults = []
    checked = {(m.owner, m.name) for m in METHODS}
    for (owner, name), (sha, why) in MIRRORED.items():
        found = _source_sha(owner, name, ds_name)
        if found is None and (owner, name) in checked:
            continue  # the method check says it is missing
        if found != sha:
            what = "no such method" if found is None else "another body"
            faults.append(f"{_short(owner)}.{name} as in {CHECKED_AGAINST} expected ({why}), found {what}")
    return faults


def check_deepspeed(ds_module=None) -> None:
    """Raise :class:`ConfigError` (one line) if the installed DeepSpeed is outside the supported
    range, or if a method, attribute or name of :data:`METHODS`, :data:`ATTRIBUTES`, :data:`NAMES`
    differs from the table. ``ds_module``: the imported ``deepspeed`` (imported here if None)."""
    from packaging.requirements import Requirement

    requirement = supported_requirement()
    if ds_module is None:
        try:
            ds_module = import_deepspeed()
        except Exception as e:  # noqa: BLE001 - any import failure reads the same to the user
            raise ConfigError(
                f"DeepSpeed does not import ({type(e).__name__}: {e}): install a DeepSpeed version "
                f"in the supported range (pip install '{requirement}' --no-build-isolation)"
            ) from e
    version = str(ds_module.__version__)
    if not _in_range(version, Requirement(requirement)):
        raise ConfigError(
            f"DeepSpeed {version} is outside offloadctl's supported range {requirement} "
            f"(the ZeRO-3 integration overrides internals of those versions): install a DeepSpeed "
            f"version in the supported range (pip install '{requirement}' --no-build-isolation)"
        )
    ds_name = getattr(ds_module, "__name__", "deepspeed")
    faults = [f for f in (_method_fault(m, ds_name) for m in METHODS) if f]
    faults += _name_faults(ds_name)
    faults += _attribute_faults(ds_name)
    faults += _mirrored_faults(ds_name)
    fault = _call_time_import_fault(ds_name)
    if fault:
        faults.append(fault)
    if faults:
        raise _fail(version, requirement, faults)


def check_optimizer_instance(opt) -> None:
    """Raise :class:`ConfigError` (one line) if the live ZeRO-3 optimizer, its parameter-offload
    helper or its first parameter lacks an attribute of :data:`ATTRIBUTES` marked ``live``.
    Call it once DeepSpeed's ``_setup_for_real_optimizer`` has run."""
    import deepspeed

    objects = {
        STAGE3: opt,
        PARAM_OFFLOAD: getattr(opt, "parameter_offload", None),
        PARTITION_PARAMETERS: next((p for g in getattr(opt, "fp16_groups", ()) for p in g), None),
    }
    what = {STAGE3: "the optimizer", PARAM_OFFLOAD: "its parameter_offload", PARTITION_PARAMETERS: "its ZeRO-3 parameters"}
    faults = []
    for a in ATTRIBUTES:
        obj = objects[a.owner]
        if a.live and obj is not None and not hasattr(obj, a.name):
            faults.append(f"{_short(a.owner)}.{a.name} expected, found no such attribute on {what[a.owner]}")
    if faults:
        raise _fail(str(deepspeed.__version__), supported_requirement(), faults)


@functools.lru_cache(maxsize=None)
def copied_source_matches(owner: str, name: str) -> bool:
    """Whether the installed DeepSpeed's ``owner.name`` is the body :data:`COPIED` records."""
    return _source_sha(owner, name) == COPIED[(owner, name)]


def integration_status() -> str:
    """``ok (DeepSpeed X)``, for ``offloadctl info``; raises what :func:`check_deepspeed` raises."""
    check_deepspeed()
    return f"ok (DeepSpeed {import_deepspeed().__version__})"
