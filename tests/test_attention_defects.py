"""Attention and encoder defects: an array activation (hfkern.nn.PReLU) in an encoder layer, torch
layers with nn.PReLU activations in from_modules, and float masks of another dtype than the query's."""

import contextlib
import re
import warnings

import pytest
import torch
from torch import nn

import hfkern.nn as hnn
import hfkern.nn.attention as attention
from _util import GRAD_TOL, CallCounter, array_input, assert_state_equal, check_against_modules

E, H, FF, S, N = 8, 2, 16, 5, 3


def _prelu_layers(B, **kw):
    """B torch layers with nn.PReLU activations of different slopes."""
    layers = [nn.TransformerEncoderLayer(E, H, FF, 0.0, activation=nn.PReLU(), **kw) for _ in range(B)]
    with torch.no_grad():
        for m in layers:
            m.activation.weight.uniform_(-0.5, 0.5)
    return layers


def _array_prelu_layer(B):
    """An array layer with an array activation of different slopes per model."""
    layer = hnn.TransformerEncoderLayer(E, H, FF, 0.0, activation=hnn.PReLU(B=B), B=B)
    with torch.no_grad():
        layer.activation.weight.uniform_(-0.5, 0.5)
    return layer


# ---- an array activation: each model has its own -------------------------------------------
@pytest.mark.parametrize("B", [1, 3])
def test_array_activation_layer_to_modules_and_extract_model_give_model_bs_activation(B):
    array = _array_prelu_layer(B)
    modules = array.to_modules()
    for b, m in enumerate(modules):
        assert type(m.activation) is nn.PReLU
        assert torch.equal(m.activation.weight, array.activation.weight[b])
        extracted = array.extract_model(b)
        assert type(extracted.activation) is nn.PReLU
        assert torch.equal(extracted.activation.weight, array.activation.weight[b])
        with torch.no_grad():
            extracted.activation.weight.add_(1.0)  # a copy: the array's slope stays
        assert torch.equal(m.activation.weight, array.activation.weight[b])
    assert len({id(m.activation) for m in modules}) == B
    assert_state_equal(array, modules)
    x, xs, leaf = array_input((S, N, E), B)
    check_against_modules(array, modules, x, xs, leaf, {}, [{}] * B)


def test_array_activation_encoder_to_modules_gives_every_layer_its_own_activation():
    B = 2
    array = hnn.TransformerEncoder(_array_prelu_layer(B), 2)
    with torch.no_grad():  # the layers' deep copies start equal: make them differ
        array.layers[1].activation.weight.uniform_(-0.5, 0.5)
    modules = array.to_modules()
    for b, m in enumerate(modules):
        for i, layer in enumerate(m.layers):
            assert type(layer.activation) is nn.PReLU
            assert torch.equal(layer.activation.weight, array.layers[i].activation.weight[b])
        assert m.layers[0].activation is not m.layers[1].activation
    assert_state_equal(array, modules)
    x, xs, leaf = array_input((S, N, E), B)
    check_against_modules(array, modules, x, xs, leaf, {}, [{}] * B)


def test_array_activation_load_model_and_reset_model():
    B = 3
    array = _array_prelu_layer(B)
    before = {k: v.clone() for k, v in array.state_dict().items()}
    (new,) = _prelu_layers(1)
    array.load_model(1, new)
    for k, v in array.state_dict().items():
        assert torch.equal(v[1], new.state_dict()[k]), k
        assert torch.equal(v[0], before[k][0]) and torch.equal(v[2], before[k][2]), k
    # A layer without the array's activation is refused, before anything is written.
    state = {k: v.clone() for k, v in array.state_dict().items()}
    with pytest.raises(ValueError, match="field 'activation' differs"):
        array.load_model(0, nn.TransformerEncoderLayer(E, H, FF, 0.0))
    with pytest.raises(ValueError, match="field 'num_parameters' of 'activation' differs"):
        array.load_model(0, nn.TransformerEncoderLayer(E, H, FF, 0.0, activation=nn.PReLU(2)))
    assert all(torch.equal(v, state[k]) for k, v in array.state_dict().items())
    # A reset model is a new one: the activation too.
    array.reset_model(2, seed=7)
    torch.manual_seed(7)
    ref = nn.TransformerEncoderLayer(E, H, FF, 0.0, activation=nn.PReLU())
    for k, v in ref.state_dict().items():
        assert torch.equal(array.state_dict()[k][2], v), k
    x, xs, leaf = array_input((S, N, E), B)
    check_against_modules(array, array.to_modules(), x, xs, leaf, {}, [{}] * B)


