"""Array LARS and LAMB against straightforward per-tensor, per-model implementations.

The references below update one model's tensors one at a time with plain torch
ops, exactly as the papers' algorithms read (LARS: You, Gitman and Ginsburg
2017, Algorithm 1 with the momentum inside the buffer; LAMB: You et al. 2019,
Algorithm 2), keeping float32 state and rounding a bfloat16 parameter once per
step. Model b of the array optimizer must follow the reference run on model b
alone, with model b's hyperparameters.
"""

from __future__ import annotations

import copy
import math

import pytest
import torch

import hfkern.optim as hoptim
from hfkern.ops import optim as ops
from hfkern.optim.lr_scheduler import LambdaLR

# per-model shapes: a [B] scalar, a bias, a small odd matrix, a 4-d conv weight
SHAPES = [(), (7,), (5, 3), (4, 3, 2, 2)]


def spread(lo, hi, B):
    return [lo + (hi - lo) * b / max(B - 1, 1) for b in range(B)]


class RefLARS:
    """One model's LARS, tensor by tensor."""

    def __init__(self, params, lr, momentum, weight_decay, trust_coefficient, eps, exclude_1d, maximize):
        self.params = params  # this model's tensors (their dtype), updated in place
        self.h = dict(lr=lr, momentum=momentum, wd=weight_decay, tc=trust_coefficient, eps=eps)
        self.exclude_1d, self.maximize = exclude_1d, maximize
        self.bufs = [torch.zeros_like(w, dtype=torch.float32) for w in params]

    def step(self, grads):
        h = self.h
        for w, grad, buf in zip(self.params, grads, self.bufs):
            w32, g = w.float(), grad.float()
            if self.maximize:
                g = -g
            if self.exclude_1d and w.dim() <= 1:
                local = 1.0
            else:
                wn, gn = w32.norm().item(), g.norm().item()
                local = h["tc"] * wn / (gn + h["wd"] * wn + h["eps"]) if wn > 0 and gn > 0 else 1.0
                g = g + h["wd"] * w32
            buf.mul_(h["momentum"]).add_(h["lr"] * local * g)
            w.copy_(w32 - buf)


class RefLAMB:
    """One model's LAMB, tensor by tensor."""

    def __init__(self, params, lr, betas, eps, weight_decay, norm_bounds, bias_correction, exclude_1d, maximize):
        self.params = params
        self.h = dict(lr=lr, beta1=betas[0], beta2=betas[1], eps=eps, wd=weight_decay,
                      lo=norm_bounds[0], hi=norm_bounds[1])
        self.bias_correction, self.exclude_1d, self.maximize = bias_correction, exclude_1d, maximize
        self.m = [torch.zeros_like(w, dtype=torch.float32) for w in params]
        self.v = [torch.zeros_like(w, dtype=torch.float32) for w in params]
        self.t = 0

    def step(self, grads):
        h = self.h
        self.t += 1
        for w, grad, m, v in zip(self.params, grads, self.m, self.v):
            w32, g = w.float(), grad.float()
            if self.maximize:
                g = -g
            m.mul_(h["beta1"]).add_((1 - h["beta1"]) * g)
            v.mul_(h["beta2"]).add_((1 - h["beta2"]) * g * g)
            m_hat, v_hat = m, v
            if self.bias_correction:
                m_hat = m / (1 - h["beta1"] ** self.t)
                v_hat = v / (1 - h["beta2"] ** self.t)
            r = m_hat / (v_hat.sqrt() + h["eps"])
            if self.exclude_1d and w.dim() <= 1:
                ratio = 1.0
            else:
                r = r + h["wd"] * w32
                wn, rn = w32.norm().item(), r.norm().item()
                ratio = min(max(wn, h["lo"]), h["hi"]) / rn if wn > 0 and rn > 0 else 1.0
            w.copy_(w32 - h["lr"] * ratio * r)


