"""torch's implementation keywords (foreach, fused, capturable, differentiable) on the array optimizers.

Each optimizer takes exactly the keywords its torch namesake takes, in torch's
positions, so torch training scripts port without edits; values that describe
hfkern's one implementation are accepted (and change nothing), others raise.
"""

from __future__ import annotations

import copy
import inspect
import io

import pytest
import torch

import hfkern.optim as hoptim

B = 3
NAMES = ["SGD", "Adam", "AdamW", "Adagrad", "Adadelta", "RMSprop"]
KEYWORDS = ("foreach", "fused", "capturable", "differentiable")


def _torch_keywords(name):
    params = inspect.signature(getattr(torch.optim, name)).parameters
    return [k for k in KEYWORDS if k in params]


@pytest.mark.parametrize("name", NAMES)
def test_signature_is_torchs(name):
    """Every parameter of torch's constructor, with torch's kind, position and default."""
    ours = inspect.signature(getattr(hoptim, name)).parameters
    theirs = inspect.signature(getattr(torch.optim, name)).parameters
    for k, p in theirs.items():
        assert k in ours, f"{name} lacks torch's {k!r}"
        assert ours[k].kind == p.kind, (name, k)
        if k != "params":
            assert ours[k].default == p.default, (name, k)
    positional = [k for k, p in ours.items() if p.kind == p.POSITIONAL_OR_KEYWORD]
    assert positional == [k for k, p in theirs.items() if p.kind == p.POSITIONAL_OR_KEYWORD]
    assert set(ours) - set(theirs) == {"skip_nonfinite"}


def _train(name, steps=4, **kwargs):
    g = torch.Generator().manual_seed(2)
    params = [torch.nn.Parameter(torch.randn(B, 5, 3, generator=g)), torch.nn.Parameter(torch.randn(B, 7, generator=g))]
    lr = {"Adadelta": [0.5, 1.0, 0.8]}.get(name, [0.01, 0.02, 0.005])
    opt = getattr(hoptim, name)(params, lr=lr, **kwargs)
    for _ in range(steps):
        for p in params:
            p.grad = torch.randn(p.shape, generator=g)
        opt.step()
    return params, opt


@pytest.mark.parametrize("name", NAMES)
def test_accepted_values_change_nothing(name):
    want, ref = _train(name)
    accepted = [dict(foreach=None), dict(foreach=True)]
    if "fused" in _torch_keywords(name):
        accepted += [dict(fused=None), dict(fused=True), dict(foreach=True, fused=True)]
    for k in ("capturable", "differentiable"):
        if k in _torch_keywords(name):
            accepted.append({k: False})
    if "capturable" in _torch_keywords(name):  # hfkern's step always is
        accepted.append({"capturable": True})
    for kwargs in accepted:
        got, opt = _train(name, **kwargs)
        for p, q in zip(got, want):
            assert torch.equal(p, q), kwargs
        for k in _torch_keywords(name):
            expected = kwargs.get(k, None if k in ("foreach", "fused") else False)
            assert opt.defaults[k] is expected and opt.param_groups[0][k] is expected, (kwargs, k)


@pytest.mark.parametrize("name", NAMES)
def test_rejected_values(name):
    p = torch.nn.Parameter(torch.randn(B, 2))
    cls = getattr(hoptim, name)
    torch_keywords = _torch_keywords(name)
    for k in ("foreach", "fused"):
        if k in torch_keywords:
            with pytest.raises(ValueError, match=rf"{k}=False asks for an implementation hfkern does not have"):
                cls([p], **{k: False})
            with pytest.raises(TypeError, match=rf"{k} must be None or a bool, got str"):
                cls([p], **{k: "yes"})
    for k in ("capturable", "differentiable"):
        if k in torch_keywords:
            if k == "differentiable":
                with pytest.raises(NotImplementedError, match=rf"{name}: {k}=True .* is not implemented"):
                    cls([p], **{k: True})
            with pytest.raises(TypeError, match=rf"{k} must be a bool"):
                cls([p], **{k: 1})
    for k in KEYWORDS:
        if k not in torch_keywords:  # as torch's namesake, which has no such keyword
            with pytest.raises(TypeError, match=k):
                cls([p], **{k: None})
    # A param group asking for what the optimizer cannot do is refused when added.
    opt = cls([p])
    q = torch.nn.Parameter(torch.randn(B, 2))
    k = torch_keywords[0]
    with pytest.raises((ValueError, NotImplementedError)):
        opt.add_param_group({"params": [q], k: False if k in ("foreach", "fused") else True})
    assert len(opt.param_groups) == 1


@pytest.mark.parametrize("name", NAMES)
def test_keywords_in_state_dict(name):
    params, opt = _train(name, foreach=True)
    buf = io.BytesIO()
    torch.save(opt.state_dict(), buf)
    buf.seek(0)
    saved = torch.load(buf)
    assert saved["param_groups"][0]["foreach"] is True
    fresh = getattr(hoptim, name)(params)
    fresh.load_state_dict(saved)
    assert fresh.param_groups[0]["foreach"] is True
    # A state saved before the keywords existed loads with their defaults.
    old = copy.deepcopy(saved)
    for group in old["param_groups"]:
        for k in KEYWORDS:
            group.pop(k, None)
    fresh = getattr(hoptim, name)(params, foreach=True)
    fresh.load_state_dict(old)
    assert fresh.param_groups[0]["foreach"] is None
    # One saved with a value hfkern cannot honour is refused, and nothing changes.
    bad = copy.deepcopy(saved)
    k = _torch_keywords(name)[-1]
    bad["param_groups"][0][k] = True if k == "differentiable" else False
    with pytest.raises((ValueError, NotImplementedError)):
        fresh.load_state_dict(bad)
    assert fresh.param_groups[0]["foreach"] is None
