"""Array losses against a loop of torch.nn.functional calls, one per model."""

import pytest
import torch
import torch.nn.functional as F

import hfkern
import hfkern.nn.functional as HF
from _util import GRAD_TOL, array_input

REDUCTIONS = ["mean", "sum", "none"]
LAYOUTS = ["contiguous", "batch_major", "strided"]


def model_grads(leaves_per_model, refs, cotangent):
    """Per model b: gradients of refs[b] (weighted by cotangent[b]) w.r.t. its leaves."""
    return [torch.autograd.grad(r, leaves, c, allow_unused=True)
            for r, leaves, c in zip(refs, leaves_per_model, cotangent)]


def compare(out, refs, array_leaves, model_leaves):
    """``out`` against ``torch.stack(refs)``, then gradients of both.

    ``array_leaves``: ``[(tensor, shared)]``, the array call's leaves; a shared
    leaf's gradient is the sum of the models' gradients, a per-model leaf's
    slice b is model b's gradient. ``model_leaves[b]``: model b's matching leaves.
    """
    expected = torch.stack(refs)
    assert out.shape == expected.shape, (out.shape, expected.shape)
    torch.testing.assert_close(out, expected, equal_nan=True)
    # A random positive weight per loss element, so that a gradient leaking
    # into another model or losing its scale is seen.
    cot = torch.rand_like(expected) + 0.5
    got = torch.autograd.grad(out, [t for t, _ in array_leaves], cot, allow_unused=True)
    ref = model_grads(model_leaves, refs, cot)
    for i, (leaf, shared) in enumerate(array_leaves):
        per_model = [r[i] if r[i] is not None else torch.zeros_like(model_leaves[b][i])
                     for b, r in enumerate(ref)]
        want = sum(per_model) if shared else torch.stack(per_model)
        assert got[i] is not None
        torch.testing.assert_close(got[i], want, **GRAD_TOL)


def with_ignored(t, ignore_index, per_model):
    """Put ignore_index at ~30% of the positions, keeping one real target per model."""
    t = t.clone()
    t[torch.rand(t.shape) < 0.3] = ignore_index
    flat = t.view(t.shape[0], -1) if per_model else t.view(1, -1)
    if flat.numel():
        flat[:, 0] = 0
    return t


# ---- cross_entropy / nll_loss -------------------------------------------------

# per-model input shapes: unbatched [C], [N, C], K-dim [N, C, d1, d2]
CLASS_SHAPES = [(7,), (5, 7), (5, 7, 3, 2)]


def class_weight(mode, B, C):
    if mode == "none":
        return None, [None] * B
    if mode == "shared":
        w = torch.rand(C) + 0.1
        return w, [w] * B
    w = torch.rand(B, C) + 0.1
    return w, list(w)


def index_target(shape, B, C, mode, ignore_index):
    tshape = (shape[0], *shape[2:]) if len(shape) > 1 else ()
    if mode == "shared":
        t = with_ignored(torch.randint(0, C, tshape), ignore_index, per_model=False) if tshape else \
            torch.tensor(0)
        return t, [t] * B
    t = with_ignored(torch.randint(0, C, (B, *tshape)), ignore_index, per_model=True)
    if not tshape and B > 1:
        t[1] = ignore_index  # an unbatched model whose only target is ignored: NaN mean
    return t, list(t)


def prob_target(shape, B, mode):
    cdim = 0 if len(shape) == 1 else 1
    if mode == "shared":
        t = torch.randn(shape).softmax(cdim)
        return t, [t] * B
    t = torch.randn(B, *shape).softmax(cdim + 1)
    return t, list(t)


# (reduction, layout, label_smoothing, B): every reduction, layout and B, and
# smoothing with each reduction, run for each combination of the parametrized options.
CLASS_VARIANTS = [
    ("mean", "contiguous", 0.25, 3),
    ("mean", "batch_major", 0.0, 3),
    ("sum", "strided", 0.25, 3),
    ("sum", "batch_major", 0.0, 1),
    ("none", "strided", 0.0, 3),
    ("none", "contiguous", 0.25, 1),
]


