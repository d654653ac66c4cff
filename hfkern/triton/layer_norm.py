"""Triton kernels for the array layer norm and RMS norm, and their launchers.

The launchers have the signatures and return values (shapes, dtypes, strides)
of the torch implementations in :mod:`hfkern.ops.layer_norm`, which states the
op contract, and register themselves as the ``triton`` implementations.

Layout. ``x`` is ``[B, *, *S]`` with any strides. The kernels see it as B x M
rows of ``D = prod(S)`` elements, addressed through strides: after merging
adjacent dims that are contiguous with each other (in every tensor of the
call, which all share one logical shape), the per-model batch dims ``*`` must
reduce to at most two strided dims (rows = M0 x M1) and ``S`` to at most two
(columns = D0 x D1). That covers contiguous inputs, ``[N, B, ...]``-memory conv
outputs, strided slices, a last-two-dims transpose, a shared input (stride 0
on B) and an expanded ``grad_y`` (stride 0 everywhere) without a copy. Rarer
layouts are copied to contiguous memory first (and outputs copied back into
the contract's layout).

Forward: one program per block of rows of one model (so the rows share that
model's weight row); short rows are stacked so a program holds about ``TILE``
elements (the autotuned parameter). A row of up to 4096 elements is read once;
a longer one is swept in blocks (mean, centred variance, write). Statistics are
float32 for float32/float16/bfloat16 ``x``; float64 is not served.

Fused activation (``activation`` "relu" or "gelu", layer norm only): the
forward applies it to the float32 ``z`` before the store; the backward
recomputes ``z = xhat * weight + bias`` where it reads ``x`` and multiplies
``grad_y`` by ``act'(z)`` first. The activation costs no memory traffic.

Backward: the M rows of each model are split into ``P`` fixed chunks, one
program each. A program writes grad_x for its rows and the float32 partial sums
of ``grad_y * xhat`` (grad_weight) and ``grad_y`` (grad_bias) over its chunk
into ``[B, P, D]`` buffers; a second kernel sums the ``P`` partials of each
column sequentially, in partial order. No atomics, so two runs with the same
inputs and the same autotuned config give bitwise equal gradients. The
partition depends only on the shapes and the device's SM count, not on the
config; the config (tile height, warps) can change the rounding of a program's
in-tile sums.
"""

from __future__ import annotations

import math
from typing import Sequence

import torch
import triton
import triton.language as tl
from torch import Tensor

from .. import _backend
from .._device import sm_count
from .._dtypes import KERNEL_DTYPES
from .._norm_layout import addressed, backward_outputs
from .._norm_layout import row_layout as _layout
from ._common import Tuned, activate, activation_grad, check_tensors, column_block, interpreting

__all__ = [
    "array_layer_norm", "array_layer_norm_backward", "array_rms_norm", "array_rms_norm_backward",
]


# ---- kernels ------------------------------------------------------------------

