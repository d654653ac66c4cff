"""hfkern.fuse: what forward and the models hold that one captured graph must keep per model.

Custom autograd Functions keep their own backward; ``.data`` and ``.requires_grad`` assignments in
forward are run or refused; configuration values that are not numbers or strings (functions,
enum members, config objects, partials, tensors in containers) and hooks' closures must agree
between the models; models that share tensors, hooks that act only through Python side effects
and views a per-model loop would copy are refused; channels-last requests on array values and
in-place writes whose source overlaps the written tensor behave as in torch. Each working case
runs B separate torch models beside the fused model on fresh random inputs and compares outputs
and gradients.
"""

from __future__ import annotations

import copy
import dataclasses
import enum
import functools
import types

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.testing import assert_close

import hfkern
from hfkern import FuseError

B = 3
TOL = {"rtol": 1e-5, "atol": 1e-5}


def _compare(models, x_shape, calls=2, fuse_kw=None, input_grad=False, eval_mode=False):
    """Fuse copies of ``models``; for ``calls`` fresh inputs compare outputs, the input's gradient
    (``input_grad``) and every parameter's gradient with the separate models'; returns the fused model."""
    fused = hfkern.fuse([copy.deepcopy(m) for m in models], **(fuse_kw or {}))
    if eval_mode:
        fused.eval()
        for m in models:
            m.eval()
    for _ in range(calls):
        x = torch.randn(len(models), *x_shape)
        xs = [x[b].clone().requires_grad_(input_grad) for b in range(len(models))]
        xf = x.clone().requires_grad_(input_grad)
        refs = [m(xs[b]) for b, m in enumerate(models)]
        out = fused(xf)
        ref = torch.stack(refs)
        assert_close(out, ref, **TOL)
        weights = torch.randn_like(ref)
        (ref * weights).sum().backward()
        (out * weights).sum().backward()
        if input_grad:
            assert_close(xf.grad, torch.stack([t.grad for t in xs]), **TOL)
        for name, p in fused.named_parameters():
            theirs = [m.get_parameter(name).grad for m in models]
            if theirs[0] is None:
                assert p.grad is None or not p.grad.any(), name
            else:
                assert_close(p.grad, torch.stack(theirs), **TOL, msg=name)
    return fused


# ---- custom autograd Functions -----------------------------------------------------------------
class RoundSTE(torch.autograd.Function):
    """Rounds; its backward passes the gradient through (the traced ops' derivative is zero)."""

    @staticmethod
    def forward(ctx, x):
        return x.round()

    @staticmethod
    def backward(ctx, g):
        return g


class ScaledClamp(torch.autograd.Function):
    """Saves its input and takes a Python number; a backward no traced op would give."""

    @staticmethod
    def forward(ctx, x, scale):
        ctx.save_for_backward(x)
        ctx.scale = scale
        return x.clamp(-1, 1) * scale, x.sign()

    @staticmethod
    def backward(ctx, g, _):
        (x,) = ctx.saved_tensors
        return g * ctx.scale * torch.exp(-x.abs()), None


class WithFunctions(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 6)
        self.out = nn.Linear(6, 3)

    def forward(self, x):
        h = RoundSTE.apply(self.fc(x) * 2)
        y, sign = ScaledClamp.apply(h, 0.5)
        return self.out(y * sign)


def test_custom_autograd_functions_run_their_own_backward_per_model():
    torch.manual_seed(0)
    fused = _compare([WithFunctions() for _ in range(B)], (5, 4), input_grad=True)
    x = torch.randn(B, 5, 4)
    assert_close(copy.deepcopy(fused)(x), fused(x))
    assert "RoundSTE" in fused.code and "ScaledClamp" in fused.code
    # one call each, not the ops their forward would be traced into
    assert not any(getattr(n.target, "method", None) in ("round", "clamp", "sign") for n in fused.graph.nodes)


# ---- .data and .requires_grad assigned in forward ------------------------------------------
class ShrinksWeight(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 4)

    def forward(self, x):
        self.fc.weight.data = self.fc.weight.data * 0.5
        return self.fc(x)


def test_parameter_data_assigned_through_an_attribute_is_run_per_model():
    torch.manual_seed(1)
    models = [ShrinksWeight() for _ in range(B)]
    fused = _compare(models, (5, 4), calls=3)
    assert_close(fused.get_parameter("fc.weight").detach(), torch.stack([m.fc.weight.detach() for m in models]))


