"""A cost model of a fused training step from a few measured steps.

:func:`fit_cost_model` profiles the fused model (``hfkern.fuse(factory, B)``) at a
few array sizes B for each setting (precision, micro-batches, layout) and fits,
per top-level block and for the rest of the step, time and memory as curves in
B. :class:`FittedCostModel` then gives any B's costs (:class:`StepCost`), which is
what the search (:func:`hfkern.plan._search.search`) needs.

What one profiled step records:

* each block's forward time (calls at the start and end of each run of the
  block's nodes in the fused forward's graph, what a recomputation
  checkpoints; CUDA events on a GPU, so that nothing synchronizes inside the
  step), the time of the model's forward outside every block, and the whole
  step's time and the optimizer's;
* the bytes each block saves for backward in one forward of the model
  (``saved_tensors_hooks`` while its code runs; a storage saved twice counts
  once, over all the block's calls) and the bytes of its inputs (what it
  keeps when recomputed); and each activation with the blocks that hold it,
  those that save it and those that read it (:attr:`Profile.held`): it is
  freed only where none of them holds it;
* the persistent bytes (parameters, optimizer state), the gradients', and the
  step's peak (CUDA allocator statistics; on the CPU the profiler's memory
  events, :mod:`hfkern.sweep._memory`).

The model: a block's forward and backward take its forward time scaled by the
step's (time less the optimizer's) over the model's forward, i.e. the rest of
the step (loss, backward, dispatch) is shared in proportion, and the share of
the forward outside every block (the model's own code, and blocks the step
never ran as code of their own, which cannot be recomputed) stays the rest of
the step's; recomputing a block costs its forward again. Memory is persistent + gradients + the
activations held + a residual (what the blocks' saved tensors do not
explain: gradients of activations during backward, workspaces), the residual
fitted from the measured peaks. The profiles of each block recomputed alone,
and of all of them together, calibrate what a recomputation adds in time,
frees at the end of the forward, and holds again in its backward.
"""

from __future__ import annotations

import dataclasses
import gc
import json
import numbers
import statistics
import time
import warnings
from typing import Any, Callable, Sequence

import torch
from torch import nn

from .._array import broadcast
from ..fusion import FusedModel, fuse
from ._search import BlockCost, SharedBytes, StepCost, check_spaces, held_bytes, step_costs
from ._strategy import (_NOT_CALLED, InFlight, Strategy, _inputs_written, _known_mean, _marked, _not_recomputable,
                        apply, blocks, make_step)

__all__ = ["FittedCostModel", "Profile", "fit_cost_model", "fit_profiles", "profile_step", "profile_together"]


class _Clock:
    """Timestamps that do not synchronize a CUDA device inside the step."""

    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"

    def mark(self) -> Any:
        if self.cuda:
            e = torch.cuda.Event(enable_timing=True)
            e.record()
            return e
        return time.perf_counter()

    def seconds(self, start: Any, end: Any) -> float:
        return start.elapsed_time(end) / 1e3 if self.cuda else end - start


@dataclasses.dataclass(frozen=True)
class Profile:
    """One setting's measured step (medians over the profiled steps)."""

    strategy: Strategy
    step_time: float                 # seconds
    optimizer_time: float            # seconds
    forward_time: dict[str, float]   # block -> seconds of its forward(s) in a step, in forward order
    saved: dict[str, float]          # block -> bytes saved for backward by its calls in one forward
    inputs: dict[str, float]         # block -> bytes of its inputs in one forward
    persistent: float                # bytes: parameters and optimizer state
    gradients: float                 # bytes
    peak: float                      # bytes: the step's peak, persistent included
    # Seconds of the model's forward in a step outside every block's code (its own code, children
    # without parameters): the rest of the step's, not a block's. 0 where not measured.
    other_forward_time: float = 0.0
    # Blocks the step never ran as code of their own (the model's forward uses their parameters
    # directly): nothing was measured for them, and they cannot be recomputed.
    unseen: tuple[str, ...] = ()
    # The activations by who holds them, per forward: (blocks that save them for backward, blocks
    # that read them as inputs, bytes), blocks in forward order. A tensor held outside every block
    # (the batch, what the model's own code saves) is not among them. Empty where not recorded:
    # each block's saved bytes and inputs are then taken as its own.
    held: tuple[tuple[tuple[str, ...], tuple[str, ...], float], ...] = ()


def _nbytes(t: torch.Tensor) -> int:
    return t.untyped_storage().nbytes() if t.layout == torch.strided else t.element_size() * t.numel()


def _storage(t: torch.Tensor) -> int:
    return t.untyped_storage().data_ptr()


