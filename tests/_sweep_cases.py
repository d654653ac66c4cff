"""Tiny sweeps for the runner's tests: data, models, search spaces, and a trial trained alone.

Shared by tests/test_sweep*.py and the worker processes they start
(tests/_sweep_worker.py). Everything is small enough that a study of a few
trials trains in about a second on two CPU cores.
"""

from __future__ import annotations

import math

import optuna
import torch
import torch.nn.functional as F
from torch import nn

import hfkern
from hfkern.optim import lr_scheduler as H
from hfkern.sweep import batch_indices

N_TRAIN, N_VALID, BATCH, EPOCHS = 192, 96, 32, 3  # 6 steps per epoch


def data(seed: int = 0):
    """Digit-like 10-class data: 8x8 images whose class shifts a random template (deterministic)."""
    g = torch.Generator().manual_seed(seed)
    templates = torch.randn(10, 1, 8, 8, generator=g)
    y = torch.randint(0, 10, (N_TRAIN + N_VALID,), generator=g)
    x = templates[y] + 1.5 * torch.randn(N_TRAIN + N_VALID, 1, 8, 8, generator=g)
    return (x[:N_TRAIN], y[:N_TRAIN]), (x[N_TRAIN:], y[N_TRAIN:])


def model(params) -> nn.Module:
    """A small CNN; ``width`` (grouped) changes its architecture, ``dropout`` (fusible) does not."""
    w = int(params.get("width", 4))
    return nn.Sequential(
        nn.Conv2d(1, w, 3, padding=1), nn.BatchNorm2d(w), nn.ReLU(), nn.MaxPool2d(2),
        nn.Flatten(), nn.Dropout(params.get("dropout", 0.0)), nn.Linear(w * 16, 10),
    )


def space(trial: optuna.Trial) -> dict:
    return {"lr": trial.suggest_float("lr", 1e-3, 0.3, log=True),
            "momentum": trial.suggest_float("momentum", 0.0, 0.9)}


def space_widths(trial: optuna.Trial) -> dict:
    return {**space(trial), "width": trial.suggest_categorical("width", [3, 5])}


def runner(study: optuna.Study, **kw) -> "hfkern.sweep.Runner":
    train, valid = data()
    args = dict(space=space, model=model, fusible=["lr", "momentum"], train=train, valid=valid,
                batch_size=BATCH, epochs=EPOCHS, optimizer=hfkern.optim.SGD, metric="loss", B=3,
                progress=False)
    args.update(kw)
    return hfkern.sweep.Runner(study, args.pop("space"), args.pop("model"), **args)


def sgd(params: dict, parameters):
    return torch.optim.SGD(parameters, lr=params["lr"], momentum=params["momentum"])


def train_alone(params: dict, seed: int, *, epochs: int = EPOCHS, batch_size: int = BATCH, data_seed: int = 0,
                scheduler=None, metric: str = "loss", optimizer=sgd, trial=None) -> list[float]:
    """Plain torch: the trial's model (built after torch.manual_seed(seed)), a torch optimizer
    (default SGD), the runner's batch order; its validation value after every epoch. With an
    Optuna ``trial``, each value is reported and the trial pruned as Optuna's own loop does."""
    (x, y), (xv, yv) = data()
    torch.manual_seed(seed)
    m = model(params)
    opt = optimizer(params, m.parameters())
    sched = scheduler(opt) if scheduler else None
    steps = N_TRAIN // batch_size
    values = []
    for step in range(epochs * steps):
        idx = batch_indices(N_TRAIN, batch_size, step, data_seed)
        m.train()
        loss = F.cross_entropy(m(x[idx]), y[idx])
        opt.zero_grad()
        loss.backward()
        opt.step()
        if (step + 1) % steps == 0:
            if sched:
                sched.step()
            m.eval()
            with torch.no_grad():
                out = m(xv)
            values.append(F.cross_entropy(out, yv).item() if metric == "loss"
                          else (out.argmax(-1) == yv).float().mean().item())
            if trial is not None:
                trial.report(values[-1], len(values))
                if trial.should_prune():
                    raise optuna.TrialPruned()
    return values


def curve(trial: optuna.trial.FrozenTrial) -> list[float]:
    return [trial.intermediate_values[r] for r in sorted(trial.intermediate_values)]


def assert_close_curves(got: list[float], want: list[float], what: str, rel: float = 2e-4) -> None:
    assert len(got) == len(want), f"{what}: {len(got)} reports, trained alone {len(want)}"
    for r, (a, b) in enumerate(zip(got, want), 1):
        assert math.isclose(a, b, rel_tol=rel, abs_tol=rel / 10), f"{what}: report {r}: array {a}, alone {b}"


class PruneNumbers(optuna.pruners.BasePruner):
    """Prunes the trials whose numbers are listed, at their first report."""

    def __init__(self, numbers):
        self.numbers = set(numbers)

    def prune(self, study, trial) -> bool:
        return trial.number in self.numbers


def step_lr(opt):
    return torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)


SCHEDULER = dict(scheduler=H.StepLR, scheduler_kwargs=lambda p: {"step_size": 1, "gamma": 0.5})
