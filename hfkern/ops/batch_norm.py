"""hfkern::array_batch_norm: B models' batch norms (BatchNorm1d/2d/3d) as one op.

Ops (registered with torch.library, implementations chosen by the registry):

``array_batch_norm(x, weight, bias, running_mean, running_var, num_batches_tracked,``
``training, momentum, eps, activation="none") -> (y, mean, rstd)``
    x ``[B, N, C, *S]`` with 0 to 3 spatial dims ``S`` and any strides (an
    array conv's ``[N, B, C, *S]`` memory behind its ``[B, N, C, *S]`` view, or
    the ``[N, H, W, B, C]`` memory of a channels-last array image, a strided
    slice, channels-last memory, a shared input with stride 0 on B).
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

    ``y = act(z)``, ``z = (x - mean) * rstd * weight + bias`` the batch-norm
    output and ``act`` the fused ``activation``: ``"none"`` (identity),
    ``"relu"`` or ``"gelu"`` (the exact erf form, ``torch.nn.GELU()``). Any
    other value raises ValueError before anything is changed. The statistics
    are z's, whatever the activation.

    ``y`` has x's dtype and the layout of ``torch.empty_like(x)`` (x's strides
    when x is dense and non-overlapping, so ``[N, B, C, *S]`` memory stays
    that way). ``mean`` and ``rstd = 1 / sqrt(var + eps)`` are the statistics
    y was normalized with (the batch's in training, the running ones in eval),
    contiguous ``[B, C]`` in the accumulation dtype (float32, float64 for
    float64 x), and not differentiable.

``array_batch_norm_backward(grad_y, x, weight, mean, rstd, training, output_mask,``
``bias=None, activation="none") -> (grad_x, grad_weight, grad_bias)``
    ``mean`` and ``rstd`` as the forward returned them; ``bias`` and
    ``activation`` the forward's (bias is only read with an activation). With
    ``xhat = (x - mean) * rstd``, ``g = grad_y * act'(xhat * weight + bias)``
    (``grad_y`` without an activation; ``z`` recomputed in the accumulation
    dtype where ``x`` is read, so the backward needs nothing but what the
    plain batch norm saves, plus the bias) and sums over N and S per (model,
    channel)::

        grad_bias   = sum(g)
        grad_weight = sum(g * xhat)
        grad_x      = weight * rstd * (g - grad_bias / n - xhat * grad_weight / n)   training
        grad_x      = weight * rstd * g                                              eval

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
own; in eval they are constants. With an activation, ``act'(z)`` depends on
x, weight and bias, and the bias (an input of the backward op then) gets its
gradient too. It only runs when a backward is itself differentiated
(``create_graph=True``).
"""

from __future__ import annotations

import math
from typing import Sequence

import torch
from torch import Tensor

from .. import _backend
from .._array import (
    array_memory_format, eager_empty_like, fresh_array, from_grouped, grouped_in_format, is_shared, op_result,
    per_model_memory_first, refuse_forward_ad, to_grouped,
)
from .._dtypes import acc_dtype
from ._norm import (
    activate_, activation_grad, backward_of_backward, backward_outputs, check_activation, check_mask, grad_mask,
    input_grads, save_forward,
)

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


def _grouped_format(x: Tensor) -> torch.memory_format | None:
    """The memory format of x's grouped view ``[N, B*C, *S]`` where that view is free:
    contiguous for ``[N, B, C, *S]`` memory (an array conv's output), channels-last for
    the ``[N, H, W, B, C]`` memory of a channels-last array image; None otherwise.
    Memory that is both (one channel, or H = W = 1) is what array_memory_format says."""
    if array_memory_format(x) == torch.channels_last:
        return torch.channels_last
    if per_model_memory_first(x):
        return torch.contiguous_format
    return None


