import math

import pytest
import torch
from torch import nn

import hfkern
import hfkern.nn.attention as attention_mod
from hfkern.nn.attention import MultiheadAttention
from _util import GRAD_TOL, array_input, assert_state_equal

L, S, N = 5, 7, 3


def _modules(B, E=12, H=3, **kw):
    return [nn.MultiheadAttention(E, H, **kw) for _ in range(B)]


def _qkv(B, mha, how, *, batched=True, layout="contiguous"):
    """Array query/key/value and per-model ones; ``how`` names which are the same tensor.

    how: "self" (q is k is v), "kv" (k is v), "distinct"; a "shared_" prefix makes
    the inputs hfkern.broadcast views, "mixed" shares only the query.
    Returns (array_qkv, per_model_qkv, leaves, shared_flags).
    """
    E, kd, vd = mha.embed_dim, mha.kdim, mha.vdim
    bf = mha.batch_first

    def shape(seq, feat):
        if not batched:
            return (seq, feat)
        return (N, seq, feat) if bf else (seq, N, feat)

    shared = how.startswith("shared_")
    base = how.removeprefix("shared_")
    lay = layout if batched else "contiguous"
    if base == "self":
        x, xs, leaf = array_input(shape(L, E), B, shared=shared, layout=lay)
        return (x, x, x), [(xb, xb, xb) for xb in xs], [leaf], [shared]
    q, qs, ql = array_input(shape(L, E), B, shared=shared or base == "mixed", layout=lay)
    k, ks, kl = array_input(shape(S, kd), B, shared=shared, layout=lay)
    if base == "kv":
        return (q, k, k), [(a, b, b) for a, b in zip(qs, ks)], [ql, kl], [shared or base == "mixed", shared]
    v, vs, vl = array_input(shape(S, vd), B, shared=shared, layout=lay)
    return ((q, k, v), list(zip(qs, ks, vs)), [ql, kl, vl],
            [shared or base == "mixed", shared, shared])


def _check(array, modules, qkv, qkv_models, leaves, shared, akw, mkws, *, grads=True,
           fwd_tol=None, grad_tol=GRAD_TOL):
    """Forward (output and weights) and gradients (inputs, parameters by name) against torch."""
    fwd_tol = fwd_tol or {}
    out, w = array(*qkv, **akw)
    refs = [m(*qkv_models[b], **mkws[b]) for b, m in enumerate(modules)]
    torch.testing.assert_close(out, torch.stack([r[0] for r in refs]), **fwd_tol)
    if refs[0][1] is None:
        assert w is None
    else:
        torch.testing.assert_close(w, torch.stack([r[1] for r in refs]), **fwd_tol)
    if not grads:
        return out, w
    outs = [out] + ([w] if w is not None else [])
    gouts = [torch.randn_like(t) for t in outs]
    names = [n for n, p in array.named_parameters()]
    params = [p for n, p in array.named_parameters()]
    got = torch.autograd.grad(outs, leaves + params, gouts, allow_unused=True)
    got_in, got_p = got[:len(leaves)], dict(zip(names, got[len(leaves):]))
    shared_sum = [0] * len(leaves)
    for b, m in enumerate(modules):
        # the distinct per-model inputs, in the order of the array's leaves
        m_in = list({id(t): t for t in qkv_models[b]}.values())
        m_names = [n for n, _ in m.named_parameters()]
        assert sorted(m_names) == sorted(names)
        m_outs = [refs[b][0]] + ([refs[b][1]] if w is not None else [])
        ref = torch.autograd.grad(m_outs, m_in + [p for _, p in m.named_parameters()],
                                  [g[b] for g in gouts], allow_unused=True)
        for i in range(len(leaves)):
            if shared[i]:
                shared_sum[i] = shared_sum[i] + ref[i]
            else:
                torch.testing.assert_close(got_in[i][b], ref[i], **grad_tol)
        for n, g in zip(m_names, ref[len(m_in):]):
            if g is None:
                assert got_p[n] is None or torch.all(got_p[n][b] == 0), n
            else:
                torch.testing.assert_close(got_p[n][b], g, **grad_tol, msg=lambda s: f"{n}: {s}")
    for i in range(len(leaves)):
        if shared[i]:
            torch.testing.assert_close(got_in[i], shared_sum[i], **grad_tol)
    return out, w


