"""Array losses: the losses of B models in one pass, one loss per model.

Every function mirrors its ``torch.nn.functional`` namesake (same keyword
arguments, without the deprecated ``size_average``/``reduce``) on array tensors.

Shapes
    ``input`` has the array dim first: ``[B, *s]`` holds B models' inputs of
    torch's shape ``s``. For :func:`cross_entropy` and :func:`nll_loss` that is
    ``[B, N, C, d1, ..., dK]`` (K >= 0), or ``[B, C]`` for unbatched models.

Targets (shared or per model)
    A target is *shared* when it has torch's per-model target shape (every
    model gets the same target) and *per model* when it has that shape with a
    leading ``B``. Anything else raises ValueError. For :func:`cross_entropy`
    the dtype decides the kind, as in torch: an integer target holds class
    indices (``[N, d1, ...]`` shared, ``[B, N, d1, ...]`` per model; ``[]`` /
    ``[B]`` for unbatched models), a floating one class probabilities
    (``[N, C, d1, ...]`` shared, ``[B, N, C, d1, ...]`` per model).

Weights
    The class ``weight`` of :func:`cross_entropy` and :func:`nll_loss` is
    ``[C]`` (shared) or ``[B, C]`` (per model). The ``weight`` and
    ``pos_weight`` of :func:`binary_cross_entropy_with_logits` broadcast
    against the array input ``[B, *s]`` by the usual right-aligned rule, so a
    torch-shaped weight (fewer dims than ``input``) is shared, and a per-model
    weight has as many dims as ``input`` with ``B`` (or 1) in front: for
    ``input [B, N, C]`` a per-model ``pos_weight`` is ``[B, 1, C]``.

Autocast
    Inside a ``torch.autocast`` region for the input's device type every loss
    here follows torch's autocast policy for it ("fp32"): bfloat16, float16 and
    float32 tensors (input, floating targets, weights) are cast to float32, and
    the loss is computed and returned in float32; float64 and integer tensors
    are left as they are. So float32 class weights go with bfloat16 logits there,
    as in torch, and the result is float32 whatever the logits' dtype. Outside
    autocast the dtypes are torch's: class weights for class-index targets must
    have the input's dtype (torch refuses others too); with class-probability
    targets a floating weight of any dtype takes part by type promotion.

Reductions
    ``'mean'`` and ``'sum'`` return ``[B]``: entry b is exactly torch's loss for
    model b alone (weighted-mean denominators, ``ignore_index``, label
    smoothing; a model whose targets are all ignored gets NaN, as in torch).
    ``'none'`` returns ``[B, *torch's 'none' shape]``. So
    ``losses.sum().backward()`` gives every model its own gradient.
"""

from __future__ import annotations

from typing import Callable, Sequence

import torch
import torch.nn.functional as F

from .._array import is_shared, per_model_memory_first
from ..ops._autocast import _cast as _autocast_cast
from ..ops.embedding import embedding_checked_indices, raise_if_out_of_range

__all__ = [
    "binary_cross_entropy_with_logits",
    "cross_entropy",
    "l1_loss",
    "mse_loss",
    "nll_loss",
]

_REDUCTIONS = ("none", "mean", "sum")


# ---- argument checks --------------------------------------------------------

def _check_reduction(fn: str, reduction: object) -> str:
    if not isinstance(reduction, str) or reduction not in _REDUCTIONS:
        raise ValueError(f"{fn}: expected reduction 'none', 'mean' or 'sum', got {reduction!r}")
    return reduction


def _check_tensor(fn: str, name: str, t: object) -> torch.Tensor:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{fn}: expected {name} to be a torch.Tensor, got {type(t).__name__}")
    return t


def _check_input(fn: str, input: object, min_dim: int, shapes: str) -> torch.Tensor:
    x = _check_tensor(fn, "input", input)
    if x.dim() < min_dim:
        raise ValueError(f"{fn}: expected input of shape {shapes} (array dim first), got shape {list(x.shape)}")
    if not x.is_floating_point():
        raise TypeError(f"{fn}: expected a floating-point input, got {x.dtype}")
    return x