class _Recorder:
    """Per block: forward times, saved and input bytes; and the time of the model's forwards.

    Of a fused model (:func:`hfkern.fuse`), a block is the runs of its nodes in the fused
    forward's graph, what a recomputation checkpoints: the fused model calls a block's leaf
    layers directly, never the block, and a block whose own code uses a parameter (``x @
    self.w``) calls no layer at all. The forward runs with a call at the start and the end of
    each run (:func:`hfkern.plan._strategy._marked`); a run's inputs are the values it reads
    from outside it, what its recomputation keeps. Of another array model, hooks on each block's
    leaf modules: a block's input is that of its first layer called after another block's.

    Per forward of the model (each micro-batch's), a storage saved for backward counts once, for
    the first block that saves it (a block's output the next block saves as its input is held
    once): a block entered twice, another block between, keeps both calls' activations until
    backward, as one that is entered twice in a row. Parameters and buffers
    (and views of them) that a block saves or reads are not activations. A block never seen
    is reported (:attr:`Profile.unseen`); the time of the forward outside every block is
    measured too (:attr:`Profile.other_forward_time`).

    Each activation's holders are recorded too (:attr:`held`): the blocks that save it and those
    that read it as an input, which a recomputation keeps. Recomputing one of them frees it only
    where no other holds it. What the model's own code saves, and the batch, is held whatever
    recomputes. Inputs are referenced until the end of the forward, so that a storage freed in it
    is not taken for a later one at the same address.
    """

    def __init__(self, model: nn.Module, names: Sequence[str], clock: _Clock):
        self.clock, self.names = clock, list(names)
        self.marks: dict[str, list[tuple[Any, Any]]] = {n: [] for n in names}
        self.forward_marks: list[tuple[Any, Any]] = []  # each recorded forward of the model
        self.saved = {n: 0.0 for n in names}
        self.inputs = {n: 0.0 for n in names}
        self.calls = {n: 0 for n in names}
        self.forwards = 0
        self.order: list[str] = []  # blocks by their first call: forward order
        self._recording = False
        self._current: str | None = None
        self._last: str | None = None
        self._saved_storages: set[int] = set()       # the storages saved (this forward), by any block
        self._seen_inputs: dict[str, set[int]] = {}  # per block, those it read
        self._persistent = {_storage(t) for t in (*model.parameters(), *model.buffers())}
        # Holders of this forward's activations, by storage (until the next forward): who saves
        # it, who reads it; those held outside every block; the inputs referenced meanwhile.
        self.held: dict[tuple[tuple[str, ...], tuple[str, ...]], float] = {}
        self._savers: dict[int, set[str]] = {}
        self._readers: dict[int, set[str]] = {}
        self._sizes: dict[int, int] = {}
        self._outside: set[int] = set()
        self._referenced: list[torch.Tensor] = []
        self._in_forward = False
        # Every forward of the model (each micro-batch's) is recorded where it builds a graph.
        self._handles = [model.register_forward_pre_hook(self._begin), model.register_forward_hook(self._end)]
        self._restore: Callable[[], None] | None = None
        if not names:
            return
        if isinstance(model, FusedModel):
            graphs = model._graphs
            marked = {mode: _marked(g, set(names), self._enter_run, self._leave) for mode, g in graphs.items()}
            model._run_graphs(marked)

            def restore() -> None:
                if model._graphs is marked:  # (a capture of a new call pattern has replaced them)
                    model._run_graphs(graphs)
            self._restore = restore
            return
        for n in names:
            block = model.get_submodule(n)
            leaves = [m for m in block.modules() if not any(True for _ in m.children())] or [block]
            for m in leaves:
                self._handles.append(m.register_forward_pre_hook(self._pre(n)))
                self._handles.append(m.register_forward_hook(lambda module, args, out, n=n: self._leave(n)))

    def _begin(self, module: nn.Module, args: Any) -> None:
        self._flush()
        self._recording = torch.is_grad_enabled()  # not evaluation
        if self._recording:
            self.forwards += 1
            self._last = self._current = None
            self._saved_storages, self._seen_inputs = set(), {}
            self._in_forward = True
            self._outside = {_storage(t) for t in torch.utils._pytree.tree_leaves(args)
                             if isinstance(t, torch.Tensor) and t.layout == torch.strided}  # the batch
            self._forward_start = self.clock.mark()

    def _end(self, module: nn.Module, args: Any, out: Any) -> None:
        if self._recording:
            self.forward_marks.append((self._forward_start, self.clock.mark()))
        self._recording, self._current, self._in_forward = False, None, False
        self._referenced = []

    def _flush(self) -> None:
        """The last forward's activations into :attr:`held`, by holders (in forward order)."""
        rank = {n: i for i, n in enumerate(self.order)}
        for key in self._savers.keys() | self._readers.keys():
            if key in self._outside:
                continue
            savers = tuple(sorted(self._savers.get(key, ()), key=rank.__getitem__))
            readers = tuple(sorted(self._readers.get(key, ()), key=rank.__getitem__))
            self.held[savers, readers] = self.held.get((savers, readers), 0.0) + self._sizes[key]
        self._savers, self._readers, self._sizes, self._outside = {}, {}, {}, set()
        self._referenced = []

    def _enter(self, name: str, inputs: Sequence[Any]) -> None:
        if name not in self.order:
            self.order.append(name)
        if self._last != name:
            self._last = name
            self.calls[name] += 1
        seen = self._seen_inputs.setdefault(name, set())
        for a in inputs:
            if isinstance(a, torch.Tensor) and a.layout == torch.strided:
                key = _storage(a)
                if key not in seen and key not in self._persistent:
                    seen.add(key)
                    self.inputs[name] += _nbytes(a)
                    self._readers.setdefault(key, set()).add(name)
                    self._sizes[key] = _nbytes(a)
                    self._referenced.append(a)
        self._current = name
        self._start = self.clock.mark()

    def _enter_run(self, name: str, *inputs: Any) -> None:
        if self._recording:
            self._enter(name, inputs)

    def _pre(self, name: str):
        def hook(module, args):
            if self._recording:
                self._enter(name, args if self._last != name else ())  # the block's first layer of a call
        return hook

    def _leave(self, name: str) -> None:
        if self._current != name:
            return
        self.marks[name].append((self._start, self.clock.mark()))
        self._current = None

    def pack(self, t: torch.Tensor) -> torch.Tensor:
        name = self._current
        if t.layout != torch.strided:
            return t
        key = _storage(t)
        if key in self._persistent:
            return t
        if name is not None:
            if key not in self._saved_storages:
                # Once per forward, to the first block that saves it: a block's output that the next
                # block saves too (its input) is held once, and the blocks' saved bytes add up.
                self._saved_storages.add(key)
                self.saved[name] += _nbytes(t)
            self._savers.setdefault(key, set()).add(name)
            self._sizes[key] = _nbytes(t)
        elif self._in_forward or key in self._savers:
            # Saved outside every block: by the model's own code, or after the forward (the loss
            # saving the model's output). After the forward, an input no block saved may have
            # been freed and its address taken by the loss's tensors: only saved ones count.
            self._outside.add(key)
        return t

    def close(self) -> None:
        self._flush()
        for h in self._handles:
            h.remove()
        self._handles = []
        if self._restore is not None:
            self._restore()
            self._restore = None


def _state_bytes(optimizer: torch.optim.Optimizer) -> int:
    return sum(_nbytes(v) for s in optimizer.state.values() for v in s.values() if isinstance(v, torch.Tensor))


def _peak_of(fn: Callable[[], None], device: torch.device) -> float:
    from ..sweep._memory import _cpu_peak_bytes, _cuda_peak_bytes

    return float(_cuda_peak_bytes(fn, device) if device.type == "cuda" else _cpu_peak_bytes(fn))


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _samples(y: torch.Tensor) -> int:
    return y.size(0)


