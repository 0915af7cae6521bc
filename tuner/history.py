"""The tuner's memory: one SQLite database per host with runs, telemetry summaries and knobs.

A new run with the same profile, the same number of ranks and a model within 2x the size of
an earlier one starts from the tuner's latest verdict for such a run (:meth:`History.warm_start`):
the knobs the tuner itself settled on in a run that finished, and only those of its knobs that
no one pinned. A user's pin (``tune --pin``, or a knob given to ``offloadctl train``), an
interrupted run and a row written before schema 2 (which did not say which knobs were the
tuner's) never set a later run's start.
Written by one daemon process (a lock serialises its threads); WAL lets ``offloadctl tune``
and other readers look at it meanwhile.
"""

from __future__ import annotations

import contextlib
import json
import os
import socket
import sqlite3
import threading
import time
from dataclasses import dataclass
from typing import Any, Mapping, Sequence

from engine.config import Knobs
from engine.errors import ConfigError
from tuner.knob_text import known_paths
from tuner.own_files import foreign_file_problem, shared_dir_problem

SCHEMA_VERSION = 2
"""2: ``runs.outcome`` and ``runs.learned``; a schema-1 file is upgraded in place (its rows get
NULL there, and are never learned from)."""
OUTCOMES = ("finished", "interrupted")

_SCHEMA = """
CREATE TABLE IF NOT EXISTS runs (
    run_id      TEXT PRIMARY KEY,
    host        TEXT NOT NULL,
    profile     TEXT NOT NULL,      -- profile name, '' without one
    params      INTEGER NOT NULL,
    ranks       INTEGER NOT NULL,
    paths       TEXT NOT NULL,      -- JSON list of storage paths
    knobs       TEXT NOT NULL,      -- JSON of Knobs.to_dict(): the knobs chosen
    iter_time_s REAL,               -- with those knobs; NULL when unknown
    started_s   REAL NOT NULL,      -- Unix time
    updated_s   REAL NOT NULL,
    outcome     TEXT,               -- finished | interrupted; NULL in rows of schema 1
    learned     TEXT                -- JSON list of the knob names the tuner chose (not pinned); NULL: unknown
);
CREATE INDEX IF NOT EXISTS runs_match ON runs (profile, ranks, params);
CREATE TABLE IF NOT EXISTS summaries (
    run_id      TEXT NOT NULL,
    iteration   INTEGER NOT NULL,
    time_s      REAL NOT NULL,
    iter_time_s REAL,
    update_s    REAL,
    knobs       TEXT NOT NULL,
    PRIMARY KEY (run_id, iteration)
);
CREATE TABLE IF NOT EXISTS controls (  -- the user's pins and freeze of a run, kept across daemon restarts
    run_id      TEXT PRIMARY KEY,
    pins        TEXT NOT NULL,      -- JSON {knob: value}
    frozen      INTEGER NOT NULL,
    updated_s   REAL NOT NULL
);
"""


_ADDED_IN_2 = (("outcome", "TEXT"), ("learned", "TEXT"))


@dataclass(frozen=True)
class WarmStart:
    """Where a new run starts from: the tuner's verdict in an earlier run like it."""

    run_id: str
    """The earlier run."""
    knobs: Knobs
    """Its knobs, cut to the new run's paths; only the ``learned`` ones are the tuner's."""
    learned: tuple[str, ...]
    """The knob names the tuner chose in that run (none of them pinned there)."""
    updated_s: float
    """When that run ended (Unix time)."""


def profile_key(profile: object) -> str:
    """A profile's identity in the database: its name (a ``Profile`` or a string), '' for none."""
    if profile is None:
        return ""
    return str(getattr(profile, "name", profile))


def check_db_place(db_path: str) -> None:
    """ConfigError (one line) unless ``db_path`` is a place for the history that no one else can
    put a link in: its directory (if there is one yet) writable by this user only, and the
    database and SQLite's files beside it, where they exist, this user's own regular files."""
    path = os.path.abspath(os.path.expanduser(db_path))
    fix = "give --db a path in a directory only you can write (mode 0700)"
    d = os.path.dirname(path)
    problem = shared_dir_problem(d, own_group_ok=True) if os.path.isdir(d) else None
    if problem:
        raise ConfigError(f"tuner history database {path}: {problem}, where they could put links for it: {fix}")
    for name in (path, *(path + suffix for suffix in ("-wal", "-shm", "-journal"))):
        problem = foreign_file_problem(name)
        if problem:
            raise ConfigError(
                f"tuner history database {path}: {problem}, which someone else may have put there: remove it, or {fix}"
            )


