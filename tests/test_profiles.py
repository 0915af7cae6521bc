"""Hardware profiles: the strict TOML schema, real measurements, and `offloadctl profile`."""

from __future__ import annotations

import contextlib
import io
import json
import os
import re
import subprocess

import helpers
import pytest

from engine.errors import ConfigError, StoragePathError
from perf.probe import best_concurrency, measure_memory_bandwidth, measure_path, measure_paths, thread_counts
from perf.profile import SCHEMA_VERSION, AdamWRate, Figure, Gpu, Host, Machine, PathProfile, Profile, Source, SweepPoint
from perf.profile_toml import (
    dumps_profile,
    list_profiles,
    load_profile,
    loads_profile,
    profile_from_dict,
    profile_to_dict,
    resolve_profile,
    save_profile,
)
from perf.toml_lines import key_lines

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
EXAMPLES = sorted(os.path.join(ROOT, "profiles", f) for f in os.listdir(os.path.join(ROOT, "profiles")) if f.endswith(".toml"))
WHEN = "2025-06-01T12:00:00+00:00"


def fig(v: float, how: str = "hand-written for a test") -> Figure:
    return Figure(value=v, how=how, when=WHEN)


def sample_profile(name: str = "sample") -> Profile:
    sweep = tuple(
        SweepPoint(op=op, concurrency=c, block_bytes=8 << 20, bytes_per_s=fig(c * k * 1e8))
        for c in (1, 4)
        for k, op in enumerate(("read", "write", "mixed"), 1)
    )
    paths = (
        PathProfile(
            path="/local/nvme0",
            kind="nvme",
            device="nvme0n1",
            device_id="259:0",
            capacity_bytes=10**12,
            read_bytes_per_s=fig(4e8),
            write_bytes_per_s=fig(8e8),
            mixed_bytes_per_s=fig(1.2e9),
            best_concurrency=4,
            sweep=sweep,
        ),
        PathProfile(
            path="/lustre/me",
            kind="remote",
            device="lustre:fs1",
            device_id="0:51",
            capacity_bytes=5 * 10**12,
            read_bytes_per_s=fig(2.5e9),
            write_bytes_per_s=fig(1.5e9),
            mixed_bytes_per_s=fig(2e9),
            best_concurrency=8,
        ),
    )
    return Profile(
        schema_version=SCHEMA_VERSION,
        name=name,
        created=WHEN,
        notes='two lines\nand "quotes" [brackets]',
        source=Source(kind="measured", description="for tests", tool="offloadctl 0.1.0"),
        machine=Machine(
            hostname="node1",
            cpu_model="Some CPU",
            cores_physical=8,
            cores_logical=16,
            memory_bytes=64 << 30,
            numa_nodes=2,
            gpu_model="Some GPU",
            gpu_count=1,
        ),
        host=Host(
            memory_bandwidth=fig(2.0e10),
            adamw=(AdamWRate(threads=1, params_per_s=fig(5e8)), AdamWRate(threads=8, params_per_s=fig(3.3e9))),
        ),
        paths=paths,
        gpu=Gpu(
            model="Some GPU",
            memory_bytes=80 << 30,
            h2d_bytes_per_s=fig(2.5e10),
            d2h_bytes_per_s=fig(2.6e10),
            duplex_h2d_bytes_per_s=fig(2.0e10),
            duplex_d2h_bytes_per_s=fig(2.1e10),
            adamw_params_per_s=fig(1e11),
        ),
    )


def line_of(text: str, needle: str, nth: int = 0) -> int:
    """1-based line of the ``nth`` line containing ``needle``."""
    hits = [i + 1 for i, line in enumerate(text.splitlines()) if needle in line]
    return hits[nth]


def load_error(text: str, tmp_path, name: str = "bad.toml") -> str:
    p = tmp_path / name
    p.write_text(text)
    with pytest.raises(ConfigError) as e:
        load_profile(str(p))
    msg = str(e.value)
    assert str(p) in msg and "\n" not in msg
    return msg


# -- writing and reading ------------------------------------------------------------------------


