"""Batch norm / layer norm with a fused ReLU or GELU: the ops, the modules and hfkern.fuse,
against B separate torch modules (the norm, then the activation)."""

from __future__ import annotations

import contextlib
import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.utils._python_dispatch import TorchDispatchMode

import hfkern
import hfkern.nn as hnn
from hfkern import _backend
from hfkern.fusion import _NormActivation
from hfkern.ops.batch_norm import array_batch_norm, array_batch_norm_backward, array_batch_norm_op
from hfkern.ops.layer_norm import array_layer_norm, array_layer_norm_backward
from _util import CallCounter

EPS = 1e-3
GRAD_TOL = dict(atol=1e-4, rtol=1e-4)
ACTS = ["relu", "gelu"]
ACT_FN = {"none": lambda t: t, "relu": F.relu, "gelu": F.gelu}
ACT_MODULE = {"relu": nn.ReLU, "gelu": nn.GELU}
TORCH_BN = {0: nn.BatchNorm1d, 1: nn.BatchNorm1d, 2: nn.BatchNorm2d, 3: nn.BatchNorm3d}
BN_FWD = torch.ops.hfkern.array_batch_norm.default


def make_x(B, shape, layout, dtype=torch.float32):
    """[B, *shape] (shape = (N, C, *S) for batch norm) in a memory layout."""
    N, *rest = shape
    if layout == "contiguous":
        return torch.randn(B, *shape, dtype=dtype)
    if layout == "batch_major":  # [N, B, ...]: an array conv's output
        return torch.randn(N, B, *rest, dtype=dtype).transpose(0, 1)
    if layout == "strided":
        return torch.randn(B, *shape[:-1], 2 * shape[-1], dtype=dtype)[..., ::2]
    if layout == "channels_last":  # [B, N, *S, C]
        C, *S = rest
        return torch.randn(B, N, *S, C, dtype=dtype).movedim(-1, 2)
    if layout == "array_channels_last":  # [N, H, W, B, C]: a channels-last array image
        C, H, W = rest
        return torch.randn(N, H, W, B, C, dtype=dtype).permute(3, 0, 4, 1, 2)
    if layout == "shared":
        return hfkern.broadcast(torch.randn(*shape, dtype=dtype), B)
    raise ValueError(layout)


def leaf(x):
    """(the tensor to differentiate, the array input built from it)."""
    if hfkern.is_shared(x):
        base = x[0].detach().clone().requires_grad_()
        return base, hfkern.broadcast(base, x.shape[0])
    x = x.detach().requires_grad_()  # keeps the layout's strides
    return x, x


# ---- batch norm op against B torch modules -------------------------------------------------

# (training, momentum, tracked running statistics)
BN_MODES = {
    "train": (True, 0.1, True),
    "cumulative": (True, None, True),
    "untracked": (True, 0.1, False),
    "eval": (False, 0.1, True),
}
BN_LAYOUTS = ["contiguous", "batch_major", "strided", "channels_last", "array_channels_last", "shared"]


def bn_reference(x, w, b, rm, rv, nbt, training, momentum, activation):
    """B torch BatchNorm modules, each followed by the activation: (modules, inputs, outputs)."""
    B, C = x.shape[0], x.shape[2]
    mods, xs, ys = [], [], []
    for i in range(B):
        m = TORCH_BN[x.dim() - 3](C, eps=EPS, momentum=momentum, track_running_stats=rm is not None)
        with torch.no_grad():
            m.weight.copy_(w[i])
            m.bias.copy_(b[i])
            if rm is not None:
                m.running_mean.copy_(rm[i])
                m.running_var.copy_(rv[i])
                m.num_batches_tracked.fill_(int(nbt[i]) - 1)  # the module counts this batch itself
        m.train(training)
        xi = x[i].detach().clone().requires_grad_()
        mods.append(m)
        xs.append(xi)
        ys.append(ACT_FN[activation](m(xi)))
    return mods, xs, ys


def check_bn(B, shape, layout, mode, activation):
    training, momentum, tracked = BN_MODES[mode]
    C = shape[1]
    base, x = leaf(make_x(B, shape, layout))
    w = torch.randn(B, C, requires_grad=True)
    b = torch.randn(B, C, requires_grad=True)
    rm, rv, nbt = (torch.randn(B, C), torch.rand(B, C) + 0.5, torch.arange(1, B + 1) * 3) if tracked \
        else (None, None, None)
    mods, xs, ys = bn_reference(x, w, b, rm, rv, nbt, training, momentum, activation)

    y, _, _ = array_batch_norm(x, w, b, rm, rv, nbt, training, momentum, EPS, activation)
    torch.testing.assert_close(y, torch.stack(ys))
    if not hfkern.is_shared(x) and layout != "strided":
        assert y.stride() == x.stride()  # the output keeps x's memory
    if tracked:
        torch.testing.assert_close(rm, torch.stack([m.running_mean for m in mods]))
        torch.testing.assert_close(rv, torch.stack([m.running_var for m in mods]))
    g = torch.randn(y.shape)
    got = torch.autograd.grad(y, (base, w, b), g)
    exp = [torch.autograd.grad(yi, (xi, m.weight, m.bias), g[i]) for i, (m, xi, yi) in enumerate(zip(mods, xs, ys))]
    gx = sum(e[0] for e in exp) if hfkern.is_shared(x) else torch.stack([e[0] for e in exp])
    torch.testing.assert_close(got[0], gx, **GRAD_TOL)
    torch.testing.assert_close(got[1], torch.stack([e[1] for e in exp]), **GRAD_TOL)
    torch.testing.assert_close(got[2], torch.stack([e[2] for e in exp]), **GRAD_TOL)


@pytest.mark.parametrize("activation", ACTS)
@pytest.mark.parametrize("layout", BN_LAYOUTS)
@pytest.mark.parametrize("mode", list(BN_MODES))
@pytest.mark.parametrize("B", [1, 3])
def test_batch_norm_activation_matches_torch_modules(B, mode, layout, activation):
    check_bn(B, (5, 3, 3, 2), layout, mode, activation)  # N, C, H, W: odd sizes


@pytest.mark.parametrize("activation", ACTS)
@pytest.mark.parametrize("shape", [(7, 4), (3, 5, 7), (2, 3, 2, 3, 2)], ids=["0d", "1d", "3d"])
@pytest.mark.parametrize("mode", ["train", "eval"])
def test_batch_norm_activation_spatial_ranks(shape, mode, activation):
    check_bn(2, shape, "batch_major", mode, activation)


def test_batch_norm_without_affine_and_weight_only():
    B, C = 3, 4
    x = make_x(B, (5, C, 3), "batch_major").requires_grad_()
    for w, b in ((None, None), (torch.randn(B, C, requires_grad=True), None)):
        y, _, _ = array_batch_norm(x, w, b, None, None, None, True, None, EPS, "relu")
        ref = torch.stack([F.relu(F.batch_norm(x[i], None, None, None if w is None else w[i], None, True, 0.1, EPS))
                           for i in range(B)])
        torch.testing.assert_close(y, ref)
        inputs = (x,) if w is None else (x, w)
        g = torch.randn_like(y)
        for a, e in zip(torch.autograd.grad(y, inputs, g), torch.autograd.grad(ref, inputs, g)):
            torch.testing.assert_close(a, e, **GRAD_TOL)


# ---- the channels-last array layout: torch's kernels on the free grouped view ---------------

