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
    with pytest.raises(ValueError, match="'inplace' differs"):
        Dropout.from_modules([nn.Dropout(0.1), nn.Dropout(0.1, inplace=True)])
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


# ---- per-model probabilities ------------------------------------------------------

P_MODELS = [0.1, 0.5, 0.8, 0.5]


@pytest.mark.parametrize("form", ["list", "tuple", "numpy", "tensor", "tensor64"])
@pytest.mark.parametrize("cls", [Dropout, Dropout1d, Dropout2d])
def test_per_model_p_forms(cls, form):
    np = pytest.importorskip("numpy")
    p = {"list": list(P_MODELS), "tuple": tuple(P_MODELS), "numpy": np.array(P_MODELS),
         "tensor": torch.tensor(P_MODELS), "tensor64": torch.tensor(P_MODELS, dtype=torch.float64)}[form]
    m = cls(p, B=4)
    tol = 1e-7 if form == "tensor" else 0  # a float32 tensor holds float32 values
    assert isinstance(m.p, tuple) and len(m.p) == 4
    assert all(abs(a - b) <= tol for a, b in zip(m.p, P_MODELS))
    assert repr(m).startswith(f"{cls.__name__}(B=4, p=(")
    mods = m.to_modules()
    assert [type(t) for t in mods] == [cls._torch_cls] * 4
    assert [t.p for t in mods] == list(m.p)
    # scalars in every spelling stay one probability for all models
    for scalar in (0.3, np.float32(0.25), np.array(0.25), torch.tensor(0.25)):
        assert isinstance(cls(scalar, B=4).p, float)


@pytest.mark.parametrize("cls", [Dropout, Dropout1d, Dropout2d])
def test_per_model_p_bad_values(cls):
    np = pytest.importorskip("numpy")
    with pytest.raises(ValueError, match=r"one value per model \(length B=4\), got 3 values"):
        cls([0.1, 0.2, 0.3], B=4)
    with pytest.raises(ValueError, match=r"between 0 and 1 for every model, but p\[2\] is 1.5"):
        cls([0.1, 0.2, 1.5, 0.0], B=4)
    with pytest.raises(ValueError, match=r"p\[0\] is -0.1"):
        cls(torch.tensor([-0.1, 0.2]), B=2)
    with pytest.raises(ValueError, match=r"p\[1\] is nan"):
        cls([0.1, float("nan")], B=2)
    with pytest.raises(ValueError, match=r"1-D array.*got shape \[2, 1\]"):
        cls(np.zeros((2, 1)), B=2)
    with pytest.raises(TypeError, match="B .*is required"):
        cls([0.1, 0.2])
    with pytest.raises(TypeError, match="one number per model, got str"):
        cls([0.1, "0.2"], B=2)
    with pytest.raises(TypeError, match="got str"):
        cls("0.5", B=2)
    with pytest.raises(TypeError, match="got bool"):
        cls(True, B=2)
    # assigning p validates it the same way
    m = cls(0.2, B=2)
    m.p = np.array([0.1, 0.3])
    assert m.p == (0.1, 0.3)
    with pytest.raises(ValueError, match=r"length B=2\), got 1 values"):
        m.p = [0.1]
    assert m.p == (0.1, 0.3)


def _per_model_units(y, x, p, k):
    """Like ``_units`` with model b's scale 1/(1 - p[b]); returns the [B, units] kept mask."""
    x = x.detach().expand_as(y)
    kept = y != 0
    for b, pb in enumerate(p):
        if pb < 1:
            torch.testing.assert_close(y[b][kept[b]], x[b][kept[b]] / (1 - pb))
    assert (x != 0).all()
    rows = kept.reshape(math.prod(y.shape[:k]), -1)
    assert (rows.all(1) | ~rows.any(1)).all(), "a mask unit is partly dropped"
    return rows[:, 0].reshape(y.shape[0], -1)


@pytest.mark.parametrize("mode", ["contiguous", "batch_major", "strided", "inner_B", "shared"])
@pytest.mark.parametrize("cls,k,shape", [(Dropout, 4, (48, 32, 16)), (Dropout1d, 3, (96, 96, 5)),
                                         (Dropout1d, 2, (4096, 5)), (Dropout2d, 3, (96, 96, 2, 3))])
def test_per_model_p_rates_scales_and_gradients(cls, k, shape, mode):
    B = len(P_MODELS)
    x, leaf = _make(shape, B, mode)
    m = cls(P_MODELS, B=B)
    y = m(x)
    assert y.shape == x.shape and not is_shared(y)
    if mode == "batch_major":
        assert y.transpose(0, 1).is_contiguous()  # the input's memory order is kept
    kept = _per_model_units(y, x, P_MODELS, k)
    n = kept.shape[1]
    for b, pb in enumerate(P_MODELS):
        rate = 1 - kept[b].float().mean().item()
        assert abs(rate - pb) < 6 * math.sqrt(pb * (1 - pb) / n) + 1e-3, (b, rate, pb)
    # models 1 and 3 share p = 0.5: independent draws agree on about half the units
    agree = (kept[1] == kept[3]).float().mean().item()
    assert abs(agree - 0.5) < 6 * math.sqrt(0.25 / n)
    g = torch.randn_like(y)
    y.backward(g)
    scale = torch.tensor([1 / (1 - pb) for pb in P_MODELS]).view(B, *([1] * len(shape)))
    expected = g * (y != 0) * scale
    torch.testing.assert_close(leaf.grad, expected.sum(0) if mode == "shared" else expected)