def test_array_activation_of_another_B_is_refused():
    with pytest.raises(ValueError, match=r"activation PReLU holds B=2 models, expected B=3"):
        hnn.TransformerEncoderLayer(E, H, FF, 0.0, activation=hnn.PReLU(B=2), B=3)


# ---- from_modules: torch layers with nn.PReLU activations ------------------------------------
@pytest.mark.parametrize("kw", [{}, {"norm_first": True, "batch_first": True}])
def test_from_modules_with_prelu_activations_matches_torch_and_round_trips(kw):
    B = 3
    modules = _prelu_layers(B, **kw)
    array = hnn.TransformerEncoderLayer.from_modules(modules)
    assert isinstance(array.activation, hnn.PReLU) and array.activation.B == B
    assert_state_equal(array, modules)  # to_modules round-trips too
    shape = (N, S, E) if kw.get("batch_first") else (S, N, E)
    x, xs, leaf = array_input(shape, B)
    check_against_modules(array, modules, x, xs, leaf, {}, [{}] * B)


def test_encoder_from_modules_with_prelu_activations_matches_torch():
    B = 2
    modules = [nn.TransformerEncoder(nn.TransformerEncoderLayer(E, H, FF, 0.0, activation=nn.PReLU()),
                                     2, enable_nested_tensor=False) for _ in range(B)]
    with torch.no_grad():
        for m in modules:
            for layer in m.layers:
                layer.activation.weight.uniform_(-0.5, 0.5)
    array = hnn.TransformerEncoder.from_modules(modules)
    assert_state_equal(array, modules)
    x, xs, leaf = array_input((S, N, E), B)
    check_against_modules(array, modules, x, xs, leaf, {}, [{}] * B)


def test_from_modules_with_activations_it_cannot_hold_per_model():
    class Scale(nn.Module):  # a module with a parameter that hfkern has no array version of
        def __init__(self):
            super().__init__()
            self.s = nn.Parameter(torch.ones(()))

        def forward(self, x):
            return x * self.s

    def layer(activation):
        return nn.TransformerEncoderLayer(E, H, FF, 0.0, activation=activation)

    with pytest.raises(TypeError, match=r"field 'activation' holds a .*Scale with parameters or buffers.*"
                                        r"no array version of it"):
        hnn.TransformerEncoderLayer.from_modules([layer(Scale()), layer(Scale())])
    with pytest.raises(ValueError, match=r"field 'activation' differs: module 0 has PReLU.*module 1 has "
                                         r"<function relu"):
        hnn.TransformerEncoderLayer.from_modules([layer(nn.PReLU()), layer("relu")])
    # a PReLU's init only sets its initial weights: per model, not a differing configuration
    stacked = hnn.TransformerEncoderLayer.from_modules([layer(nn.PReLU()), layer(nn.PReLU(init=0.1))])
    assert stacked.activation.init == (0.25, 0.1)


# ---- float masks of another dtype than the query's -------------------------------------------
MASK_DTYPES = [None, torch.bool, torch.float32, torch.float64, torch.float16]


def _mask(dtype, shape):
    if dtype is None:
        return None
    if dtype == torch.bool:
        m = torch.rand(shape) < 0.3
        m[..., 0] = False  # every query sees a key
        return m
    return torch.randn(shape).to(dtype)


def _torch_error(call):
    try:
        call()
    except RuntimeError as ex:  # torch's dtype errors, raised inside baddbmm or SDPA
        return ex
    return None