class _OpSpy(TorchDispatchMode):
    """Records every aten op, and every copy that reads one of ``watched``'s storages."""

    COPIES = {torch.ops.aten.clone.default, torch.ops.aten._to_copy.default, torch.ops.aten.copy_.default,
              torch.ops.aten.contiguous.default}

    def __init__(self, *watched):
        super().__init__()
        self.storages = {t.untyped_storage().data_ptr() for t in watched}
        self.ops, self.copies = [], []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops.append(func)
        sources = args[1:2] if func is torch.ops.aten.copy_.default else args[:1]
        if func in self.COPIES and any(
            isinstance(a, torch.Tensor) and a.untyped_storage().data_ptr() in self.storages for a in sources
        ):
            self.copies.append(func)
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("activation", ["none", "relu", "gelu"])
def test_channels_last_array_runs_torch_kernels_on_the_grouped_view(activation):
    B, N, C, H, W = 3, 4, 5, 3, 6
    x = make_x(B, (N, C, H, W), "array_channels_last")
    assert hfkern._array.array_memory_format(x) == torch.channels_last
    w, b = torch.randn(B, C), torch.randn(B, C)
    rm, rv = torch.randn(B, C), torch.rand(B, C) + 0.5
    gy = make_x(B, (N, C, H, W), "array_channels_last")
    forward, backward = (_backend._registry[op]["torch"].load()
                         for op in ("array_batch_norm", "array_batch_norm_backward"))
    with _OpSpy(x) as spy:
        y, mean, rstd = forward(x, w, b, rm, rv, None, True, 0.1, EPS, activation)
    assert torch.ops.aten.native_batch_norm.default in spy.ops and spy.copies == []
    assert y.stride() == x.stride()
    with _OpSpy(x, gy) as spy:
        gx, gw, gb = backward(gy, x, w, mean, rstd, True, [True, True, True], b, activation)
    assert torch.ops.aten.native_batch_norm_backward.default in spy.ops and spy.copies == []
    assert gx.stride() == x.stride()
    # the same values as the strided reductions of the general path (a contiguous copy of x)
    rm2, rv2 = torch.randn(B, C), torch.rand(B, C) + 0.5
    y2, mean2, rstd2 = forward(x.contiguous(), w, b, rm2, rv2, None, True, 0.1, EPS, activation)
    torch.testing.assert_close(y, y2)
    ref = backward(gy.contiguous(), x.contiguous(), w, mean2, rstd2, True, [True, True, True], b, activation)
    for a, e in zip((gx, gw, gb), ref):
        torch.testing.assert_close(a, e, **GRAD_TOL)


@pytest.mark.parametrize("shape", [(4, 1, 5, 6), (4, 5, 1, 1)], ids=["one_channel", "one_pixel"])
def test_channels_last_array_in_both_formats_keeps_its_strides(shape):
    """Memory that is NCHW and channels-last at once: the output has x's exact strides, so it
    stays channels-last for the next layer (array_memory_format decides by them)."""
    B = 3
    x = hfkern._array.new_batch_major(torch.empty(0), (B, *shape), torch.channels_last).normal_()
    x.requires_grad_()
    w, b = torch.randn(B, shape[1], requires_grad=True), torch.randn(B, shape[1], requires_grad=True)
    y, _, _ = array_batch_norm(x, w, b, None, None, None, True, 0.1, EPS, "relu")
    assert y.stride() == x.stride()
    assert hfkern._array.array_memory_format(y) == torch.channels_last
    ref = torch.stack([F.relu(F.batch_norm(x[i], None, None, w[i], b[i], True, 0.1, EPS)) for i in range(B)])
    torch.testing.assert_close(y, ref)
    g = torch.randn_like(y)
    (gx,) = torch.autograd.grad(y, x, g)
    assert gx.stride() == x.stride()
    torch.testing.assert_close(gx, torch.autograd.grad(ref, x, g)[0], **GRAD_TOL)
    torch.library.opcheck(BN_FWD, (x.detach(), w.detach(), b.detach(), None, None, None, True, 0.1, EPS, "relu"))


def test_channels_last_array_module_keeps_its_memory():
    B, C = 2, 4
    bn = hnn.BatchNorm2d(C, B=B, activation="relu")
    x = make_x(B, (3, C, 5, 4), "array_channels_last").requires_grad_()
    y = bn(x)
    assert y.stride() == x.stride() and (y >= 0).all()
    y.backward(torch.randn_like(y))
    assert x.grad.shape == x.shape


# ---- layer norm op against B torch modules ---------------------------------------------------

LN_LAYOUTS = ["contiguous", "batch_major", "strided", "shared"]


@pytest.mark.parametrize("activation", ACTS)
@pytest.mark.parametrize("layout", LN_LAYOUTS)
@pytest.mark.parametrize("norm_shape", [(7,), (3, 5)], ids=["1d", "2d"])
@pytest.mark.parametrize("B", [1, 3])
def test_layer_norm_activation_matches_torch_modules(B, norm_shape, layout, activation):
    base, x = leaf(make_x(B, (4, *norm_shape), layout))
    w = torch.randn(B, *norm_shape, requires_grad=True)
    b = torch.randn(B, *norm_shape, requires_grad=True)
    y, _, _ = array_layer_norm(x, w, b, len(norm_shape), EPS, activation)
    mods, xs, ys = [], [], []
    for i in range(B):
        m = nn.LayerNorm(norm_shape, eps=EPS)
        with torch.no_grad():
            m.weight.copy_(w[i])
            m.bias.copy_(b[i])
        xi = x[i].detach().clone().requires_grad_()
        mods.append(m)
        xs.append(xi)
        ys.append(ACT_MODULE[activation]()(m(xi)))
    torch.testing.assert_close(y, torch.stack(ys))
    g = torch.randn(y.shape)
    got = torch.autograd.grad(y, (base, w, b), g)
    exp = [torch.autograd.grad(yi, (xi, m.weight, m.bias), g[i]) for i, (m, xi, yi) in enumerate(zip(mods, xs, ys))]
    gx = sum(e[0] for e in exp) if hfkern.is_shared(x) else torch.stack([e[0] for e in exp])
    torch.testing.assert_close(got[0], gx, **GRAD_TOL)
    torch.testing.assert_close(got[1], torch.stack([e[1] for e in exp]), **GRAD_TOL)
    torch.testing.assert_close(got[2], torch.stack([e[2] for e in exp]), **GRAD_TOL)


def test_layer_norm_activation_without_parameters():
    x = torch.randn(2, 3, 6, requires_grad=True)
    y, _, _ = array_layer_norm(x, None, None, 1, EPS, "gelu")
    ref = F.gelu(F.layer_norm(x, (6,), eps=EPS))
    torch.testing.assert_close(y, ref)
    g = torch.randn_like(y)
    torch.testing.assert_close(torch.autograd.grad(y, x, g)[0], torch.autograd.grad(ref, x, g)[0], **GRAD_TOL)


# ---- reduced precision: CPU autocast ------------------------------------------------------

