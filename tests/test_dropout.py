import math
import warnings

import pytest
import torch
from torch import nn

import hfkern
from hfkern._array import is_shared
from hfkern.nn.dropout import Dropout, Dropout1d, Dropout2d
from _util import array_input, compare_modules

# (array class, one model's input shape, k): a mask is drawn per index of the
# array input's first k dims and shared along the rest, which is what torch's
# namesake does per model (per element; per (sample, channel); for a 3-D input
# to dropout2d per (dim 0, dim 1), i.e. rows along the last dim).
CASES = [
    (Dropout, (5, 4, 6, 7), 5),
    (Dropout, (7,), 2),
    (Dropout, (), 1),
    (Dropout1d, (6, 5, 9), 3),
    (Dropout1d, (7, 9), 2),
    (Dropout2d, (6, 5, 4, 3), 3),
    (Dropout2d, (5, 6, 7), 3),
    (Dropout2d, (6, 7), 3),
    (Dropout2d, (4, 5, 2, 3, 3), 3),
]
IDS = [f"{c.__name__}-{len(s)}d" for c, s, _ in CASES]
P = 0.4

# torch's deprecation warnings for some dropout2d ranks are expected; tests that
# care record them explicitly.
pytestmark = pytest.mark.filterwarnings("ignore:dropout2d:UserWarning")


def _make(shape, B, mode, requires_grad=True):
    shared = mode == "shared"
    if not shape and mode in ("batch_major", "strided"):
        pytest.skip("a 0-d model input has no dim to permute or stride")
    if mode == "inner_B":
        # B varies fastest after the last dim: [B, N, ...] dims that no view can merge,
        # so folding the array dim has to copy.
        data = torch.randn(*shape[:-1], B, shape[-1]).movedim(-2, 0)
        leaf = data.requires_grad_(requires_grad)
        return leaf, leaf
    if shared:
        leaf = torch.randn(shape).requires_grad_(requires_grad)
        return hfkern.broadcast(leaf, B), leaf
    x, _, leaf = array_input(shape, B, layout=mode, requires_grad=requires_grad)
    return x, leaf


def _units(y, x, p, k):
    """Check ``y`` is ``0`` or ``x / (1 - p)`` entry by entry, constant per mask unit;
    return the [B, units] kept mask."""
    x = x.detach().expand_as(y)
    kept = y != 0
    torch.testing.assert_close(y[kept], x[kept] / (1 - p))
    assert (x != 0).all()  # a zero input would hide a kept entry
    rows = kept.reshape(math.prod(y.shape[:k]), -1)
    assert (rows.all(1) | ~rows.any(1)).all(), "a mask unit is partly dropped"
    return rows[:, 0].reshape(y.shape[0], -1)


def _record(fn):
    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter("always")
        out = fn()
    return out, sorted({str(m.message) for m in w})


@pytest.mark.parametrize("mode", ["contiguous", "batch_major", "strided", "inner_B", "shared"])
@pytest.mark.parametrize("B", [1, 3])
@pytest.mark.parametrize("cls,shape,k", CASES, ids=IDS)
def test_train_masks(cls, shape, k, B, mode):
    if mode == "inner_B" and len(shape) < 2:
        pytest.skip("needs two per-model dims")
    x, leaf = _make(shape, B, mode)
    m = cls(P, B=B)
    before = x.detach().clone()
    y, warned = _record(lambda: m(x))
    assert torch.equal(x, before)  # not in place: the input is left alone
    # torch's own warnings for this per-model rank, no more and no fewer
    _, torch_warned = _record(lambda: cls._torch_cls(P)(torch.randn(shape)))
    assert warned == torch_warned
    assert y.shape == x.shape and y.dtype == x.dtype
    kept = _units(y, x, P, k)
    g = torch.randn_like(y)
    y.backward(g)
    expected = g * (y != 0) / (1 - P)
    torch.testing.assert_close(leaf.grad, expected.sum(0) if mode == "shared" else expected)
    if mode == "batch_major" and len(shape) >= 2:
        assert y.transpose(0, 1).is_contiguous()
    if mode == "shared":
        assert not is_shared(y) and y.stride(0) != 0
    if kept.shape[1] >= 20:  # enough draws per model that equal masks mean a bug
        assert 0 < kept.sum() < kept.numel()
        if B > 1:
            # every model draws its own masks, also from one shared input
            assert not torch.equal(kept[0], kept[1]) and not torch.equal(kept[1], kept[2])


