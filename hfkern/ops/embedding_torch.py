"""Array embedding on the pure-PyTorch path: one lookup over the ``[B*V, D]`` table.

The B models' tables are one ``[B*V, D]`` table; model b's index ``i`` is row
``b*V + i`` of it, so the B lookups (and the B gradient scatters, and the B
max-norm renormalizations) are one aten call each. A shared index tensor
(stride 0 on the array dim) needs no offsets: the forward is one
``index_select`` along the vocabulary dim of ``[B, V, D]``.

Shapes::

    weight    [B, V, D]
    indices   [B, *] int64 or int32 (any strides; stride 0 on dim 0: shared)
    out       [B, *, D]
    grad_out  [B, *, D]

Determinism: the dense backward is aten's ``embedding_dense_backward`` over the
flat table (the kernel ``torch.nn.Embedding`` itself uses), not ``index_add_``:
on CPU it is a sequential scatter, on CUDA a sort by row followed by per-row
sums, and torch does not list it among its nondeterministic operations. The
sparse backward and the renorm do no reductions across indices.
"""

from __future__ import annotations

import torch

from .._array import is_shared

aten = torch.ops.aten

_INT32_MAX = torch.iinfo(torch.int32).max


def offset_indices(indices: torch.Tensor, num_weights: int) -> torch.Tensor:
    """``[B, *]`` per-model indices -> ``[B*n]`` contiguous rows of the ``[B*V, D]`` table.

    Keeps int32 indices int32 unless a row number of the flat table could
    exceed the int32 range.
    """
    B = indices.shape[0]
    dtype = torch.int64 if B * num_weights > _INT32_MAX else indices.dtype
    offsets = torch.arange(0, B * num_weights, num_weights, device=indices.device, dtype=dtype)
    offsets = offsets.view(B, *([1] * (indices.dim() - 1)))
    # Written into a contiguous buffer so that indices with any strides (an
    # [N, B] memory order, a broadcast) flatten without a second copy.
    out = torch.empty(indices.shape, dtype=dtype, device=indices.device)
    return torch.add(indices, offsets, out=out).view(-1)


def array_embedding(
    weight: torch.Tensor,
    indices: torch.Tensor,
    padding_idx: int = -1,
    scale_grad_by_freq: bool = False,
    sparse: bool = False,
) -> torch.Tensor:
    """out[b, ...] = weight[b, indices[b, ...]]; the remaining arguments only shape the backward."""
    B, V, D = weight.shape
    if is_shared(indices):
        rows = indices[0].reshape(-1)
        return weight.index_select(1, rows).view(B, *indices.shape[1:], D)
    table = weight.reshape(B * V, D)
    return table.index_select(0, offset_indices(indices, V)).view(*indices.shape, D)


def array_embedding_backward(
    grad_out: torch.Tensor,
    indices: torch.Tensor,
    num_weights: int,
    padding_idx: int,
    scale_grad_by_freq: bool,
) -> torch.Tensor:
    """Dense weight gradient ``[B, num_weights, D]``.

    Row counts for ``scale_grad_by_freq`` are counted per flat row, i.e. per
    model, because each model's rows are distinct rows of the flat table.
    """
    B, D = grad_out.shape[0], grad_out.shape[-1]
    rows = offset_indices(indices, num_weights)
    grad = aten.embedding_dense_backward(
        grad_out.reshape(rows.numel(), D), rows, B * num_weights, -1, scale_grad_by_freq
    ).view(B, num_weights, D)
    if padding_idx >= 0:
        # aten takes one padding row; each model's padding row is a different
        # flat row, so they are cleared here instead.
        grad[:, padding_idx] = 0
    return grad


def array_embedding_sparse_backward(
    grad_out: torch.Tensor,
    indices: torch.Tensor,
    num_weights: int,
    padding_idx: int,
) -> torch.Tensor:
    """Sparse COO weight gradient ``[B, num_weights, D]`` (2 sparse dims, 1 dense).

    Uncoalesced, one entry per looked-up index in input order with the padding
    entries left out, so ``grad[b]`` is exactly the gradient ``torch.nn.Embedding``
    with ``sparse=True`` gives model b.
    """
    B, D = grad_out.shape[0], grad_out.shape[-1]
    models = torch.arange(B, device=indices.device).view(B, *([1] * (indices.dim() - 1)))
    models = models.expand(indices.shape).reshape(-1)
    rows = indices.reshape(-1).to(torch.int64)
    values = grad_out.reshape(rows.numel(), D)
    if padding_idx >= 0:
        keep = rows != padding_idx
        models, rows, values = models[keep], rows[keep], values[keep]
    else:
        values = values.clone()  # the gradient must not alias grad_out
    return torch.sparse_coo_tensor(
        torch.stack([models, rows]), values, (B, num_weights, D), check_invariants=False
    )


def array_embedding_renorm_(
    weight: torch.Tensor, indices: torch.Tensor, max_norm: float, norm_type: float
) -> None:
    """In place: rescale each row of model b referenced by ``indices[b]`` to norm <= max_norm."""
    B, V, D = weight.shape
    rows = offset_indices(indices, V)
    if weight.is_contiguous():
        torch.embedding_renorm_(weight.view(B * V, D), rows, max_norm, norm_type)
    else:
        table = weight.contiguous().view(B * V, D)
        torch.embedding_renorm_(table, rows, max_norm, norm_type)
        weight.copy_(table.view(B, V, D))
