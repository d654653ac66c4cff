"""Learning-rate schedulers for array optimizers: torch's schedules, one per model.

Each scheduler drives the ``[B]`` learning-rate tensors in an hfkern array
optimizer's ``param_groups`` (:mod:`hfkern.optim`; or a ``torch.optim.Optimizer``
following its conventions: an int ``B`` attribute and ``[B]`` learning-rate
tensors) so that model b follows the schedule that
``torch.optim.lr_scheduler.<Same>`` with model b's arguments gives model b
alone, to float64 rounding (below): the initial step in the constructor,
``initial_lr`` / ``base_lrs``, the chained update of :meth:`LRScheduler.step`
and the closed form of ``step(epoch)``. A plain torch optimizer, whose
learning rates are Python floats, raises a TypeError at construction (its
schedulers are ``torch.optim.lr_scheduler``'s). Every numeric argument may be
per model: a number (all models alike), a length-B sequence, or a 1-D tensor
or numpy array of length B; callables (``LambdaLR``, ``MultiplicativeLR``,
``CyclicLR``'s ``scale_fn``) are one per model or shared.

The schedule is computed on the host in float64, the arithmetic torch does with
Python floats, each formula once over every model's ``[B]`` values. The basic
operations round as Python's do; ``**`` and ``cos`` are torch's kernels,
which for larger B (from 16 on a typical CPU) run vectorized and may differ
from Python's ``math`` by one float64 rounding (1 ulp): so may a learning
rate computed with them (``StepLR``, ``MultiStepLR``, ``ExponentialLR``,
``PolynomialLR``, ``CosineAnnealingLR``, ``CosineAnnealingWarmRestarts``,
``OneCycleLR``, ``CyclicLR``'s ``triangular2`` and ``exp_range``), and a
chained update carries such a difference on to the next steps (relative
differences of order 1e-15, far below the float32 rounding of the optimizer's
learning rates). The values are written into the optimizer's tensors in place
with one small host-to-device copy per param group and step (from pinned
memory, non-blocking, on CUDA): stepping a scheduler never waits for the
device. The host copy of a group's learning rates is shared by every scheduler
of the optimizer, so schedulers chain as in torch; a learning rate changed
outside the schedulers (assigned anew, or edited in place) is noticed through
the tensor's identity and version counter and read back once.

Every write also records the float64 values in the param group as
``group["scheduled_lr"]`` (``[B]`` float64 CPU), which the optimizer's
``state_dict`` saves: after ``optimizer.load_state_dict`` the schedulers go on
from those exact values, not from their float32 rounding in ``group["lr"]``,
so a resumed run is bit-identical to an uninterrupted one (torch keeps its
learning rates as Python floats for the same reason). The record of a model is
used only while it rounds to the model's learning rate; a learning rate changed
outside the schedulers wins (for that model: the others keep their exact values).
Where no scheduler has written yet (a new scheduler's ``initial_lr`` and
``base_lrs``), and after a learning rate is given anew (assigned to
``group["lr"]``, or ``optimizer.set_hyperparameters(b, lr=...)``), the exact
values are those given to the optimizer, which keeps them beside their rounding
(``ArrayOptimizer._exact_lr``), under the same rule: a schedule starts from the
learning rate given, as torch's does, not from its float32 rounding.

Values a scheduler keeps itself (``base_lrs``, ``get_last_lr()``, and the
``initial_lr``, ``max_lr``, ``min_lr``, ``max_momentum``, ``base_momentum``
entries it adds to ``param_groups``) are ``[B]`` float64 CPU tensors, none of
them shared with another (editing a param-group entry in place changes nothing
the scheduler keeps). ``OneCycleLR`` and ``CyclicLR``, which set the learning
rate irrespective of the optimizer's, also add ``initial_lr_owner`` (their
class name): there ``optimizer.set_hyperparameters(b, lr=...)`` leaves
``initial_lr``, an endpoint of their schedule, as it is, and their next step
overwrites the new learning rate, as torch's do.

A scheduler keeps values per param group. After ``optimizer.add_param_group``
the chained update of ``StepLR``, ``MultiStepLR``, ``ConstantLR``,
``LinearLR``, ``ExponentialLR`` and ``PolynomialLR`` (which reads only the
groups' learning rates) goes on over every group, as torch's does, and so does
``ReduceLROnPlateau`` (its ``reset_model`` too); any other step, a
``step(epoch)`` and a ``reset_model`` raise a ValueError, before anything
changes, saying that a group was added after the scheduler.

Every model has its own epoch: ``last_epochs`` (and the step counts) are
``[B]`` int64 CPU tensors, and each formula is written once over them, for
every model at its own epoch. ``last_epoch`` is an int while every model is at
the same epoch (as torch code expects) and otherwise a copy of ``last_epochs``;
``state_dict`` saves it in the same form and ``load_state_dict`` takes either,
so a state saved before epochs were per model loads. A constructor's
``last_epoch`` is one int for every model or one per model (a length-B
sequence of ints, or a 1-D integer tensor or numpy array), each >= -1: model b
then follows torch's scheduler built with ``last_epoch[b]``, initial step
included (a model resuming at >= 0 needs ``initial_lr`` in the param groups,
as in torch). ``step(epoch)`` (deprecated, with torch's warning) takes one
epoch for every model or one per model, in the same forms (any int, as torch
takes; ``CosineAnnealingWarmRestarts``: real numbers >= 0, fractional
included, not deprecated; ``ReduceLROnPlateau.step(metrics, epoch)`` alike):
model b goes to ``epoch[b]`` and gets what torch's scheduler gives after
``step(epoch[b])``, the closed form where it has one, else the chained update
at that epoch. ``SequentialLR`` and ``ChainedScheduler`` take no epoch, as
torch's do.

``reset_model(b, **kwargs)`` refills slot b (a sweep pruning a trial and
starting a new one in its place): model b's schedule restarts as a scheduler
built now on an optimizer holding model b's current learning rate would start
it (set that first, e.g. with ``optimizer.set_hyperparameters(b, lr=...)``):
its ``initial_lr`` / ``base_lrs`` become that learning rate (``CyclicLR`` and
``OneCycleLR`` set their own, as their constructors do), its epoch and step
count restart, every per-model state is reset for model b (``T_cur``/``T_i``,
the plateau counters, the cycled momentum, the schedulers inside
``SequentialLR`` and ``ChainedScheduler``), and model b takes the initial
step. ``kwargs`` give model b new values of the per-model constructor
arguments (``reset_model(2, T_max=50, eta_min=1e-4)``), checked as the
constructor checks them; an unknown name raises TypeError. The other models'
learning rates, epochs and state stay bit-identical: every update computes
all models and writes only those it updates. Models at different epochs, or a
``SequentialLR`` whose models are in different schedulers, step together.

``state_dict_of(models)`` is the state of some of the models only (a list of
model indices, in their new order): a scheduler of the same class built for
those models, with their arguments, loads it with ``load_state_dict`` and
continues them as they would have continued here (a sweep rebuilding an array
around its remaining models; the optimizer's state of those models is loaded
into the new optimizer alike).

A step, a construction, a ``reset_model`` or a ``load_state_dict`` that raises
changes nothing: values are computed and checked before anything is written (a
negative or NaN ``lr_lambda`` factor, or ``CyclicLR`` ``scale_fn`` value,
raises a ValueError naming the models, as the optimizers reject such learning
rates), what a failing ``reset_model`` (or a step of several chained
schedulers) already changed is restored, and ``load_state_dict`` checks every
entry of the state (names, array size, shapes, dtypes, values: NaN and
infinite ones too, where they would make NaN learning rates) first. The errors
of ``reset_model(b, ...)`` name model b and its bad value.
"""

from __future__ import annotations

import contextlib
import math
import numbers
import operator
import sys
import types
import warnings
import weakref
from bisect import bisect_right
from collections import Counter
from collections.abc import Mapping
from typing import Any, Callable, Iterable, Iterator, Sequence

import torch
from torch.optim import Optimizer
from torch.optim import lr_scheduler as _torch

from .._array import hyper
from ..graphs import host_step
from ._base import _INITIAL_LR_OWNER, _LR_RECORD, ArrayOptimizer

__all__ = [
    "LRScheduler",
    "StepLR",
    "MultiStepLR",
    "ConstantLR",
    "LinearLR",
    "ExponentialLR",
    "PolynomialLR",
    "CosineAnnealingLR",
    "CosineAnnealingWarmRestarts",
    "CyclicLR",
    "OneCycleLR",
    "LambdaLR",
    "MultiplicativeLR",
    "SequentialLR",
    "ChainedScheduler",
    "ReduceLROnPlateau",
]

_F64 = torch.float64
_RECORD = _LR_RECORD  # the param-group entry holding the exact learning rates
_EPOCH_DEPRECATION_WARNING = getattr(
    _torch,
    "EPOCH_DEPRECATION_WARNING",
    "The epoch parameter in `scheduler.step()` is deprecated; the closed form is used when given.",
)

# An hfkern optimizer that has never stepped when its scheduler first steps: the order torch
# warns about too (the schedule's first value is never used).
_STEP_ORDER_WARNING = (
    "lr_scheduler.step() was called before optimizer.step(): step the optimizer first, then the "
    "scheduler (the order since PyTorch 1.1), or the schedule's first learning rate is never used."
)


# ---- argument parsing ---------------------------------------------------
def _numpy() -> Any:
    """numpy, if it has been imported (a numpy value cannot exist before); hfkern never imports it."""
    return sys.modules.get("numpy")


def _is_int(value: object) -> bool:
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


def _array_size(optimizer: object, who: str) -> int:
    """The array size B of ``optimizer``: an hfkern array optimizer's ``B`` (or that of a
    ``torch.optim.Optimizer`` following its conventions: an int ``B`` attribute, ``[B]`` learning
    rates). A plain torch optimizer, whose learning rates are Python floats, raises a TypeError."""
    if not isinstance(optimizer, Optimizer):
        raise TypeError(
            f"{who}: expected a torch.optim.Optimizer (an hfkern.optim array optimizer), got "
            f"{type(optimizer).__name__}"
        )
    B = getattr(optimizer, "B", None)
    if isinstance(B, int) and not isinstance(B, bool) and B >= 1:
        return B
    if isinstance(optimizer, ArrayOptimizer):  # B is set with its first parameter
        raise ValueError(f"{who}: the optimizer has no [B, ...] parameter to take the array size B from")
    torch_name = f"torch.optim.lr_scheduler.{who}" if hasattr(_torch, who) else "torch.optim.lr_scheduler"
    raise TypeError(
        f"{who}: expected an hfkern.optim array optimizer (e.g. hfkern.optim.SGD, with [B] learning "
        f"rates, one per model), got {type(optimizer).__module__}.{type(optimizer).__name__}, whose learning "
        f"rates are not per model; for a torch.optim optimizer use {torch_name}"
    )


_Epochs = int | Sequence[int] | torch.Tensor  # last_epoch, step's epoch: one int for every model, or one per model


def _epochs(value: object, B: int) -> torch.Tensor:
    """A ``last_epoch`` argument (one int for every model, or one per model) as ``[B]`` int64."""
    return _ints(value, B, "last_epoch", minimum=-1)


def _step_epochs(value: object, B: int, who: str) -> torch.Tensor:
    """The ``epoch`` of ``step(epoch)`` (one int for every model, or one per model) as ``[B]`` int64.

    Any int: torch's step sets ``last_epoch`` to whatever it is given, negative included.
    """
    return _ints(value, B, f"{who}: epoch", minimum=None)


def _fractional_epochs(value: object, B: int, who: str) -> torch.Tensor:
    """The ``epoch`` of ``CosineAnnealingWarmRestarts.step(epoch)`` (one real number for every model,
    or one per model) as ``[B]`` float64, each finite and >= 0."""
    # hyper rejects negative and NaN epochs, as torch refuses a negative one (and fails on NaN).
    t = hyper(value, B, f"{who}: epoch")
    if torch.isinf(t).any():  # torch's floor of the epoch overflows
        raise ValueError(f"{who}: epoch must be finite for every model, got {t.tolist()}")
    return t


def _model_index(b: object, B: int, who: str) -> int:
    """``b`` checked as a model index (an int in [0, B))."""
    if isinstance(b, bool) or not isinstance(b, numbers.Integral):
        raise TypeError(f"{who}: expected a model index b (an int in [0, {B})), got {type(b).__name__} {b!r}")
    if not 0 <= b < B:
        raise ValueError(f"{who}: expected a model index b in [0, {B}), got {b}")
    return int(b)


def _model_indices(models: object, B: int, who: str) -> list[int]:
    """``models`` checked as a non-empty sequence of model indices (ints in [0, B)): a list or tuple
    of ints, or a 1-D integer tensor or numpy array."""
    np = _numpy()
    if isinstance(models, torch.Tensor) or (np is not None and isinstance(models, np.ndarray)):
        if models.ndim != 1:
            raise ValueError(f"{who}: expected a 1-D sequence of model indices, got shape {list(models.shape)}")
        models = models.tolist()
    if not isinstance(models, (list, tuple)) or not models:
        raise TypeError(f"{who}: expected a non-empty list of model indices (ints in [0, {B})), got {models!r}")
    return [_model_index(b, B, who) for b in models]


def _models_of(value: Any, rows: torch.Tensor) -> Any:
    """A state entry for the models ``rows`` only: every tensor in it (each a per-model ``[B]`` value,
    as every tensor a scheduler keeps is) indexed by ``rows``, through lists, tuples and dicts."""
    if isinstance(value, torch.Tensor):
        return value[rows].clone()
    if isinstance(value, dict):
        return type(value)({k: _models_of(v, rows) for k, v in value.items()})
    if isinstance(value, (list, tuple)):
        return type(value)(_models_of(v, rows) for v in value)
    return value


def _one_hot(b: int, B: int) -> torch.Tensor:
    models = torch.zeros(B, dtype=torch.bool)
    models[b] = True
    return models


def _uniform(t: torch.Tensor) -> int | torch.Tensor:
    """An int while every model has the same value, else (a copy of) the ``[B]`` tensor."""
    first = int(t[0])
    return first if bool((t == first).all()) else t.clone()


def _floats(value: object, B: int, name: str, *, model: int | None = None) -> torch.Tensor:
    """A per-model non-negative argument as a fresh ``[B]`` float64 CPU tensor.

    With ``model``, ``value`` is that model's one value (``reset_model``; B is 1) and
    a message gives that value (the caller names the model).
    """
    if model is None:
        return hyper(value, B, name).clone()
    try:
        return hyper(value, B, name).clone()
    except TypeError:
        raise TypeError(f"{name} must be a real number, got {type(value).__name__} {value!r}") from None
    except ValueError as e:
        error = e
    try:
        number = float(value)  # one number, NaN or negative: say which and give it
    except (TypeError, ValueError, RuntimeError):
        raise error from None
    problem = "must not be NaN" if number != number else "must be >= 0"
    raise ValueError(f"{name} {problem}, got {number}") from None


def _read(value: object, B: int, name: str) -> torch.Tensor:
    """A per-model value stored in a param group, as ``[B]`` float64 on the host (never modify)."""
    if isinstance(value, torch.Tensor) and value.dtype == _F64 and value.device.type == "cpu" \
            and value.shape == (B,):
        return value
    return hyper(value, B, name)


def _ints(value: object, B: int, name: str, *, minimum: int | None, model: int | None = None) -> torch.Tensor:
    """A per-model integer argument (int, length-B sequence of ints, 1-D integer tensor or numpy
    array) as a fresh ``[B]`` int64 CPU tensor (with ``model``: that model's one value, B 1)."""
    np = _numpy()
    if np is not None and isinstance(value, np.ndarray):
        if value.dtype.kind not in "iu":
            raise TypeError(f"{name} must be an int or integers (one per model), got a {value.dtype} numpy array")
        value = torch.from_numpy(value.astype(np.int64))
    if isinstance(value, torch.Tensor):
        if value.is_floating_point() or value.is_complex() or value.dtype == torch.bool:
            raise TypeError(f"{name} must be an int or integers (one per model), got a {value.dtype} tensor")
        t = value.detach().to(device="cpu", dtype=torch.int64).clone()
        if t.dim() == 0:
            t = t.expand(B).clone()
    elif _is_int(value):
        t = torch.full((B,), int(value), dtype=torch.int64)
    elif isinstance(value, Sequence) and not isinstance(value, (str, bytes)):
        items = []
        for v in value:
            if isinstance(v, bool):
                raise TypeError(f"{name} must hold ints (one per model), got {value!r}")
            try:
                items.append(operator.index(v))
            except TypeError:
                raise TypeError(f"{name} must hold ints (one per model), got {value!r}") from None
        t = torch.tensor(items, dtype=torch.int64)
    elif model is not None:
        raise TypeError(f"{name} must be an int, got {type(value).__name__} {value!r}")
    else:
        raise TypeError(
            f"{name} must be an int, a length-{B} sequence of ints or a 1-D integer tensor or array, "
            f"got {type(value).__name__} {value!r}"
        )
    if t.dim() != 1 or t.numel() != B:
        raise ValueError(f"{name} must have one value per model (length B={B}), got shape {list(t.shape)}")
    if minimum is not None and (t < minimum).any():
        if model is not None:
            raise ValueError(f"{name} must be >= {minimum}, got {int(t[0])}")
        raise ValueError(f"{name} must be >= {minimum} for every model, got {t.tolist()}")
    return t


def _check_range(t: torch.Tensor, name: str, lo: float, hi: float, *, lo_open: bool = False,
                 hi_open: bool = False, model: int | None = None) -> None:
    """Every value of ``t`` in the interval (with ``model``: ``t`` is that model's one value, and the
    message gives it; the caller names the model)."""
    bad = (t <= lo if lo_open else t < lo) | (t >= hi if hi_open else t > hi)
    if bad.any():
        interval = f"{'(' if lo_open else '['}{lo}, {hi}{')' if hi_open else ']'}"
        if model is not None:
            raise ValueError(f"{name} must lie in {interval}, got {t[0].item()}")
        raise ValueError(
            f"{name} must lie in {interval} for every model; models {bad.nonzero().flatten().tolist()} "
            f"have {t[bad].tolist()}"
        )


