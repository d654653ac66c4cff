"""hfkern::*_step_: one optimizer step of B models as one in-place op per family.

Ops (registered with torch.library, implementations chosen by the registry)::

    sgd_step_(params, grads, momentum_buffers, steps, hypers, nesterov, maximize,
              has_weight_decay, skip) -> ()
    adam_step_(params, grads, exp_avgs, exp_avg_sqs, max_exp_avg_sqs, steps, hypers,
               amsgrad, maximize, decoupled_weight_decay, has_weight_decay, skip) -> ()
    adagrad_step_(params, grads, state_sums, steps, hypers, maximize, has_weight_decay,
                  skip) -> ()
    adadelta_step_(params, grads, square_avgs, acc_deltas, steps, hypers, maximize,
                   has_weight_decay, skip) -> ()
    rmsprop_step_(params, grads, square_avgs, grad_avgs, momentum_buffers, steps, hypers,
                  centered, maximize, has_weight_decay, skip) -> ()
    lars_step_(params, grads, momentum_buffers, steps, hypers, exclude_1d, maximize,
               has_weight_decay, skip) -> ()
    lamb_step_(params, grads, exp_avgs, exp_avg_sqs, steps, hypers, bias_correction,
               exclude_1d, maximize, has_weight_decay, skip) -> ()
    nonfinite_models(grads) -> Tensor  # [B] bool

Conventions shared by every ``*_step_`` op (model b is index b of every dim 0):

* ``params``: n tensors ``[B, *shape_i]`` of float32, float64, bfloat16 or float16,
  updated in place. ``grads``: n tensors with the shape and dtype of ``params[i]``,
  read only. All tensors of one call live on one device (``hypers`` included;
  ValueError otherwise). For a bfloat16/float16 parameter the update is
  computed in float32 from the parameter's value and rounded into the
  parameter once, at the end.
* State lists (``exp_avgs``, ...): n tensors ``[B, *shape_i]`` in the *state
  dtype*, float64 for a float64 parameter and float32 otherwise, updated in
  place; an optional state list is empty (length 0) when its option is off.
  The optimizers allocate state with the parameter's strides
  (``torch.zeros_like(p, dtype=...)``); ``params``, ``grads`` and state are dense.
  A tensor the op writes (a parameter, a state tensor, a step count) that stores
  an element twice (an expanded one: a stride-0 dim of size > 1) raises ValueError.
  Every check runs before anything is written.
  A momentum buffer is present when any model has momentum, and a model whose
  momentum is 0 leaves its slice untouched (torch keeps no buffer for it and
  steps without one): switched off, a model's buffer waits as it was, and
  switched on again it resumes from there, as torch's does.
* ``steps``: n ``[B]`` float32 tensors, how many updates each model has made to
  parameter i (integers held exactly up to 2**24). An op first adds 1 for every
  model it updates, and the update uses the incremented count. ``sgd_step_``
  counts only the updates with momentum (momentum != 0): its count is 0 until a
  model's buffer starts.
* ``hypers``: ``[H, B]`` tensor of per-model hyperparameters, one row each in the
  order the op documents; float64 when every parameter is float64, else
  float32. It is read from device memory at every call (a scheduler writes new
  learning rates into it in place), so nothing depends on its values on the
  host. Arithmetic on hyperparameters (``1 - beta``, bias corrections, ...) is
  done in ``hypers.dtype`` at run time.
* Each op's rows, state lists and flags are declared once, by name, in
  :mod:`hfkern._optim_specs` (``SGD_SPEC``, ...); the checks here, every backend's
  implementation and the optimizer classes read them from that declaration.
* ``has_weight_decay``: False promises that every model's weight_decay is 0; a
  backend may then skip the weight decay terms. With True they are computed for
  every model (for a model with weight_decay 0 they change nothing).
* ``maximize``: the update ascends: ``g = -grad``.
* ``skip``: None, or a ``[B]`` bool tensor. A model marked True is not updated:
  its slice of every parameter, every state tensor and every step count is left
  bit-identical, whatever its gradients hold (inf and NaN included). Other
  models compute exactly what they compute without a mask.

Models never interact: every value of model b depends only on model b's slices,
its hyperparameter column ``hypers[:, b]`` and its step counts, so a kernel may
process any (tensor, model, chunk) tile independently (one launch over a chunk
table of every parameter). The step counts must be read before any program
increments them (e.g. each program computes ``step + 1`` itself and one program
per tensor writes it back, or a separate pass increments them).

In the formulas below every operation is element-wise on model b's slice and
scalar names are model b's entries of ``hypers``; ``t`` is the incremented step
count of that parameter and model.

Layer-wise adaptive steps (``lars_step_``, ``lamb_step_``) scale the update of
each (parameter i, model b) by a *trust ratio* made of two Euclidean norms over
model b's whole slice of parameter i (``||x||`` below: over every element of the
slice, accumulated in float32, float64 for float64 parameters). Such a ratio
couples the elements of a slice but never two slices: models and tensors stay
independent. With ``exclude_1d`` a parameter whose per-model shape has at most
one dim (``[B]`` or ``[B, n]``: biases, norm weights) is *excluded*: its ratio
is 1 and it gets no weight decay. The ratio is computed in ``hypers.dtype``
from the norms, which are computed in the math dtype.

``nonfinite_models(grads)``: ``[B]`` bool, True for every model with an inf or
NaN in any of the n ``[B, ...]`` gradients (on grads[0]'s device).
"""

from __future__ import annotations

import inspect
import itertools
import math
from operator import attrgetter, itemgetter
from types import SimpleNamespace
from typing import Any, Callable, Sequence

import torch
from torch import Tensor

from .. import _backend
from .._dtypes import FLOAT_DTYPES, acc_dtype
from .._optim_specs import (
    ADADELTA_SPEC, ADAGRAD_SPEC, ADAM_SPEC, LAMB_SPEC, LARS_SPEC, RMSPROP_SPEC, SGD_SPEC, OptimizerSpec,
    excluded,
)

__all__ = [
    "sgd_step_", "adam_step_", "adagrad_step_", "adadelta_step_", "rmsprop_step_", "lars_step_",
    "lamb_step_", "excluded", "nonfinite_models",
]


# ---- checks and op definition ----------------------------------------------------

