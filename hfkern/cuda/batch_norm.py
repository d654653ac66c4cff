"""hfkern::array_batch_norm and its backward on the CUDA kernels (csrc/norm/batch_norm.cu).

The launchers have the signatures and results (shapes, dtypes, strides) of the
torch implementations in :mod:`hfkern.ops.batch_norm`, whose module docstring
is the op contract, plus the fused activation: the forward's ``activation``
(``"none"``, ``"relu"``, ``"gelu"``: the exact erf form) is applied to ``z = (x -
mean) * rstd * weight + bias``; the backward takes the forward's ``bias`` and
``activation`` and first turns ``grad_y`` into ``g = grad_y * act'(z)``, with z
recomputed in float32 from x (nothing extra is saved), then runs the ordinary
batch-norm backward with g.

Layout: each model's x is seen as ``[R0, C, R1]`` through strides
(:mod:`hfkern._norm_layout`, shared with the Triton kernels), so contiguous
``[B, N, C]`` and ``[B, N, C, *S]``, an array conv's ``[N, B, C, *S]`` memory,
channels-last array memory ``[N, *S, B, C]``, strided slices, a shared input
(stride 0 on B) and an expanded ``grad_y`` are read where they lie; rarer
layouts are copied to contiguous memory first (and the output copied back). A
thread block is a tile of ``tr0 x tc x tr1`` threads whose fastest dim is the
one that runs along memory: the channels for ``[B, N, C]`` and channels-last
memory, R1 for channels-first memory.

Forward, training: per-chunk Welford partials (the partition of
:mod:`hfkern._norm_layout`), a per-channel kernel that combines them in chunk
order and updates the running statistics in place (float32 blend, as torch's
CUDA kernel), then the normalize + affine + activation kernel. Backward: per-chunk
partial sums of g and g * xhat, a per-channel sum in chunk order (grad_bias,
grad_weight), the grad_x kernel. No atomics: the results are bitwise
reproducible. Served: float32, float16 and bfloat16 data and parameters with
float32 statistics; float64 raises TypeError (the torch backend serves it).

``emulated(op)`` runs the same launchers on CPU tensors through
``hfkern._C_emu``, the kernels built for the host grid emulator.
"""

from __future__ import annotations

import math
from typing import Callable, Sequence

import torch
from torch import Tensor

from .._norm_layout import (
    NORM_ACTIVATIONS,
    addressed,
    backward_outputs,
    cdiv,
    layout,
    partition,
    tile_shape,
)
from . import _ext
from ._launch import Launcher, implements

__all__ = ["array_batch_norm", "array_batch_norm_backward", "emulated", "ACTIVATIONS"]

_FWD, _BWD = "array_batch_norm", "array_batch_norm_backward"
ACTIVATIONS = NORM_ACTIVATIONS

# Threads per block of the element and reduction kernels, and of the per-channel
# kernels (finalize, reduce). Under the emulator every block is a group of host
# threads: small blocks, so that small test shapes span several blocks and chunks.
_THREADS, _CHANNEL_THREADS = 256, 128
_EMULATED_THREADS, _EMULATED_CHANNEL_THREADS = 16, 8


def _tile(R0: int, C: int, R1: int, s_c: int, s_r1: int, threads: int) -> tuple[int, int, int, int]:
    """(tr0, tc, tr1, c_inner): the threads of a block, long along the dim that runs along memory."""
    tr0, tc, tr1, channels_inner = tile_shape(R0, C, R1, s_c, s_r1, threads, threads)
    return tr0, tc, tr1, int(channels_inner)


def _activation_code(op: str, activation: str, ext) -> int:
    if activation not in ACTIVATIONS:
        raise ValueError(f"hfkern::{op} (cuda): expected activation in {list(ACTIVATIONS)}, got {activation!r}")
    return int(ext.BN_ACTIVATIONS[activation])


def _data(t: Tensor, strides: Sequence[int]) -> tuple[int, ...]:
    """A data operand as the binding takes it: (address, dtype code, s_b, s_r0, s_c, s_r1)."""
    return (t.data_ptr(), _ext.DTYPE_CODES[t.dtype], *strides)


def _channels(t: Tensor | None) -> tuple[int, int, int, int]:
    """A [B, C] operand: (address, dtype code, s_b, s_c), or zeros when absent."""
    if t is None:
        return (0, 0, 0, 0)
    return (t.data_ptr(), _ext.DTYPE_CODES[t.dtype], t.stride(0), t.stride(1))


