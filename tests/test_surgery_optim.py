"""Per-model surgery of the array optimizers and the GradScaler: ``reset_state``,
``set_hyperparameters`` and ``GradScaler.reset_model``.

A sweep replaces model b while the others train on. After the surgery model b
must train exactly as a new torch model with a new ``torch.optim`` optimizer
(and a new ``torch.amp.GradScaler``) would, and the other models must stay
bit-identical to a run without the surgery.
"""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn

import hfkern.nn as hnn
import hfkern.optim as hoptim
from hfkern.amp import GradScaler

IN, HID, OUT, N = 5, 7, 3, 6  # odd sizes
STEPS_BEFORE, STEPS_AFTER = 3, 4
SEEDS = (101, 202)  # the fresh layers of the replaced model


def _f32(x):
    return float(torch.tensor(x, dtype=torch.float32))


def _s(lo, hi, B):
    """B distinct values from lo to hi (lo for B = 1)."""
    return [lo + (hi - lo) * b / max(B - 1, 1) for b in range(B)]


# (array class, torch class, per-model constructor values (lo, hi) or shared values,
#  shared options, model b's new hyperparameters)
CASES = {
    "sgd_momentum": (
        hoptim.SGD, torch.optim.SGD,
        dict(lr=(0.02, 0.05), momentum=(0.5, 0.9), dampening=(0.0, 0.2), weight_decay=(0.001, 0.01)), {},
        dict(lr=0.03, momentum=0.8, dampening=0.1, weight_decay=0.02),
    ),
    "sgd_nesterov": (
        hoptim.SGD, torch.optim.SGD,
        dict(lr=(0.02, 0.05), momentum=(0.5, 0.9)), dict(nesterov=True),
        dict(lr=0.04, momentum=0.7),
    ),
    # every model had momentum and weight decay off: the new values must switch them on
    "sgd_switch_on": (
        hoptim.SGD, torch.optim.SGD, dict(lr=(0.02, 0.05)), {},
        dict(momentum=0.9, dampening=0.1, weight_decay=0.05),
    ),
    "adam": (
        hoptim.Adam, torch.optim.Adam,
        dict(lr=(0.01, 0.03), betas=((0.8, 0.9), (0.99, 0.999)), eps=(1e-8, 1e-6)), {},
        dict(lr=0.02, betas=(0.85, 0.95), eps=1e-7, weight_decay=0.01),
    ),
    "adamw_amsgrad": (
        hoptim.AdamW, torch.optim.AdamW,
        dict(lr=(0.01, 0.03), weight_decay=(0.01, 0.1)), dict(amsgrad=True),
        dict(lr=0.025, betas=(0.7, 0.9), weight_decay=0.2),
    ),
    "rmsprop_centered_momentum": (
        hoptim.RMSprop, torch.optim.RMSprop,
        dict(lr=(0.002, 0.01), alpha=(0.9, 0.99), momentum=(0.0, 0.5)), dict(centered=True),
        dict(lr=0.005, alpha=0.95, momentum=0.3, eps=1e-6),
    ),
    "rmsprop_switch_on": (
        hoptim.RMSprop, torch.optim.RMSprop, dict(lr=(0.002, 0.01)), {},
        dict(momentum=0.6, weight_decay=0.01),
    ),
    "adagrad": (
        hoptim.Adagrad, torch.optim.Adagrad,
        dict(lr=(0.05, 0.1), lr_decay=(0.0, 0.1), initial_accumulator_value=(0.0, 0.2)), {},
        dict(lr=0.07, lr_decay=0.05, initial_accumulator_value=0.3, eps=1e-9),
    ),
    "adadelta": (
        hoptim.Adadelta, torch.optim.Adadelta,
        dict(lr=(0.5, 1.0), rho=(0.8, 0.95)), {},
        dict(lr=0.75, rho=0.85, eps=1e-5, weight_decay=0.01),
    ),
}


def _per_model(values, B):
    out = {}
    for k, v in values.items():
        if k == "betas":
            out[k] = tuple(_s(*pair, B) for pair in v)
        else:
            out[k] = _s(*v, B)
    return out


def _model_values(values, b):
    """Model b's hyperparameters, rounded to float32 as the array optimizer stores them."""
    return {k: (tuple(_f32(x[b]) for x in v) if k == "betas" else _f32(v[b])) for k, v in values.items()}