def _is_per_model(value: object) -> bool:
    """A sequence, 1-D tensor or 1-D numpy array: one value per model."""
    np = _numpy()
    return (
        (isinstance(value, torch.Tensor) and value.dim() > 0)
        or (np is not None and isinstance(value, np.ndarray) and value.ndim > 0)
        or (isinstance(value, Sequence) and not isinstance(value, (str, bytes, torch.Tensor)))
    )


def _is_nested(value: object) -> bool:
    """True for a list/tuple with a per-model value in it: one per-model value per param group."""
    return isinstance(value, (list, tuple)) and any(_is_per_model(v) for v in value)


def _per_group(value: object, n_groups: int, B: int, name: str) -> list[torch.Tensor]:
    """An argument torch takes per param group: one per-model value for all groups, or a list of them.

    A flat list of numbers is per model (the hfkern convention); one value per
    param group is a list of per-model values, e.g. ``[[a0, a1, a2], 0.1]``.
    """
    if _is_nested(value):
        if len(value) != n_groups:
            raise ValueError(
                f"{name}: expected one per-model value per param group ({n_groups}), got {len(value)}"
            )
        return [_floats(v, B, f"{name}[{i}]") for i, v in enumerate(value)]
    _check_flat_list(value, n_groups, B, name, "numbers", "[[v0] * B, [v1] * B]")
    t = _floats(value, B, name)
    return [t.clone() for _ in range(n_groups)]


def _check_flat_list(value: object, n_groups: int, B: int, name: str, what: str, nested: str) -> None:
    """A flat list or tuple of one entry per param group, as a torch script passes it: hfkern
    reads a flat list as one entry per model. Where that is also B, it warns (a script ported from
    torch would run with another meaning); else the error says how to write one per group."""
    if n_groups < 2 or not isinstance(value, (list, tuple)) or len(value) != n_groups:
        return
    how = (f"for one per param group, as torch reads such a list, give each group its own per-model "
           f"value: a list of {n_groups} entries each of B={B} (e.g. {nested})")
    if len(value) != B:
        raise ValueError(f"{name}: a flat list of {len(value)} {what} is one per model here (B={B}), "
                         f"not one per param group ({n_groups}); {how}")
    warnings.warn(f"{name}: a flat list of {B} {what} is read as one per model (hfkern's convention), "
                  f"where torch reads one per param group (this optimizer has {n_groups}); {how}",
                  UserWarning, stacklevel=4)


def _milestones(value: object, B: int, name: str = "milestones") -> list[Counter]:
    """One shared list of epochs, or one list per model, as B Counters."""
    np = _numpy()
    if isinstance(value, torch.Tensor) or (np is not None and isinstance(value, np.ndarray)):
        value = value.tolist()
    if isinstance(value, (str, bytes)) or not isinstance(value, Iterable):
        raise TypeError(f"{name} must be a list of ints, or one list per model, got {type(value).__name__}")
    value = list(value)

    def ints(seq: Iterable, where: str) -> list[int]:
        out = []
        for v in seq:
            if isinstance(v, bool):
                raise TypeError(f"{where} must hold ints, got {v!r}")
            try:
                out.append(operator.index(v))
            except TypeError:
                raise TypeError(f"{where} must hold ints, got {v!r}") from None
        return out

    nested = [isinstance(v, Iterable) and not isinstance(v, (str, bytes)) for v in value]
    if value and all(nested):
        if len(value) != B:
            raise ValueError(f"{name}: expected one list per model (B={B}), got {len(value)} lists")
        return [Counter(ints(v.tolist() if hasattr(v, "tolist") else v, f"{name}[{b}]"))
                for b, v in enumerate(value)]
    if any(nested):
        raise TypeError(f"{name} must be one list of ints or one list per model, not a mix: {value!r}")
    shared = ints(value, name)
    return [Counter(shared) for _ in range(B)]


def _factors(out: object, B: int, who: str, *, number: bool = False) -> torch.Tensor:
    """What a user function returned as ``[B]`` float64: a number (all models alike) or, unless
    ``number``, one value per model (a sequence, tensor or numpy array)."""
    expected = "a number" if number else f"a number or B={B} factors (one per model)"
    np = _numpy()
    if np is not None and isinstance(out, np.ndarray):
        out = torch.from_numpy(out.astype(np.float64))
    if isinstance(out, torch.Tensor):
        t = out.detach().to(device="cpu", dtype=_F64)
        t = t.expand(B) if t.dim() == 0 else t
    elif isinstance(out, numbers.Real) and not isinstance(out, bool):
        return torch.full((B,), float(out), dtype=_F64)
    else:
        try:
            t = torch.tensor([float(v) for v in out], dtype=_F64)
        except (TypeError, ValueError):
            raise TypeError(f"{who}: expected {expected}, got {type(out).__name__} {out!r}") from None
    if t.shape != (B,) or (number and out is not None and getattr(out, "ndim", 0) > 0):
        raise ValueError(f"{who}: expected {expected}, got shape {list(t.shape)}")
    return t


def _check_factors(t: torch.Tensor, who: str, epochs: torch.Tensor, group: int | None,
                   models: torch.Tensor | None) -> torch.Tensor:
    """Reject negative and NaN factors of ``models`` (None: every model), as the optimizers reject such
    learning rates. ``group``: the param group the factors are of (None: every group's)."""
    bad = torch.isnan(t) | (t < 0)
    if models is not None:
        bad &= models
    if bad.any():
        at = epochs[bad].tolist()
        at = f"epoch {at[0]}" if len(set(at)) == 1 else f"epochs {at}"
        of = "" if group is None else f" of param group {group}"
        raise ValueError(
            f"{who}: factors must be >= 0 and not NaN (they scale learning rates); at {at} "
            f"models {bad.nonzero().flatten().tolist()}{of} got {t[bad].tolist()}"
        )
    return t


def _call_per_model(fns: Callable | list[Callable], args: torch.Tensor, models: torch.Tensor | None, B: int,
                    who: str) -> torch.Tensor:
    """User functions at each model's own argument, as ``[B]`` float64, for ``models`` (None: every
    model; the others get 1).

    ``fns``: a list of B callables (model b's called with ``args[b]``, returning
    a number), or one callable shared by every model, called once per distinct
    argument (returning a number, or one value per model).
    """
    chosen = list(range(B)) if models is None else models.nonzero().flatten().tolist()
    values = args.tolist()
    if isinstance(fns, list):
        out = torch.ones(B, dtype=_F64)
        for b in chosen:
            out[b] = _factors(fns[b](_number(values[b])), 1, f"{who} of model {b}", number=True)[0]
        return out
    distinct = sorted({values[b] for b in chosen})
    if len(distinct) == 1 and models is None:
        return _factors(fns(_number(distinct[0])), B, who)
    out = torch.ones(B, dtype=_F64)
    for v in distinct:
        at = args == v
        if models is not None:
            at &= models
        out = torch.where(at, _factors(fns(_number(v)), B, who), out)
    return out


def _number(v: object) -> int | float:
    """A host value as the Python number torch's schedulers pass to user functions."""
    v = float(v)
    return int(v) if v.is_integer() else v


# ---- the host copy of the learning rates ----------------------------------
class _HostLR:
    """A group's learning rates on the host, valid while ``source`` is unchanged."""

    __slots__ = ("group", "source", "version", "values")

    def __init__(self, group: dict, source: object, values: torch.Tensor):
        self.group = group  # held so that id(group) stays this group's
        self.source = source
        self.version = _version(source)
        self.values = values


_HOST_LRS: weakref.WeakKeyDictionary[Optimizer, dict[int, _HostLR]] = weakref.WeakKeyDictionary()


def _version(t: object) -> int | None:
    if not isinstance(t, torch.Tensor):
        return None
    try:
        return t._version
    except RuntimeError:  # inference tensors keep no version counter
        return None


def _valid(entry: _HostLR | None, group: dict) -> bool:
    lr = group["lr"]
    return (
        entry is not None and entry.group is group and isinstance(lr, torch.Tensor)
        and entry.source is lr and entry.version == _version(lr)
    )


def _current_lr(optimizer: Optimizer, group: dict, B: int) -> torch.Tensor:
    """``group["lr"]`` as ``[B]`` float64 on the host; reads the device only after an outside change."""
    entries = _HOST_LRS.setdefault(optimizer, {})
    entry = entries.get(id(group))
    if _valid(entry, group):
        return entry.values
    lr = group["lr"]
    values = hyper(lr, B, "lr").clone()
    if isinstance(optimizer, ArrayOptimizer):
        record = optimizer._exact_lr(group)
    else:
        record = group.get(_RECORD)
    if isinstance(record, torch.Tensor) and record.dtype == _F64 and record.shape == (B,) \
            and record.device.type == "cpu":
        # The exact values the schedulers last wrote (e.g. restored by the optimizer's
        # load_state_dict), or else those given to the optimizer, for every model whose
        # learning rate is still their rounding: a new learning rate for one model (a
        # refilled slot, an lr written in place) leaves the others exact.
        rounded = record.to(lr.dtype) if isinstance(lr, torch.Tensor) and lr.is_floating_point() else record
        values = torch.where(rounded.to(_F64) == values, record, values)
    live = {id(g) for g in optimizer.param_groups}
    for k in [k for k in entries if k not in live]:
        del entries[k]
    entries[id(group)] = _HostLR(group, lr, values)
    return values


def _is_array_tensor(t: object, B: int) -> bool:
    return isinstance(t, torch.Tensor) and t.dim() == 1 and t.numel() == B and t.is_floating_point()


def _copy_into(dst: torch.Tensor, values: torch.Tensor) -> None:
    """Write host ``values`` into ``dst`` in place, without making the host wait for the device."""
    src = values.to(dst.dtype)
    with torch.no_grad():
        if dst.device.type == "cuda":
            # A pageable source makes copy_ synchronize the stream; a pinned one
            # is copied asynchronously, and the caching host allocator keeps
            # the buffer alive until the copy has run.
            dst.copy_(src.pin_memory(), non_blocking=True)
        else:
            dst.copy_(src)


def _set_lr(optimizer: Optimizer, group: dict, values: torch.Tensor, B: int) -> None:
    """Set the group's learning rates to the ``[B]`` float64 host ``values``."""
    entries = _HOST_LRS.setdefault(optimizer, {})
    entry = entries.get(id(group))
    lr = group["lr"]
    if _is_array_tensor(lr, B):
        if not (_valid(entry, group) and torch.equal(entry.values, values)):
            _copy_into(lr, values)
    else:
        # Not (yet) a [B] tensor, e.g. a float the user assigned: hand the
        # optimizer a new value, which it validates and stores at its next step.
        lr = values.clone()
        group["lr"] = lr
    group[_RECORD] = values
    entries[id(group)] = _HostLR(group, lr, values)


def _copy_models_into(dst: torch.Tensor, values: torch.Tensor, models: torch.Tensor) -> None:
    """Write host ``values`` into ``dst`` in place for ``models`` only ([B] bool), without a host sync."""
    src = values.to(dst.dtype)
    with torch.no_grad():
        if dst.device.type == "cuda":
            src = src.pin_memory().to(dst.device, non_blocking=True)
            models = models.pin_memory().to(dst.device, non_blocking=True)
        dst.copy_(torch.where(models, src, dst))


def _set_momentum(group: dict, values: torch.Tensor, B: int, use_beta1: bool,
                  models: torch.Tensor | None = None) -> None:
    """Set the cycled momentum (``momentum``, or ``betas[0]``) of every model, or of ``models`` only;
    in place where it is a [B] tensor."""
    current = group["betas"][0] if use_beta1 else group["momentum"]
    if _is_array_tensor(current, B):
        if models is None:
            _copy_into(current, values)
        else:
            _copy_models_into(current, values, models)
        return
    if models is not None:  # not validated yet (a number): the other models keep its value
        values = torch.where(models, values, hyper(current, B, "momentum"))
    if use_beta1:
        group["betas"] = (values.clone(), *group["betas"][1:])
    else:
        group["momentum"] = values.clone()


@contextlib.contextmanager
def _kept_on_error(*schedulers: object, optimizer: Optimizer | None = None) -> Iterator[None]:
    """Undo what the block did to ``schedulers`` (their attributes) and, with ``optimizer``,
    to its param groups (entries, and the values of tensors written in place) if it raises."""
    kept = [(s, dict(s.__dict__)) for s in schedulers]
    groups = []
    if optimizer is not None:
        for group in optimizer.param_groups:
            tensors = [group.get(k) for k in ("lr", "momentum")] + list(group.get("betas", ()))[:1]
            # Device clones: restoring in place needs the old values, and reading them
            # to the host would wait for the device.
            clones = [(t, t.detach().clone()) for t in tensors if isinstance(t, torch.Tensor)]
            groups.append((group, dict(group), clones))
        # An entry valid now is valid again once its tensor's values are restored.
        entries = {k: (e, e.version == _version(e.source)) for k, e in _HOST_LRS.get(optimizer, {}).items()}
    try:
        yield
    except BaseException:
        for s, d in kept:
            s.__dict__.clear()
            s.__dict__.update(d)
        if optimizer is not None:
            with torch.no_grad():
                for group, saved, clones in groups:
                    for t, c in clones:
                        t.copy_(c)
                    group.clear()
                    group.update(saved)
            for entry, valid in entries.values():
                if valid:
                    entry.version = _version(entry.source)
            _HOST_LRS[optimizer] = {k: e for k, (e, _) in entries.items()}
        raise


def _nested(scheduler: object) -> list[object]:
    """``scheduler`` and every scheduler it contains."""
    out = [scheduler]
    for s in getattr(scheduler, "_schedulers", ()):
        out += _nested(s)
    return out


# ---- state dict checks --------------------------------------------------------
# A scheduler's state is its ``__dict__`` (as torch's). Each class names how every
# entry is checked and converted when loaded: a function (value, scheduler, name)
# returning the value to store, raising a ValueError or TypeError for a bad one.
# The constructors use the same functions for the arguments they store as given.
class _OneModel:
    """What a check of the table below is given in place of a scheduler to check model ``b``'s
    one value of an argument (``reset_model``): B is 1, and messages name model b."""

    __slots__ = ("B", "b")

    def __init__(self, b: int) -> None:
        self.B = 1
        self.b = b


def _model_of(sched: Any) -> int | None:
    """The model whose one value a check checks (``_OneModel``), else None (every model's)."""
    return sched.b if isinstance(sched, _OneModel) else None


def _spec_floats(lo: float = 0.0, hi: float = math.inf, *, lo_open: bool = False, hi_open: bool = False):
    def check(value: object, sched: Any, name: str) -> torch.Tensor:
        model = _model_of(sched)
        t = _floats(value, sched.B, name, model=model)
        if lo != 0.0 or lo_open or hi != math.inf or hi_open:
            _check_range(t, name, lo, hi, lo_open=lo_open, hi_open=hi_open, model=model)
        return t
    return check


def _spec_any_floats(*, infinite: bool = False):
    """``[B]`` float64 of any sign (a running best value, a phase boundary, a position in a period),
    never NaN; finite unless ``infinite`` (a best value starts at inf or -inf)."""
    def check(value: object, sched: Any, name: str) -> torch.Tensor:
        if not isinstance(value, torch.Tensor) or value.dtype != _F64 or value.shape != (sched.B,):
            got = f"{value.dtype} tensor of shape {list(value.shape)}" if isinstance(value, torch.Tensor) \
                else type(value).__name__
            raise TypeError(f"{name} must be a [B={sched.B}] float64 tensor, got {got}")
        t = value.detach().to("cpu").clone()
        bad = torch.isnan(t) if infinite else ~torch.isfinite(t)
        if bad.any():
            raise ValueError(
                f"{name} must {'not be NaN' if infinite else 'be finite'} for every model; models "
                f"{bad.nonzero().flatten().tolist()} have {t[bad].tolist()}"
            )
        return t
    return check


def _spec_ints(minimum: int | None):
    def check(value: object, sched: Any, name: str) -> torch.Tensor:
        return _ints(value, sched.B, name, minimum=minimum, model=_model_of(sched))
    return check


def _spec_group_floats(value: object, sched: Any, name: str) -> list[torch.Tensor]:
    n = len(sched.optimizer.param_groups)
    if not isinstance(value, (list, tuple)) or len(value) != n:
        got = f"{len(value)} entries" if isinstance(value, (list, tuple)) else type(value).__name__
        raise ValueError(f"{name} must hold one [B] tensor per param group ({n}), got {got}")
    return [_floats(v, sched.B, f"{name}[{i}]") for i, v in enumerate(value)]


def _spec_bool(value: object, sched: Any, name: str) -> bool:
    if not isinstance(value, bool):
        raise TypeError(f"{name} must be a bool, got {type(value).__name__} {value!r}")
    return value


def _spec_choice(*options: str):
    def check(value: object, sched: Any, name: str) -> str:
        if value not in options:
            raise ValueError(f"{name} must be one of {list(options)}, got {value!r}")
        return value
    return check


def _spec_str(value: object, sched: Any, name: str) -> str:
    if not isinstance(value, str):
        raise TypeError(f"{name} must be a str, got {type(value).__name__} {value!r}")
    return value


def _spec_same_B(value: object, sched: Any, name: str) -> int:
    if value != sched.B:
        raise ValueError(
            f"the state is of an array of B={value} models, this scheduler's optimizer has B={sched.B}"
        )
    return sched.B


