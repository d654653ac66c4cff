"""hfkern::array_conv: B convolutions (1-D/2-D/3-D, plain or transposed) as one op.

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

Padding is symmetric per spatial dim; modules apply asymmetric or non-zero
padding with ``F.pad`` first, as torch does. The bias gradient is a plain
reduction done in the autograd formula.
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
    fn = _backend.resolve(_FWD, x.device)
    return fn(x, weight, bias, stride, padding, dilation, transposed, output_padding, groups)


@array_conv.register_fake
def _(x, weight, bias, stride, padding, dilation, transposed, output_padding, groups):
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
    fn = _backend.resolve(_DGRAD, grad_out.device)
    return fn(grad_out, weight, input_size, stride, padding, dilation, transposed, output_padding, groups)


@array_conv_input_grad.register_fake
def _(grad_out, weight, input_size, stride, padding, dilation, transposed, output_padding, groups):
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
    fn = _backend.resolve(_WGRAD, grad_out.device)
    return fn(grad_out, x, weight, stride, padding, dilation, transposed, output_padding, groups)


@array_conv_weight_grad.register_fake
def _(grad_out, x, weight, stride, padding, dilation, transposed, output_padding, groups):
    return torch.empty_like(weight, memory_format=torch.contiguous_format)


def _setup_context(ctx, inputs, output):
    x, weight, bias, stride, padding, dilation, transposed, output_padding, groups = inputs
    ctx.save_for_backward(x, weight)
    ctx.has_bias = bias is not None
    ctx.input_size = list(x.shape)
    ctx.conv_args = (stride, padding, dilation, transposed, output_padding, groups)


def _backward(ctx, grad_out):
    x, weight = ctx.saved_tensors
    grad_x = grad_w = grad_b = None
    if ctx.needs_input_grad[0]:
        grad_x = array_conv_input_grad(grad_out, weight, ctx.input_size, *ctx.conv_args)
    if ctx.needs_input_grad[1]:
        grad_w = array_conv_weight_grad(grad_out, x, weight, *ctx.conv_args)
    if ctx.has_bias and ctx.needs_input_grad[2]:
        grad_b = grad_out.sum(dim=[1] + list(range(3, grad_out.dim())))
    return grad_x, grad_w, grad_b, None, None, None, None, None, None


array_conv.register_autograd(_backward, setup_context=_setup_context)

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