CONFIGS = [
    dict(),
    dict(batch_first=True),
    dict(bias=False),
    dict(add_bias_kv=True),
    dict(add_zero_attn=True),
    dict(add_bias_kv=True, add_zero_attn=True, batch_first=True, H=4),
    dict(kdim=6, vdim=5),
    dict(kdim=7, vdim=7, bias=False, batch_first=True, H=1),
    dict(E=8, H=2, dropout=0.3),  # compared in eval mode; dropout semantics are tested below
]
WEIGHTS = [(True, True), (True, False), (False, True)]


def _hows(kw, full):
    E = kw.get("E", 12)
    if kw.get("kdim", E) != E or kw.get("vdim", E) != E:
        hows = ["distinct", "shared_distinct", "mixed"]
        return hows + ["kv"] if kw.get("kdim") == kw.get("vdim") else hows
    return ["self", "shared_self", "kv", "distinct", "mixed"] if full else ["self", "shared_self", "mixed"]


CASES = ([(3, kw, how) for i, kw in enumerate(CONFIGS) for how in _hows(kw, i < 2)]
         + [(1, kw, how) for kw in CONFIGS[:2] + CONFIGS[5:7] for how in _hows(kw, False)])


@pytest.mark.parametrize("B,kw,how", CASES)
@pytest.mark.parametrize("need_weights,average", WEIGHTS)
def test_mha_matches_torch(B, kw, how, need_weights, average):
    modules = _modules(B, **kw)
    if kw.get("dropout", 0) > 0:
        for m in modules:
            m.eval()
    array = MultiheadAttention.from_modules(modules)
    assert array.training == modules[0].training
    qkv, qkv_m, leaves, shared = _qkv(B, array, how)
    akw = dict(need_weights=need_weights, average_attn_weights=average)
    _check(array, modules, qkv, qkv_m, leaves, shared, akw, [akw] * B)
    assert_state_equal(array, modules)


@pytest.mark.parametrize("B", [1, 3])
@pytest.mark.parametrize("kw,how", [
    (dict(), "self"), (dict(), "shared_self"), (dict(batch_first=True, add_bias_kv=True), "distinct"),
    (dict(kdim=6, vdim=5), "mixed"), (dict(kdim=6, vdim=5, add_zero_attn=True), "shared_distinct"),
])
@pytest.mark.parametrize("need_weights,average", WEIGHTS)
def test_mha_unbatched(B, kw, how, need_weights, average):
    modules = _modules(B, **kw)
    array = MultiheadAttention.from_modules(modules)
    qkv, qkv_m, leaves, shared = _qkv(B, array, how, batched=False)
    akw = dict(need_weights=need_weights, average_attn_weights=average)
    out, w = _check(array, modules, qkv, qkv_m, leaves, shared, akw, [akw] * B)
    assert out.shape == (B, L, 12)


@pytest.mark.parametrize("layout", ["batch_major", "strided"])
@pytest.mark.parametrize("kw", [dict(), dict(batch_first=True)])
@pytest.mark.parametrize("how", ["self", "distinct"])
def test_mha_noncontiguous_inputs(layout, kw, how):
    B = 3
    modules = _modules(B, **kw)
    array = MultiheadAttention.from_modules(modules)
    qkv, qkv_m, leaves, shared = _qkv(B, array, how, layout=layout)
    assert not qkv[0].is_contiguous()
    for nw in (True, False):
        _check(array, modules, qkv, qkv_m, leaves, shared, dict(need_weights=nw), [dict(need_weights=nw)] * B)


# ---- masks ---------------------------------------------------------------------

def _bool_or_float(shape, dtype):
    if dtype == torch.bool:
        m = torch.rand(shape) > 0.6
        m[..., 0] = False  # no fully masked row
        return m
    return torch.randn(shape)


def _attn_mask(kind, dtype, B, H, batched):
    n = N if batched else 1
    if kind is None:
        return None, [None] * B
    if kind == "LS":
        m = _bool_or_float((L, S), dtype)
        return m, [m] * B
    if kind == "NH":
        m = _bool_or_float((n * H, L, S), dtype)
        # with B == n*H the 3-D form is ambiguous: the explicit shared 4-D form
        return (m.unsqueeze(0) if B == n * H and B > 1 else m), [m] * B
    if kind == "BLS":  # one [L, S] mask per model, stacked
        m = _bool_or_float((B, L, S), dtype)
        return m, list(m)
    if kind == "1NH":
        m = _bool_or_float((1, n * H, L, S), dtype)
        return m, [m[0]] * B
    if kind == "11":
        m = _bool_or_float((1, 1, L, S), dtype)
        return m, [m[0, 0]] * B
    if kind == "B1":
        m = _bool_or_float((B, 1, L, S), dtype)
        return m, [m[b, 0] for b in range(B)]
    if kind == "BNH":
        m = _bool_or_float((B, n * H, L, S), dtype)
        return m, [m[b] for b in range(B)]
    if kind == "broadcast":  # a shared mask passed as a per-model stride-0 view
        m = _bool_or_float((L, S), dtype)
        return hfkern.broadcast(m.unsqueeze(0), B), [m] * B
    raise ValueError(kind)


