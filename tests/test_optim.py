"""hfkern.optim's array optimizers against B separate torch.optim optimizers, one per
model, and the hfkern::*_step_ ops they call.

References get each model's hyperparameters rounded to float32, the precision the
array optimizer stores them in (float64 for float64 parameters), so that fp32
trajectories agree to rounding of the arithmetic alone.
"""

from __future__ import annotations

import inspect
import io
import math
import re

import pytest
import torch

import hfkern.optim as hoptim
from hfkern._dtypes import acc_dtype
from hfkern._optim_specs import ADAM_SPEC
from hfkern.ops import optim as ops

SHAPES = [(5, 3), (7,), (2, 3, 3, 1)]  # per-model parameter shapes of the first group
LATE_SHAPE = (4, 2)  # second group; its gradient starts late and skips a step
NAMES = ["SGD", "Adam", "AdamW", "Adagrad", "Adadelta", "RMSprop"]
STATE_KEYS = {  # torch's state keys, which the array optimizers keep ([B]-stacked)
    "SGD": {"momentum_buffer"},
    "Adam": {"step", "exp_avg", "exp_avg_sq"},
    "AdamW": {"step", "exp_avg", "exp_avg_sq"},
    "Adagrad": {"step", "sum"},
    "Adadelta": {"step", "square_avg", "acc_delta"},
    "RMSprop": {"step", "square_avg"},
}


def spread(lo, hi, B):
    """B distinct values from lo to hi (lo for B = 1)."""
    return [lo + (hi - lo) * b / max(B - 1, 1) for b in range(B)]


def _configs(B):
    s = lambda lo, hi: spread(lo, hi, B)  # noqa: E731
    first_zero = lambda lo, hi: [0.0] + s(lo, hi)[1:]  # noqa: E731  model 0 has none
    return {
        "SGD": {
            "nesterov": dict(lr=s(0.01, 0.05), momentum=s(0.3, 0.9), nesterov=True,
                             weight_decay=torch.tensor(s(0.001, 0.01))),
            "dampening_maximize": dict(lr=0.05, momentum=first_zero(0.5, 0.9), dampening=s(0.1, 0.4),
                                       weight_decay=1e-2, maximize=True),
        },
        "Adam": {
            "plain": dict(lr=s(1e-3, 3e-2), betas=(s(0.8, 0.9), s(0.99, 0.999)), eps=s(1e-8, 1e-6)),
            "weight_decay_amsgrad": dict(lr=torch.tensor(s(0.01, 0.03)), betas=(0.9, s(0.9, 0.999)),
                                         weight_decay=first_zero(0.01, 0.1), amsgrad=True),
            "zero_beta_maximize": dict(lr=s(0.01, 0.02), betas=(first_zero(0.5, 0.9), 0.99),
                                       maximize=True),
            "decoupled": dict(lr=s(0.01, 0.03), weight_decay=s(0.05, 0.2), decoupled_weight_decay=True),
        },
        "AdamW": {
            "default_decay": dict(lr=s(0.01, 0.03)),
            "amsgrad_maximize": dict(lr=s(0.005, 0.02),
                                     betas=(torch.tensor(s(0.85, 0.95)), torch.tensor(s(0.95, 0.999))),
                                     weight_decay=s(0.0, 0.3), amsgrad=True, maximize=True),
        },
        "Adagrad": {
            "plain": dict(lr=s(0.01, 0.1)),
            "decay_init_eps": dict(lr=s(0.05, 0.2), lr_decay=s(0.0, 0.1),
                                   initial_accumulator_value=s(0.0, 0.5), eps=s(1e-10, 1e-6)),
            "weight_decay_maximize": dict(lr=0.1, weight_decay=first_zero(0.01, 0.1), maximize=True),
        },
        "Adadelta": {
            "plain": dict(lr=s(0.5, 1.0), rho=s(0.8, 0.95)),
            "eps_weight_decay_maximize": dict(lr=s(0.1, 1.0), eps=s(1e-6, 1e-4),
                                              weight_decay=first_zero(0.01, 0.1), maximize=True),
        },
        "RMSprop": {
            "plain": dict(lr=s(0.001, 0.01), alpha=s(0.9, 0.99)),
            "momentum": dict(lr=s(0.001, 0.01), momentum=first_zero(0.5, 0.9), eps=s(1e-8, 1e-6)),
            "centered": dict(lr=s(0.001, 0.01), centered=True, weight_decay=s(0.0, 0.1)),
            "everything": dict(lr=s(0.001, 0.01), alpha=s(0.8, 0.99), momentum=s(0.3, 0.9),
                               centered=True, weight_decay=0.01, maximize=True),
        },
    }


def _feature_config(name, B=3):
    """One configuration per optimizer with its stateful options on."""
    s = lambda lo, hi: spread(lo, hi, B)  # noqa: E731
    return {
        "SGD": dict(lr=s(0.02, 0.1), momentum=s(0.5, 0.9), dampening=0.1, weight_decay=0.01),
        "Adam": dict(lr=s(0.01, 0.03), betas=(s(0.8, 0.9), s(0.95, 0.99)), weight_decay=0.01,
                     amsgrad=True),
        "AdamW": dict(lr=s(0.01, 0.03), betas=(0.9, s(0.95, 0.99))),
        "Adagrad": dict(lr=s(0.05, 0.1), lr_decay=0.05, initial_accumulator_value=0.1),
        "Adadelta": dict(lr=s(0.5, 1.0), rho=s(0.8, 0.95), weight_decay=0.01),
        "RMSprop": dict(lr=s(0.005, 0.01), momentum=0.5, centered=True),
    }[name]


def _value(v, b):
    if isinstance(v, torch.Tensor):
        return float(v[b]) if v.dim() else float(v)
    if isinstance(v, (list, tuple)):
        return float(v[b])
    return float(v)


def _round(x, dtype):
    return float(torch.tensor(x, dtype=torch.float64 if dtype == torch.float64 else torch.float32))


def _torch_kwargs(cfg, b, dtype=torch.float32, cls=None):
    """Model b's arguments for torch; with ``cls``, its defaults too (rounded like the rest)."""
    if cls is not None:
        defaults = {k: inspect.signature(cls).parameters[k].default for k in cls._hypers + cls._init_hypers}
        cfg = {**defaults, **cfg}
    out = {}
    for k, v in cfg.items():
        if isinstance(v, bool):
            out[k] = v
        elif k == "betas":
            out[k] = tuple(_round(_value(e, b), dtype) for e in v)
        else:
            out[k] = _round(_value(v, b), dtype)
    return out


