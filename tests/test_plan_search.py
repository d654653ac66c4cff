"""hfkern.plan's search: the dynamic program over blocks against brute force, on random costs."""

from __future__ import annotations

import math
import random
import time

import pytest
import torch

import hfkern.plan

from hfkern.plan._search import (BlockCost, Plan, SharedBytes, StepCost, _recompute_front, pareto_front, search,
                                 search_brute_force, step_costs)


class RandomCosts:
    """A synthetic cost model: per-block costs linear in B with random coefficients, bf16 faster
    and smaller, micro-batches smaller in activations and slower per step."""

    def __init__(self, n_blocks: int, seed: int):
        rng = random.Random(seed)
        self.blocks = [dict(t=rng.uniform(1, 10), rt=rng.uniform(0.3, 4), s=rng.uniform(1, 50),
                            sr=rng.uniform(0.1, 5), tr=rng.uniform(1, 60)) for _ in range(n_blocks)]
        self.opt = rng.uniform(0.5, 2)

    def step_cost(self, B, precision, micro_batches, memory_format):
        speed = 0.6 if precision == "bf16" else 1.0
        size = 0.5 if precision == "bf16" else 1.0
        blocks = tuple(BlockCost(f"b{i}", B * c["t"] * speed + micro_batches, B * c["rt"] * speed,
                                 B * c["s"] * size / micro_batches, B * c["sr"] * size / micro_batches,
                                 B * c["tr"] * size / micro_batches) for i, c in enumerate(self.blocks))
        return StepCost(blocks, self.opt * B + 1.0, 20.0 * B + 100.0)


def key(front):
    return [(p.B, p.precision, p.micro_batches, p.arrays, round(p.time, 9), round(p.peak_memory, 6))
            for p in front]


@pytest.mark.parametrize("n_blocks", [1, 3, 6])
@pytest.mark.parametrize("seed", range(4))
def test_dynamic_program_finds_the_brute_force_front(n_blocks, seed):
    model = RandomCosts(n_blocks, seed)
    space = dict(trials=37, steps=11, B_values=[1, 2, 3, 5, 8], precisions=["fp32", "bf16"],
                 micro_batches=[1, 2], arrays=[1, 2])
    dp, brute = search(model, **space), search_brute_force(model, **space)
    assert key(dp) == key(brute)
    for p in dp:  # and the same recomputed blocks give the same costs: re-derive one plan
        assert isinstance(p, Plan) and set(p.recompute) <= {f"b{i}" for i in range(n_blocks)}


class RandomSharedCosts(RandomCosts):
    """RandomCosts with bytes several blocks hold (SharedBytes): each entry held by two or three
    blocks, near one another or not, as savers, readers or both."""

    def __init__(self, n_blocks: int, seed: int, n_shared: int):
        super().__init__(n_blocks, seed)
        rng = random.Random(seed + 1000)
        self.shared = []
        for _ in range(n_shared):
            holders = rng.sample(range(n_blocks), min(n_blocks, rng.choice((2, 2, 3))))
            savers = frozenset(f"b{k}" for k in holders if rng.random() < 0.7)
            readers = frozenset(f"b{k}" for k in holders if rng.random() < 0.5)
            self.shared.append((rng.uniform(1, 60), savers, readers))

    def step_cost(self, B, precision, micro_batches, memory_format):
        cost = super().step_cost(B, precision, micro_batches, memory_format)
        size = (0.5 if precision == "bf16" else 1.0) / micro_batches
        return StepCost(cost.blocks, cost.other_time, cost.static,
                        tuple(SharedBytes(B * b * size, s, r) for b, s, r in self.shared))


@pytest.mark.parametrize("n_blocks, n_shared", [(2, 1), (4, 3), (6, 4), (7, 8)])
@pytest.mark.parametrize("seed", range(4))
def test_dynamic_program_with_shared_bytes_finds_the_brute_force_front(n_blocks, n_shared, seed):
    model = RandomSharedCosts(n_blocks, seed, n_shared)
    space = dict(trials=37, steps=11, B_values=[1, 3, 8], precisions=["fp32", "bf16"], micro_batches=[1, 2])
    dp, brute = search(model, **space), search_brute_force(model, **space)
    assert key(dp) == key(brute)
    for p in dp:  # each plan's recomputed blocks give its costs
        t, m = step_costs(model.step_cost(p.B, p.precision, p.micro_batches, "auto"), p.recompute)
        assert (p.step_time, p.peak_memory) == pytest.approx((t, m))


