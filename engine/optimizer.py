"""``OffloadAdamW``: a ``torch.optim.Optimizer`` whose state lives in the multi-tier engine.

A thin adapter: it flattens each param group's parameters into subgroups of about
``subgroup_numel`` elements (:class:`ParamSubgroup`) and hands them to
:class:`engine.core.SubgroupEngine`, which owns all update and I/O logic.
"""

from __future__ import annotations

import os
import weakref
from dataclasses import dataclass, field
from typing import Any, Callable, Literal, Mapping, Sequence, overload

import torch

from engine.adamw import hyper_from_group
from engine.checkpoint import save_atomic
from engine.config import EngineConfig, KnobKey, Knobs, StoragePath, resolve_host_cache, storage_paths
from engine.core import SubgroupEngine
from engine.errors import ConfigError
from engine.hooks import StepHook
from engine.telemetry import StepRecord


@dataclass
class ParamSlice:
    param: torch.Tensor
    start: int  # offset in the flattened parameter
    numel: int


@dataclass
class ParamSubgroup:
    """A :class:`SubgroupBinding` over consecutive slices of ``nn.Parameter``s of one group."""

    group: int
    slices: list[ParamSlice] = field(default_factory=list)

    @property
    def numel(self) -> int:
        return sum(s.numel for s in self.slices)

    @property
    def slice_numels(self) -> list[int]:
        return [s.numel for s in self.slices]

    def grads(self) -> list[torch.Tensor | None]:
        return [None if s.param.grad is None else s.param.grad.reshape(-1)[s.start : s.start + s.numel] for s in self.slices]

    def read_weights(self, out: torch.Tensor) -> None:
        off = 0
        for s in self.slices:
            out[off : off + s.numel].copy_(s.param.detach().reshape(-1)[s.start : s.start + s.numel])
            off += s.numel

    def weight_views(self) -> list[tuple[int, int, torch.Tensor | None]]:
        """Per slice, (lo, hi, the parameter's flat view there): the host lane writes them chunk
        by chunk, and uploads those on a GPU through its pinned ring on the upload stream, as it
        does ZeRO-3's flat partitions (``engine.host_lane.WeightUploader``). A parameter that is
        not contiguous has no flat view (None): it is written whole through
        :meth:`write_weights` after the update, a synchronous copy of that parameter."""
        out, off = [], 0
        for s in self.slices:
            view = s.param.detach().view(-1)[s.start : s.start + s.numel] if s.param.is_contiguous() else None
            out.append((off, off + s.numel, view))
            off += s.numel
        return out

    def write_weights(self, master: torch.Tensor, offset: int = 0) -> None:
        end, off = offset + master.numel(), 0
        with torch.no_grad():
            for s in self.slices:
                lo, hi = max(off, offset), min(off + s.numel, end)
                if lo < hi:
                    src = master[lo - offset : hi - offset]
                    if s.param.is_contiguous():
                        start = s.start + lo - off
                        s.param.view(-1)[start : start + hi - lo].copy_(src)
                    elif hi - lo == s.numel:  # never split across subgroups (see flatten_params)
                        s.param.copy_(src.view(s.param.shape))
                    else:  # a device-lane chunk ends inside it: read, modify, write the whole
                        whole = s.param.detach().reshape(-1).clone()
                        whole[lo - off : hi - off] = src.to(whole.device)
                        s.param.copy_(whole.view(s.param.shape))
                off += s.numel


def flatten_params(groups: Sequence[Sequence[torch.Tensor]], subgroup_numel: int) -> list[ParamSubgroup]:
    """Cut each group's parameters, in order, into subgroups of at most ``subgroup_numel``.

    Contiguous parameters may be split across subgroups; a non-contiguous one is kept whole
    (its flat view would be a copy), even if that makes its subgroup larger.
    """
    out: list[ParamSubgroup] = []
    for g, params in enumerate(groups):
        cur = ParamSubgroup(g)
        for p in params:
            if not p.is_contiguous():
                if cur.slices and cur.numel + p.numel() > subgroup_numel:
                    out.append(cur)
                    cur = ParamSubgroup(g)
                cur.slices.append(ParamSlice(p, 0, p.numel()))
                continue
            start = 0
            while start < p.numel():
                room = subgroup_numel - cur.numel
                if room <= 0:
                    out.append(cur)
                    cur = ParamSubgroup(g)
                    room = subgroup_numel
                n = min(room, p.numel() - start)
                cur.slices.append(ParamSlice(p, start, n))
                start += n
        if cur.slices:
            out.append(cur)
    return out


