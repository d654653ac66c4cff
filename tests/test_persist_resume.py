"""Exact resume: save at step k, load into fresh objects, continue.

Every array optimizer with every scheduler (chained ones and SequentialLR
included) is run for STEPS steps without interruption, and again with a save
at step SPLIT through ``torch.save`` / ``torch.load`` (torch.load's default,
``weights_only=True``) into a freshly built optimizer and scheduler. The
resumed run must be bit-identical to the uninterrupted one: parameters,
optimizer state, learning rates and the scheduler's last learning rates.
"""

from __future__ import annotations

import io

import pytest
import torch

import hfkern.optim as hoptim
from hfkern.optim import lr_scheduler as H
from _sched import _f0, _f1, _f2, _m0, _m1

STEPS = 40
SPLIT = 17
GROUP_LRS = ([0.05, 0.02, 0.1], [0.01, 0.03, 0.007])
OPTIMIZERS = {
    "SGD": dict(momentum=[0.5, 0.9, 0.0], weight_decay=0.01),
    "Adam": dict(betas=([0.8, 0.9, 0.85], 0.99), amsgrad=True),
    "AdamW": dict(betas=(0.9, [0.95, 0.99, 0.999])),
    "Adagrad": dict(lr_decay=[0.0, 0.01, 0.05], initial_accumulator_value=0.1),
    "Adadelta": dict(rho=[0.8, 0.9, 0.95]),
    "RMSprop": dict(momentum=[0.3, 0.5, 0.7], centered=True),
}
HAS_MOMENTUM = {"SGD", "Adam", "AdamW", "RMSprop"}


def _m2(e):
    return 1.01 if e < 10 else 0.93


def _schedulers(opt, name, momentum, B):
    """The scheduler(s) of case ``name`` on ``opt``: one scheduler, or a list stepped in order."""
    s = lambda values: values[:B]  # noqa: E731  the first B models' values
    if name == "StepLR":
        return H.StepLR(opt, step_size=s([3, 5, 7]), gamma=s([0.5, 0.9, 0.7]))
    if name == "MultiStepLR":
        return H.MultiStepLR(opt, milestones=s([[3, 9, 20], [5, 5, 25], [30, 2]]), gamma=0.6)
    if name == "ExponentialLR":
        return H.ExponentialLR(opt, gamma=s([0.9, 0.95, 0.97]))
    if name == "CosineAnnealingLR":  # every model passes its T_max before the save
        return H.CosineAnnealingLR(opt, T_max=s([7, 11, 5]), eta_min=s([0.0, 1e-4, 1e-3]))
    if name == "LinearLR":
        return H.LinearLR(opt, start_factor=s([0.1, 0.3, 0.5]), end_factor=s([1.0, 0.5, 0.9]),
                          total_iters=s([10, 25, 30]))
    if name == "OneCycleLR":
        return H.OneCycleLR(opt, max_lr=s([0.3, 0.2, 0.5]), total_steps=s([45, 50, 60]),
                            cycle_momentum=momentum)
    if name == "LambdaLR":
        return H.LambdaLR(opt, lr_lambda=s([_f0, _f1, _f2]))
    if name == "ReduceLROnPlateau":
        return H.ReduceLROnPlateau(opt, patience=s([0, 2, 4]), cooldown=s([0, 1, 3]), factor=s([0.5, 0.1, 0.3]))
    if name == "SequentialLR":
        return H.SequentialLR(opt, [H.LinearLR(opt, start_factor=s([0.01, 0.1, 0.5]), total_iters=s([5, 3, 8])),
                                    H.CosineAnnealingLR(opt, T_max=s([9, 6, 12]), eta_min=s([0.0, 1e-4, 1e-3]))],
                              milestones=[6])
    if name == "chained":
        return [H.ExponentialLR(opt, gamma=s([0.9, 0.95, 0.97])),
                H.MultiStepLR(opt, milestones=s([[4, 9], [6], [2, 3, 30]]), gamma=s([0.5, 0.1, 0.8]))]
    if name == "ChainedScheduler":
        return H.ChainedScheduler([H.ConstantLR(opt, factor=s([0.5, 0.25, 0.1]), total_iters=s([4, 20, 30])),
                                   H.ExponentialLR(opt, gamma=s([0.9, 0.95, 0.97]))], optimizer=opt)
    if name == "ConstantLR":
        return H.ConstantLR(opt, factor=s([0.5, 0.25, 1 / 3]), total_iters=s([4, 20, 30]))
    if name == "MultiplicativeLR":
        return H.MultiplicativeLR(opt, lr_lambda=s([_m0, _m1, _m2]))
    if name == "PolynomialLR":
        return H.PolynomialLR(opt, total_iters=s([10, 30, 50]), power=s([1.0, 2.0, 0.5]))
    if name == "CyclicLR":
        return H.CyclicLR(opt, base_lr=s([0.001, 0.002, 0.003]), max_lr=s([0.1, 0.05, 0.2]),
                          step_size_up=s([4, 5, 6]), step_size_down=s([3, 5, 9]), mode="triangular2",
                          cycle_momentum=momentum)
    if name == "CosineAnnealingWarmRestarts":
        return H.CosineAnnealingWarmRestarts(opt, T_0=s([3, 5, 4]), T_mult=s([1, 2, 3]),
                                             eta_min=s([0.0, 1e-4, 1e-3]))
    raise AssertionError(name)


SCHEDULERS = ["StepLR", "MultiStepLR", "ExponentialLR", "CosineAnnealingLR", "LinearLR", "OneCycleLR",
              "LambdaLR", "ReduceLROnPlateau", "SequentialLR", "chained", "ChainedScheduler", "ConstantLR",
              "MultiplicativeLR", "PolynomialLR", "CyclicLR", "CosineAnnealingWarmRestarts"]


