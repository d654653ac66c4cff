"""Array convolutions: Conv1d, Conv2d, ConvTranspose1d, ConvTranspose2d.

Input ``[B, N, C_in, *s]`` (or ``[B, C_in, *s]`` for unbatched models), output
``[B, N, C_out, *s']`` stored as ``[N, B, C_out, *s']`` memory, which the next
conv, norm or pooling layer reads without a copy. A shared input
(:func:`hfkern.broadcast`) runs one dense convolution over the B weights.

Memory format (2-D convs). ``model.to(memory_format=torch.channels_last)`` on
an array model (or :func:`hfkern.nn.set_memory_format`) keeps its images as
``[N, H, W, B, C]`` memory instead, the channels-last memory of the grouped
view ``[N, B*C, H, W]`` that cuDNN's grouped convolutions read and write
without layout conversions; each conv then converts an input in the other
format once, and stores its weight so that the grouped weight is
channels-last too. Every layer between two convs (norms, activations,
pooling, residual adds) keeps the memory it is given. Results are the same up
to the rounding of the algorithms cuDNN picks. Left at ``None`` (auto), a conv
converts only where a committed whole-step measurement shows the format
faster on the device (:mod:`hfkern._evidence`), and otherwise keeps its
input's memory.
"""

from __future__ import annotations

from typing import Sequence

import torch
import torch.nn.functional as F
from torch import nn

from .. import _evidence
from .._array import (
    array_memory_format, check_channels, check_input, conv_output_size, from_grouped,
    is_shared, shares_work, to_array_memory_format, to_grouped,
)
from ..ops.conv import GroupedConvCall, conv, grouped_conv
from ._base import ArrayModule, raise_model_error, reset_kaiming_uniform

__all__ = ["Conv1d", "Conv2d", "ConvTranspose1d", "ConvTranspose2d"]


