"""Gradients with respect to a shared input (hfkern.broadcast) are each model's own.

A module given a shared input computes once from ``x[0]`` where it can (a dense matmul with
the B weights concatenated, one normalization, one pooling). Autograd would then give the
B models' summed input gradient to the first row of the broadcast view and zeros to the
rest: right for ``x``'s gradient (their sum), wrong for a model's own ``d loss_b / d x``,
which a per-model gradient penalty (R1, WGAN-GP on shared real images) reads. Where the
shared input requires grad the modules compute as for B inputs.
"""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

import hfkern
import hfkern.nn as hnn

CASES = {
    "Linear": (lambda: nn.Linear(7, 2), (4, 7)),
    "Conv2d": (lambda: nn.Conv2d(3, 2, 3), (2, 3, 6, 6)),
    "Conv2d_reflect": (lambda: nn.Conv2d(3, 2, 3, padding=2, padding_mode="reflect"), (2, 3, 5, 6)),
    "Conv1d_1x1": (lambda: nn.Conv1d(3, 2, 1), (2, 3, 6)),
    "ConvTranspose2d": (lambda: nn.ConvTranspose2d(3, 2, 3, stride=2), (2, 3, 4, 4)),
    "GroupNorm": (lambda: nn.GroupNorm(1, 3), (2, 3, 4)),
    "LayerNorm": (lambda: nn.LayerNorm(5, elementwise_affine=False), (2, 5)),
    "RMSNorm": (lambda: nn.RMSNorm(5, elementwise_affine=False), (2, 5)),
    "BatchNorm1d": (lambda: nn.BatchNorm1d(3, affine=False, track_running_stats=False), (4, 3)),
    "MaxPool2d": (lambda: nn.MaxPool2d(2), (2, 3, 4, 4)),
    "MultiheadAttention": (lambda: nn.MultiheadAttention(4, 2, batch_first=True), (2, 3, 4)),
}


def _call(name, module, x):
    return module(x, x, x)[0] if name == "MultiheadAttention" else module(x)


@pytest.mark.parametrize("B", [2, 3])
@pytest.mark.parametrize("case", sorted(CASES))
def test_each_model_gets_its_own_input_gradient(case, B):
    make, shape = CASES[case]
    torch.manual_seed(0)
    mods = [make().double() for _ in range(B)]
    array = getattr(hnn, type(mods[0]).__name__).from_modules(copy.deepcopy(mods))
    x = torch.randn(*shape, dtype=torch.float64, requires_grad=True)
    xa = hfkern.broadcast(x, B)
    y = _call(case, array, xa)
    cot = torch.randn_like(y)
    (ours,) = torch.autograd.grad(y, xa, cot, retain_graph=True)
    ref_x = hfkern.broadcast(x, B)
    refs = torch.stack([_call(case, m, ref_x[b]) for b, m in enumerate(mods)])
    torch.testing.assert_close(y, refs)
    (theirs,) = torch.autograd.grad(refs, ref_x, cot)
    torch.testing.assert_close(ours, theirs)
    # ... and x's gradient, their sum
    (ours_x,) = torch.autograd.grad(y, x, cot)
    torch.testing.assert_close(ours_x, theirs.sum(0))


@pytest.mark.parametrize("case", ["Linear", "LayerNorm", "MaxPool2d"])
def test_a_shared_input_without_gradient_is_computed_once(case):
    """The shortcut stays where nothing differentiates the input (training's usual batch):
    the result is one computation's, broadcast or viewed per model."""
    make, shape = CASES[case]
    B = 3
    array = getattr(hnn, type(make()).__name__).from_modules([make() for _ in range(B)])
    x = hfkern.broadcast(torch.randn(*shape), B)
    once = _call(case, array, x)
    per_model = _call(case, array, x.contiguous())
    torch.testing.assert_close(once, per_model)
    if case == "Linear":
        assert once.movedim(0, -2).is_contiguous()  # the dense matmul's [*, B, out] memory
    else:
        assert once.stride(0) == 0  # one result for every model


def test_r1_penalty_on_shared_real_images():
    """A per-model gradient penalty (R1: ||d D_b(x) / dx||^2 on the real batch every model
    shares), its double backward included, as B separate discriminators compute it."""
    B = 3
    torch.manual_seed(1)

    def discriminator():
        return nn.Sequential(nn.Conv2d(3, 4, 3, stride=2, padding=1), nn.LeakyReLU(0.2),
                             nn.Flatten(), nn.Linear(4 * 4 * 4, 1))

    models = [discriminator().double() for _ in range(B)]
    fused = hfkern.fuse(copy.deepcopy(models))
    real = torch.randn(5, 3, 8, 8, dtype=torch.float64)

    x = hfkern.broadcast(real.clone().requires_grad_(), B)
    out = fused(x)
    (grad,) = torch.autograd.grad(out.sum(), x, create_graph=True)
    penalty = grad.square().flatten(1).sum(1)  # [B]: one per model
    penalty.sum().backward()

    for b, m in enumerate(models):
        xb = real.clone().requires_grad_()
        (gb,) = torch.autograd.grad(m(xb).sum(), xb, create_graph=True)
        pb = gb.square().sum()
        torch.testing.assert_close(penalty[b], pb)
        pb.backward()
        for name, p in m.named_parameters():
            ours = fused.get_parameter(name).grad
            if p.grad is None:  # (the last bias: no part of the input gradient)
                assert ours is None or not ours[b].any(), name
            else:
                torch.testing.assert_close(ours[b], p.grad, msg=name)


@pytest.mark.parametrize("make", [
    lambda: hnn.BatchNorm2d(3, affine=False, track_running_stats=False, B=2),
    lambda: hnn.LayerNorm(5, elementwise_affine=False, B=2),
    lambda: hnn.GroupNorm(1, 3, affine=False, B=2),
    lambda: hnn.MaxPool2d(2, B=2),
], ids=["batch_norm", "layer_norm", "group_norm", "max_pool"])
def test_layer_without_parameters_returns_a_shared_input_shared(make):
    """The README's rule: computed once, returned as a broadcast view (the next layer's cheaper
    path), equal to the result on B stacked copies; written in place it raises as any expanded
    tensor does, and a clone of it is an ordinary per-model tensor."""
    layer = make()
    x = torch.randn(4, 3, 5, 5)
    y = layer(hfkern.broadcast(x, 2))
    assert hfkern.is_shared(y)
    torch.testing.assert_close(y, layer(torch.stack([x, x])))
    with pytest.raises(RuntimeError, match="single memory location"):
        torch.relu_(y)
    y = y.clone()
    torch.relu_(y)
    assert not hfkern.is_shared(y)
