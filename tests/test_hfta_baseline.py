"""The HFTA-style baseline (bench/models/hfta.py) trains exactly what B separate
torch models of each workload compute: forward outputs, per-model losses, every
gradient, the batch-norm statistics and optimizer steps, fp32 on the CPU.

Each workload's own training step (``Workload.step``) runs once over the B torch
models one by one (each with its ``torch.optim`` optimizer, ``foreach=True``)
and once over the fused model, with the harness's per-model learning rates.
Dropout is switched off in both (its masks are random draws that no two
implementations share); everything else is the workload at its ``smoke`` size.
The fused optimizer steps from the torch models' own gradients (written into
the fused gradients after they were compared), so that the step is checked on
equal inputs: Adam's first step divides a gradient by its own magnitude, and
the rounding noise of a gradient that is zero in exact arithmetic (a conv bias
before batch norm) would otherwise flip signs of ``lr``-sized updates.

Tolerances are fp32's: rtol 1e-4, atol 1e-5 times the tensor's largest entry
(at least 1e-5). The batch is 16 samples rather than the smoke size's 2 to 4:
batch norm over 4 samples amplifies rounding so much that PointNet's fp32
gradients, torch's own included, stand about 1e-4 of their scale off a float64
run, and two correct fp32 implementations then differ by more than that.
"""

from __future__ import annotations

import os
import sys

import pytest
import torch
from torch import nn

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

from bench.models import WORKLOADS, hfta  # noqa: E402

SIZE = "smoke"
BATCH = 16
OPTIMIZERS = {"sgd": torch.optim.SGD, "adam": torch.optim.Adam, "adamw": torch.optim.AdamW}


def _close(actual: torch.Tensor, expected: torch.Tensor, what: str) -> None:
    """fp32 tolerances; the absolute one relative to the tensor's scale, as a
    deep stack's gradients carry errors proportional to their largest entries."""
    scale = max(1.0, expected.detach().abs().max().item() if expected.numel() else 0.0)
    torch.testing.assert_close(actual.detach(), expected.detach(), rtol=1e-4, atol=1e-5 * scale,
                               msg=lambda m: f"{what}: {m}")


def _batch(w) -> tuple[torch.Tensor, ...]:
    """One batch of ``BATCH`` samples in the shapes of the workload's smoke size."""
    return w.make_batch({**w.config(SIZE), "batch": BATCH}, torch.Generator().manual_seed(3))


def _models(workload, B: int) -> dict[str, list[nn.Module]]:
    w = WORKLOADS[workload]
    out = {}
    for i, net in enumerate(w.nets):
        ms = []
        for b in range(B):
            torch.manual_seed(1000 * i + b)
            m = w.build(net, SIZE)
            for mod in m.modules():
                if isinstance(mod, nn.Dropout):
                    mod.p = 0.0
                elif isinstance(mod, nn.MultiheadAttention):
                    mod.dropout = 0.0
            ms.append(m)
        out[net] = ms
    return out


class _TorchSide:
    """The B torch models trained one by one; records every apply's output, and at
    every update the losses, gradients and parameters after the step."""

    def __init__(self, w, models, lrs):
        opt_name, kw = w.optimizer
        self.w, self.models = w, models
        self.opts = {n: [OPTIMIZERS[opt_name](m.parameters(), lr=lrs[b], foreach=True, **kw)
                         for b, m in enumerate(ms)] for n, ms in models.items()}
        B = len(lrs)
        self.outputs = [[] for _ in range(B)]
        self.updates = [[] for _ in range(B)]

    def run(self, batch):
        for k in range(len(self.outputs)):
            def apply(net, *inputs, per_model=False, k=k):
                if per_model:
                    inputs = tuple(x.squeeze(0) for x in inputs)
                out = self.models[net][k](*inputs).unsqueeze(0)
                self.outputs[k].append(out.detach().clone())
                return out

            def update(net, losses, k=k):
                m, opt = self.models[net][k], self.opts[net][k]
                opt.zero_grad()
                losses.sum().backward()
                grads = {n: p.grad.clone() for n, p in m.named_parameters()}
                opt.step()
                after = {n: p.detach().clone() for n, p in m.named_parameters()}
                self.updates[k].append((net, losses.detach().clone(), grads, after))

            self.w.step(apply, update, batch)