def _expected_hyper(cls, cfg, key, B, dtype=torch.float32):
    value = cfg.get(key, inspect.signature(cls).parameters[key].default)
    return torch.tensor([_value(value, b) for b in range(B)], dtype=dtype)


def _assert_hypers_restored(opt, cls, cfg, B):
    group = opt.param_groups[0]
    for key in cls._hypers + cls._init_hypers:
        if key == "betas":
            default = inspect.signature(cls).parameters["betas"].default
            betas = cfg.get("betas", default)
            for i in range(2):
                expected = torch.tensor([_value(betas[i], b) for b in range(B)], dtype=torch.float32)
                torch.testing.assert_close(group["betas"][i], expected)
        else:
            torch.testing.assert_close(group[key], _expected_hyper(cls, cfg, key, B))
    for key in cls._flags:
        if cls is hoptim.AdamW and key == "decoupled_weight_decay":
            expected = True
        else:
            expected = cfg.get(key, inspect.signature(cls).parameters[key].default)
        assert group[key] is expected


def _reload(cls, opt, groups):
    """Save and serialize ``opt``'s state, load it into a new optimizer built with defaults."""
    buf = io.BytesIO()
    torch.save(opt.state_dict(), buf)
    buf.seek(0)
    saved = torch.load(buf)
    new = cls([{"params": g} for g in groups])
    new.load_state_dict(saved)
    return new


def _assert_state_close(opt, refs, arrays, per_model, name):
    """Every state entry torch keeps for model b equals slice b of ours."""
    for i, p in enumerate(arrays):
        for b, ref in enumerate(refs):
            ref_state = ref.state[per_model[b][i]]
            assert set(ref_state) <= set(opt.state[p]), (name, set(ref_state), set(opt.state[p]))
            for k, v in ref_state.items():
                ours = opt.state[p][k]
                if k == "step":
                    assert ours.shape == (len(refs),) and ours.dtype == torch.float32
                    assert float(ours[b]) == float(v), (k, b)
                else:
                    assert ours.shape == p.shape
                    atol = 1e-6 * float(v.abs().max())
                    torch.testing.assert_close(ours[b], v, rtol=1e-5, atol=atol,
                                               msg=lambda m: f"{name} state {k} model {b}: {m}")


def _grad_plan(step):
    """Whether the late group gets a gradient at ``step``: from 3 on, except 7."""
    return 3 <= step and step != 7


CASES = [(n, c) for n, cs in _configs(3).items() for c in cs]


@pytest.mark.parametrize("B", [1, 3])
@pytest.mark.parametrize("name, case", CASES)
def test_trajectory_matches_torch(name, case, B):
    cfg = _configs(B)[name][case]
    cls, ref_cls = getattr(hoptim, name), getattr(torch.optim, name)
    late_cfg = dict(lr=spread(0.02, 0.04, B))
    params = [torch.nn.Parameter(torch.randn(B, *s)) for s in SHAPES]
    late = torch.nn.Parameter(torch.randn(B, *LATE_SHAPE))
    models = [[torch.nn.Parameter(p[b].detach().clone()) for p in params] for b in range(B)]
    models_late = [torch.nn.Parameter(late[b].detach().clone()) for b in range(B)]
    opt = cls([{"params": params}, {"params": [late], **late_cfg}], **cfg)
    refs = [
        ref_cls([{"params": models[b]}, {"params": [models_late[b]], **_torch_kwargs(late_cfg, b)}],
                **_torch_kwargs(cfg, b, cls=cls))
        for b in range(B)
    ]
    for step in range(20):
        grads = [torch.randn_like(p) for p in params]
        late_grad = torch.randn_like(late) if _grad_plan(step) else None
        for p, g in zip(params, grads):
            p.grad = g.clone()
        late.grad = None if late_grad is None else late_grad.clone()
        for b in range(B):
            for p, g in zip(models[b], grads):
                p.grad = g[b].clone()
            models_late[b].grad = None if late_grad is None else late_grad[b].clone()
        opt.step()
        for r in refs:
            r.step()
        assert not opt.last_skipped.any()
        if step == 9:
            opt = _reload(cls, opt, [params, [late]])
            _assert_hypers_restored(opt, cls, cfg, B)
            torch.testing.assert_close(opt.param_groups[1]["lr"], torch.tensor(late_cfg["lr"]))
        for b in range(B):
            for p, ref in zip(params + [late], models[b] + [models_late[b]]):
                torch.testing.assert_close(p[b], ref, rtol=1e-5, atol=1e-6,
                                           msg=lambda m: f"step {step} model {b}: {m}")
    _assert_state_close(opt, refs, params + [late],
                        [models[b] + [models_late[b]] for b in range(B)], name)


@pytest.mark.parametrize("name", ["Adam", "RMSprop", "Adagrad"])
def test_float64_trajectory(name):
    B = 3
    cfg = _feature_config(name, B)
    cls, ref_cls = getattr(hoptim, name), getattr(torch.optim, name)
    p = torch.nn.Parameter(torch.randn(B, 4, 3, dtype=torch.float64))
    models = [torch.nn.Parameter(p[b].detach().clone()) for b in range(B)]
    opt = cls([p], **cfg)
    refs = [ref_cls([models[b]], **_torch_kwargs(cfg, b, torch.float64, cls=cls)) for b in range(B)]
    assert opt.param_groups[0]["lr"].dtype == torch.float64
    for _ in range(10):
        g = torch.randn_like(p)
        p.grad = g
        opt.step()
        for b in range(B):
            models[b].grad = g[b].clone()
            refs[b].step()
    for b in range(B):
        torch.testing.assert_close(p[b], models[b], rtol=1e-12, atol=1e-13)
    assert all(v.dtype == torch.float64 for k, v in opt.state[p].items() if k != "step")


def test_in_place_hyperparameter_edits_take_effect():
    """A scheduler writes into the stored [B] tensors; the next step uses the new values."""
    B = 3
    p = torch.nn.Parameter(torch.randn(B, 6))
    models = [torch.nn.Parameter(p[b].detach().clone()) for b in range(B)]
    opt = hoptim.Adam([p], lr=0.01, betas=(0.9, [0.99, 0.995, 0.999]))
    f32 = torch.float32
    refs = [torch.optim.Adam([models[b]], lr=0.01, betas=(_round(0.9, f32), _round([0.99, 0.995, 0.999][b], f32)))
            for b in range(B)]
    lr = opt.param_groups[0]["lr"]
    for step in range(6):
        if step == 3:
            new_lr, new_beta1 = [0.03, 0.002, 0.05], [0.5, 0.8, 0.7]
            opt.param_groups[0]["lr"].copy_(torch.tensor(new_lr))
            opt.param_groups[0]["betas"][0].copy_(torch.tensor(new_beta1))
            for r, a, b1 in zip(refs, new_lr, new_beta1):
                r.param_groups[0]["lr"] = _round(a, f32)
                r.param_groups[0]["betas"] = (_round(b1, f32), r.param_groups[0]["betas"][1])
        g = torch.randn_like(p)
        p.grad = g
        opt.step()
        for b in range(B):
            models[b].grad = g[b].clone()
            refs[b].step()
    assert opt.param_groups[0]["lr"] is lr  # not re-validated, not replaced
    for b in range(B):
        torch.testing.assert_close(p[b], models[b], rtol=1e-5, atol=1e-6)