class _ArrayConvNd(ArrayModule):
    _n: int  # spatial dims
    _transposed = False
    # The memory format of the images of a 2-D conv (None: auto); see the module docstring.
    memory_format: torch.memory_format | None = None
    _config_fields = (
        "in_channels", "out_channels", "kernel_size", "stride", "padding",
        "dilation", "groups", "bias", "padding_mode",
    )

    def _build(self, template: nn.Module, B: int, factory: dict) -> None:
        # The namesake, built on the meta device, validates and normalizes the
        # arguments exactly as torch does (int -> tuple, 'same' -> padding pairs).
        self._set_B(B, required=True)
        for field in self._config_fields + ("transposed", "output_padding", "_reversed_padding_repeated_twice"):
            if field != "bias":
                setattr(self, field, getattr(template, field))
        self.weight = nn.Parameter(torch.empty((self.B, *template.weight.shape), **factory))
        if template.bias is not None:
            self.bias = nn.Parameter(torch.empty((self.B, self.out_channels), **factory))
        else:
            self.register_parameter("bias", None)
        self.reset_parameters()

    def reset_parameters(self) -> None:
        reset_kaiming_uniform(self.weight, self.bias)

    def _check(self, input: torch.Tensor) -> tuple[torch.Tensor, bool]:
        name = type(self).__name__
        n = self._n
        x = check_input(name, input, self.B, (n + 1, n + 2), self.weight)
        unbatched = x.dim() == n + 2
        if unbatched:
            # checked before the N=1 dim is added: the message names the shape the user passed
            if x.size(1) != self.in_channels:
                raise ValueError(
                    f"{name}: expected input with {self.in_channels} channels at dim 1 (shape "
                    f"[B, C, ...] for unbatched models), got {x.size(1)} in shape {list(x.shape)}"
                )
            return x.unsqueeze(1), True
        check_channels(name, x, 2, self.in_channels)
        return x, False

    def _model_forward(self, input: torch.Tensor, output_padding: Sequence[int] | None = None) -> torch.Tensor:
        """The namesake's forward for model 0 on its input ``input[0]`` (``input`` as given):
        what torch computes, or raises, for one model (see :func:`raise_model_error`)."""
        n = self._n
        x, weight = input[0], self.weight[0]
        bias = None if self.bias is None else self.bias[0]
        if self._transposed:
            return getattr(F, f"conv_transpose{n}d")(
                x, weight, bias, self.stride, self.padding, output_padding, self.groups, self.dilation)
        padding = self.padding
        if self.padding_mode != "zeros":
            x = F.pad(x, self._reversed_padding_repeated_twice, mode=self.padding_mode)
            padding = (0,) * n
        return getattr(F, f"conv{n}d")(x, weight, bias, self.stride, padding, self.dilation, self.groups)

    def __getstate__(self) -> dict:
        # torch.memory_format objects do not pickle (torch.save's protocol 2): kept by name.
        state = dict(super().__getstate__())
        if isinstance(state.get("memory_format"), torch.memory_format):
            state["memory_format"] = str(state["memory_format"]).removeprefix("torch.")
        return state

    def __setstate__(self, state: dict) -> None:
        if isinstance(state.get("memory_format"), str):
            state = {**state, "memory_format": getattr(torch, state["memory_format"])}
        super().__setstate__(state)

    def _set_memory_format(self, memory_format: torch.memory_format | None) -> None:
        """Keep this conv's images (and its weight) in ``memory_format`` (None: auto).

        The weight ``[B, A, C/g, kh, kw]`` is stored so that its grouped view
        ``[B*A, C/g, kh, kw]`` is in the same format (a channels-last weight
        spares cuDNN a conversion per call); it stays the same Parameter, so an
        optimizer holding it goes on working, but optimizer state created
        before the change keeps the old strides: change formats before
        building the optimizer, as with ``Module.to``. 1-D convs have no
        channels-last form and ignore it, as torch's ``Module.to`` leaves 3-D
        weights alone.
        """
        if self._n != 2:
            return
        self.memory_format = memory_format
        w = self.weight
        flat = w.detach().reshape(w.shape[0] * w.shape[1], *w.shape[2:])
        target = torch.contiguous_format if memory_format is None else memory_format
        if not flat.is_contiguous(memory_format=target):
            relaid = flat.contiguous(memory_format=target)
            w.data = relaid.view(w.shape)  # splitting the leading dim is a view in either format

    def _input_memory_format(self, x: torch.Tensor) -> torch.memory_format | None:
        """The memory format the input is converted to, or None to keep the input's."""
        if self._n != 2:
            return None
        if self.memory_format is not None:
            return self.memory_format
        dtype = torch.get_autocast_dtype(x.device.type) if torch.is_autocast_enabled(x.device.type) else x.dtype
        return _evidence.auto_memory_format(x.device, dtype)

    def _in_memory_format(self, x: torch.Tensor) -> torch.Tensor:
        """x ([B, N, C, *s], possibly shared) in the memory format this conv converts to."""
        memory_format = self._input_memory_format(x)
        return x if memory_format is None else to_array_memory_format(x, memory_format)

    def _conv(self, x: torch.Tensor, padding, output_padding) -> torch.Tensor:
        """x: [B, N, C, *s] (possibly shared) already padded for non-zero modes."""
        x = self._in_memory_format(x)
        if shares_work(x):
            x = x[0]
        return conv(
            x, self.weight, self.bias, list(self.stride), list(padding),
            list(self.dilation), self._transposed, list(output_padding), self.groups,
        )

    def _direct_padding(self) -> tuple[int, ...] | None:
        """The padding the convolution applies itself (zeros, the same on both sides of
        every dim), or None where ``F.pad`` pads first."""
        padding = self.padding  # what torch's convolution reads, a value set later too
        if isinstance(padding, int):
            padding = (padding,) * self._n
        if self._transposed:
            return tuple(padding) if self.padding_mode == "zeros" else None
        if self.padding_mode == "zeros" and not isinstance(padding, str):
            return tuple(padding)
        pad = self._reversed_padding_repeated_twice  # F.pad order: last dim first
        left, right = pad[0::2][::-1], pad[1::2][::-1]
        return tuple(left) if self.padding_mode == "zeros" and left == right else None

    def _grouped_output(self, input: torch.Tensor, *, checked: bool = False
                        ) -> tuple[torch.Tensor, torch.memory_format] | None:
        """``forward(input)`` as ``(y, fmt)`` with ``y`` the grouped result ``[N, B*C_out, *s']``
        (see :func:`hfkern.ops.conv.grouped_conv`), where the eager torch path computes it
        so: a batched per-model input and padding the convolution applies itself; else None.
        Raises what ``forward`` raises for a bad input. ``checked``: a call of the same
        metadata took this path before (``grouped_conv``'s ``checked``): no checks."""
        padding = self._direct_padding()
        if checked:
            x = input
        else:
            x, unbatched = self._check(input)
            if unbatched or padding is None:
                return None
        output_padding = list(self.output_padding) if self._transposed else [0] * self._n
        try:
            x = self._in_memory_format(x)
            if not checked and is_shared(x):
                return None
            return grouped_conv(x, self.weight, self.bias, list(self.stride), list(padding),
                                list(self.dilation), self._transposed, output_padding, self.groups,
                                checked=checked)
        except RuntimeError as ex:  # torch's error names the grouped [N, B*C_in, *s]: one model's
            raise_model_error(type(self).__name__, input, lambda: self._model_forward(input, output_padding), ex)

    def _grouped_call(self, input: torch.Tensor) -> GroupedConvCall | None:
        """What ``_grouped_output(x, checked=True)`` runs for inputs of ``input``'s metadata,
        its decisions made once (:class:`hfkern.ops.conv.GroupedConvCall`), for an input
        that ``_grouped_output`` served; None where a call does more than the grouped
        convolution (converts the input's memory format, or takes the 1x1 matmul path)."""
        if self._in_memory_format(input) is not input:
            return None
        return GroupedConvCall.make(
            input, self.weight, self.bias, self.stride, self._direct_padding(), self.dilation, self._transposed,
            self.output_padding if self._transposed else (0,) * self._n, self.groups)


