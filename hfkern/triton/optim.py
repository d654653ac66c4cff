"""Multi-tensor optimizer steps: one launch updates every parameter of every model.

Each launcher implements the hfkern op of the same name (hfkern/ops/optim.py
documents the arguments and the math, and its torch implementation is the
oracle whose operation order the kernels follow). The ops are declared in
:mod:`hfkern._optim_specs` (``SGD_SPEC``, ...): the launchers take their arguments
in the declared order and the kernels read the hyperparameter rows by the
declared names.

One driver, one update function per optimizer
----------------------------------------------
``_step_kernel`` is the driver every optimizer shares (the functor pattern of
apex's ``multi_tensor_apply``): it finds its tile and model, addresses the
parameter, the gradient and up to three state lists, runs the loop over the
tile's blocks and loads and stores the parameter. An optimizer supplies two
small functions, selected by the ``OPT`` constexpr (the op's name):
``_<name>_scalars`` computes the per-model scalars once per program from the
hyperparameter rows and the step count, and ``_<name>_update`` is the
element-wise math on one block (including its state's loads and stores).

Tiles
-----
The launcher addresses every parameter of every model through two tables
(hfkern/_multi_tensor.py): a tile table, one int64 row per (tensor, model,
chunk) tile, which depends only on the tensors' shapes, dtypes and layouts and
is built once and cached, and a small per-tensor address table made at each
step (each tensor's element offset from the first tensor of its list, and
whether its tiles are 16-byte aligned), which reaches the device with one
non-blocking copy. New gradient tensors at every step (``zero_grad()``) change
only the address table. One program handles one tile: it reads model b's
hyperparameters ``hypers[:, b]`` and step count, computes in float32 (float64
for float64 parameters) and writes parameter and state in place. Aligned tiles
take a copy of the loop with divisibility hints, so loads and stores are
16-byte vectors; the rest (small tensors of odd size) take the scalar copy,
and a gradient laid out unlike its parameter (channels-last) is read where it
lies through its gather row (``GATHER``: compiled only for groups that have
one). A steady-state step costs the table lookup, one pass over the tensors'
addresses, the step-count launch and one launch per parameter dtype
(parameters are grouped by dtype, each group addressed from its own first
tensors).

Trust ratios (LARS, LAMB)
-------------------------
A layer-wise adaptive step scales each (tensor, model) update by a ratio of two
norms over that model's whole slice of the tensor. Such a step makes two passes
over the same tile table: ``_norms_kernel`` writes each tile's two partial sums
of squares (float32, float64 for float64 parameters; LAMB's pass also updates
the moments, from which its update direction is then recomputed), and the
update kernel's program sums the partials of its (tensor, model) pair in row
order (the table's ``COL_FIRST``, ``COL_TILES``) before it computes the ratio
with the model's hyperparameters: deterministic, no atomics. A parameter that
``exclude_1d`` excludes is launched apart, without the norm pass (``TRUST``
False: ratio 1, no weight decay).

Step counts
-----------
``steps[i][b]`` is incremented exactly once per (tensor, model) by
``_count_kernel``, launched before the update; the update kernel then reads the
incremented count (every program of a (tensor, model) reads the same value, and
nothing writes it during the update), as the torch path does. Where the op's
counts follow a row (SGD's momentum, ``OptimizerSpec.counted_by``), the count
kernel reads the model's value and counts only a non-zero one.

Skipped models
--------------
A tile of a skipped model runs its loop zero times and the count kernel masks
its store, so nothing of a skipped model is written: its slices stay
bit-identical whatever its gradients hold.

Autotuning
----------
An update kernel writes its inputs, so timing it on live tensors would apply the
step many times. The autotuner therefore only ever sees scratch tensors: the
first launch of a kernel variant times its block sizes on scratch tensors of
the live call's dtypes (``_tune_on_scratch``), and live launches call the plain
kernel with the config found.

Tracing
-------
The kernels address tensors that are not kernel arguments, which a traced graph
cannot see. Under FakeTensorMode (shape propagation) the launchers only check
their arguments; inside functionalization (AOT tracing, which would record the
kernel without its real inputs) they raise. The hfkern::*_step_ ops, which are
opaque to torch.compile, call them eagerly.
"""

from __future__ import annotations

import inspect
from typing import Any, Callable, Sequence

import torch
import triton
import triton.language as tl
from torch import Tensor

from .. import _backend, _multi_tensor as mt
from .._device import sm_count
from .._optim_specs import (
    ADADELTA_SPEC, ADAGRAD_SPEC, ADAM_SPEC, LAMB_SPEC, LARS_SPEC, OPTIMIZER_SPECS, RMSPROP_SPEC, SGD_SPEC,
    TRUST_RATIO_SPECS, OptimizerSpec, trust_subsets,
)
from ._common import Tuned, autotuning, interpreting

__all__ = [
    "sgd_step_", "adam_step_", "adagrad_step_", "adadelta_step_", "rmsprop_step_", "lars_step_",
    "lamb_step_", "nonfinite_models",
]

# Named constants that host code and kernels share are tl.constexpr objects (the
# only globals a kernel may read); host code takes their int().

# The columns of the tile, address and gather tables (hfkern/_multi_tensor.py) as kernel constants.
(_COL_TENSOR, _COL_MODEL, _COL_OFFSET, _COL_GRAD, _COL_START, _COL_LEN, _COL_STEP, _COL_GATHER, _COL_FIRST,
 _COL_TILES, _COLS) = (
    tl.constexpr(c) for c in (mt.COL_TENSOR, mt.COL_MODEL, mt.COL_OFFSET, mt.COL_GRAD, mt.COL_START, mt.COL_LEN,
                              mt.COL_STEP, mt.COL_GATHER, mt.COL_FIRST, mt.COL_TILES, mt.COLS)
)
_ADDR_P, _ADDR_G, _ADDR_S0, _ADDR_S1, _ADDR_S2, _ADDR_STEP, _ADDR_ALIGNED, _ADDR_COLS = (
    tl.constexpr(c) for c in (mt.ADDR_P, mt.ADDR_G, mt.ADDR_S0, mt.ADDR_S1, mt.ADDR_S2, mt.ADDR_STEP,
                              mt.ADDR_ALIGNED, mt.ADDR_COLS)
)
_N_STATES = mt.N_STATES
_NF_TENSOR, _NF_OFFSET, _NF_PART, _NF_LEN, _NF_COLS = (
    tl.constexpr(c) for c in (mt.NF_TENSOR, mt.NF_OFFSET, mt.NF_PART, mt.NF_LEN, mt.NF_COLS)
)
_NF_ADDR_G, _NF_ADDR_ALIGNED, _NF_ADDR_COLS = (
    tl.constexpr(c) for c in (mt.NF_ADDR_G, mt.NF_ADDR_ALIGNED, mt.NF_ADDR_COLS)
)
_MAX_GRAD_DIMS = tl.constexpr(mt.MAX_GRAD_DIMS)
_GATHER_COLS = tl.constexpr(mt.GATHER_COLS)
_ALIGN_BYTES = mt.ALIGN_BYTES
_LEN_ALIGN = tl.constexpr(mt.LEN_ALIGN)
_MAX_CACHED = mt.MAX_CACHED

if max(len(spec.states) for spec in OPTIMIZER_SPECS) > _N_STATES:
    raise RuntimeError(f"the optimizer kernels address at most {_N_STATES} state lists")


def _rows(spec: OptimizerSpec, *names: str) -> list[tl.constexpr]:
    """Kernel constants for the hyperparameter rows of ``spec``, by name. Every row
    must be named, so that a row added to the declaration cannot go unread."""
    if sorted(names) != sorted(spec.rows):
        raise RuntimeError(f"the {spec.name} kernel reads rows {names}; hfkern::{spec.op} has {spec.rows}")
    return [tl.constexpr(spec.row(name)) for name in names]


