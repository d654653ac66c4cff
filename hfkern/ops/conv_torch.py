"""Array convolution on the pure-PyTorch path: cuDNN / oneDNN grouped convolution.

The B models' convolutions become one convolution with ``groups = B * groups``
over ``[N, B*C, *spatial]`` tensors, which is exactly the physical layout the
array conv keeps its activations in, so neither the input nor the output is
copied. A shared input (``hfkern.broadcast``) instead runs one dense convolution
with the B weights concatenated on the output channels.

Shapes (``k`` = spatial dims, ``g`` = groups within one model)::

    x       [B, N, C_in, *s]   per-model input, or [N, C_in, *s] shared
    weight  [B, C_out, C_in/g, *k]        (transposed: [B, C_in, C_out/g, *k])
    bias    [B, C_out]
    out     [B, N, C_out, *s']  view of [N, B, C_out, *s'] memory
"""

from __future__ import annotations

from typing import Sequence

import torch

aten = torch.ops.aten


def out_channels(weight: torch.Tensor, transposed: bool, groups: int) -> int:
    return weight.shape[2] * groups if transposed else weight.shape[1]


def to_grouped(x: torch.Tensor) -> torch.Tensor:
    """[B, N, C, *s] -> [N, B*C, *s]; free when x has [N, B, ...] memory."""
    B, N = x.shape[:2]
    return x.transpose(0, 1).reshape(N, B * x.shape[2], *x.shape[3:])


def from_grouped(y: torch.Tensor, B: int) -> torch.Tensor:
    """[N, B*C, *s] -> [B, N, C, *s] view keeping [N, B, ...] memory."""
    y = y.contiguous()
    N = y.shape[0]
    return y.view(N, B, y.shape[1] // B, *y.shape[2:]).transpose(0, 1)


def _flat_weight(weight: torch.Tensor) -> torch.Tensor:
    """[B, A, b, *k] -> [B*A, b, *k]: the per-model weights of the grouped conv."""
    return weight.reshape(weight.shape[0] * weight.shape[1], *weight.shape[2:])


def _dense_weight(weight: torch.Tensor, transposed: bool, groups: int) -> torch.Tensor:
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


def _channels_gbo_to_bgo(y: torch.Tensor, B: int, groups: int) -> torch.Tensor:
    """[N, (g, B, c), *s] channel order -> [N, (B, g, c), *s] (a copy only if groups > 1)."""
    if groups == 1:
        return y
    N, C = y.shape[:2]
    return y.reshape(N, groups, B, C // (groups * B), *y.shape[2:]).transpose(1, 2).reshape(y.shape)


def _channels_bgo_to_gbo(y: torch.Tensor, B: int, groups: int) -> torch.Tensor:
    if groups == 1:
        return y
    N, C = y.shape[:2]
    return y.reshape(N, B, groups, C // (groups * B), *y.shape[2:]).transpose(1, 2).reshape(y.shape)


def array_conv(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    stride: Sequence[int],
    padding: Sequence[int],
    dilation: Sequence[int],
    transposed: bool,
    output_padding: Sequence[int],
    groups: int,
) -> torch.Tensor:
    B = weight.shape[0]
    if x.dim() == weight.dim():  # per-model input
        y = aten.convolution(
            to_grouped(x),
            _flat_weight(weight),
            None if bias is None else bias.reshape(-1),
            stride, padding, dilation, transposed, output_padding, B * groups,
        )
        return from_grouped(y, B)
    # shared input [N, C_in, *s]: one dense conv
    dense_bias = None
    if bias is not None:
        dense_bias = bias.reshape(B, groups, -1).transpose(0, 1).reshape(-1)
    y = aten.convolution(
        x, _dense_weight(weight, transposed, groups), dense_bias,
        stride, padding, dilation, transposed, output_padding, groups,
    )
    return from_grouped(_channels_gbo_to_bgo(y, B, groups), B)


def _input_grad_output_padding(
    input_size: Sequence[int], grad_size: Sequence[int], weight: torch.Tensor,
    stride: Sequence[int], padding: Sequence[int], dilation: Sequence[int],
) -> list[int]:
    """output_padding that makes the transposed conv of grad_out land on input_size."""
    k = weight.shape[-len(stride):]
    return [
        i - ((o - 1) * s - 2 * p + d * (kk - 1) + 1)
        for i, o, s, p, d, kk in zip(input_size, grad_size, stride, padding, dilation, k)
    ]


def array_conv_input_grad(
    grad_out: torch.Tensor,
    weight: torch.Tensor,
    input_size: Sequence[int],
    stride: Sequence[int],
    padding: Sequence[int],
    dilation: Sequence[int],
    transposed: bool,
    output_padding: Sequence[int],
    groups: int,
) -> torch.Tensor:
    """d(loss)/dx: the adjoint convolution of grad_out (a transposed conv for a conv)."""
    B = weight.shape[0]
    shared = len(input_size) == weight.dim() - 1
    if shared:  # the sum over the B models falls out of the dense conv
        gy = _channels_bgo_to_gbo(to_grouped(grad_out), B, groups)
        w, g = _dense_weight(weight, transposed, groups), groups
    else:
        gy = to_grouped(grad_out)
        w, g = _flat_weight(weight), B * groups
    spatial = list(input_size[-len(stride):])
    adjoint_padding = (
        [0] * len(stride) if transposed
        else _input_grad_output_padding(spatial, gy.shape[2:], weight, stride, padding, dilation)
    )
    gx = aten.convolution(
        gy, w, None, stride, padding, dilation, not transposed, adjoint_padding, g
    )
    return gx if shared else from_grouped(gx, B)


def array_conv_weight_grad(
    grad_out: torch.Tensor,
    x: torch.Tensor,
    weight: torch.Tensor,
    stride: Sequence[int],
    padding: Sequence[int],
    dilation: Sequence[int],
    transposed: bool,
    output_padding: Sequence[int],
    groups: int,
) -> torch.Tensor:
    """d(loss)/dweight (``weight`` is read for its shape only)."""
    B = weight.shape[0]
    if x.dim() == weight.dim():
        gw = aten.convolution_backward(
            to_grouped(grad_out), to_grouped(x), _flat_weight(weight), None,
            stride, padding, dilation, transposed, output_padding, B * groups,
            [False, True, False],
        )[1]
        return gw.reshape(weight.shape)
    gw = aten.convolution_backward(
        _channels_bgo_to_gbo(to_grouped(grad_out), B, groups), x,
        _dense_weight(weight, transposed, groups), None,
        stride, padding, dilation, transposed, output_padding, groups,
        [False, True, False],
    )[1]
    if transposed:  # [C_in, B*C_out/g, *k] -> [B, C_in, C_out/g, *k]
        return gw.reshape(gw.shape[0], B, -1, *gw.shape[2:]).transpose(0, 1).contiguous()
    # [(g, B, c), C_in/g, *k] -> [B, (g, c), C_in/g, *k]
    return gw.reshape(groups, B, -1, *gw.shape[1:]).transpose(0, 1).reshape(weight.shape)
