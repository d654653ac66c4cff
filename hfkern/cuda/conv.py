"""hfkern::array_conv and its gradient ops on the CUDA backend: our depthwise kernels, cuDNN otherwise.

The launchers have the signatures and results (shapes, dtypes, strides) of the
torch implementations in :mod:`hfkern.ops.conv`, whose module docstring is the
op contract. What the cuda backend's convolution is, by call:

* **Depthwise 2-D convolutions** (not transposed, ``groups == C_in == C_out``:
  weight ``[B, C, 1, kh, kw]``) of float32, float16 or bfloat16 data run the
  direct kernels of csrc/conv/depthwise_conv.cu: forward, input gradient and
  weight gradient, any kernel size (3x3 and 5x5 unrolled), stride, padding and
  dilation, float32 accumulation. cuDNN runs B models' depthwise layers as one
  grouped conv of ``B * C`` one-channel groups, its weakest case (MobileNetV2).
* **Every other call** (dense or grouped convs, channel multipliers other than
  1, transposed or 1-D convs, float64) runs the torch implementation, which on
  CUDA tensors is cuDNN's grouped convolution. This is the documented behaviour
  of this backend, not a fallback: the call is served, by the library that is
  fastest for it.

Layouts. Activations are read and written through their five strides, so an
array conv's ``[N, B, C, H, W]`` memory, channels-last array memory ``[N, H, W,
B, C]``, a shared input (``[N, C, H, W]``, or a :func:`hfkern.broadcast` view:
stride 0 on B) and strided slices need no copy. Outputs follow the input's memory
format as the torch implementation's do (:func:`hfkern._array.array_memory_format`);
the thread tile runs along the columns for ``[N, B, C, H, W]`` memory and along
the (model, channel) pairs for channels-last memory, where those are contiguous.
The input gradient of a shared input sums the B models in model order; the weight
gradient is per-block partial sums over chunks of the N * OH output rows added in
chunk order by a second kernel: no atomics, bitwise reproducible. The bias
gradient is the op's autograd formula's, as on every backend.

Mixed dtypes in a depthwise call raise TypeError (the torch path rejects them too).
The launchers check their arguments as the ops do (``check_conv_args`` with every
operand), since benchmarks and the emulator tests call them directly.

``emulated(op)`` runs the same launchers on CPU tensors through ``hfkern._C_emu``,
the kernels built for the host grid emulator (non-depthwise calls run the torch
implementation on the CPU there).
"""

from __future__ import annotations

from typing import Callable, Sequence

import torch
from torch import Tensor

from .._array import array_memory_format, check_conv_args, conv_output_size, new_batch_major
from .._device import sm_count
from .._dtypes import KERNEL_DTYPES
from ..ops.conv import (
    array_conv_input_grad_torch,
    array_conv_torch,
    array_conv_weight_grad_torch,
)
from . import _ext
from ._launch import Launcher, implements

__all__ = ["array_conv", "array_conv_input_grad", "array_conv_weight_grad", "emulated", "is_depthwise"]

_FWD, _DGRAD, _WGRAD = "array_conv", "array_conv_input_grad", "array_conv_weight_grad"

# Threads per block of the element and partial-sum kernels, the most (model, channel)
# lanes of a channels-last tile, and threads of the reduce kernel; rows per thread of
# the element kernels. Under the emulator every block is a group of host threads:
# small blocks, so that small test shapes span several blocks and chunks.
_THREADS, _PAIR_LANES, _REDUCE_THREADS, _ROWS = 256, 64, 128, 2
_EMULATED_THREADS, _EMULATED_PAIR_LANES, _EMULATED_REDUCE_THREADS, _EMULATED_ROWS = 16, 4, 8, 2
# Weight-gradient blocks aimed for per SM (the chunks of N * OH rows fill the device).
_BLOCKS_PER_SM = 4


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def _np2(n: int) -> int:
    return 1 << max(0, int(n) - 1).bit_length()