PathLike = str | os.PathLike[str] | StoragePath


class OffloadAdamW(torch.optim.Optimizer):
    """AdamW (decoupled weight decay, as ``torch.optim.AdamW``) with state across tiers.

    Args:
        host_cache_bytes: budget for optimizer state kept in host memory; the rest is striped
            over ``nvme_paths`` and ``remote_paths`` by bandwidth. None: all of it without
            paths, none with paths (``engine.config.resolve_host_cache``).
        nvme_paths, remote_paths: directories (or :class:`StoragePath` with declared
            bandwidth and, for shared file systems, a cap).
        subgroup_numel: elements per subgroup (12 bytes of state each).
        device_cache_bytes: state kept in device memory (needs a device lane).
        device: device lane: 'cuda', 'cpu' (tests), or None (CUDA when present).
        prefetch_depth, device_fraction, node_lock, io_concurrency: starting :class:`Knobs`
            (None: the default, 2, 0, False, 4 per path); change them later with
            :meth:`set_knobs`. Those given are pinned: a tuner (``engine.hooks``) never moves them.
        host_memory_bytes: budget for everything the engine holds in host memory (state,
            staging buffers, copies: ``engine.host_memory``). None: a share of what is available.
        host_memory_floor_bytes: available memory below which the engine gives back its kept and
            read-ahead buffers. None: 5% of the machine's memory, at least 1 GiB.
        read_ahead_bytes: host memory for reading the next step's state ahead during forward and
            backward. None: what the paths read in one forward and backward (measured); 0: none.
        overlap_io: False: each ``step()`` waits for its writes and nothing is read ahead.
        io_backend, host_adam, verify_checksums, run_dir, rank: see :class:`EngineConfig`.

    The fp32 master weights are seeded from the parameters at the first step (and at
    ``load_state_dict`` for fp32 parameters), so load model weights before optimizer state.
    """

    def __init__(
        self,
        params: torch.optim.optimizer.ParamsT,
        lr: float = 1e-3,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 0.01,
        *,
        host_cache_bytes: int | None = None,
        nvme_paths: Sequence[PathLike] = (),
        remote_paths: Sequence[PathLike] = (),
        subgroup_numel: int = 10_000_000,
        device_cache_bytes: int = 0,
        device: str | None = None,
        prefetch_depth: int | None = None,
        device_fraction: float | None = None,
        node_lock: bool | None = None,
        io_concurrency: Mapping[str, int] | None = None,
        host_memory_bytes: int | None = None,
        host_memory_floor_bytes: int | None = None,
        read_ahead_bytes: int | None = None,
        overlap_io: bool = True,
        io_backend: Literal["auto", "aio", "posix"] = "auto",
        host_adam: Literal["auto", "fastest", "torch", "deepspeed"] = "auto",
        verify_checksums: bool = True,
        run_dir: str | None = None,
        rank: int = 0,
    ) -> None:
        _check_hyper(lr, betas, eps, weight_decay)
        super().__init__(params, dict(lr=lr, betas=tuple(betas), eps=eps, weight_decay=weight_decay))
        for g in self.param_groups:
            _check_hyper(g["lr"], g["betas"], g["eps"], g["weight_decay"])
        paths = storage_paths(nvme_paths, remote_paths)
        pins: dict[str, Any] = {  # the knobs given are pinned
            k: v
            for k, v in (("prefetch_depth", prefetch_depth), ("device_fraction", device_fraction), ("node_lock", node_lock))
            if v is not None
        }
        concurrency = {StoragePath.coerce(k, "nvme").path: v for k, v in (io_concurrency or {}).items()}
        knobs = Knobs(**pins, io_concurrency=concurrency)
        pins.update({str(KnobKey(KnobKey.PATH_KNOB, p)): n for p, n in concurrency.items()})
        config = EngineConfig(
            subgroup_numel=subgroup_numel,
            host_cache_bytes=resolve_host_cache(host_cache_bytes, paths),
            device_cache_bytes=device_cache_bytes,
            paths=paths,
            device=device,
            io_backend=io_backend,
            host_adam=host_adam,
            verify_checksums=verify_checksums,
            run_dir=run_dir,
            rank=rank,
            host_memory_bytes=host_memory_bytes,
            host_memory_floor_bytes=host_memory_floor_bytes,
            read_ahead_bytes=read_ahead_bytes,
            overlap_io=overlap_io,
            pins=pins,
        )
        self._bindings = flatten_params([g["params"] for g in self.param_groups], subgroup_numel)
        self.engine = SubgroupEngine(self._bindings, config, knobs)
        # Read ahead during backward: the first gradient accumulated after a step starts the
        # next step's first reads (engine.read_ahead), with no call in the user's loop.
        self._read_ahead_armed = bool(paths) and overlap_io
        if self._read_ahead_armed:
            engine_ref = weakref.ref(self)
            for g in self.param_groups:
                for p in g["params"]:
                    if p.requires_grad:
                        p.register_post_accumulate_grad_hook(lambda _p, ref=engine_ref: _backward_began(ref))

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        if hasattr(self, "engine"):
            raise ConfigError(
                "OffloadAdamW places its state at construction and cannot add param groups later; "
                "pass every group to the constructor"
            )
        super().add_param_group(param_group)

    @overload
    def step(self, closure: None = None) -> None: ...
    @overload
    def step(self, closure: Callable[[], float]) -> float: ...
    @torch.no_grad()
    def step(self, closure: Callable[[], float] | None = None) -> float | None:
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        self.engine.step([hyper_from_group(g) for g in self.param_groups])
        self._read_ahead_armed = self.engine.transfers.swaps
        return loss

    def skipped_step(self) -> None:
        """Say that this iteration ends without ``step()`` (a ``torch.amp.GradScaler`` that found
        inf gradients skips it), so that the next step's ``fwd_bwd_s`` and a tuner's iteration
        time cover the next iteration alone, the skipped one's time going to ``excluded_s``
        (:meth:`SubgroupEngine.skipped_step`). With a GradScaler::

            scale = scaler.get_scale()
            scaler.step(opt)
            scaler.update()
            if scaler.get_scale() < scale:  # inf gradients: the step was skipped
                opt.skipped_step()

        Without it the next iteration is timed as both, which a tuner takes for a slower one."""
        self.engine.skipped_step()

    def pause_clock(self) -> None:
        """Training pauses between steps (generation in an RLHF loop, an evaluation): the time
        until :meth:`resume_clock`, or the next ``step()``, is kept out of the next step's
        ``fwd_bwd_s`` and a tuner's iteration time (``excluded_s``)."""
        self.engine.pause_clock()

    def resume_clock(self) -> None:
        """Training resumes after :meth:`pause_clock`."""
        self.engine.resume_clock()

    def flush(self) -> None:
        """Wait for the state writes still running behind the last ``step()`` (they drain during
        the next forward and backward); raise the first that failed. ``close()``, checkpoints
        and the next ``step()`` wait for them too."""
        self.engine.flush()

    def set_knobs(self, knobs: Knobs) -> None:
        """Change the knobs; they take effect at the next ``step()``."""
        self.engine.set_knobs(knobs)

    def add_step_hook(self, hook: StepHook) -> None:
        """Call ``hook`` around every step (``engine.hooks``): how a tuner drives this optimizer,
        e.g. ``tuner.client.TunerClient.for_engine(socket, opt.engine, run_id=...)`` registers itself."""
        self.engine.add_step_hook(hook)

    @property
    def knobs(self) -> Knobs:
        return self.engine.next_knobs

    @property
    def telemetry(self) -> list[StepRecord]:
        return self.engine.telemetry.records

    # -- state dict: the format of torch.optim.AdamW, plus 'master' for non-fp32 params --------

    def _param_index(self) -> dict[int, int]:
        params = [p for g in self.param_groups for p in g["params"]]
        return {id(p): i for i, p in enumerate(params)}

    def state_dict(self) -> dict[str, Any]:
        index = self._param_index()
        per_param: dict[int, dict[str, torch.Tensor]] = {}
        for k, b in enumerate(self._bindings):
            master, m, v, steps = self.engine.read_state(k)
            off = 0
            for s, step in zip(b.slices, steps):
                if step > 0:
                    param_state = per_param.setdefault(index[id(s.param)], _empty_state(s.param, step))
                    for key, src in (("exp_avg", m), ("exp_avg_sq", v), ("master", master)):
                        if key in param_state:
                            param_state[key].view(-1)[s.start : s.start + s.numel].copy_(src[off : off + s.numel])
                off += s.numel
        groups = []
        for g in self.param_groups:
            d = {k: v for k, v in g.items() if k != "params"}
            d["params"] = [index[id(p)] for p in g["params"]]
            groups.append(d)
        return {"state": per_param, "param_groups": groups}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        groups = state_dict.get("param_groups")
        if not isinstance(groups, list) or len(groups) != len(self.param_groups):
            raise ConfigError(
                f"optimizer state has {len(groups) if isinstance(groups, list) else 'no'} param groups, "
                f"this optimizer has {len(self.param_groups)}: load the state of the same model and groups"
            )
        for saved, g in zip(groups, self.param_groups):
            if len(saved["params"]) != len(g["params"]):
                raise ConfigError(
                    f"a saved param group has {len(saved['params'])} params, this one {len(g['params'])}: "
                    f"load the state of the same model and groups"
                )
        saved_index = [i for s in groups for i in s["params"]]
        mine = self._param_index()
        state = state_dict.get("state", {})
        by_param = {p_id: state.get(saved_i) for p_id, saved_i in zip(mine, saved_index)}
        for k, b in enumerate(self._bindings):
            n = b.numel
            master, m, v = torch.empty(n), torch.zeros(n), torch.zeros(n)
            b.read_weights(master)
            steps, off = [], 0
            for s in b.slices:
                saved = by_param[id(s.param)]
                if saved:
                    if tuple(saved["exp_avg"].shape) != tuple(s.param.shape):
                        raise ConfigError(
                            f"saved optimizer state has shape {tuple(saved['exp_avg'].shape)} for a parameter "
                            f"of shape {tuple(s.param.shape)}: load the state of the same model"
                        )
                    m[off : off + s.numel].copy_(saved["exp_avg"].reshape(-1)[s.start : s.start + s.numel])
                    v[off : off + s.numel].copy_(saved["exp_avg_sq"].reshape(-1)[s.start : s.start + s.numel])
                    if "master" in saved:
                        master[off : off + s.numel].copy_(saved["master"].reshape(-1)[s.start : s.start + s.numel])
                    steps.append(int(float(saved["step"])))
                else:
                    steps.append(0)
                off += s.numel
            self.engine.write_state(k, master, m, v, steps)
        for saved, g in zip(groups, self.param_groups):
            g.update({key: val for key, val in saved.items() if key != "params"})

    def save(self, path: str) -> None:
        """Write ``state_dict()`` to ``path`` atomically (temporary file, then rename)."""
        save_atomic(self.state_dict(), path)

    def close(self) -> None:
        """Remove swap files now (they are also removed at interpreter exit)."""
        self.engine.close()

    def __enter__(self) -> "OffloadAdamW":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _backward_began(ref: weakref.ref[OffloadAdamW]) -> None:
    """A gradient was accumulated: the first one after a step starts the reads ahead."""
    opt = ref()
    if opt is not None and opt._read_ahead_armed:
        opt._read_ahead_armed = False
        opt.engine.read_ahead()


def _empty_state(p: torch.Tensor, step: int) -> dict[str, torch.Tensor]:
    state = {
        "step": torch.tensor(float(step)),
        "exp_avg": torch.zeros(p.shape, dtype=torch.float32),
        "exp_avg_sq": torch.zeros(p.shape, dtype=torch.float32),
    }
    if p.dtype != torch.float32:
        state["master"] = torch.zeros(p.shape, dtype=torch.float32)
    return state


def _check_hyper(lr: float, betas: Sequence[float], eps: float, weight_decay: float) -> None:
    if not float(lr) >= 0.0:
        raise ConfigError(f"invalid learning rate {lr!r}: must be >= 0")
    if not (len(betas) == 2 and all(0.0 <= float(b) < 1.0 for b in betas)):
        raise ConfigError(f"invalid betas {betas!r}: two values in [0, 1)")
    if not float(eps) >= 0.0:
        raise ConfigError(f"invalid eps {eps!r}: must be >= 0")
    if not float(weight_decay) >= 0.0:
        raise ConfigError(f"invalid weight_decay {weight_decay!r}: must be >= 0")
