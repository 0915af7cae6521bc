"""The device tier after its fit (issue 47 items 4 and 5): the margin is taken from the memory the
process may use, and a pass between steps that needs more than the first step's peak (an
evaluation with a bigger batch), or an out-of-memory error at the step, shrinks the tier.

Checked on the CPU with the ZeRO-3 adapter's fakes (``tests/test_gpu_path_zero3.py``): the
device's memory is :class:`FakeCudaMemory`, whose ``reserved`` does not count the tier's own
tensors (CPU tensors here), so each pass below says what the process holds with the tier in it,
as the real allocator would count it. What only a GPU shows (a real eval's peak, the allocator's
rounding) is the GPU plan's item 4 and 5 check.
"""

from __future__ import annotations

import logging

import pytest
import torch
from test_gpu_path_zero3 import CUDA0, NUMELS, FakeCudaMemory, backward, make_optimizer

import engine.core
import engine.gpumem
from engine.device_tier import requested_bytes
from engine.layout import payload_bytes

TOTAL = 1_000_000
MARGIN_SHARE = 0.1  # of the usable memory: 100_000 here
TRAIN_PEAK = 300_000


@pytest.fixture(scope="module")
def ds():
    from engine.storage.native_ops import import_deepspeed

    return import_deepspeed()


def _fake(monkeypatch) -> FakeCudaMemory:
    mem = FakeCudaMemory(monkeypatch, total=TOTAL)
    monkeypatch.setattr(engine.gpumem, "MARGIN_SHARE", MARGIN_SHARE)
    return mem


def _tier(opt) -> list[int]:
    return [sg.index for sg in opt.offload_engine.subgroups if sg.tier.kind == "device"]


def _tier_bytes(opt) -> int:
    """Device bytes of the tier now: its state and, kept beside it, its gradients."""
    per = opt.offload_engine.device_tier.grad_bytes_per_element
    return sum(payload_bytes(sg.numel) + per * sg.numel for sg in opt.offload_engine.subgroups if sg.tier.kind == "device")


def _train(opt, mem, gen, peak: int) -> None:
    """One iteration whose forward/backward peaks at ``peak`` (the tier's bytes on top)."""
    mem.use(peak + _tier_bytes(opt))
    backward(opt, gen)
    opt.step()


def _same_state(a, b) -> None:
    for x, y in zip(a.fp16_partitioned_groups_flat, b.fp16_partitioned_groups_flat):
        torch.testing.assert_close(x, y)
    for i in range(len(NUMELS)):
        for x, y in zip(a.offload_engine.read_state(i)[:3], b.offload_engine.read_state(i)[:3]):
            torch.testing.assert_close(x, y)


def test_an_eval_pass_into_the_margin_moves_tier_subgroups_to_host_memory(ds, monkeypatch, caplog):
    """An evaluation between steps peaks 0.7 of the margin into it: the next step moves the
    tier's last subgroups to host memory until the whole margin is back, says so in one line,
    and training goes on with the numbers of a run without the eval."""
    mem = _fake(monkeypatch)
    opt, twin = make_optimizer(monkeypatch, fraction=0.0), make_optimizer(monkeypatch, fraction=0.0)
    gens = torch.Generator().manual_seed(1), torch.Generator().manual_seed(1)
    for o, g in zip((opt, twin), gens):
        _train(o, mem, g, TRAIN_PEAK)
    fit = opt.device_fit
    assert fit.margin_bytes == 100_000 and fit.usable_bytes == TOTAL
    before = _tier(opt)
    assert len(before) >= 3, fit  # the case is not vacuous: the tier has subgroups to give
    for o, g in zip((opt, twin), gens):
        _train(o, mem, g, TRAIN_PEAK)
    assert _tier(opt) == before  # training's own peak: nothing moves
    into = 70_000
    caplog.set_level(logging.WARNING, logger="engine.device_tier")
    mem.use(TOTAL - fit.margin_bytes + into)  # the eval, the tier resident
    mem.use(0)
    for o, g in zip((opt, twin), gens):
        _train(o, mem, g, TRAIN_PEAK)
    after = _tier(opt)
    assert after == before[: len(after)] and len(after) < len(before)
    freed = sum(12 * NUMELS[i] + 2 * NUMELS[i] for i in before[len(after) :])
    assert freed >= into
    lines = [r.getMessage() for r in caplog.records if "device-tier subgroup" in r.getMessage()]
    assert len(lines) == 1 and "\n" not in lines[0] and "offload_states()" in lines[0], lines
    for o, g in zip((opt, twin), gens):
        _train(o, mem, g, TRAIN_PEAK)
    assert _tier(opt) == after  # measured afresh: training's peak moves nothing more
    _same_state(opt, twin)
    opt.offload_engine.close()
    twin.offload_engine.close()


