import pytest
import torch
from torch import nn

import hfkern
from hfkern._array import is_shared
from hfkern.nn.pooling import (
    AdaptiveAvgPool1d, AdaptiveAvgPool2d, AvgPool1d, AvgPool2d, MaxPool1d, MaxPool2d,
)
from _util import array_input, compare_modules

# (array class, constructor kwargs, one model's input shape); shapes with n+1
# dims are the namesake's unbatched form.
CASES = [
    (MaxPool1d, dict(kernel_size=3), (5, 4, 11)),
    (MaxPool1d, dict(kernel_size=3, stride=2, padding=1, dilation=2, ceil_mode=True,
                     return_indices=True), (5, 4, 13)),
    (MaxPool1d, dict(kernel_size=2, return_indices=True), (4, 9)),
    (MaxPool2d, dict(kernel_size=(3, 2), stride=(2, 1), padding=(1, 0), dilation=(1, 2),
                     return_indices=True), (5, 4, 9, 8)),
    (MaxPool2d, dict(kernel_size=3, stride=2, ceil_mode=True), (3, 4, 11, 7)),
    (MaxPool2d, dict(kernel_size=2, return_indices=True), (4, 7, 9)),
    (AvgPool1d, dict(kernel_size=3, stride=2, padding=1, ceil_mode=True, count_include_pad=False),
     (5, 4, 12)),
    (AvgPool1d, dict(kernel_size=4, padding=2), (4, 11)),
    (AvgPool2d, dict(kernel_size=(3, 2), stride=(2, 1), padding=1, ceil_mode=True,
                     count_include_pad=False), (5, 4, 9, 8)),
    (AvgPool2d, dict(kernel_size=3, padding=1, divisor_override=5), (3, 4, 7, 9)),
    (AvgPool2d, dict(kernel_size=2), (4, 7, 9)),
    (AdaptiveAvgPool1d, dict(output_size=4), (5, 4, 11)),
    (AdaptiveAvgPool1d, dict(output_size=5), (4, 7)),
    (AdaptiveAvgPool2d, dict(output_size=(3, None)), (5, 4, 9, 8)),
    (AdaptiveAvgPool2d, dict(output_size=(None, 4)), (4, 7, 9)),
    (AdaptiveAvgPool2d, dict(output_size=1), (5, 4, 9, 8)),
]
IDS = [f"{c.__name__}-{i}" for i, (c, _, _) in enumerate(CASES)]


def _first(m, inp):
    return m(inp)[0]


@pytest.mark.parametrize("mode", ["contiguous", "batch_major", "strided", "shared"])
@pytest.mark.parametrize("B", [1, 3])
@pytest.mark.parametrize("cls,kw,shape", CASES, ids=IDS)
def test_pool_matches_torch(cls, kw, shape, B, mode):
    _check_pool(cls, kw, shape, B, mode, training=True)


@pytest.mark.parametrize("mode", ["batch_major", "shared"])
@pytest.mark.parametrize("cls,kw,shape", CASES, ids=IDS)
def test_pool_eval_matches_torch(cls, kw, shape, mode):
    _check_pool(cls, kw, shape, 3, mode, training=False)


def _check_pool(cls, kw, shape, B, mode, training):
    modules = [cls._torch_cls(**kw).train(training) for _ in range(B)]
    array = cls.from_modules(modules)
    assert array.B == B and array.training == training
    shared = mode == "shared"
    x, xs, leaf = array_input(shape, B, shared=shared, layout="contiguous" if shared else mode)
    with_indices = kw.get("return_indices", False)
    y = compare_modules(array, modules, x, xs, leaf, call=_first if with_indices else None,
                        shared=shared)
    if with_indices:
        out, idx = array(x)
        ref = torch.stack([m(xb)[1] for m, xb in zip(modules, xs)])
        assert idx.dtype == ref.dtype and torch.equal(idx, ref)
        assert idx.shape == out.shape
    if mode == "batch_major":
        # [N, B, ...] memory in, [N, B, ...] memory out: the next conv reads it as is.
        assert y.transpose(0, 1).is_contiguous()
    if shared and B > 1:
        # pooled once for every model where nothing differentiates the input; with its
        # gradient, each model's own (tests/test_shared_input_grads.py)
        assert not is_shared(y)
        with torch.no_grad():
            once = array(x)
        assert is_shared(once[0] if with_indices else once)
    for m in array.to_modules():
        assert type(m) is cls._torch_cls
        assert repr(m) == repr(modules[0])
        assert m.training == training


@pytest.mark.parametrize("cls,kw", [(MaxPool2d, dict(kernel_size=2)), (AvgPool2d, dict(kernel_size=3, stride=1)),
                                    (AdaptiveAvgPool2d, dict(output_size=(2, 3)))])
def test_conv_layout_survives_pooling(cls, kw):
    conv = hfkern.nn.Conv2d(3, 4, 3, B=3)
    h = conv(torch.randn(3, 5, 3, 10, 9))
    assert h.transpose(0, 1).is_contiguous()
    y = cls(**kw, B=3)(h)
    assert y.transpose(0, 1).is_contiguous()
    ref = torch.stack([cls._torch_cls(**kw)(h[b]) for b in range(3)])
    torch.testing.assert_close(y, ref)


