"""The CUDA array batch norm (csrc/norm/batch_norm.cu) against B separate torch batch norms.

Emulator tests run the kernel sources built as host C++ (hfkern._C_emu) on CPU
tensors through the same launchers as on a GPU (hfkern.cuda.batch_norm.emulated),
with blocks of at most 16 threads so that small odd shapes span several blocks
and several chunks. The reference is B separate ``torch.nn.functional.batch_norm``
calls (one per model) in float64, followed by ``torch.relu`` / ``F.gelu``, and
autograd through them for the backward. GPU tests run the ops with the cuda
backend selected against the torch backend, and the launchers with an
activation against the float64 reference.
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from _norm_cases import EPS, MODE_IDS, MODES, assert_as_accurate, masks
from _norm_cases import run_batch_norm_op as _run_op

import hfkern
from hfkern import _backend
from hfkern._norm_layout import layout, partition
from hfkern.cuda import batch_norm as cb
from hfkern.ops import batch_norm as bnops

ACTIVATIONS = ("none", "relu", "gelu")
# error allowed against the float64 reference, relative to the reference's largest magnitude
# (the emulated kernels stay within about 3e-7, 4e-3 and 5e-4: float32 accumulation, and
# the rounding of the output into bfloat16 / float16)
TOL = {torch.float32: 1e-5, torch.bfloat16: 1e-2, torch.float16: 2e-3}

fwd = cb.emulated("array_batch_norm")
bwd = cb.emulated("array_batch_norm_backward")


# ---- inputs -----------------------------------------------------------------------

def make_x(B, shape, layout_name, dtype=torch.float32, device="cpu"):
    """x [B, *shape] (shape = (N, C, *S)) in the named memory layout."""
    kw = dict(dtype=dtype, device=device)
    N, C, *S = shape
    if layout_name == "contiguous":
        return torch.randn(B, *shape, **kw)
    if layout_name == "batch_major":  # an array conv's output: [N, B, C, *S] memory
        return torch.randn(N, B, C, *S, **kw).transpose(0, 1)
    if layout_name == "array_channels_last":  # [N, *S, B, C] memory: [N, B*C, *S] in channels_last
        return torch.randn(N, *S, B, C, **kw).permute(len(S) + 1, 0, len(S) + 2, *range(1, len(S) + 1))
    if layout_name == "channels_last":  # per model [B, N, *S, C]
        return torch.randn(B, N, *S, C, **kw).movedim(-1, 2)
    if layout_name == "shared":  # one input for every model: stride 0 on B
        return hfkern.broadcast(torch.randn(*shape, **kw), B)
    if layout_name == "strided_n":  # every other sample
        return torch.randn(B, 2 * N, C, *S, **kw)[:, ::2]
    if layout_name == "strided_last":  # every other element of the last dim
        return torch.randn(B, *shape[:-1], 2 * shape[-1], **kw)[..., ::2]
    if layout_name == "cropped":  # three reduced dims no two of which merge: copied
        return torch.randn(B, N, C, S[0] + 1, S[1] + 1, **kw)[..., : S[0], : S[1]]
    raise ValueError(layout_name)


def params(B, C, weight=True, bias=True, dtype=torch.float32):
    w = torch.randn(B, C).to(dtype) if weight else None
    b = torch.randn(B, C).to(dtype) if bias else None
    return w, b


def running(B, C, tracked, dtype=torch.float32):
    if not tracked:
        return None, None, None
    return torch.randn(B, C).to(dtype), (torch.rand(B, C) + 0.5).to(dtype), torch.arange(1, B + 1) * 2


def _act(z, activation):
    return {"none": lambda t: t, "relu": torch.relu, "gelu": F.gelu}[activation](z)


def _clone(t):
    return None if t is None else t.clone()


def _cpu(t):
    return None if t is None else t.cpu()


# ---- the reference: B separate batch norms in float64 ------------------------------

def reference(x, w, b, rm, rv, nbt, mode, activation, gy):
    """(y, mean, rstd, running_mean, running_var, grad_x, grad_w, grad_b), float64,
    from one F.batch_norm per model; the running statistics are updated copies."""
    training, momentum, _ = mode
    B = x.shape[0]
    dims = [0, *range(2, x.dim() - 1)]
    rm64 = None if rm is None else rm.double().clone()
    rv64 = None if rv is None else rv.double().clone()
    out = {k: [] for k in ("y", "mean", "rstd", "gx", "gw", "gb")}
    for i in range(B):
        xi = x[i].double().requires_grad_()
        wi = None if w is None else w[i].double().requires_grad_()
        # a zero bias without one: its gradient is grad_bias = sum(g), which the op gives either way
        bi = (torch.zeros(x.shape[2], dtype=torch.float64) if b is None else b[i].double()).requires_grad_()
        if training:
            var, mean = torch.var_mean(xi.detach(), dim=dims, correction=0)
        else:
            mean, var = rm64[i].clone(), rv64[i].clone()
        factor = momentum if momentum is not None else 1.0 / float(nbt[i])
        z = F.batch_norm(xi, None if rm64 is None else rm64[i], None if rv64 is None else rv64[i], wi, bi,
                         training, factor, EPS)
        yi = _act(z, activation)
        leaves = [t for t in (xi, wi, bi) if t is not None]
        grads = list(torch.autograd.grad(yi, leaves, gy[i].double()))
        out["y"].append(yi.detach())
        out["mean"].append(mean)
        out["rstd"].append((var + EPS).rsqrt())
        out["gx"].append(grads.pop(0))
        out["gw"].append(grads.pop(0) if wi is not None else None)
        out["gb"].append(grads.pop(0))
    stack = {k: torch.stack(v) if v[0] is not None else None for k, v in out.items()}
    return (stack["y"], stack["mean"], stack["rstd"], rm64, rv64, stack["gx"], stack["gw"], stack["gb"])


def _off_the_kink(gy, x, w, b, rm, rv, training):
    """gy with zeros where the pre-activation z is within rounding of 0: there ReLU's gradient
    is gy or 0 as the kernel's float32 z and the float64 reference's z fall either side, and
    one such element among 10^5 (seen on a GPU, float16) moves grad_x by a whole gy."""
    x64 = x.detach().cpu().double()
    dims = [0, *range(2, x.dim() - 1)]
    shape = [x.shape[0], *[1] * (x.dim() - 1)]            # [B, C] statistics over [B, N, C, *S]
    shape[2] = x.shape[2]
    if training:
        var, mean = torch.var_mean(x64, dim=[d + 1 for d in dims], correction=0, keepdim=True)
    else:
        mean, var = (t.cpu().double().view(shape) for t in (rm, rv))
    z = (x64 - mean) * (var + EPS).rsqrt()
    if w is not None:
        z = z * w.cpu().double().view(shape)
    if b is not None:
        z = z + b.cpu().double().view(shape)
    near = z.abs() <= 1e-3 * max(1.0, z.abs().max().item())
    return gy.masked_fill(near.to(gy.device), 0)


def assert_near(got, expected64, dtype, loosen=1.0):
    """got within TOL[dtype] (times ``loosen``) of the float64 reference, scaled by the
    reference's magnitude."""
    assert got.shape == expected64.shape, (got.shape, expected64.shape)
    scale = max(1.0, expected64.abs().max().item()) if expected64.numel() else 1.0
    tol = TOL[dtype] * loosen
    torch.testing.assert_close(got.double(), expected64, atol=tol * scale, rtol=tol)