def test_assigned_hyperparameters_are_validated_at_next_step():
    B = 3
    p = torch.nn.Parameter(torch.randn(B, 6))
    models = [torch.nn.Parameter(p[b].detach().clone()) for b in range(B)]
    opt = hoptim.RMSprop([p], lr=0.01)
    refs = [torch.optim.RMSprop([models[b]], lr=_round(0.01, torch.float32), alpha=_round(0.99, torch.float32))
            for b in range(B)]
    new = dict(weight_decay=[0.0, 0.1, 0.2], alpha=[0.9, 0.95, 0.5])  # switches weight decay on
    for step in range(5):
        if step == 2:
            opt.param_groups[0].update(new)
            for b, r in enumerate(refs):
                r.param_groups[0].update({k: _round(v[b], torch.float32) for k, v in new.items()})
        g = torch.randn_like(p)
        p.grad = g
        opt.step()
        for b in range(B):
            models[b].grad = g[b].clone()
            refs[b].step()
    assert isinstance(opt.param_groups[0]["weight_decay"], torch.Tensor)
    for b in range(B):
        torch.testing.assert_close(p[b], models[b], rtol=1e-5, atol=1e-6)


# ---- skipping models --------------------------------------------------------------

SKIP_PLAN = {0: {0}, 4: {1}, 5: {1}, 11: {1, 2}}  # step -> models skipped (model 0 at its first step)
POISON = [math.inf, math.nan, -math.inf]


def _snapshot(opt, params, b):
    out = [p[b].detach().clone() for p in params]
    for p in params:
        out += [v[b].clone() for _, v in sorted(opt.state[p].items())]
    return out


def _assert_bitwise(xs, ys, what):
    assert len(xs) == len(ys)
    for i, (x, y) in enumerate(zip(xs, ys)):
        assert torch.equal(x, y), f"{what}: tensor {i} differs"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("mode", ["mask", "nonfinite", "both"])
@pytest.mark.parametrize("name", NAMES)
def test_skipped_models_are_untouched(name, mode, dtype):
    """Poisoned models stay bit-identical, the others follow their clean trajectories
    exactly, and each model follows torch stepped on its own non-skipped steps."""
    B = 3
    cfg = _feature_config(name, B)
    cls, ref_cls = getattr(hoptim, name), getattr(torch.optim, name)
    init = [torch.randn(B, *s).to(dtype) for s in SHAPES]
    params = [torch.nn.Parameter(x.clone()) for x in init]
    masked = [torch.nn.Parameter(x.clone()) for x in init]  # clean gradients, same models skipped
    free = [torch.nn.Parameter(x.clone()) for x in init]  # clean gradients, nothing skipped
    models = [[torch.nn.Parameter(x[b].float()) for x in init] for b in range(B)]
    opt = cls(params, skip_nonfinite=mode != "mask", **cfg)
    opt_masked, opt_free = cls(masked, **cfg), cls(free, **cfg)
    refs = [ref_cls(models[b], **_torch_kwargs(cfg, b, cls=cls)) for b in range(B)]
    for step in range(20):
        grads = [torch.randn(B, *s).to(dtype) for s in SHAPES]
        skipped = SKIP_PLAN.get(step, set())
        poisoned = [g.clone() for g in grads]
        for b in skipped:
            if mode == "mask" or (mode == "both" and b == 0):
                for g in poisoned:  # masked models may hold anything
                    g[b] = math.nan
            else:
                poisoned[(step + b) % len(SHAPES)][b].view(-1)[b] = POISON[(step + b) % 3]
        skip_mask = torch.tensor([b in skipped for b in range(B)])
        explicit = None
        if mode == "mask":
            explicit = skip_mask
        elif mode == "both":
            explicit = torch.tensor([b == 0 and b in skipped for b in range(B)])
        before = {b: _snapshot(opt, params, b) for b in skipped}
        for p, g in zip(params, poisoned):
            p.grad = g
        for ps in (masked, free):
            for p, g in zip(ps, grads):
                p.grad = g.clone()
        opt.step(skip=explicit)
        opt_masked.step(skip=skip_mask)
        opt_free.step()
        assert torch.equal(opt.last_skipped, skip_mask), step
        for b in skipped:
            after = _snapshot(opt, params, b)
            if len(after) == len(before[b]):
                _assert_bitwise(after, before[b], f"step {step}: skipped model {b}")
            else:  # state started at this step: the skipped model's is still the initial one
                _assert_bitwise(after[:len(SHAPES)], before[b], f"step {step}: skipped model {b}")
                for p in params:
                    for k, v in opt.state[p].items():
                        init = _value(cfg.get("initial_accumulator_value", 0.0), b) if k == "sum" else 0.0
                        assert torch.equal(v[b], torch.full_like(v[b], init)), (step, k)
        # The whole array equals the run with clean gradients and the same models masked.
        _assert_bitwise([p.detach() for p in params], [p.detach() for p in masked], f"step {step}")
        for p, q in zip(params, masked):
            _assert_bitwise([v for _, v in sorted(opt.state[p].items())],
                            [v for _, v in sorted(opt_masked.state[q].items())], f"step {step} state")
        for b in range(B):
            if b not in skipped:
                for p, g in zip(models[b], grads):
                    p.grad = g[b].float()
                refs[b].step()
    # Model 2 was skipped only at step 11: before that it matched the unmasked run exactly;
    # a model that was never skipped still does at the end.
    never = [b for b in range(B) if not any(b in s for s in SKIP_PLAN.values())]
    for b in never:
        _assert_bitwise(_snapshot(opt, params, b), _snapshot(opt_free, free, b), f"model {b}")
    counts = [20 - sum(b in s for s in SKIP_PLAN.values()) for b in range(B)]
    if "step" in opt.state[params[0]]:
        assert opt.state[params[0]]["step"].tolist() == counts
    if dtype == torch.float32:
        for b in range(B):
            for p, ref in zip(params, models[b]):
                torch.testing.assert_close(p[b], ref, rtol=1e-5, atol=1e-6, msg=lambda m: f"model {b}: {m}")
        _assert_state_close(opt, refs, params, models, name)


