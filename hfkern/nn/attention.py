"""Array multi-head attention: B ``torch.nn.MultiheadAttention`` models.

The in-projections are batched matmuls over the array (one dense matmul for a
shared input), the attention runs over a merged batch of (model, sample, head)
triples: ``F.scaled_dot_product_attention`` when the weights are not returned,
an explicit softmax when they are, as torch does.
"""

from __future__ import annotations

import functools
import math
import warnings

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn import init

from .._array import check_input
from ._base import ArrayModule, stack_init
from .dropout import dropout_probability, per_model_dropout, refresh_factors, uniform_p
from .linear import Linear, array_linear

__all__ = ["MultiheadAttention"]


def _float_dtypes(query: torch.Tensor, need_weights: bool) -> str:
    """The float mask dtypes torch's attention takes with ``query``, in words: the query's, and
    also float32 where it calls scaled_dot_product_attention (no weights returned), which takes
    a bool mask, a float32 mask or one of the query's dtype."""
    also = "" if need_weights or query.dtype == torch.float32 else ", or torch.float32"
    return f"({query.dtype}, the query's{also})"


def _float_mask(module: str, mask: torch.Tensor | None, name: str, query: torch.Tensor,
                need_weights: bool) -> torch.Tensor | None:
    """torch's canonical mask: bool (True = masked) becomes an additive -inf float mask of the
    query's dtype; a float mask is kept as it is (its dtype is checked, as torch's attention
    checks it, by :func:`check_mask_dtypes` once the masks it uses are known)."""
    if mask is None:
        return None
    if not isinstance(mask, torch.Tensor):
        raise TypeError(f"{module}: expected {name} to be a torch.Tensor or None, got {type(mask).__name__}")
    if mask.device != query.device:
        raise ValueError(f"{module}: {name} is on {mask.device} but query is on {query.device}")
    if mask.dtype == torch.bool:
        return torch.zeros_like(mask, dtype=query.dtype).masked_fill_(mask, float("-inf"))
    if not mask.is_floating_point():
        raise TypeError(
            f"{module}: expected {name} of dtype torch.bool or a floating dtype "
            f"{_float_dtypes(query, need_weights)}, got {mask.dtype}")
    return mask


def check_mask_dtypes(module: str, masks: list[tuple[str, torch.Tensor | None]], query: torch.Tensor,
                      need_weights: bool) -> None:
    """Refuse, as torch's attention does, float masks of a dtype it does not take, before any work.

    ``masks``: ``(name, mask)`` for the attention mask and the key padding mask that the
    attention uses (after :func:`_float_mask`; None for one not given, or not used: torch drops
    the attention mask for the ``is_causal`` hint). torch adds the two, so their sum's dtype
    (type promotion) is what must be the query's (with the weights: ``baddbmm``) or, without,
    the query's or float32 (``scaled_dot_product_attention``). torch raises deep inside either;
    this names the masks whose dtypes keep the sum from being one of those.
    """
    given = [(name, mask) for name, mask in masks if mask is not None]
    if not given:
        return
    accepted = (query.dtype,) if need_weights else (query.dtype, torch.float32)
    total = functools.reduce(torch.promote_types, (mask.dtype for _, mask in given))
    if total in accepted:
        return
    bad = [(name, mask) for name, mask in given if mask.dtype not in accepted]
    names = " and ".join(name for name, _ in bad)
    dtypes = " and ".join(str(mask.dtype) for _, mask in bad)
    summed = ""
    if len(given) > 1:
        summed = (f"; {' and '.join(name for name, _ in given)} are added, their sum ({total}) must "
                  "have such a dtype")
    raise TypeError(
        f"{module}: expected {names} of dtype torch.bool or a floating dtype "
        f"{_float_dtypes(query, need_weights)}, got {dtypes}{summed}"
    )


def key_padding_mask_5d(
    module: str, name: str, kpm: torch.Tensor | None, B: int, N: int, S: int, batched: bool
) -> torch.Tensor | None:
    """A key padding mask as a ``[1 or B, N, 1, 1, S]`` view.

    Shared: torch's ``[N, S]`` (unbatched ``[S]``); per model: ``[B, N, S]``
    (unbatched ``[B, S]``). The ranks differ, so the shape always decides.
    """
    if kpm is None:
        return None
    shared = [N, S] if batched else [S]
    if list(kpm.shape) == shared:
        kpm = kpm.unsqueeze(0)
    elif list(kpm.shape) != [B] + shared:
        raise ValueError(
            f"{module}: expected {name} of shape {shared} (shared) or {[B] + shared} (per model), "
            f"got {list(kpm.shape)}"
        )
    return kpm.reshape(kpm.size(0), N, 1, 1, S)


