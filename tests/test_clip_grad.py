"""hfkern.utils' per-model gradient clipping against torch.nn.utils run on each model alone."""

from __future__ import annotations

import math

import pytest
import torch

import hfkern.utils as hutils

SHAPES = [(5, 3), (7,), (2, 3, 3, 1), (), (4, 6)]  # per-model shapes; () is a [B] parameter
EXACT = dict(rtol=0, atol=0)  # the per-model reductions run the same kernels as torch's


def _arrays(B, shapes=SHAPES, *, dtypes=None, scale=3.0, no_grad_index=None, layout="contiguous"):
    """Array parameters with random gradients; the parameter at ``no_grad_index`` has none."""
    dtypes = dtypes or [torch.float32] * len(shapes)
    params = []
    for i, (s, dt) in enumerate(zip(shapes, dtypes)):
        p = torch.randn(B, *s, dtype=dt, requires_grad=True)
        if i != no_grad_index:
            if layout == "transposed" and len(s) >= 2:
                # The same values in other memory: per-model slices are not contiguous.
                g = (torch.randn(B, *s[:-2], s[-1], s[-2], dtype=dt) * scale).transpose(-1, -2)
            else:
                g = torch.randn(B, *s, dtype=dt) * scale
            p.grad = g
        params.append(p)
    return params


def _per_model_copies(params):
    """Model b's parameters as separate leaves with copies of their gradient slices."""
    B = params[0].size(0)
    models = []
    for b in range(B):
        leaves = []
        for p in params:
            leaf = p[b].detach().clone().requires_grad_()
            if p.grad is not None:
                leaf.grad = p.grad[b].clone()
            leaves.append(leaf)
        models.append(leaves)
    return models


def _values(v, B):
    if isinstance(v, torch.Tensor):
        return [float(x) for x in v]
    if isinstance(v, (list, tuple)):
        return [float(x) for x in v]
    return [float(v)] * B


def _max_norms(kind, B):
    # Model 0 is clipped hard, the last one not at all (a max norm far above its norm).
    # Not powers of 2: max_norm / x and reciprocal(x) * max_norm (torch's form) then differ.
    values = [0.3 + 0.7 * b for b in range(B - 1)] + [1e4] if B > 1 else [0.3]
    if kind == "float":
        return 0.7
    if kind == "list":
        return values
    return torch.tensor(values, dtype=torch.float64)


def _assert_grads_match(params, models, **tol):
    for i, p in enumerate(params):
        for b, leaves in enumerate(models):
            if p.grad is None:
                assert leaves[i].grad is None
                continue
            torch.testing.assert_close(p.grad[b], leaves[i].grad, equal_nan=True, **tol,
                                       msg=lambda m: f"param {i} model {b}: {m}")


@pytest.mark.parametrize("B", [1, 3])
@pytest.mark.parametrize("norm_type", [1.0, 2.0, math.inf, 3.0])
@pytest.mark.parametrize("max_norm_kind", ["float", "list", "tensor"])
def test_clip_grad_norm_matches_torch(B, norm_type, max_norm_kind):
    params = _arrays(B, no_grad_index=2)
    models = _per_model_copies(params)
    max_norm = _max_norms(max_norm_kind, B)
    total = hutils.clip_grad_norm_(params, max_norm, norm_type)
    assert total.shape == (B,) and total.dtype == torch.float32
    expected = torch.stack([
        torch.nn.utils.clip_grad_norm_(leaves, m, norm_type)
        for leaves, m in zip(models, _values(max_norm, B))
    ])
    torch.testing.assert_close(total, expected, **EXACT)
    _assert_grads_match(params, models, **EXACT)
    assert params[2].grad is None
    if B == 3 and max_norm_kind != "float":
        # The per-model max norms matter: model 0 was clipped, the last model was not.
        assert float(total[0]) > 0.3 and float(total[-1]) < 1e4


