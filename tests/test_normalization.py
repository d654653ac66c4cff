import pytest
import torch
from torch import nn

import hfkern
import hfkern.nn.normalization as hnn
from hfkern.nn._base import torch_module
from _util import array_input, assert_state_equal, compare_modules

LAYOUTS = ["contiguous", "batch_major", "strided", "shared"]


def randomized(modules):
    """torch modules with random parameters (their init is ones/zeros) so every
    parameter gradient and affine term is exercised."""
    with torch.no_grad():
        for m in modules:
            for p in m.parameters():
                p.normal_()
    return modules


def run_case(cls, modules, shape, B, layout, **kw):
    array = cls.from_modules(modules)
    shared = layout == "shared"
    x, xs, leaf = array_input(shape, B, shared=shared, layout="contiguous" if shared else layout)
    y = compare_modules(array, modules, x, xs, leaf, shared=shared, **kw)
    assert_state_equal(array, modules)
    return array, x, y


def assert_memory_order_kept(x, y):
    if hfkern.is_shared(x):
        return
    if x.is_contiguous():
        assert y.is_contiguous(), y.stride()
    elif x.transpose(0, 1).is_contiguous():
        assert y.transpose(0, 1).is_contiguous(), y.stride()


# ---- LayerNorm / RMSNorm --------------------------------------------------

LN_CASES = [
    (dict(normalized_shape=7), (5, 7)),
    (dict(normalized_shape=(3, 5), eps=1e-3), (4, 3, 5)),
    (dict(normalized_shape=[3, 4, 5], bias=False), (2, 3, 4, 5)),
    (dict(normalized_shape=(4, 3), elementwise_affine=False), (2, 3, 4, 3)),
    (dict(normalized_shape=6), (6,)),
]


@pytest.mark.parametrize("B", [1, 3])
@pytest.mark.parametrize("kw,shape", LN_CASES)
@pytest.mark.parametrize("layout", LAYOUTS)
def test_layer_norm_matches_torch(B, kw, shape, layout):
    if layout == "batch_major" and len(shape) == 1:
        pytest.skip("no per-model batch dim")
    modules = randomized([nn.LayerNorm(**kw) for _ in range(B)])
    _, x, y = run_case(hnn.LayerNorm, modules, shape, B, layout)
    assert_memory_order_kept(x, y)


RMS_CASES = [
    (dict(normalized_shape=7), (5, 7)),
    (dict(normalized_shape=(3, 5), eps=1e-4), (4, 3, 5)),
    (dict(normalized_shape=(4, 3), elementwise_affine=False), (2, 3, 4, 3)),
    (dict(normalized_shape=[6], eps=0.5), (6,)),
]


@pytest.mark.parametrize("B", [1, 3])
@pytest.mark.parametrize("kw,shape", RMS_CASES)
@pytest.mark.parametrize("layout", LAYOUTS)
def test_rms_norm_matches_torch(B, kw, shape, layout):
    if layout == "batch_major" and len(shape) == 1:
        pytest.skip("no per-model batch dim")
    modules = randomized([nn.RMSNorm(**kw) for _ in range(B)])
    _, x, y = run_case(hnn.RMSNorm, modules, shape, B, layout)
    assert_memory_order_kept(x, y)


def test_rms_norm_default_eps_follows_dtype():
    B = 2
    x = torch.randn(B, 3, 4, dtype=torch.float64) * 1e-9  # eps dominates the mean square
    for dtype in (torch.float64, torch.float32):
        array = hnn.RMSNorm(4, B=B, dtype=dtype)
        ref = nn.RMSNorm(4, dtype=dtype)
        torch.testing.assert_close(array(x.to(dtype)), torch.stack([ref(x[b].to(dtype)) for b in range(B)]))


@pytest.mark.parametrize("cls", [hnn.LayerNorm, hnn.RMSNorm])
def test_shared_input_without_parameters_is_computed_once(cls):
    array = cls((5,), elementwise_affine=False)
    base = torch.randn(4, 5)
    y = array(hfkern.broadcast(base, 3))
    assert hfkern.is_shared(y) and y.shape == (3, 4, 5)
    torch.testing.assert_close(y[2], cls._torch_cls(5, elementwise_affine=False)(base))


# ---- GroupNorm ------------------------------------------------------------

