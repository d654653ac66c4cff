"""End to end: a CNN array trained with per-model learning rates follows the B
torch models trained one by one."""

import torch
from torch import nn

import hfkern
import hfkern.nn as hnn
import hfkern.nn.functional as HF
from hfkern.optim import SGD


def _array_cnn(B):
    return nn.Sequential(
        hnn.Conv2d(1, 4, 3, padding=1, B=B),
        hnn.BatchNorm2d(4, B=B),
        nn.ReLU(),
        hnn.MaxPool2d(2, B=B),
        hnn.Conv2d(4, 6, 3, B=B),
        hnn.BatchNorm2d(6, B=B),
        nn.ReLU(),
        hnn.AvgPool2d(2, B=B),
        hnn.Flatten(B=B),
        hnn.Linear(6 * 2 * 2, 5, B=B),
        nn.ReLU(),
        hnn.Linear(5, 3, B=B),
    )


def _to_torch_models(array, B):
    per_layer = [m.to_modules() if isinstance(m, hnn.ArrayModule) else [m] * B for m in array]
    return [nn.Sequential(*(layer[b] for layer in per_layer)) for b in range(B)]


def test_cnn_array_follows_separate_models():
    B, steps = 3, 10
    lrs = [0.3, 0.1, 0.02]
    array = _array_cnn(B)
    models = _to_torch_models(array, B)
    opt = SGD(array.parameters(), lr=lrs, momentum=0.9)
    opts = [torch.optim.SGD(m.parameters(), lr=lr, momentum=0.9) for m, lr in zip(models, lrs)]
    for step in range(steps):
        x = torch.randn(9, 1, 12, 12)
        y = torch.randint(0, 3, (9,))
        losses = HF.cross_entropy(array(hfkern.broadcast(x, B)), y)
        opt.zero_grad()
        losses.sum().backward()
        opt.step()
        for b, (m, o) in enumerate(zip(models, opts)):
            loss = nn.functional.cross_entropy(m(x), y)
            o.zero_grad()
            loss.backward()
            o.step()
            torch.testing.assert_close(losses[b], loss, atol=1e-5, rtol=1e-4,
                                       msg=lambda s: f"step {step}, model {b}: {s}")
    # parameters and running statistics ended up the same, model by model
    for layer in (m for m in array if isinstance(m, hnn.ArrayModule)):
        idx = list(array).index(layer)
        for b, m in enumerate(models):
            for k, v in m[idx].state_dict().items():
                torch.testing.assert_close(layer.state_dict()[k][b], v, atol=1e-4, rtol=1e-4)
    # the models really trained apart: different learning rates, different weights
    assert not torch.allclose(array[0].weight[0], array[0].weight[2])