_SGD_LR, _SGD_MOMENTUM, _SGD_DAMPENING, _SGD_WD = _rows(SGD_SPEC, "lr", "momentum", "dampening", "weight_decay")
_ADAM_LR, _ADAM_BETA1, _ADAM_BETA2, _ADAM_EPS, _ADAM_WD = _rows(
    ADAM_SPEC, "lr", "beta1", "beta2", "eps", "weight_decay")
_ADAGRAD_LR, _ADAGRAD_LR_DECAY, _ADAGRAD_WD, _ADAGRAD_EPS = _rows(
    ADAGRAD_SPEC, "lr", "lr_decay", "weight_decay", "eps")
_ADADELTA_LR, _ADADELTA_RHO, _ADADELTA_EPS, _ADADELTA_WD = _rows(ADADELTA_SPEC, "lr", "rho", "eps", "weight_decay")
_RMSPROP_LR, _RMSPROP_ALPHA, _RMSPROP_EPS, _RMSPROP_WD, _RMSPROP_MOMENTUM = _rows(
    RMSPROP_SPEC, "lr", "alpha", "eps", "weight_decay", "momentum")
_LARS_LR, _LARS_MOMENTUM, _LARS_WD, _LARS_TRUST, _LARS_EPS = _rows(
    LARS_SPEC, "lr", "momentum", "weight_decay", "trust_coefficient", "eps")
_LAMB_LR, _LAMB_BETA1, _LAMB_BETA2, _LAMB_EPS, _LAMB_WD, _LAMB_NORM_MIN, _LAMB_NORM_MAX = _rows(
    LAMB_SPEC, "lr", "beta1", "beta2", "eps", "weight_decay", "norm_min", "norm_max")


# ---- shared device helpers -----------------------------------------------------

@triton.jit
def _div(a, b, F64: tl.constexpr):
    # IEEE division, as torch's: Triton's float32 `/` may be approximate.
    if F64:
        return a / b
    else:
        return tl.div_rn(a, b)


@triton.jit
def _sqrt(x, F64: tl.constexpr):
    if F64:
        return tl.sqrt(x)
    else:
        return tl.sqrt_rn(x)


@triton.jit
def _math(x, F64: tl.constexpr):
    """``x`` in the math dtype: float64 for float64 parameters, else float32."""
    if F64:
        return x.to(tl.float64)
    else:
        return x.to(tl.float32)


@triton.jit
def _one_minus_pow(beta, t):
    """``1 - beta ** t`` in float64 as ``-expm1(t * log(beta))``, with Kahan's
    ``expm1(x) = (u - 1) * x / log(u)``, ``u = exp(x)``: full relative precision
    where ``beta ** t`` is close to 1, from plain exp/log."""
    x = t.to(tl.float64) * tl.log(beta.to(tl.float64))
    u = tl.exp(x)
    edge = (u == 1.0) | (u == 0.0)
    # The quotient is used only off the edges; a stand-in keeps it finite there.
    em1 = (u - 1.0) * x / tl.log(tl.where(edge, 0.5, u))
    return -tl.where(u == 1.0, x, tl.where(u == 0.0, -1.0, em1))


@triton.jit
def _lerp(start, end, w, w_small):
    """torch.lerp's formula: ``start + w * (end - start)`` for ``|w| < 0.5``, else
    ``end - (end - start) * (1 - w)``."""
    diff = end - start
    return tl.where(w_small, start + w * diff, end - diff * (1.0 - w))


@triton.jit
def _direction(g, p, wd, MAXIMIZE: tl.constexpr, WD: tl.constexpr, F64: tl.constexpr):
    d = _math(g, F64)
    if MAXIMIZE:
        d = -d
    if WD:
        d = d + p * wd
    return d


@triton.jit
def _step_count(t_ptr):
    """The tile's (already incremented) step count."""
    return tl.load(t_ptr)


@triton.jit
def _offset(arow, ACOL: tl.constexpr, tile_offset, VEC: tl.constexpr, ALIGNED: tl.constexpr,
            PRESENT: tl.constexpr):
    """A tile's element offset in one list: the tensor's offset from the list's first
    tensor (address row) plus the tile's offset in the tensor (tile row)."""
    if PRESENT:
        # Loaded here, once per loop copy, so the hint sits on this copy's load only.
        o = tl.load(arow + ACOL) + tile_offset
        if ALIGNED:
            o = tl.multiple_of(o, VEC)
    else:
        o = 0
    return o


@triton.jit
def _gathered(grow, j):
    """Offsets in a gradient's model slice of elements ``j`` of its parameter's slice:
    the gather row's (size, stride) pairs, innermost first (padding (1, 0) adds 0)."""
    r = j.to(tl.int64)
    o = tl.zeros_like(r)
    for d in tl.static_range(_MAX_GRAD_DIMS):
        size = tl.load(grow + 2 * d)
        o += (r % size) * tl.load(grow + 2 * d + 1)
        r = r // size
    return o


# ---- the optimizers: per-model scalars (once per program) and element-wise math ----
#
# An update function gets the block's parameter (in the math dtype) and gradient,
# and pointers to the block of each state list; it loads and stores its state
# itself, each as late and as early as its math allows (fewer live registers),
# and returns the new parameter.

@triton.jit
def _sgd_scalars(h, stride_hr, t_ptr, MOMENTUM: tl.constexpr, F64: tl.constexpr):
    lr = tl.load(h + _SGD_LR * stride_hr)
    momentum = tl.load(h + _SGD_MOMENTUM * stride_hr)
    dampening = tl.load(h + _SGD_DAMPENING * stride_hr)
    wd = tl.load(h + _SGD_WD * stride_hr)
    # A model without momentum steps with its gradient and keeps its buffer.
    on = momentum != 0.0
    decay = momentum
    scale = 1.0 - dampening
    if MOMENTUM:
        # A model's first update with momentum (the count counts only those) sets its
        # buffer to the gradient, as torch's clone does.
        first = _step_count(t_ptr) == 1.0
        decay = tl.where(first, 0.0, momentum)
        scale = tl.where(first, 1.0, scale)
    return _math(-lr, F64), _math(momentum, F64), _math(decay, F64), _math(scale, F64), _math(wd, F64), on


@triton.jit
def _sgd_update(c, p, g, buf_ptrs, mask, MOMENTUM: tl.constexpr, NESTEROV: tl.constexpr,
                MAXIMIZE: tl.constexpr, HAS_WD: tl.constexpr, F64: tl.constexpr):
    neg_lr, momentum, decay, scale, wd, on = c
    d = _direction(g, p, wd, MAXIMIZE, HAS_WD, F64)
    if MOMENTUM:
        # a model without momentum neither reads nor writes its buffer
        in_use = tl.where(on, mask, False)  # (the interpreter cannot & a scalar into a block)
        buf = tl.load(buf_ptrs, mask=in_use)
        buf = buf * decay + d * scale
        tl.store(buf_ptrs, buf, mask=in_use)
        if NESTEROV:
            d = tl.where(on, d + buf * momentum, d)
        else:
            d = tl.where(on, buf, d)
    return p + d * neg_lr


@triton.jit
def _adam_scalars(h, stride_hr, t_ptr, F64: tl.constexpr, H64: tl.constexpr):
    lr = tl.load(h + _ADAM_LR * stride_hr)
    beta1 = tl.load(h + _ADAM_BETA1 * stride_hr)
    beta2 = tl.load(h + _ADAM_BETA2 * stride_hr)
    eps = tl.load(h + _ADAM_EPS * stride_hr)
    wd = tl.load(h + _ADAM_WD * stride_hr)
    t = _step_count(t_ptr)
    # Per-model scalars in the hyperparameters' dtype, as the torch path computes them.
    bc1 = _one_minus_pow(beta1, t).to(lr.dtype)
    bc2 = _one_minus_pow(beta2, t).to(lr.dtype)
    step_size = _div(lr, bc1, H64)
    bc2_sqrt = _sqrt(bc2, H64)
    w1 = 1.0 - beta1
    return (_math(-step_size, F64), _math(bc2_sqrt, F64), _math(eps, F64), _math(wd, F64),
            _math(1.0 - lr * wd, F64), _math(beta2, F64), _math(w1, F64), tl.abs(w1) < 0.5,
            _math(1.0 - beta2, F64))