def _spec_milestones(value: object, sched: Any, name: str) -> list[Counter]:
    if not isinstance(value, (list, tuple)) or len(value) != sched.B:
        raise ValueError(f"{name} must hold one Counter of epochs per model (B={sched.B}), got {value!r}")
    out = []
    for b, m in enumerate(value):
        if not isinstance(m, Mapping) or not all(_is_int(k) and _is_int(n) and n >= 1 for k, n in m.items()):
            raise TypeError(f"{name}[{b}] must be a Counter of int epochs, got {m!r}")
        out.append(Counter({int(k): int(n) for k, n in m.items()}))
    return out


def _spec_callables(attr: str):
    """The saved state of the callables in attribute ``attr``: checked against the current ones."""
    def check(value: object, sched: Any, name: str) -> Any:
        _check_saved_callables(getattr(sched, attr), value, name)
        return value
    return check


def _saved_callables(fns: Any) -> Any:
    """What torch saves of callables: the ``__dict__`` of callable objects, None for functions."""
    if fns is None:
        return None
    if isinstance(fns, list):
        return [_saved_callables(f) for f in fns]
    if isinstance(fns, types.FunctionType) or not hasattr(fns, "__dict__"):  # a builtin has no state to keep
        return None
    return fns.__dict__.copy()


def _check_saved_callables(fns: Any, saved: object, name: str) -> None:
    if isinstance(fns, list):
        if not isinstance(saved, (list, tuple)) or len(saved) != len(fns):
            raise ValueError(
                f"{name}: expected a list of {len(fns)} saved callables to match this scheduler's, got {saved!r}"
            )
        for i, (f, s) in enumerate(zip(fns, saved)):
            _check_saved_callables(f, s, f"{name}[{i}]")
    elif saved is not None:
        if not isinstance(saved, Mapping):
            raise TypeError(f"{name}: expected the saved __dict__ of a callable object (or None), got {saved!r}")
        if fns is None or not hasattr(fns, "__dict__"):
            raise ValueError(f"{name}: the state holds a callable object's state, this scheduler has {fns!r}")


def _restore_callables(fns: Any, saved: Any) -> None:
    if isinstance(fns, list):
        for f, s in zip(fns, saved):
            _restore_callables(f, s)
    elif saved is not None:
        fns.__dict__.update(saved)


def _spec_phases(value: object, sched: Any, name: str) -> list[dict[str, Any]]:
    keys = {"end_step", "start_lr", "end_lr", "start_momentum", "end_momentum"}
    names = {"initial_lr", "max_lr", "min_lr", "max_momentum", "base_momentum"}
    if not isinstance(value, (list, tuple)) or len(value) not in (2, 3):
        raise ValueError(f"{name} must be a list of 2 or 3 phases, got {value!r}")
    out = []
    for i, phase in enumerate(value):
        if not isinstance(phase, Mapping) or set(phase) != keys:
            raise ValueError(f"{name}[{i}] must be a dict with the entries {sorted(keys)}, got {phase!r}")
        for k in keys - {"end_step"}:
            if phase[k] not in names:
                raise ValueError(f"{name}[{i}][{k!r}] must be one of {sorted(names)}, got {phase[k]!r}")
        out.append({**phase, "end_step": _spec_any_floats()(phase["end_step"], sched, f"{name}[{i}]['end_step']")})
    return out


def _spec_children(value: object, sched: Any, name: str) -> list[Callable[[], None]]:
    """Every child's state, checked by the child: what loads them all."""
    children = sched._schedulers
    if not isinstance(value, (list, tuple)) or len(value) != len(children):
        got = f"{len(value)} states" if isinstance(value, (list, tuple)) else type(value).__name__
        raise ValueError(f"{name}: expected one state per scheduler ({len(children)}), got {got}")
    loads = []
    for i, (child, state) in enumerate(zip(children, value)):
        try:
            loads.append(child._prepare_load(state))
        except (TypeError, ValueError) as e:
            raise type(e)(f"{name}[{i}]: {e}") from None
    return loads


def _spec_milestone_list(value: object, sched: Any, name: str) -> list[int | torch.Tensor]:
    return _sequence_milestones(value, len(sched._schedulers) - 1, sched.B, name)


def _sequence_milestones(value: object, n: int, B: int, name: str) -> list[int | torch.Tensor]:
    """SequentialLR's ``n`` milestones, each one int for every model or one per model (a length-B
    sequence of ints, or a 1-D integer tensor or numpy array; a ``[n, B]`` tensor or array gives
    them all). A milestone stays an int while every model agrees: torch's form, that of a state
    saved before milestones were per model."""
    np = _numpy()
    if isinstance(value, torch.Tensor) or (np is not None and isinstance(value, np.ndarray)):
        value = value.tolist()
    if isinstance(value, (str, bytes)) or not isinstance(value, Iterable):
        raise TypeError(
            f"{name} must be a list of {n} milestones (each an int or one per model), got {type(value).__name__}"
        )
    value = list(value)
    if len(value) != n:
        raise ValueError(f"{name}: expected one milestone fewer than schedulers ({n}), got {len(value)}")
    return [_uniform(_ints(m, B, f"{name}[{i}]", minimum=None)) for i, m in enumerate(value)]


def _spec_optional_floats(value: object, sched: Any, name: str) -> torch.Tensor | None:
    return None if value is None else _floats(value, sched.B, name)


def _spec_mode_worse(value: object, sched: Any, name: str) -> float:
    if value not in (math.inf, -math.inf):
        raise ValueError(f"{name} must be inf or -inf, got {value!r}")
    return float(value)


_BASE_SPEC: dict[str, Callable] = {
    "B": _spec_same_B,
    "base_lrs": _spec_group_floats,
    "last_epoch": _spec_ints(None),  # any int: step(epoch) sets whatever it is given, as torch's does
    "_step_count": _spec_ints(0),
    "_last_lr": _spec_group_floats,
    "_is_initial": _spec_bool,
}

# State entries kept in another attribute: the per-model epochs and step counts are
# [B] int64 tensors, saved under torch's names (an int while every model agrees).
_HELD_IN = {"last_epoch": "last_epochs", "_step_count": "_step_counts"}
_SAVED_AS = {attr: entry for entry, attr in _HELD_IN.items()}


class _Loadable:
    """``state_dict`` / ``load_state_dict`` for the schedulers: every entry is checked first."""

    _spec: dict[str, Callable] = {}  # entry name -> check, beyond those of the base classes
    _spec_replaces = False  # True: _spec lists every entry (the base classes' are not kept)
    _optional: frozenset[str] = frozenset({"_is_initial"})  # entries a state may lack

    @classmethod
    def _full_spec(cls) -> dict[str, Callable]:
        spec: dict[str, Callable] = {}
        for klass in reversed(cls.__mro__):
            if klass.__dict__.get("_spec_replaces", False):
                spec = {}
            spec.update(klass.__dict__.get("_spec", {}))
        return spec

    def _arg(self, name: str, value: object) -> Any:
        """A constructor argument checked and converted as a loaded state entry of that name is."""
        return self._full_spec()[name](value, self, name)

    def state_dict(self) -> dict[str, Any]:
        """The scheduler's state: every attribute but the optimizer.

        The per-model epochs (and step counts) are saved under torch's names
        ``last_epoch`` (and ``_step_count``): an int while every model agrees,
        else the ``[B]`` int64 tensor. Loading takes either form, so a state
        saved before epochs were per model loads too.
        """
        return self._state_entries()

    def _state_entries(self, skip: tuple[str, ...] = ()) -> dict[str, Any]:
        out = {}
        for k, v in self.__dict__.items():
            if k == "optimizer" or k in skip:
                continue
            entry = _SAVED_AS.get(k)
            if entry is None:
                out[k] = v
            else:
                out[entry] = _uniform(v)
        return out

    def _store(self, new: Mapping[str, Any]) -> None:
        """Set checked state entries as attributes."""
        self.__dict__.update({_HELD_IN.get(k, k): v for k, v in new.items()})

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Load a state from :meth:`state_dict` of a scheduler of this class with the same B.

        Every entry is checked (names, B, shapes, dtypes and values, as the
        constructor checks its arguments) before anything changes; a state that
        does not fit raises a ValueError or TypeError and leaves the scheduler
        as it was.
        """
        self._prepare_load(state_dict)()

    def _prepare_load(self, state_dict: object) -> Callable[[], None]:
        """Check ``state_dict`` against this scheduler; returns what loads it (which cannot fail)."""
        who = f"{type(self).__name__}.load_state_dict"
        if not isinstance(state_dict, Mapping):
            raise TypeError(f"{who}: expected a dict from state_dict(), got {type(state_dict).__name__}")
        spec = self._full_spec()
        try:
            if "B" in state_dict:
                _spec_same_B(state_dict["B"], self, "B")
            missing = sorted(set(spec) - self._optional - set(state_dict))
            unknown = sorted(set(state_dict) - set(spec))
            if missing or unknown:
                raise ValueError(
                    f"the state does not fit a {type(self).__name__}: missing entries {missing}, "
                    f"unexpected entries {unknown} (is it another scheduler's state?)"
                )
            new = {k: spec[k](v, self, k) for k, v in state_dict.items()}
            self._check_loaded(new)
        except (TypeError, ValueError) as e:
            raise type(e)(f"{who}: {e}") from None
        return lambda: self._apply_state(new)

    def _check_loaded(self, new: dict[str, Any]) -> None:
        """Checks across entries, after each entry has been checked on its own."""

    def _apply_state(self, new: dict[str, Any]) -> None:
        self._store(new)


# ---- per-model epochs and restarts ----------------------------------------------
class _At:
    """What one update computes: each model's epoch, and which models it updates how."""

    __slots__ = ("epoch", "only", "initial", "_e")

    def __init__(self, epoch: torch.Tensor, only: torch.Tensor | None, initial: torch.Tensor | None) -> None:
        self.epoch = epoch  # [B] int64: every model's epoch (after the update's increment)
        self.only = only  # [B] bool: the models this update sets (the others' values are not used); None: all
        self.initial = initial  # [B] bool: models taking a constructor's initial step; None: no model
        self._e: torch.Tensor | None = None

    @property
    def e(self) -> torch.Tensor:
        """``epoch`` as float64, for the formulas (the arithmetic torch does with Python numbers)."""
        if self._e is None:
            self._e = self.epoch.to(_F64)
        return self._e

    def unless_initial(self, lr: torch.Tensor, value: torch.Tensor) -> torch.Tensor:
        """``value``, but ``lr`` for models taking the initial step (which keeps the learning rate)."""
        return value if self.initial is None else torch.where(self.initial, lr, value)


class _Restart:
    """What one :meth:`reset_model` shares among the schedulers it restarts in order (those of a
    ChainedScheduler or SequentialLR), as torch's constructors share the optimizer on which
    they run one after another."""

    def __init__(self) -> None:
        # A fresh optimizer has no initial_lr: the first scheduler to start sets it.
        self.initial_lr_set = False


def _single(value: object, who: str, name: str, b: int) -> None:
    """Reject a per-model value where one model's value is expected."""
    if _is_per_model(value):
        raise TypeError(f"{who}: {name} must be one value, model {b}'s, got {value!r}")


def _per_group_values(value: object, n_groups: int, who: str, name: str, b: int) -> list[torch.Tensor]:
    """Model b's value of an argument torch takes per param group: one number for every group, or a
    list of one number per group. Returns, per group, the number as a ``[1]`` float64 tensor."""
    if isinstance(value, (list, tuple)):
        if len(value) != n_groups:
            raise ValueError(
                f"{who}: {name} must be one number (model {b}'s) or one per param group ({n_groups}), "
                f"got {len(value)} values"
            )
        items = list(value)
    else:
        items = [value] * n_groups
    out = []
    for i, v in enumerate(items):
        label = f"{name}[{i}]" if isinstance(value, (list, tuple)) else name
        _single(v, who, label, b)
        try:
            out.append(_floats(v, 1, label, model=b))
        except (TypeError, ValueError) as e:
            raise _reset_error(e, who, b, label) from None
    return out


def _reset_error(e: Exception, who: str, b: int, name: str) -> Exception:
    """The error ``e`` of checking model b's argument ``name`` for ``who`` (a ``reset_model``),
    saying so: prefixed by ``who``, model b and the argument (unless it names ``who`` already)."""
    message = str(e)
    if message.startswith(who):
        return e
    return type(e)(f"{who}: model {b}'s {name}: {message}")


def _with(t: torch.Tensor, b: int, value: torch.Tensor | float) -> torch.Tensor:
    """A copy of ``t`` with model b's entry set to ``value``."""
    out = t.clone()
    out[b] = value
    return out


class _PerModel(_Loadable):
    """Per-model epochs and :meth:`reset_model`, shared by every scheduler."""

    B: int
    _model_args: tuple[str, ...] = ()  # constructor arguments reset_model takes (one model's value)

    @property
    def last_epoch(self) -> int | torch.Tensor:
        """The epoch: an int while every model is at the same epoch, else a copy of the ``[B]`` int64
        tensor of every model's epoch (``last_epochs``). Assigning an int sets every model's epoch,
        a per-model value each model's."""
        return _uniform(self.last_epochs)

    @last_epoch.setter
    def last_epoch(self, value: object) -> None:
        self.last_epochs = _ints(value, self.B, "last_epoch", minimum=None)

    @property
    def _step_count(self) -> int | torch.Tensor:
        return _uniform(self._step_counts)

    @_step_count.setter
    def _step_count(self, value: object) -> None:
        self._step_counts = _ints(value, self.B, "_step_count", minimum=None)

    def reset_model(self, b: int, **kwargs: Any) -> None:
        """Restart model b's schedule as a scheduler built now would start it; the other models go on.

        Model b's base learning rate (``initial_lr``, ``base_lrs``) becomes the
        optimizer's current learning rate of model b (set it first, e.g. with
        ``optimizer.set_hyperparameters(b, lr=...)``; ``CyclicLR`` and
        ``OneCycleLR`` set their own, as their constructors do), its epoch restarts, and
        every per-model state of the scheduler is reset for model b; then model
        b takes the constructor's initial step. ``kwargs`` give model b new values
        of the scheduler's per-model constructor arguments (one value each, checked
        as the constructor checks them; e.g. ``reset_model(2, T_max=50)``); the
        others keep model b's values. The other models' learning rates, epochs and
        state stay bit-identical.

        Raises TypeError for an unknown argument name or a ``b`` that is not an
        int, ValueError for a ``b`` out of [0, B) or a bad value; a reset that
        raises changes nothing.
        """
        who = f"{type(self).__name__}.reset_model"
        b = _model_index(b, self.B, who)
        for s in _nested(self):
            s._check_groups()
        with _kept_on_error(*_nested(self), optimizer=self.optimizer):
            self._restart(b, _Restart(), kwargs)

    def _restart(self, b: int, ctx: _Restart, kwargs: Mapping[str, Any]) -> None:
        raise NotImplementedError

    def _check_groups(self) -> None:
        """Raise where the scheduler cannot go on over the optimizer's param groups (one added
        after it was built); ReduceLROnPlateau goes on over them, as torch's does."""

    def _check_arg_names(self, kwargs: Mapping[str, Any]) -> None:
        unknown = [k for k in kwargs if k not in self._model_args]
        if unknown:
            raise TypeError(
                f"{type(self).__name__}.reset_model: unknown argument(s) {unknown}; the per-model arguments "
                f"of {type(self).__name__} are {list(self._model_args)}"
            )

    def _set_model_args(self, b: int, kwargs: Mapping[str, Any]) -> None:
        """Set model b's values of the per-model constructor arguments in ``kwargs``."""
        who = f"{type(self).__name__}.reset_model"
        self._check_arg_names(kwargs)
        for name, value in kwargs.items():
            try:
                self._set_model_arg(b, name, value)
            except (TypeError, ValueError) as e:
                raise _reset_error(e, who, b, name) from None

    def _set_model_arg(self, b: int, name: str, value: object) -> None:
        """One argument: by default an attribute of that name holding a ``[B]`` tensor, checked as
        the constructor checks it."""
        _single(value, f"{type(self).__name__}.reset_model", name, b)
        one = self._full_spec()[name](value, _OneModel(b), name)
        setattr(self, name, _with(getattr(self, name), b, one[0]))

    def state_dict_of(self, models: Sequence[int] | torch.Tensor) -> dict[str, Any]:
        """The state of the models ``models`` only (model indices; their order is the new one): the
        :meth:`state_dict` of a scheduler of ``len(models)`` models in which model i is model
        ``models[i]`` of this one.

        A scheduler of this class built for those models (on an optimizer holding their
        param-group entries, with their per-model arguments; callables are not part of a
        state) loads it with :meth:`load_state_dict` and goes on as they would here: a sweep
        rebuilds an array around its remaining models so. Raises TypeError or ValueError for
        ``models`` that are not a non-empty sequence of indices in [0, B).
        """
        rows = _model_indices(models, self.B, f"{type(self).__name__}.state_dict_of")
        return self._state_of_models(self.state_dict(), rows)

    def _state_of_models(self, state: dict[str, Any], rows: list[int]) -> dict[str, Any]:
        """``state`` (this scheduler's :meth:`state_dict`) for the models ``rows``."""
        index = torch.tensor(rows, dtype=torch.int64)
        return {k: len(rows) if k == "B" else self._entry_of_models(k, v, rows, index) for k, v in state.items()}

    def _entry_of_models(self, name: str, value: Any, rows: list[int], index: torch.Tensor) -> Any:
        """State entry ``name`` for the models ``rows`` (also as the tensor ``index``): its per-model
        tensors indexed. Classes keeping per-model entries in Python lists select those too."""
        return _models_of(value, index)


