"""Per-slot surgery on fused models: a pruned trial's slot refilled with a fresh model.

Slot b after ``reset_model(b)`` + ``reset_state(b)`` (+ the scheduler's and the
GradScaler's resets) must train exactly as a fresh torch model with a fresh
torch optimizer and scheduler would, while every other slot stays bit-identical
to a run without the surgery.
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.testing import assert_close

import hfkern
from _fuse_models import DigitsCNN, TransformerLM

B = 3
LRS = [0.05, 0.02, 0.1]
STEP_SIZES = [2, 3, 2]


def _batches(n, seed=1):
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(16, 1, 8, 8, generator=g), torch.randint(0, 10, (16,), generator=g))
            for _ in range(n)]


def _train(fused, opt, sched, scaler, batches):
    for x, y in batches:
        losses = torch.stack([F.cross_entropy(o, y) for o in fused(hfkern.broadcast(x, B))])
        opt.zero_grad()
        scaler.scale(losses).sum().backward()
        scaler.step(opt)
        scaler.update()
        sched.step()


def _run(surgery: bool, before=2, after=3):
    torch.manual_seed(0)
    fused = hfkern.fuse(DigitsCNN, B)
    opt = hfkern.optim.SGD(fused.parameters(), lr=LRS, momentum=0.9, weight_decay=1e-4)
    sched = hfkern.optim.lr_scheduler.StepLR(opt, step_size=STEP_SIZES, gamma=0.5)
    scaler = hfkern.amp.GradScaler("cpu", init_scale=2.0**8, B=B)
    batches = _batches(before + after)
    _train(fused, opt, sched, scaler, batches[:before])
    if surgery:
        fused.reset_model(1, seed=11)
        opt.reset_state(1)
        opt.set_hyperparameters(1, lr=0.07, momentum=0.8)
        sched.reset_model(1, step_size=4)
        scaler.reset_model(1)
    _train(fused, opt, sched, scaler, batches[before:])
    return fused, opt, batches[before:]


def test_refilled_slot_trains_as_a_fresh_model_and_others_are_untouched():
    fused, opt, after = _run(surgery=True)
    plain, plain_opt, _ = _run(surgery=False)

    state, plain_state = fused.state_dict(), plain.state_dict()
    for key, value in state.items():
        for b in (0, 2):
            assert torch.equal(value[b], plain_state[key][b]), key
    for p, q in zip(fused.parameters(), plain.parameters()):
        for name, s in opt.state[p].items():
            for b in (0, 2):
                assert torch.equal(s[b], plain_opt.state[q][name][b]), name

    torch.manual_seed(11)
    fresh = DigitsCNN()
    torch_opt = torch.optim.SGD(fresh.parameters(), lr=0.07, momentum=0.8, weight_decay=1e-4)
    torch_sched = torch.optim.lr_scheduler.StepLR(torch_opt, step_size=4, gamma=0.5)
    for x, y in after:
        loss = F.cross_entropy(fresh(x), y)
        torch_opt.zero_grad()
        loss.backward()
        torch_opt.step()
        torch_sched.step()
    for key, value in fresh.state_dict().items():
        assert_close(state[key][1], value, rtol=1e-4, atol=1e-5, msg=lambda s: f"{key}: {s}")
    assert_close(opt.param_groups[0]["lr"][1].double(), torch.tensor(torch_sched.get_last_lr()[0],
                 dtype=torch.float64), rtol=1e-6, atol=0)


def test_load_and_extract_model():
    models = [DigitsCNN() for _ in range(B)]
    fused = hfkern.fuse(models)
    before = copy.deepcopy(fused.state_dict())
    other = DigitsCNN()
    fused.load_model(2, other)
    out = fused.extract_model(2)
    assert type(out) is DigitsCNN
    for key, value in other.state_dict().items():
        assert torch.equal(fused.state_dict()[key][2], value)
        assert torch.equal(out.state_dict()[key], value)
        for b in (0, 1):
            assert torch.equal(fused.state_dict()[key][b], before[key][b])
    x = torch.randn(B, 5, 1, 8, 8)
    fused.eval()
    out.eval()
    assert_close(fused(x)[2], out(x[2]), rtol=1e-4, atol=1e-5)


def test_load_model_checks_everything_before_writing():
    fused = hfkern.fuse([DigitsCNN() for _ in range(B)])
    before = copy.deepcopy(fused.state_dict())
    with pytest.raises(TypeError, match="expected a DigitsCNN"):
        fused.load_model(0, nn.Linear(2, 2))
    with pytest.raises(ValueError, match="classifier.weight"):
        fused.load_model(0, DigitsCNN(num_classes=7))
    bad = DigitsCNN()
    bad.features[4] = nn.Conv2d(16, 32, 3, padding=2)  # same shapes, other configuration
    with pytest.raises(ValueError, match="padding"):
        fused.load_model(1, bad)
    with pytest.raises(ValueError, match=r"0 <= b < B=3|\[0, 3\)"):
        fused.load_model(3, DigitsCNN())
    with pytest.raises(TypeError):
        fused.extract_model(1.0)
    for key, value in fused.state_dict().items():
        assert torch.equal(value, before[key])


def test_reset_model_without_factory_reinitializes_like_the_constructor():
    fused = hfkern.fuse([DigitsCNN() for _ in range(B)])
    state = torch.get_rng_state()
    fused.reset_model(0, seed=5)
    assert torch.equal(torch.get_rng_state(), state)  # the global RNG is untouched
    torch.manual_seed(5)
    fresh = DigitsCNN()
    for key, value in fresh.state_dict().items():
        assert torch.equal(fused.state_dict()[key][0], value), key


def test_reset_model_needs_a_factory_for_parameters_no_module_initializes():
    class WithOwnParameter(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = nn.Linear(3, 3)
            self.gain = nn.Parameter(torch.randn(3))

        def forward(self, x):
            return self.fc(x) * self.gain

    fused = hfkern.fuse([WithOwnParameter() for _ in range(2)])
    with pytest.raises(ValueError, match="gain.*factory"):
        fused.reset_model(0, seed=1)
    fused.reset_model(0, seed=1, factory=WithOwnParameter)
    torch.manual_seed(1)
    fresh = WithOwnParameter()
    assert torch.equal(fused.gain[0], fresh.gain) and torch.equal(fused.fc.weight[0], fresh.fc.weight)


def test_surgery_on_a_transformer_with_per_model_dropout():
    def lm(p=0.0):
        return TransformerLM(vocab=13, d_model=8, nhead=2, num_layers=2, dim_ff=8, dropout=p)

    fused = hfkern.fuse([lm() for _ in range(2)])
    fused.load_model(1, lm(0.25))
    assert fused.encoder.layers[0].dropout.p == (0.0, 0.25)
    back = fused.extract_model(1)
    assert back.encoder.layers[1].dropout.p == 0.25
    fused.reset_model(1, seed=3, factory=lm)  # torch's encoder clones its layer: the factory's draw
    torch.manual_seed(3)
    fresh = lm()
    for key, value in fresh.state_dict().items():
        assert torch.equal(fused.state_dict()[key][1], value), key


class _Act(nn.Module):
    """A small model whose element-wise activations (not array layers) carry configuration."""

    def __init__(self, act=None, hidden=6):
        super().__init__()
        self.conv = nn.Conv2d(1, 4, 3)
        self.bn = nn.BatchNorm2d(4)
        self.act = act if act is not None else nn.LeakyReLU(0.1)
        self.fc = nn.Linear(4, hidden)
        self.gain = nn.Parameter(torch.randn(hidden))
        self.register_buffer("calls", torch.zeros((), dtype=torch.long))

    def forward(self, x):
        self.calls += 1
        return self.fc(self.act(self.bn(self.conv(x))).mean((2, 3))) * self.gain


@pytest.mark.parametrize("bad, match", [
    (lambda: _Act(nn.LeakyReLU(0.2)), r"attribute 'act.negative_slope' differs: {ref} has 0.1, {it} has 0.2"),
    (lambda: _Act(nn.GELU()), r"module tree differs from {ref}'s at 'act': {ref} has LeakyReLU, {it} has GELU"),
    (lambda: _Act(nn.Sequential(nn.LeakyReLU(0.1))), r"module tree differs from {ref}'s at 'act"),
])
def test_load_model_makes_the_checks_fuse_makes(bad, match):
    models = [_Act() for _ in range(B)]
    fused = hfkern.fuse(models)
    before = copy.deepcopy(fused.state_dict())
    with pytest.raises(hfkern.FuseError, match=match.format(ref="model 0", it="model 1")):
        hfkern.fuse([models[0], bad()])  # the same check ...
    with pytest.raises(hfkern.FuseError, match=match.format(ref="the fused architecture", it="the model")):
        fused.load_model(1, bad())  # ... and the same error
    for key, value in fused.state_dict().items():
        assert torch.equal(value, before[key]), key
    assert type(fused.extract_model(1).act) is nn.LeakyReLU and fused.extract_model(1).act.negative_slope == 0.1


@pytest.mark.parametrize("dtype", [torch.float64, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("how", ["method", "to"])
def test_surgery_follows_the_fused_models_dtype(dtype, how):
    def convert(m):
        if how == "to":
            return m.to(dtype)
        return {torch.float64: m.double, torch.float16: m.half, torch.bfloat16: m.bfloat16}[dtype]()

    torch.manual_seed(0)
    fused = convert(hfkern.fuse(_Act, B))
    # extract_model: every floating tensor in the current dtype, as the original after the same call
    out = fused.extract_model(1)
    floats = {k: v.dtype for k, v in out.state_dict().items() if v.is_floating_point()}
    assert set(floats.values()) == {dtype}, floats
    assert out.calls.dtype == torch.long
    for key, value in out.state_dict().items():
        assert torch.equal(value, fused.state_dict()[key][1]), key
    # load_model: a model of the current dtype loads; one of the old dtype is refused, naming both
    other = convert(_Act())
    fused.load_model(2, other)
    for key, value in other.state_dict().items():
        assert torch.equal(fused.state_dict()[key][2], value), key
    with pytest.raises(hfkern.FuseError, match=rf"dtype of '.*' differs: the fused architecture has {dtype}, "
                                               r"the model has torch.float32"):
        fused.load_model(2, _Act())
    # reset_model (factory and re-initialization): the fresh model in the current dtype
    fused.reset_model(0, seed=4)
    torch.manual_seed(4)
    fresh = convert(_Act())
    for key, value in fresh.state_dict().items():
        if key != "gain":  # no submodule initializes a model's own parameter without the factory
            assert torch.equal(fused.state_dict()[key][0], value), key
    unfused = hfkern.unfuse(fused)
    assert all({v.dtype for v in m.state_dict().values() if v.is_floating_point()} == {dtype} for m in unfused)


def test_surgery_without_a_factory_after_a_dtype_change():
    fused = hfkern.fuse([DigitsCNN() for _ in range(B)]).double()
    fused.reset_model(1, seed=5)
    torch.manual_seed(5)
    fresh = DigitsCNN().double()
    for key, value in fresh.state_dict().items():
        assert torch.equal(fused.state_dict()[key][1], value), key
    x = torch.randn(B, 2, 1, 8, 8, dtype=torch.float64)
    fused.eval()
    assert_close(fused(x)[1], fused.extract_model(1).eval()(x[1]))


@pytest.mark.parametrize("dtype", [torch.float64, torch.bfloat16])
def test_reset_model_of_models_converted_before_fusing_draws_as_their_constructor(dtype):
    """Models made as `Net().to(dtype)` and then fused: the constructor draws in torch's default
    dtype and the model is converted after, so a reset slot must too (it drew in the models' dtype:
    other numbers, up to 0.7 apart)."""
    fused = hfkern.fuse([DigitsCNN().to(dtype) for _ in range(B)])
    fused.reset_model(1, seed=5)
    torch.manual_seed(5)
    fresh = DigitsCNN().to(dtype)
    for key, value in fresh.state_dict().items():
        assert fused.state_dict()[key].dtype == value.dtype, key
        assert torch.equal(fused.state_dict()[key][1], value), key


def test_legacy_state_dict_without_a_torch_norms_count_loads_as_torch_loads_it():
    # A plain dict (no version metadata) without num_batches_tracked, for a norm the fused model
    # keeps as torch's (BatchNorm3d): torch's own loader keeps the count; the checks refused it.
    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.bn = nn.BatchNorm3d(2)

        def forward(self, x):
            return self.bn(x)

    fused = hfkern.fuse([Net(), Net()])
    fused.get_submodule("bn").num_batches_tracked.fill_(3)
    sd = {k: v.clone() + (1 if v.is_floating_point() else 0) for k, v in fused.state_dict().items()
          if k != "bn.num_batches_tracked"}
    assert not fused.load_state_dict(sd).missing_keys
    for k, v in sd.items():
        assert torch.equal(fused.state_dict()[k], v), k
    assert fused.get_submodule("bn").num_batches_tracked.tolist() == [3, 3]