class Refused(nn.Module):
    def __init__(self, kind):
        super().__init__()
        self.fc = nn.Linear(4, 4)
        self.kind = kind

    def forward(self, x):
        h = self.fc(x)
        if self.kind == "data":
            h.data = h.data * 2
        elif self.kind == "grad":
            h.grad = torch.ones_like(h)
        else:
            self.fc.weight.requires_grad = False
        return h


@pytest.mark.parametrize("kind, match", [
    ("data", r"assigns `.data` of a tensor computed in forward.*h.data = h.data \* 2"),
    ("grad", r"assigns `.grad` of a tensor computed in forward"),
    ("requires_grad", r"assigns `.requires_grad` of parameter 'fc.weight'.*requires_grad = False"),
])
def test_assignments_to_tensor_attributes_that_cannot_be_run_are_refused(kind, match):
    with pytest.raises(FuseError, match=match):
        hfkern.fuse([Refused(kind) for _ in range(2)])


class GradientPenalty(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 3)

    def forward(self, x):
        x.requires_grad = True
        y = torch.tanh(self.fc(x))
        (g,) = torch.autograd.grad(y.sum(), x, create_graph=True)
        return y + g.square().sum(-1, keepdim=True)


def test_requires_grad_assigned_to_an_input_is_requires_grad_():
    torch.manual_seed(2)
    _compare([GradientPenalty() for _ in range(B)], (5, 4))


# ---- configuration values that are not plain ----------------------------------------------------
class Kind(enum.Enum):
    A = 1
    B = 2


@dataclasses.dataclass
class Cfg:
    scale: float
    shift: torch.Tensor


class Configured(nn.Module):
    def __init__(self, act, kind, cfg, ns, table, rule):
        super().__init__()
        self.fc = nn.Linear(4, 4)
        self.act, self.kind, self.cfg, self.ns, self.table, self.rule = act, kind, cfg, ns, table, rule
        self.lam = lambda h: h * ns.scale  # a model's own lambda, closing over its own namespace
        self.own = [self.fc.bias, self.fc]  # its own parameter and module: the same where registered alike

    def forward(self, x):
        h = self.act(self.fc(x)) * self.cfg.scale + self.cfg.shift + self.table["w"][0]
        h = self.rule(self.lam(h)) + self.own[0] + self.own[1](h)
        return h if self.kind is Kind.A else -h


def _configured(**changes):
    values = {"act": F.relu, "kind": Kind.A, "cfg": Cfg(1.0, torch.ones(4)), "ns": types.SimpleNamespace(scale=2.0),
              "table": {"w": [torch.full((4,), 0.5)]}, "rule": functools.partial(F.leaky_relu, negative_slope=0.1)}
    values.update(changes)
    return Configured(**values)


def test_models_whose_configuration_objects_are_equal_in_value_fuse():
    """Each model holds its own (equal) config object, partial, namespace, lambda and tensors;
    one whose function differs is refused."""
    torch.manual_seed(3)
    _compare([_configured() for _ in range(B)], (5, 4))
    with pytest.raises(FuseError, match=r"attribute 'act' differs"):
        hfkern.fuse([_configured(), _configured(act=torch.tanh)])


@pytest.mark.parametrize("name, value", [
    ("act", torch.tanh),
    ("kind", Kind.B),
    ("cfg", Cfg(3.0, torch.ones(4))),
    ("cfg", Cfg(1.0, torch.zeros(4))),
    ("ns", types.SimpleNamespace(scale=5.0)),
    ("table", {"w": [torch.full((4,), 2.0)]}),
    ("rule", functools.partial(F.leaky_relu, negative_slope=0.9)),
])
def test_configuration_objects_that_differ_between_the_models_are_refused(name, value):
    torch.manual_seed(4)
    models = [_configured(), _configured(**{name: value})]
    # (the namespace is also in the lambda's closure, an attribute named before it)
    with pytest.raises(FuseError, match=rf"attribute '({name}|lam)' differs.*captured from model 0"):
        hfkern.fuse(models)


@pytest.mark.parametrize("a, b", [({1}, {1, 2}), (torch.float32, torch.float16), (frozenset({1}), frozenset({3}))])
def test_sets_and_dtypes_that_differ_are_refused(a, b):
    models = [nn.Sequential(nn.Linear(2, 2)) for _ in range(2)]
    models[0].option, models[1].option = a, b
    with pytest.raises(FuseError, match=r"attribute 'option' differs"):
        hfkern.fuse(models)