def _new_values(new):
    return {k: (tuple(_f32(x) for x in v) if k == "betas" else _f32(v)) for k, v in new.items()}


def _net(B):
    return nn.Sequential(hnn.Linear(IN, HID, B=B), nn.Tanh(), hnn.Linear(HID, OUT, B=B))


def _torch_net():
    return nn.Sequential(nn.Linear(IN, HID), nn.Tanh(), nn.Linear(HID, OUT))


def _fresh_torch_net():
    """What the array's slot becomes with reset_model(b, seed) per layer."""
    net = _torch_net()
    for layer, seed in zip((net[0], net[2]), SEEDS):
        torch.manual_seed(seed)
        fresh = nn.Linear(layer.in_features, layer.out_features)
        with torch.no_grad():
            layer.weight.copy_(fresh.weight)
            layer.bias.copy_(fresh.bias)
    return net


def _data(B, steps):
    return [(torch.randn(B, N, IN), torch.randn(B, N, OUT)) for _ in range(steps)]


def _losses(out, y):
    return ((out - y) ** 2).flatten(1).mean(1)  # [B]


def _train(net, opt, data):
    for x, y in data:
        opt.zero_grad()
        _losses(net(x), y).sum().backward()
        opt.step()


def _params(net):
    return [p.detach().clone() for p in net.parameters()]


@pytest.mark.parametrize("B,b", [(1, 0), (3, 1), (5, 4)])
@pytest.mark.parametrize("case", list(CASES))
def test_replaced_model_trains_as_new_and_others_are_untouched(case, B, b):
    cls, torch_cls, values, options, new = CASES[case]
    per_model = _per_model(values, B)
    data = _data(B, STEPS_BEFORE + STEPS_AFTER)
    torch.manual_seed(0)
    net = _net(B)
    baseline = _net(B)
    baseline.load_state_dict(net.state_dict())
    opt = cls(net.parameters(), **per_model, **options)
    base_opt = cls(baseline.parameters(), **per_model, **options)

    _train(net, opt, data[:STEPS_BEFORE])
    _train(baseline, base_opt, data)
    # the surgery: fresh parameters, hyperparameters (Adagrad's initial
    # accumulator value before the state it initializes), fresh state
    for layer, seed in zip((net[0], net[2]), SEEDS):
        layer.reset_model(b, seed=seed)
    opt.set_hyperparameters(b, **new)
    opt.reset_state(b)
    _train(net, opt, data[STEPS_BEFORE:])

    # model b: a new torch model and a new torch optimizer with the new values
    ref = _fresh_torch_net()
    hypers = {**_model_values(per_model, b), **_new_values(new)}
    ref_opt = torch_cls(ref.parameters(), **hypers, **options)
    for x, y in data[STEPS_BEFORE:]:
        ref_opt.zero_grad()
        _losses(ref(x[b : b + 1]), y[b : b + 1]).sum().backward()
        ref_opt.step()
    for got, want in zip(net.parameters(), ref.parameters()):
        torch.testing.assert_close(got[b], want.detach(), rtol=1e-5, atol=1e-6)
    # the others: bit-identical to the run without the surgery
    others = [i for i in range(B) if i != b]
    for got, want in zip(net.parameters(), baseline.parameters()):
        assert torch.equal(got[others], want[others])
    for p, q in zip(net.parameters(), baseline.parameters()):
        # (a switched-on momentum adds state the run without it does not keep)
        for key, t in base_opt.state[q].items():
            assert torch.equal(opt.state[p][key][others], t[others]), key


@pytest.mark.parametrize("case", ["adam", "sgd_momentum", "adagrad"])
def test_reset_state_gives_the_state_of_a_new_optimizer(case):
    cls, _, values, options, _ = CASES[case]
    B, b = 3, 2
    per_model = _per_model(values, B)
    torch.manual_seed(1)
    net = _net(B)
    opt = cls(net.parameters(), **per_model, **options)
    _train(net, opt, _data(B, 2))
    before = {p: {k: t.clone() for k, t in opt.state[p].items()} for p in net.parameters()}
    fresh = cls([p.detach().clone().requires_grad_() for p in net.parameters()], **per_model, **options)
    for p in fresh.param_groups[0]["params"]:
        p.grad = torch.randn_like(p)
    fresh.step(skip=torch.ones(B, dtype=torch.bool))  # creates the state, changes nothing
    opt.reset_state(b)
    for p, q in zip(net.parameters(), fresh.param_groups[0]["params"]):
        assert set(opt.state[p]) == set(fresh.state[q])
        for key, t in opt.state[p].items():
            assert torch.equal(t[b], fresh.state[q][key][b]), key
            assert torch.equal(t[:b], before[p][key][:b]), key