# ---- schedulers -----------------------------------------------------------
class LRScheduler(_PerModel, _torch.LRScheduler):
    """Base class of the array schedulers: torch's ``LRScheduler`` with ``[B]`` learning rates.

    Subclasses set their per-model arguments, then call ``super().__init__``,
    which records ``initial_lr`` (``[B]`` float64 CPU) in every param group that
    has none, sets ``base_lrs`` from it and takes the initial step.
    :meth:`_lr_at` computes one ``[B]`` float64 CPU tensor per param group for
    every model at its own epoch (``_At``), and ``_closed_form_at`` the closed
    form of ``step(epoch)`` where the scheduler has one.
    """

    _is_initial: bool = False
    _spec = _BASE_SPEC
    _closed_form_at: Callable[[_At], list[torch.Tensor]] | None = None
    # Whether the chained update (step() without an epoch) reads only the param groups' current
    # learning rates, nothing kept per group, so that it goes on over a param group added after the
    # scheduler was built, as torch's does (StepLR, ExponentialLR...). Every other update raises
    # there (_check_groups).
    _chains_added_groups = False

    def __init__(self, optimizer: Optimizer, last_epoch: _Epochs = -1) -> None:
        self.B = _array_size(optimizer, type(self).__name__)
        self.optimizer = optimizer
        epochs = _epochs(last_epoch, self.B)
        _require_initial_lr(optimizer, epochs)
        with _kept_on_error(optimizer=optimizer):
            for group in optimizer.param_groups:
                if "initial_lr" not in group:  # only when every model starts afresh
                    group["initial_lr"] = _current_lr(optimizer, group, self.B).clone()
            self.base_lrs: list[torch.Tensor] = [
                _read(group["initial_lr"], self.B, f"param_groups[{i}]['initial_lr']").clone()
                for i, group in enumerate(optimizer.param_groups)
            ]
            self.last_epochs = epochs
            self._initial_step()

    def _initial_step(self, models: torch.Tensor | None = None) -> None:
        """The constructor's step, for every model or for ``models`` ([B] bool) only."""
        counts = self.__dict__.get("_step_counts")
        if models is None or counts is None:
            self._step_counts = torch.zeros(self.B, dtype=torch.int64)
        else:
            self._step_counts = torch.where(models, 0, counts)
        self._is_initial = True
        try:
            self._step_models(models)
        finally:
            self._is_initial = False

    def _start(self, models: torch.Tensor, ctx: _Restart) -> None:
        """Start ``models`` afresh, as a constructor with ``last_epoch=-1`` starts every model on an
        optimizer without ``initial_lr`` (set by the first scheduler of a restart, ``ctx``)."""
        self._check_groups()
        groups = self.optimizer.param_groups
        if not ctx.initial_lr_set:
            for i, group in enumerate(groups):
                current = _current_lr(self.optimizer, group, self.B)
                old = group.get("initial_lr")
                old = current if old is None else _read(old, self.B, f"param_groups[{i}]['initial_lr']")
                group["initial_lr"] = torch.where(models, current, old)
            ctx.initial_lr_set = True
        self.base_lrs = [
            torch.where(models, _read(group["initial_lr"], self.B, f"param_groups[{i}]['initial_lr']"), base)
            for i, (group, base) in enumerate(zip(groups, self.base_lrs, strict=True))
        ]
        self.last_epochs = torch.where(models, -1, self.last_epochs)
        self._initial_step(models)

    def _restart(self, b: int, ctx: _Restart, kwargs: Mapping[str, Any]) -> None:
        self._set_model_args(b, kwargs)
        self._start(_one_hot(b, self.B), ctx)

    def _lrs(self) -> list[torch.Tensor]:
        """The optimizer's current learning rates, one ``[B]`` float64 host tensor per group."""
        return [_current_lr(self.optimizer, g, self.B) for g in self.optimizer.param_groups]

    def _at(self, models: torch.Tensor | None = None) -> _At:
        initial = None
        if self._is_initial:
            initial = torch.ones(self.B, dtype=torch.bool) if models is None else models
        return _At(self.last_epochs, models, initial)

    def get_lr(self) -> list[torch.Tensor]:
        """The learning rates at every model's ``last_epoch``: one ``[B]`` float64 tensor per group."""
        return self._lr_at(self._at())

    def _lr_at(self, at: _At) -> list[torch.Tensor]:
        """The chained update at ``at``: one ``[B]`` float64 tensor per group (of which only the
        models ``at.only`` updates are used)."""
        if type(self).get_lr is LRScheduler.get_lr:
            raise NotImplementedError(f"{type(self).__name__} implements neither _lr_at nor get_lr")
        return self.get_lr()  # a subclass written the torch way (one epoch for every model)

    def get_last_lr(self) -> list[torch.Tensor]:
        """The learning rates the last step set: one ``[B]`` float64 CPU tensor per param group."""
        return self._last_lr

    @host_step
    def step(self, epoch: _Epochs | None = None) -> None:
        """Advance every model's schedule by one step (call after ``optimizer.step()``).

        ``epoch`` (deprecated, as in torch, which warns) sets each model's epoch:
        one int for every model, or one per model (a length-B sequence of ints,
        or a 1-D integer tensor or numpy array of length B). Model b's learning
        rate is then what torch's scheduler gives after ``step(epoch[b])``: the
        closed form at its epoch where the scheduler has one, else the chained
        update there. A bad ``epoch`` raises (TypeError for a non-integer,
        ValueError for a length other than B) before anything changes, and so
        does any step that raises.
        """
        # (stacklevel 3: the caller's line, past host_step's wrapper)
        if getattr(self.optimizer, "_opt_called", None) is False and bool((self._step_counts == 1).any()):
            warnings.warn(_STEP_ORDER_WARNING, UserWarning, stacklevel=3)
        if epoch is not None:
            epoch = _step_epochs(epoch, self.B, f"{type(self).__name__}.step")
            warnings.warn(_EPOCH_DEPRECATION_WARNING, UserWarning, stacklevel=3)
        self._step_models(None, epoch)

    def _step_models(self, models: torch.Tensor | None = None, epoch: _Epochs | None = None) -> None:
        """``step(epoch)`` for every model, or for ``models`` ([B] bool) only."""
        with _kept_on_error(self):
            counts = self._step_counts + 1
            self._step_counts = counts if models is None else torch.where(models, counts, self._step_counts)
            self._update_lr(epoch, models)

    def _update_lr(self, epoch: _Epochs | None = None, models: torch.Tensor | None = None) -> None:
        closed_form = epoch is not None and self._closed_form_at is not None
        if closed_form or not self._chains_added_groups:
            self._check_groups()
        with _kept_on_error(self):
            old = self.last_epochs
            new = old + 1 if epoch is None else _step_epochs(epoch, self.B, f"{type(self).__name__}.step")
            self.last_epochs = new if models is None else torch.where(models, new, old)
            at = self._at(models)
            if closed_form:
                values = self._closed_form_at(at)
            else:
                values = self._lr_at(at)
            self._write(values, models)

    def _check_groups(self) -> None:
        """Raise, before anything changes, where the optimizer has another number of param groups
        than the scheduler keeps values for (``base_lrs``, one per group when it was built; a
        SequentialLR's or ChainedScheduler's schedulers keep them)."""
        base_lrs = self.__dict__.get("base_lrs")
        if base_lrs is None:
            return
        n, kept = len(self.optimizer.param_groups), len(base_lrs)
        if n != kept:
            raise ValueError(
                f"{type(self).__name__}: the optimizer has {n} param groups, the scheduler keeps values "
                f"for {kept} (was a group added after the scheduler?); build the scheduler after adding "
                f"every param group"
            )

    def _get_closed_form_lr(self) -> list[torch.Tensor]:
        """The closed form at every model's ``last_epoch`` (schedulers that have one)."""
        if self._closed_form_at is None:
            raise AttributeError(f"{type(self).__name__} has no closed form")
        return self._closed_form_at(self._at())

    def _write(self, values: Sequence[torch.Tensor], models: torch.Tensor | None = None) -> None:
        """Set the computed learning rates of every model, or of ``models`` only (the only write
        of a step, after everything is computed)."""
        groups = self.optimizer.param_groups
        if len(values) != len(groups):
            raise ValueError(
                f"{type(self).__name__}: computed {len(values)} learning rates for "
                f"{len(groups)} param groups (was a group added after the scheduler?)"
            )
        for group, v in zip(groups, values):
            if models is not None:
                v = torch.where(models, v, _current_lr(self.optimizer, group, self.B))
            _set_lr(self.optimizer, group, v, self.B)
        last = self.__dict__.get("_last_lr")
        if models is None or last is None or len(last) != len(groups):
            self._last_lr = [v.clone() for v in self._lrs()]
        else:
            self._last_lr = [torch.where(models, v, old) for v, old in zip(self._lrs(), last)]


def _require_initial_lr(optimizer: Optimizer, epochs: torch.Tensor) -> None:
    """A model resuming at last_epoch >= 0 needs initial_lr, as torch's does."""
    resuming = epochs >= 0
    if not resuming.any():
        return
    for i, group in enumerate(optimizer.param_groups):
        if "initial_lr" not in group:
            raise KeyError(
                f"param 'initial_lr' is not specified in param_groups[{i}] when resuming a scheduler with "
                f"last_epoch >= 0 (models {resuming.nonzero().flatten().tolist()} of last_epoch {epochs.tolist()})"
            )


class StepLR(LRScheduler):
    """Decay each model's learning rate by ``gamma`` every ``step_size`` epochs.

    Args:
        optimizer: array optimizer with ``[B]`` learning rates.
        step_size: period of decay, int >= 1, per model.
        gamma: multiplicative decay, per model. Default 0.1.
        last_epoch: index of the last epoch, one int or one per model; -1 starts the schedule.
    """

    _chains_added_groups = True
    _spec = {"step_size": _spec_ints(1), "gamma": _spec_floats()}
    _model_args = ("step_size", "gamma")

    def __init__(self, optimizer: Optimizer, step_size: int | Sequence[int] | torch.Tensor,
                 gamma: float | Sequence[float] | torch.Tensor = 0.1, last_epoch: _Epochs = -1) -> None:
        self.B = _array_size(optimizer, "StepLR")
        self.step_size = self._arg("step_size", step_size)
        self.gamma = self._arg("gamma", gamma)
        super().__init__(optimizer, last_epoch)

    def _lr_at(self, at: _At) -> list[torch.Tensor]:
        e = at.epoch
        decay = (e != 0) & (torch.remainder(e, self.step_size) == 0)
        return [torch.where(decay, lr * self.gamma, lr) for lr in self._lrs()]

    def _closed_form_at(self, at: _At) -> list[torch.Tensor]:
        n = torch.div(at.epoch, self.step_size, rounding_mode="floor")
        return [base * self.gamma ** n for base in self.base_lrs]


class MultiStepLR(LRScheduler):
    """Decay each model's learning rate by ``gamma`` at each of its milestones.

    Args:
        optimizer: array optimizer with ``[B]`` learning rates.
        milestones: one list of epochs for every model, or one list per model
            (B lists, of any lengths). An epoch listed n times decays by gamma**n.
        gamma: multiplicative decay, per model. Default 0.1.
        last_epoch: index of the last epoch, one int or one per model; -1 starts the schedule.
    """

    _chains_added_groups = True
    _spec = {"milestones": _spec_milestones, "gamma": _spec_floats()}
    _model_args = ("milestones", "gamma")

    def __init__(self, optimizer: Optimizer, milestones: Iterable[int] | Sequence[Iterable[int]],
                 gamma: float | Sequence[float] | torch.Tensor = 0.1, last_epoch: _Epochs = -1) -> None:
        self.B = _array_size(optimizer, "MultiStepLR")
        self.milestones = _milestones(milestones, self.B)
        self.gamma = self._arg("gamma", gamma)
        super().__init__(optimizer, last_epoch)

    def _set_model_arg(self, b: int, name: str, value: object) -> None:
        if name != "milestones":
            return super()._set_model_arg(b, name, value)
        if isinstance(value, (str, bytes)) or not isinstance(value, Iterable) or any(
                isinstance(v, Iterable) and not isinstance(v, (str, bytes)) for v in list(value)):
            raise TypeError(f"milestones must be one list of ints (model {b}'s), got {value!r}")
        milestones = list(self.milestones)
        milestones[b] = _milestones(value, 1)[0]
        self.milestones = milestones

    def _entry_of_models(self, name: str, value: Any, rows: list[int], index: torch.Tensor) -> Any:
        if name == "milestones":  # one Counter per model
            return [value[b] for b in rows]
        return _models_of(value, index)

    def _lr_at(self, at: _At) -> list[torch.Tensor]:
        counts = torch.tensor([m[e] for m, e in zip(self.milestones, at.epoch.tolist())], dtype=_F64)
        return [torch.where(counts > 0, lr * self.gamma ** counts, lr) for lr in self._lrs()]

    def _closed_form_at(self, at: _At) -> list[torch.Tensor]:
        n = torch.tensor(
            [bisect_right(sorted(m.elements()), e) for m, e in zip(self.milestones, at.epoch.tolist())],
            dtype=_F64,
        )
        return [base * self.gamma ** n for base in self.base_lrs]


class ConstantLR(LRScheduler):
    """Scale each model's learning rate by ``factor`` until its ``total_iters`` is reached.

    Args:
        optimizer: array optimizer with ``[B]`` learning rates.
        factor: in [0, 1], per model. Default 1/3. At ``total_iters`` the scale is
            undone by multiplying with ``1 / factor`` (a factor of 0 then raises
            ZeroDivisionError, as torch does).
        total_iters: epochs of the scaled phase, int >= 0, per model. Default 5.
        last_epoch: index of the last epoch, one int or one per model; -1 starts the schedule.
    """

    _chains_added_groups = True
    _spec = {"factor": _spec_floats(0.0, 1.0), "total_iters": _spec_ints(0)}
    _model_args = ("factor", "total_iters")

    def __init__(self, optimizer: Optimizer, factor: float | Sequence[float] | torch.Tensor = 1.0 / 3,
                 total_iters: int | Sequence[int] | torch.Tensor = 5, last_epoch: _Epochs = -1) -> None:
        self.B = _array_size(optimizer, "ConstantLR")
        self.factor = self._arg("factor", factor)
        self.total_iters = self._arg("total_iters", total_iters)
        super().__init__(optimizer, last_epoch)

    def _lr_at(self, at: _At) -> list[torch.Tensor]:
        e = at.epoch
        start = e == 0
        end = ~start & (self.total_iters == e)
        undo = end & (self.factor == 0)
        if at.only is not None:
            undo &= at.only
        if undo.any():
            raise ZeroDivisionError(
                f"ConstantLR: models {undo.nonzero().flatten().tolist()} reach total_iters at epochs "
                f"{e[undo].tolist()} with factor 0, and undoing the factor divides by it"
            )
        # torch multiplies by 1.0 / factor; the division's rounding is part of the schedule.
        inverse = 1.0 / torch.where(end, self.factor, torch.ones_like(self.factor))
        return [torch.where(start, lr * self.factor, torch.where(end, lr * inverse, lr)) for lr in self._lrs()]

    def _closed_form_at(self, at: _At) -> list[torch.Tensor]:
        done = (self.total_iters <= at.epoch).to(_F64)
        return [base * (self.factor + done * (1 - self.factor)) for base in self.base_lrs]


class LinearLR(LRScheduler):
    """Scale each model's learning rate by a factor moving linearly from ``start_factor`` to ``end_factor``.

    Args:
        optimizer: array optimizer with ``[B]`` learning rates.
        start_factor: factor at epoch 0, in (0, 1], per model. Default 1/3.
        end_factor: factor from ``total_iters`` on, in [0, 1], per model. Default 1.
        total_iters: epochs of the ramp, int >= 1, per model. Default 5.
        last_epoch: index of the last epoch, one int or one per model; -1 starts the schedule.
    """

    _chains_added_groups = True
    _spec = {"start_factor": _spec_floats(0.0, 1.0, lo_open=True), "end_factor": _spec_floats(0.0, 1.0),
             "total_iters": _spec_ints(1)}
    _model_args = ("start_factor", "end_factor", "total_iters")

    def __init__(self, optimizer: Optimizer, start_factor: float | Sequence[float] | torch.Tensor = 1.0 / 3,
                 end_factor: float | Sequence[float] | torch.Tensor = 1.0,
                 total_iters: int | Sequence[int] | torch.Tensor = 5, last_epoch: _Epochs = -1) -> None:
        self.B = _array_size(optimizer, "LinearLR")
        self.start_factor = self._arg("start_factor", start_factor)
        self.end_factor = self._arg("end_factor", end_factor)
        self.total_iters = self._arg("total_iters", total_iters)
        super().__init__(optimizer, last_epoch)

    def _lr_at(self, at: _At) -> list[torch.Tensor]:
        s, t = self.start_factor, self.end_factor
        factor = 1.0 + (t - s) / (self.total_iters.to(_F64) * s + (at.e - 1) * (t - s))
        ramping = self.total_iters >= at.epoch
        start = at.epoch == 0
        return [torch.where(start, lr * s, at.unless_initial(lr, torch.where(ramping, lr * factor, lr)))
                for lr in self._lrs()]

    def _closed_form_at(self, at: _At) -> list[torch.Tensor]:
        s, t, n = self.start_factor, self.end_factor, self.total_iters
        done = torch.minimum(n, at.epoch).to(_F64)
        return [base * (s + (t - s) * done / n.to(_F64)) for base in self.base_lrs]


class ExponentialLR(LRScheduler):
    """Decay each model's learning rate by ``gamma`` (per model) every epoch."""

    _chains_added_groups = True
    _spec = {"gamma": _spec_floats()}
    _model_args = ("gamma",)

    def __init__(self, optimizer: Optimizer, gamma: float | Sequence[float] | torch.Tensor,
                 last_epoch: _Epochs = -1) -> None:
        self.B = _array_size(optimizer, "ExponentialLR")
        self.gamma = self._arg("gamma", gamma)
        super().__init__(optimizer, last_epoch)

    def _lr_at(self, at: _At) -> list[torch.Tensor]:
        return [at.unless_initial(lr, lr * self.gamma) for lr in self._lrs()]

    def _closed_form_at(self, at: _At) -> list[torch.Tensor]:
        return [base * self.gamma ** at.epoch for base in self.base_lrs]


