import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import hfkern
from hfkern.nn.transformer import TransformerEncoderLayer
from _util import GRAD_TOL, array_input, assert_state_equal, check_against_modules as _check

E, S, N = 12, 5, 3


def _layers(B, nhead=2, dim_feedforward=13, dropout=0.0, **kw):
    return [nn.TransformerEncoderLayer(E, nhead, dim_feedforward, dropout, **kw) for _ in range(B)]


def _src_shape(batch_first, batched=True):
    if not batched:
        return (S, E)
    return (N, S, E) if batch_first else (S, N, E)


CONFIGS = [
    dict(),
    dict(norm_first=True),
    dict(activation="gelu"),
    dict(activation=F.gelu, norm_first=True, batch_first=True),
    dict(activation=torch.tanh, bias=False),
    dict(bias=False, norm_first=True, nhead=3),
    dict(batch_first=True, nhead=1, layer_norm_eps=1e-3),
    dict(dim_feedforward=7, nhead=4, activation=nn.GELU(approximate="tanh")),  # one module instance
]


@pytest.mark.parametrize("B", [1, 3])
@pytest.mark.parametrize("kw", CONFIGS)
@pytest.mark.parametrize("mode", ["contiguous", "shared", "batch_major", "unbatched"])
def test_encoder_layer_matches_torch(B, kw, mode):
    modules = _layers(B, **kw)
    array = TransformerEncoderLayer.from_modules(modules)
    shape = _src_shape(kw.get("batch_first", False), batched=mode != "unbatched")
    x, xs, leaf = array_input(shape, B, shared=mode == "shared",
                              layout=mode if mode == "batch_major" else "contiguous")
    _check(array, modules, x, xs, leaf, {}, [{}] * B, shared=mode == "shared")
    assert_state_equal(array, modules)


def _mask(shape, dtype):
    if dtype == torch.bool:
        m = torch.rand(shape) > 0.6
        m[..., 0] = False
        return m
    return torch.randn(shape)


MASKS = [
    # (src_mask kind, key padding kind, dtype, batched)
    ("SS", None, torch.bool, True),
    ("SS", "shared", torch.float32, True),
    ("NH", "model", torch.bool, True),
    ("B1", None, torch.float32, True),
    ("B1", "model", torch.bool, True),
    ("BNH", "shared", torch.float32, True),
    (None, "model", torch.bool, True),
    (None, "shared", torch.float32, True),
    ("NH", "model", torch.float32, False),
    ("B1", "shared", torch.bool, False),
]


@pytest.mark.parametrize("B", [1, 3])
@pytest.mark.parametrize("src_kind,kpm_kind,dtype,batched", MASKS)
@pytest.mark.parametrize("kw", [dict(), dict(norm_first=True, batch_first=True, activation="gelu")])
def test_encoder_layer_masks(B, src_kind, kpm_kind, dtype, batched, kw):
    H = 2
    modules = _layers(B, nhead=H, **kw)
    array = TransformerEncoderLayer.from_modules(modules)
    x, xs, leaf = array_input(_src_shape(kw.get("batch_first", False), batched), B)
    n = N if batched else 1
    if src_kind is None:
        sm, sms = None, [None] * B
    elif src_kind == "SS":
        sm = _mask((S, S), dtype)
        sms = [sm] * B
    elif src_kind == "NH":
        sm = _mask((n * H, S, S), dtype)
        sms = [sm] * B
    elif src_kind == "B1":
        sm = _mask((B, 1, S, S), dtype)
        sms = [sm[b, 0] for b in range(B)]
    else:
        sm = _mask((B, n * H, S, S), dtype)
        sms = [sm[b] for b in range(B)]
    kshape = (N, S) if batched else (S,)
    if kpm_kind is None:
        km, kms = None, [None] * B
    elif kpm_kind == "shared":
        km = _mask(kshape, dtype)
        kms = [km] * B
    else:
        km = _mask((B, *kshape), dtype)
        kms = [km[b] for b in range(B)]
    akw = dict(src_mask=sm, src_key_padding_mask=km)
    _check(array, modules, x, xs, leaf, akw, [dict(src_mask=sms[b], src_key_padding_mask=kms[b]) for b in range(B)])


