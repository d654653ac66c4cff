"""from_modules / to_modules keep each parameter's requires_grad (frozen parameters)."""

import pytest
import torch
from torch import nn

import hfkern.nn as hnn

B = 3

# (torch factory, array class, one model's input, which parameters to freeze)
CASES = [
    (lambda: nn.Linear(5, 3), hnn.Linear, lambda: torch.randn(4, 5), ["weight"]),
    (lambda: nn.Conv1d(2, 3, 3), hnn.Conv1d, lambda: torch.randn(4, 2, 9), ["bias"]),
    (lambda: nn.Conv2d(2, 3, 3), hnn.Conv2d, lambda: torch.randn(2, 2, 7, 6), ["weight"]),
    (lambda: nn.ConvTranspose1d(2, 3, 3, stride=2), hnn.ConvTranspose1d, lambda: torch.randn(2, 2, 5), ["weight"]),
    (lambda: nn.ConvTranspose2d(2, 3, 3), hnn.ConvTranspose2d, lambda: torch.randn(2, 2, 4, 5), ["bias"]),
    (lambda: nn.LayerNorm(6), hnn.LayerNorm, lambda: torch.randn(4, 6), ["weight"]),
    (lambda: nn.RMSNorm(6), hnn.RMSNorm, lambda: torch.randn(4, 6), ["weight"]),
    (lambda: nn.GroupNorm(2, 4), hnn.GroupNorm, lambda: torch.randn(3, 4, 5), ["bias"]),
    (lambda: nn.BatchNorm1d(4), hnn.BatchNorm1d, lambda: torch.randn(6, 4), ["weight"]),
    (lambda: nn.BatchNorm2d(4), hnn.BatchNorm2d, lambda: torch.randn(3, 4, 5, 5), ["weight", "bias"]),
    (lambda: nn.Embedding(7, 3), hnn.Embedding, lambda: torch.randint(0, 7, (5,)), ["weight"]),
    (lambda: nn.PReLU(3), hnn.PReLU, lambda: torch.randn(4, 3), ["weight"]),
    (lambda: nn.MultiheadAttention(6, 2, add_bias_kv=True), hnn.MultiheadAttention,
     lambda: torch.randn(5, 2, 6), ["in_proj_weight", "bias_k", "out_proj.bias"]),
    (lambda: nn.TransformerEncoderLayer(6, 2, 10, dropout=0.0), hnn.TransformerEncoderLayer,
     lambda: torch.randn(5, 2, 6), ["self_attn.in_proj_weight", "linear1.bias", "norm2.weight"]),
]
IDS = [c[1].__name__ for c in CASES]


def _call(m, x):
    if isinstance(m, (nn.MultiheadAttention, hnn.MultiheadAttention)):
        return m(x, x, x)[0]
    return m(x)


def _frozen(modules, names):
    for m in modules:
        for n in names:
            m.get_parameter(n).requires_grad_(False)
    return modules


@pytest.mark.parametrize("factory,cls,make_input,names", CASES, ids=IDS)
def test_frozen_parameters_survive_from_and_to_modules(factory, cls, make_input, names):
    modules = _frozen([factory() for _ in range(B)], names)
    array = cls.from_modules(modules)
    expected = {n: p.requires_grad for n, p in modules[0].named_parameters()}
    assert {n: p.requires_grad for n, p in array.named_parameters()} == expected
    assert not all(expected.values())

    # training: the frozen parameters get no gradient, the others torch's
    xs = [make_input() for _ in range(B)]
    x = torch.stack(xs)
    if x.is_floating_point():  # so that there is a backward also when every parameter is frozen
        x.requires_grad_()
        xs = [xb.requires_grad_() for xb in xs]
    y = _call(array, x)
    ys = [_call(m, xb) for m, xb in zip(modules, xs)]
    torch.testing.assert_close(y, torch.stack(ys), atol=1e-5, rtol=1e-5)
    if not y.requires_grad:  # an embedding whose table is frozen
        assert not any(yb.requires_grad for yb in ys)
        return _check_to_modules(array, cls, expected)
    g = torch.randn_like(y)
    y.backward(g)
    for b, (m, yb) in enumerate(zip(modules, ys)):
        yb.backward(g[b])
        for n, p in m.named_parameters():
            q = array.get_parameter(n)
            if n in names:
                assert p.grad is None and q.grad is None, n
            else:
                torch.testing.assert_close(q.grad[b], p.grad, atol=1e-4, rtol=1e-4, msg=n)

    torch.testing.assert_close(x.grad, torch.stack([xb.grad for xb in xs]), atol=1e-4, rtol=1e-4)
    _check_to_modules(array, cls, expected)


def _check_to_modules(array, cls, expected):
    back = array.to_modules()
    for m in back:
        assert {n: p.requires_grad for n, p in m.named_parameters()} == expected
    # and the round trip again
    again = cls.from_modules(back)
    assert {n: p.requires_grad for n, p in again.named_parameters()} == expected


@pytest.mark.parametrize("factory,cls,make_input,names", CASES, ids=IDS)
def test_models_disagreeing_on_requires_grad_raise(factory, cls, make_input, names):
    modules = [factory() for _ in range(B)]
    name = names[0]
    modules[2].get_parameter(name).requires_grad_(False)
    with pytest.raises(ValueError, match=rf"'{name}.requires_grad' differs: module 0 has True, "
                                         rf"module 2 has False.*parameter '{name}'"):
        cls.from_modules(modules)


def test_array_frozen_by_hand_converts_to_frozen_modules():
    array = hnn.Linear(4, 2, B=2)
    array.bias.requires_grad_(False)
    mods = array.to_modules()
    assert all(m.weight.requires_grad and not m.bias.requires_grad for m in mods)
