"""hfkern::array_layer_norm, array_rms_norm and their backward ops on the CUDA kernels
(csrc/norm/layer_norm.cu).

The launchers have the signatures and results (shapes, dtypes, strides) of the
torch implementations in :mod:`hfkern.ops.layer_norm`, whose module docstring
is the op contract: the layer norm's fused activation (``"none"``, ``"relu"``,
``"gelu"``: the exact erf form) is applied to the float32 ``z = xhat * weight +
bias`` before the store; the backward recomputes ``z`` from ``x`` where it reads
it and multiplies ``grad_y`` by ``act'(z)`` first.

Layout (as the Triton kernels, :mod:`hfkern.triton.layer_norm`): ``x`` is
``[B, *, *S]`` with any strides, seen as B x M rows of ``D = prod(S)``
elements; the per-model batch dims merged into at most two strided dims and
``S`` into at most two, in every tensor of the call. That covers contiguous
inputs, an array conv's ``[N, B, ...]`` memory, strided slices, a last-two-dims
transpose, a shared input (stride 0 on B) and an expanded ``grad_y`` without a
copy; rarer layouts are copied to contiguous memory first (and the output
copied back).

Threads: a row of up to 1024 elements (256 in the backward) runs on a warp, or
a power-of-two part of one, with warp-shuffle reductions, several rows per
block; a longer row on a block, held in registers up to 16384 elements (2048 in
the backward, whose blocks have at most 256 threads), swept beyond. Where the layout allows (columns contiguous, rows and
addresses 16-byte aligned) a thread reads and writes 16 bytes at a time.

Backward: each model's rows are split into ``P`` fixed chunks, one block each,
which writes grad_x and its float32 partial sums of the parameter gradients
into ``[B, P, D]`` buffers; a second kernel adds each column's partials in
chunk order. No atomics: two runs give bitwise equal results. The partition
depends only on the shapes and the device's SM count.

Served: float32, float16 and bfloat16 ``x`` and parameters, float32
statistics; float64 raises TypeError (the torch backend serves it). A
``grad_y`` of another dtype than x's is read as float32.

``emulated(op)`` runs the same launchers on CPU tensors through
``hfkern._C_emu``, the kernels built for the host grid emulator.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence

import torch
from torch import Tensor

from .._device import sm_count
from .._norm_layout import (
    NORM_ACTIVATIONS,
    PROGRAMS_PER_SM,
    addressed,
    backward_outputs,
    cdiv,
    next_power_of_2,
    row_layout,
)
from . import _ext
from ._launch import Launcher, implements

__all__ = [
    "array_layer_norm", "array_layer_norm_backward", "array_rms_norm", "array_rms_norm_backward", "emulated",
]

_LN_FWD, _LN_BWD = "array_layer_norm", "array_layer_norm_backward"
_RMS_FWD, _RMS_BWD = "array_rms_norm", "array_rms_norm_backward"


class _Limits:
    """The launch shapes of one device kind. ``threads``: a block of short rows;
    ``lanes``: a shuffle group (a warp); ``max_row_threads``: a long row's block;
    ``packs``: the packs a thread holds in registers (None: as many as the kernel
    allows); ``sum_threads``: the partial-sum kernel's block."""

    def __init__(self, threads: int, lanes: int, max_row_threads: int, packs: int | None, sum_threads: int):
        self.threads, self.lanes, self.max_row_threads = threads, lanes, max_row_threads
        self.packs, self.sum_threads = packs, sum_threads


# Under the emulator every block is a group of host threads: small blocks, shuffle
# groups of 8 and at most two packs a thread, so that small test shapes run
# several rows per warp, several shuffle groups per row, and swept rows.
_DEVICE = _Limits(threads=128, lanes=32, max_row_threads=512, packs=None, sum_threads=256)
_EMULATED = _Limits(threads=16, lanes=8, max_row_threads=16, packs=2, sum_threads=16)


def _pack(dtype: torch.dtype) -> int:
    """VEC: the columns of a pack, 16 bytes of x."""
    return 16 // torch.empty(0, dtype=dtype).element_size()