class _Run:
    """One strategy's arrays built on the device and warmed up: its steps are timed one at a time
    (:meth:`time`), then :meth:`finish` measures the blocks and the peak and gives the Profile."""

    def __init__(self, factory: Callable[[], nn.Module], batch: tuple[torch.Tensor, torch.Tensor],
                 strategy: Strategy, optimizer: Callable, loss_fn: Callable, device: torch.device, warmup: int):
        self.strategy, self.device = strategy, device
        self.x, self.y = (t.to(device) for t in batch)
        # Arrays in flight: that many arrays, their steps run together (InFlight: a CUDA stream
        # each); the first array's optimizer is timed, and blocks are measured with one array only.
        self.models = [fuse(factory, strategy.B).to(device) for _ in range(strategy.arrays)]
        self.opts = []
        for m in self.models:
            apply(m, strategy)
            self.opts.append(optimizer(m.parameters()))
        # A loss whose mean make_step cannot see is weighted by samples here: the profile times the
        # step, whatever the weights (make_step refuses ignored targets for it without a
        # loss_denominator, which training passes).
        kw = {}
        if strategy.micro_batches > 1 and _known_mean(loss_fn, strategy.B, True) is None:
            kw["loss_denominator"] = _samples
        steps_of = [make_step(m, o, strategy, loss_fn, **kw) for m, o in zip(self.models, self.opts)]
        self.step = steps_of[0] if len(steps_of) == 1 else InFlight(steps_of, device)
        self.clock = _Clock(device)
        opt, self.opt_marks = self.opts[0], []
        self.hooks = [opt.register_step_pre_hook(lambda *a: self.opt_marks.append((self.clock.mark(), None))),
                      opt.register_step_post_hook(
                          lambda *a: self.opt_marks.__setitem__(-1, (self.opt_marks[-1][0], self.clock.mark())))]
        for _ in range(warmup):
            self.step(self.x, self.y)
        _sync(device)
        self.opt_marks.clear()
        self.step_times: list[float] = []

    def time(self) -> None:
        """One step, timed. The step's time is measured without the block hooks: they run Python at
        every layer and every saved tensor, which a model of many small layers would pay in every
        prediction. The hooked steps of :meth:`finish` give the blocks' shares and saved bytes only."""
        _sync(self.device)
        start = self.clock.mark()
        self.step(self.x, self.y)
        end = self.clock.mark()
        _sync(self.device)
        self.step_times.append(self.clock.seconds(start, end))

    def close(self) -> None:
        """Remove the optimizer's timing hooks (they hold this run: a cycle until removed)."""
        for h in self.hooks:
            h.remove()
        self.hooks = []

    def finish(self, steps: int, measure_blocks: bool) -> Profile:
        x, y, clock, model = self.x, self.y, self.clock, self.models[0]
        optimizer_times = [clock.seconds(a, b) for a, b in self.opt_marks]
        names = blocks(model) if measure_blocks and len(self.models) == 1 else []
        rec = _Recorder(model, names, clock)
        try:
            if names:
                with torch.autograd.graph.saved_tensors_hooks(rec.pack, lambda t: t):
                    for _ in range(steps):
                        self.step(x, y)
                _sync(self.device)
        finally:
            rec.close()
            self.close()
        # In forward order (registration order may differ: PointNet registers its convolutions
        # before the batch norms between them): what is alive while a block recomputes follows it.
        names = rec.order + [n for n in names if n not in rec.order]
        forward = {n: sum(clock.seconds(a, b) for a, b in rec.marks[n]) / steps for n in names}
        other_forward = 0.0
        if names:  # what the model's forwards took outside every block: the rest of the step's
            whole = sum(clock.seconds(a, b) for a, b in rec.forward_marks) / steps
            other_forward = max(whole - sum(forward.values()), 0.0)
        forwards = max(rec.forwards, 1)  # a block's bytes are per forward of the model, all its calls
        gradients = float(sum(_nbytes(p.grad) for m in self.models for p in m.parameters() if p.grad is not None))
        persistent = float(sum(sum(_nbytes(p) for p in m.parameters()) + _state_bytes(o)
                               + sum(_nbytes(b) for b in m.buffers()) for m, o in zip(self.models, self.opts)))
        gc.collect()
        peak = persistent + _peak_of(lambda: self.step(x, y), self.device)
        return Profile(self.strategy, statistics.median(self.step_times), statistics.median(optimizer_times),
                       forward, {n: rec.saved[n] / forwards for n in names},
                       {n: rec.inputs[n] / forwards for n in names}, persistent, gradients, peak,
                       other_forward_time=other_forward, unseen=tuple(n for n in names if not rec.calls[n]),
                       held=tuple((savers, readers, nbytes / forwards)
                                  for (savers, readers), nbytes in rec.held.items()))


def _time_in_rounds(runs: Sequence[_Run], steps: int) -> None:
    """``steps`` rounds, each timing one step of every run, the order rotated from round to round."""
    for r in range(steps):
        for i in range(len(runs)):
            runs[(r + i) % len(runs)].time()


def _scaled(p: Profile, factor: float) -> Profile:
    """``p`` with every time multiplied by ``factor``."""
    return dataclasses.replace(p, step_time=p.step_time * factor, optimizer_time=p.optimizer_time * factor,
                               forward_time={n: t * factor for n, t in p.forward_time.items()},
                               other_forward_time=p.other_forward_time * factor)


def check_run_args(who: str, optimizer: Any, loss_fn: Any, steps: Any, warmup: Any, *,
                   defaults: bool = False) -> None:
    """TypeError/ValueError, before any profiling, for an ``optimizer`` or ``loss_fn`` that is
    not callable (None allowed where ``defaults``), ``steps`` that is not a positive int and
    ``warmup`` that is not a non-negative int."""
    for name, fn in (("optimizer", optimizer), ("loss_fn", loss_fn)):
        if not (callable(fn) or defaults and fn is None):
            expected = "a callable or None" if defaults else "a callable"
            raise TypeError(f"{who}: expected {name} to be {expected}, got {type(fn).__name__} {fn!r}")
    check_spaces(who, None, steps)
    if isinstance(warmup, bool) or not isinstance(warmup, numbers.Integral):
        raise TypeError(f"{who}: expected warmup to be an int >= 0, got {type(warmup).__name__} {warmup!r}")
    if warmup < 0:
        raise ValueError(f"{who}: expected warmup to be an int >= 0, got {warmup!r}")


