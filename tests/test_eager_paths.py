"""The eager paths of the torch backend (``hfkern._backend.eager_torch``): where the torch
backend serves an array convolution or a training batch norm outside ``torch.compile``,
``hfkern.nn`` runs the torch implementation under torch's own autograd instead of
dispatching the op; the other norms, the embedding and the optimizers call the
registered implementations without the dispatcher. Everything a caller sees must be
what the dispatched op gives: values, dtypes, strides, running statistics, gradients
and their layouts, optimizer state."""

from __future__ import annotations

import contextlib

import pytest
import torch
from torch import nn

import hfkern
import hfkern.nn as hnn
import hfkern.ops.batch_norm as bn_ops
import hfkern.ops.conv as conv_ops
from hfkern import _backend
from hfkern._array import array_memory_format
from _util import CallCounter

GRAD_TOL = dict(atol=1e-5, rtol=1e-5)


_Calls = CallCounter


def _path(eager: bool):
    """The eager paths (the default) or, for the reference, every op dispatched."""
    return contextlib.nullcontext() if eager else _backend.dispatched_ops()


class _RegistryCalls:
    """Counts the calls of a backend's registered implementation of an op."""

    def __init__(self, request, op, backend="torch"):
        self.n, impl = 0, _backend._registry[op][backend]
        fn = impl.load()

        def counted(*args, **kwargs):
            self.n += 1
            return fn(*args, **kwargs)
        _backend.register(op, backend, counted, device_types=impl.device_types or None, auto=impl.auto,
                          dtypes=impl.dtypes or None)
        request.addfinalizer(lambda: _backend.register(op, backend, fn, device_types=impl.device_types or None,
                                                       auto=impl.auto, dtypes=impl.dtypes or None))


def _layout(t: torch.Tensor, layout: str) -> torch.Tensor:
    """``t`` [B, N, C, *s] with the same values in another memory layout."""
    if layout == "contiguous":
        return t.contiguous()
    if layout == "batch_major":  # [N, B, ...] memory: an array conv's output
        return t.transpose(0, 1).contiguous().transpose(0, 1)
    if layout == "channels_last":  # [N, H, W, B, C] memory
        return t.permute(1, 3, 4, 0, 2).contiguous().permute(3, 0, 4, 1, 2)
    if layout == "strided":
        wide = torch.zeros(*t.shape[:-1], 2 * t.shape[-1], dtype=t.dtype)
        wide[..., ::2] = t
        return wide[..., ::2]
    raise ValueError(layout)


def _run(module: nn.Module, x: torch.Tensor, grad_seed: int, *, eager: bool):
    """Forward and backward of a copy of ``module`` on a fresh leaf with ``x``'s values and
    strides: (output, input grad, {name: param grad}, {name: buffer})."""
    import copy

    m = copy.deepcopy(module)
    leaf = x.detach().clone(memory_format=torch.preserve_format).requires_grad_()
    if leaf.stride() != x.stride():  # clone keeps dense layouts only
        leaf = torch.empty_strided(x.shape, x.stride()).copy_(x).requires_grad_()
    with _path(eager):
        y = m(leaf)
        g = torch.randn(y.shape, generator=torch.Generator().manual_seed(grad_seed))
        y.backward(g)
    return y, leaf.grad, {n: p.grad for n, p in m.named_parameters()}, {n: b.clone() for n, b in m.named_buffers()}


def _strides(t: torch.Tensor) -> tuple:
    """The strides that place elements (a dim of size one has none that matters)."""
    return tuple(s for n, s in zip(t.shape, t.stride()) if n > 1)


def _assert_same(a, b, *, exact_forward=True):
    ya, gxa, pa, ba = a
    yb, gxb, pb, bb = b
    assert ya.dtype == yb.dtype and ya.shape == yb.shape and ya.stride() == yb.stride()
    if exact_forward:  # the same kernels on the same memory
        assert torch.equal(ya, yb)
    else:
        torch.testing.assert_close(ya, yb)
    assert gxa.dtype == gxb.dtype
    torch.testing.assert_close(gxa, gxb, **GRAD_TOL)
    assert pa.keys() == pb.keys()
    for n in pa:
        assert _strides(pa[n]) == _strides(pb[n]), n  # gradients laid out like their parameters
        torch.testing.assert_close(pa[n], pb[n], **GRAD_TOL, msg=n)
    for n in ba:
        torch.testing.assert_close(ba[n], bb[n], atol=0, rtol=0, msg=n)


