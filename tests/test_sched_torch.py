"""ConstantLR, MultiplicativeLR, PolynomialLR, CyclicLR, CosineAnnealingWarmRestarts and
ChainedScheduler against torch, model by model; and the factor checks of LambdaLR and
MultiplicativeLR.

Model b's reference is the torch scheduler of the same name on its own
``torch.optim.SGD`` (one dummy parameter per param group) with model b's
arguments. Learning rates (and cycled momentum) are compared after every step,
across a ``state_dict`` round trip through ``torch.save`` / ``torch.load``.
"""

from __future__ import annotations

import copy
import io
import math
import warnings

import pytest
import torch
from torch.optim import lr_scheduler as T

import hfkern.optim as hoptim
from hfkern.optim import SGD
from hfkern.optim import lr_scheduler as H
from _sched import PM, _h, _m0, _m1, _t, step_array_and_torch

STEPS = 60
SPLIT = 23
TOL = dict(rtol=1e-6, atol=1e-12)
GROUP_LRS = [[0.1, 0.05, 0.2], [0.01, 0.03, 0.002]]


def _m2(e):
    return 1.02 if e < 10 else 0.95


def _shared(e):
    return 0.99


class _Half:
    """A scale_fn object with state of its own (saved by state_dict)."""

    def __init__(self, rate):
        self.rate = rate

    def __call__(self, x):
        return self.rate ** x


def _scale_a(x):
    return 1.0 / (1.0 + 0.1 * x)


def _scale_b(x):
    return 0.5 * (1 + math.cos(x))


def _cases():
    """name: (list of (class name, kwargs) chained in one ChainedScheduler, or one (class name, kwargs))."""
    return {
        "ConstantLR": ("ConstantLR", dict(factor=PM([0.5, 0.25, 1 / 3]), total_iters=PM([4, 0, 30]))),
        "ConstantLR_tensor_defaults": ("ConstantLR", dict(factor=PM([0.2, 0.9, 1.0], tensor=True))),
        "MultiplicativeLR_per_model": ("MultiplicativeLR", dict(lr_lambda=PM([_m0, _m1, _m2]))),
        "MultiplicativeLR_shared": ("MultiplicativeLR", dict(lr_lambda=_shared)),
        "MultiplicativeLR_per_group": ("MultiplicativeLR", dict(lr_lambda=[PM([_m0, _m1, _m2]), _shared])),
        "PolynomialLR": ("PolynomialLR", dict(total_iters=PM([10, 30, 50]), power=PM([1.0, 2.0, 0.5]))),
        "PolynomialLR_defaults": ("PolynomialLR", dict()),
        "PolynomialLR_tensor": ("PolynomialLR", dict(total_iters=PM([7, 3, 64], tensor=True),
                                                     power=PM([0.9, 3.0, 1.5], tensor=True))),
        "CyclicLR_triangular": ("CyclicLR", dict(base_lr=PM([0.001, 0.002, 0.003]), max_lr=PM([0.1, 0.05, 0.2]),
                                                 step_size_up=PM([4, 5, 6]), step_size_down=PM([3, 5, 9]))),
        "CyclicLR_triangular2_per_group": ("CyclicLR", dict(
            base_lr=[PM([0.001, 0.002, 0.003]), PM([0.01, 0.02, 0.005])], max_lr=[PM([0.1, 0.05, 0.2]), 0.3],
            step_size_up=PM([2, 7, 3]), mode="triangular2")),
        "CyclicLR_exp_range": ("CyclicLR", dict(base_lr=0.01, max_lr=PM([0.1, 0.05, 0.2]),
                                                step_size_up=PM([3, 4, 5], tensor=True), mode="exp_range",
                                                gamma=PM([0.9, 0.95, 0.99]))),
        "CyclicLR_scale_fn_shared_cycle": ("CyclicLR", dict(base_lr=0.01, max_lr=0.1, step_size_up=PM([2, 3, 5]),
                                                            scale_fn=_scale_a)),
        "CyclicLR_scale_fn_per_model_iterations": ("CyclicLR", dict(
            base_lr=0.01, max_lr=PM([0.1, 0.2, 0.05]), step_size_up=4, scale_fn=PM([_scale_a, _scale_b, _Half(0.9)]),
            scale_mode="iterations")),
        "CyclicLR_fractional_steps": ("CyclicLR", dict(base_lr=0.01, max_lr=0.1, step_size_up=PM([2.5, 3.0, 1.5]),
                                                       step_size_down=PM([0.0, 4.5, 2.0]))),
        "CosineAnnealingWarmRestarts": ("CosineAnnealingWarmRestarts", dict(
            T_0=PM([3, 5, 4]), T_mult=PM([1, 2, 3]), eta_min=PM([0.0, 1e-4, 1e-3]))),
        "CosineAnnealingWarmRestarts_tensor": ("CosineAnnealingWarmRestarts", dict(
            T_0=PM([7, 2, 11], tensor=True), eta_min=1e-3)),
        "Chained_constant_exponential": [("ConstantLR", dict(factor=PM([0.5, 0.25, 0.1]), total_iters=PM([4, 20, 30]))),
                                         ("ExponentialLR", dict(gamma=PM([0.9, 0.95, 0.97])))],
        "Chained_three": [("LinearLR", dict(start_factor=PM([0.1, 0.5, 0.9]), total_iters=PM([5, 10, 3]))),
                          ("MultiplicativeLR", dict(lr_lambda=PM([_m0, _m1, _m2]))),
                          ("StepLR", dict(step_size=PM([3, 5, 7]), gamma=0.8))],
    }


