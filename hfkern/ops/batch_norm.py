"""hfkern::array_batch_norm: B models' batch norms (BatchNorm1d/2d/3d) as one op.

Ops (registered with torch.library, implementations chosen by the registry):

``array_batch_norm(x, weight, bias, running_mean, running_var, num_batches_tracked,``
``training, momentum, eps) -> (y, mean, rstd)``
    x ``[B, N, C, *S]`` with 0 to 3 spatial dims ``S`` and any strides (an
    array conv's ``[N, B, C, *S]`` memory behind its ``[B, N, C, *S]`` view, a
    strided slice, channels-last memory, a shared input with stride 0 on B).
    weight and bias ``[B, C]`` or None. running_mean and running_var ``[B, C]``,
    both or neither. num_batches_tracked ``[B]`` (an integer dtype) or None.
    ``n = N * prod(S)`` values per (model, channel).

    ``training=True``: y is normalized with the batch statistics of each
    (model, channel) over N and S (biased variance; ``n == 1`` raises
    ValueError, as torch does). Given running statistics, they are updated in
    place, per model: ``running = (1 - f) * running + f * batch``, with the
    unbiased variance ``var * n / (n - 1)`` for running_var, and ``f =
    momentum``, or ``f = 1 / num_batches_tracked[b]`` when momentum is None
    (torch's cumulative average; num_batches_tracked must be the counts with
    this batch included: modules increment it before the call, as torch's do;
    it is only read). The blend is computed in float64 on the torch path (as
    torch's CPU kernel) and float32 in the Triton kernels (as torch's CUDA
    kernel). In training, an input with ``n == 0`` changes no running
    statistic and gives NaN statistics.

    ``training=False``: y is normalized with the running statistics, which are
    then required (ValueError otherwise) and are not changed.

    ``y`` has x's dtype and the layout of ``torch.empty_like(x)`` (x's strides
    when x is dense and non-overlapping, so ``[N, B, C, *S]`` memory stays
    that way). ``mean`` and ``rstd = 1 / sqrt(var + eps)`` are the statistics
    y was normalized with (the batch's in training, the running ones in eval),
    contiguous ``[B, C]`` in the accumulation dtype (float32, float64 for
    float64 x), and not differentiable.

``array_batch_norm_backward(grad_y, x, weight, mean, rstd, training, output_mask)``
``-> (grad_x, grad_weight, grad_bias)``
    ``mean`` and ``rstd`` as the forward returned them. With
    ``xhat = (x - mean) * rstd`` and sums over N and S per (model, channel)::

        grad_bias   = sum(grad_y)
        grad_weight = sum(grad_y * xhat)
        grad_x      = weight * rstd * (grad_y - grad_bias / n - xhat * grad_weight / n)   training
        grad_x      = weight * rstd * grad_y                                              eval

    One op with an ``output_mask``, as ``array_layer_norm_backward``: the three
    gradients share the two per-channel sums, so a backend reduces ``x`` and
    ``grad_y`` once for all of them. Custom ops cannot return None: an output
    whose mask entry is False is an empty ``[0]`` tensor of x's dtype.
    ``grad_x`` has x's dtype and the layout of ``torch.empty_like(x)`` (per
    model for a shared input; autograd's expand backward sums it);
    ``grad_weight`` and ``grad_bias`` are contiguous ``[B, C]`` in weight's
    dtype (x's without a weight). ``output_mask[1]`` requires a weight.

Autograd. An op that mutates an input cannot carry a torch.library autograd
formula (``register_autograd`` refuses non-functional schemas), and the
forward must update the running statistics where they lie, so
``torch.ops.hfkern.array_batch_norm`` itself is not differentiable. The
differentiable entry point is :func:`array_batch_norm` of this module, a
``torch.autograd.Function`` around the op with the same signature and
results: its backward runs ``array_batch_norm_backward`` on the backend the
forward ran (under ``torch.compile`` the pin is traced away, as for every
op). ``torch.compile`` traces the Function and functionalizes the mutation;
``torch.library.opcheck`` checks the forward op with inputs that do not
require grad, and everything on the backward op.

Double backward: ``array_batch_norm_backward`` is differentiable, as the layer
norm backward: its formula differentiates the reference math
(:func:`batch_norm_backward_math`) with ``torch.func.vjp``. In training,
``mean`` and ``rstd`` are differentiated as the functions of x they are (the
gradient with respect to x is the total one) and get no gradient of their
own; in eval they are constants. It only runs when a backward is itself
differentiated (``create_graph=True``).
"""

