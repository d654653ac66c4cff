"""Per-model hyperparameters that switch optimizer state on and off, against torch.optim.

torch keeps some state only while an option is on. ``torch.optim.SGD`` uses a
parameter's ``momentum_buffer`` only while the group's momentum is non-zero: it
starts as a copy of the first gradient it sees, is left alone while momentum
is 0, and resumes from where it was when momentum comes back. RMSprop creates
its ``momentum_buffer`` (``grad_avg`` when centered; Adam its ``max_exp_avg_sq``
with amsgrad) at a parameter's first step only, and raises a KeyError when the
option is switched on later.

An array optimizer keeps such state for all B models of a group, and a model's
trajectory must not depend on that: when model b's momentum changes between
steps (by ``set_hyperparameters``, an assigned value or an in-place edit of the
stored row), model b follows a torch optimizer given the same change. Where
torch raises, the array optimizer starts the state from zeros, which is what
torch's first step creates; the references here insert those zeros by hand.
LARS has no torch namesake: its reference is the paper's update with
``torch.optim.SGD``'s rule for a momentum of 0.

Every test runs on each backend that serves the op on CPU tensors: the torch
path, the Triton kernels in Triton's interpreter and the CUDA kernels through
the host grid emulator.
"""

from __future__ import annotations

import pytest
import torch

import hfkern.optim as hoptim
from hfkern import _backend
from hfkern._optim_specs import OPTIMIZER_SPECS

# Per-model shapes: a [B] parameter, a small odd matrix and one that spans several
# kernel tiles (64 elements in Triton's interpreter, 192 in the emulator).
SHAPES = [(), (5, 3), (37, 11)]
STEPS = 8
SKIPPED = {5: 0}  # step -> a model that the array skips (and whose torch optimizer does not step)

_CUDA_OPS = ("sgd_step_", "adam_step_", "lars_step_", "lamb_step_")  # the CUDA kernels' ops (Triton: every one)


def _backends(op):
    """The backends that serve ``op`` on CPU tensors, as test parameters."""
    out = [pytest.param("torch", id="torch"), pytest.param("triton", id="triton", marks=pytest.mark.interpreter)]
    if op in _CUDA_OPS:
        out.append(pytest.param("cuda", id="cuda_emulated", marks=pytest.mark.emulator))
    return out


@pytest.fixture
def routed(monkeypatch):
    """``routed(backend)`` serves every optimizer step op on CPU tensors from ``backend``
    (the registry gives the Triton and CUDA kernels to CUDA tensors only) and returns
    the list of the ops it served, so that a test can check it ran there."""

    def route(backend):
        if backend == "triton":
            pytest.importorskip("triton")
            from hfkern.triton import optim as tk

            get = lambda op: getattr(tk, op)  # noqa: E731
        elif backend == "cuda":
            from hfkern.cuda import optim as ck

            get = ck.emulated
        else:
            get = lambda op: _backend._registry[op]["torch"].load()  # noqa: E731
        served = []
        impls = {}
        resolve = _backend.resolve
        step_ops = {spec.op for spec in OPTIMIZER_SPECS}

        def resolve_routed(op, device, dtype=None):
            if op not in step_ops:
                return resolve(op, device, dtype)
            served.append(op)
            if op not in impls:
                impls[op] = get(op)
            return impls[op]

        monkeypatch.setattr(_backend, "resolve", resolve_routed)
        return served

    return route


def _f32(x):
    """``x`` as the array optimizer stores it (float32), for the torch references."""
    return float(torch.tensor(x, dtype=torch.float32))


def _params(B):
    return [torch.nn.Parameter(torch.randn(B, *s)) for s in SHAPES]


def _copies(params, b):
    return [torch.nn.Parameter(p[b].detach().clone()) for p in params]


def _set_momentum(opt, b, value, how):
    """Model b's momentum becomes ``value`` through one of the entries that change it."""
    group = opt.param_groups[0]
    if how == "set_hyperparameters":
        opt.set_hyperparameters(b, momentum=value)
    elif how == "assign":  # a new value, validated at the next step
        values = [float(v) for v in group["momentum"]]  # (a list when assigned this step already)
        values[b] = value
        group["momentum"] = values
    else:  # in place, as a scheduler writes: reaches the next step unvalidated
        assert how == "in_place"
        group["momentum"][b] = value


