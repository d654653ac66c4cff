"""hfkern::array_embedding: B embedding lookups (B tables, B index tensors) as one op.

Ops (all registered with torch.library, implementations chosen by the registry):

``array_embedding(weight, indices, padding_idx=-1, scale_grad_by_freq=False, sparse=False)``
    weight ``[B, V, D]``, indices ``[B, *]`` int64 or int32 with any strides
    (stride 0 on dim 0: one index tensor shared by the B models). Returns
    ``[B, *, D]`` with ``out[b, ...] = weight[b, indices[b, ...]]``. The last
    three arguments mean what they mean for ``aten::embedding`` and only shape
    the backward: ``padding_idx`` (``-1``: none; otherwise in ``[0, V)``) rows
    get no gradient, ``scale_grad_by_freq`` divides each row's gradient by the
    number of times that model's indices hit it, ``sparse`` makes the weight
    gradient a sparse COO tensor.
``array_embedding_backward(grad_out, indices, num_weights, padding_idx, scale_grad_by_freq)``
    The dense weight gradient ``[B, num_weights, D]``, deterministic.
``array_embedding_sparse_backward(grad_out, indices, num_weights, padding_idx)``
    The sparse COO weight gradient ``[B, num_weights, D]`` (sparse dims B and
    V, dense dim D); its slice ``[b]`` is the gradient ``torch.nn.Embedding``
    with ``sparse=True`` gives model b.
``array_embedding_renorm_(weight, indices, max_norm, norm_type)``
    In place, no autograd: each row of model b referenced by ``indices[b]``
    whose ``norm_type``-norm exceeds ``max_norm`` is rescaled to ``max_norm``
    (``torch.embedding_renorm_`` per model). Call under ``torch.no_grad()``.

The two backward ops are differentiable (double backward: gradient penalties,
MAML): both are linear in ``grad_out``, and their adjoint is the lookup of the
incoming weight gradient at ``indices`` (``array_embedding``, on the backend
the backward ran), zero at ``padding_idx`` and divided by the row's hit
count under ``scale_grad_by_freq``. ``indices`` are not differentiable.

Indices must lie in ``[0, V)``. The lookup ops do not check this; an
out-of-range index can read another model's rows, so callers check at the
Python boundary, as :class:`hfkern.nn.Embedding` does, with
:func:`raise_if_out_of_range` (IndexError on the CPU, a device-side assertion
without a synchronization on CUDA) in eager mode and ``embedding_checked_indices(values, num_embeddings, shared, module)``
(an op opaque to the compiler that returns a checked copy) under
``torch.compile``; both raise the same IndexError.
"""

from __future__ import annotations

import torch
from torch import Tensor

from .. import _backend
from .._array import is_shared, refuse_forward_ad

__all__ = [
    "array_embedding", "array_embedding_backward", "array_embedding_sparse_backward",
    "array_embedding_renorm_", "embedding_checked_indices", "raise_if_out_of_range",
]

_FWD, _BWD = "array_embedding", "array_embedding_backward"
_SPARSE_BWD, _RENORM = "array_embedding_sparse_backward", "array_embedding_renorm_"

aten = torch.ops.aten

_INT32_MAX = torch.iinfo(torch.int32).max


# ---- the torch implementations (CPU path and oracle) ---------------------------
#
# One lookup over the ``[B*V, D]`` table: the B models' tables are one table
# and model b's index ``i`` is row ``b*V + i`` of it, so the B lookups (and the
# B gradient scatters, and the B max-norm renormalizations) are one aten call
# each. A shared index tensor (stride 0 on the array dim) needs no offsets: the
# forward is one ``index_select`` along the vocabulary dim of ``[B, V, D]``.
#
# Shapes::
#
#     weight    [B, V, D]
#     indices   [B, *] int64 or int32 (any strides; stride 0 on dim 0: shared)
#     out       [B, *, D]
#     grad_out  [B, *, D]
#
# Determinism: the dense backward is aten's ``embedding_dense_backward`` over
# the flat table (the kernel ``torch.nn.Embedding`` itself uses), not
# ``index_add_``: on CPU it is a sequential scatter, on CUDA a sort by row
# followed by per-row sums, and torch does not list it among its
# nondeterministic operations. The sparse backward and the renorm do no
# reductions across indices.