def _check(spec: OptimizerSpec, args: Sequence[Any]) -> None:
    """Shapes, dtypes, list lengths, devices and memory of the op's arguments (in
    ``spec.args`` order): metadata only, never a device value. Everything is checked
    before the op writes anything, so a call that raises leaves every tensor as it was."""
    op = spec.op
    n_states = len(spec.states)
    params, grads = args[0], args[1]
    lists = dict(zip(spec.state_args, args[2 : 2 + n_states]))
    steps, hypers = args[2 + n_states], args[3 + n_states]
    flags = dict(zip(spec.flags, args[4 + n_states : -1]))
    skip = args[-1]

    def required(when: str) -> bool:
        if not when:
            return True
        if when in flags:
            return bool(flags[when])
        # A row's condition: the caller decided by the values; every list that
        # follows the row must agree with the first one.
        return bool(next(lists[a] for a, _, w in spec.states if w == when))

    n = len(params)
    if len(grads) != n:
        raise ValueError(f"hfkern::{op}: expected {n} grads (one per parameter), got {len(grads)}")
    if n and params[0].dim() == 0:  # (B is read from it below)
        raise ValueError(
            f"hfkern::{op}: expected every parameter of shape [B, ...] (array dim first), got [] at index 0"
        )
    rows = spec.rows
    if hypers.dim() != 2 or hypers.size(0) != len(rows) or (n and hypers.size(1) != params[0].size(0)):
        B = params[0].size(0) if n else "B"
        raise ValueError(
            f"hfkern::{op}: expected hypers of shape [{len(rows)}, {B}] (rows {list(rows)}), "
            f"got {list(hypers.shape)}"
        )
    if hypers.dtype not in (torch.float32, torch.float64):
        raise TypeError(f"hfkern::{op}: expected float32 or float64 hypers, got {hypers.dtype}")
    if hypers.dtype == torch.float64 and any(p.dtype != torch.float64 for p in params):
        raise TypeError(
            f"hfkern::{op}: expected float32 hypers (float64 only when every parameter is float64), "
            f"got float64 hypers with {sorted({str(p.dtype) for p in params} - {'torch.float64'})} parameters"
        )
    counted = [(arg, lists[arg], required(when)) for arg, _, when in spec.states]
    counted.append(("steps", steps, required(spec.steps_when)))
    for name, lst, req in counted:
        expected = n if req else 0
        if len(lst) != expected:
            raise ValueError(
                f"hfkern::{op}: expected {name} to hold {expected} tensors "
                f"({'one per parameter' if req else 'empty: its option is off'}), got {len(lst)}"
            )
    if n == 0:
        return
    B = params[0].size(0)
    if not _lists_match(params, grads, lists, steps, B):
        _explain_mismatch(op, params, grads, lists, steps, B)
    if not _placement_ok(params, grads, lists, steps, hypers):
        _explain_placement(op, params, grads, lists, steps, hypers)
    if skip is not None and (
        skip.dtype != torch.bool or skip.shape != (B,) or skip.device != params[0].device
    ):
        raise ValueError(
            f"hfkern::{op}: expected skip of shape [{B}] and dtype torch.bool on {params[0].device}, "
            f"got {list(skip.shape)} {skip.dtype} on {skip.device}"
        )


# The checks below run at every step over every tensor of the step: they read one
# attribute of every tensor of a list at a time (``map`` with an attribute getter,
# no Python code per tensor) and compare lists, and look at single tensors only to
# explain a failure.
_shape_of, _dtype_of, _device_of, _is_cpu = (attrgetter(a) for a in ("shape", "dtype", "device", "is_cpu"))
_first = itemgetter(0)
_is_contiguous = Tensor.is_contiguous


def _lists_match(params, grads, lists: dict, steps, B: int) -> bool:
    """Whether every tensor list fits ``params`` (the conditions :func:`_explain_mismatch`
    names), compared list against list: a step checks every call, so the common case
    costs a few list comparisons rather than Python branches per tensor."""
    shapes = list(map(_shape_of, params))
    dtypes = list(map(_dtype_of, params))
    kinds = set(dtypes)
    # (an empty torch.Size is false: every parameter has a dim 0, which is B)
    if not (all(shapes) and list(map(_first, shapes)) == [B] * len(shapes)) or not kinds <= _FLOAT_SET:
        return False
    if list(map(_shape_of, grads)) != shapes or list(map(_dtype_of, grads)) != dtypes:
        return False
    if len(kinds) == 1:  # one dtype: one state dtype
        state_dtypes = [acc_dtype(dtypes[0])] * len(dtypes)
    else:
        state_dtypes = [acc_dtype(d) for d in dtypes]
    for lst in lists.values():
        if lst and (list(map(_shape_of, lst)) != shapes or list(map(_dtype_of, lst)) != state_dtypes):
            return False
    return not steps or (list(map(_shape_of, steps)) == [(B,)] * len(steps)
                         and set(map(_dtype_of, steps)) == _FLOAT32_SET)


_FLOAT_SET = frozenset(FLOAT_DTYPES)
_FLOAT32_SET = frozenset({torch.float32})


def _written(params, lists: dict, steps) -> list[list[Tensor]]:
    """The tensor lists a step writes in place."""
    return [params, *(lst for lst in lists.values() if lst), steps]


def _placement_ok(params, grads, lists: dict, steps, hypers: Tensor) -> bool:
    """Whether every tensor lies on ``params[0]``'s device and every tensor the step writes
    has no overlapping elements (the conditions :func:`_explain_placement` names). A tensor
    with a stride-0 dim of size > 1 (an expanded one) is never contiguous, so the common
    case is one ``is_contiguous`` per written tensor; only tensors that are not (a
    channels-last weight and its state) have their strides read."""
    device = params[0].device
    every = itertools.chain(params, grads, *lists.values(), steps, (hypers,))
    # (on the CPU a flag per tensor: reading a device makes an object)
    if not (all(map(_is_cpu, every)) if device.type == "cpu" else set(map(_device_of, every)) == {device}):
        return False
    written = itertools.chain.from_iterable(_written(params, lists, steps))
    return all(map(_is_contiguous, written)) or not any(
        _overlapping(t) for t in itertools.chain.from_iterable(_written(params, lists, steps))
        if not t.is_contiguous()
    )


def _overlapping(t: Tensor) -> bool:
    """Whether ``t`` addresses an element more than once through a stride-0 dim of size > 1
    (an expanded tensor: ``expand``, ``broadcast_to``)."""
    return any(stride == 0 and size > 1 for size, stride in zip(t.shape, t.stride()))


