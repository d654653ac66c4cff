"""hfkern::array_embedding and its dense backward on the CUDA kernels (csrc/embedding/embedding.cu).

The launchers take exactly the arguments of the ops in :mod:`hfkern.ops.embedding`
(whose module docstring is the op contract; its torch implementations are the
oracle) and register themselves as the ``cuda`` implementations. The sparse
backward and the renorm stay torch-only, as on the Triton backend: neither
reduces across indices.

Shapes::

    weight    [B, V, D]  any strides
    indices   [B, *]     int32 or int64, any strides (stride 0 on dim 0: shared)
    out       [B, *, D]  contiguous
    grad_out  [B, *, D]  any strides
    grad_w    [B, V, D]  contiguous

The ``*`` dims of indices and grad_out are addressed through their strides,
collapsed to at most two dims ``[M, L]``, so strided inputs are read where
they lie; only a layout that does not collapse to two dims is copied first.

Forward: a row copy per lookup in the widest word (2 to 16 bytes) that the
table's and the output's alignment allow. Backward: the (b * V + index,
position) pairs are sorted once with ``cub::DeviceRadixSort::SortPairs`` (one
sort for all B tables when the indices are shared), a binary search per row
gives each row's segment of the sorted order, and each row of the gradient is
the sum of its segment's grad rows in sorted (stable, hence input) order;
rows hit more than ``chunk`` times are summed in chunks first, whose partials
are added in order (csrc/embedding/embedding.cu). No atomics: two runs give
bitwise equal gradients. The sort's temporary storage is a torch tensor, and
every launch runs on torch's current stream.

``emulated(op)`` runs the same launchers on CPU tensors through
``hfkern._C_emu``, the kernels built for the host grid emulator, where the
sort step is a host ``std::stable_sort`` behind the same entry point (CUB is
device-only); every other step runs as emulated kernels.
"""

from __future__ import annotations

import math
from typing import Callable

import torch
from torch import Tensor

from .._array import lookup_dims
from .._dtypes import KERNEL_DTYPES
from . import _ext
from ._launch import Launcher, implements

__all__ = ["array_embedding", "array_embedding_backward", "emulated"]

_FWD, _BWD = "array_embedding", "array_embedding_backward"
_INT32_MAX = 2**31 - 1
_INDEX_DTYPES = (torch.int32, torch.int64)

# Threads per block; under the emulator every block is a group of host threads:
# small blocks, so that small test shapes span several blocks.
_THREADS, _EMULATED_THREADS = 256, 8
# Lanes along a row (forward, backward rows) and along D (chunk sums).
_ROW_LANES, _EMULATED_ROW_LANES = 32, 4
_CHUNK_LANES, _EMULATED_CHUNK_LANES = 128, 4
# Hits of one row summed by one thread before the row is cut into chunks. It fixes
# the summation order, so it is a constant per device kind, never tuned per call;
# tiny under the emulator so that small tests cut rows into several chunks.
CHUNK, EMULATED_CHUNK = 64, 4


def _pow2_at_most(x: int, cap: int) -> int:
    return min(cap, 1 << max(0, x - 1).bit_length())


def _word_layout(weight: Tensor, out: Tensor) -> tuple[int, int, int, int, int]:
    """(word bytes, Dw, s_wb, s_wv, s_wd) in words: the widest word (<= 16 bytes) that
    every row start of the table and the output is aligned to."""
    B, V, D = weight.shape
    elem = weight.element_size()
    s_wb, s_wv, s_wd = (s if size > 1 else 0 for s, size in zip(weight.stride(), weight.shape))
    if D == 1 or s_wd == 1:
        row = D * elem
        for word in (16, 8, 4, 2):
            if word < elem or word % elem or row % word:
                continue
            if (weight.data_ptr() % word or out.data_ptr() % word
                    or (s_wb * elem) % word or (s_wv * elem) % word):
                continue
            return word, row // word, s_wb * elem // word, s_wv * elem // word, 1
    return elem, D, s_wb, s_wv, s_wd


def _vec(grad: Tensor, grad_w: Tensor, strides: tuple[int, int, int, int], D: int) -> int:
    """Elements per backward load/store: the most (<= 16 bytes) that D, grad_out's
    strides and both base addresses allow; 1 unless grad_out's rows are contiguous."""
    elem = grad.element_size()
    s_gb, s_gm, s_gl, s_gd = strides
    for vec in (8, 4, 2):
        nbytes = vec * elem
        if nbytes > 16 or D % vec or s_gd != 1:
            continue
        if any(s % vec for s in (s_gb, s_gm, s_gl)):
            continue
        if grad.data_ptr() % nbytes or grad_w.data_ptr() % nbytes:
            continue
        return vec
    return 1