@pytest.mark.parametrize("cls,shape,k", CASES, ids=IDS)
def test_masks_differ_across_samples_and_channels(cls, shape, k):
    if k < 3:
        pytest.skip("no sample/channel structure")
    x = torch.randn(2, *shape)
    y = cls(P, B=2)(x)
    _units(y, x, P, k)
    kept = (y != 0).reshape(*y.shape[:k], -1)[..., 0]
    # per (sample, channel) draws within one model, not one draw per model
    assert not (kept[0].all() or (~kept[0]).all())
    assert not torch.equal(kept[0, 0], kept[0, 1])


@pytest.mark.parametrize("cls,k,shape", [(Dropout, 4, (64, 32, 16)), (Dropout1d, 3, (64, 64, 8)),
                                         (Dropout2d, 3, (64, 64, 2, 2))])
@pytest.mark.parametrize("p", [0.2, 0.7])
def test_kept_fraction(cls, k, shape, p):
    x = torch.randn(3, *shape)
    kept = _units(cls(p)(x), x, p, k)
    assert abs(kept.float().mean().item() - (1 - p)) < 0.03
    for b in range(3):
        assert abs(kept[b].float().mean().item() - (1 - p)) < 0.05


@pytest.mark.parametrize("mode", ["contiguous", "batch_major", "shared"])
@pytest.mark.parametrize("inplace", [False, True])
@pytest.mark.parametrize("cls,shape,k", CASES, ids=IDS)
def test_eval_is_identity_like_torch(cls, shape, k, inplace, mode):
    B = 3
    modules = [cls._torch_cls(P, inplace).eval() for _ in range(B)]
    array = cls.from_modules(modules)
    assert not array.training and array.inplace == inplace and array.p == P
    x, leaf = _make(shape, B, mode)
    y, warned = _record(lambda: array(x))
    assert y is x  # torch returns its input itself
    _, torch_warned = _record(lambda: modules[0](torch.randn(shape)))
    assert warned == torch_warned
    # non-leaf model inputs: torch's in-place dropout1d reshapes a 2-D input in place even in eval
    xs = [x[b].detach().clone().requires_grad_() * 1.0 for b in range(B)]
    compare_modules(array, modules, x, xs, leaf, shared=mode == "shared")


@pytest.mark.parametrize("mode", ["contiguous", "shared"])
@pytest.mark.parametrize("cls,shape,k", CASES, ids=IDS)
def test_p0_and_p1(cls, shape, k, mode):
    x, leaf = _make(shape, 3, mode)
    assert cls(0.0, B=3)(x) is x
    y = cls(1.0, B=3)(x)
    assert y.shape == x.shape and (y == 0).all() and not is_shared(y)
    y.backward(torch.randn_like(y))
    assert (leaf.grad == 0).all()


@pytest.mark.parametrize("mode", ["contiguous", "batch_major", "strided", "inner_B"])
@pytest.mark.parametrize("cls,shape,k", CASES, ids=IDS)
def test_inplace(cls, shape, k, mode):
    if mode == "inner_B" and len(shape) < 2:
        pytest.skip("needs two per-model dims")
    x, _ = _make(shape, 3, mode, requires_grad=False)
    before = x.clone()
    strides = x.stride()
    y = cls(P, inplace=True, B=3)(x)
    assert y is x and x.stride() == strides
    kept = _units(x, before, P, k)
    assert 0 < kept.sum() < kept.numel()
    # and through autograd, as torch's in-place dropout on a non-leaf
    leaf, _ = _make(shape, 3, mode)
    h = leaf * 1.0
    y = cls(P, inplace=True, B=3)(h)
    assert y is h
    g = torch.randn_like(y)
    y.backward(g)
    torch.testing.assert_close(leaf.grad, g * (y.detach() != 0) / (1 - P))


