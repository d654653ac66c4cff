"""Op-layer defects, fourth round.

1. Batch norm on the torch path with per-channel tensors that are strided views (a ``[B, C]``
   weight sliced out of a ``[B, 2C]`` one, whose flat view has stride 2): torch's CPU batch-norm
   kernels ignore a per-channel tensor's stride, so hfkern hands them contiguous ones; the
   results are those of contiguous copies, bit for bit (op, eager autograd path, grouped path).
2. The Triton and CUDA (emulated) conv launchers called directly check their operands as the
   ops do: a weight of another B, a bias of the wrong shape or dtype raise instead of being read
   out of bounds.
"""

from __future__ import annotations


import pytest
import torch

import hfkern  # noqa: F401  (registers the ops)
from hfkern import _backend
from hfkern.ops import batch_norm as bnops

ops = torch.ops.hfkern
EPS = 1e-5

_bn_fwd = _backend._registry["array_batch_norm"]["torch"].load()
_bn_bwd = _backend._registry["array_batch_norm_backward"]["torch"].load()


def _strided(t: torch.Tensor) -> torch.Tensor:
    """``t`` ([B, C]) as a stride-2 slice of a [B, 2C] tensor: the same values."""
    wide = torch.full((t.shape[0], 2 * t.shape[1]), float("nan"), dtype=t.dtype)
    out = wide[:, ::2]
    out.copy_(t)
    assert out.stride() == (2 * t.shape[1], 2)
    return out


def _bn_inputs(layout: str, B=3, N=4, C=5):
    if layout == "linear":  # [B, N, C]: the copied grouped path
        return torch.randn(B, N, C)
    # [B, N, C, H, W] in [N, B, C, H, W] memory: the free grouped view
    return torch.randn(N, B, C, 3, 2).transpose(0, 1)


# ---- 1. batch norm with strided per-channel tensors -----------------------------------------

@pytest.mark.parametrize("layout", ["linear", "conv"])
@pytest.mark.parametrize("activation", ["none", "relu"])
def test_bn_backward_with_strided_weight_is_the_contiguous_ones(layout, activation):
    x = _bn_inputs(layout)
    B, C = x.shape[0], x.shape[2]
    w, b = torch.randn(B, C), torch.randn(B, C)
    _, mean, rstd = _bn_fwd(x, w, b, None, None, None, True, 0.1, EPS, activation)
    gy = torch.randn(x.shape)
    mask = [True, True, True]
    want = _bn_bwd(gy, x, w, mean, rstd, True, mask, b, activation)
    for ws, ms, rs in [(_strided(w), mean, rstd), (w, _strided(mean), _strided(rstd)),
                       (_strided(w), _strided(mean), _strided(rstd))]:
        got = _bn_bwd(gy, x, ws, ms, rs, True, mask, _strided(b), activation)
        for g, e in zip(got, want):
            assert torch.equal(g, e)
        got = ops.array_batch_norm_backward(gy, x, ws, ms, rs, True, mask, b, activation)
        for g, e in zip(got, want):
            assert torch.equal(g, e)


def _f64_reference_grad_x(x, w, gy):
    out = []
    for i in range(x.shape[0]):
        xi = x[i].double().requires_grad_()
        yi = torch.nn.functional.batch_norm(xi, None, None, w[i].double().contiguous(), None, True, 0.1, EPS)
        out.append(torch.autograd.grad(yi, xi, gy[i].double())[0])
    return torch.stack(out)


@pytest.mark.parametrize("layout", ["linear", "conv"])
def test_bn_autograd_with_strided_weight(layout):
    """The differentiable entry point (eager torch path under torch's autograd): the strided
    weight's gradients are the contiguous weight's, and grad_x is right (against float64)."""
    x = _bn_inputs(layout)
    B, C = x.shape[0], x.shape[2]
    w0, b0 = torch.randn(B, C), torch.randn(B, C)
    gy = torch.randn(x.shape)
    grads = []
    for w, b in [(w0.clone(), b0.clone()), (_strided(w0), _strided(b0))]:
        xl = x.detach().clone().requires_grad_()
        w.requires_grad_()
        b.requires_grad_()
        y, _, _ = bnops.array_batch_norm(xl, w, b, None, None, None, True, 0.1, EPS, "none")
        grads.append(torch.autograd.grad(y, [xl, w, b], gy))
    for g, e in zip(grads[1], grads[0]):
        assert torch.equal(g, e)
    ref = _f64_reference_grad_x(x, w0, gy)
    torch.testing.assert_close(grads[1][0].double(), ref, atol=1e-4, rtol=1e-4)


def test_bn_forward_with_strided_weight_bias_and_running_stats():
    """Forward (op and grouped path): strided weight, bias and running statistics give the
    contiguous ones' output and running statistics, bit for bit; the strided statistics are
    updated in place."""
    for layout in ["linear", "conv"]:
        x = _bn_inputs(layout)
        B, C = x.shape[0], x.shape[2]
        w, b, rm, rv = torch.randn(B, C), torch.randn(B, C), torch.randn(B, C), torch.rand(B, C) + 0.5
        rm_c, rv_c = rm.clone(), rv.clone()
        want = _bn_fwd(x, w, b, rm_c, rv_c, None, True, 0.1, EPS, "relu")
        rm_s, rv_s = _strided(rm), _strided(rv)
        got = ops.array_batch_norm(x, _strided(w), _strided(b), rm_s, rv_s, None, True, 0.1, EPS, "relu")
        for g, e in zip(got, want):
            assert torch.equal(g, e)
        assert torch.equal(rm_s, rm_c) and torch.equal(rv_s, rv_c)


