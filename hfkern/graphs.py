"""A whole training step as one CUDA graph replay: :func:`capture_step`.

A fused step of B models launches thousands of small kernels, and on a fast GPU
the host issuing them, not the GPU, sets the pace. A CUDA graph records the
launches of one step once and replays them with a single call. What a step
changes between calls has to live in device memory the graph reads, which is
how hfkern's pieces already keep it: the optimizers' per-model
hyper-parameters (``[H, B]`` device tensors, written in place by
``set_hyperparameters`` and by the schedulers), their state, the GradScaler's
scales, the skip masks, the parameters written in place by per-slot surgery
(``load_model``, ``reset_model``, ``reset_state``), the per-model dropout
probabilities of hfkern's dropout layers.

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
  the example arguments: they are checked as every call's arguments are (the
  static input buffers are copies of the capturing call's own arguments).
* The next call copies its arguments into the static buffers, captures
  ``step_fn`` on them into a graph and replays it once; every later call copies
  and replays. The outputs are returned as copies (a replay overwrites the
  static ones); an output that is an argument itself (or its ``.grad``) is
  returned as the caller's tensor, as an eager call returns it. If what the
  graph depends on (below) changed since the last eager call, the capture
  waits for one more eager call, which validates it (a new hyperparameter is
  checked and copied to the device, which a capture cannot do).
* **Arguments.** Tensor arguments are copied into static tensors, which
  ``step_fn`` gets in the graph. An argument that ``step_fn`` writes in place
  (``acc.add_(x)``, seen by its version counter at capture) is copied back
  into the caller's tensor after every replay. An argument that requires grad
  is given to ``step_fn`` as a leaf that requires grad, with the caller's
  ``.grad``: after a replay the caller's tensor has the ``.grad`` an eager call
  would have left (set, accumulated in place, or cleared). Whether it had a
  ``.grad`` is part of the graph's key. An argument that requires grad and is
  not a leaf (it has a ``grad_fn``: a backward through it would reach the
  caller's graph, which a replay cannot) raises a ValueError, on the CPU too.
  Arguments that share memory are copied in as separate tensors. An argument
  with dims of stride 0 (``hfkern.broadcast(x, B)``: one input shared by the B
  models) keeps its form: its static tensor is one copy of the memory it views,
  expanded as the argument is (same strides), so the graph computes once for
  the B models as an eager call does, and a call copies in only that memory.
  (One that requires grad is copied densely.) Tensor arguments must be strided
  (dense) tensors: a sparse, nested or MKLDNN one raises a TypeError, on the
  CPU too.
* **The parameters' gradients.** After a replay every parameter's ``.grad`` is
  the gradient the step computed, as after an eager call, also where the
  caller cleared the gradients before the call (``opt.zero_grad()`` outside
  ``step_fn``, then ``opt.step()`` outside it). A graph computes from the
  gradients as its capture found them: where the step adds to a ``.grad``
  that existed then, another ``.grad`` before a call (cleared to None, or a
  tensor assigned) forces a new capture, as does a ``.grad`` set before a
  call where the capture found None and the step does not clear it itself.
* **Host steps.** An hfkern LR scheduler's ``step()`` reached during capture
  does not run then: it computes the next learning rates on the host and
  copies them to the device, which a replay would not redo. It is recorded and
  runs after every replay instead, in call order, so schedulers inside
  ``step_fn`` must be stepped after the optimizer (as torch asks anyway).
  What ``step_fn`` reads after ``sched.step()`` (the group's ``lr``) is
  therefore the learning rate before that step in a replay, one step behind
  an eager call: read it after the call instead. Any other host work inside
  ``step_fn`` (``print``, ``.item()``, Python counters, a module's
  ``train()``) runs at capture only: keep it out of ``step_fn``.
* **GradScaler.** An hfkern GradScaler's ``unscale_``/``step`` inside
  ``step_fn`` keep host records (each optimizer's stage, its inf checks) that
  its ``update()`` and ``step()`` read: after every replay they are as the
  captured call left them (the inf checks are tensors every replay writes), so
  ``update()`` may run inside ``step_fn`` or after the call, and ``step()``
  after a ``step_fn`` that calls ``unscale_``. A replay with ``step()`` already
  called since the last ``update()`` raises a RuntimeError before it runs, as
  an eager step raises; ``step()`` in ``step_fn`` after an ``unscale_()``
  outside it raises at the capture (every replay would read that call's
  checks). An hfkern optimizer's ``last_skipped`` is one tensor that every
  step writes in place: it is right after a replay of any of the graphs.
* **What gets its own graph** (after its own warm-up calls; graphs share one
  memory pool): arguments whose tensors differ in shape, dtype, device,
  strides or ``requires_grad`` (or in having a ``.grad``) from the captured
  ones; non-tensor arguments that differ; a call under another grad mode
  (``torch.no_grad()``, inference mode) or autocast state. Non-tensor
  arguments must be hashable or numpy arrays (floats, complex numbers and
  numpy scalars match by their bits: a NaN matches itself, 0.0 and -0.0
  differ); another raises a TypeError, on the CPU too. Keyword arguments
  match in any order.
* **What forces a new capture** (a stale graph is never replayed), checked at
  every call:

  - a change in the parameter groups of an hfkern optimizer that ``step_fn``
    steps (a new group, parameters added or removed, a hyperparameter assigned
    anew instead of written in place, a value that switches optional work such
    as weight decay or momentum on for a group that had none), a parameter
    given new memory (``module.half()``, ``module.double()``, ``.data = ...``)
    or a changed ``requires_grad`` of one, and optimizer state replaced
    (``opt.state.clear()``, ``load_state_dict``);
  - a parameter or buffer of a module whose ``forward`` ran in the step (or
    of one of its submodules), stepped by an optimizer or not (a frozen
    layer), replaced (``module.buf = tensor``), given new memory (``.data =
    ...``, ``module.half()``, ``model.to(memory_format=torch.channels_last)``,
    which relays conv weights), another dtype, shape or strides, or a changed
    ``requires_grad``;
  - a new growth factor, backoff factor or growth interval of an hfkern
    GradScaler it updates (``set_growth_factor``, ``load_state_dict``);
  - the train/eval mode of a module whose ``forward`` ran in the step, or of
    any of its submodules (``model.train()``, ``model.eval()``), and a host
    hyper-parameter of an hfkern array module the step ran: a dropout
    probability that switches between one value for all models and one per
    model, a new common value (``F.dropout`` takes it from the host), a
    per-model attention dropout, ``inplace``. (The modules are the ones whose
    ``forward`` ran, found while the step runs eagerly or is captured; under
    another Python profiler, ``sys.setprofile``, they are not found and their
    modes, values and tensors are not watched: a UserWarning says so.)
  - a parameter's ``.grad`` that no longer fits the graph (see the
    parameters' gradients above). Which parameters have a ``.grad`` at all
    before a call is part of the graph's key instead: a caller that clears
    the gradients every few calls (gradient accumulation) gets one graph for
    the calls after a clear and one for the others.

  Everything else, written in place into the tensors the graph reads, takes
  effect without one: ``set_hyperparameters``, the schedulers' learning rates
  and momenta, ``reset_state``, ``load_model``/``reset_model`` (with
  per-model dropout probabilities: hfkern's dropout layers keep them in device
  tensors), the GradScaler's resets, skip masks passed as arguments. Host state
  that ``capture_step`` does not see (a Python attribute ``step_fn`` reads, a
  tensor given new memory that is no parameter or buffer of a module the step
  ran, ``torch.backends`` flags): call :meth:`CapturedStep.reset` after
  changing it.

Calls that keep coming with new signatures (a Python number that changes at
every call, such as a step counter) each warm up and capture anew, so a
signature that never recurs runs eagerly every time: a UserWarning names a
non-tensor argument once it has taken more than 8 values; pass such values as
tensors. Only the warm-up records of the 1024 most recent signatures without a
graph are kept (a warning says so when older ones are dropped). Batches of a
few shapes are what graphs per signature are for: each shape gets its graph.

A call whose capture raises has run the step's Python up to the error, but
none of its device work (a capture records kernels, it does not run them: the
optimizer has not stepped, arguments written in place are as they were) and
none of the host steps recorded so far (a scheduler's ``step()``); the next
call captures again. An eager call that raises has done everything before the
error.

Without CUDA (CPU tensors, or no CUDA device), or for arguments on a device
other than CUDA, the callable runs ``step_fn`` eagerly, with identical
results, so code does not branch. ``torch.cuda.graphs`` constraints apply to
``step_fn``: no host synchronization (``.item()``, ``.tolist()``, printing a
tensor), no CPU tensors created per call that a kernel reads.
"""