def _vec_tensors(tensors: Sequence[Tensor], strides: Sequence[Sequence[int]], D: int, D1: int, vec: int) -> bool:
    """Whether every data tensor can be read a pack at a time (csrc: check_vec_tensor)."""
    return D1 == D and D % vec == 0 and all(
        st[4] == 1 and all(s % vec == 0 for s in st[:3]) and t.data_ptr() % 16 == 0
        for t, st in zip(tensors, strides)
    )


def _param(p: Tensor | None, B: int, D: int) -> tuple[Tensor | None, tuple[int, int, int, int]]:
    """A [B, *S] parameter as the binding takes it: its [B, D] view (a copy for an odd layout:
    parameters are small) and (address, dtype code, s_b, s_d); zeros when absent."""
    if p is None:
        return None, (0, 0, 0, 0)
    p2 = p.reshape(B, D)
    return p2, (p2.data_ptr(), _ext.DTYPE_CODES[p2.dtype], p2.stride(0), p2.stride(1))


def _vec_params(params: Sequence[Tensor | None], D: int, vec: int) -> bool:
    def ok(p):
        align = min(16, vec * p.element_size())
        return p.stride(1) == 1 and p.stride(0) % vec == 0 and p.data_ptr() % align == 0

    return D % vec == 0 and all(ok(p) for p in params if p is not None)


def _num_rows(x: Tensor, norm_ndim: int) -> int:
    return math.prod(x.shape[1: x.dim() - norm_ndim])


