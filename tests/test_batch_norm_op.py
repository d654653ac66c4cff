"""hfkern::array_batch_norm on the torch path against B separate torch BatchNorm modules."""

import math

import pytest
import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

import hfkern
import hfkern.nn as hnn
from hfkern import _backend
from hfkern.ops.batch_norm import array_batch_norm, array_batch_norm_backward

GRAD_TOL = dict(atol=1e-4, rtol=1e-4)
EPS = 1e-5
OP = torch.ops.hfkern.array_batch_norm.default
TORCH_BN = {0: nn.BatchNorm1d, 1: nn.BatchNorm1d, 2: nn.BatchNorm2d, 3: nn.BatchNorm3d}


def make_x(B, shape, layout, dtype=torch.float32, requires_grad=False):
    """[B, *shape] (shape = (N, C, *S)) in the given memory layout.

    A shared input is a broadcast view of a leaf (``x._base``) that holds its gradient.
    """
    N, C, *S = shape
    if layout == "contiguous":
        x = torch.randn(B, *shape, dtype=dtype)
    elif layout == "batch_major":  # what an array conv produces: [N, B, C, *S] memory
        x = torch.randn(N, B, *shape[1:], dtype=dtype).transpose(0, 1)
    elif layout == "strided":  # every other element of the last dim
        x = torch.randn(B, *shape[:-1], 2 * shape[-1], dtype=dtype)[..., ::2]
    elif layout == "channels_last":  # [B, N, *S, C] memory
        x = torch.randn(B, N, *S, C, dtype=dtype).movedim(-1, 2)
    elif layout == "shared":
        return hfkern.broadcast(torch.randn(*shape, dtype=dtype).requires_grad_(requires_grad), B)
    else:
        raise ValueError(layout)
    return x.requires_grad_(requires_grad)


def leaf_of(x):
    return x._base if hfkern.is_shared(x) else x


def params(B, C, weight, bias, dtype=torch.float32, requires_grad=False):
    w = torch.randn(B, C, dtype=dtype).requires_grad_(requires_grad) if weight else None
    b = torch.randn(B, C, dtype=dtype).requires_grad_(requires_grad) if bias else None
    return w, b


def running(B, C, dtype=torch.float32):
    """Fresh running statistics and per-model counts (this batch included, all different)."""
    return (torch.randn(B, C, dtype=dtype), torch.rand(B, C, dtype=dtype) + 0.5,
            torch.arange(1, B + 1) * 3)


def reference(x, w, b, rm, rv, nbt, training, momentum, eps):
    """B torch BatchNorm modules on x[i]: (y, running_mean, running_var, modules)."""
    B, N, C = x.shape[:3]
    cls = TORCH_BN[x.dim() - 3]
    modules, ys = [], []
    xd = x.detach()
    for i in range(B):
        m = cls(C, eps=eps, momentum=momentum, track_running_stats=rm is not None, dtype=x.dtype)
        with torch.no_grad():
            m.weight.copy_(w[i] if w is not None else torch.ones(C))
            m.bias.copy_(b[i] if b is not None else torch.zeros(C))
            if rm is not None:
                m.running_mean.copy_(rm[i])
                m.running_var.copy_(rv[i])
                m.num_batches_tracked.fill_(int(nbt[i]) - 1)  # the module counts this batch itself
        if w is None:
            m.weight = None
        if b is None:
            m.bias = None
        m.train(training)
        xi = xd[i].clone().requires_grad_()
        ys.append((m, xi, m(xi)))
        modules.append(m)
    y = torch.stack([t[2] for t in ys])
    stats = (None, None) if rm is None else (
        torch.stack([m.running_mean for m in modules]), torch.stack([m.running_var for m in modules]))
    return y, stats, ys