def _kpm(kind, dtype, B, batched, seq=S):
    shape = (N, seq) if batched else (seq,)
    if kind is None:
        return None, [None] * B
    if kind == "shared":
        m = _bool_or_float(shape, dtype)
        return m, [m] * B
    m = _bool_or_float((B, *shape), dtype)
    return m, [m[b] for b in range(B)]


MASK_LAYOUTS = [
    (dict(), True),
    (dict(batch_first=True, add_bias_kv=True, add_zero_attn=True), True),
    (dict(), False),
]
ATTN_KINDS = [None, "LS", "NH", "B1", "BNH", "broadcast"]
KPM_KINDS = [None, "shared", "model"]
# Every attention-mask kind meets every padding-mask kind, and (Latin square)
# every layout.
MASK_CASES = (
    [(3, a, k, *MASK_LAYOUTS[(i + j) % 3]) for i, a in enumerate(ATTN_KINDS) for j, k in enumerate(KPM_KINDS)]
    + [(1, a, "model", *MASK_LAYOUTS[i]) for i, a in enumerate(["B1", "BNH", "LS"])]
)


@pytest.mark.parametrize("B,attn_kind,kpm_kind,kw,batched", MASK_CASES)
@pytest.mark.parametrize("dtype,need_weights", [
    (torch.bool, False), (torch.bool, True), (torch.float32, False), (torch.float32, True)])
def test_mha_masks(B, attn_kind, kpm_kind, dtype, need_weights, kw, batched):
    H = 3
    modules = _modules(B, H=H, **kw)
    array = MultiheadAttention.from_modules(modules)
    qkv, qkv_m, leaves, shared = _qkv(B, array, "kv" if B == 1 else "distinct", batched=batched)
    am, ams = _attn_mask(attn_kind, dtype, B, H, batched)
    kp, kps = _kpm(kpm_kind, dtype, B, batched)
    akw = dict(attn_mask=am, key_padding_mask=kp, need_weights=need_weights, average_attn_weights=False)
    mkws = [dict(attn_mask=ams[b], key_padding_mask=kps[b], need_weights=need_weights,
                 average_attn_weights=False) for b in range(B)]
    _check(array, modules, qkv, qkv_m, leaves, shared, akw, mkws)


def test_mha_mixed_mask_dtypes_warn_like_torch():
    B = 2
    modules = _modules(B)
    array = MultiheadAttention.from_modules(modules)
    qkv, qkv_m, leaves, shared = _qkv(B, array, "distinct")
    am = _bool_or_float((L, S), torch.bool)
    kp = _bool_or_float((B, N, S), torch.float32)
    with pytest.warns(UserWarning, match="mismatched"):
        _check(array, modules, qkv, qkv_m, leaves, shared, dict(attn_mask=am, key_padding_mask=kp),
               [dict(attn_mask=am, key_padding_mask=kp[b]) for b in range(B)])


@pytest.mark.parametrize("batched", [True, False])
@pytest.mark.parametrize("dtype", [torch.bool, torch.float32])
@pytest.mark.parametrize("B", [1, 2, 4])
def test_mha_masks_with_array_dim(B, dtype, batched):
    # One [L, S] mask per model stacked to [B, L, S] (the array-dim-first form),
    # and the explicit 4-D shared forms, against B torch modules with each
    # model's own mask; H = 3 keeps B != N*H (and != H unbatched).
    H = 3
    modules = _modules(B, H=H)
    array = MultiheadAttention.from_modules(modules)
    qkv, qkv_m, leaves, shared = _qkv(B, array, "distinct", batched=batched)
    kp, kps = _kpm("model", dtype, B, batched)
    for kind, nw in [(kind, nw) for kind in ("BLS", "1NH", "11") for nw in (True, False)]:
        am, ams = _attn_mask(kind, dtype, B, H, batched)
        akw = dict(attn_mask=am, key_padding_mask=kp, need_weights=nw, average_attn_weights=False)
        mkws = [dict(akw, attn_mask=ams[b], key_padding_mask=kps[b]) for b in range(B)]
        _check(array, modules, qkv, qkv_m, leaves, shared, akw, mkws)


