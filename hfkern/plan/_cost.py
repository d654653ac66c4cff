"""A cost model of a fused training step from a few measured steps.

:func:`fit_cost_model` profiles the fused model (``hfkern.fuse(factory, B)``) at a
few array sizes B for each setting (precision, micro-batches, layout) and fits,
per top-level block and for the rest of the step, time and memory as lines in
B. :class:`FittedCostModel` then gives any B's costs (:class:`StepCost`), which is
what the search (:func:`hfkern.plan._search.search`) needs.

What one profiled step records:

* each block's forward time (hooks around its forward; CUDA events on a GPU,
  so that nothing synchronizes inside the step), and the whole step's time
  and the optimizer's;
* the bytes each block saves for backward (``saved_tensors_hooks`` while its
  forward runs; a storage saved twice counts once) and the bytes of its
  inputs (what it saves when recomputed);
* the persistent bytes (parameters, optimizer state), the gradients', and the
  step's peak (CUDA allocator statistics; on the CPU the profiler's memory
  events, :mod:`hfkern.sweep._memory`).

The model: a block's forward and backward take its forward time scaled by the
step's (time less the optimizer's) over the blocks' forward sum, i.e. the rest
of the step (loss, backward, dispatch) is shared in proportion; recomputing
a block costs its forward again. Memory is persistent + gradients + the
activations saved + a residual (what the blocks' saved tensors do not
explain: gradients of activations during backward, workspaces), the residual
fitted from the measured peaks.
"""

from __future__ import annotations

import dataclasses
import gc
import statistics
import time
from typing import Any, Callable, Sequence

import torch
from torch import nn

from ..fusion import fuse
from ._search import BlockCost, StepCost
from ._strategy import Strategy, apply, blocks, make_step

__all__ = ["FittedCostModel", "Profile", "fit_cost_model", "fit_profiles", "profile_step"]


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
    forward_time: dict[str, float]   # block -> seconds of its forward(s) in a step
    saved: dict[str, float]          # block -> bytes saved for backward, per forward call
    inputs: dict[str, float]         # block -> bytes of its inputs, per forward call
    persistent: float                # bytes: parameters and optimizer state
    gradients: float                 # bytes
    peak: float                      # bytes: the step's peak, persistent included


def _nbytes(t: torch.Tensor) -> int:
    return t.untyped_storage().nbytes() if t.layout == torch.strided else t.element_size() * t.numel()


class _Recorder:
    """Hooks on the blocks of a model: forward times, saved and input bytes."""

    def __init__(self, model: nn.Module, names: Sequence[str], clock: _Clock):
        self.clock, self.names = clock, list(names)
        self.marks: dict[str, list[tuple[Any, Any]]] = {n: [] for n in names}
        self.saved = {n: 0.0 for n in names}
        self.inputs = {n: 0.0 for n in names}
        self.calls = {n: 0 for n in names}
        self._current: str | None = None
        self._seen: set[int] = set()
        self._handles = []
        for n in names:
            m = model.get_submodule(n)
            self._handles.append(m.register_forward_pre_hook(self._pre(n)))
            self._handles.append(m.register_forward_hook(self._post(n)))

    def _pre(self, name: str):
        def hook(module, args):
            if not torch.is_grad_enabled():  # a recomputation in backward, or evaluation
                return
            self._current, self._seen = name, set()
            self.calls[name] += 1
            self.inputs[name] += sum(_nbytes(a) for a in args if isinstance(a, torch.Tensor))
            self._start = self.clock.mark()
        return hook

    def _post(self, name: str):
        def hook(module, args, out):
            if self._current != name:
                return
            self.marks[name].append((self._start, self.clock.mark()))
            self._current = None
        return hook

    def pack(self, t: torch.Tensor) -> torch.Tensor:
        if self._current is not None and t.layout == torch.strided:
            key = t.untyped_storage().data_ptr()
            if key not in self._seen:
                self._seen.add(key)
                self.saved[self._current] += _nbytes(t)
        return t

    def close(self) -> None:
        for h in self._handles:
            h.remove()


def _state_bytes(optimizer: torch.optim.Optimizer) -> int:
    return sum(_nbytes(v) for s in optimizer.state.values() for v in s.values() if isinstance(v, torch.Tensor))


