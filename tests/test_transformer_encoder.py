"""hfkern.nn.TransformerEncoder against B separate torch.nn.TransformerEncoder models."""

import warnings

import pytest
import torch
from torch import nn

import hfkern
import hfkern.nn as hnn
from hfkern.nn import StateDictError
from _util import array_input, check_against_modules

E, S, N, FF = 12, 5, 4, 20
FWD_TOL = dict(rtol=1e-5, atol=1e-5)

# torch's notice at construction that its nested-tensor path is off for a configuration
pytestmark = pytest.mark.filterwarnings("ignore:enable_nested_tensor is True")


def _randomize(model: nn.Module) -> nn.Module:
    # torch's layers start as copies of one layer with zero biases and unit norm
    # weights: perturb everything so each layer, and each model, is different.
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p), alpha=0.2)
    return model


def _norm(kind):
    if kind is None:
        return None
    if kind == "layer":
        return nn.LayerNorm(E)
    if kind == "layer_nobias":
        return nn.LayerNorm(E, eps=1e-4, bias=False)
    if kind == "rms":
        return nn.RMSNorm(E)
    raise ValueError(kind)


def _encoders(B, *, num_layers=2, norm=None, nhead=3, dropout=0.0, enable_nested_tensor=False, **kw):
    return [
        _randomize(nn.TransformerEncoder(nn.TransformerEncoderLayer(E, nhead, FF, dropout, **kw),
                                         num_layers, _norm(norm), enable_nested_tensor=enable_nested_tensor))
        for _ in range(B)
    ]


def _src_shape(batch_first, batched=True):
    if not batched:
        return (S, E)
    return (N, S, E) if batch_first else (S, N, E)


def _check(*args, fwd_tol=FWD_TOL, **kwargs):
    """Forward, input and per-parameter gradients against the B torch encoders."""
    return check_against_modules(*args, fwd_tol=fwd_tol, **kwargs)


def _state_matches(array, modules):
    sd = array.state_dict()
    for b, m in enumerate(modules):
        msd = m.state_dict()
        assert list(sd) == list(msd)
        for k, v in msd.items():
            assert torch.equal(sd[k][b], v), k


CONFIGS = [
    dict(),
    dict(norm="layer"),
    dict(norm="layer", norm_first=True, batch_first=True),
    dict(norm="rms", batch_first=True, activation="gelu", num_layers=3),
    dict(norm="layer_nobias", norm_first=True, bias=False, num_layers=1, nhead=2),
]


@pytest.mark.parametrize("B", [1, 3])
@pytest.mark.parametrize("kw", CONFIGS)
@pytest.mark.parametrize("mode", ["contiguous", "shared", "batch_major", "strided", "unbatched"])
def test_encoder_matches_torch(B, kw, mode):
    modules = _encoders(B, **kw)
    array = hnn.TransformerEncoder.from_modules(modules)
    assert array.training and array.B == B and array.num_layers == kw.get("num_layers", 2)
    _state_matches(array, modules)
    shape = _src_shape(kw.get("batch_first", False), batched=mode != "unbatched")
    layout = mode if mode in ("batch_major", "strided") else "contiguous"
    x, xs, leaf = array_input(shape, B, shared=mode == "shared", layout=layout)
    if mode not in ("contiguous", "unbatched") and B > 1:
        assert not x.is_contiguous()
    _check(array, modules, x, xs, leaf, {}, [{}] * B, shared=mode == "shared")


def _mask(shape, dtype):
    if dtype == torch.bool:
        m = torch.rand(shape) > 0.6
        m[..., 0] = False  # no fully masked row
        return m
    return torch.randn(shape)


def _causal(dtype):
    m = nn.Transformer.generate_square_subsequent_mask(S)
    return m if dtype == torch.float32 else torch.isinf(m)


