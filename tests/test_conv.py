import pytest
import torch
from torch import nn

import hfkern
import hfkern.nn as hnn
from _util import array_input, assert_state_equal, compare_modules

CASES = [
    (hnn.Conv2d, dict(in_channels=4, out_channels=6, kernel_size=(3, 2), padding="same",
                      padding_mode="reflect", dilation=2), (5, 4, 9, 8)),
    (hnn.Conv2d, dict(in_channels=4, out_channels=6, kernel_size=4, padding="same", groups=2), (5, 4, 9, 8)),
    (hnn.Conv2d, dict(in_channels=3, out_channels=5, kernel_size=3, stride=2, bias=False), (3, 11, 7)),
    (hnn.Conv1d, dict(in_channels=4, out_channels=6, kernel_size=3, padding=2,
                      padding_mode="circular", stride=2), (5, 4, 9)),
    (hnn.ConvTranspose2d, dict(in_channels=4, out_channels=6, kernel_size=3, stride=2,
                               output_padding=1, groups=2), (5, 4, 7, 6)),
    (hnn.ConvTranspose1d, dict(in_channels=4, out_channels=6, kernel_size=3, stride=2, dilation=2), (4, 7)),
]


@pytest.mark.parametrize("B", [1, 3])
@pytest.mark.parametrize("cls,kw,shape", CASES)
@pytest.mark.parametrize("mode", ["contiguous", "batch_major", "shared"])
def test_conv_matches_torch(cls, kw, shape, B, mode):
    if mode == "batch_major" and len(shape) == cls._n + 1:
        pytest.skip("unbatched input has no batch dim to put first")
    modules = [cls._torch_cls(**kw) for _ in range(B)]
    array = cls.from_modules(modules)
    x, xs, leaf = array_input(shape, B, shared=mode == "shared", layout=mode if mode != "shared" else "contiguous")
    compare_modules(array, modules, x, xs, leaf, shared=mode == "shared")
    assert_state_equal(array, modules)
