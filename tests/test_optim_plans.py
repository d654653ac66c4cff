"""The optimizer kernels build their tile tables once per structure, not once per step.

A training loop hands the optimizer new gradient tensors at every step
(``zero_grad()`` sets them to None and backward allocates new ones). The tile
tables (hfkern/_multi_tensor.py) depend only on shapes, dtypes and layouts, so
over 10 steps with ``zero_grad()`` between them the triton backend (Triton's
interpreter) and the cuda backend (the host grid emulator) build one table per
distinct structure: one per parameter group (per exclusion subset for LAMB's
``exclude_1d``) and the non-finite check's, and one more of each when a group
is added later. The results equal, bit for bit, the same kernels' run on
gradients kept in the same tensors at every step (addresses are the only
difference), and follow the torch path.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

import hfkern
import hfkern.nn as hnn
import hfkern.nn.functional as HF
import hfkern.optim as hoptim
from hfkern import _backend
from hfkern._optim_specs import OPTIMIZER_SPECS

B = 3
STEPS = 10
ADD_AT = 3  # the step at which the second parameter group joins
_CUDA_OPS = ("sgd_step_", "adam_step_", "lars_step_", "lamb_step_")


@pytest.fixture(params=[pytest.param("triton", marks=pytest.mark.interpreter),
                        pytest.param("cuda", marks=pytest.mark.emulator)])
def kernels(request, monkeypatch):
    """``(backend, planner)``: the backend's optimizer kernels serving CPU tensors under
    ``hfkern.use_backend(backend)``, in Triton's interpreter or the host grid emulator."""
    backend = request.param
    if backend == "triton":
        from hfkern.triton import optim as tk

        impls = {spec.op: getattr(tk, spec.op) for spec in OPTIMIZER_SPECS}
        impls["nonfinite_models"] = tk.nonfinite_models
        planner = tk._planner
    else:
        from hfkern.cuda import optim as ck

        impls = {op: ck.emulated(op) for op in _CUDA_OPS}
        planner = ck._planner
    _backend._load_packages()  # the backends register now, not over the entries below later
    monkeypatch.setitem(_backend._availability, backend, lambda: (True, "pretend"))
    # CPU tensors otherwise always take the torch path under a GPU backend.
    monkeypatch.setattr(_backend, "_GPU_BACKENDS", tuple(b for b in _backend._GPU_BACKENDS if b != backend))
    for op, fn in impls.items():
        monkeypatch.setitem(_backend._registry[op], backend, _backend._Impl(fn, ("cpu",), False))
    _backend._resolved.clear()
    planner.plans.clear()  # tables of the same structures built by earlier tests would hide builds
    yield backend, planner
    _backend._resolved.clear()


# ---- the models: a hand-written array and a fused torch model, each in two parts ----

def _array_parts():
    body = nn.Sequential(
        hnn.Conv2d(1, 4, 3, padding=1, B=B), nn.ReLU(), hnn.MaxPool2d(2, B=B), hnn.Flatten(B=B),
        hnn.Linear(4 * 3 * 3, 5, B=B), hnn.LayerNorm(5, B=B), nn.ReLU(),
    )
    head = hnn.Linear(5, 3, B=B)
    return nn.Sequential(body, head), list(body.parameters()), list(head.parameters())


def _array_batch(step):
    gen = torch.Generator().manual_seed(100 + step)
    x = torch.randn(5, 1, 6, 6, generator=gen)
    return hfkern.broadcast(x, B), torch.randint(0, 3, (5,), generator=gen)


def _array_loss(model, batch):
    x, y = batch
    return HF.cross_entropy(model(x), y).sum()


class _SmallCNN(nn.Module):
    """A plain torch model, written as its authors write it (as tests/_fuse_models.py's),
    small enough for Triton's interpreter."""

    def __init__(self):
        super().__init__()
        self.features = nn.Sequential(nn.Conv2d(1, 4, 3, padding=1), nn.BatchNorm2d(4), nn.ReLU(), nn.MaxPool2d(2))
        self.classifier = nn.Linear(4 * 3 * 3, 5)

    def forward(self, x):
        x = self.features(x)
        return self.classifier(x.view(x.size(0), -1))


