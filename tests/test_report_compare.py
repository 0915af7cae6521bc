"""The comparison report answers "was it worth it" (issue 46, point 1): each run's command line,
options, tier layout, knobs at start, versions and date; the loss curve; a rolling median over
the iteration times, which outliers do not set the scale of; a warning when the phases the
engine does not touch differ beyond the noise, and the ratio on the one it runs; what limits
each run and the next step; the user's knob changes said as the user's; panels this machine
cannot record in one line each. Real runs of examples/train_gpt.py (stock and offloadctl's
engine), rendered, their HTML and figures checked; the variants are edited copies of a real
run's record."""

from __future__ import annotations

import html as html_lib
import json
import re
import shutil

import pytest
import torch
from ds_runs import GPT, GPT_RECORDED, Launch
from helpers import cli

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def runs(ds_runs):
    """The runs tests/test_report.py reports (the session makes each once)."""
    ours = ds_runs.get(GPT_RECORDED).ok()
    stock = ds_runs.get(
        Launch("ours", 1, ("--steps", "4", "--batch", "8"), script=GPT, opts=("--engine", "stock", "--run-dir", "{dir}/stock"))
    ).ok()
    return {"ours": str(ours.run_dir), "stock": str(stock.run_dir)}


def _page(tmp_path, *dirs: str) -> tuple[str, str]:
    out = tmp_path / "page.html"
    p = cli("report", *dirs, "--output", str(out))
    assert p.returncode == 0, p.stderr[-3000:]
    return html_lib.unescape(out.read_text()), p.stdout


def _records(run_dir) -> list[dict]:
    return [json.loads(x) for x in (run_dir / "record-rank0.jsonl").read_text().splitlines()]


def _write(run_dir, lines: list[dict]) -> None:
    (run_dir / "record-rank0.jsonl").write_text("".join(json.dumps(x) + "\n" for x in lines))


def test_the_comparison_page_says_what_each_run_was_and_what_limits_it(runs, tmp_path):
    page, stdout = _page(tmp_path, runs["stock"], runs["ours"])
    # What each run was, from its record: the command as typed, its options apart, the layout,
    # the knobs it started from, the versions and the date.
    facts = page[page.index("<h2 id='runs'>") : page.index("<h2 id='figures'>")]
    assert "offloadctl train" in facts and "--engine stock" in facts, facts
    options = re.search(r"<th>options</th><td>([^<]*)</td><td>([^<]*)</td>", facts)
    assert re.search(r"--engine stock --run-dir \S+/stock$", options[1]), options[1]
    assert re.search(r"--nvme \S+/nvme --tuner off .*--run-dir \S+/ours$", options[2]), options[2]
    assert "--steps 5 --batch 8" in facts and "--local_rank" not in facts
    assert "DeepSpeed's own: all in host memory (CPU offload)" in facts
    assert re.search(r"MB on \S+/nvme \(nvme\)", facts), facts
    assert "prefetch_depth=0" in facts and "none (DeepSpeed's own optimizer)" in facts
    assert f"torch {torch.__version__}" in facts and "deepspeed 0.19" in facts and "offloadctl " in facts
    assert re.search(r"<th>date</th><td>20\d\d-\d\d-\d\d \d\d:\d\d:\d\d", facts), facts
    assert "not recorded" not in facts
    # The ratio on the phase the engine runs beside the iteration's, on the page and the terminal.
    assert re.search(
        r"against stock \(stock\): iteration \d\.\d\dx the speed; the update \(the optimizer step, "
        r"the engine's phase\) \d+\.\d\dx",
        page,
    ), page[:3000]
    assert "update's speed vs the first" in stdout and "against stock (stock)" in stdout
    # What limits each run, with the next step (a stock run's: offloadctl's engine, where the update limits).
    assert page.count("<p class='limit' id='limit'>what limits this run: ") == 2
    assert all("; next: " in line for line in re.findall(r"<p class='limit'[^>]*>([^<]*)", page))
    # Every line of the terminal summary fits its 100 columns; the report's new lines too.
    assert all(len(line) <= 100 for line in stdout.splitlines()), stdout


