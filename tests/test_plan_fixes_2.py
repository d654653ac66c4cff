"""hfkern.plan: Python attributes a recomputed block assigns, the plot's axis under a budget far
above the plans, the message of a budget a byte short, and plan()'s arguments checked first."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import hfkern
import hfkern.nn as hn
import hfkern.plan as hp
from hfkern.plan._plan import PlanSet
from hfkern.plan._search import Plan

CPU = torch.device("cpu")


class Counted(nn.Module):
    """A hand-written array block with a Python counter its forward assigns and reads."""

    def __init__(self):
        super().__init__()
        self.l = hn.Linear(4, 4, B=2)
        self.calls = 0
        self.last = "none"

    def forward(self, x):
        self.calls += 1
        self.last = f"call {self.calls}"
        return self.l(x) * self.calls


@pytest.mark.parametrize("micro_batches", [1, 2])
def test_a_recomputed_block_assigns_its_python_attributes_once_per_forward(micro_batches):
    runs = []
    for recompute in ((), ("0",)):
        torch.manual_seed(0)
        model = nn.Sequential(Counted(), hn.Linear(4, 3, B=2))
        strategy = hp.Strategy(2, recompute=recompute, micro_batches=micro_batches)
        hp.apply(model, strategy)
        step = hp.make_step(model, hfkern.optim.SGD(model.parameters(), lr=0.1), strategy,
                            hfkern.nn.functional.cross_entropy)
        torch.manual_seed(1)
        losses = [step(torch.randn(6, 4), torch.randint(0, 3, (6,))) for _ in range(3)]
        runs.append((model[0].calls, model[0].last, losses, [p.detach().clone() for p in model.parameters()]))
    (calls, last, losses, params), (calls_rc, last_rc, losses_rc, params_rc) = runs
    assert (calls_rc, last_rc) == (calls, last) == (3 * micro_batches, f"call {3 * micro_batches}")
    for a, b in zip(losses + params, losses_rc + params_rc):
        torch.testing.assert_close(a, b, rtol=0, atol=0)


def plans(budget: float) -> PlanSet:
    front = [Plan(B, "fp32", 1, 1, "auto", (), 1e-4 * B, 1e6 * B, 2e-3 / B) for B in (1, 2, 3)]
    return PlanSet(front, None, 8, 2, budget, 1e-3, 0.0, CPU)


def test_a_budget_far_above_the_plans_stays_off_the_plots_axis(tmp_path):
    fig = plans(2e10).plot(tmp_path / "far.png")
    ax = fig.axes[0]
    assert ax.get_xlim()[1] < 10  # MiB: the plans' scale (3 MB at most), not the budget's 19 GiB
    assert any("memory budget 18.6 GiB (off the axis)" in t.get_text() for t in ax.get_legend().get_texts())
    near = plans(4e6).plot(tmp_path / "near.png").axes[0]
    assert [t.get_text() for t in near.get_legend().get_texts()].count("memory budget") == 1
    assert near.get_xlim()[1] >= 4e6 / 2**20


def test_a_budget_a_byte_short_names_both_exact_counts():
    with pytest.raises(ValueError, match=r"no plan fits 976.6 KiB \(999999 bytes\); the smallest needs 976.6 KiB "
                                         r"\(1000000 bytes\)"):
        plans(2e6).best(999_999)


BATCH = (torch.randn(4, 3), torch.randint(0, 2, (4,)))


@pytest.mark.parametrize("args, kwargs, error, match", [
    ((5, BATCH), {}, TypeError, "plan: factory must be a callable returning a torch model, got int"),
    ((lambda: nn.Linear(3, 2), 5), {}, TypeError, r"plan: example_batch must be \(inputs, targets\), two tensors, "
                                                  r"got int"),
    ((lambda: nn.Linear(3, 2), (torch.randn(4, 3),)), {}, TypeError, "got tuple of Tensor"),
    ((lambda: nn.Linear(3, 2), (torch.randn(4, 3), [1, 0, 1, 0])), {}, TypeError, "got tuple of Tensor, list"),
    ((lambda: nn.Linear(3, 2), (torch.randn(4, 3), torch.zeros(3))), {}, ValueError,
     r"samples in dim 0, got shapes \[4, 3\] and \[3\]"),
    ((lambda: nn.Linear(3, 2), BATCH), dict(cost_model=5), TypeError, "cost_model must be a FittedCostModel"),
])
def test_plan_checks_its_model_arguments_before_profiling(monkeypatch, args, kwargs, error, match):
    from hfkern.plan import _plan

    monkeypatch.setattr(_plan, "fit_cost_model", lambda *a, **k: pytest.fail("profiled before the checks"))
    with pytest.raises(error, match=match):
        hp.plan(*args, trials=4, steps=2, B_values=(1, 2), **kwargs)


def test_fit_cost_model_checks_them_too():
    with pytest.raises(TypeError, match="fit_cost_model: factory must be a callable"):
        hp.fit_cost_model(None, BATCH)