CONVS = [
    # (module factory, one model's input shape)
    (lambda B: hnn.Conv2d(3, 5, 3, padding=1, B=B), (4, 3, 7, 9)),
    (lambda B: hnn.Conv2d(4, 6, 3, stride=2, dilation=2, groups=2, bias=False, B=B), (3, 4, 11, 10)),
    (lambda B: hnn.Conv2d(4, 6, 1, B=B), (2, 4, 8, 8)),  # the CPU's batched-matmul 1x1 path
    (lambda B: hnn.Conv2d(3, 4, 3, padding="same", padding_mode="reflect", B=B), (2, 3, 6, 5)),
    (lambda B: hnn.Conv1d(4, 6, 3, padding=2, B=B), (3, 4, 13)),
    (lambda B: hnn.Conv1d(4, 6, 1, B=B), (3, 4, 64)),
    (lambda B: hnn.ConvTranspose2d(4, 3, 3, stride=2, padding=1, output_padding=1, B=B), (2, 4, 5, 6)),
    (lambda B: hnn.ConvTranspose1d(6, 4, 4, stride=3, groups=2, B=B), (2, 6, 7)),
]


@pytest.mark.parametrize("B", [1, 3])
@pytest.mark.parametrize("case", range(len(CONVS)))
@pytest.mark.parametrize("layout", ["contiguous", "batch_major", "channels_last", "strided"])
def test_conv_eager_path_equals_the_op(case, B, layout, monkeypatch):
    make, shape = CONVS[case]
    if layout == "channels_last" and len(shape) != 4:
        pytest.skip("channels-last memory is 2-D only")
    torch.manual_seed(case)
    module = make(B)
    x = _layout(torch.randn(B, *shape), layout)
    ops = _Calls(monkeypatch, conv_ops, "array_conv")
    eager = _run(module, x, case, eager=True)
    # the op was not dispatched; the CPU's 1x1 convolutions as batched matmuls keep its
    # formula in an autograd Function, the others run under torch's autograd
    assert ops.n == 0
    pointwise = all(k == 1 for k in module.kernel_size) and not module._transposed and layout != "channels_last"
    assert ("_EagerConv" in eager[0].grad_fn.name()) == pointwise
    dispatched = _run(module, x, case, eager=False)
    assert ops.n > 0
    _assert_same(eager, dispatched)
    if layout in ("batch_major", "channels_last"):  # the array keeps its memory order
        assert array_memory_format(eager[0]) == array_memory_format(x)


@pytest.mark.parametrize("B", [1, 3])
def test_conv_eager_path_with_a_shared_input(B, monkeypatch):
    torch.manual_seed(1)
    module = hnn.Conv2d(3, 4, 3, groups=1, B=B)
    base = torch.randn(2, 3, 6, 6)
    results = []
    for eager in (True, False):
        m = hnn.Conv2d(3, 4, 3, B=B)
        m.load_state_dict(module.state_dict())
        leaf = base.clone().requires_grad_()
        with _path(eager):
            y = m(hfkern.broadcast(leaf, B))
            y.backward(torch.ones_like(y))
        results.append((y, leaf.grad, m.weight.grad, m.bias.grad))
    (y, gx, gw, gb), (y2, gx2, gw2, gb2) = results
    assert torch.equal(y, y2) and y.stride() == y2.stride()
    for a, b in ((gx, gx2), (gw, gw2), (gb, gb2)):
        torch.testing.assert_close(a, b, **GRAD_TOL)


def test_conv_eager_path_under_autocast_computes_in_the_region_dtype():
    torch.manual_seed(2)
    module = hnn.Conv2d(3, 4, 3, B=2)
    x = torch.randn(2, 2, 3, 8, 8)
    outs = []
    for eager in (True, False):
        with _path(eager), \
                torch.autocast("cpu", dtype=torch.bfloat16):
            outs.append(module(x))
    assert outs[0].dtype == outs[1].dtype == torch.bfloat16
    assert torch.equal(outs[0], outs[1])


