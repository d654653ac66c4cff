"""Defects of hfkern.optim.lr_scheduler (second batch).

A: with float32 parameters the schedulers started from the float32 rounding of the learning rate
   the user gave (``initial_lr``, ``base_lrs``, ``get_last_lr()``), not from the value given,
   contrary to the documented float64 agreement with torch; the optimizer now keeps the exact
   learning rates given beside their rounding, and the schedulers start from them.
B: a ``SequentialLR`` step in which one scheduler restarts some models at their milestone and
   steps the others, and the step of those others raises, kept the restart.
"""

from __future__ import annotations

import copy
import io

import pytest
import torch
from torch.optim import lr_scheduler as T

from hfkern.optim import SGD, Adam
from hfkern.optim import lr_scheduler as H

from _sched import sgd_opt, zero_grad_step


def _opt(B=2, lr=0.1, momentum=0.9, dtype=torch.float32):
    return sgd_opt(B, 3, lr, momentum, dtype)


_step = zero_grad_step


def _f32(x):
    return torch.tensor(x, dtype=torch.float32).item()


# ---- A: the schedules start from the learning rates given ----------------------------------------
def test_step_lr_starts_from_the_lr_given_not_its_float32_rounding():
    lrs = [0.015, 0.1]
    opt = _opt(lr=lrs)
    sched = H.StepLR(opt, step_size=1, gamma=0.3)
    group = opt.param_groups[0]
    assert group["initial_lr"].tolist() == lrs
    assert sched.base_lrs[0].tolist() == lrs
    assert sched.get_last_lr()[0].tolist() == lrs
    torch_lrs = []
    for lr in lrs:
        tp = torch.zeros(3, requires_grad=True)
        topt = torch.optim.SGD([tp], lr=lr, momentum=0.9)
        ts = T.StepLR(topt, step_size=1, gamma=0.3)
        seq = [ts.get_last_lr()[0]]
        for _ in range(4):
            tp.grad = torch.zeros_like(tp)
            topt.step()
            ts.step()
            seq.append(ts.get_last_lr()[0])
        torch_lrs.append(seq)
    ours = [sched.get_last_lr()[0].tolist()]
    for _ in range(4):
        _step(opt)
        sched.step()
        ours.append(sched.get_last_lr()[0].tolist())
    assert [list(x) for x in zip(*ours)] == torch_lrs
    torch_lrs_at_1 = [seq[1] for seq in torch_lrs]
    # The optimizer still steps with the float32 rounding.
    assert group["lr"].dtype == torch.float32
    # float64 parameters: as before (their stored learning rates are exact).
    opt = _opt(lr=lrs, dtype=torch.float64)
    sched = H.StepLR(opt, step_size=1, gamma=0.3)
    assert sched.base_lrs[0].tolist() == lrs
    _step(opt)
    sched.step()
    assert sched.get_last_lr()[0].tolist() == [v * 0.3 for v in lrs] == torch_lrs_at_1


def test_plateau_eps_boundary_as_torch():
    """lr=0.001, factor 0, eps=0.001: old - new == eps is no reduction (torch keeps 0.001); the
    float32 rounding of 0.001 is a little above it and was reduced to 0."""
    opt = _opt(B=1, lr=0.001)
    sched = H.ReduceLROnPlateau(opt, factor=0.0, patience=0, eps=0.001)
    tp = torch.zeros(3, requires_grad=True)
    topt = torch.optim.SGD([tp], lr=0.001)
    ts = T.ReduceLROnPlateau(topt, factor=0.0, patience=0, eps=0.001)
    for metric in (1.0, 2.0):
        _step(opt)
        sched.step([metric])
        tp.grad = torch.zeros_like(tp)
        topt.step()
        ts.step(metric)
    assert ts.get_last_lr() == [0.001]
    assert sched.get_last_lr()[0].tolist() == [0.001]
    assert opt.param_groups[0]["lr"].tolist() == [_f32(0.001)]