def reference_grads(ys, g, x_shared, want_w, want_b):
    gx, gw, gb = [], [], []
    for i, (m, xi, yi) in enumerate(ys):
        inputs = [xi] + ([m.weight] if want_w else []) + ([m.bias] if want_b else [])
        grads = torch.autograd.grad(yi, inputs, g[i])
        gx.append(grads[0])
        if want_w:
            gw.append(grads[1])
        if want_b:
            gb.append(grads[-1])
    out = [sum(gx) if x_shared else torch.stack(gx)]
    return out + ([torch.stack(gw)] if want_w else []) + ([torch.stack(gb)] if want_b else [])


SHAPES = [(6, 5), (4, 3, 7), (3, 4, 5, 3), (2, 3, 3, 2, 4)]  # (N, C, *S), 0 to 3 spatial dims
LAYOUTS = ["contiguous", "batch_major", "strided", "channels_last", "shared"]
# (training, momentum, running stats)
MODES = {
    "train": (True, 0.1, True),
    "train_cumulative": (True, None, True),
    "train_untracked": (True, 0.1, False),
    "eval": (False, 0.1, True),
}


def check_against_torch(B, shape, layout, weight, bias, mode, eps=1e-3):
    training, momentum, tracked = MODES[mode]
    C = shape[1]
    x = make_x(B, shape, layout, requires_grad=True)
    w, b = params(B, C, weight, bias, requires_grad=True)
    rm, rv, nbt = running(B, C) if tracked else (None, None, None)
    expected, (exp_rm, exp_rv), ys = reference(x, w, b, rm, rv, nbt, training, momentum, eps)

    y, mean, rstd = array_batch_norm(x, w, b, rm, rv, nbt, training, momentum, eps)
    torch.testing.assert_close(y, expected)
    # the output keeps x's memory order; a non-dense input gives a dense one
    dense = layout in ("contiguous", "batch_major", "channels_last")
    assert y.stride() == (x.stride() if dense else torch.empty_like(x).stride())
    if tracked:
        torch.testing.assert_close(rm, exp_rm, atol=1e-6, rtol=1e-5)
        torch.testing.assert_close(rv, exp_rv, atol=1e-6, rtol=1e-5)

    # the statistics y was normalized with, [B, C] float32 and contiguous
    assert mean.shape == rstd.shape == (B, C) and mean.is_contiguous() and rstd.is_contiguous()
    assert mean.dtype == rstd.dtype == torch.float32 and not mean.requires_grad
    if training:
        var, m = torch.var_mean(x.detach().double(), dim=[1, *range(3, x.dim())], correction=0)
        torch.testing.assert_close(mean, m.float())
        torch.testing.assert_close(rstd, (var + eps).rsqrt().float())

    g = torch.randn_like(expected)
    leaves = [leaf_of(x)] + [t for t in (w, b) if t is not None]
    got = torch.autograd.grad(y, leaves, g)
    ref = reference_grads(ys, g, hfkern.is_shared(x), w is not None, b is not None)
    for a, e in zip(got, ref):
        torch.testing.assert_close(a, e, **GRAD_TOL)


@pytest.mark.parametrize("B", [1, 3])
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("mode", list(MODES))
def test_matches_torch_modules(B, shape, layout, mode):
    check_against_torch(B, shape, layout, True, True, mode)


@pytest.mark.parametrize("weight,bias", [(True, False), (False, True), (False, False)])
@pytest.mark.parametrize("mode", list(MODES))
@pytest.mark.parametrize("layout", ["batch_major", "shared"])
def test_partial_affine_matches_torch_modules(weight, bias, mode, layout):
    check_against_torch(3, (5, 4, 3, 3), layout, weight, bias, mode)


