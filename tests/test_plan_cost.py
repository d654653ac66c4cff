"""hfkern.plan's cost model: the fit on synthetic profiles with known lines, and on a real model
(the predictions at array sizes it was not fitted on, against measurement, on this CPU)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from hfkern.plan._cost import Profile, fit_cost_model, fit_profiles, profile_step, profile_together
from hfkern.plan._strategy import Strategy


def synthetic(B: int, precision: str = "fp32") -> Profile:
    """Known lines: blocks a and b, a backward twice the forward, a linear optimizer and memory."""
    slow = 2.0 if precision == "bf16" else 1.0
    fwd = {"a": (0.1 + 0.2 * B) * slow, "b": 0.3 * B * slow}
    opt = 0.05 + 0.01 * B
    saved = {"a": 100.0 * B, "b": 50.0 + 200.0 * B}
    return Profile(Strategy(B=B, precision=precision), step_time=3 * sum(fwd.values()) + opt, optimizer_time=opt,
                   forward_time=fwd, saved=saved, inputs={"a": 10.0 * B, "b": 20.0 * B}, persistent=400.0 * B,
                   gradients=100.0 * B, peak=1000.0 + 500.0 * B + sum(saved.values()))


def test_fit_recovers_known_lines_and_extrapolates():
    model = fit_profiles([synthetic(B, p) for B in (1, 2, 4) for p in ("fp32", "bf16")])
    assert model.blocks == ["a", "b"]
    for precision, slow in (("fp32", 1.0), ("bf16", 2.0)):
        for B in (3, 8, 32):  # between and beyond the fitted sizes
            p = synthetic(B, precision)
            t, m = model.predict(Strategy(B=B, precision=precision))
            assert t == pytest.approx(p.step_time) and m == pytest.approx(p.peak)
            cost = model.step_cost(B, precision, 1, "auto")
            a, b = cost.blocks
            assert a.time == pytest.approx(3 * p.forward_time["a"]) and a.recompute_time == pytest.approx(
                p.forward_time["a"])
            assert b.saved == pytest.approx(p.saved["b"]) and b.saved_recompute == pytest.approx(p.inputs["b"])
            # Recomputing block b: its forward again; its inputs kept, and its activations exist
            # again (on top of them) only during its backward.
            t_rc, m_rc = model.predict(Strategy(B=B, precision=precision, recompute=("b",)))
            assert t_rc == pytest.approx(p.step_time + p.forward_time["b"])
            static = p.peak - sum(p.saved.values())
            assert m_rc == pytest.approx(static + p.saved["a"] + p.inputs["b"] + p.saved["b"])


def test_measured_recomputation_of_one_block_calibrates_its_cost():
    """Profiles with block b recomputed alone: it costs 0.5 s + 0.25 s * B more, and its peak is the
    plain step's less all b saved plus 30 bytes * B; the model gives both back at other B."""
    import dataclasses

    profiles = []
    for B in (1, 2, 4):
        p = synthetic(B)
        kept = 30.0 * B
        profiles += [p, dataclasses.replace(p, strategy=Strategy(B=B, recompute=("b",)),
                                            step_time=p.step_time + 0.5 + 0.25 * B,
                                            peak=p.peak - p.saved["b"] + kept)]
    model = fit_profiles(profiles)
    for B in (3, 10):
        p = synthetic(B)
        t, m = model.predict(Strategy(B=B, recompute=("b",)))
        assert t == pytest.approx(p.step_time + 0.5 + 0.25 * B)
        static = p.peak - sum(p.saved.values())
        assert m == pytest.approx(static + p.saved["a"] + 30.0 * B)
        b = model.step_cost(B, "fp32", 1, "auto").blocks[1]
        assert b.recompute_time == pytest.approx(0.5 + 0.25 * B)
        # its inputs kept (20 bytes * B), and 10 bytes * B more while its backward runs
        assert b.saved_recompute == pytest.approx(20.0 * B) and b.transient == pytest.approx(10.0 * B)