class PolynomialLR(LRScheduler):
    """Decay each model's learning rate polynomially to 0 over its ``total_iters`` epochs.

    Model b's learning rate at epoch e is ``base_lr * (1 - min(e, T) / T) ** power``
    (reached by torch's chained update).

    Args:
        optimizer: array optimizer with ``[B]`` learning rates.
        total_iters: T, epochs of the decay, int >= 1, per model. Default 5.
        power: the polynomial's power, >= 0, per model. Default 1.
        last_epoch: index of the last epoch, one int or one per model; -1 starts the schedule.
    """

    _chains_added_groups = True
    _spec = {"total_iters": _spec_ints(1), "power": _spec_floats()}
    _model_args = ("total_iters", "power")

    def __init__(self, optimizer: Optimizer, total_iters: int | Sequence[int] | torch.Tensor = 5,
                 power: float | Sequence[float] | torch.Tensor = 1.0, last_epoch: _Epochs = -1) -> None:
        self.B = _array_size(optimizer, "PolynomialLR")
        self.total_iters = self._arg("total_iters", total_iters)
        self.power = self._arg("power", power)
        super().__init__(optimizer, last_epoch)

    def _lr_at(self, at: _At) -> list[torch.Tensor]:
        e, T = at.e, self.total_iters.to(_F64)
        decay = ((1.0 - e / T) / (1.0 - (e - 1) / T)) ** self.power
        decaying = self.total_iters >= at.epoch
        return [at.unless_initial(lr, torch.where(decaying, lr * decay, lr)) for lr in self._lrs()]

    def _closed_form_at(self, at: _At) -> list[torch.Tensor]:
        T = self.total_iters.to(_F64)
        done = torch.minimum(self.total_iters, at.epoch).to(_F64)
        return [base * (1.0 - done / T) ** self.power for base in self.base_lrs]


class CosineAnnealingLR(LRScheduler):
    """Cosine annealing of each model's learning rate from its base to ``eta_min`` over ``T_max`` epochs.

    Chained (recursive) update as in torch, which keeps following the cosine
    past ``T_max`` (back up to the base lr at ``2 * T_max``).

    Args:
        optimizer: array optimizer with ``[B]`` learning rates.
        T_max: half period in epochs, int >= 1, per model.
        eta_min: minimum learning rate, per model. Default 0.
        last_epoch: index of the last epoch, one int or one per model; -1 starts the schedule.
    """

    _spec = {"T_max": _spec_ints(1), "eta_min": _spec_floats()}
    _model_args = ("T_max", "eta_min")

    def __init__(self, optimizer: Optimizer, T_max: int | Sequence[int] | torch.Tensor,
                 eta_min: float | Sequence[float] | torch.Tensor = 0.0, last_epoch: _Epochs = -1) -> None:
        self.B = _array_size(optimizer, "CosineAnnealingLR")
        self.T_max = self._arg("T_max", T_max)
        self.eta_min = self._arg("eta_min", eta_min)
        super().__init__(optimizer, last_epoch)

    def _lr_at(self, at: _At) -> list[torch.Tensor]:
        e, eta, T = at.e, self.eta_min, self.T_max.to(_F64)
        # torch's closed form for an update before the first step() after a (resuming) start:
        # only where _update_lr is called without step().
        first = self._step_counts == 1
        resumed = first & (at.epoch > 0) if first.any() else None
        cos = torch.cos(e * math.pi / T) if resumed is not None else None
        # At the bottom of the cosine the ratio below is 0/0; torch steps up by the closed-form increment.
        bottom = torch.remainder(at.epoch - 1 - self.T_max, 2 * self.T_max) == 0
        rise = (1 - torch.cos(math.pi / T))
        ratio = (1 + torch.cos(math.pi * e / T)) / (1 + torch.cos(math.pi * (e - 1) / T))
        out = []
        for lr, base in zip(self._lrs(), self.base_lrs, strict=True):
            value = torch.where(bottom, lr + (base - eta) * rise / 2, ratio * (lr - eta) + eta)
            if resumed is not None:
                value = torch.where(resumed, eta + (base - eta) * (1 + cos) / 2, value)
            out.append(at.unless_initial(lr, value))
        return out

    def _closed_form_at(self, at: _At) -> list[torch.Tensor]:
        cos = torch.cos(math.pi * at.e / self.T_max.to(_F64))
        return [self.eta_min + (base - self.eta_min) * (1 + cos) / 2 for base in self.base_lrs]


class CosineAnnealingWarmRestarts(LRScheduler):
    """Cosine annealing with warm restarts (SGDR), per model.

    Model b's learning rate is ``eta_min + (base_lr - eta_min) * (1 + cos(pi *
    T_cur / T_i)) / 2``, where ``T_cur`` counts the epochs since its last
    restart and ``T_i``, the length of its current period, starts at ``T_0``
    and is multiplied by ``T_mult`` at each restart. ``T_cur`` and ``T_i`` are
    ``[B]`` tensors (float64 and int64). As torch's, ``step(epoch)`` may be
    given a (fractional) epoch, computed in closed form, and is not deprecated.

    Args:
        optimizer: array optimizer with ``[B]`` learning rates.
        T_0: epochs until the first restart, int >= 1, per model.
        T_mult: factor by which the period grows at each restart, int >= 1, per model. Default 1.
        eta_min: minimum learning rate, per model. Default 0.
        last_epoch: index of the last epoch, one int or one per model; -1 starts the schedule.
    """

    _spec = {"T_0": _spec_ints(1), "T_i": _spec_ints(1), "T_mult": _spec_ints(1), "eta_min": _spec_floats(),
             "T_cur": _spec_any_floats()}
    _model_args = ("T_0", "T_mult", "eta_min")

    def __init__(self, optimizer: Optimizer, T_0: int | Sequence[int] | torch.Tensor,
                 T_mult: int | Sequence[int] | torch.Tensor = 1,
                 eta_min: float | Sequence[float] | torch.Tensor = 0.0, last_epoch: _Epochs = -1) -> None:
        self.B = _array_size(optimizer, "CosineAnnealingWarmRestarts")
        self.T_0 = self._arg("T_0", T_0)
        self.T_i = self.T_0.clone()
        self.T_mult = self._arg("T_mult", T_mult)
        self.eta_min = self._arg("eta_min", eta_min)
        self.T_cur = _epochs(last_epoch, self.B).to(_F64)
        super().__init__(optimizer, last_epoch)

    def _lr_at(self, at: _At) -> list[torch.Tensor]:
        cos = torch.cos(math.pi * self.T_cur / self.T_i.to(_F64))
        return [self.eta_min + (base - self.eta_min) * (1 + cos) / 2 for base in self.base_lrs]

    @host_step
    def step(self, epoch: float | Sequence[float] | torch.Tensor | None = None) -> None:
        """Advance every model by one epoch, or (``epoch`` given) set each model to its epoch, in
        closed form.

        ``epoch`` is one number for every model or one per model (a length-B
        sequence, or a 1-D tensor or numpy array of length B); it may be
        fractional (e.g. ``epoch + i / iters`` within an epoch), as in torch,
        which neither deprecates nor warns here. Model b then follows torch's
        ``step(epoch[b])``. A negative, NaN or infinite epoch, or a length other
        than B, raises a ValueError, a non-real one a TypeError, before anything
        changes; a step that raises changes nothing.
        """
        if epoch is not None:
            epoch = _fractional_epochs(epoch, self.B, "CosineAnnealingWarmRestarts.step")
        self._step_models(None, epoch)

    def _step_models(self, models: torch.Tensor | None = None,
                     epoch: float | Sequence[float] | torch.Tensor | None = None) -> None:
        self._check_groups()
        with _kept_on_error(self):
            e = self.last_epochs
            if epoch is None:
                # A model not started yet (last_epoch -1: built, or restarted by reset_model) goes to
                # epoch 0, torch's closed form there (T_cur 0, T_i = T_0); ``advance`` (None: every
                # model) are the others that step.
                start = e < 0
                if models is not None:
                    start &= models
                advance = models
                if start.any():
                    advance = ~start if advance is None else advance & ~start
                T_cur = self.T_cur + 1
                restart = T_cur >= self.T_i
                if advance is not None:
                    restart &= advance
                T_cur = torch.where(restart, torch.remainder(T_cur, self.T_i.to(_F64)), T_cur)
                T_i = torch.where(restart, self.T_i * self.T_mult, self.T_i)
                epochs = e + 1
                if advance is not None:
                    T_cur = torch.where(start, 0.0, torch.where(advance, T_cur, self.T_cur))
                    T_i = torch.where(start, self.T_0, T_i)
                    epochs = torch.where(start, 0, torch.where(advance, epochs, e))
                self.T_cur, self.T_i, self.last_epochs = T_cur, T_i, epochs
            else:
                chosen = torch.ones(self.B, dtype=torch.bool) if models is None else models
                epochs = _fractional_epochs(epoch, self.B, "CosineAnnealingWarmRestarts.step")
                T_cur, T_i = [], []
                for epoch, T_0, T_mult in zip(epochs.tolist(), self.T_0.tolist(), self.T_mult.tolist()):
                    # torch's closed form with Python numbers, for each model's own epoch, T_0 and T_mult.
                    if epoch >= T_0:
                        if T_mult == 1:
                            T_cur.append(epoch % T_0)
                            T_i.append(T_0)
                        else:
                            n = int(math.log((epoch / T_0 * (T_mult - 1) + 1), T_mult))
                            T_cur.append(epoch - T_0 * (T_mult ** n - 1) / (T_mult - 1))
                            T_i.append(T_0 * T_mult ** n)
                    else:
                        T_cur.append(epoch)
                        T_i.append(T_0)
                T_cur = torch.tensor([float(t) for t in T_cur], dtype=_F64)
                self.T_cur = torch.where(chosen, T_cur, self.T_cur)
                self.T_i = torch.where(chosen, torch.tensor(T_i, dtype=torch.int64), self.T_i)
                self.last_epochs = torch.where(chosen, torch.floor(epochs).to(torch.int64), e)
            self._write(self._lr_at(self._at(models)), models)


class LambdaLR(LRScheduler):
    """Each model's learning rate is its initial lr times ``lr_lambda(epoch)``.

    ``lr_lambda`` is one of:

    - a callable shared by all models and groups; it returns a number, or one
      factor per model (a length-B sequence, ``[B]`` tensor or numpy array);
    - a list of B callables, one per model (every group);
    - one entry per param group, each a callable or a list of B callables
      (recognized by a list inside the list, e.g. ``[[f0, f1, f2], g]``).

    A factor that is negative or NaN raises a ValueError naming the models,
    before anything changes (the optimizers reject such learning rates).
    As in torch, ``state_dict`` saves the ``__dict__`` of callable objects but
    not plain functions or lambdas.
    """

    _spec = {"lr_lambdas": _spec_callables("lr_lambdas")}
    _model_args = ("lr_lambda",)

    def __init__(self, optimizer: Optimizer, lr_lambda: Callable | Sequence, last_epoch: _Epochs = -1) -> None:
        self.B = _array_size(optimizer, "LambdaLR")
        self.lr_lambdas = _lambdas(lr_lambda, len(optimizer.param_groups), self.B)
        super().__init__(optimizer, last_epoch)

    def _lr_at(self, at: _At) -> list[torch.Tensor]:
        return [
            base * _lambda_factors(fns, at, at.only, self.B, "LambdaLR", g)
            for g, (fns, base) in enumerate(zip(self.lr_lambdas, self.base_lrs, strict=True))
        ]

    def _set_model_arg(self, b: int, name: str, value: object) -> None:
        """``lr_lambda``: model b's callable for every param group, or a list of one per group; each
        group must hold one callable per model (a shared one may return every model's factor)."""
        n = len(self.optimizer.param_groups)
        if callable(value):
            fns = [value] * n
        elif isinstance(value, (list, tuple)) and len(value) == n and all(callable(f) for f in value):
            fns = list(value)
        else:
            raise TypeError(
                f"{name} must be a callable (model {b}'s) or one callable per param group ({n}), got {value!r}"
            )
        new = []
        for g, (current, f) in enumerate(zip(self.lr_lambdas, fns, strict=True)):
            if not isinstance(current, list):
                raise TypeError(
                    f"{name}: param group {g} has one lr_lambda shared by every model; to give model {b} "
                    f"its own, build the scheduler with a list of B={self.B} callables"
                )
            new.append(current[:b] + [f] + current[b + 1:])
        self.lr_lambdas = new

    def state_dict(self) -> dict[str, Any]:
        """Every attribute but the optimizer; of the callables, torch's choice: the ``__dict__``
        of callable objects, None for plain functions and lambdas."""
        state = self._state_entries(skip=("lr_lambdas",))
        state["lr_lambdas"] = _saved_callables(self.lr_lambdas)
        return state

    def _apply_state(self, new: dict[str, Any]) -> None:
        saved = new.pop("lr_lambdas")
        self._store(new)
        _restore_callables(self.lr_lambdas, saved)

    def _entry_of_models(self, name: str, value: Any, rows: list[int], index: torch.Tensor) -> Any:
        if name == "lr_lambdas":  # per group: what is saved of one callable per model, or of a shared one
            return [_callables_of(fns, saved, rows) for fns, saved in zip(self.lr_lambdas, value, strict=True)]
        return _models_of(value, index)


def _callables_of(fns: Any, saved: Any, rows: list[int]) -> Any:
    """The saved state of callables ``fns`` (one per model: a list; else shared) for the models ``rows``."""
    return [saved[b] for b in rows] if isinstance(fns, list) else saved


def _lambdas(lr_lambda: object, n_groups: int, B: int, name: str = "lr_lambda") -> list[Callable | list[Callable]]:
    def per_model(value: object, where: str) -> Callable | list[Callable]:
        if callable(value):
            return value
        if isinstance(value, (list, tuple)):
            if len(value) != B:
                raise ValueError(f"{where}: expected one callable per model (B={B}), got {len(value)}")
            for f in value:
                if not callable(f):
                    raise TypeError(f"{where}: expected callables, got {type(f).__name__}")
            return list(value)
        raise TypeError(
            f"{where}: expected a callable or a list of B={B} callables, got {type(value).__name__}"
        )

    if callable(lr_lambda):
        return [lr_lambda] * n_groups
    if not isinstance(lr_lambda, (list, tuple)):
        raise TypeError(f"{name}: expected a callable or a list, got {type(lr_lambda).__name__}")
    if any(isinstance(f, (list, tuple)) for f in lr_lambda):
        if len(lr_lambda) != n_groups:
            raise ValueError(
                f"{name}: expected one entry per param group ({n_groups}), got {len(lr_lambda)}"
            )
        return [per_model(f, f"{name}[{i}]") for i, f in enumerate(lr_lambda)]
    _check_flat_list(lr_lambda, n_groups, B, name, "callables", "[[f0] * B, [f1] * B]")
    fns = per_model(list(lr_lambda), name)
    return [fns] * n_groups


def _lambda_factors(fns: Callable | list[Callable], at: _At, models: torch.Tensor | None, B: int, who: str,
                    group: int) -> torch.Tensor:
    """The lr_lambda factors of ``models`` (None: every model) at their epochs, checked (the others get 1)."""
    t = _call_per_model(fns, at.epoch, models, B, f"{who}: lr_lambda")
    return _check_factors(t, who, at.epoch, group, models)


class MultiplicativeLR(LRScheduler):
    """Multiply each model's learning rate by ``lr_lambda(epoch)`` every epoch (after the first).

    ``lr_lambda`` takes the forms :class:`LambdaLR` takes (shared, one per
    model, or one entry per param group). A negative or NaN factor raises a
    ValueError naming the models, before anything changes.
    """

    _spec = {"lr_lambdas": _spec_callables("lr_lambdas")}
    _model_args = ("lr_lambda",)

    def __init__(self, optimizer: Optimizer, lr_lambda: Callable | Sequence, last_epoch: _Epochs = -1) -> None:
        self.B = _array_size(optimizer, "MultiplicativeLR")
        self.lr_lambdas = _lambdas(lr_lambda, len(optimizer.param_groups), self.B)
        super().__init__(optimizer, last_epoch)

    def _lr_at(self, at: _At) -> list[torch.Tensor]:
        if at.initial is not None:  # the models of an initial step keep their learning rate (no factor)
            return self._lrs()
        return [
            lr * _lambda_factors(fns, at, at.only, self.B, "MultiplicativeLR", g)
            for g, (fns, lr) in enumerate(zip(self.lr_lambdas, self._lrs(), strict=True))
        ]

    _set_model_arg = LambdaLR._set_model_arg
    state_dict = LambdaLR.state_dict
    _apply_state = LambdaLR._apply_state
    _entry_of_models = LambdaLR._entry_of_models


def _check_cycled_momentum(optimizer: Optimizer, who: str, use_beta1: bool, max_ms: list[torch.Tensor],
                           base_ms: list[torch.Tensor]) -> None:
    """Momentum set to 0 for every model of a group switches an array optimizer's momentum
    off for that group, and values written in place later cannot switch it back on."""
    if use_beta1 or not isinstance(optimizer, ArrayOptimizer):
        return
    for g, (m, b) in enumerate(zip(max_ms, base_ms)):
        if not (m != 0).any() and (b != 0).any():
            raise ValueError(
                f"{who}: max_momentum is 0 for every model of param group {g} while base_momentum is "
                f"not ({b.tolist()}); the optimizer starts from max_momentum and would keep momentum off "
                f"for the group. Give some model a non-zero max_momentum"
            )


def _require_momentum(optimizer: object, cycle_momentum: object, message: str) -> None:
    """Cycling momentum needs an optimizer with ``momentum`` or ``betas`` (a ValueError with
    ``message``); checked before anything else of the optimizer, its array size included."""
    if cycle_momentum is True and isinstance(optimizer, Optimizer) \
            and "momentum" not in optimizer.defaults and "betas" not in optimizer.defaults:
        raise ValueError(message)


