"""Array Adagrad: ``torch.optim.Adagrad`` for each of B models, in one op (``hfkern::adagrad_step_``)."""

from __future__ import annotations

from typing import Any, Iterable

import torch

from .._dtypes import acc_dtype
from .._optim_specs import ADAGRAD_SPEC
from ._base import ArrayOptimizer, Hyper

__all__ = ["Adagrad"]


class Adagrad(ArrayOptimizer):
    """Adagrad for B models at once, ``torch.optim.Adagrad`` per model (dense gradients).

    Every parameter is ``[B, ...]`` (model b is index b). ``lr``, ``lr_decay``,
    ``weight_decay``, ``initial_accumulator_value`` and ``eps`` are each a
    float, a length-B sequence, or a ``[B]`` tensor or numpy array, stored in
    ``param_groups`` as ``[B]`` tensors on the parameters' device. State per parameter: ``step``
    (``[B]`` float32, each model's own count, used for its learning-rate decay)
    and ``sum`` (``[B, ...]``, starting at each model's
    ``initial_accumulator_value`` when the parameter first steps). A parameter
    group's own ``initial_accumulator_value`` (given in the group, or in
    :meth:`add_param_group`) is its parameters' starting value;
    ``torch.optim.Adagrad`` starts every group at its constructor's value
    (later groups at its defaults) and ignores a group's.
    ``skip_nonfinite`` and ``step(skip=...)``, and torch's implementation keywords
    ``foreach``, ``differentiable`` and ``fused``: see :class:`~hfkern.optim.ArrayOptimizer`.
    """

    _spec = ADAGRAD_SPEC
    _init_hypers = ("initial_accumulator_value",)
    _compat = ("foreach", "differentiable", "fused")

    def __init__(
        self,
        params: Iterable[torch.Tensor] | Iterable[dict[str, Any]],
        lr: Hyper = 1e-2,
        lr_decay: Hyper = 0,
        weight_decay: Hyper = 0,
        initial_accumulator_value: Hyper = 0,
        eps: Hyper = 1e-10,
        foreach: bool | None = None,
        *,
        maximize: bool = False,
        differentiable: bool = False,
        fused: bool | None = None,
        skip_nonfinite: bool = False,
    ):
        defaults = dict(
            lr=lr, lr_decay=lr_decay, weight_decay=weight_decay,
            initial_accumulator_value=initial_accumulator_value, eps=eps, maximize=maximize,
            foreach=foreach, differentiable=differentiable, fused=fused,
        )
        super().__init__(params, defaults, skip_nonfinite=skip_nonfinite)

    def _init_state(self, key, p, group, state):
        if key == "sum":
            init = group["initial_accumulator_value"]
            out = torch.empty_like(p, dtype=acc_dtype(p.dtype), memory_format=torch.preserve_format)
            return out.copy_(init.view(-1, *([1] * (p.dim() - 1))).expand_as(p))
        return super()._init_state(key, p, group, state)
