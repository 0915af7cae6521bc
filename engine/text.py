"""User-supplied text on the way to a terminal: without the control characters (an escape
sequence in a profile's name, a path or an error's message) that a terminal would act on."""
from __future__ import annotations

import re

_CONTROL = re.compile(r"[\x00-\x08\x0b-\x1f\x7f-\x9f]")
"""C0 controls but tab and newline, DEL, and C1 controls (ESC and CSI among them)."""


def printable(text: str) -> str:
    """``text`` with its control characters (but tab and newline) removed."""
    return _CONTROL.sub("", text)
