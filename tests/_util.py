"""Shared test helpers: compare an array module against B separate torch modules."""

from __future__ import annotations

from typing import Callable, Sequence

import torch
from torch import nn

import hfkern

GRAD_TOL = dict(atol=1e-4, rtol=1e-4)


def array_input(shape: Sequence[int], B: int, *, shared: bool = False, layout: str = "contiguous",
                dtype=torch.float32, requires_grad: bool = True) -> tuple[torch.Tensor, list[torch.Tensor], torch.Tensor]:
    """A fresh random array input and the per-model inputs it stands for.

    ``shape`` is one model's input shape. ``layout``: "contiguous" ([B, ...]
    memory), "batch_major" ([N, B, ...] memory, what an array conv produces; needs
    a batch dim), "channels_last" ([N, H, W, B, C] memory, a channels-last array
    image; ``shape`` [N, C, H, W]) or "strided" (every other element of an
    over-allocated last dim).
    Returns ``(x_array, [x_0, ..., x_{B-1}], leaf)``: the per-model inputs are
    separate leaves; ``leaf`` is the tensor the array input's gradient lands on
    (``x_array`` itself, or the unexpanded tensor of a shared input).
    """
    if shared:
        base = torch.randn(*shape, dtype=dtype)
        leaf = base.clone().requires_grad_(requires_grad)
        x = hfkern.broadcast(leaf, B)
        models = [base.clone().requires_grad_(requires_grad) for _ in range(B)]
        return x, models, leaf
    if layout == "contiguous":
        data = torch.randn(B, *shape, dtype=dtype)
    elif layout == "batch_major":
        data = torch.randn(shape[0], B, *shape[1:], dtype=dtype).transpose(0, 1)
    elif layout == "channels_last":
        N, C, H, W = shape
        data = torch.randn(N, H, W, B, C, dtype=dtype).permute(3, 0, 4, 1, 2)
    elif layout == "strided":
        data = torch.randn(B, *shape[:-1], 2 * shape[-1], dtype=dtype)[..., ::2]
    else:
        raise ValueError(layout)
    leaf = data.detach().requires_grad_(requires_grad)  # keeps the layout's strides
    models = [data[b].detach().clone().requires_grad_(requires_grad) for b in range(B)]
    return leaf, models, leaf


def compare_modules(
    array: nn.Module,
    modules: Sequence[nn.Module],
    x: torch.Tensor,
    xs: Sequence[torch.Tensor],
    leaf: torch.Tensor | None = None,
    *,
    call: Callable | None = None,
    fwd_tol: dict | None = None,
    grad_tol: dict | None = None,
    shared: bool = False,
) -> torch.Tensor:
    """Forward and backward of ``array(x)`` against ``[m(x_b) for m in modules]``.

    Checks outputs, input gradients (summed over models for a shared input) and
    every parameter gradient. ``call(module, input)`` overrides how a module is
    invoked and must return a tensor. Returns the array output.
    """
    call = call or (lambda m, inp: m(inp))
    fwd_tol = fwd_tol or {}
    grad_tol = grad_tol or GRAD_TOL
    y = call(array, x)
    ys = [call(m, xb) for m, xb in zip(modules, xs)]
    expected = torch.stack(ys)
    torch.testing.assert_close(y, expected, **fwd_tol)
    grad = torch.randn_like(expected)
    params = [p for p in array.parameters() if p.requires_grad]
    inputs = [leaf] if leaf is not None and leaf.requires_grad else []
    got = torch.autograd.grad(y, inputs + params, grad, allow_unused=True)
    shared_grad = 0
    for b, (m, yb) in enumerate(zip(modules, ys)):
        m_inputs = [xs[b]] if inputs else []
        m_params = [p for p in m.parameters() if p.requires_grad]
        ref = torch.autograd.grad(yb, m_inputs + m_params, grad[b], allow_unused=True)
        if inputs and shared:
            shared_grad = shared_grad + ref[0]
        elif inputs:
            torch.testing.assert_close(got[0][b], ref[0], **grad_tol)
        for g_arr, g_ref in zip(got[len(inputs):], ref[len(inputs):]):
            if g_ref is None:
                assert g_arr is None or torch.all(g_arr[b] == 0)
            else:
                torch.testing.assert_close(g_arr[b], g_ref, **grad_tol)
    if inputs and shared:
        torch.testing.assert_close(got[0], shared_grad, **grad_tol)
    return y


