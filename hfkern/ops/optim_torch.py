"""Array optimizer steps on the pure-PyTorch path: ``torch._foreach_*`` over every parameter.

Each function implements the hfkern op of the same name; hfkern/ops/optim.py
documents the arguments and the math. A per-model hyperparameter (``[B]``)
enters the foreach calls as a ``[B, 1, ...]`` view per tensor, so one call
serves every model, and per-(parameter, model) quantities such as bias
corrections are computed once on the stacked ``[n, B]`` step counts. Nothing
reads a device value on the host and nothing loops over models.

The arithmetic follows torch.optim's single-tensor implementations operation
by operation (same operands, same order), so that a model's trajectory matches
torch's to rounding.
"""

from __future__ import annotations

import math
from typing import Sequence

import torch
from torch import Tensor

def _math_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32


def _col(h: Tensor, like: Tensor) -> Tensor:
    """The ``[B]`` tensor ``h`` as ``[B, 1, ...]``, broadcasting against ``like`` ([B, ...])."""
    return h.view(h.shape[0], *([1] * (like.dim() - 1)))


def _cols(h: Tensor, tensors: Sequence[Tensor]) -> list[Tensor]:
    return [_col(h, t) for t in tensors]


def _lerp_weights(h: Tensor, tensors: Sequence[Tensor]) -> list[Tensor]:
    """``_cols`` in each tensor's dtype: foreach lerp wants its weight in the tensor's
    dtype, and one group may mix float64 state with float32 hyperparameters."""
    return [_col(h.to(t.dtype), t) for t in tensors]


def _per_tensor(x: Tensor, tensors: Sequence[Tensor]) -> list[Tensor]:
    """Row i of the ``[n, B]`` tensor ``x`` as a column broadcasting against ``tensors[i]``."""
    return [_col(row, t) for row, t in zip(x.unbind(0), tensors)]


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
        out = []
        for t in tensors:
            dtype = _math_dtype(t.dtype)
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


def _advance(steps: list[Tensor], skip: Tensor | None) -> None:
    """Count one update for every model that is not skipped."""
    if not steps:
        return
    if skip is None:
        torch._foreach_add_(steps, 1.0)
    else:
        inc = (~skip).to(steps[0].dtype)
        torch._foreach_add_(steps, [inc] * len(steps))


def _direction(
    grads: Sequence[Tensor],
    params: list[Tensor],
    weight_decay: Tensor | None,
    maximize: bool,
) -> list[Tensor]:
    """The gradient the update follows: in the math dtype, negated to maximize, plus
    ``weight_decay * param`` when given. May alias ``grads``: read only."""
    d = [g.to(_math_dtype(g.dtype)) for g in grads]
    if maximize:
        d = torch._foreach_neg(d)
    if weight_decay is not None:
        d = torch._foreach_addcmul(d, params, _cols(weight_decay, params))
    return d


def _ema_sq_(avgs: list[Tensor], d: list[Tensor], decay: Tensor) -> None:
    """``avg = decay * avg + (1 - decay) * d * d``, as torch's ``mul_(decay).addcmul_(d, d, value=1 - decay)``."""
    torch._foreach_mul_(avgs, _cols(decay, avgs))
    torch._foreach_addcmul_(avgs, torch._foreach_mul(d, _cols(1 - decay, d)), d)