def _spy_is_causal(modules):
    """Record the is_causal every layer of ``modules`` receives."""
    seen = []
    for m in modules:
        for layer in m.layers:
            layer.register_forward_pre_hook(lambda mod, args, kwargs: seen.append(kwargs["is_causal"]),
                                            with_kwargs=True)
    return seen


MASKS = [
    # (mask kind, key padding kind, dtype, is_causal, batched)
    ("causal", None, torch.float32, None, True),
    ("causal", None, torch.float32, True, True),
    ("causal", None, torch.bool, None, True),
    ("causal", "shared", torch.float32, None, True),
    ("causal", "model", torch.bool, True, True),
    ("causal", "model", torch.float32, False, False),
    ("model_causal", None, torch.float32, None, True),
    ("SS", "model", torch.float32, None, True),
    ("NH", "shared", torch.bool, None, True),
    ("B1", "model", torch.float32, None, True),
    ("BSS", None, torch.bool, None, True),
    ("BNH", "model", torch.float32, None, False),
    (None, "model", torch.bool, None, True),
    (None, "shared", torch.float32, None, False),
]


@pytest.mark.parametrize("B", [1, 3])
@pytest.mark.parametrize("mask_kind,kpm_kind,dtype,is_causal,batched", MASKS)
@pytest.mark.parametrize("kw", [dict(norm="layer"), dict(norm_first=True, batch_first=True)])
def test_encoder_masks(B, mask_kind, kpm_kind, dtype, is_causal, batched, kw):
    H = 3
    modules = _encoders(B, nhead=H, **kw)
    array = hnn.TransformerEncoder.from_modules(modules)
    x, xs, leaf = array_input(_src_shape(kw.get("batch_first", False), batched), B)
    n = N if batched else 1
    if mask_kind is None:
        m, ms = None, [None] * B
    elif mask_kind == "causal":
        m = _causal(dtype)
        ms = [m] * B
    elif mask_kind == "model_causal":  # one causal mask per model, [B, S, S]
        m = torch.stack([_causal(dtype)] * B)
        ms = [m[b] for b in range(B)]
    elif mask_kind == "SS":
        m = _mask((S, S), dtype)
        ms = [m] * B
    elif mask_kind == "NH":
        m = _mask((n * H, S, S), dtype)
        ms = [m] * B
    elif mask_kind == "B1":
        m = _mask((B, 1, S, S), dtype)
        ms = [m[b, 0] for b in range(B)]
    elif mask_kind == "BSS":
        m = _mask((B, S, S), dtype)
        ms = [m[b] for b in range(B)]
    else:
        m = _mask((B, n * H, S, S), dtype)
        ms = [m[b] for b in range(B)]
    kshape = (N, S) if batched else (S,)
    if kpm_kind is None:
        km, kms = None, [None] * B
    elif kpm_kind == "shared":
        km = _mask(kshape, dtype)
        kms = [km] * B
    else:
        km = _mask((B, *kshape), dtype)
        kms = [km[b] for b in range(B)]
    seen, seen_ref = _spy_is_causal([array]), _spy_is_causal(modules)
    akw = dict(mask=m, src_key_padding_mask=km, is_causal=is_causal)
    _check(array, modules, x, xs, leaf, akw,
           [dict(mask=ms[b], src_key_padding_mask=kms[b], is_causal=is_causal) for b in range(B)])
    # torch's causal detection: the layers get the hint torch's layers get
    nl = len(array.layers)
    assert len(set(seen)) == 1 and seen == seen_ref[:nl]
    assert seen_ref == seen_ref[:nl] * B
    expect = is_causal if is_causal is not None else mask_kind in ("causal", "model_causal")
    assert seen[0] is expect


