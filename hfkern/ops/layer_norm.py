"""hfkern::array_layer_norm and hfkern::array_rms_norm: B models' norms as one op each.

Ops (all registered with torch.library, implementations chosen by the registry):

``array_layer_norm(x, weight, bias, norm_ndim, eps, activation="none") -> (y, mean, rstd)``
    x ``[B, *, *S]`` with any strides (``S`` = the trailing ``norm_ndim`` dims,
    normalized_shape), weight and bias ``[B, *S]`` or None. ``y = act(z)`` with
    ``z = xhat * weight + bias`` the layer-norm output and ``act`` the fused
    ``activation``: ``"none"`` (identity), ``"relu"`` or ``"gelu"`` (the exact erf
    form, ``torch.nn.GELU()``); any other value raises ValueError. ``y`` has x's
    dtype and the layout of ``torch.empty_like(x)`` (x's strides when x is dense
    and non-overlapping, so an ``[N, B, ...]``-memory conv output stays that way).
    ``mean`` and ``rstd`` are contiguous ``[B, M]`` (``M`` = product of ``*``) in
    the accumulation dtype: float32, or float64 for float64 x. They are not
    differentiable.
``array_layer_norm_backward(grad_y, x, weight, mean, rstd, norm_ndim, output_mask,``
``bias=None, activation="none") -> (grad_x, grad_weight, grad_bias)``
    With an activation, the gradients of ``act(z)``: ``grad_y`` is first
    multiplied by ``act'(z)``, ``z`` recomputed (in the accumulation dtype) from
    ``x``, the statistics, ``weight`` and ``bias`` (the forward's, which the
    autograd formula saves for it), so nothing but ``x`` is kept for the
    backward and the activation's output is never read back.
``array_rms_norm(x, weight, norm_ndim, eps) -> (y, rstd)``
    The same conventions; RMSNorm has no bias and no mean.
``array_rms_norm_backward(grad_y, x, weight, rstd, norm_ndim, output_mask)``
    ``-> (grad_x, grad_weight)``.

Why one backward op with an ``output_mask`` (as ``aten::native_layer_norm_backward``)
rather than separate input-grad and weight-grad ops (as ``array_conv``): a norm's
three gradients are all cheap functions of the same two reads, ``x`` and
``grad_y``, and a fused kernel produces the input gradient and the per-block
partial sums of the parameter gradients in one pass over them (then reduces the
partials in a second, deterministic pass). Separate ops would read the
activation twice. Custom ops cannot return None, so an output whose
``output_mask`` entry is False comes back as an empty ``[0]`` tensor of x's
dtype and must be ignored; a backend may skip that work entirely. Requested
outputs: ``grad_x`` has x's dtype and the layout of ``torch.empty_like(x)``;
``grad_weight`` and ``grad_bias`` are contiguous ``[B, *S]`` in weight's dtype
(x's dtype when there is no weight). ``output_mask[1]`` requires a weight.
``grad_x`` of a shared input (stride 0 on B) is per model, ``[B, ...]``;
autograd's expand backward sums it.

Fused activation: a norm followed by ReLU or GELU (``hfkern.fuse`` finds the
pattern, the modules take ``activation=``) is one op, backward included, so the
activation's separate read and write of the activation tensor disappear. The
torch path applies it in place on the output; backends apply it before the
store and recompute ``z`` where they read ``x`` in the backward.

Double backward: the backward ops are differentiable too (gradient penalties,
MAML). Their formula differentiates the reference math
(:func:`norm_backward_math`) with autograd, on every backend:
a Triton backward's own gradients run as torch ops. As for
``aten::native_layer_norm_backward``, ``mean`` and ``rstd`` must be the
statistics the forward returned for ``x``; the formula differentiates them as
functions of ``x`` (so the gradient with respect to ``x`` is the total one)
and gives them no gradient of their own (with an activation, the bias, which
enters ``act'(z)``, is differentiated too). The first backward is never slowed:
the formula only runs when a backward is itself differentiated
(``create_graph=True``).
"""

from __future__ import annotations

import math
from typing import Sequence