def _fp32_under_autocast(x: torch.Tensor, *tensors: object) -> tuple:
    """``(x, *tensors)`` as torch's autocast hands them to its losses ("fp32" policy: every
    loss of this module is on torch's float32 list): inside an autocast region for ``x``'s
    device type, bfloat16, float16 and float32 tensors on that device type as float32
    (float64, integer and other tensors unchanged); outside one, all unchanged."""
    device_type = x.device.type
    if not torch.is_autocast_enabled(device_type):
        return (x, *tensors)
    return tuple(_autocast_cast(t, device_type, torch.float32) for t in (x, *tensors))


def _check_device(fn: str, name: str, t: torch.Tensor, x: torch.Tensor) -> None:
    if t.device != x.device:
        raise ValueError(f"{fn}: expected {name} on the input's device {x.device}, got {t.device}")


def _array_target(fn: str, target: torch.Tensor, model_shape: Sequence[int], x: torch.Tensor,
                  name: str = "target") -> torch.Tensor:
    """``target`` (or another tensor ``name`` of the target's shape) as ``[1 or B, *model_shape]``:
    shared ones get a size-1 array dim."""
    B, model_shape, shape = x.size(0), list(model_shape), list(target.shape)
    _check_device(fn, name, target, x)
    if shape == model_shape:
        return target.unsqueeze(0)
    if shape == [B] + model_shape:
        return target
    if len(shape) == len(model_shape) + 1 and shape[1:] == model_shape:
        raise ValueError(
            f"{fn}: expected a per-model {name} with leading (array) dim B={B} (the input's), "
            f"got shape {shape} for input of shape {list(x.shape)}"
        )
    raise ValueError(
        f"{fn}: expected {name} of shape {model_shape} (shared by all models) or {[B] + model_shape} "
        f"(per model), got shape {shape} for input of shape {list(x.shape)}"
    )


def _check_class_weight(fn: str, weight: object, x: torch.Tensor, C: int,
                        promotes: bool = False) -> torch.Tensor | None:
    """``weight`` checked: ``[C]`` or ``[B, C]``, on the input's device, of its dtype
    (``promotes``, for class-probability targets: any floating dtype, as torch's loss
    multiplies it in with type promotion there)."""
    if weight is None:
        return None
    w = _check_tensor(fn, "weight", weight)
    B = x.size(0)
    if w.dim() == 2 and w.size(1) == C and w.size(0) != B:
        raise ValueError(
            f"{fn}: expected a per-model weight with leading (array) dim B={B} (the input's), "
            f"got shape {list(w.shape)}"
        )
    if not (w.dim() == 1 and w.size(0) == C) and not (w.dim() == 2 and w.size(1) == C):
        raise ValueError(
            f"{fn}: expected weight of shape [{C}] (one per class, shared) or [{B}, {C}] (per model), "
            f"got shape {list(w.shape)}"
        )
    _check_device(fn, "weight", w, x)
    if w.dtype != x.dtype and not (promotes and w.is_floating_point()):
        expected = "a floating-point weight" if promotes else f"weight of the input's dtype {x.dtype}"
        raise TypeError(f"{fn}: expected {expected}, got {w.dtype}")
    return w


def _check_broadcast_weight(fn: str, name: str, weight: object, x: torch.Tensor) -> torch.Tensor | None:
    if weight is None:
        return None
    w = _check_tensor(fn, name, weight)
    B = x.size(0)
    if w.dim() == x.dim() and w.size(0) not in (1, B):
        raise ValueError(
            f"{fn}: expected a per-model {name} with leading (array) dim B={B} (the input's) or 1, "
            f"got shape {list(w.shape)} for input of shape {list(x.shape)}"
        )
    try:
        fits = list(torch.broadcast_shapes(w.shape, x.shape)) == list(x.shape)
    except RuntimeError:
        fits = False
    if not fits:
        raise ValueError(
            f"{fn}: expected {name} broadcastable to the input's shape {list(x.shape)} (torch's shape "
            f"for a shared one, [B, ...] with {x.dim()} dims for a per-model one), got shape {list(w.shape)}"
        )
    _check_device(fn, name, w, x)
    return w


