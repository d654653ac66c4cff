"""Array layer norm and RMS norm on the pure-PyTorch path.

The B models' norms are one set of reductions over the trailing ``norm_ndim``
dims of ``x``; nothing is reshaped, so ``x`` may have any strides (an
``[N, B, ...]``-memory conv output, a strided slice, a shared input with stride
0 on the array dim) and is never copied for fp32. Statistics and the normalized
values are computed in the accumulation dtype (float32, float64 for float64
``x``) and rounded to ``x``'s dtype once, on the write into the output.

Shapes (``*`` = the per-model batch dims, ``M`` = their product, ``S`` =
normalized_shape, ``K`` = its product)::

    x, y, grad_y, grad_x   [B, *, *S]   y/grad_x laid out like torch.empty_like(x)
    weight, bias           [B, *S]
    mean, rstd             [B, M]       accumulation dtype, contiguous
    grad_weight, grad_bias [B, *S]      contiguous
"""

from __future__ import annotations

import math
from typing import Sequence

import torch
from torch import Tensor


def acc_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype statistics are kept in: float64 for float64 inputs, else float32."""
    return torch.float64 if dtype == torch.float64 else torch.float32


def num_rows(x: Tensor, norm_ndim: int) -> int:
    """M: the number of normalized rows per model."""
    return math.prod(x.shape[1 : x.dim() - norm_ndim])


def _norm_dims(x: Tensor, norm_ndim: int) -> list[int]:
    return list(range(x.dim() - norm_ndim, x.dim()))


def _stat_view(stat: Tensor, x: Tensor, norm_ndim: int) -> Tensor:
    """[B, M] -> [B, *, 1, ..., 1], broadcastable against x."""
    return stat.reshape(*x.shape[: x.dim() - norm_ndim], *([1] * norm_ndim))


def _param_view(p: Tensor, x: Tensor, norm_ndim: int) -> Tensor:
    """[B, *S] -> [B, 1, ..., 1, *S], broadcastable against x."""
    return p.reshape(p.shape[0], *([1] * (x.dim() - 1 - norm_ndim)), *p.shape[1:])


def _stats_out(stat: Tensor, x: Tensor, norm_ndim: int) -> Tensor:
    # A reduction's output follows the input's stride order; the stats are
    # contiguous [B, M] by contract (the fake kernel says so).
    return stat.reshape(x.shape[0], num_rows(x, norm_ndim)).contiguous()


def _sum_rows(t: Tensor, norm_ndim: int, dtype: torch.dtype) -> Tensor:
    """Sum [B, *, *S] over the per-model batch dims * -> contiguous [B, *S] in ``dtype``."""
    batch_dims = list(range(1, t.dim() - norm_ndim))
    if not batch_dims:  # sum(dim=[]) would reduce over every dim; t may be an input
        return t.to(dtype=dtype, memory_format=torch.contiguous_format, copy=True)
    return t.sum(dim=batch_dims).to(dtype).contiguous()


def _write_affine(y: Tensor, xhat: Tensor, w: Tensor | None, b: Tensor | None) -> Tensor:
    """y <- xhat * w + b, computed in xhat's dtype, rounded once into y."""
    if w is not None and b is not None:
        return torch.addcmul(b, xhat, w, out=y)
    if w is not None:
        return torch.mul(xhat, w, out=y)
    if b is not None:
        return torch.add(xhat, b, out=y)
    return y.copy_(xhat)


def array_layer_norm(
    x: Tensor, weight: Tensor | None, bias: Tensor | None, norm_ndim: int, eps: float
) -> tuple[Tensor, Tensor, Tensor]:
    acc = acc_dtype(x.dtype)
    xf = x.to(acc)
    var, mean = torch.var_mean(xf, dim=_norm_dims(x, norm_ndim), correction=0, keepdim=True)
    rstd = var.add_(eps).rsqrt_()
    xhat = (xf - mean).mul_(rstd)
    w = None if weight is None else _param_view(weight, x, norm_ndim).to(acc)
    b = None if bias is None else _param_view(bias, x, norm_ndim).to(acc)
    y = _write_affine(torch.empty_like(x), xhat, w, b)
    return y, _stats_out(mean, x, norm_ndim), _stats_out(rstd, x, norm_ndim)