def test_round_trip_save_load(tmp_path):
    p = sample_profile()
    out = save_profile(p, str(tmp_path / "sub" / "sample.toml"))
    assert load_profile(out) == p
    assert sorted(os.listdir(tmp_path / "sub")) == ["sample.toml"]  # no temporary file left behind
    text = open(out).read()
    # Figures are inline tables, one line each; the large numbers are short.
    assert 'memory_bandwidth = { value = 2e10, how = "hand-written for a test", when = "2025-06-01T12:00:00+00:00" }' in text
    assert "[[paths]]" in text and "[host]" in text and "[gpu]" in text


def test_round_trip_without_gpu_or_paths(tmp_path):
    p = Profile(**{**sample_profile().__dict__, "gpu": None, "paths": ()})
    assert "[gpu]" not in dumps_profile(p)
    assert loads_profile(dumps_profile(p)) == p
    assert profile_from_dict(profile_to_dict(p)) == p


def test_save_replaces_atomically(tmp_path):
    path = str(tmp_path / "p.toml")
    save_profile(sample_profile("one"), path)
    save_profile(sample_profile("two"), path)
    assert load_profile(path).name == "two"
    assert os.listdir(tmp_path) == ["p.toml"]


@pytest.mark.parametrize("path", EXAMPLES, ids=os.path.basename)
def test_example_profiles_load_and_say_they_are_not_measurements(path):
    p = load_profile(path)
    assert p.source.kind in ("datasheet", "estimate")  # never "measured"
    assert "not a measurement" in p.source.description
    text = open(path).read()
    assert "NOT A MEASUREMENT" in text.splitlines()[0]
    assert p.name == os.path.basename(path)[:-5]
    assert p.paths and p.host.adamw and p.host.memory_bandwidth.value > 0


def test_example_profiles_cover_datasheet_and_estimate():
    kinds = {load_profile(p).source.kind for p in EXAMPLES}
    assert kinds == {"datasheet", "estimate"}
    h100 = load_profile(os.path.join(ROOT, "profiles", "example-h100-node.toml"))
    assert h100.gpu is not None and "PM1743" in h100.paths[0].read_bytes_per_s.how


def test_key_lines_follow_tables_arrays_and_inline_tables():
    text = dumps_profile(sample_profile())
    lines = key_lines(text)
    assert lines["host"] == line_of(text, "[host]")
    assert lines["host.memory_bandwidth.value"] == line_of(text, "memory_bandwidth =")
    assert lines["host.adamw[1].params_per_s.how"] == line_of(text, "threads = 8")
    assert lines["paths[1]"] == line_of(text, "[[paths]]", 1)
    assert lines["paths[1].read_bytes_per_s.value"] == line_of(text, "read_bytes_per_s =", 1)
    assert lines["paths[0].sweep[4].bytes_per_s"] == line_of(text, 'op = "write", concurrency = 4')
    assert lines["gpu.adamw_params_per_s"] == line_of(text, "adamw_params_per_s")


def test_key_lines_of_hand_written_toml():
    text = '''# comment [not.a.table]
a = """multi
line = 3
"""
[t]  # comment
"quoted key" = 1
x.y = 'literal'
arr = [
  1,   # one
  { k = "}", j = [2, 3] },
]
[[t.items]]
v = 1979-05-27 07:32:00
[[t.items]]
v = 2
[[u]]
[[u.sub]]
w = 1
[[u]]
[[u.sub]]
w = 2
[u.sub.deep]
z = 3
'''
    lines = key_lines(text)
    assert lines["a"] == 2 and "line" not in lines
    assert lines["t"] == 5 and lines["t.quoted key"] == 6 and lines["t.x.y"] == 7
    assert lines["t.arr"] == 8 and lines["t.arr[0]"] == 9 and lines["t.arr[1].j"] == 10
    assert lines["t.items[0]"] == 12 and lines["t.items[0].v"] == 13 and lines["t.items[1].v"] == 15
    assert lines["u[0].sub[0].w"] == 18 and lines["u[1]"] == 19 and lines["u[1].sub[0].w"] == 21
    assert lines["u[1].sub[0].deep.z"] == 23


# -- strict schema: every error names the file, the key and its line ---------------------------


@pytest.fixture
def good_text():
    return dumps_profile(sample_profile())


def test_unknown_key_at_top_level(tmp_path, good_text):
    text = good_text.replace('name = "sample"\n', 'name = "sample"\ncolour = "blue"\n')
    msg = load_error(text, tmp_path)
    assert "key colour" in msg and f"line {line_of(text, 'colour')}" in msg and "remove it" in msg


