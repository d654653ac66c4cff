"""Per-slot surgery on fused models, continued: a refused ``load_model`` writes nothing,
``reset_model`` without a factory keeps the slot's own per-model configuration, and a
forward that assigns ``.data`` of a plain tensor attribute is refused rather than run
once at capture."""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.testing import assert_close

import hfkern
from hfkern.fusion import FuseError


class _Sweep(nn.Module):
    """Every kind of per-model value a fused model holds: a dropout's ``p``, an attention's
    ``dropout`` and an encoder layer's (its attention's and three dropouts')."""

    def __init__(self, p: float = 0.1):
        super().__init__()
        self.fc = nn.Linear(8, 8)
        self.drop = nn.Dropout(p)
        self.attn = nn.MultiheadAttention(8, 2, dropout=p, batch_first=True)
        self.layer = nn.TransformerEncoderLayer(8, 2, 16, dropout=p, batch_first=True)
        self.head = nn.Linear(8, 3)

    def forward(self, x):
        h = self.drop(torch.relu(self.fc(x)))
        h = h + self.attn(h, h, h, need_weights=False)[0]
        return self.head(self.layer(h))


class _ScaledSweep(_Sweep):
    """With a parameter of the model's own, which the fused model writes itself (not an array layer)."""

    def __init__(self, p: float = 0.1):
        super().__init__(p)
        self.scale = nn.Parameter(torch.ones(3))

    def forward(self, x):
        return super().forward(x) * self.scale


def _per_model_values(fused) -> dict[str, object]:
    """Every per-model value the fused model's array layers hold, by its name in the model."""
    return {".".join(filter(None, (path, sub_path, field))): getattr(sub, field)
            for path in fused._array_leaves
            for sub_path, sub, field in fused.get_submodule(path)._held_per_model_fields()}


def _snapshot(fused):
    return ({k: v.clone() for k, v in fused.state_dict().items()},
            {n: p.grad.clone() for n, p in fused.named_parameters()},
            _per_model_values(fused))


def _assert_unchanged(fused, snapshot):
    state, grads, values = snapshot
    now = fused.state_dict()
    assert now.keys() == state.keys()
    for k, v in state.items():
        assert now[k].dtype == v.dtype and torch.equal(now[k], v), k
    for n, p in fused.named_parameters():
        assert torch.equal(p.grad, grads[n]), n
    assert _per_model_values(fused) == values


# ---- load_model is all or nothing ------------------------------------------------------------
@pytest.mark.parametrize("bad", ["drop.p", "attn.dropout", "layer.dropout2.p"])
def test_a_refused_per_model_value_leaves_the_fused_model_as_it_was(bad):
    """torch does not check a dropout probability assigned after construction, the array layer
    does when the value is loaded: the refusal must come before the model's own parameter, the
    layers before the refused one (``drop.p``: the first with such a value; ``layer.dropout2.p``:
    the last) and the gradients' slot are written."""
    torch.manual_seed(0)
    fused = hfkern.fuse([_ScaledSweep(p) for p in (0.1, 0.2, 0.3)])
    fused(torch.randn(3, 2, 5, 8)).sum().backward()  # gradients: a load zeroes the slot's
    snapshot = _snapshot(fused)

    model = _ScaledSweep(0.25)
    with torch.no_grad():
        model.scale.fill_(7.0)
    owner, _, field = bad.rpartition(".")
    setattr(model.get_submodule(owner), field, 1.5)
    with pytest.raises(ValueError) as refused:
        fused.load_model(1, model)
    _assert_unchanged(fused, snapshot)
    assert f"load_model: the model's {bad!r} is refused for slot 1" in str(refused.value)
    assert "1.5" in str(refused.value)

    # The same model with a valid value loads: slot 1 is that torch model, the others as they were.
    setattr(model.get_submodule(owner), field, 0.25)
    fused.load_model(1, model)
    state = fused.state_dict()
    for k, v in model.state_dict().items():
        assert torch.equal(state[k][1], v), k
        for b in (0, 2):
            assert torch.equal(state[k][b], snapshot[0][k][b]), k
    assert all(value == (0.1, 0.25, 0.3) for value in _per_model_values(fused).values())
    x = torch.randn(3, 2, 5, 8)
    fused.eval()
    assert_close(fused(x)[1], model.eval()(x[1]))


def test_a_refused_load_of_a_model_with_its_own_parameter_first_writes_nothing():
    """A fused model whose own parameter comes before its only array layer with a per-model value."""

    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.scale = nn.Parameter(torch.ones(4))
            self.fc = nn.Linear(4, 4)
            self.drop = nn.Dropout(0.1)

        def forward(self, x):
            return self.drop(self.fc(x)) * self.scale

    torch.manual_seed(0)
    fused = hfkern.fuse([Net() for _ in range(3)])
    before = {k: v.clone() for k, v in fused.state_dict().items()}
    model = Net()
    model.drop.p = -0.5
    with torch.no_grad():
        model.scale.fill_(7.0)
    with pytest.raises(ValueError) as refused:
        fused.load_model(2, model)
    assert all(torch.equal(v, before[k]) for k, v in fused.state_dict().items())
    assert fused.drop.p == 0.1
    assert "'drop.p'" in str(refused.value) and "-0.5" in str(refused.value)