def _fused_parts():
    fused = hfkern.fuse(_SmallCNN, B)
    named = list(fused.named_parameters())
    body = [p for name, p in named if not name.startswith("classifier")]
    head = [p for name, p in named if name.startswith("classifier")]
    assert body and head
    return fused, body, head


def _fused_batch(step):
    gen = torch.Generator().manual_seed(200 + step)
    return torch.randn(B, 4, 1, 6, 6, generator=gen), torch.randint(0, 5, (4,), generator=gen)


def _fused_loss(model, batch):
    x, y = batch
    out = model(x)
    return sum(nn.functional.cross_entropy(out[b], y) for b in range(B))


MODELS = {"array": (_array_parts, _array_batch, _array_loss), "fused": (_fused_parts, _fused_batch, _fused_loss)}
# (optimizer, its arguments, step plans per parameter group): LAMB's exclude_1d splits
# each group into the parameters it adapts and those it excludes, one call each.
OPTIMIZERS = {
    "adam": (hoptim.Adam, dict(lr=[0.01, 0.02, 0.03], weight_decay=[0.0, 0.01, 0.02], amsgrad=True), 1),
    "lamb": (hoptim.LAMB, dict(lr=[0.01, 0.02, 0.03], weight_decay=0.01, exclude_1d=True), 2),
}


def _train(model_name, opt_name, backend, *, keep_grads, planner=None):
    """10 steps with ``zero_grad()`` between them, the second parameter group added at step
    ADD_AT; with ``keep_grads`` the gradients are copied into the same tensors at every step.
    A shadow copy of the parameters takes the same steps on the torch path, from the same
    gradients (a model's own training would amplify rounding differences: a conv bias before
    a batch norm has a gradient of rounding noise, which Adam scales up).
    Returns the parameters, the shadow's, and the planner's build count after each step."""
    parts, batch, loss_fn = MODELS[model_name]
    cls, kwargs, _ = OPTIMIZERS[opt_name]
    torch.manual_seed(0)
    model, body, head = parts()
    shadow = [nn.Parameter(p.detach().clone()) for p in body + head]
    shadow_body, shadow_head = shadow[: len(body)], shadow[len(body):]
    # The non-finite check has a Triton kernel only.
    opt = cls(body, **kwargs, skip_nonfinite=backend == "triton")
    shadow_opt = cls(shadow_body, **kwargs, skip_nonfinite=backend == "triton")
    kept: dict[torch.Tensor, torch.Tensor] = {}
    builds = []
    for step in range(STEPS):
        if step == ADD_AT:
            opt.add_param_group({"params": head})
            shadow_opt.add_param_group({"params": shadow_head})
        loss = loss_fn(model, batch(step))
        opt.zero_grad()
        shadow_opt.zero_grad()
        loss.backward()
        for p, sp in zip(body + head, shadow):
            sp.grad = p.grad.clone()
            if keep_grads:
                p.grad = kept.setdefault(p, torch.empty_like(p.grad)).copy_(p.grad)
        with hfkern.use_backend(backend):
            opt.step()
        shadow_opt.step()
        if planner is not None:
            builds.append(planner.builds)
    return [p.detach() for p in body + head], [p.detach() for p in shadow], builds


@pytest.mark.long
@pytest.mark.parametrize("opt_name", list(OPTIMIZERS))
@pytest.mark.parametrize("model_name", list(MODELS))
def test_tables_are_built_once_per_structure(kernels, model_name, opt_name):
    backend, planner = kernels
    before = planner.builds
    got, want, builds = _train(model_name, opt_name, backend, keep_grads=False, planner=planner)
    # Per parameter group: its step plans, and (triton) the non-finite check over all groups.
    per_group = OPTIMIZERS[opt_name][2] + (backend == "triton")
    assert [b - before for b in builds] == [per_group] * ADD_AT + [2 * per_group] * (STEPS - ADD_AT)
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
    kept, _, _ = _train(model_name, opt_name, backend, keep_grads=True)
    for a, b in zip(got, kept):
        assert torch.equal(a, b)


