"""Array LARS: layer-wise adaptive rate scaling for each of B models, in one op (``hfkern::lars_step_``)."""

from __future__ import annotations

from typing import Any, Iterable

import torch

from .._optim_specs import LARS_SPEC
from ._base import ArrayOptimizer, Hyper

__all__ = ["LARS"]


class LARS(ArrayOptimizer):
    r"""LARS (You, Gitman and Ginsburg 2017) for B models at once: SGD with momentum whose
    step for each layer (parameter tensor) and model is scaled by that layer's trust ratio.

    For model b and parameter i, with ``w`` model b's slice of parameter i (every
    norm is over that whole slice)::

        g = -grad if maximize else grad
        local_lr = trust_coefficient * ||w|| / (||g|| + weight_decay * ||w|| + eps)
                   if ||w|| > 0 and ||g|| > 0 else 1
        g = g + weight_decay * w
        buf = momentum * buf + (lr * local_lr) * g
        w = w - buf

    With ``exclude_1d=True`` the group's parameters whose per-model shape has at
    most one dim (``[B]`` or ``[B, n]``: biases, normalization weights) are
    excluded from adaptation and weight decay (``local_lr = 1``, no
    ``weight_decay * w``), as LARS is commonly used. Put parameters in separate
    groups to exclude some and not others. Momentum follows the paper (the
    learning rate is inside the buffer); a model with momentum 0 steps with
    ``lr * local_lr * g`` and leaves its buffer as it was, as ``torch.optim.SGD``
    does: a model whose momentum is switched on starts from a zero buffer (or,
    switched off and on again, resumes from the buffer it had).

    Every parameter is ``[B, ...]`` (model b is index b). ``lr``, ``momentum``,
    ``weight_decay``, ``trust_coefficient`` and ``eps`` are each a float, a
    length-B sequence, or a ``[B]`` tensor or numpy array, stored in
    ``param_groups`` as ``[B]`` tensors on the parameters' device (see
    :class:`~hfkern.optim.ArrayOptimizer`: schedulers and in-place edits reach
    the next step, except that an in-place edit cannot switch momentum or weight
    decay on for a group in which every model had zero when the group was last
    validated). ``exclude_1d`` and ``maximize`` apply to every model of a group.

    State per parameter: ``step`` (``[B]`` float32, each model's count of
    updates, not used by the math) and, when any model of the group has
    momentum, ``momentum_buffer`` (``[B, ...]``, float32 for bfloat16/float16
    parameters). The norms of all parameters and models are computed in one
    multi-tensor pass (two on a GPU kernel: per-tile partial sums, then each
    update program sums its layer's partials in a fixed order), in float32
    (float64 for float64 parameters). ``skip_nonfinite`` and ``step(skip=...)``:
    see :class:`~hfkern.optim.ArrayOptimizer`.
    """

    _spec = LARS_SPEC

    def __init__(
        self,
        params: Iterable[torch.Tensor] | Iterable[dict[str, Any]],
        lr: Hyper = 1.0,
        momentum: Hyper = 0.9,
        weight_decay: Hyper = 0,
        trust_coefficient: Hyper = 1e-3,
        eps: Hyper = 1e-8,
        *,
        exclude_1d: bool = False,
        maximize: bool = False,
        skip_nonfinite: bool = False,
    ):
        defaults = dict(
            lr=lr, momentum=momentum, weight_decay=weight_decay, trust_coefficient=trust_coefficient,
            eps=eps, exclude_1d=exclude_1d, maximize=maximize,
        )
        super().__init__(params, defaults, skip_nonfinite=skip_nonfinite)
