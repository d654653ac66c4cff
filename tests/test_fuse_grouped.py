"""Grouped regions of hfkern.fuse: values between convolution + batch norm calls and the
elementwise calls between them (activations, residual adds) stay in the grouped form
[N, B*C, *S], and become array views only where something else reads them."""

from __future__ import annotations

import contextlib

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import hfkern
from hfkern import _backend, fusion
from hfkern.plan._strategy import Strategy, apply


class Block(nn.Module):
    """ResNet's basic block: a residual add written in place, a ReLU module applied twice."""

    def __init__(self, c_in: int, c: int, stride: int = 1):
        super().__init__()
        self.conv1 = nn.Conv2d(c_in, c, 3, stride=stride, padding=1, bias=False)
        self.bn1 = nn.BatchNorm2d(c)
        self.relu = nn.ReLU(inplace=True)
        self.conv2 = nn.Conv2d(c, c, 3, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(c)
        self.down = None
        if stride != 1 or c_in != c:
            self.down = nn.Sequential(nn.Conv2d(c_in, c, 1, stride=stride, bias=False), nn.BatchNorm2d(c))

    def forward(self, x):
        identity = x if self.down is None else self.down(x)
        out = self.relu(self.bn1(self.conv1(x)))
        out = self.bn2(self.conv2(out))
        out += identity
        return self.relu(out)


class Net(nn.Module):
    """A small ResNet: a stem whose batch norm is a top-level block of its own (its output
    enters the region through a grouped view), two stages, pooling and a linear head."""

    def __init__(self):
        super().__init__()
        self.conv1 = nn.Conv2d(3, 4, 3, padding=1, bias=False)
        self.bn1 = nn.BatchNorm2d(4)
        self.relu = nn.ReLU(inplace=True)
        self.layer1 = nn.Sequential(Block(4, 4), Block(4, 4))
        self.layer2 = nn.Sequential(Block(4, 6, stride=2), Block(6, 6))
        self.fc = nn.Linear(6, 5)

    def forward(self, x):
        x = self.relu(self.bn1(self.conv1(x)))
        x = self.layer2(self.layer1(x))
        return self.fc(F.adaptive_avg_pool2d(x, 1).flatten(1))


def _ungrouped_fuse(models, monkeypatch):
    """hfkern.fuse without grouped regions: every call's output an array."""
    with monkeypatch.context() as m:
        m.setattr(fusion, "_group_regions", lambda *args: None)
        return hfkern.fuse(models)


def _targets(fused, cls):
    return [n.target for n in fused.graph.nodes if isinstance(n.target, cls)]


def test_the_values_between_the_calls_stay_grouped():
    fused = hfkern.fuse([Net() for _ in range(2)])
    calls = _targets(fused, fusion._ConvNorm)
    assert len(calls) == 9  # (the stem's pair spans two top-level blocks: a norm + ReLU call)
    assert all(c.grouped_in and c.grouped_out for c in calls)
    # the residual adds and the second ReLU of every block run on grouped values
    grouped = _targets(fused, fusion._GroupedCall)
    assert len(grouped) == 8 and sum(g.module for g in grouped) == 4
    views = [n for n in fused.graph.nodes if n.target is fusion.array_of_grouped]
    entries = [n for n in fused.graph.nodes if n.target is fusion.to_grouped]
    assert len(views) == 1 and len(entries) == 1  # out before the pooling, in after the stem


def test_a_chain_without_elementwise_calls_is_grouped_too():
    """Convolution + batch norm calls reading each other's outputs directly; the last output
    read by something else as an array."""
    class Chain(nn.Module):
        def __init__(self):
            super().__init__()
            self.body = nn.Sequential(nn.Conv2d(3, 4, 3, padding=1), nn.BatchNorm2d(4), nn.ReLU(),
                                      nn.Conv2d(4, 4, 3, padding=1), nn.BatchNorm2d(4))
            self.head = nn.Linear(4 * 25, 2)

        def forward(self, x):
            return self.head(self.body(x).flatten(1))

    models = [Chain() for _ in range(3)]
    fused = hfkern.fuse(models)
    first, second = _targets(fused, fusion._ConvNorm)
    assert (first.grouped_in, first.grouped_out, second.grouped_in, second.grouped_out) == (False, True, True, False)
    x = torch.randn(3, 2, 3, 5, 5)
    torch.testing.assert_close(fused(x), torch.stack([m(x[b]) for b, m in enumerate(models)]), rtol=1e-4, atol=1e-5)


def _train(model, x, y, steps, region=contextlib.nullcontext):
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    outs = []
    for step in range(steps):
        opt.zero_grad()
        with region():
            out = model(x + step)
            loss = F.cross_entropy(out.float().flatten(0, 1), y.flatten(), reduction="sum")
        loss.backward()
        outs.append(out.detach())
        grads = {k: p.grad.clone() for k, p in model.named_parameters()}
        opt.step()
    return outs, grads


def _train_as_the_arrays_do(case: str, device: str, monkeypatch) -> None:
    """Bit for bit what the same fused model without grouped regions computes: outputs,
    gradients, parameters and buffers over 3 steps (the same kernels on the same memory; from
    the second step on, the convolution + batch norm calls' steady state)."""
    B = 1 if case == "B1" else 3
    torch.manual_seed(0)
    models = [Net() for _ in range(B)]
    fused, plain = (m.to(device) for m in (hfkern.fuse(models), _ungrouped_fuse(models, monkeypatch)))
    if case == "channels_last":
        fused, plain = (m.to(memory_format=torch.channels_last) for m in (fused, plain))
    x, y = torch.randn(B, 4, 3, 6, 6, device=device), torch.randint(0, 5, (B, 4), device=device)
    region = contextlib.nullcontext
    if case == "bf16_autocast":
        region = lambda: torch.autocast(device, dtype=torch.bfloat16)  # noqa: E731
    elif case == "dispatched":
        region = _backend.dispatched_ops  # every call's op: the calls on arrays, then grouped views
    with hfkern.use_backend("torch"):
        ours, our_grads = _train(fused, x, y, 3, region)
        theirs, their_grads = _train(plain, x, y, 3, region)
    for a, b in zip(ours, theirs):
        assert torch.equal(a, b)
    for k in our_grads:
        assert torch.equal(our_grads[k], their_grads[k]), k
    for (k, a), b in zip(fused.state_dict().items(), plain.state_dict().values()):
        assert torch.equal(a, b), k


@pytest.mark.parametrize("case", ["contiguous", "channels_last", "B1", "bf16_autocast", "dispatched"])
def test_grouped_regions_train_as_the_arrays_do(case, monkeypatch):
    _train_as_the_arrays_do(case, "cpu", monkeypatch)


@pytest.mark.gpu
@pytest.mark.parametrize("case", ["contiguous", "channels_last", "B1", "bf16_autocast"])
def test_gpu_grouped_regions_train_as_the_arrays_do(case, deterministic, monkeypatch):
    """On CUDA: cuDNN's grouped convolutions and batch norms, deterministic algorithms (two
    runs of either model agree bit for bit only with them)."""
    _train_as_the_arrays_do(case, "cuda", monkeypatch)


def _train_as_the_torch_models_do(device: str) -> None:
    B = 3
    torch.manual_seed(1)
    models = [Net().to(device) for _ in range(B)]
    fused = hfkern.fuse(models)
    x = torch.randn(B, 4, 3, 6, 6, device=device)
    for step in range(3):  # the second and third: the steady state
        fused.zero_grad()
        y = fused(x + step)
        ys = [m(x[b] + step) for b, m in enumerate(models)]
        torch.testing.assert_close(y, torch.stack(ys), rtol=1e-4, atol=1e-5)
        y.square().sum().backward()
        for m, yb in zip(models, ys):
            m.zero_grad()
            yb.square().sum().backward()
        for name, p in fused.named_parameters():
            ref = torch.stack([dict(m.named_parameters())[name].grad for m in models])
            torch.testing.assert_close(p.grad, ref, rtol=1e-3, atol=1e-3 * ref.abs().max().item() + 1e-5)
    state = fused.state_dict()
    for b, m in enumerate(models):
        for k, v in m.state_dict().items():
            torch.testing.assert_close(state[k][b], v, rtol=1e-4, atol=1e-5)


def test_grouped_regions_train_as_the_torch_models_do():
    _train_as_the_torch_models_do("cpu")


@pytest.mark.gpu
def test_gpu_grouped_regions_train_as_the_torch_models_do(monkeypatch):
    """On CUDA, in float32 without TF32 (cuDNN's convolutions round to TF32 by default; the
    B torch models and the array would then agree to TF32's 1e-3 only)."""
    monkeypatch.setattr(torch.backends.cudnn, "allow_tf32", False)
    monkeypatch.setattr(torch.backends.cuda.matmul, "allow_tf32", False)
    with hfkern.use_backend("torch"):
        _train_as_the_torch_models_do("cuda")


def test_hooks_inside_a_region_see_arrays(monkeypatch):
    """A hook added after fusing, on an activation module or a convolution inside a region,
    sees the arrays [B, N, C, H, W] the models' modules would; the values are unchanged."""
    B = 2
    torch.manual_seed(2)
    models = [Net() for _ in range(B)]
    fused, plain = hfkern.fuse(models), _ungrouped_fuse(models, monkeypatch)
    x = torch.randn(B, 4, 3, 6, 6)
    seen = {}
    for path in ("layer1.0.relu", "layer2.1.conv1"):
        fused.get_submodule(path).register_forward_hook(
            lambda m, args, out, path=path: seen.__setitem__(path, (args[0].shape, out.detach().clone())))
    assert torch.equal(fused(x), plain(x))
    assert seen["layer1.0.relu"][0] == (B, 4, 4, 6, 6)
    assert seen["layer2.1.conv1"][0] == (B, 4, 6, 3, 3)
    with torch.no_grad():
        for b, m in enumerate(models):
            h = m.relu(m.bn1(m.conv1(x[b])))
            block = m.layer1[0]
            out = block.bn2(block.conv2(block.relu(block.bn1(block.conv1(h))))) + h
            # the hooked ReLU's last call: the block's output
            torch.testing.assert_close(seen["layer1.0.relu"][1][b], out.relu(), rtol=1e-4, atol=1e-5)


class Gated(nn.Module):
    """Grouped values of different shapes in one elementwise call: a one-channel gate times a
    four-channel map (the arrays broadcast over the channels; the grouped forms do not)."""

    def __init__(self):
        super().__init__()
        self.a = nn.Sequential(nn.Conv2d(3, 4, 3, padding=1), nn.BatchNorm2d(4))
        self.g = nn.Sequential(nn.Conv2d(3, 1, 3, padding=1), nn.BatchNorm2d(1))
        self.b = nn.Sequential(nn.Conv2d(4, 2, 3, padding=1), nn.BatchNorm2d(2))

    def forward(self, x):
        return self.b(self.a(x) * torch.sigmoid(self.g(x))).mean((2, 3))


def test_an_elementwise_call_of_grouped_values_of_different_shapes_runs_on_arrays():
    B = 3
    torch.manual_seed(3)
    models = [Gated() for _ in range(B)]
    fused = hfkern.fuse(models)
    assert len(_targets(fused, fusion._GroupedCall)) == 2  # the sigmoid and the product
    x = torch.randn(B, 2, 3, 5, 5)
    y = fused(x)
    ys = torch.stack([m(x[b]) for b, m in enumerate(models)])
    torch.testing.assert_close(y, ys, rtol=1e-4, atol=1e-5)
    y.square().sum().backward()
    ys.square().sum().backward()
    for name, p in fused.named_parameters():
        ref = torch.stack([dict(m.named_parameters())[name].grad for m in models])
        torch.testing.assert_close(p.grad, ref, rtol=1e-3, atol=1e-4, msg=name)


def test_recomputed_blocks_of_a_grouped_region(monkeypatch):
    """hfkern.plan's recomputation of blocks whose values cross the blocks' bounds grouped."""
    B = 2
    torch.manual_seed(4)
    models = [Net() for _ in range(B)]
    fused, plain = hfkern.fuse(models), _ungrouped_fuse(models, monkeypatch)
    apply(fused, Strategy(B, recompute=("layer1", "layer2")))
    x, y = torch.randn(B, 4, 3, 6, 6), torch.randint(0, 5, (B, 4))
    ours, our_grads = _train(fused, x, y, 2)
    theirs, their_grads = _train(plain, x, y, 2)
    for a, b in zip(ours, theirs):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
    for k in our_grads:
        torch.testing.assert_close(our_grads[k], their_grads[k], rtol=1e-5, atol=1e-6, msg=k)
    for (k, a), b in zip(fused.state_dict().items(), plain.state_dict().values()):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6, msg=k)


