"""Triton array batch norm against the torch implementation.

Interpreter tests call the launchers on CPU float32 tensors (TRITON_INTERPRET=1),
with shapes chosen to reach every kernel path: tiles long along the reduced
inner dim or along the channels, reduced dims stored as one or two strided
dims (or copied when they need more), several tiles per program and several
chunks per (model, channel block) split over either reduced dim, training and
eval, the running-statistics update with a momentum or a cumulative average.
GPU tests go through the hfkern ops with the triton backend selected.
"""

import pytest

triton = pytest.importorskip("triton")

import torch  # noqa: E402
from _norm_cases import (  # noqa: E402
    EPS,
    GRAD_TOL,
    MODE_IDS,
    MODES,
    Impls,
    assert_as_accurate,
    assert_grads,
    assert_same_layout,
    masks,
)
from _norm_cases import run_batch_norm_op as _run_op  # noqa: E402

import hfkern  # noqa: E402
import hfkern.nn as hnn  # noqa: E402
from hfkern import _backend  # noqa: E402
from hfkern.ops import batch_norm as bnops  # noqa: E402

_OPS = ("array_batch_norm", "array_batch_norm_backward")
ref = Impls("torch", _OPS)
# the device the GPU tests run on (a name, so their logic can be tried elsewhere)
GPU = "cuda"


def make_x(B, shape, layout, dtype=torch.float32, device="cpu"):
    """[B, *shape] (shape = (N, C, *S)) in the given memory layout."""
    kw = dict(dtype=dtype, device=device)
    N, C, *S = shape
    if layout == "contiguous":
        return torch.randn(B, *shape, **kw)
    if layout == "batch_major":  # what an array conv produces: [N, B, C, *S] memory
        return torch.randn(N, B, *shape[1:], **kw).transpose(0, 1)
    if layout == "channels_last":  # [B, N, *S, C] memory: the channels run along memory
        return torch.randn(B, N, *S, C, **kw).movedim(-1, 2)
    if layout == "array_channels_last":  # [N, H, W, B, C]: a channels-last array image
        return torch.randn(N, *S, B, C, **kw).permute(3, 0, 4, 1, 2)
    if layout == "strided":  # every other element of the last dim: still two strided dims
        return torch.randn(B, *shape[:-1], 2 * shape[-1], **kw)[..., ::2]
    if layout == "shared":
        return hfkern.broadcast(torch.randn(*shape, **kw), B)
    if layout == "scrambled":  # N, H, W no two of which merge: copied, output copied back
        return torch.randn(B, *shape[:-2], shape[-2], 2 * shape[-1], **kw)[..., ::2].transpose(-1, -2)
    raise ValueError(layout)


def params(B, C, weight, bias, dtype=torch.float32, device="cpu"):
    kw = dict(dtype=dtype, device=device)
    w = torch.randn(B, C, **kw) if weight else None
    b = torch.randn(B, C, **kw) if bias else None
    return w, b


def running(B, C, tracked, dtype=torch.float32, device="cpu"):
    if not tracked:
        return None, None, None
    kw = dict(dtype=dtype, device=device)
    counts = torch.arange(1, B + 1, device=device) * 2
    return torch.randn(B, C, **kw), torch.rand(B, C, **kw) + 0.5, counts


# ---- interpreter: launchers against the torch implementation -----------------

def _tk():
    from hfkern.triton import batch_norm as tk

    return tk


def check(x, w, b, mode, mask_list, grad_y=None, activation="none"):
    training, momentum, tracked = mode
    tk = _tk()
    B, C = x.shape[0], x.shape[2]
    rm, rv, nbt = running(B, C, tracked)
    rm0, rv0 = (None, None) if rm is None else (rm.clone(), rv.clone())
    y, mean, rstd = tk.array_batch_norm(x, w, b, rm, rv, nbt, training, momentum, EPS, activation)
    y0, mean0, rstd0 = ref.array_batch_norm(x, w, b, rm0, rv0, nbt, training, momentum, EPS, activation)
    for got, exp in ((y, y0), (mean, mean0), (rstd, rstd0)):
        assert_same_layout(got, exp)
        torch.testing.assert_close(got, exp)
    assert mean.is_contiguous() and rstd.is_contiguous()
    if tracked:
        torch.testing.assert_close(rm, rm0)
        torch.testing.assert_close(rv, rv0)
    gy = torch.randn(y0.shape) if grad_y is None else grad_y
    for mask in mask_list:
        got = tk.array_batch_norm_backward(gy, x, w, mean0, rstd0, training, mask, b, activation)
        exp = ref.array_batch_norm_backward(gy, x, w, mean0, rstd0, training, mask, b, activation)
        assert_grads(got, exp, mask)