@pytest.mark.parametrize("activation", ACTS)
def test_batch_norm_under_cpu_autocast(activation):
    """A bf16 conv output into a fused norm under autocast, against float32 torch modules."""
    B, C = 3, 4
    x32 = make_x(B, (6, C, 4, 4), "batch_major")
    bn = hnn.BatchNorm2d(C, B=B, activation=activation)
    with torch.no_grad():
        bn.weight.normal_()
        bn.bias.normal_()
    ref_bn = copy.deepcopy(bn)
    ref_bn.activation = "none"
    x = x32.to(torch.bfloat16).requires_grad_()
    xr = x.detach().float().requires_grad_()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        y = bn(x)
    assert y.dtype == torch.bfloat16
    yr = ACT_FN[activation](ref_bn(xr))
    tol = dict(atol=3e-2, rtol=2e-2)
    torch.testing.assert_close(y.float(), yr, **tol)
    torch.testing.assert_close(bn.running_var, ref_bn.running_var, **tol)
    g = torch.randn_like(yr)
    got = torch.autograd.grad(y, (x, bn.weight, bn.bias), g.to(torch.bfloat16))
    exp = torch.autograd.grad(yr, (xr, ref_bn.weight, ref_bn.bias), g)
    for a, e in zip(got, exp):
        torch.testing.assert_close(a.float(), e, atol=5e-2, rtol=5e-2)


@pytest.mark.parametrize("activation", ACTS)
def test_layer_norm_under_cpu_autocast(activation):
    B, D = 2, 8
    ln = hnn.LayerNorm(D, B=B, activation=activation)
    with torch.no_grad():
        ln.weight.normal_()
        ln.bias.normal_()
    x = torch.randn(B, 5, D).to(torch.bfloat16).requires_grad_()
    xr = x.detach().float().requires_grad_()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        y = ln(x)
    assert y.dtype == torch.bfloat16
    yr = torch.stack([ACT_FN[activation](F.layer_norm(xr[i], (D,), ln.weight[i], ln.bias[i], 1e-5))
                      for i in range(B)])
    torch.testing.assert_close(y.float(), yr, atol=3e-2, rtol=2e-2)
    g = torch.randn_like(yr)
    got = torch.autograd.grad(y, x, g.to(torch.bfloat16))[0]
    torch.testing.assert_close(got.float(), torch.autograd.grad(yr, xr, g)[0], atol=5e-2, rtol=5e-2)


# ---- double backward ------------------------------------------------------------------------

@pytest.mark.parametrize("activation", ACTS)
@pytest.mark.parametrize("training", [True, False])
@pytest.mark.parametrize("layout", ["batch_major", "shared"])
def test_batch_norm_gradcheck_float64(layout, training, activation):
    B, C = 2, 3
    base = make_x(B, (4, C, 3), layout, dtype=torch.float64)
    base = (base[0] if layout == "shared" else base).detach().requires_grad_()
    w = torch.randn(B, C, dtype=torch.float64, requires_grad=True)
    b = torch.randn(B, C, dtype=torch.float64, requires_grad=True)
    rm, rv = torch.randn(B, C, dtype=torch.float64), torch.rand(B, C, dtype=torch.float64) + 0.5

    def fn(base, w, b):
        xi = hfkern.broadcast(base, B) if layout == "shared" else base
        return array_batch_norm(xi, w, b, rm, rv, None, training, 0.1, EPS, activation)[0]

    assert torch.autograd.gradcheck(fn, (base, w, b))
    assert torch.autograd.gradgradcheck(fn, (base, w, b))


@pytest.mark.parametrize("activation", ACTS)
def test_layer_norm_gradcheck_float64(activation):
    B = 2
    x = torch.randn(B, 3, 5, dtype=torch.float64, requires_grad=True)
    w = torch.randn(B, 5, dtype=torch.float64, requires_grad=True)
    b = torch.randn(B, 5, dtype=torch.float64, requires_grad=True)

    def fn(x, w, b):
        return array_layer_norm(x, w, b, 1, EPS, activation)[0]

    assert torch.autograd.gradcheck(fn, (x, w, b))
    assert torch.autograd.gradgradcheck(fn, (x, w, b))


@pytest.mark.parametrize("activation", ACTS)
def test_double_backward_matches_torch(activation):
    """A gradient penalty through the fused op and through B torch (norm, activation) pairs."""
    B, C = 3, 4
    x = make_x(B, (5, C, 3), "batch_major").requires_grad_()
    w = torch.randn(B, C, requires_grad=True)
    b = torch.randn(B, C, requires_grad=True)
    y, _, _ = array_batch_norm(x, w, b, None, None, None, True, 0.1, EPS, activation)
    (gx,) = torch.autograd.grad(y.square().sum(), x, create_graph=True)
    got = torch.autograd.grad(gx.square().sum(), [x, w, b])
    for i in range(B):
        xi, wi, bi = (t[i].detach().clone().requires_grad_() for t in (x, w, b))
        yi = ACT_FN[activation](F.batch_norm(xi, None, None, wi, bi, True, 0.1, EPS))
        (gxi,) = torch.autograd.grad(yi.square().sum(), xi, create_graph=True)
        for g, e in zip(got, torch.autograd.grad(gxi.square().sum(), [xi, wi, bi])):
            torch.testing.assert_close(g[i], e, **GRAD_TOL)


# ---- opcheck ------------------------------------------------------------------------------

@pytest.mark.parametrize("activation", ACTS)
@pytest.mark.parametrize("layout,mode", [("batch_major", "train"), ("array_channels_last", "cumulative"),
                                         ("contiguous", "eval"), ("shared", "untracked")])
def test_opcheck_batch_norm(layout, mode, activation):
    training, momentum, tracked = BN_MODES[mode]
    B, C = 3, 4
    x = make_x(B, (4, C, 3, 2), layout)
    w, b = torch.randn(B, C), torch.randn(B, C)
    rm, rv, nbt = (torch.randn(B, C), torch.rand(B, C) + 0.5, torch.arange(1, B + 1)) if tracked \
        else (None, None, None)
    torch.library.opcheck(BN_FWD, (x, w, b, rm, rv, nbt, training, momentum, EPS, activation))
    torch.library.opcheck(BN_FWD, (x, None, None, rm, rv, nbt, training, momentum, EPS),
                          {"activation": activation})
    _, mean, rstd = BN_FWD(x, w, b, rm, rv, nbt, training, momentum, EPS, activation)
    gy = torch.randn(x.shape)
    for mask in ([True, True, True], [False, True, False]):
        torch.library.opcheck(array_batch_norm_backward, (gy, x, w, mean, rstd, training, mask, b, activation),
                              test_utils=("test_schema", "test_faketensor"))
    # inputs that require grad: the double-backward formula (with the bias) is traced and checked too
    xs, ws, bs, gys = (t.detach().clone().requires_grad_() for t in (x.contiguous(), w, b, gy))
    torch.library.opcheck(array_batch_norm_backward, (gys, xs, ws, mean, rstd, training, [True, True, True],
                                                      bs, activation))


@pytest.mark.parametrize("activation", ACTS)
def test_opcheck_layer_norm(activation):
    B = 2
    x = torch.randn(B, 3, 6, requires_grad=True)
    w = torch.randn(B, 6, requires_grad=True)
    b = torch.randn(B, 6, requires_grad=True)
    torch.library.opcheck(array_layer_norm, (x, w, b, 1, EPS, activation))
    torch.library.opcheck(array_layer_norm, (x, None, None, 1, EPS), {"activation": activation})
    _, mean, rstd = array_layer_norm(x, w, b, 1, EPS, activation)
    gy = torch.randn(x.shape, requires_grad=True)
    for mask in ([True, True, True], [True, False, True]):
        torch.library.opcheck(array_layer_norm_backward, (gy, x, w, mean, rstd, 1, mask, b, activation))


# ---- bad activation strings ---------------------------------------------------------------