def _grouped_view(x: Tensor, *per_channel: Tensor | None, grad_y: Tensor | None = None) -> torch.memory_format | None:
    """The memory format of the free grouped view ``[N, B*C, *S]`` of ``x`` (see
    :func:`_grouped_format`) where torch's own batch norm can serve ``x`` on it, else
    None: float32 or float64 ``x`` with every per-channel tensor of its dtype, or
    torch's mixed precision (bfloat16 or float16 ``x``, as autocast's convs give it,
    with float32 per-channel tensors); the statistics are in the accumulation dtype
    either way."""
    if not (x.dtype in _PARAM_DTYPE and x.numel() > 0 and x.dim() > 3
            and not is_shared(x) and _pairs(x, per_channel)
            and (grad_y is None or grad_y.dtype == x.dtype)):
        return None
    return _grouped_format(x)


def _grouped_copy(x: Tensor, *per_channel: Tensor | None, grad_y: Tensor | None = None) -> bool:
    """Whether torch's batch norm serves ``x`` on a copy of its grouped view, where
    :func:`_grouped_view` found no free one (a linear layer's ``[B, N, C]`` output, images
    in ``[B, N, C, *S]`` memory): the dtypes it pairs, a batch per model (not shared), 1 to
    3 spatial dims or none. Two copies of the activation cost less than the strided
    reductions of the general path, forward and backward (several passes each; on the
    CPU a [8, 32, 256] training step of the norm took 0.76 ms that way and 0.14 ms so)."""
    return (x.dtype in _PARAM_DTYPE and x.numel() > 0 and x.dim() >= 3 and not is_shared(x)
            and _pairs(x, per_channel) and (grad_y is None or grad_y.dtype == x.dtype))


# The per-channel dtype torch's batch norm takes with each activation dtype on the grouped
# path: its own, or float32 (mixed precision: reduced-precision activations, float32
# parameters, running and saved statistics).
_PARAM_DTYPE = {torch.float64: torch.float64, torch.float32: torch.float32,
                torch.bfloat16: torch.float32, torch.float16: torch.float32}


def _pairs(x: Tensor, per_channel: tuple[Tensor | None, ...]) -> bool:
    """Whether every per-channel tensor has the dtype torch's kernel pairs with x's (``x.dtype``
    one of ``_PARAM_DTYPE``'s keys)."""
    return all(t is None or t.dtype == _PARAM_DTYPE[x.dtype] for t in per_channel)


def _grouped_params(xg: Tensor, weight: Tensor | None, bias: Tensor | None) -> tuple[Tensor | None, Tensor | None]:
    """weight and bias flat ``[B*C]`` for torch's kernel on the grouped ``xg``. Without them,
    mixed precision gets float32 ones and zeros (the same math): without a float32
    parameter torch's kernels take the reduced dtype for the statistics too. A bias without a
    weight gets ones for the weight (the same math)."""
    if weight is not None:
        return _flat(weight), _flat(bias)
    if bias is not None:  # torch's kernel has no double backward for a bias without a weight: ones
        return xg.new_ones(xg.shape[1], dtype=bias.dtype), _flat(bias)
    if xg.dtype == _PARAM_DTYPE[xg.dtype]:
        return None, None
    n = xg.shape[1]
    return (xg.new_ones(n, dtype=torch.float32),
            _flat(bias) if bias is not None else xg.new_zeros(n, dtype=torch.float32))


def _flat(t: Tensor | None) -> Tensor | None:
    """A ``[B, C]`` per-channel tensor flat ``[B*C]`` for torch's batch-norm kernels: a view
    where it is contiguous, else a contiguous copy (differentiable). torch's CPU kernels
    ignore a per-channel tensor's stride (``native_batch_norm_backward`` reads a stride-2
    weight or mean as if it were dense: torch 2.13), so a strided slice such as
    ``w[:, ::2]``, whose flat reshape is a stride-2 view, must not reach them as one."""
    if t is None:
        return None
    flat = t.reshape(-1)
    return flat if flat.is_contiguous() else flat.contiguous()