def test_skip_mask_never_skipped_model_matches_unmasked_run():
    B = 4
    p = torch.nn.Parameter(torch.randn(B, 9))
    q = torch.nn.Parameter(p.detach().clone())
    opt, opt_free = hoptim.Adam([p], lr=0.01, amsgrad=True), hoptim.Adam([q], lr=0.01, amsgrad=True)
    init = p.detach().clone()
    for step in range(8):
        g = torch.randn_like(p)
        p.grad, q.grad = g.clone(), g.clone()
        opt.step(skip=torch.tensor([step % 2 == 0, False, True, False]))
        opt_free.step()
    for b in (1, 3):
        assert torch.equal(p[b], q[b])
        for k, v in opt.state[p].items():
            assert torch.equal(v[b], opt_free.state[q][k][b]), k
    assert torch.equal(p[2], init[2])  # always masked: never moved, state never started
    assert not opt.state[p]["exp_avg"][2].any() and not opt.state[p]["max_exp_avg_sq"][2].any()
    assert opt.state[p]["step"].tolist() == [4.0, 8.0, 0.0, 8.0]


def test_last_skipped_and_bad_skip_masks():
    B = 3
    p = torch.nn.Parameter(torch.randn(B, 4))
    opt = hoptim.SGD([p], lr=0.1, momentum=0.9, skip_nonfinite=True)
    assert opt.last_skipped is None
    p.grad = torch.randn_like(p)
    opt.step()
    assert torch.equal(opt.last_skipped, torch.zeros(B, dtype=torch.bool))
    mask = torch.tensor([False, True, False])
    opt.step(skip=mask)
    mask[0] = True  # the recorded mask is the optimizer's own
    assert opt.last_skipped.tolist() == [False, True, False]
    with pytest.raises(TypeError, match="bool tensor, got dtype torch.int64"):
        opt.step(skip=torch.tensor([0, 1, 0]))
    with pytest.raises(ValueError, match=r"shape \[B\]=\[3\], got \[2\]"):
        opt.step(skip=torch.tensor([True, False]))
    with pytest.raises(TypeError, match="got list"):
        opt.step(skip=[True, False, True])
    with pytest.raises(ValueError, match="parameters' device cpu, got meta"):
        opt.step(skip=torch.zeros(B, dtype=torch.bool, device="meta"))
    with pytest.raises(TypeError, match="skip_nonfinite must be a bool"):
        hoptim.Adam([p], skip_nonfinite=1)


# ---- low-precision parameters -----------------------------------------------------

@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("name", NAMES)
def test_low_precision_params_follow_fp32_master(name, dtype):
    B = 3
    cfg = _feature_config(name, B)
    cls, ref_cls = getattr(hoptim, name), getattr(torch.optim, name)
    params = [torch.nn.Parameter(torch.randn(B, *s).to(dtype)) for s in SHAPES]
    masters = [[torch.nn.Parameter(p[b].detach().float()) for p in params] for b in range(B)]
    opt = cls(params, **cfg)
    refs = [ref_cls(masters[b], **_torch_kwargs(cfg, b, cls=cls)) for b in range(B)]
    steps = 20
    for _ in range(steps):
        grads = [torch.randn(B, *s).to(dtype) for s in SHAPES]
        for p, g in zip(params, grads):
            p.grad = g
        opt.step()
        for b in range(B):
            for m, g in zip(masters[b], grads):
                m.grad = g[b].float()
            refs[b].step()
    # The array rounds its parameters every step, the masters never: the difference
    # is a random walk of one rounding (up to half an ulp) per step.
    tol = math.sqrt(steps) * torch.finfo(dtype).eps
    for p in params:
        assert p.dtype == dtype
        assert all(v.dtype == torch.float32 for v in opt.state[p].values())
    for b in range(B):
        for p, m in zip(params, masters[b]):
            torch.testing.assert_close(p[b].float(), m.detach(), rtol=tol, atol=tol,
                                       msg=lambda s: f"model {b}: {s}")


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("name", NAMES)
def test_low_precision_update_is_fp32_rounded_once(name, dtype):
    """A bf16/fp16 step equals the fp32 step from the same values, rounded once."""
    B = 3
    cfg = _feature_config(name, B)
    cls = getattr(hoptim, name)
    p = torch.nn.Parameter(torch.randn(B, 5, 7).to(dtype))
    opt = cls([p], **cfg)
    for _ in range(3):
        p.grad = torch.randn_like(p)
        opt.step()
    q = torch.nn.Parameter(p.detach().float())
    opt32 = cls([q], **cfg)
    opt32.load_state_dict(opt.state_dict())
    g = torch.randn_like(p)
    p.grad, q.grad = g, g.float()
    opt.step()
    opt32.step()
    assert torch.equal(p.detach(), q.detach().to(dtype))
    for k, v in opt.state[p].items():
        assert v.dtype == torch.float32
        assert torch.equal(v, opt32.state[q][k]), k


# ---- state dict -------------------------------------------------------------------

@pytest.mark.parametrize("name", NAMES)
def test_state_dict_moves_to_parameters_device_and_keeps_fp32_state(name):
    B = 3
    cfg = _feature_config(name, B)
    cls = getattr(hoptim, name)
    p = torch.nn.Parameter(torch.randn(B, 4, 2).to(torch.bfloat16))
    opt = cls([p], **cfg)
    for _ in range(2):
        p.grad = torch.randn_like(p)
        opt.step()
    sd = opt.state_dict()
    assert set(sd["state"][0]) >= STATE_KEYS[name]
    # The same parameters on another device (meta: no data, but a device of its own).
    on_meta = torch.nn.Parameter(torch.empty(B, 4, 2, dtype=torch.bfloat16, device="meta"))
    other = cls([on_meta])
    other.load_state_dict(sd)
    for k, v in other.state[on_meta].items():
        assert v.device.type == "meta", k
        assert v.dtype == torch.float32, k
    for k, v in other.param_groups[0].items():
        for t in v if isinstance(v, tuple) else (v,):
            if isinstance(t, torch.Tensor):
                assert t.device.type == "meta" and t.shape == (B,), k
    # Loading copies: the loaded optimizer does not share state with the saved one.
    again = cls([p])
    again.load_state_dict(sd)
    for k, v in again.state[p].items():
        assert torch.equal(v, opt.state[p][k]) and v.data_ptr() != opt.state[p][k].data_ptr()
    p.grad = torch.randn_like(p)
    before = {k: v.clone() for k, v in opt.state[p].items()}
    again.step()
    for k, v in opt.state[p].items():
        assert torch.equal(v, before[k])


