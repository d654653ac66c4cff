"""Regression tests for defects found by fuzzing hfkern.elastic: non-finite trace parameters,
half-done Controller.submit, and input-validation gaps (errors raised before any state changes)."""

import math

import numpy as np
import pytest

from hfkern.elastic import (
    Allocation,
    Autoscaler,
    Controller,
    Efficiency,
    Executor,
    Job,
    JobSpec,
    Solution,
    ThroughputModel,
    TraceJob,
    compare,
    generate_trace,
    place,
    simulate,
)
from hfkern.elastic._trace import (
    _lognormal_clipped_mean,
    expected_gpu_seconds,
    rate_for_load,
)

MODEL = ThroughputModel(0.01, 0.001)


def make_job(name="a", batch_sizes=(16, 32), **kw):
    return Job(name, MODEL, Efficiency(batch_sizes[0], 100.0), batch_sizes, **kw)


@pytest.fixture(scope="module")
def small_trace():
    return generate_trace(3, seed=0, load=1.0, cluster_gpus=8, duration_scale=0.05)


# -- 1. generate_trace / expected_gpu_seconds with non-finite values -------------------------------
def test_clipped_lognormal_mean_without_upper_clip():
    # E[max(X, lo)] of a log-normal: finite, and the limit of ever larger upper clips
    m = _lognormal_clipped_mean(900.0, 1.5, 60.0, math.inf)
    assert math.isfinite(m)
    assert m == pytest.approx(_lognormal_clipped_mean(900.0, 1.5, 60.0, 1e15), rel=1e-12)
    # with lo tiny it is the unclipped mean e^{mu + s^2 / 2}
    assert _lognormal_clipped_mean(900.0, 1.5, 1e-300, math.inf) == pytest.approx(900.0 * math.exp(1.5 ** 2 / 2))


def test_infinite_max_duration_means_no_upper_clip():
    e = expected_gpu_seconds(max_duration=math.inf)
    assert math.isfinite(e) and e > expected_gpu_seconds()
    assert e == pytest.approx(expected_gpu_seconds(max_duration=1e15), rel=1e-12)
    for basis in ("expected", "realized"):
        tr = generate_trace(20, seed=0, load=1.0, max_duration=math.inf, load_basis=basis)
        assert math.isfinite(tr.rate) and tr.rate > 0
        arrivals = [tj.arrival for tj in tr]
        assert all(math.isfinite(a) and a > 0 for a in arrivals)
        assert arrivals == sorted(arrivals)
    # realized basis: the offered load is exactly the target
    tr = generate_trace(20, seed=0, load=1.5, cluster_gpus=64, max_duration=math.inf)
    assert tr.offered_load(64) == pytest.approx(1.5)


@pytest.mark.parametrize("kwargs, word", [
    (dict(load=math.inf), "load"),
    (dict(load=math.nan), "load"),
    (dict(rate=math.inf), "rate"),
    (dict(rate=1.0, duration_scale=math.inf), "duration_scale"),
    (dict(load=1.0, duration_scale=math.inf), "duration_scale"),
    (dict(rate=1.0, duration_scale=math.nan), "duration_scale"),
    (dict(rate=1.0, min_duration=math.inf, max_duration=math.inf), "min_duration"),
    (dict(rate=1.0, max_duration=math.nan), "max_duration"),
])
def test_trace_rejects_non_finite(kwargs, word):
    with pytest.raises(ValueError, match=word) as e:
        generate_trace(5, seed=0, **kwargs)
    assert "generate_trace" in str(e.value)


def test_expected_gpu_seconds_and_rate_for_load_reject_non_finite():
    with pytest.raises(ValueError, match="expected_gpu_seconds: expected a finite duration_scale > 0, got inf"):
        expected_gpu_seconds(duration_scale=math.inf)
    with pytest.raises(ValueError, match="rate_for_load: expected a finite load > 0, got inf"):
        rate_for_load(math.inf, 64)
    with pytest.raises(TypeError, match="rate_for_load: expected load a number, got str"):
        rate_for_load("1", 64)
    assert rate_for_load(1.0, np.int64(64)) == pytest.approx(rate_for_load(1.0, 64))


# -- 2. Controller.submit changes nothing when it raises -------------------------------------------
class FakeExecutor(Executor):
    def __init__(self):
        self.registered = []
        self.applied = []

    def register(self, spec):
        self.registered.append(spec.name)

    def launch(self, *a, **k):
        pass

    def rescale(self, *a, **k):
        pass

    def stop(self, *a, **k):
        pass

    def poll(self):
        return {}

    def shutdown(self, **k):
        pass

    def log(self, name, last=None):
        return []

    def spec(self, name):
        pass

    def apply_all(self, decisions, **k):
        self.applied += [d.job for d in decisions]


