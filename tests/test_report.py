"""`offloadctl report` on real runs (offloadctl's engine, and `--engine stock`), its files and its errors.

The two real runs (examples/train_gpt.py under `offloadctl train`, CPU) are made once per module.
"""

from __future__ import annotations

import json
import os
import shutil
import struct
import time

import pytest
import torch
from ds_runs import GPT, GPT_RECORDED, Launch
from helpers import ROOT, cli

# Real `offloadctl train` runs, processes and signals: minutes; `pytest -m "not slow"` skips them.
pytestmark = pytest.mark.slow

SECTIONS = ("breakdown", "timeline", "bytes", "cache", "compare")
ONE_RUN_SECTIONS = ("breakdown", "timeline", "bytes", "cache")


@pytest.fixture(scope="module")
def runs(ds_runs):
    """An offloadctl run (all state on an NVMe path) and a stock DeepSpeed run of the same script."""
    ours = ds_runs.get(GPT_RECORDED).ok()
    assert f"recorded: offloadctl report {ours.run_dir}" in ours.stdout
    stock = ds_runs.get(
        Launch("ours", 1, ("--steps", "4", "--batch", "8"), script=GPT, opts=("--engine", "stock", "--run-dir", "{dir}/stock"))
    ).ok()
    assert "engine active" not in stock.stderr  # DeepSpeed's own optimizer ran
    return {"ours": str(ours.run_dir), "stock": str(stock.run_dir), "nvme": str(ours.nvme)}


def _png_size(path: str) -> tuple[int, int]:
    with open(path, "rb") as f:
        head = f.read(24)
    assert head[:8] == b"\x89PNG\r\n\x1a\n", f"{path} is not a PNG"
    return struct.unpack(">II", head[16:24])


def _report_json(*args) -> dict:
    out = cli("report", *args, "--json")
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout)


