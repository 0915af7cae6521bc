"""The tuner's knob values, read and written in one place, and the pins made of them.

A knob is named by its :class:`engine.config.KnobKey` text (``prefetch_depth``, or
``io_concurrency[/nvme0]`` for one path). A value arrives as typed (JSON text, on/off) or
already decoded; :func:`read_value` reads it and :func:`with_value` applies it. Pins
(:class:`Pins`) are knob keys with their values, set only through :meth:`Pins.pin`. Every
knob and value shown to a user is written by :func:`value_text` and :func:`knobs_text`.

``offloadctl tune --pin``, the daemon's pin messages (:mod:`tuner.runs`) and the policy read
knob values here; :class:`engine.config.Knobs` only validates the values it is built from.
"""

from __future__ import annotations

import json
from typing import Any, Callable, Mapping, Sequence

from engine.config import KnobKey, Knobs, split_key
from engine.errors import ConfigError


def flat_knobs(knobs: Mapping[str, Any]) -> dict[str, Any]:
    """``Knobs.to_dict()`` with the per-path knobs spread out by :class:`KnobKey` spelling:
    ``{'prefetch_depth': 2, 'io_concurrency[/nvme0]': 8, 'stripe_weights[/nvme0]': 0.5, ...}``."""
    out: dict[str, Any] = {}
    for name, v in knobs.items():
        if isinstance(v, Mapping):
            out.update({str(KnobKey(name, p)): x for p, x in v.items()})
        else:
            out[name] = v
    return out


def changed_knobs(before: Mapping[str, Any], after: Mapping[str, Any]) -> dict[str, tuple[Any, Any]]:
    """``{key: (before, after)}`` of the :func:`flat_knobs` entries that differ (None: absent)."""
    a, b = flat_knobs(before), flat_knobs(after)
    return {k: (a.get(k), b.get(k)) for k in sorted(set(a) | set(b), key=lambda k: (split_key(k)[0], k)) if a.get(k) != b.get(k)}


def value_text(value: Any) -> str:
    """A knob's value as shown to a user: on/off, 0.5, 8, a per-path knob's ``/nvme0:8,/nvme1:4``;
    '-' for none."""
    if value is None:
        return "-"
    if isinstance(value, bool):
        return "on" if value else "off"
    if isinstance(value, float):
        return f"{value:g}"
    if isinstance(value, Mapping):
        return ",".join(f"{p}:{value_text(v)}" for p, v in value.items())
    return str(value)


def knobs_text(knobs: Knobs | Mapping[str, Any] | None, sep: str = " ") -> str:
    """``KNOB=VALUE`` of each knob in ``knobs`` (:class:`Knobs`, its ``to_dict()``, pins) with a
    value (a per-path knob with no path set is left out), joined by ``sep``; '-' for none."""
    values = knobs.to_dict() if isinstance(knobs, Knobs) else knobs or {}
    return sep.join(f"{k}={value_text(v)}" for k, v in values.items() if v not in ({}, None)) or "-"


def read_value(name: str, value: Any, paths: Sequence[str]) -> Any:
    """A user's value for knob ``name``: JSON text read, booleans spelled out, per-path dicts
    checked against the run's paths. The ranges are checked by constructing Knobs."""
    if isinstance(value, str):
        v = value.strip()
        if name == "node_lock":
            if v.lower() not in ("true", "false", "1", "0", "on", "off"):
                raise ConfigError(f"node_lock must be true or false, got {value!r}")
            return v.lower() in ("true", "1", "on")
        try:
            value = json.loads(v)
        except ValueError:
            raise ConfigError(f"{name}: cannot read {value!r} as a number or a JSON object") from None
    if name == "node_lock":
        if not isinstance(value, bool):
            raise ConfigError(f"node_lock must be true or false, got {value!r}")
    elif name == "stripe_weights":
        if not isinstance(value, dict) or set(value) != set(paths):
            raise ConfigError(f"stripe_weights must give a weight for each path {list(paths)}, got {value!r}")
    elif name == "io_concurrency" and isinstance(value, dict):
        unknown = set(value) - set(paths)
        if unknown:
            raise ConfigError(f"io_concurrency names paths this run does not use: {sorted(unknown)}")
    return value