def _explain_placement(op: str, params, grads, lists: dict, steps, hypers: Tensor) -> None:
    """Raise for the first tensor :func:`_placement_ok` rejects."""
    device = params[0].device
    named = [("params", params), ("grads", grads), *lists.items(), ("steps", steps)]
    for name, lst in named:
        for i, t in enumerate(lst):
            if t.device != device:
                raise ValueError(
                    f"hfkern::{op}: expected every tensor on one device (params[0]'s, {device}), "
                    f"got {name}[{i}] on {t.device}"
                )
    if hypers.device != device:
        raise ValueError(
            f"hfkern::{op}: expected every tensor on one device (params[0]'s, {device}), got hypers on {hypers.device}"
        )
    for name, lst in named:
        if name == "grads":  # read only
            continue
        for i, t in enumerate(lst):
            if _overlapping(t):
                raise ValueError(
                    f"hfkern::{op}: expected {name}[{i}] in dense memory (updated in place: no element "
                    f"stored twice), got shape {list(t.shape)} with strides {list(t.stride())} (an expanded "
                    "tensor; pass a copy, e.g. .clone())"
                )
    raise AssertionError(f"hfkern::{op}: tensors judged misplaced, but none is")


def _explain_mismatch(op: str, params, grads, lists: dict, steps, B: int) -> None:
    """Raise for the first tensor that does not fit (see :func:`_lists_match`)."""
    for i, (p, g) in enumerate(zip(params, grads)):
        if p.dim() == 0 or p.size(0) != B:
            raise ValueError(
                f"hfkern::{op}: expected every parameter of shape [B={B}, ...], got {list(p.shape)} at index {i}"
            )
        if p.dtype not in FLOAT_DTYPES:
            raise TypeError(f"hfkern::{op}: expected a floating-point parameter, got {p.dtype} at index {i}")
        if g.shape != p.shape or g.dtype != p.dtype:
            raise ValueError(
                f"hfkern::{op}: expected grads[{i}] of shape {list(p.shape)} and dtype {p.dtype} "
                f"(its parameter's), got {list(g.shape)} {g.dtype}"
            )
        sdt = acc_dtype(p.dtype)
        for name, lst in lists.items():
            if lst and (lst[i].shape != p.shape or lst[i].dtype != sdt):
                raise ValueError(
                    f"hfkern::{op}: expected {name}[{i}] of shape {list(p.shape)} and dtype {sdt}, "
                    f"got {list(lst[i].shape)} {lst[i].dtype}"
                )
        if steps and (steps[i].shape != (B,) or steps[i].dtype != torch.float32):
            raise ValueError(
                f"hfkern::{op}: expected steps[{i}] of shape [{B}] and dtype float32, "
                f"got {list(steps[i].shape)} {steps[i].dtype}"
            )
    raise AssertionError(f"hfkern::{op}: tensor lists judged mismatched, but no tensor differs")


def _step_op(spec: OptimizerSpec) -> Callable[[Callable], Any]:
    """Define the decorated function (its signature: the op's schema; its docstring:
    the math) as ``hfkern::<spec.op>``, with the fake kernel that checks its arguments."""
    def define(fn: Callable) -> Any:
        signature = inspect.signature(fn)
        if tuple(signature.parameters) != spec.args:
            raise TypeError(
                f"hfkern::{spec.op}: expected the arguments {spec.args}, got {tuple(signature.parameters)}"
            )
        op = torch.library.custom_op(f"hfkern::{spec.op}", fn, mutates_args=spec.mutated)

        @op.register_fake
        def _(*args, **kwargs):
            _check(spec, signature.bind(*args, **kwargs).args)

        return op

    return define


def check_step(spec: OptimizerSpec, *args: Any) -> None:
    """The checks the op ``spec.op`` makes of its arguments, without running it (an optimizer
    checks every group's arguments before the first group steps)."""
    _check(spec, args)


def run_step(spec: OptimizerSpec, *args: Any) -> None:
    """Check the arguments and run the implementation the registry picks: the op's body,
    which the array optimizers call directly on the torch backend outside
    ``torch.compile`` (no dispatcher)."""
    _check(spec, args)
    if args[0]:
        _backend.resolve(spec.op, args[0][0].device)(*args)


# ---- the torch implementation (CPU path and oracle) ------------------------------
#
# ``torch._foreach_*`` over every parameter. A per-model hyperparameter (``[B]``)
# enters the foreach calls as a ``[B, 1, ...]`` view per tensor, so one call
# serves every model, and per-(parameter, model) quantities such as bias
# corrections are computed once on the stacked ``[n, B]`` step counts. Nothing
# reads a device value on the host and nothing loops over models. The arithmetic
# follows torch.optim's single-tensor implementations operation by operation
# (same operands, same order), so that a model's trajectory matches torch's to
# rounding; the Triton kernels follow this order too.

_ONE = torch.ones((), dtype=torch.float32, device="cpu")  # the increment of the float32 step counts


def _rows(spec: OptimizerSpec, hypers: Tensor) -> SimpleNamespace:
    """The ``[B]`` rows of ``hypers`` by name (``h.lr``, ``h.beta1``, ...)."""
    return SimpleNamespace(**dict(zip(spec.rows, hypers.unbind(0))))


def _col(h: Tensor, like: Tensor) -> Tensor:
    """The ``[B]`` tensor ``h`` as ``[B, 1, ...]``, broadcasting against ``like`` ([B, ...])."""
    return h.view(h.shape[0], *([1] * (like.dim() - 1)))


_rank = Tensor.dim
_ACC_DTYPES = frozenset({torch.float32, torch.float64})  # the dtypes that are their own acc_dtype


# A step passes a dozen lists of such columns, and on the CPU every view is a
# dispatched op that costs about what a small parameter's update costs: the
# lists share one view per rank (and dtype) instead of making one per tensor.

def _cols(h: Tensor, tensors: Sequence[Tensor], *, match_dtype: bool = False) -> list[Tensor]:
    """``_col(h, t)`` for every ``t`` in ``tensors``; with ``match_dtype`` each in its
    tensor's dtype (foreach lerp wants its weight in the tensor's dtype, and one
    group may mix float64 state with float32 hyperparameters)."""
    # (the per-tensor loops in C: map over the tensors, then over their keys)
    keys = list(zip(map(_rank, tensors), map(_dtype_of, tensors))) if match_dtype else list(map(_rank, tensors))
    made = {}
    for key in set(keys):
        rank, dtype = key if match_dtype else (key, None)
        made[key] = (h.to(dtype) if match_dtype else h).view(h.shape[0], *([1] * (rank - 1)))
    return list(map(made.__getitem__, keys))