@pytest.mark.parametrize("kernel_size", [3, 1], ids=["conv", "pointwise"])
def test_conv_eager_path_is_differentiable_twice(kernel_size):
    """Gradient penalties: torch's convolution backward is differentiable, as the op's formulas
    are (the 1x1 convolutions' Function runs them under create_graph)."""
    torch.manual_seed(3)
    module = hnn.Conv2d(2, 3, kernel_size, B=2)
    x = torch.randn(2, 2, 2, 5, 5)
    grads = []
    for eager in (True, False):
        module.zero_grad()
        leaf = x.clone().requires_grad_()
        with _path(eager):
            (gx,) = torch.autograd.grad(module(leaf).square().sum(), leaf, create_graph=True)
            gx.square().sum().backward()
        grads.append(module.weight.grad.clone())
    torch.testing.assert_close(grads[0], grads[1], **GRAD_TOL)


def test_conv_checks_arguments_on_the_eager_path():
    w = torch.randn(2, 4, 3, 3, 3)
    with pytest.raises(NotImplementedError):
        conv_ops.conv(torch.randn(2, 1, 3, 4, 4, 4), torch.randn(2, 4, 3, 3, 3, 3), None, [1] * 3, [0] * 3,
                      [1] * 3, False, [0] * 3, 1)
    with pytest.raises(ValueError):
        conv_ops.conv(torch.randn(2, 1, 3, 6, 6), w, None, [1], [0, 0], [1, 1], False, [0, 0], 1)


@pytest.mark.parametrize("B", [1, 2, 3])  # B = 1: x's strides on B too (a dim of size one)
@pytest.mark.parametrize("layout", ["batch_major", "channels_last", "contiguous"])
@pytest.mark.parametrize("momentum", [0.1, None])
@pytest.mark.parametrize("activation", ["none", "relu"])
@pytest.mark.parametrize("affine", [True, False])
def test_batch_norm_eager_path_equals_the_op(B, layout, momentum, activation, affine, monkeypatch, request):
    torch.manual_seed(B)
    module = hnn.BatchNorm2d(5, momentum=momentum, affine=affine, activation=activation, B=B)
    if affine:
        with torch.no_grad():
            module.weight.uniform_(0.5, 1.5)
            module.bias.uniform_(-0.5, 0.5)
    module.num_batches_tracked.copy_(torch.arange(B) + 2)  # per-model counts: momentum=None differs by model
    x = _layout(torch.randn(B, 4, 5, 3, 6), layout)
    ops = _Calls(monkeypatch, bn_ops, "array_batch_norm_op")
    direct = _RegistryCalls(request, "array_batch_norm")
    eager = _run(module, x, B, eager=True)
    assert ops.n == 0
    # Contiguous [B, N, ...] memory has no free grouped view: torch's kernel on a copy of
    # it, under torch's autograd as on the free view; the op's torch path copies alike.
    assert direct.n == 0
    dispatched = _run(module, x, B, eager=False)
    assert ops.n > 0 and direct.n == 1
    _assert_same(eager, dispatched)


def test_batch_norm_eager_path_in_mixed_precision():
    """bf16 activations with float32 parameters and statistics (what autocast's convs feed it)."""
    torch.manual_seed(4)
    B, C = 2, 3
    x0 = _layout(torch.randn(B, 4, C, 5, 5), "batch_major").bfloat16()
    results = []
    for eager in (True, False):
        x = torch.empty_strided(x0.shape, x0.stride(), dtype=x0.dtype).copy_(x0).requires_grad_()
        w = torch.linspace(0.5, 1.5, B * C).view(B, C).requires_grad_()
        b = torch.linspace(-0.5, 0.5, B * C).view(B, C).requires_grad_()
        rm, rv = torch.zeros(B, C), torch.ones(B, C)
        with _path(eager):
            y, mean, rstd = bn_ops.array_batch_norm(x, w, b, rm, rv, None, True, 0.1, 1e-5, "relu")
            y.backward(torch.ones_like(y))
        results.append((y, mean, rstd, rm, rv, x.grad, w.grad, b.grad))
    for a, b in zip(*results):
        assert a.dtype == b.dtype and _strides(a) == _strides(b)
        torch.testing.assert_close(a, b, atol=0, rtol=0)
    assert results[0][0].dtype == torch.bfloat16 and results[0][1].dtype == torch.float32