def test_reset_state_without_state_is_a_no_op_and_state_stays_lazy():
    torch.manual_seed(2)
    net = _net(3)
    opt = hoptim.Adam(net.parameters(), lr=0.01)
    opt.reset_state(1)
    assert len(opt.state) == 0
    _train(net, opt, _data(3, 1))
    assert all(set(s) == {"step", "exp_avg", "exp_avg_sq"} for s in opt.state.values())


def test_reset_then_set_order_matches_new_model():
    """The order of the brief: parameters, state, then hyperparameters (no state-initializing value)."""
    B, b = 3, 0
    data = _data(B, 5)
    torch.manual_seed(3)
    net = _net(B)
    opt = hoptim.Adam(net.parameters(), lr=_s(0.01, 0.03, B))
    _train(net, opt, data[:2])
    for layer, seed in zip((net[0], net[2]), SEEDS):
        layer.reset_model(b, seed=seed)
    opt.reset_state(b)
    opt.set_hyperparameters(b, lr=0.005, betas=(0.5, 0.75))
    _train(net, opt, data[2:])
    ref = _fresh_torch_net()
    ref_opt = torch.optim.Adam(ref.parameters(), lr=_f32(0.005), betas=(0.5, 0.75))
    for x, y in data[2:]:
        ref_opt.zero_grad()
        _losses(ref(x[b : b + 1]), y[b : b + 1]).sum().backward()
        ref_opt.step()
    for got, want in zip(net.parameters(), ref.parameters()):
        torch.testing.assert_close(got[b], want.detach(), rtol=1e-5, atol=1e-6)


def _snapshot(opt):
    groups = []
    for g in opt.param_groups:
        entry = {}
        for k, v in g.items():
            if isinstance(v, torch.Tensor):
                entry[k] = (v, v.clone())
            elif isinstance(v, tuple) and v and isinstance(v[0], torch.Tensor):
                entry[k] = (v, tuple(t.clone() for t in v))
            elif k != "params":
                entry[k] = (v, v)
        groups.append(entry)
    return groups


def _assert_unchanged(opt, snapshot):
    for g, entry in zip(opt.param_groups, snapshot):
        for k, (obj, values) in entry.items():
            assert g[k] is obj, k
            if isinstance(obj, torch.Tensor):
                assert torch.equal(obj, values), k
            elif isinstance(obj, tuple) and isinstance(obj[0], torch.Tensor):
                assert all(torch.equal(a, c) for a, c in zip(obj, values)), k


@pytest.mark.parametrize("kwargs,error,match", [
    (dict(lr=-0.1), ValueError, ">= 0"),
    (dict(lr=math.nan), ValueError, "NaN"),
    (dict(lr="fast"), TypeError, "lr"),
    (dict(lr=[0.1, 0.2]), TypeError, "one number"),
    (dict(lr=True), TypeError, "lr"),
    (dict(betas=(0.9,)), ValueError, "pair"),
    (dict(betas=(0.9, 1.0)), ValueError, r"betas\[1\]"),
    (dict(lr=0.1, betas=(0.9, -0.5)), ValueError, r"betas\[1\]"),
    (dict(momentum=0.9), TypeError, r"'lr', 'betas', 'eps', 'weight_decay'"),
    (dict(amsgrad=True), TypeError, "every model"),
])
def test_set_hyperparameters_rejects_before_writing(kwargs, error, match):
    torch.manual_seed(4)
    net = _net(3)
    opt = hoptim.Adam(net.parameters(), lr=[0.01, 0.02, 0.03], weight_decay=0.0)
    _train(net, opt, _data(3, 1))
    snapshot = _snapshot(opt)
    with pytest.raises(error, match=match):
        opt.set_hyperparameters(1, **kwargs)
    _assert_unchanged(opt, snapshot)


