import pytest
import torch
from torch import nn

import hfkern
import hfkern.nn as hnn
from _util import array_input, assert_state_equal, compare_modules

CASES = [
    (hnn.Conv2d, dict(in_channels=4, out_channels=6, kernel_size=(3, 2), padding="same",
                      padding_mode="reflect", dilation=2), (5, 4, 9, 8)),
    (hnn.Conv2d, dict(in_channels=4, out_channels=6, kernel_size=4, padding="same", groups=2), (5, 4, 9, 8)),
    (hnn.Conv2d, dict(in_channels=3, out_channels=5, kernel_size=3, stride=2, bias=False), (3, 11, 7)),
    (hnn.Conv1d, dict(in_channels=4, out_channels=6, kernel_size=3, padding=2,
                      padding_mode="circular", stride=2), (5, 4, 9)),
    (hnn.ConvTranspose2d, dict(in_channels=4, out_channels=6, kernel_size=3, stride=2,
                               output_padding=1, groups=2), (5, 4, 7, 6)),
    (hnn.ConvTranspose1d, dict(in_channels=4, out_channels=6, kernel_size=3, stride=2, dilation=2), (4, 7)),
    (hnn.Conv2d, dict(in_channels=2, out_channels=3, kernel_size=(2, 3), padding=(1, 2),
                      padding_mode="replicate", stride=(2, 1)), (3, 2, 6, 7)),
    (hnn.Conv2d, dict(in_channels=6, out_channels=6, kernel_size=3, padding="valid", groups=6), (2, 6, 5, 5)),
    (hnn.Conv1d, dict(in_channels=4, out_channels=2, kernel_size=4, padding="same", dilation=3,
                      groups=2, bias=False), (3, 4, 11)),
    (hnn.Conv1d, dict(in_channels=3, out_channels=3, kernel_size=2, padding=1, padding_mode="reflect"), (3, 5)),
    (hnn.ConvTranspose2d, dict(in_channels=3, out_channels=4, kernel_size=(2, 3), stride=(1, 2),
                               padding=(1, 1), dilation=(2, 1), bias=False), (2, 3, 5, 4)),
    (hnn.ConvTranspose1d, dict(in_channels=4, out_channels=4, kernel_size=3, stride=3, padding=1,
                               output_padding=2, groups=4), (2, 4, 5)),
    # 1x1 convs: a batched matmul on the CPU's torch path (hfkern/ops/conv.py, _pointwise)
    (hnn.Conv1d, dict(in_channels=3, out_channels=7, kernel_size=1), (5, 3, 9)),
    (hnn.Conv2d, dict(in_channels=5, out_channels=4, kernel_size=1, bias=False), (3, 5, 4, 7)),
    (hnn.Conv2d, dict(in_channels=4, out_channels=6, kernel_size=(1, 1)), (4, 5, 3)),
]


@pytest.mark.parametrize("B", [1, 3])
@pytest.mark.parametrize("cls,kw,shape", CASES)
@pytest.mark.parametrize("mode", ["contiguous", "batch_major", "shared"])
def test_conv_matches_torch(cls, kw, shape, B, mode):
    if mode == "batch_major" and len(shape) == cls._n + 1:
        pytest.skip("unbatched input has no batch dim to put first")
    modules = [cls._torch_cls(**kw) for _ in range(B)]
    array = cls.from_modules(modules)
    x, xs, leaf = array_input(shape, B, shared=mode == "shared", layout=mode if mode != "shared" else "contiguous")
    compare_modules(array, modules, x, xs, leaf, shared=mode == "shared")
    assert_state_equal(array, modules)