import torch
from torch import Tensor

from .. import _backend
from . import _autocast
from ._norm import (
    activate_, activation_grad, backward_of_backward, backward_outputs, check_activation,
    check_mask, grad_mask, input_grads, save_forward,
)
from .._array import refuse_forward_ad
from .._dtypes import acc_dtype

__all__ = [
    "array_layer_norm", "array_layer_norm_backward", "array_rms_norm", "array_rms_norm_backward",
]

_LN_FWD, _LN_BWD = "array_layer_norm", "array_layer_norm_backward"
_RMS_FWD, _RMS_BWD = "array_rms_norm", "array_rms_norm_backward"


# ---- the torch implementations (CPU path and oracle) ---------------------------
#
# Array layer norm and RMS norm on the pure-PyTorch path.
#
# The B models' norms are one set of reductions over the trailing ``norm_ndim``
# dims of ``x``; nothing is reshaped, so ``x`` may have any strides (an
# ``[N, B, ...]``-memory conv output, a strided slice, a shared input with stride
# 0 on the array dim) and is never copied for fp32. Statistics and the normalized
# values are computed in the accumulation dtype (float32, float64 for float64
# ``x``) and rounded to ``x``'s dtype once, on the write into the output.
#
# Shapes (``*`` = the per-model batch dims, ``M`` = their product, ``S`` =
# normalized_shape, ``K`` = its product)::
#
#     x, y, grad_y, grad_x   [B, *, *S]   y/grad_x laid out like torch.empty_like(x)
#     weight, bias           [B, *S]
#     mean, rstd             [B, M]       accumulation dtype, contiguous
#     grad_weight, grad_bias [B, *S]      contiguous


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


def _write_affine(y: Tensor | None, xhat: Tensor, w: Tensor | None, b: Tensor | None) -> Tensor:
    """y <- xhat * w + b, computed in xhat's dtype, rounded once into y (None: a new
    tensor, differentiable; xhat itself without affine parameters)."""
    if w is not None and b is not None:
        return torch.addcmul(b, xhat, w, out=y)
    if w is not None:
        return torch.mul(xhat, w, out=y)
    if b is not None:
        return torch.add(xhat, b, out=y)
    return xhat if y is None else y.copy_(xhat)


def _affine_params(x: Tensor, weight: Tensor | None, bias: Tensor | None, norm_ndim: int, acc):
    w = None if weight is None else _param_view(weight, x, norm_ndim).to(acc)
    b = None if bias is None else _param_view(bias, x, norm_ndim).to(acc)
    return w, b


def _native_ok(x: Tensor, weight: Tensor | None, bias: Tensor | None) -> bool:
    """Whether torch's own layer norm computes xhat for ``x`` as this path must: float32
    or float64 ``x`` (its accumulation dtype, so xhat is not rounded before the affine
    step), dense row-major (no copy), parameters of x's dtype, not empty."""
    return (x.dtype in _NATIVE_DTYPES and x.numel() > 0 and x.is_contiguous()
            and all(p is None or p.dtype == x.dtype for p in (weight, bias)))


_NATIVE_DTYPES = (torch.float32, torch.float64)


@_backend.implements("array_layer_norm", "torch")
def array_layer_norm_torch(
    x: Tensor, weight: Tensor | None, bias: Tensor | None, norm_ndim: int, eps: float,
    activation: str = "none",
) -> tuple[Tensor, Tensor, Tensor]:
    if _native_ok(x, weight, bias):
        return _native_layer_norm(x, weight, bias, norm_ndim, eps, activation, out=torch.empty_like(x))
    acc = acc_dtype(x.dtype)
    xf = x.to(acc)
    var, mean = torch.var_mean(xf, dim=_norm_dims(x, norm_ndim), correction=0, keepdim=True)
    rstd = var.add_(eps).rsqrt_()
    xhat = (xf - mean).mul_(rstd)
    w, b = _affine_params(x, weight, bias, norm_ndim, acc)
    y = activate_(_write_affine(torch.empty_like(x), xhat, w, b), activation)
    return y, _stats_out(mean, x, norm_ndim), _stats_out(rstd, x, norm_ndim)