def test_encoder_causal_detection_per_model():
    # Per-model [B, S, S] masks: the hint is on only when every model's mask is causal.
    B = 3
    modules = _encoders(B)
    array = hnn.TransformerEncoder.from_modules(modules)
    x, xs, leaf = array_input(_src_shape(False), B)
    m = torch.stack([_causal(torch.float32)] * B)
    m[1, 0, 1] = -1.0  # model 1's mask is not causal
    seen = _spy_is_causal([array])
    _check(array, modules, x, xs, leaf, dict(mask=m), [dict(mask=m[b]) for b in range(B)])
    assert seen == [False] * 2
    # a shared per-(sample, head) mask is never detected, as in torch
    nh = torch.stack([_causal(torch.float32)] * (N * 3))
    seen.clear()
    array(x, mask=nh)
    assert seen == [False] * 2


def test_encoder_is_causal_without_mask_raises_like_torch():
    B = 2
    modules = _encoders(B)
    array = hnn.TransformerEncoder.from_modules(modules)
    x = torch.randn(B, S, N, E)
    with pytest.raises(RuntimeError, match="is_causal"):
        modules[0](x[0], is_causal=True)
    with pytest.raises(RuntimeError, match="is_causal"):
        array(x, is_causal=True)


def test_encoder_mixed_mask_dtypes_warn_like_torch():
    B = 2
    modules = _encoders(B)
    array = hnn.TransformerEncoder.from_modules(modules)
    x, xs, leaf = array_input(_src_shape(False), B)
    m, km = _causal(torch.bool), _mask((B, N, S), torch.float32)
    with pytest.warns(UserWarning, match="mismatched src_key_padding_mask and mask"):
        modules[0](xs[0], mask=m, src_key_padding_mask=km[0])
    with pytest.warns(UserWarning, match="mismatched src_key_padding_mask and mask"):
        _check(array, modules, x, xs, leaf, dict(mask=m, src_key_padding_mask=km),
               [dict(mask=m, src_key_padding_mask=km[b]) for b in range(B)])
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        array(x, mask=m, src_key_padding_mask=km)
    assert [str(w.message) for w in record] == [
        "Support for mismatched src_key_padding_mask and mask is deprecated. Use same type for both instead."
    ]  # once, by the encoder: the layers get float masks and do not warn again


@pytest.mark.parametrize("kw", [dict(batch_first=True, norm="layer"), dict(batch_first=True, nhead=2),
                                dict(norm="rms", norm_first=True)])
@pytest.mark.parametrize("masked", [False, True])
@pytest.mark.filterwarnings("ignore:The PyTorch API of nested tensors is in prototype stage")
def test_encoder_eval(kw, masked, monkeypatch):
    # Eval with grad is torch's ordinary path: equal to fp32 tolerance. Eval
    # without grad takes torch's fused layer (batch_first) and, with a padding
    # mask and an even nhead, its nested-tensor path, which returns zeros at
    # padded positions: compared at the unpadded ones.
    nested = []
    real = torch._nested_tensor_from_mask
    monkeypatch.setattr(torch, "_nested_tensor_from_mask", lambda *a, **k: nested.append(1) or real(*a, **k))
    B = 3
    modules = [m.eval() for m in _encoders(B, dropout=0.3, enable_nested_tensor=True, **kw)]
    array = hnn.TransformerEncoder.from_modules(modules)
    assert not array.training and not any(m.training for m in array.modules())
    x, xs, leaf = array_input(_src_shape(kw.get("batch_first", False)), B)
    km = None
    if masked:
        km = torch.zeros(B, N, S, dtype=torch.bool)
        km[:, 0, 3:] = True  # left-aligned padding, as the nested path requires
        km[1, 2, 4:] = True
    akw = dict(src_key_padding_mask=km)
    mkws = [dict(src_key_padding_mask=None if km is None else km[b]) for b in range(B)]
    _check(array, modules, x, xs, leaf, akw, mkws)
    with torch.no_grad():
        y = array(x, **akw)
        ys = torch.stack([m(xs[b], **mkws[b]) for b, m in enumerate(modules)])
    uses_nested = masked and kw.get("nhead", 3) % 2 == 0 and not kw.get("norm_first")
    assert len(nested) == (B if uses_nested else 0)
    if uses_nested:
        keep = ~km if kw.get("batch_first") else ~km.transpose(1, 2)
        y, ys = y[keep], ys[keep]
    torch.testing.assert_close(y, ys, atol=1e-5, rtol=1e-4)