def profile_together(factory: Callable[[], nn.Module], batch: tuple[torch.Tensor, torch.Tensor],
                     strategies: Sequence[Strategy], *, optimizer: Callable, loss_fn: Callable,
                     device: torch.device | str, steps: int = 3, warmup: int = 2,
                     measure_blocks: bool | Sequence[bool] = True) -> list[Profile]:
    """Profiles of several strategies whose step times are measured in interleaved rounds.

    Every strategy's arrays are built and warmed up first; then each of ``steps``
    rounds times one step of each (the order rotated from round to round), and
    each step time is the median of its rounds. A device whose speed drifts
    (a CPU's clock and its neighbours, a GPU's clocks) then slows every
    strategy alike, and their differences (what recomputing a block costs)
    keep their sign and size; timed one after another, one strategy may see a
    fast spell and the next a slow one. Blocks and peaks are measured after
    the rounds, one strategy at a time, whose arrays are freed once measured.
    ``measure_blocks``: one bool for all or a sequence of one per strategy.
    ``device``: a torch.device or its name (``"cpu"``, ``"cuda"``; None: CUDA
    where available). ``steps`` >= 1, ``warmup`` >= 0.

    Raises TypeError/ValueError, before building anything, for arguments
    outside these (a ``measure_blocks`` of another length than ``strategies``,
    a strategy that is not a :class:`Strategy`, an unavailable device).
    """
    from ..sweep._memory import _check_device

    who = "profile_together"
    check_model_args(who, factory, batch)
    if isinstance(strategies, (str, bytes)) or not isinstance(strategies, Sequence):
        raise TypeError(f"{who}: expected strategies to be a sequence of Strategy, got "
                        f"{type(strategies).__name__} {strategies!r}")
    strategies = list(strategies)
    bad = [s for s in strategies if not isinstance(s, Strategy)]
    if bad:
        raise TypeError(f"{who}: expected strategies to hold hfkern.plan Strategy objects, got "
                        f"{type(bad[0]).__name__} {bad[0]!r}")
    if isinstance(measure_blocks, bool):
        measure_blocks = [measure_blocks] * len(strategies)
    elif isinstance(measure_blocks, (str, bytes)) or not isinstance(measure_blocks, Sequence):
        raise TypeError(f"{who}: expected measure_blocks to be a bool or a sequence of bools (one per strategy), "
                        f"got {type(measure_blocks).__name__} {measure_blocks!r}")
    else:
        measure_blocks = list(measure_blocks)
        if not all(isinstance(b, bool) for b in measure_blocks):
            raise TypeError(f"{who}: expected measure_blocks to hold bools, got {measure_blocks!r}")
        if len(measure_blocks) != len(strategies):
            raise ValueError(f"{who}: expected one measure_blocks entry per strategy ({len(strategies)}), got "
                             f"{len(measure_blocks)}")
    check_run_args(who, optimizer, loss_fn, steps, warmup)
    device = _check_device(who, device)
    steps, warmup = int(steps), int(warmup)
    runs: list[_Run | None] = [_Run(factory, batch, s, optimizer, loss_fn, device, warmup) for s in strategies]
    _time_in_rounds(runs, steps)
    out = []
    for i, blocks_too in enumerate(measure_blocks):
        out.append(runs[i].finish(steps, blocks_too))
        runs[i] = None  # its arrays freed before the next one's peak is measured
    return out


def profile_step(factory: Callable[[], nn.Module], batch: tuple[torch.Tensor, torch.Tensor], strategy: Strategy,
                 *, optimizer: Callable, loss_fn: Callable, device: torch.device | str, steps: int = 3,
                 warmup: int = 2, measure_blocks: bool = True) -> Profile:
    """Build ``hfkern.fuse(factory, strategy.B)`` under ``strategy`` and measure its steps (medians).

    The arguments as :func:`profile_together` takes them (one strategy, one bool), checked alike."""
    if not isinstance(strategy, Strategy):
        raise TypeError(f"profile_step: expected a hfkern.plan Strategy, got {type(strategy).__name__} {strategy!r}")
    if not isinstance(measure_blocks, bool):
        raise TypeError(f"profile_step: expected measure_blocks to be a bool, got {type(measure_blocks).__name__} "
                        f"{measure_blocks!r}")
    return profile_together(factory, batch, [strategy], optimizer=optimizer, loss_fn=loss_fn, device=device,
                            steps=steps, warmup=warmup, measure_blocks=measure_blocks)[0]


def _least_squares(xs: Sequence[float], ys: Sequence[float]) -> tuple[float, float]:
    """(intercept, slope) of the least-squares line through the points."""
    mx, my = statistics.fmean(xs), statistics.fmean(ys)
    sxx = sum((x - mx) ** 2 for x in xs)
    slope = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sxx
    return my - slope * mx, slope


@dataclasses.dataclass(frozen=True)
class Curve:
    """A cost as a function of B from its values at the profiled B: linear interpolation between
    them (exact at each), and beyond the largest the least-squares slope of the last three from
    the largest's value, not below zero (steps grow linearly in B once the device is busy; the
    smallest B are dominated by per-call costs, which a line through all points would spread
    over every B)."""

    points: tuple[tuple[int, float], ...]  # (B, value), by B

    @classmethod
    def fit(cls, values: dict[int, float]) -> "Curve":
        if len(values) < 2:
            raise ValueError(f"Curve: a cost needs values at two array sizes at least, got B = {list(values)}")
        return cls(tuple(sorted(values.items())))

    def __call__(self, B: float) -> float:
        pts = self.points
        if B >= pts[-1][0]:
            # Continuous at the largest B; never falling (a cost does not shrink as B grows:
            # a falling slope there is measurement noise).
            tail = pts[-3:]
            b = max(_least_squares([x for x, _ in tail], [y for _, y in tail])[1], 0.0)
            a = pts[-1][1] - b * pts[-1][0]
        else:
            i = max(1, next(i for i, (x, _) in enumerate(pts) if x > B))
            (x0, y0), (x1, y1) = pts[i - 1], pts[i]
            b = (y1 - y0) / (x1 - x0)
            a = y0 - b * x0
        return max(a + b * B, 0.0)


