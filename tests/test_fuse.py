"""hfkern.fuse / unfuse against B separate torch models: forward, gradients, a step, state."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.testing import assert_close

import hfkern
from _fuse_models import ARCHITECTURES, DigitsCNN, MobileNetV2, TransformerLM

TOL = {"rtol": 1e-4, "atol": 1e-5}
GRAD_TOL = {"rtol": 1e-3, "atol": 1e-5}


def assert_grad_close(actual, expected, what=""):
    """fp32 gradients through deep stacks (BatchNorm, max-pooling): errors of order 1e-4 of the
    tensor's largest entry are rounding, and a bias before a norm has a gradient of exactly 0."""
    scale = expected.abs().max().item()
    assert_close(actual, expected, rtol=1e-3, atol=1e-3 * scale + 1e-5, msg=lambda s: f"{what}: {s}")


def _models(arch, B):
    return [arch.factory() for _ in range(B)]


def _inputs(arch, B):
    return torch.stack([arch.input(arch.N) for _ in range(B)])


def _reference(models, x):
    return torch.stack([m(x[b]) for b, m in enumerate(models)])


def _assert_state(fused, models, close=None):
    state = fused.state_dict()
    for b, m in enumerate(models):
        ref = m.state_dict()
        assert state.keys() == ref.keys()
        for k, v in ref.items():
            if close is None:
                assert_close(state[k][b], v, **TOL, msg=lambda s: f"{k}[{b}]: {s}")
            else:
                close(state[k][b], v, f"{k}[{b}]")


@pytest.mark.parametrize("name", list(ARCHITECTURES))
def test_architecture(name):
    """Train mode: forward, every gradient, BatchNorm statistics and one optimizer step;
    then eval with a shared input, and the unfuse round trip."""
    arch = ARCHITECTURES[name]
    B = 3
    models = _models(arch, B)
    originals = copy.deepcopy(models)
    fused = hfkern.fuse(models)
    for m, o in zip(models, originals):  # fuse copies; the models are left as they were
        for k, v in m.state_dict().items():
            assert torch.equal(v, o.state_dict()[k])
    _assert_state(fused, models)

    x = _inputs(arch, B)
    out = fused(x)
    ref = _reference(models, x)
    assert out.shape == ref.shape
    assert_close(out, ref, **TOL)

    sum(arch.loss(out[b]) for b in range(B)).backward()
    sum(arch.loss(ref[b]) for b in range(B)).backward()
    for key, p in fused.named_parameters():
        for b, m in enumerate(models):
            assert_grad_close(p.grad[b], m.get_parameter(key).grad, key)
    for key, buf in fused.named_buffers():  # running statistics, per model
        for b, m in enumerate(models):
            assert_close(buf[b], m.get_buffer(key), **TOL)

    lrs = [0.1, 0.03, 0.01][:B]
    opt = hfkern.optim.SGD(fused.parameters(), lr=lrs, momentum=0.9)
    ref_opts = [torch.optim.SGD(m.parameters(), lr=lr, momentum=0.9) for m, lr in zip(models, lrs)]
    opt.step()
    for o in ref_opts:
        o.step()
    _assert_state(fused, models, assert_grad_close)  # moved by gradients: their tolerance

    fused.eval()
    for m in models:
        m.eval()
    x0 = arch.input(arch.N)
    with torch.no_grad():
        shared = fused(hfkern.broadcast(x0, B))
        assert_close(shared, torch.stack([m(x0) for m in models]), **TOL)

    back = hfkern.unfuse(fused)
    for b, (m, o) in enumerate(zip(back, originals)):
        assert type(m) is type(o) and not m.training
        o.load_state_dict(m.state_dict())  # strict: the original keys
        for k, v in m.state_dict().items():
            assert torch.equal(v, fused.state_dict()[k][b])
            assert v.data_ptr() != fused.state_dict()[k].data_ptr()  # copies
        with torch.no_grad():
            assert_close(m(x0), models[b](x0), **TOL)


def test_b1_factory_and_noncontiguous_input():
    arch = ARCHITECTURES["resnet18"]
    torch.manual_seed(3)
    fused = hfkern.fuse(arch.factory, 1)
    torch.manual_seed(3)
    model = arch.factory()
    _assert_state(fused, [model])
    x = torch.randn(1, arch.N, 3, 16, 32)[..., ::2]  # non-contiguous
    assert not x.is_contiguous()
    assert_close(fused(x)[0], model(x[0]), **TOL)


