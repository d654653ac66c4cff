"""The threshold search of the approximate top-k selection, shared by every backend.

``hfkern::topk_select`` (the contract is in :mod:`hfkern.ops.topk`) selects, per
row, the entries of largest magnitude. Every backend runs the same search
written here, in torch ops on the row's device, and supplies only two
primitives: a counting pass (how many keys of each row are >= each of a few
candidate thresholds) and a compaction (write the selected entries in index
order). Counts are exact integers, so every backend finds the same threshold
from the same sample and the backends select identical sets.

Keys. An entry's magnitude is compared through its *key*: the bit pattern of
``x`` with the sign bit cleared, read as a non-negative integer. For IEEE
floats these integers order exactly as the magnitudes do (+-0 share key 0,
subnormals come next, +-inf is the largest finite-or-infinite key), and every
NaN is above inf; all NaNs are clamped to one key, ``inf_key + 1``, so that
NaNs tie with each other and are taken lowest index first like any other tie.
Integer keys make the threshold arithmetic exact and identical on every
backend (no float rounding, no NaN comparisons), and a kernel never does float
arithmetic at all: it reads and copies bit patterns.

Search. ``c(t)`` = number of keys >= t, non-increasing in t; ``c(0) = n``.
The search keeps a bracket ``lo < hi`` with ``c(lo) >= k > c(hi)`` (so the k-th
largest key K lies in ``[lo, hi)``), starting at ``[0, nan_key + 1]``, and
counts ``c`` at ``NUM_CANDIDATES`` thresholds per pass:

1. the first pass takes its candidates from a seeded sample of the row's keys
   (up to ``SAMPLE_SIZE`` positions drawn with replacement by a CPU generator
   seeded with ``seed``, so the sample does not depend on the device; a row of
   at most ``SAMPLE_SIZE`` entries is its own sample): the sample's order
   statistics around the rank a threshold with ``(k + cap) / 2`` hits would
   have, plus that order statistic + 1;
2. each further pass spreads its candidates evenly over the integers of
   ``(lo, hi)``, so the bracket shrinks at least ``NUM_CANDIDATES + 1``-fold per
   pass (after the first pass, at most 7 more for 32-bit keys, 13 for
   64-bit, 3 for 16-bit).

After each pass, ``lo`` becomes the largest candidate with ``c >= k`` and ``hi``
the smallest with ``c < k``. A row is done when ``c(lo) <= cap`` (the threshold
``lo`` selects ``c(lo)`` in ``[k, cap]`` entries) or ``hi == lo + 1`` (then
``lo == K`` and the ties at K would overflow ``cap``: every key > K is taken,
``c(hi)`` of them, and the ``cap - c(hi)`` lowest-index keys equal to K, so
``count == cap``). Both cases are one rule: select ``key > lo``, and
``key == lo`` while its rank among the row's keys equal to ``lo`` is below
``quota = cap - c(hi)``; ``count = min(c(lo), cap)``. Exact mode is the same
search with ``cap = k``. A finished row is frozen, so one row's result never
depends on the other rows. Every pass reads the rows' ``done`` flags back to the
host once.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable

import torch
from torch import Tensor

__all__ = [
    "op_seed", "NUM_CANDIDATES", "SAMPLE_SIZE", "KeySpec", "key_spec", "keys_of", "capacity",
    "sample_candidates", "find_threshold", "select",
]

# Thresholds counted per pass. A counting kernel compares each key with all of
# them, so this is its inner width (a power of two for Triton's block shapes).
NUM_CANDIDATES = 32
# Sampled keys per row for the first pass's candidates; rows of at most this
# many entries are sampled whole (their first pass is then exact).
SAMPLE_SIZE = 16384


@dataclass(frozen=True)
class KeySpec:
    """How a float dtype's bit patterns become magnitude keys."""

    bits_dtype: torch.dtype  # the integer dtype of the same width (x.view(bits_dtype))
    mag_mask: int  # clears the sign bit
    inf_key: int  # |inf|'s key; every NaN maps to inf_key + 1

    @property
    def nan_key(self) -> int:
        return self.inf_key + 1

    @property
    def key_dtype(self) -> torch.dtype:
        # 16-bit keys are widened: torch's integer kernels (searchsorted, topk)
        # cover int32 and int64 on every device.
        return torch.int64 if self.bits_dtype == torch.int64 else torch.int32


