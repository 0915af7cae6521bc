"""Save/load round trips continue exactly as an uninterrupted run."""

from __future__ import annotations

import copy

import pytest
import torch
from helpers import assert_params_close, feed_same_grads, make_model

from engine import OffloadAdamW, StoragePath

SUB = 700


def _opt(model, path, **kw):
    return OffloadAdamW(
        model.parameters(), lr=1e-2, subgroup_numel=SUB, host_cache_bytes=12 * 1500, nvme_paths=[path], host_adam="torch", **kw
    )


def test_round_trip_through_disk_continues_identically(swap_dirs, tmp_path):
    nvme0, nvme1, _ = swap_dirs
    model = make_model()
    resumed_model = copy.deepcopy(model)
    opt = _opt(model, nvme0)
    feed_same_grads([(model, opt)], 3, seed=1)
    ckpt = str(tmp_path / "ckpt.pt")
    torch.save(model.state_dict(), str(tmp_path / "model.pt"))
    opt.save(ckpt)
    feed_same_grads([(model, opt)], 3, seed=2)  # the uninterrupted run: steps 4-6

    # A new optimizer on another path, with no host cache, resumes from the file.
    resumed_model.load_state_dict(torch.load(str(tmp_path / "model.pt")))
    resumed = OffloadAdamW(
        resumed_model.parameters(), lr=1e-2, subgroup_numel=SUB, host_cache_bytes=0, nvme_paths=[nvme1], host_adam="torch"
    )
    resumed.load_state_dict(torch.load(ckpt))
    feed_same_grads([(resumed_model, resumed)], 3, seed=2)
    assert_params_close(resumed_model, model, rtol=0, atol=0)  # bit-identical
    opt.close()
    resumed.close()


def test_state_dict_is_adamw_compatible(swap_dir):
    model = make_model()
    ref = copy.deepcopy(model)
    opt = _opt(model, swap_dir)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2)
    feed_same_grads([(model, opt), (ref, ref_opt)], 2)
    sd, rsd = opt.state_dict(), ref_opt.state_dict()
    assert sd["param_groups"][0]["params"] == rsd["param_groups"][0]["params"]
    for i, st in rsd["state"].items():
        for key in ("step", "exp_avg", "exp_avg_sq"):
            torch.testing.assert_close(sd["state"][i][key], st[key], rtol=1e-5, atol=1e-9)
    # Both directions: AdamW state into OffloadAdamW, OffloadAdamW state into AdamW.
    opt2 = _opt(copy.deepcopy(ref), swap_dir)
    opt2.load_state_dict(rsd)
    ref_opt2 = torch.optim.AdamW(copy.deepcopy(ref).parameters(), lr=1e-2)
    ref_opt2.load_state_dict(sd)
    m2 = opt2.param_groups[0]["params"]
    feed_same_grads([(_as_module(m2), opt2), (ref, ref_opt)], 2, seed=9)
    for a, b in zip(m2, ref.parameters()):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
    opt.close()
    opt2.close()


def _as_module(params):
    m = torch.nn.Module()
    for i, p in enumerate(params):
        m.register_parameter(f"p{i}", p)
    return m


@pytest.mark.parametrize("host_cache", [None, 0], ids=["host", "nvme"])
def test_write_state_takes_tensors_that_require_grad(swap_dir, host_cache):
    """A stock DeepSpeed checkpoint's fp32 groups may require grad, and DeepSpeed builds the
    optimizer (so the engine's buffers and their views) under no_grad: writing one into the engine
    reads it as data (no "A view was created in no_grad mode ..." error)."""
    from engine import EngineConfig, FlatSubgroup, SubgroupEngine

    w = torch.randn(3000)
    with torch.no_grad():
        eng = SubgroupEngine(
            [FlatSubgroup(w[:1500]), FlatSubgroup(w[1500:])],
            EngineConfig(host_cache_bytes=host_cache, paths=(StoragePath(path=swap_dir),), host_adam="torch", io_backend="posix"),
        )
    master = torch.randn(1500, requires_grad=True)
    m, v = torch.rand(1500, requires_grad=True), torch.rand(1500)
    eng.write_state(1, master, m, v, [7])
    got = eng.read_state(1)
    torch.testing.assert_close(got[0], master.detach(), rtol=0, atol=0)
    torch.testing.assert_close(got[1], m.detach(), rtol=0, atol=0)
    assert got[3] == [7]
    eng.close()
