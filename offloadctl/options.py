"""Options that several subcommands share: sizes, with the rule of :mod:`engine.units`, and the
deprecated spellings that took a bare number of GB.

A size option is parsed into a :class:`SizeText` (the spelling given and its text) and turned
into bytes by the command (:func:`size_bytes`), not by argparse: a bad size is then a one-line
:class:`engine.errors.ConfigError` naming the flag as typed, exit status 2, like every other
bad value, rather than argparse's usage block.
"""

from __future__ import annotations

import argparse
import re
from typing import NamedTuple

from engine.units import SIZE_HELP, parse_size

AUTO = "auto"


class SizeText(NamedTuple):
    flag: str
    """The spelling given, for errors."""
    text: str
    bare_unit: str | None
    """Unit of a bare number: None for the size flags (refused), "GB" for their deprecated ones."""


def _tagged(flag: str, bare_unit: str | None):
    def parse(text: str) -> SizeText:
        return SizeText(flag, text, bare_unit)

    parse.__name__ = flag  # argparse names the type in its own errors
    return parse


def add_size_option(group, flag: str, *, dest: str, help: str, deprecated: str | None = None, auto: bool = False) -> None:
    """``flag SIZE`` (``SIZE|auto`` with ``auto``) into ``dest``; ``deprecated``, for one release, the
    old spelling into the same ``dest`` with its old meaning: a bare number of GB (1e9 bytes). Of
    both, the last one given wins."""
    group.add_argument(flag, dest=dest, type=_tagged(flag, None), metavar="SIZE|auto" if auto else "SIZE", help=help)
    if deprecated:
        group.add_argument(
            deprecated,
            dest=dest,
            type=_tagged(deprecated, "GB"),
            default=argparse.SUPPRESS,
            metavar="GB|auto" if auto else "GB",
            help=argparse.SUPPRESS,
        )  # still taken, for one more release; not offered


def size_bytes(value: SizeText | None, *, auto: bool = False) -> int | None:
    """Bytes of a parsed size option; None when not given, or ``auto`` where ``auto`` is allowed."""
    if value is None or (auto and value.text.strip().lower() == AUTO):
        return None
    return parse_size(value.text, flag=value.flag, bare_unit=value.bare_unit)


def add_size_epilog(p: argparse.ArgumentParser) -> None:
    """The size rule under the option list of ``p``'s help."""
    # One paragraph: the help formatter fills it to the terminal.
    p.epilog = ((p.epilog + "\n\n") if p.epilog else "") + " ".join(SIZE_HELP.split())


def knob_words(message: str, spelled: dict[str, str] | None = None) -> str:
    """A knob error (from :class:`engine.config.Knobs`, which names its fields ``Knobs.name``) in
    the words the user typed: ``spelled[name]`` (an option such as ``--prefetch-depth``) where
    given, else the knob's own name (as ``offloadctl tune --pin`` takes it)."""
    return re.sub(r"Knobs\.([a-z_]+)", lambda m: (spelled or {}).get(m.group(1), m.group(1)), message)