class _Launcher(Launcher):
    """The batch-norm kernels on one device kind (:class:`hfkern.cuda._launch.Launcher`)."""

    check_integer_dtypes = False  # num_batches_tracked is an integer counter

    def __init__(self, emulate: bool):
        super().__init__(emulate)
        self.threads = _EMULATED_THREADS if emulate else _THREADS
        self.channel_threads = _EMULATED_CHANNEL_THREADS if emulate else _CHANNEL_THREADS

    def require(self, ext) -> None:
        if set(ext.BN_ACTIVATIONS) != set(ACTIVATIONS) or ext.BN_MAX_THREADS < self.threads:
            raise RuntimeError(
                f"{ext.__name__} knows the activations {sorted(ext.BN_ACTIVATIONS)} and at most "
                f"{ext.BN_MAX_THREADS} threads per block, expected {sorted(ACTIVATIONS)} and "
                f"{self.threads}; rebuild it"
            )

    # ---- forward --------------------------------------------------------------------

    def forward(
        self,
        x: Tensor,
        weight: Tensor | None,
        bias: Tensor | None,
        running_mean: Tensor | None,
        running_var: Tensor | None,
        num_batches_tracked: Tensor | None,
        training: bool,
        momentum: float | None,
        eps: float,
        activation: str = "none",
    ) -> tuple[Tensor, Tensor, Tensor]:
        self.check(_FWD, x, weight=weight, bias=bias, running_mean=running_mean, running_var=running_var,
                   num_batches_tracked=num_batches_tracked)
        ext = self.ext(x.device)
        act = _activation_code(_FWD, activation, ext)
        stream = _ext.stream(x.device)
        B, N, C = x.shape[:3]
        n = N * math.prod(x.shape[3:])
        y = torch.empty_like(x)
        mean = x.new_empty((B, C), dtype=torch.float32)
        rstd = x.new_empty((B, C), dtype=torch.float32)
        if B * C == 0:
            return y, mean, rstd
        update = training and running_mean is not None
        cumulative = update and momentum is None
        nbt = None
        if cumulative:
            nbt = num_batches_tracked if num_batches_tracked.dtype == torch.int64 else num_batches_tracked.long()

        x_in, y_out = x, y
        shape, tile, chunks = (B, 1, C, 1), (1, 1, 1, 1), (1, 1, 0, 1)  # n == 0: no partials
        partials, s_part_b = None, 0
        if n > 0:
            # more than two strided reduced dims: copied, the output copied back
            (x_in,), y_out, (R0, R1, (sx, sy)) = addressed(layout, [x], y)
            tile = _tile(R0, C, R1, sx[2], sx[3], self.threads)
            shape = (B, R0, C, R1)
            if training:
                # A shared input is the same batch for every model: its statistics once.
                stat_models = 1 if x_in.stride(0) == 0 else B
                n_cb = cdiv(C, tile[1])
                chunks = partition(x.device, stat_models * n_cb, R0, R1, tile[0], tile[2])
                partials = x.new_empty((2, stat_models, chunks[2], C), dtype=torch.float32)
                s_part_b = 0 if stat_models == 1 else chunks[2] * C
                ext.batch_norm_stats(_data(x_in, sx), (stat_models, R0, C, R1), tile, chunks,
                                     partials[0].data_ptr(), partials[1].data_ptr(), stream)
        ext.batch_norm_finalize(
            pmean=partials[0].data_ptr() if partials is not None else 0,
            pm2=partials[1].data_ptr() if partials is not None else 0,
            s_part_b=s_part_b,
            running_mean=_channels(running_mean), running_var=_channels(running_var),
            num_batches_tracked=nbt.data_ptr() if nbt is not None else 0,
            s_nbt=nbt.stride(0) if nbt is not None else 0,
            training=bool(training), update=update, cumulative=cumulative,
            momentum=0.0 if momentum is None else float(momentum), unbias=n / (n - 1) if n > 1 else 1.0,
            eps=float(eps), shape=shape, chunks=chunks, mean=mean.data_ptr(), rstd=rstd.data_ptr(),
            threads=self.channel_threads, stream=stream,
        )
        if n > 0:
            ext.batch_norm_apply(_data(x_in, sx), _data(y_out, sy), shape, tile, mean.data_ptr(), rstd.data_ptr(),
                                 _channels(weight), _channels(bias), act, stream)
            if y_out is not y:
                y.copy_(y_out)
        return y, mean, rstd

    # ---- backward -------------------------------------------------------------------

    def backward(
        self,
        grad_y: Tensor,
        x: Tensor,
        weight: Tensor | None,
        mean: Tensor,
        rstd: Tensor,
        training: bool,
        output_mask: Sequence[bool],
        bias: Tensor | None = None,
        activation: str = "none",
    ) -> tuple[Tensor, Tensor, Tensor]:
        self.check(_BWD, x, grad_y=grad_y, weight=weight, bias=bias, mean=mean, rstd=rstd)
        ext = self.ext(x.device)
        act = _activation_code(_BWD, activation, ext)
        B, N, C = x.shape[:3]
        if bias is not None and list(bias.shape) != [B, C]:
            raise ValueError(f"hfkern::{_BWD} (cuda): expected bias of shape {[B, C]} ([B, C] of x of shape "
                             f"{list(x.shape)}), got {list(bias.shape)}")
        if act == 0:
            bias = None  # z is only needed for the activation's derivative
        want_dx, want_dw, want_db = (bool(m) for m in output_mask)
        grad_x, grad_w, grad_b = backward_outputs(x, weight, output_mask, (B, C), launch=True)
        if x.numel() == 0 or not any(output_mask):
            return grad_x, grad_w, grad_b
        need_sums = want_dw or want_db or (want_dx and training)

        stream = _ext.stream(x.device)
        (x_in, gy_in), gx_out, (R0, R1, strides) = addressed(layout, [x, grad_y], grad_x if want_dx else None)
        sx, sg = strides[0], strides[1]
        shape = (B, R0, C, R1)
        tile = _tile(R0, C, R1, sx[2], sx[3], self.threads)
        mean = mean.to(torch.float32).contiguous()
        rstd = rstd.to(torch.float32).contiguous()
        w, b = _channels(weight), _channels(bias)
        sums = None
        if need_sums:
            chunks = partition(x.device, B * cdiv(C, tile[1]), R0, R1, tile[0], tile[2])
            partials = x.new_empty((2, B, chunks[2], C), dtype=torch.float32)
            ext.batch_norm_backward_partials(_data(gy_in, sg), _data(x_in, sx), shape, tile, chunks,
                                             mean.data_ptr(), rstd.data_ptr(), w, b, act,
                                             partials[0].data_ptr(), partials[1].data_ptr(), stream)
            sums = x.new_empty((2, B, C), dtype=torch.float32)
            ext.batch_norm_backward_reduce(partials[0].data_ptr(), partials[1].data_ptr(), B, C, chunks[2],
                                           sums.data_ptr(), _channels(grad_w if want_dw else None),
                                           _channels(grad_b if want_db else None), self.channel_threads, stream)
        if want_dx:
            ext.batch_norm_backward_dx(_data(gy_in, sg), _data(x_in, sx), _data(gx_out, strides[2]), shape, tile,
                                       mean.data_ptr(), rstd.data_ptr(), w, b,
                                       sums.data_ptr() if sums is not None else 0, 1.0 / (N * math.prod(x.shape[3:])),
                                       bool(training), act, stream)
            if gx_out is not grad_x:
                grad_x.copy_(gx_out)
        return grad_x, grad_w, grad_b