@pytest.mark.parametrize("value", [0.02, [0.02, 0.03]])
def test_lr_assigned_to_the_group_is_kept_exact(value):
    opt = _opt(lr=0.1)
    _step(opt)
    opt.param_groups[0]["lr"] = value
    _step(opt)  # validated: group["lr"] is now a float32 tensor
    expected = [0.02, 0.02] if value == 0.02 else [0.02, 0.03]
    sched = H.ExponentialLR(opt, gamma=0.5)
    assert opt.param_groups[0]["initial_lr"].tolist() == expected
    assert sched.get_last_lr()[0].tolist() == expected
    _step(opt)
    sched.step()
    assert sched.get_last_lr()[0].tolist() == [v * 0.5 for v in expected]


def test_lr_assigned_under_a_running_scheduler_goes_on_exact():
    opt = _opt(lr=[0.1, 0.2])
    sched = H.ExponentialLR(opt, gamma=0.5)
    _step(opt)
    sched.step()
    opt.param_groups[0]["lr"] = [0.015, 0.025]
    _step(opt)  # the optimizer validates the new value before the scheduler reads it
    sched.step()
    assert sched.get_last_lr()[0].tolist() == [0.015 * 0.5, 0.025 * 0.5]


def test_set_hyperparameters_lr_before_the_scheduler_is_kept_exact():
    opt = _opt(B=3, lr=0.1)
    _step(opt)
    opt.set_hyperparameters(1, lr=0.015)
    sched = H.CosineAnnealingLR(opt, T_max=10)
    assert opt.param_groups[0]["initial_lr"].tolist() == [0.1, 0.015, 0.1]
    assert sched.base_lrs[0].tolist() == [0.1, 0.015, 0.1]


def test_reset_model_starts_from_the_lr_given():
    opt = _opt(B=3, lr=0.1)
    sched = H.ExponentialLR(opt, gamma=0.9)
    for _ in range(3):
        _step(opt)
        sched.step()
    lrs = sched.get_last_lr()[0].tolist()
    opt.param_groups[0]["lr"] = lrs[:2] + [0.015]  # a new learning rate for the refilled slot 2
    _step(opt)
    sched.reset_model(2)
    assert sched.base_lrs[0][2].item() == 0.015
    assert sched.get_last_lr()[0].tolist() == lrs[:2] + [0.015]


def test_exact_lr_survives_revalidation_copies_and_float32_reassignment():
    # Another hyperparameter assigned anew revalidates the group (lr is then the stored view).
    opt = _opt(lr=[0.015, 0.1])
    _step(opt)
    opt.param_groups[0]["momentum"] = 0.5
    _step(opt)
    assert H.StepLR(opt, step_size=2).base_lrs[0].tolist() == [0.015, 0.1]
    # A copy of the optimizer.
    opt = _opt(lr=[0.015, 0.1])
    _step(opt)
    twin = copy.deepcopy(opt)
    assert H.StepLR(twin, step_size=2).base_lrs[0].tolist() == [0.015, 0.1]
    # Its own float32 values given back as a new tensor: still the rounding of what was given.
    opt = _opt(lr=[0.015, 0.1])
    _step(opt)
    opt.param_groups[0]["lr"] = opt.param_groups[0]["lr"].clone()
    _step(opt)
    assert H.StepLR(opt, step_size=2).base_lrs[0].tolist() == [0.015, 0.1]


def test_lr_written_in_place_still_wins_for_its_model():
    opt = _opt(lr=[0.015, 0.1])
    _step(opt)
    with torch.no_grad():
        opt.param_groups[0]["lr"][0] = 0.03
    sched = H.StepLR(opt, step_size=2)
    # Model 0: the value written (its float32, nothing more is known); model 1: the exact value given.
    assert sched.base_lrs[0].tolist() == [_f32(0.03), 0.1]


