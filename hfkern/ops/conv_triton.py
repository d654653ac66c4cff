"""Triton implementations of the array conv ops, one ``torch.library.triton_op`` per kernel.

``hfkern::array_conv_triton``, ``hfkern::array_conv_input_grad_triton`` and
``hfkern::array_conv_weight_grad_triton`` take exactly the arguments of the
ops in :mod:`hfkern.ops.conv` and call the launchers in
:mod:`hfkern.triton.conv`. The backend registry imports this module the first
time the ``triton`` backend serves a conv op. Like the ops, they check the
arguments first (1-D and 2-D only), since they can be called directly.
The kernels are not differentiable themselves; the ops' autograd formulas
express every derivative through the three ops again.
"""

from __future__ import annotations

import torch
from torch import Tensor

from ..triton import conv as kernels
from .conv import check_conv_args


@torch.library.triton_op("hfkern::array_conv_triton", mutates_args=())
def array_conv_triton(
    x: Tensor, weight: Tensor, bias: Tensor | None, stride: list[int], padding: list[int],
    dilation: list[int], transposed: bool, output_padding: list[int], groups: int,
) -> Tensor:
    check_conv_args("array_conv_triton", x.dim(), weight, stride, padding, dilation,
                    output_padding, groups)
    return kernels.array_conv(
        x, weight, bias, stride, padding, dilation, transposed, output_padding, groups
    )


@torch.library.triton_op("hfkern::array_conv_input_grad_triton", mutates_args=())
def array_conv_input_grad_triton(
    grad_out: Tensor, weight: Tensor, input_size: list[int], stride: list[int], padding: list[int],
    dilation: list[int], transposed: bool, output_padding: list[int], groups: int,
) -> Tensor:
    check_conv_args("array_conv_input_grad_triton", len(input_size), weight, stride, padding,
                    dilation, output_padding, groups, grad_out=grad_out)
    return kernels.array_conv_input_grad(
        grad_out, weight, input_size, stride, padding, dilation, transposed, output_padding, groups
    )


@torch.library.triton_op("hfkern::array_conv_weight_grad_triton", mutates_args=())
def array_conv_weight_grad_triton(
    grad_out: Tensor, x: Tensor, weight: Tensor, stride: list[int], padding: list[int],
    dilation: list[int], transposed: bool, output_padding: list[int], groups: int,
) -> Tensor:
    check_conv_args("array_conv_weight_grad_triton", x.dim(), weight, stride, padding, dilation,
                    output_padding, groups, grad_out=grad_out)
    return kernels.array_conv_weight_grad(
        grad_out, x, weight, stride, padding, dilation, transposed, output_padding, groups
    )
