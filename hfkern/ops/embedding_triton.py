"""Triton implementations of the array embedding ops, one ``torch.library.triton_op`` each.

``hfkern::array_embedding_triton`` and ``hfkern::array_embedding_backward_triton``
take exactly the arguments of the ops in :mod:`hfkern.ops.embedding` and call
the launchers in :mod:`hfkern.triton.embedding`. The backend registry imports
this module the first time the ``triton`` backend serves an embedding op.
The kernels need no derivatives of their own: the backward ops' derivative
is a lookup, which the ``triton`` backend serves with its forward kernel.
"""

from __future__ import annotations

import torch
from torch import Tensor

from ..triton import embedding as kernels


@torch.library.triton_op("hfkern::array_embedding_triton", mutates_args=())
def array_embedding_triton(
    weight: Tensor,
    indices: Tensor,
    padding_idx: int = -1,
    scale_grad_by_freq: bool = False,
    sparse: bool = False,
) -> Tensor:
    return kernels.array_embedding(weight, indices, padding_idx, scale_grad_by_freq, sparse)


@torch.library.triton_op("hfkern::array_embedding_backward_triton", mutates_args=())
def array_embedding_backward_triton(
    grad_out: Tensor,
    indices: Tensor,
    num_weights: int,
    padding_idx: int,
    scale_grad_by_freq: bool,
) -> Tensor:
    return kernels.array_embedding_backward(grad_out, indices, num_weights, padding_idx, scale_grad_by_freq)