def class_variants(shape, smoothing=True):
    for reduction, layout, label_smoothing, B in CLASS_VARIANTS:
        if layout == "batch_major" and len(shape) == 1:
            layout = "contiguous"  # unbatched models have no batch dim
        yield reduction, layout, label_smoothing if smoothing else 0.0, B


@pytest.mark.parametrize("weight_mode", ["none", "shared", "per_model"])
@pytest.mark.parametrize("target_mode", ["shared", "per_model"])
@pytest.mark.parametrize("kind,ignore_index", [("index", -100), ("index", 2), ("prob", -100)])
@pytest.mark.parametrize("shape", CLASS_SHAPES)
def test_cross_entropy(shape, kind, ignore_index, target_mode, weight_mode):
    C = shape[0] if len(shape) == 1 else shape[1]
    for reduction, layout, label_smoothing, B in class_variants(shape):
        weight, ws = class_weight(weight_mode, B, C)
        if kind == "index":
            target, ts = index_target(shape, B, C, target_mode, ignore_index)
        else:
            target, ts = prob_target(shape, B, target_mode)
        x, xs, leaf = array_input(shape, B, layout=layout)
        out = HF.cross_entropy(x, target, weight, ignore_index=ignore_index, reduction=reduction,
                               label_smoothing=label_smoothing)
        refs = [F.cross_entropy(xs[b], ts[b], ws[b], ignore_index=ignore_index, reduction=reduction,
                                label_smoothing=label_smoothing) for b in range(B)]
        compare(out, refs, [(leaf, False)], [[xb] for xb in xs])


@pytest.mark.parametrize("weight_mode", ["none", "shared", "per_model"])
@pytest.mark.parametrize("target_mode", ["shared", "per_model"])
@pytest.mark.parametrize("ignore_index", [-100, 2])
@pytest.mark.parametrize("shape", CLASS_SHAPES)
def test_nll_loss(shape, ignore_index, target_mode, weight_mode):
    C = shape[0] if len(shape) == 1 else shape[1]
    for reduction, layout, _, B in class_variants(shape, smoothing=False):
        weight, ws = class_weight(weight_mode, B, C)
        target, ts = index_target(shape, B, C, target_mode, ignore_index)
        x, xs, leaf = array_input(shape, B, layout=layout)
        out = HF.nll_loss(x, target, weight, ignore_index=ignore_index, reduction=reduction)
        refs = [F.nll_loss(xs[b], ts[b], ws[b], ignore_index=ignore_index, reduction=reduction)
                for b in range(B)]
        compare(out, refs, [(leaf, False)], [[xb] for xb in xs])


@pytest.mark.parametrize("fn", ["cross_entropy", "nll_loss"])
@pytest.mark.parametrize("weight_mode", ["none", "shared", "per_model"])
@pytest.mark.parametrize("label_smoothing", [0.0, 0.3])
def test_all_ignored_model_is_nan(fn, weight_mode, label_smoothing):
    if fn == "nll_loss" and label_smoothing:
        pytest.skip("nll_loss has no label smoothing")
    B, N, C = 3, 4, 5
    kw = {} if fn == "nll_loss" else {"label_smoothing": label_smoothing}
    weight, ws = class_weight(weight_mode, B, C)
    target = torch.randint(0, C, (B, N))
    target[1] = -100
    x, xs, leaf = array_input((N, C), B)
    out = getattr(HF, fn)(x, target, weight, **kw)
    refs = [getattr(F, fn)(xs[b], target[b], ws[b], **kw) for b in range(B)]
    assert torch.isnan(out[1]) and torch.isfinite(out[[0, 2]]).all()
    compare(out, refs, [(leaf, False)], [[xb] for xb in xs])
    # torch gives the all-ignored model a zero gradient, not NaN
    g, = torch.autograd.grad(HF.cross_entropy(x, target, weight).nansum(), leaf) if fn == "cross_entropy" \
        else torch.autograd.grad(HF.nll_loss(x, target, weight).nansum(), leaf)
    assert torch.equal(g[1], torch.zeros_like(g[1]))


