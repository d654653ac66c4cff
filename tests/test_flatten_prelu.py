import pytest
import torch
from torch import nn

import hfkern
from hfkern._array import is_shared
from hfkern.nn.activation import PReLU
from hfkern.nn.flatten import Flatten
from _util import array_input, assert_state_equal, compare_modules


def _input(shape, B, mode, dtype=torch.float32):
    """(array input, per-model leaves, gradient leaf); handles 0-d model inputs."""
    if mode == "shared":
        base = torch.randn(shape, dtype=dtype)
        leaf = base.clone().requires_grad_()
        return hfkern.broadcast(leaf, B), [base.clone().requires_grad_() for _ in range(B)], leaf
    if not shape and mode != "contiguous":
        pytest.skip("a 0-d model input has no dim to permute or stride")
    return array_input(shape, B, layout=mode, dtype=dtype)


MODES = ["contiguous", "batch_major", "strided", "shared"]

# ---------------------------------------------------------------- Flatten

SHAPES = [(), (7,), (5, 4), (5, 4, 3, 6), (2, 3, 1, 4, 5)]
DIMS = [(1, -1), (0, -1), (0, 0), (-2, -1), (1, 2), (-3, -2), (2, 3), (0, 1), (2, 1)]


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("B", [1, 3])
@pytest.mark.parametrize("dims", DIMS, ids=str)
@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_flatten_matches_torch(shape, dims, B, mode):
    modules = [nn.Flatten(*dims) for _ in range(B)]
    array = Flatten.from_modules(modules)
    assert (array.B, array.start_dim, array.end_dim) == (B, *dims)
    x, xs, leaf = _input(shape, B, mode)
    try:
        modules[0](torch.randn(shape))
    except (IndexError, RuntimeError):
        # dims that torch rejects for one model's input are rejected for the array
        with pytest.raises(ValueError, match=rf"start_dim={dims[0]}, end_dim={dims[1]}.*{len(shape)} dims"):
            array(x)
        return
    y = compare_modules(array, modules, x, xs, leaf, shared=mode == "shared")
    if mode == "shared" and B > 1:
        assert is_shared(y)
    if mode in ("contiguous", "shared"):
        # torch.flatten never copies contiguous memory; neither does the array
        assert y._base is not None and y.data_ptr() == x.data_ptr()
    back = array.to_modules()
    assert [type(m) for m in back] == [nn.Flatten] * B
    assert all((m.start_dim, m.end_dim) == dims for m in back)


def test_flatten_conv_layout_is_a_view():
    N, B, C, H, W = 5, 3, 4, 6, 7
    x = torch.randn(N, B, C, H, W).transpose(0, 1)
    y = Flatten(B=B)(x)
    assert y.shape == (B, N, C * H * W)
    assert y._base is not None and y.data_ptr() == x.data_ptr()  # no copy
    assert y.transpose(0, 1).is_contiguous()
    torch.testing.assert_close(y, torch.stack([nn.Flatten()(x[b]) for b in range(B)]))
    # dims a view cannot merge ([N, B] memory flattened from the sample dim) copy, like torch's
    z = Flatten(0)(x)
    torch.testing.assert_close(z, torch.stack([x[b].flatten() for b in range(B)]))


def test_flatten_bad_inputs():
    m = Flatten(B=3)
    with pytest.raises(ValueError, match=r"B=3.*got shape \[2, "):
        m(torch.randn(2, 4, 5))
    with pytest.raises(ValueError, match="at least 1-D.*got 0-D"):
        m(torch.randn(()))
    with pytest.raises(ValueError, match=r"start_dim=1, end_dim=-1.*1 dims \[4\]"):
        m(torch.randn(3, 4))  # one model's input is 1-D: torch's Flatten() rejects it too
    with pytest.raises(ValueError, match="start_dim=2, end_dim=1"):
        Flatten(2, 1)(torch.randn(3, 4, 5, 6))
    with pytest.raises(TypeError, match="torch.Tensor, got list"):
        m([1.0])
    for bad, exc in ((0, ValueError), (-3, ValueError), (3.0, TypeError), (True, TypeError)):
        with pytest.raises(exc, match="B must be"):
            Flatten(B=bad)
    with pytest.raises(ValueError, match="'end_dim' differs"):
        Flatten.from_modules([nn.Flatten(1, -1), nn.Flatten(1, 2)])


def test_flatten_without_B():
    m = Flatten(2)
    for B in (1, 4):
        assert m(torch.randn(B, 2, 3, 4, 5)).shape == (B, 2, 3, 20)
    assert dict(m.state_dict()) == {}
    with pytest.raises(ValueError, match="array size is unknown"):
        m.to_modules()


# ---------------------------------------------------------------- PReLU

# (num_parameters, one model's input shape)
PRELU_CASES = [
    (1, ()), (1, (7,)), (1, (5, 4)), (1, (5, 4, 3, 6)),
    (4, (5, 4)), (4, (5, 4, 3, 6)), (3, (2, 3, 5)), (3, (2, 3, 4, 3)), (4, (2, 4, 3, 2, 5)),
]


