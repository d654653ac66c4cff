"""Array dropout: Dropout, Dropout1d, Dropout2d.

Each model draws its own masks, exactly as B separate torch modules would
(element-wise for Dropout, one draw per (model, sample, channel) for
Dropout1d/2d). A shared input (:func:`hfkern.broadcast`) therefore comes out,
in training with ``p > 0``, as a real ``[B, ...]`` tensor with B independent
masks; in eval (or with ``p == 0``) dropout is the identity and returns its
input itself, shared or not.

The probability ``p`` is one float for all models or one value per model (a
length-B sequence, a 1-D numpy array or a ``[B]`` tensor): dropout is a
hyper-parameter sweeps vary. Model b then zeroes each unit with probability
``p[b]`` and scales the kept ones by ``1 / (1 - p[b])``, as
``torch.nn.Dropout(p[b])`` does; :meth:`to_modules` gives model b that module.

``inplace=True`` modifies the input in place and returns it, as torch does. A
shared input cannot be written in place (its B models are one memory), so that
raises ValueError when the call would write.
"""

from __future__ import annotations

from numbers import Real
from typing import Any, Callable, ClassVar

import torch
import torch.nn.functional as F
from torch import nn

from .._array import MAX_NDIM, check_input, fold, is_shared, per_model_memory_first
from .._dtypes import acc_dtype
from ._base import ArrayModule

__all__ = ["Dropout", "Dropout1d", "Dropout2d", "dropout_probability", "per_model_dropout"]


def dropout_probability(p: Any, B: int | None, module: str, name: str = "p") -> float | tuple[float, ...]:
    """Validate a dropout probability: a float for every model, or a tuple of B floats.

    ``p`` may be a real number (also a 0-d tensor or numpy scalar), or one
    value per model: a length-B sequence of numbers, a 1-D numpy array or a
    1-D tensor of length B. Every value must lie in ``[0, 1]``. Raises
    TypeError for other types (and when ``p`` is per model but ``B`` is not
    given), ValueError for a wrong length or a value outside ``[0, 1]``.
    """
    if isinstance(p, bool):
        raise TypeError(f"{module}: expected {name} to be a float in [0, 1] or one per model, got bool {p!r}")
    values: list | None = None
    if isinstance(p, Real):
        value = float(p)
    elif hasattr(p, "ndim") and hasattr(p, "tolist"):  # torch.Tensor, numpy.ndarray, numpy scalar
        if str(getattr(p, "dtype", "")) in ("torch.bool", "bool"):
            raise TypeError(f"{module}: expected {name} of a floating point dtype, got dtype {p.dtype}")
        if p.ndim > 1:
            raise ValueError(
                f"{module}: expected {name} to be a float or a 1-D array of one value per model "
                f"(length B={B}), got shape {list(p.shape)}"
            )
        data = p.detach().tolist() if isinstance(p, torch.Tensor) else p.tolist()
        if p.ndim == 0:
            value = float(data)
        else:
            values = data
    elif isinstance(p, (list, tuple)):
        values = list(p)
    else:
        raise TypeError(
            f"{module}: expected {name} to be a float, a length-B sequence, a 1-D numpy array or a "
            f"[B] tensor, got {type(p).__name__}"
        )
    if values is None:
        if not 0.0 <= value <= 1.0:
            raise ValueError(f"{module}: dropout probability has to be between 0 and 1, but got {value}")
        return value
    for i, v in enumerate(values):
        if isinstance(v, bool) or not isinstance(v, Real):
            raise TypeError(
                f"{module}: expected {name} to hold one number per model, got {type(v).__name__} "
                f"{v!r} at index {i}"
            )
    if B is None:
        raise TypeError(
            f"{module}: {name} has one value per model ({len(values)} values), so the keyword "
            "argument B (array size) is required"
        )
    if len(values) != B:
        raise ValueError(
            f"{module}: expected {name} with one value per model (length B={B}), got {len(values)} "
            f"values {values}"
        )
    out = tuple(float(v) for v in values)
    for b, v in enumerate(out):
        if not 0.0 <= v <= 1.0:
            raise ValueError(
                f"{module}: dropout probability has to be between 0 and 1 for every model, but "
                f"{name}[{b}] is {v}"
            )
    return out


