"""The published workloads of horizontally fused training, as plain torch models
with synthetic data of the right shapes (nothing is downloaded).

Each :class:`Workload` says how to build its networks (``build``), make one
batch (``batch``) and run one training step (``step``), at a named size:

* ``full``: the published configurations (CIFAR-10 ResNet-18 and MobileNetV2 at
  batch 128, DCGAN on 64x64 images at batch 128, PointNet on 2,500 points at
  batch 32, the word-language-model transformer at batch 20 x 35 tokens,
  BERT-small at batch 32 x 128 tokens), for GPUs;
* ``cpu``: the same architectures narrowed (widths, vocabularies, batches) so
  that a sweep over B finishes on a 2-core CPU; the ratios between modes are
  what such a run measures, not the absolute rates of the full models;
* ``smoke``: tiny, for the harness's own test.

The models know nothing about hfkern. A training step is written once for every
way of running B models (bench/train_throughput.py): it calls
``apply(net, *inputs, per_model=...)``, which returns ``[M, N, ...]`` outputs of
M models (M = 1 for one model run alone, M = B for an array), and
``update(net, losses)``, which back-propagates the ``[M]`` per-model losses and
steps that network's optimizer. Inputs from the batch are shared by all models;
``per_model=True`` marks inputs that are themselves ``[M, ...]`` outputs (the
generator's images fed to the discriminator).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Mapping, Protocol

import torch
import torch.nn.functional as F
from torch import nn

from .dcgan import DCGANDiscriminator, DCGANGenerator
from .mobilenet import MobileNetV2
from .pointnet import PointNetCls
from .resnet import ResNet18
from .transformer import BertSmall, TransformerLM

__all__ = ["WORKLOADS", "SIZES", "Workload", "BertSmall", "DCGANDiscriminator", "DCGANGenerator",
           "MobileNetV2", "PointNetCls", "ResNet18", "TransformerLM", "mean_cross_entropy"]

SIZES = ("full", "cpu", "smoke")


class Apply(Protocol):
    def __call__(self, net: str, *inputs: torch.Tensor, per_model: bool = False) -> torch.Tensor: ...


Update = Callable[[str, torch.Tensor], None]


def mean_cross_entropy(out: torch.Tensor, target: torch.Tensor, nll: bool = False) -> torch.Tensor:
    """Per-model mean cross-entropy of ``[M, N, ..., C]`` logits (log-probabilities
    with ``nll``) against a shared ``[N, ...]`` target; entries equal to -100
    are ignored, as torch does. Returns ``[M]``."""
    M, C = out.size(0), out.size(-1)
    flat = target.reshape(-1)
    loss = (F.nll_loss if nll else F.cross_entropy)(
        out.reshape(-1, C), flat.repeat(M), reduction="none", ignore_index=-100)
    return loss.view(M, -1).sum(1) / (flat != -100).sum()


def _mean_bce(prob: torch.Tensor, value: float) -> torch.Tensor:
    """Per-model binary cross-entropy of ``[M, N]`` probabilities against a constant label."""
    return F.binary_cross_entropy(prob, torch.full_like(prob, value), reduction="none").mean(1)


@dataclass(frozen=True)
class Workload:
    """One published workload.

    ``sizes[size]`` holds the model keyword arguments (``model``), the per-model
    batch (``batch``) and the data shape parameters of that size. ``nets`` names
    the networks a step trains (each gets its own optimizer), ``optimizer`` is
    ``(name, keyword arguments)`` for torch.optim / hfkern.optim (``sgd``, ``adam``
    or ``adamw``), ``lr`` the range the B models' learning rates span (log-spaced).
    """

    name: str
    summary: str
    nets: tuple[str, ...]
    sizes: Mapping[str, Mapping[str, Any]]
    make: Callable[[str, Mapping[str, Any]], nn.Module]            # (net, size config) -> model
    make_batch: Callable[[Mapping[str, Any], torch.Generator], tuple[torch.Tensor, ...]]
    train_step: Callable[[Apply, Update, tuple[torch.Tensor, ...]], torch.Tensor]
    optimizer: tuple[str, Mapping[str, Any]]
    lr: tuple[float, float]
    unit: str = "samples"
    extras: Mapping[str, Any] = field(default_factory=dict)

    def config(self, size: str) -> Mapping[str, Any]:
        if size not in self.sizes:
            raise ValueError(f"{self.name}: unknown size {size!r}; expected one of {tuple(self.sizes)}")
        return self.sizes[size]

    def build(self, net: str, size: str) -> nn.Module:
        """A new network ``net`` (one of ``nets``) at ``size``, with torch's default initialization."""
        if net not in self.nets:
            raise ValueError(f"{self.name}: unknown network {net!r}; expected one of {self.nets}")
        return self.make(net, self.config(size))

    def batch(self, size: str, seed: int = 0) -> tuple[torch.Tensor, ...]:
        """One synthetic batch (CPU tensors) for one model, the same for a given seed."""
        return self.make_batch(self.config(size), torch.Generator().manual_seed(seed))

    def step(self, apply: Apply, update: Update, batch: tuple[torch.Tensor, ...]) -> torch.Tensor:
        """One training step of M models; returns their ``[M]`` losses (detached)."""
        return self.train_step(apply, update, batch)

    def samples(self, size: str) -> int:
        """Samples one model consumes per step."""
        return int(self.config(size)["batch"])

    def learning_rates(self, B: int) -> list[float]:
        """The B models' learning rates, log-spaced over ``lr`` (the middle for B = 1)."""
        lo, hi = self.lr
        if B == 1:
            return [float((lo * hi) ** 0.5)]
        return torch.logspace(torch.tensor(lo).log10(), torch.tensor(hi).log10(), B, dtype=torch.float64).tolist()