_SPECS = {
    torch.float16: KeySpec(torch.int16, 0x7FFF, 0x7C00),
    torch.bfloat16: KeySpec(torch.int16, 0x7FFF, 0x7F80),
    torch.float32: KeySpec(torch.int32, 0x7FFFFFFF, 0x7F800000),
    torch.float64: KeySpec(torch.int64, 0x7FFFFFFFFFFFFFFF, 0x7FF0000000000000),
}


def key_spec(dtype: torch.dtype) -> KeySpec:
    try:
        return _SPECS[dtype]
    except KeyError:
        raise TypeError(
            f"topk_select: expected x of dtype float32, float64, bfloat16 or float16, got {dtype}"
        ) from None


def keys_of(bits: Tensor, spec: KeySpec) -> Tensor:
    """Magnitude keys (``spec.key_dtype``) of bit patterns ``bits`` (``spec.bits_dtype``)."""
    keys = bits.to(spec.key_dtype) & spec.mag_mask
    return keys.clamp_max_(spec.nan_key)


def row_bits(x: Tensor, spec: KeySpec) -> Tensor:
    """``x`` (``[n]`` or ``[R, n]``) as ``[R, n]`` contiguous bit patterns
    (``spec.bits_dtype``); a copy only if ``x`` is strided."""
    rows = x if x.dim() == 2 else x.unsqueeze(0)
    return rows.contiguous().view(spec.bits_dtype)


