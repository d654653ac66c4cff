"""hfkern.fuse: attention masks and F.embedding, against B separate torch models.

Masks: the array attention modules read torch's shared ``[N*num_heads, L, S]`` mask and B
stacked ``[L, S]`` masks ``[B, L, S]`` alike where B == N*num_heads; fuse knows which one a mask
is (one per model, or the same for every model) and hands the module the explicit 4-D form, so
a model that works with torch works fused at every B.

Embedding: ``F.embedding`` (and an ``nn.Embedding`` subclass with its own forward, which fx traces
into it) runs on hfkern's array embedding op: each model's ``padding_idx`` row gets no gradient,
``scale_grad_by_freq`` counts per model, ``sparse=True`` gives each model its sparse gradient,
``max_norm`` renormalizes each model's table in place as torch does.
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.testing import assert_close

import hfkern
from hfkern.fusion import FuseError

E, H, N, L = 8, 2, 2, 5  # N * H == 4
TOL = {torch.float32: {"rtol": 1e-4, "atol": 1e-5}, torch.float64: {"rtol": 1e-9, "atol": 1e-10}}


def _dense(t):
    return t.to_dense() if t is not None and t.layout != torch.strided else t


def _check(models, inputs, dtype, *, sparse_grads=False):
    """Fuse ``models`` and compare with them: outputs, every parameter's gradient and every input's
    gradient. ``inputs``: ``(tensor, shared)`` pairs; a shared tensor is one for every model (given
    to the fused model as hfkern.broadcast), else ``[B, ...]`` with model b's at ``[b]``. The torch
    models run on copies of the inputs. Returns the fused model and the reference models."""
    B = len(models)
    refs = copy.deepcopy(models)
    fused = hfkern.fuse(models)
    ref_inputs = [t.detach().clone().requires_grad_(t.requires_grad) for t, _ in inputs]
    out = fused(*(hfkern.broadcast(t, B) if shared else t for t, shared in inputs))
    ref = torch.stack([m(*(r if shared else r[b] for r, (_, shared) in zip(ref_inputs, inputs)))
                       for b, m in enumerate(refs)])
    tol = TOL[dtype]
    assert out.dtype == dtype
    assert_close(out, ref, **tol)
    g = torch.randn_like(ref)
    (out * g).sum().backward()
    (ref * g).sum().backward()
    for name, p in fused.named_parameters():
        if sparse_grads:
            assert p.grad.layout == torch.sparse_coo, name
        for b, m in enumerate(refs):
            want = _dense(m.get_parameter(name).grad)
            got = _dense(p.grad)
            if want is None:
                assert got is None or not got[b].any(), name
            else:
                assert_close(got[b], want, **tol, msg=lambda s: f"{name}.grad[{b}]: {s}")
    for i, ((t, _), r) in enumerate(zip(inputs, ref_inputs)):
        if t.requires_grad:
            assert_close(t.grad, r.grad, **tol, msg=lambda s: f"input {i} grad: {s}")
    return fused, refs


def _x(B, dtype, shared, shape=(N, L, E)):
    """A float input that requires grad: one shared ``shape`` tensor or ``[B, *shape]``."""
    return (torch.randn(shape if shared else (B, *shape), dtype=dtype).requires_grad_(), shared)


# ---- attention masks --------------------------------------------------------------------------
class _MHAPerModelMask(nn.Module):
    """A per-model [L, S] mask and [N, S] key padding mask computed from inputs."""

    def __init__(self, positional):
        super().__init__()
        self.positional = positional
        self.attn = nn.MultiheadAttention(E, H, batch_first=True)

    def forward(self, x, scores, pad):
        mask, kpm = scores > 0.5, pad > 0.7
        if self.positional:  # attn_mask as the 6th positional argument, weights returned
            out, w = self.attn(x, x, x, kpm, True, mask)
            return torch.cat([out.flatten(1), w.flatten(1)], 1)
        return self.attn(x, x, x, key_padding_mask=kpm, attn_mask=mask, need_weights=False)[0]


def _scores(B, *shape):
    s = torch.rand(B, *shape)
    s[..., 0] = 0.0  # every query sees key 0: no fully masked row
    return s


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("shared_x", [False, True])
@pytest.mark.parametrize("positional", [False, True])
def test_mha_per_model_mask(dtype, shared_x, positional):
    for B in (N * H, 3):
        models = [_MHAPerModelMask(positional).to(dtype) for _ in range(B)]
        _check(models, [_x(B, dtype, shared_x), (_scores(B, L, L), False), (_scores(B, N, L), False)], dtype)


class _MHASharedMask(nn.Module):
    """Masks the same for every model, [N*H, L, S]: made in forward from shapes, or a constant."""

    def __init__(self, kind):
        super().__init__()
        self.kind = kind
        self.attn = nn.MultiheadAttention(E, H, batch_first=True)
        self.bias = torch.randn(N * H, L, L, generator=torch.Generator().manual_seed(1))

    def forward(self, x):
        n, length = x.size(0), x.size(1)
        if self.kind == "causal":
            mask = torch.triu(torch.ones(n * H, length, length, dtype=torch.bool), 1)
        else:
            mask = self.bias.to(x.dtype)
        return self.attn(x, x, x, attn_mask=mask, need_weights=False)[0]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("shared_x", [False, True])
@pytest.mark.parametrize("kind", ["causal", "constant"])
def test_mha_shared_3d_mask(dtype, shared_x, kind):
    for B in (N * H, 3):
        models = [_MHASharedMask(kind).to(dtype) for _ in range(B)]
        _check(models, [_x(B, dtype, shared_x)], dtype)


class _MHAUnbatched(nn.Module):
    def __init__(self):
        super().__init__()
        self.attn = nn.MultiheadAttention(E, H)

    def forward(self, x, scores):
        return self.attn(x, x, x, attn_mask=scores > 0.5, need_weights=False)[0]


@pytest.mark.parametrize("shared_x", [False, True])
def test_mha_unbatched_per_model_mask(shared_x):
    """Unbatched inputs: torch's shared mask is [num_heads, L, S] (N = 1), ambiguous at B == H."""
    dtype = torch.float32
    for B in (H, 3):
        models = [_MHAUnbatched() for _ in range(B)]
        _check(models, [_x(B, dtype, shared_x, (L, E)), (_scores(B, L, L), False)], dtype)