# ---- classification of images and point clouds ----------------------------------------------
def _classify_step(nll: bool = False):
    def step(apply, update, batch):
        x, y = batch
        loss = mean_cross_entropy(apply("net", x), y, nll=nll)
        update("net", loss)
        return loss.detach()
    return step


def _images(channels: int, side: int, classes: int):
    def make(cfg, g):
        n = cfg["batch"]
        return torch.randn(n, channels, side, side, generator=g), torch.randint(0, classes, (n,), generator=g)
    return make


def _points(cfg, g):
    n, p = cfg["batch"], cfg["points"]
    return torch.randn(n, 3, p, generator=g), torch.randint(0, cfg["model"]["k"], (n,), generator=g)


# ---- DCGAN: one discriminator step, then one generator step ---------------------------------
def _dcgan_step(apply, update, batch):
    real, z = batch
    fake = apply("G", z)
    loss_d = _mean_bce(apply("D", real), 1.0) + _mean_bce(apply("D", fake.detach(), per_model=True), 0.0)
    update("D", loss_d)
    loss_g = _mean_bce(apply("D", fake, per_model=True), 1.0)
    update("G", loss_g)
    return (loss_d + loss_g).detach()


def _dcgan_batch(cfg, g):
    n = cfg["batch"]
    real = torch.rand(n, 3, 64, 64, generator=g) * 2 - 1          # images scaled to [-1, 1]
    return real, torch.randn(n, cfg["nz"], 1, 1, generator=g)


def _dcgan_make(net, cfg):
    if net == "G":
        return DCGANGenerator(nz=cfg["nz"], ngf=cfg["width"], nc=3)
    return DCGANDiscriminator(nc=3, ndf=cfg["width"])


# ---- language models ---------------------------------------------------------------------------
def _lm_batch(cfg, g):
    tokens = torch.randint(0, cfg["model"]["vocab"], (cfg["batch"], cfg["seq"] + 1), generator=g)
    return tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()


