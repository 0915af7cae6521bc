"""The engine's step hook (how a tuner plugs in) and the one host-cache rule."""

from __future__ import annotations

import os

import pytest
import torch

from engine import AdamWHyper, EngineConfig, FlatSubgroup, OffloadAdamW, SubgroupEngine
from engine.config import StoragePath, resolve_host_cache
from engine.hooks import StepHook


class Recorder(StepHook):
    def __init__(self, fail_before: bool = False) -> None:
        self.calls: list[tuple] = []
        self.fail_before = fail_before

    def before_step(self, engine):
        self.calls.append(("before", engine.iteration, engine.knobs.prefetch_depth))
        if self.fail_before:
            raise RuntimeError("hook failed")
        if engine.iteration == 1:
            engine.set_knobs(engine.knobs.replace(prefetch_depth=5))

    def after_step(self, engine, record):
        self.calls.append(("after", record.iteration, record.knobs.prefetch_depth))

    def on_error(self, engine, error):
        self.calls.append(("error", str(error)))

    def close(self):
        self.calls.append(("close",))


def _engine(n: int = 300, **config) -> SubgroupEngine:
    w, g = torch.zeros(n), torch.ones(n)
    return SubgroupEngine(
        [FlatSubgroup(w[o : o + 100], g[o : o + 100]) for o in range(0, n, 100)],
        EngineConfig(subgroup_numel=100, host_adam="torch", **config),
    )


def test_hooks_run_around_each_step_and_a_change_they_make_applies_to_that_step():
    eng = _engine()
    hook = Recorder()
    eng.add_step_hook(hook)
    for _ in range(3):
        eng.step([AdamWHyper(lr=1e-3)])
    eng.close()
    eng.close()
    assert hook.calls == [
        ("before", 0, 2),
        ("after", 0, 2),
        ("before", 1, 2),
        ("after", 1, 5),
        ("before", 2, 5),
        ("after", 2, 5),
        ("close",),
    ]


def test_a_failing_step_reaches_on_error_and_is_raised():
    eng = _engine()
    hook = Recorder(fail_before=True)
    eng.add_step_hook(hook)
    with pytest.raises(RuntimeError, match="hook failed"):
        eng.step([AdamWHyper(lr=1e-3)])
    eng.close()
    assert hook.calls == [("before", 0, 2), ("error", "hook failed"), ("close",)]


@pytest.mark.parametrize(
    "budget, paths, want", [(None, (), None), (None, ("/p",), 0), (0, (), 0), (4096, ("/p",), 4096), (4096, (), 4096)]
)
def test_resolve_host_cache(budget, paths, want):
    assert resolve_host_cache(budget, paths) == want


def test_offload_adamw_with_paths_and_no_budget_puts_state_on_the_paths(tmp_path):
    """The rule `offloadctl train` follows holds for OffloadAdamW too: paths given means state on
    the paths (not everything in memory with the paths silently unused)."""
    swap = tmp_path / "swap"
    swap.mkdir()
    model = torch.nn.Linear(32, 32)
    ref_model = torch.nn.Linear(32, 32)
    ref_model.load_state_dict(model.state_dict())
    opt = OffloadAdamW(
        model.parameters(), lr=1e-2, subgroup_numel=256, host_adam="torch", io_backend="posix", nvme_paths=[str(swap)]
    )
    ref = torch.optim.AdamW(ref_model.parameters(), lr=1e-2, weight_decay=0.01)
    try:
        tiers = opt.engine.describe().state_bytes_by_tier
        assert set(tiers) == {StoragePath(path=str(swap)).path}, tiers
        assert any(os.scandir(swap)), "no swap files on the path"
        x = torch.randn(4, 32, device="cpu")  # host tensors: the models live on the CPU here
        for _ in range(3):
            for m, o in ((model, opt), (ref_model, ref)):
                o.zero_grad()
                m(x).square().mean().backward()
                o.step()
        for p, q in zip(model.parameters(), ref_model.parameters()):
            torch.testing.assert_close(p, q)
    finally:
        opt.close()