def test_report_of_a_real_run(runs, tmp_path):
    html, png = tmp_path / "r.html", tmp_path / "png"
    t0 = time.perf_counter()
    data = _report_json(runs["ours"], "--output", str(html), "--png", str(png))
    assert time.perf_counter() - t0 < 60
    [run] = data["runs"]
    assert run["engine"] == "offloadctl" and run["status"] == "finished"
    # One run: nothing to compare it with, and its one rank is not "rank 0 of ranks [0]".
    assert run["summary"]["speedup_vs_first"] is None
    # Samples and tokens: train_gpt.py's batch of 8 sequences of 64 tokens, per iteration.
    assert all((i["samples"], i["tokens"]) == (8, 8 * 64) for i in run["iterations"])
    s = run["summary"]
    assert s["samples_per_s"] == pytest.approx(8 / s["median_iter_s"])
    assert s["tokens_per_s"] == pytest.approx(8 * 64 / s["median_iter_s"])
    assert sum(v for _, v in s["shares"]) == pytest.approx(1.0, abs=1e-6)
    assert s["verdict"]
    # The phases' bytes add up to the iteration's total (the same means, the same units).
    if s["disk_bytes_per_param_total"] is not None:
        assert s["disk_bytes_per_param_total"] == pytest.approx(
            sum(v for ph in s["disk_bytes_per_param"].values() for rw in ph.values() for v in rw.values())
        )
    its = run["iterations"]
    assert [i["iteration"] for i in its] == [0, 1, 2, 3, 4]
    for i in its:
        # Every phase is there, and the recorded spans cover the iteration to within 5%.
        assert all(i["phases"][p] > 0 for p in ("forward", "backward", "update")), i["phases"]
        assert i["measured_share"] >= 0.95, i
        assert abs(sum(i["segments"].values()) - i["iter_s"]) < 1e-6
        # The engine's parts, timed inside the engine, fit in the DeepSpeed step span timed outside it.
        assert i["segments"]["update_other"] >= -1e-4, i["segments"]
        assert i["engine_update_s"] <= i["phases"]["update"] + 1e-4
    # Bytes per tier: the engine's telemetry, as the engine wrote it.
    tel = [json.loads(line) for line in open(os.path.join(runs["ours"], "telemetry-rank0.jsonl"))]
    assert len(tel) == len(its)
    for i, t in zip(its, tel):
        assert i["engine_iteration"] == t["iteration"]
        assert i["engine_bytes"]["nvme"] == {"read": t["bytes_read"]["nvme"], "written": t["bytes_written"]["nvme"]}
        assert i["cache"] == {"hits": t["cache_hits"], "misses": t["cache_misses"]}
        assert i["engine_bytes_per_param"]["nvme"]["read"] == pytest.approx(t["bytes_read"]["nvme"] / t["params"])
    assert sum(t["bytes_read"]["nvme"] for t in tel[1:]) > 0
    # The kernel's counters of the tier's disk saw at least what the engine moved (O_DIRECT), over
    # the iterations' phases. Writes drain behind the update, into the next forward and backward
    # (the tail of an update's writes lands in its own update or in the next iteration, as the
    # timing falls), and the next step waits for them: by the end of iteration k, the disk has seen
    # every byte the engine wrote up to iteration k-1, and read up to iteration k.
    [tier] = run["tiers"]
    if tier["device"]:
        label = next(iter(its[1]["disk_bytes"]["update"]))
        disk = {k: [sum(ph[label][k] for ph in i["disk_bytes"].values()) for i in its] for k in ("read", "written")}
        engine = {k: [i["engine_bytes"]["nvme"][k] for i in its] for k in ("read", "written")}
        for k in range(1, len(its) + 1):
            assert sum(disk["read"][:k]) >= 0.95 * sum(engine["read"][:k]), ("read", k, disk, engine)
            if k < len(its):  # the last iteration's tail lands at the run's close, after every iteration
                assert sum(disk["written"][: k + 1]) >= 0.95 * sum(engine["written"][:k]), ("written", k, disk, engine)
    # The timeline: sampled series on the iteration's clock, GPU series absent (not zero) without CUDA.
    tl = run["timeline"]
    assert tl["iteration"] == run["summary"]["median_iteration"]
    assert len(tl["series"]["t"]) >= 2 and len(tl["series"]["rss_bytes"]) == len(tl["series"]["t"])
    assert {s[0] for s in tl["phase_spans"]} == {"forward", "backward", "update"}
    assert [s[0] for s in tl["update_spans"]] == ["write_wait", "update_loop", "device_wait"]
    if not torch.cuda.is_available():
        assert "gpu_allocated_bytes" not in tl["series"] and "pcie_tx_bytes_per_s" not in tl["series"]
        assert any("GPU memory: not recorded" in m for m in tl["missing"])
    # One plot per section, as files and inside the page.
    assert sorted(data["files"]["png"]) == sorted(ONE_RUN_SECTIONS)
    for name in ONE_RUN_SECTIONS:
        w, h = _png_size(str(png / f"{name}.png"))
        assert w >= 800 and h >= 200, (name, w, h)
    page = html.read_text()
    assert page.count("data:image/png;base64,") == len(ONE_RUN_SECTIONS)
    assert "of ranks" not in page and "speed vs the first run" not in page and "baseline" not in page
    assert s["verdict"] in page.replace("&#x27;", "'")
    assert "http://" not in page and "https://" not in page and "<script" not in page  # opens offline


