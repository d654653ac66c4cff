"""Per-model surgery of the array modules: ``load_model``, ``extract_model``, ``reset_model``.

Slot b takes a torch module's parameters and buffers (or a fresh model's)
while the other slots stay bit-identical, and everything is checked before
anything is written.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

import hfkern.nn as hnn
import hfkern.optim as hoptim

# (torch factory, array class, one model's input)
CASES = [
    (lambda: nn.Conv2d(3, 5, 3, padding=1), hnn.Conv2d, lambda: torch.randn(2, 3, 7, 5)),
    (lambda: nn.Linear(5, 3), hnn.Linear, lambda: torch.randn(4, 5)),
    (lambda: nn.BatchNorm2d(5, momentum=0.3), hnn.BatchNorm2d, lambda: torch.randn(3, 5, 3, 5)),
    (lambda: nn.LayerNorm(7), hnn.LayerNorm, lambda: torch.randn(3, 7)),
    (lambda: nn.Embedding(11, 3, padding_idx=2), hnn.Embedding, lambda: torch.randint(0, 11, (5,))),
    (lambda: nn.Dropout(0.25), hnn.Dropout, lambda: torch.randn(3, 5)),
    (lambda: nn.MultiheadAttention(6, 2, dropout=0.1, add_bias_kv=True), hnn.MultiheadAttention,
     lambda: torch.randn(5, 2, 6)),
    (lambda: nn.TransformerEncoderLayer(6, 2, 9, dropout=0.1), hnn.TransformerEncoderLayer,
     lambda: torch.randn(5, 2, 6)),
    (lambda: nn.PReLU(3), hnn.PReLU, lambda: torch.randn(4, 3)),
]
IDS = [c[1].__name__ for c in CASES]
SLOTS = [(1, 0), (3, 1), (5, 4)]  # (B, b)


def _call(m, x):
    if isinstance(m, (nn.MultiheadAttention, hnn.MultiheadAttention)):
        return m(x, x, x)[0]
    return m(x)


def _randomized(module):
    """``module`` with fresh random values in every parameter and buffer (not its init)."""
    with torch.no_grad():
        for t in module.parameters():
            t.copy_(torch.randn_like(t))
        for t in module.buffers():  # running statistics: variances must stay positive
            t.copy_(torch.rand_like(t) + 0.5 if t.is_floating_point() else torch.randint_like(t, 0, 100))
    return module


def _array(factory, cls, B):
    return cls.from_modules([_randomized(factory()) for _ in range(B)])


def _snapshot(array):
    state = {k: v.clone() for k, v in array.state_dict().items()}
    state.update({k: v.clone() for k, v in array.named_buffers()})
    fields = {(path, f): getattr(sub, f) for path, sub, f in array._held_per_model_fields()}
    return state, fields


def _assert_same(array, snapshot, slots=None):
    state, fields = snapshot
    now = dict(array.state_dict())
    now.update(dict(array.named_buffers()))
    assert set(now) == set(state)
    for k, v in state.items():
        if slots is None:
            assert torch.equal(now[k], v), k
        else:
            assert torch.equal(now[k][slots], v[slots]), k
    if slots is None:
        assert {(path, f): getattr(sub, f) for path, sub, f in array._held_per_model_fields()} == fields


def _assert_module_equal(got, want):
    assert type(got) is type(want)
    sd_got, sd_want = got.state_dict(), want.state_dict()
    assert set(sd_got) == set(sd_want)
    for k, v in sd_want.items():
        assert got.state_dict()[k].dtype == v.dtype, k
        assert torch.equal(sd_got[k], v), k


@pytest.mark.parametrize("B,b", SLOTS)
@pytest.mark.parametrize("factory,cls,make_input", CASES, ids=IDS)
def test_load_and_extract_round_trip(factory, cls, make_input, B, b):
    array = _array(factory, cls, B)
    params = {k: p for k, p in array.named_parameters()}
    before = _snapshot(array)
    module = _randomized(factory())
    array.load_model(b, module)

    others = [i for i in range(B) if i != b]
    _assert_same(array, before, others)
    assert {k: p for k, p in array.named_parameters()} == params  # the same objects
    got = array.extract_model(b)
    _assert_module_equal(got, module)
    assert got.training == array.training
    assert all(p.requires_grad for p in got.parameters())
    # copies, not views
    for p in got.parameters():
        with torch.no_grad():
            p.add_(1)
    for k, v in module.state_dict().items():
        assert torch.equal(array.state_dict()[k][b], v), k
    # the other slots still extract as before
    for i in others:
        state = before[0]
        for k, v in array.extract_model(i).state_dict().items():
            assert torch.equal(v, state[k][i]), k
    # and the array computes what the module computes
    array.eval()
    module.eval()
    x = make_input()
    xs = torch.stack([make_input() if i != b else x for i in range(B)])
    torch.testing.assert_close(_call(array, xs)[b], _call(module, x), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("factory,cls,make_input", CASES, ids=IDS)
def test_to_modules_is_extract_model(factory, cls, make_input):
    array = _array(factory, cls, 3)
    array.eval()
    for b, m in enumerate(array.to_modules()):
        _assert_module_equal(m, array.extract_model(b))
        assert not m.training


@pytest.mark.parametrize("B,b", SLOTS)
@pytest.mark.parametrize("factory,cls,make_input", CASES, ids=IDS)
def test_reset_model_with_seed_is_a_fresh_torch_module(factory, cls, make_input, B, b):
    array = _array(factory, cls, B)
    before = _snapshot(array)
    rng = torch.get_rng_state()
    array.reset_model(b, seed=1234)
    assert torch.equal(torch.get_rng_state(), rng)  # the global RNG is untouched
    torch.manual_seed(1234)
    fresh = factory()
    _assert_module_equal(array.extract_model(b), fresh)
    _assert_same(array, before, [i for i in range(B) if i != b])


@pytest.mark.parametrize("factory,cls,make_input", CASES, ids=IDS)
def test_reset_model_without_seed_draws_from_the_global_rng(factory, cls, make_input):
    array = _array(factory, cls, 3)
    torch.manual_seed(77)
    array.reset_model(2)
    after = torch.get_rng_state()
    torch.manual_seed(77)
    fresh = factory()
    assert torch.equal(torch.get_rng_state(), after)
    _assert_module_equal(array.extract_model(2), fresh)


def test_per_model_dropout_probability():
    array = hnn.Dropout(0.5, B=3)
    array.load_model(1, nn.Dropout(0.3))
    assert array.p == (0.5, 0.3, 0.5)
    assert array.extract_model(1).p == 0.3 and array.extract_model(2).p == 0.5
    array.reset_model(0, seed=0)  # keeps model 0's probability
    assert array.p == (0.5, 0.3, 0.5)
    array.load_model(1, nn.Dropout(0.5))
    assert array.p == 0.5  # one value again when all models agree, as from_modules keeps it

    # in training, model b drops with its own probability
    array = hnn.Dropout((0.0, 0.0, 0.0), B=3)
    array.load_model(2, nn.Dropout(1.0))
    y = array(torch.randn(3, 4, 5) + 10)
    assert (y[:2] != 0).all() and (y[2] == 0).all()


def test_transformer_layer_per_model_dropout_reaches_every_dropout():
    array = _array(lambda: nn.TransformerEncoderLayer(6, 2, 9, dropout=0.1), hnn.TransformerEncoderLayer, 3)
    array.load_model(1, nn.TransformerEncoderLayer(6, 2, 9, dropout=0.4))
    for sub, field in ((array.self_attn, "dropout"), (array.dropout, "p"), (array.dropout1, "p"),
                       (array.dropout2, "p")):
        assert getattr(sub, field) == (0.1, 0.4, 0.1)
    got = array.extract_model(1)
    assert (got.self_attn.dropout, got.dropout.p, got.dropout1.p, got.dropout2.p) == (0.4,) * 4
    assert array.extract_model(0).dropout.p == 0.1
    # torch children whose probabilities differ keep them, each in its own place
    odd = nn.TransformerEncoderLayer(6, 2, 9, dropout=0.1)
    odd.dropout2.p = 0.3
    array.load_model(2, odd)
    assert array.dropout2.p == (0.1, 0.4, 0.3) and array.dropout1.p == (0.1, 0.4, 0.1)
    assert array.extract_model(2).dropout2.p == 0.3


def test_batch_norm_running_stats_and_counts():
    torch.manual_seed(3)
    modules = [nn.BatchNorm2d(5) for _ in range(3)]
    for i, m in enumerate(modules):
        for _ in range(i + 1):
            m(torch.randn(4, 5, 3, 3))
    array = hnn.BatchNorm2d.from_modules(modules)
    new = nn.BatchNorm2d(5)
    for _ in range(5):
        new(torch.randn(4, 5, 3, 3))
    array.load_model(0, new)
    assert array.num_batches_tracked.tolist() == [5, 2, 3]
    assert torch.equal(array.running_var[0], new.running_var)
    array.reset_model(1, seed=0)
    assert array.num_batches_tracked.tolist() == [5, 0, 3]
    assert torch.equal(array.running_mean[1], torch.zeros(5))
    assert torch.equal(array.running_var[1], torch.ones(5))
    # training goes on per model: model 0 as the torch module it came from
    x = torch.randn(3, 4, 5, 3, 3)
    array(x)
    new(x[0])
    torch.testing.assert_close(array.running_mean[0], new.running_mean)
    assert array.num_batches_tracked.tolist() == [6, 1, 4]


def test_load_model_keeps_an_optimizer_working_and_clears_the_gradient():
    torch.manual_seed(4)
    array = hnn.Linear(5, 3, B=3)
    opt = hoptim.SGD(array.parameters(), lr=0.1)
    array(torch.randn(3, 4, 5)).sum().backward()
    grads = [p.grad.clone() for p in array.parameters()]
    module = nn.Linear(5, 3)
    array.load_model(1, module)
    for p, g in zip(array.parameters(), grads):
        assert torch.equal(p.grad[1], torch.zeros_like(g[1]))
        assert torch.equal(p.grad[[0, 2]], g[[0, 2]])
    weight = array.weight.detach().clone()
    opt.step()  # the optimizer still holds the array's parameters: slot 1 has a zero gradient
    assert torch.equal(array.weight[1], module.weight.detach())
    torch.testing.assert_close(array.weight[0], weight[0] - 0.1 * grads[0][0])

    # the in-place write is seen by autograd: a backward through the old values refuses
    y = array(torch.randn(3, 2, 5, requires_grad=True)).sum()
    array.load_model(2, nn.Linear(5, 3))
    with pytest.raises(RuntimeError, match="inplace"):
        y.backward()


def test_frozen_parameters_and_mode_stay_the_arrays():
    array = _array(lambda: nn.Linear(5, 3), hnn.Linear, 3)
    array.weight.requires_grad_(False)
    array.eval()
    array.load_model(0, nn.Linear(5, 3))  # a trainable module, in training mode
    assert not array.weight.requires_grad and array.bias.requires_grad and not array.training
    got = array.extract_model(0)
    assert not got.weight.requires_grad and got.bias.requires_grad and not got.training


@pytest.mark.parametrize("make_bad,error,match", [
    (lambda: nn.Linear(5, 4), ValueError, "out_features"),
    (lambda: nn.Linear(5, 3, bias=False), ValueError, "bias"),
    (lambda: nn.Conv1d(5, 3, 1), TypeError, "torch.nn.Linear"),
    (lambda: nn.Linear(5, 3).double(), TypeError, "dtype of 'weight'"),
    (lambda: "Linear", TypeError, "str"),
])
def test_load_model_rejects_before_writing(make_bad, error, match):
    array = _array(lambda: nn.Linear(5, 3), hnn.Linear, 3)
    before = _snapshot(array)
    with pytest.raises(error, match=match):
        array.load_model(1, make_bad())
    _assert_same(array, before)


def test_load_model_rejects_shapes_buffers_and_indices_before_writing():
    array = _array(lambda: nn.BatchNorm2d(4), hnn.BatchNorm2d, 3)
    before = _snapshot(array)
    bad = nn.BatchNorm2d(4)
    bad.running_mean = torch.zeros(5)  # a shape torch's configuration does not describe
    with pytest.raises(ValueError, match=r"'running_mean': expected \[4\].*got \[5\]"):
        array.load_model(0, bad)
    extra = nn.BatchNorm2d(4)
    extra.register_buffer("extra", torch.zeros(2))
    with pytest.raises(ValueError, match="buffers"):
        array.load_model(0, extra)
    for b, error in ((3, ValueError), (-1, ValueError), (1.0, TypeError), (True, TypeError)):
        with pytest.raises(error, match=r"\[0, 3\)"):
            array.load_model(b, nn.BatchNorm2d(4))
        with pytest.raises(error, match=r"\[0, 3\)"):
            array.reset_model(b)
        with pytest.raises(error, match=r"\[0, 3\)"):
            array.extract_model(b)
    for seed, error in (("1", TypeError), (1.5, TypeError), (2**64, ValueError)):
        with pytest.raises(error, match="seed"):
            array.reset_model(0, seed=seed)
    _assert_same(array, before)
    with pytest.raises(ValueError, match="B=..."):
        hnn.Dropout(0.5).load_model(0, nn.Dropout(0.5))


def test_load_model_rejects_a_bad_per_model_value_before_writing():
    array = _array(lambda: nn.TransformerEncoderLayer(6, 2, 9, dropout=0.1), hnn.TransformerEncoderLayer, 3)
    before = _snapshot(array)
    bad = _randomized(nn.TransformerEncoderLayer(6, 2, 9, dropout=0.2))
    bad.dropout2.p = 1.5  # torch checks p only in the constructor
    with pytest.raises(ValueError, match="between 0 and 1"):
        array.load_model(1, bad)
    _assert_same(array, before)
    other_activation = nn.TransformerEncoderLayer(6, 2, 9, dropout=0.1, activation="gelu")
    with pytest.raises(ValueError, match="activation"):
        array.load_model(1, other_activation)
    _assert_same(array, before)