from __future__ import annotations

import contextlib
import functools
import operator
import sys
import threading
import warnings
from itertools import chain, repeat
from typing import Any, Callable, Iterator

import numpy as np
import torch
from torch.utils._pytree import tree_flatten, tree_unflatten

__all__ = ["capture_step", "CapturedStep", "host_step"]


class _Recording(threading.local):
    """What a step under :func:`capture_step` reports while it runs (per thread)."""

    def __init__(self) -> None:
        self.active: CapturedStep | None = None  # the step running now (eagerly or being captured)
        self.capturing = False  # inside a graph capture: host steps are recorded, not run
        self.host_steps: list[tuple[Callable, tuple, dict]] = []
        self.checks: list[tuple[Callable, tuple, dict]] = []  # run before every replay (before_replay)
        self.restores: list[tuple[Callable, tuple, dict]] = []  # run after every replay (after_replay)
        self.capture: object | None = None  # identifies the capture running now (capturing())
        # the optimizers (and GradScalers) stepped, while a warm-up call runs or a graph is captured
        self.optimizers: dict[int, Any] | None = None


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


def capturing() -> object | None:
    """An object that identifies the graph being captured now (the same for the whole capture, a
    new one for the next), or None outside a capture."""
    return _recording.capture if _recording.capturing else None


def after_replay(fn: Callable, *args: Any) -> None:
    """While a graph is captured, have ``fn(*args)`` run after every replay of it (in call order,
    before the recorded host steps: it restores host records, which they do not read); outside a
    capture, nothing. For host records that the step's Python keeps beside its device work, which
    a replay (running no Python) would otherwise leave as they were: a GradScaler's per-optimizer
    stages and found-inf tensors (tensors made in the capture, which every replay writes)."""
    if _recording.capturing:
        _recording.restores.append((fn, args, {}))