def test_cross_entropy_empty_batch_is_nan():
    B, C = 2, 3
    for target in (torch.zeros(0, dtype=torch.long), torch.rand(0, C)):
        out = HF.cross_entropy(torch.randn(B, 0, C), target)
        ref = F.cross_entropy(torch.randn(0, C), target)
        assert out.shape == (B,) and torch.isnan(ref) and torch.isnan(out).all()


def test_losses_sum_backward_gives_each_model_its_gradient():
    B, N, C = 3, 5, 7
    x = torch.randn(B, N, C, requires_grad=True)
    target = with_ignored(torch.randint(0, C, (B, N)), -100, per_model=True)
    weight = torch.rand(B, C) + 0.1
    HF.cross_entropy(x, target, weight, label_smoothing=0.1).sum().backward()
    for b in range(B):
        xb = x[b].detach().clone().requires_grad_()
        F.cross_entropy(xb, target[b], weight[b], label_smoothing=0.1).backward()
        torch.testing.assert_close(x.grad[b], xb.grad, **GRAD_TOL)


def test_class_targets_non_contiguous_and_broadcast():
    B, N, C, d = 3, 5, 4, 6
    x, xs, leaf = array_input((N, C, d), B, layout="batch_major")
    per_model = torch.randint(0, C, (B, d, N)).transpose(1, 2)  # [B, N, d], non-contiguous
    shared = torch.randint(0, C, (N, d))
    probs = torch.randn(B, N, d, C).softmax(-1).movedim(-1, 2)  # [B, N, C, d], non-contiguous
    for target, ts in ((per_model, list(per_model)), (hfkern.broadcast(shared, B), [shared] * B),
                       (probs, list(probs))):
        out = HF.cross_entropy(x, target, reduction="none", label_smoothing=0.2)
        refs = [F.cross_entropy(xs[b], ts[b], reduction="none", label_smoothing=0.2) for b in range(B)]
        compare(out, refs, [(leaf, False)], [[xb] for xb in xs])


def test_cross_entropy_shared_input_and_prob_target_grad():
    B, N, C = 3, 5, 4
    x, xs, leaf = array_input((N, C), B, shared=True)
    target = torch.randn(B, N, C).softmax(-1).requires_grad_()
    ts = [target[b].detach().clone().requires_grad_() for b in range(B)]
    weight = torch.rand(B, C) + 0.1
    out = HF.cross_entropy(x, target, weight, label_smoothing=0.1)
    refs = [F.cross_entropy(xs[b], ts[b], weight[b], label_smoothing=0.1) for b in range(B)]
    compare(out, refs, [(leaf, True), (target, False)], [[xs[b], ts[b]] for b in range(B)])


def test_cross_entropy_integer_target_dtypes():
    B, N, C = 2, 5, 4
    x = torch.randn(B, N, C)
    t = torch.randint(0, C, (B, N))
    want = HF.cross_entropy(x, t)
    for dtype in (torch.int32, torch.uint8):
        torch.testing.assert_close(HF.cross_entropy(x, t.to(dtype)), want)


@pytest.mark.parametrize("fn", [HF.cross_entropy, HF.nll_loss])
@pytest.mark.parametrize("weight_mode", [None, "shared", "per_model"])
def test_out_of_range_class_index_raises_index_error(fn, weight_mode):
    # torch raises IndexError on the CPU (per-model weights gathered past the
    # classes and raised an obscure RuntimeError naming an internal dimension)
    x = torch.randn(2, 3, 4)
    weight = {None: None, "shared": torch.rand(4), "per_model": torch.rand(2, 4)}[weight_mode]
    for t, bad in ((torch.tensor([[0, 1, 4], [0, 1, 2]]), 4), (torch.tensor([[0, 1, 2], [0, -2, 1]]), -2),
                   (torch.tensor([0, 9, 1]), 9)):
        with pytest.raises(IndexError, match=str(bad)) as info:
            fn(x, t, weight)
        if weight_mode == "per_model":
            where = "the shared input" if t.dim() == 1 else "model 0" if bad == 4 else "model 1"
            assert where in str(info.value)
    # ignore_index is not a class: it is skipped, not refused
    fn(x, torch.tensor([[0, -100, 1], [2, 3, -100]]), weight)