@pytest.mark.parametrize("momentum", [0.1, None])
def test_trajectory_then_eval(momentum):
    # running statistics carried across steps by the op, as B torch modules carry theirs
    B, C = 3, 4
    torch_bns = [nn.BatchNorm1d(C, momentum=momentum) for _ in range(B)]
    rm, rv, nbt = torch.zeros(B, C), torch.ones(B, C), torch.zeros(B, dtype=torch.long)
    for _ in range(3):
        x = make_x(B, (6, C, 5), "batch_major")
        nbt += 1
        y, _, _ = array_batch_norm(x, None, None, rm, rv, nbt, True, momentum, EPS)
        torch.testing.assert_close(y, torch.stack([m(x[i]) for i, m in enumerate(torch_bns)]))
        torch.testing.assert_close(rv, torch.stack([m.running_var for m in torch_bns]))
    for m in torch_bns:
        m.eval()
    x = make_x(B, (6, C, 5), "contiguous")
    y, _, _ = array_batch_norm(x, None, None, rm, rv, nbt, False, momentum, EPS)
    torch.testing.assert_close(y, torch.stack([m(x[i]) for i, m in enumerate(torch_bns)]))
    torch.testing.assert_close(rm, torch.stack([m.running_mean for m in torch_bns]))


# ---- memory: x is read where it lies -------------------------------------------

class _CopySpy(TorchDispatchMode):
    """Records every copy (clone, _to_copy, copy_ from) that reads one of ``watched``'s storages."""

    COPIES = {torch.ops.aten.clone.default, torch.ops.aten._to_copy.default, torch.ops.aten.copy_.default,
              torch.ops.aten.contiguous.default}

    def __init__(self, *watched):
        super().__init__()
        self.storages = {t.untyped_storage().data_ptr() for t in watched}
        self.copies = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        sources = args[1:2] if func is torch.ops.aten.copy_.default else args[:1]
        if func in self.COPIES and any(
            isinstance(a, torch.Tensor) and a.untyped_storage().data_ptr() in self.storages for a in sources
        ):
            self.copies.append(func)
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("layout", ["batch_major", "contiguous", "channels_last", "shared"])
def test_input_and_grad_are_copied_only_where_the_grouped_view_is_not_free(layout):
    """The torch path reads an array conv's memory ([N, B, C, *S]) and channels-last array
    images where they lie (torch's kernel on the free grouped view), and a shared input once;
    B-major memory (a linear layer's [B, N, C] output, per-model images) is copied once into the grouped
    layout, x forward and x and grad_y backward (torch's kernel on the copy costs less than
    strided reductions). Outputs take x's layout either way."""
    B = 3
    x = make_x(B, (4, 5, 3, 6), layout)
    w, b = params(B, 5, True, True)
    rm, rv, nbt = running(B, 5)
    gy = make_x(B, (4, 5, 3, 6), "batch_major" if layout == "shared" else layout)
    # the implementations themselves: a dispatch mode sees a custom op as one call
    forward, backward = (_backend._registry[op]["torch"].load()
                         for op in ("array_batch_norm", "array_batch_norm_backward"))
    copied = layout in ("contiguous", "channels_last")  # B-major: [B, N, C, *S] and [B, N, *S, C]
    with _CopySpy(x) as spy:
        y, mean, rstd = forward(x, w, b, rm, rv, nbt, True, 0.1, EPS)
    assert len(spy.copies) == copied
    assert y.stride() == (torch.empty_like(x).stride())
    with _CopySpy(x, gy) as spy:
        gx, _, _ = backward(gy, x, w, mean, rstd, True, [True, True, True])
    assert len(spy.copies) == 2 * copied
    assert gx.stride() == y.stride()


class _ZerosSpy(TorchDispatchMode):
    """Records every tensor of zeros made outside the ops (autograd materializing a gradient)."""

    ZEROS = {torch.ops.aten.zeros.default, torch.ops.aten.zeros_like.default, torch.ops.aten.new_zeros.default}

    def __init__(self):
        super().__init__()
        self.zeros = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func in self.ZEROS:
            self.zeros.append(func)
        return func(*args, **(kwargs or {}))


def test_backward_gets_no_zero_gradients_for_the_statistics():
    """mean and rstd take no gradient: the backward is handed None for them, not [B, C] zeros
    that autograd would allocate and fill at every step."""
    B = 3
    x = make_x(B, (4, 5, 3, 6), "batch_major", requires_grad=True)
    w, b = params(B, 5, True, True, requires_grad=True)
    y, _, _ = array_batch_norm(x, w, b, None, None, None, True, None, EPS)
    with _ZerosSpy() as spy:
        y.backward(torch.randn_like(y))
    assert spy.zeros == []
    assert x.grad is not None and w.grad is not None and b.grad is not None


