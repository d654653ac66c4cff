"""Array transformer modules: B ``torch.nn.TransformerEncoderLayer`` / ``TransformerEncoder`` models."""

from __future__ import annotations

import copy
import warnings
from typing import Callable, Sequence

import torch
import torch.nn.functional as F
from torch import nn

from .._array import check_B, check_input
from ._base import ArrayModule
from .attention import (MultiheadAttention, _float_mask, attn_mask_5d, check_mask_dtypes,
                        key_padding_mask_5d)
from .dropout import Dropout, dropout_probability
from .linear import Linear
from .normalization import LayerNorm, RMSNorm

try:
    from torch.nn.modules.transformer import _detect_is_causal_mask, _generate_square_subsequent_mask
except ImportError:  # private torch helpers; their rule, replicated
    def _generate_square_subsequent_mask(sz, device=None, dtype=None):
        return torch.triu(torch.full((sz, sz), float("-inf"), dtype=dtype, device=device), diagonal=1)

    def _detect_is_causal_mask(mask, is_causal=None, size=None):
        make_causal = is_causal is True
        if is_causal is None and mask is not None:
            sz = size if size is not None else mask.size(-2)
            causal = _generate_square_subsequent_mask(sz, device=mask.device, dtype=mask.dtype)
            make_causal = mask.size() == causal.size() and bool((mask == causal).all())
        return make_causal

__all__ = ["TransformerEncoderLayer", "TransformerEncoder"]


def _prepare_src(name: str, layer: "TransformerEncoderLayer", src: torch.Tensor,
                 mask: torch.Tensor | None, mask_name: str, key_padding_mask: torch.Tensor | None):
    """Check ``src`` and the masks of an encoder (layer), under their names, as torch does.

    Returns ``(x, mask, key_padding_mask, mask5)``: both masks float (as torch
    converts them, so attention sees one kind), the attention mask in the
    explicit 4-D form ``[1 or B, 1 or N*nhead, S, S]`` that self_attn cannot
    misread (a ``[B, S, S]`` mask with ``B == N*nhead`` is otherwise ambiguous),
    and ``mask5``, its ``[1 or B, 1 or N, 1 or H, S, S]`` view (None without a mask).
    """
    x = check_input(name, src, layer.B, (2, 3), layer.linear1.weight, "src")
    d_model = layer.self_attn.embed_dim
    if x.size(-1) != d_model:
        raise ValueError(
            f"{name}: expected src with d_model={d_model} features in its last dim, "
            f"got shape {list(x.shape)}"
        )
    if (isinstance(mask, torch.Tensor) and isinstance(key_padding_mask, torch.Tensor)
            and mask.dtype != key_padding_mask.dtype):
        warnings.warn(
            f"Support for mismatched src_key_padding_mask and {mask_name} is deprecated. "
            "Use same type for both instead.",
            stacklevel=4,
        )
    # self_attn returns no weights: scaled_dot_product_attention's dtype rules
    key_padding_mask = _float_mask(name, key_padding_mask, "src_key_padding_mask", x, need_weights=False)
    mask = _float_mask(name, mask, mask_name, x, need_weights=False)
    batched = x.dim() == 4
    batch_first = layer.self_attn.batch_first
    S = x.size(2 if batch_first and batched else 1)
    N = (x.size(1) if batch_first else x.size(2)) if batched else 1
    key_padding_mask_5d(name, "src_key_padding_mask", key_padding_mask, layer.B, N, S, batched)
    mask5 = attn_mask_5d(name, mask_name, mask, layer.B, layer.self_attn.num_heads, N, S, S)
    if mask5 is not None:
        mask = mask5.reshape(mask5.size(0), mask5.size(1) * mask5.size(2), S, S)
    return x, mask, key_padding_mask, mask5


def _check_src_mask_dtypes(name: str, x: torch.Tensor, mask: torch.Tensor | None, mask_name: str,
                           key_padding_mask: torch.Tensor | None, is_causal: bool) -> None:
    """Refuse, before any layer runs, the is_causal hint without a mask (RuntimeError, as torch's
    self_attn raises it) and float masks of a dtype torch's layers refuse.

    As self_attn (:func:`check_mask_dtypes` without weights): the masks' sum must be of the
    src's dtype or float32, except that the mask is not used (nor checked) for the is_causal
    hint without a key padding mask.
    """
    if is_causal and mask is None:
        raise RuntimeError(
            f"{name}: need {mask_name} if specifying the is_causal hint "
            "(torch.nn.Transformer.generate_square_subsequent_mask makes one)"
        )
    hint_only = is_causal and key_padding_mask is None
    check_mask_dtypes(name, [(mask_name, None if hint_only else mask),
                             ("src_key_padding_mask", key_padding_mask)], x, need_weights=False)