def test_load_rejects_state_of_another_array_size():
    p = torch.nn.Parameter(torch.randn(3, 4))
    opt = hoptim.Adam([p])
    p.grad = torch.randn_like(p)
    opt.step()
    q = torch.nn.Parameter(torch.randn(2, 4))
    with pytest.raises(ValueError, match=r"loaded state '\w+' of shape \[3\S*\] does not fit a parameter of shape \[2, 4\]"):
        hoptim.Adam([q]).load_state_dict(opt.state_dict())
    del opt.state[p]  # without state, the hyperparameters' length is what does not fit
    with pytest.raises(ValueError, match="length B=2"):
        hoptim.Adam([q]).load_state_dict(opt.state_dict())


@pytest.mark.parametrize("name,dropped", [("Adam", "step"), ("Adam", "exp_avg"), ("RMSprop", "square_avg"),
                                          ("Adagrad", "step"), ("Adadelta", "acc_delta")])
def test_load_refuses_a_started_state_with_an_entry_missing(name, dropped):
    """A missing entry would start from zeros beside the others' history (a step count of 0 beside
    moments of many steps): refused, naming it, and nothing changes. Entries kept only where a value
    switches them on may be missing (switched on since the last step, the next step starts them)."""
    p = torch.nn.Parameter(torch.randn(3, 4))
    opt = getattr(hoptim, name)([p], lr=0.1)
    p.grad = torch.randn_like(p)
    opt.step()
    sd = opt.state_dict()
    del sd["state"][0][dropped]
    q = torch.nn.Parameter(torch.randn(3, 4))
    other = getattr(hoptim, name)([q], lr=0.1)
    q.grad = torch.randn_like(q)
    other.step()
    before = {k: v.clone() for k, v in other.state[q].items()}
    with pytest.raises(ValueError, match=rf"state of parameter 0 has .* but not \['{dropped}'\]"):
        other.load_state_dict(sd)
    assert {k: v for k, v in other.state[q].items()}.keys() == before.keys()
    for k, v in other.state[q].items():
        assert torch.equal(v, before[k])


def test_load_takes_a_state_whose_switched_on_entry_starts_next_step():
    """amsgrad switched on after a step and saved before the next: the maximum is not there yet,
    and loading the state gives what continuing would have given."""
    p = torch.nn.Parameter(torch.randn(3, 4))
    opt = hoptim.Adam([p], lr=0.1)
    p.grad = torch.randn_like(p)
    opt.step()
    opt.param_groups[0]["amsgrad"] = True
    sd = opt.state_dict()
    assert "max_exp_avg_sq" not in sd["state"][0]
    q = torch.nn.Parameter(p.detach().clone())
    other = hoptim.Adam([q], lr=0.1, amsgrad=True)
    other.load_state_dict(sd)
    p.grad = q.grad = torch.randn_like(p)
    opt.step()
    other.step()
    assert torch.equal(p, q)


def test_sgd_loads_momentum_buffer_without_step_count():
    """A momentum buffer saved without a count has been started for every model."""
    B = 3
    p = torch.nn.Parameter(torch.randn(B, 5))
    opt = hoptim.SGD([p], lr=0.1, momentum=0.9, dampening=0.5)
    p.grad = torch.randn_like(p)
    opt.step()
    sd = opt.state_dict()
    del sd["state"][0]["step"]
    other = hoptim.SGD([p], lr=0.1)
    other.load_state_dict(sd)
    buf = other.state[p]["momentum_buffer"].clone()
    p.grad = torch.randn_like(p)
    other.step()
    torch.testing.assert_close(other.state[p]["momentum_buffer"], 0.9 * buf + 0.5 * p.grad)
    assert other.state[p]["step"].tolist() == [2.0, 2.0, 2.0]


def test_closure_zero_grad_and_param_groups():
    B = 2
    p = torch.nn.Parameter(torch.randn(B, 3))
    q = torch.nn.Parameter(torch.randn(B, 2))
    opt = hoptim.Adagrad([{"params": [p]}, {"params": [q], "lr": [0.0, 0.0]}], lr=[0.1, 0.2])
    before = q.detach().clone()

    def closure():
        opt.zero_grad()
        loss = (p ** 2).sum(dim=1) + (q ** 2).sum(dim=1)
        loss.sum().backward()
        return loss

    loss = opt.step(closure)
    assert loss.shape == (B,)
    assert torch.equal(q.detach(), before)  # its group's learning rates are 0
    assert opt.state[q]["step"].tolist() == [1.0, 1.0]
    opt.zero_grad()
    assert p.grad is None and q.grad is None


# ---- validation --------------------------------------------------------------------

def _numeric_hypers(name):
    cls = getattr(hoptim, name)
    return [k for k in cls._hypers + cls._init_hypers if k != "betas"]


BAD_VALUES = [([0.1, 0.2], "length B=3"), (torch.ones(4), "length B=3"), (-0.1, ">= 0"),
              ([0.1, -1.0, 0.2], ">= 0"), (math.nan, "NaN"), (torch.tensor([0.1, math.nan, 0.1]), "NaN")]


@pytest.mark.parametrize("value, match", BAD_VALUES)
@pytest.mark.parametrize("name, key", [(n, k) for n in NAMES for k in _numeric_hypers(n)])
def test_bad_hyperparameters_rejected(name, key, value, match):
    cls = getattr(hoptim, name)
    p = torch.nn.Parameter(torch.randn(3, 2))
    with pytest.raises(ValueError, match=match) as info:
        cls([p], **{key: value})
    assert key in str(info.value) and name in str(info.value)
    # The same value assigned later is rejected at the next step, before any update.
    opt = cls([p])
    opt.param_groups[0][key] = value
    p.grad = torch.randn_like(p)
    before = p.detach().clone()
    with pytest.raises(ValueError, match=match):
        opt.step()
    assert torch.equal(p.detach(), before)
    assert not opt.state[p]


@pytest.mark.parametrize("name", ["Adam", "AdamW"])
@pytest.mark.parametrize(
    "betas, match",
    [((0.9,), "betas must be a pair"), ((0.9, 0.99, 0.999), "betas must be a pair"),
     (0.9, "betas must be a pair"), ((0.9, 1.0), r"betas\[1\] must be < 1"),
     (([0.9, 1.2, 0.9], 0.99), r"betas\[0\] must be < 1"), ((-0.1, 0.99), r"betas\[0\] must be >= 0"),
     (([0.9, 0.9], 0.99), r"betas\[0\] must have one value per model"),
     ((0.9, torch.tensor([0.9, math.nan, 0.9])), r"betas\[1\] must not be NaN")],
)
def test_bad_betas_rejected(name, betas, match):
    cls = getattr(hoptim, name)
    p = torch.nn.Parameter(torch.randn(3, 2))
    with pytest.raises(ValueError, match=match):
        cls([p], betas=betas)
    opt = cls([p])
    opt.param_groups[0]["betas"] = betas
    p.grad = torch.randn_like(p)
    with pytest.raises(ValueError, match=match):
        opt.step()


