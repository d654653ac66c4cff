"""Triton array convolution against the torch implementation.

Interpreter tests call the launchers on CPU tensors (TRITON_INTERPRET=1);
GPU tests go through the hfkern ops with the triton backend selected.
"""

from types import SimpleNamespace

import pytest
import torch

import hfkern
import hfkern.nn as hnn
from hfkern import _backend

triton = pytest.importorskip("triton")
from hfkern.triton import conv as tc  # noqa: E402

_OPS = ("array_conv", "array_conv_input_grad", "array_conv_weight_grad")
# the torch implementations, as registered: the oracle
ref = SimpleNamespace(**{op: _backend._registry[op]["torch"].load() for op in _OPS})

B = 3


def _layout(t, layout):
    """t [B, N, ...] as [N, B, ...] memory (a conv output), contiguous, or strided."""
    if layout == "batch_major":
        return t.transpose(0, 1).contiguous().transpose(0, 1)
    if layout == "strided":
        return torch.cat([t, t], dim=-1)[..., ::2]
    return t.contiguous()


def _case(nd, transposed, groups, shared, layout, *, n=2, ci=4, co=6, sp=(6, 5), k=(3, 2),
          stride=(2, 1), padding=(1, 0), dilation=(1, 2), output_padding=(1, 0), bias=True,
          dtype=torch.float32, device="cpu", models=B):
    sp, k = sp[-nd:], k[-nd:]
    stride, padding, dilation = list(stride[-nd:]), list(padding[-nd:]), list(dilation[-nd:])
    output_padding = list(output_padding[-nd:]) if transposed else [0] * nd
    kw = dict(dtype=dtype, device=device)
    x = torch.randn(n, ci, *sp, **kw) if shared else _layout(torch.randn(models, n, ci, *sp, **kw), layout)
    w = (torch.randn(models, ci, co // groups, *k, **kw) if transposed
         else torch.randn(models, co, ci // groups, *k, **kw))
    b = torch.randn(models, co, **kw) if bias else None
    return x, w, b, (stride, padding, dilation, transposed, output_padding, groups)


CASES = [
    # nd, transposed, groups, shared, layout
    (2, False, 1, False, "batch_major"),
    (2, False, 1, False, "contiguous"),
    (2, False, 2, False, "strided"),
    (2, False, 1, True, None),
    (2, False, 2, True, None),
    (2, True, 1, False, "batch_major"),
    (2, True, 2, False, "contiguous"),
    (2, True, 1, True, None),
    (1, False, 1, False, "batch_major"),
    (1, False, 2, True, None),
    (1, True, 1, False, "strided"),
    (1, True, 2, True, None),
]


@pytest.fixture
def ieee_fp32():
    flag = torch.backends.cudnn.allow_tf32
    torch.backends.cudnn.allow_tf32 = False
    yield
    torch.backends.cudnn.allow_tf32 = flag


def _check_all(x, w, b, conv, tol):
    y = tc.array_conv(x, w, b, *conv)
    y_ref = ref.array_conv(x, w, b, *conv)
    assert y.shape == y_ref.shape and y.stride() == y_ref.stride()
    torch.testing.assert_close(y, y_ref, **tol)
    gy = torch.randn_like(y_ref)
    gx = tc.array_conv_input_grad(gy, w, list(x.shape), *conv)
    gx_ref = ref.array_conv_input_grad(gy, w, list(x.shape), *conv)
    assert gx.shape == gx_ref.shape and gx.stride() == gx_ref.stride()
    torch.testing.assert_close(gx, gx_ref, **tol)
    gw = tc.array_conv_weight_grad(gy, x, w, *conv)
    torch.testing.assert_close(gw, ref.array_conv_weight_grad(gy, x, w, *conv), **tol)
    assert gw.is_contiguous() and gw.dtype == w.dtype


@pytest.mark.interpreter
@pytest.mark.parametrize("nd,transposed,groups,shared,layout", CASES)
def test_interpreter_matches_torch(nd, transposed, groups, shared, layout, ieee_fp32):
    _check_all(*_case(nd, transposed, groups, shared, layout), dict(atol=1e-4, rtol=1e-4))


@pytest.mark.interpreter
@pytest.mark.parametrize("opts", [
    dict(models=1),
    dict(bias=False, n=1),
    dict(stride=(1, 3), padding=(2, 2), dilation=(2, 1), k=(2, 3), sp=(5, 7)),
    dict(ci=3, co=5, k=(1, 1), stride=(1, 1), padding=(0, 0), dilation=(1, 1)),
    dict(sp=(1, 1), k=(1, 1), padding=(0, 0), stride=(1, 1), dilation=(1, 1)),
])
@pytest.mark.parametrize("transposed", [False, True])
def test_interpreter_options(opts, transposed, ieee_fp32):
    if transposed and opts.get("stride", (2, 1)) == (1, 3):
        opts = dict(opts, output_padding=(0, 2))
    if transposed and opts.get("stride") == (1, 1):
        opts = dict(opts, output_padding=(0, 0))
    _check_all(*_case(2, transposed, 1, False, "batch_major", **opts), dict(atol=1e-4, rtol=1e-4))


@pytest.mark.interpreter
def test_interpreter_depthwise_and_wgrad_splits(ieee_fp32):
    # depthwise (groups == channels) with a reduction long enough to be split
    x, w, b, conv = _case(2, False, 6, False, "batch_major", ci=6, co=6, n=3, sp=(9, 8),
                          k=(3, 3), stride=(1, 1), padding=(1, 1), dilation=(1, 1))
    _check_all(x, w, b, conv, dict(atol=1e-4, rtol=1e-4))


# ---- GPU ---------------------------------------------------------------------

GPU_MODULES = [
    lambda dt: hnn.Conv2d(16, 32, 3, padding=1, B=B, device="cuda", dtype=dt),
    lambda dt: hnn.Conv2d(32, 32, 3, stride=2, padding=1, groups=32, B=B, device="cuda", dtype=dt),
    lambda dt: hnn.Conv2d(16, 24, 1, B=B, device="cuda", dtype=dt),
    lambda dt: hnn.Conv2d(16, 16, 4, padding="same", padding_mode="reflect", dilation=2, B=B,
                          device="cuda", dtype=dt),
    lambda dt: hnn.Conv1d(16, 24, 5, stride=2, padding=2, B=B, device="cuda", dtype=dt),
    lambda dt: hnn.ConvTranspose2d(32, 16, 4, stride=2, padding=1, B=B, device="cuda", dtype=dt),
    lambda dt: hnn.ConvTranspose1d(16, 8, 3, stride=2, output_padding=1, groups=2, B=B,
                                   device="cuda", dtype=dt),
]


def _fwd_bwd(module, x, backend):
    with hfkern.use_backend(backend):
        xx = x.detach().requires_grad_(not hfkern.is_shared(x))
        y = module(xx)
        grads = torch.autograd.grad(y, ([xx] if xx.requires_grad else []) + list(module.parameters()),
                                    torch.ones_like(y))
    return [y.float()] + [g.float() for g in grads]


@pytest.mark.gpu
@pytest.mark.parametrize("i", range(len(GPU_MODULES)))
@pytest.mark.parametrize("shared", [False, True])
def test_gpu_fp32_matches_torch(i, shared, ieee_fp32):
    module = GPU_MODULES[i](torch.float32)
    c_in = module.in_channels
    spatial = (17,) if module._n == 1 else (17, 15)
    base = torch.randn(8, c_in, *spatial, device="cuda")
    x = hfkern.broadcast(base, B) if shared else torch.randn(B, 8, c_in, *spatial, device="cuda")
    for got, want in zip(_fwd_bwd(module, x, "triton"), _fwd_bwd(module, x, "torch")):
        torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)


def _tf32_truncated(t):
    """float32 ``t`` with the 13 low mantissa bits cleared: the operand a TF32
    matrix unit sees when it truncates (rounding to nearest is never further)."""
    return (t.contiguous().view(torch.int32) & ~0x1FFF).view(torch.float32)


@pytest.mark.gpu
@pytest.mark.parametrize("i", range(len(GPU_MODULES)))
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_gpu_low_precision_error_bounded_by_torch(i, dtype, monkeypatch):
    """Flash-attention rule: the Triton path's error against an fp64 reference is
    at most twice the torch path's own error at the same operand precision.

    For bf16/fp16 the torch path runs in the same dtype. For fp32 the Triton
    kernels use TF32 here (cudnn.allow_tf32 is on, torch's default), while cuDNN
    may or may not for a given grouped conv; its yardstick is the torch path in
    IEEE fp32 on TF32-truncated input and weights, the error TF32 operands carry.
    """
    monkeypatch.setattr(torch.backends.cudnn, "allow_tf32", True)
    module = GPU_MODULES[i](dtype)
    ref_module = GPU_MODULES[i](torch.float64)
    ref_module.load_state_dict(module.state_dict())
    spatial = (17,) if module._n == 1 else (17, 15)
    x = torch.randn(B, 8, module.in_channels, *spatial, device="cuda")
    ref = _fwd_bwd(ref_module, x.double(), "torch")
    tri = _fwd_bwd(module, x.to(dtype), "triton")
    if dtype == torch.float32:
        yardstick = GPU_MODULES[i](dtype)
        yardstick.load_state_dict({k: _tf32_truncated(v) if k == "weight" else v
                                   for k, v in module.state_dict().items()})
        with monkeypatch.context() as m:
            m.setattr(torch.backends.cudnn, "allow_tf32", False)
            tor = _fwd_bwd(yardstick, _tf32_truncated(x), "torch")
    else:
        tor = _fwd_bwd(module, x.to(dtype), "torch")
    for t, c, r in zip(tri, tor, ref):
        err_t = (t.double() - r).abs().max().item()
        err_c = (c.double() - r).abs().max().item()
        assert err_t <= 2 * err_c + 1e-5 * r.abs().max().item(), (err_t, err_c)


@pytest.mark.gpu
def test_gpu_weight_grad_is_deterministic():
    module = hnn.Conv2d(64, 64, 3, padding=1, B=4, device="cuda")
    x = torch.randn(4, 64, 64, 32, 32, device="cuda")
    runs = [_fwd_bwd(module, x, "triton")[2] for _ in range(2)]
    assert torch.equal(runs[0], runs[1])


@pytest.mark.gpu
@pytest.mark.parametrize("transposed", [False, True])
@pytest.mark.parametrize("shared", [False, True])
def test_gpu_opcheck_ops_on_triton(transposed, shared):
    x, w, b, conv = _case(2, transposed, 1, shared, "batch_major", device="cuda")
    ops = torch.ops.hfkern
    with hfkern.use_backend("triton"):
        torch.library.opcheck(ops.array_conv, (x, w, b, *conv))
        gy = torch.randn_like(ops.array_conv(x, w, b, *conv))
        torch.library.opcheck(ops.array_conv_input_grad, (gy, w, list(x.shape), *conv))
        torch.library.opcheck(ops.array_conv_weight_grad, (gy, x, w, *conv))


def test_registered_as_explicit_cuda_backend():
    # auto=False until a GPU benchmark shows the kernels faster than the torch path
    for op in _OPS:
        entry = _backend._registry[op]["triton"]
        assert entry.load() is getattr(tc, op)
        assert entry.device_types == ("cuda",) and entry.auto is False and entry.dtypes == ()


def _assert_like_fake(op, args, real):
    """``real`` (a launcher's output) has the shape, strides and dtype the op's fake promises."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode(allow_non_fake_inputs=True):
        fake = getattr(torch.ops.hfkern, op)(*args)
    assert (real.shape, real.stride(), real.dtype) == (fake.shape, fake.stride(), fake.dtype)


@pytest.mark.interpreter
@pytest.mark.parametrize("transposed", [False, True])
@pytest.mark.parametrize("shared", [False, True])
def test_interpreter_outputs_match_the_ops_fakes(transposed, shared):
    # The AOT checks of the ops on this backend run only on a GPU
    # (test_gpu_opcheck_ops_on_triton); CPU tensors always take the torch path.
    x, w, b, conv = _case(2, transposed, 1, shared, "batch_major")
    y = tc.array_conv(x, w, b, *conv)
    _assert_like_fake("array_conv", (x, w, b, *conv), y)
    gy = torch.randn_like(y)
    dgrad_args = (gy, w, list(x.shape), *conv)
    _assert_like_fake("array_conv_input_grad", dgrad_args, tc.array_conv_input_grad(*dgrad_args))
    wgrad_args = (gy, x, w, *conv)
    _assert_like_fake("array_conv_weight_grad", wgrad_args, tc.array_conv_weight_grad(*wgrad_args))


@pytest.mark.interpreter
@pytest.mark.parametrize("transposed", [False, True])
def test_interpreter_empty_batch(transposed):
    # N = 0: nothing to launch; the weight gradient is a sum over no pixels
    x, w, b, conv = _case(2, transposed, 1, False, "batch_major", n=0)
    _check_all(x, w, b, conv, dict(atol=0, rtol=0))


@pytest.mark.interpreter
@pytest.mark.parametrize("geometry", [
    dict(stride=(2, 2), padding=(1, 1), k=(4, 4), sp=(5, 4)),          # DCGAN-like
    dict(stride=(3, 2), padding=(0, 1), k=(2, 3), sp=(4, 5)),          # kernel smaller than stride
    dict(stride=(2, 3), padding=(2, 0), k=(5, 1), sp=(3, 4)),          # a phase with no tap
])
@pytest.mark.parametrize("transposed", [False, True])
def test_interpreter_strided_phases(geometry, transposed, ieee_fp32):
    # A strided conv's input gradient and a strided transposed conv run the
    # phase-split GEMM (dilation 1); every phase, including tap-less ones, is covered.
    opts = dict(geometry, dilation=(1, 1))
    if transposed:
        opts["output_padding"] = (1, 1)
    _check_all(*_case(2, transposed, 1, False, "batch_major", **opts), dict(atol=1e-4, rtol=1e-4))
