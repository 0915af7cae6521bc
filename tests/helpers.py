"""Helpers the tests share (conftest.py keeps the fixtures): reference runs against
torch.optim.AdamW fed the same gradients, mounts, polling, and skip marks."""
from __future__ import annotations

import contextlib
import copy
import os
import subprocess
import tempfile
import time

import pytest
import torch

IS_ROOT = os.geteuid() == 0


def make_model(seed: int = 0) -> torch.nn.Module:
    """Layers of poor arithmetic density and odd sizes, so subgroup edges cut through params."""
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(37, 53), torch.nn.LayerNorm(53), torch.nn.Linear(53, 29, bias=False),
                               torch.nn.Linear(29, 11))


def feed_same_grads(models_opts, steps: int, seed: int = 1, skip=None, scale: float = 1.0, grad_dtype=None):
    """Give every model identical gradients each step, then step every optimizer.

    ``skip(step, param_index) -> bool`` leaves that parameter's grad as None for the step.
    """
    gen = torch.Generator().manual_seed(seed)
    ref_params = list(models_opts[0][0].parameters())
    for t in range(steps):
        # On the CPU (seeded, the same everywhere), then onto each parameter's device below.
        grads = [torch.randn(p.shape, generator=gen) * scale for p in ref_params]
        if grad_dtype is not None:  # round once, so that every model sees the same values
            grads = [g.to(grad_dtype).float() for g in grads]
        for model, opt in models_opts:
            opt.zero_grad(set_to_none=True)
            for k, (p, g) in enumerate(zip(model.parameters(), grads)):
                if skip is None or not skip(t, k):
                    p.grad = g.to(device=p.device, dtype=p.dtype).clone()
            opt.step()


def assert_params_close(a: torch.nn.Module, b: torch.nn.Module, rtol: float = 1e-5, atol: float = 1e-6) -> None:
    for (name, pa), pb in zip(a.named_parameters(), b.parameters()):
        torch.testing.assert_close(pa.detach().float(), pb.detach().float(), rtol=rtol, atol=atol,
                                   msg=lambda m, name=name: f"{name}: {m}")


def reference_pair(opt_factory, steps: int = 4, *, model_fn=make_model, ref_kwargs=None, **feed):
    """Train a model with ``opt_factory(params)`` and a deep copy with torch AdamW; return both."""
    model = model_fn()
    ref = copy.deepcopy(model)
    opt = opt_factory(model)
    ref_opt = torch.optim.AdamW(ref.parameters(), **(ref_kwargs or dict(lr=1e-2, weight_decay=0.01)))
    feed_same_grads([(model, opt), (ref, ref_opt)], steps, **feed)
    return model, opt, ref, ref_opt


@contextlib.contextmanager
def mounted(fstype: str, options: str = ""):
    """A fresh mount of ``fstype`` (tmpfs, ramfs) in a temporary directory; root only."""
    d = tempfile.mkdtemp(prefix=f"offloadctl-{fstype}-")
    cmd = ["mount", "-t", fstype] + (["-o", options] if options else []) + [fstype, d]
    subprocess.run(cmd, check=True, capture_output=True)
    try:
        yield d
    finally:
        subprocess.run(["umount", "-l", d], check=False, capture_output=True)
        os.rmdir(d)


def wait_for(cond, timeout_s: float, what: str):
    """Poll ``cond()`` until it is truthy (and return it), or fail naming ``what``."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        v = cond()
        if v:
            return v
        time.sleep(0.05)
    raise AssertionError(f"timed out waiting for {what}")


def needs_root(test, reason: str = "needs root to mount a file system"):
    """Marked ``root`` (``pytest -m root`` runs these alone) and skipped without root."""
    return pytest.mark.root(pytest.mark.skipif(not IS_ROOT, reason=reason)(test))


needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
