"""hfkern.plan: attributes a recomputed block's forward creates or deletes, micro-batches of a loss
whose mean is not over samples, keyword arguments of a recomputed block, the train/eval mode of a
recomputation, pickling an applied block whose class pickles its own way, torch's parametrize on
an applied block, and the arguments of the profiling functions and of plan()."""

from __future__ import annotations

import copy
import functools
import io

import pytest
import torch
import torch.nn.utils.parametrize as P
from torch import nn

import hfkern
import hfkern.nn as hn
import hfkern.plan as hp
from hfkern.nn import functional as AF

B = 2
CPU = torch.device("cpu")


def grads(model: nn.Module) -> list[torch.Tensor]:
    return [p.grad.detach().clone() for p in model.parameters()]


def assert_same_grads(a: nn.Module, b: nn.Module) -> None:
    ga, gb = grads(a), grads(b)
    assert len(ga) == len(gb)
    for x, y in zip(ga, gb):
        torch.testing.assert_close(x, y, rtol=1e-5, atol=1e-6)


def recomputed_copy(model: nn.Module, *names: str) -> nn.Module:
    rc = copy.deepcopy(model)
    hp.apply(rc, hp.Strategy(B, recompute=names))
    return rc


# ---- 1. attributes the forward creates (or deletes) ------------------------------------------
class ActNorm(nn.Module):
    """Data-dependent initialization at the first call, its flag a new attribute (Glow's ActNorm)."""

    def __init__(self):
        super().__init__()
        self.lin = hn.Linear(4, 4, B=B)
        self.register_buffer("shift", torch.zeros(B, 1, 4))

    def forward(self, x):
        h = self.lin(x)
        if not getattr(self, "initialized", False):
            with torch.no_grad():
                self.shift.copy_(-h.mean(1, keepdim=True))
            self.initialized = True
        return torch.tanh(h + self.shift)


def test_an_attribute_the_first_forward_creates_is_absent_for_its_recomputation():
    torch.manual_seed(0)
    plain = nn.Sequential(ActNorm(), hn.Linear(4, 3, B=B))
    rc = recomputed_copy(plain, "0")
    x = torch.randn(B, 5, 4)
    for step in range(2):
        for m in (plain, rc):
            m.zero_grad()
            (m(x) ** 2).sum().backward()
        assert_same_grads(plain, rc)
        assert rc[0].initialized is True
        torch.testing.assert_close(rc[0].shift, plain[0].shift, rtol=0, atol=0)


class Pending(nn.Module):
    """A forward that deletes an attribute (a value handed over once) and creates another."""

    def __init__(self):
        super().__init__()
        self.lin = hn.Linear(4, 4, B=B)
        self.scale = 3.0

    def forward(self, x):
        scale = getattr(self, "scale", 1.0)
        if hasattr(self, "scale"):
            del self.scale
            self.used = scale
        return self.lin(x) * scale


def test_an_attribute_the_forward_deletes_is_there_for_the_recomputation_and_gone_after():
    torch.manual_seed(0)
    plain = nn.Sequential(Pending(), hn.Linear(4, 3, B=B))
    rc = recomputed_copy(plain, "0")
    x = torch.randn(B, 5, 4)
    for m in (plain, rc):
        (m(x) ** 2).sum().backward()
    assert_same_grads(plain, rc)
    assert not hasattr(rc[0], "scale") and rc[0].used == 3.0


# ---- 2. micro-batches of a loss whose mean is not over samples -------------------------------
def lm():
    return nn.Sequential(nn.Embedding(11, 8), nn.Linear(8, 11))


