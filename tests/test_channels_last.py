"""Channels-last array images: [N, H, W, B, C] memory through convs, norms,
activations, pooling, residual adds and the classifier, against B torch models."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import hfkern
import hfkern.nn as hnn
from hfkern import _evidence
from hfkern._array import array_memory_format, to_array_memory_format, to_grouped
from _util import GRAD_TOL, array_input, compare_modules, torch_modules

CL, NCHW = torch.channels_last, torch.contiguous_format
TOL = dict(atol=1e-5, rtol=1e-5)


def _cl(shape, B, **kw):
    return array_input(shape, B, layout="channels_last", **kw)


# ---- the memory format helpers -------------------------------------------------

def test_array_memory_format_names_the_grouped_views_format():
    x, _, _ = _cl((2, 3, 4, 5), 3)
    assert array_memory_format(x) == CL
    assert to_grouped(x).is_contiguous(memory_format=CL) and to_grouped(x).data_ptr() == x.data_ptr()
    nchw, _, _ = array_input((2, 3, 4, 5), 3, layout="batch_major")
    assert array_memory_format(nchw) == NCHW
    assert array_memory_format(torch.randn(3, 2, 3, 4, 5)) == NCHW
    # H = W = 1: memory in both formats at once; the exact strides decide
    assert array_memory_format(torch.randn(2, 1, 1, 3, 4).permute(3, 0, 4, 1, 2)) == CL
    assert array_memory_format(torch.randn(2, 3, 4, 1, 1).transpose(0, 1)) == NCHW
    one_channel = torch.randn(2, 1, 4, 5)  # both formats: the default unless strided as channels-last
    assert array_memory_format(one_channel, shared=True) == NCHW
    assert array_memory_format(torch.empty_like(one_channel, memory_format=CL), shared=True) == CL
    assert array_memory_format(to_array_memory_format(hfkern.broadcast(one_channel, 2), CL)) == CL
    shared = torch.randn(2, 3, 4, 5).contiguous(memory_format=CL)
    assert array_memory_format(shared, shared=True) == CL
    assert array_memory_format(hfkern.broadcast(shared, 3)) == CL
    y = to_array_memory_format(nchw, CL)
    assert array_memory_format(y) == CL and torch.equal(y, nchw)
    assert to_array_memory_format(y, CL) is y
    back = to_array_memory_format(y, NCHW)
    assert back.transpose(0, 1).is_contiguous() and torch.equal(back, nchw)


def _memory_format_by_views(x, shared=False):
    """array_memory_format's definition in torch's own contiguity checks on views."""
    from hfkern._array import _TO_NHWBC, _canonical_strides, is_shared
    image = shared or (x.dim() == 5 and is_shared(x))
    if image:
        x = x[0] if x.dim() == 5 else x
        if x.dim() != 4:
            return NCHW
        channels_last, nchw = x.is_contiguous(memory_format=CL), x.is_contiguous()
    else:
        if x.dim() != 5:
            return NCHW
        channels_last, nchw = x.permute(_TO_NHWBC).is_contiguous(), x.transpose(0, 1).is_contiguous()
    if channels_last and nchw:
        channels_last = x.stride() == _canonical_strides(x, CL, image) != _canonical_strides(x, NCHW, image)
    return CL if channels_last else NCHW


def test_array_memory_format_reads_strides_as_torchs_contiguity_checks_do():
    # array_memory_format and per_model_memory_first read sizes and strides without
    # making views: the same answers as torch's checks on the views, for permuted,
    # expanded, arbitrarily strided and empty tensors of every rank they see.
    from hfkern._array import per_model_memory_first
    gen = torch.Generator().manual_seed(0)

    def pick(options):
        return options[int(torch.randint(len(options), (1,), generator=gen))]

    checked = 0
    for _ in range(3000):
        rank = pick([3, 4, 5])
        shape = [pick([0, 1, 1, 2, 3]) for _ in range(rank)]
        kind = pick(["permuted", "strided", "expanded"])
        if kind == "strided":
            x = torch.empty(600).as_strided(shape, [pick([0, 1, 2, 3, 6]) for _ in range(rank)])
        else:
            perm = torch.randperm(rank, generator=gen).tolist()
            x = torch.empty([shape[p] for p in perm]).permute([perm.index(i) for i in range(rank)])
            if kind == "expanded" and rank == 4:
                x = x.unsqueeze(0).expand(pick([1, 2, 3]), *shape)
        for shared in (False, True) if x.dim() == 4 else (False,):
            assert array_memory_format(x, shared) == _memory_format_by_views(x, shared), (
                x.shape, x.stride(), shared)
            checked += 1
        assert per_model_memory_first(x) == x.transpose(0, 1).is_contiguous(), (x.shape, x.stride())
    assert checked > 3000


# ---- the conv ops keep the input's format ----------------------------------------

def _conv_fns(backend):
    """(forward, input grad, weight grad) of one backend, called as the ops are."""
    if backend == "triton":
        pytest.importorskip("triton")
        from hfkern.triton import conv as tc
        return tc.array_conv, tc.array_conv_input_grad, tc.array_conv_weight_grad
    ops = torch.ops.hfkern
    return ops.array_conv, ops.array_conv_input_grad, ops.array_conv_weight_grad


@pytest.mark.parametrize("backend", ["torch", pytest.param("triton", marks=pytest.mark.interpreter)])
@pytest.mark.parametrize("shared", [False, True])
@pytest.mark.parametrize("groups,transposed", [(1, False), (2, False), (1, True)])
def test_conv_ops_follow_the_input_memory_format(backend, shared, groups, transposed):
    B, N, C, H, W = 3, 2, 4, 5, 6
    torch.manual_seed(0)
    if shared:
        x_ref = torch.randn(N, C, H, W)
        x = x_ref.contiguous(memory_format=CL)
    else:
        x, _, _ = _cl((N, C, H, W), B, requires_grad=False)
        x_ref = x.contiguous()
    w_shape = (B, C, 6 // groups, 3, 3) if transposed else (B, 6, C // groups, 3, 3)
    weight = torch.randn(w_shape)
    bias = torch.randn(B, 6)
    args = ([2, 1], [1, 1], [1, 1], transposed, [1, 0] if transposed else [0, 0], groups)
    conv, input_grad, weight_grad = _conv_fns(backend)
    ops = torch.ops.hfkern  # the torch path on the default memory: the reference
    y = conv(x, weight, bias, *args)
    y_ref = ops.array_conv(x_ref, weight, bias, *args)
    assert array_memory_format(y) == CL
    torch.testing.assert_close(y, y_ref, **TOL)
    g = to_array_memory_format(torch.randn_like(y_ref), CL)
    gx = input_grad(g, weight, list(x.shape), *args)
    gx_ref = ops.array_conv_input_grad(g.contiguous(), weight, list(x.shape), *args)
    assert array_memory_format(gx, shared=shared) == CL
    torch.testing.assert_close(gx, gx_ref, **TOL)
    # a channels-last weight: its gradient is laid out like it
    w_cl = weight.flatten(0, 1).contiguous(memory_format=CL).view(weight.shape)
    gw = weight_grad(g, x, w_cl, *args)
    gw_ref = ops.array_conv_weight_grad(g.contiguous(), x_ref, weight, *args)
    assert gw.stride() == w_cl.stride() and gw_ref.is_contiguous()
    torch.testing.assert_close(gw, gw_ref, **TOL)


@pytest.mark.parametrize("shared", [False, True])
def test_opcheck_conv_ops_on_channels_last_images(shared):
    B, N, C = 2, 2, 3
    x = torch.randn(N, C, 5, 4).contiguous(memory_format=CL) if shared else _cl((N, C, 5, 4), B)[0].detach()
    weight = torch.randn(B, 4, C, 3, 3).flatten(0, 1).contiguous(memory_format=CL).view(B, 4, C, 3, 3)
    args = ([1, 1], [1, 1], [1, 1], False, [0, 0], 1)
    y = torch.ops.hfkern.array_conv(x, weight, None, *args)
    torch.library.opcheck(torch.ops.hfkern.array_conv.default, (x, weight, None, *args))
    g = torch.randn_like(y)
    torch.library.opcheck(torch.ops.hfkern.array_conv_input_grad.default, (g, weight, list(x.shape), *args))
    torch.library.opcheck(torch.ops.hfkern.array_conv_weight_grad.default, (g, x, weight, *args))


# ---- modules ---------------------------------------------------------------------

def test_conv_module_to_channels_last_relays_the_weight_and_converts_the_input():
    torch.manual_seed(0)
    B = 3
    modules = torch_modules(lambda: nn.Conv2d(4, 5, 3, padding=1), B)
    conv = hnn.Conv2d.from_modules(modules)
    weight = conv.weight
    assert conv.to(memory_format=CL) is conv
    assert conv.weight is weight  # the same Parameter: an optimizer holding it still works
    assert conv.weight.flatten(0, 1).is_contiguous(memory_format=CL)
    x, xs, leaf = array_input((2, 4, 6, 5), B, layout="batch_major")
    y = compare_modules(conv, modules, x, xs, leaf)
    assert array_memory_format(y) == CL
    conv.to(memory_format=NCHW)
    assert conv.weight.is_contiguous()
    assert array_memory_format(conv(x)) == NCHW


def test_set_memory_format_reaches_array_convs_in_plain_containers():
    seq = nn.Sequential(hnn.Conv2d(3, 4, 3, B=2), nn.ReLU(), hnn.Conv1d(4, 4, 1, B=2))
    assert hnn.set_memory_format(seq, CL) is seq
    assert seq[0].memory_format is CL and seq[0].weight.flatten(0, 1).is_contiguous(memory_format=CL)
    assert seq[2].memory_format is None  # 1-D convs have no channels-last form
    hnn.set_memory_format(seq, None)
    assert seq[0].memory_format is None and seq[0].weight.is_contiguous()


def test_bad_memory_formats_raise_before_anything_changes():
    conv = hnn.Conv2d(3, 4, 3, B=2)
    strides = conv.weight.stride()
    with pytest.raises(ValueError, match="channels_last_3d"):
        conv.to(memory_format=torch.channels_last_3d)
    with pytest.raises(TypeError, match="memory_format"):
        hnn.set_memory_format(conv, "channels_last")
    assert conv.memory_format is None and conv.weight.stride() == strides


def test_auto_converts_only_where_a_record_cites_a_measurement(monkeypatch):
    record = _evidence.LayoutEvidence("channels_last", "H200", ("bfloat16",), "bench/results/x.json", "s")
    assert _evidence.memory_format_record("NVIDIA H200", torch.bfloat16, (record,)) is record
    assert _evidence.memory_format_record("NVIDIA H200", torch.float32, (record,)) is None
    assert _evidence.memory_format_record("NVIDIA H100 80GB HBM3", torch.bfloat16, (record,)) is None
    assert _evidence.auto_memory_format(torch.device("cpu"), torch.float32) is None
    conv = hnn.Conv2d(3, 4, 3, B=2)
    x, _, _ = array_input((2, 3, 5, 5), 2, layout="batch_major")
    assert array_memory_format(conv(x)) == NCHW  # no record: the input's memory is kept
    monkeypatch.setattr(_evidence, "auto_memory_format", lambda device, dtype: CL)
    assert array_memory_format(conv(x)) == CL
    conv.to(memory_format=NCHW)  # an explicit choice wins over auto
    assert array_memory_format(conv(x)) == NCHW


@pytest.mark.parametrize("cls,kw", [
    (hnn.MaxPool2d, dict(kernel_size=2, return_indices=True)),
    (hnn.AvgPool2d, dict(kernel_size=3, stride=2, padding=1)),
    (hnn.AdaptiveAvgPool2d, dict(output_size=(2, 3))),
])
def test_pooling_keeps_channels_last_memory(cls, kw):
    B = 3
    pool = cls(**kw)
    x, xs, leaf = _cl((2, 4, 7, 6), B)
    out = pool(x)
    ys = [getattr(F, {hnn.MaxPool2d: "max_pool2d", hnn.AvgPool2d: "avg_pool2d",
                      hnn.AdaptiveAvgPool2d: "adaptive_avg_pool2d"}[cls])(xb, **kw) for xb in xs]
    if isinstance(out, tuple):
        torch.testing.assert_close(out[1], torch.stack([y[1] for y in ys]), atol=0, rtol=0)
        out, ys = out[0], [y[0] for y in ys]
    torch.testing.assert_close(out, torch.stack(ys), **TOL)
    assert array_memory_format(out) == CL


# ---- whole networks ----------------------------------------------------------------

class _Block(nn.Module):
    def __init__(self, c_in, c_out, stride):
        super().__init__()
        self.conv1 = nn.Conv2d(c_in, c_out, 3, stride, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(c_out)
        self.conv2 = nn.Conv2d(c_out, c_out, 3, 1, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(c_out)
        self.short = nn.Sequential()
        if stride != 1 or c_in != c_out:
            self.short = nn.Sequential(nn.Conv2d(c_in, c_out, 1, stride, bias=False), nn.BatchNorm2d(c_out))

    def forward(self, x):
        out = F.relu(self.bn1(self.conv1(x)))
        out = self.bn2(self.conv2(out))
        return F.relu(out + self.short(x))


class _SmallResNet(nn.Module):
    """ResNet's pieces: stem conv + BN + ReLU, max pool, residual blocks with a
    projection shortcut, global average pool, flatten, linear."""

    def __init__(self):
        super().__init__()
        self.stem = nn.Conv2d(3, 4, 3, padding=1, bias=False)
        self.bn = nn.BatchNorm2d(4)
        self.pool = nn.MaxPool2d(2)
        self.layer1 = _Block(4, 4, 1)
        self.layer2 = _Block(4, 6, 2)
        self.fc = nn.Linear(6, 5)

    def forward(self, x):
        x = self.pool(F.relu(self.bn(self.stem(x))))
        x = self.layer2(self.layer1(x))
        return self.fc(torch.flatten(F.adaptive_avg_pool2d(x, 1), 1))


def _conv_formats(monkeypatch):
    """Record (input format, output format) of every array convolution's torch path (the
    op's torch implementation and the eager path both run it)."""
    import hfkern.ops.conv as conv_ops

    seen, conv_torch = [], conv_ops._conv_torch

    def spy(x, weight, *rest, **kwargs):
        y = conv_torch(x, weight, *rest, **kwargs)
        seen.append((array_memory_format(x, shared=x.dim() != weight.dim()), array_memory_format(y)))
        return y

    monkeypatch.setattr(conv_ops, "_conv_torch", spy)
    return seen