def test_memory_the_hooks_miss_is_calibrated_from_single_recomputations():
    """Blocks a and b hold more than the hooks see (an autograd function keeping tensors on its
    context), as PointNet's two transform networks do: recomputed alone, each frees its true bytes
    (its peak is at the end of the forward), which bound its saved bytes from below, while the
    backward of its recomputation holds only what the hooks see. The model must predict every set
    of recomputed blocks, the pair included, from the single profiles."""
    import dataclasses

    names = ("a", "b", "c")
    true_saved = {"a": 100.0, "b": 100.0, "c": 30.0}    # bytes per model
    seen = {"a": 40.0, "b": 20.0, "c": 30.0}            # what saved_tensors_hooks report
    # Who holds what the hooks see: a's input is the batch (held anyway); b's input (5 of a's 40
    # bytes: a ReLU's output that a saves) and c's (5 of b's) are each kept by the next block's
    # recomputation, so they are freed only when both blocks recompute.
    held = lambda B: (((("a",), ("b",), 5.0 * B)), (("a",), (), 35.0 * B),  # noqa: E731
                      (("b",), ("c",), 5.0 * B), (("b",), (), 15.0 * B), (("c",), (), 30.0 * B))

    def peak(B, recompute):
        static = 1000.0 + 500.0 * B
        kept = {n: 0.0 if n in recompute else true_saved[n] * B for n in names}
        for n, before in (("b", "a"), ("c", "b")):  # an input kept that the block before no longer saves
            if n in recompute and before in recompute:
                kept[n] += 5.0 * B
        # While a recomputed block's backward runs: what it (its input) and the blocks before it keep.
        during = [sum(kept[k] for k in names[:names.index(n) + 1]) + seen[n] * B for n in recompute]
        return static + max([sum(kept.values()), *during])

    profiles = []
    for B in (1, 2, 4):
        plain = Profile(Strategy(B=B), step_time=1.0, optimizer_time=0.1,
                        forward_time={"a": 0.2, "b": 0.3, "c": 0.1}, saved={n: seen[n] * B for n in names},
                        inputs={n: 5.0 * B for n in names}, persistent=400.0 * B, gradients=100.0 * B,
                        peak=peak(B, ()), held=held(B))
        profiles.append(plain)
        for n in names:
            profiles.append(dataclasses.replace(plain, strategy=Strategy(B=B, recompute=(n,)), peak=peak(B, (n,))))
    assert_every_subset_predicted(fit_profiles(profiles), names, peak)


def assert_every_subset_predicted(model, names, peak, B_values=(3, 8)) -> None:
    """The model's peak of every set of recomputed blocks, at array sizes it was not fitted on,
    is ``peak(B, recompute)``."""
    import itertools

    for B in B_values:
        for k in range(len(names) + 1):
            for recompute in itertools.combinations(names, k):
                _, m = model.predict(Strategy(B=B, recompute=recompute))
                assert m == pytest.approx(peak(B, recompute)), (B, recompute)


def test_all_blocks_recomputed_bound_what_the_backward_of_each_holds():
    """Block a recomputed alone leaves the peak at the end of the forward, which hides what its
    recomputation's backward holds (here half of what it saves: the step's large gradients are
    freed by then). The model took all it saves, and predicted a and b recomputed together 50%
    high (PointNet's transform networks, 16%). The profile of every block recomputed bounds it.
    The time that profile adds is shared out in proportion to the single ones'."""
    import dataclasses

    names = ("a", "b", "c")
    saved = {"a": 100.0, "b": 100.0, "c": 30.0}
    backward = {"a": 50.0, "b": 40.0, "c": 30.0}  # what each recomputed block's backward holds
    rc_time = {"a": 0.3, "b": 0.1, "c": 0.2}  # per model, measured alone (noisy: 10% high)

    def peak(B, recompute):
        static = 1000.0 + 500.0 * B
        kept = {n: 0.0 if n in recompute else saved[n] * B for n in names}
        during = [sum(kept[k] for k in names[:names.index(n)]) + backward[n] * B for n in recompute]
        return static + max([sum(kept.values()), *during])

    def step_time(B, recompute):
        return B * (1.0 + sum(rc_time[n] for n in recompute) / (1.1 if len(recompute) > 1 else 1.0))

    profiles = []
    for B in (1, 2, 4):
        plain = Profile(Strategy(B=B), step_time=step_time(B, ()), optimizer_time=0.1 * B,
                        forward_time={"a": 0.2 * B, "b": 0.3 * B, "c": 0.1 * B},
                        saved={n: saved[n] * B for n in names}, inputs={n: 0.0 for n in names},
                        persistent=400.0 * B, gradients=100.0 * B, peak=peak(B, ()),
                        held=tuple(((n,), (), saved[n] * B) for n in names))
        profiles.append(plain)
        for chosen in [(n,) for n in names] + [names]:
            profiles.append(dataclasses.replace(plain, strategy=Strategy(B=B, recompute=chosen),
                                                peak=peak(B, chosen), step_time=step_time(B, chosen)))
    model = fit_profiles(profiles)
    assert_every_subset_predicted(model, names, peak)
    for B in (3, 8):
        t, _ = model.predict(Strategy(B=B, recompute=names))
        assert t == pytest.approx(step_time(B, names))
        t, _ = model.predict(Strategy(B=B, recompute=("a",)))
        assert t == pytest.approx(B * (1.0 + 0.3 / 1.1))  # scaled as all of them were
    # Without the profile of all of them, a's backward is taken as all it saves.
    model = fit_profiles([p for p in profiles if len(p.strategy.recompute) < 2])
    _, m = model.predict(Strategy(B=4, recompute=("a", "b")))
    assert m == pytest.approx(1000.0 + 500.0 * 4 + 100.0 * 4)


