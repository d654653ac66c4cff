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
    of each model's updates with momentum (``state[p]["step"]``) that tells its
    first one, which starts its buffer from the gradient as torch does. A model
    with zero momentum steps with its gradient and leaves its buffer and count
    as they were, as torch leaves ``momentum_buffer`` alone while a group's
    momentum is 0. So when a model's momentum changes between steps (by
    :meth:`set_hyperparameters`, an assigned value or an in-place edit) it
    follows ``torch.optim.SGD`` with the same change: switched on for the first
    time, its buffer starts from the next gradient; switched off and on again, it
    resumes from the buffer it had (torch's does too; :meth:`reset_state` starts
    it anew).

    Editing a stored hyperparameter tensor in place takes effect at the next
    step, with one exception: it cannot switch momentum or weight decay on for a
    group in which every model had zero when the group was last validated (the
    step then keeps no buffers, or skips the weight decay terms); assign a new
    value or use :meth:`set_hyperparameters` for that. ``foreach``,
    ``differentiable`` and ``fused`` are torch's implementation keywords, see
    :class:`~hfkern.optim.ArrayOptimizer`.
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
            # A buffer without a count was saved by a version that kept none; it
            # has been started for every model with momentum (one without held its
            # last gradient there, which its first update with momentum must not
            # continue from).
            return (group["momentum"] != 0).to(device=p.device, dtype=torch.float32)
        return super()._init_state(key, p, group, state)

    def _place_loaded_state(self):
        super()._place_loaded_state()
        # Counted now, from the momentum saved with the buffers: a momentum set
        # before the next step must not make a buffer that never started look
        # started.
        for group in self.param_groups:
            for p in group["params"]:
                state = self.state.get(p)
                if state and "momentum_buffer" in state and "step" not in state:
                    state["step"] = self._init_state("step", p, group, state)
