"""What `offloadctl plan` and `offloadctl profile` print fits the terminal: every line within 80
columns at COLUMNS=80 (160 at 160), no cell cut short, one notation for numbers, plans that do
not fit shown as such and ranked last, and help that speaks to users."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys

import pytest
from test_profiles import sample_profile

from engine.units import format_count, format_rate, format_seconds, format_size, tidy_numbers
from perf.profile_toml import save_profile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
H100 = os.path.join(ROOT, "profiles", "example-h100-node.toml")
CPU_VM = os.path.join(ROOT, "profiles", "example-cpu-vm.toml")
TIME = re.compile(r"\d(?: s| ms| µs)\b")
"""A time as the tables print one."""


def offloadctl(*args: str, columns: int = 80) -> str:
    out = subprocess.run(
        [sys.executable, "-m", "offloadctl.cli", *args],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=ROOT,
        env={**os.environ, "PYTHONPATH": ROOT, "COLUMNS": str(columns)},
    )
    assert out.returncode == 0, out.stderr
    assert out.stderr == ""
    return out.stdout


def assert_fits(text: str, columns: int = 80, *, numbers: str | None = None) -> None:
    """Every line of ``text`` within ``columns``, no cell cut short; and in ``numbers`` (default:
    all of ``text``; a profile's own prose is not ours to rewrite) no exponent notation and no
    powers of 1024."""
    lines = text.splitlines()
    assert lines
    too_wide = [line for line in lines if len(line) > columns]
    assert not too_wide, "\n".join(too_wide)
    assert "…" not in text, text  # rich's mark of a cell cut short
    numbers = text if numbers is None else numbers
    assert not re.search(r"\d[eE][+-]?\d", numbers), numbers
    assert not re.search(r"\b(GiB|TiB|MiB|KiB)\b", numbers), numbers


def plan_json(*args: str) -> dict:
    return json.loads(offloadctl("plan", *args, "--json"))


def table_rows(text: str) -> list[str]:
    """The rows of the first table in ``text``: the lines between its header rule and the next
    header or blank line."""
    lines = text.splitlines()
    start = next(i for i, line in enumerate(lines) if set(line.strip()) == {"─"}) + 1
    rows = []
    for line in lines[start:]:
        if not line.strip() or line.startswith(("plan ", "host, disk:", "best conc.:")):
            break
        rows.append(line)
    return rows


# -- offloadctl plan ------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "profile,params,ranks",
    [(H100, "125M", "8"), (H100, "7B", "8"), (H100, "70B", "8"), (H100, "1T", "8"), (CPU_VM, "125M", "1"), (CPU_VM, "7B", "1")],
)
def test_plan_fits_80_columns_with_every_plan_name_whole(profile, params, ranks):
    from offloadctl.commands.plan import plan_label

    args = ("--profile", profile, "--params", params, "--ranks", ranks, "--fwd-bwd-s", "2")
    text = offloadctl("plan", *args)
    assert_fits(text)
    assert text.splitlines()[0].startswith(f"{params} params, {ranks} rank")
    rows = table_rows(text)
    names = [p["name"] for p in plan_json(*args)["plans"]]
    assert len(rows) == len(names)
    labels = {plan_label(n) for n in names}
    assert len(labels) == len(names)  # short names still tell the plans apart
    assert {label for label in labels if any(row.startswith(label + " ") for row in rows)} == labels


def test_plan_at_160_columns_is_one_table():
    text = offloadctl("plan", "--profile", H100, "--params", "70B", "--ranks", "8", columns=160)
    assert_fits(text, 160)
    headers = [line for line in text.splitlines() if line.startswith("plan ")]
    assert len(headers) == 1 and all(h in headers[0] for h in ("prefetch", "conc.", "iteration", "bottleneck"))
    narrow = offloadctl("plan", "--profile", H100, "--params", "70B", "--ranks", "8")
    assert len([line for line in narrow.splitlines() if line.startswith("plan ")]) == 2


def test_plans_that_do_not_fit_say_so_and_rank_last():
    args = ("--profile", H100, "--params", "1T", "--ranks", "8")
    data = plan_json(*args)
    unfit = [p for p in data["plans"] if not p["feasible"]]
    assert unfit and len(unfit) < len(data["plans"])
    # The model still has a time for them (what they would take with the memory): not shown.
    assert any(p["iteration_s"] is not None and p["iteration_s"] < data["plans"][0]["iteration_s"] for p in unfit)
    text = offloadctl("plan", *args)
    rows = table_rows(text)
    fits = ["does not fit" not in row for row in rows]
    assert fits == sorted(fits, reverse=True) and fits.count(False) == len(unfit), rows
    for row in rows:
        assert ("does not fit" in row) != bool(TIME.search(row)), row
    assert rows[0].startswith("best ")
    fitting = [row for row in rows if "does not fit" not in row]
    seconds = [_seconds(row) for row in fitting]
    assert seconds == sorted(seconds)  # by iteration time, fastest first
    for p in unfit:  # and why, in one of the notes
        assert re.search(rf"^{re.escape(p['label'])} does not fit: needs \S+ [KMGT]?B", text, re.MULTILINE), text


def _seconds(row: str) -> float:
    """The iteration time of a table row: the second time in it."""
    value, unit = re.findall(r"([\d,.]+) (s|ms|µs)\b", row)[1]
    return float(value.replace(",", "")) * {"s": 1, "ms": 1e-3, "µs": 1e-6}[unit]


def test_plan_json_keeps_every_field_and_adds_the_label():
    data = plan_json("--profile", H100, "--params", "7B", "--ranks", "8")
    for p in data["plans"]:
        assert {
            "name",
            "label",
            "plan",
            "update_s",
            "iteration_s",
            "breakdown",
            "bytes_per_param",
            "bottleneck",
            "notes",
            "feasible",
            "memory",
        } <= set(p)
    assert data["workload"]["params"] == 7 * 10**9 and data["best"] == data["plans"][0]["name"] == "best"


# -- offloadctl profile ---------------------------------------------------------------------------


@pytest.fixture
def profile_dir(tmp_path):
    d = tmp_path / "profiles"
    save_profile(sample_profile("sample"), str(d / "sample.toml"))
    return d


@pytest.mark.parametrize("path", [H100, CPU_VM])
def test_profile_show_fits_80_columns_in_powers_of_1000(path):
    text = offloadctl("profile", "show", path)
    tables = text[text.index("\nmachine ") : text.index("\nfigure ")]
    values = "\n".join(line[:46] for line in text[text.index("\nfigure ") :].splitlines())  # not the how column
    assert_fits(text, numbers=tables + values)
    rows = table_rows(text.split("storage path", 1)[1])
    one_line = re.compile(r"^/\S+ +(nvme|remote) +\S+ +[\d.]+ [KMGT]B( +[\d.,]+){4}$")
    assert rows and all(one_line.match(row) for row in rows), rows  # one line per path, every cell on it
    if path == H100:
        assert "memory      2.2 TB" in text and "7.68 TB" in rows[0]
        assert re.search(r"path /local/nvme0 read\s+13 GB/s", text)


def test_profile_show_sweep_list_and_diff_fit_80_columns(profile_dir):
    sample = str(profile_dir / "sample.toml")
    text = offloadctl("profile", "show", sample, "--sweep")
    assert_fits(text, numbers=text.replace("[brackets]", ""))
    assert "path /local/nvme0 read c=4 8.39 MB" in text  # 8 MiB blocks, in MB
    listing = offloadctl("profile", "list", "--dir", str(profile_dir))
    assert_fits(listing)
    assert re.search(r"^sample\s+measured\s+2025-06-01\s+node1\s+/local/nvme0$", listing, re.MULTILINE), listing
    diff = offloadctl("profile", "diff", H100, sample)
    assert_fits(diff)
    assert re.search(r"machine\.memory\s+2\.2 TB\s+68\.7 GB", diff), diff


# -- help -----------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "command", [("plan",), ("profile",), ("profile", "save"), ("profile", "show"), ("profile", "list"), ("profile", "diff")]
)
def test_help_fits_80_columns_and_names_no_modules(command):
    text = offloadctl(*command, "--help")
    too_wide = [line for line in text.splitlines() if len(line) > 80]
    assert not too_wide, "\n".join(too_wide)
    assert "``" not in text
    assert not re.search(r"\b(engine|perf|tuner|report|integrations)\.[a-z_]+", text), text


# -- the notation ---------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "value,text",
    [
        (0, "0 B"),
        (512, "512 B"),
        (1.5e9, "1.5 GB"),
        (550e9, "550 GB"),
        (1.099e12, "1.1 TB"),
        (10.616e12, "10.6 TB"),
        (12e12, "12 TB"),
        (999.6e9, "1 TB"),
        (80 << 30, "85.9 GB"),
        (None, "-"),
    ],
)
def test_format_size(value, text):
    assert format_size(value) == text


def test_format_rate_count_seconds_and_tidy():
    assert [format_rate(v) for v in (13e9, 850e6, 1.25e9)] == ["13 GB/s", "850 MB/s", "1.25 GB/s"]
    assert format_rate(1.07e9, "params/s") == "1.07G params/s"
    assert [format_count(n) for n in (125e6, 7e9, 70e9, 1e12, 1.5e12)] == ["125M", "7B", "70B", "1T", "1.5T"]
    assert [format_seconds(s) for s in (1093.4, 7.55, 0.00729, 0.00013, float("inf"))] == [
        "1,093 s",
        "7.55 s",
        "7.29 ms",
        "130 µs",
        "-",
    ]
    assert (
        tidy_numbers("needs 1.2e+04 GB on /local/nvme0, over 7.68e+03 GB; 2 of 11058")
        == "needs 12 TB on /local/nvme0, over 7.68 TB; 2 of 11,058"
    )
