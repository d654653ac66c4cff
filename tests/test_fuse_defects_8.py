"""hfkern.fuse: configuration, hooks and train/eval modes that one captured graph must respect.

Configuration attributes whose names start with ``_`` and attributes added to a layer that
becomes an array module must agree between the models (signed zeros differ); gradient hooks on
parameters are refused rather than dropped; ``load_model`` refuses what ``fuse`` refuses; the
forward chosen follows the modes of exactly the modules whose ``training`` forward reads (array
layers included), so a frozen backbone in eval mode fuses; buffers registered in forward are
refused. Each working case runs B separate torch models beside the fused model on fresh random
inputs and compares outputs, gradients and buffers.
"""

from __future__ import annotations

import copy
import math

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.testing import assert_close

import hfkern
from hfkern import FuseError

B = 3
TOL = {"rtol": 1e-5, "atol": 1e-5}


def _compare(fused, models, x_shape, calls=2):
    """For ``calls`` fresh inputs, compare ``fused`` with the separate ``models`` (modes as they
    are): outputs, the input's and every parameter's gradient, and every buffer."""
    for _ in range(calls):
        x = torch.randn(len(models), *x_shape)
        xs = [x[b].clone().requires_grad_() for b in range(len(models))]
        xf = x.clone().requires_grad_()
        ref = torch.stack([m(xs[b]) for b, m in enumerate(models)])
        out = fused(xf)
        assert_close(out, ref, **TOL)
        weights = torch.randn_like(ref)
        (ref * weights).sum().backward()
        (out * weights).sum().backward()
        assert_close(xf.grad, torch.stack([t.grad for t in xs]), **TOL)
        # Absolute tolerance on the scale of the step's gradients: a gradient that is zero in
        # exact arithmetic (a linear layer's bias before a training batch norm) is rounding
        # noise of the size of the sums it comes from, in both runs.
        scale = max([m.get_parameter(name).grad.abs().max().item() for name, _ in fused.named_parameters()
                     for m in models if m.get_parameter(name).grad is not None] + [1.0])
        for name, p in fused.named_parameters():
            theirs = [m.get_parameter(name).grad for m in models]
            if theirs[0] is None:
                assert p.grad is None or not p.grad.any(), name
            else:
                assert_close(p.grad, torch.stack(theirs), rtol=TOL["rtol"], atol=TOL["atol"] * scale, msg=name)
        for name, buf in fused.named_buffers():
            assert_close(buf, torch.stack([m.get_buffer(name) for m in models]), **TOL, msg=name)


def _fused_and_copies(models):
    """The fused model of ``models`` and copies of them to run beside it."""
    copies = [copy.deepcopy(m) for m in models]
    return hfkern.fuse(models), copies


# ---- 1. configuration: `_` attributes, attributes added to array layers -------------------------
class Private(nn.Module):
    def __init__(self, scale):
        super().__init__()
        self.conv = nn.Conv2d(2, 3, 3, padding=1, padding_mode="reflect")  # (torch's own `_` attributes)
        self.fc = nn.Linear(3, 4)
        self._scale = scale
        self._act = F.gelu
        self._cache = {}

    def forward(self, x):
        h = self._act(self.conv(x)).mean((2, 3))
        return self.fc(h) * self._scale


class OnLayer(nn.Module):
    def __init__(self, scale):
        super().__init__()
        self.fc = nn.Linear(4, 4)
        self.drop = nn.Dropout(0.0)
        self.fc.scale = scale  # added to a layer that becomes an array module
        self.fc._shift = scale / 2

    def forward(self, x):
        return self.drop(self.fc(x)) * self.fc.scale + self.fc._shift


def test_a_private_configuration_attribute_that_differs_is_refused():
    torch.manual_seed(0)
    with pytest.raises(FuseError, match=r"attribute '_scale' differs: model 0 has 1.0, model 1 has 2.0"):
        hfkern.fuse([Private(1.0), Private(2.0), Private(1.0)])
    fused, models = _fused_and_copies([Private(2.0) for _ in range(B)])
    _compare(fused, models, (5, 2, 6, 6))


def test_an_attribute_added_to_an_array_layer_that_differs_is_refused():
    torch.manual_seed(1)
    with pytest.raises(FuseError, match=r"attribute 'fc._shift' differs: model 0 has 0.5, model 2 has 1.5"):
        hfkern.fuse([OnLayer(1.0), OnLayer(1.0), OnLayer(3.0)])
    models = [OnLayer(3.0) for _ in range(B)]
    models[1].drop.p = 0.0  # the layers' own configuration stays per model (and checked by them)
    fused, models = _fused_and_copies(models)
    _compare(fused, models, (5, 4))
    bad = OnLayer(3.0)
    bad.fc.scale = 1.0
    with pytest.raises(FuseError, match=r"attribute 'fc.scale' differs: the fused architecture has 3.0, "
                                        r"the model has 1.0"):
        fused.load_model(1, bad)