def _momentum_plan(schedule, B):
    """Each model's momentum per step: model 0 follows ``schedule`` (step -> value);
    for B > 1 the last model follows it two steps later (switching alone, or in
    the same step as model 0) and the models between keep 0.5 (so that the group
    always has buffers)."""
    plan = []
    for b in range(B):
        if b == 0:
            plan.append(dict(schedule))
        elif b == B - 1:
            plan.append({0: schedule[0], **{s + 2: v for s, v in schedule.items() if s}})
        else:
            plan.append({0: 0.5})
    return plan


def _run(opt, refs, params, models, plan, how, compare, before_step=None):
    """STEPS steps of the array optimizer and of one torch-like reference per model,
    switching momentum by ``plan`` and skipping by SKIPPED; ``compare(step)`` checks."""
    B = len(refs)
    for step in range(STEPS):
        for b in range(B):
            if step and step in plan[b]:
                _set_momentum(opt, b, plan[b][step], how)
                refs[b].param_groups[0]["momentum"] = _f32(plan[b][step])
        grads = [torch.randn_like(p) for p in params]
        for p, g in zip(params, grads):
            p.grad = g
        skipped = SKIPPED.get(step)
        skip = None
        if skipped is not None and skipped < B:
            skip = torch.zeros(B, dtype=torch.bool)
            skip[skipped] = True
        opt.step(skip=skip)
        for b in range(B):
            if b == skipped:
                continue
            for m, g in zip(models[b], grads):
                m.grad = g[b].clone()
            if before_step is not None:
                before_step(refs[b])
            refs[b].step()
        compare(step)


def _assert_follows(params, models, step, rtol=1e-5, atol=1e-6):
    for b, model in enumerate(models):
        for p, m in zip(params, model):
            torch.testing.assert_close(p[b], m.detach(), rtol=rtol, atol=atol,
                                       msg=lambda e: f"step {step}, model {b}: {e}")


# ---- SGD ----------------------------------------------------------------------------

# Model 0's momentum by step (0: the start).
SGD_SCHEDULES = {
    "on": {0: 0.0, 3: 0.9},  # torch starts a fresh buffer from the next gradient
    "off_on": {0: 0.9, 2: 0.0, 4: 0.7},  # torch leaves the buffer alone while off, then resumes it
    "on_off_on": {0: 0.0, 2: 0.8, 4: 0.0, 6: 0.6},
}
HOWS = ["set_hyperparameters", "assign", "in_place"]


def _sgd_cases():
    out = []
    for how in HOWS:
        for B in (1, 3):
            if how == "in_place" and B == 1:
                continue  # in place cannot switch on a group without buffers (documented)
            for schedule in SGD_SCHEDULES:
                out.append(pytest.param(how, B, schedule, id=f"{how}-B{B}-{schedule}"))
    return out


@pytest.mark.parametrize("backend", _backends("sgd_step_"))
@pytest.mark.parametrize("how, B, schedule", _sgd_cases())
def test_sgd_momentum_switches_follow_torch(routed, backend, how, B, schedule):
    served = routed(backend)
    plan = _momentum_plan(SGD_SCHEDULES[schedule], B)
    lrs = [0.05 + 0.02 * b for b in range(B)]
    dampening = [0.15 + 0.05 * b for b in range(B)]  # (a buffer's first update ignores it)
    weight_decay = [0.01 * b for b in range(B)]
    params = _params(B)
    models = [_copies(params, b) for b in range(B)]
    opt = hoptim.SGD(params, lr=lrs, momentum=[p[0] for p in plan], dampening=dampening,
                     weight_decay=weight_decay)
    refs = [torch.optim.SGD(models[b], lr=_f32(lrs[b]), momentum=_f32(plan[b][0]), dampening=_f32(dampening[b]),
                            weight_decay=_f32(weight_decay[b]))
            for b in range(B)]
    _run(opt, refs, params, models, plan, how, lambda step: _assert_follows(params, models, step))
    assert served, "the step never reached the backend under test"
    # A buffer torch keeps equals the model's slice of ours; the count counts the
    # model's updates with momentum.
    for b in range(B):
        with_momentum = [s for s in range(STEPS) if SKIPPED.get(s) != b
                         and plan[b][max(k for k in plan[b] if k <= s)] != 0]
        for p, m in zip(params, models[b]):
            ref_buf = refs[b].state[m].get("momentum_buffer")
            if ref_buf is None:
                continue
            torch.testing.assert_close(opt.state[p]["momentum_buffer"][b], ref_buf, rtol=1e-5, atol=1e-6)
            assert opt.state[p]["step"][b].item() == len(with_momentum)