# ---- reset_model keeps the slot's configuration ------------------------------------------------
def test_reset_model_without_a_factory_keeps_the_slots_per_model_configuration():
    """A sweep over dropout probabilities fused from a list (no factory): slot 2 after
    reset_model(2, seed) is the torch model of slot 2's configuration that
    torch.manual_seed(seed) gives, weights and every per-model value; the others stay."""
    ps = (0.1, 0.2, 0.3)
    torch.manual_seed(0)
    fused = hfkern.fuse([_Sweep(p) for p in ps])
    before = {k: v.clone() for k, v in fused.state_dict().items()}
    fused.reset_model(2, seed=7)

    torch.manual_seed(7)
    fresh = _Sweep(0.3)
    state = fused.state_dict()
    for k, v in fresh.state_dict().items():
        assert torch.equal(state[k][2], v), k
        assert torch.equal(state[k][0], before[k][0]) and torch.equal(state[k][1], before[k][1]), k
    assert all(value == ps for value in _per_model_values(fused).values()), _per_model_values(fused)
    extracted = fused.extract_model(2)
    for name in _per_model_values(fused):
        owner, _, field = name.rpartition(".")
        assert getattr(extracted.get_submodule(owner), field) == getattr(fresh.get_submodule(owner), field), name


def test_reset_slot_drops_what_a_fresh_model_of_its_configuration_drops_in_training():
    """p = 0 and p = 1 make training deterministic: with the slot's p kept, each slot's training
    forward after the reset equals its torch model's (model 0's p = 0 for slot 2 would not)."""
    torch.manual_seed(0)
    models = [_Sweep(p) for p in (0.0, 0.0, 1.0)]
    fused = hfkern.fuse(models)
    fused.reset_model(2, seed=4)
    torch.manual_seed(4)
    models[2] = _Sweep(1.0)
    x = torch.randn(3, 2, 5, 8)
    out = fused.train()(x)
    for b, m in enumerate(models):
        assert_close(out[b], m.train()(x[b]))


# ---- .data of a plain tensor attribute ----------------------------------------------------------
class _Inner(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(3, 3)
        self.const = torch.ones(3)  # neither a parameter nor a buffer

    def forward(self, x, grow: bool = False):
        if grow:
            self.const.data = self.const * 2
        return self.fc(x) * self.const


class _Outer(nn.Module):
    def __init__(self):
        super().__init__()
        self.inner = _Inner()

    def forward(self, x, grow: bool = False):
        return self.inner(x, grow)


@pytest.mark.parametrize("B", [1, 2])
def test_assigning_data_of_a_tensor_attribute_is_refused_not_run_once(B):
    """A call pattern captured after fusing (``grow=True``) assigns ``.data`` of a tensor attribute:
    torch doubles it at every call, a captured forward would have doubled it once, at capture.
    Refused, naming the attribute, and the fused model's calls without it still equal torch's."""
    torch.manual_seed(0)
    models = [_Outer() for _ in range(B)]
    fused = hfkern.fuse(models)
    x = torch.randn(B, 4, 3)
    with pytest.raises(FuseError, match=r"`\.data` of the tensor attribute 'inner\.const'.*register_buffer"):
        fused(x, grow=True)
    assert_close(fused(x), torch.stack([m(x[b]) for b, m in enumerate(models)]))


def test_assigning_data_of_a_tensor_attribute_is_refused_when_fusing():
    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = nn.Linear(3, 3)
            self.const = torch.ones(3)

        def forward(self, x):
            c = self.const  # another name for the attribute's tensor
            c.data = x.mean(0).detach()
            return self.fc(x) * c

    models = [Net() for _ in range(2)]
    with pytest.raises(FuseError, match=r"`\.data` of the tensor attribute 'const'"):
        hfkern.fuse(models)
    assert all(torch.equal(m.const, torch.ones(3)) for m in models)  # fusing changed no model


def test_assigning_data_of_a_tensor_made_in_forward_or_of_a_buffer_still_equals_torch():
    """A tensor made in forward from Python values changes the same way at every call, and a
    buffer's ``.data`` is per-model state the fused model updates: neither is refused."""

    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = nn.Linear(3, 3)
            self.register_buffer("avg", torch.zeros(3))

        def forward(self, x):
            w = torch.ones(3)
            w.data = torch.full((3,), 0.5)
            self.avg.data = 0.9 * self.avg + 0.1 * x.mean(0).detach()
            return self.fc(x) * w + self.avg

    torch.manual_seed(0)
    models = [Net() for _ in range(2)]
    refs = [Net() for _ in range(2)]
    for r, m in zip(refs, models):
        r.load_state_dict(m.state_dict())
    fused = hfkern.fuse(models)
    for _ in range(3):
        x = torch.randn(2, 4, 3)
        assert_close(fused(x), torch.stack([r(x[b]) for b, r in enumerate(refs)]))
    assert_close(fused.avg, torch.stack([r.avg for r in refs]))


class _WritesItsConstant(nn.Module):
    """Writes a plain tensor attribute in place with no traced operand: a constant of the capture."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(3, 3)
        self.const = torch.ones(3)

    def forward(self, x):
        self.const.mul_(2)
        return self.fc(x) * self.const


@pytest.mark.parametrize("B", [1, 2])
def test_an_in_place_write_to_a_tensor_attribute_is_refused_and_leaves_the_models_alone(B):
    # It ran once, at capture: with B = 1 the fused model then scaled by 2 where torch scales by 2, 4, 8...
    models = [_WritesItsConstant() for _ in range(B)]
    with pytest.raises(hfkern.FuseError, match=r"writes the tensor attribute\(s\) \['const'\].*register it as a buffer"):
        hfkern.fuse(models)
    assert all(torch.equal(m.const, torch.ones(3)) for m in models)