def lars_hypers(B, wd):
    momentum = spread(0.5, 0.9, B)
    momentum[0] = 0.0  # a model without momentum among models with it
    return dict(lr=spread(0.5, 2.0, B), momentum=momentum, weight_decay=spread(1e-3, 5e-2, B) if wd else 0.0,
                trust_coefficient=spread(1e-3, 2e-2, B), eps=spread(1e-8, 1e-6, B))


def lamb_hypers(B, wd, bounds):
    return dict(lr=spread(0.01, 0.03, B), betas=(spread(0.8, 0.9, B), spread(0.95, 0.999, B)),
                eps=spread(1e-6, 1e-4, B), weight_decay=spread(0.01, 0.1, B) if wd else 0.0,
                norm_bounds=(spread(0.0, 1.0, B), spread(3.0, 50.0, B)) if bounds else (0.0, math.inf))


def model_value(value, b):
    if isinstance(value, tuple):
        return tuple(model_value(v, b) for v in value)
    return value[b] if isinstance(value, list) else value


def make(kind, B, hypers, flags, dtype=torch.float32, shapes=SHAPES, params=None):
    """The array optimizer on fresh [B, ...] parameters, and per-model references on copies."""
    if params is None:
        params = [torch.randn(B, *s).to(dtype).requires_grad_() for s in shapes]
    cls, ref = (hoptim.LARS, RefLARS) if kind == "lars" else (hoptim.LAMB, RefLAMB)
    opt = cls(params, **hypers, **flags)
    refs = [ref([p[b].detach().clone() for p in params], **{k: model_value(v, b) for k, v in hypers.items()},
                **{k: flags.get(k, v) for k, v in DEFAULT_FLAGS[kind].items()})
            for b in range(B)]
    return params, opt, refs


DEFAULT_FLAGS = {"lars": dict(exclude_1d=False, maximize=False),
                 "lamb": dict(bias_correction=True, exclude_1d=False, maximize=False)}


def step_both(params, opt, refs, grads=None):
    if grads is None:
        grads = [torch.randn_like(p) for p in params]
    for p, g in zip(params, grads):
        p.grad = g
    opt.step()
    for b, ref in enumerate(refs):
        ref.step([g[b] for g in grads])
    return grads


def assert_follow(params, refs, **tol):
    for b, ref in enumerate(refs):
        for i, (p, w) in enumerate(zip(params, ref.params)):
            torch.testing.assert_close(p.detach()[b], w, msg=lambda m: f"model {b}, param {i}: {m}", **tol)


LARS_FLAGS = [dict(), dict(wd=True), dict(wd=True, exclude_1d=True), dict(wd=True, maximize=True)]
LAMB_FLAGS = [dict(), dict(wd=True), dict(wd=True, exclude_1d=True, bounds=True),
              dict(bias_correction=False, maximize=True, wd=True)]


def _split(kind, opts, B):
    wd = opts.get("wd", False)
    hypers = lars_hypers(B, wd) if kind == "lars" else lamb_hypers(B, wd, opts.get("bounds", False))
    flags = {k: v for k, v in opts.items() if k in DEFAULT_FLAGS[kind]}
    return hypers, flags


@pytest.mark.parametrize("B", [1, 3])
@pytest.mark.parametrize("kind, opts", [("lars", o) for o in LARS_FLAGS] + [("lamb", o) for o in LAMB_FLAGS],
                         ids=lambda v: v if isinstance(v, str) else "-".join(v) or "plain")
def test_models_follow_per_tensor_reference(kind, opts, B):
    torch.manual_seed(0)
    hypers, flags = _split(kind, opts, B)
    params, opt, refs = make(kind, B, hypers, flags)
    start = [p.detach().clone() for p in params]
    for _ in range(4):
        step_both(params, opt, refs)
    assert_follow(params, refs, rtol=2e-5, atol=2e-6)
    assert all(not torch.equal(p.detach()[b], s[b]) for p, s in zip(params, start) for b in range(B))