def attn_mask_5d(
    module: str, name: str, mask: torch.Tensor | None, B: int, H: int, N: int, L: int, S: int
) -> torch.Tensor | None:
    """An attention mask as a ``[1 or B, 1 or N, 1 or H, L, S]`` view (N = 1 for unbatched inputs).

    Accepted: torch's shared ``[L, S]`` and ``[N*H, L, S]``; one ``[L, S]`` mask
    per model stacked as ``[B, L, S]``; and the explicit 4-D forms
    ``[b, h, L, S]`` with b in {1, B} (shared or per model) and h in {1, N*H}
    (one mask, or one per (sample, head)). A 3-D mask whose first dim is both B
    and N*H (and B > 1) could mean either, so it is refused with the two
    explicit 4-D spellings.
    """
    if mask is None:
        return None
    shape = list(mask.shape)
    NH = N * H
    forms = (f"{[L, S]} or {[NH, L, S]} (shared), {[B, L, S]} (one mask per model), or 4-D "
             f"[b, h, {L}, {S}] with b in (1, B={B}) and h in (1, N*num_heads={NH})")
    if shape == [L, S]:
        return mask.view(1, 1, 1, L, S)
    if len(shape) == 3 and shape[1:] == [L, S] and shape[0] in (B, NH):
        if B == NH and B > 1:
            raise ValueError(
                f"{module}: {name} of shape {shape} is ambiguous: its first dim {B} is both the "
                f"array size B and N*num_heads ({N}*{H}), so it could be torch's shared per-(sample, "
                f"head) mask or one [L, S] mask per model; pass it as {[1, NH, L, S]} for the shared "
                f"per-(sample, head) mask, or as {[B, 1, L, S]} for one mask per model"
            )
        if shape[0] == NH:
            return mask.view(1, N, H, L, S)
        return mask.view(B, 1, 1, L, S)
    if len(shape) == 4 and shape[2:] == [L, S] and shape[0] in (1, B) and shape[1] in (1, NH):
        b, h = shape[:2]
        return mask.view(b, 1, 1, L, S) if h == 1 else mask.view(b, N, H, L, S)
    raise ValueError(f"{module}: expected {name} of shape {forms}, got {shape}")