# ---- per-model reductions ---------------------------------------------------

def _per_model_sum(loss: torch.Tensor) -> torch.Tensor:
    # An empty dim list would reduce every dim, the array dim included.
    return loss if loss.dim() == 1 else loss.sum(dim=tuple(range(1, loss.dim())))


def _reduce_elementwise(loss: torch.Tensor, reduction: str) -> torch.Tensor:
    if reduction == "none":
        return loss
    if reduction == "sum":
        return _per_model_sum(loss)
    # torch's mean of an empty loss is NaN; so is .mean over empty dims.
    return loss if loss.dim() == 1 else loss.mean(dim=tuple(range(1, loss.dim())))


def _fold_pair(x: torch.Tensor, t: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, Callable]:
    """Merge the array and batch dims of ``x`` ([B, N, ...]) and ``t`` ([B, N, ...]) alike.

    ``x`` is folded in its own memory order (a free view when it is ``[B, N]``-
    or ``[N, B]``-contiguous); ``t`` follows that order. Returns the folded pair
    and ``unfold`` mapping a ``[B*N or N*B, ...]`` result back to ``[B, N, ...]``.
    """
    B, N = x.shape[:2]
    if per_model_memory_first(x) and not is_shared(x):
        xf = x.transpose(0, 1).reshape(N * B, *x.shape[2:])
        tf = t.transpose(0, 1).reshape(N * B, *t.shape[2:])
        return xf, tf, lambda y: y.view(N, B, *y.shape[1:]).transpose(0, 1)
    xf = x.reshape(B * N, *x.shape[2:])
    tf = t.reshape(B * N, *t.shape[2:])
    return xf, tf, lambda y: y.view(B, N, *y.shape[1:])


# ---- class-index and class-probability losses -------------------------------

def _check_smoothing(fn: str, label_smoothing: object) -> float:
    if isinstance(label_smoothing, bool) or not isinstance(label_smoothing, (int, float)):
        raise TypeError(f"{fn}: expected label_smoothing to be a float, got {type(label_smoothing).__name__}")
    if not 0.0 <= label_smoothing <= 1.0:
        raise ValueError(f"{fn}: expected label_smoothing between 0.0 and 1.0, got {label_smoothing}")
    return float(label_smoothing)


def _check_ignore_index(fn: str, ignore_index: object) -> int:
    if isinstance(ignore_index, bool) or not isinstance(ignore_index, int):
        raise TypeError(f"{fn}: expected ignore_index to be an int, got {type(ignore_index).__name__}")
    return ignore_index


