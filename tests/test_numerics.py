"""OffloadAdamW against torch.optim.AdamW, fed the same gradients, in every layout."""

from __future__ import annotations

import copy
import os

import pytest
import torch
from helpers import assert_params_close, make_model, needs_cuda, reference_pair

from engine import Knobs, OffloadAdamW, StoragePath

SUB = 700  # elements per subgroup: the test model's 3987 params make 6 subgroups
N_SUB = 6
STATE = 12 * 3987  # bytes of optimizer state of make_model()


def _run(factory, steps=4, **kw):
    model, opt, ref, ref_opt = reference_pair(factory, steps, **kw)
    assert_params_close(model, ref)
    return model, opt, ref, ref_opt


@pytest.mark.parametrize("backend", ["posix", "aio"])
@pytest.mark.parametrize("layout", ["host", "nvme", "mixed", "two_paths", "remote_capped"])
def test_layouts_match_adamw(layout, backend, swap_dirs):
    nvme0, nvme1, pfs = swap_dirs
    kw = {
        "host": dict(host_cache_bytes=None),
        "nvme": dict(host_cache_bytes=0, nvme_paths=[nvme0]),
        "mixed": dict(host_cache_bytes=STATE // 3, nvme_paths=[nvme0]),
        "two_paths": dict(host_cache_bytes=0, nvme_paths=[nvme0, nvme1]),
        # Declared bandwidths make the stripe deterministic: the cap halves the remote share.
        "remote_capped": dict(
            host_cache_bytes=0,
            nvme_paths=[StoragePath(path=nvme0, read_bytes_per_s=400e6, write_bytes_per_s=400e6)],
            remote_paths=[
                StoragePath(path=pfs, kind="remote", read_bytes_per_s=400e6, write_bytes_per_s=400e6, cap_bytes_per_s=200e6)
            ],
        ),
    }[layout]
    # No read-ahead budget and fewer staging buffers than swapped subgroups (prefetch 1: 5 for
    # 6; a third cached, prefetch 0: 3 for 4), so that every step reads state back from the
    # files, not only from buffers that still hold it.
    depth = 0 if layout == "mixed" else 1
    _, opt, _, _ = _run(
        lambda m: OffloadAdamW(
            m.parameters(),
            lr=1e-2,
            subgroup_numel=SUB,
            io_backend=backend,
            host_adam="torch",
            prefetch_depth=depth,
            read_ahead_bytes=0,
            **kw,
        ),
        steps=5,
    )
    rec = opt.telemetry[-1]
    if layout == "host":
        assert opt.engine.swap_paths.io_backend is None and rec.bytes_read == {}
    else:
        assert opt.engine.swap_paths.io_backend == backend
        assert sum(rec.bytes_read.values()) > 0 and sum(rec.bytes_written.values()) > 0
    if layout == "remote_capped":
        for kind in ("remote", "nvme"):
            assert sum(r.bytes_written.get(kind, 0) for r in opt.telemetry) > 0
    opt.close()


@pytest.mark.parametrize("fraction", [0.5, 1.0])
def test_device_lane_on_cpu_matches_adamw(fraction, swap_dir):
    _, opt, _, _ = _run(
        lambda m: OffloadAdamW(
            m.parameters(),
            lr=1e-2,
            subgroup_numel=SUB,
            host_cache_bytes=STATE // 3,
            nvme_paths=[swap_dir],
            device="cpu",
            device_fraction=fraction,
            host_adam="torch",
        )
    )
    rec = opt.telemetry[-1]
    assert rec.device_lane_subgroups == round(N_SUB * fraction) and rec.host_lane_subgroups == N_SUB - rec.device_lane_subgroups
    opt.close()


def test_device_tier_on_cpu_matches_adamw(swap_dir):
    _, opt, _, _ = _run(
        lambda m: OffloadAdamW(
            m.parameters(),
            lr=1e-2,
            subgroup_numel=SUB,
            device_cache_bytes=STATE // 3,
            host_cache_bytes=STATE // 3,
            nvme_paths=[swap_dir],
            device="cpu",
            host_adam="torch",
        )
    )
    tiers = opt.engine.describe().state_bytes_by_tier
    assert set(tiers) == {"device", "host", swap_dir}
    opt.close()


def test_deepspeed_host_kernel_matches_adamw(swap_dir):
    pytest.importorskip("deepspeed")
    from engine.storage.native_ops import load_cpu_adam

    if load_cpu_adam() is None:
        pytest.skip("DeepSpeed cpu_adam op does not build here")
    _, opt, _, _ = _run(
        lambda m: OffloadAdamW(
            m.parameters(), lr=1e-2, subgroup_numel=SUB, host_cache_bytes=0, nvme_paths=[swap_dir], host_adam="deepspeed"
        )
    )
    assert opt.engine.host_kernel_name == "deepspeed"
    opt.close()


def test_param_groups_missing_grads_noncontiguous(swap_dir):
    def model_fn():
        m = make_model()
        # A transposed (non-contiguous) parameter, which is never split across subgroups.
        m.register_parameter("t", torch.nn.Parameter(torch.randn(40, 30).t()))
        return m

    def factory(m):
        ps = list(m.parameters())
        groups = [
            {"params": ps[:3], "lr": 3e-2, "weight_decay": 0.1},
            {"params": ps[3:], "lr": 1e-2, "betas": (0.8, 0.99), "eps": 1e-6, "weight_decay": 0.0},
        ]
        return OffloadAdamW(groups, lr=1e-2, subgroup_numel=SUB, host_cache_bytes=0, nvme_paths=[swap_dir], host_adam="torch")

    def ref_groups(m):
        ps = list(m.parameters())
        return [
            {"params": ps[:3], "lr": 3e-2, "weight_decay": 0.1},
            {"params": ps[3:], "lr": 1e-2, "betas": (0.8, 0.99), "eps": 1e-6, "weight_decay": 0.0},
        ]

    from helpers import feed_same_grads

    model = model_fn()
    ref = copy.deepcopy(model)
    assert not model.t.is_contiguous()
    opt, ref_opt = factory(model), torch.optim.AdamW(ref_groups(ref), lr=1e-2)
    # Param 1 never has a gradient; param 4 skips odd steps (so its step count lags).
    feed_same_grads([(model, opt), (ref, ref_opt)], 6, skip=lambda t, k: k == 1 or (k == 4 and t % 2))
    assert_params_close(model, ref)
    sd, rsd = opt.state_dict(), ref_opt.state_dict()
    assert set(sd["state"]) == set(rsd["state"])
    for i, st in rsd["state"].items():
        assert float(sd["state"][i]["step"]) == float(st["step"])
        torch.testing.assert_close(sd["state"][i]["exp_avg_sq"], st["exp_avg_sq"], rtol=1e-5, atol=1e-9)
    opt.close()


@pytest.mark.parametrize("sub,depth", [(100, 1), (100, 0), (10**9, 2)], ids=["many-subgroups", "no-prefetch", "single-subgroup"])
def test_subgroup_counts(sub, depth, swap_dir):
    _, opt, _, _ = _run(
        lambda m: OffloadAdamW(
            m.parameters(),
            lr=1e-2,
            subgroup_numel=sub,
            host_cache_bytes=0,
            nvme_paths=[swap_dir],
            prefetch_depth=depth,
            host_adam="torch",
        ),
        steps=5,
    )
    n = opt.engine.describe().subgroups
    assert (n == 1) if sub == 10**9 else (n > depth + 2)
    opt.close()


def test_lr_scheduler(swap_dir):
    from helpers import feed_same_grads

    model = make_model()
    ref = copy.deepcopy(model)
    opt = OffloadAdamW(
        model.parameters(), lr=1e-2, subgroup_numel=SUB, host_cache_bytes=0, nvme_paths=[swap_dir], host_adam="torch"
    )
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2)
    scheds = [torch.optim.lr_scheduler.StepLR(o, step_size=1, gamma=0.5) for o in (opt, ref_opt)]
    for t in range(5):
        feed_same_grads([(model, opt), (ref, ref_opt)], 1, seed=t)
        for s in scheds:
            s.step()
    assert_params_close(model, ref)
    assert opt.param_groups[0]["lr"] == pytest.approx(1e-2 * 0.5**5)
    opt.close()