def test_running_statistics_updated_in_place():
    B, C = 2, 3
    rm, rv, nbt = running(B, C)
    ptrs = rm.data_ptr(), rv.data_ptr()
    versions = rm._version, rv._version
    x = make_x(B, (5, C), "contiguous")
    OP(x, None, None, rm, rv, nbt, True, 0.2, EPS)
    assert (rm.data_ptr(), rv.data_ptr()) == ptrs
    assert rm._version > versions[0] and rv._version > versions[1]
    # eval and untracked training leave them alone
    before = rm.clone(), rv.clone()
    OP(x, None, None, rm, rv, nbt, False, 0.2, EPS)
    assert torch.equal(rm, before[0]) and torch.equal(rv, before[1])


def test_cumulative_average_per_model_counts():
    # momentum=None: model b averages with factor 1 / num_batches_tracked[b]
    B, C = 3, 2
    rm, rv = torch.zeros(B, C), torch.ones(B, C)
    nbt = torch.tensor([1, 2, 4])
    x = make_x(B, (7, C), "contiguous")
    OP(x, None, None, rm, rv, nbt, True, None, EPS)
    f = 1 / nbt.double().unsqueeze(1)
    var, mean = torch.var_mean(x.double(), dim=1, correction=1)
    torch.testing.assert_close(rm, (f * mean).float())
    torch.testing.assert_close(rv, (f * var + (1 - f)).float())


# ---- gradients ------------------------------------------------------------------

@pytest.mark.parametrize("training", [True, False])
@pytest.mark.parametrize("layout", ["batch_major", "shared"])
def test_gradcheck_and_double_backward_float64(training, layout):
    B, C = 2, 3
    x = make_x(B, (4, C, 3), layout, dtype=torch.float64, requires_grad=True)
    w, b = params(B, C, True, True, dtype=torch.float64, requires_grad=True)
    rm, rv, nbt = running(B, C, dtype=torch.float64)
    base = leaf_of(x)

    def fn(base, w, b):
        xi = hfkern.broadcast(base, B) if layout == "shared" else base
        return array_batch_norm(xi, w, b, rm, rv, nbt, training, 0.1, 1e-3)[0]

    assert torch.autograd.gradcheck(fn, (base, w, b))
    assert torch.autograd.gradgradcheck(fn, (base, w, b))
    _, mean, rstd = array_batch_norm(x, w, b, rm, rv, nbt, training, 0.1, 1e-3)
    assert mean.dtype == rstd.dtype == torch.float64


def test_double_backward_matches_torch():
    # a gradient penalty through the array op and through B torch modules
    B, C = 3, 4
    x = make_x(B, (5, C, 3), "batch_major", requires_grad=True)
    w, b = params(B, C, True, True, requires_grad=True)
    y, _, _ = array_batch_norm(x, w, b, None, None, None, True, 0.1, EPS)
    (gx,) = torch.autograd.grad(y.square().sum(), x, create_graph=True)
    got = torch.autograd.grad(gx.square().sum(), [x, w, b])
    expected = []
    for i in range(B):
        xi = x[i].detach().clone().requires_grad_()
        wi, bi = w[i].detach().clone().requires_grad_(), b[i].detach().clone().requires_grad_()
        yi = torch.nn.functional.batch_norm(xi, None, None, wi, bi, True, 0.1, EPS)
        (gxi,) = torch.autograd.grad(yi.square().sum(), xi, create_graph=True)
        expected.append(torch.autograd.grad(gxi.square().sum(), [xi, wi, bi]))
    for k, g in enumerate(got):
        torch.testing.assert_close(g, torch.stack([e[k] for e in expected]), **GRAD_TOL)


