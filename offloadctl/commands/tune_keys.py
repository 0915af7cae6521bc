"""The live view's keyboard (``offloadctl tune`` on a terminal): the keys read one by one,
unechoed, and what each does to the run shown (pin, unpin, freeze, help, quit), with the legend
under the frame and the help in its place."""

from __future__ import annotations

import os
import re
import select
import sys
import termios
import time
from typing import TYPE_CHECKING, Any

from rich.text import Text

from engine.config import KnobKey, nearest_knob, typed_knob
from offloadctl.commands.tune_view import ENDED
from offloadctl.options import knob_words
from tuner.protocol import ProtocolError

if TYPE_CHECKING:
    from tuner.run_state import RunView

LEGEND = "q quit  p pin  u unpin  f {freeze}  ? help"
HELP = """keys of the live view
  q  leave the view; the run goes on
  p  pin a knob (the tuner never moves it): type KNOB=VALUE, Enter; Esc cancels
  u  unpin a knob (the tuner may move it again): type KNOB, Enter
  f  freeze tuning (the knobs stay as they are), or resume it
  ?  this help, or back to the run
slots (per path): the most reads and writes the engine keeps in
  flight there at once, its io_concurrency (the tuner may move it)

{knobs}
values are JSON: 4, 0.5, true, {{"/nvme": 8}}
the same from a shell: offloadctl tune --pin RUN:KNOB=VALUE, --unpin, --freeze"""


class Keys:
    """The live view's keyboard, where stdin is a terminal: no echo and no line buffering while
    the view runs (a key neither shows on the frame nor moves it), and on exit the terminal as
    it was, with the keys not yet read dropped (they never reach the shell's prompt). Ctrl-C
    still interrupts."""

    def __init__(self, stream=None) -> None:
        stream = stream if stream is not None else sys.stdin
        try:
            self.fd = stream.fileno() if stream.isatty() else None
        except (AttributeError, ValueError, OSError):
            self.fd = None
        self._saved: list[Any] | None = None  # the terminal's modes while the view has it

    @property
    def active(self) -> bool:
        return self._saved is not None

    def __enter__(self) -> "Keys":
        if self.fd is not None:
            try:
                self._saved = termios.tcgetattr(self.fd)
                mode = termios.tcgetattr(self.fd)
                mode[3] &= ~(termios.ECHO | termios.ICANON)  # lflags: keys one by one, not shown
                mode[6][termios.VMIN], mode[6][termios.VTIME] = 1, 0
                termios.tcsetattr(self.fd, termios.TCSANOW, mode)
            except termios.error:
                self._saved = None
        return self

    def __exit__(self, *exc) -> None:
        if self._saved is not None and self.fd is not None:  # saved: it has one
            try:
                termios.tcflush(self.fd, termios.TCIFLUSH)
                termios.tcsetattr(self.fd, termios.TCSADRAIN, self._saved)
            except termios.error:
                pass
            self._saved = None

    def read(self, timeout_s: float) -> str:
        """The keys typed within ``timeout_s`` (at once when some are waiting); '' if none."""
        if not self.active or self.fd is None:  # active: it has one
            time.sleep(max(0.0, timeout_s))
            return ""
        ready, _, _ = select.select([self.fd], [], [], max(0.0, timeout_s))
        if not ready:
            return ""
        return os.read(self.fd, 64).decode(errors="replace")


def view_error(kind: str, text: str, error: str, run_id: str) -> str:
    """A pin or unpin typed in the live view that was refused, in the view's own words: what was
    typed, the nearest knob where the name is mistyped, and the form the prompt takes (KNOB=VALUE
    or KNOB), not the command line's RUN:KNOB=VALUE."""
    form = "KNOB=VALUE, e.g. prefetch_depth=4" if kind == "pin" else "KNOB, e.g. prefetch_depth"
    shape = KnobKey.pattern() + (r"=.*" if kind == "pin" else "")
    if not re.fullmatch(shape, text, re.S):
        name = typed_knob(text)
        near = nearest_knob(name) if name else None
        said = f"no knob {name!r} (did you mean {near}?)" if near else f"not {form.split(',')[0]}"
        return f"{text}: {said}; type {form} (? lists the knobs)"
    return f"{text}: " + re.sub(rf"^--(?:un)?pin '{re.escape(run_id)}:[^']*': ", "", error)


class ViewControls:
    """What the keys do in the live view of one run: the prompt being typed, the last action's
    result, the help; :meth:`legend` is the line under the frame. What a typed pin or unpin
    sends (:meth:`_send`, read as the command line reads it) and the help's knobs
    (:meth:`help_text`) are the command's: ``offloadctl.commands.tune.Controls``."""

    def __init__(self, conn) -> None:
        self.conn = conn
        self.prompt: str | None = None  # 'pin' or 'unpin' while one is typed
        self.typed = ""
        self.message = ""
        self.help = False
        self.quit = False
        self.sent = False  # a request went to the daemon: the frame is redrawn from a new snapshot

    def keys(self, text: str, runs: list[RunView]) -> None:
        i = 0
        while i < len(text):
            ch = text[i]
            i += 1
            if ch == "\x1b":  # Esc, or the start of an arrow key's sequence: cancels a prompt, else nothing
                if text[i : i + 1] in ("[", "O"):
                    i += 2
                if self.prompt:
                    self.prompt, self.typed, self.message = None, "", "cancelled"
                continue
            if self.prompt is not None:
                if ch in "\r\n":
                    self._send(self.prompt, runs)
                elif ch in "\x7f\b":
                    self.typed = self.typed[:-1]
                elif ch.isprintable():
                    self.typed += ch
                continue
            if ch == "q":
                self.quit = True
                return
            if ch == "?":
                self.help = not self.help
            elif ch in "pu":
                if self._run(runs) is not None:
                    self.prompt, self.typed, self.message = {"p": "pin", "u": "unpin"}[ch], "", ""
            elif ch == "f":
                run = self._run(runs)
                if run is not None:
                    self._request(
                        f"{'unfrozen' if run['frozen'] else 'frozen'}: tuning "
                        f"{'resumed' if run['frozen'] else 'stopped, knobs held'}",
                        "freeze",
                        run_id=run["run_id"],
                        frozen=not run["frozen"],
                    )
            elif ch.isprintable() and ch != " ":
                self.message = f"no key {ch!r}: ? shows the keys"

    def _run(self, runs: list[RunView]) -> RunView | None:
        live = [r for r in runs if r["status"] not in ENDED]
        if len(live) == 1:
            return live[0]
        self.message = (
            "no running run here" if not live else f"{len(live)} runs: pin or freeze one from a view of it alone (tune --run RUN)"
        )
        return None

    def _request(self, done: str, kind: str, **fields) -> None:
        try:
            self.conn.request(kind, **fields)
            self.message, self.sent = done, True
        except ProtocolError as e:
            self.message = knob_words(str(e))

    def legend(self, runs: list[RunView]):
        if self.prompt is not None:
            what = "KNOB=VALUE" if self.prompt == "pin" else "KNOB"
            return (
                Text(f"{self.prompt} {what}: ")
                + Text(self.typed + "_", style="bold")
                + Text("  (Enter sends, Esc cancels)", style="dim")
            )
        frozen = any(r.get("frozen") for r in runs if r["status"] not in ENDED)
        text = Text(LEGEND.format(freeze="unfreeze" if frozen else "freeze"), style="dim")
        if self.message:
            text.append("  " + self.message, style="yellow")
        return text

    def _send(self, kind: str, runs: list[RunView]) -> None:
        """Send the pin or unpin typed (``kind``) to the one live run of ``runs``."""
        raise NotImplementedError