_device_launcher = _Launcher(emulate=False)


# Registered for CUDA tensors and the dtypes the kernels compute in (_launch.implements).
@implements(_FWD)
def array_batch_norm(
    x: Tensor,
    weight: Tensor | None,
    bias: Tensor | None,
    running_mean: Tensor | None,
    running_var: Tensor | None,
    num_batches_tracked: Tensor | None,
    training: bool,
    momentum: float | None,
    eps: float,
    activation: str = "none",
) -> tuple[Tensor, Tensor, Tensor]:
    """Batch norm of B models with a fused activation: see :mod:`hfkern.ops.batch_norm`.

    x ``[B, N, C, *S]`` (float32/float16/bfloat16, any strides); weight, bias,
    running_mean, running_var ``[B, C]`` or None; num_batches_tracked ``[B]``
    or None; activation ``"none"``, ``"relu"`` or ``"gelu"``. Returns
    ``(y, mean, rstd)``: ``y = act((x - mean) * rstd * weight + bias)`` in x's
    dtype and ``empty_like(x)`` layout, mean and rstd float32 ``[B, C]``
    contiguous; in training the running statistics are updated in place.
    """
    return _device_launcher.forward(x, weight, bias, running_mean, running_var, num_batches_tracked, training,
                                    momentum, eps, activation)


@implements(_BWD)
def array_batch_norm_backward(
    grad_y: Tensor,
    x: Tensor,
    weight: Tensor | None,
    mean: Tensor,
    rstd: Tensor,
    training: bool,
    output_mask: Sequence[bool],
    bias: Tensor | None = None,
    activation: str = "none",
) -> tuple[Tensor, Tensor, Tensor]:
    """(grad_x, grad_weight, grad_bias): see :mod:`hfkern.ops.batch_norm`.

    grad_y, x ``[B, N, C, *S]`` (any strides); weight and bias ``[B, C]`` or
    None (the forward's; bias only matters with an activation); mean and rstd
    float32 ``[B, C]`` as the forward returned them. With ``g = grad_y *
    act'(z)``, z recomputed from x, the gradients are the batch norm's of g. An
    output whose ``output_mask`` entry is False is an empty ``[0]`` tensor.
    """
    return _device_launcher.backward(grad_y, x, weight, mean, rstd, training, output_mask, bias, activation)


def emulated(op: str) -> Callable[..., tuple[Tensor, Tensor, Tensor]]:
    """The cuda launcher of ``op`` (``"array_batch_norm"`` or ``"array_batch_norm_backward"``)
    on CPU tensors, running the same kernel sources in the host grid emulator (hfkern._C_emu)."""
    launcher = _Launcher(emulate=True)
    ops = {_FWD: launcher.forward, _BWD: launcher.backward}
    if op not in ops:
        raise ValueError(f"hfkern.cuda.batch_norm implements {sorted(ops)}, got {op!r}")
    return ops[op]