@pytest.mark.parametrize("foreach", [None, True, False])
@pytest.mark.parametrize("layout", ["contiguous", "transposed"])
def test_clip_grad_norm_foreach_and_layout(foreach, layout):
    B = 3
    params = _arrays(B, layout=layout)
    models = _per_model_copies(params)
    max_norm = [0.3, 1.1, 2.7]
    total = hutils.clip_grad_norm_(iter(params), max_norm, 2.0, foreach=foreach)  # any iterable
    expected = torch.stack([torch.nn.utils.clip_grad_norm_(m, v, 2.0) for m, v in zip(models, max_norm)])
    torch.testing.assert_close(total, expected, rtol=1e-6, atol=0)
    _assert_grads_match(params, models, rtol=1e-6, atol=0)


def test_clip_grad_norm_single_tensor_and_float64():
    B = 4
    p = torch.randn(B, 9, 2, dtype=torch.float64, requires_grad=True)
    p.grad = torch.randn_like(p) * 5
    ref = [p[b].detach().clone().requires_grad_() for b in range(B)]
    for b, r in enumerate(ref):
        r.grad = p.grad[b].clone()
    max_norm = torch.tensor([0.1, 1.0, 3.0, 100.0])
    total = hutils.clip_grad_norm_(p, max_norm)
    assert total.dtype == torch.float64
    for b in range(B):
        t = torch.nn.utils.clip_grad_norm_(ref[b], float(max_norm[b]))
        assert float(total[b]) == float(t)
        assert torch.equal(p.grad[b], ref[b].grad)


def test_clip_grad_norm_mixed_dtypes():
    B = 3
    params = _arrays(B, dtypes=[torch.float64, torch.float32, torch.float32, torch.float64, torch.float32])
    models = _per_model_copies(params)
    total = hutils.clip_grad_norm_(params, [0.5, 1.0, 2.0], 2.0)
    expected = torch.stack([torch.nn.utils.clip_grad_norm_(m, v, 2.0) for m, v in zip(models, [0.5, 1.0, 2.0])])
    assert total.dtype == expected.dtype == torch.float64
    torch.testing.assert_close(total, expected, rtol=1e-12, atol=0)
    _assert_grads_match(params, models, rtol=1e-6, atol=0)


def test_clip_grad_norm_bfloat16():
    B = 3
    params = _arrays(B, dtypes=[torch.bfloat16] * len(SHAPES))
    models = _per_model_copies(params)
    total = hutils.clip_grad_norm_(params, [0.5, 1.0, 1e3])
    expected = torch.stack([torch.nn.utils.clip_grad_norm_(m, v) for m, v in zip(models, [0.5, 1.0, 1e3])])
    assert total.dtype == torch.bfloat16
    torch.testing.assert_close(total, expected, rtol=1e-2, atol=0)
    _assert_grads_match(params, models, rtol=1e-2, atol=1e-3)


@pytest.mark.parametrize("poison", [math.inf, -math.inf, math.nan])
@pytest.mark.parametrize("norm_type", [1.0, 2.0, math.inf])
def test_poisoned_model_does_not_affect_the_others(poison, norm_type):
    B = 3
    clean = _arrays(B)
    poisoned = [p.detach().clone().requires_grad_() for p in clean]
    for p, c in zip(poisoned, clean):
        p.grad = c.grad.clone()
    poisoned[0].grad[1, 2, 1] = poison
    models = _per_model_copies(poisoned)
    max_norm = [0.3, 0.9, 1.7]
    total_clean = hutils.clip_grad_norm_(clean, max_norm, norm_type)
    total = hutils.clip_grad_norm_(poisoned, max_norm, norm_type)
    for b in (0, 2):
        assert float(total[b]) == float(total_clean[b])
        for p, c in zip(poisoned, clean):
            assert torch.equal(p.grad[b], c.grad[b])
    assert not math.isfinite(float(total[1]))
    # Model 1 gets exactly what torch gives it alone: an inf/NaN norm and gradients scaled by it.
    expected = torch.stack([torch.nn.utils.clip_grad_norm_(m, v, norm_type) for m, v in zip(models, max_norm)])
    torch.testing.assert_close(total, expected, equal_nan=True, **EXACT)
    _assert_grads_match(poisoned, models, **EXACT)