@pytest.mark.parametrize("batched", [True, False])
def test_mha_3d_mask_ambiguous_when_B_equals_N_times_heads(batched):
    H = 2
    n = N if batched else 1
    B = n * H
    modules = _modules(B, E=8, H=H)
    array = MultiheadAttention.from_modules(modules)
    qkv, qkv_m, leaves, shared = _qkv(B, array, "distinct", batched=batched)
    m = torch.randn(B, L, S)
    with pytest.raises(ValueError, match=rf"attn_mask of shape \[{B}, 5, 7\] is ambiguous.*"
                                         rf"\[1, {B}, 5, 7\].*\[{B}, 1, 5, 7\]"):
        array(*qkv, attn_mask=m)
    for nw in (True, False):
        # the explicit spellings: torch's shared per-(sample, head) mask ...
        _check(array, modules, qkv, qkv_m, leaves, shared, dict(attn_mask=m.unsqueeze(0), need_weights=nw),
               [dict(attn_mask=m, need_weights=nw)] * B)
        # ... and one [L, S] mask per model
        _check(array, modules, qkv, qkv_m, leaves, shared, dict(attn_mask=m.unsqueeze(1), need_weights=nw),
               [dict(attn_mask=m[b], need_weights=nw) for b in range(B)])


@pytest.mark.parametrize("need_weights", [True, False])
@pytest.mark.parametrize("with_kpm", [False, True])
@pytest.mark.parametrize("kw", [dict(), dict(add_zero_attn=True, batch_first=True)])
def test_mha_is_causal(need_weights, with_kpm, kw):
    B = 3
    modules = _modules(B, **kw)
    array = MultiheadAttention.from_modules(modules)
    qkv, qkv_m, leaves, shared = _qkv(B, array, "self")
    causal = nn.Transformer.generate_square_subsequent_mask(L)
    kp, kps = _kpm("model" if with_kpm else None, torch.float32, B, True, seq=L)
    akw = dict(attn_mask=causal, is_causal=True, need_weights=need_weights, key_padding_mask=kp)
    mkws = [dict(akw, key_padding_mask=kps[b]) for b in range(B)]
    _check(array, modules, qkv, qkv_m, leaves, shared, akw, mkws)


def test_mha_is_causal_hint_replaces_the_mask_like_torch():
    # Without a padding mask and without weights torch trusts the hint over the
    # mask it was given; the array must do the same.
    B = 2
    modules = _modules(B)
    array = MultiheadAttention.from_modules(modules)
    qkv, qkv_m, leaves, shared = _qkv(B, array, "self")
    not_causal = torch.randn(B, 1, L, L)
    out, _ = array(*qkv, attn_mask=not_causal, is_causal=True, need_weights=False)
    ref, _ = array(*qkv, attn_mask=nn.Transformer.generate_square_subsequent_mask(L), need_weights=False)
    torch.testing.assert_close(out, ref)
    with pytest.raises(RuntimeError, match="is_causal"):
        array(*qkv, is_causal=True)


# ---- train / eval ----------------------------------------------------------------

@pytest.mark.parametrize("need_weights", [True, False])
@pytest.mark.parametrize("masked", [False, True])
def test_mha_eval_fast_path(need_weights, masked, monkeypatch):
    # batch_first self-attention in eval under no_grad takes torch's fused path.
    fused = []
    real = torch._native_multi_head_attention
    monkeypatch.setattr(torch, "_native_multi_head_attention", lambda *a: fused.append(1) or real(*a))
    B = 3
    modules = [m.eval() for m in _modules(B, E=8, H=2, batch_first=True)]
    array = MultiheadAttention.from_modules(modules)
    assert not array.training
    x, xs, _ = array_input((N, L, 8), B, requires_grad=False)
    kp, kps = _kpm("model" if masked else None, torch.bool, B, True, seq=L)
    with torch.no_grad():
        out, w = array(x, x, x, key_padding_mask=kp, need_weights=need_weights)
        refs = [m(xs[b], xs[b], xs[b], key_padding_mask=kps[b], need_weights=need_weights)
                for b, m in enumerate(modules)]
    assert len(fused) == B
    tol = dict(atol=1e-5, rtol=1e-4)
    torch.testing.assert_close(out, torch.stack([r[0] for r in refs]), **tol)
    if need_weights:
        torch.testing.assert_close(w, torch.stack([r[1] for r in refs]), **tol)


