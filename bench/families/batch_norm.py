"""Array batch norm (``hfkern::array_batch_norm`` and its backward op).

Benchmark suite: the BatchNorm2d layers of the convolutional workloads hfkern
fuses, in training mode, on the ``[N, B, C, H, W]`` memory an array conv
leaves: ResNet-18 for CIFAR-10, MobileNetV2 for CIFAR-10 and DCGAN at 64x64.
Baselines: ``grouped``, torch's batch norm on the grouped view
``[N, B*C, H, W]`` (the original horizontally fused training's method), and
``loop``, B separate ``F.batch_norm`` calls.

Suite ``bytes``: the published workloads' batch norms at their own batch sizes
(bench/models, size full) in both array layouts (``@nchw`` / ``@nhwc`` layer
suffix, with the ``convert`` row): ResNet-18 for CIFAR-10 at batch 128 (each
stage), PointNet's BatchNorm1d over ``[N, C, P]`` at batch 32 x 2,500 points
(64, 128 and 1024 channels), MobileNetV2 at batch 128; and with the activation
that follows them fused (``activation``, the ``+relu`` / ``+gelu`` layer
suffix), against ``unfused_<backend>``: the op with activation "none" under
that backend, then ``torch.relu`` / ``F.gelu``. With an activation, ``grouped``
and ``loop`` run it unfused after their batch norm too.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

import torch
import torch.nn.functional as F

from . import (
    LAYOUTS,
    Activated,
    Family,
    FusedNorm,
    Impl,
    LayoutConversion,
    Loop,
    Suite,
    UnfusedNorm,
    array_randn,
    leaf,
    cuda_baseline,
    unfused_baselines,
)

EPS, MOMENTUM = 1e-5, 0.1


@dataclass(frozen=True)
class BatchNormShape:
    """One model's BatchNorm2d over ``[N, C, H, W]`` activations (``H=None``:
    BatchNorm1d over ``[N, C, W]``).

    ``layout``: None for an array conv's own ``[N, B, C, *S]`` memory, or one of
    families.LAYOUTS (the layout axis, with the conversion row). ``activation``:
    "none", or the activation fused into the op ("relu", "gelu").
    """

    model: str
    layer: str
    N: int
    C: int
    H: int | None
    W: int
    quick: bool = False
    layout: str | None = None
    activation: str = "none"

    @property
    def spatial(self) -> tuple[int, ...]:
        return (self.W,) if self.H is None else (self.H, self.W)

    def describe(self) -> str:
        act = f" +{self.activation}" if self.activation != "none" else ""
        lay = f" {self.layout}" if self.layout else ""
        return f"[{', '.join(map(str, (self.N, self.C, *self.spatial)))}]{act}{lay}"


SHAPES: list[BatchNormShape] = [
    BatchNormShape("resnet18-cifar", "layer1.bn", 32, 64, 32, 32, quick=True),
    BatchNormShape("resnet18-cifar", "layer2.bn", 32, 128, 16, 16),
    BatchNormShape("resnet18-cifar", "layer3.bn", 32, 256, 8, 8, quick=True),
    BatchNormShape("resnet18-cifar", "layer4.bn", 32, 512, 4, 4),
    BatchNormShape("mobilenetv2-cifar", "expand96.bn", 32, 96, 32, 32),
    BatchNormShape("mobilenetv2-cifar", "expand384.bn", 32, 384, 8, 8, quick=True),
    BatchNormShape("mobilenetv2-cifar", "expand960.bn", 32, 960, 4, 4),
    BatchNormShape("dcgan-64", "G.bn256", 64, 256, 8, 8),
    BatchNormShape("dcgan-64", "G.bn64", 64, 64, 32, 32),
]
SMOKE_SHAPES = [BatchNormShape("smoke", "bn", 3, 5, 4, 3)]


def variants(shapes, activations=("none",)) -> list:
    """Each shape once per array layout and activation; both in the layer name
    (``layer1.bn+relu@nhwc``), as the result tables key a case by model and layer."""
    out = []
    for s in shapes:
        for act in activations:
            for layout in LAYOUTS:
                name = s.layer + ("" if act == "none" else f"+{act}") + f"@{layout}"
                out.append(replace(s, layer=name, layout=layout, activation=act))
    return out


def _bytes_suite() -> list[BatchNormShape]:
    """The published workloads' batch norms at their own batch sizes (bench/models, size full).

    Every one is followed by a ReLU in its model (MobileNetV2's ReLU6 is the
    nearest fusable activation, ReLU); GELU on the widest of each model shows
    a fused activation that costs arithmetic.
    """
    r, p, m = "resnet18", "pointnet", "mobilenet_v2"
    quick = {"layer1.bn+relu@nchw", "layer1.bn+relu@nhwc", "layer1.bn@nchw", "layer1.bn@nhwc",
             "bn3+relu@nchw", "bn3+relu@nhwc"}
    shapes = variants([
        BatchNormShape(r, "layer1.bn", 128, 64, 32, 32),
        BatchNormShape(p, "bn3", 32, 1024, None, 2500),
    ], ("none", "relu", "gelu")) + variants([
        BatchNormShape(r, "layer2.bn", 128, 128, 16, 16),
        BatchNormShape(r, "layer3.bn", 128, 256, 8, 8),
        BatchNormShape(r, "layer4.bn", 128, 512, 4, 4),
        BatchNormShape(p, "bn1", 32, 64, None, 2500),
        BatchNormShape(p, "bn2", 32, 128, None, 2500),
        BatchNormShape(m, "stem.bn", 128, 32, 16, 16),
        BatchNormShape(m, "features.2.expand.bn", 128, 96, 16, 16),
        BatchNormShape(m, "features.3.expand.bn", 128, 144, 8, 8),
    ], ("none", "relu"))
    return [replace(s, quick=s.layer in quick) for s in shapes]


BYTES_SHAPES = _bytes_suite()
BYTES_SMOKE_SHAPES = (variants([BatchNormShape("smoke", "bn", 3, 5, 4, 3)], ("none", "relu", "gelu"))
                      + variants([BatchNormShape("smoke", "bn1d", 3, 4, None, 7)], ("relu",)))


def make_data(s: BatchNormShape, B: int, dtype: torch.dtype, device, grad: bool) -> dict:
    """x, gy: [B, N, C, *S] views of [N, B, C, *S] memory (an array conv's
    output; ``s.layout`` "nhwc": of [N, *S, B, C] memory); w, b and the running
    statistics: [B, C] in float32 (float64 for float64 x), as mixed-precision
    training keeps them."""
    layout = s.layout or "nchw"
    x = array_randn(B, s.N, s.C, s.spatial, layout, dtype=dtype, device=device)
    stats = torch.float64 if dtype == torch.float64 else torch.float32
    w = 1 + 0.1 * torch.randn(B, s.C, device=device, dtype=stats)
    b = 0.1 * torch.randn(B, s.C, device=device, dtype=stats)
    rm = torch.zeros(B, s.C, device=device, dtype=stats)
    rv = torch.ones(B, s.C, device=device, dtype=stats)
    gy = array_randn(B, s.N, s.C, s.spatial, layout, dtype=dtype, device=device) if grad else None
    return {"B": B, "x": x, "w": w, "b": b, "rm": rm, "rv": rv, "gy": gy}


def cost(s: BatchNormShape, B: int, elem: int) -> tuple:
    """The op's least bytes; a fused activation moves nothing more (its backward
    recomputes the pre-activation from x and reads b as well)."""
    n, p = B * s.N * s.C * math.prod(s.spatial), B * s.C
    fused = 4 * p if s.activation != "none" else 0
    fwd = (elem * 2 * n + 4 * 8 * p, None)  # x in, y out; w, b, stats read and written, mean/rstd out
    bwd = (elem * 3 * n + 4 * 5 * p + fused, None)  # gy, x in, gx out; w, (b,) mean, rstd in, gw, gb out
    return fwd, bwd


class _Activated(Activated):
    cost = staticmethod(cost)


class HfkernBatchNorm(FusedNorm):
    extra_inputs = ("rm", "rv")

    def norm(self, args, activation):
        from hfkern.ops.batch_norm import array_batch_norm

        x, w, b, rm, rv = args
        return array_batch_norm(x, w, b, rm, rv, None, True, MOMENTUM, EPS, activation)[0]


class UnfusedBatchNorm(_Activated, UnfusedNorm, HfkernBatchNorm):
    """The hfkern op with activation "none" under ``backend``, then the activation in torch."""


def _conversion(s: BatchNormShape):
    if s.layout is None:
        return None
    return LayoutConversion(s.layout, s.N, (s.C, *s.spatial), (s.C, *s.spatial))


class GroupedBatchNorm(_Activated, Impl):
    """torch's batch norm on the ``[N, B*C, H, W]`` view of ``[N, B, C, H, W]`` memory."""

    name = "grouped"

    def __init__(self, s):
        self.s = s

    def inputs(self, d, grad):
        x, w, b = (t.transpose(0, 1) if t.dim() > 2 else t for t in (d["x"], d["w"], d["b"]))
        if grad:
            x, w, b = leaf(x), leaf(w), leaf(b)
        return (x, w, b, d["rm"].view(-1), d["rv"].view(-1)), [x, w, b]

    def forward(self, args):
        x, w, b, rm, rv = args  # x: [N, B, C, *S]
        N, B, C = x.shape[:3]
        y = F.batch_norm(x.reshape(N, B * C, *x.shape[3:]), rm, rv, w.reshape(-1), b.reshape(-1),
                         True, MOMENTUM, EPS)
        return [self.activate(y).view(x.shape)]

    def grad_outputs(self, d):
        return [d["gy"].transpose(0, 1)]

    def canon_out(self, outs):
        return outs[0].transpose(0, 1)

    def canon_grads(self, grads):
        gx, gw, gb = grads
        return [gx.transpose(0, 1), gw, gb]


