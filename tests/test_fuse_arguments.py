"""A fused model's forward takes the original forward's arguments, and each call computes
what B torch models compute with those arguments.

Arguments that are None, a bool, an int, a string (an enum member, a tuple of them) are
Python values in the captured code (torch.fx would trace them as tensors, never None, so
``if mask is None:`` would always take the other branch): the forward is captured for each
pattern of such arguments, and a call runs its pattern's graph. A tensor made in forward from a non-tensor argument alone
(``torch.arange(k)``) is the same for every model. What cannot be captured for a call is
refused with a FuseError naming the call's arguments and the module or statement.
"""

from __future__ import annotations

import copy
import enum
import pickle
import warnings

import pytest
import torch
from torch import nn
from torch.testing import assert_close

import hfkern
from hfkern.fusion import FuseError

B = 3
TOL = {"rtol": 1e-5, "atol": 1e-5}


def _per_model(value, b):
    return value[b] if isinstance(value, torch.Tensor) else value


def _check_call(fused, models, *args, **kwargs):
    """``fused(*args, **kwargs)`` against each model called with its slice of the tensors:
    outputs and every parameter's gradient."""
    fused.zero_grad()
    for m in models:
        m.zero_grad()
    out = fused(*args, **kwargs)
    ref = torch.stack([m(*(_per_model(a, b) for a in args), **{k: _per_model(v, b) for k, v in kwargs.items()})
                       for b, m in enumerate(models)])
    assert_close(out, ref, **TOL)
    out.square().sum().backward()
    ref.square().sum().backward()
    for name, p in fused.named_parameters():
        for b, m in enumerate(models):
            want = m.get_parameter(name).grad
            if want is None:
                assert p.grad is None or not p.grad[b].any(), name
            else:
                assert_close(p.grad[b], want, **TOL, msg=lambda s: f"{name}.grad[{b}]: {s}")


# ---- None arguments -------------------------------------------------------------------------
class _CausalAttention(nn.Module):
    """A default mask where none is given: the usual language-model idiom."""

    def __init__(self):
        super().__init__()
        self.attn = nn.MultiheadAttention(8, 2, batch_first=True)
        self.register_buffer("causal", torch.triu(torch.ones(5, 5, dtype=torch.bool), 1))

    def forward(self, x, attn_mask=None):
        mask = attn_mask if attn_mask is not None else self.causal
        return self.attn(x, x, x, attn_mask=mask, need_weights=False)[0]