def _put(group: dict, key: str, values: torch.Tensor, models: torch.Tensor, B: int) -> None:
    """Set ``models``' entries of the per-model param-group entry ``key`` (a new ``[B]`` float64 tensor,
    never one the scheduler keeps: editing the entry in place must not change the schedule)."""
    if key not in group or bool(models.all()):
        group[key] = values.clone()
    else:
        group[key] = torch.where(models, values, _read(group[key], B, key))


def _require_entries(groups: list[dict], keys: Iterable[str], epochs: torch.Tensor) -> None:
    """A model resuming at last_epoch >= 0 reads these entries from the param groups, as torch's does."""
    resuming = epochs >= 0
    if not resuming.any():
        return
    for i, group in enumerate(groups):
        for key in keys:
            if key not in group:
                raise KeyError(
                    f"param {key!r} is not specified in param_groups[{i}] when resuming a scheduler with "
                    f"last_epoch >= 0 (models {resuming.nonzero().flatten().tolist()})"
                )


def _new_momentum(group: dict, values: torch.Tensor, fresh: torch.Tensor, B: int, use_beta1: bool) -> None:
    """The constructor's momentum for the ``fresh`` models: a new object, not an in-place write, so
    that the optimizer re-validates it (which matters when it had every model's momentum at zero)."""
    if not bool(fresh.all()):
        current = group["betas"][0] if use_beta1 else group["momentum"]
        values = torch.where(fresh, values, hyper(current, B, "momentum"))
    if use_beta1:
        group["betas"] = (values.clone(), *group["betas"][1:])
    else:
        group["momentum"] = values.clone()


def _one_cycle_phases(pct: torch.Tensor, total_steps: torch.Tensor, three_phase: bool) -> list[dict[str, Any]]:
    total = total_steps.to(_F64)
    if three_phase:
        return [
            dict(end_step=pct * total - 1, start_lr="initial_lr", end_lr="max_lr",
                 start_momentum="max_momentum", end_momentum="base_momentum"),
            dict(end_step=2 * pct * total - 2, start_lr="max_lr", end_lr="initial_lr",
                 start_momentum="base_momentum", end_momentum="max_momentum"),
            dict(end_step=total - 1, start_lr="initial_lr", end_lr="min_lr",
                 start_momentum="max_momentum", end_momentum="max_momentum"),
        ]
    return [
        dict(end_step=pct * total - 1, start_lr="initial_lr", end_lr="max_lr",
             start_momentum="max_momentum", end_momentum="base_momentum"),
        dict(end_step=total - 1, start_lr="max_lr", end_lr="min_lr",
             start_momentum="base_momentum", end_momentum="max_momentum"),
    ]


class OneCycleLR(LRScheduler):
    """The 1cycle policy per model: warm up to ``max_lr``, then anneal far below the start.

    Every numeric argument may be per model, so models may differ in
    ``total_steps`` too; stepping past any model's ``total_steps`` raises, as
    torch does for that model. ``max_lr``, ``base_momentum`` and
    ``max_momentum`` may also be given per param group as a list of per-model
    values (e.g. ``[[0.1, 0.2, 0.3], 0.05]``). With ``cycle_momentum`` the
    optimizer's ``momentum`` (or ``betas[0]``) is cycled inversely, written in
    place like the learning rate (a second small copy per group and step); the
    constructor sets it anew, so the optimizer re-validates it at its next step.

    As torch's, the schedule ignores the optimizer's learning rate: a model's
    start is ``max_lr / div_factor`` (the param groups' ``initial_lr``, which
    ``optimizer.set_hyperparameters(b, lr=...)`` leaves as it is: the next
    step overwrites that learning rate), also after :meth:`reset_model`, which
    takes ``max_lr``, ``total_steps`` (or ``epochs`` with ``steps_per_epoch``),
    ``pct_start``, ``div_factor``, ``final_div_factor``, ``base_momentum`` and
    ``max_momentum`` (the last three: one number, or one per param group).
    """

    _spec = {"total_steps": _spec_ints(1), "_schedule_phases": _spec_phases,
             "_anneal_func_type": _spec_choice("cos", "linear"), "cycle_momentum": _spec_bool,
             "use_beta1": _spec_bool, "pct_start": _spec_floats(0.0, 1.0),
             "div_factor": _spec_floats(0.0, math.inf, lo_open=True),
             "final_div_factor": _spec_floats(0.0, math.inf, lo_open=True)}
    # A state saved before reset_model existed lacks the arguments it keeps.
    _optional = _Loadable._optional | {"use_beta1", "pct_start", "div_factor", "final_div_factor"}
    _model_args = ("max_lr", "total_steps", "epochs", "steps_per_epoch", "pct_start", "div_factor",
                   "final_div_factor", "base_momentum", "max_momentum")

    def __init__(
        self,
        optimizer: Optimizer,
        max_lr: float | Sequence | torch.Tensor,
        total_steps: int | Sequence[int] | torch.Tensor | None = None,
        epochs: int | Sequence[int] | torch.Tensor | None = None,
        steps_per_epoch: int | Sequence[int] | torch.Tensor | None = None,
        pct_start: float | Sequence[float] | torch.Tensor = 0.3,
        anneal_strategy: str = "cos",
        cycle_momentum: bool = True,
        base_momentum: float | Sequence | torch.Tensor = 0.85,
        max_momentum: float | Sequence | torch.Tensor = 0.95,
        div_factor: float | Sequence[float] | torch.Tensor = 25.0,
        final_div_factor: float | Sequence[float] | torch.Tensor = 1e4,
        three_phase: bool = False,
        last_epoch: _Epochs = -1,
    ) -> None:
        _require_momentum(optimizer, cycle_momentum,
                          "OneCycleLR: the optimizer must have momentum or betas to use cycle_momentum")
        B = self.B = _array_size(optimizer, "OneCycleLR")
        self.optimizer = optimizer
        last_epochs = _epochs(last_epoch, B)
        fresh = last_epochs == -1
        if total_steps is not None:
            self.total_steps = self._arg("total_steps", total_steps)
        elif epochs is not None and steps_per_epoch is not None:
            epochs = _ints(epochs, B, "epochs", minimum=1)
            self.total_steps = epochs * _ints(steps_per_epoch, B, "steps_per_epoch", minimum=1)
        else:
            raise ValueError("OneCycleLR: define either total_steps or (epochs and steps_per_epoch)")
        self.pct_start = self._arg("pct_start", pct_start)
        if not isinstance(three_phase, bool):
            raise TypeError(f"three_phase must be a bool, got {type(three_phase).__name__}")
        self._schedule_phases = _one_cycle_phases(self.pct_start, self.total_steps, three_phase)
        if anneal_strategy not in ("cos", "linear"):
            raise ValueError(f"anneal_strategy must be 'cos' or 'linear', got {anneal_strategy!r}")
        self._anneal_func_type = anneal_strategy

        groups = optimizer.param_groups
        max_lrs = _per_group(max_lr, len(groups), B, "max_lr")
        self.div_factor = self._arg("div_factor", div_factor)
        self.final_div_factor = self._arg("final_div_factor", final_div_factor)
        if not isinstance(cycle_momentum, bool):
            raise TypeError(f"cycle_momentum must be a bool, got {type(cycle_momentum).__name__}")
        self.cycle_momentum = cycle_momentum
        if cycle_momentum:
            self.use_beta1 = "betas" in optimizer.defaults
            max_ms = _per_group(max_momentum, len(groups), B, "max_momentum")
            base_ms = _per_group(base_momentum, len(groups), B, "base_momentum")
            _check_cycled_momentum(optimizer, "OneCycleLR", self.use_beta1, max_ms, base_ms)
        _require_initial_lr(optimizer, last_epochs)
        _require_entries(groups, ("max_lr", "min_lr") + (("max_momentum", "base_momentum") if cycle_momentum else ()),
                         last_epochs)
        with _kept_on_error(optimizer=optimizer):
            for group in groups:  # initial_lr is a phase endpoint: set_hyperparameters leaves it
                group[_INITIAL_LR_OWNER] = type(self).__name__
            if fresh.any():
                for group, m in zip(groups, max_lrs):
                    initial = m / self.div_factor
                    _put(group, "initial_lr", initial, fresh, B)
                    _put(group, "max_lr", m, fresh, B)
                    _put(group, "min_lr", initial / self.final_div_factor, fresh, B)
                if cycle_momentum:
                    for group, m, b in zip(groups, max_ms, base_ms):
                        _new_momentum(group, m, fresh, B, self.use_beta1)
                        _put(group, "max_momentum", m, fresh, B)
                        _put(group, "base_momentum", b, fresh, B)
            super().__init__(optimizer, last_epochs)

    def _restart(self, b: int, ctx: _Restart, kwargs: Mapping[str, Any]) -> None:
        who = "OneCycleLR.reset_model"
        self._check_arg_names(kwargs)
        kwargs = dict(kwargs)
        if "epochs" in kwargs or "steps_per_epoch" in kwargs:
            if "total_steps" in kwargs or "epochs" not in kwargs or "steps_per_epoch" not in kwargs:
                raise TypeError(f"{who}: give total_steps, or epochs and steps_per_epoch, got {sorted(kwargs)}")
            counts = []
            for name in ("epochs", "steps_per_epoch"):
                _single(kwargs[name], who, name, b)
                try:
                    counts.append(int(_ints(kwargs.pop(name), 1, name, minimum=1, model=b)[0]))
                except (TypeError, ValueError) as e:
                    raise _reset_error(e, who, b, name) from None
            kwargs["total_steps"] = counts[0] * counts[1]
        self._set_model_args(b, kwargs)
        B, one = self.B, _one_hot(b, self.B)
        groups = self.optimizer.param_groups
        phases = _one_cycle_phases(self.pct_start, self.total_steps, len(self._schedule_phases) == 3)
        self._schedule_phases = [{**old, "end_step": torch.where(one, new["end_step"], old["end_step"])}
                                 for old, new in zip(self._schedule_phases, phases, strict=True)]
        # The constructor's start: initial_lr = max_lr / div_factor (whatever the optimizer's lr).
        for i, group in enumerate(groups):
            initial = _read(group["max_lr"], B, f"param_groups[{i}]['max_lr']") / self.div_factor
            _put(group, "initial_lr", initial, one, B)
            _put(group, "min_lr", initial / self.final_div_factor, one, B)
        ctx.initial_lr_set = True
        self._start(one, ctx)  # the initial step sets model b's momentum too

    def _set_model_arg(self, b: int, name: str, value: object) -> None:
        if name not in ("max_lr", "base_momentum", "max_momentum"):
            return super()._set_model_arg(b, name, value)
        if name != "max_lr" and not self.cycle_momentum:
            raise TypeError(f"{name}: this scheduler does not cycle momentum (cycle_momentum=False)")
        groups = self.optimizer.param_groups
        values = _per_group_values(value, len(groups), f"{type(self).__name__}.reset_model", name, b)
        for i, (group, v) in enumerate(zip(groups, values)):
            group[name] = _with(_read(group[name], self.B, f"param_groups[{i}]['{name}']"), b, v[0])
        if name != "max_lr":
            _check_cycled_momentum(self.optimizer, "OneCycleLR", self.use_beta1,
                                   [_read(g["max_momentum"], self.B, "max_momentum") for g in groups],
                                   [_read(g["base_momentum"], self.B, "base_momentum") for g in groups])

    def _anneal(self, start: torch.Tensor, end: torch.Tensor, pct: torch.Tensor) -> torch.Tensor:
        if self._anneal_func_type == "cos":
            return end + (start - end) / 2.0 * (torch.cos(math.pi * pct) + 1)
        return (end - start) * pct + start

    def _lr_at(self, at: _At) -> list[torch.Tensor]:
        """The learning rates at each model's step; also sets the cycled momentum, as torch does."""
        step = at.epoch
        over = self.total_steps < step
        if at.only is not None:
            over &= at.only
        if over.any():
            raise ValueError(
                f"OneCycleLR: tried to step {step[over].tolist()} times; models "
                f"{over.nonzero().flatten().tolist()} have total_steps {self.total_steps[over].tolist()}"
            )
        B = self.B
        # Which phase each model is in, and how far through it.
        chosen = torch.zeros(B, dtype=torch.bool)
        start = torch.zeros(B, dtype=_F64)
        picks = []
        last = len(self._schedule_phases) - 1
        for i, phase in enumerate(self._schedule_phases):
            end = phase["end_step"]
            sel = ~chosen & ((step <= end) if i < last else torch.ones(B, dtype=torch.bool))
            width = end - start
            empty = sel & (width == 0)
            if at.only is not None:
                empty &= at.only
            if empty.any():
                raise ZeroDivisionError(
                    f"OneCycleLR: phase {i} of models {empty.nonzero().flatten().tolist()} has no steps "
                    "(pct_start * total_steps gives a phase of length 0)"
                )
            picks.append((sel, (step - start) / width, phase))
            chosen |= sel
            start = end

        lrs, momenta = [], []
        for g, group in enumerate(self.optimizer.param_groups):
            def value(key: str) -> torch.Tensor:
                return _read(group[key], B, f"param_groups[{g}]['{key}']")

            lr = torch.zeros(B, dtype=_F64)
            momentum = torch.zeros(B, dtype=_F64)
            for sel, pct, phase in picks:
                if not sel.any():
                    continue
                lr = torch.where(sel, self._anneal(value(phase["start_lr"]), value(phase["end_lr"]), pct), lr)
                if self.cycle_momentum:
                    m = self._anneal(value(phase["start_momentum"]), value(phase["end_momentum"]), pct)
                    momentum = torch.where(sel, m, momentum)
            lrs.append(lr)
            momenta.append(momentum)
        if self.cycle_momentum:
            for group, momentum in zip(self.optimizer.param_groups, momenta):
                _set_momentum(group, momentum, B, self.use_beta1, at.only)
        return lrs

    def _check_loaded(self, new: dict[str, Any]) -> None:
        if new["cycle_momentum"] and "use_beta1" not in new:
            raise ValueError("the state cycles momentum but has no 'use_beta1' entry")


