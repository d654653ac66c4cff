"""hfkern.fuse keeps what the given models are beyond their forward code: each module's
train/eval mode, modules registered under two names, parametrized weights, recurrent modules;
and refuses, naming what to do instead, what a fused model would silently drop (module
hooks it cannot call) or cannot be (a model that is itself a module with an array version)."""

from __future__ import annotations

import copy
import warnings

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.utils import parametrizations, parametrize

import hfkern
from hfkern.fusion import FuseError


def _check_training(models, x, steps=2, lrs=(0.1, 0.05, 0.2), **fuse_kwargs):
    """``fuse(models)`` against deep copies of the models over ``steps`` SGD steps (momentum):
    outputs, gradients, and at the end every state_dict entry; and the unfused models'
    state_dicts load into the originals' class."""
    B = len(models)
    refs = [copy.deepcopy(m) for m in models]
    fused = hfkern.fuse(models, **fuse_kwargs)
    opt = hfkern.optim.SGD(fused.parameters(), lr=list(lrs[:B]), momentum=0.9)
    ref_opts = [torch.optim.SGD(r.parameters(), lr=lr, momentum=0.9) for r, lr in zip(refs, lrs)]
    for step in range(steps):
        xs = x + step
        y = fused(xs)
        ys = torch.stack([r(xs[b]) for b, r in enumerate(refs)])
        torch.testing.assert_close(y, ys, rtol=1e-5, atol=1e-6)
        opt.zero_grad()
        y.square().sum().backward()
        for o in ref_opts:
            o.zero_grad()
        ys.square().sum().backward()
        for name, p in fused.named_parameters():
            ref = torch.stack([r.get_parameter(name).grad for r in refs])
            torch.testing.assert_close(p.grad, ref, rtol=1e-5, atol=1e-6, msg=name)
        opt.step()
        for o in ref_opts:
            o.step()
    state = fused.state_dict()
    for b, r in enumerate(refs):
        assert state.keys() == r.state_dict().keys()
        for k, v in r.state_dict().items():
            torch.testing.assert_close(state[k][b], v, rtol=1e-5, atol=1e-6, msg=k)
    for b, m in enumerate(hfkern.unfuse(fused)):
        assert type(m) is type(models[b]) or parametrize.is_parametrized(m)
        fresh = copy.deepcopy(models[b])
        fresh.load_state_dict(m.state_dict())
        for k, v in fresh.state_dict().items():
            torch.testing.assert_close(v, refs[b].state_dict()[k], rtol=1e-5, atol=1e-6, msg=k)
    return fused


# ---- train/eval modes -----------------------------------------------------------------------
class Frozen(nn.Module):
    def __init__(self):
        super().__init__()
        self.body = nn.Sequential(nn.Linear(4, 6), nn.BatchNorm1d(6), nn.ReLU())
        self.drop = nn.Dropout(0.0)
        self.head = nn.Linear(6, 3)

    def forward(self, x):
        return self.head(F.dropout(self.body(x), 0.0, self.training))


def test_each_module_keeps_its_mode():
    """A batch norm kept in eval mode inside a model that trains (fine-tuning) normalizes with
    its running statistics and leaves them alone, as in the models."""
    B = 3
    torch.manual_seed(0)
    models = [Frozen() for _ in range(B)]
    for m in models:
        m.body[1].running_mean.uniform_(-1, 1)
        m.body[1].eval()
    fused = _check_training(models, torch.randn(B, 5, 4))
    assert fused.training and not fused.body[1].training and fused.body[0].training
    assert all(m.body[1].training is False for m in hfkern.unfuse(fused))
    fused.train()  # as torch: the whole model
    assert fused.body[1].training


def test_models_whose_modules_differ_in_mode_are_refused():
    models = [Frozen() for _ in range(2)]
    models[1].body[1].eval()
    with pytest.raises(FuseError, match=r"module 'body.1' is in training mode in one model and in eval mode"):
        hfkern.fuse(models)


# ---- a module under two names ----------------------------------------------------------------
class Aliased(nn.Module):
    """A Linear (an array module's class) and a module of the model's own each registered under
    two names, called under both."""

    def __init__(self):
        super().__init__()
        self.l = nn.Linear(4, 4)
        self.seq = nn.Sequential(self.l, nn.Tanh())
        self.scale = Scale()
        self.again = self.scale

    def forward(self, x):
        return self.again(self.seq(self.scale(self.l(x))))