def _make(module, opt, spec, B=None, b=None):
    def args(kwargs):
        return {k: (_h(v, B) if b is None else _t(v, b)) for k, v in kwargs.items()}

    if isinstance(spec, list):
        return module.ChainedScheduler([getattr(module, c)(opt, **args(kw)) for c, kw in spec], optimizer=opt)
    cls_name, kwargs = spec
    return getattr(module, cls_name)(opt, **args(kwargs))


class Run:
    def __init__(self, B, spec, momentum=0.5):
        self.B = B
        self.spec = spec
        self.params = [torch.nn.Parameter(torch.randn(B, 3)) for _ in range(2)]
        self.opt = SGD([{"params": [p], "lr": GROUP_LRS[g][:B]} for g, p in enumerate(self.params)],
                       momentum=momentum)
        self.refs = [
            torch.optim.SGD([{"params": [torch.nn.Parameter(torch.zeros(1))], "lr": GROUP_LRS[g][b]}
                             for g in range(2)], momentum=momentum)
            for b in range(B)
        ]
        self.sched = _make(H, self.opt, spec, B=B)
        self.ts = [_make(T, r, spec, b=b) for b, r in enumerate(self.refs)]

    def expected(self, g, key="lr"):
        return torch.tensor([float(r.param_groups[g][key]) for r in self.refs], dtype=torch.float64)

    def check(self, where):
        for g, group in enumerate(self.opt.param_groups):
            want = self.expected(g)
            torch.testing.assert_close(self.sched.get_last_lr()[g], want, **TOL, msg=f"{where} group {g}")
            torch.testing.assert_close(group["lr"].double(), want, **TOL, msg=f"{where} group {g} (optimizer)")
            last = torch.tensor([float(t.get_last_lr()[g]) for t in self.ts], dtype=torch.float64)
            torch.testing.assert_close(self.sched.get_last_lr()[g], last, **TOL, msg=f"{where} group {g} last")
            torch.testing.assert_close(group["momentum"].double(), self.expected(g, "momentum"), **TOL,
                                       msg=f"{where} group {g} momentum")

    def step(self):
        self.opt.step()
        for r in self.refs:
            r.step()
        self.sched.step()
        for t in self.ts:
            t.step()


def _roundtrip(obj):
    buf = io.BytesIO()
    torch.save(obj, buf)
    buf.seek(0)
    return torch.load(buf)


