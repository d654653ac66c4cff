"""The CUDA array depthwise conv2d (csrc/conv/depthwise_conv.cu) against the torch
implementation and B separate torch depthwise convs.

Emulator tests run the kernel sources built as host C++ (hfkern._C_emu) on CPU tensors
through the same launchers as on a GPU (hfkern.cuda.conv.emulated), with blocks of at
most 16 threads so that the small odd shapes here span several blocks, and the weight
gradient several chunks of rows. References: the torch implementation
(hfkern.ops.conv, the values and the exact strides of its results) and B separate
``F.conv2d(..., groups=C)`` calls in float64 with autograd through them. GPU tests run
the ops with the cuda backend selected against the torch backend (cuDNN).
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import hfkern
from hfkern import _backend
from hfkern._array import array_memory_format
from hfkern.cuda import conv as cc
from hfkern.ops import conv as oc

CL, NCHW = torch.channels_last, torch.contiguous_format
FORMATS = [NCHW, CL]
FORMAT_IDS = ["nchw", "nhwc"]
# error allowed against the float64 reference, relative to the reference's largest magnitude
# (float32 accumulation; the rounding of inputs and output into bfloat16 / float16)
TOL = {torch.float32: 1e-5, torch.bfloat16: 2e-2, torch.float16: 3e-3}

fwd = cc.emulated("array_conv")
dgrad = cc.emulated("array_conv_input_grad")
wgrad = cc.emulated("array_conv_weight_grad")

N, C, H, W = 2, 5, 7, 6
# (kernel, stride, padding, dilation, bias)
CASES = [
    ((3, 3), 1, 1, 1, True),
    ((3, 3), 2, 1, 1, False),
    ((3, 3), 1, 0, 2, True),
    ((5, 5), 1, 2, 1, True),
    ((5, 5), 2, 2, 1, False),
    ((5, 5), 1, 2, 2, False),
    ((2, 3), 1, 0, 1, True),
    ((2, 3), 2, 1, 2, False),
]
CASE_IDS = [f"k{k[0]}x{k[1]}-s{s}-p{p}-d{d}{'-bias' if b else ''}" for k, s, p, d, b in CASES]


# ---- inputs ---------------------------------------------------------------------------

def make_act(B, n, c, h, w, fmt, dtype=torch.float32, device="cpu"):
    """[B, n, c, h, w] in array memory: [n, B, c, h, w], or [n, h, w, B, c] for channels-last."""
    kw = {"dtype": dtype, "device": device}
    if fmt == CL:
        return torch.randn(n, h, w, B, c, **kw).permute(3, 0, 4, 1, 2)
    return torch.randn(n, B, c, h, w, **kw).transpose(0, 1)


def make_shared(n, c, h, w, fmt, dtype=torch.float32, device="cpu"):
    return torch.randn(n, c, h, w, dtype=dtype, device=device).contiguous(memory_format=fmt)


def make_params(B, k, bias, dtype=torch.float32, device="cpu", channels=C):
    w = torch.randn(B, channels, 1, *k, device=device) / k[0]
    b = torch.randn(B, channels, device=device) if bias else None
    return w.to(dtype), None if b is None else b.to(dtype)


def geometry(stride, padding, dilation, groups=C):
    return [stride] * 2, [padding] * 2, [dilation] * 2, False, [0, 0], groups


def out_size(k, stride, padding, dilation, h=H, w=W):
    return [(i + 2 * padding - dilation * (kk - 1) - 1) // stride + 1 for i, kk in zip((h, w), k)]


# ---- the reference: B separate depthwise convs in float64 ---------------------------------

def reference(x, w, b, gy, geom):
    """(y, grad_x, grad_w) in float64 from one F.conv2d(groups=C) per model; for a shared
    input ([N, C, H, W] or a broadcast view) grad_x sums over the models."""
    stride, padding, dilation = geom[:3]
    B, groups = w.shape[0], geom[5]
    shared = x.dim() == 4 or x.stride(0) == 0
    x64 = (x if x.dim() == 4 else x[0] if shared else x).detach().double().requires_grad_()
    w64 = w.detach().double().requires_grad_()
    b64 = None if b is None else b.detach().double()
    ys = [F.conv2d(x64 if shared else x64[i], w64[i], None if b64 is None else b64[i], stride, padding, dilation,
                   groups) for i in range(B)]
    y = torch.stack(ys)
    gx, gw = torch.autograd.grad(y, [x64, w64], gy.double())
    return y.detach(), gx, gw


def assert_near(got, expected64, dtype, what=""):
    assert got.shape == expected64.shape, (what, got.shape, expected64.shape)
    scale = max(1.0, expected64.abs().max().item()) if expected64.numel() else 1.0
    tol = TOL[dtype]
    torch.testing.assert_close(got.double(), expected64, atol=tol * scale, rtol=tol, msg=lambda m: f"{what}: {m}")


def run_all(x, w, b, gy, geom, input_size=None):
    """The three emulated launchers and the torch implementation's results, in pairs."""
    input_size = list(x.shape) if input_size is None else input_size
    ours = (fwd(x, w, b, *geom), dgrad(gy, w, input_size, *geom), wgrad(gy, x, w, *geom))
    theirs = (oc.array_conv_torch(x, w, b, *geom), oc.array_conv_input_grad_torch(gy, w, input_size, *geom),
              oc.array_conv_weight_grad_torch(gy, x, w, *geom))
    return ours, theirs