class _OptionalInput(nn.Module):
    """An optional input with its own layer, used only when given; a train-only branch."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 4)
        self.cond = nn.Linear(2, 4)
        self.register_buffer("offset", torch.randn(4))

    def forward(self, x, cond=None, scale=None):
        h = self.fc(x)
        h = h + (self.cond(cond) if cond is not None else self.offset)
        if scale is None:
            scale = 2.0
        if self.training:
            h = h.relu()
        return h * scale


def test_none_default_argument_runs_the_default_branch():
    torch.manual_seed(0)
    models = [_CausalAttention() for _ in range(B)]
    fused = hfkern.fuse(models)
    x = torch.randn(B, 3, 5, 8)
    _check_call(fused, models, x)  # the default: the causal mask
    mask = torch.rand(B, 5, 5) > 0.5
    mask[..., 0] = False  # (every query sees a key)
    _check_call(fused, models, x, mask)
    _check_call(fused, models, x, attn_mask=mask)
    _check_call(fused, models, x, attn_mask=None)


def test_each_pattern_of_none_arguments_gets_its_graph_in_both_modes():
    torch.manual_seed(0)
    models = [_OptionalInput() for _ in range(B)]
    fused = hfkern.fuse(models)
    x, cond, scale = torch.randn(B, 5, 4), torch.randn(B, 5, 2), torch.rand(B, 5, 1)
    for mode in (True, False):
        fused.train(mode)
        for m in models:
            m.train(mode)
        _check_call(fused, models, x)
        _check_call(fused, models, x, cond)
        _check_call(fused, models, x, None, scale)
        _check_call(fused, models, x, cond=cond, scale=scale)
    # captured graphs travel with the model
    loaded = copy.deepcopy(fused)
    _check_call(loaded, models, x, None, scale)
    _check_call(loaded, models, x)


# ---- bool arguments -------------------------------------------------------------------------
class _Flagged(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 4)

    def forward(self, x, double: bool = False, *, negate=True):
        h = self.fc(x)
        if double:
            h = h * 2
        if not negate:
            return h
        return -h


def test_bool_argument_takes_the_branch_of_the_call():
    torch.manual_seed(0)
    models = [_Flagged() for _ in range(B)]
    fused = hfkern.fuse(models)
    x = torch.randn(B, 5, 4)
    for double in (False, True):
        for negate in (True, False):
            _check_call(fused, models, x, double, negate=negate)
    _check_call(fused, models, x)


class _Auxiliary(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 4)
        self.aux = nn.Linear(4, 4)

    def forward(self, x, use_aux: bool = False):
        h = self.fc(x)
        return self.aux(h) if use_aux else h


def test_call_running_a_module_fuse_did_not_see_raises_naming_it():
    torch.manual_seed(0)
    models = [_Auxiliary() for _ in range(B)]
    fused = hfkern.fuse(models)
    x = torch.randn(B, 5, 4)
    _check_call(fused, models, x)
    with pytest.raises(FuseError, match=r"use_aux=True.*module 'aux' \(Linear\)"):
        fused(x, True)


class _Varargs(nn.Module):
    def __init__(self):
        super().__init__()
        self.m = nn.Linear(4, 3)

    def forward(self, *args):
        return self.m(*args)


class _FloatBranch(nn.Module):
    def __init__(self):
        super().__init__()
        self.m = nn.Linear(4, 3)

    def forward(self, x, scale=1.0):
        return self.m(x) if scale > 0 else -self.m(x)


def test_uncapturable_arguments_are_named_as_such():
    with pytest.raises(FuseError, match=r"forward's own `\*args`.*one value.*model's own forward \(_Varargs\)") as e:
        hfkern.fuse([_Varargs() for _ in range(2)])
    assert "Python control flow" not in str(e.value)
    with pytest.raises(FuseError, match=r"argument of forward.*not a Python constant.*floats included.*"
                                        r"`return self\.m\(x\) if"):
        hfkern.fuse([_FloatBranch() for _ in range(2)])


# ---- ints, strings and other Python constants ----------------------------------------------
class _Mode(enum.Enum):
    SUM = "sum"
    MAX = "max"


class _Configurable(nn.Module):
    """Arguments that choose the structure: how many blocks run, a reduction named by a string
    or an enum, a tuple of dims; a float scale (traced: every value shares one capture)."""

    def __init__(self):
        super().__init__()
        self.blocks = nn.ModuleList([nn.Linear(4, 4) for _ in range(3)])
        self.out = nn.Linear(4, 2)

    def forward(self, x, depth: int = 3, mode="sum", dims=(-1,), kind=_Mode.SUM, scale: float = 1.0):
        for block in self.blocks[:depth]:
            x = block(x).relu()
        y = self.out(x)
        y = y.sum(dims) if mode == "sum" else y.amax(dims)
        return (y if kind is _Mode.SUM else -y) * scale


@pytest.mark.parametrize("kwargs", [{}, {"depth": 1}, {"depth": 0, "mode": "max"}, {"mode": "max", "dims": (-2, -1)},
                                    {"kind": _Mode.MAX, "scale": 0.25}, {"depth": 2, "scale": -3.0}])
def test_int_string_and_enum_arguments_take_what_the_call_takes(kwargs):
    torch.manual_seed(0)
    models = [_Configurable() for _ in range(B)]
    fused = hfkern.fuse(models)
    x = torch.randn(B, 5, 4)
    _check_call(fused, models, x, **kwargs)
    _check_call(fused, models, x.transpose(1, 2).contiguous().transpose(1, 2), **kwargs)  # non-contiguous
    fused.eval()
    for m in models:
        m.eval()
    _check_call(fused, models, x, **kwargs)


def test_positional_int_and_its_default_are_one_capture_and_a_bool_is_not_an_int():
    models = [_Configurable() for _ in range(B)]
    fused = hfkern.fuse(models)
    x = torch.randn(B, 5, 4)
    fused(x)
    patterns = len(fused._own_graphs)
    fused(x, 3)  # the default, positionally
    fused(x, depth=3, scale=0.5)  # a float: traced, no capture of its own
    assert len(fused._own_graphs) == patterns
    fused(x, True)  # True == 1 in Python, but a bool is its own pattern (torch's slicing takes both alike)
    fused(x, 1)
    assert len(fused._own_graphs) == patterns + 2
    _check_call(fused, models, x, True)
    _check_call(fused, models, x, 1)


def test_pickled_model_keeps_its_captures_for_int_arguments():
    models = [_Configurable() for _ in range(B)]
    fused = hfkern.fuse(models)
    x = torch.randn(B, 5, 4)
    want = fused(x, 1, "max")
    loaded = pickle.loads(pickle.dumps(fused))
    assert set(loaded._own_graphs) == set(fused._own_graphs)
    assert_close(loaded(x, 1, "max"), want, rtol=0, atol=0)
    assert_close(loaded(x, 2), fused(x, 2), rtol=0, atol=0)


def test_many_patterns_warn_once_naming_the_argument():
    models = [_Configurable() for _ in range(2)]
    fused = hfkern.fuse(models)
    x = torch.randn(2, 5, 4)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for depth in range(-6, 4):
            fused(x, depth)
    messages = [str(w.message) for w in caught if issubclass(w.category, UserWarning)]
    assert len(messages) == 1, messages
    assert "'depth'" in messages[0] and "float or a tensor" in messages[0]


# ---- tensors made from Python values given to forward ---------------------------------------
class _Ranged(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 3)

    def forward(self, x, k: int = 3):
        offset = torch.zeros(3)
        offset[0] = 1.0  # written in place, as each model may
        return self.fc(x) + offset * k + torch.arange(k).float()


class _Drawn(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 3)

    def forward(self, x, k: int = 3):
        return self.fc(x) + torch.randn(k)


def test_tensor_made_from_an_int_argument_is_every_models():
    torch.manual_seed(0)
    models = [_Ranged() for _ in range(B)]
    fused = hfkern.fuse(models)
    for k in (3, 3.0):  # an int is a Python value in the captured code; a float a traced value
        _check_call(fused, models, torch.randn(B, 2, 4), k)
        _check_call(fused, models, hfkern.broadcast(torch.randn(2, 4), B), k)


def test_draw_sized_by_an_int_argument_is_drawn_per_model():
    torch.manual_seed(0)
    models = [_Drawn() for _ in range(B)]
    fused = hfkern.fuse(models)
    x = torch.randn(B, 2, 4)
    torch.manual_seed(1)
    out = fused(x, 3)
    torch.manual_seed(1)  # B torch models called one after another draw what the fused model draws
    ref = torch.stack([m(x[b], 3) for b, m in enumerate(models)])
    assert_close(out, ref, **TOL)
    assert not torch.allclose(out[0] - models[0].fc(x[0]), out[1] - models[1].fc(x[1]))


def test_compiled_fused_model_captures_a_new_pattern_between_graphs():
    """A pattern first met while dynamo traces is captured eagerly (a graph break), then compiled;
    with ``fullgraph=True`` such a call must have been made once eagerly first."""
    torch.manual_seed(0)
    models = [_Configurable() for _ in range(B)]
    fused = hfkern.fuse(models)
    x = torch.randn(B, 5, 4)
    compiled = torch.compile(fused, backend="aot_eager")
    for kwargs in ({}, {"depth": 1}, {"mode": "max", "scale": 0.5}, {"depth": 1}):
        want = torch.stack([m(x[b], **kwargs) for b, m in enumerate(models)])
        assert_close(compiled(x, **kwargs), want, **TOL)
    full = torch.compile(fused, backend="aot_eager", fullgraph=True)
    assert_close(full(x, depth=1), fused(x, depth=1), rtol=0, atol=0)  # a pattern captured before
