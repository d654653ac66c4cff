"""Mixed precision in the array losses and norms, against B separate torch computations.

Losses: torch's CPU autocast runs its losses (``cross_entropy_loss``, ``nll_loss``,
``mse_loss``, ``l1_loss``, ``binary_cross_entropy_with_logits``, ...) in float32
(its "fp32" policy: bfloat16, float16 and float32 arguments cast to float32, result
float32). The array losses follow it: float32 class weights with low-precision logits
(refused before), class-probability targets (the log-softmax was taken in the logits'
dtype, and bfloat16 targets gave a bfloat16 loss) and low-precision class weights (their
sum was taken in bfloat16).

Norms: outside autocast torch's norm modules take a bfloat16 or float16 input with
float32 parameters and return the input's dtype (a ``torch.autocast(enabled=False)``
region around a norm that reads a low-precision activation); torch's linear and
convolution layers refuse it. The array norms accept exactly that mixed case.
"""

from __future__ import annotations

import copy
import warnings

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import hfkern
import hfkern.nn as hnn
import hfkern.nn.functional as HF
from hfkern._array import to_grouped

B = 3
LOWP = [torch.bfloat16, torch.float16]
LOWP_IDS = ["bf16", "fp16"]
REDUCTIONS = ["mean", "sum", "none"]
# float32 rounding of the same float32 computation (torch's own assert_close tolerance)
FP32 = dict(rtol=1.3e-6, atol=1e-5)


def _autocast(dtype):
    return torch.autocast("cpu", dtype=dtype)


def _per_model(t: torch.Tensor | None, b: int, per_model: bool) -> torch.Tensor | None:
    return None if t is None else (t[b] if per_model else t)


def _assert_as_torch(out: torch.Tensor, ref: torch.Tensor, tol: dict = FP32) -> None:
    assert out.dtype == ref.dtype, (out.dtype, ref.dtype)
    assert out.shape == ref.shape, (out.shape, ref.shape)
    torch.testing.assert_close(out, ref, **tol, equal_nan=True)


def _assert_grad_as_torch(out: torch.Tensor, ref: torch.Tensor, x: torch.Tensor, dtype: torch.dtype) -> None:
    """The gradient reaches the low-precision input in its dtype, as torch's does, and agrees."""
    cot = torch.rand_like(ref)
    (g,) = torch.autograd.grad(out, x, cot)
    (g_ref,) = torch.autograd.grad(ref, x, cot)
    assert g.dtype == g_ref.dtype == dtype
    torch.testing.assert_close(g.float(), g_ref.float(), rtol=1e-2, atol=1e-3)


# ---- cross_entropy and nll_loss under autocast ---------------------------------------------

def _logits(dtype, N=16, C=7, extra=()):
    return ((torch.randn(B, N, C, *extra) * 3).to(dtype)).requires_grad_()


@pytest.mark.parametrize("dtype", LOWP, ids=LOWP_IDS)
@pytest.mark.parametrize("weight_kind", ["fp32 [C]", "fp32 [B,C]", "lowp [C]", "lowp [B,C]"])
@pytest.mark.parametrize("reduction", REDUCTIONS)
@pytest.mark.parametrize("fn", ["cross_entropy", "nll_loss"])
def test_class_weights_under_autocast(dtype, weight_kind, reduction, fn):
    """Float32 class weights with low-precision logits ran into the dtype check; a
    low-precision weight's 'mean' divisor was summed in bfloat16 (0.015 off). torch casts
    logits and weight to float32 and returns float32."""
    C = 7
    x = _logits(dtype, C=C)
    t = torch.randint(0, C, (16,))
    t[::5] = -100  # ignored targets: not in the weighted divisor
    per_model = "[B,C]" in weight_kind
    w = (torch.rand(B, C) + 0.5) if per_model else (torch.rand(C) + 0.5)
    if weight_kind.startswith("lowp"):
        w = w.to(dtype)
    torch_fn, array_fn = getattr(F, fn), getattr(HF, fn)
    kw = dict(reduction=reduction)
    if fn == "cross_entropy":
        kw["label_smoothing"] = 0.1
    with _autocast(dtype):
        out = array_fn(x, t, weight=w, **kw)
        refs = [torch_fn(x[b], t, weight=_per_model(w, b, per_model), **kw) for b in range(B)]
    ref = torch.stack(refs)
    assert ref.dtype == torch.float32
    _assert_as_torch(out, ref)
    # the gradient reaches the low-precision logits in their dtype, as torch's does
    _assert_grad_as_torch(out, ref, x, dtype)