class _Columns:
    """Per-(parameter, model) quantities as columns broadcasting against the parameters.

    An ``[n, B]`` tensor of such quantities is kept with its rows in *rank order*
    (the parameters grouped by rank, :meth:`stack` builds it so), so that each rank's
    rows are one slice, viewed as ``[k, B, 1, ...]`` and split by one ``unbind``: C++
    makes the n column views, rather than a view op per parameter, and nothing is
    gathered (no index tensor, which a captured CUDA graph could not copy to the device).
    Every list of a step (parameters, gradients, state) has the parameters' ranks in
    the parameters' order, so one instance serves them all.
    """

    def __init__(self, tensors: Sequence[Tensor]):
        ranks = list(map(_rank, tensors))
        # the parameters in rank order (stable: by rank, then by position), and per rank its count
        self.order = sorted(range(len(ranks)), key=ranks.__getitem__)
        counts: dict[int, int] = {}
        for r in ranks:
            counts[r] = counts.get(r, 0) + 1
        self._counts = sorted(counts.items())
        # where each parameter's column is among the columns made in rank order
        self._position = [0] * len(ranks)
        for k, i in enumerate(self.order):
            self._position[i] = k

    def stack(self, rows: Sequence[Tensor]) -> Tensor:
        """``[n, B]``: the ``[B]`` tensors ``rows`` (one per parameter) in rank order."""
        return torch.stack([rows[i] for i in self.order])

    def ordered(self, indices: Sequence[int]) -> list[int]:
        """Parameters ``indices`` in rank order."""
        chosen = set(indices)
        return [i for i in self.order if i in chosen]

    def rows(self, indices: Sequence[int], values: Tensor, default: Tensor) -> Tensor:
        """``[n, B]`` in rank order: for the parameters ``indices`` the rows of ``values``
        (one per parameter, in :meth:`ordered` order), for the others the ``[B]``
        ``default``; concatenated slices, no index."""
        chosen = set(indices)
        pieces, taken = [], 0
        for is_chosen, run in itertools.groupby(self.order, key=chosen.__contains__):
            k = len(list(run))
            pieces.append(values[taken:taken + k] if is_chosen else default.expand(k, -1))
            taken += k if is_chosen else 0
        return torch.cat(pieces)

    def __call__(self, x: Tensor) -> list[Tensor]:
        """Row r of the rank-ordered ``[n, B]`` ``x`` as the column of its parameter, in the
        parameters' order."""
        made: list[Tensor] = []
        start = 0
        for rank, k in self._counts:
            rows = x[start:start + k]
            made += rows.reshape(*rows.shape, *([1] * (rank - 1))).unbind(0)
            start += k
        return list(map(made.__getitem__, self._position))


class _Targets:
    """The tensors a step writes, as the math sees them, and their write-back.

    Without a skip mask a float32/float64 tensor is updated directly. A
    bfloat16/float16 parameter is updated through a float32 copy that
    :meth:`commit` rounds into it once. With a mask every written tensor goes
    through a copy, and :meth:`commit` keeps the stored values of the skipped
    models (``torch.where``, so inf/NaN computed for them never lands).
    """

    def __init__(self, skip: Tensor | None):
        self.skip = skip
        self._copies: list[tuple[Tensor, Tensor]] = []

    def __call__(self, tensors: Sequence[Tensor]) -> list[Tensor]:
        if self.skip is None and set(map(_dtype_of, tensors)) <= _ACC_DTYPES:
            return list(tensors)  # every tensor updated directly (the loop below, in C)
        out = []
        for t in tensors:
            dtype = acc_dtype(t.dtype)
            if self.skip is None and t.dtype == dtype:
                out.append(t)
            else:
                w = t.to(dtype, copy=True)
                self._copies.append((t, w))
                out.append(w)
        return out

    def commit(self) -> None:
        if not self._copies:
            return
        stored = [s for s, _ in self._copies]
        work = [w for _, w in self._copies]
        if self.skip is not None:
            for s, w in zip(stored, work):
                torch.where(_col(self.skip, w), s, w, out=w)
        torch._foreach_copy_(stored, work)


def _advance(steps: list[Tensor], skip: Tensor | None, counted: Tensor | None = None) -> None:
    """Count one update for every model that is not skipped (and, given the ``[B]``
    bool ``counted``, is marked True in it)."""
    if not steps:
        return
    if counted is None and skip is None:
        if steps[0].device.type == "cpu":
            # A tensor increment: on the CPU a Python number would be wrapped into a new
            # tensor for every count (three dispatched ops each).
            torch._foreach_add_(steps, [_ONE] * len(steps))
        else:
            # A number: one multi-tensor kernel, where a host tensor's increment is a
            # kernel per count (a foreach list with a tensor on another device).
            torch._foreach_add_(steps, 1.0)
        return
    live = ~skip if counted is None else (counted if skip is None else counted & ~skip)
    # [B] increments on the counts' device: a list of tensors shaped like the counts
    torch._foreach_add_(steps, [live.to(steps[0].dtype)] * len(steps))


def _direction(
    grads: Sequence[Tensor], params: list[Tensor], weight_decay: Tensor | None, maximize: bool
) -> list[Tensor]:
    """The gradient the update follows: in the math dtype, negated to maximize, plus
    ``weight_decay * param`` when given. May alias ``grads``: read only."""
    # g.to(g.dtype) would return g, but through a dispatched op per tensor
    if set(map(_dtype_of, grads)) <= _ACC_DTYPES:
        d = list(grads)
    else:
        d = [g if g.dtype == acc_dtype(g.dtype) else g.to(acc_dtype(g.dtype)) for g in grads]
    if maximize:
        d = torch._foreach_neg(d)
    if weight_decay is not None:
        d = torch._foreach_addcmul(d, params, _cols(weight_decay, params))
    return d


def _ema_sq_(avgs: list[Tensor], d: list[Tensor], decay: Tensor) -> None:
    """``avg = decay * avg + (1 - decay) * d * d``, as torch's ``mul_(decay).addcmul_(d, d, value=1 - decay)``."""
    torch._foreach_mul_(avgs, _cols(decay, avgs))
    torch._foreach_addcmul_(avgs, torch._foreach_mul(d, _cols(1 - decay, d)), d)