from __future__ import annotations

import math
from typing import Sequence

import torch
from torch import Tensor

from .. import _backend
from .._array import from_grouped, is_shared, op_result, per_model_memory_first, to_grouped
from .._dtypes import acc_dtype

__all__ = ["array_batch_norm", "array_batch_norm_backward", "batch_norm_backward_math"]

_FWD, _BWD = "array_batch_norm", "array_batch_norm_backward"


# ---- the torch implementations (CPU path and oracle) ---------------------------
#
# The B models' batch norms are one set of reductions over the N and spatial
# dims of ``x`` per (model, channel); nothing is reshaped, so ``x`` is read
# where it lies whatever its strides (an [N, B, C, *S]-memory conv output is
# not gathered into [B, N, C, *S]). Statistics and the normalized values are
# computed in the accumulation dtype and rounded to x's dtype once, on the
# write into the output.
#
# Shapes::
#
#     x, y, grad_y, grad_x      [B, N, C, *S]   y/grad_x laid out like torch.empty_like(x)
#     weight, bias              [B, C]
#     running_mean, running_var [B, C]          updated in place in training
#     num_batches_tracked       [B]
#     mean, rstd                [B, C]          accumulation dtype, contiguous
#     grad_weight, grad_bias    [B, C]          contiguous


def values_per_channel(x: Tensor) -> int:
    """n: the values each (model, channel) statistic is taken over, ``N * prod(S)``."""
    return x.shape[1] * math.prod(x.shape[3:])


def _reduced_dims(x: Tensor) -> list[int]:
    return [1, *range(3, x.dim())]


def _channel_view(t: Tensor, x: Tensor) -> Tensor:
    """[B, C] (or [1, C]) -> [B, 1, C, 1, ...], broadcastable against x."""
    return t.reshape(t.shape[0], 1, t.shape[1], *([1] * (x.dim() - 3)))


def _update_running(
    running_mean: Tensor, running_var: Tensor, num_batches_tracked: Tensor | None,
    mean: Tensor, var_unbiased: Tensor, momentum: float | None,
) -> None:
    """running <- f * batch + (1 - f) * running per model, in float64 as torch's CPU kernel."""
    if momentum is None:
        factor = 1.0 / num_batches_tracked.to(torch.float64).unsqueeze(1)
    else:
        factor = momentum
    for buf, new in ((running_mean, mean), (running_var, var_unbiased)):
        buf.copy_(factor * new.to(torch.float64) + (1 - factor) * buf.to(torch.float64))


def _grouped_ok(x: Tensor, *tensors: Tensor | None) -> bool:
    """Whether torch's own batch norm can serve ``x`` on the free grouped view
    ``[N, B*C, *S]``: ``[N, B, C, *S]`` memory (an array conv's output), and
    every per-channel tensor of x's dtype (float32 or float64, so the
    statistics are in the accumulation dtype either way)."""
    # B > 1: for B = 1 the view's strides would differ from torch.empty_like(x)'s
    return (x.dtype in (torch.float32, torch.float64) and x.numel() > 0 and x.dim() > 3 and x.size(0) > 1
            and per_model_memory_first(x) and not is_shared(x)
            and all(t is None or t.dtype == x.dtype for t in tensors))


def _flat(t: Tensor | None) -> Tensor | None:
    return None if t is None else t.reshape(-1)


