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

Indices must lie in ``[0, V)``. The lookup ops do not check this (that would
cost a device synchronization per call); an out-of-range index can read another
model's rows, so callers check at the Python boundary, as
:class:`hfkern.nn.Embedding` does, with :func:`raise_if_out_of_range` in eager
mode and ``embedding_checked_indices(values, num_embeddings, shared, module)``
(an op opaque to the compiler that returns a checked copy) under
``torch.compile``; both raise the same IndexError.
"""

from __future__ import annotations

import torch
from torch import Tensor

from .. import _backend
from . import embedding_torch

_FWD = "array_embedding"
_BWD = "array_embedding_backward"
_SPARSE_BWD = "array_embedding_sparse_backward"
_RENORM = "array_embedding_renorm_"


# ---- index range check (for callers at the Python boundary) ---------------------

def raise_if_out_of_range(module: str, values: Tensor, num_embeddings: int, shared: bool) -> None:
    """IndexError naming the first bad value and its model, if ``values`` leaves ``[0, num_embeddings)``.

    ``values`` is the ``[B, *]`` index tensor, or the ``[*]`` tensor a shared
    input broadcasts. Reads one min/max pair back to the host.
    """
    if values.numel() == 0:
        return
    lo, hi = (int(v) for v in torch.aminmax(values))
    if lo >= 0 and hi < num_embeddings:
        return
    bad = lo if lo < 0 else hi
    if shared:
        where = "the shared input"
    else:
        model = int((values == bad).reshape(values.size(0), -1).any(dim=1).nonzero()[0, 0])
        where = f"model {model}'s input"
    raise IndexError(
        f"{module}: index {bad} in {where} is out of range: expected indices in "
        f"[0, {num_embeddings}) (num_embeddings={num_embeddings})"
    )


# The range check as an op the compiler cannot see into, so that a compiled
# model raises the eager IndexError (with the same message) at run time instead
# of tracing a device-side assertion, which raises RuntimeError on CPU and
# poisons the CUDA context on GPU. It returns a copy of the indices (an op may
# not return its input) that the lookup then reads, which keeps the check in
# the graph and ordered before the lookup. It synchronizes with the device, as
# the eager check does, so it is marked unsafe for CUDA-graph capture.
_CUDAGRAPH_UNSAFE = tuple(t for t in (getattr(torch.Tag, "cudagraph_unsafe", None),) if t is not None)


@torch.library.custom_op("hfkern::embedding_checked_indices", mutates_args=(), tags=_CUDAGRAPH_UNSAFE)
def embedding_checked_indices(
    values: Tensor, num_embeddings: int, shared: bool, module: str
) -> Tensor:
    """``values`` (a copy) if every index is in ``[0, num_embeddings)``; IndexError otherwise."""
    raise_if_out_of_range(module, values, num_embeddings, shared)
    return values.clone()


@embedding_checked_indices.register_fake
def _(values, num_embeddings, shared, module):
    return torch.empty_like(values)


@torch.library.custom_op("hfkern::array_embedding", mutates_args=())
def array_embedding(
    weight: Tensor,
    indices: Tensor,
    padding_idx: int = -1,
    scale_grad_by_freq: bool = False,
    sparse: bool = False,
) -> Tensor:
    fn = _backend.resolve(_FWD, weight.device)
    return fn(weight, indices, padding_idx, scale_grad_by_freq, sparse)


@array_embedding.register_fake
def _(weight, indices, padding_idx=-1, scale_grad_by_freq=False, sparse=False):
    return weight.new_empty((*indices.shape, weight.shape[-1]))


@torch.library.custom_op("hfkern::array_embedding_backward", mutates_args=())
def array_embedding_backward(
    grad_out: Tensor,
    indices: Tensor,
    num_weights: int,
    padding_idx: int,
    scale_grad_by_freq: bool,
) -> Tensor:
    fn = _backend.resolve(_BWD, grad_out.device)
    return fn(grad_out, indices, num_weights, padding_idx, scale_grad_by_freq)


@array_embedding_backward.register_fake
def _(grad_out, indices, num_weights, padding_idx, scale_grad_by_freq):
    return grad_out.new_empty((grad_out.shape[0], num_weights, grad_out.shape[-1]))


@torch.library.custom_op("hfkern::array_embedding_sparse_backward", mutates_args=())
def array_embedding_sparse_backward(
    grad_out: Tensor,
    indices: Tensor,
    num_weights: int,
    padding_idx: int,
) -> Tensor:
    fn = _backend.resolve(_SPARSE_BWD, grad_out.device)
    return fn(grad_out, indices, num_weights, padding_idx)


@array_embedding_sparse_backward.register_fake
def _(grad_out, indices, num_weights, padding_idx):
    return torch.empty(
        (grad_out.shape[0], num_weights, grad_out.shape[-1]),
        dtype=grad_out.dtype, device=grad_out.device, layout=torch.sparse_coo,
    )


@torch.library.custom_op("hfkern::array_embedding_renorm_", mutates_args=("weight",))
def array_embedding_renorm_(weight: Tensor, indices: Tensor, max_norm: float, norm_type: float) -> None:
    fn = _backend.resolve(_RENORM, weight.device)
    fn(weight, indices, max_norm, norm_type)


@array_embedding_renorm_.register_fake
def _(weight, indices, max_norm, norm_type):
    return None


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
        rows = embedding_torch.offset_indices(indices, num_weights)
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

_backend.register(_FWD, "torch", embedding_torch.array_embedding)
_backend.register(_BWD, "torch", embedding_torch.array_embedding_backward)
_backend.register(_SPARSE_BWD, "torch", embedding_torch.array_embedding_sparse_backward)
_backend.register(_RENORM, "torch", embedding_torch.array_embedding_renorm_)


# The Triton implementations are torch.library triton ops defined in
# hfkern/ops/embedding_triton.py, imported on first use (defining a triton op
# imports triton and parts of inductor, which plain "import hfkern" should not
# pay for). The sparse backward and the renorm stay torch-only: neither reduces
# across indices, and aten's kernels for them are already single passes.
# auto=False: auto picks them only once a GPU benchmark shows them faster.
for _op in (_FWD, _BWD):
    _backend.register(_op, "triton", f"hfkern.ops.embedding_triton:{_op}_triton",
                      device_types=("cuda",), auto=False)
