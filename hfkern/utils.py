"""Per-model gradient clipping: ``torch.nn.utils``' clipping applied to each of B models.

Every parameter (and gradient) is ``[B, ...]``; model b's gradient is the slice
``[b]`` of every gradient. :func:`clip_grad_norm_` clips model b exactly as
``torch.nn.utils.clip_grad_norm_`` would clip model b alone: its total norm is
taken over its own slices only, and its clip coefficient is torch's
``min(max_norm[b] / (total_norm[b] + 1e-6), 1)``. Models never mix, so a model
whose gradients hold inf or NaN gets an inf/NaN norm and leaves the others
exactly as they would be without it.

Per-model values (``max_norm``, ``clip_value``) are a float (or numpy scalar),
a length-B sequence, or a ``[B]`` tensor or numpy array. Nothing here reads a
device value on the host, except ``error_if_nonfinite=True`` (as torch's) and
the first use of a device tensor of per-model values, which is validated once
and again only after it is modified in place.
"""

from __future__ import annotations

import numbers
from typing import Iterable, Sequence

import torch
from torch import Tensor
from torch.utils._foreach_utils import _device_has_foreach_support
from torch.utils.weak import WeakIdKeyDictionary

from ._array import hyper

__all__ = ["clip_grad_norm_", "clip_grad_value_", "get_total_norm", "clip_grads_with_norm_"]

Tensors = Tensor | Iterable[Tensor]
PerModel = float | Sequence[float] | Tensor

# Device tensors of per-model values already validated: tensor -> (its version counter, B).
_validated: WeakIdKeyDictionary = WeakIdKeyDictionary()


def _host_to_device(t: Tensor, device: torch.device) -> Tensor:
    """Copy a host tensor to ``device`` without waiting for the device's queued work."""
    if device.type == "cuda":
        return t.pin_memory().to(device, non_blocking=True)
    return t.to(device)


def _per_model(fn: str, value: PerModel, B: int, name: str, device: torch.device,
               dtype: torch.dtype) -> float | Tensor:
    """Validate a per-model value; a Python float when it is one (torch's own scalar
    arithmetic), else a ``[B]`` tensor of ``dtype`` on ``device``."""
    try:
        if isinstance(value, Tensor) and value.device.type != "cpu":
            if value.dim() > 1 or (value.dim() == 1 and value.numel() != B):
                raise ValueError(
                    f"{name} must have one value per model (length B={B}), got shape {list(value.shape)}"
                )
            # Reading a device tensor waits for the device: do it once per in-place version
            # (a meta tensor has no values to read).
            if value.device.type != "meta" and _validated.get(value) != (value._version, B):
                hyper(value, B, name)
                _validated[value] = (value._version, B)
            t = value.detach().to(device=device, dtype=dtype)
            return t.expand(B) if t.dim() == 0 else t
        checked = hyper(value, B, name)
    except (TypeError, ValueError) as e:
        raise type(e)(f"{fn}: {e}") from None
    if isinstance(value, numbers.Real):  # Python and numpy scalars: torch's own scalar arithmetic
        return float(value)
    return _host_to_device(checked.to(dtype), device)


def _tensor_list(fn: str, tensors: Tensors, what: str) -> list[Tensor]:
    if isinstance(tensors, Tensor):
        return [tensors]
    try:
        out = list(tensors)
    except TypeError:
        raise TypeError(
            f"{fn}: expected a tensor or an iterable of tensors as {what}s, got {type(tensors).__name__}"
        ) from None
    for i, t in enumerate(out):
        if not isinstance(t, Tensor):
            raise TypeError(f"{fn}: expected {what}s to be tensors, got {type(t).__name__} at index {i}")
    return out


def _array_dim(fn: str, tensors: Sequence[Tensor], what: str) -> int:
    """The common leading (array) dim B of ``tensors``."""
    if not tensors:
        raise ValueError(f"{fn}: expected at least one {what} of shape [B, ...], got none")
    B = None
    for i, t in enumerate(tensors):
        if t.dim() == 0:
            raise ValueError(
                f"{fn}: expected array {what}s of shape [B, ...], got a 0-d tensor at index {i}"
            )
        if B is None:
            B = t.size(0)
        elif t.size(0) != B:
            raise ValueError(
                f"{fn}: every {what} must have the same leading (array) dim B={B}, "
                f"got shape {list(t.shape)} at index {i}"
            )
    return B


def _grads_of(fn: str, params: Sequence[Tensor]) -> list[Tensor]:
    grads = [p.grad for p in params if p.grad is not None]
    for g in grads:
        if g.is_sparse:
            raise RuntimeError(f"{fn}: sparse gradients are not supported for array parameters")
    return grads


