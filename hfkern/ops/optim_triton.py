"""Triton implementations of the array optimizer ops, one ``torch.library.triton_op`` each.

``hfkern::sgd_step_triton``, ``hfkern::adam_step_triton``,
``hfkern::adagrad_step_triton``, ``hfkern::adadelta_step_triton``,
``hfkern::rmsprop_step_triton`` and ``hfkern::nonfinite_models_triton`` take
exactly the arguments of the ops in :mod:`hfkern.ops.optim` (and mutate the same
ones) and call the multi-tensor launchers in :mod:`hfkern.triton.optim`. The
backend registry imports this module the first time the ``triton`` backend
serves an optimizer op.

The kernels reach every tensor but the first of each list through a device
table of offsets, which a traced graph cannot follow: these ops run eagerly,
called from the hfkern::*_step_ ops (opaque to torch.compile). Under
FakeTensorMode they only check their arguments; inside AOT tracing they raise.
"""

from __future__ import annotations

import torch
from torch import Tensor

from ..triton import optim as kernels


@torch.library.triton_op("hfkern::sgd_step_triton", mutates_args=("params", "momentum_buffers", "steps"))
def sgd_step_triton(
    params: list[Tensor],
    grads: list[Tensor],
    momentum_buffers: list[Tensor],
    steps: list[Tensor],
    hypers: Tensor,
    nesterov: bool,
    maximize: bool,
    has_weight_decay: bool,
    skip: Tensor | None,
) -> None:
    kernels.sgd_step_(params, grads, momentum_buffers, steps, hypers, nesterov, maximize,
                      has_weight_decay, skip)


@torch.library.triton_op(
    "hfkern::adam_step_triton",
    mutates_args=("params", "exp_avgs", "exp_avg_sqs", "max_exp_avg_sqs", "steps"),
)
def adam_step_triton(
    params: list[Tensor],
    grads: list[Tensor],
    exp_avgs: list[Tensor],
    exp_avg_sqs: list[Tensor],
    max_exp_avg_sqs: list[Tensor],
    steps: list[Tensor],
    hypers: Tensor,
    amsgrad: bool,
    maximize: bool,
    decoupled_weight_decay: bool,
    has_weight_decay: bool,
    skip: Tensor | None,
) -> None:
    kernels.adam_step_(params, grads, exp_avgs, exp_avg_sqs, max_exp_avg_sqs, steps, hypers,
                       amsgrad, maximize, decoupled_weight_decay, has_weight_decay, skip)


@torch.library.triton_op("hfkern::adagrad_step_triton", mutates_args=("params", "state_sums", "steps"))
def adagrad_step_triton(
    params: list[Tensor],
    grads: list[Tensor],
    state_sums: list[Tensor],
    steps: list[Tensor],
    hypers: Tensor,
    maximize: bool,
    has_weight_decay: bool,
    skip: Tensor | None,
) -> None:
    kernels.adagrad_step_(params, grads, state_sums, steps, hypers, maximize, has_weight_decay, skip)


@torch.library.triton_op(
    "hfkern::adadelta_step_triton", mutates_args=("params", "square_avgs", "acc_deltas", "steps")
)
def adadelta_step_triton(
    params: list[Tensor],
    grads: list[Tensor],
    square_avgs: list[Tensor],
    acc_deltas: list[Tensor],
    steps: list[Tensor],
    hypers: Tensor,
    maximize: bool,
    has_weight_decay: bool,
    skip: Tensor | None,
) -> None:
    kernels.adadelta_step_(params, grads, square_avgs, acc_deltas, steps, hypers, maximize,
                           has_weight_decay, skip)


@torch.library.triton_op(
    "hfkern::rmsprop_step_triton",
    mutates_args=("params", "square_avgs", "grad_avgs", "momentum_buffers", "steps"),
)
def rmsprop_step_triton(
    params: list[Tensor],
    grads: list[Tensor],
    square_avgs: list[Tensor],
    grad_avgs: list[Tensor],
    momentum_buffers: list[Tensor],
    steps: list[Tensor],
    hypers: Tensor,
    centered: bool,
    maximize: bool,
    has_weight_decay: bool,
    skip: Tensor | None,
) -> None:
    kernels.rmsprop_step_(params, grads, square_avgs, grad_avgs, momentum_buffers, steps, hypers,
                          centered, maximize, has_weight_decay, skip)


@torch.library.triton_op("hfkern::nonfinite_models_triton", mutates_args=())
def nonfinite_models_triton(grads: list[Tensor]) -> Tensor:
    return kernels.nonfinite_models(grads)