class _Launcher(Launcher):
    """The embedding kernels on one device kind (:class:`hfkern.cuda._launch.Launcher`)."""

    def __init__(self, emulate: bool, chunk: int | None = None):
        super().__init__(emulate)
        self.threads = _EMULATED_THREADS if emulate else _THREADS
        self.row_lanes = _EMULATED_ROW_LANES if emulate else _ROW_LANES
        self.chunk_lanes = _EMULATED_CHUNK_LANES if emulate else _CHUNK_LANES
        self.chunk = int(chunk) if chunk is not None else (EMULATED_CHUNK if emulate else CHUNK)
        if self.chunk < 1:
            raise ValueError(f"hfkern.cuda.embedding: expected chunk >= 1, got {chunk}")

    def require(self, ext) -> None:
        if not hasattr(ext, "embedding_forward") or int(ext.EMB_MAX_THREADS) < self.threads:
            raise RuntimeError(f"{ext.__name__} has no embedding kernels for {self.threads} threads per "
                               f"block; rebuild it")

    def check(self, op: str, data_name: str, data: Tensor, indices: Tensor, V: int, padding_idx: int) -> None:
        """Devices, dtypes, shapes and padding_idx; nothing invalid reaches a kernel."""
        self.check_device(op, data_name, data)
        where = self.where
        if indices.device != data.device:
            raise ValueError(f"hfkern::{op} on the {where}: expected indices on {data.device}, got {indices.device}")
        if data.dtype not in KERNEL_DTYPES:
            raise TypeError(f"hfkern::{op} on the {where}: expected {data_name} of dtype float32, float16 or "
                            f"bfloat16, got {data.dtype}; the torch backend serves it")
        if indices.dtype not in _INDEX_DTYPES:
            raise TypeError(f"hfkern::{op} on the {where}: expected indices of dtype int32 or int64, "
                            f"got {indices.dtype}")
        if indices.dim() < 1:
            raise ValueError(f"hfkern::{op} on the {where}: expected indices of shape [B, *], got a 0-dim tensor")
        if V < 0:
            raise ValueError(f"hfkern::{op} on the {where}: expected num_weights >= 0, got {V}")
        if padding_idx != -1 and not 0 <= padding_idx < V:
            raise ValueError(f"hfkern::{op} on the {where}: expected padding_idx -1 (none) or in [0, {V}), "
                             f"got {padding_idx}")

    @staticmethod
    def _index(indices: Tensor, n: int) -> tuple[Tensor, tuple]:
        """indices (or a copy) and their (address, bytes, L, s_b, s_m, s_l) for the binding."""
        idx, L, s_m, s_l = lookup_dims(indices, n, 0)
        s_b = idx.stride(0) if idx.shape[0] > 1 else 0
        return idx, (idx.data_ptr(), idx.element_size(), L, s_b, s_m, s_l)

    # ---- forward --------------------------------------------------------------------

    def forward(self, weight: Tensor, indices: Tensor, padding_idx: int = -1, scale_grad_by_freq: bool = False,
                sparse: bool = False) -> Tensor:
        if weight.dim() != 3:
            raise ValueError(f"hfkern::{_FWD} (cuda): expected weight of shape [B, V, D], got {list(weight.shape)}")
        B, V, D = weight.shape
        self.check(_FWD, "weight", weight, indices, V, padding_idx)
        if indices.shape[0] != B:
            raise ValueError(f"hfkern::{_FWD} (cuda): expected indices of shape [B, *] with B = {B} (weight's), "
                             f"got {list(indices.shape)}")
        out = torch.empty((*indices.shape, D), dtype=weight.dtype, device=weight.device)
        n = math.prod(indices.shape[1:])
        if out.numel() == 0:
            return out
        ext = self.ext(weight.device)
        idx, index = self._index(indices, n)
        word, Dw, s_wb, s_wv, s_wd = _word_layout(weight, out)
        tx = _pow2_at_most(Dw, self.row_lanes)
        ext.embedding_forward(weight.data_ptr(), out.data_ptr(), word, B, n, Dw, s_wb, s_wv, s_wd, index,
                              tx, max(1, self.threads // tx), _ext.stream(weight.device))
        return out

    # ---- backward -------------------------------------------------------------------

    def backward(self, grad_out: Tensor, indices: Tensor, num_weights: int, padding_idx: int,
                 scale_grad_by_freq: bool) -> Tensor:
        V = int(num_weights)
        self.check(_BWD, "grad_out", grad_out, indices, V, padding_idx)
        if grad_out.dim() != indices.dim() + 1 or grad_out.shape[:-1] != indices.shape:
            raise ValueError(f"hfkern::{_BWD} (cuda): expected grad_out of shape [*indices.shape, D] = "
                             f"{list(indices.shape)} + [D], got {list(grad_out.shape)}")
        B, D = grad_out.shape[0], grad_out.shape[-1]
        grad_w = torch.empty((B, V, D), dtype=grad_out.dtype, device=grad_out.device)
        n = math.prod(indices.shape[1:])
        if grad_w.numel() == 0:
            return grad_w
        if n == 0:
            return grad_w.zero_()
        shared = indices.stride(0) == 0 or B == 1
        models = 1 if shared else B
        items, rows = models * n, models * V
        if items > _INT32_MAX:
            raise ValueError(f"hfkern::{_BWD} (cuda): expected at most 2**31 - 1 lookups to sort, got "
                             f"{items} ({models} index tensors of {n})")
        ext = self.ext(grad_out.device)
        stream = _ext.stream(grad_out.device)
        device = grad_out.device

        # 1, 2: one stable sort of the (b * V + index, position) pairs.
        idx, index = self._index(indices, n)
        key_dtype = torch.int32 if rows <= 2**32 - 1 else torch.int64  # read as uint32 / uint64
        key_bytes = 4 if key_dtype == torch.int32 else 8
        end_bit = max(1, (rows - 1).bit_length())
        keys = torch.empty((2, items), dtype=key_dtype, device=device)
        pos = torch.empty((2, items), dtype=torch.int32, device=device)
        ext.embedding_sort_keys(index, models, n, V, key_bytes, keys[0].data_ptr(), pos[0].data_ptr(),
                                self.threads, stream)
        temp = torch.empty(max(1, ext.embedding_sort_temp_bytes(items, key_bytes, end_bit)), dtype=torch.uint8,
                           device=device)
        ext.embedding_sort(temp.data_ptr(), temp.numel(), keys[0].data_ptr(), keys[1].data_ptr(),
                           pos[0].data_ptr(), pos[1].data_ptr(), items, key_bytes, end_bit, stream)
        # 3: each row's segment of the sorted order.
        bounds = torch.empty(rows + 1, dtype=torch.int32, device=device)
        ext.embedding_segments(keys[1].data_ptr(), key_bytes, items, rows, bounds.data_ptr(), self.threads, stream)

        # 4: chunk sums of long rows, then every row of the gradient.
        grad, L, s_gm, s_gl = lookup_dims(grad_out, n, 1)
        strides = (grad.stride(0) if B > 1 else 0, s_gm, s_gl, grad.stride(-1) if D > 1 else 1)
        vec = _vec(grad, grad_w, strides, D)
        part = None
        if items > self.chunk:
            part = torch.empty((-(-items // self.chunk), 2, B if shared else 1, D), dtype=torch.float32,
                               device=device)
        args = dict(
            grad=grad.data_ptr(), dtype=_ext.DTYPE_CODES[grad.dtype], L=L, strides=strides,
            perm=pos[1].data_ptr(), bounds=bounds.data_ptr(), part=0 if part is None else part.data_ptr(),
            grad_w=grad_w.data_ptr(), shape=(B, V, D, items), padding_idx=int(padding_idx), chunk=self.chunk,
            vec=vec, shared=shared, scale=bool(scale_grad_by_freq),
        )
        dv = D // vec
        if part is not None:
            ext.embedding_backward_chunks(**args, tx=_pow2_at_most(dv, self.chunk_lanes), stream=stream)
        tx = _pow2_at_most(dv, self.row_lanes)
        ext.embedding_backward_rows(**args, tx=tx, ty=max(1, self.threads // tx), stream=stream)
        return grad_w


_device_launcher = _Launcher(emulate=False)


# Registered for CUDA tensors and the dtypes the kernels serve (_launch.implements).
@implements(_FWD)
def array_embedding(
    weight: Tensor,
    indices: Tensor,
    padding_idx: int = -1,
    scale_grad_by_freq: bool = False,
    sparse: bool = False,
) -> Tensor:
    """``out[b, ...] = weight[b, indices[b, ...]]``.

    weight ``[B, V, D]`` (float32/float16/bfloat16, any strides), indices ``[B, *]``
    int32/int64 -> contiguous ``[B, *, D]``. The last three arguments only shape
    the backward and are ignored here.
    """
    return _device_launcher.forward(weight, indices, padding_idx, scale_grad_by_freq, sparse)


@implements(_BWD)
def array_embedding_backward(
    grad_out: Tensor,
    indices: Tensor,
    num_weights: int,
    padding_idx: int,
    scale_grad_by_freq: bool,
) -> Tensor:
    """Dense weight gradient ``[B, num_weights, D]`` (contiguous, grad_out's dtype), deterministic.

    grad_out ``[B, *, D]``, indices ``[B, *]``. Row ``padding_idx`` (``-1``: none)
    gets zero; with ``scale_grad_by_freq`` each row's sum is divided by the number
    of times that model's indices hit it.
    """
    return _device_launcher.backward(grad_out, indices, num_weights, padding_idx, scale_grad_by_freq)


def emulated(op: str, *, chunk: int | None = None) -> Callable[..., Tensor]:
    """The cuda launcher of ``op`` (``"array_embedding"`` or ``"array_embedding_backward"``)
    on CPU tensors, running the same kernel sources in the host grid emulator
    (hfkern._C_emu); ``chunk``: hits per chunk of a long row (default EMULATED_CHUNK)."""
    launcher = _Launcher(emulate=True, chunk=chunk)
    ops = {_FWD: launcher.forward, _BWD: launcher.backward}
    if op not in ops:
        raise ValueError(f"hfkern.cuda.embedding implements {sorted(ops)}, got {op!r}")
    return ops[op]