def check(x, w, b, mode, activation, mask_list=([True, True, True],), grad_y=None, stats_dtype=torch.float32,
          launchers=(fwd, bwd), loosen=1.0):
    """The launchers' forward and backward (each mask) against the reference."""
    forward, backward = launchers
    training, momentum, tracked = mode
    B, C = x.shape[0], x.shape[2]
    rm, rv, nbt = running(B, C, tracked, dtype=stats_dtype)
    rm = None if rm is None else rm.to(x.device)
    rv = None if rv is None else rv.to(x.device)
    nbt = None if nbt is None else nbt.to(x.device)
    rm0, rv0 = _clone(rm), _clone(rv)
    gy = torch.randn(x.shape, device=x.device).to(x.dtype) if grad_y is None else grad_y
    if activation == "relu":
        gy = _off_the_kink(gy, x, w, b, rm, rv, training)
    y, mean, rstd = forward(x, w, b, rm, rv, nbt, training, momentum, EPS, activation)
    ref = reference(*(_cpu(t) for t in (x, w, b, rm0, rv0, nbt)), mode, activation, _cpu(gy))
    y64, mean64, rstd64, rm64, rv64, gx64, gw64, gb64 = ref
    dtype = x.dtype

    assert y.dtype == x.dtype and y.stride() == torch.empty_like(x).stride()
    assert mean.dtype == rstd.dtype == torch.float32 and mean.is_contiguous() and rstd.is_contiguous()
    assert_near(y.cpu(), y64, dtype, loosen)
    assert_near(mean.cpu(), mean64, torch.float32, loosen)
    assert_near(rstd.cpu(), rstd64, torch.float32, loosen)
    if tracked and training:
        assert_near(rm.cpu(), rm64, stats_dtype, loosen)
        assert_near(rv.cpu(), rv64, stats_dtype, loosen)
    elif tracked:  # eval: unchanged
        assert torch.equal(rm, rm0) and torch.equal(rv, rv0)

    for mask in mask_list:
        got = backward(gy, x, w, mean, rstd, training, mask, b, activation)
        assert len(got) == 3
        param_dtype = x.dtype if w is None else w.dtype
        for g, e, wanted, want_dtype in zip(got, (gx64, gw64, gb64), mask, (x.dtype, param_dtype, param_dtype)):
            if not wanted:
                assert g.shape == (0,)
                continue
            assert g.dtype == want_dtype
            if g is got[0]:
                assert g.stride() == torch.empty_like(x).stride()
            else:
                assert g.is_contiguous()
            assert_near(g.cpu(), e, dtype, loosen)
    return y, mean, rstd


