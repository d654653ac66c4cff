"""hfkern::array_conv: B convolutions (1-D or 2-D, plain or transposed) as one op.

Ops (all registered with torch.library, implementations chosen by the registry):

``array_conv(x, weight, bias, stride, padding, dilation, transposed, output_padding, groups)``
    x ``[B, N, C_in, *s]`` (or ``[N, C_in, *s]`` for an input shared by all B
    models), weight ``[B, C_out, C_in/groups, *k]`` (transposed:
    ``[B, C_in, C_out/groups, *k]``), bias ``[B, C_out]`` or None.
    Returns ``[B, N, C_out, *s']``, stored as ``[N, B, C_out, *s']`` memory.
``array_conv_input_grad(grad_out, weight, input_size, ...)``
    The input gradient (for a shared input: summed over the models).
``array_conv_weight_grad(grad_out, x, weight, ...)``
    The weight gradient, shaped like ``weight``.

``*s`` and ``*k`` are one or two spatial dims, and ``stride``, ``padding``,
``dilation`` and ``output_padding`` have one entry per spatial dim. 3-D
convolution is not implemented: every op raises ``NotImplementedError`` for it
(and ``ValueError`` for arguments of inconsistent dimensionality) before any
backend runs. Padding is symmetric per spatial dim; modules apply asymmetric or
non-zero padding with ``F.pad`` first, as torch does. The bias gradient is a
plain reduction done in the autograd formula.

Every op is differentiable to any order (double backward for gradient
penalties, MAML): the two gradient ops are linear in each argument, and
their own gradients are array convs and gradient ops again, on the backend
the differentiated op ran.
"""

from __future__ import annotations

from typing import Sequence

import torch
from torch import Tensor

from .. import _backend
from . import conv_torch

_FWD, _DGRAD, _WGRAD = "array_conv", "array_conv_input_grad", "array_conv_weight_grad"


def conv_output_size(
    size: Sequence[int], weight: Tensor, stride, padding, dilation, transposed, output_padding
) -> list[int]:
    k = weight.shape[-len(stride):]
    if transposed:
        return [
            (i - 1) * s - 2 * p + d * (kk - 1) + op + 1
            for i, kk, s, p, d, op in zip(size, k, stride, padding, dilation, output_padding)
        ]
    return [
        (i + 2 * p - d * (kk - 1) - 1) // s + 1
        for i, kk, s, p, d in zip(size, k, stride, padding, dilation)
    ]


_SUPPORTED_ND = (1, 2)


def check_conv_args(
    op: str, activation_dims: int, weight: Tensor, stride, padding, dilation, output_padding,
    groups: int, *, grad_out: Tensor | None = None,
) -> None:
    """Raise unless the arguments describe a 1-D or 2-D array convolution.

    ``activation_dims`` is the number of dims of the conv's input (``[B, N, C, *s]``
    or a shared ``[N, C, *s]``). Metadata only: no device value is read.
    """
    nd = len(stride)
    kernel_nd = weight.dim() - 3
    if nd not in _SUPPORTED_ND or kernel_nd not in _SUPPORTED_ND:
        # A 3-D conv is a well-formed request this library does not implement;
        # any other count of spatial dims is malformed.
        unsupported = 3 in (nd, kernel_nd)
        raise (NotImplementedError if unsupported else ValueError)(
            f"hfkern::{op}: supports 1-D and 2-D convolutions only (stride, padding, dilation "
            f"and output_padding of length 1 or 2, weight [B, C_out, C_in/groups, *k] of 4 or "
            f"5 dims), got {'a 3-D convolution: ' if unsupported else ''}stride {list(stride)} "
            f"and weight of shape {list(weight.shape)}"
        )
    if kernel_nd != nd:
        raise ValueError(
            f"hfkern::{op}: expected weight of {nd + 3} dims ([B, C_out, C_in/groups, *k] with "
            f"{nd} kernel dims, as stride {list(stride)}), got {list(weight.shape)}"
        )
    for name, value in (("padding", padding), ("dilation", dilation), ("output_padding", output_padding)):
        if len(value) != nd:
            raise ValueError(
                f"hfkern::{op}: expected {name} of length {nd} (one per spatial dim, as stride "
                f"{list(stride)}), got {list(value)}"
            )
    if activation_dims not in (nd + 2, nd + 3):
        raise ValueError(
            f"hfkern::{op}: expected an input of {nd + 3} dims [B, N, C_in, *s] (or {nd + 2} dims "
            f"[N, C_in, *s], shared) for a {nd}-D convolution, got {activation_dims} dims"
        )
    if grad_out is not None and grad_out.dim() != nd + 3:
        raise ValueError(
            f"hfkern::{op}: expected grad_out of {nd + 3} dims [B, N, C_out, *s'] for a {nd}-D "
            f"convolution, got shape {list(grad_out.shape)}"
        )
    if groups < 1:
        raise ValueError(f"hfkern::{op}: expected groups >= 1, got {groups}")


