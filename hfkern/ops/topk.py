"""hfkern::topk_select: approximate (and exact) top-k selection by magnitude.

Gradient sparsification sends, per step, the ``k`` entries of a flat gradient
with the largest magnitude. A full sort (``torch.topk``) is the costly part of
that on a GPU; an approximate selection that takes between ``k`` and
``1.25 k`` entries needs only a threshold, which a sample and a few counting
passes find (the search is described in :mod:`hfkern._topk`), and a stable
compaction.

Op (registered with torch.library, implementation chosen by the registry)::

    topk_select(Tensor x, int k, bool exact, int seed) -> (Tensor values, Tensor indices, Tensor count)

* ``x``: float32, float64, bfloat16 or float16, shape ``[n]`` or ``[R, n]``, any
  strides; each row is selected on its own, by magnitude ``|x|``; ``1 <= k <= n``
  and ``n < 2**31``.
* ``values``: ``[cap]`` or ``[R, cap]`` in ``x.dtype``, the signed values of ``x``
  at the selected positions (bit for bit: NaN payloads and -0.0 kept);
  ``indices``: the same shape, int32, positions within the row in ascending
  order; ``count``: int64, ``[]`` or ``[R]``, how many entries of the row are
  valid, ``k <= count <= cap``. Entries past ``count`` hold value 0 and index 0,
  so ``index_add``/``scatter_add`` of the whole buffer is correct without
  reading ``count``.
* ``cap = topk_capacity(k, exact)``: ``k`` when ``exact``, else ``ceil(1.25 k)``.
* ``exact=True``: ``count == k``, the set ``torch.topk(x.abs(), k)`` selects, with
  ties broken towards lower indices. ``exact=False``: every entry of magnitude
  above a threshold and none below it (so the selected set is a top set), the
  threshold found from a sample of the row drawn with ``seed`` (an int64: the
  64-bit pattern of a generator seed; :func:`topk_select` takes torch's whole
  seed range and converts); if the entries
  tied at the threshold would overflow ``cap``, the lowest-index ones are kept
  and ``count == cap``.
* NaN counts as the largest magnitude (selected before any finite value, so a
  NaN gradient reaches the reduction as it would densely), +-inf next; NaNs tie
  with each other.
* Deterministic for a fixed ``(x, k, exact, seed)``, and identical on every
  backend: they run the same search from the same sample, with exact integer
  counts, and differ only in how they count and compact.

The op is not differentiated (a selection of gradients): its results never require
grad, also for an ``x`` that does.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
from torch import Tensor

from .. import _backend, _topk
from .._topk import KeySpec, capacity, key_spec, keys_of, row_bits, shape_outputs

__all__ = ["TopK", "topk_select", "topk_capacity", "check_topk_args"]

_OP = "topk_select"
_INT32_MAX = torch.iinfo(torch.int32).max
# Columns per step of the torch path's counting and compaction, which bounds
# their temporaries (a few int64 tensors of this many columns per row).
_CHUNK = 1 << 22


class TopK(NamedTuple):
    """What :func:`topk_select` returns (see the module docstring for the contract)."""

    values: Tensor  # [cap] or [R, cap], x.dtype
    indices: Tensor  # [cap] or [R, cap], int32, ascending within the valid entries
    count: Tensor  # [] or [R], int64, k <= count <= cap


def topk_capacity(k: int, exact: bool = False) -> int:
    """The length of :func:`topk_select`'s buffers: ``k`` if ``exact``, else ``ceil(1.25 * k)``.

    ``k`` and ``exact`` are checked as :func:`topk_select` checks them: ``k`` an int
    in ``[1, 2**31 - 1]`` (the longest row it takes), ``exact`` a bool.
    """
    if isinstance(k, bool) or not isinstance(k, int):
        raise TypeError(f"topk_capacity: expected k to be an int, got {type(k).__name__} {k!r}")
    if not 1 <= k <= _INT32_MAX:
        raise ValueError(f"topk_capacity: expected k >= 1 and k <= {_INT32_MAX} (topk_select's longest "
                         f"row), got k = {k}")
    if not isinstance(exact, bool):
        raise TypeError(f"topk_capacity: expected exact to be a bool, got {type(exact).__name__} {exact!r}")
    return capacity(k, exact)


def check_topk_args(x: Tensor, k: int, exact: bool, seed: int) -> KeySpec:
    """Raise TypeError/ValueError naming the expected and the received value; the key spec."""
    if not isinstance(x, Tensor):
        raise TypeError(f"topk_select: expected x to be a Tensor, got {type(x).__name__}")
    spec = key_spec(x.dtype)
    if x.dim() not in (1, 2):
        raise ValueError(f"topk_select: expected x of shape [n] or [R, n], got shape {tuple(x.shape)}")
    n = x.shape[-1]
    if isinstance(k, bool) or not isinstance(k, int):
        raise TypeError(f"topk_select: expected k to be an int, got {type(k).__name__} {k!r}")
    if not 1 <= k <= n:
        raise ValueError(f"topk_select: expected 1 <= k <= n = {n} (the row length), got k = {k}")
    if n > _INT32_MAX:
        raise ValueError(f"topk_select: expected rows of at most {_INT32_MAX} entries (int32 indices), got {n}")
    if not isinstance(exact, bool):
        raise TypeError(f"topk_select: expected exact to be a bool, got {type(exact).__name__} {exact!r}")
    if isinstance(seed, bool) or not isinstance(seed, int):
        raise TypeError(f"topk_select: expected seed to be an int, got {type(seed).__name__} {seed!r}")
    if not -(2**63) <= seed < 2**64:
        raise ValueError(f"topk_select: expected seed in [-2**63, 2**64) as torch.Generator.manual_seed "
                         f"takes, got {seed}")
    return spec


# ---- the torch implementation (CPU path and oracle) -----------------------------

def count_ge_torch(bits: Tensor, spec: KeySpec, candidates: Tensor) -> Tensor:
    """``[R, C]`` int64: how many keys of each row of ``bits`` are >= each candidate."""
    R, C = candidates.shape
    ordered, order = candidates.sort(dim=1)
    # Candidates may exceed every key (nan_key + 1); clamping keeps them in the
    # key dtype without changing any count (no key exceeds nan_key).
    ordered_keys = ordered.clamp(max=spec.nan_key + 1).to(spec.key_dtype).contiguous()
    hist = torch.zeros(R, C + 1, dtype=torch.int64, device=bits.device)
    for start in range(0, bits.shape[1], _CHUNK):
        keys = keys_of(bits[:, start:start + _CHUNK], spec)
        # bucket = how many candidates are <= key: key >= ordered[j] <=> bucket > j
        bucket = torch.searchsorted(ordered_keys, keys, right=True)
        if R > 1:
            bucket += torch.arange(0, R * (C + 1), C + 1, device=bits.device).unsqueeze(1)
        hist += torch.bincount(bucket.view(-1), minlength=R * (C + 1)).view(R, C + 1)
    above = hist.flip(1).cumsum(1).flip(1)[:, 1:]  # above[:, j] = sum of hist[:, j+1:]
    return torch.empty_like(above).scatter_(1, order, above)


def compact_torch(bits: Tensor, dtype: torch.dtype, spec: KeySpec, threshold: Tensor, quota: Tensor,
                  cap: int) -> tuple[Tensor, Tensor]:
    """The selected entries of each row, in index order, zero-padded to ``cap``.

    Selects ``key > threshold``, and ``key == threshold`` while its rank among the
    row's keys equal to the threshold is below ``quota`` (``[R]`` int64 each).
    Only the entries at or above the threshold (about ``count`` of them, plus
    ties) are gathered and ranked, so no temporary is as long as the row but the
    keys of one chunk and their comparison.
    """
    R, n = bits.shape
    device = bits.device
    rows, cols, ties = [], [], []
    for start in range(0, n, _CHUNK):
        keys = keys_of(bits[:, start:start + _CHUNK], spec)
        r, c = (keys >= threshold.unsqueeze(1)).nonzero(as_tuple=True)  # row-major, ascending c
        rows.append(r)
        cols.append(c + start)
        ties.append(keys[r, c] == threshold[r])
    rows, cols, tie = torch.cat(rows), torch.cat(cols), torch.cat(ties)
    if n > _CHUNK:  # chunk-major -> row-major; stable, so each row stays in index order
        order = torch.sort(rows, stable=True).indices
        rows, cols, tie = rows[order], cols[order], tie[order]

    def rank_in_row(flags: Tensor, rows: Tensor) -> Tensor:
        """0-based rank of each entry among its row's entries with ``flags`` set (inclusive count - 1)."""
        flags = flags.to(torch.int64)
        totals = torch.zeros(R, dtype=torch.int64, device=device).index_add_(0, rows, flags)
        before = totals.cumsum(0) - totals  # flagged entries of the rows above
        return flags.cumsum(0) - 1 - before[rows]

    tie_rank = rank_in_row(tie, rows)
    keep = ~tie | (tie_rank < quota[rows])
    rows, cols = rows[keep], cols[keep]
    slot = rank_in_row(torch.ones_like(rows, dtype=torch.bool), rows)
    values = torch.zeros(R, cap, dtype=bits.dtype, device=device)  # bit patterns: NaN payloads kept
    indices = torch.zeros(R, cap, dtype=torch.int32, device=device)
    values[rows, slot] = bits[rows, cols]
    indices[rows, slot] = cols.to(torch.int32)
    return values.view(dtype), indices


