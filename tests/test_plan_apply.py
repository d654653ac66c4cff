"""Applying a strategy (hfkern.plan._strategy): recomputation, micro-batches, bf16, layout.

Recomputation and micro-batching must leave every model's losses and
gradients as the plain fused model computes them (to float32 rounding), on
:func:`hfkern.fuse` models and on hand-written arrays alike; batch norm's
running statistics must end as after one forward; dropout must draw the same
masks in the recomputation.
"""

from __future__ import annotations

import copy
import io
from collections import Counter

import pytest
import torch
from torch import nn
from torch.testing import assert_close

import hfkern
from hfkern.nn import functional as AF
from hfkern.nn.normalization import _BatchNorm as ArrayBatchNorm
from hfkern.plan._strategy import Recompute, Strategy, applied, apply, blocks, make_step, unapply

B = 3
FP32 = dict(atol=1e-5, rtol=1e-5)


# ---- models --------------------------------------------------------------------------------
class CNN(nn.Module):
    def __init__(self):
        super().__init__()
        self.features = nn.Sequential(nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4), nn.ReLU())
        self.conv2 = nn.Conv2d(4, 5, 3, padding=1)
        self.bn2 = nn.BatchNorm2d(5)
        self.head = nn.Linear(5 * 5 * 5, 7)

    def forward(self, x):
        x = self.features(x)
        x = torch.relu(self.bn2(self.conv2(x)))
        return self.head(x.flatten(1))


class MLP(nn.Module):
    def __init__(self, p: float = 0.3):
        super().__init__()
        self.body = nn.Sequential(nn.Linear(9, 11), nn.LayerNorm(11), nn.GELU(), nn.Dropout(p))
        self.head = nn.Linear(11, 5)

    def forward(self, x):
        return self.head(self.body(x))


def hand_cnn() -> nn.Sequential:
    return nn.Sequential(hfkern.nn.Conv2d(3, 4, 3, B=B), hfkern.nn.BatchNorm2d(4, B=B), nn.ReLU(),
                         hfkern.nn.Flatten(), hfkern.nn.Linear(4 * 5 * 5, 7, B=B))


def hand_mlp() -> nn.Sequential:
    return nn.Sequential(hfkern.nn.Linear(9, 11, B=B), hfkern.nn.LayerNorm(11, B=B), nn.GELU(),
                         hfkern.nn.Linear(11, 5, B=B))


def hand_nested() -> nn.Sequential:
    """A hand-written array whose first block is three layers (its activations are inside it)."""
    return nn.Sequential(
        nn.Sequential(hfkern.nn.Conv2d(3, 4, 3, B=B), hfkern.nn.BatchNorm2d(4, B=B), nn.ReLU()),
        hfkern.nn.Flatten(), hfkern.nn.Linear(4 * 5 * 5, 7, B=B))


MAKERS = {
    "cnn": lambda: hfkern.fuse(CNN, B),
    "mlp": lambda: hfkern.fuse(MLP, B),
    "mlp_no_dropout": lambda: hfkern.fuse(lambda: MLP(p=0.0), B),
    "hand_cnn": hand_cnn,
    "hand_mlp": hand_mlp,
    "hand_nested": hand_nested,
}