def check(x, w, b, gy, geom, dtype=torch.float32, input_size=None):
    """Values against the float64 reference (and in float32 the torch implementation),
    strides exactly the torch implementation's."""
    ours, theirs = run_all(x, w, b, gy, geom, input_size)
    refs = reference(x, w, b, gy, geom)
    for name, got, torch_path, ref in zip(("y", "grad_x", "grad_w"), ours, theirs, refs):
        assert got.dtype == dtype, name
        assert got.stride() == torch_path.stride(), (name, got.stride(), torch_path.stride())
        assert_near(got, ref, dtype, name)
        if dtype == torch.float32:
            torch.testing.assert_close(got, torch_path, msg=lambda m, name=name: f"{name}: {m}")
    return ours


# ---- emulator: geometry, memory formats, B ----------------------------------------------

@pytest.mark.emulator
@pytest.mark.parametrize("fmt", FORMATS, ids=FORMAT_IDS)
@pytest.mark.parametrize("B", [1, 3])
@pytest.mark.parametrize("k,stride,padding,dilation,bias", CASES, ids=CASE_IDS)
def test_depthwise_matches_reference(k, stride, padding, dilation, bias, B, fmt):
    geom = geometry(stride, padding, dilation)
    x = make_act(B, N, C, H, W, fmt)
    w, b = make_params(B, k, bias)
    gy = make_act(B, N, C, *out_size(k, stride, padding, dilation), fmt)
    y, gx, gw = check(x, w, b, gy, geom)
    # outputs follow the input's memory format; grad_w is laid out like the weight
    assert array_memory_format(y) == fmt and array_memory_format(gx) == fmt
    assert gw.stride() == w.stride()


@pytest.mark.emulator
@pytest.mark.parametrize("fmt", FORMATS, ids=FORMAT_IDS)
@pytest.mark.parametrize("k,stride,padding,dilation,bias", [CASES[0], CASES[4], CASES[7]],
                         ids=[CASE_IDS[0], CASE_IDS[4], CASE_IDS[7]])
def test_shared_input(k, stride, padding, dilation, bias, fmt):
    """An [N, C, H, W] input shared by the models: its gradient sums over them."""
    B = 3
    geom = geometry(stride, padding, dilation)
    x = make_shared(N, C, H, W, fmt)
    w, b = make_params(B, k, bias)
    gy = make_act(B, N, C, *out_size(k, stride, padding, dilation), fmt)
    y, gx, _ = check(x, w, b, gy, geom)
    assert array_memory_format(y) == fmt
    assert gx.shape == x.shape and gx.is_contiguous(memory_format=fmt)


@pytest.mark.emulator
@pytest.mark.parametrize("fmt", FORMATS, ids=FORMAT_IDS)
def test_broadcast_input(fmt):
    """A [B, N, C, H, W] broadcast view (stride 0 on B) is read in place."""
    B = 3
    geom = geometry(1, 1, 1)
    x = hfkern.broadcast(make_shared(N, C, H, W, fmt), B)
    w, b = make_params(B, (3, 3), True)
    gy = make_act(B, N, C, H, W, fmt)
    ours, theirs = run_all(x, w, b, gy, geom)
    refs = reference(x, w, b, gy, geom)
    assert_near(ours[0], refs[0], torch.float32, "y")
    assert ours[0].stride() == theirs[0].stride()
    # per-model input gradients of the broadcast view: each model's own
    gx_ref = []
    for i in range(B):
        xi = x[i].double().requires_grad_()
        gx_ref.append(torch.autograd.grad(F.conv2d(xi, w[i].double(), None, 1, 1, 1, C), xi, gy[i].double())[0])
    gx_ref = torch.stack(gx_ref)
    assert_near(ours[1], gx_ref, torch.float32, "grad_x")
    torch.testing.assert_close(ours[1], theirs[1])
    assert_near(ours[2], refs[2], torch.float32, "grad_w")


