"""ConvTranspose output_size in every form: spatial, one model's output shape, the array output shape."""

import pytest
import torch

import hfkern
import hfkern.nn as hnn
from _util import array_input, compare_modules

# (class, config, one model's input shape); batched and unbatched, odd sizes
CASES = [
    (hnn.ConvTranspose1d, dict(in_channels=3, out_channels=2, kernel_size=3, stride=2, padding=1), (4, 3, 5)),
    (hnn.ConvTranspose1d, dict(in_channels=2, out_channels=4, kernel_size=4, stride=3, groups=2), (2, 7)),
    (hnn.ConvTranspose2d, dict(in_channels=3, out_channels=2, kernel_size=3, stride=2, padding=1), (3, 3, 5, 4)),
    (hnn.ConvTranspose2d, dict(in_channels=2, out_channels=3, kernel_size=(2, 3), stride=(3, 2),
                               dilation=(1, 2), bias=False), (2, 5, 3)),
]
IDS = ["1d-batched", "1d-unbatched", "2d-batched", "2d-unbatched"]


def _largest_sizes(m, shape):
    """The largest spatial output sizes the stride allows for one model's input ``shape`` (not the default)."""
    n = len(m.kernel_size)
    return [(shape[-n + d] - 1) * m.stride[d] - 2 * m.padding[d] + m.dilation[d] * (m.kernel_size[d] - 1)
            + 1 + m.stride[d] - 1 for d in range(n)]


@pytest.mark.parametrize("mode", ["contiguous", "batch_major", "shared"])
@pytest.mark.parametrize("B", [1, 3])
@pytest.mark.parametrize("cls,kw,shape", CASES, ids=IDS)
def test_output_size_forms_match_torch(cls, kw, shape, B, mode):
    n = cls._n
    batched = len(shape) == n + 2
    if mode == "batch_major" and not batched:
        pytest.skip("unbatched input has no batch dim to put first")
    modules = [cls._torch_cls(**kw) for _ in range(B)]
    array = cls.from_modules(modules)
    spatial = _largest_sizes(modules[0], shape)
    model_shape = ([shape[0]] if batched else []) + [kw["out_channels"]] + spatial
    forms = [spatial, model_shape,  # torch's own forms, per model
             [B] + model_shape, tuple([B] + model_shape), torch.Size([B] + model_shape)]  # the array's
    for size in forms:
        x, xs, leaf = array_input(shape, B, shared=mode == "shared",
                                  layout="contiguous" if mode == "shared" else mode)
        # torch is given a per-model form; the array form is the array's addition
        torch_size = model_shape if len(size) == len(model_shape) + 1 else size
        call = lambda m, inp: m(inp, output_size=size if isinstance(m, cls) else torch_size)  # noqa: E731
        y = compare_modules(array, modules, x, xs, leaf, call=call, shared=mode == "shared")
        assert list(y.shape) == [B] + model_shape


@pytest.mark.parametrize("cls,kw,shape", CASES, ids=IDS)
def test_output_size_errors(cls, kw, shape):
    n = cls._n
    batched = len(shape) == n + 2
    array = cls(**kw, B=2)
    x = torch.randn(2, *shape)
    spatial = _largest_sizes(array, shape)
    model_shape = ([shape[0]] if batched else []) + [kw["out_channels"]] + spatial
    with pytest.raises(ValueError, match=r"array output shape .*first entry must be B=2; got \[3, "):
        array(x, output_size=[3] + model_shape)
    with pytest.raises(ValueError, match=rf"expected output_size of the form \[\*spatial\] \({n}\).*"
                                         rf"got {n + 4} entries"):
        array(x, output_size=[1] * (n + 4))
    with pytest.raises(ValueError, match="output size"):  # torch's check of the spatial sizes
        array(x, output_size=[2] + model_shape[:-1] + [model_shape[-1] + 5])
    with pytest.raises(TypeError, match="output_size to be a list or tuple of ints, got int"):
        array(x, output_size=7)
    # a shared input takes the same forms
    shared = hfkern.broadcast(torch.randn(shape), 2)
    assert list(array(shared, output_size=[2] + model_shape).shape) == [2] + model_shape


@pytest.mark.parametrize("shared", [False, True])
def test_in_place_ops_on_conv_and_batch_norm_outputs(shared):
    """nn.ReLU(inplace=True) and `out += identity` on array outputs, as ResNets write them:
    the same values and gradients as the out-of-place code."""
    torch.manual_seed(0)
    B = 3
    conv, bn = hnn.Conv2d(2, 4, 3, padding=1, B=B), hnn.BatchNorm2d(4, B=B)
    conv2 = hnn.Conv2d(4, 4, 1, B=B)
    x = torch.randn(5, 2, 6, 6) if shared else torch.randn(B, 5, 2, 6, 6)
    x = hfkern.broadcast(x, B) if shared else x

    def run(inplace):
        for m in (conv, bn, conv2):
            m.zero_grad()
        y = conv(x)
        y = torch.nn.ReLU(inplace=inplace)(y)
        z = bn(conv2(y))
        if inplace:
            z += y
            z.relu_()
        else:
            z = torch.relu(z + y)
        z.square().sum().backward()
        return z.detach(), [p.grad.clone() for m in (conv, bn, conv2) for p in m.parameters()]

    out, grads = run(True)
    ref, ref_grads = run(False)
    torch.testing.assert_close(out, ref)
    for g, r in zip(grads, ref_grads):
        torch.testing.assert_close(g, r)