def test_state_dict_loads_stacked_originals():
    arch = ARCHITECTURES["mobilenet_v2"]
    models = _models(arch, 2)
    fused = hfkern.fuse(_models(arch, 2))
    fused.load_state_dict({k: torch.stack([m.state_dict()[k] for m in models]) for k in models[0].state_dict()})
    _assert_state(fused, models)
    x = _inputs(arch, 2)
    assert_close(fused(x), _reference(models, x), **TOL)


def test_dropout_draws_per_model():
    """Identical models and inputs: in training every model draws its own dropout masks."""
    model = MobileNetV2(10, width_mult=0.25, dropout=0.5, setting=[[1, 16, 1, 1]])
    fused = hfkern.fuse([copy.deepcopy(model) for _ in range(4)])
    x = hfkern.broadcast(torch.randn(6, 3, 16, 16), 4)
    y = fused(x)
    assert not torch.equal(y[0], y[1]) and not torch.equal(y[2], y[3])
    fused.eval()  # the same weights and (updated alike) statistics: the same outputs
    y = fused(x)
    for b in range(4):
        assert torch.equal(y[b], y[0])
    assert_close(y[0], hfkern.unfuse(fused)[0](x[0]), **TOL)


class _Functional(nn.Module):
    """Per-model code the translations do not cover, run under vmap, beside translated ops."""

    def __init__(self):
        super().__init__()
        self.proj = nn.Parameter(torch.randn(5, 6))
        self.scale = nn.Parameter(torch.randn(5))
        self.register_buffer("offset", torch.randn(5))
        self.bilinear = nn.Bilinear(5, 5, 3)   # a torch layer without an array version
        self.softmax = nn.Softmax(dim=1)
        self.ratio = 0.5

    def forward(self, x, idx):
        h = F.linear(x, self.proj)                          # [N, 5], own parameter
        h = h * self.scale + self.offset                    # lower-rank parameters
        a, b = h.chunk(2, dim=0)
        h = torch.cat([b, a], dim=0)
        h = torch.einsum("nd,d->nd", h, self.scale)
        picked = h[:, idx]                                  # tensor index
        g = self.bilinear(h, h.flip(0)) * self.ratio
        out = self.softmax(g) + picked.sum(1, keepdim=True) + h.new_ones(1) * x.size(1)
        return out, h.mean(0)


@pytest.mark.parametrize("B", [1, 3])
def test_vmapped_code_and_torch_leaves(B):
    models = [_Functional() for _ in range(B)]
    fused = hfkern.fuse(models)
    x = torch.randn(B, 7, 6, requires_grad=True)
    idx = torch.tensor([4, 0, 2])
    out, mean = fused(x, hfkern.broadcast(idx, B))
    refs = [m(x[b], idx) for b, m in enumerate(models)]
    assert_close(out, torch.stack([r[0] for r in refs]), **TOL)
    assert_close(mean, torch.stack([r[1] for r in refs]), **TOL)
    (out.sum() + mean.sum()).backward()
    gx = x.grad.clone()
    x.grad = None
    sum(r[0].sum() + r[1].sum() for r in refs).backward()
    assert_close(gx, x.grad, **GRAD_TOL)
    for key, p in fused.named_parameters():
        for b, m in enumerate(models):
            assert_close(p.grad[b], m.get_parameter(key).grad, **GRAD_TOL)


class _TrainingFlag(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 4)

    def forward(self, x):
        return F.dropout(self.fc(x), 0.5, self.training) + (1.0 if self.training else 0.0)


class _Nested(nn.Module):
    def __init__(self):
        super().__init__()
        self.inner = _TrainingFlag()

    def forward(self, x):
        return self.inner(x) * (2.0 if self.training else 3.0)


def test_forward_reading_self_training():
    models = [_Nested() for _ in range(2)]
    fused = hfkern.fuse(models)
    x = torch.randn(2, 3, 4)
    y = fused(x)
    assert (y == 2.0).any()  # dropped units, then (0 + 1) * 2 in training
    fused.eval()
    assert_close(fused(x), torch.stack([m.eval()(x[b]) for b, m in enumerate(models)]), **TOL)
    fused.inner.train()  # modes no capture made at fusing serves: captured at this call
    y = fused(x)
    assert (y == 3.0).any()  # dropped units, then (0 + 1) * 3 in eval; kept ones (fc * 2 + 1) * 3
    kept = torch.stack([(m.inner.fc(x[b]) * 2 + 1) * 3 for b, m in enumerate(models)])
    assert_close(torch.where(y == 3.0, kept, y), kept, **TOL)


