"""Array RMSprop: ``torch.optim.RMSprop`` for each of B models, in one op (``hfkern::rmsprop_step_``)."""

from __future__ import annotations

from typing import Any, Iterable

import torch

from .._optim_specs import RMSPROP_SPEC
from ._base import ArrayOptimizer, Hyper

__all__ = ["RMSprop"]


class RMSprop(ArrayOptimizer):
    """RMSprop for B models at once, ``torch.optim.RMSprop`` per model.

    Every parameter is ``[B, ...]`` (model b is index b). ``lr``, ``alpha``,
    ``eps``, ``weight_decay`` and ``momentum`` are each a float, a length-B
    sequence, or a ``[B]`` tensor or numpy array, stored in ``param_groups`` as ``[B]`` tensors on
    the parameters' device; ``centered`` and ``maximize`` apply to every model.
    State per parameter: ``step`` (``[B]`` float32), ``square_avg``, with
    momentum in any model of the group ``momentum_buffer`` and when centered
    ``grad_avg`` (``[B, ...]``). A model with zero momentum steps as torch does
    without a buffer and leaves its buffer as it was, so that a momentum
    switched off and on again resumes from the buffer it had, as torch's does.
    Switched on for a model that never had momentum (or ``centered`` switched
    on for a group), the state starts from zeros: torch's RMSprop creates
    ``momentum_buffer`` (``grad_avg``) only at a parameter's first step and
    raises a KeyError when the option is switched on later, and zeros are what
    that first step creates. Editing the stored momentum in place cannot switch
    momentum on for a group in which every model had zero when the group was
    last validated (assign a new value or use :meth:`set_hyperparameters`).
    ``skip_nonfinite`` and ``step(skip=...)``, and torch's implementation keywords
    ``capturable``, ``foreach`` and ``differentiable``: see :class:`~hfkern.optim.ArrayOptimizer`.
    The positional order of the arguments is torch's.
    """

    _spec = RMSPROP_SPEC
    _compat = ("capturable", "foreach", "differentiable")

    def __init__(
        self,
        params: Iterable[torch.Tensor] | Iterable[dict[str, Any]],
        lr: Hyper = 1e-2,
        alpha: Hyper = 0.99,
        eps: Hyper = 1e-8,
        weight_decay: Hyper = 0,
        momentum: Hyper = 0,
        centered: bool = False,
        capturable: bool = False,
        foreach: bool | None = None,
        maximize: bool = False,
        differentiable: bool = False,
        *,
        skip_nonfinite: bool = False,
    ):
        defaults = dict(
            lr=lr, alpha=alpha, eps=eps, weight_decay=weight_decay, momentum=momentum,
            centered=centered, maximize=maximize, capturable=capturable, foreach=foreach,
            differentiable=differentiable,
        )
        super().__init__(params, defaults, skip_nonfinite=skip_nonfinite)