def test_error_if_nonfinite_names_the_models():
    B = 4
    params = _arrays(B)
    models = _per_model_copies(params)
    total = hutils.clip_grad_norm_(params, 0.1, error_if_nonfinite=True)  # finite: no error
    expected = torch.stack([torch.nn.utils.clip_grad_norm_(m, 0.1, error_if_nonfinite=True) for m in models])
    torch.testing.assert_close(total, expected, **EXACT)
    params[1].grad[1, 0] = math.nan
    params[4].grad[3, 2, 2] = math.inf
    before = [p.grad.clone() for p in params]
    with pytest.raises(RuntimeError, match=r"models \[1, 3\]"):
        hutils.clip_grad_norm_(params, 0.1, error_if_nonfinite=True)
    for p, g in zip(params, before):  # the error comes before any model is clipped
        torch.testing.assert_close(p.grad, g, equal_nan=True, **EXACT)


def test_no_gradients():
    B = 3
    params = _arrays(B, shapes=[(2, 2), (3,)], no_grad_index=0)
    params[1].grad = None
    total = hutils.clip_grad_norm_(params, [1.0, 2.0, 3.0])
    assert torch.equal(total, torch.zeros(B))
    hutils.clip_grad_value_(params, 1.0)
    assert all(p.grad is None for p in params)


def test_get_total_norm_and_clip_grads_with_norm_match_torch():
    B = 3
    params = _arrays(B)
    models = _per_model_copies(params)
    for norm_type in (1.0, 2.0, math.inf):
        total = hutils.get_total_norm([p.grad for p in params], norm_type)
        for b, leaves in enumerate(models):
            assert float(total[b]) == float(torch.nn.utils.get_total_norm([x.grad for x in leaves], norm_type))
    total = hutils.get_total_norm([p.grad for p in params])
    max_norm = [0.5, 1.0, 1e3]
    hutils.clip_grads_with_norm_(params, max_norm, total)
    for b, leaves in enumerate(models):
        t = torch.nn.utils.get_total_norm([x.grad for x in leaves])
        torch.nn.utils.clip_grads_with_norm_(leaves, max_norm[b], t)
    _assert_grads_match(params, models, **EXACT)


@pytest.mark.parametrize("B", [1, 3])
@pytest.mark.parametrize("kind", ["float", "list", "tensor"])
@pytest.mark.parametrize("foreach", [None, True, False])
def test_clip_grad_value_matches_torch(B, kind, foreach):
    params = _arrays(B, no_grad_index=1)
    params[0].grad[0, 1, 1] = math.nan
    params[2].grad[-1, 0, 0, 0, 0] = math.inf
    models = _per_model_copies(params)
    values = [0.3 + 0.7 * b for b in range(B)]
    clip_value = {"float": 0.75, "list": values, "tensor": torch.tensor(values)}[kind]
    hutils.clip_grad_value_(params, clip_value, foreach=foreach)
    for leaves, v in zip(models, _values(clip_value, B)):
        torch.nn.utils.clip_grad_value_(leaves, v)
    _assert_grads_match(params, models, **EXACT)
    assert math.isnan(float(params[0].grad[0, 1, 1]))
    hi = torch.tensor(_values(clip_value, B))
    for p in params:
        if p.grad is not None:
            per_model = p.grad.reshape(B, -1).nan_to_num(nan=0.0).abs().amax(1)
            assert (per_model <= hi).all()