def _grouped_forward(x, weight, bias, running_mean, running_var, num_batches_tracked, momentum, eps):
    """Training on ``[N, B, C, *S]`` memory: torch's kernel (cuDNN, oneDNN) on the
    grouped view, about twice as fast as strided reductions over ``x``."""
    B, C = x.shape[0], x.shape[2]
    running, factor = (None, None), 0.0
    if running_mean is not None and momentum is not None:
        running, factor = (running_mean.view(-1), running_var.view(-1)), momentum  # updated in place
    elif running_mean is not None:
        # Per-model factors: torch writes the batch mean and unbiased variance
        # (momentum 1 into zeros), blended per model below.
        running, factor = (x.new_zeros(B * C), x.new_zeros(B * C)), 1.0
    y, mean, rstd = torch.native_batch_norm(
        to_grouped(x), _flat(weight), _flat(bias), *running, True, factor, eps
    )
    if running_mean is not None and momentum is None:
        _update_running(running_mean, running_var, num_batches_tracked,
                        running[0].view(B, C), running[1].view(B, C), None)
    return op_result(from_grouped(y, B)), mean.view(B, C), rstd.view(B, C)


@_backend.implements(_FWD, "torch")
def array_batch_norm_torch(
    x: Tensor,
    weight: Tensor | None,
    bias: Tensor | None,
    running_mean: Tensor | None,
    running_var: Tensor | None,
    num_batches_tracked: Tensor | None,
    training: bool,
    momentum: float | None,
    eps: float,
) -> tuple[Tensor, Tensor, Tensor]:
    B, C = x.shape[0], x.shape[2]
    acc = acc_dtype(x.dtype)
    if training and values_per_channel(x) > 0 and _grouped_ok(x, weight, bias, running_mean, running_var):
        return _grouped_forward(x, weight, bias, running_mean, running_var, num_batches_tracked, momentum, eps)
    if training:
        n = values_per_channel(x)
        # A shared input is the same batch for every model: its statistics once.
        src = x[:1] if is_shared(x) else x
        if n == 0:  # var_mean of nothing: NaN, and a warning this contract makes moot
            var = mean = x.new_full((src.shape[0], C), math.nan, dtype=acc)
        else:
            var, mean = torch.var_mean(src.to(acc), dim=_reduced_dims(x), correction=0)
            if running_mean is not None:
                _update_running(
                    running_mean, running_var, num_batches_tracked, mean, var * (n / (n - 1)), momentum
                )
        rstd = (var + eps).rsqrt_()
        mean, rstd = mean.expand(B, C).contiguous(), rstd.expand(B, C).contiguous()
    else:
        # copies: an output may not alias an input
        mean = running_mean.to(dtype=acc, memory_format=torch.contiguous_format, copy=True)
        rstd = (running_var.to(acc) + eps).rsqrt_().contiguous()
    scale = rstd if weight is None else rstd * weight.to(acc)
    centered = x.to(acc) - _channel_view(mean, x)
    y = torch.empty_like(x)
    if bias is None:
        return torch.mul(centered, _channel_view(scale, x), out=y), mean, rstd
    shift = _channel_view(bias.to(acc), x)
    return torch.addcmul(shift, centered, _channel_view(scale, x), out=y), mean, rstd