def test_out_of_range_class_index_under_compile_raises_index_error():
    weight = torch.rand(2, 4)
    loss = torch.compile(lambda x, t: HF.cross_entropy(x, t, weight), fullgraph=True, backend="eager")
    x = torch.randn(2, 3, 4)
    torch.testing.assert_close(loss(x, torch.tensor([0, 3, 1])), HF.cross_entropy(x, torch.tensor([0, 3, 1]), weight))
    with pytest.raises(IndexError, match="target 7"):
        loss(x, torch.tensor([0, 7, 1]))


# ---- mse_loss / l1_loss ------------------------------------------------------------

@pytest.mark.parametrize("B", [1, 3])
@pytest.mark.parametrize("target_mode", ["shared", "per_model"])
@pytest.mark.parametrize("shape", [(), (5,), (5, 3, 2)])
@pytest.mark.parametrize("fn", ["mse_loss", "l1_loss"])
def test_elementwise_losses(fn, shape, target_mode, B):
    for reduction, layout in zip(REDUCTIONS, LAYOUTS):
        if not shape:
            layout = "contiguous"  # a scalar per model has no dim to lay out
        x, xs, leaf = array_input(shape, B, layout=layout)
        if target_mode == "shared":
            target = torch.randn(shape).requires_grad_()
            ts = [target.detach().clone().requires_grad_() for _ in range(B)]
        else:
            target = torch.randn(B, *shape).requires_grad_()
            ts = [target[b].detach().clone().requires_grad_() for b in range(B)]
        out = getattr(HF, fn)(x, target, reduction=reduction)
        refs = [getattr(F, fn)(xs[b], ts[b], reduction=reduction) for b in range(B)]
        compare(out, refs, [(leaf, False), (target, target_mode == "shared")],
                [[xs[b], ts[b]] for b in range(B)])


@pytest.mark.parametrize("B", [1, 3])
@pytest.mark.parametrize("weight_mode", ["shared", "per_model"])
@pytest.mark.parametrize("shape", [(), (5,), (5, 3, 2)])
@pytest.mark.parametrize("fn", ["mse_loss", "l1_loss"])
def test_elementwise_losses_with_weight(fn, shape, weight_mode, B):
    """torch's ``weight=`` (each element's weight, the mean divided by their sum), shared (a
    model's input shape) or per model; the weight's gradient too."""
    for reduction, layout in zip(REDUCTIONS, LAYOUTS):
        if not shape:
            layout = "contiguous"
        x, xs, leaf = array_input(shape, B, layout=layout)
        target = torch.randn(B, *shape)
        if weight_mode == "shared":
            weight = (torch.rand(shape) + 0.1).requires_grad_()
            ws = [weight.detach().clone().requires_grad_() for _ in range(B)]
        else:
            weight = (torch.rand(B, *shape) + 0.1).requires_grad_()
            ws = [weight[b].detach().clone().requires_grad_() for b in range(B)]
        out = getattr(HF, fn)(x, target, reduction=reduction, weight=weight)
        refs = [getattr(F, fn)(xs[b], target[b], reduction=reduction, weight=ws[b]) for b in range(B)]
        compare(out, refs, [(leaf, False), (weight, weight_mode == "shared")],
                [[xs[b], ws[b]] for b in range(B)])