@_backend.implements("array_layer_norm_backward", "torch")
def array_layer_norm_backward_torch(
    grad_y: Tensor,
    x: Tensor,
    weight: Tensor | None,
    mean: Tensor,
    rstd: Tensor,
    norm_ndim: int,
    output_mask: Sequence[bool],
    bias: Tensor | None = None,
    activation: str = "none",
) -> tuple[Tensor, Tensor, Tensor]:
    """(grad_x, grad_weight, grad_bias); an output whose mask entry is False is ``[0]``.

    With xhat = (x - mean) * rstd, gz = grad_y * act'(xhat * weight + bias) (grad_y
    without an activation) and g = gz * weight (or gz), per row::

        grad_x      = rstd * (g - mean(g) - xhat * mean(g * xhat))
        grad_weight = sum over rows of gz * xhat
        grad_bias   = sum over rows of gz
    """
    acc = mean.dtype
    dims = _norm_dims(x, norm_ndim)
    rstd_v = _stat_view(rstd, x, norm_ndim)
    xhat = (x.to(acc) - _stat_view(mean, x, norm_ndim)).mul_(rstd_v)
    gy = grad_y.to(acc)
    if activation != "none":
        # z as the forward computed it, before its rounding to x's dtype
        w, b = _affine_params(x, weight, bias, norm_ndim, acc)
        gy = activation_grad(gy, _write_affine(torch.empty_like(xhat), xhat, w, b), activation)
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


@_backend.implements("array_rms_norm", "torch")
def array_rms_norm_torch(
    x: Tensor, weight: Tensor | None, norm_ndim: int, eps: float
) -> tuple[Tensor, Tensor]:
    acc = acc_dtype(x.dtype)
    xf = x.to(acc)
    rstd = xf.square().mean(dim=_norm_dims(x, norm_ndim), keepdim=True).add_(eps).rsqrt_()
    xhat = xf * rstd
    w = None if weight is None else _param_view(weight, x, norm_ndim).to(acc)
    y = _write_affine(torch.empty_like(x), xhat, w, None)
    return y, _stats_out(rstd, x, norm_ndim)


@_backend.implements("array_rms_norm_backward", "torch")
def array_rms_norm_backward_torch(
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
    bias: Tensor | None = None,
    activation: str = "none",
) -> list[Tensor | None]:
    """The math of :func:`array_layer_norm_backward_torch` (``mean`` given) or
    :func:`array_rms_norm_backward_torch` (``mean`` None) in differentiable ops, with
    mean and rstd as functions of x: (grad_x, grad_weight[, grad_bias]), None
    where the mask entry is False. What the double-backward formulas
    differentiate; slower than the backward functions above, which it matches.
    With an activation, ``act'(z)`` is a function of x, weight and bias too.
    """
    xf, mean_v, rstd_v = _attached_stats(x, mean, rstd, norm_ndim)
    dims = _norm_dims(x, norm_ndim)
    xhat = (xf if mean_v is None else xf - mean_v) * rstd_v
    gy = grad_y.to(rstd.dtype)
    if activation != "none":
        z = xhat
        if weight is not None:
            z = z * _param_view(weight, x, norm_ndim).to(rstd.dtype)
        if bias is not None:
            z = z + _param_view(bias, x, norm_ndim).to(rstd.dtype)
        gy = activation_grad(gy, z, activation)
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


# ---- the ops -----------------------------------------------------------------