@dataclasses.dataclass
class FittedCostModel:
    """Per setting (precision, micro-batches, layout): every block's and the step's costs as curves in B."""

    blocks: list[str]
    fits: dict[tuple[str, int, str], dict[str, Curve]]
    profiles: list[Profile]
    # Blocks that cannot be recomputed, each with the reason: the search leaves them out.
    unrecomputable: dict[str, str] = dataclasses.field(default_factory=dict)

    def settings(self) -> list[tuple[str, int, str]]:
        return list(self.fits)

    def _at(self, setting: tuple[str, int, str], key: str, B: int) -> float:
        return self.fits[setting][key](B)

    def step_cost(self, B: int, precision: str, micro_batches: int, memory_format: str) -> StepCost:
        setting = (precision, micro_batches, memory_format)
        if setting not in self.fits:
            raise ValueError(f"FittedCostModel: no profile of precision={precision!r}, micro_batches="
                             f"{micro_batches}, memory_format={memory_format!r}; fitted: {self.settings()}")
        at = lambda key: self._at(setting, key, B)  # noqa: E731
        fit = self.fits[setting]
        compute = at("compute")       # seconds of the step less the optimizer's
        fwd = {n: at(f"fwd:{n}") for n in self.blocks}
        # The forward outside every block (the model's own code, layers without parameters, blocks
        # never seen) is the rest of the step's: its share stays in the step, not a block's.
        other_fwd = at("fwd_other") if "fwd_other" in fit else 0.0
        forward = sum(fwd.values()) + other_fwd
        share = compute / forward if forward > 0 else 0.0  # forward + backward per second of forward
        # The activations by holders, and what single recomputations showed the hooks miss.
        held = [(*json.loads(key[len("held:"):]), at(key)) for key in fit if key.startswith("held:")]
        memory = _memory_cost(self.blocks, held, {n: at(f"hidden:{n}") for n in self.blocks})
        # Measured recomputation (a profile with the block recomputed alone) where there is one;
        # else its forward again, and its own saved tensors alive again in its backward.
        blocks = tuple(dataclasses.replace(
            m, time=fwd[n] * share, recompute_time=at(f"rc_time:{n}") if f"rc_time:{n}" in fit else fwd[n],
            transient=at(f"rc_peak:{n}") if f"rc_peak:{n}" in fit else _own_bytes(self.blocks, held, n),
            recomputable=n not in self.unrecomputable) for n, m in zip(self.blocks, memory.blocks))
        # No forward measured (no blocks, or none seen): the whole step is the rest's.
        other = at("optimizer") + (other_fwd * share if forward > 0 else compute)
        return StepCost(blocks, other, at("static"), memory.shared)

    def in_flight(self, B: int, precision: str, micro_batches: int, memory_format: str,
                  arrays: int) -> tuple[float, float] | None:
        """``arrays`` arrays run together (:class:`~hfkern.plan._strategy.InFlight`) against one after
        another: (time factor, memory factor) as measured, or None where not profiled."""
        if arrays == 1:
            return 1.0, 1.0
        fit = self.fits.get((precision, micro_batches, memory_format), {})
        if f"arrays{arrays}:time" not in fit:
            return None
        return fit[f"arrays{arrays}:time"](B), fit[f"arrays{arrays}:memory"](B)

    def predict(self, strategy: Strategy) -> tuple[float, float]:
        """(seconds of one step of the strategy's arrays, peak bytes of the device): one array's
        under ``strategy``, times ``strategy.arrays`` (one after another) and what :meth:`in_flight`
        measured for that many together."""
        fixed = {n: self.unrecomputable[n] for n in strategy.recompute if n in self.unrecomputable}
        if fixed:
            raise ValueError("FittedCostModel.predict: expected blocks that can be recomputed, got "
                             + "; ".join(f"{n!r}: {why}" for n, why in fixed.items()))
        cost = self.step_cost(strategy.B, strategy.precision, strategy.micro_batches, strategy.memory_format)
        time, peak = step_costs(cost, strategy.recompute)
        k = strategy.arrays
        factors = self.in_flight(strategy.B, strategy.precision, strategy.micro_batches, strategy.memory_format, k)
        time_factor, memory_factor = factors if factors is not None else (1.0, 1.0)
        return k * time * time_factor, k * peak * memory_factor


_ALWAYS_PROFILED = 8  # the default sizes up to this one must fit; a larger one may be left out


def default_profile_B(device: torch.device | str) -> tuple[int, ...]:
    """The array sizes :func:`fit_cost_model` profiles by default: 1, 2, 4, 8, and 16 on CUDA.

    On a GPU a small model's step is issued by the host: its time stays nearly flat in B while
    the host is the bottleneck and grows with B once the device is, and a curve continued past
    its largest profiled B with the slope it has there misses that knee. Measured on an H200
    (ResNet-18 at full size, bf16, fitted at B <= 8): steps at B = 12 and 16 took 18% and 22%
    longer than predicted. On the CPU the step grows with B from the start. Where the
    profiles at 16 do not fit the device, :func:`fit_cost_model` leaves that size out with a
    warning (given ``B_values`` explicitly, it raises)."""
    return (1, 2, 4, 8, 16) if torch.device(device).type == "cuda" else (1, 2, 4, 8)


def check_model_args(who: str, factory: Any, example_batch: Any) -> None:
    """TypeError for a ``factory`` that is not callable, and for an ``example_batch`` that is not
    ``(inputs, targets)``, two tensors with the samples in dim 0 (before any profiling)."""
    if not callable(factory):
        raise TypeError(f"{who}: factory must be a callable returning a torch model, got {type(factory).__name__}")
    if not (isinstance(example_batch, (tuple, list)) and len(example_batch) == 2
            and all(isinstance(t, torch.Tensor) for t in example_batch)):
        got = type(example_batch).__name__
        if isinstance(example_batch, (tuple, list)):
            got += " of " + ", ".join(type(t).__name__ for t in example_batch)
        raise TypeError(f"{who}: example_batch must be (inputs, targets), two tensors, got {got}")
    x, y = example_batch
    if x.dim() == 0 or y.dim() == 0 or x.shape[0] != y.shape[0]:
        raise ValueError(f"{who}: example_batch's inputs and targets must have the samples in dim 0, got shapes "
                         f"{list(x.shape)} and {list(y.shape)}")