# (B, per-model shape (N, C, *S), layout). In the interpreter a tile holds 32
# elements, at most 8 along the dim that runs along memory, and about 8
# programs share each reduction.
CASES = [
    (3, (5, 7), "contiguous"),  # [B, N, C]: channels along memory, one reduced dim
    (1, (6, 3, 11), "contiguous"),  # B = 1; the reduced inner dim along memory, partial tiles
    (3, (4, 5, 3, 3), "batch_major"),  # [N, B, C, H, W] memory: H, W merge, N apart
    (2, (3, 6, 2, 5), "channels_last"),  # N, H, W merge into one dim; channels along memory
    (2, (3, 4, 4, 6), "strided"),  # W stride 2, H merges with it
    (3, (5, 3, 7), "shared"),  # stride 0 on the array dim: statistics once
    (2, (3, 3, 4, 5), "scrambled"),  # three strided reduced dims: copied, output copied back
    (2, (2, 3, 2, 3, 4), "contiguous"),  # three spatial dims
    (2, (2, 3, 2, 3, 4), "batch_major"),
]
CASE_IDS = [f"B{c[0]}-{'x'.join(map(str, c[1]))}-{c[2]}" for c in CASES]


# every mode on the first cases, training and eval on the others (the
# interpreter is slow, and the modes only change the per-channel kernels)
LAYOUT_MODE_CASES = [
    pytest.param(*case, mode, id=f"{case_id}-{mode_id}")
    for i, (case, case_id) in enumerate(zip(CASES, CASE_IDS))
    for mode, mode_id in zip(MODES, MODE_IDS)
    if i < 3 or mode_id in ("train", "eval")
]


@pytest.mark.interpreter
@pytest.mark.parametrize("B,shape,layout,mode", LAYOUT_MODE_CASES)
def test_layouts_and_modes(B, shape, layout, mode):
    x = make_x(B, shape, layout)
    w, b = params(B, shape[1], True, True)
    check(x, w, b, mode, [[True, True, True]])


@pytest.mark.interpreter
@pytest.mark.parametrize("weight,bias", [(True, True), (True, False), (False, True), (False, False)])
@pytest.mark.parametrize("mode", [MODES[0], MODES[3]], ids=["train", "eval"])
def test_affine_and_masks(weight, bias, mode):
    x = make_x(2, (4, 3, 5), "batch_major")
    w, b = params(2, 3, weight, bias)
    check(x, w, b, mode, masks(weight))


@pytest.mark.interpreter
@pytest.mark.parametrize("activation", ["relu", "gelu"])
@pytest.mark.parametrize("mode", [MODES[0], MODES[3]], ids=["train", "eval"])
@pytest.mark.parametrize("B,shape,layout,weight,bias", [
    (3, (5, 7), "contiguous", True, True),  # channels along memory
    (2, (4, 5, 3, 3), "batch_major", True, False),  # z without a bias
    (2, (3, 6, 2, 5), "array_channels_last", False, True),  # [N, H, W, B, C] memory, z without a weight
    (3, (5, 3, 7), "shared", True, True),
])
def test_fused_activation(B, shape, layout, weight, bias, mode, activation):
    """The activation in the normalize kernel, z recomputed in the partial-sum and grad_x kernels."""
    x = make_x(B, shape, layout)
    w, b = params(B, shape[1], weight, bias)
    check(x, w, b, mode, masks(weight), activation=activation)


def _partition_of(x):
    """(blocks, CHUNK0, CHUNK1, P, P1) of the forward statistics of x."""
    tk = _tk()
    R0, R1, strides = tk._layout([x])
    blocks = tk._blocks(R0, x.shape[2], R1, *strides[0][2:])
    programs = x.shape[0] * triton.cdiv(x.shape[2], blocks[1])
    return (blocks, *tk._partition(x.device, programs, R0, R1, blocks[0], blocks[2]))