def _peak_of(fn: Callable[[], None], device: torch.device) -> float:
    from ..sweep._memory import _cpu_peak_bytes, _cuda_peak_bytes

    return float(_cuda_peak_bytes(fn, device) if device.type == "cuda" else _cpu_peak_bytes(fn))


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def profile_step(factory: Callable[[], nn.Module], batch: tuple[torch.Tensor, torch.Tensor], strategy: Strategy,
                 *, optimizer: Callable, loss_fn: Callable, device: torch.device, steps: int = 3,
                 warmup: int = 2, measure_blocks: bool = True) -> Profile:
    """Build ``hfkern.fuse(factory, strategy.B)`` under ``strategy`` and measure its steps (medians)."""
    x, y = (t.to(device) for t in batch)
    model = fuse(factory, strategy.B).to(device)
    apply(model, strategy)
    opt = optimizer(model.parameters())
    step = make_step(model, opt, strategy, loss_fn)
    clock = _Clock(device)
    opt_marks: list[tuple[Any, Any]] = []
    pre = opt.register_step_pre_hook(lambda *a: opt_marks.append((clock.mark(), None)))
    post = opt.register_step_post_hook(lambda *a: opt_marks.__setitem__(-1, (opt_marks[-1][0], clock.mark())))
    for _ in range(warmup):
        step(x, y)
    _sync(device)
    opt_marks.clear()
    names = blocks(model) if measure_blocks else []
    rec = _Recorder(model, names, clock)
    step_times = []
    try:
        with torch.autograd.graph.saved_tensors_hooks(rec.pack, lambda t: t):
            for _ in range(steps):
                _sync(device)
                start = clock.mark()
                step(x, y)
                end = clock.mark()
                _sync(device)
                step_times.append(clock.seconds(start, end))
    finally:
        rec.close()
        pre.remove()
        post.remove()
    forward = {n: sum(clock.seconds(a, b) for a, b in rec.marks[n]) / steps for n in names}
    per_call = {n: max(rec.calls[n], 1) for n in names}
    gradients = float(sum(_nbytes(p.grad) for p in model.parameters() if p.grad is not None))
    persistent = float(sum(_nbytes(p) for p in model.parameters()) + _state_bytes(opt)
                       + sum(_nbytes(b) for b in model.buffers()))
    gc.collect()
    peak = persistent + _peak_of(lambda: step(x, y), device)
    return Profile(strategy, statistics.median(step_times),
                   statistics.median(clock.seconds(a, b) for a, b in opt_marks),
                   forward, {n: rec.saved[n] / per_call[n] for n in names},
                   {n: rec.inputs[n] / per_call[n] for n in names}, persistent, gradients, peak)


def _line(points: dict[int, float]) -> tuple[float, float]:
    """Least-squares (intercept, slope) of value against B."""
    xs, ys = list(points), list(points.values())
    if len(xs) == 1:
        return 0.0, ys[0] / xs[0]
    mx, my = statistics.fmean(xs), statistics.fmean(ys)
    sxx = sum((x - mx) ** 2 for x in xs)
    slope = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sxx
    return my - slope * mx, slope


@dataclasses.dataclass
class FittedCostModel:
    """Per setting (precision, micro-batches, layout): lines in B of every block's and the step's costs."""

    blocks: list[str]
    fits: dict[tuple[str, int, str], dict[str, tuple[float, float]]]
    profiles: list[Profile]

    def settings(self) -> list[tuple[str, int, str]]:
        return list(self.fits)

    def _at(self, setting: tuple[str, int, str], key: str, B: int) -> float:
        a, b = self.fits[setting][key]
        return max(a + b * B, 0.0)

    def step_cost(self, B: int, precision: str, micro_batches: int, memory_format: str) -> StepCost:
        setting = (precision, micro_batches, memory_format)
        if setting not in self.fits:
            raise ValueError(f"FittedCostModel: no profile of precision={precision!r}, micro_batches="
                             f"{micro_batches}, memory_format={memory_format!r}; fitted: {self.settings()}")
        at = lambda key: self._at(setting, key, B)  # noqa: E731
        compute = at("compute")       # seconds of the step less the optimizer's
        fwd = {n: at(f"fwd:{n}") for n in self.blocks}
        total_fwd = sum(fwd.values()) or 1.0
        share = compute / total_fwd   # a block's forward + backward per second of its forward
        blocks = tuple(BlockCost(n, fwd[n] * share, fwd[n], at(f"saved:{n}"), at(f"inputs:{n}"), at(f"saved:{n}"))
                       for n in self.blocks)
        other = at("optimizer") + (0.0 if self.blocks else compute)
        return StepCost(blocks, other, at("static"))

    def predict(self, strategy: Strategy) -> tuple[float, float]:
        """(step seconds, peak bytes) of one array under ``strategy``."""
        cost = self.step_cost(strategy.B, strategy.precision, strategy.micro_batches, strategy.memory_format)
        time_, saved, peak = cost.other_time, 0.0, 0.0
        for b in cost.blocks:
            if b.name in strategy.recompute:
                time_ += b.time + b.recompute_time
                peak = max(peak, saved + b.transient)
                saved += b.saved_recompute
            else:
                time_ += b.time
                saved += b.saved
        return time_, cost.static + max(saved, peak)