@_backend.implements(_BWD, "torch")
def array_batch_norm_backward_torch(
    grad_y: Tensor,
    x: Tensor,
    weight: Tensor | None,
    mean: Tensor,
    rstd: Tensor,
    training: bool,
    output_mask: Sequence[bool],
) -> tuple[Tensor, Tensor, Tensor]:
    """(grad_x, grad_weight, grad_bias); an output whose mask entry is False is ``[0]``."""
    if training and _grouped_ok(x, grad_y, weight, mean):
        B, N, C = x.shape[:3]
        if not per_model_memory_first(grad_y):
            # e.g. the gradient of a max over points (PointNet), in [B, N, ...]
            # memory: one copy into x's layout costs less than the strided
            # reductions of the general path (several passes over x and grad_y).
            grad_y = grad_y.transpose(0, 1).contiguous().transpose(0, 1)
        # CUDA's kernel reads the weight's device even when it is undefined ("tensor does not
        # have a device"): a weight of ones is the same math on every device.
        w = _flat(weight) if weight is not None else x.new_ones(B * C)
        gx, gw, gb = torch.ops.aten.native_batch_norm_backward(
            to_grouped(grad_y), to_grouped(x), w, None, None, mean.view(-1), rstd.view(-1),
            True, 0.0, list(output_mask),
        )
        # unrequested outputs: distinct empties, as custom-op outputs may not alias
        return (
            op_result(from_grouped(gx, B)) if output_mask[0] else x.new_empty(0),
            gw.view(B, C) if output_mask[1] else x.new_empty(0),
            gb.view(B, C) if output_mask[2] else x.new_empty(0),
        )
    acc = mean.dtype
    dims = _reduced_dims(x)
    n = values_per_channel(x)
    rstd_v = _channel_view(rstd, x)
    xhat = (x.to(acc) - _channel_view(mean, x)).mul_(rstd_v)
    gy = grad_y.to(acc)
    param_dtype = x.dtype if weight is None else weight.dtype
    # Unrequested outputs are distinct empties: custom-op outputs may not alias.
    grad_x, grad_w, grad_b = x.new_empty(0), x.new_empty(0), x.new_empty(0)
    if output_mask[1] or output_mask[2] or (output_mask[0] and training):
        sum_gy = gy.sum(dim=dims)
        sum_gy_xhat = (gy * xhat).sum(dim=dims)
    if output_mask[0]:
        scale = rstd_v if weight is None else rstd_v * _channel_view(weight.to(acc), x)
        inner = gy
        if training:
            inner = gy - _channel_view(sum_gy / n, x) - xhat * _channel_view(sum_gy_xhat / n, x)
        grad_x = torch.mul(inner, scale, out=torch.empty_like(x))
    if output_mask[1]:
        grad_w = sum_gy_xhat.to(param_dtype).contiguous()
    if output_mask[2]:
        grad_b = sum_gy.to(param_dtype).contiguous()
    return grad_x, grad_w, grad_b


# ---- differentiable backward math (double backward) --------------------------
#
# In training, mean and rstd are functions of x, and a double backward must
# differentiate through them. eps is not an input of the backward op, so the
# statistics are re-attached to x rather than recomputed (the layer-norm
# trick): with v(x) the biased variance, v0 and r0 its value and the saved
# rstd here, r(x) = r0 * rsqrt(1 + r0^2 * (v(x) - v0)) equals (v(x) + eps)^-1/2
# as a function of x, with the saved value r0 itself.


def batch_norm_backward_math(
    grad_y: Tensor,
    x: Tensor,
    weight: Tensor | None,
    mean: Tensor,
    rstd: Tensor,
    training: bool,
    output_mask: Sequence[bool],
) -> list[Tensor | None]:
    """The math of :func:`array_batch_norm_backward_torch` in differentiable ops,
    with mean and rstd as functions of x in training: (grad_x, grad_weight,
    grad_bias), None where the mask entry is False. What the double-backward
    formula differentiates; slower than the backward op, which it matches."""
    acc = rstd.dtype
    dims = _reduced_dims(x)
    n = values_per_channel(x)
    xf = x.to(acc)
    mean_v, rstd_v = _channel_view(mean, x), _channel_view(rstd, x)
    if training:
        mu = xf.mean(dim=dims, keepdim=True)
        mean_v = mean_v + (mu - mu.detach())
        v = (xf - mu).square().mean(dim=dims, keepdim=True)
        rstd_v = rstd_v * torch.rsqrt(1 + rstd_v.square() * (v - v.detach()))
    xhat = (xf - mean_v) * rstd_v
    gy = grad_y.to(acc)
    sum_gy = gy.sum(dim=dims, keepdim=True)
    sum_gy_xhat = (gy * xhat).sum(dim=dims, keepdim=True)
    param_dtype = x.dtype if weight is None else weight.dtype
    outs: list[Tensor | None] = [None, None, None]
    if output_mask[0]:
        inner = gy - sum_gy / n - xhat * (sum_gy_xhat / n) if training else gy
        scale = rstd_v if weight is None else rstd_v * _channel_view(weight.to(acc), x)
        outs[0] = (inner * scale).to(x.dtype)
    if output_mask[1]:
        outs[1] = sum_gy_xhat.reshape(x.shape[0], x.shape[2]).to(param_dtype)
    if output_mask[2]:
        outs[2] = sum_gy.reshape(x.shape[0], x.shape[2]).to(param_dtype)
    return outs