def _from_grouped_like(y: Tensor, x: Tensor, fmt: torch.memory_format) -> Tensor:
    """torch's grouped output ``[N, B*C, *S]`` as ``[B, N, C, *S]`` in x's memory, with x's
    strides also on size-1 dims (the same elements: one channel in channels-last memory),
    so the layout is exactly ``torch.empty_like(x)``'s, as the fake promises. ``fmt``:
    :func:`_grouped_view` of x."""
    out = from_grouped(y, x.shape[0], fmt)
    if out.stride() != x.stride() and all(
            n == 1 or a == b for n, a, b in zip(x.shape, out.stride(), x.stride())):
        out = out.as_strided(x.shape, x.stride(), out.storage_offset())
    return op_result(out)


def _grouped_forward(x, weight, bias, running_mean, running_var, num_batches_tracked, momentum, eps,
                     activation, fmt: torch.memory_format, op: bool = True):
    """Training on memory whose grouped view is free (``fmt``: :func:`_grouped_view` of
    x): torch's kernel (cuDNN, oneDNN) on the grouped view, about twice as fast as
    strided reductions over ``x``. ``op``: the op's kernel; else differentiable by
    torch's autograd (:func:`array_batch_norm`'s eager path; x has no dim of size one
    but B, so the output takes x's strides without :func:`_from_grouped_like`'s
    ``as_strided``, whose gradient is a copy of the whole input)."""
    B = x.shape[0]
    y, mean, rstd = _grouped_train(to_grouped(x), B, weight, bias, running_mean, running_var,
                                   num_batches_tracked, momentum, eps)
    if op:
        y = _from_grouped_like(activate_(y, activation), x, fmt)
    else:  # the activation saves its output: the array itself, not the grouped view (fresh_array)
        out = fresh_array(y, B, fmt)
        if out.stride(0) != x.stride(0):
            # B = 1 in [B, N, ...] memory, the same elements as [N, B, ...]: x's stride on B
            out = torch.ops.aten._unsafe_view(out[0], out.shape)
        y = activate_(out, activation)
    return y, mean, rstd


def _copied_forward(x, weight, bias, running_mean, running_var, num_batches_tracked, momentum, eps, activation):
    """Training where the grouped view is not free (:func:`_grouped_copy`): torch's kernel on a
    copy of it, the output copied back into ``x``'s layout (``torch.empty_like(x)``). The
    op's torch path, and under torch's autograd (the copies' backward included) the eager
    path of :func:`array_batch_norm`: the same ops, so the same values."""
    B = x.shape[0]
    y, mean, rstd = _grouped_train(to_grouped(x), B, weight, bias, running_mean, running_var,
                                   num_batches_tracked, momentum, eps)
    out = torch.empty_like(x)
    out.copy_(from_grouped(activate_(y, activation), B))
    return out, mean, rstd


def _grouped_train(xg, B, weight, bias, running_mean, running_var, num_batches_tracked, momentum, eps,
                   stats: bool = True):
    """torch's training batch norm of the grouped ``xg`` (``[N, B*C, *S]``), running statistics
    updated: ``(yg, mean [B, C], rstd [B, C])`` (with ``stats=False`` the last two are None)."""
    C = xg.shape[1] // B
    running, factor = (None, None), 0.0
    if running_mean is not None and momentum is not None:
        # Updated in place by torch's kernel, which takes them flat: running statistics
        # with other strides (a [C, B] buffer transposed) through contiguous copies,
        # written back below.
        running, factor = (_flat_running(running_mean), _flat_running(running_var)), momentum
    elif running_mean is not None:
        # Per-model factors: torch writes the batch mean and unbiased variance
        # (momentum 1 into zeros), blended per model below.
        stat_dtype = _PARAM_DTYPE[xg.dtype]
        running, factor = (xg.new_zeros(B * C, dtype=stat_dtype), xg.new_zeros(B * C, dtype=stat_dtype)), 1.0
    y, mean, rstd = torch.native_batch_norm(xg, *_grouped_params(xg, weight, bias), *running, True, factor, eps)
    if running_mean is not None and momentum is None:
        _update_running(running_mean, running_var, num_batches_tracked,
                        running[0].view(B, C), running[1].view(B, C), None)
    elif running_mean is not None:
        for buf, flat in ((running_mean, running[0]), (running_var, running[1])):
            if not buf.is_contiguous():
                buf.copy_(flat.view(B, C))
    if not stats:
        return y, None, None
    return y, mean.view(B, C), rstd.view(B, C)