@pytest.mark.parametrize("bad", ["tanh", "ReLU", "", "gelu_tanh"])
def test_bad_activation_raises(bad):
    B, C = 2, 3
    x = torch.randn(B, 4, C, 2)
    rm, rv = torch.zeros(B, C), torch.ones(B, C)
    match = r"activation to be one of 'none', 'relu', 'gelu'"
    with pytest.raises(ValueError, match=match):
        BN_FWD(x, None, None, rm, rv, None, True, 0.1, EPS, bad)
    # raised before anything changed
    assert torch.equal(rm, torch.zeros(B, C)) and torch.equal(rv, torch.ones(B, C))
    with pytest.raises(ValueError, match=match):
        array_batch_norm(x, None, None, rm, rv, None, True, 0.1, EPS, bad)
    _, mean, rstd = BN_FWD(x, None, None, None, None, None, True, 0.1, EPS)
    with pytest.raises(ValueError, match=match):
        array_batch_norm_backward(x, x, None, mean, rstd, True, [True, False, False], None, bad)
    with pytest.raises(ValueError, match=match):
        array_layer_norm(x, None, None, 1, EPS, bad)
    _, mean, rstd = array_layer_norm(x, None, None, 1, EPS)
    with pytest.raises(ValueError, match=match):
        array_layer_norm_backward(x, x, None, mean, rstd, 1, [True, False, False], None, bad)
    with FakeTensorMode() as mode:  # the fakes check it too
        xf, rmf, rvf = (mode.from_tensor(t) for t in (x, rm, rv))
        with pytest.raises(ValueError, match=match):
            array_batch_norm_op(xf, None, None, rmf, rvf, None, True, 0.1, EPS, bad)
        with pytest.raises(ValueError, match=match):
            array_layer_norm(xf, None, None, 1, EPS, bad)
    for make in (lambda: hnn.BatchNorm2d(C, B=B, activation=bad), lambda: hnn.BatchNorm1d(C, B=B, activation=bad),
                 lambda: hnn.LayerNorm(C, B=B, activation=bad)):
        with pytest.raises(ValueError, match=r"activation to be one of"):
            make()
    with pytest.raises(ValueError, match=r"activation to be one of.*got None"):
        hnn.BatchNorm2d(C, B=B, activation=None)


# ---- modules ------------------------------------------------------------------------------

def _randomized(modules):
    with torch.no_grad():
        for m in modules:
            for p in m.parameters():
                p.normal_()
    return modules


@pytest.mark.parametrize("activation", ACTS)
@pytest.mark.parametrize("training", [True, False])
def test_batch_norm_module_activation(training, activation):
    B, C = 3, 4
    mods = _randomized([nn.BatchNorm2d(C) for _ in range(B)])
    for m in mods:
        with torch.no_grad():
            m.running_mean.normal_()
            m.running_var.uniform_(0.5, 1.5)
    array = hnn.BatchNorm2d.from_modules(mods)
    assert array.activation == "none"
    array.activation = activation
    assert f"activation={activation!r}" in repr(array)
    array.train(training)
    for m in mods:
        m.train(training)
    x = make_x(B, (5, C, 3, 3), "batch_major").requires_grad_()
    y = array(x)
    xs = [x[i].detach().clone().requires_grad_() for i in range(B)]
    ys = [ACT_MODULE[activation]()(m(xi)) for m, xi in zip(mods, xs)]
    torch.testing.assert_close(y, torch.stack(ys))
    g = torch.randn_like(y)
    got = torch.autograd.grad(y, [x, array.weight, array.bias], g)
    for i, (m, xi, yi) in enumerate(zip(mods, xs, ys)):
        for a, e in zip(got, torch.autograd.grad(yi, [xi, m.weight, m.bias], g[i])):
            torch.testing.assert_close(a[i], e, **GRAD_TOL)
    # state: the torch namesake's, round trips unchanged by the activation
    for k, v in array.state_dict().items():
        for i, m in enumerate(mods):
            torch.testing.assert_close(v[i], m.state_dict()[k])
    extracted = array.extract_model(1)
    assert type(extracted) is nn.BatchNorm2d
    torch.testing.assert_close(extracted.running_var, mods[1].running_var)
    fresh = hnn.BatchNorm2d(C, B=B, activation=activation)
    fresh.load_state_dict(array.state_dict())
    fresh.load_model(0, mods[2])
    torch.testing.assert_close(fresh.weight[0], mods[2].weight)


@pytest.mark.parametrize("activation", ACTS)
def test_batch_norm1d_and_layer_norm_modules(activation):
    B, C = 2, 5
    bn = hnn.BatchNorm1d(C, B=B, activation=activation)
    x = torch.randn(B, 6, C)
    ref = torch.stack([ACT_FN[activation](F.batch_norm(x[i], None, None, training=True)) for i in range(B)])
    torch.testing.assert_close(bn(x), ref)
    ln = hnn.LayerNorm(C, B=B, activation=activation)
    with torch.no_grad():
        ln.weight.normal_()
    ref = torch.stack([ACT_FN[activation](F.layer_norm(x[i], (C,), ln.weight[i], ln.bias[i])) for i in range(B)])
    torch.testing.assert_close(ln(x), ref)
    assert type(ln.extract_model(0)) is nn.LayerNorm
    # a shared input without parameters: computed once, still activated
    plain = hnn.LayerNorm(C, elementwise_affine=False, activation=activation)
    xs = hfkern.broadcast(torch.randn(6, C), B)
    torch.testing.assert_close(plain(xs), ACT_FN[activation](F.layer_norm(xs, (C,))))


def test_compile_training_module_with_activation():
    # fullgraph: the Function with the activation argument, the running update and the backward
    torch._dynamo.reset()
    B, C = 3, 4
    eager = hnn.BatchNorm2d(C, B=B, activation="gelu")
    with torch.no_grad():
        eager.weight.normal_()
        eager.bias.normal_()
    compiled_module = copy.deepcopy(eager)
    compiled = torch.compile(compiled_module, fullgraph=True, backend="aot_eager")
    x = make_x(B, (5, C, 3, 3), "batch_major")
    xs = [x.detach().clone().requires_grad_() for _ in range(2)]
    outs = [eager(xs[0]), compiled(xs[1])]
    torch.testing.assert_close(outs[1], outs[0])
    g = torch.randn_like(outs[0])
    for a, e in zip(torch.autograd.grad(outs[1], [xs[1], compiled_module.weight, compiled_module.bias], g),
                    torch.autograd.grad(outs[0], [xs[0], eager.weight, eager.bias], g)):
        torch.testing.assert_close(a, e, **GRAD_TOL)
    torch.testing.assert_close(compiled_module.running_var, eager.running_var)


# ---- hfkern.fuse ---------------------------------------------------------------------------

