"""Kernel benchmark: hfkern's array ops per backend against the baselines they replace.

For every case (op, layer shape, array size B, dtype, direction) each
implementation runs on the same random inputs:

* ``torch``, ``triton``: the hfkern op (``torch.ops.hfkern.array_conv``,
  ``array_layer_norm``, ``array_embedding``) under
  ``hfkern.use_backend(name)``. The torch backend's conv is cuDNN grouped
  convolution on the array layout.
* conv baselines: ``grouped_nchw`` / ``grouped_nhwc``, one ``F.conv2d`` (or
  ``F.conv_transpose2d``) with ``groups = B * groups`` on ``[N, B*C, H, W]``
  in NCHW and in channels-last memory (cuDNN with ``cudnn.benchmark`` on
  CUDA), ``grouped_best`` the faster of the two per case; ``vmap``,
  ``torch.func.vmap`` of the per-model call over the stacked parameters;
  ``loop``, B separate per-model calls.
* layer norm and embedding baselines: ``loop``, B separate ``F.layer_norm`` /
  ``F.embedding`` calls.

Directions: ``fwd`` (forward under ``torch.no_grad``), ``bwd`` (the backward
alone: ``torch.autograd.grad`` over a forward graph built once and retained),
``fwd+bwd`` (forward with autograd, then the gradients of every input and
parameter). Every implementation's output (or gradients) is compared with the
torch backend's: ``rel_err`` = max over outputs of ||out - ref|| / ||ref||.

    python bench/bench_kernels.py                    # the whole suite on CUDA
    python bench/bench_kernels.py --quick            # a subset, a few minutes
    python bench/bench_kernels.py --ops layer_norm --dtypes bf16 --B 8
    python bench/bench_kernels.py --time-budget 300  # stop starting cases after 300 s
    python bench/bench_kernels.py --smoke            # tiny shapes on the CPU, seconds

Results go to ``<out>/<name>.csv`` and ``.json`` (bench/README.md explains the
columns and how bytes and FLOPs are counted); a table and the summary are
printed at the end.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import importlib.metadata
import itertools
import json
import math
import os
import platform
import subprocess
import sys
import time
import traceback
from dataclasses import dataclass
from typing import Callable

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
for _p in (ROOT, HERE):  # HERE first: the sibling modules below; ROOT: the in-tree hfkern
    if _p not in sys.path:
        sys.path.insert(0, _p)

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

import bandwidth  # noqa: E402
import report  # noqa: E402
import shapes  # noqa: E402

import hfkern  # noqa: E402

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
EPS = 1e-5
# B's priority when a time budget cuts the suite short: the middle size first.
B_PRIORITY = (8, 16, 4)
# The directions the targets are stated in come first.
QUICK_DIRECTIONS = {"conv": ("fwd+bwd", "fwd"), "layer_norm": ("fwd", "bwd"), "embedding": ("fwd", "bwd")}
# Rotation needs the last-level cache size; the CPU figure only sizes --smoke's rotation.
CPU_CACHE_BYTES = 4 * 2**20
MAX_ROTATE = 8


@dataclass(frozen=True)
class Case:
    op: str
    shape: object  # a shapes.ConvShape / LayerNormShape / EmbeddingShape
    B: int
    dtype: str
    direction: str

    def label(self) -> str:
        s = self.shape
        return f"{self.op} {s.model}.{s.layer} B={self.B} {self.dtype} {self.direction}"


ContextLost = report.ContextLost  # the runners raise it when the CUDA context is unusable


def _leaf(t):
    # detach() keeps the strides, so an [N, B, ...]-memory input stays one as a leaf.
    return None if t is None else t.detach().requires_grad_()


# ---- inputs ------------------------------------------------------------------

def conv_data(s: shapes.ConvShape, B: int, dtype: torch.dtype, device, grad: bool) -> dict:
    """x, gy: [B, N, C, H, W] views of [N, B, C, H, W] memory (the array conv's own
    layout), w: [B, *weight_shape] scaled by fan-in**-0.5 so fp16 stays in range,
    b: [B, C_out] or None."""
    Ho, Wo = s.out_hw()
    fan_in = math.prod(s.weight_shape()[1:])
    x = torch.randn(s.N, B, s.C_in, s.H, s.W, device=device, dtype=dtype).transpose(0, 1)
    w = torch.randn(B, *s.weight_shape(), device=device, dtype=dtype) * fan_in**-0.5
    b = torch.randn(B, s.C_out, device=device, dtype=dtype) if s.bias else None
    gy = torch.randn(s.N, B, s.C_out, Ho, Wo, device=device, dtype=dtype).transpose(0, 1) if grad else None
    return {"B": B, "x": x, "w": w, "b": b, "gy": gy}


def layer_norm_data(s: shapes.LayerNormShape, B: int, dtype: torch.dtype, device, grad: bool) -> dict:
    """x, gy: [B, rows, D]; w, b: [B, D]."""
    x = torch.randn(B, s.rows, s.D, device=device, dtype=dtype)
    w = 1 + 0.1 * torch.randn(B, s.D, device=device, dtype=dtype)
    b = 0.1 * torch.randn(B, s.D, device=device, dtype=dtype)
    gy = torch.randn(B, s.rows, s.D, device=device, dtype=dtype) if grad else None
    return {"B": B, "x": x, "w": w, "b": b, "gy": gy}


def embedding_data(s: shapes.EmbeddingShape, B: int, dtype: torch.dtype, device, grad: bool) -> dict:
    """w: [B, V, D]; idx: [B, batch, seq] int64, uniform over the table or Zipf
    distributed (``s.zipf``); gy: [B, batch, seq, D]."""
    w = torch.randn(B, s.V, s.D, device=device, dtype=dtype)
    if s.zipf:
        p = torch.arange(1, s.V + 1, dtype=torch.float64, device=device) ** -s.zipf
        idx = torch.multinomial(p.float(), B * s.tokens, replacement=True).view(B, s.batch, s.seq)
    else:
        idx = torch.randint(0, s.V, (B, s.batch, s.seq), device=device)
    gy = torch.randn(B, s.batch, s.seq, s.D, device=device, dtype=dtype) if grad else None
    return {"B": B, "w": w, "idx": idx, "gy": gy}


MAKE_DATA = {"conv": conv_data, "layer_norm": layer_norm_data, "embedding": embedding_data}


# ---- bytes and FLOPs ---------------------------------------------------------

def cost(case: Case, elem: int) -> tuple[int, int | None]:
    """(bytes, FLOPs) the direction must move / compute at least.

    Bytes: every input read once and every output written once, in the
    benchmark's dtype (``elem`` bytes; indices int64, norm statistics fp32).
    ``fwd+bwd`` is the sum of the two directions. FLOPs (conv only): 2 per
    multiply-accumulate; the backward does the input and the weight gradient,
    each as many MACs as the forward.
    """
    s, B = case.shape, case.B
    if case.op == "conv":
        Ho, Wo = s.out_hw()
        x = B * s.N * s.C_in * s.H * s.W
        y = B * s.N * s.C_out * Ho * Wo
        w = B * math.prod(s.weight_shape())
        b = B * s.C_out if s.bias else 0
        fwd = (elem * (x + w + b + y), 2 * B * s.macs())
        bwd = (elem * (y + x + w + x + w + b), 4 * B * s.macs())  # read gy, x, w; write gx, gw, gb
    elif case.op == "layer_norm":
        rows, n, p = B * s.rows, B * s.rows * s.D, B * s.D
        fwd = (elem * (2 * n + 2 * p) + 8 * rows, None)  # x, w, b in; y, mean, rstd out
        bwd = (elem * (3 * n + 3 * p) + 8 * rows, None)  # gy, x, w, mean, rstd in; gx, gw, gb out
    elif case.op == "embedding":
        t = B * s.tokens
        fwd = (8 * t + 2 * elem * t * s.D, None)  # indices, one row read per lookup, out
        bwd = (8 * t + elem * t * s.D + elem * B * s.V * s.D, None)  # indices, gy in; dense grad out
    else:
        raise ValueError(case.op)
    if case.direction == "fwd":
        return fwd
    if case.direction == "bwd":
        return bwd
    return fwd[0] + bwd[0], (None if fwd[1] is None else fwd[1] + bwd[1])


# ---- implementations ---------------------------------------------------------
#
# An implementation turns the canonical data (``*_data`` above) into its own
# inputs, runs the forward, and maps its outputs and gradients back to the
# canonical [B, ...] form so that every implementation can be checked against
# the torch backend's result.

class Impl:
    name: str = ""
    kind: str = "baseline"
    backend: str | None = None  # the hfkern backend to select while it runs

    def inputs(self, d: dict, grad: bool) -> tuple[tuple, list]:
        """(arguments of forward, the tensors to differentiate)."""
        raise NotImplementedError

    def forward(self, args: tuple) -> list:
        raise NotImplementedError

    def grad_outputs(self, d: dict) -> list:
        raise NotImplementedError

    def canon_out(self, outs: list) -> torch.Tensor:
        raise NotImplementedError

    def canon_grads(self, grads: tuple) -> list:
        return list(grads)

    def context(self):
        return hfkern.use_backend(self.backend) if self.backend else contextlib.nullcontext()


class _ConvBase(Impl):
    def __init__(self, s: shapes.ConvShape):
        self.s = s
        self.stride, self.padding = (s.stride,) * 2, (s.padding,) * 2
        self.output_padding = (s.output_padding,) * 2

    def _call(self, x, w, b, groups):
        if self.s.transposed:
            return F.conv_transpose2d(x, w, b, self.stride, self.padding, self.output_padding, groups)
        return F.conv2d(x, w, b, self.stride, self.padding, 1, groups)


class HfkernConv(_ConvBase):
    kind = "backend"

    def __init__(self, s, backend: str):
        super().__init__(s)
        self.name = self.backend = backend

    def inputs(self, d, grad):
        x, w, b = d["x"], d["w"], d["b"]
        if grad:
            x, w, b = _leaf(x), _leaf(w), _leaf(b)
        return (x, w, b), [t for t in (x, w, b) if t is not None]

    def forward(self, args):
        x, w, b = args
        s = self.s
        return [torch.ops.hfkern.array_conv(
            x, w, b, list(self.stride), list(self.padding), [1, 1], s.transposed,
            list(self.output_padding), s.groups,
        )]

    def grad_outputs(self, d):
        return [d["gy"]]

    def canon_out(self, outs):
        return outs[0]


class GroupedConv(_ConvBase):
    """One grouped conv over [N, B*C, H, W]: the models are groups B*groups."""

    def __init__(self, s, channels_last: bool):
        super().__init__(s)
        self.channels_last = channels_last
        self.name = "grouped_nhwc" if channels_last else "grouped_nchw"
        self.fmt = torch.channels_last if channels_last else torch.contiguous_format

    def inputs(self, d, grad):
        s, B = self.s, d["B"]
        x = d["x"].transpose(0, 1).reshape(s.N, B * s.C_in, s.H, s.W).contiguous(memory_format=self.fmt)
        w = d["w"].reshape(B * d["w"].shape[1], *d["w"].shape[2:]).contiguous(memory_format=self.fmt)
        b = None if d["b"] is None else d["b"].reshape(-1).contiguous()
        if grad:
            x, w, b = _leaf(x), _leaf(w), _leaf(b)
        return (x, w, b, B * s.groups), [t for t in (x, w, b) if t is not None]

    def forward(self, args):
        x, w, b, groups = args
        return [self._call(x, w, b, groups)]

    def grad_outputs(self, d):
        gy = d["gy"]
        B, N, C, H, W = gy.shape
        return [gy.transpose(0, 1).reshape(N, B * C, H, W).contiguous(memory_format=self.fmt)]

    def canon_out(self, outs):
        y = outs[0]
        N, BC, H, W = y.shape
        B = BC // self.s.C_out
        return y.reshape(N, B, self.s.C_out, H, W).transpose(0, 1)

    def canon_grads(self, grads):
        s = self.s
        gx, gw = grads[0], grads[1]
        N, BC, H, W = gx.shape
        B = BC // s.C_in
        out = [gx.reshape(N, B, s.C_in, H, W).transpose(0, 1), gw.reshape(B, *s.weight_shape())]
        if len(grads) > 2:
            out.append(grads[2].reshape(B, s.C_out))
        return out


class VmapConv(_ConvBase):
    """torch.func.vmap of the per-model conv over stacked [B, ...] inputs and parameters."""

    name = "vmap"

    def __init__(self, s):
        super().__init__(s)
        g = s.groups
        self._with_bias = torch.func.vmap(lambda x, w, b: self._call(x, w, b, g))
        self._no_bias = torch.func.vmap(lambda x, w: self._call(x, w, None, g))

    def inputs(self, d, grad):
        x, w, b = d["x"].contiguous(), d["w"], d["b"]
        if grad:
            x, w, b = _leaf(x), _leaf(w), _leaf(b)
        return (x, w, b), [t for t in (x, w, b) if t is not None]

    def forward(self, args):
        x, w, b = args
        return [self._no_bias(x, w) if b is None else self._with_bias(x, w, b)]

    def grad_outputs(self, d):
        return [d["gy"].contiguous()]

    def canon_out(self, outs):
        return outs[0]


class LoopConv(_ConvBase):
    """B separate per-model convs on separate (contiguous) tensors."""

    name = "loop"

    def inputs(self, d, grad):
        B = d["B"]
        xs = [d["x"][i].contiguous() for i in range(B)]
        ws = [d["w"][i].contiguous() for i in range(B)]
        bs = [None if d["b"] is None else d["b"][i].contiguous() for i in range(B)]
        if grad:
            xs, ws, bs = [_leaf(t) for t in xs], [_leaf(t) for t in ws], [_leaf(t) for t in bs]
        return (xs, ws, bs), xs + ws + [t for t in bs if t is not None]

    def forward(self, args):
        xs, ws, bs = args
        g = self.s.groups
        return [self._call(x, w, b, g) for x, w, b in zip(xs, ws, bs)]

    def grad_outputs(self, d):
        return [d["gy"][i].contiguous() for i in range(d["B"])]

    def canon_out(self, outs):
        return torch.stack(outs)

    def canon_grads(self, grads):
        n = len(grads)
        B = n // 3 if self.s.bias else n // 2
        return [torch.stack(grads[i:i + B]) for i in range(0, n, B)]


class HfkernLayerNorm(Impl):
    kind = "backend"

    def __init__(self, s, backend: str):
        self.s = s
        self.name = self.backend = backend

    def inputs(self, d, grad):
        x, w, b = d["x"], d["w"], d["b"]
        if grad:
            x, w, b = _leaf(x), _leaf(w), _leaf(b)
        return (x, w, b), [x, w, b]

    def forward(self, args):
        x, w, b = args
        return [torch.ops.hfkern.array_layer_norm(x, w, b, 1, EPS)[0]]

    def grad_outputs(self, d):
        return [d["gy"]]

    def canon_out(self, outs):
        return outs[0]


class LoopLayerNorm(Impl):
    name = "loop"

    def __init__(self, s):
        self.s = s

    def inputs(self, d, grad):
        B = d["B"]
        parts = [[d[k][i].contiguous() for i in range(B)] for k in ("x", "w", "b")]
        if grad:
            parts = [[_leaf(t) for t in p] for p in parts]
        xs, ws, bs = parts
        return (xs, ws, bs), xs + ws + bs

    def forward(self, args):
        xs, ws, bs = args
        return [F.layer_norm(x, (self.s.D,), w, b, EPS) for x, w, b in zip(xs, ws, bs)]

    def grad_outputs(self, d):
        return [d["gy"][i].contiguous() for i in range(d["B"])]

    def canon_out(self, outs):
        return torch.stack(outs)

    def canon_grads(self, grads):
        B = len(grads) // 3
        return [torch.stack(grads[i:i + B]) for i in range(0, len(grads), B)]


class HfkernEmbedding(Impl):
    kind = "backend"

    def __init__(self, s, backend: str):
        self.s = s
        self.name = self.backend = backend

    def inputs(self, d, grad):
        w = _leaf(d["w"]) if grad else d["w"]
        return (w, d["idx"]), [w]

    def forward(self, args):
        w, idx = args
        return [torch.ops.hfkern.array_embedding(w, idx, -1, False, False)]

    def grad_outputs(self, d):
        return [d["gy"]]

    def canon_out(self, outs):
        return outs[0]


class LoopEmbedding(Impl):
    name = "loop"

    def __init__(self, s):
        self.s = s

    def inputs(self, d, grad):
        B = d["B"]
        ws = [d["w"][i].contiguous() for i in range(B)]
        if grad:
            ws = [_leaf(t) for t in ws]
        idx = [d["idx"][i].contiguous() for i in range(B)]
        return (ws, idx), ws

    def forward(self, args):
        ws, idx = args
        return [F.embedding(i, w) for w, i in zip(ws, idx)]

    def grad_outputs(self, d):
        return [d["gy"][i].contiguous() for i in range(d["B"])]

    def canon_out(self, outs):
        return torch.stack(outs)

    def canon_grads(self, grads):
        return [torch.stack(grads)]


BACKENDS = ("torch", "triton")
IMPL_NAMES = {
    "conv": ("torch", "triton", "grouped_nchw", "grouped_nhwc", "vmap", "loop"),
    "layer_norm": ("torch", "triton", "loop"),
    "embedding": ("torch", "triton", "loop"),
}


def make_impls(op: str, s, names) -> list[Impl]:
    """The implementations of ``op`` named in ``names``; ``torch`` first (the reference)."""
    out: list[Impl] = []
    for name in IMPL_NAMES[op]:
        if name not in names:
            continue
        if op == "conv":
            if name in BACKENDS:
                out.append(HfkernConv(s, name))
            elif name == "grouped_nchw":
                out.append(GroupedConv(s, channels_last=False))
            elif name == "grouped_nhwc":
                out.append(GroupedConv(s, channels_last=True))
            elif name == "vmap":
                out.append(VmapConv(s))
            else:
                out.append(LoopConv(s))
        elif op == "layer_norm":
            out.append(HfkernLayerNorm(s, name) if name in BACKENDS else LoopLayerNorm(s))
        else:
            out.append(HfkernEmbedding(s, name) if name in BACKENDS else LoopEmbedding(s))
    return out


def build_fn(impl: Impl, d: dict, direction: str) -> tuple[Callable, Callable]:
    """(the timed callable, a map of its result to canonical tensors)."""
    args, diff = impl.inputs(d, grad=direction != "fwd")
    if direction == "fwd":
        def fn():
            with torch.no_grad():
                return impl.forward(args)
        return fn, lambda res: [impl.canon_out(res)]
    gouts = impl.grad_outputs(d)
    if direction == "fwd+bwd":
        def fn():
            return torch.autograd.grad(impl.forward(args), diff, gouts)
    else:
        outs = impl.forward(args)

        def fn():
            return torch.autograd.grad(outs, diff, gouts, retain_graph=True)
    return fn, impl.canon_grads


def rel_err(outs: list, refs: list) -> float:
    """max over outputs of ||out - ref|| / ||ref||, in fp32."""
    if len(outs) != len(refs):
        raise ValueError(f"{len(outs)} outputs against {len(refs)} reference outputs")
    worst = 0.0
    for a, r in zip(outs, refs):
        if a.shape != r.shape:
            raise ValueError(f"output shape {list(a.shape)} against reference {list(r.shape)}")
        a, r = a.float(), r.float()
        den = r.norm().item()
        num = (a - r).norm().item()
        worst = max(worst, num / den if den > 0 else num)
    return worst


# ---- the run -----------------------------------------------------------------

class Runner:
    """Runs the implementations of one case after another and makes their rows."""

    def __init__(self, args, device: torch.device, timer, ceilings: dict, env: dict):
        self.args = args
        self.device = device
        self.timer = timer
        self.ceilings = ceilings
        self.env = env
        self.cache_bytes = _cache_bytes(device)
        self._reported: set[tuple] = set()

    def sync(self):
        if self.device.type == "cuda":
            torch.cuda.synchronize()

    def _check_context(self, after: str) -> None:
        if self.device.type != "cuda":
            return
        try:
            torch.cuda.synchronize()
            torch.ones(1, device=self.device).add_(1).item()
        except Exception as e:  # noqa: BLE001
            raise ContextLost(f"CUDA context unusable after {after}: {type(e).__name__}: {e}") from e

    def _frac_matmul(self, dtype: str, tflops):
        if tflops is None:
            return None
        key = dtype
        if dtype == "fp32":
            key = "tf32" if self.device.type == "cuda" and torch.backends.cudnn.allow_tf32 else "fp32"
        ceil = (self.ceilings.get("matmul_tflops") or {}).get(key)
        return tflops / ceil if ceil else None

    def base_row(self, case: Case, impl_name: str, kind: str) -> dict:
        s = case.shape
        return {
            "op": case.op, "model": s.model, "layer": s.layer, "shape": s.describe(), "B": case.B,
            "dtype": case.dtype, "direction": case.direction, "impl": impl_name, "kind": kind,
            "status": None, "ms": None, "gbps": None, "tflops": None, "frac_copy_bw": None,
            "frac_matmul": None, "bytes": None, "flops": None, "rel_err": None, "rotate": None,
            "note": None, "error": None, **self.env,
        }

    def run_case(self, case: Case, impl_names) -> list[dict]:
        dtype = DTYPES[case.dtype]
        nbytes, flops = cost(case, torch.empty(0, dtype=dtype).element_size())
        # do_bench already flushes L2 before each timed call; rotating among
        # several input sets as well keeps a small case's inputs from being
        # cache-resident even where that flush is not used (CPU, cuda_events).
        rotate = 1 if nbytes >= self.cache_bytes else min(MAX_ROTATE, math.ceil(2 * self.cache_bytes / nbytes))
        grad = case.direction != "fwd"
        make = MAKE_DATA[case.op]
        datasets = [make(case.shape, case.B, dtype, self.device, grad) for _ in range(rotate)]
        impls = make_impls(case.op, case.shape, impl_names)
        rows, ref = [], None
        for impl in impls:
            row = self.base_row(case, impl.name, impl.kind)
            row.update(bytes=nbytes, flops=flops, rotate=rotate)
            failed = False

            def check(result, impl=impl, row=row):
                nonlocal ref
                if impl.name == "torch":
                    ref = result
                elif ref is not None:
                    try:
                        row["rel_err"] = rel_err(result, ref)
                        if not math.isfinite(row["rel_err"]):
                            row["rel_err"], row["note"] = None, "non-finite output"
                    except (ValueError, RuntimeError) as e:
                        row["note"] = f"not checked: {e}"

            try:
                ms = self._measure(impl, datasets, case.direction, check)
                if not ms > 0:
                    raise RuntimeError(f"the timer returned {ms} ms")
            except ContextLost:
                raise
            except Exception as e:  # noqa: BLE001  (one failing implementation must not stop the run)
                text = str(e).strip()
                msg = f"{type(e).__name__}: {text.splitlines()[0] if text else ''}"[:500]
                row.update(status="error", error=msg)
                if self.args.verbose:
                    traceback.print_exc()
                elif (case.op, impl.name, msg) not in self._reported:
                    self._reported.add((case.op, impl.name, msg))
                    print(f"  {impl.name} failed on {case.label()}: {msg}", flush=True)
                failed = True
            if failed:
                # Outside the except block, so the failed call's tensors are gone
                # before the allocator's cache is emptied.
                if self.device.type == "cuda":
                    self._check_context(f"{impl.name} on {case.label()}: {row['error'][:200]}")
                    torch.cuda.empty_cache()
                rows.append(row)
                continue
            row.update(status="ok", ms=ms, gbps=nbytes / (ms * 1e-3) / 1e9)
            copy = self.ceilings.get("copy_gbps")
            row["frac_copy_bw"] = row["gbps"] / copy if copy else None
            if flops is not None:
                row["tflops"] = flops / (ms * 1e-3) / 1e12
                row["frac_matmul"] = self._frac_matmul(case.dtype, row["tflops"])
            rows.append(row)
        rows.extend(_derived_best(rows))
        return rows

    def _measure(self, impl: Impl, datasets: list[dict], direction: str, check: Callable) -> float:
        """Median ms of ``impl`` cycling over ``datasets``; ``check`` gets the
        canonical result of the first call on ``datasets[0]`` before the timing."""
        with impl.context():
            built = [build_fn(impl, d, direction) for d in datasets]
            fns, canon = [b[0] for b in built], built[0][1]
            del built
            # The first call compiles / autotunes / picks cuDNN algorithms and
            # gives the result that is checked against the reference.
            result = [t.detach() for t in canon(fns[0]())]
            self.sync()
            check(result)
            del result
            if isinstance(self.timer, bandwidth.GraphTimer):
                # One capture holds a call on every input set, in turn.
                ms = self.timer(lambda: [f() for f in fns]) / len(fns)
            else:
                cycle = itertools.cycle(fns)
                ms = self.timer(lambda: next(cycle)())
            self.sync()
        return ms


def _derived_best(rows: list[dict]) -> list[dict]:
    """grouped_best: the faster of the two grouped-conv layouts."""
    grouped = [r for r in rows if r["impl"] in ("grouped_nchw", "grouped_nhwc")]
    if not grouped:
        return []
    ok = [r for r in grouped if r["status"] == "ok"]
    if ok:
        best = dict(min(ok, key=lambda r: r["ms"]))
        best["note"] = f"{best['impl']}" + (f"; {best['note']}" if best.get("note") else "")
    else:
        best = dict(grouped[0])
        best["error"] = "; ".join(f"{r['impl']}: {r['error']}" for r in grouped)[:500]
    best["impl"] = "grouped_best"
    return [best]


def _cache_bytes(device: torch.device) -> int:
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        return int(getattr(props, "L2_cache_size", 0) or 50 * 2**20)
    return CPU_CACHE_BYTES


def plan(args) -> list[Case]:
    """The cases to run, most important first (a time budget cuts the tail).

    The ``--quick`` subset (quick shapes, B=8, the directions the targets
    need, the headline direction first) comes first, then the rest of the
    suite by B (8, 16, 4); ops are interleaved so that a cut leaves every op
    measured.
    """
    if args.smoke:
        tiers = [[(op, s, B, dt, d) for s in shapes.suite(op, smoke=True) for B in args.B
                  for dt in args.dtypes for d in args.directions or shapes.DIRECTIONS]
                 for op in args.ops]
        return _filtered(_interleave(tiers), args.filter)
    quick, rest = [], []
    for op in args.ops:
        dirs_q = args.directions or QUICK_DIRECTIONS[op]
        dirs = args.directions or shapes.DIRECTIONS
        q = [(op, s, B, dt, d) for d in dirs_q for s in shapes.suite(op, quick=True) for B in args.B
             if B in shapes.QUICK_B_VALUES or args.B_given
             for dt in args.dtypes]
        quick.append(q)
        seen = set(q)
        r = [(op, s, B, dt, d) for B in sorted(args.B, key=_b_priority) for s in shapes.suite(op)
             for dt in args.dtypes for d in dirs]
        rest.append([c for c in r if c not in seen])
    return _filtered(_interleave(quick) + ([] if args.quick else _interleave(rest)), args.filter)


def _filtered(cases: list[tuple], text: str | None) -> list[Case]:
    return [Case(*c) for c in cases if not text or text in f"{c[1].model}.{c[1].layer}"]


def _b_priority(B: int) -> int:
    return B_PRIORITY.index(B) if B in B_PRIORITY else len(B_PRIORITY) + B


def _interleave(lists: list[list]) -> list:
    out = []
    for group in itertools.zip_longest(*lists):
        out.extend(c for c in group if c is not None)
    return out


# ---- environment -------------------------------------------------------------

def _version(dist: str) -> str | None:
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return None


def environment(device: torch.device) -> dict:
    """The per-row environment columns."""
    if device.type == "cuda":
        name = torch.cuda.get_device_name(device)
        cudnn = str(torch.backends.cudnn.version()) if torch.backends.cudnn.is_available() else None
    else:
        name = f"cpu ({platform.machine()}, {torch.get_num_threads()} threads)"
        cudnn = None
    return {
        "device": name,
        "torch": torch.__version__,
        "triton": _version("triton") or _version("pytorch-triton"),
        "cudnn": cudnn,
        "cuda": torch.version.cuda,
        "hfkern": hfkern.__version__,
        "timer": None,
        "date": datetime.date.today().isoformat(),
    }


def _git_commit() -> str | None:
    try:
        out = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True,
                             text=True, timeout=10)
        return out.stdout.strip() or None
    except (OSError, subprocess.SubprocessError):
        return None


def _csv_list(kind, choices=None):
    def parse(text: str):
        items = [kind(t.strip()) for t in text.split(",") if t.strip()]
        if choices is not None:
            bad = [i for i in items if i not in choices]
            if bad:
                raise argparse.ArgumentTypeError(f"expected a comma list of {list(choices)}, got {bad}")
        return items
    return parse


def parse_args(argv=None) -> argparse.Namespace:
    all_impls = sorted({i for v in IMPL_NAMES.values() for i in v})
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--ops", type=_csv_list(str, shapes.OPS), default=list(shapes.OPS),
                   help="comma list of ops (default: all of %(default)s)")
    p.add_argument("--dtypes", type=_csv_list(str, DTYPES), default=None,
                   help="comma list of fp32, bf16, fp16 (default: all; --smoke: fp32,bf16)")
    p.add_argument("--B", type=_csv_list(int), default=None,
                   help="comma list of array sizes (default: 4,8,16, the quick subset 8; --smoke: 2)")
    p.add_argument("--directions", type=_csv_list(str, shapes.DIRECTIONS), default=None,
                   help="comma list of fwd, bwd, fwd+bwd (default: all; the quick subset: what the "
                        "targets need)")
    p.add_argument("--impls", type=_csv_list(str, all_impls), default=None,
                   help=f"comma list of implementations (default: all; --smoke: all but triton): {all_impls}")
    p.add_argument("--filter", default=None, help="only layers whose 'model.layer' contains this text")
    p.add_argument("--quick", action="store_true", help="only the quick subset (a few minutes)")
    p.add_argument("--smoke", action="store_true",
                   help="tiny shapes on the CPU, perf_counter timing, torch backend only (seconds)")
    p.add_argument("--time-budget", type=float, default=None, metavar="SECONDS",
                   help="start no new case after this many seconds (the cases left are counted as skipped)")
    p.add_argument("--out", default=os.path.join(HERE, "results"), help="results directory (default bench/results)")
    p.add_argument("--name", default=None, help="file stem of the results (default kernels_<device>_<date>)")
    p.add_argument("--ceilings", default=None, metavar="JSON",
                   help="ceilings written by bench/bandwidth.py --out (default: measure them now)")
    p.add_argument("--timer", choices=bandwidth.TIMERS, default="do_bench",
                   help="CUDA timer: do_bench (eager calls, launch overhead included) or "
                        "cuda_graph (replays of one captured call: the kernels' own time)")
    p.add_argument("--warmup-ms", type=float, default=10.0, help="warm-up per timing (ms)")
    p.add_argument("--rep-ms", type=float, default=40.0, help="repetition time per timing (ms)")
    p.add_argument("--no-table", action="store_true", help="print only the summary")
    p.add_argument("--list", action="store_true", help="print the planned cases and exit")
    p.add_argument("--verbose", action="store_true", help="print the traceback of every error row")
    args = p.parse_args(argv)
    args.B_given = args.B is not None
    if args.smoke:
        args.dtypes = args.dtypes or list(shapes.SMOKE_DTYPES)
        args.B = args.B or list(shapes.SMOKE_B_VALUES)
        args.impls = args.impls or [i for i in all_impls if i != "triton"]
    else:
        args.dtypes = args.dtypes or list(shapes.DTYPES)
        args.B = args.B or list(shapes.B_VALUES)
        args.impls = args.impls or all_impls
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    cases = plan(args)
    if args.list:
        for i, c in enumerate(cases):
            print(f"{i:5d} {c.label()}  [{c.shape.describe()}]")
        return 0
    t_start = time.monotonic()
    device = torch.device("cuda" if torch.cuda.is_available() and not args.smoke else "cpu")
    if device.type == "cuda":
        # cuDNN picks the fastest algorithm per shape, for the torch backend
        # and the baselines alike.
        torch.backends.cudnn.benchmark = True
        timer = bandwidth.make_cuda_timer(args.timer, args.warmup_ms, args.rep_ms)
    else:
        # The first call of every implementation (the checked one) is the warm-up.
        timer = bandwidth.CpuTimer(reps=3, max_seconds=0.5, warmup=0) if args.smoke else bandwidth.CpuTimer()
        if not args.smoke:
            print("warning: no CUDA device; timing on the CPU with perf_counter"
                  + (f" (--timer {args.timer} is for CUDA)" if args.timer != "do_bench" else ""))
    torch.manual_seed(0)
    env = environment(device)
    env["timer"] = timer.name

    ceilings = None
    if args.ceilings:
        try:
            with open(args.ceilings) as f:
                ceilings = json.load(f)
            if ceilings.get("device") not in (None, env["device"]):
                print(f"warning: ceilings were measured on {ceilings.get('device')}, not {env['device']}")
        except (OSError, ValueError) as e:
            print(f"could not read ceilings from {args.ceilings} ({e}); measuring them")
            ceilings = None
    if ceilings is None:
        ceilings = bandwidth.measure_ceilings(device, timer, smoke=args.smoke)
        ceilings["device"] = env["device"]

    stem = args.name or f"kernels_{report.slug(env['device'].split(' (')[0])}_{env['date']}"
    if args.smoke and not args.name:
        stem = f"kernels_smoke_{env['date']}"
    meta = {
        "benchmark": "bench/bench_kernels.py",
        "argv": sys.argv[1:] if argv is None else list(argv),
        "started": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "date": env["date"],
        "device": env["device"],
        "versions": {k: env[k] for k in ("torch", "triton", "cudnn", "cuda", "hfkern")}
        | {"python": platform.python_version(), "git": _git_commit()},
        "ceilings": ceilings,
        "settings": {
            "timer": timer.name, "warmup_ms": args.warmup_ms, "rep_ms": args.rep_ms,
            "cudnn_benchmark": bool(torch.backends.cudnn.benchmark) if device.type == "cuda" else None,
            "cudnn_allow_tf32": bool(torch.backends.cudnn.allow_tf32) if device.type == "cuda" else None,
            "matmul_allow_tf32": bool(torch.backends.cuda.matmul.allow_tf32) if device.type == "cuda" else None,
            "cache_bytes": _cache_bytes(device), "quick": args.quick, "smoke": args.smoke,
            "time_budget_s": args.time_budget,
        },
        "backends": _backend_summary(),
        "planned_cases": len(cases),
        "skipped_cases": 0,
        # True once the plan ran to its end or to the time budget; False after
        # an abort (CUDA context lost) or an interrupt.
        "finished": False,
    }
    writer = report.RowWriter(args.out, stem, meta)
    writer.write_json(complete=False)
    bw = ceilings.get("copy_gbps")
    print(f"device: {env['device']}; torch {env['torch']}, triton {env['triton']}, cuDNN {env['cudnn']}, "
          f"CUDA {env['cuda']}; timer {timer.name}")
    print(f"copy bandwidth ceiling: {bw:.0f} GB/s; matmul TFLOP/s: "
          + ", ".join(f"{k} {v:.1f}" for k, v in (ceilings.get('matmul_tflops') or {}).items())
          if bw else "copy bandwidth ceiling: not measured")
    print(f"{len(cases)} cases; writing {writer.csv_path}", flush=True)

    runner = Runner(args, device, timer, ceilings, env)
    report.run_cases(cases, lambda case: runner.run_case(case, args.impls), writer, meta, args.time_budget, t_start, device)
    if not args.no_table:
        report.print_table(writer.rows)
    meta["summary"] = report.print_summary(writer.rows, meta)
    writer.write_json(complete=True)
    print(f"wrote {writer.csv_path} and {writer.json_path} ({len(writer.rows)} rows)")
    return 0 if meta["finished"] else 3


def _backend_summary() -> dict:
    try:
        info = hfkern.backend_info()
        return {"backends": info["backends"], "ops": info["ops"]}
    except Exception as e:  # noqa: BLE001
        return {"error": f"{type(e).__name__}: {e}"}


if __name__ == "__main__":
    raise SystemExit(main())
