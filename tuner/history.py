"""The tuner's memory: one SQLite database per host with runs, telemetry summaries and knobs.

A new run with the same profile, the same number of ranks and a model within 2x the size of
an earlier one starts from the best knobs found then (lowest iteration time per parameter).
Written by one daemon process (a lock serialises its threads); WAL lets ``offloadctl tune``
and other readers look at it meanwhile.
"""
from __future__ import annotations

import json
import os
import socket
import sqlite3
import threading
import time
from typing import Sequence

from engine.config import Knobs
from engine.errors import ConfigError

SCHEMA_VERSION = 1

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
    updated_s   REAL NOT NULL
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


def profile_key(profile) -> str:
    """A profile's identity in the database: its name (a ``Profile`` or a string), '' for none."""
    if profile is None:
        return ""
    return str(getattr(profile, "name", profile))


class History:
    """Runs, periodic summaries and chosen knobs in ``db_path`` (created with its directory)."""

    def __init__(self, db_path: str) -> None:
        self.db_path = os.path.abspath(os.path.expanduser(db_path))
        self.host = socket.gethostname()
        self._lock = threading.Lock()
        try:
            os.makedirs(os.path.dirname(self.db_path), mode=0o700, exist_ok=True)
            self._db = sqlite3.connect(self.db_path, timeout=10, check_same_thread=False, isolation_level=None)
        except (OSError, sqlite3.Error) as e:
            raise ConfigError(f"tuner history database {self.db_path} cannot be opened ({e}): give a writable path "
                              f"(--db PATH)") from None
        try:
            self._db.execute("PRAGMA journal_mode=WAL")
            self._db.execute("PRAGMA synchronous=NORMAL")
            version = self._db.execute("PRAGMA user_version").fetchone()[0]
            if version not in (0, SCHEMA_VERSION):
                raise ConfigError(f"tuner history database {self.db_path} has schema version {version}, this offloadctl "
                                  f"reads {SCHEMA_VERSION}: move the file away to start a new history")
            with self._db:
                self._db.executescript("BEGIN;" + _SCHEMA + f"PRAGMA user_version={SCHEMA_VERSION};COMMIT;")
        except sqlite3.Error as e:
            self._db.close()
            raise ConfigError(f"tuner history database {self.db_path} is not usable ({e}): move the file away to "
                              f"start a new history") from None
        except ConfigError:
            self._db.close()
            raise

    def record_run(self, run_id: str, profile, params: int, ranks: int, knobs: Knobs, iter_time_s: float | None,
                   *, paths: Sequence[str] | None = None) -> None:
        """Insert or update ``run_id`` with the knobs chosen and their iteration time."""
        if paths is None:
            paths = sorted(set(knobs.io_concurrency) | set(knobs.stripe_weights))
        now = time.time()
        with self._lock, self._db:
            self._db.execute(
                "INSERT INTO runs (run_id, host, profile, params, ranks, paths, knobs, iter_time_s, started_s, updated_s) "
                "VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?) ON CONFLICT(run_id) DO UPDATE SET profile=excluded.profile, "
                "params=excluded.params, ranks=excluded.ranks, paths=excluded.paths, knobs=excluded.knobs, "
                "iter_time_s=excluded.iter_time_s, updated_s=excluded.updated_s",
                (run_id, self.host, profile_key(profile), int(params), int(ranks), json.dumps(list(paths)),
                 json.dumps(knobs.to_dict(), sort_keys=True), _float_or_none(iter_time_s), now, now))

    def save_controls(self, run_id: str, pins: dict, frozen: bool) -> None:
        """Remember ``run_id``'s pins and freeze (a restarted daemon puts them back)."""
        with self._lock, self._db:
            self._db.execute(
                "INSERT INTO controls (run_id, pins, frozen, updated_s) VALUES (?, ?, ?, ?) ON CONFLICT(run_id) DO "
                "UPDATE SET pins=excluded.pins, frozen=excluded.frozen, updated_s=excluded.updated_s",
                (run_id, json.dumps(pins, sort_keys=True), int(bool(frozen)), time.time()))

    def controls(self, run_id: str) -> tuple[dict, bool] | None:
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

    def record_summary(self, run_id: str, iteration: int, iter_time_s: float | None, update_s: float | None,
                       knobs: Knobs) -> None:
        """A periodic point of a run: its times at ``iteration`` and the knobs in force."""
        with self._lock, self._db:
            self._db.execute(
                "INSERT OR REPLACE INTO summaries (run_id, iteration, time_s, iter_time_s, update_s, knobs) "
                "VALUES (?, ?, ?, ?, ?, ?)",
                (run_id, int(iteration), time.time(), _float_or_none(iter_time_s), _float_or_none(update_s),
                 json.dumps(knobs.to_dict(), sort_keys=True)))

    def best_knobs(self, profile, params: int, ranks: int, *, paths: Sequence[str] | None = None) -> Knobs | None:
        """The knobs of the fastest matching run (iteration time per parameter): same profile, same
        ranks, params within 2x. With ``paths``, only entries for those paths are kept, and runs on
        exactly these paths are preferred."""
        with self._lock:
            rows = self._db.execute(
                "SELECT knobs, paths, iter_time_s, params FROM runs WHERE profile = ? AND ranks = ? "
                "AND params * 2 >= ? AND params <= ? * 2 AND iter_time_s IS NOT NULL AND params > 0",
                (profile_key(profile), int(ranks), int(params), int(params))).fetchall()
        if not rows:
            return None
        want = set(paths) if paths is not None else None
        best = min(rows, key=lambda r: (want is not None and set(json.loads(r[1])) != want, r[2] / r[3]))
        knobs = Knobs.from_dict(json.loads(best[0]))
        if want is None:
            return knobs
        conc = {p: v for p, v in knobs.io_concurrency.items() if p in want}
        weights = {p: v for p, v in knobs.stripe_weights.items() if p in want}
        if set(weights) != want:
            weights = {}  # partial weights would mix with the engine's measured bandwidths
        return knobs.replace(io_concurrency=conc, stripe_weights=weights)

    def runs(self) -> list[dict]:
        """Every run, newest first."""
        with self._lock:
            rows = self._db.execute("SELECT run_id, host, profile, params, ranks, paths, knobs, iter_time_s, started_s, "
                                    "updated_s FROM runs ORDER BY updated_s DESC").fetchall()
        keys = ("run_id", "host", "profile", "params", "ranks", "paths", "knobs", "iter_time_s", "started_s", "updated_s")
        out = []
        for r in rows:
            d = dict(zip(keys, r))
            d["paths"], d["knobs"] = json.loads(d["paths"]), json.loads(d["knobs"])
            out.append(d)
        return out

    def summaries(self, run_id: str) -> list[dict]:
        """One run's summaries by iteration."""
        with self._lock:
            rows = self._db.execute("SELECT iteration, time_s, iter_time_s, update_s, knobs FROM summaries "
                                    "WHERE run_id = ? ORDER BY iteration", (run_id,)).fetchall()
        return [{"iteration": i, "time_s": t, "iter_time_s": it, "update_s": u, "knobs": json.loads(k)}
                for i, t, it, u, k in rows]

    def close(self) -> None:
        with self._lock:
            self._db.close()

    def __enter__(self) -> "History":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def _float_or_none(x) -> float | None:
    return None if x is None else float(x)
