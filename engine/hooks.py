"""How a tuner, or anything else, plugs into the engine's step without the engine knowing it.

A step hook is any object with these three methods (all optional to act on; ``StepHook`` is the
base to inherit from). :class:`engine.core.SubgroupEngine` calls them in order of registration:

- ``before_step(engine)``: at the start of ``step()``, before the knobs pending in the engine
  are applied, so a hook may call ``engine.set_knobs`` and have it in force for this step;
- ``after_step(engine, record)``: once the step finished, with its :class:`StepRecord`;
- ``on_error(engine, error)``: when the step raised (the error is raised again afterwards).

The engine closes its hooks in ``close()`` (``close()`` on a hook is optional). The tuner's
client (``tuner.client.TunerClient``) is one; ``OffloadAdamW`` and the DeepSpeed integration
register it the same way. A hook that raises in ``before_step``/``after_step`` fails the step:
hooks are part of training, not observers of it; one that must never fail training catches its
own errors (the tuner client does).
"""

from __future__ import annotations

import contextlib
from typing import TYPE_CHECKING, Iterable, Protocol

if TYPE_CHECKING:
    from engine.core import SubgroupEngine
    from engine.telemetry import StepRecord


class StepHook(Protocol):
    """A hook that does nothing; subclass and override what you need (any object with these
    methods is one: a protocol)."""

    def before_step(self, engine: SubgroupEngine) -> None:
        return None  # a protocol's method with a body: not abstract

    def after_step(self, engine: SubgroupEngine, record: StepRecord) -> None:
        return None

    def on_error(self, engine: SubgroupEngine, error: BaseException) -> None:
        return None

    def close(self) -> None:
        return None


def close_hooks(hooks: Iterable[StepHook]) -> None:
    """Close each hook that has ``close()``; a failure in one is ignored (the engine closes its
    hooks on its way out, and must still remove its swap files)."""
    for hook in hooks:
        close = getattr(hook, "close", None)
        if close is not None:
            with contextlib.suppress(Exception):
                close()