def before_replay(fn: Callable, *args: Any) -> None:
    """While a graph is captured, have ``fn(*args)`` run before every later replay of it (not the
    one that completes the capture); outside a capture, nothing. For a check of host state the
    step's Python checked at capture, which a replay does not check: ``fn`` raises (and the
    replay does not run) where an eager call would have raised."""
    if _recording.capturing:
        _recording.checks.append((fn, args, {}))


def note_optimizer(optimizer: Any) -> None:
    """Called by an hfkern optimizer's ``step`` (and a GradScaler's ``update``): a captured step
    watches its parameter groups (``_graph_structure``)."""
    found = _recording.optimizers
    if found is not None:
        found[id(optimizer)] = optimizer


def _structure(optimizers: dict[int, Any]) -> tuple:
    return tuple((key, opt._graph_structure()) for key, opt in sorted(optimizers.items()))


# ---- the modules a step runs ----------------------------------------------------------------

_training = operator.attrgetter("training")


def _host_state_getter(module: torch.nn.Module) -> Callable[[torch.nn.Module], Any] | None:
    """How to read the host values ``module``'s forward computes with, beyond its mode: its
    ``_graph_state()`` where it has one (hfkern's dropout layers), else an hfkern array module's
    per-model fields it stores (``MultiheadAttention.dropout``); None for any other module."""
    method = getattr(type(module), "_graph_state", None)
    if method is not None:
        return method
    fields = tuple(f for f in getattr(type(module), "_per_model_fields", ()) if f not in module._modules)
    return operator.attrgetter(*fields) if fields else None


_data_ptr = torch.Tensor.data_ptr
_stride = torch.Tensor.stride
_geometry = operator.attrgetter("dtype", "shape", "requires_grad")
_dict_values = dict.values


def _watchable(v: Any) -> bool:
    """Whether a parameter or buffer has memory to watch: a strided tensor, not a lazy one, with a
    data pointer (a tensor subclass without storage has none)."""
    if not isinstance(v, torch.Tensor) or v.layout != torch.strided or torch.nn.parameter.is_lazy(v):
        return False
    try:
        v.data_ptr()
    except RuntimeError:
        return False
    return True


def _entries(views: tuple) -> tuple[int, ...]:
    """What the parameter and buffer tables of modules hold (``views``: their ``values()``), as
    object identities (None included: an entry set to None, or from None to a tensor, is a change)."""
    return tuple(map(id, chain.from_iterable(views)))


def _memory(tensors: tuple[torch.Tensor, ...]) -> tuple[tuple, ...]:
    """Where and how ``tensors`` lie: their addresses, dtypes, shapes and ``requires_grad``,
    strides. (Loops in C: it runs before every replay; a tensor's ``__hash__`` or ``__eq__`` is
    never called.)"""
    return (tuple(map(_data_ptr, tensors)), tuple(map(_geometry, tensors)), tuple(map(_stride, tensors)))


class _Modules:
    """What a graph depends on in the modules the step ran: their (and their submodules')
    train/eval modes, the host values of those that have some (:func:`_host_state_getter`),
    with the values they had, and their own parameters and buffers: which tensors they are and
    the memory they had, with ``requires_grad`` (a graph holds addresses, dtypes, shapes and
    strides: a frozen parameter, which no optimizer watches, given new memory by ``.data = ...``,
    ``module.half()`` or ``model.to(memory_format=...)``, or unfrozen, or a buffer replaced, is
    a change)."""

    __slots__ = ("modules", "modes", "getters", "values", "views", "entries", "tensors", "memory")

    def __init__(self, modules: tuple, modes: tuple, getters: tuple, values: tuple, tables: tuple = ()):
        self.modules, self.modes, self.getters, self.values = modules, modes, getters, values
        # The parameter and buffer tables that held something (live views of their values), with
        # what they held then (the tensors are held: an identity is not reused while it is compared).
        self.views = tuple(map(_dict_values, tables))
        self.entries = _entries(self.views)
        tensors = {id(v): v for v in chain.from_iterable(self.views) if _watchable(v)}
        self.tensors = tuple(tensors.values())
        self.memory = _memory(self.tensors)

    def changed(self) -> bool:
        if tuple(map(_training, self.modules)) != self.modes:
            return True
        if _entries(self.views) != self.entries or _memory(self.tensors) != self.memory:
            return True
        for (module, get), value in zip(self.getters, self.values):
            if get(module) != value:
                return True
        return False


