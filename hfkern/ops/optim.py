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
    nonfinite_models(grads) -> Tensor  # [B] bool

Conventions shared by every ``*_step_`` op (model b is index b of every dim 0):

* ``params``: n tensors ``[B, *shape_i]`` of float32, float64, bfloat16 or float16,
  updated in place. ``grads``: n tensors with the shape and dtype of ``params[i]``,
  read only. All tensors of one call live on one device. For a bfloat16/float16
  parameter the update is computed in float32 from the parameter's value and
  rounded into the parameter once, at the end.
* State lists (``exp_avgs``, ...): n tensors ``[B, *shape_i]`` in the *state
  dtype*, float64 for a float64 parameter and float32 otherwise, updated in
  place; an optional state list is empty (length 0) when its option is off.
  The optimizers allocate state with the parameter's strides
  (``torch.zeros_like(p, dtype=...)``); ``params``, ``grads`` and state are dense.
* ``steps``: n ``[B]`` float32 tensors, how many updates each model has made to
  parameter i (integers held exactly up to 2**24). An op first adds 1 for every
  model it updates, and the update uses the incremented count.
* ``hypers``: ``[H, B]`` tensor of per-model hyperparameters, one row each in the
  order the op documents; float64 when every parameter is float64, else
  float32. It is read from device memory at every call (a scheduler writes new
  learning rates into it in place), so nothing depends on its values on the
  host. Arithmetic on hyperparameters (``1 - beta``, bias corrections, ...) is
  done in ``hypers.dtype`` at run time.
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

