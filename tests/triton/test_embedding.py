"""Triton array embedding (gather forward, sorted-segment dense backward) against
the torch implementation.

Interpreter tests call the launchers on CPU tensors (TRITON_INTERPRET=1); GPU
tests go through the hfkern ops with the triton backend selected.
"""

from types import SimpleNamespace

import pytest
import torch

import hfkern
from hfkern import _backend
from hfkern.ops.embedding import array_embedding, array_embedding_backward

triton = pytest.importorskip("triton")
from hfkern.triton import embedding as tk  # noqa: E402

_OPS = ("array_embedding", "array_embedding_backward")
# the torch implementations, as registered: the oracle
ref = SimpleNamespace(**{op: _backend._registry[op]["torch"].load() for op in _OPS})

V = 7  # small, so every index tensor of more than 7 entries repeats rows

LAYOUTS = ["contiguous", "batch_major", "strided", "shared", "scrambled"]


def make_indices(B, layout, *, V=V, shape=(4, 6), dtype=torch.int64, device="cpu", padding_idx=-1):
    """``[B, *shape]`` indices in ``layout``; every model's first index is the
    padding row when there is one.

    "batch_major": ``[N, B, ...]`` memory; "strided": every other element of the
    last dim; "shared": one index tensor broadcast to B models; "scrambled": a
    permutation of dims whose ``*`` dims cannot be collapsed to two (needs three).
    """
    def draw(*size):
        return torch.randint(0, V, size, dtype=dtype, device=device)

    if layout == "shared":
        base = draw(*shape)
        if padding_idx >= 0:
            base.view(-1)[0] = padding_idx
        return hfkern.broadcast(base, B)
    if layout == "contiguous":
        idx = draw(B, *shape)
    elif layout == "batch_major":
        idx = draw(shape[0], B, *shape[1:]).transpose(0, 1)
    elif layout == "strided":
        idx = draw(B, *shape[:-1], 2 * shape[-1])[..., ::2]
    elif layout == "scrambled":
        assert len(shape) == 3
        idx = draw(shape[2], shape[1], B, shape[0]).permute(2, 3, 1, 0)
    else:
        raise ValueError(layout)
    if padding_idx >= 0:
        idx[(slice(None),) + (0,) * len(shape)] = padding_idx
    return idx


def make_grad(B, shape, D, layout, *, dtype=torch.float32, device="cpu"):
    """A fresh ``[B, *shape, D]`` upstream gradient in ``layout``."""
    kw = dict(dtype=dtype, device=device)
    if layout == "batch_major":
        return torch.randn(shape[0], B, *shape[1:], D, **kw).transpose(0, 1)
    if layout == "strided":
        return torch.randn(B, *shape, 2 * D, **kw)[..., ::2]
    if layout == "scrambled":
        return torch.randn(shape[2], shape[1], B, shape[0], D, **kw).permute(2, 3, 1, 0, 4)
    return torch.randn(B, *shape, D, **kw)


def shape_for(layout):
    return (2, 3, 4) if layout == "scrambled" else (4, 6)


# ---- interpreter: launchers against the torch implementation ----------------

@pytest.mark.interpreter
@pytest.mark.parametrize("B", [1, 3])
@pytest.mark.parametrize("D", [5, 33])
@pytest.mark.parametrize("dtype", [torch.int64, torch.int32])
@pytest.mark.parametrize("layout", LAYOUTS)
def test_forward_matches_torch(B, D, dtype, layout):
    shape = shape_for(layout)
    w = torch.randn(B, V, D)
    idx = make_indices(B, layout, shape=shape, dtype=dtype)
    if layout != "contiguous" and B > 1:
        assert not idx.is_contiguous()
    out = tk.array_embedding(w, idx)
    expected = ref.array_embedding(w, idx)
    assert out.shape == (B, *shape, D)
    assert out.stride() == expected.stride()
    assert torch.equal(out, expected)  # a gather: bit for bit


