"""Triton kernels of hfkern::topk_select: the counting pass and the stable compaction.

The launcher implements the op of :mod:`hfkern.ops.topk` (which states the
contract) with the threshold search of :mod:`hfkern._topk`, the one every
backend runs: the sample and the bracket updates are torch ops on the device,
the kernels here do the two passes over the data. Counts are exact integers,
so the search takes the same steps as on the torch path and the selection is
identical to it, exact mode included (the search with ``cap = k`` instead of
``torch.topk``).

Kernels never do float arithmetic: they read ``x`` as bit patterns (int16,
int32 or int64 for the 16-, 32- and 64-bit dtypes), form the magnitude key
(sign bit cleared, every NaN clamped to ``inf_key + 1``) and copy the bit
patterns of the selected entries, so any float dtype, float64 included, is
served, and values are x's bit for bit.

Shapes::

    bits        [R, n]   contiguous bit patterns of x's rows
    candidates  [R, C]   thresholds of one counting pass, in the key dtype
    partial     [R, P, C] int32: per program, how many of its keys are >= each candidate
    gt, eq      [R, P]   int32: per program, its keys above / equal to the row's threshold
    values      [R, cap] bit patterns; indices [R, cap] int32

Both passes split a row into ``P`` programs of ``TILES`` consecutive tiles of
``BLOCK`` entries. The compaction is deterministic without atomics: a first
kernel counts each program's keys above and at the threshold, exclusive scans
over the programs (torch, :func:`hfkern._topk.compaction_offsets`) give each
program where its entries and its ties start, and the write kernel walks its
tiles in order, placing each kept entry at its program's offset plus its rank
(a ``tl.cumsum``) within the program.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from .. import _backend, _topk
from .._device import sm_count
from ._common import interpreting

__all__ = ["topk_select"]

# Entries per tile of the counting kernel; each is compared with C candidates at
# once ([BLOCK, C] in registers), so this is smaller than the compaction's tile.
_COUNT_BLOCK = 256
_COMPACT_BLOCK = 1024
# Programs per row aimed at: enough to fill the device a few times over when
# there are few rows, few enough that the [R, P] scans stay trivial.
_PROGRAMS_PER_SM = 4


@triton.jit
def _topk_key(bits, MAG_MASK: tl.constexpr, NAN_KEY: tl.constexpr, KEY_DTYPE: tl.constexpr):
    # The magnitude key (hfkern/_topk.py): sign bit cleared, NaNs clamped to one key.
    key = (bits & MAG_MASK).to(KEY_DTYPE)
    return tl.minimum(key, NAN_KEY)


@triton.jit
def _topk_count_kernel(
    bits_ptr,  # [R, n] bit patterns
    cand_ptr,  # [R, C] candidate thresholds, key dtype
    partial_ptr,  # [R, P, C] int32
    n, P, TILES,
    MAG_MASK: tl.constexpr, NAN_KEY: tl.constexpr, KEY_DTYPE: tl.constexpr,
    C: tl.constexpr, BLOCK: tl.constexpr,
):
    p = tl.program_id(0)
    r = tl.program_id(1).to(tl.int64)  # int64: r * n can exceed 2**31
    cols = tl.arange(0, C)
    cand = tl.load(cand_ptr + r * C + cols)
    acc = tl.zeros([C], dtype=tl.int32)
    start = p.to(tl.int64) * TILES * BLOCK
    for t in range(TILES):
        offs = start + t * BLOCK + tl.arange(0, BLOCK)
        mask = offs < n
        bits = tl.load(bits_ptr + r * n + offs, mask=mask, other=0)
        key = _topk_key(bits, MAG_MASK, NAN_KEY, KEY_DTYPE)
        # masked lanes get key -1, below every candidate (candidates are >= 0)
        key = tl.where(mask, key, -1)
        hit = (key[:, None] >= cand[None, :]).to(tl.int32)
        acc += tl.sum(hit, axis=0)
    tl.store(partial_ptr + (r * P + p) * C + cols, acc)


@triton.jit
def _topk_block_counts_kernel(
    bits_ptr,  # [R, n] bit patterns
    thr_ptr,  # [R] threshold, key dtype
    gt_ptr, eq_ptr,  # [R, P] int32
    n, P, TILES,
    MAG_MASK: tl.constexpr, NAN_KEY: tl.constexpr, KEY_DTYPE: tl.constexpr, BLOCK: tl.constexpr,
):
    p = tl.program_id(0)
    r = tl.program_id(1).to(tl.int64)
    thr = tl.load(thr_ptr + r)
    gt = tl.zeros([BLOCK], dtype=tl.int32)
    eq = tl.zeros([BLOCK], dtype=tl.int32)
    start = p.to(tl.int64) * TILES * BLOCK
    for t in range(TILES):
        offs = start + t * BLOCK + tl.arange(0, BLOCK)
        mask = offs < n
        key = _topk_key(tl.load(bits_ptr + r * n + offs, mask=mask, other=0), MAG_MASK, NAN_KEY, KEY_DTYPE)
        gt += (mask & (key > thr)).to(tl.int32)
        eq += (mask & (key == thr)).to(tl.int32)
    tl.store(gt_ptr + r * P + p, tl.sum(gt, axis=0))
    tl.store(eq_ptr + r * P + p, tl.sum(eq, axis=0))


@triton.jit
def _topk_write_kernel(
    bits_ptr,  # [R, n] bit patterns
    thr_ptr, quota_ptr,  # [R] threshold (key dtype), tie quota (int64)
    tie_off_ptr, out_off_ptr,  # [R, P] int64 exclusive scans
    values_ptr,  # [R, cap] bit patterns
    indices_ptr,  # [R, cap] int32
    n, P, TILES, cap,
    MAG_MASK: tl.constexpr, NAN_KEY: tl.constexpr, KEY_DTYPE: tl.constexpr, BLOCK: tl.constexpr,
):
    p = tl.program_id(0)
    r = tl.program_id(1).to(tl.int64)
    thr = tl.load(thr_ptr + r)
    quota = tl.load(quota_ptr + r)
    ties = tl.load(tie_off_ptr + r * P + p)
    taken = tl.load(out_off_ptr + r * P + p)
    start = p.to(tl.int64) * TILES * BLOCK
    for t in range(TILES):
        offs = start + t * BLOCK + tl.arange(0, BLOCK)
        mask = offs < n
        bits = tl.load(bits_ptr + r * n + offs, mask=mask, other=0)
        key = _topk_key(bits, MAG_MASK, NAN_KEY, KEY_DTYPE)
        eq = (mask & (key == thr)).to(tl.int32)
        # rank of each tie among the row's ties; the lowest-index quota of them are kept
        tie_rank = ties + tl.cumsum(eq, axis=0) - 1
        keep = (mask & (key > thr)) | ((eq != 0) & (tie_rank < quota))
        slot = taken + tl.cumsum(keep.to(tl.int32), axis=0) - 1
        tl.store(values_ptr + r * cap + slot, bits, mask=keep)
        tl.store(indices_ptr + r * cap + slot, offs.to(tl.int32), mask=keep)
        ties += tl.sum(eq, axis=0)
        taken += tl.sum(keep.to(tl.int32), axis=0)


def _tiling(R: int, n: int, block: int, device: torch.device) -> tuple[int, int]:
    """(P, TILES): programs per row and tiles per program."""
    tiles_total = triton.cdiv(n, block)
    if interpreting():
        programs = min(tiles_total, 4)  # the interpreter runs programs one by one
    else:
        programs = max(1, _PROGRAMS_PER_SM * sm_count(device) // max(R, 1))
    tiles = triton.cdiv(tiles_total, max(1, min(programs, tiles_total)))
    return triton.cdiv(tiles_total, tiles), tiles


def _key_constants(spec: _topk.KeySpec) -> dict:
    key_dtype = tl.int64 if spec.key_dtype == torch.int64 else tl.int32
    return dict(MAG_MASK=spec.mag_mask, NAN_KEY=spec.nan_key, KEY_DTYPE=key_dtype)


def count_ge(bits: Tensor, spec: _topk.KeySpec, candidates: Tensor) -> Tensor:
    """``[R, C]`` int64: how many keys of each row are >= each candidate (the search's pass)."""
    R, n = bits.shape
    C = candidates.shape[1]
    # Candidates above every key (up to nan_key + 1) fit the key dtype after this
    # clamp, which changes no count.
    cand = candidates.clamp(max=spec.nan_key + 1).to(spec.key_dtype).contiguous()
    P, tiles = _tiling(R, n, _COUNT_BLOCK, bits.device)
    partial = torch.empty(R, P, C, dtype=torch.int32, device=bits.device)
    _topk_count_kernel[(P, R)](
        bits, cand, partial, n, P, tiles, C=C, BLOCK=_COUNT_BLOCK, **_key_constants(spec),
    )
    return partial.sum(1, dtype=torch.int64)  # a deterministic integer sum


def compact(bits: Tensor, dtype: torch.dtype, spec: _topk.KeySpec, threshold: Tensor, quota: Tensor,
            cap: int) -> tuple[Tensor, Tensor]:
    """The selected entries of each row in index order, zero-padded to ``cap`` (as
    :func:`hfkern.ops.topk.compact_torch`)."""
    R, n = bits.shape
    device = bits.device
    consts = _key_constants(spec)
    thr = threshold.to(spec.key_dtype).contiguous()
    P, tiles = _tiling(R, n, _COMPACT_BLOCK, device)
    gt = torch.empty(R, P, dtype=torch.int32, device=device)
    eq = torch.empty(R, P, dtype=torch.int32, device=device)
    _topk_block_counts_kernel[(P, R)](bits, thr, gt, eq, n, P, tiles, BLOCK=_COMPACT_BLOCK, **consts)
    tie_offset, out_offset = _topk.compaction_offsets(gt, eq, quota)
    values = torch.zeros(R, cap, dtype=bits.dtype, device=device)
    indices = torch.zeros(R, cap, dtype=torch.int32, device=device)
    _topk_write_kernel[(P, R)](
        bits, thr, quota.contiguous(), tie_offset, out_offset, values, indices, n, P, tiles, cap,
        BLOCK=_COMPACT_BLOCK, **consts,
    )
    return values.view(dtype), indices


# auto never picks it until a committed GPU benchmark shows it faster than the
# torch path on the device (the selection is identical either way);
# set_backend("triton") selects it.
@_backend.implements("topk_select", "triton", device_types=("cuda",), auto=False)
def topk_select(x: Tensor, k: int, exact: bool, seed: int) -> tuple[Tensor, Tensor, Tensor]:
    """hfkern::topk_select on the Triton kernels (the search itself is shared; see above)."""
    if x.device.type != "cuda" and not interpreting():
        raise ValueError(
            f"hfkern::topk_select (triton): expected a CUDA tensor (or TRITON_INTERPRET=1), got x on {x.device}"
        )
    return _topk.select(x, k, exact, seed, count_ge, compact)
