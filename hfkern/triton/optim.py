"""Multi-tensor optimizer steps: one launch updates every parameter of every model.

Each launcher implements the hfkern op of the same name (hfkern/ops/optim.py
documents the arguments and the math; hfkern/ops/optim_torch.py is the oracle
whose operation order the kernels follow).

Tiles
-----
A step op gets n parameters ``[B, *shape_i]`` with gradients and state of the
same shape. Model b's slice of tensor i is ``n_i = numel / B`` consecutive
elements (tensors are dense with the array dim outermost in memory, and every
list shares its parameter's element order). The launcher cuts every slice into
tiles of at most ``CHUNK`` elements and keeps, per tile, one row of a small
int64 device table (``_COLS``): the element offset of the tile's first element
in the parameter, the gradient and each state list, the offset of the step
count ``steps[i][b]``, the model b, the tile's length and whether the tile is
16-byte aligned in every list. Offsets are counted from the *first* tensor of
each list, which the kernel receives as an ordinary typed pointer, so every
other tensor is plain pointer arithmetic from it. One program handles one tile:
it reads model b's hyperparameters ``hypers[:, b]`` and step count, computes in
float32 (float64 for float64 parameters) and writes parameter and state in
place. Aligned tiles take a copy of the loop with divisibility hints, so loads
and stores are 16-byte vectors; the rest (small tensors of odd size) take the
scalar copy.

The table depends only on the tensors' addresses and layouts, so it is built
once per distinct set of tensors and cached (a training loop hits the cache at
every step); a cached step costs one dict lookup, the step-count launch and one
launch per parameter dtype (parameters are grouped by dtype, each group
addressed from its own first tensors).

Step counts
-----------
``steps[i][b]`` is incremented exactly once per (tensor, model) by
``_count_kernel``, launched before the update; the update kernels then read the
incremented count (every program of a (tensor, model) reads the same value, and
nothing writes it during the update), as the torch path does.

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

import collections
import operator
from dataclasses import dataclass
from typing import Sequence

import torch
import triton
import triton.language as tl
from torch import Tensor
from torch._subclasses.fake_tensor import is_fake
from torch._subclasses.functional_tensor import FunctionalTensor

from ._common import Tuned, autotuning, interpreting

__all__ = [
    "sgd_step_", "adam_step_", "adagrad_step_", "adadelta_step_", "rmsprop_step_",
    "nonfinite_models",
]

# Columns of a tile row.
_OP, _OG, _OS1, _OS2, _OS3, _OSTEP, _MODEL, _LEN, _ALIGNED = range(9)
_COLS = 9
# Columns of a non-finite check tile row.
_NF_OG, _NF_PART, _NF_LEN, _NF_ALIGNED = range(4)
_NF_COLS = 4

_ALIGN_BYTES = 16
# Alignment of a tile's length (elements): keeps masks constant over a whole
# 16-byte vector for every element size.
_LEN_ALIGN = 16
_MAX_CACHED = 16

_FLOAT_PARAMS = (torch.float32, torch.float64, torch.bfloat16, torch.float16)


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
def _offset(row, COL: tl.constexpr, VEC: tl.constexpr, ALIGNED: tl.constexpr):
    # Loaded here, once per loop copy, so the hint sits on this copy's load only.
    o = tl.load(row + COL)
    if ALIGNED:
        o = tl.multiple_of(o, VEC)
    return o


@triton.jit
def _length(row, live, ALIGNED: tl.constexpr):
    """The tile's length, 0 for a skipped model (its loop then runs zero times)."""
    n = tl.where(live, tl.load(row + 7), 0)  # 7: _LEN
    if ALIGNED:
        n = tl.multiple_of(n, 16)
    return n


@triton.jit
def _prologue(tiles_ptr, skip_ptr, HAS_SKIP: tl.constexpr):
    row = tiles_ptr + tl.program_id(0).to(tl.int64) * 9  # 9: _COLS
    b = tl.load(row + 6)  # 6: _MODEL
    if HAS_SKIP:
        live = tl.load(skip_ptr + b) == 0
    else:
        live = b >= 0
    aligned = tl.load(row + 8)  # 8: _ALIGNED
    return row, b, live, aligned


@triton.jit
def _direction(g, p, wd, MAXIMIZE: tl.constexpr, WD: tl.constexpr, F64: tl.constexpr):
    d = _math(g, F64)
    if MAXIMIZE:
        d = -d
    if WD:
        d = d + p * wd
    return d


# ---- SGD -----------------------------------------------------------------------

