"""Array LAMB: layer-wise adaptive moments for each of B models, in one op (``hfkern::lamb_step_``)."""

from __future__ import annotations

import math
from typing import Any, Iterable

import torch

from .._optim_specs import LAMB_SPEC
from ._base import ArrayOptimizer, Hyper

__all__ = ["LAMB"]


class LAMB(ArrayOptimizer):
    r"""LAMB (You et al. 2019, Algorithm 2) for B models at once: an Adam direction whose
    step for each layer (parameter tensor) and model is scaled by that layer's trust ratio.

    For model b and parameter i, with ``w`` model b's slice of parameter i, ``t``
    its step count and every norm over that whole slice::

        g = -grad if maximize else grad
        m = beta1 * m + (1 - beta1) * g
        v = beta2 * v + (1 - beta2) * g * g
        m_hat = m / (1 - beta1 ** t);  v_hat = v / (1 - beta2 ** t)     # bias_correction
        r = m_hat / (sqrt(v_hat) + eps) + weight_decay * w
        ratio = phi(||w||) / ||r||  if ||w|| > 0 and ||r|| > 0 else 1
        w = w - lr * ratio * r

    with ``phi(z) = clamp(z, norm_min, norm_max)`` (``norm_bounds``; the default
    ``(0, inf)`` is the identity). Without ``bias_correction``, ``m_hat = m`` and
    ``v_hat = v``. With ``exclude_1d=True`` the group's parameters whose
    per-model shape has at most one dim (``[B]`` or ``[B, n]``: biases,
    normalization weights) are excluded from adaptation and weight decay
    (``ratio = 1``, no ``weight_decay * w``). hfkern/ops/optim.py's
    ``lamb_step_`` gives the exact operation order.

    Every parameter is ``[B, ...]`` (model b is index b). ``lr``, ``eps`` and
    ``weight_decay`` are each a float, a length-B sequence, or a ``[B]`` tensor
    or numpy array; ``betas`` (each in [0, 1)) and ``norm_bounds`` (``norm_min <=
    norm_max``) are pairs whose entries are each one of those. They are stored
    in ``param_groups`` as ``[B]`` tensors on the parameters' device (pairs as
    pairs of them). ``bias_correction``, ``exclude_1d`` and ``maximize`` apply to
    every model of a group.

    State per parameter: ``step`` (``[B]`` float32, each model's own count, used
    for its bias correction), ``exp_avg`` and ``exp_avg_sq`` (``[B, ...]``,
    float32 for bfloat16/float16 parameters). The norms of all parameters and
    models are computed in one multi-tensor pass, in float32 (float64 for
    float64 parameters). ``skip_nonfinite`` and ``step(skip=...)``: see
    :class:`~hfkern.optim.ArrayOptimizer`.
    """

    _spec = LAMB_SPEC

    def __init__(
        self,
        params: Iterable[torch.Tensor] | Iterable[dict[str, Any]],
        lr: Hyper = 1e-3,
        betas: tuple[Hyper, Hyper] = (0.9, 0.999),
        eps: Hyper = 1e-6,
        weight_decay: Hyper = 0.01,
        norm_bounds: tuple[Hyper, Hyper] = (0.0, math.inf),
        *,
        bias_correction: bool = True,
        exclude_1d: bool = False,
        maximize: bool = False,
        skip_nonfinite: bool = False,
    ):
        defaults = dict(
            lr=lr, betas=betas, eps=eps, weight_decay=weight_decay, norm_bounds=norm_bounds,
            bias_correction=bias_correction, exclude_1d=exclude_1d, maximize=maximize,
        )
        super().__init__(params, defaults, skip_nonfinite=skip_nonfinite)

    def _check_values(self, group, per_model):
        self._require_below(per_model, "beta1", 1.0)
        self._require_below(per_model, "beta2", 1.0)
        low, high = per_model["norm_min"], per_model["norm_max"]
        bad = (low > high).nonzero().flatten()
        if bad.numel():
            raise ValueError(
                f"LAMB: norm_bounds must satisfy norm_bounds[0] <= norm_bounds[1] for every model; models "
                f"{bad.tolist()} have {low[bad].tolist()} and {high[bad].tolist()}"
            )