def _encoder():
    return nn.TransformerEncoder(nn.TransformerEncoderLayer(E, H, 16, dropout=0.0, batch_first=True), 2,
                                 enable_nested_tensor=False)


class _EncoderPerModelMask(nn.Module):
    def __init__(self, bool_masks):
        super().__init__()
        self.bool_masks = bool_masks
        self.enc = _encoder()

    def forward(self, x, m, pad):
        if self.bool_masks:
            return self.enc(x, mask=m > 0.5, src_key_padding_mask=pad > 0.7)
        return self.enc(x, mask=m)  # a float [S, S] mask per model


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("shared_x", [False, True])
@pytest.mark.parametrize("bool_masks", [False, True])
def test_transformer_encoder_per_model_mask(dtype, shared_x, bool_masks):
    for B in (N * H, 3):
        models = [_EncoderPerModelMask(bool_masks).to(dtype) for _ in range(B)]
        m = _scores(B, L, L) if bool_masks else torch.randn(B, L, L, dtype=dtype)
        _check(models, [_x(B, dtype, shared_x), (m, False), (_scores(B, N, L), False)], dtype)


class _EncoderSharedMask(nn.Module):
    """A [N*nhead, S, S] float mask made in forward, to an encoder layer (positional) and an encoder."""

    def __init__(self):
        super().__init__()
        self.layer = nn.TransformerEncoderLayer(E, H, 16, dropout=0.0, batch_first=True)
        self.enc = _encoder()

    def forward(self, x):
        n, s = x.size(0), x.size(1)
        mask = torch.triu(torch.full((n * H, s, s), float("-inf"), dtype=x.dtype), 1)
        return self.enc(self.layer(x, mask), mask)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("shared_x", [False, True])
def test_transformer_encoder_shared_3d_mask(dtype, shared_x):
    for B in (N * H, 3):
        models = [_EncoderSharedMask().to(dtype) for _ in range(B)]
        _check(models, [_x(B, dtype, shared_x)], dtype)


