"""hfkern.elastic's autoscaler: when it re-solves, which decisions it emits, the restart test on
both sides of its threshold, learning-rate scaling, and capacity on random event sequences."""

from __future__ import annotations

import math
import random

import pytest

from hfkern.elastic._autoscaler import Autoscaler, Decision, scale_lr
from hfkern.elastic._model import Efficiency, Job, ThroughputModel


def sublinear_job(name, batch_sizes=(8,), **kw):
    """Speedups 1, 1.43, 1.76, 2.0 at 1..4 devices (batch 8): every device helps, less and less."""
    return Job(name, ThroughputModel(0.01, 0.005, 0.005), Efficiency(batch_sizes[0], 1e12), batch_sizes, **kw)


def random_job(rng: random.Random, name: str) -> Job:
    model = ThroughputModel(rng.uniform(0.01, 0.2), rng.uniform(1e-4, 5e-3), rng.uniform(0, 0.1),
                            rng.uniform(0, 0.02), rng.uniform(0, 0.2), rng.choice([1, 2]))
    b0 = rng.choice([4, 16, 32])
    return Job(name, model, Efficiency(b0, rng.uniform(1, 3000)), tuple(b0 * 2 ** k for k in range(rng.randint(1, 5))),
               rng.choice([(1,), (1, 2, 4)]), max_local_batch=rng.choice([None, 64]))


def test_scale_lr_rules():
    assert scale_lr(0.1, 64, 256, "linear") == pytest.approx(0.4)
    assert scale_lr(0.1, 64, 256, "sqrt") == pytest.approx(0.2)
    assert scale_lr(0.1, 64, 256) == pytest.approx(0.2)
    assert scale_lr(0.1, 256, 64, "linear") == pytest.approx(0.025)
    assert scale_lr(0.1, 64, 256, "none") == 0.1
    with pytest.raises(ValueError, match="rule: expected one of .* got 'cubic'"):
        scale_lr(0.1, 64, 128, "cubic")
    with pytest.raises(ValueError, match="old_batch: expected a positive batch size, got 0"):
        scale_lr(0.1, 0, 128)
    with pytest.raises(TypeError, match="new_batch"):
        scale_lr(0.1, 64, 128.0)
    with pytest.raises(TypeError, match="lr: expected a finite number >= 0, got str"):
        scale_lr("1", 64, 128)
    with pytest.raises(ValueError, match="lr: expected a finite number >= 0, got nan"):
        scale_lr(math.nan, 64, 128)


def test_a_call_that_raises_changes_nothing():
    # the clock moved (and remaining times were stored) before the checks that then raised
    s = Autoscaler(4, interval=1e6)
    s.submit(sublinear_job("a"), 0.0)
    s.submit(sublinear_job("c"), 0.0)
    for call, exc in [(lambda: s.submit(sublinear_job("a"), 100.0), ValueError),
                      (lambda: s.finish("zz", 200.0), ValueError),
                      (lambda: s.tick(300.0, remaining={"a": 100.0, "zz": 5.0, "c": -1.0}), ValueError),
                      (lambda: s.tick(math.nan), ValueError),
                      (lambda: s.tick("soon"), TypeError)]:
        with pytest.raises(exc):
            call()
    assert s._now == 0.0 and s._remaining == {}
    s.submit(sublinear_job("b"), 50.0)  # a legitimate later event still fits
    assert set(s.jobs) == {"a", "b", "c"}


def test_job_requests_its_minimum_by_default():
    job = sublinear_job("a", batch_sizes=(8, 16), min_gpus=2)
    assert job.requested_gpus == 2
    with pytest.raises(ValueError, match="requested_gpus: expected between min_gpus=2"):
        sublinear_job("a", batch_sizes=(8, 16), min_gpus=2, requested_gpus=1)


def test_fit_names_a_bad_gamma_grid():
    samples = [(g, 32, 1, 1, 0.1 / g + 0.01) for g in (1, 2, 4, 8)]
    with pytest.raises(TypeError, match="gamma_grid: expected a sequence of gammas >= 1, got int 2"):
        ThroughputModel.fit(samples, gamma_grid=2)


def test_constructor_errors():
    with pytest.raises(ValueError, match="gpus"):
        Autoscaler(0)
    with pytest.raises(ValueError, match="policy: expected one of .* got 'pollux'"):
        Autoscaler(4, policy="pollux")
    with pytest.raises(ValueError, match="lr_rule"):
        Autoscaler(4, lr_rule="cosine")
    with pytest.raises(ValueError, match="objective"):
        Autoscaler(4, objective="jct")
    with pytest.raises(ValueError, match="interval"):
        Autoscaler(4, interval=0)
    with pytest.raises(ValueError, match="restart_cost"):
        Autoscaler(4, restart_cost=-1)