@pytest.mark.parametrize("cls", [hnn.ConvTranspose1d, hnn.ConvTranspose2d])
def test_conv_transpose_output_size(cls):
    n = cls._n
    kw = dict(in_channels=3, out_channels=2, kernel_size=3, stride=2, padding=1)
    modules = [cls._torch_cls(**kw) for _ in range(2)]
    array = cls.from_modules(modules)
    shape = (4, 3) + (5,) * n
    x = torch.randn(2, *shape)
    size = [10] * n
    y = array(x, output_size=size)
    expected = torch.stack([m(x[b], output_size=size) for b, m in enumerate(modules)])
    torch.testing.assert_close(y, expected)
    with pytest.raises(ValueError, match="output size"):
        array(x, output_size=[20] * n)


def test_conv_output_keeps_batch_major_memory():
    conv1 = hnn.Conv2d(3, 4, 3, B=3)
    conv2 = hnn.Conv2d(4, 5, 3, B=3)
    y = conv1(torch.randn(3, 2, 3, 9, 9))
    assert y.shape == (3, 2, 4, 7, 7)
    assert y.transpose(0, 1).is_contiguous()
    z = conv2(y)
    assert z.transpose(0, 1).is_contiguous()


@pytest.mark.parametrize("cls,kw", [
    (hnn.Conv1d, dict(in_channels=3, out_channels=8, kernel_size=3, groups=1)),
    (hnn.Conv2d, dict(in_channels=4, out_channels=6, kernel_size=(3, 5), groups=2)),
    (hnn.ConvTranspose2d, dict(in_channels=4, out_channels=6, kernel_size=3)),
])
def test_init_matches_torch_distribution(cls, kw):
    B = 64
    array = cls(**kw, B=B)
    ref = torch.stack([cls._torch_cls(**kw).weight.detach() for _ in range(B)])
    fan_in = torch.nn.init._calculate_fan_in_and_fan_out(ref[0])[0]
    bound = 1 / fan_in ** 0.5  # kaiming_uniform_(a=sqrt(5)) bound and bias bound coincide
    for got, want in ((array.weight, ref),):
        assert got.abs().max() <= bound
        torch.testing.assert_close(got.std(), want.std(), atol=0, rtol=0.05)
    assert array.bias.abs().max() <= bound
    # models are drawn independently
    assert not torch.equal(array.weight[0], array.weight[1])
    assert not torch.equal(array.bias[0], array.bias[1])


def test_bad_inputs():
    conv = hnn.Conv2d(3, 4, 3, B=2)
    with pytest.raises(ValueError, match="leading .*B=2"):
        conv(torch.randn(3, 1, 3, 8, 8))
    with pytest.raises(ValueError, match="4-D or 5-D"):
        conv(torch.randn(2, 8, 8))
    with pytest.raises(ValueError, match="expected input with 3 channels.*got 5"):
        conv(torch.randn(2, 1, 5, 8, 8))
    with pytest.raises(TypeError, match="dtype torch.float32.*got torch.float64"):
        conv(torch.randn(2, 1, 3, 8, 8, dtype=torch.float64))
    with pytest.raises(ValueError, match="on meta but the parameters are on cpu"):
        conv(torch.randn(2, 1, 3, 8, 8, device="meta"))
    with pytest.raises(TypeError, match="torch.Tensor"):
        conv([1, 2, 3])
    with pytest.raises(ValueError, match="B must be >= 1, got 0"):
        hnn.Conv2d(3, 4, 3, B=0)
    with pytest.raises(TypeError, match="B must be an int"):
        hnn.Conv2d(3, 4, 3, B=2.0)
    with pytest.raises(TypeError, match="keyword-only argument: 'B'"):
        hnn.Conv2d(3, 4, 3)
    with pytest.raises(ValueError, match="in_channels must be divisible by groups"):
        hnn.Conv2d(3, 4, 3, groups=2, B=2)


