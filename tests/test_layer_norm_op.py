import pytest
import torch
import torch.nn.functional as F

import hfkern
from hfkern.ops.layer_norm import (
    array_layer_norm, array_layer_norm_backward, array_rms_norm, array_rms_norm_backward,
)

GRAD_TOL = dict(atol=1e-4, rtol=1e-4)


def make_x(B, shape, layout, dtype=torch.float32, requires_grad=False):
    """[B, *shape] in the given memory layout (shape[0] is the per-model batch N).

    A shared input is a broadcast view of a leaf (``x._base``) that holds its gradient.
    """
    if layout == "contiguous":
        x = torch.randn(B, *shape, dtype=dtype)
    elif layout == "batch_major":  # what an array conv produces
        x = torch.randn(shape[0], B, *shape[1:], dtype=dtype).transpose(0, 1)
    elif layout == "strided":
        x = torch.randn(B, *shape[:-1], 2 * shape[-1], dtype=dtype)[..., ::2]
    elif layout == "transposed":  # dense, last two dims swapped in memory
        x = torch.randn(B, *shape[:-2], shape[-1], shape[-2], dtype=dtype).transpose(-1, -2)
    elif layout == "shared":
        return hfkern.broadcast(torch.randn(*shape, dtype=dtype).requires_grad_(requires_grad), B)
    else:
        raise ValueError(layout)
    return x.requires_grad_(requires_grad)


def params(B, norm_shape, weight, bias, dtype=torch.float32, requires_grad=False):
    w = torch.randn(B, *norm_shape, dtype=dtype).requires_grad_(requires_grad) if weight else None
    b = torch.randn(B, *norm_shape, dtype=dtype).requires_grad_(requires_grad) if bias else None
    return w, b


def ref_layer_norm(x, w, b, norm_ndim, eps):
    S = x.shape[x.dim() - norm_ndim:]
    return torch.stack([
        F.layer_norm(x[i], S, None if w is None else w[i], None if b is None else b[i], eps)
        for i in range(x.shape[0])
    ])


def ref_rms_norm(x, w, norm_ndim, eps):
    S = x.shape[x.dim() - norm_ndim:]
    return torch.stack([
        F.rms_norm(x[i], S, None if w is None else w[i], eps) for i in range(x.shape[0])
    ])


SHAPES = [((5, 7), 1), ((4, 3, 6), 2), ((2, 3, 5, 3), 3), ((7,), 1)]
LAYOUTS = ["contiguous", "batch_major", "strided", "transposed", "shared"]
AFFINE = [(True, True), (True, False), (False, True), (False, False)]


# ---- torch.library.opcheck ------------------------------------------------

# (B, layout): B = 1 and 3, every layout the ops must read
OPCHECK_CASES = [(1, "contiguous"), (3, "batch_major"), (3, "strided"), (3, "transposed")]
# with inputs that do not require grad, the backward ops' own checks are the
# schema and fake ones (the forward ops' test_aot_dispatch_dynamic traces them);
# test_opcheck_backward_ops_with_inputs_that_require_grad runs every check
BACKWARD_UTILS = ("test_schema", "test_faketensor")


@pytest.mark.parametrize("B,layout", OPCHECK_CASES)
@pytest.mark.parametrize("weight,bias", AFFINE)
def test_opcheck_layer_norm(B, layout, weight, bias):
    x = make_x(B, (4, 3, 5), layout, requires_grad=True)
    w, b = params(B, (3, 5), weight, bias, requires_grad=True)
    torch.library.opcheck(array_layer_norm, (x, w, b, 2, 1e-5))


@pytest.mark.parametrize("B,layout", OPCHECK_CASES)
@pytest.mark.parametrize("weight", [True, False])
def test_opcheck_rms_norm(B, layout, weight):
    x = make_x(B, (4, 3, 5), layout, requires_grad=True)
    w, _ = params(B, (5,), weight, False, requires_grad=True)
    torch.library.opcheck(array_rms_norm, (x, w, 1, 1e-6))