@pytest.mark.emulator
def test_strided_inputs():
    """Slices (every other sample, every other column) and a permuted weight are read
    where they lie; outputs in the torch implementation's layout."""
    B = 3
    k, stride, padding, dilation = (3, 3), 2, 1, 1
    geom = geometry(stride, padding, dilation)
    x = torch.randn(B, 2 * N, C, H, 2 * W)[:, ::2, :, :, ::2]
    w = torch.randn(B, C, 1, k[1], k[0]).transpose(-1, -2)
    b = torch.randn(2 * B, C)[::2]
    OH, OW = out_size(k, stride, padding, dilation)
    gy = torch.randn(N, B, C, OH + 1, OW)[:, :, :, 1:].transpose(0, 1)
    gw = check(x, w, b, gy, geom)[2]
    assert gw.stride() == oc.array_conv_weight_grad_torch(gy, x, w, *geom).stride()


@pytest.mark.emulator
def test_mixed_formats():
    """x in one memory format, grad_out in the other: each output follows its own rule."""
    B = 3
    geom = geometry(1, 1, 1)
    x = make_act(B, N, C, H, W, CL)
    w, b = make_params(B, (3, 3), False)
    gy = make_act(B, N, C, H, W, NCHW)
    y, gx, _ = check(x, w, b, gy, geom)
    assert array_memory_format(y) == CL and array_memory_format(gx) == NCHW


@pytest.mark.emulator
@pytest.mark.parametrize("fmt", FORMATS, ids=FORMAT_IDS)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("k,stride,padding,dilation,bias", [CASES[0], CASES[5], CASES[7]],
                         ids=[CASE_IDS[0], CASE_IDS[5], CASE_IDS[7]])
def test_low_precision(k, stride, padding, dilation, bias, dtype, fmt):
    B = 3
    geom = geometry(stride, padding, dilation)
    x = make_act(B, N, C, H, W, fmt, dtype)
    w, b = make_params(B, k, bias, dtype)
    gy = make_act(B, N, C, *out_size(k, stride, padding, dilation), fmt, dtype)
    check(x, w, b, gy, geom, dtype)


@pytest.mark.emulator
def test_weight_grad_deterministic_and_chunked():
    """Two runs give bitwise equal gradients; a tall input spans many chunks of rows."""
    B = 2
    geom = geometry(1, 1, 1)
    x = make_act(B, 3, C, 19, 4, NCHW)
    w, _ = make_params(B, (3, 3), False)
    gy = make_act(B, 3, C, 19, 4, NCHW)
    a, b = wgrad(gy, x, w, *geom), wgrad(gy, x, w, *geom)
    assert torch.equal(a, b)
    assert_near(a, reference(x, w, None, gy, geom)[2], torch.float32, "grad_w")


@pytest.mark.emulator
@pytest.mark.parametrize("fmt", FORMATS, ids=FORMAT_IDS)
def test_empty_batch(fmt):
    """N = 0: empty activations and a zero weight gradient."""
    B = 3
    geom = geometry(1, 1, 1)
    x = make_act(B, 0, C, H, W, fmt)
    w, b = make_params(B, (3, 3), True)
    gy = make_act(B, 0, C, H, W, fmt)
    y = fwd(x, w, b, *geom)
    assert y.shape == (B, 0, C, H, W)
    assert dgrad(gy, w, list(x.shape), *geom).shape == x.shape
    gw = wgrad(gy, x, w, *geom)
    assert gw.shape == w.shape and torch.equal(gw, torch.zeros_like(w))


# ---- emulator: calls the depthwise kernels do not serve ----------------------------------