def fit_cost_model(factory: Callable[[], nn.Module], example_batch: tuple[torch.Tensor, torch.Tensor], *,
                   optimizer: Callable | None = None, loss_fn: Callable | None = None,
                   device: torch.device | str | None = None, B_values: Sequence[int] | None = None,
                   precisions: Sequence[str] = ("fp32",), micro_batches: Sequence[int] = (1,),
                   memory_formats: Sequence[str] = ("auto",), arrays: Sequence[int] = (1,), steps: int = 3,
                   warmup: int = 2, recompute: bool = True, interleave: bool = True) -> FittedCostModel:
    """Profile ``hfkern.fuse(factory, B)`` at each B of ``B_values`` in every setting and fit the curves (:class:`Curve`).

    ``B_values``: default :func:`default_profile_B` (1, 2, 4, 8, and 16 on CUDA).
    ``micro_batches``: counts of at most the N samples of ``example_batch`` (else
    ValueError, before any profiling).

    ``example_batch``: ``(inputs [N, ...], targets [N])``, one batch as one model
    sees it. ``optimizer``: ``params -> optimizer`` (default ``hfkern.optim.Adam``);
    ``loss_fn(output, target) -> [B]`` (default per-model cross entropy).
    ``recompute``: also profile each block recomputed alone, and all of them
    together, at every B, and fit what recomputing each costs and saves from
    those (else: its forward again, its inputs kept and its saved tensors alive
    again in its backward, as the hooks see them). Blocks that cannot be
    recomputed are neither profiled recomputed nor recomputed by any plan
    (:attr:`FittedCostModel.unrecomputable`), with a UserWarning naming each:
    those the forward never runs as code of their own, and those whose input
    the forward writes in place, in the block or after it (which
    ``torch.utils.checkpoint``, keeping the inputs, would find modified in
    backward), as the fused graph shows and as one forward of
    ``example_batch``'s inputs (at B = 1, comparing the versions of every
    block's inputs) finds. ``arrays``: array counts in
    flight to profile together (:class:`~hfkern.plan._strategy.InFlight`; on CUDA
    a stream each) at every B, for :meth:`FittedCostModel.in_flight`; counts not
    profiled are modelled as one array after another.

    ``interleave`` (default): each B's strategies are timed together, in
    interleaved rounds (:func:`profile_together`), and then the plain steps of
    all B together, to which each B's times are scaled (the device's drift
    between one B and the next does not bend the curves). Their arrays are
    alive together: one B's plain array, one per block, one with all blocks
    recomputed and one per array in flight, then one plain array per B. ``interleave=False`` profiles one
    strategy at a time (one array alive; pass the result to
    ``hfkern.plan(..., cost_model=...)`` where the arrays of several together
    do not fit the device), and the drift goes into the fit.

    Times are the process's: on the CPU, glibc's malloc maps each large
    allocation afresh (page faults at every step) until enough large blocks
    were freed, after which it serves them from the heap; the same step can
    take twice as long in a fresh process as later on. Fit and train under the
    same conditions (``bench/bench_plan.py`` fixes the thresholds with
    ``MALLOC_MMAP_THRESHOLD_`` and ``MALLOC_TRIM_THRESHOLD_``).
    """
    from .. import optim
    from ..nn.functional import cross_entropy

    from ..sweep._memory import _check_device

    if not isinstance(interleave, bool):
        raise TypeError(f"fit_cost_model: interleave must be a bool, got {type(interleave).__name__}")
    check_model_args("fit_cost_model", factory, example_batch)
    check_run_args("fit_cost_model", optimizer, loss_fn, steps, warmup, defaults=True)
    device = _check_device("fit_cost_model", device)
    by_default = B_values is None
    B_values = default_profile_B(device) if by_default else B_values
    # (numpy ints as ints; TypeError for values of another type, ValueError for those out of range)
    spaces = check_spaces("fit_cost_model", None, steps, B_values=B_values, precisions=precisions,
                          micro_batches=micro_batches, memory_formats=memory_formats, arrays=arrays)
    B_values, precisions, micro_batches = spaces["B_values"], spaces["precisions"], spaces["micro_batches"]
    memory_formats, arrays, steps, warmup = spaces["memory_formats"], list(spaces["arrays"]), int(steps), int(warmup)
    if len(set(B_values)) < 2:
        raise ValueError(f"fit_cost_model: B_values needs at least two distinct sizes to fit curves, got "
                         f"{list(B_values)}")
    check_micro_batches("fit_cost_model", micro_batches, example_batch)
    split = [m for m in micro_batches if m > 1]
    if split:  # make_step refuses them on batch norm: say so before the profiling, which takes minutes
        from ._strategy import _BATCH_NORMS

        norms = [name for name, mod in factory().named_modules() if isinstance(mod, _BATCH_NORMS)]
        if norms:
            raise ValueError(
                f"fit_cost_model: micro_batches={split} on a model with batch norm ({', '.join(norms)}), which "
                "normalizes each micro-batch by its own statistics, not the full batch's; expected "
                "micro_batches=(1,)")
    optimizer = optimizer or (lambda params: optim.Adam(params, lr=1e-3))
    loss_fn = loss_fn or cross_entropy
    profiles: list[Profile] = []
    too_large: set[int] = set()    # default sizes whose profiles ran out of device memory
    # Blocks that cannot be recomputed: those the fused forward never runs as code of its own (no
    # time or activations of their own: the profiles report them), and those whose inputs are
    # written in place in the block or after it, before backward (torch.utils.checkpoint's kept
    # input would be found modified in backward), as the fused graph shows them (apply() refuses
    # those) and as one forward of the fused model finds them. Neither is profiled recomputed,
    # and the search leaves them out.
    one = fuse(factory, 1).to(device)
    fixed = _not_recomputable(one)
    found = _written_inputs(one, example_batch[0], device)
    every = blocks(one)
    del one
    never = [n for n, why in fixed.items() if why == _NOT_CALLED]  # (as the profiles report them too)
    written = {n: why for n, why in fixed.items() if why != _NOT_CALLED}  # as the graph shows
    written.update((n, why) for n, why in found.items() if n not in fixed)  # as the forward finds
    written = {n: written[n] for n in every if n in written}
    names = [n for n in every if n not in fixed and n not in written] if recompute else []  # each recomputed alone
    if recompute and never:
        warnings.warn(f"fit_cost_model: block(s) {never} cannot be recomputed: {_NOT_CALLED}; their time and "
                      f"activations count with the rest of the step, and no plan recomputes them", stacklevel=2)
    for n, why in written.items():
        warnings.warn(f"fit_cost_model: block {n!r} cannot be recomputed: {why}. No plan recomputes it (it keeps "
                      f"its activations, as the plain step does)", stacklevel=2)
    kw = dict(optimizer=optimizer, loss_fn=loss_fn, device=device, steps=steps, warmup=warmup)
    for precision in precisions:
        for m in micro_batches:
            for fmt in memory_formats:
                groups = []
                for B in sorted(set(B_values)):
                    if B in too_large:
                        continue
                    # One B's strategies are timed together (profile_together): the model takes
                    # differences of their times (what a recomputation adds, what a second array
                    # in flight costs), which a drifting device would otherwise distort.
                    strategy = Strategy(B=B, precision=precision, micro_batches=m, memory_format=fmt)
                    group = [strategy]
                    group += [dataclasses.replace(strategy, recompute=(n,)) for n in names]
                    if len(names) > 1:  # and all of them (what the backward of each holds, bounded)
                        group.append(dataclasses.replace(strategy, recompute=tuple(names)))
                    group += [dataclasses.replace(strategy, arrays=k) for k in sorted(set(arrays) - {1})]
                    try:
                        if interleave:
                            groups.append(profile_together(
                                factory, example_batch, group, measure_blocks=[True] + [False] * (len(group) - 1),
                                **kw))
                        else:
                            profiles += [profile_step(factory, example_batch, s, measure_blocks=i == 0, **kw)
                                         for i, s in enumerate(group)]
                    except torch.OutOfMemoryError:
                        if not by_default or B <= _ALWAYS_PROFILED:
                            raise
                        too_large.add(B)
                    if B in too_large:  # out of the handler: the failed arrays are garbage now
                        _release(device)
                        warnings.warn(f"fit_cost_model: the profiles at B = {B} ({strategy.label} and its "
                                      f"variants) do not fit {device}; the curves are fitted without that size "
                                      f"(pass B_values to choose the sizes)", stacklevel=2)
                if interleave:
                    profiles += _scaled_across_B(factory, example_batch, groups, **kw)
    fitted = fit_profiles(profiles)
    for n, why in written.items():
        if n in fitted.blocks:
            fitted.unrecomputable.setdefault(n, why)
    return fitted