def shape_outputs(x: Tensor, values: Tensor, indices: Tensor, count: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """The ``[R, ...]`` results in the op's shapes for ``x`` (one row: no row dim)."""
    if x.dim() == 1:
        return values[0], indices[0], count[0]
    return values, indices, count


def compaction_offsets(gt: Tensor, eq: Tensor, quota: Tensor) -> tuple[Tensor, Tensor]:
    """Where each block of a row starts writing, for a kernel that compacts in blocks.

    ``gt``/``eq``: ``[R, P]`` counts of each block's keys above / equal to the
    threshold; ``quota``: ``[R]``. Returns ``(tie_offset, out_offset)``, ``[R, P]``
    int64: how many keys equal to the threshold, and how many selected entries,
    precede the block in its row (exclusive scans, so the result does not depend
    on how a kernel orders its blocks).
    """
    gt, eq = gt.to(torch.int64), eq.to(torch.int64)
    tie_offset = eq.cumsum(1) - eq
    taken = gt + (quota.unsqueeze(1) - tie_offset).clamp(min=0).minimum(eq)
    return tie_offset, taken.cumsum(1) - taken


def capacity(k: int, exact: bool = False) -> int:
    """The buffer length of a selection of ``k``: ``k`` if exact, else ``ceil(1.25 * k)``."""
    return k if exact else (5 * k + 3) // 4


def op_seed(seed: int) -> int:
    """A generator seed as ``topk_select``'s int64 ``seed`` argument (its 64-bit pattern).

    ``torch.Generator.manual_seed`` takes ``[-2**63, 2**64)`` and seeds with the
    value modulo ``2**64``; the op's schema holds an int64, so seeds from ``2**63``
    up travel as ``seed - 2**64``, which seeds the same generator. ``seed`` was
    checked (``hfkern.ops.topk.check_topk_args``).
    """
    return seed - 2**64 if seed >= 2**63 else seed


def sample_positions(R: int, n: int, seed: int) -> Tensor:
    """``[R, s]`` int64 positions of each row's sample, on the CPU (see the module docstring)."""
    if n <= SAMPLE_SIZE:
        return torch.arange(n).expand(R, n)
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(0, n, (R, SAMPLE_SIZE), generator=generator)


def sample_candidates(keys_sample: Tensor, n: int, k: int, cap: int) -> Tensor:
    """``[R, NUM_CANDIDATES]`` int64 first-pass thresholds from ``[R, s]`` sampled keys."""
    R, s = keys_sample.shape
    ordered = keys_sample.sort(dim=1).values.to(torch.int64)  # ascending
    # A threshold that selects about (k + cap) / 2 entries has about this many
    # sampled keys at or above it; the candidates cover its binomial spread.
    m = (k + cap) / 2 * s / n
    center = min(max(s - round(m), 0), s - 1)
    half = 3.0 * math.sqrt(m) + 1.0
    step = max(1, math.ceil(2 * half / (NUM_CANDIDATES - 1)))
    offsets = (torch.arange(NUM_CANDIDATES - 1) - (NUM_CANDIDATES - 1) // 2) * step
    where = (center + offsets).clamp_(0, s - 1).to(keys_sample.device)
    picked = ordered.index_select(1, where)
    # The centre + 1 as well: with a whole-row sample the centre is K itself, and
    # K + 1 closes the bracket to [K, K + 1] in this one pass when K is tied.
    return torch.cat([picked, ordered[:, center:center + 1] + 1], dim=1)


def _even_candidates(lo: Tensor, hi: Tensor) -> Tensor:
    """``[R, NUM_CANDIDATES]`` thresholds spread over [lo, hi) (every integer of it when
    it has at most NUM_CANDIDATES + 1); written so that no product overflows int64."""
    parts = NUM_CANDIDATES + 1
    j = torch.arange(1, parts, device=lo.device, dtype=torch.int64)
    width = (hi - lo).unsqueeze(1)
    return lo.unsqueeze(1) + (width // parts) * j + ((width % parts) * j) // parts


# count_ge(bits [R, n], spec, candidates [R, C] int64) -> [R, C] int64, c(t) per candidate
CountFn = Callable[[Tensor, KeySpec, Tensor], Tensor]


def find_threshold(
    bits: Tensor, spec: KeySpec, k: int, cap: int, seed: int, count_ge: CountFn,
) -> tuple[Tensor, Tensor, Tensor]:
    """Run the search over the rows of ``bits`` (``[R, n]``, ``spec.bits_dtype``, contiguous).

    Returns ``(threshold, quota, count)``, each ``[R]`` int64: select ``key >
    threshold``, and ``key == threshold`` while its rank among the row's keys
    equal to the threshold is below ``quota``; ``count`` entries in all, in
    ``[k, cap]``.
    """
    R, n = bits.shape
    device = bits.device
    positions = sample_positions(R, n, seed).to(device)
    sample = keys_of(bits.gather(1, positions), spec)
    lo = torch.zeros(R, dtype=torch.int64, device=device)
    hi = torch.full((R,), spec.nan_key + 1, dtype=torch.int64, device=device)
    c_lo = torch.full((R,), n, dtype=torch.int64, device=device)
    c_hi = torch.zeros(R, dtype=torch.int64, device=device)
    done = torch.zeros(R, dtype=torch.bool, device=device)
    candidates = sample_candidates(sample, n, k, cap)
    key_bits = 8 * torch.empty((), dtype=spec.bits_dtype).element_size()
    for _ in range(2 + key_bits):  # more than the search can take (module docstring)
        counts = count_ge(bits, spec, candidates)
        ge = counts >= k
        big = torch.iinfo(torch.int64).max
        new_lo = torch.where(ge, candidates, -1).amax(1)
        new_c_lo = torch.where(ge, counts, big).amin(1)
        new_hi = torch.where(ge, big, candidates).amin(1)
        new_c_hi = torch.where(ge, -1, counts).amax(1)
        raise_lo = (new_lo > lo) & ~done
        lower_hi = (new_hi < hi) & ~done
        lo = torch.where(raise_lo, new_lo, lo)
        c_lo = torch.where(raise_lo, new_c_lo, c_lo)
        hi = torch.where(lower_hi, new_hi, hi)
        c_hi = torch.where(lower_hi, new_c_hi, c_hi)
        done = done | (c_lo <= cap) | (hi - lo <= 1)
        if bool(done.all()):
            break
        candidates = _even_candidates(lo, hi)
    else:  # unreachable: the bracket shrinks 33-fold per pass
        raise RuntimeError(f"topk_select: threshold search did not converge (n={n}, k={k})")
    return lo, cap - c_hi, torch.clamp(c_lo, max=cap)


Compact = Callable[[Tensor, torch.dtype, KeySpec, Tensor, Tensor, int], tuple[Tensor, Tensor]]


def select(x: Tensor, k: int, exact: bool, seed: int, count_ge: CountFn, compact: Compact
           ) -> tuple[Tensor, Tensor, Tensor]:
    """hfkern::topk_select of ``x`` on a backend's two primitives: ``count_ge(bits,
    spec, candidates) -> [R, C]`` counts and ``compact(bits, dtype, spec,
    threshold, quota, cap) -> (values, indices)``. Exact mode is the same search
    with no slack above k."""
    spec = key_spec(x.dtype)
    bits = row_bits(x, spec)
    cap = capacity(k, exact)
    if bits.shape[0] == 0:
        empty = torch.zeros(0, cap, dtype=x.dtype, device=x.device)
        return empty, empty.to(torch.int32), torch.zeros(0, dtype=torch.int64, device=x.device)
    threshold, quota, count = find_threshold(bits, spec, k, cap, seed, count_ge)
    values, indices = compact(bits, x.dtype, spec, threshold, quota, cap)
    return shape_outputs(x, values, indices, count)