def test_grouped_batch_norm_with_strided_weight():
    """hfkern.nn's and hfkern.fuse's grouped path (grouped_batch_norm, under torch's autograd):
    the gradients with a strided weight are the contiguous weight's."""
    B, N, C = 3, 4, 5
    xg = torch.randn(N, B * C, 3, 2)
    w0, b0 = torch.randn(B, C), torch.randn(B, C)
    rm0, rv0 = torch.randn(B, C), torch.rand(B, C) + 0.5
    gy = None
    results = []
    for w, b, rm, rv in [(w0.clone(), b0.clone(), rm0.clone(), rv0.clone()),
                         (_strided(w0), _strided(b0), _strided(rm0), _strided(rv0))]:
        xl = xg.detach().clone().requires_grad_()
        w.requires_grad_()
        b.requires_grad_()
        assert bnops.grouped_serves(xl, B, w, b, rm, rv)
        y = bnops.grouped_batch_norm(xl, B, torch.contiguous_format, w, b, rm, rv, None, 0.1, EPS)
        if gy is None:
            gy = torch.randn(y.shape)
        results.append((y.detach(), rm.clone(), rv.clone(), *torch.autograd.grad(y, [xl, w, b], gy)))
    for g, e in zip(results[1], results[0]):
        assert torch.equal(g, e)


# ---- 2. the conv launchers check their operands -------------------------------------------------

_CONV = ([1, 1], [1, 1], [1, 1], False, [0, 0], 1)


def _bad_conv_calls(fwd, dgrad, wgrad):
    x = torch.randn(2, 3, 4, 6, 6)
    w = torch.randn(2, 8, 4, 3, 3)
    gy = torch.randn(2, 3, 8, 6, 6)
    return [
        ("forward, weight of another B", ValueError, lambda: fwd(x, torch.randn(3, 8, 4, 3, 3), None, *_CONV)),
        ("forward, bias [B, 7] for C_out = 8", ValueError, lambda: fwd(x, w, torch.randn(2, 7), *_CONV)),
        ("forward, float16 bias", TypeError, lambda: fwd(x, w, torch.randn(2, 8).half(), *_CONV)),
        ("forward, float64 x", TypeError, lambda: fwd(x.double(), w, None, *_CONV)),
        ("input grad, input_size of another B", ValueError, lambda: dgrad(gy, w, [3, 3, 4, 6, 6], *_CONV)),
        ("input grad, input_size of another C_in", ValueError, lambda: dgrad(gy, w, [2, 3, 5, 6, 6], *_CONV)),
        ("input grad, float64 grad_out", TypeError, lambda: dgrad(gy.double(), w, [2, 3, 4, 6, 6], *_CONV)),
        ("weight grad, x of another B", ValueError, lambda: wgrad(gy, torch.randn(3, 3, 4, 6, 6), w, *_CONV)),
        ("weight grad, grad_out of another shape", ValueError,
         lambda: wgrad(torch.randn(2, 3, 8, 5, 5), x, w, *_CONV)),
        ("weight grad, float64 x", TypeError, lambda: wgrad(gy, x.double(), w, *_CONV)),
        ("depthwise forward, bias of another B", ValueError,
         lambda: fwd(x, torch.randn(2, 4, 1, 3, 3), torch.randn(3, 4), [1, 1], [1, 1], [1, 1], False, [0, 0], 4)),
        ("depthwise input grad, shared input_size of another C", ValueError,
         lambda: dgrad(torch.randn(2, 3, 4, 6, 6), torch.randn(2, 4, 1, 3, 3), [3, 5, 6, 6],
                       [1, 1], [1, 1], [1, 1], False, [0, 0], 4)),
    ]


def _check_conv_launchers(fwd, dgrad, wgrad):
    for what, error, call in _bad_conv_calls(fwd, dgrad, wgrad):
        with pytest.raises(error, match="hfkern::array_conv"):
            call()
            pytest.fail(f"{what}: accepted")
    # the ops refuse the same calls
    for what, error, call in _bad_conv_calls(ops.array_conv, ops.array_conv_input_grad,
                                             ops.array_conv_weight_grad):
        with pytest.raises(error):
            call()


@pytest.mark.interpreter
def test_triton_conv_launchers_check_their_operands():
    pytest.importorskip("triton")
    from hfkern.triton import conv as tc

    _check_conv_launchers(tc.array_conv, tc.array_conv_input_grad, tc.array_conv_weight_grad)
    # a good call still runs
    x, w, b = torch.randn(2, 3, 4, 6, 6), torch.randn(2, 8, 4, 3, 3), torch.randn(2, 8)
    want = ops.array_conv(x, w, b, *_CONV)
    torch.testing.assert_close(tc.array_conv(x, w, b, *_CONV), want, atol=1e-4, rtol=1e-4)


@pytest.mark.emulator
def test_cuda_conv_launchers_check_their_operands():
    from hfkern.cuda import conv as cc

    _check_conv_launchers(cc.emulated("array_conv"), cc.emulated("array_conv_input_grad"),
                          cc.emulated("array_conv_weight_grad"))
    x, w = torch.randn(2, 3, 4, 6, 6), torch.randn(2, 4, 1, 3, 3)
    dw = ([1, 1], [1, 1], [1, 1], False, [0, 0], 4)
    torch.testing.assert_close(cc.emulated("array_conv")(x, w, None, *dw), ops.array_conv(x, w, None, *dw),
                               atol=1e-5, rtol=1e-5)
