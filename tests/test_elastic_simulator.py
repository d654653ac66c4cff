"""Trace generator and cluster simulator of hfkern.elastic (hfkern/elastic/_trace.py, _simulator.py)."""

from __future__ import annotations

import dataclasses
import math

import numpy as np
import pytest

from hfkern.elastic import _simulator as sim_mod
from hfkern.elastic._model import Efficiency, Job, ThroughputModel
from hfkern.elastic._optimizer import Allocation
from hfkern.elastic._simulator import POLICIES, Segment, check_result, compare, simulate
from hfkern.elastic._trace import (ARCHETYPES, DURATION_MEDIAN_S, DURATION_SIGMA, GPU_REQUEST_DIST, TraceJob,
                                   expected_gpu_seconds, generate_trace, rate_for_load)


# ------------------------------------------------------------------------------------------------
# traces
# ------------------------------------------------------------------------------------------------
def _fingerprint(trace):
    return [(tj.name, tj.arrival, tj.work, tj.duration, tj.job.requested_gpus, tj.job.default_batch_size,
             tj.job.default_B, dataclasses.astuple(tj.job.model), tj.job.efficiency.noise_scale) for tj in trace]


def test_trace_reproducible_by_seed():
    a = generate_trace(60, seed=3, load=1.0, cluster_gpus=32, gpus_per_node=8)
    b = generate_trace(60, seed=3, load=1.0, cluster_gpus=32, gpus_per_node=8)
    c = generate_trace(60, seed=4, load=1.0, cluster_gpus=32, gpus_per_node=8)
    assert _fingerprint(a) == _fingerprint(b)
    assert _fingerprint(a) != _fingerprint(c)
    # same seed, another load: the same jobs, arrival times scaled by the rate ratio
    d = generate_trace(60, seed=3, load=2.0, cluster_gpus=32, gpus_per_node=8)
    assert [tj.name for tj in a] == [tj.name for tj in d]
    assert [tj.work for tj in a] == [tj.work for tj in d]
    ratio = np.array([x.arrival / y.arrival for x, y in zip(a, d)])
    np.testing.assert_allclose(ratio, 2.0, rtol=1e-9)