@pytest.mark.parametrize("cls,shape,k", CASES, ids=IDS)
def test_inplace_on_shared_input(cls, shape, k):
    x = hfkern.broadcast(torch.randn(shape), 3)
    m = cls(P, inplace=True, B=3)
    with pytest.raises(ValueError, match="inplace=True.*shared"):
        m(x)
    assert m.eval()(x) is x  # nothing to write in eval
    assert cls(0.0, inplace=True)(x) is x


def test_inplace_on_leaf_is_torch_error():
    x = torch.randn(3, 4, 5, 6, requires_grad=True)
    with pytest.raises(RuntimeError, match="leaf Variable"):
        nn.Dropout1d(P, inplace=True)(x[0])
    with pytest.raises(RuntimeError, match="leaf Variable"):
        Dropout1d(P, inplace=True)(x)


def test_from_modules_to_modules():
    mods = [nn.Dropout2d(0.3, inplace=True) for _ in range(3)]
    array = Dropout2d.from_modules(mods)
    assert (array.B, array.p, array.inplace, array.training) == (3, 0.3, True, True)
    assert dict(array.state_dict()) == {}
    back = array.eval().to_modules()
    assert [type(m) for m in back] == [nn.Dropout2d] * 3
    assert all(m.p == 0.3 and m.inplace and not m.training for m in back)
    with pytest.raises(ValueError, match="'p' differs"):
        Dropout.from_modules([nn.Dropout(0.1), nn.Dropout(0.2)])
    with pytest.raises(ValueError, match="'training' differs"):
        Dropout.from_modules([nn.Dropout(0.1), nn.Dropout(0.1).eval()])
    with pytest.raises(TypeError, match="torch.nn.Dropout1d"):
        Dropout1d.from_modules([nn.Dropout2d()])
    with pytest.raises(ValueError, match="array size is unknown"):
        Dropout().to_modules()


@pytest.mark.parametrize("cls,bad_ranks,ok", [(Dropout1d, (1, 4), "3-D or 4-D"),
                                              (Dropout2d, (0, 1), "at least 3-D"),
                                              (Dropout, (-1,), "at least 1-D")])
def test_bad_inputs(cls, bad_ranks, ok):
    m = cls(P, B=3)
    with pytest.raises(ValueError, match=r"B=3.*got shape \[2, "):
        m(torch.randn(2, 4, 5, 6))
    with pytest.raises(ValueError, match="B=3"):
        m(hfkern.broadcast(torch.randn(4, 5, 6), 2))
    for r in bad_ranks:
        with pytest.raises(ValueError, match=rf"expected input of {ok}.*got {r + 1}-D"):
            m(torch.randn([3] * (r + 1)))
    with pytest.raises(TypeError, match="torch.Tensor, got float"):
        m(1.0)


@pytest.mark.parametrize("cls", [Dropout, Dropout1d, Dropout2d])
def test_bad_config(cls):
    for p in (-0.1, 1.5):
        with pytest.raises(ValueError, match="dropout probability"):
            cls(p)
    for bad, exc in ((0, ValueError), (-1, ValueError), (1.0, TypeError), (True, TypeError)):
        with pytest.raises(exc, match="B must be"):
            cls(P, B=bad)


@pytest.mark.parametrize("cls,shape,k", [CASES[0], CASES[3], CASES[5]], ids=["Dropout", "Dropout1d", "Dropout2d"])
def test_compile_fullgraph(cls, shape, k):
    torch._dynamo.reset()
    m = cls(P, B=3)
    compiled = torch.compile(m, fullgraph=True, backend="aot_eager")
    for mode in ("batch_major", "shared"):
        x, leaf = _make(shape, 3, mode)
        y = compiled(x)
        kept = _units(y, x, P, k)
        assert not torch.equal(kept[0], kept[1])
        y.backward(torch.ones_like(y))
        expected = (y != 0) / (1 - P)
        torch.testing.assert_close(leaf.grad, expected.sum(0) if mode == "shared" else expected)
    m.eval()
    x = torch.randn(3, *shape)
    assert torch.equal(torch.compile(m, fullgraph=True, backend="aot_eager")(x), x)
