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
* bytes several blocks hold (:class:`SharedBytes`: a tensor one block saves for
  backward and the next keeps as its input when recomputed) count once, and
  only while one of them holds them;
* while a recomputed block's backward runs, its activations exist again
  (``transient``) on top of what it (its inputs) and the blocks before it
  still hold.

So the peak is ``static + max(held, max over recomputed blocks i of (held by
i and the blocks before it + transient_i))``, ``held`` what the blocks hold at
the end of the forward. A partial strategy over the
first k blocks is the triple (time, saved so far, peak so far); one that is no
better in all three than another is dropped: whatever the remaining blocks
choose, it stays no better. A peak below what the blocks so far and the least
the remaining ones can save is never the step's and counts as 0, so that more
partial strategies are comparable. Shared bytes whose holders are not all
decided yet make partial strategies differ in what they already hold: only
those that hold the same of them are compared. The pruning sorts and sweeps (O(n log n) in
the partial strategies), as does the last filter of the (time, memory) front.
"""

from __future__ import annotations

import bisect
import dataclasses
import itertools
import math
import numbers
from typing import Any, Iterable, Protocol, Sequence

__all__ = ["BlockCost", "CostModel", "Plan", "SharedBytes", "StepCost", "pareto_front", "search", "search_brute_force", "step_costs"]


@dataclasses.dataclass(frozen=True)
class BlockCost:
    """One block's costs in one setting (B, precision, micro-batches, layout), per training step."""

    name: str
    time: float             # seconds of its forward and backward
    recompute_time: float   # seconds its forward takes again when recomputed
    saved: float            # bytes it saves for backward
    saved_recompute: float  # bytes it saves when recomputed (its inputs)
    transient: float        # bytes alive again during its backward when recomputed
    # False: the block cannot be recomputed (the fused forward never runs it as code of its own);
    # the search never chooses it.
    recomputable: bool = True


@dataclasses.dataclass(frozen=True)
class SharedBytes:
    """Bytes that several blocks hold until backward, counted once: alive at the end of the
    forward while one of them holds them, a block of ``savers`` that is not recomputed (it saves
    them for backward) or a block of ``readers`` that is (its recomputation keeps its inputs).

    A block's output that the next block saves for backward (a ReLU's output, the next
    convolution's input) is freed by recomputing neither alone: the first's recomputation does
    not save it, but the second still does, or keeps it as its input when recomputed too."""

    nbytes: float
    savers: frozenset[str]
    readers: frozenset[str] = frozenset()

    def held_by(self, block: str, recomputed: bool) -> bool:
        return block in (self.readers if recomputed else self.savers)


@dataclasses.dataclass(frozen=True)
class StepCost:
    """A setting's costs that do not depend on which blocks recompute."""

    blocks: tuple[BlockCost, ...]
    other_time: float    # seconds of the rest of a step: optimizer, loss, data, dispatch
    static: float        # bytes: parameters, gradients, optimizer state, batch
    # Bytes several blocks hold (a block's own are its BlockCost's saved and saved_recompute).
    shared: tuple[SharedBytes, ...] = ()


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


def held_bytes(cost: StepCost, recompute: Sequence[str]) -> tuple[float, dict[str, float]]:
    """(bytes the blocks hold at the end of the forward, {block: bytes held by it and the blocks
    before it}) when the blocks named in ``recompute`` recompute. While a recomputed block's
    backward runs, what it and the blocks before it hold is alive (its inputs, kept by its
    recomputation, among them), and its transient on top."""
    recompute = set(recompute)
    held, through, taken = 0.0, {}, set()
    for block in cost.blocks:
        rc = block.name in recompute
        held += block.saved_recompute if rc else block.saved
        for i, s in enumerate(cost.shared):
            if i not in taken and s.held_by(block.name, rc):
                taken.add(i)
                held += s.nbytes
        through[block.name] = held
    return held, through