def test_backward_op_masks_and_layouts():
    B, C = 3, 4
    x = make_x(B, (5, C, 2, 3), "batch_major")
    w, _ = params(B, C, True, False)
    _, mean, rstd = OP(x, w, None, None, None, None, True, 0.1, EPS)
    gy = torch.randn(x.shape)
    gx, gw, gb = array_batch_norm_backward(gy, x, w, mean, rstd, True, [True, False, True])
    assert gx.stride() == x.stride() and gw.shape == (0,)
    assert gb.shape == (B, C) and gb.is_contiguous()
    torch.testing.assert_close(gb, gy.sum(dim=(1, 3, 4)))
    # gy in [B, N, ...] memory, x in [N, B, ...]: the documented training formula
    n, view = 5 * 2 * 3, (B, 1, C, 1, 1)
    xhat = (x - mean.view(view)) * rstd.view(view)
    want = (w * rstd).view(view) * (gy - gy.sum(dim=(1, 3, 4)).view(view) / n
                                    - xhat * (gy * xhat).sum(dim=(1, 3, 4)).view(view) / n)
    torch.testing.assert_close(gx, want, **GRAD_TOL)
    gx2, gw2, gb2 = array_batch_norm_backward(gy, x, w, mean, rstd, True, [False, True, False])
    assert gx2.shape == (0,) and gb2.shape == (0,) and gw2.shape == (B, C)
    xhat = (x - mean.view(B, 1, C, 1, 1)) * rstd.view(B, 1, C, 1, 1)
    torch.testing.assert_close(gw2, (gy * xhat).sum(dim=(1, 3, 4)), **GRAD_TOL)
    # eval: the affine backward
    gx3, _, _ = array_batch_norm_backward(gy, x, w, mean, rstd, False, [True, False, False])
    torch.testing.assert_close(gx3, gy * (w * rstd).view(B, 1, C, 1, 1))


# ---- torch.library.opcheck and torch.compile -------------------------------------

# The forward op mutates the running statistics, so it has no torch.library
# autograd formula (array_batch_norm, an autograd.Function, differentiates it):
# it is checked with inputs that do not require grad.
OPCHECK_CASES = [
    (1, (4, 3), "contiguous", "train"),
    (3, (4, 3, 5), "batch_major", "train_cumulative"),
    (3, (3, 3, 4, 2), "channels_last", "train_untracked"),
    (2, (3, 3, 4, 2), "strided", "eval"),
    (3, (4, 3, 5), "shared", "train"),
]


@pytest.mark.parametrize("B,shape,layout,mode", OPCHECK_CASES)
def test_opcheck_forward(B, shape, layout, mode):
    training, momentum, tracked = MODES[mode]
    x = make_x(B, shape, layout)
    w, b = params(B, shape[1], True, True)
    rm, rv, nbt = running(B, shape[1]) if tracked else (None, None, None)
    torch.library.opcheck(OP, (x, w, b, rm, rv, nbt, training, momentum, EPS))
    torch.library.opcheck(OP, (x, None, None, rm, rv, nbt, training, momentum, EPS))


MASKS = [[True, True, True], [True, False, False], [False, True, True], [False, False, True]]


@pytest.mark.parametrize("training", [True, False])
@pytest.mark.parametrize("mask", MASKS)
def test_opcheck_backward(training, mask):
    B, C = 3, 4
    x = make_x(B, (5, C, 3), "batch_major")
    w, _ = params(B, C, True, False)
    rm, rv, nbt = running(B, C)
    _, mean, rstd = OP(x, w, None, rm, rv, nbt, training, 0.1, EPS)
    gy = torch.randn(x.shape)
    torch.library.opcheck(array_batch_norm_backward, (gy, x, w, mean, rstd, training, mask),
                          test_utils=("test_schema", "test_faketensor"))
    # with inputs that require grad: the double-backward formula is traced and checked too
    xs, ws, gys = (t.detach().clone().requires_grad_() for t in (x, w, gy))
    torch.library.opcheck(array_batch_norm_backward, (gys, xs, ws, mean, rstd, training, mask))
    if not mask[1]:
        torch.library.opcheck(array_batch_norm_backward, (gys, xs, None, mean, rstd, training, mask))