def test_stock_and_offloadctl_side_by_side(runs, tmp_path):
    data = _report_json(runs["stock"], runs["ours"], "--png", str(tmp_path / "png"))
    stock, ours = data["runs"]
    assert (stock["engine"], ours["engine"]) == ("stock", "offloadctl")
    assert data["baseline"] == stock["label"]
    assert stock["summary"]["speedup_vs_first"] == 1.0
    assert ours["summary"]["speedup_vs_first"] == pytest.approx(
        stock["summary"]["median_iter_s"] / ours["summary"]["median_iter_s"]
    )
    assert [i["iteration"] for i in stock["iterations"]] == [0, 1, 2, 3]
    for i in stock["iterations"]:
        assert "engine_bytes" not in i and i["measured_share"] >= 0.95
        # DeepSpeed's own per-subgroup optimizer step (CPU Adam), timed inside its update.
        assert 0 < i["segments"]["host_lane"] < i["phases"]["update"]
    assert stock["tiers"] == [] and stock["offload_optimizer"]["device"] == "cpu"
    assert stock["summary"]["disk_bytes_per_param_total"] is None  # no tier: nothing to count, not zero
    assert os.path.getsize(tmp_path / "png" / "compare.png") > 5000
    assert sorted(data["files"]["png"]) == sorted(SECTIONS)
    out = cli("report", runs["stock"], runs["ours"], "--output", str(tmp_path / "both.html"))
    assert out.returncode == 0, out.stderr
    assert "stock (stock)" in out.stdout and "ours (offloadctl)" in out.stdout and "speed vs the first run" in out.stdout
    assert f"report: {tmp_path / 'both.html'}" in out.stdout


def test_chosen_iteration_and_default_output(runs, tmp_path):
    run_dir = tmp_path / "copy"
    shutil.copytree(runs["ours"], run_dir)
    data = _report_json(str(run_dir), "--iteration", "0")
    assert data["runs"][0]["timeline"]["iteration"] == 0
    out = cli("report", str(run_dir))
    assert out.returncode == 0 and (run_dir / "report.html").exists()
    assert "speed vs the first run" not in out.stdout and "bottleneck: " in out.stdout
    bad = cli("report", str(run_dir), "--iteration", "99")
    _one_line_error(bad, r"recorded iterations 0\.\.4: --iteration 99 is not among them")


