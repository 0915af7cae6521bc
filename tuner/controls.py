"""The user's controls of a run in the tuner daemon: pins, unpins and the freeze.

A pin is checked whole before anything keeps it: the knobs it makes must be ones every rank can
run (:meth:`engine.config.Knobs.check_for`) and ones the wire carries (``tuner.protocol.KNOBS``,
the schema each rank checks a push against). A pin past the wire's bounds that the daemon kept
would make every later push one the ranks throw away, for the rest of the run. The controls are
saved to the history and put back after a daemon restart, under the same checks.

:class:`UserControls` is a part of :class:`tuner.runs.Runs`, given what it uses: the runs, the
history, and the push of new knobs to a run's ranks.
"""

from __future__ import annotations

import logging
import time
from typing import Any, Callable, Sequence

from engine.config import KnobKey, Knobs
from engine.errors import ConfigError
from tuner.history import History
from tuner.knob_text import Pins
from tuner.protocol import KNOBS, ErrorCode, ProtocolError
from tuner.run_state import Run

log = logging.getLogger("offloadctl.tuner")


def check_knobs_for(knobs: Knobs, paths: Sequence[str], has_device: bool) -> None:
    """``Knobs.check_for`` and the wire's schema of knobs, as the protocol's BAD_VALUE: no rank
    refuses a change the daemon pushes."""
    try:
        knobs.check_for(paths, has_device)
    except ConfigError as e:
        raise ProtocolError(ErrorCode.BAD_VALUE, str(e)) from None
    try:
        KNOBS(knobs.to_dict(), "knobs")
    except ProtocolError as e:
        raise ProtocolError(ErrorCode.BAD_VALUE, f"{e.message}, the protocol's bound that every rank checks") from None


class UserControls:
    """The CLI's ``pin``, ``unpin`` and ``freeze`` messages for the runs of :class:`tuner.runs.Runs`:
    ``runs`` (run id -> run, the daemon's own dict), ``history`` (a ``tuner.history.History``, where
    the controls are saved, or None) and ``change(run, knobs, reason, source=)``, which pushes
    knobs to every rank of a run (``Runs._change``)."""

    def __init__(self, runs: dict[str, Run], history: History | None, change: Callable[..., None]) -> None:
        self.runs = runs
        self.history = history
        self._change = change

    def _run_for_cli(self, msg: dict[str, Any]) -> Run:
        run = self.runs.get(msg["run_id"])
        if run is None:
            raise ProtocolError(
                ErrorCode.UNKNOWN_RUN, f"no run {msg['run_id']!r}; runs: {', '.join(sorted(self.runs)) or 'none'}"
            )
        if run.status == "finished":
            raise ProtocolError(ErrorCode.UNKNOWN_RUN, f"run {run.run_id} has finished")
        return run

    def pin(self, msg: dict[str, Any]) -> dict[str, Any]:
        run = self._run_for_cli(msg)
        knob, value = msg["knob"], msg["value"]

        def wire(_: KnobKey, new: Knobs) -> None:  # checked before the policy (or the run) keeps it
            check_knobs_for(new, run.facts.paths, run.facts.has_device)

        try:
            if run.policy_ok():  # the policy owns the pins: it ends a trial of the knob, and never searches it
                run.policy.pin(knob, value, check=wire)
                knobs = run.policy.knobs
            else:
                _, _, knobs = run.own_pins.pin(knob, value, run.knobs, run.facts.paths, run.facts.has_device, check=wire)
        except (ConfigError, TypeError, ProtocolError) as e:
            raise ProtocolError(ErrorCode.BAD_VALUE, f"cannot pin {knob}={value!r}: {e}") from None
        check_knobs_for(knobs, run.facts.paths, run.facts.has_device)  # whatever the policy made of it
        return self._user_change(run, knobs, f"{knob} pinned to {value!r} by the user")

    def unpin(self, msg: dict[str, Any]) -> dict[str, Any]:
        run = self._run_for_cli(msg)
        knob = msg["knob"]
        try:
            if run.policy_ok():
                run.policy.unpin(knob)
            else:
                run.own_pins.unpin(knob, run.facts.paths)
        except ConfigError as e:
            raise ProtocolError(ErrorCode.BAD_VALUE, str(e)) from None
        return self._user_change(run, run.knobs, f"{knob} unpinned by the user")

    def freeze(self, msg: dict[str, Any]) -> dict[str, Any]:
        run = self._run_for_cli(msg)
        run.frozen = msg["frozen"]
        knobs = run.knobs
        if run.policy_ok():
            run.policy.freeze(run.frozen)  # freezing mid-trial goes back to the last good knobs
            knobs = run.policy.knobs
        return self._user_change(run, knobs, f"tuning {'frozen' if run.frozen else 'resumed'} by the user")

    def _user_change(self, run: Run, knobs: Knobs, reason: str) -> dict[str, Any]:
        """Push ``knobs`` now if they differ, log the request either way, and save the controls;
        the reply to the CLI."""
        if knobs != run.knobs:
            self._change(run, knobs, reason, source="user")
        else:
            log.info("run %s: %s", run.run_id, reason)
            run.decisions.append(
                {
                    "time": time.time(),
                    "iteration": run.max_iteration,
                    "seq": run.seq,
                    "apply_at": None,
                    "knobs": run.knobs_dict,
                    "source": "user",
                    "reason": reason,
                }
            )
        self._save(run)
        return {"type": "ok", "knobs": run.knobs_dict}

    # -- kept across a daemon restart --------------------------------------------------------

    def restore(self, run: Run, knobs: Knobs) -> None:
        """The user's pins and freeze of this run, saved before a daemon restart: put them back
        (all of them, or none: saved pins that no longer pass the checks are left out whole)."""
        saved = None
        if self.history is not None:
            try:
                saved = self.history.controls(run.run_id)
            except Exception as e:
                log.warning("run %s: saved pins not read: %s", run.run_id, e)
        if not saved:
            return
        pins, frozen = saved
        try:  # every pin checked whole before the policy (or the run) keeps any
            own, target = Pins(), knobs
            for knob, value in pins.items():
                _, _, target = own.pin(knob, value, target, run.facts.paths, run.facts.has_device)
            check_knobs_for(target, run.facts.paths, run.facts.has_device)
            if run.policy_ok():
                for knob, value in pins.items():
                    run.policy.pin(knob, value)
                if frozen:
                    run.policy.freeze(True)
                target = run.policy.knobs
                check_knobs_for(target, run.facts.paths, run.facts.has_device)
            else:
                run.own_pins = own
        except (ConfigError, ProtocolError, TypeError) as e:
            log.warning("run %s: saved pins %s not restored: %s", run.run_id, pins, e)
            return
        run.frozen = frozen
        log.info("run %s: restored the user's pins %s%s", run.run_id, pins, " and freeze" if frozen else "")
        if target != knobs:
            run.start_change = (target, "the user's pins, restored after a daemon restart", "user")

    def _save(self, run: Run) -> None:
        if self.history is not None:
            try:
                self.history.save_controls(run.run_id, run.pins(), run.frozen)
            except Exception as e:
                log.warning("run %s: pins not saved: %s", run.run_id, e)
