"""The ZeRO-3 adapter's GPU path (``integrations/zero3_optimizer.py``), checked on the CPU.

:class:`OffloadZero3Optimizer` is built without ``deepspeed.initialize``: the attributes its
methods read are set by hand (the ones DeepSpeed's ``__init__`` would set), DeepSpeed's own
step helpers are no-ops, and its ``offload_states``/``reload_states``/``destroy`` are DeepSpeed's
real ones (the CPU accelerator's). The engine runs its CUDA code path on the CPU with the
recording fake of its streams (``tests/fake_streams.py``), and the device's memory is a fake of
``torch.cuda``'s memory API (:class:`FakeCudaMemory`), so a test can say what the device fit
measured. What only a GPU shows (the buffer's real device, real peaks) is checked by the GPU
session (bench/gpu_session.sh).
"""

from __future__ import annotations

import time
import types

import pytest
import torch
from fake_streams import RecordingStreams

import engine.core
import engine.device_tier
import engine.gpumem
from engine.config import EngineConfig, Knobs
from engine.core import SubgroupEngine

NUMELS = [4000, 3000, 5000, 4000, 3500, 4500]
CHUNK = 512
CUDA0 = torch.device("cuda", 0)


@pytest.fixture(scope="module")
def ds():
    from engine.storage.native_ops import import_deepspeed

    return import_deepspeed()


class FakeCudaMemory:
    """``torch.cuda``'s memory API for one device: ``reserved`` now and its ``peak`` since the
    last reset, in bytes; nothing of other processes."""

    def __init__(self, monkeypatch, total: int) -> None:
        self.total, self.reserved, self.peak = total, 0, 0
        monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (self.total - self.reserved, self.total))
        monkeypatch.setattr(torch.cuda, "memory_reserved", lambda device=None: self.reserved)
        monkeypatch.setattr(torch.cuda, "max_memory_reserved", lambda device=None: self.peak)
        monkeypatch.setattr(torch.cuda, "reset_peak_memory_stats", self.reset)
        monkeypatch.setattr(torch.cuda, "empty_cache", lambda: None)
        # The engine's device is the CPU here; its memory questions go to the fake CUDA device.
        for module in (engine.core, engine.device_tier):
            monkeypatch.setattr(module, "gpu_headroom_bytes", lambda device: engine.gpumem.gpu_headroom_bytes(CUDA0))
            monkeypatch.setattr(module, "usable_bytes", lambda device: engine.gpumem.usable_bytes(CUDA0))
        monkeypatch.setattr(engine.device_tier, "gpu_memory_left", lambda device: engine.gpumem.gpu_memory_left(CUDA0))
        monkeypatch.setattr(torch.cuda, "get_per_process_memory_fraction", lambda device=None: self.fraction)
        self.fraction = 1.0
        monkeypatch.setattr(engine.device_tier, "reset_peak", lambda device: torch.cuda.reset_peak_memory_stats(CUDA0))
        monkeypatch.setattr(engine.gpumem, "MARGIN_MIN_BYTES", 0)
        monkeypatch.setattr(engine.gpumem, "MARGIN_SHARE", 0.0)

    def reset(self, device=None) -> None:
        self.peak = self.reserved

    def use(self, nbytes: int) -> None:
        """The process now holds ``nbytes`` (a forward/backward's peak, a generation's)."""
        self.reserved = nbytes
        self.peak = max(self.peak, nbytes)


class _Param:
    def __init__(self, ds_id: int, numel: int) -> None:
        self.ds_id, self.ds_numel, self._numel, self.grad = ds_id, numel, numel, None

    def partition_numel(self) -> int:
        return self._numel


