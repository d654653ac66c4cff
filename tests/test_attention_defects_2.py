"""Attention and encoder defects (2): the is_causal hint with per-model dropout, fully masked rows
against torch's eval fast path, per-model masks of a rank torch refuses in fused models, and the
error for the is_causal hint without a mask in the encoder (layer)."""

import copy

import pytest
import torch
from torch import nn
from torch.testing import assert_close

import hfkern
import hfkern.nn as hnn

L, N, E, H, FF = 4, 2, 4, 2, 8
F64 = {"rtol": 1e-9, "atol": 1e-10}
F32 = {"rtol": 1e-5, "atol": 1e-6}


def _causal(n, dtype=torch.float64):
    return nn.Transformer.generate_square_subsequent_mask(n, dtype=dtype)


# ---- 1. the is_causal hint with per-model dropout ---------------------------------------------
@pytest.mark.parametrize("extra", [{"add_zero_attn": True}, {"add_bias_kv": True},
                                   {"add_zero_attn": True, "add_bias_kv": True}])
@pytest.mark.parametrize("batched", [True, False])
def test_per_model_dropout_causal_hint_masks_the_appended_key_columns(extra, batched):
    """torch hands scaled_dot_product_attention is_causal=True, whose causal mask spans every key
    column, also those add_bias_kv / add_zero_attn append; model 0 (p=0) must equal torch's."""
    torch.manual_seed(0)
    mods = [nn.MultiheadAttention(E, H, dropout=p, dtype=torch.float64, **extra) for p in (0.0, 0.5)]
    arr = hnn.MultiheadAttention.from_modules(mods)
    assert arr.training and arr.dropout == (0.0, 0.5)
    shape = (2, L, N, E) if batched else (2, L, E)
    x = torch.randn(shape, dtype=torch.float64, requires_grad=True)
    x0 = x[0].detach().clone().requires_grad_()
    ref = mods[0](x0, x0, x0, attn_mask=_causal(L), is_causal=True, need_weights=False)[0]
    out, w = arr(x, x, x, attn_mask=_causal(L), is_causal=True, need_weights=False)
    assert w is None
    assert_close(out[0], ref, **F64)
    g = torch.randn_like(ref)
    ref.backward(g)
    (out[0] * g).sum().backward()
    assert_close(x.grad[0], x0.grad, **F64)
    assert_close(arr.in_proj_weight.grad[0], mods[0].in_proj_weight.grad, **F64)


@pytest.mark.parametrize("add_zero_attn", [False, True])
def test_per_model_dropout_causal_hint_ignores_a_non_causal_attn_mask(add_zero_attn):
    """With the hint (no weights, no key padding mask) torch does not use attn_mask at all."""
    torch.manual_seed(1)
    mods = [nn.MultiheadAttention(E, H, dropout=p, add_zero_attn=add_zero_attn, batch_first=True,
                                  dtype=torch.float64) for p in (0.0, 0.3, 0.6)]
    arr = hnn.MultiheadAttention.from_modules(mods)
    x = torch.randn(3, N, L, E, dtype=torch.float64)
    mask = torch.randn(L, L, dtype=torch.float64)  # not causal: torch ignores it for the hint
    ref = mods[0](x[0], x[0], x[0], attn_mask=mask, is_causal=True, need_weights=False)[0]
    out = arr(x, x, x, attn_mask=mask, is_causal=True, need_weights=False)[0]
    assert_close(out[0], ref, **F64)
    # the same as with one dropout probability for all models (scaled_dot_product_attention)
    arr.dropout = 0.0
    assert_close(arr(x, x, x, attn_mask=mask, is_causal=True, need_weights=False)[0][0], ref, **F64)