@pytest.mark.parametrize("layout", ["contiguous", "batch_major"])
@pytest.mark.parametrize("activation", ["none", "relu"])
def test_batch_norm_eager_path_on_linear_outputs(layout, activation, monkeypatch, request):
    """BatchNorm1d on [B, N, C] (a linear layer's output, B-major; or [N, B, C] memory): torch's
    batch norm on the grouped [N, B*C] (a copy where the memory is B-major) under torch's own
    autograd; the dispatched op's results, strides included."""
    B, C = 3, 6
    module = hnn.BatchNorm1d(C, activation=activation, B=B)
    with torch.no_grad():
        module.weight.uniform_(0.5, 1.5)
        module.bias.uniform_(-0.5, 0.5)
    x = torch.randn(B, 7, C)
    if layout == "batch_major":
        x = x.transpose(0, 1).contiguous().transpose(0, 1)
    ops = _Calls(monkeypatch, bn_ops, "array_batch_norm_op")
    direct = _RegistryCalls(request, "array_batch_norm")
    eager = _run(module, x, B, eager=True)
    assert (ops.n, direct.n) == (0, 0)
    dispatched = _run(module, x, B, eager=False)
    assert (ops.n, direct.n) == (1, 1)
    _assert_same(eager, dispatched)


@pytest.mark.parametrize("case", ["eval", "gelu", "one channel"])
def test_batch_norm_cases_the_autograd_function_serves_without_the_dispatcher(case, monkeypatch, request):
    """What torch's batch norm under autograd does not serve runs the op's autograd Function,
    which calls the torch implementations directly: the dispatched op's results."""
    B = 2
    C = 1 if case == "one channel" else 3
    module = (hnn.BatchNorm1d if case == "1-d" else hnn.BatchNorm2d)(
        C, activation="gelu" if case == "gelu" else "relu", B=B)
    if case == "eval":
        module.running_mean.uniform_(-1, 1)
        module.eval()
    shape = (B, 4, C) if case == "1-d" else (B, 4, C, 5, 5)
    x = torch.randn(shape).transpose(0, 1).contiguous().transpose(0, 1)
    ops = _Calls(monkeypatch, bn_ops, "array_batch_norm_op")
    direct = _RegistryCalls(request, "array_batch_norm")
    eager = _run(module, x, 0, eager=True)
    assert (ops.n, direct.n) == (0, 1)
    dispatched = _run(module, x, 0, eager=False)
    assert (ops.n, direct.n) == (1, 2)
    _assert_same(eager, dispatched)


def test_batch_norm_eager_path_checks_before_changing_state():
    module = hnn.BatchNorm2d(3, B=2)
    before = module.running_mean.clone()
    x = _layout(torch.randn(2, 4, 3, 5, 5), "batch_major")
    with pytest.raises(ValueError):
        bn_ops.array_batch_norm(x, module.weight, module.bias, module.running_mean[:, :2], module.running_var,
                                module.num_batches_tracked, True, 0.1, 1e-5)
    assert torch.equal(module.running_mean, before)


def test_eager_paths_follow_the_selected_backend(monkeypatch):
    """``use_backend("torch")`` and ``auto`` on the CPU take them; under torch.compile the ops stay."""
    x = torch.randn(2, 3, 3, 6, 6)
    for selection in ("torch", "auto"):
        with hfkern.use_backend(selection):
            assert _backend.eager_torch("array_conv", x.device)
    with _backend.dispatched_ops():
        assert not _backend.eager_torch("array_conv", x.device)
    assert _backend.eager_torch("array_conv", x.device)
    monkeypatch.setattr(torch.compiler, "is_compiling", lambda: True)
    assert not _backend.eager_torch("array_conv", x.device)


