"""Array SGD: ``torch.optim.SGD`` for each of B models, in one op (``hfkern::sgd_step_``)."""

from __future__ import annotations

from typing import Any, Iterable

import torch

from .._optim_specs import SGD_SPEC
from ._base import ArrayOptimizer, Hyper

__all__ = ["SGD"]


class SGD(ArrayOptimizer):
    """Stochastic gradient descent for B models at once, ``torch.optim.SGD`` per model.

    Every parameter is ``[B, ...]`` with the same array size B (model b is index b).
    ``lr``, ``momentum``, ``dampening`` and ``weight_decay`` are each a float (all
    models alike), a length-B sequence, or a 1-D tensor or numpy array of length
    B, stored in ``param_groups`` as ``[B]`` tensors on the parameters' device (see
    :class:`~hfkern.optim.ArrayOptimizer`). ``nesterov`` and ``maximize`` apply to
    every model; ``nesterov`` needs momentum > 0 and zero dampening for every
    model, as torch requires per model. ``skip_nonfinite`` and ``step(skip=...)``
    skip models, see :class:`~hfkern.optim.ArrayOptimizer`.

    Momentum buffers (``state[p]["momentum_buffer"]``, ``[B, ...]``) are kept for
    every model of a group in which any model has momentum, with a ``[B]`` count
    of updates (``state[p]["step"]``) that tells a model's first update, which
    starts its buffer from the gradient as torch does; a model with zero
    momentum steps with its gradient. Editing a stored hyperparameter tensor in
    place takes effect at the next step but cannot switch momentum or weight
    decay on for a group in which every model had zero (assign a new value).
    ``foreach``, ``differentiable`` and ``fused`` are torch's implementation
    keywords, see :class:`~hfkern.optim.ArrayOptimizer`.
    """

    _spec = SGD_SPEC
    _compat = ("foreach", "differentiable", "fused")

    def __init__(
        self,
        params: Iterable[torch.Tensor] | Iterable[dict[str, Any]],
        lr: Hyper = 1e-3,
        momentum: Hyper = 0,
        dampening: Hyper = 0,
        weight_decay: Hyper = 0,
        nesterov: bool = False,
        *,
        maximize: bool = False,
        foreach: bool | None = None,
        differentiable: bool = False,
        fused: bool | None = None,
        skip_nonfinite: bool = False,
    ):
        defaults = dict(
            lr=lr, momentum=momentum, dampening=dampening, weight_decay=weight_decay,
            nesterov=nesterov, maximize=maximize, foreach=foreach, differentiable=differentiable,
            fused=fused,
        )
        super().__init__(params, defaults, skip_nonfinite=skip_nonfinite)

    def _check_values(self, group, per_model):
        if group["nesterov"]:
            bad = ((per_model["momentum"] <= 0) | (per_model["dampening"] != 0)).nonzero().flatten()
            if bad.numel():
                raise ValueError(
                    "SGD: Nesterov momentum requires a momentum and zero dampening for every model; "
                    f"models {bad.tolist()} have momentum {per_model['momentum'][bad].tolist()} "
                    f"and dampening {per_model['dampening'][bad].tolist()}"
                )

    def _init_state(self, key, p, group, state):
        if key == "step" and "momentum_buffer" in state:
            # A buffer loaded without a count was saved by a version that kept
            # none; it has been started for every model.
            return torch.ones(p.size(0), dtype=torch.float32, device=p.device)
        return super()._init_state(key, p, group, state)
