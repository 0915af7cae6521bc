"""Reading a run directory's records (``report/recorder.py``), with one-line errors.

A run directory holds, per rank, ``record-rank<R>.jsonl`` and ``samples-rank<R>.jsonl`` (the
recorder's) and, for offloadctl's engine, ``telemetry-rank<R>.jsonl`` (the engine's). A crashed
run keeps every full line it wrote: a last line cut short is skipped with a note, a missing
``end`` line reads as a run that ended without one, and what was recorded still reports. Record
format versions 1 and 2 read alike (1 has no samples or tokens, and an end status of ok).

What cannot report is an error naming the directory and what to do: an empty or foreign
directory, a record damaged before its last line, a run that stopped before its first complete
iteration.
"""

from __future__ import annotations

import json
import os
import re
from dataclasses import dataclass, field

from engine.errors import ConfigError
from engine.telemetry import StepRecord, upgrade_record
from report.recorder import FORMAT_VERSION, RECORD_FORMAT, SAMPLES_FORMAT


@dataclass
class RankRecord:
    """What one rank recorded."""

    rank: int
    header: dict
    init: dict
    iterations: list[dict]
    """The recorder's iteration lines; an iteration's ``engine``, when there is one, is the
    engine's :class:`StepRecord` of the step that ended it."""
    end: dict | None
    samples_header: dict | None = None
    samples: list[list] = field(default_factory=list)
    telemetry: list[StepRecord] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    """What was odd but did not stop the report (a cut last line, a missing samples file)."""


@dataclass
class Run:
    path: str
    label: str
    engine: str
    ranks: list[int]
    """Every rank with a record in the directory."""
    record: RankRecord
    """The rank reported (``--rank``)."""

    @property
    def status_kind(self) -> str:
        """finished, interrupted, error, or no end record (killed outright, or still running)."""
        end = self.record.end
        if end is None:
            return "no end record"
        status = end.get("status") or "finished"
        return "finished" if status == "ok" else status

    @property
    def stopped_at(self) -> int:
        """Iterations completed when the run stopped (the 0-based iteration it was in)."""
        end = self.record.end
        if end is not None and end.get("iterations") is not None:
            return int(end["iterations"])
        return self.record.iterations[-1]["iteration"] + 1

    @property
    def status(self) -> str:
        """The run's end in words: 'finished', 'interrupted by SIGINT at iteration 200', ..."""
        kind, at, end = self.status_kind, self.stopped_at, self.record.end or {}  # {}: read only where there is one
        if kind == "no end record":
            return f"ended without an end record at iteration {at} (killed, or still running)"
        if kind == "interrupted":
            return f"interrupted by {end.get('signal') or 'a signal'} at iteration {at}"
        if kind == "error":
            return f"crashed at iteration {at}: {end.get('error')}"
        return "finished"


def load_run(path: str, rank: int | None = None, label: str | None = None) -> Run:
    """The records of ``rank`` in run directory ``path`` (None: the lowest rank recorded there,
    which on a node of a multi-node run is not 0); :class:`ConfigError` when there is nothing
    to report."""
    if not os.path.lexists(path):
        raise ConfigError(f"{path} does not exist: give the --run-dir of an `offloadctl train` run (its start line names it)")
    if not os.path.isdir(path):
        raise ConfigError(f"{path} is not a directory: give the --run-dir of an `offloadctl train` run")
    names = os.listdir(path)
    if not names:
        raise ConfigError(
            f"{path} is empty: no run recorded there (offloadctl train writes record-rank<R>.jsonl into its --run-dir)"
        )
    ranks = sorted(int(m.group(1)) for m in (re.fullmatch(r"record-rank(\d+)\.jsonl", n) for n in names) if m)
    if not ranks:
        if any(re.fullmatch(r"telemetry-rank\d+\.jsonl", n) for n in names):
            raise ConfigError(
                f"{path} has the engine's telemetry but no record-rank<R>.jsonl: the run was made with "
                f"--no-record or by an older offloadctl; run it again to report it"
            )
        raise ConfigError(
            f"{path} is not an offloadctl run directory (no record-rank<R>.jsonl among its "
            f"{len(names)} entries): give the --run-dir of an `offloadctl train` run"
        )
    if rank is None:
        rank = ranks[0]
    if rank not in ranks:
        raise ConfigError(
            f"{path} has no record of rank {rank} (ranks recorded: {', '.join(map(str, ranks))}): choose one with --rank"
        )
    rec = _load_record(os.path.join(path, f"record-rank{rank}.jsonl"), rank)
    _load_samples(os.path.join(path, f"samples-rank{rank}.jsonl"), rec)
    tel = os.path.join(path, f"telemetry-rank{rank}.jsonl")
    if os.path.exists(tel):
        rec.telemetry = read_telemetry(tel, rec.notes)
    engine = rec.header.get("engine", "offloadctl")
    name = label or f"{os.path.basename(os.path.normpath(os.path.abspath(path)))} ({engine})"
    return Run(path=os.path.abspath(path), label=name, engine=engine, ranks=ranks, record=rec)