def _add_scaled_ratio_(
    p: list[Tensor], num: list[Tensor], sq: list[Tensor], eps: Tensor, scale: Tensor, columns: _Columns,
    root_divisor: Tensor | None = None,
) -> None:
    """``p += scale * num / (sqrt(sq) [/ root_divisor] + eps)``; ``scale`` and
    ``root_divisor`` are per (parameter, model), ``[n, B]`` in ``columns``' rank order."""
    denom = torch._foreach_sqrt(sq)
    if root_divisor is not None:
        torch._foreach_div_(denom, columns(root_divisor))
    torch._foreach_add_(denom, _cols(eps, denom))
    update = torch._foreach_div(num, denom)
    del denom
    torch._foreach_addcmul_(p, update, columns(scale))


def _bias_correction(beta: Tensor, t: Tensor) -> Tensor:
    """``1 - beta ** t`` for ``t`` ``[n, B]``, without cancellation where ``beta ** t`` is near 1."""
    return -torch.expm1(t * torch.log(beta))


# ---- SGD -------------------------------------------------------------------

# A model whose momentum is 0 keeps its momentum buffer as it was and steps without
# it (SGD, RMSprop, LARS). The torch path blends the two per model with 0/1 factors
# in its foreach ops (one launch over every tensor) rather than a torch.where per
# tensor: for a model with momentum ``buf * 1 + u * 0`` is exactly ``buf``, for one
# without ``u``, wherever the values are finite (a skipped model's slices are
# restored by _Targets whatever they hold).

@_step_op(SGD_SPEC)
def sgd_step_(
    params: list[Tensor], grads: list[Tensor], momentum_buffers: list[Tensor], steps: list[Tensor],
    hypers: Tensor, nesterov: bool, maximize: bool, has_weight_decay: bool, skip: Tensor | None,
) -> None:
    """``torch.optim.SGD``'s step for each of B models, in place.

    ``hypers`` rows: ``lr, momentum, dampening, weight_decay``.
    ``momentum_buffers`` and ``steps``: both empty (no model has momentum: plain
    SGD, no state) or both one per parameter. ``steps`` counts each model's
    updates with momentum, so a model's buffer starts at its first update with
    momentum (count 0 before it; the optimizers allocate zeros), as torch's
    starts as a copy of the first gradient it sees. A model with momentum 0
    steps with its gradient and leaves its buffer and count as they were (torch
    keeps no buffer in use for it), so that switched on again it resumes from
    them as torch's does, or starts if it never had. (One exception, on the
    torch backend only: an inf or NaN in such a model's gradient reaches its
    buffer as NaN, since the torch path blends the two cases with factors 0
    and 1; its parameters are non-finite after that step anyway, and a skipped
    model's buffer is kept. RMSprop and LARS alike.)::

        g = -grad if maximize else grad
        g = g + weight_decay * p                         # has_weight_decay
        if momentum_buffers and momentum != 0:
            t = t + 1
            if t == 1: buf = g                           # first update with momentum
            else:      buf = momentum * buf + (1 - dampening) * g
            g = g + momentum * buf if nesterov else buf
        p = p - lr * g
    """
    run_step(SGD_SPEC, params, grads, momentum_buffers, steps, hypers, nesterov, maximize, has_weight_decay, skip)


@_backend.implements(SGD_SPEC.op, "torch")
def sgd_step_torch(params, grads, momentum_buffers, steps, hypers, nesterov, maximize, has_weight_decay, skip):
    h = _rows(SGD_SPEC, hypers)
    targets = _Targets(skip)
    p = targets(params)
    d = _direction(grads, p, h.weight_decay if has_weight_decay else None, maximize)
    if not momentum_buffers:
        torch._foreach_addcmul_(p, d, _cols(-h.lr, p))
        targets.commit()
        return
    on = h.momentum != 0
    # A model's first update with momentum sets its buffer to the gradient (torch
    # clones it): from zeros that is buf * 0 + g * 1. A model without momentum keeps
    # its buffer: buf * 1 + g * 0.
    columns = _Columns(p)
    first = columns.stack(steps) == 0
    decay = torch.where(on, torch.where(first, 0.0, h.momentum), 1.0)
    scale = torch.where(on, torch.where(first, 1.0, 1 - h.dampening), 0.0)
    bufs = targets(momentum_buffers)
    torch._foreach_mul_(bufs, columns(decay))
    torch._foreach_addcmul_(bufs, d, columns(scale))
    if nesterov:
        # (every model has momentum; one without, from an in-place edit, gets g + 0 * buf)
        d = torch._foreach_addcmul(d, bufs, _cols(h.momentum, bufs))
        torch._foreach_addcmul_(p, d, _cols(-h.lr, p))
    else:
        # p - lr * buf with momentum, p - lr * g without
        o = on.to(hypers.dtype)
        torch._foreach_addcmul_(p, bufs, _cols(-h.lr * o, p))
        torch._foreach_addcmul_(p, d, _cols(-h.lr * (1 - o), p))
    _advance(steps, skip, on)
    targets.commit()


# ---- Adam / AdamW ------------------------------------------------------------

@_step_op(ADAM_SPEC)
def adam_step_(
    params: list[Tensor], grads: list[Tensor], exp_avgs: list[Tensor], exp_avg_sqs: list[Tensor],
    max_exp_avg_sqs: list[Tensor], steps: list[Tensor], hypers: Tensor, amsgrad: bool, maximize: bool,
    decoupled_weight_decay: bool, has_weight_decay: bool, skip: Tensor | None,
) -> None:
    """``torch.optim.Adam`` (``AdamW`` with ``decoupled_weight_decay``) for each of B models, in place.

    ``hypers`` rows: ``lr, beta1, beta2, eps, weight_decay``. ``max_exp_avg_sqs``
    is one per parameter with ``amsgrad``, else empty. State starts at zero::

        g = -grad if maximize else grad
        if has_weight_decay:
            if decoupled_weight_decay: p = p * (1 - lr * weight_decay)
            else:                      g = g + weight_decay * p
        exp_avg    = lerp(exp_avg, g, 1 - beta1)          # torch.lerp's formula
        exp_avg_sq = beta2 * exp_avg_sq + (1 - beta2) * g * g
        v = exp_avg_sq
        if amsgrad: max_exp_avg_sq = max(max_exp_avg_sq, exp_avg_sq); v = max_exp_avg_sq
        bc1 = 1 - beta1 ** t;  bc2 = 1 - beta2 ** t
        p = p - (lr / bc1) * exp_avg / (sqrt(v) / sqrt(bc2) + eps)

    The bias corrections are per model and parameter (each has its own ``t``).
    ``1 - beta ** t`` is computed as ``-expm1(t * log(beta))``, which keeps full
    relative precision where ``beta ** t`` is close to 1 (``beta = 0`` gives 1).
    """
    run_step(ADAM_SPEC, params, grads, exp_avgs, exp_avg_sqs, max_exp_avg_sqs, steps, hypers,
             amsgrad, maximize, decoupled_weight_decay, has_weight_decay, skip)


