"""The runner's ``loss_denominator``: micro-batches of a loss whose mean is not over samples.

Under a strategy of several micro-batches each chunk's mean loss is weighted by what that mean
divides by, so that the weighted sum is the full batch's mean. A class-weighted cross entropy
divides by the summed weights of the chunk's targets, not by its samples: the runner passes
``loss_denominator`` to :func:`hfkern.plan.make_step` for it.
"""

from __future__ import annotations

import optuna
import pytest
import torch
from torch import nn

import hfkern
from hfkern.nn import functional as AF

from . import _sweep_cases as cases

CLASS_WEIGHT = torch.linspace(0.2, 3.0, 10)


def mlp(params) -> nn.Module:  # no batch norm: micro-batches leave a trial's results as one batch's
    return nn.Sequential(nn.Flatten(), nn.Linear(64, 12), nn.Tanh(), nn.Linear(12, 10))


def weighted_loss(out, y, hp):
    return AF.cross_entropy(out, y, weight=CLASS_WEIGHT.to(out.device))


def summed_weights(y):
    return CLASS_WEIGHT.to(y.device)[y].sum()


def curves(micro_batches: int, **kw) -> list[list[float]]:
    study = optuna.create_study(sampler=optuna.samplers.RandomSampler(0))
    strategy = hfkern.plan.Strategy(B=3, micro_batches=micro_batches)
    cases.runner(study, model=mlp, B=None, strategy=strategy, loss=weighted_loss, epochs=2, **kw).run(n_trials=3)
    return [cases.curve(t) for t in sorted(study.trials, key=lambda t: t.number)]


def test_micro_batches_weighted_by_the_loss_denominator_train_as_one_batch():
    whole = curves(1)
    split = curves(2, loss_denominator=summed_weights)
    for k, (a, b) in enumerate(zip(split, whole)):
        cases.assert_close_curves(a, b, f"trial {k}: two micro-batches against one batch", 1e-4)
    # Weighted by samples (no loss_denominator), the same chunks train otherwise: the argument is what
    # makes the two agree.
    by_samples = curves(2)
    assert max(abs(a - b) for ca, cb in zip(by_samples, whole) for a, b in zip(ca, cb)) > 1e-4


def test_loss_denominator_must_be_callable():
    study = optuna.create_study()
    with pytest.raises(TypeError, match="loss_denominator must be callable or None, got int"):
        cases.runner(study, loss_denominator=3)