def read_telemetry(path: str, notes: list[str]) -> list[StepRecord]:
    """The engine's ``telemetry-rank<R>.jsonl``, a step a line (a last line cut short skipped,
    with a note); :class:`ConfigError` naming the file and line where a line is no step record."""
    values = _json_lines(path, notes)
    return [step_record(v, f"{path}:{i}") for i, v in enumerate(values, 1)]


def step_record(d, where: str) -> StepRecord:
    """One step record as a run directory's files hold it, read as today's
    :class:`StepRecord` (older ones upgraded: :func:`engine.telemetry.upgrade_record`)."""
    if not isinstance(d, dict):
        raise ConfigError(f"{where}: not a step record (a JSON object): the record is damaged")
    try:
        return StepRecord.from_dict(upgrade_record(d))
    except TypeError:  # a required field missing
        raise ConfigError(
            f"{where}: a step record without its times (iteration, update_s, read_wait_s, kernel_s, "
            f"write_wait_s): the record is damaged"
        ) from None


class _NotFinite(ValueError):
    pass


def _not_finite(name: str):
    """json's NaN, Infinity and -Infinity: no record holds them (the plots cannot scale to them)."""
    raise _NotFinite(name)


def _json_lines(path: str, notes: list[str]) -> list:
    """Every JSON line of ``path``; a last line cut short (a crash mid-write) is skipped with a
    note, a bad line before it is an error."""
    with open(path, "rb") as f:
        data = f.read()
    lines = data.split(b"\n")
    complete = data.endswith(b"\n")
    if complete:
        lines = lines[:-1]
    out = []
    for i, raw in enumerate(lines, 1):
        if not raw.strip():
            continue
        try:
            out.append(json.loads(raw, parse_constant=_not_finite))
        except _NotFinite as e:
            raise ConfigError(
                f"{path}:{i}: holds {e.args[0]}, not a number: the record is damaged (offloadctl writes "
                f"finite numbers only); fix or remove that line"
            ) from None
        except (json.JSONDecodeError, UnicodeDecodeError):
            if i == len(lines) and not complete:
                notes.append(
                    f"{os.path.basename(path)}: its last line was cut short (the run stopped while writing "
                    f"it); reported up to the line before"
                )
                break
            raise ConfigError(
                f"{path}:{i}: not a JSON line: the record is damaged (or not offloadctl's); "
                f"nothing after a damaged line can be trusted"
            ) from None
    return out


def _load_record(path: str, rank: int) -> RankRecord:
    notes: list[str] = []
    if os.path.getsize(path) == 0:
        raise ConfigError(f"{path} is empty: the run stopped before it started recording")
    try:
        values = _json_lines(path, notes)
    except ConfigError as e:
        if ":1:" in str(e):  # not even a header: someone else's file of that name
            raise ConfigError(f"{path} is not an offloadctl record (its first line is not JSON)") from None
        raise
    if not values or not isinstance(values[0], dict) or values[0].get("format") != RECORD_FORMAT:
        raise ConfigError(f"{path} is not an offloadctl record (its first line is not a {RECORD_FORMAT} header)")
    header = values[0]
    if int(header.get("version", 0)) > FORMAT_VERSION:
        raise ConfigError(
            f"{path} is record format version {header.get('version')}, newer than this offloadctl "
            f"reads ({FORMAT_VERSION}): upgrade offloadctl"
        )
    init, iterations, end = None, [], None
    for v in values[1:]:
        kind = v.get("type") if isinstance(v, dict) else None
        if kind == "init" and init is None:
            init = v
        elif kind == "iteration":
            if v.get("engine") is not None:
                v["engine"] = step_record(v["engine"], f"{path}: iteration {v.get('iteration')}'s engine record")
            iterations.append(v)
        elif kind == "end":
            end = v
    if init is None:
        raise ConfigError(
            f"{path}: the run stopped before deepspeed.initialize returned (or never called it): no iteration to report"
        )
    if not iterations:
        raise ConfigError(
            f"{path}: the run recorded no complete iteration (it stopped before its first optimizer "
            f"step ended): nothing to report"
        )
    return RankRecord(rank=rank, header=header, init=init, iterations=iterations, end=end, notes=notes)


def _load_samples(path: str, rec: RankRecord) -> None:
    if not os.path.exists(path):
        if rec.header.get("sample_hz", 0) > 0:
            rec.notes.append(f"{os.path.basename(path)} is missing: no sampled series")
        return
    try:
        values = _json_lines(path, rec.notes)
    except ConfigError as e:
        rec.notes.append(f"sampled series left out: {e}")
        return
    if not values or not isinstance(values[0], dict) or values[0].get("format") != SAMPLES_FORMAT:
        rec.notes.append(f"{os.path.basename(path)} is not an offloadctl samples file: no sampled series")
        return
    width = len(values[0]["columns"])
    rec.samples_header = values[0]
    rec.samples = [r for r in values[1:] if isinstance(r, list) and len(r) == width]