def _written_inputs(model: nn.Module, x: torch.Tensor, device: torch.device) -> dict[str, str]:
    """The blocks of ``model`` (a fused array of one model, on ``device``) whose inputs one
    forward of the inputs ``x`` writes in place (:func:`hfkern.plan._strategy._inputs_written`);
    the random number generators are left as they were. (The loss is not called: what it
    computes, and how often it is called, is the profiles'.)"""
    devices = [device.index if device.index is not None else torch.cuda.current_device()] \
        if device.type == "cuda" else []
    with torch.random.fork_rng(devices=devices):
        return _inputs_written(model, (broadcast(x.to(device), 1),))


def check_micro_batches(who: str, micro_batches: Sequence[int], example_batch: tuple[torch.Tensor, ...]) -> None:
    """ValueError, before any profiling, for micro-batch counts above the example batch's N
    samples: a step splits the batch into that many micro-batches, one sample each at least."""
    N = example_batch[0].shape[0]
    over = [m for m in micro_batches if m > N]
    if over:
        raise ValueError(f"{who}: micro_batches {over} exceed the batch size N={N} of example_batch: expected at "
                         f"most one micro-batch per sample (micro_batches <= {N})")


def _release(device: torch.device) -> None:
    """Return what a failed profile held to the device (its arrays, its allocator's cache)."""
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


def _scaled_across_B(factory: Callable[[], nn.Module], batch: tuple[torch.Tensor, torch.Tensor],
                     groups: Sequence[list[Profile]], *, optimizer: Callable, loss_fn: Callable,
                     device: torch.device, steps: int, warmup: int) -> list[Profile]:
    """The profiles of ``groups`` (one B's strategies each, its plain one first), timed one group
    after another, scaled to the plain steps of every B timed together now: the curves in B then
    do not follow the device's drift from one group to the next."""
    runs = [_Run(factory, batch, g[0].strategy, optimizer, loss_fn, device, warmup) for g in groups]
    _time_in_rounds(runs, steps)
    factors = [statistics.median(r.step_times) / g[0].step_time for r, g in zip(runs, groups)]
    for r in runs:
        r.close()
    runs.clear()  # their arrays freed before anything else is profiled
    return [_scaled(p, factor) for factor, group in zip(factors, groups) for p in group]


def _held(p: Profile) -> list[tuple[tuple[str, ...], tuple[str, ...], float]]:
    """A profile's activations by holders (:attr:`Profile.held`); where not recorded, each block's
    saved bytes as its own, and its inputs as what it alone keeps when recomputed."""
    if p.held:
        return [(tuple(s), tuple(r), float(b)) for s, r, b in p.held]
    return ([((n,), (), b) for n, b in p.saved.items()] + [((), (n,), b) for n, b in p.inputs.items()])


def _held_key(savers: Sequence[str], readers: Sequence[str]) -> str:
    return "held:" + json.dumps([list(savers), list(readers)])


def _memory_cost(names: Sequence[str], held: Sequence[tuple[Sequence[str], Sequence[str], float]],
                 hidden: dict[str, float]) -> StepCost:
    """The blocks' memory as a StepCost (times and static 0): what one block holds alone in its
    BlockCost (saved; saved_recompute: what its recomputation keeps), ``hidden[n]`` among its
    saved bytes, the rest as SharedBytes."""
    saved = {n: hidden.get(n, 0.0) for n in names}
    kept = {n: 0.0 for n in names}
    shared = []
    for savers, readers, nbytes in held:
        holders = set(savers) | set(readers)
        if len(holders) == 1:
            (n,) = holders
            if n in saved:
                saved[n] += nbytes if n in savers else 0.0
                kept[n] += nbytes if n in readers else 0.0
        elif holders:
            shared.append(SharedBytes(nbytes, frozenset(savers), frozenset(readers)))
    return StepCost(tuple(BlockCost(n, 0.0, 0.0, saved[n], kept[n], 0.0) for n in names),
                    0.0, 0.0, tuple(shared))


def _own_bytes(names: Sequence[str], held: Sequence[tuple[Sequence[str], Sequence[str], float]], name: str) -> float:
    """What a block saves that no block before it holds (plain) and its recomputation does not
    keep (its inputs): its activations alive again while its recomputation's backward runs, as
    the hooks see them."""
    before = set(names[:list(names).index(name)])
    return sum(nbytes for savers, readers, nbytes in held
               if name in savers and name not in readers and not (set(savers) & before))