def _empty_array_layout(B: int, N: int, C: int, spatial: Sequence[int], like: Tensor) -> Tensor:
    return like.new_empty((N, B, C, *spatial)).transpose(0, 1)


@torch.library.custom_op("hfkern::array_conv", mutates_args=())
def array_conv(
    x: Tensor,
    weight: Tensor,
    bias: Tensor | None,
    stride: list[int],
    padding: list[int],
    dilation: list[int],
    transposed: bool,
    output_padding: list[int],
    groups: int,
) -> Tensor:
    check_conv_args(_FWD, x.dim(), weight, stride, padding, dilation, output_padding, groups)
    fn = _backend.resolve(_FWD, x.device)
    return fn(x, weight, bias, stride, padding, dilation, transposed, output_padding, groups)


@array_conv.register_fake
def _(x, weight, bias, stride, padding, dilation, transposed, output_padding, groups):
    check_conv_args(_FWD, x.dim(), weight, stride, padding, dilation, output_padding, groups)
    nd = len(stride)
    out = conv_output_size(x.shape[-nd:], weight, stride, padding, dilation, transposed, output_padding)
    N = x.shape[-nd - 2]
    return _empty_array_layout(
        weight.shape[0], N, conv_torch.out_channels(weight, transposed, groups), out, x
    )


@torch.library.custom_op("hfkern::array_conv_input_grad", mutates_args=())
def array_conv_input_grad(
    grad_out: Tensor,
    weight: Tensor,
    input_size: list[int],
    stride: list[int],
    padding: list[int],
    dilation: list[int],
    transposed: bool,
    output_padding: list[int],
    groups: int,
) -> Tensor:
    check_conv_args(_DGRAD, len(input_size), weight, stride, padding, dilation, output_padding,
                    groups, grad_out=grad_out)
    fn = _backend.resolve(_DGRAD, grad_out.device)
    return fn(grad_out, weight, input_size, stride, padding, dilation, transposed, output_padding, groups)


@array_conv_input_grad.register_fake
def _(grad_out, weight, input_size, stride, padding, dilation, transposed, output_padding, groups):
    check_conv_args(_DGRAD, len(input_size), weight, stride, padding, dilation, output_padding,
                    groups, grad_out=grad_out)
    if len(input_size) == weight.dim() - 1:  # shared input
        return grad_out.new_empty(input_size)
    B, N, C = input_size[:3]
    return _empty_array_layout(B, N, C, input_size[3:], grad_out)


@torch.library.custom_op("hfkern::array_conv_weight_grad", mutates_args=())
def array_conv_weight_grad(
    grad_out: Tensor,
    x: Tensor,
    weight: Tensor,
    stride: list[int],
    padding: list[int],
    dilation: list[int],
    transposed: bool,
    output_padding: list[int],
    groups: int,
) -> Tensor:
    check_conv_args(_WGRAD, x.dim(), weight, stride, padding, dilation, output_padding, groups,
                    grad_out=grad_out)
    fn = _backend.resolve(_WGRAD, grad_out.device)
    return fn(grad_out, x, weight, stride, padding, dilation, transposed, output_padding, groups)


@array_conv_weight_grad.register_fake
def _(grad_out, x, weight, stride, padding, dilation, transposed, output_padding, groups):
    check_conv_args(_WGRAD, x.dim(), weight, stride, padding, dilation, output_padding, groups,
                    grad_out=grad_out)
    return torch.empty_like(weight, memory_format=torch.contiguous_format)


# Every formula runs its ops pinned to the backend that served the op it
# differentiates (recorded in setup_context): a backward run on another thread,
# or after the use_backend block of its forward, still runs that backend.

def _setup_context(ctx, inputs, output):
    x, weight, bias, stride, padding, dilation, transposed, output_padding, groups = inputs
    ctx.save_for_backward(x, weight)
    ctx.has_bias = bias is not None
    ctx.input_size = list(x.shape)
    ctx.conv_args = (stride, padding, dilation, transposed, output_padding, groups)
    ctx.backend = _backend.current(_FWD, x.device)