class _LayoutSpy(torch.utils._python_dispatch.TorchDispatchMode):
    """Records the layout of the operands of ReLU and its backward (strides, and whether they are
    [N, B, ...] memory), and every copy of a tensor of one of the ``sizes`` (numel)."""

    ELEMENTWISE = {torch.ops.aten.relu.default, torch.ops.aten.clamp_min.default,
                   torch.ops.aten.threshold_backward.default}
    COPIES = {torch.ops.aten.clone.default, torch.ops.aten._to_copy.default, torch.ops.aten.copy_.default,
              torch.ops.aten.contiguous.default}

    def __init__(self, sizes):
        super().__init__()
        self.sizes, self.elementwise, self.copies = set(sizes), [], []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        tensors = [a for a in args if isinstance(a, torch.Tensor)]
        if func in self.ELEMENTWISE:
            self.elementwise.append((func, [(t.stride(), t.transpose(0, 1).is_contiguous()) for t in tensors]))
        if func in self.COPIES and any(t.numel() in self.sizes for t in tensors):
            self.copies.append((func, [t.shape for t in tensors]))
        return func(*args, **(kwargs or {}))


def test_conv_norm_relu_pool_chain_keeps_one_layout():
    """Conv, batch norm, ReLU and max-pool keep the conv's [N, B, C, H, W] memory forward and
    backward: ReLU and its backward see operands of one layout (TensorIterator's dense loop,
    as on [N, B*C, H, W] memory), and no activation or gradient is copied between the ops."""
    B, N = 3, 5
    model = torch.nn.Sequential(
        hnn.Conv2d(2, 4, 3, padding=1, B=B), hnn.BatchNorm2d(4, B=B), torch.nn.ReLU(), hnn.MaxPool2d(2, B=B),
        hnn.Conv2d(4, 6, 3, padding=1, B=B), hnn.BatchNorm2d(6, B=B), torch.nn.ReLU(), hnn.MaxPool2d(2, B=B),
    )
    x = hfkern.broadcast(torch.randn(N, 2, 8, 8), B)
    # the gradient a next array conv (or a pooled layer's view) hands back: [N, B, ...] memory
    grad = torch.randn(N, B, 6, 2, 2).transpose(0, 1)
    spy = _LayoutSpy(B * N * c * s * s for c, s in ((4, 8), (4, 4), (6, 4), (6, 2)))
    with spy:
        y = model(x)
        y.backward(grad)
    assert y.transpose(0, 1).is_contiguous()
    assert [f for f, _ in spy.elementwise] == [torch.ops.aten.relu.default] * 2 + \
        [torch.ops.aten.threshold_backward.default] * 2
    for func, operands in spy.elementwise:
        assert len(set(operands)) == 1 and operands[0][1], (func, operands)  # one layout: [N, B, ...] memory
    assert spy.copies == []


@pytest.mark.parametrize("n_first", [False, True])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_low_precision_bias_gradient_accumulates_in_float32(dtype, n_first):
    """The bias gradient of a low-precision conv rounds once, as torch's does: per-sample
    sums that cancel (a conv before batch norm) leave no per-sample round-off behind."""
    B, N, C = 2, 8, 3
    torch.manual_seed(0)
    big = 100 * torch.randn(B, 1, C, 1, 1).expand(B, N, C, 5, 5).clone()
    big[:, N // 2:] *= -1                                   # per-sample sums of 2500, totals near 0
    grad = (big + torch.randn(B, N, C, 5, 5)).to(dtype)
    if n_first:                                             # [N, B, ...] memory, as an array conv's
        grad = grad.transpose(0, 1).contiguous().transpose(0, 1)
    x = torch.randn(B, N, 4, 7, 7, dtype=dtype)
    w = torch.randn(B, C, 4, 3, 3, dtype=dtype, requires_grad=True)
    b = torch.zeros(B, C, dtype=dtype, requires_grad=True)
    out = torch.ops.hfkern.array_conv(x, w, b, [1, 1], [0, 0], [1, 1], False, [0, 0], 1)
    out.backward(grad)
    want = grad.double().sum(dim=(1, 3, 4))
    assert b.grad.dtype == dtype
    # one rounding of the exact sum (float32 accumulation adds far less than that)
    atol = 2 * torch.finfo(dtype).eps * want.abs().max().item()
    torch.testing.assert_close(b.grad.double(), want.to(dtype).double(), rtol=0, atol=atol)


@pytest.mark.parametrize("cls", ["Conv1d", "Conv2d", "ConvTranspose2d"])
def test_padding_set_after_construction_is_what_the_convolution_applies(cls):
    """torch's convolutions read ``padding`` at every call (zeros mode), so a value set after
    construction applies; the array convolution does the same, per model as B torch convs."""
    torch.manual_seed(0)
    B = 3
    nd = 1 if cls == "Conv1d" else 2
    convs = [getattr(torch.nn, cls)(2, 4, 3, padding=1) for _ in range(B)]
    array = getattr(hnn, cls).from_modules(convs)
    for conv in (*convs, array):
        conv.padding = (2,) * nd if cls != "ConvTranspose2d" else (0,) * nd
    x = torch.randn(B, 5, 2, *([7] * nd))
    y = array(x)
    ref = torch.stack([c(x[b]) for b, c in enumerate(convs)])
    assert y.shape == ref.shape
    torch.testing.assert_close(y, ref, rtol=1e-4, atol=1e-5)