def _bert_batch(cfg, g):
    """Token ids with BERT's masked-LM labels: 15% of the real (unpadded) positions
    are predicted; every sequence is at least half as long as the batch's."""
    n, s, vocab = cfg["batch"], cfg["seq"], cfg["model"]["vocab"]
    ids = torch.randint(0, vocab, (n, s), generator=g)
    lengths = torch.randint(s // 2, s + 1, (n,), generator=g)
    attention = (torch.arange(s) < lengths[:, None]).long()
    types = (torch.arange(s) >= (lengths[:, None] // 2)).long() * attention
    chosen = (torch.rand(n, s, generator=g) < 0.15) & attention.bool()
    chosen[:, 0] = True                                  # at least one label per sequence
    labels = torch.where(chosen, ids, torch.full_like(ids, -100))
    return ids, types, attention, labels


def _lm_step(apply, update, batch):
    x, y = batch
    loss = mean_cross_entropy(apply("net", x), y)
    update("net", loss)
    return loss.detach()


def _bert_step(apply, update, batch):
    ids, types, attention, labels = batch
    loss = mean_cross_entropy(apply("net", ids, types, attention), labels)
    update("net", loss)
    return loss.detach()


_SMALL_MOBILENET = [[1, 16, 1, 1], [6, 24, 2, 2], [6, 32, 2, 2]]

WORKLOADS: dict[str, Workload] = {w.name: w for w in [
    Workload(
        "pointnet", "PointNet classification (input and feature transforms), ShapeNet-like point clouds",
        ("net",),
        {"full": {"model": dict(k=16, width=64), "batch": 32, "points": 2500},
         "cpu": {"model": dict(k=16, width=16), "batch": 16, "points": 256},
         "smoke": {"model": dict(k=5, width=4), "batch": 4, "points": 17}},
        lambda net, cfg: PointNetCls(**cfg["model"]), _points, _classify_step(nll=True),
        ("adam", dict(betas=(0.9, 0.999))), (1e-4, 1e-2)),
    Workload(
        "dcgan", "DCGAN generator and discriminator, 64x64 images, one D and one G step",
        ("G", "D"),
        {"full": {"width": 64, "nz": 100, "batch": 128},
         "cpu": {"width": 8, "nz": 32, "batch": 16},
         "smoke": {"width": 2, "nz": 4, "batch": 2}},
        _dcgan_make, _dcgan_batch, _dcgan_step,
        ("adam", dict(betas=(0.5, 0.999))), (5e-5, 5e-3)),
    Workload(
        "resnet18", "ResNet-18 (BasicBlock) for CIFAR-10, 32x32 images",
        ("net",),
        {"full": {"model": dict(num_classes=10, width=64), "batch": 128},
         "cpu": {"model": dict(num_classes=10, width=8), "batch": 32},
         "smoke": {"model": dict(num_classes=10, width=2), "batch": 2}},
        lambda net, cfg: ResNet18(**cfg["model"]), _images(3, 32, 10), _classify_step(),
        ("sgd", dict(momentum=0.9, weight_decay=5e-4)), (1e-3, 1e-1)),
    Workload(
        "mobilenet_v2", "MobileNetV2 for CIFAR-10, 32x32 images",
        ("net",),
        {"full": {"model": dict(num_classes=10, width_mult=1.0), "batch": 128},
         "cpu": {"model": dict(num_classes=10, width_mult=0.25), "batch": 32},
         "smoke": {"model": dict(num_classes=10, width_mult=0.25, setting=_SMALL_MOBILENET), "batch": 2}},
        lambda net, cfg: MobileNetV2(**cfg["model"]), _images(3, 32, 10), _classify_step(),
        ("sgd", dict(momentum=0.9, weight_decay=4e-5)), (1e-3, 1e-1)),
    Workload(
        "transformer_lm", "transformer language model (word-language-model sizes), causal mask",
        ("net",),
        {"full": {"model": dict(vocab=33278, d_model=200, nhead=2, num_layers=2, dim_ff=200, max_len=35),
                  "batch": 20, "seq": 35},
         "cpu": {"model": dict(vocab=2000, d_model=64, nhead=2, num_layers=2, dim_ff=128, max_len=35),
                 "batch": 20, "seq": 35},
         "smoke": {"model": dict(vocab=23, d_model=8, nhead=2, num_layers=1, dim_ff=12, max_len=7),
                   "batch": 2, "seq": 7}},
        lambda net, cfg: TransformerLM(**cfg["model"]), _lm_batch, _lm_step,
        ("adam", dict(betas=(0.9, 0.999))), (1e-4, 1e-2), unit="sequences"),
    Workload(
        "bert_small", "BERT-small encoder with the masked-LM head, padded sequences",
        ("net",),
        {"full": {"model": dict(vocab=30522, hidden=512, num_layers=4, nhead=8, dim_ff=2048, max_len=128),
                  "batch": 32, "seq": 128},
         "cpu": {"model": dict(vocab=2000, hidden=64, num_layers=2, nhead=2, dim_ff=256, max_len=64),
                 "batch": 8, "seq": 64},
         "smoke": {"model": dict(vocab=29, hidden=8, num_layers=1, nhead=2, dim_ff=12, max_len=9),
                   "batch": 2, "seq": 9}},
        lambda net, cfg: BertSmall(**cfg["model"]), _bert_batch, _bert_step,
        ("adamw", dict(betas=(0.9, 0.999), weight_decay=0.01)), (1e-5, 1e-3), unit="sequences"),
]}