def _offset_indices(indices: Tensor, num_weights: int) -> Tensor:
    """``[B, *]`` per-model indices -> ``[B*n]`` contiguous rows of the ``[B*V, D]`` table.

    Keeps int32 indices int32 unless a row number of the flat table could
    exceed the int32 range.
    """
    B = indices.shape[0]
    dtype = torch.int64 if B * num_weights > _INT32_MAX else indices.dtype
    if num_weights == 0:  # empty tables (no valid index, as torch's): torch.arange takes no step 0
        offsets = torch.zeros(B, device=indices.device, dtype=dtype)
    else:
        offsets = torch.arange(0, B * num_weights, num_weights, device=indices.device, dtype=dtype)
    offsets = offsets.view(B, *([1] * (indices.dim() - 1)))
    # Indices with any strides (an [N, B] memory order, a broadcast) flatten through a
    # contiguous copy of the sum. (An out= buffer saved that copy in eager mode, but traced
    # with dynamic shapes the sum written into it kept the indices' strides, and the flat
    # view of it failed.)
    return (indices.to(dtype) + offsets).contiguous().view(-1)


@_backend.implements(_FWD, "torch")
def array_embedding_torch(
    weight: Tensor, indices: Tensor, padding_idx: int = -1, scale_grad_by_freq: bool = False,
    sparse: bool = False,
) -> Tensor:
    """out[b, ...] = weight[b, indices[b, ...]]; the remaining arguments only shape the backward.

    The result is a fresh tensor, not a view: the lookup writes through a flat view
    into the ``[B, *, D]`` output it returns (``index_select(..., out=)``, no copy).
    Returning ``index_select(...).view(...)`` instead gave a view of an intermediate,
    which autograd marks as created inside a custom Function (``_EagerEmbedding``,
    the op's autograd wrapper) and so refuses every in-place write into it
    (``h[:, 0] = cls``, ``h.mul_(2)``) that ``torch.nn.Embedding``'s output takes.
    """
    B, V, D = weight.shape
    out = weight.new_empty((*indices.shape, D))  # contiguous
    if is_shared(indices):
        rows = indices[0].reshape(-1)
        torch.index_select(weight, 1, rows, out=out.view(B, rows.numel(), D))
        return out
    table = weight.reshape(B * V, D)
    rows = _offset_indices(indices, V)
    torch.index_select(table, 0, rows, out=out.view(rows.numel(), D))
    return out


@_backend.implements(_BWD, "torch")
def array_embedding_backward_torch(
    grad_out: Tensor, indices: Tensor, num_weights: int, padding_idx: int, scale_grad_by_freq: bool,
) -> Tensor:
    """Dense weight gradient ``[B, num_weights, D]``.

    Row counts for ``scale_grad_by_freq`` are counted per flat row, i.e. per
    model, because each model's rows are distinct rows of the flat table.
    """
    B, D = grad_out.shape[0], grad_out.shape[-1]
    rows = _offset_indices(indices, num_weights)
    grad = aten.embedding_dense_backward(
        grad_out.reshape(rows.numel(), D), rows, B * num_weights, -1, scale_grad_by_freq
    ).view(B, num_weights, D)
    if padding_idx >= 0:
        # aten takes one padding row; each model's padding row is a different
        # flat row, so they are cleared here instead.
        grad[:, padding_idx] = 0
    return grad


@_backend.implements(_SPARSE_BWD, "torch")
def array_embedding_sparse_backward_torch(
    grad_out: Tensor, indices: Tensor, num_weights: int, padding_idx: int,
) -> Tensor:
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


