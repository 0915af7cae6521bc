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

import math
import re
from decimal import Decimal
from typing import Sequence

from engine.errors import ConfigError

UNITS = {
    "B": 1,
    "K": 10**3,
    "KB": 10**3,
    "M": 10**6,
    "MB": 10**6,
    "G": 10**9,
    "GB": 10**9,
    "T": 10**12,
    "TB": 10**12,
    "KIB": 2**10,
    "MIB": 2**20,
    "GIB": 2**30,
    "TIB": 2**40,
}

MAX_BYTES = 10**18
"""Larger is a typo (1 EB), and would overflow the int64 byte counts downstream."""

SIZE_HELP = (
    "SIZE is a number and a unit: K/M/G/T or KB/MB/GB/TB are powers of 1000, KiB/MiB/GiB/TiB powers "
    "of 1024, B bytes (case-insensitive), e.g. 512MB, 1.5TB, 60GiB; a bare number other than 0 is "
    "refused, so that 64 is never read as 64 bytes."
)
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
        raise ConfigError(
            f"{flag} {shown} is not a size: give {examples} (K/M/G/T: powers of 1000; KiB/MiB/GiB/TiB: powers of 1024)"
        )
    number = Decimal(m.group(1))  # exact: 0.3GB is 300000000 bytes, where float gives 299999999
    if number.adjusted() > 18:  # before any arithmetic: 1e999999999 would overflow Decimal's context
        raise ConfigError(f"{flag} {shown} is over {format_size(MAX_BYTES)}: give {examples}")
    if not unit:
        if bare_unit is not None:
            unit = bare_unit.upper()
        elif number != 0:
            raise ConfigError(
                f"{flag} {shown} has no unit: write {m.group(1)}GB or {m.group(1)}GiB ({m.group(1)}B if you mean bytes)"
            )
    value = number * UNITS.get(unit, 1)
    if value > MAX_BYTES:
        raise ConfigError(f"{flag} {shown} is over {format_size(MAX_BYTES)}: give {examples}")
    return int(value)


# -- printing: one notation everywhere -------------------------------------------------------
# Sizes, rates and counts take K/M/G/T prefixes, powers of 1000 (GB, TB, GB/s), to three
# significant digits and never in exponent notation; times are seconds (ms and µs below one
# second), with a thousands comma from 1,000 s. What a table shows is rounded; --json keeps
# the exact numbers.

_SI = (("E", 1e18), ("P", 1e15), ("T", 1e12), ("G", 1e9), ("M", 1e6), ("K", 1e3))


def _three(v: float) -> str:
    """``v`` (0 <= v < 1000 after scaling) to three significant digits, no exponent."""
    if v >= 100:
        return f"{v:.0f}"
    if v >= 10:
        return f"{v:.1f}".rstrip("0").rstrip(".")
    return f"{v:.2f}".rstrip("0").rstrip(".")


def _scaled(v: float, prefixes: Sequence[tuple[str, float]] = _SI) -> tuple[str, str]:
    """(digits, prefix) of ``v`` with the largest prefix that leaves it at least 1; a value that
    rounds up to 1000 takes the next prefix (999.7 GB is 1 TB, not 1000 GB)."""
    for prefix, scale in prefixes:
        if abs(v) >= scale * 0.9995:
            return _three(abs(v) / scale), prefix
    return _three(abs(v)), ""


def format_size(n: float | None, *, binary: bool = False) -> str:
    """Bytes: ``550 GB``, ``1.1 TB``, ``10.6 TB``, ``512 B``; ``binary``: ``60 GiB``; None: ``-``.
    The inverse of :func:`parse_size` up to rounding (without the space)."""
    if n is None or not math.isfinite(n):
        return "-"
    if binary:
        digits, prefix = _scaled(n, (("Ti", 2**40), ("Gi", 2**30), ("Mi", 2**20), ("Ki", 2**10)))
    else:
        digits, prefix = _scaled(n)
    if not prefix:
        digits = f"{abs(n):.0f}"
    return f"{'-' if n < 0 else ''}{digits} {prefix}B"


def size_at_least(n: float) -> str:
    """``n`` bytes as a size to type (``1.43GB``), rounded up at its third significant digit: the
    smallest such size that is not below ``n``, for a message that names the least setting that
    works (:func:`format_size` rounds to nearest, which can fall short)."""
    whole = max(1, math.ceil(n))
    drop = max(0, len(str(whole)) - 3)
    top = -(-whole // 10**drop) * 10**drop
    for prefix, scale in _SI:
        if top >= scale:
            return f"{top / scale:.2f}".rstrip("0").rstrip(".") + f"{prefix}B"
    return f"{top}B"


def format_rate(v: float | None, unit: str = "B/s") -> str:
    """A rate: ``13 GB/s``, ``850 MB/s``; with another ``unit``: ``1.07G params/s``."""
    if v is None or not math.isfinite(v):
        return "-"
    digits, prefix = _scaled(v)
    if unit.startswith("B"):
        return f"{digits} {prefix}{unit}"
    return f"{digits}{prefix} {unit}"


def format_count(n: float) -> str:
    """A parameter count as ``--params`` takes it: ``125M``, ``7B``, ``1.5T`` (B: billion)."""
    counts = (("T", 1e12), ("B", 1e9), ("M", 1e6), ("K", 1e3))
    digits, prefix = _scaled(n, counts)
    return f"{digits}{prefix}"


def format_seconds(s: float | None) -> str:
    """``1,093 s``, ``7.55 s``, ``7.29 ms``, ``130 µs``; None or infinite: ``-``."""
    if s is None or not math.isfinite(s):
        return "-"
    if s >= 999.5:
        return f"{s:,.0f} s"
    if s >= 0.9995 or s == 0:
        return f"{_three(s)} s"
    if s >= 0.0009995:
        return f"{_three(s * 1e3)} ms"
    if s >= 0.0000009995:
        return f"{_three(s * 1e6)} µs"
    return "<1 µs"


def format_int(n: int) -> str:
    """A whole number with thousands commas: ``11,058``."""
    return f"{n:,}"


_GB_TEXT = re.compile(r"(?<![\w.])(\d+(?:\.\d+)?(?:e[+-]?\d+)?) GB\b")
_LONG_INT = re.compile(r"(?<![\w.,/:#-])(\d{4,})(?![\w.,:/])")


def tidy_numbers(text: str) -> str:
    """A sentence of the performance model's with its numbers in this module's notation: a
    size in GB (``1.2e+04 GB``) as :func:`format_size` writes it (``12 TB``), a long whole
    number with thousands commas (``11058``: ``11,058``)."""
    text = _GB_TEXT.sub(lambda m: format_size(float(m.group(1)) * 1e9), text)
    return _LONG_INT.sub(lambda m: format_int(int(m.group(1))), text)