def _flat_running(t: Tensor) -> Tensor:
    """The ``[B, C]`` running statistic ``t`` flat: a view of it where it is contiguous, else a
    contiguous copy (which :func:`_grouped_train` writes back)."""
    return t.view(-1) if t.is_contiguous() else t.contiguous().view(-1)


def grouped_serves(xg: Tensor, B: int, *per_channel: Tensor | None, activation: str = "none") -> bool:
    """Whether :func:`grouped_batch_norm` serves the array whose grouped form is ``xg``
    (``[N, B*C, *S]``) with these per-channel tensors: as :func:`array_batch_norm`'s eager
    path on the array's free grouped view, the torch backend outside ``torch.compile``,
    no activation or ReLU, no dim of size one, dtypes torch's kernel pairs."""
    return (_backend.eager_torch(_FWD, xg.device, xg.dtype) and activation in ("none", "relu")
            and xg.dim() >= 3 and min(*xg.shape, xg.shape[1] // B) > 1 and xg.dtype in _PARAM_DTYPE
            and _pairs(xg, per_channel))


def grouped_batch_norm(
    xg: Tensor, B: int, fmt: torch.memory_format, weight: Tensor | None, bias: Tensor | None,
    running_mean: Tensor | None, running_var: Tensor | None, num_batches_tracked: Tensor | None,
    momentum: float | None, eps: float, activation: str = "none", *, checked: bool = False, grouped: bool = False,
) -> Tensor:
    """Training batch norm of the array whose grouped form is ``xg`` (``[N, B*C, *S]``, e.g.
    :func:`hfkern.ops.conv.grouped_conv`'s result, ``fmt`` its array memory format) where
    :func:`grouped_serves`: the output array of :func:`array_batch_norm`'s eager path (a
    tensor of its own, :func:`hfkern._array.fresh_array`), the running statistics
    updated, the arguments checked as the op checks them (unless ``checked``: a call of
    the same metadata passed them before). ``grouped``: the output's grouped form
    ``[N, B*C, *S]`` in ``fmt``'s grouped memory instead, of which that array is a view."""
    if not checked:
        _check_forward(_ArrayMeta(xg, B), weight, bias, running_mean, running_var, num_batches_tracked, True,
                       momentum, activation)
    y, _, _ = _grouped_train(xg, B, weight, bias, running_mean, running_var, num_batches_tracked, momentum, eps,
                             stats=False)
    return activate_(grouped_in_format(y, fmt) if grouped else fresh_array(y, B, fmt), activation)


class _ArrayMeta:
    """The metadata the argument checks read of the array ``[B, N, C, *S]`` whose grouped
    form is ``xg``, without making a tensor (a meta tensor costs as much as the checks)."""

    def __init__(self, xg: Tensor, B: int):
        self.shape = torch.Size((B, xg.shape[0], xg.shape[1] // B, *xg.shape[2:]))
        self.dtype = xg.dtype
        self.device = xg.device

    def dim(self) -> int:
        return len(self.shape)

    def is_floating_point(self) -> bool:
        return self.dtype.is_floating_point


def _affine(centered: Tensor, x: Tensor, rstd: Tensor, weight: Tensor | None, bias: Tensor | None,
            out: Tensor | None = None) -> Tensor:
    """z = (x - mean) * (rstd * weight) + bias from ``centered = x - mean`` (accumulation
    dtype), into ``out`` when given: the forward's expression, which the backward repeats
    to recompute z for an activation's derivative."""
    acc = rstd.dtype
    scale = _channel_view(rstd if weight is None else rstd * weight.to(acc), x)
    if bias is None:
        return torch.mul(centered, scale, out=out)
    return torch.addcmul(_channel_view(bias.to(acc), x), centered, scale, out=out)


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
    activation: str = "none",
) -> tuple[Tensor, Tensor, Tensor]:
    B, C = x.shape[0], x.shape[2]
    acc = acc_dtype(x.dtype)
    fmt = _grouped_view(x, weight, bias, running_mean, running_var) if training else None
    if fmt is not None and values_per_channel(x) > 0:
        return _grouped_forward(x, weight, bias, running_mean, running_var, num_batches_tracked, momentum,
                                eps, activation, fmt)
    if training and values_per_channel(x) > 0 and _grouped_copy(x, weight, bias, running_mean, running_var):
        return _copied_forward(x, weight, bias, running_mean, running_var, num_batches_tracked, momentum, eps,
                               activation)
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
    centered = x.to(acc) - _channel_view(mean, x)
    # z rounded once into y, then the activation in place: what the separate
    # activation computes on the rounded norm output
    y = _affine(centered, x, rstd, weight, bias, out=torch.empty_like(x))
    return activate_(y, activation), mean, rstd


@_backend.implements(_BWD, "torch")
def array_batch_norm_backward_torch(
    grad_y: Tensor,
    x: Tensor,
    weight: Tensor | None,
    mean: Tensor,
    rstd: Tensor,
    training: bool,
    output_mask: Sequence[bool],
    bias: Tensor | None = None,
    activation: str = "none",
) -> tuple[Tensor, Tensor, Tensor]:
    """(grad_x, grad_weight, grad_bias); an output whose mask entry is False is ``[0]``."""
    acc = mean.dtype
    fmt = _grouped_view(x, weight, bias, mean, grad_y=grad_y) if training else None
    copied = fmt is None and training and _grouped_copy(x, weight, bias, mean, grad_y=grad_y)
    if fmt is not None or copied:
        B, N, C = x.shape[:3]
        if activation != "none":
            # g = grad_y * act'(z) in one pass, written in x's layout for the grouped view
            z = _affine(x - _channel_view(mean, x), x, rstd, weight, bias)
            grad_y = activation_grad(grad_y, z, activation, out=torch.empty_like(x))
        elif not copied and _grouped_format(grad_y) != fmt:  # (copied: both given one layout below)
            # e.g. the gradient of a max over points (PointNet), in [B, N, ...]
            # memory: one copy into x's layout costs less than the strided
            # reductions of the general path (several passes over x and grad_y).
            grad_y = torch.empty_like(x).copy_(grad_y)
        # CUDA's kernel reads the weight's device even when it is undefined ("tensor does not
        # have a device"): a weight of ones is the same math on every device.
        w = _flat(weight) if weight is not None else x.new_ones(B * C, dtype=_PARAM_DTYPE[x.dtype])
        gy_g, x_g = to_grouped(grad_y), to_grouped(x)
        if copied and gy_g.stride() != x_g.stride():
            # to_grouped is a view where one is possible (size-1 dims), and torch's CPU kernel reads
            # grad_y in x's layout when x's strides also pass for channels-last: the same strides.
            gy_g, x_g = (t.clone(memory_format=torch.contiguous_format) for t in (gy_g, x_g))
        gx, gw, gb = torch.ops.aten.native_batch_norm_backward(
            gy_g, x_g, w, None, None, _flat(mean), _flat(rstd), True, 0.0, list(output_mask),
        )
        if output_mask[0]:
            gx = torch.empty_like(x).copy_(from_grouped(gx, B)) if copied else _from_grouped_like(gx, x, fmt)
        # unrequested outputs: distinct empties, as custom-op outputs may not alias
        return (
            gx if output_mask[0] else x.new_empty(0),
            gw.view(B, C) if output_mask[1] else x.new_empty(0),
            # without a weight, grad_bias has x's dtype (the contract), not the ones' float32
            gb.view(B, C).to(x.dtype if weight is None else weight.dtype) if output_mask[2] else x.new_empty(0),
        )
    dims = _reduced_dims(x)
    n = values_per_channel(x)
    rstd_v = _channel_view(rstd, x)
    centered = x.to(acc) - _channel_view(mean, x)
    gy = grad_y.to(acc)
    if activation != "none":
        gy = activation_grad(gy, _affine(centered, x, rstd, weight, bias), activation)
    xhat = centered.mul_(rstd_v)
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
    bias: Tensor | None = None,
    activation: str = "none",
) -> list[Tensor | None]:
    """The math of :func:`array_batch_norm_backward_torch` in differentiable ops,
    with mean and rstd as functions of x in training: (grad_x, grad_weight,
    grad_bias), None where the mask entry is False. What the double-backward
    formula differentiates; slower than the backward op, which it matches.
    With an activation, ``act'(z)`` is a function of x, weight and bias too."""
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
    if activation != "none":
        z = xhat if weight is None else xhat * _channel_view(weight.to(acc), x)
        z = z if bias is None else z + _channel_view(bias.to(acc), x)
        gy = activation_grad(gy, z, activation)
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
    device = x.device
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
        if t.device != device:
            _raise_device(op, name, t, device)


def _raise_device(op: str, name: str, t: Tensor, device: torch.device) -> None:
    raise ValueError(f"hfkern::{op}: expected {name} on x's device ({device}), got {name} on {t.device}")


def _check_in_place(op: str, **tensors: Tensor | None) -> None:
    """The tensors the op writes in place have no element stored twice (an expanded tensor,
    a stride-0 dim of size > 1, is never contiguous: callers ask where one is not)."""
    for name, t in tensors.items():
        if t is not None and not t.is_contiguous() and any(
                st == 0 and n > 1 for n, st in zip(t.shape, t.stride())):
            raise ValueError(
                f"hfkern::{op}: expected {name} in dense memory (updated in place: no element stored "
                f"twice), got shape {_shape(t)} with strides {list(t.stride())} (an expanded tensor)"
            )


def _check_forward(
    x: Tensor, weight, bias, running_mean, running_var, num_batches_tracked, training, momentum, activation
) -> None:
    check_activation(f"hfkern::{_FWD}", activation)
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
        if num_batches_tracked.device != x.device:
            _raise_device(_FWD, "num_batches_tracked", num_batches_tracked, x.device)
    elif training and momentum is None and running_mean is not None:
        raise ValueError(
            f"hfkern::{_FWD}: momentum=None (cumulative average) updates the running statistics "
            "by 1 / num_batches_tracked: expected num_batches_tracked of shape "
            f"[{x.shape[0]}], got None"
        )
    if training and running_mean is not None and not (running_mean.is_contiguous() and running_var.is_contiguous()):
        _check_in_place(_FWD, running_mean=running_mean, running_var=running_var)


def _check_backward(grad_y: Tensor, x: Tensor, weight, mean, rstd, output_mask, bias, activation) -> None:
    check_activation(f"hfkern::{_BWD}", activation)
    _check_x(_BWD, x)
    if _shape(grad_y) != _shape(x):
        raise ValueError(
            f"hfkern::{_BWD}: expected grad_y of x's shape {_shape(x)}, got {_shape(grad_y)}"
        )
    if grad_y.device != x.device:
        _raise_device(_BWD, "grad_y", grad_y, x.device)
    _check_per_channel(_BWD, x, weight=weight, mean=mean, rstd=rstd, bias=bias)
    check_mask(_BWD, output_mask, 3, weight)


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
    activation: str = "none",
) -> tuple[Tensor, Tensor, Tensor]:
    """The registered op (not differentiable: see the module docstring)."""
    _check_forward(x, weight, bias, running_mean, running_var, num_batches_tracked, training, momentum,
                   activation)
    fn = _backend.resolve(_FWD, x.device, x.dtype)
    return fn(x, weight, bias, running_mean, running_var, num_batches_tracked, training, momentum, eps,
              activation)


