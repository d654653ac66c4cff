"""Plain torch models, written as their authors write them, for the hfkern.fuse tests.

Nothing here knows about hfkern: each model is the usual torch code (residual
adds, ``torch.flatten(x, 1)``, ``x.view(x.size(0), -1)``, functional calls),
at small widths so that the tests run on a CPU. The published workloads are
bench/models' (the models the end-to-end benchmark trains); the digits CNN is
the demo's. Each entry of ``ARCHITECTURES`` gives a factory, a per-model input
maker and a per-model loss.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch
import torch.nn.functional as F
from torch import nn

from bench.models import (BertSmall, DCGANDiscriminator, DCGANGenerator, MobileNetV2, PointNetCls,  # noqa: F401
                          ResNet18, TransformerLM)


# ---- the digits CNN of examples/digits_sweep.py ----------------------------------------
class DigitsCNN(nn.Module):
    def __init__(self, num_classes: int = 10):
        super().__init__()
        self.features = nn.Sequential(
            nn.Conv2d(1, 16, 3, padding=1), nn.BatchNorm2d(16), nn.ReLU(), nn.MaxPool2d(2),
            nn.Conv2d(16, 32, 3, padding=1), nn.BatchNorm2d(32), nn.ReLU(), nn.MaxPool2d(2),
        )
        self.classifier = nn.Linear(32 * 2 * 2, num_classes)

    def forward(self, x):
        x = self.features(x)
        return self.classifier(x.view(x.size(0), -1))


# ---- the table the tests iterate -----------------------------------------------------------
@dataclass(frozen=True)
class Architecture:
    name: str
    factory: Callable[[], nn.Module]          # a new model (small widths), dropout off
    input: Callable[[int], torch.Tensor]      # one model's input batch of N samples
    loss: Callable[[torch.Tensor], torch.Tensor]  # one model's output -> scalar loss
    N: int = 4


def _image(c, s):
    return lambda n: torch.randn(n, c, s, s)



ARCHITECTURES = {
    "digits_cnn": Architecture("digits_cnn", DigitsCNN, _image(1, 8), lambda o: F.cross_entropy(o, torch.arange(o.size(0)) % 10)),
    "resnet18": Architecture("resnet18", lambda: ResNet18(10, width=4), _image(3, 16),
                             lambda o: F.cross_entropy(o, torch.arange(o.size(0)) % 10)),
    "mobilenet_v2": Architecture(
        "mobilenet_v2",
        lambda: MobileNetV2(10, width_mult=0.25, dropout=0.0,
                            setting=[[1, 16, 1, 1], [6, 24, 2, 2], [6, 32, 2, 2]]),
        _image(3, 16), lambda o: F.cross_entropy(o, torch.arange(o.size(0)) % 10)),
    "dcgan_generator": Architecture("dcgan_generator", lambda: DCGANGenerator(nz=8, ngf=4, nc=3),
                                    lambda n: torch.randn(n, 8, 1, 1), lambda o: (o ** 2).mean()),
    "dcgan_discriminator": Architecture("dcgan_discriminator", lambda: DCGANDiscriminator(nc=3, ndf=4),
                                        _image(3, 64), lambda o: F.binary_cross_entropy(o, torch.ones_like(o))),
    "pointnet": Architecture("pointnet", lambda: PointNetCls(k=5, width=4, dropout=0.0), lambda n: torch.randn(n, 3, 17),
                             lambda o: F.nll_loss(o, torch.arange(o.size(0)) % 5)),
    "transformer_lm": Architecture(
        "transformer_lm", lambda: TransformerLM(vocab=23, d_model=12, nhead=3, num_layers=2, dim_ff=20, dropout=0.0),
        lambda n: torch.randint(0, 23, (n, 7)),
        lambda o: F.cross_entropy(o.reshape(-1, o.size(-1)), torch.arange(o.numel() // o.size(-1)) % o.size(-1)),
        N=3),
}