@pytest.mark.interpreter
def test_forward_strided_weight_wide_rows_and_many_positions():
    # D > 256 splits rows over programs; 50 positions span several programs; the
    # weight is a [V, B, D]-memory view with a padded last dim.
    B, D = 3, 300
    w = torch.randn(V, B, 2 * D).transpose(0, 1)[..., ::2]
    idx = torch.randint(0, V, (B, 50))
    torch.testing.assert_close(tk.array_embedding(w, idx), ref.array_embedding(w, idx), rtol=0, atol=0)


@pytest.mark.interpreter
@pytest.mark.parametrize("shape", [(), (0,), (3, 0)], ids=["scalar", "empty", "empty2d"])
@pytest.mark.parametrize("shared", [False, True])
def test_degenerate_index_shapes(shape, shared):
    B, D = 3, 5
    w = torch.randn(B, V, D)
    idx = hfkern.broadcast(torch.randint(0, V, shape), B) if shared else torch.randint(0, V, (B, *shape))
    out = tk.array_embedding(w, idx)
    expected = ref.array_embedding(w, idx)
    assert out.shape == expected.shape == (B, *shape, D)
    assert torch.equal(out, expected)
    g = torch.randn(B, *shape, D)
    grad_w = tk.array_embedding_backward(g, idx, V, 2, True)
    torch.testing.assert_close(grad_w, ref.array_embedding_backward(g, idx, V, 2, True))


BWD_OPTIONS = [(-1, False), (2, False), (-1, True), (0, True)]  # (padding_idx, scale_grad_by_freq)


@pytest.mark.interpreter
@pytest.mark.parametrize("B", [1, 3])
@pytest.mark.parametrize("D,dtype", [(5, torch.int64), (33, torch.int32)])
@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("padding_idx,scale", BWD_OPTIONS, ids=lambda o: str(o))
def test_backward_matches_torch(B, D, dtype, layout, padding_idx, scale):
    shape = shape_for(layout)
    idx = make_indices(B, layout, shape=shape, dtype=dtype, padding_idx=padding_idx)
    # the gradient's layout follows the indices' (an array layer's output); a
    # shared index tensor still gets a per-model gradient, in [N, B] memory
    g = make_grad(B, shape, D, "batch_major" if layout == "shared" else layout)
    grad_w = tk.array_embedding_backward(g, idx, V, padding_idx, scale)
    expected = ref.array_embedding_backward(g, idx, V, padding_idx, scale)
    assert grad_w.shape == (B, V, D)
    assert grad_w.stride() == expected.stride()
    torch.testing.assert_close(grad_w, expected)
    if padding_idx >= 0:
        assert torch.all(grad_w[:, padding_idx] == 0)


@pytest.mark.interpreter
@pytest.mark.parametrize("shared", [False, True])
def test_backward_untouched_rows_are_zero(shared):
    B, Vbig, D = 3, 40, 6
    idx = torch.tensor([[3, 17, 3, 39, 0], [5, 5, 5, 5, 5], [39, 38, 1, 2, 3]])
    if shared:
        idx = hfkern.broadcast(idx[0], B)
    g = torch.randn(B, 5, D)
    grad_w = tk.array_embedding_backward(g, idx, Vbig, -1, False)
    for b in range(B):
        hit = set(idx[b].tolist())
        for v in range(Vbig):
            if v not in hit:
                assert torch.all(grad_w[b, v] == 0), (b, v)
    torch.testing.assert_close(grad_w, ref.array_embedding_backward(g, idx, Vbig, -1, False))


@pytest.mark.interpreter
@pytest.mark.parametrize("scale", [False, True])
def test_backward_hot_row(scale):
    # One row hit 23 times (several unrolled steps, a ragged last one) next to
    # rows hit once, in the same program; model 1 all on one row.
    B, D = 2, 9
    idx = torch.full((B, 30), 4)
    idx[0, ::4] = torch.arange(8) % V
    g = torch.randn(B, 30, D)
    grad_w = tk.array_embedding_backward(g, idx, V, -1, scale)
    torch.testing.assert_close(grad_w, ref.array_embedding_backward(g, idx, V, -1, scale))
    expected_row = g[1].sum(0) / (30 if scale else 1)
    torch.testing.assert_close(grad_w[1, 4], expected_row)


