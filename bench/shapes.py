"""The benchmark's shape suite: the layers of the workloads hfkern fuses.

Each entry is one layer of one model, with that model's per-model batch size;
the array size B and the dtype are benchmark axes (``B_VALUES``, ``DTYPES``).

* Convolutions: ResNet-18 for CIFAR-10 (32x32 input; every distinct 3x3 conv
  and the 1x1 stride-2 downsample convs), a representative subset of
  MobileNetV2 for CIFAR-10 (1x1 expansions and projections, depthwise 3x3 with
  ``groups = C``), and DCGAN at 64x64 (the generator's 4x4 stride-2
  ConvTranspose2d layers, the discriminator's 4x4 stride-2 Conv2d layers).
* Layer norm: BERT-base (hidden 768, sequence 128 and 512) and a small
  transformer language model (d_model 256 and 512).
* Embedding: BERT-base's word and position tables, and a small language
  model's token table, with the token counts of a training batch.

Entries marked ``quick`` form the ``--quick`` subset. ``SMOKE_*`` are tiny
shapes that exercise every code path on the CPU in seconds.
"""

from __future__ import annotations

from dataclasses import dataclass

B_VALUES = (4, 8, 16)
QUICK_B_VALUES = (8,)
DTYPES = ("fp32", "bf16", "fp16")
OPS = ("conv", "layer_norm", "embedding")
DIRECTIONS = ("fwd", "bwd", "fwd+bwd")


@dataclass(frozen=True)
class ConvShape:
    """One model's 2-D convolution (or transposed convolution) layer.

    Input ``[N, C_in, H, W]``, weight ``[C_out, C_in/groups, k, k]``
    (transposed: ``[C_in, C_out/groups, k, k]``); square kernels, symmetric
    padding, no dilation.
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

    def out_hw(self) -> tuple[int, int]:
        k, s, p = self.kernel, self.stride, self.padding
        if self.transposed:
            return tuple((i - 1) * s - 2 * p + k + self.output_padding for i in (self.H, self.W))
        return tuple((i + 2 * p - k) // s + 1 for i in (self.H, self.W))

    def macs(self) -> int:
        """Multiply-accumulates of one model's forward pass.

        A transposed convolution is the adjoint of the convolution from its
        output to its input, so it does that convolution's MACs.
        """
        k2 = self.kernel * self.kernel
        if self.transposed:
            return self.N * self.C_in * self.H * self.W * (self.C_out // self.groups) * k2
        Ho, Wo = self.out_hw()
        return self.N * self.C_out * Ho * Wo * (self.C_in // self.groups) * k2

    def weight_shape(self) -> tuple[int, ...]:
        k = self.kernel
        if self.transposed:
            return (self.C_in, self.C_out // self.groups, k, k)
        return (self.C_out, self.C_in // self.groups, k, k)

    def describe(self) -> str:
        Ho, Wo = self.out_hw()
        kind = "convT" if self.transposed else ("dwconv" if self.groups == self.C_in == self.C_out > 1 else "conv")
        g = f" g{self.groups}" if self.groups > 1 else ""
        return (
            f"{kind} N={self.N} {self.C_in}->{self.C_out} {self.H}x{self.W}->{Ho}x{Wo} "
            f"k{self.kernel} s{self.stride} p{self.padding}{g}"
        )


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


@dataclass(frozen=True)
class EmbeddingShape:
    """One model's lookup of ``[batch, seq]`` indices in a ``[V, D]`` table.

    ``zipf``: 0 draws the indices uniformly over the table; s > 0 draws index r
    with probability proportional to ``1 / (r + 1) ** s``, as token frequencies
    of natural text roughly follow (s about 1), so a few rows are hit very often.
    """

    model: str
    layer: str
    V: int
    D: int
    batch: int
    seq: int
    quick: bool = False
    zipf: float = 0.0

    @property
    def tokens(self) -> int:
        return self.batch * self.seq

    def describe(self) -> str:
        dist = f", Zipf s={self.zipf:g}" if self.zipf else ""
        return f"table {self.V}x{self.D}, idx [{self.batch}, {self.seq}] ({self.tokens} tokens{dist})"


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


CONV_SHAPES: list[ConvShape] = _resnet18_cifar() + _mobilenetv2_cifar() + _dcgan()

LAYER_NORM_SHAPES: list[LayerNormShape] = [
    LayerNormShape("bert-base", "seq128", 32, 128, 768, quick=True),
    LayerNormShape("bert-base", "seq512", 8, 512, 768),
    LayerNormShape("lm-small", "d256", 32, 256, 256),
    LayerNormShape("lm-small", "d512", 16, 512, 512, quick=True),
]

EMBEDDING_SHAPES: list[EmbeddingShape] = [
    EmbeddingShape("bert-base", "word", 30522, 768, 32, 128, quick=True),
    EmbeddingShape("bert-base", "position", 512, 768, 32, 128),
    EmbeddingShape("lm-small", "token", 8192, 512, 16, 256, quick=True),
    # Text-like token frequencies: the most frequent row takes about 10% of the hits.
    EmbeddingShape("lm-small", "token-zipf", 8192, 512, 16, 256, quick=True, zipf=1.0),
]

# Tiny shapes for --smoke: one of each code path (dense, strided 1x1,
# depthwise, transposed with bias) at a few KB each.
SMOKE_CONV_SHAPES: list[ConvShape] = [
    ConvShape("smoke", "conv3x3", 2, 3, 4, 6, 6, 3, 1, 1, bias=True),
    ConvShape("smoke", "downsample", 2, 4, 6, 6, 6, 1, 2, 0),
    ConvShape("smoke", "dw_s2", 2, 4, 4, 7, 7, 3, 2, 1, groups=4),
    ConvShape("smoke", "convT", 2, 4, 3, 3, 3, 4, 2, 1, transposed=True, bias=True),
]
SMOKE_LAYER_NORM_SHAPES = [LayerNormShape("smoke", "ln", 2, 5, 12)]
SMOKE_EMBEDDING_SHAPES = [EmbeddingShape("smoke", "emb", 17, 6, 2, 5)]
SMOKE_B_VALUES = (2,)
SMOKE_DTYPES = ("fp32", "bf16")


def suite(op: str, *, quick: bool = False, smoke: bool = False) -> list:
    """The shapes of ``op`` ("conv", "layer_norm" or "embedding") for a run mode."""
    if op not in OPS:
        raise ValueError(f"op must be one of {OPS}, got {op!r}")
    if smoke:
        return {"conv": SMOKE_CONV_SHAPES, "layer_norm": SMOKE_LAYER_NORM_SHAPES,
                "embedding": SMOKE_EMBEDDING_SHAPES}[op]
    shapes = {"conv": CONV_SHAPES, "layer_norm": LAYER_NORM_SHAPES, "embedding": EMBEDDING_SHAPES}[op]
    return [s for s in shapes if s.quick] if quick else list(shapes)
