"""Array normalization layers: LayerNorm, RMSNorm, GroupNorm, BatchNorm1d, BatchNorm2d.

LayerNorm, RMSNorm and BatchNorm run the ``hfkern::array_layer_norm`` /
``array_rms_norm`` / ``array_batch_norm`` ops, which read any input strides
(the ``[N, B, C, *]`` memory an array conv produces included) and write the
output in the input's memory order. GroupNorm runs torch's own kernel on the
grouped view ``[N, B*C, *]`` with the per-model parameters viewed as ``[B*C]``;
that view is free for ``[N, B, C, *]`` memory. For ``[B, N, C, *]`` memory (a
Linear output, or a user's stacked tensor) it folds the samples into the
groups instead of copying the activation.

Mixed precision: as torch's norms, every one takes a bfloat16 or float16 input
with float32 parameters (and running statistics) outside autocast too (a norm in
a ``torch.autocast(enabled=False)`` region reading a low-precision activation):
computed in float32, the output in the input's dtype, parameter gradients and
running statistics in float32. Other mixes raise TypeError there.

An hfkern addition: LayerNorm and BatchNorm take a keyword-only
``activation`` (``"none"``, ``"relu"`` or ``"gelu"``, the exact
``torch.nn.GELU()``) and then compute ``act(norm(x))`` in one op, backward
included, without the activation's separate pass over the tensor
(:func:`hfkern.fuse` uses it for a norm followed by ReLU or GELU). It is not
a field of the torch namesake: ``from_modules`` builds modules without it,
and ``extract_model``/``to_modules`` return the norm alone.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor, nn
from torch.nn import init

from .._array import (
    array_memory_format, check_channels, check_input, from_grouped, is_mixed_precision, per_model_memory_first,
    shares_work, to_grouped,
)
from .._dtypes import acc_dtype
from ..ops.batch_norm import array_batch_norm, grouped_batch_norm, grouped_serves
from ..ops._norm import check_activation
from ..ops.layer_norm import layer_norm, rms_norm
from ._base import ArrayModule, torch_module

__all__ = ["LayerNorm", "RMSNorm", "GroupNorm", "BatchNorm1d", "BatchNorm2d"]


def _check_trailing(
    module: str, input: object, B: int | None, shape: tuple[int, ...], param: Tensor | None
) -> Tensor:
    """Check an input ``[B, *, *shape]``: at least one per-model dim per normalized dim."""
    if not isinstance(input, Tensor):
        raise TypeError(f"{module}: expected input to be a torch.Tensor, got {type(input).__name__}")
    n = len(shape)
    if input.dim() < n + 1 or tuple(input.shape[input.dim() - n:]) != shape:
        raise ValueError(
            f"{module}: expected input of shape [B, *, {', '.join(map(str, shape))}] "
            f"(array dim first, normalized_shape={list(shape)} last), got shape {list(input.shape)}"
        )
    return check_input(module, input, B, (input.dim() - 1,), param, mixed_precision=True)


def _affine_parameters(module: nn.Module, shape: tuple[int, ...], affine: bool, bias: bool,
                       factory: dict) -> None:
    """weight and bias of ``shape`` as torch's norms make them: registered as None where
    absent (``affine=False``, or ``bias=False``), initialized by :func:`_reset_affine`."""
    if affine:
        module.weight = nn.Parameter(torch.empty(shape, **factory))
        if bias:
            module.bias = nn.Parameter(torch.empty(shape, **factory))
        else:
            module.register_parameter("bias", None)
    else:
        module.register_parameter("weight", None)
        module.register_parameter("bias", None)


def _reset_affine(module: nn.Module) -> None:
    if module.weight is not None:
        init.ones_(module.weight)
    if module.bias is not None:
        init.zeros_(module.bias)


class _FusedActivation:
    """The ``activation`` keyword of LayerNorm and BatchNorm (an hfkern addition, not a
    field of the torch namesake): shown in the repr where it is not "none"."""

    activation: str

    def extra_repr(self) -> str:
        text = super().extra_repr()
        return text if self.activation == "none" else f"{text}, activation={self.activation!r}"


class LayerNorm(_FusedActivation, ArrayModule):
    """B ``torch.nn.LayerNorm`` models.

    Input ``[B, *, *normalized_shape]`` (any strides), output of the same shape
    in the input's memory order; weight and bias ``[B, *normalized_shape]``.
    ``B`` is required when ``elementwise_affine`` (the models have parameters).
    ``activation`` (hfkern's, keyword-only): ``"relu"`` or ``"gelu"`` computes
    ``act(layer_norm(x))`` in the same op (see the module docstring).
    """

    _torch_cls = nn.LayerNorm
    _config_fields = ("normalized_shape", "eps", "elementwise_affine", "bias")

    def __init__(self, normalized_shape, eps: float = 1e-5, elementwise_affine: bool = True,
                 bias: bool = True, *, activation: str = "none", B: int | None = None, device=None,
                 dtype=None):
        super().__init__()
        template = nn.LayerNorm(normalized_shape, eps, elementwise_affine, bias, device="meta")
        self.activation = check_activation("LayerNorm", activation)
        self._set_B(B, required=elementwise_affine)
        self.normalized_shape = template.normalized_shape
        self.eps = eps
        self.elementwise_affine = elementwise_affine
        _affine_parameters(self, (self.B, *self.normalized_shape), elementwise_affine, bias,
                           {"device": device, "dtype": dtype})
        self.reset_parameters()

    def reset_parameters(self) -> None:
        _reset_affine(self)

    def forward(self, input: Tensor) -> Tensor:
        return self._normalize(input, self.activation)

    def _normalize(self, input: Tensor, activation: str) -> Tensor:
        """act(layer_norm(input)) for the given ``activation`` (hfkern.fuse calls it)."""
        x = _check_trailing("LayerNorm", input, self.B, self.normalized_shape, self.weight)
        n = len(self.normalized_shape)
        if shares_work(x) and self.weight is None and self.bias is None:
            # Without parameters the B models compute the same thing: once.
            return layer_norm(x[:1], None, None, n, self.eps, activation)[0].expand(x.shape)
        return layer_norm(x, self.weight, self.bias, n, self.eps, activation)[0]


class RMSNorm(ArrayModule):
    """B ``torch.nn.RMSNorm`` models.

    Input ``[B, *, *normalized_shape]`` (any strides), output of the same shape
    in the input's memory order; weight ``[B, *normalized_shape]``. ``eps=None``
    uses ``torch.finfo(input.dtype).eps``, as torch does. ``B`` is required when
    ``elementwise_affine``.
    """

    _torch_cls = nn.RMSNorm
    _config_fields = ("normalized_shape", "eps", "elementwise_affine")

    def __init__(self, normalized_shape, eps: float | None = None, elementwise_affine: bool = True,
                 *, B: int | None = None, device=None, dtype=None):
        super().__init__()
        template = nn.RMSNorm(normalized_shape, eps, elementwise_affine, device="meta")
        self._set_B(B, required=elementwise_affine)
        self.normalized_shape = template.normalized_shape
        self.eps = eps
        self.elementwise_affine = elementwise_affine
        if elementwise_affine:
            self.weight = nn.Parameter(
                torch.empty((self.B, *self.normalized_shape), device=device, dtype=dtype)
            )
        else:
            self.register_parameter("weight", None)
        self.reset_parameters()

    def reset_parameters(self) -> None:
        if self.weight is not None:
            init.ones_(self.weight)

    def forward(self, input: Tensor) -> Tensor:
        x = _check_trailing("RMSNorm", input, self.B, self.normalized_shape, self.weight)
        n = len(self.normalized_shape)
        # torch's default is the epsilon of the dtype it computes in (float32 for
        # bfloat16 and float16 input), not of the input's dtype.
        eps = torch.finfo(acc_dtype(x.dtype)).eps if self.eps is None else self.eps
        if shares_work(x) and self.weight is None:
            return rms_norm(x[:1], None, n, eps)[0].expand(x.shape)
        return rms_norm(x, self.weight, n, eps)[0]


class GroupNorm(ArrayModule):
    """B ``torch.nn.GroupNorm`` models.

    Input ``[B, N, C, *]`` (torch's ``(N, C, *)`` per model), output of the same
    shape; weight and bias ``[B, C]``. ``[N, B, C, *]`` memory (an array conv's
    output) runs one ``group_norm`` with ``B * num_groups`` groups on the free
    view ``[N, B*C, *]`` and keeps that memory order; other layouts run it on
    ``[1, B*N*C, *]`` with the weight expanded over N (a copy of ``B*N*C``
    values, not of the activation). ``B`` is required when ``affine``.

    Like torch, which reads every input as ``(N, C, *)`` and has no unbatched
    form, a per-model input must have at least 2 dims.
    """

    _torch_cls = nn.GroupNorm
    _config_fields = ("num_groups", "num_channels", "eps", "affine", "bias")

    def __init__(self, num_groups: int, num_channels: int, eps: float = 1e-5, affine: bool = True,
                 *, bias: bool = True, B: int | None = None, device=None, dtype=None):
        super().__init__()
        torch_module(nn.GroupNorm, num_groups, num_channels, eps, affine, bias=bias, device="meta")
        self._set_B(B, required=affine)
        self.num_groups, self.num_channels = num_groups, num_channels
        self.eps, self.affine = eps, affine
        _affine_parameters(self, (self.B, num_channels), affine, bias, {"device": device, "dtype": dtype})
        self.reset_parameters()

    def reset_parameters(self) -> None:
        _reset_affine(self)

    def forward(self, input: Tensor) -> Tensor:
        if isinstance(input, Tensor) and input.dim() < 3:
            raise ValueError(
                "GroupNorm: expected input of shape [B, N, C, *] (at least 3-D: torch reads "
                f"every per-model input as (N, C, *)), got {input.dim()}-D shape {list(input.shape)}"
            )
        x = check_input("GroupNorm", input, self.B, (getattr(input, "ndim", 0) - 1,), self.weight,
                        mixed_precision=True)
        check_channels("GroupNorm", x, 2, self.num_channels)
        B, N, C = x.shape[:3]
        rest = tuple(x.shape[3:])
        G = self.num_groups
        # torch's own guard (F.group_norm -> _verify_batch_size), on one model's input.
        if N * (C // G) * math.prod(rest) == 1:
            raise ValueError(
                "GroupNorm: expected more than 1 value per channel when training, got per-model "
                f"input shape {list(x.shape[1:])}"
            )
        w, b = self.weight, self.bias
        cudnn = torch.backends.cudnn.enabled
        # torch's mixed precision (a bfloat16 or float16 input, float32 parameters; under
        # autocast or not) computes in float32 and rounds once into the input's dtype; where
        # the affine step is spelled out here it does the same (a low-precision xhat times the
        # float32 weight would return float32, and round twice).
        mixed = w is not None and is_mixed_precision(x, w)
        if shares_work(x):
            # One normalization serves every model; only the affine differs.
            xhat = torch.group_norm(x[0].to(w.dtype) if mixed else x[0], G, None, None, self.eps, cudnn)
            if w is None and b is None:
                return xhat.expand(x.shape)
            shape = (1, B, C) + (1,) * len(rest)  # [N, B, C, *]: the memory a conv expects
            y = xhat.unsqueeze(1)
            y = y * w.view(shape) if w is not None else y
            y = y + b.view(shape) if b is not None else y
            return y.to(x.dtype).transpose(0, 1)
        memory_format = array_memory_format(x)
        if per_model_memory_first(x) or memory_format == torch.channels_last:
            # [N, B, C, *] or channels-last [N, H, W, B, C] memory: the grouped view is free
            y = torch.group_norm(
                to_grouped(x), B * G, None if w is None else w.reshape(-1),
                None if b is None else b.reshape(-1), self.eps, cudnn,
            )
            return from_grouped(y, B, memory_format)
        # Each (model, sample) pair is its own set of G groups of a [1, B*N*C, *]
        # input, so the activation is only viewed; the per-channel affine is
        # expanded over the samples instead.
        def per_sample(p: Tensor | None) -> Tensor | None:
            return None if p is None else p.unsqueeze(1).expand(B, N, C).reshape(-1)

        if torch.compiler.is_compiling():
            # group_norm's group count is a plain int, which a trace specializes: B * N * G
            # would compile a graph per batch size. Normalized as B * N samples of G groups,
            # the per-model affine applied after (the compiler fuses it).
            xs = x.reshape(B * N, C, *rest)
            xhat = torch.group_norm(xs.to(w.dtype) if mixed else xs, G, None, None, self.eps, cudnn).view(x.shape)
            shape = (B, 1, C) + (1,) * len(rest)
            y = xhat * w.view(shape) if w is not None else xhat
            return (y + b.view(shape) if b is not None else y).to(x.dtype)
        y = torch.group_norm(
            x.reshape(1, B * N * C, *rest), B * N * G, per_sample(w), per_sample(b), self.eps, cudnn
        )
        return y.view(x.shape)


class _BatchNorm(_FusedActivation, ArrayModule):
    _model_ndims: tuple[int, ...]
    _config_fields = ("num_features", "eps", "momentum", "affine", "track_running_stats", "bias")
    # torch's BatchNorm state dict version: 2 added num_batches_tracked.
    _version = 2

    def __init__(self, num_features: int, eps: float = 1e-5, momentum: float | None = 0.1,
                 affine: bool = True, track_running_stats: bool = True, *, bias: bool = True,
                 activation: str = "none", B: int | None = None, device=None, dtype=None):
        super().__init__()
        torch_module(self._torch_cls, num_features, eps, momentum, affine, track_running_stats,
                     bias=bias, device="meta")
        self.activation = check_activation(type(self).__name__, activation)
        self._set_B(B, required=affine or track_running_stats)
        self.num_features, self.eps, self.momentum = num_features, eps, momentum
        self.affine, self.track_running_stats = affine, track_running_stats
        factory = {"device": device, "dtype": dtype}
        C = num_features
        _affine_parameters(self, (self.B, C), affine, bias, factory)
        if track_running_stats:
            self.register_buffer("running_mean", torch.zeros((self.B, C), **factory))
            self.register_buffer("running_var", torch.ones((self.B, C), **factory))
            self.register_buffer(
                "num_batches_tracked", torch.zeros(self.B, dtype=torch.long, device=device)
            )
        else:
            self.register_buffer("running_mean", None)
            self.register_buffer("running_var", None)
            self.register_buffer("num_batches_tracked", None)
        self.reset_parameters()

    def _fill_legacy_entries(self, state_dict: dict, prefix: str, local_metadata: dict) -> None:
        # As torch's _NormBase: a checkpoint older than version 2 (or one without
        # version metadata, such as a hand-built dict) has no num_batches_tracked;
        # the module keeps its own counts.
        version = local_metadata.get("version", None)
        key = prefix + "num_batches_tracked"
        nbt = self.num_batches_tracked
        if (version is None or version < 2) and nbt is not None and key not in state_dict:
            state_dict[key] = torch.zeros(nbt.shape, dtype=nbt.dtype) if nbt.is_meta else nbt

    def reset_running_stats(self) -> None:
        if self.track_running_stats:
            self.running_mean.zero_()
            self.running_var.fill_(1)
            self.num_batches_tracked.zero_()

    def reset_parameters(self) -> None:
        self.reset_running_stats()
        _reset_affine(self)

    def forward(self, input: Tensor) -> Tensor:
        return self._normalize(input, self.activation)

    def _normalize(self, input: Tensor, activation: str) -> Tensor:
        """act(batch_norm(input)) for the given ``activation`` (hfkern.fuse calls it)."""
        name = type(self).__name__
        param = self.weight if self.weight is not None else self.running_mean
        x = check_input(name, input, self.B, self._model_ndims, param, mixed_precision=True)
        check_channels(name, x, 2, self.num_features)
        # As torch: batch statistics in training, and in eval when nothing is tracked.
        use_batch_stats = self.training or self.running_mean is None
        if use_batch_stats:
            n = x.size(1) * math.prod(x.shape[3:])
            if n == 1:  # torch's F.batch_norm -> _verify_batch_size, per model
                raise ValueError(
                    f"{name}: expected more than 1 value per channel when training, got "
                    f"per-model input shape {list(x.shape[1:])}"
                )
            if self.eps <= 0.0:
                raise ValueError(f"{name}: batch_norm eps must be positive during training, got {self.eps}")
        elif self.eps < 0.0:
            raise ValueError(f"{name}: batch_norm eps must be non-negative, got {self.eps}")
        if shares_work(x) and self.weight is None and self.bias is None and self.running_mean is None:
            # One shared batch, its own statistics, no per-model state: the B
            # models compute the same thing, once.
            y = array_batch_norm(x[:1], None, None, None, None, None, True, None, self.eps, activation)[0]
            return y.expand(x.shape)
        # Counted before the op runs: momentum=None averages over each model's own count (the B
        # counts may differ after from_modules). The op checks its arguments before it writes the
        # running statistics: a call it refuses is uncounted, and changes nothing.
        counted = self.training and self.track_running_stats
        if counted:
            self.num_batches_tracked.add_(1)
        try:
            return array_batch_norm(
                x, self.weight, self.bias, self.running_mean, self.running_var, self.num_batches_tracked,
                use_batch_stats, self.momentum, self.eps, activation,
            )[0]
        except BaseException:
            if counted:
                self.num_batches_tracked.sub_(1)
            raise

    def _normalize_grouped(self, xg: Tensor, B: int, fmt: torch.memory_format, activation: str, *,
                           checked: bool = False, grouped: bool = False) -> Tensor | None:
        """``_normalize`` of the array whose grouped form is ``xg`` (``[N, B*C, *S]``, ``fmt`` its
        array memory format) without making the array first, where
        :func:`hfkern.ops.batch_norm.grouped_serves` (what ``hfkern.fuse`` runs for a
        convolution whose output only this norm reads); None, nothing changed, where
        ``_normalize`` must run on the array. ``checked``: a call of the same metadata
        (input, parameters and buffers, configuration, backend selection, autocast state)
        took this path before, so the checks are not repeated. ``grouped``: the output's
        grouped form (see :func:`hfkern.ops.batch_norm.grouped_batch_norm`)."""
        if checked:
            if self.training and self.track_running_stats:
                self.num_batches_tracked.add_(1)
            return grouped_batch_norm(xg, B, fmt, self.weight, self.bias, self.running_mean, self.running_var,
                                      self.num_batches_tracked, self.momentum, self.eps, activation, checked=True,
                                      grouped=grouped)
        param = self.weight if self.weight is not None else self.running_mean
        use_batch_stats = self.training or self.running_mean is None
        if not (use_batch_stats and B == self.B and xg.dim() in self._model_ndims
                and xg.shape[1] == B * self.num_features and self.eps > 0.0
                and (param is None or (xg.device == param.device and (
                    xg.dtype == param.dtype or is_mixed_precision(xg, param)
                    or torch.is_autocast_enabled(xg.device.type))))
                and grouped_serves(xg, B, self.weight, self.bias, self.running_mean, self.running_var,
                                   activation=activation)):
            return None
        counted = self.training and self.track_running_stats
        if counted:
            self.num_batches_tracked.add_(1)  # as _normalize: counted before the op runs, uncounted if it raises
        try:
            return grouped_batch_norm(xg, B, fmt, self.weight, self.bias, self.running_mean, self.running_var,
                                      self.num_batches_tracked, self.momentum, self.eps, activation,
                                      grouped=grouped)
        except BaseException:
            if counted:
                self.num_batches_tracked.sub_(1)
            raise


class BatchNorm1d(_BatchNorm):
    """B ``torch.nn.BatchNorm1d`` models: input ``[B, N, C]`` or ``[B, N, C, L]``.

    Parameters and ``running_mean``/``running_var`` are ``[B, C]``,
    ``num_batches_tracked`` is ``[B]``; every model's statistics and running
    averages are its own, exactly as B torch modules would keep them. ``B`` is
    required when ``affine`` or ``track_running_stats``. ``activation``
    (hfkern's, keyword-only): ``"relu"`` or ``"gelu"`` computes
    ``act(batch_norm(x))`` in the same op (see the module docstring).
    """

    _torch_cls = nn.BatchNorm1d
    _model_ndims = (2, 3)


class BatchNorm2d(_BatchNorm):
    """B ``torch.nn.BatchNorm2d`` models: input ``[B, N, C, H, W]``.

    Parameters and ``running_mean``/``running_var`` are ``[B, C]``,
    ``num_batches_tracked`` is ``[B]``. Any input strides are read as they are;
    ``[N, B, C, H, W]`` memory (an array conv's output) and the ``[N, H, W, B, C]``
    memory of a channels-last array image keep their memory order. ``B`` is
    required when ``affine`` or ``track_running_stats``. ``activation``
    (hfkern's, keyword-only): ``"relu"`` or ``"gelu"`` computes
    ``act(batch_norm(x))`` in the same op (see the module docstring).
    """

    _torch_cls = nn.BatchNorm2d
    _model_ndims = (4,)
