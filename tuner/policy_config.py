"""How the tuner's policy searches (:class:`PolicyConfig`): windows, thresholds, steps and caps,
validated once. The one owner of those defaults; :mod:`tuner.policy` and the modules it is
made of read them from here.
"""

from __future__ import annotations

from dataclasses import dataclass

from engine.errors import ConfigError


@dataclass(frozen=True, kw_only=True)
class PolicyConfig:
    """How the policy searches. Defaults suit iterations of a few seconds on a noisy machine."""

    window: int = 3
    """Iterations measured per candidate; their median is compared."""
    rebaseline_iters: int = 2
    """Iterations measured under the last good knobs after contention appears or vanishes."""
    settle_iters: int = 1
    """Iterations discarded after each change before measuring."""
    warmup_iters: int = 2
    """Iterations discarded at the start of a run (the first step materialises state, the
    second still writes fresh file extents)."""
    min_gain: float = 0.03
    """Smallest relative improvement that keeps a move."""
    negligible_share: float = 0.05
    """Hold when what the knobs can change (the update's I/O waits; with a device lane, the
    whole update) is under this share of the iteration, or under twice the noise threshold:
    no move could be confirmed, and trials cost iterations. Re-examined when the share
    exceeds twice that."""
    noise_k: float = 2.5
    """Threshold = ``noise_k`` x the relative noise (sigma) pooled over the windows measured."""
    max_threshold: float = 0.15
    """Upper bound of the threshold, so that a noisy machine can still improve."""
    drift: float = 0.2
    """While holding: re-explore when the median update time rises by this fraction."""
    reexplore_every_iters: int = 100
    """While holding: re-explore after this many iterations. 0: never."""
    max_prefetch_depth: int = 8
    """Highest prefetch depth tried (each step costs two staging buffers of host memory)."""
    host_staging_bytes: int | None = None
    """Cap on staging memory of the run's ranks on this node, ``(2 * depth + 3) *
    subgroup_bytes * ranks``. None: a quarter of the host memory available when the policy
    starts."""
    device_step: float = 0.1
    """Change of the device-lane fraction per move."""
    stripe_step: float = 0.25
    """Largest share of a path's stripe weight moved to the other paths per move."""
    contention_min_bytes_per_s: float = 20e6
    """Others' traffic on a path counts as contention above this, and above
    ``contention_ratio`` x our own traffic there (sensor and engine intervals never align
    exactly); it is gone below half of that."""
    contention_ratio: float = 0.05
    rate_change: float = 0.3
    """A path's measured rate that moves by more than this share (and beyond its own noise) for
    ``change_iters`` iterations in a row is a change of conditions (:mod:`tuner.conditions`)."""
    change_iters: int = 3
    """Iterations a path's rate must stay beyond its band before it counts as a change."""
    unfelt_rate_change: float = 1.0
    """A change the step does not feel (the update phase within the noise threshold) is acted on
    only when a path's round trip moved by more than this share (1.0: twice or half): the rates
    are then the only evidence, and a quiet emulated path's reads swing 1.8x between regimes."""
    model_gain: float = 0.15
    """The model's re-stripe is made when it predicts the paths' I/O time shorter by this share;
    closer to balance than that, small moves refine it."""
    min_stripe_share: float = 0.03
    """The smallest share of the bytes the model leaves a path: enough to keep measuring its rate,
    so that a path that comes back is seen."""
    depth_gain: float = 0.1
    """A path's concurrency is tried higher only where its probe at start served at least this
    share faster with twice the requests in flight (``EngineFacts.path_depth_response``), until
    its conditions change; a path without a probe is tried."""

    def __post_init__(self) -> None:
        for name in ("window", "rebaseline_iters", "change_iters"):
            v = getattr(self, name)
            if not (isinstance(v, int) and not isinstance(v, bool) and v >= 1):
                raise ConfigError(f"PolicyConfig.{name} must be an integer >= 1, got {v!r}")
        for name in ("settle_iters", "warmup_iters", "reexplore_every_iters", "max_prefetch_depth"):
            v = getattr(self, name)
            if not (isinstance(v, int) and not isinstance(v, bool) and v >= 0):
                raise ConfigError(f"PolicyConfig.{name} must be a non-negative integer, got {v!r}")
        if self.max_prefetch_depth > 64:
            raise ConfigError(f"PolicyConfig.max_prefetch_depth must be at most 64, got {self.max_prefetch_depth}")
        for name in (
            "min_gain",
            "max_threshold",
            "drift",
            "device_step",
            "stripe_step",
            "contention_ratio",
            "rate_change",
            "unfelt_rate_change",
            "model_gain",
            "depth_gain",
        ):
            v = getattr(self, name)
            if not (isinstance(v, (int, float)) and 0 < v <= 1):
                raise ConfigError(f"PolicyConfig.{name} must be in (0, 1], got {v!r}")
        if self.min_gain > self.max_threshold:
            raise ConfigError(f"PolicyConfig.min_gain ({self.min_gain}) must not exceed max_threshold ({self.max_threshold})")
        if not (isinstance(self.min_stripe_share, (int, float)) and 0 <= self.min_stripe_share < 0.5):
            raise ConfigError(f"PolicyConfig.min_stripe_share must be in [0, 0.5), got {self.min_stripe_share!r}")
        if not (isinstance(self.noise_k, (int, float)) and self.noise_k >= 0):
            raise ConfigError(f"PolicyConfig.noise_k must be a non-negative number, got {self.noise_k!r}")
        if not (isinstance(self.contention_min_bytes_per_s, (int, float)) and self.contention_min_bytes_per_s > 0):
            raise ConfigError(
                f"PolicyConfig.contention_min_bytes_per_s must be positive, got {self.contention_min_bytes_per_s!r}"
            )
        if self.host_staging_bytes is not None and not (isinstance(self.host_staging_bytes, int) and self.host_staging_bytes > 0):
            raise ConfigError(
                f"PolicyConfig.host_staging_bytes must be a positive integer or None, got {self.host_staging_bytes!r}"
            )