def test_bf16_params_keep_fp32_master(swap_dir):
    """Low-precision weights are written from the fp32 master, which follows fp32 AdamW exactly."""
    model = make_model().to(torch.bfloat16)
    ref = make_model()  # fp32, same init before the cast
    with torch.no_grad():
        for p, r in zip(model.parameters(), ref.parameters()):
            r.copy_(p.float())
    opt = OffloadAdamW(
        model.parameters(), lr=1e-2, subgroup_numel=SUB, host_cache_bytes=0, nvme_paths=[swap_dir], host_adam="torch"
    )
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2)
    from helpers import feed_same_grads

    feed_same_grads([(model, opt), (ref, ref_opt)], 4, grad_dtype=torch.bfloat16)
    sd = opt.state_dict()
    for i, r in enumerate(ref.parameters()):
        torch.testing.assert_close(sd["state"][i]["master"], r.detach(), rtol=1e-5, atol=1e-6)
        assert torch.equal(list(model.parameters())[i], r.detach().to(torch.bfloat16))
    opt.close()


def test_knob_changes_between_steps_keep_numerics(swap_dirs):
    nvme0, nvme1, _ = swap_dirs

    def factory(m):
        return OffloadAdamW(
            m.parameters(),
            lr=1e-2,
            subgroup_numel=SUB,
            host_cache_bytes=0,
            nvme_paths=[nvme0, nvme1],
            device="cpu",
            host_adam="torch",
        )

    model, opt, ref, ref_opt = reference_pair(factory, 2)
    from helpers import feed_same_grads

    knob_sets = [
        Knobs(prefetch_depth=4, io_concurrency={nvme0: 1, nvme1: 8}, node_lock=True, device_fraction=0.3),
        Knobs(prefetch_depth=0, stripe_weights={nvme0: 0.0, nvme1: 1.0}),  # everything moves to nvme1
        Knobs(prefetch_depth=1, stripe_weights={nvme0: 3.0, nvme1: 1.0}, device_fraction=1.0),
    ]
    for k, knobs in enumerate(knob_sets):
        opt.set_knobs(knobs)
        feed_same_grads([(model, opt), (ref, ref_opt)], 2, seed=10 + k)
        assert opt.telemetry[-1].knobs == knobs
        assert_params_close(model, ref)
        if k == 1:
            # Moved lazily at each subgroup's next write: after two steps nothing is read from nvme0.
            assert opt.telemetry[-1].path_bytes_read[nvme0] == 0
            assert opt.telemetry[-1].path_bytes_written[nvme0] == 0
    opt.close()


