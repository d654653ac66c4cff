"""Array SGD: one multi-tensor step updates B models with per-model hyperparameters.

Model b's trajectory is that of ``torch.optim.SGD`` on model b alone. The math
lives in :func:`sgd_step_`, which sees only tensors (parameters, gradients,
momentum buffers ``[B, ...]`` and hyperparameters ``[B]``); the optimizer class
only validates, bookkeeps state and calls it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Iterable, Sequence

import torch
from torch.optim import Optimizer

from .._array import hyper

__all__ = ["SGD", "sgd_step_"]

_HYPERS = ("lr", "momentum", "dampening", "weight_decay")


def _per_model(h: torch.Tensor, tensors: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    """Views of the ``[B]`` tensor ``h`` that broadcast against each ``[B, ...]`` tensor."""
    return [h.view(h.numel(), *([1] * (t.dim() - 1))) for t in tensors]


def sgd_step_(
    params: list[torch.Tensor],
    grads: list[torch.Tensor],
    momentum_buffers: list[torch.Tensor | None],
    *,
    lr: torch.Tensor,
    momentum: torch.Tensor,
    dampening: torch.Tensor,
    weight_decay: torch.Tensor,
    nesterov: bool,
    maximize: bool,
    use_momentum: bool,
    use_weight_decay: bool,
) -> list[torch.Tensor | None]:
    """One SGD step of B models, in place on ``params``; returns the momentum buffers.

    ``params``, ``grads``: lists of ``[B, ...]`` tensors (model b is index b of
    each); ``momentum_buffers``: the matching ``[B, ...]`` buffers, updated in
    place, ``None`` for a parameter that has none yet (its buffer starts as its
    gradient, as in torch). ``lr``, ``momentum``, ``dampening``,
    ``weight_decay``: ``[B]`` tensors on the parameters' device. ``use_momentum``
    and ``use_weight_decay`` say whether any model has a non-zero value; they
    are host-side flags so the step never reads a device value.
    """
    d_p = torch._foreach_neg(grads) if maximize else list(grads)
    if use_weight_decay:
        d_p = torch._foreach_addcmul(d_p, params, _per_model(weight_decay, params))
    if not use_momentum:
        torch._foreach_addcmul_(params, d_p, _per_model(-lr, params))
        return list(momentum_buffers)

    # torch ignores dampening for a model without momentum; with a factor of 1
    # that model's buffer is exactly its gradient, which is what torch steps with.
    keep = 1 - torch.where(momentum == 0, torch.zeros_like(dampening), dampening)
    old = [i for i, b in enumerate(momentum_buffers) if b is not None]
    if old:
        bufs = [momentum_buffers[i] for i in old]
        torch._foreach_mul_(bufs, _per_model(momentum, bufs))
        torch._foreach_addcmul_(bufs, [d_p[i] for i in old], _per_model(keep, bufs))
    buffers = [b if b is not None else d.clone() for b, d in zip(momentum_buffers, d_p)]
    if nesterov:
        d_p = torch._foreach_addcmul(d_p, buffers, _per_model(momentum, buffers))
    else:
        d_p = buffers
    torch._foreach_addcmul_(params, d_p, _per_model(-lr, params))
    return buffers


@dataclass(frozen=True)
class _Checked:
    """What validating a group established, and the values it was established for."""

    values: tuple[Any, ...]  # the group's hyperparameter objects, compared by identity
    use_momentum: bool
    use_weight_decay: bool


class SGD(Optimizer):
    """Stochastic gradient descent for B models at once, ``torch.optim.SGD`` per model.

    Every parameter is ``[B, ...]`` with the same array size B (model b is index b).
    ``lr``, ``momentum``, ``dampening`` and ``weight_decay`` are each a float (all
    models alike), a length-B sequence or a 1-D tensor of length B; they are
    stored in ``param_groups`` as ``[B]`` float tensors on the parameters'
    device (float64 for float64 parameters, float32 otherwise). ``nesterov`` and
    ``maximize`` apply to every model; ``nesterov`` needs momentum > 0 and zero
    dampening for every model, as torch requires per model.

    To change a hyperparameter during training, assign a new value to
    ``group[name]`` (float, sequence or tensor); it is validated at the next
    step. Editing the stored tensor in place also takes effect, but is not
    validated, and cannot switch momentum or weight decay on for a group in
    which every model had zero.

    Momentum buffers are kept for every model of a group in which any model has
    momentum; a model with zero momentum steps with its gradient, as in torch.
    """

    def __init__(
        self,
        params: Iterable[torch.Tensor] | Iterable[dict[str, Any]],
        lr: float | Sequence[float] | torch.Tensor = 1e-3,
        momentum: float | Sequence[float] | torch.Tensor = 0,
        dampening: float | Sequence[float] | torch.Tensor = 0,
        weight_decay: float | Sequence[float] | torch.Tensor = 0,
        nesterov: bool = False,
        *,
        maximize: bool = False,
    ):
        self.B: int | None = None
        self._checked: dict[int, tuple[dict, _Checked]] = {}
        defaults = dict(
            lr=lr, momentum=momentum, dampening=dampening, weight_decay=weight_decay,
            nesterov=nesterov, maximize=maximize,
        )
        super().__init__(params, defaults)

    # ---- validation -----------------------------------------------------
    def add_param_group(self, param_group: dict[str, Any]) -> None:
        """Add a group of ``[B, ...]`` parameters, with optional per-group hyperparameters."""
        B = self.B
        super().add_param_group(param_group)
        group = self.param_groups[-1]
        try:
            self._check_group(group)
        except Exception:
            self.param_groups.pop()
            self.B = B
            raise

    def _check_params(self, group: dict[str, Any]) -> torch.Tensor:
        params = group["params"]
        for i, p in enumerate(params):
            if p.dim() == 0:
                raise ValueError(
                    f"SGD: expected array parameters of shape [B, ...], got a 0-d tensor at index {i}"
                )
            if self.B is None:
                self.B = p.size(0)
            if p.size(0) != self.B:
                raise ValueError(
                    f"SGD: every parameter must have the same leading (array) dim B={self.B}, "
                    f"got shape {list(p.shape)} at index {i}"
                )
            if p.device != params[0].device:
                raise ValueError(
                    f"SGD: the parameters of a group must share one device, got {params[0].device} "
                    f"and {p.device}"
                )
        return params[0]

    def _check_group(self, group: dict[str, Any]) -> _Checked:
        """Validate ``group`` (once per set of values) and store its hyperparameters as [B] tensors."""
        cached = self._checked.get(id(group))
        values = tuple(group[k] for k in _HYPERS)
        if cached is not None and cached[0] is group and all(
            a is b for a, b in zip(cached[1].values, values)
        ):
            return cached[1]
        if not group["params"]:
            raise ValueError("SGD: a parameter group has no parameters")
        first = self._check_params(group)
        per_model = {k: hyper(group[k], self.B, k) for k in _HYPERS}
        for k in ("nesterov", "maximize"):
            if not isinstance(group[k], bool):
                raise TypeError(f"SGD: {k} must be a bool, got {type(group[k]).__name__} {group[k]!r}")
        if group["nesterov"]:
            bad = ((per_model["momentum"] <= 0) | (per_model["dampening"] != 0)).nonzero().flatten()
            if bad.numel():
                raise ValueError(
                    "SGD: Nesterov momentum requires a momentum and zero dampening for every model; "
                    f"models {bad.tolist()} have momentum "
                    f"{per_model['momentum'][bad].tolist()} and dampening {per_model['dampening'][bad].tolist()}"
                )
        dtype = (
            torch.float64 if all(p.dtype == torch.float64 for p in group["params"]) else torch.float32
        )
        for k in _HYPERS:
            group[k] = per_model[k].to(device=first.device, dtype=dtype)
        checked = _Checked(
            values=tuple(group[k] for k in _HYPERS),
            use_momentum=bool((per_model["momentum"] != 0).any()),
            use_weight_decay=bool((per_model["weight_decay"] != 0).any()),
        )
        self._checked[id(group)] = (group, checked)
        return checked

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Load a state from :meth:`state_dict`; hyperparameters move to the parameters' device."""
        super().load_state_dict(state_dict)
        self._checked = {}
        for group in self.param_groups:
            self._check_group(group)

    # ---- step -----------------------------------------------------------
    @torch.no_grad()
    def step(self, closure: Callable[[], torch.Tensor] | None = None) -> torch.Tensor | None:
        """One step of every model; ``closure`` re-evaluates and returns the loss (e.g. ``[B]``)."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            checked = self._check_group(group)
            params, grads, buffers = [], [], []
            for p in group["params"]:
                if p.grad is None:
                    continue
                if p.grad.is_sparse:
                    raise RuntimeError("SGD: sparse gradients are not supported for array parameters")
                params.append(p)
                grads.append(p.grad)
                buffers.append(self.state[p].get("momentum_buffer"))
            if not params:
                continue
            buffers = sgd_step_(
                params, grads, buffers,
                lr=group["lr"], momentum=group["momentum"], dampening=group["dampening"],
                weight_decay=group["weight_decay"], nesterov=group["nesterov"],
                maximize=group["maximize"], use_momentum=checked.use_momentum,
                use_weight_decay=checked.use_weight_decay,
            )
            if checked.use_momentum:
                for p, buf in zip(params, buffers):
                    self.state[p]["momentum_buffer"] = buf
        return loss