class History:
    """Runs, periodic summaries and chosen knobs in ``db_path`` (created with its directory)."""

    def __init__(self, db_path: str) -> None:
        self.db_path = os.path.abspath(os.path.expanduser(db_path))
        self.host = socket.gethostname()
        self._lock = threading.Lock()
        check_db_place(self.db_path)
        try:
            os.makedirs(os.path.dirname(self.db_path), mode=0o700, exist_ok=True)
            # A new database is born the user's alone (0600), never through a link put there meanwhile
            with contextlib.suppress(FileExistsError):
                os.close(os.open(self.db_path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600))
            self._db = sqlite3.connect(self.db_path, timeout=10, check_same_thread=False, isolation_level=None)
        except (OSError, sqlite3.Error) as e:
            raise ConfigError(
                f"tuner history database {self.db_path} cannot be opened ({e}): give a writable path (--db PATH)"
            ) from None
        try:
            self._db.execute("PRAGMA journal_mode=WAL")
            self._db.execute("PRAGMA synchronous=NORMAL")
            version = self._db.execute("PRAGMA user_version").fetchone()[0]
            if version not in (0, 1, SCHEMA_VERSION):  # 1 is upgraded below
                raise ConfigError(
                    f"tuner history database {self.db_path} has schema version {version}, this offloadctl "
                    f"reads {SCHEMA_VERSION}: move the file away to start a new history"
                )
            with self._db:
                self._db.executescript("BEGIN;" + _SCHEMA + "COMMIT;")
                have = {row[1] for row in self._db.execute("PRAGMA table_info(runs)")}
                for name, kind in _ADDED_IN_2:  # a schema-1 file: its rows say nothing of who chose the knobs
                    if name not in have:
                        self._db.execute(f"ALTER TABLE runs ADD COLUMN {name} {kind}")
                self._db.execute(f"PRAGMA user_version={SCHEMA_VERSION}")
        except sqlite3.Error as e:
            self._db.close()
            raise ConfigError(
                f"tuner history database {self.db_path} is not usable ({e}): move the file away to start a new history"
            ) from None
        except ConfigError:
            self._db.close()
            raise

    def record_run(
        self,
        run_id: str,
        profile: object,
        params: int,
        ranks: int,
        knobs: Knobs,
        iter_time_s: float | None,
        *,
        paths: Sequence[str] | None = None,
        outcome: str = "finished",
        learned: Sequence[str] | None = None,
    ) -> None:
        """Insert or update ``run_id`` with the knobs chosen and their iteration time.

        ``outcome``: 'finished', or 'interrupted' (a signal stopped it: never learned from).
        ``learned``: the knob names the tuner chose in this run, those no one pinned (None: all
        of them; ``[]``: none, e.g. the run's tuning failed); only these are ever a later start."""
        if outcome not in OUTCOMES:
            raise ConfigError(f"record_run outcome must be one of {', '.join(OUTCOMES)}, got {outcome!r}")
        learned = list(Knobs.names()) if learned is None else [n for n in Knobs.names() if n in set(learned)]
        if paths is None:
            paths = sorted(set(knobs.io_concurrency) | set(knobs.stripe_weights))
        now = time.time()
        with self._lock, self._db:
            self._db.execute(
                "INSERT INTO runs (run_id, host, profile, params, ranks, paths, knobs, iter_time_s, started_s, updated_s, "
                "outcome, learned) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?) ON CONFLICT(run_id) DO UPDATE SET "
                "profile=excluded.profile, params=excluded.params, ranks=excluded.ranks, paths=excluded.paths, "
                "knobs=excluded.knobs, iter_time_s=excluded.iter_time_s, updated_s=excluded.updated_s, "
                "outcome=excluded.outcome, learned=excluded.learned",
                (
                    run_id,
                    self.host,
                    profile_key(profile),
                    int(params),
                    int(ranks),
                    json.dumps(list(paths)),
                    json.dumps(knobs.to_dict(), sort_keys=True),
                    _float_or_none(iter_time_s),
                    now,
                    now,
                    outcome,
                    json.dumps(learned),
                ),
            )

    def save_controls(self, run_id: str, pins: Mapping[str, Any], frozen: bool) -> None:
        """Remember ``run_id``'s pins and freeze (a restarted daemon puts them back)."""
        with self._lock, self._db:
            self._db.execute(
                "INSERT INTO controls (run_id, pins, frozen, updated_s) VALUES (?, ?, ?, ?) ON CONFLICT(run_id) DO "
                "UPDATE SET pins=excluded.pins, frozen=excluded.frozen, updated_s=excluded.updated_s",
                (run_id, json.dumps(pins, sort_keys=True), int(bool(frozen)), time.time()),
            )

    def controls(self, run_id: str) -> tuple[dict[str, Any], bool] | None:
        """``(pins, frozen)`` saved for ``run_id``, or None."""
        with self._lock:
            row = self._db.execute("SELECT pins, frozen FROM controls WHERE run_id = ?", (run_id,)).fetchone()
        if row is None:
            return None
        try:
            pins = json.loads(row[0])
        except ValueError:
            return None
        return (pins if isinstance(pins, dict) else {}), bool(row[1])

    def record_summary(
        self, run_id: str, iteration: int, iter_time_s: float | None, update_s: float | None, knobs: Knobs
    ) -> None:
        """A periodic point of a run: its times at ``iteration`` and the knobs in force."""
        with self._lock, self._db:
            self._db.execute(
                "INSERT OR REPLACE INTO summaries (run_id, iteration, time_s, iter_time_s, update_s, knobs) "
                "VALUES (?, ?, ?, ?, ?, ?)",
                (
                    run_id,
                    int(iteration),
                    time.time(),
                    _float_or_none(iter_time_s),
                    _float_or_none(update_s),
                    json.dumps(knobs.to_dict(), sort_keys=True),
                ),
            )

    def warm_start(self, profile: object, params: int, ranks: int, *, paths: Sequence[str] | None = None) -> WarmStart | None:
        """The tuner's latest verdict for a run like this one: same profile, same ranks, params
        within 2x, a run that finished with an iteration time and knobs the tuner chose; with
        ``paths``, runs on exactly these paths first, and only entries for those paths kept.
        The latest, not the fastest: runs of other sizes and loads are not comparable by
        speed, and the newest verdict knows the machine as it is now. None when there is none."""
        with self._lock:
            rows = self._db.execute(
                "SELECT run_id, knobs, paths, learned, updated_s FROM runs WHERE profile = ? AND ranks = ? "
                "AND params * 2 >= ? AND params <= ? * 2 AND iter_time_s IS NOT NULL AND params > 0 "
                "AND outcome = 'finished' AND learned IS NOT NULL AND learned != '[]'",
                (profile_key(profile), int(ranks), int(params), int(params)),
            ).fetchall()
        if not rows:
            return None
        want = set(paths) if paths is not None else None
        run_id, knobs_json, paths_json, learned_json, updated = min(
            rows, key=lambda r: (want is not None and set(json.loads(r[2])) != want, -r[4])
        )
        knobs = Knobs.from_dict(json.loads(knobs_json))
        learned = tuple(n for n in json.loads(learned_json) if n in Knobs.names())
        if want is not None:
            knobs, _ = known_paths(knobs, sorted(want), "the history's knobs")
            if set(knobs.stripe_weights) != want:  # partial weights were dropped: none learned
                learned = tuple(n for n in learned if n != "stripe_weights")
        return WarmStart(run_id=run_id, knobs=knobs, learned=learned, updated_s=updated) if learned else None

    def runs(self) -> list[dict[str, Any]]:
        """Every run, newest first."""
        with self._lock:
            rows = self._db.execute(
                "SELECT run_id, host, profile, params, ranks, paths, knobs, iter_time_s, started_s, "
                "updated_s, outcome, learned FROM runs ORDER BY updated_s DESC"
            ).fetchall()
        keys = (
            "run_id",
            "host",
            "profile",
            "params",
            "ranks",
            "paths",
            "knobs",
            "iter_time_s",
            "started_s",
            "updated_s",
            "outcome",
            "learned",
        )
        out = []
        for r in rows:
            d = dict(zip(keys, r))
            d["paths"], d["knobs"] = json.loads(d["paths"]), json.loads(d["knobs"])
            d["learned"] = json.loads(d["learned"]) if d["learned"] is not None else None
            out.append(d)
        return out

    def summaries(self, run_id: str) -> list[dict[str, Any]]:
        """One run's summaries by iteration."""
        with self._lock:
            rows = self._db.execute(
                "SELECT iteration, time_s, iter_time_s, update_s, knobs FROM summaries WHERE run_id = ? ORDER BY iteration",
                (run_id,),
            ).fetchall()
        return [
            {"iteration": i, "time_s": t, "iter_time_s": it, "update_s": u, "knobs": json.loads(k)} for i, t, it, u, k in rows
        ]

    def close(self) -> None:
        with self._lock:
            self._db.close()

    def __enter__(self) -> "History":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _float_or_none(x: float | None) -> float | None:
    return None if x is None else float(x)
