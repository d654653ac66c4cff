"""Triton kernels for the array batch norm, and their launchers.

The launchers have the signatures and return values (shapes, dtypes, strides)
of the torch implementations in :mod:`hfkern.ops.batch_norm`, which states the
op contract, and register themselves as the ``triton`` implementations.

Layout. ``x`` is ``[B, N, C, *S]`` with any strides. The kernels see each
model's input as ``[R0, C, R1]``: the reduced dims (N and the spatial dims)
are ordered by x's strides and merged where they are contiguous with each
other in every tensor of the call, and must come down to at most two strided
dims, ``R0`` (outer) and ``R1`` (inner). That covers contiguous
``[B, N, C, *S]`` memory, the ``[N, B, C, *S]`` memory of an array conv's
output, channels-last memory, strided slices of one dim, a shared input
(stride 0 on B) and an expanded ``grad_y`` (stride 0 everywhere) without a
copy. Rarer layouts are copied to contiguous memory first (and outputs copied
back into the contract's layout).

Tiles are ``[BLOCK_R0, BLOCK_C, BLOCK_R1]``, chosen by the launcher from the
shape and x's strides so that the dim that runs along memory (R1 for
channels-first memory, C for channels-last or ``[B, N, C]``) is the long one.

Forward, training: the reduced elements of each (model, channel block) are
split into ``P`` fixed chunks, one program each; a program combines its tiles'
means and centred sums of squares (Chan's parallel update, as accurate as a
two-pass variance) into per-chunk partials ``[B, P, C]``; a second kernel
combines the ``P`` partials of each channel in chunk order, writes mean and
rstd, and updates the running statistics in place (one program per channel
block: nothing else touches them). Then a third kernel normalizes. Eval: the
second kernel turns the running statistics into mean and rstd.

Fused activation (``activation`` "relu" or "gelu"): the normalize kernel
applies it to the float32 ``z`` before the store; the backward kernels that
read ``x`` (partial sums, grad_x) recompute ``z`` from ``x``, the statistics,
weight and bias as the forward computed it and use ``g = grad_y * act'(z)``
in place of ``grad_y``. In eval, grad_x then reads ``x`` too.

Backward: the same partition; a program writes the float32 partial sums of
``grad_y`` and ``grad_y * xhat`` over its chunk, a second kernel sums the
partials of each channel in chunk order (grad_bias, grad_weight, and the two
terms grad_x needs), a third writes grad_x. In eval, grad_x alone needs no
sums. No atomics: the partition depends only on the shapes and the device's
SM count, so two runs with the same inputs give bitwise equal results (the
autotuned warp count can change the rounding of a program's in-tile sums).
"""

from __future__ import annotations

import math
from typing import Sequence

import torch
import triton
import triton.language as tl
from torch import Tensor

from .. import _backend
from .._dtypes import KERNEL_DTYPES
from .._norm_layout import addressed, backward_outputs, tile_shape
from .._norm_layout import layout as _layout
from .._norm_layout import partition as _partition
from ._common import Tuned, activate, activation_grad, check_tensors, column_block, interpreting

__all__ = ["array_batch_norm", "array_batch_norm_backward"]


# ---- kernels ------------------------------------------------------------------

@triton.jit
def _tile_offsets(b, r0, c, r1, s_b, s_r0, s_c, s_r1):
    """Memory offsets (int64) of the [R0, C, R1] tile of model ``b``."""
    # int64 before multiplying: an offset into a large activation can pass 2**31.
    return (
        b.to(tl.int64) * s_b
        + r0.to(tl.int64)[:, None, None] * s_r0
        + c.to(tl.int64)[None, :, None] * s_c
        + r1.to(tl.int64)[None, None, :] * s_r1
    )


@triton.jit
def _sum_tile(t):
    """[BLOCK_R0, BLOCK_C, BLOCK_R1] -> [BLOCK_C]."""
    return tl.sum(tl.sum(t, axis=2), axis=0)


@triton.jit
def _chunk_bounds(p, P1, R0, R1, CHUNK0, CHUNK1):
    """The rows [r0_lo, r0_hi) and inner elements [r1_lo, r1_hi) of chunk ``p``."""
    p0 = p // P1
    p1 = p % P1
    r0_lo = p0 * CHUNK0
    r1_lo = p1 * CHUNK1
    return r0_lo, tl.minimum(r0_lo + CHUNK0, R0), r1_lo, tl.minimum(r1_lo + CHUNK1, R1)