def test_set_hyperparameters_checks_index_and_group():
    torch.manual_seed(5)
    net = _net(3)
    opt = hoptim.SGD([{"params": net[0].parameters()}, {"params": net[2].parameters(), "lr": 0.5}],
                     lr=0.1, momentum=0.9, nesterov=True)
    snapshot = _snapshot(opt)
    for b, error in ((3, ValueError), (-1, ValueError), (1.0, TypeError), (True, TypeError)):
        with pytest.raises(error, match=r"\[0, 3\)"):
            opt.set_hyperparameters(b, lr=0.2)
    with pytest.raises(ValueError, match=r"\[0, 2\)"):
        opt.set_hyperparameters(0, group=2, lr=0.2)
    # Nesterov needs a momentum for every model, checked with the rest of the group
    with pytest.raises(ValueError, match="Nesterov"):
        opt.set_hyperparameters(2, momentum=0.0)
    _assert_unchanged(opt, snapshot)
    for b, error in ((3, ValueError), ("1", TypeError)):
        with pytest.raises(error):
            opt.reset_state(b)

    opt.set_hyperparameters(1, group=1, lr=0.25, momentum=0.5)
    g0, g1 = opt.param_groups
    assert torch.equal(g0["lr"], torch.full((3,), 0.1))
    assert torch.equal(g1["lr"], torch.tensor([0.5, 0.25, 0.5]))
    assert torch.equal(g1["momentum"], torch.tensor([0.9, 0.5, 0.9]))
    assert torch.equal(g0["momentum"], torch.full((3,), 0.9))


def test_set_hyperparameters_writes_in_place():
    torch.manual_seed(6)
    net = _net(3)
    opt = hoptim.Adam(net.parameters(), lr=0.01, betas=(0.9, 0.999))
    group = opt.param_groups[0]
    lr, (beta1, beta2) = group["lr"], group["betas"]
    version = lr._version
    opt.set_hyperparameters(2, lr=0.5, betas=(0.25, 0.5), eps=1e-3)
    assert group["lr"] is lr and group["betas"][0] is beta1 and group["betas"][1] is beta2
    assert lr._version > version  # what the schedulers watch
    assert torch.equal(lr, torch.tensor([0.01, 0.01, 0.5]))
    assert torch.equal(beta1, torch.tensor([0.9, 0.9, 0.25]))
    assert torch.equal(beta2, torch.tensor([0.999, 0.999, 0.5]))
    assert torch.equal(group["eps"], torch.tensor([1e-8, 1e-8, 1e-3]))
    # numpy-free scalar forms: a 0-d tensor and a one-element tensor
    opt.set_hyperparameters(0, lr=torch.tensor(0.125), weight_decay=torch.tensor([0.0625]))
    assert torch.equal(lr, torch.tensor([0.125, 0.01, 0.5]))
    assert torch.equal(group["weight_decay"], torch.tensor([0.0625, 0.0, 0.0]))


def test_set_hyperparameters_keeps_the_schedulers_records():
    B, b = 3, 1
    torch.manual_seed(7)
    net = _net(B)
    data = _data(B, 8)
    opt = hoptim.SGD(net.parameters(), lr=[0.1, 0.2, 0.3])
    sched = hoptim.lr_scheduler.ExponentialLR(opt, gamma=[0.9, 0.7, 0.3])
    ref = _net(B)
    ref.load_state_dict(net.state_dict())
    ref_opt = hoptim.SGD(ref.parameters(), lr=[0.1, 0.2, 0.3])
    ref_sched = hoptim.lr_scheduler.ExponentialLR(ref_opt, gamma=[0.9, 0.7, 0.3])
    for step, (x, y) in enumerate(data):
        for n, o, s in ((net, opt, sched), (ref, ref_opt, ref_sched)):
            o.zero_grad()
            _losses(n(x), y).sum().backward()
            o.step()
            s.step()
        if step == 2:
            opt.set_hyperparameters(b, lr=0.05)
            group = opt.param_groups[0]
            assert group["scheduled_lr"][b].item() == 0.05
            assert group["initial_lr"][b].item() == 0.05
            assert group["scheduled_lr"].dtype == torch.float64
    # model b's schedule goes on from the new value (float64, as torch's floats)
    assert math.isclose(sched.get_last_lr()[0][b].item(), 0.05 * 0.7**5, rel_tol=1e-12)
    # the other models keep their exact float64 schedules and trajectories
    others = [0, 2]
    assert torch.equal(sched.get_last_lr()[0][others], ref_sched.get_last_lr()[0][others])
    assert torch.equal(opt.param_groups[0]["lr"][others], ref_opt.param_groups[0]["lr"][others])
    for p, q in zip(net.parameters(), ref.parameters()):
        assert torch.equal(p[others], q[others])