@_backend.implements(ADAM_SPEC.op, "torch")
def adam_step_torch(params, grads, exp_avgs, exp_avg_sqs, max_exp_avg_sqs, steps, hypers,
                    amsgrad, maximize, decoupled_weight_decay, has_weight_decay, skip):
    h = _rows(ADAM_SPEC, hypers)
    _advance(steps, skip)
    targets = _Targets(skip)
    p = targets(params)
    coupled = has_weight_decay and not decoupled_weight_decay
    d = _direction(grads, p, h.weight_decay if coupled else None, maximize)
    if has_weight_decay and decoupled_weight_decay:
        torch._foreach_mul_(p, _cols(1 - h.lr * h.weight_decay, p))
    m, v = targets(exp_avgs), targets(exp_avg_sqs)
    torch._foreach_lerp_(m, d, _cols(1 - h.beta1, m, match_dtype=True))
    _ema_sq_(v, d, h.beta2)
    if amsgrad:
        v_max = targets(max_exp_avg_sqs)
        torch._foreach_maximum_(v_max, v)
        v = v_max
    columns = _Columns(p)
    t = columns.stack(steps).to(hypers.dtype)
    step_size = h.lr / _bias_correction(h.beta1, t)
    bc2_sqrt = _bias_correction(h.beta2, t).sqrt()
    _add_scaled_ratio_(p, m, v, h.eps, -step_size, columns, bc2_sqrt)
    targets.commit()


# ---- Adagrad -------------------------------------------------------------------

@_step_op(ADAGRAD_SPEC)
def adagrad_step_(
    params: list[Tensor], grads: list[Tensor], state_sums: list[Tensor], steps: list[Tensor],
    hypers: Tensor, maximize: bool, has_weight_decay: bool, skip: Tensor | None,
) -> None:
    """``torch.optim.Adagrad`` (dense gradients) for each of B models, in place.

    ``hypers`` rows: ``lr, lr_decay, weight_decay, eps``. ``state_sums`` start at
    each model's ``initial_accumulator_value`` (set by the optimizer)::

        g = -grad if maximize else grad
        g = g + weight_decay * p                         # has_weight_decay
        clr = lr / (1 + (t - 1) * lr_decay)
        state_sum = state_sum + g * g
        p = p - clr * g / (sqrt(state_sum) + eps)
    """
    run_step(ADAGRAD_SPEC, params, grads, state_sums, steps, hypers, maximize, has_weight_decay, skip)


@_backend.implements(ADAGRAD_SPEC.op, "torch")
def adagrad_step_torch(params, grads, state_sums, steps, hypers, maximize, has_weight_decay, skip):
    h = _rows(ADAGRAD_SPEC, hypers)
    _advance(steps, skip)
    targets = _Targets(skip)
    p = targets(params)
    d = _direction(grads, p, h.weight_decay if has_weight_decay else None, maximize)
    columns = _Columns(p)
    t = columns.stack(steps).to(hypers.dtype)
    clr = h.lr / (1 + (t - 1) * h.lr_decay)
    sums = targets(state_sums)
    torch._foreach_addcmul_(sums, d, d)
    _add_scaled_ratio_(p, d, sums, h.eps, -clr, columns)
    targets.commit()


# ---- Adadelta ------------------------------------------------------------------

@_step_op(ADADELTA_SPEC)
def adadelta_step_(
    params: list[Tensor], grads: list[Tensor], square_avgs: list[Tensor], acc_deltas: list[Tensor],
    steps: list[Tensor], hypers: Tensor, maximize: bool, has_weight_decay: bool, skip: Tensor | None,
) -> None:
    """``torch.optim.Adadelta`` for each of B models, in place.

    ``hypers`` rows: ``lr, rho, eps, weight_decay``. State starts at zero; the
    step counts are kept (as torch does) but not used by the math::

        g = -grad if maximize else grad
        g = g + weight_decay * p                         # has_weight_decay
        square_avg = rho * square_avg + (1 - rho) * g * g
        delta = sqrt(acc_delta + eps) / sqrt(square_avg + eps) * g
        acc_delta = rho * acc_delta + (1 - rho) * delta * delta
        p = p - lr * delta
    """
    run_step(ADADELTA_SPEC, params, grads, square_avgs, acc_deltas, steps, hypers, maximize, has_weight_decay, skip)


@_backend.implements(ADADELTA_SPEC.op, "torch")
def adadelta_step_torch(params, grads, square_avgs, acc_deltas, steps, hypers, maximize, has_weight_decay, skip):
    h = _rows(ADADELTA_SPEC, hypers)
    _advance(steps, skip)
    targets = _Targets(skip)
    p = targets(params)
    d = _direction(grads, p, h.weight_decay if has_weight_decay else None, maximize)
    sq, acc = targets(square_avgs), targets(acc_deltas)
    _ema_sq_(sq, d, h.rho)
    std = torch._foreach_add(sq, _cols(h.eps, sq))
    torch._foreach_sqrt_(std)
    delta = torch._foreach_add(acc, _cols(h.eps, acc))
    torch._foreach_sqrt_(delta)
    torch._foreach_div_(delta, std)
    del std
    torch._foreach_mul_(delta, d)
    _ema_sq_(acc, delta, h.rho)
    torch._foreach_addcmul_(p, delta, _cols(-h.lr, p))
    targets.commit()


# ---- RMSprop -------------------------------------------------------------------

@_step_op(RMSPROP_SPEC)
def rmsprop_step_(
    params: list[Tensor], grads: list[Tensor], square_avgs: list[Tensor], grad_avgs: list[Tensor],
    momentum_buffers: list[Tensor], steps: list[Tensor], hypers: Tensor, centered: bool, maximize: bool,
    has_weight_decay: bool, skip: Tensor | None,
) -> None:
    """``torch.optim.RMSprop`` for each of B models, in place.

    ``hypers`` rows: ``lr, alpha, eps, weight_decay, momentum``. ``grad_avgs`` is
    one per parameter when ``centered``, else empty; ``momentum_buffers`` one per
    parameter when any model has momentum > 0, else empty (then every model's
    momentum row is 0). A model with momentum 0 steps as torch's RMSprop does
    without a buffer and leaves its buffer as it was. State starts at zero; the
    step counts are kept but not used by the math::

        g = -grad if maximize else grad
        g = g + weight_decay * p                         # has_weight_decay
        square_avg = alpha * square_avg + (1 - alpha) * g * g
        if centered:
            grad_avg = lerp(grad_avg, g, 1 - alpha)
            avg = sqrt(square_avg - grad_avg * grad_avg) + eps
        else:
            avg = sqrt(square_avg) + eps
        if momentum_buffers and momentum != 0:
            buf = momentum * buf + g / avg
            p = p - lr * buf
        else:
            p = p - lr * g / avg
    """
    run_step(RMSPROP_SPEC, params, grads, square_avgs, grad_avgs, momentum_buffers, steps, hypers,
             centered, maximize, has_weight_decay, skip)


