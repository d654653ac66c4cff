"""hfkern::array_conv: B convolutions (1-D or 2-D, plain or transposed) as one op.

Ops (all registered with torch.library, implementations chosen by the registry):

``array_conv(x, weight, bias, stride, padding, dilation, transposed, output_padding, groups)``
    x ``[B, N, C_in, *s]`` (or ``[N, C_in, *s]`` for an input shared by all B
    models), weight ``[B, C_out, C_in/groups, *k]`` (transposed:
    ``[B, C_in, C_out/groups, *k]``), bias ``[B, C_out]`` or None.
    Returns ``[B, N, C_out, *s']``, stored as ``[N, B, C_out, *s']`` memory, or
    for a 2-D conv of a channels-last input (``[N, H, W, B, C_in]`` memory, or a
    shared ``[N, C_in, H, W]`` in ``torch.channels_last``) as ``[N, H', W', B,
    C_out]`` memory (:func:`hfkern._array.array_memory_format`): the output
    keeps the input's memory format.
``array_conv_input_grad(grad_out, weight, input_size, ...)``
    The input gradient (for a shared input: summed over the models), in
    grad_out's memory format.
``array_conv_weight_grad(grad_out, x, weight, ...)``
    The weight gradient, shaped and laid out like ``weight``
    (``torch.empty_like(weight)``): an array conv module stores its weight so
    that the grouped weight ``[B*C_out, C_in/g, kh, kw]`` is channels-last when
    its activations are, and its gradient follows.

``*s`` and ``*k`` are one or two spatial dims, and ``stride``, ``padding``,
``dilation`` and ``output_padding`` have one entry per spatial dim. 3-D
convolution is not implemented: every op raises ``NotImplementedError`` for it
(and ``ValueError`` for arguments of inconsistent dimensionality) before any
backend runs. Padding is symmetric per spatial dim; modules apply asymmetric or
non-zero padding with ``F.pad`` first, as torch does. The bias gradient is a
plain reduction done in the autograd formula (:func:`_bias_grad`).

Every op is differentiable to any order (double backward for gradient
penalties, MAML): the two gradient ops are linear in each argument, and
their own gradients are array convs and gradient ops again, on the backend
the differentiated op ran.
"""

from __future__ import annotations

import math
from typing import Sequence

import torch
from torch import Tensor

from .. import _backend
from . import _autocast
from .._array import (
    array_memory_format, check_conv_args, conv_output_size, eager_empty_like, exact_batch_major,
    exact_empty_strides, fresh_array, from_grouped, like_weight, new_batch_major, op_result,
    per_model_memory_first, refuse_forward_ad, to_grouped,
)

__all__ = ["array_conv", "array_conv_input_grad", "array_conv_weight_grad", "conv"]

_FWD, _DGRAD, _WGRAD = "array_conv", "array_conv_input_grad", "array_conv_weight_grad"

aten = torch.ops.aten


# ---- the torch implementations (CPU path and oracle) ---------------------------
#
# cuDNN / oneDNN grouped convolution: the B models' convolutions become one
# convolution with ``groups = B * groups`` over ``[N, B*C, *s]`` tensors, which
# is exactly the physical layout the array conv keeps its activations in, so
# neither the input nor the output is copied. A shared input instead runs one
# dense convolution with the B weights concatenated on the output channels.
#
# Shapes (``g`` = groups within one model)::
#
#     x       [B, N, C_in, *s]   per-model input, or [N, C_in, *s] shared
#     weight  [B, C_out, C_in/g, *k]        (transposed: [B, C_in, C_out/g, *k])
#     bias    [B, C_out]
#     out     [B, N, C_out, *s']  view of [N, B, C_out, *s'] memory


def _out_channels(weight: Tensor, transposed: bool, groups: int) -> int:
    return weight.shape[2] * groups if transposed else weight.shape[1]


def _flat_weight(weight: Tensor) -> Tensor:
    """[B, A, b, *k] -> [B*A, b, *k]: the per-model weights of the grouped conv."""
    return weight.reshape(weight.shape[0] * weight.shape[1], *weight.shape[2:])