class TransformerEncoderLayer(ArrayModule):
    """B ``torch.nn.TransformerEncoderLayer`` models.

    Built from array modules under torch's names (``self_attn``, ``linear1``,
    ``dropout``, ``linear2``, ``norm1``, ``norm2``, ``dropout1``, ``dropout2``),
    so the state_dict keys are torch's, each entry stacked on a leading B.

    ``src``: ``[B, S, N, d_model]`` (``[B, N, S, d_model]`` with ``batch_first``)
    or unbatched ``[B, S, d_model]``, shared (:func:`hfkern.broadcast`) or per
    model; the output has the same shape. ``src_mask`` and
    ``src_key_padding_mask`` follow :class:`hfkern.nn.MultiheadAttention`'s
    ``attn_mask`` and ``key_padding_mask`` rules: torch's shared shapes
    (``[S, S]``, ``[N*nhead, S, S]``; ``[N, S]``), one mask per model with a
    leading B (``[B, S, S]``; ``[B, N, S]``), or the 4-D ``[b, h, S, S]`` with
    ``b`` in (1, B) and ``h`` in (1, N*nhead). A 3-D ``src_mask`` with
    ``B == N*nhead > 1`` is ambiguous and raises ValueError naming the 4-D forms
    ``[1, N*nhead, S, S]`` (shared) and ``[B, 1, S, S]`` (per model). Float
    masks must be of src's dtype or float32 (their sum, where both are given),
    or raise TypeError before any work, as torch's ordinary path raises (not a
    ``src_mask`` the ``is_causal`` hint replaces); torch's fused eval path
    (batch_first, without grad) accepts other float dtypes.
    ``activation`` ("relu", "gelu" or a callable) must be element-wise: it is
    applied to the array tensor ``[B, ..., dim_feedforward]``. A module with
    parameters (torch's ``nn.PReLU()``) would be shared by the B models and is
    refused; give its array version (:class:`hfkern.nn.PReLU` with this B), one
    activation per model: it is a submodule (``activation.weight`` in the
    state_dict), model b of the array has model b's activation
    (:meth:`extract_model`, :meth:`to_modules`, :meth:`load_model`; a new one
    with :meth:`reset_model`), and :meth:`from_modules` builds it from the B
    torch layers' ``nn.PReLU`` activations.

    ``dropout`` is one probability for all models or one per model (a length-B
    sequence, 1-D numpy array or ``[B]`` tensor), used by every dropout of the
    layer (attention weights, ``dropout``, ``dropout1``, ``dropout2``) as in torch.

    In eval mode without grad, torch may run its fused fast path
    (``torch._transformer_encoder_layer_fwd``; batch_first among its
    conditions); this module always runs torch's ordinary path (as torch runs
    in training or with grad). The two agree to fp32 tolerance, except for a
    position whose every key is masked (a fully masked ``src_mask`` row, or a
    sample whose every key is padded): torch's fast path returns NaN there,
    its ordinary path and this module finite values (the attention gives zeros
    there, then the residual, norms and feed-forward apply).
    """

    _torch_cls = nn.TransformerEncoderLayer
    _per_model_fields = ("dropout",)

    def __init__(
        self, d_model: int, nhead: int, dim_feedforward: int = 2048, dropout: float = 0.1,
        activation: str | Callable[[torch.Tensor], torch.Tensor] = F.relu,
        layer_norm_eps: float = 1e-5, batch_first: bool = False, norm_first: bool = False,
        bias: bool = True, *, B: int, device=None, dtype=None,
    ):
        super().__init__()
        self._set_B(B, required=True)
        dropout = dropout_probability(dropout, self.B, "TransformerEncoderLayer", "dropout")
        template = nn.TransformerEncoderLayer(  # torch's argument checks and activation lookup
            d_model, nhead, dim_feedforward, 0.0, activation, layer_norm_eps, batch_first,
            norm_first, bias, device="meta",
        )
        if (isinstance(activation, nn.Module) and not isinstance(activation, ArrayModule)
                and any(True for _ in activation.state_dict())):
            raise TypeError(
                "TransformerEncoderLayer: an activation module with parameters or buffers would "
                f"be shared by the B models; got {type(activation).__name__}, expected a function, "
                "'relu'/'gelu', a stateless module or an hfkern array module"
            )
        if isinstance(activation, ArrayModule) and activation.B is not None and activation.B != self.B:
            raise ValueError(
                f"TransformerEncoderLayer: the activation {type(activation).__name__} holds "
                f"B={activation.B} models, expected B={self.B} (the layer's)"
            )
        factory = {"device": device, "dtype": dtype}
        self.self_attn = MultiheadAttention(
            d_model, nhead, dropout=dropout, bias=bias, batch_first=batch_first, B=self.B, **factory
        )
        self.linear1 = Linear(d_model, dim_feedforward, bias=bias, B=self.B, **factory)
        self.dropout = Dropout(dropout, B=self.B)
        self.linear2 = Linear(dim_feedforward, d_model, bias=bias, B=self.B, **factory)
        self.norm_first = norm_first
        self.norm1 = LayerNorm(d_model, eps=layer_norm_eps, bias=bias, B=self.B, **factory)
        self.norm2 = LayerNorm(d_model, eps=layer_norm_eps, bias=bias, B=self.B, **factory)
        self.dropout1 = Dropout(dropout, B=self.B)
        self.dropout2 = Dropout(dropout, B=self.B)
        self.activation_relu_or_gelu = template.activation_relu_or_gelu
        self.activation = activation if isinstance(activation, nn.Module) else template.activation

    @classmethod
    def _config_of(cls, module: nn.Module) -> dict:
        # torch keeps these only inside the submodules; the activation as the callable.
        return {
            "d_model": module.self_attn.embed_dim,
            "nhead": module.self_attn.num_heads,
            "dim_feedforward": module.linear1.out_features,
            "dropout": module.dropout.p,
            "activation": module.activation,
            "layer_norm_eps": module.norm1.eps,
            "batch_first": module.self_attn.batch_first,
            "norm_first": module.norm_first,
            "bias": module.linear1.bias is not None,
        }

    def forward(
        self,
        src: torch.Tensor,
        src_mask: torch.Tensor | None = None,
        src_key_padding_mask: torch.Tensor | None = None,
        is_causal: bool = False,
    ) -> torch.Tensor:
        """One encoder layer per model: ``[B, S, N, E]`` (or as in the class docstring) to the same shape."""
        x, src_mask, src_key_padding_mask, _ = _prepare_src(
            "TransformerEncoderLayer", self, src, src_mask, "src_mask", src_key_padding_mask)
        _check_src_mask_dtypes("TransformerEncoderLayer", x, src_mask, "src_mask", src_key_padding_mask,
                               is_causal)
        if self.norm_first:
            x = x + self._sa_block(self.norm1(x), src_mask, src_key_padding_mask, is_causal)
            x = x + self._ff_block(self.norm2(x))
        else:
            x = self.norm1(x + self._sa_block(x, src_mask, src_key_padding_mask, is_causal))
            x = self.norm2(x + self._ff_block(x))
        return x

    def _sa_block(self, x, attn_mask, key_padding_mask, is_causal):
        x = self.self_attn(x, x, x, attn_mask=attn_mask, key_padding_mask=key_padding_mask,
                           need_weights=False, is_causal=is_causal)[0]
        return self.dropout1(x)

    def _ff_block(self, x):
        return self.dropout2(self.linear2(self.dropout(self.activation(self.linear1(x)))))