@pytest.mark.parametrize("with_kpm", [False, True])
def test_encoder_layer_is_causal(with_kpm):
    B = 3
    modules = _layers(B)
    array = TransformerEncoderLayer.from_modules(modules)
    x, xs, leaf = array_input(_src_shape(False), B)
    causal = nn.Transformer.generate_square_subsequent_mask(S)
    km = _mask((B, N, S), torch.float32) if with_kpm else None
    akw = dict(src_mask=causal, is_causal=True, src_key_padding_mask=km)
    mkws = [dict(akw, src_key_padding_mask=None if km is None else km[b]) for b in range(B)]
    _check(array, modules, x, xs, leaf, akw, mkws)
    with pytest.raises(RuntimeError, match="is_causal"):
        array(x, is_causal=True)


def test_encoder_layer_mixed_mask_dtypes_warn_like_torch():
    B = 2
    modules = _layers(B)
    array = TransformerEncoderLayer.from_modules(modules)
    x, xs, leaf = array_input(_src_shape(False), B)
    sm, km = _mask((S, S), torch.bool), _mask((B, N, S), torch.float32)
    with pytest.warns(UserWarning, match="mismatched src_key_padding_mask and src_mask"):
        _check(array, modules, x, xs, leaf, dict(src_mask=sm, src_key_padding_mask=km),
               [dict(src_mask=sm, src_key_padding_mask=km[b]) for b in range(B)])


@pytest.mark.parametrize("kw", [dict(batch_first=True), dict(batch_first=True, norm_first=True, activation="gelu"),
                                dict()])
@pytest.mark.parametrize("masked", [False, True])
def test_encoder_layer_eval(kw, masked, monkeypatch):
    # With batch_first, eval and no_grad torch takes its fused encoder path;
    # compared within tolerance. Eval with grad is the ordinary path.
    fused = []
    real = torch._transformer_encoder_layer_fwd
    monkeypatch.setattr(torch, "_transformer_encoder_layer_fwd", lambda *a: fused.append(1) or real(*a))
    B = 3
    modules = [m.eval() for m in _layers(B, dropout=0.3, **kw)]
    array = TransformerEncoderLayer.from_modules(modules)
    assert not array.training
    x, xs, leaf = array_input(_src_shape(kw.get("batch_first", False)), B)
    km = _mask((B, N, S), torch.bool) if masked else None
    akw = dict(src_key_padding_mask=km)
    mkws = [dict(src_key_padding_mask=None if km is None else km[b]) for b in range(B)]
    with torch.no_grad():
        _check(array, modules, x, xs, leaf, akw, mkws, grads=False, fwd_tol=dict(atol=1e-5, rtol=1e-4))
    assert len(fused) == (B if kw.get("batch_first") else 0)
    _check(array, modules, x, xs, leaf, akw, mkws)


def test_encoder_layer_dropout_semantics():
    B = 3
    one = nn.TransformerEncoderLayer(E, 2, 16, dropout=0.3)
    array = TransformerEncoderLayer.from_modules([one] * B)  # identical models
    assert array.training and array.self_attn.dropout == 0.3 and array.dropout.p == 0.3
    x = hfkern.broadcast(torch.randn(S, N, E), B)
    y = array(x)
    for a, b in ((0, 1), (1, 2)):
        assert not torch.allclose(y[a], y[b], atol=1e-3)  # independent draws per model
    y_eval = array.eval()(x)
    torch.testing.assert_close(y_eval, torch.stack([one.eval()(x[0])] * B))
    assert not torch.allclose(y, y_eval, atol=1e-3)