def _metrics(step, B):
    g = torch.Generator().manual_seed(1000 + step)
    return (1.0 - 0.01 * step + 0.05 * torch.randn(3, generator=g, dtype=torch.float64))[:B]


def _first(value, B):
    """A configuration value with its per-model lists cut to the first B models."""
    if isinstance(value, tuple):
        return tuple(_first(v, B) for v in value)
    return value[:B] if isinstance(value, list) else value


class _Run:
    def __init__(self, opt_name, sched_name, params):
        self.opt_name, self.sched_name = opt_name, sched_name
        self.params = params
        self.B = B = params[0].size(0)
        cls = getattr(hoptim, opt_name)
        self.opt = cls([{"params": [p], "lr": GROUP_LRS[g][:B]} for g, p in enumerate(params)],
                       **{k: _first(v, B) for k, v in OPTIMIZERS[opt_name].items()})
        scheds = _schedulers(self.opt, sched_name, opt_name in HAS_MOMENTUM, B)
        self.scheds = scheds if isinstance(scheds, list) else [scheds]

    def step(self, i):
        for j, p in enumerate(self.params):
            g = torch.Generator().manual_seed(100 * i + j)
            p.grad = torch.randn(p.shape, generator=g)
        self.opt.step()
        for s in self.scheds:
            if self.sched_name == "ReduceLROnPlateau":
                s.step(_metrics(i, self.B))
            else:
                s.step()

    def lrs(self):
        return [g["lr"].clone() for g in self.opt.param_groups], \
            [[v.clone() for v in s.get_last_lr()] for s in self.scheds]


def _params(B=3):
    g = torch.Generator().manual_seed(7)
    return [torch.nn.Parameter(torch.randn(B, 5, 3, generator=g)),
            torch.nn.Parameter(torch.randn(B, 7, generator=g))]


def _save_load(obj):
    buf = io.BytesIO()
    torch.save(obj, buf)
    buf.seek(0)
    return torch.load(buf)  # the default: weights_only=True


def _assert_equal(a, b, what):
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor) and a.dtype == b.dtype and a.shape == b.shape, what
        assert torch.equal(a, b), f"{what}: {a} != {b}"
    elif isinstance(a, dict):
        assert set(a) == set(b), what
        for k in a:
            _assert_equal(a[k], b[k], f"{what}[{k!r}]")
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b), what
        for i, (x, y) in enumerate(zip(a, b)):
            _assert_equal(x, y, f"{what}[{i}]")
    else:
        assert a == b, f"{what}: {a!r} != {b!r}"


def _check_resume(opt_name, sched_name, B):
    straight = _Run(opt_name, sched_name, _params(B))
    expected = []
    for i in range(STEPS):
        straight.step(i)
        expected.append(straight.lrs())

    run = _Run(opt_name, sched_name, _params(B))
    for i in range(SPLIT):
        run.step(i)
    saved = _save_load({"opt": run.opt.state_dict(), "scheds": [s.state_dict() for s in run.scheds],
                        "params": [p.detach() for p in run.params]})
    # Fresh objects as a training script builds them, then the saved states (torch's order).
    resumed = _Run(opt_name, sched_name, [torch.nn.Parameter(p.clone()) for p in saved["params"]])
    resumed.opt.load_state_dict(saved["opt"])
    for s, state in zip(resumed.scheds, saved["scheds"], strict=True):
        s.load_state_dict(state)
    _assert_equal(resumed.lrs(), expected[SPLIT - 1], "after load")
    for i in range(SPLIT, STEPS):
        resumed.step(i)
        _assert_equal(resumed.lrs(), expected[i], f"step {i + 1}")
    for p, q in zip(resumed.params, straight.params):
        assert torch.equal(p, q), "parameters differ"
    _assert_equal(resumed.opt.state_dict(), straight.opt.state_dict(), "optimizer state")


@pytest.mark.parametrize("opt_name, B", [(name, 3) for name in OPTIMIZERS] + [("SGD", 1), ("Adam", 1)])
def test_resume_is_bit_identical(opt_name, B):
    """The optimizer with every scheduler; the message lists every scheduler that does not resume exactly."""
    failures = []
    for sched_name in SCHEDULERS:
        try:
            _check_resume(opt_name, sched_name, B)
        except AssertionError as e:
            failures.append(f"{sched_name}: {str(e).splitlines()[0]}")
    assert not failures, f"{opt_name}:\n" + "\n".join(failures)


@pytest.mark.parametrize("sched_name", ["ExponentialLR", "CosineAnnealingLR", "SequentialLR", "chained",
                                        "CyclicLR", "ReduceLROnPlateau"])
def test_resume_loading_the_scheduler_first(sched_name):
    """The order of torch's SequentialLR example: scheduler state, then optimizer state."""
    straight = _Run("SGD", sched_name, _params())
    for i in range(STEPS):
        straight.step(i)
    run = _Run("SGD", sched_name, _params())
    for i in range(SPLIT):
        run.step(i)
    saved = _save_load({"opt": run.opt.state_dict(), "scheds": [s.state_dict() for s in run.scheds]})
    resumed = _Run("SGD", sched_name, [torch.nn.Parameter(p.detach().clone()) for p in run.params])
    for s, state in zip(resumed.scheds, saved["scheds"], strict=True):
        s.load_state_dict(state)
    resumed.opt.load_state_dict(saved["opt"])
    for i in range(SPLIT, STEPS):
        resumed.step(i)
    for p, q in zip(resumed.params, straight.params):
        assert torch.equal(p, q)
    _assert_equal(resumed.lrs(), straight.lrs(), "learning rates")