def test_bad_rho_and_flags_rejected():
    p = torch.nn.Parameter(torch.randn(3, 2))
    with pytest.raises(ValueError, match="rho must be <= 1.0 for every model"):
        hoptim.Adadelta([p], rho=[0.9, 1.5, 0.9])
    hoptim.Adadelta([p], rho=1.0)  # torch accepts rho = 1
    for cls, flag in [(hoptim.Adam, "amsgrad"), (hoptim.RMSprop, "centered"), (hoptim.Adagrad, "maximize"),
                      (hoptim.SGD, "nesterov")]:
        with pytest.raises(TypeError, match=f"{flag} must be a bool"):
            cls([p], **{flag: 1})


def test_bad_parameters_and_groups_rejected():
    with pytest.raises(ValueError, match=r"same leading \(array\) dim B=3, got shape \[4, 2\]"):
        hoptim.Adam([torch.nn.Parameter(torch.randn(3, 2)), torch.nn.Parameter(torch.randn(4, 2))])
    with pytest.raises(ValueError, match="0-d"):
        hoptim.RMSprop([torch.nn.Parameter(torch.tensor(1.0))])
    with pytest.raises(TypeError, match="floating-point parameters"):
        hoptim.Adagrad([torch.zeros(3, 2, dtype=torch.int64)])
    with pytest.raises(ValueError, match="one device, got cpu and meta"):
        hoptim.Adadelta([torch.nn.Parameter(torch.randn(3, 2)),
                         torch.nn.Parameter(torch.empty(3, 2, device="meta"))])
    p, q = (torch.nn.Parameter(torch.randn(3, 2)) for _ in range(2))
    opt = hoptim.AdamW([p])
    with pytest.raises(ValueError, match="weight_decay"):
        opt.add_param_group({"params": [q], "weight_decay": [0.1, 0.1]})
    with pytest.raises(ValueError, match="B=3"):
        opt.add_param_group({"params": [torch.nn.Parameter(torch.randn(2, 2))]})
    assert len(opt.param_groups) == 1
    opt.add_param_group({"params": [q], "lr": [0.1, 0.2, 0.3]})
    assert opt.param_groups[1]["lr"].shape == (3,)


# ---- GradScaler ---------------------------------------------------------------------

@pytest.mark.parametrize("name", NAMES)
def test_grad_scaler_matches_torch(name):
    B = 3
    cfg = _feature_config(name, B)
    cls, ref_cls = getattr(hoptim, name), getattr(torch.optim, name)
    x = torch.randn(6, 5)
    w = torch.nn.Parameter(torch.randn(B, 5, 4))
    models = [torch.nn.Parameter(w[b].detach().clone()) for b in range(B)]
    opt = cls([w], **cfg)
    refs = [ref_cls([models[b]], **_torch_kwargs(cfg, b, cls=cls)) for b in range(B)]
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 8, growth_interval=2)
    scalers = [torch.amp.GradScaler("cpu", init_scale=2.0 ** 8, growth_interval=2) for _ in range(B)]
    for _ in range(6):
        target = torch.randn(B, 6, 4)
        losses = ((x @ w - target) ** 2).mean(dim=(1, 2))
        opt.zero_grad()
        scaler.scale(losses.sum()).backward()
        scaler.step(opt)
        scaler.update()
        for b in range(B):
            loss = ((x @ models[b] - target[b]) ** 2).mean()
            refs[b].zero_grad()
            scalers[b].scale(loss).backward()
            scalers[b].step(refs[b])
            scalers[b].update()
            torch.testing.assert_close(losses[b], loss, rtol=1e-5, atol=1e-6)
    assert scaler.get_scale() == scalers[0].get_scale() == 2.0 ** 11
    for b in range(B):
        torch.testing.assert_close(w[b], models[b], rtol=1e-5, atol=1e-6)
    # An inf in one model makes torch's scaler skip the whole step and back off.
    before = w.detach().clone()
    state = {k: v.clone() for k, v in opt.state[w].items()}
    opt.zero_grad()
    scaler.scale(((x @ w) ** 2).mean(dim=(1, 2)).sum()).backward()
    w.grad[1, 0, 0] = math.inf
    scaler.step(opt)
    scaler.update()
    assert torch.equal(w.detach(), before)
    assert all(torch.equal(v, state[k]) for k, v in opt.state[w].items())
    assert scaler.get_scale() == 2.0 ** 10


# ---- no host synchronization ---------------------------------------------------------

@pytest.mark.parametrize("name", NAMES)
def test_step_reads_no_device_value(name):
    """On meta tensors any host read of a device value raises: the optimizer's step
    (validation cached, skip handling, non-finite detection) and the torch
    implementation of its op run without one."""
    B = 3
    cls = getattr(hoptim, name)
    params = [torch.nn.Parameter(torch.empty(B, *s, device="meta")) for s in SHAPES]
    opt = cls(params, skip_nonfinite=True, **_feature_config(name, B))
    for _ in range(2):
        for p in params:
            p.grad = torch.empty_like(p)
        opt.step(skip=torch.zeros(B, dtype=torch.bool, device="meta"))
    assert opt.last_skipped.device.type == "meta"
    # The custom op runs its fake kernel on meta; call the torch implementation itself.
    fn = {"SGD": ops.sgd_step_torch, "AdamW": ops.adam_step_torch, "Adam": ops.adam_step_torch,
          "Adagrad": ops.adagrad_step_torch, "Adadelta": ops.adadelta_step_torch,
          "RMSprop": ops.rmsprop_step_torch}[name]
    for skip in (None, torch.zeros(B, dtype=torch.bool, device="meta")):
        args = _op_args(name, torch.bfloat16, skip, device="meta")
        fn(*args)
    ops.nonfinite_models_torch([p.grad for p in params])


@pytest.mark.gpu
@pytest.mark.parametrize("name", NAMES)
def test_cuda_step_does_not_synchronize(name):
    B = 4
    cls = getattr(hoptim, name)
    params = [torch.nn.Parameter(torch.randn(B, *s, device="cuda")) for s in SHAPES]
    params.append(torch.nn.Parameter(torch.randn(B, 6, device="cuda", dtype=torch.bfloat16)))
    opt = cls(params, skip_nonfinite=True, **_feature_config(name, B))
    for g in opt.param_groups[0].values():
        for t in g if isinstance(g, tuple) else (g,):
            if isinstance(t, torch.Tensor):
                assert t.device.type == "cuda"
    for p in params:
        p.grad = torch.randn_like(p)
    skip = torch.tensor([False, True, False, False], device="cuda")
    opt.step()  # creates state
    torch.cuda.set_sync_debug_mode("error")
    try:
        for _ in range(3):
            opt.step(skip=skip)
            opt.param_groups[0]["lr"].mul_(0.5)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    torch.cuda.synchronize()
    assert opt.last_skipped.tolist() == [False, True, False, False]