@pytest.mark.parametrize("fn", ["mse_loss", "l1_loss"])
def test_elementwise_loss_weight_errors(fn):
    x, t = torch.randn(3, 5, 4), torch.randn(5, 4)
    loss = getattr(HF, fn)
    with pytest.raises(ValueError, match=r"expected weight of shape \[5, 4\] \(shared by all models\) or "
                                         r"\[3, 5, 4\] \(per model\), got shape \[4\]"):
        loss(x, t, weight=torch.rand(4))
    with pytest.raises(ValueError, match=r"per-model weight with leading \(array\) dim B=3"):
        loss(x, t, weight=torch.rand(2, 5, 4))
    with pytest.raises(TypeError, match="expected a real weight, got torch.complex64"):
        loss(x, t, weight=torch.ones(5, 4, dtype=torch.complex64))
    with pytest.raises(TypeError, match="weight"):
        loss(x, t, weight=[1.0] * 4)


# ---- binary_cross_entropy_with_logits -------------------------------------------

def bce_weight(mode, B, shape, kind):
    """A weight (kind 'weight': the full model shape) or pos_weight (last dim)."""
    wshape = tuple(shape) if kind == "weight" else tuple(shape[-1:])
    if mode == "none":
        return None, [None] * B
    if mode == "shared":
        w = torch.rand(wshape) + 0.1
        return w, [w] * B
    if mode == "per_model":  # as many dims as the array input, B in front
        w = torch.rand(B, *([1] * (len(shape) - len(wshape))), *wshape) + 0.1
        return w, list(w)
    w = torch.rand(1, *shape) + 0.1  # "one": leading dim 1, the same for every model
    return w, [w[0]] * B


@pytest.mark.parametrize("pos_weight_mode", ["none", "shared", "per_model"])
@pytest.mark.parametrize("weight_mode", ["none", "shared", "per_model", "one"])
@pytest.mark.parametrize("target_mode", ["shared", "per_model"])
@pytest.mark.parametrize("shape", [(7,), (5, 7), (5, 3, 4)])
def test_binary_cross_entropy_with_logits(shape, target_mode, weight_mode, pos_weight_mode):
    for reduction, layout, B in zip(REDUCTIONS, LAYOUTS, (3, 1, 3)):
        weight, ws = bce_weight(weight_mode, B, shape, "weight")
        pos_weight, pws = bce_weight(pos_weight_mode, B, shape, "pos_weight")
        if target_mode == "shared":
            target = torch.rand(shape)
            ts = [target] * B
        else:
            target = torch.rand(B, *shape)
            ts = list(target)
        x, xs, leaf = array_input(shape, B, layout=layout)
        out = HF.binary_cross_entropy_with_logits(x, target, weight, reduction=reduction,
                                                  pos_weight=pos_weight)
        refs = [F.binary_cross_entropy_with_logits(xs[b], ts[b], ws[b], reduction=reduction,
                                                   pos_weight=pws[b]) for b in range(B)]
        compare(out, refs, [(leaf, False)], [[xb] for xb in xs])


# ---- bad input --------------------------------------------------------------------

B_, N_, C_ = 3, 5, 4


def _x(*shape):
    return torch.randn(*(shape or (B_, N_, C_)))


def _t(*shape):
    return torch.randint(0, C_, shape or (B_, N_))


