"""``hfkern.plan``: the Pareto set of (time, memory) strategies for training T trials of one model.

:func:`plan` fits a cost model from a few measured steps
(:func:`hfkern.plan.fit_cost_model`), searches the strategy space
(:func:`hfkern.plan._search.search`) and returns a :class:`PlanSet`: the
Pareto-optimal plans as data, a table, a plot of the front, the fastest plan
within a memory budget, and the means to apply one to a fused model.
"""

from __future__ import annotations

import dataclasses
import time
from typing import Callable, Sequence

import torch
from torch import nn

from ._cost import FittedCostModel, check_micro_batches, check_model_args, fit_cost_model
from ._search import Plan, check_budget, check_spaces, search

__all__ = ["PlanSet", "plan"]


def _fmt_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    raise AssertionError


def _fmt_seconds(t: float) -> str:
    """Seconds in a unit that keeps four significant digits readable (µs to hours)."""
    for unit, scale in (("h", 3600.0), ("min", 60.0), ("s", 1.0), ("ms", 1e-3)):
        if abs(t) >= scale:
            return f"{t / scale:.4g} {unit}"
    return f"{t / 1e-6:.4g} µs"


@dataclasses.dataclass
class PlanSet:
    """The Pareto set :func:`plan` found, by increasing memory (so by decreasing time).

    ``front`` holds the plans within ``memory_budget``; ``unbounded_front`` (None: the same as
    ``front``) the whole Pareto set, from which :meth:`best` chooses for another budget.
    """

    front: list[Plan]
    cost_model: FittedCostModel
    trials: int
    steps: int
    memory_budget: float | None
    search_seconds: float
    fit_seconds: float
    device: torch.device
    unbounded_front: list[Plan] | None = None

    def best(self, memory_budget: float | None = None) -> Plan:
        """The fastest plan whose peak memory is within ``memory_budget`` bytes (default: the set's).

        A budget larger than the set's reaches the plans above it too (those of the whole Pareto
        set, which :func:`plan` keeps in ``unbounded_front``). Raises TypeError for a budget that is
        not a number (a str, a bool), ValueError for one not finite or not positive, and for a
        budget no plan fits."""
        budget = self.memory_budget if memory_budget is None else check_budget("PlanSet.best", memory_budget)
        plans = self.front if self.unbounded_front is None else self.unbounded_front
        if not plans:
            raise ValueError("PlanSet.best: expected a set with plans, got none")
        fitting = [p for p in plans if budget is None or p.peak_memory <= budget]
        if not fitting:
            least = min(plans, key=lambda p: p.peak_memory)
            have, need = _fmt_bytes(budget), _fmt_bytes(least.peak_memory)
            if have == need:  # rounded alike: the exact counts tell them apart
                have, need = f"{have} ({int(budget)} bytes)", f"{need} ({int(least.peak_memory)} bytes)"
            raise ValueError(f"PlanSet.best: no plan fits {have}; the smallest needs {need} ({least.strategy.label})")
        return min(fitting, key=lambda p: p.time)

    def table(self, chosen: Plan | None = None):
        """A ``rich.table.Table`` of the front."""
        from rich.table import Table

        budget = "" if self.memory_budget is None else f", budget {_fmt_bytes(self.memory_budget)}"
        table = Table(title=f"Pareto set: {self.trials} trials of {self.steps} steps on {self.device}{budget} "
                            f"(search {self.search_seconds * 1e3:.1f} ms)")
        for col in ("", "B", "precision", "micro-batches", "arrays", "layout", "recompute", "step",
                    "peak memory", "time for all trials"):
            table.add_column(col, justify="right")
        for p in self.front:
            table.add_row("*" if p == chosen else "", str(p.B), p.precision, str(p.micro_batches), str(p.arrays),
                          p.memory_format, ",".join(p.recompute) or "-", _fmt_seconds(p.step_time),
                          _fmt_bytes(p.peak_memory), _fmt_seconds(p.time))
        return table

    def print(self, chosen: Plan | None = None) -> None:
        from rich.console import Console

        Console().print(self.table(chosen))

    def plot(self, path: str | None = None, *, chosen: Plan | None = None,
             measured: Sequence[tuple[Plan, float, float]] = (), title: str | None = None):
        """Time for all trials against peak memory: the predicted front, ``chosen`` marked, and
        ``measured`` points (plan, measured time for all trials, measured peak bytes) beside their
        predictions. Saved to ``path`` if given, drawn on a figure of its own (an Agg canvas: neither
        pyplot's figures nor its backend change); else a pyplot figure. Returns the figure."""
        if path is not None:
            from matplotlib.backends.backend_agg import FigureCanvasAgg
            from matplotlib.figure import Figure

            fig = Figure(figsize=(7, 4.5))
            FigureCanvasAgg(fig)
            ax = fig.subplots()
        else:
            import matplotlib.pyplot as plt

            fig, ax = plt.subplots(figsize=(7, 4.5))
        mib = 1024 ** 2
        ax.step([p.peak_memory / mib for p in self.front], [p.time for p in self.front], where="post",
                color="tab:blue", alpha=0.4)
        ax.scatter([p.peak_memory / mib for p in self.front], [p.time for p in self.front], color="tab:blue",
                   label="predicted Pareto set", zorder=3)
        if measured:
            ax.scatter([m / mib for _, _, m in measured], [t for _, t, _ in measured], marker="x",
                       color="tab:orange", label="measured", zorder=4)
            for p, t, m in measured:
                ax.plot([p.peak_memory / mib, m / mib], [p.time, t], color="tab:orange", alpha=0.3, lw=1)
        if chosen is not None:
            ax.scatter([chosen.peak_memory / mib], [chosen.time], s=160, facecolors="none", edgecolors="tab:red",
                       label=f"chosen: {chosen.strategy.label}", zorder=5)
        if self.memory_budget is not None:
            shown = [p.peak_memory for p in self.front] + [m for _, _, m in measured]
            if not shown or self.memory_budget <= 2 * max(shown):
                ax.axvline(self.memory_budget / mib, color="gray", ls="--", lw=1, label="memory budget")
            else:  # a line far right of the plans would squeeze them all against the axis
                ax.plot([], [], " ", label=f"memory budget {_fmt_bytes(self.memory_budget)} (off the axis)")
        ax.set_xlabel("peak memory per device (MiB)")
        ax.set_ylabel(f"time to train {self.trials} trials (s)")
        ax.set_title(title or f"{self.trials} trials on {self.device}")
        ax.legend(fontsize=8)
        ax.grid(alpha=0.3)
        fig.tight_layout()
        if path is not None:
            fig.savefig(path, dpi=120)
        return fig


