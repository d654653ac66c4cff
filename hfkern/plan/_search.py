"""The Pareto set of (time, memory) strategies, by dynamic programming over a model's blocks.

A strategy (:class:`hfkern.plan._strategy.Strategy`) fixes the array size B,
the precision, the micro-batches, the arrays in flight, the memory layout and
which blocks recompute their activations. Everything but the recomputation is
a handful of values, enumerated; the recomputation is a subset of the blocks,
2^n choices, searched by dynamic programming over the blocks in forward order
with dominated partial strategies dropped (as FT/TensorOpt search the Pareto
set of parallelization strategies).

Memory of one step, what the search minimizes with time:

* ``static``: parameters, gradients, optimizer state, the batch;
* the activations each block saves for backward: ``saved`` without
  recomputation, ``saved_recompute`` (its inputs) with it;
* while a recomputed block's backward runs, its activations exist again
  (``transient``) on top of what the blocks before it still hold.

So the peak is ``static + max(sum of saved, max over recomputed blocks i of
(saved of the blocks before i + transient_i))``. A partial strategy over the
first k blocks is the triple (time, saved so far, peak so far); one that is no
better in all three than another is dropped: whatever the remaining blocks
choose, it stays no better.
"""

from __future__ import annotations

import bisect
import dataclasses
import itertools
import math
from typing import Iterable, Protocol, Sequence

__all__ = ["BlockCost", "CostModel", "Plan", "StepCost", "pareto_front", "search", "search_brute_force", "step_costs"]


@dataclasses.dataclass(frozen=True)
class BlockCost:
    """One block's costs in one setting (B, precision, micro-batches, layout), per training step."""

    name: str
    time: float             # seconds of its forward and backward
    recompute_time: float   # seconds its forward takes again when recomputed
    saved: float            # bytes it saves for backward
    saved_recompute: float  # bytes it saves when recomputed (its inputs)
    transient: float        # bytes alive again during its backward when recomputed


@dataclasses.dataclass(frozen=True)
class StepCost:
    """A setting's costs that do not depend on which blocks recompute."""

    blocks: tuple[BlockCost, ...]
    other_time: float    # seconds of the rest of a step: optimizer, loss, data, dispatch
    static: float        # bytes: parameters, gradients, optimizer state, batch


class CostModel(Protocol):
    """What the search needs: a setting's costs. ``hfkern.plan.fit_cost_model`` makes one."""

    def step_cost(self, B: int, precision: str, micro_batches: int, memory_format: str) -> StepCost: ...


@dataclasses.dataclass(frozen=True)
class Plan:
    """A strategy with its predicted costs."""

    B: int
    precision: str
    micro_batches: int
    arrays: int
    memory_format: str
    recompute: tuple[str, ...]
    step_time: float   # seconds per step of one array (its share when several are in flight)
    peak_memory: float  # bytes of the device, all arrays in flight
    time: float        # seconds to train every trial

    @property
    def strategy(self):
        from ._strategy import Strategy

        return Strategy(B=self.B, precision=self.precision, micro_batches=self.micro_batches,
                        recompute=self.recompute, arrays=self.arrays, memory_format=self.memory_format)


def step_costs(cost: StepCost, recompute: Sequence[str]) -> tuple[float, float]:
    """(step seconds, peak bytes) of one array whose blocks named in ``recompute`` recompute."""
    time, saved, peak = cost.other_time, 0.0, 0.0
    for block in cost.blocks:
        if block.name in recompute:
            time += block.time + block.recompute_time
            peak = max(peak, saved + block.transient)
            saved += block.saved_recompute
        else:
            time += block.time
            saved += block.saved
    return time, cost.static + max(saved, peak)


def _dominated(a: tuple[float, ...], b: tuple[float, ...]) -> bool:
    """Whether ``a`` is no better than ``b`` in every component (and so may be dropped for it)."""
    return all(x >= y for x, y in zip(a, b))


def _prune(states: list[tuple[tuple[float, float, float], tuple[str, ...]]]
           ) -> list[tuple[tuple[float, float, float], tuple[str, ...]]]:
    """The states (time, saved, peak) not dominated by another (of equal ones, the first).

    In order of time, a state is dominated exactly when an earlier kept one has
    saved and peak no larger: the least peak among kept states with saved <= s.
    That is read off a staircase of the kept (saved, peak) pairs, saved rising
    and peak falling, in O(log n) per state.
    """
    states = sorted(states, key=lambda s: s[0])
    kept = []
    stair_saved: list[float] = []  # the staircase: saved increasing ...
    stair_peak: list[float] = []   # ... peak decreasing
    for key, choice in states:
        _, saved, peak = key
        i = bisect.bisect_right(stair_saved, saved)
        if i and stair_peak[i - 1] <= peak:
            continue
        kept.append((key, choice))
        # Steps at or after saved with a peak no lower are covered by this one now.
        j = i
        while j < len(stair_saved) and stair_peak[j] >= peak:
            j += 1
        stair_saved[i:j] = [saved]
        stair_peak[i:j] = [peak]
    return kept