@triton.jit
def _sgd_tile(
    row, live, p_ptr, g_ptr, buf_ptr,
    lr, momentum, decay, scale, wd,
    MOMENTUM: tl.constexpr, NESTEROV: tl.constexpr, MAXIMIZE: tl.constexpr, HAS_WD: tl.constexpr,
    F64: tl.constexpr, ALIGNED: tl.constexpr, VEC_P: tl.constexpr, VEC_S: tl.constexpr,
    BLOCK: tl.constexpr,
):
    o_p = _offset(row, 0, VEC_P, ALIGNED)
    o_g = _offset(row, 1, VEC_P, ALIGNED)
    o_b = _offset(row, 2, VEC_S, ALIGNED)
    n = _length(row, live, ALIGNED)
    for k in range(0, tl.cdiv(n, BLOCK)):
        idx = k * BLOCK + tl.arange(0, BLOCK)
        mask = idx < n
        p = _math(tl.load(p_ptr + o_p + idx, mask=mask), F64)
        g = tl.load(g_ptr + o_g + idx, mask=mask)
        d = _direction(g, p, wd, MAXIMIZE, HAS_WD, F64)
        if MOMENTUM:
            buf = tl.load(buf_ptr + o_b + idx, mask=mask)
            buf = buf * decay + d * scale
            tl.store(buf_ptr + o_b + idx, buf, mask=mask)
            if NESTEROV:
                d = d + buf * momentum
            else:
                d = buf
        p = p + d * lr
        tl.store(p_ptr + o_p + idx, p.to(p_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _sgd_kernel(
    tiles_ptr,  # [T, 9] int64 tile rows (module docstring)
    p_ptr,  # the group's first parameter [B, ...]; every parameter is an offset from it
    g_ptr,  # the group's first gradient (parameter dtype)
    buf_ptr,  # the group's first momentum buffer (state dtype)
    steps_ptr,  # the group's first step count [B] float32, already incremented
    hyp_ptr,  # [4, B]: lr, momentum, dampening, weight_decay
    stride_hr, stride_hb,
    skip_ptr,  # [B] bool
    HAS_SKIP: tl.constexpr, MOMENTUM: tl.constexpr, NESTEROV: tl.constexpr,
    MAXIMIZE: tl.constexpr, HAS_WD: tl.constexpr, F64: tl.constexpr, H64: tl.constexpr,
    VEC_P: tl.constexpr, VEC_S: tl.constexpr, BLOCK: tl.constexpr,
):
    row, b, live, aligned = _prologue(tiles_ptr, skip_ptr, HAS_SKIP)
    h = hyp_ptr + b * stride_hb
    lr = tl.load(h)
    momentum = tl.load(h + stride_hr)
    dampening = tl.load(h + 2 * stride_hr)
    wd = tl.load(h + 3 * stride_hr)
    decay = momentum
    scale = 1.0 - tl.where(momentum == 0.0, 0.0, dampening)
    if MOMENTUM:
        # A model's first update sets its buffer to the gradient, as torch's clone does.
        first = tl.load(steps_ptr + tl.load(row + 5)) == 1.0
        decay = tl.where(first, 0.0, momentum)
        scale = tl.where(first, 1.0, scale)
    lr_m = _math(-lr, F64)
    mom_m = _math(momentum, F64)
    decay_m = _math(decay, F64)
    scale_m = _math(scale, F64)
    wd_m = _math(wd, F64)
    if aligned != 0:
        _sgd_tile(row, live, p_ptr, g_ptr, buf_ptr, lr_m, mom_m, decay_m, scale_m, wd_m,
                  MOMENTUM, NESTEROV, MAXIMIZE, HAS_WD, F64, True, VEC_P, VEC_S, BLOCK)
    else:
        _sgd_tile(row, live, p_ptr, g_ptr, buf_ptr, lr_m, mom_m, decay_m, scale_m, wd_m,
                  MOMENTUM, NESTEROV, MAXIMIZE, HAS_WD, F64, False, VEC_P, VEC_S, BLOCK)


# ---- Adam / AdamW ------------------------------------------------------------------

@triton.jit
def _adam_tile(
    row, live, p_ptr, g_ptr, m_ptr, v_ptr, vmax_ptr,
    neg_step, bc2_sqrt, eps, wd, p_decay, beta2, w1, w1_small, w2,
    AMSGRAD: tl.constexpr, MAXIMIZE: tl.constexpr, COUPLED_WD: tl.constexpr,
    DECOUPLED_WD: tl.constexpr, F64: tl.constexpr, ALIGNED: tl.constexpr,
    VEC_P: tl.constexpr, VEC_S: tl.constexpr, BLOCK: tl.constexpr,
):
    o_p = _offset(row, 0, VEC_P, ALIGNED)
    o_g = _offset(row, 1, VEC_P, ALIGNED)
    o_m = _offset(row, 2, VEC_S, ALIGNED)
    o_v = _offset(row, 3, VEC_S, ALIGNED)
    o_x = _offset(row, 4, VEC_S, ALIGNED)
    n = _length(row, live, ALIGNED)
    for k in range(0, tl.cdiv(n, BLOCK)):
        idx = k * BLOCK + tl.arange(0, BLOCK)
        mask = idx < n
        p = _math(tl.load(p_ptr + o_p + idx, mask=mask), F64)
        g = tl.load(g_ptr + o_g + idx, mask=mask)
        m = tl.load(m_ptr + o_m + idx, mask=mask)
        v = tl.load(v_ptr + o_v + idx, mask=mask)
        d = _direction(g, p, wd, MAXIMIZE, COUPLED_WD, F64)
        if DECOUPLED_WD:
            p = p * p_decay
        m = _lerp(m, d, w1, w1_small)
        v = v * beta2 + (d * w2) * d
        tl.store(m_ptr + o_m + idx, m, mask=mask)
        tl.store(v_ptr + o_v + idx, v, mask=mask)
        if AMSGRAD:
            vmax = tl.load(vmax_ptr + o_x + idx, mask=mask)
            vmax = tl.maximum(vmax, v, propagate_nan=tl.PropagateNan.ALL)
            tl.store(vmax_ptr + o_x + idx, vmax, mask=mask)
            v = vmax
        denom = _div(_sqrt(v, F64), bc2_sqrt, F64) + eps
        p = p + _div(m, denom, F64) * neg_step
        tl.store(p_ptr + o_p + idx, p.to(p_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _adam_kernel(
    tiles_ptr,  # [T, 9] int64 tile rows (module docstring)
    p_ptr,  # the group's first parameter [B, ...]; every parameter is an offset from it
    g_ptr,  # the group's first gradient (parameter dtype)
    m_ptr,  # the group's first exp_avg (state dtype)
    v_ptr,  # the group's first exp_avg_sq (state dtype)
    vmax_ptr,  # the group's first max_exp_avg_sq (state dtype; unused unless AMSGRAD)
    steps_ptr,  # the group's first step count [B] float32, already incremented
    hyp_ptr,  # [5, B]: lr, beta1, beta2, eps, weight_decay
    stride_hr, stride_hb,
    skip_ptr,  # [B] bool
    HAS_SKIP: tl.constexpr, AMSGRAD: tl.constexpr, MAXIMIZE: tl.constexpr,
    DECOUPLED: tl.constexpr, HAS_WD: tl.constexpr, F64: tl.constexpr, H64: tl.constexpr,
    VEC_P: tl.constexpr, VEC_S: tl.constexpr, BLOCK: tl.constexpr,
):
    row, b, live, aligned = _prologue(tiles_ptr, skip_ptr, HAS_SKIP)
    h = hyp_ptr + b * stride_hb
    lr = tl.load(h)
    beta1 = tl.load(h + stride_hr)
    beta2 = tl.load(h + 2 * stride_hr)
    eps = tl.load(h + 3 * stride_hr)
    wd = tl.load(h + 4 * stride_hr)
    t = tl.load(steps_ptr + tl.load(row + 5))
    # Per-model scalars in the hyperparameters' dtype, as the torch path computes them.
    bc1 = _one_minus_pow(beta1, t).to(lr.dtype)
    bc2 = _one_minus_pow(beta2, t).to(lr.dtype)
    step_size = _div(lr, bc1, H64)
    bc2_sqrt = _sqrt(bc2, H64)
    w1 = 1.0 - beta1
    if aligned != 0:
        _adam_tile(row, live, p_ptr, g_ptr, m_ptr, v_ptr, vmax_ptr,
                   _math(-step_size, F64), _math(bc2_sqrt, F64), _math(eps, F64), _math(wd, F64),
                   _math(1.0 - lr * wd, F64), _math(beta2, F64), _math(w1, F64),
                   tl.abs(w1) < 0.5, _math(1.0 - beta2, F64),
                   AMSGRAD, MAXIMIZE, HAS_WD and not DECOUPLED, HAS_WD and DECOUPLED, F64,
                   True, VEC_P, VEC_S, BLOCK)
    else:
        _adam_tile(row, live, p_ptr, g_ptr, m_ptr, v_ptr, vmax_ptr,
                   _math(-step_size, F64), _math(bc2_sqrt, F64), _math(eps, F64), _math(wd, F64),
                   _math(1.0 - lr * wd, F64), _math(beta2, F64), _math(w1, F64),
                   tl.abs(w1) < 0.5, _math(1.0 - beta2, F64),
                   AMSGRAD, MAXIMIZE, HAS_WD and not DECOUPLED, HAS_WD and DECOUPLED, F64,
                   False, VEC_P, VEC_S, BLOCK)


# ---- Adagrad ---------------------------------------------------------------------

@triton.jit
def _adagrad_tile(
    row, live, p_ptr, g_ptr, sum_ptr,
    neg_clr, eps, wd,
    MAXIMIZE: tl.constexpr, HAS_WD: tl.constexpr, F64: tl.constexpr, ALIGNED: tl.constexpr,
    VEC_P: tl.constexpr, VEC_S: tl.constexpr, BLOCK: tl.constexpr,
):
    o_p = _offset(row, 0, VEC_P, ALIGNED)
    o_g = _offset(row, 1, VEC_P, ALIGNED)
    o_s = _offset(row, 2, VEC_S, ALIGNED)
    n = _length(row, live, ALIGNED)
    for k in range(0, tl.cdiv(n, BLOCK)):
        idx = k * BLOCK + tl.arange(0, BLOCK)
        mask = idx < n
        p = _math(tl.load(p_ptr + o_p + idx, mask=mask), F64)
        g = tl.load(g_ptr + o_g + idx, mask=mask)
        s = tl.load(sum_ptr + o_s + idx, mask=mask)
        d = _direction(g, p, wd, MAXIMIZE, HAS_WD, F64)
        s = s + d * d
        tl.store(sum_ptr + o_s + idx, s, mask=mask)
        p = p + _div(d, _sqrt(s, F64) + eps, F64) * neg_clr
        tl.store(p_ptr + o_p + idx, p.to(p_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _adagrad_kernel(
    tiles_ptr,  # [T, 9] int64 tile rows (module docstring)
    p_ptr,  # the group's first parameter [B, ...]; every parameter is an offset from it
    g_ptr,  # the group's first gradient (parameter dtype)
    sum_ptr,  # the group's first state_sum (state dtype)
    steps_ptr,  # the group's first step count [B] float32, already incremented
    hyp_ptr,  # [4, B]: lr, lr_decay, weight_decay, eps
    stride_hr, stride_hb,
    skip_ptr,  # [B] bool
    HAS_SKIP: tl.constexpr, MAXIMIZE: tl.constexpr, HAS_WD: tl.constexpr,
    F64: tl.constexpr, H64: tl.constexpr,
    VEC_P: tl.constexpr, VEC_S: tl.constexpr, BLOCK: tl.constexpr,
):
    row, b, live, aligned = _prologue(tiles_ptr, skip_ptr, HAS_SKIP)
    h = hyp_ptr + b * stride_hb
    lr = tl.load(h)
    lr_decay = tl.load(h + stride_hr)
    wd = tl.load(h + 2 * stride_hr)
    eps = tl.load(h + 3 * stride_hr)
    t = tl.load(steps_ptr + tl.load(row + 5)).to(lr.dtype)
    clr = _div(lr, 1.0 + (t - 1.0) * lr_decay, H64)
    if aligned != 0:
        _adagrad_tile(row, live, p_ptr, g_ptr, sum_ptr, _math(-clr, F64), _math(eps, F64),
                      _math(wd, F64), MAXIMIZE, HAS_WD, F64, True, VEC_P, VEC_S, BLOCK)
    else:
        _adagrad_tile(row, live, p_ptr, g_ptr, sum_ptr, _math(-clr, F64), _math(eps, F64),
                      _math(wd, F64), MAXIMIZE, HAS_WD, F64, False, VEC_P, VEC_S, BLOCK)


# ---- Adadelta --------------------------------------------------------------------

@triton.jit
def _adadelta_tile(
    row, live, p_ptr, g_ptr, sq_ptr, acc_ptr,
    neg_lr, rho, w, eps, wd,
    MAXIMIZE: tl.constexpr, HAS_WD: tl.constexpr, F64: tl.constexpr, ALIGNED: tl.constexpr,
    VEC_P: tl.constexpr, VEC_S: tl.constexpr, BLOCK: tl.constexpr,
):
    o_p = _offset(row, 0, VEC_P, ALIGNED)
    o_g = _offset(row, 1, VEC_P, ALIGNED)
    o_q = _offset(row, 2, VEC_S, ALIGNED)
    o_a = _offset(row, 3, VEC_S, ALIGNED)
    n = _length(row, live, ALIGNED)
    for k in range(0, tl.cdiv(n, BLOCK)):
        idx = k * BLOCK + tl.arange(0, BLOCK)
        mask = idx < n
        p = _math(tl.load(p_ptr + o_p + idx, mask=mask), F64)
        g = tl.load(g_ptr + o_g + idx, mask=mask)
        sq = tl.load(sq_ptr + o_q + idx, mask=mask)
        acc = tl.load(acc_ptr + o_a + idx, mask=mask)
        d = _direction(g, p, wd, MAXIMIZE, HAS_WD, F64)
        sq = sq * rho + (d * w) * d
        std = _sqrt(sq + eps, F64)
        delta = _div(_sqrt(acc + eps, F64), std, F64) * d
        acc = acc * rho + (delta * w) * delta
        tl.store(sq_ptr + o_q + idx, sq, mask=mask)
        tl.store(acc_ptr + o_a + idx, acc, mask=mask)
        p = p + delta * neg_lr
        tl.store(p_ptr + o_p + idx, p.to(p_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _adadelta_kernel(
    tiles_ptr,  # [T, 9] int64 tile rows (module docstring)
    p_ptr,  # the group's first parameter [B, ...]; every parameter is an offset from it
    g_ptr,  # the group's first gradient (parameter dtype)
    sq_ptr,  # the group's first square_avg (state dtype)
    acc_ptr,  # the group's first acc_delta (state dtype)
    hyp_ptr,  # [4, B]: lr, rho, eps, weight_decay
    stride_hr, stride_hb,
    skip_ptr,  # [B] bool
    HAS_SKIP: tl.constexpr, MAXIMIZE: tl.constexpr, HAS_WD: tl.constexpr,
    F64: tl.constexpr, H64: tl.constexpr,
    VEC_P: tl.constexpr, VEC_S: tl.constexpr, BLOCK: tl.constexpr,
):
    row, b, live, aligned = _prologue(tiles_ptr, skip_ptr, HAS_SKIP)
    h = hyp_ptr + b * stride_hb
    lr = tl.load(h)
    rho = tl.load(h + stride_hr)
    eps = tl.load(h + 2 * stride_hr)
    wd = tl.load(h + 3 * stride_hr)
    if aligned != 0:
        _adadelta_tile(row, live, p_ptr, g_ptr, sq_ptr, acc_ptr, _math(-lr, F64), _math(rho, F64),
                       _math(1.0 - rho, F64), _math(eps, F64), _math(wd, F64),
                       MAXIMIZE, HAS_WD, F64, True, VEC_P, VEC_S, BLOCK)
    else:
        _adadelta_tile(row, live, p_ptr, g_ptr, sq_ptr, acc_ptr, _math(-lr, F64), _math(rho, F64),
                       _math(1.0 - rho, F64), _math(eps, F64), _math(wd, F64),
                       MAXIMIZE, HAS_WD, F64, False, VEC_P, VEC_S, BLOCK)


# ---- RMSprop ---------------------------------------------------------------------

@triton.jit
def _rmsprop_tile(
    row, live, p_ptr, g_ptr, sq_ptr, gavg_ptr, buf_ptr,
    neg_lr, alpha, w, w_small, eps, wd, momentum,
    CENTERED: tl.constexpr, MOMENTUM: tl.constexpr, MAXIMIZE: tl.constexpr,
    HAS_WD: tl.constexpr, F64: tl.constexpr, ALIGNED: tl.constexpr,
    VEC_P: tl.constexpr, VEC_S: tl.constexpr, BLOCK: tl.constexpr,
):
    o_p = _offset(row, 0, VEC_P, ALIGNED)
    o_g = _offset(row, 1, VEC_P, ALIGNED)
    o_q = _offset(row, 2, VEC_S, ALIGNED)
    o_a = _offset(row, 3, VEC_S, ALIGNED)
    o_b = _offset(row, 4, VEC_S, ALIGNED)
    n = _length(row, live, ALIGNED)
    for k in range(0, tl.cdiv(n, BLOCK)):
        idx = k * BLOCK + tl.arange(0, BLOCK)
        mask = idx < n
        p = _math(tl.load(p_ptr + o_p + idx, mask=mask), F64)
        g = tl.load(g_ptr + o_g + idx, mask=mask)
        sq = tl.load(sq_ptr + o_q + idx, mask=mask)
        d = _direction(g, p, wd, MAXIMIZE, HAS_WD, F64)
        sq = sq * alpha + (d * w) * d
        tl.store(sq_ptr + o_q + idx, sq, mask=mask)
        if CENTERED:
            gavg = tl.load(gavg_ptr + o_a + idx, mask=mask)
            gavg = _lerp(gavg, d, w, w_small)
            tl.store(gavg_ptr + o_a + idx, gavg, mask=mask)
            avg = _sqrt(sq - gavg * gavg, F64) + eps
        else:
            avg = _sqrt(sq, F64) + eps
        if MOMENTUM:
            buf = tl.load(buf_ptr + o_b + idx, mask=mask)
            buf = buf * momentum + _div(d, avg, F64)
            tl.store(buf_ptr + o_b + idx, buf, mask=mask)
            update = buf
        else:
            update = _div(d, avg, F64)
        p = p + update * neg_lr
        tl.store(p_ptr + o_p + idx, p.to(p_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _rmsprop_kernel(
    tiles_ptr,  # [T, 9] int64 tile rows (module docstring)
    p_ptr,  # the group's first parameter [B, ...]; every parameter is an offset from it
    g_ptr,  # the group's first gradient (parameter dtype)
    sq_ptr,  # the group's first square_avg (state dtype)
    gavg_ptr,  # the group's first grad_avg (state dtype; unused unless CENTERED)
    buf_ptr,  # the group's first momentum buffer (state dtype; unused unless MOMENTUM)
    hyp_ptr,  # [5, B]: lr, alpha, eps, weight_decay, momentum
    stride_hr, stride_hb,
    skip_ptr,  # [B] bool
    HAS_SKIP: tl.constexpr, CENTERED: tl.constexpr, MOMENTUM: tl.constexpr,
    MAXIMIZE: tl.constexpr, HAS_WD: tl.constexpr, F64: tl.constexpr, H64: tl.constexpr,
    VEC_P: tl.constexpr, VEC_S: tl.constexpr, BLOCK: tl.constexpr,
):
    row, b, live, aligned = _prologue(tiles_ptr, skip_ptr, HAS_SKIP)
    h = hyp_ptr + b * stride_hb
    lr = tl.load(h)
    alpha = tl.load(h + stride_hr)
    eps = tl.load(h + 2 * stride_hr)
    wd = tl.load(h + 3 * stride_hr)
    momentum = tl.load(h + 4 * stride_hr)
    w = 1.0 - alpha
    if aligned != 0:
        _rmsprop_tile(row, live, p_ptr, g_ptr, sq_ptr, gavg_ptr, buf_ptr, _math(-lr, F64),
                      _math(alpha, F64), _math(w, F64), tl.abs(w) < 0.5, _math(eps, F64),
                      _math(wd, F64), _math(momentum, F64),
                      CENTERED, MOMENTUM, MAXIMIZE, HAS_WD, F64, True, VEC_P, VEC_S, BLOCK)
    else:
        _rmsprop_tile(row, live, p_ptr, g_ptr, sq_ptr, gavg_ptr, buf_ptr, _math(-lr, F64),
                      _math(alpha, F64), _math(w, F64), tl.abs(w) < 0.5, _math(eps, F64),
                      _math(wd, F64), _math(momentum, F64),
                      CENTERED, MOMENTUM, MAXIMIZE, HAS_WD, F64, False, VEC_P, VEC_S, BLOCK)


# ---- step counts -----------------------------------------------------------------

@triton.jit
def _count_kernel(
    steps_ptr,  # steps[0]: [B] float32; every step count of the call is an offset from it
    offs_ptr,  # [n * B] int64: element offset of steps[i][b] at i * B + b
    skip_ptr,  # [B] bool
    NB, B,
    HAS_SKIP: tl.constexpr, BLOCK: tl.constexpr,
):
    k = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = k < NB
    if HAS_SKIP:
        mask = mask & (tl.load(skip_ptr + k % B, mask=mask, other=1) == 0)
    off = tl.load(offs_ptr + k, mask=mask, other=0)
    t = tl.load(steps_ptr + off, mask=mask)
    tl.store(steps_ptr + off, t + 1.0, mask=mask)


# ---- non-finite check ----------------------------------------------------------------

@triton.jit
def _nonfinite_tile(row, g_ptr, ALIGNED: tl.constexpr, F64: tl.constexpr, VEC: tl.constexpr,
                    BLOCK: tl.constexpr):
    o = _offset(row, 0, VEC, ALIGNED)
    n = tl.load(row + 2)  # 2: _NF_LEN
    if ALIGNED:
        n = tl.multiple_of(n, 16)
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
    tiles_ptr,  # [T, 4] int64: gradient offset, partial index, length, aligned
    g_ptr,  # the group's first gradient; every gradient is an offset from it
    part_ptr,  # [B, Tm] int32 per-tile flags
    F64: tl.constexpr, VEC: tl.constexpr, BLOCK: tl.constexpr,
):
    row = tiles_ptr + tl.program_id(0).to(tl.int64) * 4  # 4: _NF_COLS
    if tl.load(row + 3) != 0:
        bad = _nonfinite_tile(row, g_ptr, True, F64, VEC, BLOCK)
    else:
        bad = _nonfinite_tile(row, g_ptr, False, F64, VEC, BLOCK)
    tl.store(part_ptr + tl.load(row + 1), bad)


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

def _step_configs() -> list[triton.Config]:
    # 4 or 8 elements per thread: 16-byte vectors at 64-160 registers (sm_90), so
    # several programs per SM keep enough loads in flight; larger blocks spill in float64.
    return [
        triton.Config({"BLOCK": 512}, num_warps=4),
        triton.Config({"BLOCK": 1024}, num_warps=4),
        triton.Config({"BLOCK": 1024}, num_warps=8),
        triton.Config({"BLOCK": 2048}, num_warps=8),
    ]


_INTERPRET_BLOCK = triton.Config({"BLOCK": 32})
_FLAG_KEYS = {
    "sgd": ["HAS_SKIP", "MOMENTUM", "NESTEROV", "MAXIMIZE", "HAS_WD"],
    "adam": ["HAS_SKIP", "AMSGRAD", "MAXIMIZE", "DECOUPLED", "HAS_WD"],
    "adagrad": ["HAS_SKIP", "MAXIMIZE", "HAS_WD"],
    "adadelta": ["HAS_SKIP", "MAXIMIZE", "HAS_WD"],
    "rmsprop": ["HAS_SKIP", "CENTERED", "MOMENTUM", "MAXIMIZE", "HAS_WD"],
}
_KERNELS = {
    name: Tuned(kernel, _step_configs(), _FLAG_KEYS[name], interpret_config=_INTERPRET_BLOCK)
    for name, kernel in (("sgd", _sgd_kernel), ("adam", _adam_kernel), ("adagrad", _adagrad_kernel),
                         ("adadelta", _adadelta_kernel), ("rmsprop", _rmsprop_kernel))
}
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

_sm_counts: dict[int, int] = {}


def _chunk(total: int, device: torch.device) -> int:
    """Elements per tile: about 64 tiles per SM, within [4096, 65536] (a multiple of
    the largest block), so big arrays run many short waves and the last is cheap."""
    if interpreting():
        return 64  # small, so small test tensors span several tiles
    idx = device.index if device.index is not None else torch.cuda.current_device()
    sms = _sm_counts.get(idx)
    if sms is None:
        sms = _sm_counts[idx] = torch.cuda.get_device_properties(idx).multi_processor_count
    return min(65536, max(4096, triton.next_power_of_2(max(1, total // (sms * 64)))))


# ---- tile tables ------------------------------------------------------------------------------

def _model_major(t: Tensor) -> bool:
    """Dense, with each model's slice one contiguous run of memory."""
    if t.is_contiguous():
        return True
    B = t.size(0)
    if B > 1 and t.numel() and t.stride(0) != t.numel() // B:
        return False
    expected = 1
    for stride, size in sorted((st, sz) for st, sz in zip(t.stride()[1:], t.shape[1:]) if sz != 1):
        if stride != expected:
            return False
        expected *= size
    return True


def _order(t: Tensor) -> tuple[int, ...]:
    """The strides that fix the element order (those of dims longer than 1)."""
    return tuple(st for st, sz in zip(t.stride(), t.shape) if sz != 1)


_data_ptr = Tensor.data_ptr
_is_contiguous = Tensor.is_contiguous
_shape_dtype = operator.attrgetter("shape", "dtype")


def _sig(tensors: Sequence[Tensor]):
    """What a tile table depends on in ``tensors``: addresses, and the layout where not
    contiguous (built from C-level calls: this runs at every step)."""
    ptrs = tuple(map(_data_ptr, tensors))
    if all(map(_is_contiguous, tensors)):
        return ptrs
    return ptrs, tuple(t.stride() for t in tensors)


@dataclass
class _Group:
    index: list[int]  # positions of this dtype's parameters in the call's lists; [0] is the base
    tiles: Tensor  # [T, _COLS] int64 on the device
    n_tiles: int
    dtype: torch.dtype


@dataclass
class _Plan:
    groups: list[_Group]
    step_offs: Tensor | None  # [n * B] int64 on the device, or None without step counts
    n_steps: int


_plans: collections.OrderedDict = collections.OrderedDict()


def _remember(cache: collections.OrderedDict, key, value) -> None:
    cache[key] = value
    if len(cache) > _MAX_CACHED:
        cache.popitem(last=False)


def _offsets(tensors: Sequence[Tensor], base: Tensor, name: str) -> list[int]:
    es = base.element_size()
    out = []
    for i, t in enumerate(tensors):
        diff = t.data_ptr() - base.data_ptr()
        if diff % es:
            raise ValueError(
                f"{name}[{i}] is not aligned to its element size ({es} bytes) relative to "
                f"{name}'s first tensor; the triton backend addresses tensors of one list from one base"
            )
        out.append(diff // es)
    return out


def _build_tiles(
    lists: Sequence[Sequence[Tensor]], names: Sequence[str], steps: Sequence[Tensor] | None,
    B: int, chunk: int, n_cols: int, part: tuple[int, int] | None = None,
) -> Tensor:
    """Model-major CPU table of every (tensor, model, chunk) tile of the tensors in ``lists``
    (every list the same length, tensor i of every list the same shape and element order).

    Columns 0..len(lists)-1: element offsets from each list's first tensor. With
    ``steps``: the step count's offset from steps[0] (its column and the model's
    follow). With ``part`` = (Tm, first column): the tile's partial index instead.
    """
    bases = [lst[0] for lst in lists]
    offs = [_offsets(lst, base, name) for lst, base, name in zip(lists, bases, names)]
    base_aligned = all(b.data_ptr() % _ALIGN_BYTES == 0 for b in bases)
    step_offs = _offsets(steps, steps[0], "steps") if steps else None
    per_model: list[list[Tensor]] = [[] for _ in range(B)]
    col = part[1] if part else 0
    for i in range(len(lists[0])):
        n = lists[0][i].numel() // B if B else 0
        if n == 0:
            continue
        nch = triton.cdiv(n, chunk)
        starts = torch.arange(nch, dtype=torch.int64) * chunk
        lens = torch.clamp(n - starts, max=chunk)
        aligned = int(
            base_aligned and n % _LEN_ALIGN == 0
            and all(lst[i].data_ptr() % _ALIGN_BYTES == 0 for lst in lists)
        )
        for b in range(B):
            rows = torch.zeros(nch, n_cols, dtype=torch.int64)
            for j, o in enumerate(offs):
                rows[:, j] = o[i] + b * n + starts
            if part is not None:
                rows[:, _NF_PART] = b * part[0] + col + torch.arange(nch)
                rows[:, _NF_LEN] = lens
                rows[:, _NF_ALIGNED] = aligned
            else:
                if step_offs is not None:
                    rows[:, _OSTEP] = step_offs[i] + b * steps[i].stride(0)
                rows[:, _MODEL] = b
                rows[:, _LEN] = lens
                rows[:, _ALIGNED] = aligned
            per_model[b].append(rows)
        col += nch
    flat = [r for rows in per_model for r in rows]
    return torch.cat(flat) if flat else torch.zeros(0, n_cols, dtype=torch.int64)


def _check_layouts(params, grads, states, names) -> None:
    device = params[0].device
    for i, p in enumerate(params):
        if not _model_major(p):
            raise ValueError(
                f"the triton backend needs every parameter dense with each model's slice contiguous "
                f"(array dim outermost in memory); params[{i}] of shape {list(p.shape)} has strides "
                f"{list(p.stride())}"
            )
        for name, lst in zip(names, states):
            t = lst[i]
            if t.device != device:
                raise ValueError(f"expected {name}[{i}] on {device}, got {t.device}")
            if t.shape != p.shape or _order(t) != _order(p) or not _model_major(t):
                raise ValueError(
                    f"the triton backend needs {name}[{i}] laid out like params[{i}] "
                    f"(shape {list(p.shape)}, strides {list(p.stride())}), got shape {list(t.shape)}, "
                    f"strides {list(t.stride())}"
                )
        if grads[i].device != device:
            raise ValueError(f"expected grads[{i}] on {device}, got {grads[i].device}")


def _conform_grads(params: Sequence[Tensor], grads: Sequence[Tensor]) -> list[Tensor]:
    """``grads``, with any gradient laid out unlike its parameter copied into the parameter's layout
    (read only, so a copy is exact)."""
    out = list(grads)
    for i, (p, g) in enumerate(zip(params, grads)):
        if g.shape != p.shape or g.dtype != p.dtype:
            raise ValueError(
                f"expected grads[{i}] of shape {list(p.shape)} and dtype {p.dtype}, "
                f"got {list(g.shape)} {g.dtype}"
            )
        if _order(g) != _order(p) or not _model_major(g):
            out[i] = torch.empty_like(p).copy_(g)
    return out


def _to_device(table: Tensor, device: torch.device) -> Tensor:
    """A host-built table on ``device`` without synchronizing: a pageable host
    tensor's copy to the GPU waits for the stream, a pinned one's is queued (the
    caching host allocator keeps the pinned buffer until the copy is done)."""
    if device.type != "cuda":
        return table.to(device)
    return table.pin_memory().to(device, non_blocking=True)


def _plan(
    params: Sequence[Tensor], grads: Sequence[Tensor], states: Sequence[Sequence[Tensor]],
    names: Sequence[str], steps: Sequence[Tensor],
) -> tuple[_Plan, Sequence[Tensor]]:
    """The cached tile tables for these tensors (built on first sight), and the
    gradients to address (``grads``, unless one needed a copy into its parameter's layout).

    ``states`` holds every state list of the kernel in its column order; an
    absent (empty) list is addressed as ``params`` and never read.
    """
    key = (_sig(params), _sig(grads), tuple(map(_sig, states)), _sig(steps),
           tuple(map(_shape_dtype, params)), params[0].device)
    plan = _plans.get(key)
    if plan is not None:
        _plans.move_to_end(key)
        return plan, grads
    present = [(n, s) for n, s in zip(names, states) if s]
    _check_layouts(params, grads, [s for _, s in present], [n for n, _ in present])
    conformed = _conform_grads(params, grads)
    B = params[0].size(0)
    device = params[0].device
    if steps:
        for i, s in enumerate(steps):
            if s.shape != (B,) or s.dtype != torch.float32 or s.device != device:
                raise ValueError(
                    f"expected steps[{i}] of shape [{B}] and dtype float32 on {device}, "
                    f"got {list(s.shape)} {s.dtype} on {s.device}"
                )
    chunk = _chunk(sum(p.numel() for p in params), device)
    groups = []
    for dtype in _FLOAT_PARAMS:
        index = [i for i, p in enumerate(params) if p.dtype == dtype]
        if not index:
            continue
        full = (params, conformed, *(s if s else params for s in states))
        lists = [[lst[i] for i in index] for lst in full]
        tiles = _build_tiles(
            lists, ("params", "grads", *(n if s else "params" for n, s in zip(names, states))),
            [steps[i] for i in index] if steps else None, B, chunk, _COLS,
        )
        groups.append(_Group(index, _to_device(tiles, device), tiles.size(0), dtype))
    step_offs = None
    if steps:
        base = _offsets(steps, steps[0], "steps")
        step_offs = torch.tensor(
            [o + b * s.stride(0) for o, s in zip(base, steps) for b in range(B)], dtype=torch.int64
        )
        step_offs = _to_device(step_offs, device)
    plan = _Plan(groups, step_offs, len(steps) * B)
    if all(c is g for c, g in zip(conformed, grads)):
        _remember(_plans, key, plan)
    return plan, conformed


_dummies: dict[tuple[torch.device, torch.dtype], Tensor] = {}


def _dummy(device: torch.device, dtype: torch.dtype) -> Tensor:
    """A one-element tensor for a pointer argument the kernel variant never reads."""
    key = (device, dtype)
    t = _dummies.get(key)
    if t is None:
        t = _dummies[key] = torch.zeros(1, dtype=dtype, device=device)
    return t


def _traced(t: Tensor) -> bool:
    """True under FakeTensorMode (nothing to launch); raises inside functionalization."""
    if isinstance(t, FunctionalTensor):
        raise RuntimeError(
            "the triton optimizer kernels address their tensors through a device table, which a "
            "traced graph cannot follow; call the hfkern::*_step_ ops (opaque to torch.compile) instead"
        )
    return is_fake(t)


# ---- launch -----------------------------------------------------------------------------

# Kernel variant (name, constexprs, argument dtypes) -> the config timed for it on scratch tensors.
_best: dict[tuple, triton.Config] = {}
# Elements of each scratch tensor a kernel variant is timed on: well past L2, like a real array.
_SCRATCH_ELEMS = 1 << 23


def _run(
    name: str,
    params: Sequence[Tensor],
    grads: Sequence[Tensor],
    states: Sequence[Sequence[Tensor]],
    names: Sequence[str],
    steps: Sequence[Tensor],
    hypers: Tensor,
    skip: Tensor | None,
    flags: dict[str, bool],
    uses_steps: bool,
) -> None:
    if not params or _traced(params[0]):
        return
    device = params[0].device
    if device.type == "cuda" and device.index is not None and device.index != torch.cuda.current_device():
        # Triton launches on the current device.
        with torch.cuda.device(device):
            return _run(name, params, grads, states, names, steps, hypers, skip, flags, uses_steps)
    plan, grads = _plan(params, grads, states, names, steps)
    skip_arg = skip if skip is not None else _dummy(device, torch.bool)
    if plan.step_offs is not None and plan.n_steps:
        n_steps = plan.n_steps
        _count[lambda meta: (triton.cdiv(n_steps, meta["BLOCK"]),)](
            steps[0], plan.step_offs, skip_arg, n_steps, params[0].size(0),
            HAS_SKIP=skip is not None,
        )
    for group in plan.groups:
        if group.n_tiles == 0:
            continue
        first = group.index[0]
        bases = [params[first], grads[first]] + [s[first] if s else params[first] for s in states]
        # The group's step offsets count from its own first step tensor.
        step_arg = [steps[first] if steps else _dummy(device, torch.float32)] if uses_steps else []
        args = (group.tiles, *bases, *step_arg, hypers, hypers.stride(0), hypers.stride(1), skip_arg)
        f64 = group.dtype == torch.float64
        meta = dict(
            flags, HAS_SKIP=skip is not None, F64=f64, H64=hypers.dtype == torch.float64,
            VEC_P=_ALIGN_BYTES // params[first].element_size(),
            VEC_S=_ALIGN_BYTES // (8 if f64 else 4),  # state: float64 or float32
        )
        if interpreting():
            _KERNELS[name][(group.n_tiles,)](*args, **meta)
            continue
        key = (name, tuple(sorted(meta.items())),
               tuple(a.dtype for a in args if isinstance(a, Tensor)))
        config = _best.get(key)
        if config is None:
            config = _best[key] = _tune_on_scratch(name, args, [bool(s) for s in states], uses_steps,
                                                   hypers, meta)
        # The plain kernel with the timed config: the autotuner never sees live tensors.
        _KERNELS[name].kernel[(group.n_tiles,)](*args, **meta, **config.all_kwargs())


def _tune_on_scratch(name, args, present, uses_steps, hypers, meta) -> triton.Config:
    """Time the block sizes of a kernel variant on scratch tensors with the live call's
    dtypes and return the fastest config (the first one under the interpreter or with
    HFKERN_TRITON_AUTOTUNE=0)."""
    if not interpreting() and not autotuning():
        return _KERNELS[name].configs[0]
    p, g = args[1], args[2]
    B = hypers.size(1)
    n = max(_LEN_ALIGN, _SCRATCH_ELEMS // B // _LEN_ALIGN * _LEN_ALIGN)

    def scratch(like: Tensor) -> Tensor:
        return torch.rand(B, n, device=like.device).to(like.dtype)

    sp, sg = scratch(p), scratch(g)
    states = [scratch(args[3 + j]) if on else sp for j, on in enumerate(present)]
    steps = [torch.ones(B, device=p.device)]
    lists = [[sp], [sg]] + [[t] for t in states]
    tiles = _build_tiles(lists, ["scratch"] * len(lists), steps, B, _chunk(B * n, p.device), _COLS)
    step_arg = [steps[0]] if uses_steps else []
    # Every model live (same dtype as the live mask: the autotuner's key), so all tiles do work.
    s_skip = torch.zeros(B, dtype=torch.bool, device=p.device)
    s_args = (tiles.to(p.device), sp, sg, *states, *step_arg, hypers, hypers.stride(0),
              hypers.stride(1), s_skip)
    tuned = _KERNELS[name]
    if interpreting():
        tuned[(tiles.size(0),)](*s_args, **meta)
        return tuned.interpret_config
    tuned.tuned[(tiles.size(0),)](*s_args, **meta)  # eager on scratch tensors: no tracing wrapper
    return tuned.tuned.best_config


# ---- launchers (signatures of hfkern/ops/optim_torch.py) ---------------------------------------

def sgd_step_(
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
    momentum = bool(momentum_buffers)
    _run("sgd", params, grads, [momentum_buffers], ["momentum_buffers"], steps, hypers, skip,
         dict(MOMENTUM=momentum, NESTEROV=nesterov, MAXIMIZE=maximize, HAS_WD=has_weight_decay),
         uses_steps=True)


def adam_step_(
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
    _run("adam", params, grads, [exp_avgs, exp_avg_sqs, max_exp_avg_sqs],
         ["exp_avgs", "exp_avg_sqs", "max_exp_avg_sqs"], steps, hypers, skip,
         dict(AMSGRAD=amsgrad, MAXIMIZE=maximize, DECOUPLED=decoupled_weight_decay,
              HAS_WD=has_weight_decay),
         uses_steps=True)


def adagrad_step_(
    params: list[Tensor],
    grads: list[Tensor],
    state_sums: list[Tensor],
    steps: list[Tensor],
    hypers: Tensor,
    maximize: bool,
    has_weight_decay: bool,
    skip: Tensor | None,
) -> None:
    _run("adagrad", params, grads, [state_sums], ["state_sums"], steps, hypers, skip,
         dict(MAXIMIZE=maximize, HAS_WD=has_weight_decay), uses_steps=True)


def adadelta_step_(
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
    _run("adadelta", params, grads, [square_avgs, acc_deltas], ["square_avgs", "acc_deltas"], steps,
         hypers, skip, dict(MAXIMIZE=maximize, HAS_WD=has_weight_decay), uses_steps=False)


def rmsprop_step_(
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
    _run("rmsprop", params, grads, [square_avgs, grad_avgs, momentum_buffers],
         ["square_avgs", "grad_avgs", "momentum_buffers"], steps, hypers, skip,
         dict(CENTERED=centered, MOMENTUM=bool(momentum_buffers), MAXIMIZE=maximize,
              HAS_WD=has_weight_decay),
         uses_steps=False)


# ---- non-finite check ----------------------------------------------------------------

@dataclass
class _CheckPlan:
    groups: list[tuple[list[int], Tensor, int]]  # (positions, tiles on the device, n_tiles) per dtype
    partials: Tensor  # [B, Tm] int32 scratch flags
    tm: int


_checks: collections.OrderedDict = collections.OrderedDict()


def nonfinite_models(grads: list[Tensor]) -> Tensor:
    g0 = grads[0]
    B = g0.size(0)
    if _traced(g0):
        return g0.new_empty((B,), dtype=torch.bool)
    if g0.is_cuda and g0.device.index != torch.cuda.current_device():
        with torch.cuda.device(g0.device):
            return nonfinite_models(grads)
    key = (_sig(grads), tuple(map(_shape_dtype, grads)), g0.device)
    plan = _checks.get(key)
    if plan is None:
        # Read only: any layout the table cannot address is checked through a dense copy.
        dense = [g if _model_major(g) else g.contiguous() for g in grads]
        chunk = _chunk(sum(g.numel() for g in grads), g0.device)
        sizes = [triton.cdiv(g.numel() // B, chunk) if B and g.numel() else 0 for g in dense]
        groups, col = [], 0
        tm = sum(sizes)
        for dtype in (*_FLOAT_PARAMS,):
            index = [i for i, g in enumerate(dense) if g.dtype == dtype and sizes[i]]
            if not index:
                continue
            tiles = _build_tiles([[dense[i] for i in index]], ["grads"], None, B, chunk, _NF_COLS,
                                 part=(tm, col))
            col += sum(sizes[i] for i in index)
            groups.append((index, _to_device(tiles, g0.device), tiles.size(0)))
        others = [g for g in dense if g.dtype not in _FLOAT_PARAMS and g.numel()]
        if others:
            raise TypeError(f"expected floating-point gradients, got {others[0].dtype}")
        plan = _CheckPlan(groups, torch.zeros(max(1, B * tm), dtype=torch.int32, device=g0.device), tm)
        if all(d is g for d, g in zip(dense, grads)):
            _remember(_checks, key, plan)
        grads = dense
    out = torch.empty(B, dtype=torch.bool, device=g0.device)
    for index, tiles, n_tiles in plan.groups:
        g = grads[index[0]]
        _nonfinite_tiles[(n_tiles,)](tiles, g, plan.partials, F64=g.dtype == torch.float64,
                                     VEC=_ALIGN_BYTES // g.element_size())
    if B:
        _nonfinite_reduce[(B,)](plan.partials, out, plan.tm)
    return out