class CyclicLR(LRScheduler):
    """Cyclical learning rates (CLR) per model: each model's learning rate cycles between
    ``base_lr`` and ``max_lr`` with its own period and amplitude policy.

    Model b follows ``torch.optim.lr_scheduler.CyclicLR`` with its own
    arguments; ``step()`` is called after every batch.

    Args:
        optimizer: array optimizer with ``[B]`` learning rates.
        base_lr: lower boundary, per model, or per param group as a list of
            per-model values; it replaces the optimizer's learning rate (one set
            later, e.g. by ``optimizer.set_hyperparameters``, holds until the next
            step, as torch's does; ``initial_lr`` stays ``base_lr``).
        max_lr: upper boundary, per model or per param group.
        step_size_up: iterations of the increasing half of a cycle, > 0, per model. Default 2000.
        step_size_down: iterations of the decreasing half, >= 0, per model; None (for all models, or
            one model's entry): ``step_size_up``.
        mode: ``'triangular'``, ``'triangular2'`` or ``'exp_range'`` (all models); ignored
            with ``scale_fn``.
        gamma: ``exp_range``'s base, per model. Default 1.
        scale_fn: custom amplitude policy: a callable shared by all models (returning a
            number, or one value per model) or a list of B callables, one per model.
            It is called with each model's cycle number or iteration (``scale_mode``);
            a negative or NaN value raises a ValueError naming the models, as
            ``LambdaLR``'s factors do.
        scale_mode: ``'cycle'`` or ``'iterations'`` (all models), for ``scale_fn``.
        cycle_momentum: cycle the optimizer's ``momentum`` (SGD, RMSprop) or ``betas[0]``
            (Adam, AdamW) inversely to the learning rate, between ``max_momentum`` and
            ``base_momentum``, written in place each step; an optimizer without either
            (Adagrad, Adadelta) raises a ValueError, as torch does. Default True.
        base_momentum: lower momentum boundary, per model or per param group. Default 0.8.
        max_momentum: upper momentum boundary, per model or per param group. Default 0.9.
        last_epoch: index of the last batch, one int or one per model; -1 starts the schedule.
    """

    _spec = {"max_lrs": _spec_group_floats, "total_size": _spec_floats(0.0, math.inf, lo_open=True),
             "step_ratio": _spec_floats(0.0, 1.0, lo_open=True), "mode": _spec_str, "gamma": _spec_floats(),
             "_scale_fn_custom": _spec_callables("_scale_fn_custom"),
             "scale_mode": _spec_choice("cycle", "iterations"), "cycle_momentum": _spec_bool,
             "use_beta1": _spec_bool, "base_momentums": _spec_group_floats, "max_momentums": _spec_group_floats}
    _optional = _Loadable._optional | {"use_beta1", "base_momentums", "max_momentums"}
    _model_args = ("base_lr", "max_lr", "step_size_up", "step_size_down", "gamma", "scale_fn", "base_momentum",
                   "max_momentum")

    def __init__(
        self,
        optimizer: Optimizer,
        base_lr: float | Sequence | torch.Tensor,
        max_lr: float | Sequence | torch.Tensor,
        step_size_up: float | Sequence[float] | torch.Tensor = 2000,
        step_size_down: float | Sequence[float] | torch.Tensor | None = None,
        mode: str = "triangular",
        gamma: float | Sequence[float] | torch.Tensor = 1.0,
        scale_fn: Callable | Sequence[Callable] | None = None,
        scale_mode: str = "cycle",
        cycle_momentum: bool = True,
        base_momentum: float | Sequence | torch.Tensor = 0.8,
        max_momentum: float | Sequence | torch.Tensor = 0.9,
        last_epoch: _Epochs = -1,
    ) -> None:
        _require_momentum(optimizer, cycle_momentum,
                          f"CyclicLR: cycle_momentum needs an optimizer with momentum or betas; "
                          f"{type(optimizer).__name__} has neither (pass cycle_momentum=False)")
        B = self.B = _array_size(optimizer, "CyclicLR")
        self.optimizer = optimizer
        last_epochs = _epochs(last_epoch, B)
        fresh = last_epochs == -1
        groups = optimizer.param_groups
        base_lrs = _per_group(base_lr, len(groups), B, "base_lr")
        self.max_lrs = _per_group(max_lr, len(groups), B, "max_lr")
        up = _floats(step_size_up, B, "step_size_up")
        _check_range(up, "step_size_up", 0.0, math.inf, lo_open=True)
        if isinstance(step_size_down, (list, tuple)) and len(step_size_down) == B and None in step_size_down:
            # a model's None is its step_size_up, as torch's is
            step_size_down = [float(up[b]) if v is None else v for b, v in enumerate(step_size_down)]
        down = up.clone() if step_size_down is None else _floats(step_size_down, B, "step_size_down")
        self.total_size = up + down
        self.step_ratio = up / self.total_size
        self._scale_fn_custom = None if scale_fn is None else _lambdas(scale_fn, 1, B, "scale_fn")[0]
        self.mode = self._arg("mode", mode)
        self._check_mode(self.mode)
        self.gamma = self._arg("gamma", gamma)
        self.scale_mode = self._arg("scale_mode", scale_mode)
        self._init_scale_fn()
        self.cycle_momentum = self._arg("cycle_momentum", cycle_momentum)
        if cycle_momentum:
            self.use_beta1 = "betas" in optimizer.defaults
            self.base_momentums = _per_group(base_momentum, len(groups), B, "base_momentum")
            self.max_momentums = _per_group(max_momentum, len(groups), B, "max_momentum")
            _check_cycled_momentum(optimizer, "CyclicLR", self.use_beta1, self.max_momentums,
                                   self.base_momentums)
        with _kept_on_error(optimizer=optimizer):
            for group in groups:  # the schedule ignores the optimizer's lr: set_hyperparameters leaves initial_lr
                group[_INITIAL_LR_OWNER] = type(self).__name__
            if fresh.any():
                every = bool(fresh.all())
                for group, lr in zip(groups, base_lrs):
                    # (a new tensor: the param group's record must not be base_lrs itself)
                    lr = lr.clone() if every else torch.where(fresh, lr, _current_lr(optimizer, group, B))
                    _set_lr(optimizer, group, lr, B)
                if cycle_momentum:
                    for group, m, b in zip(groups, self.max_momentums, self.base_momentums):
                        _new_momentum(group, m, fresh, B, self.use_beta1)
                        _put(group, "max_momentum", m, fresh, B)
                        _put(group, "base_momentum", b, fresh, B)
            super().__init__(optimizer, last_epochs)
        self.base_lrs = base_lrs

    def _restart(self, b: int, ctx: _Restart, kwargs: Mapping[str, Any]) -> None:
        who = "CyclicLR.reset_model"
        self._check_arg_names(kwargs)
        kwargs = dict(kwargs)
        B, one = self.B, _one_hot(b, self.B)
        groups = self.optimizer.param_groups
        bases = self.base_lrs  # CyclicLR keeps base_lr as its base_lrs
        if "base_lr" in kwargs:
            values = _per_group_values(kwargs.pop("base_lr"), len(groups), who, "base_lr", b)
            bases = [_with(t, b, v[0]) for t, v in zip(bases, values, strict=True)]
        up, down = kwargs.pop("step_size_up", None), kwargs.pop("step_size_down", None)
        if down is not None and up is None:
            raise TypeError(f"{who}: step_size_down needs step_size_up with it (alone, step_size_up sets both)")
        if up is not None:
            _single(up, who, "step_size_up", b)
            try:
                up = _floats(up, 1, "step_size_up", model=b)
                _check_range(up, "step_size_up", 0.0, math.inf, lo_open=True, model=b)
            except (TypeError, ValueError) as e:
                raise _reset_error(e, who, b, "step_size_up") from None
            if down is not None:
                _single(down, who, "step_size_down", b)
                try:
                    down = _floats(down, 1, "step_size_down", model=b)
                except (TypeError, ValueError) as e:
                    raise _reset_error(e, who, b, "step_size_down") from None
            down = up.clone() if down is None else down
            total = up + down
            self.total_size = _with(self.total_size, b, total[0])
            self.step_ratio = _with(self.step_ratio, b, (up / total)[0])
        self._set_model_args(b, kwargs)
        # The constructor's start: the learning rate becomes base_lr, the momentum entries max/base_momentum
        # (the momentum itself is set by the initial step).
        for group, lr in zip(groups, bases):
            _set_lr(self.optimizer, group, torch.where(one, lr, _current_lr(self.optimizer, group, B)), B)
        if self.cycle_momentum:
            for group, m, bm in zip(groups, self.max_momentums, self.base_momentums):
                _put(group, "max_momentum", m, one, B)
                _put(group, "base_momentum", bm, one, B)
        self._start(one, ctx)
        self.base_lrs = [torch.where(one, new, current) for new, current in zip(bases, self.base_lrs, strict=True)]

    def _set_model_arg(self, b: int, name: str, value: object) -> None:
        who = f"{type(self).__name__}.reset_model"
        groups = self.optimizer.param_groups
        if name == "scale_fn":
            if not isinstance(self._scale_fn_custom, list):
                raise TypeError(
                    f"scale_fn: model {b} can get its own scale_fn only when the scheduler was built "
                    f"with one per model (a list of B={self.B} callables)"
                )
            if not callable(value):
                raise TypeError(f"scale_fn must be a callable (model {b}'s), got {type(value).__name__}")
            self._scale_fn_custom = self._scale_fn_custom[:b] + [value] + self._scale_fn_custom[b + 1:]
            return
        attr = {"max_lr": "max_lrs", "base_momentum": "base_momentums", "max_momentum": "max_momentums"}.get(name)
        if attr is None:
            return super()._set_model_arg(b, name, value)
        if attr != "max_lrs" and not self.cycle_momentum:
            raise TypeError(f"{name}: this scheduler does not cycle momentum (cycle_momentum=False)")
        values = _per_group_values(value, len(groups), who, name, b)
        setattr(self, attr, [_with(t, b, v[0]) for t, v in zip(getattr(self, attr), values, strict=True)])
        if attr != "max_lrs":
            _check_cycled_momentum(self.optimizer, "CyclicLR", self.use_beta1, self.max_momentums,
                                   self.base_momentums)

    _MODES = ("triangular", "triangular2", "exp_range")

    def _check_mode(self, mode: str) -> None:
        if self._scale_fn_custom is None and mode not in self._MODES:
            raise ValueError(f"mode must be one of {list(self._MODES)} (or scale_fn given), got {mode!r}")

    def _check_loaded(self, new: dict[str, Any]) -> None:
        self._check_mode(new["mode"])
        missing = [k for k in ("use_beta1", "base_momentums", "max_momentums") if k not in new]
        if new["cycle_momentum"] and missing:
            raise ValueError(f"the state cycles momentum but has no {missing} entries")

    def _init_scale_fn(self) -> None:
        if self._scale_fn_custom is None:
            self.scale_mode = "iterations" if self.mode == "exp_range" else "cycle"

    def _scale(self, x: torch.Tensor, at: _At) -> torch.Tensor:
        """The amplitude scale of each model at its cycle number or iteration ``x`` (``[B]`` float64)
        at ``at``; a custom ``scale_fn``'s is checked as LambdaLR's factors are."""
        fn = self._scale_fn_custom
        if fn is None:
            if self.mode == "triangular":
                return torch.ones_like(x)
            if self.mode == "triangular2":
                return 1 / (2.0 ** (x - 1))
            return self.gamma ** x
        t = _call_per_model(fn, x, at.only, self.B, "CyclicLR: scale_fn")
        return _check_factors(t, "CyclicLR: scale_fn", at.epoch, None, at.only)

    def _lr_at(self, at: _At) -> list[torch.Tensor]:
        """The learning rates at each model's step; also sets the cycled momentum, as torch does."""
        e = at.e
        cycle = torch.floor(1 + e / self.total_size)
        x = 1.0 + e / self.total_size - cycle
        scale_factor = torch.where(x <= self.step_ratio, x / self.step_ratio, (x - 1) / (self.step_ratio - 1))
        scale = self._scale(cycle if self.scale_mode == "cycle" else e, at)
        lrs = [base + (top - base) * scale_factor * scale for base, top in zip(self.base_lrs, self.max_lrs)]
        if self.cycle_momentum:
            momenta = [top - (top - base) * scale_factor * scale
                       for base, top in zip(self.base_momentums, self.max_momentums)]
            for group, momentum in zip(self.optimizer.param_groups, momenta):
                _set_momentum(group, momentum, self.B, self.use_beta1, at.only)
        return lrs

    def state_dict(self) -> dict[str, Any]:
        """Every attribute but the optimizer; of a custom ``scale_fn``, what LambdaLR saves of its callables."""
        state = super().state_dict()
        state["_scale_fn_custom"] = _saved_callables(self._scale_fn_custom)
        return state

    def _apply_state(self, new: dict[str, Any]) -> None:
        saved = new.pop("_scale_fn_custom")
        self._store(new)
        _restore_callables(self._scale_fn_custom, saved)
        self._init_scale_fn()

    def _entry_of_models(self, name: str, value: Any, rows: list[int], index: torch.Tensor) -> Any:
        if name == "_scale_fn_custom":
            return _callables_of(self._scale_fn_custom, value, rows)
        return _models_of(value, index)


def _check_children(who: str, optimizer: Optimizer, schedulers: object) -> list[LRScheduler]:
    if not isinstance(schedulers, Iterable):
        raise TypeError(f"{who} expects a list of hfkern schedulers, got {type(schedulers).__name__}")
    schedulers = list(schedulers)
    if len(schedulers) < 1:
        raise ValueError(f"{who} expects at least one scheduler, got none")
    for i, s in enumerate(schedulers):
        if isinstance(s, _torch.ReduceLROnPlateau):
            raise ValueError(
                f"{who} does not support ReduceLROnPlateau (its step needs metrics); got one at index {i}"
            )
        if not isinstance(s, LRScheduler):
            raise TypeError(
                f"{who} expects hfkern.optim.lr_scheduler schedulers, got {type(s).__name__} at index {i}"
            )
        if s.optimizer is not optimizer:
            raise ValueError(
                f"{who} expects every scheduler to drive its optimizer; the one at index {i} "
                f"({type(s).__name__}) drives another"
            )
    return schedulers


def _child_kwargs(sched: Any, b: int, kwargs: Mapping[str, Any]) -> list[dict[str, Any]]:
    """A container's reset_model arguments: ``schedulers``, one dict of arguments (or None) per scheduler."""
    sched._check_arg_names(kwargs)
    n = len(sched._schedulers)
    given = kwargs.get("schedulers")
    if given is None:
        return [{} for _ in range(n)]
    if not isinstance(given, (list, tuple)) or len(given) != n \
            or not all(k is None or isinstance(k, Mapping) for k in given):
        raise TypeError(
            f"{type(sched).__name__}.reset_model: schedulers must be a list of one dict of model {b}'s "
            f"arguments (or None) per scheduler ({n}), got {given!r}"
        )
    return [dict(k or {}) for k in given]


def _step_child(child: LRScheduler, models: torch.Tensor) -> None:
    """Step ``child`` for ``models``: through its public step() when that is every model."""
    if bool(models.all()):
        child.step()
    else:
        child._step_models(models)


class SequentialLR(LRScheduler):
    """Run hfkern schedulers one after another, switching at ``milestones`` (e.g. warm-up, then decay).

    Every model has its own epoch and milestones, so models may be in
    different schedulers of the sequence at once: each scheduler steps the
    models in its stretch, and a model reaching a milestone restarts the next
    scheduler at its epoch 0 for itself. Model b follows torch's SequentialLR
    with model b's milestones.

    Args:
        optimizer: the optimizer every scheduler in ``schedulers`` drives.
        schedulers: hfkern schedulers (not :class:`ReduceLROnPlateau`).
        milestones: ``len(schedulers) - 1`` epochs at which the next scheduler
            takes over, restarting at its epoch 0; each one int for every model
            or one per model (e.g. ``[[5, 3, 8]]``: warm-up lengths of three
            models; a ``[len(schedulers) - 1, B]`` tensor or array gives all).
        last_epoch: index of the last epoch, one int or one per model; -1 starts the schedule.

    ``reset_model(b, schedulers=None, milestones=None)`` restarts model b in
    every scheduler, as building them and this SequentialLR anew would;
    ``schedulers`` gives model b new arguments: one dict (or None) per
    scheduler, passed to its reset; ``milestones`` model b's own milestones
    (``len(schedulers) - 1`` ints).
    """

    _spec = {"B": _spec_same_B, "_schedulers": _spec_children, "_milestones": _spec_milestone_list,
             "last_epoch": _spec_ints(0), "_last_lr": _spec_group_floats}
    _spec_replaces = True
    _optional = frozenset()
    _model_args = ("schedulers", "milestones")

    def __init__(self, optimizer: Optimizer, schedulers: Sequence[LRScheduler],
                 milestones: Sequence[int | Sequence[int] | torch.Tensor] | torch.Tensor,
                 last_epoch: _Epochs = -1) -> None:
        self.B = _array_size(optimizer, "SequentialLR")
        last_epochs = _epochs(last_epoch, self.B)
        schedulers = _check_children("SequentialLR", optimizer, schedulers)
        self._milestones = _sequence_milestones(milestones, len(schedulers) - 1, self.B,
                                                "SequentialLR: milestones")
        self._schedulers = schedulers
        self.last_epochs = last_epochs + 1
        self.optimizer = optimizer

        nested = [s for c in schedulers for s in _nested(c)]
        with _kept_on_error(*nested, optimizer=optimizer):
            for i, group in enumerate(optimizer.param_groups):
                initial = _read(group["initial_lr"], self.B, f"param_groups[{i}]['initial_lr']")
                _set_lr(optimizer, group, initial, self.B)
            # Each scheduler took its initial step when it was built; only the first to run keeps one
            # (per model: a milestone at 0 hands a model to a later scheduler from the start).
            self.recursive_undo()
            first = self._stages(torch.zeros(self.B, dtype=torch.int64))
            last = None
            for k in first.unique().tolist():
                sel = first == k
                self._schedulers[k]._initial_step(None if bool(sel.all()) else sel)
                lrs = self._schedulers[k].get_last_lr()
                last = lrs if last is None else [torch.where(sel, v, old) for v, old in zip(lrs, last)]
            self._last_lr = last

    def _set_model_arg(self, b: int, name: str, value: object) -> None:
        """``milestones``: model b's own, one int per milestone."""
        if isinstance(value, (list, tuple)):
            for i, m in enumerate(value):
                _single(m, f"{type(self).__name__}.reset_model", f"{name}[{i}]", b)
        mine = _sequence_milestones(value, len(self._milestones), 1, name)
        self._milestones = [_uniform(_with(_ints(m, self.B, name, minimum=None), b, v))
                            for m, v in zip(self._milestones, mine, strict=True)]

    def _stages(self, epochs: torch.Tensor) -> torch.Tensor:
        """``[B]`` int64: which scheduler is in charge of each model at its epoch (``epochs``, ``[B]``),
        torch's ``bisect_right`` over the model's milestones."""
        rows = [m.tolist() if isinstance(m, torch.Tensor) else [m] * self.B for m in self._milestones]
        per_model = zip(*rows) if rows else ([] for _ in range(self.B))
        return torch.tensor([bisect_right(list(ms), e) for ms, e in zip(per_model, epochs.tolist())],
                            dtype=torch.int64)

    def recursive_undo(self, sched: LRScheduler | None = None) -> None:
        """Undo the initial step the schedulers (and nested ones) took when built."""
        scheds = self if sched is None else sched
        if hasattr(scheds, "_schedulers"):
            for s in scheds._schedulers:
                self.recursive_undo(s)
        elif hasattr(scheds, "last_epoch"):
            scheds.last_epoch -= 1

    def _undo(self, sched: Any, models: torch.Tensor) -> None:
        """:meth:`recursive_undo` for ``models`` only."""
        if hasattr(sched, "_schedulers"):
            for s in sched._schedulers:
                self._undo(s, models)
        elif hasattr(sched, "last_epochs"):
            sched.last_epochs = torch.where(models, sched.last_epochs - 1, sched.last_epochs)

    def _restart(self, b: int, ctx: _Restart, kwargs: Mapping[str, Any]) -> None:
        kids = _child_kwargs(self, b, kwargs)
        one = _one_hot(b, self.B)
        if kwargs.get("milestones") is not None:
            self._set_model_args(b, {"milestones": kwargs["milestones"]})
        # As the constructors run: every scheduler starts model b, then this one takes over.
        for child, kw in zip(self._schedulers, kids, strict=True):
            child._restart(b, ctx, kw)
        for i, group in enumerate(self.optimizer.param_groups):
            initial = _read(group["initial_lr"], self.B, f"param_groups[{i}]['initial_lr']")
            current = _current_lr(self.optimizer, group, self.B)
            _set_lr(self.optimizer, group, torch.where(one, initial, current), self.B)
        self._undo(self, one)
        first = self._schedulers[int(self._stages(torch.zeros(self.B, dtype=torch.int64))[b])]
        first._initial_step(one)
        self.last_epochs = torch.where(one, 0, self.last_epochs)
        self._last_lr = [torch.where(one, v, old) for v, old in zip(first.get_last_lr(), self._last_lr)]

    @host_step
    def step(self) -> None:  # type: ignore[override]
        """Step the scheduler in charge of each model at its next epoch; at a milestone, restart the next one.

        A step that raises changes nothing.
        """
        self._step_models(None)

    def _step_models(self, models: torch.Tensor | None = None, epoch: int | None = None) -> None:
        chosen = torch.ones(self.B, dtype=torch.bool) if models is None else models
        epochs = torch.where(chosen, self.last_epochs + 1, self.last_epochs)
        idx = self._stages(epochs)
        parts = [(k, chosen & (idx == k)) for k in range(len(self._schedulers))]
        parts = [(k, sel, sel & (epochs == self._milestones[k - 1]) if k > 0 else torch.zeros_like(sel))
                 for k, sel in parts if sel.any()]
        # One update (a scheduler's step, or its restart at a milestone) checks everything before it
        # writes, and restores itself if it raises; where several run (schedulers in charge of
        # different models, or one that restarts some models and steps others), what the earlier
        # ones wrote is restored: every scheduler and the optimizer's learning rates and momentum.
        updates = sum(int(bool(restart.any())) + int(bool((sel & ~restart).any())) for _, sel, restart in parts)
        kept = [self] if updates == 1 else [self, *(s for c in self._schedulers for s in _nested(c))]
        with _kept_on_error(*kept, optimizer=None if updates == 1 else self.optimizer):
            self.last_epochs = epochs
            last = self._last_lr
            for k, sel, restart in parts:
                scheduler = self._schedulers[k]
                if restart.any():
                    if isinstance(scheduler, (ChainedScheduler, SequentialLR)):
                        raise NotImplementedError(
                            f"SequentialLR: scheduler {k} is a {type(scheduler).__name__}, which cannot "
                            f"restart at epoch 0 when models reach its milestone (torch's SequentialLR "
                            f"raises NotImplementedError there too); give SequentialLR its schedulers "
                            f"one by one")
                    scheduler._update_lr(0, None if bool(restart.all()) else restart)
                if (sel & ~restart).any():
                    _step_child(scheduler, sel & ~restart)
                if bool(sel.all()):
                    last = scheduler.get_last_lr()
                else:
                    last = [torch.where(sel, v, old) for v, old in zip(scheduler.get_last_lr(), last)]
            self._last_lr = last

    def state_dict(self) -> dict[str, Any]:
        """Every attribute but the optimizer, with each scheduler's own state under ``_schedulers``."""
        state = self._state_entries(skip=("_schedulers",))
        state["_schedulers"] = [s.state_dict() for s in self._schedulers]
        return state

    def _apply_state(self, new: dict[str, Any]) -> None:
        loads = new.pop("_schedulers")
        self._store(new)
        for load in loads:
            load()

    def _entry_of_models(self, name: str, value: Any, rows: list[int], index: torch.Tensor) -> Any:
        if name == "_schedulers":  # each scheduler's state, selected by the scheduler
            return [s._state_of_models(state, rows) for s, state in zip(self._schedulers, value, strict=True)]
        return _models_of(value, index)