@triton.jit
def _adam_update(c, p, g, m_ptrs, v_ptrs, vmax_ptrs, mask, AMSGRAD: tl.constexpr, DECOUPLED: tl.constexpr,
                 MAXIMIZE: tl.constexpr, HAS_WD: tl.constexpr, F64: tl.constexpr):
    neg_step, bc2_sqrt, eps, wd, p_decay, beta2, w1, w1_small, w2 = c
    m = tl.load(m_ptrs, mask=mask)
    v = tl.load(v_ptrs, mask=mask)
    d = _direction(g, p, wd, MAXIMIZE, HAS_WD and not DECOUPLED, F64)
    if HAS_WD and DECOUPLED:
        p = p * p_decay
    m = _lerp(m, d, w1, w1_small)
    v = v * beta2 + (d * w2) * d
    tl.store(m_ptrs, m, mask=mask)
    tl.store(v_ptrs, v, mask=mask)
    if AMSGRAD:
        vmax = tl.load(vmax_ptrs, mask=mask)
        vmax = tl.maximum(vmax, v, propagate_nan=tl.PropagateNan.ALL)
        tl.store(vmax_ptrs, vmax, mask=mask)
        v = vmax
    denom = _div(_sqrt(v, F64), bc2_sqrt, F64) + eps
    return p + _div(m, denom, F64) * neg_step


@triton.jit
def _adagrad_scalars(h, stride_hr, t_ptr, F64: tl.constexpr, H64: tl.constexpr):
    lr = tl.load(h + _ADAGRAD_LR * stride_hr)
    lr_decay = tl.load(h + _ADAGRAD_LR_DECAY * stride_hr)
    wd = tl.load(h + _ADAGRAD_WD * stride_hr)
    eps = tl.load(h + _ADAGRAD_EPS * stride_hr)
    t = _step_count(t_ptr).to(lr.dtype)
    clr = _div(lr, 1.0 + (t - 1.0) * lr_decay, H64)
    return _math(-clr, F64), _math(eps, F64), _math(wd, F64)


@triton.jit
def _adagrad_update(c, p, g, sum_ptrs, mask, MAXIMIZE: tl.constexpr, HAS_WD: tl.constexpr, F64: tl.constexpr):
    neg_clr, eps, wd = c
    s = tl.load(sum_ptrs, mask=mask)
    d = _direction(g, p, wd, MAXIMIZE, HAS_WD, F64)
    s = s + d * d
    tl.store(sum_ptrs, s, mask=mask)
    return p + _div(d, _sqrt(s, F64) + eps, F64) * neg_clr


@triton.jit
def _adadelta_scalars(h, stride_hr, F64: tl.constexpr):
    lr = tl.load(h + _ADADELTA_LR * stride_hr)
    rho = tl.load(h + _ADADELTA_RHO * stride_hr)
    eps = tl.load(h + _ADADELTA_EPS * stride_hr)
    wd = tl.load(h + _ADADELTA_WD * stride_hr)
    return _math(-lr, F64), _math(rho, F64), _math(1.0 - rho, F64), _math(eps, F64), _math(wd, F64)


@triton.jit
def _adadelta_update(c, p, g, sq_ptrs, acc_ptrs, mask, MAXIMIZE: tl.constexpr, HAS_WD: tl.constexpr,
                     F64: tl.constexpr):
    neg_lr, rho, w, eps, wd = c
    sq = tl.load(sq_ptrs, mask=mask)
    acc = tl.load(acc_ptrs, mask=mask)
    d = _direction(g, p, wd, MAXIMIZE, HAS_WD, F64)
    sq = sq * rho + (d * w) * d
    std = _sqrt(sq + eps, F64)
    delta = _div(_sqrt(acc + eps, F64), std, F64) * d
    acc = acc * rho + (delta * w) * delta
    tl.store(sq_ptrs, sq, mask=mask)
    tl.store(acc_ptrs, acc, mask=mask)
    return p + delta * neg_lr


@triton.jit
def _rmsprop_scalars(h, stride_hr, F64: tl.constexpr):
    lr = tl.load(h + _RMSPROP_LR * stride_hr)
    alpha = tl.load(h + _RMSPROP_ALPHA * stride_hr)
    eps = tl.load(h + _RMSPROP_EPS * stride_hr)
    wd = tl.load(h + _RMSPROP_WD * stride_hr)
    momentum = tl.load(h + _RMSPROP_MOMENTUM * stride_hr)
    w = 1.0 - alpha
    return (_math(-lr, F64), _math(alpha, F64), _math(w, F64), tl.abs(w) < 0.5, _math(eps, F64),
            _math(wd, F64), _math(momentum, F64), momentum != 0.0)


@triton.jit
def _rmsprop_update(c, p, g, sq_ptrs, gavg_ptrs, buf_ptrs, mask, CENTERED: tl.constexpr,
                    MOMENTUM: tl.constexpr, MAXIMIZE: tl.constexpr, HAS_WD: tl.constexpr, F64: tl.constexpr):
    neg_lr, alpha, w, w_small, eps, wd, momentum, on = c
    sq = tl.load(sq_ptrs, mask=mask)
    d = _direction(g, p, wd, MAXIMIZE, HAS_WD, F64)
    sq = sq * alpha + (d * w) * d
    tl.store(sq_ptrs, sq, mask=mask)
    if CENTERED:
        gavg = tl.load(gavg_ptrs, mask=mask)
        gavg = _lerp(gavg, d, w, w_small)
        tl.store(gavg_ptrs, gavg, mask=mask)
        avg = _sqrt(sq - gavg * gavg, F64) + eps
    else:
        avg = _sqrt(sq, F64) + eps
    update = _div(d, avg, F64)
    if MOMENTUM:
        # a model without momentum steps without its buffer and keeps it as it was
        in_use = tl.where(on, mask, False)  # (the interpreter cannot & a scalar into a block)
        buf = tl.load(buf_ptrs, mask=in_use)
        buf = buf * momentum + update
        tl.store(buf_ptrs, buf, mask=in_use)
        update = tl.where(on, buf, update)
    return p + update * neg_lr


@triton.jit
def _norm(sq, F64: tl.constexpr, dtype):
    """A norm from its sum of squares (math dtype), in the hyperparameters' ``dtype``."""
    return _sqrt(sq, F64).to(dtype)


@triton.jit
def _lars_scalars(h, stride_hr, w_sq, g_sq, TRUST: tl.constexpr, F64: tl.constexpr, H64: tl.constexpr):
    lr = tl.load(h + _LARS_LR * stride_hr)
    momentum = tl.load(h + _LARS_MOMENTUM * stride_hr)
    wd = tl.load(h + _LARS_WD * stride_hr)
    trust = tl.load(h + _LARS_TRUST * stride_hr)
    eps = tl.load(h + _LARS_EPS * stride_hr)
    scale = lr
    if TRUST:
        w_norm = _norm(w_sq, F64, lr.dtype)
        g_norm = _norm(g_sq, F64, lr.dtype)
        local = _div(trust * w_norm, g_norm + wd * w_norm + eps, H64)
        scale = lr * tl.where((w_norm > 0.0) & (g_norm > 0.0), local, 1.0)
    return _math(scale, F64), _math(momentum, F64), _math(wd, F64), momentum != 0.0


@triton.jit
def _lars_norm_terms(c, p, g, F64: tl.constexpr):
    # ||w|| and ||grad|| (the sign of maximize does not change a norm)
    return p, _math(g, F64)