def make_optimizer(monkeypatch, *, fraction=0.5, device_cache_bytes=None, numels=NUMELS, fake=None, host_memory_bytes=None):
    """An OffloadZero3Optimizer over ``numels`` (two parameters a subgroup), bf16 weights on the
    'device' and bf16 gradients reduced into DeepSpeed's flat host buffer."""
    from integrations.settings import ZeroEngineSettings
    from integrations.zero3_optimizer import OffloadZero3Optimizer, ZeroPartitionSubgroup

    fake = fake or RecordingStreams()
    monkeypatch.setattr(engine.core, "streams_for", lambda device: fake)
    opt = OffloadZero3Optimizer.__new__(OffloadZero3Optimizer)
    gen = torch.Generator().manual_seed(0)
    opt.fp16_groups, opt.fp16_partitioned_groups_flat, ids = [], [], 0
    for n in numels:
        opt.fp16_groups.append([_Param(ids, n // 2), _Param(ids + 1, n - n // 2)])
        ids += 2
        w = torch.randn(n, generator=gen).to(torch.bfloat16)
        fake.mark_device(w)
        opt.fp16_partitioned_groups_flat.append(w)
    opt.fp16_partitioned_groups_flat_numel = list(numels)
    opt.sub_group_to_group_id = {i: 0 for i in range(len(numels))}
    opt.grad_partitions_flat_buffer = torch.zeros(sum(numels), dtype=torch.bfloat16)
    opt.offload_optimizer_pin_memory = True
    mapping, off = {}, 0
    for g in opt.fp16_groups:
        for p in g:
            mapping[p.ds_id] = opt.grad_partitions_flat_buffer.narrow(0, off, p.partition_numel())
            off += p.partition_numel()
    opt._DeepSpeedZeroOptimizer_Stage3__param_id_to_grad_partition = mapping
    opt.optimizer = types.SimpleNamespace(
        param_groups=[dict(lr=1e-2, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.01)], step=lambda: None, state={}
    )
    opt.parameter_offload = types.SimpleNamespace(_max_available_parameters_in_numel=0, empty_partition_cache=lambda: None)
    opt.prefetch_elements = 0
    opt.offloaded_states, opt.ipg_buckets, opt.averaged_gradients = set(), {}, {}
    opt.clip_grad, opt.custom_loss_scaler, opt.external_loss_scale, opt.overflow = 0.0, True, 1.0, False
    opt.settings = ZeroEngineSettings(lane_device="cpu")
    # DeepSpeed's step helpers: nothing to check, partition or scale in these tests.
    opt._pre_step = opt._partition_all_parameters = lambda: None
    opt._overflow_check_and_loss_scale_update = lambda update_scale=True: False
    opt._get_norm_groups = lambda: [torch.tensor(1.0)]
    opt._loss_scale_update_and_overflow_cleanup = lambda: False
    opt._post_step = lambda timer_names: None
    opt._unflatten_partitioned_parameters = lambda sub_group_id: None  # the flat weights are what the tests read
    opt.offload_grad_scale, opt._checked_out, opt.plan_summary, opt.tuner_client = 1.0, {}, None, None
    opt._bindings, off = [], 0
    for i, n in enumerate(numels):
        opt._bindings.append(ZeroPartitionSubgroup(opt, i, off))
        off += n
    cfg = EngineConfig(
        device="cpu",
        host_cache_bytes=None,
        device_cache_bytes=device_cache_bytes,
        host_adam="torch",
        auto_device_fraction=False,
        host_memory_bytes=host_memory_bytes,
    )
    opt.offload_engine = SubgroupEngine(opt._bindings, cfg, Knobs(device_fraction=fraction))
    opt.offload_engine.device_lane.chunk_numel = CHUNK
    opt.device_fit = None
    opt.fake = fake
    return opt


def backward(opt, gen: torch.Generator) -> None:
    """What DeepSpeed's backward leaves: each parameter's reduced gradient in its map entry."""
    mapping = opt._DeepSpeedZeroOptimizer_Stage3__param_id_to_grad_partition
    for g in opt.fp16_groups:
        for p in g:
            mapping[p.ds_id].copy_(torch.randn(p.partition_numel(), generator=gen))


def _entries_in(opt, t: torch.Tensor) -> set[int]:
    """ds_ids whose gradient entry lies inside ``t``."""
    lo, hi = t.data_ptr(), t.data_ptr() + t.numel() * t.element_size()
    mapping = opt._DeepSpeedZeroOptimizer_Stage3__param_id_to_grad_partition
    return {i for i, e in mapping.items() if lo <= e.data_ptr() < hi}


OURS_AND_GRADS = ["optim_states", "hp_params", "lp_grads", "contiguous_grad_buffer"]


def _offload_and_reload(opt, mem: FakeCudaMemory | None = None, generation_bytes: int = 0) -> None:
    from deepspeed.runtime.zero.offload_config import OffloadStateTypeEnum

    opt.offload_states(include=[OffloadStateTypeEnum(s) for s in OURS_AND_GRADS])
    if mem is not None:  # an RLHF loop's generation: the GPU is full, then freed again
        mem.use(generation_bytes)
        mem.use(mem.total // 20)
    opt.reload_states()


def test_the_refit_after_offload_states_is_the_first_steps_fit(ds, monkeypatch):
    """After offload_states()/reload_states() the next step's refit is the first step's (with the
    gradient bytes and the prefetch reserve; lane gradients kept on the GPU again), measured from
    a fresh peak, not one that includes the generation phase in between."""
    mem = FakeCudaMemory(monkeypatch, total=600_000)
    opt = make_optimizer(monkeypatch, fraction=1.0)
    gen = torch.Generator().manual_seed(1)
    train_peak = 300_000
    fits, kept = [], []
    for it in range(4):
        if it == 2:
            _offload_and_reload(opt, mem, generation_bytes=590_000)
            assert opt.device_fit is None
        mem.use(train_peak)  # forward/backward's peak
        backward(opt, gen)
        opt.step()
        fits.append(opt.device_fit)
        kept.append(sorted(b.index for b in opt._bindings if b.device_grad is not None))
    first, refit = fits[0], fits[2]
    assert first.device_tier_subgroups >= 2 and first.device_lane_grads_on_device >= 1  # the case is not vacuous
    assert refit == first, (first, refit)
    assert opt.offload_engine.device_tier.grad_bytes_per_element == 2  # lane gradients kept on the device again
    assert kept[2] == kept[0] and kept[3] == kept[0]
    opt.offload_engine.close()


# The iteration's clock (StepRecord.fwd_bwd_s, excluded_s, setup_s: what the tuner judges by).
# Sleeps stand in for the time of each part: an iteration's forward/backward (FWD_S), a skipped
# iteration's or the generation between offload_states and reload_states (AWAY_S), the device
# fit (FIT_S). A bound on the clean time holds unless the machine stalls the test for a tenth
# of AWAY_S or more.
FWD_S, AWAY_S, FIT_S = 0.05, 0.8, 0.4


def test_an_overflow_skipped_step_is_not_timed_as_part_of_the_next(ds, monkeypatch):
    """DeepSpeed skips the step of an iteration whose gradients overflowed (fp16): the engine
    never ran, and the next step's record must not time both iterations as one. The skipped
    one's time goes to that record's excluded_s; its fwd_bwd_s is the next iteration's alone."""
    opt = make_optimizer(monkeypatch)
    overflow = {"now": False}
    opt._loss_scale_update_and_overflow_cleanup = lambda: overflow["now"]  # DeepSpeed's answer: skip the step
    gen = torch.Generator().manual_seed(1)
    for it in range(4):
        overflow["now"] = it == 2
        time.sleep(AWAY_S if it == 2 else FWD_S)  # forward/backward; the skipped iteration's is the long one
        backward(opt, gen)
        opt.step()
    recs = opt.offload_engine.telemetry.records
    assert [r.iteration for r in recs] == [0, 1, 2]
    assert recs[0].excluded_s == recs[1].excluded_s == 0.0
    after = recs[2]  # the step after the skipped one
    assert after.excluded_s >= AWAY_S, after
    assert FWD_S <= after.fwd_bwd_s < FWD_S + AWAY_S / 2, after
    opt.offload_engine.close()


def test_the_gap_between_offload_and_reload_states_and_the_refit_are_not_the_iterations_time(ds, monkeypatch):
    """An RLHF loop offloads the states, generates, reloads them: the cycle is no training
    iteration's, and goes to the next record's excluded_s. The engine's release of the device
    and the device fit that follows (as at the first step) are one-time work: in setup_s, not
    fwd_bwd_s."""
    mem = FakeCudaMemory(monkeypatch, total=600_000)
    opt = make_optimizer(monkeypatch, fraction=1.0)
    eng = opt.offload_engine
    fit, release = eng.fit_device_tier, eng.release_device

    def slow_fit(*args, **kw):  # a fit that takes FIT_S (measuring, allocating, pinning on a real GPU)
        time.sleep(FIT_S)
        return fit(*args, **kw)

    def slow_release():  # and a release (copying the device tier out)
        time.sleep(FIT_S)
        release()

    monkeypatch.setattr(eng, "fit_device_tier", slow_fit)
    monkeypatch.setattr(eng, "release_device", slow_release)
    gen = torch.Generator().manual_seed(1)
    for it in range(4):
        if it == 2:
            from deepspeed.runtime.zero.offload_config import OffloadStateTypeEnum

            opt.offload_states(include=[OffloadStateTypeEnum(s) for s in OURS_AND_GRADS])
            mem.use(590_000)
            time.sleep(AWAY_S)  # generation
            mem.use(0)
            opt.reload_states()
            assert opt.device_fit is None  # the next step fits again
        mem.use(300_000)
        time.sleep(FWD_S)
        backward(opt, gen)
        opt.step()
    recs = eng.telemetry.records
    assert recs[0].setup_s >= FIT_S  # the first step's fit is setup too
    assert recs[1].excluded_s == recs[3].excluded_s == 0.0 and recs[1].setup_s < FIT_S
    after = recs[2]  # the step after reload_states, with its refit
    assert after.device_tier_subgroups == recs[1].device_tier_subgroups > 0  # refitted, as at the first step
    assert after.excluded_s >= AWAY_S, after
    assert after.setup_s >= 2 * FIT_S, after  # the release and the refit
    assert FWD_S <= after.fwd_bwd_s < FWD_S + AWAY_S / 2 and after.fwd_bwd_s < FIT_S, after
    eng.close()


def test_the_gradient_buffer_stays_in_host_memory_across_offload_states(ds, monkeypatch):
    """With offload_optimizer the gradient buffer is the engine's (pinned in place, at its exact
    size): offload_states()/reload_states() leave it where it is (DeepSpeed's lp_grads offload
    would copy it into a power-of-two pinned copy of its own and move it to the GPU), and training
    goes on with the same numbers as a run without the cycle."""
    opt, twin = make_optimizer(monkeypatch), make_optimizer(monkeypatch)
    buf = opt.grad_partitions_flat_buffer
    ptr = buf.data_ptr()
    gens = torch.Generator().manual_seed(1), torch.Generator().manual_seed(1)
    for it in range(4):
        if it == 2:
            _offload_and_reload(opt)
            assert opt.grad_partitions_flat_buffer.data_ptr() == ptr and opt.grad_partitions_flat_buffer.device == buf.device
            assert not hasattr(opt, "lp_grad_partitions_flat_pin_buffers")
            assert not opt.offloaded_states
            host = _entries_in(opt, opt.grad_partitions_flat_buffer)
            assert host == {p.ds_id for g in opt.fp16_groups for p in g}  # every gradient reduced into it
        for o, g in zip((opt, twin), gens):
            backward(o, g)
            o.step()
    for a, b in zip(opt.fp16_partitioned_groups_flat, twin.fp16_partitioned_groups_flat):
        assert torch.equal(a, b)
    for i in range(len(NUMELS)):
        for x, y in zip(opt.offload_engine.read_state(i)[:3], twin.offload_engine.read_state(i)[:3]):
            assert torch.equal(x, y)
    opt.offload_engine.close()
    twin.offload_engine.close()


def test_a_lane_change_places_gradients_for_the_step_it_applies_to(ds, monkeypatch):
    """Knobs apply at the start of a step but gradients are placed after the step before it: the
    lane change due next is handed over at the step's end, and gradients are placed for the lanes
    it sets, so the step a tuner judges reads no moved subgroup's gradient across PCIe."""
    opt = make_optimizer(monkeypatch, fraction=0.0, device_cache_bytes=0)
    eng = opt.offload_engine

    class Client:  # the tuner client's side that matters here: a change due at the next iteration
        due: Knobs | None = None

        def apply_pending(self, engine):
            if self.due is not None:
                engine.set_knobs(self.due)
                self.due = None

    opt.tuner_client = Client()
    gen = torch.Generator().manual_seed(1)
    backward(opt, gen)
    opt.step()
    assert opt.device_fit.device_fraction == 0.0 and not any(b.device_grad is not None for b in opt._bindings)
    opt.tuner_client.due = eng.knobs.replace(device_fraction=1.0)
    backward(opt, gen)
    opt.step()
    lane_grads = {b.index for b in opt._bindings if b.device_grad is not None}
    assert lane_grads and lane_grads == set(eng.device_grad_subgroups())
    backward(opt, gen)
    opt.step()
    assert eng.telemetry.records[-1].device_lane_subgroups == len(NUMELS)
    assert lane_grads == eng.device_tier.device_grads  # the step that ran the new lanes read these in place
    eng.close()


def test_destroy_leaves_the_engines_gradient_buffer_to_it(ds, monkeypatch):
    """DeepSpeed 0.19.8's destroy() unpins its offload buffers; under DS_PIN_MEMORY_BACKEND=native
    that frees by address, and the gradient buffer was pinned in place by the engine
    (cudaHostRegister), not allocated by DeepSpeed: DeepSpeed is handed only what it pinned itself."""
    import deepspeed.runtime.zero.stage3 as stage3
    from deepspeed.accelerator import get_accelerator

    monkeypatch.setattr(stage3, "print_rank_0", lambda *a, **k: None)  # no process group here
    opt = make_optimizer(monkeypatch)
    opt._grad_acc_hooks, opt._leaf_module_hooks, opt.zenflow = [], [], False
    opt._clear_muon_allgather_buffers = lambda: None
    opt.parameter_offload.destroy = lambda: None
    opt.fp32_partitioned_groups_flat = []
    unpinned = []
    monkeypatch.setattr(type(get_accelerator()), "unpin_memory", lambda self, t: unpinned.append(t.data_ptr()))
    buf = opt.grad_partitions_flat_buffer
    opt.destroy()
    assert buf.data_ptr() not in unpinned
    assert opt.grad_partitions_flat_buffer is buf  # still there for whatever reads it after destroy
