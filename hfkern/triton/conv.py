"""Array convolution as implicit GEMMs with the array dimension on the grid.

Two kernels serve conv1d/conv2d and their transposed forms, forward and
backward (1-D runs as 2-D with a height of 1):

``_conv_gemm_kernel``
    ``out[n, o, p] = sum_{i, k} in[n, i, p*s - pad + k*d] * w[o, i, k]``: the
    forward of a convolution and the input gradient of a transposed one; with
    ``TRANSPOSED``,
    ``out[n, o, p] = sum_{i, k: p + pad - k*d = q*s} in[n, i, q] * w[i, o, k]``:
    the forward of a transposed convolution and the input gradient of a plain one.
``_conv_wgrad_kernel``
    ``dw[a, c, k] = sum_{n, q} g[n, a, q] * in[n, c, q*s - pad + k*d]``: the
    weight gradient of both (for a transposed conv, ``g`` is its input and
    ``in`` its output gradient), split over the reduction for parallelism with
    per-split fp32 partials summed in a fixed order (deterministic, no atomics).

Each is one GEMM per (model, group) on ``program_id(2)``: rows are
output pixels ``(n, oh, ow)``, columns output channels, the reduction runs over
``(input channel, kh, kw)``. Tensors are addressed through their strides, so the
``[N, B, C, H, W]`` memory behind the array conv's ``[B, N, C, H, W]`` views is
read and written in place, and a shared input is a model stride of 0. Outputs
keep the op contract's memory format (channels-last ``[N, H, W, B, C]`` for a
channels-last input): the kernels only see other strides. Their tiles are
tuned for ``[N, B, C, H, W]`` memory; channels-last arrays run them only on an
explicit request (``auto`` keeps convs on cuDNN). A shared
input with one group per model folds the B weights into one GEMM (B*C_out
columns) in the forward and one reduction over B*C_out in the input gradient.

Accumulation is fp32. fp32 inputs use TF32 tensor cores only when
``torch.backends.cudnn.allow_tf32`` allows it, as cuDNN does for torch's convs.

The launchers take exactly the arguments of the ops in :mod:`hfkern.ops.conv`
(which states the op contract; its torch implementations are the oracle),
check them as the ops do, since benchmarks call them directly, and register
themselves as the ``triton`` implementations.
"""

from __future__ import annotations

from typing import Sequence

import torch
import triton
import triton.language as tl

from .. import _backend
from .._array import array_memory_format, check_conv_args, conv_output_size, like_weight, new_batch_major
from .._device import sm_count
from ._common import Tuned, interpreting

_FWD, _DGRAD, _WGRAD = "array_conv", "array_conv_input_grad", "array_conv_weight_grad"


def _configs(m_n_k: Sequence[tuple[int, int, int, int, int]]) -> list[triton.Config]:
    return [
        triton.Config({"BLOCK_M": m, "BLOCK_N": n, "BLOCK_K": k}, num_warps=w, num_stages=s)
        for m, n, k, w, s in m_n_k
    ]


# Hopper-oriented tiles that also fit Ampere's shared memory (<= 4 stages of 128x128x32 fp32).
_GEMM_CONFIGS = _configs([
    (128, 128, 32, 8, 3),
    (128, 64, 32, 4, 4),
    (64, 128, 32, 4, 4),
    (64, 64, 32, 4, 4),
    (128, 32, 32, 4, 4),
    (64, 32, 64, 4, 3),
    (32, 64, 64, 4, 3),
    (32, 32, 64, 2, 3),
])
_INTERPRET_CONFIG = triton.Config({"BLOCK_M": 16, "BLOCK_N": 16, "BLOCK_K": 16})