class _Launcher(Launcher):
    """The layer-norm kernels on one device kind (:class:`hfkern.cuda._launch.Launcher`)."""

    def __init__(self, emulate: bool):
        super().__init__(emulate)
        self.limits = _EMULATED if emulate else _DEVICE

    def require(self, ext) -> None:
        acts = getattr(ext, "LN_ACTIVATIONS", None)
        if acts is None or set(acts) != set(NORM_ACTIVATIONS) or ext.LN_MAX_THREADS < self.limits.max_row_threads:
            raise RuntimeError(
                f"{ext.__name__} has no layer-norm kernels for the activations {list(NORM_ACTIVATIONS)} and "
                f"{self.limits.max_row_threads} threads per block; rebuild it"
            )

    def config(self, D: int, dtype: torch.dtype, values: int, max_threads: int) -> tuple[int, int, int, bool]:
        """(row_threads, lanes, rows, regs) for rows of D elements; ``values``: the float32
        values of a row a thread may hold (LN_FWD_VALUES / LN_BWD_VALUES); ``max_threads``: the
        kernel's largest block (LN_MAX_THREADS / LN_MAX_BWD_THREADS)."""
        lim = self.limits
        vec = _pack(dtype)
        n_packs = cdiv(D, vec)
        # (the emulator's cap, within what the kernel allows: one 16-bit pack of 8 values
        # fills the backward's LN_BWD_VALUES)
        packs = values // vec if lim.packs is None else min(lim.packs, values // vec)
        if n_packs <= lim.lanes * packs:  # a warp's registers hold the row: a warp (or part of one) per row
            tpr = min(lim.lanes, next_power_of_2(n_packs))
            return tpr, tpr, lim.threads // tpr, True
        # a block per row: the fewest threads (at least two warps) that hold it, swept past the largest block
        tpr = min(lim.max_row_threads, max_threads, max(2 * lim.lanes, next_power_of_2(cdiv(n_packs, packs))))
        return tpr, lim.lanes, 1, cdiv(n_packs, tpr) <= packs

    def _programs(self, device: torch.device) -> int:
        if self.emulate:  # a few blocks, to exercise the partials
            return 2 * PROGRAMS_PER_SM
        return PROGRAMS_PER_SM * sm_count(device)

    # ---- forward ------------------------------------------------------------------------

    def forward(self, op: str, x: Tensor, weight: Tensor | None, bias: Tensor | None, norm_ndim: int, eps: float,
                activation: str, is_rms: bool) -> tuple[Tensor, Tensor, Tensor]:
        self.check(op, x, weight=weight, bias=bias)
        ext = self.ext(x.device)
        act = _activation_code(op, activation, ext)
        B, M = x.shape[0], _num_rows(x, norm_ndim)
        D = math.prod(x.shape[x.dim() - norm_ndim:])
        y = torch.empty_like(x)
        mean = x.new_empty((B, M), dtype=torch.float32)
        rstd = x.new_empty((B, M), dtype=torch.float32)
        if x.numel() == 0:  # nothing to launch: rows of no elements have NaN statistics, as on the torch backend
            return y, mean.fill_(math.nan), rstd.fill_(math.nan)
        (x_in,), y_out, (M1, _, D1, _, (sx, sy)) = addressed(lambda ts: row_layout(ts, norm_ndim), [x], y)
        w2, w = _param(weight, B, D)
        b2, b = _param(bias, B, D)
        vec = _pack(x.dtype)
        tpr, lanes, rows, regs = self.config(D, x.dtype, ext.LN_FWD_VALUES, ext.LN_MAX_THREADS)
        config = (tpr, lanes, rows, int(regs), int(_vec_tensors([x_in, y_out], [sx, sy], D, D1, vec)),
                  int(_vec_params([w2, b2], D, vec)))
        ext.layer_norm_forward(
            _data(x_in, sx), _data(y_out, sy), w, b, (B, M, M1, D, D1), config, float(eps), bool(is_rms), act,
            0 if is_rms else mean.data_ptr(), rstd.data_ptr(), _ext.stream(x.device),
        )
        if y_out is not y:
            y.copy_(y_out)
        return y, mean, rstd

    # ---- backward -----------------------------------------------------------------------

    def backward(self, op: str, grad_y: Tensor, x: Tensor, weight: Tensor | None, mean: Tensor | None, rstd: Tensor,
                 norm_ndim: int, output_mask: Sequence[bool], bias: Tensor | None, activation: str,
                 is_rms: bool) -> tuple[Tensor, Tensor, Tensor]:
        """(grad_x, grad_weight, grad_bias); output_mask has three entries."""
        self.check(op, x, grad_y=grad_y, weight=weight, bias=bias, mean=mean, rstd=rstd)
        ext = self.ext(x.device)
        act = _activation_code(op, activation, ext)
        B, M = x.shape[0], _num_rows(x, norm_ndim)
        S = x.shape[x.dim() - norm_ndim:]
        D = math.prod(S)
        if grad_y.shape != x.shape:
            raise ValueError(f"hfkern::{op} (cuda): expected grad_y of x's shape {list(x.shape)}, "
                             f"got {list(grad_y.shape)}")
        for name, stat in (("mean", mean), ("rstd", rstd)):
            if stat is not None and stat.numel() != B * M:
                raise ValueError(f"hfkern::{op} (cuda): expected {name} of {B * M} values ([B, M] = [{B}, {M}]), "
                                 f"got shape {list(stat.shape)}")
        if bias is not None and list(bias.shape) != [B, *S]:
            raise ValueError(f"hfkern::{op} (cuda): expected bias of shape {[B, *S]}, got {list(bias.shape)}")
        want_dx, want_dw, want_db = (bool(m) for m in output_mask)
        grad_x, grad_w, grad_b = backward_outputs(x, weight, output_mask, (B, *S), launch=True)
        if x.numel() == 0 or not any(output_mask):
            return grad_x, grad_w, grad_b
        if grad_y.dtype not in (x.dtype, torch.float32):
            grad_y = grad_y.float()  # exact: the kernels read grad_y in x's dtype or float32

        (gy_in, x_in), gx_out, (M1, _, D1, _, strides) = addressed(
            lambda ts: row_layout(ts, norm_ndim), [grad_y, x], grad_x if want_dx else None)
        sg, sx = strides[0], strides[1]
        sgx = strides[2] if want_dx else [0] * 5
        if activation == "none":
            bias = None  # z is only needed for the activation's derivative
        w2, w = _param(weight, B, D)
        b2, b = _param(bias, B, D)
        rstd = rstd.reshape(B, M).to(torch.float32).contiguous()
        mean = None if mean is None else mean.reshape(B, M).to(torch.float32).contiguous()
        vec = _pack(x.dtype)
        tpr, lanes, rows, regs = self.config(D, x.dtype, ext.LN_BWD_VALUES, ext.LN_MAX_BWD_THREADS)
        data = [gy_in, x_in] + ([gx_out] if want_dx else [])
        config = (tpr, lanes, rows, int(regs), int(_vec_tensors(data, strides, D, D1, vec)),
                  int(_vec_params([w2, b2], D, vec)))
        # A fixed partition of each model's rows into P chunks of whole row slots.
        per_model = max(1, cdiv(self._programs(x.device), B))
        chunk = cdiv(cdiv(M, per_model), rows) * rows
        P = cdiv(M, chunk)
        n_partials = int(want_dw) + int(want_db)
        pw = pb = 0
        if n_partials:
            # no memset: every block writes its whole partial row
            partials = x.new_empty((n_partials, B, P, D), dtype=torch.float32)
            pw = partials[0].data_ptr() if want_dw else 0
            pb = partials[-1].data_ptr() if want_db else 0
        stream = _ext.stream(x.device)
        ext.layer_norm_backward(
            _data(gy_in, sg), _data(x_in, sx), _data(gx_out, sgx) if want_dx else (0, _ext.DTYPE_CODES[x.dtype], 0, 0, 0, 0, 0),
            w, b, (B, M, M1, D, D1), config, chunk, P, 0 if mean is None else mean.data_ptr(), rstd.data_ptr(),
            bool(is_rms), act, pw, pb, stream,
        )
        if want_dx and gx_out is not grad_x:
            grad_x.copy_(gx_out)
        if n_partials:
            ext.layer_norm_sum_partials(pw, pb, B, P, D, _param(grad_w if want_dw else None, B, D)[1],
                                        _param(grad_b if want_db else None, B, D)[1], self.limits.sum_threads,
                                        stream)
        return grad_x, grad_w, grad_b