CUDA_LAYOUTS = {
    "host": dict(host_cache_bytes=None),
    "device_lane_half": dict(host_cache_bytes=None, device_fraction=0.5),
    "device_lane_all": dict(host_cache_bytes=None, device_fraction=1.0),
    "device_lane_nvme": dict(host_cache_bytes=0, device_fraction=0.5, nvme=True),
    "device_tier": dict(device_cache_bytes=STATE // 3, host_cache_bytes=STATE // 3, nvme=True, device_fraction=0.5),
    "device_tier_auto": dict(device_cache_bytes=None, host_cache_bytes=None),
}


def _cuda_spellings() -> list[str]:
    """Both ways to name the GPU: 'cuda' (the current device, its index resolved) and 'cuda:N'."""
    return ["cuda", f"cuda:{torch.cuda.current_device()}"] if torch.cuda.is_available() else ["cuda"]


@needs_cuda
@pytest.mark.parametrize("device", _cuda_spellings())
@pytest.mark.parametrize("layout", sorted(CUDA_LAYOUTS))
def test_cuda_layouts_match_adamw(layout, device, swap_dir):
    """Every lane and tier on a real GPU, the model on the GPU: the side streams, events and
    pinned buffers must order every copy (a missing wait fails on these thin layers). Both
    spellings of the device read the gradients and weights on the GPU in place."""
    kw = dict(CUDA_LAYOUTS[layout])
    if kw.pop("nvme", False):
        kw["nvme_paths"] = [swap_dir]
    model, opt, _, _ = _run(
        lambda m: OffloadAdamW(m.parameters(), lr=1e-2, subgroup_numel=SUB, device=device, host_adam="torch", **kw),
        steps=5,
        model_fn=lambda: make_model().cuda(),
    )
    p = next(model.parameters())
    assert opt.engine.streams.on_device(p) and opt.engine.device.index is not None
    rec = opt.telemetry[-1]
    if layout == "device_tier_auto":
        assert rec.device_tier_subgroups == N_SUB  # a few kB of state: all of it fits the GPU
    elif layout == "device_tier":
        assert rec.device_tier_subgroups > 0 and rec.host_lane_subgroups > 0
    opt.close()


@needs_cuda
def test_cuda_knob_switches_match_adamw(swap_dir):
    """Subgroups move between the lanes from step to step (a tuner's trials)."""
    model = make_model().cuda()
    ref = copy.deepcopy(model)
    opt = OffloadAdamW(
        model.parameters(),
        lr=1e-2,
        subgroup_numel=SUB,
        device="cuda",
        host_cache_bytes=STATE // 2,
        nvme_paths=[swap_dir],
        host_adam="torch",
    )
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2, weight_decay=0.01)
    from helpers import feed_same_grads

    for k, f in enumerate([0.0, 1.0, 0.5, 0.0, 1.0]):
        opt.set_knobs(opt.knobs.replace(device_fraction=f, prefetch_depth=k % 3))
        feed_same_grads([(model, opt), (ref, ref_opt)], 1, seed=30 + k)
        assert_params_close(model, ref)
    opt.close()


