"""AdamW update math, kept apart from where the state lives.

``adamw_update_`` is the one update function every lane calls: the host lane with CPU
tensors, the device lane with device tensors. It applies decoupled weight decay exactly as
``torch.optim.AdamW`` does (Loshchilov & Hutter), through the same fused kernel
``torch._fused_adamw_``, so results match the reference to rounding.

The host lane may instead use DeepSpeed's AVX ``DeepSpeedCPUAdam`` kernel; ``select_host_kernel``
measures both and keeps the faster. The two round differently in the last bit, so the choice is
measured once per machine and environment and kept in a file (``KERNEL_CHOICE_FILE``): every
rank, every run and every resume then takes the same kernel, and the same seed gives the same
losses.
"""
from __future__ import annotations

import fcntl
import functools
import json
import logging
import os
import platform
import statistics
import time
from dataclasses import dataclass
from typing import Callable, Sequence

import torch

from engine.storage.native_ops import extensions_dir, load_cpu_adam

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class AdamWHyper:
    """Hyper-parameters of one param group at one step."""

    lr: float
    beta1: float = 0.9
    beta2: float = 0.999
    eps: float = 1e-8
    weight_decay: float = 0.01


def hyper_from_group(g: dict) -> AdamWHyper:
    """The hyper-parameters of a ``torch.optim`` param group (lr, betas, eps, weight_decay)."""
    b1, b2 = g["betas"]
    return AdamWHyper(lr=float(g["lr"]), beta1=float(b1), beta2=float(b2), eps=float(g["eps"]),
                      weight_decay=float(g.get("weight_decay", 0.0)))


@dataclass
class AdamWSlices:
    """Views of one subgroup's state that share a step count, ready for one fused call.

    ``steps`` are float32 scalars on the tensors' device, as the fused kernel wants them; they
    already hold the new step number (the caller increments before calling).
    """

    params: list[torch.Tensor]
    grads: list[torch.Tensor]
    exp_avgs: list[torch.Tensor]
    exp_avg_sqs: list[torch.Tensor]
    steps: list[torch.Tensor]


def adamw_update_torch_(s: AdamWSlices, hp: AdamWHyper) -> None:
    """One AdamW step on every slice, in place, with torch's fused kernel."""
    if not s.params:
        return
    torch._fused_adamw_(
        s.params, s.grads, s.exp_avgs, s.exp_avg_sqs, [], s.steps,
        lr=hp.lr, beta1=hp.beta1, beta2=hp.beta2, weight_decay=hp.weight_decay, eps=hp.eps,
        amsgrad=False, maximize=False,
    )


class _DeepSpeedCpuAdam:
    """DeepSpeed's AVX CPU AdamW called on flat tensors, without its per-parameter state."""

    def __init__(self) -> None:
        self._op = load_cpu_adam()
        if self._op is None:
            raise RuntimeError("DeepSpeed cpu_adam op did not build")
        self._opt_id = 0x0FF1 + id(self) % 10_000
        # adamw_mode=True: decoupled weight decay, as torch.optim.AdamW.
        self._op.create_adam(self._opt_id, 1e-3, 0.9, 0.999, 1e-8, 0.0, True, False)

    def __call__(self, s: AdamWSlices, hp: AdamWHyper) -> None:
        for p, g, m, v, step in zip(s.params, s.grads, s.exp_avgs, s.exp_avg_sqs, s.steps):
            self._op.adam_update(self._opt_id, int(step.item()), hp.lr, hp.beta1, hp.beta2, hp.eps,
                                 hp.weight_decay, True, p, g, m, v)


HostKernel = Callable[[AdamWSlices, AdamWHyper], None]


def measure_host_kernels(numel: int = 1 << 24, reps: int = 7) -> dict[str, float]:
    """Measured params/s of each available host kernel ('torch', and 'deepspeed' when its op
    builds), on one flat fp32 buffer larger than the caches. Runs alternate between kernels and
    the median is kept, so that a burst of noise does not pick the slower one."""
    kernels: dict[str, HostKernel] = {"torch": adamw_update_torch_}
    try:
        kernels["deepspeed"] = _DeepSpeedCpuAdam()
    except Exception as e:  # op cannot build here (no compiler, no AVX): torch's kernel still works
        log.info("DeepSpeedCPUAdam unavailable: %s", e)
    # A private generator: the measurement runs inside the user's deepspeed.initialize and must
    # not move their RNG state (dropout masks would differ from a stock run).
    gen = torch.Generator().manual_seed(0)
    t = [torch.rand(numel, generator=gen) for _ in range(4)]
    s = AdamWSlices([t[0]], [t[1]], [t[2]], [t[3]], [torch.tensor(1.0)])
    hp = AdamWHyper(lr=1e-6)
    times: dict[str, list[float]] = {k: [] for k in kernels}
    for k in kernels:
        kernels[k](s, hp)  # warm-up
    for _ in range(reps):
        for k, kernel in kernels.items():
            t0 = time.perf_counter()
            kernel(s, hp)
            times[k].append(time.perf_counter() - t0)
    return {k: numel / statistics.median(v) for k, v in times.items()}