def test_encoder_per_model_dropout():
    # Models with dropout 0 and 1 are deterministic in training and must match their own torch encoders.
    p = [0.0, 1.0, 0.3]
    B = len(p)
    modules = [_encoders(1, dropout=pb, norm="layer")[0] for pb in p]
    array = hnn.TransformerEncoder.from_modules(modules)
    for layer in array.layers:
        assert layer.self_attn.dropout == layer.dropout.p == layer.dropout2.p == tuple(p)
    back = array.to_modules()
    assert [[lay.dropout.p for lay in m.layers] for m in back] == [[pb] * 2 for pb in p]
    x, xs, leaf = array_input(_src_shape(False), B)
    y = array(x)
    for b in (0, 1):
        torch.testing.assert_close(y[b], modules[b](xs[b]), **FWD_TOL)
    assert not torch.allclose(y[2], array(x)[2], atol=1e-4)
    torch.testing.assert_close(array.eval()(x)[2], modules[2].eval()(xs[2]), **FWD_TOL)


def test_encoder_layers_of_one_model_may_differ():
    # torch lets a model's layers differ (a replaced layer); the array's layer i is the models' layer i.
    B = 2
    modules = _encoders(B, num_layers=2, norm="layer")
    for m in modules:
        m.layers[1] = _randomize(nn.TransformerEncoderLayer(E, 2, 7, 0.0, activation="gelu"))
    array = hnn.TransformerEncoder.from_modules(modules)
    assert array.layers[1].linear1.out_features == 7 and array.layers[0].linear1.out_features == FF
    x, xs, leaf = array_input(_src_shape(False), B)
    _check(array, modules, x, xs, leaf, {}, [{}] * B)


# ---- conversion ------------------------------------------------------------------------

@pytest.mark.parametrize("norm", [None, "layer", "rms"])
def test_encoder_to_modules_round_trip(norm):
    B = 3
    modules = _encoders(B, norm=norm, batch_first=True, nhead=2, enable_nested_tensor=True)
    modules[0].layers[0].linear1.weight.requires_grad_(False)  # frozen in every model
    for m in modules[1:]:
        m.layers[0].linear1.weight.requires_grad_(False)
    for m in modules:
        m.layers[1].eval()  # a submodule's own mode survives the round trip
        m.layers.training = False
    array = hnn.TransformerEncoder.from_modules(modules)
    assert not array.layers[0].linear1.weight.requires_grad
    assert array.training and array.layers[0].training and not array.layers[1].training
    assert not array.layers.training
    back = array.to_modules()
    assert all(type(m) is nn.TransformerEncoder for m in back)
    for m, orig in zip(back, modules):
        assert (m.num_layers, m.enable_nested_tensor, m.use_nested_tensor, m.mask_check) == \
               (orig.num_layers, orig.enable_nested_tensor, orig.use_nested_tensor, orig.mask_check)
        assert type(m.norm) is type(orig.norm)
        assert [s.training for s in m.modules()] == [s.training for s in orig.modules()]
        assert [p.requires_grad for p in m.parameters()] == [p.requires_grad for p in orig.parameters()]
        assert m.layers[0] is not m.layers[1]
        orig.load_state_dict(m.state_dict())  # strict: torch's keys and shapes
    _state_matches(array, back)
    x = torch.randn(B, N, S, E)
    km = _mask((B, N, S), torch.bool)
    ys = torch.stack([m(x[b], src_key_padding_mask=km[b]) for b, m in enumerate(back)])
    torch.testing.assert_close(array(x, src_key_padding_mask=km), ys, **FWD_TOL)
    # and back again
    _state_matches(hnn.TransformerEncoder.from_modules(back), back)


