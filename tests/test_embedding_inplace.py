"""In-place writes into the array embedding's output, as torch allows them into nn.Embedding's.

``torch.nn.Embedding`` returns a fresh tensor: a ``[CLS]`` token written into position 0
(``h[:, 0] = cls``), an in-place scale (``h.mul_(2)``), a zeroed slice, a write through a view,
``index_put_`` are all legal and differentiable. The array embedding's output must take the same
writes, on the eager torch path (``_EagerEmbedding``) and the dispatched op
(``hfkern::array_embedding``) alike, directly and inside ``hfkern.fuse``, with forward values
and gradients equal to B separate ``torch.nn.Embedding`` models'.
"""

from __future__ import annotations

import contextlib
import copy

import pytest
import torch
from torch import nn
from torch.testing import assert_close

import hfkern
from hfkern import _backend

V, D, N, T = 11, 6, 4, 5
TOL = {"rtol": 1e-5, "atol": 1e-6}


def _pos():
    return torch.arange(T * D, dtype=torch.float32).view(T, D) / (T * D)


def _cls_array(h, cls):  # h [B, N, T, D], cls [B, D]
    h[:, :, 0] = cls[:, None]


def _cls_model(h, cls):  # h [N, T, D], cls [D]
    h[:, 0] = cls


def _index_put_array(h, cls):
    rows = torch.tensor([0, 2])
    h.index_put_((torch.arange(h.shape[0])[:, None], rows[None]), cls[:, None, None])


def _index_put_model(h, cls):
    h.index_put_((torch.tensor([0, 2]),), cls)


def _same(fn):
    return fn, fn


def _iadd(h, cls):
    h += _pos()


def _imul(h, cls):
    h *= 3.0


# name: (write into the array output [B, N, T, D], write into model b's output [N, T, D])
WRITES = {
    "setitem_cls": (_cls_array, _cls_model),
    "mul_": _same(lambda h, cls: h.mul_(2.0)),
    "slice_zero_": _same(lambda h, cls: h[..., :3].zero_()),
    "view_mul_": _same(lambda h, cls: h.view(-1).mul_(2.0)),
    "index_put_": (_index_put_array, _index_put_model),
    "imul": _same(_imul),
    "iadd": _same(_iadd),
}

CONFIGS = {
    "plain": {},
    "padding_idx": {"padding_idx": 1},
    "max_norm": {"max_norm": 1.0},
    "scale_grad_by_freq": {"scale_grad_by_freq": True},
    "sparse": {"sparse": True},
}

PATHS = {"eager": contextlib.nullcontext, "dispatched": _backend.dispatched_ops}


def _dense(t):
    return t.to_dense() if t.layout != torch.strided else t