@pytest.mark.parametrize("B", [1, 3])
def test_fused_resnet_in_channels_last_matches_torch_models(B, monkeypatch):
    torch.manual_seed(0)
    models = [_SmallResNet() for _ in range(B)]
    fused = hfkern.fuse(models)
    assert fused.to(memory_format=CL) is fused
    seen = _conv_formats(monkeypatch)
    x = torch.randn(5, 3, 9, 9)  # odd sizes: the strided conv and the pool drop a row
    out = fused(hfkern.broadcast(x, B))
    refs = [m(x) for m in models]
    torch.testing.assert_close(out, torch.stack(refs), **TOL)
    # every conv read and wrote channels-last memory: no layout conversion on the way
    assert seen and all(f == (CL, CL) for f in seen), seen
    grad = torch.randn_like(out)
    out.backward(grad)
    for b, (m, r) in enumerate(zip(models, refs)):
        r.backward(grad[b])
        for name, p in m.named_parameters():
            torch.testing.assert_close(fused.get_parameter(name).grad[b], p.grad, **GRAD_TOL)
        for name, buf in m.named_buffers():
            torch.testing.assert_close(fused.get_buffer(name)[b], buf, **TOL)
    fused.eval()
    [m.eval() for m in models]
    torch.testing.assert_close(fused(hfkern.broadcast(x, B)), torch.stack([m(x) for m in models]), **TOL)