@_backend.implements(RMSPROP_SPEC.op, "torch")
def rmsprop_step_torch(params, grads, square_avgs, grad_avgs, momentum_buffers, steps, hypers,
                       centered, maximize, has_weight_decay, skip):
    h = _rows(RMSPROP_SPEC, hypers)
    _advance(steps, skip)
    targets = _Targets(skip)
    p = targets(params)
    d = _direction(grads, p, h.weight_decay if has_weight_decay else None, maximize)
    sq = targets(square_avgs)
    _ema_sq_(sq, d, h.alpha)
    if centered:
        g_avg = targets(grad_avgs)
        torch._foreach_lerp_(g_avg, d, _cols(1 - h.alpha, g_avg, match_dtype=True))
        avg = torch._foreach_addcmul(sq, g_avg, g_avg, value=-1)
        torch._foreach_sqrt_(avg)
    else:
        avg = torch._foreach_sqrt(sq)
    torch._foreach_add_(avg, _cols(h.eps, avg))
    update = torch._foreach_div(d, avg)
    del avg
    if momentum_buffers:
        # buf * momentum + g / avg with momentum; buf * 1 + 0 without (kept as it was)
        on = h.momentum != 0
        o = on.to(hypers.dtype)
        bufs = targets(momentum_buffers)
        torch._foreach_mul_(bufs, _cols(torch.where(on, h.momentum, 1.0), bufs))
        torch._foreach_addcmul_(bufs, update, _cols(o, bufs))
        # p - lr * buf with momentum, p - lr * g / avg without
        torch._foreach_addcmul_(p, bufs, _cols(-h.lr * o, p))
        torch._foreach_addcmul_(p, update, _cols(-h.lr * (1 - o), p))
    else:
        torch._foreach_addcmul_(p, update, _cols(-h.lr, p))
    targets.commit()


# ---- layer-wise adaptive steps: LARS and LAMB -------------------------------------

def _model_norms(tensors: Sequence[Tensor], dtype: torch.dtype) -> Tensor:
    """``[n, B]``: the Euclidean norm of every model's slice of every tensor, each computed
    in its tensor's dtype (float32 or float64: the math dtype), then cast to ``dtype``."""
    return torch.stack([
        torch.linalg.vector_norm(t.reshape(t.size(0), -1), dim=1).to(dtype) for t in tensors
    ])


def _trust_ratio(w_norm: Tensor, x_norm: Tensor, num: Tensor, den: Tensor) -> Tensor:
    """``num / den`` where both norms are > 0, else 1 (``[n, B]``)."""
    return torch.where((w_norm > 0) & (x_norm > 0), num / den, 1)


def _adapted(params: Sequence[Tensor], exclude_1d: bool) -> list[int]:
    return [i for i, p in enumerate(params) if not excluded(p, exclude_1d)]


@_step_op(LARS_SPEC)
def lars_step_(
    params: list[Tensor], grads: list[Tensor], momentum_buffers: list[Tensor], steps: list[Tensor],
    hypers: Tensor, exclude_1d: bool, maximize: bool, has_weight_decay: bool, skip: Tensor | None,
) -> None:
    """LARS (You, Gitman and Ginsburg 2017, Algorithm 1) for each of B models, in place.

    ``hypers`` rows: ``lr, momentum, weight_decay, trust_coefficient, eps``.
    ``momentum_buffers``: one per parameter when any model has momentum > 0, else
    empty (every model's momentum is then 0). Buffers start at zero, and a model
    with momentum 0 steps without its buffer and leaves it as it was; the step
    counts are kept but not used by the math. For parameter i and model b, with
    ``w`` model b's slice of parameter i::

        g = -grad if maximize else grad
        if excluded(w):  local_lr = 1                    # exclude_1d and a [B] / [B, n] parameter
        else:
            local_lr = trust_coefficient * ||w|| / (||g|| + weight_decay * ||w|| + eps)
                       if ||w|| > 0 and ||g|| > 0 else 1
            g = g + weight_decay * w                     # has_weight_decay
        if momentum_buffers and momentum != 0:
            buf = momentum * buf + (lr * local_lr) * g
            w = w - buf
        else:
            w = w - (lr * local_lr) * g

    The momentum is the paper's (the learning rate inside the buffer), so a
    learning-rate change acts on new gradients only.
    """
    run_step(LARS_SPEC, params, grads, momentum_buffers, steps, hypers, exclude_1d, maximize, has_weight_decay,
             skip)


@_backend.implements(LARS_SPEC.op, "torch")
def lars_step_torch(params, grads, momentum_buffers, steps, hypers, exclude_1d, maximize, has_weight_decay,
                    skip):
    h = _rows(LARS_SPEC, hypers)
    _advance(steps, skip)
    targets = _Targets(skip)
    p = targets(params)
    d = list(_direction(grads, p, None, maximize))
    columns = _Columns(p)
    scale = h.lr.expand(len(p), -1)  # lr * local_lr, [n, B] in rank order
    adapted = columns.ordered(_adapted(params, exclude_1d))
    if adapted:
        pa, da = [p[i] for i in adapted], [d[i] for i in adapted]
        w_norm, g_norm = _model_norms(pa, hypers.dtype), _model_norms(da, hypers.dtype)
        local = _trust_ratio(w_norm, g_norm, h.trust_coefficient * w_norm,
                             g_norm + h.weight_decay * w_norm + h.eps)
        scale = columns.rows(adapted, h.lr * local, h.lr)
        if has_weight_decay:
            da = torch._foreach_addcmul(da, pa, _cols(h.weight_decay, pa))
            for i, t in zip(adapted, da):
                d[i] = t
    if momentum_buffers:
        # buf * momentum + scale * g with momentum; buf * 1 + 0 without (kept as it was)
        on = h.momentum != 0
        o = on.to(hypers.dtype)
        bufs = targets(momentum_buffers)
        torch._foreach_mul_(bufs, _cols(torch.where(on, h.momentum, 1.0), bufs))
        torch._foreach_addcmul_(bufs, d, columns(scale * o))
        # w - buf with momentum, w - scale * g without
        torch._foreach_addcmul_(p, bufs, _cols(-o, p))
        torch._foreach_addcmul_(p, d, columns(-scale * (1 - o)))
    else:
        torch._foreach_addcmul_(p, d, columns(-scale))
    targets.commit()


