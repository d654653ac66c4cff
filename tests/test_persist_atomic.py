"""A failed ``load_state_dict`` changes nothing.

For every optimizer, every scheduler and GradScaler: each bad state (wrong
array size B, wrong shapes, wrong or missing keys, bad values, another
class's state) raises a ValueError or TypeError, leaves ``state_dict()``
bit-identical to what it was, leaves a ``state_dict()`` that
``torch.load``'s default (``weights_only=True``) reads, and the next step
equals the step of a twin that never saw the failed load.
"""

from __future__ import annotations

import copy
import io
import math

import pytest
import torch

import hfkern.optim as hoptim
from hfkern.amp import GradScaler
from hfkern.optim import lr_scheduler as H
from _sched import _f0, _f1, _f2

B = 3
OPTIMIZERS = {
    "SGD": dict(lr=[0.05, 0.02, 0.1], momentum=[0.5, 0.9, 0.0]),
    "Adam": dict(lr=[0.01, 0.02, 0.03], betas=([0.8, 0.9, 0.85], 0.99), amsgrad=True),
    "AdamW": dict(lr=[0.01, 0.02, 0.03]),
    "Adagrad": dict(lr=[0.05, 0.1, 0.2], initial_accumulator_value=0.1),
    "Adadelta": dict(lr=[0.5, 1.0, 0.8], rho=[0.8, 0.9, 0.95]),
    "RMSprop": dict(lr=[0.005, 0.01, 0.002], momentum=[0.0, 0.5, 0.9], centered=True),
}


def _per_model(cfg, B):
    return {k: (v[:B] if isinstance(v, list) else tuple(x[:B] if isinstance(x, list) else x for x in v)
                if isinstance(v, tuple) else v) for k, v in cfg.items()}


def _snapshot(sd):
    """A deep copy of a state dict (tensors cloned), to compare against later."""
    return copy.deepcopy(sd)


def _assert_equal(a, b, what="state"):
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor), f"{what}: tensor became {type(b).__name__}"
        assert a.dtype == b.dtype and a.shape == b.shape and a.device == b.device, what
        assert torch.equal(a, b), what
    elif isinstance(a, dict):
        assert type(a) is type(b) and set(a) == set(b), f"{what}: keys {set(a) ^ set(b)}"
        for k in a:
            _assert_equal(a[k], b[k], f"{what}[{k!r}]")
    elif isinstance(a, (list, tuple)):
        assert type(a) is type(b) and len(a) == len(b), what
        for i, (x, y) in enumerate(zip(a, b)):
            _assert_equal(x, y, f"{what}[{i}]")
    elif isinstance(a, float) and math.isnan(a):
        assert isinstance(b, float) and math.isnan(b), what
    else:
        assert type(a) is type(b) and a == b, f"{what}: {a!r} != {b!r}"


def _readable(sd):
    buf = io.BytesIO()
    torch.save(sd, buf)
    buf.seek(0)
    torch.load(buf)  # the default: weights_only=True


# ---- optimizers ---------------------------------------------------------------
def _optimizer(name, B=B, seed=0, steps=3, shapes=((5, 3), (7,))):
    g = torch.Generator().manual_seed(seed)
    params = [torch.nn.Parameter(torch.randn(B, *s, generator=g)) for s in shapes]
    opt = getattr(hoptim, name)([{"params": [params[0]]}, {"params": params[1:], "lr": 0.01}],
                                **_per_model(OPTIMIZERS[name], B))
    for _ in range(steps):
        for p in params:
            p.grad = torch.randn(p.shape, generator=g)
        opt.step()
    return params, opt