@pytest.mark.parametrize("backend", _backends("sgd_step_"))
def test_sgd_nesterov_model_joins_after_momentum_switched_on(routed, backend):
    """Nesterov needs momentum for every model, so a model can only join it through a
    group that had momentum off, switched on by values (assigned to the whole group)."""
    served = routed(backend)
    B = 3
    params = _params(B)
    models = [_copies(params, b) for b in range(B)]
    opt = hoptim.SGD(params, lr=[0.02, 0.03, 0.04], momentum=[0.0, 0.9, 0.5])
    refs = [torch.optim.SGD(models[b], lr=_f32(0.02 + 0.01 * b), momentum=_f32([0.0, 0.9, 0.5][b]))
            for b in range(B)]
    for step in range(6):
        if step == 3:
            group = opt.param_groups[0]
            group["momentum"], group["nesterov"] = [0.8, 0.9, 0.5], True
            refs[0].param_groups[0]["momentum"] = _f32(0.8)
            for r in refs:
                r.param_groups[0]["nesterov"] = True
        grads = [torch.randn_like(p) for p in params]
        for p, g in zip(params, grads):
            p.grad = g
        opt.step()
        for b in range(B):
            for m, g in zip(models[b], grads):
                m.grad = g[b].clone()
            refs[b].step()
        _assert_follows(params, models, step)
    assert served


@pytest.mark.parametrize("backend", _backends("sgd_step_"))
def test_sgd_buffer_loaded_without_count_restarts_a_model_without_momentum(routed, backend):
    """A checkpoint of a version that kept no step count: a model with momentum 0 has
    not started its buffer (whatever it holds), so switched on it starts afresh."""
    served = routed(backend)
    B = 3
    momentum = [0.0, 0.5, 0.9]
    params = _params(B)
    models = [_copies(params, b) for b in range(B)]
    opt = hoptim.SGD(params, lr=0.05, momentum=momentum)
    refs = [torch.optim.SGD(models[b], lr=_f32(0.05), momentum=_f32(momentum[b])) for b in range(B)]

    def step_all():
        grads = [torch.randn_like(p) for p in params]
        for p, g in zip(params, grads):
            p.grad = g
        opt.step()
        for b in range(B):
            for m, g in zip(models[b], grads):
                m.grad = g[b].clone()
            refs[b].step()

    for _ in range(2):
        step_all()
    saved = opt.state_dict()
    for state in saved["state"].values():
        del state["step"]
        # the older version held model 0's last gradient there
        state["momentum_buffer"][0] = torch.randn_like(state["momentum_buffer"][0])
    opt = hoptim.SGD(params, lr=0.05)
    opt.load_state_dict(saved)
    opt.set_hyperparameters(0, momentum=0.9)
    refs[0].param_groups[0]["momentum"] = _f32(0.9)
    for step in range(3):
        step_all()
        _assert_follows(params, models, step)
    for p in params:
        assert opt.state[p]["step"].tolist() == [3.0, 4.0, 4.0]  # started: 1, then 3 updates
    assert served


# ---- RMSprop ------------------------------------------------------------------------

RMSPROP_SCHEDULES = {
    "on": {0: 0.0, 3: 0.9},  # torch raises; the buffer starts from zeros
    "off_on": {0: 0.9, 2: 0.0, 4: 0.7},  # torch leaves the buffer alone while off, then resumes it
}


def _zero_state_where_torch_raises(*keys):
    """Before a torch optimizer's step: the state it creates only at its first step, added
    as zeros to a started state that lacks it (what the array optimizer keeps)."""

    def fill(ref):
        group = ref.param_groups[0]
        wanted = [k for k in keys if (group["momentum"] > 0 if k == "momentum_buffer" else
                                      group["centered" if k == "grad_avg" else "amsgrad"])]
        for p in group["params"]:
            state = ref.state[p]
            for k in wanted:
                if state and k not in state:
                    state[k] = torch.zeros_like(p, memory_format=torch.preserve_format)

    return fill