@pytest.mark.parametrize("momentum", [0.1, None])
def test_compile_training_module(momentum):
    # fullgraph: the Function, the in-place running update and the backward trace
    torch._dynamo.reset()
    B, C = 3, 4
    eager = hnn.BatchNorm2d(C, momentum=momentum, B=B)
    with torch.no_grad():
        eager.weight.normal_()
        eager.bias.normal_()
    compiled_module = hnn.BatchNorm2d(C, momentum=momentum, B=B)
    compiled_module.load_state_dict(eager.state_dict())
    compiled = torch.compile(compiled_module, fullgraph=True, backend="aot_eager")
    for _ in range(2):
        x = make_x(B, (5, C, 3, 3), "batch_major")
        xs = [x.detach().clone().requires_grad_() for _ in range(2)]
        outs = [eager(xs[0]), compiled(xs[1])]
        torch.testing.assert_close(outs[1], outs[0])
        g = torch.randn_like(outs[0])
        grads = [torch.autograd.grad(o, [xi, m.weight, m.bias], g)
                 for o, xi, m in zip(outs, xs, (eager, compiled_module))]
        for a, e in zip(grads[1], grads[0]):
            torch.testing.assert_close(a, e, **GRAD_TOL)
    for k, v in eager.state_dict().items():
        torch.testing.assert_close(compiled_module.state_dict()[k], v)


# ---- edge cases ----------------------------------------------------------------

def test_empty_batch():
    B, C = 2, 3
    x = torch.randn(B, 0, C, 4)
    rm, rv, nbt = running(B, C)
    before = rm.clone(), rv.clone()
    y, mean, rstd = OP(x, None, None, rm, rv, nbt, True, 0.1, EPS)
    assert y.shape == x.shape and mean.shape == (B, C) and torch.isnan(mean).all()
    assert torch.equal(rm, before[0]) and torch.equal(rv, before[1])
    y, mean, rstd = OP(x, None, None, rm, rv, nbt, False, 0.1, EPS)
    torch.testing.assert_close(mean, rm)
    w = torch.randn(B, C)
    gx, gw, gb = array_batch_norm_backward(x, x, w, mean, rstd, True, [True, True, True])
    assert gx.shape == x.shape and torch.equal(gw, torch.zeros(B, C)) and torch.equal(gb, torch.zeros(B, C))


def test_one_channel_and_odd_sizes():
    check_against_torch(1, (7, 1, 3), "contiguous", True, True, "train")
    check_against_torch(5, (3, 7, 1, 5), "batch_major", True, True, "train")


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_reduced_precision_against_fp32(dtype):
    B, C = 3, 6
    x32 = make_x(B, (8, C, 4, 4), "batch_major")
    w32, b32 = params(B, C, True, True)
    x, w, b = (t.to(dtype).detach().requires_grad_() for t in (x32, w32, b32))
    xr, wr, br = (t.detach().float().requires_grad_() for t in (x, w, b))
    rm, rv = torch.zeros(B, C, dtype=dtype), torch.ones(B, C, dtype=dtype)
    rm32, rv32 = rm.float(), rv.float()
    tol = dict(atol=5e-2, rtol=2e-2)
    y, mean, rstd = array_batch_norm(x, w, b, rm, rv, None, True, 0.1, EPS)
    assert y.dtype == dtype and mean.dtype == rstd.dtype == torch.float32
    yr, _, _ = array_batch_norm(xr, wr, br, rm32, rv32, None, True, 0.1, EPS)
    torch.testing.assert_close(y.float(), yr, **tol)
    torch.testing.assert_close(rm.float(), rm32, **tol)
    torch.testing.assert_close(rv.float(), rv32, **tol)
    g = torch.randn_like(yr)
    got = torch.autograd.grad(y, (x, w, b), g.to(dtype))
    ref = torch.autograd.grad(yr, (xr, wr, br), g)
    for a, e in zip(got, ref):
        assert a.dtype == dtype
        torch.testing.assert_close(a.float(), e, **tol)