class ChainedScheduler(LRScheduler):
    """Step several hfkern schedulers of one optimizer together: each ``step()`` steps them all, in order.

    Their updates compose as in torch (each chained scheduler scales the
    learning rate the previous one left). A step that raises in any of them
    changes nothing: the schedulers and the optimizer's learning rates (and
    cycled momentum) are restored.

    ``reset_model(b, schedulers=None)`` restarts model b in every scheduler in
    order, as building them anew on one optimizer would (the first sets
    ``initial_lr``, the next ones start from the learning rate it leaves);
    ``schedulers`` gives model b new arguments: one dict (or None) per scheduler.
    Reset schedulers that share an optimizer through this class: resetting them
    one by one would give each the learning rate the previous left as its base.

    Args:
        schedulers: hfkern schedulers (not :class:`ReduceLROnPlateau`), all of one optimizer.
        optimizer: that optimizer; default: the first scheduler's.
    """

    _spec = {"B": _spec_same_B, "_schedulers": _spec_children, "_last_lr": _spec_group_floats}
    _spec_replaces = True
    _optional = frozenset()
    _model_args = ("schedulers",)

    def __init__(self, schedulers: Sequence[LRScheduler], optimizer: Optimizer | None = None) -> None:
        if not isinstance(schedulers, Iterable):
            raise TypeError(f"ChainedScheduler expects a list of hfkern schedulers, got {type(schedulers).__name__}")
        schedulers = list(schedulers)
        if not schedulers:
            raise ValueError("ChainedScheduler expects at least one scheduler, got none")
        if optimizer is None:
            optimizer = getattr(schedulers[0], "optimizer", None)
        self.B = _array_size(optimizer, "ChainedScheduler")
        self._schedulers = _check_children("ChainedScheduler", optimizer, schedulers)
        self.optimizer = optimizer
        self._last_lr = [v.clone() for v in self._lrs()]

    @host_step
    def step(self) -> None:  # type: ignore[override]
        """Step every chained scheduler once, in order."""
        self._step_models(None)

    def _step_models(self, models: torch.Tensor | None = None, epoch: int | None = None) -> None:
        nested = [s for c in self._schedulers for s in _nested(c)]
        with _kept_on_error(self, *nested, optimizer=self.optimizer):
            for scheduler in self._schedulers:
                _step_child(scheduler, torch.ones(self.B, dtype=torch.bool) if models is None else models)
            if models is None:
                self._last_lr = [v.clone() for v in self._lrs()]
            else:
                self._last_lr = [torch.where(models, v, old) for v, old in zip(self._lrs(), self._last_lr)]

    def _restart(self, b: int, ctx: _Restart, kwargs: Mapping[str, Any]) -> None:
        kids = _child_kwargs(self, b, kwargs)
        for child, kw in zip(self._schedulers, kids, strict=True):
            child._restart(b, ctx, kw)
        one = _one_hot(b, self.B)
        self._last_lr = [torch.where(one, v, old) for v, old in zip(self._lrs(), self._last_lr)]

    state_dict = SequentialLR.state_dict
    _apply_state = SequentialLR._apply_state
    _entry_of_models = SequentialLR._entry_of_models


class ReduceLROnPlateau(_PerModel, _torch.ReduceLROnPlateau):
    """Reduce each model's learning rate when its own metric stops improving.

    ``step(metrics)`` takes one metric per model (a length-B sequence, a
    ``[B]`` tensor or a numpy array, read to the host). Every model keeps its
    own best value, bad-epoch count and cooldown, with torch's rules.

    Args:
        optimizer: array optimizer with ``[B]`` learning rates.
        mode: ``'min'`` or ``'max'`` (all models).
        factor: ``new_lr = lr * factor``, in [0, 1), per model. Default 0.1.
        patience: bad epochs tolerated before a reduction, int >= 0, per model. Default 10.
        threshold: least significant change, per model. Default 1e-4.
        threshold_mode: ``'rel'`` or ``'abs'`` (all models).
        cooldown: epochs of rest after a reduction, int >= 0, per model. Default 0.
        min_lr: lower bound, per model; or per param group as a list of
            per-model values (e.g. ``[[0.0, 1e-4, 1e-3], 1e-5]``). Default 0.
        eps: reductions smaller than this are skipped, per model. Default 1e-8.

    ``reset_model(b, **kwargs)`` forgets model b's best value, bad epochs and
    cooldown and restarts its epoch count; ``kwargs``: model b's new ``factor``,
    ``patience``, ``threshold``, ``cooldown``, ``min_lr`` (one number, or one per
    param group) or ``eps``.
    """

    _spec = {"B": _spec_same_B, "factor": _spec_floats(0.0, 1.0, hi_open=True), "min_lrs": _spec_group_floats,
             "default_min_lr": _spec_optional_floats, "patience": _spec_ints(0), "cooldown": _spec_ints(0),
             "eps": _spec_floats(), "last_epoch": _spec_ints(None), "_last_lr": _spec_group_floats,
             "mode_worse": _spec_mode_worse, "mode": _spec_choice("min", "max"), "threshold": _spec_floats(),
             "threshold_mode": _spec_choice("rel", "abs"), "best": _spec_any_floats(infinite=True),
             "cooldown_counter": _spec_ints(0), "num_bad_epochs": _spec_ints(0)}
    _spec_replaces = True
    _optional = frozenset()
    _model_args = ("factor", "patience", "threshold", "cooldown", "min_lr", "eps")

    def __init__(
        self,
        optimizer: Optimizer,
        mode: str = "min",
        factor: float | Sequence[float] | torch.Tensor = 0.1,
        patience: int | Sequence[int] | torch.Tensor = 10,
        threshold: float | Sequence[float] | torch.Tensor = 1e-4,
        threshold_mode: str = "rel",
        cooldown: int | Sequence[int] | torch.Tensor = 0,
        min_lr: float | Sequence | torch.Tensor = 0,
        eps: float | Sequence[float] | torch.Tensor = 1e-8,
    ) -> None:
        B = self.B = _array_size(optimizer, "ReduceLROnPlateau")
        self.optimizer = optimizer
        self.factor = self._arg("factor", factor)
        groups = optimizer.param_groups
        self.min_lrs = _per_group(min_lr, len(groups), B, "min_lr")
        self.default_min_lr = None if _is_nested(min_lr) else self.min_lrs[0].clone()
        self.patience = self._arg("patience", patience)
        self.cooldown = self._arg("cooldown", cooldown)
        self.eps = self._arg("eps", eps)
        self.last_epochs = torch.zeros(B, dtype=torch.int64)
        self._last_lr = [_current_lr(optimizer, g, B).clone() for g in groups]
        self._init_is_better(mode=mode, threshold=threshold, threshold_mode=threshold_mode)
        self._reset()

    def _reset(self) -> None:
        """Forget every model's best value, bad epochs and cooldown."""
        self.best = torch.full((self.B,), self.mode_worse, dtype=_F64)
        self.cooldown_counter = torch.zeros(self.B, dtype=torch.int64)
        self.num_bad_epochs = torch.zeros(self.B, dtype=torch.int64)

    def _restart(self, b: int, ctx: _Restart, kwargs: Mapping[str, Any]) -> None:
        self._set_model_args(b, kwargs)
        self.best = _with(self.best, b, self.mode_worse)
        self.cooldown_counter = _with(self.cooldown_counter, b, 0)
        self.num_bad_epochs = _with(self.num_bad_epochs, b, 0)
        self.last_epochs = _with(self.last_epochs, b, 0)
        one = _one_hot(b, self.B)
        groups = self.optimizer.param_groups
        # (a group added since the last step, which steps as torch's does, has no entry yet)
        last = self._last_lr if len(self._last_lr) == len(groups) else [_current_lr(self.optimizer, g, self.B)
                                                                        for g in groups]
        self._last_lr = [torch.where(one, _current_lr(self.optimizer, g, self.B), old)
                         for g, old in zip(groups, last, strict=True)]

    def _set_model_arg(self, b: int, name: str, value: object) -> None:
        if name != "min_lr":
            return super()._set_model_arg(b, name, value)
        values = _per_group_values(value, len(self.min_lrs), f"{type(self).__name__}.reset_model", name, b)
        self.min_lrs = [_with(t, b, v[0]) for t, v in zip(self.min_lrs, values, strict=True)]
        if self.default_min_lr is not None and not isinstance(value, (list, tuple)):
            self.default_min_lr = _with(self.default_min_lr, b, values[0][0])

    def _metrics(self, metrics: object) -> torch.Tensor:
        B = self.B
        np = _numpy()
        if np is not None and isinstance(metrics, np.ndarray):
            if metrics.dtype.kind not in "biuf":  # bools count as 0 and 1, as in a tensor
                raise TypeError(f"ReduceLROnPlateau.step: expected real metrics, got a {metrics.dtype} numpy array")
            metrics = torch.from_numpy(metrics.astype(np.float64))
        if isinstance(metrics, torch.Tensor):
            if metrics.is_complex():  # torch's float() of a complex metric raises too
                raise TypeError(f"ReduceLROnPlateau.step: expected real metrics, got a {metrics.dtype} tensor")
            t = metrics.detach().to(device="cpu", dtype=_F64)
            if t.dim() > 1 or t.numel() != B:
                raise ValueError(
                    f"ReduceLROnPlateau.step: expected metrics of shape [B={B}] (one per model), "
                    f"got shape {list(t.shape)}"
                )
            return t.reshape(B)
        if isinstance(metrics, numbers.Real) and not isinstance(metrics, bool):
            if B != 1:
                raise ValueError(
                    f"ReduceLROnPlateau.step: expected one metric per model (B={B}), got the single "
                    f"number {metrics!r}"
                )
            return torch.tensor([float(metrics)], dtype=_F64)
        if isinstance(metrics, Sequence) and not isinstance(metrics, str):
            if len(metrics) != B:
                raise ValueError(
                    f"ReduceLROnPlateau.step: expected one metric per model (B={B}), got {len(metrics)}"
                )
            return torch.tensor([self._metric(m, b) for b, m in enumerate(metrics)], dtype=_F64)
        raise TypeError(
            f"ReduceLROnPlateau.step: expected metrics as a [B] tensor, a numpy array or a length-B "
            f"sequence, got {type(metrics).__name__}"
        )

    @staticmethod
    def _metric(m: object, b: int) -> float:
        """Model b's metric of a sequence, as torch's ``float(metrics)`` takes it."""
        if isinstance(m, torch.Tensor) and m.is_complex():  # float() would drop the imaginary part
            raise TypeError(f"ReduceLROnPlateau.step: the metric of model {b} must be a real number, got a "
                            f"{m.dtype} tensor")
        try:
            return float(m)
        except (TypeError, ValueError, RuntimeError) as e:
            kind = ValueError if isinstance(e, ValueError) else TypeError
            raise kind(
                f"ReduceLROnPlateau.step: the metric of model {b} must be a real number, got "
                f"{type(m).__name__} {m!r}"
            ) from None

    @host_step
    def step(  # type: ignore[override]
        self, metrics: Sequence[float] | torch.Tensor, epoch: _Epochs | None = None
    ) -> None:
        """Record one epoch's metrics, ``[B]`` (one per model), and reduce where a plateau is reached.

        ``epoch`` (deprecated, as in torch, which warns) sets each model's epoch:
        one int for every model, or one per model (a length-B sequence of ints,
        or a 1-D integer tensor or numpy array). Bad metrics or a bad epoch
        raise before anything changes: metrics that are not real numbers (a
        complex tensor, a None entry) a TypeError naming the model where one is.
        Bools count as 0 and 1, as torch's ``float(metrics)`` takes them.
        """
        current = self._metrics(metrics)
        if epoch is None:
            epochs = self.last_epochs + 1
        else:
            epochs = _step_epochs(epoch, self.B, "ReduceLROnPlateau.step")
            warnings.warn(_EPOCH_DEPRECATION_WARNING, UserWarning, stacklevel=3)
        with _kept_on_error(self):
            self.last_epochs = epochs

            better = self._is_better(current, self.best)
            self.best = torch.where(better, current, self.best)
            self.num_bad_epochs = torch.where(better, 0, self.num_bad_epochs + 1)

            cooling = self.in_cooldown
            self.cooldown_counter = torch.where(cooling, self.cooldown_counter - 1, self.cooldown_counter)
            # Bad epochs during a cooldown do not count.
            self.num_bad_epochs = torch.where(cooling, 0, self.num_bad_epochs)

            reduce = self.num_bad_epochs > self.patience
            if reduce.any():
                self._reduce_lr(self.last_epoch, reduce)
            self.cooldown_counter = torch.where(reduce, self.cooldown, self.cooldown_counter)
            self.num_bad_epochs = torch.where(reduce, 0, self.num_bad_epochs)
            self._last_lr = [_current_lr(self.optimizer, g, self.B).clone() for g in self.optimizer.param_groups]

    def _reduce_lr(self, epoch: int, models: torch.Tensor | None = None) -> None:
        B = self.B
        groups = self.optimizer.param_groups
        if len(groups) != len(self.min_lrs):
            if self.default_min_lr is None:
                raise RuntimeError(
                    f"ReduceLROnPlateau: the optimizer has {len(groups)} param groups but min_lr was given "
                    f"for {len(self.min_lrs)}; set the scheduler's min_lrs to one [B] tensor per group"
                )
            self.min_lrs = [self.default_min_lr.clone() for _ in groups]
        if models is None:
            models = torch.ones(B, dtype=torch.bool)
        changes = []
        for group, min_lr in zip(groups, self.min_lrs):
            old = _current_lr(self.optimizer, group, B)
            new = torch.maximum(old * self.factor, min_lr)
            change = models & (old - new > self.eps)
            if change.any():
                changes.append((group, torch.where(change, new, old)))
        for group, values in changes:
            _set_lr(self.optimizer, group, values, B)

    @property
    def in_cooldown(self) -> torch.Tensor:
        """``[B]`` bool: the models still cooling down after a reduction."""
        return self.cooldown_counter > 0

    def _is_better(self, a: torch.Tensor, best: torch.Tensor) -> torch.Tensor:
        if self.mode == "min" and self.threshold_mode == "rel":
            return a < best * (1.0 - self.threshold)
        if self.mode == "min" and self.threshold_mode == "abs":
            return a < best - self.threshold
        if self.mode == "max" and self.threshold_mode == "rel":
            return a > best * (self.threshold + 1.0)
        return a > best + self.threshold

    def _init_is_better(self, mode: str, threshold: object, threshold_mode: str) -> None:
        if mode not in ("min", "max"):
            raise ValueError(f"mode must be 'min' or 'max', got {mode!r}")
        if threshold_mode not in ("rel", "abs"):
            raise ValueError(f"threshold_mode must be 'rel' or 'abs', got {threshold_mode!r}")
        self.mode_worse = math.inf if mode == "min" else -math.inf
        self.mode = mode
        self.threshold = _floats(threshold, self.B, "threshold")
        self.threshold_mode = threshold_mode

    def get_last_lr(self) -> list[torch.Tensor]:
        """The current learning rates: one ``[B]`` float64 CPU tensor per param group."""
        return self._last_lr

    def _apply_state(self, new: dict[str, Any]) -> None:
        self._store(new)
        self.mode_worse = math.inf if self.mode == "min" else -math.inf
