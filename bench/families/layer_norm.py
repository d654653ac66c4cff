"""Array layer norm and RMS norm (``hfkern::array_layer_norm``, ``array_rms_norm`` and their backward ops).

Benchmark suite: the layer norms of BERT-base (hidden 768, sequence 128 and
512) and of a small transformer language model (d_model 256 and 512), over the
last dim of ``[batch, seq, D]`` activations. Baseline: ``loop``, B separate
``F.layer_norm`` calls.

Suite ``bytes``: the published transformers' shapes (bench/models, size full:
the word-language-model transformer, d_model 200 at 20 x 35 tokens, and
BERT-small, hidden 512 at 32 x 128 tokens) with an activation fused into the
op (``activation``, the ``+relu`` / ``+gelu`` layer suffix), against
``unfused_<backend>``: the op with activation "none" under that backend, then
``torch.relu`` / ``F.gelu``; ``loop`` runs the activation after each model's
layer norm.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch
import torch.nn.functional as F

from . import Activated, Family, FusedNorm, Loop, Suite, UnfusedNorm, unfused_baselines

EPS = 1e-5


@dataclass(frozen=True)
class LayerNormShape:
    """One model's layer norm over the last dim of ``[batch, seq, D]`` activations."""

    model: str
    layer: str
    batch: int
    seq: int
    D: int
    quick: bool = False
    activation: str = "none"  # fused into the op: "none", "relu", "gelu"

    @property
    def rows(self) -> int:
        return self.batch * self.seq

    def describe(self) -> str:
        act = f" +{self.activation}" if self.activation != "none" else ""
        return f"[{self.batch}, {self.seq}, {self.D}] (rows {self.rows}){act}"


SHAPES: list[LayerNormShape] = [
    LayerNormShape("bert-base", "seq128", 32, 128, 768, quick=True),
    LayerNormShape("bert-base", "seq512", 8, 512, 768),
    LayerNormShape("lm-small", "d256", 32, 256, 256),
    LayerNormShape("lm-small", "d512", 16, 512, 512, quick=True),
]
SMOKE_SHAPES = [LayerNormShape("smoke", "ln", 2, 5, 12)]


def _activated(shapes, activations=("relu", "gelu")) -> list:
    """Each shape once per fused activation, the activation in its layer name (``ln+gelu``)."""
    return [replace(s, layer=f"{s.layer}+{act}", activation=act) for s in shapes for act in activations]


BYTES_SHAPES = _activated([
    LayerNormShape("transformer_lm", "ln", 20, 35, 200),
    LayerNormShape("bert_small", "ln", 32, 128, 512, quick=True),
])
BYTES_SMOKE_SHAPES = _activated(SMOKE_SHAPES)


def make_data(s: LayerNormShape, B: int, dtype: torch.dtype, device, grad: bool) -> dict:
    """x, gy: [B, rows, D]; w, b: [B, D]."""
    x = torch.randn(B, s.rows, s.D, device=device, dtype=dtype)
    w = 1 + 0.1 * torch.randn(B, s.D, device=device, dtype=dtype)
    b = 0.1 * torch.randn(B, s.D, device=device, dtype=dtype)
    gy = torch.randn(B, s.rows, s.D, device=device, dtype=dtype) if grad else None
    return {"B": B, "x": x, "w": w, "b": b, "gy": gy}


def cost(s: LayerNormShape, B: int, elem: int) -> tuple:
    """The op's least bytes; a fused activation moves nothing more (its backward
    recomputes the pre-activation from x and reads b as well)."""
    rows, n, p = B * s.rows, B * s.rows * s.D, B * s.D
    fused = elem * p if s.activation != "none" else 0
    fwd = (elem * (2 * n + 2 * p) + 8 * rows, None)  # x, w, b in; y, mean, rstd out
    bwd = (elem * (3 * n + 3 * p) + 8 * rows + fused, None)  # gy, x, w, (b,) mean, rstd in; gx, gw, gb out
    return fwd, bwd


class _Activated(Activated):
    cost = staticmethod(cost)


class HfkernLayerNorm(FusedNorm):
    def norm(self, args, activation):
        x, w, b = args
        return torch.ops.hfkern.array_layer_norm(x, w, b, 1, EPS, activation)[0]


class UnfusedLayerNorm(_Activated, UnfusedNorm, HfkernLayerNorm):
    """The hfkern op with activation "none" under ``backend``, then the activation in torch."""


def _cuda_backend(s: LayerNormShape):
    """The hfkern op under the ``cuda`` backend (csrc/norm/layer_norm.cu), where hfkern._C
    is built and a GPU can run it (else no row)."""
    from hfkern.cuda import _ext

    return HfkernLayerNorm(s, "cuda") if _ext.availability()[0] else None