@triton.jit
def _strided_offsets(idx, inner, s_outer, s_inner, SPLIT: tl.constexpr):
    """Memory offsets (int64) of logical indices along a dim stored as outer x inner."""
    # int64 before multiplying: an offset into a large activation can pass 2**31.
    idx = idx.to(tl.int64)
    if SPLIT:
        return (idx // inner) * s_outer + (idx % inner) * s_inner
    return idx * s_inner


@triton.jit
def _load_param(row_ptr, cols, col_ok, s_d):
    return tl.load(row_ptr + cols * s_d, mask=col_ok, other=0.0).to(tl.float32)


@triton.jit
def _norm_activation_grad(gy, xhat, w_row, bias_row, cols, col_ok, sw_d, sbias_d,
                          HAS_W: tl.constexpr, HAS_B: tl.constexpr, ACTIVATION: tl.constexpr):
    """gy * act'(z) of the rows' columns ``cols``, z = xhat * w + b recomputed as the forward did."""
    if ACTIVATION != "none":
        z = xhat
        if HAS_W:
            z = z * _load_param(w_row, cols, col_ok, sw_d)[None, :]
        if HAS_B:
            z = z + _load_param(bias_row, cols, col_ok, sbias_d)[None, :]
        gy = activation_grad(gy, z, ACTIVATION)
    return gy


@triton.jit
def _swept_block(x_ptr, gy_ptr, x_rows, g_rows, row_ok, d0, mean, rstd, w_row, bias_row,
                 D, D1, sx_d0, sx_d1, sg_d0, sg_d1, sw_d, sbias_d,
                 IS_RMS: tl.constexpr, HAS_W: tl.constexpr, HAS_B: tl.constexpr, ACTIVATION: tl.constexpr,
                 COL2: tl.constexpr, BLOCK_D: tl.constexpr):
    """Columns [d0, d0 + BLOCK_D) of a row tile the backward sweeps (rows longer than one
    block): (cols, col_ok, mask, xhat, grad_y * act'(z)), float32; ``mean`` unread for RMS."""
    cols = d0 + tl.arange(0, BLOCK_D)
    col_ok = cols < D
    mask = row_ok[:, None] & col_ok[None, :]
    x_offs = x_rows[:, None] + _strided_offsets(cols, D1, sx_d0, sx_d1, COL2)[None, :]
    g_offs = g_rows[:, None] + _strided_offsets(cols, D1, sg_d0, sg_d1, COL2)[None, :]
    x = tl.load(x_ptr + x_offs, mask=mask, other=0.0).to(tl.float32)
    gy = tl.load(gy_ptr + g_offs, mask=mask, other=0.0).to(tl.float32)
    if IS_RMS:
        xhat = x * rstd[:, None]
    else:
        xhat = tl.where(mask, (x - mean[:, None]) * rstd[:, None], 0.0)
    gy = _norm_activation_grad(gy, xhat, w_row, bias_row, cols, col_ok, sw_d, sbias_d, HAS_W, HAS_B, ACTIVATION)
    return cols, col_ok, mask, xhat, gy


@triton.jit
def _norm_fwd_kernel(
    x_ptr,  # [B, M, D] through strides (rows M0 x M1, columns D0 x D1)
    y_ptr,  # [B, M, D] through y's strides
    w_ptr,  # [B, D]
    bias_ptr,  # [B, D]
    mean_ptr,  # [B, M] float32, contiguous
    rstd_ptr,  # [B, M] float32, contiguous
    M, M1, D, D1,
    sx_b, sx_m0, sx_m1, sx_d0, sx_d1,
    sy_b, sy_m0, sy_m1, sy_d0, sy_d1,
    sw_b, sw_d, sbias_b, sbias_d,
    eps,
    IS_RMS: tl.constexpr,
    HAS_W: tl.constexpr,
    HAS_B: tl.constexpr,
    ACTIVATION: tl.constexpr,
    ROW2: tl.constexpr,
    COL2: tl.constexpr,
    BLOCK_D: tl.constexpr,
    ONE_BLOCK: tl.constexpr,
    TILE: tl.constexpr,
):
    # TILE bounds the elements a program holds, whatever D is: short rows are
    # stacked ROWS high so each program still moves a useful amount of data.
    ROWS: tl.constexpr = (TILE + BLOCK_D - 1) // BLOCK_D
    pid = tl.program_id(0)
    n_row_blocks = tl.cdiv(M, ROWS)
    bi = (pid // n_row_blocks).to(tl.int64)
    rows = (pid % n_row_blocks) * ROWS + tl.arange(0, ROWS)
    row_ok = rows < M
    x_rows = bi * sx_b + _strided_offsets(rows, M1, sx_m0, sx_m1, ROW2)
    y_rows = bi * sy_b + _strided_offsets(rows, M1, sy_m0, sy_m1, ROW2)
    w_row = w_ptr + bi * sw_b
    bias_row = bias_ptr + bi * sbias_b

    if ONE_BLOCK:
        cols = tl.arange(0, BLOCK_D)
        col_ok = cols < D
        mask = row_ok[:, None] & col_ok[None, :]
        x_offs = x_rows[:, None] + _strided_offsets(cols, D1, sx_d0, sx_d1, COL2)[None, :]
        x = tl.load(x_ptr + x_offs, mask=mask, other=0.0).to(tl.float32)
        if IS_RMS:
            xc = x
        else:
            mean = tl.sum(x, axis=1) / D
            # padding must not enter the variance
            xc = tl.where(mask, x - mean[:, None], 0.0)
        rstd = tl.rsqrt(tl.sum(xc * xc, axis=1) / D + eps)
        y = xc * rstd[:, None]
        if HAS_W:
            y = y * _load_param(w_row, cols, col_ok, sw_d)[None, :]
        if HAS_B:
            y = y + _load_param(bias_row, cols, col_ok, sbias_d)[None, :]
        y = activate(y, ACTIVATION)
        y_offs = y_rows[:, None] + _strided_offsets(cols, D1, sy_d0, sy_d1, COL2)[None, :]
        tl.store(y_ptr + y_offs, y.to(y_ptr.dtype.element_ty), mask=mask)
    else:
        # Rows longer than one tile: the mean first, then the centred sum of
        # squares (as accurate as a two-pass variance), then the write. The
        # re-reads of a program's rows mostly hit cache.
        if not IS_RMS:
            acc = tl.zeros([ROWS, BLOCK_D], dtype=tl.float32)
            for d0 in range(0, D, BLOCK_D):
                cols = d0 + tl.arange(0, BLOCK_D)
                mask = row_ok[:, None] & (cols < D)[None, :]
                x_offs = x_rows[:, None] + _strided_offsets(cols, D1, sx_d0, sx_d1, COL2)[None, :]
                acc += tl.load(x_ptr + x_offs, mask=mask, other=0.0).to(tl.float32)
            mean = tl.sum(acc, axis=1) / D
        acc = tl.zeros([ROWS, BLOCK_D], dtype=tl.float32)
        for d0 in range(0, D, BLOCK_D):
            cols = d0 + tl.arange(0, BLOCK_D)
            mask = row_ok[:, None] & (cols < D)[None, :]
            x_offs = x_rows[:, None] + _strided_offsets(cols, D1, sx_d0, sx_d1, COL2)[None, :]
            x = tl.load(x_ptr + x_offs, mask=mask, other=0.0).to(tl.float32)
            if IS_RMS:
                xc = x
            else:
                xc = tl.where(mask, x - mean[:, None], 0.0)
            acc += xc * xc
        rstd = tl.rsqrt(tl.sum(acc, axis=1) / D + eps)
        for d0 in range(0, D, BLOCK_D):
            cols = d0 + tl.arange(0, BLOCK_D)
            col_ok = cols < D
            mask = row_ok[:, None] & col_ok[None, :]
            x_offs = x_rows[:, None] + _strided_offsets(cols, D1, sx_d0, sx_d1, COL2)[None, :]
            x = tl.load(x_ptr + x_offs, mask=mask, other=0.0).to(tl.float32)
            if IS_RMS:
                y = x * rstd[:, None]
            else:
                y = (x - mean[:, None]) * rstd[:, None]
            if HAS_W:
                y = y * _load_param(w_row, cols, col_ok, sw_d)[None, :]
            if HAS_B:
                y = y + _load_param(bias_row, cols, col_ok, sbias_d)[None, :]
            y = activate(y, ACTIVATION)
            y_offs = y_rows[:, None] + _strided_offsets(cols, D1, sy_d0, sy_d1, COL2)[None, :]
            tl.store(y_ptr + y_offs, y.to(y_ptr.dtype.element_ty), mask=mask)

    stats = bi * M + rows
    if not IS_RMS:
        tl.store(mean_ptr + stats, mean, mask=row_ok)
    tl.store(rstd_ptr + stats, rstd, mask=row_ok)


@triton.jit
def _norm_bwd_kernel(
    gy_ptr,  # [B, M, D] through strides (rows M0 x M1, columns D0 x D1)
    x_ptr,  # [B, M, D] through x's strides
    gx_ptr,  # [B, M, D] through grad_x's strides
    w_ptr,  # [B, D]
    bias_ptr,  # [B, D] (read only to recompute z for the activation)
    mean_ptr,  # [B, M] float32, contiguous
    rstd_ptr,  # [B, M] float32, contiguous
    pw_ptr,  # [B, P, D] float32: per-chunk partial sums of grad_y * xhat
    pb_ptr,  # [B, P, D] float32: per-chunk partial sums of grad_y
    M, M1, D, D1, CHUNK, P,
    sg_b, sg_m0, sg_m1, sg_d0, sg_d1,
    sx_b, sx_m0, sx_m1, sx_d0, sx_d1,
    sgx_b, sgx_m0, sgx_m1, sgx_d0, sgx_d1,
    sw_b, sw_d, sbias_b, sbias_d,
    IS_RMS: tl.constexpr,
    HAS_W: tl.constexpr,
    HAS_B: tl.constexpr,
    ACTIVATION: tl.constexpr,
    HAS_DX: tl.constexpr,
    HAS_DW: tl.constexpr,
    HAS_DB: tl.constexpr,
    ROW2: tl.constexpr,
    COL2: tl.constexpr,
    BLOCK_D: tl.constexpr,
    ONE_BLOCK: tl.constexpr,
    TILE: tl.constexpr,
):
    ROWS: tl.constexpr = (TILE + BLOCK_D - 1) // BLOCK_D
    pid = tl.program_id(0)
    bi = (pid // P).to(tl.int64)
    chunk = pid % P
    row_start = chunk * CHUNK
    row_end = tl.minimum(row_start + CHUNK, M)
    w_row = w_ptr + bi * sw_b
    bias_row = bias_ptr + bi * sbias_b
    # this program's own row of the partial buffers: nobody else reads or writes it
    pw_row = pw_ptr + (bi * P + chunk) * D
    pb_row = pb_ptr + (bi * P + chunk) * D

    if ONE_BLOCK:
        cols = tl.arange(0, BLOCK_D)
        col_ok = cols < D
        g_cols = _strided_offsets(cols, D1, sg_d0, sg_d1, COL2)
        x_cols = _strided_offsets(cols, D1, sx_d0, sx_d1, COL2)
        gx_cols = _strided_offsets(cols, D1, sgx_d0, sgx_d1, COL2)
        if HAS_W:
            w = _load_param(w_row, cols, col_ok, sw_d)
        # Parameter-gradient sums stay 2-D across the chunk and are reduced
        # over rows once at the end.
        acc_w = tl.zeros([ROWS, BLOCK_D], dtype=tl.float32)
        acc_b = tl.zeros([ROWS, BLOCK_D], dtype=tl.float32)
        for r0 in range(row_start, row_end, ROWS):
            rows = r0 + tl.arange(0, ROWS)
            row_ok = rows < row_end
            mask = row_ok[:, None] & col_ok[None, :]
            stats = bi * M + rows
            rstd = tl.load(rstd_ptr + stats, mask=row_ok, other=0.0)
            x_rows = bi * sx_b + _strided_offsets(rows, M1, sx_m0, sx_m1, ROW2)
            g_rows = bi * sg_b + _strided_offsets(rows, M1, sg_m0, sg_m1, ROW2)
            x = tl.load(x_ptr + x_rows[:, None] + x_cols[None, :], mask=mask, other=0.0).to(tl.float32)
            gy = tl.load(gy_ptr + g_rows[:, None] + g_cols[None, :], mask=mask, other=0.0).to(tl.float32)
            if IS_RMS:
                xhat = x * rstd[:, None]
            else:
                mean = tl.load(mean_ptr + stats, mask=row_ok, other=0.0)
                xhat = tl.where(mask, (x - mean[:, None]) * rstd[:, None], 0.0)
            gy = _norm_activation_grad(gy, xhat, w_row, bias_row, cols, col_ok, sw_d, sbias_d,
                                       HAS_W, HAS_B, ACTIVATION)
            if HAS_DX:
                if HAS_W:
                    g = gy * w[None, :]
                else:
                    g = gy
                c_xhat = tl.sum(g * xhat, axis=1) / D
                if IS_RMS:
                    gx = (g - xhat * c_xhat[:, None]) * rstd[:, None]
                else:
                    c_g = tl.sum(g, axis=1) / D
                    gx = (g - c_g[:, None] - xhat * c_xhat[:, None]) * rstd[:, None]
                gx_rows = bi * sgx_b + _strided_offsets(rows, M1, sgx_m0, sgx_m1, ROW2)
                tl.store(gx_ptr + gx_rows[:, None] + gx_cols[None, :],
                         gx.to(gx_ptr.dtype.element_ty), mask=mask)
            if HAS_DW:
                acc_w += gy * xhat
            if HAS_DB:
                acc_b += gy
        if HAS_DW:
            tl.store(pw_row + cols, tl.sum(acc_w, axis=0), mask=col_ok)
        if HAS_DB:
            tl.store(pb_row + cols, tl.sum(acc_b, axis=0), mask=col_ok)
    else:
        for r0 in range(row_start, row_end, ROWS):
            rows = r0 + tl.arange(0, ROWS)
            row_ok = rows < row_end
            stats = bi * M + rows
            rstd = tl.load(rstd_ptr + stats, mask=row_ok, other=0.0)
            if IS_RMS:
                mean = rstd  # not read
            else:
                mean = tl.load(mean_ptr + stats, mask=row_ok, other=0.0)
            x_rows = bi * sx_b + _strided_offsets(rows, M1, sx_m0, sx_m1, ROW2)
            g_rows = bi * sg_b + _strided_offsets(rows, M1, sg_m0, sg_m1, ROW2)
            if HAS_DX:
                # the row means of g * xhat and g, before any grad_x can be written
                acc_gx = tl.zeros([ROWS, BLOCK_D], dtype=tl.float32)
                acc_g = tl.zeros([ROWS, BLOCK_D], dtype=tl.float32)
                for d0 in range(0, D, BLOCK_D):
                    cols, col_ok, mask, xhat, g = _swept_block(
                        x_ptr, gy_ptr, x_rows, g_rows, row_ok, d0, mean, rstd, w_row, bias_row,
                        D, D1, sx_d0, sx_d1, sg_d0, sg_d1, sw_d, sbias_d,
                        IS_RMS, HAS_W, HAS_B, ACTIVATION, COL2, BLOCK_D,
                    )
                    if HAS_W:
                        g = g * _load_param(w_row, cols, col_ok, sw_d)[None, :]
                    acc_gx += g * xhat
                    acc_g += g
                c_xhat = tl.sum(acc_gx, axis=1) / D
                c_g = tl.sum(acc_g, axis=1) / D
            for d0 in range(0, D, BLOCK_D):
                cols, col_ok, mask, xhat, gy = _swept_block(
                    x_ptr, gy_ptr, x_rows, g_rows, row_ok, d0, mean, rstd, w_row, bias_row,
                    D, D1, sx_d0, sx_d1, sg_d0, sg_d1, sw_d, sbias_d,
                    IS_RMS, HAS_W, HAS_B, ACTIVATION, COL2, BLOCK_D,
                )
                if HAS_DX:
                    if HAS_W:
                        g = gy * _load_param(w_row, cols, col_ok, sw_d)[None, :]
                    else:
                        g = gy
                    if IS_RMS:
                        gx = (g - xhat * c_xhat[:, None]) * rstd[:, None]
                    else:
                        gx = (g - c_g[:, None] - xhat * c_xhat[:, None]) * rstd[:, None]
                    gx_rows = bi * sgx_b + _strided_offsets(rows, M1, sgx_m0, sgx_m1, ROW2)
                    gx_offs = gx_rows[:, None] + _strided_offsets(cols, D1, sgx_d0, sgx_d1, COL2)[None, :]
                    tl.store(gx_ptr + gx_offs, gx.to(gx_ptr.dtype.element_ty), mask=mask)
                # The chunk's partial sums for these columns live in this
                # program's partial row (too long for registers): read-add-write,
                # starting from nothing on the chunk's first row tile.
                prev_cols = tl.where(r0 > row_start, D, 0)
                if HAS_DW:
                    prev = tl.load(pw_row + cols, mask=cols < prev_cols, other=0.0)
                    tl.store(pw_row + cols, prev + tl.sum(gy * xhat, axis=0), mask=col_ok)
                if HAS_DB:
                    prev = tl.load(pb_row + cols, mask=cols < prev_cols, other=0.0)
                    tl.store(pb_row + cols, prev + tl.sum(gy, axis=0), mask=col_ok)
            # the next row tile reads back those partial rows
            tl.debug_barrier()


@triton.jit
def _sum_partials_kernel(
    pw_ptr,  # [B, P, D] float32
    pb_ptr,  # [B, P, D] float32
    gw_ptr,  # [B, D] contiguous, grad_weight's dtype
    gb_ptr,  # [B, D] contiguous, grad_bias's dtype
    P, D,
    HAS_DW: tl.constexpr,
    HAS_DB: tl.constexpr,
    BLOCK_R: tl.constexpr,
):
    bi, cols, col_ok = column_block(tl.program_id(0), D, BLOCK_R)
    pw = pw_ptr + bi * P * D + cols
    pb = pb_ptr + bi * P * D + cols
    acc_w = tl.zeros([BLOCK_R], dtype=tl.float32)
    acc_b = tl.zeros([BLOCK_R], dtype=tl.float32)
    # One column's partials are added one after another in chunk order, so the
    # result does not depend on the launch config.
    for _ in range(0, P):
        if HAS_DW:
            acc_w += tl.load(pw, mask=col_ok, other=0.0)
            pw += D
        if HAS_DB:
            acc_b += tl.load(pb, mask=col_ok, other=0.0)
            pb += D
    if HAS_DW:
        tl.store(gw_ptr + bi * D + cols, acc_w.to(gw_ptr.dtype.element_ty), mask=col_ok)
    if HAS_DB:
        tl.store(gb_ptr + bi * D + cols, acc_b.to(gb_ptr.dtype.element_ty), mask=col_ok)


# Configs aimed at Hopper (run on Ampere too): TILE elements per program,
# warps scaled so a thread holds about 8-16 float32 values per live tile.
_fwd = Tuned(
    _norm_fwd_kernel,
    [
        triton.Config({"TILE": 1024}, num_warps=4),
        triton.Config({"TILE": 2048}, num_warps=4),
        triton.Config({"TILE": 4096}, num_warps=8),
        triton.Config({"TILE": 8192}, num_warps=16),
    ],
    key=["D", "IS_RMS", "ONE_BLOCK"],
    interpret_config=triton.Config({"TILE": 32}),
)
# The backward keeps about six tiles live (x, grad_y, xhat, g, two sums).
_bwd = Tuned(
    _norm_bwd_kernel,
    [
        triton.Config({"TILE": 1024}, num_warps=4),
        triton.Config({"TILE": 2048}, num_warps=8),
        triton.Config({"TILE": 4096}, num_warps=8),
        triton.Config({"TILE": 4096}, num_warps=16),
    ],
    key=["D", "IS_RMS", "HAS_DX", "ONE_BLOCK"],
    interpret_config=triton.Config({"TILE": 32}),
)
_sum_partials = Tuned(
    _sum_partials_kernel,
    [
        triton.Config({"BLOCK_R": 256}, num_warps=2),
        triton.Config({"BLOCK_R": 1024}, num_warps=4),
    ],
    key=["D"],
    interpret_config=triton.Config({"BLOCK_R": 16}),
)

# Rows up to _ONE_BLOCK_MAX_D elements are held whole; longer ones are swept in
# _SWEEP_BLOCK_D blocks (a 4096-wide sweep block runs out of registers in the
# backward). The interpreter uses small blocks so that tests with small D
# exercise the sweep.
_ONE_BLOCK_MAX_D, _SWEEP_BLOCK_D = 4096, 1024
_INTERPRET_ONE_BLOCK_MAX_D, _INTERPRET_SWEEP_BLOCK_D = 16, 8
# backward programs per SM: enough to hide latency, few enough that the
# [B, P, D] partial buffers stay small next to x
_PROGRAMS_PER_SM = 4


def _param_2d(p: Tensor | None, B: int, D: int, dummy: Tensor) -> tuple[Tensor, int, int]:
    # parameters are small: a copy (for an odd layout) costs nothing that matters
    if p is None:
        return dummy, 0, 0
    p2 = p.reshape(B, D)
    return p2, p2.stride(0), p2.stride(1)


def _block_d(D: int) -> tuple[int, bool]:
    """(BLOCK_D, whether one block holds a whole row)."""
    if interpreting():
        one_max, sweep = _INTERPRET_ONE_BLOCK_MAX_D, _INTERPRET_SWEEP_BLOCK_D
    else:
        one_max, sweep = _ONE_BLOCK_MAX_D, _SWEEP_BLOCK_D
    block = triton.next_power_of_2(D)
    return (block, True) if block <= one_max else (sweep, False)


def _max_rows(tuned: Tuned, block_d: int) -> int:
    configs = [tuned.interpret_config] if interpreting() else tuned.configs
    return max(triton.cdiv(c.kwargs["TILE"], block_d) for c in configs)


def _num_programs(device: torch.device) -> int:
    if device.type != "cuda":  # the interpreter: a few programs, to exercise the partials
        return 2 * _PROGRAMS_PER_SM
    return _PROGRAMS_PER_SM * sm_count(device)


def _num_rows(x: Tensor, norm_ndim: int) -> int:
    return math.prod(x.shape[1 : x.dim() - norm_ndim])


# Registered for CUDA tensors and the dtypes the kernels compute in (auto gives
# float64 to the torch path). auto picks a kernel only where a committed GPU
# benchmark shows it faster: layer norm forward and backward are, on an H100,
# 4-11x the torch path in kernel time and 1.8-3.8x eager (geomean per dtype;
# bench/results/h100_2026-11-22/). RMS norm has not been benchmarked yet.
def _implements(op: str, auto: bool):
    return _backend.implements(op, "triton", device_types=("cuda",), auto=auto, dtypes=KERNEL_DTYPES)


# ---- forward ------------------------------------------------------------------

def _forward_outputs(x: Tensor, norm_ndim: int) -> tuple[Tensor, Tensor, Tensor]:
    """(y, mean, rstd) as the forward returns them, unwritten (all of it for an empty x:
    nothing to launch)."""
    stats = (x.shape[0], _num_rows(x, norm_ndim))
    return torch.empty_like(x), x.new_empty(stats, dtype=torch.float32), x.new_empty(stats, dtype=torch.float32)


def _empty_forward(x: Tensor, norm_ndim: int) -> tuple[Tensor, Tensor, Tensor]:
    """(y, mean, rstd) of an empty x, which launches nothing: the statistics of rows of no
    elements (``S`` empty) are NaN, as the torch backend's (not uninitialised memory);
    without rows they are empty."""
    y, mean, rstd = _forward_outputs(x, norm_ndim)
    return y, mean.fill_(math.nan), rstd.fill_(math.nan)


def _forward(x: Tensor, weight, bias, norm_ndim: int, eps: float, is_rms: bool, activation: str = "none"):
    B = x.shape[0]
    M = _num_rows(x, norm_ndim)
    D = math.prod(x.shape[x.dim() - norm_ndim:])
    y, mean, rstd = _forward_outputs(x, norm_ndim)
    (x_in,), y_out, (M1, row2, D1, col2, (sx, sy)) = addressed(lambda ts: _layout(ts, norm_ndim), [x], y)
    w, sw_b, sw_d = _param_2d(weight, B, D, x)
    b, sb_b, sb_d = _param_2d(bias, B, D, x)
    block_d, one_block = _block_d(D)

    def grid(meta):
        return (B * triton.cdiv(M, triton.cdiv(meta["TILE"], block_d)),)

    _fwd[grid](
        x_in, y_out, w, b, mean, rstd,
        M, M1, D, D1,
        *sx, *sy,
        sw_b, sw_d, sb_b, sb_d,
        eps,
        IS_RMS=is_rms, HAS_W=weight is not None, HAS_B=bias is not None, ACTIVATION=activation,
        ROW2=row2, COL2=col2, BLOCK_D=block_d, ONE_BLOCK=one_block,
    )
    if y_out is not y:
        y.copy_(y_out)
    return y, mean, rstd


@_implements("array_layer_norm", auto=True)
def array_layer_norm(
    x: Tensor, weight: Tensor | None, bias: Tensor | None, norm_ndim: int, eps: float,
    activation: str = "none",
) -> tuple[Tensor, Tensor, Tensor]:
    """Layer norm of B models: see :mod:`hfkern.ops.layer_norm`.

    x ``[B, *, *S]`` (float32/float16/bfloat16, any strides), weight/bias
    ``[B, *S]`` or None, ``activation`` "none", "relu" or "gelu". Returns y (x's
    dtype, ``empty_like(x)`` layout) and mean, rstd (float32 ``[B, M]``, contiguous).
    """
    check_tensors("array_layer_norm", x, weight, bias)
    if x.numel() == 0:
        return _empty_forward(x, norm_ndim)
    return _forward(x, weight, bias, norm_ndim, eps, is_rms=False, activation=activation)


@_implements("array_rms_norm", auto=False)
def array_rms_norm(
    x: Tensor, weight: Tensor | None, norm_ndim: int, eps: float
) -> tuple[Tensor, Tensor]:
    """RMS norm of B models: see :mod:`hfkern.ops.layer_norm`.

    x ``[B, *, *S]``, weight ``[B, *S]`` or None. Returns y and rstd (float32 ``[B, M]``).
    """
    check_tensors("array_rms_norm", x, weight)
    if x.numel() == 0:
        return _empty_forward(x, norm_ndim)[::2]
    y, _, rstd = _forward(x, weight, None, norm_ndim, eps, is_rms=True)
    return y, rstd


# ---- backward -----------------------------------------------------------------

def _backward(grad_y, x, weight, mean, rstd, norm_ndim: int, mask: Sequence[bool], is_rms: bool,
              bias: Tensor | None = None, activation: str = "none"):
    """(grad_x, grad_weight, grad_bias) as the ops return them; mask has three entries."""
    want_dx, want_dw, want_db = (bool(m) for m in mask)
    B = x.shape[0]
    M = _num_rows(x, norm_ndim)
    S = x.shape[x.dim() - norm_ndim:]
    D = math.prod(S)
    grad_x, grad_w, grad_b = backward_outputs(x, weight, mask, (B, *S), launch=True)
    if x.numel() == 0 or not any(mask):
        return grad_x, grad_w, grad_b

    (gy_in, x_in), gx_out, lay = addressed(lambda ts: _layout(ts, norm_ndim), [grad_y, x],
                                           grad_x if want_dx else None)
    M1, row2, D1, col2, strides = lay
    sg, sx = strides[0], strides[1]
    sgx = strides[2] if want_dx else [0] * 5
    w, sw_b, sw_d = _param_2d(weight, B, D, x)
    # the bias is read only to recompute z for the activation's derivative
    bias = bias if activation != "none" else None
    b, sb_b, sb_d = _param_2d(bias, B, D, x)
    rstd = rstd.reshape(B, M).contiguous()
    mean = rstd if mean is None else mean.reshape(B, M).contiguous()

    block_d, one_block = _block_d(D)
    # A fixed partition of each model's rows into P chunks (multiples of the
    # tallest tile any config uses), so the partial sums do not depend on the
    # config the autotuner picks.
    align = _max_rows(_bwd, block_d)
    per_model = max(1, triton.cdiv(_num_programs(x.device), B))
    chunk = triton.cdiv(triton.cdiv(M, per_model), align) * align
    P = triton.cdiv(M, chunk)
    n_partials = int(want_dw) + int(want_db)
    pw = pb = x  # placeholders for pointers the kernel does not touch
    if n_partials:
        # no memset: each chunk's first row tile stores its partials outright
        partials = x.new_empty((n_partials, B, P, D), dtype=torch.float32)
        pw, pb = partials[0], partials[-1]

    _bwd[(B * P,)](
        gy_in, x_in, gx_out if want_dx else x, w, b, mean, rstd, pw, pb,
        M, M1, D, D1, chunk, P,
        *sg, *sx, *sgx,
        sw_b, sw_d, sb_b, sb_d,
        IS_RMS=is_rms, HAS_W=weight is not None, HAS_B=bias is not None, ACTIVATION=activation,
        HAS_DX=want_dx, HAS_DW=want_dw, HAS_DB=want_db,
        ROW2=row2, COL2=col2, BLOCK_D=block_d, ONE_BLOCK=one_block,
    )
    if want_dx and gx_out is not grad_x:
        grad_x.copy_(gx_out)
    if n_partials:
        def grid(meta):
            return (B * triton.cdiv(D, meta["BLOCK_R"]),)

        _sum_partials[grid](
            pw, pb, grad_w if want_dw else pw, grad_b if want_db else pb,
            P, D,
            HAS_DW=want_dw, HAS_DB=want_db,
        )
    return grad_x, grad_w, grad_b


@_implements("array_layer_norm_backward", auto=True)
def array_layer_norm_backward(
    grad_y: Tensor,
    x: Tensor,
    weight: Tensor | None,
    mean: Tensor,
    rstd: Tensor,
    norm_ndim: int,
    output_mask: Sequence[bool],
    bias: Tensor | None = None,
    activation: str = "none",
) -> tuple[Tensor, Tensor, Tensor]:
    """(grad_x, grad_weight, grad_bias): see :mod:`hfkern.ops.layer_norm`.

    grad_y, x ``[B, *, *S]`` (any strides), weight and bias ``[B, *S]`` or None,
    mean and rstd float32 ``[B, M]``, ``activation`` the forward's. An output
    whose ``output_mask`` entry is False is an empty ``[0]`` tensor.
    """
    check_tensors("array_layer_norm_backward", x, grad_y, weight, bias)
    return _backward(grad_y, x, weight, mean, rstd, norm_ndim, output_mask, is_rms=False,
                     bias=bias, activation=activation)


@_implements("array_rms_norm_backward", auto=False)
def array_rms_norm_backward(
    grad_y: Tensor,
    x: Tensor,
    weight: Tensor | None,
    rstd: Tensor,
    norm_ndim: int,
    output_mask: Sequence[bool],
) -> tuple[Tensor, Tensor]:
    """(grad_x, grad_weight): see :mod:`hfkern.ops.layer_norm`.

    grad_y, x ``[B, *, *S]``, weight ``[B, *S]`` or None, rstd float32 ``[B, M]``.
    """
    check_tensors("array_rms_norm_backward", x, grad_y, weight)
    grad_x, grad_w, _ = _backward(
        grad_y, x, weight, None, rstd, norm_ndim, [*output_mask, False], is_rms=True
    )
    return grad_x, grad_w
