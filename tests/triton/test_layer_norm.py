"""Triton array layer norm / RMS norm against the torch implementation.

Interpreter tests call the launchers on CPU float32 tensors (TRITON_INTERPRET=1),
with shapes chosen to reach every kernel path: a row in one block or swept in
blocks, rows and columns stored as one or two strided dims (or copied when they
need more), several row tiles per backward chunk and several chunks per model.
GPU tests go through the hfkern ops with the triton backend selected.
"""

import pytest

triton = pytest.importorskip("triton")

import torch  # noqa: E402
from _norm_cases import (  # noqa: E402
    EPS,
    GRAD_TOL,
    Impls,
    assert_as_accurate,
    assert_grads,
    assert_same_layout,
)
from _norm_cases import masks as ln_masks  # noqa: E402

import hfkern  # noqa: E402
import hfkern.nn as hnn  # noqa: E402
from hfkern import _backend  # noqa: E402
from hfkern.ops import layer_norm as lnops  # noqa: E402
from hfkern.triton import layer_norm as tk_module  # noqa: E402

_NORM_OPS = ("array_layer_norm", "array_layer_norm_backward", "array_rms_norm", "array_rms_norm_backward")


ref = Impls("torch", _NORM_OPS)
# the device the GPU tests run on (a name, so their logic can be tried elsewhere)
GPU = "cuda"


def make_x(B, shape, layout, dtype=torch.float32, device="cpu"):
    """[B, *shape] in the given memory layout (shape[0] is the per-model batch N)."""
    kw = dict(dtype=dtype, device=device)
    if layout == "contiguous":
        return torch.randn(B, *shape, **kw)
    if layout == "batch_major":  # what an array conv produces: [N, B, ...] memory
        return torch.randn(shape[0], B, *shape[1:], **kw).transpose(0, 1)
    if layout == "strided":
        return torch.randn(B, *shape[:-1], 2 * shape[-1], **kw)[..., ::2]
    if layout == "transposed":  # dense, last two dims swapped in memory
        return torch.randn(B, *shape[:-2], shape[-1], shape[-2], **kw).transpose(-1, -2)
    if layout == "shared":
        return hfkern.broadcast(torch.randn(*shape, **kw), B)
    if layout == "scrambled":  # three per-model dims no two of which merge: [b, B, a, c, D] memory
        a, b, c, d = shape
        return torch.randn(b, B, a, c, d, **kw).permute(1, 2, 0, 3, 4)
    raise ValueError(layout)


def params(B, norm_shape, weight, bias, dtype=torch.float32, device="cpu"):
    kw = dict(dtype=dtype, device=device)
    w = torch.randn(B, *norm_shape, **kw) if weight else None
    b = torch.randn(B, *norm_shape, **kw) if bias else None
    return w, b


# ---- interpreter: launchers against the torch implementation -----------------

def _tk():
    from hfkern.triton import layer_norm as tk

    return tk


def check_layer_norm(x, w, b, nd, masks, grad_y=None, activation="none"):
    tk = _tk()
    y, mean, rstd = tk.array_layer_norm(x, w, b, nd, EPS, activation)
    y0, mean0, rstd0 = ref.array_layer_norm(x, w, b, nd, EPS, activation)
    for got, exp in ((y, y0), (mean, mean0), (rstd, rstd0)):
        assert_same_layout(got, exp)
        torch.testing.assert_close(got, exp)
    assert mean.is_contiguous() and rstd.is_contiguous()
    gy = torch.randn(y0.shape) if grad_y is None else grad_y
    for mask in masks:
        got = tk.array_layer_norm_backward(gy, x, w, mean0, rstd0, nd, mask, b, activation)
        exp = ref.array_layer_norm_backward(gy, x, w, mean0, rstd0, nd, mask, b, activation)
        assert_grads(got, exp, mask)


def check_rms_norm(x, w, nd, masks, grad_y=None):
    tk = _tk()
    y, rstd = tk.array_rms_norm(x, w, nd, EPS)
    y0, rstd0 = ref.array_rms_norm(x, w, nd, EPS)
    for got, exp in ((y, y0), (rstd, rstd0)):
        assert_same_layout(got, exp)
        torch.testing.assert_close(got, exp)
    gy = torch.randn(y0.shape) if grad_y is None else grad_y
    for mask in masks:
        got = tk.array_rms_norm_backward(gy, x, w, rstd0, nd, mask)
        exp = ref.array_rms_norm_backward(gy, x, w, rstd0, nd, mask)
        assert_grads(got, exp, mask)