def _bias_correction(beta: Tensor, t: Tensor) -> Tensor:
    """``1 - beta ** t`` for ``t`` ``[n, B]``, without cancellation where ``beta ** t`` is near 1."""
    return -torch.expm1(t * torch.log(beta))


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
    lr, momentum, dampening, weight_decay = hypers.unbind(0)
    targets = _Targets(skip)
    p = targets(params)
    d = _direction(grads, p, weight_decay if has_weight_decay else None, maximize)
    if momentum_buffers:
        # A model's first update sets its buffer to the gradient (torch clones it);
        # from zeros that is buf * 0 + g * 1. torch ignores dampening without momentum.
        first = torch.stack(steps) == 0
        keep = 1 - torch.where(momentum == 0, 0.0, dampening)
        decay = torch.where(first, 0.0, momentum)
        scale = torch.where(first, 1.0, keep)
        bufs = targets(momentum_buffers)
        torch._foreach_mul_(bufs, _per_tensor(decay, bufs))
        torch._foreach_addcmul_(bufs, d, _per_tensor(scale, bufs))
        d = torch._foreach_addcmul(d, bufs, _cols(momentum, bufs)) if nesterov else bufs
        _advance(steps, skip)
    torch._foreach_addcmul_(p, d, _cols(-lr, p))
    targets.commit()


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
    lr, beta1, beta2, eps, weight_decay = hypers.unbind(0)
    _advance(steps, skip)
    targets = _Targets(skip)
    p = targets(params)
    coupled = has_weight_decay and not decoupled_weight_decay
    d = _direction(grads, p, weight_decay if coupled else None, maximize)
    if has_weight_decay and decoupled_weight_decay:
        torch._foreach_mul_(p, _cols(1 - lr * weight_decay, p))
    m, v = targets(exp_avgs), targets(exp_avg_sqs)
    torch._foreach_lerp_(m, d, _lerp_weights(1 - beta1, m))
    _ema_sq_(v, d, beta2)
    if amsgrad:
        v_max = targets(max_exp_avg_sqs)
        torch._foreach_maximum_(v_max, v)
        v = v_max
    t = torch.stack(steps).to(hypers.dtype)
    step_size = lr / _bias_correction(beta1, t)
    bc2_sqrt = _bias_correction(beta2, t).sqrt()
    denom = torch._foreach_sqrt(v)
    torch._foreach_div_(denom, _per_tensor(bc2_sqrt, denom))
    torch._foreach_add_(denom, _cols(eps, denom))
    update = torch._foreach_div(m, denom)
    del denom
    torch._foreach_addcmul_(p, update, _per_tensor(-step_size, p))
    targets.commit()


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
    lr, lr_decay, weight_decay, eps = hypers.unbind(0)
    _advance(steps, skip)
    targets = _Targets(skip)
    p = targets(params)
    d = _direction(grads, p, weight_decay if has_weight_decay else None, maximize)
    t = torch.stack(steps).to(hypers.dtype)
    clr = lr / (1 + (t - 1) * lr_decay)
    sums = targets(state_sums)
    torch._foreach_addcmul_(sums, d, d)
    std = torch._foreach_sqrt(sums)
    torch._foreach_add_(std, _cols(eps, std))
    update = torch._foreach_div(d, std)
    del std
    torch._foreach_addcmul_(p, update, _per_tensor(-clr, p))
    targets.commit()


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
    lr, rho, eps, weight_decay = hypers.unbind(0)
    _advance(steps, skip)
    targets = _Targets(skip)
    p = targets(params)
    d = _direction(grads, p, weight_decay if has_weight_decay else None, maximize)
    sq, acc = targets(square_avgs), targets(acc_deltas)
    _ema_sq_(sq, d, rho)
    std = torch._foreach_add(sq, _cols(eps, sq))
    torch._foreach_sqrt_(std)
    delta = torch._foreach_add(acc, _cols(eps, acc))
    torch._foreach_sqrt_(delta)
    torch._foreach_div_(delta, std)
    del std
    torch._foreach_mul_(delta, d)
    _ema_sq_(acc, delta, rho)
    torch._foreach_addcmul_(p, delta, _cols(-lr, p))
    targets.commit()


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
    lr, alpha, eps, weight_decay, momentum = hypers.unbind(0)
    _advance(steps, skip)
    targets = _Targets(skip)
    p = targets(params)
    d = _direction(grads, p, weight_decay if has_weight_decay else None, maximize)
    sq = targets(square_avgs)
    _ema_sq_(sq, d, alpha)
    if centered:
        g_avg = targets(grad_avgs)
        torch._foreach_lerp_(g_avg, d, _lerp_weights(1 - alpha, g_avg))
        avg = torch._foreach_addcmul(sq, g_avg, g_avg, value=-1)
        torch._foreach_sqrt_(avg)
    else:
        avg = torch._foreach_sqrt(sq)
    torch._foreach_add_(avg, _cols(eps, avg))
    if momentum_buffers:
        bufs = targets(momentum_buffers)
        torch._foreach_mul_(bufs, _cols(momentum, bufs))
        torch._foreach_addcdiv_(bufs, d, avg)
        update = bufs
    else:
        update = torch._foreach_div(d, avg)
    del avg
    torch._foreach_addcmul_(p, update, _cols(-lr, p))
    targets.commit()


def nonfinite_models(grads: list[Tensor]) -> Tensor:
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