class LoopBatchNorm(_Activated, Loop):
    def inputs(self, d, grad):
        xs, ws, bs = self.per_model(d, ("x", "w", "b"), grad)
        stats = [list(d["rm"].unbind(0)), list(d["rv"].unbind(0))]
        return (xs, ws, bs, *stats), xs + ws + bs

    def forward(self, args):
        return [self.activate(F.batch_norm(x, rm, rv, w, b, True, MOMENTUM, EPS)) for x, w, b, rm, rv in zip(*args)]


# ---- the launchers' code paths and the op samples --------------------------------

# The fused activations' kernel variants (forward normalize, backward partial sums and
# grad_x, which recompute z), each once: ReLU in float32, GELU in bfloat16.
COMPILE_ACTIVATIONS = (("relu", torch.float32), ("gelu", torch.bfloat16))


def compile_calls():
    from hfkern.triton import batch_norm as bn

    B, N, C = 3, 4, 6
    layouts = {
        "conv output": lambda dtype: torch.randn(N, B, C, 5, 3, dtype=dtype).transpose(0, 1),
        "contiguous 1d": lambda dtype: torch.randn(B, N, C, dtype=dtype),
        "channels-last": lambda dtype: torch.randn(B, N, 5, 3, C, dtype=dtype).permute(0, 1, 4, 2, 3),
    }

    def calls_of(x, training, affine, activation="none"):
        def calls():
            dtype = x.dtype
            w = torch.randn(B, C, dtype=dtype) if affine else None
            b = torch.randn(B, C, dtype=dtype) if affine else None
            rm, rv = torch.randn(B, C), torch.rand(B, C) + 0.5
            nbt = torch.full((B,), 2, dtype=torch.long)
            _, mean, rstd = bn.array_batch_norm(x, w, b, rm, rv, nbt, training, None, EPS, activation)
            gy = torch.randn_like(x)
            for mask in ([True, affine, affine], [False, affine, True], [True, False, False]):
                bn.array_batch_norm_backward(gy, x, w, mean, rstd, training, mask, b, activation)

        return calls

    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        for layout, make in layouts.items():
            for training in (True, False):
                for affine in (True, False):
                    yield f"batch norm {layout}{' training' if training else ' eval'}" \
                          f"{' affine' if affine else ''} {dtype}", calls_of(make(dtype), training, affine)
    for activation, dtype in COMPILE_ACTIVATIONS:
        for training in (True, False):
            yield f"batch norm +{activation}{' training' if training else ' eval'} affine {dtype}", \
                calls_of(layouts["conv output"](dtype), training, True, activation)
    # training without running statistics
    x = layouts["conv output"](torch.float32)
    yield "batch norm, no running statistics", lambda: bn.array_batch_norm(
        x, None, None, None, None, None, True, MOMENTUM, EPS)


