"""hfkern.optim.lr_scheduler against B separate torch schedulers, one per model.

Model b's torch reference is ``torch.optim.lr_scheduler.<Same>`` on its own
``torch.optim.SGD`` (one dummy parameter per param group) with model b's
arguments; the learning rates are compared after every step.
"""

from __future__ import annotations

import io
import warnings

import pytest
import torch
from torch.optim import lr_scheduler as T

from hfkern.optim import SGD
from hfkern.optim import lr_scheduler as H
from _sched import PM, _f0, _f1, _f2, _h, _t, step_array_and_torch

STEPS = 50
TOL = dict(rtol=1e-6, atol=1e-12)  # atol: a cosine schedule passes through eta_min = 0
GROUP_LRS = [[0.1, 0.05, 0.2], [0.01, 0.03, 0.002]]  # per param group, per model


def _g(e):
    return 0.9 ** e


def _cases():
    """name: (scheduler class name, kwargs with PM per-model values)."""
    return {
        "StepLR": ("StepLR", dict(step_size=PM([3, 5, 7]), gamma=PM([0.5, 0.9, 0.1], tensor=True))),
        "StepLR_shared": ("StepLR", dict(step_size=4, gamma=0.5)),
        "MultiStepLR_shared_milestones": (
            "MultiStepLR", dict(milestones=[5, 10, 10, 30], gamma=PM([0.5, 0.8, 0.3]))),
        "MultiStepLR_per_model_milestones": (
            "MultiStepLR", dict(milestones=PM([[3, 9], [5, 5, 20], [40, 2]]), gamma=0.5)),
        "ExponentialLR": ("ExponentialLR", dict(gamma=PM([0.9, 0.95, 0.99], tensor=True))),
        "CosineAnnealingLR": (
            "CosineAnnealingLR", dict(T_max=PM([10, 17, 50]), eta_min=PM([0.0, 1e-3, 5e-4]))),
        "CosineAnnealingLR_tensor_T": (
            "CosineAnnealingLR", dict(T_max=PM([7, 23, 4], tensor=True), eta_min=1e-4)),
        "LinearLR": ("LinearLR", dict(start_factor=PM([0.1, 0.5, 1.0]), end_factor=PM([1.0, 0.2, 0.0]),
                                      total_iters=PM([4, 10, 60]))),
        "LinearLR_defaults": ("LinearLR", dict()),
        "OneCycleLR_cos": ("OneCycleLR", dict(
            max_lr=PM([0.5, 1.0, 0.3]), total_steps=PM([50, 60, 80]), pct_start=PM([0.3, 0.25, 0.5]),
            div_factor=PM([25.0, 10.0, 5.0]), final_div_factor=PM([1e4, 100.0, 10.0]), cycle_momentum=False)),
        "OneCycleLR_linear_three_phase": ("OneCycleLR", dict(
            max_lr=PM([0.5, 1.0, 0.3], tensor=True), total_steps=PM([50, 60, 80]),
            pct_start=PM([0.3, 0.25, 0.5]),
            anneal_strategy="linear", three_phase=True, cycle_momentum=False)),
        "OneCycleLR_epochs_per_group_max_lr": ("OneCycleLR", dict(
            max_lr=[PM([0.5, 1.0, 0.3]), PM([0.05, 0.1, 0.03])], epochs=PM([5, 10, 25]),
            steps_per_epoch=PM([10, 6, 2]), three_phase=True, cycle_momentum=False)),
        "LambdaLR_per_model": ("LambdaLR", dict(lr_lambda=PM([_f0, _f1, _f2]))),
        "LambdaLR_shared": ("LambdaLR", dict(lr_lambda=_g)),
        "LambdaLR_per_group": ("LambdaLR", dict(lr_lambda=[PM([_f0, _f1, _f2]), _g])),
    }


class Run:
    """An array SGD + scheduler and B torch SGDs + schedulers, stepped together."""

    def __init__(self, B, make_h, make_t, *, momentum=0.0, groups=2):
        self.B = B
        self.params = [torch.nn.Parameter(torch.randn(B, 3)) for _ in range(groups)]
        self.opt = SGD(
            [{"params": [p], "lr": GROUP_LRS[g][:B]} for g, p in enumerate(self.params)], momentum=momentum
        )
        self.refs = [
            torch.optim.SGD(
                [{"params": [torch.nn.Parameter(torch.zeros(1))], "lr": GROUP_LRS[g][b]} for g in range(groups)],
                momentum=momentum,
            )
            for b in range(B)
        ]
        self.sched = make_h(self.opt)
        self.ts = [make_t(self.refs[b], b) for b in range(B)]

    def expected(self, g, key="lr"):
        return torch.tensor([float(r.param_groups[g][key]) for r in self.refs], dtype=torch.float64)

    def check(self, where=""):
        for g, group in enumerate(self.opt.param_groups):
            want = self.expected(g)
            torch.testing.assert_close(self.sched.get_last_lr()[g], want, **TOL, msg=f"{where} group {g}")
            torch.testing.assert_close(group["lr"].double(), want, **TOL, msg=f"{where} group {g} (optimizer)")
            last = torch.tensor([t.get_last_lr()[g] for t in self.ts], dtype=torch.float64)
            torch.testing.assert_close(self.sched.get_last_lr()[g], last, **TOL, msg=f"{where} group {g} last")

    def step(self, *args_h, args_t=None):
        self.opt.step()
        for r in self.refs:
            r.step()
        self.sched.step(*args_h)
        for b, t in enumerate(self.ts):
            t.step(*(args_t(b) if args_t else ()))


