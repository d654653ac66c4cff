"""Op-layer defects, third round.

1. Real and fake layouts of the array conv ops and the batch norm where memory is both
   array memory formats at once (one model, one channel, 1x1 images): the real op's
   strides are exactly its fake's (``new_batch_major`` / ``torch.empty`` for the conv
   ops, eager ``torch.empty_like`` for the batch norm and the weight gradient), so
   ``torch.compile`` with inductor agrees with eager mode on chains of those ops.
2. Embedding ops on empty tables (V = 0) give empty results, as ``torch.nn.Embedding(0, D)``.
3. The Triton and CUDA (emulated) layer norm and RMS norm give NaN statistics for rows of no
   elements, as the torch backend does, not uninitialised memory.
"""

from __future__ import annotations

import itertools
import math

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode

import hfkern  # noqa: F401  (registers the ops)
import hfkern.nn as hnn
from hfkern import _backend
from hfkern._array import array_memory_format, eager_empty_like, to_array_memory_format

ops = torch.ops.hfkern


def _fake_run(fn, *args):
    """``fn(*args)`` under FakeTensorMode (tensors converted with their exact strides)."""
    with FakeTensorMode() as mode:
        return fn(*(mode.from_tensor(a) if isinstance(a, torch.Tensor) else a for a in args))


def _assert_same_layout(real, fake, what):
    assert tuple(real.shape) == tuple(fake.shape), what
    assert real.stride() == fake.stride(), f"{what}: real strides {real.stride()}, fake {fake.stride()}"
    if real.dim() == 5:
        assert array_memory_format(real) == array_memory_format(fake), what


# ---- 1. layouts: the real ops' strides are their fakes' -------------------------------------

def _conv_input(B, N, C, H, W, fmt, shared):
    if shared:
        x = torch.randn(N, C, H, W)
        return x.contiguous(memory_format=torch.channels_last) if fmt == "cl" else x
    x = torch.randn(B, N, C, H, W)
    return to_array_memory_format(x, torch.channels_last if fmt == "cl" else torch.contiguous_format)