def test_trust_ratio_is_per_model_and_per_tensor():
    """A model whose gradients are 1000x larger takes the same LARS step (the ratio
    normalizes it) and leaves the other models' steps unchanged."""
    B = 3
    hypers = dict(lr=1.0, momentum=0.0, weight_decay=0.0, trust_coefficient=0.01, eps=0.0)
    params, opt, _ = make("lars", B, hypers, {})
    grads = [torch.randn_like(p) for p in params]
    for p, g in zip(params, grads):
        p.data[1] = p.data[0]  # models 0 and 1 start alike; model 1's gradients are 1000x model 0's
        g[1] = g[0] * 1000
        p.grad = g
    before = [p.detach().clone() for p in params]
    opt.step()
    for p, p0 in zip(params, before):
        torch.testing.assert_close(p.detach()[1] - p0[1], p.detach()[0] - p0[0], rtol=1e-5, atol=1e-7)
        # each layer's step has norm trust_coefficient * ||w||
        step = (p.detach()[2] - p0[2]).norm()
        torch.testing.assert_close(step, 0.01 * p0[2].norm(), rtol=1e-5, atol=0)


@pytest.mark.parametrize("kind", ["lars", "lamb"])
def test_zero_norms_give_ratio_one(kind):
    """A parameter of zeros (||w|| = 0) and a zero gradient (||g|| = 0, LAMB's ||r|| = 0 without
    weight decay) take the ratio 1, as the reference does, and produce no NaN."""
    B = 2
    params = [torch.zeros(B, 6, 4, requires_grad=True), torch.randn(B, 5, 3, requires_grad=True)]
    hypers, flags = _split(kind, dict(), B)
    params, opt, refs = make(kind, B, hypers, flags, params=params)
    grads = [torch.randn(B, 6, 4), torch.zeros(B, 5, 3)]
    w1 = params[1].detach().clone()
    step_both(params, opt, refs, grads)
    assert_follow(params, refs, rtol=2e-5, atol=2e-6)
    assert all(torch.isfinite(p).all() for p in params)
    lr = torch.tensor(hypers["lr"])
    if kind == "lars":
        # ratio 1: the zero parameter moved by exactly lr * g (the buffer starts at zero)
        torch.testing.assert_close(params[0].detach(), -lr.view(B, 1, 1) * grads[0])
    else:
        # first step with bias correction: r = g / (|g| + eps'), ratio 1
        assert (params[0].detach().abs() > 0.5 * lr.view(B, 1, 1)).all()
    # a zero gradient moved nothing (LAMB without weight decay: r = 0)
    assert torch.equal(params[1].detach(), w1)
    for _ in range(2):
        step_both(params, opt, refs)
    assert_follow(params, refs, rtol=2e-5, atol=2e-6)


@pytest.mark.parametrize("kind", ["lars", "lamb"])
def test_exclude_1d_leaves_biases_unadapted(kind):
    """With exclude_1d the [B, n] and [B] parameters take the plain (ratio 1, no weight decay)
    step: the same as a group of their own with weight decay 0 and without the ratio."""
    B = 2
    hypers, flags = _split(kind, dict(wd=True), B)
    bias = torch.randn(B, 9, requires_grad=True)
    weight = torch.randn(B, 9, 4, requires_grad=True)
    opt = (hoptim.LARS if kind == "lars" else hoptim.LAMB)([weight, bias], **hypers, exclude_1d=True)
    g = torch.randn(B, 9)
    bias.grad, weight.grad = g.clone(), torch.randn(B, 9, 4)
    b0 = bias.detach().clone()
    opt.step()
    lr = torch.tensor(hypers["lr"]).view(B, 1)
    if kind == "lars":
        torch.testing.assert_close(bias.detach(), b0 - lr * g)
    else:
        eps = torch.tensor(hypers["eps"]).view(B, 1)
        torch.testing.assert_close(bias.detach(), b0 - lr * g / (g.abs() + eps), rtol=1e-5, atol=1e-6)


def test_bfloat16_params_follow_fp32_reference():
    torch.manual_seed(1)
    B = 3
    for kind, opts in (("lars", dict(wd=True, exclude_1d=True)), ("lamb", dict(wd=True, bounds=True))):
        hypers, flags = _split(kind, opts, B)
        params, opt, refs = make(kind, B, hypers, flags, dtype=torch.bfloat16)
        for _ in range(3):
            step_both(params, opt, refs)
        assert all(p.dtype == torch.bfloat16 for p in params)
        assert all(t.dtype == torch.float32 for st in opt.state.values() for t in st.values())
        assert_follow(params, refs, rtol=1.6e-2, atol=1e-2)


