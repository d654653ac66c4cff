"""hfkern.fuse: random functions and factories the model's module imported by name.

``from torch.nn.functional import dropout`` or ``from torch import randn, zeros`` puts the
functions in the model's module namespace, where forward finds them without looking them up
on torch. The capture recorded only the lookups on torch's modules (``F.dropout``,
``torch.randn``): a draw through an imported name on a constant tensor ran once, at the
capture, and every model and call reused its numbers. Now the names the model's modules
imported are recorded as the attributes are.
"""

from __future__ import annotations

import dataclasses

import torch
from torch import nn, randn, zeros
from torch.nn.functional import dropout
from torch.testing import assert_close

import hfkern

B = 3


class _ImportedDropout(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 4)

    def forward(self, x):
        return dropout(torch.ones(64), 0.5, self.training)


class _ImportedRandn(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 4)

    def forward(self, x):
        return self.fc(x) + randn(4)


class _ImportedSizedFactory(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 4)

    def forward(self, x):
        return self.fc(x) + zeros(x.size(0), 4).normal_()


def test_imported_dropout_on_a_constant_draws_per_model_and_call():
    torch.manual_seed(0)
    fused = hfkern.fuse([_ImportedDropout() for _ in range(B)])
    first, second = fused(torch.ones(B, 2, 4)), fused(torch.ones(B, 2, 4))
    assert first.shape == (B, 64)
    assert set(first.unique().tolist()) <= {0.0, 2.0}
    assert not torch.equal(first[0], first[1])
    assert not torch.equal(first, second)
    fused.eval()
    assert_close(fused(torch.ones(B, 2, 4)), torch.ones(B, 64))


def test_imported_random_factory_draws_per_model_and_call():
    torch.manual_seed(0)
    models = [_ImportedRandn() for _ in range(B)]
    fused = hfkern.fuse(models)
    x = torch.zeros(B, 2, 4)
    first, second = fused(x), fused(x)
    noise = first - torch.stack([m.fc(x[b]) for b, m in enumerate(models)])
    assert not torch.equal(noise[0], noise[1])  # each model its own draw
    assert torch.equal(noise[0, 0], noise[0, 1])  # one [4] draw per model, broadcast over the batch
    assert not torch.equal(first, second)  # and per call


def test_imported_sized_factory_takes_the_input_size():
    torch.manual_seed(0)
    fused = hfkern.fuse([_ImportedSizedFactory() for _ in range(B)])
    out = fused(torch.randn(B, 5, 4))
    assert out.shape == (B, 5, 4)
    out7 = fused(torch.randn(B, 7, 4))  # the size follows the input, as forward says
    assert out7.shape == (B, 7, 4)
    assert not torch.equal(out[0], out[1])


def test_the_imported_names_are_restored_after_the_capture():
    fused = hfkern.fuse([_ImportedDropout() for _ in range(B)])
    fused(torch.ones(B, 2, 4))
    assert dropout is torch.nn.functional.dropout and randn is torch.randn and zeros is torch.zeros
    assert globals()["dropout"] is torch.nn.functional.dropout


@dataclasses.dataclass
class _Scale:  # eq=True: unhashable, and callable, as a module-level value of the model's module
    factor: float

    def __call__(self, x):
        return x * self.factor


_SCALE = _Scale(2.0)


class _UsesUnhashable(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 4)

    def forward(self, x):
        return _SCALE(self.fc(x))


def test_unhashable_callables_in_the_models_module_are_left_alone():
    """The names are matched by identity: a callable module-level value that cannot be hashed
    (a dataclass instance) neither breaks the capture nor leaves torch patched."""
    torch.manual_seed(0)
    models = [_UsesUnhashable() for _ in range(B)]
    x = torch.randn(B, 2, 4)
    out = hfkern.fuse(models)(x)
    for b, m in enumerate(models):
        assert_close(out[b], m(x[b]))
    assert torch.nn.functional.dropout is dropout and torch.randn is randn
    assert nn.Module.__setattr__ is torch.nn.modules.module.Module.__dict__["__setattr__"]
