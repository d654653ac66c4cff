"""How the normalization kernels see their operands: layouts, tiles and reduction chunks.

Shared by every GPU backend of the array batch norm (hfkern/triton/batch_norm.py,
hfkern/cuda/batch_norm.py): what a backend needs to read ``x`` where it lies
and to split each (model, channel)'s reduction into fixed chunks. Nothing here
knows a kernel language; tile sizes are each backend's own, the rule that shapes
a tile is :func:`tile_shape`. The launchers' common prologue and epilogue
(:func:`addressed`: a copy where no layout serves; :func:`backward_outputs`) and
the fused activations' names serve the layer-norm launchers and the ops too, and
so does the layer norm's own layout, :func:`row_layout` (rows of ``S``).

Layout. ``x`` is ``[B, N, C, *S]`` with any strides. The kernels see each
model's input as ``[R0, C, R1]``: the reduced dims (N and the spatial dims)
ordered by the first tensor's strides and merged where they are contiguous with
each other in every tensor of the call, which must leave at most two strided
dims, ``R0`` (outer) and ``R1`` (inner). That covers contiguous ``[B, N, C,
*S]`` memory, the ``[N, B, C, *S]`` memory of an array conv's output,
channels-last memory, strided slices of one dim, a shared input (stride 0 on B)
and an expanded ``grad_y`` (stride 0 everywhere) without a copy.

Partition. The ``R0 x R1`` elements of each (model, channel block) are split
into ``P`` chunks of whole tiles, ``P0`` over R0 times ``P1`` over R1; chunk
``p`` covers rows ``[p0 * CHUNK0, min((p0 + 1) * CHUNK0, R0))`` and inner
elements ``[p1 * CHUNK1, min((p1 + 1) * CHUNK1, R1))`` with ``p0 = p // P1``,
``p1 = p % P1``. It depends only on the shapes and the device's SM count, so
the per-chunk partials are combined in the same order on every run.
"""

from __future__ import annotations

from typing import Any, Callable, Sequence

import torch
from torch import Tensor

from ._device import sm_count

__all__ = [
    "layout", "row_layout", "partition", "cdiv", "next_power_of_2", "tile_shape", "addressed", "backward_outputs",
    "NORM_ACTIVATIONS", "PROGRAMS_PER_SM",
]

# The activations a norm op fuses, by the names the ops take (and the kernels' codes
# are keyed by): identity, ReLU, and GELU in its exact erf form.
NORM_ACTIVATIONS = ("none", "relu", "gelu")

# reduction programs per SM: enough to hide latency, few enough that the
# [B, P, C] partial buffers stay small next to x
PROGRAMS_PER_SM = 4


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


def next_power_of_2(n: int) -> int:
    return 1 if n <= 1 else 1 << (n - 1).bit_length()


def layout(tensors: Sequence[Tensor]):
    """Strides of ``tensors`` (one shape ``[B, N, C, *S]``) as B x R0 x C x R1.

    The reduced dims (N, S) are ordered by the first tensor's strides, largest
    first, and merged where every tensor allows it. Returns ``(R0, R1,
    [[s_b, s_r0, s_c, s_r1] per tensor])`` or None when more than two strided
    dims remain.
    """
    shape = [int(s) for s in tensors[0].shape]
    strides = [[int(s) for s in t.stride()] for t in tensors]
    reduced = [d for d in [1, *range(3, len(shape))] if shape[d] != 1]
    reduced.sort(key=lambda d: -strides[0][d])  # stable: ties keep logical order
    merged: list[tuple[int, list[int]]] = []
    for d in reduced:
        st = [s[d] for s in strides]
        if merged and all(outer == inner * shape[d] for outer, inner in zip(merged[-1][1], st)):
            merged[-1] = (merged[-1][0] * shape[d], st)
        else:
            merged.append((shape[d], st))
    if len(merged) > 2:
        return None
    # One dim left: it is R1 if it runs along memory more than the channels do.
    if len(merged) == 1 and merged[0][1][0] > strides[0][2]:
        merged.append((1, [0] * len(tensors)))
    while len(merged) < 2:
        merged.insert(0, (1, [0] * len(tensors)))
    (R0, s0), (R1, s1) = merged
    return R0, R1, [[s[0], a, s[2], c] for s, a, c in zip(strides, s0, s1)]


# ---- layer norm: rows -------------------------------------------------------------

def _merge_dims(shape: Sequence[int], strides: Sequence[Sequence[int]], dims: range):
    """Merge ``dims`` (outer to inner) of every tensor where all tensors allow it.

    Returns ``[(size, [stride per tensor]), ...]`` for the dims left, size-1
    dims dropped.
    """
    merged: list[tuple[int, list[int]]] = []
    for i in dims:
        size = shape[i]
        if size == 1:
            continue
        st = [s[i] for s in strides]
        if merged and all(outer == inner * size for outer, inner in zip(merged[-1][1], st)):
            merged[-1] = (merged[-1][0] * size, st)
        else:
            merged.append((size, st))
    return merged


def _split(merged, n: int):
    """(inner size, split?, [(outer stride, inner stride) per tensor]) or None past two dims;
    one dim is its own inner dim (outer stride 0)."""
    if len(merged) > 2:
        return None
    if not merged:
        return 1, False, [(0, 0)] * n
    if len(merged) == 1:
        size, st = merged[0]
        return size, False, [(0, s) for s in st]
    (_, outer), (inner_size, inner) = merged
    return inner_size, True, list(zip(outer, inner))