@pytest.mark.parametrize("kind", ["lars", "lamb"])
def test_skip_mask_leaves_model_bit_identical(kind):
    B = 3
    hypers, flags = _split(kind, dict(wd=True), B)
    params, opt, refs = make(kind, B, hypers, flags)
    step_both(params, opt, refs)
    snap = [p.detach().clone() for p in params], {k: v.clone() for st in opt.state.values() for k, v in st.items()}
    state_before = [[t.clone() for t in st.values()] for st in opt.state.values()]
    grads = [torch.randn_like(p) for p in params]
    for g in grads:
        g[1] = math.nan
    for p, g in zip(params, grads):
        p.grad = g
    opt.step(skip=torch.tensor([False, True, False]))
    for b in (0, 2):
        refs[b].step([g[b] for g in grads])
    for p, p0 in zip(params, snap[0]):
        assert torch.equal(p.detach()[1], p0[1])
    for st, before in zip(opt.state.values(), state_before):
        for t, t0 in zip(st.values(), before):
            assert torch.equal(t[1], t0[1])
    for b in (0, 2):
        for p, w in zip(params, refs[b].params):
            torch.testing.assert_close(p.detach()[b], w, rtol=2e-5, atol=2e-6)
    # skip_nonfinite finds the NaN model by itself
    opt.skip_nonfinite = True
    opt.step()
    assert opt.last_skipped.tolist() == [False, True, False]


@pytest.mark.parametrize("kind", ["lars", "lamb"])
def test_state_dict_round_trip_mid_run_continues_identically(kind):
    B = 3
    hypers, flags = _split(kind, dict(wd=True, exclude_1d=True), B)
    params, opt, _ = make(kind, B, hypers, flags)
    grads = [[torch.randn_like(p) for p in params] for _ in range(4)]

    def run(o, ps, steps):
        for gs in steps:
            for p, g in zip(ps, gs):
                p.grad = g.clone()
            o.step()

    run(opt, params, grads[:2])
    saved = copy.deepcopy(opt.state_dict())  # state_dict() holds the live tensors
    saved_params = [p.detach().clone() for p in params]
    run(opt, params, grads[2:])
    resumed = [p.clone().requires_grad_() for p in saved_params]
    cls = hoptim.LARS if kind == "lars" else hoptim.LAMB
    other = cls(resumed, lr=0.5, exclude_1d=False)  # hyperparameters and flags come from the state
    other.load_state_dict(saved)
    assert other.param_groups[0]["exclude_1d"] is True
    run(other, resumed, grads[2:])
    for p, q in zip(params, resumed):
        assert torch.equal(p.detach(), q.detach())


@pytest.mark.parametrize("kind", ["lars", "lamb"])
def test_scheduler_changes_reach_the_step(kind):
    """A scheduler writes the per-model learning rates in place; each model's next step uses
    its new rate (the reference gets the same rates)."""
    B = 2
    hypers, flags = _split(kind, dict(wd=True), B)
    params, opt, refs = make(kind, B, hypers, flags)
    sched = LambdaLR(opt, [lambda e: 0.5 ** e, lambda e: 1.0 / (1 + e)])
    base = hypers["lr"]
    for epoch in range(3):
        for b, ref in enumerate(refs):
            ref.h["lr"] = base[b] * (0.5 ** epoch if b == 0 else 1.0 / (1 + epoch))
        step_both(params, opt, refs)
        sched.step()
    assert_follow(params, refs, rtol=2e-5, atol=2e-6)