def test_arrival_completion_and_interval():
    s = Autoscaler(4, interval=100.0, restart_cost=0.0)
    d = s.submit(sublinear_job("a"), 0.0)
    assert [(x.job, x.old, x.new.gpus, x.reason) for x in d] == [("a", None, 4, "arrival")]
    assert s.allocations["a"].gpus == 4
    d = s.submit(sublinear_job("b"), 10.0)
    assert {x.job: (x.old.gpus if x.old else None, x.new.gpus) for x in d} == {"a": (4, 2), "b": (None, 2)}
    assert all(x.reason == "arrival" for x in d)
    # nothing changes: no decisions, at the interval or before it
    assert s.tick(50.0) == []
    assert s.tick(110.0) == [] and s.last_solve == 110.0
    d = s.finish("b", 120.0)
    assert [(x.job, x.new.gpus, x.reason) for x in d] == [("a", 4, "completion")]
    assert s.allocations == {"a": s.allocations["a"]} and s.queued == []
    with pytest.raises(ValueError, match="active job .* got 'b'"):
        s.finish("b", 130.0)
    with pytest.raises(ValueError, match="got 'a' twice"):
        s.submit(sublinear_job("a"), 130.0)
    # (the two calls that raised did not move the clock: the last event is the finish at 120)
    with pytest.raises(ValueError, match="now: expected a time >= the last event's 120.0, got 5.0"):
        s.tick(5.0)


def test_interval_resolve_uses_updated_remaining_time():
    # a shrinks to 2 devices when b arrives; when b finishes, a's remaining time decides
    # whether growing back is worth a restart
    s = Autoscaler(4, interval=100.0, restart_cost=10.0)
    s.submit(sublinear_job("a"), 0.0)
    s.submit(sublinear_job("b"), 0.0)
    assert s.allocations["a"].gpus == 2
    # b finishes, but a has only 12 s left: horizon 12 s, a restart of 10 s is not worth it
    s.tick(1.0, remaining={"a": 12.0, "gone": 5.0})
    assert s.finish("b", 2.0) == []
    assert s.allocations["a"].gpus == 2
    # told later that a has long to go: the interval solve grows it
    assert s.tick(101.0, remaining={"a": 1000.0}) == []      # 99 s since the last solve
    d = s.tick(102.0)
    assert [(x.job, x.old.gpus, x.new.gpus, x.reason) for x in d] == [("a", 2, 4, "interval")]


def grow_case(restart_cost):
    """b (at most 2 devices) holds 2 of 4; a arrives and starts on the other 2; b finishes;
    does a grow to 4?"""
    s = Autoscaler(4, interval=60.0, horizon=60.0, restart_cost=restart_cost)
    s.submit(sublinear_job("b", max_gpus=2), 0.0)
    s.submit(sublinear_job("a"), 0.0)
    assert s.allocations["a"].gpus == 2 and s.allocations["b"].gpus == 2
    return s, s.finish("b", 1.0)


def test_gain_test_both_sides_of_the_threshold():
    a = sublinear_job("a")
    go, gn = a.goodput(2, 8), a.goodput(4, 8)
    # (gn - go) * horizon > gn * restart_cost  <=>  restart_cost < (gn - go) * horizon / gn
    threshold = (gn - go) * 60.0 / gn
    assert 5.0 < threshold < 30.0
    s, d = grow_case(threshold * 0.99)
    assert [(x.job, x.old.gpus, x.new.gpus) for x in d] == [("a", 2, 4)]
    s, d = grow_case(threshold * 1.01)
    assert d == [] and s.allocations["a"].gpus == 2
    # the inequality as the spec writes it, at the decision taken
    s, d = grow_case(threshold * 0.99)
    assert (d[0].new.goodput - d[0].old.goodput) * 60.0 > d[0].new.goodput * threshold * 0.99


def test_arrival_preempts_or_shrinks_only_when_the_cluster_gains():
    # a alone on 4 devices (speedup 2.0); b arrives. Shrinking a to 2 and starting b gives
    # 1.43 * f + 1.43 (b starts at 2, no restart cost) -- worth it unless f is tiny
    s = Autoscaler(4, interval=60.0, horizon=60.0, restart_cost=6.0)            # f = 0.9
    s.submit(sublinear_job("a"), 0.0)
    d = s.submit(sublinear_job("b"), 1.0)
    assert {x.job: x.new.gpus for x in d} == {"a": 2, "b": 2}
    # with f = 0 (restart as long as the horizon): a keeps its devices; b (at most 3 devices,
    # worth less than a's 4) waits in the queue
    s = Autoscaler(4, interval=60.0, horizon=60.0, restart_cost=60.0)
    s.submit(sublinear_job("a"), 0.0)
    assert s.submit(sublinear_job("b", max_gpus=3), 1.0) == [] and s.queued == ["b"]
    # b starts when a finishes, and the decision says it was not running before
    d = s.finish("a", 2.0)
    assert [(x.job, x.old, x.new.gpus, x.reason) for x in d] == [("b", None, 3, "completion")]