def test_shared_bytes_are_freed_only_when_no_holder_holds_them():
    """a's output, saved by b (its input, as a convolution saves it): recomputing a alone frees
    nothing of it (b saves it), nor does recomputing b (it keeps its input), nor both."""
    out = SharedBytes(100.0, savers=frozenset({"b"}), readers=frozenset({"b"}))
    relu = SharedBytes(40.0, savers=frozenset({"a", "b"}), readers=frozenset({"b"}))  # a saves it too
    own = SharedBytes(30.0, savers=frozenset({"a"}), readers=frozenset({"c"}))  # a's, then c's input
    cost = StepCost((BlockCost("a", 1.0, 1.0, 10.0, 1.0, 5.0), BlockCost("b", 1.0, 1.0, 20.0, 2.0, 5.0),
                     BlockCost("c", 1.0, 1.0, 0.0, 0.0, 0.0)), 0.0, 0.0, (out, relu, own))
    plain = 10 + 20 + 100 + 40 + 30
    assert step_costs(cost, ())[1] == plain
    assert step_costs(cost, ("a",))[1] == plain - 10 + 1 - 30
    assert step_costs(cost, ("b",))[1] == plain - 20 + 2 + 5  # b's transient, in its backward, on top
    assert step_costs(cost, ("c",))[1] == plain  # it keeps a's output, which a saves anyway
    assert step_costs(cost, ("a", "c"))[1] == plain - 10 + 1
    # While a recomputed block's backward runs, its transient adds to what it and the blocks
    # before it hold: b's, to a's 1 and its own 2 + 100 + 40.
    assert step_costs(cost, ("a", "b"))[1] == 1 + 2 + 100 + 40 + 5
    # the least memory: a and b recomputed, c not (it would keep a's output)
    front = _recompute_front(cost)
    assert min(front, key=lambda f: f[1])[1:] == (148.0, ("a", "b"))


def test_front_is_sorted_non_dominated_and_respects_the_budget():
    model = RandomCosts(5, 7)
    front = search(model, trials=64, steps=10, B_values=list(range(1, 17)), precisions=["fp32", "bf16"])
    mem = [p.peak_memory for p in front]
    t = [p.time for p in front]
    assert mem == sorted(mem) and t == sorted(t, reverse=True)
    assert all(a.time > b.time for a, b in zip(front, front[1:]))
    budget = (mem[0] + mem[-1]) / 2
    within = search(model, trials=64, steps=10, B_values=list(range(1, 17)), precisions=["fp32", "bf16"],
                    memory_budget=budget)
    assert within and all(p.peak_memory <= budget for p in within)
    assert within == [p for p in front if p.peak_memory <= budget]


def test_recomputation_buys_memory_for_time():
    """One block whose activations dominate: recomputing it lowers the peak and costs its forward."""
    class OneHeavy:
        def step_cost(self, B, precision, micro_batches, memory_format):
            return StepCost((BlockCost("light", B, 0.5 * B, 1.0 * B, 1.0 * B, 1.0 * B),
                             BlockCost("heavy", 2.0 * B, 1.0 * B, 100.0 * B, 1.0 * B, 60.0 * B)), 0.0, 0.0)

    front = search(OneHeavy(), trials=1, steps=1, B_values=[1])
    assert [p.recompute for p in front] == [("heavy",), ()]
    low, high = front
    # light's 1, heavy's input (1) kept and its 60 while its backward runs
    assert low.peak_memory == pytest.approx(1.0 + 1.0 + 60.0) and high.peak_memory == pytest.approx(101.0)
    assert low.time == pytest.approx(high.time + 1.0)


def test_time_counts_the_arrays_needed_for_every_trial():
    class Flat:
        def step_cost(self, B, precision, micro_batches, memory_format):
            return StepCost((), 1.0 + 0.25 * B, 10.0 * B)

    front = search(Flat(), trials=10, steps=3, B_values=[1, 4, 10])
    by_B = {p.B: p for p in front}
    assert by_B[10].time == pytest.approx(1 * 3 * 3.5)
    assert by_B[1].time == pytest.approx(10 * 3 * 1.25)
    assert 4 not in by_B or by_B[4].time == pytest.approx(math.ceil(10 / 4) * 3 * 2.0)