def test_loss_rolling_median_and_the_panels_this_machine_cannot_record(runs, tmp_path):
    from report.analyze import analyze
    from report.load import load_run
    from report.plots import LOSS_AXES, OUTLIER, ROLLING_MEDIAN, figures, timeline_rows

    # The loss each iteration passed to backward: train_gpt.py's own losses, in order.
    [run] = analyze([load_run(runs["ours"])])["runs"]
    losses = [i["loss"] for i in run["iterations"]]
    assert all(isinstance(x, float) and 0 < x < 20 for x in losses), losses
    assert losses[-1] < losses[0]
    # An outlier: iteration 2 three seconds longer (every later end moves with it).
    slow = tmp_path / "slow"
    shutil.copytree(runs["ours"], slow)
    lines = _records(slow)
    for x in lines:
        if x["type"] == "iteration" and x["iteration"] >= 2:
            x["t_end"] += 3.0
    _write(slow, lines)
    analysis = analyze([load_run(runs["stock"]), load_run(str(slow))])
    figs = figures(analysis)
    fig = figs["breakdown"]
    assert len(fig.findobj(lambda a: a.get_gid() == ROLLING_MEDIAN)) == 2
    [marks] = fig.findobj(lambda a: a.get_gid() == OUTLIER)
    assert list(marks.get_xdata()) == [2]
    bars = [ax for ax in fig.axes if ax.get_gid() != LOSS_AXES]
    assert bars[0].get_ylim()[1] < 3.0  # the scale is the other iterations', not the outlier's
    assert "1 above" in bars[1].get_title(loc="left") and "cut" in bars[1].get_title(loc="left")
    [loss_ax] = [ax for ax in fig.axes if ax.get_gid() == LOSS_AXES]
    assert [len(line.get_xdata()) for line in loss_ax.lines] == [4, 5]
    # No GPU here: no GPU memory or PCIe rows, and one line each under "Not recorded on this machine".
    if not torch.cuda.is_available():
        assert timeline_rows(analysis["runs"]) == ["phases", "tiers", "host"]
        assert len(figs["timeline"].axes) >= 3 * 2
        page, _ = _page(tmp_path, runs["stock"], str(slow))
        absent = page[page.index("<h2 id='not-recorded'>") :]
        items = re.findall(r"<li>([^<]*)</li>", absent)
        assert "GPU memory: not recorded (no CUDA device)" in items
        assert any(i.startswith("PCIe TX/RX: not recorded") for i in items)
        assert any(
            i.startswith("cache hits and knobs: no engine telemetry") and i.endswith("; in stock (stock)") for i in items
        ), items
        assert "the rolling median" in page and "loss" in page