# ---- emulator: layouts ---------------------------------------------------------------

N, C = 5, 7
# (B, per-model shape, layout, the dim that runs along memory: "c" or "r1"; None: copied)
LAYOUT_CASES = [
    (3, (N, C), "contiguous", "c"),  # [B, N, C] point features: one reduced dim, C along memory
    (1, (N, C), "contiguous", "c"),
    (3, (N, C, 3, 5), "contiguous", "r1"),
    (1, (N, C, 9), "contiguous", "r1"),
    (3, (N, C, 3, 5), "batch_major", "r1"),  # [N, B, C, H, W]: H, W merge, N apart
    (1, (N, C, 3, 5), "batch_major", "r1"),
    (3, (N, C, 9), "batch_major", "r1"),
    (3, (N, C, 3, 5), "array_channels_last", "c"),  # [N, H, W, B, C]: N, H, W merge
    (3, (N, C, 9), "array_channels_last", "c"),
    (3, (N, C, 3, 5), "channels_last", "c"),
    (3, (N, C, 3, 5), "shared", "r1"),
    (3, (N, C), "shared", "c"),
    (3, (N, C, 3, 5), "strided_n", "r1"),
    (3, (N, C, 3, 5), "strided_last", "r1"),
    (2, (N, C, 3, 5), "cropped", None),
]
LAYOUT_IDS = [f"B{c[0]}-{'x'.join(map(str, c[1]))}-{c[2]}" for c in LAYOUT_CASES]


@pytest.mark.emulator
@pytest.mark.parametrize("B,shape,layout_name,inner", LAYOUT_CASES, ids=LAYOUT_IDS)
def test_emulated_layouts(B, shape, layout_name, inner):
    x = make_x(B, shape, layout_name)
    lay = layout([x, torch.empty_like(x)])
    if inner is None:
        assert lay is None  # the one case that is copied
    else:
        # read where it lies, with threads along the dim that runs along memory
        assert lay is not None
        R0, R1, strides = lay
        tile = cb._tile(R0, shape[1], R1, strides[0][2], strides[0][3], cb._EMULATED_THREADS)
        assert tile[3] == (inner == "c")
    w, b = params(B, shape[1])
    check(x, w, b, MODES[0], "gelu")


@pytest.mark.emulator
@pytest.mark.parametrize("activation", ACTIVATIONS)
@pytest.mark.parametrize("mode", MODES, ids=MODE_IDS)
@pytest.mark.parametrize("case", [(3, (N, C, 3, 5), "batch_major"), (3, (N, C), "contiguous"),
                                  (1, (N, C, 9), "array_channels_last")], ids=["conv", "points", "B1-cl"])
def test_emulated_modes_and_activations(case, mode, activation):
    B, shape, layout_name = case
    x = make_x(B, shape, layout_name)
    w, b = params(B, shape[1])
    check(x, w, b, mode, activation)