BAD = [
    # (call, error, fragments the message must contain: expected and received)
    (lambda: HF.cross_entropy(_x(), _t(6)), ValueError, ["[5]", "[3, 5]", "[6]"]),
    (lambda: HF.cross_entropy(_x(), _t(2, 5)), ValueError, ["B=3", "[2, 5]"]),
    (lambda: HF.cross_entropy(_x(), _t(3, 5, 1)), ValueError, ["[3, 5]", "[3, 5, 1]"]),
    (lambda: HF.cross_entropy(_x(), torch.rand(2, 5, 4)), ValueError, ["B=3", "[2, 5, 4]"]),
    (lambda: HF.cross_entropy(_x(), torch.rand(5, 3)), ValueError, ["[5, 4]", "[5, 3]"]),
    (lambda: HF.cross_entropy(_x(3, 4), _t(2)), ValueError, ["B=3", "[2]"]),
    (lambda: HF.cross_entropy(_x(), _t(), torch.rand(2, 4)), ValueError, ["B=3", "[2, 4]"]),
    (lambda: HF.cross_entropy(_x(), _t(), torch.rand(5)), ValueError, ["[4]", "[3, 4]", "[5]"]),
    (lambda: HF.cross_entropy(_x(), _t(), torch.rand(3, 5)), ValueError, ["[4]", "[3, 4]", "[3, 5]"]),
    (lambda: HF.cross_entropy(_x(), _t(), torch.rand(4, dtype=torch.float64)), TypeError,
     ["float32", "float64"]),
    (lambda: HF.cross_entropy(_x(), _t(), reduction="avg"), ValueError, ["'mean'", "'avg'"]),
    (lambda: HF.cross_entropy(_x(), _t(), label_smoothing=1.5), ValueError, ["1.0", "1.5"]),
    (lambda: HF.cross_entropy(_x(), torch.rand(5, 4), ignore_index=1), ValueError, ["negative", "1"]),
    (lambda: HF.cross_entropy(_x(), _t() > 1), TypeError, ["integer", "torch.bool"]),
    (lambda: HF.cross_entropy(_x(), [0, 1, 2]), TypeError, ["torch.Tensor", "list"]),
    (lambda: HF.cross_entropy(_x(3), torch.tensor(0)), ValueError, ["[B, C]", "[3]"]),
    (lambda: HF.cross_entropy(_t(3, 5, 4), _t()), TypeError, ["floating", "int64"]),
    (lambda: HF.nll_loss(_x(), torch.rand(3, 5)), TypeError, ["integer", "float32"]),
    (lambda: HF.nll_loss(_x(), _t(4, 5)), ValueError, ["B=3", "[4, 5]"]),
    (lambda: HF.nll_loss(_x(), _t(), torch.rand(1, 4)), ValueError, ["B=3", "[1, 4]"]),
    (lambda: HF.nll_loss(_x(), _t(), reduction="batchmean"), ValueError, ["'sum'", "'batchmean'"]),
    (lambda: HF.mse_loss(_x(), _t(3, 5, 4)), TypeError, ["floating", "int64"]),
    (lambda: HF.mse_loss(_x(), torch.rand(2, 5, 4)), ValueError, ["B=3", "[2, 5, 4]"]),
    (lambda: HF.mse_loss(_x(), torch.rand(4)), ValueError, ["[5, 4]", "[3, 5, 4]", "got shape [4]"]),
    (lambda: HF.mse_loss(_x(), torch.rand(5, 4), reduction=None), ValueError, ["'none'", "None"]),
    (lambda: HF.l1_loss(_x(), _t(5, 4)), TypeError, ["floating", "int64"]),
    (lambda: HF.l1_loss(_x(), torch.rand(5, 5)), ValueError, ["[5, 4]", "[5, 5]"]),
    (lambda: HF.binary_cross_entropy_with_logits(_x(), _t(5, 4)), TypeError, ["floating", "int64"]),
    (lambda: HF.binary_cross_entropy_with_logits(_x(), torch.rand(4, 5, 4)), ValueError,
     ["B=3", "[4, 5, 4]"]),
    (lambda: HF.binary_cross_entropy_with_logits(_x(), torch.rand(5, 4), torch.rand(2, 1, 4)), ValueError,
     ["B=3", "[2, 1, 4]"]),
    (lambda: HF.binary_cross_entropy_with_logits(_x(), torch.rand(5, 4), pos_weight=torch.rand(3, 4)),
     ValueError, ["[3, 5, 4]", "[3, 4]"]),
    (lambda: HF.binary_cross_entropy_with_logits(_x(), torch.rand(5, 4), pos_weight=torch.rand(1, 3, 5, 4)),
     ValueError, ["[3, 5, 4]", "[1, 3, 5, 4]"]),
    (lambda: HF.binary_cross_entropy_with_logits(_x(), torch.rand(5, 4), reduction="mea"), ValueError,
     ["'mean'", "'mea'"]),
]


@pytest.mark.parametrize("i", range(len(BAD)))
def test_bad_input(i):
    call, error, fragments = BAD[i]
    with pytest.raises(error) as info:
        call()
    for fragment in fragments:
        assert fragment in str(info.value), (fragment, str(info.value))