def test_a_pickled_fused_model_keeps_its_regions():
    import io
    B = 2
    fused = hfkern.fuse([Net() for _ in range(B)])
    x = torch.randn(B, 4, 3, 6, 6)
    buffer = io.BytesIO()
    torch.save(fused, buffer)
    buffer.seek(0)
    loaded = torch.load(buffer, weights_only=False)
    assert [(c.grouped_in, c.grouped_out) for c in _targets(loaded, fusion._ConvNorm)] == \
        [(c.grouped_in, c.grouped_out) for c in _targets(fused, fusion._ConvNorm)]
    assert torch.equal(loaded(x), fused(x))


class Inverted(nn.Module):
    """MobileNetV2's pattern: batch norms without an activation of their own, each followed by
    an in-place ReLU6 module; the first convolution reads the input every model shares."""

    def __init__(self):
        super().__init__()
        self.body = nn.Sequential(
            nn.Conv2d(3, 4, 3, padding=1, bias=False), nn.BatchNorm2d(4), nn.ReLU6(inplace=True),
            nn.Conv2d(4, 4, 3, padding=1, groups=4, bias=False), nn.BatchNorm2d(4), nn.ReLU6(inplace=True),
            nn.Conv2d(4, 3, 3, padding=1, bias=False), nn.BatchNorm2d(3))
        self.head = nn.Linear(3, 2)

    def forward(self, x):
        return self.head(self.body(x).mean((2, 3)))


