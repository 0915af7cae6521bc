"""The one per-machine cache (``engine/storage/machine_cache.py``): what the kernel choice, the
node's memory bandwidth and py-cpuinfo's answer are kept with, tested alone."""

from __future__ import annotations

import json
import multiprocessing
import os
import time

import pytest

from engine.storage.machine_cache import kept_fact


def test_a_fact_is_decided_once_and_read_after(tmp_path):
    calls = []

    def measure(kept):
        if kept is not None:
            return kept
        calls.append(1)
        return {"rate": 5.0}

    assert kept_fact(str(tmp_path), "facts.json", "cpu-a", measure) == {"rate": 5.0}
    assert kept_fact(str(tmp_path), "facts.json", "cpu-a", measure) == {"rate": 5.0}
    assert len(calls) == 1
    assert kept_fact(str(tmp_path), "facts.json", "cpu-b", measure) == {"rate": 5.0}  # another key: measured
    assert len(calls) == 2
    assert json.loads((tmp_path / "facts.json").read_text()) == {"cpu-a": {"rate": 5.0}, "cpu-b": {"rate": 5.0}}
    assert not [p for p in tmp_path.iterdir() if p.name.endswith(".tmp")]


def test_decide_sees_what_is_kept_and_none_keeps_nothing(tmp_path):
    (tmp_path / "f.json").write_text(json.dumps({"k": 3}))
    seen = []
    assert kept_fact(str(tmp_path), "f.json", "k", lambda kept: seen.append(kept)) is None
    assert seen == [3]
    assert json.loads((tmp_path / "f.json").read_text()) == {"k": 3}  # None changed nothing
    for bad in ("{not json", "[1, 2]", ""):
        (tmp_path / "f.json").write_text(bad)
        assert kept_fact(str(tmp_path), "f.json", "k", lambda kept: kept if kept is not None else 7) == 7
        assert json.loads((tmp_path / "f.json").read_text()) == {"k": 7}


def _slow_decider(directory: str, out: str) -> None:
    def decide(kept):
        if kept is None:
            time.sleep(0.5)  # long enough for the other process to arrive meanwhile
            with open(out, "a") as f:
                f.write(f"{os.getpid()}\n")
            return os.getpid()
        return kept

    kept_fact(directory, "f.json", "k", decide)


def test_processes_starting_together_decide_once(tmp_path):
    """Ranks starting together: one measures under the lock, the other reads what it kept."""
    out = str(tmp_path / "measured")
    ctx = multiprocessing.get_context("spawn")
    procs = [ctx.Process(target=_slow_decider, args=(str(tmp_path), out)) for _ in range(2)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(60)
        assert p.exitcode == 0
    measured = open(out).read().split()
    assert len(measured) == 1, measured
    assert json.loads((tmp_path / "f.json").read_text()) == {"k": int(measured[0])}


def test_a_link_planted_in_its_place_is_not_followed(tmp_path):
    """Someone links the cache's file to one of theirs (or to a file of ours): it is neither read
    nor written through; the fact is decided here and the target is left as it was."""
    target = tmp_path / "elsewhere.json"
    target.write_text(json.dumps({"k": "planted"}))
    cache = tmp_path / "cache"
    cache.mkdir()
    os.symlink(target, cache / "f.json")
    assert kept_fact(str(cache), "f.json", "k", lambda kept: kept if kept is not None else "measured") == "measured"
    assert json.loads(target.read_text()) == {"k": "planted"}


@pytest.mark.skipif(os.geteuid() == 0, reason="root writes anywhere")
def test_nowhere_to_keep_it_still_decides(tmp_path):
    ro = tmp_path / "ro"
    ro.mkdir()
    ro.chmod(0o555)
    try:
        assert kept_fact(str(ro), "f.json", "k", lambda kept: 4) == 4
    finally:
        ro.chmod(0o755)


def test_a_directory_that_cannot_be_made_still_decides(tmp_path):
    (tmp_path / "file").write_text("")
    assert kept_fact(str(tmp_path / "file" / "sub"), "f.json", "k", lambda kept: 4) == 4