class BasicBlock(nn.Module):
    """ResNet's basic block, as torchvision writes it."""

    def __init__(self, c_in=3, c=4):
        super().__init__()
        self.conv1 = nn.Conv2d(c_in, c, 3, padding=1, bias=False)
        self.bn1 = nn.BatchNorm2d(c)
        self.relu = nn.ReLU(inplace=True)
        self.conv2 = nn.Conv2d(c, c, 3, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(c)
        self.shortcut = nn.Conv2d(c_in, c, 1, bias=False)
        self.head = nn.Linear(c, 3)

    def forward(self, x):
        out = self.relu(self.bn1(self.conv1(x)))
        out = self.bn2(self.conv2(out))  # its output has one user: the residual add, not fused
        out = F.relu(out + self.shortcut(x))
        return self.head(out.mean(dim=(2, 3)))


class Mixer(nn.Module):
    """Every spelling of a fusable activation, and patterns that must stay apart."""

    def __init__(self, d=6):
        super().__init__()
        self.fc = nn.Linear(d, d)
        self.ln1, self.ln2, self.ln3, self.ln4 = (nn.LayerNorm(d) for _ in range(4))
        self.bn = nn.BatchNorm1d(d)
        self.gelu = nn.GELU()
        self.tanh_gelu = nn.GELU(approximate="tanh")

    def forward(self, x):
        h = self.fc(x)
        a = self.gelu(self.ln1(h))  # fused: nn.GELU
        b = torch.relu(self.ln2(h))  # fused: torch.relu
        c = self.tanh_gelu(self.ln3(h))  # not fused: the tanh approximation
        n = self.ln4(h)
        d = F.gelu(n) + n  # not fused: the norm output has two users
        e = self.bn(h.transpose(1, 2)).relu_().transpose(1, 2)  # fused: Tensor.relu_
        return a + b + c + d + e


def _fused_calls(fused):
    return [n.target.activation for n in fused.graph.nodes if isinstance(n.target, _NormActivation)]


def _relu_nodes(fused):
    relu = {F.relu, torch.relu, torch.relu_}
    return [n for n in fused.graph.nodes
            if (n.op == "call_module" and "relu" in n.target)
            or (n.op == "call_function" and getattr(n.target, "fn", None) in relu)
            or (n.op == "call_function" and getattr(n.target, "method", None) in ("relu", "relu_"))]


def _check_against_models(fused, models, x, loss=lambda y: y.square().sum()):
    y = fused(x)
    ys = [m(x[b]) for b, m in enumerate(models)]
    torch.testing.assert_close(y, torch.stack(ys), rtol=1e-4, atol=1e-5)
    loss(y).backward()
    for m, yb in zip(models, ys):
        loss(yb).backward()
    params = dict(fused.named_parameters())
    for name, p in params.items():
        refs = [dict(m.named_parameters())[name].grad for m in models]
        if p.grad is None:  # no path to the loss (a norm under no_grad)
            assert all(r is None for r in refs), name
            continue
        ref = torch.stack(refs)
        scale = ref.abs().max().item()
        torch.testing.assert_close(p.grad, ref, rtol=1e-3, atol=1e-3 * scale + 1e-5)
    state = fused.state_dict()
    for b, m in enumerate(models):
        for k, v in m.state_dict().items():
            torch.testing.assert_close(state[k][b], v, rtol=1e-4, atol=1e-5)


def _train_then_evaluate(fused, models, x, steps=2):
    """Training steps checked against the models (running statistics advance per model),
    then the outputs in eval mode."""
    for step in range(steps):
        fused.zero_grad()
        for m in models:
            m.zero_grad()
        _check_against_models(fused, models, x + step)
    fused.eval()
    for m in models:
        m.eval()
    with torch.no_grad():
        torch.testing.assert_close(fused(x), torch.stack([m(x[b]) for b, m in enumerate(models)]),
                                   rtol=1e-4, atol=1e-5)


def test_fuse_resnet_block_fuses_bn_relu():
    B = 3
    models = [BasicBlock() for _ in range(B)]
    for m in models:
        _randomized([m.bn1, m.bn2])
    originals = copy.deepcopy(models)
    fused = hfkern.fuse(models)
    # conv-bn-relu is one fused call; bn2 feeds an add and stays a plain call
    assert _fused_calls(fused) == ["relu"]
    assert not [n for n in fused.graph.nodes if n.op == "call_module" and n.target == "relu"]
    assert [n for n in fused.graph.nodes if n.op == "call_module" and n.target == "bn2"]
    _train_then_evaluate(fused, models, torch.randn(B, 2, 3, 5, 5))
    assert _fused_calls(fused) == ["relu"]
    # surgery sees the original architecture, its separate ReLU included
    extracted = fused.extract_model(1)
    assert type(extracted) is BasicBlock and isinstance(extracted.relu, nn.ReLU)
    assert type(extracted.bn1) is nn.BatchNorm2d
    for k, v in extracted.state_dict().items():
        torch.testing.assert_close(v, models[1].state_dict()[k])
    fused.load_model(0, originals[0])
    torch.testing.assert_close(fused.state_dict()["bn1.running_mean"][0], originals[0].bn1.running_mean)
    unfused = hfkern.unfuse(fused)
    assert all(type(m) is BasicBlock for m in unfused)


def test_fuse_activation_spellings_and_refusals():
    B = 2
    models = [Mixer() for _ in range(B)]
    for m in models:
        _randomized([m.ln1, m.ln2, m.ln3, m.ln4, m.bn])
    fused = hfkern.fuse(models)
    assert sorted(_fused_calls(fused)) == ["gelu", "relu", "relu"]
    # the ones that must stay apart are still there
    assert [n for n in fused.graph.nodes if n.op == "call_module" and n.target in ("tanh_gelu", "ln3", "ln4")]
    x = torch.randn(B, 5, 4, 6)
    _check_against_models(fused, models, x)


def test_fuse_two_users_are_not_fused():
    class TwoUsers(nn.Module):
        def __init__(self):
            super().__init__()
            self.conv = nn.Conv2d(3, 4, 3, bias=False)
            self.bn = nn.BatchNorm2d(4)
            self.relu = nn.ReLU()

        def forward(self, x):
            h = self.bn(self.conv(x))
            return self.relu(h) + h  # the norm output is read twice: it must exist

    B = 3
    models = [TwoUsers() for _ in range(B)]
    fused = hfkern.fuse(models)
    assert _fused_calls(fused) == []
    assert _relu_nodes(fused)
    _check_against_models(fused, models, torch.randn(B, 2, 3, 5, 5))


def test_fuse_not_across_a_grad_mode_region():
    class Frozen(nn.Module):
        def __init__(self):
            super().__init__()
            self.ln = nn.LayerNorm(5)
            self.out = nn.Linear(5, 5)

        def forward(self, x):
            with torch.no_grad():
                h = self.ln(x)
            return self.out(F.relu(h))

    B = 2
    models = [Frozen() for _ in range(B)]
    fused = hfkern.fuse(models)
    assert _fused_calls(fused) == []
    _check_against_models(fused, models, torch.randn(B, 3, 5))


def test_fuse_hook_added_later_sees_the_norm_output():
    B = 2
    models = [nn.Sequential(nn.Linear(4, 4), nn.LayerNorm(4), nn.ReLU()) for _ in range(B)]
    fused = hfkern.fuse(models)
    assert _fused_calls(fused) == ["relu"]
    seen = []
    fused.get_submodule("1").register_forward_hook(lambda m, args, out: seen.append(out.detach().clone()))
    x = torch.randn(B, 3, 4)
    y = fused(x)
    assert len(seen) == 1 and (seen[0] < 0).any()  # the hook saw the norm output, not its ReLU
    torch.testing.assert_close(y, seen[0].relu())


@pytest.mark.parametrize("kernel", [True, False])
def test_fused_call_runs_one_op_only_where_a_kernel_serves_the_norm(kernel, monkeypatch):
    """On a kernel backend the fused call is one norm op with the activation; on the torch
    path it is the two calls (torch's ReLU backward reads the saved output once, cheaper
    than recomputing z); both compute what the models do."""
    from hfkern import fusion
    from hfkern.nn.normalization import _BatchNorm

    monkeypatch.setattr(fusion._NormActivation, "_kernel_serves", staticmethod(lambda norm, x: kernel))
    seen = []
    normalize = _BatchNorm._normalize

    def spy(self, x, activation="none"):
        seen.append(activation)
        return normalize(self, x, activation)

    monkeypatch.setattr(_BatchNorm, "_normalize", spy)
    B = 2
    models = [BasicBlock() for _ in range(B)]
    for m in models:
        _randomized([m.bn1, m.bn2])
    fused = hfkern.fuse(models)
    _check_against_models(fused, models, torch.randn(B, 2, 3, 5, 5))
    assert ("relu" in seen) == kernel


# ---- a convolution and its batch norm as one call (hfkern.fuse, torch path) -------------------

class ConvNormNet(nn.Module):
    """Convolutions whose outputs only a batch norm reads, inside top-level blocks: with a
    ReLU after the norm, with nothing, transposed with a GELU, and 1-D."""

    def __init__(self, **bn):
        super().__init__()
        self.features = nn.Sequential(
            nn.Conv2d(3, 4, 3, padding=1, bias=False), nn.BatchNorm2d(4, **bn), nn.ReLU(inplace=True),
            nn.Conv2d(4, 5, 3, stride=2, padding=1), nn.BatchNorm2d(5, **bn),
            nn.ConvTranspose2d(5, 4, 2, stride=2), nn.BatchNorm2d(4, **bn), nn.GELU(),
        )
        self.tail = nn.Sequential(nn.Conv1d(4, 3, 3, padding=1), nn.BatchNorm1d(3, **bn), nn.ReLU())
        self.head = nn.Linear(3, 2)

    def forward(self, x):
        h = self.features(x)
        return self.head(self.tail(h.flatten(2)).mean(-1))


def _conv_norm_calls(fused):
    from hfkern.fusion import _ConvNorm
    return [n.target.activation for n in fused.graph.nodes if isinstance(n.target, _ConvNorm)]


@pytest.mark.parametrize("bn", [{}, dict(momentum=None), dict(affine=False), dict(track_running_stats=False)],
                         ids=["default", "cumulative", "no_affine", "untracked"])
def test_fuse_runs_a_convolution_and_its_batch_norm_as_one_call(bn, monkeypatch):
    """On the torch path in eager mode the pair runs on the grouped view (torch's grouped
    convolution, then its batch norm on the result): every model computes, trains and keeps
    running statistics as its torch model does, in training and in eval."""
    import hfkern.nn.normalization as hnorm
    B = 3
    torch.manual_seed(0)
    models = [ConvNormNet(**bn) for _ in range(B)]
    for m in models:
        _randomized([m for m in m.modules() if isinstance(m, nn.modules.batchnorm._BatchNorm)])
    fused = hfkern.fuse(models)
    assert _conv_norm_calls(fused) == ["relu", None, "gelu", "relu"]
    calls = CallCounter(monkeypatch, hnorm, "grouped_batch_norm")
    _train_then_evaluate(fused, models, torch.randn(B, 4, 3, 6, 6))
    # the four pairs on the grouped view in both training steps, and in eval where a norm
    # without running statistics normalizes with the batch's
    assert calls.n == (12 if bn.get("track_running_stats") is False else 8)


@pytest.mark.parametrize("case", ["contiguous", "channels_last", "bf16_autocast", "B1"])
def test_fused_conv_norm_call_equals_the_two_calls(case):
    """The one call gives the two calls' outputs bit for bit (the same kernels on the same
    memory), their running statistics, and their gradients to rounding (the reference: every
    op dispatched, where the pair runs as the two calls)."""
    B = 1 if case == "B1" else 3
    torch.manual_seed(1)
    fused = hfkern.fuse([ConvNormNet() for _ in range(B)])
    if case == "channels_last":
        fused = fused.to(memory_format=torch.channels_last)
    twin = copy.deepcopy(fused)
    x = torch.randn(B, 4, 3, 6, 6)
    region = (lambda: torch.autocast("cpu", dtype=torch.bfloat16)) if case == "bf16_autocast" else contextlib.nullcontext
    outs = []
    for model, reference in ((fused, False), (twin, True)):
        with (_backend.dispatched_ops() if reference else contextlib.nullcontext()), region():
            y = model(x)
            y.float().square().sum().backward()
        outs.append(y)
    assert torch.equal(outs[0], outs[1])
    for (name, a), b in zip(fused.named_buffers(), twin.buffers()):
        assert torch.equal(a, b), name
    for (name, a), b in zip(fused.named_parameters(), twin.parameters()):
        tol = dict(rtol=2e-2, atol=2e-2) if case == "bf16_autocast" else dict(rtol=1e-4, atol=1e-5)
        torch.testing.assert_close(a.grad, b.grad, **tol, msg=name)


class PointwiseNet(nn.Module):
    """1x1 convolutions and their batch norms (MobileNetV2's expansions and projections,
    PointNet's point-wise layers), which the CPU runs as batched matmuls."""

    def __init__(self):
        super().__init__()
        # (no biases: a bias before a batch norm has a gradient of zero, up to rounding)
        self.a = nn.Sequential(nn.Conv2d(3, 8, 1, bias=False), nn.BatchNorm2d(8), nn.ReLU(inplace=True),
                               nn.Conv2d(8, 4, 1, bias=False), nn.BatchNorm2d(4))
        self.b = nn.Sequential(nn.Conv1d(4, 5, 1, bias=False), nn.BatchNorm1d(5), nn.ReLU())
        _randomized([m for m in self.modules() if isinstance(m, nn.modules.batchnorm._BatchNorm)])

    def forward(self, x):
        return self.b(self.a(x).flatten(2))


@pytest.mark.parametrize("B", [1, 3])
def test_fused_pointwise_conv_norm_call_equals_the_two_calls(B, monkeypatch):
    """The CPU's 1x1 convolutions (batched matmuls) and their batch norms run as one call on
    the matmul's grouped view: the two calls' outputs and running statistics bit for bit,
    their gradients to rounding, and B torch models' results."""
    import hfkern.nn.normalization as hnorm
    torch.manual_seed(2)
    models = [PointwiseNet() for _ in range(B)]
    fused = hfkern.fuse(models)
    assert _conv_norm_calls(fused) == ["relu", None, "relu"]
    twin = copy.deepcopy(fused)
    calls = CallCounter(monkeypatch, hnorm, "grouped_batch_norm")
    x = torch.randn(B, 4, 3, 6, 6)
    outs = []
    for _ in range(2):  # the second step skips the checks
        for model, reference in ((fused, False), (twin, True)):
            with _backend.dispatched_ops() if reference else contextlib.nullcontext():
                y = model(x)
                y.square().sum().backward()
            outs.append(y)
        assert torch.equal(outs[-2], outs[-1])
    assert calls.n == 6  # both steps, B = 1 included
    for (name, a), b in zip(fused.named_buffers(), twin.buffers()):
        assert torch.equal(a, b), name
    for (name, a), b in zip(fused.named_parameters(), twin.parameters()):
        torch.testing.assert_close(a.grad, b.grad, rtol=1e-4, atol=1e-5, msg=name)
    _check_against_models(hfkern.fuse(models), models, x, loss=lambda y: (y * torch.linspace(-1, 2, y.shape[-1])).sum())


@pytest.mark.gpu
@pytest.mark.parametrize("precision", ["fp32", "bf16_autocast"])
def test_gpu_fused_conv_norm_call_matches_the_two_calls(precision, monkeypatch):
    """On CUDA (cuDNN's grouped convolution and batch norm) the one call trains as the two
    calls do: outputs, running statistics and gradients, against every op dispatched."""
    import hfkern.nn.normalization as hnorm
    calls = CallCounter(monkeypatch, hnorm, "grouped_batch_norm")
    # float32 as float32: with TF32 (cuDNN's default) the two paths' algorithms may round apart
    monkeypatch.setattr(torch.backends.cudnn, "allow_tf32", False)
    monkeypatch.setattr(torch.backends.cuda.matmul, "allow_tf32", False)
    B = 3
    torch.manual_seed(3)
    fused = hfkern.fuse([ConvNormNet() for _ in range(B)]).cuda()
    twin = copy.deepcopy(fused)
    x = torch.randn(B, 4, 3, 6, 6, device="cuda")
    region = (lambda: torch.autocast("cuda", dtype=torch.bfloat16)) if precision != "fp32" else contextlib.nullcontext
    tol = dict(rtol=2e-2, atol=2e-2) if precision != "fp32" else dict(rtol=1e-4, atol=1e-4)
    outs = []
    with hfkern.use_backend("torch"):
        for model, reference in ((fused, False), (twin, True)):
            with (_backend.dispatched_ops() if reference else contextlib.nullcontext()), region():
                y = model(x)
                y.float().square().sum().backward()
            outs.append(y.float())
    assert _conv_norm_calls(fused) == ["relu", None, "gelu", "relu"] and calls.n == 4
    torch.testing.assert_close(outs[0], outs[1], **tol)
    for (name, a), b in zip(fused.named_buffers(), twin.buffers()):
        torch.testing.assert_close(a.float(), b.float(), **tol, msg=name)
    for (name, a), b in zip(fused.named_parameters(), twin.parameters()):
        torch.testing.assert_close(a.grad, b.grad, **tol, msg=name)


def test_fuse_keeps_a_convolution_and_its_batch_norm_apart_where_it_must():
    """Not fused: a pair split between two top-level blocks (hfkern.plan recomputes whole
    top-level blocks), a convolution output read twice, a grad-mode region between them."""
    class Apart(nn.Module):
        def __init__(self):
            super().__init__()
            # (no biases: a bias before a batch norm has a gradient of zero, up to rounding)
            self.conv = nn.Conv2d(3, 4, 3, padding=1, bias=False)
            self.bn = nn.BatchNorm2d(4)  # another top-level block than conv
            self.twice = nn.Sequential(nn.Conv2d(4, 4, 3, padding=1, bias=False), nn.BatchNorm2d(4))
            self.frozen = nn.Sequential(nn.Conv2d(4, 4, 3, padding=1, bias=False), nn.BatchNorm2d(4))

        def forward(self, x):
            h = self.bn(self.conv(x))
            c = self.twice[0](h)
            h = self.twice[1](c) + c
            c = self.frozen[0](h)
            with torch.no_grad():
                f = self.frozen[1](c)
            return h + f

    B = 2
    models = [Apart() for _ in range(B)]
    fused = hfkern.fuse(models)
    assert _conv_norm_calls(fused) == []
    _check_against_models(fused, models, torch.randn(B, 2, 3, 5, 5))


def test_hooks_added_after_fusing_see_the_convolution_and_norm_outputs():
    B = 2
    torch.manual_seed(2)
    models = [ConvNormNet() for _ in range(B)]
    fused = hfkern.fuse(models)
    seen = {}
    for name in ("features.0", "features.1"):
        fused.get_submodule(name).register_forward_hook(
            lambda m, args, out, name=name: seen.__setitem__(name, out.detach().clone()))
    x = torch.randn(B, 4, 3, 6, 6)
    fused(x)
    for b, m in enumerate(models):
        conv_out = m.features[0](x[b])
        torch.testing.assert_close(seen["features.0"][b], conv_out, rtol=1e-4, atol=1e-5)
        torch.testing.assert_close(seen["features.1"][b], m.features[1](conv_out), rtol=1e-4, atol=1e-5)


# ---- the call's checks skipped for metadata seen before -----------------------------------------

def _served(fused):
    from hfkern.fusion import _ConvNorm
    return [n.target._served for n in fused.graph.nodes if isinstance(n.target, _ConvNorm)]


def _forget(fused):
    """Clear what the fused model's convolution + batch norm calls remember of earlier calls."""
    from hfkern.fusion import _ConvNorm
    for n in fused.graph.nodes:
        if isinstance(n.target, _ConvNorm):
            n.target._served = None


def _outcome(fn):
    """What calling ``fn`` gives: its value (detached, cloned) or its exception's type and message."""
    try:
        out = fn()
    except Exception as e:  # noqa: BLE001 - the comparison is the point
        return type(e), str(e)
    return out.detach().clone()


def _set_data(path, name, make):
    def mutate(fused):
        t = getattr(fused.get_submodule(path), name)
        t.data = make(t)
    return mutate


def _set_attr(path, name, value):
    return lambda fused: setattr(fused.get_submodule(path), name, value)


class _Doubled(nn.Module):
    def forward(self, w):
        return 2 * w


_MUTATIONS = {
    "nothing": lambda fused: None,
    "conv weight of another shape": _set_data("features.0", "weight", lambda w: torch.ones(w.shape[0], 5, *w.shape[2:])),
    "conv weight in float64": _set_data("features.0", "weight", lambda w: w.double()),
    "conv weight channels-last": _set_data(
        "features.0", "weight", lambda w: w.reshape(-1, *w.shape[2:]).contiguous(
            memory_format=torch.channels_last).view(w.shape)),
    "conv bias added": lambda fused: setattr(fused.features[0], "bias", nn.Parameter(torch.linspace(-1, 1, 12).view(3, 4))),
    "conv padding": _set_attr("features.3", "padding", (0, 0)),
    "conv stride": _set_attr("features.3", "stride", (1, 1)),
    "conv dilation of the wrong length": _set_attr("features.3", "dilation", (1,)),
    "conv groups zero": _set_attr("features.3", "groups", 0),
    "conv memory format": lambda fused: fused.features[0]._set_memory_format(torch.channels_last),
    "conv made 1x1": lambda fused: (
        _set_data("features.0", "weight", lambda w: torch.ones(*w.shape[:3], 1, 1) / 3)(fused),
        _set_attr("features.0", "padding", (0, 0))(fused),
        _set_attr("features.0", "_reversed_padding_repeated_twice", [0, 0, 0, 0])(fused)),
    "conv weight parametrized": lambda fused: torch.nn.utils.parametrize.register_parametrization(
        fused.features[0], "weight", _Doubled()),
    "conv weight a plain tensor": lambda fused: (
        delattr(fused.features[0], "weight"), setattr(fused.features[0], "weight", torch.ones(3, 4, 3, 3, 3))),
    "norm weight of another shape": _set_data("features.1", "weight", lambda w: w.t().contiguous()),
    "norm weight in float64": _set_data("features.1", "weight", lambda w: w.double()),
    "norm weight removed": _set_attr("features.1", "weight", None),
    "running mean of another shape": _set_data("features.1", "running_mean", lambda t: torch.zeros(t.numel())),
    "running var in bfloat16": _set_data("features.4", "running_var", lambda t: t.bfloat16()),
    "step count in float": _set_data("features.1", "num_batches_tracked", lambda t: t.float()),
    "momentum None": _set_attr("features.1", "momentum", None),
    "momentum None without step counts": lambda fused: (setattr(fused.features[1], "momentum", None),
                                                        setattr(fused.features[1], "num_batches_tracked", None)),
    "eps zero": _set_attr("features.4", "eps", 0.0),
    "untracked": _set_attr("features.1", "track_running_stats", False),
    "eval": lambda fused: fused.eval(),
    "norm eval only": lambda fused: fused.features[4].eval(),
}

_INPUTS = {
    "same": lambda x: x,
    "another batch": lambda x: torch.randn(x.shape[0], 2 * x.shape[1], *x.shape[2:]),
    "another image size": lambda x: torch.randn(*x.shape[:3], 8, 8),
    "batch-major": lambda x: x.transpose(0, 1).contiguous().transpose(0, 1),
    "channels-last": lambda x: x.permute(1, 3, 4, 0, 2).contiguous().permute(3, 0, 4, 1, 2),
    "float64": lambda x: x.double(),
    "shared": lambda x: hfkern.broadcast(x[0], x.shape[0]),
    "wrong channels": lambda x: torch.randn(*x.shape[:2], 2, *x.shape[3:]),
    "wrong B": lambda x: x[:2],
    "one sample": lambda x: x[:, :1],
}


@pytest.mark.parametrize("mutation", list(_MUTATIONS))
@pytest.mark.parametrize("given", ["same", "another batch", "channels-last", "float64", "shared"])
def test_a_call_that_skips_the_checks_does_what_a_checked_call_does(mutation, given):
    """The convolution + batch norm call skips its checks when a call of the same metadata
    (input strides, both modules' configuration, their tensors' shapes, dtypes and devices,
    backend selection, autocast state) took its path before. Whatever changes after such a
    call, the next call does exactly what it does on a model that remembers nothing: the same
    values bit for bit, the same running statistics, or the same error."""
    B = 3
    torch.manual_seed(4)
    models = [ConvNormNet() for _ in range(B)]
    remembers, forgets = hfkern.fuse(models), hfkern.fuse(models)
    x = torch.randn(B, 4, 3, 6, 6)
    for fused in (remembers, forgets):
        fused(x)
    _forget(forgets)
    assert all(s is not None for s in _served(remembers)) and not any(_served(forgets))
    for fused in (remembers, forgets):
        _MUTATIONS[mutation](fused)
    x2 = _INPUTS[given](x)
    outcomes = [_outcome(lambda: remembers(x2))]
    _forget(forgets)
    outcomes.append(_outcome(lambda: forgets(x2)))
    if isinstance(outcomes[0], torch.Tensor):
        assert torch.equal(outcomes[0], outcomes[1])
        for (name, a), b in zip(remembers.named_buffers(), forgets.buffers()):
            assert torch.equal(a, b), name
    else:
        assert outcomes[0] == outcomes[1]


@pytest.mark.parametrize("given", [g for g in _INPUTS if g != "same"])
def test_a_call_after_the_checked_one_with_other_inputs(given):
    test_a_call_that_skips_the_checks_does_what_a_checked_call_does("nothing", given)


def test_the_checks_are_skipped_only_for_metadata_seen_before(monkeypatch):
    import hfkern.ops.batch_norm as obn
    B = 2
    torch.manual_seed(5)
    fused = hfkern.fuse([ConvNormNet() for _ in range(B)])
    checks = CallCounter(monkeypatch, obn, "_check_forward")
    x = torch.randn(B, 4, 3, 6, 6)
    fused(x)
    first = checks.n
    assert first >= 4  # each of the four calls checked
    fused(x)
    fused(torch.randn(B, 4, 3, 6, 6))
    assert checks.n == first  # the same metadata: not again
    fused(torch.randn(B, 5, 3, 6, 6))
    assert checks.n == 2 * first  # another batch size: checked
    with torch.autocast("cpu", dtype=torch.bfloat16):
        fused(x)
    assert checks.n == 3 * first
    with hfkern.use_backend("torch"):  # another selection string (auto before)
        fused(x)
    assert checks.n == 4 * first


def test_a_served_call_of_the_same_metadata_runs_the_prepared_convolution(monkeypatch):
    """After the first call that took the grouped path, a call of the same metadata runs the
    convolution the first call decided on (GroupedConvCall) without the module's path: the
    same values as a model that decides again, over steps of training."""
    import hfkern.nn.conv as hconv
    from hfkern.fusion import _ConvNorm
    B = 2
    torch.manual_seed(6)
    models = [ConvNormNet() for _ in range(B)]
    fused, twin = hfkern.fuse(models), hfkern.fuse(models)
    calls = [n.target for n in fused.graph.nodes if isinstance(n.target, _ConvNorm)]
    opts = [torch.optim.SGD(m.parameters(), lr=0.1) for m in (fused, twin)]
    decided = CallCounter(monkeypatch, hconv._ArrayConvNd, "_grouped_output")
    for step in range(3):
        x = torch.randn(B, 4, 3, 6, 6)
        for model, opt in zip((fused, twin), opts):
            if model is twin:
                _forget(twin)
            opt.zero_grad()
            model(x).square().sum().backward()
            opt.step()
        if step == 0:
            assert all(c._conv_call is not None for c in calls)
            first = decided.n
    assert decided.n == first + 2 * len(calls)  # the twin only, which forgets
    for (name, a), b in zip(fused.state_dict().items(), twin.state_dict().values()):
        assert torch.equal(a, b), name


@pytest.mark.parametrize("case", ["channels-last input", "1x1"])
def test_a_served_call_that_does_more_than_the_convolution_keeps_the_module_path(case):
    """A call that converts its input's memory format (an input that is not in the format the
    convolution keeps) or runs the CPU's 1x1 convolution as a matmul has no prepared
    convolution: its calls keep deciding through the module, and give its values."""
    from hfkern.fusion import _ConvNorm
    B = 2
    torch.manual_seed(7)
    if case == "1x1":
        models = [PointwiseNet() for _ in range(B)]
    else:
        models = [ConvNormNet() for _ in range(B)]
    fused, twin = hfkern.fuse(models), hfkern.fuse(models)
    x = torch.randn(B, 4, 3, 6, 6)
    if case == "channels-last input":
        for m in (fused, twin):
            m.features[0]._set_memory_format(torch.channels_last)
    for _ in range(2):
        _forget(twin)
        assert torch.equal(fused(x), twin(x))
    first = next(n.target for n in fused.graph.nodes if isinstance(n.target, _ConvNorm))
    assert first._served is not None and first._conv_call is None


@pytest.mark.parametrize("mutation", ["conv weight parametrized", "conv weight a plain tensor"])
def test_tensors_the_signature_cannot_read_are_checked_at_every_call(mutation):
    from hfkern import fusion
    B = 3
    fused = hfkern.fuse([ConvNormNet() for _ in range(B)])
    x = torch.randn(B, 4, 3, 6, 6)
    fused(x)
    _MUTATIONS[mutation](fused)
    assert fusion._signature(fused.features[0], fused.features[1], x) is None
    fused(x)
    assert _served(fused)[0] is None


def test_a_compiler_tracing_the_call_never_skips_the_checks(monkeypatch):
    from hfkern import fusion
    monkeypatch.setattr(torch.compiler, "is_compiling", lambda: True)
    conv = hfkern.nn.Conv2d(2, 2, 3, padding=1, B=2)
    norm = hfkern.nn.BatchNorm2d(2, B=2)
    assert fusion._signature(conv, norm, torch.randn(2, 3, 2, 5, 5)) is None
