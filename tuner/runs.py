"""The tuner daemon's runs: their state, their ranks, and what the policy is told and decides.

:class:`Runs` owns every run the daemon knows: registering ranks, aggregating each iteration's
per-rank telemetry into a :class:`tuner.observation.Observation` (the slowest rank's times, the sum
of the ranks' bandwidths) once every rank reported it, asking the run's policy, and pushing a
change to every rank with ``apply_at``, an iteration far enough ahead that all ranks have the
message before they reach it, so every rank switches at the same iteration. The history
database (best earlier knobs, summaries) and the end of a run are here too; the user's pins and
freeze are its :attr:`Runs.controls` (:mod:`tuner.controls`). One run's state, policy or client
failing never touches another run.

No sockets: a rank's connection is an opaque *peer* (any hashable object; its ``pid``
attribute, if it has one, is named in logs). Messages for peers are queued in an outbox that
the caller (:class:`tuner.server.TunerServer`) takes with :meth:`Runs.take_outbox` and sends,
so this module can be driven and checked without a daemon.
"""

from __future__ import annotations

import json
import logging
import math
import statistics
import time
from collections import deque
from typing import TYPE_CHECKING, Any, Callable, Literal

from engine.config import Knobs, split_key
from engine.errors import ConfigError
from engine.telemetry import StepRecord
from tuner.controls import UserControls, check_knobs_for
from tuner.daemon_config import ServerConfig
from tuner.history import History
from tuner.knob_text import Pins, changed_knobs
from tuner.observation import Decision, Observation
from tuner.protocol import API_VERSION, ErrorCode, ProtocolError, knobs_from_dict
from tuner.run_state import Rank, Run, RunFacts, RunView, encodable_view

if TYPE_CHECKING:  # imported when first used: a daemon given its own factories never loads them
    from tuner.policy import Policy
    from tuner.sensors import Sensors

log = logging.getLogger("offloadctl.tuner")
PolicyFactory = Callable[[Knobs, RunFacts], Any]  # a run's policy (Run.policy: duck-typed)
SensorsFactory = Callable[[list[str]], Any]  # a run's sensors, from its paths
Handler = Callable[[Any, dict[str, Any]], dict[str, Any] | None]  # handler(peer, msg) -> the reply's body, or None


def _default_policy_factory(start: Knobs, facts: RunFacts) -> Policy:
    from tuner.policy import Policy

    return Policy(start, facts)


def _default_sensors_factory(paths: list[str]) -> Sensors:
    from tuner.sensors import Sensors

    return Sensors(paths)