def _makers(cls_name, kwargs, B):
    def make_h(opt):
        return getattr(H, cls_name)(opt, **{k: _h(v, B) for k, v in kwargs.items()})

    def make_t(opt, b):
        return getattr(T, cls_name)(opt, **{k: _t(v, b) for k, v in kwargs.items()})

    return make_h, make_t


@pytest.mark.parametrize("B", [1, 3])
@pytest.mark.parametrize("name", list(_cases()))
def test_matches_torch_per_model(name, B):
    cls_name, kwargs = _cases()[name]
    run = Run(B, *_makers(cls_name, kwargs, B))
    run.check("after construction")
    for i in range(STEPS):
        run.step()
        run.check(f"step {i + 1}")


def test_models_get_different_schedules():
    cls_name, kwargs = _cases()["CosineAnnealingLR"]
    run = Run(3, *_makers(cls_name, kwargs, 3))
    for _ in range(12):
        run.step()
    ratios = run.sched.get_last_lr()[0] / torch.tensor(GROUP_LRS[0], dtype=torch.float64)
    assert len(set(ratios.tolist())) == 3


@pytest.mark.parametrize("name", ["StepLR", "MultiStepLR_per_model_milestones", "ExponentialLR",
                                  "CosineAnnealingLR", "LinearLR"])
def test_closed_form_step_epoch(name):
    B = 3
    cls_name, kwargs = _cases()[name]
    run = Run(B, *_makers(cls_name, kwargs, B))
    for epoch in [3, 7, 7, 12, 1, 30, 45, 0]:
        with pytest.warns(UserWarning):
            run.sched.step(epoch)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            for t in run.ts:
                t.step(epoch)
        run.check(f"epoch {epoch}")


# ---- SequentialLR and chaining ----------------------------------------------
def _sequential_cases():
    return {
        "warmup_cosine": (
            [("LinearLR", dict(start_factor=PM([0.01, 0.1, 0.5]), total_iters=PM([5, 3, 8]))),
             ("CosineAnnealingLR", dict(T_max=PM([45, 30, 60]), eta_min=PM([0.0, 1e-4, 1e-3])))],
            [5],
        ),
        "three_stages": (
            [("ExponentialLR", dict(gamma=PM([0.9, 0.8, 0.95]))),
             ("LambdaLR", dict(lr_lambda=PM([_f0, _f1, _f2]))),
             ("MultiStepLR", dict(milestones=PM([[3, 9], [5], [2, 4, 6]]), gamma=PM([0.5, 0.3, 0.7])))],
            [10, 25],
        ),
        "step_then_one_cycle": (
            [("StepLR", dict(step_size=PM([2, 3, 4]), gamma=0.7)),
             ("OneCycleLR", dict(max_lr=PM([0.3, 0.2, 0.5]), total_steps=PM([42, 45, 50]),
                                 cycle_momentum=False))],
            [8],
        ),
    }


def _sequential_makers(children, milestones, B):
    def make_h(opt):
        scheds = [getattr(H, c)(opt, **{k: _h(v, B) for k, v in kw.items()}) for c, kw in children]
        return H.SequentialLR(opt, scheds, milestones)

    def make_t(opt, b):
        scheds = [getattr(T, c)(opt, **{k: _t(v, b) for k, v in kw.items()}) for c, kw in children]
        return T.SequentialLR(opt, scheds, milestones)

    return make_h, make_t


@pytest.mark.parametrize("B", [1, 3])
@pytest.mark.parametrize("name", list(_sequential_cases()))
def test_sequential_matches_torch(name, B):
    run = Run(B, *_sequential_makers(*_sequential_cases()[name], B))
    run.check("after construction")
    for i in range(STEPS):
        run.step()
        run.check(f"step {i + 1}")


def test_two_schedulers_chain_on_one_optimizer():
    B = 3

    def make_h(opt):
        return [H.ExponentialLR(opt, gamma=[0.9, 0.95, 0.97]),
                H.MultiStepLR(opt, milestones=[[4, 9], [6], [2, 3, 30]], gamma=[0.5, 0.1, 0.8])]

    def make_t(opt, b):
        return [T.ExponentialLR(opt, gamma=[0.9, 0.95, 0.97][b]),
                T.MultiStepLR(opt, milestones=[[4, 9], [6], [2, 3, 30]][b], gamma=[0.5, 0.1, 0.8][b])]

    run = Run(B, lambda o: None, lambda o, b: None)
    run.sched = make_h(run.opt)
    run.ts = [make_t(r, b) for b, r in enumerate(run.refs)]
    for i in range(STEPS):
        run.opt.step()
        for r in run.refs:
            r.step()
        for s in run.sched:
            s.step()
        for ts in run.ts:
            for t in ts:
                t.step()
        for g in range(2):
            want = run.expected(g)
            torch.testing.assert_close(run.sched[1].get_last_lr()[g], want, **TOL, msg=f"step {i}")
            torch.testing.assert_close(run.opt.param_groups[g]["lr"].double(), want, **TOL)