def _flat_reference_run(device: str, layout: str, monkeypatch) -> None:
    """What the DeepSpeed binding hands the engine: bf16 flat weights on the device, bf16
    gradients (on the host, or on the device for the GPU-updated layouts) and a gradient
    scale (clipping). Against torch AdamW on fp32 masters fed fp32(grad) * scale."""
    import engine.host_lane as host_lane
    from engine.adamw import AdamWHyper
    from engine.binding import FlatSubgroup
    from engine.config import EngineConfig
    from engine.core import SubgroupEngine

    monkeypatch.setattr(host_lane, "HOST_CHUNK_NUMEL", 64)  # chunk edges fall inside subgroups
    gen = torch.Generator().manual_seed(3)
    sizes = [300, 257, 300, 129]
    weights = [torch.randn(n, generator=gen).to(device=device, dtype=torch.bfloat16) for n in sizes]
    masters = [torch.nn.Parameter(w.float().cpu()) for w in weights]
    ref = torch.optim.AdamW(masters, lr=1e-2, weight_decay=0.01)
    grad_dev = device if layout != "host" else "cpu"
    bindings = [FlatSubgroup(w) for w in weights]
    kw = {
        "host": dict(),
        "device_lane": dict(knobs=Knobs(device_fraction=0.5)),
        "device_tier": dict(device_cache_bytes=2 * 12 * 300),
    }[layout]
    eng = SubgroupEngine(
        bindings,
        EngineConfig(subgroup_numel=300, device=device, host_adam="torch", device_cache_bytes=kw.get("device_cache_bytes", 0)),
        kw.get("knobs"),
    )
    for step in range(4):
        scale = 1.0 if step == 2 else 0.37 + 0.1 * step
        for b, m in zip(bindings, masters):
            g = (torch.randn(b.numel, generator=gen) * 3).to(torch.bfloat16)
            b.grad = g.to(grad_dev)
            b.grad_scale = scale
            m.grad = g.float() * scale
        eng.step([AdamWHyper(lr=1e-2)])
        ref.step()
        for k, (b, m) in enumerate(zip(bindings, masters)):
            got = eng.read_state(k)[0]
            torch.testing.assert_close(got, m.detach(), rtol=1e-5, atol=1e-6)
            torch.testing.assert_close(b.weight.float().cpu(), m.detach().bfloat16().float(), rtol=0, atol=0)
            assert b.grad.dtype == torch.bfloat16  # the engine read the gradient, never unscaled it in place
    eng.close()