class _ArrayConv(_ArrayConvNd):
    def __init__(
        self, in_channels, out_channels, kernel_size, stride=1, padding=0, dilation=1,
        groups=1, bias=True, padding_mode="zeros", *, B, device=None, dtype=None,
    ):
        super().__init__()
        template = self._torch_cls(
            in_channels, out_channels, kernel_size, stride, padding, dilation, groups,
            bias, padding_mode, device="meta",
        )
        self._build(template, B, {"device": device, "dtype": dtype})

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        x, unbatched = self._check(input)
        try:
            y = self._forward(x)
        except RuntimeError as ex:  # torch's error names the grouped [N, B*C_in, *s]: one model's
            raise_model_error(type(self).__name__, input, lambda: self._model_forward(input), ex)
        return y.squeeze(1) if unbatched else y

    def _forward(self, x: torch.Tensor) -> torch.Tensor:
        """``forward`` of a checked ``[B, N, C_in, *s]`` input."""
        conv_padding = self._direct_padding()
        if conv_padding is None:
            pad = self._reversed_padding_repeated_twice  # F.pad order: last dim first
            left = pad[0::2][::-1]
            # Non-zero padding modes and the asymmetric part of padding='same'
            # are applied by F.pad first, as torch does.
            mode = "constant" if self.padding_mode == "zeros" else self.padding_mode
            if self.padding_mode == "zeros":  # pad only the excess on the right
                pad = [0 if i % 2 == 0 else pad[i] - pad[i - 1] for i in range(len(pad))]
                conv_padding = left
            else:
                conv_padding = [0] * self._n
            if shares_work(x):
                x = F.pad(x[0], pad, mode=mode).expand(x.shape[0], -1, -1, *([-1] * self._n))
            else:
                x = from_grouped(F.pad(to_grouped(x), pad, mode=mode), x.shape[0], array_memory_format(x))
        return self._conv(x, conv_padding, [0] * self._n)


class Conv1d(_ArrayConv):
    """B ``torch.nn.Conv1d`` models: input ``[B, N, C_in, L]`` or ``[B, C_in, L]``."""

    _torch_cls = nn.Conv1d
    _n = 1


class Conv2d(_ArrayConv):
    """B ``torch.nn.Conv2d`` models: input ``[B, N, C_in, H, W]`` or ``[B, C_in, H, W]``."""

    _torch_cls = nn.Conv2d
    _n = 2