# ---- hooks that differ in what they close over ------------------------------------------------
class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 4)

    def forward(self, x):
        return self.fc(x)


class Hooked(nn.Module):
    def __init__(self):
        super().__init__()
        self.blk = Block()
        self.head = nn.Linear(4, 2)

    def forward(self, x):
        return self.head(self.blk(x))


def _scaled_hook(scale):
    return lambda m, args, out: out * scale


def _scaled(m, args, out, scale):
    return out * scale


@pytest.mark.parametrize("kind", ["closure", "partial"])
def test_hooks_that_differ_in_their_closure_or_arguments_are_refused(kind):
    def hook(scale):
        return _scaled_hook(scale) if kind == "closure" else functools.partial(_scaled, scale=scale)

    models = [Hooked(), Hooked()]
    for m, s in zip(models, (1.0, 5.0)):
        m.blk.register_forward_hook(hook(s))
    with pytest.raises(FuseError, match=r"forward hooks on 'blk' differ between model 0 and model 1"):
        hfkern.fuse(models)
    # equal in value (each model's own closure or partial): run as the models run them
    torch.manual_seed(5)
    models = [Hooked() for _ in range(B)]
    for m in models:
        m.blk.register_forward_hook(hook(3.0))
    _compare(models, (5, 4))


def test_a_hook_that_acts_only_through_python_side_effects_is_refused():
    # returning None but writing the output in place: captured
    torch.manual_seed(6)
    models = [Hooked() for _ in range(B)]
    for m in models:
        m.blk.register_forward_hook(lambda mod, args, out: out.mul_(2))
    _compare(models, (5, 4))
    seen = []
    models = [Hooked() for _ in range(2)]
    for m in models:
        m.blk.register_forward_hook(lambda mod, args, out: seen.append(out.detach()))
    with pytest.raises(FuseError, match=r"forward hook .* on module 'blk' returns None and changes no tensor"):
        hfkern.fuse(models)
    models = [Hooked() for _ in range(2)]
    for m in models:
        m.blk.register_forward_pre_hook(lambda mod, args: print(args))
    with pytest.raises(FuseError, match=r"forward pre-hook .* on module 'blk' returns None"):
        hfkern.fuse(models)


# ---- models that share tensors ------------------------------------------------------------------
class Encoded(nn.Module):
    def __init__(self, enc):
        super().__init__()
        self.enc = enc
        self.head = nn.Linear(4, 2)

    def forward(self, x):
        return self.head(self.enc(x))


def test_models_that_share_a_parameter_or_buffer_are_refused():
    enc = nn.Linear(4, 4)
    with pytest.raises(FuseError, match=r"models 0 and 1 share the parameter or buffer 'enc.weight'"):
        hfkern.fuse([Encoded(enc), Encoded(enc)])
    bn = nn.BatchNorm1d(4)
    with pytest.raises(FuseError, match=r"models 1 and 2 share .*'enc.weight'"):
        hfkern.fuse([Encoded(nn.BatchNorm1d(4)), Encoded(bn), Encoded(bn)])
    m = Encoded(nn.Linear(4, 4))
    with pytest.raises(FuseError, match=r"models 0 and 1 are one model object"):
        hfkern.fuse([m, m])
    # tied within one model stays allowed
    torch.manual_seed(7)
    _compare([Encoded(nn.Linear(4, 4)) for _ in range(B)], (5, 4))


# ---- an attention decoder layer under torch.vmap in eval mode -----------------------------------
class Decoder(nn.Module):
    def __init__(self):
        super().__init__()
        self.d = nn.TransformerDecoderLayer(8, 2, 16, dropout=0.0, batch_first=True)

    def forward(self, a):
        return self.d(a, a)


def test_a_decoder_layer_in_eval_mode_trains_as_torch_trains_it():
    """Under torch.vmap no tensor reads requires_grad, which would send the layer's attention to
    torch's inference fast path (no backward)."""
    torch.manual_seed(8)
    _compare([Decoder() for _ in range(B)], (2, 4, 8), eval_mode=True, input_grad=True)


class Gate(nn.Module):
    def __init__(self):
        super().__init__()
        self.w = nn.Parameter(torch.ones(4))

    def forward(self, x):
        y = x * self.w
        return y * 2 if y.requires_grad else y * 3


class Gated(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 4)
        self.gate = Gate()

    def forward(self, x):
        return self.gate(self.fc(x))