class Scale(nn.Module):
    def __init__(self):
        super().__init__()
        self.w = nn.Parameter(torch.randn(4))

    def forward(self, x):
        return x * self.w


def test_a_module_under_two_names_is_one_module_under_both():
    B = 3
    torch.manual_seed(1)
    models = [Aliased() for _ in range(B)]
    fused = _check_training(models, torch.randn(B, 5, 4))
    assert fused.l is fused.seq[0] and fused.scale is fused.again
    assert list(fused.state_dict()) == list(models[0].state_dict())  # l.*, seq.0.*, scale.w, again.w
    assert len(list(fused.parameters())) == 3


# ---- parametrized weights --------------------------------------------------------------------
class Symmetric(nn.Module):
    def forward(self, X):
        return X.triu() + X.triu(1).transpose(-1, -2)


def _parametrized(kind: str) -> nn.Module:
    m = nn.Sequential(nn.Linear(4, 4), nn.Tanh(), nn.Linear(4, 3))
    if kind == "weight_norm":
        parametrizations.weight_norm(m[0])
    elif kind == "spectral_norm":
        parametrizations.spectral_norm(m[0])
    else:
        parametrize.register_parametrization(m[0], "weight", Symmetric())
    return m


@pytest.mark.parametrize("kind", ["weight_norm", "custom"])
def test_parametrized_weights(kind):
    """torch makes a class for every parametrized module: the models' are compared as their
    own class and parametrizations. The module runs per model (under torch.vmap)."""
    B = 3
    torch.manual_seed(2)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # vmap's fallback for aten::_weight_norm
        _check_training([_parametrized(kind) for _ in range(B)], torch.randn(B, 5, 4))


def test_a_parametrization_vmap_cannot_run_says_to_loop_and_loops():
    """spectral_norm's power iteration writes its vectors with out= (no vmap batching rule):
    the forward says to name the class in loop_modules, and with it the models train as torch's."""
    B = 3
    torch.manual_seed(3)
    models = [_parametrized("spectral_norm") for _ in range(B)]
    with pytest.raises(RuntimeError, match=r"parametrized Linear module runs under torch.vmap .*"
                                           r"loop_modules=\(Linear,\)"):
        hfkern.fuse(models)(torch.randn(B, 5, 4))
    _check_training(models, torch.randn(B, 5, 4), loop_modules=(nn.Linear,))


def test_models_with_different_parametrizations_are_refused():
    models = [_parametrized("weight_norm"), _parametrized("custom")]
    with pytest.raises(FuseError, match="differs"):
        hfkern.fuse(models)


# ---- recurrent modules -----------------------------------------------------------------------
class Recurrent(nn.Module):
    def __init__(self, kind: str):
        super().__init__()
        self.kind = kind
        if kind == "lstm":
            self.r = nn.LSTM(4, 5, num_layers=2, batch_first=True, bidirectional=True)
        elif kind == "gru":
            self.r = nn.GRU(4, 5, batch_first=True)
        else:
            self.r = nn.LSTMCell(4, 5)
        self.head = nn.Linear(10 if kind == "lstm" else 5, 2)

    def forward(self, x):
        out = self.r(x)
        return self.head(out[0] if self.kind != "cell" else out[0] * out[1])


@pytest.mark.parametrize("kind", ["lstm", "gru", "cell"])
def test_recurrent_modules_run_in_a_loop_over_the_models(kind):
    """torch.vmap has no batching rule for aten::lstm and its kin: recurrent modules run once
    per model unless named in vmap_modules."""
    B = 3
    torch.manual_seed(4)
    x = torch.randn(B, 3, 6, 4) if kind != "cell" else torch.randn(B, 3, 4)
    fused = _check_training([Recurrent(kind) for _ in range(B)], x)
    call = next(n.target for n in fused.graph.nodes if "per_model" in n.name and hasattr(n.target, "strategy"))
    assert call.strategy == "loop"
    vmapped = hfkern.fuse([Recurrent(kind) for _ in range(B)], vmap_modules=(type(Recurrent(kind).r),))
    with pytest.raises(RuntimeError, match=r"runs under torch.vmap .* loop_modules=\("):
        vmapped(x)


