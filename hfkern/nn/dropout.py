"""Array dropout: Dropout, Dropout1d, Dropout2d.

Each model draws its own masks, exactly as B separate torch modules would
(element-wise for Dropout, one draw per (model, sample, channel) for
Dropout1d/2d). A shared input (:func:`hfkern.broadcast`) therefore comes out,
in training with ``p > 0``, as a real ``[B, ...]`` tensor with B independent
masks; in eval (or with ``p == 0``) dropout is the identity and returns its
input itself, shared or not.

``inplace=True`` modifies the input in place and returns it, as torch does. A
shared input cannot be written in place (its B models are one memory), so that
raises ValueError when the call would write.
"""

from __future__ import annotations

from typing import Callable, ClassVar

import torch
import torch.nn.functional as F
from torch import nn

from .._array import MAX_NDIM, check_input, fold, is_shared, per_model_memory_first
from ._base import ArrayModule

__all__ = ["Dropout", "Dropout1d", "Dropout2d"]


def _fold_copies(x: torch.Tensor) -> bool:
    """Whether :func:`hfkern._array.fold` must copy ``x`` ([B, N, ...]) to merge its first two dims."""
    if per_model_memory_first(x) and not is_shared(x):
        return False
    B, N = x.shape[:2]
    # strides alone decide (no storage query, which torch.compile cannot trace)
    return not (B <= 1 or N <= 1 or x.stride(0) == N * x.stride(1))


class _ArrayDropoutNd(ArrayModule):
    _config_fields = ("p", "inplace")
    _model_ndims: ClassVar[tuple[int, int | None]]  # per-model ranks the namesake accepts: lo <= r < hi

    def __init__(self, p: float = 0.5, inplace: bool = False, *, B: int | None = None):
        super().__init__()
        self._torch_cls(p, inplace)  # torch's own check of p
        self._set_B(B, required=False)
        self.p, self.inplace = p, inplace

    def _check(self, input: torch.Tensor) -> torch.Tensor:
        lo, hi = self._model_ndims
        x = check_input(type(self).__name__, input, self.B, range(lo, hi or MAX_NDIM))
        if self.inplace and self.training and self.p > 0 and is_shared(x):
            raise ValueError(
                f"{type(self).__name__}: inplace=True needs an input with its own memory per "
                f"model, got a shared (hfkern.broadcast) input of shape {list(x.shape)} whose B "
                f"models are one memory; use inplace=False for this layer"
            )
        return x


class Dropout(_ArrayDropoutNd):
    """B ``torch.nn.Dropout`` models: input ``[B, *]``, output ``[B, *]``.

    In training every element is zeroed with probability ``p``, independently
    for every model, and the kept ones are scaled by ``1 / (1 - p)``. The output
    has the input's memory order (a ``[N, B, ...]``-memory input stays so).
    """

    _torch_cls = nn.Dropout
    _model_ndims = (0, None)

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        x = self._check(input)
        inplace = self.inplace
        if self.training and self.p > 0 and is_shared(x):
            # One copy per model, then dropped out in place: B independent masks.
            x, inplace = x.contiguous(), True
        return F.dropout(x, self.p, self.training, inplace)


class _ArrayFeatureDropout(_ArrayDropoutNd):
    _fn: ClassVar[Callable[..., torch.Tensor]]

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        x = self._check(input)
        fn = type(self)._fn
        if not (self.training and self.p > 0):
            # Identity, as in torch; the call on an empty per-model tensor only
            # issues the warnings torch gives for this input rank.
            fn(torch.empty(x.shape[1:], dtype=x.dtype, device="meta"), self.p, False, False)
            return x
        # Folding B into dim 0 keeps the rank: torch sees a batch of B*N samples
        # (or, for a model's unbatched input, B*C channels) and draws one mask
        # per model, sample and channel; a 3-D input to dropout2d keeps torch's
        # reading of dim 0 as the batch, with torch's warning.
        folded, unfold = fold(x)
        copied = _fold_copies(x)
        # A folded copy (shared input, or strides that do not merge) is ours to overwrite.
        out = fn(folded, self.p, True, self.inplace or copied)
        if self.inplace:
            if copied:
                x.copy_(unfold(out))
            return x
        return unfold(out)


class Dropout1d(_ArrayFeatureDropout):
    """B ``torch.nn.Dropout1d`` models: input ``[B, N, C, L]`` or ``[B, C, L]``.

    In training each (model, sample, channel) row of length L is zeroed with
    probability ``p``, independently, and the kept rows are scaled by
    ``1 / (1 - p)``. A ``[N, B, C, L]``-memory input gives ``[N, B, C, L]``-memory
    output.
    """

    _torch_cls = nn.Dropout1d
    _fn = staticmethod(F.dropout1d)
    _model_ndims = (2, 4)


class Dropout2d(_ArrayFeatureDropout):
    """B ``torch.nn.Dropout2d`` models: input ``[B, N, C, H, W]`` (or ``[B, C, H, W]``, below).

    In training each (model, sample, channel) plane is zeroed with probability
    ``p``, independently, and the kept planes are scaled by ``1 / (1 - p)``. A
    ``[N, B, C, H, W]``-memory input gives ``[N, B, C, H, W]``-memory output.

    An array input ``[B, C, H, W]`` holds a 3-D input per model, which torch's
    dropout2d reads as ``(N, C, L)``: each model's rows along the last dim are
    dropped independently, with torch's warning, exactly as B torch modules do.
    Per-model 2-D and 5-D or higher inputs (deprecated by torch, with its
    warning) drop per entry of their first two dims, as torch does.
    """

    _torch_cls = nn.Dropout2d
    _fn = staticmethod(F.dropout2d)
    _model_ndims = (2, None)
