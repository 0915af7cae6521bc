"""Issue 47 item 3: nothing is pinned inside a step; OffloadAdamW's weights go up in chunks.

On the CPU with the recording fake of the streams (``tests/fake_streams.py``), as
``tests/test_gpu_path.py``.
"""

from __future__ import annotations

from concurrent.futures import Future

import pytest
import torch
from fake_streams import RecordingStreams
from test_gpu_path import NUMELS, _Run

import engine.device_lane
from engine.buffers import StateBuffer
from engine.errors import StorageIOError
from engine.subgroup import InHost


class _Pins:
    """StateBuffer.pin recorded: which buffer, and whether a device-lane update was running."""

    def __init__(self, monkeypatch) -> None:
        self.calls: list[tuple[int, bool]] = []
        self.updating = False
        pins = self

        def pin(buf):
            if not buf._pin_tried:
                buf._pin_tried = buf.pinned = True
                pins.calls.append((id(buf), pins.updating))
            return True

        real = engine.device_lane.DeviceLane.update_staged

        def update_staged(lane, *a, **k):
            pins.updating = True
            try:
                return real(lane, *a, **k)
            finally:
                pins.updating = False

        monkeypatch.setattr(StateBuffer, "pin", pin)
        monkeypatch.setattr(engine.device_lane.DeviceLane, "update_staged", update_staged)


def test_a_buffer_grown_after_failed_writes_is_pinned_at_the_next_step_not_in_its_update(monkeypatch, swap_dir):
    """Failed writes keep their state in their buffers, out of the pool; the pool then grows
    inside the step. Such a buffer is copied from pageable memory in that step and pinned at the
    next step's start, after its sync: no cudaHostRegister inside an update."""
    pins = _Pins(monkeypatch)
    run = _Run(monkeypatch, swap_dir, host_cache_bytes=0, fraction=1.0)
    run.step()
    run.step()
    path = run.engine.subgroups[0].swap.file.path
    real_write = path.write
    pool = run.engine.transfers
    run.engine.transfers.wait_all()
    run.engine.transfers.read_ahead_buffers = 0  # the working buffers alone: fewer than the swapped subgroups
    run.engine.transfers.resize_for(1)
    failing = {"left": pool.pool_size}  # every buffer of the pool kept by a failed write: it must grow

    def write(sf, buf):
        if failing["left"] <= 0:
            return real_write(sf, buf)
        failing["left"] -= 1
        f = Future()
        f.set_exception(StorageIOError("injected"))
        return f

    monkeypatch.setattr(path, "write", write)
    made = []
    real_init = StateBuffer.__init__

    def init(buf, *a, **k):
        real_init(buf, *a, **k)
        made.append(buf)

    monkeypatch.setattr(StateBuffer, "__init__", init)
    raised = 0
    for _ in range(5):
        try:
            run.step()
        except StorageIOError:
            raised += 1
    assert raised >= 1
    grown = [b for b in made if b.capacity_numel == max(NUMELS)]
    assert grown, "the pool grew no buffer"
    assert not [c for c in pins.calls if c[1]], "pinned inside a device-lane update"
    assert {id(b) for b in grown} <= {c[0] for c in pins.calls}  # pinned, at a step's start
    run.engine.close()