# ---- hooks -----------------------------------------------------------------------------------
def _with_hook(where: str, kind: str = "forward") -> nn.Module:
    m = nn.Sequential(nn.Linear(4, 4), nn.Tanh(), nn.Linear(4, 2))
    target = {"root": m, "linear": m[0], "activation": m[1]}[where]
    if kind == "forward":
        target.register_forward_hook(lambda mod, args, out: out * 2)
    elif kind == "pre":
        target.register_forward_pre_hook(lambda mod, args: (args[0] * 2,))
    else:
        target.register_full_backward_hook(lambda mod, gin, gout: None)
    return m


@pytest.mark.parametrize("where, kind, match", [
    ("root", "forward", r"forward hooks on the model itself"),
    ("root", "pre", r"forward pre-hooks on the model itself"),
    ("linear", "forward", r"forward hooks on '0'.*one array module \(hfkern.nn's Linear\).*fused.get_submodule\('0'\)"),
    ("linear", "pre", r"forward pre-hooks on '0'"),
    ("activation", "backward", r"backward hooks on '1'"),
])
def test_hooks_the_fused_model_would_not_call_are_refused(where, kind, match):
    with pytest.raises(FuseError, match=match):
        hfkern.fuse([_with_hook(where, kind) for _ in range(2)])


def test_hooks_inside_an_array_module_and_torchs_legacy_weight_norm_are_refused():
    class Attention(nn.Module):
        def __init__(self):
            super().__init__()
            self.a = nn.MultiheadAttention(8, 2, batch_first=True)

        def forward(self, x):
            return self.a(x, x, x)[0]

    def attention():
        m = Attention()
        m.a.out_proj.register_forward_hook(lambda *args: None)
        return m

    with pytest.raises(FuseError, match=r"forward hooks on 'a.out_proj' inside 'a'"):
        hfkern.fuse([attention() for _ in range(2)])

    def legacy():
        m = nn.Sequential(nn.Linear(4, 4))
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", FutureWarning)
            torch.nn.utils.weight_norm(m[0])
        return m

    with pytest.raises(FuseError, match=r"torch.nn.utils.weight_norm's: torch.nn.utils.parametrizations"):
        hfkern.fuse([legacy() for _ in range(2)])


def test_forward_hooks_of_captured_modules_run_per_model():
    """A forward hook on a module whose code is captured (an activation) runs in the captured
    call, for every model; models whose hooks differ are refused."""
    B = 3
    torch.manual_seed(5)
    _check_training([_with_hook("activation") for _ in range(B)], torch.randn(B, 5, 4))
    models = [_with_hook("activation"), nn.Sequential(nn.Linear(4, 4), nn.Tanh(), nn.Linear(4, 2))]
    with pytest.raises(FuseError, match=r"forward hooks on '1' differ between model 0 and model 1"):
        hfkern.fuse(models)


# ---- a model that is itself an array module's class ----------------------------------------------
def test_a_model_that_is_a_module_with_an_array_version():
    """A bare batch norm's forward branches on values (not captured): the error names the array
    module to build instead. A bare Linear's forward captures and fuses."""
    with pytest.raises(FuseError, match=r"BatchNorm1d modules themselves.*hfkern.nn.BatchNorm1d.from_modules"):
        hfkern.fuse([nn.BatchNorm1d(4) for _ in range(2)])
    B = 2
    torch.manual_seed(6)
    _check_training([nn.Linear(4, 3) for _ in range(B)], torch.randn(B, 5, 4))


class _AliasedNorm(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 4)
        self.bn = nn.BatchNorm1d(4)
        self.seq = nn.Sequential(self.bn)

    def forward(self, x):
        return self.seq(self.fc(x))


def test_unfused_models_keep_a_module_under_two_names():
    B = 2
    torch.manual_seed(7)
    models = [_AliasedNorm() for _ in range(B)]
    x = torch.randn(8, 4)
    for m in models:
        m(x)  # running statistics of their own
    for b, m in enumerate(hfkern.unfuse(hfkern.fuse(models))):
        assert m.seq[0] is m.bn
        for k, v in models[b].state_dict().items():
            assert torch.equal(m.state_dict()[k], v), k
        torch.testing.assert_close(m.eval()(x), models[b].eval()(x))