def test_encoder_layer_state_and_init():
    B = 3
    array = TransformerEncoderLayer(E, 2, 13, B=B)
    ref = nn.TransformerEncoderLayer(E, 2, 13)
    sd, ref_sd = array.state_dict(), ref.state_dict()
    assert list(sd) == list(ref_sd)
    for k, v in ref_sd.items():
        assert sd[k].shape == (B, *v.shape), k
    for k in ("self_attn.in_proj_weight", "self_attn.out_proj.weight", "linear1.weight", "linear2.weight",
              "linear1.bias"):
        assert not torch.equal(sd[k][0], sd[k][1]), k
    for k in ("self_attn.in_proj_bias", "self_attn.out_proj.bias", "norm1.bias"):
        assert torch.all(sd[k] == 0), k
    assert torch.all(sd["norm2.weight"] == 1)
    mods = array.to_modules()
    assert_state_equal(array, mods)
    assert all(m.activation is F.relu and m.linear1.out_features == 13 for m in mods)


def test_encoder_layer_config_round_trip():
    array = TransformerEncoderLayer(E, 3, 9, dropout=0.2, activation="gelu", layer_norm_eps=1e-4,
                                    batch_first=True, norm_first=True, bias=False, B=2)
    cfg = TransformerEncoderLayer._config_of(array)
    assert cfg == dict(d_model=E, nhead=3, dim_feedforward=9, dropout=0.2, activation=F.gelu,
                       layer_norm_eps=1e-4, batch_first=True, norm_first=True, bias=False)
    mods = array.to_modules()
    assert TransformerEncoderLayer._config_of(mods[0]) == cfg
    assert_state_equal(TransformerEncoderLayer.from_modules(mods), mods)


def test_encoder_layer_from_modules_rejects_mixed_configs():
    with pytest.raises(ValueError, match="norm_first"):
        TransformerEncoderLayer.from_modules([nn.TransformerEncoderLayer(E, 2, 8),
                                              nn.TransformerEncoderLayer(E, 2, 8, norm_first=True)])
    with pytest.raises(ValueError, match="activation"):
        TransformerEncoderLayer.from_modules([nn.TransformerEncoderLayer(E, 2, 8),
                                              nn.TransformerEncoderLayer(E, 2, 8, activation="gelu")])


def test_encoder_layer_constructor_errors():
    with pytest.raises(TypeError, match="B"):
        TransformerEncoderLayer(E, 2)
    with pytest.raises(RuntimeError, match="relu/gelu"):
        TransformerEncoderLayer(E, 2, activation="tanh", B=2)
    with pytest.raises(TypeError, match="PReLU"):
        TransformerEncoderLayer(E, 2, activation=nn.PReLU(), B=2)


def test_encoder_layer_bad_inputs():
    B = 2
    array = TransformerEncoderLayer(E, 2, 8, B=B)
    x = torch.randn(B, S, N, E)
    with pytest.raises(ValueError, match=r"B=2, got shape \[3"):
        array(torch.randn(3, S, N, E))
    with pytest.raises(ValueError, match=r"d_model=12.*got shape \[2, 5, 3, 10\]"):
        array(torch.randn(B, S, N, 10))
    with pytest.raises(ValueError, match=r"3-D or 4-D.*got 2-D"):
        array(torch.randn(B, E))
    with pytest.raises(TypeError, match="float64"):
        array(x.double())
    with pytest.raises(ValueError, match=r"src_mask of shape \[5, 5\].*got \[4, 5, 5\]"):
        array(x, src_mask=torch.zeros(4, S, S))
    with pytest.raises(ValueError, match=r"src_key_padding_mask of shape \[3, 5\].*got \[2, 5\]"):
        array(x, src_key_padding_mask=torch.zeros(B, S, dtype=torch.bool))
    with pytest.raises(TypeError, match="src_mask of dtype torch.bool or a floating dtype \\(torch.float32, the query.s\\), got torch.int32"):
        array(x, src_mask=torch.zeros(S, S, dtype=torch.int32))


# ---- masks with the array dim ------------------------------------------------------------

@pytest.mark.parametrize("B", [1, 2, 4])
@pytest.mark.parametrize("dtype", [torch.bool, torch.float32])
@pytest.mark.parametrize("kw,batched", [(dict(), True), (dict(batch_first=True, norm_first=True), True),
                                        (dict(), False)])