class LoopLayerNorm(_Activated, Loop):
    def inputs(self, d, grad):
        xs, ws, bs = self.per_model(d, ("x", "w", "b"), grad)
        return (xs, ws, bs), xs + ws + bs

    def forward(self, args):
        return [self.activate(F.layer_norm(x, (self.s.D,), w, b, EPS)) for x, w, b in zip(*args)]


# ---- the launchers' code paths and the op samples --------------------------------

# The fused activations' kernel variants (forward, and the backward that recomputes z),
# each once per row path: ReLU in float32, GELU in bfloat16.
COMPILE_ACTIVATIONS = (("relu", torch.float32), ("gelu", torch.bfloat16))


def compile_calls():
    from hfkern.triton import layer_norm as ln

    B = 3

    def calls_of(x, w, b, rms, activation="none"):
        def calls():
            gy = torch.randn_like(x)
            if rms:
                _, rstd = ln.array_rms_norm(x, w, 1, 1e-5)
                for mask in ([True, True], [False, True], [True, False]):
                    ln.array_rms_norm_backward(gy, x, w, rstd, 1, mask)
            else:
                _, mean, rstd = ln.array_layer_norm(x, w, b, 1, 1e-5, activation)
                for mask in ([True, True, True], [False, True, True], [True, False, False]):
                    ln.array_layer_norm_backward(gy, x, w, mean, rstd, 1, mask, b, activation)

        return calls

    def data(D, dtype):
        return (torch.randn(B, 5, D, dtype=dtype), torch.randn(B, D, dtype=dtype),
                torch.randn(B, D, dtype=dtype))

    # a short row held whole, and one long enough to be swept in blocks
    row_lengths = (48, 20_000)
    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        for D in row_lengths:
            x, w, b = data(D, dtype)
            for rms in (False, True):
                for affine in (True, False):
                    yield f"{'rms' if rms else 'layer'} norm D={D}{' affine' if affine else ''} {dtype}", \
                        calls_of(x, w if affine else None, b if affine else None, rms)
    for activation, dtype in COMPILE_ACTIVATIONS:
        for D in row_lengths:
            yield f"layer norm +{activation} D={D} affine {dtype}", calls_of(*data(D, dtype), False, activation)
    # a transposed layout ([N, B, D] memory) and a 2-D normalized shape
    x = torch.randn(5, B, 8, 6).transpose(0, 1)
    yield "layer norm strided, 2-D shape", lambda: ln.array_layer_norm(x, torch.randn(B, 8, 6), None, 2, 1e-5)


def samples(device):
    def rand(*shape):
        return torch.randn(*shape, device=device)

    cases = [
        # x as an array conv leaves it ([N, B, ...] memory), D odd, weight and bias
        (rand(5, 3, 7, 13).transpose(0, 1), rand(3, 13), rand(3, 13), 1),
        # B = 1, a strided input, a 2-D normalized shape, weight only
        (rand(1, 4, 3, 22)[..., ::2], rand(1, 3, 11), None, 2),
        # no affine parameters
        (rand(2, 9, 5), None, None, 1),
    ]
    for x, w, b, nd in cases:
        yield "array_layer_norm", (x, w, b, nd, EPS)
        _, mean, rstd = torch.ops.hfkern.array_layer_norm(x, w, b, nd, EPS)
        gy = rand(*x.shape)
        affine = w is not None
        # every gradient, and the parameter gradient alone
        for mask in [[True, affine, b is not None]] + ([[False, True, False]] if affine else []):
            yield "array_layer_norm_backward", (gy, x, w, mean, rstd, nd, mask)
        yield "array_rms_norm", (x, w, nd, EPS)
        _, rstd = torch.ops.hfkern.array_rms_norm(x, w, nd, EPS)
        yield "array_rms_norm_backward", (gy, x, w, rstd, nd, [True, affine])


FAMILY = Family(
    name="layer_norm",
    summary="array layer norm and RMS norm over the trailing dims, forward and backward",
    shapes=SHAPES,
    smoke_shapes=SMOKE_SHAPES,
    quick_directions=("fwd", "bwd"),
    make_data=make_data,
    cost=cost,
    backend_impl=HfkernLayerNorm,
    baselines={"cuda": _cuda_backend, "loop": LoopLayerNorm, **unfused_baselines(UnfusedLayerNorm)},
    compile_calls=compile_calls,
    samples=samples,
    suites={"bytes": Suite(BYTES_SHAPES, BYTES_SMOKE_SHAPES, quick_directions=("fwd+bwd", "fwd"))},
)