def _check(op: str, x: Tensor, weight: Tensor | None, bias: Tensor | None, norm_ndim: int,
           grad_y: Tensor | None = None, **stats: Tensor) -> None:
    """The arguments of a forward op, or with ``grad_y`` and the statistics (``mean=``,
    ``rstd=``) of a backward op: shapes, dtypes and devices (every tensor on x's)."""
    if norm_ndim < 1 or x.dim() < norm_ndim + 1:
        raise ValueError(
            f"hfkern::{op}: expected x of shape [B, *, *normalized_shape] with norm_ndim >= 1 "
            f"trailing dims normalized, got norm_ndim={norm_ndim} and x of shape {list(x.shape)}"
        )
    # (torch's norms raise NotImplementedError for these; the math here would run and
    # round the normalized values back into the integer, bool or complex dtype)
    for name, t in (("x", x), ("weight", weight), ("bias", bias)):
        if t is not None and not t.is_floating_point():
            raise TypeError(f"hfkern::{op}: expected {name} of a floating-point dtype, got {t.dtype}")
    expected = _param_shape(x, norm_ndim)
    for name, p in (("weight", weight), ("bias", bias)):
        if p is not None and list(p.shape) != expected:
            raise ValueError(
                f"hfkern::{op}: expected {name} of shape {expected} ([B, *normalized_shape]), "
                f"got {list(p.shape)}"
            )
    device = x.device
    if (weight is not None and weight.device != device) or (bias is not None and bias.device != device):
        _raise_device(op, "weight" if weight is not None and weight.device != device else "bias", device,
                      weight if weight is not None and weight.device != device else bias)
    if grad_y is None:
        return
    if grad_y.shape != x.shape:
        raise ValueError(
            f"hfkern::{op}: expected grad_y of x's shape {list(x.shape)}, got {list(grad_y.shape)}"
        )
    rows = [x.shape[0], num_rows(x, norm_ndim)]
    for name, t in stats.items():
        if list(t.shape) != rows:
            raise ValueError(
                f"hfkern::{op}: expected {name} of shape {rows} ([B, M], M the rows normalized per model "
                f"of x of shape {list(x.shape)}: as the forward returned it), got {list(t.shape)}"
            )
    for name, t in (("grad_y", grad_y), *stats.items()):
        if t.device != device:
            _raise_device(op, name, device, t)


def _raise_device(op: str, name: str, device: torch.device, t: Tensor) -> None:
    raise ValueError(f"hfkern::{op}: expected {name} on x's device ({device}), got {name} on {t.device}")


def _param_shape(x: Tensor, norm_ndim: int) -> list[int]:
    """[B, *S]: a parameter's (and its gradient's) shape."""
    return [x.shape[0], *x.shape[x.dim() - norm_ndim:]]


def _fake_stats(x: Tensor, norm_ndim: int) -> Tensor:
    return x.new_empty(
        (x.shape[0], num_rows(x, norm_ndim)),
        dtype=acc_dtype(x.dtype),
    )


# ---- layer norm -----------------------------------------------------------

@torch.library.custom_op("hfkern::array_layer_norm", mutates_args=())
def array_layer_norm(
    x: Tensor, weight: Tensor | None, bias: Tensor | None, norm_ndim: int, eps: float,
    activation: str = "none",
) -> tuple[Tensor, Tensor, Tensor]:
    """Layer norm of B models, differentiable (see the module docstring): ``y = act(z)``
    with ``activation`` in ``("none", "relu", "gelu")``."""
    _check(_LN_FWD, x, weight, bias, norm_ndim)
    check_activation(f"hfkern::{_LN_FWD}", activation)
    fn = _backend.resolve(_LN_FWD, x.device, x.dtype)
    return fn(x, weight, bias, norm_ndim, eps, activation)


@array_layer_norm.register_fake
def _(x, weight, bias, norm_ndim, eps, activation="none"):
    _check(_LN_FWD, x, weight, bias, norm_ndim)
    check_activation(f"hfkern::{_LN_FWD}", activation)
    return torch.empty_like(x), _fake_stats(x, norm_ndim), _fake_stats(x, norm_ndim)


@torch.library.custom_op("hfkern::array_layer_norm_backward", mutates_args=())
def array_layer_norm_backward(
    grad_y: Tensor,
    x: Tensor,
    weight: Tensor | None,
    mean: Tensor,
    rstd: Tensor,
    norm_ndim: int,
    output_mask: list[bool],
    bias: Tensor | None = None,
    activation: str = "none",
) -> tuple[Tensor, Tensor, Tensor]:
    _check(_LN_BWD, x, weight, bias, norm_ndim, grad_y, mean=mean, rstd=rstd)
    check_mask(_LN_BWD, output_mask, 3, weight)
    check_activation(f"hfkern::{_LN_BWD}", activation)
    fn = _backend.resolve(_LN_BWD, grad_y.device, x.dtype)
    return fn(grad_y, x, weight, mean, rstd, norm_ndim, output_mask, bias, activation)


