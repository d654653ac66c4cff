"""Fusing and unfusing draw nothing from torch's random generators.

Building an array module from B models (``from_modules``, ``hfkern.fuse``), extracting model
b from one (``extract_model``, ``to_modules``, ``unfuse``, and the capture of a fused
model's forward at its first call, which extracts model 0) constructs modules whose random
initial values are all overwritten from the models' state. They used to be drawn from the
global generator, so every later draw (dropout masks, a new model's initialization)
depended on how often models had been fused or extracted: a sweep with an execution
strategy, which fuses one more array to check it, gave other results than the same sweep
without one, although nothing else differed.
"""

from __future__ import annotations

import optuna
import pytest
import torch
from torch import nn

import hfkern
import hfkern.plan as hp
import hfkern.sweep
from hfkern.nn._base import _array_class

B = 3


class _Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(2, 4, 3, padding=1)
        self.bn = nn.BatchNorm2d(4)
        self.act = nn.PReLU()
        self.emb = nn.Embedding(7, 4)
        enc = nn.TransformerEncoderLayer(4, 2, dim_feedforward=8, batch_first=True)
        self.enc = nn.TransformerEncoder(enc, 1, enable_nested_tensor=False)
        self.norm = nn.LayerNorm(4)
        self.drop = nn.Dropout(0.3)
        self.head = nn.Linear(4, 2)

    def forward(self, x, ids):
        h = self.act(self.bn(self.conv(x))).mean(dim=(2, 3))        # [N, 4]
        t = self.enc(self.emb(ids) + h[:, None])                     # [N, S, 4]
        return self.head(self.drop(self.norm(t.mean(1))))


def _unchanged(fn):
    """Whether ``fn()`` leaves torch's CPU generator as it found it; ``fn``'s result."""
    torch.manual_seed(123)
    before = torch.get_rng_state()
    out = fn()
    return torch.equal(before, torch.get_rng_state()), out


def test_fuse_extract_and_first_forward_draw_nothing():
    torch.manual_seed(0)
    models = [_Net() for _ in range(B)]
    ok, fused = _unchanged(lambda: hfkern.fuse(models))
    assert ok, "hfkern.fuse drew from the generator"
    fused.eval()  # (dropout in training draws, as torch's does)
    x, ids = torch.randn(B, 2, 2, 5, 5), torch.randint(0, 7, (B, 2, 3))
    ok, out = _unchanged(lambda: fused(x, ids))  # the first call captures forward from model 0
    assert ok, "the fused model's first forward drew from the generator"
    for b, m in enumerate(models):
        torch.testing.assert_close(out[b], m.eval()(x[b], ids[b]))
    for name, fn in [("unfuse", lambda: hfkern.unfuse(fused)), ("extract_model", lambda: fused.extract_model(1))]:
        ok, _ = _unchanged(fn)
        assert ok, f"{name} drew from the generator"


@pytest.mark.parametrize("make", [
    lambda: nn.Linear(3, 4), lambda: nn.Conv2d(2, 3, 3), lambda: nn.BatchNorm1d(4), lambda: nn.PReLU(2),
    lambda: nn.MultiheadAttention(4, 2), lambda: nn.Embedding(5, 3), lambda: nn.LayerNorm(4),
    lambda: nn.TransformerEncoder(nn.TransformerEncoderLayer(4, 2, 8), 2, enable_nested_tensor=False),
])
def test_array_modules_from_and_to_torch_modules_draw_nothing(make):
    torch.manual_seed(0)
    mods = [make() for _ in range(B)]
    cls = _array_class(type(mods[0]))
    ok, array = _unchanged(lambda: cls.from_modules(mods))
    assert ok
    ok, back = _unchanged(array.to_modules)
    assert ok
    for m, n in zip(mods, back):
        for (k, v), (_, w) in zip(m.state_dict().items(), n.state_dict().items()):
            assert torch.equal(v, w), k


class _DropNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.f1 = nn.Sequential(nn.Linear(6, 16), nn.Dropout(0.3), nn.ReLU())
        self.head = nn.Linear(16, 4)

    def forward(self, x):
        return self.head(self.f1(x))


def test_sweep_results_do_not_depend_on_a_strategy_that_changes_nothing():
    """A sweep of a dropout model with Strategy(B=2) (or recomputing a block, which leaves
    every trial's results unchanged, as the Runner documents) reports what the sweep without a
    strategy reports. (Before, checking the strategy fused one more array, which drew from the
    generator and moved every later dropout mask.)"""
    optuna.logging.set_verbosity(optuna.logging.ERROR)
    g = torch.Generator().manual_seed(42)
    train = (torch.randn(40, 6, generator=g), torch.randint(0, 4, (40,), generator=g))
    valid = (torch.randn(16, 6, generator=g), torch.randint(0, 4, (16,), generator=g))

    def values(strategy):
        torch.manual_seed(1234)
        study = optuna.create_study(sampler=optuna.samplers.RandomSampler(seed=0))
        runner = hfkern.sweep.Runner(
            study, lambda t: {"lr": t.suggest_float("lr", 1e-3, 0.3, log=True)}, lambda p: _DropNet(),
            fusible=["lr"], train=train, valid=valid, batch_size=10, epochs=1, optimizer=hfkern.optim.SGD,
            B=2, strategy=strategy, progress=False, device="cpu", metric="loss")
        runner.run(n_trials=2)
        return [t.intermediate_values for t in study.trials]

    plain = values(None)
    assert values(hp.Strategy(B=2)) == plain
    assert values(hp.Strategy(B=2, recompute=("f1",))) == plain