def test_a_vmap_module_reads_requires_grad_as_each_model_would():
    torch.manual_seed(13)
    models = [Gated() for _ in range(B)]
    _compare(models, (5, 4), fuse_kw={"vmap_modules": (Gate,)})
    fused = hfkern.fuse(models, vmap_modules=(Gate,))
    x = torch.randn(B, 5, 4)
    with torch.no_grad():
        assert_close(fused(x), torch.stack([m(x[b]) for b, m in enumerate(models)]))
    assert "requires_grad" not in vars(torch.Tensor)


# ---- loop modules whose result is, or is a view of, their input ----------------------------------
class Passthrough(nn.Module):
    def forward(self, x):
        return x


class InplaceScale(nn.Module):
    def forward(self, x):
        return x.mul_(2)


class Slice(nn.Module):
    def forward(self, x):
        return x[:, :2]


class Aliasing(nn.Module):
    def __init__(self, inner):
        super().__init__()
        self.fc = nn.Linear(3, 3)
        self.inner = inner

    def forward(self, x):
        h = self.fc(x)
        y = self.inner(h)
        y.add_(1.0)
        return h * 2


@pytest.mark.parametrize("inner", [Passthrough, InplaceScale])
def test_a_loop_module_that_returns_its_input_keeps_the_alias(inner):
    torch.manual_seed(9)
    _compare([Aliasing(inner()) for _ in range(B)], (4, 3), fuse_kw={"loop_modules": (inner,)})


def test_a_loop_module_that_returns_another_view_of_its_input_written_later_is_refused():
    fused = hfkern.fuse([Aliasing(Slice()) for _ in range(2)], loop_modules=(Slice,))
    with pytest.raises(FuseError, match=r"Slice module, run once per model \(loop_modules\), returns a view"):
        fused(torch.randn(2, 4, 3))


# ---- channels-last requests on array values ------------------------------------------------------
class ChannelsLast(nn.Module):
    def __init__(self, how):
        super().__init__()
        self.conv = nn.Conv2d(3, 4, 3, padding=1)
        self.how = how

    def forward(self, x):
        cl = torch.channels_last
        if self.how == "contiguous":
            y = x.contiguous(memory_format=cl)
        elif self.how == "to":
            y = x.to(torch.float32, memory_format=cl)
        elif self.how == "clone":
            y = x.clone(memory_format=cl)
        else:
            y = torch.zeros_like(x, memory_format=cl) + x
        return self.conv(y) * 2 + y.sum()


@pytest.mark.parametrize("how", ["contiguous", "to", "clone", "zeros_like"])
def test_channels_last_on_array_values_computes_what_the_models_compute(how):
    torch.manual_seed(10)
    _compare([ChannelsLast(how) for _ in range(B)], (2, 3, 5, 5), input_grad=True)


class ReturnsChannelsLast(nn.Module):
    def __init__(self):
        super().__init__()
        self.w = nn.Parameter(torch.randn(3, 1, 1))

    def forward(self, x):
        return (x * self.w).contiguous(memory_format=torch.channels_last)


def test_each_models_slice_gets_the_channels_last_layout():
    torch.manual_seed(11)
    models = [ReturnsChannelsLast() for _ in range(B)]
    fused = _compare(models, (2, 3, 4, 5))
    out = fused(torch.randn(B, 2, 3, 4, 5))
    assert all(out[b].is_contiguous(memory_format=torch.channels_last) for b in range(B))
    assert not out[0].is_contiguous()


# ---- in-place writes whose source overlaps the written tensor --------------------------------------
class Shifts(nn.Module):
    def __init__(self, overlap):
        super().__init__()
        self.fc = nn.Linear(3, 3)
        self.overlap = overlap

    def forward(self, x):
        h = self.fc(x).contiguous()
        if self.overlap:
            h[1:].copy_(h[:-1])
        else:
            h[2:].copy_(h[:2])
        return h


def test_an_in_place_write_from_an_overlapping_source_is_refused():
    torch.manual_seed(12)
    models = [Shifts(True) for _ in range(2)]
    with pytest.raises(RuntimeError, match="single memory location"):
        models[0](torch.randn(4, 3))
    fused = hfkern.fuse(models)
    with pytest.raises(FuseError, match=r"`Tensor.copy_`.*overlaps one of its arguments in part"):
        fused(torch.randn(2, 4, 3))
    _compare([Shifts(False) for _ in range(B)], (4, 3))
