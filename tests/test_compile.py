"""torch.compile(fullgraph=True) traces hfkern models without graph breaks."""

import pytest
import torch
from torch import nn

import hfkern
import hfkern.nn as hnn
import hfkern.nn.functional as HF


def _grads(model):
    return [p.grad.clone() for p in model.parameters()]


def _check_compiled(model, make_inputs, loss_fn, backend):
    compiled = torch.compile(model, fullgraph=True, backend=backend)
    for _ in range(2):  # the second call must hit the compiled graph, not retrace badly
        inputs = make_inputs()
        model.zero_grad()
        ref_loss = loss_fn(model(*inputs))
        ref_loss.sum().backward()
        ref = _grads(model)
        model.zero_grad()
        loss = loss_fn(compiled(*inputs))
        loss.sum().backward()
        torch.testing.assert_close(loss, ref_loss, atol=1e-5, rtol=1e-4)
        for g, r in zip(_grads(model), ref):
            torch.testing.assert_close(g, r, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("backend", ["inductor"])
def test_compile_cnn(backend):
    torch._dynamo.reset()
    B = 3
    model = nn.Sequential(
        hnn.Conv2d(1, 4, 3, padding=1, B=B), hnn.BatchNorm2d(4, B=B), nn.ReLU(), hnn.MaxPool2d(2),
        hnn.Conv2d(4, 4, 3, groups=2, B=B), hnn.GroupNorm(2, 4, B=B), nn.GELU(),
        hnn.AdaptiveAvgPool2d(2), hnn.Flatten(), hnn.Dropout(0.0), hnn.Linear(16, 5, B=B),
    ).eval()  # eval: batch-norm running stats are read, not written, so both runs agree
    target = torch.randint(0, 5, (6,))
    _check_compiled(
        model,
        lambda: (hfkern.broadcast(torch.randn(6, 1, 8, 8), B),),
        lambda out: HF.cross_entropy(out, target),
        backend,
    )


class _TinyLM(nn.Module):
    def __init__(self, B, vocab=11, d=8):
        super().__init__()
        self.emb = hnn.Embedding(vocab, d, padding_idx=0, B=B)
        self.layer = hnn.TransformerEncoderLayer(d, 2, dim_feedforward=16, dropout=0.0,
                                                 batch_first=True, B=B)
        self.norm = hnn.RMSNorm(d, B=B)
        self.head = hnn.Linear(d, vocab, B=B)

    def forward(self, tokens, mask):
        return self.head(self.norm(self.layer(self.emb(tokens), src_mask=mask)))


@pytest.mark.parametrize("backend", ["aot_eager"])
def test_compile_transformer(backend):
    torch._dynamo.reset()
    B, vocab, T = 3, 11, 5
    model = _TinyLM(B, vocab)
    mask = nn.Transformer.generate_square_subsequent_mask(T)
    tokens = torch.randint(0, vocab, (4, T))
    _check_compiled(
        model,
        lambda: (hfkern.broadcast(tokens, B), mask),
        lambda out: HF.cross_entropy(out.flatten(1, 2), tokens.flatten()),
        backend,
    )


class _NormActs(nn.Module):
    """A batch norm and a layer norm each followed by an activation: hfkern.fuse calls them
    as one norm + activation, which read the backend selection (a ContextVar dynamo cannot
    trace) and broke every such graph."""

    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(1, 3, 3)
        self.bn = nn.BatchNorm2d(3)
        self.fc = nn.Linear(3 * 4 * 4, 6)
        self.ln = nn.LayerNorm(6)
        self.head = nn.Linear(6, 4)

    def forward(self, x):
        h = torch.relu(self.bn(self.conv(x)))
        return self.head(nn.functional.gelu(self.ln(self.fc(h.flatten(1)))))


@pytest.mark.parametrize("train", [True, False])
def test_compile_fused_norms_with_activations(train):
    torch._dynamo.reset()
    B = 2
    model = hfkern.fuse(_NormActs, B).train(train)
    target = torch.randint(0, 4, (5,))
    _check_compiled(
        model,
        lambda: (hfkern.broadcast(torch.randn(5, 1, 6, 6), B),),
        lambda out: HF.cross_entropy(out, target),
        "aot_eager",
    )


def test_compiled_group_norm_does_not_recompile_per_batch_size():
    # Its [B, N, C, ...] path ran torch's group norm with B * N * G groups, a plain int a
    # trace specializes: a graph per batch size until dynamo's recompile limit, then eager.
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()
    B = 3
    gn = hnn.GroupNorm(2, 4, B=B)
    with torch.no_grad():
        gn.weight.uniform_(0.5, 1.5)
        gn.bias.uniform_(-0.5, 0.5)
    compiled = torch.compile(gn, backend="eager")
    for n in range(2, 9):
        x = torch.randn(B, n, 4, 3, 3, requires_grad=True)
        out = compiled(x)
        torch.testing.assert_close(out, gn(x))
        gx, gw = torch.autograd.grad(out.sum(), (x, gn.weight))
        wx, ww = torch.autograd.grad(gn(x).sum(), (x, gn.weight))
        torch.testing.assert_close(gx, wx)
        torch.testing.assert_close(gw, ww)
    assert counters["stats"]["unique_graphs"] <= 2, dict(counters["stats"])


class _FlatView(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 5)

    def forward(self, x):
        return self.fc(x).view(-1)  # per model a contiguous [N, 5]; on a shared input the array's is not


def test_compiled_fused_view_where_the_arrays_layout_needs_a_copy():
    """The fused forward's `.view` caught a failed view and copied: eager that worked, but dynamo
    cannot trace a caught failure, and torch.compile(fused, fullgraph=True) raised (also for
    the README's CNN in channels-last memory)."""
    torch._dynamo.reset()
    B = 3
    torch.manual_seed(0)
    models = [_FlatView() for _ in range(B)]
    fused = hfkern.fuse(models)
    x = torch.randn(6, 4)
    want = torch.stack([m(x) for m in models])
    got = torch.compile(fused, fullgraph=True, backend="aot_eager")(hfkern.broadcast(x, B))
    torch.testing.assert_close(got, want)