def test_per_model_dropout_causal_hint_still_uses_the_mask_with_weights_or_key_padding():
    """Where torch does not take the hint (weights returned, or a key padding mask), the mask counts."""
    torch.manual_seed(2)
    mods = [nn.MultiheadAttention(E, H, dropout=p, add_zero_attn=True, dtype=torch.float64)
            for p in (0.0, 0.5)]
    arr = hnn.MultiheadAttention.from_modules(mods)
    x = torch.randn(2, L, N, E, dtype=torch.float64)
    mask = torch.randn(L, L, dtype=torch.float64)
    kpm = torch.zeros(N, L, dtype=torch.float64)
    kpm[1, -1] = float("-inf")
    ref = mods[0](x[0], x[0], x[0], attn_mask=mask, key_padding_mask=kpm, is_causal=True,
                  need_weights=False)[0]
    out = arr(x, x, x, attn_mask=mask, key_padding_mask=kpm, is_causal=True, need_weights=False)[0]
    assert_close(out[0], ref, **F64)
    torch.manual_seed(3)
    ref, ref_w = mods[0](x[0], x[0], x[0], attn_mask=mask, is_causal=True, need_weights=True)
    torch.manual_seed(3)
    out, w = arr(x, x, x, attn_mask=mask, is_causal=True, need_weights=True)
    assert_close(w[0], ref_w, **F64)
    assert_close(out[0], ref, **F64)


@pytest.mark.parametrize("encoder", [False, True])
def test_encoder_per_model_dropout_causal_hint_ignores_a_non_causal_mask(encoder):
    """The encoder (layer) passes is_causal on to self_attn, as torch does."""
    torch.manual_seed(4)
    layers = [nn.TransformerEncoderLayer(E, H, FF, dropout=p, dtype=torch.float64) for p in (0.0, 0.4)]
    for m in layers[1:]:  # model 1's dropout is random: compare model 0 only
        m.load_state_dict(layers[0].state_dict())
    if encoder:
        mods = [nn.TransformerEncoder(m, 2, enable_nested_tensor=False) for m in layers]
        arr = hnn.TransformerEncoder.from_modules(mods)
    else:
        mods = layers
        arr = hnn.TransformerEncoderLayer.from_modules(mods)
    x = torch.randn(2, L, N, E, dtype=torch.float64)
    mask = torch.randn(L, L, dtype=torch.float64)
    kw = {"mask" if encoder else "src_mask": mask, "is_causal": True}
    ref = mods[0](x[0], **kw)
    out = arr(x, **kw)
    assert_close(out[0], ref, **F64)


# ---- 2. a fully masked row in eval without grad: torch's ordinary path, not its fast path's NaN --
def _fully_masked():
    kpm = torch.tensor([[True] * L, [False] * (L - 1) + [True]])  # sample 0: every key padded
    am = torch.zeros(L, L, dtype=torch.bool)
    am[1] = True  # query 1 attends to nothing
    return kpm, am


@pytest.mark.parametrize("which", ["key_padding_mask", "attn_mask"])
def test_mha_fully_masked_row_eval_no_grad_follows_torchs_ordinary_path(which):
    torch.manual_seed(5)
    mods = [nn.MultiheadAttention(E, H, batch_first=True).eval() for _ in range(2)]
    arr = hnn.MultiheadAttention.from_modules(mods).eval()
    x = torch.randn(2, N, L, E)
    kpm, am = _fully_masked()
    kw = {which: kpm if which == "key_padding_mask" else am, "need_weights": False}
    xb = x[0]
    ordinary = mods[0](xb, xb, xb, **kw)[0].detach()  # grad enabled: torch's ordinary path
    with torch.no_grad():
        out = arr(x, x, x, **kw)[0]
    assert not out.isnan().any()
    assert_close(out[0], ordinary, **F32)
    # where the weights are returned, torch's paths and the array give NaN alike
    ordinary_w = mods[0](xb, xb, xb, **{**kw, "need_weights": True})[0].detach()
    with torch.no_grad():
        out_w = arr(x, x, x, **{**kw, "need_weights": True})[0]
    assert_close(out_w[0], ordinary_w, **F32, equal_nan=True)