# ---- errors and dispatch ----------------------------------------------------------

def test_bad_arguments_raise():
    B, C = 3, 4
    x = torch.randn(B, 5, C, 2)
    rm, rv, nbt = running(B, C)
    with pytest.raises(ValueError, match=r"0 to 3 spatial dims.*got 2-D shape \[3, 5\]"):
        OP(torch.randn(B, 5), None, None, None, None, None, True, 0.1, EPS)
    with pytest.raises(TypeError, match=r"x of a floating-point dtype, got torch.int64"):
        OP(torch.ones(B, 5, C, dtype=torch.long), None, None, None, None, None, True, 0.1, EPS)
    with pytest.raises(ValueError, match=r"expected weight of shape \[3, 4\].*got \[4\]"):
        OP(x, torch.randn(C), None, None, None, None, True, 0.1, EPS)
    with pytest.raises(ValueError, match=r"expected running_var of shape \[3, 4\].*got \[3, 5\]"):
        OP(x, None, None, rm, torch.ones(B, 5), nbt, True, 0.1, EPS)
    with pytest.raises(TypeError, match=r"running_mean of a floating-point dtype, got torch.int64"):
        OP(x, None, None, rm.long(), rv, nbt, True, 0.1, EPS)
    with pytest.raises(ValueError, match=r"both or neither, got only running_mean"):
        OP(x, None, None, rm, None, nbt, True, 0.1, EPS)
    with pytest.raises(ValueError, match=r"training=False.*expected running_mean and running_var, got None"):
        OP(x, None, None, None, None, None, False, 0.1, EPS)
    with pytest.raises(ValueError, match=r"more than 1 value per channel.*\[3, 1, 4\]"):
        OP(torch.randn(B, 1, C), None, None, None, None, None, True, 0.1, EPS)
    with pytest.raises(ValueError, match=r"num_batches_tracked of shape \[3\].*got None"):
        OP(x, None, None, rm, rv, None, True, None, EPS)
    with pytest.raises(ValueError, match=r"num_batches_tracked of shape \[3\].*got \[2\]"):
        OP(x, None, None, rm, rv, nbt[:2], True, None, EPS)
    with pytest.raises(TypeError, match=r"num_batches_tracked of an integer dtype, got torch.float32"):
        OP(x, None, None, rm, rv, nbt.float(), True, None, EPS)
    _, mean, rstd = OP(x, None, None, None, None, None, True, 0.1, EPS)
    with pytest.raises(ValueError, match=r"grad_weight but weight is None"):
        array_batch_norm_backward(x, x, None, mean, rstd, True, [True, True, False])
    with pytest.raises(ValueError, match=r"output_mask of length 3, got \[True, False\]"):
        array_batch_norm_backward(x, x, None, mean, rstd, True, [True, False])
    with pytest.raises(ValueError, match=r"grad_y of x's shape \[3, 5, 4, 2\], got \[3, 5, 4\]"):
        array_batch_norm_backward(x[..., 0], x, None, mean, rstd, True, [True, False, False])
    with pytest.raises(ValueError, match=r"expected mean of shape \[3, 4\].*got \[4\]"):
        array_batch_norm_backward(x, x, None, mean[0], rstd, True, [True, False, False])


def test_ops_dispatch_through_registry():
    info = hfkern.backend_info()["ops"]
    for op in ("array_batch_norm", "array_batch_norm_backward"):
        assert "torch" in info[op]["registered"]
        assert info[op]["cpu"].startswith("torch")
    calls = []
    orig = _backend._registry["array_batch_norm"]["torch"].fn

    def spy(*args):
        calls.append(args[6:])
        return orig(*args)

    _backend.register("array_batch_norm", "torch", spy)
    try:
        # (in eager mode the torch path trains under torch's autograd without the op)
        with _backend.dispatched_ops():
            y, _, _ = array_batch_norm(torch.randn(2, 3, 4, requires_grad=True), None, None, None, None, None,
                                       True, 0.5, 1e-4)
            y.sum().backward()
    finally:
        _backend.register("array_batch_norm", "torch", orig)
    assert calls == [(True, 0.5, 1e-4, "none")]  # training, momentum, eps, activation