def test_encoder_layer_per_model_3d_src_mask(B, dtype, kw, batched):
    # One [S, S] mask per model stacked to [B, S, S] (nhead=3, so B != N*nhead),
    # against B torch layers each with its own mask; with per-model padding masks.
    modules = _layers(B, nhead=3, **kw)
    array = TransformerEncoderLayer.from_modules(modules)
    x, xs, leaf = array_input(_src_shape(kw.get("batch_first", False), batched), B)
    sm = _mask((B, S, S), dtype)
    km = _mask((B, N, S) if batched else (B, S), dtype)
    _check(array, modules, x, xs, leaf, dict(src_mask=sm, src_key_padding_mask=km),
           [dict(src_mask=sm[b], src_key_padding_mask=km[b]) for b in range(B)])


@pytest.mark.parametrize("batched", [True, False])
def test_encoder_layer_3d_src_mask_ambiguous_when_B_equals_N_times_heads(batched):
    H = 2
    B = (N if batched else 1) * H
    modules = _layers(B, nhead=H)
    array = TransformerEncoderLayer.from_modules(modules)
    x, xs, leaf = array_input(_src_shape(False, batched), B)
    sm = _mask((B, S, S), torch.float32)
    with pytest.raises(ValueError, match=rf"src_mask of shape \[{B}, 5, 5\] is ambiguous.*"
                                         rf"\[1, {B}, 5, 5\].*\[{B}, 1, 5, 5\]"):
        array(x, src_mask=sm)
    # the two explicit spellings: torch's shared per-(sample, head) mask, one mask per model
    _check(array, modules, x, xs, leaf, dict(src_mask=sm.unsqueeze(0)), [dict(src_mask=sm)] * B)
    _check(array, modules, x, xs, leaf, dict(src_mask=sm.unsqueeze(1)), [dict(src_mask=sm[b]) for b in range(B)])


# ---- per-model dropout -------------------------------------------------------------------

@pytest.mark.parametrize("norm_first", [False, True])
def test_encoder_layer_per_model_dropout(norm_first):
    # Models with dropout 0 and 1 are deterministic in training and must match
    # their own torch layers, forward and backward; every dropout of the layer
    # takes the model's probability.
    p = [0.0, 1.0, 0.3]
    B = len(p)
    modules = [nn.TransformerEncoderLayer(E, 2, 13, dropout=pb, norm_first=norm_first) for pb in p]
    array = TransformerEncoderLayer.from_modules(modules)
    assert array.self_attn.dropout == tuple(p)
    assert array.dropout.p == array.dropout1.p == array.dropout2.p == tuple(p)
    back = array.to_modules()
    assert [(m.dropout.p, m.dropout1.p, m.dropout2.p, m.self_attn.dropout) for m in back] == [(pb,) * 4 for pb in p]
    assert TransformerEncoderLayer._config_of(array)["dropout"] == tuple(p)
    x, xs, leaf = array_input(_src_shape(False), B)
    y = array(x)
    g = torch.randn_like(y)
    names, params = zip(*array.named_parameters())
    got = dict(zip(("x",) + names, torch.autograd.grad(y, [leaf, *params], g)))
    for b in (0, 1):
        ref = modules[b](xs[b])
        torch.testing.assert_close(y[b], ref)
        m_names, m_params = zip(*modules[b].named_parameters())
        ref_g = torch.autograd.grad(ref, [xs[b], *m_params], g[b])
        torch.testing.assert_close(got["x"][b], ref_g[0], **GRAD_TOL)
        for n, rg in zip(m_names, ref_g[1:]):
            torch.testing.assert_close(got[n][b], rg, **GRAD_TOL, msg=lambda s: f"{n}: {s}")
    # model 2 is random in training and its own torch layer in eval
    assert not torch.allclose(y[2], array(x)[2], atol=1e-4)
    torch.testing.assert_close(array.eval()(x)[2], modules[2].eval()(xs[2]))