@pytest.mark.parametrize("norm_first", [False, True])
@pytest.mark.parametrize("which", ["key_padding", "mask"])
@pytest.mark.parametrize("encoder", [False, True])
def test_encoder_fully_masked_row_eval_no_grad_follows_torchs_ordinary_path(norm_first, which, encoder):
    torch.manual_seed(6)
    layers = [nn.TransformerEncoderLayer(E, H, FF, 0.0, batch_first=True, norm_first=norm_first)
              for _ in range(2)]
    if encoder:
        mods = [nn.TransformerEncoder(m, 2, enable_nested_tensor=False).eval() for m in layers]
        arr = hnn.TransformerEncoder.from_modules(mods)
        mask_name = "mask"
    else:
        mods = [m.eval() for m in layers]
        arr = hnn.TransformerEncoderLayer.from_modules(mods)
        mask_name = "src_mask"
    x = torch.randn(2, N, L, E)
    kpm, am = _fully_masked()
    kw = {"src_key_padding_mask": kpm} if which == "key_padding" else {mask_name: am}
    ordinary = mods[0](x[0], **kw).detach()  # grad enabled: torch's ordinary path
    with torch.no_grad():
        out = arr(x, **kw)
    assert torch.isfinite(out).all()
    assert_close(out[0], ordinary, **F32)


@pytest.mark.parametrize("cls", [hnn.MultiheadAttention, hnn.TransformerEncoderLayer, hnn.TransformerEncoder])
def test_docstrings_state_the_fast_path_nan_difference(cls):
    doc = " ".join(cls.__doc__.split())
    assert "NaN" in doc and "ordinary path" in doc, cls.__name__


# ---- 3. fused models: per-model masks of a rank torch refuses -----------------------------------
class _MHA(nn.Module):
    def __init__(self, batch_first=True):
        super().__init__()
        self.attn = nn.MultiheadAttention(4, 2, batch_first=batch_first)

    def forward(self, x, mask=None, kpm=None):
        return self.attn(x, x, x, attn_mask=mask, key_padding_mask=kpm, need_weights=False)[0]


def test_fuse_per_model_1d_attn_mask_raises_as_torch_does():
    """B == L: B stacked [S] masks must not pass for one shared [L, S] mask."""
    torch.manual_seed(7)
    B = n_len = 3
    models = [_MHA() for _ in range(B)]
    fused = hfkern.fuse(models)
    x = torch.randn(B, 2, n_len, 4)
    masks = torch.randn(B, n_len)
    with pytest.raises(AssertionError, match="attn_mask"):
        models[0](x[0], masks[0])
    with pytest.raises(ValueError, match=r"attn_mask.*2-D or 3-D.*1-D mask \[3\] per model"):
        fused(x, masks)


def test_fuse_per_model_1d_key_padding_mask_with_batched_input_raises_as_torch_does():
    """B == N: B stacked [S] key padding masks must not pass for one shared [N, S] mask."""
    torch.manual_seed(8)
    B, n_len = 2, 3
    models = [_MHA() for _ in range(B)]
    fused = hfkern.fuse(models)
    x = torch.randn(B, B, n_len, 4)  # N == B
    kpm = torch.zeros(B, n_len, dtype=torch.bool)
    kpm[0, -1] = True
    with pytest.raises(AssertionError, match="key_padding_mask"):
        models[0](x[0], None, kpm[0])
    with pytest.raises(ValueError, match=r"key_padding_mask.*2-D \[N, S\].*1-D mask \[3\] per model"):
        fused(x, None, kpm)


class _MHASharedKpm(nn.Module):
    """A 3-D key padding mask made in forward (the same for every model): torch refuses it."""

    def __init__(self):
        super().__init__()
        self.attn = nn.MultiheadAttention(4, 2, batch_first=True)

    def forward(self, x):
        kpm = torch.zeros(2, x.size(0), x.size(1), dtype=torch.bool)
        return self.attn(x, x, x, key_padding_mask=kpm, need_weights=False)[0]


