"""A fused training step leaves no tensors in reference cycles.

Tensors held by a reference cycle live until Python's cyclic collector runs,
which may be many steps later: activations kept that way raise every step's
peak memory (a recomputed block's activations outlived its backward). The step
must free its tensors by reference counting alone.
"""

import gc

import pytest
import torch
from torch import nn

import hfkern
import hfkern.plan as hp


class _Residual(nn.Module):
    def __init__(self):
        super().__init__()
        self.stem = nn.Conv2d(3, 8, 3, padding=1)
        self.block = nn.Sequential(nn.Conv2d(8, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU())
        self.head = nn.Linear(8, 5)

    def forward(self, x):
        h = torch.relu(self.stem(x))
        h = h + self.block(h)  # the residual add: a per-model op of the fused graph
        return self.head(h.mean((2, 3)))


def _garbage_tensors(step) -> list[torch.Tensor]:
    """Tensors in reference cycles made by ``step()``. Objects alive before it are frozen (left out
    of collections), so garbage of earlier tests released meanwhile does not count."""
    gc.collect()
    gc.freeze()
    gc.set_debug(gc.DEBUG_SAVEALL)
    try:
        step()
        gc.collect()
        return [o for o in gc.garbage if isinstance(o, torch.Tensor)]
    finally:
        gc.set_debug(0)
        gc.garbage.clear()
        gc.unfreeze()


@pytest.mark.parametrize("recompute", [(), ("block",)])
def test_fused_step_frees_its_tensors_without_the_cycle_collector(recompute):
    torch.manual_seed(0)
    B = 3
    model = hfkern.fuse(_Residual, B)
    hp.apply(model, hp.Strategy(B=B, recompute=recompute))
    x = hfkern.broadcast(torch.randn(4, 3, 6, 6), B)
    y = torch.randint(0, 5, (4,))

    def step():
        hfkern.nn.functional.cross_entropy(model(x), y).sum().backward()

    step()  # first call: lazily built tables are not garbage
    leaked = _garbage_tensors(step)
    assert leaked == [], f"{len(leaked)} tensors of shapes {[tuple(t.shape) for t in leaked][:5]} were in cycles"