def _backward_nodes(t: torch.Tensor) -> set[str]:
    seen, stack = set(), [t.grad_fn]
    while stack:
        f = stack.pop()
        if f is not None and f not in seen:
            seen.add(f)
            stack.extend(n for n, _ in f.next_functions)
    return {type(f).__name__ for f in seen}


@pytest.mark.parametrize("case", ["shared input", "dispatched",
                                  pytest.param("cuda shared input", marks=pytest.mark.gpu)])
def test_in_place_calls_after_a_call_on_arrays_stay_plain_in_place_ops(case, monkeypatch, request):
    """Where a convolution + batch norm call runs on arrays (a shared input, another backend)
    and gives its output to the region, an in-place activation after it is a plain in-place
    op (no view's rebase in the backward, CopySlices), with the values of the arrays' path."""
    device = "cuda" if case.startswith("cuda") else "cpu"
    if device == "cuda":
        request.getfixturevalue("deterministic")
    B = 3
    torch.manual_seed(5)
    models = [Inverted() for _ in range(B)]
    fused, plain = (m.to(device) for m in (hfkern.fuse(models), _ungrouped_fuse(models, monkeypatch)))
    assert [(c.grouped_in, c.grouped_out) for c in _targets(fused, fusion._ConvNorm)] == \
        [(False, True), (True, True), (True, False)]
    x = torch.randn(B, 4, 3, 6, 6, device=device)
    if case.endswith("shared input"):
        x = hfkern.broadcast(x[0], B)
    region = _backend.dispatched_ops if case == "dispatched" else contextlib.nullcontext
    with region():
        ours, theirs = fused(x), plain(x)
        assert "CopySlices" not in _backward_nodes(ours)
        assert torch.equal(ours, theirs)
        ours.square().sum().backward()
        theirs.square().sum().backward()
    for (k, a), b in zip(fused.named_parameters(), plain.parameters()):
        assert torch.equal(a.grad, b.grad), k