@pytest.mark.parametrize("B", [1, 3])
@pytest.mark.parametrize("name", list(_cases()))
def test_matches_torch_per_model(name, B):
    spec = _cases()[name]
    run = Run(B, spec)
    run.check("after construction")
    for i in range(SPLIT):
        run.step()
        run.check(f"step {i + 1}")
    # Into fresh objects through torch.save/torch.load (weights_only), on both sides.
    opt_state, sched_state = _roundtrip(run.opt.state_dict()), _roundtrip(run.sched.state_dict())
    run.opt = SGD([{"params": [p], "lr": 1.0} for p in run.params], momentum=0.5)
    run.sched = _make(H, run.opt, spec, B=B)
    run.opt.load_state_dict(opt_state)
    run.sched.load_state_dict(sched_state)
    t_states = [(copy.deepcopy(r.state_dict()), copy.deepcopy(t.state_dict())) for r, t in zip(run.refs, run.ts)]
    for b, (r_state, t_state) in enumerate(t_states):
        ref = torch.optim.SGD([{"params": [torch.nn.Parameter(torch.zeros(1))], "lr": 1.0} for _ in range(2)],
                              momentum=0.5)
        run.ts[b] = _make(T, ref, spec, b=b)
        ref.load_state_dict(r_state)
        run.ts[b].load_state_dict(t_state)
        run.refs[b] = ref
    run.check("after load")
    for i in range(SPLIT, STEPS):
        run.step()
        run.check(f"step {i + 1}")


@pytest.mark.parametrize("name", ["ConstantLR", "PolynomialLR", "CosineAnnealingWarmRestarts"])
def test_closed_form_step_epoch(name):
    B = 3
    run = Run(B, _cases()[name])
    for epoch in [3, 7, 7, 12, 1, 30, 45, 0, 64]:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            run.sched.step(epoch)
            for t in run.ts:
                t.step(epoch)
        run.check(f"epoch {epoch}")


def test_warm_restarts_fractional_epochs():
    """torch's pattern: step(epoch + i / iters) inside an epoch."""
    B = 3
    run = Run(B, _cases()["CosineAnnealingWarmRestarts"])
    iters = 7
    for epoch in range(12):
        for i in range(iters):
            run.sched.step(epoch + i / iters)
            for t in run.ts:
                t.step(epoch + i / iters)
            run.check(f"epoch {epoch} + {i}/{iters}")
    assert run.sched.T_cur.dtype == torch.float64 and run.sched.T_i.dtype == torch.int64
    with pytest.raises(ValueError, match=r"epoch must be >= 0 for every model, got \[-1.0, -1.0, -1.0\]"):
        run.sched.step(-1)  # torch refuses a negative epoch too