def test_clip_grad_value_float64_and_bfloat16():
    B = 3
    for dtype in (torch.float64, torch.bfloat16):
        params = _arrays(B, dtypes=[dtype] * len(SHAPES))
        models = _per_model_copies(params)
        values = [0.1, 0.3333333, 2.0]
        hutils.clip_grad_value_(params, values)
        for leaves, v in zip(models, values):
            torch.nn.utils.clip_grad_value_(leaves, v)
        _assert_grads_match(params, models, **EXACT)


def test_device_values_are_not_read_on_the_host():
    """On the meta device a value read raises: the clipping must never need one."""
    B = 3
    params = [torch.empty(B, *s, device="meta", requires_grad=True) for s in SHAPES]
    for p in params:
        p.grad = torch.empty_like(p)
    for max_norm in (1.0, [1.0, 2.0, 3.0], torch.ones(B, device="meta")):
        total = hutils.clip_grad_norm_(params, max_norm, 2.0)
        assert total.shape == (B,) and total.device.type == "meta"
    hutils.clip_grad_value_(params, [1.0, 2.0, 3.0])
    hutils.clip_grad_value_(params, torch.ones(B, device="meta"))
    with pytest.raises(RuntimeError):  # the meta device cannot give the value this check needs
        hutils.clip_grad_norm_(params, 1.0, error_if_nonfinite=True)


def test_bad_arguments():
    B = 3
    params = _arrays(B, shapes=[(2, 2), (3,)])
    with pytest.raises(ValueError, match=r"B=3.*\[2, 2\]"):
        hutils.clip_grad_norm_(params + [torch.randn(2, 2, requires_grad=True)], 1.0)
    with pytest.raises(ValueError, match="0-d"):
        hutils.clip_grad_norm_([torch.tensor(1.0, requires_grad=True)], 1.0)
    with pytest.raises(ValueError, match="at least one parameter"):
        hutils.clip_grad_norm_([], 1.0)
    with pytest.raises(TypeError, match="tensors"):
        hutils.clip_grad_norm_([params[0], "x"], 1.0)
    with pytest.raises(TypeError, match="iterable"):
        hutils.clip_grad_norm_(3, 1.0)
    for bad, msg in [(-1.0, ">= 0"), (math.nan, "NaN"), ([1.0, 2.0], "length B=3"),
                     (torch.ones(4), "length B=3"), ([1.0, -2.0, 3.0], ">= 0")]:
        with pytest.raises(ValueError, match=f"clip_grad_norm_: max_norm.*{msg}"):
            hutils.clip_grad_norm_(params, bad)
        with pytest.raises(ValueError, match=f"clip_grad_value_: clip_value.*{msg}"):
            hutils.clip_grad_value_(params, bad)
    with pytest.raises(TypeError, match="max_norm"):
        hutils.clip_grad_norm_(params, "big")
    with pytest.raises(ValueError, match="max_norm.*length B=3"):
        hutils.clip_grad_norm_([torch.empty(B, 2, device="meta")], torch.ones(2, device="meta"))
    with pytest.raises(TypeError, match="norm_type"):
        hutils.clip_grad_norm_(params, 1.0, norm_type="two")
    with pytest.raises(TypeError, match="foreach"):
        hutils.clip_grad_norm_(params, 1.0, foreach="yes")
    with pytest.raises(ValueError, match=r"total_norm of shape \[B\]=\[3\].*\[2\]"):
        hutils.clip_grads_with_norm_(params, 1.0, torch.ones(2))
    meta = [torch.empty(B, 2, device="meta", requires_grad=True)]
    meta[0].grad = torch.empty_like(meta[0])
    with pytest.raises(RuntimeError, match="foreach=True"):
        hutils.clip_grad_norm_(meta, 1.0, foreach=True)
    # A rejected call changed no gradient.
    before = [p.grad.clone() for p in params]
    with pytest.raises(ValueError):
        hutils.clip_grad_norm_(params, [0.1, 0.1, -1.0])
    assert all(torch.equal(p.grad, g) for p, g in zip(params, before))