@triton.jit
def _lars_update(c, p, g, buf_ptrs, mask, MOMENTUM: tl.constexpr, MAXIMIZE: tl.constexpr, HAS_WD: tl.constexpr,
                 F64: tl.constexpr):
    scale, momentum, wd, on = c
    d = _direction(g, p, wd, MAXIMIZE, HAS_WD, F64)
    if MOMENTUM:
        # a model without momentum steps without its buffer and keeps it as it was
        in_use = tl.where(on, mask, False)  # (the interpreter cannot & a scalar into a block)
        buf = tl.load(buf_ptrs, mask=in_use)
        buf = buf * momentum + d * scale
        tl.store(buf_ptrs, buf, mask=in_use)
        return tl.where(on, p - buf, p + d * -scale)
    else:
        return p + d * -scale


@triton.jit
def _lamb_scalars(h, stride_hr, t_ptr, w_sq, r_sq, TRUST: tl.constexpr, BIAS_CORRECTION: tl.constexpr,
                  F64: tl.constexpr, H64: tl.constexpr):
    lr = tl.load(h + _LAMB_LR * stride_hr)
    beta1 = tl.load(h + _LAMB_BETA1 * stride_hr)
    beta2 = tl.load(h + _LAMB_BETA2 * stride_hr)
    eps = tl.load(h + _LAMB_EPS * stride_hr)
    wd = tl.load(h + _LAMB_WD * stride_hr)
    if BIAS_CORRECTION:
        t = _step_count(t_ptr)
        bc1 = _one_minus_pow(beta1, t).to(lr.dtype)
        bc2_sqrt = _sqrt(_one_minus_pow(beta2, t).to(lr.dtype), H64)
    else:
        # dividing by 1 is exact: the same code serves both
        bc1 = tl.full((), 1.0, lr.dtype)
        bc2_sqrt = tl.full((), 1.0, lr.dtype)
    scale = lr
    if TRUST:
        lo = tl.load(h + _LAMB_NORM_MIN * stride_hr)
        hi = tl.load(h + _LAMB_NORM_MAX * stride_hr)
        w_norm = _norm(w_sq, F64, lr.dtype)
        r_norm = _norm(r_sq, F64, lr.dtype)
        phi = tl.minimum(tl.maximum(w_norm, lo), hi)
        ok = (w_norm > 0.0) & (r_norm > 0.0)
        scale = lr * tl.where(ok, _div(phi, tl.where(ok, r_norm, 1.0), H64), 1.0)
    w1 = 1.0 - beta1
    return (_math(scale, F64), _math(bc1, F64), _math(bc2_sqrt, F64), _math(eps, F64), _math(wd, F64),
            _math(beta2, F64), _math(w1, F64), tl.abs(w1) < 0.5, _math(1.0 - beta2, F64))


@triton.jit
def _lamb_moments(c, p, g, m_ptrs, v_ptrs, mask, MAXIMIZE: tl.constexpr, F64: tl.constexpr):
    """Update and store the moments of a block; returns them."""
    scale, bc1, bc2_sqrt, eps, wd, beta2, w1, w1_small, w2 = c
    d = _direction(g, p, wd, MAXIMIZE, False, F64)
    m = _lerp(tl.load(m_ptrs, mask=mask), d, w1, w1_small)
    v = tl.load(v_ptrs, mask=mask)
    v = v * beta2 + (d * w2) * d
    tl.store(m_ptrs, m, mask=mask)
    tl.store(v_ptrs, v, mask=mask)
    return m, v


@triton.jit
def _lamb_direction(c, p, m, v, HAS_WD: tl.constexpr, F64: tl.constexpr):
    """``r = (m / bc1) / (sqrt(v) / sqrt(bc2) + eps) [+ weight_decay * w]``."""
    scale, bc1, bc2_sqrt, eps, wd, beta2, w1, w1_small, w2 = c
    denom = _div(_sqrt(v, F64), bc2_sqrt, F64) + eps
    r = _div(_div(m, bc1, F64), denom, F64)
    if HAS_WD:
        r = r + p * wd
    return r


@triton.jit
def _lamb_norm_terms(c, p, g, m_ptrs, v_ptrs, mask, MAXIMIZE: tl.constexpr, HAS_WD: tl.constexpr,
                     F64: tl.constexpr):
    m, v = _lamb_moments(c, p, g, m_ptrs, v_ptrs, mask, MAXIMIZE, F64)
    return p, _lamb_direction(c, p, m, v, HAS_WD, F64)


@triton.jit
def _lamb_update(c, p, g, m_ptrs, v_ptrs, mask, TRUST: tl.constexpr, MAXIMIZE: tl.constexpr,
                 HAS_WD: tl.constexpr, F64: tl.constexpr):
    if TRUST:
        # the norm pass has updated the moments
        m = tl.load(m_ptrs, mask=mask)
        v = tl.load(v_ptrs, mask=mask)
    else:
        m, v = _lamb_moments(c, p, g, m_ptrs, v_ptrs, mask, MAXIMIZE, F64)
    r = _lamb_direction(c, p, m, v, HAS_WD, F64)
    return p + r * -c[0]


@triton.jit
def _scalars(OPT: tl.constexpr, h, stride_hr, t_ptr, w_sq, x_sq, HAS_S0: tl.constexpr,
             TRUST: tl.constexpr, BIAS_CORRECTION: tl.constexpr, F64: tl.constexpr, H64: tl.constexpr):
    # w_sq, x_sq: the sums of squares of the tile's (tensor, model) pair (TRUST), else unused
    if OPT == "lars":
        return _lars_scalars(h, stride_hr, w_sq, x_sq, TRUST, F64, H64)
    elif OPT == "lamb":
        return _lamb_scalars(h, stride_hr, t_ptr, w_sq, x_sq, TRUST, BIAS_CORRECTION, F64, H64)
    elif OPT == "sgd":
        return _sgd_scalars(h, stride_hr, t_ptr, HAS_S0, F64)
    elif OPT == "adam":
        return _adam_scalars(h, stride_hr, t_ptr, F64, H64)
    elif OPT == "adagrad":
        return _adagrad_scalars(h, stride_hr, t_ptr, F64, H64)
    elif OPT == "adadelta":
        return _adadelta_scalars(h, stride_hr, F64)
    else:
        tl.static_assert(OPT == "rmsprop", "no update function for this optimizer")
        return _rmsprop_scalars(h, stride_hr, F64)


@triton.jit
def _update(OPT: tl.constexpr, c, p, g, s0, s1, s2, mask,
            HAS_S0: tl.constexpr, HAS_S1: tl.constexpr, HAS_S2: tl.constexpr, NESTEROV: tl.constexpr,
            DECOUPLED: tl.constexpr, TRUST: tl.constexpr, MAXIMIZE: tl.constexpr, HAS_WD: tl.constexpr,
            F64: tl.constexpr):
    # s0..s2: the state lists' pointers in the op's argument order; an optional
    # list's flag is its presence.
    if OPT == "lars":
        return _lars_update(c, p, g, s0, mask, HAS_S0, MAXIMIZE, HAS_WD, F64)
    elif OPT == "lamb":
        return _lamb_update(c, p, g, s0, s1, mask, TRUST, MAXIMIZE, HAS_WD, F64)
    elif OPT == "sgd":
        return _sgd_update(c, p, g, s0, mask, HAS_S0, NESTEROV, MAXIMIZE, HAS_WD, F64)
    elif OPT == "adam":
        return _adam_update(c, p, g, s0, s1, s2, mask, HAS_S2, DECOUPLED, MAXIMIZE, HAS_WD, F64)
    elif OPT == "adagrad":
        return _adagrad_update(c, p, g, s0, mask, MAXIMIZE, HAS_WD, F64)
    elif OPT == "adadelta":
        return _adadelta_update(c, p, g, s0, s1, mask, MAXIMIZE, HAS_WD, F64)
    else:
        return _rmsprop_update(c, p, g, s0, s1, s2, mask, HAS_S1, HAS_S2, MAXIMIZE, HAS_WD, F64)


# ---- the driver -------------------------------------------------------------------