def test_tied_weights_stay_tied():
    def lm():
        m = TransformerLM(vocab=11, d_model=8, nhead=2, num_layers=1, dim_ff=8, dropout=0.0)
        m.head.weight = m.tok.weight
        return m

    models = [lm() for _ in range(2)]
    fused = hfkern.fuse(models)
    assert fused.head.weight is fused.tok.weight
    assert "head.weight" in fused.state_dict() and "tok.weight" in fused.state_dict()
    idx = torch.randint(0, 11, (2, 3, 5))
    out = fused(idx)
    refs = torch.stack([m(idx[b]) for b, m in enumerate(models)])
    assert_close(out, refs, **TOL)
    out.square().sum().backward()
    refs.square().sum().backward()
    for b, m in enumerate(models):
        assert_close(fused.tok.weight.grad[b], m.tok.weight.grad, **GRAD_TOL)
    back = hfkern.unfuse(fused)
    assert back[1].head.weight is back[1].tok.weight


# ---- what cannot be captured ------------------------------------------------------------------
class _ValueBranch(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(3, 3)

    def forward(self, x):
        if x.sum() > 0:
            return self.fc(x)
        return -self.fc(x)


class _HostRead(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(3, 3)

    def forward(self, x):
        return self.fc(x) * x.abs().max().item()


class _ShapeBranch(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(3, 3)

    def forward(self, x):
        if x.dim() == 3:
            x = x.flatten(0, 1)
        return self.fc(x)


class _Outer(nn.Module):
    def __init__(self, inner):
        super().__init__()
        self.pre = nn.Linear(3, 3)
        self.block = inner()

    def forward(self, x):
        return self.block(torch.relu(self.pre(x)))


def test_uncapturable_model_names_construct_and_module():
    with pytest.raises(hfkern.FuseError) as e:
        hfkern.fuse([_Outer(_ValueBranch) for _ in range(2)])
    msg = str(e.value)
    assert "control flow" in msg and "if x.sum() > 0:" in msg
    assert "module 'block' (_ValueBranch)" in msg and "loop_modules" in msg
    with pytest.raises(hfkern.FuseError, match=r"\.item\(\)` reads .*module 'block' \(_HostRead\)"):
        hfkern.fuse([_Outer(_HostRead) for _ in range(2)])
    assert isinstance(e.value, ValueError)


@pytest.mark.parametrize("inner, option", [(_ValueBranch, "loop_modules"), (_HostRead, "loop_modules"),
                                           (_ShapeBranch, "vmap_modules")])
def test_opaque_modules_run_per_model(inner, option):
    models = [_Outer(inner) for _ in range(3)]
    fused = hfkern.fuse(models, **{option: (inner,)})
    x = torch.randn(3, 4, 2, 3)
    x[1] = x[1].abs()
    x[2] = -x[2].abs()
    out = fused(x)
    ref = torch.stack([m(x[b]) for b, m in enumerate(models)])
    assert_close(out, ref, **TOL)
    out.sum().backward()
    ref.sum().backward()
    for b, m in enumerate(models):
        assert_close(fused.block.fc.weight.grad[b], m.block.fc.weight.grad, **GRAD_TOL)
    assert list(fused.state_dict()) == list(models[0].state_dict())


def test_argument_errors():
    with pytest.raises(ValueError, match="at least one model"):
        hfkern.fuse([])
    with pytest.raises(TypeError, match="one model"):
        hfkern.fuse(DigitsCNN())
    with pytest.raises(TypeError, match="B is required"):
        hfkern.fuse(DigitsCNN)
    with pytest.raises(TypeError, match="only with a factory"):
        hfkern.fuse([DigitsCNN()], 1)
    with pytest.raises(TypeError, match="one class"):
        hfkern.fuse([DigitsCNN(), MobileNetV2()])
    with pytest.raises(hfkern.FuseError, match="shape of 'classifier.weight' differs"):
        hfkern.fuse([DigitsCNN(10), DigitsCNN(5)])
    m = DigitsCNN()
    m.classifier.weight.requires_grad_(False)
    with pytest.raises(hfkern.FuseError, match="requires_grad"):
        hfkern.fuse([DigitsCNN(), m])
    with pytest.raises(hfkern.FuseError, match="training mode"):
        hfkern.fuse([DigitsCNN(), DigitsCNN().eval()])
    with pytest.raises(TypeError, match="vmap_modules"):
        hfkern.fuse([DigitsCNN()], vmap_modules=("Linear",))
    fused = hfkern.fuse([DigitsCNN(), DigitsCNN()])
    with pytest.raises(ValueError, match=r"array dim B=2 first.*got shape \[5, 1, 8, 8\]"):
        fused(torch.randn(5, 1, 8, 8))


def test_compile_matches_eager():
    torch._dynamo.reset()
    fused = hfkern.fuse(DigitsCNN, 2).eval()
    compiled = torch.compile(fused)
    x = torch.randn(2, 5, 1, 8, 8)
    ref = fused(x)
    ref.sum().backward()
    grads = [p.grad.clone() for p in fused.parameters()]
    fused.zero_grad()
    out = compiled(x)
    out.sum().backward()
    assert_close(out, ref, **TOL)
    for p, g in zip(fused.parameters(), grads):
        assert_close(p.grad, g, **GRAD_TOL)


class _ViewAfterSharedLinear(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(6, 3 * 8)
        self.conv = nn.Conv1d(3, 4, 3)

    def forward(self, x):
        # .view of the linear's output: contiguous for one torch model, a [B, N, ...]
        # view of [N, B, ...] memory for the array on a shared input
        return self.conv(self.fc(x).view(-1, 3, 8))


def test_view_of_an_array_whose_layout_is_not_viewable():
    torch.manual_seed(0)
    models = [_ViewAfterSharedLinear() for _ in range(3)]
    fused = hfkern.fuse(models)
    x = torch.randn(5, 6)
    out = fused(hfkern.broadcast(x, 3))
    assert_close(out, torch.stack([m(x) for m in models]), **TOL)


def _check_forward_backward(fused, models, x, shared=False):
    """fused(x) against the models (each on its slice of ``x``, or all on ``x[0]``): outputs and
    every parameter's gradient."""
    out = fused(x)
    ref = torch.stack([m(x[0] if shared else x[b]) for b, m in enumerate(models)])
    assert_close(out, ref, **TOL)
    out.square().sum().backward()
    ref.square().sum().backward()
    for key, p in fused.named_parameters():
        for b, m in enumerate(models):
            assert_grad_close(p.grad[b], m.get_parameter(key).grad, f"{key}[{b}]")


# ---- views that forward writes through -----------------------------------------------------------
class _WriteThroughFlatView(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 6)

    def forward(self, x):
        h = self.fc(x)
        flat = h.view(-1)  # a view of h in torch
        flat[::2] = 0
        flat.mul_(2)
        return h


class _ClampThroughConvView(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(1, 2, 3, padding=1)

    def forward(self, x):
        y = self.conv(x)
        y.view(y.size(0), -1).clamp_(min=0)  # a ReLU through a flat view of y
        return y * 1.5


class _SliceThenWriteThroughView(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 6)

    def forward(self, x):
        h = self.fc(x)
        first = h[..., :3]  # shares h's memory: sees the write below in torch
        h.view(-1).mul_(3)
        return first + h.sum(-1, keepdim=True)


class _WriteSourceWhileViewed(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(1, 2, 3, padding=1)

    def forward(self, x):
        y = self.conv(x)
        flat = y.view(y.size(0), -1)
        y.mul_(-2)  # flat sees it in torch
        return flat


@pytest.mark.parametrize("make, shape, how", [
    (_WriteThroughFlatView, (3, 4), "shared"), (_WriteThroughFlatView, (3, 4), "per_model"),
    (_ClampThroughConvView, (3, 1, 4, 4), "per_model"), (_ClampThroughConvView, (3, 1, 4, 4), "shared"),
    (_ClampThroughConvView, (3, 1, 4, 4), "channels_last"), (_SliceThenWriteThroughView, (3, 4), "shared"),
    (_WriteSourceWhileViewed, (3, 1, 4, 4), "per_model"), (_WriteSourceWhileViewed, (3, 1, 4, 4), "channels_last"),
])
def test_in_place_writes_through_a_view_reach_what_it_views(make, shape, how):
    """``x.view(...)`` is a view in torch: in-place writes through it change x, and writes into x
    change it. Where the array's memory cannot be viewed so (a linear on a shared input, a
    convolution's output, a channels-last model), the fused model must still alias them."""
    torch.manual_seed(0)
    models = [make() for _ in range(3)]
    fused = hfkern.fuse(models)
    if how == "channels_last":
        fused = fused.to(memory_format=torch.channels_last)
    x = hfkern.broadcast(torch.randn(*shape), 3) if how == "shared" else torch.randn(3, *shape)
    _check_forward_backward(fused, models, x, shared=how == "shared")


class _KeepLast(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 6)
        self.register_buffer("last", torch.zeros(3, 6))

    def forward(self, x):
        h = self.fc(x)
        self.last = h.detach()  # shares h's memory
        h.view(-1).mul_(2)  # ... so the buffer sees this write in torch
        return h


def test_write_through_a_view_reaches_a_buffer_assigned_its_source():
    torch.manual_seed(0)
    models = [_KeepLast() for _ in range(3)]
    fused = hfkern.fuse(models)
    x = torch.randn(3, 4)
    _check_forward_backward(fused, models, hfkern.broadcast(x, 3), shared=True)
    assert_close(fused.last, torch.stack([m.last for m in models]), **TOL)


class _DecayLast(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 6)
        self.register_buffer("last", torch.zeros(3, 6))

    def forward(self, x):
        self.last.view(-1).mul_(0.5)  # the buffer, updated through a view
        h = self.fc(x)
        self.last = h.detach().clone()
        return h


def test_view_that_must_alias_state_and_cannot_raises_naming_it():
    """A buffer updated through a view: the write must reach the buffer. Where the buffer holds a
    value in the memory layout of an array op (a linear's output on a shared input), it cannot be
    viewed flat; the forward raises rather than updating a copy."""
    torch.manual_seed(0)
    models = [_DecayLast() for _ in range(3)]
    fused = hfkern.fuse(models)
    x = torch.randn(3, 4)
    with torch.no_grad():
        fused(torch.stack([x] * 3))  # per-model input: a contiguous output, a contiguous buffer
        fused(torch.stack([x] * 3))
        for m in models:
            m(x)
            m(x)
        assert_close(fused.last, torch.stack([m.last for m in models]), **TOL)
        fused(hfkern.broadcast(x, 3))  # the buffer now holds [B, N, ...] view of [N, B, ...] memory
        with pytest.raises(hfkern.FuseError, match=r"`\.view\(-1\)` at test_fuse\.py:\d+: "
                                                   r"`self\.last\.view\(-1\)\.mul_\(0\.5\).*` in the model's own "
                                                   r"forward \(_DecayLast\) cannot be a view"):
            fused(hfkern.broadcast(x, 3))


# ---- interpolation ------------------------------------------------------------------------------
class _Upsample(nn.Module):
    def __init__(self, conv, mode):
        super().__init__()
        self.conv = conv(2, 3, 3, padding=1)
        self.mode = mode

    def forward(self, x):
        kwargs = {} if self.mode == "nearest" else {"align_corners": False}
        return F.interpolate(self.conv(x), scale_factor=2, mode=self.mode, **kwargs)


@pytest.mark.parametrize("conv, mode, shape", [
    (nn.Conv1d, "nearest", (3, 2, 5)), (nn.Conv1d, "linear", (3, 2, 5)),
    (nn.Conv2d, "bilinear", (3, 2, 4, 5)), (nn.Conv3d, "trilinear", (2, 2, 3, 3, 4)),
])
def test_interpolate_of_1d_2d_and_3d_inputs(conv, mode, shape):
    """F.interpolate has no unbatched form: a per-model [N, C, L] input is a 1-D interpolation,
    [N, C, D, H, W] a 3-D one, whatever the array's rank."""
    torch.manual_seed(0)
    models = [_Upsample(conv, mode) for _ in range(3)]
    fused = hfkern.fuse(models)
    _check_forward_backward(fused, models, torch.randn(3, *shape))


def test_bert_with_padding_mask_and_tied_decoder():
    """BERT-small's code: three shared inputs, ``src_key_padding_mask`` built from one of
    them, GELU layers and a decoder tied to the word embedding; forward, gradients and
    the tie through an optimizer step."""
    from bench.models import WORKLOADS, BertSmall

    torch.manual_seed(0)
    B = 3
    models = [BertSmall(vocab=29, hidden=8, num_layers=2, nhead=2, dim_ff=12, max_len=9, dropout=0.0)
              for _ in range(B)]
    fused = hfkern.fuse(models)
    ids, types, attention, labels = WORKLOADS["bert_small"].batch("smoke", seed=1)
    assert not attention.bool().all()                  # some positions are padding
    out = fused(*(hfkern.broadcast(t, B) for t in (ids, types, attention)))
    ref = torch.stack([m(ids, types, attention) for m in models])
    assert_close(out, ref, **TOL)
    loss = lambda o: F.cross_entropy(o.reshape(-1, o.size(-1)), labels.reshape(-1))  # noqa: E731
    sum(loss(out[b]) for b in range(B)).backward()
    sum(loss(ref[b]) for b in range(B)).backward()
    for key, p in fused.named_parameters():
        for b, m in enumerate(models):
            assert_grad_close(p.grad[b], m.get_parameter(key).grad, key)
    hfkern.optim.AdamW(fused.parameters(), lr=[1e-2, 1e-3, 1e-4]).step()
    assert fused.get_parameter("decoder.weight") is fused.get_parameter("word.weight")