def test_fit_checks_its_profiles():
    with pytest.raises(ValueError, match="needs two array sizes"):
        fit_profiles([synthetic(2)])
    with pytest.raises(ValueError, match="recomputes 'c', not a block"):
        fit_profiles([synthetic(1), synthetic(2), dataclasses_replace(synthetic(2), recompute=("a", "c"))])
    import dataclasses

    with pytest.raises(ValueError, match=r"held by \['c'\], not blocks of \['a', 'b'\]"):
        fit_profiles([synthetic(1), dataclasses.replace(synthetic(2), held=((("a",), ("c",), 1.0),))])
    with pytest.raises(ValueError, match="recomputes 'c', not a block"):
        fit_profiles([synthetic(1), synthetic(2), dataclasses_replace(synthetic(2), recompute=("c",))])
    model = fit_profiles([synthetic(1), synthetic(2)])
    with pytest.raises(ValueError, match="no profile of precision='bf16'"):
        model.step_cost(4, "bf16", 1, "auto")


def dataclasses_replace(p: Profile, **strategy_changes) -> Profile:
    import dataclasses

    return dataclasses.replace(p, strategy=dataclasses.replace(p.strategy, **strategy_changes))


def mlp() -> nn.Module:
    return nn.Sequential(nn.Linear(32, 256), nn.LayerNorm(256), nn.ReLU(), nn.Linear(256, 256), nn.ReLU(),
                         nn.Linear(256, 10))


def test_measured_profile_sees_every_block_and_the_saved_activations():
    x, y = torch.randn(64, 32), torch.randint(0, 10, (64,))
    p = profile_step(mlp, (x, y), Strategy(B=4), optimizer=lambda ps: torch.optim.SGD(ps, lr=0.1),
                     loss_fn=__import__("hfkern").nn.functional.cross_entropy, device=torch.device("cpu"))
    assert set(p.forward_time) == {"0", "1", "3", "5"}  # the blocks with parameters
    # The step is timed without the hooks, the blocks' forwards with them: both measured, not compared.
    assert all(t > 0 for t in p.forward_time.values()) and p.step_time > 0 and 0 < p.optimizer_time < p.step_time
    # Linear 0 saves its input [64, 32] (shared, once) and its weight; LayerNorm 1 its input [4, 64, 256].
    assert p.saved["1"] >= 4 * 64 * 256 * 4
    assert p.inputs["3"] >= 4 * 64 * 256 * 4
    assert p.peak > p.persistent + p.gradients


