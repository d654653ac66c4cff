"""Array batch norm (``hfkern::array_batch_norm`` and its backward op).

Benchmark suite: the BatchNorm2d layers of the convolutional workloads hfkern
fuses, in training mode, on the ``[N, B, C, H, W]`` memory an array conv
leaves: ResNet-18 for CIFAR-10, MobileNetV2 for CIFAR-10 and DCGAN at 64x64.
Baselines: ``grouped``, torch's batch norm on the grouped view
``[N, B*C, H, W]`` (the original horizontally fused training's method), and
``loop``, B separate ``F.batch_norm`` calls.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from . import Family, Impl, Loop, leaf

EPS, MOMENTUM = 1e-5, 0.1


@dataclass(frozen=True)
class BatchNormShape:
    """One model's BatchNorm2d over ``[N, C, H, W]`` activations."""

    model: str
    layer: str
    N: int
    C: int
    H: int
    W: int
    quick: bool = False

    def describe(self) -> str:
        return f"[{self.N}, {self.C}, {self.H}, {self.W}]"


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


def make_data(s: BatchNormShape, B: int, dtype: torch.dtype, device, grad: bool) -> dict:
    """x, gy: [B, N, C, H, W] views of [N, B, C, H, W] memory (an array conv's
    output); w, b and the running statistics: [B, C] in float32 (float64 for
    float64 x), as mixed-precision training keeps them."""
    x = torch.randn(s.N, B, s.C, s.H, s.W, device=device, dtype=dtype).transpose(0, 1)
    stats = torch.float64 if dtype == torch.float64 else torch.float32
    w = 1 + 0.1 * torch.randn(B, s.C, device=device, dtype=stats)
    b = 0.1 * torch.randn(B, s.C, device=device, dtype=stats)
    rm = torch.zeros(B, s.C, device=device, dtype=stats)
    rv = torch.ones(B, s.C, device=device, dtype=stats)
    gy = torch.randn(s.N, B, s.C, s.H, s.W, device=device, dtype=dtype).transpose(0, 1) if grad else None
    return {"B": B, "x": x, "w": w, "b": b, "rm": rm, "rv": rv, "gy": gy}


def cost(s: BatchNormShape, B: int, elem: int) -> tuple:
    n, p = B * s.N * s.C * s.H * s.W, B * s.C
    fwd = (elem * 2 * n + 4 * 8 * p, None)  # x in, y out; w, b, stats read and written, mean/rstd out
    bwd = (elem * 3 * n + 4 * 5 * p, None)  # gy, x in, gx out; w, mean, rstd in, gw, gb out
    return fwd, bwd


class HfkernBatchNorm(Impl):
    kind = "backend"

    def __init__(self, s, backend: str):
        self.s = s
        self.name = self.backend = backend

    def inputs(self, d, grad):
        x, w, b = d["x"], d["w"], d["b"]
        if grad:
            x, w, b = leaf(x), leaf(w), leaf(b)
        return (x, w, b, d["rm"], d["rv"]), [x, w, b]

    def forward(self, args):
        from hfkern.ops.batch_norm import array_batch_norm

        x, w, b, rm, rv = args
        return [array_batch_norm(x, w, b, rm, rv, None, True, MOMENTUM, EPS)[0]]


class GroupedBatchNorm(Impl):
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
        x, w, b, rm, rv = args  # x: [N, B, C, H, W]
        N, B, C = x.shape[:3]
        y = F.batch_norm(x.reshape(N, B * C, *x.shape[3:]), rm, rv, w.reshape(-1), b.reshape(-1),
                         True, MOMENTUM, EPS)
        return [y.view(x.shape)]

    def grad_outputs(self, d):
        return [d["gy"].transpose(0, 1)]

    def canon_out(self, outs):
        return outs[0].transpose(0, 1)

    def canon_grads(self, grads):
        gx, gw, gb = grads
        return [gx.transpose(0, 1), gw, gb]


class LoopBatchNorm(Loop):
    def inputs(self, d, grad):
        xs, ws, bs = self.per_model(d, ("x", "w", "b"), grad)
        stats = [list(d["rm"].unbind(0)), list(d["rv"].unbind(0))]
        return (xs, ws, bs, *stats), xs + ws + bs

    def forward(self, args):
        return [F.batch_norm(x, rm, rv, w, b, True, MOMENTUM, EPS) for x, w, b, rm, rv in zip(*args)]


# ---- the launchers' code paths and the op samples --------------------------------

def compile_calls():
    from hfkern.triton import batch_norm as bn

    B, N, C = 3, 4, 6
    layouts = {
        "conv output": lambda dtype: torch.randn(N, B, C, 5, 3, dtype=dtype).transpose(0, 1),
        "contiguous 1d": lambda dtype: torch.randn(B, N, C, dtype=dtype),
        "channels-last": lambda dtype: torch.randn(B, N, 5, 3, C, dtype=dtype).permute(0, 1, 4, 2, 3),
    }
    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        for layout, make in layouts.items():
            for training in (True, False):
                for affine in (True, False):
                    def calls(x=make(dtype), training=training, affine=affine):
                        w = torch.randn(B, C, dtype=dtype) if affine else None
                        b = torch.randn(B, C, dtype=dtype) if affine else None
                        rm, rv = torch.randn(B, C), torch.rand(B, C) + 0.5
                        nbt = torch.full((B,), 2, dtype=torch.long)
                        _, mean, rstd = bn.array_batch_norm(x, w, b, rm, rv, nbt, training, None, EPS)
                        gy = torch.randn_like(x)
                        for mask in ([True, affine, affine], [False, affine, True], [True, False, False]):
                            bn.array_batch_norm_backward(gy, x, w, mean, rstd, training, mask)

                    yield f"batch norm {layout}{' training' if training else ' eval'}" \
                          f"{' affine' if affine else ''} {dtype}", calls
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
    baselines={"grouped": GroupedBatchNorm, "loop": LoopBatchNorm},
    compile_calls=compile_calls,
    samples=samples,
)