# ---- the ops -----------------------------------------------------------------

def _shape(t: Tensor) -> list[int]:
    return list(t.shape)


def _check_x(op: str, x: Tensor) -> None:
    if not 3 <= x.dim() <= 6:
        raise ValueError(
            f"hfkern::{op}: expected x of shape [B, N, C, *spatial] with 0 to 3 spatial dims "
            f"(3-D to 6-D), got {x.dim()}-D shape {_shape(x)}"
        )
    if not x.is_floating_point():
        raise TypeError(f"hfkern::{op}: expected x of a floating-point dtype, got {x.dtype}")


def _check_per_channel(op: str, x: Tensor, **tensors: Tensor | None) -> None:
    expected = [x.shape[0], x.shape[2]]
    for name, t in tensors.items():
        if t is None:
            continue
        if _shape(t) != expected:
            raise ValueError(
                f"hfkern::{op}: expected {name} of shape {expected} ([B, C] of x of shape "
                f"{_shape(x)}), got {_shape(t)}"
            )
        if not t.is_floating_point():
            raise TypeError(f"hfkern::{op}: expected {name} of a floating-point dtype, got {t.dtype}")


def _check_forward(
    x: Tensor, weight, bias, running_mean, running_var, num_batches_tracked, training, momentum
) -> None:
    _check_x(_FWD, x)
    _check_per_channel(_FWD, x, weight=weight, bias=bias, running_mean=running_mean,
                       running_var=running_var)
    if (running_mean is None) != (running_var is None):
        given = "running_mean" if running_var is None else "running_var"
        raise ValueError(
            f"hfkern::{_FWD}: expected running_mean and running_var both or neither, got only {given}"
        )
    if not training and running_mean is None:
        raise ValueError(
            f"hfkern::{_FWD}: training=False normalizes with the running statistics: expected "
            "running_mean and running_var, got None"
        )
    if training and values_per_channel(x) == 1:
        raise ValueError(
            f"hfkern::{_FWD}: expected more than 1 value per channel when training, got x of "
            f"shape {_shape(x)} (N * prod(spatial) = 1)"
        )
    if num_batches_tracked is not None:
        if _shape(num_batches_tracked) != [x.shape[0]]:
            raise ValueError(
                f"hfkern::{_FWD}: expected num_batches_tracked of shape [{x.shape[0]}] ([B]), "
                f"got {_shape(num_batches_tracked)}"
            )
        if num_batches_tracked.is_floating_point() or num_batches_tracked.is_complex() or \
                num_batches_tracked.dtype == torch.bool:
            raise TypeError(
                f"hfkern::{_FWD}: expected num_batches_tracked of an integer dtype, "
                f"got {num_batches_tracked.dtype}"
            )
    elif training and momentum is None and running_mean is not None:
        raise ValueError(
            f"hfkern::{_FWD}: momentum=None (cumulative average) updates the running statistics "
            "by 1 / num_batches_tracked: expected num_batches_tracked of shape "
            f"[{x.shape[0]}], got None"
        )