def _class_index_loss(fn: str, x: torch.Tensor, target: torch.Tensor, weight: torch.Tensor | None,
                      ignore_index: int, reduction: str, label_smoothing: float,
                      from_logits: bool) -> torch.Tensor:
    unbatched = x.dim() == 2
    B = x.size(0)
    model_shape = [] if unbatched else [x.size(1), *x.shape[3:]]
    t = _array_target(fn, target, model_shape, x)
    if unbatched:  # one model's [C] is a batch of one: [B, 1, C], target [1|B, 1]
        x, t = x.unsqueeze(1), t.unsqueeze(1)
    C = x.size(2)
    t = t.long()
    valid = t != ignore_index  # [1|B, N, *d]
    # the class index of every target, ignored ones as class 0: only class weights read it
    t_safe = None if weight is None else t.masked_fill(~valid, 0)

    if weight is None or weight.dim() == 1:
        # torch's own kernel on the folded array: each element exactly torch's.
        xf, tf, unfold = _fold_pair(x, t.expand(B, *t.shape[1:]))
        if from_logits:
            lf = F.cross_entropy(xf, tf, weight, ignore_index=ignore_index, reduction="none",
                                 label_smoothing=label_smoothing)
        else:
            lf = F.nll_loss(xf, tf, weight, ignore_index=ignore_index, reduction="none")
        loss = unfold(lf)
        w_t = None if weight is None else weight[t_safe].masked_fill(~valid, 0)
    else:
        # torch takes one [C] weight, so per-model weights use the same math spelled out.
        # gather would index past the classes with a target torch refuses: the same
        # IndexError as torch's (the model named; on CUDA a device-side assertion).
        # (under torch.compile in an op the compiler does not trace, as Embedding's check)
        check = (f"hfkern.nn.functional.{fn}", "target", "classes")
        if torch.compiler.is_compiling():
            t_safe = embedding_checked_indices(t_safe, C, t.size(0) == 1, *check)
        else:
            raise_if_out_of_range(check[0], t_safe, C, t.size(0) == 1, item=check[1], limit=check[2])
        logp = torch.log_softmax(x, dim=2) if from_logits else x
        tx = t_safe.expand(B, *t.shape[1:])
        picked = logp.gather(2, tx.unsqueeze(2)).squeeze(2)
        w_t = weight.gather(1, tx.reshape(B, -1)).view(tx.shape).masked_fill(~valid, 0)
        loss = torch.where(valid, -picked * w_t, 0.0)
        if label_smoothing > 0.0:
            w_b = weight.view(B, 1, C, *([1] * (x.dim() - 3)))
            smooth = -(logp * w_b).sum(2).masked_fill(~valid, 0.0)
            loss = (1 - label_smoothing) * loss + smooth * (label_smoothing / C)

    if reduction == "none":
        return loss.squeeze(1) if unbatched else loss
    total = _per_model_sum(loss)
    if reduction == "sum":
        return total
    # torch divides by the summed class weights of the non-ignored targets
    # (their count without weights), for the smoothing term too; 0/0 gives NaN.
    if w_t is None and valid.size(0) == 1:
        # A shared target's count is one number for every model: counted once
        # (an all-element count, without a per-model reduction over a bool tensor).
        return total / valid.count_nonzero()
    return total / _per_model_sum(valid if w_t is None else w_t)


def _class_prob_loss(fn: str, x: torch.Tensor, target: torch.Tensor, weight: torch.Tensor | None,
                     reduction: str, label_smoothing: float) -> torch.Tensor:
    unbatched = x.dim() == 2
    t = _array_target(fn, target, x.shape[1:], x)  # broadcasts; never copied to [B, ...]
    if unbatched:
        x, t = x.unsqueeze(1), t.unsqueeze(1)
    C = x.size(2)
    logp = torch.log_softmax(x, dim=2)
    if label_smoothing > 0.0:
        t = t * (1 - label_smoothing) + label_smoothing / C
    prod = logp * t
    if weight is not None:
        prod = prod * weight.view(-1, 1, C, *([1] * (x.dim() - 3)))  # [1|B, 1, C, 1...]
    loss = -prod.sum(2)  # [B, N, *d]
    if unbatched and reduction == "none":
        return loss.squeeze(1)
    return _reduce_elementwise(loss, reduction)