class _ModuleWatch:
    """The modules the calls of one signature ran, found while a call runs eagerly or is captured
    (a profile function sees every ``forward`` return; it changes nothing torch or hfkern do, where
    a global module hook would make them take their hooked paths). Holds the modules (a module
    made in the step lives as long as the graph anyway)."""

    def __init__(self) -> None:
        self.modules: list[torch.nn.Module] = []
        self.getters: list[tuple[torch.nn.Module, Callable]] = []
        self._ids: set[int] = set()
        self.optimizers: dict[int, Any] = {}  # the optimizers the calls stepped
        self._leaves: tuple[tuple, list[torch.Tensor]] = ((), [])

    def grad_pattern(self) -> tuple[bool, ...]:
        """Which of the parameters the calls reach have no ``.grad`` now: part of a graph's key (a
        backward into a gradient that exists computes another thing than into none, so a caller
        that clears the gradients every few calls gets a graph for each case, not a new capture
        at every change)."""
        known = (len(self.modules), tuple(self.optimizers))
        if self._leaves[0] != known:
            self._leaves = (known, _grad_leaves(self.modules, self.optimizers))
        return tuple(map(operator.is_, map(_grad, self._leaves[1]), repeat(None)))

    @contextlib.contextmanager
    def running(self) -> Iterator[Callable[[], _Modules]]:
        """Watch one call: yields the function that gives, after it, the modules known then with
        the modes and values they had when the call began (first seen in it: when they were)."""
        modes = list(map(_training, self.modules))
        values = [get(m) for m, get in self.getters]

        def found(module: torch.nn.Module) -> None:
            for m in module.modules():
                if id(m) not in self._ids:
                    self._ids.add(id(m))
                    self.modules.append(m)
                    modes.append(m.training)
                    get = _host_state_getter(m)
                    if get is not None:
                        self.getters.append((m, get))
                        values.append(get(m))

        def profile(frame: Any, event: str, arg: Any) -> None:
            # After the forward ran (its locals are complete), once per module.
            if event == "return" and frame.f_code.co_name == "forward" and frame.f_code.co_argcount:
                module = frame.f_locals.get(frame.f_code.co_varnames[0])
                if isinstance(module, torch.nn.Module) and id(module) not in self._ids:
                    found(module)

        def snapshot() -> _Modules:
            # The tensors as the call left them (a graph holds the memory its capture used).
            tables = tuple(t for m in self.modules for t in (m._parameters, m._buffers) if t)
            return _Modules(tuple(self.modules), tuple(modes), tuple(self.getters), tuple(values), tables)

        running = sys.getprofile()
        if running is not None:  # another profiler (or an outer watch, which finds them) runs
            if not getattr(running, "_hfkern_module_watch", False):
                warnings.warn(
                    "capture_step: another Python profiler (sys.setprofile) runs while the step runs eagerly or "
                    "is captured, so the modules it runs are not found: a later train()/eval() of them, a "
                    "change of their host hyper-parameters, or new memory of their parameters or buffers, "
                    "will not make a new capture, and only the parameters of optimizers stepped in the step "
                    "get their .grad back after a replay (call "
                    "CapturedStep.reset() after such a change, or capture without the profiler)",
                    UserWarning, stacklevel=4)
            yield snapshot
            return
        profile._hfkern_module_watch = True  # type: ignore[attr-defined]
        sys.setprofile(profile)
        try:
            yield snapshot
        finally:
            sys.setprofile(None)


# ---- keys -------------------------------------------------------------------------------------

def _value_key(v: Any, where: int) -> tuple:
    """A non-tensor argument as a graph's key: the graph holds what the step computed from its
    value. Floats, complex numbers and numpy scalars by their bits (a NaN matches itself; 0.0 and
    -0.0 differ), numpy arrays by their dtype, shape and bytes; anything else must be hashable."""
    if isinstance(v, np.generic) and v.dtype.kind in "fc":  # np.float32, np.float64, np.complex64...
        return ("numpy", v.dtype.str, v.tobytes())
    if isinstance(v, float):
        return ("float", type(v), v.hex())
    if isinstance(v, complex):
        return ("complex", type(v), v.real.hex(), v.imag.hex())
    if isinstance(v, np.ndarray):
        return ("ndarray", v.dtype.str, v.shape, v.tobytes())
    try:
        hash(v)
    except TypeError:
        raise TypeError(f"capture_step: a graph is specific to the values of the non-tensor arguments, so they "
                        f"must be hashable (or numpy arrays, or lists, tuples and dicts of such); argument leaf "
                        f"{where} is an unhashable {type(v).__name__}") from None
    return ("value", type(v), v)


def _ordered(kwargs: dict) -> dict:
    """Keyword arguments in one order (by name): the same call in another order is the same graph."""
    return dict(sorted(kwargs.items())) if len(kwargs) > 1 else kwargs


def _signature(args: tuple, kwargs: dict) -> tuple:
    """What a graph is specific to: tensors' metadata, other values as they are."""
    leaves, spec = tree_flatten((args, kwargs))
    sig = []
    for i, v in enumerate(leaves):
        if isinstance(v, torch.Tensor):
            if v.layout != torch.strided or v.is_nested:
                raise TypeError(
                    f"capture_step: argument leaf {i} is a "
                    f"{'nested' if v.is_nested else str(v.layout).replace('torch.', '')} tensor; a captured "
                    f"step copies each call's tensor arguments into static strided tensors that its graph "
                    f"reads, so they must be strided (dense) tensors: pass a dense one (x.to_dense(), a nested "
                    f"tensor's to_padded_tensor), or make it in step_fn")
            grad = False
            if v.requires_grad:
                if v.grad_fn is not None:
                    raise ValueError(
                        f"capture_step: argument leaf {i} requires grad and is not a leaf tensor (it has a "
                        f"grad_fn, {type(v.grad_fn).__name__}): a graph's backward cannot reach the "
                        f"caller's autograd graph; pass a leaf (x.detach().requires_grad_()) or compute it "
                        f"in step_fn")
                grad = v.grad is not None
            sig.append(("tensor", v.shape, v.dtype, v.device, v.stride(), v.requires_grad, grad))
        else:
            sig.append(_value_key(v, i))
    return spec, tuple(sig)