@triton.jit
def _program_tile(pid, R0, C, R1, n_cb, n_r0b, n_r1b,
                  BLOCK_R0: tl.constexpr, BLOCK_C: tl.constexpr, BLOCK_R1: tl.constexpr):
    """The tile of an element-wise program: (model, R0 rows, channels, R1 rows,
    channel mask, tile mask). The inner blocks vary fastest, so neighbouring
    programs read neighbouring memory."""
    r1 = (pid % n_r1b) * BLOCK_R1 + tl.arange(0, BLOCK_R1)
    r0 = ((pid // n_r1b) % n_r0b) * BLOCK_R0 + tl.arange(0, BLOCK_R0)
    cb = (pid // (n_r1b * n_r0b)) % n_cb
    b = (pid // (n_r1b * n_r0b * n_cb)).to(tl.int64)
    cols = cb * BLOCK_C + tl.arange(0, BLOCK_C)
    col_ok = cols < C
    mask = (r0 < R0)[:, None, None] & col_ok[None, :, None] & (r1 < R1)[None, None, :]
    return b, r0, cols, r1, col_ok, mask


@triton.jit
def _channel_scale(b, cols, col_ok, rstd, w_ptr, sw_b, sw_c, HAS_W: tl.constexpr):
    """[BLOCK_C] float32: rstd * weight, the scale of z = (x - mean) * scale + bias."""
    scale = rstd
    if HAS_W:
        scale = rstd * tl.load(w_ptr + b * sw_b + cols * sw_c, mask=col_ok, other=0.0).to(tl.float32)
    return scale


@triton.jit
def _channel_shift(b, cols, col_ok, bias_ptr, sbias_b, sbias_c):
    """[BLOCK_C] float32: the bias, the shift of z = (x - mean) * scale + bias."""
    return tl.load(bias_ptr + b * sbias_b + cols * sbias_c, mask=col_ok, other=0.0).to(tl.float32)


@triton.jit
def _bn_stats_kernel(
    x_ptr,  # [B, R0, C, R1] through strides
    pmean_ptr,  # [B, P, C] float32: the mean of each chunk
    pm2_ptr,  # [B, P, C] float32: the sum of squared deviations from that mean
    R0, C, R1,
    s_b, s_r0, s_c, s_r1,
    CHUNK0, CHUNK1, P, P1, n_cb,
    BLOCK_R0: tl.constexpr,
    BLOCK_C: tl.constexpr,
    BLOCK_R1: tl.constexpr,
):
    pid = tl.program_id(0)
    p = pid % P
    cb = (pid // P) % n_cb
    b = pid // (P * n_cb)
    r0_lo, r0_hi, r1_lo, r1_hi = _chunk_bounds(p, P1, R0, R1, CHUNK0, CHUNK1)
    cols = cb * BLOCK_C + tl.arange(0, BLOCK_C)
    col_ok = cols < C
    count = 0.0
    mean = tl.zeros([BLOCK_C], dtype=tl.float32)
    m2 = tl.zeros([BLOCK_C], dtype=tl.float32)
    for r0_start in range(r0_lo, r0_hi, BLOCK_R0):
        r0 = r0_start + tl.arange(0, BLOCK_R0)
        n0 = tl.minimum(r0_hi - r0_start, BLOCK_R0)
        for r1_start in range(r1_lo, r1_hi, BLOCK_R1):
            r1 = r1_start + tl.arange(0, BLOCK_R1)
            mask = (r0 < r0_hi)[:, None, None] & col_ok[None, :, None] & (r1 < r1_hi)[None, None, :]
            offs = _tile_offsets(b, r0, cols, r1, s_b, s_r0, s_c, s_r1)
            x = tl.load(x_ptr + offs, mask=mask, other=0.0).to(tl.float32)
            # The tile's own mean and centred sum of squares, then Chan's update:
            # no sum of squares of raw values, whose difference would cancel.
            n_tile = (n0 * tl.minimum(r1_hi - r1_start, BLOCK_R1)).to(tl.float32)
            tile_mean = _sum_tile(x) / n_tile
            d = tl.where(mask, x - tile_mean[None, :, None], 0.0)
            tile_m2 = _sum_tile(d * d)
            total = count + n_tile
            delta = tile_mean - mean
            mean += delta * (n_tile / total)
            m2 += tile_m2 + delta * delta * (count * n_tile / total)
            count = total
    part = (b.to(tl.int64) * P + p) * C + cols
    tl.store(pmean_ptr + part, mean, mask=col_ok)
    tl.store(pm2_ptr + part, m2, mask=col_ok)


@triton.jit
def _bn_finalize_kernel(
    pmean_ptr,  # [B or 1, P, C] float32 (1: a shared input's statistics, for every model)
    pm2_ptr,  # [B or 1, P, C] float32
    rm_ptr,  # [B, C] running_mean through strides, its own dtype
    rv_ptr,  # [B, C] running_var through strides
    nbt_ptr,  # [B] num_batches_tracked through its stride, an integer dtype
    mean_ptr,  # [B, C] float32, contiguous
    rstd_ptr,  # [B, C] float32, contiguous
    C, R0, R1, CHUNK0, CHUNK1, P, P1, s_part_b,
    s_rm_b, s_rm_c, s_rv_b, s_rv_c, s_nbt,
    momentum, unbias, eps,
    TRAINING: tl.constexpr,
    UPDATE: tl.constexpr,
    CUMULATIVE: tl.constexpr,
    BLOCK: tl.constexpr,
):
    b, cols, col_ok = column_block(tl.program_id(0), C, BLOCK)
    rm_offs = b * s_rm_b + cols * s_rm_c
    rv_offs = b * s_rv_b + cols * s_rv_c
    if TRAINING:
        count = 0.0
        mean = tl.zeros([BLOCK], dtype=tl.float32)
        m2 = tl.zeros([BLOCK], dtype=tl.float32)
        part = b * s_part_b + cols
        # in chunk order, one after another: the result does not depend on the launch
        for p in range(0, P):
            r0_lo, r0_hi, r1_lo, r1_hi = _chunk_bounds(p, P1, R0, R1, CHUNK0, CHUNK1)
            n_part = (r0_hi - r0_lo).to(tl.float32) * (r1_hi - r1_lo).to(tl.float32)
            p_mean = tl.load(pmean_ptr + part, mask=col_ok, other=0.0)
            p_m2 = tl.load(pm2_ptr + part, mask=col_ok, other=0.0)
            total = count + n_part
            delta = p_mean - mean
            mean += delta * (n_part / total)
            m2 += p_m2 + delta * delta * (count * n_part / total)
            count = total
            part += C
        var = m2 / count
        if UPDATE:
            # float32, as torch's CUDA kernel blends
            if CUMULATIVE:
                f = 1.0 / tl.load(nbt_ptr + b * s_nbt).to(tl.float32)
            else:
                f = momentum
            rm = tl.load(rm_ptr + rm_offs, mask=col_ok, other=0.0).to(tl.float32)
            rv = tl.load(rv_ptr + rv_offs, mask=col_ok, other=0.0).to(tl.float32)
            tl.store(rm_ptr + rm_offs, (f * mean + (1 - f) * rm).to(rm_ptr.dtype.element_ty), mask=col_ok)
            tl.store(rv_ptr + rv_offs, (f * (var * unbias) + (1 - f) * rv).to(rv_ptr.dtype.element_ty),
                     mask=col_ok)
    else:
        mean = tl.load(rm_ptr + rm_offs, mask=col_ok, other=0.0).to(tl.float32)
        var = tl.load(rv_ptr + rv_offs, mask=col_ok, other=1.0).to(tl.float32)
    stats = b * C + cols
    tl.store(mean_ptr + stats, mean, mask=col_ok)
    tl.store(rstd_ptr + stats, tl.rsqrt(var + eps), mask=col_ok)


@triton.jit
def _bn_norm_kernel(
    x_ptr,  # [B, R0, C, R1] through strides
    y_ptr,  # [B, R0, C, R1] through y's strides
    mean_ptr,  # [B, C] float32, contiguous
    rstd_ptr,  # [B, C] float32, contiguous
    w_ptr,  # [B, C] through strides
    bias_ptr,  # [B, C] through strides
    R0, C, R1,
    sx_b, sx_r0, sx_c, sx_r1,
    sy_b, sy_r0, sy_c, sy_r1,
    sw_b, sw_c, sbias_b, sbias_c,
    n_cb, n_r0b, n_r1b,
    HAS_W: tl.constexpr,
    HAS_B: tl.constexpr,
    ACTIVATION: tl.constexpr,
    BLOCK_R0: tl.constexpr,
    BLOCK_C: tl.constexpr,
    BLOCK_R1: tl.constexpr,
):
    # one tile per program
    b, r0, cols, r1, col_ok, mask = _program_tile(
        tl.program_id(0), R0, C, R1, n_cb, n_r0b, n_r1b, BLOCK_R0, BLOCK_C, BLOCK_R1
    )
    mean = tl.load(mean_ptr + b * C + cols, mask=col_ok, other=0.0)
    rstd = tl.load(rstd_ptr + b * C + cols, mask=col_ok, other=0.0)
    scale = _channel_scale(b, cols, col_ok, rstd, w_ptr, sw_b, sw_c, HAS_W)
    x = tl.load(x_ptr + _tile_offsets(b, r0, cols, r1, sx_b, sx_r0, sx_c, sx_r1), mask=mask, other=0.0)
    y = (x.to(tl.float32) - mean[None, :, None]) * scale[None, :, None]
    if HAS_B:
        y = y + _channel_shift(b, cols, col_ok, bias_ptr, sbias_b, sbias_c)[None, :, None]
    y = activate(y, ACTIVATION)
    y_offs = _tile_offsets(b, r0, cols, r1, sy_b, sy_r0, sy_c, sy_r1)
    tl.store(y_ptr + y_offs, y.to(y_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _bn_bwd_partial_kernel(
    gy_ptr,  # [B, R0, C, R1] through strides
    x_ptr,  # [B, R0, C, R1] through x's strides
    mean_ptr,  # [B, C] float32, contiguous
    rstd_ptr,  # [B, C] float32, contiguous
    w_ptr,  # [B, C] through strides (read for the activation only)
    bias_ptr,  # [B, C] through strides (read for the activation only)
    pg_ptr,  # [B, P, C] float32: per-chunk sums of g = grad_y * act'(z)
    pgx_ptr,  # [B, P, C] float32: per-chunk sums of g * xhat
    R0, C, R1,
    sg_b, sg_r0, sg_c, sg_r1,
    sx_b, sx_r0, sx_c, sx_r1,
    sw_b, sw_c, sbias_b, sbias_c,
    CHUNK0, CHUNK1, P, P1, n_cb,
    HAS_W: tl.constexpr,
    HAS_B: tl.constexpr,
    ACTIVATION: tl.constexpr,
    BLOCK_R0: tl.constexpr,
    BLOCK_C: tl.constexpr,
    BLOCK_R1: tl.constexpr,
):
    pid = tl.program_id(0)
    p = pid % P
    cb = (pid // P) % n_cb
    b = (pid // (P * n_cb)).to(tl.int64)
    r0_lo, r0_hi, r1_lo, r1_hi = _chunk_bounds(p, P1, R0, R1, CHUNK0, CHUNK1)
    cols = cb * BLOCK_C + tl.arange(0, BLOCK_C)
    col_ok = cols < C
    mean = tl.load(mean_ptr + b * C + cols, mask=col_ok, other=0.0)
    rstd = tl.load(rstd_ptr + b * C + cols, mask=col_ok, other=0.0)
    if ACTIVATION != "none":
        scale = _channel_scale(b, cols, col_ok, rstd, w_ptr, sw_b, sw_c, HAS_W)[None, :, None]
        if HAS_B:
            shift = _channel_shift(b, cols, col_ok, bias_ptr, sbias_b, sbias_c)[None, :, None]
    mean = mean[None, :, None]
    rstd = rstd[None, :, None]
    # Sums stay tiles across the chunk and are reduced once at the end.
    acc_g = tl.zeros([BLOCK_R0, BLOCK_C, BLOCK_R1], dtype=tl.float32)
    acc_gx = tl.zeros([BLOCK_R0, BLOCK_C, BLOCK_R1], dtype=tl.float32)
    for r0_start in range(r0_lo, r0_hi, BLOCK_R0):
        r0 = r0_start + tl.arange(0, BLOCK_R0)
        for r1_start in range(r1_lo, r1_hi, BLOCK_R1):
            r1 = r1_start + tl.arange(0, BLOCK_R1)
            mask = (r0 < r0_hi)[:, None, None] & col_ok[None, :, None] & (r1 < r1_hi)[None, None, :]
            g_offs = _tile_offsets(b, r0, cols, r1, sg_b, sg_r0, sg_c, sg_r1)
            x_offs = _tile_offsets(b, r0, cols, r1, sx_b, sx_r0, sx_c, sx_r1)
            gy = tl.load(gy_ptr + g_offs, mask=mask, other=0.0).to(tl.float32)
            x = tl.load(x_ptr + x_offs, mask=mask, other=0.0).to(tl.float32)
            xc = x - mean
            if ACTIVATION != "none":
                z = xc * scale  # as the normalize kernel computed it
                if HAS_B:
                    z = z + shift
                gy = activation_grad(gy, z, ACTIVATION)
            acc_g += gy
            acc_gx += gy * (xc * rstd)  # padding: grad_y (so g) is 0 there
    part = (b * P + p) * C + cols
    tl.store(pg_ptr + part, _sum_tile(acc_g), mask=col_ok)
    tl.store(pgx_ptr + part, _sum_tile(acc_gx), mask=col_ok)


@triton.jit
def _bn_bwd_reduce_kernel(
    pg_ptr,  # [B, P, C] float32
    pgx_ptr,  # [B, P, C] float32
    sums_ptr,  # [2, B, C] float32: sum of grad_y, sum of grad_y * xhat
    gw_ptr,  # [B, C] contiguous, grad_weight's dtype
    gb_ptr,  # [B, C] contiguous, grad_bias's dtype
    B, C, P,
    HAS_DW: tl.constexpr,
    HAS_DB: tl.constexpr,
    BLOCK: tl.constexpr,
):
    b, cols, col_ok = column_block(tl.program_id(0), C, BLOCK)
    part = b * P * C + cols
    sum_g = tl.zeros([BLOCK], dtype=tl.float32)
    sum_gx = tl.zeros([BLOCK], dtype=tl.float32)
    # one channel's partials are added one after another in chunk order
    for _ in range(0, P):
        sum_g += tl.load(pg_ptr + part, mask=col_ok, other=0.0)
        sum_gx += tl.load(pgx_ptr + part, mask=col_ok, other=0.0)
        part += C
    stats = b * C + cols
    tl.store(sums_ptr + stats, sum_g, mask=col_ok)
    tl.store(sums_ptr + B * C + stats, sum_gx, mask=col_ok)
    if HAS_DW:
        tl.store(gw_ptr + stats, sum_gx.to(gw_ptr.dtype.element_ty), mask=col_ok)
    if HAS_DB:
        tl.store(gb_ptr + stats, sum_g.to(gb_ptr.dtype.element_ty), mask=col_ok)


@triton.jit
def _bn_bwd_dx_kernel(
    gy_ptr,  # [B, R0, C, R1] through strides
    x_ptr,  # [B, R0, C, R1] through x's strides
    gx_ptr,  # [B, R0, C, R1] through grad_x's strides
    mean_ptr,  # [B, C] float32, contiguous
    rstd_ptr,  # [B, C] float32, contiguous
    w_ptr,  # [B, C] through strides
    bias_ptr,  # [B, C] through strides (read for the activation only)
    sums_ptr,  # [2, B, C] float32 (training only)
    B, R0, C, R1,
    sg_b, sg_r0, sg_c, sg_r1,
    sx_b, sx_r0, sx_c, sx_r1,
    sgx_b, sgx_r0, sgx_c, sgx_r1,
    sw_b, sw_c, sbias_b, sbias_c,
    inv_n,
    n_cb, n_r0b, n_r1b,
    TRAINING: tl.constexpr,
    READ_X: tl.constexpr,  # TRAINING, or an activation whose derivative needs z
    HAS_W: tl.constexpr,
    HAS_B: tl.constexpr,
    ACTIVATION: tl.constexpr,
    BLOCK_R0: tl.constexpr,
    BLOCK_C: tl.constexpr,
    BLOCK_R1: tl.constexpr,
):
    b, r0, cols, r1, col_ok, mask = _program_tile(
        tl.program_id(0), R0, C, R1, n_cb, n_r0b, n_r1b, BLOCK_R0, BLOCK_C, BLOCK_R1
    )
    stats = b * C + cols
    rstd = tl.load(rstd_ptr + stats, mask=col_ok, other=0.0)
    scale = _channel_scale(b, cols, col_ok, rstd, w_ptr, sw_b, sw_c, HAS_W)
    gy = tl.load(gy_ptr + _tile_offsets(b, r0, cols, r1, sg_b, sg_r0, sg_c, sg_r1), mask=mask, other=0.0)
    gy = gy.to(tl.float32)
    if READ_X:
        mean = tl.load(mean_ptr + stats, mask=col_ok, other=0.0)
        x = tl.load(x_ptr + _tile_offsets(b, r0, cols, r1, sx_b, sx_r0, sx_c, sx_r1), mask=mask, other=0.0)
        xc = x.to(tl.float32) - mean[None, :, None]
        if ACTIVATION != "none":
            z = xc * scale[None, :, None]  # as the normalize kernel computed it
            if HAS_B:
                z = z + _channel_shift(b, cols, col_ok, bias_ptr, sbias_b, sbias_c)[None, :, None]
            gy = activation_grad(gy, z, ACTIVATION)
        if TRAINING:
            c_g = tl.load(sums_ptr + stats, mask=col_ok, other=0.0) * inv_n
            c_gx = tl.load(sums_ptr + B * C + stats, mask=col_ok, other=0.0) * inv_n
            xhat = xc * rstd[None, :, None]
            gy = gy - c_g[None, :, None] - xhat * c_gx[None, :, None]
    gx = gy * scale[None, :, None]
    gx_offs = _tile_offsets(b, r0, cols, r1, sgx_b, sgx_r0, sgx_c, sgx_r1)
    tl.store(gx_ptr + gx_offs, gx.to(gx_ptr.dtype.element_ty), mask=mask)


# The block shapes come from the launcher (the shape and the layout decide
# them); the autotuner only picks the warp count. At 4 warps a 2048-element
# tile spills registers on sm_90 (stats and dx kernels), so 8 is the least.
# Kernels that write the running statistics in place are never autotuned:
# timing runs them repeatedly.
_WARPS = [triton.Config({}, num_warps=8), triton.Config({}, num_warps=16)]
_TILE_KEY = ["C", "R1", "BLOCK_R0", "BLOCK_C", "BLOCK_R1"]
_stats = Tuned(_bn_stats_kernel, _WARPS, key=_TILE_KEY, interpret_config=triton.Config({}))
_norm = Tuned(_bn_norm_kernel, _WARPS, key=_TILE_KEY, interpret_config=triton.Config({}))
_bwd_partial = Tuned(_bn_bwd_partial_kernel, _WARPS, key=_TILE_KEY, interpret_config=triton.Config({}))
_bwd_dx = Tuned(_bn_bwd_dx_kernel, _WARPS, key=_TILE_KEY, interpret_config=triton.Config({}))
_finalize = Tuned(_bn_finalize_kernel, [triton.Config({}, num_warps=4)], key=[])
_bwd_reduce = Tuned(_bn_bwd_reduce_kernel, [triton.Config({}, num_warps=4)], key=[])

# Elements per tile, and the most along the memory-contiguous dim. The backward
# partial kernel keeps two float32 tiles of sums live besides the loads. The
# interpreter uses small tiles so that small test shapes reach every loop.
_TILE, _INNER = 2048, 512
_INTERPRET_TILE, _INTERPRET_INNER = 32, 8
# channels per program of the per-channel kernels (finalize, reduce)
_CHANNEL_BLOCK, _INTERPRET_CHANNEL_BLOCK = 128, 4


# ---- layout -------------------------------------------------------------------

def _blocks(R0: int, C: int, R1: int, s_c: int, s_r1: int) -> tuple[int, int, int]:
    """(BLOCK_R0, BLOCK_C, BLOCK_R1): long along the dim that runs along memory."""
    tile, inner = (_INTERPRET_TILE, _INTERPRET_INNER) if interpreting() else (_TILE, _INNER)
    return tile_shape(R0, C, R1, s_c, s_r1, tile, inner)[:3]


def _channel_block() -> int:
    return _INTERPRET_CHANNEL_BLOCK if interpreting() else _CHANNEL_BLOCK


def _param(p: Tensor | None, dummy: Tensor) -> tuple[Tensor, int, int]:
    return (dummy, 0, 0) if p is None else (p, p.stride(0), p.stride(1))


# Registered for CUDA tensors and the dtypes the kernels compute in; not
# auto-eligible until a GPU benchmark under bench/results/ shows them faster
# than the torch path.
def _implements(op: str):
    return _backend.implements(op, "triton", device_types=("cuda",), auto=False, dtypes=KERNEL_DTYPES)


# ---- forward ------------------------------------------------------------------

def _empty_forward(x: Tensor, running_mean, running_var, training: bool, eps: float):
    """(y, mean, rstd) of an x with no elements: nothing to launch, nothing to update."""
    B, C = x.shape[0], x.shape[2]
    if training:  # the statistics of no values
        mean = x.new_full((B, C), math.nan, dtype=torch.float32)
        return torch.empty_like(x), mean, mean.clone()
    mean = running_mean.to(dtype=torch.float32, memory_format=torch.contiguous_format, copy=True)
    return torch.empty_like(x), mean, (running_var.float() + eps).rsqrt_().contiguous()


@_implements("array_batch_norm")
def array_batch_norm(
    x: Tensor,
    weight: Tensor | None,
    bias: Tensor | None,
    running_mean: Tensor | None,
    running_var: Tensor | None,
    num_batches_tracked: Tensor | None,
    training: bool,
    momentum: float | None,
    eps: float,
    activation: str = "none",
) -> tuple[Tensor, Tensor, Tensor]:
    """Batch norm of B models: see :mod:`hfkern.ops.batch_norm`.

    x ``[B, N, C, *S]`` (float32/float16/bfloat16, any strides); weight, bias,
    running_mean, running_var ``[B, C]`` or None; num_batches_tracked ``[B]``
    or None; ``activation`` "none", "relu" or "gelu", applied to z. Returns y
    (x's dtype, ``empty_like(x)`` layout), mean and rstd (float32 ``[B, C]``,
    contiguous); in training the running statistics are updated in place.
    """
    check_tensors("array_batch_norm", x, weight, bias, running_mean, running_var)
    B, N, C = x.shape[:3]
    if x.numel() == 0:
        return _empty_forward(x, running_mean, running_var, training, eps)
    y = torch.empty_like(x)
    (x_in,), y_out, (R0, R1, (sx, sy)) = addressed(_layout, [x], y)
    block_r0, block_c, block_r1 = _blocks(R0, C, R1, sx[2], sx[3])
    n_cb = triton.cdiv(C, block_c)
    mean = x.new_empty((B, C), dtype=torch.float32)
    rstd = x.new_empty((B, C), dtype=torch.float32)
    update = training and running_mean is not None
    cumulative = update and momentum is None
    dummy = mean
    rm, s_rm_b, s_rm_c = _param(running_mean, dummy)
    rv, s_rv_b, s_rv_c = _param(running_var, dummy)
    nbt = num_batches_tracked if cumulative else dummy
    s_nbt = nbt.stride(0) if cumulative else 0
    n = N * math.prod(x.shape[3:])
    unbias = n / (n - 1) if n > 1 else 1.0

    partials, chunk0, chunk1, P, P1, s_part_b = dummy, 1, 1, 1, 1, 0
    if training:
        # A shared input is the same batch for every model: its statistics once.
        stat_models = 1 if x.stride(0) == 0 else B
        chunk0, chunk1, P, P1 = _partition(x.device, stat_models * n_cb, R0, R1, block_r0, block_r1)
        partials = x.new_empty((2, stat_models, P, C), dtype=torch.float32)
        s_part_b = 0 if stat_models == 1 else P * C
        _stats[(stat_models * n_cb * P,)](
            x_in, partials[0], partials[1],
            R0, C, R1, *sx,
            chunk0, chunk1, P, P1, n_cb,
            BLOCK_R0=block_r0, BLOCK_C=block_c, BLOCK_R1=block_r1,
        )
    channel_block = _channel_block()
    _finalize[(B * triton.cdiv(C, channel_block),)](
        partials[0], partials[-1], rm, rv, nbt, mean, rstd,
        C, R0, R1, chunk0, chunk1, P, P1, s_part_b,
        s_rm_b, s_rm_c, s_rv_b, s_rv_c, s_nbt,
        0.0 if momentum is None else float(momentum), unbias, eps,
        TRAINING=training, UPDATE=update, CUMULATIVE=cumulative, BLOCK=channel_block,
    )
    w, sw_b, sw_c = _param(weight, dummy)
    b, sb_b, sb_c = _param(bias, dummy)
    n_r0b, n_r1b = triton.cdiv(R0, block_r0), triton.cdiv(R1, block_r1)
    _norm[(B * n_cb * n_r0b * n_r1b,)](
        x_in, y_out, mean, rstd, w, b,
        R0, C, R1, *sx, *sy,
        sw_b, sw_c, sb_b, sb_c,
        n_cb, n_r0b, n_r1b,
        HAS_W=weight is not None, HAS_B=bias is not None, ACTIVATION=activation,
        BLOCK_R0=block_r0, BLOCK_C=block_c, BLOCK_R1=block_r1,
    )
    if y_out is not y:
        y.copy_(y_out)
    return y, mean, rstd


# ---- backward -----------------------------------------------------------------

@_implements("array_batch_norm_backward")
def array_batch_norm_backward(
    grad_y: Tensor,
    x: Tensor,
    weight: Tensor | None,
    mean: Tensor,
    rstd: Tensor,
    training: bool,
    output_mask: Sequence[bool],
    bias: Tensor | None = None,
    activation: str = "none",
) -> tuple[Tensor, Tensor, Tensor]:
    """(grad_x, grad_weight, grad_bias): see :mod:`hfkern.ops.batch_norm`.

    grad_y, x ``[B, N, C, *S]`` (any strides), weight and bias ``[B, C]`` or
    None, mean and rstd float32 ``[B, C]``, ``activation`` the forward's. An
    output whose ``output_mask`` entry is False is an empty ``[0]`` tensor.
    """
    check_tensors("array_batch_norm_backward", x, grad_y, weight, bias)
    want_dx, want_dw, want_db = (bool(m) for m in output_mask)
    B, N, C = x.shape[:3]
    grad_x, grad_w, grad_b = backward_outputs(x, weight, output_mask, (B, C), launch=True)
    if x.numel() == 0 or not any(output_mask):
        return grad_x, grad_w, grad_b
    need_sums = want_dw or want_db or (want_dx and training)

    (x_in, gy_in), gx_out, (R0, R1, strides) = addressed(_layout, [x, grad_y], grad_x if want_dx else None)
    sx, sg = strides[0], strides[1]
    sgx = strides[2] if want_dx else [0] * 4
    block_r0, block_c, block_r1 = _blocks(R0, C, R1, sx[2], sx[3])
    n_cb = triton.cdiv(C, block_c)
    mean = mean.float().contiguous()
    rstd = rstd.float().contiguous()
    sums = mean  # a placeholder where the kernels do not read it
    # the activation's derivative needs z: weight and bias are read where x is
    fused = activation != "none"
    w, sw_b, sw_c = _param(weight, mean)
    b, sb_b, sb_c = _param(bias if fused else None, mean)
    has_b = fused and bias is not None
    if need_sums:
        chunk0, chunk1, P, P1 = _partition(x.device, B * n_cb, R0, R1, block_r0, block_r1)
        partials = x.new_empty((2, B, P, C), dtype=torch.float32)
        _bwd_partial[(B * n_cb * P,)](
            gy_in, x_in, mean, rstd, w, b, partials[0], partials[1],
            R0, C, R1, *sg, *sx,
            sw_b, sw_c, sb_b, sb_c,
            chunk0, chunk1, P, P1, n_cb,
            HAS_W=weight is not None, HAS_B=has_b, ACTIVATION=activation,
            BLOCK_R0=block_r0, BLOCK_C=block_c, BLOCK_R1=block_r1,
        )
        sums = x.new_empty((2, B, C), dtype=torch.float32)
        channel_block = _channel_block()
        _bwd_reduce[(B * triton.cdiv(C, channel_block),)](
            partials[0], partials[1], sums,
            grad_w if want_dw else sums, grad_b if want_db else sums,
            B, C, P,
            HAS_DW=want_dw, HAS_DB=want_db, BLOCK=channel_block,
        )
    if want_dx:
        n_r0b, n_r1b = triton.cdiv(R0, block_r0), triton.cdiv(R1, block_r1)
        _bwd_dx[(B * n_cb * n_r0b * n_r1b,)](
            gy_in, x_in, gx_out, mean, rstd, w, b, sums,
            B, R0, C, R1, *sg, *sx, *sgx,
            sw_b, sw_c, sb_b, sb_c,
            1.0 / (N * math.prod(x.shape[3:])),
            n_cb, n_r0b, n_r1b,
            TRAINING=training, READ_X=training or fused, HAS_W=weight is not None, HAS_B=has_b,
            ACTIVATION=activation,
            BLOCK_R0=block_r0, BLOCK_C=block_c, BLOCK_R1=block_r1,
        )
        if gx_out is not grad_x:
            grad_x.copy_(gx_out)
    return grad_x, grad_w, grad_b