def test_channels_last_array_trains_like_the_default_and_round_trips():
    torch.manual_seed(0)
    B = 2
    models = [_SmallResNet() for _ in range(B)]
    default, cl = hfkern.fuse(models), hfkern.fuse(models)
    cl.to(memory_format=CL)
    opts = [hfkern.optim.SGD(m.parameters(), lr=[0.1, 0.05], momentum=0.9) for m in (default, cl)]
    x, target = torch.randn(6, 3, 8, 8), torch.randint(0, 5, (6,))
    for _ in range(3):
        for m, opt in zip((default, cl), opts):
            opt.zero_grad()
            out = m(hfkern.broadcast(x, B))
            loss = F.cross_entropy(out.flatten(0, 1), target.repeat(B), reduction="sum") / 6
            loss.backward()
            opt.step()
    for (name, p), q in zip(default.named_parameters(), cl.parameters()):
        torch.testing.assert_close(q, p, atol=1e-5, rtol=1e-4, msg=name)
    # extract_model gives the torch architecture with the same weights
    extracted = cl.extract_model(1)
    for name, p in extracted.named_parameters():
        torch.testing.assert_close(p, cl.get_parameter(name)[1], atol=0, rtol=0)
    state = cl.state_dict()
    default.load_state_dict(state)
    torch.testing.assert_close(default(hfkern.broadcast(x, B)), cl(hfkern.broadcast(x, B)), **TOL)