def _activation_code(op: str, activation: str, ext) -> int:
    if activation not in NORM_ACTIVATIONS:
        raise ValueError(f"hfkern::{op} (cuda): expected activation in {list(NORM_ACTIVATIONS)}, got {activation!r}")
    return int(ext.LN_ACTIVATIONS[activation])


def _data(t: Tensor, strides: Sequence[int]) -> tuple[int, ...]:
    """A data operand as the binding takes it: (address, dtype code, s_b, s_m0, s_m1, s_d0, s_d1)."""
    return (t.data_ptr(), _ext.DTYPE_CODES[t.dtype], *strides)


class _Ops:
    """The four ops' launchers on one launcher (device or emulator), with the ops' signatures."""

    def __init__(self, launcher: _Launcher):
        self.launcher = launcher

    def array_layer_norm(self, x: Tensor, weight: Tensor | None, bias: Tensor | None, norm_ndim: int, eps: float,
                         activation: str = "none") -> tuple[Tensor, Tensor, Tensor]:
        return self.launcher.forward(_LN_FWD, x, weight, bias, norm_ndim, eps, activation, is_rms=False)

    def array_layer_norm_backward(self, grad_y: Tensor, x: Tensor, weight: Tensor | None, mean: Tensor, rstd: Tensor,
                                  norm_ndim: int, output_mask: Sequence[bool], bias: Tensor | None = None,
                                  activation: str = "none") -> tuple[Tensor, Tensor, Tensor]:
        _check_mask(_LN_BWD, output_mask, 3, weight)
        return self.launcher.backward(_LN_BWD, grad_y, x, weight, mean, rstd, norm_ndim, output_mask, bias,
                                      activation, is_rms=False)

    def array_rms_norm(self, x: Tensor, weight: Tensor | None, norm_ndim: int, eps: float) -> tuple[Tensor, Tensor]:
        y, _, rstd = self.launcher.forward(_RMS_FWD, x, weight, None, norm_ndim, eps, "none", is_rms=True)
        return y, rstd

    def array_rms_norm_backward(self, grad_y: Tensor, x: Tensor, weight: Tensor | None, rstd: Tensor, norm_ndim: int,
                                output_mask: Sequence[bool]) -> tuple[Tensor, Tensor]:
        _check_mask(_RMS_BWD, output_mask, 2, weight)
        grad_x, grad_w, _ = self.launcher.backward(_RMS_BWD, grad_y, x, weight, None, rstd, norm_ndim,
                                                   [*output_mask, False], None, "none", is_rms=True)
        return grad_x, grad_w


