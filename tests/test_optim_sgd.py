"""hfkern.optim.SGD against B separate torch.optim.SGD optimizers, one per model."""

from __future__ import annotations

import io
import math

import pytest
import torch

from hfkern.optim import SGD

SHAPES = [(5, 3), (7,), (2, 3, 3, 1)]  # per-model parameter shapes of the first group
LATE_SHAPE = (4, 2)  # second group; its gradient starts late and skips a step


def _per_model(value, B):
    """The float model b uses, from a float / sequence / tensor hyperparameter."""
    if isinstance(value, torch.Tensor):
        return [float(v) for v in value]
    if isinstance(value, (list, tuple)):
        return [float(v) for v in value]
    return [float(value)] * B


def _configs(B):
    def spread(lo, hi):  # B distinct values, exact for B = 1
        return [lo + (hi - lo) * b / max(B - 1, 1) for b in range(B)]

    mixed_momentum = [0.0] + spread(0.5, 0.9)[1:]  # model 0 has none: dampening is ignored there
    return {
        "plain": dict(lr=spread(0.01, 0.2)),
        "tensor_lr": dict(lr=torch.tensor(spread(0.05, 0.3))),
        "momentum": dict(lr=spread(0.02, 0.1), momentum=spread(0.5, 0.95)),
        "mixed_momentum_dampening": dict(lr=0.05, momentum=mixed_momentum, dampening=spread(0.1, 0.4)),
        "weight_decay": dict(lr=spread(0.02, 0.1), weight_decay=[0.0] + spread(0.01, 0.1)[1:]),
        "nesterov": dict(lr=spread(0.01, 0.05), momentum=spread(0.3, 0.9), nesterov=True,
                         weight_decay=torch.tensor(spread(0.001, 0.01))),
        "maximize": dict(lr=spread(0.01, 0.05), momentum=0.8, dampening=0.2, weight_decay=1e-2,
                         maximize=True),
        "everything": dict(lr=torch.tensor(spread(0.01, 0.1)), momentum=spread(0.6, 0.9),
                           dampening=spread(0.0, 0.3), weight_decay=spread(0.0, 0.05)),
    }


def _torch_kwargs(cfg, b, B):
    out = {}
    for k, v in cfg.items():
        out[k] = v if isinstance(v, bool) else _per_model(v, B)[b]
    return out


def _grad_plan(step):
    """Which groups get gradients at ``step``: the late group starts at 3 and skips 7."""
    return 3 <= step and step != 7


