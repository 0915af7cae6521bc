"""AdamW update math, kept apart from where the state lives.

``adamw_update_torch_`` is the update both lanes can run: the host lane with CPU tensors, the
device lane with device tensors. It applies decoupled weight decay exactly as
``torch.optim.AdamW`` does (Loshchilov & Hutter), through the same fused kernel
``torch._fused_adamw_``, so results match the reference to rounding.

The host lane may instead use DeepSpeed's AVX ``DeepSpeedCPUAdam`` kernel (``DeepSpeedCpuAdam``);
which of the two it runs is :mod:`engine.host_kernel`'s choice.
"""

from __future__ import annotations

import logging
import statistics
import time
from dataclasses import dataclass
from typing import Any, Callable, Sequence

import torch

from engine.storage.native_ops import load_cpu_adam, load_host_fused

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class AdamWHyper:
    """Hyper-parameters of one param group at one step."""

    lr: float
    beta1: float = 0.9
    beta2: float = 0.999
    eps: float = 1e-8
    weight_decay: float = 0.01


def hyper_from_group(g: dict[str, Any]) -> AdamWHyper:
    """The hyper-parameters of a ``torch.optim`` param group (lr, betas, eps, weight_decay)."""
    b1, b2 = g["betas"]
    return AdamWHyper(
        lr=float(g["lr"]), beta1=float(b1), beta2=float(b2), eps=float(g["eps"]), weight_decay=float(g.get("weight_decay", 0.0))
    )


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


def adamw_update_torch_(s: AdamWSlices, hyper: AdamWHyper) -> None:
    """One AdamW step on every slice, in place, with torch's fused kernel."""
    if not s.params:
        return
    torch._fused_adamw_(
        s.params,
        s.grads,
        s.exp_avgs,
        s.exp_avg_sqs,
        [],
        s.steps,
        lr=hyper.lr,
        beta1=hyper.beta1,
        beta2=hyper.beta2,
        weight_decay=hyper.weight_decay,
        eps=hyper.eps,
        amsgrad=False,
        maximize=False,
    )


class DeepSpeedCpuAdam:
    """DeepSpeed's AVX CPU AdamW called on flat tensors, without its per-parameter state.

    Where our fused op is built (``engine/csrc/host_fused.cpp``: the same kernel, with the
    gradient upcast, unscale and weight cast in its one parallel region), every call goes through
    it, :meth:`fused_step` included: one optimizer table, whose running products of the betas
    advance once per step as in stock's op, whichever of the two calls a subgroup takes."""

    def __init__(self) -> None:
        fused = load_host_fused()
        op = fused if fused is not None else load_cpu_adam()
        if op is None:
            raise RuntimeError("DeepSpeed cpu_adam op did not build")
        self._op = op
        self.fused = fused is not None  # else the lane runs its chunks op by op
        self._opt_id = 0x0FF1 + id(self) % 10_000
        # adamw_mode=True: decoupled weight decay, as torch.optim.AdamW.
        self._op.create_adam(self._opt_id, 1e-3, 0.9, 0.999, 1e-8, 0.0, True, False)

    def __call__(self, s: AdamWSlices, hyper: AdamWHyper) -> None:
        for p, g, m, v, step in zip(s.params, s.grads, s.exp_avgs, s.exp_avg_sqs, s.steps):
            self._op.adam_update(
                self._opt_id,
                int(step.item()),
                hyper.lr,
                hyper.beta1,
                hyper.beta2,
                hyper.eps,
                hyper.weight_decay,
                True,
                p,
                g,
                m,
                v,
            )

    def fused_step(
        self,
        step: int,
        hyper: AdamWHyper,
        state: tuple[torch.Tensor, torch.Tensor, torch.Tensor],
        grads: list[tuple[int, torch.Tensor]],
        scale: float,
        weights: list[tuple[int, torch.Tensor]],
    ) -> None:
        """One step of a run of a subgroup: ``state`` its (master, exp_avg, exp_avg_sq) fp32
        views, ``grads`` the (offset, flat gradient) pieces that cover it in order, multiplied
        by ``scale`` where it is not 1, and the new master cast into each (offset, flat weight)."""
        master, exp_avg, exp_avg_sq = state
        self._op.fused_step(
            self._opt_id,
            step,
            hyper.lr,
            hyper.beta1,
            hyper.beta2,
            hyper.eps,
            hyper.weight_decay,
            master,
            exp_avg,
            exp_avg_sq,
            [g for _, g in grads],
            [off for off, _ in grads],
            scale,
            [w for _, w in weights],
            [off for off, _ in weights],
        )


HostKernel = Callable[[AdamWSlices, AdamWHyper], None]


def host_kernels() -> dict[str, HostKernel]:
    """The host kernels that run here: torch's always, DeepSpeed's when its op loads."""
    kernels: dict[str, HostKernel] = {"torch": adamw_update_torch_}
    try:
        kernels["deepspeed"] = DeepSpeedCpuAdam()
    except Exception as e:  # op cannot build here (no compiler, no AVX): torch's kernel still works
        log.info("DeepSpeedCPUAdam unavailable: %s", e)
    return kernels


def measure_host_kernels(numel: int = 1 << 24, reps: int = 7) -> dict[str, float]:
    """Measured params/s of each bare host kernel ('torch', and 'deepspeed' when its op
    builds), on one flat fp32 buffer larger than the caches: the profile's CPU AdamW figure. (The
    host lane's own loop, which picks the kernel, is :mod:`engine.host_kernel`'s.) Runs alternate
    between kernels and the median is kept, so that a burst of noise does not pick the slower one."""
    kernels = host_kernels()
    # A private generator: the measurement runs inside the user's deepspeed.initialize and must
    # not move their RNG state (dropout masks would differ from a stock run).
    gen = torch.Generator().manual_seed(0)
    t = [torch.rand(numel, generator=gen) for _ in range(4)]
    s = AdamWSlices([t[0]], [t[1]], [t[2]], [t[3]], [torch.tensor(1.0)])
    hyper = AdamWHyper(lr=1e-6)
    times: dict[str, list[float]] = {k: [] for k in kernels}
    for k in kernels:
        kernels[k](s, hyper)  # warm-up
    for _ in range(reps):
        for k, kernel in kernels.items():
            t0 = time.perf_counter()
            kernel(s, hyper)
            times[k].append(time.perf_counter() - t0)
    return {k: numel / statistics.median(v) for k, v in times.items()}


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
