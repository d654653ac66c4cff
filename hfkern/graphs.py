"""A whole training step as one CUDA graph replay: :func:`capture_step`.

A fused step of B models launches thousands of small kernels, and on a fast GPU
the host issuing them, not the GPU, sets the pace. A CUDA graph records the
launches of one step once and replays them with a single call. What a step
changes between calls has to live in device memory the graph reads, which is
how hfkern's pieces already keep it: the optimizers' per-model
hyper-parameters (``[H, B]`` device tensors, written in place by
``set_hyperparameters`` and by the schedulers), their state, the GradScaler's
scales, the skip masks, the parameters written in place by per-slot surgery
(``load_model``, ``reset_model``, ``reset_state``).

Usage::

    def step(x, y):
        losses = hfkern.nn.functional.cross_entropy(fused(x), y)   # [B]
        opt.zero_grad()
        scaler.scale(losses).sum().backward()
        scaler.step(opt)
        scaler.update()
        sched.step()
        return losses.detach()

    step = hfkern.capture_step(step, x0, y0)   # x0, y0: example batches (shapes, dtypes)
    for x, y in loader:
        losses = step(x, y)                      # the same results as step(x, y) eagerly

How a call runs:

* Its first ``warmup`` calls (and the first ``warmup`` calls after anything that
  forces a new capture) run ``step_fn`` eagerly, on a side stream as CUDA
  graph capture requires: they are real training steps, so optimizer state is
  allocated and Triton kernels are compiled before capture. Nothing is run on
  the example arguments: they only give the static input buffers their shapes.
* The next call copies its arguments into the static buffers, captures
  ``step_fn`` on them into a graph and replays it once; every later call copies
  and replays. The outputs are returned as copies (a replay overwrites the
  static ones).
* **Host steps.** An hfkern LR scheduler's ``step()`` reached during capture
  does not run then: it computes the next learning rates on the host and
  copies them to the device, which a replay would not redo. It is recorded and
  runs after every replay instead, in call order, so schedulers inside
  ``step_fn`` must be stepped after the optimizer (as torch asks anyway). Any
  other host work inside ``step_fn`` (``print``, ``.item()``, Python counters)
  runs at capture only: keep it out of ``step_fn``.
* **What forces a new capture.** Arguments whose tensors differ in shape,
  dtype, device or layout from the captured ones, or non-tensor arguments
  that differ (each signature gets its own graph, after its own warm-up calls;
  graphs share one memory pool), and a change in the parameter groups of an
  hfkern optimizer that ``step_fn`` steps (a new group, parameters added or
  removed, a hyperparameter assigned anew instead of written in place, a value
  that switches optional work such as weight decay or momentum on for a group
  that had none: the graph would run stale work), and a new growth factor,
  backoff factor or growth interval of an hfkern GradScaler it updates
  (``set_growth_factor``, ``load_state_dict``). Non-tensor arguments must be
  hashable or numpy arrays (floats match by their bits: a NaN matches itself);
  another raises a TypeError, on the CPU too. Everything else, written in
  place into the tensors the graph reads, takes effect without one:
  ``set_hyperparameters``, the schedulers' learning rates and momenta,
  ``reset_state``, ``load_model``/``reset_model``, the GradScaler's resets, skip
  masks passed as arguments.

Without CUDA (CPU tensors, or no CUDA device), or for arguments on a device
other than CUDA, the callable runs ``step_fn`` eagerly, with identical
results, so code does not branch. ``torch.cuda.graphs`` constraints apply to
``step_fn``: no host synchronization (``.item()``, ``.tolist()``, printing a
tensor), no CPU tensors created per call that a kernel reads.
"""

from __future__ import annotations

import contextlib
import functools
import threading
from typing import Any, Callable, Iterator

import numpy as np
import torch
from torch.utils._pytree import tree_flatten, tree_map, tree_unflatten

__all__ = ["capture_step", "CapturedStep", "host_step"]


class _Recording(threading.local):
    """What a step under :func:`capture_step` reports while it runs (per thread)."""

    def __init__(self) -> None:
        self.active: CapturedStep | None = None  # the step running now (eagerly or being captured)
        self.capturing = False  # inside a graph capture: host steps are recorded, not run
        self.host_steps: list[tuple[Callable, tuple, dict]] = []
        self.optimizers: dict[int, Any] = {}


_recording = _Recording()