@triton.jit
def _conv_gemm_kernel(
    x_ptr,  # [B, N, C_in, H, W]   (model stride 0: one input shared by all models)
    w_ptr,  # plain: [B, C_out, C_in/G, KH, KW]; TRANSPOSED: [B, C_in, C_out/G, KH, KW]
    bias_ptr,  # [B, C_out] (unused unless HAS_BIAS)
    y_ptr,  # [B, N, C_out, OH, OW]
    N, H, W, OH, OW, C_IN_G, C_OUT_G, G,
    sxb, sxn, sxc, sxh, sxw,
    swb, sw1, sw2, swh, sww,  # weight strides: model, dim 1, dim 2, kh, kw
    sbb, sbc,
    syb, syn, syc, syh, syw,
    STRIDE_H: tl.constexpr, STRIDE_W: tl.constexpr, PAD_H: tl.constexpr, PAD_W: tl.constexpr,
    DIL_H: tl.constexpr, DIL_W: tl.constexpr, KH: tl.constexpr, KW: tl.constexpr,
    TRANSPOSED: tl.constexpr, PHASED: tl.constexpr, HAS_BIAS: tl.constexpr,
    PRECISION: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):
    # One (model, group) GEMM: rows are output pixels (n, oh, ow), columns output
    # channels of the group, the reduction runs over (input channel, kh, kw).
    #
    # PHASED (transposed, dilation 1, stride > 1): only the taps kh = kh0 (mod
    # STRIDE) reach an output row of phase oh % STRIDE, so each program takes the
    # pixels of one phase and reduces over just those taps instead of masking
    # the other (STRIDE_H*STRIDE_W - 1)/(STRIDE_H*STRIDE_W) of the reduction.
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    pid_bg = tl.program_id(2)
    b = (pid_bg // G).to(tl.int64)
    g = (pid_bg % G).to(tl.int64)

    if PHASED:
        tiles = tl.cdiv(N * tl.cdiv(OH, STRIDE_H) * tl.cdiv(OW, STRIDE_W), BLOCK_M)
        phase = pid_m // tiles
        rh = phase // STRIDE_W
        rw = phase % STRIDE_W
        OHP = tl.cdiv(OH - rh, STRIDE_H)
        OWP = tl.cdiv(OW - rw, STRIDE_W)
        offs_m = (pid_m % tiles) * BLOCK_M + tl.arange(0, BLOCK_M)
        m_ok = offs_m < N * OHP * OWP
        n = offs_m // tl.maximum(OHP * OWP, 1)
        rem = offs_m % tl.maximum(OHP * OWP, 1)
        oh = rh + (rem // tl.maximum(OWP, 1)) * STRIDE_H
        ow = rw + (rem % tl.maximum(OWP, 1)) * STRIDE_W
        kh0 = (rh + PAD_H) % STRIDE_H
        kw0 = (rw + PAD_W) % STRIDE_W
        KHP = tl.cdiv(KH - kh0, STRIDE_H)
        KWP = tl.cdiv(KW - kw0, STRIDE_W)
    else:
        offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        m_ok = offs_m < N * OH * OW
        n = offs_m // (OH * OW)
        rem = offs_m % (OH * OW)
        oh = rem // OW
        ow = rem % OW
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = offs_n < C_OUT_G

    x_rows = x_ptr + b * sxb + g * C_IN_G * sxc + n.to(tl.int64)[:, None] * sxn
    if TRANSPOSED:  # weight dim 1 = input channels (global), dim 2 = output channels of the group
        w_cols = w_ptr + b * swb + g * C_IN_G * sw1 + offs_n.to(tl.int64)[None, :] * sw2
        sw_in = sw1
    else:  # weight dim 1 = output channels (global), dim 2 = input channels of the group
        w_cols = w_ptr + b * swb + (g * C_OUT_G + offs_n).to(tl.int64)[None, :] * sw1
        sw_in = sw2

    if PHASED:
        K = C_IN_G * KHP * KWP
    else:
        K = C_IN_G * KH * KW
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        k_ok = offs_k < K
        if PHASED:
            ci = offs_k // tl.maximum(KHP * KWP, 1)
            kr = offs_k % tl.maximum(KHP * KWP, 1)
            kh = kh0 + (kr // tl.maximum(KWP, 1)) * STRIDE_H
            kw = kw0 + (kr % tl.maximum(KWP, 1)) * STRIDE_W
        else:
            ci = offs_k // (KH * KW)
            kr = offs_k % (KH * KW)
            kh = kr // KW
            kw = kr % KW
        if PHASED:
            # oh + PAD - kh is an exact multiple of the stride for these taps.
            ih = (oh[:, None] + PAD_H - kh[None, :]) // STRIDE_H
            iw = (ow[:, None] + PAD_W - kw[None, :]) // STRIDE_W
            in_ok = (oh[:, None] + PAD_H - kh[None, :] >= 0) & (ow[:, None] + PAD_W - kw[None, :] >= 0)
            in_ok = in_ok & (ih < H) & (iw < W)
        elif TRANSPOSED:
            # Output row oh receives input row q where q*STRIDE - PAD + kh*DIL == oh.
            th = oh[:, None] + PAD_H - kh[None, :] * DIL_H
            tw = ow[:, None] + PAD_W - kw[None, :] * DIL_W
            # th, tw < 0 are masked; clamp first so // and % never see negatives.
            thc = tl.maximum(th, 0)
            twc = tl.maximum(tw, 0)
            ih = thc // STRIDE_H
            iw = twc // STRIDE_W
            in_ok = ((th >= 0) & (tw >= 0) & (thc % STRIDE_H == 0) & (twc % STRIDE_W == 0)
                     & (ih < H) & (iw < W))
        else:
            ih = oh[:, None] * STRIDE_H - PAD_H + kh[None, :] * DIL_H
            iw = ow[:, None] * STRIDE_W - PAD_W + kw[None, :] * DIL_W
            in_ok = (ih >= 0) & (ih < H) & (iw >= 0) & (iw < W)
        a = tl.load(
            x_rows + ci.to(tl.int64)[None, :] * sxc + ih.to(tl.int64) * sxh + iw.to(tl.int64) * sxw,
            mask=m_ok[:, None] & k_ok[None, :] & in_ok, other=0.0,
        )
        w = tl.load(
            w_cols + ci.to(tl.int64)[:, None] * sw_in + kh[:, None] * swh + kw[:, None] * sww,
            mask=k_ok[:, None] & n_ok[None, :], other=0.0,
        )
        acc += tl.dot(a, w, input_precision=PRECISION)

    if HAS_BIAS:
        bias = tl.load(bias_ptr + b * sbb + (g * C_OUT_G + offs_n) * sbc, mask=n_ok, other=0.0)
        acc += bias.to(tl.float32)[None, :]
    y = (y_ptr + b * syb + n.to(tl.int64)[:, None] * syn
         + (g * C_OUT_G + offs_n).to(tl.int64)[None, :] * syc
         + oh.to(tl.int64)[:, None] * syh + ow.to(tl.int64)[:, None] * syw)
    tl.store(y, acc.to(y_ptr.dtype.element_ty), mask=m_ok[:, None] & n_ok[None, :])


@triton.jit
def _conv_wgrad_kernel(
    g_ptr,  # [B, N, A, OH, OW]: output-side operand (dy of a conv; x of a transposed conv)
    x_ptr,  # [B, N, C, H, W]: window-side operand (x of a conv; dy of a transposed conv)
    dw_ptr,  # [SPLIT, B, G, A/G, C/G*KH*KW] fp32 partial sums, contiguous
    N, H, W, OH, OW, A_G, C_G, G, CHUNK,
    sgb, sgn, sgc, sgh, sgw,
    sxb, sxn, sxc, sxh, sxw,
    STRIDE_H: tl.constexpr, STRIDE_W: tl.constexpr, PAD_H: tl.constexpr, PAD_W: tl.constexpr,
    DIL_H: tl.constexpr, DIL_W: tl.constexpr, KH: tl.constexpr, KW: tl.constexpr,
    PRECISION: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):
    # GEMM rows: a (A/G), columns: (c, kh, kw), reduction: output pixels (n, oh, ow)
    # restricted to this program's CHUNK of them.
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    pid_z = tl.program_id(2)
    BG = tl.num_programs(2) // tl.cdiv(N * OH * OW, CHUNK)
    split = pid_z // BG
    bg = pid_z % BG
    b = (bg // G).to(tl.int64)
    g = (bg % G).to(tl.int64)

    offs_a = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_c = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    CK = C_G * KH * KW
    a_ok = offs_a < A_G
    c_ok = offs_c < CK
    ci = offs_c // (KH * KW)
    kr = offs_c % (KH * KW)
    kh = kr // KW
    kw = kr % KW

    g_rows = g_ptr + b * sgb + (g * A_G + offs_a).to(tl.int64)[:, None] * sgc
    x_cols = x_ptr + b * sxb + (g * C_G + ci).to(tl.int64)[None, :] * sxc

    P = N * OH * OW
    p_start = split * CHUNK
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for p0 in range(0, CHUNK, BLOCK_K):
        offs_p = p_start + p0 + tl.arange(0, BLOCK_K)
        p_ok = (offs_p < P) & (p0 + tl.arange(0, BLOCK_K) < CHUNK)
        n = offs_p // (OH * OW)
        rem = offs_p % (OH * OW)
        oh = rem // OW
        ow = rem % OW
        gt = tl.load(
            g_rows + n.to(tl.int64)[None, :] * sgn + oh.to(tl.int64)[None, :] * sgh
            + ow.to(tl.int64)[None, :] * sgw,
            mask=a_ok[:, None] & p_ok[None, :], other=0.0,
        )
        ih = oh[:, None] * STRIDE_H - PAD_H + kh[None, :] * DIL_H
        iw = ow[:, None] * STRIDE_W - PAD_W + kw[None, :] * DIL_W
        x_ok = p_ok[:, None] & c_ok[None, :] & (ih >= 0) & (ih < H) & (iw >= 0) & (iw < W)
        xt = tl.load(
            x_cols + n.to(tl.int64)[:, None] * sxn + ih.to(tl.int64) * sxh + iw.to(tl.int64) * sxw,
            mask=x_ok, other=0.0,
        )
        acc += tl.dot(gt, xt, input_precision=PRECISION)

    out = (dw_ptr + ((split * BG + bg) * A_G).to(tl.int64) * CK
           + offs_a.to(tl.int64)[:, None] * CK + offs_c[None, :])
    tl.store(out, acc, mask=a_ok[:, None] & c_ok[None, :])


_gemm = Tuned(_conv_gemm_kernel, _GEMM_CONFIGS,
              ["N", "OH", "OW", "C_IN_G", "C_OUT_G", "KH", "KW", "TRANSPOSED", "PHASED"],
              interpret_config=_INTERPRET_CONFIG)
_wgrad = Tuned(_conv_wgrad_kernel, _GEMM_CONFIGS, ["A_G", "C_G", "CHUNK", "OH", "OW"],
               interpret_config=_INTERPRET_CONFIG)


# ---- launchers -----------------------------------------------------------------

# Registered for CUDA tensors; auto=False: auto picks them only once a GPU
# benchmark shows them faster than the torch path.
def _implements(op: str):
    return _backend.implements(op, "triton", device_types=("cuda",), auto=False)


def _precision(dtype: torch.dtype) -> str:
    if dtype == torch.float32 and not torch.backends.cudnn.allow_tf32:
        return "ieee"
    return "tf32" if dtype == torch.float32 else "ieee"


def _as_2d(t: torch.Tensor, nd: int) -> torch.Tensor:
    """1-D convs run as 2-D with height 1."""
    return t.unsqueeze(-2) if nd == 1 else t


def _strides5(t: torch.Tensor, shared: bool) -> tuple[int, int, int, int, int]:
    """(model, batch, channel, h, w) strides of an activation; model stride 0 if shared."""
    if shared:
        return (0, *t.stride())
    return tuple(t.stride())


def _geometry(stride, padding, dilation, nd):
    if nd == 1:
        return (1, stride[0]), (0, padding[0]), (1, dilation[0])
    return tuple(stride), tuple(padding), tuple(dilation)


def _weight_strides(w: torch.Tensor) -> tuple[int, ...]:
    """(model, dim1, dim2, kh, kw) strides of a [B, *, *, (KH,) KW] weight."""
    s = w.stride()
    return (*s[:3], 0, s[3]) if w.dim() == 4 else tuple(s)


def _kernel_hw(w: torch.Tensor) -> tuple[int, int]:
    return (1, w.shape[-1]) if w.dim() == 4 else (w.shape[-2], w.shape[-1])


def _launch_gemm(transposed, x, x_strides, w, w_strides, bias, y, y_strides, sizes, geom, n_models,
                 groups, dtype):
    N, H, W, OH, OW, c_in_g, c_out_g = sizes
    (sh, sw), (ph, pw), (dh, dw) = geom
    kh, kw = _kernel_hw(w)
    has_bias = bias is not None
    bias_arg = bias if has_bias else y
    b_strides = bias.stride() if has_bias else (0, 0)

    phased = transposed and (sh, sw) != (1, 1) and (dh, dw) == (1, 1)

    def grid(meta):
        if phased:
            per_phase = N * triton.cdiv(OH, sh) * triton.cdiv(OW, sw)
            rows = sh * sw * triton.cdiv(per_phase, meta["BLOCK_M"])
        else:
            rows = triton.cdiv(N * OH * OW, meta["BLOCK_M"])
        return (rows, triton.cdiv(c_out_g, meta["BLOCK_N"]), n_models * groups)

    _gemm[grid](
        x, w, bias_arg, y,
        N, H, W, OH, OW, c_in_g, c_out_g, groups,
        *x_strides, *w_strides, *b_strides, *y_strides,
        sh, sw, ph, pw, dh, dw, kh, kw, transposed, phased, has_bias, _precision(dtype),
    )


@_implements(_FWD)
def array_conv(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    stride: Sequence[int],
    padding: Sequence[int],
    dilation: Sequence[int],
    transposed: bool,
    output_padding: Sequence[int],
    groups: int,
) -> torch.Tensor:
    """The Triton implementation of ``hfkern::array_conv`` (see hfkern/ops/conv.py)."""
    check_conv_args(f"{_FWD} (triton)", x.dim(), weight, stride, padding, dilation, output_padding,
                    groups, transposed=transposed, x=x, bias=bias)
    nd = len(stride)
    B = weight.shape[0]
    shared = x.dim() == weight.dim() - 1
    N, C_in = (x.shape[0], x.shape[1]) if shared else (x.shape[1], x.shape[2])
    C_out = weight.shape[2] * groups if transposed else weight.shape[1]
    geom = _geometry(stride, padding, dilation, nd)
    x2 = _as_2d(x, nd)
    H, W = x2.shape[-2:]
    out_spatial = conv_output_size(x.shape[-nd:], weight.shape[-nd:], stride, padding, dilation,
                                   transposed, output_padding)
    y = new_batch_major(x, (B, N, C_out, *out_spatial), array_memory_format(x, shared=shared))
    y2 = _as_2d(y, nd)
    OH, OW = y2.shape[-2:]
    y_strides = tuple(y2.stride())
    c_in_g, c_out_g = C_in // groups, C_out // groups
    sizes = (N, H, W, OH, OW, c_in_g, c_out_g)
    if not transposed and shared and groups == 1 and _mergeable(weight, bias, y2, C_out):
        # One dense GEMM for all B models: their weights are B*C_out columns.
        ws = _weight_strides(weight)
        _launch_gemm(
            False, x2, _strides5(x2, True), weight, (0, ws[1], ws[2], ws[3], ws[4]),
            None if bias is None else bias.reshape(1, B * C_out),
            y2, (0, y_strides[1], y_strides[2], y_strides[3], y_strides[4]),
            (N, H, W, OH, OW, C_in, B * C_out), geom, 1, 1, x.dtype,
        )
        return y
    _launch_gemm(transposed, x2, _strides5(x2, shared), weight, _weight_strides(weight), bias,
                 y2, y_strides, sizes, geom, B, groups, x.dtype)
    return y


def _mergeable(weight, bias, y2, C_out) -> bool:
    """True if (model, out channel) of weight, bias and y2 form one channel axis."""
    ok = weight.stride(0) == C_out * weight.stride(1) and y2.stride(0) == C_out * y2.stride(2)
    return ok and (bias is None or bias.stride(0) == C_out * bias.stride(1))


@_implements(_DGRAD)
def array_conv_input_grad(
    grad_out: torch.Tensor,
    weight: torch.Tensor,
    input_size: Sequence[int],
    stride: Sequence[int],
    padding: Sequence[int],
    dilation: Sequence[int],
    transposed: bool,
    output_padding: Sequence[int],
    groups: int,
) -> torch.Tensor:
    """The Triton implementation of ``hfkern::array_conv_input_grad``."""
    check_conv_args(f"{_DGRAD} (triton)", len(input_size), weight, stride, padding, dilation,
                    output_padding, groups, grad_out=grad_out, transposed=transposed, input_size=input_size)
    nd = len(stride)
    B = weight.shape[0]
    shared = len(input_size) == weight.dim() - 1
    geom = _geometry(stride, padding, dilation, nd)
    gy2 = _as_2d(grad_out, nd)
    _, N, C_out, OH, OW = gy2.shape
    fmt = array_memory_format(grad_out)
    if shared:
        gx = torch.empty(input_size, dtype=grad_out.dtype, device=grad_out.device, memory_format=fmt)
        C_in = input_size[1]
    else:
        gx = new_batch_major(grad_out, input_size, fmt)
        C_in = input_size[2]
    gx2 = _as_2d(gx, nd)
    H, W = gx2.shape[-2:]
    c_in_g, c_out_g = C_in // groups, C_out // groups
    # The input gradient of a conv is a transposed conv of grad_out and vice
    # versa: here the kernel's "in" channels are grad_out's and its "out"
    # channels the input's. A plain GEMM reads its weight as (model, out, in/G)
    # and a transposed one as (model, in, out/G): a transposed conv's
    # [B, C_in, C_out/G] and a conv's [B, C_out, C_in/G] weight are exactly
    # that, strides unchanged.
    adjoint = not transposed
    w_strides = _weight_strides(weight)
    sizes = (N, OH, OW, H, W, c_out_g, c_in_g)
    if shared:
        gy_merged = gy2.stride(0) == C_out * gy2.stride(2)
        w_merged = weight.stride(0) == weight.shape[1] * weight.stride(1)
        if groups == 1 and not transposed and gy_merged and w_merged:
            # One reduction over all B*C_out channels sums the models' gradients.
            gs = gy2.stride()
            _launch_gemm(adjoint, gy2, (0, gs[1], gs[2], gs[3], gs[4]), weight,
                         (0, w_strides[1], w_strides[2], w_strides[3], w_strides[4]), None,
                         gx2, (0, *gx2.stride()), (N, OH, OW, H, W, B * C_out, C_in),
                         geom, 1, 1, grad_out.dtype)
            return gx
        per_model = new_batch_major(grad_out, (B, N, *input_size[1:]), fmt)
        pm2 = _as_2d(per_model, nd)
        _launch_gemm(adjoint, gy2, tuple(gy2.stride()), weight, w_strides, None,
                     pm2, tuple(pm2.stride()), sizes, geom, B, groups, grad_out.dtype)
        return per_model.sum(0).contiguous(memory_format=fmt)  # fixed-order reduction over the models
    _launch_gemm(adjoint, gy2, tuple(gy2.stride()), weight, w_strides, None,
                 gx2, tuple(gx2.stride()), sizes, geom, B, groups, grad_out.dtype)
    return gx


@_implements(_WGRAD)
def array_conv_weight_grad(
    grad_out: torch.Tensor,
    x: torch.Tensor,
    weight: torch.Tensor,
    stride: Sequence[int],
    padding: Sequence[int],
    dilation: Sequence[int],
    transposed: bool,
    output_padding: Sequence[int],
    groups: int,
) -> torch.Tensor:
    """The Triton implementation of ``hfkern::array_conv_weight_grad``."""
    check_conv_args(f"{_WGRAD} (triton)", x.dim(), weight, stride, padding, dilation,
                    output_padding, groups, grad_out=grad_out, transposed=transposed, x=x)
    nd = len(stride)
    B = weight.shape[0]
    shared = x.dim() == weight.dim() - 1
    geom = _geometry(stride, padding, dilation, nd)
    x2 = _as_2d(x, nd)
    gy2 = _as_2d(grad_out, nd)
    x_strides = _strides5(x2, shared)
    gy_strides = tuple(gy2.stride())
    kh, kw = _kernel_hw(weight)
    if transposed:
        # dw[i, o, k] = sum x[n, i, q] * dy[n, o, q*s - p + k*d]
        g_op, g_strides, win, win_strides = x2, x_strides, gy2, gy_strides
    else:
        # dw[o, i, k] = sum dy[n, o, q] * x[n, i, q*s - p + k*d]
        g_op, g_strides, win, win_strides = gy2, gy_strides, x2, x_strides
    N = g_op.shape[-4]
    OH, OW = g_op.shape[-2:]
    H, W = win.shape[-2:]
    # weight is [B, A, C/G, *k] with A = C_out (conv) or C_in (transposed conv)
    A_g, C_g = weight.shape[1] // groups, weight.shape[2]
    CK = C_g * kh * kw
    P = N * OH * OW
    if P == 0:  # a sum over no output pixels: nothing to launch
        return torch.zeros_like(weight)
    chunk = _wgrad_chunk(P, A_g, CK, B * groups, weight.numel(), weight.device)
    splits = triton.cdiv(P, chunk)
    partial = torch.empty((splits, B, groups, A_g, CK), device=weight.device, dtype=torch.float32)
    (sh, sw), (ph, pw), (dh, dw) = geom

    def grid(meta):
        return (triton.cdiv(A_g, meta["BLOCK_M"]), triton.cdiv(CK, meta["BLOCK_N"]),
                splits * B * groups)

    _wgrad[grid](
        g_op, win, partial,
        N, H, W, OH, OW, A_g, C_g, groups, chunk,
        *g_strides, *win_strides,
        sh, sw, ph, pw, dh, dw, kh, kw, _precision(grad_out.dtype),
    )
    # Fixed-order sum of the per-split partials: deterministic.
    gw = partial.sum(0) if splits > 1 else partial[0]
    return like_weight(gw.reshape(weight.shape).to(weight.dtype), weight)


def _wgrad_chunk(P: int, A_g: int, CK: int, models_groups: int, weight_numel: int,
                 device: torch.device) -> int:
    """Output pixels per reduction split: enough programs to fill the GPU, bounded partial memory."""
    if interpreting():
        return max(16, triton.cdiv(P, 2))
    tiles = triton.cdiv(A_g, 64) * triton.cdiv(CK, 64) * models_groups
    target_programs = 4 * sm_count(device)  # a few waves of programs over the SMs
    splits = max(1, min(target_programs // max(tiles, 1), triton.cdiv(P, 256)))
    splits = max(1, min(splits, (64 << 20) // max(weight_numel, 1)))  # <= 256 MiB of partials
    chunk = triton.cdiv(P, splits)
    return triton.cdiv(chunk, 64) * 64