def step_costs(cost: StepCost, recompute: Sequence[str]) -> tuple[float, float]:
    """(step seconds, peak bytes) of one array whose blocks named in ``recompute`` recompute."""
    fixed = [b.name for b in cost.blocks if b.name in recompute and not b.recomputable]
    if fixed:
        raise ValueError(f"step_costs: expected blocks that can be recomputed, got {fixed}")
    held, through = held_bytes(cost, recompute)
    time, peak = cost.other_time, 0.0
    for block in cost.blocks:
        if block.name in recompute:
            time += block.time + block.recompute_time
            peak = max(peak, through[block.name] + block.transient)
        else:
            time += block.time
    return time, cost.static + max(held, peak)


def _prune(states: list[tuple[tuple[float, float, float], Any]]) -> list[tuple[tuple[float, float, float], Any]]:
    """The states (time, saved, peak) not dominated by another (of equal ones, the first).

    Sorted by (time, saved, peak), a state's dominators all come before it, so a
    state is dominated exactly when an earlier kept one has saved and peak no
    larger: the least peak among kept states with saved <= s. That is read off a
    staircase of the kept (saved, peak) pairs, saved rising and peak falling, in
    O(log n) per state (and an amortized O(1) of steps removed).
    """
    states = sorted(states, key=lambda s: s[0])  # by (time, saved, peak), stable: of equal ones the first
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


def _not_dominated(points: Sequence[tuple[float, float]]) -> list[bool]:
    """For each (time, memory) point, whether no other point is at least as good in both and
    differs (equal points are all kept). Sort and sweep, O(n log n): in order of (time, memory),
    a group of equal points is dominated exactly when a point before it has no more memory."""
    order = sorted(range(len(points)), key=points.__getitem__)
    keep = [False] * len(points)
    least = math.inf  # the least memory of the points before the current group
    k = 0
    while k < len(order):
        point = points[order[k]]
        g = k
        while g < len(order) and points[order[g]] == point:
            g += 1
        if point[1] < least:
            for i in order[k:g]:
                keep[i] = True
            least = point[1]
        k = g
    return keep


def _names(chosen: Any) -> tuple[str, ...]:
    """The recomputed blocks of a chain ``(name, (name, ... None))``, in forward order."""
    names = []
    while chosen is not None:
        names.append(chosen[0])
        chosen = chosen[1]
    return tuple(reversed(names))


_BELOW = 1.0 - 1e-9  # a peak below (1 - 1e-9) of the least saved bytes to come cannot be the step's