def _prelu_modules(P, B, **kw):
    modules = [nn.PReLU(P, **kw) for _ in range(B)]
    with torch.no_grad():
        for m in modules:  # distinct slopes per model, negative ones too
            m.weight.uniform_(-0.5, 1.0)
    return modules


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("B", [1, 3])
@pytest.mark.parametrize("P,shape", PRELU_CASES, ids=str)
def test_prelu_matches_torch(P, shape, B, mode):
    modules = _prelu_modules(P, B)
    array = PReLU.from_modules(modules)
    assert array.weight.shape == (B, P)
    x, xs, leaf = _input(shape, B, mode)
    y = compare_modules(array, modules, x, xs, leaf, shared=mode == "shared")
    if mode == "batch_major" and len(shape) >= 2:
        assert y.transpose(0, 1).is_contiguous()  # a conv output's memory order survives
    if mode == "shared" and B > 1:
        assert not is_shared(y)
    assert_state_equal(array, modules)


@pytest.mark.parametrize("training", [True, False])
def test_prelu_float64_and_mode(training):
    modules = [m.double().train(training) for m in _prelu_modules(4, 3)]
    array = PReLU.from_modules(modules)
    assert array.weight.dtype == torch.float64 and array.training == training
    x, xs, leaf = array_input((5, 4, 3), 3, layout="batch_major", dtype=torch.float64)
    compare_modules(array, modules, x, xs, leaf, grad_tol=dict(atol=1e-12, rtol=1e-12))
    assert all(m.training == training and m.weight.dtype == torch.float64 for m in array.to_modules())


def test_prelu_init_and_state():
    m = PReLU(3, init=0.1, B=4)
    ref = nn.PReLU(3, init=0.1)
    assert m.weight.shape == (4, 3) and m.weight.requires_grad
    for b in range(4):
        assert torch.equal(m.weight[b], ref.weight.detach())
    assert set(m.state_dict()) == set(ref.state_dict()) == {"weight"}
    assert PReLU(B=2).weight.shape == (2, 1) and (PReLU(B=2).weight == 0.25).all()
    assert PReLU(2, B=2, dtype=torch.float64).weight.dtype == torch.float64
    assert PReLU(2, B=2, device="meta").weight.device.type == "meta"
    back = m.to_modules()
    assert all(isinstance(t, nn.PReLU) and t.num_parameters == 3 and t.init == 0.1 for t in back)
    with torch.no_grad():
        m.weight.uniform_()
    m.reset_parameters()
    assert (m.weight == 0.1).all()


def test_prelu_slopes_per_model():
    # model b's negative inputs are scaled by its own slopes only
    m = PReLU(2, B=3)
    with torch.no_grad():
        m.weight.copy_(torch.tensor([[0.1, 0.2], [0.3, 0.4], [0.5, 0.6]]))
    y = m(-torch.ones(3, 1, 2, 1))
    torch.testing.assert_close(y.flatten(), -m.weight.detach().flatten())
    y = m(torch.ones(3, 1, 2, 1))
    assert (y == 1).all()


def test_prelu_bad_inputs():
    m = PReLU(4, B=3)
    with pytest.raises(ValueError, match=r"B=3.*got shape \[2, "):
        m(torch.randn(2, 5, 4))
    with pytest.raises(ValueError, match=r"expected input with 4 channels at dim 2.*got 3"):
        m(torch.randn(3, 5, 3, 6))
    with pytest.raises(ValueError, match=r"num_parameters=4.*got 1-D per-model"):
        m(torch.randn(3, 4))
    with pytest.raises(ValueError, match=r"num_parameters=4.*got 0-D per-model"):
        m(torch.randn(3))
    with pytest.raises(ValueError, match="at least 1-D"):
        PReLU(B=1)(torch.randn(()))
    with pytest.raises(TypeError, match=r"dtype torch.float32.*got torch.float64"):
        m(torch.randn(3, 5, 4, dtype=torch.float64))
    with pytest.raises(ValueError, match=r"input is on meta but the parameters are on cpu"):
        m(torch.randn(3, 5, 4, device="meta"))
    with pytest.raises(ValueError, match="B=3"):
        m(hfkern.broadcast(torch.randn(5, 4), 2))
    with pytest.raises(TypeError, match="torch.Tensor, got int"):
        m(3)
    with pytest.raises(TypeError, match="required keyword-only argument: .B."):
        PReLU(4)
    for bad, exc in ((0, ValueError), (-1, ValueError), (2.0, TypeError), (False, TypeError)):
        with pytest.raises(exc, match="B must be"):
            PReLU(4, B=bad)
    with pytest.raises(ValueError, match="'num_parameters' differs"):
        PReLU.from_modules([nn.PReLU(2), nn.PReLU(3)])
    # init only sets the initial weights: models whose init differs are one array
    assert PReLU.from_modules([nn.PReLU(2, init=0.1), nn.PReLU(2)]).init == (0.1, 0.25)


def test_compile_fullgraph():
    torch._dynamo.reset()
    modules = _prelu_modules(4, 3)
    model = nn.Sequential(PReLU.from_modules(modules), Flatten(-2), Flatten(B=3))
    compiled = torch.compile(model, fullgraph=True, backend="aot_eager")
    for x in (torch.randn(5, 3, 4, 6, 7).transpose(0, 1), hfkern.broadcast(torch.randn(5, 4, 6, 7), 3)):
        y = compiled(x)
        ref = torch.stack([nn.Flatten()(nn.Flatten(-2)(m(x[b]))) for b, m in enumerate(modules)])
        torch.testing.assert_close(y, ref)


def test_train_eval_round_trip():
    array = Flatten.from_modules([nn.Flatten(0, 1).eval() for _ in range(2)])
    assert not array.training and all(not m.training for m in array.to_modules())
    array = PReLU.from_modules([nn.PReLU(3).eval() for _ in range(2)])
    assert not array.training and all(not m.training for m in array.to_modules())