@pytest.mark.emulator
@pytest.mark.parametrize("activation", ACTIVATIONS)
@pytest.mark.parametrize("training", [True, False], ids=["train", "eval"])
@pytest.mark.parametrize("weight,bias", [(True, True), (True, False), (False, True), (False, False)],
                         ids=["wb", "w", "b", "none"])
def test_emulated_backward_masks(weight, bias, training, activation):
    x = make_x(3, (N, C, 9), "batch_major")
    w, b = params(3, C, weight, bias)
    check(x, w, b, (training, 0.1, True), activation, mask_list=masks(weight))


@pytest.mark.emulator
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("activation", ["none", "relu", "gelu"])
@pytest.mark.parametrize("case", [(3, (N, C, 3, 5), "batch_major"), (3, (N, C), "contiguous"),
                                  (3, (N, C, 9), "array_channels_last")], ids=["conv", "points", "cl"])
def test_emulated_low_precision(case, activation, dtype):
    B, shape, layout_name = case
    x = make_x(B, shape, layout_name, dtype=dtype)
    w, b = params(B, shape[1], dtype=dtype)
    for mode in (MODES[0], MODES[3]):
        check(x, w, b, mode, activation, stats_dtype=dtype)


@pytest.mark.emulator
def test_emulated_mixed_dtypes():
    # bfloat16 data with float32 parameters and statistics, and a float32 grad_y
    x = make_x(3, (N, C, 3, 5), "batch_major", dtype=torch.bfloat16)
    w, b = params(3, C)
    gy = torch.randn(x.shape)
    check(x, w, b, MODES[1], "relu", mask_list=masks(True), grad_y=gy)
    # float16 data, bfloat16 parameters and running statistics
    x = make_x(3, (N, C), "contiguous", dtype=torch.float16)
    w, b = params(3, C, dtype=torch.bfloat16)
    check(x, w, b, MODES[0], "gelu", stats_dtype=torch.bfloat16)


@pytest.mark.emulator
@pytest.mark.parametrize("layout_name", ["batch_major", "contiguous"])
def test_emulated_expanded_grad_y(layout_name):
    # out.sum().backward() hands the backward a grad_y with stride 0 everywhere
    x = make_x(3, (N, C, 3, 5), layout_name)
    w, b = params(3, C)
    gy = torch.randn(()).expand(x.shape)
    assert layout([x, gy, torch.empty_like(x)]) is not None  # read where it lies
    for mode in (MODES[0], MODES[3]):
        for activation in ("none", "relu"):
            check(x, w, b, mode, activation, mask_list=masks(True), grad_y=gy)


def _partition_of(x, B_stats):
    R0, R1, strides = layout([x])
    tile = cb._tile(R0, x.shape[2], R1, strides[0][2], strides[0][3], cb._EMULATED_THREADS)
    programs = B_stats * math.ceil(x.shape[2] / tile[1])
    return tile, partition(x.device, programs, R0, R1, tile[0], tile[2])


@pytest.mark.emulator
@pytest.mark.parametrize("shape,layout_name,split", [
    ((100, 3), "contiguous", "r0"),  # [B, N, C]: chunks of several rows over N
    ((1, 3, 100), "contiguous", "r1"),  # N = 1: chunks over the spatial dim
    ((2, 2, 5, 16), "contiguous", "both"),  # N split, each part over the spatial dims
    ((6, 3, 2, 5), "array_channels_last", "r0"),
])
def test_emulated_many_chunks(shape, layout_name, split):
    x = make_x(1, shape, layout_name)
    tile, (chunk0, chunk1, P, P1) = _partition_of(x, 1)
    # the partition is what this case is here for
    if split == "r0":
        assert P1 == 1 and P > 1 and chunk0 > tile[0]
    elif split == "r1":
        assert P == P1 > 1 and chunk1 > tile[2]
    else:
        assert P1 > 1 and P > P1
    w, b = params(1, shape[1])
    check(x, w, b, MODES[1], "gelu", mask_list=[[True, True, True], [False, True, True]])


@pytest.mark.emulator
def test_emulated_deterministic():
    x = make_x(3, (N, C, 3, 5), "batch_major")
    w, b = params(3, C)
    gy = torch.randn(x.shape)
    runs = []
    for _ in range(2):
        torch.manual_seed(1)
        rm, rv, nbt = running(3, C, True)
        y, mean, rstd = fwd(x, w, b, rm, rv, nbt, True, 0.1, EPS, "gelu")
        grads = bwd(gy, x, w, mean, rstd, True, [True, True, True], b, "gelu")
        runs.append((y, mean, rstd, rm, rv, *grads))
    for a, c in zip(*runs):
        assert torch.equal(a, c)