def cross_entropy(input: torch.Tensor, target: torch.Tensor, weight: torch.Tensor | None = None,
                  ignore_index: int = -100, reduction: str = "mean",
                  label_smoothing: float = 0.0) -> torch.Tensor:
    """Per-model ``torch.nn.functional.cross_entropy`` of B models.

    Args:
        input: logits ``[B, N, C, d1, ..., dK]``, or ``[B, C]`` for unbatched models.
        target: class indices (integer dtype) ``[N, d1, ...]`` shared or
            ``[B, N, d1, ...]`` per model (``[]`` / ``[B]`` for unbatched models),
            or class probabilities (floating dtype) of ``input``'s per-model shape
            (shared) or of ``input``'s shape (per model).
        weight: class weights ``[C]`` (shared) or ``[B, C]`` (per model).
        ignore_index: class index whose targets contribute neither loss nor
            weight (class-index targets only).
        reduction: ``'mean'`` / ``'sum'`` give ``[B]``; ``'none'`` gives
            ``[B, N, d1, ...]`` (``[B]`` for unbatched models).
        label_smoothing: in ``[0, 1]``, as in torch.

    Returns:
        Entry b (or slice b) equals torch's loss for model b alone. For bfloat16
        or float16 logits, a ``'mean'`` or ``'sum'`` entry may differ from it by
        a few units in the last place of that dtype: each model's losses are
        reduced by torch's ``sum``/``mean``, which accumulate in float32, not by
        the loss kernel's own reduction (hfkern's value is the nearer to the
        float64 loss).
    """
    fn = "cross_entropy"
    reduction = _check_reduction(fn, reduction)
    x = _check_input(fn, input, 2, "[B, C] or [B, N, C, d1, ...]")
    target = _check_tensor(fn, "target", target)
    ignore_index = _check_ignore_index(fn, ignore_index)
    label_smoothing = _check_smoothing(fn, label_smoothing)
    x, target, weight = _fp32_under_autocast(x, target, weight)
    C = x.size(1 if x.dim() == 2 else 2)
    weight = _check_class_weight(fn, weight, x, C, promotes=target.is_floating_point())
    if target.is_floating_point():
        if ignore_index >= 0:
            raise ValueError(
                f"{fn}: ignore_index is not supported with class-probability (floating) targets; "
                f"expected a negative ignore_index, got {ignore_index}"
            )
        return _class_prob_loss(fn, x, target, weight, reduction, label_smoothing)
    if target.dtype == torch.bool or target.is_complex():
        raise TypeError(
            f"{fn}: expected an integer target (class indices) or a floating one (class "
            f"probabilities), got {target.dtype}"
        )
    return _class_index_loss(fn, x, target, weight, ignore_index, reduction, label_smoothing, True)


def nll_loss(input: torch.Tensor, target: torch.Tensor, weight: torch.Tensor | None = None,
             ignore_index: int = -100, reduction: str = "mean") -> torch.Tensor:
    """Per-model ``torch.nn.functional.nll_loss`` of B models.

    Args:
        input: log-probabilities ``[B, N, C, d1, ..., dK]``, or ``[B, C]`` for
            unbatched models.
        target: integer class indices ``[N, d1, ...]`` shared or
            ``[B, N, d1, ...]`` per model (``[]`` / ``[B]`` for unbatched models).
        weight: class weights ``[C]`` (shared) or ``[B, C]`` (per model).
        ignore_index: class index whose targets contribute neither loss nor weight.
        reduction: ``'mean'`` / ``'sum'`` give ``[B]``; ``'none'`` gives
            ``[B, N, d1, ...]`` (``[B]`` for unbatched models).
    """
    fn = "nll_loss"
    reduction = _check_reduction(fn, reduction)
    x = _check_input(fn, input, 2, "[B, C] or [B, N, C, d1, ...]")
    target = _check_tensor(fn, "target", target)
    ignore_index = _check_ignore_index(fn, ignore_index)
    x, weight = _fp32_under_autocast(x, weight)
    weight = _check_class_weight(fn, weight, x, x.size(1 if x.dim() == 2 else 2))
    if target.is_floating_point() or target.is_complex() or target.dtype == torch.bool:
        raise TypeError(f"{fn}: expected an integer target (class indices), got {target.dtype}")
    return _class_index_loss(fn, x, target, weight, ignore_index, reduction, 0.0, False)


# ---- element-wise losses ------------------------------------------------------

def _elementwise_target(fn: str, target: object, x: torch.Tensor) -> torch.Tensor:
    t = _check_tensor(fn, "target", target)
    if not t.is_floating_point():
        raise TypeError(f"{fn}: expected a floating-point target, got {t.dtype}")
    return _array_target(fn, t, x.shape[1:], x).expand_as(x)


def _elementwise_weight(fn: str, weight: object, x: torch.Tensor) -> torch.Tensor | None:
    """An element-wise loss's ``weight``: a model's input shape ``s`` (shared) or ``[B, *s]`` (per
    model), as ``[1 or B, *s]``; torch's loss takes only the input's own shape."""
    if weight is None:
        return None
    w = _check_tensor(fn, "weight", weight)
    if w.is_complex():
        raise TypeError(f"{fn}: expected a real weight, got {w.dtype}")
    return _array_target(fn, w, x.shape[1:], x, "weight")


