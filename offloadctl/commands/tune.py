"""Watch the tuner's runs live, or print a snapshot; pin knobs or freeze tuning.

    offloadctl tune                # live view (Ctrl-C leaves; the run goes on)
    offloadctl tune --run-dir DIR  # the run writing to DIR
    offloadctl tune --once --json  # {"runs": [{"run_id", "iteration", ...}]}
    offloadctl tune --pin RUN:prefetch_depth=4   # VALUE is JSON: 4, {"/a": 8}
    offloadctl tune --unpin RUN:prefetch_depth --freeze RUN --unfreeze RUN

Which daemon: --socket PATH; else the run in --run-dir DIR; else the system
daemon when it serves a run; else this user's live runs (`offloadctl train`
starts a private daemon in RUN_DIR/tuner/): one is shown, several are listed
for you to pick one with --run-dir. Pins and freezes are sent first; then the
view (or, with only those, a line per action).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import re
import sys
import textwrap
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING

from rich.console import Console, Group
from rich.live import Live
from rich.text import Text

from engine.config import KnobKey, Knobs, nearest_knob, split_key, typed_knob
from engine.errors import ConfigError
from engine.text import printable, printable_all
from integrations.run_dir import in_use
from offloadctl.commands.tune_keys import HELP, Keys, ViewControls, view_error
from offloadctl.commands.tune_view import ENDED, at_iteration, final_line, fitted_panels, run_panel, runs_table
from offloadctl.options import knob_words
from tuner import service
from tuner.knob_text import knobs_text
from tuner.protocol import Connection, ErrorCode, ProtocolError

if TYPE_CHECKING:
    from tuner.run_state import RunView

DISCONNECTED_GRACE_S = 3.0
"""How long a run's ranks must stay away before the live view calls it interrupted."""


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--socket", metavar="PATH", help="the daemon's socket (default: found, see above)")
    p.add_argument("--run-dir", metavar="DIR", help="the run whose run directory is DIR")
    p.add_argument("--once", action="store_true", help="print one snapshot and exit")
    p.add_argument("--json", action="store_true", help="with --once: print JSON")
    p.add_argument("--live", action="store_true", help="live view (the default without --once)")
    p.add_argument("--run", metavar="RUN", help="only the run with this id")
    p.add_argument("--interval", type=float, default=1.0, metavar="S", help="live refresh period (default 1 s)")
    p.add_argument("--pin", action="append", default=[], metavar="RUN:KNOB=VALUE", help="hold a knob at a value")
    p.add_argument("--unpin", action="append", default=[], metavar="RUN:KNOB", help="let the tuner move a knob again")
    p.add_argument("--freeze", action="append", default=[], metavar="RUN", help="stop tuning a run (knobs stay)")
    p.add_argument("--unfreeze", action="append", default=[], metavar="RUN", help="resume tuning a run")


def parse_pin(spec: str) -> tuple[str, str, object]:
    """``RUN:KNOB=VALUE`` -> (run, knob, value); VALUE is JSON, else taken as a string. The
    knob names anchor the split, so run ids and paths may hold ':' and '='. A value out of
    range is refused here, naming what was typed."""
    m = re.fullmatch(rf"(?P<run>.+?):(?P<knob>{KnobKey.pattern()})=(?P<value>.*)", spec, re.S)
    if not m:
        near = nearest_knob(typed_knob(spec)) if "=" in spec else None
        raise ConfigError(
            f"--pin {spec!r}: "
            + (f"no knob {typed_knob(spec)!r} (did you mean {near}?); " if near else "")
            + f"write RUN:KNOB=VALUE, e.g. myrun:prefetch_depth=4 (knobs: "
            f"{', '.join(Knobs.names())}; {KnobKey.PATH_FORM} for one path)"
        )
    try:
        value = json.loads(m["value"])
    except ValueError:
        value = m["value"]
    name, path = split_key(m["knob"])
    if path is None and name not in Knobs.PER_PATH:  # per-path values: the daemon knows the paths
        try:
            Knobs().replace(**{name: value})
        except (ConfigError, TypeError) as e:
            raise ConfigError(f"--pin {spec!r}: {knob_words(str(e))}") from None
    return m["run"], m["knob"], value