@pytest.mark.long
def test_memory_prediction_at_unfitted_B_within_ten_percent():
    """Fitted at B = 2, 4, 8; the peak at B = 12 and 16 predicted within 10% of its measurement."""
    x, y = torch.randn(64, 32), torch.randint(0, 10, (64,))
    kw = dict(optimizer=lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9), device="cpu", steps=2, warmup=1)
    import hfkern

    # The profiler's memory events have come out short of a step's allocations, rarely, in full
    # test runs (a measured peak 12% low once; a fitted one 11% low once, which made a prediction
    # 11% short), never long: the larger of two measurements, and a second fit where the first
    # misses.
    peaks = {B: max(profile_step(mlp, (x, y), Strategy(B=B), loss_fn=hfkern.nn.functional.cross_entropy,
                                 device=torch.device("cpu"), optimizer=kw["optimizer"], steps=2, warmup=1,
                                 measure_blocks=False).peak for _ in range(2)) for B in (12, 16)}
    for attempt in range(2):
        model = fit_cost_model(mlp, (x, y), B_values=(2, 4, 8), **kw)
        errors = {B: (model.predict(Strategy(B=B))[1] - peak) / peak for B, peak in peaks.items()}
        if all(abs(e) < 0.10 for e in errors.values()):
            break
    assert all(abs(e) < 0.10 for e in errors.values()), (errors, peaks)


def test_profile_together_times_the_strategies_in_rotated_rounds():
    """After each strategy's warm-up, round r times one step of each, starting from strategy r mod n;
    the blocks and peaks are measured afterwards, in order. Seen through the loss's calls (its B)."""
    import hfkern

    calls = []

    def loss(out, y):
        calls.append(out.shape[0])
        return hfkern.nn.functional.cross_entropy(out, y)

    x, y = torch.randn(16, 32), torch.randint(0, 10, (16,))
    strategies = [Strategy(B=1), Strategy(B=2), Strategy(B=3)]
    profiles = profile_together(mlp, (x, y), strategies, optimizer=lambda ps: torch.optim.SGD(ps, lr=0.1),
                                loss_fn=loss, device=torch.device("cpu"), steps=3, warmup=2,
                                measure_blocks=[True, False, False])
    assert [p.strategy for p in profiles] == strategies
    warm, rounds, after = calls[:6], calls[6:15], calls[15:]
    assert warm == [1, 1, 2, 2, 3, 3]
    assert rounds == [1, 2, 3, 2, 3, 1, 3, 1, 2]
    assert after == [1, 1, 1, 1, 2, 3]  # B = 1: 3 hooked steps and its peak; the others: their peak
    assert set(profiles[0].forward_time) == {"0", "1", "3", "5"} and not profiles[1].forward_time


class Drifting:
    """A loss on a device whose speed changes mid-profile: its first ``slow`` calls take
    ``SLOW`` seconds more, the later ones ``FAST`` more."""

    SLOW, FAST = 0.2, 0.002

    def __init__(self, slow: int):
        self.calls, self.slow = 0, slow

    def __call__(self, out, y):
        import hfkern

        self.calls += 1
        __import__("time").sleep(self.SLOW if self.calls <= self.slow else self.FAST)
        return hfkern.nn.functional.cross_entropy(out, y)


def test_strategies_timed_together_see_the_same_device():
    """Two identical strategies, the device 100x slower for its first 6 steps: timed in rounds,
    each sees 2 slow steps of 7 and both medians are the fast device's (timed strategy after
    strategy, the first would see 4 slow steps of 7, a slow median); timed one after the other
    under the same drift, the first sees mostly the slow device and the second only the fast one.

    The bounds leave room for a loaded machine (parallel tests): the sleep bounds a step from
    below, a small MLP's step stays far under the slow sleep, and a median of seven with two slow
    steps survives one more stall."""
    x, y = torch.randn(4, 32), torch.randint(0, 10, (4,))
    kw = dict(optimizer=lambda ps: torch.optim.SGD(ps, lr=0.1), device=torch.device("cpu"), warmup=1,
              measure_blocks=False)
    drift = Drifting(slow=2 + 4)  # both warm-ups, then the first 2 of the 7 rounds (a step of each)
    a, b = profile_together(mlp, (x, y), [Strategy(B=2), Strategy(B=2)], steps=7, loss_fn=drift, **kw)
    assert max(a.step_time, b.step_time) < Drifting.SLOW / 2, (a.step_time, b.step_time)
    drift = Drifting(slow=2 + 4)  # the same drift: a's warm-up and 5 of its 7 steps
    a = profile_step(mlp, (x, y), Strategy(B=2), steps=7, loss_fn=drift, **kw)
    b = profile_step(mlp, (x, y), Strategy(B=2), steps=7, loss_fn=drift, **kw)
    assert a.step_time >= Drifting.SLOW > 2 * b.step_time, (a.step_time, b.step_time)


