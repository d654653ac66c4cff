"""Whole fused models through torch.save / torch.load and copy.deepcopy.

A loaded model (and its optimizer, saved in the same file) must go on exactly
as the original: the same outputs in both modes, the same next training step,
the same generated code. The factory given to ``hfkern.fuse`` travels where
pickle can save it; where it cannot (a lambda), saving still works and
``reset_model`` on the loaded model asks for ``factory=``.
"""

from __future__ import annotations

import copy
import io

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import hfkern
from _fuse_models import ARCHITECTURES, DigitsCNN


def _round_trip(obj):
    buffer = io.BytesIO()
    torch.save(obj, buffer)
    return torch.load(io.BytesIO(buffer.getvalue()), weights_only=False)


def _step(fused, opt, x, loss):
    out = fused(x)
    losses = torch.stack([loss(out[b]) for b in range(fused.B)])
    opt.zero_grad()
    losses.sum().backward()
    opt.step()
    return losses.detach()


def _assert_same_state(a: nn.Module, b: nn.Module) -> None:
    sa, sb = a.state_dict(), b.state_dict()
    assert sa.keys() == sb.keys()
    for key in sa:
        assert torch.equal(sa[key], sb[key]), key


@pytest.mark.parametrize("name", sorted(ARCHITECTURES))
def test_saved_model_and_optimizer_go_on_as_the_original(name):
    arch = ARCHITECTURES[name]
    B = 1 if name == "digits_cnn" else 2
    torch.manual_seed(0)
    fused = hfkern.fuse(arch.factory, B)
    opt = hfkern.optim.Adam(fused.parameters(), lr=[1e-3 * (b + 1) for b in range(B)])
    inputs = [torch.stack([arch.input(arch.N) for _ in range(B)]) for _ in range(2)]
    _step(fused, opt, inputs[0], arch.loss)

    saved = _round_trip({"model": fused, "opt": opt})
    loaded, loaded_opt = saved["model"], saved["opt"]
    assert type(loaded) is type(fused) and loaded.B == B and loaded.model_class is fused.model_class
    assert loaded.code == fused.code
    _assert_same_state(loaded, fused)
    # The loaded optimizer holds the loaded model's parameters (one pickle keeps them one object).
    assert [id(p) for g in loaded_opt.param_groups for p in g["params"]] == [id(p) for p in loaded.parameters()]

    # The next step, then both modes' outputs, bit for bit.
    assert torch.equal(_step(loaded, loaded_opt, inputs[1], arch.loss), _step(fused, opt, inputs[1], arch.loss))
    _assert_same_state(loaded, fused)
    for mode in (True, False):
        fused.train(mode)
        loaded.train(mode)
        with torch.no_grad():
            assert torch.equal(loaded(inputs[0]), fused(inputs[0])), mode


def test_a_lambda_factory_is_not_saved_and_reset_model_asks_for_one():
    torch.manual_seed(0)
    fused = hfkern.fuse(lambda: DigitsCNN(), 3)
    loaded = _round_trip(fused)
    before = copy.deepcopy(loaded.state_dict())
    with pytest.raises(ValueError, match=r"factory given to hfkern.fuse \(<function .*<lambda>.*pass factory="):
        loaded.reset_model(1)
    for key, value in loaded.state_dict().items():
        assert torch.equal(value, before[key]), key  # refused before any change

    loaded.reset_model(1, seed=5, factory=DigitsCNN)
    fused.reset_model(1, seed=5)  # saving left the original's lambda in place
    _assert_same_state(loaded, fused)


def test_a_module_level_factory_is_saved():
    torch.manual_seed(0)
    fused = hfkern.fuse(DigitsCNN, 3)
    loaded = _round_trip(fused)
    assert loaded._factory is DigitsCNN
    loaded.reset_model(2, seed=7)
    fused.reset_model(2, seed=7)
    _assert_same_state(loaded, fused)


def test_fused_from_a_list_of_models_is_saved_without_a_factory():
    torch.manual_seed(0)
    fused = hfkern.fuse([DigitsCNN() for _ in range(2)])
    loaded = _round_trip(fused)
    loaded.reset_model(0, seed=3)  # re-initialized from reset_parameters(), as the original does
    fused.reset_model(0, seed=3)
    _assert_same_state(loaded, fused)


def test_deepcopy_keeps_a_lambda_factory_and_is_independent():
    torch.manual_seed(0)
    fused = hfkern.fuse(lambda: DigitsCNN(), 2)
    twin = copy.deepcopy(fused)
    assert twin._factory is fused._factory
    twin.reset_model(0, seed=4)
    fused.reset_model(0, seed=4)
    _assert_same_state(twin, fused)
    with torch.no_grad():
        next(twin.parameters()).add_(1.0)
    assert not torch.equal(next(twin.parameters()), next(fused.parameters()))


class _ModeDependent(nn.Module):
    """A forward that reads self.training (two captured graphs) and calls functions that
    torch's boolean_dispatch makes (F.max_pool2d, F.adaptive_max_pool2d), whose qualified
    names pickle cannot look up."""

    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(2, 4, 3, padding=1)
        self.head = nn.Linear(4, 3)

    def forward(self, x):
        x = F.max_pool2d(self.conv(x), 2)
        x = F.adaptive_max_pool2d(x, 1).flatten(1)
        if self.training:
            x = x * 2.0
        return self.head(x).log_softmax(-1)


def test_two_mode_graphs_and_boolean_dispatch_functions_round_trip():
    torch.manual_seed(0)
    fused = hfkern.fuse(_ModeDependent, 3)
    assert len(fused._graphs) == 2
    loaded = _round_trip(fused)
    x = torch.randn(3, 5, 2, 6, 6)
    for mode in (True, False):
        fused.train(mode)
        loaded.train(mode)
        assert loaded.code == fused.code
        assert torch.equal(loaded(x), fused(x)), mode


class _Deep(nn.Module):
    """Thousands of graph nodes: more than pickle's recursion allows for a linked fx.Graph."""

    def __init__(self, depth: int):
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(3, 3) for _ in range(depth))

    def forward(self, x):
        for layer in self.layers:
            x = layer(x).tanh() + x * 0.5
        return x.sum(-1)


def test_a_deep_graph_round_trips():
    torch.manual_seed(0)
    fused = hfkern.fuse([_Deep(400) for _ in range(2)])
    assert len(fused.graph.nodes) > 1500
    loaded = _round_trip(fused)
    x = torch.randn(2, 4, 3)
    assert torch.equal(loaded(x), fused(x))