@pytest.mark.parametrize("B", [1, 3])
@pytest.mark.parametrize("workload", list(WORKLOADS))
def test_hfta_trains_what_separate_torch_models_compute(workload, B):
    w = WORKLOADS[workload]
    lrs = w.learning_rates(B)
    batch = _batch(w)
    models = _models(workload, B)
    fused = {n: hfta.fuse(workload, n, ms) for n, ms in models.items()}

    # the fused parameters mirror the models' names and hold their initial values
    for net, f in fused.items():
        assert {n for n, _ in f.named_parameters()} == {n for n, _ in models[net][0].named_parameters()}
        for b, per in enumerate(hfta.per_model(f, f.named_parameters())):
            for name, p in models[net][b].named_parameters():
                assert per[name].shape == p.shape, name
                torch.testing.assert_close(per[name], p.detach(), rtol=0, atol=0)

    opt_name, kw = w.optimizer
    opts = {n: hfta.optimizer(opt_name, f.parameters(), B, lr=lrs, **kw) for n, f in fused.items()}
    ref = _TorchSide(w, models, lrs)
    ref.run(batch)

    calls = {"apply": 0, "update": 0}

    def apply(net, *inputs, per_model=False):
        out = fused[net](*inputs, per_model=per_model)
        i = calls["apply"]
        calls["apply"] += 1
        assert out.shape[0] == B
        for k in range(B):
            _close(out[k], ref.outputs[k][i][0], f"{net} output {i} of model {k}")
        return out

    def update(net, losses):
        i = calls["update"]
        calls["update"] += 1
        f, opt = fused[net], opts[net]
        opt.zero_grad()
        losses.sum().backward()
        grads = hfta.per_model(f, ((n, p.grad) for n, p in f.named_parameters()))
        for k in range(B):
            ref_net, ref_losses, ref_grads, _ = ref.updates[k][i]
            assert ref_net == net
            _close(losses[k], ref_losses[0], f"{net} loss of model {k}")
            assert set(grads[k]) == set(ref_grads)
            for name, g in ref_grads.items():
                _close(grads[k][name], g, f"{net} gradient of model {k}'s {name}")
                grads[k][name].copy_(g)           # the step below starts from torch's own gradients
        opt.step()
        after = hfta.per_model(f, f.named_parameters())
        for k in range(B):
            for name, p in ref.updates[k][i][3].items():
                _close(after[k][name], p, f"{net} parameter {name} of model {k} after the step")

    w.step(apply, update, batch)
    assert calls["apply"] == len(ref.outputs[0]) and calls["update"] == len(ref.updates[0])

    # batch-norm running statistics (and counts) moved as the models' did
    for net, f in fused.items():
        per = hfta.per_model(f, f.named_buffers())
        for b, m in enumerate(models[net]):
            for name, buf in m.named_buffers():
                _close(per[b][name], buf, f"{net} buffer {name} of model {b}")


@pytest.mark.parametrize("opt_name", ["sgd", "adam", "adamw"])
def test_hfta_optimizer_steps_like_torch_per_model(opt_name):
    """Three steps (momentum buffers and bias corrections past their first step) of
    the fused optimizer on ``[B*C, ...]`` and ``[B, ...]`` parameters against B torch
    optimizers with their own learning rates."""
    torch.manual_seed(0)
    B, lrs = 3, [1e-3, 3e-2, 0.5]
    kw = {"sgd": dict(momentum=0.9, weight_decay=5e-4, nesterov=True), "adam": dict(betas=(0.8, 0.99)),
          "adamw": dict(betas=(0.9, 0.999), weight_decay=0.1)}[opt_name]
    shapes = [(5, 3, 3, 3), (7,), (4, 6)]
    per = [[torch.randn(s) for s in shapes] for _ in range(B)]
    ref = [[p.clone().requires_grad_() for p in ps] for ps in per]
    ref_opts = [OPTIMIZERS[opt_name](ps, lr=lrs[b], foreach=True, **kw) for b, ps in enumerate(ref)]
    fused = [nn.Parameter(torch.cat([per[b][0] for b in range(B)])),     # grouped conv weight [B*O, ...]
             nn.Parameter(torch.cat([per[b][1] for b in range(B)])),     # batch-norm weight [B*C]
             nn.Parameter(torch.stack([per[b][2] for b in range(B)]))]   # [B, ...]
    opt = hfta.optimizer(opt_name, fused, B, lr=lrs, **kw)
    for _ in range(3):
        grads = [[torch.randn(s) for s in shapes] for _ in range(B)]
        for b in range(B):
            for p, g in zip(ref[b], grads[b]):
                p.grad = g.clone()
            ref_opts[b].step()
        for i, f in enumerate(fused):
            f.grad = torch.cat([grads[b][i].reshape(1, -1) for b in range(B)]).view_as(f)
        opt.step()
        for b in range(B):
            for i, f in enumerate(fused):
                _close(f.detach().view(B, -1)[b], ref[b][i].detach().reshape(-1), f"{opt_name} model {b} param {i}")


def test_fuse_names_what_it_cannot_do():
    with pytest.raises(NotImplementedError, match="not implemented for workload 'nope'"):
        hfta.fuse("nope", "net", [nn.Linear(2, 2)])
    with pytest.raises(TypeError, match="expected ResNet18 models"):
        hfta.fuse("resnet18", "net", [nn.Linear(2, 2)])
    with pytest.raises(ValueError, match="expected 2 learning rates, got 3"):
        hfta.optimizer("sgd", [nn.Parameter(torch.randn(2, 3))], 2, lr=[0.1, 0.2, 0.3])
    convs = [nn.Conv2d(3, 4, 3), nn.Conv2d(3, 4, 5)]
    with pytest.raises(ValueError, match="must agree on Conv2d.kernel_size"):
        hfta.fuse_modules(convs)