def _delegated_cases():
    B = 3
    # (name, x, weight, bias, geometry)
    yield "dense", make_act(B, N, C, H, W, NCHW), torch.randn(B, 4, C, 3, 3), torch.randn(B, 4), geometry(1, 1, 1, 1)
    yield "grouped", make_act(B, N, 4, H, W, CL), torch.randn(B, 6, 2, 3, 3), None, geometry(2, 1, 1, 2)
    yield "multiplier2", make_act(B, N, C, H, W, NCHW), torch.randn(B, 2 * C, 1, 3, 3), None, geometry(1, 1, 1, C)
    yield "transposed", make_act(B, N, C, H, W, NCHW), torch.randn(B, C, 1, 3, 3), torch.randn(B, C), \
        ([2, 2], [1, 1], [1, 1], True, [1, 1], C)
    yield "conv1d", torch.randn(N, B, C, W).transpose(0, 1), torch.randn(B, C, 1, 3), None, \
        ([1], [1], [1], False, [0], C)
    yield "float64", make_act(B, N, C, H, W, NCHW).double(), torch.randn(B, C, 1, 3, 3).double(), None, \
        geometry(1, 1, 1)


@pytest.mark.emulator
@pytest.mark.parametrize("name", [c[0] for c in _delegated_cases()])
def test_other_convs_run_the_torch_implementation(name):
    _, x, w, b, geom = next(c for c in _delegated_cases() if c[0] == name)
    # geometry the kernels do not compute, or (float64) a dtype they do not compute in
    assert x.dtype == torch.float64 or not cc.is_depthwise(x.shape[2], w, geom[3], geom[5], len(geom[0]))
    y = fwd(x, w, b, *geom)
    y_t = oc.array_conv_torch(x, w, b, *geom)
    assert torch.equal(y, y_t) and y.stride() == y_t.stride()
    gy = torch.randn_like(y_t)
    gx, gx_t = dgrad(gy, w, list(x.shape), *geom), oc.array_conv_input_grad_torch(gy, w, list(x.shape), *geom)
    assert torch.equal(gx, gx_t) and gx.stride() == gx_t.stride()
    gw, gw_t = wgrad(gy, x, w, *geom), oc.array_conv_weight_grad_torch(gy, x, w, *geom)
    assert torch.equal(gw, gw_t)


def test_depthwise_predicate():
    w = torch.empty(2, C, 1, 3, 3)
    assert cc.is_depthwise(C, w, False, C, 2)
    assert not cc.is_depthwise(C, w, True, C, 2)  # transposed
    assert not cc.is_depthwise(C + 1, w, False, C, 2)
    assert not cc.is_depthwise(C, torch.empty(2, 2 * C, 1, 3, 3), False, C, 2)  # multiplier 2
    assert not cc.is_depthwise(C, torch.empty(2, C, 1, 3), False, C, 1)  # 1-D


def test_registered_for_cuda_tensors_only_on_request():
    for op in ("array_conv", "array_conv_input_grad", "array_conv_weight_grad"):
        impl = _backend._registry[op]["cuda"]
        assert impl.device_types == ("cuda",) and not impl.auto and impl.dtypes == ()
        assert impl.load() is getattr(cc, op)


# ---- emulator: bad inputs -------------------------------------------------------------------

@pytest.mark.emulator
def test_bad_inputs():
    B = 3
    geom = geometry(1, 1, 1)
    x = make_act(B, N, C, H, W, NCHW)
    w, b = make_params(B, (3, 3), True)
    gy = make_act(B, N, C, H, W, NCHW)
    with pytest.raises(TypeError, match="expected weight of dtype torch.float32"):
        fwd(x, w.to(torch.bfloat16), b, *geom)
    with pytest.raises(TypeError, match="expected bias of dtype"):
        fwd(x, w, b.half(), *geom)
    with pytest.raises(TypeError, match="expected x of dtype torch.bfloat16"):
        wgrad(gy.to(torch.bfloat16), x, w.to(torch.bfloat16), *geom)
    with pytest.raises(ValueError, match=r"expected bias of shape \[3, 5\]"):
        fwd(x, w, b[:, :4], *geom)
    with pytest.raises(ValueError, match="expected x \\[B=2"):
        fwd(x, w[:2], None, *geom)
    with pytest.raises(ValueError, match="does not fit the input"):
        fwd(make_act(B, N, C, 2, 2, NCHW), w, None, *geometry(1, 0, 1))
    with pytest.raises(ValueError, match="expected stride >= 1, padding >= 0"):
        fwd(x, w, None, *geometry(1, -1, 1))
    with pytest.raises(ValueError, match=r"expected grad_out of shape \[3, 2, 5, 7, 6\]"):
        dgrad(gy[..., :5], w, list(x.shape), *geom)
    with pytest.raises(ValueError, match=r"expected grad_out of shape"):
        wgrad(gy[:, :1], x, w, *geom)
    with pytest.raises(ValueError, match="expected input_size \\[B=3"):
        dgrad(gy, w, [2, N, C, H, W], *geom)
    with pytest.raises(ValueError, match="expected tensors on a cpu device"):
        fwd(x.to("meta"), w.to("meta"), None, *geom)
    with pytest.raises(ValueError, match="expected weight on cpu"):
        fwd(x, w.to("meta"), None, *geom)