def test_mha_eval_with_grad_matches_torch():
    B = 3
    modules = [m.eval() for m in _modules(B, dropout=0.5)]
    array = MultiheadAttention.from_modules(modules)
    qkv, qkv_m, leaves, shared = _qkv(B, array, "distinct")
    for nw in (True, False):
        _check(array, modules, qkv, qkv_m, leaves, shared, dict(need_weights=nw), [dict(need_weights=nw)] * B)
    assert [m.training for m in array.to_modules()] == [False] * B


def test_mha_dropout_weights_semantics():
    # Returned weights are the dropped-out ones (as torch): zero, or the eval
    # weight scaled by 1/(1-p); the drop pattern is independent per model.
    B, p = 3, 0.4
    one = nn.MultiheadAttention(8, 2, dropout=p)
    array = MultiheadAttention.from_modules([one] * B)  # B identical models
    x = hfkern.broadcast(torch.randn(L, 64, 8), B)
    w_train = array(x, x, x, average_attn_weights=False)[1]
    w_eval = array.eval()(x, x, x, average_attn_weights=False)[1]
    zero = w_train == 0
    assert abs(zero.float().mean().item() - p) < 0.03
    torch.testing.assert_close(w_train[~zero], w_eval[~zero] / (1 - p))
    assert not torch.equal(zero[0], zero[1]) and not torch.equal(zero[1], zero[2])
    torch.testing.assert_close(w_eval[0], w_eval[1])


def test_mha_dropout_sdpa_semantics():
    # need_weights=False: unbiased (mean over many samples is the eval output),
    # random, and independent per model.
    B, p, reps = 2, 0.5, 4000
    one = nn.MultiheadAttention(4, 1, dropout=p)
    array = MultiheadAttention.from_modules([one] * B)
    x = hfkern.broadcast(torch.randn(3, 1, 4).expand(3, reps, 4), B)
    out = array(x, x, x, need_weights=False)[0]  # [B, L, reps, E]
    ref = array.eval()(x, x, x, need_weights=False)[0]
    assert not torch.allclose(out[0], ref[0], atol=1e-3)
    assert not torch.allclose(out[0], out[1], atol=1e-3)
    torch.testing.assert_close(ref[:, :, 0], ref[:, :, 1])
    se = out.std(dim=2) / math.sqrt(reps)
    assert ((out.mean(dim=2) - ref[:, :, 0]).abs() < 5 * se + 1e-6).all()


# ---- structure, init, conversion -----------------------------------------------

def test_mha_self_attention_projects_once(monkeypatch):
    calls = []
    real = attention_mod.array_linear
    monkeypatch.setattr(attention_mod, "array_linear", lambda *a: calls.append(1) or real(*a))
    array = MultiheadAttention(12, 3, B=2)
    x, y, z = (torch.randn(2, L, N, 12) for _ in range(3))
    for args, n in (((x, x, x), 1), ((x, y, y), 2), ((x, y, z), 3)):
        calls.clear()
        array(*args)
        assert len(calls) == n


@pytest.mark.parametrize("kw", [dict(), dict(kdim=20, vdim=40, add_bias_kv=True), dict(bias=False)])
def test_mha_init_per_model(kw):
    B, E = 3, 64
    array = MultiheadAttention(E, 4, B=B, **kw)
    ref = nn.MultiheadAttention(E, 4, **kw)
    sd, ref_sd = array.state_dict(), ref.state_dict()
    assert set(sd) == set(ref_sd)
    for k, v in ref_sd.items():
        assert sd[k].shape == (B, *v.shape), k
    weights = ["in_proj_weight"] if "kdim" not in kw else ["q_proj_weight", "k_proj_weight", "v_proj_weight"]
    for name in weights + ["out_proj.weight"]:
        w = sd[name]
        if name == "out_proj.weight":
            bound = 1 / math.sqrt(E)
        else:
            bound = math.sqrt(6 / (w.size(1) + w.size(2)))
        for b in range(B):
            assert w[b].abs().max() <= bound
            assert abs(w[b].std().item() - bound / math.sqrt(3)) < 0.1 * bound
        assert not torch.equal(w[0], w[1])
    for name in ("in_proj_bias", "out_proj.bias"):
        if name in sd:
            assert torch.all(sd[name] == 0)
    if "bias_k" in sd:
        for name in ("bias_k", "bias_v"):
            t = sd[name]
            assert not torch.equal(t[0], t[1])
            std = t.reshape(B, -1).std(dim=1)
            assert ((std - 1 / math.sqrt(E)).abs() < 0.3 / math.sqrt(E)).all(), std


