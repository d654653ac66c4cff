"""hfkern::array_layer_norm and hfkern::array_rms_norm: B models' norms as one op each.

Ops (all registered with torch.library, implementations chosen by the registry):

``array_layer_norm(x, weight, bias, norm_ndim, eps) -> (y, mean, rstd)``
    x ``[B, *, *S]`` with any strides (``S`` = the trailing ``norm_ndim`` dims,
    normalized_shape), weight and bias ``[B, *S]`` or None. ``y`` has x's dtype
    and the layout of ``torch.empty_like(x)`` (x's strides when x is dense and
    non-overlapping, so an ``[N, B, ...]``-memory conv output stays that way).
    ``mean`` and ``rstd`` are contiguous ``[B, M]`` (``M`` = product of ``*``) in
    the accumulation dtype: float32, or float64 for float64 x. They are not
    differentiable.
``array_layer_norm_backward(grad_y, x, weight, mean, rstd, norm_ndim, output_mask)``
    ``-> (grad_x, grad_weight, grad_bias)``.
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

Double backward: the backward ops are differentiable too (gradient penalties,
MAML). Their formula differentiates the reference math
(:func:`layer_norm_torch.norm_backward_math`) with autograd, on every backend:
a Triton backward's own gradients run as torch ops. As for
``aten::native_layer_norm_backward``, ``mean`` and ``rstd`` must be the
statistics the forward returned for ``x``; the formula differentiates them as
functions of ``x`` (so the gradient with respect to ``x`` is the total one)
and gives them no gradient of their own. The first backward is never slowed:
the formula only runs when a backward is itself differentiated
(``create_graph=True``).
"""

from __future__ import annotations

from typing import Sequence

import torch
from torch import Tensor

from .. import _backend
from . import layer_norm_torch

__all__ = [
    "array_layer_norm", "array_layer_norm_backward", "array_rms_norm", "array_rms_norm_backward",
]

_LN_FWD, _LN_BWD = "array_layer_norm", "array_layer_norm_backward"
_RMS_FWD, _RMS_BWD = "array_rms_norm", "array_rms_norm_backward"


def _check(op: str, x: Tensor, weight: Tensor | None, bias: Tensor | None, norm_ndim: int) -> None:
    if norm_ndim < 1 or x.dim() < norm_ndim + 1:
        raise ValueError(
            f"hfkern::{op}: expected x of shape [B, *, *normalized_shape] with norm_ndim >= 1 "
            f"trailing dims normalized, got norm_ndim={norm_ndim} and x of shape {list(x.shape)}"
        )
    expected = [x.shape[0], *x.shape[x.dim() - norm_ndim:]]
    for name, p in (("weight", weight), ("bias", bias)):
        if p is not None and list(p.shape) != expected:
            raise ValueError(
                f"hfkern::{op}: expected {name} of shape {expected} ([B, *normalized_shape]), "
                f"got {list(p.shape)}"
            )


def _check_mask(op: str, output_mask: Sequence[bool], n: int, weight: Tensor | None) -> None:
    if len(output_mask) != n:
        raise ValueError(f"hfkern::{op}: expected output_mask of length {n}, got {list(output_mask)}")
    if output_mask[1] and weight is None:
        raise ValueError(f"hfkern::{op}: output_mask asks for grad_weight but weight is None")


def _fake_stats(x: Tensor, norm_ndim: int) -> Tensor:
    return x.new_empty(
        (x.shape[0], layer_norm_torch.num_rows(x, norm_ndim)),
        dtype=layer_norm_torch.acc_dtype(x.dtype),
    )


def _fake_param_grad(x: Tensor, weight: Tensor | None, norm_ndim: int, wanted: bool) -> Tensor:
    if not wanted:
        return x.new_empty(0)
    dtype = x.dtype if weight is None else weight.dtype
    return x.new_empty((x.shape[0], *x.shape[x.dim() - norm_ndim:]), dtype=dtype)


def _fake_input_grad(x: Tensor, wanted: bool) -> Tensor:
    return torch.empty_like(x) if wanted else x.new_empty(0)