class MultiheadAttention(ArrayModule):
    """B ``torch.nn.MultiheadAttention`` models.

    Parameters (torch's names, each stacked on a leading B): ``in_proj_weight``
    ``[B, 3E, E]`` (or ``q_proj_weight`` ``[B, E, E]``, ``k_proj_weight``
    ``[B, E, kdim]``, ``v_proj_weight`` ``[B, E, vdim]`` when ``kdim`` or ``vdim``
    differs from ``E``), ``in_proj_bias`` ``[B, 3E]``, ``bias_k``/``bias_v``
    ``[B, 1, 1, E]`` and ``out_proj`` (an :class:`hfkern.nn.Linear`).

    Inputs (each of query, key, value may be shared via :func:`hfkern.broadcast`
    or per model): ``[B, L, N, E]`` (``[B, N, L, E]`` with ``batch_first``) or
    unbatched ``[B, L, E]``; key and value likewise with source length S and
    feature sizes ``kdim``/``vdim``.

    Masks (bool: True = not allowed to attend; float: added to the scores):

    - ``key_padding_mask``: shared as torch's ``[N, S]`` (unbatched ``[S]``) or
      per model ``[B, N, S]`` (unbatched ``[B, S]``).
    - ``attn_mask``: shared as torch's ``[L, S]`` or ``[N*num_heads, L, S]``
      (unbatched ``[num_heads, L, S]``), per model as ``[B, L, S]`` (one
      ``[L, S]`` mask per model, stacked), or 4-D ``[b, h, L, S]`` with ``b``
      1 (shared) or B (per model) and ``h`` 1 or ``N*num_heads`` (unbatched:
      ``num_heads``). A 3-D mask with ``B == N*num_heads > 1`` could be either
      3-D form and raises ValueError: spell it ``[1, N*num_heads, L, S]`` or
      ``[B, 1, L, S]``.
    - float masks take torch's dtypes: the query's, and without weights
      (``need_weights=False``) also float32; where both masks are given, their
      sum's (by type promotion). Others raise TypeError before any work, where
      torch raises deep inside; not the ``attn_mask`` that the ``is_causal``
      hint replaces (no weights, no ``key_padding_mask``), which torch ignores.

    ``dropout`` is one probability for all models or one per model (a length-B
    sequence, 1-D numpy array or ``[B]`` tensor): model b drops its attention
    weights with ``dropout[b]`` in training. With per-model probabilities the
    attention is computed with an explicit softmax (scaled_dot_product_attention
    takes one probability), also when the weights are not returned.

    Outputs: ``attn_output`` with the query's shape, and ``attn_weights``
    ``[B, N, L, S]`` averaged over heads or ``[B, N, num_heads, L, S]``
    (unbatched: without N), or None when ``need_weights=False``.

    In eval mode without grad, torch may run a fused fast path
    (``torch._native_multi_head_attention``; batch_first self-attention among
    its conditions); this module always runs torch's ordinary path (as torch
    runs in training or with grad). The two agree, except for a query whose
    every key is masked (a fully masked ``attn_mask`` row, or a sample whose
    every key is padded): without the weights, torch's fast path returns NaN
    for it and its ordinary path, and this module, zeros. (With the weights,
    both of torch's paths and this module return NaN there.)
    """

    _torch_cls = nn.MultiheadAttention
    _per_model_fields = ("dropout",)

    def __init__(
        self, embed_dim, num_heads, dropout=0.0, bias=True, add_bias_kv=False,
        add_zero_attn=False, kdim=None, vdim=None, batch_first=False, *, B,
        device=None, dtype=None,
    ):
        super().__init__()
        self._set_B(B, required=True)
        self._dropout_factors: dict = {}
        self.dropout = dropout
        template = nn.MultiheadAttention(  # torch's argument checks
            embed_dim, num_heads, 0.0, bias, add_bias_kv, add_zero_attn, kdim, vdim,
            batch_first, device="meta",
        )
        for field in ("embed_dim", "kdim", "vdim", "_qkv_same_embed_dim", "num_heads",
                      "batch_first", "head_dim", "add_zero_attn"):
            setattr(self, field, getattr(template, field))
        E = embed_dim
        factory = {"device": device, "dtype": dtype}
        if self._qkv_same_embed_dim:
            self.in_proj_weight = nn.Parameter(torch.empty((self.B, 3 * E, E), **factory))
            self.register_parameter("q_proj_weight", None)
            self.register_parameter("k_proj_weight", None)
            self.register_parameter("v_proj_weight", None)
        else:
            self.q_proj_weight = nn.Parameter(torch.empty((self.B, E, E), **factory))
            self.k_proj_weight = nn.Parameter(torch.empty((self.B, E, self.kdim), **factory))
            self.v_proj_weight = nn.Parameter(torch.empty((self.B, E, self.vdim), **factory))
            self.register_parameter("in_proj_weight", None)
        if bias:
            self.in_proj_bias = nn.Parameter(torch.empty((self.B, 3 * E), **factory))
        else:
            self.register_parameter("in_proj_bias", None)
        self.out_proj = Linear(E, E, bias=bias, B=self.B, **factory)
        if add_bias_kv:
            self.bias_k = nn.Parameter(torch.empty((self.B, 1, 1, E), **factory))
            self.bias_v = nn.Parameter(torch.empty((self.B, 1, 1, E), **factory))
        else:
            self.bias_k = self.bias_v = None
        self._reset_parameters()

    def _reset_parameters(self) -> None:
        """torch's ``_reset_parameters``, drawn independently for each model."""
        if self._qkv_same_embed_dim:
            stack_init([self.in_proj_weight], init.xavier_uniform_)
        else:
            stack_init([self.q_proj_weight, self.k_proj_weight, self.v_proj_weight],
                       lambda q, k, v: [init.xavier_uniform_(t) for t in (q, k, v)])
        if self.in_proj_bias is not None:
            with torch.no_grad():
                self.in_proj_bias.zero_()
                self.out_proj.bias.zero_()
        if self.bias_k is not None:
            stack_init([self.bias_k, self.bias_v],
                       lambda k, v: [init.xavier_normal_(t) for t in (k, v)])

    @property
    def dropout(self) -> float | tuple[float, ...]:
        """The attention-weight dropout probability: one float, or a tuple of B floats."""
        return self._dropout

    @dropout.setter
    def dropout(self, value) -> None:
        d = dropout_probability(value, self.B, "MultiheadAttention", "dropout")
        self._dropout, self._dropout_uniform = d, uniform_p(d)
        # per-model values live in device tensors a captured graph reads: written in place
        refresh_factors(self._dropout_factors, d)

    def __setstate__(self, state: dict) -> None:
        super().__setstate__(state)
        self._dropout_uniform = uniform_p(self._dropout)  # (pickled before it was kept)

    def _graph_state(self) -> float | None:
        """The host value this layer's forward computes with beyond its mode (see
        :func:`hfkern.capture_step`): the common dropout probability, None where it is one per
        model (device tensors, written in place when it changes)."""
        return self._dropout_uniform

    @classmethod
    def _config_of(cls, module: nn.Module) -> dict:
        # torch keeps "bias" and "add_bias_kv" only as the presence of parameters.
        return {
            "embed_dim": module.embed_dim,
            "num_heads": module.num_heads,
            "dropout": module.dropout,
            "bias": module.in_proj_bias is not None,
            "add_bias_kv": module.bias_k is not None,
            "add_zero_attn": module.add_zero_attn,
            "kdim": module.kdim,
            "vdim": module.vdim,
            "batch_first": module.batch_first,
        }

    # ---- input checks ---------------------------------------------------
    def _check_inputs(self, query, key, value) -> bool:
        name = "MultiheadAttention"
        w = self.in_proj_weight if self.in_proj_weight is not None else self.q_proj_weight
        check_input(name, query, self.B, (2, 3), w, "query")
        batched = query.dim() == 4
        for t, tname in ((key, "key"), (value, "value")):
            check_input(name, t, self.B, (query.dim() - 1,), w, tname)
        for t, tname, dim in ((query, "query", self.embed_dim), (key, "key", self.kdim),
                              (value, "value", self.vdim)):
            if t.size(-1) != dim:
                raise ValueError(
                    f"{name}: expected {tname} with {dim} features in its last dim, "
                    f"got shape {list(t.shape)}"
                )
        if key.shape[1:-1] != value.shape[1:-1]:
            raise ValueError(
                f"{name}: key and value must agree in all but the feature dim, "
                f"got key {list(key.shape)} and value {list(value.shape)}"
            )
        if batched:
            n_dim = 1 if self.batch_first else 2
            if key.size(n_dim) != query.size(n_dim):
                layout = "[B, N, L, E]" if self.batch_first else "[B, L, N, E]"
                raise ValueError(
                    f"{name}: query and key must have the same batch size N (layout {layout}), "
                    f"got query {list(query.shape)} and key {list(key.shape)}"
                )
        return batched

    # ---- forward --------------------------------------------------------
    def forward(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        key_padding_mask: torch.Tensor | None = None,
        need_weights: bool = True,
        attn_mask: torch.Tensor | None = None,
        average_attn_weights: bool = True,
        is_causal: bool = False,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Attention of each model over its own (or the shared) inputs.

        Shapes as in the class docstring. ``is_causal`` is torch's hint that
        ``attn_mask`` is causal: it requires ``attn_mask`` and, as in torch, is
        used in place of it only when there is no ``key_padding_mask`` and the
        weights are not needed. Then the mask is scaled_dot_product_attention's
        causal one, as in torch: query i attends key columns 0 to i of all the
        key columns, those ``add_bias_kv`` and ``add_zero_attn`` append included,
        and ``attn_mask`` itself is not used, also with per-model dropout (where
        the attention is an explicit softmax).
        """
        name = "MultiheadAttention"
        batched = self._check_inputs(query, key, value)
        B, H, D, E = self.B, self.num_heads, self.head_dim, self.embed_dim
        if not batched:
            L, S, N = query.size(1), key.size(1), 1
        elif self.batch_first:
            N, L, S = query.size(1), query.size(2), key.size(2)
        else:
            L, N, S = query.size(1), query.size(2), key.size(1)

        if (isinstance(key_padding_mask, torch.Tensor) and isinstance(attn_mask, torch.Tensor)
                and key_padding_mask.dtype != attn_mask.dtype):
            warnings.warn(
                "Support for mismatched key_padding_mask and attn_mask is deprecated. "
                "Use same type for both instead.",
                stacklevel=2,
            )
        kpm = _float_mask(name, key_padding_mask, "key_padding_mask", query, need_weights)
        mask = _float_mask(name, attn_mask, "attn_mask", query, need_weights)
        kpm = key_padding_mask_5d(name, "key_padding_mask", kpm, B, N, S, batched)
        mask = attn_mask_5d(name, "attn_mask", mask, B, H, N, L, S)
        if is_causal and mask is None:
            raise RuntimeError(
                "MultiheadAttention: need attn_mask if specifying the is_causal hint "
                "(torch.nn.Transformer.generate_square_subsequent_mask makes one)"
            )
        # torch uses the is_causal hint in place of attn_mask (whatever its dtype) when it returns
        # no weights and has no key padding mask; otherwise it adds the two masks.
        hint_only = is_causal and kpm is None and not need_weights
        check_mask_dtypes(name, [("attn_mask", None if hint_only else mask), ("key_padding_mask", kpm)],
                          query, need_weights)
        p = self._dropout_uniform
        # Per-model dropout probabilities need the weights explicitly: SDPA takes one.
        per_model_drop = self.training and p is None
        explicit = need_weights or per_model_drop
        # torch hands scaled_dot_product_attention is_causal=True and no mask for the hint, and
        # is_causal=False otherwise (with the weights, or a key padding mask merged into the mask).
        is_causal = hint_only
        if hint_only:
            mask = None  # the causal mask replaces attn_mask, whatever attn_mask holds

        q, k, v = self._in_projection(query, key, value)
        q, k, v = (self._split_heads(t, batched) for t in (q, k, v))  # [B, N, H, len, D]

        if self.bias_k is not None:
            k = torch.cat([k, self.bias_k.view(B, 1, H, 1, D).expand(B, N, H, 1, D)], dim=3)
            v = torch.cat([v, self.bias_v.view(B, 1, H, 1, D).expand(B, N, H, 1, D)], dim=3)
            mask = None if mask is None else F.pad(mask, (0, 1))
            kpm = None if kpm is None else F.pad(kpm, (0, 1))
        if self.add_zero_attn:
            k = torch.cat([k, k.new_zeros(B, N, H, 1, D)], dim=3)
            v = torch.cat([v, v.new_zeros(B, N, H, 1, D)], dim=3)
            mask = None if mask is None else F.pad(mask, (0, 1))
            kpm = None if kpm is None else F.pad(kpm, (0, 1))
        if kpm is not None:
            mask = kpm if mask is None else mask + kpm
        if hint_only and explicit:
            # Per-model dropout without SDPA: SDPA's causal mask, top-left aligned over every key
            # column, also those add_bias_kv and add_zero_attn appended (so those are masked).
            keep = torch.ones(L, k.size(3), dtype=torch.bool, device=q.device).tril()
            mask = q.new_zeros(L, k.size(3)).masked_fill_(~keep, float("-inf")).view(1, 1, 1, L, -1)
            is_causal = False

        # Merge (model, sample, head) into SDPA's two batch dims, choosing the
        # pair that q's memory order merges without a copy.
        merge_nh = N == 1 or H == 1 or q.stride(1) == H * q.stride(2)
        q4, k4, v4 = (self._merge(t, merge_nh) for t in (q, k, v))
        mask4 = None if mask is None else self._merge_mask(mask, merge_nh, N)
        dropout_p = p if self.training and p is not None else 0.0

        if explicit:
            scores = torch.matmul(q4 * math.sqrt(1.0 / D), k4.transpose(-2, -1))
            empty = None
            if mask4 is not None:
                # The mask's dtype is one torch takes (checked above): the query's, which autocast
                # may have lowered in the projections (torch's baddbmm is cast the same way); or,
                # without weights (per-model dropout), float32, which torch hands to
                # scaled_dot_product_attention (the is_causal hint's mask is made here, of q's dtype).
                scores = scores + mask4.to(scores.dtype)
                if not need_weights:
                    # What scaled_dot_product_attention does, which torch's module calls here: a
                    # query whose every key is masked attends to nothing (zeros, not NaN), and its
                    # scores get no gradient (a NaN softmax row would give q and k NaN gradients).
                    empty = torch.isneginf(scores).all(dim=-1, keepdim=True)
                    scores = scores.masked_fill(empty, 0.0)
            weights = torch.softmax(scores, dim=-1)
            if empty is not None:
                weights = weights.masked_fill(empty, 0.0)
            if per_model_drop:
                # the merged batch dim starts with the array dim in both merges
                cache = None if torch.compiler.is_compiling() else self._dropout_factors
                dropped = per_model_dropout(weights.view(B, -1), self.dropout, 2, cache=cache)
                weights = dropped.view(weights.shape)
            elif dropout_p > 0.0:
                weights = F.dropout(weights, p=dropout_p)
            out = torch.matmul(weights, v4)
        else:
            out = F.scaled_dot_product_attention(q4, k4, v4, mask4, dropout_p, is_causal)

        out = out.view(B, N, H, L, D)
        if not batched:
            out = out[:, 0].transpose(1, 2).reshape(B, L, E)
        elif self.batch_first:
            out = out.transpose(2, 3).reshape(B, N, L, E)
        else:
            out = out.permute(0, 3, 1, 2, 4).reshape(B, L, N, E)
        out = self.out_proj(out)
        if not need_weights:
            return out, None
        weights = weights.view(B, N, H, L, weights.size(-1))
        if average_attn_weights:
            weights = weights.mean(dim=2)
        return out, (weights if batched else weights[:, 0])

    def _in_projection(self, query, key, value):
        """Per-model projections ``[B, *, E]``; self-attention projects once."""
        E, b = self.embed_dim, self.in_proj_bias
        bq, bk, bv = (None, None, None) if b is None else (b[:, :E], b[:, E:2 * E], b[:, 2 * E:])
        if not self._qkv_same_embed_dim:
            return (array_linear(query, self.q_proj_weight, bq),
                    array_linear(key, self.k_proj_weight, bk),
                    array_linear(value, self.v_proj_weight, bv))
        w = self.in_proj_weight
        if query is key and key is value:
            qkv = array_linear(query, w, b).unflatten(-1, (3, E))
            return qkv.select(-2, 0), qkv.select(-2, 1), qkv.select(-2, 2)
        q = array_linear(query, w[:, :E], bq)
        if key is value:
            kv = array_linear(key, w[:, E:], None if b is None else b[:, E:]).unflatten(-1, (2, E))
            return q, kv.select(-2, 0), kv.select(-2, 1)
        return q, array_linear(key, w[:, E:2 * E], bk), array_linear(value, w[:, 2 * E:], bv)

    def _split_heads(self, t: torch.Tensor, batched: bool) -> torch.Tensor:
        """``[B, *, E]`` in the input layout -> a ``[B, N, H, len, D]`` view."""
        t = t.unflatten(-1, (self.num_heads, self.head_dim))
        if not batched:
            t = t.unsqueeze(1)
        elif not self.batch_first:
            t = t.transpose(1, 2)
        return t.transpose(2, 3)

    def _merge(self, t: torch.Tensor, merge_nh: bool) -> torch.Tensor:
        B, N, H = t.shape[:3]
        if merge_nh:
            return t.reshape(B, N * H, *t.shape[3:])
        return t.reshape(B * N, H, *t.shape[3:])

    def _merge_mask(self, m: torch.Tensor, merge_nh: bool, N: int) -> torch.Tensor:
        """A broadcastable ``[1|B, 1|N, 1|H, 1|L, S]`` mask in ``_merge``'s batch dims."""
        b, n, h, l, s = m.shape
        B, H = self.B, self.num_heads
        if merge_nh:
            if n == 1 and h == 1:
                return m.reshape(b, 1, l, s)
            return m.expand(b, N, H, l, s).reshape(b, N * H, l, s)
        if b == 1 and n == 1:
            return m.reshape(1, h, l, s)
        return m.expand(B, N, h, l, s).reshape(B * N, h, l, s)
