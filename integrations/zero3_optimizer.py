"""The engine inside DeepSpeed ZeRO-3: :class:`OffloadZero3Optimizer`, a subclass of
``DeepSpeedZeroOptimizer_Stage3``, and the binding of its subgroups to the engine.

ZeRO-3 already keeps each rank's parameters as flat partitions split into subgroups
(``sub_group_size``), so every subgroup becomes one :class:`ZeroPartitionSubgroup` binding and
:class:`engine.core.SubgroupEngine` does the rest. What changes against stock DeepSpeed:

- DeepSpeed allocates no fp32 master copies, no fp32 gradient copies and no Adam state
  (``_create_fp32_partitions``, ``initialize_optimizer_states``,
  ``_offload_grad_partition_at_boundary``), and creates no swapper: the engine owns the state
  and its tiers.
- Reduced gradients stay in DeepSpeed's host buffer (``grad_partitions_flat_buffer``, pinned
  in place at its exact size) in their own dtype; they are upcast and unscaled per chunk at
  update time, never written to storage. Gradients of subgroups updated on the GPU (the device
  tier, and the device lane when memory allows) stay on the GPU: their entries in DeepSpeed's
  per-parameter gradient map point into device buffers, so backward never copies them out.
- ``step()`` keeps DeepSpeed's overflow check, loss-scale update and clipping, then hands the
  whole update loop to the engine.
- ``state_dict``/``_rigid_load_state_dict`` gather and restore the engine's state in
  DeepSpeed's own checkpoint layout, so stock DeepSpeed can resume from our checkpoints.

Imported only by :func:`integrations.deepspeed_zero3.install`, after DeepSpeed was imported
the way that keeps it from compiling native ops in a rank.
"""

from __future__ import annotations

import atexit

import deepspeed.comm as dist
import torch
from deepspeed.accelerator import get_accelerator
from deepspeed.checkpoint.constants import FP32_FLAT_GROUPS, LOSS_SCALER, OPTIMIZER_STATE_DICT, PARTITION_COUNT, ZERO_STAGE
from deepspeed.runtime.utils import combine_grad_norm_groups, is_invalid_grad_norm
from deepspeed.runtime.zero.config import ZeroStageEnum
from deepspeed.runtime.zero.offload_config import OffloadDeviceEnum, OffloadStateTypeEnum
from deepspeed.runtime.zero.stage3 import DeepSpeedZeroOptimizer_Stage3

from engine.adamw import hyper_from_group
from engine.buffers import pin_in_place
from engine.config import EngineConfig, Knobs, resolve_host_cache, storage_paths
from engine.core import SubgroupEngine
from engine.errors import CheckpointError, ConfigError
from engine.streams import resolve_lane_device
from integrations import checkpoints, ds_compat
from integrations.ds_config_check import refuse_nvme_without_path
from integrations.settings import ZeroEngineSettings
from perf.plan import local_rank, node_layout, plan_for_rank


class ZeroPartitionSubgroup:
    """A :class:`SubgroupBinding` over one ZeRO-3 subgroup of this rank's partition."""

    def __init__(self, opt, index: int, grad_offset: int) -> None:
        self.opt, self.index = opt, index
        self.group = opt.sub_group_to_group_id[index]
        self.numel = opt.fp16_partitioned_groups_flat_numel[index]
        self.slice_numels = (self.numel,)
        # DeepSpeed's host buffer of reduced gradients, in the gradient-accumulation dtype.
        self.grad_offset = grad_offset
        self.host_grad = opt.grad_partitions_flat_buffer.narrow(0, grad_offset, self.numel)
        self.device_grad: torch.Tensor | None = None  # set while backward writes this subgroup's gradients on the GPU

    def grads(self) -> list[torch.Tensor]:
        # As reduced; the engine unscales them (grad_scale) as it reads them.
        return [self.device_grad if self.device_grad is not None else self.host_grad]

    @property
    def grad_scale(self) -> float:
        return self.opt.offload_grad_scale  # DeepSpeed's math: fp32 grad * (1 / combined scale)

    @property
    def flat_weights(self) -> torch.Tensor:
        return self.opt.fp16_partitioned_groups_flat[self.index]

    def weights_written(self) -> None:
        self.opt._unflatten_partitioned_parameters(self.index)

    def read_weights(self, out: torch.Tensor) -> None:
        out.copy_(self.flat_weights)

    def write_weights(self, master: torch.Tensor, offset: int = 0) -> None:
        self.flat_weights.data[offset : offset + master.numel()].copy_(master)
        self.weights_written()

    def params(self):
        return self.opt.fp16_groups[self.index]