@array_batch_norm_op.register_fake
def _(x, weight, bias, running_mean, running_var, num_batches_tracked, training, momentum, eps,
      activation="none"):
    _check_forward(x, weight, bias, running_mean, running_var, num_batches_tracked, training, momentum,
                   activation)
    stats = (x.shape[0], x.shape[2])
    acc = acc_dtype(x.dtype)
    # empty_like(x) as eager torch lays it out (a fake's own differs on dims of size one)
    return eager_empty_like(x), x.new_empty(stats, dtype=acc), x.new_empty(stats, dtype=acc)


@torch.library.custom_op("hfkern::array_batch_norm_backward", mutates_args=())
def array_batch_norm_backward(
    grad_y: Tensor,
    x: Tensor,
    weight: Tensor | None,
    mean: Tensor,
    rstd: Tensor,
    training: bool,
    output_mask: list[bool],
    bias: Tensor | None = None,
    activation: str = "none",
) -> tuple[Tensor, Tensor, Tensor]:
    _check_backward(grad_y, x, weight, mean, rstd, output_mask, bias, activation)
    fn = _backend.resolve(_BWD, grad_y.device, x.dtype)
    return fn(grad_y, x, weight, mean, rstd, training, output_mask, bias, activation)


@array_batch_norm_backward.register_fake
def _(grad_y, x, weight, mean, rstd, training, output_mask, bias=None, activation="none"):
    _check_backward(grad_y, x, weight, mean, rstd, output_mask, bias, activation)
    grad_x, grad_weight, grad_bias = backward_outputs(x, weight, output_mask, (x.shape[0], x.shape[2]))
    # grad_x: empty_like(x) as eager torch lays it out (a fake's own differs on dims of size one)
    return eager_empty_like(x) if output_mask[0] else grad_x, grad_weight, grad_bias