GN_CASES = [
    (dict(num_groups=2, num_channels=6), (5, 6, 4, 3)),
    (dict(num_groups=3, num_channels=6, eps=1e-3, affine=False), (5, 6, 7)),
    (dict(num_groups=1, num_channels=4, bias=False), (3, 4, 5, 2)),
    # one value per group and sample: y = bias, up to eps-amplified rounding
    (dict(num_groups=4, num_channels=4, eps=0.1), (5, 4)),
    (dict(num_groups=2, num_channels=4), (1, 4, 3, 2, 2)),
]


@pytest.mark.parametrize("B", [1, 3])
@pytest.mark.parametrize("kw,shape", GN_CASES)
@pytest.mark.parametrize("layout", LAYOUTS)
def test_group_norm_matches_torch(B, kw, shape, layout):
    modules = randomized([torch_module(nn.GroupNorm, **kw) for _ in range(B)])
    array, x, y = run_case(hnn.GroupNorm, modules, shape, B, layout)
    assert_memory_order_kept(x, y)
    if layout == "shared" and B > 1 and kw.get("affine", True):
        # normalized once where nothing differentiates the input, the affine per model into
        # [N, B, C, *] memory, which an array conv reads for free
        with torch.no_grad():
            assert array(x).transpose(0, 1).is_contiguous()


def test_group_norm_inputs_torch_rejects():
    array = hnn.GroupNorm(2, 4, B=2)
    with pytest.raises(ValueError, match=r"expected input of shape \[B, N, C, \*\].*got 2-D shape \[2, 4\]"):
        array(torch.randn(2, 4))  # torch: at least 2 dims per model
    with pytest.raises(ValueError, match=r"more than 1 value per channel.*\[1, 4\]"):
        hnn.GroupNorm(4, 4, B=2)(torch.randn(2, 1, 4))
    with pytest.raises(ValueError, match="more than 1 value per channel"):
        nn.GroupNorm(4, 4)(torch.randn(1, 4))  # the same input, torch's own guard


# ---- BatchNorm ------------------------------------------------------------

BN_OPTIONS = [
    dict(),
    dict(momentum=None),
    dict(momentum=0.3, eps=1e-3, affine=False),
    dict(track_running_stats=False),
    dict(affine=False, track_running_stats=False),
    dict(bias=False, momentum=None),
]
BN_SHAPES = [(nn.BatchNorm1d, hnn.BatchNorm1d, (6, 5)),
             (nn.BatchNorm1d, hnn.BatchNorm1d, (4, 5, 3)),
             (nn.BatchNorm2d, hnn.BatchNorm2d, (3, 5, 4, 3))]


def bn_trajectory(torch_cls, cls, shape, B, layout, kw, steps=3):
    """Several training steps (forward, backward, buffers) against B torch
    modules, then eval; returns the array module."""
    modules = randomized([torch_module(torch_cls, shape[1], **kw) for _ in range(B)])
    array = cls.from_modules(modules)
    for _ in range(steps):
        shared = layout == "shared"
        x, xs, leaf = array_input(shape, B, shared=shared, layout="contiguous" if shared else layout)
        y = compare_modules(array, modules, x, xs, leaf, shared=shared)
        assert_memory_order_kept(x, y)
        assert_state_equal(array, modules)
    array.eval()
    for m in modules:
        m.eval()
    x, xs, leaf = array_input(shape, B, layout="contiguous" if layout == "shared" else layout)
    compare_modules(array, modules, x, xs, leaf)
    assert_state_equal(array, modules)
    return array


@pytest.mark.parametrize("B", [1, 3])
@pytest.mark.parametrize("torch_cls,cls,shape", BN_SHAPES)
@pytest.mark.parametrize("kw", BN_OPTIONS)
@pytest.mark.parametrize("layout", LAYOUTS)
def test_batch_norm_trajectory_matches_torch(B, torch_cls, cls, shape, kw, layout):
    array = bn_trajectory(torch_cls, cls, shape, B, layout, kw)
    if array.track_running_stats:
        assert array.num_batches_tracked.tolist() == [3] * B