# ---- modules of an array class that forward does not call ------------------------------------------
class _TimmAttention(nn.Module):
    """timm's vision-transformer attention (fused_attn): reads its dropout module's p, never calls it."""

    def __init__(self, attn_drop=0.0, proj_drop=0.0):
        super().__init__()
        self.num_heads, self.head_dim = 2, 4
        self.qkv = nn.Linear(8, 24)
        self.attn_drop = nn.Dropout(attn_drop)
        self.proj = nn.Linear(8, 8)
        self.proj_drop = nn.Dropout(proj_drop)

    def forward(self, x):
        B, N, C = x.shape
        qkv = self.qkv(x).reshape(B, N, 3, self.num_heads, self.head_dim).permute(2, 0, 3, 1, 4)
        q, k, v = qkv.unbind(0)
        x = F.scaled_dot_product_attention(q, k, v, dropout_p=self.attn_drop.p if self.training else 0.)
        return self.proj_drop(self.proj(x.transpose(1, 2).reshape(B, N, C)))


def test_configuration_of_an_array_class_module_forward_reads_but_does_not_call():
    """The dropout probability forward reads from a dropout module it never calls is captured as
    model 0's: models that differ in it are refused, naming it. A called dropout keeps its
    probability per model; the unfused models keep both."""
    with pytest.raises(FuseError, match=r"attribute 'attn_drop\.p' differs: model 0 has 0\.0, model 1 has 0\.5"):
        hfkern.fuse([_TimmAttention(attn_drop=0.0), _TimmAttention(attn_drop=0.5)])
    torch.manual_seed(0)
    models = [_TimmAttention(attn_drop=0.25, proj_drop=p) for p in (0.0, 0.5)]
    fused = hfkern.fuse(models)
    for b, m in enumerate(hfkern.unfuse(fused)):
        assert (m.attn_drop.p, m.proj_drop.p) == (0.25, models[b].proj_drop.p)
    x = torch.randn(2, 3, 5, 8)
    fused.eval()
    torch.testing.assert_close(fused(x), torch.stack([m.eval()(x[b]) for b, m in enumerate(models)]))


# ---- reset_model without a factory ---------------------------------------------------------------
class _Attention(nn.Module):
    def __init__(self):
        super().__init__()
        self.att = nn.MultiheadAttention(8, 2, batch_first=True)
        self.fc = nn.Linear(8, 3)

    def forward(self, x):
        return self.fc(self.att(x, x, x, need_weights=False)[0])


class _TiedLM(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(11, 6)
        self.head = nn.Linear(6, 11)
        self.head.weight = self.embed.weight

    def forward(self, idx):
        return self.head(torch.tanh(self.embed(idx)))


@pytest.mark.parametrize("make", [_Attention, _TiedLM])
def test_reset_model_without_a_factory_draws_what_the_constructors_draw(make):
    """Submodules' initializations before their module's (MultiheadAttention zeroes its output
    projection's bias after that Linear's own draw), a tied parameter the module's it is first
    registered in: the fresh slot is what torch.manual_seed(seed); make() gives, exactly."""
    torch.manual_seed(8)
    fused = hfkern.fuse([make() for _ in range(3)])  # from a list: no factory
    before = {k: v.clone() for k, v in fused.state_dict().items()}
    fused.reset_model(1, seed=3)
    torch.manual_seed(3)
    fresh = make()
    state = fused.state_dict()
    for k, v in fresh.state_dict().items():
        assert torch.equal(state[k][1], v), k
        assert torch.equal(state[k][0], before[k][0]) and torch.equal(state[k][2], before[k][2]), k


def test_reset_model_without_a_factory_refuses_parametrized_weights():
    fused = hfkern.fuse([_parametrized("weight_norm") for _ in range(2)])
    before = {k: v.clone() for k, v in fused.state_dict().items()}
    with pytest.raises(ValueError, match=r"parametrizations.weight.original0.*pass factory="):
        fused.reset_model(1, seed=3)
    assert all(torch.equal(v, before[k]) for k, v in fused.state_dict().items())
    fused.reset_model(1, seed=3, factory=lambda: _parametrized("weight_norm"))