def _weighted_elementwise(loss: torch.Tensor, w: torch.Tensor | None, reduction: str) -> torch.Tensor:
    """``loss`` ([B, *s], unreduced) reduced per model; with weights ``w``, as torch weighs: each
    element times its weight, the mean divided by the summed weights."""
    if w is None:
        return _reduce_elementwise(loss, reduction)
    loss = loss * w
    if reduction == "none":
        return loss
    summed = _per_model_sum(loss)
    return summed if reduction == "sum" else summed / _per_model_sum(w.expand(loss.shape))


def mse_loss(input: torch.Tensor, target: torch.Tensor, reduction: str = "mean",
             weight: torch.Tensor | None = None) -> torch.Tensor:
    """Per-model ``torch.nn.functional.mse_loss`` of B models.

    ``input`` is ``[B, *s]``; ``target`` is ``s`` (shared) or ``[B, *s]`` (per
    model), floating. ``'mean'`` / ``'sum'`` give ``[B]``, ``'none'`` ``[B, *s]``.
    ``weight``: each element's weight, ``s`` (shared) or ``[B, *s]`` (per model);
    as torch, the elements' squared errors are multiplied by it and the mean
    divides by its sum (per model).
    """
    fn = "mse_loss"
    reduction = _check_reduction(fn, reduction)
    x = _check_input(fn, input, 1, "[B, ...]")
    x, target, weight = _fp32_under_autocast(x, target, weight)
    t = _elementwise_target(fn, target, x)
    w = _elementwise_weight(fn, weight, x)
    return _weighted_elementwise(F.mse_loss(x, t, reduction="none"), w, reduction)


def l1_loss(input: torch.Tensor, target: torch.Tensor, reduction: str = "mean",
            weight: torch.Tensor | None = None) -> torch.Tensor:
    """Per-model ``torch.nn.functional.l1_loss`` of B models.

    ``input`` is ``[B, *s]``; ``target`` is ``s`` (shared) or ``[B, *s]`` (per
    model), floating. ``'mean'`` / ``'sum'`` give ``[B]``, ``'none'`` ``[B, *s]``.
    ``weight``: each element's weight, ``s`` (shared) or ``[B, *s]`` (per model);
    as torch, the elements' absolute errors are multiplied by it and the mean
    divides by its sum (per model).
    """
    fn = "l1_loss"
    reduction = _check_reduction(fn, reduction)
    x = _check_input(fn, input, 1, "[B, ...]")
    x, target, weight = _fp32_under_autocast(x, target, weight)
    t = _elementwise_target(fn, target, x)
    w = _elementwise_weight(fn, weight, x)
    return _weighted_elementwise(F.l1_loss(x, t, reduction="none"), w, reduction)


def binary_cross_entropy_with_logits(input: torch.Tensor, target: torch.Tensor,
                                     weight: torch.Tensor | None = None, reduction: str = "mean",
                                     pos_weight: torch.Tensor | None = None) -> torch.Tensor:
    """Per-model ``torch.nn.functional.binary_cross_entropy_with_logits`` of B models.

    ``input`` is ``[B, *s]``; ``target`` is ``s`` (shared) or ``[B, *s]`` (per
    model), floating. ``weight`` and ``pos_weight`` broadcast against
    ``[B, *s]``: a torch-shaped one (fewer dims than ``input``, e.g.
    ``pos_weight [C]`` for ``s = [N, C]``) is shared; a per-model one has
    ``input``'s number of dims with B in front (e.g. ``[B, 1, C]``).
    ``'mean'`` / ``'sum'`` give ``[B]``, ``'none'`` ``[B, *s]``.
    """
    fn = "binary_cross_entropy_with_logits"
    reduction = _check_reduction(fn, reduction)
    x = _check_input(fn, input, 1, "[B, ...]")
    x, target, weight, pos_weight = _fp32_under_autocast(x, target, weight, pos_weight)
    t = _elementwise_target(fn, target, x)
    weight = _check_broadcast_weight(fn, "weight", weight, x)
    pos_weight = _check_broadcast_weight(fn, "pos_weight", pos_weight, x)
    loss = F.binary_cross_entropy_with_logits(x, t, weight, reduction="none", pos_weight=pos_weight)
    return _reduce_elementwise(loss, reduction)