def test_a_crashed_run_still_reports(runs, tmp_path):
    """The record as a killed run leaves it: no end line, the last line cut mid-write."""
    run_dir = tmp_path / "crashed"
    shutil.copytree(runs["ours"], run_dir)
    rec = run_dir / "record-rank0.jsonl"
    lines = rec.read_text().splitlines(keepends=True)
    assert json.loads(lines[-1])["type"] == "end"
    rec.write_text("".join(lines[:-2]) + lines[-2][: len(lines[-2]) // 2])
    samples = run_dir / "samples-rank0.jsonl"
    samples.write_text(samples.read_text()[:-7])
    data = _report_json(str(run_dir), "--png", str(tmp_path / "png"))
    [run] = data["runs"]
    assert run["status"].startswith("ended without an end record at iteration 4")
    assert [i["iteration"] for i in run["iterations"]] == [0, 1, 2, 3]
    assert any("cut short" in n for n in run["notes"])
    assert all((tmp_path / "png" / f"{s}.png").exists() for s in ONE_RUN_SECTIONS)


def _one_line_error(out, pattern):
    import re

    assert out.returncode == 2, (out.returncode, out.stdout[-2000:], out.stderr[-2000:])
    assert "Traceback" not in out.stderr, out.stderr[-3000:]
    assert len(out.stderr.strip().splitlines()) == 1, out.stderr
    assert re.search(pattern, out.stderr), out.stderr


def test_errors_are_one_line(runs, tmp_path):
    empty = tmp_path / "empty"
    empty.mkdir()
    _one_line_error(cli("report", str(empty)), r"is empty: no run recorded there")
    foreign = tmp_path / "foreign"
    foreign.mkdir()
    (foreign / "notes.txt").write_text("hello")
    _one_line_error(cli("report", str(foreign)), r"is not an offloadctl run directory")
    _one_line_error(cli("report", str(tmp_path / "missing")), r"does not exist")
    fake = tmp_path / "fake"
    fake.mkdir()
    (fake / "record-rank0.jsonl").write_text('{"some": "json"}\n')
    _one_line_error(cli("report", str(fake)), r"is not an offloadctl record")
    old = tmp_path / "telemetry-only"
    old.mkdir()
    shutil.copy(os.path.join(runs["ours"], "telemetry-rank0.jsonl"), old)
    _one_line_error(cli("report", str(old)), r"has the engine's telemetry but no record")
    # Partial: the header and init only (the run died in its first iteration).
    partial = tmp_path / "partial"
    partial.mkdir()
    lines = open(os.path.join(runs["ours"], "record-rank0.jsonl")).readlines()
    (partial / "record-rank0.jsonl").write_text("".join(lines[:2]))
    _one_line_error(cli("report", str(partial)), r"recorded no complete iteration")
    (partial / "record-rank0.jsonl").write_text(lines[0])
    _one_line_error(cli("report", str(partial)), r"stopped before deepspeed.initialize returned")
    # Damaged before its last line: nothing after it can be trusted.
    damaged = tmp_path / "damaged"
    damaged.mkdir()
    (damaged / "record-rank0.jsonl").write_text("".join(lines[:3]) + "{not json\n" + "".join(lines[3:]))
    _one_line_error(cli("report", str(damaged)), r"record-rank0.jsonl:4: not a JSON line")
    _one_line_error(cli("report", runs["ours"], "--rank", "3"), r"no record of rank 3 \(ranks recorded: 0\)")


def test_engine_stock_launch(tmp_path):
    script = os.path.join(ROOT, "tests", "ds_scripts", "train_tiny.py")
    out = cli("train", "--dry-run", "--json", "--engine", "stock", "--record-hz", "5", "--run-dir", str(tmp_path / "run"), script)
    assert out.returncode == 0, out.stderr
    plan = json.loads(out.stdout)
    assert plan["settings"]["engine"] == "stock" and plan["tuner"] == "off"
    assert plan["settings"]["recorder"] == {
        "run_dir": str(tmp_path / "run"),
        "engine": "stock",
        "sample_hz": 5.0,
        "max_rows": 360000,
    }
    _one_line_error(
        cli("train", "--engine", "stock", "--nvme", str(tmp_path), script),
        r"--engine stock runs DeepSpeed's own optimizer .* --nvme does not apply",
    )
    _one_line_error(cli("train", "--record-hz", "-1", script), r"--record-hz must be")
    off = json.loads(cli("train", "--dry-run", "--json", "--no-record", script).stdout)
    assert off["settings"]["recorder"] is None and off["settings"]["engine"] == "offloadctl"


class _FakeOptimizer:
    overflow = False


class _FakeEngine:
    """What the recorder touches of a DeepSpeedEngine, with gradient accumulation over 2 micro-batches."""

    def __init__(self):
        self.optimizer = _FakeOptimizer()
        self.module = torch.nn.Linear(4, 4)
        self.global_steps = 0
        self.micro = 0
        self.device = torch.device("cpu")

    def forward(self, x, input_ids=None):
        time.sleep(0.02)
        return x

    def backward(self, loss):
        time.sleep(0.03)

    def step(self):
        self.micro += 1
        if self.micro % 2 == 0:
            time.sleep(0.01)
            self.global_steps += 1

    def zero_optimization_stage(self):
        return 3


def _train(rec, eng, *, iterations: int, micro_batches: int) -> None:
    """Drive a fake engine through ``iterations`` optimizer steps under the recorder, then close
    it; every micro-batch has 4 sequences of 16 token ids (and a float input before them)."""
    from integrations.ds_patches import attach_recorder

    attach_recorder(eng, rec)
    for _ in range(iterations):
        for _ in range(micro_batches):
            eng.backward(eng.forward(torch.ones(2, 3), input_ids=torch.zeros(4, 16, dtype=torch.long)))
            eng.step()
    rec.close()


def test_recorder_spans_with_gradient_accumulation(tmp_path):
    from report.analyze import analyze
    from report.load import load_run
    from report.recorder import Recorder, RecorderConfig

    rec = Recorder(RecorderConfig(run_dir=str(tmp_path), engine="stock", sample_hz=50), rank=0, script="fake.py")
    eng = _FakeEngine()
    _train(rec, eng, iterations=3, micro_batches=2)
    lines = [json.loads(x) for x in open(tmp_path / "record-rank0.jsonl")]
    assert [x["type"] for x in lines] == ["header", "init", "iteration", "iteration", "iteration", "end"]
    it = lines[3]
    assert it["counts"] == {"forward": 2, "backward": 2, "update": 2}
    assert it["sums"]["forward"] == pytest.approx(0.04, abs=0.02) and it["sums"]["backward"] == pytest.approx(0.06, abs=0.02)
    assert lines[-1]["status"] == "finished" and lines[-1]["sampler_rows"] >= 5
    # Samples and tokens of the input_ids, summed over the iteration's two micro-batches.
    assert [(x["samples"], x["tokens"]) for x in lines[2:5]] == [(8, 128)] * 3
    [run] = analyze([load_run(str(tmp_path))])["runs"]
    assert all(i["measured_share"] > 0.9 for i in run["iterations"])
    assert run["iterations"][1]["iter_s"] == pytest.approx(0.11, abs=0.04)
    header = json.loads(open(tmp_path / "samples-rank0.jsonl").readline())
    assert header["columns"][:3] == ["t", "rss_bytes", "cpu_percent"] and not header["gpu"]


def test_knob_changes_are_marked(runs, tmp_path):
    """Tuner changes (written into a copy of the record) in three iterations in a row: each is
    marked with its reason where it took effect, every changed knob (the per-path
    io_concurrency too) is drawn, and no two labels overprint each other or a legend."""
    from report.analyze import analyze
    from report.load import load_run
    from report.plots import KNOB_LABEL, figures

    run_dir = tmp_path / "tuned"
    shutil.copytree(runs["ours"], run_dir)
    rec = run_dir / "record-rank0.jsonl"
    lines = [json.loads(x) for x in rec.read_text().splitlines()]
    path = runs["nvme"]
    for x in lines:
        if x["type"] == "iteration":
            knobs, i = x["engine"]["knobs"], x["iteration"]
            knobs["prefetch_depth"] = 1 if i >= 2 else 2
            knobs["io_concurrency"] = {path: 8 if i >= 3 else 4}
            knobs["device_fraction"] = 0.25 if i >= 4 else 0.0
            if i >= 2:
                x["tuner"] = {"seq": i, "reason": f"reads wait 40% of the update: change {i} on the slowest path", "apply_at": i}
    rec.write_text("".join(json.dumps(x) + "\n" for x in lines))
    data = _report_json(str(run_dir), "--png", str(tmp_path / "png"))
    [run] = data["runs"]
    changes = run["knob_changes"]
    assert [c["iteration"] for c in changes] == [2, 3, 4]
    assert changes[0]["changed"] == {"prefetch_depth": [2, 1]}
    assert changes[1]["changed"] == {f"io_concurrency[{path}]": [4, 8]}
    assert changes[0]["reason"] == "reads wait 40% of the update: change 2 on the slowest path"
    assert set(run["knob_series"]) == {"iteration", "prefetch_depth", f"io_concurrency[{path}]", "device_fraction"}
    assert run["knob_series"][f"io_concurrency[{path}]"] == [4, 4, 4, 8, 8]
    assert _png_size(str(tmp_path / "png" / "cache.png"))[0] >= 800

    figs = figures(analyze([load_run(str(run_dir))]))
    for name in ("breakdown", "cache"):
        fig = figs[name]
        fig.canvas.draw()
        renderer = fig.canvas.get_renderer()
        labels = [t for t in fig.findobj(lambda a: a.get_gid() == KNOB_LABEL)]
        assert len(labels) == 3, name
        boxes = [t.get_window_extent(renderer) for t in labels]
        if name == "cache":  # the tuner's reasons are too long for one row: the placement stacked them
            assert len({round(b.y0) for b in boxes}) > 1, name
        for k, a in enumerate(boxes):
            for b in boxes[k + 1 :]:
                assert not a.overlaps(b), (name, a, b)
        legends = [lg.get_window_extent(renderer) for lg in fig.legends]
        legends += [ax.get_legend().get_window_extent(renderer) for ax in fig.axes if ax.get_legend()]
        for a in boxes:
            assert not any(a.overlaps(lg) for lg in legends), (name, a, legends)
            fig_box = fig.bbox
            assert fig_box.x0 <= a.x0 and a.x1 <= fig_box.x1, (name, a)
        # Iterations are whole numbers on every iteration axis.
        for ax in fig.axes:
            if ax.get_xlabel() == "iteration" or ax.get_xlabel() == "":
                ticks = [t for t in ax.get_xticks() if ax.get_xlim()[0] <= t <= ax.get_xlim()[1]]
                assert all(float(t).is_integer() for t in ticks), (name, ticks)
    # The cache figure: the hits' axes, and one axes per changed knob below it.
    assert len(figs["cache"].axes) == 1 + 3


def test_gpu_series_are_recorded_and_drawn(tmp_path, monkeypatch):
    """Where CUDA and NVML exist (faked here: no GPU on the test machines), GPU memory and PCIe
    are sampled on the rank's device, and the report draws them and their peaks by phase."""
    import types

    from report import recorder, sampler
    from report.analyze import analyze
    from report.load import load_run
    from report.plots import figures, png_bytes
    from report.render import summary_rows

    class FakeNvml:
        NVML_PCIE_UTIL_TX_BYTES, NVML_PCIE_UTIL_RX_BYTES = 0, 1

        def nvmlDeviceGetMemoryInfo(self, handle):
            return types.SimpleNamespace(used=5 << 30)

        def nvmlDeviceGetPcieThroughput(self, handle, counter):
            return 1_000_000 if counter == self.NVML_PCIE_UTIL_TX_BYTES else 2_000_000  # KB/s

        def nvmlShutdown(self):
            pass

    asked = []
    monkeypatch.setattr(sampler, "_own_nvml", lambda dev: asked.append(dev) or (FakeNvml(), "handle"))
    monkeypatch.setattr(torch.cuda, "memory_allocated", lambda dev=None: 3 << 30)
    monkeypatch.setattr(torch.cuda, "memory_reserved", lambda dev=None: 4 << 30)
    rec = recorder.Recorder(recorder.RecorderConfig(run_dir=str(tmp_path), sample_hz=100), rank=0)
    eng = _FakeEngine()
    eng.device = torch.device("cuda", 1)  # only its name reaches the (faked) CUDA and NVML calls
    _train(rec, eng, iterations=4, micro_batches=2)
    assert asked == [torch.device("cuda", 1)]
    analysis = analyze([load_run(str(tmp_path))])
    tl = analysis["runs"][0]["timeline"]
    assert set(tl["series"]) >= {
        "gpu_allocated_bytes",
        "gpu_reserved_bytes",
        "nvml_used_bytes",
        "pcie_tx_bytes_per_s",
        "pcie_rx_bytes_per_s",
    }
    assert set(tl["series"]["pcie_rx_bytes_per_s"]) == {2_000_000 * 1024}
    assert not any("not recorded" in m for m in tl["missing"] if m.startswith(("GPU", "PCIe")))
    assert tl["gpu_peak_by_phase"]["nvml_used_bytes"]["backward"] == 5 << 30
    assert "5.4" in dict(summary_rows(analysis))["GPU peak fwd/bwd/update"][0]
    assert all(len(png_bytes(fig)) > 5000 for fig in figures(analysis).values())