def test_fused_resnet_block_trains_the_same_on_both_paths():
    """A fused model of torch modules (hfkern.fuse: conv, batch norm + ReLU, residual add in place)
    trains identically for a few optimizer steps on either path."""
    from bench.models.resnet import BasicBlock

    torch.manual_seed(5)
    models = [nn.Sequential(nn.Conv2d(3, 8, 3, padding=1, bias=False), nn.BatchNorm2d(8), nn.ReLU(inplace=True),
                            BasicBlock(8, 8), nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(8, 4))
              for _ in range(3)]
    x, y = torch.randn(6, 3, 8, 8), torch.randint(0, 4, (6,))
    losses = []
    for eager in (True, False):
        fused = hfkern.fuse(models)
        opt = hfkern.optim.SGD(fused.parameters(), lr=[0.1, 0.05, 0.02], momentum=0.9)
        run = []
        for _ in range(3):
            opt.zero_grad()
            with _path(eager):
                loss = hfkern.nn.functional.cross_entropy(fused(hfkern.broadcast(x, 3)), hfkern.broadcast(y, 3))
                loss.sum().backward()
            opt.step()
            run.append(loss.detach())
        losses.append((torch.stack(run), [p.detach().clone() for p in fused.parameters()]))
    torch.testing.assert_close(losses[0][0], losses[1][0], **GRAD_TOL)
    for a, b in zip(losses[0][1], losses[1][1]):
        torch.testing.assert_close(a, b, **GRAD_TOL)


def _graph_names(t: torch.Tensor) -> set[str]:
    """The names of every node of ``t``'s backward graph."""
    names, todo, seen = set(), [t.grad_fn], set()
    while todo:
        fn = todo.pop()
        if fn is None or fn in seen:
            continue
        seen.add(fn)
        names.add(type(fn).__name__)
        todo += [f for f, _ in fn.next_functions]
    return names


@pytest.mark.parametrize("layout", ["batch_major", "channels_last"])
def test_in_place_ops_on_eager_outputs_are_plain_and_exact(layout):
    """A residual ``+=`` and an in-place activation on the outputs: no view rebase (whose
    backward copies the whole base per op), and the op's gradients."""
    torch.manual_seed(6)
    conv, bn = hnn.Conv2d(3, 3, 3, padding=1, B=2), hnn.BatchNorm2d(3, B=2)
    x0 = _layout(torch.randn(2, 4, 3, 6, 6), layout)
    results = []
    for eager in (True, False):
        c, b = conv.__class__(3, 3, 3, padding=1, B=2), bn.__class__(3, B=2)
        c.load_state_dict(conv.state_dict())
        b.load_state_dict(bn.state_dict())
        x = torch.empty_strided(x0.shape, x0.stride()).copy_(x0).requires_grad_()
        with _path(eager):
            y = c(x)
            assert not y._is_view()
            y = torch.nn.functional.leaky_relu(y, 0.2, inplace=True)
            z = b(y)
            z += x
            z.relu_()
            if eager:
                assert "CopySlices" not in _graph_names(z) and "AsStridedBackward0" not in _graph_names(z)
            z.backward(torch.ones_like(z))
        results.append((z.detach(), x.grad, c.weight.grad, b.weight.grad, b.running_var.clone()))
    for a, b_ in zip(*results):
        torch.testing.assert_close(a, b_, **GRAD_TOL)


def test_in_place_change_of_an_eager_relu_output_is_an_error_as_in_torch():
    """Batch norm + ReLU saves its output, as torch's ReLU does: changing it in place before
    backward raises, as it does for B torch modules, rather than giving a wrong gradient."""
    bn = hnn.BatchNorm2d(3, activation="relu", B=2)
    x = _layout(torch.randn(2, 4, 3, 5, 5), "batch_major").requires_grad_()
    y = bn(x)
    y += 1
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        y.sum().backward()
    ref = nn.BatchNorm2d(3)
    r = torch.relu(ref(torch.randn(4, 3, 5, 5, requires_grad=True)))
    r += 1
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        r.sum().backward()