def test_optimizer_state_dict_round_trip():
    opt = _opt(lr=[0.015, 0.1])
    _step(opt)
    buf = io.BytesIO()
    torch.save(opt.state_dict(), buf)
    buf.seek(0)
    state = torch.load(buf, weights_only=True)
    # Without a scheduler the param groups hold what they held (every tensor a [B] hyperparameter).
    assert set(state["param_groups"][0]) == set(opt.param_groups[0])
    assert "scheduled_lr" not in state["param_groups"][0]
    # Loaded into an optimizer built with the same learning rates: they stay exact.
    other = _opt(lr=[0.015, 0.1])
    other.load_state_dict(state)
    assert H.StepLR(other, step_size=2).base_lrs[0].tolist() == [0.015, 0.1]
    # Built with others: the loaded learning rates (their float32 values: nothing more is known).
    other = _opt(lr=[0.5, 0.1])
    other.load_state_dict(state)
    assert H.StepLR(other, step_size=2).base_lrs[0].tolist() == [_f32(0.015), 0.1]
    # With a scheduler, its exact record travels in the state dict, as before.
    sched = H.ExponentialLR(opt, gamma=0.3)
    _step(opt)
    sched.step()
    buf = io.BytesIO()
    torch.save({"opt": opt.state_dict(), "sched": sched.state_dict()}, buf)
    buf.seek(0)
    state = torch.load(buf, weights_only=True)
    other = _opt(lr=[0.5, 0.5])
    other_sched = H.ExponentialLR(other, gamma=0.3)
    other.load_state_dict(state["opt"])
    other_sched.load_state_dict(state["sched"])
    for o, s in ((opt, sched), (other, other_sched)):
        _step(o)
        s.step()
    assert other_sched.get_last_lr()[0].tolist() == sched.get_last_lr()[0].tolist() == [
        0.015 * 0.3 * 0.3, 0.1 * 0.3 * 0.3]


# ---- B: SequentialLR, a scheduler that restarts some models and steps others ---------------------
class _Flaky:
    """A shared lr_lambda returning one factor per model; a bad one while armed."""

    def __init__(self, bad):
        self.bad = bad
        self.armed = False

    def __call__(self, epoch):
        return self.bad if self.armed else 0.9 ** epoch


def _snapshot(opt, scheds):
    groups = [{k: (v.clone() if isinstance(v, torch.Tensor) else
                   tuple(x.clone() for x in v) if isinstance(v, tuple) else v)
               for k, v in g.items() if k != "params"} for g in opt.param_groups]
    return groups, [copy.deepcopy(s.state_dict()) for s in scheds]


def _same(a, b):
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b)
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return isinstance(b, (list, tuple)) and len(a) == len(b) and all(map(_same, a, b))
    return a == b or callable(a)


def _build(kind, opt, fn):
    if kind == "cyclic_lambda":
        first, second = H.CyclicLR(opt, 0.01, 0.1, step_size_up=2), H.LambdaLR(opt, fn)
    else:
        first, second = H.ExponentialLR(opt, 0.9), H.MultiplicativeLR(opt, fn)
    return first, second


@pytest.mark.parametrize("kind", ["cyclic_lambda", "exponential_multiplicative"])
@pytest.mark.parametrize("milestones, steps, bad", [
    ([3, 0, 1], 2, [1.0, -1.0, 1.0]),   # model 0 restarts in the second scheduler, models 1, 2 step there
    ([0, 3, 5], 4, [-1.0, 1.0, 1.0]),   # model 2 restarts, models 0, 1 step
])
@pytest.mark.parametrize("opt_name", ["SGD", "Adam"])
def test_sequential_restart_then_failing_step_changes_nothing(kind, milestones, steps, bad, opt_name):
    def make():
        p = torch.nn.Parameter(torch.zeros(3, 3))
        opt = SGD([p], lr=[0.1, 0.05, 0.3], momentum=0.9) if opt_name == "SGD" else Adam([p], lr=[0.1, 0.05, 0.3])
        fn = _Flaky(bad)
        first, second = _build(kind, opt, fn)
        return opt, fn, H.SequentialLR(opt, [first, second], milestones=[milestones]), [first, second]

    opt, fn, seq, kids = make()
    twin, _, twin_seq, _ = make()
    for _ in range(steps):
        for o, s in ((opt, seq), (twin, twin_seq)):
            _step(o)
            s.step()
    before = _snapshot(opt, [seq, *kids])
    fn.armed = True
    with pytest.raises(ValueError, match="factors must be >= 0"):
        seq.step()
    fn.armed = False
    assert _same(_snapshot(opt, [seq, *kids]), before)
    # It goes on as the twin that never saw the failing step.
    for _ in range(6):
        for o, s in ((opt, seq), (twin, twin_seq)):
            _step(o)
            s.step()
        assert torch.equal(opt.param_groups[0]["lr"], twin.param_groups[0]["lr"])
        assert all(torch.equal(a, b) for a, b in zip(seq.get_last_lr(), twin_seq.get_last_lr()))