def array_layer_norm_backward(
    grad_y: Tensor,
    x: Tensor,
    weight: Tensor | None,
    mean: Tensor,
    rstd: Tensor,
    norm_ndim: int,
    output_mask: Sequence[bool],
) -> tuple[Tensor, Tensor, Tensor]:
    """(grad_x, grad_weight, grad_bias); an output whose mask entry is False is ``[0]``.

    With xhat = (x - mean) * rstd and g = grad_y * weight (or grad_y), per row::

        grad_x      = rstd * (g - mean(g) - xhat * mean(g * xhat))
        grad_weight = sum over rows of grad_y * xhat
        grad_bias   = sum over rows of grad_y
    """
    acc = mean.dtype
    dims = _norm_dims(x, norm_ndim)
    rstd_v = _stat_view(rstd, x, norm_ndim)
    xhat = (x.to(acc) - _stat_view(mean, x, norm_ndim)).mul_(rstd_v)
    gy = grad_y.to(acc)
    param_dtype = x.dtype if weight is None else weight.dtype
    # Unrequested outputs are distinct empties: custom-op outputs may not alias.
    grad_x, grad_w, grad_b = x.new_empty(0), x.new_empty(0), x.new_empty(0)
    if output_mask[0]:
        g = gy if weight is None else gy * _param_view(weight, x, norm_ndim).to(acc)
        c_xhat = (g * xhat).mean(dim=dims, keepdim=True)
        c_g = g.mean(dim=dims, keepdim=True)
        inner = (g - c_g).sub_(xhat * c_xhat)
        grad_x = torch.mul(inner, rstd_v, out=torch.empty_like(x))
    if output_mask[1]:
        grad_w = _sum_rows(gy * xhat, norm_ndim, param_dtype)
    if output_mask[2]:
        grad_b = _sum_rows(gy, norm_ndim, param_dtype)
    return grad_x, grad_w, grad_b


def array_rms_norm(
    x: Tensor, weight: Tensor | None, norm_ndim: int, eps: float
) -> tuple[Tensor, Tensor]:
    acc = acc_dtype(x.dtype)
    xf = x.to(acc)
    rstd = xf.square().mean(dim=_norm_dims(x, norm_ndim), keepdim=True).add_(eps).rsqrt_()
    xhat = xf * rstd
    w = None if weight is None else _param_view(weight, x, norm_ndim).to(acc)
    y = _write_affine(torch.empty_like(x), xhat, w, None)
    return y, _stats_out(rstd, x, norm_ndim)


def array_rms_norm_backward(
    grad_y: Tensor,
    x: Tensor,
    weight: Tensor | None,
    rstd: Tensor,
    norm_ndim: int,
    output_mask: Sequence[bool],
) -> tuple[Tensor, Tensor]:
    """(grad_x, grad_weight); an output whose mask entry is False is ``[0]``.

    With xhat = x * rstd and g = grad_y * weight (or grad_y), per row::

        grad_x      = rstd * (g - xhat * mean(g * xhat))
        grad_weight = sum over rows of grad_y * xhat
    """
    acc = rstd.dtype
    rstd_v = _stat_view(rstd, x, norm_ndim)
    xhat = x.to(acc) * rstd_v
    gy = grad_y.to(acc)
    grad_x, grad_w = x.new_empty(0), x.new_empty(0)
    if output_mask[0]:
        g = gy if weight is None else gy * _param_view(weight, x, norm_ndim).to(acc)
        c_xhat = (g * xhat).mean(dim=_norm_dims(x, norm_ndim), keepdim=True)
        inner = g - xhat * c_xhat
        grad_x = torch.mul(inner, rstd_v, out=torch.empty_like(x))
    if output_mask[1]:
        grad_w = _sum_rows(gy * xhat, norm_ndim, weight.dtype)
    return grad_x, grad_w


