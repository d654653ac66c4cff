"""Plain torch models, written as their authors write them, for the hfkern.fuse tests.

Nothing here knows about hfkern: each model is the usual torch code (residual
adds, ``torch.flatten(x, 1)``, ``x.view(x.size(0), -1)``, functional calls),
at small widths so that the tests run on a CPU. Each entry of ``ARCHITECTURES``
gives a factory, a per-model input maker and a per-model loss.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch
import torch.nn.functional as F
from torch import nn


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


# ---- CIFAR ResNet-18, BasicBlock style --------------------------------------------------
class BasicBlock(nn.Module):
    expansion = 1

    def __init__(self, in_planes, planes, stride=1):
        super().__init__()
        self.conv1 = nn.Conv2d(in_planes, planes, 3, stride=stride, padding=1, bias=False)
        self.bn1 = nn.BatchNorm2d(planes)
        self.conv2 = nn.Conv2d(planes, planes, 3, stride=1, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(planes)
        self.relu = nn.ReLU(inplace=True)
        self.downsample = None
        if stride != 1 or in_planes != planes:
            self.downsample = nn.Sequential(
                nn.Conv2d(in_planes, planes, 1, stride=stride, bias=False), nn.BatchNorm2d(planes))

    def forward(self, x):
        identity = x
        out = self.relu(self.bn1(self.conv1(x)))
        out = self.bn2(self.conv2(out))
        if self.downsample is not None:
            identity = self.downsample(x)
        out += identity
        return self.relu(out)


class ResNet18(nn.Module):
    def __init__(self, num_classes: int = 10, width: int = 64):
        super().__init__()
        self.in_planes = width
        self.conv1 = nn.Conv2d(3, width, 3, stride=1, padding=1, bias=False)
        self.bn1 = nn.BatchNorm2d(width)
        self.layer1 = self._make_layer(width, 2, 1)
        self.layer2 = self._make_layer(2 * width, 2, 2)
        self.layer3 = self._make_layer(4 * width, 2, 2)
        self.layer4 = self._make_layer(8 * width, 2, 2)
        self.avgpool = nn.AdaptiveAvgPool2d((1, 1))
        self.fc = nn.Linear(8 * width, num_classes)
        for m in self.modules():
            if isinstance(m, nn.Conv2d):
                nn.init.kaiming_normal_(m.weight, mode="fan_out", nonlinearity="relu")

    def _make_layer(self, planes, blocks, stride):
        layers = []
        for s in [stride] + [1] * (blocks - 1):
            layers.append(BasicBlock(self.in_planes, planes, s))
            self.in_planes = planes
        return nn.Sequential(*layers)

    def forward(self, x):
        x = F.relu(self.bn1(self.conv1(x)))
        x = self.layer4(self.layer3(self.layer2(self.layer1(x))))
        x = self.avgpool(x)
        x = torch.flatten(x, 1)
        return self.fc(x)


# ---- MobileNetV2 --------------------------------------------------------------------------
class ConvBNReLU(nn.Sequential):
    def __init__(self, in_planes, out_planes, kernel_size=3, stride=1, groups=1):
        padding = (kernel_size - 1) // 2
        super().__init__(
            nn.Conv2d(in_planes, out_planes, kernel_size, stride, padding, groups=groups, bias=False),
            nn.BatchNorm2d(out_planes),
            nn.ReLU6(inplace=True),
        )


class InvertedResidual(nn.Module):
    def __init__(self, inp, oup, stride, expand_ratio):
        super().__init__()
        hidden = int(round(inp * expand_ratio))
        self.use_res_connect = stride == 1 and inp == oup
        layers = []
        if expand_ratio != 1:
            layers.append(ConvBNReLU(inp, hidden, kernel_size=1))
        layers += [
            ConvBNReLU(hidden, hidden, stride=stride, groups=hidden),   # depthwise
            nn.Conv2d(hidden, oup, 1, 1, 0, bias=False),                # pointwise
            nn.BatchNorm2d(oup),
        ]
        self.conv = nn.Sequential(*layers)

    def forward(self, x):
        if self.use_res_connect:
            return x + self.conv(x)
        return self.conv(x)


class MobileNetV2(nn.Module):
    # t, c, n, s (the paper's table, channels scaled by width_mult)
    SETTING = [[1, 16, 1, 1], [6, 24, 2, 2], [6, 32, 3, 2], [6, 64, 4, 2], [6, 96, 3, 1],
               [6, 160, 3, 2], [6, 320, 1, 1]]

    def __init__(self, num_classes=10, width_mult=1.0, dropout=0.2, setting=None):
        super().__init__()
        setting = setting or self.SETTING
        input_channel = max(int(32 * width_mult), 4)
        self.last_channel = max(int(1280 * width_mult), 8)
        features = [ConvBNReLU(3, input_channel, stride=2)]
        for t, c, n, s in setting:
            output_channel = max(int(c * width_mult), 4)
            for i in range(n):
                features.append(InvertedResidual(input_channel, output_channel, s if i == 0 else 1, t))
                input_channel = output_channel
        features.append(ConvBNReLU(input_channel, self.last_channel, kernel_size=1))
        self.features = nn.Sequential(*features)
        self.classifier = nn.Sequential(nn.Dropout(dropout), nn.Linear(self.last_channel, num_classes))

    def forward(self, x):
        x = self.features(x)
        x = nn.functional.adaptive_avg_pool2d(x, (1, 1))
        x = torch.flatten(x, 1)
        return self.classifier(x)


# ---- DCGAN ---------------------------------------------------------------------------------
class DCGANGenerator(nn.Module):
    def __init__(self, nz=100, ngf=64, nc=3):
        super().__init__()
        self.main = nn.Sequential(
            nn.ConvTranspose2d(nz, ngf * 8, 4, 1, 0, bias=False), nn.BatchNorm2d(ngf * 8), nn.ReLU(True),
            nn.ConvTranspose2d(ngf * 8, ngf * 4, 4, 2, 1, bias=False), nn.BatchNorm2d(ngf * 4), nn.ReLU(True),
            nn.ConvTranspose2d(ngf * 4, ngf * 2, 4, 2, 1, bias=False), nn.BatchNorm2d(ngf * 2), nn.ReLU(True),
            nn.ConvTranspose2d(ngf * 2, ngf, 4, 2, 1, bias=False), nn.BatchNorm2d(ngf), nn.ReLU(True),
            nn.ConvTranspose2d(ngf, nc, 4, 2, 1, bias=False), nn.Tanh(),
        )

    def forward(self, input):
        return self.main(input)


class DCGANDiscriminator(nn.Module):
    def __init__(self, nc=3, ndf=64):
        super().__init__()
        self.main = nn.Sequential(
            nn.Conv2d(nc, ndf, 4, 2, 1, bias=False), nn.LeakyReLU(0.2, inplace=True),
            nn.Conv2d(ndf, ndf * 2, 4, 2, 1, bias=False), nn.BatchNorm2d(ndf * 2),
            nn.LeakyReLU(0.2, inplace=True),
            nn.Conv2d(ndf * 2, ndf * 4, 4, 2, 1, bias=False), nn.BatchNorm2d(ndf * 4),
            nn.LeakyReLU(0.2, inplace=True),
            nn.Conv2d(ndf * 4, ndf * 8, 4, 2, 1, bias=False), nn.BatchNorm2d(ndf * 8),
            nn.LeakyReLU(0.2, inplace=True),
            nn.Conv2d(ndf * 8, 1, 4, 1, 0, bias=False), nn.Sigmoid(),
        )

    def forward(self, input):
        return self.main(input).view(-1, 1).squeeze(1)


# ---- PointNet (classification, input and feature transforms) -------------------------------
class STNkd(nn.Module):
    def __init__(self, k=64, width=64):
        super().__init__()
        self.k = k
        self.conv1 = nn.Conv1d(k, width, 1)
        self.conv2 = nn.Conv1d(width, 2 * width, 1)
        self.conv3 = nn.Conv1d(2 * width, 16 * width, 1)
        self.fc1 = nn.Linear(16 * width, 8 * width)
        self.fc2 = nn.Linear(8 * width, 4 * width)
        self.fc3 = nn.Linear(4 * width, k * k)
        self.bn1, self.bn2, self.bn3 = nn.BatchNorm1d(width), nn.BatchNorm1d(2 * width), nn.BatchNorm1d(16 * width)
        self.bn4, self.bn5 = nn.BatchNorm1d(8 * width), nn.BatchNorm1d(4 * width)
        self.width = width

    def forward(self, x):
        batchsize = x.size(0)
        x = F.relu(self.bn1(self.conv1(x)))
        x = F.relu(self.bn2(self.conv2(x)))
        x = F.relu(self.bn3(self.conv3(x)))
        x = torch.max(x, 2, keepdim=True)[0]
        x = x.view(-1, 16 * self.width)
        x = F.relu(self.bn4(self.fc1(x)))
        x = F.relu(self.bn5(self.fc2(x)))
        x = self.fc3(x)
        iden = torch.eye(self.k, device=x.device, dtype=x.dtype).flatten().view(1, -1).repeat(batchsize, 1)
        x = x + iden
        return x.view(-1, self.k, self.k)


class PointNetCls(nn.Module):
    def __init__(self, k=10, width=64, feature_transform=True, dropout=0.3):
        super().__init__()
        self.stn = STNkd(3, width)
        self.conv1 = nn.Conv1d(3, width, 1)
        self.conv2 = nn.Conv1d(width, 2 * width, 1)
        self.conv3 = nn.Conv1d(2 * width, 16 * width, 1)
        self.bn1, self.bn2, self.bn3 = nn.BatchNorm1d(width), nn.BatchNorm1d(2 * width), nn.BatchNorm1d(16 * width)
        self.feature_transform = feature_transform
        if feature_transform:
            self.fstn = STNkd(width, width)
        self.fc1 = nn.Linear(16 * width, 8 * width)
        self.fc2 = nn.Linear(8 * width, 4 * width)
        self.fc3 = nn.Linear(4 * width, k)
        self.dropout = nn.Dropout(p=dropout)
        self.bn4, self.bn5 = nn.BatchNorm1d(8 * width), nn.BatchNorm1d(4 * width)
        self.width = width

    def forward(self, x):
        trans = self.stn(x)
        x = torch.bmm(x.transpose(2, 1), trans).transpose(2, 1)
        x = F.relu(self.bn1(self.conv1(x)))
        if self.feature_transform:
            trans_feat = self.fstn(x)
            x = torch.bmm(x.transpose(2, 1), trans_feat).transpose(2, 1)
        x = F.relu(self.bn2(self.conv2(x)))
        x = self.bn3(self.conv3(x))
        x = torch.max(x, 2, keepdim=True)[0].view(-1, 16 * self.width)
        x = F.relu(self.bn4(self.fc1(x)))
        x = F.relu(self.bn5(self.dropout(self.fc2(x))))
        return F.log_softmax(self.fc3(x), dim=1)


# ---- a small transformer language model ---------------------------------------------------
class TransformerLM(nn.Module):
    def __init__(self, vocab=50, d_model=16, nhead=2, num_layers=2, dim_ff=32, max_len=32, dropout=0.1):
        super().__init__()
        self.tok = nn.Embedding(vocab, d_model)
        self.pos = nn.Embedding(max_len, d_model)
        layer = nn.TransformerEncoderLayer(d_model, nhead, dim_ff, dropout, batch_first=True)
        self.encoder = nn.TransformerEncoder(layer, num_layers, enable_nested_tensor=False)
        self.norm = nn.LayerNorm(d_model)
        self.head = nn.Linear(d_model, vocab)

    def forward(self, idx):
        T = idx.size(1)
        pos = torch.arange(T, device=idx.device)
        h = self.tok(idx) + self.pos(pos)
        mask = nn.Transformer.generate_square_subsequent_mask(T, device=idx.device)
        h = self.encoder(h, mask=mask, is_causal=True)
        return self.head(self.norm(h))


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
