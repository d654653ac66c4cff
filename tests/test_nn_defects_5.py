"""Defects of hfkern.nn's convolutions, pooling and from_modules (fifth round).

1. An unbatched ConvTranspose input whose calculated output size is below 1
   gave an empty float32 result where torch refuses one model's unbatched input.
2. The channel error for unbatched conv inputs named the internal [B, 1, C, ...]
   shape and dim 2 instead of the input as given.
3. Errors torch raised inside pooling (and convolutions) named the folded
   [B*N, C, ...] / grouped [N, B*C, ...] shape the user never passed.
4. from_modules refused modules that differ only in the spelling of a pool's
   sizes, or in a PReLU's init (which only initializes the weight).
"""

import re

import pytest
import torch
from torch import nn

import hfkern
import hfkern.nn as hnn


def _outcome(f):
    """("ok", shape) or ("error", type, message) of calling ``f``."""
    try:
        return ("ok", tuple(f().shape))
    except Exception as ex:  # noqa: BLE001 - compared with torch's outcome
        return ("error", type(ex), str(ex))


# ---- 1. unbatched ConvTranspose with an output size below 1 ---------------------------------

@pytest.mark.parametrize("n", [1, 2])
def test_conv_transpose_unbatched_zero_output_raises_as_torch(n):
    torch.manual_seed(0)
    cls, torch_cls = (hnn.ConvTranspose1d, nn.ConvTranspose1d) if n == 1 else (hnn.ConvTranspose2d,
                                                                              nn.ConvTranspose2d)
    spatial = (3,) if n == 1 else (5, 3)  # padding 2, kernel 2: output (0,) / (2, 0)
    calculated = "(1 x 0)" if n == 1 else "(2 x 0)"
    for dtype in (torch.float32, torch.float64):
        model = torch_cls(2, 1, 2, padding=2).to(dtype)
        x = torch.randn(3, 2, *spatial, dtype=dtype)  # per-model [C, *s]: unbatched
        with pytest.raises(RuntimeError, match="Output size is too small"):
            model(x[0])
        array = cls.from_modules([model] * 3)
        with pytest.raises(RuntimeError, match=re.escape(calculated) + r".*Output size is too small") as info:
            array(x)
        assert str(list(x.shape)) in str(info.value)  # names the array input as given
        # the same through output_size (the smallest size is the one torch computes)
        with pytest.raises(RuntimeError, match="Output size is too small"):
            array(x, output_size=[2, 0] if n == 2 else [0])
    for dtype in (torch.float32, torch.float64, torch.bfloat16):
        # The array does what torch does for one model's input of that dtype (torch's CPU
        # kernels raise for some dtypes and return an empty tensor for others).
        model = torch_cls(2, 1, 2, padding=2).to(dtype)
        array = cls.from_modules([model] * 3)
        for x in (torch.randn(3, 2, *spatial, dtype=dtype), torch.randn(3, 2, 2, *spatial, dtype=dtype)):
            expected, got = _outcome(lambda: model(x[0])), _outcome(lambda: array(x))
            if expected[0] == "ok":
                assert got == ("ok", (3, *expected[1]))
            else:
                assert got[0] == "error" and got[1] is expected[1] and expected[2] in got[2], (got, expected)
    # outputs of a positive size are computed as before
    models = [torch_cls(2, 3, 3, stride=2, padding=1) for _ in range(3)]
    array = cls.from_modules(models)
    x = torch.randn(3, 2, *spatial)
    torch.testing.assert_close(array(x), torch.stack([m(x[b]) for b, m in enumerate(models)]).detach())


# ---- 2. the channel error of unbatched conv inputs ----------------------------------------

@pytest.mark.parametrize("cls,spatial", [
    (hnn.Conv1d, (4,)), (hnn.Conv2d, (4, 4)), (hnn.ConvTranspose1d, (4,)), (hnn.ConvTranspose2d, (4, 4)),
])
def test_unbatched_channel_error_names_the_input_as_given(cls, spatial):
    m = cls(3, 2, 3, B=2)
    x = torch.randn(2, 5, *spatial)
    with pytest.raises(ValueError) as info:
        m(x)
    msg = str(info.value)
    assert msg.startswith(f"{cls.__name__}: expected input with 3 channels at dim 1 (shape [B, C, ...]"), msg
    assert f"got 5 in shape {list(x.shape)}" in msg, msg
    assert "[2, 1, 5" not in msg, msg
    # batched inputs keep their [B, N, C, ...] message
    xb = torch.randn(2, 4, 5, *spatial)
    with pytest.raises(ValueError, match=re.escape(f"at dim 2 (shape [B, N, C, ...]), got 5 in shape "
                                                   f"{list(xb.shape)}")):
        m(xb)


# ---- 3. errors torch raises inside pooling and convolutions -----------------------------