@pytest.mark.parametrize("layout", ["contiguous", "batch_major"])
def test_batch_norm_cumulative_average_with_different_counts(layout):
    # momentum=None averages over each model's own count of batches
    B = 3
    modules = randomized([nn.BatchNorm1d(4, momentum=None) for _ in range(B)])
    for b, m in enumerate(modules):
        with torch.no_grad():
            m.num_batches_tracked.fill_(2 * b)
            m.running_mean.normal_()
            m.running_var.uniform_(0.5, 2)
    array = hnn.BatchNorm1d.from_modules(modules)
    for _ in range(2):
        x, xs, leaf = array_input((6, 4, 3), B, layout=layout)
        compare_modules(array, modules, x, xs, leaf)
        assert_state_equal(array, modules)
    assert array.num_batches_tracked.tolist() == [2, 4, 6]


def test_batch_norm_paths():
    """[N, B, ...] memory runs torch's kernel on the grouped view and writes the
    running stats into the [B, C] buffers in place; [B, N, C] memory is read
    where it lies (the output has its memory order, nothing is gathered)."""
    B, N, C = 3, 5, 4
    array = hnn.BatchNorm1d(C, B=B)
    rm_ptr = array.running_mean.data_ptr()
    x = torch.randn(N, B, C).transpose(0, 1)
    y = array(x)
    assert y.transpose(0, 1).is_contiguous()
    assert array.running_mean.data_ptr() == rm_ptr
    torch.testing.assert_close(array.running_mean, 0.1 * x.mean(1))
    running_var = array.running_var.clone()
    x = torch.randn(B, N, C, 3)
    y = array(x)
    assert y.is_contiguous()
    torch.testing.assert_close(array.running_var, 0.9 * running_var + 0.1 * x.var(dim=(1, 3)))


def test_batch_norm_errors_follow_torch():
    array = hnn.BatchNorm1d(3, B=2)
    with pytest.raises(ValueError, match=r"more than 1 value per channel.*\[1, 3\]"):
        array(torch.randn(2, 1, 3))
    with pytest.raises(ValueError):
        nn.BatchNorm1d(3)(torch.randn(1, 3))
    array.eval()
    assert array(torch.randn(2, 1, 3)).shape == (2, 1, 3)  # eval uses the running stats
    with pytest.raises(ValueError, match=r"expected input of 3-D or 4-D shape.*got 5-D"):
        array(torch.randn(2, 4, 3, 2, 2))
    with pytest.raises(ValueError, match=r"expected input of 5-D shape.*got 4-D"):
        hnn.BatchNorm2d(3, B=2)(torch.randn(2, 4, 3, 2))
    with pytest.raises(ValueError, match=r"eps must be positive"):
        hnn.BatchNorm2d(3, eps=0.0, B=2)(torch.randn(2, 4, 3, 2, 2))


# ---- init, state, conversion ----------------------------------------------

@pytest.mark.parametrize("make,torch_make", [
    (lambda: hnn.LayerNorm((3, 4), B=3), lambda: nn.LayerNorm((3, 4))),
    (lambda: hnn.RMSNorm(4, B=3), lambda: nn.RMSNorm(4)),
    (lambda: hnn.GroupNorm(2, 4, B=3), lambda: nn.GroupNorm(2, 4)),
    (lambda: hnn.BatchNorm1d(4, momentum=None, B=3), lambda: nn.BatchNorm1d(4, momentum=None)),
    (lambda: hnn.BatchNorm2d(4, affine=False, B=3), lambda: nn.BatchNorm2d(4, affine=False)),
])
def test_init_and_state_like_torch(make, torch_make):
    array, ref = make(), torch_make()
    sd, ref_sd = array.state_dict(), ref.state_dict()
    assert list(sd) == list(ref_sd)
    for k, v in ref_sd.items():
        assert sd[k].shape == (3, *v.shape) and sd[k].dtype == v.dtype
        for b in range(3):
            assert torch.equal(sd[k][b], v)
    for b, m in enumerate(array.to_modules()):
        assert type(m) is type(ref)
        assert type(array)._config_of(m) == type(array)._config_of(ref)


def test_batch_norm_reset_running_stats():
    array = hnn.BatchNorm2d(3, B=2)
    array(torch.randn(2, 4, 3, 2, 2))
    assert array.num_batches_tracked.tolist() == [1, 1]
    array.reset_running_stats()
    assert torch.equal(array.running_mean, torch.zeros(2, 3))
    assert torch.equal(array.running_var, torch.ones(2, 3))
    assert array.num_batches_tracked.tolist() == [0, 0]