def test_opcheck_shared_input():
    B = 3
    x = make_x(B, (4, 6), "shared", requires_grad=True)
    w, b = params(B, (6,), True, True, requires_grad=True)
    torch.library.opcheck(array_layer_norm, (x, w, b, 1, 1e-5))
    torch.library.opcheck(array_rms_norm, (x, w, 1, 1e-5))


@pytest.mark.parametrize("B", [1, 3])
@pytest.mark.parametrize(
    "mask", [[True, True, True], [True, False, False], [False, True, True], [False, False, True]]
)
def test_opcheck_backward_ops(B, mask):
    x = make_x(B, (4, 3, 5), "batch_major")
    w, _ = params(B, (3, 5), True, False)
    _, mean, rstd = array_layer_norm(x, w, None, 2, 1e-5)
    gy = torch.randn(B, 4, 3, 5)
    torch.library.opcheck(
        array_layer_norm_backward, (gy, x, w, mean, rstd, 2, mask), test_utils=BACKWARD_UTILS
    )
    _, rstd = array_rms_norm(x, w, 2, 1e-5)
    torch.library.opcheck(
        array_rms_norm_backward, (gy, x, w, rstd, 2, mask[:2]), test_utils=BACKWARD_UTILS
    )


@pytest.mark.parametrize("layout,mask", [
    ("batch_major", [True, True, True]), ("shared", [True, False, False]),
    ("batch_major", [False, True, True]), ("shared", [False, False, True]),
])
def test_opcheck_backward_ops_with_inputs_that_require_grad(layout, mask):
    # Their autograd formulas (double backward) are registered, traced and checked.
    B = 3
    x = make_x(B, (4, 3, 5), layout, requires_grad=True)
    w, _ = params(B, (3, 5), True, False, requires_grad=True)
    gy = torch.randn(B, 4, 3, 5, requires_grad=True)
    _, mean, rstd = array_layer_norm(x, w, None, 2, 1e-5)
    torch.library.opcheck(array_layer_norm_backward, (gy, x, w, mean, rstd, 2, mask))
    _, rstd = array_rms_norm(x, w, 2, 1e-5)
    torch.library.opcheck(array_rms_norm_backward, (gy, x, w, rstd, 2, mask[:2]))
    _, mean, rstd = array_layer_norm(x, None, None, 2, 1e-5)
    torch.library.opcheck(array_layer_norm_backward, (gy, x, None, mean, rstd, 2, [mask[0], False, mask[2]]))


def test_opcheck_backward_without_weight():
    x = make_x(3, (4, 5), "contiguous")
    _, mean, rstd = array_layer_norm(x, None, None, 1, 1e-5)
    gy = torch.randn(3, 4, 5)
    torch.library.opcheck(array_layer_norm_backward, (gy, x, None, mean, rstd, 1, [True, False, True]))
    _, rstd = array_rms_norm(x, None, 1, 1e-5)
    torch.library.opcheck(array_rms_norm_backward, (gy, x, None, rstd, 1, [True, False]))


# ---- against torch, per model ---------------------------------------------

@pytest.mark.parametrize("B", [1, 3])
@pytest.mark.parametrize("shape,norm_ndim", SHAPES)
@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("weight,bias", AFFINE)
def test_layer_norm_matches_torch(B, shape, norm_ndim, layout, weight, bias):
    if layout in ("batch_major", "transposed") and len(shape) == norm_ndim:
        pytest.skip("no per-model batch dim")
    x = make_x(B, shape, layout, requires_grad=True)
    w, b = params(B, shape[len(shape) - norm_ndim:], weight, bias, requires_grad=True)
    leaves = [t for t in (x._base if layout == "shared" else x, w, b) if t is not None]
    eps = 1e-3
    y, mean, rstd = array_layer_norm(x, w, b, norm_ndim, eps)
    expected = ref_layer_norm(x, w, b, norm_ndim, eps)
    torch.testing.assert_close(y, expected)
    # the output keeps x's memory order; non-dense inputs give a contiguous one
    dense = layout in ("contiguous", "batch_major", "transposed")
    assert y.stride() == (x.stride() if dense else y.contiguous().stride())

    dims = list(range(x.dim() - norm_ndim, x.dim()))
    var, m = torch.var_mean(x.detach().double(), dim=dims, correction=0)
    assert mean.shape == rstd.shape == (B, m[0].numel())
    assert mean.dtype == rstd.dtype == torch.float32 and mean.is_contiguous()
    torch.testing.assert_close(mean, m.reshape(B, -1).float())
    torch.testing.assert_close(rstd, (var + eps).rsqrt().reshape(B, -1).float())

    g = torch.randn_like(expected)
    got = torch.autograd.grad(y, leaves, g)
    ref = torch.autograd.grad(expected, leaves, g)
    for a, e in zip(got, ref):
        torch.testing.assert_close(a, e, **GRAD_TOL)