def _bad_optimizer_states(name):
    """(what, state dict) pairs, each to be rejected by a B=3 ``name`` optimizer."""
    good = _optimizer(name, seed=1)[1].state_dict()
    out = []

    def variant(what, edit):
        sd = copy.deepcopy(good)
        edit(sd)
        out.append((what, sd))

    out.append(("another array size", _optimizer(name, B=2, seed=1)[1].state_dict()))
    out.append(("other parameter shapes", _optimizer(name, seed=1, shapes=((5, 4), (7,)))[1].state_dict()))
    other = "Adagrad" if name != "Adagrad" else "SGD"
    out.append(("another optimizer's state", _optimizer(other, seed=1)[1].state_dict()))
    hyper = "betas" if name in ("Adam", "AdamW") else "lr"
    variant("a missing hyperparameter", lambda sd: sd["param_groups"][0].pop(hyper))
    variant("a missing flag", lambda sd: sd["param_groups"][1].pop("maximize"))
    variant("a negative learning rate",
            lambda sd: sd["param_groups"][1].__setitem__("lr", torch.tensor([0.1, -0.1, 0.1])))
    variant("a learning rate per model of another B",
            lambda sd: sd["param_groups"][0].__setitem__("lr", torch.tensor([0.1, 0.1])))
    variant("a flag that is not a bool", lambda sd: sd["param_groups"][0].__setitem__("maximize", 1))
    variant("one parameter group too few", lambda sd: sd["param_groups"].pop())
    variant("a group with a parameter too many", lambda sd: sd["param_groups"][1]["params"].append(7))
    key = next(k for k in sd_keys(good) if k != "step")
    variant("a state tensor of another shape",
            lambda sd: sd["state"][1].__setitem__(key, torch.zeros(B, 8)))
    variant("a step count of another shape", lambda sd: sd["state"][0].__setitem__("step", torch.zeros(2)))
    variant("a state entry that is not a tensor", lambda sd: sd["state"][0].__setitem__(key, None))
    variant("an integer state tensor",
            lambda sd: sd["state"][0].__setitem__(key, torch.zeros(B, 5, 3, dtype=torch.int64)))
    variant("an unknown state entry", lambda sd: sd["state"][0].__setitem__("exp_avg_cube", torch.zeros(B, 5, 3)))
    variant("a state that is not a dict", lambda sd: sd["state"].__setitem__(0, torch.zeros(B)))
    variant("no 'state' entry", lambda sd: sd.pop("state"))
    out.append(("not a dict", [good]))
    return out


def sd_keys(sd):
    return list(sd["state"][0])


@pytest.mark.parametrize("name", list(OPTIMIZERS))
def test_failed_optimizer_load_changes_nothing(name):
    params, opt = _optimizer(name)
    twin_params, twin = _optimizer(name)
    for what, bad in _bad_optimizer_states(name):
        before = _snapshot(opt.state_dict())
        with pytest.raises((ValueError, TypeError)):
            opt.load_state_dict(bad)
        _assert_equal(before, opt.state_dict(), f"{name} after loading {what}")
        _readable(opt.state_dict())
    g = torch.Generator().manual_seed(9)
    for _ in range(2):
        grads = [torch.randn(p.shape, generator=g) for p in params]
        for p, q, gr in zip(params, twin_params, grads):
            p.grad, q.grad = gr.clone(), gr.clone()
        opt.step()
        twin.step()
    for p, q in zip(params, twin_params):
        assert torch.equal(p, q)
    _assert_equal(twin.state_dict(), opt.state_dict(), f"{name} after the next steps")


# ---- schedulers ---------------------------------------------------------------------


def _sched(name, opt, B):
    s = lambda values: values[:B]  # noqa: E731
    if name == "StepLR":
        return H.StepLR(opt, step_size=s([3, 5, 7]), gamma=s([0.5, 0.9, 0.7]))
    if name == "MultiStepLR":
        return H.MultiStepLR(opt, milestones=s([[3, 9], [5, 5], [2]]), gamma=0.6)
    if name == "ExponentialLR":
        return H.ExponentialLR(opt, gamma=s([0.9, 0.95, 0.97]))
    if name == "CosineAnnealingLR":
        return H.CosineAnnealingLR(opt, T_max=s([7, 11, 5]), eta_min=s([0.0, 1e-4, 1e-3]))
    if name == "LinearLR":
        return H.LinearLR(opt, start_factor=s([0.1, 0.3, 0.5]), total_iters=s([10, 25, 30]))
    if name == "OneCycleLR":
        return H.OneCycleLR(opt, max_lr=s([0.3, 0.2, 0.5]), total_steps=s([45, 50, 60]))
    if name == "LambdaLR":
        return H.LambdaLR(opt, lr_lambda=s([_f0, _f1, _f2]))
    if name == "ReduceLROnPlateau":
        return H.ReduceLROnPlateau(opt, patience=s([0, 2, 4]), factor=s([0.5, 0.1, 0.3]))
    if name == "SequentialLR":
        return H.SequentialLR(opt, [H.LinearLR(opt, start_factor=s([0.01, 0.1, 0.5]), total_iters=s([5, 3, 8])),
                                    H.ExponentialLR(opt, gamma=s([0.9, 0.8, 0.7]))], milestones=[2])
    if name == "ChainedScheduler":
        return H.ChainedScheduler([H.ConstantLR(opt, factor=s([0.5, 0.25, 0.1]), total_iters=s([4, 20, 30])),
                                   H.ExponentialLR(opt, gamma=s([0.9, 0.95, 0.97]))], optimizer=opt)
    if name == "ConstantLR":
        return H.ConstantLR(opt, factor=s([0.5, 0.25, 1 / 3]), total_iters=s([4, 20, 30]))
    if name == "MultiplicativeLR":
        return H.MultiplicativeLR(opt, lr_lambda=lambda e: 0.9)
    if name == "PolynomialLR":
        return H.PolynomialLR(opt, total_iters=s([10, 30, 50]), power=s([1.0, 2.0, 0.5]))
    if name == "CyclicLR":
        return H.CyclicLR(opt, base_lr=s([0.001, 0.002, 0.003]), max_lr=s([0.1, 0.05, 0.2]),
                          step_size_up=s([4, 5, 6]), mode="exp_range", gamma=s([0.9, 0.95, 0.99]))
    if name == "CosineAnnealingWarmRestarts":
        return H.CosineAnnealingWarmRestarts(opt, T_0=s([3, 5, 4]), T_mult=s([1, 2, 3]))
    raise AssertionError(name)