@_backend.implements(_OP, "torch")
def topk_select_torch(x: Tensor, k: int, exact: bool, seed: int) -> tuple[Tensor, Tensor, Tensor]:
    """The torch path: exact mode through ``torch.topk`` on the keys, approximate mode
    through the shared threshold search; one compaction for both."""
    spec = key_spec(x.dtype)
    bits = row_bits(x, spec)
    R, n = bits.shape
    cap = capacity(k, exact)
    if R == 0:
        threshold = quota = count = torch.zeros(0, dtype=torch.int64, device=x.device)
    elif exact:
        # The k-th largest key K; every key above K is taken and the k - c(K + 1)
        # lowest-index keys equal to K.
        threshold = torch.topk(keys_of(bits, spec), k, dim=1, sorted=False).values.amin(1).to(torch.int64)
        above = count_ge_torch(bits, spec, (threshold + 1).unsqueeze(1)).squeeze(1)
        quota = k - above
        count = torch.full((R,), k, dtype=torch.int64, device=x.device)
    else:
        threshold, quota, count = _topk.find_threshold(bits, spec, k, cap, seed, count_ge_torch)
    values, indices = compact_torch(bits, x.dtype, spec, threshold, quota, cap)
    return shape_outputs(x, values, indices, count)


# ---- the op ----------------------------------------------------------------------