@pytest.mark.parametrize("B", [1, 3])
@pytest.mark.parametrize("shape,norm_ndim", SHAPES)
@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("weight", [True, False])
def test_rms_norm_matches_torch(B, shape, norm_ndim, layout, weight):
    if layout in ("batch_major", "transposed") and len(shape) == norm_ndim:
        pytest.skip("no per-model batch dim")
    x = make_x(B, shape, layout, requires_grad=True)
    w, _ = params(B, shape[len(shape) - norm_ndim:], weight, False, requires_grad=True)
    leaves = [t for t in (x._base if layout == "shared" else x, w) if t is not None]
    eps = 1e-4
    y, rstd = array_rms_norm(x, w, norm_ndim, eps)
    expected = ref_rms_norm(x, w, norm_ndim, eps)
    torch.testing.assert_close(y, expected)
    dims = list(range(x.dim() - norm_ndim, x.dim()))
    ms = x.detach().double().square().mean(dim=dims)
    torch.testing.assert_close(rstd, (ms + eps).rsqrt().reshape(B, -1).float())

    g = torch.randn_like(expected)
    got = torch.autograd.grad(y, leaves, g)
    ref = torch.autograd.grad(expected, leaves, g)
    for a, e in zip(got, ref):
        torch.testing.assert_close(a, e, **GRAD_TOL)


def test_shared_input_gradient_sums_over_models():
    B = 3
    base = torch.randn(4, 6, requires_grad=True)
    w, b = params(B, (6,), True, True)
    y, _, _ = array_layer_norm(hfkern.broadcast(base, B), w, b, 1, 1e-5)
    g = torch.randn_like(y)
    (got,) = torch.autograd.grad(y, base, g)
    expected = sum(
        torch.autograd.grad(F.layer_norm(base, (6,), w[i], b[i]), base, g[i])[0] for i in range(B)
    )
    torch.testing.assert_close(got, expected, **GRAD_TOL)