@pytest.mark.gpu
@pytest.mark.parametrize("name", NAMES)
def test_cuda_load_state_dict_moves_to_cuda(name):
    B = 3
    cls = getattr(hoptim, name)
    p = torch.nn.Parameter(torch.randn(B, 4))
    opt = cls([p], **_feature_config(name, B))
    p.grad = torch.randn_like(p)
    opt.step()
    q = torch.nn.Parameter(p.detach().cuda())
    other = cls([q])
    other.load_state_dict(opt.state_dict())
    assert all(v.is_cuda for v in other.state[q].values())
    q.grad = p.grad.cuda()
    opt.step()
    other.step()
    torch.testing.assert_close(q.cpu(), p.detach(), rtol=1e-5, atol=1e-6)


# ---- the ops --------------------------------------------------------------------------

def _op_args(name, dtype=torch.float32, skip=None, option=True, device="cpu"):
    """Arguments of the op behind optimizer ``name``: two parameters, state in the state dtype."""
    B = 3
    params = [torch.randn(B, 4, 3, device=device).to(dtype), torch.randn(B, 5, device=device).to(dtype)]
    grads = [torch.randn_like(p) for p in params]
    sdt = acc_dtype(dtype)

    def state(lo=0.0):
        return [torch.rand(p.shape, dtype=sdt, device=device) + lo for p in params]

    steps = [torch.tensor([0.0, 3.0, 1.0], device=device), torch.tensor([2.0, 2.0, 0.0], device=device)]
    hdt = torch.float64 if dtype == torch.float64 else torch.float32

    def hypers(n):
        return (torch.rand(n, B, dtype=hdt, device=device) * 0.5 + 0.1)

    if name == "SGD":
        bufs, st = (state(), steps) if option else ([], [])
        return (params, grads, bufs, st, hypers(4), option, True, True, skip)
    if name in ("Adam", "AdamW"):
        return (params, grads, state(), state(), state() if option else [], steps, hypers(5),
                option, False, name == "AdamW", True, skip)
    if name == "Adagrad":
        return (params, grads, state(), steps, hypers(4), option, True, skip)
    if name == "Adadelta":
        return (params, grads, state(), state(), steps, hypers(4), option, True, skip)
    if name == "RMSprop":
        grad_avgs = [g * 0.1 for g in state()] if option else []
        return (params, grads, state(1.0), grad_avgs, state() if option else [], steps, hypers(5),
                option, False, True, skip)
    raise AssertionError(name)


OPS = {"SGD": ops.sgd_step_, "Adam": ops.adam_step_, "AdamW": ops.adam_step_,
       "Adagrad": ops.adagrad_step_, "Adadelta": ops.adadelta_step_, "RMSprop": ops.rmsprop_step_}
OPCHECK_UTILS = ("test_schema", "test_faketensor", "test_aot_dispatch_dynamic")


@pytest.mark.parametrize(
    "dtype, masked, option",
    [(torch.float32, False, True), (torch.bfloat16, True, False), (torch.float64, True, True)],
)
@pytest.mark.parametrize("name", NAMES)
def test_opcheck(name, dtype, masked, option):
    skip = torch.tensor([False, True, False]) if masked else None
    torch.library.opcheck(OPS[name], _op_args(name, dtype, skip, option), test_utils=OPCHECK_UTILS)


def test_opcheck_nonfinite_models():
    grads = [torch.randn(3, 4, 2), torch.randn(3), torch.randn(3, 0)]
    grads[0][2, 1, 1] = math.nan
    grads[1][0] = -math.inf
    torch.library.opcheck(ops.nonfinite_models, (grads,), test_utils=OPCHECK_UTILS)
    assert ops.nonfinite_models(grads).tolist() == [True, False, True]
    big = torch.full((2, 8), 6e4, dtype=torch.float16)  # finite, though its sum is not
    assert ops.nonfinite_models([big]).tolist() == [False, False]


@pytest.mark.parametrize("name", NAMES)
def test_op_masked_models_bit_identical(name):
    """The op alone: a masked model's slices stay bit-identical, whatever its gradient holds."""
    args = _op_args(name, torch.bfloat16, torch.tensor([False, True, False]))
    for g in args[1]:
        g[1] = math.nan
    tensors = [t for i, a in enumerate(args) if isinstance(a, list) and i != 1 for t in a]
    before = [t[1].clone() for t in tensors]
    OPS[name](*args)
    for t, b in zip(tensors, before):
        assert torch.equal(t[1], b)
    assert not any(torch.isnan(t).any() for t in tensors)


@pytest.mark.parametrize("name", NAMES)
def test_hyper_table_rows_follow_the_op_declaration(name):
    """The optimizer's [R, B] table holds each row of its op's declaration, by name, and the
    op's check names those rows."""
    cls = getattr(hoptim, name)
    spec = cls._spec
    assert cls._hypers == spec.group_keys and set(cls._state_names) == {"step"} | {k for _, k, _ in spec.states}
    B = 3
    # distinct values per row and model, valid for every row (below 1, above 0)
    values = {row: [0.01 * (i + 1) + 0.001 * b for b in range(B)] for i, row in enumerate(spec.rows)}
    kwargs = {}
    for key in spec.group_keys:
        pair = spec.pair(key)
        kwargs[key] = tuple(values[r] for r in pair) if pair else values[key]
    p = torch.nn.Parameter(torch.randn(B, 2))
    opt = cls([p], **kwargs)
    table = opt._check_group(opt.param_groups[0]).hypers
    assert table.shape == (len(spec.rows), B)
    for row in spec.rows:
        torch.testing.assert_close(table[spec.row(row)], torch.tensor(values[row]))
    op = getattr(ops, spec.op)
    args = list(_op_args(name))
    args[spec.args.index("hypers")] = torch.rand(len(spec.rows) + 1, B)
    with pytest.raises(ValueError, match=re.escape(f"rows {list(spec.rows)}")):
        op(*args)