def test_unknown_key_nested_in_inline_table(tmp_path, good_text):
    text = good_text.replace("write_bytes_per_s = { value = 8e8,", 'write_bytes_per_s = { value = 8e8, unit = "B/s",')
    msg = load_error(text, tmp_path)
    assert "key paths[0].write_bytes_per_s.unit" in msg
    assert f"line {line_of(text, 'unit =')}" in msg


def test_unknown_key_in_second_array_element(tmp_path, good_text):
    lines = good_text.splitlines()
    second = line_of(good_text, "[[paths]]", 1)
    lines.insert(second, "speed = 3")  # right below the second [[paths]] header
    text = "\n".join(lines) + "\n"
    msg = load_error(text, tmp_path)
    assert "key paths[1].speed" in msg and f"line {second + 1}" in msg


def test_wrong_type(tmp_path, good_text):
    text = good_text.replace("read_bytes_per_s = { value = 2.5e9,", 'read_bytes_per_s = { value = "fast",')
    msg = load_error(text, tmp_path)
    assert "key paths[1].read_bytes_per_s.value" in msg and "must be a number" in msg and "'fast'" in msg
    assert f"line {line_of(text, 'fast')}" in msg


def test_wrong_type_literal_array_and_table(tmp_path, good_text):
    msg = load_error(good_text.replace('kind = "measured"', 'kind = "guessed"'), tmp_path)
    assert "key source.kind" in msg and "'measured', 'datasheet', 'estimate'" in msg
    assert f"line {line_of(good_text, 'measured')}" in msg
    text = good_text.replace('cpu_model = "Some CPU"', 'cpu_model = ["Some", "CPU"]')
    msg = load_error(text, tmp_path)
    assert "key machine.cpu_model must be a string, got an array" in msg and f"line {line_of(text, 'cpu_model')}" in msg
    text = re.sub(r"mixed_bytes_per_s = \{ value = 2e9,[^\n]*", "mixed_bytes_per_s = 2e9", good_text)
    msg = load_error(text, tmp_path)
    assert "key paths[1].mixed_bytes_per_s must be a table, got a float" in msg
    assert f"line {line_of(text, 'mixed_bytes_per_s = 2e9')}" in msg


def test_bool_is_not_an_int_and_int_is_a_float(tmp_path, good_text):
    text = good_text.replace("cores_physical = 8", "cores_physical = true")
    msg = load_error(text, tmp_path)
    assert "key machine.cores_physical" in msg and "must be an integer, got a boolean" in msg
    assert f"line {line_of(text, 'cores_physical')}" in msg
    text = good_text.replace("value = 2e10,", "value = true,")
    msg = load_error(text, tmp_path)
    assert "key host.memory_bandwidth.value" in msg and "got a boolean" in msg
    # An integer where a float is expected is fine; a float where an integer is expected is not.
    ok = loads_profile(good_text.replace("value = 2e10,", "value = 20000000000,"))
    assert ok.host.memory_bandwidth.value == 2e10 and type(ok.host.memory_bandwidth.value) is float
    msg = load_error(good_text.replace("numa_nodes = 2", "numa_nodes = 2.0"), tmp_path)
    assert "key machine.numa_nodes" in msg and "must be an integer, got a float" in msg


def test_missing_field(tmp_path, good_text):
    text = good_text.replace("best_concurrency = 8\n", "")
    msg = load_error(text, tmp_path)
    assert "key paths[1].best_concurrency is missing" in msg and "add `best_concurrency = ...`" in msg
    assert f"line {line_of(text, '[[paths]]', 1)}" in msg  # the table it belongs in


def test_missing_field_of_inline_figure(tmp_path, good_text):
    text = re.sub(r'(threads = 8, params_per_s = \{ value = [^,]+), how = "[^"]*"', r"\1", good_text)
    msg = load_error(text, tmp_path)
    assert "key host.adamw[1].params_per_s.how is missing" in msg
    assert f"line {line_of(text, 'threads = 8')}" in msg


def test_missing_top_level_table(tmp_path, good_text):
    start = good_text.index("[machine]")
    end = good_text.index("[host]")
    msg = load_error(good_text[:start] + good_text[end:], tmp_path)
    assert "key machine is missing" in msg


