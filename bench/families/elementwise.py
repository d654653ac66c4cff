"""The elementwise ops around an array conv: ReLU, the residual add and ``copy_``.

These are torch's own ops on the ``[B, N, C, H, W]`` array activation (hfkern
has no op of its own for them), and a ResNet training step spends about a
fifth of its time in them; what the benchmark asks is how close they come to
the copy bandwidth, and whether the array layout (families.LAYOUTS) changes
that. A case is one op on one activation in one layout (``layer1.relu@nhwc``):

* ``relu``: ``torch.relu(x)``, forward (read x, write y) and backward (read gy
  and the saved y, write gx);
* ``add``: the residual add ``x + r`` with both operands in the case's layout
  (read two, write one);
* ``add_mixed``: the same with ``r`` in the other layout (a shortcut computed in
  the other layout): the strided read of one operand;
* ``copy_``: ``dst.copy_(x)`` into a preallocated tensor in the same layout (the
  copy-bandwidth ceiling on this tensor);
* ``copy_other``: ``dst.copy_(x)`` into the other layout: a layout conversion
  without the allocation of ``.contiguous(memory_format=...)``.

Implementations: ``torch``, the op on the array view (what an hfkern array
model runs), and ``loop``, B per-model calls on separate (contiguous, so
layout-free) tensors: what the launches cost. Suite
``bytes`` only: ResNet-18 for CIFAR-10 at batch 128 (the activation of each
stage) and PointNet's widest activation (1024 channels over 32 x 2,500 points).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from . import LAYOUTS, Family, Impl, Loop, Suite, array_randn, leaf, other_layout

OPS = ("relu", "add", "add_mixed", "copy_", "copy_other")


@dataclass(frozen=True)
class ElementwiseShape:
    """One elementwise ``op`` (:data:`OPS`) on one model's ``[N, C, H, W]`` activation
    (``H=None``: ``[N, C, W]``) in ``layout`` memory."""

    model: str
    layer: str
    op: str
    N: int
    C: int
    H: int | None
    W: int
    layout: str = "nchw"
    quick: bool = False

    @property
    def spatial(self) -> tuple[int, ...]:
        return (self.W,) if self.H is None else (self.H, self.W)

    @property
    def directions(self) -> tuple[str, ...]:
        """Only ReLU has a backward that moves bytes (an add's passes the gradient on)."""
        return ("fwd", "bwd") if self.op == "relu" else ("fwd",)

    def describe(self) -> str:
        return f"{self.op} [{', '.join(map(str, (self.N, self.C, *self.spatial)))}] {self.layout}"


def variants(model: str, stage: str, N: int, C: int, H: int | None, W: int, ops=OPS, quick=()) -> list:
    """One shape per op and layout; both in the layer name (``layer1.relu@nhwc``)."""
    return [ElementwiseShape(model, f"{stage}.{op}@{layout}", op, N, C, H, W, layout, quick=op in quick)
            for op in ops for layout in LAYOUTS]


SHAPES_BYTES: list[ElementwiseShape] = (
    variants("resnet18", "layer1", 128, 64, 32, 32, quick=("relu", "add", "copy_"))
    + variants("resnet18", "layer2", 128, 128, 16, 16, ops=("relu", "add", "copy_"))
    + variants("resnet18", "layer3", 128, 256, 8, 8, ops=("relu", "add", "copy_"))
    + variants("resnet18", "layer4", 128, 512, 4, 4, ops=("relu", "add", "copy_"))
    + variants("pointnet", "bn3", 32, 1024, None, 2500, ops=("relu", "copy_", "copy_other"))
)
SMOKE_SHAPES = variants("smoke", "act", 3, 4, 5, 6) + variants("smoke", "act1d", 3, 4, None, 7, ops=("relu",))


def make_data(s: ElementwiseShape, B: int, dtype: torch.dtype, device, grad: bool) -> dict:
    """x (and gy): [B, N, C, *S] in ``s.layout`` memory; r: the add's second operand
    (``add_mixed``: in the other layout); dst: the copy's destination."""
    def act(layout):
        return array_randn(B, s.N, s.C, s.spatial, layout, dtype=dtype, device=device)

    d = {"B": B, "x": act(s.layout), "r": None, "dst": None, "gy": act(s.layout) if grad else None}
    if s.op in ("add", "add_mixed"):
        d["r"] = act(s.layout if s.op == "add" else other_layout(s.layout))
    if s.op in ("copy_", "copy_other"):
        d["dst"] = act(s.layout if s.op == "copy_" else other_layout(s.layout))
    return d


def cost(s: ElementwiseShape, B: int, elem: int) -> tuple:
    """Tensors of the activation's size read and written, per direction."""
    n = B * s.N * s.C * math.prod(s.spatial)
    fwd = {"relu": 2, "add": 3, "add_mixed": 3, "copy_": 2, "copy_other": 2}[s.op]
    bwd = 3 if s.op == "relu" else 0  # gy and y in, gx out
    return (elem * fwd * n, None), (elem * bwd * n, None)


def _apply(op: str, x, r, dst):
    if op == "relu":
        return torch.relu(x)
    if op in ("add", "add_mixed"):
        return torch.add(x, r)
    return dst.copy_(x)


class TorchElementwise(Impl):
    """torch's op on the array view: what an hfkern array model runs."""

    kind = "backend"
    name = "torch"

    def __init__(self, s):
        self.s = s

    def inputs(self, d, grad):
        x = leaf(d["x"]) if grad else d["x"]
        return (x, d["r"], d["dst"]), [x]

    def forward(self, args):
        return [_apply(self.s.op, *args)]


class LoopElementwise(Loop):
    def inputs(self, d, grad):
        xs, = self.per_model(d, ("x",), grad)
        rs, dsts = self.per_model(d, ("r", "dst"), False)
        return (xs, rs, dsts), xs

    def forward(self, args):
        return [_apply(self.s.op, x, r, dst) for x, r, dst in zip(*args)]


def _backend_impl(s, backend: str):
    # torch's ops are the only implementation; no hfkern backend has its own.
    return TorchElementwise(s) if backend == "torch" else None


FAMILY = Family(
    name="elementwise",
    summary="ReLU, the residual add and copy_ on array activations in both layouts (torch's ops)",
    directions=("fwd", "bwd"),
    quick_directions=("fwd", "bwd"),
    make_data=make_data,
    cost=cost,
    backend_impl=_backend_impl,
    baselines={"loop": LoopElementwise},
    suites={"bytes": Suite(SHAPES_BYTES, SMOKE_SHAPES)},
)