class OffloadZero3Optimizer(DeepSpeedZeroOptimizer_Stage3):
    """DeepSpeed's ZeRO-3 optimizer with the engine in place of its optimizer offload (see the
    module docstring for what changes), for a rank's :class:`ZeroEngineSettings`
    (:func:`optimizer_class` hands them over)."""

    settings: ZeroEngineSettings
    _checked_out: dict[int, torch.Tensor]  # subgroup -> its placeholder, while checked out

    def __init__(self, *args, settings: ZeroEngineSettings, **kwargs) -> None:
        self.settings = settings  # before DeepSpeed's __init__, which calls _configure_offloading and the rest
        super().__init__(*args, **kwargs)

    def _configure_offloading(self, offload_optimizer_config, offload_param_config):
        super()._configure_offloading(offload_optimizer_config, offload_param_config)
        if not self.offload_optimizer:
            raise ConfigError(
                "offloadctl needs `offload_optimizer` (device cpu or nvme) in the ZeRO-3 config: "
                "add it, or use engine.OffloadAdamW without DeepSpeed"
            )
        nvme = getattr(offload_optimizer_config, "nvme_path", None) if self.swap_optimizer else None
        refuse_nvme_without_path(self.swap_optimizer, nvme, self.settings)  # a config built in the script
        self._ds_nvme_path = str(nvme) if nvme else None
        self.swap_optimizer = False  # the engine owns the tiers; DeepSpeed creates no swapper

    def _create_fp32_partitions(self):
        # Placeholders only: the engine holds the fp32 masters, in its tiers.
        self.subgroup_to_device = {i: "cpu" for i in range(len(self.fp16_partitioned_groups_flat))}
        for i in range(len(self.fp16_partitioned_groups_flat)):
            t = torch.empty(0, dtype=torch.float32)
            ids = self.fp16_partitioned_groups_flat_id[i]
            t.ds_id = f"{ids[0]}_{ids[-1]}"
            self.fp32_partitioned_groups_flat.append(t)
        for pg in self.optimizer.param_groups:
            pg["params"] = []

    def initialize_optimizer_states(self):
        pass  # no fp32 gradient buffers, no Adam state: both live in the engine

    def _offload_grad_partition_at_boundary(self, param, grad_buffer, *args):
        # Keep DeepSpeed's norm bookkeeping; skip its fp32 copy of the gradient.
        self.norm_for_param_grads[self.get_param_id(param)] = self._constant_buffered_norm2(grad_buffer)

    def partition_grads(self, params_to_release, grad_partitions):
        """DeepSpeed's ``partition_grads`` (copied from 0.19.8) less one PCIe round trip. For a
        gradient reduced into host memory, stock copies the partition out, then copies the host
        buffer back to the GPU only to take its norm there (2 B per element of a 16-bit gradient,
        every step). Here the norm is taken from the partition while it is still on the GPU, cast
        to the buffer's dtype first where they differ: the same values, the same norm. Where the
        installed DeepSpeed's body is not the one copied (``ds_compat.COPIED``), its own runs."""
        if not ds_compat.copied_source_matches(ds_compat.STAGE3, "partition_grads"):
            return super().partition_grads(params_to_release, grad_partitions)
        accel = get_accelerator()
        mapping = self._DeepSpeedZeroOptimizer_Stage3__param_id_to_grad_partition
        offload_fp32_gradients, offload_fp32_offsets, buffers = {}, {}, []
        for param, grad_partition in zip(params_to_release, grad_partitions):
            if not param.partition_numel() * self._get_param_partition_rank(param) < param.ds_numel:
                param.grad = None  # this rank's partition of it is empty
                continue
            self._offload_boundary_param_ids.add(param.ds_id)
            grad_buffer = mapping[param.ds_id].narrow(0, 0, grad_partition.numel())
            buffers.append(grad_buffer)
            if self.micro_step_id == 0:  # don't accumulate
                grad_buffer.copy_(grad_partition, non_blocking=True)
                if not accel.on_accelerator(grad_buffer):
                    # Ours: the norm below reads the partition on the GPU, not a copy of the buffer.
                    grad_buffer = (
                        grad_partition if grad_partition.dtype == grad_buffer.dtype else grad_partition.to(grad_buffer.dtype)
                    )
            elif accel.on_accelerator(grad_buffer):
                grad_buffer.add_(grad_partition.to(self.gradient_accumulation_dtype).view(grad_buffer.shape))
            else:
                # A host buffer: add on the GPU, copy back (DeepSpeed's: adding on the CPU is slow).
                cuda_grad_buffer = grad_buffer.to(grad_partition.device, non_blocking=True)
                cuda_grad_buffer.add_(grad_partition.to(self.gradient_accumulation_dtype).view(cuda_grad_buffer.shape))
                grad_buffer.copy_(cuda_grad_buffer, non_blocking=True)
                grad_buffer = cuda_grad_buffer
            if self.offload_optimizer and self.is_gradient_accumulation_boundary():
                self._offload_grad_partition_at_boundary(param, grad_buffer, offload_fp32_gradients, offload_fp32_offsets)
            if not accel.is_synchronized_device() and param.grad is not None:
                param.grad.record_stream(accel.current_stream())
            param.grad = None
        self._swap_out_offload_fp32_gradients(offload_fp32_gradients, offload_fp32_offsets)
        return buffers

    def _setup_for_real_optimizer(self):
        # DeepSpeed pins its gradient buffer through torch's pinned allocator, which rounds
        # it up to a power of two (a 4.1 GB buffer takes 8 GiB locked): pin it in place.
        pin, self.offload_optimizer_pin_memory = self.offload_optimizer_pin_memory, False
        try:
            super()._setup_for_real_optimizer()  # creates grad_partitions_flat_buffer
        finally:
            self.offload_optimizer_pin_memory = pin
        ds_compat.check_optimizer_instance(self)  # the DeepSpeed internals used from here on
        _check_adamw(self.optimizer)
        _check_supported(self)
        self.offload_grad_scale = 1.0
        self._checked_out = {}
        self._bindings, off = [], 0
        for i in range(len(self.fp16_groups)):
            self._bindings.append(ZeroPartitionSubgroup(self, i, off))
            off += self.fp16_partitioned_groups_flat_numel[i]
        config, knobs = self._engine_config()
        self.offload_engine = SubgroupEngine(self._bindings, config, knobs)
        device = self.offload_engine.device
        if pin or (device is not None and device.type == "cuda"):
            # With a CUDA device lane, pinned whatever the ds_config says: a pageable gradient
            # buffer makes every device-lane upload of it a synchronous copy (the host blocks
            # once per chunk).
            pin_in_place(self.grad_partitions_flat_buffer)
        self.device_fit = None  # the first step fits the device tier to what backward left free
        self.tuner_client = self._connect_tuner()

    def _engine_config(self) -> tuple[EngineConfig, Knobs]:
        rank = dist.get_rank() if dist.is_initialized() else 0
        local_ranks, _ = node_layout(dist.get_world_size() if dist.is_initialized() else 1)
        nvme = list(self.settings.nvme_paths) or ([self._ds_nvme_path] if self._ds_nvme_path else [])
        paths = storage_paths(nvme, self.settings.remote_paths)
        host_cache = resolve_host_cache(self.settings.host_cache_bytes, paths)
        knobs = self.settings.start_knobs
        subgroup_numel = max(self.fp16_partitioned_groups_flat_numel)
        self.plan_summary = None
        if self.settings.profile:
            plan = self._rank_plan(paths)
            host_cache, knobs, paths, self.plan_summary = plan.host_cache_bytes, plan.knobs, plan.paths, plan.summary
        lane_device = resolve_lane_device(self.settings.lane_device or None)
        device = str(lane_device) if lane_device is not None else None
        config = EngineConfig(
            subgroup_numel=subgroup_numel,
            host_cache_bytes=host_cache,
            paths=paths,
            device=device,
            device_cache_bytes=(self.settings.device_cache_bytes if device else 0),
            auto_device_fraction=bool(device) and self.settings.auto_device_fraction,
            io_backend=self.settings.io_backend,
            host_adam=self.settings.host_adam,
            run_dir=self.settings.run_dir,
            rank=rank,
            local_ranks=local_ranks,
            host_memory_bytes=self.settings.host_memory_bytes,
            read_ahead_bytes=self.settings.read_ahead_bytes,
            overlap_io=self.settings.overlap_io,
            pins=self.settings.pins,
        )
        return config, knobs

    def _rank_plan(self, paths, **measured):
        """The performance model's plan for this rank's real partition (``--profile``)."""
        world = dist.get_world_size() if dist.is_initialized() else 1
        return plan_for_rank(
            self.settings.profile,
            params_total=sum(self.fp16_partitioned_groups_flat_numel) * world,
            world_size=world,
            subgroup_numel=max(self.fp16_partitioned_groups_flat_numel),
            paths=paths,
            weight_bytes=self.fp16_partitioned_groups_flat[0].element_size(),
            host_cache_bytes=self.settings.host_cache_bytes,
            pins=self.settings.pins,
            **measured,
        )

    def _fit_to_gpu(self) -> None:
        """At the first step, after the first forward/backward: keep on the GPU what its peak
        leaves room for, and balance the lanes for the rest (the engine's lane model on rates
        measured here; with --profile the plan's summary is redone for what the fit left)."""
        engine = self.offload_engine
        grad_bytes = self.grad_partitions_flat_buffer.element_size()
        # From the second forward on, DeepSpeed prefetches and keeps live up to these many
        # gathered parameters beyond what the first pass (the measured peak) held.
        offload = self.parameter_offload
        live = (getattr(offload, "_max_available_parameters_in_numel", 0) or 0) + self.prefetch_elements
        total = sum(p.ds_numel for g in self.fp16_groups for p in g)
        reserve = min(live, total) * self.fp16_partitioned_groups_flat[0].element_size()
        self.device_fit = engine.fit_device_tier(grad_bytes_per_element=grad_bytes, reserve_bytes=reserve)
        if self.settings.profile:
            try:
                plan = self._rank_plan(
                    tuple(p.spec for p in engine.swap_paths.paths) or tuple(engine.config.paths),
                    gpu_headroom_bytes=self.device_fit.headroom_bytes,
                    device_cache_bytes=self.device_fit.device_tier_bytes,
                    device_fraction=self.device_fit.device_fraction,
                )
                self.plan_summary = plan.summary
            except ConfigError as e:  # the prediction is for the record; the run goes on as fitted
                self.plan_summary = f"profile: no prediction for the fitted plan ({e})"

    def _place_grads(self) -> None:
        """Point DeepSpeed's per-parameter gradient entries of the subgroups the engine
        updates on the GPU at device buffers, and the others at the host buffer, for the
        next backward. DeepSpeed copies (or accumulates) each reduced partition into its
        entry, and takes the norm from it there: an inf or nan in a device buffer makes the
        norm invalid, which DeepSpeed's step treats as an overflow, as for its own buffer."""
        on_device = set(self.offload_engine.device_grad_subgroups())
        dev = self.offload_engine.device
        for b in self._bindings:
            want = b.index in on_device
            if want == (b.device_grad is not None):
                continue
            if want:
                b.device_grad = torch.zeros(b.numel, dtype=b.host_grad.dtype, device=dev)
                b.host_grad.zero_()  # stale host values must not reach DeepSpeed's overflow scan
            else:
                b.device_grad = None
            self._point_grads(b)

    def _point_grads(self, b: ZeroPartitionSubgroup) -> None:
        """DeepSpeed's gradient entries of ``b``'s parameters, into its device buffer or its
        slice of the host buffer, whichever it has now."""
        mapping = self._DeepSpeedZeroOptimizer_Stage3__param_id_to_grad_partition
        flat, off = (b.device_grad if b.device_grad is not None else b.host_grad), 0
        for p in b.params():
            n = p.partition_numel()
            mapping[p.ds_id] = flat.narrow(0, off, n)
            off += n

    def _connect_tuner(self):
        if not self.settings.tuner_socket:
            return None
        from tuner.client import TunerClient

        # The daemon is per node (a Unix socket), so it sees this node's ranks: local rank and size.
        world = dist.get_world_size() if dist.is_initialized() else 1
        local_size, _ = node_layout(world)
        client = TunerClient.for_engine(
            self.settings.tuner_socket,
            self.offload_engine,
            run_id=self.settings.run_id or "run",
            rank=local_rank(),
            world_size=local_size,
            profile=self.settings.profile,
        )
        atexit.register(client.close)  # scripts rarely call destroy(): say bye at exit all the same
        return client

    def step(self, closure=None):
        self._pre_step()
        self._partition_all_parameters()
        self._overflow_check_and_loss_scale_update(update_scale=False)
        scaled_norm = None
        if not self.overflow:
            scaled_norm = combine_grad_norm_groups(self._get_norm_groups())
            if is_invalid_grad_norm(scaled_norm):
                self.overflow = True
        if self._loss_scale_update_and_overflow_cleanup():
            # Overflow: DeepSpeed skips the step (fp16 loss scaling). This iteration's time is
            # not the next one's: the tuner judges that one alone.
            self.offload_engine.skipped_step()
            return
        self._global_grad_norm = scaled_norm / self.loss_scale
        combined = self.loss_scale
        if self.clip_grad > 0.0:
            clip = ((scaled_norm / self.loss_scale) + 1e-6) / self.clip_grad
            combined = torch.clamp(clip, min=1.0) * self.loss_scale if torch.is_tensor(clip) else max(clip, 1.0) * self.loss_scale
        inv = 1.0 / combined
        self.offload_grad_scale = float(inv)
        if self.device_fit is None and self.offload_engine.device is not None:
            with self.offload_engine.setup_time():  # the first fit, or the refit after reload_states: one-time
                self._fit_to_gpu()
        # The tuner client, when there is one, is the engine's step hook (engine.hooks).
        self.offload_engine.step([hyper_from_group(g) for g in self.optimizer.param_groups])
        if self.offload_engine.device is not None:
            if self.tuner_client is not None:
                # A knob change due at the next step is handed to the engine now rather than at
                # that step's start, so that the next backward already places its gradients for
                # the new lanes (a subgroup that moved would otherwise be read across PCIe by a
                # synchronous copy per chunk, in the very step the tuner judges).
                self.tuner_client.apply_pending(self.offload_engine)
            with self.offload_engine.setup_time():  # one-time buffers: not the next iteration's time
                self._place_grads()  # for the next backward, for the lanes of the next step
        # The wrapped optimizer holds no params (the engine owns them), so its step() updates
        # nothing; it is called for what hangs on it: an LR scheduler's step tracking (Hugging
        # Face attaches its scheduler to this optimizer) and registered step hooks.
        self.optimizer.step()
        self._post_step(set())

    # -- DeepSpeed's partitioned-state API -------------------------------------------------------
    # DeepSpeed's getters and setters of partitioned state (deepspeed.utils.safe_get_*/safe_set_*,
    # safe_update_full_grad_vectorized), load_checkpoint(load_optimizer_states=False) and the
    # universal checkpoint's loader read and write fp32_partitioned_groups_flat[i], its .grad and
    # optimizer.state[it], between _optimizer_states_and_gradient_swap_in and _swap_out (or
    # _release_swap_buffers, _writeback_swap_state) for a swappable subgroup. Here every
    # subgroup is "swappable": swapping in checks its state out of the engine, from whichever tier
    # holds it, into those places; swapping out writes it back there; releasing drops the copy.

    def backward_prologue(self):
        # Read ahead during backward: the state of the subgroups the next step updates first does
        # not depend on the gradients (engine.read_ahead; again at each micro-batch, harmlessly).
        self.offload_engine.read_ahead()
        super().backward_prologue()

    def _swappable_optimizer_subgroup(self, sub_group_id):
        return True  # every subgroup's fp32 state is in the engine (see above)

    def _optimizer_states_and_gradient_swap_in(self, sub_group_id, timer_names=None):
        self._check_out(sub_group_id)

    def _optimizer_states_and_gradient_swap_out(self, sub_group_id, timer_names=None):
        self._check_in(sub_group_id, write_state=True, write_grads=True)

    def _release_swap_buffers(self, sub_group_id):
        self._check_in(sub_group_id, write_state=False, write_grads=False)

    def _writeback_swap_state(self, sub_group_id, write_opt_state, write_gradients):
        self._check_in(sub_group_id, write_state=write_opt_state, write_grads=write_gradients)

    def _check_out(self, i: int) -> None:
        """Subgroup ``i``'s master, moments and fp32 gradient, copied out of the engine into
        fp32_partitioned_groups_flat[i] (and its .grad) and optimizer.state[it]."""
        if i in self._checked_out:
            return
        master, exp_avg, exp_avg_sq, steps = self.offload_engine.read_state(i)
        placeholder = self.fp32_partitioned_groups_flat[i]
        master.ds_id = placeholder.ds_id
        # DeepSpeed's fp32 gradient of an offloaded subgroup: the reduced gradient, not unscaled.
        master.grad = self._bindings[i].grads()[0].detach().to("cpu", torch.float32, copy=True)
        self.fp32_partitioned_groups_flat[i] = master
        self.optimizer.state[master] = {"exp_avg": exp_avg, "exp_avg_sq": exp_avg_sq, "step": steps[0]}
        self._checked_out[i] = placeholder

    def _check_in(self, i: int, *, write_state: bool, write_grads: bool) -> None:
        """Put subgroup ``i``'s placeholder back, writing what was changed into the engine (the
        state, to its tier) and the gradient buffer the engine reads."""
        placeholder = self._checked_out.pop(i, None)
        if placeholder is None:
            return
        master = self.fp32_partitioned_groups_flat[i]
        adam = self.optimizer.state.pop(master, {})
        if write_state:
            step = adam.get("step", 0)
            self.offload_engine.write_state(
                i, master, adam["exp_avg"], adam["exp_avg_sq"], [int(step.item() if torch.is_tensor(step) else step)]
            )
        if write_grads and master.grad is not None:
            self._bindings[i].grads()[0].copy_(master.grad)
        master.grad = None
        self.fp32_partitioned_groups_flat[i] = placeholder

    def _restore_from_bit16_weights(self):
        # load_checkpoint(load_optimizer_states=False or load_module_only=True): the masters from
        # the loaded 16-bit weights, the moments as they are (DeepSpeed's own behaviour).
        for i, flat16 in enumerate(self.fp16_partitioned_groups_flat):
            _, exp_avg, exp_avg_sq, steps = self.offload_engine.read_state(i)
            self.offload_engine.write_state(i, flat16.float(), exp_avg, exp_avg_sq, steps)

    def _load_universal_checkpoint(self, checkpoint_folder, load_optimizer_states, load_from_fp32_weights):
        # DeepSpeed's loader writes every subgroup's fp32_partitioned_groups_flat[i] and
        # optimizer.state[it] in place: check them all out for it, then write them back.
        for i in range(len(self.fp16_groups)):
            self._check_out(i)
        try:
            super()._load_universal_checkpoint(checkpoint_folder, load_optimizer_states, load_from_fp32_weights)
        except BaseException:
            for i in range(len(self.fp16_groups)):
                self._check_in(i, write_state=False, write_grads=False)
            raise
        for i in range(len(self.fp16_groups)):
            self._check_in(i, write_state=True, write_grads=False)

    # -- offload_states / reload_states (RLHF: the GPU freed for generation between steps) ---------

    def offload_states(self, include=None, device=OffloadDeviceEnum.cpu, pin_memory=True, non_blocking=False):
        """DeepSpeed's, with the optimizer's part done by the engine: its fp32 state (the hp
        params and Adam states) is already off the GPU except the device tier, which goes to
        host memory with the device lane's buffers and the gradients kept on the GPU
        (:meth:`SubgroupEngine.release_device`); the next step fits the tier again as at the first.
        The gradients (``lp_grads``) are the engine's too: the flat buffer stays where it is, in
        host memory and pinned in place, and only the gradients kept on the GPU are dropped
        (DeepSpeed's would copy the buffer into a pinned copy of its own, rounded up to a power
        of two and kept for good, and ``reload_states`` would move it to the GPU: 2 bytes per
        parameter of GPU memory from then on, and every host-lane read of it across PCIe). The
        rest (the 16-bit params, the contiguous bucket) is DeepSpeed's own work.

        From here to the end of :meth:`reload_states` (the cycle, and the generation between)
        no training iteration runs: that time is kept out of the next step's (the tuner's clock:
        ``StepRecord.excluded_s``), but for the engine's release, one-time work like the refit
        after it, counted in its ``setup_s``."""
        self.offload_engine.pause_clock()
        ours = {OffloadStateTypeEnum.optim_states, OffloadStateTypeEnum.hp_params}
        asked = set(OffloadStateTypeEnum) if include is None else set(include)
        grads = OffloadStateTypeEnum.lp_grads
        release = bool(asked & ours - self.offloaded_states)
        if release:
            with self.offload_engine.setup_time():
                self.offload_engine.release_device()
            self.device_fit = None  # the next step fits again: gradients and DeepSpeed's prefetch counted
            self.offloaded_states |= asked & ours
        if grads in asked:
            self.offloaded_states.add(grads)
        if release or grads in asked:
            for b in self._bindings:
                b.device_grad = None  # the next backward reduces into host memory
            self._remap_grads()
        # DeepSpeed's own skips what is in offloaded_states: ours are there, so its FusedAdam-only
        # path for them never runs, and it leaves the gradient buffer alone.
        super().offload_states(include=include, device=device, pin_memory=pin_memory, non_blocking=non_blocking)

    def reload_states(self, non_blocking=False):
        """DeepSpeed's, less the engine's states (see :meth:`offload_states`). The time since
        ``offload_states`` began is kept out of the next step's (``StepRecord.excluded_s``); the
        next step's refit is its ``setup_s``."""
        ours = {OffloadStateTypeEnum.optim_states, OffloadStateTypeEnum.hp_params, OffloadStateTypeEnum.lp_grads}
        # The engine's come back at the next step's device fit; the gradient buffer never left.
        self.offloaded_states -= ours
        super().reload_states(non_blocking=non_blocking)
        self._remap_grads()
        # The fit after the next forward/backward measures their peak, not the generation's before.
        self.offload_engine.device_tier.returned()
        self.offload_engine.resume_clock()  # training again

    def _remap_grads(self) -> None:
        """Every subgroup's host slice of the gradient buffer, and its parameters' entries in
        DeepSpeed's gradient map, where its gradient lives now (after a change to either)."""
        for b in self._bindings:
            b.host_grad = self.grad_partitions_flat_buffer.narrow(0, b.grad_offset, b.numel)
            self._point_grads(b)

    def state_dict(self):
        n = len(self.fp16_groups)
        state, masters = {}, []
        for i in range(n):
            master, m, v, steps = self.offload_engine.read_state(i)
            masters.append(master)
            state[i] = {"step": steps[0], "exp_avg": m, "exp_avg_sq": v}
        groups = []
        for gid, g in enumerate(self.optimizer.param_groups):
            d = {k: v for k, v in g.items() if k != "params"}
            d["params"] = [i for i in range(n) if self.sub_group_to_group_id[i] == gid]
            groups.append(d)
        return {
            ZERO_STAGE: ZeroStageEnum.weights,
            LOSS_SCALER: self.loss_scaler,
            "dynamic_loss_scale": self.dynamic_loss_scale,
            "overflow": self.overflow,
            PARTITION_COUNT: self.partition_count,
            OPTIMIZER_STATE_DICT: {"state": state, "param_groups": groups},
            FP32_FLAT_GROUPS: masters,
            checkpoints.SAVED_AT_STEP: getattr(self, "checkpoint_global_steps", None),
        }  # which model states it goes with

    def _rigid_load_state_dict(self, state_dict, load_optimizer_states=True):
        self._check_loadable(state_dict, load_optimizer_states)  # before anything is written
        self.loss_scaler = state_dict[LOSS_SCALER]
        self.dynamic_loss_scale = state_dict["dynamic_loss_scale"]
        self.overflow = state_dict["overflow"]
        osd = state_dict[OPTIMIZER_STATE_DICT]
        if load_optimizer_states:
            for g, saved in zip(self.optimizer.param_groups, osd["param_groups"]):
                g.update({k: v for k, v in saved.items() if k != "params"})
        for i, master in enumerate(state_dict[FP32_FLAT_GROUPS]):
            saved = osd["state"].get(i) if load_optimizer_states else None
            if saved:
                self.offload_engine.write_state(i, master, saved["exp_avg"], saved["exp_avg_sq"], [int(saved["step"])])
            else:
                zeros = torch.zeros_like(master)
                self.offload_engine.write_state(i, master, zeros, zeros, [0])
            self._bindings[i].write_weights(master)

    def _check_loadable(self, state_dict, load_optimizer_states: bool) -> None:
        """CheckpointError unless every subgroup of ``state_dict`` matches this run's: the check
        comes first, so a load that fails changes nothing in the engine's tiers: the model's shapes
        (``param_shapes``, where the preflight found the folder), then this rank's partition sizes."""
        rank = dist.get_rank(group=self.dp_process_group) if dist.is_initialized() else 0
        folder = checkpoints.loading_folder()
        if folder is not None:
            shapes = [[tuple(getattr(p, "ds_shape", p.shape)) for p in group] for group in self.fp16_groups]
            checkpoints.refuse_on_every_rank(checkpoints.another_model(folder, rank, shapes))
        bad = checkpoints.partition_refusal(
            [int(t.numel()) for t in state_dict[FP32_FLAT_GROUPS]] if FP32_FLAT_GROUPS in state_dict else None,
            list(self.fp16_partitioned_groups_flat_numel),
            folder=folder,
            rank=rank,
            moments=state_dict[OPTIMIZER_STATE_DICT]["state"] if load_optimizer_states else None,
        )
        if folder is not None:
            checkpoints.refuse_on_every_rank(bad)
        elif bad:
            raise CheckpointError(bad)

    def destroy(self):
        self.offload_engine.close()  # closes its step hooks: the tuner client says bye
        super_destroy = getattr(super(), "destroy", None)
        if super_destroy:
            # DeepSpeed's destroy() (since 0.19.7) unpins its offload buffers, the gradient buffer
            # among them, which under DS_PIN_MEMORY_BACKEND=native frees memory by address. This
            # one is the engine's: allocated by torch, pinned in place by the engine, unpinned when
            # it is freed (engine.buffers.pin_in_place). DeepSpeed is handed only what it pinned.
            buf, self.grad_partitions_flat_buffer = self.grad_partitions_flat_buffer, None
            try:
                super_destroy()
            finally:
                self.grad_partitions_flat_buffer = buf