def parse_unpin(spec: str) -> tuple[str, str]:
    """``RUN:KNOB`` -> (run, knob)."""
    m = re.fullmatch(rf"(?P<run>.+?):(?P<knob>{KnobKey.pattern()})", spec, re.S)
    if not m:
        near = nearest_knob(typed_knob(spec))
        raise ConfigError(
            f"--unpin {spec!r}: "
            + (f"no knob {typed_knob(spec)!r} (did you mean {near}?); " if near else "")
            + "write RUN:KNOB, e.g. myrun:prefetch_depth"
        )
    return m["run"], m["knob"]


def _actions(args: argparse.Namespace) -> list[tuple[str, str, dict]]:
    """(flag as typed, message type, fields) for each pin, unpin, freeze and unfreeze."""
    out = []
    for spec in args.pin:
        run_id, knob, value = parse_pin(spec)
        out.append((f"--pin {spec}", "pin", {"run_id": run_id, "knob": knob, "value": value}))
    for spec in args.unpin:
        run_id, knob = parse_unpin(spec)
        out.append((f"--unpin {spec}", "unpin", {"run_id": run_id, "knob": knob}))
    out += [(f"--freeze {r}", "freeze", {"run_id": r, "frozen": True}) for r in args.freeze]
    out += [(f"--unfreeze {r}", "freeze", {"run_id": r, "frozen": False}) for r in args.unfreeze]
    return out


# -- which daemon ---------------------------------------------------------------------------------


@dataclass
class Target:
    socket: str
    private: bool
    """A run's own daemon: it stops when the run ends, and so does the view."""
    run_dir: str | None = None
    """The run's directory, when known (a private daemon's run): its record gives the final
    line the same median as the run's summary."""


def find_target(args: argparse.Namespace, run_ids: set[str]) -> Target:
    """The daemon to talk to: ``--socket``; the run in ``--run-dir``; the system daemon when it
    serves a run; else the one live private run of this user (of ``run_ids`` when given: a run
    whose ranks are still starting counts by the id its daemon was started for). Several runs
    are listed for the user to pick one rather than guessed at, and so are the live ones when
    ``run_ids`` names none of them: a pin sent to a guessed run would change the wrong training."""
    if args.socket:
        return Target(args.socket, private=False)
    if args.run_dir:
        return _target_in(os.path.abspath(args.run_dir))
    system = service.default_socket_path()
    system_runs = _runs_at(system)
    if system_runs is not None and any(r["status"] == "running" and (not run_ids or r["run_id"] in run_ids) for r in system_runs):
        return Target(system, private=False)
    live = [(entry, runs) for entry in service.live_runs() if (runs := _runs_at(entry["socket"])) is not None]
    found = [
        (entry, runs)
        for entry, runs in live
        if not run_ids or entry.get("run_id") in run_ids or any(r["run_id"] in run_ids for r in runs)
    ]
    if len(found) == 1:
        return Target(found[0][0]["socket"], private=True, run_dir=found[0][0].get("run_dir"))
    if found:
        print(printable(live_runs_table(found)))
        raise ConfigError(f"{len(found)} live runs: pick one with --run-dir DIR")
    if run_ids and (live or system_runs):
        theirs = [({"run_dir": f"(daemon {system})", "started_at": None}, system_runs)] if system_runs else []
        print(printable(live_runs_table(live + theirs)))
        raise ConfigError(
            f"no live run {', '.join(sorted(run_ids))}: the live runs are above; give one of their ids "
            f"(RUN in RUN:KNOB=VALUE), or --run-dir DIR"
        )
    if system_runs is not None:
        return Target(system, private=False)
    which = f" {', '.join(sorted(run_ids))}" if run_ids else ""
    raise ConfigError(
        f"no live run{which} (no tuner daemon at {system}, no training run of yours): "
        "start one with `offloadctl train`, or give --run-dir DIR or --socket PATH"
    )


