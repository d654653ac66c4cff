"""Array Adam and AdamW: ``torch.optim.Adam`` / ``AdamW`` for each of B models, in one op
(``hfkern::adam_step_``)."""

from __future__ import annotations

from typing import Any, Iterable

import torch

from .._optim_specs import ADAM_SPEC
from ._base import ArrayOptimizer, Hyper

__all__ = ["Adam", "AdamW"]


class Adam(ArrayOptimizer):
    """Adam for B models at once, ``torch.optim.Adam`` per model.

    Every parameter is ``[B, ...]`` (model b is index b). ``lr``, ``eps`` and
    ``weight_decay`` are each a float, a length-B sequence, or a ``[B]`` tensor
    or numpy array; ``betas`` is a pair whose entries are each one of those (each in [0, 1)).
    They are stored in ``param_groups`` as ``[B]`` tensors on the parameters'
    device (``betas`` as a pair of them). ``amsgrad``, ``maximize`` and
    ``decoupled_weight_decay`` (AdamW's weight decay) apply to every model.

    State per parameter: ``step`` (``[B]`` float32, each model's own count, used
    for its bias correction), ``exp_avg``, ``exp_avg_sq`` and with amsgrad
    ``max_exp_avg_sq`` (``[B, ...]``, float32 for bfloat16/float16 parameters).
    ``skip_nonfinite`` and ``step(skip=...)``, and torch's implementation keywords
    ``foreach``, ``capturable``, ``differentiable`` and ``fused``: see
    :class:`~hfkern.optim.ArrayOptimizer`.
    """

    _spec = ADAM_SPEC
    _compat = ("foreach", "capturable", "differentiable", "fused")

    def __init__(
        self,
        params: Iterable[torch.Tensor] | Iterable[dict[str, Any]],
        lr: Hyper = 1e-3,
        betas: tuple[Hyper, Hyper] = (0.9, 0.999),
        eps: Hyper = 1e-8,
        weight_decay: Hyper = 0,
        amsgrad: bool = False,
        *,
        foreach: bool | None = None,
        maximize: bool = False,
        capturable: bool = False,
        differentiable: bool = False,
        fused: bool | None = None,
        decoupled_weight_decay: bool = False,
        skip_nonfinite: bool = False,
    ):
        defaults = dict(
            lr=lr, betas=betas, eps=eps, weight_decay=weight_decay, amsgrad=amsgrad,
            maximize=maximize, decoupled_weight_decay=decoupled_weight_decay, foreach=foreach,
            capturable=capturable, differentiable=differentiable, fused=fused,
        )
        super().__init__(params, defaults, skip_nonfinite=skip_nonfinite)

    def _check_values(self, group, per_model):
        self._require_below(per_model, "beta1", 1.0)
        self._require_below(per_model, "beta2", 1.0)


class AdamW(Adam):
    """AdamW for B models at once, ``torch.optim.AdamW`` per model.

    Adam with decoupled weight decay (``p *= 1 - lr * weight_decay`` before the
    Adam update), default ``weight_decay=1e-2``; arguments as :class:`Adam`.
    """

    def __init__(
        self,
        params: Iterable[torch.Tensor] | Iterable[dict[str, Any]],
        lr: Hyper = 1e-3,
        betas: tuple[Hyper, Hyper] = (0.9, 0.999),
        eps: Hyper = 1e-8,
        weight_decay: Hyper = 1e-2,
        amsgrad: bool = False,
        *,
        maximize: bool = False,
        foreach: bool | None = None,
        capturable: bool = False,
        differentiable: bool = False,
        fused: bool | None = None,
        skip_nonfinite: bool = False,
    ):
        super().__init__(
            params, lr, betas, eps, weight_decay, amsgrad, maximize=maximize, foreach=foreach,
            capturable=capturable, differentiable=differentiable, fused=fused,
            decoupled_weight_decay=True, skip_nonfinite=skip_nonfinite,
        )