def row_layout(tensors: Sequence[Tensor], norm_ndim: int):
    """Strides of ``tensors`` (one shape ``[B, *, *S]``, the layer norm's) as B x (M0 x M1)
    x (D0 x D1): the per-model batch dims merged into at most two strided dims (rows) and
    the ``norm_ndim`` normalized dims ``S`` into at most two (columns), in every tensor.

    Returns ``(M1, ROW2, D1, COL2, [[s_b, s_m0, s_m1, s_d0, s_d1] per tensor])`` (ROW2,
    COL2: whether the rows, the columns span two dims) or None when a dim group needs
    more than two strided dims.
    """
    shape = [int(s) for s in tensors[0].shape]
    strides = [[int(s) for s in t.stride()] for t in tensors]
    nd = len(shape)
    rows = _split(_merge_dims(shape, strides, range(1, nd - norm_ndim)), len(tensors))
    cols = _split(_merge_dims(shape, strides, range(nd - norm_ndim, nd)), len(tensors))
    if rows is None or cols is None:
        return None
    M1, row2, rs = rows
    D1, col2, cs = cols
    per_tensor = [[st[0], *r, *c] for st, r, c in zip(strides, rs, cs)]
    return M1, row2, D1, col2, per_tensor


def partition(device: torch.device, programs: int, R0: int, R1: int, block_r0: int, block_r1: int):
    """Chunks of each (model, channel block)'s R0 x R1 elements, whole tiles each:
    ``(CHUNK0, CHUNK1, P, P1)``, split over R0 first. ``programs``: models x channel blocks."""
    if device.type != "cuda":  # an interpreter or emulator: a few programs, to exercise the partials
        target = 2 * PROGRAMS_PER_SM
    else:
        target = PROGRAMS_PER_SM * sm_count(device)
    per = max(1, cdiv(target, programs))
    n0, n1 = cdiv(R0, block_r0), cdiv(R1, block_r1)
    tiles0 = cdiv(n0, min(per, n0))
    P0 = cdiv(n0, tiles0)
    tiles1 = cdiv(n1, min(max(1, per // P0), n1))
    P1 = cdiv(n1, tiles1)
    return tiles0 * block_r0, tiles1 * block_r1, P0 * P1, P1


def tile_shape(R0: int, C: int, R1: int, s_c: int, s_r1: int, total: int, inner: int):
    """``(t_r0, t_c, t_r1, channels_inner)``: a tile of at most ``total`` elements, long along
    the dim that runs along memory, whose inner two dims hold at most ``inner``
    (channels_inner: the channels run along memory, not R1)."""
    np2 = next_power_of_2
    if R1 > 1 and s_r1 <= s_c:  # channels-first memory: the reduced inner dim is contiguous
        t_r1 = min(np2(R1), inner)
        t_c = min(np2(C), max(1, inner // t_r1))
        channels_inner = False
    else:  # channels run along memory ([B, N, C], channels-last)
        t_c = min(np2(C), inner)
        t_r1 = min(np2(R1), max(1, inner // t_c))
        channels_inner = True
    t_r0 = min(np2(R0), max(1, total // (t_c * t_r1)))
    return t_r0, t_c, t_r1, channels_inner


def addressed(layout_of: Callable[[list[Tensor]], Any], inputs: Sequence[Tensor], out: Tensor | None):
    """``(inputs, out, lay)`` as the kernels read and write them: the tensors themselves
    where ``layout_of`` reduces their strides (``lay``, its result), else contiguous
    copies of the inputs and a fresh contiguous ``out`` (rarer layouts; the caller
    copies the kernels' output back into its own when it is not the one it passed).
    ``out`` None: the call writes no full-size output."""
    outs = [] if out is None else [out]
    lay = layout_of([*inputs, *outs])
    if lay is not None:
        return list(inputs), out, lay
    inputs = [t.contiguous() for t in inputs]
    out = None if out is None else torch.empty_like(out, memory_format=torch.contiguous_format)
    return inputs, out, layout_of([*inputs, *([] if out is None else [out])])


def backward_outputs(x: Tensor, weight: Tensor | None, output_mask: Sequence[bool],
                     param_shape: Sequence[int], *, launch: bool = False) -> tuple[Tensor, ...]:
    """What a norm's backward op returns: grad_x ``empty_like(x)`` and one parameter
    gradient ``param_shape`` in weight's dtype (x's without a weight) per further mask
    entry; where the entry is False, a distinct empty ``[0]`` tensor of x's dtype
    (custom-op outputs may not alias). ``launch``: for a launcher, whose kernels write
    them; an empty x launches nothing, and its parameter gradients, sums over nothing,
    are zeros."""
    param_dtype = x.dtype if weight is None else weight.dtype

    def param_grad(wanted: bool) -> Tensor:
        if not wanted:
            return x.new_empty(0)
        grad = x.new_empty(tuple(param_shape), dtype=param_dtype)
        return grad.zero_() if launch and x.numel() == 0 else grad

    grad_x = torch.empty_like(x) if output_mask[0] else x.new_empty(0)
    return (grad_x, *(param_grad(bool(m)) for m in output_mask[1:]))
