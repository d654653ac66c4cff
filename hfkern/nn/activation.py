"""Array activations with parameters: PReLU.

Parameter-free activations (ReLU, GELU, ...) need no array version: the plain
``torch.nn`` modules work element-wise on array tensors.
"""

from __future__ import annotations

import functools
from typing import Sequence

import torch
from torch import nn
from torch.nn import init

from .._array import MAX_NDIM, check_channels, check_input
from ..ops import _autocast
from ._base import ArrayModule, stack_init


@functools.lru_cache(maxsize=None)
def _prelu_autocasts(device_type: str) -> bool:
    """Whether torch's autocast casts ``aten::prelu`` on ``device_type`` (this build's rule)."""
    key = "Autocast" + torch._C._dispatch_key_for_device(device_type)
    return torch._C._dispatch_has_kernel_for_dispatch_key("aten::prelu", key)

__all__ = ["PReLU"]


class PReLU(ArrayModule):
    """B ``torch.nn.PReLU`` models: input ``[B, *s]``, output ``[B, *s]``.

    ``weight`` is ``[B, num_parameters]``, model b's slopes in row b. As in
    torch, one model's input ``s`` has its channel dim at dim 1 (array dim 2):
    with ``num_parameters > 1`` it must have at least 2 dims and
    ``s[1] == num_parameters``; with ``num_parameters == 1`` the slope applies
    to every element of any input (0-d per-model inputs included). The output
    has the input's memory order; a shared input gives a ``[B, *s]`` tensor.

    ``init`` (the slopes :meth:`reset_parameters` sets) is one value for every
    model or a length-B sequence, model b's at b (kept as a tuple). It only
    initializes the weight, so models whose ``init`` differs are one array:
    :meth:`from_modules` keeps one value where the modules agree and a tuple of
    their B values otherwise, :meth:`load_model` sets model b's, and
    :meth:`to_modules` gives model b its own.
    """

    _torch_cls = nn.PReLU
    _config_fields = ("num_parameters", "init")
    _per_model_fields = ("init",)

    def __init__(self, num_parameters: int = 1, init: float | Sequence[float] = 0.25, *, B: int,
                 device=None, dtype=None):
        super().__init__()
        nn.PReLU(num_parameters, device="meta")  # torch's argument checks
        self._set_B(B, required=True)
        if isinstance(init, (list, tuple)):
            if len(init) != self.B:
                raise ValueError(
                    f"PReLU: expected init to be one value or one per model (length B={self.B}), "
                    f"got {len(init)} values {list(init)}"
                )
            init = tuple(init)
        self.num_parameters, self.init = num_parameters, init
        self.weight = nn.Parameter(torch.empty((self.B, num_parameters), device=device, dtype=dtype))
        self.reset_parameters()

    def reset_parameters(self) -> None:
        values = iter(self.init if isinstance(self.init, tuple) else [self.init] * self.weight.size(0))
        stack_init([self.weight], lambda w: init.constant_(w, next(values)))

    def _graph_state(self) -> tuple:
        """The host values the forward computes with beyond its mode: none (``init``, a per-model
        field, only initializes the weight), so a captured step is not captured anew for it."""
        return ()

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        x = check_input("PReLU", input, self.B, range(0, MAX_NDIM), self.weight)
        B, P, r = self.weight.size(0), self.num_parameters, x.dim() - 1
        if P == 1:
            w = self.weight.view(B, *([1] * r))
        else:
            if r < 2:
                raise ValueError(
                    f"PReLU: num_parameters={P} needs one model's input to have a channel dim "
                    f"(dim 1, at least 2 dims: array input [B, N, C, ...]), got {r}-D per-model "
                    f"inputs (array input shape {list(x.shape)})"
                )
            check_channels("PReLU", x, 2, P)
            w = self.weight.view(B, 1, P, *([1] * (r - 2)))
        # torch.prelu reshapes its weight to broadcast over the input and calls
        # this kernel; a [B, ...] weight broadcasts the same way per model, and
        # autograd sums the weight gradient back to [B, P].
        # (the kernel has no autocast rule of its own: cast as torch.prelu's rule casts, to the
        # region's dtype where it has one, so that a bf16 conv's output meets a bf16 weight)
        device = x.device.type
        if torch.is_autocast_enabled(device) and _prelu_autocasts(device):
            x, w = _autocast._cast((x, w), device, torch.get_autocast_dtype(device))
        return torch._prelu_kernel(x, w)