def test_trace_distributions_within_tolerance():
    n = 4000
    tr = generate_trace(n, seed=11, rate=0.01, cluster_gpus=64, gpus_per_node=8)
    req = np.array([tj.job.requested_gpus for tj in tr])
    for g, p in GPU_REQUEST_DIST.items():
        tol = 4 * math.sqrt(p * (1 - p) / n) + 0.005
        assert abs(np.mean(req == g) - p) < tol, (g, np.mean(req == g), p)
    # durations of one-GPU jobs: log-normal median and spread (quartiles avoid the clipped tails)
    d1 = np.log([tj.duration for tj in tr if tj.job.requested_gpus == 1])
    assert abs(np.median(d1) - math.log(DURATION_MEDIAN_S["1"])) < 0.1
    q1, q3 = np.quantile(d1, [0.25, 0.75])
    assert abs((q3 - q1) / 1.349 - DURATION_SIGMA) < 0.12
    # larger requests run longer
    d16 = np.median([tj.duration for tj in tr if tj.job.requested_gpus >= 16])
    assert d16 > 5 * math.exp(np.median(d1))
    # Poisson arrivals: exponential gaps with mean 1/rate (coefficient of variation 1)
    gaps = np.diff([0.0] + [tj.arrival for tj in tr])
    assert abs(gaps.mean() * 0.01 - 1.0) < 0.06
    assert abs(gaps.std() / gaps.mean() - 1.0) < 0.08
    # requested GPU-seconds per job against the closed form
    gd = np.mean([tj.job.requested_gpus * tj.duration for tj in tr])
    assert abs(gd / expected_gpu_seconds(max_request=64) - 1.0) < 0.3
    # work = duration x goodput at the request
    for tj in tr.jobs[:200]:
        j = tj.job
        gp = j.goodput(j.requested_gpus, j.default_batch_size, j.default_B, -(-j.requested_gpus // 8))
        assert tj.work == pytest.approx(tj.duration * gp, rel=1e-12)
        assert j.feasible(j.requested_gpus, j.default_batch_size, j.default_B)
    assert set(tj.archetype for tj in tr) == set(ARCHETYPES)


def test_trace_load():
    tr = generate_trace(200, seed=5, load=1.5, cluster_gpus=64)
    assert tr.offered_load(64) == pytest.approx(1.5, rel=1e-9)
    rate = rate_for_load(1.5, 64)
    tr2 = generate_trace(200, seed=5, load=1.5, cluster_gpus=64, load_basis="expected")
    assert tr2.rate == pytest.approx(rate)
    assert max(tj.job.requested_gpus for tj in generate_trace(300, seed=1, rate=1.0, cluster_gpus=8)) <= 8
    mem = generate_trace(200, seed=5, load=1.5, cluster_gpus=64, default_batch="memory")
    for a, b in zip(tr, mem):
        assert b.job.default_batch_size >= a.job.default_batch_size


@pytest.mark.parametrize("kwargs, err, words", [
    (dict(num_jobs=10, seed=0), ValueError, "exactly one of rate and load"),
    (dict(num_jobs=10, seed=0, rate=1.0, load=1.0), ValueError, "exactly one of rate and load"),
    (dict(num_jobs=2.5, seed=0, rate=1.0), TypeError, "num_jobs an int"),
    (dict(num_jobs=-1, seed=0, rate=1.0), ValueError, "num_jobs >= 0"),
    (dict(num_jobs=3, seed=0, rate=-1.0), ValueError, "rate > 0"),
    (dict(num_jobs=3, seed=0, rate=math.inf), ValueError, "finite rate > 0"),
    (dict(num_jobs=3, seed=0, rate=1.0, min_duration="1"), TypeError, "min_duration a number, got str"),
    (dict(num_jobs=3, seed=-2, rate=1.0), ValueError, "seed a non-negative int"),
    (dict(num_jobs=3, seed=0, rate=1.0, gpus_per_node=0), ValueError, "gpus_per_node an int >= 1"),
    (dict(num_jobs=3, seed=0, rate=1.0, default_batch="huge"), ValueError, "'typical' or 'memory'"),
    (dict(num_jobs=3, seed=0, rate=1.0, archetype_mix={"1": {"nope": 1.0}}), ValueError, "'nope'"),
])
def test_trace_validation(kwargs, err, words):
    n = kwargs.pop("num_jobs")
    with pytest.raises(err, match=words):
        generate_trace(n, **kwargs)


@pytest.mark.parametrize("kwargs", [dict(cluster_gpus=24, gpus_per_node=8), dict(cluster_gpus=12, gpus_per_node=4),
                                    dict(cluster_gpus=64, max_request=3), dict(gpu_request_dist={3: 1.0})])
def test_trace_on_clusters_of_any_size(kwargs):
    # A single training job's batch is its devices' batch: at 24 or 3 devices no allowed
    # (power-of-two) batch size, which raised; it takes the allowed size at or below it.
    trace = generate_trace(200, seed=0, load=1.0, **kwargs)
    for tj in trace:
        job = tj.job
        assert job.default_batch_size in job.batch_sizes
        if job.array_sizes == (1,) and job.max_local_batch is None:
            assert job.default_batch_size <= max(job.batch_sizes[0], 16 * 1024)


# ------------------------------------------------------------------------------------------------
# simulator bookkeeping on random traces
# ------------------------------------------------------------------------------------------------
def _small_trace(seed, n=24, load=1.5):
    return generate_trace(n, seed=seed, load=load, cluster_gpus=16, gpus_per_node=4, duration_scale=0.1,
                          max_duration=4 * 3600.0)


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_bookkeeping_random_traces(seed):
    tr = _small_trace(seed)
    results = compare(tr, gpus=16, gpus_per_node=4, interval=60.0, restart_cost=20.0)
    assert set(results) == set(POLICIES)
    for policy, res in results.items():
        assert res.checks["ok"], (policy, res.checks)
        assert res.checks["max_allocated"] <= 16
        recs = res.jobs
        assert len(recs) == len(tr)
        for tj in tr:
            r = recs[tj.name]
            assert r.finishes == 1 and r.finish is not None, (policy, tj.name)
            assert r.finish > tj.arrival and r.start >= tj.arrival
            # work recomputed here from the segments and the job's own model
            w = 0.0
            for s in r.segments:
                gp = tj.job.goodput(s.gpus, s.batch_size, s.B, -(-s.gpus // 4))
                w += gp * max(0.0, s.end - max(s.start, s.productive_from))
            assert w == pytest.approx(tj.work, rel=1e-7), (policy, tj.name)
            if policy == "fixed":
                assert len(r.segments) == 1
                assert r.finish - r.start == pytest.approx(tj.duration, rel=1e-9)
            if policy == "gpu":
                assert all((s.batch_size, s.B) == (tj.job.default_batch_size, tj.job.default_B)
                           for s in r.segments)
        # capacity from the timeline, independently of check_result
        assert max(row[1] for row in res.timeline) <= 16
        m = res.metrics()
        assert m["completed"] == len(tr) and m["makespan"] == pytest.approx(max(r.finish for r in recs.values()))
        assert 0.0 < m["productive_utilization"] <= m["utilization"] <= 1.0
        # the binned series integrates to the same utilization
        t, u = res.utilization_series(600.0)
        widths = np.minimum(t + 600.0, res.end_time) - t
        assert np.sum(u * widths) / res.end_time == pytest.approx(m["utilization"], rel=1e-9)


def test_horizon_stops_and_counts():
    tr = _small_trace(7, n=30, load=3.0)
    full = simulate(tr, "hfkern", gpus=16, gpus_per_node=4)
    cut = simulate(tr, "hfkern", gpus=16, gpus_per_node=4, horizon=tr.span)
    assert cut.end_time == pytest.approx(tr.span)
    done_cut = {r.name for r in cut.completed()}
    assert done_cut == {r.name for r in full.completed(by=tr.span)}
    assert cut.metrics()["makespan"] is None or len(done_cut) == len(tr)
    assert cut.checks["ok"]


def test_checks_detect_broken_bookkeeping():
    tr = _small_trace(1, n=10)
    res = simulate(tr, "fixed", gpus=16, gpus_per_node=4)
    assert res.checks["ok"]
    name, rec = next(iter(res.jobs.items()))
    # a second finish, an over-capacity segment and lost work must all be reported
    rec.finishes = 2
    s = rec.segments[0]
    rec.segments[0] = dataclasses.replace(s, gpus=17)
    other = list(res.jobs.values())[1]
    other.segments[-1] = dataclasses.replace(other.segments[-1], end=other.segments[-1].end - 1.0)
    bad = check_result(res, tr)
    assert not bad["ok"]
    assert bad["finished_more_than_once"] == 1
    assert bad["capacity_exceeded_segments"] >= 1
    assert bad["work_mismatches"] == 1          # the shortened segment
    assert bad["goodput_mismatches"] == 1       # 17 GPUs do not give the recorded goodput


# ------------------------------------------------------------------------------------------------
# hand-made cases
# ------------------------------------------------------------------------------------------------
def _job(name, requested, *, max_gpus=None, beta=0.01):
    """A job with perfectly linear scaling: step = beta * local batch, so goodput = g / beta."""
    return Job(name=name, model=ThroughputModel(alpha_grad=0.0, beta_grad=beta),
               efficiency=Efficiency(base_batch_size=64, noise_scale=100.0), batch_sizes=(64,),
               requested_gpus=requested, max_gpus=max_gpus)


def _tj(name, arrival, requested, duration, **kw):
    job = _job(name, requested, **kw)
    work = duration * job.goodput(requested, 64, 1, 1)
    return TraceJob(arrival=arrival, job=job, work=work, duration=duration, archetype="hand")


def _hand_trace():
    return [_tj("A", 0.0, 3, 100.0), _tj("B", 10.0, 2, 50.0), _tj("C", 20.0, 1, 30.0), _tj("D", 25.0, 1, 200.0)]


def test_fixed_hand_case_easy_backfill():
    # 4 GPUs. A (3 GPUs) runs 0-100. B (2 GPUs) waits for A: reservation at t=100 with 2 spare GPUs.
    # C (1 GPU, ends at 50 < 100) backfills at 20. D (1 GPU, ends after 100) waits for the free
    # GPU at 50 and backfills on the reservation's spare GPUs. B runs 100-150.
    res = simulate(_hand_trace(), "fixed", gpus=4, gpus_per_node=4)
    jct = {n: r.jct for n, r in res.jobs.items()}
    assert jct == pytest.approx({"A": 100.0, "B": 140.0, "C": 30.0, "D": 225.0})
    assert res.metrics()["makespan"] == pytest.approx(250.0)
    busy = 3 * 100 + 2 * 50 + 1 * 30 + 1 * 200
    assert res.metrics()["utilization"] == pytest.approx(busy / (4 * 250.0))


def test_fixed_hand_case_strict_fifo():
    # No backfilling: C and D wait behind B; at 100 B, C and D all start (2 + 1 + 1 GPUs).
    res = simulate(_hand_trace(), "fixed", gpus=4, gpus_per_node=4, backfill="none")
    jct = {n: r.jct for n, r in res.jobs.items()}
    assert jct == pytest.approx({"A": 100.0, "B": 140.0, "C": 110.0, "D": 275.0})
    # greedy backfilling without a reservation: C at 20, D at 50 (as EASY here)
    res = simulate(_hand_trace(), "fixed", gpus=4, gpus_per_node=4, backfill="greedy")
    jct = {n: r.jct for n, r in res.jobs.items()}
    assert jct == pytest.approx({"A": 100.0, "B": 140.0, "C": 30.0, "D": 225.0})


@pytest.mark.parametrize("policy", ["gpu", "hfkern"], ids=["devices-only", "devices-batch-B"])
def test_elastic_hand_case_no_contention(policy):
    # 8 GPUs, two linearly scaling jobs allowed 4 GPUs each: each runs on 4 from its arrival,
    # never rescaled; duration at its request (1 GPU) is 400 s and 200 s -> 100 s and 50 s.
    trace = [_tj("A", 0.0, 1, 400.0, max_gpus=4), _tj("B", 30.0, 1, 200.0, max_gpus=4)]
    res = simulate(trace, policy, gpus=8, gpus_per_node=8, restart_cost=10.0)
    assert res.jobs["A"].jct == pytest.approx(100.0)
    assert res.jobs["B"].jct == pytest.approx(50.0)
    assert all(r.restarts == 0 for r in res.jobs.values())
    assert res.checks["ok"]


class _ScriptedScaler:
    """An autoscaler stand-in whose allocations follow a script of (time, {job: gpus})."""

    def __init__(self, script):
        self.script = script
        self.allocations = {}
        self.calls = []
        self.done = set()

    def _set(self, now):
        for t, alloc in self.script:
            if t <= now:
                self.allocations = {n: Allocation(g, 64, 1, 0.0) for n, g in alloc.items()
                                    if g > 0 and n not in self.done}
        return []

    def submit(self, job, now):
        self.calls.append(("submit", job.name, now))
        return self._set(now)

    def finish(self, name, now):
        self.calls.append(("finish", name, now))
        self.done.add(name)
        return self._set(now)

    def tick(self, now, remaining=None):
        self.calls.append(("tick", None, now))
        return self._set(now)


def test_restart_cost_hand_case(monkeypatch):
    # A job of 1000 GPU-seconds (linear scaling). 1 GPU from 0; at the tick at 60 s it is resized
    # to 4 GPUs and loses 30 s: 60 s of 1-GPU progress, then (1000 - 60) / 4 = 235 s after the
    # restart -> finishes at 60 + 30 + 235 = 325. A second job arriving at 100 gets 0 until 200,
    # when A is preempted: A resumes at 260 with another 30 s restart.
    scaler = _ScriptedScaler([(0.0, {"A": 1})])
    monkeypatch.setattr(sim_mod, "_make_scaler", lambda *a, **k: scaler)
    res = simulate([_tj("A", 0.0, 1, 1000.0)], "hfkern", gpus=4, gpus_per_node=4, interval=60.0,
                   restart_cost=30.0)
    assert res.jobs["A"].finish == pytest.approx(1000.0)     # never resized: 1000 s on 1 GPU

    scaler = _ScriptedScaler([(0.0, {"A": 1}), (60.0, {"A": 4})])
    monkeypatch.setattr(sim_mod, "_make_scaler", lambda *a, **k: scaler)
    res = simulate([_tj("A", 0.0, 1, 1000.0)], "hfkern", gpus=4, gpus_per_node=4, interval=60.0,
                   restart_cost=30.0)
    r = res.jobs["A"]
    assert r.finish == pytest.approx(325.0)
    assert r.restarts == 1 and len(r.segments) == 2
    assert res.metrics()["productive_utilization"] < res.metrics()["utilization"]

    # preempted at 180 (tick), resumed at 240 on 4 GPUs: 60 + (180 - 90) * 4 = 420 done by 180,
    # 580 left at 4/s after the restart at 240 + 30 -> 270 + 145 = 415
    scaler = _ScriptedScaler([(0.0, {"A": 1}), (60.0, {"A": 4}), (180.0, {}), (240.0, {"A": 4})])
    monkeypatch.setattr(sim_mod, "_make_scaler", lambda *a, **k: scaler)
    res = simulate([_tj("A", 0.0, 1, 1000.0)], "hfkern", gpus=4, gpus_per_node=4, interval=60.0,
                   restart_cost=30.0)
    r = res.jobs["A"]
    assert r.finish == pytest.approx(415.0)
    assert (r.restarts, r.preemptions) == (2, 1)
    assert res.checks["ok"]
    assert [c[0] for c in scaler.calls].count("finish") == 1


def test_overcommitting_scaler_is_reported(monkeypatch):
    scaler = _ScriptedScaler([(0.0, {"A": 3, "B": 3})])
    monkeypatch.setattr(sim_mod, "_make_scaler", lambda *a, **k: scaler)
    res = simulate([_tj("A", 0.0, 1, 100.0), _tj("B", 0.0, 1, 100.0)], "hfkern", gpus=4, gpus_per_node=4)
    assert not res.checks["ok"]
    assert res.checks["capacity_exceeded_events"] >= 1 and res.checks["capacity_exceeded_segments"] >= 1


# ------------------------------------------------------------------------------------------------
# the three policies, and input validation
# ------------------------------------------------------------------------------------------------
def test_three_policies_run_and_elastic_helps_at_light_load():
    tr = generate_trace(40, seed=2, load=0.5, cluster_gpus=32, gpus_per_node=8, duration_scale=0.2)
    res = compare(tr, gpus=32, gpus_per_node=8)
    m = {p: r.metrics() for p, r in res.items()}
    for p in POLICIES:
        assert res[p].checks["ok"], (p, res[p].checks)
        assert m[p]["completed"] == 40
        assert m[p]["jct_median"] <= m[p]["jct_mean"] or m[p]["jct_median"] == pytest.approx(m[p]["jct_mean"])
    # idle devices and batch-size elasticity: hfkern finishes jobs faster than the fixed policy
    assert m["hfkern"]["jct_mean"] < m["fixed"]["jct_mean"]
    assert sum(res["fixed"].decisions.values()) == 0 and sum(res["hfkern"].decisions.values()) > 0


@pytest.mark.parametrize("kwargs, err, words", [
    (dict(policy="pollux", gpus=8), ValueError, "policy one of"),
    (dict(policy="fixed", gpus=8.0), TypeError, "gpus an int"),
    (dict(policy="fixed", gpus=12, gpus_per_node=8), ValueError, "multiple of gpus_per_node"),
    (dict(policy="fixed", gpus=8, interval=0.0), ValueError, "interval a finite number > 0"),
    (dict(policy="fixed", gpus=8, restart_cost=-1.0), ValueError, "restart_cost"),
    (dict(policy="fixed", gpus=8, backfill="conservative"), ValueError, "backfill one of"),
    (dict(policy="fixed", gpus=2, gpus_per_node=2), ValueError, "requests 3 GPUs"),
])
def test_simulate_validation(kwargs, err, words):
    policy = kwargs.pop("policy")
    with pytest.raises(err, match=words):
        simulate(_hand_trace(), policy, **kwargs)


def test_simulate_rejects_bad_traces():
    with pytest.raises(TypeError, match="Trace or a sequence of TraceJob"):
        simulate(42, "fixed", gpus=8)
    with pytest.raises(TypeError, match="TraceJob"):
        simulate([("A", 0.0)], "fixed", gpus=8)
    dup = [_tj("A", 0.0, 1, 10.0), _tj("A", 5.0, 1, 10.0)]
    with pytest.raises(ValueError, match="unique job names"):
        simulate(dup, "fixed", gpus=8)
    with pytest.raises(TypeError, match="sequence of policy names"):
        compare(_hand_trace(), "fixed", gpus=4)


def test_segment_work():
    s = Segment(start=10.0, end=50.0, gpus=2, batch_size=64, B=1, goodput=3.0, productive_from=20.0)
    assert s.productive_seconds == 30.0 and s.work == 90.0
    s = Segment(start=10.0, end=15.0, gpus=2, batch_size=64, B=1, goodput=3.0, productive_from=20.0)
    assert s.work == 0.0