class Runs:
    """Every run of one daemon, driven by the messages of its ranks and of the CLI.

    ``policy_factory(start_knobs, facts)`` makes one run's policy from its :class:`tuner.run_state.RunFacts`
    (default ``tuner.policy.Policy``); ``sensors_factory(paths)`` its sensors (default
    ``tuner.sensors.Sensors``; False: none); ``history`` is a ``tuner.history.History`` or None.

    The message methods take the sender (a peer) and the validated message, return the reply's
    body (or None) and raise ``ProtocolError`` for the sender; pushes to other peers wait in the outbox."""

    def __init__(
        self,
        config: ServerConfig,
        *,
        policy_factory: PolicyFactory | None = None,
        sensors_factory: SensorsFactory | Literal[False] | None = None,
        history: History | None = None,
        on_end: Callable[[Run], None] | None = None,
    ) -> None:
        self.config = config
        self.on_end = on_end
        """Called with each run that ends (every rank said bye), after its history is written."""
        self.policy_factory = policy_factory or _default_policy_factory
        self.sensors_factory = _default_sensors_factory if sensors_factory is None else sensors_factory
        self.history = history
        self.runs: dict[str, Run] = {}
        self._peer_ranks: dict[Any, set[tuple[str, int]]] = {}  # peer -> (run_id, rank) registered on it
        self._outbox: list[tuple[Any, dict[str, Any]]] = []
        self.controls = UserControls(self.runs, history, self._change)
        """The CLI's pin, unpin and freeze."""

    # -- for the transport -------------------------------------------------------------------

    def handlers(self) -> dict[str, Handler]:
        """The message types this object answers, as ``handler(peer, msg)``."""
        return {
            "register": self.register,
            "telemetry": self.telemetry,
            "event": self.event,
            "applied": self.applied,
            "bye": self.bye,
            "pin": lambda peer, msg: self.controls.pin(msg),
            "unpin": lambda peer, msg: self.controls.unpin(msg),
            "freeze": lambda peer, msg: self.controls.freeze(msg),
        }

    def take_outbox(self) -> list[tuple[Any, dict[str, Any]]]:
        """The (peer, message) pairs queued since the last call, in order: the caller sends them."""
        out, self._outbox = self._outbox, []
        return out

    def any_running(self) -> bool:
        return any(r.status == "running" for r in self.runs.values())

    def forget_ended(self, now: float) -> None:
        """Forget finished runs after ``finished_keep_s``, and runs whose ranks never came back."""
        for run in list(self.runs.values()):
            # A run that never reported an iteration has nothing to show or to resume: it
            # goes after a minute (clients that only register must not pile up).
            keep = self.config.finished_keep_s if run.max_iteration >= 0 else min(60.0, self.config.finished_keep_s)
            if run.status != "running" and (idle := now - (run.ended_at or now)) > keep:
                if run.status == "disconnected":
                    log.info("run %s: no rank came back in %.0f s; forgetting it", run.run_id, idle)
                del self.runs[run.run_id]
                run.close_sensors()

    def detach(self, peer: Any) -> None:
        """A connection ended: its ranks are gone until they register again."""
        for run_id, r in self._peer_ranks.pop(peer, set()):
            run = self.runs.get(run_id)
            if run is not None and r in run.ranks and run.ranks[r].peer is peer:
                run.ranks[r].peer = None
                log.info("run %s: rank %d disconnected", run_id, r)
                self._maybe_end(run)

    # -- engine messages ---------------------------------------------------------------------

    def register(self, peer: Any, msg: dict[str, Any]) -> dict[str, Any]:
        run_id, rank, world = msg["run_id"], msg["rank"], msg["world_size"]
        if rank >= world:
            raise ProtocolError(ErrorCode.BAD_VALUE, f"rank {rank} is not below world_size {world}")
        knobs = knobs_from_dict(msg["knobs"])
        check_knobs_for(knobs, msg["paths"], msg["has_device"])
        run = self.runs.get(run_id)
        if run is not None and run.status == "finished":
            run = None  # a run id used again after its end: a new run
        if run is None:
            run = self._new_run(msg, knobs)
        elif run.facts.ranks != world:
            raise ProtocolError(
                ErrorCode.BAD_VALUE,
                f"run {run_id} has world_size {run.facts.ranks}, but rank {rank} says {world}: give each run its own run_id",
            )
        self._attach(run, rank, peer, msg)
        reply = {"type": "registered", "run_id": run_id, "rank": rank}
        if run.start_from is not None:  # the rank's start line says which knobs history set, and from which run
            reply["start_from"] = run.start_from
        if run.start_change is not None and run.connected() == run.facts.ranks:
            (start, reason, source), run.start_change = run.start_change, None
            self._change(run, start, reason, source=source)
            return reply
        if knobs != run.knobs:
            if run.apply_at is not None and run.apply_at > run.max_iteration:
                # A change no rank has reached yet: this rank takes it at the same iteration as the others.
                self._outbox.append((peer, self._knobs_message(run)))
            else:
                log.warning(
                    "run %s: rank %d registered with knobs %s, not the run's %s; resynchronizing every rank",
                    run_id,
                    rank,
                    knobs.to_dict(),
                    run.knobs_dict,
                )
                self._change(
                    run, run.knobs, f"rank {rank} registered with other knobs; every rank takes the run's", source="resync"
                )
        return reply

    def _attach(self, run: Run, rank: int, peer: Any, msg: dict[str, Any]) -> None:
        """``rank`` of ``run`` is on ``peer`` now (a first registration or a reconnect)."""
        old = run.ranks.get(rank)
        if old is not None and old.peer is not None and old.peer is not peer:
            # A reconnect before we noticed the old one die.
            self._peer_ranks.get(old.peer, set()).discard((run.run_id, rank))
        run.ranks[rank] = Rank(peer, iteration=max(msg.get("iteration", 0) - 1, old.iteration if old else -1))
        run.headroom[rank] = msg.get("device_headroom_bytes")
        run.max_iteration = max(run.max_iteration, run.ranks[rank].iteration)
        run.status, run.ended_at = "running", None
        self._peer_ranks.setdefault(peer, set()).add((run.run_id, rank))
        log.info("run %s: rank %d/%d registered (pid %s)", run.run_id, rank, run.facts.ranks, getattr(peer, "pid", None))

    def _new_run(self, msg: dict[str, Any], knobs: Knobs) -> Run:
        self._make_room(msg["run_id"])
        run = Run(
            run_id=msg["run_id"], facts=RunFacts.from_register(msg), knobs=knobs, history=deque(maxlen=self.config.history_points)
        )
        self.runs[run.run_id] = run
        from_history = self._warm_start(run, knobs)
        start = from_history if from_history is not None else knobs
        try:
            run.policy = self.policy_factory(start, run.facts)
        except Exception as e:
            run.policy_error = f"policy failed to start: {e}"
            log.exception("run %s: policy failed to start; the run keeps its knobs", run.run_id)
        if self.sensors_factory and run.facts.paths:
            try:
                run.sensors = self.sensors_factory(list(run.facts.paths))
            except Exception as e:
                log.warning("run %s: no sensors: %s", run.run_id, e)
        run.sensor_at = time.monotonic()
        log.info(
            "run %s: new, %d rank(s), %d params, paths %s", run.run_id, run.facts.ranks, run.facts.params, list(run.facts.paths)
        )
        if from_history is not None and run.start_from is not None:  # pushed once every rank is here to take it at once
            said = ", ".join(f"{k}={json.dumps(v, sort_keys=True)}" for k, v in run.start_from["knobs"].items())
            run.start_change = (
                from_history,
                f"from history: the tuner's verdict in run {run.start_from['run_id']} ({said})",
                "history",
            )
        self.controls.restore(run, knobs)
        return run

    def _make_room(self, run_id: str) -> None:
        """At ``max_runs``: forget the oldest run that ended, or refuse with BUSY when all run."""
        if len(self.runs) < self.config.max_runs:
            return
        idle = [r for r in self.runs.values() if r.status != "running"]
        if not idle:
            raise ProtocolError(
                ErrorCode.BUSY,
                f"the daemon already tunes {len(self.runs)} running runs: start "
                f"this one with --tuner off, or another daemon (--tuner SOCKET)",
            )
        oldest = min(idle, key=lambda r: r.ended_at or 0.0)
        log.info("run %s: forgotten to make room for run %s", oldest.run_id, run_id)
        del self.runs[oldest.run_id]
        oldest.close_sensors()

    def _warm_start(self, run: Run, knobs: Knobs) -> Knobs | None:
        """``knobs`` with the tuner's latest verdict for runs like this one
        (:meth:`tuner.history.History.warm_start`) in place of the knobs it chose there, except
        those this run's own options fix; None when history has nothing usable here that
        differs. Sets ``run.start_from`` to say where each value came from."""
        if self.history is None:
            return None
        try:
            warm = self.history.warm_start(run.facts.profile, run.facts.params, run.facts.ranks, paths=list(run.facts.paths))
            if warm is None:
                return None
            fixed = {split_key(k)[0] for k in run.facts.pins}
            start = knobs
            for name in warm.learned:
                if name in fixed:
                    continue  # the run's own options fixed it: their value stands, whatever history says
                value = getattr(warm.knobs, name)
                if name == "io_concurrency":
                    value = {**knobs.io_concurrency, **value}
                elif name == "stripe_weights" and not value:
                    continue  # none for these paths: the engine's own measured weights stand
                start = start.replace(**{name: value})
            if start == knobs:
                return None
            check_knobs_for(start, run.facts.paths, run.facts.has_device)
        except Exception as e:  # history is advice; a bad entry must not stop the run
            log.warning("run %s: history not used: %s", run.run_id, e)
            return None
        run.start_from = {
            "run_id": warm.run_id,
            "knobs": {k: new for k, (_, new) in changed_knobs(knobs.to_dict(), start.to_dict()).items()},
        }
        return start

    def _rank_of(self, peer: Any, msg: dict[str, Any]) -> tuple[Run, Rank]:
        key = (msg["run_id"], msg["rank"])
        run = self.runs.get(key[0])
        if key not in self._peer_ranks.get(peer, ()) or run is None:
            raise ProtocolError(
                ErrorCode.UNKNOWN_RUN, f"run {key[0]} rank {key[1]} is not registered on this connection: send register first"
            )
        return run, run.ranks[key[1]]

    def telemetry(self, peer: Any, msg: dict[str, Any]) -> None:
        run, rank = self._rank_of(peer, msg)
        i = msg["iteration"]
        rank.iteration = max(rank.iteration, i)
        if msg.get("iter_time_s") is not None:
            rank.iter_time_s = msg["iter_time_s"]
        if "device_headroom_bytes" in msg:
            run.headroom[msg["rank"]] = msg["device_headroom_bytes"]
        run.max_iteration = max(run.max_iteration, i)
        if i <= run.last_observed:
            return  # late: its iteration was already aggregated without it
        try:
            rec = StepRecord.from_dict(msg["record"])
        except (ConfigError, TypeError) as e:  # knobs out of range, host bytes of unknown kinds: unchecked by the schema
            raise ProtocolError(ErrorCode.BAD_VALUE, f"record: {e}") from None
        run.pending.setdefault(i, {})[msg["rank"]] = (rec, msg.get("iter_time_s"))
        self._aggregate_ready(run)

    def event(self, peer: Any, msg: dict[str, Any]) -> None:
        run, _ = self._rank_of(peer, msg)
        run.error = msg["kind"] if msg["kind"] == "oom" else msg["message"]
        run.events.append({"time": time.time(), "rank": msg["rank"], "kind": msg["kind"], "message": msg["message"]})
        log.warning("run %s rank %d: %s: %s", run.run_id, msg["rank"], msg["kind"], msg["message"])

    def applied(self, peer: Any, msg: dict[str, Any]) -> None:
        run, _ = self._rank_of(peer, msg)
        run.applied.setdefault(msg["seq"], {})[msg["rank"]] = msg["iteration"]
        while len(run.applied) > 64:
            del run.applied[min(run.applied)]
        if msg["iteration"] > msg["apply_at"]:
            log.warning(
                "run %s rank %d: change #%d applied late, at iteration %d instead of %d",
                run.run_id,
                msg["rank"],
                msg["seq"],
                msg["iteration"],
                msg["apply_at"],
            )
            run.events.append(
                {
                    "time": time.time(),
                    "rank": msg["rank"],
                    "kind": "late",
                    "message": f"change #{msg['seq']} applied at iteration {msg['iteration']}, not {msg['apply_at']}",
                }
            )

    def bye(self, peer: Any, msg: dict[str, Any]) -> None:
        run, rank = self._rank_of(peer, msg)
        rank.bye = True
        rank.stopped_by = msg.get("stopped_by")
        if msg.get("steps"):  # a signal between a step and its telemetry: the run ends where it did
            run.max_iteration = max(run.max_iteration, msg["steps"] - 1)
        rank.peer = None
        self._peer_ranks.get(peer, set()).discard((run.run_id, msg["rank"]))
        self._maybe_end(run)

    def _maybe_end(self, run: Run) -> None:
        if run.connected():
            return
        run.ended_at = time.time()
        if len(run.ranks) == run.facts.ranks and all(r.bye for r in run.ranks.values()):
            run.status = "finished"
            run.stopped_by = next((r.stopped_by for r in run.ranks.values() if r.stopped_by), None)
            self._aggregate_ready(run, flush=True)
            log.info(
                "run %s: %s at iteration %d with knobs %s",
                run.run_id,
                f"interrupted by {run.stopped_by}" if run.stopped_by else "finished",
                run.max_iteration,
                (run.in_force or run.knobs).to_dict(),
            )
            self._record_history(run)
            run.close_sensors()
            if self.on_end is not None:
                try:
                    self.on_end(run)
                except Exception as e:  # what the end is told to: never a reason to lose the run
                    log.warning("run %s: its end not recorded: %s", run.run_id, e)
        else:
            run.status = "disconnected"

    # -- the history database ----------------------------------------------------------------

    def _record_history(self, run: Run) -> None:
        """The run's end in the history: the tuner's verdict (the policy's last good knobs, and
        which of them it chose: none the user or the run's options pinned), its iteration time,
        and whether it finished or was interrupted. Only a finished run's verdict is ever a
        later run's start (:meth:`_warm_start`)."""
        if self.history is None or not run.history:
            return
        times = [t if t is not None else u for i, t, u in run.history if i >= run.in_force_since]
        try:
            knobs, learned = self._verdict(run)
            self.history.record_run(
                run.run_id,
                run.facts.profile,
                run.facts.params,
                run.facts.ranks,
                knobs,
                statistics.median(times) if times else None,
                paths=list(run.facts.paths),
                outcome="interrupted" if run.stopped_by else "finished",
                learned=learned,
            )
        except Exception as e:
            log.warning("run %s: not recorded in the history: %s", run.run_id, e)

    @staticmethod
    def _verdict(run: Run) -> tuple[Knobs, list[str]]:
        """The tuner's verdict on the run at its end, (knobs, names the tuner chose): the policy's
        last good knobs less every knob pinned (by the user or the run's options) and every knob
        the user pinned and unpinned whose value the tuner never moved since; without a working
        policy, the knobs in force and nothing learned."""
        in_force = run.in_force or run.knobs
        state = run.policy.state() if run.policy_ok() and callable(getattr(run.policy, "state", None)) else None
        if not state or not isinstance(state.get("good_knobs"), dict):
            return in_force, []
        pinned = {split_key(k)[0] for k in [*(state.get("pins") or {}), *(state.get("user_set") or []), *run.facts.pins]}
        return knobs_from_dict(state["good_knobs"]), [n for n in Knobs.names() if n not in pinned]

    def _maybe_summarize(self, run: Run, i: int, iter_time: float | None, update_s: float) -> None:
        """A point in the history database every ``summary_interval_s``: how the run went over time."""
        now = time.monotonic()
        if self.history is None or now - run.summary_at < self.config.summary_interval_s:
            return
        run.summary_at = now
        try:
            self.history.record_summary(run.run_id, i, iter_time, update_s, run.knobs)
        except Exception as e:
            log.warning("run %s: summary not recorded in the history: %s", run.run_id, e)

    # -- aggregation and decisions -----------------------------------------------------------

    def _aggregate_ready(self, run: Run, flush: bool = False) -> None:
        """Observe every iteration that all ranks reported, in order; and older ones anyway.

        Nothing is decided while a rank is away (a change could not reach it): iterations wait,
        and those older than the window are dropped. ``flush`` (the run ended) records what is
        left without asking the policy."""
        if not flush and run.connected() < run.facts.ranks:
            for i in [i for i in run.pending if i < run.max_iteration - self.config.window]:
                del run.pending[i]
            return
        for i in sorted(run.pending):
            got = run.pending[i]
            complete = len(got) >= run.facts.ranks
            stale = i < run.max_iteration - self.config.window
            if not (complete or stale or flush):
                break
            del run.pending[i]
            run.last_observed = i
            self._observe(run, i, list(got.values()), decide=not flush)

    def _observe(self, run: Run, i: int, reports: list[tuple[StepRecord, float | None]], decide: bool = True) -> None:
        """Record iteration ``i`` from its ranks' (record, iteration time); with ``decide``, ask the policy."""
        recs = [rec for rec, _ in reports]
        for r in recs:  # this iteration's bytes count as ours in the next sensor sample
            for traffic in (r.path_bytes_read, r.path_bytes_written):
                for p, b in traffic.items():
                    run.sensor_bytes[p] = run.sensor_bytes.get(p, 0) + b
        other = self._sample_sensors(run)
        headrooms = [h for h in run.headroom.values() if h is not None]
        # The knobs this iteration ran under; when ranks disagree (a late change), the odd one,
        # so that the policy does not take the mix for a measurement of its knobs.
        reported = [r.knobs for r in recs if r.knobs is not None]
        in_force = next((k for k in reported if k != run.knobs), reported[0] if reported else None)
        obs = Observation.from_records(
            recs,
            iter_times_s=[t for _, t in reports if t is not None],
            path_other_bytes_per_s={p: v for p, v in other.items() if v is not None},
            device_headroom_bytes=min(headrooms) if headrooms else None,
            error=run.error,
            knobs=in_force,
        )
        run.history.append((i, obs.iter_time_s, obs.update_s))
        run.phases = {
            "iteration": i,
            "iter_time_s": obs.iter_time_s,
            "update_s": obs.update_s,
            "read_wait_s": obs.read_wait_s,
            "write_wait_s": obs.write_wait_s,
            "kernel_s": obs.kernel_s,
            "ranks_reported": len(recs),
        }
        run.bandwidth = {
            p: {
                "read_bytes_per_s": obs.path_read_bytes_per_s.get(p, 0.0),
                "write_bytes_per_s": obs.path_write_bytes_per_s.get(p, 0.0),
                "other_bytes_per_s": other.get(p),
                "concurrency": run.knobs.concurrency_for(p),
            }
            for p in run.facts.paths
        }
        if in_force is not None and in_force != run.in_force:
            run.in_force, run.in_force_since = in_force, i
        self._maybe_summarize(run, i, obs.iter_time_s, obs.update_s)
        if not decide or run.policy is None or run.policy_error:
            return
        try:
            run.error = None
            decision = run.policy.observe(obs)
        except Exception as e:
            self._policy_failed(run, f"{type(e).__name__}: {e}")
            log.exception("run %s: policy failed at iteration %d; the run keeps knobs %s", run.run_id, i, run.knobs_dict)
            return
        self._take_decision(run, decision)

    @staticmethod
    def _policy_failed(run: Run, error: str) -> None:
        """The run's policy decides nothing more; the run keeps the pins it held, and takes new ones itself."""
        try:
            run.own_pins = Pins.of(run.policy.pins)
        except Exception as e:
            log.warning("run %s: the failed policy's pins are lost: %s", run.run_id, e)
        run.policy_error = error

    def _take_decision(self, run: Run, decision: Decision | None) -> None:
        """Push the policy's decision, unless it is none, no change, or knobs a rank would refuse."""
        if decision is None:
            return
        try:
            check_knobs_for(decision.knobs, run.facts.paths, run.facts.has_device)
        except ProtocolError as e:
            self._policy_failed(run, f"policy proposed unusable knobs: {e}")
            log.error("run %s: %s", run.run_id, run.policy_error)
            return
        if decision.knobs != run.knobs:
            self._change(run, decision.knobs, decision.reason, source="policy")

    def _sample_sensors(self, run: Run) -> dict[str, float | None]:
        """Other processes' traffic per path, sampled at most every ``sensor_interval_s``."""
        now = time.monotonic()
        if run.sensors is not None and now - run.sensor_at >= self.config.sensor_interval_s:
            ours = {p: b / (now - run.sensor_at) for p, b in run.sensor_bytes.items()}
            run.sensor_bytes, run.sensor_at = {}, now
            try:
                run.sensor_sample = run.sensors.sample(ours)
            except Exception as e:
                log.warning("run %s: sensors failed, disabled for this run: %s", run.run_id, e)
                run.sensors = None
        paths = (run.sensor_sample or {}).get("paths", {})
        return {p: (paths.get(p) or {}).get("other_bytes_per_s") for p in run.facts.paths}

    def _margin(self, run: Run) -> int:
        """Iterations ahead for ``apply_at``: ``margin_s`` worth of recent iterations, at least min_margin."""
        recent = [t if t is not None else u for _, t, u in list(run.history)[-8:]]
        recent = [t for t in recent if t and t > 0]
        if not recent:
            return self.config.min_margin
        n = math.ceil(self.config.margin_s / statistics.median(recent))
        return max(self.config.min_margin, min(n, self.config.max_margin))

    def _change(self, run: Run, knobs: Knobs, reason: str, *, source: str) -> None:
        """Push ``knobs`` to every rank of ``run``, to apply at one iteration all ranks reach later."""
        run.seq += 1
        run.apply_at = max(run.max_iteration, 0) + self._margin(run)
        for key in changed_knobs(run.knobs_dict, knobs.to_dict()):
            run.changed_by[key] = source
        run.knobs, run.knobs_dict, run.reason = knobs, knobs.to_dict(), reason
        run.decisions.append(
            {
                "time": time.time(),
                "iteration": run.max_iteration,
                "seq": run.seq,
                "apply_at": run.apply_at,
                "knobs": run.knobs_dict,
                "reason": reason,
                "source": source,
            }
        )
        log.info(
            "run %s: iteration %d: change #%d at iteration %d (%s): %s; knobs %s",
            run.run_id,
            run.max_iteration,
            run.seq,
            run.apply_at,
            source,
            reason,
            run.knobs_dict,
        )
        msg = self._knobs_message(run)
        for r in run.ranks.values():
            if r.peer is not None:
                self._outbox.append((r.peer, msg))

    @staticmethod
    def _knobs_message(run: Run) -> dict[str, Any]:
        return {
            "v": API_VERSION,
            "type": "knobs",
            "run_id": run.run_id,
            "knobs": run.knobs_dict,
            "apply_at": run.apply_at,
            "seq": run.seq,
            "reason": run.reason,
        }

    # -- views -------------------------------------------------------------------------------

    def views(self, run_id: str | None, history: int, budget: int) -> tuple[list[RunView], list[str]]:
        """Views of every run (or of ``run_id``) within ``budget`` encoded bytes, and the ids of
        those left out. A run whose view cannot be encoded or is too large for its share comes
        as a compact view; one run never breaks the answer for the others."""
        wanted = [r for r in self.runs.values() if run_id in (None, r.run_id)]
        share = max(budget // max(1, len(wanted)), 16 * 1024)
        runs, omitted, used = [], [], 0
        for r in wanted:
            view, size = encodable_view(r, history, share)
            if used + size > budget:
                omitted.append(r.run_id)
                continue
            runs.append(view)
            used += size
        return runs, omitted