def test_encoder_norm_without_parameters():
    B = 2
    modules = [_randomize(nn.TransformerEncoder(nn.TransformerEncoderLayer(E, 3, FF, 0.0), 1,
                                                nn.LayerNorm(E, elementwise_affine=False),
                                                enable_nested_tensor=False)) for _ in range(B)]
    array = hnn.TransformerEncoder.from_modules(modules)
    x, xs, leaf = array_input(_src_shape(False), B)
    _check(array, modules, x, xs, leaf, {}, [{}] * B)
    layer = hnn.TransformerEncoderLayer(E, 3, FF, 0.0, B=B)
    enc = hnn.TransformerEncoder(layer, 2, hnn.LayerNorm(E, elementwise_affine=False))
    back = enc.to_modules()
    assert len(back) == B and all(not m.norm.elementwise_affine for m in back)
    assert enc.norm.B is None  # the given norm is not changed


# ---- construction ----------------------------------------------------------------------

def test_encoder_constructor_and_state():
    B = 3
    layer = hnn.TransformerEncoderLayer(E, 3, FF, 0.1, norm_first=True, B=B)
    norm = hnn.LayerNorm(E, B=B)
    enc = hnn.TransformerEncoder(layer, 2, norm, enable_nested_tensor=False, mask_check=False)
    assert enc.B == B and enc.num_layers == 2 and enc.norm is norm
    assert not enc.enable_nested_tensor and not enc.mask_check
    assert enc.layers[0] is not layer and enc.layers[0] is not enc.layers[1]
    ref = nn.TransformerEncoder(nn.TransformerEncoderLayer(E, 3, FF, norm_first=True), 2, nn.LayerNorm(E),
                                enable_nested_tensor=False)
    sd, ref_sd = enc.state_dict(), ref.state_dict()
    assert list(sd) == list(ref_sd)
    for k, v in ref_sd.items():
        assert sd[k].shape == (B, *v.shape), k
    # deep copies: equal values, separate storage, as torch's _get_clones
    for k, v in layer.state_dict().items():
        assert torch.equal(sd["layers.1." + k], v)
        assert sd["layers.1." + k].data_ptr() != v.data_ptr()
    assert not torch.equal(sd["layers.0.linear1.weight"][0], sd["layers.0.linear1.weight"][1])
    assert "B=3, num_layers=2, enable_nested_tensor=False, mask_check=False" in repr(enc)
    enc.eval()
    assert not any(m.training for m in enc.modules())
    enc.train()
    assert all(m.training for m in enc.modules())
    assert hnn.TransformerEncoder(layer, 1, B=B).B == B
    assert hnn.TransformerEncoder(layer, 1, hnn.RMSNorm(E, B=B)).norm.B == B


def test_encoder_constructor_errors():
    B = 2
    layer = hnn.TransformerEncoderLayer(E, 3, FF, B=B)
    with pytest.raises(TypeError, match=r"hfkern.nn.TransformerEncoderLayer.*got torch.*from_modules"):
        hnn.TransformerEncoder(nn.TransformerEncoderLayer(E, 3, FF), 2)
    with pytest.raises(TypeError, match=r"encoder_layer.*got hfkern.nn.linear.Linear"):
        hnn.TransformerEncoder(hnn.Linear(E, E, B=B), 2)
    with pytest.raises(TypeError, match=r"norm to be None or hfkern.nn.LayerNorm or hfkern.nn.RMSNorm.*"
                                        r"got torch.nn.modules.normalization.LayerNorm.*from_modules"):
        hnn.TransformerEncoder(layer, 2, nn.LayerNorm(E))
    with pytest.raises(TypeError, match=r"norm.*got hfkern.nn.normalization.GroupNorm"):
        hnn.TransformerEncoder(layer, 2, hnn.GroupNorm(3, E, B=B))
    with pytest.raises(ValueError, match=r"norm holds B=3 models, expected B=2"):
        hnn.TransformerEncoder(layer, 2, hnn.LayerNorm(E, B=3))
    with pytest.raises(ValueError, match=r"B=3 but encoder_layer holds B=2"):
        hnn.TransformerEncoder(layer, 2, B=3)
    with pytest.raises(TypeError, match="B must be an int"):
        hnn.TransformerEncoder(layer, 2, B=2.0)
    with pytest.raises(ValueError, match="num_layers >= 1, got 0"):
        hnn.TransformerEncoder(layer, 0)
    for bad in (True, 2.0, "2"):
        with pytest.raises(TypeError, match="num_layers to be an int"):
            hnn.TransformerEncoder(layer, bad)