@pytest.mark.interpreter
@pytest.mark.parametrize("B,layout", [(1, "contiguous"), (3, "batch_major"), (3, "shared"),
                                      (3, "strided"), (2, "scrambled")])
@pytest.mark.parametrize("padding_idx,scale", BWD_OPTIONS, ids=lambda o: str(o))
def test_backward_long_rows_in_chunks(monkeypatch, B, layout, padding_idx, scale):
    # A chunk of 4 hits: with 7 rows and 24 positions most rows are long, some
    # with a ragged last chunk, and the padding row (first index) may be the longest.
    monkeypatch.setattr(tk, "_CHUNK", 4)
    shape = shape_for(layout)
    idx = make_indices(B, layout, shape=shape, padding_idx=padding_idx)
    g = make_grad(B, shape, 11, "batch_major" if layout == "shared" else layout)
    grad_w = tk.array_embedding_backward(g, idx, V, padding_idx, scale)
    torch.testing.assert_close(grad_w, ref.array_embedding_backward(g, idx, V, padding_idx, scale))
    if padding_idx >= 0:
        assert torch.all(grad_w[:, padding_idx] == 0)


@pytest.mark.interpreter
@pytest.mark.parametrize("shared", [False, True])
def test_backward_long_row_chunks_are_bounded(monkeypatch, shared):
    # The most chunks a grid can need: every row hit CHUNK + 1 times (two chunks
    # each, the second of one hit), next to rows of exactly CHUNK hits (none).
    monkeypatch.setattr(tk, "_CHUNK", 2)
    B, D = 2, 5
    row = torch.tensor([0] * 3 + [1] * 3 + [2] * 2 + [3] * 3 + [4] * 3)
    idx = hfkern.broadcast(row, B) if shared else torch.stack([row, row.flip(0)])
    g = torch.randn(B, row.numel(), D)
    grad_w = tk.array_embedding_backward(g, idx, 5, -1, False)
    torch.testing.assert_close(grad_w, ref.array_embedding_backward(g, idx, 5, -1, False))


@pytest.mark.interpreter
def test_backward_hot_row_default_chunk():
    # One row taking most of 300 hits (several chunks of the default size and a
    # ragged one) beside rows hit a few times, in one program's block.
    B, n, D = 2, 300, 7
    idx = torch.randint(0, V, (B, n))
    idx[:, ::5] = 3
    idx[1, 100:] = 5
    g = torch.randn(B, n, D)
    assert (idx == 5).sum() > 2 * tk._CHUNK
    grad_w = tk.array_embedding_backward(g, idx, V, 0, False)
    torch.testing.assert_close(grad_w, ref.array_embedding_backward(g, idx, V, 0, False))
    torch.testing.assert_close(grad_w[1, 5], g[1][idx[1] == 5].sum(0))


@pytest.mark.interpreter
def test_backward_is_independent_of_tiling(monkeypatch):
    """The claim behind cross-process determinism: any tile, model group and
    unroll the autotuner might pick gives the same bits."""
    B, D = 3, 70
    idx = torch.randint(0, V, (B, 40))
    g = torch.randn(B, 40, D)
    monkeypatch.setattr(tk, "_CHUNK", 4)  # long rows too: their chunk sums
    results = []
    for tile, models, unroll in [(64, 2, 4), (1024, 1, 1), (256, 4, 3)]:
        cfg = triton.Config({"TILE": tile, "MODELS": models}, num_warps=1)
        monkeypatch.setattr(tk._bwd, "interpret_config", cfg)
        monkeypatch.setattr(tk, "_UNROLL", unroll)
        results.append(tk.array_embedding_backward(g, idx, V, 1, True))
    for r in results[1:]:
        assert torch.equal(r, results[0])
    torch.testing.assert_close(results[0], ref.array_embedding_backward(g, idx, V, 1, True))


