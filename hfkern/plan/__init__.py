"""Plans for a sweep: the Pareto set of (time, memory) execution strategies, and applying one.

How fast B fused models train, and how many fit a device, depends on choices
a user should not have to make by hand: the array size B, arrays in flight,
precision, which blocks recompute their activations, micro-batches, layout.
``hfkern.plan(factory, example_batch, trials=T, steps=S)`` (the module is
callable: :func:`plan`) fits a cost model from a few measured steps
(:func:`fit_cost_model`), searches the strategy space by dynamic programming
over the model's blocks (:func:`search`) and returns a :class:`PlanSet`: the
Pareto-optimal plans, a table, a plot, :meth:`PlanSet.best` within a memory
budget. :func:`apply` puts a plan's strategy on a fused model (recomputation
wrappers, layout) and :func:`make_step` is its training step (autocast,
micro-batches), so training code does not change.
"""

from __future__ import annotations

import sys
import types

from ._cost import (FittedCostModel, Profile, default_profile_B, fit_cost_model, fit_profiles, profile_step,
                    profile_together)
from ._plan import PlanSet, plan
from ._search import BlockCost, Plan, SharedBytes, StepCost, pareto_front, search, search_brute_force
from ._strategy import InFlight, Recompute, Strategy, applied, apply, blocks, make_step, unapply

__all__ = [
    "BlockCost", "FittedCostModel", "InFlight", "Plan", "PlanSet", "Profile", "Recompute", "SharedBytes", "StepCost",
    "Strategy",
    "applied", "apply", "blocks", "default_profile_B", "fit_cost_model", "fit_profiles", "make_step", "pareto_front", "plan",
    "profile_step", "profile_together", "search", "search_brute_force", "unapply",
]


class _CallableModule(types.ModuleType):
    """``hfkern.plan(...)`` is :func:`plan`; ``hfkern.plan.<name>`` the rest of the package."""

    def __call__(self, *args, **kwargs) -> PlanSet:
        return plan(*args, **kwargs)


sys.modules[__name__].__class__ = _CallableModule