@pytest.mark.interpreter
@pytest.mark.parametrize("shape,layout,split", [
    ((100, 3), "contiguous", "r0"),  # [B, N, C]: chunks of several tiles over N
    ((2, 2, 40), "contiguous", "r1"),  # N too short to split: chunks over the spatial dim
    ((5, 2, 5, 8), "contiguous", "both"),  # N split in two, each half over the spatial dim
])
def test_many_chunks_and_tiles(shape, layout, split):
    x = make_x(1, shape, layout)
    blocks, chunk0, chunk1, P, P1 = _partition_of(x)
    # the partition is what this case is here for
    if split == "r0":
        assert P1 == 1 and P > 1 and chunk0 > blocks[0]
    elif split == "r1":
        assert P == P1 > 1 and chunk1 > blocks[2]
    else:
        assert P1 > 1 and P > P1
    w, b = params(1, shape[1], True, True)
    check(x, w, b, MODES[1], [[True, True, True], [False, True, True]])


@pytest.mark.interpreter
def test_expanded_grad_y():
    # out.sum().backward() hands the backward a grad_y with stride 0 everywhere
    x = make_x(3, (4, 5, 3, 2), "batch_major")
    w, b = params(3, 5, True, True)
    gy = torch.randn(()).expand(x.shape)
    for mode in (MODES[0], MODES[3]):
        check(x, w, b, mode, [[True, True, True]], grad_y=gy)


@pytest.mark.interpreter
def test_size_one_dims_and_one_channel():
    x = make_x(2, (1, 4, 1, 7), "batch_major")  # N = 1, H = 1: dropped from the layout
    w, b = params(2, 4, True, True)
    check(x, w, b, MODES[0], [[True, True, True]])
    x = make_x(2, (6, 1, 3), "contiguous")  # C = 1
    w, b = params(2, 1, True, True)
    check(x, w, b, MODES[1], [[True, True, True]])


@pytest.mark.interpreter
@pytest.mark.filterwarnings("ignore:var_mean")
def test_empty_input():
    B, C = 2, 3
    x = torch.randn(B, 0, C, 4)
    w, b = params(B, C, True, True)
    for mode in MODES:
        training, momentum, tracked = mode
        rm, rv, nbt = running(B, C, tracked)
        before = None if rm is None else (rm.clone(), rv.clone())
        y, mean, rstd = _tk().array_batch_norm(x, w, b, rm, rv, nbt, training, momentum, EPS)
        y0, mean0, rstd0 = ref.array_batch_norm(x, w, b, rm, rv, nbt, training, momentum, EPS)
        assert y.shape == x.shape
        torch.testing.assert_close((mean, rstd), (mean0, rstd0), equal_nan=True)
        if tracked:
            assert torch.equal(rm, before[0]) and torch.equal(rv, before[1])
        got = _tk().array_batch_norm_backward(x, x, w, mean0, rstd0, training, [True, True, True])
        assert_grads(got, ref.array_batch_norm_backward(x, x, w, mean0, rstd0, training, [True, True, True]),
                     [True, True, True])


@pytest.mark.interpreter
def test_registered_triton_implementations():
    # what the registry calls for CUDA tensors, called directly on CPU tensors
    ops = Impls("triton", _OPS)
    B, C = 3, 4
    x = make_x(B, (5, C, 3), "batch_major")
    w, b = params(B, C, True, True)
    rm, rv, nbt = running(B, C, True)
    rm0, rv0 = rm.clone(), rv.clone()
    y, mean, rstd = ops.array_batch_norm(x, w, b, rm, rv, nbt, True, None, EPS)
    y0, mean0, rstd0 = ref.array_batch_norm(x, w, b, rm0, rv0, nbt, True, None, EPS)
    torch.testing.assert_close((y, mean, rstd, rm, rv), (y0, mean0, rstd0, rm0, rv0))
    assert y.stride() == y0.stride()
    gy = torch.randn(x.shape)
    mask = [True, True, False]
    got = ops.array_batch_norm_backward(gy, x, w, mean, rstd, True, mask)
    assert_grads(got, ref.array_batch_norm_backward(gy, x, w, mean0, rstd0, True, mask), mask)