def test_a_pass_less_than_halfway_into_the_margin_moves_nothing(ds, monkeypatch):
    """Within half the margin (the allocator's rounding of the tier's own blocks, a slightly
    longer batch), the tier stays as fitted."""
    mem = _fake(monkeypatch)
    opt = make_optimizer(monkeypatch, fraction=0.0)
    gen = torch.Generator().manual_seed(1)
    _train(opt, mem, gen, TRAIN_PEAK)
    before = _tier(opt)
    mem.use(TOTAL - opt.device_fit.margin_bytes + 40_000)
    _train(opt, mem, gen, TRAIN_PEAK)
    assert _tier(opt) == before
    opt.offload_engine.close()


def test_an_out_of_memory_error_at_the_step_shrinks_the_tier_for_the_next(ds, monkeypatch, caplog):
    """The step raises torch's OutOfMemoryError: the error reaches the caller as it was, and the
    tier gives back what the failed allocation asked for and the margin, so that a loop that
    skips the batch runs its next step with room."""
    mem = _fake(monkeypatch)
    opt = make_optimizer(monkeypatch, fraction=0.0)
    gen = torch.Generator().manual_seed(1)
    _train(opt, mem, gen, TRAIN_PEAK)
    before = _tier(opt)
    eng = opt.offload_engine
    real = eng.device_lane.update_resident
    calls = []

    def fail_once(*a, **k):
        if not calls:
            calls.append(1)
            raise torch.OutOfMemoryError(
                "CUDA out of memory. Tried to allocate 48.83 KiB. GPU 0 has a total capacity of 139.8 GiB"
            )
        return real(*a, **k)

    monkeypatch.setattr(eng.device_lane, "update_resident", fail_once)  # the tier's update
    caplog.set_level(logging.WARNING, logger="engine.device_tier")
    with pytest.raises(torch.OutOfMemoryError):
        _train(opt, mem, gen, TRAIN_PEAK)
    after = _tier(opt)
    freed = sum(14 * NUMELS[i] for i in before[len(after) :])
    assert len(after) < len(before) and freed >= 50_000 + opt.device_fit.margin_bytes
    assert any("out of GPU memory at the step (it asked for 50 KB more)" in r.getMessage() for r in caplog.records)
    _train(opt, mem, gen, TRAIN_PEAK)  # the caller went on
    assert eng.telemetry.records[-1].device_tier_subgroups == len(after)
    eng.close()


def test_requested_bytes_reads_torchs_message():
    assert requested_bytes(RuntimeError("CUDA out of memory. Tried to allocate 1.50 GiB. GPU 0")) == 3 << 29
    assert requested_bytes(RuntimeError("Tried to allocate 20.00 MiB")) == 20 << 20
    assert requested_bytes(RuntimeError("something else")) == 0


@pytest.mark.parametrize(
    "others, fraction, usable",
    [
        (0, 1.0, 141_000_000_000),  # the card alone
        (61_000_000_000, 1.0, 80_000_000_000),  # another process (a ballast, a tenant) holds 61 GB
        (0, 0.5, 70_500_000_000),  # torch.cuda.set_per_process_memory_fraction(0.5)
        (61_000_000_000, 0.5, 70_500_000_000),  # both: the fraction is of the card's total
    ],
)
def test_the_margin_is_taken_from_the_memory_the_process_may_use(monkeypatch, others, fraction, usable):
    """6% of what this process may use, not of the card: on a 141 GB card held to 80 GB, 4.8 GB
    is kept free beyond the peak, not 8.5 GB; and no state goes past a per-process fraction."""
    mem = FakeCudaMemory(monkeypatch, total=141_000_000_000)
    monkeypatch.setattr(engine.gpumem, "MARGIN_MIN_BYTES", 2 << 30)
    monkeypatch.setattr(engine.gpumem, "MARGIN_SHARE", 0.06)
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (mem.total - others - mem.reserved, mem.total))
    mem.fraction = fraction
    mem.use(10_000_000_000)
    assert engine.gpumem.usable_bytes(CUDA0) == usable
    margin = max(2 << 30, int(0.06 * usable))
    assert engine.gpumem.gpu_headroom_bytes(CUDA0) == usable - 10_000_000_000 - margin
