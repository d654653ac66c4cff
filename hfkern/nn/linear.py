"""Array Linear: B ``torch.nn.Linear`` models as one batched matmul."""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from .._array import MAX_NDIM, check_input, shares_work
from ._base import ArrayModule, reset_kaiming_uniform

__all__ = ["Linear", "array_linear"]


def array_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """x ``[B, *, in]`` (per model or shared), weight ``[B, out, in]``, bias ``[B, out]`` -> ``[B, *, out]``.

    Per-model inputs are one batched matmul. A shared input
    (:func:`hfkern.broadcast`) is one dense matmul against the B weights
    concatenated; its result is a view of ``[*, B, out]`` memory.
    """
    B, out, inp = weight.shape
    if shares_work(x):
        dense_bias = None if bias is None else bias.reshape(B * out)
        y = F.linear(x[0], weight.reshape(B * out, inp), dense_bias)
        return y.unflatten(-1, (B, out)).movedim(-2, 0)
    # The rows are counted, not inferred: with in_features == 0 reshape cannot infer -1.
    x3 = x.reshape(B, math.prod(x.shape[1:-1]), inp)
    wt = weight.transpose(1, 2)
    y = torch.bmm(x3, wt) if bias is None else torch.baddbmm(bias.unsqueeze(1), x3, wt)
    return y.view(*x.shape[:-1], out)


class Linear(ArrayModule):
    """B ``torch.nn.Linear`` models.

    Input ``[B, *, in_features]``, output ``[B, *, out_features]``; weight
    ``[B, out_features, in_features]``, bias ``[B, out_features]``. A shared input
    (:func:`hfkern.broadcast`) is one dense matmul with the B weights
    concatenated; its output is stored as ``[*, B, out_features]`` memory.
    """

    _torch_cls = nn.Linear
    _config_fields = ("in_features", "out_features", "bias")

    def __init__(self, in_features: int, out_features: int, bias: bool = True, *, B: int,
                 device=None, dtype=None):
        super().__init__()
        nn.Linear(in_features, out_features, bias, device="meta")  # torch's argument checks
        self._set_B(B, required=True)
        self.in_features, self.out_features = in_features, out_features
        factory = {"device": device, "dtype": dtype}
        self.weight = nn.Parameter(torch.empty((self.B, out_features, in_features), **factory))
        if bias:
            self.bias = nn.Parameter(torch.empty((self.B, out_features), **factory))
        else:
            self.register_parameter("bias", None)
        self.reset_parameters()

    def reset_parameters(self) -> None:
        """torch.nn.Linear's init, drawn independently for each model."""
        reset_kaiming_uniform(self.weight, self.bias)

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        x = check_input("Linear", input, self.B, range(1, MAX_NDIM), self.weight)
        if x.size(-1) != self.in_features:
            raise ValueError(
                f"Linear: expected input with in_features={self.in_features} in its last dim, "
                f"got shape {list(x.shape)}"
            )
        return array_linear(x, self.weight, self.bias)
