"""hfkern.fuse: random draws and stateless layers on tensors every model shares, and Tensor.view_as.

A stateless array layer (pooling, flatten, dropout) called on a tensor made from constants in forward
returns each model's value (it returned [B, B, ...] or B times the sum); a random functional on a
tensor made from constants draws per model and per call (it ran once, at capture, as a graph
constant); in-place random draws and random functionals into a tensor sized by the input draw per
model (every model got the same numbers); ``view_as``/``reshape_as``/``expand_as`` on an array from a
shared input work (view_as failed).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from torch.testing import assert_close

import hfkern

B = 3


def _per_model(models, x):
    return torch.stack([m(x[b]) for b, m in enumerate(models)])


class _Pooled(nn.Module):
    def __init__(self, layer: nn.Module):
        super().__init__()
        self.conv = nn.Conv2d(1, 1, 1)
        self.layer = layer

    def forward(self, x):
        y = self.conv(x)
        return y / self.layer(torch.ones(1, 1, 2 * y.size(2), 2 * y.size(3)))


def test_stateless_layer_on_constant_tensor_is_each_models_value():
    for make in (lambda: nn.AvgPool2d(2), lambda: nn.MaxPool2d(2), lambda: nn.AdaptiveAvgPool2d(4)):
        torch.manual_seed(0)
        models = [_Pooled(make()) for _ in range(B)]
        fused = hfkern.fuse(models)
        x = torch.randn(B, 2, 1, 4, 4)
        out = fused(x)
        assert out.shape == (B, 2, 1, 4, 4)
        assert_close(out, _per_model(models, x))


class _DropMask(nn.Module):
    def __init__(self):
        super().__init__()
        self.drop = nn.Dropout(0.5)

    def forward(self, x):
        mask = self.drop(torch.ones(16))
        return x * mask, mask


def test_dropout_layer_on_constant_tensor_draws_a_mask_per_model():
    torch.manual_seed(0)
    fused = hfkern.fuse([_DropMask() for _ in range(B)])
    out, mask = fused(torch.ones(B, 2, 16))
    assert mask.shape == (B, 16)
    assert set(mask.unique().tolist()) <= {0.0, 2.0}
    assert_close(out, mask[:, None].expand(B, 2, 16))
    assert not all(torch.equal(mask[0], mask[b]) for b in range(1, B))


class _FunctionalMask(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 4)

    def forward(self, x):
        return F.dropout(torch.ones(64), 0.5, self.training)


def test_random_functional_on_constant_tensor_draws_per_model_and_call():
    torch.manual_seed(0)
    fused = hfkern.fuse([_FunctionalMask() for _ in range(B)])
    first, second = fused(torch.ones(B, 2, 4)), fused(torch.ones(B, 2, 4))
    assert first.shape == (B, 64)
    assert not torch.equal(first[0], first[1])
    assert not torch.equal(first, second)
    fused.eval()
    assert_close(fused(torch.ones(B, 2, 4)), torch.ones(B, 64))


_SIZED_DRAWS = {
    "normal_": lambda x: torch.empty(x.size(0), 32).normal_(),
    "uniform_": lambda x: torch.empty(len(x), 32).uniform_(),
    "bernoulli_": lambda x: torch.zeros(x.shape[0], 32).bernoulli_(0.5),
    "exponential_": lambda x: torch.empty(x.size(0), 32).exponential_(),
    "dropout": lambda x: F.dropout(torch.ones(x.size(0), 32), 0.5, True),
    "dropout1d": lambda x: F.dropout1d(torch.ones(x.size(0), 32, 4), 0.5, True),
    "alpha_dropout": lambda x: F.alpha_dropout(torch.ones(x.size(0), 32), 0.5, True),
    "rrelu": lambda x: F.rrelu(-torch.ones(x.size(0), 32), training=True),
    "gumbel_softmax": lambda x: F.gumbel_softmax(torch.zeros(x.size(0), 32)),
}


class _SizedDraw(nn.Module):
    def __init__(self, how: str):
        super().__init__()
        self.fc = nn.Linear(4, 4)
        self.how = how

    def forward(self, x):
        return self.fc(x).sum() * 0 + _SIZED_DRAWS[self.how](x)


def test_draws_into_a_tensor_sized_by_the_input_are_per_model():
    for how in _SIZED_DRAWS:
        torch.manual_seed(0)
        fused = hfkern.fuse([_SizedDraw(how) for _ in range(B)])
        out = fused(torch.randn(B, 5, 4))
        assert out.shape[:2] == (B, 5), how
        assert not torch.equal(out[0], out[1]), how
        assert not torch.equal(out, fused(torch.randn(B, 5, 4))), how


class _As(nn.Module):
    def __init__(self, method: str):
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.method = method

    def forward(self, x, like):
        return getattr(self.lin(x), self.method)(like)


def test_view_as_reshape_as_expand_as_on_a_shared_input():
    x = torch.randn(2, 5, 4)
    for method, like in (("view_as", torch.empty(2, 20)), ("reshape_as", torch.empty(10, 4)),
                         ("expand_as", torch.empty(3, 2, 5, 4))):
        torch.manual_seed(0)
        models = [_As(method) for _ in range(B)]
        fused = hfkern.fuse(models)
        out = fused(hfkern.broadcast(x, B), hfkern.broadcast(like, B))
        assert_close(out, torch.stack([m(x, like) for m in models]), msg=method)
        per_model = fused(x.expand(B, *x.shape).contiguous(), like.expand(B, *like.shape))
        assert_close(per_model, out, msg=method)