@pytest.mark.parametrize("cls,args", [
    (hnn.LayerNorm, (5,)), (hnn.RMSNorm, (5,)), (hnn.GroupNorm, (1, 5)),
    (hnn.BatchNorm1d, (5,)), (hnn.BatchNorm2d, (5,)),
])
def test_b_required_with_state_and_validated(cls, args):
    with pytest.raises(TypeError, match="B"):
        cls(*args)
    with pytest.raises(ValueError, match="B must be >= 1, got 0"):
        cls(*args, B=0)


def test_stateless_modules_take_optional_b():
    x = torch.randn(3, 4, 5)
    assert hnn.LayerNorm(5, elementwise_affine=False)(x).shape == x.shape
    assert hnn.GroupNorm(1, 5, affine=False)(x).shape == x.shape
    assert hnn.BatchNorm1d(5, affine=False, track_running_stats=False)(x).shape == x.shape
    with pytest.raises(ValueError, match=r"leading \(array\) dim B=2, got shape \[3, 4, 5\]"):
        hnn.RMSNorm(5, elementwise_affine=False, B=2)(x)


# ---- bad input ------------------------------------------------------------

def _ln():
    return hnn.LayerNorm((3, 4), B=2)


def _gn():
    return hnn.GroupNorm(2, 4, B=2)


F64 = r"dtype torch.float32.*got torch.float64"
randn64 = lambda *s: torch.randn(*s, dtype=torch.float64)  # noqa: E731


@pytest.mark.parametrize("module,bad,match,exc", [
    (_ln, torch.randn(3, 5, 3, 4), r"leading \(array\) dim B=2, got shape \[3, 5, 3, 4\]", ValueError),
    (_ln, torch.randn(2, 5, 4, 3), r"\[B, \*, 3, 4\].*got shape \[2, 5, 4, 3\]", ValueError),
    (_ln, torch.randn(2, 4), r"\[B, \*, 3, 4\].*got shape \[2, 4\]", ValueError),
    (lambda: hnn.LayerNorm(4, B=2), randn64(2, 3, 4), F64, TypeError),
    (lambda: hnn.RMSNorm(4, B=2), [[1.0]], r"torch.Tensor, got list", TypeError),
    (lambda: hnn.RMSNorm(4, B=2), torch.randn(2, 3, 5), r"\[B, \*, 4\].*got shape \[2, 3, 5\]", ValueError),
    (_gn, torch.randn(2, 3, 6, 5), r"expected input with 4 channels at dim 2.*got 6", ValueError),
    (_gn, torch.randn(3, 3, 4, 5), r"B=2, got shape \[3, 3, 4, 5\]", ValueError),
    (_gn, randn64(2, 3, 4), F64, TypeError),
    (_gn, "x", r"torch.Tensor, got str", TypeError),
    (lambda: hnn.BatchNorm1d(4, B=2), torch.randn(2, 3, 5), r"4 channels at dim 2.*got 5", ValueError),
    (lambda: hnn.BatchNorm1d(4, affine=False, B=2), randn64(2, 3, 4), F64, TypeError),
    (lambda: hnn.BatchNorm2d(4, B=2), torch.randn(1, 3, 4, 2, 2), r"B=2, got shape \[1, 3, 4, 2, 2\]", ValueError),
    # without a weight nothing else checks the dtype: these computed and rounded the
    # normalized values into the input's dtype (torch raises NotImplementedError)
    (lambda: hnn.LayerNorm(4, elementwise_affine=False, B=2), torch.randint(0, 9, (2, 3, 4)),
     r"floating-point dtype, got torch.int64", TypeError),
    (lambda: hnn.LayerNorm(4, elementwise_affine=False, B=2), torch.rand(2, 3, 4) > 0.5,
     r"floating-point dtype, got torch.bool", TypeError),
    (lambda: hnn.RMSNorm(4, elementwise_affine=False, B=2), torch.randint(0, 9, (2, 3, 4)),
     r"floating-point dtype, got torch.int64", TypeError),
    (lambda: hnn.RMSNorm(4, elementwise_affine=False, B=2), torch.randn(2, 3, 4, dtype=torch.complex64),
     r"floating-point dtype, got torch.complex64", TypeError),
])
def test_bad_input_raises(module, bad, match, exc):
    m = module()
    before = {k: v.clone() for k, v in m.state_dict().items()}
    with pytest.raises(exc, match=match):
        m(bad)
    for k, v in m.state_dict().items():  # rejected before any state changes
        assert torch.equal(v, before[k])