def test_encoder_load_state_dict_checks():
    B = 2
    enc = hnn.TransformerEncoder(hnn.TransformerEncoderLayer(E, 3, FF, B=B), 2, hnn.LayerNorm(E, B=B))
    before = {k: v.clone() for k, v in enc.state_dict().items()}
    other = hnn.TransformerEncoder(hnn.TransformerEncoderLayer(E, 3, FF, B=3), 2, hnn.LayerNorm(E, B=3))
    with pytest.raises(StateDictError, match=r"layers.0.linear1.weight: the checkpoint holds 3 models"):
        enc.load_state_dict(other.state_dict())
    sd = {k: torch.randn_like(v) for k, v in before.items()}
    del sd["norm.bias"]
    with pytest.raises(StateDictError, match=r'Missing key\(s\) in state_dict: "norm.bias"'):
        enc.load_state_dict(sd)
    for k, v in enc.state_dict().items():
        assert torch.equal(v, before[k]), k  # nothing was written
    sd["norm.bias"] = torch.randn(B, E)
    enc.load_state_dict(sd)
    assert torch.equal(enc.norm.bias, sd["norm.bias"])


def test_encoder_from_modules_errors():
    def enc(layer_kw=None, num_layers=2, norm="layer", **kw):
        layer = nn.TransformerEncoderLayer(E, **(dict(nhead=3, dim_feedforward=FF) | (layer_kw or {})))
        return nn.TransformerEncoder(layer, num_layers, _norm(norm), **(dict(enable_nested_tensor=False) | kw))

    H = hnn.TransformerEncoder
    with pytest.raises(ValueError, match="at least one module"):
        H.from_modules([])
    with pytest.raises(TypeError, match="expected torch.nn.TransformerEncoder modules, got TransformerEncoderLayer"):
        H.from_modules([enc(), nn.TransformerEncoderLayer(E, 3)])
    with pytest.raises(ValueError, match=r"field 'num_layers' differs: module 0 has 2, module 1 has 3"):
        H.from_modules([enc(), enc(num_layers=3)])
    with pytest.raises(ValueError, match=r"field 'norm' differs: module 0 has LayerNorm, module 1 has NoneType"):
        H.from_modules([enc(), enc(norm=None)])
    with pytest.raises(ValueError, match=r"field 'norm' differs: module 0 has LayerNorm, module 1 has RMSNorm"):
        H.from_modules([enc(), enc(norm="rms")])
    with pytest.raises(ValueError, match=r"'norm'.*field 'eps' differs"):
        H.from_modules([enc(), enc(norm="layer_nobias")])
    with pytest.raises(ValueError, match=r"'layers.0'.*field 'norm_first' differs"):
        H.from_modules([enc(), enc(dict(norm_first=True))])
    with pytest.raises(ValueError, match=r"'layers.0'.*field 'nhead' differs: module 0 has 3, module 1 has 4"):
        H.from_modules([enc(), enc(dict(nhead=4))])
    with pytest.raises(ValueError, match=r"field 'enable_nested_tensor' differs"):
        H.from_modules([enc(), enc(enable_nested_tensor=True)])
    with pytest.raises(ValueError, match=r"field 'mask_check' differs"):
        H.from_modules([enc(), enc(mask_check=False)])
    with pytest.raises(ValueError, match=r"field 'training' differs: module 0 has True, module 1 has False"):
        H.from_modules([enc(), enc().eval()])
    odd = enc()
    odd.layers.training = False
    with pytest.raises(ValueError, match=r"field 'layers.training' differs"):
        H.from_modules([enc(), odd])
    odd = enc()
    odd.layers[1].eval()
    with pytest.raises(ValueError, match=r"'layers.1'.*field 'training' differs"):
        H.from_modules([enc(), odd])
    odd = enc()
    odd.layers[1] = nn.TransformerEncoderLayer(E, 3, 7)
    with pytest.raises(ValueError, match=r"'layers.1'.*field 'dim_feedforward' differs"):
        H.from_modules([enc(), odd])
    with pytest.raises(TypeError, match=r"norm to be None or torch.nn.LayerNorm or torch.nn.RMSNorm, got Identity"):
        H.from_modules([nn.TransformerEncoder(nn.TransformerEncoderLayer(E, 3), 1, nn.Identity(),
                                              enable_nested_tensor=False)])