# The final norms an array encoder accepts, and (by their _torch_cls) the torch
# norms from_modules converts.
_NORMS = (LayerNorm, RMSNorm)


def _check_num_layers(num_layers: object) -> int:
    if isinstance(num_layers, bool) or not isinstance(num_layers, int):
        raise TypeError(
            f"TransformerEncoder: expected num_layers to be an int >= 1, got "
            f"{type(num_layers).__name__} {num_layers!r}"
        )
    if num_layers < 1:
        raise ValueError(f"TransformerEncoder: expected num_layers >= 1, got {num_layers}")
    return num_layers


def _norm_names() -> str:
    return " or ".join(f"hfkern.nn.{c.__name__}" for c in _NORMS)


def _detect_is_causal(mask5: torch.Tensor | None, is_causal: bool | None, S: int) -> bool:
    """torch's ``_detect_is_causal_mask`` for the B models' masks at once.

    ``mask5`` is the float mask as a ``[1 or B, 1 or N, 1 or H, S, S]`` view.
    An explicit ``is_causal`` is returned as torch returns it (``is_causal is
    True``). Otherwise the hint is set when every model's mask is one ``[S, S]``
    mask equal to ``generate_square_subsequent_mask(S)``; torch never detects a
    per-(sample, head) mask. Where only some models' masks are causal the hint
    stays off: it only selects the implementation, the masks give the same result.
    """
    if is_causal is not None or mask5 is None:
        return _detect_is_causal_mask(None, is_causal, S)
    b, n, h = mask5.shape[:3]
    if n != 1 or h != 1:
        return False
    per_model = mask5.reshape(b, S, S)
    if b == 1:
        return _detect_is_causal_mask(per_model[0], None, S)
    causal = _generate_square_subsequent_mask(S, device=mask5.device, dtype=mask5.dtype)
    return bool((per_model == causal).all())


