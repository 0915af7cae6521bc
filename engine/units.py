"""Sizes in bytes, as people write them on a command line, and back.

One rule for every size flag (``offloadctl train --host-cache``, ``plan --host-memory``, ...):

- a size is a number and a unit: ``512M``, ``512MB``, ``1.5GB``, ``1.5T``, ``4GiB``, ``4096B``;
- K, M, G, T and KB, MB, GB, TB are powers of 1000 (as disks and ``--host-cache-gb`` count);
  KiB, MiB, GiB, TiB are powers of 1024; B is bytes; case does not matter;
- a bare number is refused (except 0): ``--host-cache 64`` would otherwise be 64 bytes, which no
  one means. Deprecated flags that took a bare number of GB pass ``bare_unit="GB"``.

This module imports nothing of the engine's but its errors, so that every layer can use it.
"""
from __future__ import annotations

import re
from decimal import Decimal

from engine.errors import ConfigError

UNITS = {"B": 1, "K": 10**3, "KB": 10**3, "M": 10**6, "MB": 10**6, "G": 10**9, "GB": 10**9, "T": 10**12,
         "TB": 10**12, "KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "TIB": 2**40}

MAX_BYTES = 10**18
"""Larger is a typo (1 EB), and would overflow the int64 byte counts downstream."""

SIZE_HELP = ("SIZE is a number and a unit: K/M/G/T or KB/MB/GB/TB are powers of 1000, KiB/MiB/GiB/TiB powers "
             "of 1024, B bytes (case-insensitive), e.g. 512MB, 1.5TB, 60GiB; a bare number other than 0 is "
             "refused, so that 64 is never read as 64 bytes.")
"""The rule in one paragraph, for the epilog of every command with a size flag."""

_EXAMPLES = "e.g. 512MB, 64GB, 1.5TB or 60GiB"
_SIZE_RE = re.compile(r"([0-9]*\.?[0-9]+(?:e[+-]?[0-9]+)?)\s*([a-z]*)", re.IGNORECASE)


def parse_size(text: str, *, flag: str, bare_unit: str | None = None) -> int:
    """``text`` as a whole number of bytes (fractions of a byte are dropped).

    ``flag`` names the option in the error. ``bare_unit`` is the unit of a number given without
    one (deprecated flags: "GB"); None refuses a bare number other than 0. Raises a one-line
    :class:`ConfigError` for anything else: empty, negative, nan, inf, an unknown unit.
    """
    s = str(text).strip()
    shown = repr(s if len(s) <= 40 else s[:37] + "...")  # one readable line, whatever was pasted
    m = _SIZE_RE.fullmatch(s)
    if bare_unit:
        examples = f"a number of {'bytes' if bare_unit.upper() == 'B' else bare_unit}, e.g. 64 or 1.5"
    else:
        examples = f"a number and a unit, {_EXAMPLES}"
    if s.startswith("-") and _SIZE_RE.fullmatch(s[1:].strip()):
        raise ConfigError(f"{flag} {shown} is negative: give {examples}")
    unit = m.group(2).upper() if m else ""
    if not m or (unit and unit not in UNITS):
        raise ConfigError(f"{flag} {shown} is not a size: give {examples} "
                          f"(K/M/G/T: powers of 1000; KiB/MiB/GiB/TiB: powers of 1024)")
    number = Decimal(m.group(1))  # exact: 0.3GB is 300000000 bytes, where float gives 299999999
    if number.adjusted() > 18:  # before any arithmetic: 1e999999999 would overflow Decimal's context
        raise ConfigError(f"{flag} {shown} is over {format_size(MAX_BYTES)}: give {examples}")
    if not unit:
        if bare_unit is not None:
            unit = bare_unit.upper()
        elif number != 0:
            raise ConfigError(f"{flag} {shown} has no unit: write {m.group(1)}GB or {m.group(1)}GiB "
                              f"({m.group(1)}B if you mean bytes)")
    value = number * UNITS.get(unit, 1)
    if value > MAX_BYTES:
        raise ConfigError(f"{flag} {shown} is over {format_size(MAX_BYTES)}: give {examples}")
    return int(value)


def format_size(n: float, *, binary: bool = False) -> str:
    """``n`` bytes to three significant digits: ``64 GB``, ``1.5 TB``, ``512 B``; ``binary``:
    ``60 GiB``. The inverse of :func:`parse_size` up to rounding (without the space)."""
    steps = (("TiB", 2**40), ("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)) if binary else (
        ("EB", 10**18), ("TB", 10**12), ("GB", 10**9), ("MB", 10**6), ("KB", 10**3))
    for unit, scale in steps:
        if abs(n) >= scale:
            return f"{n / scale:.3g} {unit}"
    return f"{n:.3g} B" if isinstance(n, float) else f"{n} B"