# (B, per-model shape, norm_ndim, layout). In the interpreter a row of up to 16
# elements is one block and a longer one is swept in blocks of 8.
CASES = [
    (3, (5, 7), 1, "contiguous"),  # D = 7: masked columns; M = 5: a partial row tile
    (1, (4, 33), 1, "contiguous"),  # B = 1; D = 33: swept, last block partial
    (3, (4, 3, 5), 2, "batch_major"),  # [N, B, ...] memory, two normalized dims
    (2, (3, 4, 6), 1, "batch_major"),  # the rows need two strides (N and the next dim)
    (2, (5, 20), 1, "strided"),  # swept with column stride 2
    (3, (4, 3, 6), 2, "transposed"),  # the columns need two strides
    (3, (6, 7), 1, "shared"),  # stride 0 on the array dim
    (2, (2, 3, 2, 5), 1, "scrambled"),  # rows need three strides: copied, output copied back
]
CASE_IDS = [f"B{c[0]}-{'x'.join(map(str, c[1]))}-nd{c[2]}-{c[3]}" for c in CASES]


@pytest.mark.interpreter
@pytest.mark.parametrize("B,shape,nd,layout", CASES, ids=CASE_IDS)
def test_layer_norm_layouts(B, shape, nd, layout):
    x = make_x(B, shape, layout)
    w, b = params(B, shape[len(shape) - nd:], True, True)
    check_layer_norm(x, w, b, nd, [[True, True, True]])


@pytest.mark.interpreter
@pytest.mark.parametrize("B,shape,nd,layout", CASES, ids=CASE_IDS)
def test_rms_norm_layouts(B, shape, nd, layout):
    x = make_x(B, shape, layout)
    w, _ = params(B, shape[len(shape) - nd:], True, False)
    check_rms_norm(x, w, nd, [[True, True]])


@pytest.mark.interpreter
@pytest.mark.parametrize("D", [9, 20], ids=["one_block", "swept"])
@pytest.mark.parametrize("weight,bias", [(True, True), (True, False), (False, True), (False, False)])
def test_layer_norm_affine_and_masks(weight, bias, D):
    x = make_x(2, (5, D), "batch_major")
    w, b = params(2, (D,), weight, bias)
    check_layer_norm(x, w, b, 1, ln_masks(weight))


@pytest.mark.interpreter
@pytest.mark.parametrize("activation", ["relu", "gelu"])
@pytest.mark.parametrize("D", [9, 20], ids=["one_block", "swept"])
@pytest.mark.parametrize("weight,bias", [(True, True), (False, True), (True, False)])
def test_layer_norm_fused_activation(weight, bias, D, activation):
    """The activation before the forward's store; z recomputed in both backward paths."""
    x = make_x(3, (5, D), "batch_major")
    w, b = params(3, (D,), weight, bias)
    check_layer_norm(x, w, b, 1, ln_masks(weight), activation=activation)
    xs = make_x(3, (4, 2, D), "shared")
    check_layer_norm(xs, w, b, 1, [[True, weight, True]], activation=activation)


@pytest.mark.interpreter
@pytest.mark.parametrize("D", [9, 20], ids=["one_block", "swept"])
@pytest.mark.parametrize("weight", [True, False])
def test_rms_norm_weight_and_masks(weight, D):
    x = make_x(2, (5, D), "batch_major")
    w, _ = params(2, (D,), weight, False)
    masks = [[True, True], [True, False], [False, True], [False, False]]
    check_rms_norm(x, w, 1, [m for m in masks if weight or not m[1]])


@pytest.mark.interpreter
@pytest.mark.parametrize("D", [7, 20], ids=["one_block", "swept"])
def test_backward_many_chunks_and_tiles(D):
    # With B = 1 and M = 48 every model's rows split into several chunks of
    # several row tiles, so the partial sums are carried across tiles within a
    # chunk and summed across chunks.
    x = make_x(1, (48, D), "contiguous")
    w, b = params(1, (D,), True, True)
    check_layer_norm(x, w, b, 1, [[True, True, True], [False, True, True]])
    check_rms_norm(x, w, 1, [[True, True]])