@pytest.mark.parametrize("name", ["ExponentialLR", "CosineAnnealingLR", "StepLR", "LinearLR"])
def test_lr_changed_outside_the_scheduler(name):
    """An in-place edit or a new value assigned to group["lr"] is picked up, as torch picks it up."""
    B = 3
    cls_name, kwargs = _cases()[name]
    run = Run(B, *_makers(cls_name, kwargs, B))
    for i in range(30):
        if i == 8:
            run.opt.param_groups[0]["lr"].mul_(0.5)
            for r in run.refs:
                r.param_groups[0]["lr"] *= 0.5
        if i == 15:
            run.opt.param_groups[1]["lr"] = 0.07
            for r in run.refs:
                r.param_groups[1]["lr"] = 0.07
        run.step()
        run.check(f"step {i + 1}")


# ---- ReduceLROnPlateau ----------------------------------------------------
def _metric_streams(B, steps, mode):
    """Per-model streams: improving, flat (plateaus), and noisy with slow drift."""
    g = torch.Generator().manual_seed(1)
    t = torch.arange(steps, dtype=torch.float64)
    streams = [
        1.0 / (1.0 + t),
        torch.full((steps,), 0.5, dtype=torch.float64) + 0.001 * (t % 3),
        1.0 - 0.01 * t + 0.05 * torch.randn(steps, generator=g, dtype=torch.float64),
    ][:B]
    s = torch.stack(streams, dim=1)
    return -s if mode == "max" else s


@pytest.mark.parametrize("B", [1, 3])
@pytest.mark.parametrize("mode", ["min", "max"])
@pytest.mark.parametrize("threshold_mode", ["rel", "abs"])
@pytest.mark.parametrize("metrics_as", ["tensor", "list"])
@pytest.mark.parametrize("min_lr", ["per_model", "per_group"])
def test_reduce_on_plateau_matches_torch(B, mode, threshold_mode, metrics_as, min_lr):
    kwargs = dict(
        mode=mode, threshold_mode=threshold_mode, factor=PM([0.5, 0.1, 0.3], tensor=True),
        patience=PM([0, 2, 4]), threshold=PM([1e-4, 0.01, 0.05]), cooldown=PM([0, 1, 3]),
        eps=PM([1e-8, 1e-3, 1e-8]),
        min_lr=(PM([0.0, 1e-3, 5e-3]) if min_lr == "per_model"
                else [PM([0.0, 1e-3, 5e-3]), PM([1e-4, 0.0, 1e-3])]),
    )
    streams = _metric_streams(B, STEPS, mode)
    run = Run(B, *_makers("ReduceLROnPlateau", kwargs, B))
    run.check("after construction")
    for i in range(STEPS):
        m = streams[i] if metrics_as == "tensor" else streams[i].tolist()
        run.step(m, args_t=lambda b: (float(streams[i, b]),))
        run.check(f"step {i + 1}")
        for b, t in enumerate(run.ts):
            assert run.sched.num_bad_epochs[b].item() == t.num_bad_epochs
            assert run.sched.cooldown_counter[b].item() == t.cooldown_counter
            assert run.sched.best[b].item() == t.best
    # The streams must have driven reductions for some models and not others.
    if B == 3:
        final = run.sched.get_last_lr()[0]
        assert final[0] == pytest.approx(GROUP_LRS[0][0], rel=1e-6)  # always improving
        assert (final < torch.tensor(GROUP_LRS[0], dtype=torch.float64) * 0.99).any()


# ---- OneCycleLR momentum ----------------------------------------------------
def test_one_cycle_cycles_sgd_momentum_and_trains_like_torch():
    """OneCycleLR with cycle_momentum on SGD whose momentum starts at 0 for every model."""
    B, steps = 3, 30
    kwargs = dict(max_lr=PM([0.2, 0.1, 0.3]), total_steps=PM([30, 40, 35]),
                  base_momentum=PM([0.8, 0.85, 0.7]), max_momentum=PM([0.95, 0.9, 0.99], tensor=True),
                  pct_start=PM([0.3, 0.2, 0.4]))
    x0 = torch.randn(B, 5)
    param = torch.nn.Parameter(x0.clone())
    opt = SGD([param], lr=0.01)
    sched = H.OneCycleLR(opt, **{k: _h(v, B) for k, v in kwargs.items()})
    models = [torch.nn.Parameter(x0[b].clone()) for b in range(B)]
    refs = [torch.optim.SGD([models[b]], lr=0.01) for b in range(B)]
    ts = [T.OneCycleLR(refs[b], **{k: _t(v, b) for k, v in kwargs.items()}) for b in range(B)]
    for i in range(steps):
        step_array_and_torch(param, models, opt, refs, sched, ts)
        momentum = torch.tensor([r.param_groups[0]["momentum"] for r in refs], dtype=torch.float64)
        lr = torch.tensor([r.param_groups[0]["lr"] for r in refs], dtype=torch.float64)
        torch.testing.assert_close(opt.param_groups[0]["momentum"].double(), momentum, **TOL, msg=f"step {i}")
        torch.testing.assert_close(opt.param_groups[0]["lr"].double(), lr, **TOL, msg=f"step {i}")
        torch.testing.assert_close(param.detach(), torch.stack([m.detach() for m in models]),
                                   atol=1e-5, rtol=1e-5)


