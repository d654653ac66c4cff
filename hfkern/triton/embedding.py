"""Triton kernels for the array embedding: the gather forward and the dense backward.

The launchers take exactly the arguments of the ops in :mod:`hfkern.ops.embedding`
(which states the op contract; its torch implementations are the oracle) and
register themselves as the ``triton`` implementations. The sparse backward and
the renorm stay torch-only: neither reduces across indices, and aten's kernels
for them are already single passes.

Shapes::

    weight    [B, V, D]  any strides
    indices   [B, *]     int32 or int64, any strides (stride 0 on dim 0: shared)
    out       [B, *, D]  contiguous
    grad_out  [B, *, D]  any strides
    grad_w    [B, V, D]  contiguous

Both kernels address the ``*`` dims of indices and grad_out through their
strides, collapsed to at most two dims ``[M, L]`` (a contiguous ``[B, N, L]``
becomes ``[B, N*L]``; the ``[N, B, L]`` memory an array layer produces stays
``[B, N, L]``), so strided inputs are read in place. Only a layout whose ``*``
dims cannot be collapsed to two is copied first.

The backward is deterministic without atomics: each model's indices are
sorted once (stably, by torch), ``searchsorted`` turns the sorted keys into one
segment ``[start, end)`` per table row, and each program owns a block of rows of
one group of models and sums every row's segment in sorted order, one grad row
after another. Every row of the gradient is written exactly once (zero where no
index hits it and on the padding row), so the output needs no zero fill.

A row hit more than ``_CHUNK`` times (a frequent token: text is Zipf-like, and
its most frequent token can take a tenth of a batch) would make its program
add thousands of rows one after another while the rest of the grid idles. Such
a row's segment is cut into chunks of ``_CHUNK`` hits; a first kernel sums each
chunk (one program per chunk, a fixed-shape reduction) into an fp32 partial, and
the row's program then adds its chunks' partials in order. Chunk tables are
built on the device (no host sync) for an upper bound of chunks; programs past
the last chunk return at once.

Either way the order of every addition is fixed by the sorted indices and the
chunk kernel's untuned shape (``_CHUNK``, ``_CHUNK_SUB``, ``_CHUNK_WARPS``),
never by the tile shape, unroll or warp count the autotuner picks, so results
are bitwise reproducible across runs and processes.
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from .. import _backend
from .._array import lookup_dims
from ._common import Tuned, tl_dtype_ok

__all__ = ["array_embedding", "array_embedding_backward"]

_INT32_MAX = torch.iinfo(torch.int32).max
# Widest D slice one program holds; wider rows are split over grid dim 1, which
# also gives small-vocabulary, wide-row problems enough programs.
_MAX_BLOCK_D = 256
# Grad rows a backward program loads before adding them; a row's segment is a
# chain of dependent adds, and issuing several loads first hides their latency.
# Results do not depend on it (masked loads add +0.0, which leaves any fp32 sum
# unchanged since the running sum starts at +0.0 and can never become -0.0).
_UNROLL = 4
# Rows hit more often than this are summed in chunks of this many hits by
# _array_embedding_chunk_kernel first (a power of two), one chunk per program.
_CHUNK = 64
_CHUNK_SUB = 16  # hits per step of a chunk sum: [16, 256] fp32 over 8 warps, no spills
_CHUNK_WARPS = 8


# ---- kernels ------------------------------------------------------------------


@triton.jit
def _array_embedding_fwd_kernel(
    weight_ptr,  # [B, V, D]
    idx_ptr,  # [B, M, L] indices, * dims collapsed to (M, L); stride 0 on B when shared
    out_ptr,  # [B, n, D] contiguous, n = M * L
    B,
    n,
    L,
    D,
    s_wb,
    s_wv,
    s_wd,
    s_ib,
    s_im,
    s_il,
    n_key,  # autotune key only: next power of two of n
    SHARED: tl.constexpr,
    BLOCK_D: tl.constexpr,
    TILE: tl.constexpr,
    MODELS: tl.constexpr,
):
    # A tile of TILE elements: BLOCK_N positions x BLOCK_D features, for MODELS models.
    BLOCK_N: tl.constexpr = (TILE + BLOCK_D - 1) // BLOCK_D
    pid_n = tl.program_id(0)
    pid_d = tl.program_id(1)
    pid_b = tl.program_id(2)
    p = pid_n.to(tl.int64) * BLOCK_N + tl.arange(0, BLOCK_N)
    d = pid_d * BLOCK_D + tl.arange(0, BLOCK_D)
    mask_p = p < n
    mask_d = d < D
    i_off = (p // L) * s_im + (p % L) * s_il
    if SHARED:
        # One index tensor for all models: load it once, gather from MODELS tables.
        rows = tl.load(idx_ptr + i_off, mask=mask_p, other=0).to(tl.int64) * s_wv
    for i in tl.static_range(MODELS):
        b = pid_b * MODELS + i
        b64 = b.to(tl.int64)
        # The last group may run past B: its extra models see no positions.
        mask_pb = p < tl.where(b < B, n, 0)
        if not SHARED:
            rows = tl.load(idx_ptr + b64 * s_ib + i_off, mask=mask_pb, other=0).to(tl.int64) * s_wv
        mask = mask_pb[:, None] & mask_d[None, :]
        vals = tl.load(weight_ptr + b64 * s_wb + rows[:, None] + (d * s_wd)[None, :], mask=mask)
        tl.store(out_ptr + (b64 * n + p)[:, None] * D + d[None, :], vals, mask=mask)


@triton.jit
def _array_embedding_bwd_kernel(
    grad_ptr,  # [B, M, L, D] grad_out, * dims collapsed to (M, L)
    perm_ptr,  # [B * n] ([n] when shared): the j-th sorted index's position within its model
    bounds_ptr,  # [B * V + 1] ([V + 1] when shared): row b*V+v's hits are perm[bounds[b*V+v]:bounds[b*V+v+1]]
    out_ptr,  # [B, V, D] contiguous
    B,
    V,
    L,
    D,
    padding_idx,
    s_gb,
    s_gm,
    s_gl,
    s_gd,
    s_bb,  # bounds stride per model: V, or 0 when the indices are shared
    chunk_off_ptr,  # like bounds (without the last entry): a long row's first chunk
    part_ptr,  # [chunks, PB, D] fp32 chunk sums of long rows
    PB,  # models per chunk in part: B when the indices are shared, else 1
    s_pm,  # 1 when the indices are shared (part holds every model's sum), else 0
    n_key,  # autotune key only: next power of two of n
    SCALE: tl.constexpr,
    LONG: tl.constexpr,  # some row may have more than CHUNK hits
    CHUNK: tl.constexpr,
    BLOCK_D: tl.constexpr,
    UNROLL: tl.constexpr,
    TILE: tl.constexpr,
    MODELS: tl.constexpr,
):
    BLOCK_V: tl.constexpr = (TILE + BLOCK_D - 1) // BLOCK_D
    pid_v = tl.program_id(0)
    pid_d = tl.program_id(1)
    pid_b = tl.program_id(2)
    v = pid_v.to(tl.int64) * BLOCK_V + tl.arange(0, BLOCK_V)
    d = pid_d * BLOCK_D + tl.arange(0, BLOCK_D)
    mask_d = d < D
    for i in tl.static_range(MODELS):
        b = pid_b * MODELS + i
        b64 = b.to(tl.int64)
        # The last group may run past B: its extra models see no rows.
        mask_vb = v < tl.where(b < B, V, 0)
        seg = bounds_ptr + b64 * s_bb + v
        start = tl.load(seg, mask=mask_vb, other=0)
        end = tl.load(seg + 1, mask=mask_vb, other=0)
        # The padding row gets no gradient: an empty segment.
        cnt = tl.where(v == padding_idx, 0, end - start)
        if LONG:
            # Rows of more than CHUNK hits add their chunk sums instead.
            n_hits = tl.where(cnt > CHUNK, 0, cnt)
        else:
            n_hits = cnt
        g_base = grad_ptr + b64 * s_gb + (d * s_gd)[None, :]
        acc = tl.zeros([BLOCK_V, BLOCK_D], dtype=tl.float32)
        longest = tl.max(n_hits, axis=0)
        for k in range(0, longest, UNROLL):
            for u in tl.static_range(UNROLL):
                hit = (k + u) < n_hits
                pos = tl.load(perm_ptr + start + k + u, mask=hit, other=0)
                g = tl.load(
                    g_base + ((pos // L) * s_gm + (pos % L) * s_gl)[:, None],
                    mask=hit[:, None] & mask_d[None, :],
                    other=0.0,
                )
                acc += g.to(tl.float32)
        if LONG:
            n_chunks = tl.where(cnt > CHUNK, (cnt + CHUNK - 1) // CHUNK, 0)
            first = tl.load(chunk_off_ptr + b64 * s_bb + v, mask=mask_vb & (n_chunks > 0), other=0)
            p_base = part_ptr + b64 * s_pm * D + d[None, :]
            for k in range(0, tl.max(n_chunks, axis=0)):
                ok = k < n_chunks
                acc += tl.load(p_base + ((first + k).to(tl.int64) * PB * D)[:, None],
                               mask=ok[:, None] & mask_d[None, :], other=0.0)
        if SCALE:
            acc = acc / tl.maximum(cnt, 1).to(tl.float32)[:, None]
        mask = mask_vb[:, None] & mask_d[None, :]
        tl.store(
            out_ptr + (b64 * V + v)[:, None] * D + d[None, :],
            acc.to(out_ptr.dtype.element_ty),
            mask=mask,
        )


@triton.jit
def _array_embedding_chunk_kernel(
    grad_ptr,  # [B, M, L, D] grad_out, * dims collapsed to (M, L)
    perm_ptr,  # as in _array_embedding_bwd_kernel
    bounds_ptr,
    chunk_row_ptr,  # [chunks] the sorted-key row each chunk belongs to (n_rows past the last chunk)
    chunk_off_ptr,  # [n_rows] a row's first chunk
    part_ptr,  # [chunks, PB, D] fp32 out
    n_rows,  # rows of the sorted keys: B * V, or V when the indices are shared
    V,
    L,
    D,
    PB,
    s_gb,
    s_gm,
    s_gl,
    s_gd,
    SHARED: tl.constexpr,
    CHUNK: tl.constexpr,
    SUB: tl.constexpr,  # hits loaded per step, a power of two dividing CHUNK
    BLOCK_D: tl.constexpr,
):
    # One chunk of CHUNK consecutive hits of one long row, one D slice, one model
    # (grid dim 2 runs over the models when the indices are shared).
    c = tl.program_id(0).to(tl.int64)
    pid_d = tl.program_id(1)
    row = tl.load(chunk_row_ptr + c).to(tl.int64)
    if row < n_rows:
        if SHARED:
            b = tl.program_id(2).to(tl.int64)
        else:
            b = row // V
        j = c - tl.load(chunk_off_ptr + row)
        start = tl.load(bounds_ptr + row) + j * CHUNK
        end = tl.load(bounds_ptr + row + 1)
        d = pid_d * BLOCK_D + tl.arange(0, BLOCK_D)
        mask_d = d < D
        g_base = grad_ptr + b * s_gb + (d * s_gd)[None, :]
        # SUB hits at a time (a whole [CHUNK, BLOCK_D] tile of gather addresses
        # would spill), into SUB running sums folded at the end.
        acc = tl.zeros([SUB, BLOCK_D], dtype=tl.float32)
        for k0 in range(0, CHUNK, SUB):
            k = start + k0 + tl.arange(0, SUB)
            hit = k < end
            pos = tl.load(perm_ptr + k, mask=hit, other=0)
            g = tl.load(
                g_base + ((pos // L) * s_gm + (pos % L) * s_gl)[:, None],
                mask=hit[:, None] & mask_d[None, :],
                other=0.0,
            )
            acc += g.to(tl.float32)
        # A fixed launch configuration, so this reduction's order never changes.
        total = tl.sum(acc, axis=0)
        tl.store(part_ptr + (c * PB + tl.program_id(2)) * D + d, total, mask=mask_d)


# Aimed at H100/H200 (also valid on Ampere): TILE is elements per model per
# program; MODELS > 1 lets one program reuse a shared index block across tables.
# Every element of a gathered tile carries a 64-bit address, so a thread holds
# at most 16 elements per tile: larger tiles (8192 forward, 4096 backward, or
# 4 warps at 4096 / 2048) spill registers to local memory on sm_90 and sm_80
# (ptxas via tests/triton/offline_compile.py --resources). The backward keeps an
# fp32 accumulator plus UNROLL loaded tiles, hence its smaller tiles.
_FWD_CONFIGS = [
    triton.Config({"TILE": tile, "MODELS": models}, num_warps=warps)
    for tile, warps in ((2048, 4), (2048, 8), (4096, 8))
    for models in (1, 4)
]
_BWD_CONFIGS = [
    triton.Config({"TILE": tile, "MODELS": models}, num_warps=warps)
    for tile, warps in ((1024, 4), (1024, 8), (2048, 8))
    for models in (1, 4)
]
# Small tiles so interpreter tests cover several programs per dim, and a model
# group of 2 so B = 3 has a partly filled group.
_INTERPRET = triton.Config({"TILE": 64, "MODELS": 2}, num_warps=1)

_fwd = Tuned(
    _array_embedding_fwd_kernel, _FWD_CONFIGS, key=["B", "D", "n_key", "SHARED"], interpret_config=_INTERPRET
)
_bwd = Tuned(
    _array_embedding_bwd_kernel, _BWD_CONFIGS, key=["B", "V", "D", "n_key", "SCALE"], interpret_config=_INTERPRET
)
# One fixed config: the chunk sum's reduction order must not depend on tuning.
_CHUNK_CONFIG = triton.Config({}, num_warps=_CHUNK_WARPS)
_chunk_sums = Tuned(_array_embedding_chunk_kernel, [_CHUNK_CONFIG], key=[], interpret_config=_CHUNK_CONFIG)


# ---- launchers ----------------------------------------------------------------


def _check_dtype(name: str, t: torch.Tensor) -> None:
    if not tl_dtype_ok(t):
        raise TypeError(
            f"the Triton array embedding needs {name} of dtype float32, float16 or bfloat16, got {t.dtype}"
        )


# Registered for CUDA tensors; auto=False: auto picks them only once a GPU
# benchmark shows them faster than the torch path.
@_backend.implements("array_embedding", "triton", device_types=("cuda",), auto=False)
def array_embedding(
    weight: torch.Tensor,
    indices: torch.Tensor,
    padding_idx: int = -1,
    scale_grad_by_freq: bool = False,
    sparse: bool = False,
) -> torch.Tensor:
    """``out[b, ...] = weight[b, indices[b, ...]]``.

    weight ``[B, V, D]``, indices ``[B, *]`` int32/int64 -> contiguous ``[B, *, D]``.
    The last three arguments only shape the backward and are ignored here.
    """
    _check_dtype("weight", weight)
    B, V, D = weight.shape
    out = torch.empty((*indices.shape, D), dtype=weight.dtype, device=weight.device)
    n = math.prod(indices.shape[1:])
    if out.numel() == 0:
        return out
    idx, L, s_im, s_il = lookup_dims(indices, n, 0)
    shared = idx.stride(0) == 0 or B == 1
    block_d = min(triton.next_power_of_2(D), _MAX_BLOCK_D)

    def grid(meta):
        block_n = triton.cdiv(meta["TILE"], block_d)
        return (triton.cdiv(n, block_n), triton.cdiv(D, block_d), triton.cdiv(B, meta["MODELS"]))

    _fwd[grid](
        weight, idx, out,
        B, n, L, D,
        *weight.stride(),
        idx.stride(0), s_im, s_il,
        triton.next_power_of_2(n),
        SHARED=shared,
        BLOCK_D=block_d,
    )
    return out


@_backend.implements("array_embedding_backward", "triton", device_types=("cuda",), auto=False)
def array_embedding_backward(
    grad_out: torch.Tensor,
    indices: torch.Tensor,
    num_weights: int,
    padding_idx: int,
    scale_grad_by_freq: bool,
) -> torch.Tensor:
    """Dense weight gradient ``[B, num_weights, D]`` (contiguous), deterministic.

    grad_out ``[B, *, D]``, indices ``[B, *]``. Row ``padding_idx`` (``-1``: none)
    gets zero; with ``scale_grad_by_freq`` each row's sum is divided by the number
    of times that model's indices hit it.
    """
    _check_dtype("grad_out", grad_out)
    B, D = grad_out.shape[0], grad_out.shape[-1]
    V = num_weights
    grad_w = torch.empty((B, V, D), dtype=grad_out.dtype, device=grad_out.device)
    if grad_w.numel() == 0:
        return grad_w
    n = indices[0].numel()
    grad, L, s_gm, s_gl = lookup_dims(grad_out, n, 1)

    shared = indices.stride(0) == 0 or B == 1
    models = 1 if shared else B
    key_dtype = torch.int64 if (indices.dtype == torch.int64 or models * V + 1 > _INT32_MAX) else torch.int32
    if shared:
        # One sort serves all B models.
        keys = indices[0].reshape(1, n).to(key_dtype)
    else:
        # Model b's rows are b*V + index, so the per-model sorted rows, read
        # flat, are sorted over all models and one searchsorted finds every
        # model's segments.
        offsets = torch.arange(0, B * V, V, dtype=key_dtype, device=indices.device).view(B, 1)
        keys = torch.empty((B, n), dtype=key_dtype, device=indices.device)
        torch.add(indices.reshape(B, n), offsets, out=keys)
    # Stable: equal indices keep their input order, which fixes the summation order.
    sorted_keys, perm = torch.sort(keys, dim=1, stable=True)
    rows = torch.arange(models * V + 1, dtype=key_dtype, device=indices.device)
    bounds = torch.searchsorted(sorted_keys.reshape(-1), rows)

    block_d = min(triton.next_power_of_2(D), _MAX_BLOCK_D)
    perm = perm.reshape(-1)
    g_strides = (grad.stride(0), s_gm, s_gl, grad.stride(-1))
    chunk_off, part, pb = _long_row_chunks(grad, perm, bounds, shared, B, V, L, D, padding_idx,
                                           g_strides, block_d)

    def grid(meta):
        block_v = triton.cdiv(meta["TILE"], block_d)
        return (triton.cdiv(V, block_v), triton.cdiv(D, block_d), triton.cdiv(B, meta["MODELS"]))

    _bwd[grid](
        grad, perm, bounds, grad_w,
        B, V, L, D, padding_idx,
        *g_strides,
        0 if shared else V,
        chunk_off, bounds if part is None else part, pb, 1 if shared else 0,
        triton.next_power_of_2(n),
        SCALE=bool(scale_grad_by_freq),
        LONG=part is not None,
        CHUNK=_CHUNK,
        BLOCK_D=block_d,
        UNROLL=_UNROLL,
    )
    return grad_w


def _long_row_chunks(grad, perm, bounds, shared, B, V, L, D, padding_idx, g_strides, block_d):
    """Chunk sums of the rows hit more than ``_CHUNK`` times.

    Returns (chunk offsets per sorted-key row, partial sums ``[chunks, PB, D]``
    float32, PB) or (bounds, None, 1) when no row can have that many hits.
    Nothing here waits for the device: the number of chunks is bounded by
    ``2 * hits / _CHUNK`` (each long row has over ``_CHUNK`` hits, so at most
    ``hits / _CHUNK`` rows are long, each with at most one partial chunk).
    """
    models = 1 if shared else B
    n = perm.numel() // models  # hits per model
    if n <= _CHUNK:
        return bounds, None, 1
    n_rows = models * V
    cnt = bounds[1:] - bounds[:-1]
    if padding_idx >= 0:
        cnt = cnt.view(models, V).clone()
        cnt[:, padding_idx] = 0  # never summed: no chunks
        cnt = cnt.view(-1)
    n_chunks = torch.where(cnt > _CHUNK, (cnt + _CHUNK - 1) // _CHUNK, 0)
    ends = torch.cumsum(n_chunks, 0)
    chunk_off = ends - n_chunks
    cap = 2 * models * n // _CHUNK + 1
    chunk_row = torch.searchsorted(ends, torch.arange(cap, device=bounds.device, dtype=ends.dtype),
                                   right=True)
    pb = B if shared else 1
    part = torch.empty((cap, pb, D), dtype=torch.float32, device=grad.device)
    _chunk_sums[(cap, triton.cdiv(D, block_d), pb)](
        grad, perm, bounds, chunk_row, chunk_off, part,
        n_rows, V, L, D, pb,
        *g_strides,
        SHARED=shared,
        CHUNK=_CHUNK,
        SUB=min(_CHUNK_SUB, _CHUNK),
        BLOCK_D=block_d,
    )
    return chunk_off, part, pb