@pytest.mark.interpreter
def test_expanded_grad_y():
    # out.sum().backward() hands the backward a grad_y with stride 0 everywhere
    x = make_x(3, (4, 2, 9), "batch_major")
    w, b = params(3, (9,), True, True)
    gy = torch.randn(()).expand(x.shape)
    check_layer_norm(x, w, b, 1, [[True, True, True]], grad_y=gy)
    check_rms_norm(x, w, 1, [[True, True]], grad_y=gy)


@pytest.mark.interpreter
def test_size_one_dims():
    # size-1 per-model and normalized dims are dropped from the stride description
    x = make_x(2, (1, 4, 1, 7), "batch_major")
    w, b = params(2, (1, 7), True, True)
    check_layer_norm(x, w, b, 2, [[True, True, True]])
    x = make_x(2, (3, 1), "contiguous")  # D = 1: every row normalizes to zero
    w, b = params(2, (1,), True, True)
    check_layer_norm(x, w, b, 1, [[True, True, True]])


@pytest.mark.interpreter
@pytest.mark.filterwarnings("ignore:var_mean")
def test_empty_input():
    x = torch.randn(2, 0, 5)
    w, b = params(2, (5,), True, True)
    check_layer_norm(x, w, b, 1, [[True, True, True]])
    check_rms_norm(x, w, 1, [[True, True]])


@pytest.mark.interpreter
def test_registered_triton_implementations():
    # what the registry calls for CUDA tensors, called directly on CPU tensors
    ops = Impls("triton", _NORM_OPS)
    B, D = 3, 7
    x = make_x(B, (4, D), "batch_major")
    w, b = params(B, (D,), True, True)
    gy = torch.randn(B, 4, D)
    y, mean, rstd = ops.array_layer_norm(x, w, b, 1, EPS)
    y0, mean0, rstd0 = ref.array_layer_norm(x, w, b, 1, EPS)
    torch.testing.assert_close((y, mean, rstd), (y0, mean0, rstd0))
    assert y.stride() == y0.stride()
    mask = [True, True, False]
    got = ops.array_layer_norm_backward(gy, x, w, mean, rstd, 1, mask)
    assert_grads(got, ref.array_layer_norm_backward(gy, x, w, mean0, rstd0, 1, mask), mask)
    y, rstd = ops.array_rms_norm(x, w, 1, EPS)
    y0, rstd0 = ref.array_rms_norm(x, w, 1, EPS)
    torch.testing.assert_close((y, rstd), (y0, rstd0))
    got = ops.array_rms_norm_backward(gy, x, None, rstd, 1, [True, False])
    assert_grads(got, ref.array_rms_norm_backward(gy, x, None, rstd0, 1, [True, False]), [True, False])


def test_registered_as_explicit_cuda_backend():
    # auto-eligible where bench/results/ shows the kernel faster than the torch path
    for op, impl, auto in [
        ("array_layer_norm", tk_module.array_layer_norm, True),
        ("array_layer_norm_backward", tk_module.array_layer_norm_backward, True),
        ("array_rms_norm", tk_module.array_rms_norm, False),
        ("array_rms_norm_backward", tk_module.array_rms_norm_backward, False),
    ]:
        entry = _backend._registry[op]["triton"]
        assert entry.load() is impl and entry.device_types == ("cuda",) and entry.auto is auto
        # float64 is not served: auto leaves it to the torch path
        assert entry.dtypes == (torch.float32, torch.float16, torch.bfloat16)


@pytest.mark.interpreter
def test_bad_inputs():
    tk = _tk()
    x = torch.randn(2, 3, 5, dtype=torch.float64)
    with pytest.raises(TypeError, match="float32, float16 or bfloat16.*got torch.float64"):
        tk.array_layer_norm(x, None, None, 1, EPS)
    with pytest.raises(TypeError, match="got torch.float64"):
        tk.array_rms_norm_backward(x, x, None, torch.ones(2, 3), 1, [True, False])
    w = torch.randn(2, 5, dtype=torch.float64)
    with pytest.raises(TypeError, match="got torch.float64"):
        tk.array_rms_norm(x.float(), w, 1, EPS)