def _check_backward(grad_y: Tensor, x: Tensor, weight, mean, rstd, output_mask) -> None:
    _check_x(_BWD, x)
    if _shape(grad_y) != _shape(x):
        raise ValueError(
            f"hfkern::{_BWD}: expected grad_y of x's shape {_shape(x)}, got {_shape(grad_y)}"
        )
    _check_per_channel(_BWD, x, weight=weight, mean=mean, rstd=rstd)
    if len(output_mask) != 3:
        raise ValueError(f"hfkern::{_BWD}: expected output_mask of length 3, got {list(output_mask)}")
    if output_mask[1] and weight is None:
        raise ValueError(f"hfkern::{_BWD}: output_mask asks for grad_weight but weight is None")


@torch.library.custom_op("hfkern::array_batch_norm", mutates_args=("running_mean", "running_var"))
def array_batch_norm_op(
    x: Tensor,
    weight: Tensor | None,
    bias: Tensor | None,
    running_mean: Tensor | None,
    running_var: Tensor | None,
    num_batches_tracked: Tensor | None,
    training: bool,
    momentum: float | None,
    eps: float,
) -> tuple[Tensor, Tensor, Tensor]:
    """The registered op (not differentiable: see the module docstring)."""
    _check_forward(x, weight, bias, running_mean, running_var, num_batches_tracked, training, momentum)
    fn = _backend.resolve(_FWD, x.device, x.dtype)
    return fn(x, weight, bias, running_mean, running_var, num_batches_tracked, training, momentum, eps)


@array_batch_norm_op.register_fake
def _(x, weight, bias, running_mean, running_var, num_batches_tracked, training, momentum, eps):
    _check_forward(x, weight, bias, running_mean, running_var, num_batches_tracked, training, momentum)
    stats = (x.shape[0], x.shape[2])
    acc = acc_dtype(x.dtype)
    return torch.empty_like(x), x.new_empty(stats, dtype=acc), x.new_empty(stats, dtype=acc)


@torch.library.custom_op("hfkern::array_batch_norm_backward", mutates_args=())
def array_batch_norm_backward(
    grad_y: Tensor,
    x: Tensor,
    weight: Tensor | None,
    mean: Tensor,
    rstd: Tensor,
    training: bool,
    output_mask: list[bool],
) -> tuple[Tensor, Tensor, Tensor]:
    _check_backward(grad_y, x, weight, mean, rstd, output_mask)
    fn = _backend.resolve(_BWD, grad_y.device, x.dtype)
    return fn(grad_y, x, weight, mean, rstd, training, output_mask)


@array_batch_norm_backward.register_fake
def _(grad_y, x, weight, mean, rstd, training, output_mask):
    _check_backward(grad_y, x, weight, mean, rstd, output_mask)
    param_dtype = x.dtype if weight is None else weight.dtype

    def param_grad(wanted: bool) -> Tensor:
        return x.new_empty((x.shape[0], x.shape[2]), dtype=param_dtype) if wanted else x.new_empty(0)

    grad_x = torch.empty_like(x) if output_mask[0] else x.new_empty(0)
    return grad_x, param_grad(output_mask[1]), param_grad(output_mask[2])


class _ArrayBatchNorm(torch.autograd.Function):
    """Autograd around the mutating forward op (which cannot carry a torch.library formula)."""

    @staticmethod
    def forward(x, weight, bias, running_mean, running_var, num_batches_tracked, training, momentum, eps):
        return array_batch_norm_op(
            x, weight, bias, running_mean, running_var, num_batches_tracked, training, momentum, eps
        )

    @staticmethod
    def setup_context(ctx, inputs, output):
        x, weight, bias, *_, training, _momentum, _eps = inputs
        _, mean, rstd = output
        ctx.save_for_backward(x, weight, mean, rstd)
        ctx.training = training
        ctx.bias_dtype = None if bias is None else bias.dtype
        ctx.mark_non_differentiable(mean, rstd)
        # No gradient flows into mean and rstd: autograd would otherwise hand the
        # backward two [B, C] zero tensors it allocates and fills every step.
        ctx.set_materialize_grads(False)
        # The backward runs pinned to the forward's backend, whatever thread runs
        # it; a compiled graph resolves its ops when it runs instead.
        ctx.backend = None if torch.compiler.is_compiling() else _backend.current(_FWD, x.device, x.dtype)

    @staticmethod
    def backward(ctx, grad_y, grad_mean, grad_rstd):
        x, weight, mean, rstd = ctx.saved_tensors
        needs = ctx.needs_input_grad
        mask = [needs[0], weight is not None and needs[1], ctx.bias_dtype is not None and needs[2]]
        none = (None,) * 6
        if not any(mask) or grad_y is None:
            return (None, None, None) + none
        if ctx.backend is None:
            gx, gw, gb = array_batch_norm_backward(grad_y, x, weight, mean, rstd, ctx.training, mask)
        else:
            with _backend.pinned(ctx.backend):
                gx, gw, gb = array_batch_norm_backward(grad_y, x, weight, mean, rstd, ctx.training, mask)
        return (
            gx if mask[0] else None,
            gw if mask[1] else None,
            gb.to(ctx.bias_dtype) if mask[2] else None,
        ) + none


