"""Array convolution (``hfkern::array_conv`` and its input- and weight-gradient ops).

Benchmark suite: ResNet-18 for CIFAR-10 (32x32 input; every distinct 3x3 conv
and the 1x1 stride-2 downsample convs), a representative subset of MobileNetV2
for CIFAR-10 (1x1 expansions and projections, depthwise 3x3 with ``groups =
C``), and DCGAN at 64x64 (the generator's 4x4 stride-2 ConvTranspose2d layers,
the discriminator's 4x4 stride-2 Conv2d layers), each with its model's
per-model batch size.

``cuda``: the op under the cuda backend (our direct depthwise kernels for the
depthwise layers, cuDNN for every other conv), where that backend is available.

Baselines: ``grouped_nchw`` / ``grouped_nhwc``, one ``F.conv2d`` (or
``F.conv_transpose2d``) with ``groups = B * groups`` on ``[N, B*C, H, W]`` in
NCHW and in channels-last memory, ``grouped_best`` the faster of the two per
case; ``vmap``, ``torch.func.vmap`` of the per-model call over the stacked
parameters; ``loop``, B separate per-model calls.

Suite ``bytes``: the published workloads (bench/models at size ``full``) at
their own batch sizes, each layer in both array layouts (``layout``, the
layer's ``@nchw`` / ``@nhwc`` suffix): ResNet-18 for CIFAR-10 at batch 128 (the
stem and each stage's 3x3 conv), PointNet at batch 32 x 2,500 points (its three
1x1 Conv1d layers, 3 -> 64 -> 128 -> 1024), MobileNetV2 on 32x32 inputs at
batch 128 (the stride-2 stem leaves 16x16: expansion, depthwise and
projection of its first blocks). Its ``convert`` row is the cost of converting
the activations to the other layout and back (families.LayoutConversion).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

import torch
import torch.nn.functional as F

from . import (
    LAYOUTS,
    Family,
    Fastest,
    Impl,
    LayoutConversion,
    Loop,
    Suite,
    array_randn,
    cuda_baseline,
    leaf,
    to_layout,
)


@dataclass(frozen=True)
class ConvShape:
    """One model's 2-D convolution (or transposed convolution) layer.

    Input ``[N, C_in, H, W]``, weight ``[C_out, C_in/groups, k, k]``
    (transposed: ``[C_in, C_out/groups, k, k]``); square kernels, symmetric
    padding, no dilation. ``H=None``: a 1-D convolution over ``[N, C_in, W]``
    (PointNet's Conv1d over points).

    ``layout``: None for the array conv's own ``[N, B, C, *S]`` memory; "nchw" or
    "nhwc" (families.LAYOUTS) put the layer on the layout axis, inputs and output
    gradients in that memory, with the conversion row beside it.
    """

    model: str
    layer: str
    N: int
    C_in: int
    C_out: int
    H: int
    W: int
    kernel: int
    stride: int = 1
    padding: int = 0
    groups: int = 1
    transposed: bool = False
    output_padding: int = 0
    bias: bool = False
    quick: bool = False
    layout: str | None = None

    @property
    def spatial(self) -> tuple[int, ...]:
        return (self.W,) if self.H is None else (self.H, self.W)

    @property
    def nd(self) -> int:
        return len(self.spatial)

    def out_hw(self) -> tuple[int, ...]:
        """The output's spatial size, (H_out, W_out) (1-D: (W_out,))."""
        k, s, p = self.kernel, self.stride, self.padding
        if self.transposed:
            return tuple((i - 1) * s - 2 * p + k + self.output_padding for i in self.spatial)
        return tuple((i + 2 * p - k) // s + 1 for i in self.spatial)

    def macs(self) -> int:
        """Multiply-accumulates of one model's forward pass.

        A transposed convolution is the adjoint of the convolution from its
        output to its input, so it does that convolution's MACs.
        """
        taps = self.kernel ** self.nd
        if self.transposed:
            return self.N * self.C_in * math.prod(self.spatial) * (self.C_out // self.groups) * taps
        return self.N * self.C_out * math.prod(self.out_hw()) * (self.C_in // self.groups) * taps

    def weight_shape(self) -> tuple[int, ...]:
        k = (self.kernel,) * self.nd
        if self.transposed:
            return (self.C_in, self.C_out // self.groups, *k)
        return (self.C_out, self.C_in // self.groups, *k)

    def describe(self) -> str:
        kind = "convT" if self.transposed else ("dwconv" if self.groups == self.C_in == self.C_out > 1 else "conv")
        if self.nd == 1:
            kind += "1d"
        g = f" g{self.groups}" if self.groups > 1 else ""
        size = "x".join(map(str, self.spatial)) + "->" + "x".join(map(str, self.out_hw()))
        lay = f" {self.layout}" if self.layout else ""
        return (f"{kind} N={self.N} {self.C_in}->{self.C_out} {size} "
                f"k{self.kernel} s{self.stride} p{self.padding}{g}{lay}")


def _resnet18_cifar(N: int = 32) -> list[ConvShape]:
    m = "resnet18-cifar"
    c = lambda layer, ci, co, hw, k, s, p, quick=False: ConvShape(  # noqa: E731
        m, layer, N, ci, co, hw, hw, k, s, p, quick=quick
    )
    return [
        c("conv1", 3, 64, 32, 3, 1, 1),
        c("layer1.conv", 64, 64, 32, 3, 1, 1, quick=True),
        c("layer2.0.conv1", 64, 128, 32, 3, 2, 1, quick=True),
        c("layer2.conv", 128, 128, 16, 3, 1, 1),
        c("layer2.0.downsample", 64, 128, 32, 1, 2, 0),
        c("layer3.0.conv1", 128, 256, 16, 3, 2, 1),
        c("layer3.conv", 256, 256, 8, 3, 1, 1, quick=True),
        c("layer3.0.downsample", 128, 256, 16, 1, 2, 0),
        c("layer4.0.conv1", 256, 512, 8, 3, 2, 1),
        c("layer4.conv", 512, 512, 4, 3, 1, 1),
        c("layer4.0.downsample", 256, 512, 8, 1, 2, 0, quick=True),
    ]


def _mobilenetv2_cifar(N: int = 32) -> list[ConvShape]:
    # The CIFAR variant keeps 32x32 through the 24-channel stage (stride 1
    # there), then halves at the 32-, 64- and 160-channel stages.
    m = "mobilenetv2-cifar"

    def pw(layer, ci, co, hw, quick=False):
        return ConvShape(m, layer, N, ci, co, hw, hw, 1, quick=quick)

    def dw(layer, c, hw, s=1, quick=False):
        return ConvShape(m, layer, N, c, c, hw, hw, 3, s, 1, groups=c, quick=quick)

    return [
        ConvShape(m, "stem", N, 3, 32, 32, 32, 3, 1, 1),
        pw("block2.expand", 16, 96, 32, quick=True),
        dw("block2.dw", 96, 32, quick=True),
        pw("block2.project", 96, 24, 32),
        dw("block4.dw_s2", 144, 32, s=2),
        pw("block4.project", 144, 32, 16),
        pw("block8.expand", 64, 384, 8),
        dw("block8.dw", 384, 8, quick=True),
        pw("block8.project", 384, 64, 8),
        pw("block15.expand", 160, 960, 4),
        dw("block15.dw", 960, 4),
        pw("block15.project", 960, 160, 4, quick=True),
        pw("head", 320, 1280, 4),
    ]


def _dcgan(N: int = 64) -> list[ConvShape]:
    m = "dcgan-64"

    def g(layer, ci, co, hw, quick=False):  # 4x4 stride 2 padding 1: doubles H and W
        return ConvShape(m, layer, N, ci, co, hw, hw, 4, 2, 1, transposed=True, quick=quick)

    def d(layer, ci, co, hw, quick=False):  # 4x4 stride 2 padding 1: halves H and W
        return ConvShape(m, layer, N, ci, co, hw, hw, 4, 2, 1, quick=quick)

    return [
        g("G.convT2", 512, 256, 4),
        g("G.convT3", 256, 128, 8, quick=True),
        g("G.convT4", 128, 64, 16),
        g("G.convT5", 64, 3, 32),
        d("D.conv1", 3, 64, 64),
        d("D.conv2", 64, 128, 32, quick=True),
        d("D.conv3", 128, 256, 16),
        d("D.conv4", 256, 512, 8),
    ]


SHAPES: list[ConvShape] = _resnet18_cifar() + _mobilenetv2_cifar() + _dcgan()


def on_layouts(shapes) -> list:
    """Each shape once per array layout, the layout in its layer name (``layer1.conv@nhwc``):
    the result tables key a case by model and layer."""
    return [replace(s, layout=layout, layer=f"{s.layer}@{layout}") for s in shapes for layout in LAYOUTS]


def _bytes_suite() -> list[ConvShape]:
    """The published workloads' convolutions at their own batch sizes (bench/models, size full)."""
    r = "resnet18"  # CIFAR ResNet-18, batch 128, 32x32

    def rc(layer, ci, co, hw, stride=1, quick=False):
        return ConvShape(r, layer, 128, ci, co, hw, hw, 3, stride, 1, quick=quick)

    p = "pointnet"  # batch 32 x 2,500 points; the Conv1d layers of the classifier (and its transforms)

    def pc(layer, ci, co, quick=False):
        return ConvShape(p, layer, 32, ci, co, None, 2500, 1, quick=quick)

    m = "mobilenet_v2"  # 32x32 inputs, batch 128; the stride-2 stem leaves 16x16

    def mpw(layer, ci, co, hw, quick=False):
        return ConvShape(m, layer, 128, ci, co, hw, hw, 1, quick=quick)

    def mdw(layer, c, hw, stride=1, quick=False):
        return ConvShape(m, layer, 128, c, c, hw, hw, 3, stride, 1, groups=c, quick=quick)

    return on_layouts([
        rc("conv1", 3, 64, 32),
        rc("layer1.conv", 64, 64, 32, quick=True),
        rc("layer2.conv", 128, 128, 16),
        rc("layer3.conv", 256, 256, 8, quick=True),
        rc("layer4.conv", 512, 512, 4),
        pc("conv1", 3, 64),
        pc("conv2", 64, 128),
        pc("conv3", 128, 1024, quick=True),
        ConvShape(m, "stem", 128, 3, 32, 32, 32, 3, 2, 1),
        mdw("features.1.dw", 32, 16),
        mpw("features.2.expand", 16, 96, 16),
        mdw("features.2.dw_s2", 96, 16, stride=2, quick=True),
        mpw("features.3.expand", 24, 144, 8),
        mdw("features.3.dw", 144, 8),
        mpw("features.3.project", 144, 24, 8),
    ])


BYTES_SHAPES = _bytes_suite()
BYTES_SMOKE_SHAPES = on_layouts([
    ConvShape("smoke", "conv3x3", 2, 3, 4, 6, 6, 3, 1, 1),
    ConvShape("smoke", "conv1d", 2, 3, 5, None, 7, 1),
])

# One of each code path (dense, strided 1x1, depthwise, transposed with bias) at a few KB each.
SMOKE_SHAPES: list[ConvShape] = [
    ConvShape("smoke", "conv3x3", 2, 3, 4, 6, 6, 3, 1, 1, bias=True),
    ConvShape("smoke", "downsample", 2, 4, 6, 6, 6, 1, 2, 0),
    ConvShape("smoke", "dw_s2", 2, 4, 4, 7, 7, 3, 2, 1, groups=4),
    ConvShape("smoke", "convT", 2, 4, 3, 3, 3, 4, 2, 1, transposed=True, bias=True),
]


def make_data(s: ConvShape, B: int, dtype: torch.dtype, device, grad: bool) -> dict:
    """x, gy: [B, N, C, *S] views of [N, B, C, *S] memory (the array conv's own
    layout; ``s.layout`` "nhwc": of [N, *S, B, C] memory), w: [B, *weight_shape]
    scaled by fan-in**-0.5 so fp16 stays in range, b: [B, C_out] or None."""
    layout = s.layout or "nchw"
    fan_in = math.prod(s.weight_shape()[1:])
    x = array_randn(B, s.N, s.C_in, s.spatial, layout, dtype=dtype, device=device)
    w = torch.randn(B, *s.weight_shape(), device=device, dtype=dtype) * fan_in**-0.5
    b = torch.randn(B, s.C_out, device=device, dtype=dtype) if s.bias else None
    gy = array_randn(B, s.N, s.C_out, s.out_hw(), layout, dtype=dtype, device=device) if grad else None
    return {"B": B, "x": x, "w": w, "b": b, "gy": gy}


def cost(s: ConvShape, B: int, elem: int) -> tuple:
    """FLOPs: 2 per multiply-accumulate; the backward does the input and the
    weight gradient, each as many MACs as the forward. Both layouts are dense:
    the same bytes."""
    x = B * s.N * s.C_in * math.prod(s.spatial)
    y = B * s.N * s.C_out * math.prod(s.out_hw())
    w = B * math.prod(s.weight_shape())
    b = B * s.C_out if s.bias else 0
    fwd = (elem * (x + w + b + y), 2 * B * s.macs())
    bwd = (elem * (y + x + w + x + w + b), 4 * B * s.macs())  # read gy, x, w; write gx, gw, gb
    return fwd, bwd


# ---- implementations ----------------------------------------------------------

class _ConvBase(Impl):
    def __init__(self, s: ConvShape):
        self.s = s
        self.stride, self.padding = (s.stride,) * s.nd, (s.padding,) * s.nd
        self.output_padding = (s.output_padding,) * s.nd

    def _call(self, x, w, b, groups):
        if self.s.transposed:
            conv_t = F.conv_transpose1d if self.s.nd == 1 else F.conv_transpose2d
            return conv_t(x, w, b, self.stride, self.padding, self.output_padding, groups)
        conv = F.conv1d if self.s.nd == 1 else F.conv2d
        return conv(x, w, b, self.stride, self.padding, 1, groups)


class HfkernConv(_ConvBase):
    kind = "backend"

    def __init__(self, s, backend: str):
        super().__init__(s)
        self.name = self.backend = backend

    def inputs(self, d, grad):
        x, w, b = d["x"], d["w"], d["b"]
        if grad:
            x, w, b = leaf(x), leaf(w), leaf(b)
        return (x, w, b), [t for t in (x, w, b) if t is not None]

    def forward(self, args):
        x, w, b = args
        s = self.s
        return [torch.ops.hfkern.array_conv(
            x, w, b, list(self.stride), list(self.padding), [1] * s.nd, s.transposed,
            list(self.output_padding), s.groups,
        )]


class GroupedConv(_ConvBase):
    """One grouped conv over [N, B*C, H, W]: the models are groups B*groups. Its
    inputs are converted to its layout before the timing (the ``convert`` row of
    a case on the layout axis says what that costs)."""

    def __init__(self, s, channels_last: bool):
        super().__init__(s)
        self.name = "grouped_nhwc" if channels_last else "grouped_nchw"
        self.layout = "nhwc" if channels_last else "nchw"

    def inputs(self, d, grad):
        s, B = self.s, d["B"]
        x = to_layout(d["x"].transpose(0, 1).reshape(s.N, B * s.C_in, *s.spatial), self.layout)
        w = to_layout(d["w"].reshape(B * d["w"].shape[1], *d["w"].shape[2:]), self.layout)
        b = None if d["b"] is None else d["b"].reshape(-1).contiguous()
        if grad:
            x, w, b = leaf(x), leaf(w), leaf(b)
        return (x, w, b, B * s.groups), [t for t in (x, w, b) if t is not None]

    def forward(self, args):
        x, w, b, groups = args
        return [self._call(x, w, b, groups)]

    def grad_outputs(self, d):
        gy = d["gy"]
        B, N, C = gy.shape[:3]
        return [to_layout(gy.transpose(0, 1).reshape(N, B * C, *gy.shape[3:]), self.layout)]

    def canon_out(self, outs):
        y = outs[0]
        N, BC = y.shape[:2]
        B = BC // self.s.C_out
        return y.reshape(N, B, self.s.C_out, *y.shape[2:]).transpose(0, 1)

    def canon_grads(self, grads):
        s = self.s
        gx, gw = grads[0], grads[1]
        N, BC = gx.shape[:2]
        B = BC // s.C_in
        out = [gx.reshape(N, B, s.C_in, *gx.shape[2:]).transpose(0, 1), gw.reshape(B, *s.weight_shape())]
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
            x, w, b = leaf(x), leaf(w), leaf(b)
        return (x, w, b), [t for t in (x, w, b) if t is not None]

    def forward(self, args):
        x, w, b = args
        return [self._no_bias(x, w) if b is None else self._with_bias(x, w, b)]

    def grad_outputs(self, d):
        return [d["gy"].contiguous()]


class LoopConv(Loop, _ConvBase):
    def __init__(self, s):
        _ConvBase.__init__(self, s)

    def inputs(self, d, grad):
        xs, ws, bs = self.per_model(d, ("x", "w", "b"), grad)
        return (xs, ws, bs), xs + ws + [t for t in bs if t is not None]

    def forward(self, args):
        return [self._call(x, w, b, self.s.groups) for x, w, b in zip(*args)]


# ---- the launchers' code paths and the op samples --------------------------------

def _geometry(nd, transposed, stride=1, padding=1, dilation=1, output_padding=0, groups=1):
    """The ops' trailing arguments: stride, padding, dilation, transposed, output_padding, groups."""
    return [stride] * nd, [padding] * nd, [dilation] * nd, transposed, [output_padding] * nd, groups


def _conversion(s: ConvShape):
    if s.layout is None:
        return None
    return LayoutConversion(s.layout, s.N, (s.C_in, *s.spatial), (s.C_out, *s.out_hw()))


def compile_calls():
    from hfkern.triton import conv

    B, N = 3, 2

    def case(nd, transposed, groups, shared, dtype, *, ci=4, co=6, stride=2, dilation=1, padding=1):
        sp = (7, 6)[-nd:]
        k = (3, 2)[-nd:]
        x = (torch.randn(N, ci, *sp, dtype=dtype) if shared
             else torch.randn(N, B, ci, *sp, dtype=dtype).transpose(0, 1))
        w = (torch.randn(B, ci, co // groups, *k, dtype=dtype) if transposed
             else torch.randn(B, co, ci // groups, *k, dtype=dtype))
        geom = _geometry(nd, transposed, stride, padding, dilation,
                         1 if transposed and stride > 1 else 0, groups)
        return x, w, torch.randn(B, co, dtype=dtype), geom

    variants = [
        # nd, transposed, groups, shared, stride, dilation
        (2, False, 1, False, 1, 1),
        (2, False, 2, False, 2, 2),
        (2, False, 1, True, 1, 1),  # shared input, groups 1: B weights folded into one GEMM
        (2, False, 2, True, 2, 1),
        (2, True, 1, False, 2, 1),  # phased
        (2, True, 2, False, 2, 2),  # transposed, dilated: masked taps
        (2, True, 1, True, 1, 1),
        (1, False, 1, False, 2, 1),
    ]
    torch.backends.cudnn.allow_tf32 = False  # fp32 as IEEE here; TF32 in the last case
    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        for nd, transposed, groups, shared, stride, dilation in variants:
            x, w, b, geom = case(nd, transposed, groups, shared, dtype, stride=stride, dilation=dilation)
            name = f"conv{nd}d{' transposed' if transposed else ''} g{groups}{' shared' if shared else ''} " \
                   f"s{stride} d{dilation} {dtype}"

            def calls(x=x, w=w, b=b, geom=geom):
                y = conv.array_conv(x, w, b, *geom)
                conv.array_conv_input_grad(torch.randn_like(y), w, list(x.shape), *geom)
                conv.array_conv_weight_grad(torch.randn_like(y), x, w, *geom)

            yield name, calls
    # fp32 with TF32 allowed (torch's default for convolutions)
    x, w, b, geom = case(2, False, 1, False, torch.float32)

    def tf32():
        before = torch.backends.cudnn.allow_tf32
        torch.backends.cudnn.allow_tf32 = True
        try:
            conv.array_conv(x, w, b, *geom)
        finally:
            torch.backends.cudnn.allow_tf32 = before

    yield "conv2d tf32", tf32


def samples(device):
    def rand(*shape):
        return torch.randn(*shape, device=device)

    def with_grads(x, w, b, geom):
        yield "array_conv", (x, w, b, *geom)
        y = torch.ops.hfkern.array_conv(x, w, b, *geom)
        gy = rand(y.shape[1], y.shape[0], *y.shape[2:]).transpose(0, 1)  # the layout the op returns
        yield "array_conv_input_grad", (gy, w, list(x.shape), *geom)
        yield "array_conv_weight_grad", (gy, x, w, *geom)

    # [B, N, C, H, W] view of [N, B, C, H, W] memory, as a previous array conv returns it
    yield from with_grads(rand(2, 3, 3, 5, 7).transpose(0, 1), rand(3, 5, 3, 3, 2) / 3, rand(3, 5),
                          _geometry(2, False))
    # B = 1, groups, stride and dilation, a strided input
    yield from with_grads(rand(1, 2, 4, 9, 14)[..., ::2], rand(1, 6, 2, 3, 3) / 3, None,
                          _geometry(2, False, stride=2, dilation=2, groups=2))
    # transposed, stride 2 with output padding, a shared input ([N, C, H, W], no array dim)
    yield from with_grads(rand(2, 4, 3, 5), rand(2, 4, 3, 2, 3) / 3, rand(2, 3),
                          _geometry(2, True, stride=2, output_padding=1))
    yield from with_grads(rand(3, 2, 5, 11), rand(3, 4, 5, 3) / 4, rand(3, 4), _geometry(1, False, stride=2))


FAMILY = Family(
    name="conv",
    summary="array 1-D/2-D convolution and transposed convolution (array_conv and its gradient ops)",
    shapes=SHAPES,
    smoke_shapes=SMOKE_SHAPES,
    quick_directions=("fwd+bwd", "fwd"),
    make_data=make_data,
    cost=cost,
    backend_impl=HfkernConv,
    baselines={
        "cuda": cuda_baseline(HfkernConv),
        "grouped_nchw": lambda s: GroupedConv(s, channels_last=False),
        "grouped_nhwc": lambda s: GroupedConv(s, channels_last=True),
        "grouped_best": Fastest(("grouped_nchw", "grouped_nhwc")),
        "vmap": VmapConv,
        "loop": LoopConv,
        "convert": _conversion,
    },
    compile_calls=compile_calls,
    samples=samples,
    suites={"bytes": Suite(BYTES_SHAPES, BYTES_SMOKE_SHAPES)},
)