NORMS = [
    lambda B: hnn.LayerNorm(6, B=B),
    lambda B: hnn.LayerNorm((3, 6), bias=False, B=B),
    lambda B: hnn.LayerNorm(6, elementwise_affine=False, B=B),
    lambda B: hnn.LayerNorm(6, activation="gelu", B=B),
    lambda B: hnn.LayerNorm(6, bias=False, activation="relu", B=B),
    lambda B: hnn.RMSNorm(6, B=B),
    lambda B: hnn.RMSNorm(6, eps=1e-3, elementwise_affine=False, B=B),
]


@pytest.mark.parametrize("B", [1, 3])
@pytest.mark.parametrize("case", range(len(NORMS)))
@pytest.mark.parametrize("strided", [False, True])
def test_layer_norms_without_the_dispatcher_equal_the_ops(case, B, strided, request):
    """In eager mode LayerNorm on dense float32 input runs torch's layer norm and the affine step
    under torch's autograd: the op's output exactly, its gradients to rounding. Otherwise
    LayerNorm and RMSNorm call the registered torch implementations from their own autograd
    Function: exactly the dispatched op's results."""
    torch.manual_seed(case)
    module = NORMS[case](B)
    with torch.no_grad():
        for p in module.parameters():
            p.uniform_(0.5, 1.5)
    op = "array_rms_norm" if isinstance(module, hnn.RMSNorm) else "array_layer_norm"
    x = torch.randn(B, 4, 3, 6)
    if strided:
        x = _layout(x, "strided")
    fwd, bwd = _RegistryCalls(request, op), _RegistryCalls(request, op + "_backward")
    eager = _run(module, x, case, eager=True)
    dispatched = _run(module, x, case, eager=False)
    native = op == "array_layer_norm" and not strided
    # each path ran the torch implementations once, but the native eager path
    assert (fwd.n, bwd.n) == ((1, 1) if native else (2, 2))
    _assert_same(eager, dispatched)
    if native:
        assert eager[0].grad_fn is not None and "Backward" in eager[0].grad_fn.name()
        assert "Eager" not in eager[0].grad_fn.name()  # C++ nodes, no Python Function
        return
    for a, b in zip(eager[2].values(), dispatched[2].values()):
        assert torch.equal(a, b)  # the same functions on the same arguments
    assert torch.equal(eager[1], dispatched[1])


@pytest.mark.parametrize("make, shape", [
    (lambda: hnn.BatchNorm1d(3, B=2), (2, 5, 3)),
    (lambda: hnn.LayerNorm(5, B=2), (2, 3, 5)),
    (lambda: hnn.RMSNorm(5, B=2), (2, 3, 5)),
])
def test_norm_functions_are_differentiable_twice(make, shape):
    """create_graph=True: the Functions' backward runs the op's formula, which dispatches the
    backward op for its double-backward formula."""
    torch.manual_seed(7)
    module = make()
    x0 = torch.randn(shape)
    grads = []
    for eager in (True, False):
        module.zero_grad()
        x = x0.clone().requires_grad_()
        with _path(eager):
            (gx,) = torch.autograd.grad(module(x).pow(3).sum(), x, create_graph=True)
            gx.square().sum().backward()
        grads.append((x.grad.clone(), module.weight.grad.clone()))
    for a, b in zip(*grads):
        torch.testing.assert_close(a, b, **GRAD_TOL)


def test_layer_norm_checks_arguments_on_the_eager_path():
    from hfkern.ops.layer_norm import layer_norm

    with pytest.raises(ValueError):
        layer_norm(torch.randn(2, 3, 6), torch.randn(2, 5), None, 1, 1e-5)
    with pytest.raises(ValueError):
        layer_norm(torch.randn(2, 3, 6), None, None, 1, 1e-5, "tanh")


EMBEDDINGS = [
    dict(),
    dict(padding_idx=2),
    dict(scale_grad_by_freq=True),
    dict(padding_idx=0, scale_grad_by_freq=True),
    dict(sparse=True),
]