def test_a_hook_that_replaces_a_norm_output_is_seen_by_autograd(monkeypatch):
    """A forward hook on a batch norm inside a region that returns a tensor autograd saves (a
    sigmoid's output), which the in-place ReLU6 after it then changes: autograd refuses the
    backward, as it does for the arrays (never a gradient from the changed values). With a
    hook whose output nothing saves, the gradients are the arrays'."""
    B = 2
    torch.manual_seed(6)
    models = [Inverted() for _ in range(B)]
    x = torch.randn(B, 4, 3, 6, 6)
    for hook, raises in ((lambda mod, args, out: torch.sigmoid(out), True), (lambda mod, args, out: out * 2, False)):
        fused, plain = hfkern.fuse(models), _ungrouped_fuse(models, monkeypatch)
        for m in (fused, plain):
            m.body[1].register_forward_hook(hook)
        ours, theirs = fused(x), plain(x)
        assert torch.equal(ours, theirs)
        for out in (ours, theirs):
            if raises:
                with pytest.raises(RuntimeError, match="modified by an inplace operation"):
                    out.square().sum().backward()
            else:
                out.square().sum().backward()
        if not raises:
            for (k, a), b in zip(fused.named_parameters(), plain.parameters()):
                assert torch.equal(a.grad, b.grad), k
