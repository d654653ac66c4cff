"""What the norm backends' tests share (batch norm and layer norm, Triton and CUDA):
the registered implementations by op name, the backward output masks, layout and
gradient checks, the flash-attention accuracy rule of the GPU tests, and the batch
norm's modes and op run."""

from __future__ import annotations

import itertools

import torch
from _util import GRAD_TOL

import hfkern
from hfkern import _backend
from hfkern.ops import batch_norm as bnops

EPS = 1e-5
# (training, momentum, tracked running statistics) of a batch norm
MODES = [(True, 0.1, True), (True, None, True), (True, 0.1, False), (False, 0.1, True)]
MODE_IDS = ["train", "cumulative", "untracked", "eval"]
# the error floor of the accuracy rule, relative to the reference's largest magnitude
LOW_PRECISION_FLOOR = {torch.float32: 1e-5, torch.bfloat16: 1e-2, torch.float16: 2e-3}


class Impls:
    """One backend's registered implementation of each of ``ops``, by op name."""

    def __init__(self, backend: str, ops):
        for op in ops:
            setattr(self, op, _backend._registry[op][backend].load())


def masks(weight):
    """Every backward output_mask (grad_x, grad_weight, grad_bias) valid with/without a weight."""
    return [list(m) for m in itertools.product([True, False], repeat=3) if weight or not m[1]]


def assert_same_layout(got, expected):
    assert got.shape == expected.shape and got.dtype == expected.dtype
    if got.numel() > 1:
        assert got.stride() == expected.stride()


def assert_grads(got, expected, mask):
    """A backward's outputs against the reference's: the wanted ones close, the others ``[0]``."""
    assert len(got) == len(expected) == len(mask)
    for g, e, wanted in zip(got, expected, mask):
        assert_same_layout(g, e)
        if wanted:
            torch.testing.assert_close(g, e, **GRAD_TOL)
        else:
            assert g.shape == (0,)


def assert_as_accurate(got, torch_out, ref64):
    """The flash-attention rule: error against float64 at most twice the torch path's, plus a floor."""
    assert got.dtype == torch_out.dtype and got.shape == torch_out.shape
    if got.numel() > 1:
        assert got.stride() == torch_out.stride()
    ref64 = ref64.to(got.device)
    err = (got.double() - ref64).abs().max().item()
    torch_err = (torch_out.double() - ref64).abs().max().item()
    floor = LOW_PRECISION_FLOOR.get(got.dtype, 1e-5) * max(ref64.abs().max().item(), 1.0)
    assert err <= 2 * torch_err + floor, (err, torch_err, floor)


def run_batch_norm_op(x, w, b, running_stats, mode, gy, backend, activation="none"):
    """(outputs, gradients of x, w, b) of the differentiable batch-norm op under ``backend``:
    y, mean, rstd and the updated running statistics (copies) where there are some."""
    training, momentum, _ = mode
    leaves = [t.detach().requires_grad_() if t is not None else None for t in (x, w, b)]
    rm, rv, nbt = (None if t is None else t.clone() for t in running_stats)
    with hfkern.use_backend(backend):
        y, mean, rstd = bnops.array_batch_norm(leaves[0], leaves[1], leaves[2], rm, rv, nbt,
                                               training, momentum, EPS, activation)
        grads = torch.autograd.grad(y, [t for t in leaves if t is not None], gy)
    outs = [y.detach(), mean, rstd] + ([rm, rv] if rm is not None else [])
    return outs, list(grads)