def _check_supported(opt) -> None:
    """DeepSpeed options whose work happens inside the per-subgroup step the engine replaces:
    refused with the fix rather than run wrongly (checked against DeepSpeed 0.19.8's ``step``)."""
    if getattr(opt, "use_muon", False):
        raise ConfigError(
            "offloadctl's engine runs AdamW, and the ds_config asks for Muon (MuonWithAuxAdam): "
            'use "optimizer": {"type": "AdamW"}, or run Muon with stock DeepSpeed'
        )
    if getattr(opt, "torch_autocast_gradscaler", None) is not None:
        raise ConfigError(
            "torch_autocast with fp16 scales the loss with torch's GradScaler, which offloadctl's engine "
            'does not unscale: use bf16 in torch_autocast, or DeepSpeed\'s "fp16" section'
        )
    if getattr(opt, "zenflow", False):
        raise ConfigError(
            "ZenFlow's selective updates replace the optimizer step that offloadctl's engine owns: "
            'remove "zenflow" from zero_optimization, or run it with stock DeepSpeed'
        )
    if any(flat is None for flat in opt.fp16_partitioned_groups_flat):
        raise ConfigError(
            "offload_param to nvme with more parameters than offload_param.max_in_cpu leaves subgroups "
            "without a host buffer, which offloadctl's engine needs: raise max_in_cpu above the "
            "model's size, or offload parameters to cpu"
        )


