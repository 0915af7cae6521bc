"""Issue 47 item 6: the host lane's threads never change torch's process-wide thread default.

torch gives a thread its count at its first op, from the process-wide default that
``torch.set_num_threads`` sets: a thread whose first op landed while the lane had set it to 1
(the caller's part of every subgroup, before) kept one thread for good.
"""

from __future__ import annotations

import threading

import pytest
import torch

import engine.host_lane
from engine.host_lane import LaneThreads, own_thread_count

pytestmark = pytest.mark.skipif(torch.get_num_threads() < 2, reason="one thread: nothing to tell apart")


def _first_op_count() -> int:
    """The count a thread started now takes at its first op."""
    out = []
    t = threading.Thread(target=lambda: out.append(torch.get_num_threads()))
    t.start()
    t.join()
    return out[0]


def test_a_thread_started_during_a_lane_part_keeps_the_process_count():
    threads = torch.get_num_threads()
    lane = LaneThreads()
    seen, counts = [], {}

    def part(k):
        counts[k] = torch.get_num_threads()
        if k == 0:
            seen.append(_first_op_count())  # e.g. an I/O thread or DeepSpeed's, starting now

    try:
        for _ in range(3):
            lane.run(2, part)
    finally:
        lane.close()
    assert seen == [threads] * 3
    assert counts == {0: 1, 1: 1}  # each part on its thread alone still
    assert torch.get_num_threads() == threads


def test_the_lane_never_sets_the_process_default(monkeypatch):
    """Starting its workers and running its parts, the lane sets only its own threads' counts."""
    assert own_thread_count() is not None, "the OpenMP runtime torch uses was not found"
    calls = []
    real = torch.set_num_threads
    monkeypatch.setattr(torch, "set_num_threads", lambda n: calls.append(n) or real(n))
    lane = LaneThreads()
    try:
        lane.run(2, lambda k: None)
        lane.run(2, lambda k: None)
    finally:
        lane.close()
    assert calls == []


def test_without_the_runtime_every_part_runs_on_a_worker(monkeypatch):
    """Where no OpenMP runtime is found, the caller's part goes to a worker: the caller's count
    and the default are left alone once the workers are up."""
    monkeypatch.setattr(engine.host_lane, "_OWN_THREADS", [None])
    threads = torch.get_num_threads()
    lane = LaneThreads()
    where = {}
    try:
        lane.run(2, lambda k: None)  # workers up
        seen = []
        lane.run(
            2,
            lambda k: (
                where.update({k: (threading.get_ident(), torch.get_num_threads())}) or (k == 0 and seen.append(_first_op_count()))
            ),
        )
    finally:
        lane.close()
    me = threading.get_ident()
    assert all(t != me and n == 1 for t, n in where.values()) and len(where) == 2
    assert seen == [threads] and torch.get_num_threads() == threads


def test_leaving_a_core_to_the_io_threads_changes_the_callers_count_alone():
    """The step with swapped state runs the lane on one thread fewer; a thread whose first op
    comes then (an I/O or DeepSpeed thread) takes the process's count, not the lane's."""
    from engine.host_lane import threads_left_to_io

    threads = torch.get_num_threads()
    with threads_left_to_io(1):
        inside = torch.get_num_threads()
        started = _first_op_count()
    assert inside == threads - 1 and started == threads
    assert torch.get_num_threads() == threads
