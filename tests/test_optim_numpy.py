"""Per-model values given as numpy arrays (and numpy scalars) act as the same list or tensor would.

Optimizer and scheduler hyperparameters, GradScaler and the clipping functions
are run once with numpy inputs and once with the same values as lists; the
results must be bit-identical. Bad numpy inputs are rejected as bad lists are.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

import hfkern.optim as hoptim
import hfkern.utils as hutils
from hfkern.amp import GradScaler
from hfkern.optim import lr_scheduler as H

B = 3
OPTIMIZERS = {
    "SGD": dict(lr=[0.05, 0.02, 0.1], momentum=[0.5, 0.9, 0.0], dampening=[0.0, 0.1, 0.2],
                weight_decay=[0.0, 0.01, 0.02]),
    "Adam": dict(lr=[0.01, 0.02, 0.03], betas=([0.8, 0.9, 0.85], [0.99, 0.999, 0.995]),
                 eps=[1e-8, 1e-7, 1e-6], weight_decay=[0.0, 0.01, 0.1]),
    "AdamW": dict(lr=[0.01, 0.02, 0.03], betas=(0.9, [0.95, 0.99, 0.999]), weight_decay=[0.0, 0.01, 0.1]),
    "Adagrad": dict(lr=[0.05, 0.1, 0.2], lr_decay=[0.0, 0.01, 0.05], weight_decay=[0.0, 0.01, 0.1],
                    initial_accumulator_value=[0.0, 0.1, 0.5], eps=[1e-10, 1e-8, 1e-6]),
    "Adadelta": dict(lr=[0.5, 1.0, 0.8], rho=[0.8, 0.9, 0.95], eps=[1e-6, 1e-5, 1e-4],
                     weight_decay=[0.0, 0.01, 0.1]),
    "RMSprop": dict(lr=[0.005, 0.01, 0.002], alpha=[0.9, 0.99, 0.95], eps=[1e-8, 1e-7, 1e-6],
                    weight_decay=[0.0, 0.01, 0.1], momentum=[0.0, 0.5, 0.9]),
}


def _as_numpy(value, how):
    """``value`` (a number, a list, or a pair of them) as numpy: ``array`` or ``float32`` arrays,
    or numpy scalars for numbers."""
    if isinstance(value, tuple):
        return tuple(_as_numpy(v, how) for v in value)
    if isinstance(value, list):
        return np.array(value, dtype=np.float32 if how == "float32" else np.float64)
    return np.float32(value) if how == "float32" else np.float64(value)


def _as_list(value, how):
    """The values the numpy form stands for, as plain floats."""
    if isinstance(value, tuple):
        return tuple(_as_list(v, how) for v in value)
    if isinstance(value, list):
        return [float(np.float32(v)) if how == "float32" else v for v in value]
    return float(np.float32(value)) if how == "float32" else value


def _train(cls, kwargs, steps=5):
    g = torch.Generator().manual_seed(3)
    p = torch.nn.Parameter(torch.randn(B, 4, 3, generator=g))
    opt = cls([p], **kwargs)
    for _ in range(steps):
        p.grad = torch.randn(p.shape, generator=g)
        opt.step()
    return p.detach(), opt


@pytest.mark.parametrize("how", ["float64", "float32"])
@pytest.mark.parametrize("name", list(OPTIMIZERS))
def test_optimizer_hyperparameters_accept_numpy(name, how):
    cls = getattr(hoptim, name)
    cfg = OPTIMIZERS[name]
    got, opt = _train(cls, {k: _as_numpy(v, how) for k, v in cfg.items()})
    want, ref = _train(cls, {k: _as_list(v, how) for k, v in cfg.items()})
    assert torch.equal(got, want)
    for k in cfg:
        a, b = opt.param_groups[0][k], ref.param_groups[0][k]
        for x, y in zip(a if isinstance(a, tuple) else (a,), b if isinstance(b, tuple) else (b,)):
            assert torch.equal(x, y), k


def test_numpy_scalars_and_assigned_arrays():
    p = torch.nn.Parameter(torch.randn(B, 2))
    opt = hoptim.SGD([p], lr=np.float32(0.5), momentum=np.int64(0), weight_decay=np.float16(0.25))
    assert torch.equal(opt.param_groups[0]["lr"], torch.full((B,), 0.5))
    assert torch.equal(opt.param_groups[0]["weight_decay"], torch.full((B,), 0.25))
    # A numpy array assigned between steps is validated and stored at the next step.
    opt.param_groups[0]["lr"] = np.array([0.1, 0.2, 0.3])
    p.grad = torch.ones(B, 2)
    opt.step()
    assert torch.equal(opt.param_groups[0]["lr"], torch.tensor([0.1, 0.2, 0.3]))
    # A 0-d array is one value for every model.
    opt = hoptim.Adam([p], lr=np.array(0.01), betas=np.array([[0.9, 0.8, 0.7], [0.99, 0.999, 0.9]]))
    assert torch.equal(opt.param_groups[0]["lr"], torch.full((B,), 0.01))
    assert torch.equal(opt.param_groups[0]["betas"][0], torch.tensor([0.9, 0.8, 0.7]))


BAD_VALUES = [
    (np.array([0.1, 0.2]), ValueError, r"lr must have one value per model \(length B=3\), got shape \[2\]"),
    (np.array([[0.1, 0.2, 0.3]]), ValueError, r"lr must have one value per model"),
    (np.array([0.1, -0.2, 0.3]), ValueError, "lr must be >= 0"),
    (np.array([0.1, np.nan, 0.3]), ValueError, "lr must not be NaN"),
    (np.array([True, False, True]), TypeError, "lr.*bool"),
    (np.array([1 + 1j, 0, 0]), TypeError, "lr.*complex"),
    (np.array(["0.1", "0.2", "0.3"]), TypeError, "lr"),
    (np.bool_(True), TypeError, "lr"),
]


def test_bad_numpy_values_rejected():
    for value, exc, match in BAD_VALUES:
        with pytest.raises(exc, match=match):
            hoptim.SGD([torch.nn.Parameter(torch.randn(B, 2))], lr=value)


def _lrs(make, steps=12, metrics=None):
    p = torch.nn.Parameter(torch.randn(B, 2))
    opt = hoptim.SGD([p], lr=[0.1, 0.05, 0.2], momentum=0.5)
    sched = make(opt)
    out = []
    for i in range(steps):
        if metrics is None:
            sched.step()
        else:
            sched.step(metrics(i))
        out.append(sched.get_last_lr()[0].clone())
        out.append(opt.param_groups[0]["momentum"].clone())
    return torch.stack(out)


def _i(values):
    return np.array(values, dtype=np.int64)


def _f(values):
    return np.array(values, dtype=np.float64)


SCHEDULERS = {
    "StepLR": (lambda o: H.StepLR(o, step_size=_i([2, 3, 4]), gamma=_f([0.5, 0.9, 0.7])),
               lambda o: H.StepLR(o, step_size=[2, 3, 4], gamma=[0.5, 0.9, 0.7])),
    "StepLR_scalars": (lambda o: H.StepLR(o, step_size=np.int32(3), gamma=np.float32(0.5)),
                       lambda o: H.StepLR(o, step_size=3, gamma=0.5)),
    "MultiStepLR": (lambda o: H.MultiStepLR(o, milestones=_i([2, 5, 5]), gamma=_f([0.5, 0.9, 0.7])),
                    lambda o: H.MultiStepLR(o, milestones=[2, 5, 5], gamma=[0.5, 0.9, 0.7])),
    "MultiStepLR_per_model": (lambda o: H.MultiStepLR(o, milestones=[_i([2, 5]), _i([3]), _i([1, 1, 4])],
                                                      gamma=np.float32(0.5)),
                              lambda o: H.MultiStepLR(o, milestones=[[2, 5], [3], [1, 1, 4]], gamma=0.5)),
    "ExponentialLR": (lambda o: H.ExponentialLR(o, gamma=_f([0.5, 0.9, 0.7])),
                      lambda o: H.ExponentialLR(o, gamma=[0.5, 0.9, 0.7])),
    "CosineAnnealingLR": (lambda o: H.CosineAnnealingLR(o, T_max=_i([3, 5, 7]), eta_min=_f([0, 1e-3, 1e-4])),
                          lambda o: H.CosineAnnealingLR(o, T_max=[3, 5, 7], eta_min=[0, 1e-3, 1e-4])),
    "LinearLR": (lambda o: H.LinearLR(o, start_factor=_f([0.1, 0.5, 1.0]), end_factor=np.float32(0.5),
                                      total_iters=_i([3, 5, 8])),
                 lambda o: H.LinearLR(o, start_factor=[0.1, 0.5, 1.0], end_factor=0.5, total_iters=[3, 5, 8])),
    "OneCycleLR": (lambda o: H.OneCycleLR(o, max_lr=_f([0.3, 0.2, 0.5]), total_steps=_i([12, 15, 20]),
                                          pct_start=_f([0.3, 0.2, 0.4]), base_momentum=_f([0.8, 0.7, 0.85]),
                                          max_momentum=np.float32(0.95), div_factor=_f([25, 10, 5]),
                                          final_div_factor=_f([1e4, 100, 10])),
                   lambda o: H.OneCycleLR(o, max_lr=[0.3, 0.2, 0.5], total_steps=[12, 15, 20],
                                          pct_start=[0.3, 0.2, 0.4], base_momentum=[0.8, 0.7, 0.85],
                                          max_momentum=float(np.float32(0.95)), div_factor=[25, 10, 5],
                                          final_div_factor=[1e4, 100, 10])),
    "OneCycleLR_epochs": (lambda o: H.OneCycleLR(o, max_lr=0.3, epochs=_i([3, 4, 5]), steps_per_epoch=np.int64(4),
                                                 cycle_momentum=False),
                          lambda o: H.OneCycleLR(o, max_lr=0.3, epochs=[3, 4, 5], steps_per_epoch=4,
                                                 cycle_momentum=False)),
    # Factors as a [B] array on even epochs, as a 0-d array (one for every model) on odd ones. The
    # same Python floats go in both ways: numpy's own pow may round differently from Python's.
    "LambdaLR": (lambda o: H.LambdaLR(o, lr_lambda=lambda e: np.array([0.9 ** e, 0.8 ** e, 0.7 ** e])
                                      if e % 2 == 0 else np.array(0.5 ** e)),
                 lambda o: H.LambdaLR(o, lr_lambda=lambda e: [0.9 ** e, 0.8 ** e, 0.7 ** e] if e % 2 == 0
                                      else 0.5 ** e)),
    "ConstantLR": (lambda o: H.ConstantLR(o, factor=_f([0.5, 0.25, 0.1]), total_iters=_i([2, 4, 6])),
                   lambda o: H.ConstantLR(o, factor=[0.5, 0.25, 0.1], total_iters=[2, 4, 6])),
    "PolynomialLR": (lambda o: H.PolynomialLR(o, total_iters=_i([4, 6, 9]), power=_f([1.0, 2.0, 0.5])),
                     lambda o: H.PolynomialLR(o, total_iters=[4, 6, 9], power=[1.0, 2.0, 0.5])),
    "CyclicLR": (lambda o: H.CyclicLR(o, base_lr=_f([0.01, 0.02, 0.03]), max_lr=_f([0.1, 0.2, 0.3]),
                                      step_size_up=_i([2, 3, 4]), step_size_down=np.int64(3), mode="exp_range",
                                      gamma=_f([0.9, 0.95, 0.99]), base_momentum=_f([0.7, 0.8, 0.75]),
                                      max_momentum=np.float64(0.95)),
                 lambda o: H.CyclicLR(o, base_lr=[0.01, 0.02, 0.03], max_lr=[0.1, 0.2, 0.3],
                                      step_size_up=[2, 3, 4], step_size_down=3, mode="exp_range",
                                      gamma=[0.9, 0.95, 0.99], base_momentum=[0.7, 0.8, 0.75], max_momentum=0.95)),
    "CosineAnnealingWarmRestarts": (
        lambda o: H.CosineAnnealingWarmRestarts(o, T_0=_i([2, 3, 4]), T_mult=_i([1, 2, 1]), eta_min=_f([0, 0.01, 0])),
        lambda o: H.CosineAnnealingWarmRestarts(o, T_0=[2, 3, 4], T_mult=[1, 2, 1], eta_min=[0, 0.01, 0])),
}


@pytest.mark.parametrize("name", list(SCHEDULERS))
def test_scheduler_arguments_accept_numpy(name):
    numpy_form, list_form = SCHEDULERS[name]
    assert torch.equal(_lrs(numpy_form), _lrs(list_form))


@pytest.mark.parametrize("as_numpy", [_f, lambda v: np.array(v, dtype=np.float32)])
def test_reduce_on_plateau_accepts_numpy(as_numpy):
    streams = np.stack([1.0 / (1.0 + np.arange(12)), np.full(12, 0.5), 1.0 - 0.01 * np.arange(12)], axis=1)
    kwargs = dict(patience=_i([0, 1, 2]), factor=_f([0.5, 0.1, 0.3]), threshold=np.float64(1e-3),
                  cooldown=_i([0, 1, 0]), min_lr=_f([0, 1e-4, 1e-3]), eps=np.float32(1e-8))
    got = _lrs(lambda o: H.ReduceLROnPlateau(o, **kwargs), metrics=lambda i: as_numpy(streams[i]))
    lists = {k: (v.tolist() if isinstance(v, np.ndarray) else float(v)) for k, v in kwargs.items()}
    want = _lrs(lambda o: H.ReduceLROnPlateau(o, **lists),
                metrics=lambda i: torch.from_numpy(as_numpy(streams[i]).astype(np.float64)))
    assert torch.equal(got, want)


def test_scheduler_bad_numpy_values_rejected():
    opt = hoptim.SGD([torch.nn.Parameter(torch.randn(B, 2))], lr=0.1)
    with pytest.raises(TypeError, match="step_size"):
        H.StepLR(opt, step_size=_f([1.0, 2.0, 3.0]))
    with pytest.raises(ValueError, match=r"step_size must have one value per model \(length B=3\)"):
        H.StepLR(opt, step_size=_i([1, 2]))
    with pytest.raises(ValueError, match="gamma must be >= 0"):
        H.ExponentialLR(opt, gamma=_f([0.5, -0.5, 0.5]))
    with pytest.raises(ValueError, match=r"metrics of shape \[B=3\]"):
        H.ReduceLROnPlateau(opt).step(_f([1.0, 2.0]))


@pytest.mark.parametrize("how", ["array", "scalars"])
def test_grad_scaler_accepts_numpy(how):
    if how == "array":
        kwargs = dict(init_scale=_f([64.0, 128.0, 256.0]))
    else:
        kwargs = dict(init_scale=np.float32(64.0), growth_factor=np.float64(3.0),
                      backoff_factor=np.float32(0.25), growth_interval=np.int64(2))
    scaler = GradScaler("cpu", B=B, **kwargs)
    lists = {k: (v.tolist() if isinstance(v, np.ndarray) else v.item()) for k, v in kwargs.items()}
    ref = GradScaler("cpu", B=B, **lists)
    for s in (scaler, ref):
        p = torch.nn.Parameter(torch.ones(B, 2))
        opt = hoptim.SGD([p], lr=0.1)
        for step in range(4):
            loss = (p * (step + 1)).sum(1) * torch.tensor([1.0, math.inf if step == 1 else 1.0, 1.0])
            s.scale(loss).sum().backward()
            s.step(opt)
            s.update()
            opt.zero_grad()
    assert torch.equal(scaler.get_scale(), ref.get_scale())
    scaler.update(_f([2.0, 4.0, 8.0]))
    assert scaler.get_scale().tolist() == [2.0, 4.0, 8.0]
    scaler.update(np.float32(16.0))
    assert scaler.get_scale().tolist() == [16.0] * B
    # A state dict with numpy values (e.g. written by other tools) loads too.
    fresh = GradScaler("cpu", B=B)
    fresh.load_state_dict({"scale": _f([1.0, 2.0, 4.0]), "growth_factor": np.float64(2.0),
                           "backoff_factor": np.float32(0.5), "growth_interval": np.int32(5),
                           "_growth_tracker": _i([0, 1, 2])})
    assert fresh.get_scale().tolist() == [1.0, 2.0, 4.0]
    assert fresh._get_growth_tracker().tolist() == [0, 1, 2] and fresh.get_growth_interval() == 5
    with pytest.raises(ValueError, match="init_scale must have one value per model"):
        GradScaler("cpu", B=B, init_scale=_f([1.0, 2.0]))


@pytest.mark.parametrize("kind", ["array", "float32_array", "scalar"])
def test_clipping_accepts_numpy(kind):
    value = {"array": _f([0.5, 1.0, 2.0]), "float32_array": np.array([0.5, 1.0, 2.0], dtype=np.float32),
             "scalar": np.float32(0.75)}[kind]
    plain = value.tolist() if isinstance(value, np.ndarray) else float(value)
    results = []
    for v in (value, plain):
        g = torch.Generator().manual_seed(5)
        params = [torch.nn.Parameter(torch.randn(B, 4, 3, generator=g)),
                  torch.nn.Parameter(torch.randn(B, 5, generator=g))]
        for p in params:
            p.grad = 3 * torch.randn(p.shape, generator=g)
        norms = hutils.clip_grad_norm_(params, max_norm=v)
        after_norm = [p.grad.clone() for p in params]
        hutils.clip_grad_value_(params, clip_value=v)
        results.append((norms, after_norm, [p.grad.clone() for p in params]))
    (n1, a1, c1), (n2, a2, c2) = results
    assert torch.equal(n1, n2)
    assert all(torch.equal(x, y) for x, y in zip(a1 + c1, a2 + c2))
    with pytest.raises(ValueError, match="max_norm must have one value per model"):
        hutils.clip_grad_norm_(params, max_norm=_f([1.0, 2.0]))
