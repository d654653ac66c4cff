"""Array layer norm and RMS norm (``hfkern::array_layer_norm``, ``array_rms_norm`` and their backward ops).

Benchmark suite: the layer norms of BERT-base (hidden 768, sequence 128 and
512) and of a small transformer language model (d_model 256 and 512), over the
last dim of ``[batch, seq, D]`` activations. Baseline: ``loop``, B separate
``F.layer_norm`` calls.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from . import Family, Impl, Loop, leaf

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

    @property
    def rows(self) -> int:
        return self.batch * self.seq

    def describe(self) -> str:
        return f"[{self.batch}, {self.seq}, {self.D}] (rows {self.rows})"


SHAPES: list[LayerNormShape] = [
    LayerNormShape("bert-base", "seq128", 32, 128, 768, quick=True),
    LayerNormShape("bert-base", "seq512", 8, 512, 768),
    LayerNormShape("lm-small", "d256", 32, 256, 256),
    LayerNormShape("lm-small", "d512", 16, 512, 512, quick=True),
]
SMOKE_SHAPES = [LayerNormShape("smoke", "ln", 2, 5, 12)]


def make_data(s: LayerNormShape, B: int, dtype: torch.dtype, device, grad: bool) -> dict:
    """x, gy: [B, rows, D]; w, b: [B, D]."""
    x = torch.randn(B, s.rows, s.D, device=device, dtype=dtype)
    w = 1 + 0.1 * torch.randn(B, s.D, device=device, dtype=dtype)
    b = 0.1 * torch.randn(B, s.D, device=device, dtype=dtype)
    gy = torch.randn(B, s.rows, s.D, device=device, dtype=dtype) if grad else None
    return {"B": B, "x": x, "w": w, "b": b, "gy": gy}


def cost(s: LayerNormShape, B: int, elem: int) -> tuple:
    rows, n, p = B * s.rows, B * s.rows * s.D, B * s.D
    fwd = (elem * (2 * n + 2 * p) + 8 * rows, None)  # x, w, b in; y, mean, rstd out
    bwd = (elem * (3 * n + 3 * p) + 8 * rows, None)  # gy, x, w, mean, rstd in; gx, gw, gb out
    return fwd, bwd


class HfkernLayerNorm(Impl):
    kind = "backend"

    def __init__(self, s, backend: str):
        self.s = s
        self.name = self.backend = backend

    def inputs(self, d, grad):
        x, w, b = d["x"], d["w"], d["b"]
        if grad:
            x, w, b = leaf(x), leaf(w), leaf(b)
        return (x, w, b), [x, w, b]

    def forward(self, args):
        x, w, b = args
        return [torch.ops.hfkern.array_layer_norm(x, w, b, 1, EPS)[0]]


class LoopLayerNorm(Loop):
    def inputs(self, d, grad):
        xs, ws, bs = self.per_model(d, ("x", "w", "b"), grad)
        return (xs, ws, bs), xs + ws + bs

    def forward(self, args):
        return [F.layer_norm(x, (self.s.D,), w, b, EPS) for x, w, b in zip(*args)]


# ---- the launchers' code paths and the op samples --------------------------------

def compile_calls():
    from hfkern.triton import layer_norm as ln

    B = 3
    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        # a short row held whole, and one long enough to be swept in blocks
        for D in (48, 20_000):
            x = torch.randn(B, 5, D, dtype=dtype)
            w = torch.randn(B, D, dtype=dtype)
            b = torch.randn(B, D, dtype=dtype)
            for rms in (False, True):
                for affine in (True, False):
                    def calls(x=x, w=w if affine else None, b=b if affine else None, rms=rms):
                        gy = torch.randn_like(x)
                        if rms:
                            y, rstd = ln.array_rms_norm(x, w, 1, 1e-5)
                            for mask in ([True, True], [False, True], [True, False]):
                                ln.array_rms_norm_backward(gy, x, w, rstd, 1, mask)
                        else:
                            y, mean, rstd = ln.array_layer_norm(x, w, b, 1, 1e-5)
                            for mask in ([True, True, True], [False, True, True], [True, False, False]):
                                ln.array_layer_norm_backward(gy, x, w, mean, rstd, 1, mask)

                    yield f"{'rms' if rms else 'layer'} norm D={D}{' affine' if affine else ''} {dtype}", calls
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
    baselines={"loop": LoopLayerNorm},
    compile_calls=compile_calls,
    samples=samples,
)