def test_the_lane_pins_a_pageable_buffer_after_the_sync_at_the_next_step():
    from engine.adamw import AdamWHyper
    from engine.binding import FlatSubgroup
    from engine.device_lane import DeviceLane

    fake = RecordingStreams()
    lane = DeviceLane(fake, 1000, chunk_numel=256)
    w = torch.randn(1000).to(torch.bfloat16)
    fake.mark_device(w)
    b = FlatSubgroup(w, torch.randn(1000).to(torch.bfloat16))
    buf = StateBuffer(1000)
    buf.exp_avg.zero_()
    buf.exp_avg_sq.zero_()
    b.read_weights(buf.master)
    order = []
    buf.pin = lambda: order.append(("pin", len(fake.ops))) or False
    lane.update_staged(buf, b, [0], AdamWHyper(lr=1e-3))
    assert order == []  # not inside the update
    lane.begin_step()
    assert len(order) == 1 and fake.ops[order[0][1] - 1][0] == "wait"  # after the step's sync


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_offload_adamw_weights_on_the_device_go_up_a_chunk_at_a_time(monkeypatch, dtype):
    """OffloadAdamW with its parameters on the GPU: the host lane's new weights go up chunk by
    chunk through the pinned ring on the upload stream (as the ZeRO-3 integration's flat
    weights), not in one synchronous, pageable, whole-subgroup copy per parameter."""
    import engine.core
    import engine.host_lane
    from engine.optimizer import OffloadAdamW

    fake = RecordingStreams()
    monkeypatch.setattr(engine.core, "streams_for", lambda device: fake)
    chunk = 128
    gen = torch.Generator().manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(n, generator=gen).to(dtype)) for n in (700, 300, 450)]
    params.append(torch.nn.Parameter(torch.randn(20, 30, generator=gen).to(dtype).t()))  # not contiguous
    fake.mark_device(*params)
    ref = [torch.nn.Parameter(p.detach().float().clone()) for p in params]
    opt = OffloadAdamW(params, lr=1e-2, subgroup_numel=1000, device="cpu", host_adam="torch", device_fraction=0.0)
    opt.engine.host_lane.weights.chunk_numel = chunk
    ref_opt = torch.optim.AdamW(ref, lr=1e-2, weight_decay=0.01)
    up = opt.engine.host_lane.weights
    spans = [(p.data_ptr(), p.data_ptr() + p.numel() * p.element_size()) for p in params]
    for _ in range(3):
        for p, r in zip(params, ref):
            g = torch.randn(p.shape, generator=gen)
            p.grad, r.grad = g.to(dtype), g.to(dtype).float()
        first = len(fake.copies)
        opt.step()
        ref_opt.step()
        writes = [c for c in fake.copies[first:] if any(a < c.dst[1] and c.dst[0] < b for a, b in spans)]
        assert writes and all(c.stream == up.stream.name for c in writes)
        assert all(c.dst[1] - c.dst[0] <= chunk * params[0].element_size() for c in writes)
        assert not [c for c in writes if not c.before(fake.default.clock)]  # joined to the caller's stream
    assert not fake.races()
    for p, r in zip(params, ref):
        exact = dict(rtol=0, atol=0) if dtype == torch.bfloat16 else dict(rtol=1e-6, atol=1e-7)
        torch.testing.assert_close(p.detach().float(), r.detach().to(dtype).float(), **exact)
    opt.close()


def test_a_refit_inside_a_step_unpins_the_buffers_it_frees_after_the_lane_sync(monkeypatch, swap_dir):
    """A refit inside step() (the fit after a release, or a pending one) moves pinned host
    buffers into the device tier and drops them: cudaHostUnregister (which may synchronize the
    device) runs at the lane's sync at the step's end, not inside the fit."""
    from test_gpu_path import STATE, _lane_bytes

    import engine.buffers
    import engine.device_tier

    events = []
    fitting = {"on": False}
    monkeypatch.setattr(engine.buffers, "_cuda_pins", lambda: True)
    monkeypatch.setattr(engine.buffers, "_host_register", lambda ptr, n: 0)
    monkeypatch.setattr(engine.buffers, "_host_unregister", lambda ptr: events.append(("unpin", fitting["on"])))
    real_fit = engine.device_tier.DeviceTier.fit

    def fit(tier, *a, **k):
        fitting["on"] = True
        try:
            return real_fit(tier, *a, **k)
        finally:
            fitting["on"] = False
            events.append(("fit", None))

    monkeypatch.setattr(engine.device_tier.DeviceTier, "fit", fit)
    run = _Run(monkeypatch, swap_dir, host_cache_bytes=None, device_cache_bytes=None, fraction=1.0)
    run.engine.fit_device_tier(headroom_bytes=_lane_bytes(run.engine.device_lane) + STATE[0] + 1)
    run.step()
    run.step()
    host = [sg.home.buffer for sg in run.engine.subgroups if isinstance(sg.home, InHost)]
    assert host and all(b.pinned for b in host)
    del host
    events.clear()
    run.engine.device_tier.fit_pending = True  # the next step fits again: every subgroup into the tier
    run.step()
    assert run.engine.describe().state_bytes_by_tier == {"device": sum(STATE)}
    unpins = [e for e in events if e[0] == "unpin"]
    assert len(unpins) == len(NUMELS) - 1  # the host buffers the refit freed
    assert not [e for e in unpins if e[1]], "unpinned inside the fit"
    assert events.index(("fit", None)) < events.index(unpins[0])
    run.check_numerics()
    run.engine.close()