def _recompute_front(cost: StepCost) -> list[tuple[float, float, tuple[str, ...]]]:
    """(step time, peak bytes, recomputed blocks) of every Pareto-optimal recomputation subset."""
    # A state: (time, saved by the blocks so far, peak of the recomputed blocks so far).
    states: list[tuple[tuple[float, ...], tuple[str, ...]]] = [((cost.other_time, 0.0, 0.0), ())]
    for block in cost.blocks:
        grown = []
        for (time, saved, peak), chosen in states:
            grown.append(((time + block.time, saved + block.saved, peak), chosen))
            grown.append(((time + block.time + block.recompute_time, saved + block.saved_recompute,
                           max(peak, saved + block.transient)), chosen + (block.name,)))
        states = _prune(grown)
    out = [(time, cost.static + max(saved, peak), chosen) for (time, saved, peak), chosen in states]
    return [(t, m, c) for t, m, c in out if not any(t2 <= t and m2 <= m and (t2, m2) != (t, m) for t2, m2, _ in out)]


def _settings(B_values, precisions, micro_batches, arrays, memory_formats):
    return itertools.product(B_values, precisions, micro_batches, arrays, memory_formats)


def _plans(model: CostModel, trials: int, steps: int, settings, front_of) -> list[Plan]:
    plans = []
    measured = getattr(model, "in_flight", None)
    for B, precision, m, k, fmt in settings:
        cost = model.step_cost(B, precision, m, fmt)
        rounds = math.ceil(trials / (B * k))
        # k arrays in flight share the device: k steps take k times one step's time and memory
        # (one after another), times what measuring k together found (a cost model's in_flight).
        factors = measured(B, precision, m, fmt, k) if (measured is not None and k > 1) else None
        time_factor, memory_factor = factors if factors is not None else (1.0, 1.0)
        for step_time, peak, chosen in front_of(cost):
            step_time *= time_factor
            plans.append(Plan(B, precision, m, k, fmt, chosen, step_time, k * peak * memory_factor,
                              rounds * steps * k * step_time))
    return plans


def pareto_front(plans: Iterable[Plan], memory_budget: float | None = None) -> list[Plan]:
    """The plans no other is at least as good as in both time and memory (and better in one),
    within ``memory_budget`` bytes if given, by increasing memory."""
    plans = [p for p in plans if memory_budget is None or p.peak_memory <= memory_budget]
    plans.sort(key=lambda p: (p.peak_memory, p.time))
    front: list[Plan] = []
    for p in plans:
        if not front or p.time < front[-1].time:
            front.append(p)
    return front


def _positive_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 1


def check_spaces(who: str, trials: int, steps: int, **spaces: Sequence) -> None:
    """ValueError naming the field unless ``trials`` and ``steps`` are positive ints and every
    space is a non-empty sequence of valid choices: ``precisions`` and ``memory_formats`` from
    :class:`hfkern.plan.Strategy`'s, the others (``B_values``, ``micro_batches``, ``arrays``)
    positive ints."""
    from ._strategy import MEMORY_FORMATS, PRECISIONS

    for name, value in (("trials", trials), ("steps", steps)):
        if not _positive_int(value):
            raise ValueError(f"{who}: {name} must be a positive int, got {value!r}")
    choices = {"precisions": PRECISIONS, "memory_formats": tuple(MEMORY_FORMATS)}
    for name, values in spaces.items():
        if isinstance(values, str) or not isinstance(values, Sequence) or not values:
            raise ValueError(f"{who}: {name} must be a non-empty sequence of choices, got {values!r}")
        allowed = choices.get(name)
        for value in values:
            if allowed is not None and value not in allowed:
                raise ValueError(f"{who}: {name} must hold choices of {allowed}, got {value!r}")
            if allowed is None and not _positive_int(value):
                raise ValueError(f"{who}: {name} must hold positive ints, got {value!r}")


def search(model: CostModel, *, trials: int, steps: int, B_values: Sequence[int],
           precisions: Sequence[str] = ("fp32",), micro_batches: Sequence[int] = (1,),
           arrays: Sequence[int] = (1,), memory_formats: Sequence[str] = ("auto",),
           memory_budget: float | None = None) -> list[Plan]:
    """The Pareto set of plans for training ``trials`` trials of ``steps`` steps each.

    Every combination of the enumerated choices, and for each the Pareto-optimal
    recomputation subsets found by dynamic programming over the blocks.
    Returns the plans of the (time, peak memory) front, by increasing memory.
    """
    check_spaces("search", trials, steps, B_values=B_values, precisions=precisions, micro_batches=micro_batches,
                 arrays=arrays, memory_formats=memory_formats)
    settings = _settings(B_values, precisions, micro_batches, arrays, memory_formats)
    return pareto_front(_plans(model, trials, steps, settings, _recompute_front), memory_budget)


def search_brute_force(model: CostModel, *, trials: int, steps: int, B_values: Sequence[int],
                       precisions: Sequence[str] = ("fp32",), micro_batches: Sequence[int] = (1,),
                       arrays: Sequence[int] = (1,), memory_formats: Sequence[str] = ("auto",),
                       memory_budget: float | None = None) -> list[Plan]:
    """:func:`search` by enumerating every recomputation subset (2^blocks per setting): the check of
    the dynamic program on small spaces."""
    check_spaces("search_brute_force", trials, steps, B_values=B_values, precisions=precisions,
                 micro_batches=micro_batches, arrays=arrays, memory_formats=memory_formats)

    def every_subset(cost: StepCost):
        out = []
        for mask in itertools.product((False, True), repeat=len(cost.blocks)):
            chosen = tuple(b.name for b, rc in zip(cost.blocks, mask) if rc)
            out.append((*step_costs(cost, chosen), chosen))
        return out

    settings = _settings(B_values, precisions, micro_batches, arrays, memory_formats)
    return pareto_front(_plans(model, trials, steps, settings, every_subset), memory_budget)