class _ArrayBatchNorm(torch.autograd.Function):
    """Autograd around the mutating forward op (which cannot carry a torch.library formula).

    ``eager`` (:func:`hfkern._backend.eager_torch`): the registered torch
    implementations are called directly, forward and backward, rather than through
    the dispatcher: the same functions on the same arguments, so the same results,
    for less host time.
    A backward that builds a graph (``create_graph=True``) dispatches the backward
    op, whose formula gives the double backward.
    """

    # forward(ctx, ...), not forward + setup_context: autograd binds the arguments of a
    # setup_context Function to forward's signature (inspect.signature) at every call.
    @staticmethod
    def forward(ctx, x, weight, bias, running_mean, running_var, num_batches_tracked, training, momentum, eps,
                activation, eager):
        args = (x, weight, bias, running_mean, running_var, num_batches_tracked, training, momentum, eps,
                activation)
        if eager:
            _check_forward(x, weight, bias, running_mean, running_var, num_batches_tracked, training, momentum,
                           activation)
            output = _backend.resolve(_FWD, x.device, x.dtype)(*args)
        else:
            output = array_batch_norm_op(*args)
        _, mean, rstd = output
        save_forward(ctx, x, weight, bias, mean, rstd, activation)
        ctx.training, ctx.eager = training, eager
        # No gradient flows into mean and rstd: autograd would otherwise hand the
        # backward two [B, C] zero tensors it allocates and fills every step.
        ctx.set_materialize_grads(False)
        # The backward runs pinned to the forward's backend, whatever thread runs
        # it; a compiled graph resolves its ops when it runs instead.
        ctx.backend = None if torch.compiler.is_compiling() else (
            "torch" if eager else _backend.current(_FWD, x.device, x.dtype))
        return output

    @staticmethod
    def backward(ctx, grad_y, grad_mean, grad_rstd):
        x, weight, mean, rstd, bias = ctx.saved_tensors
        mask = grad_mask(ctx, weight)
        none = (None,) * 7
        if not any(mask) or grad_y is None:
            return (None, None, None, None) + none
        args = (grad_y, x, weight, mean, rstd, ctx.training, mask, bias, ctx.activation)
        if ctx.eager and not torch.is_grad_enabled():
            with _backend.pinned(ctx.backend):
                fn = _backend.resolve(_BWD, grad_y.device, x.dtype)
            gx, gw, gb = fn(*args)
        elif ctx.backend is None:
            gx, gw, gb = array_batch_norm_backward(*args)
        else:
            with _backend.pinned(ctx.backend):
                gx, gw, gb = array_batch_norm_backward(*args)
        return input_grads(ctx, mask, gx, gw, gb) + none + (None,)


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
    activation: str = "none",
) -> tuple[Tensor, Tensor, Tensor]:
    """Batch norm of B models, differentiable: ``hfkern::array_batch_norm`` with autograd.

    x ``[B, N, C, *S]`` (0 to 3 spatial dims, any strides); weight, bias,
    running_mean, running_var ``[B, C]`` or None; num_batches_tracked ``[B]``
    or None; ``activation`` one of ``"none"``, ``"relu"``, ``"gelu"`` (exact),
    applied to the batch-norm output in the same op. Returns ``(y, mean,
    rstd)``: y ``[B, N, C, *S]`` in x's dtype and memory order, mean and rstd
    ``[B, C]`` (accumulation dtype, not differentiable). In training the
    running statistics are updated in place. The full contract is the module
    docstring.

    Where the torch backend serves a training call in eager mode
    (:func:`hfkern._backend.eager_torch`), without an activation or with ReLU,
    torch's batch norm on the grouped view runs under torch's own autograd (the
    same kernels as the op's torch path, with C++ backward nodes): on the view
    itself where it is free, on a copy of it elsewhere (the output copied back
    into x's layout); in the other eager cases on the torch backend, the
    autograd Function calls the torch implementations without the dispatcher;
    otherwise the op with its autograd Function.
    """
    eager = _backend.eager_torch(_FWD, x.device, x.dtype)
    if eager and training and activation in ("none", "relu") and min(x.shape[1:]) > 1:
        # (a dim of one but B: y may take x's strides through as_strided, which the op's gradient keeps)
        fmt = _grouped_view(x, weight, bias, running_mean, running_var)
        if fmt is not None or _grouped_copy(x, weight, bias, running_mean, running_var):
            _check_forward(x, weight, bias, running_mean, running_var, num_batches_tracked, training, momentum,
                           activation)
            if fmt is None:
                return _copied_forward(x, weight, bias, running_mean, running_var, num_batches_tracked, momentum,
                                       eps, activation)
            return _grouped_forward(x, weight, bias, running_mean, running_var, num_batches_tracked, momentum,
                                    eps, activation, fmt, op=False)
    # The autograd Function has no forward-mode formula: refused before the running statistics change.
    refuse_forward_ad(_FWD, x, weight, bias)
    return _ArrayBatchNorm.apply(
        x, weight, bias, running_mean, running_var, num_batches_tracked, training, momentum, eps, activation, eager
    )