``nonfinite_models(grads)``: ``[B]`` bool, True for every model with an inf or
NaN in any of the n ``[B, ...]`` gradients (on grads[0]'s device).
"""

from __future__ import annotations

from typing import Sequence

import torch
from torch import Tensor

from .. import _backend
from . import optim_torch

__all__ = [
    "sgd_step_", "adam_step_", "adagrad_step_", "adadelta_step_", "rmsprop_step_",
    "nonfinite_models",
]

_SGD, _ADAM, _ADAGRAD, _ADADELTA, _RMSPROP = (
    "sgd_step_", "adam_step_", "adagrad_step_", "adadelta_step_", "rmsprop_step_"
)
_NONFINITE = "nonfinite_models"

SGD_ROWS = ("lr", "momentum", "dampening", "weight_decay")
ADAM_ROWS = ("lr", "beta1", "beta2", "eps", "weight_decay")
ADAGRAD_ROWS = ("lr", "lr_decay", "weight_decay", "eps")
ADADELTA_ROWS = ("lr", "rho", "eps", "weight_decay")
RMSPROP_ROWS = ("lr", "alpha", "eps", "weight_decay", "momentum")

_FLOAT_PARAMS = (torch.float32, torch.float64, torch.bfloat16, torch.float16)


def state_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype of optimizer state (and of the update math) for parameters of ``dtype``."""
    return torch.float64 if dtype == torch.float64 else torch.float32


def _check(
    op: str,
    params: Sequence[Tensor],
    grads: Sequence[Tensor],
    states: dict[str, tuple[Sequence[Tensor], bool]],
    steps: Sequence[Tensor],
    steps_required: bool,
    hypers: Tensor,
    rows: Sequence[str],
    skip: Tensor | None,
) -> None:
    """Shapes, dtypes and list lengths only: metadata, never a device value."""
    n = len(params)
    if len(grads) != n:
        raise ValueError(f"hfkern::{op}: expected {n} grads (one per parameter), got {len(grads)}")
    if hypers.dim() != 2 or hypers.size(0) != len(rows) or (n and hypers.size(1) != params[0].size(0)):
        B = params[0].size(0) if n else "B"
        raise ValueError(
            f"hfkern::{op}: expected hypers of shape [{len(rows)}, {B}] (rows {list(rows)}), "
            f"got {list(hypers.shape)}"
        )
    if hypers.dtype not in (torch.float32, torch.float64):
        raise TypeError(f"hfkern::{op}: expected float32 or float64 hypers, got {hypers.dtype}")
    lists = dict(states)
    lists["steps"] = (steps, steps_required)
    for name, (lst, required) in lists.items():
        expected = n if required else 0
        if len(lst) != expected:
            raise ValueError(
                f"hfkern::{op}: expected {name} to hold {expected} tensors "
                f"({'one per parameter' if required else 'empty: its option is off'}), got {len(lst)}"
            )
    if n == 0:
        return
    B = params[0].size(0)
    for i, (p, g) in enumerate(zip(params, grads)):
        if p.dim() == 0 or p.size(0) != B:
            raise ValueError(
                f"hfkern::{op}: expected every parameter of shape [B={B}, ...], got {list(p.shape)} at index {i}"
            )
        if p.dtype not in _FLOAT_PARAMS:
            raise TypeError(f"hfkern::{op}: expected a floating-point parameter, got {p.dtype} at index {i}")
        if g.shape != p.shape or g.dtype != p.dtype:
            raise ValueError(
                f"hfkern::{op}: expected grads[{i}] of shape {list(p.shape)} and dtype {p.dtype} "
                f"(its parameter's), got {list(g.shape)} {g.dtype}"
            )
        sdt = state_dtype(p.dtype)
        for name, (lst, _) in states.items():
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
    if skip is not None and (
        skip.dtype != torch.bool or skip.shape != (B,) or skip.device != params[0].device
    ):
        raise ValueError(
            f"hfkern::{op}: expected skip of shape [{B}] and dtype torch.bool on {params[0].device}, "
            f"got {list(skip.shape)} {skip.dtype} on {skip.device}"
        )


# ---- SGD -------------------------------------------------------------------

@torch.library.custom_op("hfkern::sgd_step_", mutates_args=("params", "momentum_buffers", "steps"))
def sgd_step_(
    params: list[Tensor],
    grads: list[Tensor],
    momentum_buffers: list[Tensor],
    steps: list[Tensor],
    hypers: Tensor,
    nesterov: bool,
    maximize: bool,
    has_weight_decay: bool,
    skip: Tensor | None,
) -> None:
    """``torch.optim.SGD``'s step for each of B models, in place.

    ``hypers`` rows: ``lr, momentum, dampening, weight_decay``.
    ``momentum_buffers`` and ``steps``: both empty (no model has momentum: plain
    SGD, no state) or both one per parameter. A model's buffer starts when its
    step count is 0 (the optimizers allocate zeros), as torch's starts as a copy
    of the first gradient::

        g = -grad if maximize else grad
        g = g + weight_decay * p                         # has_weight_decay
        if momentum_buffers:
            if t == 1: buf = g                           # first update of this model
            else:      buf = momentum * buf + (1 - damp) * g
                       # damp = dampening, or 0 for a model with momentum == 0
            g = g + momentum * buf if nesterov else buf
        p = p - lr * g
    """
    _check(_SGD, params, grads, {"momentum_buffers": (momentum_buffers, bool(momentum_buffers))},
           steps, bool(momentum_buffers), hypers, SGD_ROWS, skip)
    if params:
        _backend.resolve(_SGD, params[0].device)(
            params, grads, momentum_buffers, steps, hypers, nesterov, maximize, has_weight_decay, skip
        )


@sgd_step_.register_fake
def _(params, grads, momentum_buffers, steps, hypers, nesterov, maximize, has_weight_decay, skip):
    _check(_SGD, params, grads, {"momentum_buffers": (momentum_buffers, bool(momentum_buffers))},
           steps, bool(momentum_buffers), hypers, SGD_ROWS, skip)


# ---- Adam / AdamW ------------------------------------------------------------

@torch.library.custom_op(
    "hfkern::adam_step_",
    mutates_args=("params", "exp_avgs", "exp_avg_sqs", "max_exp_avg_sqs", "steps"),
)
def adam_step_(
    params: list[Tensor],
    grads: list[Tensor],
    exp_avgs: list[Tensor],
    exp_avg_sqs: list[Tensor],
    max_exp_avg_sqs: list[Tensor],
    steps: list[Tensor],
    hypers: Tensor,
    amsgrad: bool,
    maximize: bool,
    decoupled_weight_decay: bool,
    has_weight_decay: bool,
    skip: Tensor | None,
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
    _check(
        _ADAM, params, grads,
        {"exp_avgs": (exp_avgs, True), "exp_avg_sqs": (exp_avg_sqs, True),
         "max_exp_avg_sqs": (max_exp_avg_sqs, amsgrad)},
        steps, True, hypers, ADAM_ROWS, skip,
    )
    if params:
        _backend.resolve(_ADAM, params[0].device)(
            params, grads, exp_avgs, exp_avg_sqs, max_exp_avg_sqs, steps, hypers,
            amsgrad, maximize, decoupled_weight_decay, has_weight_decay, skip,
        )


@adam_step_.register_fake
def _(params, grads, exp_avgs, exp_avg_sqs, max_exp_avg_sqs, steps, hypers,
      amsgrad, maximize, decoupled_weight_decay, has_weight_decay, skip):
    _check(
        _ADAM, params, grads,
        {"exp_avgs": (exp_avgs, True), "exp_avg_sqs": (exp_avg_sqs, True),
         "max_exp_avg_sqs": (max_exp_avg_sqs, amsgrad)},
        steps, True, hypers, ADAM_ROWS, skip,
    )


# ---- Adagrad -------------------------------------------------------------------

@torch.library.custom_op("hfkern::adagrad_step_", mutates_args=("params", "state_sums", "steps"))
def adagrad_step_(
    params: list[Tensor],
    grads: list[Tensor],
    state_sums: list[Tensor],
    steps: list[Tensor],
    hypers: Tensor,
    maximize: bool,
    has_weight_decay: bool,
    skip: Tensor | None,
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
    _check(_ADAGRAD, params, grads, {"state_sums": (state_sums, True)}, steps, True, hypers,
           ADAGRAD_ROWS, skip)
    if params:
        _backend.resolve(_ADAGRAD, params[0].device)(
            params, grads, state_sums, steps, hypers, maximize, has_weight_decay, skip
        )


@adagrad_step_.register_fake
def _(params, grads, state_sums, steps, hypers, maximize, has_weight_decay, skip):
    _check(_ADAGRAD, params, grads, {"state_sums": (state_sums, True)}, steps, True, hypers,
           ADAGRAD_ROWS, skip)


# ---- Adadelta ------------------------------------------------------------------

@torch.library.custom_op(
    "hfkern::adadelta_step_", mutates_args=("params", "square_avgs", "acc_deltas", "steps")
)
def adadelta_step_(
    params: list[Tensor],
    grads: list[Tensor],
    square_avgs: list[Tensor],
    acc_deltas: list[Tensor],
    steps: list[Tensor],
    hypers: Tensor,
    maximize: bool,
    has_weight_decay: bool,
    skip: Tensor | None,
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
    _check(_ADADELTA, params, grads,
           {"square_avgs": (square_avgs, True), "acc_deltas": (acc_deltas, True)},
           steps, True, hypers, ADADELTA_ROWS, skip)
    if params:
        _backend.resolve(_ADADELTA, params[0].device)(
            params, grads, square_avgs, acc_deltas, steps, hypers, maximize, has_weight_decay, skip
        )


@adadelta_step_.register_fake
def _(params, grads, square_avgs, acc_deltas, steps, hypers, maximize, has_weight_decay, skip):
    _check(_ADADELTA, params, grads,
           {"square_avgs": (square_avgs, True), "acc_deltas": (acc_deltas, True)},
           steps, True, hypers, ADADELTA_ROWS, skip)


# ---- RMSprop -------------------------------------------------------------------

@torch.library.custom_op(
    "hfkern::rmsprop_step_",
    mutates_args=("params", "square_avgs", "grad_avgs", "momentum_buffers", "steps"),
)
def rmsprop_step_(
    params: list[Tensor],
    grads: list[Tensor],
    square_avgs: list[Tensor],
    grad_avgs: list[Tensor],
    momentum_buffers: list[Tensor],
    steps: list[Tensor],
    hypers: Tensor,
    centered: bool,
    maximize: bool,
    has_weight_decay: bool,
    skip: Tensor | None,
) -> None:
    """``torch.optim.RMSprop`` for each of B models, in place.

    ``hypers`` rows: ``lr, alpha, eps, weight_decay, momentum``. ``grad_avgs`` is
    one per parameter when ``centered``, else empty; ``momentum_buffers`` one per
    parameter when any model has momentum > 0, else empty (then every model's
    momentum row is 0). State starts at zero; the step counts are kept but not
    used by the math::

        g = -grad if maximize else grad
        g = g + weight_decay * p                         # has_weight_decay
        square_avg = alpha * square_avg + (1 - alpha) * g * g
        if centered:
            grad_avg = lerp(grad_avg, g, 1 - alpha)
            avg = sqrt(square_avg - grad_avg * grad_avg) + eps
        else:
            avg = sqrt(square_avg) + eps
        if momentum_buffers:
            buf = momentum * buf + g / avg               # momentum 0: buf = g / avg
            p = p - lr * buf
        else:
            p = p - lr * g / avg
    """
    _check(_RMSPROP, params, grads,
           {"square_avgs": (square_avgs, True), "grad_avgs": (grad_avgs, centered),
            "momentum_buffers": (momentum_buffers, bool(momentum_buffers))},
           steps, True, hypers, RMSPROP_ROWS, skip)
    if params:
        _backend.resolve(_RMSPROP, params[0].device)(
            params, grads, square_avgs, grad_avgs, momentum_buffers, steps, hypers,
            centered, maximize, has_weight_decay, skip,
        )


@rmsprop_step_.register_fake
def _(params, grads, square_avgs, grad_avgs, momentum_buffers, steps, hypers,
      centered, maximize, has_weight_decay, skip):
    _check(_RMSPROP, params, grads,
           {"square_avgs": (square_avgs, True), "grad_avgs": (grad_avgs, centered),
            "momentum_buffers": (momentum_buffers, bool(momentum_buffers))},
           steps, True, hypers, RMSPROP_ROWS, skip)


# ---- non-finite detection -----------------------------------------------------

def _check_grads(grads: Sequence[Tensor]) -> int:
    if not grads:
        raise ValueError("hfkern::nonfinite_models: expected at least one gradient")
    B = grads[0].size(0) if grads[0].dim() else 0
    for i, g in enumerate(grads):
        if g.dim() == 0 or g.size(0) != B:
            raise ValueError(
                f"hfkern::nonfinite_models: expected gradients of shape [B={B}, ...], "
                f"got {list(g.shape)} at index {i}"
            )
    return B


@torch.library.custom_op("hfkern::nonfinite_models", mutates_args=())
def nonfinite_models(grads: list[Tensor]) -> Tensor:
    """``[B]`` bool: which models have an inf or NaN anywhere in ``grads`` (n tensors ``[B, ...]``)."""
    _check_grads(grads)
    return _backend.resolve(_NONFINITE, grads[0].device)(grads)


@nonfinite_models.register_fake
def _(grads):
    B = _check_grads(grads)
    return grads[0].new_empty((B,), dtype=torch.bool)


_backend.register(_SGD, "torch", optim_torch.sgd_step_)
_backend.register(_ADAM, "torch", optim_torch.adam_step_)
_backend.register(_ADAGRAD, "torch", optim_torch.adagrad_step_)
_backend.register(_ADADELTA, "torch", optim_torch.adadelta_step_)
_backend.register(_RMSPROP, "torch", optim_torch.rmsprop_step_)
_backend.register(_NONFINITE, "torch", optim_torch.nonfinite_models)


# The Triton implementations are torch.library triton ops defined in
# hfkern/ops/optim_triton.py, imported on first use (defining a triton op imports
# triton and parts of inductor, which plain "import hfkern" should not pay for).
# auto picks a Triton kernel only where a committed GPU benchmark shows it faster:
# the SGD and Adam/AdamW steps are, on an H100, 2.8-4.5x the torch path for B
# ResNet-18 models, B = 4, 16, 32 (bench/results/h100_2026-11-22/). Adagrad,
# Adadelta, RMSprop and the non-finite check have not been benchmarked yet.
_AUTO = {_SGD: True, _ADAM: True, _ADAGRAD: False, _ADADELTA: False, _RMSPROP: False, _NONFINITE: False}
for _op, _auto in _AUTO.items():
    _backend.register(_op, "triton", f"hfkern.ops.optim_triton:{_op.rstrip('_')}_triton",
                      device_types=("cuda",), auto=_auto)