def plan(factory: Callable[[], nn.Module], example_batch: tuple[torch.Tensor, torch.Tensor], *, trials: int,
         steps: int, device: torch.device | str | None = None, optimizer: Callable | None = None,
         loss_fn: Callable | None = None, B_values: Sequence[int] | None = None,
         precisions: Sequence[str] | None = None, micro_batches: Sequence[int] = (1,),
         arrays: Sequence[int] | None = None, memory_formats: Sequence[str] = ("auto",),
         memory_budget: float | None = None, profile_B: Sequence[int] | None = None,
         cost_model: FittedCostModel | None = None) -> PlanSet:
    """The Pareto set of strategies for training ``trials`` trials of ``steps`` steps of ``factory``'s model.

    Args:
        factory: one plain torch model per call; the arrays are ``hfkern.fuse(factory, B)``.
        example_batch: ``(inputs [N, ...], targets [N])`` as one model sees a batch.
        optimizer, loss_fn: as :func:`hfkern.plan.fit_cost_model` takes them.
        B_values: array sizes searched (default 1 to 64).
        precisions: default ``("fp32", "bf16")`` on CUDA, ``("fp32",)`` on the CPU.
        micro_batches: micro-batch counts searched (micro-batching changes batch-norm
            statistics: only for models without it), each at most the batch size N of
            ``example_batch`` (else ValueError, before profiling).
        arrays: arrays in flight (default ``(1, 2)`` on CUDA, ``(1,)`` on the CPU), each
            count profiled together (:class:`hfkern.plan.InFlight`: a CUDA stream
            per array) for the cost model.
        memory_formats: layouts searched.
        memory_budget: bytes a device offers; plans above it are left out of
            ``front`` (default: 90% of the device's free memory, as
            :func:`hfkern.max_array_size` reads it), kept in ``unbounded_front`` for
            :meth:`PlanSet.best` with a larger budget. Checked before profiling: TypeError
            for what is not a number (a str such as "8GiB", a bool), ValueError for one
            not finite or not positive.
        profile_B: the array sizes profiled to fit the cost model (default
            :func:`hfkern.plan.default_profile_B`: 1, 2, 4, 8, and 16 on CUDA).
        cost_model: a fitted model to reuse instead of profiling again.
    """
    from ..sweep._memory import _check_device, _free_bytes

    check_model_args("plan", factory, example_batch)
    if cost_model is not None and not isinstance(cost_model, FittedCostModel):
        raise TypeError(f"plan: cost_model must be a FittedCostModel (hfkern.plan.fit_cost_model) or None, got "
                        f"{type(cost_model).__name__}")
    for name, fn in (("optimizer", optimizer), ("loss_fn", loss_fn)):
        if fn is not None and not callable(fn):
            raise TypeError(f"plan: expected {name} to be a callable or None, got {type(fn).__name__} {fn!r}")
    device = _check_device("plan", device)
    cuda = device.type == "cuda"
    precisions = (("fp32", "bf16") if cuda else ("fp32",)) if precisions is None else precisions
    arrays = ((1, 2) if cuda else (1,)) if arrays is None else arrays
    B_values = range(1, 65) if B_values is None else B_values
    # before the profiling, which takes minutes
    spaces = check_spaces("plan", trials, steps, B_values=B_values, precisions=precisions,
                          micro_batches=micro_batches, arrays=arrays, memory_formats=memory_formats)
    if profile_B is not None:
        profile_B = check_spaces("plan", trials, steps, profile_B=profile_B)["profile_B"]
        if len(set(profile_B)) < 2:
            raise ValueError(f"plan: profile_B needs at least two distinct sizes to fit curves, got {list(profile_B)}")
    # a step splits the batch into micro_batches parts: at most one per sample
    check_micro_batches("plan", spaces["micro_batches"], example_batch)
    memory_budget = check_budget("plan", memory_budget)
    trials, steps = int(trials), int(steps)
    B_values, precisions, micro_batches = spaces["B_values"], spaces["precisions"], spaces["micro_batches"]
    arrays, memory_formats = spaces["arrays"], spaces["memory_formats"]
    if memory_budget is None:
        memory_budget = 0.9 * _free_bytes(device)
    start = time.perf_counter()
    if cost_model is None:
        cost_model = fit_cost_model(factory, example_batch, optimizer=optimizer, loss_fn=loss_fn, device=device,
                                    B_values=profile_B, precisions=precisions, micro_batches=micro_batches,
                                    memory_formats=memory_formats, arrays=arrays)
    fitted = time.perf_counter() - start
    start = time.perf_counter()
    unbounded = search(cost_model, trials=trials, steps=steps, B_values=B_values, precisions=precisions,
                       micro_batches=micro_batches, arrays=arrays, memory_formats=memory_formats)
    # The front within the budget is the whole front's plans within it (a plan's dominators need
    # no more memory than it).
    front = [p for p in unbounded if p.peak_memory <= memory_budget]
    searched = time.perf_counter() - start
    if not front:
        raise ValueError(f"plan: no strategy fits the memory budget of {_fmt_bytes(memory_budget)} on {device}")
    return PlanSet(front, cost_model, trials, steps, memory_budget, searched, fitted, device, unbounded)
