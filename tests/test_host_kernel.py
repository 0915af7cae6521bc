"""The host AdamW kernel is chosen once per machine and environment (by timing the host lane's
own loop with each) and kept: every process after the first takes the kept choice without
measuring, so runs of one seed agree bit for bit."""

from __future__ import annotations

import json

import pytest

import engine.host_kernel as host_kernel
from engine.storage.native_ops import load_cpu_adam


@pytest.fixture
def choice_dir(tmp_path, monkeypatch):
    monkeypatch.setattr(host_kernel, "extensions_dir", lambda: str(tmp_path))
    monkeypatch.setattr(host_kernel, "_measured_rates", {})
    return tmp_path


def _no_measuring(*a, **k):
    raise AssertionError("measured although a choice was kept")


def test_first_process_measures_and_keeps_the_choice(choice_dir, monkeypatch):
    first = host_kernel.chosen_host_kernel()
    kept = json.loads((choice_dir / host_kernel.KERNEL_CHOICE_FILE).read_text())
    key = host_kernel._machine_key()
    assert kept == {key: {"kernel": first, "params_per_s": kept[key]["params_per_s"]}}
    rates = kept[host_kernel._machine_key()]["params_per_s"]
    assert first == max(rates, key=rates.get)
    monkeypatch.setattr(host_kernel, "measure_host_lanes", _no_measuring)
    assert host_kernel.chosen_host_kernel() == first


def test_a_kept_choice_wins_over_a_new_measurement(choice_dir, monkeypatch):
    """The point of keeping it: a later, noisier measurement must not flip the kernel."""
    have_ds = load_cpu_adam() is not None
    rates = {"torch": 1.0, "deepspeed": 2.0} if have_ds else {"torch": 1.0}
    slower = "torch"  # slower by the kept rates, where DeepSpeed's op exists
    (choice_dir / host_kernel.KERNEL_CHOICE_FILE).write_text(
        json.dumps({host_kernel._machine_key(): {"kernel": slower, "params_per_s": rates}})
    )
    monkeypatch.setattr(host_kernel, "measure_host_lanes", _no_measuring)
    assert host_kernel.chosen_host_kernel() == slower
    assert host_kernel.host_lane_rate("torch") == 1.0  # the kept rates serve the lane balance too


def test_measured_again_when_the_op_changed_or_the_file_is_bad(choice_dir, monkeypatch):
    have_ds = load_cpu_adam() is not None
    path = choice_dir / host_kernel.KERNEL_CHOICE_FILE
    calls = []

    def measure():
        calls.append(1)
        return {"torch": 5.0, "deepspeed": 9.0} if have_ds else {"torch": 5.0}

    monkeypatch.setattr(host_kernel, "measure_host_lanes", measure)
    # Kept before the cpu_adam op was built (or when it still existed): stale, measured again.
    stale = {"torch": 1.0} if have_ds else {"torch": 1.0, "deepspeed": 2.0}
    path.write_text(json.dumps({host_kernel._machine_key(): {"kernel": "torch", "params_per_s": stale}}))
    assert host_kernel.chosen_host_kernel() == ("deepspeed" if have_ds else "torch")
    assert len(calls) == 1
    for bad in ("{not json", "[1, 2]", json.dumps({host_kernel._machine_key(): {"kernel": "sgd"}})):
        path.write_text(bad)
        assert host_kernel.chosen_host_kernel() == ("deepspeed" if have_ds else "torch")
        assert json.loads(path.read_text())[host_kernel._machine_key()]["kernel"] in ("torch", "deepspeed")
    assert len(calls) == 4
    assert not [p for p in choice_dir.iterdir() if p.name.endswith(".tmp")]


def test_nowhere_to_keep_it_still_chooses(tmp_path, monkeypatch):
    monkeypatch.setattr(host_kernel, "extensions_dir", lambda: str(tmp_path / "file" / "sub"))
    (tmp_path / "file").write_text("")  # a file where the directory would go
    monkeypatch.setattr(host_kernel, "measure_host_lanes", lambda: {"torch": 1.0})
    assert host_kernel.chosen_host_kernel() == "torch"


def _spinning_children() -> list:
    import psutil

    return [c for c in psutil.Process().children() if "time.monotonic() < e" in " ".join(c.cmdline())]


def test_each_lane_is_timed_with_a_busy_process_beside_and_the_slower_counts(monkeypatch):
    """Issue 47 item 1: a lane that wins quiet but loses beside other runnable work (DeepSpeed's,
    one thread driving parallel regions) must not be chosen over one that holds there; the busy
    process is a real one while the busy rounds run, and nothing outlives the timing."""
    import contextlib
    import time

    real = host_kernel.busy_beside
    state = {"busy": False, "spinners": []}

    @contextlib.contextmanager
    def watched():
        with real():
            state["spinners"].append(len(_spinning_children()))
            state["busy"] = True
            try:
                yield
            finally:
                state["busy"] = False

    monkeypatch.setattr(host_kernel, "busy_beside", watched)
    seen = {"quiet": 0, "busy": 0}

    def timed(quiet_s, busy_s):
        def kernel(slices, hyper):
            seen["busy" if state["busy"] else "quiet"] += 1
            time.sleep(busy_s if state["busy"] else quiet_s)

        return kernel

    kernels = {"torch": timed(0.004, 0.006), "deepspeed": timed(0.002, 0.012)}  # deepspeed: faster quiet
    rates = host_kernel.time_host_lane(kernels, numel=4096, reps=3)
    assert seen["quiet"] and seen["busy"] and state["spinners"] == [1]
    assert rates["torch"] > rates["deepspeed"], rates
    assert not _spinning_children()
    quiet = host_kernel.time_host_lane(kernels, numel=4096, reps=3, busy=False)
    assert quiet["deepspeed"] > quiet["torch"], quiet  # quiet alone would have chosen it