class _BetasOptimizer(torch.optim.Optimizer):
    """A minimal optimizer following the array conventions, with per-model betas (no update)."""

    def __init__(self, params, lr, betas):
        self.B = 3
        super().__init__(params, dict(lr=lr, betas=betas))
        for group in self.param_groups:
            group["lr"] = torch.tensor(group["lr"], dtype=torch.float32)
            group["betas"] = tuple(torch.tensor(v, dtype=torch.float32) for v in group["betas"])

    def step(self, closure=None):
        return None


def test_one_cycle_cycles_beta1():
    B = 3
    kwargs = dict(max_lr=PM([0.02, 0.01, 0.03]), total_steps=PM([50, 55, 60]),
                  base_momentum=PM([0.8, 0.85, 0.7]), max_momentum=PM([0.95, 0.9, 0.99]))
    beta2 = [0.999, 0.99, 0.9]
    opt = _BetasOptimizer([torch.nn.Parameter(torch.randn(B, 2))], lr=[1e-3] * B, betas=([0.9] * B, beta2))
    sched = H.OneCycleLR(opt, **{k: _h(v, B) for k, v in kwargs.items()})
    refs = [torch.optim.Adam([torch.nn.Parameter(torch.zeros(1))], lr=1e-3, betas=(0.9, beta2[b]))
            for b in range(B)]
    ts = [T.OneCycleLR(refs[b], **{k: _t(v, b) for k, v in kwargs.items()}) for b in range(B)]
    beta1_obj = None
    for i in range(STEPS):
        opt.step()
        for r in refs:
            r.step()
        sched.step()
        for t in ts:
            t.step()
        betas = opt.param_groups[0]["betas"]
        if beta1_obj is None:
            beta1_obj = betas[0]
        assert betas[0] is beta1_obj  # cycled in place after construction
        want1 = torch.tensor([r.param_groups[0]["betas"][0] for r in refs], dtype=torch.float64)
        torch.testing.assert_close(betas[0].double(), want1, **TOL, msg=f"step {i}")
        torch.testing.assert_close(betas[1].double(), torch.tensor(beta2, dtype=torch.float64), **TOL)
        lr = torch.tensor([r.param_groups[0]["lr"] for r in refs], dtype=torch.float64)
        torch.testing.assert_close(opt.param_groups[0]["lr"].double(), lr, **TOL)


def test_one_cycle_past_total_steps_raises():
    opt = SGD([torch.nn.Parameter(torch.randn(3, 2))], lr=0.1)
    sched = H.OneCycleLR(opt, max_lr=0.1, total_steps=[5, 3, 8], cycle_momentum=False)
    for _ in range(3):
        sched.step()
    with pytest.raises(ValueError, match=r"models \[1\]"):
        sched.step()


# ---- in-place updates -------------------------------------------------------
@pytest.mark.parametrize("name", list(_cases()))
def test_step_writes_the_optimizer_lr_in_place(name):
    B = 3
    cls_name, kwargs = _cases()[name]
    params = [torch.nn.Parameter(torch.randn(B, 3)) for _ in range(2)]
    opt = SGD([{"params": [p], "lr": GROUP_LRS[g]} for g, p in enumerate(params)])
    lrs = [g["lr"] for g in opt.param_groups]
    ptrs = [t.data_ptr() for t in lrs]
    before = [t.clone() for t in lrs]
    sched = getattr(H, cls_name)(opt, **{k: _h(v, B) for k, v in kwargs.items()})
    changed = False
    for _ in range(10):
        opt.step()
        sched.step()
        for g, group in enumerate(opt.param_groups):
            assert group["lr"] is lrs[g]
            assert group["lr"].data_ptr() == ptrs[g]
            changed |= not torch.equal(group["lr"], before[g])
    assert changed


def test_reduce_on_plateau_writes_in_place():
    opt = SGD([torch.nn.Parameter(torch.randn(3, 3))], lr=[0.1, 0.2, 0.3])
    lr = opt.param_groups[0]["lr"]
    sched = H.ReduceLROnPlateau(opt, patience=[0, 1, 100])
    for _ in range(4):
        sched.step(torch.ones(3))
    assert opt.param_groups[0]["lr"] is lr
    torch.testing.assert_close(lr, torch.tensor([0.1 * 0.1 ** 3, 0.2 * 0.1 ** 1, 0.3]))