# ---- layer norm -----------------------------------------------------------

@torch.library.custom_op("hfkern::array_layer_norm", mutates_args=())
def array_layer_norm(
    x: Tensor, weight: Tensor | None, bias: Tensor | None, norm_ndim: int, eps: float
) -> tuple[Tensor, Tensor, Tensor]:
    _check(_LN_FWD, x, weight, bias, norm_ndim)
    fn = _backend.resolve(_LN_FWD, x.device, x.dtype)
    return fn(x, weight, bias, norm_ndim, eps)


@array_layer_norm.register_fake
def _(x, weight, bias, norm_ndim, eps):
    _check(_LN_FWD, x, weight, bias, norm_ndim)
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
) -> tuple[Tensor, Tensor, Tensor]:
    _check(_LN_BWD, x, weight, None, norm_ndim)
    _check_mask(_LN_BWD, output_mask, 3, weight)
    fn = _backend.resolve(_LN_BWD, grad_y.device, x.dtype)
    return fn(grad_y, x, weight, mean, rstd, norm_ndim, output_mask)


@array_layer_norm_backward.register_fake
def _(grad_y, x, weight, mean, rstd, norm_ndim, output_mask):
    _check(_LN_BWD, x, weight, None, norm_ndim)
    _check_mask(_LN_BWD, output_mask, 3, weight)
    return (
        _fake_input_grad(x, output_mask[0]),
        _fake_param_grad(x, weight, norm_ndim, output_mask[1]),
        _fake_param_grad(x, weight, norm_ndim, output_mask[2]),
    )


def _ln_setup_context(ctx, inputs, output):
    x, weight, bias, norm_ndim, eps = inputs
    _, mean, rstd = output
    ctx.save_for_backward(x, weight, mean, rstd)
    ctx.norm_ndim = norm_ndim
    ctx.bias_dtype = None if bias is None else bias.dtype
    ctx.mark_non_differentiable(mean, rstd)
    # The backward runs pinned to the forward's backend, whatever thread runs it.
    ctx.backend = _backend.current(_LN_FWD, x.device, x.dtype)


def _ln_backward(ctx, grad_y, grad_mean, grad_rstd):
    x, weight, mean, rstd = ctx.saved_tensors
    needs = ctx.needs_input_grad
    mask = [needs[0], weight is not None and needs[1], ctx.bias_dtype is not None and needs[2]]
    if not any(mask):
        return None, None, None, None, None
    with _backend.pinned(ctx.backend):
        gx, gw, gb = array_layer_norm_backward(grad_y, x, weight, mean, rstd, ctx.norm_ndim, mask)
    return (
        gx if mask[0] else None,
        gw if mask[1] else None,
        gb.to(ctx.bias_dtype) if mask[2] else None,
        None,
        None,
    )


array_layer_norm.register_autograd(_ln_backward, setup_context=_ln_setup_context)


# ---- double backward --------------------------------------------------------
#
# The backward ops' gradients are derived, not written out: each formula takes
# the vector-Jacobian product of the reference math of the backward
# (layer_norm_torch.norm_backward_math, differentiable aten ops). Written out,
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

def _norm_backward_setup_context(ctx, inputs, output):
    grad_y, x, weight, *stats, norm_ndim, output_mask = inputs
    ctx.save_for_backward(grad_y, x, weight, *stats)
    ctx.norm_ndim = norm_ndim
    ctx.output_mask = list(output_mask)