@pytest.mark.parametrize("layout", ["host", "device_lane", "device_tier"])
def test_flat_bf16_binding_with_grad_scale_on_cpu(layout, monkeypatch):
    _flat_reference_run("cpu", layout, monkeypatch)


@needs_cuda
@pytest.mark.parametrize("layout", ["host", "device_lane", "device_tier"])
def test_flat_bf16_binding_with_grad_scale_on_cuda(layout, monkeypatch):
    _flat_reference_run("cuda", layout, monkeypatch)


@pytest.mark.parametrize("backend", ["aio", "posix"])
def test_stripe_change_reverted_before_the_move_keeps_state(swap_dirs, backend):
    """A tuner trial moves stripe weight and reverts it one step later, before some kept
    subgroups were written to their new path: their state must stay where it is, intact."""
    nvme0, nvme1, _ = swap_dirs

    def factory(m):
        return OffloadAdamW(
            m.parameters(),
            lr=1e-2,
            subgroup_numel=SUB,
            host_cache_bytes=0,
            nvme_paths=[nvme0, nvme1],
            io_backend=backend,
            host_adam="torch",
            prefetch_depth=2,
        )

    model, opt, ref, ref_opt = reference_pair(factory, 2)
    from helpers import feed_same_grads

    base = opt.engine.knobs
    for k, knobs in enumerate([base.replace(stripe_weights={nvme0: 3.0, nvme1: 1.0}), base, base]):
        opt.set_knobs(knobs)
        feed_same_grads([(model, opt), (ref, ref_opt)], 1 if k < 2 else 3, seed=20 + k)
        assert_params_close(model, ref)
    for sg in opt.engine.subgroups:
        if sg.tier.swapped:
            assert os.path.exists(sg.swap.file.filename), f"subgroup {sg.index}'s swap file was removed"
    opt.close()


def test_io_overlap_is_bit_identical_to_no_overlap(swap_dir):
    """Writes behind the step, reads ahead of it (with a read-ahead budget, and without one) and
    reused copies change when bytes move, never what they are: every parameter and moment is
    bit-identical to the same run with each step waiting for its writes, and close to torch AdamW."""
    results = []
    for kw in (dict(overlap_io=False), dict(read_ahead_bytes=0), dict(read_ahead_bytes=None), dict(prefetch_depth=0)):
        model, opt, ref, _ = _run(
            lambda m, kw=kw: OffloadAdamW(
                m.parameters(),
                lr=1e-2,
                subgroup_numel=SUB // 2,
                host_cache_bytes=0,
                nvme_paths=[swap_dir],
                host_adam="torch",
                **kw,
            ),
            steps=6,
        )
        recs = opt.telemetry
        assert sum(sum(r.bytes_read.values()) for r in recs[1:]) > 0, kw  # state came back from the files
        # The auto budget takes buffers once forward and backward were timed; the others take none.
        auto = kw.get("read_ahead_bytes") is None and kw.get("overlap_io", True)
        assert (opt.engine.transfers.read_ahead_bytes > 0) == auto, kw
        assert all(r.read_ahead_bytes == opt.engine.transfers.read_ahead_bytes for r in recs[2:]), kw
        sd = opt.state_dict()
        results.append(
            ([p.detach().clone() for p in model.parameters()], [(s["exp_avg"], s["exp_avg_sq"]) for s in sd["state"].values()])
        )
        opt.close()
    base_params, base_moments = results[0]
    for params, moments in results[1:]:
        assert all(torch.equal(a, b) for a, b in zip(base_params, params))
        assert all(torch.equal(a, c) and torch.equal(b, d) for (a, b), (c, d) in zip(base_moments, moments))