@pytest.mark.parametrize("transposed", [False, True])
def test_conv_ops_real_strides_are_the_fakes(transposed):
    """Every ambiguous layout (B = 1, C = 1, 1x1 images, N = 1) of the three conv ops, the CPU's
    1x1 matmul path (k = 1, contiguous) included: the real op's strides equal the fake's
    in every dim, so array_memory_format reads the same."""
    for B, N, C_in, C_out, H, W, fmt, shared, k in itertools.product(
            (1, 2), (1, 2), (1, 2), (1, 3), (1, 3), (1, 4), ("contiguous", "cl"), (False, True), (1, 3)):
        x = _conv_input(B, N, C_in, H, W, fmt, shared)
        w = torch.randn(B, C_in, C_out, k, k) if transposed else torch.randn(B, C_out, C_in, k, k)
        args = ([1, 1], [k // 2, k // 2], [1, 1], transposed, [0, 0], 1)
        case = f"B={B} N={N} C_in={C_in} C_out={C_out} {H}x{W} {fmt} shared={shared} k={k}"
        y = ops.array_conv(x, w, None, *args)
        _assert_same_layout(y, _fake_run(lambda *a: ops.array_conv(*a, None, *args), x, w), f"array_conv {case}")
        gy = torch.randn_like(y)
        gx = ops.array_conv_input_grad(gy, w, list(x.shape), *args)
        gx_fake = _fake_run(lambda g, ww: ops.array_conv_input_grad(g, ww, list(x.shape), *args), gy, w)
        _assert_same_layout(gx, gx_fake, f"array_conv_input_grad {case}")
        gw = ops.array_conv_weight_grad(gy, x, w, *args)
        _assert_same_layout(gw, _fake_run(lambda *a: ops.array_conv_weight_grad(*a, *args), gy, x, w),
                            f"array_conv_weight_grad {case}")


def test_conv_one_channel_channels_last_stays_channels_last():
    """The defect's case: B = 1 and C_out = 1 in channels-last memory. The output is
    channels-last (as the fake says), and so is the next conv's."""
    x = to_array_memory_format(torch.randn(1, 2, 2, 5, 5), torch.channels_last)
    args = ([1, 1], [1, 1], [1, 1], False, [0, 0], 1)
    y = ops.array_conv(x, torch.randn(1, 1, 2, 3, 3), None, *args)
    assert y.stride() == (1, 25, 1, 5, 1) and array_memory_format(y) == torch.channels_last
    z = ops.array_conv(y, torch.randn(1, 4, 1, 3, 3), None, *args)
    assert z.stride() == (4, 100, 1, 20, 4) and array_memory_format(z) == torch.channels_last
    # an input gradient of a one-channel input [3, 1, 1, 1, 1] in channels-last memory
    gy = to_array_memory_format(torch.randn(3, 1, 2, 1, 1), torch.channels_last)
    w = torch.randn(3, 2, 1, 1, 1)
    gx = ops.array_conv_input_grad(gy, w, [3, 1, 1, 1, 1], [1, 1], [0, 0], [1, 1], False, [0, 0], 1)
    assert gx.stride() == (1, 3, 1, 3, 3) and array_memory_format(gx) == torch.channels_last


def test_conv_weight_grad_keeps_size_one_strides_of_the_weight():
    """``torch.empty_like(weight)``'s layout, as eager torch gives it, also in the fake (whose own
    empty_like re-derives the strides of dims of size one)."""
    w = torch.randn(4, 2, 1, 1, 1).permute(2, 0, 1, 3, 4)  # [1, 4, 2, 1, 1], strides (1, 2, 1, 1, 1)
    x = torch.randn(1, 2, 2, 5, 5)
    args = ([1, 1], [0, 0], [1, 1], False, [0, 0], 1)
    gy = ops.array_conv(x, w, None, *args)
    gw = ops.array_conv_weight_grad(gy, x, w, *args)
    assert gw.stride() == torch.empty_like(w).stride() == w.stride()
    assert _fake_run(lambda *a: ops.array_conv_weight_grad(*a, *args), gy, x, w).stride() == w.stride()


def test_conv_input_grad_of_shared_input_with_empty_output():
    """A shared input whose output plane is empty: zeros in the fake's layout (this raised a
    TypeError: torch.zeros takes no memory_format)."""
    x = torch.randn(2, 3, 2, 2).contiguous(memory_format=torch.channels_last)
    w = torch.randn(2, 4, 3, 3, 3)
    args = ([1, 1], [0, 0], [1, 1], False, [0, 0], 1)
    gy = torch.randn(2, 2, 4, 0, 0)
    gx = ops.array_conv_input_grad(gy, w, list(x.shape), *args)
    assert torch.equal(gx, torch.zeros(x.shape))
    _assert_same_layout(gx, _fake_run(lambda g, ww: ops.array_conv_input_grad(g, ww, list(x.shape), *args), gy, w),
                        "shared input, empty output")


def _bn_inputs():
    """Batch-norm inputs whose layout is ambiguous, or not dense."""
    cl = torch.channels_last
    yield "B1 1x1 channels-last", to_array_memory_format(torch.randn(1, 2, 4, 1, 1), cl)
    yield "B2 1x1 channels-last", to_array_memory_format(torch.randn(2, 2, 4, 1, 1), cl)
    yield "B1 C1 channels-last", to_array_memory_format(torch.randn(1, 3, 1, 2, 2), cl)
    yield "B1 N1 channels-last", to_array_memory_format(torch.randn(1, 1, 3, 1, 4), cl)
    yield "size-one dims with odd strides", torch.randn(4, 2, 1, 1, 1).permute(2, 1, 0, 3, 4)
    yield "strided", torch.randn(2, 3, 4, 1, 6)[..., ::2]
    yield "shared", torch.randn(3, 4, 1, 2).expand(2, 3, 4, 1, 2)
    yield "3-D [N, B, C] memory", torch.randn(3, 1, 4).transpose(0, 1)


@pytest.mark.parametrize("training", [True, False])
def test_batch_norm_real_strides_are_the_fakes(training):
    for name, x in _bn_inputs():
        B, C = x.shape[0], x.shape[2]
        w, b = torch.randn(B, C), torch.randn(B, C)
        rm, rv = torch.zeros(B, C), torch.ones(B, C)
        args = (None, None, None) if training else (rm, rv, None)
        y, mean, rstd = ops.array_batch_norm(x, w, b, *args, training, 0.1, 1e-5)
        assert y.stride() == torch.empty_like(x).stride(), name
        y_fake = _fake_run(lambda xx, ww, bb, *a: ops.array_batch_norm(xx, ww, bb, *a, training, 0.1, 1e-5)[0],
                           x, w, b, *args)
        _assert_same_layout(y, y_fake, f"array_batch_norm {name}")
        gy = torch.randn_like(y)
        gx = ops.array_batch_norm_backward(gy, x, w, mean, rstd, training, [True, True, True])[0]
        gx_fake = _fake_run(
            lambda *a: ops.array_batch_norm_backward(*a, training, [True, True, True])[0], gy, x, w, mean, rstd)
        _assert_same_layout(gx, gx_fake, f"array_batch_norm_backward {name}")


def test_eager_empty_like_is_eager_torchs():
    """The fakes' empty_like: eager torch's strides for dense and non-dense tensors, dims of size
    one included, also under FakeTensorMode."""
    gen = torch.Generator().manual_seed(0)

    def pick(options):
        return options[int(torch.randint(len(options), (1,), generator=gen))]

    for _ in range(400):
        nd = pick([1, 2, 3, 4, 5])
        shape = [pick([0, 1, 1, 2, 3]) for _ in range(nd)]
        order = torch.randperm(nd, generator=gen).tolist()
        strides, step = [0] * nd, 1
        for d in order:
            strides[d] = step
            step *= max(shape[d], 1) * pick([1, 1, 2])
        strides = [pick([0, 1, 5]) if n == 1 and pick([0, 1]) else s for n, s in zip(shape, strides)]
        strides = [0 if pick([0, 0, 0, 1]) else s for s in strides]
        x = torch.empty_strided(shape, strides)
        expected = torch.empty_like(x).stride()
        assert eager_empty_like(x).stride() == expected, (shape, strides)
        assert _fake_run(eager_empty_like, x).stride() == expected, (shape, strides)


# inductor on the CPU compiles C++: a few seconds a graph, so a few small graphs
_CONV_ARGS = ([1, 1], [1, 1], [1, 1], False, [0, 0], 1)


def _conv_chain(x, w1, w2):
    y = ops.array_conv(x, w1, None, *_CONV_ARGS)
    return ops.array_conv(y, w2, None, *_CONV_ARGS) * 2 + 1


def _input_grad_then_conv(gy, w1, w2):
    gx = ops.array_conv_input_grad(gy, w1, [1, 2, 1, 3, 4], *_CONV_ARGS)
    return ops.array_conv(gx, w2, None, *_CONV_ARGS) * 2 + 1


def _bn_then_conv(x, w1, w2):
    y = ops.array_batch_norm(x, None, None, None, None, None, True, 0.1, 1e-5)[0]
    return y, ops.array_conv(y, w2, None, *_CONV_ARGS) * 2 + 1  # 1x1 kernel, padding 1: a 3x3 output


_CL = torch.channels_last
_COMPILED = {
    # B = 1, C_out = 1 in channels-last memory, then a conv of it
    "conv_chain": (_conv_chain, lambda: (to_array_memory_format(torch.randn(1, 2, 2, 5, 5), _CL),
                                         torch.randn(1, 1, 2, 3, 3), torch.randn(1, 4, 1, 3, 3))),
    # a shared channels-last input at B = 1, C_out = 1
    "shared_conv_chain": (_conv_chain, lambda: (torch.randn(2, 2, 5, 5).contiguous(memory_format=_CL),
                                                torch.randn(1, 1, 2, 3, 3), torch.randn(1, 4, 1, 3, 3))),
    # the input gradient of a one-channel input at B = 1
    "input_grad_then_conv": (_input_grad_then_conv, lambda: (
        to_array_memory_format(torch.randn(1, 2, 3, 3, 4), _CL), torch.randn(1, 3, 1, 3, 3),
        torch.randn(1, 4, 1, 3, 3))),
    # a batch norm of 1x1 images at B = 1 in channels-last memory, then a conv that grows them
    "bn_then_conv": (_bn_then_conv, lambda: (to_array_memory_format(torch.randn(1, 2, 4, 1, 1), _CL), None,
                                             torch.randn(1, 3, 4, 1, 1))),
}


@pytest.mark.parametrize("case", list(_COMPILED))
def test_inductor_agrees_with_eager_on_ambiguous_layouts(case):
    from torch._functorch import config as functorch_config
    from torch._inductor import config as inductor_config

    fn, make = _COMPILED[case]
    args = make()
    expected = fn(*args)
    torch._dynamo.reset()
    # Compiled anew: the caches of compiled graphs do not key on the ops' fake implementations.
    with inductor_config.patch(fx_graph_cache=False), functorch_config.patch(enable_autograd_cache=False):
        got = torch.compile(fn, backend="inductor", fullgraph=True)(*args)
    torch.testing.assert_close(got, expected)
    for g, e in zip(got if isinstance(got, tuple) else (got,), expected if isinstance(expected, tuple) else (expected,)):
        assert array_memory_format(g) == array_memory_format(e)


# ---- 2. embeddings of empty tables ------------------------------------------------------------

def test_embedding_ops_on_empty_tables():
    w = torch.randn(2, 0, 3)
    idx = torch.zeros(2, 0, dtype=torch.long)
    y = ops.array_embedding(w, idx)
    assert y.shape == (2, 0, 3)
    _assert_same_layout(y, _fake_run(ops.array_embedding, w, idx), "array_embedding V=0")
    for sgbf in (False, True):
        g = ops.array_embedding_backward(torch.randn(2, 0, 3), idx, 0, -1, sgbf)
        assert g.shape == (2, 0, 3)
        _assert_same_layout(g, _fake_run(lambda gg, ii: ops.array_embedding_backward(gg, ii, 0, -1, sgbf),
                                         torch.randn(2, 0, 3), idx), "array_embedding_backward V=0")
    ops.array_embedding_renorm_(w, idx, 1.0, 2.0)
    # int32 indices of any rank, and a shared (expanded) index tensor
    assert ops.array_embedding(w, torch.zeros(2, 4, 0, dtype=torch.int32)).shape == (2, 4, 0, 3)
    assert ops.array_embedding(w, torch.zeros(0, dtype=torch.long).expand(2, 0)).shape == (2, 0, 3)


@pytest.mark.parametrize("kwargs", [{}, {"max_norm": 1.0}, {"scale_grad_by_freq": True}, {"sparse": True}])
def test_nn_embedding_of_an_empty_table(kwargs):
    """As torch.nn.Embedding(0, 3) on empty indices: an empty output, an empty gradient."""
    m = hnn.Embedding(0, 3, B=2, **kwargs)
    ref = torch.nn.Embedding(0, 3, **kwargs)
    idx = torch.zeros(2, 0, dtype=torch.long)
    y = m(idx)
    assert y.shape == (2, 0, 3) and ref(idx[0]).shape == (0, 3)
    y.sum().backward()
    assert m.weight.grad.shape == (2, 0, 3)


def test_embedding_double_backward_of_an_empty_table():
    from hfkern.ops.embedding import embedding

    w = torch.randn(2, 0, 3, requires_grad=True)
    y = embedding(w, torch.zeros(2, 5, 0, dtype=torch.long), scale_grad_by_freq=True)
    (g,) = torch.autograd.grad(y.sum(), w, create_graph=True)
    assert g.shape == (2, 0, 3)


# ---- 3. norm statistics of rows of no elements ------------------------------------------------

_NORM_EMPTY = [(2, 3, 0), (1, 4, 2, 0)]


def _check_empty_norm_stats(ln, rms):
    torch_ln = _backend._registry["array_layer_norm"]["torch"].load()
    torch_rms = _backend._registry["array_rms_norm"]["torch"].load()
    for shape in _NORM_EMPTY:
        for norm_ndim in (1, 2):
            x = torch.randn(shape)
            S = shape[len(shape) - norm_ndim:]
            w, b = torch.randn(shape[0], *S), torch.randn(shape[0], *S)
            ref = torch_ln(x, w, b, norm_ndim, 1e-5)
            y, mean, rstd = ln(x, w, b, norm_ndim, 1e-5)
            assert y.shape == x.shape
            for got, want in ((mean, ref[1]), (rstd, ref[2])):
                assert got.shape == want.shape and got.dtype == torch.float32
                assert torch.isnan(got).all() and torch.isnan(want).all()
            ref_rms = torch_rms(x, w, norm_ndim, 1e-5)
            y, rstd = rms(x, w, norm_ndim, 1e-5)
            assert y.shape == x.shape and rstd.shape == ref_rms[1].shape
            assert torch.isnan(rstd).all() and torch.isnan(ref_rms[1]).all()
    # no rows: empty statistics
    y, mean, rstd = ln(torch.randn(2, 0, 4), None, None, 1, 1e-5)
    assert mean.shape == rstd.shape == (2, 0)


@pytest.mark.interpreter
@pytest.mark.filterwarnings("ignore:var_mean")
def test_triton_norm_statistics_of_empty_rows_are_nan():
    pytest.importorskip("triton")
    from hfkern.triton import layer_norm as tln

    _check_empty_norm_stats(tln.array_layer_norm, tln.array_rms_norm)


@pytest.mark.emulator
@pytest.mark.filterwarnings("ignore:var_mean")
def test_emulated_cuda_norm_statistics_of_empty_rows_are_nan():
    from hfkern.cuda import layer_norm as cln

    _check_empty_norm_stats(cln.emulated("array_layer_norm"), cln.emulated("array_rms_norm"))


def test_nan_is_what_torch_gives_rows_of_no_elements():
    """The reference: torch's own layer norm of rows of no elements has NaN rstd."""
    assert math.isnan(torch.native_layer_norm(torch.randn(3, 0), [0], None, None, 1e-5)[2][0, 0].item())