def test_bad_schema_version(tmp_path, good_text):
    text = good_text.replace(f"schema_version = {SCHEMA_VERSION}", "schema_version = 99")
    msg = load_error(text, tmp_path)
    assert "key schema_version is 99" in msg and f"schema version {SCHEMA_VERSION} only" in msg and "line 1" in msg
    msg = load_error(good_text.replace(f"schema_version = {SCHEMA_VERSION}\n", ""), tmp_path)
    assert "key schema_version is missing" in msg
    msg = load_error(good_text.replace(f"schema_version = {SCHEMA_VERSION}", 'schema_version = "1"'), tmp_path)
    assert "key schema_version must be an integer" in msg and "line 1" in msg


def test_toml_syntax_error(tmp_path, good_text):
    text = good_text.replace("numa_nodes = 2", "numa_nodes = = 2")
    msg = load_error(text, tmp_path)
    assert "not valid TOML" in msg and f"line {line_of(text, 'numa_nodes')}" in msg


def test_figure_needs_provenance(tmp_path, good_text):
    msg = load_error(good_text.replace('how = "hand-written for a test"', 'how = " "', 1), tmp_path)
    assert "key host.memory_bandwidth.how is empty" in msg
    msg = load_error(good_text.replace(f'when = "{WHEN}"', 'when = "last tuesday"', 1), tmp_path)
    assert "key host.memory_bandwidth.when" in msg and "ISO 8601" in msg
    msg = load_error(good_text.replace("value = 2e10,", "value = -1.0,"), tmp_path)
    assert "key host.memory_bandwidth.value" in msg and "0 or more" in msg
    msg = load_error(good_text.replace("value = 2e10,", "value = nan,"), tmp_path)
    assert "finite" in msg


def test_missing_file_and_unknown_name(tmp_path, monkeypatch):
    monkeypatch.setenv("OFFLOADCTL_PROFILE_DIR", str(tmp_path))
    with pytest.raises(ConfigError, match=r"profile file .*nowhere\.toml does not exist"):
        load_profile(str(tmp_path / "nowhere.toml"))
    save_profile(sample_profile("alpha"), str(tmp_path / "alpha.toml"))
    save_profile(sample_profile("beta"), str(tmp_path / "beta.toml"))
    with pytest.raises(ConfigError) as e:
        resolve_profile("gamma")
    assert "no profile named 'gamma'" in str(e.value) and "available: alpha, beta" in str(e.value)
    assert "offloadctl profile save gamma" in str(e.value)
    assert resolve_profile("beta") == str(tmp_path / "beta.toml")
    assert load_profile("alpha").name == "alpha"
    assert list_profiles() == ["alpha", "beta"]


# -- measurements -------------------------------------------------------------------------------


def test_measure_path_tiny(tmp_path):
    d = tmp_path / "nvme0"
    d.mkdir()
    st = os.stat(d)
    seen = []
    p = measure_path(
        str(d),
        io_bytes=8 << 20,
        io_seconds=0.03,
        concurrencies=(1, 2),
        block_sizes=(1 << 20, 256 << 10),
        progress=lambda what, done, total: seen.append((done, total)),
    )
    assert p.device_id == f"{os.major(st.st_dev)}:{os.minor(st.st_dev)}"
    assert p.device and p.capacity_bytes > 0 and p.kind == "nvme" and p.path == str(d)
    assert len(p.sweep) == 2 * 2 * 3 and all(s.bytes_per_s.value > 0 for s in p.sweep)
    assert {(s.op, s.concurrency, s.block_bytes) for s in p.sweep} == {
        (op, c, b) for op in ("read", "write", "mixed") for c in (1, 2) for b in (1 << 20, 256 << 10)
    }
    for op in ("read", "write", "mixed"):
        best = max(s.bytes_per_s.value for s in p.sweep if s.op == op)
        assert getattr(p, f"{op}_bytes_per_s").value == best > 0
    assert p.best_concurrency in (1, 2)
    assert "O_DIRECT" in p.read_bytes_per_s.how and p.read_bytes_per_s.when
    assert seen[-1] == (13, 13) and [d for d, _ in seen] == sorted(d for d, _ in seen)
    assert os.listdir(d) == []  # the probe file and its directory are gone