def test_the_drift_between_array_sizes_is_taken_out_of_the_fit():
    """The device is 100x slower while B = 1's strategies are profiled than for the rest: the plain
    steps of every B, timed together afterwards, scale each B's times, so B = 1 is fitted at the
    fast device's time as B = 2 is; unscaled, B = 1's step would take the slow sleep or more."""
    x, y = torch.randn(4, 32), torch.randint(0, 10, (4,))
    # B = 1's group: 1 warm-up, 4 timed steps, 4 hooked steps and the peak's step.
    drift = Drifting(slow=1 + 4 + 4 + 1)
    model = fit_cost_model(mlp, (x, y), optimizer=lambda ps: torch.optim.SGD(ps, lr=0.1), loss_fn=drift,
                           device="cpu", B_values=(1, 2), steps=4, warmup=1, recompute=False)
    assert drift.calls == 2 * 10 + 2 * (1 + 4)  # the two groups, then the plain steps timed together
    one, two = (p.step_time for p in model.profiles)
    assert max(one, two) < Drifting.SLOW / 2, (one, two)  # both the fast device's


def test_without_interleaving_one_strategy_is_profiled_at_a_time():
    """interleave=False: each strategy's steps run together (warm-up, timed, hooked, its peak's),
    one array alive at a time, and nothing is timed again across B."""
    import hfkern

    calls = []

    def loss(out, y):
        calls.append(out.shape[0])
        return hfkern.nn.functional.cross_entropy(out, y)

    x, y = torch.randn(16, 32), torch.randint(0, 10, (16,))
    kw = dict(optimizer=lambda ps: torch.optim.SGD(ps, lr=0.1), loss_fn=loss, device="cpu", B_values=(1, 2),
              steps=2, warmup=1)
    model = fit_cost_model(mlp, (x, y), recompute=False, interleave=False, **kw)
    assert calls == [1] * 6 + [2] * 6
    assert [p.strategy.B for p in model.profiles] == [1, 2] and model.predict(Strategy(B=3))[0] > 0
    with pytest.raises(TypeError, match="interleave must be a bool"):
        fit_cost_model(mlp, (x, y), interleave="no", **kw)


@pytest.mark.parametrize("interleave", [True, False])
def test_a_default_size_that_does_not_fit_the_device_is_left_out_with_a_warning(monkeypatch, interleave):
    """The default sizes past 8 (16 on CUDA) may not fit a device: their profiles running out of
    memory leave that size out, with a warning; sizes the caller chose, or 8 and below, raise."""
    import hfkern.plan._cost as cost

    real = cost.profile_together

    def tight(factory, batch, strategies, **kw):          # a device that holds arrays of B < 16
        if any(s.B >= 16 for s in strategies):
            raise torch.OutOfMemoryError("CUDA out of memory (simulated)")
        return real(factory, batch, strategies, **kw)

    monkeypatch.setattr(cost, "profile_together", tight)
    monkeypatch.setattr(cost, "default_profile_B", lambda device: (1, 2, 16))
    x, y = torch.randn(16, 32), torch.randint(0, 10, (16,))
    kw = dict(optimizer=lambda ps: torch.optim.SGD(ps, lr=0.1), device="cpu", steps=1, warmup=1, recompute=False,
              interleave=interleave, precisions=("fp32", "bf16"))
    with pytest.warns(UserWarning, match=r"the profiles at B = 16 \(B=16 fp32 and its variants\) do not fit cpu"):
        model = fit_cost_model(mlp, (x, y), **kw)
    assert sorted({p.strategy.B for p in model.profiles}) == [1, 2]     # in bf16 too: not tried again
    assert model.predict(Strategy(B=16))[0] > 0
    with pytest.raises(torch.OutOfMemoryError):
        fit_cost_model(mlp, (x, y), B_values=(1, 2, 16), **kw)
    monkeypatch.setattr(cost, "default_profile_B", lambda device: (1, 16))
    monkeypatch.setattr(cost, "_ALWAYS_PROFILED", 16)
    with pytest.raises(torch.OutOfMemoryError):
        fit_cost_model(mlp, (x, y), **kw)