@pytest.mark.parametrize("dtype", LOWP, ids=LOWP_IDS)
@pytest.mark.parametrize("shape", ["[B, N, C, d]", "[B, C] unbatched"])
@pytest.mark.parametrize("target_kind", ["shared", "per model"])
def test_class_index_losses_under_autocast_without_weight(dtype, shape, target_kind):
    C = 5
    if shape == "[B, C] unbatched":
        x = (torch.randn(B, C) * 3).to(dtype)
        t = torch.randint(0, C, (B,) if target_kind == "per model" else ())
    else:
        x = (torch.randn(B, 6, C, 4) * 3).to(dtype)
        t = torch.randint(0, C, (B, 6, 4) if target_kind == "per model" else (6, 4))
    per_model = target_kind == "per model"
    for reduction in REDUCTIONS:
        with _autocast(dtype):
            out_ce = HF.cross_entropy(x, t, reduction=reduction)
            out_nll = HF.nll_loss(x, t, reduction=reduction)
            ref_ce = torch.stack([F.cross_entropy(x[b], _per_model(t, b, per_model), reduction=reduction)
                                  for b in range(B)])
            ref_nll = torch.stack([F.nll_loss(x[b], _per_model(t, b, per_model), reduction=reduction)
                                   for b in range(B)])
        _assert_as_torch(out_ce, ref_ce)
        _assert_as_torch(out_nll, ref_nll)