def test_mha_from_modules_rejects_mixed_configs():
    with pytest.raises(ValueError, match="add_bias_kv"):
        MultiheadAttention.from_modules([nn.MultiheadAttention(8, 2), nn.MultiheadAttention(8, 2, add_bias_kv=True)])
    with pytest.raises(ValueError, match="bias"):
        MultiheadAttention.from_modules([nn.MultiheadAttention(8, 2), nn.MultiheadAttention(8, 2, bias=False)])


def test_mha_to_modules_round_trip():
    array = MultiheadAttention(8, 2, kdim=3, vdim=5, add_bias_kv=True, batch_first=True, dropout=0.2, B=3)
    mods = array.to_modules()
    assert all(m.kdim == 3 and m.vdim == 5 and m.batch_first and m.dropout == 0.2 for m in mods)
    assert all(m.bias_k is not None and m.in_proj_bias is not None for m in mods)
    assert_state_equal(array, mods)
    assert_state_equal(MultiheadAttention.from_modules(mods), mods)


# ---- bad input ---------------------------------------------------------------------

def test_mha_constructor_errors():
    with pytest.raises(TypeError, match="B"):
        MultiheadAttention(8, 2)
    with pytest.raises(ValueError, match="B must be >= 1"):
        MultiheadAttention(8, 2, B=0)
    with pytest.raises(AssertionError, match="divisible"):
        MultiheadAttention(8, 3, B=2)
    with pytest.raises(ValueError, match="greater than 0"):
        MultiheadAttention(0, 1, B=2)


def test_mha_bad_inputs():
    B = 2
    a = MultiheadAttention(8, 2, B=B)
    x = torch.randn(B, L, N, 8)
    with pytest.raises(ValueError, match=r"leading \(array\) dim B=2, got shape \[3"):
        a(torch.randn(3, L, N, 8), x, x)
    with pytest.raises(ValueError, match=r"3-D or 4-D.*got 5-D"):
        a(torch.randn(B, 1, L, N, 8), x, x)
    with pytest.raises(ValueError, match=r"key of 4-D.*got 3-D"):
        a(x, torch.randn(B, S, 8), torch.randn(B, S, 8))
    with pytest.raises(ValueError, match=r"query with 8 features.*got shape \[2, 5, 3, 6\]"):
        a(torch.randn(B, L, N, 6), x, x)
    with pytest.raises(ValueError, match=r"value with 8 features"):
        a(x, x, torch.randn(B, L, N, 7))
    with pytest.raises(ValueError, match="key and value must agree"):
        a(x, torch.randn(B, S, N, 8), torch.randn(B, S + 1, N, 8))
    with pytest.raises(ValueError, match="same batch size N"):
        a(x, torch.randn(B, S, N + 1, 8), torch.randn(B, S, N + 1, 8))
    with pytest.raises(TypeError, match="float64"):
        a(x.double(), x, x)
    with pytest.raises(TypeError, match="query to be a torch.Tensor"):
        a([1.0], x, x)


def test_mha_bad_masks():
    B = 2
    a = MultiheadAttention(8, 2, B=B)
    x = torch.randn(B, L, N, 8)
    with pytest.raises(ValueError, match=r"key_padding_mask of shape \[3, 5\].*\[2, 3, 5\].*got \[4, 5\]"):
        a(x, x, x, key_padding_mask=torch.zeros(4, L, dtype=torch.bool))
    with pytest.raises(ValueError, match=r"attn_mask of shape \[5, 5\] or \[6, 5, 5\].*\[2, 5, 5\].*got \[4, 5, 5\]"):
        a(x, x, x, attn_mask=torch.zeros(4, L, L, dtype=torch.bool))
    with pytest.raises(ValueError, match=r"got \[2, 6, 5, 4\]"):
        a(x, x, x, attn_mask=torch.zeros(B, N * 2, L, L - 1))
    with pytest.raises(ValueError, match=r"got \[3, 1, 5, 5\]"):
        a(x, x, x, attn_mask=torch.zeros(3, 1, L, L))
    with pytest.raises(TypeError, match=r"torch.bool or a floating dtype \(torch.float32, the query's\), got torch.int64"):
        a(x, x, x, attn_mask=torch.zeros(L, L, dtype=torch.long))
    with pytest.raises(ValueError, match="attn_mask is on meta but query is on cpu"):
        a(x, x, x, attn_mask=torch.zeros(L, L, device="meta"))
    u = torch.randn(B, L, 8)
    with pytest.raises(ValueError, match=r"key_padding_mask of shape \[5\].*\[2, 5\]"):
        a(u, u, u, key_padding_mask=torch.zeros(N, L, dtype=torch.bool))
    with pytest.raises(ValueError, match=r"\[5, 5\] or \[2, 5, 5\] \(shared\).*got \[3, 5, 5\]"):
        a(u, u, u, attn_mask=torch.zeros(N, L, L))