def _pool_cases():
    return [
        # (array module, torch module, array input shape, what torch names for one model)
        (hnn.MaxPool2d(2), nn.MaxPool2d(2), (2, 2, 3, 0, 5), "[2, 3, 0, 5]"),
        (hnn.MaxPool2d(2), nn.MaxPool2d(2), (2, 3, 0, 5), "[3, 0, 5]"),
        (hnn.MaxPool2d(3), nn.MaxPool2d(3), (2, 3, 2, 2), "(3x2x2)"),  # unbatched, output too small
        (hnn.MaxPool1d(2), nn.MaxPool1d(2), (2, 2, 3, 0), "[2, 3, 0]"),
        (hnn.AvgPool2d(2), nn.AvgPool2d(2), (2, 3, 0, 5), "[3, 0, 5]"),
        (hnn.AdaptiveAvgPool2d(2), nn.AdaptiveAvgPool2d(2), (2, 2, 3, 0, 5), "[2, 3, 0, 5]"),
        (hnn.AdaptiveAvgPool1d(2), nn.AdaptiveAvgPool1d(2), (2, 3, 0), "[3, 1, 0]"),
        (hnn.ConvTranspose2d(3, 2, 3, B=2), nn.ConvTranspose2d(3, 2, 3), (2, 2, 3, 0, 5), "[2, 3, 0, 5]"),
        (hnn.ConvTranspose1d(3, 2, 3, B=2), nn.ConvTranspose1d(3, 2, 3), (2, 3, 0), "[1, 3, 1, 0]"),
        (hnn.Conv2d(3, 2, 3, padding=1, padding_mode="reflect", B=2),
         nn.Conv2d(3, 2, 3, padding=1, padding_mode="reflect"), (2, 2, 3, 0, 5), "[2, 3, 0, 5]"),
    ]


@pytest.mark.parametrize("layout", ["batch_major", "memory_first", "shared"])
def test_errors_inside_pooling_and_convs_name_the_users_shape(layout):
    for array, model, shape, named in _pool_cases():
        x = torch.randn(shape)
        if layout == "memory_first" and x.dim() >= 3:
            x = x.transpose(0, 1).contiguous().transpose(0, 1)
        elif layout == "shared":
            x = hfkern.broadcast(x[0], shape[0])
        with pytest.raises(RuntimeError) as expected:
            model(x[0])
        assert named in str(expected.value)  # what torch says for one model's input
        with pytest.raises(RuntimeError) as info:
            array(x)
        msg = str(info.value)
        assert msg.startswith(f"{type(array).__name__}: "), msg
        assert str(expected.value) in msg, msg  # torch's message for one model's input
        assert f"the array input has shape {list(x.shape)}" in msg, msg
        assert f"model 0's input of shape {list(x.shape[1:])}" in msg, msg


def test_pool_error_no_longer_shows_the_folded_shape():
    with pytest.raises(RuntimeError) as info:
        hnn.MaxPool2d(2)(torch.randn(2, 2, 3, 0, 5))
    assert "[4, 3, 0, 5]" not in str(info.value) and "got:[2, 3, 0, 5]" in str(info.value)
    with pytest.raises(RuntimeError) as info:
        hnn.MaxPool2d(3)(torch.randn(2, 3, 2, 2))  # unbatched: torch says (3x2x2), not (6x2x2)
    assert "(6x2x2)" not in str(info.value) and "Given input size: (3x2x2)" in str(info.value)
    with pytest.raises(RuntimeError) as info:
        hnn.ConvTranspose2d(3, 2, 3, B=2)(torch.randn(2, 2, 3, 0, 5))
    assert "[2, 6, 0, 5]" not in str(info.value) and "input shape: [2, 3, 0, 5]" in str(info.value)
    # inputs torch accepts are computed as before
    torch.manual_seed(0)
    pool = hnn.MaxPool2d(2, return_indices=True)
    x = torch.randn(3, 2, 4, 6, 6)
    y, idx = pool(x)
    for b in range(3):
        ry, ridx = nn.MaxPool2d(2, return_indices=True)(x[b])
        assert torch.equal(y[b], ry) and torch.equal(idx[b], ridx)
    convs = [nn.Conv2d(4, 2, 3, padding=1, padding_mode="reflect") for _ in range(3)]
    array = hnn.Conv2d.from_modules(convs)
    torch.testing.assert_close(array(x), torch.stack([m(x[b]) for b, m in enumerate(convs)]).detach())


# ---- 4. from_modules: equal-meaning spellings, PReLU's init -----------------------------