def _check_foreach(fn: str, foreach: bool | None, tensors: Sequence[Tensor]) -> bool:
    """Whether to use the foreach ops, with torch's rules for ``foreach``."""
    if foreach is not None and not isinstance(foreach, bool):
        raise TypeError(f"{fn}: foreach must be a bool or None, got {type(foreach).__name__} {foreach!r}")
    supported = all(_device_has_foreach_support(t.device) for t in tensors)
    if foreach and not supported:
        devices = sorted({t.device.type for t in tensors})
        raise RuntimeError(
            f"{fn}: foreach=True was passed, but can't use the foreach API on {devices} tensors"
        )
    return supported if foreach is None else foreach


def _norm_type(fn: str, norm_type: float | str) -> float:
    try:
        return float(norm_type)
    except (TypeError, ValueError):
        raise TypeError(f"{fn}: norm_type must be a float (e.g. 2.0 or inf), got {norm_type!r}") from None


def _per_model_shape(B: int, t: Tensor) -> tuple[int, ...]:
    """The shape that broadcasts a ``[B]`` tensor against ``t`` ([B, ...])."""
    return (B,) + (1,) * (t.dim() - 1)


def _model_norms(t: Tensor, norm_type: float) -> Tensor:
    """``[B]``: the norm of each model's slice of ``t`` ([B, ...]), in ``t``'s dtype."""
    if t.dim() == 1:
        # An empty dim list would reduce over every dim: give each model its one element as a row.
        return torch.linalg.vector_norm(t.unsqueeze(1), norm_type, dim=1)
    return torch.linalg.vector_norm(t, norm_type, dim=tuple(range(1, t.dim())))


@torch.no_grad()
def get_total_norm(
    tensors: Tensors,
    norm_type: float = 2.0,
    error_if_nonfinite: bool = False,
    foreach: bool | None = None,
) -> Tensor:
    """Each model's norm of ``tensors``: ``torch.nn.utils.get_total_norm`` per model.

    ``tensors``: a ``[B, ...]`` tensor or an iterable of them (one common B).
    Returns a ``[B]`` tensor on the first tensor's device, in the promoted dtype
    of the tensors: entry b is the ``norm_type``-norm of the slices ``[b]`` of all
    tensors viewed as one vector (computed, as torch does, as the norm of the
    per-tensor norms). ``error_if_nonfinite``: raise a RuntimeError naming the
    models whose norm is inf or NaN (reads the norms on the host).
    ``foreach`` is validated with torch's rules; the norms are per-tensor
    reductions over each model's slice either way.
    """
    fn = "get_total_norm"
    tensors = _tensor_list(fn, tensors, "tensor")
    _array_dim(fn, tensors, "tensor")
    norm_type = _norm_type(fn, norm_type)
    _check_foreach(fn, foreach, tensors)
    return _total_norm(fn, tensors, norm_type, error_if_nonfinite)


def _total_norm(fn: str, grads: Sequence[Tensor], norm_type: float, error_if_nonfinite: bool) -> Tensor:
    first = grads[0].device
    norms = [_model_norms(g, norm_type).to(first) for g in grads]
    # [B, n] rows: each model's per-tensor norms side by side, as torch stacks them for one model.
    total = torch.linalg.vector_norm(torch.stack(norms, dim=1), norm_type, dim=1)
    if error_if_nonfinite:
        bad = ~torch.isfinite(total)
        if bool(bad.any()):
            models = bad.nonzero().flatten().tolist()
            raise RuntimeError(
                f"{fn}: the total norm of order {norm_type} of the gradients of models {models} is "
                f"non-finite ({total[bad].tolist()}), so they cannot be clipped. To disable this "
                f"error and scale those models' gradients by the non-finite norm anyway, set "
                f"error_if_nonfinite=False"
            )
    return total


@torch.no_grad()
def clip_grads_with_norm_(
    parameters: Tensors,
    max_norm: PerModel,
    total_norm: Tensor,
    foreach: bool | None = None,
) -> None:
    """Scale each model's gradients by ``min(max_norm[b] / (total_norm[b] + 1e-6), 1)``, in place.

    ``torch.nn.utils.clip_grads_with_norm_`` per model. ``parameters``: ``[B, ...]``
    tensors (one common B) whose ``.grad`` is scaled; ``max_norm``: a float, a
    length-B sequence or a ``[B]`` tensor or numpy array (each >= 0); ``total_norm``: ``[B]``,
    e.g. from :func:`get_total_norm`.
    """
    fn = "clip_grads_with_norm_"
    params = _tensor_list(fn, parameters, "parameter")
    B = _array_dim(fn, params, "parameter")
    _clip_with_norm(fn, params, _grads_of(fn, params), max_norm, total_norm, B, foreach)