def test_registered_as_explicit_cuda_backend():
    from hfkern.triton import batch_norm as tk

    for op in _OPS:
        entry = _backend._registry[op]["triton"]
        # not auto-eligible until a GPU benchmark shows the kernels faster
        assert entry.load() is getattr(tk, op) and entry.device_types == ("cuda",) and entry.auto is False
        assert entry.dtypes == (torch.float32, torch.float16, torch.bfloat16)


@pytest.mark.interpreter
def test_bad_inputs():
    tk = _tk()
    x = torch.randn(2, 3, 4, dtype=torch.float64)
    with pytest.raises(TypeError, match="float32, float16 or bfloat16.*got torch.float64"):
        tk.array_batch_norm(x, None, None, None, None, None, True, 0.1, EPS)
    with pytest.raises(TypeError, match="got torch.float64"):
        tk.array_batch_norm(x.float(), None, None, torch.zeros(2, 4, dtype=torch.float64),
                            torch.ones(2, 4, dtype=torch.float64), None, True, 0.1, EPS)
    with pytest.raises(TypeError, match="got torch.float64"):
        ones = torch.ones(2, 4)
        tk.array_batch_norm_backward(x, x, None, ones, ones, True, [True, False, True])


@pytest.mark.interpreter
def test_cpu_tensors_need_the_interpreter(monkeypatch):
    tk = _tk()
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    with pytest.raises(ValueError, match="expected CUDA tensors.*got x on cpu"):
        tk.array_batch_norm(torch.randn(2, 3, 4), None, None, None, None, None, True, 0.1, EPS)


# ---- GPU: the ops with the triton backend against the torch backend ----------

GPU_CASES = [
    (8, (32, 64, 16, 16), "batch_major"),  # a ResNet block's activation as an array conv leaves it
    (4, (64, 128, 8, 8), "contiguous"),
    (6, (128, 256), "contiguous"),  # BatchNorm1d on [B, N, C]
    (3, (16, 32, 7, 7), "channels_last"),
    (5, (16, 24, 33, 9), "shared"),
    (1, (2, 3, 224, 224), "batch_major"),  # few channels, a long reduced inner dim
    (2, (4, 8, 6, 10), "scrambled"),
]


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("mode", MODES, ids=MODE_IDS)
@pytest.mark.parametrize("B,shape,layout", GPU_CASES)
def test_gpu_matches_torch_backend(B, shape, layout, mode, dtype):
    C = shape[1]
    x = make_x(B, shape, layout, dtype=dtype, device=GPU)
    w, b = params(B, C, True, True, dtype=dtype, device=GPU)
    stats = running(B, C, mode[2], dtype=torch.float32, device=GPU)
    gy = torch.randn(x.shape, dtype=dtype, device=GPU)
    outs, grads = _run_op(x, w, b, stats, mode, gy, "triton")
    outs_t, grads_t = _run_op(x, w, b, stats, mode, gy, "torch")
    dbl = [None if t is None else t.double() for t in (x, w, b)]
    stats64 = tuple(t.double() if t is not None and t.is_floating_point() else t for t in stats)
    outs_64, grads_64 = _run_op(*dbl, stats64, mode, gy.double(), "torch")
    for got, exp, r64 in zip(outs + grads, outs_t + grads_t, outs_64 + grads_64):
        assert_as_accurate(got, exp, r64)