def fit_profiles(profiles: Sequence[Profile]) -> FittedCostModel:
    """The cost model of measured profiles: per setting, :class:`Curve` s in B (at least two B each)."""
    by_setting: dict[tuple[str, int, str], dict[int, Profile]] = {}
    single: dict[tuple[str, int, str], dict[str, dict[int, Profile]]] = {}
    several: dict[tuple[str, int, str], dict[int, list[Profile]]] = {}  # several blocks recomputed
    flight: dict[tuple[str, int, str], dict[int, dict[int, Profile]]] = {}
    for p in profiles:
        s = p.strategy
        setting = (s.precision, s.micro_batches, s.memory_format)
        if s.arrays > 1:
            if s.recompute:
                raise ValueError(f"fit_profiles: profiles of arrays in flight recompute nothing, got {s.label}")
            flight.setdefault(setting, {}).setdefault(s.arrays, {})[s.B] = p
            continue
        if len(s.recompute) > 1:
            several.setdefault(setting, {}).setdefault(s.B, []).append(p)
        elif s.recompute:
            single.setdefault(setting, {}).setdefault(s.recompute[0], {})[s.B] = p
        else:
            by_setting.setdefault(setting, {})[s.B] = p
    names: list[str] | None = None
    unseen: dict[str, None] = {}  # (ordered)
    fits = {}
    for setting, by_B in by_setting.items():
        if len(by_B) < 2:
            raise ValueError(f"fit_profiles: setting {setting} has a profile at B = {list(by_B)} only; a curve "
                             f"needs two array sizes")
        for p in by_B.values():  # every B of every setting: one model's blocks
            these = list(p.forward_time)
            if names is None:
                names = these
            elif these != names:
                raise ValueError(f"fit_profiles: profiles of different models (blocks {names} and {these}, "
                                 f"the latter at {p.strategy.label})")
            if set(p.saved) != set(these) or set(p.inputs) != set(these):
                raise ValueError(f"fit_profiles: a profile ({p.strategy.label}) with saved bytes of blocks "
                                 f"{list(p.saved)} and inputs of {list(p.inputs)}, expected its blocks {these}")
            strangers = sorted({n for savers, readers, _ in p.held for n in (*savers, *readers)} - set(these))
            if strangers:
                raise ValueError(f"fit_profiles: a profile ({p.strategy.label}) whose activations are held by "
                                 f"{strangers}, not blocks of {these}")
            unseen.update((n, None) for n in p.unseen)
        series: dict[str, dict[int, float]] = {"compute": {}, "optimizer": {}, "static": {}, "fwd_other": {}}
        rc_profiles = single.get(setting, {})
        for n in [*rc_profiles, *(n for ps in several.get(setting, {}).values() for q in ps
                                  for n in q.strategy.recompute)]:
            if n not in names:
                raise ValueError(f"fit_profiles: a profile recomputes {n!r}, not a block of {names}")
        for B, p in by_B.items():
            series["compute"][B] = p.step_time - p.optimizer_time
            series["optimizer"][B] = p.optimizer_time
            series["fwd_other"][B] = p.other_forward_time
            for n in names:
                series.setdefault(f"fwd:{n}", {})[B] = p.forward_time[n]
            held = _held(p)
            for savers, readers, nbytes in held:
                key = _held_key(savers, readers)
                series.setdefault(key, {})[B] = series.get(key, {}).get(B, 0.0) + nbytes
            # Memory the hooks do not see (tensors an autograd function keeps on its context, a
            # vmapped op's own buffers) is freed by recomputing its block: recomputed alone, block
            # n's measured peak P_n bounds what it frees from below (the peak is at least what
            # remains at the end of the forward), so where it frees more than the recorded
            # activations say, the difference is its hidden bytes.
            cost = _memory_cost(names, held, {})
            plain_held = held_bytes(cost, ())[0]
            rc = {n: rc_by_B[B] for n, rc_by_B in rc_profiles.items() if B in rc_by_B}
            hidden = {n: max(p.peak - q.peak - (plain_held - held_bytes(cost, (n,))[0]), 0.0) for n, q in rc.items()}
            for n in names:
                series.setdefault(f"hidden:{n}", {})[B] = hidden.get(n, 0.0)
            # What the activations do not explain (persistent bytes, gradients, workspaces,
            # gradients of activations in backward) is fitted as the static term.
            cost = _memory_cost(names, held, hidden)
            total = held_bytes(cost, ())[0]
            static = series["static"][B] = p.peak - total
            # Recomputing block n alone: the time it adds, and its measured peak P_n, which the
            # model must give back: P_n = static + max(H_n, through_n + transient_n), H_n what the
            # blocks hold at the end of the forward and through_n what n and the blocks before it
            # hold (n its inputs).
            # Where the first term reaches P_n, the transient is not seen (anything up to P_n fits):
            # it is taken as the block's own saved tensors alive again (those the hooks see), which
            # is what its backward holds at least. Otherwise the transient is what makes the second term P_n.
            for n, q in rc.items():
                end, through = held_bytes(cost, (n,))
                bound = max(q.peak - static - through[n], 0.0)
                series.setdefault(f"rc_time:{n}", {})[B] = max(q.step_time - p.step_time, 0.0)
                # The end of the forward explains P_n within 1% (measurement noise): the transient is not seen.
                explained = static + end >= 0.99 * q.peak
                own = _own_bytes(names, held, n)
                series.setdefault(f"rc_peak:{n}", {})[B] = min(bound, own) if explained else bound
            # Several blocks recomputed together (every one that can be, as fit_cost_model profiles):
            # their peak P_S bounds each one's transient from above, P_S >= static + through_n +
            # transient_n, where a single recomputation's end of the forward hid it. (PointNet's
            # transform networks: recomputed alone, each leaves the peak at the end of the forward;
            # the backward of their recomputation holds less than all they save, the gradients of
            # the large layers after them being freed by then.) And the time they add, measured
            # together, is shared out in proportion to what each added alone: single differences
            # of a few timed steps are noisy, and a plan adds up several.
            for q in sorted(several.get(setting, {}).get(B, ()), key=lambda q: len(q.strategy.recompute)):
                chosen = q.strategy.recompute
                through = held_bytes(cost, chosen)[1]
                for n in chosen:
                    bound = max(q.peak - static - through[n], 0.0)
                    default = _own_bytes(names, held, n)
                    rc_peak = series.setdefault(f"rc_peak:{n}", {})
                    rc_peak[B] = min(rc_peak.get(B, default), bound)
                added = [series.get(f"rc_time:{n}", {}).get(B) for n in chosen]
                if None not in added and sum(added) > 0:
                    factor = max(q.step_time - p.step_time, 0.0) / sum(added)
                    for n in chosen:
                        series[f"rc_time:{n}"][B] *= factor
        # Holders not recorded at some B hold nothing there.
        for key in [k for k in series if k.startswith("held:")]:
            series[key] = {B: series[key].get(B, 0.0) for B in by_B}
        # k arrays in flight against k steps one after another: the time and memory factors.
        for k, flight_by_B in flight.get(setting, {}).items():
            for B, q in flight_by_B.items():
                if B in by_B:
                    series.setdefault(f"arrays{k}:time", {})[B] = q.step_time / (k * by_B[B].step_time)
                    series.setdefault(f"arrays{k}:memory", {})[B] = q.peak / (k * by_B[B].peak)
        fits[setting] = {k: Curve.fit(v) for k, v in series.items()
                         if not k.startswith(("rc_", "arrays")) or len(v) >= 2}
    names = names or []
    reason = ("the profiled step never ran it as code of its own (the model's forward uses its parameters "
              "directly): its time and activations count with the rest of the step")
    return FittedCostModel(names, fits, list(profiles), {n: reason for n in unseen if n in names})