SCHEDULERS = ["StepLR", "MultiStepLR", "ExponentialLR", "CosineAnnealingLR", "LinearLR", "OneCycleLR",
              "LambdaLR", "ReduceLROnPlateau", "SequentialLR", "ChainedScheduler", "ConstantLR",
              "MultiplicativeLR", "PolynomialLR", "CyclicLR", "CosineAnnealingWarmRestarts"]


class _SchedRun:
    def __init__(self, name, B=B, steps=4, groups=2):
        self.name = name
        self.params = [torch.nn.Parameter(torch.ones(B, 2)) for _ in range(groups)]
        self.opt = hoptim.SGD([{"params": [p], "lr": [0.1, 0.05, 0.2][:B]} for p in self.params], momentum=0.5)
        self.sched = _sched(name, self.opt, B)
        self.B = B
        for i in range(steps):
            self.step(i)

    def step(self, i):
        for p in self.params:
            p.grad = torch.full_like(p, 0.5 + i)
        self.opt.step()
        if self.name == "ReduceLROnPlateau":
            self.sched.step(torch.tensor([1.0, 0.9 ** i, 1.0 + i], dtype=torch.float64)[:self.B])
        else:
            self.sched.step()


def _first_per_model_key(sd):
    """A key of ``sd`` whose value is a [B] tensor the scheduler's arguments hold."""
    for k, v in sd.items():
        if isinstance(v, torch.Tensor) and v.shape == (B,) and not k.startswith("_") and k not in ("best",):
            return k
    return None


def _bad_scheduler_states(name):
    good = _SchedRun(name, steps=6).sched.state_dict()
    out = []

    def variant(what, edit):
        sd = copy.deepcopy(good)
        edit(sd)
        out.append((what, sd))

    out.append(("another array size", _SchedRun(name, B=2).sched.state_dict()))
    other = "StepLR" if name != "StepLR" else "ExponentialLR"
    out.append(("another scheduler's state", _SchedRun(other).sched.state_dict()))
    variant("a missing entry", lambda sd: sd.pop("last_epoch" if "last_epoch" in sd else "_last_lr"))
    variant("an unknown entry", lambda sd: sd.__setitem__("warmup", 3))
    variant("last_epoch that is not an int", lambda sd: sd.__setitem__("last_epoch", "3"))
    if "base_lrs" in good:
        variant("base_lrs of another B", lambda sd: sd["base_lrs"].__setitem__(0, torch.ones(2, dtype=torch.float64)))
        variant("base_lrs of one group too few", lambda sd: sd["base_lrs"].pop())
        variant("a negative base lr",
                lambda sd: sd["base_lrs"].__setitem__(1, torch.tensor([0.1, -0.1, 0.1], dtype=torch.float64)))
    key = _first_per_model_key(good)
    if key is not None:
        variant(f"{key} of another B", lambda sd: sd.__setitem__(key, sd[key][:2].clone()))
        variant(f"{key} of another dtype", lambda sd: sd.__setitem__(key, sd[key].to(torch.complex64)))
        if good[key].is_floating_point():
            variant(f"a NaN in {key}", lambda sd: sd.__setitem__(key, torch.full_like(sd[key], math.nan)))
        else:
            variant(f"a negative {key}", lambda sd: sd.__setitem__(key, torch.full_like(sd[key], -1)))
    if "_schedulers" in good:
        # The first child's state is good, the second's is not: neither may change.
        variant("a bad second child", lambda sd: sd["_schedulers"][1].pop("last_epoch"))
        variant("one child too few", lambda sd: sd["_schedulers"].pop())
    out.append(("not a dict", [good]))
    return out