@_step_op(LAMB_SPEC)
def lamb_step_(
    params: list[Tensor], grads: list[Tensor], exp_avgs: list[Tensor], exp_avg_sqs: list[Tensor],
    steps: list[Tensor], hypers: Tensor, bias_correction: bool, exclude_1d: bool, maximize: bool,
    has_weight_decay: bool, skip: Tensor | None,
) -> None:
    """LAMB (You et al. 2019, Algorithm 2) for each of B models, in place.

    ``hypers`` rows: ``lr, beta1, beta2, eps, weight_decay, norm_min, norm_max``.
    State starts at zero. For parameter i and model b, with ``w`` model b's
    slice of parameter i and ``t`` its incremented step count::

        g = -grad if maximize else grad
        m = lerp(m, g, 1 - beta1)                        # torch.lerp's formula
        v = beta2 * v + (1 - beta2) * g * g
        if bias_correction: bc1 = 1 - beta1 ** t;  bc2 = 1 - beta2 ** t
        else:               bc1 = bc2 = 1
        r = (m / bc1) / (sqrt(v) / sqrt(bc2) + eps)
        if excluded(w):  ratio = 1                       # exclude_1d and a [B] / [B, n] parameter
        else:
            r = r + weight_decay * w                     # has_weight_decay
            ratio = clamp(||w||, norm_min, norm_max) / ||r||  if ||w|| > 0 and ||r|| > 0 else 1
        w = w - (lr * ratio) * r

    ``clamp(||w||, norm_min, norm_max)`` is the paper's scaling function phi;
    ``norm_min = 0, norm_max = inf`` make it the identity. ``1 - beta ** t`` is
    computed as in ``adam_step_``.
    """
    run_step(LAMB_SPEC, params, grads, exp_avgs, exp_avg_sqs, steps, hypers, bias_correction, exclude_1d,
             maximize, has_weight_decay, skip)


@_backend.implements(LAMB_SPEC.op, "torch")
def lamb_step_torch(params, grads, exp_avgs, exp_avg_sqs, steps, hypers, bias_correction, exclude_1d,
                    maximize, has_weight_decay, skip):
    h = _rows(LAMB_SPEC, hypers)
    _advance(steps, skip)
    targets = _Targets(skip)
    p = targets(params)
    d = _direction(grads, p, None, maximize)
    m, v = targets(exp_avgs), targets(exp_avg_sqs)
    torch._foreach_lerp_(m, d, _cols(1 - h.beta1, m, match_dtype=True))
    _ema_sq_(v, d, h.beta2)
    del d
    denom = torch._foreach_sqrt(v)
    columns = _Columns(p)
    if bias_correction:
        t = columns.stack(steps).to(hypers.dtype)
        torch._foreach_div_(denom, columns(_bias_correction(h.beta2, t).sqrt()))
        torch._foreach_add_(denom, _cols(h.eps, denom))
        r = torch._foreach_div(m, columns(_bias_correction(h.beta1, t)))
        torch._foreach_div_(r, denom)
    else:
        torch._foreach_add_(denom, _cols(h.eps, denom))
        r = torch._foreach_div(m, denom)
    del denom
    scale = h.lr.expand(len(p), -1)  # lr * ratio, [n, B] in rank order
    adapted = columns.ordered(_adapted(params, exclude_1d))
    if adapted:
        pa, ra = [p[i] for i in adapted], [r[i] for i in adapted]
        if has_weight_decay:
            torch._foreach_addcmul_(ra, pa, _cols(h.weight_decay, pa))
        w_norm, r_norm = _model_norms(pa, hypers.dtype), _model_norms(ra, hypers.dtype)
        phi = torch.minimum(torch.maximum(w_norm, h.norm_min), h.norm_max)
        scale = columns.rows(adapted, h.lr * _trust_ratio(w_norm, r_norm, phi, r_norm), h.lr)
    torch._foreach_addcmul_(p, r, columns(-scale))
    targets.commit()


# ---- non-finite detection -----------------------------------------------------

def _check_grads(grads: Sequence[Tensor]) -> int:
    if not grads:
        raise ValueError("hfkern::nonfinite_models: expected at least one gradient")
    B = grads[0].size(0) if grads[0].dim() else 0
    device = grads[0].device
    for i, g in enumerate(grads):
        if g.dim() == 0 or g.size(0) != B:
            raise ValueError(
                f"hfkern::nonfinite_models: expected gradients of shape [B={B}, ...], "
                f"got {list(g.shape)} at index {i}"
            )
        if g.device != device:
            raise ValueError(f"hfkern::nonfinite_models: expected every gradient on {device} (as grads[0]), got "
                             f"grads[{i}] on {g.device}")
        if not (g.is_floating_point() or g.is_complex()):
            raise TypeError(f"hfkern::nonfinite_models: expected floating-point gradients, got grads[{i}] of "
                            f"dtype {g.dtype}")
    return B


@torch.library.custom_op("hfkern::nonfinite_models", mutates_args=())
def nonfinite_models(grads: list[Tensor]) -> Tensor:
    """``[B]`` bool: which models have an inf or NaN anywhere in ``grads`` (n tensors ``[B, ...]``)."""
    _check_grads(grads)
    return _backend.resolve("nonfinite_models", grads[0].device)(grads)


@nonfinite_models.register_fake
def _(grads):
    B = _check_grads(grads)
    return grads[0].new_empty((B,), dtype=torch.bool)


@_backend.implements("nonfinite_models", "torch")
def nonfinite_models_torch(grads: list[Tensor]) -> Tensor:
    bad = torch.zeros(grads[0].size(0), dtype=torch.bool, device=grads[0].device)
    for g in grads:
        if g.numel() == 0:
            continue
        if g.dim() == 1:
            m = ~torch.isfinite(g)
        else:
            # The max-abs norm is inf or NaN exactly when an entry is; unlike a
            # sum it cannot overflow on large finite (e.g. float16) values.
            norm = torch.linalg.vector_norm(g, ord=math.inf, dim=tuple(range(1, g.dim())))
            m = ~torch.isfinite(norm)
        bad |= m
    return bad