@pytest.mark.emulator
@pytest.mark.filterwarnings("ignore:var_mean")
def test_emulated_empty_and_size_one_dims():
    B = 2
    x = torch.randn(B, 0, 3, 4)
    w, b = params(B, 3)
    for mode in MODES:
        training, momentum, tracked = mode
        rm, rv, nbt = running(B, 3, tracked)
        before = None if rm is None else (rm.clone(), rv.clone())
        y, mean, rstd = fwd(x, w, b, rm, rv, nbt, training, momentum, EPS, "relu")
        _, mean0, rstd0 = bnops.array_batch_norm_torch(x, w, b, _clone(rm), _clone(rv), nbt, training,
                                                       momentum, EPS)
        assert y.shape == x.shape
        torch.testing.assert_close((mean, rstd), (mean0, rstd0), equal_nan=True)
        if tracked:  # n == 0 changes no running statistic
            assert torch.equal(rm, before[0]) and torch.equal(rv, before[1])
        gx, gw, gb = bwd(x, x, w, mean0, rstd0, training, [True, True, True], b, "relu")
        assert gx.shape == x.shape and torch.equal(gw, torch.zeros(B, 3)) and torch.equal(gb, torch.zeros(B, 3))
    # N = 1 and H = 1 drop out of the layout; C = 1
    x = make_x(2, (1, 4, 1, 7), "batch_major")
    w, b = params(2, 4)
    check(x, w, b, MODES[0], "relu")
    x = make_x(2, (6, 1, 3), "contiguous")
    w, b = params(2, 1)
    check(x, w, b, MODES[1], "gelu")


@pytest.mark.emulator
def test_emulated_bad_inputs():
    x = torch.randn(2, 3, 4)
    ones = torch.ones(2, 4)
    with pytest.raises(TypeError, match="float32, float16 or bfloat16, got torch.float64"):
        fwd(x.double(), None, None, None, None, None, True, 0.1, EPS)
    with pytest.raises(TypeError, match="running_mean of dtype float32, float16 or bfloat16, got torch.float64"):
        fwd(x, None, None, ones.double(), ones.double(), None, True, 0.1, EPS)
    with pytest.raises(TypeError, match="got torch.float64"):
        bwd(x.double(), x.double(), None, ones, ones, True, [True, False, True])
    with pytest.raises(ValueError, match=r"activation in \['none', 'relu', 'gelu'\], got 'tanh'"):
        fwd(x, None, None, None, None, None, True, 0.1, EPS, "tanh")
    with pytest.raises(ValueError, match=r"activation in \['none', 'relu', 'gelu'\], got 'GELU'"):
        bwd(x, x, None, ones, ones, True, [True, False, True], None, "GELU")
    with pytest.raises(ValueError, match=r"expected bias of shape \[2, 4\]"):
        bwd(x, x, None, ones, ones, True, [True, False, True], torch.ones(2, 3), "relu")
    with pytest.raises(ValueError, match="expected x on a cpu device"):
        fwd(torch.randn(2, 3, 4, device="meta"), None, None, None, None, None, True, 0.1, EPS)
    with pytest.raises(ValueError, match="implements"):
        cb.emulated("array_layer_norm")
    # the kernels' own checks, behind the launcher's
    ext = cb._Launcher(emulate=True).ext(torch.device("cpu"))
    t = (x.data_ptr(), 0, 12, 4, 1, 0)
    with pytest.raises(ValueError, match="tile sizes in"):
        ext.batch_norm_stats(t, (2, 3, 4, 1), (1, 300, 1, 1), (3, 1, 1, 1), 0, 0, 0)
    with pytest.raises(ValueError, match="at most 256"):
        ext.batch_norm_stats(t, (2, 3, 4, 1), (4, 4, 32, 1), (3, 1, 1, 1), 0, 0, 0)
    with pytest.raises(ValueError, match="covering R0 = 3"):
        ext.batch_norm_stats(t, (2, 3, 4, 1), (1, 4, 1, 1), (1, 1, 2, 1), 0, 0, 0)
    with pytest.raises(ValueError, match="unknown activation code 7"):
        ext.batch_norm_apply(t, t, (2, 3, 4, 1), (1, 4, 1, 1), 0, 0, (0, 0, 0, 0), (0, 0, 0, 0), 7, 0)
    with pytest.raises(ValueError, match="dtype code 3"):
        ext.batch_norm_apply((x.data_ptr(), 3, 12, 4, 1, 0), (x.data_ptr(), 3, 12, 4, 1, 0), (2, 3, 4, 1),
                             (1, 4, 1, 1), 0, 0, (0, 0, 0, 0), (0, 0, 0, 0), 0, 0)