def tokens(seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randint(0, 11, (4, 6), generator=g)
    y = torch.randint(0, 11, (4, 6), generator=g)
    y[2:, 1:] = -100  # padding in the second half of the batch
    return x, y


def sequence_ce(loss=AF.cross_entropy):
    return lambda out, y: loss(out.transpose(2, 3), y)  # [B, N, T, C] -> [B, N, C, T]


def run_step(factory, loss_fn, micro_batches, x, y, **kw):
    torch.manual_seed(0)
    model = hfkern.fuse(factory, B)
    strategy = hp.Strategy(B, micro_batches=micro_batches)
    hp.apply(model, strategy)
    step = hp.make_step(model, hfkern.optim.SGD(model.parameters(), lr=0.0), strategy, loss_fn, **kw)
    return step(x, y), model


def test_micro_batches_of_a_wrapped_loss_with_ignored_targets_are_refused_before_any_change():
    x, y = tokens()
    torch.manual_seed(0)
    model = hfkern.fuse(lm, B)
    strategy = hp.Strategy(B, micro_batches=2)
    hp.apply(model, strategy)
    before = [p.detach().clone() for p in model.parameters()]
    step = hp.make_step(model, hfkern.optim.SGD(model.parameters(), lr=0.1), strategy, sequence_ce())
    with pytest.raises(ValueError, match="integer targets with negative entries.*loss_denominator"):
        step(x, y)
    assert all(p.grad is None for p in model.parameters())
    for p, q in zip(model.parameters(), before):
        assert torch.equal(p, q)


def test_loss_denominator_gives_the_full_batch_gradients():
    x, y = tokens()
    cw = torch.rand(11) + 0.1
    cases = [
        (sequence_ce(), lambda y: (y != -100).sum()),
        (sequence_ce(functools.partial(AF.cross_entropy, weight=cw)),
         lambda y: (cw[y.clamp(min=0)] * (y != -100)).sum()),
    ]
    for loss_fn, denominator in cases:
        full, plain = run_step(lm, loss_fn, 1, x, y)
        for m in (2, 3):
            losses, micro = run_step(lm, loss_fn, m, x, y, loss_denominator=denominator)
            torch.testing.assert_close(losses, full, rtol=1e-5, atol=1e-6)
            assert_same_grads(plain, micro)


class Tagger(nn.Module):
    """[N, T] tokens -> [N, C, T] logits, the layout cross_entropy takes as it is."""

    def __init__(self):
        super().__init__()
        self.emb, self.head = nn.Embedding(11, 8), nn.Linear(8, 5)

    def forward(self, x):
        return self.head(self.emb(x)).transpose(1, 2)


def tagged(seed=0, pad=-100):
    g = torch.Generator().manual_seed(seed)
    x = torch.randint(0, 11, (6, 4), generator=g)
    y = torch.randint(1, 5, (6, 4), generator=g)
    y[3:, 1:] = pad
    y[1, :] = 2  # a class of another weight
    return x, y


@pytest.mark.parametrize("loss_fn, pad", [
    (AF.cross_entropy, -100),
    (AF.nll_loss, -100),  # (of logits: only the weighting matters here)
    (functools.partial(AF.cross_entropy, weight=torch.tensor([0.5, 1.0, 3.0, 0.2, 1.5])), -100),
    (functools.partial(AF.cross_entropy, weight=torch.tensor([0.5, 1.0, 3.0, 0.2, 1.5])), 1),  # nothing ignored
    (functools.partial(AF.cross_entropy, weight=torch.rand(B, 5) + 0.1, label_smoothing=0.1), -100),
    (functools.partial(AF.cross_entropy, ignore_index=0), 0),
])
def test_hfkerns_own_class_losses_are_weighted_by_their_own_denominator(loss_fn, pad):
    x, y = tagged(pad=pad)
    full, plain = run_step(Tagger, loss_fn, 1, x, y)
    losses, micro = run_step(Tagger, loss_fn, 2, x, y)
    torch.testing.assert_close(losses, full, rtol=1e-5, atol=1e-6)
    assert_same_grads(plain, micro)


def test_per_model_batches_with_per_model_denominators():
    x, y = tagged()
    xs = torch.stack([x, x.flip(0)])  # each model its own batch
    ys = torch.stack([y, y.flip(0)])
    loss_fn = functools.partial(AF.cross_entropy, weight=torch.rand(B, 5) + 0.1)
    full, plain = run_step(Tagger, loss_fn, 1, xs, ys, shared=False)
    losses, micro = run_step(Tagger, loss_fn, 2, xs, ys, shared=False)
    torch.testing.assert_close(losses, full, rtol=1e-5, atol=1e-6)
    assert_same_grads(plain, micro)


def test_a_micro_batch_with_nothing_counted_is_skipped():
    x, y = tagged()
    y[4:] = -100  # the last of three micro-batches all padding
    full, plain = run_step(Tagger, AF.cross_entropy, 1, x, y)
    losses, micro = run_step(Tagger, AF.cross_entropy, 3, x, y)
    assert torch.isfinite(losses).all()
    torch.testing.assert_close(losses, full, rtol=1e-5, atol=1e-6)
    assert_same_grads(plain, micro)


def test_a_micro_batch_with_nothing_counted_for_some_models_only_is_refused():
    x, y = tagged()
    xs, ys = torch.stack([x, x]), torch.stack([y, y])
    ys[1, 3:] = -100  # model 1's second micro-batch all padding, model 0's not
    with pytest.raises(ValueError, match=r"micro-batch 1 of 2 holds nothing loss_denominator counts for models \[1\]"):
        run_step(Tagger, AF.cross_entropy, 2, xs, ys, shared=False)


def test_summed_losses_and_bad_denominators_are_refused():
    model = hfkern.fuse(Tagger, B)
    strategy = hp.Strategy(B, micro_batches=2)
    hp.apply(model, strategy)
    opt = hfkern.optim.SGD(model.parameters(), lr=0.1)
    with pytest.raises(ValueError, match="reduction='sum'"):
        hp.make_step(model, opt, strategy, functools.partial(AF.cross_entropy, reduction="sum"))
    with pytest.raises(TypeError, match="loss_denominator to be callable or None, got int"):
        hp.make_step(model, opt, strategy, AF.cross_entropy, loss_denominator=3)
    x, y = tagged()
    for bad, error, match in ((lambda y: "3", TypeError, "got str"),
                              (lambda y: torch.ones(3), ValueError, r"shape \[3\]"),
                              (lambda y: -1.0, ValueError, "finite, non-negative")):
        step = hp.make_step(model, opt, strategy, AF.cross_entropy, loss_denominator=bad)
        with pytest.raises(error, match=match):
            step(x, y)
    assert all(p.grad is None for p in model.parameters())
    # one micro-batch: the weighting plays no part, a sum is a sum
    one = hp.Strategy(B)
    hp.apply(model, one)
    hp.make_step(model, opt, one, functools.partial(AF.cross_entropy, reduction="sum"))


def test_float_targets_and_losses_over_samples_keep_the_share_weighting():
    torch.manual_seed(0)
    x, y = torch.randn(7, 3), torch.randn(7, 2)
    factory = lambda: nn.Linear(3, 2)  # noqa: E731
    full, plain = run_step(factory, AF.mse_loss, 1, x, y)
    losses, micro = run_step(factory, AF.mse_loss, 3, x, y)
    torch.testing.assert_close(losses, full, rtol=1e-5, atol=1e-6)
    assert_same_grads(plain, micro)


# ---- 3. keyword arguments of a recomputed block ----------------------------------------------
class Keywords(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = hn.Linear(4, 4, B=B)

    # names torch.utils.checkpoint and the recomputation's wrappers have as their own
    def forward(self, x, debug=True, site=None, fn=None, block=None, preserve_rng_state=1.0, use_reentrant=0.0,
                context_fn=0.0, determinism_check=0.0):
        h = self.lin(x)
        h = h * 0 if debug else h
        for v in (site, fn, block):
            h = h + (0 if v is None else len(v))
        return h * preserve_rng_state + use_reentrant + context_fn + determinism_check


class CallsKeywords(nn.Module):
    def __init__(self, **kw):
        super().__init__()
        self.blk, self.head, self.kw = Keywords(), hn.Linear(4, 3, B=B), kw

    def forward(self, x):
        return self.head(self.blk(x, **self.kw))


@pytest.mark.parametrize("kw", [dict(debug=False), dict(debug=False, site="a", fn="bb", block="ccc"),
                                dict(debug=False, preserve_rng_state=2.0, use_reentrant=0.5, context_fn=0.25,
                                     determinism_check=0.125)])
def test_a_recomputed_blocks_keyword_arguments_all_go_to_the_block(kw):
    torch.manual_seed(0)
    plain = CallsKeywords(**kw)
    rc = recomputed_copy(plain, "blk")
    x = torch.randn(B, 5, 4)
    outs = []
    for m in (plain, rc):
        out = m(x)
        (out ** 2).sum().backward()
        outs.append(out)
    torch.testing.assert_close(outs[0], outs[1], rtol=0, atol=0)
    assert_same_grads(plain, rc)


# ---- 4. the forward's train/eval mode for the recomputation ----------------------------------
class Moded(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = hn.Linear(4, 8, B=B)

    def forward(self, x):
        h = self.lin(x)
        return torch.tanh(h) if self.training else torch.sigmoid(h)


class WithBatchNorm(nn.Module):
    def __init__(self):
        super().__init__()
        self.a = nn.Sequential(nn.Linear(4, 8), nn.BatchNorm1d(8), nn.Tanh())
        self.head = nn.Linear(8, 3)

    def forward(self, x):
        return self.head(self.a(x))


@pytest.mark.parametrize("fused", [False, True])
def test_a_recomputation_runs_in_its_forwards_mode(fused):
    torch.manual_seed(0)
    if fused:
        plain, name, x = hfkern.fuse(WithBatchNorm, B), "a", hfkern.broadcast(torch.randn(6, 4), B)
    else:
        plain, name, x = nn.Sequential(Moded(), hn.Linear(8, 3, B=B)), "0", torch.randn(B, 6, 4)
    rc = recomputed_copy(plain, name)
    for m in (plain, rc):
        loss = (m(x) ** 2).sum()  # train mode
        m.eval()                   # an evaluation before backward
        loss.backward()
        assert not any(mod.training for mod in m.modules())  # and eval it stays
        m.train()
    assert_same_grads(plain, rc)
    for a, b in zip(plain.buffers(), rc.buffers()):
        torch.testing.assert_close(a, b, rtol=0, atol=0)


# ---- 5. pickling an applied block whose class pickles its own way ----------------------------
class SmallNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin, self.bn = nn.Linear(4, 8), nn.BatchNorm1d(8)

    def forward(self, x):
        return torch.relu(self.bn(self.lin(x)))


class OwnPickling(nn.Module):
    """Drops an unpicklable member when pickled (its own __getstate__ / __setstate__)."""

    def __init__(self):
        super().__init__()
        self.lin = hn.Linear(4, 8, B=B)
        self.act = lambda t: torch.tanh(t)

    def forward(self, x):
        return self.act(self.lin(x))

    def __getstate__(self):
        state = dict(self.__dict__)
        del state["act"]
        return state

    def __setstate__(self, state):
        super().__setstate__(state)
        self.act = lambda t: torch.tanh(t)


@pytest.mark.parametrize("first", ["fused", "own"])
def test_an_applied_block_pickles_through_its_own_classs_protocol(first):
    torch.manual_seed(0)
    block = hfkern.fuse(SmallNet, B) if first == "fused" else OwnPickling()
    model = nn.Sequential(block, hn.Linear(8, 3, B=B))
    hp.apply(model, hp.Strategy(B, recompute=("0",)))
    x = hfkern.broadcast(torch.randn(6, 4), B)
    buf = io.BytesIO()
    torch.save(model, buf)
    buf.seek(0)
    copies = [copy.deepcopy(model), torch.load(buf, weights_only=False)]
    (model(x) ** 2).sum().backward()
    for other in copies:
        assert isinstance(other[0], hp.Recompute) and type(other[0]).__name__ == type(block).__name__
        (other(x) ** 2).sum().backward()
        assert_same_grads(model, other)


# ---- 6. torch's parametrize on an applied block ----------------------------------------------
class Double(nn.Module):
    def forward(self, w):
        return 2 * w


def parametrized_pair():
    torch.manual_seed(0)
    return nn.Sequential(hn.Linear(4, 4, B=B), hn.Linear(4, 3, B=B))


def test_parametrize_then_apply_then_remove_the_parametrization():
    x = torch.randn(B, 5, 4)
    ref = parametrized_pair()
    P.register_parametrization(ref[0], "weight", Double())
    expected = ref(x)
    m = parametrized_pair()
    P.register_parametrization(m[0], "weight", Double())
    hp.apply(m, hp.Strategy(B, recompute=("0",)))
    assert isinstance(m[0], hp.Recompute) and P.is_parametrized(m[0], "weight")
    torch.testing.assert_close(m(x), expected, rtol=0, atol=0)
    P.remove_parametrizations(m[0], "weight", leave_parametrized=True)
    assert isinstance(m[0], hp.Recompute) and not P.is_parametrized(m[0])
    torch.testing.assert_close(m(x), expected, rtol=0, atol=0)
    hp.unapply(m)
    assert type(m[0]) is hn.Linear
    torch.testing.assert_close(m(x), expected, rtol=0, atol=0)


def test_apply_then_parametrize_then_unapply():
    x = torch.randn(B, 5, 4)
    ref = parametrized_pair()
    P.register_parametrization(ref[0], "weight", Double())
    (ref(x) ** 2).sum().backward()
    m = parametrized_pair()
    hp.apply(m, hp.Strategy(B, recompute=("0",)))
    P.register_parametrization(m[0], "weight", Double())
    assert isinstance(m[0], hp.Recompute)
    hp.apply(m, hp.Strategy(B, recompute=("0",)))  # applied again: swapped out and in
    assert isinstance(m[0], hp.Recompute) and P.is_parametrized(m[0], "weight")
    (m(x) ** 2).sum().backward()
    assert_same_grads(ref, m)
    hp.unapply(m)
    assert not isinstance(m[0], hp.Recompute) and P.is_parametrized(m[0], "weight")
    torch.testing.assert_close(m(x), ref(x), rtol=0, atol=0)
    copy.deepcopy(m)
    P.remove_parametrizations(m[0], "weight")
    assert type(m[0]) is hn.Linear


# ---- 7. profile_together / profile_step arguments ---------------------------------------------
FACTORY = lambda: nn.Sequential(nn.Linear(3, 4), nn.ReLU(), nn.Linear(4, 2))  # noqa: E731
BATCH = (torch.randn(4, 3), torch.randint(0, 2, (4,)))
KW = dict(optimizer=lambda p: hfkern.optim.SGD(p, lr=0.1), loss_fn=AF.cross_entropy, device=CPU, steps=1, warmup=0)


@pytest.mark.parametrize("strategies, kw, error, match", [
    ([hp.Strategy(1), hp.Strategy(2)], dict(measure_blocks=[True]), ValueError,
     r"one measure_blocks entry per strategy \(2\), got 1"),
    ([hp.Strategy(1)], dict(measure_blocks=[True, False]), ValueError, r"per strategy \(1\), got 2"),
    ([hp.Strategy(1)], dict(measure_blocks=[1]), TypeError, "measure_blocks to hold bools"),
    ([hp.Strategy(1)], dict(measure_blocks="yes"), TypeError, "measure_blocks to be a bool or a sequence"),
    ([hp.Strategy(1)], dict(steps=0), ValueError, "steps must be a positive int, got 0"),
    ([hp.Strategy(1)], dict(steps=1.5), TypeError, "steps must be a positive int"),
    ([hp.Strategy(1)], dict(warmup=-1), ValueError, "warmup to be an int >= 0, got -1"),
    ([hp.Strategy(1)], dict(device=3.5), TypeError, "device must be a torch.device, a str or None"),
    ([hp.Strategy(1)], dict(device="meta"), ValueError, "expected a 'cpu' or 'cuda' device"),
    ([hp.Strategy(1)], dict(optimizer=3), TypeError, "expected optimizer to be a callable, got int"),
    ([hp.Strategy(1)], dict(loss_fn=None), TypeError, "expected loss_fn to be a callable, got NoneType"),
    (["B=1"], {}, TypeError, "Strategy objects, got str"),
    (hp.Strategy(1), {}, TypeError, "strategies to be a sequence of Strategy"),
])
def test_profile_together_checks_its_arguments_before_building(monkeypatch, strategies, kw, error, match):
    from hfkern.plan import _cost

    monkeypatch.setattr(_cost, "_Run", lambda *a, **k: pytest.fail("built before the checks"))
    with pytest.raises(error, match=match):
        hp.profile_together(FACTORY, BATCH, strategies, **{**KW, **kw})


def test_profile_step_checks_its_strategy_and_takes_a_device_name(monkeypatch):
    with pytest.raises(TypeError, match="profile_step: expected a hfkern.plan Strategy, got str"):
        hp.profile_step(FACTORY, BATCH, "B=1", **KW)
    with pytest.raises(TypeError, match="measure_blocks to be a bool"):
        hp.profile_step(FACTORY, BATCH, hp.Strategy(1), **KW, measure_blocks=[True])
    profile = hp.profile_step(FACTORY, BATCH, hp.Strategy(1), **{**KW, "device": "cpu"})
    assert isinstance(profile, hp.Profile) and profile.step_time > 0


# ---- 8. plan() / fit_cost_model() arguments ---------------------------------------------------
BAD = [
    (dict(device=3.5), TypeError, "device must be a torch.device, a str or None, got float"),
    (dict(device="meta"), ValueError, "expected a 'cpu' or 'cuda' device, got meta"),
    (dict(optimizer=3), TypeError, "expected optimizer to be a callable or None, got int"),
    (dict(loss_fn="ce"), TypeError, "expected loss_fn to be a callable or None, got str"),
]
if not torch.cuda.is_available():
    BAD.append((dict(device="cuda"), ValueError, "expected an available device, got cuda"))


@pytest.mark.parametrize("kw, error, match", BAD + [
    (dict(warmup=-1), ValueError, "warmup to be an int >= 0, got -1"),
    (dict(warmup=1.5), TypeError, "warmup to be an int >= 0, got float"),
])
def test_fit_cost_model_checks_device_optimizer_and_warmup_first(monkeypatch, kw, error, match):
    from hfkern.plan import _cost

    monkeypatch.setattr(_cost, "profile_together", lambda *a, **k: pytest.fail("profiled before the checks"))
    monkeypatch.setattr(_cost, "fuse", lambda *a, **k: pytest.fail("built before the checks"))
    with pytest.raises(error, match=match):
        hp.fit_cost_model(FACTORY, BATCH, B_values=(1, 2), steps=1, **kw)


@pytest.mark.parametrize("kw, error, match", BAD)
def test_plan_checks_device_and_optimizer_first(monkeypatch, kw, error, match):
    from hfkern.plan import _plan

    monkeypatch.setattr(_plan, "fit_cost_model", lambda *a, **k: pytest.fail("profiled before the checks"))
    with pytest.raises(error, match=match.replace("expected", "plan: expected", 1) if "device" not in kw
                       else match):
        hp.plan(FACTORY, BATCH, trials=4, steps=2, B_values=(1, 2), **kw)


# ---- the front keeps one plan per point --------------------------------------------------------
def test_pareto_front_keeps_the_first_of_equal_plans():
    from hfkern.plan._search import Plan

    a = Plan(1, "fp32", 1, 1, "auto", (), 1.0, 10.0, 5.0)
    b = Plan(2, "fp32", 1, 1, "auto", (), 1.0, 10.0, 5.0)
    assert hp.pareto_front([a, b]) == [a] and hp.pareto_front([b, a]) == [b]


def test_profiling_micro_batches_of_a_wrapped_loss_with_ignored_targets_is_not_refused():
    # (the profile times the step: make_step's refusal is training's business, not the cost model's)
    x, y = tokens()
    p = hp.profile_step(lm, (x, y), hp.Strategy(B, micro_batches=2), **{**KW, "loss_fn": sequence_ce()})
    assert p.step_time > 0