@pytest.mark.parametrize("shared", [False, True])
@pytest.mark.parametrize("case", range(len(EMBEDDINGS)))
def test_embedding_without_the_dispatcher_equals_the_op(case, shared, request):
    """hfkern.nn.Embedding calls the registered torch implementations from its own autograd
    Function in eager mode (the sparse backward keeps the op's): the dispatched op's results."""
    torch.manual_seed(case)
    B = 3
    module = hnn.Embedding(7, 4, B=B, **EMBEDDINGS[case])
    idx = torch.randint(0, 7, (5, 6)) if shared else torch.randint(0, 7, (B, 5, 6))
    if shared:
        idx = hfkern.broadcast(idx, B)
    fwd = _RegistryCalls(request, "array_embedding")
    results = []
    for eager in (True, False):
        module.zero_grad()
        with _path(eager):
            y = module(idx)
            y.backward(torch.randn(y.shape, generator=torch.Generator().manual_seed(case)))
        g = module.weight.grad
        results.append((y.detach(), g.to_dense() if g.is_sparse else g.clone()))
    assert fwd.n == 2
    for a, b in zip(*results):
        assert torch.equal(a, b)


# ---- optimizer steps --------------------------------------------------------------

OPTIMIZERS = [
    ("SGD", dict(lr=[0.1, 0.05, 0.2], momentum=[0.9, 0.0, 0.5], weight_decay=1e-2)),
    ("SGD", dict(lr=0.1, momentum=0.9, nesterov=True)),
    ("Adam", dict(lr=[1e-2, 2e-2, 5e-3], amsgrad=True, weight_decay=1e-3)),
    ("AdamW", dict(lr=1e-2, maximize=True)),
    ("Adagrad", dict(lr=[0.1, 0.2, 0.05])),
    ("Adadelta", dict(lr=1.0, weight_decay=1e-2)),
    ("RMSprop", dict(lr=1e-2, momentum=0.5, centered=True)),
    ("LARS", dict(lr=0.1, momentum=0.9, weight_decay=1e-3)),
    ("LAMB", dict(lr=1e-2, weight_decay=1e-2)),
]


@pytest.mark.parametrize("skip_some", [False, True])
@pytest.mark.parametrize("case", range(len(OPTIMIZERS)), ids=[f"{n}{i}" for i, (n, _) in enumerate(OPTIMIZERS)])
def test_optimizer_steps_without_the_dispatcher_equal_the_op(case, skip_some, monkeypatch):
    """In eager mode an array optimizer calls the selected implementation of its step directly
    (checks included) rather than through the op: bit for bit the op's parameters and state,
    for float32 and bfloat16 parameters, with a skip mask."""
    import hfkern.optim as hoptim
    from hfkern.ops import optim as optim_ops

    name, kwargs = OPTIMIZERS[case]
    cls = getattr(hoptim, name)
    op_name = cls._spec.op
    calls = _Calls(monkeypatch, optim_ops, op_name)
    torch.manual_seed(case)
    init = [torch.randn(3, 4, 3), torch.randn(3, 5), torch.randn(3, 2, 2).bfloat16()]
    grads = [[torch.randn_like(t) for t in init] for _ in range(3)]
    skip = torch.tensor([False, True, False]) if skip_some else None
    results = []
    for eager in (True, False):
        params = [nn.Parameter(t.clone()) for t in init]
        opt = cls(params, **kwargs)
        with _path(eager):
            for step_grads in grads:
                for p, g in zip(params, step_grads):
                    p.grad = g.clone()
                versions = [p._version for p in params]
                opt.step(skip=skip)
                # every parameter written in place, as autograd's saved-tensor check must see
                assert all(p._version > v for p, v in zip(params, versions))
        if eager:
            assert calls.n == 0
        results.append((params, opt.state_dict()["state"]))
    assert calls.n == len(grads)
    (p_eager, s_eager), (p_op, s_op) = results
    for a, b in zip(p_eager, p_op):
        assert torch.equal(a, b)
    for i in s_op:
        assert s_eager[i].keys() == s_op[i].keys()
        for key in s_op[i]:
            assert torch.equal(s_eager[i][key], s_op[i][key]), (i, key)
