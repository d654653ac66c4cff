"""Arrays in flight: InFlight runs several arrays' steps together, and the cost model measures
what that costs against one after another (the search uses it where it was profiled)."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from torch import nn

import hfkern
import hfkern.plan as hp
from hfkern.plan._cost import Profile, fit_profiles, profile_step


def _mlp() -> nn.Module:
    return nn.Sequential(nn.Linear(12, 32), nn.LayerNorm(32), nn.ReLU(), nn.Linear(32, 5))


def _arrays(k: int, B: int, device: str = "cpu", seed: int = 0):
    """k fused arrays of B models, each with Adam and its training step."""
    torch.manual_seed(seed)
    strategy = hp.Strategy(B=B)
    out = []
    for _ in range(k):
        model = hfkern.fuse(_mlp, B).to(device)
        hp.apply(model, strategy)
        opt = hfkern.optim.Adam(model.parameters(), lr=1e-2)
        out.append((model, hp.make_step(model, opt, strategy, hfkern.nn.functional.cross_entropy)))
    return out


def _run_together_and_alone(device: str) -> None:
    together, alone = _arrays(2, 3, device), _arrays(2, 3, device)
    flight = hp.InFlight([s for _, s in together])
    g = torch.Generator().manual_seed(1)
    for _ in range(4):
        batches = [(torch.randn(16, 12, generator=g).to(device), torch.randint(0, 5, (16,), generator=g).to(device))
                   for _ in range(2)]
        got = flight(batches=batches)
        want = [step(x, y) for (_, step), (x, y) in zip(alone, batches)]
        for a, b in zip(got, want):
            torch.testing.assert_close(a, b, rtol=0, atol=0)
    for (m1, _), (m2, _) in zip(together, alone):
        for p1, p2 in zip(m1.parameters(), m2.parameters()):
            torch.testing.assert_close(p1, p2, rtol=0, atol=0)


def test_in_flight_steps_equal_each_array_alone():
    _run_together_and_alone("cpu")


@pytest.mark.gpu
def test_gpu_in_flight_streams_equal_each_array_alone():
    _run_together_and_alone("cuda")


def test_in_flight_shared_batch_and_bad_calls():
    arrays = _arrays(2, 2)
    flight = hp.InFlight([s for _, s in arrays])
    x, y = torch.randn(8, 12), torch.randint(0, 5, (8,))
    losses = flight(x, y)
    assert len(losses) == 2 and all(t.shape == (2,) for t in losses)
    with pytest.raises(ValueError, match="one batch per array"):
        flight(batches=[(x, y)])
    with pytest.raises(TypeError, match="either"):
        flight(x, y, batches=[(x, y), (x, y)])
    with pytest.raises(TypeError, match="shared by the arrays"):
        flight(x)
    with pytest.raises(TypeError, match="step callables"):
        hp.InFlight([])


def test_profile_of_two_arrays_in_flight_measures_both():
    x, y = torch.randn(32, 12), torch.randint(0, 5, (32,))
    kw = dict(optimizer=lambda ps: torch.optim.SGD(ps, lr=0.1), loss_fn=hfkern.nn.functional.cross_entropy,
              device=torch.device("cpu"), steps=2, warmup=1, measure_blocks=False)
    # The larger peak of two measurements each: the profiler's memory events have come out short
    # of a step's allocations, rarely, in full test runs.
    one = max((profile_step(_mlp, (x, y), hp.Strategy(B=4), **kw) for _ in range(2)), key=lambda p: p.peak)
    two = max((profile_step(_mlp, (x, y), hp.Strategy(B=4, arrays=2), **kw) for _ in range(2)),
              key=lambda p: p.peak)
    assert two.persistent == pytest.approx(2 * one.persistent)
    assert two.gradients == pytest.approx(2 * one.gradients)
    # One after another (the CPU), the second array's activations reuse the first's memory: the
    # peak is one step's plus the second array's persistent bytes, well under twice one's.
    assert one.peak + 0.9 * one.persistent <= two.peak < 2 * one.peak


def _synthetic(B: int, arrays: int = 1) -> Profile:
    """One block; two arrays together take 1.2x one array's step (not 2x) and 1.9x its memory."""
    step, peak = 0.1 + 0.05 * B, 1000.0 + 100.0 * B
    if arrays == 2:
        step, peak = 1.2 * step, 1.9 * peak
    return Profile(hp.Strategy(B=B, arrays=arrays), step_time=step, optimizer_time=0.01,
                   forward_time={"a": 0.03 * B}, saved={"a": 50.0 * B}, inputs={"a": 5.0 * B},
                   persistent=300.0 * B, gradients=100.0 * B, peak=peak)


def test_fit_and_search_use_the_measured_in_flight_factors():
    model = fit_profiles([_synthetic(B, k) for B in (1, 2, 4) for k in (1, 2)])
    for B in (3, 8):
        tf, mf = model.in_flight(B, "fp32", 1, "auto", 2)
        assert tf == pytest.approx(0.6) and mf == pytest.approx(0.95)
        t1, m1 = model.predict(hp.Strategy(B=B))
        t2, m2 = model.predict(hp.Strategy(B=B, arrays=2))
        assert t2 == pytest.approx(1.2 * t1) and m2 == pytest.approx(1.9 * m1)
    assert model.in_flight(4, "fp32", 1, "auto", 3) is None       # not profiled: one after another
    t3, m3 = model.predict(hp.Strategy(B=4, arrays=3))
    assert (t3, m3) == pytest.approx((3 * model.predict(hp.Strategy(B=4))[0], 3 * model.predict(hp.Strategy(B=4))[1]))
    # The search: 8 trials as two arrays of 4 in flight take one round at 1.2x a step of one array.
    front = hp.search(model, trials=8, steps=10, B_values=[4], arrays=(1, 2))
    by_k = {p.arrays: p for p in front}
    single = model.predict(hp.Strategy(B=4))[0]
    assert by_k[2].time == pytest.approx(10 * 1.2 * single) and by_k[1].time == pytest.approx(2 * 10 * single)
    with pytest.raises(ValueError, match="recompute nothing"):
        fit_profiles([dataclasses.replace(_synthetic(1, 2), strategy=hp.Strategy(B=1, arrays=2, recompute=("a",)))])
