"""hfkern.plan: blocks whose input is written in place, in the block or after it (D1), and
micro-batch counts above the example batch's size (D5).

torch.utils.checkpoint keeps a recomputed block's inputs for its recomputation and refuses them
in backward if they were written in place since: such a block cannot be recomputed, though the
plain model (and B separate torch models) trains. apply() refuses it before changing the model,
a block that writes its input in a way the fused graph does not show raises at its first
forward, and fit_cost_model()/plan() leave it out of every plan with a warning."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import hfkern
import hfkern.nn as hn
import hfkern.plan as hp
from hfkern.nn import functional as AF
from hfkern.plan._strategy import applied

B = 2
CPU = torch.device("cpu")


# ---- models ----------------------------------------------------------------------------------
def relu_first() -> nn.Module:
    """Block '1' starts with an in-place ReLU on its input (block '0''s output)."""
    return nn.Sequential(nn.Linear(6, 8), nn.Sequential(nn.ReLU(inplace=True), nn.Linear(8, 4)))


class AddBias(nn.Module):
    def __init__(self):
        super().__init__()
        self.b = nn.Parameter(torch.randn(8) * 0.1)

    def forward(self, x):
        return torch.tanh(x + self.b)


class WritesAfter(nn.Module):
    """The model's own code writes f2's input in place after f2 ran (torch keeps no copy of it)."""

    def __init__(self):
        super().__init__()
        self.f1 = nn.Linear(6, 8)
        self.f2 = AddBias()
        self.head = nn.Linear(8, 4)

    def forward(self, x):
        h = self.f1(x)
        out = self.f2(h)
        h.mul_(0.5)
        return self.head(out + h)


class Doubled(torch.autograd.Function):
    """Doubles its input in place: the fused graph shows a call of a Function, not the write."""

    @staticmethod
    def forward(ctx, x):
        ctx.mark_dirty(x)
        return x.mul_(2)

    @staticmethod
    def backward(ctx, g):
        return g * 2


class DoublesInput(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(8, 4)

    def forward(self, x):
        return self.lin(Doubled.apply(x))


class ByFunction(nn.Module):
    def __init__(self):
        super().__init__()
        self.a = nn.Linear(6, 8)
        self.b = DoublesInput()

    def forward(self, x):
        return self.b(self.a(x))


# factory, the block that cannot be recomputed, the other blocks
CASES = {"in_block": (relu_first, "1", ("0",)),
         "after_block": (WritesAfter, "f2", ("f1", "head")),
         "custom_function": (ByFunction, "b", ("a",))}
WHERE = {"in_block": r"its input \('_0' in the fused model's code\) is written in place \(module '1.0' \(ReLU, "
                     r"inplace=True\)\) in the block's own forward",
         "after_block": r"its input \('f1' in the fused model's code\) is written in place \(`.mul_\(\)`\) after it "
                        r"ran, by the model's own forward code"}


def batch(N: int = 5, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(N, 6, generator=g), torch.randint(0, 4, (N,), generator=g)


def sgd(params):
    return hfkern.optim.SGD(params, lr=0.1)


# ---- D1: apply ---------------------------------------------------------------------------------
@pytest.mark.parametrize("case", ["in_block", "after_block"])
def test_apply_refuses_a_block_whose_input_is_written_in_place_before_changing_the_model(case):
    factory, block, _ = CASES[case]
    fused = hfkern.fuse(factory, B)
    code = fused.code
    with pytest.raises(ValueError, match=rf"apply: expected blocks whose inputs stay as they were until backward, "
                                         rf"got \['{block}'\]: block '{block}': {WHERE[case]}; torch.utils.checkpoint "
                                         r"keeps a recomputed block's inputs"):
        hp.apply(fused, hp.Strategy(B, recompute=(block,)))
    assert fused.code == code and applied(fused) is None


@pytest.mark.parametrize("case", ["in_block", "after_block", "custom_function"])
def test_recomputing_the_other_blocks_trains_as_separate_torch_models(case):
    """The blocks that can be recomputed still are, and every model trains as it does alone in torch."""
    factory, _, others = CASES[case]
    torch.manual_seed(0)
    models = [factory() for _ in range(B)]
    fused = hfkern.fuse(models)
    strategy = hp.Strategy(B, recompute=others)
    hp.apply(fused, strategy)
    step = hp.make_step(fused, sgd(fused.parameters()), strategy, AF.cross_entropy)
    optimizers = [torch.optim.SGD(m.parameters(), lr=0.1) for m in models]
    for i in range(3):
        x, y = batch(seed=i)
        losses = step(x, y)
        expected = []
        for m, opt in zip(models, optimizers):
            opt.zero_grad()
            loss = nn.functional.cross_entropy(m(x), y)
            loss.backward()
            opt.step()
            expected.append(loss.detach())
        torch.testing.assert_close(losses, torch.stack(expected), rtol=1e-5, atol=1e-6)
    for b, m in enumerate(models):
        for (name, p), q in zip(fused.extract_model(b).named_parameters(), m.parameters()):
            torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-6, msg=name)


def test_a_block_that_writes_its_input_raises_at_its_first_forward():
    """Where the graph does not show the write (a custom autograd Function; a hand-written array's
    block), the block's first forward finds it, rather than backward with torch's message."""
    fused = hfkern.fuse(ByFunction, B)
    hp.apply(fused, hp.Strategy(B, recompute=("b",)))  # the graph shows a Function call
    x, _ = batch()
    with pytest.raises(RuntimeError, match=r"hfkern.plan: a recomputed block \(block 'b'\) wrote its input in place "
                                           r"in its forward; torch.utils.checkpoint keeps"):
        fused(hfkern.broadcast(x, B))

    class HalvesInput(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = hn.Linear(4, 3, B=B)

        def forward(self, x):
            return self.lin(x.mul_(0.5))

    hand = nn.Sequential(hn.Linear(5, 4, B=B), HalvesInput())
    hp.apply(hand, hp.Strategy(B, recompute=("1",)))
    with pytest.raises(RuntimeError, match=r"a recomputed block \(HalvesInput\) wrote its input in place"):
        hand(torch.randn(B, 3, 5))
    hp.apply(hand, hp.Strategy(B, recompute=("0",)))  # the other block recomputes
    (hand(torch.randn(B, 3, 5)) ** 2).sum().backward()


# ---- D1: fit_cost_model and plan ----------------------------------------------------------------
@pytest.mark.parametrize("case", ["in_block", "after_block", "custom_function"])
def test_fit_cost_model_and_plan_leave_such_a_block_out_with_a_warning(case):
    factory, block, others = CASES[case]
    with pytest.warns(UserWarning, match=rf"fit_cost_model: block '{block}' cannot be recomputed: its "
                                         r"(input|forward) .*in place.* No plan recomputes it"):
        model = hp.fit_cost_model(factory, batch(), optimizer=sgd, device=CPU, B_values=(1, 2), steps=1, warmup=1)
    assert list(model.unrecomputable) == [block]
    assert "torch.utils.checkpoint keeps a recomputed block's inputs" in model.unrecomputable[block]
    recomputed = {p.strategy.recompute for p in model.profiles}
    assert recomputed == {(), others} | {(n,) for n in others}  # the other blocks were profiled recomputed
    with pytest.raises(ValueError, match=rf"expected blocks that can be recomputed, got '{block}'"):
        model.predict(hp.Strategy(B=2, recompute=(block,)))
    plans = hp.plan(factory, batch(), trials=4, steps=2, B_values=(1, 2, 3), device=CPU, cost_model=model,
                    memory_budget=2.0**40)
    assert plans.front and all(block not in p.recompute for p in plans.unbounded_front)


# ---- D5: micro-batches above the batch size -------------------------------------------------------
def mlp() -> nn.Module:
    return nn.Sequential(nn.Linear(6, 8), nn.ReLU(), nn.Linear(8, 4))


def test_plan_refuses_more_micro_batches_than_samples_before_profiling(monkeypatch):
    from hfkern.plan import _cost, _plan

    monkeypatch.setattr(_plan, "fit_cost_model", lambda *a, **k: pytest.fail("profiled before the check"))
    with pytest.raises(ValueError, match=r"plan: micro_batches \[20\] exceed the batch size N=8 of example_batch: "
                                         r"expected at most one micro-batch per sample"):
        hp.plan(mlp, batch(8), trials=4, steps=3, micro_batches=(1, 20), B_values=[1, 2], profile_B=(1, 2))

    class Profiled(Exception):
        pass

    def profiled(*args, **kwargs):
        raise Profiled

    monkeypatch.setattr(_plan, "fit_cost_model", profiled)
    with pytest.raises(Profiled):  # as many micro-batches as samples: one each
        hp.plan(mlp, batch(8), trials=4, steps=3, micro_batches=(1, 8), B_values=[1, 2], profile_B=(1, 2))
    for name in ("fuse", "profile_together", "profile_step"):
        monkeypatch.setattr(_cost, name, lambda *a, **k: pytest.fail("profiled before the check"))
    with pytest.raises(ValueError, match=r"fit_cost_model: micro_batches \[9, 16\] exceed the batch size N=8"):
        hp.fit_cost_model(mlp, batch(8), device=CPU, B_values=(1, 2), micro_batches=(1, 9, 16))
