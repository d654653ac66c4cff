"""The op layer: forward-mode AD refused where an op is dispatched (torch would give zero
tangents), batch norm's double backward with a bias and no weight, a 1x1 convolution of an
empty batch, nonfinite_models' device and dtype checks, and the convolution's stride,
padding, dilation and output_padding values checked by the op and its fake alike."""

from __future__ import annotations

import pytest
import torch
import torch.autograd.forward_ad as fwAD
from torch._subclasses.fake_tensor import FakeTensorMode

import hfkern.nn as hn
from hfkern import _backend
from hfkern.ops import batch_norm as bn_ops
from hfkern.ops.optim import nonfinite_models

ops = torch.ops.hfkern
B = 2


def modules_and_inputs():
    return [(hn.Conv2d(2, 3, 3, B=B), torch.randn(B, 3, 2, 5, 5)),
            (hn.Conv2d(2, 3, 1, B=B), torch.randn(B, 3, 2, 4, 4)),
            (hn.LayerNorm(4, B=B), torch.randn(B, 3, 4)),
            (hn.RMSNorm(4, B=B), torch.randn(B, 3, 4))]


@pytest.mark.parametrize("index", range(4))
def test_forward_mode_ad_through_a_dispatched_op_raises(index):
    module, x = modules_and_inputs()[index]
    with _backend.dispatched_ops():
        with pytest.raises(RuntimeError, match="forward-mode AD .* is not supported"):
            torch.func.jvp(module, (x,), (torch.randn_like(x),))
        with fwAD.dual_level(), pytest.raises(RuntimeError, match="forward-mode AD .* is not supported"):
            module(fwAD.make_dual(x, torch.randn_like(x)))
        # Without a tangent the forward runs as always, also inside a dual level.
        with fwAD.dual_level():
            torch.testing.assert_close(module(x), module(x))


def test_forward_mode_ad_through_a_dispatched_embedding_raises():
    emb = hn.Embedding(5, 4, B=B)
    idx = torch.randint(0, 5, (B, 3))
    params = dict(emb.named_parameters())
    with _backend.dispatched_ops(), pytest.raises(RuntimeError, match="array_embedding: forward-mode AD"):
        torch.func.jvp(lambda p: torch.func.functional_call(emb, p, (idx,)), (params,),
                       ({k: torch.randn_like(v) for k, v in params.items()},))


def test_batch_norm_with_a_bias_and_no_weight_has_a_double_backward():
    torch.manual_seed(0)
    x = torch.randn(B, 4, 3, 2, 2, dtype=torch.float64, requires_grad=True)
    bias = torch.randn(B, 3, dtype=torch.float64, requires_grad=True)

    def f(x, bias):
        return bn_ops.array_batch_norm(x, None, bias, None, None, None, True, 0.1, 1e-5)

    torch.autograd.gradgradcheck(f, (x, bias))
    with _backend.dispatched_ops():
        torch.autograd.gradgradcheck(f, (x, bias))


@pytest.mark.parametrize("k", [1, 3])
def test_a_convolution_of_an_empty_batch_matches_torch(k):
    conv = hn.Conv2d(2, 4, k, B=3)
    x = torch.randn(3, 0, 2, 5, 5, requires_grad=True)
    y = conv(x)
    ref = torch.nn.Conv2d(2, 4, k)
    assert y.shape == (3, *ref(torch.randn(0, 2, 5, 5)).shape)
    y.sum().backward()
    assert x.grad.shape == x.shape and torch.equal(conv.weight.grad, torch.zeros_like(conv.weight))


def test_nonfinite_models_checks_devices_and_dtypes():
    nan = torch.full((3, 2), float("nan"))
    for grads in ([nan, torch.randn(3, 2, device="meta")], [torch.randn(3, 2, device="meta"), nan]):
        with pytest.raises(ValueError, match=r"expected every gradient on .* \(as grads\[0\]\), got grads\[1\]"):
            nonfinite_models(grads)
    with pytest.raises(TypeError, match=r"expected floating-point gradients, got grads\[1\] of dtype torch.int64"):
        nonfinite_models([nan, torch.ones(3, 2, dtype=torch.int64)])
    assert nonfinite_models([nan, torch.randn(3, 4)]).tolist() == [True, True, True]