def _ambient() -> tuple:
    """The modes a call runs under that change what a step records: grad mode, inference mode,
    autocast (CUDA and CPU)."""
    return (torch.is_grad_enabled(), torch.is_inference_mode_enabled(), torch.is_autocast_enabled("cuda"),
            torch.get_autocast_dtype("cuda"), torch.is_autocast_enabled("cpu"), torch.get_autocast_dtype("cpu"),
            torch.is_autocast_cache_enabled())


def _on_cuda(args: tuple, kwargs: dict) -> bool:
    tensors = [v for v in tree_flatten((args, kwargs))[0] if isinstance(v, torch.Tensor)]
    return bool(tensors) and all(t.device.type == "cuda" for t in tensors) and torch.cuda.is_available()


def _expanded(v: torch.Tensor) -> tuple[int, ...] | None:
    """For a tensor with dims of stride 0 (an expanded view, such as :func:`hfkern.broadcast`'s
    input shared by the B models), the shape of the memory it views (1 in those dims); else None.
    (A tensor that requires grad is copied densely, as before: its ``.grad`` is per element.)"""
    if v.requires_grad or not any(stride == 0 and size > 1 for size, stride in zip(v.shape, v.stride())):
        return None
    return tuple(1 if stride == 0 else size for size, stride in zip(v.shape, v.stride()))


def _static_copy(v: Any) -> tuple[Any, Any, tuple[int, ...] | None]:
    """A tensor argument's static copy: a new leaf (requiring grad as ``v`` does, with a copy of
    its ``.grad``), not a node of the caller's autograd graph. Returns ``(static, target, base)``:
    what ``step_fn`` gets, the tensor a replay copies a new argument into and, for an expanded
    argument (:func:`_expanded`), the shape of the memory it views, of which the static copy is
    a copy expanded the same way (a shared input stays shared, with its strides); else None.
    Arguments of one graph have one shape and strides (its key), so one form."""
    if not isinstance(v, torch.Tensor):
        return v, None, None
    base = _expanded(v)
    # (outside inference mode: a copy made in it is an inference tensor, which has no version
    # counter, and a write of step_fn to it could not be seen)
    with torch.inference_mode(False), torch.no_grad():
        if base is not None:
            target = v.detach().as_strided(base, v.stride(), v.storage_offset()).clone()
            return target.expand(v.shape), target, base
        s = v.detach().clone()
        if v.requires_grad:
            s.requires_grad_(True)
            if v.grad is not None:
                s.grad = v.grad.detach().clone()
    return s, s, None


def _version(t: torch.Tensor) -> int | None:
    try:
        return t._version
    except RuntimeError:  # an inference tensor has no version counter
        return None


# ---- the parameters' gradients ---------------------------------------------------------------

_grad = operator.attrgetter("grad")
_UNKNOWN = object()  # a parameter's .grad before a capture that did not know the parameter yet


def _grad_leaves(modules: Iterator[torch.nn.Module] | list, optimizers: dict[int, Any]) -> list[torch.Tensor]:
    """The tensors whose ``.grad`` a step's backward may set: the parameters of the optimizers it
    steps and the leaf parameters of the modules it runs that require grad."""
    found: dict[int, torch.Tensor] = {}
    for opt in optimizers.values():
        for group in getattr(opt, "param_groups", ()):
            for p in group["params"]:
                found.setdefault(id(p), p)
    for m in modules:
        for p in m._parameters.values():
            if isinstance(p, torch.Tensor) and p.requires_grad and p.grad_fn is None:
                found.setdefault(id(p), p)
    return list(found.values())