def test_shared_indices_match_torch():
    base = torch.randn(2, 3, 9, 8)
    x = hfkern.broadcast(base, 4)
    out, idx = MaxPool2d(3, stride=2, padding=1, return_indices=True, B=4)(x)
    ref_out, ref_idx = nn.MaxPool2d(3, stride=2, padding=1, return_indices=True)(base)
    assert out.shape == (4, *ref_out.shape) and idx.shape == (4, *ref_idx.shape)
    for b in range(4):
        assert torch.equal(out[b], ref_out) and torch.equal(idx[b], ref_idx)


def test_models_pooled_independently():
    # Each model's plane is pooled from its own input: swapping two models'
    # inputs swaps their outputs and nothing else.
    x = torch.randn(3, 2, 4, 8, 8)
    m = MaxPool2d(2)
    y = m(x)
    y_swapped = m(x[[1, 0, 2]])
    torch.testing.assert_close(y_swapped, y[[1, 0, 2]])
    assert not torch.equal(y[0], y[1])


def test_stateless_without_B_accepts_any_array_size():
    m = AvgPool1d(3)
    assert m.B is None and dict(m.state_dict()) == {}
    for B in (1, 2, 5):
        x = torch.randn(B, 2, 3, 10)
        torch.testing.assert_close(m(x), torch.stack([nn.AvgPool1d(3)(x[b]) for b in range(B)]))
    with pytest.raises(ValueError, match="array size is unknown"):
        m.to_modules()


def test_from_modules_config():
    mods = [nn.MaxPool2d(3, stride=None, padding=1, ceil_mode=True) for _ in range(2)]
    array = MaxPool2d.from_modules(mods)
    assert (array.kernel_size, array.stride, array.padding, array.ceil_mode) == (3, 3, 1, True)
    mods = [nn.AvgPool1d(3), nn.AvgPool1d(3, stride=2)]
    with pytest.raises(ValueError, match="'stride' differs"):
        AvgPool1d.from_modules(mods)
    with pytest.raises(TypeError, match="torch.nn.AdaptiveAvgPool2d"):
        AdaptiveAvgPool2d.from_modules([nn.AdaptiveAvgPool1d(3)])
    mods = [nn.AvgPool2d(2, divisor_override=3).eval() for _ in range(3)]
    back = AvgPool2d.from_modules(mods).to_modules()
    assert len(back) == 3 and all(repr(m) == repr(mods[0]) and not m.training for m in back)
    assert back[0].divisor_override == 3


@pytest.mark.parametrize("cls,kw,n", [(MaxPool1d, dict(kernel_size=2), 1), (MaxPool2d, dict(kernel_size=2), 2),
                                      (AvgPool1d, dict(kernel_size=2), 1), (AvgPool2d, dict(kernel_size=2), 2),
                                      (AdaptiveAvgPool1d, dict(output_size=2), 1),
                                      (AdaptiveAvgPool2d, dict(output_size=2), 2)])
def test_bad_inputs(cls, kw, n):
    m = cls(**kw, B=3)
    with pytest.raises(ValueError, match=r"B=3.*got shape \[2, "):
        m(torch.randn(2, 2, 3, *[6] * n))
    for rank in (n + 1, n + 4):
        with pytest.raises(ValueError, match=rf"expected input of {n + 2}-D or {n + 3}-D.*got {rank}-D"):
            m(torch.randn(*[3] * rank))
    with pytest.raises(TypeError, match="torch.Tensor, got list"):
        m([[1.0]])
    # A shared input is checked like any other.
    with pytest.raises(ValueError, match="B=3"):
        m(hfkern.broadcast(torch.randn(2, 3, *[6] * n), 2))


@pytest.mark.parametrize("bad,exc", [(0, ValueError), (-2, ValueError), (2.0, TypeError),
                                     (True, TypeError), ("3", TypeError)])
def test_bad_B(bad, exc):
    for cls, args in ((MaxPool2d, (2,)), (AvgPool1d, (2,)), (AdaptiveAvgPool2d, (3,))):
        with pytest.raises(exc, match="B must be"):
            cls(*args, B=bad)


def test_torch_config_errors_surface():
    # Invalid pooling arguments are torch's to reject, at the first call as for the namesake.
    x = torch.randn(2, 3, 4, 9, 9)
    with pytest.raises(RuntimeError, match="pad should"):
        nn.MaxPool2d(2, padding=2)(x[0])
    with pytest.raises(RuntimeError, match="pad should"):
        MaxPool2d(2, padding=2)(x)


def test_compile_fullgraph():
    torch._dynamo.reset()
    model = nn.Sequential(MaxPool2d(2, padding=1, B=3), AvgPool2d(2, ceil_mode=True), AdaptiveAvgPool2d((2, None)))
    compiled = torch.compile(model, fullgraph=True, backend="aot_eager")
    for x in (torch.randn(5, 3, 4, 9, 8).transpose(0, 1), hfkern.broadcast(torch.randn(5, 4, 9, 8), 3)):
        y = compiled(x)
        torch.testing.assert_close(y, model(x))
        assert y.shape == (3, 5, 4, 2, 3)
    x = torch.randn(2, 4, 10)
    out, idx = torch.compile(MaxPool1d(3, return_indices=True), fullgraph=True, backend="aot_eager")(x)
    ref = [nn.MaxPool1d(3, return_indices=True)(x[b]) for b in range(2)]
    assert torch.equal(idx, torch.stack([r[1] for r in ref]))