# ---- per-model dropout --------------------------------------------------------------

@pytest.mark.parametrize("need_weights", [True, False])
@pytest.mark.parametrize("how", ["self", "shared_self", "distinct"])
def test_mha_per_model_dropout_p0_p1_match_torch(how, need_weights):
    # Models with dropout 0 or 1 are deterministic in training: each must match
    # its own torch module (from to_modules), forward and backward, whatever
    # the model with dropout 0.5 beside them draws.
    p = [0.0, 1.0, 0.5, 1.0]
    B = len(p)
    modules = [nn.MultiheadAttention(12, 3, dropout=pb) for pb in p]
    array = MultiheadAttention.from_modules(modules)
    assert array.training and array.dropout == tuple(p)
    assert [m.dropout for m in array.to_modules()] == p
    qkv, qkv_m, leaves, shared = _qkv(B, array, how)
    out, w = array(*qkv, need_weights=need_weights, average_attn_weights=False)
    g = torch.randn_like(out)
    params = [q for _, q in array.named_parameters()]
    got = torch.autograd.grad(out, params, g)
    got = dict(zip([n for n, _ in array.named_parameters()], got))
    for b in (0, 1, 3):
        ref, ref_w = modules[b](*qkv_m[b], need_weights=need_weights, average_attn_weights=False)
        torch.testing.assert_close(out[b], ref)
        if need_weights:
            torch.testing.assert_close(w[b], ref_w)
            if p[b] == 1.0:
                assert (w[b] == 0).all()
        names = [n for n, _ in modules[b].named_parameters()]
        ref_g = torch.autograd.grad(ref, [q for _, q in modules[b].named_parameters()], g[b],
                                    allow_unused=True)
        for n, rg in zip(names, ref_g):
            if rg is None:
                assert torch.all(got[n][b] == 0), n
            else:
                torch.testing.assert_close(got[n][b], rg, **GRAD_TOL, msg=lambda s: f"{n}: {s}")


@pytest.mark.parametrize("dropout", [0.0, (0.0, 1.0)], ids=["sdpa", "per_model_dropout"])
@pytest.mark.parametrize("dtype", [torch.float64, torch.bfloat16])
def test_mha_float_mask_of_another_dtype_than_the_query(dtype, dropout):
    # torch's module passes a float mask as it is to scaled_dot_product_attention (a float32
    # causal mask from generate_square_subsequent_mask on a float64 model): accepted here too.
    B, E, H, L, N = 2, 8, 2, 5, 3
    p = dropout if isinstance(dropout, tuple) else (dropout,) * B
    modules = [nn.MultiheadAttention(E, H, dropout=pb, batch_first=True).to(dtype) for pb in p]
    array = MultiheadAttention.from_modules(modules)
    x = torch.randn(B, N, L, E, dtype=dtype)
    causal = nn.Transformer.generate_square_subsequent_mask(L)  # float32
    kpm = torch.zeros(N, L)
    kpm[1, 3:] = -1e4
    out, _ = array(x, x, x, attn_mask=causal, key_padding_mask=kpm, need_weights=False)
    tol = {} if dtype == torch.float64 else {"rtol": 2e-2, "atol": 2e-2}
    for b in range(B):
        ref, _ = modules[b](x[b], x[b], x[b], attn_mask=causal, key_padding_mask=kpm, need_weights=False)
        torch.testing.assert_close(out[b], ref, **tol)