# ---- momentum cycling ------------------------------------------------------------
@pytest.mark.parametrize("name", ["SGD", "RMSprop"])
def test_cyclic_lr_cycles_momentum_and_trains_like_torch(name):
    B, steps = 3, 40
    kwargs = dict(base_lr=PM([0.01, 0.02, 0.005]), max_lr=PM([0.2, 0.1, 0.3]), step_size_up=PM([3, 5, 4]),
                  mode="triangular2", base_momentum=PM([0.8, 0.7, 0.85]), max_momentum=PM([0.95, 0.9, 0.99]))
    x0 = torch.randn(B, 5)
    param = torch.nn.Parameter(x0.clone())
    opt = getattr(hoptim, name)([param], lr=0.01, momentum=0.0)  # momentum off until the scheduler sets it
    sched = H.CyclicLR(opt, **{k: _h(v, B) for k, v in kwargs.items()})
    models = [torch.nn.Parameter(x0[b].clone()) for b in range(B)]
    refs = [getattr(torch.optim, name)([models[b]], lr=0.01) for b in range(B)]
    ts = [T.CyclicLR(refs[b], **{k: _t(v, b) for k, v in kwargs.items()}) for b in range(B)]
    momentum_obj = None
    for i in range(steps):
        step_array_and_torch(param, models, opt, refs, sched, ts)
        if momentum_obj is None:  # the optimizer's validated [B] row, after its first step
            momentum_obj = opt.param_groups[0]["momentum"]
        assert opt.param_groups[0]["momentum"] is momentum_obj  # cycled in place
        momentum = torch.tensor([r.param_groups[0]["momentum"] for r in refs], dtype=torch.float64)
        torch.testing.assert_close(opt.param_groups[0]["momentum"].double(), momentum, **TOL, msg=f"step {i}")
        torch.testing.assert_close(param.detach(), torch.stack([m.detach() for m in models]), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("name", ["Adam", "AdamW"])
def test_cyclic_lr_cycles_adam_beta1(name):
    B, steps = 3, 30
    kwargs = dict(base_lr=PM([0.001, 0.002, 0.003]), max_lr=PM([0.01, 0.02, 0.005]), step_size_up=PM([2, 3, 4]),
                  base_momentum=PM([0.8, 0.85, 0.7]), max_momentum=PM([0.95, 0.9, 0.99]))
    beta2 = [0.999, 0.99, 0.9]
    x0 = torch.randn(B, 4)
    param = torch.nn.Parameter(x0.clone())
    opt = getattr(hoptim, name)([param], lr=1e-3, betas=(0.9, beta2))
    sched = H.CyclicLR(opt, **{k: _h(v, B) for k, v in kwargs.items()})
    models = [torch.nn.Parameter(x0[b].clone()) for b in range(B)]
    refs = [getattr(torch.optim, name)([models[b]], lr=1e-3, betas=(0.9, beta2[b])) for b in range(B)]
    ts = [T.CyclicLR(refs[b], **{k: _t(v, b) for k, v in kwargs.items()}) for b in range(B)]
    for i in range(steps):
        step_array_and_torch(param, models, opt, refs, sched, ts)
        betas = opt.param_groups[0]["betas"]
        want = torch.tensor([r.param_groups[0]["betas"][0] for r in refs], dtype=torch.float64)
        torch.testing.assert_close(betas[0].double(), want, **TOL, msg=f"step {i}")
        torch.testing.assert_close(betas[1], torch.tensor(beta2))
        torch.testing.assert_close(param.detach(), torch.stack([m.detach() for m in models]), atol=1e-5, rtol=1e-4)


def test_cyclic_lr_momentum_errors():
    p = torch.nn.Parameter(torch.randn(3, 2))
    for name in ("Adagrad", "Adadelta"):
        opt = getattr(hoptim, name)([p], lr=0.1)
        with pytest.raises(ValueError, match="momentum or betas"):
            H.CyclicLR(opt, base_lr=0.01, max_lr=0.1)
        H.CyclicLR(opt, base_lr=0.01, max_lr=0.1, cycle_momentum=False)  # fine without cycling
    # Starting every model at zero momentum would switch SGD's momentum off for the group.
    opt = SGD([p], lr=0.1, momentum=0.9)
    before = {k: v for k, v in opt.param_groups[0].items()}
    with pytest.raises(ValueError, match="max_momentum is 0 for every model of param group 0"):
        H.CyclicLR(opt, base_lr=0.01, max_lr=0.1, base_momentum=[0.5, 0.0, 0.2], max_momentum=0.0)
    assert {k: v for k, v in opt.param_groups[0].items()} == before  # nothing was written


# ---- ChainedScheduler ---------------------------------------------------------------
def test_chained_scheduler_arguments():
    opt = SGD([torch.nn.Parameter(torch.randn(3, 2))], lr=0.1)
    a = H.ExponentialLR(opt, gamma=0.9)
    assert H.ChainedScheduler([a]).optimizer is opt
    with pytest.raises(ValueError, match="at least one scheduler"):
        H.ChainedScheduler([])
    with pytest.raises(ValueError, match="ReduceLROnPlateau"):
        H.ChainedScheduler([a, H.ReduceLROnPlateau(opt)])
    with pytest.raises(ValueError, match="index 1"):
        H.ChainedScheduler([a, H.ExponentialLR(SGD([torch.nn.Parameter(torch.randn(3, 2))], lr=0.1), 0.9)])
    with pytest.raises(TypeError, match="hfkern"):
        H.ChainedScheduler([a, T.ExponentialLR(torch.optim.SGD([torch.zeros(1, requires_grad=True)]), 0.9)],
                           optimizer=opt)


def test_sequential_of_new_schedulers_matches_torch():
    B = 3
    children = [("ConstantLR", dict(factor=PM([0.5, 0.25, 0.1]), total_iters=PM([3, 8, 5]))),
                ("CosineAnnealingWarmRestarts", dict(T_0=PM([3, 5, 4]), T_mult=PM([1, 2, 1]))),
                ("PolynomialLR", dict(total_iters=PM([10, 20, 15]), power=PM([1.0, 2.0, 0.5])))]

    def make(module, opt, b=None):
        args = (lambda kw: {k: _h(v, B) for k, v in kw.items()}) if b is None else \
            (lambda kw: {k: _t(v, b) for k, v in kw.items()})
        scheds = [getattr(module, c)(opt, **args(kw)) for c, kw in children]
        return module.SequentialLR(opt, scheds, milestones=[6, 25])

    run = Run(B, ("ConstantLR", dict()))
    run.sched = make(H, run.opt)
    run.ts = [make(T, r, b) for b, r in enumerate(run.refs)]
    for i in range(STEPS):
        run.step()
        run.check(f"step {i + 1}")


# ---- negative and NaN factors --------------------------------------------------------------
def _bad_at(epoch, value):
    def f(e):
        return value if e == epoch else 0.9 ** e
    return f


@pytest.mark.parametrize("value", [-0.5, math.nan])
def test_lambda_lr_rejects_negative_or_nan_factor(value):
    p = torch.nn.Parameter(torch.randn(3, 2))
    opt = SGD([p], lr=[0.1, 0.2, 0.3])
    # At construction (epoch 0): nothing may be written, not even initial_lr.
    before = dict(opt.param_groups[0])
    with pytest.raises(ValueError, match=r"models \[1\] of param group 0 got \[" + ("-0.5" if value < 0 else "nan")):
        H.LambdaLR(opt, lr_lambda=[_bad_at(9, 1.0), _bad_at(0, value), _bad_at(9, 1.0)])
    assert opt.param_groups[0].keys() == before.keys()
    assert torch.equal(opt.param_groups[0]["lr"], torch.tensor([0.1, 0.2, 0.3]))
    # At a later step: the step raises and changes nothing.
    sched = H.LambdaLR(opt, lr_lambda=[_bad_at(9, 1.0), _bad_at(4, value), _bad_at(9, 1.0)])
    twin_opt = SGD([torch.nn.Parameter(p.detach().clone())], lr=[0.1, 0.2, 0.3])
    twin = H.LambdaLR(twin_opt, lr_lambda=[_bad_at(9, 1.0), _bad_at(9, 1.0), _bad_at(9, 1.0)])
    for _ in range(3):
        sched.step()
        twin.step()
    state = copy.deepcopy(sched.state_dict())
    lr = opt.param_groups[0]["lr"].clone()
    with pytest.raises(ValueError, match=r"LambdaLR: .*epoch 4.*models \[1\]"):
        sched.step()
    assert torch.equal(opt.param_groups[0]["lr"], lr)
    assert sched.last_epoch == state["last_epoch"] and sched._step_count == state["_step_count"]
    assert torch.equal(sched.get_last_lr()[0], state["_last_lr"][0])
    # A shared callable returning per-model factors is checked per model too.
    with pytest.raises(ValueError, match=r"models \[0, 2\]"):
        H.LambdaLR(opt, lr_lambda=lambda e: [value, 1.0, value])


def test_multiplicative_lr_rejects_negative_factor_inside_chains():
    """A failing scheduler inside ChainedScheduler or SequentialLR leaves every scheduler and the
    optimizer as they were."""
    p = torch.nn.Parameter(torch.randn(3, 2))
    opt = SGD([p], lr=[0.1, 0.2, 0.3], momentum=0.5)
    exp = H.ExponentialLR(opt, gamma=[0.9, 0.8, 0.7])
    cyc = H.CyclicLR(opt, base_lr=0.01, max_lr=[0.1, 0.2, 0.3], step_size_up=3)
    bad = H.MultiplicativeLR(opt, lr_lambda=[_bad_at(99, 1.0), _bad_at(99, 1.0), _bad_at(3, -2.0)])
    chain = H.ChainedScheduler([exp, cyc, bad])
    chain.step()
    chain.step()
    states = [copy.deepcopy(s.state_dict()) for s in (chain, exp, cyc, bad)]
    group = dict(opt.param_groups[0])
    values = {k: opt.param_groups[0][k].clone() for k in ("lr", "momentum")}
    with pytest.raises(ValueError, match=r"MultiplicativeLR: .*epoch 3.*models \[2\].*-2.0"):
        chain.step()
    for s, before in zip((chain, exp, cyc, bad), states):
        after = s.state_dict()
        assert set(after) == set(before)
        for k in before:
            if k != "_schedulers":
                assert repr(after[k]) == repr(before[k]), (type(s).__name__, k)
    assert dict(opt.param_groups[0]).keys() == group.keys()
    for k, v in values.items():
        assert torch.equal(opt.param_groups[0][k], v), k
        assert opt.param_groups[0][k] is group[k]

    opt2 = SGD([p], lr=[0.1, 0.2, 0.3])
    seq = H.SequentialLR(opt2, [H.ExponentialLR(opt2, gamma=0.9),
                                H.MultiplicativeLR(opt2, lr_lambda=lambda e: -1.0 if e == 2 else 1.0)],
                         milestones=[2])
    for _ in range(3):
        seq.step()
    before = copy.deepcopy(seq.state_dict())
    lr = opt2.param_groups[0]["lr"].clone()
    with pytest.raises(ValueError, match="MultiplicativeLR"):
        seq.step()
    assert seq.last_epoch == before["last_epoch"]
    assert seq._schedulers[1].last_epoch == before["_schedulers"][1]["last_epoch"]
    assert torch.equal(opt2.param_groups[0]["lr"], lr)


# ---- bad arguments ----------------------------------------------------------------------
def _opt(B=3, groups=1):
    return SGD([{"params": [torch.nn.Parameter(torch.randn(B, 2))]} for _ in range(groups)], lr=0.1)


@pytest.mark.parametrize("make, exc, match", [
    (lambda: H.ConstantLR(_opt(), factor=[0.5, 1.5, 0.5]), ValueError, r"factor must lie in \[0.0, 1.0\]"),
    (lambda: H.ConstantLR(_opt(), total_iters=[1, -1, 2]), ValueError, "total_iters must be >= 0"),
    (lambda: H.ConstantLR(_opt(), total_iters=2.5), TypeError, "total_iters"),
    (lambda: H.MultiplicativeLR(_opt(), lr_lambda=[_m0, _m1]), ValueError, r"one callable per model \(B=3\)"),
    (lambda: H.MultiplicativeLR(_opt(), lr_lambda=3), TypeError, "callable"),
    (lambda: H.PolynomialLR(_opt(), total_iters=[0, 1, 2]), ValueError, "total_iters must be >= 1"),
    (lambda: H.PolynomialLR(_opt(), power=-1.0), ValueError, "power must be >= 0"),
    (lambda: H.CyclicLR(_opt(), base_lr=[0.1, 0.2], max_lr=1.0), ValueError, "base_lr must have one value per model"),
    (lambda: H.CyclicLR(_opt(), base_lr=0.1, max_lr=1.0, step_size_up=0),
     ValueError, r"step_size_up must lie in \(0.0"),
    (lambda: H.CyclicLR(_opt(), base_lr=0.1, max_lr=1.0, mode="linear"), ValueError, "mode must be one of"),
    (lambda: H.CyclicLR(_opt(), base_lr=0.1, max_lr=1.0, scale_mode="epochs"), ValueError, "scale_mode"),
    (lambda: H.CyclicLR(_opt(), base_lr=0.1, max_lr=1.0, scale_fn=[_scale_a]), ValueError, "one callable per model"),
    (lambda: H.CyclicLR(_opt(groups=2), base_lr=[[0.1] * 3] * 3, max_lr=1.0), ValueError,
     r"base_lr: expected one per-model value per param group \(2\), got 3"),
    (lambda: H.CosineAnnealingWarmRestarts(_opt(), T_0=[3, 0, 3]), ValueError, "T_0 must be >= 1"),
    (lambda: H.CosineAnnealingWarmRestarts(_opt(), T_0=3, T_mult=0), ValueError, "T_mult must be >= 1"),
    (lambda: H.CosineAnnealingWarmRestarts(_opt(), T_0=3.0), TypeError, "T_0"),
    (lambda: H.CosineAnnealingWarmRestarts(_opt(), T_0=3, eta_min=-0.1), ValueError, "eta_min must be >= 0"),
])
def test_bad_arguments_rejected(make, exc, match):
    with pytest.raises(exc, match=match):
        make()


def test_constant_lr_zero_factor_at_total_iters_raises_like_torch():
    opt = _opt()
    sched = H.ConstantLR(opt, factor=[0.5, 0.0, 0.5], total_iters=[5, 2, 5])
    sched.step()
    lr = opt.param_groups[0]["lr"].clone()
    with pytest.raises(ZeroDivisionError, match=r"models \[1\]"):
        sched.step()
    assert torch.equal(opt.param_groups[0]["lr"], lr) and sched.last_epoch == 1
    ref = T.ConstantLR(torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=0.1), factor=0.0, total_iters=2)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # torch's warning about stepping before optimizer.step()
        ref.step()
        with pytest.raises(ZeroDivisionError):
            ref.step()