def test_controller_submit_refused_by_autoscaler_changes_nothing():
    clock = [10.0]
    scaler, ex = Autoscaler(4), FakeExecutor()
    c = Controller(scaler, ex, clock=lambda: clock[0])
    c.submit(make_job("a", (32,)), JobSpec("a", batch_size=32, total_steps=10))
    clock[0] = 5.0                                          # the clock goes back: the autoscaler refuses
    with pytest.raises(ValueError, match="now"):
        c.submit(make_job("b", (32,)), JobSpec("b", batch_size=32, total_steps=10))
    assert ex.registered == ["a"] and list(c._specs) == ["a"] and list(scaler.jobs) == ["a"]
    clock[0] = 20.0                                         # a retry goes through
    c.submit(make_job("b", (32,)), JobSpec("b", batch_size=32, total_steps=10))
    assert ex.registered == ["a", "b"] and list(c._specs) == ["a", "b"] and list(scaler.jobs) == ["a", "b"]


def test_controller_submit_of_a_job_the_autoscaler_already_has():
    scaler, ex = Autoscaler(4), FakeExecutor()
    scaler.submit(make_job("a", (32,)), 0.0)                # submitted around the controller
    c = Controller(scaler, ex, clock=lambda: 1.0)
    with pytest.raises(ValueError, match="'a' twice"):
        c.submit(make_job("a", (32,)), JobSpec("a", batch_size=32, total_steps=10))
    assert ex.registered == [] and c._specs == {}


def test_autoscaler_submit_rolls_back_a_failed_solve(monkeypatch):
    s = Autoscaler(4)
    s.submit(make_job("a"), 1.0)
    before = (dict(s.jobs), dict(s.allocations), s._now, s.last_solve)

    def boom(*a, **k):
        raise RuntimeError("solver failed")
    monkeypatch.setattr("hfkern.elastic._autoscaler.allocate", boom)
    with pytest.raises(RuntimeError, match="solver failed"):
        s.submit(make_job("b"), 2.0)
    assert (dict(s.jobs), dict(s.allocations), s._now, s.last_solve) == before


# -- 3. validation gaps ----------------------------------------------------------------------------
def test_simulate_checks_objective_under_every_policy(small_trace):
    for policy in ("fixed", "gpu", "hfkern"):
        with pytest.raises(ValueError, match=r"simulate: expected objective one of .*got 'bogus'"):
            simulate(small_trace, policy, gpus=8, objective="bogus")


def test_compare_fails_before_running_anything(small_trace, monkeypatch):
    import hfkern.elastic._simulator as sim
    ran = []
    real = sim._Sim.run

    def run(self):
        ran.append(self.policy)
        return real(self)
    monkeypatch.setattr(sim._Sim, "run", run)
    with pytest.raises(ValueError, match="objective"):
        compare(small_trace, gpus=8, objective="bogus")
    with pytest.raises(ValueError, match="lr_rule"):
        compare(small_trace, gpus=8, autoscaler_kwargs={"lr_rule": "cubic"})
    with pytest.raises(ValueError, match="compare: expected policies among .*got 'bogus'"):
        compare(small_trace, ["fixed", "bogus"], gpus=8)
    assert ran == []


@pytest.mark.parametrize("field, tj_args", [
    ("arrival", ("0", 1.0, 1.0, "x")),
    ("work", (0.0, "1", 1.0, "x")),
    ("duration", (0.0, 1.0, None, "x")),
    ("archetype", (0.0, 1.0, 1.0, 3)),
])
def test_simulate_trace_job_field_types(field, tj_args):
    a, w, d, arch = tj_args
    tj = TraceJob(a, make_job(), w, d, arch)
    with pytest.raises(TypeError, match=rf"simulate: expected trace\[0\]\.{field} a"):
        simulate([tj], "hfkern", gpus=8)


def test_simulate_autoscaler_kwargs(small_trace):
    with pytest.raises(TypeError, match=r"simulate: expected autoscaler_kwargs a mapping.*got list \[1\]"):
        simulate(small_trace, "hfkern", gpus=8, autoscaler_kwargs=[1])
    for policy in ("fixed", "gpu"):
        with pytest.raises(ValueError, match="policy.*set by simulate's own policy argument"):
            simulate(small_trace, policy, gpus=8, autoscaler_kwargs={"policy": "hfkern"})
    # the policy itself is harmless, and other kwargs still apply
    r = simulate(small_trace, "gpu", gpus=8, autoscaler_kwargs={"policy": "gpu", "lr_rule": "linear"})
    assert r.checks["ok"] and r.params["autoscaler_kwargs"] == {"policy": "gpu", "lr_rule": "linear"}