@_backend.implements(_RENORM, "torch")
def array_embedding_renorm_torch(weight: Tensor, indices: Tensor, max_norm: float, norm_type: float) -> None:
    """In place: rescale each row of model b referenced by ``indices[b]`` to norm <= max_norm."""
    B, V, D = weight.shape
    rows = _offset_indices(indices, V)
    table = weight.contiguous().view(B * V, D)  # weight itself when contiguous
    torch.embedding_renorm_(table, rows, max_norm, norm_type)
    if not weight.is_contiguous():
        weight.copy_(table.view(B, V, D))


# ---- index range check (for callers at the Python boundary) ---------------------

# Device types on which the range check is a device-side assertion (no host read).
_ASSERTED_ON = frozenset({"cuda"})


def raise_if_out_of_range(module: str, values: Tensor, num_embeddings: int, shared: bool, *,
                          item: str = "index", limit: str = "num_embeddings") -> None:
    """IndexError naming the first bad value and its model, if ``values`` leaves ``[0, num_embeddings)``.

    ``values`` is the ``[B, *]`` index tensor, or the ``[*]`` tensor a shared
    input broadcasts. Reads one min/max pair back to the host, except on CUDA:
    there a bad index fails a device-side assertion instead, which is what
    ``torch.nn.functional.embedding`` does on CUDA, so that a training step never
    waits for the device (the host keeps issuing ahead of it) and can be
    captured as a CUDA graph. The assertion surfaces as a RuntimeError at a
    later synchronization and leaves the CUDA context unusable, as torch's does;
    the same indices on the CPU name the index and the model.
    """
    if values.numel() == 0:
        return
    lo, hi = torch.aminmax(values)
    if values.device.type in _ASSERTED_ON:
        torch._assert_async((lo >= 0) & (hi < num_embeddings),
                            f"{module}: {'an' if item[0] in 'aeiou' else 'a'} {item} is out of range "
                            f"[0, {num_embeddings})")
        return
    lo, hi = int(lo), int(hi)
    if lo >= 0 and hi < num_embeddings:
        return
    bad = lo if lo < 0 else hi
    if shared:
        where = "the shared input"
    else:
        model = int((values == bad).reshape(values.size(0), -1).any(dim=1).nonzero()[0, 0])
        where = f"model {model}'s input"
    raise IndexError(
        f"{module}: {item} {bad} in {where} is out of range: expected {'indices' if item == 'index' else item + 's'} in "
        f"[0, {num_embeddings}) ({limit}={num_embeddings})"
    )


# The range check as an op the compiler cannot see into, so that a compiled
# model checks as the eager one does (raise_if_out_of_range: on the CPU the
# IndexError with the same message, on CUDA the device-side assertion) instead
# of tracing an assertion of its own, which raises RuntimeError on the CPU. It
# returns a copy of the indices (an op may not return its input) that the
# lookup then reads, which keeps the check in the graph and ordered before the
# lookup. On CUDA it does not synchronize, so CUDA graphs may capture it.
@torch.library.custom_op("hfkern::embedding_checked_indices", mutates_args=())
def embedding_checked_indices(
    values: Tensor, num_embeddings: int, shared: bool, module: str, item: str = "index",
    limit: str = "num_embeddings",
) -> Tensor:
    """``values`` (a copy) if every index is in ``[0, num_embeddings)``; IndexError otherwise."""
    raise_if_out_of_range(module, values, num_embeddings, shared, item=item, limit=limit)
    return values.clone()


@embedding_checked_indices.register_fake
def _(values, num_embeddings, shared, module, item="index", limit="num_embeddings"):
    return torch.empty_like(values)


def _check_padding_idx(op: str, padding_idx: int, num_weights: int) -> None:
    """The contract's padding_idx: -1 (none) or a row in ``[0, num_weights)``, for every backend alike."""
    if padding_idx != -1 and not 0 <= padding_idx < num_weights:
        raise ValueError(f"hfkern::{op}: expected padding_idx -1 (none) or in [0, {num_weights}), "
                         f"got {padding_idx}")


_INDEX_DTYPES = (torch.int64, torch.int32)