@pytest.mark.gpu
@pytest.mark.parametrize("activation", ["relu", "gelu"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("mode", [MODES[0], MODES[3]], ids=["train", "eval"])
@pytest.mark.parametrize("B,shape,layout", [GPU_CASES[0], GPU_CASES[2], (4, (8, 32, 7, 7), "array_channels_last")])
def test_gpu_fused_activation_matches_torch_backend(B, shape, layout, mode, dtype, activation):
    C = shape[1]
    x = make_x(B, shape, layout, dtype=dtype, device=GPU)
    w, b = params(B, C, True, True, dtype=dtype, device=GPU)
    stats = running(B, C, mode[2], dtype=torch.float32, device=GPU)
    gy = torch.randn(x.shape, dtype=dtype, device=GPU)
    outs, grads = _run_op(x, w, b, stats, mode, gy, "triton", activation)
    outs_t, grads_t = _run_op(x, w, b, stats, mode, gy, "torch", activation)
    dbl = [None if t is None else t.double() for t in (x, w, b)]
    stats64 = tuple(t.double() if t is not None and t.is_floating_point() else t for t in stats)
    outs_64, grads_64 = _run_op(*dbl, stats64, mode, gy.double(), "torch", activation)
    for got, exp, r64 in zip(outs + grads, outs_t + grads_t, outs_64 + grads_64):
        assert_as_accurate(got, exp, r64)


@pytest.mark.gpu
@pytest.mark.parametrize("training", [True, False])
@pytest.mark.parametrize("weight", [True, False])
def test_gpu_backward_output_masks(training, weight):
    B, C = 4, 48
    x = make_x(B, (16, C, 9, 9), "batch_major", device=GPU)
    w, _ = params(B, C, weight, False, device=GPU)
    gy = torch.randn(x.shape, device=GPU)
    rm, rv, nbt = running(B, C, True, device=GPU)
    _, mean, rstd = ref.array_batch_norm(x, w, None, rm, rv, nbt, training, 0.1, EPS)
    for mask in masks(weight):
        with hfkern.use_backend("triton"):
            got = bnops.array_batch_norm_backward(gy, x, w, mean, rstd, training, mask)
        assert_grads(got, ref.array_batch_norm_backward(gy, x, w, mean, rstd, training, mask), mask)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gpu_deterministic(dtype):
    B, C = 4, 64
    x = make_x(B, (64, C, 14, 14), "batch_major", dtype=dtype, device=GPU)
    w, _ = params(B, C, True, False, dtype=dtype, device=GPU)
    gy = torch.randn(x.shape, dtype=dtype, device=GPU)
    results = []
    for _ in range(2):
        rm, rv, nbt = running(B, C, True, device=GPU)
        with hfkern.use_backend("triton"):
            y, mean, rstd = bnops.array_batch_norm_op(x, w, None, rm, rv, nbt, True, 0.1, EPS)
            grads = bnops.array_batch_norm_backward(gy, x, w, mean, rstd, True, [True, True, True])
        results.append((y, mean, rstd, *grads))
    for a, c in zip(*results):
        assert torch.equal(a, c)


@pytest.mark.gpu
@pytest.mark.parametrize("layout", ["contiguous", "batch_major", "shared"])
def test_gpu_modules_with_triton_backend(layout):
    B = 3
    x = make_x(B, (8, 6, 5, 5), layout, device=GPU)
    modules = {backend: hnn.BatchNorm2d(6, momentum=None, B=B).to(GPU) for backend in ("triton", "torch")}
    with torch.no_grad():
        modules["torch"].weight.normal_()
    modules["triton"].load_state_dict(modules["torch"].state_dict())
    results = []
    for backend, module in modules.items():
        xl = x.detach().requires_grad_()
        with hfkern.use_backend(backend):
            out = module(xl)
            grads = torch.autograd.grad(out, [xl, *module.parameters()], torch.ones_like(out))
            module.eval()
            out_eval = module(x)
        results.append((out, grads, out_eval, module.state_dict()))
    (out, grads, ev, sd), (out_t, grads_t, ev_t, sd_t) = results
    torch.testing.assert_close(out, out_t)
    torch.testing.assert_close(ev, ev_t)
    for g, e in zip(grads, grads_t):
        torch.testing.assert_close(g, e, **GRAD_TOL)
    for k in sd_t:
        torch.testing.assert_close(sd[k], sd_t[k])


@pytest.mark.gpu
@pytest.mark.parametrize("layout", ["contiguous", "batch_major", "shared"])
def test_gpu_opcheck_ops_on_triton(layout):
    B, C = 3, 10
    x = make_x(B, (4, C, 5), layout, device=GPU)
    w, b = params(B, C, True, True, device=GPU)
    gy = torch.randn(B, 4, C, 5, device=GPU)
    ops = torch.ops.hfkern
    with hfkern.use_backend("triton"):
        for mode in MODES:
            training, momentum, tracked = mode
            rm, rv, nbt = running(B, C, tracked, device=GPU)
            torch.library.opcheck(ops.array_batch_norm, (x, w, b, rm, rv, nbt, training, momentum, EPS))
        rm, rv, nbt = running(B, C, True, device=GPU)
        _, mean, rstd = ref.array_batch_norm(x, w, b, rm, rv, nbt, True, 0.1, EPS)
        for mask in ([True, True, True], [False, True, False], [True, False, True]):
            torch.library.opcheck(ops.array_batch_norm_backward, (gy, x, w, mean, rstd, True, mask))