# ---- double backward --------------------------------------------------------
#
# As for the layer-norm backward ops: the vector-Jacobian product of the
# reference math, with torch.func.vjp so that grad_y and weight are treated as
# the independent inputs of the op they are (a gradient penalty's grad_y
# depends on x in the caller's graph) and the result stays differentiable.

# The backward op's differentiable inputs, by position: grad_y, x, weight, and
# bias (argument 7, through the activation).
_BWD_BIAS = 7


def _backward_setup_context(ctx, inputs, output):
    grad_y, x, weight, mean, rstd, training, output_mask, bias, activation = inputs
    ctx.save_for_backward(grad_y, x, weight, mean, rstd, bias)
    ctx.training = training
    ctx.output_mask = list(output_mask)
    ctx.activation = activation


def _backward_backward(ctx, grad_grad_x, grad_grad_w, grad_grad_b):
    grad_y, x, weight, mean, rstd, bias = ctx.saved_tensors

    def math(args):
        return batch_norm_backward_math(args[0], args[1], args[2], mean, rstd, ctx.training, ctx.output_mask,
                                        args[_BWD_BIAS], ctx.activation)

    return backward_of_backward(ctx.needs_input_grad, {0: grad_y, 1: x, 2: weight, _BWD_BIAS: bias},
                                ctx.output_mask, (grad_grad_x, grad_grad_w, grad_grad_b), math)


array_batch_norm_backward.register_autograd(_backward_backward, setup_context=_backward_setup_context)