def test_set_hyperparameters_switches_weight_decay_off_again():
    """Re-validation also notices that no model has weight decay any more."""
    torch.manual_seed(8)
    B = 3
    data = _data(B, 3)
    net, ref = _net(B), _net(B)
    ref.load_state_dict(net.state_dict())
    opt = hoptim.SGD(net.parameters(), lr=0.1, weight_decay=[0.0, 0.5, 0.0])
    ref_opt = hoptim.SGD(ref.parameters(), lr=0.1)
    opt.set_hyperparameters(1, weight_decay=0.0)
    _train(net, opt, data)
    _train(ref, ref_opt, data)
    for p, q in zip(net.parameters(), ref.parameters()):
        assert torch.equal(p, q)


# ---- GradScaler ------------------------------------------------------------------

SCALER_ARGS = dict(growth_factor=2.0, backoff_factor=0.5, growth_interval=2)


def test_scaler_reset_model_before_and_after_first_scale():
    scaler = GradScaler("cpu", init_scale=[2.0**10, 2.0**12, 2.0**8], B=3, **SCALER_ARGS)
    scaler.reset_model(1, init_scale=2.0**5)  # before scale(): the values scale() starts from
    state = scaler.state_dict()
    assert torch.equal(state["scale"], torch.tensor([2.0**10, 2.0**5, 2.0**8]))
    assert torch.equal(state["_growth_tracker"], torch.zeros(3, dtype=torch.int32))
    assert torch.equal(scaler.scale(torch.ones(3)), torch.tensor([2.0**10, 2.0**5, 2.0**8]))

    net = hnn.Linear(4, 2, B=3)
    opt = hoptim.SGD(net.parameters(), lr=0.01)
    for step in range(3):
        opt.zero_grad()
        scaler.scale(net(torch.randn(3, 5, 4)).pow(2).flatten(1).mean(1)).sum().backward()
        if step == 2:
            net.weight.grad[2, 0, 0] = math.inf
        scaler.step(opt)
        scaler.update()
    scale, tracker = scaler.get_scale(), scaler._get_growth_tracker()
    assert torch.equal(scale, torch.tensor([2.0**11, 2.0**6, 2.0**8]))
    assert torch.equal(tracker, torch.tensor([1, 1, 0], dtype=torch.int32))
    scaler.reset_model(0)
    assert torch.equal(scaler.get_scale(), torch.tensor([2.0**10, 2.0**6, 2.0**8]))
    assert torch.equal(scaler._get_growth_tracker(), torch.tensor([0, 1, 0], dtype=torch.int32))
    scaler.reset_model(1)  # its initial scale is now the one given to reset_model
    assert torch.equal(scaler.state_dict()["scale"], torch.tensor([2.0**10, 2.0**5, 2.0**8]))
    assert torch.equal(scaler.state_dict()["_growth_tracker"], torch.zeros(3, dtype=torch.int32))


def test_scaler_reset_model_keeps_its_initial_scale_over_load_state_dict():
    scaler = GradScaler("cpu", init_scale=[2.0**10, 2.0**12], B=2, **SCALER_ARGS)
    scaler.load_state_dict({**scaler.state_dict(), "scale": torch.tensor([3.0, 5.0])})
    scaler.reset_model(1)
    assert torch.equal(scaler.get_scale(), torch.tensor([3.0, 2.0**12]))


