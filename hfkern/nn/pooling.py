"""Array pooling: MaxPool1d/2d, AvgPool1d/2d, AdaptiveAvgPool1d/2d.

Input ``[B, N, C, *s]`` (or ``[B, C, *s]`` for models fed unbatched inputs),
output ``[B, N, C, *s']`` (resp. ``[B, C, *s']``). Every (model, sample,
channel) plane is pooled on its own, so the array dim is folded into torch's
batch dim (:func:`hfkern._array.fold_planes`): a conv output's ``[N, B, C, *s]``
memory comes out as ``[N, B, C, *s']`` memory, and channels-last ``[N, H, W, B,
C]`` memory (pooled as the channels-last grouped view ``[N, B*C, H, W]``) as
``[N, H', W', B, C]``, ready for the next conv without a copy. A shared input (:func:`hfkern.broadcast`) is pooled once and the result
is shared by the B models (a broadcast view, gradients summed over the models).

Configuration is torch's own: each module builds its namesake to store the
arguments exactly as torch does, and torch's functional form validates them
at the first call, as it does for the namesake. An error torch raises for the
folded input is raised as torch's error for one model's input, naming the
array input's shape (:func:`hfkern.nn._base.raise_model_error`).
:meth:`~hfkern.nn.ArrayModule.from_modules` takes the spellings of a setting
that torch reads alike as one (``kernel_size=2`` and ``(2, 2)``; ``stride=None``
and ``stride=kernel_size``) and keeps module 0's.
"""

from __future__ import annotations

from numbers import Integral
from typing import Any, ClassVar

import torch
import torch.nn.functional as F
from torch import nn

from .._array import check_input, fold_planes, shares_work
from ._base import ArrayModule, raise_model_error

__all__ = [
    "MaxPool1d", "MaxPool2d", "AvgPool1d", "AvgPool2d",
    "AdaptiveAvgPool1d", "AdaptiveAvgPool2d",
]


class _ArrayPool(ArrayModule):
    _n: ClassVar[int]  # spatial dims

    def _adopt(self, template: nn.Module, B: int | None) -> None:
        # The namesake normalizes the arguments (stride=None -> kernel_size,
        # int -> tuple where torch does that), so reading them back for
        # to_modules/from_modules gives the namesake's own values.
        self._set_B(B, required=False)
        for field in self._config_fields:
            setattr(self, field, getattr(template, field))

    @classmethod
    def _comparable_config(cls, config: dict[str, Any]) -> dict[str, Any]:
        """``config`` with the sizes in torch's reading: an int (or a 1-tuple, for
        ``kernel_size``, ``stride``, ``padding``, ``dilation``) is that size in each of the
        ``_n`` dims, ``stride=None`` (or ``()``) is ``kernel_size``; an adaptive pool's
        ``output_size`` int is that size in each dim."""
        n = cls._n

        def sizes(value: Any, singleton: bool = True) -> Any:
            if isinstance(value, Integral) and not isinstance(value, bool):
                return (int(value),) * n
            if isinstance(value, (list, tuple)):
                return tuple(value) * n if singleton and len(value) == 1 else tuple(value)
            return value

        out = dict(config)
        for field in ("kernel_size", "stride", "padding", "dilation"):
            if field in out:
                out[field] = sizes(out[field])
        if "stride" in out and out["stride"] in (None, ()):
            out["stride"] = out["kernel_size"]
        if "output_size" in out:
            out["output_size"] = sizes(out["output_size"], singleton=n == 1)
        return out

    def _pool(self, x: torch.Tensor):
        """torch's functional form on a batch torch accepts: ``[M, C, *s]`` or ``[C, *s]``."""
        raise NotImplementedError

    def forward(self, input: torch.Tensor):
        n = self._n
        x = check_input(type(self).__name__, input, self.B, (n + 1, n + 2))
        try:
            return self._forward(x)
        except RuntimeError as ex:  # torch's error names the folded [B*N, C, *s]: one model's
            raise_model_error(type(self).__name__, x, lambda: self._pool(x[0]), ex)

    def _forward(self, x: torch.Tensor):
        """``forward`` of a checked input."""
        if shares_work(x):
            out = self._pool(x[0])
            B = x.size(0)
            if isinstance(out, tuple):
                return tuple(o.expand(B, *o.shape) for o in out)
            return out.expand(B, *out.shape)
        # Folding B into dim 0 keeps the rank, so a model's unbatched [C, *s]
        # input stays an unbatched [B*C, *s] input for torch.
        folded, unfold = fold_planes(x)
        out = self._pool(folded)
        if isinstance(out, tuple):
            return tuple(unfold(o) for o in out)
        return unfold(out)


