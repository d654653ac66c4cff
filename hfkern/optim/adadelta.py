"""Array Adadelta: ``torch.optim.Adadelta`` for each of B models, in one op (``hfkern::adadelta_step_``)."""

from __future__ import annotations

from typing import Any, Iterable

import torch

from .._optim_specs import ADADELTA_SPEC
from ._base import ArrayOptimizer, Hyper

__all__ = ["Adadelta"]


class Adadelta(ArrayOptimizer):
    """Adadelta for B models at once, ``torch.optim.Adadelta`` per model.

    Every parameter is ``[B, ...]`` (model b is index b). ``lr``, ``rho`` (in
    [0, 1]), ``eps`` and ``weight_decay`` are each a float, a length-B sequence,
    or a ``[B]`` tensor or numpy array, stored in ``param_groups`` as ``[B]`` tensors on the
    parameters' device. State per parameter: ``step`` (``[B]`` float32),
    ``square_avg`` and ``acc_delta`` (``[B, ...]``). ``skip_nonfinite`` and
    ``step(skip=...)``, and torch's implementation keywords ``foreach``,
    ``capturable`` and ``differentiable``: see :class:`~hfkern.optim.ArrayOptimizer`.
    """

    _spec = ADADELTA_SPEC
    _compat = ("foreach", "capturable", "differentiable")

    def __init__(
        self,
        params: Iterable[torch.Tensor] | Iterable[dict[str, Any]],
        lr: Hyper = 1.0,
        rho: Hyper = 0.9,
        eps: Hyper = 1e-6,
        weight_decay: Hyper = 0,
        foreach: bool | None = None,
        *,
        capturable: bool = False,
        maximize: bool = False,
        differentiable: bool = False,
        skip_nonfinite: bool = False,
    ):
        defaults = dict(
            lr=lr, rho=rho, eps=eps, weight_decay=weight_decay, maximize=maximize, foreach=foreach,
            capturable=capturable, differentiable=differentiable,
        )
        super().__init__(params, defaults, skip_nonfinite=skip_nonfinite)

    def _check_values(self, group, per_model):
        self._require_below(per_model, "rho", 1.0, inclusive=True)
