"""What every Triton launcher shares: interpreter detection and autotuned launches; and the
jit helpers of more than one family (the norms' fused activations)."""

from __future__ import annotations

import os
from typing import Any, Callable, Sequence

import torch
import triton
import triton.language as tl
from torch._subclasses.fake_tensor import is_fake

from .._dtypes import KERNEL_DTYPES


def interpreting() -> bool:
    """True when kernels run in Triton's CPU interpreter (``TRITON_INTERPRET=1``)."""
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def autotuning() -> bool:
    """False when ``HFKERN_TRITON_AUTOTUNE=0``: every kernel then launches with its
    first (default) config, untimed, which skips the autotuner's compile-and-time
    pass over every config for each new problem key (quick start-up, test runs)."""
    value = os.environ.get("HFKERN_TRITON_AUTOTUNE", "1").strip()
    if value not in ("0", "1"):
        raise ValueError(f"HFKERN_TRITON_AUTOTUNE must be 0 or 1, got {value!r}")
    return value == "1"


def tl_dtype_ok(t: torch.Tensor) -> bool:
    return t.dtype in KERNEL_DTYPES


def check_tensors(op: str, x: torch.Tensor, *others: torch.Tensor | None) -> None:
    """What every launcher checks before a launch: ``x`` (the data) and the other
    floating-point tensors in a kernel dtype, on a CUDA device (or in the interpreter)."""
    if not tl_dtype_ok(x):
        raise TypeError(
            f"hfkern::{op} (triton): expected x of dtype float32, float16 or bfloat16, got {x.dtype}"
        )
    if x.device.type != "cuda" and not interpreting():
        raise ValueError(
            f"hfkern::{op} (triton): expected CUDA tensors (or TRITON_INTERPRET=1), "
            f"got x on {x.device}"
        )
    for t in others:
        if t is not None and t.is_floating_point() and not tl_dtype_ok(t):
            raise TypeError(
                f"hfkern::{op} (triton): expected float32, float16 or bfloat16 tensors, got {t.dtype}"
            )


class Tuned:
    """A ``@triton.jit`` kernel launched with autotuning, or with one fixed
    config in the interpreter (which cannot time configs).

    ``Tuned(kernel, configs, key)[grid](*args, **kwargs)`` launches like an
    autotuned kernel (with ``configs[0]`` alone when ``HFKERN_TRITON_AUTOTUNE=0``).
    Launchers run inside the opaque ``hfkern::`` custom ops, which
    ``torch.compile`` does not trace into, so a launch is a plain Triton launch
    (no ``wrap_triton`` higher-order op and its per-call host cost).
    """

    def __init__(
        self,
        kernel: Any,
        configs: Sequence[triton.Config],
        key: Sequence[str],
        *,
        interpret_config: triton.Config | None = None,
        **autotune_kwargs: Any,
    ):
        self.kernel = kernel
        self.configs = list(configs)
        self.tuned = triton.autotune(configs=self.configs, key=list(key), **autotune_kwargs)(kernel)
        # An autotuner of one config never times it: HFKERN_TRITON_AUTOTUNE=0.
        self.fixed = triton.autotune(configs=self.configs[:1], key=[], **autotune_kwargs)(kernel)
        self.interpret_config = interpret_config or self.configs[0]

    def __getitem__(self, grid: Callable | tuple) -> Callable:
        if interpreting():
            launch = self.kernel[grid]
            meta = dict(self.interpret_config.kwargs)

            def run(*args, **kwargs):
                # Tracing (opcheck, torch.compile) would run it on FakeTensors; a
                # traced launch has no effect on the shapes, so skip it there.
                if any(isinstance(a, torch.Tensor) and is_fake(a) for a in args):
                    return None
                return launch(*args, **kwargs, **meta)

            return run
        return (self.tuned if autotuning() else self.fixed)[grid]


# ---- the norms' shared jit helpers (layer norm, batch norm) ---------------------

@triton.jit
def column_block(pid, n, BLOCK: tl.constexpr):
    """(model (int64), columns, in-range mask) of program ``pid`` of a per-column kernel
    over ``[B, n]``, one program per block of ``BLOCK`` columns of one model."""
    n_blocks = tl.cdiv(n, BLOCK)
    b = (pid // n_blocks).to(tl.int64)
    cols = (pid % n_blocks) * BLOCK + tl.arange(0, BLOCK)
    return b, cols, cols < n


# The fused activations: ACTIVATION is a constexpr, the op's string: "none", "relu" or "gelu" (the exact
# erf form). Math in float32.

@triton.jit
def activate(z, ACTIVATION: tl.constexpr):
    """act(z), float32."""
    if ACTIVATION == "relu":
        z = tl.where(z < 0, 0.0, z)  # NaN stays NaN, as torch.relu
    elif ACTIVATION == "gelu":
        z = 0.5 * z * (1.0 + tl.erf(z * 0.7071067811865476))
    return z


@triton.jit
def activation_grad(g, z, ACTIVATION: tl.constexpr):
    """g * act'(z): torch's rules (ReLU: g where z > 0, else 0; GELU: Phi(z) + z * phi(z))."""
    if ACTIVATION == "relu":
        g = tl.where(z > 0, g, 0.0)
    elif ACTIVATION == "gelu":
        cdf = 0.5 * (1.0 + tl.erf(z * 0.7071067811865476))
        pdf = tl.exp(-0.5 * z * z) * 0.3989422804014327
        g = g * (cdf + z * pdf)
    return g