# ---- gradients laid out unlike their parameters -------------------------------------

def _conv_params():
    gen = torch.Generator().manual_seed(3)
    # model-major conv weights with the channels innermost, as a channels-last array keeps them
    w = torch.randn(B, 6, 4, 3, 3, generator=gen).contiguous(memory_format=torch.channels_last_3d)
    wide = torch.randn(B, 5, 2, 3, 2, 3, generator=gen)
    return [nn.Parameter(w), nn.Parameter(torch.randn(B, 6, generator=gen)), nn.Parameter(wide)]


def _grads(step, params, layout):
    gen = torch.Generator().manual_seed(300 + step)
    out = []
    for p in params:
        g = torch.randn(p.shape, generator=gen)
        if layout == "param":
            g = torch.empty_like(p).copy_(g)
        elif p.dim() == 6:  # every inner dim permuted: more dims than a gather row holds
            g = g.permute(0, 5, 3, 1, 4, 2).contiguous().permute(0, 3, 5, 2, 4, 1)
        out.append(g)
    return out


# LAMB's norm pass reads the gradients too.
LAYOUT_OPTIMIZERS = {"adam": (hoptim.Adam, dict(lr=[0.01, 0.02, 0.03], weight_decay=0.01)),
                     "lamb": (hoptim.LAMB, dict(lr=[0.01, 0.02, 0.03], weight_decay=0.01))}


def _run_layouts(backend, opt_name, layout, planner=None):
    params = _conv_params()
    cls, kwargs = LAYOUT_OPTIMIZERS[opt_name]
    opt = cls(params, **kwargs)
    builds = []
    for step in range(STEPS):
        opt.zero_grad()
        for p, g in zip(params, _grads(step, params, layout)):
            p.grad = g
        with hfkern.use_backend(backend):
            opt.step()
        if planner is not None:
            builds.append(planner.builds)
    return [p.detach() for p in params], builds


@pytest.mark.long
@pytest.mark.parametrize("opt_name", list(LAYOUT_OPTIMIZERS))
def test_gradients_in_another_layout_are_read_where_they_lie(kernels, opt_name):
    """Contiguous gradients of channels-last conv weights are read in place through the
    gather table: one table for all 10 steps and no copy, and bit for bit what gradients
    in the weights' own layout give. Only a gradient with more dims in another order than
    a gather row holds is copied at each step, still without a new table."""
    backend, planner = kernels
    before = planner.builds
    got, builds = _run_layouts(backend, opt_name, "other", planner)
    assert [b - before for b in builds] == [1] * STEPS
    params = _conv_params()
    plan, _, _ = planner.plan(params, _grads(0, params, "other"), [[], [], []], ["a", "b", "c"], [])
    assert planner.builds - before == 2  # the same shapes without state: another structure
    assert plan.copied == [2]  # the 6-d gradient; the conv weight's is gathered
    (group,) = plan.groups
    assert group.gathers is not None and group.gathers.size(0) == 1
    want, _ = _run_layouts(backend, opt_name, "param")
    for a, b in zip(got, want):
        assert torch.equal(a, b)


@pytest.mark.interpreter
def test_nonfinite_check_builds_once():
    from hfkern.triton import optim as tk

    tk._planner.plans.clear()
    before = tk._planner.builds
    grads = [torch.randn(B, 37, 11), torch.randn(B, 16, 8).half(), torch.randn(B, 30, 2).transpose(1, 2)]
    for step in range(STEPS):
        fresh = [g.clone() for g in grads]  # new tensors, the same values
        if step == 5:
            fresh[1][2, 3, 4] = float("nan")
        assert tk.nonfinite_models(fresh).tolist() == [False, False, step == 5]
    assert tk._planner.builds - before == 1