def _backward(ctx, grad_out):
    x, weight = ctx.saved_tensors
    grad_x = grad_w = grad_b = None
    with _backend.pinned(ctx.backend):
        if ctx.needs_input_grad[0]:
            grad_x = array_conv_input_grad(grad_out, weight, ctx.input_size, *ctx.conv_args)
        if ctx.needs_input_grad[1]:
            grad_w = array_conv_weight_grad(grad_out, x, weight, *ctx.conv_args)
    if ctx.has_bias and ctx.needs_input_grad[2]:
        grad_b = grad_out.sum(dim=[1] + list(range(3, grad_out.dim())))
    return grad_x, grad_w, grad_b, None, None, None, None, None, None


array_conv.register_autograd(_backward, setup_context=_setup_context)


# The gradient ops' own gradients are written out rather than derived by
# differentiating the reference math: both ops are bilinear, so each of their
# adjoints is one of the three conv ops. With y = conv(x, w),
# dx = input_grad(dy, w) and dw = weight_grad(dy, x), and for any ddx, ddw:
#   <ddx, input_grad(dy, w)> = <conv(ddx, w), dy> = <weight_grad(dy, ddx), w>
#   <ddw, weight_grad(dy, x)> = <conv(x, ddw), dy> = <input_grad(dy, ddw), x>
# (the same identities hold for a transposed conv and for a shared input, whose
# input gradient sums over the models). The adjoints run on the same backend
# at the same cost as a forward or backward, and they are ops with autograd
# formulas themselves, so every order of derivative is exact.

def _input_grad_setup_context(ctx, inputs, output):
    grad_out, weight, input_size, *conv_args = inputs
    ctx.save_for_backward(grad_out, weight)
    ctx.conv_args = tuple(conv_args)
    ctx.backend = _backend.current(_DGRAD, grad_out.device)


def _input_grad_backward(ctx, grad_grad_x):
    grad_out, weight = ctx.saved_tensors
    d_grad_out = d_weight = None
    with _backend.pinned(ctx.backend):
        if ctx.needs_input_grad[0]:
            d_grad_out = array_conv(grad_grad_x, weight, None, *ctx.conv_args)
        if ctx.needs_input_grad[1]:
            d_weight = array_conv_weight_grad(grad_out, grad_grad_x, weight, *ctx.conv_args)
    return d_grad_out, d_weight, None, None, None, None, None, None, None


array_conv_input_grad.register_autograd(_input_grad_backward, setup_context=_input_grad_setup_context)


def _weight_grad_setup_context(ctx, inputs, output):
    grad_out, x, weight, *conv_args = inputs
    ctx.save_for_backward(grad_out, x)
    ctx.input_size = list(x.shape)
    ctx.conv_args = tuple(conv_args)
    ctx.backend = _backend.current(_WGRAD, grad_out.device)


def _weight_grad_backward(ctx, grad_grad_w):
    grad_out, x = ctx.saved_tensors
    d_grad_out = d_x = None
    with _backend.pinned(ctx.backend):
        if ctx.needs_input_grad[0]:
            d_grad_out = array_conv(x, grad_grad_w, None, *ctx.conv_args)
        if ctx.needs_input_grad[1]:
            d_x = array_conv_input_grad(grad_out, grad_grad_w, ctx.input_size, *ctx.conv_args)
    # weight is read for its shape only: no gradient.
    return d_grad_out, d_x, None, None, None, None, None, None, None


array_conv_weight_grad.register_autograd(_weight_grad_backward, setup_context=_weight_grad_setup_context)

_backend.register(_FWD, "torch", conv_torch.array_conv)
_backend.register(_DGRAD, "torch", conv_torch.array_conv_input_grad)
_backend.register(_WGRAD, "torch", conv_torch.array_conv_weight_grad)


# The Triton implementations are torch.library triton ops defined in
# hfkern/ops/conv_triton.py, imported on first use (defining a triton op imports
# triton and parts of inductor, which plain "import hfkern" should not pay for).
# auto=False: auto picks them only once a GPU benchmark shows them faster.
for _op in (_FWD, _DGRAD, _WGRAD):
    _backend.register(_op, "triton", f"hfkern.ops.conv_triton:{_op}_triton",
                      device_types=("cuda",), auto=False)