@pytest.mark.parametrize("dist, word", [
    ({1: math.inf, 2: 1.0}, "inf"), ({1: math.nan}, "nan"), ({1: -1.0}, "-1.0"),
])
def test_gpu_request_dist_non_finite(dist, word):
    want = f"gpu_request_dist: expected finite non-negative probabilities, got 1: {word}"
    with pytest.raises(ValueError, match=want):
        generate_trace(3, seed=0, load=1.0, gpu_request_dist=dist)


def test_gpu_request_dist_wrong_type():
    with pytest.raises(TypeError, match="gpu_request_dist: .*got 1: str '1'"):
        generate_trace(3, seed=0, load=1.0, gpu_request_dist={1: "1"})


def test_generate_trace_accepts_numpy_numbers():
    ref = generate_trace(5, seed=0, load=1.0, cluster_gpus=16)
    assert generate_trace(5, seed=0, load=1.0, cluster_gpus=np.int64(16)) == ref
    assert generate_trace(5, seed=0, load=np.float64(1.0), cluster_gpus=16) == ref
    assert generate_trace(5, seed=0, rate=np.float32(0.5)).rate == pytest.approx(0.5)
    d = generate_trace(5, seed=0, load=1.0, gpu_request_dist={1: np.float32(0.5), 2: np.float64(0.5)})
    assert {tj.job.requested_gpus for tj in d} <= {1, 2}


@pytest.mark.parametrize("kwargs, word", [
    (dict(seed="x", load=1.0), "seed"),
    (dict(seed=1.5, load=1.0), "seed"),
    (dict(load="1"), "load"),
    (dict(rate="1"), "rate"),
    (dict(load=1.0, cluster_gpus="16"), "cluster_gpus"),
    (dict(load=1.0, cluster_gpus=16.0), "cluster_gpus"),
    (dict(load=1.0, gpus_per_node="8"), "gpus_per_node"),
    (dict(load=1.0, max_request=2.0), "max_request"),
    (dict(load=1.0, duration_scale="1"), "duration_scale"),
])
def test_generate_trace_wrong_types_are_type_errors(kwargs, word):
    with pytest.raises(TypeError, match=f"generate_trace: expected {word}"):
        generate_trace(3, **kwargs)


def test_autoscaler_finish_non_str_name():
    s = Autoscaler(4)
    s.submit(make_job("a"), 0.0)
    for bad in (["a"], 3, None):
        with pytest.raises(TypeError, match=r"name: expected an active job's name \(a str\), got"):
            s.finish(bad, 1.0)
    assert list(s.jobs) == ["a"] and s._now == 0.0


def test_place_rejects_bad_allocation_gpus():
    neg = Solution({"a": Allocation(-2, 1, 1, 0.0), "b": Allocation(6, 1, 1, 1.0)}, 0.0, 0.0)
    with pytest.raises(ValueError, match=r"Allocation\.gpus an int >= 0 for job 'a', got -2"):
        place(neg, 4, 2)
    flt = Solution({"a": Allocation(2.0, 1, 1, 1.0)}, 0.0, 0.0)
    with pytest.raises(TypeError, match=r"Allocation\.gpus an int >= 0 for job 'a', got float 2.0"):
        place(flt, 4, 2)
    # numpy ints are ints
    assert place(Solution({"a": Allocation(np.int64(2), 1, 1, 1.0)}, 0.0, 0.0), 4, 2) == {"a": [0, 1]}


@pytest.mark.parametrize("sizes", [np.array([0, -5]), np.array([32, 0]), np.array([[16.0, math.nan]])])
def test_efficiency_rejects_non_positive_batch_arrays(sizes):
    with pytest.raises(ValueError, match="batch_size: expected batch sizes > 0"):
        Efficiency(32, 10.0)(sizes)


def test_efficiency_arrays_still_work():
    e = Efficiency(32, 1000.0)
    assert e(np.array([32, 64])) == pytest.approx([1.0, 1032 / 1064])
    with pytest.raises(ValueError, match="batch_size"):
        e(0)


def test_job_requested_gpus_needs_a_sample_per_device():
    with pytest.raises(ValueError, match="requested_gpus: expected at most the largest batch size 16"):
        Job("b", MODEL, Efficiency(16, 1.0), (16,), requested_gpus=32)
    assert Job("b", MODEL, Efficiency(16, 1.0), (16,), requested_gpus=16).requested_gpus == 16