# ---- embedding ------------------------------------------------------------------------------
V, D, T = 10, 4, 6


class _FEmbedding(nn.Module):
    """F.embedding on the model's own table, times a float input."""

    def __init__(self, padding_idx=None, max_norm=None, norm_type=2.0, scale_grad_by_freq=False, sparse=False):
        super().__init__()
        self.w = nn.Parameter(torch.randn(V, D) * 2)
        self.padding_idx, self.max_norm, self.norm_type = padding_idx, max_norm, norm_type
        self.scale_grad_by_freq, self.sparse = scale_grad_by_freq, sparse

    def forward(self, idx, s):
        return F.embedding(idx, self.w, self.padding_idx, self.max_norm, self.norm_type,
                           self.scale_grad_by_freq, self.sparse) * s.unsqueeze(-1)


class _ScaledEmbedding(nn.Embedding):
    def forward(self, idx):
        return super().forward(idx) * 2.0


class _Subclassed(nn.Module):
    """An nn.Embedding subclass with its own forward: fx traces it into F.embedding."""

    def __init__(self, **kw):
        super().__init__()
        self.emb = _ScaledEmbedding(V, D, **kw)
        with torch.no_grad():
            self.emb.weight.mul_(2)

    def forward(self, idx, s):
        return self.emb(idx) * s.unsqueeze(-1)


def _embedding_model(variant, dtype, **kw):
    model = _FEmbedding(**kw) if variant == "F.embedding" else _Subclassed(**kw)
    return model.to(dtype)


def _indices(B, shared, padding_idx=0):
    """Indices with repeats and every model hitting the padding row."""
    if shared:
        idx = torch.randint(0, V, (T,))
        idx[:2] = padding_idx % V
        idx[2:4] = 3
        return idx
    idx = torch.randint(0, V, (B, T))
    idx[:, :2] = padding_idx % V
    idx[:, 2:4] = 3
    return idx


def _embedding_inputs(B, dtype, shared_idx, padding_idx=0):
    return [(_indices(B, shared_idx, padding_idx), shared_idx),
            (torch.rand(B, T, dtype=dtype).add_(0.5).requires_grad_(), False)]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("shared_idx", [False, True])
@pytest.mark.parametrize("padding_idx", [2, -3])
@pytest.mark.parametrize("variant", ["F.embedding", "subclass"])
def test_embedding_padding_idx(variant, padding_idx, shared_idx, dtype):
    for B in (1, 3):
        models = [_embedding_model(variant, dtype, padding_idx=padding_idx) for _ in range(B)]
        _check(models, _embedding_inputs(B, dtype, shared_idx, padding_idx), dtype)


class _TorchEmbedding(nn.Module):
    def __init__(self):
        super().__init__()
        self.w = nn.Parameter(torch.randn(V, D))

    def forward(self, idx):
        return torch.embedding(self.w, idx, 2)


@pytest.mark.parametrize("shared_idx", [False, True])
def test_torch_embedding_padding_idx(shared_idx):
    dtype = torch.float32
    for B in (1, 3):
        _check([_TorchEmbedding() for _ in range(B)], [(_indices(B, shared_idx, 2), shared_idx)], dtype)


class _TokensAndPositions(nn.Module):
    """Token embeddings (per-model or shared indices) plus position embeddings whose indices are
    made in forward from shapes alone (the same for every model, not an array value)."""

    def __init__(self):
        super().__init__()
        self.tok = _ScaledEmbedding(V, D, padding_idx=0)  # (traced into F.embedding)
        self.pos = nn.Parameter(torch.randn(V, D))

    def forward(self, idx):
        positions = torch.arange(idx.size(-1)) % 4  # 0 (the padding row) several times
        return self.tok(idx) + F.embedding(positions, self.pos, padding_idx=0, scale_grad_by_freq=True)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("shared_idx", [False, True])