class _ArrayMaxPool(_ArrayPool):
    _config_fields = ("kernel_size", "stride", "padding", "dilation", "return_indices", "ceil_mode")

    def __init__(self, kernel_size, stride=None, padding=0, dilation=1, return_indices=False,
                 ceil_mode=False, *, B: int | None = None):
        super().__init__()
        self._adopt(
            self._torch_cls(kernel_size, stride, padding, dilation, return_indices, ceil_mode), B
        )


class MaxPool1d(_ArrayMaxPool):
    """B ``torch.nn.MaxPool1d`` models: input ``[B, N, C, L]`` or ``[B, C, L]``.

    Returns ``[B, N, C, L']`` (``[B, C, L']``); with ``return_indices=True`` also
    the indices of the same shape, equal to each model's torch indices (int64
    positions along L).
    """

    _torch_cls = nn.MaxPool1d
    _n = 1

    def _pool(self, x):
        return F.max_pool1d(x, self.kernel_size, self.stride, self.padding, self.dilation,
                            ceil_mode=self.ceil_mode, return_indices=self.return_indices)


class MaxPool2d(_ArrayMaxPool):
    """B ``torch.nn.MaxPool2d`` models: input ``[B, N, C, H, W]`` or ``[B, C, H, W]``.

    Returns ``[B, N, C, H', W']`` (``[B, C, H', W']``); with ``return_indices=True``
    also the indices of the same shape, equal to each model's torch indices
    (int64 flat positions in the H x W plane).
    """

    _torch_cls = nn.MaxPool2d
    _n = 2

    def _pool(self, x):
        return F.max_pool2d(x, self.kernel_size, self.stride, self.padding, self.dilation,
                            ceil_mode=self.ceil_mode, return_indices=self.return_indices)


class AvgPool1d(_ArrayPool):
    """B ``torch.nn.AvgPool1d`` models: input ``[B, N, C, L]`` or ``[B, C, L]``,
    output ``[B, N, C, L']`` or ``[B, C, L']``."""

    _torch_cls = nn.AvgPool1d
    _n = 1
    _config_fields = ("kernel_size", "stride", "padding", "ceil_mode", "count_include_pad")

    def __init__(self, kernel_size, stride=None, padding=0, ceil_mode=False, count_include_pad=True,
                 *, B: int | None = None):
        super().__init__()
        self._adopt(nn.AvgPool1d(kernel_size, stride, padding, ceil_mode, count_include_pad), B)

    def _pool(self, x):
        return F.avg_pool1d(x, self.kernel_size, self.stride, self.padding, self.ceil_mode,
                            self.count_include_pad)


class AvgPool2d(_ArrayPool):
    """B ``torch.nn.AvgPool2d`` models: input ``[B, N, C, H, W]`` or ``[B, C, H, W]``,
    output ``[B, N, C, H', W']`` or ``[B, C, H', W']``."""

    _torch_cls = nn.AvgPool2d
    _n = 2
    _config_fields = ("kernel_size", "stride", "padding", "ceil_mode", "count_include_pad",
                      "divisor_override")

    def __init__(self, kernel_size, stride=None, padding=0, ceil_mode=False, count_include_pad=True,
                 divisor_override=None, *, B: int | None = None):
        super().__init__()
        self._adopt(
            nn.AvgPool2d(kernel_size, stride, padding, ceil_mode, count_include_pad, divisor_override),
            B,
        )

    def _pool(self, x):
        return F.avg_pool2d(x, self.kernel_size, self.stride, self.padding, self.ceil_mode,
                            self.count_include_pad, self.divisor_override)


class AdaptiveAvgPool1d(_ArrayPool):
    """B ``torch.nn.AdaptiveAvgPool1d`` models: input ``[B, N, C, L]`` or ``[B, C, L]``,
    output ``[B, N, C, output_size]`` or ``[B, C, output_size]``."""

    _torch_cls = nn.AdaptiveAvgPool1d
    _n = 1
    _config_fields = ("output_size",)

    def __init__(self, output_size, *, B: int | None = None):
        super().__init__()
        self._adopt(nn.AdaptiveAvgPool1d(output_size), B)

    def _pool(self, x):
        return F.adaptive_avg_pool1d(x, self.output_size)


class AdaptiveAvgPool2d(_ArrayPool):
    """B ``torch.nn.AdaptiveAvgPool2d`` models: input ``[B, N, C, H, W]`` or ``[B, C, H, W]``,
    output ``[B, N, C, H', W']`` or ``[B, C, H', W']`` with ``(H', W') = output_size``
    (a ``None`` entry keeps that input size)."""

    _torch_cls = nn.AdaptiveAvgPool2d
    _n = 2
    _config_fields = ("output_size",)

    def __init__(self, output_size, *, B: int | None = None):
        super().__init__()
        self._adopt(nn.AdaptiveAvgPool2d(output_size), B)

    def _pool(self, x):
        return F.adaptive_avg_pool2d(x, self.output_size)