def test_from_modules_rejects_mixed_configs():
    with pytest.raises(ValueError, match="field 'stride' differs: module 0 has \\(1, 1\\), module 1 has \\(2, 2\\)"):
        hnn.Conv2d.from_modules([nn.Conv2d(3, 4, 3), nn.Conv2d(3, 4, 3, stride=2)])
    with pytest.raises(ValueError, match="field 'bias' differs"):
        hnn.Conv2d.from_modules([nn.Conv2d(3, 4, 3), nn.Conv2d(3, 4, 3, bias=False)])
    with pytest.raises(TypeError, match="expected torch.nn.Conv2d modules, got Linear at index 1"):
        hnn.Conv2d.from_modules([nn.Conv2d(3, 4, 3), nn.Linear(3, 4)])
    with pytest.raises(ValueError, match="dtype of 'weight' differs"):
        hnn.Conv2d.from_modules([nn.Conv2d(3, 4, 3), nn.Conv2d(3, 4, 3).double()])
    with pytest.raises(ValueError, match="at least one module"):
        hnn.Conv2d.from_modules([])


def _conv_op_args(transposed, shared, groups, B=3):
    ci, co = 4, 6
    x = torch.randn(2, ci, 6, 5) if shared else torch.randn(B, 2, ci, 6, 5)
    w = torch.randn(B, ci, co // groups, 3, 2) if transposed else torch.randn(B, co, ci // groups, 3, 2)
    b = torch.randn(B, co)
    for t in (x, w, b):
        t.requires_grad_()
    return (x, w, b, [2, 1], [1, 0], [1, 2], transposed, [1, 0] if transposed else [0, 0], groups)


@pytest.mark.parametrize("transposed", [False, True])
@pytest.mark.parametrize("shared", [False, True])
@pytest.mark.parametrize("groups", [1, 2])
def test_opcheck_array_conv(transposed, shared, groups):
    from hfkern.ops.conv import array_conv
    torch.library.opcheck(array_conv, _conv_op_args(transposed, shared, groups))


def test_opcheck_array_conv_grads():
    from hfkern.ops.conv import array_conv, array_conv_input_grad, array_conv_weight_grad
    x, w, b, *conv = _conv_op_args(False, False, 2)
    y = array_conv(x, w, b, *conv)
    gy = torch.randn_like(y)
    torch.library.opcheck(array_conv_input_grad, (gy, w.detach(), list(x.shape), *conv))
    torch.library.opcheck(array_conv_weight_grad, (gy, x.detach(), w.detach(), *conv))


@pytest.mark.parametrize("shared", [False, True])
@pytest.mark.parametrize("nd", [1, 2])
def test_op_grads_of_a_transposed_conv_with_output_padding_at_stride_1(nd, shared):
    # output_padding < dilation is legal at stride 1: the input gradient's adjoint conv read
    # the padding rows too and returned a gradient one row longer than the input
    from hfkern.ops.conv import array_conv
    B, N, C_in, C_out, L = 2, 3, 2, 3, 5
    conv_t = torch.nn.functional.conv_transpose1d if nd == 1 else torch.nn.functional.conv_transpose2d
    x = torch.randn(N, C_in, *[L] * nd, dtype=torch.float64)
    xa = (hfkern.broadcast(x, B) if shared else torch.stack([x + b for b in range(B)])).requires_grad_()
    w = torch.randn(B, C_in, C_out, *[2] * nd, dtype=torch.float64, requires_grad=True)
    geom = ([1] * nd, [0] * nd, [2] * nd, True, [1] * nd, 1)
    y = array_conv(xa, w, None, *geom)
    gy = torch.randn_like(y)
    gx, gw = torch.autograd.grad(y, (xa, w), gy)
    assert gx.shape == xa.shape
    for b in range(B):
        xb = (x if shared else x + b).requires_grad_()
        wb = w[b].detach().requires_grad_()
        yb = conv_t(xb, wb, None, 1, 0, 1, 1, 2)
        torch.testing.assert_close(y[b], yb)
        gxb, gwb = torch.autograd.grad(yb, (xb, wb), gy[b])
        if not shared:
            torch.testing.assert_close(gx[b], gxb)
        torch.testing.assert_close(gw[b], gwb)
    if shared:  # the shared input's gradient: the models' sum
        want = sum(torch.autograd.grad(conv_t(x.requires_grad_(), w[b].detach(), None, 1, 0, 1, 1, 2), x, gy[b])[0]
                   for b in range(B))
        torch.testing.assert_close(gx.sum(0) if gx.stride(0) else gx[0], want)


@pytest.mark.parametrize("dtype,tol", [(torch.float64, dict(atol=1e-10, rtol=1e-10)),
                                       (torch.bfloat16, dict(atol=2e-2, rtol=2e-2))])
def test_conv_dtypes(dtype, tol):
    modules = [nn.Conv2d(3, 4, 3, padding=1, dtype=dtype) for _ in range(3)]
    array = hnn.Conv2d.from_modules(modules)
    assert array.weight.dtype == dtype
    x = torch.randn(3, 2, 3, 6, 5, dtype=dtype)
    expected = torch.stack([m(x[b]) for b, m in enumerate(modules)])
    torch.testing.assert_close(array(x), expected, **tol)


@pytest.mark.parametrize("transposed", [False, True])
@pytest.mark.parametrize("shared", [False, True])
def test_opcheck_array_conv_grads_with_inputs_that_require_grad(transposed, shared):
    # With inputs that require grad the gradient ops' own autograd formulas
    # (double backward) are registered, traced and checked too.
    from hfkern.ops.conv import array_conv, array_conv_input_grad, array_conv_weight_grad
    x, w, b, *conv = _conv_op_args(transposed, shared, 2)
    gy = torch.randn_like(array_conv(x, w, b, *conv)).requires_grad_()
    torch.library.opcheck(array_conv_input_grad, (gy, w, list(x.shape), *conv))
    torch.library.opcheck(array_conv_weight_grad, (gy, x, w, *conv))


# ---- 3-D convolution and malformed geometry ---------------------------------

def _conv3d_args(shared=False):
    x = torch.randn(2, 3, 4, 4, 4) if shared else torch.randn(2, 2, 3, 4, 4, 4)
    w = torch.randn(2, 5, 3, 2, 2, 2)
    return x, w, [1, 1, 1], [0, 0, 0], [1, 1, 1], [0, 0, 0]


def _conv3d_calls(shared=False, impls=None):
    """(op name, a 3-D call of it): of the ops, or of ``impls`` (the three functions in op order)."""
    from hfkern.ops import conv
    array_conv, array_conv_input_grad, array_conv_weight_grad = impls or (
        conv.array_conv, conv.array_conv_input_grad, conv.array_conv_weight_grad)
    x, w, stride, padding, dilation, output_padding = _conv3d_args(shared)
    gy = torch.randn(2, 2, 5, 3, 3, 3)
    geom = (stride, padding, dilation, False, output_padding, 1)
    return [
        ("array_conv", lambda: array_conv(x, w, None, *geom)),
        ("array_conv_input_grad", lambda: array_conv_input_grad(gy, w, list(x.shape), *geom)),
        ("array_conv_weight_grad", lambda: array_conv_weight_grad(gy, x, w, *geom)),
    ]


@pytest.fixture
def spy_backends(monkeypatch):
    """Every backend pretend-available for the conv ops, each a spy that records a call."""
    from hfkern import _backend
    called = []
    ops = ("array_conv", "array_conv_input_grad", "array_conv_weight_grad")
    saved = {op: dict(_backend._registry[op]) for op in ops}
    for name in ("triton", "cuda"):
        monkeypatch.setitem(_backend._availability, name, lambda: (True, "pretend"))
    for op in ops:
        for name in _backend.BACKENDS:
            _backend.register(op, name, lambda *a, _n=name: called.append(_n))
    yield called
    for op in ops:
        _backend._registry[op] = saved[op]
    _backend._resolved.clear()


@pytest.mark.parametrize("backend", ["auto", "torch", "triton", "cuda"])
@pytest.mark.parametrize("shared", [False, True])
def test_3d_conv_raises_before_any_backend_runs(spy_backends, backend, shared):
    with hfkern.use_backend(backend):
        for op, call in _conv3d_calls(shared):
            with pytest.raises(NotImplementedError,
                               match=rf"hfkern::{op}: supports 1-D and 2-D convolutions only .*"
                                     r"got a 3-D convolution: stride \[1, 1, 1\] and weight of shape "
                                     r"\[2, 5, 3, 2, 2, 2\]"):
                call()
    assert spy_backends == []


def test_3d_conv_raises_under_fake_tensors_and_torch_compile():
    from torch._subclasses.fake_tensor import FakeTensorMode
    with FakeTensorMode(allow_non_fake_inputs=True):
        for op, call in _conv3d_calls():
            with pytest.raises(NotImplementedError, match=rf"hfkern::{op}: .*3-D convolution"):
                call()
    from hfkern.ops.conv import array_conv
    torch._dynamo.reset()
    x, w, *geom = _conv3d_args()
    compiled = torch.compile(lambda x, w: array_conv(x, w, None, *geom[:3], False, geom[3], 1),
                             fullgraph=True, backend="aot_eager")
    # dynamo reports the fake's NotImplementedError as Unsupported (both RuntimeErrors)
    with pytest.raises(RuntimeError, match=r"hfkern::array_conv: .*3-D convolution"):
        compiled(x, w)


@pytest.mark.parametrize("shared", [False, True])
def test_triton_conv_implementations_reject_3d_conv(shared):
    # Benchmarks call the launchers directly, past the ops' checks.
    pytest.importorskip("triton")
    from hfkern import _backend
    from hfkern.triton import conv as launchers
    ops = ("array_conv", "array_conv_input_grad", "array_conv_weight_grad")
    impls = [_backend._registry[op]["triton"].load() for op in ops]
    assert impls == [launchers.array_conv, launchers.array_conv_input_grad, launchers.array_conv_weight_grad]
    for op, call in _conv3d_calls(shared, impls):
        with pytest.raises(NotImplementedError,
                           match=rf"hfkern::{op} \(triton\): supports 1-D and 2-D convolutions only .*"
                                 r"got a 3-D convolution: stride \[1, 1, 1\] and weight of shape "
                                 r"\[2, 5, 3, 2, 2, 2\]"):
            call()


def test_malformed_conv_geometry_raises_value_error():
    from hfkern.ops.conv import array_conv, array_conv_input_grad
    x, w = torch.randn(2, 2, 3, 6, 6), torch.randn(2, 4, 3, 3, 3)
    geom = dict(stride=[1, 1], padding=[0, 0], dilation=[1, 1], output_padding=[0, 0])

    def conv(x=x, w=w, **kw):
        g = {**geom, **kw}
        return array_conv(x, w, None, g["stride"], g["padding"], g["dilation"], False, g["output_padding"], 1)

    with pytest.raises(ValueError, match=r"expected padding of length 2 .* got \[0\]"):
        conv(padding=[0])
    with pytest.raises(ValueError, match=r"expected dilation of length 2 .* got \[1, 1, 1\]"):
        conv(dilation=[1, 1, 1])
    with pytest.raises(ValueError, match=r"expected weight of 5 dims .* got \[2, 4, 3, 3\]"):
        conv(w=torch.randn(2, 4, 3, 3))
    with pytest.raises(ValueError, match=r"expected an input of 5 dims .* got 6 dims"):
        conv(x=torch.randn(2, 2, 3, 6, 6, 1))
    with pytest.raises(ValueError, match=r"supports 1-D and 2-D convolutions only .* got stride \[\]"):
        conv(stride=[], padding=[], dilation=[], output_padding=[])
    with pytest.raises(ValueError, match=r"expected grad_out of 5 dims .* got shape \[2, 2, 4, 4\]"):
        array_conv_input_grad(torch.randn(2, 2, 4, 4), w, list(x.shape), [1, 1], [0, 0], [1, 1],
                              False, [0, 0], 1)