def _indices(B, shared, padding):
    g = torch.Generator().manual_seed(1)
    idx = torch.randint(0, V, (N, T) if shared else (B, N, T), generator=g)
    if padding:  # make sure the padding row is hit
        idx[..., 1] = 1
    return idx


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("shared", [False, True], ids=["per_model", "shared"])
@pytest.mark.parametrize("B", [1, 3])
@pytest.mark.parametrize("config", CONFIGS)
@pytest.mark.parametrize("write", WRITES)
def test_inplace_write_matches_torch(write, config, B, shared, path):
    torch.manual_seed(0)
    cfg = CONFIGS[config]
    write_array, write_model = WRITES[write]
    emb = hfkern.nn.Embedding(V, D, B=B, **cfg)
    mods = emb.to_modules()
    idx = _indices(B, shared, "padding_idx" in cfg)
    cls = torch.randn(B, D, requires_grad=True)
    ref_cls = [cls.detach()[b].clone().requires_grad_() for b in range(B)]
    g = torch.randn(B, N, T, D)

    with PATHS[path]():
        h = emb(hfkern.broadcast(idx, B) if shared else idx)
        assert not h._is_view() and h.is_contiguous()
        write_array(h, cls)
        (h * g).sum().backward()
    refs = []
    for b, m in enumerate(mods):
        r = m(idx if shared else idx[b])
        write_model(r, ref_cls[b])
        (r * g[b]).sum().backward()
        refs.append(r)

    assert_close(h, torch.stack(refs), rtol=0, atol=0)
    if cfg.get("sparse"):
        assert emb.weight.grad.layout == torch.sparse_coo
    for b, m in enumerate(mods):
        assert_close(emb.weight.detach()[b], m.weight.detach(), rtol=0, atol=0)  # max_norm's renorm
        assert_close(_dense(emb.weight.grad)[b], _dense(m.weight.grad), **TOL)
        if write_array in (_cls_array, _index_put_array):
            assert_close(cls.grad[b], ref_cls[b].grad, **TOL)


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("shared", [False, True], ids=["per_model", "shared"])
def test_inplace_write_double_backward(shared, path):
    """A gradient penalty through an in-place written output (create_graph=True)."""
    torch.manual_seed(0)
    B = 3
    emb = hfkern.nn.Embedding(V, D, B=B, padding_idx=2)
    mods = emb.to_modules()
    idx = _indices(B, shared, False)
    cls = torch.randn(B, D, requires_grad=True)
    ref_cls = [cls.detach()[b].clone().requires_grad_() for b in range(B)]

    with PATHS[path]():
        h = emb(hfkern.broadcast(idx, B) if shared else idx)
        h[:, :, 0] = cls[:, None]
        h.mul_(2.0)
        (gw,) = torch.autograd.grad((h ** 3).sum(), emb.weight, create_graph=True)
        (gw ** 2).sum().backward()
    for b, m in enumerate(mods):
        r = m(idx if shared else idx[b])
        r[:, 0] = ref_cls[b]
        r.mul_(2.0)
        (rgw,) = torch.autograd.grad((r ** 3).sum(), m.weight, create_graph=True)
        (rgw ** 2).sum().backward()
        assert_close(gw.detach()[b], rgw.detach(), **TOL)
        assert_close(emb.weight.grad[b], m.weight.grad, **TOL)
        assert_close(cls.grad[b], ref_cls[b].grad, **TOL)


class TinyBert(nn.Module):
    """Word + position embeddings with a learned [CLS] token written into position 0."""

    def __init__(self, vocab=13, max_len=T, dim=8):
        super().__init__()
        self.word = nn.Embedding(vocab, dim, padding_idx=0)
        self.pos = nn.Embedding(max_len, dim)
        self.cls = nn.Parameter(torch.randn(dim))
        self.norm = nn.LayerNorm(dim)
        self.ff = nn.Linear(dim, dim)
        self.head = nn.Linear(dim, 3)

    def forward(self, ids, positions):  # ids, positions: [N, T]
        h = self.word(ids)
        h[:, 0] = self.cls
        h += self.pos(positions)
        h = self.norm(h)
        h = h + torch.tanh(self.ff(h))
        return self.head(h[:, 0])


@pytest.mark.parametrize("shared", [False, True], ids=["per_model", "shared"])
@pytest.mark.parametrize("B", [1, 3])
def test_fused_bert_like_cls_token(B, shared):
    torch.manual_seed(0)
    models = [TinyBert() for _ in range(B)]
    refs = copy.deepcopy(models)
    fused = hfkern.fuse(models)
    g = torch.Generator().manual_seed(2)
    ids = torch.randint(0, 13, (N, T) if shared else (B, N, T), generator=g)
    positions = torch.arange(T).expand(N, T)
    pos_in = hfkern.broadcast(positions, B)
    out = fused(hfkern.broadcast(ids, B) if shared else ids, pos_in)
    ref = torch.stack([m(ids if shared else ids[b], positions) for b, m in enumerate(refs)])
    assert_close(out, ref, **TOL)
    w = torch.randn_like(ref)
    (out * w).sum().backward()
    (ref * w).sum().backward()
    names = [name for name, _ in fused.named_parameters()]
    assert "cls" in names and "word.weight" in names
    for name, p in fused.named_parameters():
        for b, m in enumerate(refs):
            assert_close(p.grad[b], m.get_parameter(name).grad, **TOL, msg=lambda s: f"{name}[{b}]: {s}")