def _target_in(run_dir: str, wait_s: float = 30.0) -> Target:
    """The daemon of the run in ``run_dir``; while that run is starting (its run dir taken, its
    daemon not up yet), waited for up to ``wait_s``; a daemon that was up and is gone, at once."""
    own = os.path.join(run_dir, "tuner", "tuner.sock")
    if not os.path.isdir(run_dir):
        what = "is not a directory" if os.path.lexists(run_dir) else "does not exist"
        raise ConfigError(
            f"--run-dir {run_dir} {what}: give the run dir an `offloadctl train` start line "
            "names, or leave --run-dir out to list the live runs"
        )
    deadline = time.monotonic() + wait_s
    while True:
        if service.probe(own) is not None:
            return Target(own, private=True, run_dir=run_dir)
        for entry in service.live_runs():  # a run dir too long for a socket path has its socket elsewhere
            if entry["run_dir"] == run_dir:
                return Target(entry["socket"], private=True, run_dir=run_dir)
        if not in_use(run_dir):
            raise ConfigError(
                f"--run-dir {run_dir}: no live run there (its tuner stops when the run ends); "
                "`offloadctl tune` without --run-dir lists the live ones"
            )
        if service.daemon_stopped(own) or time.monotonic() > deadline:  # stopped: no use waiting
            raise ConfigError(
                f"--run-dir {run_dir}: the run there goes on, but its tuner daemon ({own}) does not "
                f"answer: it stopped, and the run keeps the knobs it has (the daemon's log: "
                f"{service.logfile_for(own)})"
            )
        time.sleep(0.2)


def _runs_at(socket_path: str) -> list[RunView] | None:
    """The runs a daemon serves, or None when nothing answers there."""
    try:
        with Connection(socket_path, timeout_s=2.0) as c:
            return c.request("snapshot", history=0)["runs"]
    except (OSError, ProtocolError, ValueError):
        return None


def live_runs_table(found: list[tuple[dict, list[RunView]]]) -> str:
    """The live runs, one line each: run dir, run id, iteration, start time."""
    rows = [("RUN DIR", "RUN", "ITERATION", "STARTED")]
    for entry, runs in found:
        shown = [(r["run_id"], str(at_iteration(r)) if r["iteration"] >= 0 else "-", r.get("started_at")) for r in runs]
        for run_id, at, t in shown or [((entry.get("run_id") or "") + " (starting)", "-", None)]:
            t = t or entry.get("started_at")
            started = time.strftime("%H:%M:%S", time.localtime(t)) if t else "-"
            rows.append((entry["run_dir"], run_id.strip(), at, started))
    widths = [max(len(row[i]) for row in rows) for i in range(4)]
    return "\n".join("  ".join(c.ljust(w) for c, w in zip(row, widths)).rstrip() for row in rows)


# -- the command ----------------------------------------------------------------------------------


def run(args: argparse.Namespace) -> int:
    actions = _actions(args)
    run_ids = {fields["run_id"] for _, _, fields in actions} | ({args.run} if args.run else set())
    try:
        target = find_target(args, run_ids)
    except ConfigError:
        if args.json and args.once and not actions:
            print(json.dumps({"runs": []}))  # no run to show is an answer, not an error
            return 0
        raise
    try:
        conn = Connection(target.socket, timeout_s=5.0)
    except OSError as e:
        raise ConfigError(
            f"no tuner daemon answers at {target.socket} ({e.strerror or e}): start one with "
            "`offloadctl tuner start`, or give --run-dir DIR or --socket PATH"
        ) from None
    with conn:
        for flag, kind, fields in actions:
            reply = _send(conn, flag, kind, fields)
            if not (args.once or args.json or args.live):
                what = {
                    "pin": f"pinned {fields.get('knob')}={fields.get('value')!r}",
                    "unpin": f"unpinned {fields.get('knob')}",
                    "freeze": "frozen" if fields.get("frozen") else "unfrozen",
                }[kind]
                say(printable(f"{fields['run_id']}: {what}; knobs now {knobs_text(reply.get('knobs') or {})}"))
        if actions and not (args.once or args.json or args.live):
            return 0
        if args.once or args.json:
            snap = conn.request("snapshot", run_id=args.run, history=60)
            if args.json:
                print(json.dumps({"runs": snap["runs"], "daemon": snap["daemon"]}, indent=2))
            elif not snap["runs"] and target.private:  # its daemon is up, its ranks are not yet
                where = f" in {args.run_dir}" if args.run_dir else ""
                say(
                    f"the run{where} is starting: its ranks are loading and have reported no iteration yet; run "
                    f"this again in a few seconds, or watch it with `offloadctl tune"
                    f"{' --run-dir ' + args.run_dir if args.run_dir else ''}` (it waits for them)"
                )
            else:
                console = Console()
                console.print(runs_table(printable_all(snap["runs"]), width=console.width))
            return 0
        return live(conn, args, target)


