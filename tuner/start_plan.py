"""Where a run's search starts: its own knobs less what names paths it does not have
(:func:`tuner.knob_text.known_paths`), or the performance model's best plan for a hardware profile
(:func:`model_start`). Pure functions: :class:`tuner.policy.Policy` applies what they return
and logs their notes."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from engine.config import Knobs
from engine.layout import STATE_BYTES_PER_ELEMENT, staging_buffers
from tuner.guards import Limits
from tuner.knob_text import Pins, known_paths
from tuner.moves import diff
from tuner.policy_config import PolicyConfig

if TYPE_CHECKING:
    from perf.profile import Profile
    from tuner.run_state import RunFacts


@dataclass(frozen=True)
class ModelStart:
    """What the model says of a run's start: ``plan`` to start from (None: keep the run's own),
    and ``note``, the reason to log (with the plan: the reason of its first change)."""

    plan: Knobs | None
    note: str
    dropped: str | None = None
    """What the plan named that the run does not have (a guard's note), if anything."""


def model_start(facts: RunFacts, start: Knobs, *, cfg: PolicyConfig, limits: Limits, pins: Pins) -> ModelStart:
    """The performance model's best plan for the run's profile (a name, a path or a Profile) from
    ``start``: within the device's room and the user's pins. The model is advice: any failure
    leaves the run's own start, with the reason."""
    profile: str | Profile = facts.profile
    paths, ranks, subgroup_bytes = facts.paths, facts.ranks, facts.subgroup_bytes
    try:
        from perf.model import Workload
        from perf.search import best_plan

        if isinstance(profile, str):
            from perf.profile_toml import load_profile

            profile = load_profile(profile)
        # The host cache is fixed for the run's life and not a knob: plan for state on the
        # paths, with host memory for the staging buffers of the deepest prefetch only.
        staging = min(limits.staging_cap, staging_buffers(cfg.max_prefetch_depth) * subgroup_bytes) * ranks if paths else None
        # params are per rank; the model's are the whole model (it divides by ranks and nodes).
        wl = Workload(
            params=facts.params * ranks,
            ranks=ranks,
            subgroup_numel=max(1, subgroup_bytes // STATE_BYTES_PER_ELEMENT),
            host_bytes=staging,
            gpu_headroom_bytes=facts.device_headroom_bytes,
        )
        pred = best_plan(profile, wl, paths=list(paths))
        plan, dropped = known_paths(pred.plan.knobs, paths, "the model's plan")
    except Exception as e:
        return ModelStart(None, f"performance model not used ({type(e).__name__}: {e}); searching from the starting knobs")
    fit = plan.device_fraction
    while fit > 0 and not limits.device_fits(fit):
        fit = round(max(0.0, fit - cfg.device_step), 6)
    plan = pins.apply(plan.replace(device_fraction=fit), list(paths), facts.has_device)
    name = getattr(profile, "name", profile)
    if plan == start:
        return ModelStart(None, f"the performance model's best plan for profile {name} is the starting plan", dropped)
    return ModelStart(
        plan,
        f"performance model's best plan for profile {name} (predicted update {pred.update_s:.3f} s): {diff(start, plan)}",
        dropped,
    )