def _assert_refused(call, mask_dtypes, query_dtype):
    """``call`` raises TypeError naming the masks' dtypes and the query's."""
    with pytest.raises(TypeError) as info:
        call()
    msg = str(info.value)
    assert "the query's" in msg and str(query_dtype) in msg, msg
    assert any(f"got {d}" in msg for d in mask_dtypes), msg


@contextlib.contextmanager
def _ignore_mixed_mask_warnings():
    """torch's (and hfkern's) deprecation warning for masks of two dtypes: tested elsewhere."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="Support for mismatched")
        yield


def _fail_if_run(module, *_):
    raise AssertionError(f"{type(module).__name__} ran before the masks were checked")


@pytest.mark.parametrize("training", [True, False], ids=["train", "eval"])
@pytest.mark.parametrize("need_weights", [True, False])
@pytest.mark.parametrize("kpm_dtype", MASK_DTYPES, ids=str)
@pytest.mark.parametrize("am_dtype", MASK_DTYPES, ids=str)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=str)
def test_mha_mask_dtypes_like_torch(dtype, am_dtype, kpm_dtype, need_weights, training, monkeypatch):
    # Refused (TypeError naming the dtypes, nothing computed) where torch raises, as torch computes
    # elsewhere: float32 masks without weights, masks whose sum has the query's dtype.
    B = 2
    modules = [nn.MultiheadAttention(E, H, dtype=dtype).train(training) for _ in range(B)]
    array = hnn.MultiheadAttention.from_modules(modules)
    x, xs, leaf = array_input((S, N, E), B, dtype=dtype)
    kw = dict(attn_mask=_mask(am_dtype, (S, S)), key_padding_mask=_mask(kpm_dtype, (N, S)),
              need_weights=need_weights)
    with _ignore_mixed_mask_warnings():
        error = _torch_error(lambda: modules[0](xs[0], xs[0], xs[0], **kw))
        if error is not None:
            projections = CallCounter(monkeypatch, attention, "array_linear")
            array.out_proj.register_forward_pre_hook(_fail_if_run)
            _assert_refused(lambda: array(x, x, x, **kw), [am_dtype, kpm_dtype], dtype)
            assert projections.n == 0
            return
        out, w = array(x, x, x, **kw)
        refs = [m(xb, xb, xb, **kw) for m, xb in zip(modules, xs)]
    torch.testing.assert_close(out, torch.stack([r[0] for r in refs]))
    if need_weights:
        torch.testing.assert_close(w, torch.stack([r[1] for r in refs]))
    g = torch.randn_like(out)
    names, params = zip(*array.named_parameters())
    got = torch.autograd.grad(out, [leaf, *params], g)
    for b, m in enumerate(modules):
        m_params = [dict(m.named_parameters())[n] for n in names]
        ref = torch.autograd.grad(refs[b][0], [xs[b], *m_params], g[b])
        for n, a, r in zip(("input", *names), (got[0][b], *(t[b] for t in got[1:])), ref):
            torch.testing.assert_close(a, r, **GRAD_TOL, msg=lambda s: f"{n}: {s}")




def _encoder(kind, dtype, B):
    if kind == "layer":
        modules = [nn.TransformerEncoderLayer(E, H, FF, 0.0, dtype=dtype) for _ in range(B)]
        return modules, hnn.TransformerEncoderLayer.from_modules(modules), "src_mask"
    modules = [nn.TransformerEncoder(nn.TransformerEncoderLayer(E, H, FF, 0.0, dtype=dtype), 2,
                                     enable_nested_tensor=False) for _ in range(B)]
    return modules, hnn.TransformerEncoder.from_modules(modules), "mask"


@pytest.mark.parametrize("training", [True, False], ids=["train", "eval"])
@pytest.mark.parametrize("kpm_dtype", MASK_DTYPES, ids=str)
@pytest.mark.parametrize("am_dtype", MASK_DTYPES, ids=str)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=str)
@pytest.mark.parametrize("kind", ["layer", "encoder"])
def test_encoder_mask_dtypes_like_torch(kind, dtype, am_dtype, kpm_dtype, training):
    # torch's ordinary path (its fused eval path needs batch_first and no grad: not taken here)
    B = 2
    modules, array, mask_name = _encoder(kind, dtype, B)
    for m in (*modules, array):
        m.train(training)
    x, xs, leaf = array_input((S, N, E), B, dtype=dtype)
    kw = {mask_name: _mask(am_dtype, (S, S)), "src_key_padding_mask": _mask(kpm_dtype, (N, S))}
    with _ignore_mixed_mask_warnings():
        error = _torch_error(lambda: modules[0](xs[0], **kw))
        if error is not None:
            for sub in array.modules():
                if sub is not array:
                    sub.register_forward_pre_hook(_fail_if_run)
            _assert_refused(lambda: array(x, **kw), [am_dtype, kpm_dtype], dtype)
            return
        check_against_modules(array, modules, x, xs, leaf, kw, [kw] * B)


@pytest.mark.parametrize("dropout", [0.0, (0.0, 1.0)], ids=["sdpa", "per_model_dropout"])
def test_mha_is_causal_hint_mask_of_another_dtype_is_accepted_like_torch(dropout):
    # torch uses the hint in place of the mask (no weights, no key padding mask) and never looks
    # at the mask's dtype. Per-model dropout (deterministic at 0 and 1) takes the explicit softmax.
    B = 2
    p = dropout if isinstance(dropout, tuple) else (dropout,) * B
    modules = [nn.MultiheadAttention(E, H, dropout=pb) for pb in p]
    array = hnn.MultiheadAttention.from_modules(modules)
    x, xs, leaf = array_input((S, N, E), B)
    causal = nn.Transformer.generate_square_subsequent_mask(S, dtype=torch.float64)
    kw = dict(attn_mask=causal, need_weights=False, is_causal=True)
    out, _ = array(x, x, x, **kw)
    refs = [m(xb, xb, xb, **kw)[0] for m, xb in zip(modules, xs)]
    torch.testing.assert_close(out, torch.stack(refs))
    g = torch.randn_like(out)
    (gx,) = torch.autograd.grad(out, [leaf], g)
    for b in range(B):
        (ref,) = torch.autograd.grad(refs[b], [xs[b]], g[b])
        torch.testing.assert_close(gx[b], ref, **GRAD_TOL)
    # With a key padding mask torch adds the two: refused as torch refuses.
    with _ignore_mixed_mask_warnings(), pytest.raises(TypeError, match=re.escape("got torch.float64")):
        array(x, x, x, key_padding_mask=torch.zeros(N, S), **kw)


@pytest.mark.parametrize("kind", ["layer", "encoder"])
def test_encoder_is_causal_hint_mask_of_another_dtype_is_accepted_like_torch(kind):
    B = 2
    modules, array, mask_name = _encoder(kind, torch.float32, B)
    x, xs, leaf = array_input((S, N, E), B)
    causal = nn.Transformer.generate_square_subsequent_mask(S, dtype=torch.float64)
    # the encoder detects the causal mask (is_causal=None), as torch does
    kw = {mask_name: causal, **({"is_causal": True} if kind == "layer" else {})}
    check_against_modules(array, modules, x, xs, leaf, kw, [kw] * B)


@pytest.mark.parametrize("need_weights", [True, False])
def test_integer_mask_message_names_the_float_dtypes_taken(need_weights):
    array = hnn.MultiheadAttention(E, H, B=2, dtype=torch.float64)
    x = torch.randn(2, S, N, E, dtype=torch.float64)
    also = "" if need_weights else ", or torch.float32"
    expected = f"torch.bool or a floating dtype (torch.float64, the query's{also}), got torch.int64"
    with pytest.raises(TypeError, match=re.escape(f"expected attn_mask of dtype {expected}")):
        array(x, x, x, attn_mask=torch.zeros(S, S, dtype=torch.int64), need_weights=need_weights)
    with pytest.raises(TypeError, match=re.escape(f"expected key_padding_mask of dtype {expected}")):
        array(x, x, x, key_padding_mask=torch.zeros(N, S, dtype=torch.int64), need_weights=need_weights)