def test_channels_last_under_cpu_autocast():
    torch.manual_seed(0)
    B = 2
    models = [_SmallResNet() for _ in range(B)]
    fused = hfkern.fuse(models).to(memory_format=CL)
    x = torch.randn(4, 3, 8, 8)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = fused(hfkern.broadcast(x, B))
        refs = torch.stack([m(x) for m in models])
    assert out.dtype == refs.dtype
    torch.testing.assert_close(out.float(), refs.float(), atol=5e-2, rtol=5e-2)


@pytest.mark.parametrize("B", [1, 3])
def test_group_norm_keeps_channels_last_memory(B):
    torch.manual_seed(0)
    modules = torch_modules(lambda: nn.GroupNorm(2, 4), B)
    for m in modules:
        nn.init.normal_(m.weight)
        nn.init.normal_(m.bias)
    x, xs, leaf = _cl((2, 4, 5, 3), B)
    y = compare_modules(hnn.GroupNorm.from_modules(modules), modules, x, xs, leaf)
    assert array_memory_format(y) == CL


def test_one_input_channel_still_gives_channels_last_images():
    """Grayscale images are in both memories at once; a channels-last conv still
    writes channels-last memory, and the net after it stays there."""
    torch.manual_seed(0)
    B = 2
    modules = torch_modules(lambda: nn.Conv2d(1, 3, 3, padding=1), B)
    conv = hnn.Conv2d.from_modules(modules).to(memory_format=CL)
    x, xs, leaf = array_input((4, 1, 6, 5), B, shared=True)
    y = compare_modules(conv, modules, x, xs, leaf, shared=True)
    assert array_memory_format(y) == CL