def test_search_is_fast_on_a_deep_model():
    model = RandomCosts(12, 3)  # 4096 subsets per setting for brute force; the workloads have <= 12 blocks
    start = time.perf_counter()
    front = search(model, trials=100, steps=50, B_values=list(range(1, 33)), precisions=["fp32", "bf16"],
                   micro_batches=[1, 2, 4])
    assert front
    assert time.perf_counter() - start < 20  # generous (a busy CI machine): the bench reports the real figure


def test_search_checks_its_arguments():
    model = RandomCosts(2, 0)
    with pytest.raises(ValueError, match="trials must be a positive int"):
        search(model, trials=0, steps=1, B_values=[1])
    with pytest.raises(ValueError, match="B_values must be a non-empty sequence"):
        search(model, trials=1, steps=1, B_values=[])
    # values too: B = 0 divided by zero, B = -3 gave a front of one plan with a negative time;
    # values of another type raise TypeError, as Strategy's fields do
    for kwargs, error, match in [
            (dict(B_values=[0, 2]), ValueError, r"B_values must hold positive ints, got 0"),
            (dict(B_values=[-3, 2]), ValueError, r"B_values must hold positive ints, got -3"),
            (dict(B_values=[2.5]), TypeError, r"B_values must hold positive ints, got 2.5"),
            (dict(B_values=[True]), TypeError, r"B_values must hold positive ints, got True"),
            (dict(B_values=[2], arrays=[0]), ValueError, r"arrays must hold positive ints, got 0"),
            (dict(B_values=[2], micro_batches=[0]), ValueError, r"micro_batches must hold positive ints, got 0"),
            (dict(B_values=[2], precisions=["fp8"]), ValueError, r"precisions must hold choices of .*'fp8'"),
            (dict(B_values=[2], memory_formats=["nhwc"]), ValueError, r"memory_formats must hold choices .*'nhwc'")]:
        for fn in (search, search_brute_force):
            with pytest.raises(error, match=fn.__name__ + ": " + match):
                fn(model, trials=1, steps=1, **kwargs)
    assert pareto_front([]) == []


def test_plan_checks_its_spaces_before_profiling(monkeypatch):
    import hfkern.plan._plan as plan_module

    def profiled(*args, **kwargs):
        raise AssertionError("profiled before checking the arguments")

    monkeypatch.setattr(plan_module, "fit_cost_model", profiled)
    batch = (torch.randn(4, 3), torch.randint(0, 2, (4,)))
    for kwargs, match in [(dict(B_values=(0, 2)), "B_values must hold positive ints, got 0"),
                          (dict(arrays=(0,)), "arrays must hold positive ints, got 0"),
                          (dict(precisions=("fp8",)), "precisions must hold choices"),
                          (dict(profile_B=(1, -2)), "profile_B must hold positive ints, got -2"),
                          (dict(profile_B=(2, 2)), r"profile_B needs at least two distinct sizes to fit curves, "
                                                   r"got \[2, 2\]"),
                          (dict(steps=0), "steps must be a positive int")]:
        with pytest.raises(ValueError, match="plan: " + match):
            hfkern.plan.plan(lambda: torch.nn.Linear(3, 2), batch, **{"trials": 4, "steps": 5, **kwargs})


def test_micro_batches_on_batch_norm_are_refused_before_profiling(monkeypatch):
    """make_step refuses micro-batches on batch norm: the fit raised that after profiling every
    micro_batches=1 setting (minutes on a real model)."""
    import hfkern.plan._cost as cost_module

    def profiled(*args, **kwargs):
        raise AssertionError("profiled before checking the micro-batches")

    monkeypatch.setattr(cost_module, "profile_together", profiled)
    monkeypatch.setattr(cost_module, "profile_step", profiled)
    batch = (torch.randn(4, 3), torch.randint(0, 2, (4,)))
    net = lambda: torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.BatchNorm1d(4))  # noqa: E731
    with pytest.raises(ValueError, match=r"fit_cost_model: micro_batches=\[2\] on a model with batch norm \(1\)"):
        hfkern.plan.plan(net, batch, trials=4, steps=5, micro_batches=(1, 2), device="cpu")