def is_depthwise(in_channels: int, weight: Tensor, transposed: bool, groups: int, nd: int) -> bool:
    """Whether a call is one the depthwise kernels compute (geometry only): a 2-D conv,
    not transposed, ``groups == C_in == C_out`` (weight ``[B, C, 1, kh, kw]``)."""
    return (nd == 2 and not transposed and weight.dim() == 5 and weight.shape[2] == 1
            and groups == in_channels == weight.shape[1])


def _activation(t: Tensor) -> tuple[int, ...]:
    """An ``[B, N, C, H, W]`` operand (or a shared ``[N, C, H, W]``: s_b = 0) as the binding
    takes it: (address, dtype code, s_b, s_n, s_c, s_h, s_w)."""
    strides = (0, *t.stride()) if t.dim() == 4 else tuple(t.stride())
    return (t.data_ptr(), _ext.DTYPE_CODES[t.dtype], *strides)


def _weight(t: Tensor | None) -> tuple[int, ...]:
    """A weight ``[B, C, 1, kh, kw]`` (its singleton dim dropped) or a bias ``[B, C]``:
    (address, dtype code, s_b, s_c, s_h, s_w); zeros when absent."""
    if t is None:
        return (0, 0, 0, 0, 0, 0)
    if t.dim() == 2:
        return (t.data_ptr(), _ext.DTYPE_CODES[t.dtype], t.stride(0), t.stride(1), 0, 0)
    s = t.stride()
    return (t.data_ptr(), _ext.DTYPE_CODES[t.dtype], s[0], s[1], s[3], s[4])


