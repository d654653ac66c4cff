"""The CUDA array layer norm and RMS norm (csrc/norm/layer_norm.cu) against B separate torch norms.

Emulator tests run the kernel sources built as host C++ (hfkern._C_emu) on CPU
tensors through the same launchers as on a GPU (hfkern.cuda.layer_norm.emulated),
with blocks of 16 threads, shuffle groups of 8 and at most two packs a thread
in registers, so that small odd shapes reach every path: several rows per warp,
a block per row with several shuffle groups, rows held in registers and swept,
vector and element access, several backward chunks per model. The reference is
B separate ``F.layer_norm`` / ``F.rms_norm`` calls (one per model) in float64,
followed by ``torch.relu`` / ``F.gelu``, and autograd through them for the
backward; float32 results are also checked against the torch backend. GPU tests
run the ops with the cuda backend selected against the torch backend.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from _norm_cases import EPS, Impls, assert_as_accurate, masks

import hfkern
from hfkern import _backend
from hfkern.cuda import layer_norm as cl
from hfkern.ops import layer_norm as lnops

_NORM_OPS = ("array_layer_norm", "array_layer_norm_backward", "array_rms_norm", "array_rms_norm_backward")
ACTIVATIONS = ("none", "relu", "gelu")
# error allowed against the float64 reference, relative to the reference's largest magnitude
TOL = {torch.float32: 1e-5, torch.bfloat16: 1e-2, torch.float16: 2e-3}

torch_ref = Impls("torch", _NORM_OPS)
emu = {op: cl.emulated(op) for op in _NORM_OPS}


# ---- inputs -----------------------------------------------------------------------

def make_x(B, shape, layout, dtype=torch.float32, device="cpu"):
    """[B, *shape] in the named memory layout (shape[0] is the per-model batch N)."""
    kw = {"dtype": dtype, "device": device}
    if layout == "contiguous":
        return torch.randn(B, *shape, **kw)
    if layout == "batch_major":  # what an array conv produces: [N, B, ...] memory
        return torch.randn(shape[0], B, *shape[1:], **kw).transpose(0, 1)
    if layout == "strided":  # every other element of the last dim
        return torch.randn(B, *shape[:-1], 2 * shape[-1], **kw)[..., ::2]
    if layout == "transposed":  # dense, last two dims swapped in memory: two strided column dims
        return torch.randn(B, *shape[:-2], shape[-1], shape[-2], **kw).transpose(-1, -2)
    if layout == "shared":  # one input for every model: stride 0 on B
        return hfkern.broadcast(torch.randn(*shape, **kw), B)
    if layout == "scrambled":  # three per-model dims no two of which merge: copied
        a, b, c, d = shape
        return torch.randn(b, B, a, c, d, **kw).permute(1, 2, 0, 3, 4)
    raise ValueError(layout)


def params(B, S, weight=True, bias=True, dtype=torch.float32, device="cpu"):
    w = (1 + 0.5 * torch.randn(B, *S)).to(dtype=dtype, device=device) if weight else None
    b = torch.randn(B, *S).to(dtype=dtype, device=device) if bias else None
    return w, b


def _act(z, activation):
    return {"none": lambda t: t, "relu": torch.relu, "gelu": F.gelu}[activation](z)


# ---- the reference: B separate norms in float64 ----------------------------------------

def reference(kind, x, w, b, nd, activation, gy):
    """(y, mean, rstd, grad_x, grad_w, grad_b) in float64 from one F.layer_norm / F.rms_norm
    per model (mean and grad_b None for RMS norm, grad_w None without a weight)."""
    B = x.shape[0]
    S = tuple(x.shape[x.dim() - nd:])
    dims = list(range(x.dim() - 1 - nd, x.dim() - 1))
    out = {k: [] for k in ("y", "mean", "rstd", "gx", "gw", "gb")}
    for i in range(B):
        xi = x[i].double().requires_grad_()
        wi = None if w is None else w[i].double().requires_grad_()
        if kind == "layer_norm":
            # a zero bias without one: its gradient is the sum of g, which the op gives either way
            bi = (torch.zeros(S, dtype=torch.float64) if b is None else b[i].double()).requires_grad_()
            var, mean = torch.var_mean(xi.detach(), dim=dims, correction=0)
            z = F.layer_norm(xi, S, wi, bi, EPS)
            out["mean"].append(mean.reshape(-1))
        else:
            bi = None
            var = xi.detach().square().mean(dim=dims)
            z = F.rms_norm(xi, S, wi, EPS)
        yi = _act(z, activation)
        leaves = [t for t in (xi, wi, bi) if t is not None]
        grads = list(torch.autograd.grad(yi, leaves, gy[i].double()))
        out["y"].append(yi.detach())
        out["rstd"].append((var + EPS).rsqrt().reshape(-1))
        out["gx"].append(grads.pop(0))
        out["gw"].append(grads.pop(0) if wi is not None else None)
        out["gb"].append(grads.pop(0) if bi is not None else None)
    return [torch.stack(v) if v and v[0] is not None else None for v in out.values()]


def assert_near(got, expected64, dtype, loosen=1.0):
    assert got.shape == expected64.shape, (got.shape, expected64.shape)
    scale = max(1.0, expected64.abs().max().item()) if expected64.numel() else 1.0
    tol = TOL[dtype] * loosen
    torch.testing.assert_close(got.double().cpu(), expected64, atol=tol * scale, rtol=tol)


def check(kind, x, w, b, nd, activation="none", mask_list=None, grad_y=None, fwd_bwd=None, loosen=1.0):
    """The launchers' forward and backward (each mask) against the float64 reference, and
    (float32) against the torch backend."""
    rms = kind == "rms_norm"
    forward, backward = fwd_bwd or ((emu["array_rms_norm"], emu["array_rms_norm_backward"]) if rms else
                                    (emu["array_layer_norm"], emu["array_layer_norm_backward"]))
    gy = torch.randn(x.shape, device=x.device).to(x.dtype) if grad_y is None else grad_y
    if rms:
        y, rstd = forward(x, w, nd, EPS)
        mean = None
    else:
        y, mean, rstd = forward(x, w, b, nd, EPS, activation)
    y64, mean64, rstd64, gx64, gw64, gb64 = reference(kind, x.cpu(), None if w is None else w.cpu(),
                                                      None if b is None else b.cpu(), nd, activation, gy.cpu())
    assert y.dtype == x.dtype and y.stride() == torch.empty_like(x).stride()
    assert rstd.dtype == torch.float32 and rstd.is_contiguous() and rstd.shape == rstd64.shape
    assert_near(y, y64, x.dtype, loosen)
    assert_near(rstd, rstd64, torch.float32, loosen)
    if not rms:
        assert mean.dtype == torch.float32 and mean.is_contiguous()
        assert_near(mean, mean64, torch.float32, loosen)
    exact = x.dtype == torch.float32 and x.device.type == "cpu"
    if exact:
        if rms:
            y0, rstd0 = torch_ref.array_rms_norm(x, w, nd, EPS)
        else:
            y0, mean0, rstd0 = torch_ref.array_layer_norm(x, w, b, nd, EPS, activation)
            torch.testing.assert_close(mean, mean0)
        torch.testing.assert_close(y, y0)
        torch.testing.assert_close(rstd, rstd0)

    n_out = 2 if rms else 3
    for mask in (mask_list or [[True, w is not None, True]]):
        mask = list(mask)[:n_out]
        if rms:
            got = backward(gy, x, w, rstd, nd, mask)
        else:
            got = backward(gy, x, w, mean, rstd, nd, mask, b, activation)
        assert len(got) == n_out
        param_dtype = x.dtype if w is None else w.dtype
        for i, (g, e, wanted) in enumerate(zip(got, (gx64, gw64, gb64), mask)):
            if not wanted:
                assert g.shape == (0,)
                continue
            assert g.dtype == (x.dtype if i == 0 else param_dtype)
            if i == 0:
                assert g.stride() == torch.empty_like(x).stride()
            else:
                assert g.is_contiguous()
            assert_near(g, e, x.dtype, loosen)
        if exact:
            if rms:
                exp = torch_ref.array_rms_norm_backward(gy, x, w, rstd, nd, mask)
            else:
                exp = torch_ref.array_layer_norm_backward(gy, x, w, mean, rstd, nd, mask, b, activation)
            for g, e, wanted in zip(got, exp, mask):
                if wanted:
                    torch.testing.assert_close(g, e, atol=1e-5, rtol=1e-5)
    return y


# ---- emulator ------------------------------------------------------------------------

# (B, per-model shape, norm_ndim, layout): D = 7 and 33 run several rows per warp, 100
# a block per row in registers, 300 a swept block per row; 100 and 300 (float32) are
# read a pack at a time, the others element by element.
LAYOUT_CASES = [
    (3, (5, 7), 1, "contiguous"),
    (1, (4, 33), 1, "contiguous"),
    (3, (5, 100), 1, "contiguous"),
    (2, (3, 300), 1, "contiguous"),
    (1, (2, 3, 300), 1, "contiguous"),
    (3, (4, 3, 11), 2, "batch_major"),
    (3, (5, 100), 1, "batch_major"),
    (3, (5, 33), 1, "strided"),
    (2, (5, 4, 9), 2, "transposed"),
    (3, (6, 20), 1, "shared"),
    (2, (3, 4, 5, 12), 1, "scrambled"),
]
LAYOUT_IDS = [f"B{c[0]}-{'x'.join(map(str, c[1]))}-nd{c[2]}-{c[3]}" for c in LAYOUT_CASES]


@pytest.mark.emulator
@pytest.mark.parametrize("kind", ["layer_norm", "rms_norm"])
@pytest.mark.parametrize("B,shape,nd,layout", LAYOUT_CASES, ids=LAYOUT_IDS)
def test_emulated_layouts(B, shape, nd, layout, kind):
    x = make_x(B, shape, layout)
    w, b = params(B, shape[len(shape) - nd:], bias=kind == "layer_norm")
    check(kind, x, w, b, nd)


@pytest.mark.emulator
@pytest.mark.parametrize("activation", ACTIVATIONS)
@pytest.mark.parametrize("weight,bias", [(True, True), (True, False), (False, True), (False, False)],
                         ids=["affine", "weight", "bias", "plain"])
@pytest.mark.parametrize("D", [33, 300])
def test_emulated_layer_norm_masks_and_activations(D, weight, bias, activation):
    x = make_x(3, (5, D), "contiguous")
    w, b = params(3, (D,), weight, bias)
    check("layer_norm", x, w, b, 1, activation, mask_list=masks(weight))


@pytest.mark.emulator
@pytest.mark.parametrize("weight", [True, False])
@pytest.mark.parametrize("D", [7, 100, 300])
def test_emulated_rms_norm_masks(D, weight):
    x = make_x(3, (5, D), "contiguous")
    w, _ = params(3, (D,), weight, False)
    check("rms_norm", x, w, None, 1, mask_list=[m[:2] for m in masks(weight) if not m[2]])


@pytest.mark.emulator
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("kind,activation", [("layer_norm", "none"), ("layer_norm", "gelu"),
                                             ("rms_norm", "none")])
@pytest.mark.parametrize("D", [33, 64, 65, 200, 300])
def test_emulated_low_precision(D, kind, activation, dtype):
    # 64: 16-bit packs of 8 read as vectors; 65 and 200: past one warp's packs, within a
    # block's (the emulator's cap of two packs a thread exceeded the backward's one)
    x = make_x(3, (5, D), "contiguous", dtype=dtype)
    w, b = params(3, (D,), bias=kind == "layer_norm", dtype=dtype)
    check(kind, x, w, b, 1, activation)


@pytest.mark.emulator
def test_emulated_mixed_dtypes():
    # bfloat16 x with float32 parameters and a float32 grad_y; float32 x with bfloat16 parameters
    x = make_x(3, (4, 64), "contiguous", dtype=torch.bfloat16)
    w, b = params(3, (64,))
    check("layer_norm", x, w, b, 1, "relu", grad_y=torch.randn(x.shape))
    x = make_x(2, (4, 40), "contiguous")
    w, b = params(2, (40,), dtype=torch.bfloat16)
    check("layer_norm", x, w, b, 1, loosen=1e3)  # float32 rounded into bfloat16 gradients
    # a float16 grad_y for bfloat16 x: read as float32
    x = make_x(2, (3, 20), "contiguous", dtype=torch.bfloat16)
    check("rms_norm", x, None, None, 1, grad_y=torch.randn(x.shape).half())


@pytest.mark.emulator
@pytest.mark.parametrize("D", [20, 300])
def test_emulated_expanded_grad_y(D):
    x = make_x(3, (4, D), "batch_major")
    w, b = params(3, (D,))
    gy = torch.randn(()).expand(x.shape)  # the gradient of a sum: stride 0 everywhere
    check("layer_norm", x, w, b, 1, "gelu", grad_y=gy)
    check("rms_norm", x, w, None, 1, grad_y=gy)


@pytest.mark.emulator
@pytest.mark.parametrize("D", [12, 100, 300])
def test_emulated_many_chunks(D):
    # 40 rows per model: several row slots per block and several chunks per model
    x = make_x(1, (8, 5, D), "contiguous")
    w, b = params(1, (D,))
    check("layer_norm", x, w, b, 1, mask_list=[[False, True, True], [True, True, False]])


@pytest.mark.emulator
def test_emulated_deterministic():
    x = make_x(2, (9, 300), "batch_major")
    w, b = params(2, (300,))
    gy = torch.randn(x.shape)
    runs = []
    for _ in range(2):
        y, mean, rstd = emu["array_layer_norm"](x, w, b, 1, EPS, "relu")
        grads = emu["array_layer_norm_backward"](gy, x, w, mean, rstd, 1, [True, True, True], b, "relu")
        runs.append((y, mean, rstd, *grads))
    for a, c in zip(*runs):
        assert torch.equal(a, c)


@pytest.mark.emulator
def test_emulated_empty_and_size_one():
    x = torch.randn(2, 0, 5)
    w, b = params(2, (5,))
    y, mean, rstd = emu["array_layer_norm"](x, w, b, 1, EPS)
    assert y.shape == x.shape and mean.shape == rstd.shape == (2, 0)
    gx, gw, gb = emu["array_layer_norm_backward"](x, x, w, mean, rstd, 1, [True, True, True])
    assert gx.shape == x.shape and torch.equal(gw, torch.zeros(2, 5)) and torch.equal(gb, torch.zeros(2, 5))
    # D = 1 and size-one batch dims
    x = make_x(3, (1, 4, 1), "contiguous")
    w, b = params(3, (1,))
    check("layer_norm", x, w, b, 1)


@pytest.mark.emulator
def test_emulated_bad_inputs():
    x = torch.randn(2, 3, 5)
    ln, ln_bwd = emu["array_layer_norm"], emu["array_layer_norm_backward"]
    rms_bwd = emu["array_rms_norm_backward"]
    stats = torch.ones(2, 3)
    with pytest.raises(TypeError, match="float32, float16 or bfloat16, got torch.float64"):
        ln(x.double(), None, None, 1, EPS)
    with pytest.raises(TypeError, match="weight of dtype float32, float16 or bfloat16, got torch.float64"):
        emu["array_rms_norm"](x, torch.ones(2, 5, dtype=torch.float64), 1, EPS)
    with pytest.raises(TypeError, match="got torch.float64"):
        rms_bwd(x.double(), x.double(), None, stats, 1, [True, False])
    with pytest.raises(ValueError, match=r"activation in \['none', 'relu', 'gelu'\], got 'tanh'"):
        ln(x, None, None, 1, EPS, "tanh")
    with pytest.raises(ValueError, match="expected x on a cpu device"):
        ln(torch.randn(2, 3, 5, device="meta"), None, None, 1, EPS)
    with pytest.raises(ValueError, match=r"expected grad_y of x's shape \[2, 3, 5\]"):
        ln_bwd(torch.randn(2, 3, 4), x, None, stats, stats, 1, [True, False, False])
    with pytest.raises(ValueError, match="expected rstd of 6 values"):
        rms_bwd(x, x, None, torch.ones(2, 4), 1, [True, False])
    with pytest.raises(ValueError, match="asks for grad_weight but weight is None"):
        ln_bwd(x, x, None, stats, stats, 1, [True, True, False])
    with pytest.raises(ValueError, match="output_mask of length 2"):
        rms_bwd(x, x, None, stats, 1, [True, False, False])
    with pytest.raises(ValueError, match="implements"):
        cl.emulated("array_batch_norm")
    # the kernels' own checks, behind the launcher's
    ext = cl._Launcher(emulate=True).ext(torch.device("cpu"))
    t = (x.data_ptr(), 0, 15, 0, 5, 0, 1)
    none = (0, 0, 0, 0)
    out = torch.empty(2, 3)
    args = {"x": t, "y": t, "weight": none, "bias": none, "shape": (2, 3, 3, 5, 5), "eps": EPS, "rms": False,
            "activation": 0, "mean": out.data_ptr(), "rstd": out.data_ptr(), "stream": 0}
    with pytest.raises(ValueError, match="powers of two"):
        ext.layer_norm_forward(config=(3, 1, 1, 1, 0, 0), **args)
    with pytest.raises(ValueError, match="rows >= 1 \\(1 when row_threads > lanes\\)"):
        ext.layer_norm_forward(config=(16, 8, 2, 1, 0, 0), **args)
    with pytest.raises(ValueError, match="packs per thread in registers"):
        ext.layer_norm_forward(config=(1, 1, 1, 1, 0, 0), **{**args, "shape": (2, 3, 3, 500, 500)})
    with pytest.raises(ValueError, match="x is not pack-aligned"):
        ext.layer_norm_forward(config=(2, 2, 8, 1, 1, 0), **args)
    with pytest.raises(ValueError, match="unknown activation code 7"):
        ext.layer_norm_forward(config=(2, 2, 8, 1, 0, 0), **{**args, "activation": 7})
    with pytest.raises(ValueError, match="RMS norm has no fused activation"):
        ext.layer_norm_forward(config=(2, 2, 8, 1, 0, 0), **{**args, "activation": 1, "rms": True})
    with pytest.raises(ValueError, match="dtype code 3"):
        ext.layer_norm_forward(config=(2, 2, 8, 1, 0, 0), **{**args, "x": (t[0], 3, *t[2:]), "y": (t[0], 3, *t[2:])})
    with pytest.raises(ValueError, match="covering M = 3"):
        ext.layer_norm_backward(t, t, t, none, none, (2, 3, 3, 5, 5), (2, 2, 8, 1, 0, 0), 8, 2, out.data_ptr(),
                                out.data_ptr(), False, 0, 0, 0, 0)


def test_registered_as_explicit_cuda_backend():
    for op in _NORM_OPS:
        entry = _backend._registry[op]["cuda"]
        # not auto-eligible until a GPU result of a training step shows it faster
        assert entry.load() is getattr(cl, op) and entry.device_types == ("cuda",) and entry.auto is False
        assert entry.dtypes == (torch.float32, torch.float16, torch.bfloat16)


# ---- GPU: the cuda backend against the torch backend -----------------------------------

GPU = "cuda"

GPU_CASES = [
    (8, (16, 64, 768), 1, "contiguous"),  # BERT's hidden size: a block per row, in registers
    (4, (16, 32, 8, 8), 3, "batch_major"),  # LayerNorm over (C, H, W) of a conv output
    (6, (64, 33), 1, "shared"),
    (6, (64, 200), 1, "contiguous"),  # a warp per row
    (3, (8, 16, 20000), 1, "contiguous"),  # swept
    (5, (7, 12, 24), 2, "transposed"),
    (1, (128, 1000), 1, "batch_major"),
    (2, (3, 4, 5, 96), 1, "scrambled"),
]


def _run_op(kind, x, w, b, nd, gy, backend, activation="none"):
    leaves = [t.detach().requires_grad_() if t is not None else None for t in (x, w, b)]
    xl, wl, bl = leaves
    with hfkern.use_backend(backend):
        if kind == "layer_norm":
            outs = lnops.array_layer_norm(xl, wl, bl, nd, EPS, activation)
        else:
            outs = lnops.array_rms_norm(xl, wl, nd, EPS)
        grads = torch.autograd.grad(outs[0], [t for t in leaves if t is not None], gy)
    return [o.detach() for o in outs], list(grads)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("kind,activation", [("layer_norm", "none"), ("layer_norm", "gelu"), ("rms_norm", "none")])
@pytest.mark.parametrize("B,shape,nd,layout", GPU_CASES)
def test_gpu_matches_torch_backend(B, shape, nd, layout, kind, activation, dtype):
    S = shape[len(shape) - nd:]
    x = make_x(B, shape, layout, dtype=dtype, device=GPU)
    w, b = params(B, S, True, kind == "layer_norm", dtype=dtype, device=GPU)
    gy = torch.randn(x.shape, dtype=dtype, device=GPU)
    outs, grads = _run_op(kind, x, w, b, nd, gy, "cuda", activation)
    outs_t, grads_t = _run_op(kind, x, w, b, nd, gy, "torch", activation)
    dbl = [None if t is None else t.double() for t in (x, w, b)]
    outs_64, grads_64 = _run_op(kind, *dbl, nd, gy.double(), "torch", activation)
    for got, exp, r64 in zip(outs + grads, outs_t + grads_t, outs_64 + grads_64):
        assert_as_accurate(got, exp, r64)


@pytest.mark.gpu
@pytest.mark.parametrize("D", [7, 100, 768, 3000, 20000])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gpu_launchers_masks(D, dtype):
    x = make_x(3, (37, D), "contiguous", dtype=dtype, device=GPU)
    w, b = params(3, (D,), dtype=dtype, device=GPU)
    fwd_bwd = (cl.array_layer_norm, cl.array_layer_norm_backward)
    check("layer_norm", x, w, b, 1, "relu", mask_list=masks(True), fwd_bwd=fwd_bwd, loosen=4.0)
    check("rms_norm", x, w, None, 1, mask_list=[[True, True], [False, True]],
          fwd_bwd=(cl.array_rms_norm, cl.array_rms_norm_backward), loosen=4.0)


@pytest.mark.gpu
@pytest.mark.parametrize("D", [256, 4096])
def test_gpu_deterministic(D):
    x = make_x(4, (512, D), "contiguous", dtype=torch.bfloat16, device=GPU)
    w, b = params(4, (D,), dtype=torch.bfloat16, device=GPU)
    gy = torch.randn(x.shape, dtype=torch.bfloat16, device=GPU)
    runs = []
    for _ in range(2):
        y, mean, rstd = cl.array_layer_norm(x, w, b, 1, EPS)
        runs.append((y, mean, rstd, *cl.array_layer_norm_backward(gy, x, w, mean, rstd, 1, [True, True, True])))
    for a, c in zip(*runs):
        assert torch.equal(a, c)