def test_class_weights_bf16_mean_is_float32_accurate():
    """The repro: a bfloat16 weight under autocast; torch's loss is within float32 rounding of
    the float64 loss of the same (bfloat16) values, and so is the array's (it was 0.015 off)."""
    C = 50
    x = (torch.randn(B, 64, C) * 3).bfloat16()
    t = torch.randint(0, C, (64,))
    w = (torch.rand(B, C) + 0.5).bfloat16()
    for per_model in (False, True):
        wa = w if per_model else w[0]
        with _autocast(torch.bfloat16):
            out = HF.cross_entropy(x, t, weight=wa)
        truth = torch.stack([F.cross_entropy(x[b].double(), t, weight=_per_model(wa, b, per_model).double())
                             for b in range(B)])
        assert out.dtype == torch.float32
        torch.testing.assert_close(out.double(), truth, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("dtype", LOWP, ids=LOWP_IDS)
@pytest.mark.parametrize("target_dtype", ["fp32", "lowp"])
@pytest.mark.parametrize("target_kind", ["shared", "per model"])
@pytest.mark.parametrize("weight_kind", [None, "fp32 [C]", "lowp [B,C]"])
@pytest.mark.parametrize("label_smoothing", [0.0, 0.2])
def test_probability_targets_under_autocast(dtype, target_dtype, target_kind, weight_kind, label_smoothing):
    """The log-softmax ran on the low-precision logits (7e-4 off where torch is 3e-7 off) and
    bfloat16 targets gave a bfloat16 loss: torch computes and returns float32."""
    N, C = 12, 6
    x = _logits(dtype, N=N, C=C, extra=(3,))
    per_model = target_kind == "per model"
    p = torch.softmax(torch.randn(*((B,) if per_model else ()), N, C, 3), dim=-2)
    if target_dtype == "lowp":
        p = p.to(dtype)
    w_per_model = weight_kind is not None and "[B,C]" in weight_kind
    w = None if weight_kind is None else (torch.rand(B, C) + 0.5 if w_per_model else torch.rand(C) + 0.5)
    if weight_kind is not None and weight_kind.startswith("lowp"):
        w = w.to(dtype)
    for reduction in REDUCTIONS:
        with _autocast(dtype):
            out = HF.cross_entropy(x, p, weight=w, reduction=reduction, label_smoothing=label_smoothing)
            ref = torch.stack([
                F.cross_entropy(x[b], _per_model(p, b, per_model), weight=_per_model(w, b, w_per_model),
                                reduction=reduction, label_smoothing=label_smoothing)
                for b in range(B)])
        assert ref.dtype == torch.float32
        _assert_as_torch(out, ref)
    _assert_grad_as_torch(out, ref, x, dtype)


def test_probability_targets_under_autocast_are_float32_accurate():
    """The repro: against the float64 loss of the same bfloat16 logits."""
    C = 50
    x = (torch.randn(B, 64, C) * 3).bfloat16()
    p = torch.softmax(torch.randn(64, C), -1)
    with _autocast(torch.bfloat16):
        out = HF.cross_entropy(x, p)
    truth = torch.stack([F.cross_entropy(x[b].double(), p.double()) for b in range(B)])
    torch.testing.assert_close(out.double(), truth, rtol=1e-6, atol=1e-5)


# ---- the element-wise losses under autocast ------------------------------------------------

@pytest.mark.parametrize("dtype", LOWP, ids=LOWP_IDS)
@pytest.mark.parametrize("fn", ["mse_loss", "l1_loss", "binary_cross_entropy_with_logits"])
@pytest.mark.parametrize("target_dtype", ["fp32", "lowp"])
@pytest.mark.parametrize("target_kind", ["shared", "per model"])
def test_elementwise_losses_under_autocast(dtype, fn, target_dtype, target_kind):
    x = torch.randn(B, 8, 5).to(dtype).requires_grad_()
    per_model = target_kind == "per model"
    t = torch.rand(*((B,) if per_model else ()), 8, 5)
    if target_dtype == "lowp":
        t = t.to(dtype)
    torch_fn, array_fn = getattr(F, fn), getattr(HF, fn)
    for reduction in REDUCTIONS:
        with _autocast(dtype):
            out = array_fn(x, t, reduction=reduction)
            ref = torch.stack([torch_fn(x[b], _per_model(t, b, per_model), reduction=reduction) for b in range(B)])
        assert ref.dtype == torch.float32
        _assert_as_torch(out, ref)
    _assert_grad_as_torch(out, ref, x, dtype)


@pytest.mark.parametrize("dtype", LOWP, ids=LOWP_IDS)
@pytest.mark.parametrize("weights", ["fp32 shared", "lowp shared", "fp32 per model", "lowp per model"])
def test_bce_with_logits_weights_under_autocast(dtype, weights):
    """weight and pos_weight are cast with the rest, as torch casts them."""
    C = 5
    x = torch.randn(B, 8, C).to(dtype)
    t = torch.rand(8, C).to(dtype)
    per_model = "per model" in weights
    w = torch.rand(B, 1, C) + 0.5 if per_model else torch.rand(C) + 0.5
    pw = torch.rand(B, 1, C) + 0.5 if per_model else torch.rand(C) + 0.5
    if weights.startswith("lowp"):
        w, pw = w.to(dtype), pw.to(dtype)
    for reduction in REDUCTIONS:
        with _autocast(dtype):
            out = HF.binary_cross_entropy_with_logits(x, t, weight=w, pos_weight=pw, reduction=reduction)
            ref = torch.stack([F.binary_cross_entropy_with_logits(
                x[b], t, weight=_per_model(w, b, per_model), pos_weight=_per_model(pw, b, per_model),
                reduction=reduction) for b in range(B)])
        assert ref.dtype == torch.float32
        _assert_as_torch(out, ref)


# ---- what autocast leaves alone, and the dtypes outside it ----------------------------------

def test_float64_is_not_autocasts_to_change():
    """torch's autocast leaves float64 arguments as they are: a float64 loss, and a float32
    weight with float64 logits refused (torch raises too)."""
    x = torch.randn(B, 6, 4, dtype=torch.float64)
    t = torch.randint(0, 4, (6,))
    p = torch.softmax(torch.randn(6, 4), -1).bfloat16()
    with _autocast(torch.bfloat16):
        _assert_as_torch(HF.cross_entropy(x, t), torch.stack([F.cross_entropy(x[b], t) for b in range(B)]))
        _assert_as_torch(HF.cross_entropy(x, p), torch.stack([F.cross_entropy(x[b], p) for b in range(B)]))
        _assert_as_torch(HF.mse_loss(x, p.float().view(6, 4)),
                         torch.stack([F.mse_loss(x[b], p.float()) for b in range(B)]))
        with pytest.raises(RuntimeError):
            F.cross_entropy(x[0], t, weight=torch.rand(4))
        with pytest.raises(TypeError, match="cross_entropy: expected weight of the input's dtype torch.float64, "
                                            "got torch.float32"):
            HF.cross_entropy(x, t, weight=torch.rand(4))


@pytest.mark.parametrize("dtype", LOWP, ids=LOWP_IDS)
def test_outside_autocast_dtypes_are_torchs(dtype):
    """Outside autocast nothing is cast: low-precision logits give a low-precision loss, a
    class weight of another dtype with class-index targets is refused (torch refuses it), and
    with class-probability targets it takes part by type promotion (torch's loss multiplies
    it in)."""
    C = 5
    x = (torch.randn(B, 8, C) * 3).to(dtype)
    t = torch.randint(0, C, (8,))
    p = torch.softmax(torch.randn(8, C), -1)
    w = torch.rand(C) + 0.5
    _assert_as_torch(HF.cross_entropy(x, t), torch.stack([F.cross_entropy(x[b], t) for b in range(B)]), tol={})
    _assert_as_torch(HF.mse_loss(x, x[0]), torch.stack([F.mse_loss(x[b], x[0]) for b in range(B)]), tol={})
    for fn in ("cross_entropy", "nll_loss"):
        with pytest.raises(RuntimeError):
            getattr(F, fn)(x[0], t, weight=w)
        with pytest.raises(TypeError, match=f"{fn}: expected weight of the input's dtype {dtype}, got torch.float32"):
            getattr(HF, fn)(x, t, weight=w)
    for xd, pd, wd in ((dtype, torch.float32, torch.float32), (dtype, dtype, torch.float32),
                       (torch.float32, torch.float32, dtype), (dtype, dtype, torch.float64)):
        xx, pp, ww = x.to(xd), p.to(pd), w.to(wd)
        for reduction in REDUCTIONS:
            out = HF.cross_entropy(xx, pp, weight=ww, reduction=reduction, label_smoothing=0.1)
            ref = torch.stack([F.cross_entropy(xx[b], pp, weight=ww, reduction=reduction, label_smoothing=0.1)
                               for b in range(B)])
            tol = FP32 if ref.dtype in (torch.float32, torch.float64) else {}
            _assert_as_torch(out, ref, tol)
    with pytest.raises(TypeError, match="cross_entropy: expected a floating-point weight, got torch.int64"):
        HF.cross_entropy(x, p.to(dtype), weight=torch.ones(C, dtype=torch.long))


# ---- norms: low-precision input, float32 parameters, outside autocast -----------------------

NORMS = {
    "LayerNorm": (lambda: nn.LayerNorm(8), hnn.LayerNorm, (6, 8)),
    "LayerNorm2d": (lambda: nn.LayerNorm([3, 8]), hnn.LayerNorm, (4, 3, 8)),
    "RMSNorm": (lambda: nn.RMSNorm(8), hnn.RMSNorm, (6, 8)),
    "GroupNorm": (lambda: nn.GroupNorm(2, 8), hnn.GroupNorm, (5, 8, 6)),
    "GroupNorm_nobias": (lambda: nn.GroupNorm(4, 8, bias=False), hnn.GroupNorm, (5, 8, 3, 2)),
    "BatchNorm1d": (lambda: nn.BatchNorm1d(8), hnn.BatchNorm1d, (6, 8)),
    "BatchNorm1d_L": (lambda: nn.BatchNorm1d(8), hnn.BatchNorm1d, (6, 8, 4)),
    # no weight: the running statistics are the float32 tensors the input meets
    "BatchNorm1d_stats_only": (lambda: nn.BatchNorm1d(8, affine=False), hnn.BatchNorm1d, (6, 8, 4)),
    "BatchNorm2d": (lambda: nn.BatchNorm2d(8), hnn.BatchNorm2d, (4, 8, 3, 3)),
    "BatchNorm2d_cumulative": (lambda: nn.BatchNorm2d(8, momentum=None), hnn.BatchNorm2d, (4, 8, 3, 3)),
}
# the error floor of the accuracy rule, relative to the float64 reference's largest magnitude
FLOOR = {torch.bfloat16: 8e-3, torch.float16: 1e-3}


def _norm_models(name, train):
    make, array_cls, shape = NORMS[name]
    models = [make().train(train) for _ in range(B)]
    with torch.no_grad():
        for m in models:
            for p in m.parameters():
                p.uniform_(-1.0, 1.5)
            if getattr(m, "running_mean", None) is not None:
                m.running_mean.uniform_(-1, 1)
                m.running_var.uniform_(0.5, 2)
    array = array_cls.from_modules(copy.deepcopy(models)).train(train)
    return models, array, shape


def _assert_as_accurate(got, ref, truth, dtype, what):
    """``got`` has ``ref``'s (torch's) dtype, and its error against float64 is at most twice
    torch's own plus a low-precision floor (hfkern rounds once where torch may round twice)."""
    assert got.dtype == ref.dtype, (what, got.dtype, ref.dtype)
    err = (got.double() - truth).abs().max()
    ref_err = (ref.double() - truth).abs().max()
    assert err <= 2 * ref_err + FLOOR[dtype] * truth.abs().max(), (what, err.item(), ref_err.item())


@pytest.mark.parametrize("dtype", LOWP, ids=LOWP_IDS)
@pytest.mark.parametrize("train", [True, False], ids=["train", "eval"])
@pytest.mark.parametrize("layout", ["contiguous", "batch_major", "shared", "shared_requires_grad"])
@pytest.mark.parametrize("name", list(NORMS))
def test_norm_takes_low_precision_input_with_float32_parameters(name, layout, train, dtype):
    """Outside autocast: the output in the input's dtype, gradients of the parameters in
    float32 and of the input in its dtype, running statistics in float32, each as torch's
    modules give them (compared with torch and with float64 copies of the modules)."""
    models, array, shape = _norm_models(name, train)
    models64 = [copy.deepcopy(m).double() for m in models]
    base = torch.randn(B, *shape) * 2 + 0.5
    if layout.startswith("shared"):
        data = base[0].to(dtype)
        leaf = data.clone().requires_grad_(layout == "shared_requires_grad")
        x = hfkern.broadcast(leaf, B)
        xs = [data.clone().requires_grad_() for _ in range(B)]
    else:
        data = base.to(dtype)
        if layout == "batch_major":
            data = data.transpose(0, 1).contiguous().transpose(0, 1)
        leaf = x = data.detach().requires_grad_()
        xs = [data[b].detach().clone().requires_grad_() for b in range(B)]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # torch's RMS norm: "Mismatch dtype ... fused implementation"
        ys = [m(xs[b]) for b, m in enumerate(models)]
    y = array(x)
    ref = torch.stack(ys)
    xs64 = [xb.detach().double().requires_grad_() for xb in xs]
    ys64 = [m(xs64[b]) for b, m in enumerate(models64)]
    truth = torch.stack(ys64)
    assert ref.dtype == dtype
    _assert_as_accurate(y, ref, truth, dtype, "output")

    g = torch.randn(ref.shape).to(dtype)
    params = list(array.named_parameters())
    wrt = ([leaf] if leaf.requires_grad else []) + [p for _, p in params]
    got = torch.autograd.grad(y, wrt, g) if wrt else ()
    got_x, got_p = (got[0], got[1:]) if leaf.requires_grad else (None, got)
    refs = [torch.autograd.grad(ys[b], [xs[b], *m.parameters()], g[b]) for b, m in enumerate(models)]
    truths = [torch.autograd.grad(ys64[b], [xs64[b], *m.parameters()], g[b].double())
              for b, m in enumerate(models64)]
    for i, (pname, p) in enumerate(params):
        want = torch.stack([r[1 + i] for r in refs])
        assert p.dtype == want.dtype == got_p[i].dtype == torch.float32
        _assert_as_accurate(got_p[i], want, torch.stack([t[1 + i] for t in truths]), dtype, pname)
    if got_x is not None:
        stack = (lambda ts: sum(ts)) if layout.startswith("shared") else torch.stack
        _assert_as_accurate(got_x, stack([r[0] for r in refs]), stack([t[0] for t in truths]), dtype, "input")
    if getattr(models[0], "running_mean", None) is not None:
        for buf in ("running_mean", "running_var", "num_batches_tracked"):
            want = torch.stack([getattr(m, buf) for m in models])
            have = getattr(array, buf)
            assert have.dtype == want.dtype, buf
            torch.testing.assert_close(have, want, rtol=1e-5, atol=1e-6, msg=buf)


class _AutocastOffNet(nn.Module):
    """The pattern that broke a fused forward: a norm in an ``autocast(enabled=False)`` region
    reads the bfloat16 output of a layer run under the caller's autocast."""

    def __init__(self, norm):
        super().__init__()
        self.fc = nn.Linear(6, 8)
        self.norm = norm

    def forward(self, x):
        h = self.fc(x)
        with torch.autocast("cpu", enabled=False):
            return torch.relu(self.norm(h))


@pytest.mark.parametrize("norm", ["LayerNorm", "RMSNorm", "GroupNorm", "BatchNorm1d"])
@pytest.mark.parametrize("train", [True, False], ids=["train", "eval"])
def test_fused_norm_in_autocast_disabled_region(norm, train):
    make = {"LayerNorm": lambda: nn.LayerNorm(8), "RMSNorm": lambda: nn.RMSNorm(8),
            "GroupNorm": lambda: nn.GroupNorm(2, 8), "BatchNorm1d": lambda: nn.BatchNorm1d(8)}[norm]
    models = [_AutocastOffNet(make()).train(train) for _ in range(B)]
    fused = hfkern.fuse(copy.deepcopy(models)).train(train)
    x = torch.randn(5, 6)
    with _autocast(torch.bfloat16), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        ref = torch.stack([m(x) for m in models])
        out = fused(hfkern.broadcast(x, B))
    assert ref.dtype == torch.bfloat16
    _assert_as_torch(out, ref, tol=dict(rtol=1.6e-2, atol=1e-2))
    g = torch.randn(ref.shape)
    (ref.float() * g).sum().backward()
    (out.float() * g).sum().backward()
    for name, p in fused.named_parameters():
        want = torch.stack([m.get_parameter(name).grad for m in models])
        assert p.grad.dtype == want.dtype == torch.float32, name
        torch.testing.assert_close(p.grad, want, rtol=3e-2, atol=3e-2 * want.abs().max().item(), msg=name)


def test_batch_norm_grouped_path_takes_the_mixed_precision():
    """The grouped call ``hfkern.fuse`` makes for a convolution's output (``_normalize_grouped``)
    serves a bfloat16 activation with float32 parameters outside autocast too, as the module does."""
    Bn, N, C = 3, 4, 5
    bn = hnn.BatchNorm2d(C, B=Bn)
    with torch.no_grad():
        bn.weight.uniform_(0.5, 1.5)
        bn.bias.uniform_(-0.5, 0.5)
    other = copy.deepcopy(bn)
    x = torch.randn(N, Bn, C, 6, 6).bfloat16().transpose(0, 1)  # an array conv's [N, B, C, H, W] memory
    z = bn._normalize_grouped(to_grouped(x), Bn, torch.contiguous_format, "none")
    assert z is not None and z.dtype == torch.bfloat16
    torch.testing.assert_close(z, other(x), rtol=0, atol=0)
    for buf in ("running_mean", "running_var", "num_batches_tracked"):
        assert torch.equal(getattr(bn, buf), getattr(other, buf)), buf


@pytest.mark.parametrize("dtype", LOWP, ids=LOWP_IDS)
def test_group_norm_shared_input_returns_the_inputs_dtype(dtype):
    """On a shared input GroupNorm normalizes once and applies the per-model affine itself: with
    float32 parameters that returned float32 (under autocast as well), where torch's returns the
    input's dtype, rounded once."""
    models, array, shape = _norm_models("GroupNorm", True)
    x = (torch.randn(*shape) * 2).to(dtype)
    truth = torch.stack([copy.deepcopy(m).double()(x.double()) for m in models])
    for region in (_autocast(dtype), torch.autocast("cpu", enabled=False)):
        with region:
            ref = torch.stack([m(x) for m in models])
            out = array(hfkern.broadcast(x, B))
        assert ref.dtype == dtype
        _assert_as_accurate(out, ref, truth, dtype, "output")
        torch.testing.assert_close(out, ref, rtol=0, atol=0)


@pytest.mark.parametrize("make, array_cls, shape", [
    (lambda: nn.Linear(8, 3), hnn.Linear, (4, 8)),
    (lambda: nn.Conv1d(8, 3, 1), hnn.Conv1d, (4, 8, 5)),
], ids=["Linear", "Conv1d"])
def test_linear_and_conv_still_refuse_mixed_dtypes(make, array_cls, shape):
    """torch's linear and convolution layers refuse a bfloat16 input with float32 parameters
    outside autocast; so do the arrays."""
    models = [make() for _ in range(B)]
    array = array_cls.from_modules(models)
    x = torch.randn(B, *shape).bfloat16()
    with pytest.raises(RuntimeError):
        models[0](x[0])
    with pytest.raises(TypeError, match=r"expected input of dtype torch.float32 \(the parameters' dtype\), "
                                        r"got torch.bfloat16"):
        array(x)


@pytest.mark.parametrize("name", ["LayerNorm", "GroupNorm", "BatchNorm2d"])
@pytest.mark.parametrize("x_dtype, p_dtype", [(torch.float64, torch.float32), (torch.float16, torch.bfloat16),
                                              (torch.float32, torch.bfloat16)])
def test_norm_other_mixed_dtypes_still_refused(name, x_dtype, p_dtype):
    """Only a low-precision input with float32 parameters is torch's mixed precision; other
    pairs are refused, by torch's modules as by the arrays."""
    models, array, shape = _norm_models(name, True)
    models, array = [m.to(p_dtype) for m in models], array.to(p_dtype)
    x = torch.randn(B, *shape).to(x_dtype)
    with pytest.raises(RuntimeError):
        models[0](x[0])
    with pytest.raises(TypeError, match=f"expected input of dtype {p_dtype}.*got {x_dtype}"):
        array(x)