@pytest.mark.parametrize("backend", _backends("rmsprop_step_"))
@pytest.mark.parametrize("centered", [False, True])
@pytest.mark.parametrize("B", [1, 3])
@pytest.mark.parametrize("schedule", list(RMSPROP_SCHEDULES))
def test_rmsprop_momentum_switches_follow_torch(routed, backend, schedule, B, centered):
    served = routed(backend)
    plan = _momentum_plan(RMSPROP_SCHEDULES[schedule], B)
    lrs = [0.005 + 0.002 * b for b in range(B)]
    alphas = [0.9 + 0.04 * b for b in range(B)]
    params = _params(B)
    models = [_copies(params, b) for b in range(B)]
    opt = hoptim.RMSprop(params, lr=lrs, alpha=alphas, momentum=[p[0] for p in plan], centered=centered,
                         weight_decay=0.01)
    refs = [torch.optim.RMSprop(models[b], lr=_f32(lrs[b]), alpha=_f32(alphas[b]), momentum=_f32(plan[b][0]),
                                centered=centered, weight_decay=_f32(0.01))
            for b in range(B)]
    _run(opt, refs, params, models, plan, "set_hyperparameters",
         lambda step: _assert_follows(params, models, step),
         before_step=_zero_state_where_torch_raises("momentum_buffer"))
    assert served
    for b in range(B):
        for p, m in zip(params, models[b]):
            ref_buf = refs[b].state[m].get("momentum_buffer")
            if ref_buf is not None:
                torch.testing.assert_close(opt.state[p]["momentum_buffer"][b], ref_buf, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("name, backend", [
    pytest.param(name, *p.values, marks=p.marks, id=f"{name}-{p.id}")
    for name, op in (("RMSprop", "rmsprop_step_"), ("Adam", "adam_step_")) for p in _backends(op)
])
def test_bool_option_switched_on_later_starts_its_state_from_zeros(routed, backend, name):
    """RMSprop's centered and Adam's amsgrad, switched on for a group after the first
    step (torch raises a KeyError): the state they add starts from zeros."""
    served = routed(backend)
    B = 3
    flag, key = {"RMSprop": ("centered", "grad_avg"), "Adam": ("amsgrad", "max_exp_avg_sq")}[name]
    kwargs = {"RMSprop": dict(lr=0.01, momentum=0.5), "Adam": dict(lr=0.01)}[name]
    params = _params(B)
    models = [_copies(params, b) for b in range(B)]
    opt = getattr(hoptim, name)(params, **kwargs)
    refs = [getattr(torch.optim, name)(models[b], **{k: _f32(v) for k, v in kwargs.items()}) for b in range(B)]
    fill = _zero_state_where_torch_raises(key)
    for step in range(5):
        if step == 2:
            opt.param_groups[0][flag] = True
            for r in refs:
                r.param_groups[0][flag] = True
        grads = [torch.randn_like(p) for p in params]
        for p, g in zip(params, grads):
            p.grad = g
        opt.step()
        for b in range(B):
            for m, g in zip(models[b], grads):
                m.grad = g[b].clone()
            fill(refs[b])
            refs[b].step()
        _assert_follows(params, models, step)
    assert served


# ---- LARS ---------------------------------------------------------------------------

class _RefLARS:
    """One model's LARS (the paper's momentum, the learning rate inside the buffer), tensor
    by tensor, with torch.optim.SGD's rule for momentum 0: no buffer in use, left as it
    was. Its ``param_groups[0]["momentum"]`` is what the test switches."""

    def __init__(self, params, lr, momentum, weight_decay, trust_coefficient, eps):
        self.param_groups = [dict(params=params, lr=lr, momentum=momentum, weight_decay=weight_decay,
                                  trust_coefficient=trust_coefficient, eps=eps)]
        self.state = {p: {} for p in params}

    @torch.no_grad()
    def step(self):
        h = self.param_groups[0]
        for w in h["params"]:
            g = w.grad
            wn, gn = w.norm().item(), g.norm().item()
            local = h["trust_coefficient"] * wn / (gn + h["weight_decay"] * wn + h["eps"]) if wn > 0 and gn > 0 else 1.0
            d = g + h["weight_decay"] * w
            if h["momentum"] != 0:
                buf = self.state[w].setdefault("momentum_buffer", torch.zeros_like(w))
                buf.mul_(h["momentum"]).add_(h["lr"] * local * d)
                w.sub_(buf)
            else:
                w.sub_(h["lr"] * local * d)


@pytest.mark.parametrize("backend", _backends("lars_step_"))
@pytest.mark.parametrize("B", [1, 3])
@pytest.mark.parametrize("schedule", list(SGD_SCHEDULES))
def test_lars_momentum_switches_follow_the_reference(routed, backend, schedule, B):
    served = routed(backend)
    plan = _momentum_plan(SGD_SCHEDULES[schedule], B)
    hypers = dict(lr=[0.5 + 0.5 * b for b in range(B)], weight_decay=[0.01 * b for b in range(B)],
                  trust_coefficient=[1e-2 + 1e-2 * b for b in range(B)], eps=1e-8)
    params = _params(B)
    models = [_copies(params, b) for b in range(B)]
    opt = hoptim.LARS(params, momentum=[p[0] for p in plan], **hypers)
    refs = [_RefLARS(models[b], momentum=_f32(plan[b][0]),
                     **{k: _f32(v[b] if isinstance(v, list) else v) for k, v in hypers.items()})
            for b in range(B)]
    _run(opt, refs, params, models, plan, "set_hyperparameters",
         lambda step: _assert_follows(params, models, step, rtol=1e-5, atol=1e-5))
    assert served
    for b in range(B):
        for p, m in zip(params, models[b]):
            ref_buf = refs[b].state[m].get("momentum_buffer")
            ours = opt.state[p].get("momentum_buffer")
            if ref_buf is None:
                assert ours is None or not ours[b].any()  # never started: still the initial zeros
            else:
                torch.testing.assert_close(ours[b], ref_buf, rtol=1e-5, atol=1e-5)


# ---- the entries that change momentum ----------------------------------------------

@pytest.mark.parametrize("backend", _backends("sgd_step_"))
def test_in_place_edit_cannot_switch_momentum_on_for_a_group_without_it(routed, backend):
    """As documented: the step keeps no buffers for a group validated with every momentum
    at 0, so an in-place edit does not switch momentum on; set_hyperparameters does."""
    served = routed(backend)
    B = 3
    params = _params(B)
    plain = [p.detach().clone() for p in params]
    opt = hoptim.SGD(params, lr=0.1)
    opt.param_groups[0]["momentum"][1] = 0.9
    for step in range(2):
        grads = [torch.randn_like(p) for p in params]
        for p, g, q in zip(params, grads, plain):
            p.grad = g
            q -= _f32(0.1) * g
        opt.step()
        for p, q in zip(params, plain):
            torch.testing.assert_close(p.detach(), q, rtol=1e-6, atol=1e-7)
    assert all("momentum_buffer" not in opt.state[p] for p in params)
    # the entry that validates: model 1 starts its buffer from the next gradient
    models = [_copies(params, b) for b in range(B)]
    refs = [torch.optim.SGD(models[b], lr=_f32(0.1), momentum=_f32(0.9) if b == 1 else 0.0) for b in range(B)]
    opt.set_hyperparameters(1, momentum=0.9)
    _run(opt, refs, params, models, [{0: 0.9 if b == 1 else 0.0} for b in range(B)], "set_hyperparameters",
         lambda step: _assert_follows(params, models, step))
    assert served


@pytest.mark.parametrize("name", ["SGD", "RMSprop", "LARS"])
@pytest.mark.parametrize("value, error, match", [
    (-0.5, ValueError, r"momentum must be >= 0 for model 1, got -0\.5"),
    (float("nan"), ValueError, r"momentum must not be NaN for model 1, got nan"),
    (torch.tensor([-2.0]), ValueError, r"momentum must be >= 0 for model 1, got -2\.0"),
    ([0.9, 0.9], TypeError, r"momentum must be one number for model 1, got \[0\.9, 0\.9\]"),
    ("fast", TypeError, r"momentum must be one real number for model 1, got str 'fast'"),
    (True, TypeError, r"momentum must be one real number for model 1, got bool True"),
], ids=["negative", "nan", "negative_tensor", "list", "str", "bool"])
def test_set_hyperparameters_rejects_a_bad_momentum_naming_model_and_value(name, value, error, match):
    B = 3
    params = _params(B)
    opt = getattr(hoptim, name)(params, lr=0.1, momentum=[0.0, 0.5, 0.9])
    stored = opt.param_groups[0]["momentum"].clone()
    with pytest.raises(error, match=rf"{name}\.set_hyperparameters: {match}"):
        opt.set_hyperparameters(1, momentum=value)
    assert torch.equal(opt.param_groups[0]["momentum"], stored)


def test_set_hyperparameters_rejects_switching_nesterov_momentum_off():
    """Nesterov needs momentum for every model: switching one off names the model and its values."""
    opt = hoptim.SGD(_params(3), lr=0.1, momentum=0.9, nesterov=True)
    with pytest.raises(ValueError, match=r"Nesterov .* models \[2\] have momentum \[0\.0\] and dampening \[0\.0\]"):
        opt.set_hyperparameters(2, momentum=0.0)
    assert torch.equal(opt.param_groups[0]["momentum"], torch.full((3,), 0.9))