def test_scheduled_lr_takes_effect_at_the_next_sgd_step():
    B = 3
    x0 = torch.randn(B, 4)
    param = torch.nn.Parameter(x0.clone())
    opt = SGD([param], lr=[0.1, 0.2, 0.3], momentum=[0.0, 0.5, 0.9])
    sched = H.StepLR(opt, step_size=[1, 2, 3], gamma=[0.5, 0.3, 0.1])
    models = [torch.nn.Parameter(x0[b].clone()) for b in range(B)]
    refs = [torch.optim.SGD([models[b]], lr=[0.1, 0.2, 0.3][b], momentum=[0.0, 0.5, 0.9][b]) for b in range(B)]
    ts = [T.StepLR(refs[b], step_size=[1, 2, 3][b], gamma=[0.5, 0.3, 0.1][b]) for b in range(B)]
    for _ in range(8):
        grad = torch.randn(B, 4)
        param.grad = grad.clone()
        opt.step()
        sched.step()
        for b in range(B):
            models[b].grad = grad[b].clone()
            refs[b].step()
            ts[b].step()
    torch.testing.assert_close(param.detach(), torch.stack([m.detach() for m in models]))


def test_get_last_lr_is_a_copy():
    opt = SGD([torch.nn.Parameter(torch.randn(3, 3))], lr=[0.1, 0.2, 0.3])
    sched = H.ExponentialLR(opt, gamma=0.5)
    sched.step()
    sched.get_last_lr()[0].zero_()
    torch.testing.assert_close(opt.param_groups[0]["lr"], torch.tensor([0.05, 0.1, 0.15]))
    sched.step()
    torch.testing.assert_close(sched.get_last_lr()[0], torch.tensor([0.025, 0.05, 0.075], dtype=torch.float64))


# ---- state_dict ---------------------------------------------------------------
class _Decay:
    """A callable object whose state LambdaLR saves (unlike a plain function)."""

    def __init__(self, rate):
        self.rate = rate

    def __call__(self, e):
        return self.rate ** e


def _state_cases():
    return {
        "StepLR": ("StepLR", dict(step_size=PM([3, 5, 7]), gamma=PM([0.5, 0.9, 0.1]))),
        "MultiStepLR": ("MultiStepLR", dict(milestones=PM([[3, 25], [5, 5, 30], [40, 2]]), gamma=0.5)),
        "CosineAnnealingLR": _cases()["CosineAnnealingLR"],
        "LinearLR": _cases()["LinearLR"],
        "OneCycleLR_momentum": ("OneCycleLR", dict(
            max_lr=PM([0.5, 1.0, 0.3]), total_steps=PM([50, 60, 80]), base_momentum=PM([0.8, 0.85, 0.7]),
            three_phase=True)),
        "LambdaLR_objects": ("LambdaLR", dict(lr_lambda=PM([_Decay(0.9), _Decay(0.95), _Decay(0.97)]))),
        "LambdaLR_shared_object": ("LambdaLR", dict(lr_lambda=_Decay(0.93))),
    }


def _roundtrip(obj):
    buf = io.BytesIO()
    torch.save(obj, buf)
    buf.seek(0)
    return torch.load(buf, weights_only=False)


@pytest.mark.parametrize("name", list(_state_cases()) + ["SequentialLR", "ReduceLROnPlateau"])
def test_state_dict_round_trip_midway(name):
    B, split = 3, 20
    momentum = 0.5 if name == "OneCycleLR_momentum" else 0.0
    streams = _metric_streams(B, STEPS, "min")
    if name == "SequentialLR":
        make_h, make_t = _sequential_makers(*_sequential_cases()["warmup_cosine"], B)
    elif name == "ReduceLROnPlateau":
        make_h, make_t = _makers("ReduceLROnPlateau", dict(patience=PM([0, 2, 4]), cooldown=PM([0, 1, 3]),
                                                           factor=PM([0.5, 0.1, 0.3])), B)
    else:
        make_h, make_t = _makers(*_state_cases()[name], B)
    run = Run(B, make_h, make_t, momentum=momentum)

    def step(i):
        if name == "ReduceLROnPlateau":
            run.step(streams[i], args_t=lambda b: (float(streams[i, b]),))
        else:
            run.step()

    for i in range(split):
        step(i)
    opt_state = _roundtrip(run.opt.state_dict())
    sched_state = _roundtrip(run.sched.state_dict())

    # A fresh optimizer and scheduler (built first, as torch recommends), then the saved states.
    opt = SGD([{"params": [p], "lr": 1.0} for p in run.params], momentum=momentum)
    if name == "LambdaLR_objects":
        sched = H.LambdaLR(opt, lr_lambda=[_Decay(0.5) for _ in range(B)])  # rates restored by the load
    elif name == "LambdaLR_shared_object":
        sched = H.LambdaLR(opt, lr_lambda=_Decay(0.5))
    else:
        sched = make_h(opt)
    opt.load_state_dict(opt_state)
    sched.load_state_dict(sched_state)
    run.opt, run.sched = opt, sched
    run.check("after load")
    for i in range(split, STEPS):
        step(i)
        run.check(f"step {i + 1}")
        if name == "OneCycleLR_momentum":
            torch.testing.assert_close(opt.param_groups[0]["momentum"].double(), run.expected(0, "momentum"),
                                       **TOL)


@pytest.mark.parametrize("name", ["StepLR", "MultiStepLR_per_model_milestones", "CosineAnnealingLR", "LinearLR",
                                  "OneCycleLR_cos", "LambdaLR_per_model"])