def test_layers_of_different_per_model_configuration_still_fuse():
    """The layers' torch configuration is theirs per model: a dropout's ``p`` may differ."""
    class Net(nn.Module):
        def __init__(self, p):
            super().__init__()
            self.fc = nn.Linear(4, 4)
            self.drop = nn.Dropout(p)

        def forward(self, x):
            return self.drop(self.fc(x))

    fused = hfkern.fuse([Net(p) for p in (0.1, 0.2, 0.3)])
    assert fused.drop.p == (0.1, 0.2, 0.3)


# ---- 2. gradient hooks on parameters ------------------------------------------------------------
def _mlp():
    return nn.Sequential(nn.Linear(4, 4), nn.Tanh(), nn.Linear(4, 2))


@pytest.mark.parametrize("kind", ["register_hook", "register_post_accumulate_grad_hook"])
@pytest.mark.parametrize("which", [0, 2])
def test_gradient_hooks_on_parameters_are_refused_not_dropped(kind, which):
    torch.manual_seed(2)
    models = [_mlp() for _ in range(B)]
    hook = (lambda g: torch.zeros_like(g)) if kind == "register_hook" else (lambda p: p.grad.zero_() and None)
    handle = getattr(models[which][2].bias, kind)(hook)
    how = "gradient hooks" if kind == "register_hook" else "post-accumulate-grad hooks"
    with pytest.raises(FuseError, match=rf"model {which}'s parameter '2.bias' has {how}"):
        hfkern.fuse(models)
    # ... also by load_model
    fused = hfkern.fuse([_mlp() for _ in range(B)])
    before = copy.deepcopy(fused.state_dict())
    with pytest.raises(FuseError, match=rf"load_model: the model's parameter '2.bias' has {how}"):
        fused.load_model(1, models[which])
    for key, value in fused.state_dict().items():
        assert torch.equal(value, before[key]), key
    handle.remove()  # without the hook: fuses, and computes what the models compute
    fused, models = _fused_and_copies(models)
    _compare(fused, models, (5, 4))


# ---- 3. load_model refuses what fuse refuses ---------------------------------------------------
class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 4)

    def forward(self, x):
        return self.fc(x)


class WithConst(nn.Module):
    def __init__(self, const=1.0, unread=0.0):
        super().__init__()
        self.blk = Block()
        self.head = nn.Linear(4, 2)
        self.const = torch.full((4,), const)  # a read-only tensor attribute
        self.unread = torch.full((2,), unread)  # a tensor attribute forward does not read

    def forward(self, x):
        return self.head(self.blk(x) * self.const)


def _hooked(where):
    def make():
        m = WithConst()
        m.get_submodule(where).register_forward_hook(lambda mod, args, out: out * 10)
        return m
    return make


@pytest.mark.parametrize("make_bad, match", [
    (_hooked("blk"), r"the forward hooks on 'blk' differ between {ref} and {it}"),
    (_hooked("head"), r"{it} has forward hooks on 'head', which the fused model would not call"),
    (_hooked(""), r"{it} has forward hooks on the model itself"),
    (lambda: WithConst(const=5.0), r"tensor attribute 'const' \(neither a parameter nor a buffer\) differs"),
])
def test_load_model_refuses_what_fuse_refuses_before_writing(make_bad, match):
    torch.manual_seed(3)
    models = [WithConst() for _ in range(B)]
    fused = hfkern.fuse(models)
    before = copy.deepcopy(fused.state_dict())
    with pytest.raises(FuseError, match="fuse: " + match.format(ref="model 0", it="model 1")):
        hfkern.fuse([models[0], make_bad()])
    with pytest.raises(FuseError, match="load_model: " + match.format(ref="the fused architecture", it="the model")):
        fused.load_model(1, make_bad())
    for key, value in fused.state_dict().items():
        assert torch.equal(value, before[key]), key


class Scaled(nn.Module):
    """A forward hook on a captured block, registered in __init__ and closing over the model."""

    def __init__(self):
        super().__init__()
        self.blk = Block()
        self.head = nn.Linear(4, 2)
        self.gain = 3.0
        self.blk.register_forward_hook(lambda mod, args, out: out * self.gain)

    def forward(self, x):
        return self.head(torch.tanh(self.blk(x)))