def test_exported_and_torch_base_classes():
    names = ["ConstantLR", "MultiplicativeLR", "PolynomialLR", "CyclicLR", "CosineAnnealingWarmRestarts",
             "ChainedScheduler"]
    for n in names:
        assert n in H.__all__
    opt = _opt()
    scheds = [H.ConstantLR(opt), H.MultiplicativeLR(opt, _shared), H.PolynomialLR(opt),
              H.CyclicLR(opt, base_lr=0.01, max_lr=0.1), H.CosineAnnealingWarmRestarts(opt, T_0=3)]
    scheds.append(H.ChainedScheduler(scheds[:2]))
    for s in scheds:
        assert isinstance(s, T.LRScheduler) and isinstance(s, H.LRScheduler)


# ---- CUDA: no host sync in step ----------------------------------------------
@pytest.mark.gpu
@pytest.mark.parametrize("name", list(_cases()))
def test_step_does_not_sync_cuda(name):
    B = 3
    spec = _cases()[name]

    def make(device):
        params = [torch.nn.Parameter(torch.randn(B, 3, device=device)) for _ in range(2)]
        opt = SGD([{"params": [p], "lr": GROUP_LRS[g]} for g, p in enumerate(params)], momentum=0.5)
        return opt, _make(H, opt, spec, B=B)

    opt, sched = make("cuda")
    twin_opt, twin = make("cpu")
    torch.cuda.synchronize()
    try:
        torch.cuda.set_sync_debug_mode("error")
        for _ in range(10):
            sched.step()
    finally:
        torch.cuda.set_sync_debug_mode("default")
    for _ in range(10):
        twin.step()
    for group, twin_group in zip(opt.param_groups, twin_opt.param_groups):
        assert torch.equal(group["lr"].cpu(), twin_group["lr"])
        assert torch.equal(group["momentum"].cpu(), twin_group["momentum"])