def _norm_backward_backward(ctx, *grad_outputs):
    grad_y, x, weight, *stats = ctx.saved_tensors
    mean, rstd = stats if len(stats) == 2 else (None, stats[0])
    needs = ctx.needs_input_grad
    wanted = [i for i, t in enumerate((grad_y, x, weight)) if needs[i] and t is not None]
    mask = ctx.output_mask
    primals = [(grad_y, x, weight)[i] for i in wanted]

    def math(*differentiated):
        args = [grad_y, x, weight]
        for i, t in zip(wanted, differentiated):
            args[i] = t
        outs = layer_norm_torch.norm_backward_math(*args, mean, rstd, ctx.norm_ndim, mask)
        return tuple(o for o in outs if o is not None)

    result: list[Tensor | None] = [None] * len(needs)
    if not wanted:
        return tuple(result)
    if any(mask):
        _, vjp = torch.func.vjp(math, *primals)
        grads = vjp(tuple(g for g, m in zip(grad_outputs, mask) if m))
    else:  # nothing was computed: zero gradients (what AOTAutograd derives, too)
        grads = [torch.zeros_like(t) for t in primals]
    for i, g in zip(wanted, grads):
        result[i] = g
    return tuple(result)


array_layer_norm_backward.register_autograd(
    _norm_backward_backward, setup_context=_norm_backward_setup_context
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
    _check(_RMS_BWD, x, weight, None, norm_ndim)
    _check_mask(_RMS_BWD, output_mask, 2, weight)
    fn = _backend.resolve(_RMS_BWD, grad_y.device, x.dtype)
    return fn(grad_y, x, weight, rstd, norm_ndim, output_mask)


@array_rms_norm_backward.register_fake
def _(grad_y, x, weight, rstd, norm_ndim, output_mask):
    _check(_RMS_BWD, x, weight, None, norm_ndim)
    _check_mask(_RMS_BWD, output_mask, 2, weight)
    return (
        _fake_input_grad(x, output_mask[0]),
        _fake_param_grad(x, weight, norm_ndim, output_mask[1]),
    )


def _rms_setup_context(ctx, inputs, output):
    x, weight, norm_ndim, eps = inputs
    _, rstd = output
    ctx.save_for_backward(x, weight, rstd)
    ctx.norm_ndim = norm_ndim
    ctx.mark_non_differentiable(rstd)
    ctx.backend = _backend.current(_RMS_FWD, x.device, x.dtype)


def _rms_backward(ctx, grad_y, grad_rstd):
    x, weight, rstd = ctx.saved_tensors
    needs = ctx.needs_input_grad
    mask = [needs[0], weight is not None and needs[1]]
    if not any(mask):
        return None, None, None, None
    with _backend.pinned(ctx.backend):
        gx, gw = array_rms_norm_backward(grad_y, x, weight, rstd, ctx.norm_ndim, mask)
    return gx if mask[0] else None, gw if mask[1] else None, None, None


array_rms_norm.register_autograd(_rms_backward, setup_context=_rms_setup_context)
array_rms_norm_backward.register_autograd(
    _norm_backward_backward, setup_context=_norm_backward_setup_context
)

_backend.register(_LN_FWD, "torch", layer_norm_torch.array_layer_norm)
_backend.register(_LN_BWD, "torch", layer_norm_torch.array_layer_norm_backward)
_backend.register(_RMS_FWD, "torch", layer_norm_torch.array_rms_norm)
_backend.register(_RMS_BWD, "torch", layer_norm_torch.array_rms_norm_backward)


# The Triton implementations are torch.library triton ops defined in
# hfkern/ops/layer_norm_triton.py, imported on first use (defining a triton op
# imports triton and parts of inductor, which plain "import hfkern" should not
# pay for). auto picks a Triton kernel only where a committed GPU benchmark shows
# it faster: layer norm forward and backward are, on an H100, 4-11x in kernel time
# and 1.8-3.8x eager (geomean per dtype; bench/results/h100_2026-11-22/). RMS norm
# has not been benchmarked yet, so auto leaves it on the torch path. The kernels
# serve float32, float16 and bfloat16; auto gives float64 to the torch path.
_AUTO = {_LN_FWD: True, _LN_BWD: True, _RMS_FWD: False, _RMS_BWD: False}
for _op, _auto in _AUTO.items():
    _backend.register(_op, "triton", f"hfkern.ops.layer_norm_triton:{_op}_triton",
                      device_types=("cuda",), auto=_auto,
                      dtypes=(torch.float32, torch.float16, torch.bfloat16))