@pytest.mark.parametrize("rule,expected", [("linear", 4.0), ("sqrt", 2.0), ("none", 1.0)])
def test_lr_scale_follows_batch_changes(rule, expected):
    # batch 8 or 32: at 4 devices batch 32 is better (more samples per device, no efficiency loss)
    s = Autoscaler(4, restart_cost=0.0, lr_rule=rule)
    d = s.submit(sublinear_job("a", batch_sizes=(8, 32)), 0.0)
    assert d[0].new.batch_size == 32
    assert d[0].lr_scale == pytest.approx(expected)      # against the default batch size, 8
    d = s.submit(sublinear_job("b", batch_sizes=(8, 32)), 1.0)
    assert {x.job for x in d} <= {"a", "b"}
    for x in d:
        if x.old is not None and x.new.gpus:
            assert x.lr_scale == pytest.approx(scale_lr(1.0, x.old.batch_size, x.new.batch_size, rule))


def test_gpu_policy_keeps_default_batch_and_B():
    s = Autoscaler(8, policy="gpu", restart_cost=0.0)
    rng = random.Random(2)
    jobs = [random_job(rng, f"j{i}") for i in range(5)]
    for t, j in enumerate(jobs):
        for x in s.submit(j, float(t)):
            assert (x.new.batch_size, x.new.B) == (s.jobs[x.job].default_batch_size, s.jobs[x.job].default_B)
            assert x.lr_scale == 1.0
    h = Autoscaler(8, policy="hfkern", restart_cost=0.0)
    for t, j in enumerate(jobs):
        h.submit(j, float(t))
    changed = [n for n, a in h.allocations.items()
               if (a.batch_size, a.B) != (h.jobs[n].default_batch_size, h.jobs[n].default_B)]
    assert changed, "the elastic policy should adapt some batch size or B on this instance"


@pytest.mark.parametrize("policy", ["hfkern", "gpu"], ids=["hfkern", "gpu-only"])  # "gpu" alone marks CUDA tests
def test_random_event_sequences_respect_capacity_and_report_every_change(policy):
    rng = random.Random(17 if policy == "gpu" else 23)
    G = 16
    s = Autoscaler(G, gpus_per_node=4, interval=30.0, restart_cost=rng.uniform(0, 20), policy=policy)
    shadow: dict = {}           # allocations rebuilt from the decisions alone
    now, n = 0.0, 0
    for _ in range(150):
        now += rng.expovariate(1 / 10.0)
        r = rng.random()
        if r < 0.4 or not s.jobs:
            d = s.submit(random_job(rng, f"j{n}"), now)
            n += 1
        elif r < 0.7:
            d = s.finish(rng.choice(sorted(s.jobs)), now)
            shadow = {k: v for k, v in shadow.items() if k in s.jobs}
        else:
            d = s.tick(now, remaining={k: rng.uniform(0, 300) for k in s.jobs})
        assert len({x.job for x in d}) == len(d)
        for x in d:
            assert isinstance(x, Decision) and x.reason in ("arrival", "completion", "interval")
            assert x.old == shadow.get(x.job)
            assert x.old is None or (x.old.gpus, x.old.batch_size, x.old.B) != (x.new.gpus, x.new.batch_size, x.new.B)
            assert math.isfinite(x.lr_scale) and x.lr_scale > 0
            if x.new.gpus:
                shadow[x.job] = x.new
            else:
                shadow.pop(x.job, None)
        assert {k: (a.gpus, a.batch_size, a.B) for k, a in shadow.items()} == \
               {k: (a.gpus, a.batch_size, a.B) for k, a in s.allocations.items()}
        assert sum(a.gpus for a in s.allocations.values()) <= G
        assert all(a.gpus > 0 for a in s.allocations.values())
        assert set(s.allocations) <= set(s.jobs)
    assert n > 20 and len(s.solve_seconds) > 50


@pytest.mark.parametrize("finish_at,grows", [(1.0, True), (10.5, False)])
def test_remaining_time_counts_down(finish_at, grows):
    # growing a from 2 to 4 devices gains (gn - go) / gn = 0.286 of gn: worth a 10 s restart
    # only over a horizon above 35 s. a has 40.5 s left at t = 0.5.
    s = Autoscaler(4, interval=100.0, restart_cost=10.0)
    s.submit(sublinear_job("b", max_gpus=2), 0.0)
    s.submit(sublinear_job("a"), 0.0)
    s.tick(0.5, remaining={"a": 40.5})
    d = s.finish("b", finish_at)
    assert [(x.job, x.new.gpus) for x in d] == ([("a", 4)] if grows else [])


def test_horizon_defaults_to_half_an_hour_and_is_capped_by_the_remaining_time():
    s = Autoscaler(4)                                   # restart_cost 30 s, horizon 1800 s
    s.submit(sublinear_job("a"), 0.0)
    assert s.restart_factor("a") == pytest.approx(1 - 30 / 1800)
    s.tick(10.0, remaining={"a": 300.0})
    assert s.restart_factor("a") == pytest.approx(1 - 30 / 300)
    with pytest.raises(ValueError, match="horizon"):
        Autoscaler(4, horizon=0.0)