def test_scaler_reset_model_rejects_before_writing():
    scaler = GradScaler("cpu", init_scale=[2.0**10, 2.0**12, 2.0**8], B=3, **SCALER_ARGS)
    scaler.scale(torch.ones(3))
    before = scaler.state_dict()
    for b, init, error in ((3, None, ValueError), (-1, None, ValueError), (1.5, None, TypeError),
                           (True, None, TypeError), (0, 0.0, ValueError), (0, -2.0, ValueError),
                           (0, math.inf, ValueError), (0, math.nan, ValueError), (0, 1e39, ValueError),
                           (0, [1.0, 2.0, 3.0], TypeError), (0, "1", TypeError), (0, True, TypeError)):
        with pytest.raises(error):
            scaler.reset_model(b, init_scale=init)
    for b in (1, 2):  # the message names the model reset, not the value's index 0
        with pytest.raises(ValueError, match=rf"init_scale of model {b} must be finite.*models \[{b}\] have \[0.0\]"):
            scaler.reset_model(b, init_scale=0.0)
    after = scaler.state_dict()
    assert all(torch.equal(before[k], after[k]) if isinstance(before[k], torch.Tensor) else before[k] == after[k]
               for k in before)
    scaler.reset_model(0)
    assert torch.equal(scaler.get_scale(), torch.tensor([2.0**10, 2.0**12, 2.0**8]))

    # mid-iteration (after unscale_, before update) the reset is refused
    net = hnn.Linear(2, 2, B=3)
    opt = hoptim.SGD(net.parameters(), lr=0.1)
    scaler.scale(net(torch.randn(3, 4, 2)).sum(dim=(1, 2))).sum().backward()
    scaler.unscale_(opt)
    with pytest.raises(RuntimeError, match="update"):
        scaler.reset_model(1)
    scaler.step(opt)
    scaler.update()
    scaler.reset_model(1)

    disabled = GradScaler("cpu", B=2, enabled=False)
    disabled.reset_model(1, init_scale=4.0)
    with pytest.raises(ValueError):
        disabled.reset_model(2)


def test_scaler_replaced_model_trains_as_new_with_a_torch_scaler():
    """Model b restarted mid-run (parameters, Adam state, scale) follows a new torch model,
    torch Adam and torch GradScaler; the others are bit-identical to the run without it."""
    B, b, steps_before, steps_after = 3, 2, 4, 6
    init_scales, new_scale = [2.0**10, 2.0**12, 2.0**8], 2.0**7
    poisoned = {1, 6, 7}  # steps at which model b's gradients overflow
    torch.manual_seed(9)
    data = _data(B, steps_before + steps_after)
    nets = [_net(B), _net(B)]
    nets[1].load_state_dict(nets[0].state_dict())
    opts = [hoptim.Adam(n.parameters(), lr=[0.0625, 0.03125, 0.125]) for n in nets]
    scalers = [GradScaler("cpu", init_scale=init_scales, B=B, **SCALER_ARGS) for _ in nets]

    def step(net, opt, scaler, x, y, poison):
        opt.zero_grad()
        scaler.scale(_losses(net(x), y)).sum().backward()
        if poison:
            net[0].weight.grad[b, 0, 0] = math.nan
        scaler.step(opt)
        scaler.update()

    for i, (x, y) in enumerate(data):
        if i == steps_before:  # surgery on the first run only
            for layer, seed in zip((nets[0][0], nets[0][2]), SEEDS):
                layer.reset_model(b, seed=seed)
            opts[0].reset_state(b)
            opts[0].set_hyperparameters(b, lr=0.015625)
            scalers[0].reset_model(b, init_scale=new_scale)
        for net, opt, scaler in zip(nets, opts, scalers):
            step(net, opt, scaler, x, y, i in poisoned)

    ref = _fresh_torch_net()
    ref_opt = torch.optim.Adam(ref.parameters(), lr=0.015625, betas=(_f32(0.9), _f32(0.999)), eps=_f32(1e-8))
    ref_scaler = torch.amp.GradScaler("cpu", init_scale=new_scale, **SCALER_ARGS)
    for i, (x, y) in enumerate(data[steps_before:], start=steps_before):
        ref_opt.zero_grad()
        ref_scaler.scale(_losses(ref(x[b : b + 1]), y[b : b + 1]).sum()).backward()
        if i in poisoned:
            ref[0].weight.grad[0, 0] = math.nan
        ref_scaler.step(ref_opt)
        ref_scaler.update()
    assert scalers[0].get_scale()[b].item() == ref_scaler.get_scale()
    assert scalers[0]._get_growth_tracker()[b].item() == ref_scaler._get_growth_tracker()
    for got, want in zip(nets[0].parameters(), ref.parameters()):
        torch.testing.assert_close(got[b], want.detach(), rtol=1e-5, atol=1e-6)
    others = [i for i in range(B) if i != b]
    assert torch.equal(scalers[0].get_scale()[others], scalers[1].get_scale()[others])
    for p, q in zip(nets[0].parameters(), nets[1].parameters()):
        assert torch.equal(p[others], q[others])