@torch.library.custom_op("hfkern::topk_select", mutates_args=())
def _topk_select_op(x: Tensor, k: int, exact: bool, seed: int) -> tuple[Tensor, Tensor, Tensor]:
    check_topk_args(x, k, exact, seed)
    return _backend.resolve(_OP, x.device, x.dtype)(x, k, exact, seed)


@_topk_select_op.register_fake
def _(x, k, exact, seed):
    check_topk_args(x, k, exact, seed)
    cap = capacity(k, exact)
    lead = tuple(x.shape[:-1])
    return (x.new_empty(lead + (cap,)), x.new_empty(lead + (cap,), dtype=torch.int32),
            x.new_empty(lead, dtype=torch.int64))


def _setup_context(ctx, inputs, output) -> None:
    # Not differentiated (the module docstring): results that do not require grad, as
    # those of torch's integer-valued ops do, rather than a graph with no backward.
    ctx.mark_non_differentiable(*output)


def _backward(ctx, *grads):
    raise RuntimeError("hfkern::topk_select is not differentiable")  # outputs never require grad


_topk_select_op.register_autograd(_backward, setup_context=_setup_context)


def topk_select(x: Tensor, k: int, *, exact: bool = False, seed: int = 0) -> TopK:
    """Select, per row of ``x`` (``[n]`` or ``[R, n]``), the entries of largest magnitude.

    Returns ``TopK(values, indices, count)``: ``values``/``indices`` ``[cap]`` or
    ``[R, cap]`` (x.dtype / int32, ascending indices, zero past ``count``), ``count``
    int64 ``[]`` or ``[R]`` with ``k <= count <= cap = topk_capacity(k, exact)``;
    ``exact=True`` gives ``torch.topk``'s set with ties towards lower indices.
    ``seed``: any seed ``torch.Generator.manual_seed`` takes, ``[-2**63, 2**64)``
    (seeds equal modulo ``2**64`` draw the same sample, as torch's generators do). See
    :mod:`hfkern.ops.topk` for the whole contract.
    """
    check_topk_args(x, k, exact, seed)
    return TopK(*torch.ops.hfkern.topk_select(x, k, exact, _topk.op_seed(seed)))
