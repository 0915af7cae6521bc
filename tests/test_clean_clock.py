"""The iteration's clock: what a step's record counts of the time since the last step's end
(``fwd_bwd_s``, ``setup_s``, ``excluded_s``) when the engine is told that an iteration ended
without its step (``skipped_step``), that training paused (``pause_clock``/``resume_clock``), and
of one-time work (``setup_time``). How the adapters use them: ``tests/test_gpu_path_zero3.py``
(DeepSpeed's overflow, ``offload_states``/``reload_states``, the refit), ``tests/test_tuner_daemon.py``
(the iteration time the tuner client sends), and the DeepSpeed runs of ``tests/test_deepspeed_integration.py``
and ``tests/test_ds_interop.py``.

Sleeps stand in for each part's time, in units of ``U``; a bound holds unless the machine stalls
the test for a whole ``U``.
"""

from __future__ import annotations

import time

import pytest
import torch

from engine import AdamWHyper, EngineConfig, FlatSubgroup, OffloadAdamW, SubgroupEngine

U = 0.3


def _engine(n: int = 300) -> SubgroupEngine:
    w, g = torch.zeros(n), torch.ones(n)
    return SubgroupEngine(
        [FlatSubgroup(w[o : o + 100], g[o : o + 100]) for o in range(0, n, 100)],
        EngineConfig(subgroup_numel=100, host_adam="torch"),
    )


def _step(eng: SubgroupEngine):
    return eng.step([AdamWHyper(lr=1e-3)])


def test_each_second_since_the_last_step_is_counted_once():
    """A skipped iteration inside a pause, setup inside the pause, calls repeated: the time is
    split between fwd_bwd_s, setup_s and excluded_s, none of it twice."""
    eng = _engine()
    _step(eng)
    time.sleep(U)  # the skipped iteration's forward/backward
    eng.pause_clock()
    time.sleep(U)
    with eng.setup_time():  # one-time work during the pause: setup, not excluded
        time.sleep(U)
    eng.pause_clock()  # again: no change
    eng.skipped_step()  # all so far is excluded but the setup; the pause goes on
    time.sleep(U)
    eng.resume_clock()
    eng.resume_clock()  # not paused: no change
    time.sleep(U)  # the next iteration's forward/backward
    rec = _step(eng)
    assert 3 * U <= rec.excluded_s < 4 * U, rec
    assert U <= rec.setup_s < 2 * U, rec
    assert U <= rec.fwd_bwd_s < 2 * U, rec
    rec = _step(eng)
    assert rec.excluded_s == 0.0 and rec.fwd_bwd_s < U  # the accumulator starts again
    eng.close()


def test_a_pause_not_resumed_ends_at_the_next_step():
    eng = _engine()
    _step(eng)
    eng.pause_clock()
    time.sleep(U)
    rec = _step(eng)
    assert U <= rec.excluded_s < 2 * U and rec.fwd_bwd_s < U, rec
    rec = _step(eng)
    assert rec.excluded_s == 0.0, rec
    eng.close()


def test_before_the_first_step_there_is_no_iteration_time_to_clean():
    """The first step's record has no fwd_bwd_s (and a tuner no iteration time for it): a skip or
    a pause before it leaves nothing behind for the second."""
    eng = _engine()
    eng.skipped_step()
    eng.pause_clock()
    time.sleep(U)
    first = _step(eng)
    assert first.fwd_bwd_s is None and first.excluded_s == 0.0
    eng.resume_clock()
    second = _step(eng)
    assert second.excluded_s == 0.0 and second.fwd_bwd_s < U
    eng.close()


@pytest.mark.parametrize("cut", ["skipped_step", "pause"])
def test_offload_adamw_says_a_skipped_step_and_a_pause_to_its_engine(cut):
    """OffloadAdamW's own calls (a GradScaler that skipped the step, a pause for generation)."""
    model = torch.nn.Linear(16, 16)
    opt = OffloadAdamW(model.parameters(), lr=1e-3, subgroup_numel=128, host_adam="torch")
    model(torch.randn(4, 16)).square().mean().backward()
    opt.step()
    if cut == "pause":
        opt.pause_clock()
        time.sleep(U)
        opt.resume_clock()
    else:
        time.sleep(U)
        opt.skipped_step()
    opt.step()
    rec = opt.telemetry[-1]
    assert U <= rec.excluded_s < 2 * U and rec.fwd_bwd_s < U, rec
    opt.close()