def batch(kind: str, N: int, shared: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    lead = (N,) if shared else (B, N)
    if kind in ("cnn", "hand_cnn", "hand_nested"):
        return torch.randn(*lead, 3, 7, 7), torch.randint(0, 7, lead)
    return torch.randn(*lead, 9), torch.randint(0, 5, lead)


def twins(kind: str) -> tuple[nn.Module, nn.Module]:
    """Two copies of one array model (same weights)."""
    model = MAKERS[kind]()
    return model, copy.deepcopy(model)


def sgd(model: nn.Module):
    return hfkern.optim.SGD(model.parameters(), lr=[0.1, 0.05, 0.2], momentum=0.9)


def run_steps(model, strategy, batches, *, shared=True, optimizer=sgd, **kw):
    """Apply, then train on ``batches`` with one seed per step; per step: losses, grads."""
    apply(model, strategy)
    step = make_step(model, optimizer(model), strategy, AF.cross_entropy, shared=shared, **kw)
    out = []
    for i, (x, y) in enumerate(batches):
        torch.manual_seed(100 + i)  # dropout draws the same in both runs
        losses = step(x, y)
        out.append((losses, [p.grad.clone() for p in model.parameters()]))
    return out


def assert_same_training(ours, theirs, a: nn.Module, b: nn.Module, **tol):
    tol = tol or FP32
    assert len(ours) == len(theirs) and list(a.state_dict()) == list(b.state_dict())
    for (la, ga), (lb, gb) in zip(ours, theirs):
        assert_close(la, lb, **tol)
        for x, y in zip(ga, gb):
            assert_close(x, y, **tol)
    for (name, x), (_, y) in zip(a.state_dict().items(), b.state_dict().items()):
        assert_close(x, y, **tol, msg=name)


class counting:
    """Counts calls of the forwards of array convs, linears and batch norms, per module."""

    def __init__(self, monkeypatch):
        self.calls: Counter = Counter()
        for cls, name in ((hfkern.nn.Conv2d, "forward"), (hfkern.nn.Linear, "forward"),
                          (ArrayBatchNorm, "_normalize")):  # a fused BN+ReLU calls _normalize
            original = getattr(cls, name)

            def counted(module, *args, _original=original, **kwargs):
                self.calls[id(module)] += 1
                return _original(module, *args, **kwargs)

            monkeypatch.setattr(cls, name, counted)

    def of(self, model: nn.Module) -> dict[str, int]:
        return {path: self.calls[id(m)] for path, m in model.named_modules()
                if isinstance(m, (hfkern.nn.Conv2d, hfkern.nn.Linear, ArrayBatchNorm))}


# ---- blocks --------------------------------------------------------------------------------
def test_blocks_are_the_top_level_children_with_parameters():
    assert blocks(hfkern.fuse(CNN, B)) == ["features", "conv2", "bn2", "head"]
    assert blocks(hfkern.fuse(MLP, B)) == ["body", "head"]
    assert blocks(hand_cnn()) == ["0", "1", "4"]  # ReLU and Flatten hold nothing


# ---- recomputation -------------------------------------------------------------------------
RECOMPUTE_CASES = [
    ("cnn", ("features",)), ("cnn", ("conv2", "bn2")), ("cnn", ("features", "conv2", "bn2", "head")),
    ("mlp", ("body",)), ("mlp", ("body", "head")),
    ("hand_cnn", ("0",)), ("hand_cnn", ("1",)), ("hand_cnn", ("0", "1", "4")),
    ("hand_nested", ("0",)),
]


@pytest.mark.parametrize("kind,names", RECOMPUTE_CASES)
def test_recompute_keeps_losses_gradients_and_buffers(kind, names, monkeypatch):
    plain, model = twins(kind)
    batches = [batch(kind, 6) for _ in range(2)]
    theirs = run_steps(plain, Strategy(B), batches)
    count = counting(monkeypatch)
    ours = run_steps(model, Strategy(B, recompute=names), batches)
    # losses, every gradient, parameters and buffers (BN running stats, counters) as the plain model's
    assert_same_training(ours, theirs, model, plain)
    # and the recomputation really ran: each leaf of a recomputed block twice per step
    calls = count.of(model)
    assert calls and all(n == len(batches) * (2 if path.split(".")[0] in names else 1)
                         for path, n in calls.items()), calls


@pytest.mark.parametrize("kind,names", [("cnn", ("features",)), ("hand_cnn", ("0", "1"))])
def test_recomputed_blocks_under_torch_compile(kind, names):
    """torch.compile of a model with recomputed blocks trains as the plain model: each
    recomputed call runs eagerly (a graph break: dynamo takes no checkpoint context_fn but
    selective checkpointing's), batch norm's running statistics updated once per step."""
    plain, model = twins(kind)
    apply(model, Strategy(B, recompute=names))
    compiled = torch.compile(model, backend="eager")
    for _ in range(2):
        x, y = batch(kind, 6)
        losses = []
        for m in (compiled, plain):
            m.zero_grad()
            loss = AF.cross_entropy(m(hfkern.broadcast(x, B)), y)
            loss.sum().backward()
            losses.append(loss)
        assert_close(losses[0], losses[1], **FP32)
        for (name, p), q in zip(model.named_parameters(), plain.parameters()):
            assert_close(p.grad, q.grad, **FP32, msg=name)
    for (name, a), b in zip(model.state_dict().items(), plain.state_dict().values()):
        assert_close(a, b, **FP32, msg=name)


class Counted(nn.Module):
    """Reads the buffer its forward updates: its recomputation must see the count the forward saw."""

    def __init__(self):
        super().__init__()
        self.w = nn.Parameter(torch.randn(4))
        self.register_buffer("calls", torch.zeros(()))

    def forward(self, x):
        self.calls += 1
        return x * self.w * self.calls


class WithCounted(nn.Module):
    def __init__(self):
        super().__init__()
        self.inp = nn.Linear(5, 4)
        self.counted = Counted()
        self.out = nn.Linear(4, 3)

    def forward(self, x):
        return self.out(torch.tanh(self.counted(self.inp(x))))


def test_recomputation_sees_the_state_the_forward_saw():
    plain = hfkern.fuse(WithCounted, B)
    model = copy.deepcopy(plain)
    apply(model, Strategy(B, recompute=("counted",)))
    x, y = torch.randn(6, 5), torch.randint(0, 3, (6,))
    for m in (plain, model):
        for _ in range(2):
            m.zero_grad()
            AF.cross_entropy(m(hfkern.broadcast(x, B)), y).sum().backward()
    assert torch.equal(model.counted.calls, torch.full((B,), 2.0))
    for (name, p), q in zip(model.named_parameters(), plain.parameters()):
        assert_close(p.grad, q.grad, msg=name, **FP32)


class WithTeacher(nn.Module):
    """A momentum (EMA) teacher the forward moves toward the student, in place."""

    def __init__(self):
        super().__init__()
        self.student = nn.Linear(4, 4)
        self.teacher = nn.Linear(4, 4)
        self.teacher.requires_grad_(False)
        with torch.no_grad():
            self.teacher.weight.mul_(3)  # away from the student, so that each update shows

    def forward(self, x):
        with torch.no_grad():
            for t, s in zip(self.teacher.parameters(), self.student.parameters()):
                t.mul_(0.5).add_(s, alpha=0.5)
        return torch.tanh(self.student(x)) * self.teacher(x).sigmoid()


class TeacherNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.blk = WithTeacher()
        self.head = nn.Linear(4, 3)

    def forward(self, x):
        return self.head(self.blk(x))


def hand_teacher() -> nn.Sequential:
    return nn.Sequential(hfkern.fuse(WithTeacher, B), hfkern.nn.Linear(4, 3, B=B))


@pytest.mark.parametrize("kind", ["fused", "hand"])
def test_recomputation_does_not_write_a_teachers_parameters_again(kind):
    # The recomputation ran the EMA update a second time, from the updated weights:
    # the teacher moved twice per step and the student's gradient was computed with
    # the wrong teacher (the loss, from the forward, looked right).
    plain = hfkern.fuse(TeacherNet, B) if kind == "fused" else hand_teacher()
    model = copy.deepcopy(plain)
    name = "blk" if kind == "fused" else "0"
    apply(model, Strategy(B, recompute=(name,)))
    x, y = torch.randn(6, 4), torch.randint(0, 3, (6,))
    for m in (plain, model):
        for _ in range(3):
            m.zero_grad()
            losses = AF.cross_entropy(m(hfkern.broadcast(x, B)), y).sum()
            losses.backward(retain_graph=True)
            losses.backward()  # a second recomputation from the same snapshot
            with torch.no_grad():
                for p in m.parameters():
                    if p.grad is not None:
                        p.sub_(0.1 * p.grad)
    for (key, a), (_, b) in zip(model.state_dict().items(), plain.state_dict().items()):
        assert_close(a, b, msg=key, **FP32)
    teacher = model.get_submodule(name).teacher
    assert isinstance(teacher.weight, nn.Parameter) and not teacher.weight.requires_grad


class WritesTrained(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 4)

    def forward(self, x):
        with torch.no_grad():
            self.lin.weight.clamp_(-0.3, 0.3)  # a trained weight written in place
        return self.lin(x)


def test_recomputing_a_block_that_writes_a_trained_parameter_raises():
    model = nn.Sequential(hfkern.fuse(WritesTrained, B), hfkern.nn.Linear(4, 3, B=B))
    apply(model, Strategy(B, recompute=("0",)))
    with pytest.raises(RuntimeError, match=r"wrote its parameters \['lin.weight'\] in place.*Strategy.recompute"):
        model(hfkern.broadcast(torch.randn(5, 4), B))
    with torch.no_grad():  # nothing is recomputed without a gradient
        model(hfkern.broadcast(torch.randn(5, 4), B))


def test_dropout_draws_inside_the_recomputed_block():
    # The equality above for "mlp" is meaningful only when dropout draws: seeds change the output.
    model = hfkern.fuse(MLP, B)
    x = hfkern.broadcast(torch.randn(5, 9), B)
    torch.manual_seed(1)
    a = model(x)
    torch.manual_seed(2)
    assert not torch.allclose(a, model(x))


def _saved_bytes(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> int:
    """Bytes of the distinct non-parameter storages that forward and loss save for backward."""
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    storages: dict[int, int] = {}

    def pack(t):
        s = t.untyped_storage()
        if s.data_ptr() not in params:
            storages[s.data_ptr()] = s.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        losses = AF.cross_entropy(model(hfkern.broadcast(x, B)), y)
    losses.sum().backward()
    return sum(storages.values())


@pytest.mark.parametrize("kind,names", [("cnn", ("features",)), ("hand_nested", ("0",))])
def test_recompute_saves_fewer_activations(kind, names):
    plain, model = twins(kind)
    apply(model, Strategy(B, recompute=names))
    N = 8
    x, y = batch(kind, N)
    # the first conv's output [N, B, 4, 5, 5] (what batch norm saves) is no longer kept
    conv_out = N * B * 4 * 5 * 5 * 4
    assert _saved_bytes(model, x, y) <= _saved_bytes(plain, x, y) - conv_out


@pytest.mark.parametrize("kind", ["cnn", "hand_cnn"])
def test_recomputed_model_in_eval_and_no_grad(kind):
    plain, model = twins(kind)
    names = tuple(blocks(model))
    apply(model, Strategy(B, recompute=names))
    x = batch(kind, 5)[0]
    plain.eval(), model.eval()
    with torch.no_grad():
        assert_close(model(hfkern.broadcast(x, B)), plain(hfkern.broadcast(x, B)), **FP32)
    # eval with gradients (frozen statistics): recomputation reads the running statistics
    out = model(hfkern.broadcast(x, B))
    out.sum().backward()
    ref = plain(hfkern.broadcast(x, B))
    ref.sum().backward()
    assert_close(out, ref, **FP32)
    for p, q in zip(model.parameters(), plain.parameters()):
        assert_close(p.grad, q.grad, **FP32)


def test_backward_twice_with_retain_graph():
    plain, model = twins("cnn")
    apply(model, Strategy(B, recompute=("features",)))
    x, y = batch("cnn", 6)
    for m in (plain, model):
        losses = AF.cross_entropy(m(hfkern.broadcast(x, B)), y).sum()
        losses.backward(retain_graph=True)
        losses.backward()
    for p, q in zip(model.parameters(), plain.parameters()):
        assert_close(p.grad, q.grad, **FP32)
    for (name, a), (_, b) in zip(model.named_buffers(), plain.named_buffers()):
        assert_close(a, b, msg=name, **FP32)


# ---- apply again, unapply ------------------------------------------------------------------
def test_apply_again_replaces_the_recomputed_blocks_and_unapply_restores(monkeypatch):
    fused = hfkern.fuse(CNN, B)
    code = fused.code
    apply(fused, Strategy(B, recompute=("features", "head")))
    assert "recompute_features" in fused.code and "recompute_head" in fused.code
    apply(fused, Strategy(B, recompute=("conv2",)))
    assert applied(fused).recompute == ("conv2",)
    count = counting(monkeypatch)
    x, y = batch("cnn", 6)
    AF.cross_entropy(fused(hfkern.broadcast(x, B)), y).sum().backward()
    assert count.of(fused) == {"features.0": 1, "features.1": 1, "conv2": 2, "bn2": 1, "head": 1}
    unapply(fused)
    assert fused.code == code and applied(fused) is None

    hand = hand_cnn()
    apply(hand, Strategy(B, recompute=("0", "4")))
    assert isinstance(hand[0], Recompute) and isinstance(hand[4], Recompute)
    apply(hand, Strategy(B, recompute=("1",)))
    assert [isinstance(m, Recompute) for m in hand] == [False, True, False, False, False]
    unapply(hand)
    assert not any(isinstance(m, Recompute) for m in hand)
    assert type(hand[1]) is hfkern.nn.BatchNorm2d


# ---- surgery and state dicts ---------------------------------------------------------------
def test_fused_surgery_and_state_dict_after_apply():
    plain, model = twins("cnn")
    apply(model, Strategy(B, recompute=("features", "head")))
    assert list(model.state_dict()) == list(plain.state_dict())
    extracted = model.extract_model(1)
    assert type(extracted) is CNN
    for key, value in extracted.state_dict().items():
        assert torch.equal(value, plain.state_dict()[key][1]), key
    fresh = CNN()
    for m in (model, plain):
        m.load_model(2, fresh)
    batches = [batch("cnn", 6)]
    ours = run_steps(model, Strategy(B, recompute=("features", "head")), batches)
    theirs = run_steps(plain, Strategy(B), batches)
    assert_same_training(ours, theirs, model, plain)
    # a copy recomputes too, on its own tensors
    twin = copy.deepcopy(model)
    assert applied(twin) == applied(model) and "recompute_features" in twin.code
    grads = [p.grad.clone() for p in model.parameters()]
    stats = model.features[1].running_mean.clone()
    x = batch("cnn", 6)[0]
    out = twin(hfkern.broadcast(x, B))
    out.sum().backward()
    assert all(torch.equal(p.grad, g) for p, g in zip(model.parameters(), grads))
    assert torch.equal(model.features[1].running_mean, stats)
    assert not torch.equal(twin.features[1].running_mean, stats)


def test_hand_written_state_dict_surgery_and_copies_after_apply():
    plain, model = twins("hand_cnn")
    keys = list(model.state_dict())
    apply(model, Strategy(B, recompute=("0", "1")))
    assert list(model.state_dict()) == keys
    model.load_state_dict(plain.state_dict())
    conv = model[0].extract_model(1)
    assert type(conv) is nn.Conv2d and torch.equal(conv.weight, plain[0].weight[1])
    fresh = nn.Conv2d(3, 4, 3)
    model[0].load_model(2, fresh)
    plain[0].load_model(2, fresh)
    assert "recompute" in repr(model[0]) and type(model[0]).__name__ == "Conv2d"
    twin = copy.deepcopy(model)
    assert isinstance(twin[0], Recompute) and twin[0] is not model[0]
    batches = [batch("hand_cnn", 6)]
    ours = run_steps(twin, Strategy(B, recompute=("0", "1")), batches)
    theirs = run_steps(plain, Strategy(B), batches)
    assert_same_training(ours, theirs, twin, plain)


def test_recomputing_blocks_survive_torch_save():
    model = hand_mlp()
    apply(model, Strategy(B, recompute=("0", "3")))
    buffer = io.BytesIO()
    torch.save(model, buffer)
    buffer.seek(0)
    loaded = torch.load(buffer, weights_only=False)
    assert [isinstance(m, Recompute) for m in loaded] == [True, False, False, True]
    x = hfkern.broadcast(torch.randn(4, 9), B)
    assert_close(loaded(x), model(x), **FP32)


def test_recomputing_fused_model_survives_torch_save(monkeypatch):
    strategy = Strategy(B, recompute=("features", "head"))
    model, twin = twins("cnn")
    own_code = model.code
    apply(model, strategy)
    buffer = io.BytesIO()
    torch.save(model, buffer)
    buffer.seek(0)
    loaded = torch.load(buffer, weights_only=False)
    assert applied(loaded) == strategy and loaded.code == model.code
    count = counting(monkeypatch)
    batches = [batch("cnn", 6) for _ in range(2)]
    ours = run_steps(loaded, strategy, batches)
    assert count.of(loaded) == {"features.0": 4, "features.1": 4, "conv2": 2, "bn2": 2, "head": 4}
    assert_same_training(ours, run_steps(twin, Strategy(B), batches), loaded, twin)
    unapply(loaded)  # the graphs fuse made travelled too
    assert loaded.code == own_code and applied(loaded) is None


# ---- micro-batches -------------------------------------------------------------------------
MICRO_CASES = [
    ("mlp_no_dropout", True, 2, ()), ("mlp_no_dropout", True, 3, ("body",)),
    ("hand_mlp", False, 2, ()), ("hand_mlp", False, 3, ("1",)),
]


@pytest.mark.parametrize("kind,shared,m,names", MICRO_CASES)
def test_micro_batches_equal_one_full_batch_step(kind, shared, m, names):
    full, micro = twins(kind)
    N = 13  # divisible by neither 2 nor 3
    batches = [batch(kind, N, shared) for _ in range(4)]

    def adam(model):
        return hfkern.optim.Adam(model.parameters(), lr=[1e-2, 3e-3, 2e-2])

    theirs = run_steps(full, Strategy(B), batches, shared=shared, optimizer=adam)
    ours = run_steps(micro, Strategy(B, micro_batches=m, recompute=names), batches, shared=shared,
                     optimizer=adam)
    assert_same_training(ours, theirs, micro, full)


def test_micro_batches_keep_float64_gradients():
    # the chunks' losses were cast to float32 before backward: float64 gradients at float32 precision
    model = nn.Sequential(hfkern.nn.Linear(4, 3, B=B)).double()
    x, y = torch.randn(7, 4, dtype=torch.float64), torch.randint(0, 3, (7,))
    AF.cross_entropy(model(hfkern.broadcast(x, B)), y).sum().backward()
    want = model[0].weight.grad.clone()
    strategy = Strategy(B, micro_batches=2)
    apply(model, strategy)
    losses = make_step(model, hfkern.optim.SGD(model.parameters(), lr=0.0), strategy, AF.cross_entropy)(x, y)
    assert losses.dtype == torch.float64
    assert_close(model[0].weight.grad, want, atol=1e-14, rtol=1e-12)


def test_micro_batches_on_batch_norm_need_the_flag():
    model = hfkern.fuse(CNN, B)
    strategy = Strategy(B, micro_batches=2)
    apply(model, strategy)
    opt = sgd(model)
    with pytest.raises(ValueError, match=r"batch norm \(features\.1, bn2\).*allow_batch_statistics"):
        make_step(model, opt, strategy, AF.cross_entropy)
    step = make_step(model, opt, strategy, AF.cross_entropy, allow_batch_statistics=True)
    x, y = batch("cnn", 7)
    assert step(x, y).shape == (B,)
    assert torch.equal(model.features[1].num_batches_tracked, torch.full((B,), 2))  # once per micro-batch


# ---- precision and layout ------------------------------------------------------------------
@pytest.mark.parametrize("kind,names", [("mlp", ("body",)), ("cnn", ("features",))])
def test_bf16_autocast(kind, names):
    fp32, bf16 = twins(kind)
    bf16_plain = copy.deepcopy(bf16)
    batches = [batch(kind, 6)]
    ref = run_steps(fp32, Strategy(B), batches)
    plain = run_steps(bf16_plain, Strategy(B, precision="bf16"), batches)
    ours = run_steps(bf16, Strategy(B, precision="bf16", recompute=names), batches)
    assert ours[0][0].dtype == torch.float32
    assert_close(ours[0][0], ref[0][0], atol=5e-2, rtol=5e-2)  # bf16 rounding of forward and loss
    assert not torch.equal(plain[0][0], ref[0][0])  # autocast did run in bf16
    assert all(p.dtype == torch.float32 and p.grad.dtype == torch.float32 for p in bf16.parameters())
    # the recomputation runs under the forward's autocast: same bf16 results as without it
    assert_same_training(ours, plain, bf16, bf16_plain)


def test_channels_last_memory_format():
    plain, model = twins("hand_cnn")
    batches = [batch("hand_cnn", 6)]
    theirs = run_steps(plain, Strategy(B), batches)
    ours = run_steps(model, Strategy(B, memory_format="channels_last", recompute=("0",)), batches)
    assert model[0].memory_format is torch.channels_last and plain[0].memory_format is not torch.channels_last
    assert_same_training(ours, theirs, model, plain, atol=1e-4, rtol=1e-4)  # conv algorithms' rounding


# ---- the strategy and errors ---------------------------------------------------------------
def test_strategy_label_and_normalization():
    s = Strategy(8, precision="bf16", micro_batches=2, recompute=["layer1", "layer2"],
                 memory_format="channels_last")
    assert s.label == "B=8 bf16 mb=2 rc=layer1,layer2 cl"
    assert s.recompute == ("layer1", "layer2") and hash(s) == hash(Strategy(8, "bf16", 2, ("layer1", "layer2"),
                                                                           memory_format="channels_last"))
    assert Strategy(4, arrays=2).label == "B=4 fp32 arrays=2"


@pytest.mark.parametrize("kwargs,error,match", [
    (dict(B=0), ValueError, r"Strategy\.B: expected an int >= 1, got 0"),
    (dict(B="3"), TypeError, r"Strategy\.B: expected an int >= 1, got str"),
    (dict(B=True), TypeError, r"Strategy\.B"),
    (dict(B=3, precision="fp16"), ValueError, r"Strategy\.precision: expected one of \['fp32', 'bf16'\], got 'fp16'"),
    (dict(B=3, precision=None), TypeError, r"Strategy\.precision"),
    (dict(B=3, micro_batches=0), ValueError, r"Strategy\.micro_batches: expected an int >= 1, got 0"),
    (dict(B=3, micro_batches=1.5), TypeError, r"Strategy\.micro_batches"),
    (dict(B=3, recompute="layer1"), TypeError, r"Strategy\.recompute: expected a tuple of block names"),
    (dict(B=3, recompute=("a", 1)), TypeError, r"Strategy\.recompute: expected non-empty block names"),
    (dict(B=3, recompute=("a", "b", "a")), ValueError, r"Strategy\.recompute: expected each block once, got \['a'\]"),
    (dict(B=3, arrays=-1), ValueError, r"Strategy\.arrays"),
    (dict(B=3, memory_format="nhwc"), ValueError, r"Strategy\.memory_format: expected one of \['auto', 'contiguous', 'channels_last'\]"),
])
def test_strategy_rejects_bad_fields(kwargs, error, match):
    with pytest.raises(error, match=match):
        Strategy(**kwargs)


def test_apply_rejects_before_changing_the_model():
    fused = hfkern.fuse(CNN, B)
    code = fused.code
    with pytest.raises(ValueError, match=r"expected block names among \['features', 'conv2', 'bn2', 'head'\], "
                                         r"got \['layer1'\]"):
        apply(fused, Strategy(B, recompute=("features", "layer1")))
    with pytest.raises(ValueError, match=r"model's B=3, got B=4"):
        apply(fused, Strategy(4))
    assert fused.code == code and applied(fused) is None
    with pytest.raises(TypeError, match="expected an array model"):
        apply(nn.Linear(2, 3), Strategy(B))
    with pytest.raises(TypeError, match="expected a hfkern.plan Strategy"):
        apply(fused, {"B": 3})
    hand = hand_cnn()
    with pytest.raises(ValueError, match=r"got \['5'\]"):
        apply(hand, Strategy(B, recompute=("0", "5")))
    assert not isinstance(hand[0], Recompute)


def test_apply_refuses_blocks_it_cannot_recompute():
    class Stack(nn.Module):  # a ModuleList block: its entries are called by the model, not the list
        def __init__(self):
            super().__init__()
            self.layers = nn.ModuleList([hfkern.nn.Linear(4, 4, B=B) for _ in range(2)])

        def forward(self, x):
            for layer in self.layers:
                x = layer(x)
            return x

    with pytest.raises(ValueError, match=r"called as modules, got 'layers', a ModuleList"):
        apply(Stack(), Strategy(B, recompute=("layers",)))

    class GradModeLeak(nn.Module):  # its block switches grad mode without switching back
        def __init__(self):
            super().__init__()
            self.a = nn.Linear(4, 4)
            self.b = nn.Linear(4, 4)

        def forward(self, x):
            return self.b(self.a(x))

    class Leaky(nn.Linear):
        def forward(self, x):
            torch.set_grad_enabled(True)
            return super().forward(x)

    def leaky():
        m = GradModeLeak()
        m.a = Leaky(4, 4)
        return m

    fused = hfkern.fuse(leaky, B)
    with pytest.raises(ValueError, match=r"block 'a' of the fused forward enters or leaves a grad-mode"):
        apply(fused, Strategy(B, recompute=("a",)))
    apply(fused, Strategy(B, recompute=("b",)))  # the other block is fine


def test_make_step_errors():
    model = hfkern.fuse(lambda: MLP(p=0.0), B)
    opt = sgd(model)
    strategy = Strategy(B, micro_batches=3, recompute=("body",))
    with pytest.raises(ValueError, match="no strategy applied.*call apply"):
        make_step(model, opt, strategy, AF.cross_entropy)
    apply(model, Strategy(B))
    with pytest.raises(ValueError, match=r"'B=3 fp32 mb=3 rc=body'.*got a model with 'B=3 fp32'"):
        make_step(model, opt, strategy, AF.cross_entropy)
    apply(model, strategy)
    with pytest.raises(TypeError, match="expected an optimizer"):
        make_step(model, object(), strategy, AF.cross_entropy)
    with pytest.raises(TypeError, match="expected shared to be a bool"):
        make_step(model, opt, strategy, AF.cross_entropy, shared=1)
    step = make_step(model, opt, strategy, AF.cross_entropy)
    before = [p.detach().clone() for p in model.parameters()]
    x, y = batch("mlp", 2)
    with pytest.raises(ValueError, match="at least micro_batches=3 samples, got N=2"):
        step(x, y)
    x, y = batch("mlp", 7)
    with pytest.raises(ValueError, match=r"expected x \[N, \.\.\.\] and y \[N, \.\.\.\]"):
        step(x, y[:5])
    per_model = make_step(model, opt, strategy, AF.cross_entropy, shared=False)
    with pytest.raises(ValueError, match=r"expected x \[B=3, N, \.\.\.\]"):
        per_model(x, y)
    assert all(torch.equal(p, q) for p, q in zip(model.parameters(), before))
    bad_loss = make_step(model, opt, strategy, lambda out, y: AF.cross_entropy(out, y).sum())
    with pytest.raises(ValueError, match=r"expected loss_fn to return the \[B\] = \[3\] per-model losses, got Tensor \[\]"):
        bad_loss(x, y)