def _dense_weight(weight: Tensor, transposed: bool, groups: int) -> Tensor:
    """The B weights concatenated on the output channels for one dense conv.

    Output channels come out in (group, model, channel-in-group) order, so each
    of the ``groups`` groups of the dense conv sees the same input channels as
    that group in every model.
    """
    B = weight.shape[0]
    if transposed:  # [B, C_in, C_out/g, *k] -> [C_in, B*C_out/g, *k]
        w = weight.transpose(0, 1)
        return w.reshape(w.shape[0], B * w.shape[2], *w.shape[3:])
    co_g = weight.shape[1] // groups  # [B, C_out, C_in/g, *k] -> [g*B*C_out/g, C_in/g, *k]
    w = weight.reshape(B, groups, co_g, *weight.shape[2:]).transpose(0, 1)
    return w.reshape(groups * B * co_g, *weight.shape[2:])


def _swap_channel_blocks(y: Tensor, outer: int, inner: int) -> Tensor:
    """[N, (outer, inner, c), *s] channel order -> [N, (inner, outer, c), *s]; with
    (groups, B) the dense conv's order to the array's, with (B, groups) back.
    A copy only when both are > 1."""
    if outer == 1 or inner == 1:
        return y
    N, C = y.shape[:2]
    return y.reshape(N, outer, inner, C // (outer * inner), *y.shape[2:]).transpose(1, 2).reshape(y.shape)


def _pointwise(x: Tensor, weight: Tensor, stride, padding, dilation, transposed: bool, groups: int) -> bool:
    """Whether a per-model conv is a 1x1 conv that the CPU runs faster as a batched
    matmul ``[B, C_out, C_in] @ [N, B, C_in, prod(s)]`` than as one grouped conv.

    oneDNN has no fast kernel for many small groups (a 1x1 Conv1d falls back to
    a loop over them). The matmul broadcasts the weights over the N samples,
    which costs ``N * C_out * C_in`` extra traffic against the activations'
    ``N * (C_in + C_out) * prod(s)``: it is used where the first is at most the
    second (PointNet's point-wise layers, MobileNetV2's 1x1 layers at 8x8 and
    above; not at 4x4 with 960 channels). bench/results/conv_pointwise_cpu-*.json
    holds the measurement this rule rests on; CUDA keeps cuDNN's grouped conv.
    """
    if not (x.device.type == "cpu" and x.dim() == weight.dim() and not transposed and groups == 1
            and all(k == 1 for k in weight.shape[3:]) and all(v == 1 for v in stride)
            and all(v == 0 for v in padding) and all(v == 1 for v in dilation)
            and array_memory_format(x) == torch.contiguous_format):
        return False
    c_out, c_in = weight.shape[1], weight.shape[2]
    return c_out * c_in <= (c_in + c_out) * math.prod(x.shape[3:])


def _pointwise_matmul(w: Tensor, x: Tensor) -> Tensor:
    """``[B, O, I] @ x [B, N, I, *s]`` -> ``[B, N, O, *s]``, a view of ``[N, B, O, *s]`` memory."""
    B, N, _, *s = x.shape
    # (the plane's size spelled out: -1 is ambiguous for an empty batch, N = 0)
    y = torch.matmul(w, x.transpose(0, 1).reshape(N, B, x.shape[2], math.prod(s)))
    return y.view(N, B, w.shape[1], *s).transpose(0, 1)


def _pointwise_weight_grad(grad_out: Tensor, x: Tensor) -> Tensor:
    """The weight gradient of :func:`_pointwise_matmul`: ``[B, O, I]``, the sum over the N
    samples of ``grad_out[b, n] @ x[b, n]^T``, as one batched matmul and a sum. Its
    ``[N, B, O, I]`` partial products are at most the activations' size (the rule of
    :func:`_pointwise`); oneDNN's grouped 1x1 weight gradient took 1.1x to 4.3x its time on
    MobileNetV2's and PointNet's layers (B = 8, one thread:
    bench/results/conv_pointwise_wgrad_cpu-1thread_2026-11-28.md, from
    bench/bench_pointwise_wgrad.py). Float32 and float64 only: reduced-precision
    partial products would be rounded before they are summed."""
    B, N = x.shape[:2]
    g = grad_out.transpose(0, 1).reshape(N, B, grad_out.shape[2], math.prod(grad_out.shape[3:]))
    xs = x.transpose(0, 1).reshape(N, B, x.shape[2], math.prod(x.shape[3:]))
    return torch.matmul(g, xs.transpose(-1, -2)).sum(0)


def _conv_torch(
    x: Tensor, weight: Tensor, bias: Tensor | None, stride: Sequence[int], padding: Sequence[int],
    dilation: Sequence[int], transposed: bool, output_padding: Sequence[int], groups: int, fresh: bool = False,
) -> Tensor:
    """The torch path's forward in differentiable torch ops: a view of the grouped result,
    or with ``fresh`` (under autograd) a tensor of its own (:func:`fresh_array`); the
    CPU's 1x1 matmul path gives a view either way (:func:`conv` leaves it to the op).
    Without ``fresh`` (the op's kernel), with exactly the strides of the op's fake
    (:func:`hfkern._array.exact_batch_major`)."""
    B = weight.shape[0]
    fmt = array_memory_format(x, shared=x.dim() != weight.dim())
    to_array = fresh_array if fresh else _from_grouped_exact
    if _pointwise(x, weight, stride, padding, dilation, transposed, groups):
        y = _pointwise_matmul(weight.flatten(2), x)
        if bias is not None:
            y = y.add_(bias.view(B, 1, -1, *([1] * (x.dim() - 3))))
        return y if fresh else exact_batch_major(y, fmt)
    if x.dim() == weight.dim():  # per-model input
        return to_array(_grouped_conv(x, weight, bias, stride, padding, dilation, transposed, output_padding,
                                      groups), B, fmt)
    # shared input [N, C_in, *s]: one dense conv
    dense_bias = None
    if bias is not None:
        dense_bias = bias.reshape(B, groups, -1).transpose(0, 1).reshape(-1)
    y = torch.convolution(
        x, _dense_weight(weight, transposed, groups), dense_bias,
        stride, padding, dilation, transposed, output_padding, groups,
    )
    return to_array(_swap_channel_blocks(y, groups, B), B, fmt)


def _from_grouped_exact(y: Tensor, B: int, fmt: torch.memory_format) -> Tensor:
    """:func:`hfkern._array.from_grouped` with the strides of :func:`new_batch_major` (the
    fakes') on dims of size one too: one channel or one model in channels-last memory
    then reads as channels-last, as the fake does, not as the view's contiguous strides."""
    return exact_batch_major(from_grouped(y, B, fmt), fmt)


def _grouped_conv(
    x: Tensor, weight: Tensor, bias: Tensor | None, stride: Sequence[int], padding: Sequence[int],
    dilation: Sequence[int], transposed: bool, output_padding: Sequence[int], groups: int,
) -> Tensor:
    """The convolution of a per-model input as one grouped convolution: ``[N, B*C_out, *s']``."""
    return _conv_of_grouped(to_grouped(x), weight, bias, stride, padding, dilation, transposed, output_padding,
                            groups)


def _conv_of_grouped(
    xg: Tensor, weight: Tensor, bias: Tensor | None, stride: Sequence[int], padding: Sequence[int],
    dilation: Sequence[int], transposed: bool, output_padding: Sequence[int], groups: int,
) -> Tensor:
    """:func:`_grouped_conv` of the input's grouped form ``xg`` (``[N, B*C_in, *s]``)."""
    return torch.convolution(
        xg, _flat_weight(weight), None if bias is None else bias.reshape(-1),
        stride, padding, dilation, transposed, output_padding, weight.shape[0] * groups,
    )


@_backend.implements(_FWD, "torch")
def array_conv_torch(
    x: Tensor, weight: Tensor, bias: Tensor | None, stride: Sequence[int], padding: Sequence[int],
    dilation: Sequence[int], transposed: bool, output_padding: Sequence[int], groups: int,
) -> Tensor:
    return op_result(_conv_torch(x, weight, bias, stride, padding, dilation, transposed, output_padding, groups))


@_backend.implements(_DGRAD, "torch")
def array_conv_input_grad_torch(
    grad_out: Tensor, weight: Tensor, input_size: Sequence[int], stride: Sequence[int],
    padding: Sequence[int], dilation: Sequence[int], transposed: bool,
    output_padding: Sequence[int], groups: int,
) -> Tensor:
    """d(loss)/dx: the adjoint convolution of grad_out (a transposed conv for a conv)."""
    B = weight.shape[0]
    shared = len(input_size) == weight.dim() - 1
    fmt = array_memory_format(grad_out)
    if 0 in grad_out.shape[3:]:  # an empty output reached no input: aten refuses an empty plane
        zeros = (torch.empty(input_size, dtype=grad_out.dtype, device=grad_out.device, memory_format=fmt)
                 if shared else new_batch_major(grad_out, input_size, fmt)).zero_()  # (zeros takes no memory_format)
        return op_result(zeros)
    if not shared and _pointwise(grad_out, weight, stride, padding, dilation, transposed, groups):
        return op_result(exact_batch_major(_pointwise_matmul(weight.flatten(2).transpose(1, 2), grad_out), fmt))
    if shared:  # the sum over the B models falls out of the dense conv
        gy = _swap_channel_blocks(to_grouped(grad_out), B, groups)
        w, g = _dense_weight(weight, transposed, groups), groups
    else:
        gy = to_grouped(grad_out)
        w, g = _flat_weight(weight), B * groups
    nd = len(stride)
    if transposed:
        adjoint_padding = [0] * nd
    else:  # the output_padding that makes the transposed conv of grad_out land on input_size
        reached = conv_output_size(gy.shape[2:], weight.shape[-nd:], stride, padding, dilation,
                                   True, [0] * nd)
        adjoint_padding = [i - r for i, r in zip(input_size[-nd:], reached)]
    gx = aten.convolution(gy, w, None, stride, padding, dilation, not transposed, adjoint_padding, g)
    if transposed and list(gx.shape[2:]) != list(input_size[-nd:]):
        # The adjoint of a transposed conv reads the output_padding rows too: at stride 1
        # (output_padding < dilation) they give rows past the input's, which no input
        # element reached. (At stride > 1 the plain conv's floor drops them.)
        gx = gx[(slice(None), slice(None), *(slice(0, n) for n in input_size[-nd:]))]
    # the fake's strides exactly, dims of size one included (:func:`exact_empty_strides`)
    return op_result(exact_empty_strides(gx, fmt) if shared else _from_grouped_exact(gx, B, fmt))


@_backend.implements(_WGRAD, "torch")
def array_conv_weight_grad_torch(
    grad_out: Tensor, x: Tensor, weight: Tensor, stride: Sequence[int], padding: Sequence[int],
    dilation: Sequence[int], transposed: bool, output_padding: Sequence[int], groups: int,
) -> Tensor:
    """d(loss)/dweight (``weight`` is read for its shape only)."""
    B = weight.shape[0]
    if 0 in grad_out.shape[3:]:  # an empty output: no product reached the weight
        return like_weight(torch.zeros_like(weight), weight)
    if x.dtype in (torch.float32, torch.float64) and grad_out.dtype == x.dtype and \
            _pointwise(x, weight, stride, padding, dilation, transposed, groups):
        return like_weight(_pointwise_weight_grad(grad_out, x).view(weight.shape), weight)
    if x.dim() == weight.dim():
        gw = aten.convolution_backward(
            to_grouped(grad_out), to_grouped(x), _flat_weight(weight), None,
            stride, padding, dilation, transposed, output_padding, B * groups,
            [False, True, False],
        )[1]
        return like_weight(gw.reshape(weight.shape), weight)
    gw = aten.convolution_backward(
        _swap_channel_blocks(to_grouped(grad_out), B, groups), x,
        _dense_weight(weight, transposed, groups), None,
        stride, padding, dilation, transposed, output_padding, groups,
        [False, True, False],
    )[1]
    if transposed:  # [C_in, B*C_out/g, *k] -> [B, C_in, C_out/g, *k]
        return like_weight(gw.reshape(gw.shape[0], B, -1, *gw.shape[2:]).transpose(0, 1), weight)
    # [(g, B, c), C_in/g, *k] -> [B, (g, c), C_in/g, *k]
    return like_weight(gw.reshape(groups, B, -1, *gw.shape[1:]).transpose(0, 1).reshape(weight.shape), weight)


def conv(
    x: Tensor, weight: Tensor, bias: Tensor | None, stride: list[int], padding: list[int],
    dilation: list[int], transposed: bool, output_padding: list[int], groups: int,
) -> Tensor:
    """The differentiable array convolution (what ``hfkern.nn``'s convolutions call):
    ``hfkern::array_conv``'s arguments, results and layouts.

    Where the torch backend serves the call in eager mode
    (:func:`hfkern._backend.eager_torch`), the torch implementation runs under
    torch's own autograd: one C++ backward node (``convolution_backward``, input
    and weight gradients in one call) instead of the op's Python formula and
    its two gradient ops. The CPU's 1x1 convolutions that run as batched
    matmuls keep the op's formula, which reads the weights (under autograd the
    matmul would save them broadcast over the N samples), in an autograd
    Function that calls the torch implementations without the dispatcher.
    Otherwise (another backend, ``torch.compile``) the op.
    """
    if not _backend.eager_torch(_FWD, x.device):
        refuse_forward_ad(_FWD, x, weight, bias)
        return array_conv(x, weight, bias, stride, padding, dilation, transposed, output_padding, groups)
    x, weight, bias = _eager_inputs(x, weight, bias, stride, padding, dilation, transposed, output_padding, groups)
    if _pointwise(x, weight, stride, padding, dilation, transposed, groups):
        return _EagerConv.apply(x, weight, bias, stride, padding, dilation, transposed, output_padding, groups)
    return _conv_torch(x, weight, bias, stride, padding, dilation, transposed, output_padding, groups, fresh=True)


def _eager_inputs(x, weight, bias, stride, padding, dilation, transposed, output_padding, groups):
    """The eager path's ``(x, weight, bias)``: the op's autocast rule, then its argument checks
    (on the dtypes the op would receive)."""
    x, weight, bias = _autocast.cast_inputs("hfkern::array_conv", x.device.type, x, weight, bias)
    check_conv_args(_FWD, x.dim(), weight, stride, padding, dilation, output_padding, groups,
                    transposed=transposed, x=x, bias=bias)
    return x, weight, bias


def grouped_conv(
    x: Tensor, weight: Tensor, bias: Tensor | None, stride: list[int], padding: list[int],
    dilation: list[int], transposed: bool, output_padding: list[int], groups: int, *, checked: bool = False,
) -> tuple[Tensor, torch.memory_format] | None:
    """:func:`conv`'s eager torch path for a per-model input, stopped before the array
    view: ``(y, fmt)``, ``y`` the grouped result ``[N, B*C_out, *s']`` (differentiable by
    torch's autograd) and ``fmt`` the array memory format ``conv`` would give the output
    (:func:`hfkern._array.fresh_array` of the two is exactly its result; for the CPU's 1x1
    convolutions, the grouped view of ``conv``'s batched-matmul result). None where
    ``conv`` takes another path: another backend or ``torch.compile``, a shared input.
    What ``hfkern.fuse`` runs for a convolution whose output only a batch norm reads
    (:func:`hfkern.ops.batch_norm.grouped_batch_norm`).

    ``checked``: the caller knows that a call with the same metadata (shapes, strides,
    dtypes, devices, arguments, backend selection, autocast state) took this path and
    passed the op's checks, so they are not repeated; autocast's casts still apply."""
    if not checked:
        if not _backend.eager_torch(_FWD, x.device) or x.dim() != weight.dim():
            return None
        x, weight, bias = _eager_inputs(x, weight, bias, stride, padding, dilation, transposed, output_padding,
                                        groups)
    else:
        x, weight, bias = _autocast.cast_inputs("hfkern::array_conv", x.device.type, x, weight, bias)
    fmt = array_memory_format(x)
    if _pointwise(x, weight, stride, padding, dilation, transposed, groups):
        # [B, N, C_out, *s] in [N, B, C_out, *s] memory: its grouped view is free
        y = _EagerConv.apply(x, weight, bias, stride, padding, dilation, transposed, output_padding, groups)
        return to_grouped(y), fmt
    return _grouped_conv(x, weight, bias, stride, padding, dilation, transposed, output_padding, groups), fmt


class GroupedConvCall:
    """:func:`grouped_conv` with ``checked=True`` for calls of the metadata of the call it
    was made for (:meth:`make`), its decisions made once: the path, the memory format and
    the convolution's arguments. A call applies autocast's rule and runs the grouped
    convolution, nothing else. What ``hfkern.fuse`` runs for a convolution whose calls
    keep the metadata of one it served (a training loop's steady state)."""

    __slots__ = ("fmt", "_args")

    def __init__(self, fmt: torch.memory_format, args: tuple):
        self.fmt = fmt
        self._args = args

    @classmethod
    def make(
        cls, x: Tensor, weight: Tensor, bias: Tensor | None, stride: Sequence[int], padding: Sequence[int],
        dilation: Sequence[int], transposed: bool, output_padding: Sequence[int], groups: int,
    ) -> "GroupedConvCall | None":
        """For calls like ``grouped_conv(x, weight, bias, ...)``, which passed its checks and
        took its grouped path; None where the CPU's 1x1 matmul path serves the call."""
        x, weight, bias = _autocast.cast_inputs("hfkern::array_conv", x.device.type, x, weight, bias)
        if _pointwise(x, weight, stride, padding, dilation, transposed, groups):
            return None
        args = (list(stride), list(padding), list(dilation), transposed, list(output_padding), groups)
        return cls(array_memory_format(x), args)

    def __call__(self, x: Tensor, weight: Tensor, bias: Tensor | None, *, grouped: bool = False) -> Tensor:
        """The grouped result ``[N, B*C_out, *s']`` (what ``grouped_conv`` returns with :attr:`fmt`).
        ``grouped``: ``x`` is the input's grouped form ``[N, B*C_in, *s]`` (its view
        ``to_grouped`` gives), not the array."""
        x, weight, bias = _autocast.cast_inputs("hfkern::array_conv", x.device.type, x, weight, bias)
        return _conv_of_grouped(x if grouped else to_grouped(x), weight, bias, *self._args)


class _EagerConv(torch.autograd.Function):
    """``hfkern::array_conv`` with its formula, the torch implementations called directly
    (as the op calls them, below autocast). A backward that builds a graph
    (``create_graph=True``) runs the op's formula, whose gradient ops are differentiable."""

    @staticmethod
    def forward(ctx, x, weight, bias, stride, padding, dilation, transposed, output_padding, groups):
        args = (stride, padding, dilation, transposed, output_padding, groups)
        fn = _backend.resolve(_FWD, x.device)
        if torch.is_autocast_enabled(x.device.type):
            with torch.autocast(x.device.type, enabled=False):
                y = fn(x, weight, bias, *args)
        else:
            y = fn(x, weight, bias, *args)
        _setup_context(ctx, (x, weight, bias, *args), y)
        return y

    @staticmethod
    def backward(ctx, grad_out):
        if torch.is_grad_enabled():
            return _backward(ctx, grad_out)
        x, weight = ctx.saved_tensors
        grad_x = grad_w = grad_b = None
        with _backend.pinned(ctx.backend):
            if ctx.needs_input_grad[0]:
                grad_x = _backend.resolve(_DGRAD, grad_out.device)(grad_out, weight, ctx.input_size, *ctx.conv_args)
            if ctx.needs_input_grad[1]:
                grad_w = _backend.resolve(_WGRAD, grad_out.device)(grad_out, x, weight, *ctx.conv_args)
        if ctx.has_bias and ctx.needs_input_grad[2]:
            grad_b = _bias_grad(grad_out)
        return grad_x, grad_w, grad_b, None, None, None, None, None, None


# ---- the ops -------------------------------------------------------------------

@torch.library.custom_op("hfkern::array_conv", mutates_args=())
def array_conv(
    x: Tensor,
    weight: Tensor,
    bias: Tensor | None,
    stride: list[int],
    padding: list[int],
    dilation: list[int],
    transposed: bool,
    output_padding: list[int],
    groups: int,
) -> Tensor:
    check_conv_args(_FWD, x.dim(), weight, stride, padding, dilation, output_padding, groups,
                    transposed=transposed, x=x, bias=bias)
    fn = _backend.resolve(_FWD, x.device)
    return fn(x, weight, bias, stride, padding, dilation, transposed, output_padding, groups)


@array_conv.register_fake
def _(x, weight, bias, stride, padding, dilation, transposed, output_padding, groups):
    check_conv_args(_FWD, x.dim(), weight, stride, padding, dilation, output_padding, groups,
                    transposed=transposed, x=x, bias=bias)
    nd = len(stride)
    out = conv_output_size(x.shape[-nd:], weight.shape[-nd:], stride, padding, dilation, transposed,
                           output_padding)
    C_out = _out_channels(weight, transposed, groups)
    fmt = array_memory_format(x, shared=x.dim() != weight.dim())
    return new_batch_major(x, (weight.shape[0], x.shape[-nd - 2], C_out, *out), fmt)


@torch.library.custom_op("hfkern::array_conv_input_grad", mutates_args=())
def array_conv_input_grad(
    grad_out: Tensor,
    weight: Tensor,
    input_size: list[int],
    stride: list[int],
    padding: list[int],
    dilation: list[int],
    transposed: bool,
    output_padding: list[int],
    groups: int,
) -> Tensor:
    check_conv_args(_DGRAD, len(input_size), weight, stride, padding, dilation, output_padding,
                    groups, grad_out=grad_out, transposed=transposed, input_size=input_size)
    fn = _backend.resolve(_DGRAD, grad_out.device)
    return fn(grad_out, weight, input_size, stride, padding, dilation, transposed, output_padding, groups)


@array_conv_input_grad.register_fake
def _(grad_out, weight, input_size, stride, padding, dilation, transposed, output_padding, groups):
    check_conv_args(_DGRAD, len(input_size), weight, stride, padding, dilation, output_padding,
                    groups, grad_out=grad_out, transposed=transposed, input_size=input_size)
    fmt = array_memory_format(grad_out)
    if len(input_size) == weight.dim() - 1:  # shared input
        return torch.empty(input_size, dtype=grad_out.dtype, device=grad_out.device, memory_format=fmt)
    return new_batch_major(grad_out, input_size, fmt)


@torch.library.custom_op("hfkern::array_conv_weight_grad", mutates_args=())
def array_conv_weight_grad(
    grad_out: Tensor,
    x: Tensor,
    weight: Tensor,
    stride: list[int],
    padding: list[int],
    dilation: list[int],
    transposed: bool,
    output_padding: list[int],
    groups: int,
) -> Tensor:
    check_conv_args(_WGRAD, x.dim(), weight, stride, padding, dilation, output_padding, groups,
                    grad_out=grad_out, transposed=transposed, x=x)
    fn = _backend.resolve(_WGRAD, grad_out.device)
    return fn(grad_out, x, weight, stride, padding, dilation, transposed, output_padding, groups)


@array_conv_weight_grad.register_fake
def _(grad_out, x, weight, stride, padding, dilation, transposed, output_padding, groups):
    check_conv_args(_WGRAD, x.dim(), weight, stride, padding, dilation, output_padding, groups,
                    grad_out=grad_out, transposed=transposed, x=x)
    return eager_empty_like(weight)  # (a fake's own empty_like differs on dims of size one)


# Every formula runs its ops pinned to the backend that served the op it
# differentiates (recorded in setup_context): a backward run on another thread,
# or after the use_backend block of its forward, still runs that backend.

def _setup_context(ctx, inputs, output):
    x, weight, bias, stride, padding, dilation, transposed, output_padding, groups = inputs
    ctx.save_for_backward(x, weight)
    ctx.has_bias = bias is not None
    ctx.input_size = list(x.shape)
    ctx.conv_args = (stride, padding, dilation, transposed, output_padding, groups)
    ctx.backend = _backend.current(_FWD, x.device)


def _backward(ctx, grad_out):
    x, weight = ctx.saved_tensors
    grad_x = grad_w = grad_b = None
    with _backend.pinned(ctx.backend):
        if ctx.needs_input_grad[0]:
            grad_x = array_conv_input_grad(grad_out, weight, ctx.input_size, *ctx.conv_args)
        if ctx.needs_input_grad[1]:
            grad_w = array_conv_weight_grad(grad_out, x, weight, *ctx.conv_args)
    if ctx.has_bias and ctx.needs_input_grad[2]:
        grad_b = _bias_grad(grad_out)
    return grad_x, grad_w, grad_b, None, None, None, None, None, None


def _bias_grad(grad_out: Tensor) -> Tensor:
    """The bias gradient ``[B, C_out]``: grad_out ``[B, N, C_out, *s]`` summed over N and s.

    Two reductions, the spatial dims first, each over grad_out's batch dims in
    memory order (``[N, B, ...]`` for an array conv): on the CPU one reduction
    over N and s together, whose kept channel dims lie between them in memory,
    runs at a third to half that speed (bench/profile_step.py's digits CNN).
    """
    acc = torch.promote_types(grad_out.dtype, torch.float32)
    if array_memory_format(grad_out) == torch.channels_last:
        # channels innermost: one reduction over (N, H, W) of the grouped view
        # reads the memory in order and keeps the (model, channel) pairs apart.
        B, C = grad_out.shape[0], grad_out.shape[2]
        return to_grouped(grad_out).sum(dim=(0, 2, 3), dtype=acc).view(B, C).to(grad_out.dtype)
    n_first = per_model_memory_first(grad_out)
    # Both sums accumulate in float32 at least: a low-precision intermediate
    # would round every per-sample sum, and those round-offs survive the
    # cancellation of the second sum (a conv followed by batch norm has a bias
    # gradient near zero made of per-sample terms that are not).
    per_sample = (grad_out.transpose(0, 1) if n_first else grad_out).sum(
        dim=list(range(3, grad_out.dim())), dtype=acc)
    return per_sample.sum(dim=0 if n_first else 1).to(grad_out.dtype)


array_conv.register_autograd(_backward, setup_context=_setup_context)


# The gradient ops' own gradients are written out rather than derived by
# differentiating the reference math: both ops are bilinear, so each of their
# adjoints is one of the three conv ops. With y = conv(x, w),
# dx = input_grad(dy, w) and dw = weight_grad(dy, x), and for any ddx, ddw:
#   <ddx, input_grad(dy, w)> = <conv(ddx, w), dy> = <weight_grad(dy, ddx), w>
#   <ddw, weight_grad(dy, x)> = <conv(x, ddw), dy> = <input_grad(dy, ddw), x>
# (the same identities hold for a transposed conv and for a shared input, whose
# input gradient sums over the models). The adjoints run on the same backend
# at the same cost as a forward or backward, and they are ops with autograd
# formulas themselves, so every order of derivative is exact.

def _input_grad_setup_context(ctx, inputs, output):
    grad_out, weight, input_size, *conv_args = inputs
    ctx.save_for_backward(grad_out, weight)
    ctx.conv_args = tuple(conv_args)
    ctx.backend = _backend.current(_DGRAD, grad_out.device)


def _input_grad_backward(ctx, grad_grad_x):
    grad_out, weight = ctx.saved_tensors
    d_grad_out = d_weight = None
    with _backend.pinned(ctx.backend):
        if ctx.needs_input_grad[0]:
            d_grad_out = array_conv(grad_grad_x, weight, None, *ctx.conv_args)
        if ctx.needs_input_grad[1]:
            d_weight = array_conv_weight_grad(grad_out, grad_grad_x, weight, *ctx.conv_args)
    return d_grad_out, d_weight, None, None, None, None, None, None, None


array_conv_input_grad.register_autograd(_input_grad_backward, setup_context=_input_grad_setup_context)


def _weight_grad_setup_context(ctx, inputs, output):
    grad_out, x, weight, *conv_args = inputs
    ctx.save_for_backward(grad_out, x)
    ctx.input_size = list(x.shape)
    ctx.conv_args = tuple(conv_args)
    ctx.backend = _backend.current(_WGRAD, grad_out.device)


def _weight_grad_backward(ctx, grad_grad_w):
    grad_out, x = ctx.saved_tensors
    d_grad_out = d_x = None
    with _backend.pinned(ctx.backend):
        if ctx.needs_input_grad[0]:
            d_grad_out = array_conv(x, grad_grad_w, None, *ctx.conv_args)
        if ctx.needs_input_grad[1]:
            d_x = array_conv_input_grad(grad_out, grad_grad_w, ctx.input_size, *ctx.conv_args)
    # weight is read for its shape only: no gradient.
    return d_grad_out, d_x, None, None, None, None, None, None, None


array_conv_weight_grad.register_autograd(_weight_grad_backward, setup_context=_weight_grad_setup_context)

# Under torch.autocast a convolution runs in the region's dtype on every device, as torch's does.
_autocast.register("hfkern::array_conv", "lower")