@pytest.mark.interpreter
def test_cpu_tensors_need_the_interpreter(monkeypatch):
    tk = _tk()
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    with pytest.raises(ValueError, match="expected CUDA tensors.*got x on cpu"):
        tk.array_layer_norm(torch.randn(2, 3, 5), None, None, 1, EPS)


# ---- GPU: the ops with the triton backend against the torch backend ----------

def _run_op(kind, x, w, b, nd, gy, backend, activation="none"):
    leaves = [t.detach().requires_grad_() if t is not None else None for t in (x, w, b)]
    xl, wl, bl = leaves
    with hfkern.use_backend(backend):
        if kind == "layer_norm":
            outs = lnops.array_layer_norm(xl, wl, bl, nd, EPS, activation)
        else:
            outs = lnops.array_rms_norm(xl, wl, nd, EPS)
        inputs = [t for t in leaves if t is not None]
        grads = torch.autograd.grad(outs[0], inputs, gy)
    return [o.detach() for o in outs], list(grads)


GPU_CASES = [
    (8, (16, 64, 768), 1, "contiguous"),
    (4, (16, 32, 8, 8), 3, "batch_major"),  # LayerNorm over (C, H, W) of a conv output
    (6, (64, 33), 1, "shared"),
    (3, (8, 16, 5000), 1, "contiguous"),  # swept in blocks
    (5, (7, 12, 24), 2, "transposed"),
    (1, (128, 1000), 1, "batch_major"),
    (2, (3, 4, 5, 96), 1, "scrambled"),
]


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("kind", ["layer_norm", "rms_norm"])
@pytest.mark.parametrize("B,shape,nd,layout", GPU_CASES)
def test_gpu_matches_torch_backend(B, shape, nd, layout, kind, dtype):
    S = shape[len(shape) - nd:]
    x = make_x(B, shape, layout, dtype=dtype, device=GPU)
    w, b = params(B, S, True, kind == "layer_norm", dtype=dtype, device=GPU)
    gy = torch.randn(x.shape, dtype=dtype, device=GPU)
    outs, grads = _run_op(kind, x, w, b, nd, gy, "triton")
    outs_t, grads_t = _run_op(kind, x, w, b, nd, gy, "torch")
    dbl = [None if t is None else t.double() for t in (x, w, b)]
    outs_64, grads_64 = _run_op(kind, *dbl, nd, gy.double(), "torch")
    for got, exp, r64 in zip(outs + grads, outs_t + grads_t, outs_64 + grads_64):
        assert_as_accurate(got, exp, r64)