def _check_mask(op: str, output_mask: Sequence[bool], n: int, weight: Tensor | None) -> None:
    if len(output_mask) != n:
        raise ValueError(f"hfkern::{op} (cuda): expected output_mask of length {n}, got {list(output_mask)}")
    if output_mask[1] and weight is None:
        raise ValueError(f"hfkern::{op} (cuda): output_mask asks for grad_weight but weight is None")


_device_ops = _Ops(_Launcher(emulate=False))


# Registered for CUDA tensors and the dtypes the kernels compute in (_launch.implements).
@implements(_LN_FWD)
def array_layer_norm(
    x: Tensor, weight: Tensor | None, bias: Tensor | None, norm_ndim: int, eps: float, activation: str = "none",
) -> tuple[Tensor, Tensor, Tensor]:
    """Layer norm of B models: see :mod:`hfkern.ops.layer_norm`.

    x ``[B, *, *S]`` (float32/float16/bfloat16, any strides), weight/bias ``[B, *S]``
    or None, ``activation`` "none", "relu" or "gelu". Returns y (x's dtype,
    ``empty_like(x)`` layout) and mean, rstd (float32 ``[B, M]``, contiguous).
    """
    return _device_ops.array_layer_norm(x, weight, bias, norm_ndim, eps, activation)


@implements(_LN_BWD)
def array_layer_norm_backward(
    grad_y: Tensor, x: Tensor, weight: Tensor | None, mean: Tensor, rstd: Tensor, norm_ndim: int,
    output_mask: Sequence[bool], bias: Tensor | None = None, activation: str = "none",
) -> tuple[Tensor, Tensor, Tensor]:
    """(grad_x, grad_weight, grad_bias): see :mod:`hfkern.ops.layer_norm`.

    grad_y, x ``[B, *, *S]`` (any strides), weight and bias ``[B, *S]`` or None (the
    forward's; bias matters only with an activation), mean and rstd float32 ``[B, M]``
    as the forward returned them. An output whose ``output_mask`` entry is False is
    an empty ``[0]`` tensor.
    """
    return _device_ops.array_layer_norm_backward(grad_y, x, weight, mean, rstd, norm_ndim, output_mask, bias,
                                                 activation)


@implements(_RMS_FWD)
def array_rms_norm(x: Tensor, weight: Tensor | None, norm_ndim: int, eps: float) -> tuple[Tensor, Tensor]:
    """RMS norm of B models: see :mod:`hfkern.ops.layer_norm`.

    x ``[B, *, *S]``, weight ``[B, *S]`` or None. Returns y and rstd (float32 ``[B, M]``).
    """
    return _device_ops.array_rms_norm(x, weight, norm_ndim, eps)


@implements(_RMS_BWD)
def array_rms_norm_backward(
    grad_y: Tensor, x: Tensor, weight: Tensor | None, rstd: Tensor, norm_ndim: int, output_mask: Sequence[bool],
) -> tuple[Tensor, Tensor]:
    """(grad_x, grad_weight): see :mod:`hfkern.ops.layer_norm`.

    grad_y, x ``[B, *, *S]``, weight ``[B, *S]`` or None, rstd float32 ``[B, M]``.
    """
    return _device_ops.array_rms_norm_backward(grad_y, x, weight, rstd, norm_ndim, output_mask)


def emulated(op: str) -> Callable:
    """The cuda launcher of ``op`` (one of the four layer-norm and RMS-norm ops) on CPU
    tensors, running the same kernel sources in the host grid emulator (hfkern._C_emu)."""
    ops = _Ops(_Launcher(emulate=True))
    names = (_LN_FWD, _LN_BWD, _RMS_FWD, _RMS_BWD)
    if op not in names:
        raise ValueError(f"hfkern.cuda.layer_norm implements {list(names)}, got {op!r}")
    return getattr(ops, op)