class _Grads:
    """What a graph assumes of the parameters' ``.grad`` and how a replay leaves them.

    A capture records, per parameter whose ``.grad`` the step left set (``g1``), what it had when
    the capture began (``g0``): the graph writes ``g1``'s memory, reading ``g0``'s where it is
    ``g1`` (a backward that accumulates, or a ``zero_grad(set_to_none=False)`` in the step).

    * ``g1 is g0``: a replay is right only while the parameter's ``.grad`` is still ``g1``.
    * ``g0`` None, ``g1`` new (the caller cleared the gradients before the call, the step does not):
      right only while ``.grad`` is None before the call (an eager call would add to another);
      a replay sets it to ``g1``, as the eager call leaves a new gradient.
    * ``g0`` another tensor, ``g1`` new, ``g0`` not written in the capture (the step clears the
      gradients itself, ``zero_grad()``): right whatever ``.grad`` is before the call; a replay
      sets it to ``g1``.
    * ``g0`` another tensor written in the capture, ``g1`` new (the step adds to the gradient, then
      assigns another, ``p.grad = p.grad.clamp(...)``): the graph reads ``g0``'s memory, so a
      replay is right only while the call's ``.grad`` is ``g0``, which the previous call's
      ``g1`` is not: such a step is captured anew at each call, running as an eager one does.

    A ``.grad`` that no longer fits is a change (a new capture, after warm-up calls), as a
    change of the parameters themselves is."""

    __slots__ = ("checked", "expected", "restored")

    def __init__(self, params: list[torch.Tensor], before: dict[int, Any]):
        checked, expected, restored = [], [], []
        for p in params:
            g1 = p.grad
            if g1 is None:
                continue  # the step left no gradient: a replay leaves .grad as it finds it, as eager does
            g0, version = before.get(id(p), (_UNKNOWN, None))
            if g0 is g1 or g0 is _UNKNOWN:
                checked.append(p)
                expected.append(g1)
            else:
                if g0 is None or _version(g0) != version:  # (None: the caller cleared it; else written)
                    checked.append(p)
                    expected.append(g0)
                restored.append((p, g1))
        self.checked = tuple(checked)
        self.expected = tuple(expected)  # (held: an identity is not reused while it is compared)
        self.restored = tuple(restored)

    def changed(self) -> bool:
        return not all(map(operator.is_, map(_grad, self.checked), self.expected))

    def restore(self) -> None:
        for p, g1 in self.restored:
            if p.grad is not g1:
                p.grad = g1


# ---- graphs -----------------------------------------------------------------------------------

class _Graph:
    """One captured signature: static inputs, the graph, its outputs, its host steps, and what it
    depends on: the optimizers it steps with the parameter groups they had at capture, the
    modules it ran with their modes and host values."""

    def __init__(self, static: list, graph: Any, outputs: Any, host_steps: list, optimizers: dict[int, Any],
                 modules: _Modules, mutated: tuple[int, ...], grads: tuple, returned: list,
                 inputs: tuple = (), checks: list | tuple = (), restores: list | tuple = (),
                 param_grads: _Grads | None = None):
        self.static = static  # the flat leaves of (args, kwargs)
        self.tensors = tuple(i for i, s in enumerate(static) if isinstance(s, torch.Tensor))
        # per tensor argument (leaf i, the tensor a new argument is copied into, the shape of the
        # memory an expanded argument views or None); by default the static tensors themselves
        self.inputs = inputs or tuple((i, static[i], None) for i in self.tensors)
        self.graph = graph
        self.outputs = outputs
        self.host_steps = host_steps
        self.checks = tuple(checks)  # host checks before a replay (before_replay)
        self.restores = tuple(restores)  # host records written after a replay (after_replay)
        self.optimizers = optimizers
        self.structure = _structure(optimizers)
        self.modules = modules
        self.mutated = mutated  # arguments the step writes in place: copied back after a replay
        self.grads = grads  # (leaf, .grad when the capture began, .grad after it) for inputs requiring grad
        self.grads_in = tuple((i, g0) for i, g0, _ in grads if g0 is not None)
        self.returned = returned  # per output leaf: None, ("arg", i) or ("grad", i)
        self.param_grads = param_grads if param_grads is not None else _Grads([], {})

    def stale(self) -> bool:
        return (self.structure != _structure(self.optimizers) or self.modules.changed()
                or self.param_grads.changed())


class _EagerCall:
    """What the last eager call of a signature depended on (:class:`_Graph`'s terms), to know
    before a capture whether it changed since."""

    __slots__ = ("optimizers", "structure", "modules")

    def __init__(self, optimizers: dict[int, Any], modules: _Modules):
        self.optimizers = optimizers
        self.structure = _structure(optimizers)
        self.modules = modules

    def changed(self) -> bool:
        return self.structure != _structure(self.optimizers) or self.modules.changed()


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


_MANY_VALUES = 8  # values of a non-tensor argument past which a step warns that they keep needing new graphs
_KEPT_COLD = 1024  # signatures without a graph whose warm-up records are kept (the most recent ones)


def _varying_values(bases: list[tuple]) -> list[tuple[int, str, int]]:
    """The non-tensor argument leaves that take more than :data:`_MANY_VALUES` values among the
    signatures ``bases`` (each ``((spec, leaf keys), ambient)``): ``(leaf, what, how many)``.
    (Tensors of several shapes are what graphs per signature are for: not counted.)"""
    sigs = [b[0][1] for b in bases if len(b[0][1]) == len(bases[0][0][1])]
    out = []
    for i in range(len(sigs[0]) if sigs else 0):
        if sigs[0][i][0] == "tensor":
            continue
        values = {sig[i] for sig in sigs}
        if len(values) > _MANY_VALUES:
            first = sigs[0][i]
            out.append((i, first[1].__name__ if isinstance(first[1], type) else first[0], len(values)))
    return out