def test_two_paths_on_one_device_share_its_id_and_figures(tmp_path):
    a, b = tmp_path / "a", tmp_path / "b"
    a.mkdir(), b.mkdir()
    swept = []
    pa, pb = measure_paths(
        [(str(a), "nvme"), (str(b), "remote")],
        io_bytes=4 << 20,
        io_seconds=0.02,
        concurrencies=(1,),
        block_sizes=(1 << 20,),
        progress=lambda w, d, t: swept.append(w),
    )
    assert pa.device_id == pb.device_id and pa.device == pb.device
    assert pb.kind == "remote" and pb.path == str(b)
    assert pb.read_bytes_per_s.value == pa.read_bytes_per_s.value
    assert f"same device as {a}" in pb.read_bytes_per_s.how
    assert {w for w in swept} == {f"I/O sweep {a}"}  # measured once
    prof = Profile(**{**sample_profile().__dict__, "paths": (pa, pb)})
    assert list(prof.devices().values()) == [[pa, pb]]


def test_measure_path_errors(tmp_path):
    with pytest.raises(StoragePathError, match="does not exist"):
        measure_path(str(tmp_path / "missing"))
    with pytest.raises(ConfigError, match="multiple of 4096"):
        measure_path(str(tmp_path), block_sizes=(1000,))


def test_best_concurrency_is_smallest_within_5_percent():
    pts = [
        SweepPoint(op=op, concurrency=c, block_bytes=8 << 20, bytes_per_s=fig(v))
        for op, c, v in (
            ("read", 1, 50),
            ("read", 2, 96),
            ("read", 4, 100),
            ("write", 1, 80),
            ("write", 2, 70),
            ("write", 4, 100),
            ("read", 8, 99),
            ("write", 8, 97),
        )
    ]
    assert best_concurrency(pts) == 4
    pts = [p for p in pts if p.concurrency != 4]
    assert best_concurrency(pts) == 8


def test_host_figures():
    f = measure_memory_bandwidth(32 << 20, reps=2)
    assert f.value > 1e8 and "copy" in f.how
    assert thread_counts(1) == [1] and thread_counts(2) == [1, 2] and thread_counts(12) == [1, 2, 4, 8, 12]


# -- the command --------------------------------------------------------------------------------


def cli(*args: str) -> tuple[int, str, str]:
    from offloadctl.cli import main

    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        rc = main(list(args))
    return rc, out.getvalue(), err.getvalue()


def run_cli(*args: str, env: dict) -> subprocess.CompletedProcess:
    return helpers.cli(*args, timeout=300, env=helpers.env_with_root(**env))


