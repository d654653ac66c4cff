"""Defects of hfkern.optim.lr_scheduler found by differential testing against torch's schedulers.

Each test reproduces one reported defect: ``set_hyperparameters`` under schedulers that set
the learning rate themselves (OneCycleLR, CyclicLR), non-finite values in a loaded state, plain
torch optimizers, ``reset_model`` error messages, param-group entries shared with the
scheduler, ReduceLROnPlateau's metric checks, negative CyclicLR ``scale_fn`` values, the
documented float64 agreement, and param groups added after the scheduler.
"""

from __future__ import annotations

import copy
import math
import warnings

import pytest
import torch
from torch.optim import lr_scheduler as T

from hfkern.optim import SGD
from hfkern.optim import lr_scheduler as H

from _sched import sgd_opt, zero_grad_step


def _opt(B=3, lr=0.1, momentum=0.9, dtype=torch.float32):
    return sgd_opt(B, 2, lr, momentum, dtype)


_step = zero_grad_step


def _same_state(a, b):
    """Two scheduler states hold equal values (tensors compared exactly, NaN equal to NaN)."""
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.shape == b.shape and torch.equal(
            torch.nan_to_num(a.double(), nan=123.0), torch.nan_to_num(b.double(), nan=123.0))
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(_same_state(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return isinstance(b, (list, tuple)) and len(a) == len(b) and all(map(_same_state, a, b))
    return a == b


# ---- 1: set_hyperparameters(b, lr=...) under OneCycleLR and CyclicLR ---------------------------
def test_set_hyperparameters_lr_under_one_cycle_is_overwritten_as_in_torch():
    p = torch.zeros(2, 1, dtype=torch.float64, requires_grad=True)
    opt = SGD([p], lr=0.1, momentum=0.9)
    sched = H.OneCycleLR(opt, max_lr=1.0, total_steps=20, three_phase=True)
    tp = torch.zeros(1, dtype=torch.float64, requires_grad=True)
    topt = torch.optim.SGD([tp], lr=0.1, momentum=0.9)
    ts = T.OneCycleLR(topt, max_lr=1.0, total_steps=20, three_phase=True)

    def both():
        _step(opt)
        sched.step()
        tp.grad = torch.zeros_like(tp)
        topt.step()
        ts.step()

    for _ in range(3):
        both()
    initial = opt.param_groups[0]["initial_lr"].clone()
    opt.set_hyperparameters(0, lr=0.5)
    topt.param_groups[0]["lr"] = 0.5
    group = opt.param_groups[0]
    assert group["lr"][0].item() == 0.5  # set until the scheduler's next step, as in torch
    assert torch.equal(group["initial_lr"], initial)  # the schedule's endpoint: max_lr / div_factor
    assert group["initial_lr"][0].item() == topt.param_groups[0]["initial_lr"] == 0.04
    for i in range(10):
        both()
        for b in range(2):
            assert math.isclose(sched.get_last_lr()[0][b].item(), ts.get_last_lr()[0], rel_tol=1e-12), (i, b)
            assert math.isclose(group["lr"][b].item(), topt.param_groups[0]["lr"], rel_tol=1e-12), (i, b)
            assert math.isclose(group["momentum"][b].item(), topt.param_groups[0]["momentum"], rel_tol=1e-12)


def test_set_hyperparameters_lr_under_cyclic_lr_keeps_initial_lr_as_torch():
    B = 3
    opt = _opt(B, dtype=torch.float64)
    sched = H.CyclicLR(opt, base_lr=[0.01, 0.02, 0.03], max_lr=0.1, step_size_up=3)
    refs = [torch.optim.SGD([torch.nn.Parameter(torch.zeros(1, dtype=torch.float64))], lr=0.1, momentum=0.9)
            for _ in range(B)]
    ts = [T.CyclicLR(r, base_lr=[0.01, 0.02, 0.03][b], max_lr=0.1, step_size_up=3) for b, r in enumerate(refs)]

    def both():
        _step(opt)
        sched.step()
        for r, t in zip(refs, ts):
            r.step()
            t.step()

    for _ in range(4):
        both()
    initial = opt.param_groups[0]["initial_lr"].clone()
    opt.set_hyperparameters(1, lr=0.5)
    refs[1].param_groups[0]["lr"] = 0.5
    assert opt.param_groups[0]["lr"][1].item() == 0.5
    assert torch.equal(opt.param_groups[0]["initial_lr"], initial)  # base_lr, as torch's initial_lr
    assert [r.param_groups[0]["initial_lr"] for r in refs] == initial.tolist()
    for _ in range(5):
        both()
        want = torch.tensor([t.get_last_lr()[0] for t in ts], dtype=torch.float64)
        torch.testing.assert_close(sched.get_last_lr()[0], want, rtol=1e-12, atol=0)
        torch.testing.assert_close(opt.param_groups[0]["lr"], want, rtol=1e-12, atol=0)


def test_set_hyperparameters_lr_still_restarts_other_schedules():
    """Schedulers that scale the optimizer's learning rate keep the documented behaviour: model b's
    initial_lr and scheduled_lr become its new lr."""
    opt = _opt(3, lr=[0.1, 0.2, 0.3])
    sched = H.ExponentialLR(opt, gamma=0.5)
    _step(opt)
    sched.step()
    opt.set_hyperparameters(2, lr=0.25)
    group = opt.param_groups[0]
    assert "initial_lr_owner" not in group
    assert group["initial_lr"].tolist() == [0.1, 0.2, 0.25]
    assert group["scheduled_lr"][2].item() == 0.25


# ---- 2: non-finite values in a loaded state ------------------------------------------------------
def _cawr(opt):
    return H.CosineAnnealingWarmRestarts(opt, T_0=3)


def _one_cycle(opt):
    return H.OneCycleLR(opt, max_lr=0.1, total_steps=10)


def _plateau(opt):
    return H.ReduceLROnPlateau(opt, patience=0)


def _set_t_cur(value):
    def edit(state):
        state["T_cur"] = torch.tensor([value, 0.0, 1.0], dtype=torch.float64)
    return edit


def _set_end_step(state):
    state["_schedule_phases"][0]["end_step"] = torch.tensor([2.0, math.nan, 2.0], dtype=torch.float64)


def _set_best(state):
    state["best"] = torch.tensor([1.0, 2.0, math.nan], dtype=torch.float64)


@pytest.mark.parametrize("make, edit, match", [
    (_cawr, _set_t_cur(math.nan), r"CosineAnnealingWarmRestarts\.load_state_dict: T_cur must be finite .*models \[0\]"),
    (_cawr, _set_t_cur(math.inf), r"CosineAnnealingWarmRestarts\.load_state_dict: T_cur must be finite .*models \[0\]"),
    (_one_cycle, _set_end_step,
     r"OneCycleLR\.load_state_dict: _schedule_phases\[0\]\['end_step'\] must be finite .*models \[1\]"),
    (_plateau, _set_best, r"ReduceLROnPlateau\.load_state_dict: best must not be NaN .*models \[2\]"),
])
def test_load_state_dict_rejects_non_finite_values(make, edit, match):
    opt = _opt()
    sched = make(opt)
    before = copy.deepcopy(sched.state_dict())
    state = copy.deepcopy(before)
    edit(state)
    with pytest.raises(ValueError, match=match):
        sched.load_state_dict(state)
    assert _same_state(sched.state_dict(), before)


def test_load_state_dict_keeps_infinite_best():
    """ReduceLROnPlateau starts from best = inf (mode min) or -inf (mode max), as torch's."""
    for mode in ("min", "max"):
        opt = _opt()
        sched = H.ReduceLROnPlateau(opt, mode=mode)
        state = sched.state_dict()
        assert torch.isinf(state["best"]).all()
        sched.load_state_dict(copy.deepcopy(state))
        sched.step([1.0, 2.0, 3.0])
        assert sched.best.tolist() == [1.0, 2.0, 3.0]


# ---- 3: plain torch optimizers ----------------------------------------------------------------
@pytest.mark.parametrize("make", [
    lambda o: H.StepLR(o, 1),
    lambda o: H.CosineAnnealingLR(o, T_max=5),
    lambda o: H.OneCycleLR(o, max_lr=0.1, total_steps=10),
    lambda o: H.CyclicLR(o, base_lr=0.01, max_lr=0.1),
    lambda o: H.LambdaLR(o, lambda e: 0.9 ** e),
    lambda o: H.ReduceLROnPlateau(o),
])
def test_plain_torch_optimizer_is_refused(make):
    opt = torch.optim.SGD(torch.nn.Linear(3, 4).parameters(), lr=0.1, momentum=0.9)
    before = [dict(g) for g in opt.param_groups]
    with pytest.raises(TypeError, match=r"expected an hfkern\.optim array optimizer.*torch\.optim\.lr_scheduler"):
        make(opt)
    assert [dict(g) for g in opt.param_groups] == before  # nothing written: lr is still a float
    assert isinstance(opt.param_groups[0]["lr"], float)
    for p in opt.param_groups[0]["params"]:  # the optimizer still steps as torch's
        p.grad = torch.ones_like(p)
    opt.step()


def test_plain_torch_optimizer_names_the_torch_scheduler():
    opt = torch.optim.SGD(torch.nn.Linear(3, 4).parameters(), lr=0.1)
    with pytest.raises(TypeError, match=r"^StepLR: .*use torch\.optim\.lr_scheduler\.StepLR$"):
        H.StepLR(opt, 1)


# ---- 4: reset_model error messages --------------------------------------------------------------
@pytest.mark.parametrize("make, kwargs, match", [
    (lambda o: H.LinearLR(o, 0.5), dict(start_factor=0.0),
     r"^LinearLR\.reset_model: model 2's start_factor: start_factor must lie in \(0\.0, 1\.0\], got 0\.0$"),
    (lambda o: H.OneCycleLR(o, 0.5, total_steps=40), dict(pct_start=2.0),
     r"^OneCycleLR\.reset_model: model 2's pct_start: pct_start must lie in \[0\.0, 1\.0\], got 2\.0$"),
    (lambda o: H.CyclicLR(o, 0.01, 0.1), dict(step_size_up=0.0),
     r"^CyclicLR\.reset_model: model 2's step_size_up: step_size_up must lie in \(0\.0, inf\], got 0\.0$"),
    (lambda o: H.CyclicLR(o, 0.01, 0.1), dict(base_lr=-1.0),
     r"^CyclicLR\.reset_model: model 2's base_lr: base_lr must be >= 0, got -1\.0$"),
    (lambda o: H.OneCycleLR(o, 0.5, total_steps=40), dict(epochs=0, steps_per_epoch=3),
     r"^OneCycleLR\.reset_model: model 2's epochs: epochs must be >= 1, got 0$"),
    (lambda o: H.StepLR(o, 2), dict(gamma=-0.5),
     r"^StepLR\.reset_model: model 2's gamma: gamma must be >= 0, got -0\.5$"),
])
def test_reset_model_errors_name_the_model_and_value(make, kwargs, match):
    opt = _opt()
    sched = make(opt)
    before = copy.deepcopy(sched.state_dict())
    with pytest.raises(ValueError, match=match) as info:
        sched.reset_model(2, **kwargs)
    assert "models [0]" not in str(info.value)
    assert _same_state(sched.state_dict(), before)


# ---- 5: param-group entries are not the scheduler's tensors -------------------------------------
def test_cyclic_lr_momentum_entries_are_copies():
    def build():
        opt = _opt(2, dtype=torch.float64)
        return opt, H.CyclicLR(opt, base_lr=0.01, max_lr=0.1, step_size_up=2, base_momentum=0.8, max_momentum=0.9)

    opt, sched = build()
    twin_opt, twin = build()
    group = opt.param_groups[0]
    assert group["max_momentum"] is not sched.max_momentums[0]
    assert group["base_momentum"] is not sched.base_momentums[0]
    assert group["scheduled_lr"] is not sched.base_lrs[0]
    with torch.no_grad():  # torch keeps floats in the group: editing it cannot reach the schedule
        group["max_momentum"].mul_(0.0)
        group["base_momentum"].mul_(0.0)
        group["scheduled_lr"].mul_(0.0)
    for _ in range(5):
        for o, s in ((opt, sched), (twin_opt, twin)):
            _step(o)
            s.step()
        assert torch.equal(group["momentum"], twin_opt.param_groups[0]["momentum"])
        assert torch.equal(sched.get_last_lr()[0], twin.get_last_lr()[0])
    assert sched.max_momentums[0].tolist() == [0.9, 0.9]
    assert sched.base_lrs[0].tolist() == [0.01, 0.01]


def test_one_cycle_entries_are_not_shared():
    opt = _opt(2, dtype=torch.float64)
    sched = H.OneCycleLR(opt, max_lr=0.1, total_steps=10)
    group = opt.param_groups[0]
    entries = [group[k] for k in ("initial_lr", "max_lr", "min_lr", "max_momentum", "base_momentum",
                                  "scheduled_lr", "momentum", "lr")]
    kept = [*sched.base_lrs, *sched.get_last_lr()]
    ids = [id(t) for t in entries + kept]
    assert len(set(ids)) == len(ids)


# ---- 6: ReduceLROnPlateau's metrics ------------------------------------------------------------
def test_plateau_refuses_complex_and_none_metrics():
    opt = _opt()
    sched = H.ReduceLROnPlateau(opt, patience=0)
    sched.step([3.0, 3.0, 3.0])
    before = copy.deepcopy(sched.state_dict())
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # not torch's cast warning: an error
        with pytest.raises(TypeError, match=r"ReduceLROnPlateau\.step: .*complex64"):
            sched.step(torch.tensor([1 + 2j, 2, 3], dtype=torch.complex64))
    with pytest.raises(TypeError, match=r"ReduceLROnPlateau\.step: the metric of model 1 .*None"):
        sched.step([1.0, None, 2.0])
    with pytest.raises(TypeError, match=r"ReduceLROnPlateau\.step: the metric of model 0 .*complex"):
        sched.step([torch.tensor(1 + 1j), 1.0, 1.0])
    with pytest.raises(TypeError):  # torch's float() of a complex raises too
        T.ReduceLROnPlateau(torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=0.1)).step(1 + 2j)
    assert _same_state(sched.state_dict(), before)
    # bools count as 0 and 1, as torch's float() takes them
    sched.step(torch.tensor([True, False, True]))
    assert sched.best.tolist() == [1.0, 0.0, 1.0]
    sched.step([False, False, 0])
    assert sched.best.tolist() == [0.0, 0.0, 0.0]


# ---- 7: negative CyclicLR scale_fn values ------------------------------------------------------
def test_cyclic_lr_rejects_negative_or_nan_scale():
    opt = _opt()
    before = dict(opt.param_groups[0])
    with pytest.raises(ValueError, match=r"CyclicLR: scale_fn: .*>= 0 and not NaN.*models \[0, 1, 2\]"):
        H.CyclicLR(opt, 0.01, 0.1, step_size_up=2, scale_fn=lambda x: -1.0)
    assert opt.param_groups[0].keys() == before.keys()

    def fn(b, bad):
        return lambda x: bad if (b == 1 and x >= 2) else 1.0

    for bad in (-0.5, math.nan):
        opt = _opt(dtype=torch.float64)
        sched = H.CyclicLR(opt, 0.01, 0.1, step_size_up=2, scale_fn=[fn(b, bad) for b in range(3)])
        for _ in range(3):  # cycle 1: iterations 0 to 3
            _step(opt)
            sched.step()
        lr, momentum = opt.param_groups[0]["lr"].clone(), opt.param_groups[0]["momentum"].clone()
        state = copy.deepcopy(sched.state_dict())
        _step(opt)
        with pytest.raises(ValueError, match=r"CyclicLR: scale_fn: .*epoch 4 models \[1\] got \[" + str(bad)):
            sched.step()
        assert torch.equal(opt.param_groups[0]["lr"], lr)
        assert torch.equal(opt.param_groups[0]["momentum"], momentum)
        assert _same_state(sched.state_dict(), state)


# ---- 9: the documented agreement with torch --------------------------------------------------
def test_docs_state_the_float64_rounding():
    doc = H.__doc__
    assert "follows exactly" not in " ".join(doc.split())
    assert "1 ulp" in doc
    # what it says: for larger B, a closed form may differ from torch's by one float64 rounding
    B = 32
    lrs = [0.1 + 0.01 * i for i in range(B)]
    gammas = [0.9 + 0.001 * i for i in range(B)]
    opt = SGD([torch.nn.Parameter(torch.zeros(B, 1, dtype=torch.float64))], lr=lrs)
    sched = H.ExponentialLR(opt, gamma=gammas)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        sched.step(37)
    for b in range(B):
        want = lrs[b] * gammas[b] ** 37
        got = sched.get_last_lr()[0][b].item()
        assert abs(got - want) <= 2 * math.ulp(want), b


# ---- 10: param groups added after the scheduler -------------------------------------------------
_ALL = {
    "StepLR": (lambda o: H.StepLR(o, 1), True),
    "MultiStepLR": (lambda o: H.MultiStepLR(o, [2]), True),
    "ConstantLR": (lambda o: H.ConstantLR(o), True),
    "LinearLR": (lambda o: H.LinearLR(o), True),
    "ExponentialLR": (lambda o: H.ExponentialLR(o, 0.9), True),
    "PolynomialLR": (lambda o: H.PolynomialLR(o), True),
    "CosineAnnealingLR": (lambda o: H.CosineAnnealingLR(o, 5), False),
    "CosineAnnealingWarmRestarts": (lambda o: H.CosineAnnealingWarmRestarts(o, 3), False),
    "CyclicLR": (lambda o: H.CyclicLR(o, 0.01, 0.1), False),
    "OneCycleLR": (lambda o: H.OneCycleLR(o, 0.1, 10), False),
    "LambdaLR": (lambda o: H.LambdaLR(o, lambda e: 0.9 ** e), False),
    "MultiplicativeLR": (lambda o: H.MultiplicativeLR(o, lambda e: 0.9), False),
    "SequentialLR": (lambda o: H.SequentialLR(o, [H.ExponentialLR(o, 0.9), H.CosineAnnealingLR(o, 5)], [1]), False),
    "ChainedScheduler": (lambda o: H.ChainedScheduler([H.ExponentialLR(o, 0.9), H.CosineAnnealingLR(o, 5)]), False),
}
_ADDED = r"was a group added after the scheduler\?"


def _added(name):
    opt = _opt(2)
    sched = _ALL[name][0](opt)
    _step(opt)
    sched.step()
    opt.add_param_group({"params": [torch.nn.Parameter(torch.zeros(2, 3))], "lr": 0.2})
    return opt, sched


def _values(opt):
    return [(g["lr"].clone(), g["momentum"].clone()) for g in opt.param_groups]


@pytest.mark.parametrize("name", sorted(_ALL))
def test_added_param_group_gives_the_helpful_error(name):
    opt, sched = _added(name)
    chains = _ALL[name][1]
    before, state = _values(opt), copy.deepcopy(sched.state_dict())
    _step(opt)
    if chains:  # the chained update reads only the groups' learning rates: it goes on, as torch's
        sched.step()
        assert len(sched.get_last_lr()) == 2
    else:
        # (a SequentialLR's or ChainedScheduler's CosineAnnealingLR says so itself)
        with pytest.raises(ValueError, match=rf"^(?:{name}|CosineAnnealingLR): .*{_ADDED}"):
            sched.step()
        for (lr, m), (lr0, m0) in zip(_values(opt), before):
            assert torch.equal(lr, lr0) and torch.equal(m, m0)
        assert _same_state(sched.state_dict(), state)
    with pytest.raises(ValueError, match=_ADDED):
        sched.reset_model(1)
    if name not in ("SequentialLR", "ChainedScheduler", "CosineAnnealingWarmRestarts", "CyclicLR",
                    "OneCycleLR", "LambdaLR", "MultiplicativeLR"):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            with pytest.raises(ValueError, match=_ADDED):
                sched.step(3)  # the closed form needs each group's base_lrs


def test_added_param_group_plateau_goes_on_as_torch():
    opt = _opt(2)
    sched = H.ReduceLROnPlateau(opt, patience=0, factor=0.5)
    sched.step([1.0, 1.0])
    opt.add_param_group({"params": [torch.nn.Parameter(torch.zeros(2, 3))], "lr": 0.2})
    sched.step([2.0, 2.0])
    assert [v.tolist() for v in sched.get_last_lr()] == [[0.05] * 2, [0.1] * 2]
    sched.reset_model(1)
    assert len(sched.get_last_lr()) == 2