# ---- GPU: the ops with the cuda backend against the torch backend (cuDNN) ------------------

GPU = "cuda"
# (B, N, C, H, W, kernel, stride, padding, dilation, shared): MobileNetV2's depthwise layers
# at CIFAR sizes, a 5x5, a general size, dilation, a shared input
GPU_CASES = [
    (4, 16, 96, 16, 16, (3, 3), 1, 1, 1, False),
    (4, 16, 144, 16, 16, (3, 3), 2, 1, 1, False),
    (8, 8, 384, 4, 4, (3, 3), 1, 1, 1, False),
    (3, 8, 40, 15, 13, (5, 5), 2, 2, 1, False),
    (2, 4, 24, 17, 19, (7, 7), 1, 3, 1, False),
    (3, 4, 32, 12, 12, (3, 3), 1, 2, 2, False),
    (4, 8, 16, 14, 14, (3, 3), 1, 1, 1, True),
]


def _run_op(x, w, b, gy, geom, backend):
    x = x.detach().requires_grad_()
    w = w.detach().requires_grad_()
    b = None if b is None else b.detach().requires_grad_()
    with hfkern.use_backend(backend):
        y = torch.ops.hfkern.array_conv(x, w, b, *geom)
        grads = torch.autograd.grad(y, [x, w] + ([b] if b is not None else []), gy)
    return [y.detach(), *grads]


def _relative_error(got, ref64):
    return ((got.double() - ref64).abs().max() / ref64.abs().max().clamp_min(1.0)).item()


@pytest.mark.gpu
@pytest.mark.parametrize("fmt", FORMATS, ids=FORMAT_IDS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("case", GPU_CASES)
def test_gpu_matches_torch_backend(case, dtype, fmt):
    B, n, c, h, w_, k, stride, padding, dilation, shared = case
    geom = geometry(stride, padding, dilation, c)
    x = make_shared(n, c, h, w_, fmt, dtype, GPU) if shared else make_act(B, n, c, h, w_, fmt, dtype, GPU)
    w, b = make_params(B, k, True, dtype, GPU, channels=c)
    gy = make_act(B, n, c, *out_size(k, stride, padding, dilation, h, w_), fmt, dtype, GPU)
    ours = _run_op(x, w, b, gy, geom, "cuda")
    theirs = _run_op(x, w, b, gy, geom, "torch")
    ref = _run_op(x.double(), w.double(), b.double(), gy.double(), geom, "torch")
    for name, got, t, r in zip(("y", "grad_x", "grad_w", "grad_b"), ours, theirs, ref):
        assert got.dtype == dtype and got.shape == t.shape and got.stride() == t.stride(), name
        # as accurate as cuDNN (twice its error), or within the dtype's tolerance
        err, err_t = _relative_error(got, r), _relative_error(t, r)
        assert err <= max(2 * err_t, TOL[dtype]), (name, err, err_t)


@pytest.mark.gpu
def test_gpu_deterministic():
    B, n, c = 4, 32, 96
    geom = geometry(1, 1, 1, c)
    x = make_act(B, n, c, 16, 16, NCHW, torch.float32, GPU)
    w, b = make_params(B, (3, 3), True, torch.float32, GPU, channels=c)
    gy = make_act(B, n, c, 16, 16, NCHW, torch.float32, GPU)
    first, second = (_run_op(x, w, b, gy, geom, "cuda") for _ in range(2))
    for a, b_ in zip(first, second):
        assert torch.equal(a, b_)


@pytest.mark.gpu
def test_gpu_other_convs_served_by_cudnn():
    B = 3
    x = make_act(B, 4, 8, 9, 9, CL, torch.float32, GPU)
    w = torch.randn(B, 16, 4, 3, 3, device=GPU)
    gy = make_act(B, 4, 16, 9, 9, CL, torch.float32, GPU)
    geom = geometry(1, 1, 1, 2)
    for got, t in zip(_run_op(x, w, None, gy, geom, "cuda"), _run_op(x, w, None, gy, geom, "torch")):
        torch.testing.assert_close(got, t)
        assert got.stride() == t.stride()
