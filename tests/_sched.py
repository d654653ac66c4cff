"""Shared helpers of the scheduler tests: per-model arguments and module-level
lr_lambda factors (module-level so that they pickle and compare by name)."""

from __future__ import annotations

import torch


class PM:
    """A per-model argument: the array scheduler gets the first B values, model b's torch one value b."""

    def __init__(self, values, tensor: bool = False):
        self.values = list(values)
        self.tensor = tensor


def _h(v, B):
    """The array scheduler's form of an argument (PM values as a list or a tensor, recursively)."""
    if isinstance(v, PM):
        vals = v.values[:B]
        if not v.tensor:
            return vals
        # float64: a float32 tensor would round gamma etc. before torch's float arithmetic sees them
        return torch.tensor(vals, dtype=torch.float64 if isinstance(vals[0], float) else None)
    if isinstance(v, list):
        return [_h(x, B) for x in v]
    return v


def _t(v, b):
    """Model b's torch scheduler's form of an argument."""
    if isinstance(v, PM):
        return v.values[b]
    if isinstance(v, list):
        return [_t(x, b) for x in v]
    return v


def _f0(e):
    return 0.95 ** e


def _f1(e):
    return 1.0 / (1 + e)


def _f2(e):
    return e // 7 + 1


def _m0(e):
    return 0.97


def _m1(e):
    return 0.9 if e % 3 == 0 else 1.0


def _f3(e):
    return 1.0 if e < 4 else 0.5


def _f4(e):
    return 0.9 ** (e // 2)


def _m3(e):
    return 0.93


def _m4(e):
    return 1.05 if e < 3 else 0.9


def _m5(e):
    return 0.98 if e % 2 else 1.0


def step_array_and_torch(param, models, opt, refs, sched, scheds) -> None:
    """One step of an array (``param`` ``[B, ...]``, ``opt``, ``sched``) and of the B
    torch models (``models[b]``, ``refs[b]``, ``scheds[b]``) on the same fresh gradient."""
    grad = torch.randn_like(param)
    param.grad = grad.clone()
    for b, m in enumerate(models):
        m.grad = grad[b].clone()
    opt.step()
    for r in refs:
        r.step()
    sched.step()
    for t in scheds:
        t.step()


def sgd_opt(B: int, features: int, lr=0.1, momentum=0.9, dtype=torch.float32):
    """An array SGD over one zero ``[B, features]`` parameter."""
    from hfkern.optim import SGD

    return SGD([torch.nn.Parameter(torch.zeros(B, features, dtype=dtype))], lr=lr, momentum=momentum)


def zero_grad_step(opt) -> None:
    """One optimizer step with zero gradients (the learning rates are what is looked at)."""
    for group in opt.param_groups:
        for p in group["params"]:
            p.grad = torch.zeros_like(p)
    opt.step()