def test_module_runs_the_op():
    calls = []
    orig = _backend._registry["array_batch_norm"]["torch"].fn

    def spy(*args):
        calls.append(args[6])
        return orig(*args)

    module = hnn.BatchNorm2d(3, B=2)
    _backend.register("array_batch_norm", "torch", spy)
    try:
        with _backend.dispatched_ops():  # as under torch.compile: the op, training too
            module(torch.randn(2, 4, 3, 2, 2))
            module.eval()
            module(torch.randn(2, 4, 3, 2, 2))
    finally:
        _backend.register("array_batch_norm", "torch", orig)
    assert calls == [True, False]
    assert math.isclose(float(module.num_batches_tracked[0]), 1)


class _NativeSpy(TorchDispatchMode):
    """Counts torch's own batch-norm kernels (the grouped path) under the ops."""

    def __init__(self):
        super().__init__()
        self.calls = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func in (torch.ops.aten.native_batch_norm.default, torch.ops.aten.native_batch_norm_backward.default):
            self.calls.append(func)
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("layout", ["batch_major", "channels_last_array"])
@pytest.mark.parametrize("affine", [True, False])
def test_mixed_precision_runs_torchs_kernel_on_the_grouped_view(dtype, layout, affine):
    """Autocast's case: reduced-precision activations, float32 parameters and statistics;
    the grouped path (torch's own kernels) serves it, with float32 statistics."""
    B, N, C, H, W = 3, 4, 5, 3, 4
    if layout == "batch_major":
        x32 = make_x(B, (N, C, H, W), "batch_major")
    else:  # [N, H, W, B, C] memory
        x32 = torch.randn(N, H, W, B, C).permute(3, 0, 4, 1, 2)
    x = x32.to(dtype).requires_grad_()  # keeps the memory order
    w, b = params(B, C, affine, affine, requires_grad=True)
    rm, rv, _ = running(B, C)
    rm32, rv32 = rm.clone(), rv.clone()
    forward, backward = (_backend._registry[op]["torch"].load()
                         for op in ("array_batch_norm", "array_batch_norm_backward"))
    with _NativeSpy() as spy:
        y, mean, rstd = forward(x.detach(), w, b, rm, rv, None, True, 0.1, EPS)
    assert spy.calls == [torch.ops.aten.native_batch_norm.default]
    assert y.dtype == dtype and mean.dtype == rstd.dtype == torch.float32 and y.stride() == x.stride()
    xr = x.detach().float().requires_grad_()
    wr, br = (None if t is None else t.detach().clone().requires_grad_() for t in (w, b))
    yr, mean_r, rstd_r = array_batch_norm(xr, wr, br, rm32, rv32, None, True, 0.1, EPS)
    torch.testing.assert_close(mean, mean_r, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(rstd, rstd_r, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(rm, rm32, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(rv, rv32, atol=1e-5, rtol=1e-5)
    tol = dict(atol=2e-2, rtol=2e-2)
    torch.testing.assert_close(y.float(), yr, **tol)
    g = torch.randn_like(yr)
    mask = [True, affine, affine]
    with _NativeSpy() as spy:
        gx, gw, gb = backward(g.to(dtype), x.detach(), w, mean, rstd, True, mask)
    assert spy.calls == [torch.ops.aten.native_batch_norm_backward.default]
    ref = torch.autograd.grad(yr, [xr] + ([wr, br] if affine else []), g)
    assert gx.dtype == dtype and gx.stride() == x.stride()
    torch.testing.assert_close(gx.float(), ref[0], **tol)
    if affine:
        assert gw.dtype == gb.dtype == torch.float32
        torch.testing.assert_close(gw, ref[1], **tol)
        torch.testing.assert_close(gb, ref[2], **tol)
