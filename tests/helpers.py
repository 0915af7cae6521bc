"""Helpers the tests share (conftest.py keeps the fixtures): reference runs against
torch.optim.AdamW fed the same gradients, the ``offloadctl`` command in a child process, free
ports, mounts, polling, and skip marks. Training runs of the test scripts are in ``ds_runs.py``."""

from __future__ import annotations

import contextlib
import copy
import glob
import os
import random
import socket
import subprocess
import sys
import tempfile
import time

import pytest
import torch

IS_ROOT = os.geteuid() == 0
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


_PORTS = random.Random()  # seeded from the OS: each process, and each session, draws its own ports


def load_bench(name: str):
    """``bench/NAME.py`` as a module, for its pure parts; ``sys.path`` as it was (the script puts
    the checkout first on it for itself)."""
    import importlib.util
    import sys

    spec = importlib.util.spec_from_file_location(f"bench_{name}_under_test", os.path.join(ROOT, "bench", f"{name}.py"))
    mod = importlib.util.module_from_spec(spec)
    saved = list(sys.path)
    try:
        spec.loader.exec_module(mod)
    finally:
        sys.path[:] = saved
    return mod


def free_port() -> str:
    """A TCP port nothing listens on now and no DeepSpeed shm buffer names, for a launcher's
    --master_port: drawn at random from a block of its own per pytest-xdist worker, below the
    kernel's ephemeral range (from 32768), so that neither another worker's launches nor the
    connections gloo opens can take it meanwhile, and another pytest session on the machine
    rarely draws it."""
    worker = os.environ.get("PYTEST_XDIST_WORKER", "gw0")
    base = 20000 + 2000 * (int(worker[2:]) % 6 if worker[2:].isdigit() else 0)
    for _ in range(500):
        port = base + _PORTS.randrange(2000)
        if glob.glob(f"/dev/shm/deepspeed_allreduce_buffer_*_{port}_*"):
            continue  # a run on this port (maybe of another session) is starting or was killed
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
        return str(port)
    raise RuntimeError(f"no free port in {base}..{base + 1999}")


def env_with_root(**extra: str) -> dict:
    """This process's environment, with the checkout importable (children run its modules)."""
    return dict(os.environ, PYTHONPATH=ROOT, **extra)


def cli(*args: str, timeout: float = 600, env: dict | None = None, **kw) -> subprocess.CompletedProcess:
    """``offloadctl ARGS`` in a child process from the checkout's root, output captured."""
    return subprocess.run(
        [sys.executable, "-m", "offloadctl.cli", *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        env=env or env_with_root(),
        cwd=ROOT,
        **kw,
    )


def make_model(seed: int = 0) -> torch.nn.Module:
    """Layers of poor arithmetic density and odd sizes, so subgroup edges cut through params."""
    torch.manual_seed(seed)
    return torch.nn.Sequential(
        torch.nn.Linear(37, 53), torch.nn.LayerNorm(53), torch.nn.Linear(53, 29, bias=False), torch.nn.Linear(29, 11)
    )


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
        torch.testing.assert_close(
            pa.detach().float(), pb.detach().float(), rtol=rtol, atol=atol, msg=lambda m, name=name: f"{name}: {m}"
        )


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


def registered_run(run_dir: str, run_id: str, nvme: str, iterations: int = 4, *, with_knobs: bool = False):
    """A private tuner daemon for ``run_dir`` and one engine-side rank of ``run_id`` that has
    reported ``iterations`` (with its knobs in each record where ``with_knobs``): (socket, stop,
    the rank's client)."""
    from engine.config import Knobs
    from engine.telemetry import StepRecord
    from tuner import service
    from tuner.client import TunerClient
    from tuner.protocol import Connection
    from tuner.run_state import RunFacts

    sock, stop = service.ensure_daemon(os.path.join(os.path.dirname(run_dir), "no-system.sock"), run_dir=run_dir)
    rank = TunerClient(sock, RunFacts(params=1000, paths=(nvme,), subgroup_bytes=12000), Knobs(), run_id=run_id, rank=0)
    assert rank.connected.wait(20)
    for i in range(iterations):
        rank.report(
            StepRecord(
                iteration=i,
                update_s=0.2,
                read_wait_s=0.05,
                kernel_s=0.1,
                write_wait_s=0.05,
                path_bytes_read={nvme: 20_000_000},
                path_bytes_written={nvme: 10_000_000},
                **({"knobs": Knobs()} if with_knobs else {}),
            ),
            iter_time_s=0.5,
        )

    def reported() -> bool:
        with Connection(sock) as c:
            return any(
                r["iteration"] == iterations - 1 and r["run_id"] == run_id for r in c.request("snapshot", history=0)["runs"]
            )

    wait_for(reported, 20, f"{run_id}'s telemetry")
    return sock, stop, rank
