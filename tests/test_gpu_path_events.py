"""Issue 47 item 2: events per ring slot, not per chunk; the part chunk a measured choice.

On the CPU with the recording fake of the streams (``tests/fake_streams.py``), as
``tests/test_gpu_path.py``: what a GPU would show (the events' cost, the lock at 16 threads) is
the GPU session's (BENCHMARKS.md, the GPU plan).
"""

from __future__ import annotations

import threading

import pytest
import torch
from fake_streams import RecordingStreams
from test_gpu_path import CHUNK, NUMELS, _Run

import engine.host_lane
from engine.adamw import adamw_update_torch_
from engine.host_lane import LOCK_CHUNK_NUMEL, PART_CHUNK_NUMEL, GradReader, PinnedRing, part_chunk_numel
from engine.streams import CudaStreams, HostStreams


def test_a_step_makes_events_per_slot_not_per_chunk(monkeypatch, swap_dir):
    """After the first step, the lanes' chunk copies (device-lane chunks, weight uploads,
    gradient reads) record their slots' events again: a step makes one new event per
    device-lane subgroup (its buffer's ready event), whatever the number of chunks."""
    monkeypatch.setattr(engine.host_lane, "HOST_CHUNK_NUMEL", CHUNK)
    run = _Run(monkeypatch, swap_dir, host_cache_bytes=None, fraction=0.5, device_grads={0, 3})
    run.engine.host_lane.weights.chunk_numel = CHUNK
    run.engine.host_lane.grads = GradReader(run.fake, chunk_numel=CHUNK)
    run.step()
    for _ in range(3):
        made, recorded = len(run.fake.events), run.fake.recorded
        rec, _ = run.step()
        assert rec.device_lane_subgroups >= 2 and rec.host_lane_subgroups >= 2
        chunks = sum(-(-n // CHUNK) for n in NUMELS)
        assert run.fake.recorded - recorded >= chunks  # every chunk still marks its copies
        assert len(run.fake.events) - made <= rec.device_lane_subgroups
    assert not run.fake.races()
    run.check_numerics()
    run.engine.close()


def test_a_ring_slot_keeps_one_event_and_waits_for_its_last_copy():
    fake = RecordingStreams()
    s = fake.new_stream()
    ring = PinnedRing(2, 64)
    src = torch.zeros(16)
    dst = torch.empty(16)
    fake.mark_device(dst)
    events = set()
    for _ in range(6):
        k, raw = ring.take()
        with fake.use(s):
            fake.copy(dst, raw.view(torch.float32)[:16].copy_(src))
            events.add(id(ring.record(k, fake, s)))
    assert len(events) == 2 and len(fake.events) == 2
    # taking a slot again waits for exactly its last copy
    last = len(fake.copies) - 2  # the copy slot 0 last carried
    ring.take()
    assert fake.copies[last].before(fake.host)


def test_cuda_and_host_streams_record_an_event_again(monkeypatch):
    made, recorded = [], []

    class Event:
        def __init__(self, enable_timing=False, blocking=False, interprocess=False):
            made.append(blocking)

        def record(self, stream=None):
            recorded.append(stream)

    monkeypatch.setattr(torch.cuda, "Event", Event)
    streams = CudaStreams(torch.device("cuda", 0))
    ev = streams.record("s")
    assert streams.record("t", ev) is ev and made == [True] and recorded == ["s", "t"]
    host = HostStreams(torch.device("cpu"))
    done = host.record(None)
    assert host.record(None, done) is done


def test_the_part_chunk_is_larger_where_the_lock_binds():
    # issue 47's figures: 90 us of calls a chunk against 2 ms of work
    assert part_chunk_numel(16, 90e-6, 2e-3) == LOCK_CHUNK_NUMEL
    assert part_chunk_numel(2, 90e-6, 2e-3) == PART_CHUNK_NUMEL
    assert part_chunk_numel(1, 1.0, 1e-3) == PART_CHUNK_NUMEL


@pytest.mark.skipif(torch.get_num_threads() < 2, reason="needs two threads")
def test_the_lane_measures_its_chunk_once_on_a_worker_and_uses_it(monkeypatch):
    """The lane's threads measure one chunk's overhead and work once, on a worker thread (one
    thread, as the parts run); a lane where the lock binds updates in the larger chunks, with
    the same math."""
    from test_gpu_path import HP

    from engine.binding import FlatSubgroup
    from engine.config import EngineConfig
    from engine.core import SubgroupEngine

    calls = []
    real = engine.host_lane.measure_chunk_costs

    def measure(*a, **k):
        calls.append((threading.get_ident(), torch.get_num_threads()))
        return real(*a, **k)

    monkeypatch.setattr(engine.host_lane, "measure_chunk_costs", measure)
    n = 2 * LOCK_CHUNK_NUMEL + 1000
    gen = torch.Generator().manual_seed(0)
    w = torch.randn(n, generator=gen).to(torch.bfloat16)
    g = torch.randn(n, generator=gen).to(torch.bfloat16)
    b = FlatSubgroup(w, g)
    ref = torch.nn.Parameter(w.float())
    ref_opt = torch.optim.AdamW([ref], lr=HP.lr, weight_decay=HP.weight_decay)
    eng = SubgroupEngine([b], EngineConfig(host_cache_bytes=None, host_adam="torch"))
    sizes = []

    def kernel(s, hp):
        sizes.append(s.params[0].numel())
        adamw_update_torch_(s, hp)

    eng.host_lane.kernel = kernel
    ref.grad = g.float()
    eng.step([HP])
    ref_opt.step()
    lane = eng.host_lane._threads
    assert len(calls) == 1 and lane.chunk_costs is not None  # measured once, before the update
    assert calls[0][0] != threading.get_ident() and calls[0][1] == 1  # on a worker, on one thread
    assert max(sizes) == part_chunk_numel(2, *lane.chunk_costs)
    lane.chunk_costs = (1.0, 1e-3)  # a lock that binds: the large chunks
    sizes.clear()
    eng.step([HP])
    ref_opt.step()
    assert len(calls) == 1 and max(sizes) == LOCK_CHUNK_NUMEL
    torch.testing.assert_close(eng.read_state(0)[0], ref.detach(), rtol=1e-6, atol=1e-7)
    eng.close()
