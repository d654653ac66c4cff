"""Array transformer layers: B ``torch.nn.TransformerEncoderLayer`` models."""

from __future__ import annotations

import warnings
from typing import Callable

import torch
import torch.nn.functional as F
from torch import nn

from .._array import check_input
from ._base import ArrayModule
from .attention import MultiheadAttention, _float_mask, attn_mask_5d, key_padding_mask_5d
from .dropout import Dropout, dropout_probability
from .linear import Linear
from .normalization import LayerNorm

__all__ = ["TransformerEncoderLayer"]


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
    ``[1, N*nhead, S, S]`` (shared) and ``[B, 1, S, S]`` (per model).
    ``activation`` ("relu", "gelu" or a callable) must be element-wise: it is
    applied to the array tensor ``[B, ..., dim_feedforward]``.

    ``dropout`` is one probability for all models or one per model (a length-B
    sequence, 1-D numpy array or ``[B]`` tensor), used by every dropout of the
    layer (attention weights, ``dropout``, ``dropout1``, ``dropout2``) as in torch.
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
        name = "TransformerEncoderLayer"
        x = check_input(name, src, self.B, (2, 3), self.linear1.weight, "src")
        d_model = self.self_attn.embed_dim
        if x.size(-1) != d_model:
            raise ValueError(
                f"{name}: expected src with d_model={d_model} features in its last dim, "
                f"got shape {list(x.shape)}"
            )
        if (isinstance(src_mask, torch.Tensor) and isinstance(src_key_padding_mask, torch.Tensor)
                and src_mask.dtype != src_key_padding_mask.dtype):
            warnings.warn(
                "Support for mismatched src_key_padding_mask and src_mask is deprecated. "
                "Use same type for both instead.",
                stacklevel=2,
            )
        # As torch does, both masks become float here so attention sees one kind.
        src_key_padding_mask = _float_mask(name, src_key_padding_mask, "src_key_padding_mask", x)
        src_mask = _float_mask(name, src_mask, "src_mask", x)
        # The masks are checked here, under their names, and the attention mask
        # is handed on in an explicit 4-D form that self_attn cannot misread.
        batched = x.dim() == 4
        S = x.size(2 if self.self_attn.batch_first and batched else 1)
        N = (x.size(1) if self.self_attn.batch_first else x.size(2)) if batched else 1
        H = self.self_attn.num_heads
        key_padding_mask_5d(name, "src_key_padding_mask", src_key_padding_mask, self.B, N, S, batched)
        mask5 = attn_mask_5d(name, "src_mask", src_mask, self.B, H, N, S, S)
        if mask5 is not None:
            src_mask = mask5.reshape(mask5.size(0), mask5.size(1) * mask5.size(2), S, S)
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