_measured_rates: dict[str, float] = {}


def host_kernel_rate(name: str) -> float:
    """Params/s of host kernel ``name`` in this process (measured once, on first need)."""
    if name not in _measured_rates:
        _measured_rates.update(measure_host_kernels())
    return _measured_rates.get(name, 0.0)


KERNEL_CHOICE_FILE = "offloadctl-host-kernel.json"
"""Kept beside the built ops (one per environment: the same torch, DeepSpeed and compiler)."""


def _machine_key() -> str:
    """What the kernels' relative speed depends on: the CPU, the threads a process uses, the
    library versions."""
    model = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            model = next((ln.split(":", 1)[1].strip() for ln in f if ln.startswith("model name")), model)
    except OSError:
        pass
    try:
        import deepspeed
        ds = deepspeed.__version__
    except Exception:
        ds = "none"
    return f"{model}|threads={torch.get_num_threads()}|torch={torch.__version__}|deepspeed={ds}"


def chosen_host_kernel() -> str:
    """The faster host kernel on this machine: read from ``KERNEL_CHOICE_FILE``, or measured once
    (under a lock, so that ranks starting together agree) and written there."""
    path = os.path.join(extensions_dir(), KERNEL_CHOICE_FILE)
    key = _machine_key()
    try:
        os.makedirs(extensions_dir(), exist_ok=True)
        fd = os.open(path + ".lock", os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
    except OSError:
        fd = -1  # nowhere to keep it: measured in this process
    try:
        if fd >= 0:
            fcntl.flock(fd, fcntl.LOCK_EX)
        try:
            with open(path) as f:
                known = json.load(f)
            if not isinstance(known, dict):
                known = {}
        except (OSError, ValueError):
            known = {}
        entry = known.get(key)
        if isinstance(entry, dict) and entry.get("kernel") in ("torch", "deepspeed"):
            rates = entry.get("params_per_s", {})
            # Measured before the cpu_adam op was built, or the op is gone since: measure again.
            if ("deepspeed" in rates) == (load_cpu_adam() is not None):
                _measured_rates.update({k: float(v) for k, v in rates.items()})
                return entry["kernel"]
        rates = measure_host_kernels()
        _measured_rates.update(rates)
        best = max(rates, key=rates.get)
        known[key] = {"kernel": best, "params_per_s": rates}
        tmp = f"{path}.{os.getpid()}.tmp"
        try:
            with open(tmp, "w") as f:
                json.dump(known, f, indent=1)
            os.replace(tmp, path)
        except OSError as e:  # a read-only environment: measured each time, still correct
            log.info("cannot keep the host kernel choice in %s: %s", path, e)
            try:
                os.unlink(tmp)
            except OSError:
                pass
        log.info("host AdamW kernel: %s (%s)", best, ", ".join(f"{k} {v:.3g} params/s" for k, v in rates.items()))
        return best
    finally:
        if fd >= 0:
            os.close(fd)


@functools.lru_cache(maxsize=None)
def select_host_kernel(choice: str = "auto") -> tuple[str, HostKernel]:
    """The host-lane kernel for ``choice`` ('auto', 'torch', 'deepspeed'), as (name, callable)."""
    if choice == "auto":
        choice = chosen_host_kernel()
    if choice == "deepspeed":
        return "deepspeed", _DeepSpeedCpuAdam()
    return "torch", adamw_update_torch_


def group_runs(step_counts: Sequence[int], has_grad: Sequence[bool]) -> list[tuple[int, int]]:
    """Maximal runs [i, j) of consecutive slices that have a gradient and share a step count.

    In the usual case (every slice has a gradient, all at the same step) this is one run, so a
    whole subgroup is updated with one fused call.
    """
    runs: list[tuple[int, int]] = []
    i, n = 0, len(step_counts)
    while i < n:
        if not has_grad[i]:
            i += 1
            continue
        j = i + 1
        while j < n and has_grad[j] and step_counts[j] == step_counts[i]:
            j += 1
        runs.append((i, j))
        i = j
    return runs