def test_load_model_takes_what_fuse_takes():
    """The same hooks as the fused models' (closing over the model itself), a tensor attribute
    forward does not read: loaded, and slot b computes what the loaded model computes."""
    torch.manual_seed(4)
    fused = hfkern.fuse(Scaled, B)
    fused.reset_model(1, seed=7)  # the factory's fresh model: its own hook
    fresh = Scaled()
    fused.load_model(2, fresh)
    torch.manual_seed(7)
    second = Scaled()  # (before extract_model, whose layers' constructors draw)
    models = [fused.extract_model(0), second, copy.deepcopy(fresh)]
    _compare(fused, models, (5, 4))
    torch.manual_seed(5)
    fused = hfkern.fuse([WithConst() for _ in range(B)])
    loaded = WithConst(unread=2.0)
    fused.load_model(0, loaded)
    _compare(fused, [loaded, fused.extract_model(1), fused.extract_model(2)], (5, 4), calls=1)


# ---- 4. a parent reading an array layer's mode ----------------------------------------------
class ReadsLayerMode(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.bn = nn.BatchNorm1d(4)

    def forward(self, x):
        h = self.bn(self.lin(x))
        if self.bn.training:  # the mode of a layer that becomes an array module
            h = h * 3
        return h


def test_a_parent_reading_an_array_layers_mode_follows_that_layers_mode():
    torch.manual_seed(6)
    models = [ReadsLayerMode() for _ in range(B)]
    for m in models:
        m.bn.eval()  # frozen batch-norm statistics, in every model, while the model trains
    fused, models = _fused_and_copies(models)
    _compare(fused, models, (5, 4))
    for mode in (True, False, True):
        fused.train(mode)
        for m in models:
            m.train(mode)
        _compare(fused, models, (5, 4), calls=1)
    fused.bn.eval()  # after fusing: the layer alone
    for m in models:
        m.bn.eval()
    _compare(fused, models, (5, 4), calls=1)


class KeepsLayerInEval(ReadsLayerMode):
    """Its own ``train()`` keeps the batch norm in eval mode (frozen statistics)."""

    def train(self, mode=True):
        super().train(mode)
        self.bn.eval()
        return self


def test_a_layers_mode_read_in_one_value_only_is_still_followed():
    """Capturing "in train mode" calls the model's own ``train()``, which leaves the layer in eval
    mode: the forward read that layer's mode as eval only, and runs what it read where the layer
    trains (as made, before any ``train()`` call) and where it does not."""
    torch.manual_seed(13)
    fused, models = _fused_and_copies([KeepsLayerInEval() for _ in range(B)])
    _compare(fused, models, (5, 4))
    fused.train()
    fused.bn.eval()  # (the fused model's train() is torch's: it does not call the model's own)
    for m in models:
        m.train()
    _compare(fused, models, (5, 4), calls=1)


# ---- 5. modes read only where forward reads them -------------------------------------------
class Backbone(nn.Module):
    """Reads no mode itself (its batch norm reads its own when it runs)."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 4)
        self.bn = nn.BatchNorm1d(4)

    def forward(self, x):
        return torch.relu(self.bn(self.fc(x)))


class FrozenBackbone(nn.Module):
    def __init__(self):
        super().__init__()
        self.backbone = Backbone()
        self.head = nn.Linear(4, 2)

    def forward(self, x):
        h = self.backbone(x)
        if self.training:  # the model's own forward reads its own mode
            h = h * 2 + 1
        return self.head(h)


def test_a_frozen_backbone_in_eval_mode_trains_as_torch_trains_it():
    torch.manual_seed(8)
    models = [FrozenBackbone() for _ in range(B)]
    for m in models:
        m.backbone.eval()
    fused, models = _fused_and_copies(models)
    _compare(fused, models, (5, 4))
    fused.eval()
    for m in models:
        m.eval()
    _compare(fused, models, (5, 4), calls=1)
    fused.train()  # the backbone trains too now; then frozen again after fusing
    fused.backbone.eval()
    for m in models:
        m.train()
        m.backbone.eval()
    _compare(fused, models, (5, 4), calls=1)


class OwnMode(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 4)

    def forward(self, x):
        h = self.fc(x)
        return F.dropout(h, 0.5, self.training) * 0 + (h * 2 if self.training else h)


class TwoModes(nn.Module):
    def __init__(self):
        super().__init__()
        self.blk = OwnMode()
        self.lin = nn.Linear(4, 4)
        self.head = nn.Linear(4, 2)

    def forward(self, x):
        h = self.blk(x)
        if self.lin.training:
            h = h + 1
        return self.head(self.lin(h))


@pytest.mark.parametrize("frozen", ["blk", "lin"])
def test_a_block_that_reads_its_own_mode_in_eval_alone_is_captured_in_those_modes(frozen):
    torch.manual_seed(9)
    models = [TwoModes() for _ in range(B)]
    for m in models:
        m.get_submodule(frozen).eval()
    fused, models = _fused_and_copies(models)
    _compare(fused, models, (5, 4))
    for mode in (False, True):
        fused.train(mode)
        for m in models:
            m.train(mode)
        _compare(fused, models, (5, 4), calls=1)


@pytest.mark.parametrize("frozen", ["blk", "lin"])
def test_modes_set_after_fusing_that_no_capture_serves_are_captured_at_their_first_call(frozen):
    torch.manual_seed(10)
    models = [TwoModes() for _ in range(B)]
    fused, models = _fused_and_copies(models)
    served = len(fused._own_graphs)
    for m in (fused, *models):  # after fusing: a combination no capture was made for
        m.get_submodule(frozen).eval()
    _compare(fused, models, (5, 4), calls=1)
    assert len(fused._own_graphs) == served + 1  # one capture more, in these modes
    for mode in (True, False):
        for m in (fused, *models):
            m.train(mode)
        _compare(fused, models, (5, 4), calls=1)
    for m in (fused, *models):
        m.get_submodule(frozen).eval()
    _compare(fused, models, (5, 4), calls=1)
    assert len(fused._own_graphs) == served + 1  # the capture serves it again


def test_modes_set_after_fusing_are_captured_under_torch_compile_too():
    torch.manual_seed(11)
    models = [TwoModes() for _ in range(B)]
    fused, models = _fused_and_copies(models)
    for m in (fused, *models):
        m.blk.eval()
    compiled = torch.compile(fused, backend="eager")
    x = torch.randn(B, 5, 4)
    torch.manual_seed(0)
    got = compiled(x)
    torch.manual_seed(0)
    want = fused(x)
    torch.testing.assert_close(got, want)


def test_capture_leaves_torch_and_the_models_as_they_were():
    models = [FrozenBackbone() for _ in range(B)]
    hfkern.fuse(models)
    assert "training" not in vars(nn.Module)  # (the capture watches reads of modes only while it runs)
    assert all("train" not in vars(m) for m in models)
    assert [m.backbone.training for m in models] == [True] * B


# ---- 6. signed zeros ----------------------------------------------------------------------------
class Signed(nn.Module):
    def __init__(self, s, table=None):
        super().__init__()
        self.fc = nn.Linear(4, 4)
        self.s = s
        self.table = {"z": torch.zeros(2) if table is None else table}

    def forward(self, x):
        sign = torch.tensor(1.0).copysign(torch.tensor(self.s))
        h = self.fc(x).clamp(-1, 1) + sign
        return h if math.isnan(self.s) else h * self.table["z"].copysign(torch.ones(2)).sum()


def test_signed_zeros_in_the_configuration_differ():
    torch.manual_seed(11)
    with pytest.raises(FuseError, match=r"attribute 's' differs: model 0 has 0.0, model 1 has -0.0"):
        hfkern.fuse([Signed(0.0), Signed(-0.0)])
    with pytest.raises(FuseError, match=r"attribute 'table' differs"):
        hfkern.fuse([Signed(1.0), Signed(1.0, torch.tensor([0.0, -0.0]))])
    for s in (-0.0, float("nan")):  # the same value in every model: fused (NaN is NaN)
        fused, models = _fused_and_copies([Signed(s) for _ in range(B)])
        _compare(fused, models, (5, 4), calls=1)


# ---- 7. buffers registered in forward ---------------------------------------------------------
class RegistersBuffer(nn.Module):
    def __init__(self, again=False):
        super().__init__()
        self.fc = nn.Linear(4, 4)
        if again:
            self.register_buffer("last", torch.zeros(4))

    def forward(self, x):
        h = self.fc(x)
        self.register_buffer("last", h.detach().mean(0))
        return h


class RegistersParameter(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 4)

    def forward(self, x):
        self.register_parameter("extra", nn.Parameter(torch.ones(4)))
        return self.fc(x) * self.extra


class AssignsBuffer(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 4)
        self.register_buffer("last", torch.zeros(4))

    def forward(self, x):
        h = self.fc(x)
        self.last = h.detach().mean(0)
        return h


@pytest.mark.parametrize("make, match", [
    (RegistersBuffer, (r"registers the new buffer 'last' \(`register_buffer` in forward\) in the model's own "
                       r"forward \(RegistersBuffer\).*self.last = value")),
    (lambda: RegistersBuffer(again=True), r"registers buffer 'last' again"),
    (RegistersParameter, r"registers the new parameter 'extra' \(`register_parameter` in forward\)"),
])
def test_state_registered_in_forward_is_refused(make, match):
    models = [make() for _ in range(2)]
    with pytest.raises(FuseError, match=match):
        hfkern.fuse(models)
    assert all(set(m.state_dict()) == set(make().state_dict()) for m in models)  # fusing changed no model


def test_a_buffer_assigned_in_forward_is_still_each_models():
    torch.manual_seed(12)
    fused, models = _fused_and_copies([AssignsBuffer() for _ in range(B)])
    _compare(fused, models, (5, 4))
    assert set(fused.state_dict()) == set(models[0].state_dict())