# ---- differentiable backward math (double backward) --------------------------
#
# The backward ops take mean and rstd as inputs, but they are functions of x,
# and a double backward must differentiate through them (as aten's
# native_layer_norm_backward does, whose mean and rstd get no gradient either).
# eps is not an input of the backward ops, so the statistics cannot simply be
# recomputed; instead they are re-attached to x: a value equal to the saved
# statistic with the derivative of the statistic as a function of x. With
# v(x) the variance (or mean square) and v0, r0 its value and the saved rstd
# at this point, r(x) = r0 * rsqrt(1 + r0^2 * (v(x) - v0)) equals
# (v(x) + 1/r0^2 - v0)^(-1/2) = (v(x) + eps)^(-1/2) exactly as a function of x,
# so every order of derivative is rstd's, while its value is r0 itself.


def _attached_stats(
    x: Tensor, mean: Tensor | None, rstd: Tensor, norm_ndim: int
) -> tuple[Tensor, Tensor | None, Tensor]:
    """(x in the accumulation dtype, mean(x), rstd(x)) with the saved values and
    the derivatives of the statistics of x; ``mean`` None: RMS norm."""
    acc = rstd.dtype
    dims = _norm_dims(x, norm_ndim)
    xf = x.to(acc)
    rstd_v = _stat_view(rstd, x, norm_ndim)
    mean_v = None
    if mean is not None:
        mu = xf.mean(dim=dims, keepdim=True)
        mean_v = _stat_view(mean, x, norm_ndim) + (mu - mu.detach())
        v = (xf - mu).square().mean(dim=dims, keepdim=True)
    else:
        v = xf.square().mean(dim=dims, keepdim=True)
    r = rstd_v * torch.rsqrt(1 + rstd_v.square() * (v - v.detach()))
    return xf, mean_v, r


def _differentiable_sum_rows(t: Tensor, norm_ndim: int, dtype: torch.dtype) -> Tensor:
    batch_dims = list(range(1, t.dim() - norm_ndim))
    return (t.sum(dim=batch_dims) if batch_dims else t).to(dtype)


def norm_backward_math(
    grad_y: Tensor,
    x: Tensor,
    weight: Tensor | None,
    mean: Tensor | None,
    rstd: Tensor,
    norm_ndim: int,
    output_mask: Sequence[bool],
) -> list[Tensor | None]:
    """The math of :func:`array_layer_norm_backward` (``mean`` given) or
    :func:`array_rms_norm_backward` (``mean`` None) in differentiable ops, with
    mean and rstd as functions of x: (grad_x, grad_weight[, grad_bias]), None
    where the mask entry is False. What the double-backward formulas
    differentiate; slower than the backward functions above, which it matches.
    """
    xf, mean_v, rstd_v = _attached_stats(x, mean, rstd, norm_ndim)
    dims = _norm_dims(x, norm_ndim)
    xhat = (xf if mean_v is None else xf - mean_v) * rstd_v
    gy = grad_y.to(rstd.dtype)
    param_dtype = x.dtype if weight is None else weight.dtype
    outs: list[Tensor | None] = [None] * len(output_mask)
    if output_mask[0]:
        g = gy if weight is None else gy * _param_view(weight, x, norm_ndim).to(rstd.dtype)
        inner = g - xhat * (g * xhat).mean(dim=dims, keepdim=True)
        if mean_v is not None:
            inner = inner - g.mean(dim=dims, keepdim=True)
        outs[0] = (inner * rstd_v).to(x.dtype)
    if output_mask[1]:
        outs[1] = _differentiable_sum_rows(gy * xhat, norm_ndim, param_dtype)
    if len(output_mask) > 2 and output_mask[2]:
        outs[2] = _differentiable_sum_rows(gy, norm_ndim, param_dtype)
    return outs