def test_a_machine_that_changed_between_runs_is_said_and_the_update_compared(runs, tmp_path):
    """The same run against itself: no warning. Against a copy whose forward took three times as
    long (the machine busy; the update as it was): the warning names forward with both medians,
    and the update's ratio stays 1.00x."""
    same = tmp_path / "same"
    shutil.copytree(runs["ours"], same)
    page, _ = _page(tmp_path, runs["ours"], str(same))
    assert "id='machine-warning'" not in page and "the update (the optimizer step, the engine's phase) 1.00x" in page
    busy = tmp_path / "busy"
    shutil.copytree(runs["ours"], busy)
    lines = _records(busy)
    # Every forward longer by twice the run's median forward: a difference far beyond the few
    # iterations' spread, which a constant leaves as it was.
    fwd = sorted(x["sums"]["forward"] for x in lines if x["type"] == "iteration")
    extra = 2 * fwd[len(fwd) // 2]
    shift = 0.0  # every later time moves by the forward time added before it
    for x in lines:
        if x["type"] == "iteration":
            spans = [sp for sp in x["spans"] if sp[0] == "forward"]
            total = sum(sp[2] - sp[1] for sp in spans)
            x["sums"]["forward"] += extra
            for sp in x["spans"]:
                grow = extra * (sp[2] - sp[1]) / total if sp[0] == "forward" else 0.0
                sp[1] += shift
                sp[2] += shift + grow
                shift += grow
            x["t_end"] += shift
    _write(busy, lines)
    page, stdout = _page(tmp_path, runs["ours"], str(busy))
    warning = page[page.index("id='machine-warning'") :]
    warning = warning[: warning.index("</div>")]
    assert "The machine differed between the runs." in warning
    assert re.search(
        r"forward, which the engine does not touch, differ beyond the noise .*: forward \S+ ms vs \S+ ms "
        r"\(\+\d+%",
        warning,
    ), warning
    assert "backward" not in warning.split("differ beyond")[0]
    assert "the update (the optimizer step, the engine's phase) 1.00x" in page
    assert "warning: forward, which the engine does not touch" in " ".join(stdout.split())


def test_the_users_knob_changes_are_said_as_the_users(runs, tmp_path):
    """A pin from `offloadctl tune` reaches the ranks with the daemon's reason ('... pinned to 4 by
    the user'); a tuner move with its own. The report labels the pin 'you:' (a solid line) and
    counts each by who made it."""
    from report.analyze import analyze
    from report.load import load_run
    from report.plots import KNOB_LABEL, figures

    tuned = tmp_path / "tuned"
    shutil.copytree(runs["ours"], tuned)
    lines = _records(tuned)
    for x in lines:
        if x["type"] == "iteration":
            i = x["iteration"]
            x["engine"]["knobs"]["prefetch_depth"] = 4 if i >= 2 else 0
            x["engine"]["knobs"]["node_lock"] = i >= 4
            if i == 2:
                x["tuner"] = {"seq": 1, "reason": "prefetch_depth pinned to 4 by the user", "apply_at": 2}
            if i == 4:
                x["tuner"] = {"seq": 2, "reason": "writes wait: the node lock serializes ranks", "apply_at": 4}
    _write(tuned, lines)
    [run] = analyze([load_run(str(tuned))])["runs"]
    assert [(c["iteration"], c["by"]) for c in run["knob_changes"]] == [(2, "you"), (4, "the tuner")]
    figs = figures(analyze([load_run(str(tuned))]))
    texts = {
        name: [t.get_text() for t in figs[name].findobj(lambda a: a.get_gid() == KNOB_LABEL)] for name in ("breakdown", "cache")
    }
    assert texts["breakdown"][0].startswith("you: prefetch_depth") and not texts["breakdown"][1].startswith("you")
    assert texts["cache"] == ["you: prefetch_depth pinned to 4", "writes wait: the node lock serializes ranks"]
    page, stdout = _page(tmp_path, str(tuned))
    assert "2 (1 by you, 1 by the tuner)" in page and "2 (1 by you, 1 by the tuner)" in stdout
    assert "yours (a pin, unpin or freeze from offloadctl tune, labelled 'you:')" in page


def test_one_median_with_one_definition_on_every_screen(runs):
    """The summary's median (every iteration but the first) is the live view's last line's too,
    read from the run's record, and says what it is of; the tuner's own figure is said as the
    median of its last window, not the run's."""
    from offloadctl.commands.tune_view import final_line
    from offloadctl.summary import run_summary_lines, tuner_lines

    lines = run_summary_lines(runs["ours"])
    m = re.match(r"(\S+ m?s)/iteration \(median of (\d+)\)", lines[1])
    assert m, lines
    assert "the median: all but the first (start-up)" in " ".join(" ".join(lines).split())
    view = {
        "run_id": "r",
        "status": "finished",
        "outcome": "finished",
        "stopped_by": None,
        "iteration": 4,
        "history": {"iter_time_s": [9.0, 9.0]},
        "knobs": {"prefetch_depth": 0},
        "start_knobs": {"prefetch_depth": 0},
        "verdict": {
            "mode": "holding",
            "since_iteration": 3,
            "reason": "no move left to try: none gained more than 5%; holding at iteration 0.309 s",
        },
    }
    text = final_line(view, runs["ours"])
    assert f"{m[1]}/iteration (median of {m[2]}, as in the run's summary)" in text, text
    assert "holding at 309 ms/iteration (the median of the last 3 it measured before it settled)" in text, text
    assert "9.00 s" not in text
    assert "(median of the last 2 the tuner saw; the run's summary takes all but the first)" in final_line(view)
    said = " ".join(" ".join(tuner_lines(view)).split())
    assert "holding at 309 ms/iteration (the median of the last 3 it measured before it settled)" in said, said