def test_from_modules_rejects_mixed_configs():
    with pytest.raises(ValueError, match="momentum"):
        hnn.BatchNorm1d.from_modules([nn.BatchNorm1d(3), nn.BatchNorm1d(3, momentum=None)])
    with pytest.raises(ValueError, match="bias"):
        hnn.LayerNorm.from_modules([nn.LayerNorm(3), nn.LayerNorm(3, bias=False)])


def test_torch_module_without_bias_argument():
    # torch releases whose GroupNorm / BatchNorm take no `bias` (2.11): bias=False
    # becomes a bias registered as None, as torch writes it where the argument exists.
    class OldNorm(nn.Module):
        def __init__(self, num_features, affine=True):
            super().__init__()
            self.weight = nn.Parameter(torch.ones(num_features)) if affine else None
            self.bias = nn.Parameter(torch.zeros(num_features)) if affine else None

    assert torch_module(OldNorm, 3, bias=False).bias is None
    assert torch_module(OldNorm, 3, bias=True).bias.shape == (3,)
    assert torch_module(OldNorm, 3, affine=False, bias=True).bias is None
    m = torch_module(nn.GroupNorm, 1, 3, bias=False)
    assert m.bias is None and m.weight.shape == (3,)


def _stats_dict(sd, drop=("num_batches_tracked",)):
    out = type(sd)((k, v) for k, v in sd.items() if k not in drop)
    if hasattr(sd, "_metadata"):
        out._metadata = sd._metadata
    return out


@pytest.mark.parametrize("torch_cls,cls,shape", [(nn.BatchNorm1d, hnn.BatchNorm1d, (6, 4)),
                                                 (nn.BatchNorm2d, hnn.BatchNorm2d, (3, 4, 5, 5))])
@pytest.mark.parametrize("strict", [True, False])
def test_batch_norm_loads_checkpoint_without_num_batches_tracked(torch_cls, cls, shape, strict):
    # A checkpoint from before num_batches_tracked (no version metadata, or
    # version 1): torch loads it and keeps its own counts; so does the array,
    # per model, exactly as B torch modules.
    B = 3
    modules = randomized([torch_cls(4) for _ in range(B)])
    for b, m in enumerate(modules):
        for _ in range(b):
            m(torch.randn(shape))  # different counts per model
    array = cls.from_modules(modules)
    donors = randomized([torch_cls(4) for _ in range(B)])
    old = {k: torch.stack([d.state_dict()[k] for d in donors]) for k in ("weight", "bias", "running_mean",
                                                                          "running_var")}
    for b, m in enumerate(modules):
        m.load_state_dict({k: v[b] for k, v in old.items()}, strict=strict)
    array.load_state_dict(old, strict=strict)
    assert_state_equal(array, modules)
    assert array.num_batches_tracked.tolist() == [0, 1, 2]
    # the same with version-1 metadata, as an older torch saved it
    v1 = _stats_dict(array.state_dict())
    v1._metadata[""]["version"] = 1
    assert cls(4, B=B).load_state_dict(v1, strict=strict).missing_keys == []
    # inside a container: the prefix is honoured
    seq = nn.Sequential(nn.Identity(), cls(4, B=B))
    seq.load_state_dict({f"1.{k}": v for k, v in old.items()}, strict=strict)
    torch.testing.assert_close(seq[1].running_mean, old["running_mean"])
    # a current (version 2) state dict without the key is incomplete, as in torch
    current = _stats_dict(array.state_dict())
    torch_current = _stats_dict(modules[0].state_dict())
    if strict:
        with pytest.raises(RuntimeError, match='Missing key.*"num_batches_tracked"'):
            modules[0].load_state_dict(torch_current)
        with pytest.raises(RuntimeError, match='Missing key.*"num_batches_tracked"'):
            array.load_state_dict(current)
    else:
        assert modules[0].load_state_dict(torch_current, strict=False).missing_keys == ["num_batches_tracked"]
        assert array.load_state_dict(current, strict=False).missing_keys == ["num_batches_tracked"]