@pytest.mark.parametrize("B", [1, 3])
@pytest.mark.parametrize("name", list(_configs(3)))
def test_trajectory_matches_torch(name, B):
    cfg = _configs(B)[name]
    late_cfg = dict(lr=[0.07 + 0.01 * b for b in range(B)], momentum=0.5)
    if cfg.get("nesterov"):
        late_cfg["nesterov"] = True
    # Array parameters and B torch models that start identical.
    params = [torch.nn.Parameter(torch.randn(B, *s)) for s in SHAPES]
    late = torch.nn.Parameter(torch.randn(B, *LATE_SHAPE))
    models = [[torch.nn.Parameter(p[b].detach().clone()) for p in params] for b in range(B)]
    models_late = [torch.nn.Parameter(late[b].detach().clone()) for b in range(B)]
    opt = SGD([{"params": params}, {"params": [late], **late_cfg}], **cfg)
    refs = [
        torch.optim.SGD(
            [{"params": models[b]}, {"params": [models_late[b]], **_torch_kwargs(late_cfg, b, B)}],
            **_torch_kwargs(cfg, b, B),
        )
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
        if step == 9:
            # Save, serialize and load into an optimizer built with other hyperparameters.
            buf = io.BytesIO()
            torch.save(opt.state_dict(), buf)
            buf.seek(0)
            saved = torch.load(buf)
            opt = SGD([{"params": params}, {"params": [late], "lr": 9.0}], lr=[0.5] * B, momentum=0.3)
            opt.load_state_dict(saved)
            for k in ("lr", "momentum", "dampening", "weight_decay"):
                expected = torch.tensor(_per_model(cfg.get(k, 0.0 if k != "lr" else 1e-3), B))
                torch.testing.assert_close(opt.param_groups[0][k], expected.float())
            assert opt.param_groups[0]["nesterov"] == cfg.get("nesterov", False)
            assert opt.param_groups[0]["maximize"] == cfg.get("maximize", False)
        for b in range(B):
            for p, ref in zip(params + [late], models[b] + [models_late[b]]):
                torch.testing.assert_close(p[b], ref, atol=1e-5, rtol=1e-5, msg=f"step {step} model {b}")
    # Momentum buffers: torch keeps one per model with momentum; ours hold the same values.
    for b in range(B):
        for p, ref in zip(params + [late], models[b] + [models_late[b]]):
            ref_buf = refs[b].state[ref].get("momentum_buffer")
            if ref_buf is not None:
                torch.testing.assert_close(opt.state[p]["momentum_buffer"][b], ref_buf, atol=1e-5, rtol=1e-5)
    momentum = _per_model(cfg.get("momentum", 0.0), B)
    if all(m == 0 for m in momentum):
        assert "momentum_buffer" not in opt.state[params[0]]


def test_hyperparameters_stored_per_model():
    B = 4
    p = torch.nn.Parameter(torch.randn(B, 3))
    q = torch.nn.Parameter(torch.randn(B, 2, dtype=torch.float64))
    opt = SGD([{"params": [p]}, {"params": [q], "momentum": torch.arange(B) / 10}],
              lr=[0.1, 0.2, 0.3, 0.4], weight_decay=1e-4)
    g0, g1 = opt.param_groups
    assert g0["lr"].shape == (B,) and g0["lr"].dtype == torch.float32
    torch.testing.assert_close(g0["lr"], torch.tensor([0.1, 0.2, 0.3, 0.4]))
    torch.testing.assert_close(g0["weight_decay"], torch.full((B,), 1e-4))
    assert g1["momentum"].dtype == torch.float64  # follows float64 parameters
    torch.testing.assert_close(g1["momentum"], torch.arange(B, dtype=torch.float64) / 10)
    assert opt.B == B


def test_assigning_hyperparameters_between_steps():
    B = 3
    p = torch.nn.Parameter(torch.randn(B, 6))
    refs_p = [torch.nn.Parameter(p[b].detach().clone()) for b in range(B)]
    opt = SGD([p], lr=0.1, momentum=[0.0, 0.5, 0.9])
    refs = [torch.optim.SGD([refs_p[b]], lr=0.1, momentum=m) for b, m in enumerate([0.0, 0.5, 0.9])]
    for step in range(6):
        if step == 3:
            new_lr = [0.3, 0.02, 0.05]
            opt.param_groups[0]["lr"] = new_lr
            for r, lr in zip(refs, new_lr):
                r.param_groups[0]["lr"] = lr
        g = torch.randn_like(p)
        p.grad = g
        for b in range(B):
            refs_p[b].grad = g[b].clone()
            refs[b].step()
        opt.step()
    assert isinstance(opt.param_groups[0]["lr"], torch.Tensor)
    torch.testing.assert_close(p.detach(), torch.stack([r.detach() for r in refs_p]))


def test_closure_and_zero_grad():
    B = 2
    p = torch.nn.Parameter(torch.randn(B, 3))
    opt = SGD([p], lr=[0.1, 0.0])
    before = p.detach().clone()

    def closure():
        opt.zero_grad()
        loss = (p ** 2).sum(dim=1)
        loss.sum().backward()
        return loss

    loss = opt.step(closure)
    assert loss.shape == (B,)
    torch.testing.assert_close(p[0].detach(), before[0] - 0.1 * 2 * before[0])
    torch.testing.assert_close(p[1].detach(), before[1])  # lr 0: model 1 does not move
    opt.zero_grad()
    assert p.grad is None


@pytest.mark.parametrize("name", ["lr", "momentum", "dampening", "weight_decay"])
@pytest.mark.parametrize(
    "value, match",
    [([0.1, 0.2], "length B=3"), (torch.ones(4), "length B=3"), (-0.1, ">= 0"),
     ([0.1, -1.0, 0.2], ">= 0"), (math.nan, "NaN"), (torch.tensor([0.1, math.nan, 0.1]), "NaN")],
)
def test_bad_hyperparameters_rejected(name, value, match):
    p = torch.nn.Parameter(torch.randn(3, 2))
    with pytest.raises(ValueError, match=match) as info:
        SGD([p], **{name: value})
    assert name in str(info.value)
    # The same value assigned later is rejected at the next step, before any update.
    opt = SGD([p], lr=0.1, momentum=0.5)
    opt.param_groups[0][name] = value
    p.grad = torch.randn_like(p)
    before = p.detach().clone()
    with pytest.raises(ValueError, match=match):
        opt.step()
    assert torch.equal(p.detach(), before)


def test_bad_hyperparameter_in_param_group():
    p, q = (torch.nn.Parameter(torch.randn(3, 2)) for _ in range(2))
    opt = SGD([p], lr=0.1)
    with pytest.raises(ValueError, match="weight_decay"):
        opt.add_param_group({"params": [q], "weight_decay": [0.1, 0.1]})
    assert len(opt.param_groups) == 1


@pytest.mark.parametrize(
    "kwargs, models",
    [(dict(momentum=[0.9, 0.0, 0.9]), "[1]"), (dict(momentum=0.9, dampening=[0.0, 0.0, 0.1]), "[2]"),
     (dict(momentum=0.0), "[0, 1, 2]")],
)
def test_nesterov_needs_momentum_and_no_dampening_per_model(kwargs, models):
    p = torch.nn.Parameter(torch.randn(3, 2))
    with pytest.raises(ValueError, match=r"Nesterov.*models " + models.replace("[", r"\[").replace("]", r"\]")):
        SGD([p], nesterov=True, **kwargs)


def test_bad_parameters_rejected():
    with pytest.raises(ValueError, match=r"same leading \(array\) dim B=3, got shape \[4, 2\]"):
        SGD([torch.nn.Parameter(torch.randn(3, 2)), torch.nn.Parameter(torch.randn(4, 2))])
    p = torch.nn.Parameter(torch.randn(3, 2))
    opt = SGD([p])
    with pytest.raises(ValueError, match="B=3"):
        opt.add_param_group({"params": [torch.nn.Parameter(torch.randn(2, 2))]})
    with pytest.raises(ValueError, match="0-d"):
        SGD([torch.nn.Parameter(torch.tensor(1.0))])
    with pytest.raises(TypeError, match="nesterov must be a bool"):
        SGD([p], momentum=0.9, nesterov=1)


def test_load_state_dict_restores_momentum():
    B = 3
    p = torch.nn.Parameter(torch.randn(B, 5))
    opt = SGD([p], lr=[0.1, 0.2, 0.3], momentum=0.9)
    p.grad = torch.randn_like(p)
    opt.step()
    sd = opt.state_dict()
    other = SGD([p], lr=1.0)
    other.load_state_dict(sd)
    assert torch.equal(other.state[p]["momentum_buffer"], opt.state[p]["momentum_buffer"])
    torch.testing.assert_close(other.param_groups[0]["lr"], torch.tensor([0.1, 0.2, 0.3]))
    # the loaded group has momentum on: its buffers keep being used
    p.grad = torch.randn_like(p)
    expected = opt.state[p]["momentum_buffer"] * 0.9 + p.grad
    other.step()
    torch.testing.assert_close(other.state[p]["momentum_buffer"], expected)


@pytest.mark.gpu
def test_cuda_step_does_not_synchronize():
    B = 4
    params = [torch.nn.Parameter(torch.randn(B, *s, device="cuda")) for s in SHAPES]
    opt = SGD(params, lr=torch.logspace(-3, 0, B), momentum=0.9, weight_decay=1e-4, nesterov=True)
    for g in opt.param_groups[0].values():
        if isinstance(g, torch.Tensor):
            assert g.device.type == "cuda"
    for p in params:
        p.grad = torch.randn_like(p)
    # The first step creates the state, and a kernel backend may tune its launch
    # configuration then (timing kernels synchronizes); the steps after it must not.
    opt.step()
    torch.cuda.set_sync_debug_mode("error")
    try:
        for _ in range(3):
            opt.step()
    finally:
        torch.cuda.set_sync_debug_mode("default")
    torch.cuda.synchronize()