def test_gradcheck_float64():
    x = make_x(2, (3, 4), "batch_major", dtype=torch.float64, requires_grad=True)
    w, b = params(2, (4,), True, True, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(lambda *a: array_layer_norm(*a, 1, 1e-5)[0], (x, w, b))
    assert torch.autograd.gradcheck(lambda *a: array_rms_norm(*a, 1, 1e-5)[0], (x, w))
    _, mean, rstd = array_layer_norm(x, w, b, 1, 1e-5)
    assert mean.dtype == rstd.dtype == torch.float64


def test_backward_layouts_and_unrequested_outputs():
    B = 3
    x = make_x(B, (4, 3, 5), "batch_major")
    w, _ = params(B, (3, 5), True, False)
    _, mean, rstd = array_layer_norm(x, w, None, 2, 1e-5)
    gy = torch.randn(B, 4, 3, 5)
    gx, gw, gb = array_layer_norm_backward(gy, x, w, mean, rstd, 2, [True, False, True])
    assert gx.stride() == x.stride() and gx.shape == x.shape
    assert gw.shape == (0,) and gb.shape == (B, 3, 5) and gb.is_contiguous()
    torch.testing.assert_close(gb, gy.sum(1))
    gx2, gw2 = array_rms_norm_backward(gy, x, w, array_rms_norm(x, w, 2, 1e-5)[1], 2, [False, True])
    assert gx2.shape == (0,) and gw2.shape == (B, 3, 5)


# ---- reduced precision ------------------------------------------------------

@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("layout", ["contiguous", "batch_major"])
def test_reduced_precision_against_fp32(dtype, layout):
    B = 3
    x32 = make_x(B, (6, 4, 16), layout)
    w32, b32 = params(B, (4, 16), True, True)
    x, w, b = (t.to(dtype).detach().requires_grad_() for t in (x32, w32, b32))
    # the fp32 reference sees exactly the rounded inputs
    xr, wr, br = (t.detach().float().requires_grad_() for t in (x, w, b))
    tol = dict(atol=5e-2, rtol=2e-2)

    y, mean, rstd = array_layer_norm(x, w, b, 2, 1e-5)
    assert y.dtype == dtype and mean.dtype == rstd.dtype == torch.float32
    yr = ref_layer_norm(xr, wr, br, 2, 1e-5)
    torch.testing.assert_close(y.float(), yr, **tol)
    g = torch.randn_like(yr)
    got = torch.autograd.grad(y, (x, w, b), g.to(dtype))
    ref = torch.autograd.grad(yr, (xr, wr, br), g)
    for a, e in zip(got, ref):
        assert a.dtype == dtype
        torch.testing.assert_close(a.float(), e, **tol)

    y, rstd = array_rms_norm(x, w, 2, 1e-5)
    assert y.dtype == dtype and rstd.dtype == torch.float32
    yr = ref_rms_norm(xr, wr, 2, 1e-5)
    torch.testing.assert_close(y.float(), yr, **tol)
    got = torch.autograd.grad(y, (x, w), g.to(dtype))
    ref = torch.autograd.grad(yr, (xr, wr), g)
    for a, e in zip(got, ref):
        torch.testing.assert_close(a.float(), e, **tol)


# ---- errors and dispatch ----------------------------------------------------

def test_bad_arguments_raise():
    x = torch.randn(3, 4, 5)
    with pytest.raises(ValueError, match=r"expected weight of shape \[3, 5\].*got \[2, 5\]"):
        array_layer_norm(x, torch.randn(2, 5), None, 1, 1e-5)
    with pytest.raises(ValueError, match=r"expected bias of shape \[3, 4, 5\].*got \[3, 5\]"):
        array_layer_norm(x, None, torch.randn(3, 5), 2, 1e-5)
    with pytest.raises(ValueError, match=r"norm_ndim=0"):
        array_rms_norm(x, None, 0, 1e-5)
    with pytest.raises(ValueError, match=r"norm_ndim=3 and x of shape \[3, 4, 5\]"):
        array_layer_norm(x, None, None, 3, 1e-5)
    _, mean, rstd = array_layer_norm(x, None, None, 1, 1e-5)
    with pytest.raises(ValueError, match=r"grad_weight but weight is None"):
        array_layer_norm_backward(x, x, None, mean, rstd, 1, [True, True, False])
    with pytest.raises(ValueError, match=r"output_mask of length 2"):
        array_rms_norm_backward(x, x, None, rstd, 1, [True, False, False])


def test_ops_dispatch_through_registry():
    info = hfkern.backend_info()["ops"]
    for op in ("array_layer_norm", "array_layer_norm_backward", "array_rms_norm", "array_rms_norm_backward"):
        assert "torch" in info[op]["registered"]
        assert info[op]["cpu"].startswith("torch")
    from hfkern import _backend

    calls = []
    orig = _backend._registry["array_rms_norm"]["torch"].fn

    def spy(*args):
        calls.append(args[2:])
        return orig(*args)

    _backend.register("array_rms_norm", "torch", spy)
    try:
        array_rms_norm(torch.randn(2, 3, 4), None, 1, 1e-5)
    finally:
        _backend.register("array_rms_norm", "torch", orig)
    assert calls == [(1, 1e-5)]
