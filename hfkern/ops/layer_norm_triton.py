"""Triton implementations of the array layer norm / RMS norm ops, one ``torch.library.triton_op`` each.

``hfkern::array_layer_norm_triton``, ``array_layer_norm_backward_triton``,
``array_rms_norm_triton`` and ``array_rms_norm_backward_triton`` take exactly
the arguments of the ops in :mod:`hfkern.ops.layer_norm` and call the launchers
in :mod:`hfkern.triton.layer_norm`. The backend registry imports this module
the first time the ``triton`` backend serves a norm op. The kernels are
differentiable once: a first backward through the ``triton`` backend runs
them, and its own derivative (double backward) runs the torch reference math
(see :mod:`hfkern.ops.layer_norm`).
"""

from __future__ import annotations

import torch
from torch import Tensor

from ..triton import layer_norm as kernels


@torch.library.triton_op("hfkern::array_layer_norm_triton", mutates_args=())
def array_layer_norm_triton(
    x: Tensor, weight: Tensor | None, bias: Tensor | None, norm_ndim: int, eps: float
) -> tuple[Tensor, Tensor, Tensor]:
    return kernels.array_layer_norm(x, weight, bias, norm_ndim, eps)


@torch.library.triton_op("hfkern::array_layer_norm_backward_triton", mutates_args=())
def array_layer_norm_backward_triton(
    grad_y: Tensor,
    x: Tensor,
    weight: Tensor | None,
    mean: Tensor,
    rstd: Tensor,
    norm_ndim: int,
    output_mask: list[bool],
) -> tuple[Tensor, Tensor, Tensor]:
    return kernels.array_layer_norm_backward(grad_y, x, weight, mean, rstd, norm_ndim, output_mask)


@torch.library.triton_op("hfkern::array_rms_norm_triton", mutates_args=())
def array_rms_norm_triton(
    x: Tensor, weight: Tensor | None, norm_ndim: int, eps: float
) -> tuple[Tensor, Tensor]:
    return kernels.array_rms_norm(x, weight, norm_ndim, eps)


@torch.library.triton_op("hfkern::array_rms_norm_backward_triton", mutates_args=())
def array_rms_norm_backward_triton(
    grad_y: Tensor,
    x: Tensor,
    weight: Tensor | None,
    rstd: Tensor,
    norm_ndim: int,
    output_mask: list[bool],
) -> tuple[Tensor, Tensor]:
    return kernels.array_rms_norm_backward(grad_y, x, weight, rstd, norm_ndim, output_mask)