def test_resume_with_last_epoch(name):
    """A scheduler built with last_epoch=k on an optimizer that has initial_lr continues like torch's."""
    B, split = 3, 12
    cls_name, kwargs = _cases()[name]
    make_h, make_t = _makers(cls_name, kwargs, B)
    run = Run(B, make_h, make_t)
    for _ in range(split):
        run.step()
    run.sched = getattr(H, cls_name)(run.opt, last_epoch=split, **{k: _h(v, B) for k, v in kwargs.items()})
    run.ts = [getattr(T, cls_name)(r, last_epoch=split, **{k: _t(v, b) for k, v in kwargs.items()})
              for b, r in enumerate(run.refs)]
    run.check("after resuming")
    # Torch's one-off branch for a scheduler updated before its first step() (cosine: closed form).
    run.sched._update_lr()
    for t in run.ts:
        t._update_lr()
    run.check("first update")
    for i in range(split + 2, STEPS):  # the constructor and _update_lr each advanced one epoch
        run.step()
        run.check(f"step {i + 1}")


def test_load_state_dict_rejects_other_array_size():
    sched3 = H.StepLR(SGD([torch.nn.Parameter(torch.randn(3, 2))], lr=0.1), step_size=2)
    sched2 = H.StepLR(SGD([torch.nn.Parameter(torch.randn(2, 2))], lr=0.1), step_size=2)
    with pytest.raises(ValueError, match="B=3.*B=2"):
        sched2.load_state_dict(sched3.state_dict())


# ---- bad arguments ------------------------------------------------------------
def _opt(B=3, groups=1):
    return SGD([{"params": [torch.nn.Parameter(torch.randn(B, 2))]} for _ in range(groups)], lr=0.1)


@pytest.mark.parametrize("make, exc, match", [
    (lambda: H.StepLR(_opt(), step_size=0), ValueError, "step_size must be >= 1"),
    (lambda: H.StepLR(_opt(), step_size=[1, 2]),
     ValueError, r"step_size must have one value per model \(length B=3\)"),
    (lambda: H.StepLR(_opt(), step_size=2.5), TypeError, "step_size"),
    (lambda: H.StepLR(_opt(), step_size=[1, True, 2]), TypeError, "step_size"),
    (lambda: H.StepLR(_opt(), step_size=torch.tensor([1.0, 2.0, 3.0])), TypeError, "step_size"),
    (lambda: H.StepLR(_opt(), step_size=2, gamma=[0.1, -0.1, 0.2]), ValueError, "gamma must be >= 0"),
    (lambda: H.StepLR(_opt(), step_size=2, gamma=float("nan")), ValueError, "gamma must not be NaN"),
    (lambda: H.StepLR(object(), step_size=2), TypeError, "expected a torch.optim.Optimizer"),
    (lambda: H.StepLR(_opt(), step_size=2, last_epoch=3), KeyError, "initial_lr"),
    (lambda: H.MultiStepLR(_opt(), milestones=[[1, 2], [3]]), ValueError, r"one list per model \(B=3\)"),
    (lambda: H.MultiStepLR(_opt(), milestones=[1, [2]]), TypeError, "milestones"),
    (lambda: H.MultiStepLR(_opt(), milestones=[1.5, 2]), TypeError, "milestones"),
    (lambda: H.ExponentialLR(_opt(), gamma=torch.ones(4)), ValueError, "gamma must have one value per model"),
    (lambda: H.CosineAnnealingLR(_opt(), T_max=[5, 0, 5]), ValueError, "T_max must be >= 1"),
    (lambda: H.CosineAnnealingLR(_opt(), T_max=5, eta_min=-1.0), ValueError, "eta_min must be >= 0"),
    (lambda: H.LinearLR(_opt(), start_factor=[0.5, 0.0, 0.5]),
     ValueError, r"start_factor must lie in \(0.0, 1.0\]"),
    (lambda: H.LinearLR(_opt(), end_factor=1.5), ValueError, r"end_factor must lie in \[0.0, 1.0\]"),
    (lambda: H.LinearLR(_opt(), total_iters=[0, 1, 2]), ValueError, "total_iters must be >= 1"),
    (lambda: H.OneCycleLR(_opt(), max_lr=0.1), ValueError, "total_steps or"),
    (lambda: H.OneCycleLR(_opt(), max_lr=0.1, total_steps=[10, 0, 10]),
     ValueError, "total_steps must be >= 1"),
    (lambda: H.OneCycleLR(_opt(), max_lr=0.1, epochs=2, steps_per_epoch=[1, 2]),
     ValueError, "steps_per_epoch"),
    (lambda: H.OneCycleLR(_opt(), max_lr=0.1, total_steps=10, pct_start=1.5),
     ValueError, "pct_start must lie in"),
    (lambda: H.OneCycleLR(_opt(), max_lr=0.1, total_steps=10, anneal_strategy="exp"),
     ValueError, "anneal_strategy"),
    (lambda: H.OneCycleLR(_opt(), max_lr=[0.1, 0.2], total_steps=10),
     ValueError, "max_lr must have one value per model"),
    (lambda: H.OneCycleLR(_opt(groups=2), max_lr=[[0.1] * 3] * 3, total_steps=10), ValueError,
     r"max_lr: expected one per-model value per param group \(2\), got 3"),
    (lambda: H.OneCycleLR(_opt(), max_lr=0.1, total_steps=10, div_factor=0.0), ValueError, "div_factor"),
    (lambda: H.OneCycleLR(torch.optim.Optimizer([torch.nn.Parameter(torch.randn(3, 2))], dict(lr=0.1)),
                          max_lr=0.1, total_steps=10), ValueError, "momentum or betas"),
    (lambda: H.LambdaLR(_opt(), lr_lambda=[_f0, _f1]), ValueError, r"one callable per model \(B=3\)"),
    (lambda: H.LambdaLR(_opt(groups=2), lr_lambda=[[_f0, _f1, _f2]]),
     ValueError, "one entry per param group"),
    (lambda: H.LambdaLR(_opt(), lr_lambda=[_f0, 3, _f1]), TypeError, "callables"),
    (lambda: H.LambdaLR(_opt(), lr_lambda=lambda e: [1.0, 2.0]), ValueError, "B=3 factors"),
    (lambda: H.ReduceLROnPlateau(_opt(), factor=[0.1, 1.0, 0.5]),
     ValueError, r"factor must lie in \[0.0, 1.0\)"),
    (lambda: H.ReduceLROnPlateau(_opt(), mode="median"), ValueError, "mode must be 'min' or 'max'"),
    (lambda: H.ReduceLROnPlateau(_opt(), threshold_mode="pct"), ValueError, "threshold_mode"),
    (lambda: H.ReduceLROnPlateau(_opt(), patience=-1), ValueError, "patience must be >= 0"),
    (lambda: H.ReduceLROnPlateau(_opt(), cooldown=[1, 2]),
     ValueError, "cooldown must have one value per model"),
    (lambda: H.ReduceLROnPlateau(_opt(), min_lr=[0.1, 0.2]),
     ValueError, "min_lr must have one value per model"),
    (lambda: H.ReduceLROnPlateau(_opt(), eps=-1e-8), ValueError, "eps must be >= 0"),
    (lambda: H.ReduceLROnPlateau(_opt()).step(torch.ones(2)), ValueError, r"metrics of shape \[B=3\]"),
    (lambda: H.ReduceLROnPlateau(_opt()).step([1.0, 2.0]),
     ValueError, r"one metric per model \(B=3\), got 2"),
    (lambda: H.ReduceLROnPlateau(_opt()).step(1.0), ValueError, "one metric per model"),
])
def test_bad_arguments_rejected(make, exc, match):
    with pytest.raises(exc, match=match):
        make()