def _check_adamw(optimizer) -> None:
    """The engine implements AdamW with bias correction; refuse anything else clearly."""
    name = type(optimizer).__name__
    adamw = (
        isinstance(optimizer, torch.optim.AdamW)
        or getattr(optimizer, "adam_w_mode", False)
        or getattr(optimizer, "adamw_mode", False)
    )
    if not adamw or getattr(optimizer, "bias_correction", True) is False:
        raise ConfigError(
            f"offloadctl's engine runs AdamW (decoupled weight decay, bias correction); the ds_config "
            f'asks for {name} without them: set "optimizer": {{"type": "AdamW"}}'
        )


def optimizer_class(settings: ZeroEngineSettings) -> type["OffloadZero3Optimizer"]:
    """The class DeepSpeed builds in this rank (``integrations.deepspeed_zero3.install`` puts it in
    place of its ZeRO-3 optimizer): :class:`OffloadZero3Optimizer` given the rank's ``settings``.
    DeepSpeed calls the class with its own arguments only, so the settings travel in this closure."""

    class RankOffloadZero3Optimizer(OffloadZero3Optimizer):
        def __init__(self, *args, **kwargs) -> None:
            super().__init__(*args, settings=settings, **kwargs)

    # DeepSpeed's logs and errors name the optimizer's class: the one this module documents.
    RankOffloadZero3Optimizer.__name__ = RankOffloadZero3Optimizer.__qualname__ = OffloadZero3Optimizer.__name__
    return RankOffloadZero3Optimizer
