"""A table of per-step engine telemetry: what an offloaded run spent its update phase on."""
from __future__ import annotations

import json
import statistics

from rich.console import Console
from rich.table import Table


def load_records(path: str) -> list[dict]:
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


def summary_table(records: list[dict], title: str = "update phase") -> Table:
    """Medians over steps 2..N (step 1 materialises the state), from ``StepRecord.to_dict()``s."""
    steady = records[1:] or records
    med = lambda key: statistics.median(r[key] for r in steady)  # noqa: E731
    t = Table(f"median over {len(steady)} steps", "value", title=title)
    t.add_row("update phase wall", f"{med('wall_s') * 1e3:.1f} ms")
    t.add_row("  waiting for reads", f"{med('read_wait_s') * 1e3:.1f} ms")
    t.add_row("  AdamW updates", f"{med('update_s') * 1e3:.1f} ms")
    t.add_row("  waiting for writes", f"{med('write_wait_s') * 1e3:.1f} ms")
    t.add_row("bytes moved per param", f"{med('bytes_moved_per_param'):.1f} (stock ZeRO-Infinity: ~32)")
    t.add_row("read / write bandwidth", f"{med('read_bytes_per_s') / 1e6:.0f} / {med('write_bytes_per_s') / 1e6:.0f} MB/s")
    swapped = steady[0]["cache_hits"] + steady[0]["cache_misses"]
    t.add_row("swapped subgroups kept in memory (alternating order)", f"{med('cache_hits'):.0f} of {swapped}")
    t.add_row("subgroups on host / device lane", f"{med('host_lane_subgroups'):.0f} / {med('device_lane_subgroups'):.0f}")
    changes = [r for prev, r in zip(records, records[1:]) if r["knobs"] != prev["knobs"]]
    t.add_row("knob changes (tuner)", f"{len(changes)}" + (f", last at step {changes[-1]['iteration']}: "
                                                          f"{_knob_text(changes[-1]['knobs'])}" if changes else ""))
    return t


def _knob_text(knobs: dict) -> str:
    return ", ".join(f"{k} {v}" for k, v in knobs.items() if v not in ({}, None))


def print_summary(records: list[dict], console: Console | None = None, title: str = "update phase") -> None:
    if records:
        (console or Console()).print(summary_table(records, title))