def host_step(method: Callable) -> Callable:
    """Decorator for a method whose work is on the host (a scheduler's ``step``): reached while
    :func:`capture_step` captures a graph, it is recorded to run after every replay instead."""

    @functools.wraps(method)
    def wrapper(self, *args: Any, **kwargs: Any) -> Any:
        if _recording.capturing:
            _recording.host_steps.append((method, (self, *args), kwargs))
            return None
        return method(self, *args, **kwargs)

    return wrapper


def note_optimizer(optimizer: Any) -> None:
    """Called by an hfkern optimizer's ``step``: a captured step watches its parameter groups."""
    if _recording.capturing:
        _recording.optimizers[id(optimizer)] = optimizer


def _structure(optimizers: dict[int, Any]) -> tuple:
    return tuple((key, opt._graph_structure()) for key, opt in sorted(optimizers.items()))


def _value_key(v: Any, where: int) -> tuple:
    """A non-tensor argument as a graph's key: the graph holds what the step computed from its
    value. Floats by their bits (a NaN matches itself; 0.0 and -0.0 differ), numpy arrays by
    their dtype, shape and bytes; anything else must be hashable."""
    if isinstance(v, float):
        return ("float", type(v), v.hex())
    if isinstance(v, np.ndarray):
        return ("ndarray", v.dtype.str, v.shape, v.tobytes())
    try:
        hash(v)
    except TypeError:
        raise TypeError(f"capture_step: a graph is specific to the values of the non-tensor arguments, so they "
                        f"must be hashable (or numpy arrays, or lists, tuples and dicts of such); argument leaf "
                        f"{where} is an unhashable {type(v).__name__}") from None
    return ("value", type(v), v)


def _signature(args: tuple, kwargs: dict) -> tuple:
    """What a graph is specific to: tensors' metadata, other values as they are."""
    leaves, spec = tree_flatten((args, kwargs))
    sig = []
    for i, v in enumerate(leaves):
        if isinstance(v, torch.Tensor):
            sig.append(("tensor", v.shape, v.dtype, v.device, v.stride(), v.requires_grad))
        else:
            sig.append(_value_key(v, i))
    return spec, tuple(sig)


def _on_cuda(args: tuple, kwargs: dict) -> bool:
    tensors = [v for v in tree_flatten((args, kwargs))[0] if isinstance(v, torch.Tensor)]
    return bool(tensors) and all(t.device.type == "cuda" for t in tensors) and torch.cuda.is_available()


class _Graph:
    """One captured signature: static inputs, the graph, its outputs, its host steps, and the
    optimizers it steps with the parameter groups they had at capture."""

    def __init__(self, static: tuple[tuple, dict], graph: Any, outputs: Any, host_steps: list,
                 optimizers: dict[int, Any]):
        self.static = static
        self.graph = graph
        self.outputs = outputs
        self.host_steps = host_steps
        self.optimizers = optimizers
        self.structure = _structure(optimizers)

    def stale(self) -> bool:
        return self.structure != _structure(self.optimizers)


class _CudaGraph:
    """A ``torch.cuda.CUDAGraph`` in the pool of one :class:`CapturedStep`."""

    runs_at_capture = False  # a capture records the kernels without running them

    def __init__(self, pool: Any):
        self.graph = torch.cuda.CUDAGraph()
        self.pool = pool

    def capture(self, fn: Callable[[], Any]) -> Any:
        torch.cuda.synchronize()
        with torch.cuda.graph(self.graph, pool=self.pool):
            return fn()

    def replay(self) -> None:
        self.graph.replay()