def test_fuse_shared_key_padding_mask_of_a_rank_torch_refuses_raises():
    """B == 2: a shared [2, N, S] must not pass for B per-model [N, S] masks."""
    models = [_MHASharedKpm() for _ in range(2)]
    fused = hfkern.fuse(models)
    x = torch.randn(2, 3, 5, 4)
    with pytest.raises(AssertionError):
        models[0](x[0])
    with pytest.raises(ValueError, match=r"key_padding_mask.*3-D mask \[2, 3, 5\] shared"):
        fused(x)


def test_fuse_per_model_masks_of_valid_ranks_still_work():
    """Unbatched input with B == S: per-model [S] key padding masks are torch's; per-model [L, S]
    attention masks at B == L too."""
    torch.manual_seed(9)
    B = S = 3
    models = [_MHA(batch_first=False) for _ in range(B)]
    refs = copy.deepcopy(models)
    fused = hfkern.fuse(models)
    x = torch.randn(B, S, 4)
    kpm = torch.zeros(B, S)
    kpm[0, -1] = kpm[2, 0] = float("-inf")
    mask = torch.randn(B, S, S)
    out = fused(x, mask, kpm)
    for b in range(B):
        assert_close(out[b], refs[b](x[b], mask[b], kpm[b]), **F32)
    out = fused(x, None, kpm)
    for b in range(B):
        assert_close(out[b], refs[b](x[b], None, kpm[b]), **F32)


class _Encoder(nn.Module):
    def __init__(self, layer_only):
        super().__init__()
        layer = nn.TransformerEncoderLayer(4, 2, 8, 0.0, batch_first=True)
        self.enc = layer if layer_only else nn.TransformerEncoder(layer, 1, enable_nested_tensor=False)

    def forward(self, x, mask=None, kpm=None):
        return self.enc(x, mask, kpm)


@pytest.mark.parametrize("layer_only", [True, False])
def test_fuse_encoder_per_model_1d_masks_raise(layer_only):
    torch.manual_seed(10)
    B = n_len = 3
    models = [_Encoder(layer_only) for _ in range(B)]
    fused = hfkern.fuse(models)
    mask_name = "src_mask" if layer_only else "mask"
    x = torch.randn(B, B, n_len, 4)  # N == L == B
    with pytest.raises(ValueError, match=rf"{mask_name}.*1-D mask \[3\] per model"):
        fused(x, torch.randn(B, n_len))
    with pytest.raises(ValueError, match=r"src_key_padding_mask.*1-D mask \[3\] per model"):
        fused(x, None, torch.zeros(B, n_len, dtype=torch.bool))
    # the valid per-model forms work
    mask, kpm = torch.randn(B, n_len, n_len), torch.zeros(B, B, n_len)
    kpm[1, 0, -1] = float("-inf")
    out = fused(x, mask, kpm)
    for b in range(B):
        assert_close(out[b], models[b](x[b], mask[b], kpm[b]), **F32)


# ---- 4. the is_causal hint without a mask: the encoder (layer) names itself ---------------------
def test_encoder_is_causal_without_mask_names_the_encoder():
    layer = hnn.TransformerEncoderLayer(E, H, FF, 0.0, B=2)
    enc = hnn.TransformerEncoder(layer, 2)
    x = torch.randn(2, L, N, E)
    with pytest.raises(RuntimeError, match=r"^TransformerEncoderLayer: need src_mask .*is_causal"):
        layer(x, is_causal=True)
    with pytest.raises(RuntimeError, match=r"^TransformerEncoder: need mask .*is_causal"):
        enc(x, is_causal=True)
    with pytest.raises(RuntimeError, match="is_causal"):  # as torch
        nn.TransformerEncoder(nn.TransformerEncoderLayer(E, H, FF, 0.0), 2,
                              enable_nested_tensor=False)(x[0], is_causal=True)