def test_sequential_bad_arguments():
    opt = _opt()
    a, b = H.LinearLR(opt), H.ExponentialLR(opt, gamma=0.9)
    with pytest.raises(ValueError, match="one milestone fewer than schedulers"):
        H.SequentialLR(opt, [a, b], milestones=[3, 5])
    with pytest.raises(ValueError, match="at least one scheduler"):
        H.SequentialLR(opt, [], milestones=[])
    with pytest.raises(ValueError, match="ReduceLROnPlateau"):
        H.SequentialLR(opt, [a, H.ReduceLROnPlateau(opt)], milestones=[3])
    with pytest.raises(ValueError, match="index 1"):
        H.SequentialLR(opt, [a, H.ExponentialLR(_opt(), gamma=0.9)], milestones=[3])
    with pytest.raises(TypeError, match="hfkern"):
        H.SequentialLR(opt, [a, T.ExponentialLR(torch.optim.SGD([torch.zeros(1, requires_grad=True)]), 0.9)],
                       milestones=[3])
    # A milestone is one int for every model or one per model (B=3).
    with pytest.raises(ValueError, match=r"milestones\[0\] must have one value per model \(length B=3\), got shape"):
        H.SequentialLR(opt, [a, b], milestones=[[3, 4]])
    with pytest.raises(TypeError, match=r"milestones\[0\] must hold ints"):
        H.SequentialLR(opt, [a, b], milestones=[[3, 4.5, 5]])
    with pytest.raises(TypeError, match=r"milestones\[0\] must be an int, a length-3 sequence of ints"):
        H.SequentialLR(opt, [a, b], milestones=[3.0])
    with pytest.raises(TypeError, match="milestones must be a list of 1 milestones"):
        H.SequentialLR(opt, [a, b], milestones=3)


def test_torch_base_classes():
    opt = _opt()
    assert isinstance(H.StepLR(opt, step_size=2), T.LRScheduler)
    assert isinstance(H.ReduceLROnPlateau(opt), T.ReduceLROnPlateau)


