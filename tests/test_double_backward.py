"""Double (and higher) backward through the array ops, in float64 on the torch path.

``gradgradcheck`` differentiates each op's backward (the backward ops' autograd
formulas) against finite differences; the module tests check a gradient
penalty (WGAN-GP / R1 style) and a MAML-style inner step against B separate
torch modules. Conv checks use gradgradcheck's fast mode (random projections
of the Jacobian), which keeps the grid affordable; one case per geometry runs
the full check.
"""

import pytest
import torch
from torch import nn

import hfkern
import hfkern.nn as hnn
from hfkern.ops.conv import array_conv, array_conv_input_grad, array_conv_weight_grad
from hfkern.ops.embedding import (
    array_embedding,
    array_embedding_backward,
    array_embedding_sparse_backward,
)
from hfkern.ops.layer_norm import array_layer_norm, array_rms_norm

F64 = torch.float64
B = 2


# ---- conv -----------------------------------------------------------------

def _conv_case(nd, transposed, shared, groups, n=2, sp=(5, 6)):
    ci, co = 2, 4
    sp, k = sp[-nd:], (2, 3)[-nd:]
    x = torch.randn(n, ci, *sp, dtype=F64) if shared else torch.randn(B, n, ci, *sp, dtype=F64)
    shape = (B, ci, co // groups, *k) if transposed else (B, co, ci // groups, *k)
    w = torch.randn(shape, dtype=F64)
    b = torch.randn(B, co, dtype=F64)
    conv = ([2, 1][-nd:], [1, 0][-nd:], [1, 2][-nd:], transposed,
            ([1, 0] if transposed else [0, 0])[-nd:], groups)
    return x.requires_grad_(), w.requires_grad_(), b.requires_grad_(), conv


CONV_GRID = [(nd, t, s, g) for nd in (1, 2) for t in (False, True) for s in (False, True) for g in (1, 2)]


@pytest.mark.parametrize("nd,transposed,shared,groups", CONV_GRID)
def test_conv_gradgradcheck(nd, transposed, shared, groups):
    x, w, b, conv = _conv_case(nd, transposed, shared, groups)
    assert torch.autograd.gradgradcheck(lambda *a: array_conv(*a, *conv), (x, w, b), fast_mode=True)


@pytest.mark.parametrize("nd,transposed", [(1, False), (2, True)])
def test_conv_gradgradcheck_full(nd, transposed):
    x, w, b, conv = _conv_case(nd, transposed, False, 2, n=1, sp=(3, 5))
    assert torch.autograd.gradgradcheck(lambda *a: array_conv(*a, *conv), (x, w, b))


@pytest.mark.parametrize("transposed", [False, True])
@pytest.mark.parametrize("shared", [False, True])
def test_conv_gradient_ops_are_differentiable(transposed, shared):
    # The gradient ops on their own, first and second order: their formulas
    # are exact adjoints at every order, not just where the forward uses them.
    x, w, _, conv = _conv_case(2, transposed, shared, 2)
    gy = torch.randn_like(array_conv(x, w, None, *conv)).requires_grad_()
    size = list(x.shape)
    for fn, args in ((lambda g, w: array_conv_input_grad(g, w, size, *conv), (gy, w)),
                     (lambda g, x: array_conv_weight_grad(g, x, w.detach(), *conv), (gy, x))):
        assert torch.autograd.gradcheck(fn, args, fast_mode=True)
        assert torch.autograd.gradgradcheck(fn, args, fast_mode=True)


# ---- layer norm / RMS norm --------------------------------------------------

def _norm_input(layout, shape=(3, 4)):
    """(x as the op sees it, the leaf its gradient lands on)."""
    if layout == "shared":
        leaf = torch.randn(*shape, dtype=F64, requires_grad=True)
        return hfkern.broadcast(leaf, B), leaf
    if layout == "batch_major":
        x = torch.randn(shape[0], B, *shape[1:], dtype=F64).transpose(0, 1)
    elif layout == "strided":
        x = torch.randn(B, *shape[:-1], 2 * shape[-1], dtype=F64)[..., ::2]
    else:
        x = torch.randn(B, *shape, dtype=F64)
    x.requires_grad_()
    return x, x


def _norm_fn(kind, layout, norm_ndim, has_weight, has_bias):
    """f(leaf, [weight], [bias]) -> y, and its inputs."""
    x, leaf = _norm_input(layout, (3, 2, 4) if norm_ndim == 2 else (3, 4))
    S = x.shape[x.dim() - norm_ndim:]
    w = torch.randn(B, *S, dtype=F64, requires_grad=True) if has_weight else None
    b = torch.randn(B, *S, dtype=F64, requires_grad=True) if has_bias else None
    inputs = [t for t in (leaf, w, b) if t is not None]

    def f(*args):
        it = iter(args)
        xx = next(it)
        if layout == "shared":
            xx = hfkern.broadcast(xx, B)
        ww = next(it) if w is not None else None
        bb = next(it) if b is not None else None
        if kind == "layer_norm":
            return array_layer_norm(xx, ww, bb, norm_ndim, 1e-3)[0]
        return array_rms_norm(xx, ww, norm_ndim, 1e-3)[0]

    return f, tuple(inputs)


@pytest.mark.parametrize("layout", ["contiguous", "batch_major", "strided", "shared"])
@pytest.mark.parametrize("norm_ndim", [1, 2])
@pytest.mark.parametrize("weight,bias", [(True, True), (True, False), (False, True), (False, False)])
def test_layer_norm_gradgradcheck(layout, norm_ndim, weight, bias):
    f, inputs = _norm_fn("layer_norm", layout, norm_ndim, weight, bias)
    assert torch.autograd.gradgradcheck(f, inputs)


@pytest.mark.parametrize("layout", ["contiguous", "batch_major", "strided", "shared"])
@pytest.mark.parametrize("norm_ndim", [1, 2])
@pytest.mark.parametrize("weight", [True, False])
def test_rms_norm_gradgradcheck(layout, norm_ndim, weight):
    f, inputs = _norm_fn("rms_norm", layout, norm_ndim, weight, False)
    assert torch.autograd.gradgradcheck(f, inputs)


@pytest.mark.parametrize("kind", ["layer_norm", "rms_norm"])
def test_norm_third_order(kind):
    # The double-backward formula runs on the saved tensors themselves, so its
    # result stays differentiable: the third derivative is exact too.
    f, inputs = _norm_fn(kind, "contiguous", 1, True, kind == "layer_norm")
    v = torch.randn(B, 3, 4, dtype=F64)

    def first_grads(*args):
        return torch.autograd.grad(f(*args), args, v, create_graph=True)

    assert torch.autograd.gradgradcheck(first_grads, inputs, fast_mode=True)


def test_conv_third_order():
    x, w, b, conv = _conv_case(2, False, False, 1)
    v = torch.randn_like(array_conv(x, w, b, *conv))

    def first_grads(x, w):
        return torch.autograd.grad(array_conv(x, w, None, *conv), (x, w), v, create_graph=True)

    assert torch.autograd.gradgradcheck(first_grads, (x, w), fast_mode=True)


# ---- embedding ----------------------------------------------------------------

V, D = 7, 3


def _indices(shared, padding_idx, dtype=torch.int64):
    idx = torch.randint(0, V, (5,) if shared else (B, 5), dtype=dtype)
    if padding_idx >= 0:
        idx[..., 0] = padding_idx  # the padding path is always taken
    idx[..., 1] = idx[..., 2]  # a repeated row: counts > 1 under scale_grad_by_freq
    return hfkern.broadcast(idx, B) if shared else idx


@pytest.mark.parametrize("shared", [False, True])
@pytest.mark.parametrize("padding_idx", [-1, 2])
@pytest.mark.parametrize("scale", [False, True])
@pytest.mark.parametrize("index_dtype", [torch.int64, torch.int32])
def test_embedding_gradgradcheck(shared, padding_idx, scale, index_dtype):
    idx = _indices(shared, padding_idx, index_dtype)
    assert hfkern.is_shared(idx) == shared
    w = torch.randn(B, V, D, dtype=F64, requires_grad=True)
    assert torch.autograd.gradgradcheck(lambda w: array_embedding(w, idx, padding_idx, scale, False), (w,))
    g = torch.randn(B, 5, D, dtype=F64, requires_grad=True)
    bwd = lambda g: array_embedding_backward(g, idx, V, padding_idx, scale)  # noqa: E731
    assert torch.autograd.gradcheck(bwd, (g,))
    assert torch.autograd.gradgradcheck(bwd, (g,))


@pytest.mark.parametrize("padding_idx", [-1, 2])
def test_embedding_sparse_backward_is_differentiable(padding_idx):
    idx = _indices(False, padding_idx)
    g = torch.randn(B, 5, D, dtype=F64, requires_grad=True)
    grad_w = array_embedding_sparse_backward(g, idx, V, padding_idx)
    r = torch.randn(B, V, D, dtype=F64)
    (got,) = torch.autograd.grad((grad_w.to_dense() * r).sum(), g)  # a sparse incoming gradient
    (dense,) = torch.autograd.grad(array_embedding_backward(g, idx, V, padding_idx, False), g, r)
    expected = torch.stack([r[b][idx[b]] for b in range(B)]) * (idx != padding_idx).unsqueeze(-1)
    torch.testing.assert_close(got, expected)
    torch.testing.assert_close(dense, expected)


# ---- modules: gradient penalty and MAML against B torch modules --------------

def _penalty_grads(modules, x_leaf, make_input):
    """Parameter gradients of sum over m of ||d sum(m(x)^2) / d x_leaf||^2, x = make_input(x_leaf, m)."""
    loss = 0
    for m in modules:
        out = m(make_input(x_leaf, m))
        (gx,) = torch.autograd.grad(out.square().sum(), x_leaf, create_graph=True)
        loss = loss + gx.square().sum()
    return torch.autograd.grad(loss, [p for m in modules for p in m.parameters()])


@pytest.mark.parametrize("shared", [False, True])
@pytest.mark.parametrize("cls,kw,shape", [
    (hnn.Conv2d, dict(in_channels=2, out_channels=3, kernel_size=3, stride=2, padding=1, groups=1), (2, 2, 5, 5)),
    (hnn.Conv1d, dict(in_channels=4, out_channels=2, kernel_size=2, dilation=2, groups=2), (2, 4, 6)),
    (hnn.ConvTranspose2d, dict(in_channels=2, out_channels=4, kernel_size=2, stride=2, groups=2), (2, 2, 3, 3)),
    (hnn.LayerNorm, dict(normalized_shape=(3, 4)), (2, 3, 4)),
    (hnn.RMSNorm, dict(normalized_shape=4), (2, 3, 4)),
])
def test_gradient_penalty_matches_torch_modules(cls, kw, shape, shared):
    modules = [cls._torch_cls(**kw, dtype=F64) for _ in range(B)]
    with torch.no_grad():
        for m in modules:  # affine norms start at ones/zeros; make every model differ
            for p in m.parameters():
                p.normal_()
    array = cls.from_modules(modules)
    data = torch.randn(*shape, dtype=F64) if shared else torch.randn(B, *shape, dtype=F64)
    leaf = data.clone().requires_grad_()
    if shared:
        got = _penalty_grads([array], leaf, lambda x, m: hfkern.broadcast(x, B))
        # the array's penalty is of the models' summed input gradient
        ref_leaf = data.clone().requires_grad_()
        total = sum(torch.autograd.grad(m(ref_leaf).square().sum(), ref_leaf, create_graph=True)[0]
                    for m in modules)
        expected = torch.autograd.grad(total.square().sum(), [p for m in modules for p in m.parameters()])
    else:
        got = _penalty_grads([array], leaf, lambda x, m: x)
        ref_leaf = data.clone().requires_grad_()
        expected = _penalty_grads(modules, ref_leaf, lambda x, m: x[modules.index(m)])
    n = len(list(modules[0].parameters()))
    for i, g in enumerate(got):
        for b in range(B):
            torch.testing.assert_close(g[b], expected[b * n + i], atol=1e-10, rtol=1e-10)


def test_maml_inner_step_through_embedding_and_layer_norm():
    # One inner SGD step with create_graph, the outer loss at the adapted
    # weights, gradients back to the initial weights: what MAML computes.
    torch_models = [nn.Sequential(nn.Embedding(V, 4, padding_idx=1, dtype=F64),
                                  nn.LayerNorm(4, dtype=F64)) for _ in range(B)]
    with torch.no_grad():
        for m in torch_models:
            m[1].weight.normal_()
            m[1].bias.normal_()
    emb = hnn.Embedding.from_modules([m[0] for m in torch_models])
    ln = hnn.LayerNorm.from_modules([m[1] for m in torch_models])
    idx, target = torch.randint(0, V, (B, 6)), torch.randn(B, 6, 4, dtype=F64)
    idx[:, 0] = 1

    def adapted_loss(params, forward):
        inner = forward(params, idx).sub(target).square().sum()
        grads = torch.autograd.grad(inner, params, create_graph=True)
        fast = [p - 0.1 * g for p, g in zip(params, grads)]
        return forward(fast, idx).sub(target).cos().sum()

    def array_forward(p, i):
        e = array_embedding(p[0], i, 1, False, False)
        return array_layer_norm(e, p[1], p[2], 1, 1e-5)[0]

    params = [emb.weight, ln.weight, ln.bias]
    got = torch.autograd.grad(adapted_loss(params, array_forward), params)
    for b, m in enumerate(torch_models):
        ps = [m[0].weight, m[1].weight, m[1].bias]

        def torch_forward(p, i, b=b):
            e = nn.functional.embedding(i[b], p[0], padding_idx=1)
            return nn.functional.layer_norm(e, (4,), p[1], p[2], 1e-5)

        def one_model_loss(p, b=b):
            inner = torch_forward(p, idx).sub(target[b]).square().sum()
            grads = torch.autograd.grad(inner, p, create_graph=True)
            fast = [q - 0.1 * g for q, g in zip(p, grads)]
            return torch_forward(fast, idx).sub(target[b]).cos().sum()

        expected = torch.autograd.grad(one_model_loss(ps), ps)
        for g, e in zip(got, expected):
            torch.testing.assert_close(g[b], e, atol=1e-10, rtol=1e-10)
