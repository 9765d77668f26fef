"""Deciding: one synchronous planner that the live pipeline and the trace replay drive.

:class:`~kvtier.plan.planner.Planner` holds every decision about what goes where
(watermarks, victims, where a victim goes, what the write policy copies down, which tier
a fetch reads from, and the policy hooks of every reference); it moves nothing and never
awaits. The live pipeline (:mod:`kvtier.transfer`) asks it over the directory, the replay
(:mod:`kvtier.sim.replay`) over resident sets: one decision path, so a replay predicts
what the live cache does by construction.
"""

from kvtier.plan.limits import TierLimits
from kvtier.plan.planner import EvictPlan, PageView, Planner, PlanTier, Spare

__all__ = ["EvictPlan", "PageView", "PlanTier", "Planner", "Spare", "TierLimits"]