# ---- on a GPU: cuDNN's grouped convs and torch's batch norm in both memories -----------

@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gpu_fused_resnet_in_channels_last_matches_the_default_memory(dtype, monkeypatch):
    # float32 in float32: with TF32 (cuDNN's default) the two layouts' algorithms round their
    # products to 10 mantissa bits each in their own order, gradients 1e-3 apart (seen on an H200)
    monkeypatch.setattr(torch.backends.cudnn, "allow_tf32", False)
    monkeypatch.setattr(torch.backends.cuda.matmul, "allow_tf32", False)
    torch.manual_seed(0)
    B = 3
    models = [_SmallResNet().cuda() for _ in range(B)]
    default, cl = hfkern.fuse(models), hfkern.fuse(models).to(memory_format=CL)
    x = torch.randn(8, 3, 16, 16, device="cuda")
    outs, grads = [], []
    for fused in (default, cl):
        with torch.autocast("cuda", dtype=torch.bfloat16, enabled=dtype == torch.bfloat16):
            out = fused(hfkern.broadcast(x, B))
        out.float().square().sum().backward()
        outs.append(out.float())
        grads.append([p.grad for p in fused.parameters()])
    tol = dict(atol=1e-3, rtol=1e-3) if dtype == torch.float32 else dict(atol=5e-2, rtol=5e-2)
    torch.testing.assert_close(outs[1], outs[0], **tol)
    for g_cl, g in zip(grads[1], grads[0]):
        torch.testing.assert_close(g_cl, g, **tol)
    for (name, buf), buf_cl in zip(default.named_buffers(), cl.buffers()):
        torch.testing.assert_close(buf_cl.float(), buf.float(), **tol, msg=name)


@pytest.mark.gpu
@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_gpu_conv_ops_keep_channels_last(backend):
    torch.manual_seed(0)
    B, N, C = 4, 8, 16
    x = torch.randn(N, 12, 12, B, C, device="cuda").permute(3, 0, 4, 1, 2)
    weight = torch.randn(B, 32, C, 3, 3, device="cuda") * 0.1
    args = ([1, 1], [1, 1], [1, 1], False, [0, 0], 1)
    with hfkern.use_backend(backend):
        y = torch.ops.hfkern.array_conv(x, weight, None, *args)
        ref = torch.ops.hfkern.array_conv(x.contiguous(), weight, None, *args)
    assert array_memory_format(y) == CL
    torch.testing.assert_close(y, ref, atol=1e-2, rtol=1e-2)  # TF32 where torch allows it


@pytest.mark.parametrize("fmt", [torch.channels_last, torch.contiguous_format, None])
def test_a_conv_with_a_memory_format_saves_and_copies(fmt):
    """torch.memory_format objects do not pickle: torch.save of a whole module kept them by name."""
    import copy
    import io

    model = torch.nn.Sequential(hnn.Conv2d(1, 2, 3, B=2), hnn.Conv2d(2, 2, 3, B=2))
    hnn.set_memory_format(model, fmt)
    buf = io.BytesIO()
    torch.save(model, buf)
    buf.seek(0)
    for other in (torch.load(buf, weights_only=False), copy.deepcopy(model)):
        assert other[0].memory_format is fmt and other[1].memory_format is fmt
        torch.testing.assert_close(other[1].weight, model[1].weight)
        assert other[1].weight.stride() == model[1].weight.stride()