@pytest.mark.gpu
@pytest.mark.parametrize("activation", ["relu", "gelu"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("B,shape,nd,layout", [GPU_CASES[0], GPU_CASES[3]], ids=["one_block", "swept"])
def test_gpu_fused_activation_matches_torch_backend(B, shape, nd, layout, dtype, activation):
    S = shape[len(shape) - nd:]
    x = make_x(B, shape, layout, dtype=dtype, device=GPU)
    w, b = params(B, S, True, True, dtype=dtype, device=GPU)
    gy = torch.randn(x.shape, dtype=dtype, device=GPU)
    outs, grads = _run_op("layer_norm", x, w, b, nd, gy, "triton", activation)
    outs_t, grads_t = _run_op("layer_norm", x, w, b, nd, gy, "torch", activation)
    dbl = [None if t is None else t.double() for t in (x, w, b)]
    outs_64, grads_64 = _run_op("layer_norm", *dbl, nd, gy.double(), "torch", activation)
    for got, exp, r64 in zip(outs + grads, outs_t + grads_t, outs_64 + grads_64):
        assert_as_accurate(got, exp, r64)


@pytest.mark.gpu
@pytest.mark.parametrize("weight", [True, False])
def test_gpu_backward_output_masks(weight):
    B, D = 4, 300
    x = make_x(B, (6, 50, D), "batch_major", device=GPU)
    w, _ = params(B, (D,), weight, False, device=GPU)
    gy = torch.randn(x.shape, device=GPU)
    _, mean, rstd = ref.array_layer_norm(x, w, None, 1, EPS)
    for mask in ln_masks(weight):
        with hfkern.use_backend("triton"):
            got = lnops.array_layer_norm_backward(gy, x, w, mean, rstd, 1, mask)
        assert_grads(got, ref.array_layer_norm_backward(gy, x, w, mean, rstd, 1, mask), mask)
    for mask in ([True, True], [True, False], [False, True]):
        if mask[1] and not weight:
            continue
        with hfkern.use_backend("triton"):
            got = lnops.array_rms_norm_backward(gy, x, w, rstd, 1, mask)
        assert_grads(got, ref.array_rms_norm_backward(gy, x, w, rstd, 1, mask), mask)


@pytest.mark.gpu
@pytest.mark.parametrize("D", [512, 6000], ids=["one_block", "swept"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gpu_backward_deterministic(D, dtype):
    B = 4
    x = make_x(B, (64, 40, D), "batch_major", dtype=dtype, device=GPU)
    w, _ = params(B, (D,), True, False, dtype=dtype, device=GPU)
    gy = torch.randn(x.shape, dtype=dtype, device=GPU)
    with hfkern.use_backend("triton"):
        _, mean, rstd = lnops.array_layer_norm(x, w, None, 1, EPS)
        first = lnops.array_layer_norm_backward(gy, x, w, mean, rstd, 1, [True, True, True])
        second = lnops.array_layer_norm_backward(gy, x, w, mean, rstd, 1, [True, True, True])
        _, rstd = lnops.array_rms_norm(x, w, 1, EPS)
        first += lnops.array_rms_norm_backward(gy, x, w, rstd, 1, [True, True])
        second += lnops.array_rms_norm_backward(gy, x, w, rstd, 1, [True, True])
    for a, c in zip(first, second):
        assert torch.equal(a, c)


@pytest.mark.gpu
@pytest.mark.parametrize("layout", ["contiguous", "batch_major", "shared"])
def test_gpu_modules_with_triton_backend(layout):
    B = 3
    x = make_x(B, (8, 10, 48), layout, device=GPU)
    for make in (lambda: hnn.LayerNorm(48, B=B), lambda: hnn.RMSNorm(48, B=B)):
        module = make().to(GPU)
        with torch.no_grad():
            for p in module.parameters():
                p.normal_()
        results = []
        for backend in ("triton", "torch"):
            xl = x.detach().requires_grad_()
            with hfkern.use_backend(backend):
                out = module(xl)
                grads = torch.autograd.grad(out, [xl, *module.parameters()], torch.ones_like(out))
            results.append((out, grads))
        (out, grads), (out_t, grads_t) = results
        torch.testing.assert_close(out, out_t)
        for g, e in zip(grads, grads_t):
            torch.testing.assert_close(g, e, **GRAD_TOL)


@pytest.mark.gpu
@pytest.mark.parametrize("layout", ["contiguous", "batch_major", "shared"])
def test_gpu_opcheck_ops_on_triton(layout):
    B, D = 3, 40
    x = make_x(B, (4, 5, D), layout, device=GPU)
    w, b = params(B, (D,), True, True, device=GPU)
    gy = torch.randn(B, 4, 5, D, device=GPU)
    ops = torch.ops.hfkern
    with hfkern.use_backend("triton"):
        torch.library.opcheck(ops.array_layer_norm, (x, w, b, 1, EPS))
        torch.library.opcheck(ops.array_layer_norm, (x, None, None, 1, EPS))
        torch.library.opcheck(ops.array_rms_norm, (x, w, 1, EPS))
        _, mean, rstd = ref.array_layer_norm(x, w, b, 1, EPS)
        for mask in ([True, True, True], [False, True, False], [True, False, True]):
            torch.library.opcheck(ops.array_layer_norm_backward, (gy, x, w, mean, rstd, 1, mask))
        _, rstd = ref.array_rms_norm(x, w, 1, EPS)
        for mask in ([True, True], [False, True], [True, False]):
            torch.library.opcheck(ops.array_rms_norm_backward, (gy, x, w, rstd, 1, mask))