def test_embedding_tokens_and_positions(shared_idx, dtype):
    for B in (1, 3):
        models = [_TokensAndPositions().to(dtype) for _ in range(B)]
        _check(models, [(_indices(B, shared_idx), shared_idx)], dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("shared_idx", [False, True])
@pytest.mark.parametrize("norm_type", [2.0, 1.0])
@pytest.mark.parametrize("variant", ["F.embedding", "subclass"])
def test_embedding_max_norm(variant, norm_type, shared_idx, dtype):
    """The rows each model looks up are renormalized in place in its own table, as torch does."""
    for B in (1, 3):
        models = [_embedding_model(variant, dtype, padding_idx=1, max_norm=1.5, norm_type=norm_type)
                  for _ in range(B)]
        key = "w" if variant == "F.embedding" else "emb.weight"
        before = torch.stack([m.state_dict()[key] for m in models])
        fused, refs = _check(models, _embedding_inputs(B, dtype, shared_idx, 1), dtype)
        after = fused.state_dict()[key]
        assert not torch.equal(after, before)  # (rows were renormalized)
        for b, m in enumerate(refs):
            assert_close(after[b], m.state_dict()[key], **TOL[dtype], msg=lambda s: f"{key}[{b}]: {s}")


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("shared_idx", [False, True])
@pytest.mark.parametrize("variant", ["F.embedding", "subclass"])
def test_embedding_scale_grad_by_freq(variant, shared_idx, dtype):
    for B in (1, 3):
        models = [_embedding_model(variant, dtype, padding_idx=0, scale_grad_by_freq=True) for _ in range(B)]
        _check(models, _embedding_inputs(B, dtype, shared_idx), dtype)


@pytest.mark.parametrize("shared_idx", [False, True])
@pytest.mark.parametrize("padding_idx", [None, 0])
@pytest.mark.parametrize("variant", ["F.embedding", "subclass"])
def test_embedding_sparse(variant, padding_idx, shared_idx):
    """sparse=True: a sparse [B, V, D] gradient whose slice b is model b's (densified, compared)."""
    dtype = torch.float64
    for B in (1, 3):
        models = [_embedding_model(variant, dtype, padding_idx=padding_idx, sparse=True) for _ in range(B)]
        _check(models, _embedding_inputs(B, dtype, shared_idx), dtype, sparse_grads=True)


class _TableInput(nn.Module):
    """The table is an input: given shared (hfkern.broadcast), every model reads one table."""

    def __init__(self, **kw):
        super().__init__()
        self.lin = nn.Linear(D, D)
        self.kw = kw

    def forward(self, idx, table):
        return self.lin(F.embedding(idx, table, **self.kw))


@pytest.mark.parametrize("shared_idx", [False, True])
@pytest.mark.parametrize("scale_grad_by_freq", [False, True])
def test_embedding_shared_table_input(scale_grad_by_freq, shared_idx):
    """Each model's padding row and counts on a shared table: its gradient is the sum of the models'."""
    dtype = torch.float32
    for B in (1, 3):
        models = [_TableInput(padding_idx=0, scale_grad_by_freq=scale_grad_by_freq) for _ in range(B)]
        table = torch.randn(V, D, requires_grad=True)
        _check(models, [(_indices(B, shared_idx), shared_idx), (table, True)], dtype)


class _ConstantTable(nn.Module):
    def __init__(self, **kw):
        super().__init__()
        self.table = torch.randn(V, D, generator=torch.Generator().manual_seed(2)) * 3
        self.lin = nn.Linear(D, D)
        self.kw = kw

    def forward(self, idx):
        return self.lin(F.embedding(idx, self.table, **self.kw))


def test_embedding_options_that_cannot_be_served_raise():
    """max_norm renormalizes each model's table in place: on one table every model reads (a
    constant, or an input given as hfkern.broadcast) the fused model cannot; nor can it form the
    sparse gradient of a shared table. FuseError names the option."""
    B = 3
    idx = _indices(B, False)
    fused = hfkern.fuse([_ConstantTable(max_norm=1.0) for _ in range(B)])
    with pytest.raises(FuseError, match="max_norm"):
        fused(idx)
    table = torch.randn(V, D)
    fused = hfkern.fuse([_TableInput(max_norm=1.0) for _ in range(B)])
    with pytest.raises(FuseError, match="max_norm"):
        fused(idx, hfkern.broadcast(table, B))
    fused = hfkern.fuse([_TableInput(sparse=True) for _ in range(B)])
    with pytest.raises(FuseError, match="sparse"):
        fused(idx, hfkern.broadcast(table.requires_grad_(), B))