def _check_indices(op: str, indices: Tensor, B: int, device: torch.device, owner: str) -> None:
    """``indices`` ``[B, *]`` int64 or int32 on ``device`` (``owner``: the argument whose B and
    device those are)."""
    if indices.dtype not in _INDEX_DTYPES:
        raise TypeError(f"hfkern::{op}: expected indices of dtype torch.int64 or torch.int32, got {indices.dtype}")
    if indices.dim() == 0 or indices.shape[0] != B:
        raise ValueError(
            f"hfkern::{op}: expected indices of shape [B, *] with B = {B} ({owner}'s; an index tensor shared "
            f"by the models is expanded to B, stride 0), got {list(indices.shape)}"
        )
    if indices.device != device:
        raise ValueError(f"hfkern::{op}: expected indices on {owner}'s device ({device}), got indices on "
                         f"{indices.device}")


def _check_lookup(op: str, weight: Tensor, indices: Tensor, padding_idx: int = -1) -> None:
    """The arguments of the lookup (and of the renorm): weight ``[B, V, D]``, indices ``[B, *]``."""
    if weight.dim() != 3:
        raise ValueError(f"hfkern::{op}: expected weight of shape [B, V, D], got {list(weight.shape)}")
    _check_indices(op, indices, weight.shape[0], weight.device, "weight")
    _check_padding_idx(op, padding_idx, weight.shape[1])


def _check_grad(op: str, grad_out: Tensor, indices: Tensor, num_weights: int, padding_idx: int) -> None:
    """The arguments of a backward op: grad_out ``[*indices.shape, D]``, indices ``[B, *]``."""
    if grad_out.dim() != indices.dim() + 1 or grad_out.shape[:-1] != indices.shape:
        raise ValueError(
            f"hfkern::{op}: expected grad_out of shape [*indices.shape, D] = {list(indices.shape)} + [D], "
            f"got {list(grad_out.shape)}"
        )
    _check_indices(op, indices, grad_out.shape[0], grad_out.device, "grad_out")
    if num_weights < 0:
        raise ValueError(f"hfkern::{op}: expected num_weights >= 0, got {num_weights}")
    _check_padding_idx(op, padding_idx, num_weights)


@torch.library.custom_op("hfkern::array_embedding", mutates_args=())
def array_embedding(
    weight: Tensor,
    indices: Tensor,
    padding_idx: int = -1,
    scale_grad_by_freq: bool = False,
    sparse: bool = False,
) -> Tensor:
    _check_lookup(_FWD, weight, indices, padding_idx)
    fn = _backend.resolve(_FWD, weight.device)
    return fn(weight, indices, padding_idx, scale_grad_by_freq, sparse)


@array_embedding.register_fake
def _(weight, indices, padding_idx=-1, scale_grad_by_freq=False, sparse=False):
    _check_lookup(_FWD, weight, indices, padding_idx)
    return weight.new_empty((*indices.shape, weight.shape[-1]))


@torch.library.custom_op("hfkern::array_embedding_backward", mutates_args=())
def array_embedding_backward(
    grad_out: Tensor,
    indices: Tensor,
    num_weights: int,
    padding_idx: int,
    scale_grad_by_freq: bool,
) -> Tensor:
    _check_grad(_BWD, grad_out, indices, num_weights, padding_idx)
    fn = _backend.resolve(_BWD, grad_out.device)
    return fn(grad_out, indices, num_weights, padding_idx, scale_grad_by_freq)


@array_embedding_backward.register_fake
def _(grad_out, indices, num_weights, padding_idx, scale_grad_by_freq):
    _check_grad(_BWD, grad_out, indices, num_weights, padding_idx)
    return grad_out.new_empty((grad_out.shape[0], num_weights, grad_out.shape[-1]))


@torch.library.custom_op("hfkern::array_embedding_sparse_backward", mutates_args=())
def array_embedding_sparse_backward(
    grad_out: Tensor,
    indices: Tensor,
    num_weights: int,
    padding_idx: int,
) -> Tensor:
    _check_grad(_SPARSE_BWD, grad_out, indices, num_weights, padding_idx)
    fn = _backend.resolve(_SPARSE_BWD, grad_out.device)
    return fn(grad_out, indices, num_weights, padding_idx)


