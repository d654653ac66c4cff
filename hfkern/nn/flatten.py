"""Array Flatten: B ``torch.nn.Flatten`` models."""

from __future__ import annotations

import torch
from torch import nn

from .._array import MAX_NDIM, check_input
from ._base import ArrayModule

__all__ = ["Flatten"]


class Flatten(ArrayModule):
    """B ``torch.nn.Flatten`` models: input ``[B, *s]``, output ``[B, *s']``.

    ``start_dim`` and ``end_dim`` count in one model's input ``s`` (negative
    ones from its end), so ``s'`` is exactly the shape ``torch.nn.Flatten``
    gives for that input: ``Flatten()`` maps ``[B, N, C, H, W]`` to
    ``[B, N, C*H*W]``. The output is a view of the input whenever its memory
    allows (a conv output's ``[N, B, C, H, W]`` memory does), a copy otherwise,
    as with ``torch.flatten``; a shared input stays shared.
    """

    _torch_cls = nn.Flatten
    _config_fields = ("start_dim", "end_dim")

    def __init__(self, start_dim: int = 1, end_dim: int = -1, *, B: int | None = None):
        super().__init__()
        self._set_B(B, required=False)
        self.start_dim, self.end_dim = start_dim, end_dim

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        x = check_input("Flatten", input, self.B, range(0, MAX_NDIM))
        model_shape = x.shape[1:]
        try:
            # torch's own flatten of one model's (empty) input: its dim rules, its shape.
            out_shape = torch.empty(model_shape, device="meta").flatten(self.start_dim, self.end_dim).shape
        except (IndexError, RuntimeError) as e:
            raise ValueError(
                f"Flatten: start_dim={self.start_dim}, end_dim={self.end_dim} do not fit one model's "
                f"input of {len(model_shape)} dims {list(model_shape)} (array input shape "
                f"{list(x.shape)}): {e}"
            ) from None
        return x.reshape(x.size(0), *out_shape)