@triton.jit
def _tile(
    row, arow, gat_ptr, live, c, p_ptr, g_ptr, s0_ptr, s1_ptr, s2_ptr,
    OPT: tl.constexpr, HAS_S0: tl.constexpr, HAS_S1: tl.constexpr, HAS_S2: tl.constexpr,
    NESTEROV: tl.constexpr, DECOUPLED: tl.constexpr, TRUST: tl.constexpr, MAXIMIZE: tl.constexpr,
    HAS_WD: tl.constexpr, F64: tl.constexpr, ALIGNED: tl.constexpr, GATHER: tl.constexpr,
    VEC_P: tl.constexpr, VEC_S: tl.constexpr, BLOCK: tl.constexpr,
):
    # ALIGNED: 16-byte vectors throughout; GATHER: the gradient is read through the
    # tile's gather row (never aligned).
    off = tl.load(row + _COL_OFFSET)
    o_p = _offset(arow, _ADDR_P, off, VEC_P, ALIGNED, True)
    o_g = _offset(arow, _ADDR_G, tl.load(row + _COL_GRAD), VEC_P, ALIGNED, True)
    o_0 = _offset(arow, _ADDR_S0, off, VEC_S, ALIGNED, HAS_S0)
    o_1 = _offset(arow, _ADDR_S1, off, VEC_S, ALIGNED, HAS_S1)
    o_2 = _offset(arow, _ADDR_S2, off, VEC_S, ALIGNED, HAS_S2)
    if GATHER:
        grow = gat_ptr + tl.load(row + _COL_GATHER) * _GATHER_COLS
        start = tl.load(row + _COL_START)
    # The tile's length, 0 for a skipped model (its loop then runs zero times).
    n = tl.where(live, tl.load(row + _COL_LEN), 0)
    if ALIGNED:
        n = tl.multiple_of(n, _LEN_ALIGN)
    for k in range(0, tl.cdiv(n, BLOCK)):
        idx = k * BLOCK + tl.arange(0, BLOCK)
        mask = idx < n
        p = _math(tl.load(p_ptr + o_p + idx, mask=mask), F64)
        if GATHER:
            g = tl.load(g_ptr + o_g + _gathered(grow, start + idx), mask=mask)
        else:
            g = tl.load(g_ptr + o_g + idx, mask=mask)
        p = _update(OPT, c, p, g, s0_ptr + o_0 + idx, s1_ptr + o_1 + idx, s2_ptr + o_2 + idx, mask,
                    HAS_S0, HAS_S1, HAS_S2, NESTEROV, DECOUPLED, TRUST, MAXIMIZE, HAS_WD, F64)
        tl.store(p_ptr + o_p + idx, p.to(p_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _step_kernel(
    tiles_ptr,  # [T, _COLS] int64 tile rows (module docstring)
    addr_ptr,  # [n, _ADDR_COLS] int64 this call's address rows, one per tensor
    gat_ptr,  # [G, _GATHER_COLS] int64 gather rows of the gradients read in another layout (read with GATHER)
    p_ptr,  # the group's first parameter [B, ...]; every parameter is an offset from it
    g_ptr,  # the group's first gradient (parameter dtype)
    s0_ptr,  # the group's first tensor of each state list, in the op's argument order
    s1_ptr,  # (state dtype); an absent list's pointer is the parameter's, never read
    s2_ptr,
    steps_ptr,  # steps[0]: [B] float32, already incremented (unread without steps)
    hyp_ptr,  # [R, B]: the op's hyperparameter rows
    stride_hr, stride_hb,
    skip_ptr,  # [B] bool
    part_ptr,  # [T, 2] the norm pass's per-tile sums of squares (math dtype); read with TRUST only
    OPT: tl.constexpr,  # the optimizer (its spec's name): which scalars and update functions run
    HAS_S0: tl.constexpr, HAS_S1: tl.constexpr, HAS_S2: tl.constexpr,
    NESTEROV: tl.constexpr, DECOUPLED: tl.constexpr, TRUST: tl.constexpr, BIAS_CORRECTION: tl.constexpr,
    MAXIMIZE: tl.constexpr, HAS_WD: tl.constexpr,
    HAS_SKIP: tl.constexpr, F64: tl.constexpr, H64: tl.constexpr,
    GATHER: tl.constexpr,  # some tile of the table reads its gradient through a gather row
    VEC_P: tl.constexpr, VEC_S: tl.constexpr, BLOCK: tl.constexpr,
):
    row = tiles_ptr + tl.program_id(0).to(tl.int64) * _COLS
    arow = addr_ptr + tl.load(row + _COL_TENSOR) * _ADDR_COLS
    b = tl.load(row + _COL_MODEL)
    if HAS_SKIP:
        live = tl.load(skip_ptr + b) == 0
    else:
        live = b >= 0
    w_sq, x_sq = _pair_sums(row, part_ptr, TRUST, BLOCK)
    t_ptr = steps_ptr + tl.load(arow + _ADDR_STEP) + tl.load(row + _COL_STEP)
    c = _scalars(OPT, hyp_ptr + b * stride_hb, stride_hr, t_ptr, w_sq, x_sq, HAS_S0, TRUST,
                 BIAS_CORRECTION, F64, H64)
    # A gathered tensor's address row is never aligned (hfkern/_multi_tensor.py).
    aligned = tl.load(arow + _ADDR_ALIGNED) != 0
    if GATHER:
        if tl.load(row + _COL_GATHER) >= 0:
            _tile(row, arow, gat_ptr, live, c, p_ptr, g_ptr, s0_ptr, s1_ptr, s2_ptr, OPT, HAS_S0, HAS_S1,
                  HAS_S2, NESTEROV, DECOUPLED, TRUST, MAXIMIZE, HAS_WD, F64, False, True, VEC_P, VEC_S, BLOCK)
        elif aligned:
            _tile(row, arow, gat_ptr, live, c, p_ptr, g_ptr, s0_ptr, s1_ptr, s2_ptr, OPT, HAS_S0, HAS_S1,
                  HAS_S2, NESTEROV, DECOUPLED, TRUST, MAXIMIZE, HAS_WD, F64, True, False, VEC_P, VEC_S, BLOCK)
        else:
            _tile(row, arow, gat_ptr, live, c, p_ptr, g_ptr, s0_ptr, s1_ptr, s2_ptr, OPT, HAS_S0, HAS_S1,
                  HAS_S2, NESTEROV, DECOUPLED, TRUST, MAXIMIZE, HAS_WD, F64, False, False, VEC_P, VEC_S, BLOCK)
    elif aligned:
        _tile(row, arow, gat_ptr, live, c, p_ptr, g_ptr, s0_ptr, s1_ptr, s2_ptr, OPT, HAS_S0, HAS_S1, HAS_S2,
              NESTEROV, DECOUPLED, TRUST, MAXIMIZE, HAS_WD, F64, True, False, VEC_P, VEC_S, BLOCK)
    else:
        _tile(row, arow, gat_ptr, live, c, p_ptr, g_ptr, s0_ptr, s1_ptr, s2_ptr, OPT, HAS_S0, HAS_S1, HAS_S2,
              NESTEROV, DECOUPLED, TRUST, MAXIMIZE, HAS_WD, F64, False, False, VEC_P, VEC_S, BLOCK)


@triton.jit
def _pair_sums(row, part_ptr, TRUST: tl.constexpr, BLOCK: tl.constexpr):
    """The two sums of squares of the tile's (tensor, model) pair: its tiles' partials,
    summed in row order (the same order in every program of the pair)."""
    if TRUST:
        first = tl.load(row + _COL_FIRST)
        count = tl.load(row + _COL_TILES)
        acc_w = tl.zeros((BLOCK,), dtype=part_ptr.dtype.element_ty)
        acc_x = tl.zeros((BLOCK,), dtype=part_ptr.dtype.element_ty)
        for k in range(0, tl.cdiv(count, BLOCK)):
            j = k * BLOCK + tl.arange(0, BLOCK)
            at = part_ptr + (first + j) * 2
            acc_w += tl.load(at, mask=j < count, other=0.0)
            acc_x += tl.load(at + 1, mask=j < count, other=0.0)
        return tl.sum(acc_w, axis=0), tl.sum(acc_x, axis=0)
    else:
        return 0.0, 0.0


@triton.jit
def _norm_tile(row, arow, gat_ptr, live, c, p_ptr, g_ptr, s0_ptr, s1_ptr, OPT: tl.constexpr,
               MAXIMIZE: tl.constexpr, HAS_WD: tl.constexpr, F64: tl.constexpr, ALIGNED: tl.constexpr,
               GATHER: tl.constexpr, VEC_P: tl.constexpr, VEC_S: tl.constexpr, BLOCK: tl.constexpr):
    off = tl.load(row + _COL_OFFSET)
    o_p = _offset(arow, _ADDR_P, off, VEC_P, ALIGNED, True)
    o_g = _offset(arow, _ADDR_G, tl.load(row + _COL_GRAD), VEC_P, ALIGNED, True)
    o_0 = _offset(arow, _ADDR_S0, off, VEC_S, ALIGNED, OPT == "lamb")
    o_1 = _offset(arow, _ADDR_S1, off, VEC_S, ALIGNED, OPT == "lamb")
    if GATHER:
        grow = gat_ptr + tl.load(row + _COL_GATHER) * _GATHER_COLS
        start = tl.load(row + _COL_START)
    n = tl.where(live, tl.load(row + _COL_LEN), 0)
    if ALIGNED:
        n = tl.multiple_of(n, _LEN_ALIGN)
    if F64:
        acc_w = tl.zeros((BLOCK,), dtype=tl.float64)
        acc_x = tl.zeros((BLOCK,), dtype=tl.float64)
    else:
        acc_w = tl.zeros((BLOCK,), dtype=tl.float32)
        acc_x = tl.zeros((BLOCK,), dtype=tl.float32)
    for k in range(0, tl.cdiv(n, BLOCK)):
        idx = k * BLOCK + tl.arange(0, BLOCK)
        mask = idx < n
        p = _math(tl.load(p_ptr + o_p + idx, mask=mask), F64)
        if GATHER:
            g = tl.load(g_ptr + o_g + _gathered(grow, start + idx), mask=mask)
        else:
            g = tl.load(g_ptr + o_g + idx, mask=mask)
        if OPT == "lars":
            w, x = _lars_norm_terms(c, p, g, F64)
        else:
            tl.static_assert(OPT == "lamb", "no norm terms for this optimizer")
            w, x = _lamb_norm_terms(c, p, g, s0_ptr + o_0 + idx, s1_ptr + o_1 + idx, mask, MAXIMIZE, HAS_WD, F64)
        # masked lanes hold whatever the load gave them
        acc_w += tl.where(mask, w * w, 0.0)
        acc_x += tl.where(mask, x * x, 0.0)
    return tl.sum(acc_w, axis=0), tl.sum(acc_x, axis=0)


@triton.jit
def _norms_kernel(
    tiles_ptr,  # [T, _COLS] int64 tile rows (module docstring)
    addr_ptr, gat_ptr,  # as _step_kernel's
    p_ptr, g_ptr, s0_ptr, s1_ptr, s2_ptr, steps_ptr,  # as _step_kernel's
    hyp_ptr,  # [R, B]: the op's hyperparameter rows
    stride_hr, stride_hb,
    skip_ptr,  # [B] bool
    part_ptr,  # [T, 2] out: the tile's sums of squares of ``w`` and of the ratio's other vector
    OPT: tl.constexpr, BIAS_CORRECTION: tl.constexpr, MAXIMIZE: tl.constexpr, HAS_WD: tl.constexpr,
    HAS_SKIP: tl.constexpr, F64: tl.constexpr, H64: tl.constexpr, GATHER: tl.constexpr,
    VEC_P: tl.constexpr, VEC_S: tl.constexpr, BLOCK: tl.constexpr,
):
    # The first pass of a trust-ratio step: one program per tile (a skipped model's
    # tiles write zeros, which no update reads).
    pid = tl.program_id(0).to(tl.int64)
    row = tiles_ptr + pid * _COLS
    arow = addr_ptr + tl.load(row + _COL_TENSOR) * _ADDR_COLS
    b = tl.load(row + _COL_MODEL)
    if HAS_SKIP:
        live = tl.load(skip_ptr + b) == 0
    else:
        live = b >= 0
    t_ptr = steps_ptr + tl.load(arow + _ADDR_STEP) + tl.load(row + _COL_STEP)
    c = _scalars(OPT, hyp_ptr + b * stride_hb, stride_hr, t_ptr, 0.0, 0.0, False, False,
                 BIAS_CORRECTION, F64, H64)
    aligned = tl.load(arow + _ADDR_ALIGNED) != 0
    if GATHER:
        if tl.load(row + _COL_GATHER) >= 0:
            w_sq, x_sq = _norm_tile(row, arow, gat_ptr, live, c, p_ptr, g_ptr, s0_ptr, s1_ptr, OPT, MAXIMIZE,
                                    HAS_WD, F64, False, True, VEC_P, VEC_S, BLOCK)
        elif aligned:
            w_sq, x_sq = _norm_tile(row, arow, gat_ptr, live, c, p_ptr, g_ptr, s0_ptr, s1_ptr, OPT, MAXIMIZE,
                                    HAS_WD, F64, True, False, VEC_P, VEC_S, BLOCK)
        else:
            w_sq, x_sq = _norm_tile(row, arow, gat_ptr, live, c, p_ptr, g_ptr, s0_ptr, s1_ptr, OPT, MAXIMIZE,
                                    HAS_WD, F64, False, False, VEC_P, VEC_S, BLOCK)
    elif aligned:
        w_sq, x_sq = _norm_tile(row, arow, gat_ptr, live, c, p_ptr, g_ptr, s0_ptr, s1_ptr, OPT, MAXIMIZE, HAS_WD,
                                F64, True, False, VEC_P, VEC_S, BLOCK)
    else:
        w_sq, x_sq = _norm_tile(row, arow, gat_ptr, live, c, p_ptr, g_ptr, s0_ptr, s1_ptr, OPT, MAXIMIZE, HAS_WD,
                                F64, False, False, VEC_P, VEC_S, BLOCK)
    tl.store(part_ptr + pid * 2, w_sq)
    tl.store(part_ptr + pid * 2 + 1, x_sq)


@triton.jit
def _count_kernel(
    steps_ptr,  # steps[0]: [B] float32; every step count of the call is an offset from it
    addr_ptr,  # [n, _ADDR_COLS] int64 this call's address rows: steps[i]'s offset at _ADDR_STEP
    offs_ptr,  # [n * B] int64: b * steps[i].stride(0) at i * B + b
    skip_ptr,  # [B] bool
    hyp_ptr,  # [R, B]: the op's hyperparameter rows (read with COUNTED_BY only)
    stride_hr, stride_hb,
    NB, B,
    HAS_SKIP: tl.constexpr,
    COUNTED_BY: tl.constexpr,  # the row whose zero value leaves a model uncounted, or -1: none
    BLOCK: tl.constexpr,
):
    k = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = k < NB
    if HAS_SKIP:
        mask = mask & (tl.load(skip_ptr + k % B, mask=mask, other=1) == 0)
    if COUNTED_BY >= 0:
        mask = mask & (tl.load(hyp_ptr + COUNTED_BY * stride_hr + (k % B) * stride_hb, mask=mask, other=0) != 0)
    off = tl.load(addr_ptr + (k // B).to(tl.int64) * _ADDR_COLS + _ADDR_STEP, mask=mask, other=0)
    off += tl.load(offs_ptr + k, mask=mask, other=0)
    t = tl.load(steps_ptr + off, mask=mask)
    tl.store(steps_ptr + off, t + 1.0, mask=mask)


# ---- non-finite check ----------------------------------------------------------------

@triton.jit
def _nonfinite_tile(row, arow, g_ptr, ALIGNED: tl.constexpr, F64: tl.constexpr, VEC: tl.constexpr,
                    BLOCK: tl.constexpr):
    o = _offset(arow, _NF_ADDR_G, tl.load(row + _NF_OFFSET), VEC, ALIGNED, True)
    n = tl.load(row + _NF_LEN)
    if ALIGNED:
        n = tl.multiple_of(n, _LEN_ALIGN)
    bad = tl.zeros((BLOCK,), dtype=tl.int32)
    for k in range(0, tl.cdiv(n, BLOCK)):
        idx = k * BLOCK + tl.arange(0, BLOCK)
        x = tl.load(g_ptr + o + idx, mask=idx < n, other=0.0)
        # Exponent bits all ones is exactly inf or NaN; integer tests survive any
        # floating-point fast-math assumption.
        if F64:
            bits = x.to(tl.int64, bitcast=True)
            flag = (bits & 0x7FF0000000000000) == 0x7FF0000000000000
        else:
            bits = x.to(tl.float32).to(tl.int32, bitcast=True)
            flag = (bits & 0x7F800000) == 0x7F800000
        bad = tl.maximum(bad, flag.to(tl.int32))
    return tl.max(bad, axis=0)


@triton.jit
def _nonfinite_tiles_kernel(
    tiles_ptr,  # [T, _NF_COLS] int64: tensor, gradient offset, partial index, length
    addr_ptr,  # [n, _NF_ADDR_COLS] int64 this call's address rows: gradient offset, aligned
    g_ptr,  # the group's first gradient; every gradient is an offset from it
    part_ptr,  # [B, Tm] int32 per-tile flags
    F64: tl.constexpr, VEC: tl.constexpr, BLOCK: tl.constexpr,
):
    row = tiles_ptr + tl.program_id(0).to(tl.int64) * _NF_COLS
    arow = addr_ptr + tl.load(row + _NF_TENSOR) * _NF_ADDR_COLS
    if tl.load(arow + _NF_ADDR_ALIGNED) != 0:
        bad = _nonfinite_tile(row, arow, g_ptr, True, F64, VEC, BLOCK)
    else:
        bad = _nonfinite_tile(row, arow, g_ptr, False, F64, VEC, BLOCK)
    tl.store(part_ptr + tl.load(row + _NF_PART), bad)


@triton.jit
def _nonfinite_reduce_kernel(
    part_ptr,  # [B, Tm] int32 per-tile flags
    out_ptr,  # [B] bool
    Tm,
    BLOCK: tl.constexpr,
):
    # Second pass of a deterministic two-pass reduction: one program per model.
    b = tl.program_id(0).to(tl.int64)
    bad = tl.zeros((BLOCK,), dtype=tl.int32)
    for k in range(0, tl.cdiv(Tm, BLOCK)):
        j = k * BLOCK + tl.arange(0, BLOCK)
        bad = tl.maximum(bad, tl.load(part_ptr + b * Tm + j, mask=j < Tm, other=0))
    tl.store(out_ptr + b, tl.max(bad, axis=0) != 0)


# ---- launch configuration ----------------------------------------------------------------

_INTERPRET_BLOCK = triton.Config({"BLOCK": 32})
# 4 or 8 elements per thread: 16-byte vectors at 64-160 registers (sm_90), so
# several programs per SM keep enough loads in flight; larger blocks spill in float64.
_step = Tuned(
    _step_kernel,
    [triton.Config({"BLOCK": 512}, num_warps=4), triton.Config({"BLOCK": 1024}, num_warps=4),
     triton.Config({"BLOCK": 1024}, num_warps=8), triton.Config({"BLOCK": 2048}, num_warps=8)],
    ["OPT", "HAS_SKIP", "HAS_S0", "HAS_S1", "HAS_S2", "NESTEROV", "DECOUPLED", "TRUST", "BIAS_CORRECTION",
     "MAXIMIZE", "HAS_WD", "GATHER"],
    interpret_config=_INTERPRET_BLOCK,
)
# The norm pass writes LAMB's moments, so it cannot be timed on live tensors: one config.
_norms = Tuned(_norms_kernel, [triton.Config({"BLOCK": 1024}, num_warps=4)], [],
               interpret_config=_INTERPRET_BLOCK)
_count = Tuned(_count_kernel, [triton.Config({"BLOCK": 256}, num_warps=4)], [],
               interpret_config=triton.Config({"BLOCK": 64}))
# Read-only (it writes only its own scratch partials), so it may be timed on live gradients.
_nonfinite_tiles = Tuned(
    _nonfinite_tiles_kernel,
    [triton.Config({"BLOCK": 2048}, num_warps=4), triton.Config({"BLOCK": 4096}, num_warps=8)],
    [], interpret_config=_INTERPRET_BLOCK,
)
_nonfinite_reduce = Tuned(_nonfinite_reduce_kernel, [triton.Config({"BLOCK": 256}, num_warps=4)], [],
                          interpret_config=triton.Config({"BLOCK": 16}))


def _chunk(total: int, device: torch.device) -> int:
    """Elements per tile: about 64 tiles per SM, within [4096, 65536] (a multiple of
    the largest block), so big arrays run many short waves and the last is cheap."""
    if interpreting():
        return 64  # small, so small test tensors span several tiles
    return min(65536, max(4096, triton.next_power_of_2(max(1, total // (sm_count(device) * 64)))))


# ---- tile tables (hfkern/_multi_tensor.py) -------------------------------------------

_planner = mt.Planner("triton", _chunk)
_plans = _planner.plans
_plan = _planner.plan
# Tables of the scratch tensors configs are timed on: apart, so that they never evict
# (or count as) a live call's.
_scratch_planner = mt.Planner("triton", _chunk)

_dummies: dict[tuple[torch.device, torch.dtype], Tensor] = {}


def _dummy(device: torch.device, dtype: torch.dtype) -> Tensor:
    """A one-element tensor for a pointer argument the kernel variant never reads."""
    key = (device, dtype)
    t = _dummies.get(key)
    if t is None:
        t = _dummies[key] = torch.zeros(1, dtype=dtype, device=device)
    return t


def _traced(t: Tensor) -> bool:
    return mt.traced(t, "triton")


# ---- launch -----------------------------------------------------------------------------

# Kernel variant (constexprs, argument dtypes) -> the config timed for it on scratch tensors.
_best: dict[tuple, triton.Config] = {}
# Elements of each scratch tensor a kernel variant is timed on: well past L2, like a real array.
_SCRATCH_ELEMS = 1 << 23
# The constexprs of the norm pass (a subset of the update's).
_NORMS_META = ("OPT", "BIAS_CORRECTION", "MAXIMIZE", "HAS_WD", "HAS_SKIP", "F64", "H64", "GATHER", "VEC_P",
               "VEC_S")


def _run(spec: OptimizerSpec, args: Sequence[Any]) -> None:
    """One step of ``spec``'s op; ``args`` in the op's argument order (``spec.args``)."""
    params = args[0]
    if not params or _traced(params[0]):
        return
    device = params[0].device
    if device.type == "cuda" and device.index is not None and device.index != torch.cuda.current_device():
        # Triton launches on the current device.
        with torch.cuda.device(device):
            return _run(spec, args)
    if spec not in TRUST_RATIO_SPECS:
        return _launch(spec, args, trust=False)
    for sub, trust in trust_subsets(spec, args):
        _launch(spec, sub, trust=trust)


def _launch(spec: OptimizerSpec, args: Sequence[Any], trust: bool) -> None:
    """Launch the kernels of one step; with ``trust`` the norm pass first (a trust-ratio
    optimizer's adapted parameters), without it a trust-ratio optimizer's parameters are
    excluded ones (ratio 1, no weight decay)."""
    n = len(spec.states)
    params, grads = args[0], args[1]
    device = params[0].device
    absent = _N_STATES - n
    states = [*args[2 : 2 + n], *([[]] * absent)]
    names = [*spec.state_args, *(["unused"] * absent)]
    steps, hypers, skip = args[2 + n], args[3 + n], args[-1]
    flags = dict(zip(spec.flags, args[4 + n : -1]))
    plan, addrs, grads = _plan(params, grads, states, names, steps)
    skip_arg = skip if skip is not None else _dummy(device, torch.bool)
    if plan.step_offs is not None and plan.n_steps:
        n_steps = plan.n_steps
        counted_by = spec.counted_by
        _count[lambda meta: (triton.cdiv(n_steps, meta["BLOCK"]),)](
            steps[0], addrs, plan.step_offs, skip_arg, hypers, hypers.stride(0), hypers.stride(1), n_steps,
            params[0].size(0), HAS_SKIP=skip is not None,
            COUNTED_BY=spec.row(counted_by) if counted_by else -1,
        )
    # Every group's step counts are offsets from steps[0] (the address table's ADDR_STEP).
    step_base = steps[0] if steps else _dummy(device, torch.float32)
    for group in plan.groups:
        if group.n_tiles == 0:
            continue
        first = group.index[0]
        bases = [params[first], grads[first]] + [s[first] if s else params[first] for s in states]
        gathers = group.gathers if group.gathers is not None else _dummy(device, torch.int64)
        kernel_args = (group.tiles, addrs, gathers, *bases, step_base, hypers, hypers.stride(0), hypers.stride(1),
                       skip_arg)
        f64 = group.dtype == torch.float64
        meta = dict(
            OPT=spec.name, HAS_S0=bool(states[0]), HAS_S1=bool(states[1]), HAS_S2=bool(states[2]),
            NESTEROV=bool(flags.get("nesterov", False)),
            DECOUPLED=bool(flags.get("decoupled_weight_decay", False)),
            TRUST=trust, BIAS_CORRECTION=bool(flags.get("bias_correction", False)),
            MAXIMIZE=bool(flags["maximize"]),
            # an excluded parameter of a trust-ratio optimizer gets no weight decay
            HAS_WD=bool(flags["has_weight_decay"]) and (trust or spec not in TRUST_RATIO_SPECS),
            HAS_SKIP=skip is not None, F64=f64, H64=hypers.dtype == torch.float64,
            GATHER=group.gathers is not None,
            VEC_P=_ALIGN_BYTES // params[first].element_size(),
            VEC_S=_ALIGN_BYTES // (8 if f64 else 4),  # state: float64 or float32
        )
        if trust:
            part = torch.empty(group.n_tiles * 2, dtype=torch.float64 if f64 else torch.float32, device=device)
            _norms[(group.n_tiles,)](
                *kernel_args, part, **{k: v for k, v in meta.items() if k in _NORMS_META},
            )
        else:
            part = _dummy(device, torch.float32)
        kernel_args = (*kernel_args, part)
        if interpreting():
            _step[(group.n_tiles,)](*kernel_args, **meta)
            continue
        key = (tuple(sorted(meta.items())), tuple(a.dtype for a in kernel_args if isinstance(a, Tensor)))
        config = _best.get(key)
        if config is None:
            config = _best[key] = _tune_on_scratch(kernel_args, hypers, meta)
        # The plain kernel with the timed config: the autotuner never sees live tensors.
        _step.kernel[(group.n_tiles,)](*kernel_args, **meta, **config.all_kwargs())


def _tune_on_scratch(args: Sequence[Any], hypers: Tensor, meta: dict[str, Any]) -> triton.Config:
    """Time the block sizes of a kernel variant (``args``, ``meta``: a live launch's) on
    scratch tensors with the live call's dtypes and return the fastest config (the
    first one under the interpreter or with HFKERN_TRITON_AUTOTUNE=0)."""
    if not interpreting() and not autotuning():
        return _step.configs[0]
    p, g = args[3], args[4]
    B = hypers.size(1)
    n = max(int(_LEN_ALIGN), _SCRATCH_ELEMS // B // int(_LEN_ALIGN) * int(_LEN_ALIGN))

    def scratch(like: Tensor) -> Tensor:
        return torch.rand(B, n, device=like.device).to(like.dtype)

    sp, sg = scratch(p), scratch(g)
    states = [[scratch(args[5 + j])] if meta[f"HAS_S{j}"] else [] for j in range(_N_STATES)]
    steps = [torch.ones(B, device=p.device)]
    plan, addrs, _ = _scratch_planner.plan([sp], [sg], states, ["scratch"] * _N_STATES, steps)
    (group,) = plan.groups
    # Every model live (same dtype as the live mask: the autotuner's key), so all tiles do work.
    s_skip = torch.zeros(B, dtype=torch.bool, device=p.device)
    # Zero partials: with TRUST every ratio is then 1 (the timing does not depend on it).
    s_part = torch.zeros(group.n_tiles * 2, dtype=torch.float64 if meta["F64"] else torch.float32,
                         device=p.device)
    # A scratch gradient is laid out like its parameter: the gather rows are the live call's.
    s_args = (group.tiles, addrs, args[2], sp, sg, *(s[0] if s else sp for s in states), steps[0], hypers,
              hypers.stride(0), hypers.stride(1), s_skip, s_part)
    if interpreting():
        _step[(group.n_tiles,)](*s_args, **meta)
        return _step.interpret_config
    _step.tuned[(group.n_tiles,)](*s_args, **meta)  # eager on scratch tensors: no tracing wrapper
    return _step.tuned.best_config


# ---- launchers --------------------------------------------------------------------------

def _launcher(spec: OptimizerSpec, *, auto: bool) -> Callable[..., None]:
    """The Triton implementation of ``spec``'s op, registered: the op's arguments, in its order."""
    signature = inspect.Signature(
        [inspect.Parameter(name, inspect.Parameter.POSITIONAL_OR_KEYWORD) for name in spec.args]
    )

    def launch(*args: Any, **kwargs: Any) -> None:
        _run(spec, signature.bind(*args, **kwargs).args if kwargs else args)

    launch.__name__ = launch.__qualname__ = spec.op
    launch.__doc__ = f"hfkern::{spec.op} on CUDA tensors with the multi-tensor step kernel."
    launch.__signature__ = signature  # type: ignore[attr-defined]
    return _backend.implements(spec.op, "triton", device_types=("cuda",), auto=auto)(launch)


# auto picks a Triton kernel only where a committed GPU benchmark shows it faster:
# the SGD and Adam/AdamW steps are, on an H100, 2.8-4.5x the torch path for B
# ResNet-18 models, B = 4, 16, 32 (bench/results/h100_2026-11-22/). Adagrad,
# Adadelta, RMSprop and the non-finite check have not been benchmarked yet.
sgd_step_ = _launcher(SGD_SPEC, auto=True)
adam_step_ = _launcher(ADAM_SPEC, auto=True)
adagrad_step_ = _launcher(ADAGRAD_SPEC, auto=False)
adadelta_step_ = _launcher(ADADELTA_SPEC, auto=False)
rmsprop_step_ = _launcher(RMSPROP_SPEC, auto=False)
lars_step_ = _launcher(LARS_SPEC, auto=False)
lamb_step_ = _launcher(LAMB_SPEC, auto=False)


# ---- non-finite check ----------------------------------------------------------------

@_backend.implements("nonfinite_models", "triton", device_types=("cuda",), auto=False)
def nonfinite_models(grads: list[Tensor]) -> Tensor:
    """hfkern::nonfinite_models on CUDA tensors: per-tile flags, then one reduction per model."""
    g0 = grads[0]
    B = g0.size(0)
    if _traced(g0):
        return g0.new_empty((B,), dtype=torch.bool)
    if g0.is_cuda and g0.device.index != torch.cuda.current_device():
        with torch.cuda.device(g0.device):
            return nonfinite_models(grads)
    plan, addrs, grads = _planner.check(grads)
    out = torch.empty(B, dtype=torch.bool, device=g0.device)
    for index, tiles, n_tiles in plan.groups:
        g = grads[index[0]]
        _nonfinite_tiles[(n_tiles,)](tiles, addrs, g, plan.partials, F64=g.dtype == torch.float64,
                                     VEC=_ALIGN_BYTES // g.element_size())
    if B:
        _nonfinite_reduce[(B,)](plan.partials, out, plan.tm)
    return out
