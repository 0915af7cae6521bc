"""What the engine needs from whoever owns the model: the adapter contract.

The core updates flat fp32 state. An adapter (``OffloadAdamW`` over ``nn.Parameter``s, or the
DeepSpeed ZeRO-3 integration over its flat partitions) describes each subgroup with a
:class:`SubgroupBinding`: where its gradient comes from and where its updated weights go.
"""

from __future__ import annotations

from typing import Protocol, Sequence

import torch


class SubgroupBinding(Protocol):
    # Read-only to the engine (a property or an attribute in an adapter).
    @property
    def numel(self) -> int:
        """Elements in this subgroup."""
        ...

    group: int
    """Index of the param group whose hyper-parameters apply."""

    @property
    def slice_numels(self) -> Sequence[int]:
        """Lengths of the slices that keep their own step count (one per parameter, or one for a
        flat partition). They tile ``numel`` in order."""
        ...

    def grads(self) -> Sequence[torch.Tensor | None]:
        """Per slice, its gradient as a flat tensor of any float dtype and device, or None
        when the slice has no gradient this step (it is then not updated, as in torch AdamW).
        The engine only reads them."""
        ...

    # Optional members (see grad_scale_of, flat_weights_of, weights_written):
    #   grad_scale: float        multiply the gradients by this before the update (clipping,
    #                            loss scale); 1.0 when absent.
    #   flat_weights: Tensor     the subgroup's weights as one flat tensor of any dtype and
    #                            device, written in place chunk by chunk instead of through
    #                            write_weights.
    #   weight_views()           without flat_weights: (lo, hi, view) per range of the
    #                            subgroup, view a flat tensor of the model's weights there
    #                            (any dtype and device; None where there is none, written
    #                            through write_weights): the host lane writes and uploads
    #                            them chunk by chunk as it does flat weights.
    #   weights_written()        called after flat_weights was written.

    def read_weights(self, out: torch.Tensor) -> None:
        """Copy the current weights into ``out`` (flat fp32), to seed the master copy."""
        ...

    def write_weights(self, master: torch.Tensor, offset: int = 0) -> None:
        """Copy updated master weights (flat fp32, host or device) into the model's weights:
        ``master`` holds elements [offset, offset + master.numel()) of the subgroup (the device
        lane writes a subgroup chunk by chunk)."""
        ...


def grad_scale_of(binding: SubgroupBinding) -> float:
    return float(getattr(binding, "grad_scale", 1.0))


def flat_weights_of(binding: SubgroupBinding) -> torch.Tensor | None:
    return getattr(binding, "flat_weights", None)


def weight_views_of(binding: SubgroupBinding) -> list[tuple[int, int, torch.Tensor | None]] | None:
    views = getattr(binding, "weight_views", None)
    return None if views is None else views()


def weights_written(binding: SubgroupBinding) -> None:
    hook = getattr(binding, "weights_written", None)
    if hook is not None:
        hook()


class FlatSubgroup:
    """A subgroup over one flat weight tensor and one flat gradient tensor (one slice).

    The shape of a ZeRO-3 partition, and what benchmarks use to drive the engine directly.
    ``grad`` may be replaced between steps; None means no gradient this step.
    """

    def __init__(self, weight: torch.Tensor, grad: torch.Tensor | None = None, group: int = 0) -> None:
        self.weight, self.grad, self.group = weight.view(-1), grad, group
        self.flat_weights = self.weight
        self.grad_scale = 1.0  # the optional member (grad_scale_of): callers set it
        self.numel = self.weight.numel()
        self.slice_numels = (self.numel,)

    def grads(self) -> list[torch.Tensor | None]:
        return [self.grad]

    def read_weights(self, out: torch.Tensor) -> None:
        out.copy_(self.weight)

    def write_weights(self, master: torch.Tensor, offset: int = 0) -> None:
        self.weight[offset : offset + master.numel()].copy_(master)