@pytest.mark.interpreter
def test_backward_sums_in_input_order():
    # Stable sort: a row's hits are added in input order, one after another,
    # so the result is bitwise the sequential fp32 sum.
    B, n, D = 2, 25, 4
    idx = torch.randint(0, 3, (B, n))
    g = torch.randn(B, n, D) * torch.logspace(-4, 4, n).view(1, n, 1)
    grad_w = tk.array_embedding_backward(g, idx, 3, -1, False)
    for b in range(B):
        for v in range(3):
            acc = torch.zeros(D)
            for i in range(n):
                if idx[b, i] == v:
                    acc = acc + g[b, i]
            assert torch.equal(grad_w[b, v], acc), (b, v)


@pytest.mark.interpreter
def test_rejects_unsupported_dtype():
    w = torch.randn(2, V, 3, dtype=torch.float64)
    idx = torch.randint(0, V, (2, 4))
    with pytest.raises(TypeError, match="float32, float16 or bfloat16, got torch.float64"):
        tk.array_embedding(w, idx)
    with pytest.raises(TypeError, match="got torch.float64"):
        tk.array_embedding_backward(torch.randn(2, 4, 3, dtype=torch.float64), idx, V, -1, False)


def test_registered_as_explicit_cuda_backend():
    # auto=False until a GPU benchmark shows the kernels faster than the torch path;
    # the sparse backward and the renorm stay torch-only
    for op in _OPS:
        entry = _backend._registry[op]["triton"]
        assert entry.load() is getattr(tk, op)
        assert entry.device_types == ("cuda",) and entry.auto is False and entry.dtypes == ()
    for op in ("array_embedding_sparse_backward", "array_embedding_renorm_"):
        assert "triton" not in _backend._registry[op]


@pytest.mark.interpreter
def test_outputs_match_the_ops_fakes_in_interpreter():
    # The AOT checks of the ops on this backend run only on a GPU
    # (test_gpu_opcheck_ops_on_triton); CPU tensors always take the torch path.
    from torch._subclasses.fake_tensor import FakeTensorMode

    B, D = 3, 5
    w = torch.randn(B, V, D)
    idx = torch.randint(0, V, (B, 4, 6))
    shared = make_indices(B, "shared")
    g = make_grad(B, (4, 6), D, "batch_major")
    for op, args in [
        ("array_embedding", (w, idx, -1, False, False)),
        ("array_embedding", (w, shared.int(), 2, True, False)),
        ("array_embedding_backward", (g, idx, V, 2, True)),
        ("array_embedding_backward", (g, shared, V, -1, False)),
    ]:
        real = getattr(tk, op)(*args)
        with FakeTensorMode(allow_non_fake_inputs=True):
            fake = getattr(torch.ops.hfkern, op)(*args)
        assert (real.shape, real.stride(), real.dtype) == (fake.shape, fake.stride(), fake.dtype), op


# ---- GPU: the hfkern ops with the triton backend against the torch backend ----

DEV = "cuda"


def assert_grad_close(got, torch_path, exact):
    """fp32: close to the torch path. Half precision: the flash-attention rule,
    error against the fp64 result at most twice the torch path's own."""
    if got.dtype == torch.float32:
        torch.testing.assert_close(got, torch_path, atol=1e-5, rtol=1e-5)
        return
    err = (got.double() - exact).abs().max().item()
    err_torch = (torch_path.double() - exact).abs().max().item()
    assert err <= 2 * err_torch + 1e-6, (err, err_torch)


def _run_op(backend, w, idx, g, padding_idx, scale):
    w = w.detach().clone().requires_grad_(True)
    with hfkern.use_backend(backend):
        out = array_embedding(w, idx, padding_idx, scale, False)
        out.backward(g)
    return out.detach(), w.grad