class TransformerEncoder(ArrayModule):
    """B ``torch.nn.TransformerEncoder`` models: a stack of array encoder layers and an optional norm.

    ``encoder_layer`` is an :class:`hfkern.nn.TransformerEncoderLayer` (B models);
    ``layers`` holds ``num_layers`` deep copies of it, so, as in torch, the
    layers of a model all start from that model's parameters in it. ``norm`` is
    None or an :class:`hfkern.nn.LayerNorm` / :class:`hfkern.nn.RMSNorm` of the
    same B (or without parameters), applied after the last layer; it is used as
    given, not copied. ``B`` may be omitted: it is the layer's. The state_dict
    keys are torch's (``layers.0.self_attn.in_proj_weight``, ...,
    ``norm.weight``), each entry stacked on a leading B.

    ``src``: ``[B, S, N, d_model]`` (``[B, N, S, d_model]`` with the layers'
    ``batch_first``) or unbatched ``[B, S, d_model]``, shared
    (:func:`hfkern.broadcast`) or per model; the output has the same shape.
    ``mask`` and ``src_key_padding_mask`` take every form
    :class:`hfkern.nn.TransformerEncoderLayer` takes for ``src_mask`` and
    ``src_key_padding_mask``: torch's shared ``[S, S]`` (e.g.
    ``nn.Transformer.generate_square_subsequent_mask(S)``) and
    ``[N*nhead, S, S]``; ``[N, S]``; one mask per model ``[B, S, S]``;
    ``[B, N, S]``; and the 4-D ``[b, h, S, S]`` with ``b`` in (1, B) and ``h``
    in (1, N*nhead). Bool masks (True = masked) become float masks once, as in
    torch; float masks take the layer's dtypes. ``is_causal=None`` detects a
    causal ``mask`` by torch's rule (every model's mask equal to
    ``generate_square_subsequent_mask(S)``); True or False is passed to every
    layer as torch passes it.

    ``enable_nested_tensor`` and ``mask_check`` are kept for :meth:`to_modules`.
    In eval mode without grad, torch runs a nested-tensor fast path (when
    ``src_key_padding_mask`` is given and its conditions hold) and a fused layer
    kernel; this module always runs the ordinary path, whose outputs match the
    fast path's to fp32 tolerance at every unpadded position. At padded
    positions torch's nested path returns zeros (before ``norm``) and this
    module the ordinary path's values, as torch does in training or with grad.
    Where a position's every key is masked (a fully masked ``mask`` row, or a
    sample whose every key is padded, outside the nested path), torch's fused
    layer kernel returns NaN and this module, as torch's ordinary path, finite
    values (see :class:`TransformerEncoderLayer`).
    """

    _torch_cls = nn.TransformerEncoder
    _config_fields = ("num_layers", "enable_nested_tensor", "mask_check")

    def __init__(
        self,
        encoder_layer: TransformerEncoderLayer,
        num_layers: int,
        norm: LayerNorm | RMSNorm | None = None,
        enable_nested_tensor: bool = True,
        mask_check: bool = True,
        *,
        B: int | None = None,
    ):
        super().__init__()
        if not isinstance(encoder_layer, TransformerEncoderLayer):
            if isinstance(encoder_layer, nn.TransformerEncoderLayer):
                hint = ("use hfkern.nn.TransformerEncoderLayer(..., B=B), or build the array from B "
                        "torch encoders with hfkern.nn.TransformerEncoder.from_modules(models)")
            else:
                hint = "use hfkern.nn.TransformerEncoderLayer(..., B=B)"
            raise TypeError(
                f"TransformerEncoder: expected encoder_layer to be an hfkern.nn.TransformerEncoderLayer "
                f"(B models), got {type(encoder_layer).__module__}.{type(encoder_layer).__name__}; {hint}"
            )
        num_layers = _check_num_layers(num_layers)
        if B is not None and check_B(B) != encoder_layer.B:
            raise ValueError(
                f"TransformerEncoder: B={B} but encoder_layer holds B={encoder_layer.B} models"
            )
        self._build(encoder_layer.B, [copy.deepcopy(encoder_layer) for _ in range(num_layers)],
                    norm, enable_nested_tensor, mask_check)

    def _build(self, B: int, layers: list[TransformerEncoderLayer], norm, enable_nested_tensor,
               mask_check) -> None:
        self._set_B(B, required=True)
        if norm is not None:
            if not isinstance(norm, _NORMS):
                if isinstance(norm, ArrayModule):
                    hint = f"use {_norm_names()}"
                else:
                    hint = (f"use {_norm_names()} (..., B=B), or build the array from B torch "
                            "encoders with hfkern.nn.TransformerEncoder.from_modules(models)")
                raise TypeError(
                    f"TransformerEncoder: expected norm to be None or {_norm_names()} (B models), "
                    f"got {type(norm).__module__}.{type(norm).__name__}; {hint}"
                )
            if norm.B is not None and norm.B != self.B:
                raise ValueError(
                    f"TransformerEncoder: norm holds B={norm.B} models, expected B={self.B} "
                    "(the encoder layer's)"
                )
        self.layers = nn.ModuleList(layers)
        self.num_layers = len(layers)
        self.norm = norm
        self.enable_nested_tensor = enable_nested_tensor
        self.mask_check = mask_check

    @classmethod
    def _config_of(cls, module: nn.Module) -> dict:
        # getattr: torch encoders pickled by older releases lack the last two.
        return {
            "num_layers": len(module.layers),
            "enable_nested_tensor": getattr(module, "enable_nested_tensor", True),
            "mask_check": getattr(module, "mask_check", True),
        }

    # ---- conversion -----------------------------------------------------
    @classmethod
    def from_modules(cls, modules: Sequence[nn.Module]) -> "TransformerEncoder":
        """An array of ``len(modules)`` models from torch ``nn.TransformerEncoder`` modules.

        Layer ``i`` of the array is :meth:`TransformerEncoderLayer.from_modules`
        of the models' layers ``i`` (so the layers' dropout probabilities may
        differ between models, and the layers of one model may differ from each
        other); the norm likewise. Parameters are copied with their
        ``requires_grad``, each submodule keeps its train/eval mode. Models that
        differ in anything else (``num_layers``, ``enable_nested_tensor``,
        ``mask_check``, the presence or type of ``norm``, a layer's or the norm's
        configuration, a mode) raise ValueError naming it.
        """
        modules = list(modules)
        name = cls.__name__
        if not modules:
            raise ValueError(f"{name}.from_modules: expected at least one module, got an empty sequence")
        for i, m in enumerate(modules):
            if not isinstance(m, nn.TransformerEncoder):
                raise TypeError(
                    f"{name}.from_modules: expected torch.nn.TransformerEncoder modules, "
                    f"got {type(m).__name__} at index {i}"
                )
        ref = modules[0]
        configs = [cls._config_of(m) for m in modules]
        for i, (m, cfg) in enumerate(zip(modules[1:], configs[1:]), start=1):
            for field, value in configs[0].items():
                if cfg[field] != value:
                    raise ValueError(
                        f"{name}.from_modules: field {field!r} differs: module 0 has {value!r}, "
                        f"module {i} has {cfg[field]!r}"
                    )
            if type(m.norm) is not type(ref.norm):
                raise ValueError(
                    f"{name}.from_modules: field 'norm' differs: module 0 has "
                    f"{type(ref.norm).__name__}, module {i} has {type(m.norm).__name__}"
                )
            for field, a, b in (("training", ref.training, m.training),
                                ("layers.training", ref.layers.training, m.layers.training)):
                if a != b:
                    raise ValueError(
                        f"{name}.from_modules: field {field!r} differs: module 0 has {a}, "
                        f"module {i} has {b}"
                    )
        if configs[0]["num_layers"] < 1:
            raise ValueError(f"{name}.from_modules: the modules have no layers (num_layers=0)")

        def convert(array_cls, path, parts):
            try:
                return array_cls.from_modules(parts)
            except (TypeError, ValueError) as ex:
                raise type(ex)(f"{name}.from_modules: in {path!r}: {ex}") from ex

        layers = [
            convert(TransformerEncoderLayer, f"layers.{i}", [m.layers[i] for m in modules])
            for i in range(configs[0]["num_layers"])
        ]
        norm = None
        if ref.norm is not None:
            array_norm = next((c for c in _NORMS if type(ref.norm) is c._torch_cls), None)
            if array_norm is None:
                raise TypeError(
                    f"{name}.from_modules: expected norm to be None or torch.nn."
                    f"{' or torch.nn.'.join(c._torch_cls.__name__ for c in _NORMS)}, "
                    f"got {type(ref.norm).__name__}"
                )
            norm = convert(array_norm, "norm", [m.norm for m in modules])
        array = cls.__new__(cls)
        ArrayModule.__init__(array)
        array._build(len(modules), layers, norm, configs[0]["enable_nested_tensor"],
                     configs[0]["mask_check"])
        # Each submodule keeps its own mode, as in the models.
        array.training = ref.training
        array.layers.training = ref.layers.training
        return array

    def _extract(self, b: int) -> nn.Module:
        """Model b as a ``torch.nn.TransformerEncoder`` (what ``extract_model``/``to_modules`` return).

        Its ``state_dict()`` equals this array's entries at index b (copies),
        its layers and norm are the array layers' and norm's model b (with model
        b's dropout probabilities), and every submodule has its array
        counterpart's train/eval mode. ``use_nested_tensor`` is what torch
        derives from the first layer; torch's warning that it is off is not
        repeated here.
        """
        layers = [layer._extract(b) for layer in self.layers]
        norm = None
        if self.norm is not None:
            norm = self.norm
            if norm.B is None:  # a norm without parameters: any B will do
                norm = copy.deepcopy(norm)
                norm.B = self.B
            norm = norm._extract(b)
        return self._torch_encoder(layers, norm)

    def _fresh_module(self, b: int) -> nn.Module:
        """A new torch encoder for model b, as torch builds one: the layer made once and
        deep-copied ``num_layers`` times (so every layer starts from the same weights)."""
        layer = self.layers[0]._fresh_module(b)
        norm = None if self.norm is None else (
            self.norm._fresh_module(b) if self.norm.B is not None else copy.deepcopy(self.norm))
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message="enable_nested_tensor is True")
            return nn.TransformerEncoder(layer, self.num_layers, norm, self.enable_nested_tensor,
                                         self.mask_check)

    def _torch_encoder(self, layers: list[nn.Module], norm: nn.Module | None) -> nn.Module:
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message="enable_nested_tensor is True")
            # num_layers=0: the layers are given, torch's clones would be discarded.
            m = nn.TransformerEncoder(layers[0], 0, norm, self.enable_nested_tensor, self.mask_check)
        m.layers = nn.ModuleList(layers)
        m.num_layers = self.num_layers
        m.training = self.training
        m.layers.training = self.layers.training
        return m

    # ---- forward --------------------------------------------------------
    def forward(
        self,
        src: torch.Tensor,
        mask: torch.Tensor | None = None,
        src_key_padding_mask: torch.Tensor | None = None,
        is_causal: bool | None = None,
    ) -> torch.Tensor:
        """The layers in turn, then ``norm``: ``[B, S, N, E]`` (or as in the class docstring), same shape out."""
        x, mask, src_key_padding_mask, mask5 = _prepare_src(
            "TransformerEncoder", self.layers[0], src, mask, "mask", src_key_padding_mask)
        S = x.size(2 if self.layers[0].self_attn.batch_first and x.dim() == 4 else 1)
        is_causal = _detect_is_causal(mask5, is_causal, S)
        _check_src_mask_dtypes("TransformerEncoder", x, mask, "mask", src_key_padding_mask, is_causal)
        for layer in self.layers:
            x = layer(x, src_mask=mask, src_key_padding_mask=src_key_padding_mask, is_causal=is_causal)
        if self.norm is not None:
            x = self.norm(x)
        return x