class CapturedStep:
    """What :func:`capture_step` returns: call it as ``step_fn`` (see :mod:`hfkern.graphs`).

    ``graphs`` counts the captures made so far (a test, or a log, can see a re-capture);
    ``eager_calls`` the calls run eagerly (those that raised included).
    """

    def __init__(self, step_fn: Callable, example_args: tuple, warmup: int):
        self.step_fn = step_fn
        self.warmup = warmup
        self.example = _signature(example_args, {})  # the signature the caller announced
        self._graphs: dict[tuple, _Graph] = {}
        self._warm: dict[tuple, int] = {}  # signature -> eager calls since it last needed a capture
        self._pool = None
        self.graphs = 0
        self.eager_calls = 0
        # name and docstring only: step_fn's __dict__ (a callable object's attributes, or
        # another CapturedStep's) would overwrite this object's own
        functools.update_wrapper(self, step_fn, updated=())

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        key = _signature(args, kwargs)  # (on the CPU too: an argument no graph can key fails alike)
        if not _on_cuda(args, kwargs):
            return self._eager(args, kwargs)
        graph = self._graphs.get(key)
        if graph is not None and graph.stale():
            del self._graphs[key]  # an optimizer's parameter groups changed: the graph is stale
            self._warm[key] = 0
            graph = None
        if graph is None:
            if self._warm.get(key, 0) < self.warmup:
                out = self._eager(args, kwargs, side_stream=True)
                self._warm[key] = self._warm.get(key, 0) + 1  # a warm-up call that raised does not count
                return out
            graph = self._graphs[key] = self._capture(args, kwargs)
            if graph.graph.runs_at_capture:
                return self._after_replay(graph)
        return self._replay(graph, args, kwargs)

    # ---- eager ----------------------------------------------------------------------------
    def _eager(self, args: tuple, kwargs: dict, side_stream: bool = False) -> Any:
        self.eager_calls += 1
        previous, _recording.active = _recording.active, self
        try:
            if not side_stream:
                return self.step_fn(*args, **kwargs)
            with self._warmup_stream():
                return self.step_fn(*args, **kwargs)
        finally:
            _recording.active = previous

    @staticmethod
    @contextlib.contextmanager
    def _warmup_stream() -> Iterator[None]:
        # Warm-up runs on a side stream, as torch.cuda.graphs asks: autograd's streams then
        # match the capture's.
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            yield
        torch.cuda.current_stream().wait_stream(stream)

    def _new_graph(self) -> _CudaGraph:
        if self._pool is None:
            self._pool = torch.cuda.graph_pool_handle()
        return _CudaGraph(self._pool)

    # ---- capture and replay -----------------------------------------------------------------
    def _capture(self, args: tuple, kwargs: dict) -> _Graph:
        static = tree_map(lambda v: v.clone() if isinstance(v, torch.Tensor) else v, (args, kwargs))
        graph = self._new_graph()
        previous = (_recording.active, _recording.capturing, _recording.host_steps, _recording.optimizers)
        _recording.active, _recording.capturing, _recording.host_steps, _recording.optimizers = self, True, [], {}
        try:
            outputs = graph.capture(lambda: self.step_fn(*static[0], **static[1]))
            host_steps, optimizers = _recording.host_steps, _recording.optimizers
        finally:
            (_recording.active, _recording.capturing, _recording.host_steps,
             _recording.optimizers) = previous
        self.graphs += 1
        return _Graph(static, graph, outputs, host_steps, optimizers)

    def _replay(self, graph: _Graph, args: tuple, kwargs: dict) -> Any:
        leaves = tree_flatten((args, kwargs))[0]
        static = tree_flatten(graph.static)[0]
        with torch.no_grad():
            for dst, src in zip(static, leaves):
                if isinstance(dst, torch.Tensor):
                    dst.copy_(src, non_blocking=True)
        graph.graph.replay()
        return self._after_replay(graph)

    @staticmethod
    def _after_replay(graph: _Graph) -> Any:
        for method, a, k in graph.host_steps:
            method(*a, **k)
        out, spec = tree_flatten(graph.outputs)
        return tree_unflatten([o.clone() if isinstance(o, torch.Tensor) else o for o in out], spec)


def capture_step(step_fn: Callable, *example_args: Any, warmup: int = 3) -> CapturedStep:
    """``step_fn`` (a whole training step) as a callable that replays one CUDA graph per call.

    Args:
        step_fn: the step: forward, per-model losses, backward, optimizer step,
            gradient scaler, scheduler steps; returns what the caller needs
            (the ``[B]`` losses, detached). Called with the arguments the
            returned callable gets.
        example_args: arguments of the shapes and dtypes of the batches to come
            (their values are not used; nothing is trained on them).
        warmup: eager calls before the capture (>= 1: state is allocated and
            kernels are compiled at the first one).

    Returns a :class:`CapturedStep`; on CPU tensors (or without CUDA) it runs
    ``step_fn`` eagerly. See :mod:`hfkern.graphs` for what a replay reads and
    what forces a new capture.
    """
    if not callable(step_fn):
        raise TypeError(f"capture_step: expected step_fn to be callable, got {type(step_fn).__name__}")
    if isinstance(warmup, bool) or not isinstance(warmup, int):
        raise TypeError(f"capture_step: expected warmup to be an int, got {type(warmup).__name__} {warmup!r}")
    if not any(isinstance(v, torch.Tensor) for v in tree_flatten(example_args)[0]):
        raise ValueError("capture_step: expected example arguments holding the batch tensors (their shapes "
                         f"and dtypes), got {[type(a).__name__ for a in example_args]}")
    if warmup < 1:
        raise ValueError(f"capture_step: expected warmup >= 1 (state is allocated at the first eager step), "
                         f"got {warmup}")
    return CapturedStep(step_fn, example_args, warmup)