@pytest.mark.parametrize("cls,torch_cls,a,b", [
    (hnn.MaxPool2d, nn.MaxPool2d, dict(kernel_size=2), dict(kernel_size=(2, 2))),
    (hnn.MaxPool2d, nn.MaxPool2d, dict(kernel_size=2), dict(kernel_size=2, stride=(2, 2), padding=(0, 0),
                                                            dilation=(1, 1))),
    (hnn.MaxPool2d, nn.MaxPool2d, dict(kernel_size=3, stride=None), dict(kernel_size=(3, 3), stride=3)),
    (hnn.MaxPool1d, nn.MaxPool1d, dict(kernel_size=2), dict(kernel_size=(2,), stride=2, padding=(0,))),
    (hnn.AvgPool2d, nn.AvgPool2d, dict(kernel_size=3, padding=1), dict(kernel_size=(3, 3), stride=3,
                                                                       padding=(1, 1))),
    (hnn.AdaptiveAvgPool2d, nn.AdaptiveAvgPool2d, dict(output_size=3), dict(output_size=(3, 3))),
    (hnn.AdaptiveAvgPool1d, nn.AdaptiveAvgPool1d, dict(output_size=3), dict(output_size=(3,))),
])
def test_from_modules_takes_equal_meaning_pool_spellings(cls, torch_cls, a, b):
    modules = [torch_cls(**a), torch_cls(**b), torch_cls(**a)]
    array = cls.from_modules(modules)
    x = torch.randn(3, 2, 4, *((9, 9) if "2d" in cls.__name__ else (9,)))
    y = array(x)
    y = y[0] if isinstance(y, tuple) else y
    for i, m in enumerate(modules):
        assert torch.equal(y[i], m(x[i]))
    # the array keeps module 0's spelling; load_model takes another spelling too
    assert {k: getattr(array, k) for k in a} == {k: getattr(modules[0], k) for k in a}
    array.load_model(1, torch_cls(**b))


def test_from_modules_refuses_only_different_pools():
    assert hnn.MaxPool2d.from_modules([nn.MaxPool2d(2), nn.MaxPool2d((2, 2))]).kernel_size == 2
    with pytest.raises(ValueError, match="field 'kernel_size' differs: module 0 has 2, module 1 has 3"):
        hnn.MaxPool2d.from_modules([nn.MaxPool2d(2), nn.MaxPool2d(3)])
    with pytest.raises(ValueError, match="field 'kernel_size' differs"):
        hnn.MaxPool2d.from_modules([nn.MaxPool2d(2), nn.MaxPool2d((2, 3))])
    with pytest.raises(ValueError, match="field 'stride' differs"):
        hnn.MaxPool2d.from_modules([nn.MaxPool2d(2), nn.MaxPool2d(2, stride=1)])
    with pytest.raises(ValueError, match="field 'output_size' differs"):
        hnn.AdaptiveAvgPool2d.from_modules([nn.AdaptiveAvgPool2d(2), nn.AdaptiveAvgPool2d((2, None))])
    with pytest.raises(ValueError, match="field 'kernel_size' differs"):
        hnn.MaxPool2d.from_modules([nn.MaxPool2d(2)]).load_model(0, nn.MaxPool2d((2, 1)))


def test_prelu_from_modules_with_different_inits():
    modules = [nn.PReLU(1, 0.1), nn.PReLU(1, 0.3)]
    array = hnn.PReLU.from_modules(modules)
    assert array.init == (0.1, 0.3)  # one value per model, as per-model fields are kept
    torch.testing.assert_close(array.weight.detach().flatten(), torch.tensor([0.1, 0.3]))
    assert [m.init for m in array.to_modules()] == [0.1, 0.3]
    with torch.no_grad():
        array.weight.zero_()
    array.reset_model(1, seed=0)  # model 1's own init
    torch.testing.assert_close(array.weight.detach().flatten(), torch.tensor([0.0, 0.3]))
    array.reset_parameters()
    torch.testing.assert_close(array.weight.detach().flatten(), torch.tensor([0.1, 0.3]))
    array.load_model(0, nn.PReLU(1, 0.5))
    assert array.init == (0.5, 0.3)
    # modules that agree keep the one value
    assert hnn.PReLU.from_modules([nn.PReLU(2, 0.1), nn.PReLU(2, 0.1)]).init == 0.1
    # num_parameters must still agree
    with pytest.raises(ValueError, match="'num_parameters' differs"):
        hnn.PReLU.from_modules([nn.PReLU(2, 0.1), nn.PReLU(3, 0.1)])
    # the constructor takes one init per model too
    m = hnn.PReLU(2, init=[0.1, 0.2, 0.3], B=3)
    torch.testing.assert_close(m.weight.detach(), torch.tensor([[0.1] * 2, [0.2] * 2, [0.3] * 2]))
    with pytest.raises(ValueError, match=r"init to be one value or one per model \(length B=3\), got 2"):
        hnn.PReLU(2, init=[0.1, 0.2], B=3)


def test_transformer_layer_with_prelu_activations_of_different_inits():
    def layer(activation):
        return nn.TransformerEncoderLayer(8, 2, 16, 0.0, activation=activation)

    array = hnn.TransformerEncoderLayer.from_modules([layer(nn.PReLU()), layer(nn.PReLU(init=0.1))])
    assert array.activation.init == (0.25, 0.1)
    assert array.extract_model(1).activation.init == 0.1