@pytest.mark.parametrize("stride, padding, dilation, transposed, output_padding, match", [
    ([0, 1], [0, 0], [1, 1], False, [0, 0], "expected stride >= 1"),
    ([1, 1], [-1, 0], [1, 1], False, [0, 0], r"padding \[-1, 0\]"),
    ([1, 1], [0, 0], [0, 1], False, [0, 0], r"dilation \[0, 1\]"),
    ([1, 1], [0, 0], [1, 1], True, [1, 0], "expected output_padding smaller than stride or dilation"),
    ([2, 2], [0, 0], [1, 1], True, [2, 0], "expected output_padding smaller than stride or dilation"),
])
def test_conv_argument_values_are_checked_by_the_op_and_its_fake(stride, padding, dilation, transposed,
                                                                output_padding, match):
    x = torch.randn(2, 1, 3, 6, 6)
    w = torch.randn(2, 3, 4, 3, 3) if transposed else torch.randn(2, 4, 3, 3, 3)
    args = (x, w, None, stride, padding, dilation, transposed, output_padding, 1)
    with pytest.raises(ValueError, match=match):
        ops.array_conv(*args)
    with FakeTensorMode() as mode, pytest.raises(ValueError, match=match):
        ops.array_conv(mode.from_tensor(x), mode.from_tensor(w), *args[2:])


def test_batch_norm_backward_on_a_layout_torchs_kernel_misreads_matches_the_formula():
    # x's grouped view passes for channels-last-3d through its size-1 dims, grad_y is contiguous:
    # torch's CPU kernel read grad_y in x's layout (grad_bias -3.24, 1.00 for -0.88, -1.36).
    torch.manual_seed(0)
    x = torch.empty_strided((1, 2, 2, 1, 2, 1), (2, 4, 1, 2, 2, 1)).copy_(torch.randn(1, 2, 2, 1, 2, 1))
    gy = torch.randn(x.shape)
    y, mean, rstd = ops.array_batch_norm(x, None, None, None, None, None, True, 0.1, 1e-5, "none")
    gx, _, gb = ops.array_batch_norm_backward(gy, x, None, mean, rstd, True, [True, False, True], None, "none")
    x64 = x.double().requires_grad_()
    dims = (1, 3, 4, 5)
    ref = (x64 - x64.mean(dims, keepdim=True)) / (x64.var(dims, unbiased=False, keepdim=True) + 1e-5).sqrt()
    ref.backward(gy.double())
    torch.testing.assert_close(gb, gy.double().sum(dims).float())
    torch.testing.assert_close(gx, x64.grad.float(), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("dispatched", [False, True])
def test_a_transposed_convolution_with_an_empty_output_has_zero_gradients(dispatched):
    x = torch.randn(2, 2, 2, 1, requires_grad=True)
    w = torch.randn(2, 2, 2, 2, requires_grad=True)
    with _backend.dispatched_ops() if dispatched else torch.enable_grad():
        y = ops.array_conv(x, w, None, [1], [1], [1], True, [0], 1)  # output length 0
        assert y.shape == (2, 2, 2, 0)
        y.sum().backward()
    assert torch.equal(x.grad, torch.zeros_like(x)) and torch.equal(w.grad, torch.zeros_like(w))


@pytest.mark.parametrize("weight, error, match", [
    (torch.randn(2, 1, 3).expand(2, 5, 3), ValueError, r"elements have memory of their own .* strides \[3, 0, 1\]"),
    (torch.ones(2, 5, 3, dtype=torch.int64), TypeError, "expected a floating-point weight, got torch.int64"),
])
def test_embedding_renorm_refuses_a_weight_it_cannot_write_in_the_op_and_its_fake(weight, error, match):
    idx = torch.tensor([[0, 1], [2, 3]])
    before = weight.clone()
    with torch.no_grad(), pytest.raises(error, match=match):
        ops.array_embedding_renorm_(weight, idx, 1.0, 2.0)
    assert torch.equal(weight, before)
    with FakeTensorMode() as mode, pytest.raises(error, match=match):
        ops.array_embedding_renorm_(mode.from_tensor(weight), mode.from_tensor(idx), 1.0, 2.0)