@pytest.mark.parametrize("B", [1, 4])
@pytest.mark.parametrize("mode", ["contiguous", "batch_major", "shared"])
@pytest.mark.parametrize("cls,shape,k", CASES, ids=IDS)
def test_per_model_p0_and_p1_match_torch(cls, shape, k, mode, B):
    # A model with p = 0 is left alone and one with p = 1 is zeroed, exactly as
    # its own torch module does, forward and backward, whatever the others draw.
    if B == 1 and mode == "shared":
        pytest.skip("a shared input needs B > 1")
    p = [0.0, 1.0, 0.5, 1.0][:B] if B > 1 else [1.0]
    x, leaf = _make(shape, B, mode)
    array = cls(p if B > 1 else torch.tensor(p), B=B)
    assert isinstance(array.p, tuple)
    modules = array.to_modules()
    assert [t.p for t in modules] == p and all(t.training for t in modules)
    y, warned = _record(lambda: array(x))
    _, torch_warned = _record(lambda: modules[0](torch.randn(shape)))
    assert warned == torch_warned  # torch's warnings for this per-model rank
    xs = [x[b].detach().clone().requires_grad_() for b in range(B)]
    g = torch.randn_like(y)
    y.backward(g)
    for b, pb in enumerate(p):
        if pb not in (0.0, 1.0):
            continue
        ref = modules[b](xs[b])
        assert torch.equal(y[b], ref), b
        ref.backward(g[b])
        if mode != "shared":
            assert torch.equal(leaf.grad[b], xs[b].grad), b


@pytest.mark.parametrize("cls,shape,k", [CASES[0], CASES[3], CASES[6]], ids=["Dropout", "Dropout1d", "Dropout2d"])
def test_per_model_p_eval_inplace_and_all_zero(cls, shape, k):
    x = torch.randn(3, *shape)
    m = cls([0.2, 0.6, 0.9], B=3)
    assert m.eval()(x) is x  # the identity in eval, as torch
    assert cls([0.0, 0.0, 0.0], B=3)(x) is x  # nothing to drop
    m.train()
    with pytest.raises(ValueError, match="inplace=True.*shared"):
        cls([0.2, 0.6, 0.9], inplace=True, B=3)(hfkern.broadcast(torch.randn(shape), 3))
    with pytest.raises(ValueError, match=r"B=3.*got shape \[2"):
        m(torch.randn(2, *shape))
    # in place: the input itself, through autograd as torch's in-place dropout on a non-leaf
    leaf = torch.randn(3, *shape, requires_grad=True)
    h = leaf * 1.0
    before = h.detach().clone()
    y = cls([0.2, 0.6, 0.9], inplace=True, B=3)(h)
    assert y is h
    _per_model_units(y, before, [0.2, 0.6, 0.9], k)
    g = torch.randn_like(y)
    y.backward(g)
    scale = torch.tensor([1 / 0.8, 1 / 0.4, 1 / 0.1]).view(3, *([1] * len(shape)))
    torch.testing.assert_close(leaf.grad, g * (y.detach() != 0) * scale)


def test_per_model_p_from_modules_and_round_trip():
    mods = [nn.Dropout1d(0.1), nn.Dropout1d(0.3), nn.Dropout1d(0.1)]
    array = Dropout1d.from_modules(mods)
    assert array.p == (0.1, 0.3, 0.1) and array.B == 3
    assert repr(array) == "Dropout1d(B=3, p=(0.1, 0.3, 0.1), inplace=False)"
    assert [m.p for m in array.to_modules()] == [0.1, 0.3, 0.1]
    same = Dropout1d.from_modules([nn.Dropout1d(0.2)] * 3)
    assert same.p == 0.2  # one probability stays one float


@pytest.mark.parametrize("cls,shape,k", [CASES[0], CASES[3], CASES[5]], ids=["Dropout", "Dropout1d", "Dropout2d"])
def test_per_model_p_compile_fullgraph(cls, shape, k):
    torch._dynamo.reset()
    p = [0.0, 0.5, 1.0]
    m = cls(p, B=3)
    compiled = torch.compile(m, fullgraph=True, backend="aot_eager")
    for mode in ("batch_major", "shared"):
        x, leaf = _make(shape, 3, mode)
        y = compiled(x)
        _per_model_units(y, x, p, k)
        assert torch.equal(y[0], x[0].detach()) and (y[2] == 0).all()
        y.backward(torch.ones_like(y))
        expected = (y != 0) * torch.tensor([1.0, 2.0, 0.0]).view(3, *([1] * len(shape)))
        torch.testing.assert_close(leaf.grad, expected.sum(0) if mode == "shared" else expected)