@pytest.mark.slow
def test_cli_save_show_list_diff(tmp_path, monkeypatch):
    pdir = tmp_path / "profiles"
    data = tmp_path / "data"
    data.mkdir()
    env = {"OFFLOADCTL_PROFILE_DIR": str(pdir)}
    monkeypatch.setenv("OFFLOADCTL_PROFILE_DIR", str(pdir))
    monkeypatch.setenv("COLUMNS", "250")
    out = run_cli("profile", "save", "mine", "--quick", "--nvme", str(data), "--io-bytes", "16M", "--io-seconds", "0.01", env=env)
    assert out.returncode == 0, out.stderr
    assert f"wrote profile mine to {pdir / 'mine.toml'}" in out.stdout
    assert "I/O sweep" in out.stderr  # the progress bars
    mine = load_profile("mine")
    assert mine.source.kind == "measured" and mine.source.tool.startswith("offloadctl ")
    assert mine.paths[0].path == str(data) and mine.host.adamw[0].threads == 1 and mine.gpu is None
    # Saving over it needs --force, and fails before measuring anything.
    rc, _, err = cli("profile", "save", "mine", "--nvme", str(data))
    assert rc == 2 and "pass --force" in err and "mine.toml exists" in err

    rc, text, _ = cli("profile", "show", "mine", "--json")
    assert rc == 0 and profile_from_dict(json.loads(text)) == mine
    rc, text, _ = cli("profile", "show", "mine", "--sweep")
    assert rc == 0 and str(data) in text and "c=16" in text

    save_profile(sample_profile("other"), str(pdir / "other.toml"))
    (pdir / "broken.toml").write_text("schema_version = 1\nname = [\n")
    rc, text, _ = cli("profile", "list", "--json")
    listing = {r["name"]: r for r in json.loads(text)["profiles"]}
    assert rc == 0 and sorted(listing) == ["broken", "mine", "other"]
    assert listing["mine"]["source"] == "measured" and listing["mine"]["paths"] == [str(data)]
    assert listing["other"]["host"] == "node1" and listing["other"]["gpu"] == "Some GPU"
    assert "not valid TOML" in listing["broken"]["error"]
    rc, text, _ = cli("profile", "list")
    assert rc == 0 and "invalid" in text and "mine" in text

    rc, text, _ = cli("profile", "diff", "mine", "other", "--json")
    d = json.loads(text)
    assert rc == 0 and d["a"]["name"] == "mine" and d["b"]["source"] == "measured"
    rows = {r["key"]: r for r in d["figures"]}
    mem = rows["host.memory_bandwidth"]
    assert mem["b"] == 2e10 and mem["ratio"] == pytest.approx(2e10 / mine.host.memory_bandwidth.value)
    assert rows["path #1 read"]["a"] == mine.paths[0].read_bytes_per_s.value  # paths paired by order
    assert rows["gpu.h2d_bytes_per_s"]["a"] is None and rows["gpu.h2d_bytes_per_s"]["ratio"] is None
    assert {"key": "machine.hostname", "a": mine.machine.hostname, "b": "node1"} in d["machine"]
    rc, text, _ = cli("profile", "diff", "other", str(pdir / "other.toml"))
    assert rc == 0 and "1.00x" in text and "/local/nvme0 read" in text  # same paths keep their names


def test_cli_show_example_tables(monkeypatch):
    monkeypatch.setenv("COLUMNS", "250")
    rc, text, _ = cli("profile", "show", os.path.join(ROOT, "profiles", "example-h100-node.toml"))
    assert rc == 0 and "datasheet (not a measurement)" in text and "PM1743" in text
    assert "host.adamw[threads=112]" in text  # brackets are not taken as markup


def test_cli_bad_toml_is_one_line_exit_2(tmp_path):
    bad = tmp_path / "bad.toml"
    bad.write_text(dumps_profile(sample_profile()).replace("numa_nodes = 2", "numa_nodes = 'two'"))
    out = run_cli("profile", "show", str(bad), env={"OFFLOADCTL_PROFILE_DIR": str(tmp_path)})
    assert out.returncode == 2 and "Traceback" not in out.stderr
    err = out.stderr.strip().splitlines()
    assert len(err) == 1 and "key machine.numa_nodes must be an integer" in err[0] and str(bad) in err[0]


def test_cli_unknown_name_and_missing_dir(tmp_path, monkeypatch):
    monkeypatch.setenv("OFFLOADCTL_PROFILE_DIR", str(tmp_path))
    rc, _, err = cli("profile", "show", "nosuch")
    assert rc == 2 and len(err.strip().splitlines()) == 1 and "no profile named 'nosuch'" in err
    rc, _, err = cli("profile", "diff", "nosuch", os.path.join(ROOT, "profiles", "example-cpu-vm.toml"))
    assert rc == 2 and "no profile named 'nosuch'" in err
    rc, _, err = cli("profile", "list", "--dir", str(tmp_path / "missing"))
    assert rc == 2 and "does not exist" in err
    rc, out, _ = cli("profile", "list", "--dir", os.path.join(ROOT, "profiles"), "--json")
    rows = json.loads(out)["profiles"]
    assert rc == 0 and {r["name"] for r in rows} == {"example-cpu-vm", "example-h100-node"}
    assert {r["source"] for r in rows} == {"datasheet", "estimate"}


def test_cli_rejects_bad_names(tmp_path, monkeypatch):
    monkeypatch.setenv("OFFLOADCTL_PROFILE_DIR", str(tmp_path))
    rc, _, err = cli("profile", "save", "../escape", "--nvme", str(tmp_path))
    assert rc == 2 and "not usable as a file name" in err
    rc, _, err = cli("profile", "save", "x", "--nvme", str(tmp_path), "--nvme", str(tmp_path))
    assert rc == 2 and "given twice" in err
    assert os.listdir(tmp_path) == []