# ---- CUDA: no host sync in step ----------------------------------------------
@pytest.mark.gpu
@pytest.mark.parametrize("name", list(_cases()))
def test_step_does_not_sync_cuda(name):
    B = 3
    cls_name, kwargs = _cases()[name]
    params = [torch.nn.Parameter(torch.randn(B, 3, device="cuda")) for _ in range(2)]
    opt = SGD([{"params": [p], "lr": GROUP_LRS[g]} for g, p in enumerate(params)])
    sched = getattr(H, cls_name)(opt, **{k: _h(v, B) for k, v in kwargs.items()})
    expected = getattr(H, cls_name)(_cpu_twin(B), **{k: _h(v, B) for k, v in kwargs.items()})
    torch.cuda.synchronize()
    try:
        torch.cuda.set_sync_debug_mode("error")
        for _ in range(10):
            sched.step()
    finally:
        torch.cuda.set_sync_debug_mode("default")
    for _ in range(10):
        expected.step()
    for g, group in enumerate(opt.param_groups):
        torch.testing.assert_close(group["lr"].cpu(), expected.optimizer.param_groups[g]["lr"])


def _cpu_twin(B):
    return SGD([{"params": [torch.nn.Parameter(torch.randn(B, 3))], "lr": GROUP_LRS[g]} for g in range(2)])


def test_scheduler_stepped_before_its_optimizer_warns_as_torch_does():
    """torch warns when a scheduler steps before its optimizer ever has (the schedule's first value
    is then never used); the array schedulers do too, and not in the usual order."""
    p = torch.nn.Parameter(torch.randn(3, 2))
    opt = SGD([p], lr=[0.1, 0.2, 0.3])
    sched = H.StepLR(opt, step_size=1, gamma=0.5)
    with pytest.warns(UserWarning, match=r"lr_scheduler.step\(\) was called before optimizer.step\(\)"):
        sched.step()
    p = torch.nn.Parameter(torch.randn(3, 2))
    opt = SGD([p], lr=[0.1, 0.2, 0.3])
    sched = H.StepLR(opt, step_size=1, gamma=0.5)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        for _ in range(3):
            p.grad = torch.randn_like(p)
            opt.step()
            sched.step()


def test_flat_list_of_one_entry_per_param_group_is_per_model_and_says_so():
    """torch reads ``[a, b]`` as one entry per param group, hfkern as one per model: where both
    readings are possible a warning says which applies, else the error says how to nest."""
    def opt_of(B):
        return SGD([{"params": [torch.nn.Parameter(torch.randn(B, 2))]},
                    {"params": [torch.nn.Parameter(torch.randn(B, 3))]}], lr=0.1)

    with pytest.warns(UserWarning, match=r"lr_lambda: a flat list of 2 callables is read as one per model.*"
                                         r"\[\[f0\] \* B, \[f1\] \* B\]") as caught:
        H.LambdaLR(opt_of(2), lr_lambda=[lambda e: 0.5, lambda e: 1.0])
    assert caught[0].filename == __file__  # pointed at the caller
    with pytest.warns(UserWarning, match=r"max_lr: a flat list of 2 numbers is read as one per model"):
        H.OneCycleLR(opt_of(2), max_lr=[0.5, 1.0], total_steps=10)
    with pytest.raises(ValueError, match=r"lr_lambda: a flat list of 2 callables is one per model here \(B=3\), "
                                         r"not one per param group \(2\)"):
        H.LambdaLR(opt_of(3), lr_lambda=[lambda e: 0.5, lambda e: 1.0])
    with pytest.raises(ValueError, match=r"base_lr: a flat list of 2 numbers is one per model here \(B=3\)"):
        H.CyclicLR(opt_of(3), base_lr=[0.01, 0.02], max_lr=0.1, cycle_momentum=False)
    with warnings.catch_warnings():  # nested, or a tensor per model: no question
        warnings.simplefilter("error")
        sched = H.LambdaLR(opt_of(2), lr_lambda=[[lambda e: 0.5] * 2, [lambda e: 1.0] * 2])
        assert [lr.tolist() for lr in sched.get_last_lr()] == [pytest.approx([0.05] * 2), pytest.approx([0.1] * 2)]
        H.OneCycleLR(opt_of(2), max_lr=torch.tensor([0.5, 1.0]), total_steps=10)
        H.LambdaLR(opt_of(3), lr_lambda=[lambda e: 0.5, lambda e: 1.0, lambda e: 2.0])


def test_sequential_lr_refuses_to_restart_a_chained_scheduler_at_its_milestone():
    """torch's SequentialLR raises NotImplementedError when a ChainedScheduler's milestone comes
    (it restarts the next scheduler at epoch 0, which a chain cannot); so does this one, by name,
    leaving everything as it was (an AttributeError came out of the chain before)."""
    p = torch.nn.Parameter(torch.randn(2, 3))
    opt = SGD([p], lr=0.1)
    chain = H.ChainedScheduler([H.StepLR(opt, step_size=2, gamma=0.5), H.ExponentialLR(opt, gamma=0.9)])
    sched = H.SequentialLR(opt, [H.ConstantLR(opt, factor=0.5, total_iters=2), chain], milestones=[2])
    p.grad = torch.ones_like(p)
    opt.step()
    sched.step()
    lr, state = opt.param_groups[0]["lr"].clone(), sched.state_dict()
    with pytest.raises(NotImplementedError, match="scheduler 1 is a ChainedScheduler, which cannot restart"):
        sched.step()
    assert torch.equal(opt.param_groups[0]["lr"], lr)
    assert str(sched.state_dict()) == str(state)