class CapturedStep:
    """What :func:`capture_step` returns: call it as ``step_fn`` (see :mod:`hfkern.graphs`).

    ``graphs`` counts the captures made so far (a test, or a log, can see a re-capture);
    ``eager_calls`` the calls run eagerly (those that raised included).
    """

    def __init__(self, step_fn: Callable, example_args: tuple, warmup: int):
        self.step_fn = step_fn
        self.warmup = warmup
        _signature(example_args, {})  # (the examples are checked as the calls' arguments will be)
        self._graphs: dict[tuple, _Graph] = {}
        self._warm: dict[tuple, int] = {}  # key -> eager calls since it last needed a capture
        self._last_eager: dict[tuple, _EagerCall] = {}  # key -> what its last eager call depended on
        self._watches: dict[tuple, _ModuleWatch] = {}  # key -> the modules its calls ran
        self._pool = None
        self._warned_signatures = False
        self.graphs = 0
        self.eager_calls = 0
        # name and docstring only: step_fn's __dict__ (a callable object's attributes, or
        # another CapturedStep's) would overwrite this object's own
        functools.update_wrapper(self, step_fn, updated=())

    def reset(self) -> None:
        """Drop every graph: the next calls warm up and capture anew. For a change to host state
        the graphs depend on that :func:`capture_step` does not watch (see :mod:`hfkern.graphs`)."""
        self._graphs.clear()
        self._warm.clear()
        self._last_eager.clear()

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        ordered = _ordered(kwargs)
        sig = _signature(args, ordered)  # (on the CPU too: an argument no graph can key fails alike)
        if not _on_cuda(args, kwargs):
            return self._eager(args, kwargs)
        base = (sig, _ambient())
        watch = self._watches.get(base)
        if watch is None:
            self._new_signature(base)
        # A graph per signature and pattern of the parameters' .grad (None or not); the warm-up
        # calls, and what they depended on, per signature.
        key = (base, watch.grad_pattern() if watch is not None else None)
        graph = self._graphs.get(key)
        if graph is not None and graph.stale():
            del self._graphs[key]  # what the graph depends on changed: it would run stale work
            self._warm[base] = 0
            graph = None
        if graph is None:
            last = self._last_eager.get(base)
            if self._warm.get(base, 0) < self.warmup or (last is not None and last.changed()) or watch is None:
                # warm-up; or a change since the last eager call, validated eagerly before a capture
                out = self._eager(args, kwargs, base)
                self._warm[base] = self._warm.get(base, 0) + 1  # a warm-up call that raised does not count
                return out
            graph = self._graphs[key] = self._capture(key, args, ordered)
            if graph.graph.runs_at_capture:
                return self._after_replay(graph, tree_flatten((args, ordered))[0])
            # the capture ran the step's Python (its host checks included) for this replay
            return self._replay(graph, args, ordered, checked=True)
        return self._replay(graph, args, ordered)

    def _new_signature(self, base: tuple) -> None:
        """A call of a signature not seen before (or forgotten): warn once when a non-tensor
        argument keeps taking new values (each value warms up and captures anew, so a value that
        never recurs runs eagerly every time), and keep the warm-up records of the most recent
        signatures without a graph only."""
        captured = {key[0] for key in self._graphs}
        cold = [b for b in self._watches if b not in captured]
        dropped = cold[:max(len(cold) + 1 - _KEPT_COLD, 0)]
        for b in dropped:
            for records in (self._warm, self._last_eager, self._watches):
                records.pop(b, None)
        if self._warned_signatures:
            return
        varying = _varying_values(list(self._watches) + [base])
        if varying or dropped:
            self._warned_signatures = True
            what = ", ".join(f"leaf {i} (a {kind}, {n} values)" for i, kind, n in varying)
            warnings.warn(
                f"capture_step: {getattr(self.step_fn, '__name__', 'the step')} keeps being called with new "
                f"argument signatures ({'non-tensor argument ' + what if varying else f'{_KEPT_COLD} without a graph'}"
                f"), and each needs {self.warmup} warm-up call(s) and a graph of its own: a signature that does "
                f"not recur runs eagerly. Pass a value that changes from call to call as a tensor (copied into the "
                f"graph's input at each call), not as a Python value", UserWarning, stacklevel=3)

    # ---- eager ----------------------------------------------------------------------------
    def _eager(self, args: tuple, kwargs: dict, key: tuple | None = None) -> Any:
        """``step_fn`` eagerly; with ``key`` (a warm-up call on CUDA: its signature) on a side
        stream, watching the optimizers it steps and the modules it runs."""
        self.eager_calls += 1
        rec = _recording
        previous, rec.active = rec.active, self
        if key is None:
            try:
                return self.step_fn(*args, **kwargs)
            finally:
                rec.active = previous
        outer, rec.optimizers = rec.optimizers, {}
        try:
            watch = self._watches.setdefault(key, _ModuleWatch())
            with self._warmup_stream(), watch.running() as modules:
                out = self.step_fn(*args, **kwargs)
            self._last_eager[key] = _EagerCall(rec.optimizers, modules())
            watch.optimizers.update(rec.optimizers)
            return out
        finally:
            found = rec.optimizers
            rec.active, rec.optimizers = previous, outer
            if outer is not None:
                outer.update(found)  # a captured step called inside another one's watched call

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
    def _capture(self, key: tuple, args: tuple, kwargs: dict) -> _Graph:
        leaves, spec = tree_flatten((args, kwargs))
        copies = [_static_copy(v) for v in leaves]
        static = [c[0] for c in copies]
        tensors = [i for i, s in enumerate(static) if isinstance(s, torch.Tensor)]
        inputs = tuple((i, copies[i][1], copies[i][2]) for i in tensors)
        versions = {i: _version(static[i]) for i in tensors}
        grads_before = {i: static[i].grad for i in tensors if static[i].requires_grad}
        static_args, static_kwargs = tree_unflatten(static, spec)
        graph = self._new_graph()
        watch = self._watches.setdefault(key[0], _ModuleWatch())
        last = self._last_eager.get(key[0])
        # the parameters' .grad as the capture finds them (those the warm-up calls reached)
        grads_found = {id(p): (p.grad, None if p.grad is None else _version(p.grad))
                       for p in _grad_leaves(watch.modules, {**watch.optimizers, **(last.optimizers if last else {})})}
        rec = _recording
        previous = (rec.active, rec.capturing, rec.host_steps, rec.checks, rec.restores, rec.capture,
                    rec.optimizers)
        rec.active, rec.capturing, rec.host_steps, rec.checks, rec.restores, rec.capture, rec.optimizers = (
            self, True, [], [], [], object(), {})
        try:
            with watch.running() as modules:
                outputs = graph.capture(lambda: self.step_fn(*static_args, **static_kwargs))
            host_steps, checks, restores, optimizers = rec.host_steps, rec.checks, rec.restores, rec.optimizers
        finally:
            (rec.active, rec.capturing, rec.host_steps, rec.checks, rec.restores, rec.capture,
             rec.optimizers) = previous
        self.graphs += 1
        mutated = tuple(i for i in tensors if versions[i] is not None and _version(static[i]) != versions[i])
        grads = tuple((i, g0, static[i].grad) for i, g0 in grads_before.items())
        param_grads = _Grads(_grad_leaves(watch.modules, optimizers), grads_found)
        sources = {id(static[i]): ("arg", i) for i in tensors}
        sources.update({id(g1): ("grad", i) for i, _, g1 in grads if g1 is not None})
        returned = [sources.get(id(o)) if isinstance(o, torch.Tensor) else None for o in tree_flatten(outputs)[0]]
        return _Graph(static, graph, outputs, host_steps, optimizers, modules(), mutated, grads, returned,
                      inputs, checks, restores, param_grads)

    def _replay(self, graph: _Graph, args: tuple, kwargs: dict, checked: bool = False) -> Any:
        if not checked:
            for fn, a, k in graph.checks:
                fn(*a, **k)
        leaves = tree_flatten((args, kwargs))[0]
        with torch.no_grad():
            for i, target, base in graph.inputs:
                v = leaves[i]
                if base is not None:  # an expanded argument: the memory it views
                    v = v.as_strided(base, v.stride(), v.storage_offset())
                target.copy_(v, non_blocking=True)
            for i, g0 in graph.grads_in:
                g0.copy_(leaves[i].grad, non_blocking=True)
        graph.graph.replay()
        return self._after_replay(graph, leaves)

    @staticmethod
    def _after_replay(graph: _Graph, leaves: list) -> Any:
        static = graph.static
        if graph.mutated:
            with torch.no_grad():
                for i in graph.mutated:
                    leaves[i].copy_(static[i])
        for i, g0, g1 in graph.grads:  # the caller's .grad as an eager call leaves it
            caller = leaves[i]
            if g1 is None:
                if g0 is not None:
                    caller.grad = None
            elif g1 is g0:
                with torch.no_grad():
                    caller.grad.copy_(g1)
            else:
                caller.grad = g1.detach().clone()
        graph.param_grads.restore()  # the parameters' .grad as an eager call leaves them
        for fn, a, k in graph.restores:
            fn(*a, **k)
        for method, a, k in graph.host_steps:
            method(*a, **k)
        out, spec = tree_flatten(graph.outputs)
        result = []
        for o, source in zip(out, graph.returned):
            if source is not None:
                kind, i = source
                result.append(leaves[i] if kind == "arg" else leaves[i].grad)
            else:
                result.append(o.clone() if isinstance(o, torch.Tensor) else o)
        return tree_unflatten(result, spec)


def capture_step(step_fn: Callable, *example_args: Any, warmup: int = 3) -> CapturedStep:
    """``step_fn`` (a whole training step) as a callable that replays one CUDA graph per call.

    Args:
        step_fn: the step: forward, per-model losses, backward, optimizer step,
            gradient scaler, scheduler steps; returns what the caller needs
            (the ``[B]`` losses, detached). Called with the arguments the
            returned callable gets.
        example_args: arguments like the batches to come (checked as the calls'
            arguments are; their values are not used, nothing is trained on them).
        warmup: eager calls before the capture (>= 1: state is allocated and
            kernels are compiled at the first one).

    Returns a :class:`CapturedStep`; on CPU tensors (or without CUDA) it runs
    ``step_fn`` eagerly. See :mod:`hfkern.graphs` for what a replay reads and
    what forces a new capture. In a replay ``step_fn``'s Python does not run:
    the schedulers' steps run after it, so a value ``step_fn`` reads after
    ``sched.step()`` (a group's ``lr``) is the one before that step, where an
    eager call reads the next one; writes to its tensor arguments are copied
    back; other host work (a module's mode set in it, ``print``) happens at the
    capture only.
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