@pytest.mark.gpu
@pytest.mark.parametrize("wdtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("layout", ["contiguous", "batch_major", "shared"])
@pytest.mark.parametrize("padding_idx,scale", BWD_OPTIONS, ids=lambda o: str(o))
@pytest.mark.parametrize("B,Vg,D,shape", [(8, 32000, 768, (16, 128)), (3, 1000, 33, (7, 50)), (1, 500, 256, (64, 9))])
def test_gpu_ops_match_torch_backend(wdtype, layout, padding_idx, scale, B, Vg, D, shape):
    idx = make_indices(B, layout, V=Vg, shape=shape, device=DEV, padding_idx=padding_idx)
    w = torch.randn(B, Vg, D, device=DEV, dtype=wdtype)
    g = make_grad(B, shape, D, "batch_major" if layout == "shared" else layout, dtype=wdtype, device=DEV)
    out, grad = _run_op("triton", w, idx, g, padding_idx, scale)
    out_ref, grad_ref = _run_op("torch", w, idx, g, padding_idx, scale)
    _, grad_exact = _run_op("torch", w.double(), idx, g.double(), padding_idx, scale)
    assert out.stride() == out_ref.stride()
    assert torch.equal(out, out_ref)
    assert grad.dtype == wdtype and grad.stride() == grad_ref.stride()
    assert_grad_close(grad, grad_ref, grad_exact)


@pytest.mark.gpu
@pytest.mark.parametrize("shared", [False, True])
@pytest.mark.parametrize("wdtype", [torch.float32, torch.bfloat16])
def test_gpu_backward_is_deterministic(shared, wdtype):
    # Zipf-like indices: a few rows take most hits, the case atomics would scramble.
    B, Vg, D, n = 4, 5000, 512, 8192
    probs = 1.0 / torch.arange(1, Vg + 1, dtype=torch.float64)
    draw = lambda m: torch.multinomial(probs, m * n, replacement=True).view(m, n).to(DEV)  # noqa: E731
    idx = hfkern.broadcast(draw(1)[0], B) if shared else draw(B)
    g = torch.randn(B, n, D, device=DEV, dtype=wdtype)
    with hfkern.use_backend("triton"):
        first = array_embedding_backward(g, idx, Vg, -1, True)
        for _ in range(3):
            assert torch.equal(array_embedding_backward(g, idx, Vg, -1, True), first)
    with hfkern.use_backend("torch"):
        expected = array_embedding_backward(g, idx, Vg, -1, True)
        exact = array_embedding_backward(g.double(), idx, Vg, -1, True)
    assert_grad_close(first, expected, exact)


@pytest.mark.gpu
@pytest.mark.parametrize("wdtype", [torch.float32, torch.bfloat16])
def test_gpu_module_with_triton_backend(wdtype):
    B, Vg, D = 4, 1000, 64
    emb = hfkern.nn.Embedding(Vg, D, padding_idx=0, scale_grad_by_freq=True, B=B).to(DEV, wdtype)
    idx = torch.randint(0, Vg, (B, 8, 33), device=DEV)
    g = torch.randn(B, 8, 33, D, device=DEV, dtype=wdtype)
    grads = {}
    for backend in ("triton", "torch"):
        emb.weight.grad = None
        with hfkern.use_backend(backend):
            emb(idx).backward(g)
        grads[backend] = emb.weight.grad.clone()
    with hfkern.use_backend("torch"):
        exact = array_embedding_backward(g.double(), idx, Vg, 0, True)
    assert torch.all(grads["triton"][:, 0] == 0)
    assert_grad_close(grads["triton"], grads["torch"], exact)


@pytest.mark.gpu
def test_gpu_opcheck_ops_on_triton():
    B, Vg, D = 3, 50, 40
    w = torch.randn(B, Vg, D, device=DEV)
    idx = torch.randint(0, Vg, (B, 5, 7), device=DEV)
    shared = make_indices(B, "shared", V=Vg, shape=(5, 7), device=DEV)
    g = make_grad(B, (5, 7), D, "batch_major", device=DEV)
    with hfkern.use_backend("triton"):
        torch.library.opcheck(array_embedding, (w, idx, -1, False, False))
        torch.library.opcheck(array_embedding, (w, shared.int(), 2, True, False))
        torch.library.opcheck(array_embedding_backward, (g, idx, Vg, 2, True))
        torch.library.opcheck(array_embedding_backward, (g, shared, Vg, -1, False))
        torch.library.opcheck(array_embedding, (w.requires_grad_(), idx, 1, True, False))
