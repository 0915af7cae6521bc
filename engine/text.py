"""User-supplied text on the way to a terminal: without the control characters (an escape
sequence in a profile's name, a path or an error's message) that a terminal would act on, and
without the bidirectional controls that make a terminal show text in another order than it is
(U+202E turns ``evil\u202etxt.py`` into what reads as ``evilyp.txt``)."""

from __future__ import annotations

import re
import sys
from typing import Any

_CONTROL = re.compile(r"[\x00-\x08\x0b-\x1f\x7f-\x9f\u061c\u200e\u200f\u202a-\u202e\u2066-\u2069]")
"""C0 controls but tab and newline, DEL, C1 controls (ESC and CSI among them), and Unicode's
bidirectional controls: the Arabic letter mark, LRM and RLM, the embeddings and overrides
(LRE, RLE, PDF, LRO, RLO) and the isolates (LRI, RLI, FSI, PDI)."""


def printable(text: str) -> str:
    """``text`` with its control characters (but tab and newline) and bidirectional controls removed."""
    return _CONTROL.sub("", text)


def printable_all(obj: Any) -> Any:
    """``obj`` (JSON's kinds: dicts, lists, strings, numbers) with every string in it, keys
    included, made :func:`printable`: what another program sent (a daemon's view of a run: its
    id, its paths, reasons), for display only."""
    if isinstance(obj, str):
        return printable(obj)
    if isinstance(obj, dict):
        return {printable_all(k): printable_all(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [printable_all(v) for v in obj]
    return obj


def say_line(text: str) -> None:
    """``text`` and its newline to stderr in one write. Ranks run unbuffered (``python -u``,
    as torchrun and DeepSpeed's launcher start them), where ``print`` writes the newline apart:
    another process's write (torchrun's traceback as it stops) can land between the two, and
    the launcher's filter then reads a line of each process's bytes."""
    sys.stderr.write(text + "\n")
    sys.stderr.flush()