WIDTH = 80


def say(text: str) -> None:
    """Print ``text`` wrapped at :data:`WIDTH` columns, its later lines indented, words whole
    (a path or a knob list is never cut)."""
    print("\n".join(textwrap.wrap(text, WIDTH, subsequent_indent="  ", break_long_words=False, break_on_hyphens=False)) or text)


STARTING_WAIT_S = 600.0
"""How long a pin waits for a run whose ranks are still starting (imports, DeepSpeed's set-up)."""


def _send(conn, flag: str, kind: str, fields: dict) -> dict:
    """Send one pin, unpin or freeze; a run the daemon does not know yet, but was started for
    (its ranks are loading), is waited for, with one line saying so."""
    deadline, said = time.monotonic() + STARTING_WAIT_S, False
    while True:
        try:
            return conn.request(kind, **fields)
        except ProtocolError as e:
            if (
                e.code == ErrorCode.UNKNOWN_RUN
                and "has finished" not in str(e)
                and time.monotonic() < deadline
                and not _known(conn, fields["run_id"])
                and _starting(conn, fields["run_id"])
            ):
                if not said:
                    print(
                        f"offloadctl: waiting for run {fields['run_id']} to start (its ranks are loading)...",
                        file=sys.stderr,
                        flush=True,
                    )
                    said = True
                time.sleep(0.5)
                continue
            raise ConfigError(f"{flag}: {knob_words(str(e))}") from None


def _known(conn, run_id: str) -> bool:
    return any(r["run_id"] == run_id for r in conn.request("snapshot", history=0)["runs"])


def _starting(conn, run_id: str) -> bool:
    """Whether the daemon behind ``conn`` is a private one started for ``run_id``."""
    pid = conn.welcome.get("pid") if getattr(conn, "welcome", None) else None
    return any(e.get("run_id") == run_id and (pid is None or e.get("pid") == pid) for e in service.live_runs())


class Controls(ViewControls):
    """The live view's keys (:class:`~offloadctl.commands.tune_keys.ViewControls`) with this
    command's reading of a typed pin or unpin, and its knobs in the help."""

    def _send(self, kind: str, runs: list[RunView]) -> None:
        text = self.typed.strip()
        self.prompt, self.typed = None, ""
        run = self._run(runs)
        if run is None or not text:
            return
        try:
            if kind == "pin":
                _, knob, value = parse_pin(f"{run['run_id']}:{text}")
                self._request(f"pinned {knob}={json.dumps(value)}", "pin", run_id=run["run_id"], knob=knob, value=value)
            else:
                _, knob = parse_unpin(f"{run['run_id']}:{text}")
                self._request(f"unpinned {knob}: the tuner may move it", "unpin", run_id=run["run_id"], knob=knob)
        except ConfigError as e:
            self.message = view_error(kind, text, str(e), run["run_id"])

    def help_text(self) -> Text:
        """What ? shows in place of the frame: the keys, and the knobs a pin takes."""

        knobs = textwrap.fill(f"knobs: {', '.join(Knobs.names())}; {KnobKey.PATH_FORM} for one path", 78, subsequent_indent="  ")
        return Text(HELP.format(knobs=knobs))