def test_encoder_layer_per_model_dropout_forms_and_errors():
    np = pytest.importorskip("numpy")
    layer = TransformerEncoderLayer(E, 2, 8, dropout=np.array([0.1, 0.2]), B=2)
    assert layer.self_attn.dropout == (0.1, 0.2) and layer.dropout2.p == (0.1, 0.2)
    with pytest.raises(ValueError, match=r"TransformerEncoderLayer: .*length B=2\), got 3"):
        TransformerEncoderLayer(E, 2, 8, dropout=[0.1, 0.2, 0.3], B=2)
    with pytest.raises(ValueError, match=r"dropout\[0\] is -0.5"):
        TransformerEncoderLayer(E, 2, 8, dropout=[-0.5, 0.2], B=2)


def test_encoder_layer_from_modules_keeps_every_submodules_mode():
    # A layer in training whose dropouts and attention are in eval: the array keeps each mode
    # (it set every submodule to the layer's, and ran its dropouts).
    def layer():
        m = nn.TransformerEncoderLayer(E, 2, 13, dropout=0.5).train()
        for sub in m.modules():
            if isinstance(sub, (nn.Dropout, nn.MultiheadAttention)):
                sub.eval()
        return m

    modules = [layer() for _ in range(2)]
    array = TransformerEncoderLayer.from_modules(modules)
    want = {path: sub.training for path, sub in modules[0].named_modules()}
    assert {path: sub.training for path, sub in array.named_modules()} == want
    x = torch.randn(2, S, N, E)
    for b, m in enumerate(modules):
        torch.testing.assert_close(array(x)[b], m(x[b]))
    encoder = hfkern.nn.TransformerEncoder.from_modules(
        [nn.TransformerEncoder(m, 2, enable_nested_tensor=False) for m in modules])
    assert not any(sub.training for sub in encoder.modules() if isinstance(sub, hfkern.nn.Dropout))
    # Models that disagree on a submodule's mode are refused, naming it.
    modules[1].dropout1.train()
    with pytest.raises(ValueError, match=r"field 'dropout1.training' differs: module 0 has False, module 1 has True"):
        TransformerEncoderLayer.from_modules(modules)


def test_from_modules_keeps_the_submodules_own_dropout_probabilities():
    # torch lets a layer's dropouts differ from its `dropout` (attention dropout off, say); the
    # array took the layer's one value for all of them, fused models too.
    def layer(p1):
        m = nn.TransformerEncoderLayer(E, 2, 13, dropout=0.1)
        m.self_attn.dropout = 0.0
        m.dropout1.p = p1
        return m

    modules = [layer(0.5), layer(0.3)]
    array = TransformerEncoderLayer.from_modules(modules)
    fused = hfkern.fuse([nn.Sequential(m) for m in modules])
    for a in (array, fused.get_submodule("0")):
        assert a.self_attn.dropout == 0.0 and a.dropout1.p == (0.5, 0.3) and a.dropout2.p == 0.1
    for back in (array.to_modules(), [m[0] for m in hfkern.unfuse(fused)]):
        assert [(m.self_attn.dropout, m.dropout1.p, m.dropout2.p) for m in back] == [(0.0, 0.5, 0.1), (0.0, 0.3, 0.1)]


def test_an_activation_module_is_compared_by_its_settings():
    # Layers built with activation=nn.GELU() were refused as differing (modules compared by
    # identity), by from_modules, fuse and load_model of an extracted model; an extracted model
    # shared the array's activation object.
    def layer(approximate="none"):
        return nn.TransformerEncoderLayer(E, 2, 13, dropout=0.0, activation=nn.GELU(approximate))

    modules = [layer(), layer()]
    array = TransformerEncoderLayer.from_modules(modules)
    x = torch.randn(2, S, N, E)
    for b, m in enumerate(modules):
        torch.testing.assert_close(array(x)[b], m(x[b]))
    extracted = array.extract_model(0)
    assert extracted.activation is not array.activation
    array.load_model(1, copy.deepcopy(extracted))
    hfkern.fuse([nn.Sequential(m) for m in modules])
    with pytest.raises(ValueError, match="field 'activation' differs"):
        TransformerEncoderLayer.from_modules([layer(), layer("tanh")])
    with pytest.raises(ValueError, match="field 'activation' differs"):
        array.load_model(0, layer("tanh"))