def fit_cost_model(factory: Callable[[], nn.Module], example_batch: tuple[torch.Tensor, torch.Tensor], *,
                   optimizer: Callable | None = None, loss_fn: Callable | None = None,
                   device: torch.device | str | None = None, B_values: Sequence[int] = (1, 2, 4),
                   precisions: Sequence[str] = ("fp32",), micro_batches: Sequence[int] = (1,),
                   memory_formats: Sequence[str] = ("auto",), steps: int = 3,
                   warmup: int = 2) -> FittedCostModel:
    """Profile ``hfkern.fuse(factory, B)`` at each B of ``B_values`` in every setting and fit the lines.

    ``example_batch``: ``(inputs [N, ...], targets [N])``, one batch as one model
    sees it. ``optimizer``: ``params -> optimizer`` (default ``hfkern.optim.Adam``);
    ``loss_fn(output, target) -> [B]`` (default per-model cross entropy).
    """
    from .. import optim
    from ..nn.functional import cross_entropy

    if len(set(B_values)) < 2:
        raise ValueError(f"fit_cost_model: B_values needs at least two distinct sizes to fit lines, got "
                         f"{list(B_values)}")
    device = torch.device(device if device is not None else ("cuda" if torch.cuda.is_available() else "cpu"))
    optimizer = optimizer or (lambda params: optim.Adam(params, lr=1e-3))
    loss_fn = loss_fn or cross_entropy
    profiles = []
    for precision in precisions:
        for m in micro_batches:
            for fmt in memory_formats:
                for B in sorted(set(B_values)):
                    strategy = Strategy(B=B, precision=precision, micro_batches=m, memory_format=fmt)
                    profiles.append(profile_step(factory, example_batch, strategy, optimizer=optimizer,
                                                 loss_fn=loss_fn, device=device, steps=steps, warmup=warmup))
    return fit_profiles(profiles)


def fit_profiles(profiles: Sequence[Profile]) -> FittedCostModel:
    """The cost model of measured profiles: per setting, least-squares lines in B (at least two B each)."""
    by_setting: dict[tuple[str, int, str], dict[int, Profile]] = {}
    for p in profiles:
        s = p.strategy
        if s.recompute:
            raise ValueError(f"fit_profiles: profiles are of steps without recomputation, got {s.label}")
        by_setting.setdefault((s.precision, s.micro_batches, s.memory_format), {})[s.B] = p
    names: list[str] | None = None
    fits = {}
    for setting, by_B in by_setting.items():
        if len(by_B) < 2:
            raise ValueError(f"fit_profiles: setting {setting} has a profile at B = {list(by_B)} only; a line "
                             f"needs two array sizes")
        these = list(next(iter(by_B.values())).forward_time)
        if names is None:
            names = these
        elif these != names:
            raise ValueError(f"fit_profiles: profiles of different models (blocks {names} and {these})")
        series: dict[str, dict[int, float]] = {"compute": {}, "optimizer": {}, "static": {}}
        for B, p in by_B.items():
            series["compute"][B] = p.step_time - p.optimizer_time
            series["optimizer"][B] = p.optimizer_time
            for n in names:
                series.setdefault(f"fwd:{n}", {})[B] = p.forward_time[n]
                series.setdefault(f"saved:{n}", {})[B] = p.saved[n]
                series.setdefault(f"inputs:{n}", {})[B] = p.inputs[n]
            # What the saved activations do not explain (persistent bytes, gradients, workspaces,
            # gradients of activations in backward) is fitted as the static term.
            series["static"][B] = p.peak - sum(p.saved.values())
        fits[setting] = {k: _line(v) for k, v in series.items()}
    return FittedCostModel(names or [], fits, list(profiles))