def uniform_p(p: float | tuple[float, ...]) -> float | None:
    """The common probability of ``p`` (a float, or a tuple whose entries are all equal), else None."""
    if isinstance(p, tuple):
        return p[0] if all(v == p[0] for v in p) else None
    return p


def _factor_values(p: tuple[float, ...], dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """``(keep, scale)`` on the CPU: ``[B]`` keep probabilities in ``dtype``'s accumulation dtype
    and ``dtype`` scales ``1 / (1 - p[b])`` (0 for p = 1).

    The scale is computed as torch computes its ``noise.div_(1 - p)``: in
    float32 (float64 for float64 inputs), rounded to the input's dtype.
    """
    acc = acc_dtype(dtype)
    keep = 1 - torch.tensor(p, dtype=torch.float64)
    scale = torch.where(keep > 0, 1 / keep.to(acc).clamp_min(torch.finfo(acc).tiny), 0).to(dtype)
    return keep.to(acc), scale


def _per_model_factors(p: tuple[float, ...], x: torch.Tensor, cache: dict | None):
    """``(keep, scale)``: ``[B]`` keep probabilities and ``x.dtype`` scales ``1 / (1 - p[b])`` on ``x``'s device.

    In eager mode they are cached per device and dtype, so a step does not copy
    B floats to the device each time, and kept there: another ``p`` is written
    into the same tensors (:func:`refresh_factors`), so a CUDA graph that reads
    them (:func:`hfkern.capture_step`) drops with the new probabilities. A
    compiled graph holds them as constants.
    """
    key = (x.device, x.dtype)
    entry = cache.get(key) if cache is not None else None
    if entry is not None:
        if entry[0] != p:
            _write_factors(entry, p)
        return entry[1], entry[2]
    if cache is None:
        keep, scale = _factor_values(p, x.dtype)
        return keep.to(x.device), scale.to(x.device)
    with torch.inference_mode(False):  # tensors written in place later, also outside inference mode
        keep, scale = _factor_values(p, x.dtype)
        keep, scale = keep.to(x.device), scale.to(x.device)
    cache[key] = [p, keep, scale]
    return keep, scale


def _write_factors(entry: list, p: tuple[float, ...]) -> None:
    keep, scale = _factor_values(p, entry[2].dtype)
    with torch.no_grad():
        entry[1].copy_(keep)
        entry[2].copy_(scale)
    entry[0] = p


def refresh_factors(cache: dict, p: float | tuple[float, ...]) -> None:
    """Write the per-model probabilities ``p`` into the device tensors of ``cache`` (a module's
    :func:`per_model_dropout` cache) in place, as a module does when its ``p`` is set: a captured
    graph that reads them drops with ``p`` from its next replay. A single ``p`` (the module then
    calls ``F.dropout``) leaves them as they are."""
    if isinstance(p, tuple):
        for entry in cache.values():
            if entry[0] != p:
                _write_factors(entry, p)


def per_model_dropout(
    x: torch.Tensor, p: tuple[float, ...], k: int, inplace: bool = False, cache: dict | None = None
) -> torch.Tensor:
    """Training-mode dropout of ``x`` ``[B, ...]`` with model b's probability ``p[b]``.

    One Bernoulli draw per index of the first ``k`` dims of ``x`` (``k = x.dim()``:
    element-wise; ``k = 3``: per (model, sample, channel)), shared along the
    rest; kept units are scaled by ``1 / (1 - p[b])``, dropped ones are zero,
    exactly torch's ``input * (bernoulli(1 - p) / (1 - p))`` per model. The
    result has ``x``'s memory order for an element-wise draw.
    """
    B = x.size(0)
    keep, scale = _per_model_factors(p, x, cache)
    view = (B,) + (1,) * (k - 1)
    if k == x.dim():
        noise = torch.empty_like(x)  # x's memory order, which the product then keeps
    else:
        noise = x.new_empty(x.shape[:k])
    noise.bernoulli_(keep.view(view).expand(noise.shape))
    noise.mul_(scale.view(view))
    noise = noise.view(*noise.shape, *([1] * (x.dim() - k)))
    return x.mul_(noise) if inplace else x * noise


def _fold_copies(x: torch.Tensor) -> bool:
    """Whether :func:`hfkern._array.fold` must copy ``x`` ([B, N, ...]) to merge its first two dims."""
    if per_model_memory_first(x) and not is_shared(x):
        return False
    B, N = x.shape[:2]
    # strides alone decide (no storage query, which torch.compile cannot trace)
    return not (B <= 1 or N <= 1 or x.stride(0) == N * x.stride(1))


class _ArrayDropoutNd(ArrayModule):
    _config_fields = ("p", "inplace")
    _per_model_fields = ("p",)
    _model_ndims: ClassVar[tuple[int, int | None]]  # per-model ranks the namesake accepts: lo <= r < hi

    def __init__(self, p: float | Any = 0.5, inplace: bool = False, *, B: int | None = None):
        super().__init__()
        self._set_B(B, required=False)
        self._factors: dict = {}
        self.p = p
        self.inplace = inplace

    @property
    def p(self) -> float | tuple[float, ...]:
        """The dropout probability: one float for every model, or a tuple of B floats."""
        return self._p

    @p.setter
    def p(self, value: Any) -> None:
        p = dropout_probability(value, self.B, type(self).__name__)
        self._p, self._uniform = p, uniform_p(p)
        refresh_factors(self._factors, p)  # per-model values live in device tensors a graph reads

    def _graph_state(self) -> tuple:
        """The host values this layer's forward computes with beyond its mode: a captured step
        (:func:`hfkern.capture_step`) whose values differ is captured anew. A per-model ``p`` is
        not one of them (device tensors, written in place when it changes); a single one is (the
        value ``F.dropout`` gets), as is whether ``p`` is one value or one per model."""
        return self.inplace, self._uniform

    def __setstate__(self, state: dict[str, Any]) -> None:
        super().__setstate__(state)
        self._uniform = uniform_p(self._p)  # (pickled before it was kept)
        self._factors = {}  # a cache, made again at the next call (older pickles hold another layout)

    def _drops(self) -> bool:
        """Whether a forward call would drop anything (training, and some model's p > 0)."""
        p = self.p
        return self.training and (max(p) > 0 if isinstance(p, tuple) else p > 0)

    def _check(self, input: torch.Tensor) -> torch.Tensor:
        lo, hi = self._model_ndims
        x = check_input(type(self).__name__, input, self.B, range(lo, hi or MAX_NDIM))
        if self.inplace and self._drops() and is_shared(x):
            raise ValueError(
                f"{type(self).__name__}: inplace=True needs an input with its own memory per "
                f"model, got a shared (hfkern.broadcast) input of shape {list(x.shape)} whose B "
                f"models are one memory; use inplace=False for this layer"
            )
        return x

    def _per_model(self, x: torch.Tensor, k: int) -> torch.Tensor:
        cache = None if torch.compiler.is_compiling() else self._factors
        return per_model_dropout(x, self.p, k, self.inplace, cache)


class Dropout(_ArrayDropoutNd):
    """B ``torch.nn.Dropout`` models: input ``[B, *]``, output ``[B, *]``.

    In training every element is zeroed with probability ``p`` (model b: ``p[b]``
    when ``p`` is per model), independently for every model, and the kept ones
    are scaled by ``1 / (1 - p)``. The output has the input's memory order (a
    ``[N, B, ...]``-memory input stays so). ``p``: a float, or one value per
    model (length-B sequence, 1-D numpy array or ``[B]`` tensor; needs ``B``).
    """

    _torch_cls = nn.Dropout
    _model_ndims = (0, None)

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        x = self._check(input)
        p = self._uniform
        if p is None:
            if not self._drops():
                return x
            return self._per_model(x, x.dim())
        inplace = self.inplace
        if self.training and p > 0 and is_shared(x):
            # One copy per model, then dropped out in place: B independent masks.
            x, inplace = x.contiguous(), True
        return F.dropout(x, p, self.training, inplace)


class _ArrayFeatureDropout(_ArrayDropoutNd):
    _fn: ClassVar[Callable[..., torch.Tensor]]

    def _mask_dims(self, model_ndim: int) -> int:
        """How many leading dims of an array input of ``model_ndim``-D models get their own draw."""
        return 3  # (model, sample, channel); for other ranks torch's per (dim 0, dim 1) entry

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        x = self._check(input)
        fn = type(self)._fn
        p = self._uniform
        if not self._drops() or p is None:
            # The call on an empty per-model tensor only issues the warnings
            # torch gives for this input rank.
            fn(torch.empty(x.shape[1:], dtype=x.dtype, device="meta"), 0.5 if p is None else p, False, False)
            if not self._drops():
                return x  # identity, as in torch
            return self._per_model(x, self._mask_dims(x.dim() - 1))
        # Folding B into dim 0 keeps the rank: torch sees a batch of B*N samples
        # (or, for a model's unbatched input, B*C channels) and draws one mask
        # per model, sample and channel; a 3-D input to dropout2d keeps torch's
        # reading of dim 0 as the batch, with torch's warning.
        folded, unfold = fold(x)
        copied = _fold_copies(x)
        # A folded copy (shared input, or strides that do not merge) is ours to overwrite.
        out = fn(folded, p, True, self.inplace or copied)
        if self.inplace:
            if copied:
                x.copy_(unfold(out))
            return x
        return unfold(out)


class Dropout1d(_ArrayFeatureDropout):
    """B ``torch.nn.Dropout1d`` models: input ``[B, N, C, L]`` or ``[B, C, L]``.

    In training each (model, sample, channel) row of length L is zeroed with
    probability ``p`` (model b: ``p[b]`` when ``p`` is per model), independently,
    and the kept rows are scaled by ``1 / (1 - p)``. A ``[N, B, C, L]``-memory input gives ``[N, B, C, L]``-memory
    output.
    """

    _torch_cls = nn.Dropout1d
    _fn = staticmethod(F.dropout1d)
    _model_ndims = (2, 4)

    def _mask_dims(self, model_ndim: int) -> int:
        return 3 if model_ndim == 3 else 2  # torch reads a 2-D model input as one sample [C, L]


class Dropout2d(_ArrayFeatureDropout):
    """B ``torch.nn.Dropout2d`` models: input ``[B, N, C, H, W]`` (or ``[B, C, H, W]``, below).

    In training each (model, sample, channel) plane is zeroed with probability
    ``p`` (model b: ``p[b]`` when ``p`` is per model), independently, and the
    kept planes are scaled by ``1 / (1 - p)``. A
    ``[N, B, C, H, W]``-memory input gives ``[N, B, C, H, W]``-memory output.

    An array input ``[B, C, H, W]`` holds a 3-D input per model, which torch's
    dropout2d reads as ``(N, C, L)``: each model's rows along the last dim are
    dropped independently, with torch's warning, exactly as B torch modules do.
    Per-model 2-D and 5-D or higher inputs (deprecated by torch, with its
    warning) drop per entry of their first two dims, as torch does.
    """

    _torch_cls = nn.Dropout2d
    _fn = staticmethod(F.dropout2d)
    _model_ndims = (2, None)