def samples(device):
    def rand(*shape):
        return torch.randn(*shape, device=device)

    def stats(B, C):
        return rand(B, C), torch.rand(B, C, device=device) + 0.5

    nbt = torch.tensor([3], device=device)
    cases = [
        # an array conv's [N, B, C, H, W] memory, odd sizes, affine, momentum
        (rand(5, 3, 7, 3, 5).transpose(0, 1), rand(3, 7), rand(3, 7), *stats(3, 7), None, True, MOMENTUM),
        # B = 1, BatchNorm1d on [B, N, C], momentum None (cumulative average)
        (rand(1, 9, 4), rand(1, 4), None, *stats(1, 4), nbt, True, None),
        # a strided input, no affine parameters, eval
        (rand(2, 4, 3, 6, 2)[:, :, :, ::2], None, None, *stats(2, 3), None, False, MOMENTUM),
    ]
    for x, w, b, rm, rv, n, training, momentum in cases:
        yield "array_batch_norm", (x, w, b, rm, rv, n, training, momentum, EPS)
        _, mean, rstd = torch.ops.hfkern.array_batch_norm(x, w, b, rm.clone(), rv.clone(), n, training,
                                                          momentum, EPS)
        affine = w is not None
        for mask in [[True, affine, b is not None]] + ([[False, True, False]] if affine else []):
            yield "array_batch_norm_backward", (rand(*x.shape), x, w, mean, rstd, training, mask)


FAMILY = Family(
    name="batch_norm",
    summary="array batch norm with per-model running statistics, forward and backward",
    shapes=SHAPES,
    smoke_shapes=SMOKE_SHAPES,
    quick_directions=("fwd+bwd", "fwd"),
    make_data=make_data,
    cost=cost,
    backend_impl=HfkernBatchNorm,
    baselines={"grouped": GroupedBatchNorm, "loop": LoopBatchNorm, "convert": _conversion,
               "cuda": cuda_baseline(HfkernBatchNorm),
               **unfused_baselines(UnfusedBatchNorm)},
    compile_calls=compile_calls,
    samples=samples,
    suites={"bytes": Suite(BYTES_SHAPES, BYTES_SMOKE_SHAPES)},
)