@pytest.mark.parametrize("name", SCHEDULERS)
def test_failed_scheduler_load_changes_nothing(name):
    run, twin = _SchedRun(name), _SchedRun(name)
    for what, bad in _bad_scheduler_states(name):
        before = _snapshot(run.sched.state_dict())
        opt_before = _snapshot(run.opt.state_dict())
        with pytest.raises((ValueError, TypeError)):
            run.sched.load_state_dict(bad)
        _assert_equal(before, run.sched.state_dict(), f"{name} after loading {what}")
        _assert_equal(opt_before, run.opt.state_dict(), f"{name}'s optimizer after loading {what}")
        _readable(run.sched.state_dict())
    for i in range(4, 12):
        run.step(i)
        twin.step(i)
        _assert_equal(twin.sched.get_last_lr(), run.sched.get_last_lr(), f"{name} step {i}")
    for p, q in zip(run.params, twin.params):
        assert torch.equal(p, q)
    _assert_equal(twin.sched.state_dict(), run.sched.state_dict(), f"{name} after the next steps")


# ---- GradScaler --------------------------------------------------------------------------
def _scaler_run(scaler, steps, seed):
    g = torch.Generator().manual_seed(seed)
    p = torch.nn.Parameter(torch.ones(B, 3))
    opt = hoptim.SGD([p], lr=0.1)
    for step in range(steps):
        poison = torch.tensor([1.0, math.inf if step % 3 == 1 else 1.0, 1.0])
        loss = (p * torch.randn(B, 3, generator=g)).sum(1) * poison
        scaler.scale(loss).sum().backward()
        scaler.step(opt)
        scaler.update()
        opt.zero_grad()
    return p


def test_failed_grad_scaler_load_changes_nothing():
    kwargs = dict(init_scale=[64.0, 128.0, 256.0], growth_factor=3.0, backoff_factor=0.25, growth_interval=2)
    scaler, twin = GradScaler("cpu", B=B, **kwargs), GradScaler("cpu", B=B, **kwargs)
    _scaler_run(scaler, 4, seed=1)
    _scaler_run(twin, 4, seed=1)
    good = scaler.state_dict()
    bad_states = [
        ("another array size", {**good, "scale": torch.ones(2)}),
        ("a zero scale", {**good, "scale": torch.tensor([1.0, 0.0, 2.0])}),
        ("an infinite scale", {**good, "scale": torch.tensor([1.0, math.inf, 2.0])}),
        ("a negative scale", {**good, "scale": -1.0}),
        ("a growth tracker beyond int32", {**good, "_growth_tracker": torch.tensor([0, 2 ** 31, 1])}),
        ("a float growth tracker", {**good, "_growth_tracker": torch.tensor([0.0, 1.0, 1.0])}),
        ("a growth tracker of another B", {**good, "_growth_tracker": torch.zeros(4, dtype=torch.int32)}),
        ("a missing entry", {k: v for k, v in good.items() if k != "growth_interval"}),
        ("a bad growth_interval", {**good, "growth_interval": 0}),
        ("a bad growth_factor", {**good, "growth_factor": 0.5}),
        ("not a dict", [good]),
    ]
    for what, bad in bad_states:
        before = _snapshot(scaler.state_dict())
        with pytest.raises((ValueError, TypeError)):
            scaler.load_state_dict(bad)
        _assert_equal(before, scaler.state_dict(), f"GradScaler after loading {what}")
    a = _scaler_run(scaler, 5, seed=2)
    b = _scaler_run(twin, 5, seed=2)
    assert torch.equal(a, b)
    _assert_equal(twin.state_dict(), scaler.state_dict(), "GradScaler after the next steps")
