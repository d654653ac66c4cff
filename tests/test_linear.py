import pytest
import torch
from torch import nn

import hfkern
import hfkern.nn as hnn
from _util import array_input, assert_state_equal, compare_modules


@pytest.mark.parametrize("B", [1, 3])
@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("shape,layout", [
    ((7, 5), "contiguous"), ((7, 5), "batch_major"), ((7, 5), "strided"),
    ((5,), "contiguous"), ((2, 3, 5), "contiguous"), ((7, 5), "shared"), ((2, 3, 5), "shared"),
])
def test_linear_matches_torch(B, bias, shape, layout):
    modules = [nn.Linear(5, 3, bias=bias) for _ in range(B)]
    array = hnn.Linear.from_modules(modules)
    shared = layout == "shared"
    x, xs, leaf = array_input(shape, B, shared=shared, layout="contiguous" if shared else layout)
    y = compare_modules(array, modules, x, xs, leaf, shared=shared)
    assert y.shape == (B, *shape[:-1], 3)
    assert_state_equal(array, modules)


def test_linear_shared_is_one_dense_matmul():
    array = hnn.Linear(5, 3, B=4)
    x = hfkern.broadcast(torch.randn(7, 5), 4)
    y = array(x)
    # the dense path returns the [N, B, out] memory of one [N, B*out] matmul
    assert y.transpose(0, 1).is_contiguous()


def test_linear_init_distribution_and_independence():
    B = 128
    array = hnn.Linear(20, 10, B=B)
    bound = 1 / 20 ** 0.5
    assert array.weight.abs().max() <= bound and array.bias.abs().max() <= bound
    ref = torch.stack([nn.Linear(20, 10).weight.detach() for _ in range(B)])
    torch.testing.assert_close(array.weight.std(), ref.std(), atol=0, rtol=0.05)
    assert not torch.equal(array.weight[0], array.weight[1])


def test_linear_bad_inputs():
    lin = hnn.Linear(5, 3, B=2)
    with pytest.raises(ValueError, match="in_features=5.*got shape \\[2, 7, 4\\]"):
        lin(torch.randn(2, 7, 4))
    with pytest.raises(ValueError, match="leading .*B=2"):
        lin(torch.randn(3, 7, 5))
    with pytest.raises(TypeError, match="dtype"):
        lin(torch.randn(2, 7, 5, dtype=torch.float64))
    with pytest.raises(ValueError, match="field 'out_features' differs"):
        hnn.Linear.from_modules([nn.Linear(5, 3), nn.Linear(5, 4)])


def test_linear_device_dtype_factory_kwargs():
    lin = hnn.Linear(5, 3, B=2, dtype=torch.float64)
    assert lin.weight.dtype == torch.float64
    mods = lin.to_modules()
    assert mods[0].weight.dtype == torch.float64
    x = torch.randn(2, 4, 5, dtype=torch.float64)
    torch.testing.assert_close(lin(x)[1], mods[1](x[1]))


@pytest.mark.filterwarnings("ignore:Initializing zero-element tensors is a no-op")
@pytest.mark.parametrize("B", [1, 3])
@pytest.mark.parametrize("shape,layout", [((7, 0), "contiguous"), ((0,), "contiguous"), ((2, 3, 0), "contiguous"),
                                          ((7, 0), "shared")])
def test_linear_zero_in_features(B, shape, layout):
    # torch returns the bias (expanded) for in_features == 0; its gradient is
    # the output gradient summed over the rows. torch's init zeroes that bias.
    array = hnn.Linear(0, 4, B=B)
    assert torch.equal(array.bias, torch.zeros(B, 4))
    with torch.no_grad():
        array.bias.normal_()  # a bias that shows in the output
    modules = array.to_modules()
    shared = layout == "shared"
    x, xs, leaf = array_input(shape, B, shared=shared)
    y = compare_modules(array, modules, x, xs, leaf, shared=shared)
    assert y.shape == (B, *shape[:-1], 4)
    assert_state_equal(array, modules)


@pytest.mark.filterwarnings("ignore:Initializing zero-element tensors is a no-op")
def test_linear_zero_out_features_and_zero_rows():
    for inp, out, shape in ((5, 0, (3, 5)), (5, 3, (0, 5)), (0, 3, (0, 0))):
        modules = [nn.Linear(inp, out) for _ in range(2)]
        array = hnn.Linear.from_modules(modules)
        x, xs, leaf = array_input(shape, 2)
        assert compare_modules(array, modules, x, xs, leaf).shape == (2, *shape[:-1], out)


def test_from_modules_refuses_what_the_array_cannot_hold():
    # A parametrized weight, or an extra persistent buffer in any module: a ValueError naming the
    # names (a KeyError, or the buffer silently dropped where module 0 had it).
    from torch.nn.utils import parametrizations

    with pytest.raises(ValueError, match=r"expected a module with the parameters \['bias', 'weight'\], got one with "
                                         r"\['bias', 'parametrizations.weight.original0'"):
        hnn.Linear.from_modules([parametrizations.weight_norm(nn.Linear(3, 4))])
    extra = nn.Linear(3, 4)
    extra.register_buffer("ema", torch.ones(4))
    for modules in ([nn.Linear(3, 4), extra], [extra, nn.Linear(3, 4)]):
        with pytest.raises(ValueError, match=r"state dict keys differ"):
            hnn.Linear.from_modules(modules)
    with pytest.raises(ValueError, match=r"expected a module with the buffers \[\], got one with \['ema'\]"):
        hnn.Linear.from_modules([extra])


def test_load_state_dict_of_a_view_of_its_own_memory():
    # A value overlapping the module's own memory (a transposed view of its weight): torch's copy_
    # refused it after the entries before it had been written; it loads as the values it holds.
    a = hnn.Linear(3, 3, B=3)
    want_weight = a.weight.detach().transpose(0, 1).clone()
    bias = torch.randn(3, 3)
    a.load_state_dict({"bias": bias, "weight": a.weight.detach().transpose(0, 1)})
    assert torch.equal(a.weight, want_weight) and torch.equal(a.bias, bias)
    before = [t.clone() for t in (a.weight, a.bias)]
    a.load_state_dict(a.state_dict())  # its own entries: the very tensors, nothing copied first
    assert all(torch.equal(t, u) for t, u in zip((a.weight, a.bias), before))