@pytest.mark.parametrize("mask", ["key_padding", "attn"])
def test_mha_per_model_dropout_query_with_every_key_masked_matches_torch(mask):
    # torch's module attends through scaled_dot_product_attention when it returns no weights: a
    # query whose every key is masked gets zeros (the output projection's bias), no NaN, and no
    # NaN gradients. Per-model dropout takes the explicit softmax, which must do the same.
    p = [0.0, 1.0, 0.5]
    B, E, H, L, N = len(p), 8, 2, 5, 3
    modules = [nn.MultiheadAttention(E, H, dropout=pb) for pb in p]
    array = MultiheadAttention.from_modules(modules)
    x = torch.randn(B, L, N, E, requires_grad=True)
    kwargs = {}
    if mask == "key_padding":
        kpm = torch.zeros(N, L, dtype=torch.bool)
        kpm[1] = True  # sample 1: every key padded
        kpm[2, 3:] = True
        kwargs["key_padding_mask"] = kpm
    else:
        am = torch.zeros(L, L)
        am[2] = -math.inf  # query 2 sees no key
        am[4, :2] = -math.inf
        kwargs["attn_mask"] = am
    out, _ = array(x, x, x, need_weights=False, **kwargs)
    assert torch.isfinite(out).all()
    g = torch.randn_like(out)
    names = [n for n, _ in array.named_parameters()]
    *got, gx = torch.autograd.grad(out, [q for _, q in array.named_parameters()] + [x], g)
    assert torch.isfinite(gx).all() and all(torch.isfinite(t).all() for t in got)
    for b in (0, 1):
        xb = x[b].detach().requires_grad_()
        ref, _ = modules[b](xb, xb, xb, need_weights=False, **kwargs)
        torch.testing.assert_close(out[b], ref)
        *ref_g, ref_gx = torch.autograd.grad(ref, [q for _, q in modules[b].named_parameters()] + [xb], g[b])
        torch.testing.assert_close(gx[b], ref_gx, **GRAD_TOL)
        for n, t, rg in zip(names, got, ref_g):
            torch.testing.assert_close(t[b], rg, **GRAD_TOL, msg=lambda s: f"{n}: {s}")


def test_mha_per_model_dropout_weights_semantics():
    # Model b zeroes its attention weights with its own probability and scales
    # the kept ones by 1/(1-p_b); models with equal p draw independently.
    p = [0.2, 0.6, 0.6]
    B = len(p)
    one = nn.MultiheadAttention(8, 2)
    array = MultiheadAttention(8, 2, dropout=torch.tensor(p, dtype=torch.float64), B=B)
    array.load_state_dict({k: torch.stack([v] * B) for k, v in one.state_dict().items()})
    x = hfkern.broadcast(torch.randn(L, 64, 8), B)
    w_train = array(x, x, x, average_attn_weights=False)[1]
    w_eval = array.eval()(x, x, x, average_attn_weights=False)[1]
    for b, pb in enumerate(p):
        zero = w_train[b] == 0
        assert abs(zero.float().mean().item() - pb) < 0.03, b
        torch.testing.assert_close(w_train[b][~zero], w_eval[b][~zero] / (1 - pb))
    assert not torch.equal(w_train[1] == 0, w_train[2] == 0)


def test_mha_per_model_dropout_without_weights_is_unbiased():
    # need_weights=False with per-model probabilities: random, independent per
    # model, and each model's mean over many samples is its eval output.
    p, reps = [0.3, 0.7], 4000
    B = len(p)
    one = nn.MultiheadAttention(4, 1)
    array = MultiheadAttention(4, 1, dropout=p, B=B)
    array.load_state_dict({k: torch.stack([v] * B) for k, v in one.state_dict().items()})
    x = hfkern.broadcast(torch.randn(3, 1, 4).expand(3, reps, 4), B)
    out = array(x, x, x, need_weights=False)[0]  # [B, L, reps, E]
    ref = array.eval()(x, x, x, need_weights=False)[0]
    for b in range(B):
        assert not torch.allclose(out[b], ref[b], atol=1e-3)
    assert not torch.allclose(out[0], out[1], atol=1e-3)
    se = out.std(dim=2) / math.sqrt(reps)
    assert ((out.mean(dim=2) - ref[:, :, 0]).abs() < 5 * se + 1e-6).all()
    # model 1 drops more: its samples spread more
    assert (out[1].std(dim=1) > out[0].std(dim=1)).float().mean() > 0.9


def test_mha_per_model_dropout_is_causal_and_bad_values():
    # is_causal with per-model dropout takes the explicit path with the given causal mask
    B = 2
    modules = [nn.MultiheadAttention(12, 3, dropout=pb) for pb in (0.0, 1.0)]
    array = MultiheadAttention.from_modules(modules)
    qkv, qkv_m, _, _ = _qkv(B, array, "self")
    causal = nn.Transformer.generate_square_subsequent_mask(L)
    out, _ = array(*qkv, attn_mask=causal, is_causal=True, need_weights=False)
    for b in range(B):
        ref, _ = modules[b](*qkv_m[b], attn_mask=causal, is_causal=True, need_weights=False)
        torch.testing.assert_close(out[b], ref)
    with pytest.raises(ValueError, match=r"one value per model \(length B=2\), got 3"):
        MultiheadAttention(8, 2, dropout=[0.1, 0.2, 0.3], B=2)
    with pytest.raises(ValueError, match=r"dropout\[1\] is 2.0"):
        MultiheadAttention(8, 2, dropout=[0.1, 2.0], B=2)
