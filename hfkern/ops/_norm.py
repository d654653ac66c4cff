"""What the norm op families share (hfkern.ops.batch_norm, hfkern.ops.layer_norm).

The fused activations of the torch path, the argument checks and fakes of the
backward ops' ``output_mask``, and the autograd plumbing both families' forward
formulas and double-backward formulas run: each family supplies its own math
and its own shapes, the rest is written here once.
"""

from __future__ import annotations

from typing import Callable, Mapping, Sequence

import torch
from torch import Tensor

from .._norm_layout import NORM_ACTIVATIONS, backward_outputs

__all__ = [
    "NORM_ACTIVATIONS", "check_activation", "activate_", "activation_grad", "check_mask",
    "backward_outputs", "save_forward", "grad_mask", "input_grads", "backward_of_backward",
]


# ---- fused activations --------------------------------------------------------
#
# A norm's output z can go through an activation in the same op: y = act(z).
# The backward multiplies grad_y by act'(z), with z recomputed from x and the
# statistics where x is read anyway, so nothing extra is saved.

_SQRT1_2 = 0.7071067811865476  # 1 / sqrt(2)
_INV_SQRT_2PI = 0.3989422804014327  # 1 / sqrt(2 * pi)


def check_activation(where: str, activation: object) -> str:
    """``activation`` if it is one of :data:`NORM_ACTIVATIONS`, else ValueError naming
    ``where`` (``"hfkern::array_layer_norm"``, a module's name)."""
    if not isinstance(activation, str) or activation not in NORM_ACTIVATIONS:
        raise ValueError(
            f"{where}: expected activation to be one of {', '.join(map(repr, NORM_ACTIVATIONS))}, "
            f"got {activation!r}"
        )
    return activation


def activate_(y: Tensor, activation: str) -> Tensor:
    """``y <- act(y)`` in place (what ``nn.ReLU(inplace=True)`` and ``nn.GELU()`` compute on
    the rounded norm output, so the fused op rounds exactly as the separate ops)."""
    if activation == "relu":
        return y.relu_()
    if activation == "gelu":
        return torch.ops.aten.gelu_(y)
    return y


def activation_grad(grad_y: Tensor, z: Tensor, activation: str, out: Tensor | None = None) -> Tensor:
    """``grad_y * act'(z)`` (``z`` the norm output before the activation), written into
    ``out`` when given (the layout a kernel wants), else differentiable.

    ReLU: torch's rule, the gradient where ``z > 0`` and 0 elsewhere (also at 0). GELU: the
    derivative of the exact form, ``Phi(z) + z * phi(z)``, as torch's gelu_backward computes it.
    """
    if activation == "relu":
        return torch.where(z > 0, grad_y, grad_y.new_zeros(()), out=out)
    if activation == "gelu":
        cdf = 0.5 * (1 + torch.erf(z * _SQRT1_2))
        pdf = torch.exp(-0.5 * z * z) * _INV_SQRT_2PI
        return torch.mul(grad_y, cdf + z * pdf, out=out)
    return grad_y if out is None else out.copy_(grad_y)


# ---- backward ops: output_mask (their fakes: backward_outputs) -------------------

def check_mask(op: str, output_mask: Sequence[bool], n: int, weight: Tensor | None) -> None:
    """An ``output_mask`` of ``n`` entries whose grad_weight entry has a weight to differentiate."""
    if len(output_mask) != n:
        raise ValueError(f"hfkern::{op}: expected output_mask of length {n}, got {list(output_mask)}")
    if output_mask[1] and weight is None:
        raise ValueError(f"hfkern::{op}: output_mask asks for grad_weight but weight is None")


# ---- autograd of the forward ops ------------------------------------------------

def save_forward(ctx, x: Tensor, weight: Tensor | None, bias: Tensor | None, mean: Tensor, rstd: Tensor,
                 activation: str) -> None:
    """What a norm's backward needs of its forward (x, weight, mean, rstd; the bias only
    where the backward recomputes z for the activation's derivative)."""
    ctx.save_for_backward(x, weight, mean, rstd, bias if activation != "none" else None)
    ctx.activation = activation
    ctx.bias_dtype = None if bias is None else bias.dtype
    ctx.mark_non_differentiable(mean, rstd)


def grad_mask(ctx, weight: Tensor | None) -> list[bool]:
    """The backward op's output_mask: the gradients autograd wants of (x, weight, bias)."""
    needs = ctx.needs_input_grad
    return [needs[0], weight is not None and needs[1], ctx.bias_dtype is not None and needs[2]]


def input_grads(ctx, mask: Sequence[bool], grad_x: Tensor, grad_w: Tensor, grad_b: Tensor) -> tuple:
    """(grad_x, grad_weight, grad_bias) for autograd: None where not wanted, grad_bias in the
    bias's own dtype (the backward op gives weight's)."""
    return (
        grad_x if mask[0] else None,
        grad_w if mask[1] else None,
        grad_b.to(ctx.bias_dtype) if mask[2] else None,
    )


# ---- double backward ------------------------------------------------------------

def backward_of_backward(
    needs: Sequence[bool],
    inputs: Mapping[int, Tensor | None],
    output_mask: Sequence[bool],
    grad_outputs: Sequence[Tensor | None],
    math: Callable[[dict], Sequence[Tensor | None]],
) -> tuple:
    """The gradients of a backward op's differentiable ``inputs`` (argument position ->
    tensor): the vector-Jacobian product of ``math(args)`` (the backward's reference math
    of the arguments by position, None where the mask entry is False) with the gradients
    of its computed outputs. torch.func.vjp rather than torch.autograd.grad: grad_y and
    weight may themselves depend on x in the caller's graph, and vjp treats the op's
    inputs as independent while its result stays differentiable."""
    # needs_input_grad covers the arguments given: none past them (defaults) needs a gradient
    wanted = [i for i, t in inputs.items() if i < len(needs) and needs[i] and t is not None]
    result: list[Tensor | None] = [None] * len(needs)
    if not wanted:
        return tuple(result)
    primals = [inputs[i] for i in wanted]

    def of(*differentiated):
        args = dict(inputs)
        args.update(zip(wanted, differentiated))
        return tuple(o for o in math(args) if o is not None)

    if any(output_mask):
        _, vjp = torch.func.vjp(of, *primals)
        grads = vjp(tuple(g for g, m in zip(grad_outputs, output_mask) if m))
    else:  # nothing was computed: zero gradients (what AOTAutograd derives, too)
        grads = [torch.zeros_like(t) for t in primals]
    for i, g in zip(wanted, grads):
        result[i] = g
    return tuple(result)