class _ArrayConvTranspose(_ArrayConvNd):
    _transposed = True
    _config_fields = _ArrayConvNd._config_fields + ("output_padding",)

    def __init__(
        self, in_channels, out_channels, kernel_size, stride=1, padding=0, output_padding=0,
        groups=1, bias=True, dilation=1, padding_mode="zeros", *, B, device=None, dtype=None,
    ):
        super().__init__()
        template = self._torch_cls(
            in_channels, out_channels, kernel_size, stride, padding, output_padding, groups,
            bias, dilation, padding_mode, device="meta",
        )
        self._build(template, B, {"device": device, "dtype": dtype})

    def forward(self, input: torch.Tensor, output_size: list[int] | None = None) -> torch.Tensor:
        """Input ``[B, N, C_in, *s]`` or ``[B, C_in, *s]`` -> ``[B, N, C_out, *s']`` or ``[B, C_out, *s']``.

        ``output_size`` picks ``s'`` among the sizes the stride allows, as in
        torch: the spatial sizes ``s'``, one model's output shape
        (``[N, C_out, *s']``, or ``[C_out, *s']`` for unbatched models), or the
        whole array output shape (``[B, N, C_out, *s']`` or ``[B, C_out, *s']``),
        whose first entry must be B.
        """
        name = type(self).__name__
        if self.padding_mode != "zeros":
            raise ValueError(f"Only `zeros` padding mode is supported for {name}")
        x, unbatched = self._check(input)
        output_padding = self.output_padding
        if output_size is not None:
            size = self._spatial_output_size(output_size, x.shape[0], unbatched)
            output_padding = self._output_padding(size, x.shape[-self._n:])

        def model_forward():
            return self._model_forward(input, output_padding)

        if unbatched and min(conv_output_size(x.shape[-self._n:], self.kernel_size, self.stride,
                                              self._direct_padding(), self.dilation, True, output_padding)) < 1:
            # An output size below 1: torch refuses one model's unbatched input ("Output size is
            # too small") where the array's grouped call (a batch of one) may return an empty
            # tensor; do as torch does for one model. (Batched inputs are left to the kernels:
            # torch itself returns an empty tensor or raises there by dtype and batch size.)
            raise_model_error(name, input, model_forward)
        try:
            y = self._conv(x, self._direct_padding(), output_padding)
        except RuntimeError as ex:  # torch's error names the grouped [N, B*C_in, *s]: one model's
            raise_model_error(name, input, model_forward, ex)
        return y.squeeze(1) if unbatched else y

    def _output_padding(self, size: Sequence[int], input_size: Sequence[int]) -> list[int]:
        """The output_padding that gives spatial output sizes ``size`` (torch's rule:
        each within ``stride - 1`` above the smallest size), or ValueError."""
        n = self._n
        smallest = conv_output_size(input_size, self.kernel_size, self.stride, self._direct_padding(),
                                    self.dilation, True, [0] * n)
        largest = [lo + s - 1 for lo, s in zip(smallest, self.stride)]
        if not all(lo <= o <= hi for o, lo, hi in zip(size, smallest, largest)):
            raise ValueError(
                f"{type(self).__name__}: requested an output size of {list(size)}, but valid sizes "
                f"range from {smallest} to {largest} (for an input of spatial size {list(input_size)})"
            )
        return [o - lo for o, lo in zip(size, smallest)]

    def _spatial_output_size(self, output_size, B: int, unbatched: bool) -> list[int]:
        """The spatial sizes of ``output_size`` in any of its forms (an array form's B checked)."""
        name = type(self).__name__
        if not isinstance(output_size, (list, tuple)):  # torch.Size is a tuple
            raise TypeError(
                f"{name}: expected output_size to be a list or tuple of ints, got "
                f"{type(output_size).__name__}"
            )
        n = self._n
        array_len = n + (2 if unbatched else 3)
        if len(output_size) not in (n, array_len - 1, array_len):
            forms = (f"[*spatial] ({n}), [C_out, *spatial] ({n + 1}) or [B, C_out, *spatial] ({n + 2})"
                     if unbatched else
                     f"[*spatial] ({n}), [N, C_out, *spatial] ({n + 2}) or [B, N, C_out, *spatial] ({n + 3})")
            in_shape = "[B, C_in, *spatial]" if unbatched else "[B, N, C_in, *spatial]"
            raise ValueError(
                f"{name}: for input of shape {in_shape}, expected output_size of the form {forms} "
                f"entries, got {len(output_size)} entries {list(output_size)}"
            )
        if len(output_size) == array_len and output_size[0] != B:
            shape = "[B, C_out, *spatial]" if unbatched else "[B, N, C_out, *spatial]"
            raise ValueError(
                f"{name}: an output_size of {array_len} entries is the array output shape {shape}, "
                f"whose first entry must be B={B}; got {list(output_size)}"
            )
        return list(output_size[-n:])


class ConvTranspose1d(_ArrayConvTranspose):
    """B ``torch.nn.ConvTranspose1d`` models: input ``[B, N, C_in, L]`` or ``[B, C_in, L]``."""

    _torch_cls = nn.ConvTranspose1d
    _n = 1


class ConvTranspose2d(_ArrayConvTranspose):
    """B ``torch.nn.ConvTranspose2d`` models: input ``[B, N, C_in, H, W]`` or ``[B, C_in, H, W]``."""

    _torch_cls = nn.ConvTranspose2d
    _n = 2