class _Launcher(Launcher):
    """The depthwise conv kernels on one device kind (:class:`hfkern.cuda._launch.Launcher`)."""

    def __init__(self, emulate: bool):
        super().__init__(emulate)
        if emulate:
            self.threads, self.pair_lanes = _EMULATED_THREADS, _EMULATED_PAIR_LANES
            self.reduce_threads, self.rows = _EMULATED_REDUCE_THREADS, _EMULATED_ROWS
        else:
            self.threads, self.pair_lanes, self.reduce_threads, self.rows = (
                _THREADS, _PAIR_LANES, _REDUCE_THREADS, _ROWS)

    def require(self, ext) -> None:
        if getattr(ext, "DW_MAX_THREADS", 0) < max(self.threads, self.reduce_threads) or \
                getattr(ext, "DW_MAX_ROWS", 0) < self.rows:
            raise RuntimeError(f"{ext.__name__} has no depthwise conv kernels for {self.threads} threads per "
                               f"block and {self.rows} rows per thread; rebuild it")

    # ---- checks -----------------------------------------------------------------------

    def _serves(self, op: str, data: Tensor, in_channels: int, weight: Tensor, transposed: bool, groups: int,
                nd: int, **others: Tensor | None) -> bool:
        """True for a depthwise call of a kernel dtype (after checking its tensors); False
        for a call the torch implementation serves."""
        if not is_depthwise(in_channels, weight, transposed, groups, nd) or data.dtype not in KERNEL_DTYPES:
            return False
        self.check_device(op, "tensors", data)
        for name, t in (("weight", weight), *others.items()):
            if t is None:
                continue
            if t.device != data.device:
                raise ValueError(f"hfkern::{op} on the {self.where}: expected {name} on {data.device}, "
                                 f"got {t.device}")
            if t.dtype != data.dtype:
                raise TypeError(f"hfkern::{op} on the {self.where}: expected {name} of dtype {data.dtype} "
                                f"(the data's), got {t.dtype}")
        return True

    def _geometry(self, op: str, B: int, N: int, C: int, size: Sequence[int], weight: Tensor,
                  stride: Sequence[int], padding: Sequence[int], dilation: Sequence[int]) -> tuple[int, ...]:
        """The binding's geometry (B, N, C, H, W, OH, OW, kh, kw, strides, pads, dilations)."""
        if weight.shape[0] != B:
            raise ValueError(f"hfkern::{op} on the {self.where}: expected weight [B={B}, C, 1, kh, kw] (the "
                             f"array dim of the activations), got {list(weight.shape)}")
        if any(s < 1 for s in stride) or any(p < 0 for p in padding) or any(d < 1 for d in dilation):
            raise ValueError(f"hfkern::{op} on the {self.where}: expected stride >= 1, padding >= 0 and "
                             f"dilation >= 1, got stride {list(stride)}, padding {list(padding)}, "
                             f"dilation {list(dilation)}")
        k = list(weight.shape[-2:])
        out = conv_output_size(size, k, stride, padding, dilation, False, [0, 0])
        if min(size) < 1 or min(out) < 1:
            raise ValueError(f"hfkern::{op} on the {self.where}: the {k[0]}x{k[1]} kernel with dilation "
                             f"{list(dilation)} and padding {list(padding)} does not fit the input of spatial "
                             f"size {list(size)} (output size {out})")
        return (B, N, C, *size, *out, *k, *stride, *padding, *dilation)

    def _tile(self, pairs: int, rows: int, cols: int, channels_last: bool, rows_per_thread: int) -> tuple:
        """(tc, th, tw, rows, c_inner): the block's threads over (pairs, rows, columns), long
        along the dim that runs along memory."""
        threads, row_lanes = self.threads, _np2(_cdiv(rows, rows_per_thread))
        if channels_last:
            tc = min(_np2(pairs), self.pair_lanes, threads)
            tw = min(_np2(cols), max(1, threads // tc))
            th = min(row_lanes, max(1, threads // (tc * tw)))
        else:
            tw = min(_np2(cols), threads)
            th = min(row_lanes, max(1, threads // tw))
            tc = min(_np2(pairs), max(1, threads // (tw * th)))
        return (tc, th, tw, rows_per_thread, int(channels_last))

    # ---- forward ------------------------------------------------------------------------

    def forward(self, x: Tensor, weight: Tensor, bias: Tensor | None, stride: Sequence[int],
                padding: Sequence[int], dilation: Sequence[int], transposed: bool,
                output_padding: Sequence[int], groups: int) -> Tensor:
        def check():  # the op's checks: benchmarks and the emulator tests call the launchers directly
            check_conv_args(f"{_FWD} on the {self.where}", x.dim(), weight, stride, padding, dilation,
                            output_padding, groups, transposed=transposed, x=x, bias=bias)

        nd = len(stride)
        if not self._serves(_FWD, x, x.shape[-nd - 1], weight, transposed, groups, nd, bias=bias):
            check()  # (the torch implementation checks nothing)
            return array_conv_torch(x, weight, bias, stride, padding, dilation, transposed, output_padding, groups)
        shared = x.dim() == 4
        B = weight.shape[0]
        if not shared and x.shape[0] != B:
            raise ValueError(f"hfkern::{_FWD} on the {self.where}: expected x [B={B}, N, C, H, W] (weight's "
                             f"array dim), got {list(x.shape)}")
        N, C = x.shape[-4], x.shape[-3]
        if bias is not None and list(bias.shape) != [B, C]:
            raise ValueError(f"hfkern::{_FWD} on the {self.where}: expected bias of shape {[B, C]}, "
                             f"got {list(bias.shape)}")
        geom = self._geometry(_FWD, B, N, C, x.shape[-2:], weight, stride, padding, dilation)
        check()  # what the depthwise checks above leave out (dims, lengths), before the kernel reads anything
        fmt = array_memory_format(x, shared=shared)
        OH, OW = geom[5], geom[6]
        y = new_batch_major(x, (B, N, C, OH, OW), fmt)
        if y.numel() == 0:
            return y
        ext = self.ext(x.device)
        tile = self._tile(B * C, OH, OW, fmt == torch.channels_last, self.rows)
        ext.depthwise_conv_fwd(_activation(x), _weight(weight), _weight(bias), _activation(y), geom, tile,
                               _ext.stream(x.device))
        return y

    # ---- input gradient ----------------------------------------------------------------

    def input_grad(self, grad_out: Tensor, weight: Tensor, input_size: Sequence[int], stride: Sequence[int],
                   padding: Sequence[int], dilation: Sequence[int], transposed: bool,
                   output_padding: Sequence[int], groups: int) -> Tensor:
        def check():
            check_conv_args(f"{_DGRAD} on the {self.where}", len(input_size), weight, stride, padding, dilation,
                            output_padding, groups, grad_out=grad_out, transposed=transposed, input_size=input_size)

        nd = len(stride)
        if not self._serves(_DGRAD, grad_out, input_size[-nd - 1], weight, transposed, groups, nd):
            check()
            return array_conv_input_grad_torch(grad_out, weight, input_size, stride, padding, dilation,
                                               transposed, output_padding, groups)
        shared = len(input_size) == 4
        B = weight.shape[0]
        N, C = input_size[-4], input_size[-3]
        if not shared and input_size[0] != B:
            raise ValueError(f"hfkern::{_DGRAD} on the {self.where}: expected input_size [B={B}, N, C, H, W], "
                             f"got {list(input_size)}")
        geom = self._geometry(_DGRAD, B, N, C, list(input_size[-2:]), weight, stride, padding, dilation)
        expected = [B, N, C, geom[5], geom[6]]
        if list(grad_out.shape) != expected:
            raise ValueError(f"hfkern::{_DGRAD} on the {self.where}: expected grad_out of shape {expected} "
                             f"(the output of an input of size {list(input_size)}), got {list(grad_out.shape)}")
        check()
        fmt = array_memory_format(grad_out)
        if shared:
            grad_x = torch.empty(list(input_size), dtype=grad_out.dtype, device=grad_out.device,
                                 memory_format=fmt)
        else:
            grad_x = new_batch_major(grad_out, list(input_size), fmt)
        if grad_x.numel() == 0:
            return grad_x
        ext = self.ext(grad_out.device)
        H, W = geom[3], geom[4]
        tile = self._tile(C if shared else B * C, H, W, fmt == torch.channels_last, self.rows)
        ext.depthwise_conv_dgrad(_activation(grad_out), _weight(weight), _activation(grad_x), shared, geom, tile,
                                 _ext.stream(grad_out.device))
        return grad_x

    # ---- weight gradient ---------------------------------------------------------------

    def weight_grad(self, grad_out: Tensor, x: Tensor, weight: Tensor, stride: Sequence[int],
                    padding: Sequence[int], dilation: Sequence[int], transposed: bool,
                    output_padding: Sequence[int], groups: int) -> Tensor:
        def check():
            check_conv_args(f"{_WGRAD} on the {self.where}", x.dim(), weight, stride, padding, dilation,
                            output_padding, groups, grad_out=grad_out, transposed=transposed, x=x)

        nd = len(stride)
        if not self._serves(_WGRAD, grad_out, x.shape[-nd - 1], weight, transposed, groups, nd, x=x):
            check()
            return array_conv_weight_grad_torch(grad_out, x, weight, stride, padding, dilation, transposed,
                                                output_padding, groups)
        B = weight.shape[0]
        if x.dim() == 5 and x.shape[0] != B:
            raise ValueError(f"hfkern::{_WGRAD} on the {self.where}: expected x [B={B}, N, C, H, W] (weight's "
                             f"array dim), got {list(x.shape)}")
        N, C = x.shape[-4], x.shape[-3]
        geom = self._geometry(_WGRAD, B, N, C, x.shape[-2:], weight, stride, padding, dilation)
        OH, OW, kh, kw = geom[5], geom[6], geom[7], geom[8]
        expected = [B, N, C, OH, OW]
        if list(grad_out.shape) != expected:
            raise ValueError(f"hfkern::{_WGRAD} on the {self.where}: expected grad_out of shape {expected} "
                             f"(the output of x of shape {list(x.shape)}), got {list(grad_out.shape)}")
        check()
        grad_w = torch.empty_like(weight)
        if grad_w.numel() == 0:
            return grad_w
        ext = self.ext(grad_out.device)
        stream = _ext.stream(grad_out.device)
        rows = N * OH
        partials, P = None, 0
        if rows > 0:
            tile = self._tile(B * C, rows, OW, array_memory_format(grad_out) == torch.channels_last, 1)
            th = tile[1]
            if self.emulate:  # a few rows per chunk: several chunks even at test sizes
                chunk_rows = th
            else:
                taps = 1 if (kh, kw) in ((3, 3), (5, 5)) else kh * kw
                programs = _cdiv(B * C, tile[0]) * taps
                P = max(1, min(_cdiv(_BLOCKS_PER_SM * sm_count(grad_out.device), programs), _cdiv(rows, th)))
                chunk_rows = _cdiv(_cdiv(rows, P), th) * th  # whole row lanes per chunk
            P = _cdiv(rows, chunk_rows)
            partials = torch.empty((B * C, P, kh * kw), dtype=torch.float32, device=grad_out.device)
            ext.depthwise_conv_wgrad_partials(_activation(grad_out), _activation(x), geom, tile, chunk_rows, P,
                                              partials.data_ptr(), stream)
        # P == 0 (no samples): the reduce writes zeros
        ext.depthwise_conv_wgrad_reduce(partials.data_ptr() if partials is not None else 0, geom, P,
                                        _weight(grad_w), self.reduce_threads, stream)
        return grad_w


_device_launcher = _Launcher(emulate=False)


# Registered for CUDA tensors and every call: depthwise ones run our kernels, the others
# the torch implementation (cuDNN), as the module docstring states. auto never picks
# them until a committed GPU result of a training step shows them faster than the torch
# path; set_backend("cuda") selects them.
def _implements(op: str):
    return implements(op, dtypes=None)


@_implements(_FWD)
def array_conv(x: Tensor, weight: Tensor, bias: Tensor | None, stride: Sequence[int], padding: Sequence[int],
               dilation: Sequence[int], transposed: bool, output_padding: Sequence[int], groups: int) -> Tensor:
    """The array conv (:mod:`hfkern.ops.conv`): depthwise 2-D convs (weight ``[B, C, 1, kh, kw]``,
    ``groups == C``) of float32/float16/bfloat16 on our kernels, every other call on cuDNN.

    x ``[B, N, C, H, W]`` (any strides) or a shared ``[N, C, H, W]``; bias ``[B, C]`` or None.
    Returns ``[B, N, C, OH, OW]`` in x's array memory format.
    """
    return _device_launcher.forward(x, weight, bias, stride, padding, dilation, transposed, output_padding, groups)


@_implements(_DGRAD)
def array_conv_input_grad(grad_out: Tensor, weight: Tensor, input_size: Sequence[int], stride: Sequence[int],
                          padding: Sequence[int], dilation: Sequence[int], transposed: bool,
                          output_padding: Sequence[int], groups: int) -> Tensor:
    """d(loss)/dx of the array conv (for a shared input summed over the models), in grad_out's
    memory format; depthwise calls on our kernels, every other call on cuDNN."""
    return _device_launcher.input_grad(grad_out, weight, input_size, stride, padding, dilation, transposed,
                                       output_padding, groups)


@_implements(_WGRAD)
def array_conv_weight_grad(grad_out: Tensor, x: Tensor, weight: Tensor, stride: Sequence[int],
                           padding: Sequence[int], dilation: Sequence[int], transposed: bool,
                           output_padding: Sequence[int], groups: int) -> Tensor:
    """d(loss)/dweight of the array conv, shaped and laid out as ``torch.empty_like(weight)``;
    depthwise calls on our kernels (deterministic two-pass reduction), every other call on cuDNN."""
    return _device_launcher.weight_grad(grad_out, x, weight, stride, padding, dilation, transposed,
                                        output_padding, groups)


def emulated(op: str) -> Callable[..., Tensor]:
    """The cuda launcher of ``op`` (``"array_conv"``, ``"array_conv_input_grad"`` or
    ``"array_conv_weight_grad"``) on CPU tensors, running the same kernel sources in the
    host grid emulator (hfkern._C_emu); non-depthwise calls run the torch implementation."""
    launcher = _Launcher(emulate=True)
    ops = {_FWD: launcher.forward, _DGRAD: launcher.input_grad, _WGRAD: launcher.weight_grad}
    if op not in ops:
        raise ValueError(f"hfkern.cuda.conv implements {sorted(ops)}, got {op!r}")
    return ops[op]
