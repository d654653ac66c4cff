"""The CUDA array embedding (csrc/embedding/embedding.cu) against the torch path and B separate embeddings.

Emulator tests run the kernel sources built as host C++ (hfkern._C_emu) on CPU
tensors through the same launchers as on a GPU (hfkern.cuda.embedding.emulated),
with blocks of 8 threads and chunks of 4 hits, so that small tables span several
blocks and frequent rows are cut into several chunks (the sort step is the
emulator build's std::stable_sort there; CUB runs only on the GPU). The
reference is B separate ``torch.nn.functional.embedding`` calls in float64, with
autograd for the weight gradient, and the torch backend's ops. GPU tests run the
ops with the cuda backend selected against the torch backend, CUB sort included.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import hfkern
from hfkern import _backend
from hfkern.cuda import embedding as ce
from hfkern.ops import embedding as eops

V = 11
# error allowed against the float64 reference, relative to its largest magnitude: float32
# accumulation, and the rounding of the gradient into bfloat16 / float16
TOL = {torch.float32: 1e-5, torch.bfloat16: 1e-2, torch.float16: 2e-3}

fwd = ce.emulated("array_embedding")
bwd = ce.emulated("array_embedding_backward")
torch_fwd = _backend._registry["array_embedding"]["torch"].load()
torch_bwd = _backend._registry["array_embedding_backward"]["torch"].load()


# ---- inputs -----------------------------------------------------------------------

def make_indices(B, shape, kind="uniform", shared=False, dtype=torch.int64, device="cpu", V=V):
    """[B, *shape] indices: uniform with repeats, or Zipf-like (row r drawn with
    probability ~ 1 / (r + 1)**1.5: rows 0 and 1 take most hits, longer than a chunk)."""
    models = 1 if shared else B
    if kind == "zipf":
        p = torch.arange(1, V + 1, dtype=torch.float64) ** -1.5
        idx = torch.multinomial(p, models * max(1, _numel(shape)), replacement=True)[: models * _numel(shape)]
        idx = idx.view(models, *shape)
    else:
        idx = torch.randint(0, V, (models, *shape))
        idx.view(-1)[::3] = 2  # repeated rows, and hits of the padding row
    idx = idx.to(dtype).to(device)
    return idx.expand(B, *shape) if shared else idx


def _numel(shape):
    n = 1
    for s in shape:
        n *= s
    return n


def make_grad(shape, D, layout="contiguous", dtype=torch.float32, device="cpu"):
    """grad_out [*shape, D] (shape = (B, *)) in the named memory layout."""
    kw = dict(dtype=dtype, device=device)
    if layout == "contiguous":
        return torch.randn(*shape, D, **kw)
    if layout == "strided_d":  # every other element of D
        return torch.randn(*shape, 2 * D, **kw)[..., ::2]
    if layout == "batch_major":  # [N, B, ..., D] memory
        return torch.randn(shape[1], shape[0], *shape[2:], D, **kw).transpose(0, 1)
    if layout == "expanded":  # stride 0 everywhere (the gradient of a sum)
        return torch.randn(1, **kw).expand(*shape, D)
    raise ValueError(layout)


def make_weight(B, D, layout="contiguous", dtype=torch.float32, device="cpu"):
    kw = dict(dtype=dtype, device=device)
    if layout == "contiguous":
        return torch.randn(B, V, D, **kw)
    if layout == "transposed":  # [B, D, V] memory: a column per element of a row
        return torch.randn(B, D, V, **kw).transpose(1, 2)
    if layout == "sliced":  # rows of a wider table
        return torch.randn(B, V, D + 3, **kw)[..., 1 : D + 1]
    raise ValueError(layout)


# ---- the reference: B separate embeddings in float64 ------------------------------

def reference(weight, indices, grad_out, padding_idx=None, scale=False):
    """(out, grad_w) in float64 from one F.embedding per model (padding_idx as torch takes it)."""
    outs, grads = [], []
    for b in range(weight.shape[0]):
        w = weight[b].detach().double().requires_grad_()
        y = F.embedding(indices[b].long(), w, padding_idx=padding_idx, scale_grad_by_freq=scale)
        (g,) = torch.autograd.grad(y, w, grad_out[b].double())
        outs.append(y.detach())
        grads.append(g)
    return torch.stack(outs), torch.stack(grads)


def assert_near(got, expected64, dtype):
    assert got.shape == expected64.shape, (got.shape, expected64.shape)
    assert got.dtype == dtype
    scale = max(1.0, expected64.abs().max().item()) if expected64.numel() else 1.0
    tol = TOL[dtype]
    torch.testing.assert_close(got.double(), expected64, atol=tol * scale, rtol=tol)


def check(weight, indices, grad_out, padding_idx=-1, scale=False, launchers=(fwd, bwd)):
    """Forward equal to the torch backend bit for bit; both results near B separate embeddings."""
    forward, backward = launchers
    D = weight.shape[-1]
    out = forward(weight, indices, padding_idx, scale, False)
    assert out.is_contiguous()
    assert torch.equal(out, torch_fwd(weight, indices, padding_idx, scale, False))
    grad_w = backward(grad_out, indices, V, padding_idx, scale)
    assert grad_w.is_contiguous() and grad_w.shape == (weight.shape[0], V, D)
    out64, grad64 = reference(weight, indices, grad_out, None if padding_idx < 0 else padding_idx, scale)
    assert_near(out, out64, weight.dtype)
    assert_near(grad_w, grad64, grad_out.dtype)
    assert_near(torch_bwd(grad_out, indices, V, padding_idx, scale), grad64, grad_out.dtype)  # the oracle itself
    return grad_w


# ---- emulator ----------------------------------------------------------------------

@pytest.mark.emulator
@pytest.mark.parametrize("B", [1, 3])
@pytest.mark.parametrize("D", [7, 16, 33])
@pytest.mark.parametrize("shared", [False, True], ids=["per_model", "shared"])
@pytest.mark.parametrize("kind", ["uniform", "zipf"])
def test_emulated_fp32(B, D, shared, kind):
    idx = make_indices(B, (4, 5), kind, shared)
    w = make_weight(B, D)
    gy = make_grad(idx.shape, D)
    for padding_idx, scale in ((-1, False), (2, False), (-1, True), (2, True)):
        check(w, idx, gy, padding_idx, scale)


@pytest.mark.emulator
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("D", [7, 16])
@pytest.mark.parametrize("shared", [False, True], ids=["per_model", "shared"])
def test_emulated_half_dtypes(dtype, D, shared):
    idx = make_indices(3, (3, 7), "zipf", shared)
    w = make_weight(3, D, dtype=dtype)
    gy = make_grad(idx.shape, D, dtype=dtype)
    check(w, idx, gy, 2, True)
    check(w, idx, gy, -1, False)


@pytest.mark.emulator
def test_emulated_negative_padding_idx():
    # torch.nn.Embedding(padding_idx=-2) means row V - 2; the op takes it normalized.
    idx = make_indices(3, (6, 4), "zipf")
    idx[1, 0, :2] = V - 2
    w, gy = make_weight(3, 33), make_grad(idx.shape, 33)
    grad_w = bwd(gy, idx, V, V - 2, True)
    _, grad64 = reference(w, idx, gy, padding_idx=-2, scale=True)
    assert_near(grad_w, grad64, torch.float32)
    assert torch.count_nonzero(grad_w[:, V - 2]) == 0
    with pytest.raises(ValueError, match="padding_idx"):
        bwd(gy, idx, V, -2, False)  # the op's padding_idx: -1 (none) or in [0, V)


@pytest.mark.emulator
@pytest.mark.parametrize("layout", ["strided_d", "batch_major", "expanded"])
@pytest.mark.parametrize("weight_layout", ["transposed", "sliced"])
def test_emulated_strided(layout, weight_layout):
    B, D = 3, 8
    # indices as an array conv's output leaves them ([N, B, L] memory), int32
    idx = make_indices(B, (5, 3), "zipf").transpose(0, 1).contiguous().transpose(0, 1).to(torch.int32)
    assert not idx.is_contiguous()
    w = make_weight(B, D, weight_layout)
    gy = make_grad(idx.shape, D, layout)
    check(w, idx, gy, 2, True)


@pytest.mark.emulator
def test_emulated_uncollapsible_index_dims():
    # three index dims no two of which merge: the launcher copies them first
    idx = torch.randint(0, V, (2, 4, 5, 6))[:, ::2, ::2, ::2]
    w = make_weight(2, 5)
    gy = make_grad(idx.shape, 5, "batch_major")
    check(w, idx, gy, 3, False)


@pytest.mark.emulator
def test_emulated_chunk_sizes_agree():
    """Rows cut into chunks (of 1, 3, 4 hits) sum to what unchunked rows sum to, and the
    summation order depends on the chunk only: other block shapes give equal bits."""
    B, D = 3, 6
    for shared in (False, True):
        idx = make_indices(B, (40,), "zipf", shared)
        gy = make_grad(idx.shape, D)
        whole = ce.emulated("array_embedding_backward", chunk=10**6)(gy, idx, V, 1, True)
        for chunk in (1, 3, 4):
            got = ce.emulated("array_embedding_backward", chunk=chunk)(gy, idx, V, 1, True)
            torch.testing.assert_close(got, whole, atol=1e-6, rtol=1e-6)
        base = bwd(gy, idx, V, 1, True)
        other = ce._Launcher(emulate=True)
        other.threads, other.row_lanes, other.chunk_lanes = 6, 2, 1
        assert torch.equal(other.backward(gy, idx, V, 1, True), base)
        assert torch.equal(bwd(gy, idx, V, 1, True), base)


@pytest.mark.emulator
@pytest.mark.parametrize("shared", [False, True], ids=["per_model", "shared"])
def test_emulated_empty(shared):
    idx = make_indices(3, (0, 4), shared=shared)
    w = make_weight(3, 5)
    assert fwd(w, idx).shape == (3, 0, 4, 5)
    gy = make_grad(idx.shape, 5)
    grad_w = bwd(gy, idx, V, 2, True)
    assert grad_w.shape == (3, V, 5) and torch.count_nonzero(grad_w) == 0
    assert bwd(torch.randn(3, 4, 0), torch.zeros(3, 4, dtype=torch.long), V, -1, False).shape == (3, V, 0)


@pytest.mark.emulator
def test_emulated_one_index_per_model():
    idx = torch.tensor([[3], [0], [3]])
    w = make_weight(3, 4)
    check(w, idx, make_grad(idx.shape, 4), -1, True)


@pytest.mark.emulator
def test_emulated_bad_inputs():
    w, idx = make_weight(3, 4), make_indices(3, (5,))
    gy = make_grad(idx.shape, 4)
    with pytest.raises(TypeError, match="float32, float16 or bfloat16"):
        fwd(w.double(), idx)
    with pytest.raises(TypeError, match="float32, float16 or bfloat16"):
        bwd(gy.double(), idx, V, -1, False)
    with pytest.raises(TypeError, match="int32 or int64"):
        fwd(w, idx.float())
    with pytest.raises(ValueError, match="shape \\[B, \\*\\] with B = 3"):
        fwd(w, idx[:2])
    with pytest.raises(ValueError, match="shape \\[B, V, D\\]"):
        fwd(w[0], idx)
    with pytest.raises(ValueError, match="grad_out of shape"):
        bwd(gy[:, :4], idx, V, -1, False)
    with pytest.raises(ValueError, match="padding_idx"):
        bwd(gy, idx, V, V, False)
    with pytest.raises(ValueError, match="padding_idx"):
        fwd(w, idx, -3)
    with pytest.raises(ValueError, match="num_weights"):
        bwd(gy, idx, -1, -1, False)
    with pytest.raises(ValueError, match="implements"):
        ce.emulated("array_embedding_renorm_")


# ---- GPU ---------------------------------------------------------------------------

GPU = "cuda"
GPU_DTYPES = [torch.float32, torch.bfloat16, torch.float16]


def _gpu_case(B, shape, D, kind, shared, dtype, V_=1000):
    idx = make_indices(B, shape, kind, shared, device=GPU, V=V_)
    w = torch.randn(B, V_, D, device=GPU, dtype=dtype)
    gy = torch.randn(*idx.shape, D, device=GPU, dtype=dtype)
    return w, idx, gy


def _run(backend, w, idx, gy, padding_idx, scale):
    with hfkern.use_backend(backend):
        out = eops.array_embedding(w, idx, padding_idx, scale, False)
        grad_w = eops.array_embedding_backward(gy, idx, w.shape[1], padding_idx, scale)
    return out, grad_w


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", GPU_DTYPES)
@pytest.mark.parametrize("D", [33, 256])
@pytest.mark.parametrize("shared", [False, True], ids=["per_model", "shared"])
@pytest.mark.parametrize("kind", ["uniform", "zipf"])
def test_gpu_matches_torch_backend(dtype, D, shared, kind):
    w, idx, gy = _gpu_case(4, (16, 256), D, kind, shared, dtype)
    for padding_idx, scale in ((-1, False), (2, True)):
        out, grad_w = _run("cuda", w, idx, gy, padding_idx, scale)
        out_t, grad_t = _run("torch", w, idx, gy, padding_idx, scale)
        assert torch.equal(out, out_t)
        grad64 = torch_bwd(gy.double(), idx, w.shape[1], padding_idx, scale)
        assert_near(grad_w, grad64, dtype)
        assert_near(grad_t, grad64, dtype)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", GPU_DTYPES)
def test_gpu_autograd_against_separate_embeddings(dtype):
    B, D, V_ = 3, 40, 500
    idx = make_indices(B, (8, 300), "zipf", device=GPU, V=V_).to(torch.int32)
    w = torch.randn(B, V_, D, device=GPU, dtype=dtype, requires_grad=True)
    gy = torch.randn(*idx.shape, D, device=GPU, dtype=dtype)
    with hfkern.use_backend("cuda"):
        out = eops.array_embedding(w, idx, 3, True, False)
    (grad_w,) = torch.autograd.grad(out, w, gy)
    out64, grad64 = reference(w, idx, gy, padding_idx=3, scale=True)
    assert_near(out, out64, dtype)
    assert_near(grad_w, grad64, dtype)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", GPU_DTYPES)
@pytest.mark.parametrize("shared", [False, True], ids=["per_model", "shared"])
def test_gpu_deterministic(dtype, shared):
    # text-like indices: the frequent rows take the chunked path of the CUB-sorted order
    w, idx, gy = _gpu_case(4, (32, 512), 128, "zipf", shared, dtype, V_=8192)
    first = _run("cuda", w, idx, gy, 0, True)
    for _ in range(2):
        again = _run("cuda", w, idx, gy, 0, True)
        for a, b in zip(first, again):
            assert torch.equal(a, b)


@pytest.mark.gpu
def test_gpu_strided_launchers():
    B, D, V_ = 3, 24, 300
    idx = make_indices(B, (50, 7), "zipf", device=GPU, V=V_).transpose(0, 1).contiguous().transpose(0, 1)
    w = torch.randn(B, D, V_, device=GPU).transpose(1, 2)
    gy = torch.randn(*idx.shape, 2 * D, device=GPU)[..., ::2]
    out = ce.array_embedding(w, idx)
    assert torch.equal(out, torch_fwd(w, idx))
    grad_w = ce.array_embedding_backward(gy, idx, V_, 5, True)
    grad64 = torch_bwd(gy.double(), idx, V_, 5, True)
    assert_near(grad_w, grad64, torch.float32)