def array_batch_norm(
    x: Tensor,
    weight: Tensor | None,
    bias: Tensor | None,
    running_mean: Tensor | None,
    running_var: Tensor | None,
    num_batches_tracked: Tensor | None,
    training: bool,
    momentum: float | None,
    eps: float,
) -> tuple[Tensor, Tensor, Tensor]:
    """Batch norm of B models, differentiable: ``hfkern::array_batch_norm`` with autograd.

    x ``[B, N, C, *S]`` (0 to 3 spatial dims, any strides); weight, bias,
    running_mean, running_var ``[B, C]`` or None; num_batches_tracked ``[B]``
    or None. Returns ``(y, mean, rstd)``: y ``[B, N, C, *S]`` in x's dtype and
    memory order, mean and rstd ``[B, C]`` (accumulation dtype, not
    differentiable). In training the running statistics are updated in place.
    The full contract is the module docstring.
    """
    return _ArrayBatchNorm.apply(
        x, weight, bias, running_mean, running_var, num_batches_tracked, training, momentum, eps
    )


# ---- double backward --------------------------------------------------------
#
# As for the layer-norm backward ops: the vector-Jacobian product of the
# reference math, with torch.func.vjp so that grad_y and weight are treated as
# the independent inputs of the op they are (a gradient penalty's grad_y
# depends on x in the caller's graph) and the result stays differentiable.

def _backward_setup_context(ctx, inputs, output):
    grad_y, x, weight, mean, rstd, training, output_mask = inputs
    ctx.save_for_backward(grad_y, x, weight, mean, rstd)
    ctx.training = training
    ctx.output_mask = list(output_mask)


def _backward_backward(ctx, grad_grad_x, grad_grad_w, grad_grad_b):
    grad_y, x, weight, mean, rstd = ctx.saved_tensors
    needs = ctx.needs_input_grad
    wanted = [i for i, t in enumerate((grad_y, x, weight)) if needs[i] and t is not None]
    result: list[Tensor | None] = [None] * len(needs)
    if not wanted:
        return tuple(result)
    mask = ctx.output_mask
    primals = [(grad_y, x, weight)[i] for i in wanted]

    def math_of(*differentiated):
        args = [grad_y, x, weight]
        for i, t in zip(wanted, differentiated):
            args[i] = t
        outs = batch_norm_backward_math(*args, mean, rstd, ctx.training, mask)
        return tuple(o for o in outs if o is not None)

    if any(mask):
        _, vjp = torch.func.vjp(math_of, *primals)
        grads = vjp(tuple(g for g, m in zip((grad_grad_x, grad_grad_w, grad_grad_b), mask) if m))
    else:  # nothing was computed: zero gradients (what AOTAutograd derives, too)
        grads = [torch.zeros_like(t) for t in primals]
    for i, g in zip(wanted, grads):
        result[i] = g
    return tuple(result)


array_batch_norm_backward.register_autograd(_backward_backward, setup_context=_backward_setup_context)