@array_embedding_sparse_backward.register_fake
def _(grad_out, indices, num_weights, padding_idx):
    _check_grad(_SPARSE_BWD, grad_out, indices, num_weights, padding_idx)
    return torch.empty(
        (grad_out.shape[0], num_weights, grad_out.shape[-1]),
        dtype=grad_out.dtype, device=grad_out.device, layout=torch.sparse_coo,
    )


def _check_renorm(weight: Tensor, indices: Tensor) -> None:
    """The lookup's checks, and a weight the renorm can write in place: floating point, each
    element its own memory (an expanded table would be written through several rows at once)."""
    _check_lookup(_RENORM, weight, indices)
    if not weight.is_floating_point():
        raise TypeError(f"hfkern::{_RENORM}: expected a floating-point weight, got {weight.dtype}")
    if torch._debug_has_internal_overlap(weight) == 1:
        raise ValueError(f"hfkern::{_RENORM}: expected a weight whose elements have memory of their own (it is "
                         f"written in place), got one with strides {list(weight.stride())} (expanded?)")


@torch.library.custom_op("hfkern::array_embedding_renorm_", mutates_args=("weight",))
def array_embedding_renorm_(weight: Tensor, indices: Tensor, max_norm: float, norm_type: float) -> None:
    _check_renorm(weight, indices)
    fn = _backend.resolve(_RENORM, weight.device)
    fn(weight, indices, max_norm, norm_type)


@array_embedding_renorm_.register_fake
def _(weight, indices, max_norm, norm_type):
    _check_renorm(weight, indices)


def _setup_context(ctx, inputs, output):
    weight, indices, padding_idx, scale_grad_by_freq, sparse = inputs
    ctx.save_for_backward(indices)
    ctx.num_weights = weight.shape[1]
    ctx.padding_idx = padding_idx
    ctx.scale_grad_by_freq = scale_grad_by_freq
    ctx.sparse = sparse
    # The backward runs pinned to the forward's backend, whatever thread runs it.
    ctx.backend = _backend.current(_FWD, weight.device)


def _backward(ctx, grad_out):
    with _backend.pinned(ctx.backend):
        return _weight_grad(ctx, grad_out)


def _weight_grad(ctx, grad_out):
    (indices,) = ctx.saved_tensors
    grad_w = None
    if ctx.needs_input_grad[0]:
        if ctx.sparse:
            if ctx.scale_grad_by_freq:
                # torch.nn.Embedding refuses this combination at the same point.
                raise RuntimeError(
                    "array_embedding backward: scale_grad_by_freq is not supported with sparse "
                    "gradients (sparse=True); use sparse=False or scale_grad_by_freq=False"
                )
            grad_w = array_embedding_sparse_backward(grad_out, indices, ctx.num_weights, ctx.padding_idx)
        else:
            grad_w = array_embedding_backward(
                grad_out, indices, ctx.num_weights, ctx.padding_idx, ctx.scale_grad_by_freq
            )
    return grad_w, None, None, None, None


array_embedding.register_autograd(_backward, setup_context=_setup_context)


def embedding(weight: Tensor, indices: Tensor, padding_idx: int = -1, scale_grad_by_freq: bool = False,
              sparse: bool = False) -> Tensor:
    """``array_embedding``'s arguments and result, differentiable (what ``hfkern.nn.Embedding``
    calls). Where the torch backend serves the call in eager mode
    (:func:`hfkern._backend.eager_torch`), an autograd Function runs the registered torch
    implementations directly with the op's formula, without the dispatcher's host time; a
    backward that builds a graph (``create_graph=True``), or a sparse one, runs the op's
    formula."""
    if not _backend.eager_torch(_FWD, weight.device):
        refuse_forward_ad(_FWD, weight)
        return array_embedding(weight, indices, padding_idx, scale_grad_by_freq, sparse)
    _check_lookup(_FWD, weight, indices, padding_idx)
    return _EagerEmbedding.apply(weight, indices, padding_idx, scale_grad_by_freq, sparse)