def _clip_with_norm(fn: str, params: Sequence[Tensor], grads: list[Tensor], max_norm: PerModel,
                    total_norm: Tensor, B: int, foreach: bool | None) -> None:
    if not isinstance(total_norm, Tensor) or total_norm.shape != (B,):
        got = list(total_norm.shape) if isinstance(total_norm, Tensor) else type(total_norm).__name__
        raise ValueError(f"{fn}: expected total_norm of shape [B]=[{B}] (one norm per model), got {got}")
    device = total_norm.device
    # torch multiplies by a Python float, which a reduced-precision kernel reads in float32.
    wide = total_norm.dtype if total_norm.dtype in (torch.float32, torch.float64) else torch.float32
    max_norm = _per_model(fn, max_norm, B, "max_norm", device, wide)
    use_foreach = _check_foreach(fn, foreach, grads)
    if not grads:
        return
    # torch computes max_norm / (total_norm + 1e-6) as reciprocal() * max_norm.
    clip_coef = ((total_norm + 1e-6).reciprocal() * max_norm).to(total_norm.dtype)
    # Clamping instead of branching on clip_coef < 1 keeps the device's values on the device.
    clip_coef_clamped = torch.clamp(clip_coef, max=1.0)
    coefs = [clip_coef_clamped.to(g.device).view(_per_model_shape(B, g)) for g in grads]
    if use_foreach:
        torch._foreach_mul_(grads, coefs)
    else:
        for g, c in zip(grads, coefs):
            g.mul_(c)


@torch.no_grad()
def clip_grad_norm_(
    parameters: Tensors,
    max_norm: PerModel,
    norm_type: float = 2.0,
    error_if_nonfinite: bool = False,
    foreach: bool | None = None,
) -> Tensor:
    """Clip each model's gradient norm: ``torch.nn.utils.clip_grad_norm_`` per model.

    Args:
        parameters: a ``[B, ...]`` tensor or an iterable of them, one common B;
            their ``.grad`` (same shape) are modified in place.
        max_norm: each model's max norm: a float, a length-B sequence, or a ``[B]``
            tensor or numpy array (>= 0, not NaN).
        norm_type: the p of the p-norm (``inf`` for the max norm).
        error_if_nonfinite: raise a RuntimeError naming the models whose total
            norm is inf or NaN (this reads the norms on the host).
        foreach: torch's option; None uses the foreach ops where the device has
            them, True requires them.

    Returns:
        ``[B]``: each model's total gradient norm before clipping (all of model
        b's gradient slices viewed as one vector). Model b's gradients are
        multiplied by ``min(max_norm[b] / (total_norm[b] + 1e-6), 1)``.
    """
    fn = "clip_grad_norm_"
    params = _tensor_list(fn, parameters, "parameter")
    B = _array_dim(fn, params, "parameter")
    norm_type = _norm_type(fn, norm_type)
    grads = _grads_of(fn, params)
    _check_foreach(fn, foreach, grads)
    if not grads:
        _per_model(fn, max_norm, B, "max_norm", params[0].device, torch.float32)
        return torch.zeros(B, device=params[0].device)
    total_norm = _total_norm(fn, grads, norm_type, error_if_nonfinite)
    _clip_with_norm(fn, params, grads, max_norm, total_norm, B, foreach)
    return total_norm


@torch.no_grad()
def clip_grad_value_(
    parameters: Tensors,
    clip_value: PerModel,
    foreach: bool | None = None,
) -> None:
    """Clamp each model's gradients to ``[-clip_value[b], clip_value[b]]``, in place.

    ``torch.nn.utils.clip_grad_value_`` per model. ``parameters``: a ``[B, ...]``
    tensor or an iterable of them (one common B); ``clip_value``: a float, a
    length-B sequence or a ``[B]`` tensor or numpy array (>= 0, not NaN). NaN gradients stay NaN.
    """
    fn = "clip_grad_value_"
    params = _tensor_list(fn, parameters, "parameter")
    B = _array_dim(fn, params, "parameter")
    grads = _grads_of(fn, params)
    use_foreach = _check_foreach(fn, foreach, grads)
    device = grads[0].device if grads else params[0].device
    value = _per_model(fn, clip_value, B, "clip_value", device, torch.float64)
    if not grads:
        return
    if isinstance(value, float):
        if use_foreach:
            torch._foreach_clamp_min_(grads, -value)
            torch._foreach_clamp_max_(grads, value)
        else:
            for g in grads:
                g.clamp_(min=-value, max=value)
        return
    # Bounds in each gradient's dtype: the rounding torch applies to its Python scalar.
    bounds: dict[tuple[torch.device, torch.dtype], Tensor] = {}
    highs, lows = [], []
    for g in grads:
        key = (g.device, g.dtype)
        if key not in bounds:
            bounds[key] = value.to(device=g.device, dtype=g.dtype)
        high = bounds[key].view(_per_model_shape(B, g))
        highs.append(high)
        lows.append(-high)
    if use_foreach:
        torch._foreach_clamp_min_(grads, lows)
        torch._foreach_clamp_max_(grads, highs)
    else:
        for g, lo, hi in zip(grads, lows, highs):
            g.clamp_(min=lo, max=hi)