def test_encoder_bad_inputs():
    B = 2
    array = hnn.TransformerEncoder(hnn.TransformerEncoderLayer(E, 3, FF, B=B), 2)
    x = torch.randn(B, S, N, E)
    with pytest.raises(ValueError, match=r"TransformerEncoder: .*B=2, got shape \[3"):
        array(torch.randn(3, S, N, E))
    with pytest.raises(ValueError, match=r"TransformerEncoder: .*d_model=12.*got shape \[2, 5, 4, 10\]"):
        array(torch.randn(B, S, N, 10))
    with pytest.raises(ValueError, match=r"3-D or 4-D.*got 2-D"):
        array(torch.randn(B, E))
    with pytest.raises(TypeError, match="float64"):
        array(x.double())
    with pytest.raises(ValueError, match=r"TransformerEncoder: expected mask of shape \[5, 5\].*got \[4, 5, 5\]"):
        array(x, mask=torch.zeros(4, S, S))
    with pytest.raises(ValueError, match=r"src_key_padding_mask of shape \[4, 5\].*got \[2, 5\]"):
        array(x, src_key_padding_mask=torch.zeros(B, S, dtype=torch.bool))
    with pytest.raises(TypeError, match="mask of dtype torch.bool or a floating dtype \\(torch.float32, the query.s\\), got torch.int32"):
        array(x, mask=torch.zeros(S, S, dtype=torch.int32))


def test_encoder_3d_mask_ambiguous_when_B_equals_N_times_heads():
    H = 2
    B = N * H
    modules = _encoders(B, nhead=H)
    array = hnn.TransformerEncoder.from_modules(modules)
    x, xs, leaf = array_input(_src_shape(False), B)
    m = _mask((B, S, S), torch.float32)
    with pytest.raises(ValueError, match=rf"mask of shape \[{B}, 5, 5\] is ambiguous"):
        array(x, mask=m)
    _check(array, modules, x, xs, leaf, dict(mask=m.unsqueeze(0)), [dict(mask=m)] * B)
    _check(array, modules, x, xs, leaf, dict(mask=m.unsqueeze(1)), [dict(mask=m[b]) for b in range(B)])


def test_encoder_shared_input_and_export():
    assert "TransformerEncoder" in hnn.__all__
    B = 3
    modules = _encoders(B, norm="layer")
    array = hnn.TransformerEncoder.from_modules(modules)
    base = torch.randn(S, N, E)
    y = array(hfkern.broadcast(base, B))
    torch.testing.assert_close(y, torch.stack([m(base) for m in modules]), **FWD_TOL)