class _EagerEmbedding(torch.autograd.Function):
    @staticmethod
    def forward(ctx, weight, indices, padding_idx, scale_grad_by_freq, sparse):
        out = _backend.resolve(_FWD, weight.device)(weight, indices, padding_idx, scale_grad_by_freq, sparse)
        _setup_context(ctx, (weight, indices, padding_idx, scale_grad_by_freq, sparse), out)
        return out

    @staticmethod
    def backward(ctx, grad_out):
        if torch.is_grad_enabled() or ctx.sparse or not ctx.needs_input_grad[0]:
            return _backward(ctx, grad_out)
        (indices,) = ctx.saved_tensors
        with _backend.pinned(ctx.backend):
            fn = _backend.resolve(_BWD, grad_out.device)
        return fn(grad_out, indices, ctx.num_weights, ctx.padding_idx, ctx.scale_grad_by_freq), None, None, None, None


# The backward ops' gradients are written out: both are linear in grad_out,
# grad_w[b, v] = sum over positions p with indices[b, p] == v of s[b, p] * grad_out[b, p]
# with s = 0 at padding_idx, 1 / (hits of row v in model b) under
# scale_grad_by_freq, else 1. The adjoint is a lookup and a scale,
# d grad_out[b, p] = s[b, p] * dgrad_w[b, indices[b, p]]: one forward op
# (differentiable again, so every order is exact) and elementwise torch ops.

def _row_scale(indices: Tensor, num_weights: int, padding_idx: int, scale_grad_by_freq: bool,
               dtype: torch.dtype) -> Tensor | None:
    """s above as [B, *, 1] in ``dtype``, or None where it is 1 everywhere."""
    if padding_idx < 0 and not scale_grad_by_freq:
        return None
    scale = torch.ones(indices.shape, dtype=dtype, device=indices.device)
    if scale_grad_by_freq:
        rows = _offset_indices(indices, num_weights)
        hits = torch.bincount(rows, minlength=indices.shape[0] * num_weights)
        scale = scale / hits.index_select(0, rows).view(indices.shape).to(dtype)
    if padding_idx >= 0:
        scale = scale.masked_fill(indices == padding_idx, 0)
    return scale.unsqueeze(-1)


def _backward_op_setup_context(op: str):
    def setup_context(ctx, inputs, output):
        grad_out, indices, num_weights, padding_idx, *scale_grad_by_freq = inputs
        ctx.save_for_backward(indices)
        ctx.num_weights = num_weights
        ctx.padding_idx = padding_idx
        ctx.scale_grad_by_freq = bool(scale_grad_by_freq and scale_grad_by_freq[0])
        ctx.backend = _backend.current(op, grad_out.device)
    return setup_context


def _backward_op_backward(ctx, grad_grad_w):
    (indices,) = ctx.saved_tensors
    n_args = len(ctx.needs_input_grad)
    if not ctx.needs_input_grad[0]:
        return (None,) * n_args
    if grad_grad_w.layout != torch.strided:  # the sparse backward's gradient may be sparse
        grad_grad_w = grad_grad_w.to_dense()
    with _backend.pinned(ctx.backend):
        d_grad_out = array_embedding(grad_grad_w, indices)
    scale = _row_scale(indices, ctx.num_weights, ctx.padding_idx, ctx.scale_grad_by_freq,
                       d_grad_out.dtype)
    if scale is not None:
        d_grad_out = d_grad_out * scale
    return (d_grad_out,) + (None,) * (n_args - 1)


array_embedding_backward.register_autograd(
    _backward_op_backward, setup_context=_backward_op_setup_context(_BWD)
)
array_embedding_sparse_backward.register_autograd(
    _backward_op_backward, setup_context=_backward_op_setup_context(_SPARSE_BWD)
)