def _recompute_front(cost: StepCost) -> list[tuple[float, float, tuple[str, ...]]]:
    """(step time, peak bytes, recomputed blocks) of every Pareto-optimal recomputation subset."""
    # A state: (time, held by the blocks so far, peak of the recomputed blocks so far), and its
    # recomputed blocks as a chain (last, earlier chain): extending a state copies nothing.
    # The blocks after the k-th hold at least least[k + 1] more, so the step's peak is at least
    # held + least[k + 1]: a peak below that cannot become the step's, and is taken as 0 (a
    # state's peak enters the step's only through max()): states then differ in fewer ways and
    # more of them are dominated. (A margin keeps the sum's rounding from mattering.)
    # States are grouped by the shared bytes they hold of those whose holders are not all decided
    # ("open"): what the blocks to come add depends on it, so only states of one group compare.
    n = len(cost.blocks)
    least = [0.0] * (n + 1)
    for k in range(n - 1, -1, -1):
        b = cost.blocks[k]
        least[k] = least[k + 1] + (min(b.saved, b.saved_recompute) if b.recomputable else b.saved)
    position = {b.name: k for k, b in enumerate(cost.blocks)}
    touching: list[list[tuple[int, SharedBytes]]] = [[] for _ in range(n)]  # per block, the shared it may hold
    closes = [set() for _ in range(n)]  # per block, the shared whose last holder it is
    for i, s in enumerate(cost.shared):
        ks = sorted(position[name] for name in s.savers | s.readers if name in position)
        for k in ks:
            touching[k].append((i, s))
        if ks:
            closes[ks[-1]].add(i)
    groups: dict[frozenset[int], list] = {frozenset(): [((cost.other_time, 0.0, 0.0), None)]}
    for k, block in enumerate(cost.blocks):
        grown: dict[frozenset[int], list] = {}
        after = least[k + 1]
        for taken, states in groups.items():
            # Per choice (kept, recomputed): the bytes it adds and the group it leads to.
            choices = []
            for rc in ((False, True) if block.recomputable else (False,)):
                new = [i for i, s in touching[k] if i not in taken and s.held_by(block.name, rc)]
                add = (block.saved_recompute if rc else block.saved) + sum(cost.shared[i].nbytes for i in new)
                key = frozenset(taken.union(new) - closes[k]) if (new or closes[k]) else taken
                choices.append((rc, add, grown.setdefault(key, [])))
            for (time, held, peak), chosen in states:
                for rc, add, out in choices:
                    h = held + add
                    if rc:
                        p = max(peak, h + block.transient)
                        out.append(((time + block.time + block.recompute_time, h,
                                     p if p >= (h + after) * _BELOW else 0.0), (block.name, chosen)))
                    else:
                        out.append(((time + block.time, h, peak if peak >= (h + after) * _BELOW else 0.0), chosen))
        groups = {key: _prune(states) for key, states in grown.items()}
    states = [state for group in groups.values() for state in group]
    out = [(time, cost.static + max(held, peak), chosen) for (time, held, peak), chosen in states]
    keep = _not_dominated([(t, m) for t, m, _ in out])
    return [(t, m, _names(c)) for (t, m, c), k in zip(out, keep) if k]


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
    within ``memory_budget`` bytes if given, by increasing memory. Of plans with equal time and
    memory only the first (in the order given) is kept: the front holds one plan per point."""
    memory_budget = check_budget("pareto_front", memory_budget)
    plans = [p for p in plans if memory_budget is None or p.peak_memory <= memory_budget]
    plans.sort(key=lambda p: (p.peak_memory, p.time))
    front: list[Plan] = []
    for p in plans:
        if not front or p.time < front[-1].time:
            front.append(p)
    return front


def _is_int(value: object) -> bool:
    """An int (numpy's too), not a bool."""
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


def check_budget(who: str, memory_budget: Any) -> float | None:
    """``memory_budget`` as float bytes (None stays None): TypeError for what is not a real
    number (a str, a bool), ValueError for one not finite or not positive."""
    if memory_budget is None:
        return None
    if isinstance(memory_budget, bool) or not isinstance(memory_budget, numbers.Real):
        raise TypeError(f"{who}: expected memory_budget as a number of bytes, got "
                        f"{type(memory_budget).__name__} {memory_budget!r}")
    value = float(memory_budget)
    if not math.isfinite(value) or value <= 0:
        raise ValueError(f"{who}: expected memory_budget as a positive, finite number of bytes, got {memory_budget!r}")
    return value


def check_spaces(who: str, trials: int | None, steps: int | None, **spaces: Sequence) -> dict[str, tuple]:
    """The spaces as tuples (numpy ints as ints), or an error naming the field: ``trials`` and
    ``steps`` positive ints (None: not checked) and every space a non-empty sequence (a 1-d numpy array too) of
    valid choices: ``precisions`` and ``memory_formats`` from :class:`hfkern.plan.Strategy`'s,
    the others (``B_values``, ``micro_batches``, ``arrays``) positive ints. TypeError for a value
    of another type (a float, a bool, a str where a sequence belongs), ValueError for one of the
    right type out of range (0, an unknown precision, an empty sequence)."""
    from ._strategy import MEMORY_FORMATS, PRECISIONS

    for name, value in (("trials", trials), ("steps", steps)):
        if value is None:
            continue
        if not _is_int(value):
            raise TypeError(f"{who}: {name} must be a positive int, got {type(value).__name__} {value!r}")
        if value < 1:
            raise ValueError(f"{who}: {name} must be a positive int, got {value!r}")
    choices = {"precisions": PRECISIONS, "memory_formats": tuple(MEMORY_FORMATS)}
    out = {}
    for name, values in spaces.items():
        if not isinstance(values, (str, bytes)) and getattr(values, "ndim", None) == 1 and hasattr(values, "tolist"):
            values = values.tolist()  # a numpy array
        if isinstance(values, (str, bytes)) or not isinstance(values, Sequence):
            raise TypeError(f"{who}: {name} must be a non-empty sequence of choices, got "
                            f"{type(values).__name__} {values!r}")
        if not values:
            raise ValueError(f"{who}: {name} must be a non-empty sequence of choices, got {values!r}")
        allowed = choices.get(name)
        for value in values:
            if allowed is not None:
                if not isinstance(value, str):
                    raise TypeError(f"{who}: {name} must hold choices of {allowed}, got {value!r} "
                                    f"({type(value).__name__})")
                if value not in allowed:
                    raise ValueError(f"{who}: {name} must hold choices of {allowed}, got {value!r}")
            else:
                if not _is_int(value):
                    raise TypeError(f"{who}: {name} must hold positive ints, got {value!r} ({type(value).__name__})")
                if value < 1:
                    raise ValueError(f"{who}: {name} must hold positive ints, got {value!r}")
        out[name] = tuple(values) if allowed is not None else tuple(int(v) for v in values)
    return out


def search(model: CostModel, *, trials: int, steps: int, B_values: Sequence[int],
           precisions: Sequence[str] = ("fp32",), micro_batches: Sequence[int] = (1,),
           arrays: Sequence[int] = (1,), memory_formats: Sequence[str] = ("auto",),
           memory_budget: float | None = None) -> list[Plan]:
    """The Pareto set of plans for training ``trials`` trials of ``steps`` steps each.

    Every combination of the enumerated choices, and for each the Pareto-optimal
    recomputation subsets found by dynamic programming over the blocks.
    Returns the plans of the (time, peak memory) front, by increasing memory.
    """
    spaces = check_spaces("search", trials, steps, B_values=B_values, precisions=precisions,
                          micro_batches=micro_batches, arrays=arrays, memory_formats=memory_formats)
    memory_budget = check_budget("search", memory_budget)
    settings = _settings(*spaces.values())
    return pareto_front(_plans(model, int(trials), int(steps), settings, _recompute_front), memory_budget)


def search_brute_force(model: CostModel, *, trials: int, steps: int, B_values: Sequence[int],
                       precisions: Sequence[str] = ("fp32",), micro_batches: Sequence[int] = (1,),
                       arrays: Sequence[int] = (1,), memory_formats: Sequence[str] = ("auto",),
                       memory_budget: float | None = None) -> list[Plan]:
    """:func:`search` by enumerating every recomputation subset (2^blocks per setting): the check of
    the dynamic program on small spaces."""
    spaces = check_spaces("search_brute_force", trials, steps, B_values=B_values, precisions=precisions,
                          micro_batches=micro_batches, arrays=arrays, memory_formats=memory_formats)
    memory_budget = check_budget("search_brute_force", memory_budget)

    def every_subset(cost: StepCost):
        out = []
        for mask in itertools.product((False, True), repeat=len(cost.blocks)):
            if any(rc and not b.recomputable for b, rc in zip(cost.blocks, mask)):
                continue
            chosen = tuple(b.name for b, rc in zip(cost.blocks, mask) if rc)
            out.append((*step_costs(cost, chosen), chosen))
        return out

    settings = _settings(*spaces.values())
    return pareto_front(_plans(model, int(trials), int(steps), settings, every_subset), memory_budget)
