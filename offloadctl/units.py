"""Numbers as the commands print them: one notation everywhere.

Sizes, rates and counts take K/M/G/T prefixes, powers of 1000 (GB, TB, GB/s), to three
significant digits and never in exponent notation; times are seconds (ms and µs below one
second), with a thousands comma from 1,000 s. What a table shows is rounded; ``--json`` keeps
the exact numbers.
"""
from __future__ import annotations

import math
import re

_SI = (("E", 1e18), ("P", 1e15), ("T", 1e12), ("G", 1e9), ("M", 1e6), ("K", 1e3))


def _three(v: float) -> str:
    """``v`` (0 <= v < 1000 after scaling) to three significant digits, no exponent."""
    if v >= 100:
        return f"{v:.0f}"
    if v >= 10:
        return f"{v:.1f}".rstrip("0").rstrip(".")
    return f"{v:.2f}".rstrip("0").rstrip(".")


def _scaled(v: float, prefixes=_SI) -> tuple[str, str]:
    """(digits, prefix) of ``v`` with the largest prefix that leaves it at least 1; a value that
    rounds up to 1000 takes the next prefix (999.7 GB is 1 TB, not 1000 GB)."""
    for prefix, scale in prefixes:
        if abs(v) >= scale * 0.9995:
            return _three(abs(v) / scale), prefix
    return _three(abs(v)), ""


def format_size(n: float | None) -> str:
    """Bytes: ``550 GB``, ``1.1 TB``, ``10.6 TB``, ``512 B``; None: ``-``."""
    if n is None or not math.isfinite(n):
        return "-"
    digits, prefix = _scaled(n)
    if not prefix:
        digits = f"{abs(n):.0f}"
    return f"{'-' if n < 0 else ''}{digits} {prefix}B"


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