def torch_modules(factory: Callable[[], nn.Module], B: int) -> list[nn.Module]:
    """B independently initialized torch modules."""
    return [factory() for _ in range(B)]


def assert_state_equal(array: nn.Module, modules: Sequence[nn.Module]) -> None:
    """``array``'s state entries at index b equal model b's, and to_modules round-trips."""
    sd = array.state_dict()
    for b, m in enumerate(modules):
        msd = m.state_dict()
        assert set(sd) == set(msd), (sorted(sd), sorted(msd))
        for k, v in msd.items():
            torch.testing.assert_close(sd[k][b], v, atol=1e-6, rtol=1e-5)
    for b, m in enumerate(array.to_modules()):
        assert type(m) is type(modules[b])
        for k, v in m.state_dict().items():
            assert torch.equal(v, sd[k][b])


def assert_fused_matches(fused: nn.Module, models: Sequence[nn.Module], *, requires_grad: bool = False,
                         **tol) -> None:
    """A fused model's parameter gradients and state entries at index b equal torch model b's (a
    gradient torch leaves None may be None or zero); ``requires_grad``: each state entry's
    ``requires_grad`` too."""
    for b, m in enumerate(models):
        for name, p in m.named_parameters():
            got = fused.get_parameter(name).grad
            if p.grad is None:
                assert got is None or not got[b].any(), f"{name}: torch has no gradient"
            else:
                torch.testing.assert_close(got[b], p.grad, **tol, msg=lambda s: f"{name}.grad[{b}]: {s}")
    state = fused.state_dict()
    for b, m in enumerate(models):
        for k, v in m.state_dict().items():
            torch.testing.assert_close(state[k][b], v, **tol, msg=lambda s: f"{k}[{b}]: {s}")
            if requires_grad:
                assert state[k].requires_grad == v.requires_grad, k


def check_against_modules(array, modules, x, xs, leaf, akw, mkws, *, shared=False, grads=True, fwd_tol=None):
    """Forward, input and per-parameter (by name) gradients of ``array(x, **akw)`` against the B
    torch modules' ``modules[b](xs[b], **mkws[b])`` (``leaf``: the tensor ``x`` was made from, as
    :func:`array_input` returns it; ``shared``: the input gradient is the sum over the models)."""
    y = array(x, **akw)
    ys = [m(xs[b], **mkws[b]) for b, m in enumerate(modules)]
    torch.testing.assert_close(y, torch.stack(ys), **(fwd_tol or {}))
    if not grads:
        return y
    g = torch.randn_like(y)
    names, params = zip(*array.named_parameters())
    got = torch.autograd.grad(y, [leaf, *params], g)
    got_p = dict(zip(names, got[1:]))
    gsum = 0
    for b, m in enumerate(modules):
        m_names, m_params = zip(*m.named_parameters())
        assert sorted(m_names) == sorted(names)
        ref = torch.autograd.grad(ys[b], [xs[b], *m_params], g[b])
        if shared:
            gsum = gsum + ref[0]
        else:
            torch.testing.assert_close(got[0][b], ref[0], **GRAD_TOL)
        for n, gr in zip(m_names, ref[1:]):
            torch.testing.assert_close(got_p[n][b], gr, **GRAD_TOL, msg=lambda s: f"{n}: {s}")
    if shared:
        torch.testing.assert_close(got[0], gsum, **GRAD_TOL)
    return y


def import_sweep_extra(name: str = "optuna"):
    """Import a module of the sweep extra (Optuna, SQLAlchemy), or skip the test module without it.

    Machines without the extra (a GPU machine with no network) skip the sweep
    tests; CI installs it, and there (HFKERN_REQUIRE_EXTENSIONS=1) a missing
    module fails instead.
    """
    import importlib
    import os

    import pytest

    if os.environ.get("HFKERN_REQUIRE_EXTENSIONS") == "1":
        return importlib.import_module(name)
    return pytest.importorskip(name, reason=f"{name} is not installed (pip install 'hfkern[sweep]')")


class CallCounter:
    """Counts the calls of a module-level function (looked up at call time by its callers),
    replaced for the test by ``monkeypatch``: ``n`` calls so far."""

    def __init__(self, monkeypatch, module, name: str):
        self.n, fn = 0, getattr(module, name)

        def counted(*args, **kwargs):
            self.n += 1
            return fn(*args, **kwargs)
        monkeypatch.setattr(module, name, counted)