def test_registered_as_explicit_cuda_backend():
    for op, fn in (("array_batch_norm", cb.array_batch_norm),
                   ("array_batch_norm_backward", cb.array_batch_norm_backward)):
        entry = _backend._registry[op]["cuda"]
        # not auto-eligible until a GPU result of a training step shows it faster
        assert entry.load() is fn and entry.device_types == ("cuda",) and entry.auto is False


# ---- GPU: the cuda backend against the torch backend ---------------------------------

GPU = "cuda"


GPU_CASES = [
    (8, (32, 64, 16, 16), "batch_major"),  # a ResNet block's activation as an array conv leaves it
    (4, (64, 128, 8, 8), "contiguous"),
    (6, (128, 256), "contiguous"),  # BatchNorm1d on [B, N, C]
    (4, (16, 32, 7, 7), "array_channels_last"),
    (3, (16, 32, 7, 7), "channels_last"),
    (5, (16, 24, 33, 9), "shared"),
    (1, (2, 3, 224, 224), "batch_major"),  # few channels, a long reduced inner dim
    (2, (4, 8, 6, 10), "cropped"),
]


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("mode", MODES, ids=MODE_IDS)
@pytest.mark.parametrize("B,shape,layout_name", GPU_CASES)
def test_gpu_matches_torch_backend(B, shape, layout_name, mode, dtype):
    C_ = shape[1]
    x = make_x(B, shape, layout_name, dtype=dtype, device=GPU)
    w, b = (t.to(GPU) for t in params(B, C_, dtype=dtype))
    stats = tuple(None if t is None else t.to(GPU) for t in running(B, C_, mode[2]))
    gy = torch.randn(x.shape, dtype=dtype, device=GPU)
    outs, grads = _run_op(x, w, b, stats, mode, gy, "cuda")
    outs_t, grads_t = _run_op(x, w, b, stats, mode, gy, "torch")
    dbl = [t.double() for t in (x, w, b)]
    stats64 = tuple(None if t is None else (t.double() if t.is_floating_point() else t) for t in stats)
    outs_64, grads_64 = _run_op(*dbl, stats64, mode, gy.double(), "torch")
    for got, exp, r64 in zip(outs + grads, outs_t + grads_t, outs_64 + grads_64):
        assert_as_accurate(got, exp, r64)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("activation", ["relu", "gelu"])
@pytest.mark.parametrize("mode", [MODES[0], MODES[3]], ids=["train", "eval"])
@pytest.mark.parametrize("B,shape,layout_name", GPU_CASES[:4])
def test_gpu_activation_launchers(B, shape, layout_name, mode, activation, dtype):
    x = make_x(B, shape, layout_name, dtype=dtype, device=GPU)
    w, b = (t.to(GPU) for t in params(B, shape[1], dtype=dtype))
    # sums over thousands of values per channel: float32 rounding grows with them
    check(x, w, b, mode, activation, mask_list=masks(True),
          launchers=(cb.array_batch_norm, cb.array_batch_norm_backward), loosen=4.0)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gpu_deterministic(dtype):
    B, C_ = 4, 64
    x = make_x(B, (64, C_, 14, 14), "batch_major", dtype=dtype, device=GPU)
    w, b = (t.to(GPU) for t in params(B, C_, dtype=dtype))
    gy = torch.randn(x.shape, dtype=dtype, device=GPU)
    results = []
    for _ in range(2):
        rm, rv, nbt = (t.to(GPU) for t in running(B, C_, True))
        with hfkern.use_backend("cuda"):
            y, mean, rstd = bnops.array_batch_norm_op(x, w, b, rm, rv, nbt, True, 0.1, EPS)
            grads = bnops.array_batch_norm_backward(gy, x, w, mean, rstd, True, [True, True, True])
        results.append((y, mean, rstd, rm, rv, *grads))
    for a, c in zip(*results):
        assert torch.equal(a, c)