@array_layer_norm_backward.register_fake
def _(grad_y, x, weight, mean, rstd, norm_ndim, output_mask, bias=None, activation="none"):
    _check(_LN_BWD, x, weight, bias, norm_ndim, grad_y, mean=mean, rstd=rstd)
    check_mask(_LN_BWD, output_mask, 3, weight)
    check_activation(f"hfkern::{_LN_BWD}", activation)
    return backward_outputs(x, weight, output_mask, _param_shape(x, norm_ndim))


def _ln_setup_context(ctx, inputs, output):
    x, weight, bias, norm_ndim, eps, activation = inputs
    _, mean, rstd = output
    save_forward(ctx, x, weight, bias, mean, rstd, activation)
    ctx.norm_ndim = norm_ndim
    # The backward runs pinned to the forward's backend, whatever thread runs it.
    ctx.backend = _backend.current(_LN_FWD, x.device, x.dtype)


def _ln_backward(ctx, grad_y, grad_mean, grad_rstd, direct: bool = False):
    """The formula; ``direct``: the backend's implementation called without the dispatcher."""
    x, weight, mean, rstd, bias = ctx.saved_tensors
    mask = grad_mask(ctx, weight)
    if not any(mask):
        return None, None, None, None, None, None
    with _backend.pinned(ctx.backend):
        backward = _backend.resolve(_LN_BWD, grad_y.device, x.dtype) if direct else array_layer_norm_backward
        gx, gw, gb = backward(grad_y, x, weight, mean, rstd, ctx.norm_ndim, mask, bias, ctx.activation)
    return input_grads(ctx, mask, gx, gw, gb) + (None, None, None)


array_layer_norm.register_autograd(_ln_backward, setup_context=_ln_setup_context)


# ---- the eager entry points ---------------------------------------------------
#
# What hfkern.nn calls. Where the torch backend serves a call in eager mode
# (hfkern._backend.eager_torch), an autograd Function runs the registered torch
# implementations directly, forward and backward, with the op's own formula: the
# same functions on the same arguments, without the dispatcher's host time per
# call. A backward that builds a graph (create_graph=True) runs the op's formula,
# which dispatches the backward op for its double-backward formula.

def layer_norm(x: Tensor, weight: Tensor | None, bias: Tensor | None, norm_ndim: int, eps: float,
               activation: str = "none") -> tuple[Tensor, Tensor, Tensor]:
    """``array_layer_norm``'s arguments and results, differentiable, without the dispatcher
    on the torch backend in eager mode."""
    x, weight, bias = _autocast.cast_inputs("hfkern::array_layer_norm", x.device.type, x, weight, bias)
    if not _backend.eager_torch(_LN_FWD, x.device, x.dtype):
        refuse_forward_ad(_LN_FWD, x, weight, bias)
        return array_layer_norm(x, weight, bias, norm_ndim, eps, activation)
    _check(_LN_FWD, x, weight, bias, norm_ndim)
    check_activation(f"hfkern::{_LN_FWD}", activation)
    if _native_ok(x, weight, bias):
        return _native_layer_norm(x, weight, bias, norm_ndim, eps, activation)
    return _EagerLayerNorm.apply(x, weight, bias, norm_ndim, eps, activation)


def _native_layer_norm(x: Tensor, weight: Tensor | None, bias: Tensor | None, norm_ndim: int, eps: float,
                       activation: str, out: Tensor | None = None) -> tuple[Tensor, Tensor, Tensor]:
    """Layer norm of :func:`_native_ok` inputs: torch's layer norm without its affine step
    (one kernel for the statistics and xhat), then the per-model affine step, into ``out``
    (the torch implementation) or, with None, differentiable by torch's autograd (the eager
    path: C++ backward nodes, ``native_layer_norm_backward`` and the affine op's)."""
    xhat, mean, rstd = torch.native_layer_norm(x, x.shape[x.dim() - norm_ndim:], None, None, eps)
    w, b = _affine_params(x, weight, bias, norm_ndim, x.dtype)
    # (the activation in place: no backward node saves the affine output or xhat)
    y = activate_(_write_affine(out, xhat, w, b), activation)
    return y, _stats_out(mean.detach(), x, norm_ndim), _stats_out(rstd.detach(), x, norm_ndim)