def live(conn, args: argparse.Namespace, target: Target, console=None, keys: Keys | None = None) -> int:
    """Redraw the view every ``--interval`` until q or Ctrl-C, or until the runs end (a private
    daemon's run, or runs seen running here): then print their final frame and figures. On a
    terminal, keys pin, unpin and freeze the run shown (:class:`Controls`), with a legend line."""
    console = console or Console()
    last: list[RunView] = []
    seen_running = False
    ended_since: float | None = None
    final: list[RunView] | None = None
    controls = Controls(conn)
    with keys or Keys() as keyboard, Live(console=console, auto_refresh=False, transient=True) as view:
        with contextlib.suppress(KeyboardInterrupt):
            while not controls.quit:
                try:
                    runs = conn.request("snapshot", run_id=args.run, history=60)["runs"]
                except (OSError, ProtocolError, ValueError):
                    final = ended_runs(last, target.socket)  # the daemon went away
                    break
                seen_running = seen_running or any(r["status"] == "running" for r in runs)
                last = runs or last
                over = bool(runs) and all(r["status"] in ENDED for r in runs) and (target.private or seen_running)
                ended_since = (ended_since or time.monotonic()) if over else None
                # Ranks that vanished may be back within seconds (a dropped connection): wait
                # that long before calling their run interrupted; a finished run ends the view now.
                if ended_since is not None and (  # not None: over
                    all(r["status"] == "finished" for r in runs) or time.monotonic() - ended_since >= DISCONNECTED_GRACE_S
                ):
                    final = runs
                    break
                deadline = time.monotonic() + args.interval
                while True:  # redrawn at once after each key, so what is typed shows as it is typed
                    extra = [controls.legend(runs)] if keyboard.active else []
                    room = console.size.height - 1 - sum(len(console.render_lines(x, console.options, pad=False)) for x in extra)
                    if controls.help:  # the keys in place of the frame, until ? again
                        body = [controls.help_text()]
                    else:
                        body = (
                            fitted_panels(printable_all(runs), console, height=room)
                            if runs
                            else [Text(_waiting(target, keyboard))]
                        )
                    view.update(Group(*body, *extra), refresh=True)
                    typed = keyboard.read(deadline - time.monotonic())
                    if not typed:
                        break
                    controls.keys(typed, runs)
                    if controls.quit or controls.sent or time.monotonic() >= deadline:
                        controls.sent = False
                        break
    if final is None:  # q or Ctrl-C: the last frame stays on screen, whole
        for p in fitted_panels(printable_all(last), console, height=None) if last else []:
            console.print(p)
        console.print("left the live view; the run goes on")
        return 0
    final = printable_all(final)  # shown only: the run ids the daemon knows are the raw ones
    for r in final:
        console.print(run_panel(r, width=console.width))
    for r in final:
        console.print(final_line(r, target.run_dir), markup=False, highlight=False)  # paths, reasons: [brackets]
    if not final:
        console.print("the tuner daemon stopped before any run reported")
    return 0


def _waiting(target: Target, keys: Keys | None = None) -> str:
    leave = "q or Ctrl-C" if keys is not None and keys.active else "Ctrl-C"
    return (
        f"waiting for the run's ranks to connect ({leave} to leave)"
        if target.private
        else f"no runs yet at {target.socket} ({leave} to leave)"
    )


def ended_runs(last: list[RunView], socket_path: str) -> list[RunView]:
    """The runs of the last snapshot as they ended once their daemon is gone: as the daemon
    recorded their end (``tuner.service.read_ended``: the run may have ended between two
    snapshots), else interrupted."""
    ended: dict[str, RunView] = service.read_ended(socket_path)
    out: list[RunView] = []
    for r in last:
        if r["status"] not in ENDED:
            r = ended.get(r["run_id"]) or {**r, "status": "disconnected", "outcome": "interrupted"}
        out.append(r)
    return out