def with_value(knobs: Knobs, key: KnobKey, value: Any, paths: Sequence[str], has_device: bool) -> Knobs:
    """``knobs`` with ``key`` set to ``value`` (as :func:`read_value` returns it), checked for
    the run (:meth:`Knobs.check_for`). ConfigError naming the knob on bad input."""
    if key.name == "io_concurrency":
        conc = dict(knobs.io_concurrency)
        if key.path is not None:
            conc[key.path] = value
        elif isinstance(value, dict):
            conc = dict(value)
        else:
            conc = {p: value for p in paths}
        out = knobs.replace(io_concurrency=conc)
    else:
        out = knobs.replace(**{key.name: value})
    out.check_for(paths, has_device)
    return out


def known_paths(k: Knobs, paths: Sequence[str], what: str) -> tuple[Knobs, str | None]:
    """``k`` less entries for paths this run does not have (the engine would refuse them), and
    the note that says what was dropped (None when nothing was)."""
    conc = {p: v for p, v in k.io_concurrency.items() if p in paths}
    weights = {p: v for p, v in k.stripe_weights.items() if p in paths}
    if len(weights) != len(paths):
        weights = {}  # partial weights would mix with the engine's measured bandwidths
    dropped = (set(k.io_concurrency) - set(conc)) | (set(k.stripe_weights) - set(weights))
    note = f"{what} name paths this run does not use, or not all of them: dropped {sorted(dropped)}" if dropped else None
    return k.replace(io_concurrency=conc, stripe_weights=weights), note


class Pins:
    """The user's pins: knobs with their values, never searched, never moved.

    Keyed by :class:`KnobKey`: a whole knob, or one path's concurrency. :meth:`pin` is the one
    place a pin is set; :meth:`as_dict` is the wire's and the view's spelling."""

    def __init__(self) -> None:
        self._values: dict[KnobKey, Any] = {}

    def pin(
        self,
        text: str,
        value: Any,
        knobs: Knobs,
        paths: Sequence[str],
        has_device: bool,
        check: Callable[[KnobKey, Knobs], None] | None = None,
    ) -> tuple[KnobKey, Any, Knobs]:
        """Pin knob ``text`` at ``value`` (as a user gives it). Returns the key, the value read
        and ``knobs`` with it set; ``check(key, new_knobs)`` may refuse (ConfigError) before
        anything is recorded."""
        key = KnobKey.parse(text, paths)
        value = read_value(key.name, value, paths)
        new = with_value(knobs, key, value, paths, has_device)
        if check is not None:
            check(key, new)
        self._values[key] = value
        return key, value, new

    def unpin(self, text: str, paths: Sequence[str] | None) -> KnobKey:
        """Remove the pin ``text`` names; ConfigError when it names no pin."""
        key = KnobKey.parse(text, paths)
        if self._values.pop(key, None) is None:
            raise ConfigError(f"knob {text!r} is not pinned (pinned: {sorted(map(str, self._values)) or 'none'})")
        return key

    def apply(self, knobs: Knobs, paths: Sequence[str], has_device: bool) -> Knobs:
        """``knobs`` with every pinned value in force (a plan made without regard to the pins)."""
        for key, value in self._values.items():
            knobs = with_value(knobs, key, value, paths, has_device)
        return knobs

    def covers(self, name: str, path: str | None = None) -> bool:
        """Whether the search must leave knob ``name`` (or its entry for ``path``) alone."""
        return KnobKey(name) in self._values or (path is not None and KnobKey(name, path) in self._values)

    def as_dict(self) -> dict[str, Any]:
        return {str(k): v for k, v in self._values.items()}

    @classmethod
    def of(cls, pins: Mapping[str, Any]) -> "Pins":
        """Pins as :meth:`as_dict` spelled them (a policy's, or saved ones), taken as they are."""
        out = cls()
        out._values = {KnobKey.parse(k): v for k, v in pins.items()}
        return out


def adaptation_text(a: Mapping[str, Any]) -> str:
    """One change of conditions and what the tuner did (an entry of :attr:`tuner.guards.Adaptation.log`,
    ``Policy.state()["adaptations"]``), in plain words:
    'at iteration 42, path /ssd1 slowed: reads 300 -> 62 MB/s, writes 290 -> 60 MB/s: stripe weight /ssd1 0.5 -> 0.17
    (iteration 10.5 -> 3.9 s, -63%)'."""
    move = a.get("move")
    done = move if move else (a.get("effect") or "no move")
    effect = a.get("effect") if move else None
    return f"at iteration {a.get('iteration')}, {a.get('cause')}: {done}" + (
        f" ({effect})" if effect else " (being measured)" if move else ""
    )