class _EagerLayerNorm(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, bias, norm_ndim, eps, activation):
        output = _backend.resolve(_LN_FWD, x.device, x.dtype)(x, weight, bias, norm_ndim, eps, activation)
        _ln_setup_context(ctx, (x, weight, bias, norm_ndim, eps, activation), output)
        return output

    @staticmethod
    def backward(ctx, grad_y, grad_mean, grad_rstd):
        return _ln_backward(ctx, grad_y, grad_mean, grad_rstd, direct=not torch.is_grad_enabled())


# ---- double backward --------------------------------------------------------
#
# The backward ops' gradients are derived, not written out: each formula takes
# the vector-Jacobian product of the reference math of the backward
# (norm_backward_math, differentiable aten ops). Written out,
# the layer-norm double backward is long and easy to get subtly wrong (see
# aten's layer_norm_double_backward); derived, it is exact by construction for
# every output mask, with and without weight. torch.func.vjp
# rather than torch.autograd.grad: grad_y and weight may themselves depend on
# x in the caller's graph (a gradient penalty's grad_y does), and autograd.grad
# with respect to such tensors would add those paths (and walk the already
# freed forward graph). vjp treats the op's inputs as independent, and its
# result stays differentiable with respect to them, so third and higher
# derivatives are exact too. None of this runs unless a backward is itself
# differentiated.

# The backward ops' differentiable inputs, by position: grad_y, x, weight (both
# ops) and bias (the layer-norm backward's argument 7, through the activation).
_LN_BWD_BIAS = 7


def _ln_backward_setup_context(ctx, inputs, output):
    grad_y, x, weight, mean, rstd, norm_ndim, output_mask, bias, activation = inputs
    ctx.save_for_backward(grad_y, x, weight, bias, mean, rstd)
    ctx.norm_ndim, ctx.output_mask, ctx.activation = norm_ndim, list(output_mask), activation


def _rms_backward_setup_context(ctx, inputs, output):
    grad_y, x, weight, rstd, norm_ndim, output_mask = inputs
    ctx.save_for_backward(grad_y, x, weight, None, rstd)
    ctx.norm_ndim, ctx.output_mask, ctx.activation = norm_ndim, list(output_mask), "none"


def _norm_backward_backward(ctx, *grad_outputs):
    grad_y, x, weight, bias, *stats = ctx.saved_tensors
    mean, rstd = stats if len(stats) == 2 else (None, stats[0])
    inputs = {0: grad_y, 1: x, 2: weight}
    if len(stats) == 2:
        inputs[_LN_BWD_BIAS] = bias

    def math(args):
        return norm_backward_math(args[0], args[1], args[2], mean, rstd, ctx.norm_ndim, ctx.output_mask,
                                  args.get(_LN_BWD_BIAS), ctx.activation)

    return backward_of_backward(ctx.needs_input_grad, inputs, ctx.output_mask, grad_outputs, math)


array_layer_norm_backward.register_autograd(
    _norm_backward_backward, setup_context=_ln_backward_setup_context
)


# ---- RMS norm -------------------------------------------------------------

@torch.library.custom_op("hfkern::array_rms_norm", mutates_args=())
def array_rms_norm(
    x: Tensor, weight: Tensor | None, norm_ndim: int, eps: float
) -> tuple[Tensor, Tensor]:
    _check(_RMS_FWD, x, weight, None, norm_ndim)
    fn = _backend.resolve(_RMS_FWD, x.device, x.dtype)
    return fn(x, weight, norm_ndim, eps)