def test_ops_check_their_arguments():
    args = list(_op_args("Adam"))
    bad = list(args)
    bad[1] = args[1][:1]
    with pytest.raises(ValueError, match="expected 2 grads"):
        ops.adam_step_(*bad)
    bad = list(args)
    bad[6] = torch.rand(4, 3)
    with pytest.raises(ValueError, match=r"hypers of shape \[5, 3\]"):
        ops.adam_step_(*bad)
    bad[6] = args[6].double()  # float64 hyperparameters are for all-float64 parameters only
    with pytest.raises(TypeError, match=r"float64 hypers with \['torch.float32'\] parameters"):
        ops.adam_step_(*bad)
    bad = list(args)
    bad[4] = []  # amsgrad without its state
    with pytest.raises(ValueError, match="max_exp_avg_sqs to hold 2 tensors"):
        ops.adam_step_(*bad)
    bad = list(args)
    bad[2] = [t.double() for t in args[2]]
    with pytest.raises(ValueError, match=r"exp_avgs\[0\] of shape \[3, 4, 3\] and dtype torch.float32"):
        ops.adam_step_(*bad)
    bad = list(args)
    bad[-1] = torch.tensor([1, 0, 0])
    with pytest.raises(ValueError, match="skip of shape"):
        ops.adam_step_(*bad)
    sgd = list(_op_args("SGD", option=False))
    sgd[3] = _op_args("SGD")[3]  # step counts without momentum buffers
    with pytest.raises(ValueError, match="steps to hold 0 tensors"):
        ops.sgd_step_(*sgd)


@pytest.mark.parametrize("eager", [True, False], ids=["direct", "dispatched"])
def test_ops_name_the_tensor_that_does_not_fit(eager):
    # Every list is compared with the parameters at once; a mismatch at any index is
    # named with its list, index and what was expected, and nothing is updated. The
    # optimizers call the implementation directly in eager mode and the op under
    # dispatched_ops(): both check.
    args = _op_args("Adam")
    before = [t.clone() for t in args[0]]

    def replaced(pos, i, t):
        bad = list(args)
        bad[pos] = list(args[pos])
        bad[pos][i] = t
        return bad

    p1 = args[0][1]
    cases = [
        (replaced(0, 1, torch.randn(4, 5)), ValueError, r"parameter of shape \[B=3, \.\.\.\], got \[4, 5\] at index 1"),
        (replaced(0, 1, torch.randint(3, p1.shape)), TypeError, "floating-point parameter, got torch.int64 at index 1"),
        (replaced(1, 1, p1.double()), ValueError, r"grads\[1\] of shape \[3, 5\] and dtype torch.float32"),
        (replaced(1, 1, torch.randn(3, 6)), ValueError, r"grads\[1\] of shape \[3, 5\].*got \[3, 6\]"),
        (replaced(3, 1, torch.rand(3, 6)), ValueError, r"exp_avg_sqs\[1\] of shape \[3, 5\]"),
        (replaced(4, 1, torch.rand(3, 5, dtype=torch.float64)), ValueError,
         r"max_exp_avg_sqs\[1\] .*got \[3, 5\] torch.float64"),
        (replaced(5, 1, torch.zeros(3, dtype=torch.int32)), ValueError, r"steps\[1\] of shape \[3\] and dtype float32"),
        (replaced(5, 1, torch.zeros(4)), ValueError, r"steps\[1\] of shape \[3\]"),
    ]
    call = (lambda a: ops.run_step(ADAM_SPEC, *a)) if eager else (lambda a: ops.adam_step_(*a))
    for bad, error, message in cases:
        with pytest.raises(error, match=message):
            call(bad)
    for p, b in zip(args[0], before):
        assert torch.equal(p, b)


@pytest.mark.parametrize("name, kwargs", [
    ("SGD", dict(lr=[0.1, 0.2, 0.05], momentum=0.9, dampening=0.3, weight_decay=1e-2)),
    ("Adam", dict(lr=[1e-2, 2e-2, 5e-3])),
    ("Adagrad", dict(lr=0.1, lr_decay=0.1)),
    ("LARS", dict(lr=0.1, momentum=0.9, weight_decay=1e-3)),
    ("LARS", dict(lr=0.1, momentum=0.9, weight_decay=1e-3, exclude_1d=True)),
    ("LAMB", dict(lr=1e-2, weight_decay=1e-2)),
    ("LAMB", dict(lr=1e-2, weight_decay=1e-2, exclude_1d=True)),
])
def test_a_step_does_not_depend_on_the_order_of_parameters(name, kwargs):
    # The per-(parameter, model) factors (bias corrections, first momentum updates, trust
    # ratios) are kept rank by rank: parameters of interleaved ranks, skipped by turns so
    # that their step counts differ, update bit for bit as they do in another order.
    torch.manual_seed(5)
    shapes = [(3, 5), (3, 2, 2, 2), (3, 4), (3, 2, 3), (3, 1, 2, 3), (3, 6)]
    init = [torch.randn(s) for s in shapes]
    steps = [[torch.randn(s) if (k + i) % 3 else None for i, s in enumerate(shapes)] for k in range(4)]
    order = [3, 0, 5, 1, 4, 2]
    results = []
    for perm in (list(range(len(shapes))), order):
        params = [torch.nn.Parameter(init[i].clone()) for i in perm]
        opt = getattr(hoptim, name)(params, **kwargs)
        for grads in steps:
            for p, i in zip(params, perm):
                p.grad = None if grads[i] is None else grads[i].clone()
            opt.step()
        results.append({i: p.detach() for p, i in zip(params, perm)})
    for i in range(len(shapes)):
        assert torch.equal(results[0][i], results[1][i]), i


@pytest.mark.parametrize("make", [
    lambda ps: hoptim.Adam(ps, lr=[0.1, 0.2, 0.3], amsgrad=True),
    lambda ps: hoptim.AdamW(ps, lr=[0.1, 0.2, 0.3]),
    lambda ps: hoptim.RMSprop(ps, lr=[0.1, 0.2, 0.3], centered=True, momentum=0.5),
])
def test_group_mixing_float64_and_float32_params(make):
    # Each parameter's trajectory does not depend on the others in its group.
    torch.manual_seed(3)
    init = [torch.randn(3, 4, dtype=torch.float64), torch.randn(3, 5)]
    grads = [[torch.randn_like(t) for t in init] for _ in range(4)]
    mixed = [torch.nn.Parameter(t.clone()) for t in init]
    alone = [torch.nn.Parameter(t.clone()) for t in init]
    opt_mixed = make(mixed)
    opts_alone = [make([p]) for p in alone]
    for step_grads in grads:
        for p, q, g in zip(mixed, alone, step_grads):
            p.grad, q.grad = g.clone(), g.clone()
        opt_mixed.step()
        for o in opts_alone:
            o.step()
    # a mixed group keeps float32 hyperparameters, a float64-only one float64
    for p, q in zip(mixed, alone):
        torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-5)