def test_hyperparameters_validated():
    p = [torch.randn(2, 3, requires_grad=True)]
    with pytest.raises(ValueError, match=r"betas\[0\] must be < 1.0"):
        hoptim.LAMB(p, betas=(1.0, 0.9))
    with pytest.raises(ValueError, match=r"norm_bounds\[0\] <= norm_bounds\[1\].*models \[1\]"):
        hoptim.LAMB(p, norm_bounds=([0.0, 5.0], [1.0, 2.0]))
    with pytest.raises(ValueError, match="trust_coefficient must be >= 0"):
        hoptim.LARS(p, trust_coefficient=-1.0)
    with pytest.raises(ValueError, match="length B=2"):
        hoptim.LARS(p, lr=[0.1, 0.2, 0.3])
    with pytest.raises(TypeError, match="exclude_1d must be a bool, got int"):
        hoptim.LARS(p, exclude_1d=1)
    with pytest.raises(TypeError, match="bias_correction must be a bool"):
        hoptim.LAMB(p, bias_correction="yes")
    opt = hoptim.LARS(p)
    with pytest.raises(TypeError, match="unknown hyperparameter"):
        opt.set_hyperparameters(0, betas=(0.9, 0.99))
    opt.set_hyperparameters(1, trust_coefficient=0.5)
    assert opt.param_groups[0]["trust_coefficient"].tolist() == pytest.approx([1e-3, 0.5])


def test_ops_check_their_arguments():
    B = 2
    params, grads = [torch.randn(B, 3)], [torch.randn(B, 3)]
    steps = [torch.zeros(B)]
    with pytest.raises(ValueError, match=r"lars_step_: expected hypers of shape \[5, 2\].*got \[4, 2\]"):
        ops.lars_step_(params, grads, [], steps, torch.rand(4, B), False, False, False, None)
    with pytest.raises(ValueError, match=r"lamb_step_: expected exp_avg_sqs to hold 1 tensors"):
        ops.lamb_step_(params, grads, [torch.zeros(B, 3)], [], steps, torch.rand(7, B), True, False, False,
                       False, None)
    with pytest.raises(ValueError, match=r"expected grads\[0\] of shape \[2, 3\]"):
        ops.lars_step_(params, [torch.randn(B, 4)], [], steps, torch.rand(5, B), False, False, False, None)


@pytest.mark.parametrize("op", ["lars_step_", "lamb_step_"])
def test_opcheck(op):
    B = 3
    params = [torch.randn(B, 4, 3), torch.randn(B, 5)]
    grads = [torch.randn_like(p) for p in params]
    steps = [torch.zeros(B) for _ in params]
    if op == "lars_step_":
        args = (params, grads, [torch.zeros_like(p) for p in params], steps, torch.rand(5, B), True, False, True,
                torch.tensor([False, True, False]))
    else:
        args = (params, grads, [torch.zeros_like(p) for p in params], [torch.zeros_like(p) for p in params], steps,
                torch.rand(7, B), True, True, False, True, None)
    torch.library.opcheck(getattr(torch.ops.hfkern, op).default, args)


@pytest.mark.parametrize("op", ["lars", "lamb"])
def test_bench_loop_baseline_follows_the_optimizer(op):
    """bench/bench_optim.py's per-tensor loop for LARS/LAMB (its only baseline: torch.optim has
    neither) computes what the array optimizer does, over three steps."""
    import importlib
    import os
    import sys

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    added = [p for p in (os.path.join(root, "bench"), root) if p not in sys.path]
    sys.path[:0] = added
    try:
        bo = importlib.import_module("bench_optim")
        shapes = bo.resnet18_cifar_shapes(width=4)[:6]
        prob = bo.make_problem(op, 3, shapes, torch.device("cpu"))
        outs = []
        for impl in (bo.HfkernImpl("torch"), bo.LoopImpl()):
            assert impl.serves(op)
            with impl.context():
                step, params = impl.build(prob)
                for _ in range(3):
                    step()
            outs.append([p.clone() for p in params()])
        assert not bo.PerModelTorch("fused").serves(op)
    finally:
        for p in added:
            sys.path.remove(p)
        for name in ("bench_optim", "bench_kernels", "report", "shapes", "bandwidth"):
            sys.modules.pop(name, None)
    for got, want in zip(*outs):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