@array_rms_norm.register_fake
def _(x, weight, norm_ndim, eps):
    _check(_RMS_FWD, x, weight, None, norm_ndim)
    return torch.empty_like(x), _fake_stats(x, norm_ndim)


@torch.library.custom_op("hfkern::array_rms_norm_backward", mutates_args=())
def array_rms_norm_backward(
    grad_y: Tensor,
    x: Tensor,
    weight: Tensor | None,
    rstd: Tensor,
    norm_ndim: int,
    output_mask: list[bool],
) -> tuple[Tensor, Tensor]:
    _check(_RMS_BWD, x, weight, None, norm_ndim, grad_y, rstd=rstd)
    check_mask(_RMS_BWD, output_mask, 2, weight)
    fn = _backend.resolve(_RMS_BWD, grad_y.device, x.dtype)
    return fn(grad_y, x, weight, rstd, norm_ndim, output_mask)


@array_rms_norm_backward.register_fake
def _(grad_y, x, weight, rstd, norm_ndim, output_mask):
    _check(_RMS_BWD, x, weight, None, norm_ndim, grad_y, rstd=rstd)
    check_mask(_RMS_BWD, output_mask, 2, weight)
    return backward_outputs(x, weight, output_mask, _param_shape(x, norm_ndim))


def _rms_setup_context(ctx, inputs, output):
    x, weight, norm_ndim, eps = inputs
    _, rstd = output
    ctx.save_for_backward(x, weight, rstd)
    ctx.norm_ndim = norm_ndim
    ctx.mark_non_differentiable(rstd)
    ctx.backend = _backend.current(_RMS_FWD, x.device, x.dtype)


def _rms_backward(ctx, grad_y, grad_rstd, direct: bool = False):
    """The formula; ``direct``: the backend's implementation called without the dispatcher."""
    x, weight, rstd = ctx.saved_tensors
    needs = ctx.needs_input_grad
    mask = [needs[0], weight is not None and needs[1]]
    if not any(mask):
        return None, None, None, None
    with _backend.pinned(ctx.backend):
        backward = _backend.resolve(_RMS_BWD, grad_y.device, x.dtype) if direct else array_rms_norm_backward
        gx, gw = backward(grad_y, x, weight, rstd, ctx.norm_ndim, mask)
    return gx if mask[0] else None, gw if mask[1] else None, None, None


array_rms_norm.register_autograd(_rms_backward, setup_context=_rms_setup_context)


def rms_norm(x: Tensor, weight: Tensor | None, norm_ndim: int, eps: float) -> tuple[Tensor, Tensor]:
    """``array_rms_norm``'s arguments and results, differentiable, without the dispatcher on
    the torch backend in eager mode (see :func:`layer_norm`)."""
    x, weight = _autocast.cast_inputs("hfkern::array_rms_norm", x.device.type, x, weight)
    if not _backend.eager_torch(_RMS_FWD, x.device, x.dtype):
        refuse_forward_ad(_RMS_FWD, x, weight)
        return array_rms_norm(x, weight, norm_ndim, eps)
    _check(_RMS_FWD, x, weight, None, norm_ndim)
    return _EagerRMSNorm.apply(x, weight, norm_ndim, eps)


class _EagerRMSNorm(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, norm_ndim, eps):
        output = _backend.resolve(_RMS_FWD, x.device, x.dtype)(x, weight, norm_ndim, eps)
        _rms_setup_context(ctx, (x, weight, norm_ndim, eps), output)
        return output

    @staticmethod
    def backward(ctx, grad_y, grad_rstd):
        return _rms_backward(ctx, grad_y, grad_rstd, direct=not torch.is_grad_enabled())


array_rms_norm_backward.register_autograd(
    _norm_backward_backward, setup_context=_rms_backward_setup_context
)

# torch runs layer norm in float32 under CUDA autocast and in its input's dtype on the CPU;
# RMS norm follows torch's rule for it in the running version (it changed).
_autocast.register("hfkern::array_layer_norm", "fp32", ("cuda",))
_autocast.register_like("hfkern::array_rms_norm", "aten::rms_norm", "fp32", ("cuda",))
